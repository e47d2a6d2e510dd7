#include "shardtrain/train/schedule.h"

namespace shardtrain::train {

optim::LrSchedule lr_schedule(const Config& config) {
  const OptimConfig& o = config.optim;
  optim::LrSchedule s;
  // Config validation admits only these three names.
  s.kind = o.schedule == "cosine"   ? optim::LrSchedule::Kind::Cosine
           : o.schedule == "linear" ? optim::LrSchedule::Kind::Linear
                                    : optim::LrSchedule::Kind::Constant;
  s.peak = static_cast<float>(o.lr);
  s.min_lr = static_cast<float>(o.effective_min_lr());
  s.warmup_steps = o.warmup_steps;
  s.total_steps = config.train.steps;
  return s;
}

}  // namespace shardtrain::train
