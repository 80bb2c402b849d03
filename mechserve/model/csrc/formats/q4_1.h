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
#if defined(MECHSERVE_INT8_FEW_ROWS)
    static constexpr bool signed_q = false;  // nibbles 0..15: unsigned bytes against the signed activations
    // Blocks b[0] and (if two) b[1]: their q as 64 bytes, low nibbles then high nibbles of block 0, 1, 0, 1
    // (lanes 0-3 and 8-11 block 0, 4-7 and 12-15 block 1); their d spread over those lanes, their m into
    // mins[0..1].
    static inline __m512i pair(const Block* b, bool two, __m512& dw, float* mins) {
        const __m128i qa = _mm_loadu_si128((const __m128i*)b[0].qs);
        const __m128i qb = two ? _mm_loadu_si128((const __m128i*)b[1].qs) : _mm_setzero_si128();
        const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1);
        const __m256i nib = _mm256_set1_epi8(0x0f);
        const __m256i lo = _mm256_and_si256(q, nib), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
        uint32_t ha, hb = 0;
        std::memcpy(&ha, &b[0], 4);
        if (two) std::memcpy(&hb, &b[1], 4);
        const __m128 h = _mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(hb), static_cast<int>(ha)));  // da ma db mb
        mins[0] = _mm_cvtss_f32(_mm_movehdup_ps(h));
        mins[1] = _mm_cvtss_f32(_mm_permute_ps(h, 3));
        dw = _mm512_permutexvar_ps(_mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0),
                                   _mm512_castps128_ps512(h));
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    // A row's int8 activations in `pair`'s order (x 0-15 of block 0, 0-15 of block 1, 16-31 of 0, 16-31 of
    // 1), each pair's two scales spread as its d are.
    static void quantize_x(const float* x, int64_t K, uint8_t* xq, float* xdv) {
        const int64_t nb = K / 32;
        for (int64_t p = 0; p < block_pairs(K); ++p) {
            alignas(16) int8_t a[32] = {}, b[32] = {};
            const float da = quantize32(x + 64 * p, a);
            const float db = 2 * p + 1 < nb ? quantize32(x + 64 * p + 32, b) : 0.f;
            std::memcpy(xq + 64 * p, a, 16);
            std::memcpy(xq + 64 * p + 16, b, 16);
            std::memcpy(xq + 64 * p + 32, a + 16, 16);
            std::memcpy(xq + 64 * p + 48, b + 16, 16);
            _mm512_storeu_ps(xdv + 16 * p, _mm512_mask_blend_ps(0xf0f0, _mm512_set1_ps(da), _mm512_set1_ps(db)));
        }
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
