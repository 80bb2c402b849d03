// The weight formats the linear kernel multiplies, and the one place that maps a type number to its format.
//
// A format is a struct (formats/*.h) giving:
//   type            its number (common.h's Type, linear.py's TYPES)
//   block, Block    weights per block and the stored block (float / uint16_t for the dense formats)
//   to_f32(b, out)  one block's weights as float32 (how gemm.h dequantizes a tile of rows for many rows)
//   few_rows, few   up to `few_rows` activation rows, a kernel that multiplies the stored blocks directly
//                   (few(job, n0, n1, out, ldo) writes output columns [n0, n1)); 0 = none, gemm.h's tiles
//                   serve every row count
//   has_min         whether `few` wants the sums of the activations per 32-weight block (Q4_1's min)
//
// A new block format (a GGUF K-quant, say) is one header in formats/ with that struct, one case in
// with_format below, its number in linear.py's TYPES and its block size in quantized.py's BLOCK_BYTES.
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
