#include "shardtrain/amp/mixed_precision.h"

#include <string>
#include <utility>
#include <vector>

#include "shardtrain/autograd/node.h"
#include "shardtrain/memory/category.h"

namespace shardtrain::amp {

namespace {

using Slots = std::vector<std::pair<std::string, Tensor*>>;

// RAII: swaps each fp32 slot for its compute copy and puts the master back on destruction, also
// when the forward throws.
class ComputeCopies {
 public:
  ComputeCopies(const Slots& slots, DType dtype) {
    CategoryScope as_parameters(MemoryCategory::Parameters);
    try {
      for (const auto& [name, slot] : slots) {
        if (!slot->defined() || slot->dtype() != DType::F32) continue;
        Tensor copy = ops::cast(*slot, dtype);
        masters_.emplace_back(slot, *slot);
        *slot = std::move(copy);
      }
    } catch (...) {
      restore();
      throw;
    }
  }
  ~ComputeCopies() { restore(); }
  ComputeCopies(const ComputeCopies&) = delete;
  ComputeCopies& operator=(const ComputeCopies&) = delete;

 private:
  void restore() {
    for (auto& [slot, master] : masters_) *slot = std::move(master);
    masters_.clear();
  }
  std::vector<std::pair<Tensor*, Tensor>> masters_;
};

void check_floating(DType dtype, const char* field) {
  ST_CHECK_AS(ConfigError, is_floating(dtype), "mixed precision: ", field,
              " must be fp32, bf16 or fp16, got ", dtype_name(dtype));
}

}  // namespace

void install_mixed_precision(nn::LlamaModel& model, const PrecisionPolicy& policy) {
  check_floating(policy.param_dtype, "param_dtype");
  check_floating(policy.reduce_dtype, "reduce_dtype");

  if (policy.param_dtype != DType::F32) {
    const DType dtype = policy.param_dtype;
    nn::LlamaModel* m = &model;
    // Slots are looked up on every call, so parameters replaced after installation (adapters,
    // gathered shards) are the ones cast.
    model.add_model_wrapper([m, dtype](const nn::TensorFn& inner, const Tensor& ids) {
      ComputeCopies root(m->root_parameters(), dtype);
      return inner(ids);
    });
    model.add_layer_wrapper([m, dtype](int layer, const nn::TensorFn& inner, const Tensor& x) {
      ComputeCopies layer_copies(m->layer_parameters(layer), dtype);
      return inner(x);
    });
  }

  if (policy.reduce_dtype != DType::F32) {
    const DType reduce = policy.reduce_dtype;
    for (auto& [name, slot] : model.named_parameters()) {
      if (!slot->defined() || !autograd::requires_grad(*slot)) continue;
      autograd::register_hook(*slot, [reduce](const Tensor& g) {
        return g.dtype() == reduce ? g : g.to(reduce).to(g.dtype());
      });
    }
  }
}

}  // namespace shardtrain::amp
