// Optimizers (AdamW, SGD), the learning-rate schedule and global-norm gradient clipping.
//
// An optimizer updates a list of named fp32 parameters from their .grad. What a "parameter" is
// depends on the layer above: a model weight in single-process training, a rank's shard of a
// flat parameter under FSDP.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/tensor/tensor.h"

namespace shardtrain::optim {

struct NamedParam {
  std::string name;
  Tensor* param;
};

// Which parameters get weight decay. Default (LLM practice): projections only, not norms or
// embeddings; with `decay_all` every parameter (what the reference AdamW step does).
bool default_decay_filter(const std::string& name);

struct AdamWOptions {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  bool decay_all = false;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update at learning rate `lr` using each parameter's .grad times `grad_scale`
  // (parameters without a gradient are skipped). The scale is how global-norm clipping reaches the
  // update (clip_factor): the AdamW optimizers multiply inside their update, saving a read and a
  // write of every gradient, and leave .grad unscaled; SGD scales .grad in place first.
  void step(float lr, float grad_scale = 1.0f) { update(lr, grad_scale); }
  void zero_grad();
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t s) { steps_ = s; }
  // Named state tensors (e.g. "exp_avg.<param>") for checkpoints.
  virtual std::vector<std::pair<std::string, Tensor*>> state() { return {}; }
  // Tells the optimizer that its parameters were overwritten from outside (a checkpoint was
  // loaded into them): optimizers that keep their own copy of the weights (OffloadedAdamW's host
  // master) read them again. Optimizers that update the parameters in place ignore it.
  virtual void reload_params() {}
  const std::vector<NamedParam>& params() const { return params_; }

 protected:
  explicit Optimizer(std::vector<NamedParam> params) : params_(std::move(params)) {}
  virtual void update(float lr, float grad_scale) = 0;
  std::vector<NamedParam> params_;
  int64_t steps_ = 0;
};

class AdamW : public Optimizer {
 public:
  AdamW(std::vector<NamedParam> params, AdamWOptions options);
  std::vector<std::pair<std::string, Tensor*>> state() override;

 private:
  void update(float lr, float grad_scale) override;
  AdamWOptions options_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
  std::vector<bool> decay_;
};

// SGD with momentum, as torch.optim.SGD: weight decay is added to the gradient (L2) before the
// momentum, on the parameters `decay_all` / default_decay_filter choose (as AdamW does).
class SGD : public Optimizer {
 public:
  SGD(std::vector<NamedParam> params, float momentum, float weight_decay, bool decay_all = false);
  std::vector<std::pair<std::string, Tensor*>> state() override;

 private:
  void update(float lr, float grad_scale) override;
  float momentum_, weight_decay_;
  std::vector<Tensor> buffers_;
  std::vector<bool> decay_;
};

// Linear warmup to peak over `warmup_steps` (0-based step s < W runs at peak (s + 1) / W, so the
// first step already moves), then cosine (or linear, or constant) decay from peak towards
// `min_lr` with progress (s - W) / (total_steps - W): the last step, s = total_steps - 1, runs one
// decay step above min_lr, which a step after the end would reach.
struct LrSchedule {
  enum class Kind { Cosine, Linear, Constant };
  Kind kind = Kind::Cosine;
  float peak = 3e-3f, min_lr = 3e-4f;
  int64_t warmup_steps = 0, total_steps = 1;
  // Learning rate of 0-based step `step`.
  float at(int64_t step) const;
};

// Sum of squared gradient elements of `params` (fp64), the building block of global norms.
double grad_sum_squares(const std::vector<NamedParam>& params);
// Scales every gradient by `factor`.
void scale_grads(const std::vector<NamedParam>& params, float factor);
// The factor that clips a global gradient norm `norm` to `max_norm`: max_norm / (norm + 1e-6)
// when the norm is finite and above max_norm (> 0), else 1 (PyTorch's clip_grad_norm_ rule).
float clip_factor(double norm, double max_norm);
// Clips the global gradient norm to `max_norm` (0 = no clipping) by scaling the gradients in place,
// and returns the norm before clipping. `sum_squares` may be given (e.g. already reduced across
// ranks). Training does not call this: it passes clip_factor() to Optimizer::step instead.
double clip_grad_norm(const std::vector<NamedParam>& params, double max_norm,
                      double sum_squares = -1.0);

}  // namespace shardtrain::optim
