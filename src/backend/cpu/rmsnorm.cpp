// RMSNorm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) per row.
#include <cmath>

#include "cpu_backend.h"

namespace shardtrain {

using cpu::kChunk;
using cpu::load_floats;
using cpu::store_floats;

void CpuBackend::rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y,
                                 Tensor& rstd) {
  const int64_t H = w.numel();
  const int64_t N = H == 0 ? 0 : x.numel() / H;
  cpu::Fp32Span w32(w);
  const float* wf = w32.data();
  float* r = rstd.data<float>();
#pragma omp parallel for schedule(static) if (N * H > kChunk)
  for (int64_t row = 0; row < N; ++row) {
    float buf[kChunk];
    double ss = 0.0;
    for (int64_t c0 = 0; c0 < H; c0 += kChunk) {
      const int64_t n = std::min(H - c0, kChunk);
      load_floats(x, row * H + c0, n, buf);
      for (int64_t j = 0; j < n; ++j) ss += static_cast<double>(buf[j]) * buf[j];
    }
    const float rs = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(H) + eps));
    r[row] = rs;
    for (int64_t c0 = 0; c0 < H; c0 += kChunk) {
      const int64_t n = std::min(H - c0, kChunk);
      load_floats(x, row * H + c0, n, buf);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) buf[j] = buf[j] * rs * wf[c0 + j];
      store_floats(buf, n, y, row * H + c0);
    }
  }
}

void CpuBackend::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                  const Tensor& rstd, Tensor& dx, Tensor& dw) {
  const int64_t H = w.numel();
  const int64_t N = H == 0 ? 0 : x.numel() / H;
  cpu::Fp32Span w32(w);
  const float* wf = w32.data();
  const float* r = rstd.data<float>();

  // dw_j += sum_rows dy_j * x_j * rstd, one column block per thread (deterministic).
  // Computed before dx so that dx may share memory with dy.
  using cpu::kColumnBlock;
  float* gw = dw.data<float>();
  const int64_t blocks = (H + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kColumnBlock, n = std::min(H, c0 + kColumnBlock) - c0;
    double acc[kColumnBlock] = {};
    float g[kColumnBlock], a[kColumnBlock];
    for (int64_t row = 0; row < N; ++row) {
      load_floats(dy, row * H + c0, n, g);
      load_floats(x, row * H + c0, n, a);
      const double rs = r[row];
      for (int64_t j = 0; j < n; ++j) acc[j] += static_cast<double>(g[j]) * a[j] * rs;
    }
    for (int64_t j = 0; j < n; ++j) gw[c0 + j] += static_cast<float>(acc[j]);
  }

  // dx_j = rstd * w_j * dy_j - x_j * rstd^3 / H * sum_k(dy_k * w_k * x_k)
#pragma omp parallel for schedule(static) if (N * H > kChunk)
  for (int64_t row = 0; row < N; ++row) {
    float g[kChunk], a[kChunk];
    double dot = 0.0;
    for (int64_t c0 = 0; c0 < H; c0 += kChunk) {
      const int64_t n = std::min(H - c0, kChunk);
      load_floats(dy, row * H + c0, n, g);
      load_floats(x, row * H + c0, n, a);
      for (int64_t j = 0; j < n; ++j) dot += static_cast<double>(g[j]) * wf[c0 + j] * a[j];
    }
    const float rs = r[row];
    const float coef = static_cast<float>(dot / static_cast<double>(H)) * rs * rs * rs;
    for (int64_t c0 = 0; c0 < H; c0 += kChunk) {
      const int64_t n = std::min(H - c0, kChunk);
      load_floats(dy, row * H + c0, n, g);
      load_floats(x, row * H + c0, n, a);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) g[j] = rs * wf[c0 + j] * g[j] - a[j] * coef;
      store_floats(g, n, dx, row * H + c0);
    }
  }
}

}  // namespace shardtrain
