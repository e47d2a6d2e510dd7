// The training loop: data, steps, evaluation, progress, metrics and the final export.
#pragma once
#include <string>

#include "shardtrain/train/config.h"

namespace shardtrain::train {

struct TrainSummary {
  int64_t steps = 0;          // the step the run ended at
  int64_t first_step = 0;     // the step it started from (> 0 when resumed from a checkpoint)
  int64_t skipped_steps = 0;  // steps whose update fp16 loss scaling skipped (inf/nan gradients)
  double first_loss = 0, final_loss = 0;
  double final_eval_loss = -1;  // < 0: never evaluated
  int64_t final_eval_step = 0;  // the step final_eval_loss was measured after
  double unigram_entropy_nats = 0;
  double tokens_per_second = 0;
  std::string metrics_path, export_dir;
  // The newest checkpoint of this run's weights: the last it saved, else the one it resumed from
  // ("" if none), and its step.
  std::string last_checkpoint;
  int64_t last_checkpoint_step = -1;
  bool stopped_early = false;  // SIGTERM/SIGUSR1 ended the run after a checkpoint
};

// Runs `config` to completion. Writes <out_dir>/metrics.jsonl (one JSON object per step and per
// evaluation, losses at full precision), <out_dir>/config.yaml (the resolved config) and, when
// train.export is on, the model in Hugging Face layout under <out_dir>/export.
TrainSummary run_training(const Config& config);

}  // namespace shardtrain::train
