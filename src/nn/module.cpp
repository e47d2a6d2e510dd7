#include "shardtrain/nn/module.h"

#include "shardtrain/autograd/node.h"

namespace shardtrain::nn {

bool is_deferred(const Tensor& t) {
  return t.defined() && t.impl()->storage != nullptr && t.impl()->storage->data.get() == nullptr &&
         t.numel() > 0;
}

Tensor deferred_parameter(const Shape& shape, Device device) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>();
  // A borrowed null pointer keeps the device without allocating or counting anything.
  impl->storage->data = DataPtr::borrowed(nullptr, 0, device);
  impl->shape = shape;
  impl->dtype = DType::F32;
  Tensor t(impl);
  autograd::set_requires_grad(t);
  return t;
}

void Module::register_parameter(std::string name, Tensor* slot) {
  params_.emplace_back(std::move(name), slot);
}

void Module::register_child(std::string name, Module* child) {
  children_.emplace_back(std::move(name), child);
}

void Module::replace_child(const std::string& name, Module* child) {
  for (auto& [n, c] : children_)
    if (n == name) {
      // The replacement runs in the mode of the module it replaces (eval: no dropout).
      child->train(c->is_training());
      c = child;
      return;
    }
  throw Error("no child module named '" + name + "'");
}

std::vector<std::pair<std::string, Tensor*>> Module::named_parameters(const std::string& prefix) {
  std::vector<std::pair<std::string, Tensor*>> out;
  std::string p = prefix.empty() ? "" : prefix + ".";
  for (auto& [name, slot] : params_) out.emplace_back(p + name, slot);
  for (auto& [name, child] : children_) {
    auto sub = child->named_parameters(p + name);
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

std::vector<Tensor*> Module::parameters() {
  std::vector<Tensor*> out;
  for (auto& [name, slot] : named_parameters()) out.push_back(slot);
  return out;
}

int64_t Module::num_parameters() {
  int64_t n = 0;
  for (Tensor* t : parameters()) n += t->numel();
  return n;
}

bool Module::has_deferred_parameters() const {
  for (const auto& [name, slot] : params_)
    if (is_deferred(*slot)) return true;
  for (const auto& [name, child] : children_)
    if (child->has_deferred_parameters()) return true;
  return false;
}

void Module::materialize() {
  CategoryScope scope(MemoryCategory::Parameters);
  for (auto& [name, slot] : named_parameters()) {
    if (!is_deferred(*slot)) continue;
    const bool trainable = autograd::requires_grad(*slot);
    *slot = zeros(slot->shape(), slot->dtype(), slot->device());
    autograd::set_requires_grad(*slot, trainable);
  }
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

}  // namespace shardtrain::nn
