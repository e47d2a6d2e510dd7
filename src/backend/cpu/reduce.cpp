// Whole-tensor reductions and the loss-scaling check, deterministic whatever the thread count:
// fixed-size chunks are summed in double and the chunk sums combined in order.
#include <cmath>
#include <vector>

#include "cpu_backend.h"

namespace shardtrain {

namespace {

template <typename Term>
double chunked_sum(const Tensor& x, Term term) {
  const int64_t n = x.numel();
  const int64_t chunks = (n + cpu::kChunk - 1) / cpu::kChunk;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
  cpu::parallel_chunks(n, [&](int64_t lo, int64_t hi) {
    float buf[cpu::kChunk];
    cpu::load_floats(x, lo, hi - lo, buf);
    double s = 0.0;
    for (int64_t i = 0; i < hi - lo; ++i) s += term(static_cast<double>(buf[i]));
    partial[static_cast<size_t>(lo / cpu::kChunk)] = s;
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace

double CpuBackend::sum(const Tensor& x) {
  return chunked_sum(x, [](double v) { return v; });
}

double CpuBackend::sum_squares(const Tensor& x) {
  return chunked_sum(x, [](double v) { return v * v; });
}

bool CpuBackend::unscale_and_check(Tensor& x, float inv_scale) {
  const int64_t n = x.numel();
  const int64_t chunks = (n + cpu::kChunk - 1) / cpu::kChunk;
  bool found = false;
#pragma omp parallel for schedule(static) reduction(|| : found) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * cpu::kChunk, len = std::min(n, lo + cpu::kChunk) - lo;
    float buf[cpu::kChunk];
    cpu::load_floats(x, lo, len, buf);
    bool bad = false;
    for (int64_t i = 0; i < len; ++i) {
      bad = bad || !std::isfinite(buf[i]);
      buf[i] *= inv_scale;
    }
    found = found || bad;
    cpu::store_floats(buf, len, x, lo);
  }
  return found;
}

}  // namespace shardtrain
