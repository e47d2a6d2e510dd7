// The code books of 4-bit NormalFloat (NF4) weight storage with double-quantized block scales,
// as in QLoRA (Dettmers et al., 2023) and bitsandbytes' quantize_4bit(quant_type="nf4",
// compress_statistics=True). Shared by the quantizer (nn/nf4) and every backend's
// nf4_dequantize kernel so that all of them read the same numbers.
//
// Layout of a quantized tensor of n elements (row-major order of the original):
//   codes        U8  [ceil(n / 2)]      two 4-bit indices into kNf4Code per byte; element 2i
//                                        in the high nibble, element 2i+1 in the low nibble
//   absmax_q     U8  [ceil(n / 64)]     per block of kNf4BlockSize elements: an index into
//                                        dynamic_map_8bit() for (absmax - offset) / scale
//   absmax_scale F32 [ceil(blocks/256)] per group of kAbsmaxGroupSize blocks: the largest
//                                        |absmax - offset| of the group
//   offset       float                  the mean of all block absmax values
// Element i dequantizes to
//   kNf4Code[code(i)] * (dynamic_map_8bit()[absmax_q[b]] * absmax_scale[b / 256] + offset)
// with b = i / 64, each product and the sum rounded to fp32 separately (no fused multiply-add),
// so every backend produces the same bits.
#pragma once
#include <array>
#include <cstdint>

#include "shardtrain/tensor/tensor.h"

namespace shardtrain::nf4 {

constexpr int64_t kNf4BlockSize = 64;      // weights per absmax
constexpr int64_t kAbsmaxGroupSize = 256;  // absmax values per fp32 scale (double quantization)

// bitsandbytes' NF4 table: quantiles of N(0, 1) normalised to [-1, 1] with an exact zero.
inline constexpr std::array<float, 16> kNf4Code = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// bitsandbytes' signed dynamic 8-bit map (create_dynamic_map(signed=True, max_exponent_bits=7)):
// 256 sorted values in [-0.99297, 1] spaced logarithmically by decade (1e-6 .. 1), with 0 and
// 1 exact. Values are computed once in double and rounded to float.
const std::array<float, 256>& dynamic_map_8bit();

// Sizes of the pieces of an n-element quantized tensor.
inline int64_t num_code_bytes(int64_t n) {
  return (n + 1) / 2;
}
inline int64_t num_blocks(int64_t n) {
  return (n + kNf4BlockSize - 1) / kNf4BlockSize;
}
inline int64_t num_absmax_groups(int64_t n) {
  return (num_blocks(n) + kAbsmaxGroupSize - 1) / kAbsmaxGroupSize;
}

// Throws ShapeError naming the operand when the arguments of Backend::nf4_dequantize do not fit
// `out` (dtypes, sizes, devices).
void check_dequantize_operands(const Tensor& codes, const Tensor& absmax_q,
                               const Tensor& absmax_scale, const Tensor& out);

}  // namespace shardtrain::nf4
