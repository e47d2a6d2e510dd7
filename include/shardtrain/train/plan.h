// The scale-up recipe as a memory planner (`shardtrain plan`, `recipe: auto`).
//
// The recipe is an ordered list of changes, each cheaper in engineering and speed than the
// next, each applied on top of the ones before:
//   1. fp32 eager                 precision.compute=fp32, activation.strategy=none, plain
//                                 attention, replicated (no_shard) over the ranks
//   2. bf16                       precision.compute=bf16 (fp32 master weights stay)
//   3. fused kernels              activation.attention=fused (no S x S probabilities) and
//                                 activation.loss_chunk_tokens (the logits a chunk at a time)
//   4. per_layer checkpointing    activation.strategy=per_layer
//   5. offload_checkpoint         activation.strategy=offload_checkpoint
//   6. full_shard over N ranks    dist.sharding=full_shard
//   7. optimizer offload          optim.offload=cpu (AdamW moments in host memory)
// The plan predicts every row's per-rank peak with the memory model (train/memory_model.h) and
// names the first that fits the device, with what it costs: recomputed FLOPs and bytes moved
// over PCIe and over the links per step. docs/recipe.md has the formulas and worked examples.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shardtrain/train/config.h"
#include "shardtrain/train/memory_model.h"

namespace shardtrain::train {

struct RecipeRow {
  std::string name;    // "bf16", "per_layer checkpointing", ...
  std::string change;  // the keys this row sets on top of the previous one
  Config config;       // the whole configuration of this row
  MemoryModelInput input;
  MemoryPrediction predicted;
  StepCost cost;
  bool fits = false;  // predicted.peak <= the plan's device memory
  // Why this step cannot run with the rest of the configuration ("" when it can); such a step
  // never fits (optimizer offload with optim.name=sgd: the offloaded optimizer is AdamW).
  std::string unavailable;

  // Filled by measure_plan().
  bool measured = false;
  int64_t measured_peak = 0;
  // Why a row was not measured, the error of a failed run, or what the measured run did not do
  // as the row says (a setting this build ignores).
  std::string measure_note;
};

struct Plan {
  int64_t device_bytes = 0;
  int world_size = 1;
  std::vector<RecipeRow> rows;
  int first_fit = -1;  // index into rows; -1 when nothing fits
  // A cheaper variant of the first fitting row that also fits, if any (e.g. per_layer instead of
  // offload_checkpoint once sharding has made room); part of verdict().
  std::string note;

  // The table: one row per recipe step with the predicted per-rank peak and its parts, whether
  // it fits, and (after measure_plan) the measured peak and the prediction's error.
  std::string table() const;
  // "first that fits: ..." with its cost, or what is missing when nothing fits.
  std::string verdict() const;
};

// Predicts every recipe row for `config`'s model and batch shape on `world_size` ranks of
// `device_bytes` each. Throws ConfigError for a non-positive device size or world size, or a
// config the memory model cannot read.
Plan make_plan(const Config& config, int64_t device_bytes, int world_size);

// Runs `measured_steps` steps (after `warmup_steps`) of every row that this machine can run and
// records the measured peak beside the prediction. Rows run on the CPU device, when their
// predicted peak fits the plan's device memory and three quarters of physical memory (shared by
// the ranks). On a single process, rows of replicated (no_shard) training run as one rank's
// step; under mpirun every rank must call this, rows of the job's world size train across the
// ranks and the peak is the largest over ranks. Other rows get a note saying why they were not
// measured.
// `log` (optional) receives a line as each row starts and ends.
void measure_plan(Plan& plan, int64_t warmup_steps = 1, int64_t measured_steps = 2,
                  const std::function<void(const std::string&)>& log = {});

// `recipe: auto`: the configuration of the first recipe row that fits `device_bytes` per rank
// on `world_size` ranks. Keys the recipe does not own (model, data, batch shape, optimizer
// hyper-parameters, ...) are kept from `config`; the recipe sets precision.compute (and clears
// precision.param_dtype so it follows), activation.attention, activation.loss_chunk_tokens,
// activation.strategy, dist.sharding and optim.offload. When `why` is given it receives one line
// naming the row, its predicted peak and its cost. The result has recipe: manual (the choice is
// made, and its config.yaml reproduces it). Throws ConfigError containing the plan table when no
// row fits, and ConfigError naming them when `config` sets any of the keys the recipe sets away
// from its default (a request the recipe would overrule).
Config apply_recipe(const Config& config, int64_t device_bytes, int world_size,
                    std::string* why = nullptr);
// The ConfigErrors apply_recipe throws before planning: an activation.layers subset, or keys the
// recipe sets that `config` sets away from their defaults. For what checks a config without
// planning it (`shardtrain config`).
void check_recipe_auto_settings(const Config& config);

// What to do after `config` ran out of `device_bytes` per rank on `world_size` ranks: the memory
// model's peak for the configuration as it is, and the first recipe step that fits (or what is
// missing when none does); a recipe step includes the steps before it. Appended to the
// out-of-memory error of a training run. Never throws: a config the memory model cannot read
// gets an empty string.
std::string out_of_memory_advice(const Config& config, int64_t device_bytes, int world_size);

}  // namespace shardtrain::train
