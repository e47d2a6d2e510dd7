// A model of the device bytes one rank needs for a training step, as functions of the model
// shape, the micro-batch, the sequence length, the precision, the activation strategy, the world
// size and the sharding strategy. `shardtrain plan` and `recipe: auto` (train/plan.h) are built
// on it; docs/recipe.md derives every term.
//
// The peak is found the way it happens: the model walks the moments of a step (end of forward,
// the loss gradient, the head's backward, each decoder layer's backward, the embedding's
// backward, the optimizer step) and adds, at each moment, what is alive then: persistent state
// (fp32 master weights, optimizer moments), the gradients produced so far, the activations the
// strategy keeps (activation/estimate.h counts them from what the ops save), 16-bit compute
// copies or FSDP-gathered units, and the transient buffers of the op running at that moment.
// Every tensor is rounded up to the allocators' 64-byte granularity.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/memory/category.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/train/config.h"

namespace shardtrain::train {

// Everything the prediction depends on (MemoryModelInput::from_config fills it from a Config).
struct MemoryModelInput {
  nn::LlamaConfig model;
  int64_t micro_batch = 1;
  int64_t seq_len = 128;
  int64_t micro_batches_per_step = 1;  // gradient accumulation: gradients live during forwards
  std::string compute = "fp32";        // precision.compute: dtype of activations and logits
  std::string param_dtype;             // precision.param_dtype; "" = compute
  std::string reduce_dtype = "fp32";   // precision.reduce_dtype (FSDP gradient reduction)
  // Gradients reduced by MPI on the CPU device (several ranks): MPI has no 16-bit sum, so a
  // 16-bit reduce_dtype runs on fp32 copies of the buffers, counted as Workspace
  // (dist/mpi.cpp). NCCL reduces 16 bits directly; MPI on a GPU stages in host memory.
  bool reduced_by_mpi_on_cpu = false;
  std::string activation_strategy = "none";
  std::string attention = "plain";  // plain | fused
  int64_t loss_chunk_tokens = 0;    // activation.loss_chunk_tokens; 0 = whole logits
  int64_t offload_min_bytes = 0;
  bool reentrant = false;
  int world_size = 1;
  std::string sharding = "full_shard";  // full_shard | grad_op_shard | no_shard | hybrid_shard
  int ranks_per_node = 0;               // hybrid_shard's shard group; 0 = min(world, 8)
  bool prefetch = true;
  bool sync_every_microbatch = true;
  std::string optimizer = "adamw";         // adamw | sgd
  double momentum = 0.9;                   // sgd: 0 = no state
  std::string optimizer_offload = "none";  // none | cpu
  std::string offload_moments = "host";    // host | device (where offloaded moments live)
  // QLoRA: adapters of rank lora_r on lora_targets; the frozen base NF4 or plain.
  bool lora = false;
  int64_t lora_r = 16;
  double lora_dropout = 0;  // > 0: every adapter keeps its own dropped-out input and mask
  std::vector<std::string> lora_targets;
  std::string quantize_base = "nf4";

  // train.micro_batch, train.seq_len, the accumulation steps for `world_size` data-parallel
  // ranks, precision.*, activation.*, dist.*, optim.* and lora.* of `config`.
  static MemoryModelInput from_config(const Config& config, int world_size);
};

struct MemoryPrediction {
  int64_t peak = 0;                                     // device bytes per rank
  std::array<int64_t, kNumMemoryCategories> at_peak{};  // the peak by category (sums to peak)
  std::string peak_moment;  // "end of forward", "loss gradient", "backward of layer 3", ...

  // Persistent per-rank state (ZeRO's "model states"): fp32 master weights, fp32 gradients (all
  // of them exist at the optimizer step) and optimizer state on the device.
  int64_t master_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_bytes = 0;  // on the device; offloaded state is in host_optimizer_bytes
  int64_t model_state_bytes() const { return master_bytes + gradient_bytes + optimizer_bytes; }
  // Frozen weights (LoRA bases, NF4 included), counted with master_bytes in at_peak.
  int64_t frozen_bytes = 0;

  // Transient at the peak: 16-bit compute copies or FSDP-gathered units (Parameters), saved
  // activations, and op/communication buffers (Workspace).
  int64_t compute_copy_bytes = 0;
  int64_t activation_bytes = 0;
  int64_t workspace_bytes = 0;

  int64_t host_activation_bytes = 0;  // offloaded activations when forward returns
  // Optimizer offload: the fp32 master copy and (optim.offload_moments=host) the moments.
  int64_t host_optimizer_bytes = 0;
  int64_t host_bytes() const { return host_activation_bytes + host_optimizer_bytes; }

  int64_t total_parameters = 0;      // elements of the model
  int64_t trainable_parameters = 0;  // elements the optimizer updates
};

// Throws ConfigError for an unknown strategy, dtype, sharding or optimizer, or a world size < 1.
MemoryPrediction predict_memory(const MemoryModelInput& input);

// What a step costs beyond plain fp32 training on one rank.
struct StepCost {
  double step_flops = 0;       // forward + backward (3x forward) over the step's tokens, per rank
  double recompute_flops = 0;  // extra forward work: checkpoint re-runs, a chunked loss's logits
  double recompute_fraction() const { return step_flops > 0 ? recompute_flops / step_flops : 0; }
  int64_t pcie_bytes = 0;  // device <-> host per step: offloaded activations, optimizer offload
  int64_t link_bytes = 0;  // sent by one rank per step: all-gathers, reduce-scatters, all-reduces
};
StepCost predict_step_cost(const MemoryModelInput& input);

}  // namespace shardtrain::train
