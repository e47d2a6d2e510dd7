// Module: a named tree of parameters, like torch.nn.Module without the magic.
//
// Parameters are Tensor members registered by pointer, so code above (mixed precision, FSDP)
// can swap a parameter's tensor for a compute copy around a forward and put it back after.
//
// A module may be built with *deferred* parameters (PyTorch's meta device): each slot holds a
// tensor with the parameter's shape, dtype, device and requires-grad flag but no storage, so
// that a model far larger than one device can be described and then sharded (fsdp::ShardedModel
// creates only this rank's part) without ever existing in full.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/tensor/tensor.h"

namespace shardtrain::nn {

// Whether a module's parameters get storage when it is built.
enum class ParameterStorage { Allocated, Deferred };

// True for a tensor with elements but no storage: a deferred parameter not yet materialised.
bool is_deferred(const Tensor& t);
// A deferred parameter: fp32 `shape` on `device`, requiring a gradient, no bytes allocated.
Tensor deferred_parameter(const Shape& shape, Device device);

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // (full name, slot) for this module's parameters and its children's, in registration order.
  // Names follow Hugging Face (e.g. "model.layers.0.self_attn.q_proj.weight").
  std::vector<std::pair<std::string, Tensor*>> named_parameters(const std::string& prefix = "");
  std::vector<Tensor*> parameters();
  int64_t num_parameters();
  // Whether any parameter (here or in a child) is deferred.
  bool has_deferred_parameters() const;
  // Gives every deferred parameter zero-filled storage on its device, counted as Parameters
  // (the values are the caller's to set, e.g. by loading weights).
  void materialize();

  void train(bool on = true);
  bool is_training() const { return training_; }

 protected:
  void register_parameter(std::string name, Tensor* slot);
  void register_child(std::string name, Module* child);
  // Replaces a registered child (e.g. a Linear by a LoRA linear) keeping its name and order.
  void replace_child(const std::string& name, Module* child);

 private:
  std::vector<std::pair<std::string, Tensor*>> params_;
  std::vector<std::pair<std::string, Module*>> children_;
  bool training_ = true;
};

}  // namespace shardtrain::nn
