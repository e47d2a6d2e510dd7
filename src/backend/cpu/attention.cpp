// Memory-efficient causal attention with grouped-query heads (flash-attention algorithm on CPU).
//
// Forward works one query row at a time with an O(S) score buffer per thread and saves the
// row's log-sum-exp; backward recomputes probabilities from it. BF16/F16 inputs are converted to
// fp32 workspace copies first (the size of the inputs; never S x S).
#include <omp.h>

#include <cmath>
#include <limits>

#include "cpu_backend.h"

namespace shardtrain {

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Keys per task in the key/value gradient pass.
constexpr int64_t kKeyBlock = 32;

struct AttentionDims {
  int64_t B, Hq, Hkv, S, D, group;
  AttentionDims(const Tensor& q, const Tensor& k)
      : B(q.size(0)),
        Hq(q.size(1)),
        Hkv(k.size(1)),
        S(q.size(2)),
        D(q.size(3)),
        group(Hkv == 0 ? 1 : Hq / Hkv) {}
  // Offset of row 0 of kv head `kvh` of batch b in a [B, Hkv, S, D] tensor.
  int64_t kv_base(int64_t b, int64_t kvh) const { return (b * Hkv + kvh) * S * D; }
};

}  // namespace

void CpuBackend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                                   Tensor& out, Tensor& lse) {
  const AttentionDims d(q, k);
  const int64_t rows = d.B * d.Hq * d.S;
  if (rows == 0) return;
  cpu::Fp32Span q32(q), k32(k), v32(v);
  const float *Q = q32.data(), *K = k32.data(), *V = v32.data();
  float* L = lse.data<float>();

  const int64_t per_thread = d.S + d.D;
  Tensor scratch = cpu::workspace(static_cast<int64_t>(omp_get_max_threads()) * per_thread);
  float* scratch_base = scratch.data<float>();

#pragma omp parallel
  {
    float* scores = scratch_base + omp_get_thread_num() * per_thread;
    float* acc = scores + d.S;
    // Rows have different lengths under the causal mask; dynamic scheduling balances them. Each
    // row is computed by one thread alone, so the result does not depend on the schedule.
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r % d.S, h = (r / d.S) % d.Hq, b = r / (d.S * d.Hq);
      const float* qi = Q + r * d.D;
      const float* Kb = K + d.kv_base(b, h / d.group);
      const float* Vb = V + d.kv_base(b, h / d.group);
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j <= i; ++j) {
        scores[j] = scale * dot(qi, Kb + j * d.D, d.D);
        mx = std::max(mx, scores[j]);
      }
      double total = 0.0;
      std::fill(acc, acc + d.D, 0.0f);
      for (int64_t j = 0; j <= i; ++j) {
        const float p = std::exp(scores[j] - mx);
        total += p;
        axpy(p, Vb + j * d.D, acc, d.D);
      }
      const float inv = static_cast<float>(1.0 / total);
      for (int64_t c = 0; c < d.D; ++c) acc[c] *= inv;
      cpu::store_floats(acc, d.D, out, r * d.D);
      L[r] = mx + static_cast<float>(std::log(total));
    }
  }
}

void CpuBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& out, const Tensor& lse, const Tensor& dout,
                                    float scale, Tensor& dq, Tensor& dk, Tensor& dv,
                                    AttentionBackwardAlgo /*algo: one deterministic backward*/) {
  const AttentionDims d(q, k);
  const int64_t rows = d.B * d.Hq * d.S;
  if (rows == 0 || d.D == 0) {
    fill(dq, 0.0f);
    fill(dk, 0.0f);
    fill(dv, 0.0f);
    return;
  }
  cpu::Fp32Span q32(q), k32(k), v32(v), do32(dout);
  const float *Q = q32.data(), *K = k32.data(), *V = v32.data(), *dO = do32.data();
  const float* L = lse.data<float>();

  // delta_i = sum_d dout_i * out_i: the row term of the softmax backward.
  Tensor delta_t = cpu::workspace(rows);
  float* delta = delta_t.data<float>();
#pragma omp parallel for schedule(static) if (rows * d.D > cpu::kChunk)
  for (int64_t r = 0; r < rows; ++r) {
    float o[cpu::kChunk];
    double s = 0.0;
    for (int64_t c0 = 0; c0 < d.D; c0 += cpu::kChunk) {
      const int64_t n = std::min(d.D - c0, cpu::kChunk);
      cpu::load_floats(out, r * d.D + c0, n, o);
      for (int64_t c = 0; c < n; ++c) s += static_cast<double>(o[c]) * dO[r * d.D + c0 + c];
    }
    delta[r] = static_cast<float>(s);
  }

  const int threads = omp_get_max_threads();
  const int64_t per_thread = 2 * kKeyBlock * d.D;
  Tensor scratch = cpu::workspace(threads * per_thread);
  float* scratch_base = scratch.data<float>();

  // dq_i = scale * sum_j P_ij (dP_ij - delta_i) k_j, one query row per task.
#pragma omp parallel
  {
    float* acc = scratch_base + omp_get_thread_num() * per_thread;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r % d.S, h = (r / d.S) % d.Hq, b = r / (d.S * d.Hq);
      const float* qi = Q + r * d.D;
      const float* doi = dO + r * d.D;
      const float* Kb = K + d.kv_base(b, h / d.group);
      const float* Vb = V + d.kv_base(b, h / d.group);
      std::fill(acc, acc + d.D, 0.0f);
      for (int64_t j = 0; j <= i; ++j) {
        const float p = std::exp(scale * dot(qi, Kb + j * d.D, d.D) - L[r]);
        const float ds = p * (dot(doi, Vb + j * d.D, d.D) - delta[r]);
        axpy(ds, Kb + j * d.D, acc, d.D);
      }
      for (int64_t c = 0; c < d.D; ++c) acc[c] *= scale;
      cpu::store_floats(acc, d.D, dq, r * d.D);
    }
  }

  // dk_j = scale * sum_{h in group, i >= j} dS_ij q_i and dv_j = sum P_ij dout_i. Each task owns
  // a block of keys of one kv head and visits heads and queries in a fixed order, so the sums
  // are deterministic.
  const int64_t key_blocks = (d.S + kKeyBlock - 1) / kKeyBlock;
  const int64_t tasks = d.B * d.Hkv * key_blocks;
#pragma omp parallel
  {
    float* dk_acc = scratch_base + omp_get_thread_num() * per_thread;
    float* dv_acc = dk_acc + kKeyBlock * d.D;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t blk = t % key_blocks, kvh = (t / key_blocks) % d.Hkv,
                    b = t / (key_blocks * d.Hkv);
      const int64_t j0 = blk * kKeyBlock, j1 = std::min(d.S, j0 + kKeyBlock);
      const float* Kb = K + d.kv_base(b, kvh);
      const float* Vb = V + d.kv_base(b, kvh);
      std::fill(dk_acc, dk_acc + per_thread, 0.0f);
      for (int64_t h = kvh * d.group; h < (kvh + 1) * d.group; ++h) {
        for (int64_t i = j0; i < d.S; ++i) {
          const int64_t r = (b * d.Hq + h) * d.S + i;
          const float* qi = Q + r * d.D;
          const float* doi = dO + r * d.D;
          const int64_t j_end = std::min(j1, i + 1);
          for (int64_t j = j0; j < j_end; ++j) {
            const float p = std::exp(scale * dot(qi, Kb + j * d.D, d.D) - L[r]);
            const float ds = p * (dot(doi, Vb + j * d.D, d.D) - delta[r]);
            axpy(p, doi, dv_acc + (j - j0) * d.D, d.D);
            axpy(ds, qi, dk_acc + (j - j0) * d.D, d.D);
          }
        }
      }
      const int64_t n = (j1 - j0) * d.D;
      for (int64_t c = 0; c < n; ++c) dk_acc[c] *= scale;
      cpu::store_floats(dk_acc, n, dk, d.kv_base(b, kvh) + j0 * d.D);
      cpu::store_floats(dv_acc, n, dv, d.kv_base(b, kvh) + j0 * d.D);
    }
  }
}

}  // namespace shardtrain
