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
