#include "shardtrain/nn/layers.h"

#include "shardtrain/autograd/node.h"
#include "shardtrain/ops/ops.h"

namespace shardtrain::nn {

namespace {
Tensor new_parameter(const Shape& shape, float value, Device device, ParameterStorage storage) {
  if (storage == ParameterStorage::Deferred) return deferred_parameter(shape, device);
  CategoryScope scope(MemoryCategory::Parameters);
  Tensor t = full(shape, value, DType::F32, device);
  autograd::set_requires_grad(t);
  return t;
}
}  // namespace

Linear::Linear(int64_t in_features, int64_t out_features, Device device, ParameterStorage storage)
    : in_(in_features), out_(out_features) {
  weight = new_parameter({out_features, in_features}, 0.0f, device, storage);
  register_parameter("weight", &weight);
}

Tensor Linear::forward(const Tensor& x) {
  return ops::linear(x, weight);
}

Embedding::Embedding(int64_t vocab, int64_t hidden, Device device, ParameterStorage storage) {
  weight = new_parameter({vocab, hidden}, 0.0f, device, storage);
  register_parameter("weight", &weight);
}

Tensor Embedding::forward(const Tensor& ids) {
  return ops::embedding(weight, ids);
}

RMSNorm::RMSNorm(int64_t hidden, float eps_, Device device, ParameterStorage storage) : eps(eps_) {
  weight = new_parameter({hidden}, 1.0f, device, storage);
  register_parameter("weight", &weight);
}

Tensor RMSNorm::forward(const Tensor& x) {
  return ops::rms_norm(x, weight, eps);
}

}  // namespace shardtrain::nn
