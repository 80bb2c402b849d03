// GGUF Q8_0 (ggml's block_q8_0): 32 weights in 34 bytes { fp16 d; int8 qs[32] }, w[j] = d * qs[j].
#pragma once

#include "blocks32.h"

namespace mechserve {

struct Q8_0Format {
    static constexpr int type = Q8_0;
    static constexpr int64_t block = 32;  // weights per block
    struct Block {
        uint16_t d;
        int8_t qs[32];
    };
    static_assert(sizeof(Block) == 34, "Q8_0 block is 34 bytes");
    static constexpr bool has_min = false;
    // Up to this many activation rows the few-row kernel multiplies the blocks directly (see q4_1.h).
    static constexpr int64_t few_rows = 3;

#if defined(__AVX512F__)
    static inline void values(const Block& b, __m512& lo, __m512& hi) {
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)b.qs)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b.qs + 16))));
    }
#endif
#if defined(MECHSERVE_INT8_FEW_ROWS)
    static constexpr bool signed_q = true;  // int8 q: the activations go in as unsigned q + 128
    // Blocks b[0] and (if two) b[1]: their q as 64 bytes (lanes 0-7 block 0, 8-15 block 1), their d spread
    // over those lanes.
    static inline __m512i pair(const Block* b, bool two, __m512& dw, float*) {
        const __m256i lo = _mm256_loadu_si256((const __m256i*)b[0].qs);
        const __m256i hi = two ? _mm256_loadu_si256((const __m256i*)b[1].qs) : _mm256_setzero_si256();
        const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(b[0].d | (two ? uint32_t(b[1].d) << 16 : 0u)));
        dw = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                   _mm512_castps128_ps512(d));
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    // A row's int8 activations, + 128, in pairs of blocks as `pair` lays out q; each pair's two scales.
    static void quantize_x(const float* x, int64_t K, uint8_t* xq, float* xdv) {
        const int64_t nb = K / 32;
        for (int64_t p = 0; p < block_pairs(K); ++p) {
            alignas(64) int8_t q[64] = {};
            const float da = quantize32(x + 64 * p, q);
            const float db = 2 * p + 1 < nb ? quantize32(x + 64 * p + 32, q + 32) : 0.f;
            _mm512_storeu_si512(xq + 64 * p, _mm512_xor_si512(_mm512_load_si512(q), _mm512_set1_epi8(-128)));
            _mm512_storeu_ps(xdv + 16 * p, _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(da), _mm512_set1_ps(db)));
        }
    }
#endif
    static inline float dot(const Block& b, const float* x, float) {
        float t = 0.f;
        for (int e = 0; e < 32; ++e) t += b.qs[e] * x[e];
        return half_to_float(b.d) * t;
    }
    static inline void to_f32(const Block& b, float* out) {
#if defined(__AVX512F__)
        __m512 lo, hi;
        values(b, lo, hi);
        const __m512 d = _mm512_set1_ps(half_to_float(b.d));
        _mm512_storeu_ps(out, _mm512_mul_ps(lo, d));
        _mm512_storeu_ps(out + 16, _mm512_mul_ps(hi, d));
#else
        const float d = half_to_float(b.d);
        for (int e = 0; e < 32; ++e) out[e] = d * b.qs[e];
#endif
    }
    static void few(const Job& j, int64_t n0, int64_t n1, float* out, int64_t ldo) {
        // one weight row at a time: two interleaved streams of 34-byte blocks read at half the speed
        blocks32_few<Q8_0Format, 1>(j, n0, n1, out, ldo);
    }
};

}  // namespace mechserve
