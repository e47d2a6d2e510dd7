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
  // fp32: every element within atol + rtol*|reference| (numpy.allclose); defaults rtol 1e-4 and
  // atol = rtol x the reference tensor's RMS. bf16/fp16, whose per-element rounding makes an
  // elementwise test meaningless for small elements: the relative L2 error ||got - ref|| / ||ref||
  // must be at most rtol (default 5e-2 for bf16, 1e-2 for fp16: both about 8 ulps of the format
  // relative to the tensor, since every activation and gradient is rounded to it).
  double rtol = -1;  // < 0: chosen from the compute precision
  double atol = -1;
};

struct TensorError {
  std::string name;
  double max_abs = 0, max_rel = 0, rel_l2 = 0, tolerance_rtol = 0, tolerance_atol = 0;
  bool normwise = false;      // judged by rel_l2 (half precision) instead of elementwise
  bool widened_atol = false;  // atol widened element by element (the AdamW step's tensors)
  int64_t numel = 0;
  bool ok = false;
};

struct CheckReport {
  std::vector<TensorError> tensors;
  int world_size = 1;
  bool leader = true;  // rank 0: the one that prints
  // Where it ran, e.g. "on 2 ranks, device cuda:0, process group nccl, sharding full_shard":
  // the first line of table(), so that a log shows which path the verdict is about.
  std::string setting;
  bool ok() const;
  std::string table() const;  // one row per tensor, then a verdict line
};

// Runs forward, backward and one optimizer step on the reference batch with `config`
// (model.from_hf is set to options.model_dir). Throws on unusable input files.
CheckReport run_check(Config config, const CheckOptions& options);

}  // namespace shardtrain::train
