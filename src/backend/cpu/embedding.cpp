// Token embedding lookup and its (deterministic) gradient.
#include <cstring>

#include "cpu_backend.h"

namespace shardtrain {

void CpuBackend::embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out) {
  const int64_t V = weight.size(0), H = weight.size(1), N = ids.numel();
  cpu::check_indices(ids, V, cpu::kNoIgnoredIndex, "token id");
  const int64_t* id = ids.data<int64_t>();
  const char* w = static_cast<const char*>(weight.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  const size_t ww = dtype_size(weight.dtype()), ow = dtype_size(out.dtype());
#pragma omp parallel for schedule(static) if (N * H > cpu::kChunk)
  for (int64_t i = 0; i < N; ++i) {
    const char* s = w + id[i] * H * ww;
    char* d = o + i * H * ow;
    if (weight.dtype() == out.dtype())
      std::memcpy(d, s, H * ww);
    else
      convert_elements(s, weight.dtype(), d, out.dtype(), H);
  }
}

void CpuBackend::embedding_backward(const Tensor& grad_out, const Tensor& ids,
                                    Tensor& grad_weight) {
  const int64_t V = grad_weight.size(0), H = grad_weight.size(1), N = ids.numel();
  cpu::check_indices(ids, V, cpu::kNoIgnoredIndex, "token id");
  const int64_t* id = ids.data<int64_t>();
  float* gw = grad_weight.data<float>();
  // Threads own column blocks and walk the tokens in order: repeated ids never race and every
  // sum is formed in the same order whatever the thread count.
  using cpu::kColumnBlock;
  const int64_t blocks = (H + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) if (blocks > 1 && N * H > cpu::kChunk)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kColumnBlock, n = std::min(H, c0 + kColumnBlock) - c0;
    float g[kColumnBlock];
    for (int64_t i = 0; i < N; ++i) {
      cpu::load_floats(grad_out, i * H + c0, n, g);
      float* row = gw + id[i] * H + c0;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) row[j] += g[j];
    }
  }
}

}  // namespace shardtrain
