// GGUF Q4_1 (ggml's block_q4_1): 32 weights in 20 bytes { fp16 d; fp16 m; uint8 qs[16] },
// w[j] = d * q[j] + m with q[j] the low nibble of qs[j] (j < 16) or the high nibble of qs[j - 16].
#pragma once

#include "blocks32.h"

namespace mechserve {

struct Q4_1Format {
    static constexpr int type = Q4_1;
    static constexpr int64_t block = 32;  // weights per block
    struct Block {
        uint16_t d, m;
        uint8_t qs[16];
    };
    static_assert(sizeof(Block) == 20, "Q4_1 block is 20 bytes");
    static constexpr bool has_min = true;  // the few-row kernel wants the sums of x per block
    // Up to this many activation rows the few-row kernel multiplies the blocks directly; more rows dequantize
    // a tile of weight rows once for all of them (gemm.h).
    static constexpr int64_t few_rows = 3;

#if defined(__AVX512F__)
    // The q values of one block's 32 weights as floats: lo = weights 0..15, hi = 16..31.
    static inline void values(const Block& b, __m512& lo, __m512& hi) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)b.qs));
        lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)));
        hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    }
#endif
    // d * (q . x) + m * xsum for one block against 32 activations x (portable path).
    static inline float dot(const Block& b, const float* x, float xsum) {
        float t = 0.f;
        for (int e = 0; e < 16; ++e) t += (b.qs[e] & 0x0f) * x[e] + (b.qs[e] >> 4) * x[e + 16];
        return half_to_float(b.d) * t + half_to_float(b.m) * xsum;
    }
    // One block's 32 weights as float32, computed as the reference decoder does (d * q, then + m).
    static inline void to_f32(const Block& b, float* out) {
#if defined(__AVX512F__)
        __m512 lo, hi;
        values(b, lo, hi);
        const __m512 d = _mm512_set1_ps(half_to_float(b.d)), m = _mm512_set1_ps(half_to_float(b.m));
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(lo, d), m));
        _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_mul_ps(hi, d), m));
#else
        const float d = half_to_float(b.d), m = half_to_float(b.m);
        for (int e = 0; e < 16; ++e) {
            out[e] = d * (b.qs[e] & 0x0f) + m;
            out[e + 16] = d * (b.qs[e] >> 4) + m;
        }
#endif
    }
    static void few(const Job& j, int64_t n0, int64_t n1, float* out, int64_t ldo) {
        blocks32_few<Q4_1Format, 2>(j, n0, n1, out, ldo);  // two weight rows share each activation load
    }
};

}  // namespace mechserve
