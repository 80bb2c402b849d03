// Matrix products for few rows (decode steps), reading each weight once, in the layout it is stored:
// float32, bfloat16, or the GGUF blocks Q4_1 and Q8_0, which are never expanded to a float copy.
//
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])      x: [M, K], w: [N, K] (torch's F.linear)
//
// At a few rows the product is bound by reading w, so the loop is arranged around that read: each
// thread takes a contiguous range of output rows, and a tile of weight rows is read once from memory
// while every activation row (kept in L1) is multiplied against it.  Accumulation is float32 for
// every storage type; bias is added in float32 and the result rounded once to the output type.
//
// Block formats (ggml's, as GGUF stores them; 32 weights per block):
//   Q4_1: { fp16 d; fp16 m; uint8 qs[16] }   w[j] = d * q[j] + m, q[j] = low nibble of qs[j] (j < 16)
//                                             or high nibble of qs[j - 16] (j >= 16)
//   Q8_0: { fp16 d; int8 qs[32] }            w[j] = d * qs[j]
// A Q4_1 block's dot product is d * (q . x) + m * sum(x), so the sums of x per block are taken once
// per call.  The AVX-512 block loop widens a block's 32 weights to two float vectors (one byte-to-int32
// expansion, for Q4_1 then split into nibbles by an AND and a shift, and two conversions) and its fp16
// head with one 4-value conversion.  At one activation row each block adds d * (q . x) into one of two
// accumulators (alternate blocks, hiding the FMA latency); from two rows on, q is scaled by d once and
// shared by every row.  The Q4_1 mins are kept per 16 blocks and their m * sum(x) added with one
// vector FMA against the block sums.  Q4_1 rows go two at a time, sharing each activation load.
//
// Paths: with AVX-512 (and AVX512-BF16 for bfloat16 weights times bfloat16 activations, the VDPBF16PS
// dot product), else portable loops the compiler vectorises.  Threads: OpenMP, on the runtime torch
// already loaded (libgomp by soname), `n_threads` of them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// Activation buffers start on a 64-byte line, so the kernels' 64-byte loads of each row (K a multiple of 16
// floats) never straddle two lines: std::vector's default 16-byte alignment cost 25-40% at 8 rows.
template <typename T>
struct LineAligned {
    using value_type = T;
    LineAligned() = default;
    template <typename U>
    LineAligned(const LineAligned<U>&) {}
    T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
    void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
    template <typename U>
    bool operator==(const LineAligned<U>&) const { return true; }
};
template <typename T>
using Buffer = std::vector<T, LineAligned<T>>;

enum Type : int { F32 = 0, BF16 = 1, Q4_1 = 2, Q8_0 = 3 };
constexpr int64_t QK = 32;  // weights per quantized block

struct BlockQ4_1 {
    uint16_t d, m;
    uint8_t qs[QK / 2];
};
struct BlockQ8_0 {
    uint16_t d;
    int8_t qs[QK];
};
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block is 20 bytes");
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block is 34 bytes");

inline float bf16_to_float(uint16_t bits) {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even, as torch does
    return static_cast<uint16_t>(u >> 16);
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do {
            ++e;
            man <<= 1;
        } while (!(man & 0x400u));
        u = sign | ((112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
}

inline float load_value(const void* p, int type, int64_t i) {
    return type == F32 ? static_cast<const float*>(p)[i] : bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

inline void store_value(void* p, int type, int64_t i, float v) {
    if (type == F32)
        static_cast<float*>(p)[i] = v;
    else
        static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
}

// Output rows [n0, n1) of one call, as float32 partial results `acc[m * ldacc + (n - n0)]`.
struct Job {
    const float* xf;      // [M, K] activations as float32
    const uint16_t* xb;   // [M, K] activations as bfloat16 (only for bf16 x bf16), else nullptr
    const float* xsum;    // [M, K / 32] per-block sums of x (Q4_1 only)
    const void* w;
    int64_t M, K;
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 load16_tail(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16_tail(const uint16_t* p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

// R weight rows (float32 or bfloat16) against MC activation rows.  One row at a time (R = 1) reads
// the weights as a single stream, which measured 30% faster than a stream per row of a tile at one
// activation row; from 4 activation rows on, two weight rows share each activation load (R = 2).
// U independent partial sums per activation row hide the FMA latency when MC is small.
template <typename WT, int MC, int R>
void dense_row(const Job& j, const WT* const* rows, int64_t m0, float out[][8]) {
    constexpr int U = MC == 1 ? 4 : MC == 2 ? 2 : 1;
    const int64_t K = j.K;
    const float* x = j.xf + m0 * K;
    __m512 acc[R][MC][U];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MC; ++m)
            for (int u = 0; u < U; ++u) acc[r][m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U)
        for (int u = 0; u < U; ++u) {
            __m512 wv[R];
            for (int r = 0; r < R; ++r) wv[r] = load16(rows[r] + k + 16 * u);
            for (int m = 0; m < MC; ++m) {
                const __m512 xv = _mm512_loadu_ps(x + m * K + k + 16 * u);
                for (int r = 0; r < R; ++r) acc[r][m][u] = _mm512_fmadd_ps(wv[r], xv, acc[r][m][u]);
            }
        }
    for (; k < K; k += 16) {
        const __mmask16 mask = static_cast<__mmask16>(K - k >= 16 ? 0xffffu : (1u << (K - k)) - 1u);
        __m512 wv[R];
        for (int r = 0; r < R; ++r) wv[r] = load16_tail(rows[r] + k, mask);
        for (int m = 0; m < MC; ++m) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
            for (int r = 0; r < R; ++r) acc[r][m][0] = _mm512_fmadd_ps(wv[r], xv, acc[r][m][0]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MC; ++m) {
            __m512 a = acc[r][m][0];
            for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[r][m][u]);
            out[r][m] = _mm512_reduce_add_ps(a);
        }
}

#if defined(__AVX512BF16__)
// R bfloat16 weight rows against MC bfloat16 activation rows: VDPBF16PS multiplies 32 pairs exactly
// and adds them into 16 float32 lanes.
template <int MC, int R>
void bf16_dot_row(const Job& j, const uint16_t* const* rows, int64_t m0, float out[][8]) {
    constexpr int U = MC == 1 ? 4 : MC == 2 ? 2 : 1;
    const int64_t K = j.K;
    const uint16_t* x = j.xb + m0 * K;
    __m512 acc[R][MC][U];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MC; ++m)
            for (int u = 0; u < U; ++u) acc[r][m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U)
        for (int u = 0; u < U; ++u) {
            __m512bh wv[R];
            for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(rows[r] + k + 32 * u);
            for (int m = 0; m < MC; ++m) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u);
                for (int r = 0; r < R; ++r) acc[r][m][u] = _mm512_dpbf16_ps(acc[r][m][u], wv[r], xv);
            }
        }
    for (; k < K; k += 32) {
        const __mmask32 mask = static_cast<__mmask32>(K - k >= 32 ? 0xffffffffu : (1u << (K - k)) - 1u);
        __m512bh wv[R];
        for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[r] + k);
        for (int m = 0; m < MC; ++m) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
            for (int r = 0; r < R; ++r) acc[r][m][0] = _mm512_dpbf16_ps(acc[r][m][0], wv[r], xv);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MC; ++m) {
            __m512 a = acc[r][m][0];
            for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[r][m][u]);
            out[r][m] = _mm512_reduce_add_ps(a);
        }
}
#endif

// A block's head widened: its first 4 fp16 values at once (lane 0 d, lane 1 Q4_1's m).
template <typename BT>
inline __m128 block_head(const BT& b) {
    return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)&b));
}

// The q values of one block's 32 weights as floats: lo = weights 0..15, hi = 16..31.
inline void block_values(const BlockQ4_1& b, __m512& lo, __m512& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)b.qs));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
inline void block_values(const BlockQ8_0& b, __m512& lo, __m512& hi) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)b.qs)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b.qs + 16))));
}

// R quantized weight rows against MC activation rows (K a multiple of 32), in chunks of 16 blocks.
template <typename BT, int MC, int R>
void quant_row(const Job& j, const BT* const* rows, int64_t m0, float out[][8]) {
    constexpr bool q4 = sizeof(BT) == sizeof(BlockQ4_1);
    constexpr int A = MC <= 4 ? 2 : 1;  // accumulators per (weight row, activation row)
    const int64_t nb = j.K / QK, K = j.K;
    const float* x = j.xf + m0 * K;
    __m512 acc[R][MC][A];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MC; ++m)
            for (int a = 0; a < A; ++a) acc[r][m][a] = _mm512_setzero_ps();
    alignas(64) float mins[R][16];
    for (int64_t i0 = 0; i0 < nb; i0 += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, nb - i0));
        const float* xb = x + i0 * QK;
        if constexpr (MC == 1) {
            // d * (q . x), alternate blocks into the two accumulators.
            const auto block = [&](int e, int a) {
                __m512 lo[R], hi[R];
                for (int r = 0; r < R; ++r) block_values(rows[r][i0 + e], lo[r], hi[r]);
                const __m512 xl = _mm512_loadu_ps(xb + e * QK), xh = _mm512_loadu_ps(xb + e * QK + 16);
                for (int r = 0; r < R; ++r) {
                    const __m128 h = block_head(rows[r][i0 + e]);
                    if constexpr (q4) mins[r][e] = _mm_cvtss_f32(_mm_movehdup_ps(h));
                    const __m512 t = _mm512_fmadd_ps(hi[r], xh, _mm512_mul_ps(lo[r], xl));
                    acc[r][0][a] = _mm512_fmadd_ps(t, _mm512_broadcastss_ps(h), acc[r][0][a]);
                }
            };
            int e = 0;
            for (; e + 2 <= n; e += 2) block(e, 0), block(e + 1, 1);
            if (e < n) block(e, 0);
        } else {
            for (int e = 0; e < n; ++e) {
                __m512 lo[R], hi[R];
                for (int r = 0; r < R; ++r) {
                    block_values(rows[r][i0 + e], lo[r], hi[r]);
                    const __m128 h = block_head(rows[r][i0 + e]);
                    if constexpr (q4) mins[r][e] = _mm_cvtss_f32(_mm_movehdup_ps(h));
                    const __m512 d = _mm512_broadcastss_ps(h);
                    lo[r] = _mm512_mul_ps(lo[r], d), hi[r] = _mm512_mul_ps(hi[r], d);
                }
                for (int m = 0; m < MC; ++m) {
                    const float* xe = xb + m * K + e * QK;
                    const __m512 xl = _mm512_loadu_ps(xe), xh = _mm512_loadu_ps(xe + 16);
                    for (int r = 0; r < R; ++r) {
                        if constexpr (A == 2) {
                            acc[r][m][0] = _mm512_fmadd_ps(lo[r], xl, acc[r][m][0]);
                            acc[r][m][1] = _mm512_fmadd_ps(hi[r], xh, acc[r][m][1]);
                        } else {
                            acc[r][m][0] = _mm512_fmadd_ps(hi[r], xh, _mm512_fmadd_ps(lo[r], xl, acc[r][m][0]));
                        }
                    }
                }
            }
        }
        if constexpr (q4) {  // m * sum(x): the chunk's mins against its blocks' sums of x
            const __mmask16 k = static_cast<__mmask16>(n == 16 ? 0xffffu : (1u << n) - 1u);
            for (int m = 0; m < MC; ++m) {
                const __m512 xs = _mm512_maskz_loadu_ps(k, j.xsum + (m0 + m) * nb + i0);
                for (int r = 0; r < R; ++r)
                    acc[r][m][A - 1] = _mm512_fmadd_ps(_mm512_maskz_load_ps(k, mins[r]), xs, acc[r][m][A - 1]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MC; ++m) {
            __m512 s = acc[r][m][0];
            for (int a = 1; a < A; ++a) s = _mm512_add_ps(s, acc[r][m][a]);
            out[r][m] = _mm512_reduce_add_ps(s);
        }
}

template <int MC, int R>
void q4_1_row(const Job& j, const BlockQ4_1* const* rows, int64_t m0, float out[][8]) {
    quant_row<BlockQ4_1, MC, R>(j, rows, m0, out);
}

template <int MC, int R>
void q8_0_row(const Job& j, const BlockQ8_0* const* rows, int64_t m0, float out[][8]) {
    quant_row<BlockQ8_0, MC, R>(j, rows, m0, out);
}
#else
template <typename WT>
inline float widen(WT v);
template <>
inline float widen<float>(float v) {
    return v;
}
template <>
inline float widen<uint16_t>(uint16_t v) {
    return bf16_to_float(v);
}

template <typename WT, int MC, int R>
void dense_row(const Job& j, const WT* const* rows, int64_t m0, float out[][8]) {
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MC; ++m) {
            const float* x = j.xf + (m0 + m) * j.K;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < j.K; ++k) s += widen<WT>(rows[r][k]) * x[k];
            out[r][m] = s;
        }
}

template <int MC, int R>
void q4_1_row(const Job& j, const BlockQ4_1* const* rows, int64_t m0, float out[][8]) {
    const int64_t nb = j.K / QK;
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MC; ++m) {
            const BlockQ4_1* b = rows[r];
            const float* x = j.xf + (m0 + m) * j.K;
            float s = 0.f;
            for (int64_t i = 0; i < nb; ++i) {
                float t = 0.f;
                for (int64_t e = 0; e < QK / 2; ++e)
                    t += (b[i].qs[e] & 0x0f) * x[i * QK + e] + (b[i].qs[e] >> 4) * x[i * QK + e + QK / 2];
                s += half_to_float(b[i].d) * t + half_to_float(b[i].m) * j.xsum[(m0 + m) * nb + i];
            }
            out[r][m] = s;
        }
}

template <int MC, int R>
void q8_0_row(const Job& j, const BlockQ8_0* const* rows, int64_t m0, float out[][8]) {
    const int64_t nb = j.K / QK;
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MC; ++m) {
            const BlockQ8_0* b = rows[r];
            const float* x = j.xf + (m0 + m) * j.K;
            float s = 0.f;
            for (int64_t i = 0; i < nb; ++i) {
                float t = 0.f;
                for (int64_t e = 0; e < QK; ++e) t += b[i].qs[e] * x[i * QK + e];
                s += half_to_float(b[i].d) * t;
            }
            out[r][m] = s;
        }
}
#endif

// Calls fn.template operator()<MC>(m0) for m0 = 0, 8, 16, ... with MC = min(8, M - m0) as a constant.
template <typename F>
void for_row_chunks(int64_t M, F&& fn) {
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        switch (std::min<int64_t>(8, M - m0)) {
            case 1: fn.template operator()<1>(m0); break;
            case 2: fn.template operator()<2>(m0); break;
            case 3: fn.template operator()<3>(m0); break;
            case 4: fn.template operator()<4>(m0); break;
            case 5: fn.template operator()<5>(m0); break;
            case 6: fn.template operator()<6>(m0); break;
            case 7: fn.template operator()<7>(m0); break;
            default: fn.template operator()<8>(m0); break;
        }
    }
}

template <typename WT, int MC, int R>
void dense_rows_of(const Job& j, const WT* const* rows, int64_t m0, float out[][8]) {
#if defined(__AVX512BF16__)
    if constexpr (sizeof(WT) == 2) {
        if (j.xb) {
            bf16_dot_row<MC, R>(j, reinterpret_cast<const uint16_t* const*>(rows), m0, out);
            return;
        }
    }
#endif
    dense_row<WT, MC, R>(j, rows, m0, out);
}

// Output rows [n0, n1) into acc[m][n - n0] (ld = n1 - n0).
template <typename WT>
void dense_rows(const Job& j, int64_t n0, int64_t n1, float* acc) {
    const WT* w = static_cast<const WT*>(j.w);
    const int64_t ld = n1 - n0;
    for (int64_t n = n0; n < n1; ++n) {
        const WT* rows[1] = {w + n * j.K};
        for_row_chunks(j.M, [&]<int MC>(int64_t m0) {
            float out[1][8];
            dense_rows_of<WT, MC, 1>(j, rows, m0, out);
            for (int m = 0; m < MC; ++m) acc[(m0 + m) * ld + (n - n0)] = out[0][m];
        });
    }
}

template <typename BT>
void quant_rows(const Job& j, int64_t n0, int64_t n1, float* acc) {
    const BT* w = static_cast<const BT*>(j.w);
    const int64_t nb = j.K / QK, ld = n1 - n0;
    // Q4_1: two weight rows at a time share each activation load (then one for an odd last row).  Q8_0
    // stays at one: two interleaved streams of its 34-byte blocks read from memory at half the speed.
    constexpr int QR = sizeof(BT) == sizeof(BlockQ4_1) ? 2 : 1;
    const auto tile = [&]<int R>(int64_t n) {
        const BT* rows[R];
        for (int r = 0; r < R; ++r) rows[r] = w + (n + r) * nb;
        for_row_chunks(j.M, [&]<int MC>(int64_t m0) {
            float out[R][8];
            if constexpr (sizeof(BT) == sizeof(BlockQ4_1))
                q4_1_row<MC, R>(j, reinterpret_cast<const BlockQ4_1* const*>(rows), m0, out);
            else
                q8_0_row<MC, R>(j, reinterpret_cast<const BlockQ8_0* const*>(rows), m0, out);
            for (int r = 0; r < R; ++r)
                for (int m = 0; m < MC; ++m) acc[(m0 + m) * ld + (n + r - n0)] = out[r][m];
        });
    };
    int64_t n = n0;
    for (; n + QR <= n1; n += QR) tile.template operator()<QR>(n);
    if (n < n1) tile.template operator()<1>(n);
}

void rows_of(const Job& j, int wt, int64_t n0, int64_t n1, float* acc) {
    switch (wt) {
        case F32: dense_rows<float>(j, n0, n1, acc); break;
        case BF16: dense_rows<uint16_t>(j, n0, n1, acc); break;
        case Q4_1: quant_rows<BlockQ4_1>(j, n0, n1, acc); break;
        default: quant_rows<BlockQ8_0>(j, n0, n1, acc); break;
    }
}

void dequantize_row(const void* w, int wt, int64_t n, int64_t K, float* out) {
    const int64_t nb = K / QK;
    if (wt == Q4_1) {
        const BlockQ4_1* b = static_cast<const BlockQ4_1*>(w) + n * nb;
        for (int64_t i = 0; i < nb; ++i) {
            const float d = half_to_float(b[i].d), m = half_to_float(b[i].m);
            for (int64_t e = 0; e < QK / 2; ++e) {
                out[i * QK + e] = d * (b[i].qs[e] & 0x0f) + m;
                out[i * QK + e + QK / 2] = d * (b[i].qs[e] >> 4) + m;
            }
        }
    } else {
        const BlockQ8_0* b = static_cast<const BlockQ8_0*>(w) + n * nb;
        for (int64_t i = 0; i < nb; ++i) {
            const float d = half_to_float(b[i].d);
            for (int64_t e = 0; e < QK; ++e) out[i * QK + e] = d * b[i].qs[e];
        }
    }
}

// issue 30 hook: weight types >= 16 are GGUF's other formats (model/kquants.py), multiplied by
// csrc/kquants.cpp's mechserve_kquant_product, which model/linear.py registers here (external_formats).
using ProductFn = void (*)(const float*, const uint16_t*, int64_t, int64_t, const void*, int, int64_t, float*, int);
ProductFn external_product = nullptr;
constexpr int EXTERNAL_TYPES = 16;

// The product of few rows into float32, unrounded and without bias: out[m * N + n] = x[m] . w[n].
// `xf` is x as float32; `xb` x's bfloat16 bits when x is bfloat16 (else null).
void product(const float* xf, const uint16_t* xb, int64_t M, int64_t K, const void* w, int wt, int64_t N,
             float* out, int n_threads) {
    if (wt >= EXTERNAL_TYPES) {  // issue 30 hook
        if (external_product) external_product(xf, xb, M, K, w, wt, N, out, n_threads);
        else std::fill(out, out + M * N, std::nanf(""));  // never reached: linear.py registers it first
        return;
    }
    std::vector<float> xsum;
    if (wt == Q4_1) {
        const int64_t nb = K / QK;
        xsum.assign(static_cast<size_t>(M * nb), 0.f);
        for (int64_t m = 0; m < M; ++m)
            for (int64_t i = 0; i < nb; ++i) {
                float s = 0.f;
                for (int64_t e = 0; e < QK; ++e) s += xf[m * K + i * QK + e];
                xsum[m * nb + i] = s;
            }
    }
    const Job job{xf, xb && wt == BF16 ? xb : nullptr, xsum.data(), w, M, K};
    // Each thread owns a contiguous range of output rows, a multiple of 16 so tiles stay whole.
    const int64_t per = ((N + n_threads - 1) / n_threads + 15) / 16 * 16;
#pragma omp parallel num_threads(n_threads)
    {
        std::vector<float> acc;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n_threads; ++t) {
            const int64_t n0 = t * per, n1 = std::min(N, n0 + per);
            if (n0 >= n1) continue;
            acc.resize(static_cast<size_t>(M * (n1 - n0)));
            rows_of(job, wt, n0, n1, acc.data());
            for (int64_t m = 0; m < M; ++m)
                std::memcpy(out + m * N + n0, acc.data() + m * (n1 - n0), sizeof(float) * (n1 - n0));
        }
    }
}

// ---- The decoder layer's blocks for few rows (decode steps), each in one call ----------------------
//
// They compute what mechserve/model/llama.py's attention_inputs and attention_outputs compute with
// torch, in the same order and with a rounding to the activations' type wherever torch's bfloat16
// ops round (in float32 every rounding is the identity), so a bfloat16 result differs from torch's
// only where a reduction (the RMSNorm mean, the products' sums) or exp is ordered differently.

inline float rnd(int type, float v) { return type == BF16 ? bf16_to_float(float_to_bf16(v)) : v; }

// Activations of one product: float32 values (already rounded to `type`) and, in bfloat16, their bits.
struct Acts {
    Buffer<float> f;
    Buffer<uint16_t> b;
    Acts(int64_t n, int type) : f(static_cast<size_t>(n)), b(type == BF16 ? static_cast<size_t>(n) : 0) {}
    void set(int type, int64_t i, float v) {
        f[i] = v;
        if (type == BF16) b[i] = float_to_bf16(v);
    }
    const uint16_t* bits() const { return b.empty() ? nullptr : b.data(); }
};

// RMSNorm of rows x [M, H] (float32 values) as llama.py's rms_norm: in float32, x * (1 / sqrt(mean(x^2)
// + eps)) rounded to `type`, times the weight, rounded again.
void rms_norm_rows(const float* x, const void* weight, int type, float eps, int64_t M, int64_t H, Acts& out) {
    for (int64_t m = 0; m < M; ++m) {
        const float* r = x + m * H;
        float s = 0.f;
        for (int64_t i = 0; i < H; ++i) s += r[i] * r[i];
        const float inv = 1.f / std::sqrt(s / static_cast<float>(H) + eps);
        for (int64_t i = 0; i < H; ++i)
            out.set(type, m * H + i, rnd(type, load_value(weight, type, i) * rnd(type, r[i] * inv)));
    }
}

// y = rnd(acc + bias) for [M, N] accumulators, in place.
void add_bias(float* acc, const void* bias, int type, int64_t M, int64_t N) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            float v = acc[m * N + n];
            if (bias) v += load_value(bias, type, n);
            acc[m * N + n] = rnd(type, v);
        }
}

// RoPE in the half-split layout on `heads` heads of width d from src (row stride `stride` floats),
// as llama.py's _rotate: x * cos + cat(-x2, x1) * sin, each product and the sum rounded.
void rotate_rows(const float* src, int64_t stride, int64_t heads, int64_t d, const void* cos, const void* sin,
                 int type, int64_t M, void* dst) {
    const int64_t half = d / 2;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t hh = 0; hh < heads; ++hh) {
            const float* x = src + m * stride + hh * d;
            for (int64_t j = 0; j < d; ++j) {
                const float rot = j < half ? -x[j + half] : x[j - half];
                const float a = rnd(type, x[j] * load_value(cos, type, m * d + j));
                const float b = rnd(type, rot * load_value(sin, type, m * d + j));
                store_value(dst, type, (m * heads + hh) * d + j, a + b);
            }
        }
}

}  // namespace

extern "C" {

// Returns the ABI version; the loader refuses a library that does not match.
int mechserve_linear_abi(void) { return 2; }

// issue 30 hook: the product for weight types >= 16 (csrc/kquants.cpp's mechserve_kquant_product).
void mechserve_set_external_product(void* fn) { external_product = reinterpret_cast<ProductFn>(fn); }

// y [M, N] (yt) = x [M, K] (xt: F32 or BF16) times w [N, K] (wt) transposed, plus bias [N] (xt) unless
// null.  Quantized w needs K % 32 == 0.  All tensors contiguous.
void mechserve_linear(const void* x, int xt, const void* w, int wt, const void* bias, void* y, int yt, int64_t M,
                      int64_t N, int64_t K, int n_threads) {
    Buffer<float> xf(static_cast<size_t>(M * K));
    for (int64_t i = 0; i < M * K; ++i) xf[i] = load_value(x, xt, i);
    std::vector<float> acc(static_cast<size_t>(M * N));
    product(xf.data(), xt == BF16 ? static_cast<const uint16_t*>(x) : nullptr, M, K, w, wt, N, acc.data(),
            n_threads);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            float v = acc[m * N + n];
            if (bias) v += load_value(bias, xt, n);
            store_value(y, yt, m * N + n, v);
        }
}

// A decoder layer up to attention (llama.py's attention_inputs without q/k norms), for M few rows:
// x [M, H] -> RMSNorm (norm [H], eps) -> qkv = . w [(h + 2 kv) d, H] (wt) + bias -> q [M, h, d] and
// k [M, kv, d] rotated by cos/sin [M, d], v [M, kv, d].  x, norm, bias, cos, sin, q, k, v in type xt.
void mechserve_attention_inputs(const void* x, int xt, const void* norm, float eps, int64_t M, int64_t H,
                                const void* w, int wt, const void* bias, const void* cos, const void* sin,
                                int64_t h, int64_t kv, int64_t d, void* q, void* k, void* v, int n_threads) {
    std::vector<float> xf(static_cast<size_t>(M * H));
    for (int64_t i = 0; i < M * H; ++i) xf[i] = load_value(x, xt, i);
    Acts y(M * H, xt);
    rms_norm_rows(xf.data(), norm, xt, eps, M, H, y);
    const int64_t N = (h + 2 * kv) * d;
    std::vector<float> qkv(static_cast<size_t>(M * N));
    product(y.f.data(), y.bits(), M, H, w, wt, N, qkv.data(), n_threads);
    add_bias(qkv.data(), bias, xt, M, N);
    rotate_rows(qkv.data(), N, h, d, cos, sin, xt, M, q);
    rotate_rows(qkv.data() + h * d, N, kv, d, cos, sin, xt, M, k);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < kv * d; ++i) store_value(v, xt, m * kv * d + i, qkv[m * N + (h + kv) * d + i]);
}

// A decoder layer after attention (llama.py's attention_outputs), for M few rows:
//   x1 = x + (attn [M, A] . o [H, A] + o_bias);  y = RMSNorm(x1);  gate, up = y . gate_up [2 I, H] + bias
//   out [M, H] = x1 + (silu(gate) * up) . down [H, I] + down_bias
// Activations and biases in type xt; each weight in its own type (ot, gt, dt).
void mechserve_attention_outputs(const void* x, int xt, const void* attn, int64_t A, const void* o, int ot,
                                 const void* o_bias, const void* norm, float eps, const void* gate_up, int gt,
                                 const void* gate_up_bias, int64_t I, const void* down, int dt, const void* down_bias,
                                 int64_t M, int64_t H, void* out, int n_threads) {
    Buffer<float> af(static_cast<size_t>(M * A));
    for (int64_t i = 0; i < M * A; ++i) af[i] = load_value(attn, xt, i);
    std::vector<float> x1(static_cast<size_t>(M * H));
    product(af.data(), xt == BF16 ? static_cast<const uint16_t*>(attn) : nullptr, M, A, o, ot, H, x1.data(),
            n_threads);
    add_bias(x1.data(), o_bias, xt, M, H);
    for (int64_t i = 0; i < M * H; ++i) x1[i] = rnd(xt, load_value(x, xt, i) + x1[i]);
    Acts y(M * H, xt);
    rms_norm_rows(x1.data(), norm, xt, eps, M, H, y);
    std::vector<float> gu(static_cast<size_t>(M * 2 * I));
    product(y.f.data(), y.bits(), M, H, gate_up, gt, 2 * I, gu.data(), n_threads);
    add_bias(gu.data(), gate_up_bias, xt, M, 2 * I);
    Acts act(M * I, xt);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < I; ++i) {
            const float g = gu[m * 2 * I + i], u = gu[m * 2 * I + I + i];
            act.set(xt, m * I + i, rnd(xt, rnd(xt, g / (1.f + std::exp(-g))) * u));
        }
    std::vector<float> dn(static_cast<size_t>(M * H));
    product(act.f.data(), act.bits(), M, I, down, dt, H, dn.data(), n_threads);
    add_bias(dn.data(), down_bias, xt, M, H);
    for (int64_t i = 0; i < M * H; ++i) store_value(out, xt, i, x1[i] + dn[i]);
}

// out [R, K] (ot: F32 or BF16) = rows ids[0..R) of the quantized matrix w [N, K] (wt: Q4_1 or Q8_0),
// dequantized: an embedding lookup, or a slice of a matrix for a product at many rows.
void mechserve_dequantize_rows(const void* w, int wt, const int64_t* ids, int64_t R, int64_t K, void* out, int ot,
                               int n_threads) {
#pragma omp parallel num_threads(n_threads)
    {
        std::vector<float> row(static_cast<size_t>(K));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r) {
            dequantize_row(w, wt, ids[r], K, row.data());
            for (int64_t k = 0; k < K; ++k) store_value(out, ot, r * K + k, row[k]);
        }
    }
}

}  // extern "C"
