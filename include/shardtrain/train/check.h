// `shardtrain check`: reproduces a reference case (loss, logits, gradients, one AdamW step) under
// any configuration the trainer accepts, and reports the error of every tensor.
#pragma once
#include <string>
#include <vector>

#include "shardtrain/train/config.h"

namespace shardtrain::train {

struct CheckOptions {
  std::string model_dir;      // Hugging Face layout: config.json + model.safetensors
  std::string batch_file;     // input_ids, targets
  std::string expected_file;  // loss, logits, grad.<name>, step1.<name>; AdamW hyper-parameters
  double rtol = -1;           // < 0: chosen from the compute precision
  double atol = -1;           // < 0: rtol x the reference tensor's RMS
};

struct TensorError {
  std::string name;
  double max_abs = 0, max_rel = 0, tolerance_rtol = 0, tolerance_atol = 0;
  int64_t numel = 0;
  bool ok = false;
};

struct CheckReport {
  std::vector<TensorError> tensors;
  bool ok() const;
  std::string table() const;  // one row per tensor, then a verdict line
};

// Runs forward, backward and one optimizer step on the reference batch with `config`
// (model.from_hf is set to options.model_dir). Throws on unusable input files.
CheckReport run_check(Config config, const CheckOptions& options);

}  // namespace shardtrain::train
