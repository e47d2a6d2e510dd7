// Elementwise kernels: fill, cast, add, mul, scale and the last-dimension broadcast multiply.
#include <cstring>

#include "cpu_backend.h"

namespace shardtrain {

using cpu::kChunk;
using cpu::load_floats;
using cpu::parallel_chunks;
using cpu::store_floats;

void CpuBackend::fill(Tensor& out, float value) {
  const int64_t n = out.numel();
  if (is_floating(out.dtype())) {
    parallel_chunks(n, [&](int64_t b, int64_t e) {
      float buf[kChunk];
      std::fill(buf, buf + (e - b), value);
      store_floats(buf, e - b, out, b);
    });
    return;
  }
  // Integer tensors: convert the value once and replicate its bytes.
  const size_t width = dtype_size(out.dtype());
  char pattern[8];
  convert_elements(&value, DType::F32, pattern, out.dtype(), 1);
  char* base = static_cast<char*>(out.data_ptr());
  parallel_chunks(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memcpy(base + i * width, pattern, width);
  });
}

void CpuBackend::cast(const Tensor& src, Tensor& dst) {
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  const size_t sw = dtype_size(src.dtype()), dw = dtype_size(dst.dtype());
  parallel_chunks(src.numel(), [&](int64_t b, int64_t e) {
    convert_elements(s + b * sw, src.dtype(), d + b * dw, dst.dtype(), e - b);
  });
}

void CpuBackend::add(const Tensor& a, const Tensor& b, Tensor& out, float alpha, float beta) {
  parallel_chunks(out.numel(), [&](int64_t lo, int64_t hi) {
    float x[kChunk], y[kChunk];
    const int64_t n = hi - lo;
    load_floats(a, lo, n, x);
    load_floats(b, lo, n, y);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = alpha * x[i] + beta * y[i];
    store_floats(x, n, out, lo);
  });
}

void CpuBackend::mul(const Tensor& a, const Tensor& b, Tensor& out) {
  parallel_chunks(out.numel(), [&](int64_t lo, int64_t hi) {
    float x[kChunk], y[kChunk];
    const int64_t n = hi - lo;
    load_floats(a, lo, n, x);
    load_floats(b, lo, n, y);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] *= y[i];
    store_floats(x, n, out, lo);
  });
}

void CpuBackend::scale(const Tensor& a, Tensor& out, float alpha) {
  parallel_chunks(out.numel(), [&](int64_t lo, int64_t hi) {
    float x[kChunk];
    const int64_t n = hi - lo;
    load_floats(a, lo, n, x);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] *= alpha;
    store_floats(x, n, out, lo);
  });
}

void CpuBackend::mul_lastdim(const Tensor& x, const Tensor& w, Tensor& out) {
  const int64_t width = w.numel();
  if (width == 0) return;
  cpu::Fp32Span w32(w);
  const float* wf = w32.data();
  parallel_chunks(out.numel(), [&](int64_t lo, int64_t hi) {
    float buf[kChunk];
    const int64_t n = hi - lo;
    load_floats(x, lo, n, buf);
    int64_t j = lo % width;
    for (int64_t i = 0; i < n; ++i) {
      buf[i] *= wf[j];
      if (++j == width) j = 0;
    }
    store_floats(buf, n, out, lo);
  });
}

void CpuBackend::mul_lastdim_backward_weight(const Tensor& dy, const Tensor& x, Tensor& grad_w) {
  const int64_t width = grad_w.numel();
  if (width == 0) return;
  const int64_t rows = dy.numel() / width;
  float* gw = grad_w.data<float>();
  // Each thread owns a block of columns and walks the rows in order, so the sums do not depend
  // on the thread count.
  using cpu::kColumnBlock;
  const int64_t blocks = (width + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kColumnBlock, n = std::min(width, c0 + kColumnBlock) - c0;
    double acc[kColumnBlock] = {};
    float a[kColumnBlock], b[kColumnBlock];
    for (int64_t r = 0; r < rows; ++r) {
      load_floats(dy, r * width + c0, n, a);
      load_floats(x, r * width + c0, n, b);
      for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<double>(a[i]) * b[i];
    }
    for (int64_t i = 0; i < n; ++i) gw[c0 + i] += static_cast<float>(acc[i]);
  }
}

}  // namespace shardtrain
