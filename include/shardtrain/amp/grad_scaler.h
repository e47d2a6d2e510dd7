// Dynamic loss scaling (torch.amp.GradScaler semantics) for 16-bit gradients.
//
// fp16 has a narrow range: gradients below 2^-24 flush to zero. Multiplying the loss by a large
// scale S lifts the gradients into range; they are divided by S again, in fp32, before clipping
// and the optimizer step. When a scaled gradient overflowed (inf or nan anywhere), the step is
// skipped and S is multiplied by backoff_factor; after growth_interval clean steps in a row S is
// multiplied by growth_factor.
//
// A step uses it in this order:
//   1. loss_scaled = ops::scale(loss_sum, scaler.scale() / total_counted_tokens)
//   2. autograd::backward(loss_scaled)           (every micro-batch)
//   3. found_inf = scaler.unscale_and_check(params)   (once, after the last micro-batch and
//      before gradient clipping, so the clip threshold applies to true gradients)
//   4. if (!found_inf) { clip; optimizer.step(lr); }
//   5. scaler.update(found_inf)                   (every step, skipped or not)
//   6. optimizer.zero_grad()
// train::Runtime::train_step fuses 3 and 4 instead, as PyTorch's fused optimizers do: it leaves
// the gradients scaled, takes found_inf and the norm from their sum of squares (times
// inv_scale() squared), and the optimizer multiplies by inv_scale() and the clipping factor as it
// reads each gradient: a pass over the gradients fewer, the same step for power-of-two scales.
// A disabled scaler has scale 1, leaves gradients untouched and never reports an overflow, so
// the same step code serves fp32 and bf16 runs.
#pragma once
#include <concepts>
#include <cstdint>
#include <vector>

#include "shardtrain/tensor/tensor.h"

namespace shardtrain::amp {

struct GradScalerOptions {
  float init_scale = 65536.0f;  // 2^16
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int64_t growth_interval = 2000;
  bool enabled = true;
};

// What a checkpoint stores to resume scaling exactly.
struct GradScalerState {
  float scale = 65536.0f;
  int64_t growth_tracker = 0;  // clean steps since the last growth or overflow
  int64_t skipped_steps = 0;   // steps skipped because of an overflow, over the whole run

  bool operator==(const GradScalerState&) const = default;
};

// A list entry naming a parameter slot, e.g. optim::NamedParam. (amp sits beside optim in the
// layering, so it accepts any such list instead of naming optim's type.)
template <typename T>
concept ParamEntry = requires(const T& entry) {
  { entry.param } -> std::convertible_to<Tensor*>;
};

class GradScaler {
 public:
  // Throws ConfigError for a non-positive or non-finite init_scale, growth_factor <= 1,
  // backoff_factor outside (0, 1) or growth_interval < 1.
  explicit GradScaler(GradScalerOptions options = {});

  bool enabled() const { return options_.enabled; }
  // The factor the loss is multiplied by (1 when disabled).
  float scale() const { return options_.enabled ? state_.scale : 1.0f; }
  // What unscaling multiplies the gradients by: 1 / scale(), formed in double and rounded once to
  // float as torch.amp does (exact for the power-of-two scales the defaults produce).
  float inv_scale() const { return static_cast<float>(1.0 / static_cast<double>(scale())); }
  int64_t growth_tracker() const { return state_.growth_tracker; }
  int64_t skipped_steps() const { return state_.skipped_steps; }
  const GradScalerOptions& options() const { return options_; }

  // Divides every defined .grad of `params` by the scale in place (multiplication by 1/scale,
  // exact for the power-of-two scales the defaults produce) and returns true when any gradient
  // held an inf or nan before unscaling: one fused pass per gradient tensor. Parameters without
  // a gradient are skipped. Call once per step: a second call before update() throws, since it
  // would divide the gradients twice. Disabled: returns false and touches nothing.
  bool unscale_and_check(const std::vector<Tensor*>& params);
  template <ParamEntry Entry>
  bool unscale_and_check(const std::vector<Entry>& params) {
    std::vector<Tensor*> slots;
    slots.reserve(params.size());
    for (const Entry& entry : params) slots.push_back(entry.param);
    return unscale_and_check(slots);
  }

  // Ends a step. found_inf: scale *= backoff_factor, the growth tracker restarts at 0 and the
  // skipped-step count goes up by one. Otherwise the tracker counts the clean step, and on
  // reaching growth_interval the scale is multiplied by growth_factor (kept only if finite) and
  // the tracker restarts. Disabled: does nothing. Throws Error when a backoff would take the scale
  // below the smallest normal float (about 1.2e-38, some 140 overflowing steps in a row from the
  // default): gradients that overflow at every scale come from a diverged run, and a smaller
  // scale would make 1/scale infinite, which the fused unscale would write into the weights.
  void update(bool found_inf);

  GradScalerState state() const { return state_; }
  // Restores a checkpointed state; throws FormatError for a non-positive or non-finite scale or
  // a negative counter.
  void set_state(const GradScalerState& state);

 private:
  GradScalerOptions options_;
  GradScalerState state_;
  bool unscaled_this_step_ = false;
};

}  // namespace shardtrain::amp
