// The forward's matrix products and a decoder layer's two dense blocks, at any row count.
//
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])      x: [M, K], w: [N, K] (torch's F.linear)
//
// w is float32, bfloat16 or a GGUF block format (formats.h), multiplied in the layout it is stored and read
// from memory once per call (gemm.h: a format's few-row kernel for a few rows, register-blocked tiles for
// more); GGUF's other formats (K-quants) by csrc/kquants.cpp's columns, registered at run time (the issue 30
// hook, below).  Accumulation is float32 for every storage type; bias is added in float32 and the result rounded
// once to the output type.
//
// Each entry point runs as one OpenMP team of `n_threads` threads (on the runtime torch already loaded:
// libgomp by soname): the products split the output columns between the threads, the elementwise steps
// between the products (norms, RoPE, SiLU, residuals) split the rows, with a barrier between phases.
// Temporaries live in buffers kept per calling thread that only grow.
//
// Built with -fvisibility=hidden (linear.py): everything but the extern "C" entry points stays inside the
// library.  Otherwise the templates' static locals (the tiles' tables and buffers, their guards) are GNU
// unique symbols, bound once per process: a second build of this source loaded beside the first (the
// tests load the portable builds next to the native one) used the first one's tables, sized for its
// own tile shape, and wrote garbage or crashed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gemm.h"

namespace mechserve {
namespace {

// Per calling thread: the temporaries of one call, reused by the next.
struct Work {
    Buffer<float> xf, y, a, b, c, sums;
    Buffer<uint16_t> yb, ab;
};
Work& work() {
    thread_local Work w;
    return w;
}

// issue 30 hook: weight types >= EXTERNAL_TYPES are GGUF's other formats (model/kquants.py), multiplied by
// csrc/kquants.cpp's mechserve_kquant_columns, which model/linear.py registers here (external_formats).
// Its arguments: xf [M, K] float32, xs [M, K / 32] the sums of xf per 32 weights, M, K, w [N, K] of type wt,
// the output columns [n0, n1) to write into out [M, ldo].
using ColumnsFn = void (*)(const float*, const float*, int64_t, int64_t, const void*, int, int64_t, int64_t, float*,
                           int64_t);
ColumnsFn external_columns = nullptr;
constexpr int EXTERNAL_TYPES = 16;

// Whether the entry points multiply weights of type `wt`: the formats of formats.h, and GGUF's other
// formats once their product is registered.
inline bool takes_format(int wt) { return known_format(wt) || (wt >= EXTERNAL_TYPES && external_columns); }

// gemm.h's product_team for any type takes_format holds for: an external type's columns are split between
// the team's threads as gemm.h splits them, each thread's share multiplied by the registered function after
// the team has summed the activations per 32 weights into `xsum`.  Ends without a barrier (as product_team).
inline void product_any(const Job& j, int wt, int64_t N, float* out, int64_t ldo, float* xsum) {
    if (wt < EXTERNAL_TYPES) return product_team(j, wt, N, out, ldo, xsum);
    block_sums(j.xf, j.M, j.K, xsum);  // ends with the team's barrier
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = ((N + T - 1) / T + 15) / 16 * 16;
    const int64_t n0 = std::min<int64_t>(N, t * per), n1 = std::min<int64_t>(N, n0 + per);
    if (n0 < n1) external_columns(j.xf, xsum, j.M, j.K, j.w, wt, n0, n1, out, ldo);
}

// Whether a product with weights `wt` over M rows reads its activations as float32 (else only their
// bfloat16 bits, when the activations are bfloat16 and the tiles are bfloat16).
inline bool wants_f32(int wt, int64_t M, bool bf16_acts) {
    if (wt >= EXTERNAL_TYPES) return true;  // issue 30 hook: kquants.cpp reads float32
#if defined(__AVX512BF16__)
    if (bf16_acts && (wt == BF16 || M > with_format(wt, [](auto f) { return decltype(f)::few_rows; }))) return false;
#endif
    (void)wt, (void)M, (void)bf16_acts;
    return true;
}

// Rows [0, M) of x [M, K] (type xt) as float32: x itself when float32, else a converted copy (the team
// splits the rows; ends with the team's barrier).
const float* as_f32(const void* x, int xt, int64_t M, int64_t K, Buffer<float>& buf, bool wanted) {
    if (xt == F32) return static_cast<const float*>(x);
    if (!wanted) return nullptr;
    float* out = buf.data();
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) out[m * K + k] = bf16_to_float(static_cast<const uint16_t*>(x)[m * K + k]);
    return out;
}

// Activations of a product that the block computes itself: float32 values (already rounded to the type)
// and, in bfloat16, their bits.
template <int T>
struct Acts {
    float* f;
    uint16_t* b;  // null in float32
    void set(int64_t i, float v) {
        f[i] = v;
        if constexpr (T == BF16) b[i] = float_to_bf16(v);
    }
};

// RMSNorm of row r [H] (float32 values) as llama.py's rms_norm: in float32, r * (1 / sqrt(mean(r^2) + eps))
// rounded to `type`, times the weight, rounded again; into row m of out.
template <int T>
void rms_norm_row(const float* r, const void* weight, float eps, int64_t m, int64_t H, Acts<T>& out) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < H; ++i) s += r[i] * r[i];
    const float inv = 1.f / std::sqrt(s / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) out.set(m * H + i, rn<T>(ld<T>(weight, i) * rn<T>(r[i] * inv)));
}

// RoPE in the half-split layout on `heads` heads of width d of row m of src (row stride `stride` floats), as
// llama.py's _rotate: x * cos + cat(-x2, x1) * sin, each product and the sum rounded; into row m of dst.
template <int T>
void rotate_row(const float* src, int64_t stride, int64_t heads, int64_t d, const void* cos, const void* sin,
                int64_t m, void* dst) {
    const int64_t half = d / 2;
    for (int64_t hh = 0; hh < heads; ++hh) {
        const float* x = src + m * stride + hh * d;
        const int64_t o = (m * heads + hh) * d;
        for (int64_t j = 0; j < half; ++j)
            st<T>(dst, o + j, rn<T>(x[j] * ld<T>(cos, m * d + j)) + rn<T>(-x[j + half] * ld<T>(sin, m * d + j)));
        for (int64_t j = half; j < d; ++j)
            st<T>(dst, o + j, rn<T>(x[j] * ld<T>(cos, m * d + j)) + rn<T>(x[j - half] * ld<T>(sin, m * d + j)));
    }
}

#if defined(__AVX512F__)
// exp of 16 lanes: 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, Cody & Waite), p the
// degree-6 Taylor polynomial (|r| <= ln 2 / 2: relative error below 2e-7).
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#endif

// silu(g) = g / (1 + exp(-g)) for n values into out.
void silu(const float* g, int64_t n, float* out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_storeu_ps(out + i, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    }
#endif
    for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i]));
}

}  // namespace
}  // namespace mechserve

using namespace mechserve;

#pragma GCC visibility push(default)  // the entry points: the only symbols the library exports
extern "C" {

// Returns the ABI version; the loader refuses a library that does not match.
int mechserve_linear_abi(void) { return 3; }

// issue 30 hook: the product of weight types >= 16 (csrc/kquants.cpp's mechserve_kquant_columns).
void mechserve_set_external_product(void* fn) { external_columns = reinterpret_cast<ColumnsFn>(fn); }

// The instruction-set path this build took (chosen at build time from the compiler's target flags).
const char* mechserve_linear_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return "avx512+bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
}

// Up to how many activation rows weights of format `type` go to the format's few-row kernel (-1: unknown).
int64_t mechserve_few_rows(int type) {
    if (!known_format(type)) return -1;
    return with_format(type, [](auto f) { return decltype(f)::few_rows; });
}

// Whether tiles of weights of format `type` times bfloat16 activations are bfloat16 (VDPBF16PS) rather
// than float32: then a block format's weights are rounded to bfloat16 above its few rows.
int mechserve_bf16_tiles(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// y [M, N] (yt) = x [M, K] (xt: F32 or BF16) times w [N, K] (wt) transposed, plus bias [N] (xt) unless
// null.  A block format needs K a multiple of its block.  All tensors contiguous.
void mechserve_linear(const void* x, int xt, const void* w, int wt, const void* bias, void* y, int yt, int64_t M,
                      int64_t N, int64_t K, int n_threads) {
    if (!takes_format(wt) || M <= 0 || N <= 0) return;
    Work& s = work();
    const bool bf16 = xt == BF16, f32 = wants_f32(wt, M, bf16);
    if (xt != F32 && f32) grown(s.xf, static_cast<size_t>(M * K));
    float* sums = grown(s.sums, static_cast<size_t>(M * (K / 32) + 1));
    const bool direct = yt == F32 && !bias;  // the product writes y itself
    float* acc = direct ? static_cast<float*>(y) : grown(s.a, static_cast<size_t>(M * N));
#pragma omp parallel num_threads(n_threads)
    {
        const float* xf = as_f32(x, xt, M, K, s.xf, f32);
        const Job job{xf, bf16 ? static_cast<const uint16_t*>(x) : nullptr, nullptr, w, M, K};
        product_any(job, wt, N, acc, N, sums);
        if (!direct) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; ++m)
                for (int64_t n = 0; n < N; ++n) {
                    float v = acc[m * N + n];
                    if (bias) v += load_value(bias, xt, n);
                    store_value(y, yt, m * N + n, v);
                }
        }
    }
}

}  // extern "C"
#pragma GCC visibility pop

namespace mechserve {
namespace {

template <int T>
void attention_inputs(const void* x, const void* norm, float eps, int64_t M, int64_t H, const void* w, int wt,
                      const void* bias, const void* cos, const void* sin, int64_t h, int64_t kv, int64_t d, void* q,
                      void* k, void* v, int n_threads) {
    Work& s = work();
    const int64_t N = (h + 2 * kv) * d;
    if (T != F32) grown(s.xf, static_cast<size_t>(M * H));
    Acts<T> y{grown(s.y, static_cast<size_t>(M * H)), T == BF16 ? grown(s.yb, static_cast<size_t>(M * H)) : nullptr};
    float* qkv = grown(s.a, static_cast<size_t>(M * N));
    float* sums = grown(s.sums, static_cast<size_t>(M * (H / 32) + 1));
#pragma omp parallel num_threads(n_threads)
    {
        const float* xf = as_f32(x, T, M, H, s.xf, true);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) rms_norm_row<T>(xf + m * H, norm, eps, m, H, y);
        product_any(Job{y.f, y.b, nullptr, w, M, H}, wt, N, qkv, N, sums);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            float* r = qkv + m * N;
            if (bias)
                for (int64_t n = 0; n < N; ++n) r[n] = rn<T>(r[n] + ld<T>(bias, n));
            else
                for (int64_t n = 0; n < N; ++n) r[n] = rn<T>(r[n]);
            rotate_row<T>(qkv, N, h, d, cos, sin, m, q);
            rotate_row<T>(qkv + h * d, N, kv, d, cos, sin, m, k);
            for (int64_t i = 0; i < kv * d; ++i) st<T>(v, m * kv * d + i, r[(h + kv) * d + i]);
        }
    }
}

template <int T>
void attention_outputs(const void* x, const void* attn, int64_t A, const void* o, int ot, const void* o_bias,
                       const void* norm, float eps, const void* gate_up, int gt, const void* gate_up_bias, int64_t I,
                       const void* down, int dt, const void* down_bias, int64_t M, int64_t H, void* out,
                       int n_threads) {
    Work& s = work();
    constexpr bool bf16 = T == BF16;
    const bool af32 = wants_f32(ot, M, bf16);
    if (T != F32 && af32) grown(s.xf, static_cast<size_t>(M * A));
    float* x1 = grown(s.b, static_cast<size_t>(M * H));
    Acts<T> y{grown(s.y, static_cast<size_t>(M * H)), bf16 ? grown(s.yb, static_cast<size_t>(M * H)) : nullptr};
    float* gu = grown(s.a, static_cast<size_t>(M * 2 * I));
    Acts<T> act{grown(s.c, static_cast<size_t>(M * I)), bf16 ? grown(s.ab, static_cast<size_t>(M * I)) : nullptr};
    float* sums = grown(s.sums, static_cast<size_t>(M * (std::max(A, std::max(H, I)) / 32) + 1));
    float* dn = gu;  // the down projection's output reuses gate/up's buffer once SiLU has read it
#pragma omp parallel num_threads(n_threads)
    {
        const float* af = as_f32(attn, T, M, A, s.xf, af32);
        product_any(Job{af, bf16 ? static_cast<const uint16_t*>(attn) : nullptr, nullptr, o, M, A}, ot, H, x1, H,
                     sums);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            float* r = x1 + m * H;
            for (int64_t i = 0; i < H; ++i)
                r[i] = rn<T>(ld<T>(x, m * H + i) + rn<T>(o_bias ? r[i] + ld<T>(o_bias, i) : r[i]));
            rms_norm_row<T>(r, norm, eps, m, H, y);
        }
        product_any(Job{y.f, y.b, nullptr, gate_up, M, H}, gt, 2 * I, gu, 2 * I, sums);
#pragma omp barrier
        {
            thread_local Buffer<float> tmp;
            float* sg = grown(tmp, static_cast<size_t>(I));
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; ++m) {
                float* g = gu + m * 2 * I;
                if (gate_up_bias)
                    for (int64_t i = 0; i < 2 * I; ++i) g[i] = rn<T>(g[i] + ld<T>(gate_up_bias, i));
                else
                    for (int64_t i = 0; i < 2 * I; ++i) g[i] = rn<T>(g[i]);
                silu(g, I, sg);
                for (int64_t i = 0; i < I; ++i) act.set(m * I + i, rn<T>(rn<T>(sg[i]) * g[I + i]));
            }
        }
        product_any(Job{act.f, act.b, nullptr, down, M, I}, dt, H, dn, H, sums);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t i = 0; i < H; ++i) {
                const float p = rn<T>(down_bias ? dn[m * H + i] + ld<T>(down_bias, i) : dn[m * H + i]);
                st<T>(out, m * H + i, x1[m * H + i] + p);
            }
    }
}

}  // namespace
}  // namespace mechserve

#pragma GCC visibility push(default)  // the entry points: the only symbols the library exports
extern "C" {

// A decoder layer up to attention (llama.py's attention_inputs without q/k norms), for M rows:
// x [M, H] -> RMSNorm (norm [H], eps) -> qkv = . w [(h + 2 kv) d, H] (wt) + bias -> q [M, h, d] and
// k [M, kv, d] rotated by cos/sin [M, d], v [M, kv, d].  x, norm, bias, cos, sin, q, k, v in type xt.
void mechserve_attention_inputs(const void* x, int xt, const void* norm, float eps, int64_t M, int64_t H,
                                const void* w, int wt, const void* bias, const void* cos, const void* sin,
                                int64_t h, int64_t kv, int64_t d, void* q, void* k, void* v, int n_threads) {
    if (!takes_format(wt) || M <= 0) return;
    (xt == BF16 ? attention_inputs<BF16> : attention_inputs<F32>)(x, norm, eps, M, H, w, wt, bias, cos, sin, h, kv,
                                                                   d, q, k, v, n_threads);
}

// A decoder layer after attention (llama.py's attention_outputs), for M rows:
//   x1 = x + (attn [M, A] . o [H, A] + o_bias);  y = RMSNorm(x1);  gate, up = y . gate_up [2 I, H] + bias
//   out [M, H] = x1 + (silu(gate) * up) . down [H, I] + down_bias
// Activations and biases in type xt; each weight in its own type (ot, gt, dt).
void mechserve_attention_outputs(const void* x, int xt, const void* attn, int64_t A, const void* o, int ot,
                                 const void* o_bias, const void* norm, float eps, const void* gate_up, int gt,
                                 const void* gate_up_bias, int64_t I, const void* down, int dt, const void* down_bias,
                                 int64_t M, int64_t H, void* out, int n_threads) {
    if (!takes_format(ot) || !takes_format(gt) || !takes_format(dt) || M <= 0) return;
    (xt == BF16 ? attention_outputs<BF16> : attention_outputs<F32>)(x, attn, A, o, ot, o_bias, norm, eps, gate_up,
                                                                     gt, gate_up_bias, I, down, dt, down_bias, M, H,
                                                                     out, n_threads);
}

// out [R, K] (ot: F32 or BF16) = rows ids[0..R) of the block-format matrix w [N, K] (wt), dequantized: an
// embedding lookup, or a slice of a matrix.
void mechserve_dequantize_rows(const void* w, int wt, const int64_t* ids, int64_t R, int64_t K, void* out, int ot,
                               int n_threads) {
    if (!known_format(wt)) return;
    with_format(wt, [&](auto fmt) {
        using F = decltype(fmt);
#pragma omp parallel num_threads(n_threads)
        {
            thread_local Buffer<float> row;
            float* r = grown(row, static_cast<size_t>(K));
#pragma omp for schedule(static)
            for (int64_t i = 0; i < R; ++i) {
                tile_to_f32<F>(w, K, ids[i], 1, r, K);
                for (int64_t k = 0; k < K; ++k) store_value(out, ot, i * K + k, r[k]);
            }
        }
    });
}

}  // extern "C"
#pragma GCC visibility pop
