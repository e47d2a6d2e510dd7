// A model ready to train: the device, the Llama, the activation strategy, the precision policy,
// the optimizer, and one training step over a global batch.
//
// One step (train_step):
//   1. count the global batch's target tokens (the loss normaliser);
//   2. per micro-batch: forward -> summed cross-entropy -> scale by loss_scale / tokens ->
//      backward (gradients accumulate in fp32 .grad);
//   3. the sum of squares of the gradients, still multiplied by the loss scale: the global norm,
//      and (fp16 loss scaling) the inf/nan check;
//   4. optimizer step unless the scaler found inf/nan, the loss scale and the clipping factor
//      applied inside the update; scaler update.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "shardtrain/amp/grad_scaler.h"
#include "shardtrain/data/batch.h"
#include "shardtrain/data/token_dataset.h"
#include "shardtrain/memory/capacity_scope.h"
#include "shardtrain/memory/stats.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/config.h"

namespace shardtrain::dist {
class DistEnv;
}
namespace shardtrain::fsdp {
class ShardedModel;
}

namespace shardtrain::train {

// "auto" picks cuda:0 when a GPU is usable, else the CPU device. Asking for cuda without one is
// an error (no silent fallback).
Device resolve_device(const std::string& name);
// The device this process trains on: train.device resolved as above, except that with several
// ranks on a node "auto" and "cuda" mean the local rank's GPU (one GPU per rank). Throws
// ConfigError when the node has fewer GPUs than ranks.
Device training_device(const Config& config);
// With model.from_hf the model is what <from_hf>/config.json describes. A model key that the run
// config sets must agree with it: one named in `keys_given` ("model.num_layers"), or one away from
// its default, since a config without `keys_given` cannot tell a default from a request. Every
// disagreement is listed in one ConfigError. The model keys then take config.json's values, so
// that `shardtrain config`, the run's config.yaml and a checkpoint's saved config show the model
// that trains; max_seq_len (a limit on train.seq_len, not part of the weights) becomes the longer
// of the two and init_std (loaded weights are not initialised) is left. Returns config.json's
// model. Without model.from_hf, nothing changes and the result is empty. `given_as` names where
// the user gave the directory ("model.from_hf", "lora.base_model", "check --model"), for the
// errors about a directory that is missing or is no model.
std::optional<nn::LlamaConfig> resolve_model_from_hf(ModelConfig& model,
                                                     const std::set<std::string>& keys_given = {},
                                                     const std::string& given_as = "model.from_hf");

// Throws ConfigError when lora.enabled is set in a job of several ranks: QLoRA quantizes whole
// base weights on one device. Checked before a run creates anything (Runtime checks it too).
void check_lora_world_size(const Config& config, int world_size);

// The model a run config describes: its model keys, or with model.from_hf the directory's
// config.json (resolve_model_from_hf: model keys set away from their defaults must agree).
nn::LlamaConfig llama_config_from(const ModelConfig& model);

// Throws ConfigError when `data` (read from data.path) has a larger vocabulary than the model
// (model.vocab_size, or config.json's with model.from_hf): some token would have no embedding
// row, and the run would fail at the first batch that holds one, possibly hours in.
void check_data_fits_model(const TokenDataset& data, const Config& config);

struct StepResult {
  double loss = 0;       // mean cross-entropy per counted token of the global batch
  double grad_norm = 0;  // before clipping
  int64_t tokens = 0;    // counted target tokens
  bool skipped = false;  // inf/nan gradients (loss scaling): no update was made
  float lr = 0;
  float loss_scale = 1;
  // Activation strategy counters of this step.
  int64_t forward_reruns = 0, bytes_offloaded = 0, bytes_restored = 0;
  double recompute_seconds = 0, transfer_seconds = 0;
  // Offload copies' own duration (bus time; on a GPU they overlap compute): see
  // activation::ActivationCounters::copy_seconds.
  double copy_seconds = 0;
  MemoryStats device_memory;  // peaks since the start of the step
  MemoryStats host_memory;
};

class Runtime {
 public:
  // Builds the model (from model.from_hf when set, else initialised from train.seed), applies
  // the activation strategy and precision policy, and creates the optimizer. Under a sharding
  // strategy other than no_shard (more than one rank) the full model is never built: each rank
  // creates only its shards, from the seed or from the checkpoint's files. A QLoRA base is built
  // one projection at a time; `on_base_projection`, when given, is told after each how many of
  // how many are done (minutes for billions of weights).
  explicit Runtime(
      const Config& config,
      const std::function<void(int64_t done, int64_t total)>& on_base_projection = nullptr);
  ~Runtime();

  // One optimizer step over this rank's micro-batches. An inf or nan gradient skips the step
  // under loss scaling (StepResult::skipped); without it, it throws shardtrain::Error before the
  // update, leaving the weights and the optimizer as they were.
  StepResult train_step(const std::vector<Batch>& micro_batches, float lr);
  // Forward and backward only: gradients are left unscaled in .grad, no optimizer step.
  struct Gradients {
    double loss = 0;         // mean cross-entropy per counted token
    bool found_inf = false;  // a gradient overflowed (loss scaling): the step must be skipped
  };
  Gradients forward_backward(const std::vector<Batch>& micro_batches);
  // Mean cross-entropy per counted token over `batches` (the same list on every rank), no graph.
  // Collective: each rank evaluates its share (every world-size-th batch) and the sums are
  // all-reduced, so W ranks evaluate a set W times faster than one.
  double eval_loss(const std::vector<Batch>& batches);
  // The same, abandoned between batches once `stop_requested` is true on any rank (asked before
  // each round and agreed by a host all-reduce, so every rank leaves at the same round):
  // nullopt then. For a long evaluation that a stop signal should not have to wait for. An empty
  // `stop_requested` never stops (and costs no all-reduce). `on_progress`, when given, is told
  // before each round and once at the end how many of the batches the ranks have evaluated so
  // far, of how many.
  std::optional<double> eval_loss(
      const std::vector<Batch>& batches, const std::function<bool()>& stop_requested,
      const std::function<void(int64_t done, int64_t total)>& on_progress = nullptr);

  nn::LlamaModel& model() { return *model_; }
  optim::Optimizer& optimizer() { return *optimizer_; }
  amp::GradScaler& scaler() { return *scaler_; }
  Device device() const { return device_; }
  const Config& config() const { return config_; }
  // The fp32 parameters the optimizer updates (this rank's shard pieces when sharded).
  std::vector<optim::NamedParam> trainable() const;
  // The job's ranks: a world of one unless launched by mpirun/srun. Each rank passes its own
  // micro-batches to train_step; token counts, losses and gradients are combined over ranks.
  dist::DistEnv& dist() { return *dist_; }
  // The sharding (dist.sharding) when the world has more than one rank, else null. Under
  // sharding the model's parameter slots are empty outside a forward: read the weights through
  // sharded()->for_each_full_parameter().
  fsdp::ShardedModel* sharded() { return sharded_.get(); }
  // What a LoRA run's frozen base is (io::TrainingState::frozen_base): "hf:<fingerprint>" of the
  // model.from_hf weights, or "init:..." with the seed and scale that initialised it; "" for a
  // run that trains every weight. Checkpoints record it and resuming compares it: adapters only
  // fit the base they were trained on. Taken once, at the first call (the fingerprint reads a
  // sample of every weight file).
  const std::string& frozen_base();

 private:
  Config config_;
  Device device_;
  // train.device_memory's cap on the device allocator, lifted when the runtime is gone (after
  // every member below has freed its memory) or when building it throws.
  std::optional<CapacityScope> device_capacity_;
  std::unique_ptr<dist::DistEnv> dist_;
  std::unique_ptr<nn::LlamaModel> model_;
  std::unique_ptr<fsdp::ShardedModel> sharded_;  // after model_, before optimizer_ (lifetimes)
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::unique_ptr<amp::GradScaler> scaler_;
  std::optional<std::string> frozen_base_;

  // Steps 1 and 2 of a step: the mean loss per counted token; the gradients stay multiplied by
  // the loss scale.
  double accumulate_gradients(const std::vector<Batch>& micro_batches);
};

}  // namespace shardtrain::train
