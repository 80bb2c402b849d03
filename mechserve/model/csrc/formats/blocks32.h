// The few-row product on 32-weight blocks with an fp16 scale d (and, for Q4_1, an fp16 min m) at their head,
// shared by formats/q4_1.h and formats/q8_0.h.  A format F gives `Block`, `has_min` and, with AVX-512,
// `values(block, lo, hi)` (its 32 q as two float vectors); the portable path calls `dot(block, x, xsum)`.
//
// A Q4_1 block's dot product is d * (q . x) + m * sum(x), so the sums of x per block are taken once per
// call.  The AVX-512 block loop widens a block's 32 weights to two float vectors and its fp16 head with one
// 4-value conversion.  At one activation row each block adds d * (q . x) into one of two accumulators
// (alternate blocks, hiding the FMA latency); from two rows on, q is scaled by d once and shared by every
// row.  The mins are kept per 16 blocks and their m * sum(x) added with one vector FMA against the block
// sums.  R weight rows at a time share each activation load.
#pragma once

#include <algorithm>

#include "../common.h"

namespace mechserve {

// The activations of one product: float32 rows, their bfloat16 bits (bfloat16 activations only, else null)
// and, when the format asks (Q4_1), their sums per 32-weight block.
struct Job {
    const float* xf;      // [M, K]
    const uint16_t* xb;   // [M, K] or nullptr
    const float* xsum;    // [M, K / 32] or nullptr
    const void* w;        // the weight matrix [N, K] in its format
    int64_t M, K;
};

#if defined(__AVX512F__)
// A block's head widened: its first 4 fp16 values at once (lane 0 d, lane 1 Q4_1's m).
template <typename BT>
inline __m128 block_head(const BT& b) {
    return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)&b));
}

// R quantized weight rows against MC activation rows (K a multiple of 32), in chunks of 16 blocks.
template <typename F, int MC, int R>
void blocks32_rows(const Job& j, const typename F::Block* const* rows, int64_t m0, float out[][8]) {
    constexpr bool q4 = F::has_min;
    constexpr int A = MC <= 4 ? 2 : 1;  // accumulators per (weight row, activation row)
    constexpr int64_t QK = 32;
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
                for (int r = 0; r < R; ++r) F::values(rows[r][i0 + e], lo[r], hi[r]);
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
                    F::values(rows[r][i0 + e], lo[r], hi[r]);
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
#else
template <typename F, int MC, int R>
void blocks32_rows(const Job& j, const typename F::Block* const* rows, int64_t m0, float out[][8]) {
    const int64_t nb = j.K / 32;
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MC; ++m) {
            const float* x = j.xf + (m0 + m) * j.K;
            const float* xs = j.xsum ? j.xsum + (m0 + m) * nb : nullptr;
            float s = 0.f;
            for (int64_t i = 0; i < nb; ++i) s += F::dot(rows[r][i], x + i * 32, xs ? xs[i] : 0.f);
            out[r][m] = s;
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

// Output columns [n0, n1) of out [M, ldo] for the few-row product, R weight rows at a time.
template <typename F, int QR>
void blocks32_few(const Job& j, int64_t n0, int64_t n1, float* out, int64_t ldo) {
    using B = typename F::Block;
    const B* w = static_cast<const B*>(j.w);
    const int64_t nb = j.K / 32;
    const auto tile = [&]<int R>(int64_t n) {
        const B* rows[R];
        for (int r = 0; r < R; ++r) rows[r] = w + (n + r) * nb;
        for_row_chunks(j.M, [&]<int MC>(int64_t m0) {
            float o[R][8];
            blocks32_rows<F, MC, R>(j, rows, m0, o);
            for (int r = 0; r < R; ++r)
                for (int m = 0; m < MC; ++m) out[(m0 + m) * ldo + n + r] = o[r][m];
        });
    };
    int64_t n = n0;
    for (; n + QR <= n1; n += QR) tile.template operator()<QR>(n);
    for (; n < n1; ++n) tile.template operator()<1>(n);
}

}  // namespace mechserve
