// Differentiable operations: each runs its forward through the device's Backend and, when a
// graph is being recorded, attaches a Node whose backward uses the tensors it saved (every saved
// tensor goes through the saved-tensor hooks).
//
// Dtype rule: outputs have the dtype of their floating inputs (binary ops need equal dtypes);
// kernels compute in fp32 internally. Mixed precision therefore means casting the parameters to
// the compute dtype (ops::cast, whose backward casts the gradient back), as PyTorch FSDP's
// MixedPrecision(param_dtype=...) does.
#pragma once
#include <cstdint>
#include <string>

#include "shardtrain/backend/attention.h"
#include "shardtrain/backend/rope.h"
#include "shardtrain/tensor/tensor.h"

namespace shardtrain::ops {

// ---- shape and type -------------------------------------------------------------------------
Tensor reshape(const Tensor& x, Shape shape);
// [A, B, C, D] -> [A, C, B, D] (e.g. [batch, seq, heads, dim] <-> [batch, heads, seq, dim]).
Tensor swap_dims_12(const Tensor& x);
Tensor cast(const Tensor& x, DType dtype);
// Rows [start, start+length) of dim 0 (a copy; the gradient scatters back).
Tensor slice_rows(const Tensor& x, int64_t start, int64_t length);

// ---- arithmetic -----------------------------------------------------------------------------
Tensor add(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor scale(const Tensor& x, float factor);
// x * w with w broadcast over the last dimension ([..., H] * [H]).
Tensor mul_lastdim(const Tensor& x, const Tensor& w);

// ---- linear algebra -------------------------------------------------------------------------
// x [..., in] @ w^T, w [out, in] -> [..., out]   (torch.nn.functional.linear without bias)
Tensor linear(const Tensor& x, const Tensor& w);
// Batched a [batch, m, k] @ b [batch, k, n] (b^T stored [batch, n, k] when trans_b).
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_b = false);

// ---- transformer pieces ---------------------------------------------------------------------
Tensor embedding(const Tensor& weight, const Tensor& ids);  // ids I64 [...] -> [..., H]
Tensor rms_norm(const Tensor& x, const Tensor& w, float eps);
// Rotary embedding on x [B, S, H, D], positions position_offset + s, frequencies from `params`
// (base theta, optional Llama-3 scaling: backend/rope.h).
Tensor rope(const Tensor& x, const RopeParams& params, int64_t position_offset = 0);
Tensor swiglu(const Tensor& gate, const Tensor& up);  // silu(gate) * up

enum class AttentionImpl { Plain, Fused };
AttentionImpl parse_attention_impl(const std::string& name);  // "plain" | "fused"
// Causal grouped-query attention: q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, Hq, S, D], scaled
// by 1/sqrt(D). Plain materialises the S x S probabilities (saved for backward); Fused keeps
// only the output and a log-sum-exp per row, and its backward runs as `backward` asks
// (backend/attention.h; Plain's backward is deterministic).
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, AttentionImpl impl,
                 AttentionBackwardAlgo backward = AttentionBackwardAlgo::Deterministic);

// Summed cross-entropy over rows whose target is not -100: logits [N, V], targets I64 [N].
// Returns an f32 scalar [1]; `counted` (if given) receives the number of counted rows.
Tensor cross_entropy_sum(const Tensor& logits, const Tensor& targets, int64_t* counted = nullptr);
int64_t count_targets(const Tensor& targets);  // rows whose target is not -100
// cross_entropy_sum(linear(x, w), targets) without the [N, V] logits: x [N, H], w [V, H].
// The logits exist one chunk of `chunk_rows` rows at a time, in forward and again (recomputed)
// in backward, which saves only x, w and the targets: one more [N, H] x [H, V] product per step
// buys back the logits and their gradient. One chunk covering every row runs the unfused pair's
// arithmetic (bit for bit on the CPU backend; on a GPU the fp32 d(w) product may take another
// cuBLASLt algorithm than the 16-bit one).
Tensor linear_cross_entropy_sum(const Tensor& x, const Tensor& w, const Tensor& targets,
                                int64_t chunk_rows, int64_t* counted = nullptr);

// ---- reductions (no gradient) -----------------------------------------------------------------
double sum(const Tensor& x);
double sum_squares(const Tensor& x);

}  // namespace shardtrain::ops
