// NF4 dequantization: one 64-weight block per iteration, its absmax rebuilt from the
// double-quantized statistics first.
#include "cpu_backend.h"
#include "shardtrain/backend/nf4_codebook.h"

namespace shardtrain {

void CpuBackend::nf4_dequantize(const Tensor& codes, const Tensor& absmax_q,
                                const Tensor& absmax_scale, float offset, Tensor& out) {
  nf4::check_dequantize_operands(codes, absmax_q, absmax_scale, out);
  const int64_t n = out.numel();
  const int64_t blocks = nf4::num_blocks(n);
  const uint8_t* c = codes.data<uint8_t>();
  const uint8_t* aq = absmax_q.data<uint8_t>();
  const float* scale = absmax_scale.data<float>();
  const std::array<float, 256>& map = nf4::dynamic_map_8bit();
#pragma omp parallel for schedule(static) if (blocks > 64)
  for (int64_t b = 0; b < blocks; ++b) {
    // Two roundings, no fused multiply-add: the CUDA kernel computes the same bits.
    const float scaled = map[aq[b]] * scale[b / nf4::kAbsmaxGroupSize];
    const float absmax = scaled + offset;
    const int64_t lo = b * nf4::kNf4BlockSize;
    const int64_t hi = std::min(n, lo + nf4::kNf4BlockSize);
    float values[nf4::kNf4BlockSize];
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t byte = c[i / 2];
      const int code = (i % 2 == 0) ? byte >> 4 : byte & 0x0f;
      values[i - lo] = nf4::kNf4Code[static_cast<size_t>(code)] * absmax;
    }
    cpu::store_floats(values, hi - lo, out, lo);
  }
}

}  // namespace shardtrain
