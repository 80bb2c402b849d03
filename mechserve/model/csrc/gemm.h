// The matrix product y[m, n] = sum_k x[m, k] * w[n, k] at any row count, each weight read from memory once
// per call, in the layout it is stored (torch's F.linear: x [M, K], w [N, K]; formats.h lists the formats).
//
// Few rows (up to a format's `few_rows`) go to the format's own kernel on its stored blocks.  More rows go
// through register-blocked tiles: the weight rows are taken NR at a time (as stored when they already are
// the compute type, else a format's blocks dequantized once into a per-thread buffer that stays in L1),
// and every MR activation rows are multiplied against them by a micro-kernel that keeps MR x NR
// accumulators in registers across the whole of K and sums each of them at the end (the dot-product form:
// both operands are read along K, so nothing is packed or transposed).  The next weight tile is prefetched
// while the activation rows pass over the current one.  The activation rows of a call are taken in blocks
// that fit the L2 cache, so a weight tile is read from memory once for a decode step and a few times from
// L3 for a long prefill.
//
// Compute types: with AVX512-BF16 and bfloat16 activations the tiles are bfloat16 and the micro-kernel is
// VDPBF16PS (32 exact products into 16 float32 lanes); otherwise float32 tiles and FMAs (AVX-512, else
// AVX2 + FMA, else plain loops the compiler vectorises).  With AVX2 and no AVX-512, bfloat16 weights are
// not converted into a tile: the micro-kernel widens them as it reads them (WIDEN_IN_TILE).  Accumulation is float32 throughout.  So a
// quantized matrix with bfloat16 activations is multiplied with its weights rounded to bfloat16, as the
// reference (quantized.dequantize to bfloat16, then torch) does; with float32 activations, exactly.
//
// Threads: the caller's OpenMP team; each thread owns a contiguous range of output columns (weight rows,
// a multiple of 16), so each weight is read by one thread.
#pragma once

#include <omp.h>

#include <algorithm>
#include <type_traits>

#include "formats.h"

namespace mechserve {

constexpr int64_t L2_ACTIVATIONS = 512 * 1024;  // bytes of activation rows kept in L2 per pass over the weights

#if defined(__AVX512F__)
constexpr int MR = 4, NR = 4;  // activation rows x weight rows per micro-kernel
constexpr bool WIDEN_IN_TILE = false;
constexpr int WIDE_MR = MR, WIDE_NR = NR;
constexpr int TALL_MR = WIDE_MR, TALL_NR = WIDE_NR;

// The 16 horizontal sums of v[0..16) as one vector (lane i = sum of v[i]'s lanes): pairs of vectors are
// interleaved and added within 128-bit lanes, then the 128-bit lanes are transposed and added.
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

// c[m * ldc + n] = the sum of acc[m][n]'s lanes, four rows (16 sums) at a time.
template <int R, int C>
inline void store_tile(__m512 acc[][NR], float* c, int64_t ldc) {
    for (int g = 0; g < R; g += 4) {
        __m512 v[16];
        for (int i = 0; i < 16; ++i) v[i] = _mm512_setzero_ps();
        for (int m = g; m < std::min(R, g + 4); ++m)
            for (int n = 0; n < C; ++n) v[(m - g) * NR + n] = acc[m][n];
        alignas(64) float s[16];
        _mm512_store_ps(s, sum16(v));
        for (int m = g; m < std::min(R, g + 4); ++m) {
            if constexpr (C == NR)
                _mm_storeu_ps(c + m * ldc, _mm_load_ps(s + NR * (m - g)));
            else
                for (int n = 0; n < C; ++n) c[m * ldc + n] = s[NR * (m - g) + n];
        }
    }
}

// R x C outputs c[m * ldc + n] = x[m] . w[n] over K, x rows ldx apart, float32.
template <int R, int C>
void tile_f32(const float* x, int64_t ldx, const float* const* w, int64_t K, float* c, int64_t ldc) {
    // Independent sums per output for a single row, to hide the FMA latency; chosen by the row count alone
    // so that an output does not depend on how the columns were split between threads.
    constexpr int U = R == 1 ? 2 : 1;
    __m512 acc[U][R][NR];
    for (int u = 0; u < U; ++u)
        for (int m = 0; m < R; ++m)
            for (int n = 0; n < C; ++n) acc[u][m][n] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U)
        for (int u = 0; u < U; ++u) {
            __m512 wv[NR];
            for (int n = 0; n < C; ++n) wv[n] = _mm512_loadu_ps(w[n] + k + 16 * u);
            for (int m = 0; m < R; ++m) {
                const __m512 xv = _mm512_loadu_ps(x + m * ldx + k + 16 * u);
                for (int n = 0; n < C; ++n) acc[u][m][n] = _mm512_fmadd_ps(xv, wv[n], acc[u][m][n]);
            }
        }
    for (; k < K; k += 16) {
        const __mmask16 mask = static_cast<__mmask16>(K - k >= 16 ? 0xffffu : (1u << (K - k)) - 1u);
        __m512 wv[NR];
        for (int n = 0; n < C; ++n) wv[n] = _mm512_maskz_loadu_ps(mask, w[n] + k);
        for (int m = 0; m < R; ++m) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);
            for (int n = 0; n < C; ++n) acc[0][m][n] = _mm512_fmadd_ps(xv, wv[n], acc[0][m][n]);
        }
    }
    for (int u = 1; u < U; ++u)
        for (int m = 0; m < R; ++m)
            for (int n = 0; n < C; ++n) acc[0][m][n] = _mm512_add_ps(acc[0][m][n], acc[u][m][n]);
    store_tile<R, C>(acc[0], c, ldc);
}

#if defined(__AVX512BF16__)
// The same on bfloat16 rows: VDPBF16PS multiplies 32 pairs exactly and adds them into 16 float32 lanes.
template <int R, int C>
void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t K, float* c, int64_t ldc) {
    constexpr int U = R == 1 ? 2 : 1;
    __m512 acc[U][R][NR];
    for (int u = 0; u < U; ++u)
        for (int m = 0; m < R; ++m)
            for (int n = 0; n < C; ++n) acc[u][m][n] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U)
        for (int u = 0; u < U; ++u) {
            __m512bh wv[NR];
            for (int n = 0; n < C; ++n) wv[n] = (__m512bh)_mm512_loadu_si512(w[n] + k + 32 * u);
            for (int m = 0; m < R; ++m) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + k + 32 * u);
                for (int n = 0; n < C; ++n) acc[u][m][n] = _mm512_dpbf16_ps(acc[u][m][n], xv, wv[n]);
            }
        }
    for (; k < K; k += 32) {
        const __mmask32 mask = static_cast<__mmask32>(K - k >= 32 ? 0xffffffffu : (1u << (K - k)) - 1u);
        __m512bh wv[NR];
        for (int n = 0; n < C; ++n) wv[n] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[n] + k);
        for (int m = 0; m < R; ++m) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
            for (int n = 0; n < C; ++n) acc[0][m][n] = _mm512_dpbf16_ps(acc[0][m][n], xv, wv[n]);
        }
    }
    for (int u = 1; u < U; ++u)
        for (int m = 0; m < R; ++m)
            for (int n = 0; n < C; ++n) acc[0][m][n] = _mm512_add_ps(acc[0][m][n], acc[u][m][n]);
    store_tile<R, C>(acc[0], c, ldc);
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int MR = 2, NR = 4;

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Without AVX-512 a bfloat16 weight row is widened to float32 in the micro-kernel as it is read (8 at a
// time: zero-extend, shift), not converted into a tile buffer first; so bfloat16 weights take the tiles from
// 2 rows on (DenseBF16's few_rows is 1 here), and each output of a product of 2 or more rows is summed in one
// order whatever the row count: 8 lanes along K, their sum, then the tail.  Their tiles are 4 activation rows
// x 3 weight rows (12 accumulators, 3 weight vectors and an activation vector: the 16 ymm registers), which
// spreads each widening over more rows; measured against 2 x 4, 4 x 2 and 3 x 4 on SmolLM2's shapes read
// from memory (docs/benchmarks.md, issue 27): faster from 2 rows on.  One row stays in the few-row loop,
// which streams one weight row at a time: the tiles measured up to 20% slower there.  (Float32 weights, with
// nothing to widen, were faster in 2 x 4 tiles and their few-row loops.)
//
// A row count that leaves a short last tile (5 rows: 4 + 1; 9: 4 + 4 + 1) pays for the widening again on its
// last rows' tile: 1 x 3 spends 3 loads and 6 widening steps on 3 FMAs.  Such counts take 6 x 2 tiles
// instead (12 accumulators, 2 weight vectors, an activation vector: 15 registers), in which 5 rows are one
// tile (`tall_tiles`: where that counts at least 5% fewer instructions).  The products are the same sums in
// the same order either way, so the result does not change with the tile shape.
constexpr bool WIDEN_IN_TILE = true;
constexpr int WIDE_MR = 4, WIDE_NR = 3;
constexpr int TALL_MR = 6, TALL_NR = 2;
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline float widen1(float v) { return v; }
inline float widen1(uint16_t v) { return bf16_to_float(v); }

template <int R, int C, typename WT = float>
void tile_f32(const float* x, int64_t ldx, const WT* const* w, int64_t K, float* c, int64_t ldc) {
    __m256 acc[R][C];
    for (int m = 0; m < R; ++m)
        for (int n = 0; n < C; ++n) acc[m][n] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[C];
        for (int n = 0; n < C; ++n) wv[n] = load8(w[n] + k);
        for (int m = 0; m < R; ++m) {
            const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
            for (int n = 0; n < C; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
        }
    }
    for (int m = 0; m < R; ++m)
        for (int n = 0; n < C; ++n) {
            float s = hsum8(acc[m][n]);
            for (int64_t kk = k; kk < K; ++kk) s += x[m * ldx + kk] * widen1(w[n][kk]);
            c[m * ldc + n] = s;
        }
}
#else
constexpr int MR = 2, NR = 4;
constexpr bool WIDEN_IN_TILE = false;
constexpr int WIDE_MR = MR, WIDE_NR = NR;
constexpr int TALL_MR = WIDE_MR, TALL_NR = WIDE_NR;

template <int R, int C>
void tile_f32(const float* x, int64_t ldx, const float* const* w, int64_t K, float* c, int64_t ldc) {
    for (int m = 0; m < R; ++m)
        for (int n = 0; n < C; ++n) {
            const float* xr = x + m * ldx;
            const float* wr = w[n];
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < K; ++k) s += xr[k] * wr[k];
            c[m * ldc + n] = s;
        }
}
#endif

// The micro-kernel for r <= MR rows and c <= NR columns, chosen once from a table of every shape: activations
// of the compute type CT against weight rows of type WT (CT, or bfloat16 widened as read: WIDEN_IN_TILE).
template <typename CT, typename WT = CT>
using TileFn = void (*)(const CT*, int64_t, const WT* const*, int64_t, float*, int64_t);

template <typename CT, typename WT, int R, int C>
constexpr TileFn<CT, WT> tile_fn() {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<CT, uint16_t>) return &tile_bf16<R, C>;
    else
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        return &tile_f32<R, C, WT>;
#else
        return &tile_f32<R, C>;
#endif
}

template <typename CT, typename WT = CT, int TMR = MR, int TNR = NR>
struct Tiles {
    TileFn<CT, WT> fn[TMR + 1][TNR + 1];
    constexpr Tiles() : fn{} {
        [&]<int... Rs>(std::integer_sequence<int, Rs...>) {
            (
                [&]<int R>() {
                    [&]<int... Cs>(std::integer_sequence<int, Cs...>) {
                        ((fn[R + 1][Cs + 1] = tile_fn<CT, WT, R + 1, Cs + 1>()), ...);
                    }(std::make_integer_sequence<int, TNR>{});
                }.template operator()<Rs>(),
                ...);
        }(std::make_integer_sequence<int, TMR>{});
    }
};

// Weight rows [n, n + r) of a format's matrix as rows of the compute type, `ld` apart.
template <typename F>
void tile_to_f32(const void* w, int64_t K, int64_t n, int r, float* out, int64_t ld) {
    using B = typename F::Block;
    const int64_t nb = K / F::block;
    const B* b = static_cast<const B*>(w) + n * nb;
    for (int i = 0; i < r; ++i)
        for (int64_t e = 0; e < nb; ++e) F::to_f32(b[i * nb + e], out + i * ld + e * F::block);
}

template <typename F>
void tile_to_bf16(const void* w, int64_t K, int64_t n, int r, uint16_t* out, int64_t ld, float* row) {
    for (int i = 0; i < r; ++i) {
        tile_to_f32<F>(w, K, n + i, 1, row, K);
        uint16_t* o = out + i * ld;
        int64_t k = 0;
#if defined(__AVX512BF16__)
        for (; k + 32 <= K; k += 32)
            _mm512_storeu_si512(o + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + k + 16), _mm512_loadu_ps(row + k)));
#endif
        for (; k < K; ++k) o[k] = float_to_bf16(row[k]);
    }
}

constexpr int64_t FAR = 4;  // tiles ahead whose weights are prefetched into L2
// Stored bytes of the tile of weight rows from n (up to nr rows before n1), in `calls` equal shares of lines.
struct Ahead {
    const char* at;
    int64_t lines, per_call;
};
inline Ahead ahead(const char* src, int64_t n, int64_t n1, int64_t row_bytes, int64_t calls, int64_t nr) {
    const int64_t bytes = n < n1 ? std::min<int64_t>(nr, n1 - n) * row_bytes : 0, lines = (bytes + 63) / 64;
    return {src + n * row_bytes, lines, (lines + calls - 1) / calls};
}

// Stored rows used as they are by the micro-kernel (WIDEN_IN_TILE): bfloat16 rows, float32 compute.
template <typename F, typename CT>
constexpr bool widened_rows() {
    return WIDEN_IN_TILE && F::block == 1 && std::is_same_v<typename F::Block, uint16_t> && std::is_same_v<CT, float>;
}

// Weight rows [n0, n1) against every activation row, in TMR x TNR tiles of the compute type CT, into out [M, ldo].
template <typename F, typename CT, int TMR, int TNR>
void tiled_as(const Job& j, int64_t n0, int64_t n1, float* out, int64_t ldo) {
    using B = typename F::Block;
    // stored rows used as they are: the compute type, or (WIDEN_IN_TILE) bfloat16 widened by the micro-kernel
    constexpr bool widened = widened_rows<F, CT>();
    constexpr bool direct = F::block == 1 && (sizeof(B) == sizeof(CT) || widened);
    using WT = std::conditional_t<widened, uint16_t, CT>;
    static constexpr Tiles<CT, WT, TMR, TNR> tiles{};
    thread_local Buffer<CT> tile_buf;
    thread_local Buffer<float> row_buf;
    const int64_t K = j.K, M = j.M;
    const CT* x;
    if constexpr (std::is_same_v<CT, float>) x = j.xf;
    else x = j.xb;
    const int64_t ld = (K + 31) / 32 * 32;  // a converted row starts on a 64-byte line
    CT* tb = direct ? nullptr : grown(tile_buf, static_cast<size_t>(TNR * ld));
    float* rb = std::is_same_v<CT, float> || direct ? nullptr : grown(row_buf, static_cast<size_t>(K));
    const int64_t row_bytes = K / F::block * static_cast<int64_t>(sizeof(B));
    const char* src = static_cast<const char*>(j.w);
    const int64_t block_rows =
        std::max<int64_t>(TMR, L2_ACTIVATIONS / (K * static_cast<int64_t>(sizeof(CT))) / TMR * TMR);
    for (int64_t mb = 0; mb < M; mb += block_rows) {
        const int64_t me = std::min(M, mb + block_rows);
        const int64_t calls = (me - mb + TMR - 1) / TMR;
        for (int64_t n = n0; n < n1; n += TNR) {
            const int nr = static_cast<int>(std::min<int64_t>(TNR, n1 - n));
            const WT* rows[TNR];
            if constexpr (direct) {
                for (int r = 0; r < TNR; ++r) rows[r] = reinterpret_cast<const WT*>(src + (n + std::min(r, nr - 1)) * row_bytes);
            } else {
                if constexpr (std::is_same_v<CT, float>) tile_to_f32<F>(j.w, K, n, nr, tb, ld);
                else tile_to_bf16<F>(j.w, K, n, nr, tb, ld, rb);
                for (int r = 0; r < TNR; ++r) rows[r] = tb + std::min(r, nr - 1) * ld;
            }
            // the stored bytes of the tiles FAR ahead (into L2) and of the next one (into L1), a share per
            // micro-kernel call, while this tile is in use
            const Ahead far = ahead(src, n + FAR * TNR, n1, row_bytes, calls, TNR), near = ahead(src, n + TNR, n1, row_bytes, calls, TNR);
            int64_t line = 0;
            for (int64_t m = mb; m < me; m += TMR) {
                for (int64_t q = 0; q < far.per_call; ++q, ++line) {
                    if (line < far.lines) __builtin_prefetch(far.at + line * 64, 0, 2);
                    if (line < near.lines) __builtin_prefetch(near.at + line * 64, 0, 3);
                }
                const int mr = static_cast<int>(std::min<int64_t>(TMR, me - m));
                tiles.fn[mr][nr](x + m * K, K, rows, K, out + m * ldo + n, ldo);
            }
        }
    }
}

// Vector instructions per weight row and 8 lanes of K for M activation rows in TMR x TNR tiles of widened
// bfloat16 rows: a tile of r rows loads and widens its TNR weight vectors once (3 instructions each), loads r
// activation vectors and runs r x TNR FMAs; counted per WIDE_NR x TALL_NR weight rows, to stay in integers.
constexpr int64_t widened_work(int64_t M, int TMR, int TNR) {
    int64_t work = 0;
    for (int64_t m = 0; m < M; m += TMR) {
        const int64_t r = std::min<int64_t>(TMR, M - m);
        work += 3 * TNR + r + r * TNR;
    }
    return work * (WIDE_NR * TALL_NR) / TNR;
}

// Whether M rows of widened bfloat16 take TALL_MR x TALL_NR tiles: where they count at least 5% fewer
// instructions than WIDE_MR x WIDE_NR, up to 20 rows, where that was measured (with AVX2's shapes: 5, 6, 9, 10,
// 17 and 18 rows; SmolLM2's layers 10.6%, 7.7%, 11%, 9% and 4% faster at 5, 6, 9, 10 and 17, its LM head
// 13%, 10%, 14%, 11% and 6%, 18 rows not measured: docs/benchmarks.md, issue 27, "Short last tiles").
constexpr bool tall_tiles(int64_t M) {
    if constexpr (TALL_MR == WIDE_MR && TALL_NR == WIDE_NR) return false;
    return M <= 20 && widened_work(M, TALL_MR, TALL_NR) * 20 <= widened_work(M, WIDE_MR, WIDE_NR) * 19;
}

// Weight rows [n0, n1) against every activation row, into out [M, ldo], in tiles of the compute type's shape
// (MR x NR), or WIDE_MR x WIDE_NR (TALL_MR x TALL_NR where `tall_tiles`) for bfloat16 rows widened as read.
template <typename F, typename CT>
void tiled(const Job& j, int64_t n0, int64_t n1, float* out, int64_t ldo) {
    if constexpr (widened_rows<F, CT>()) {
        if constexpr (TALL_MR != WIDE_MR || TALL_NR != WIDE_NR)
            if (tall_tiles(j.M)) return tiled_as<F, CT, TALL_MR, TALL_NR>(j, n0, n1, out, ldo);
        return tiled_as<F, CT, WIDE_MR, WIDE_NR>(j, n0, n1, out, ldo);
    }
    tiled_as<F, CT, MR, NR>(j, n0, n1, out, ldo);
}

// The activations' per-32-weight-block sums that a format's few-row kernel wants (Q4_1), for the team.
inline void block_sums(const float* xf, int64_t M, int64_t K, float* xsum) {
    const int64_t nb = K / 32;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < nb; ++i) {
            float s = 0.f;
            for (int64_t e = 0; e < 32; ++e) s += xf[m * K + i * 32 + e];
            xsum[m * nb + i] = s;
        }
}

// out [M, ldo] (columns [0, N)) = x . w^T for every thread of the calling OpenMP team: each thread writes
// its own columns.  `xsum` is scratch for M * K / 32 floats (used by Q4_1's few-row kernel).  Ends without
// a barrier: the caller puts one before it reads `out` across columns.
template <typename F>
void product_team_f(Job j, int64_t N, float* out, int64_t ldo, float* xsum) {
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = ((N + T - 1) / T + 15) / 16 * 16;
    const int64_t n0 = std::min<int64_t>(N, t * per), n1 = std::min<int64_t>(N, n0 + per);
    if constexpr (F::few_rows > 0) {  // (a format without a few-row kernel need not define `few`)
        if (j.M <= F::few_rows) {
            if constexpr (F::has_min) {
                block_sums(j.xf, j.M, j.K, xsum);  // ends with the team's barrier
                j.xsum = xsum;
            }
            if (n0 < n1) F::few(j, n0, n1, out, ldo);
            return;
        }
    }
    if (n0 >= n1) return;
#if defined(__AVX512BF16__)
    if (j.xb) return tiled<F, uint16_t>(j, n0, n1, out, ldo);
#endif
    tiled<F, float>(j, n0, n1, out, ldo);
}

inline void product_team(const Job& j, int wt, int64_t N, float* out, int64_t ldo, float* xsum) {
    with_format(wt, [&](auto fmt) { product_team_f<decltype(fmt)>(j, N, out, ldo, xsum); });
}

}  // namespace mechserve
