#include "shardtrain/backend/attention.h"

namespace shardtrain {

bool cuda_attention_uses_tensor_cores(DType type, int64_t head_dim) {
  return (type == DType::BF16 || type == DType::F16) && (head_dim == 64 || head_dim == 128);
}

}  // namespace shardtrain
