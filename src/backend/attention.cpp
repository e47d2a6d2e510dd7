#include "shardtrain/backend/attention.h"

#include "shardtrain/core/error.h"

namespace shardtrain {

bool cuda_attention_uses_tensor_cores(DType type, int64_t head_dim) {
  return (type == DType::BF16 || type == DType::F16) && (head_dim == 64 || head_dim == 128);
}

AttentionBackwardAlgo parse_attention_backward(const std::string& name) {
  if (name == "deterministic") return AttentionBackwardAlgo::Deterministic;
  if (name == "atomic_dq") return AttentionBackwardAlgo::AtomicDq;
  throw ConfigError("activation.attention_backward: unknown value '" + name +
                    "': expected deterministic (bit-reproducible) or atomic_dq (dQ accumulated "
                    "with atomics on the GPU: faster, not bit-reproducible)");
}

}  // namespace shardtrain
