// Which cases of the fused causal attention the CUDA backend runs on tensor cores, and how its
// backward may add up dQ. Host code of every build, CPU-only ones included, so that the kernels'
// dispatch and the layers above that tell a user which path a run takes read one rule.
#pragma once
#include <cstdint>
#include <string>

#include "shardtrain/core/dtype.h"

namespace shardtrain {

// bf16 and fp16 with head dim 64 or 128 have tensor-core kernels (used when the operands are also
// 16-byte aligned, which the backend checks per call); every other case runs on the exact
// CUDA-core kernels (any head dim up to 256), which are far slower.
bool cuda_attention_uses_tensor_cores(DType type, int64_t head_dim);

// How the fused attention's backward computes dQ (config key activation.attention_backward).
// - Deterministic: dK/dV in one pass and dQ in another, which recomputes the scores and dP
//   (7 matrix products per pair of query and key tiles): every gradient is bit-reproducible.
// - AtomicDq: one pass that adds each key block's share of dQ into an fp32 buffer with atomics
//   (5 products, as FlashAttention-2): less work, but the order of those additions, and so the
//   last bits of dQ, vary from run to run. dK and dV stay bit-reproducible.
// Only the CUDA tensor-core kernels have the AtomicDq form; every other case (the CPU backend,
// the CUDA-core kernels) runs its one deterministic backward whatever is asked.
enum class AttentionBackwardAlgo { Deterministic, AtomicDq };
// "deterministic" | "atomic_dq"; anything else is a ConfigError naming the key.
AttentionBackwardAlgo parse_attention_backward(const std::string& name);

}  // namespace shardtrain
