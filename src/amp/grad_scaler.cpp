#include "shardtrain/amp/grad_scaler.h"

#include <cmath>
#include <limits>

#include "shardtrain/autograd/node.h"
#include "shardtrain/backend/backend.h"

namespace shardtrain::amp {

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  ST_CHECK_AS(ConfigError, std::isfinite(options.init_scale) && options.init_scale > 0.0f,
              "loss scaling: init_scale must be a positive finite number, got ",
              options.init_scale);
  ST_CHECK_AS(ConfigError, std::isfinite(options.growth_factor) && options.growth_factor > 1.0f,
              "loss scaling: growth_factor must be greater than 1, got ", options.growth_factor);
  ST_CHECK_AS(ConfigError, options.backoff_factor > 0.0f && options.backoff_factor < 1.0f,
              "loss scaling: backoff_factor must be in (0, 1), got ", options.backoff_factor);
  ST_CHECK_AS(ConfigError, options.growth_interval >= 1,
              "loss scaling: growth_interval must be at least 1 step, got ",
              options.growth_interval);
  state_.scale = options.init_scale;
}

bool GradScaler::unscale_and_check(const std::vector<Tensor*>& params) {
  if (!options_.enabled) return false;
  ST_CHECK(!unscaled_this_step_,
           "GradScaler::unscale_and_check called twice in one step: the gradients are already "
           "unscaled; call update() to end the step first");
  unscaled_this_step_ = true;
  std::vector<Tensor> grads;
  for (Tensor* param : params)
    if (Tensor g = autograd::grad(*param); g.defined()) grads.push_back(std::move(g));
  std::vector<Tensor*> pointers;
  for (Tensor& g : grads) pointers.push_back(&g);
  // Every gradient is unscaled even after an overflow was seen, so they stay consistent.
  bool found_inf = false;
  for (const auto& [device, list] :
       split_by_device(pointers, [](const Tensor* g) { return g->device(); }))
    found_inf = backend_for(device).unscale_and_check_multi(list, inv_scale()) || found_inf;
  return found_inf;
}

void GradScaler::update(bool found_inf) {
  unscaled_this_step_ = false;
  if (!options_.enabled) return;
  if (found_inf) {
    const float backed_off = state_.scale * options_.backoff_factor;
    ST_CHECK(backed_off >= std::numeric_limits<float>::min(),
             "fp16 loss scaling: the gradients overflowed at every loss scale down to ",
             state_.scale, " (", state_.skipped_steps + 1,
             " steps skipped in all): the run has diverged, or the model or data produce inf/NaN; "
             "lower optim.lr, set optim.grad_clip, check the data, or train with "
             "precision.compute=bf16, then continue from an earlier checkpoint");
    state_.scale = backed_off;
    state_.growth_tracker = 0;
    state_.skipped_steps += 1;
    return;
  }
  state_.growth_tracker += 1;
  if (state_.growth_tracker >= options_.growth_interval) {
    float grown = state_.scale * options_.growth_factor;
    if (std::isfinite(grown)) state_.scale = grown;
    state_.growth_tracker = 0;
  }
}

void GradScaler::set_state(const GradScalerState& state) {
  ST_CHECK_AS(FormatError, std::isfinite(state.scale) && state.scale > 0.0f,
              "loss-scaler state: scale must be a positive finite number, got ", state.scale);
  ST_CHECK_AS(FormatError, state.growth_tracker >= 0 && state.skipped_steps >= 0,
              "loss-scaler state: growth_tracker (", state.growth_tracker, ") and skipped_steps (",
              state.skipped_steps, ") must not be negative");
  state_ = state;
  unscaled_this_step_ = false;
}

}  // namespace shardtrain::amp
