// Which cases of the fused causal attention the CUDA backend runs on tensor cores. A host function
// of every build, CPU-only ones included, so that the kernels' dispatch and the layers above that
// tell a user which path a run takes read one rule.
#pragma once
#include <cstdint>

#include "shardtrain/core/dtype.h"

namespace shardtrain {

// bf16 and fp16 with head dim 64 or 128 have tensor-core kernels (used when the operands are also
// 16-byte aligned, which the backend checks per call); every other case runs on the exact
// CUDA-core kernels (any head dim up to 256), which are far slower.
bool cuda_attention_uses_tensor_cores(DType type, int64_t head_dim);

}  // namespace shardtrain
