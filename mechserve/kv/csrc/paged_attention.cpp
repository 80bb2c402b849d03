// Paged attention for every item of a step (decode steps, speculative windows, prefill chunks), reading
// K/V straight from the page pool: no gathered copy of the context, no allocation per step beyond a
// small per-thread scratch.
//
// Layouts (see mechserve/kv/paged.py, which owns them):
//   q:        [T, H, D]              contiguous, the step's flat rows
//   k, v:     [P * S, KV, D]         one layer's pool, slot = page * S + offset
//   out:      [T, H, D]              only the rows of the items given are written
//   items:    [N, 4] int64           (first row, first position, query length, offset into tables)
//   tables:   int32                  each item's page table, concatenated
//
// One task per (short item, split) or per block of LONG_BLOCK query tokens of a long item (a prefill
// chunk): every query of the task (its tokens times H heads) runs over the context it can see, 16
// positions at a time, so a block of a prefill chunk reads each page once for all of its queries and
// stops at its last query's position (causal blocks are skipped, not masked).  All KV heads of a
// position are read together: a position's K (and V) rows of all heads are one contiguous KV * D run,
// and reading only one head's D of them per pass measured 2.3x slower here (the hardware prefetcher
// fetches the whole run anyway).  For each block: scores = scale * q . k (masked to each query's causal
// window), then the online softmax of Milakov & Gimelshein 2018 ("Online normalizer calculation for
// softmax"), as in FlashAttention (Dao et al. 2022) and vLLM's paged attention (Kwon et al. 2023):
// running max m, running sum l, accumulator rescaled by exp(m_old - m_new).  When there are fewer
// tasks than twice the threads (a batch of one or two decode steps), each short item's context is
// split into parts attended in parallel and the parts' (m, l, acc) are merged, as flash-decoding does
// (Dao et al. 2023, "Flash-Decoding for long-context inference").  Accumulation is float32 for every
// storage type.
//
// With AVX-512 and a head dimension of 32, 64 or 128, each block's scores of one query come out of one
// transposed sum of 16 dot products (bfloat16 ones by VDPBF16PS where the CPU has it), the softmax runs
// on 16 lanes, and the accumulators of a few queries stay in registers while each V row is loaded once
// for them; with AVX2 + FMA the same on 8 lanes, one query at a time; otherwise portable loops the
// compiler vectorises.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

struct Bf16 {
    uint16_t bits;
};

inline float load(float x) { return x; }
inline float load(Bf16 x) {
    uint32_t u = static_cast<uint32_t>(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(Bf16* p, float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
        p->bits = static_cast<uint16_t>((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    p->bits = static_cast<uint16_t>(u >> 16);
}

const float NEG_INF = -std::numeric_limits<float>::infinity();

// The queries of one task: float32 rows already multiplied by the scale, with their positions,
// grouped by KV head: query i of head h is row h * nq + i.  m, l: [KV * nq], acc: [KV * nq, D] hold
// their running softmax state.
struct Queries {
    const float* q;      // [KV * nq, D]
    const uint16_t* qb;  // the same rows as bfloat16, unscaled (bfloat16 queries), else null
    float scale;
    const int64_t* pos;  // [nq] (the same for every head)
    int64_t nq;
    float *m, *l, *acc;
};

// One part of one item's context: positions [lo, hi).
template <typename KT>
struct Context {
    const KT* k;
    const KT* v;
    const int32_t* table;
    int64_t KV, D, page_size, window;
    int64_t lo, hi;

    bool visible(int64_t t, int64_t pos) const { return t <= pos && (window <= 0 || t > pos - window); }
};

// Offsets (in elements) of consecutive positions' rows (all heads: KV * D elements), walking the
// page table without a division per position.
struct RowWalk {
    const int32_t* table;
    int64_t page_size, stride, page, off;
    RowWalk(const int32_t* tb, int64_t ps, int64_t stride_, int64_t t)
        : table(tb), page_size(ps), stride(stride_), page(t / ps), off(t % ps) {}
    int64_t next() {  // the current position's row offset, then step to the next position
        const int64_t r = (int64_t(table[page]) * page_size + off) * stride;
        if (++off == page_size) off = 0, ++page;
        return r;
    }
};

// The online-softmax update of one query for one page: scores s[0..w) (NEG_INF where masked) become
// weights in place; m, l and the accumulator's scale factor are returned through the references.
inline bool softmax_page(float* s, int64_t w, float& m, float& l, float& corr) {
    float bm = NEG_INF;
    for (int64_t t = 0; t < w; ++t) bm = std::max(bm, s[t]);
    if (bm == NEG_INF) {  // nothing visible on this page: weight 0 everywhere
        for (int64_t t = 0; t < w; ++t) s[t] = 0.f;
        corr = 1.f;
        return false;
    }
    const float mnew = std::max(m, bm);
    corr = std::exp(m - mnew);  // 0 on the first visible page
    float sum = 0.f;
    for (int64_t t = 0; t < w; ++t) {
        const float p = s[t] == NEG_INF ? 0.f : std::exp(s[t] - mnew);
        s[t] = p;
        sum += p;
    }
    l = l * corr + sum;
    m = mnew;
    return true;
}

// Portable path: every query of every head, page by page.  s: scratch [nq, page_size].
template <typename KT, int64_t DC>
void attend_portable(const Context<KT>& c, const Queries& qs, float* s) {
    const int64_t D = DC ? DC : c.D, S = c.page_size, stride = c.KV * D;
    for (int64_t t0 = c.lo - c.lo % S; t0 < c.hi; t0 += S) {
        const int64_t a = std::max(t0, c.lo), b = std::min(t0 + S, c.hi), w = b - a;
        const int64_t base = int64_t(c.table[t0 / S]) * S * stride;  // row of position t: base + (t - t0) * stride
        for (int64_t h = 0; h < c.KV; ++h) {
            const int64_t q0 = h * qs.nq;
            for (int64_t t = a; t < b; ++t) {
                const KT* kr = c.k + base + (t - t0) * stride + h * D;
                for (int64_t i = 0; i < qs.nq; ++i) {
                    float dot = NEG_INF;
                    if (c.visible(t, qs.pos[i])) {
                        const float* qr = qs.q + (q0 + i) * D;
                        float acc_dot = 0.f;
#pragma omp simd reduction(+ : acc_dot)
                        for (int64_t d = 0; d < D; ++d) acc_dot += qr[d] * load(kr[d]);
                        dot = acc_dot;
                    }
                    s[i * S + (t - a)] = dot;
                }
            }
            for (int64_t i = 0; i < qs.nq; ++i) {
                float corr;
                softmax_page(s + i * S, w, qs.m[q0 + i], qs.l[q0 + i], corr);
                float* ar = qs.acc + (q0 + i) * D;
                if (corr != 1.f)
                    for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
            }
            for (int64_t t = a; t < b; ++t) {
                const KT* vr = c.v + base + (t - t0) * stride + h * D;
                for (int64_t i = 0; i < qs.nq; ++i) {
                    const float p = s[i * S + (t - a)];
                    if (p == 0.f) continue;
                    float* ar = qs.acc + (q0 + i) * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) ar[d] += p * load(vr[d]);
                }
            }
        }
    }
}

// Loads one value of every cache line of the block's K and V rows (all heads), in address order,
// before the per-head passes read them with gaps: the gapped order alone ran at a third of the
// machine's read bandwidth (the prefetcher does not follow it; software prefetches did not help),
// this first sweep made the fp32 kernel 1.5x faster at batch 8.
template <typename KT>
inline void touch_rows(const KT* k, const KT* v, const int64_t* rows, int64_t w, int64_t stride) {
    constexpr int64_t LINE = 64 / sizeof(KT);
    float sum = 0.f;
    for (int64_t t = 0; t < w; ++t)
        for (int64_t o = 0; o < stride; o += LINE) sum += load(k[rows[t] + o]) + load(v[rows[t] + o]);
    volatile float sink = sum;  // keeps the loads
    (void)sink;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const Bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// The 16 horizontal sums of v[0..16) as one vector (lane i = sum of v[i]'s lanes): pairs of vectors
// are interleaved and added within 128-bit lanes, then the 128-bit lanes are transposed and added.
inline __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; ++i)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xee));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xdd));
}

// exp of 16 lanes: 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, Cody & Waite),
// p the degree-6 Taylor polynomial (|r| <= ln 2 / 2: relative error below 2e-7).  Lanes of -inf give
// 0 (scalef of a huge negative exponent); callers mask them anyway.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// Vector path: D = 16 * DV; positions are taken 16 at a time (wherever the pages put them), and for
// each KV head, its queries QB at a time: their accumulators are loaded into registers for the
// block, each V row of the block is loaded once for them, and they are stored back.
template <typename KT, int DV, int QB>
void attend_vector(const Context<KT>& c, const Queries& qs) {
    constexpr int64_t D = 16 * DV;
    const int64_t stride = c.KV * D;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    alignas(64) float p[QB][16];
    RowWalk walk(c.table, c.page_size, stride, c.lo);
    for (int64_t t0 = c.lo; t0 < c.hi; t0 += 16) {
        const int64_t w = std::min<int64_t>(16, c.hi - t0);
        int64_t rows[16];
        for (int64_t t = 0; t < w; ++t) rows[t] = walk.next();
        for (int64_t t = w; t < 16; ++t) rows[t] = rows[w - 1];
        touch_rows(c.k, c.v, rows, w, stride);
        const __m512i tpos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(t0)), lane);
        const __mmask16 inside = static_cast<__mmask16>(w == 16 ? 0xffffu : (1u << w) - 1u);
        for (int64_t h = 0; h < c.KV; ++h) {
            const KT* kb = c.k + h * D;
            const KT* vb = c.v + h * D;
            for (int64_t q0 = 0; q0 < qs.nq; q0 += QB) {
                const int64_t nc = std::min<int64_t>(QB, qs.nq - q0), base = h * qs.nq + q0;
                bool any = false;
                float corr[QB];
                for (int i = 0; i < QB; ++i) {
                    if (i >= nc) break;
                    const int64_t pos = qs.pos[q0 + i];
                    __mmask16 vis = inside & _mm512_cmple_epi32_mask(tpos, _mm512_set1_epi32(static_cast<int>(pos)));
                    if (c.window > 0)
                        vis &= _mm512_cmpgt_epi32_mask(tpos, _mm512_set1_epi32(static_cast<int>(pos - c.window)));
                    corr[i] = 1.f;
                    if (!vis) {
                        _mm512_store_ps(p[i], _mm512_setzero_ps());
                        continue;
                    }
                    __m512 prod[16], dots;
#if defined(__AVX512BF16__)
                    if constexpr (std::is_same_v<KT, Bf16>) {
                        // bfloat16 pairs multiplied exactly by VDPBF16PS, the scale applied to the 16 sums
                        const uint16_t* qr = qs.qb + (base + i) * D;
                        __m512bh qv[DV / 2];
                        for (int d = 0; d < DV / 2; ++d) qv[d] = (__m512bh)_mm512_loadu_si512(qr + 32 * d);
                        for (int t = 0; t < 16; ++t) {
                            const KT* kr = kb + rows[t];
                            __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kr));
                            for (int d = 1; d < DV / 2; ++d)
                                x = _mm512_dpbf16_ps(x, qv[d], (__m512bh)_mm512_loadu_si512(kr + 32 * d));
                            prod[t] = x;
                        }
                        dots = _mm512_mul_ps(sum16(prod), _mm512_set1_ps(qs.scale));
                    } else
#endif
                    {
                        const float* qr = qs.q + (base + i) * D;
                        __m512 qv[DV];
                        for (int d = 0; d < DV; ++d) qv[d] = _mm512_loadu_ps(qr + 16 * d);
                        for (int t = 0; t < 16; ++t) {
                            const KT* kr = kb + rows[t];
                            __m512 x = _mm512_mul_ps(qv[0], load16(kr));
                            for (int d = 1; d < DV; ++d) x = _mm512_fmadd_ps(qv[d], load16(kr + 16 * d), x);
                            prod[t] = x;
                        }
                        dots = sum16(prod);
                    }
                    const __m512 sc = _mm512_mask_blend_ps(vis, _mm512_set1_ps(NEG_INF), dots);
                    float& m = qs.m[base + i];
                    const float mnew = std::max(m, _mm512_reduce_max_ps(sc));
                    // (exp16, not std::exp: a call into libm would spill every live vector register)
                    corr[i] = m == NEG_INF ? 0.f : _mm512_cvtss_f32(exp16(_mm512_set1_ps(m - mnew)));
                    const __m512 e = _mm512_maskz_mov_ps(vis, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mnew))));
                    _mm512_store_ps(p[i], e);
                    qs.l[base + i] = qs.l[base + i] * corr[i] + _mm512_reduce_add_ps(e);
                    m = mnew;
                    any = true;
                }
                if (!any) continue;
                __m512 ar[QB][DV];
                for (int i = 0; i < QB; ++i) {
                    if (i >= nc) break;
                    const __m512 cv = _mm512_set1_ps(corr[i]);
                    for (int d = 0; d < DV; ++d)
                        ar[i][d] = _mm512_mul_ps(_mm512_loadu_ps(qs.acc + (base + i) * D + 16 * d), cv);
                }
                for (int64_t t = 0; t < w; ++t) {
                    const KT* vr = vb + rows[t];
                    __m512 vv[DV];
                    for (int d = 0; d < DV; ++d) vv[d] = load16(vr + 16 * d);
                    for (int i = 0; i < QB; ++i) {
                        if (i >= nc) break;
                        if (p[i][t] == 0.f) continue;  // masked (or nothing visible): its V row may be a NaN
                        const __m512 pt = _mm512_set1_ps(p[i][t]);
                        for (int d = 0; d < DV; ++d) ar[i][d] = _mm512_fmadd_ps(pt, vv[d], ar[i][d]);
                    }
                }
                for (int i = 0; i < QB; ++i) {
                    if (i >= nc) break;
                    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(qs.acc + (base + i) * D + 16 * d, ar[i][d]);
                }
            }
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX2 path: the AVX-512 one's shape on 8 lanes.  Positions are taken 8 at a time; each query's 8
// scores come out of one transposed sum of 8 dot products, its softmax runs on 8 lanes, and its
// accumulator (8 vectors at a time) stays in registers while the block's V rows are added into it.
// Each query is computed on its own, so a query's output does not depend on the queries beside it.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Bf16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// The 8 horizontal sums of v[0..8) as one vector (lane i = sum of v[i]'s lanes).
inline __m256 sum8(const __m256 v[8]) {
    const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp of 8 lanes as exp16 does it, with 2^n built in the exponent bits; x is clamped at -87 so that n
// stays a normal exponent (exp(-87) is 1.6e-38: a weight that small is 0 beside the block's largest, 1).
inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// D = 8 * DV.
template <typename KT, int DV>
void attend_vector(const Context<KT>& c, const Queries& qs) {
    constexpr int64_t D = 8 * DV;
    constexpr int DC = DV < 8 ? DV : 8;  // accumulator vectors held in registers at a time
    const int64_t stride = c.KV * D;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 neg_inf = _mm256_set1_ps(NEG_INF);
    alignas(32) float p[8];
    RowWalk walk(c.table, c.page_size, stride, c.lo);
    for (int64_t t0 = c.lo; t0 < c.hi; t0 += 8) {
        const int64_t w = std::min<int64_t>(8, c.hi - t0);
        int64_t rows[8];
        for (int64_t t = 0; t < w; ++t) rows[t] = walk.next();
        for (int64_t t = w; t < 8; ++t) rows[t] = rows[w - 1];
        touch_rows(c.k, c.v, rows, w, stride);
        const __m256i tpos = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(t0)), lane);
        const __m256i inside = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(w)), lane);
        for (int64_t h = 0; h < c.KV; ++h) {
            const KT* kb = c.k + h * D;
            const KT* vb = c.v + h * D;
            for (int64_t i = 0; i < qs.nq; ++i) {
                const int64_t pos = qs.pos[i], qi = h * qs.nq + i;
                __m256i vis = _mm256_and_si256(inside, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(pos + 1)), tpos));
                if (c.window > 0)
                    vis = _mm256_and_si256(vis, _mm256_cmpgt_epi32(tpos, _mm256_set1_epi32(static_cast<int>(pos - c.window))));
                if (_mm256_testz_si256(vis, vis)) continue;  // nothing visible: weight 0, the state unchanged
                const __m256 visf = _mm256_castsi256_ps(vis);
                const float* qr = qs.q + qi * D;
                __m256 prod[8];
                for (int t = 0; t < 8; ++t) {
                    const KT* kr = kb + rows[t];
                    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(qr), load8(kr));
                    for (int d = 1; d < DV; ++d) x = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * d), load8(kr + 8 * d), x);
                    prod[t] = x;
                }
                const __m256 sc = _mm256_blendv_ps(neg_inf, sum8(prod), visf);
                float& m = qs.m[qi];
                const float mnew = std::max(m, hmax8(sc));
                const float corr = m == NEG_INF ? 0.f : _mm256_cvtss_f32(exp8(_mm256_set1_ps(m - mnew)));
                const __m256 e = _mm256_and_ps(visf, exp8(_mm256_sub_ps(sc, _mm256_set1_ps(mnew))));
                _mm256_store_ps(p, e);
                qs.l[qi] = qs.l[qi] * corr + hsum8(e);
                m = mnew;
                float* ar = qs.acc + qi * D;
                const __m256 cv = _mm256_set1_ps(corr);
                for (int d0 = 0; d0 < DV; d0 += DC) {
                    __m256 a[DC];
                    for (int d = 0; d < DC; ++d) a[d] = _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * (d0 + d)), cv);
                    for (int64_t t = 0; t < w; ++t) {
                        if (p[t] == 0.f) continue;  // masked: its V row may hold anything, even a NaN (0 * NaN)
                        const KT* vr = vb + rows[t] + 8 * d0;
                        const __m256 pt = _mm256_set1_ps(p[t]);
                        for (int d = 0; d < DC; ++d) a[d] = _mm256_fmadd_ps(pt, load8(vr + 8 * d), a[d]);
                    }
                    for (int d = 0; d < DC; ++d) _mm256_storeu_ps(ar + 8 * (d0 + d), a[d]);
                }
            }
        }
    }
}
#endif

template <typename KT>
void attend(const Context<KT>& c, const Queries& qs, float* s) {
#if defined(__AVX512F__)
    if (c.D == 64) return attend_vector<KT, 4, 3>(c, qs);
    if (c.D == 128) return attend_vector<KT, 8, 2>(c, qs);
    if (c.D == 32) return attend_vector<KT, 2, 4>(c, qs);
#elif defined(__AVX2__) && defined(__FMA__)
    if (c.D == 64) return attend_vector<KT, 8>(c, qs);
    if (c.D == 128) return attend_vector<KT, 16>(c, qs);
    if (c.D == 32) return attend_vector<KT, 4>(c, qs);
#endif
    if (c.D == 64) return attend_portable<KT, 64>(c, qs, s);
    if (c.D == 128) return attend_portable<KT, 128>(c, qs, s);
    attend_portable<KT, 0>(c, qs, s);
}

// One task: tokens [j0, j1) of one item, attending context part `split` of `splits` (a short item split
// across threads) or, for a long item (a prefill chunk), its whole visible context; `part` indexes the
// split partial results.
struct Task {
    int64_t item, j0, j1, split, splits, part;
};

// Query tokens per task of a long item: its queries (times G heads) share each block of K/V read.
constexpr int64_t LONG_BLOCK = 32;

template <typename QT, typename KT>
void run(const QT* q, KT* k, KT* v, QT* out, const int64_t* items, const int32_t* tables, int64_t n_items,
         int64_t H, int64_t KV, int64_t D, int64_t page_size, int64_t window, float scale, int n_threads,
         const KT* k_new, const KT* v_new, const int64_t* slots, int64_t n_new) {
    // The step's own K/V rows go into their slots first, so every query sees them.  The caller checked the
    // slots (see the entry points).
    for (int64_t r = 0; r < n_new; ++r) {
        std::memcpy(k + slots[r] * KV * D, k_new + r * KV * D, sizeof(KT) * KV * D);
        std::memcpy(v + slots[r] * KV * D, v_new + r * KV * D, sizeof(KT) * KV * D);
    }
    const int64_t G = H / KV;
    // Short items (decode steps, speculative windows) are one task each, split across the context when
    // there are too few tasks for the threads (a batch of one or two); a long item is a task per block of
    // LONG_BLOCK query tokens, each reading the context its causal window needs.
    int64_t n_short = 0, n_long_tasks = 0, max_n = 0;
    for (int64_t i = 0; i < n_items; ++i) {
        const int64_t n = items[4 * i + 2];
        if (n <= LONG_BLOCK) ++n_short, max_n = std::max(max_n, n);
        else n_long_tasks += (n + LONG_BLOCK - 1) / LONG_BLOCK, max_n = std::max(max_n, LONG_BLOCK);
    }
    const int64_t total = n_short + n_long_tasks;
    const int64_t splits = total >= 2 * n_threads || n_short == 0 ? 1 : std::min<int64_t>(8, (2 * n_threads + total - 1) / total);
    std::vector<Task> tasks;
    tasks.reserve(static_cast<size_t>(n_short * splits + n_long_tasks));
    std::vector<int64_t> first_part(static_cast<size_t>(n_items), -1);
    int64_t n_parts = 0;
    // the long items' blocks first, latest (largest context) first, so the threads end together
    for (int64_t i = 0; i < n_items; ++i) {
        const int64_t n = items[4 * i + 2];
        if (n > LONG_BLOCK)
            for (int64_t j0 = (n - 1) / LONG_BLOCK * LONG_BLOCK; j0 >= 0; j0 -= LONG_BLOCK)
                tasks.push_back({i, j0, std::min(n, j0 + LONG_BLOCK), 0, 1, -1});
    }
    for (int64_t i = 0; i < n_items; ++i) {
        const int64_t n = items[4 * i + 2];
        if (n > LONG_BLOCK) continue;
        if (splits > 1) first_part[i] = n_parts, n_parts += splits;
        for (int64_t sp = 0; sp < splits; ++sp) tasks.push_back({i, 0, n, sp, splits, splits > 1 ? first_part[i] + sp : -1});
    }
    const int64_t max_q = max_n * G;  // queries per KV head of a task: (token j, head g) at j * G + g
    // each split's partial result: m [KV * max_q], l [KV * max_q], acc [KV * max_q, D]
    const int64_t part = KV * max_q * (D + 2);
    std::vector<float> parts(static_cast<size_t>(n_parts * part));
    const int64_t n_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel num_threads(n_threads)
    {
        std::vector<float> qf(static_cast<size_t>(KV * max_q * D)), s(static_cast<size_t>(max_q * page_size));
        std::vector<float> m(KV * max_q), l(KV * max_q), acc(static_cast<size_t>(KV * max_q * D));
        std::vector<int64_t> pos(max_q);
        std::vector<uint16_t> qb(std::is_same_v<QT, Bf16> ? static_cast<size_t>(KV * max_q * D) : 0);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n_tasks; ++t) {
            const Task& task = tasks[t];
            const int64_t* it = items + 4 * task.item;
            const int64_t row0 = it[0] + task.j0, start = it[1] + task.j0, n = task.j1 - task.j0, nq = n * G;
            for (int64_t h = 0; h < KV; ++h)
                for (int64_t j = 0; j < n; ++j)
                    for (int64_t g = 0; g < G; ++g) {
                        const QT* src = q + ((row0 + j) * H + h * G + g) * D;
                        float* dst = qf.data() + (h * nq + j * G + g) * D;
                        for (int64_t d = 0; d < D; ++d) dst[d] = load(src[d]) * scale;
                        if constexpr (std::is_same_v<QT, Bf16>)
                            std::memcpy(qb.data() + (h * nq + j * G + g) * D, src, sizeof(QT) * D);
                        pos[j * G + g] = start + j;
                    }
            const int64_t end = start + n;
            const int64_t first = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
            // split boundaries on page edges, so each page is read by one task
            const int64_t p0 = first / page_size, p1 = (end + page_size - 1) / page_size;
            const int64_t per = (p1 - p0 + task.splits - 1) / task.splits;
            const int64_t lo = std::max(first, (p0 + task.split * per) * page_size);
            const int64_t hi = std::min(end, (p0 + (task.split + 1) * per) * page_size);
            std::fill(m.begin(), m.begin() + KV * nq, NEG_INF);
            std::fill(l.begin(), l.begin() + KV * nq, 0.f);
            std::fill(acc.begin(), acc.begin() + KV * nq * D, 0.f);
            if (lo < hi) {
                const Context<KT> c{k, v, tables + it[3], KV, D, page_size, window, lo, hi};
                const Queries qs{qf.data(), qb.empty() ? nullptr : qb.data(), scale, pos.data(), nq, m.data(), l.data(), acc.data()};
                attend(c, qs, s.data());
            }
            if (task.part < 0) {
                for (int64_t h = 0; h < KV; ++h)
                    for (int64_t i = 0; i < nq; ++i) {
                        const int64_t qi = h * nq + i, j = i / G, g = i % G;
                        const float inv = l[qi] > 0.f ? 1.f / l[qi] : 0.f;
                        QT* dst = out + ((row0 + j) * H + h * G + g) * D;
                        for (int64_t d = 0; d < D; ++d) store(dst + d, acc[qi * D + d] * inv);
                    }
            } else {
                float* mine = parts.data() + task.part * part;
                std::copy(m.begin(), m.begin() + KV * nq, mine);
                std::copy(l.begin(), l.begin() + KV * nq, mine + KV * max_q);
                std::copy(acc.begin(), acc.begin() + KV * nq * D, mine + 2 * KV * max_q);
            }
        }
        if (n_parts > 0) {
            // merge the parts of each (item, head, query) with weights exp(m_s - M)
            std::vector<float> merged(static_cast<size_t>(D));
#pragma omp for schedule(static)
            for (int64_t item = 0; item < n_items; ++item) {
                if (first_part[item] < 0) continue;
                const int64_t* it = items + 4 * item;
                const int64_t row0 = it[0], nq = it[2] * G;
                const float* p0 = parts.data() + first_part[item] * part;
                for (int64_t qi = 0; qi < KV * nq; ++qi) {
                    float big = NEG_INF;
                    for (int64_t sp = 0; sp < splits; ++sp) big = std::max(big, p0[sp * part + qi]);
                    float total_l = 0.f;
                    std::fill(merged.begin(), merged.end(), 0.f);
                    if (big != NEG_INF)
                        for (int64_t sp = 0; sp < splits; ++sp) {
                            const float* pp = p0 + sp * part;
                            if (pp[qi] == NEG_INF) continue;
                            const float wgt = std::exp(pp[qi] - big);
                            total_l += wgt * pp[KV * max_q + qi];
                            const float* pa = pp + 2 * KV * max_q + qi * D;
                            for (int64_t d = 0; d < D; ++d) merged[d] += wgt * pa[d];
                        }
                    const float inv = total_l > 0.f ? 1.f / total_l : 0.f;
                    const int64_t h = qi / nq, j = (qi % nq) / G, g = (qi % nq) % G;
                    QT* dst = out + ((row0 + j) * H + h * G + g) * D;
                    for (int64_t d = 0; d < D; ++d) store(dst + d, merged[d] * inv);
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// Returns the ABI version; the loader refuses a library that does not match.
int mechserve_paged_attention_abi(void) { return 3; }

// Whether every slot is a row of a pool of pool_rows rows.
bool slots_fit(const int64_t* slots, int64_t n_new, int64_t pool_rows) {
    for (int64_t r = 0; r < n_new; ++r)
        if (slots[r] < 0 || slots[r] >= pool_rows) return false;
    return true;
}

// First writes the step's n_new K/V rows (k_new, v_new: [n_new, KV, D]) at `slots` ([n_new] int64) of
// the pools k, v ([pool_rows, KV, D]), then attends the items.  Returns 0, or -1 (writing and
// attending nothing) when a slot is not a row of the pool.
int mechserve_paged_attention_f32(const float* q, float* k, float* v, float* out, const int64_t* items,
                                  const int32_t* tables, int64_t n_items, int64_t H, int64_t KV, int64_t D,
                                  int64_t page_size, int64_t window, float scale, int n_threads, const float* k_new,
                                  const float* v_new, const int64_t* slots, int64_t n_new, int64_t pool_rows) {
    if (!slots_fit(slots, n_new, pool_rows)) return -1;
    run<float, float>(q, k, v, out, items, tables, n_items, H, KV, D, page_size, window, scale, n_threads, k_new,
                      v_new, slots, n_new);
    return 0;
}

int mechserve_paged_attention_bf16(const void* q, void* k, void* v, void* out, const int64_t* items,
                                   const int32_t* tables, int64_t n_items, int64_t H, int64_t KV, int64_t D,
                                   int64_t page_size, int64_t window, float scale, int n_threads, const void* k_new,
                                   const void* v_new, const int64_t* slots, int64_t n_new, int64_t pool_rows) {
    if (!slots_fit(slots, n_new, pool_rows)) return -1;
    run<Bf16, Bf16>(static_cast<const Bf16*>(q), static_cast<Bf16*>(k), static_cast<Bf16*>(v),
                    static_cast<Bf16*>(out), items, tables, n_items, H, KV, D, page_size, window, scale, n_threads,
                    static_cast<const Bf16*>(k_new), static_cast<const Bf16*>(v_new), slots, n_new);
    return 0;
}

}  // extern "C"
