// Float weight matrices, float32 and bfloat16: their rows are used as they are stored, and their few-row
// kernels stream one weight row at a time.
#pragma once

#include "blocks32.h"

namespace mechserve {

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 load16_tail(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16_tail(const uint16_t* p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

// One weight row (float32 or bfloat16) against MC float32 activation rows: the weights read as a single
// stream, which measured 30% faster than a stream per row of a tile at one activation row.  U independent
// partial sums per activation row hide the FMA latency when MC is small.
template <typename WT, int MC>
void dense_row(const Job& j, const WT* row, int64_t m0, float out[8]) {
    constexpr int U = MC == 1 ? 4 : MC == 2 ? 2 : 1;
    const int64_t K = j.K;
    const float* x = j.xf + m0 * K;
    __m512 acc[MC][U];
    for (int m = 0; m < MC; ++m)
        for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U)
        for (int u = 0; u < U; ++u) {
            const __m512 wv = load16(row + k + 16 * u);
            for (int m = 0; m < MC; ++m)
                acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k + 16 * u), acc[m][u]);
        }
    for (; k < K; k += 16) {
        const __mmask16 mask = static_cast<__mmask16>(K - k >= 16 ? 0xffffu : (1u << (K - k)) - 1u);
        const __m512 wv = load16_tail(row + k, mask);
        for (int m = 0; m < MC; ++m)
            acc[m][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * K + k), acc[m][0]);
    }
    for (int m = 0; m < MC; ++m) {
        __m512 a = acc[m][0];
        for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[m][u]);
        out[m] = _mm512_reduce_add_ps(a);
    }
}

#if defined(__AVX512BF16__)
// One bfloat16 weight row against MC bfloat16 activation rows: VDPBF16PS multiplies 32 pairs exactly and
// adds them into 16 float32 lanes.
template <int MC>
void bf16_dot_row(const Job& j, const uint16_t* row, int64_t m0, float out[8]) {
    constexpr int U = MC == 1 ? 4 : MC == 2 ? 2 : 1;
    const int64_t K = j.K;
    const uint16_t* x = j.xb + m0 * K;
    __m512 acc[MC][U];
    for (int m = 0; m < MC; ++m)
        for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U)
        for (int u = 0; u < U; ++u) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + k + 32 * u);
            for (int m = 0; m < MC; ++m)
                acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u));
        }
    for (; k < K; k += 32) {
        const __mmask32 mask = static_cast<__mmask32>(K - k >= 32 ? 0xffffffffu : (1u << (K - k)) - 1u);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, row + k);
        for (int m = 0; m < MC; ++m)
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
    }
    for (int m = 0; m < MC; ++m) {
        __m512 a = acc[m][0];
        for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[m][u]);
        out[m] = _mm512_reduce_add_ps(a);
    }
}
#endif
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

template <typename WT, int MC>
void dense_row(const Job& j, const WT* row, int64_t m0, float out[8]) {
    for (int m = 0; m < MC; ++m) {
        const float* x = j.xf + (m0 + m) * j.K;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < j.K; ++k) s += widen<WT>(row[k]) * x[k];
        out[m] = s;
    }
}
#endif

// Output columns [n0, n1) of out [M, ldo], one weight row at a time against every activation row.
template <typename WT>
void dense_few(const Job& j, int64_t n0, int64_t n1, float* out, int64_t ldo) {
    const WT* w = static_cast<const WT*>(j.w);
    for (int64_t n = n0; n < n1; ++n) {
        const WT* row = w + n * j.K;
        for_row_chunks(j.M, [&]<int MC>(int64_t m0) {
            float o[8];
#if defined(__AVX512BF16__)
            if constexpr (sizeof(WT) == 2)
                if (j.xb) {
                    bf16_dot_row<MC>(j, row, m0, o);
                    for (int m = 0; m < MC; ++m) out[(m0 + m) * ldo + n] = o[m];
                    return;
                }
#endif
            dense_row<WT, MC>(j, row, m0, o);
            for (int m = 0; m < MC; ++m) out[(m0 + m) * ldo + n] = o[m];
        });
    }
}

// Up to how many activation rows DenseBF16's few-row kernel serves.  With AVX2 and no AVX-512 the tiles
// (gemm.h) read bfloat16 rows as stored from 2 rows on, widening them as they go (WIDEN_IN_TILE): faster
// here than the one-weight-row loops below at 2 rows and more, and slower at one (docs/benchmarks.md,
// issue 27).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr int64_t BF16_FEW_ROWS = 1;
#else
constexpr int64_t BF16_FEW_ROWS = 3;
#endif

struct DenseF32 {
    static constexpr int type = F32;
    static constexpr int64_t block = 1;
    using Block = float;
    static constexpr bool has_min = false;
    static constexpr int64_t few_rows = 3;
    static inline void to_f32(const Block& b, float* out) { *out = b; }
    static void few(const Job& j, int64_t n0, int64_t n1, float* out, int64_t ldo) {
        dense_few<float>(j, n0, n1, out, ldo);
    }
};

struct DenseBF16 {
    static constexpr int type = BF16;
    static constexpr int64_t block = 1;
    using Block = uint16_t;
    static constexpr bool has_min = false;
    static constexpr int64_t few_rows = BF16_FEW_ROWS;
    static inline void to_f32(const Block& b, float* out) { *out = bf16_to_float(b); }
    static void few(const Job& j, int64_t n0, int64_t n1, float* out, int64_t ldo) {
        dense_few<uint16_t>(j, n0, n1, out, ldo);
    }
};

}  // namespace mechserve
