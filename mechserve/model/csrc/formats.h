// The weight formats the linear kernel multiplies, and the one place that maps a type number to its format.
//
// A format is a struct (formats/*.h) giving:
//   type            its number (common.h's Type, linear.py's TYPES)
//   block, Block    weights per block (a row's K must be a multiple of it) and the stored block (float /
//                   uint16_t for the dense formats; a packed struct, its size static_assert-ed, for GGUF's)
//   to_f32(b, out)  one block's `block` weights as float32 (how gemm.h dequantizes a tile of rows for many
//                   rows, and mechserve_dequantize_rows an embedding row): the reference decoder's values
//   few_rows        up to how many activation rows `few` multiplies the stored blocks directly; 0 = no
//                   few-row kernel (then `few` and `has_min` are not read): gemm.h's tiles serve every count
//   few(job, n0, n1, out, ldo)   the few-row kernel: output columns [n0, n1) of out [M, ldo] (blocks32.h
//                   gives one for 32-weight blocks with an fp16 scale at their head)
//   has_min         whether `few` wants the activations' sums per 32 weights in job.xsum (Q4_1's min)
//
// Adding a block format (a GGUF K-quant, say):
//   1. formats/NAME.h with that struct (block = 256 for a K-quant super-block; few_rows = 0 until a
//      few-row kernel is measured faster than the tiles);
//   2. common.h: its number in Type (the next free one);
//   3. here: its #include, its number in known_format, its case in with_format;
//   4. linear.py: TYPES[kind] = that number (NATIVE_MAX_ROWS only if torch is measured faster above some
//      row count); quantized.py: its stored bytes per block and its weights per block, and `dequantize`
//      (the torch reference the kernel is tested against);
//   5. tests/model/test_native_linear.py and test_fused_blocks.py: the kind in their lists of formats.
// Nothing else changes: gemm.h, the fused blocks (linear.cpp) and fused.py take any format listed here.
#pragma once

#include "formats/dense.h"
#include "formats/q4_1.h"
#include "formats/q8_0.h"

namespace mechserve {

// Whether `type` names a weight format this build knows.
inline bool known_format(int type) { return type == F32 || type == BF16 || type == Q4_1 || type == Q8_0; }

// fn(Format{}) for the format numbered `type` (known_format(type) must hold).
template <typename Fn>
decltype(auto) with_format(int type, Fn&& fn) {
    switch (type) {
        case BF16: return fn(DenseBF16{});
        case Q4_1: return fn(Q4_1Format{});
        case Q8_0: return fn(Q8_0Format{});
        default: return fn(DenseF32{});
    }
}

}  // namespace mechserve
