// The building blocks of a Llama: Linear, Embedding, RMSNorm. Each creates its weight filled
// (zeros, ones for RMSNorm) or deferred (no storage; see module.h).
#pragma once
#include "shardtrain/nn/module.h"

namespace shardtrain::nn {

// y = x @ weight^T, weight [out, in] (Llama projections have no bias). Virtual so that adapters
// (LoRA, quantized bases) can stand in for it.
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, Device device,
         ParameterStorage storage = ParameterStorage::Allocated);
  virtual Tensor forward(const Tensor& x);
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Tensor weight;

 protected:
  Linear(int64_t in_features, int64_t out_features) : in_(in_features), out_(out_features) {}

 private:
  int64_t in_, out_;
};

class Embedding : public Module {
 public:
  Embedding(int64_t vocab, int64_t hidden, Device device,
            ParameterStorage storage = ParameterStorage::Allocated);
  Tensor forward(const Tensor& ids);
  Tensor weight;
};

class RMSNorm : public Module {
 public:
  RMSNorm(int64_t hidden, float eps, Device device,
          ParameterStorage storage = ParameterStorage::Allocated);
  Tensor forward(const Tensor& x);
  Tensor weight;
  float eps;
};

}  // namespace shardtrain::nn
