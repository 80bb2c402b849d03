// What every part of the linear kernel shares: the storage types' numbers (mechserve/model/linear.py's
// TYPES), 64-byte aligned buffers, and the scalar conversions between float32, bfloat16 and fp16.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace mechserve {

// A storage type's number: the activations' (F32, BF16) or a weight matrix's (those, or a block format of
// formats.h).  The numbers are linear.py's TYPES; a new block format takes the next free one.
enum Type : int { F32 = 0, BF16 = 1, Q4_1 = 2, Q8_0 = 3 };

// Buffers start on a 64-byte line, so 64-byte loads of a row (K a multiple of 16 floats) never straddle two
// lines: std::vector's default 16-byte alignment cost 25-40% at 8 rows.
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

// A buffer that only grows: a call's temporaries reuse the previous call's memory (a fresh multi-megabyte
// allocation per call is a page fault per 4 KiB on first touch).
template <typename T>
T* grown(Buffer<T>& b, size_t n) {
    if (b.size() < n) b.resize(n);
    return b.data();
}

inline float bf16_to_float(uint16_t bits) {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const uint32_t nan = (u >> 16) | 0x40u;              // a NaN stays a quiet NaN
    const uint32_t even = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even, as torch does
    return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : even);
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

// v rounded to the activations' type and back (the identity in float32).
inline float rnd(int type, float v) { return type == BF16 ? bf16_to_float(float_to_bf16(v)) : v; }

// The same three for a type known at compile time (T = F32 or BF16), so that loops over them vectorise.
template <int T>
inline float ld(const void* p, int64_t i) {
    if constexpr (T == F32) return static_cast<const float*>(p)[i];
    else return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}
template <int T>
inline float rn(float v) {
    if constexpr (T == F32) return v;
    else return bf16_to_float(float_to_bf16(v));
}
template <int T>
inline void st(void* p, int64_t i, float v) {
    if constexpr (T == F32) static_cast<float*>(p)[i] = v;
    else static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
}

}  // namespace mechserve
