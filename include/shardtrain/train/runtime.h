// A model ready to train: the device, the Llama, the activation strategy, the precision policy,
// the optimizer, and one training step over a global batch.
//
// One step (train_step):
//   1. count the global batch's target tokens (the loss normaliser);
//   2. per micro-batch: forward -> summed cross-entropy -> scale by loss_scale / tokens ->
//      backward (gradients accumulate in fp32 .grad);
//   3. unscale + inf/nan check (fp16 loss scaling), global-norm clipping;
//   4. optimizer step unless the scaler found inf/nan; scaler update.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/data/batch.h"
#include "shardtrain/memory/stats.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/config.h"

namespace shardtrain::train {

// "auto" picks cuda:0 when a GPU is usable, else the CPU device. Asking for cuda without one is
// an error (no silent fallback).
Device resolve_device(const std::string& name);
nn::LlamaConfig llama_config_from(const ModelConfig& model);

struct StepResult {
  double loss = 0;        // mean cross-entropy per counted token of the global batch
  double grad_norm = 0;   // before clipping
  int64_t tokens = 0;     // counted target tokens
  bool skipped = false;   // inf/nan gradients (loss scaling): no update was made
  float lr = 0;
  float loss_scale = 1;
  MemoryStats device_memory;  // peaks since the start of the step
  MemoryStats host_memory;
};

class Runtime {
 public:
  // Builds the model (from model.from_hf when set, else initialised from train.seed), applies
  // the activation strategy and precision policy, and creates the optimizer.
  explicit Runtime(const Config& config);
  ~Runtime();

  StepResult train_step(const std::vector<Batch>& micro_batches, float lr);
  // Forward and backward only (gradients left in .grad, no optimizer step); returns the loss.
  double forward_backward(const std::vector<Batch>& micro_batches);
  // Mean cross-entropy per counted token, no graph.
  double eval_loss(const std::vector<Batch>& batches);

  nn::LlamaModel& model() { return *model_; }
  optim::Optimizer& optimizer() { return *optimizer_; }
  Device device() const { return device_; }
  const Config& config() const { return config_; }
  // The fp32 parameters the optimizer updates.
  std::vector<optim::NamedParam> trainable() const;

 private:
  Config config_;
  Device device_;
  std::unique_ptr<nn::LlamaModel> model_;
  std::unique_ptr<optim::Optimizer> optimizer_;
};

}  // namespace shardtrain::train
