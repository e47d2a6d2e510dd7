// The learning-rate schedule a config asks for (optim.schedule, lr, min_lr, warmup_steps over
// train.steps), shared by training and benchmarks so both step the same curve.
#pragma once
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/config.h"

namespace shardtrain::train {

optim::LrSchedule lr_schedule(const Config& config);

}  // namespace shardtrain::train
