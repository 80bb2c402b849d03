// GGUF's weight formats, multiplied as a file stores them: F16, Q4_0, Q5_0, Q5_1, the K-quants Q4_K, Q5_K,
// Q6_K (ggml's block layouts, ggml-common.h), and Q4_1, Q8_0, F32, BF16 inside a MIXED matrix (row groups of
// different formats: a file's q/k/v or gate/up fused).  Never expanded to a float copy of the matrix: a
// product reads each block once and widens it in registers.
//
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])      x: [M, K], w: [N, K] (torch's F.linear)
//
// Every block format is described to the kernels the same way: its weights come in groups of 16, and
// group g of a block is  w = sc[g] * q + off  with q the stored integers less the format's zero point
// (signed: Q4_0 -8, Q5_0 -16, Q8_0 none, Q6_K -32) and off the min of the formats that have one (Q4_1,
// Q5_1: m; Q4_K, Q5_K: -dmin * m_j), shared by each 32 weights.  So a block's dot product with x is
//   sum_g sc[g] * (q_g . x_g) + sum over 32-weight pairs of off_p * sum(x_p)
// with the sums of x per 32 weights taken once per call and 16 pairs' mins added with one vector FMA.
//
//   format  block  bytes  layout (ggml)                                         group scale, min
//   Q4_0    32     18     fp16 d; qs[16] (weight j: low nibble of qs[j],          d, none
//                         j >= 16: high nibble of qs[j - 16])
//   Q4_1    32     20     fp16 d, m; qs[16]                                      d, m
//   Q5_0    32     22     fp16 d; u32 qh (bit j: weight j's 5th bit); qs[16]     d, none
//   Q5_1    32     24     fp16 d, m; u32 qh; qs[16]                              d, m
//   Q8_0    32     34     fp16 d; int8 qs[32]                                    d, none
//   Q4_K    256    144    fp16 d, dmin; scales[12] (8 six-bit scales and mins);  d * s_j, -dmin * m_j
//                         qs[128] (64 weights per 32 bytes: sub-block 2c in the   (j = g / 2)
//                         low nibbles, 2c + 1 in the high ones)
//   Q5_K    256    176    as Q4_K, plus qh[32] (bit j of qh[l]: weight l of sub-block j's 5th bit)
//   Q6_K    256    210    ql[128], qh[64] (2 bits each), int8 scales[16], fp16 d  d * s_g, none
//   F16, BF16, F32        one value each                                         (dense: no groups)
//
// `to_f32` of each format computes a block's weights exactly as gguf-py's reference decoder
// (gguf.quants) does, in the same float32 operations (built with -ffp-contract=off), so a row
// dequantized here equals the reference bit for bit; the products differ from (reference row) . x
// only in summation order.
//
// Paths: AVX-512 (the pair decoders, in registers), else a portable loop over rows dequantized with
// to_f32.  Threads: OpenMP on the runtime torch already loaded, as linear.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"

namespace {

// The block decoders and the kernels' steps are inlined whatever GCC's size heuristics say: a step left as a
// call keeps the accumulators in memory (Q5_1 at two activation rows ran 3x slower than Q4_1 that way).
#define KQ_INLINE __attribute__((always_inline)) inline

// linear.cpp's numbers for F32, BF16, Q4_1 and Q8_0; MIXED: a matrix whose row groups differ in format.
enum Type : int {
    F32 = 0, BF16 = 1, Q4_1 = 2, Q8_0 = 3,
    F16 = 16, Q4_0 = 17, Q5_0 = 18, Q5_1 = 19, Q4_K = 20, Q5_K = 21, Q6_K = 22,
    MIXED = 63,
};
constexpr int64_t G = 16;  // weights per group

// The scalar conversions are linear.cpp's (common.h): one copy of each.
using mechserve::bf16_to_float;
using mechserve::float_to_bf16;
using mechserve::half_to_float;

inline float load_value(const void* p, int type, int64_t i) {
    return type == F32 ? static_cast<const float*>(p)[i] : bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

inline void store_value(void* p, int type, int64_t i, float v) {
    if (type == F32)
        static_cast<float*>(p)[i] = v;
    else
        static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
}

KQ_INLINE uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// ggml's get_scale_min_k4: the six-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block.
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// A Q4_K/Q5_K block's scales per sub-block j of 32 weights (sc[j]) and what each weight of it adds
// (off[j] = -dmin * m_j).
KQ_INLINE void k_scales(uint16_t dh, uint16_t dminh, const uint8_t* q, float* sc, float* off) {
    const float d = half_to_float(dh), dmin = half_to_float(dminh);
#if defined(__AVX512F__)
    // scale_min_k4 for all eight at once, a byte per value in four 32-bit words: with u0..u2 the
    // scales' words, s0-3 = u0 & 63, m0-3 = u1 & 63, s4-7 = low nibbles of u2 | (u0's top two bits) << 4,
    // m4-7 = high nibbles of u2 | (u1's top two bits) << 4.
    uint32_t u[3];
    std::memcpy(u, q, sizeof u);
    const uint32_t six = 0x3f3f3f3fu, low = 0x0f0f0f0fu, top = 0x03030303u;
    const uint32_t words[4] = {u[0] & six, (u[2] & low) | (((u[0] >> 6) & top) << 4), u[1] & six,
                               ((u[2] >> 4) & low) | (((u[1] >> 6) & top) << 4)};
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)words)));
    const __m512 mul = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d), _mm512_set1_ps(-dmin));
    alignas(64) float both[16];
    _mm512_store_ps(both, _mm512_mul_ps(v, mul));  // -(dmin * m) == (-dmin) * m exactly
    std::memcpy(sc, both, 8 * sizeof(float));
    std::memcpy(off, both + 8, 8 * sizeof(float));
    return;
#endif
    for (int j = 0; j < 8; ++j) {
        int s, m;
        scale_min_k4(j, q, s, m);
        sc[j] = d * static_cast<float>(s);
        off[j] = -(dmin * static_cast<float>(m));
    }
}

#if defined(__AVX512F__)
KQ_INLINE __m512i widen(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
KQ_INLINE __m512 as_float(__m512i v) { return _mm512_cvtepi32_ps(v); }
KQ_INLINE __m512i nib_lo(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi32(0x0f)); }
KQ_INLINE __m512i nib_hi(__m512i v) { return _mm512_srli_epi32(v, 4); }
// v with 16 added in the lanes whose bit of `bits` is set (a 5th bit).
KQ_INLINE __m512i fifth_bit(__m512i v, uint32_t bits) {
    return _mm512_mask_or_epi32(v, static_cast<__mmask16>(bits), v, _mm512_set1_epi32(16));
}
#endif

struct Q4_0F {
    static constexpr int64_t block = 32, groups = 2;
    struct Block {
        uint16_t d;
        uint8_t qs[16];
    };
    static void to_f32(const Block& b, float* out) {
        const float d = half_to_float(b.d);
        for (int j = 0; j < 16; ++j) {
            out[j] = d * static_cast<float>((b.qs[j] & 0x0f) - 8);
            out[j + 16] = d * static_cast<float>((b.qs[j] >> 4) - 8);
        }
    }
    static constexpr bool has_min = false;
    static constexpr bool shared = true;  // one scale per 32 weights
#if defined(__AVX512F__)
    template <int P>
    KQ_INLINE static void pair(const Block& b, __m512& q0, __m512& q1) {
        const __m512i v = widen(b.qs), eight = _mm512_set1_epi32(8);
        q0 = as_float(_mm512_sub_epi32(nib_lo(v), eight)), q1 = as_float(_mm512_sub_epi32(nib_hi(v), eight));
    }
#endif
};

struct Q4_1F {
    static constexpr int64_t block = 32, groups = 2;
    struct Block {
        uint16_t d, m;
        uint8_t qs[16];
    };
    static void to_f32(const Block& b, float* out) {
        const float d = half_to_float(b.d), m = half_to_float(b.m);
        for (int j = 0; j < 16; ++j) {
            out[j] = d * static_cast<float>(b.qs[j] & 0x0f) + m;
            out[j + 16] = d * static_cast<float>(b.qs[j] >> 4) + m;
        }
    }
    static constexpr bool has_min = true;
    static constexpr bool shared = true;  // one scale per 32 weights
#if defined(__AVX512F__)
    template <int P>
    KQ_INLINE static void pair(const Block& b, __m512& q0, __m512& q1) {
        const __m512i v = widen(b.qs);
        q0 = as_float(nib_lo(v)), q1 = as_float(nib_hi(v));
    }
#endif
};

struct Q8_0F {
    static constexpr int64_t block = 32, groups = 2;
    struct Block {
        uint16_t d;
        int8_t qs[32];
    };
    static void to_f32(const Block& b, float* out) {
        const float d = half_to_float(b.d);
        for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(b.qs[j]);
    }
    static constexpr bool has_min = false;
    static constexpr bool shared = true;  // one scale per 32 weights
#if defined(__AVX512F__)
    template <int P>
    KQ_INLINE static void pair(const Block& b, __m512& q0, __m512& q1) {
        q0 = as_float(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)b.qs)));
        q1 = as_float(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b.qs + 16))));
    }
#endif
};

struct Q5_0F {
    static constexpr int64_t block = 32, groups = 2;
    struct Block {
        uint16_t d;
        uint8_t qh[4];
        uint8_t qs[16];
    };
    static void to_f32(const Block& b, float* out) {
        const float d = half_to_float(b.d);
        const uint32_t qh = load_u32(b.qh);
        for (int j = 0; j < 16; ++j) {
            const int lo = (b.qs[j] & 0x0f) | (((qh >> j) & 1) << 4);
            const int hi = (b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            out[j] = d * static_cast<float>(lo - 16);
            out[j + 16] = d * static_cast<float>(hi - 16);
        }
    }
    static constexpr bool has_min = false;
    static constexpr bool shared = true;  // one scale per 32 weights
#if defined(__AVX512F__)
    template <int P>
    KQ_INLINE static void pair(const Block& b, __m512& q0, __m512& q1) {
        // q - 16 with q = nibble | fifth bit << 4: the nibble where the bit is set, nibble - 16 where not
        const __m512i v = widen(b.qs), sixteen = _mm512_set1_epi32(16);
        const uint32_t qh = load_u32(b.qh);
        const __m512i lo = nib_lo(v), hi = nib_hi(v);
        q0 = as_float(_mm512_mask_sub_epi32(lo, static_cast<__mmask16>(~qh), lo, sixteen));
        q1 = as_float(_mm512_mask_sub_epi32(hi, static_cast<__mmask16>(~qh >> 16), hi, sixteen));
    }
#endif
};

struct Q5_1F {
    static constexpr int64_t block = 32, groups = 2;
    struct Block {
        uint16_t d, m;
        uint8_t qh[4];
        uint8_t qs[16];
    };
    static void to_f32(const Block& b, float* out) {
        const float d = half_to_float(b.d), m = half_to_float(b.m);
        const uint32_t qh = load_u32(b.qh);
        for (int j = 0; j < 16; ++j) {
            const int lo = (b.qs[j] & 0x0f) | (((qh >> j) & 1) << 4);
            const int hi = (b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            out[j] = d * static_cast<float>(lo) + m;
            out[j + 16] = d * static_cast<float>(hi) + m;
        }
    }
    static constexpr bool has_min = true;
    static constexpr bool shared = true;  // one scale per 32 weights
#if defined(__AVX512F__)
    template <int P>
    KQ_INLINE static void pair(const Block& b, __m512& q0, __m512& q1) {
        // the fifth bits as a vector (lane l of the low half: bit l of qh), not as a mask register: with
        // the min's bookkeeping beside it the mask form ran 2-3x slower from two activation rows on
        const __m512i v = widen(b.qs), one = _mm512_set1_epi32(1);
        const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i qh = _mm512_set1_epi32(static_cast<int>(load_u32(b.qh)));
        const __m512i h0 = _mm512_and_si512(_mm512_srlv_epi32(qh, lanes), one);
        const __m512i h1 = _mm512_and_si512(_mm512_srlv_epi32(qh, _mm512_add_epi32(lanes, _mm512_set1_epi32(16))), one);
        q0 = as_float(_mm512_or_si512(nib_lo(v), _mm512_slli_epi32(h0, 4)));
        q1 = as_float(_mm512_or_si512(nib_hi(v), _mm512_slli_epi32(h1, 4)));
    }
#endif
};

struct Q4_KF {
    static constexpr int64_t block = 256, groups = 16;
    struct Block {
        uint16_t d, dmin;
        uint8_t scales[12];
        uint8_t qs[128];
    };
    static void to_f32(const Block& b, float* out) {
        const float d = half_to_float(b.d), dmin = half_to_float(b.dmin);
        for (int j = 0; j < 8; ++j) {
            int s, m;
            scale_min_k4(j, b.scales, s, m);
            const float d1 = d * static_cast<float>(s), m1 = dmin * static_cast<float>(m);
            const uint8_t* q = b.qs + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int l = 0; l < 32; ++l) out[32 * j + l] = d1 * static_cast<float>((q[l] >> shift) & 0x0f) - m1;
        }
    }
    static constexpr bool has_min = true;
    static constexpr bool shared = true;  // pair P is sub-block P: one scale
    KQ_INLINE static void scales(const Block& b, float* sc, float* off) { k_scales(b.d, b.dmin, b.scales, sc, off); }
#if defined(__AVX512F__)
    template <int P>
    KQ_INLINE static void pair(const Block& b, __m512& q0, __m512& q1) {
        const __m512i v0 = widen(b.qs + 32 * (P / 2)), v1 = widen(b.qs + 32 * (P / 2) + 16);
        if constexpr (P % 2) {
            q0 = as_float(nib_hi(v0)), q1 = as_float(nib_hi(v1));
        } else {
            q0 = as_float(nib_lo(v0)), q1 = as_float(nib_lo(v1));
        }
    }
#endif
};

struct Q5_KF {
    static constexpr int64_t block = 256, groups = 16;
    struct Block {
        uint16_t d, dmin;
        uint8_t scales[12];
        uint8_t qh[32];
        uint8_t qs[128];
    };
    static void to_f32(const Block& b, float* out) {
        const float d = half_to_float(b.d), dmin = half_to_float(b.dmin);
        for (int j = 0; j < 8; ++j) {
            int s, m;
            scale_min_k4(j, b.scales, s, m);
            const float d1 = d * static_cast<float>(s), m1 = dmin * static_cast<float>(m);
            const uint8_t* q = b.qs + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int l = 0; l < 32; ++l) {
                const int v = ((q[l] >> shift) & 0x0f) | (((b.qh[l] >> j) & 1) << 4);
                out[32 * j + l] = d1 * static_cast<float>(v) - m1;
            }
        }
    }
    static constexpr bool has_min = true;
    static constexpr bool shared = true;  // pair P is sub-block P: one scale
    KQ_INLINE static void scales(const Block& b, float* sc, float* off) { k_scales(b.d, b.dmin, b.scales, sc, off); }
#if defined(__AVX512F__)
    template <int P>
    KQ_INLINE static void pair(const Block& b, __m512& q0, __m512& q1) {
        const __m512i v0 = widen(b.qs + 32 * (P / 2)), v1 = widen(b.qs + 32 * (P / 2) + 16);
        const __m512i a = P % 2 ? nib_hi(v0) : nib_lo(v0), z = P % 2 ? nib_hi(v1) : nib_lo(v1);
        const __m512i bit = _mm512_set1_epi32(1 << P), sixteen = _mm512_set1_epi32(16);
        q0 = as_float(_mm512_mask_or_epi32(a, _mm512_test_epi32_mask(widen(b.qh), bit), a, sixteen));
        q1 = as_float(_mm512_mask_or_epi32(z, _mm512_test_epi32_mask(widen(b.qh + 16), bit), z, sixteen));
    }
#endif
};

struct Q6_KF {
    static constexpr int64_t block = 256, groups = 16;
    struct Block {
        uint8_t ql[128];
        uint8_t qh[64];
        int8_t scales[16];
        uint16_t d;
    };
    // Weight h * 128 + 32 k + l (half h, quarter k, l < 32): low 4 bits from ql[64 h + l + 32 (k % 2)]
    // (its high nibble for k >= 2), high 2 bits from qh[32 h + l] >> 2 k.
    static int q_of(const Block& b, int i) {
        const int h = i / 128, k = (i % 128) / 32, l = i % 32;
        const int low = (b.ql[64 * h + l + 32 * (k % 2)] >> (4 * (k / 2))) & 0x0f;
        return low | (((b.qh[32 * h + l] >> (2 * k)) & 3) << 4);
    }
    static void to_f32(const Block& b, float* out) {
        const float d = half_to_float(b.d);
        for (int g = 0; g < 16; ++g) {
            const float dg = d * static_cast<float>(b.scales[g]);
            for (int l = 0; l < 16; ++l) out[16 * g + l] = dg * static_cast<float>(q_of(b, 16 * g + l) - 32);
        }
    }
    static constexpr bool has_min = false;
    static constexpr bool shared = false;  // every group of 16 has its own scale
    KQ_INLINE static void scales(const Block& b, float* sc, float*) {
        const float d = half_to_float(b.d);
#if defined(__AVX512F__)
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)b.scales)));
        _mm512_storeu_ps(sc, _mm512_mul_ps(v, _mm512_set1_ps(d)));
#else
        for (int g = 0; g < 16; ++g) sc[g] = d * static_cast<float>(b.scales[g]);
#endif
    }
#if defined(__AVX512F__)
    // Pair P = 4 h + k: weights h * 128 + 32 k + (0..15, 16..31), groups 2 P and 2 P + 1.
    template <int P>
    KQ_INLINE static void pair(const Block& b, __m512& q0, __m512& q1) {
        constexpr int h = P / 4, k = P % 4;
        const uint8_t* ql = b.ql + 64 * h + 32 * (k % 2);
        const uint8_t* qh = b.qh + 32 * h;
        const __m512i three = _mm512_set1_epi32(3);
        const __m512i l0 = k / 2 ? nib_hi(widen(ql)) : nib_lo(widen(ql));
        const __m512i l1 = k / 2 ? nib_hi(widen(ql + 16)) : nib_lo(widen(ql + 16));
        const __m512i h0 = _mm512_and_si512(_mm512_srli_epi32(widen(qh), 2 * k), three);
        const __m512i h1 = _mm512_and_si512(_mm512_srli_epi32(widen(qh + 16), 2 * k), three);
        const __m512i bias = _mm512_set1_epi32(32);
        q0 = as_float(_mm512_sub_epi32(_mm512_or_si512(l0, _mm512_slli_epi32(h0, 4)), bias));
        q1 = as_float(_mm512_sub_epi32(_mm512_or_si512(l1, _mm512_slli_epi32(h1, 4)), bias));
    }
#endif
};

// ---- Products for few rows ---------------------------------------------------------------------------

// One call's activations: x [M, K] float32 and its sums per 32 weights, xs [M, K / 32].
struct Job {
    const float* x;
    const float* xs;
    const void* w;
    int64_t M, K;
};

// The dense formats' weights as float32, 16 at a time (a masked tail for the last).
struct DenseF32 {
    using T = float;
    static float one(T v) { return v; }
#if defined(__AVX512F__)
    static __m512 load(const T* p) { return _mm512_loadu_ps(p); }
    static __m512 load(const T* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
#endif
};
struct DenseBF16 {
    using T = uint16_t;
    static float one(T v) { return bf16_to_float(v); }
#if defined(__AVX512F__)
    static __m512 load(const T* p) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
    }
    static __m512 load(const T* p, __mmask16 k) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
    }
#endif
};
struct DenseF16 {
    using T = uint16_t;
    static float one(T v) { return half_to_float(v); }
#if defined(__AVX512F__)
    static __m512 load(const T* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
    static __m512 load(const T* p, __mmask16 k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }
#endif
};

#if defined(__AVX512F__)
// A 32-weight block's head widened: lane 0 its scale d, lane 1 its min m (Q4_1, Q5_1: the next fp16).
// Only those 4 bytes are converted: the bytes after them (Q5's high bits) read as fp16 are often denormals
// or NaNs, which made the conversion take a slow path (Q5_1 at 2 rows ran 3x slower than Q4_1).
template <typename BT>
KQ_INLINE __m128 head32(const BT& b) {
    uint32_t dm;
    std::memcpy(&dm, &b, sizeof dm);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
}

// One weight row of block format F against MC activation rows starting at m0.  A block is read a pair of
// 16-weight groups (32 weights) at a time, its pairs unrolled (the pair index a template constant), values
// signed (the formats' zero points taken off) so only the formats with a min (Q4_1, Q5_1, Q4_K, Q5_K) add
// min * sum(x) per 32 weights, 16 at a time against the sums of x.  One activation row: the pair's two
// q . x are summed before their shared scale is applied, into four accumulators in turn (one chain would
// be bound by the FMA's latency); more rows: the scaled values are shared by every row.
template <typename F, int MC>
void block_row(const Job& j, const typename F::Block* w, int64_t m0, float* out) {
    constexpr int NP = static_cast<int>(F::groups / 2);  // pairs per block
    constexpr int A = MC == 1 ? 4 : 2;                   // accumulators per activation row
    const int64_t K = j.K, nb = K / F::block, np = K / 32;
    const float* x = j.x + m0 * K;
    const float* xs = j.xs + m0 * np;
    __m512 acc[MC][A], acco[MC];
    for (int m = 0; m < MC; ++m) {
        for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
        acco[m] = _mm512_setzero_ps();
    }
    alignas(64) float mins[16];
    int filled = 0;
    int64_t p0 = 0;  // the pair of x the buffered mins start at
    const auto flush = [&](bool last) __attribute__((always_inline)) {
        if (!F::has_min || (filled < 16 && !last) || filled == 0) return;
        const __mmask16 k = static_cast<__mmask16>(filled == 16 ? 0xffffu : (1u << filled) - 1u);
        const __m512 o = _mm512_maskz_load_ps(k, mins);
        for (int m = 0; m < MC; ++m) acco[m] = _mm512_fmadd_ps(o, _mm512_maskz_loadu_ps(k, xs + m * np + p0), acco[m]);
        p0 += filled;
        filled = 0;
    };
    // Pair P of block i scaled by s0 (its first 16 weights) and s1, into accumulator AC for one row.
    const auto step = [&]<int P, int AC>(int64_t i, __m512 s0, __m512 s1) __attribute__((always_inline)) {
        __m512 q0, q1;
        F::template pair<P>(w[i], q0, q1);
        const float* xp = x + i * F::block + 32 * P;
        if constexpr (MC == 1) {
            if constexpr (F::shared) {
                const __m512 t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xp + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xp)));
                acc[0][AC] = _mm512_fmadd_ps(t, s0, acc[0][AC]);
            } else {
                acc[0][AC] = _mm512_fmadd_ps(_mm512_mul_ps(q0, _mm512_loadu_ps(xp)), s0, acc[0][AC]);
                acc[0][AC ^ 1] = _mm512_fmadd_ps(_mm512_mul_ps(q1, _mm512_loadu_ps(xp + 16)), s1, acc[0][AC ^ 1]);
            }
        } else {
            const __m512 w0 = _mm512_mul_ps(q0, s0), w1 = _mm512_mul_ps(q1, s1);
            for (int m = 0; m < MC; ++m) {
                acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp + m * K), acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + m * K + 16), acc[m][1]);
            }
        }
    };
    if constexpr (NP == 1) {  // 32-weight blocks: the head in one conversion; blocks take accumulators in turn
        const auto block = [&]<int AC>(int64_t i) __attribute__((always_inline)) {
            const __m128 h = head32(w[i]);
            if constexpr (F::has_min) mins[filled++] = _mm_cvtss_f32(_mm_movehdup_ps(h));
            const __m512 d = _mm512_broadcastss_ps(h);
            step.template operator()<0, AC>(i, d, d);
            flush(false);
        };
        int64_t i = 0;
        for (; i + 4 <= nb; i += 4) {
            block.template operator()<0>(i);
            block.template operator()<1 % A>(i + 1);
            block.template operator()<2 % A>(i + 2);
            block.template operator()<3 % A>(i + 3);
        }
        for (; i < nb; ++i) block.template operator()<0>(i);
    } else {  // K-quants: the block's scales, then its eight pairs unrolled
        alignas(64) float sc[16];
        for (int64_t i = 0; i < nb; ++i) {
            F::scales(w[i], sc, mins + filled);
            [&]<int... P>(std::integer_sequence<int, P...>) __attribute__((always_inline)) {
                if constexpr (F::shared)
                    (step.template operator()<P, P % A>(i, _mm512_set1_ps(sc[P]), _mm512_set1_ps(sc[P])), ...);
                else
                    (step.template operator()<P, (2 * P) % A>(i, _mm512_set1_ps(sc[2 * P]), _mm512_set1_ps(sc[2 * P + 1])),
                     ...);
            }(std::make_integer_sequence<int, NP>());
            if constexpr (F::has_min) filled += NP;
            flush(false);
        }
    }
    flush(true);
    for (int m = 0; m < MC; ++m) {
        __m512 total = acco[m];
        for (int a = 0; a < A; ++a) total = _mm512_add_ps(total, acc[m][a]);
        out[m] = _mm512_reduce_add_ps(total);
    }
}

// One dense weight row (F32, BF16 or F16) against MC activation rows.
template <typename D, int MC>
void dense_row(const Job& j, const typename D::T* w, int64_t m0, float* out) {
    constexpr int U = MC == 1 ? 4 : MC == 2 ? 2 : 1;
    const int64_t K = j.K;
    const float* x = j.x + m0 * K;
    __m512 acc[MC][U];
    for (int m = 0; m < MC; ++m)
        for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U)
        for (int u = 0; u < U; ++u) {
            const __m512 wv = D::load(w + k + 16 * u);
            for (int m = 0; m < MC; ++m)
                acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k + 16 * u), acc[m][u]);
        }
    for (; k < K; k += 16) {
        const __mmask16 mask = static_cast<__mmask16>(K - k >= 16 ? 0xffffu : (1u << (K - k)) - 1u);
        const __m512 wv = D::load(w + k, mask);
        for (int m = 0; m < MC; ++m)
            acc[m][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * K + k), acc[m][0]);
    }
    for (int m = 0; m < MC; ++m) {
        __m512 a = acc[m][0];
        for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[m][u]);
        out[m] = _mm512_reduce_add_ps(a);
    }
}
#endif

// Calls fn.template operator()<MC>(m0) for m0 = 0, 8, 16, ... with MC = min(8, M - m0) as a constant.
template <typename Fn>
void for_row_chunks(int64_t M, Fn&& fn) {
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

// Row n of a matrix of block format F (K weights per row) as float32, exactly as the reference decoder.
template <typename F>
void dequantize_row(const void* w, int64_t n, int64_t K, float* out) {
    const int64_t nb = K / F::block;
    const auto* b = static_cast<const typename F::Block*>(w) + n * nb;
    for (int64_t i = 0; i < nb; ++i) F::to_f32(b[i], out + i * F::block);
}

template <typename D>
void dequantize_dense_row(const void* w, int64_t n, int64_t K, float* out) {
    const auto* r = static_cast<const typename D::T*>(w) + n * K;
    for (int64_t k = 0; k < K; ++k) out[k] = D::one(r[k]);
}

// The portable product of output rows [n0, n1): each weight row dequantized, then dotted.
template <typename Dequantize>
void rows_by_dequantizing(const Job& j, int64_t n0, int64_t n1, float* acc, int64_t ld, Dequantize&& dq) {
    std::vector<float> row(static_cast<size_t>(j.K));
    for (int64_t n = n0; n < n1; ++n) {
        dq(n, row.data());
        for (int64_t m = 0; m < j.M; ++m) {
            const float* x = j.x + m * j.K;
            float s = 0.f;
            for (int64_t k = 0; k < j.K; ++k) s += row[k] * x[k];
            acc[m * ld + (n - n0)] = s;
        }
    }
}

// Output rows [n0, n1) of block format F into acc[m * ld + (n - n0)].
template <typename F>
void block_rows(const Job& j, int64_t n0, int64_t n1, float* acc, int64_t ld) {
#if defined(__AVX512F__)
    const auto* w = static_cast<const typename F::Block*>(j.w);
    const int64_t nb = j.K / F::block;
    for (int64_t n = n0; n < n1; ++n)
        for_row_chunks(j.M, [&]<int MC>(int64_t m0) {
            float out[8];
            block_row<F, MC>(j, w + n * nb, m0, out);
            for (int m = 0; m < MC; ++m) acc[(m0 + m) * ld + (n - n0)] = out[m];
        });
#else
    rows_by_dequantizing(j, n0, n1, acc, ld, [&](int64_t n, float* row) { dequantize_row<F>(j.w, n, j.K, row); });
#endif
}

template <typename D>
void dense_rows(const Job& j, int64_t n0, int64_t n1, float* acc, int64_t ld) {
#if defined(__AVX512F__)
    const auto* w = static_cast<const typename D::T*>(j.w);
    for (int64_t n = n0; n < n1; ++n)
        for_row_chunks(j.M, [&]<int MC>(int64_t m0) {
            float out[8];
            dense_row<D, MC>(j, w + n * j.K, m0, out);
            for (int m = 0; m < MC; ++m) acc[(m0 + m) * ld + (n - n0)] = out[m];
        });
#else
    rows_by_dequantizing(j, n0, n1, acc, ld, [&](int64_t n, float* row) { dequantize_dense_row<D>(j.w, n, j.K, row); });
#endif
}

bool known(int wt) { return (wt >= F32 && wt <= Q8_0) || (wt >= F16 && wt <= Q6_K) || wt == MIXED; }

int64_t block_of(int wt) {
    switch (wt) {
        case F32:
        case BF16:
        case F16: return 1;
        case Q4_K:
        case Q5_K:
        case Q6_K: return 256;
        default: return 32;
    }
}

int64_t block_bytes_of(int wt) {
    switch (wt) {
        case F32: return 4;
        case BF16:
        case F16: return 2;
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        default: return 210;  // Q6_K
    }
}

// A MIXED matrix's bytes start with this header (int64 little-endian), then each segment's rows of
// blocks at its offset (from the header's first byte):
//   [MIXED_MAGIC, count, (type, rows, offset) x count]
constexpr int64_t MIXED_MAGIC = 0x4d49584544;  // "MIXED"
struct Segment {
    int type;
    int64_t row0, rows;
    const uint8_t* data;
};

std::vector<Segment> segments_of(const void* w) {
    const int64_t* h = static_cast<const int64_t*>(w);
    std::vector<Segment> out;
    if (h[0] != MIXED_MAGIC) return out;
    int64_t row0 = 0;
    for (int64_t s = 0; s < h[1]; ++s) {
        const int64_t* e = h + 2 + 3 * s;
        out.push_back({static_cast<int>(e[0]), row0, e[1], static_cast<const uint8_t*>(w) + e[2]});
        row0 += e[1];
    }
    return out;
}

void single_rows_of(const Job& j, int wt, int64_t n0, int64_t n1, float* acc, int64_t ld) {
    switch (wt) {
        case F32: dense_rows<DenseF32>(j, n0, n1, acc, ld); break;
        case BF16: dense_rows<DenseBF16>(j, n0, n1, acc, ld); break;
        case F16: dense_rows<DenseF16>(j, n0, n1, acc, ld); break;
        case Q4_0: block_rows<Q4_0F>(j, n0, n1, acc, ld); break;
        case Q4_1: block_rows<Q4_1F>(j, n0, n1, acc, ld); break;
        case Q5_0: block_rows<Q5_0F>(j, n0, n1, acc, ld); break;
        case Q5_1: block_rows<Q5_1F>(j, n0, n1, acc, ld); break;
        case Q8_0: block_rows<Q8_0F>(j, n0, n1, acc, ld); break;
        case Q4_K: block_rows<Q4_KF>(j, n0, n1, acc, ld); break;
        case Q5_K: block_rows<Q5_KF>(j, n0, n1, acc, ld); break;
        default: block_rows<Q6_KF>(j, n0, n1, acc, ld); break;
    }
}

// Output rows [n0, n1) of w (type wt, MIXED included) into acc[m * ld + (n - n0)].
void rows_of(const Job& j, int wt, const std::vector<Segment>& segments, int64_t n0, int64_t n1, float* acc,
             int64_t ld) {
    if (wt != MIXED) {
        single_rows_of(j, wt, n0, n1, acc, ld);
        return;
    }
    for (const Segment& s : segments) {
        const int64_t a = std::max(n0, s.row0), b = std::min(n1, s.row0 + s.rows);
        if (a >= b) continue;
        Job part = j;
        part.w = s.data;
        single_rows_of(part, s.type, a - s.row0, b - s.row0, acc + (a - n0), ld);
    }
}

void dequantize_single(const void* w, int wt, int64_t n, int64_t K, float* out) {
    switch (wt) {
        case F32: dequantize_dense_row<DenseF32>(w, n, K, out); break;
        case BF16: dequantize_dense_row<DenseBF16>(w, n, K, out); break;
        case F16: dequantize_dense_row<DenseF16>(w, n, K, out); break;
        case Q4_0: dequantize_row<Q4_0F>(w, n, K, out); break;
        case Q4_1: dequantize_row<Q4_1F>(w, n, K, out); break;
        case Q5_0: dequantize_row<Q5_0F>(w, n, K, out); break;
        case Q5_1: dequantize_row<Q5_1F>(w, n, K, out); break;
        case Q8_0: dequantize_row<Q8_0F>(w, n, K, out); break;
        case Q4_K: dequantize_row<Q4_KF>(w, n, K, out); break;
        case Q5_K: dequantize_row<Q5_KF>(w, n, K, out); break;
        default: dequantize_row<Q6_KF>(w, n, K, out); break;
    }
}

void dequantize_any(const void* w, int wt, const std::vector<Segment>& segments, int64_t n, int64_t K, float* out) {
    if (wt != MIXED) {
        dequantize_single(w, wt, n, K, out);
        return;
    }
    for (const Segment& s : segments)
        if (n >= s.row0 && n < s.row0 + s.rows) {
            dequantize_single(s.data, s.type, n - s.row0, K, out);
            return;
        }
}

}  // namespace

extern "C" {

// Returns the ABI version; the loader refuses a library that does not match.
int mechserve_kquants_abi(void) { return 1; }

// Whether this build knows weight type `wt` and a row of K weights is whole blocks of it (MIXED: checked
// per segment by the caller).
int mechserve_kquant_accepts(int wt, int64_t K) { return known(wt) && K > 0 && K % block_of(wt) == 0; }

// Bytes of one row of K weights of type `wt` (not MIXED).
int64_t mechserve_kquant_row_bytes(int wt, int64_t K) { return K / block_of(wt) * block_bytes_of(wt); }

// out [M, N] float32 = xf [M, K] (float32) times w [N, K] (type wt) transposed: unrounded, no bias.  `xb`
// (x's bfloat16 bits) is unused; the signature is linear.cpp's product(), so its fused blocks can call it.
void mechserve_kquant_product(const float* xf, const uint16_t* /*xb*/, int64_t M, int64_t K, const void* w, int wt,
                              int64_t N, float* out, int n_threads) {
    const int64_t np = K / 32;  // the sums of x per 32 weights (formats with a min)
    std::vector<float> xs(static_cast<size_t>(M * np), 0.f);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t p = 0; p < np; ++p) {
            float s = 0.f;
            for (int64_t e = 0; e < 32; ++e) s += xf[m * K + p * 32 + e];
            xs[m * np + p] = s;
        }
    const Job job{xf, xs.data(), w, M, K};
    const std::vector<Segment> segments = wt == MIXED ? segments_of(w) : std::vector<Segment>{};
    // Each thread owns a contiguous range of output rows, a multiple of 16.
    const int64_t per = ((N + n_threads - 1) / n_threads + 15) / 16 * 16;
#pragma omp parallel num_threads(n_threads)
    {
        std::vector<float> acc;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n_threads; ++t) {
            const int64_t n0 = t * per, n1 = std::min(N, n0 + per);
            if (n0 >= n1) continue;
            acc.resize(static_cast<size_t>(M * (n1 - n0)));
            rows_of(job, wt, segments, n0, n1, acc.data(), n1 - n0);
            for (int64_t m = 0; m < M; ++m)
                std::memcpy(out + m * N + n0, acc.data() + m * (n1 - n0), sizeof(float) * (n1 - n0));
        }
    }
}

// Columns [n0, n1) of x . w^T into out[m * ldo + n], on the calling thread: xf [M, K] float32, xs [M, K / 32]
// the sums of xf per 32 weights, w [N, K] of type wt.  linear.cpp's fused blocks call it from each thread of
// their team for its share of the columns (registered by model/linear.py's external_formats).
void mechserve_kquant_columns(const float* xf, const float* xs, int64_t M, int64_t K, const void* w, int wt,
                              int64_t n0, int64_t n1, float* out, int64_t ldo) {
    const Job job{xf, xs, w, M, K};
    const std::vector<Segment> segments = wt == MIXED ? segments_of(w) : std::vector<Segment>{};
    rows_of(job, wt, segments, n0, n1, out + n0, ldo);
}

// y [M, N] (yt: F32 or BF16) = x [M, K] (xt: F32 or BF16) times w [N, K] (wt) transposed, plus bias [N]
// (type xt) unless null; accumulated in float32 and rounded once.  All tensors contiguous.
void mechserve_kquant_linear(const void* x, int xt, const void* w, int wt, const void* bias, void* y, int yt, int64_t M,
                             int64_t N, int64_t K, int n_threads) {
    std::vector<float> xf(static_cast<size_t>(M * K));
    for (int64_t i = 0; i < M * K; ++i) xf[i] = load_value(x, xt, i);
    std::vector<float> acc(static_cast<size_t>(M * N));
    mechserve_kquant_product(xf.data(), nullptr, M, K, w, wt, N, acc.data(), n_threads);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            float v = acc[m * N + n];
            if (bias) v += load_value(bias, xt, n);
            store_value(y, yt, m * N + n, v);
        }
}

// out [R, K] (ot: F32 or BF16) = rows ids[0..R) of w [N, K] (type wt), dequantized as the reference
// decoder does: an embedding lookup, or a slice of a matrix for a product at many rows.
void mechserve_kquant_dequantize_rows(const void* w, int wt, const int64_t* ids, int64_t R, int64_t K, void* out,
                                      int ot, int n_threads) {
    const std::vector<Segment> segments = wt == MIXED ? segments_of(w) : std::vector<Segment>{};
#pragma omp parallel num_threads(n_threads)
    {
        std::vector<float> row(static_cast<size_t>(K));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r) {
            dequantize_any(w, wt, segments, ids[r], K, row.data());
            if (ot == F32)
                std::memcpy(static_cast<float*>(out) + r * K, row.data(), sizeof(float) * K);
            else
                for (int64_t k = 0; k < K; ++k) store_value(out, ot, r * K + k, row[k]);
        }
    }
}

}  // extern "C"
