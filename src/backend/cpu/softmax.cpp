// Causal softmax over explicit score blocks (the non-fused attention path) and its backward.
#include <cmath>
#include <limits>

#include "cpu_backend.h"

namespace shardtrain {

using cpu::kChunk;
using cpu::load_floats;
using cpu::store_floats;

void CpuBackend::causal_softmax(const Tensor& scores, float scale, Tensor& probs) {
  const int64_t Sk = scores.size(-1), Sq = scores.size(-2);
  const int64_t rows = Sk == 0 ? 0 : scores.numel() / Sk;
#pragma omp parallel for schedule(dynamic, 16) if (rows * Sk > kChunk)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t q = r % Sq;
    // Keys [0, valid) are visible to this query; the rest are masked to probability 0.
    const int64_t valid = std::clamp<int64_t>(q + (Sk - Sq) + 1, 0, Sk);
    const int64_t base = r * Sk;
    float buf[kChunk];
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c0 = 0; c0 < valid; c0 += kChunk) {
      const int64_t n = std::min(valid - c0, kChunk);
      load_floats(scores, base + c0, n, buf);
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, scale * buf[j]);
    }
    double total = 0.0;
    for (int64_t c0 = 0; c0 < valid; c0 += kChunk) {
      const int64_t n = std::min(valid - c0, kChunk);
      load_floats(scores, base + c0, n, buf);
      for (int64_t j = 0; j < n; ++j) total += std::exp(scale * buf[j] - mx);
    }
    const float inv = total > 0.0 ? static_cast<float>(1.0 / total) : 0.0f;
    for (int64_t c0 = 0; c0 < Sk; c0 += kChunk) {
      const int64_t n = std::min(Sk - c0, kChunk);
      load_floats(scores, base + c0, n, buf);
      for (int64_t j = 0; j < n; ++j)
        buf[j] = c0 + j < valid ? std::exp(scale * buf[j] - mx) * inv : 0.0f;
      store_floats(buf, n, probs, base + c0);
    }
  }
}

void CpuBackend::causal_softmax_backward(const Tensor& probs, const Tensor& dprobs, float scale,
                                         Tensor& dscores) {
  const int64_t Sk = probs.size(-1);
  const int64_t rows = Sk == 0 ? 0 : probs.numel() / Sk;
#pragma omp parallel for schedule(static) if (rows * Sk > kChunk)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * Sk;
    float p[kChunk], d[kChunk];
    double dot = 0.0;
    for (int64_t c0 = 0; c0 < Sk; c0 += kChunk) {
      const int64_t n = std::min(Sk - c0, kChunk);
      load_floats(probs, base + c0, n, p);
      load_floats(dprobs, base + c0, n, d);
      for (int64_t j = 0; j < n; ++j) dot += static_cast<double>(p[j]) * d[j];
    }
    const float dotf = static_cast<float>(dot);
    for (int64_t c0 = 0; c0 < Sk; c0 += kChunk) {
      const int64_t n = std::min(Sk - c0, kChunk);
      load_floats(probs, base + c0, n, p);
      load_floats(dprobs, base + c0, n, d);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) p[j] = scale * p[j] * (d[j] - dotf);
      store_floats(p, n, dscores, base + c0);
    }
  }
}

}  // namespace shardtrain
