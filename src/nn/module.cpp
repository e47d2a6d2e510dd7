#include "shardtrain/nn/module.h"

namespace shardtrain::nn {

void Module::register_parameter(std::string name, Tensor* slot) {
  params_.emplace_back(std::move(name), slot);
}

void Module::register_child(std::string name, Module* child) {
  children_.emplace_back(std::move(name), child);
}

void Module::replace_child(const std::string& name, Module* child) {
  for (auto& [n, c] : children_)
    if (n == name) {
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

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

}  // namespace shardtrain::nn
