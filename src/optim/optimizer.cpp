#include "shardtrain/optim/optimizer.h"

#include <cmath>

#include "shardtrain/autograd/node.h"
#include "shardtrain/backend/backend.h"

namespace shardtrain::optim {

bool default_decay_filter(const std::string& name) {
  return name.find("norm") == std::string::npos && name.find("embed") == std::string::npos;
}

void Optimizer::zero_grad() {
  for (auto& p : params_) autograd::set_grad(*p.param, Tensor());
}

AdamW::AdamW(std::vector<NamedParam> params, AdamWOptions options)
    : Optimizer(std::move(params)), options_(options) {
  CategoryScope scope(MemoryCategory::OptimizerState);
  for (auto& p : params_) {
    ST_CHECK(p.param->dtype() == DType::F32, "AdamW keeps fp32 parameters; '", p.name, "' is ",
             p.param->describe());
    exp_avg_.push_back(zeros(p.param->shape(), DType::F32, p.param->device()));
    exp_avg_sq_.push_back(zeros(p.param->shape(), DType::F32, p.param->device()));
    decay_.push_back(options_.decay_all || default_decay_filter(p.name));
  }
}

void AdamW::update(float lr, float grad_scale) {
  ++steps_;
  const Backend::AdamWArgs args{
      lr, options_.beta1, options_.beta2, options_.eps, options_.weight_decay, steps_, grad_scale};
  std::vector<Tensor> grads(params_.size());
  std::vector<Backend::AdamWTensor> tensors;
  for (size_t i = 0; i < params_.size(); ++i) {
    grads[i] = autograd::grad(*params_[i].param);
    if (!grads[i].defined()) continue;
    tensors.push_back(
        {params_[i].param, &grads[i], &exp_avg_[i], &exp_avg_sq_[i], static_cast<bool>(decay_[i])});
  }
  // One call per device, so that each backend updates all of its tensors at once.
  for (const auto& [device, list] :
       split_by_device(tensors, [](const Backend::AdamWTensor& t) { return t.param->device(); }))
    backend_for(device).adamw_multi(list, args);
}

std::vector<std::pair<std::string, Tensor*>> AdamW::state() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("exp_avg." + params_[i].name, &exp_avg_[i]);
    out.emplace_back("exp_avg_sq." + params_[i].name, &exp_avg_sq_[i]);
  }
  return out;
}

SGD::SGD(std::vector<NamedParam> params, float momentum, float weight_decay, bool decay_all)
    : Optimizer(std::move(params)), momentum_(momentum), weight_decay_(weight_decay) {
  CategoryScope scope(MemoryCategory::OptimizerState);
  for (auto& p : params_) {
    buffers_.push_back(momentum_ > 0 ? zeros(p.param->shape(), DType::F32, p.param->device())
                                     : Tensor());
    decay_.push_back(decay_all || default_decay_filter(p.name));
  }
}

void SGD::update(float lr, float grad_scale) {
  ++steps_;
  // No fused kernel here: the factor is applied as its own pass over the gradients.
  if (grad_scale != 1.0f) scale_grads(params_, grad_scale);
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = *params_[i].param;
    Tensor g = autograd::grad(p);
    if (!g.defined()) continue;
    Backend& be = backend_for(p.device());
    Tensor d = g;
    if (weight_decay_ != 0.0f && decay_[i]) {  // d = g + wd * p
      d = empty(p.shape(), DType::F32, p.device());
      be.add(g, p, d, 1.0f, weight_decay_);
    }
    if (momentum_ > 0) {  // buf = momentum * buf + d (PyTorch: plain copy on the first step)
      if (steps_ == 1)
        buffers_[i].copy_from(d);
      else
        be.add(buffers_[i], d, buffers_[i], momentum_, 1.0f);
      d = buffers_[i];
    }
    be.add(p, d, p, 1.0f, -lr);
  }
}

std::vector<std::pair<std::string, Tensor*>> SGD::state() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (size_t i = 0; i < params_.size(); ++i)
    if (buffers_[i].defined()) out.emplace_back("momentum." + params_[i].name, &buffers_[i]);
  return out;
}

float LrSchedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps)
    return peak * static_cast<float>(step + 1) / static_cast<float>(warmup_steps);
  if (kind == Kind::Constant) return peak;
  int64_t decay_steps = std::max<int64_t>(total_steps - warmup_steps, 1);
  double progress =
      std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps));
  double factor = kind == Kind::Cosine ? 0.5 * (1.0 + std::cos(M_PI * progress)) : 1.0 - progress;
  return static_cast<float>(min_lr + (peak - min_lr) * factor);
}

double grad_sum_squares(const std::vector<NamedParam>& params) {
  std::vector<Tensor> grads;
  for (auto& p : params)
    if (Tensor g = autograd::grad(*p.param); g.defined()) grads.push_back(std::move(g));
  std::vector<const Tensor*> pointers;
  for (const Tensor& g : grads) pointers.push_back(&g);
  double total = 0;
  for (const auto& [device, list] :
       split_by_device(pointers, [](const Tensor* g) { return g->device(); }))
    for (double part : backend_for(device).sum_squares_multi(list)) total += part;
  return total;
}

void scale_grads(const std::vector<NamedParam>& params, float factor) {
  for (auto& p : params) {
    Tensor g = autograd::grad(*p.param);
    if (g.defined()) backend_for(g.device()).scale(g, g, factor);
  }
}

float clip_factor(double norm, double max_norm) {
  if (max_norm > 0 && norm > max_norm && std::isfinite(norm))
    return static_cast<float>(max_norm / (norm + 1e-6));
  return 1.0f;
}

double clip_grad_norm(const std::vector<NamedParam>& params, double max_norm, double sum_squares) {
  double norm = std::sqrt(sum_squares >= 0 ? sum_squares : grad_sum_squares(params));
  if (const float factor = clip_factor(norm, max_norm); factor != 1.0f) scale_grads(params, factor);
  return norm;
}

}  // namespace shardtrain::optim
