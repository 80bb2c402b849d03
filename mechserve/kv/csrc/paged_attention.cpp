// Paged attention for short query runs (decode steps and speculative windows), reading each KV
// page once, straight from the page pool: no gathered copy of the context, no allocation per step
// beyond a small per-thread scratch.
//
// Layouts (see mechserve/backends/paged_kv.py, which owns them):
//   q:        [T, H, D]              contiguous, the step's flat rows
//   k, v:     [P * S, KV, D]         one layer's pool, slot = page * S + offset
//   out:      [T, H, D]              only the rows of the items given are written
//   items:    [N, 4] int64           (first row, first position, query length, offset into tables)
//   tables:   int32                  each item's page table, concatenated
//
// One task per (item, KV head): its G = H / KV query heads times its query length run together
// over the item's context, page by page.  For each page: scores = scale * q . k (masked to the
// query's causal window), then the online softmax of Milakov & Gimelshein 2018 ("Online normalizer
// calculation for softmax"), as in FlashAttention (Dao et al. 2022) and vLLM's paged attention
// (Kwon et al. 2023): running max m, running sum l, accumulator rescaled by exp(m_old - m_new).
// Accumulation is float32 for every storage type.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

// DC: the head dimension when known at compile time (0 = use D), so the inner loops unroll.
template <typename QT, typename KT, int64_t DC>
void run(const QT* q, const KT* k, const KT* v, QT* out, const int64_t* items, const int32_t* tables,
         int64_t n_items, int64_t H, int64_t KV, int64_t D_, int64_t page_size, int64_t window, float scale,
         int n_threads) {
    const int64_t D = DC ? DC : D_;
    const int64_t G = H / KV;
    const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel num_threads(n_threads)
    {
        std::vector<float> qf, m, l, acc, s;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n_items * KV; ++task) {
            const int64_t* it = items + 4 * (task / KV);
            const int64_t h = task % KV;
            const int64_t row0 = it[0], start = it[1], n = it[2];
            const int32_t* table = tables + it[3];
            const int64_t nq = n * G;  // query (j, g) at index j * G + g
            qf.assign(nq * D, 0.f);
            m.assign(nq, neg_inf);
            l.assign(nq, 0.f);
            acc.assign(nq * D, 0.f);
            s.assign(nq * page_size, neg_inf);
            for (int64_t j = 0; j < n; ++j)
                for (int64_t g = 0; g < G; ++g) {
                    const QT* src = q + ((row0 + j) * H + h * G + g) * D;
                    float* dst = qf.data() + (j * G + g) * D;
                    for (int64_t d = 0; d < D; ++d) dst[d] = load(src[d]) * scale;
                }
            const int64_t end = start + n;  // positions [lo, end) are read
            const int64_t lo = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
            for (int64_t t0 = lo - lo % page_size; t0 < end; t0 += page_size) {
                const int64_t base = static_cast<int64_t>(table[t0 / page_size]) * page_size;
                const int64_t a = std::max(t0, lo), b = std::min(t0 + page_size, end);
                // scores for this page
                for (int64_t t = a; t < b; ++t) {
                    const KT* kr = k + ((base + t - t0) * KV + h) * D;
                    for (int64_t j = 0; j < n; ++j) {
                        const int64_t pos = start + j;
                        const bool visible = t <= pos && (window <= 0 || t > pos - window);
                        for (int64_t g = 0; g < G; ++g) {
                            const int64_t qi = j * G + g;
                            float dot = neg_inf;
                            if (visible) {
                                const float* qr = qf.data() + qi * D;
                                float acc_dot = 0.f;
#pragma omp simd reduction(+ : acc_dot)
                                for (int64_t d = 0; d < D; ++d) acc_dot += qr[d] * load(kr[d]);
                                dot = acc_dot;
                            }
                            s[qi * page_size + (t - a)] = dot;
                        }
                    }
                }
                // online softmax update, then the weighted values
                const int64_t w = b - a;
                for (int64_t qi = 0; qi < nq; ++qi) {
                    float* sr = s.data() + qi * page_size;
                    float bm = neg_inf;
                    for (int64_t t = 0; t < w; ++t) bm = std::max(bm, sr[t]);
                    if (bm == neg_inf) {  // nothing visible on this page: weight 0 everywhere
                        for (int64_t t = 0; t < w; ++t) sr[t] = 0.f;
                        continue;
                    }
                    const float mnew = std::max(m[qi], bm);
                    const float corr = std::exp(m[qi] - mnew);  // 0 on the first visible page
                    float sum = 0.f;
                    for (int64_t t = 0; t < w; ++t) {
                        const float p = sr[t] == neg_inf ? 0.f : std::exp(sr[t] - mnew);
                        sr[t] = p;
                        sum += p;
                    }
                    l[qi] = l[qi] * corr + sum;
                    m[qi] = mnew;
                    float* ar = acc.data() + qi * D;
                    if (corr != 1.f)
                        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
                }
                for (int64_t t = a; t < b; ++t) {
                    const KT* vr = v + ((base + t - t0) * KV + h) * D;
                    for (int64_t qi = 0; qi < nq; ++qi) {
                        const float p = s[qi * page_size + (t - a)];
                        if (p == 0.f) continue;
                        float* ar = acc.data() + qi * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d) ar[d] += p * load(vr[d]);
                    }
                }
            }
            for (int64_t j = 0; j < n; ++j)
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t qi = j * G + g;
                    const float inv = l[qi] > 0.f ? 1.f / l[qi] : 0.f;
                    QT* dst = out + ((row0 + j) * H + h * G + g) * D;
                    const float* ar = acc.data() + qi * D;
                    for (int64_t d = 0; d < D; ++d) store(dst + d, ar[d] * inv);
                }
        }
    }
}

template <typename QT, typename KT>
void dispatch(const QT* q, const KT* k, const KT* v, QT* out, const int64_t* items, const int32_t* tables,
              int64_t n_items, int64_t H, int64_t KV, int64_t D, int64_t page_size, int64_t window, float scale,
              int n_threads) {
    if (D == 64)
        run<QT, KT, 64>(q, k, v, out, items, tables, n_items, H, KV, D, page_size, window, scale, n_threads);
    else if (D == 128)
        run<QT, KT, 128>(q, k, v, out, items, tables, n_items, H, KV, D, page_size, window, scale, n_threads);
    else
        run<QT, KT, 0>(q, k, v, out, items, tables, n_items, H, KV, D, page_size, window, scale, n_threads);
}

}  // namespace

extern "C" {

// Returns the ABI version; the loader refuses a library that does not match.
int mechserve_paged_attention_abi(void) { return 1; }

void mechserve_paged_attention_f32(const float* q, const float* k, const float* v, float* out,
                                   const int64_t* items, const int32_t* tables, int64_t n_items, int64_t H,
                                   int64_t KV, int64_t D, int64_t page_size, int64_t window, float scale,
                                   int n_threads) {
    dispatch<float, float>(q, k, v, out, items, tables, n_items, H, KV, D, page_size, window, scale, n_threads);
}

void mechserve_paged_attention_bf16(const void* q, const void* k, const void* v, void* out, const int64_t* items,
                                    const int32_t* tables, int64_t n_items, int64_t H, int64_t KV, int64_t D,
                                    int64_t page_size, int64_t window, float scale, int n_threads) {
    dispatch<Bf16, Bf16>(static_cast<const Bf16*>(q), static_cast<const Bf16*>(k), static_cast<const Bf16*>(v),
                    static_cast<Bf16*>(out), items, tables, n_items, H, KV, D, page_size, window, scale, n_threads);
}

}  // extern "C"
