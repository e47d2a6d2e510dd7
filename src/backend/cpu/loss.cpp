// Cross-entropy over vocabulary rows, with a numerically stable log-sum-exp.
#include <cmath>
#include <limits>

#include "cpu_backend.h"

namespace shardtrain {

namespace {

constexpr int64_t kIgnoreIndex = -100;

struct RowStats {
  float max;
  double sum_exp;  // sum_j exp(logit_j - max)
};

RowStats row_stats(const Tensor& logits, int64_t base, int64_t V) {
  float buf[cpu::kChunk];
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t c0 = 0; c0 < V; c0 += cpu::kChunk) {
    const int64_t n = std::min(V - c0, cpu::kChunk);
    cpu::load_floats(logits, base + c0, n, buf);
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, buf[j]);
  }
  double total = 0.0;
  for (int64_t c0 = 0; c0 < V; c0 += cpu::kChunk) {
    const int64_t n = std::min(V - c0, cpu::kChunk);
    cpu::load_floats(logits, base + c0, n, buf);
    for (int64_t j = 0; j < n; ++j) total += std::exp(buf[j] - mx);
  }
  return {mx, total};
}

float element(const Tensor& logits, int64_t index) {
  float value;
  cpu::load_floats(logits, index, 1, &value);
  return value;
}

}  // namespace

void CpuBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                                       bool targets_checked) {
  const int64_t V = logits.size(-1), N = targets.numel();
  if (!targets_checked) cpu::check_indices(targets, V, kIgnoreIndex, "target token id");
  const int64_t* t = targets.data<int64_t>();
  float* loss = losses.data<float>();
#pragma omp parallel for schedule(static) if (N * V > cpu::kChunk)
  for (int64_t i = 0; i < N; ++i) {
    if (t[i] == kIgnoreIndex) {
      loss[i] = 0.0f;
      continue;
    }
    const RowStats st = row_stats(logits, i * V, V);
    const double lse = st.max + std::log(st.sum_exp);
    loss[i] = static_cast<float>(lse - element(logits, i * V + t[i]));
  }
}

void CpuBackend::cross_entropy_backward(const Tensor& logits, const Tensor& targets,
                                        float grad_scale, Tensor& dlogits, bool targets_checked) {
  const int64_t V = logits.size(-1), N = targets.numel();
  if (!targets_checked) cpu::check_indices(targets, V, kIgnoreIndex, "target token id");
  const int64_t* t = targets.data<int64_t>();
#pragma omp parallel for schedule(static) if (N * V > cpu::kChunk)
  for (int64_t i = 0; i < N; ++i) {
    float buf[cpu::kChunk];
    if (t[i] == kIgnoreIndex) {
      std::fill(buf, buf + std::min(V, cpu::kChunk), 0.0f);
      for (int64_t c0 = 0; c0 < V; c0 += cpu::kChunk)
        cpu::store_floats(buf, std::min(V - c0, cpu::kChunk), dlogits, i * V + c0);
      continue;
    }
    const RowStats st = row_stats(logits, i * V, V);
    const float inv = static_cast<float>(1.0 / st.sum_exp);
    for (int64_t c0 = 0; c0 < V; c0 += cpu::kChunk) {
      const int64_t n = std::min(V - c0, cpu::kChunk);
      cpu::load_floats(logits, i * V + c0, n, buf);
      for (int64_t j = 0; j < n; ++j) {
        const float p = std::exp(buf[j] - st.max) * inv;
        buf[j] = grad_scale * (c0 + j == t[i] ? p - 1.0f : p);
      }
      cpu::store_floats(buf, n, dlogits, i * V + c0);
    }
  }
}

}  // namespace shardtrain
