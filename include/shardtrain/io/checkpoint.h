// Training checkpoints in HDF5, written by every rank of a job at once and readable by a job of
// any size.
//
// A checkpoint of step N in its directory is a set of files (docs/checkpoints.md has the full
// format):
//   step-0000000N.h5         the checkpoint: every tensor at its full logical shape, as an HDF5
//                            virtual dataset over the rank files, plus the training state
//   step-0000000N.rank-R.h5  the contiguous ranges of tensors that rank R held (1-D datasets)
//
// Serial HDF5 cannot have several processes write one file, so each rank writes its own file and
// rank 0 then writes the main file, whose datasets only map onto the rank files. Other readers
// open the main file alone and see whole tensors (h5py, h5dump); CheckpointReader reads the
// ranges from the rank files, as the main file's piece records name them.
//
// Saving is atomic: every file is written under a ".tmp" name, closed and fsynced; after every
// rank has finished, rank 0 renames the rank files and then the main file, whose last write before
// closing is its `complete` attribute. Each range carries a checksum, recorded in its rank file
// and again in the main file, so a reader can prove that the data behind every virtual dataset is
// the data that was saved.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "shardtrain/amp/grad_scaler.h"
#include "shardtrain/dist/process_group.h"
#include "shardtrain/tensor/tensor.h"

namespace shardtrain::io {

// A contiguous part of a tensor held by this rank: the elements [begin, begin + data.numel())
// of the row-major flattened tensor `name` whose full shape is `shape`. A process that holds
// whole tensors gives begin 0 and the tensor itself.
struct TensorRange {
  std::string name;  // path in the checkpoint: "model/<param>", "optim/exp_avg/<param>", ...
  Shape shape;       // the full tensor's shape (at least one dimension)
  int64_t begin = 0;
  Tensor data;  // fp32 (converted otherwise), any shape and device; numel() is the length
};

// A random generator's state (see Generator): the two integers that fix its future draws.
struct GeneratorState {
  std::string name;  // e.g. "model.layers.0.self_attn.q_proj.lora_dropout"
  uint64_t seed = 0;
  uint64_t offset = 0;
  bool operator==(const GeneratorState&) const = default;
};

// Where the training sampler stands: its seed, epoch and windows already taken in the epoch (the
// data layer's SamplerState, kept here as plain numbers: io does not depend on data).
struct SamplerPosition {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t position = 0;
  uint64_t data_checksum = 0;  // of the tokens it walks; 0 = not recorded (older checkpoints)
  bool operator==(const SamplerPosition&) const = default;
};

// Everything a checkpoint holds besides the tensors.
struct TrainingState {
  int64_t step = 0;       // optimizer steps completed; training continues with step + 1 (1-based)
  std::string optimizer;  // "adamw" | "sgd"
  int64_t optimizer_steps = 0;  // the optimizer's own count (bias correction)
  double lr = 0;                // learning rate of the last step taken
  bool scaler_enabled = false;
  amp::GradScalerState scaler;
  SamplerPosition sampler;  // the training sampler, positioned at the next batch
  uint64_t init_seed = 0;   // the model initialisation generator's seed (train.seed)
  std::string config_yaml;  // the resolved configuration of the run that saved
  // What the frozen weights are, for a run that trains adapters over a base the checkpoint does
  // not hold (LoRA): the fingerprint of its Hugging Face weights, or the seed it was initialised
  // from. Empty otherwise, and in checkpoints written before it was recorded.
  std::string frozen_base;
  // The model the weights are for, as config.json text (LlamaConfig::to_hf_json): with
  // model.from_hf the run config's model keys are not the model, config.json is. Empty in
  // checkpoints written before it was recorded.
  std::string model_config_json;
  std::string sharding = "none";  // dist.sharding of the saving job, "none" for one rank
  // The flat-parameter layout of every sharded unit (JSON: names, shapes, offsets, padding,
  // shards); empty when not sharded. Informational: loading goes by tensor name.
  std::string layout_json;
  // Filled by save_checkpoint / read from the file: the job size and every rank's generators
  // (rng[r] = rank r's, in the same order on every rank).
  int64_t world_size = 1;
  std::vector<std::vector<GeneratorState>> rng;
};

// One save, as seen from one rank.
struct SaveRequest {
  std::string dir;
  TrainingState state;  // rank 0's is written; every rank must give the same step
  std::vector<GeneratorState> generators;  // this rank's
  std::vector<TensorRange> ranges;         // this rank's
  // False on ranks whose ranges another rank already writes (replicas of a shard: no_shard,
  // hybrid_shard): they write no rank file.
  bool writes_ranges = true;
};

// "step-00000040.h5" and "step-00000040.rank-3.h5" (at least 8 digits).
std::string checkpoint_file_name(int64_t step);
std::string rank_file_name(int64_t step, int rank);
// The step of a rank file's name or path (rank_file_name's form), nullopt for any other name.
std::optional<int64_t> rank_file_step(const std::string& name);

// Saves a checkpoint: collective over `group` (every rank calls it with the same step). Creates
// `dir` when missing and returns the main file's path. A failure on any rank throws on every rank
// (Error naming the file and the rank) and leaves no file under a checkpoint's final name.
std::string save_checkpoint(dist::ProcessGroup& group, const SaveRequest& request);

// Checks that the checkpoint at `path` is whole: the main file opens and is `complete`, every rank
// file it maps onto exists and is complete, and the data of every range hashes to the checksum
// the main file recorded. Collective over `group` (the hashing is split over its ranks). Returns
// "" when it is intact, else a message naming the file and what is wrong, the same on every rank.
std::string verify_checkpoint(dist::ProcessGroup& group, const std::string& path);

// A main file ends in a checksum of its bytes, checked before HDF5 parses them (HDF5 does not
// checksum the part that holds the virtual datasets' mappings, and damage there can crash it).
// Editing the file with HDF5 (h5py, H5Adelete, ...) drops the trailer, and the file is then
// refused as damaged; this re-seals such a file as it now is. A file with a valid trailer is
// left alone; one whose trailer does not match is a FormatError (damage is not re-sealed).
void reseal_checkpoint_file(const std::string& main_path);

struct CheckpointEntry {
  int64_t step = 0;
  std::string path;  // main file
};
// The main files in `dir` by name (complete or not; temporary files excluded), newest first.
// A missing directory gives an empty list.
std::vector<CheckpointEntry> list_checkpoints(const std::string& dir);
// Applies checkpoint.keep_last after a run saved step `saved_step` in `dir`: keeps the
// `keep_last` newest complete checkpoints up to that step (0 keeps everything) and deletes every
// file of older checkpoints, complete or not, and leftovers of interrupted saves older than
// `saved_step`. The checkpoints in `refused` (steps the run's resume found damaged) do not count
// among those kept; they are deleted once older than the oldest kept. Checkpoints past
// `saved_step` are left alone: a run saves past a later checkpoint only when resume refused it,
// and it is neither the run's to delete nor one that counts. Not collective: one rank calls it.
void prune_checkpoints(const std::string& dir, int64_t keep_last, int64_t saved_step,
                       const std::set<int64_t>& refused = {});

// One contiguous range of a tensor as the main file records it: the rank file that holds it, the
// flat elements [begin, begin + length) it covers, and their checksum.
struct CheckpointPiece {
  int rank = 0;
  int64_t begin = 0, length = 0;
  uint64_t checksum = 0;
};

// Reads a checkpoint: its training state and tensor list from the main file, each tensor's data
// from the rank files the main file records for it, the files verify_checkpoint checks (not
// through the virtual datasets, whose mappings nothing checks against those records).
class CheckpointReader {
 public:
  // Throws FormatError naming the file when it is not an HDF5 file, cannot be opened (e.g.
  // truncated), is not a shardtrain checkpoint, lacks its `complete` attribute, or records state
  // no run could have saved (a negative position, a loss scale that is not a positive float,
  // pieces that do not tile a tensor). Reads no tensor data.
  explicit CheckpointReader(const std::string& path);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& path() const { return path_; }
  const TrainingState& state() const { return state_; }
  // Tensor paths ("model/<param>", "optim/<kind>/<param>"), sorted.
  const std::vector<std::string>& tensor_names() const { return names_; }
  bool has(const std::string& name) const;
  // Throws FormatError naming the file when the tensor is missing.
  Shape shape(const std::string& name) const;
  // The ranks that wrote a rank file (attribute writer_ranks); every piece is on one of them.
  const std::vector<int64_t>& writer_ranks() const { return writer_ranks_; }
  // The pieces of a tensor, in element order; together they cover it exactly once.
  const std::vector<CheckpointPiece>& pieces(const std::string& name) const;
  // The whole tensor, fp32 on the CPU device.
  Tensor read(const std::string& name) const;
  // Elements [begin, begin + out.numel()) of the flattened tensor into `out` (any float dtype,
  // any device). Throws ShapeError when the range exceeds the tensor.
  void read_range(const std::string& name, int64_t begin, Tensor& out) const;

 private:
  struct File;
  std::string path_;
  std::unique_ptr<File> file_;
  TrainingState state_;
  std::vector<std::string> names_;
  std::vector<int64_t> writer_ranks_;
};

}  // namespace shardtrain::io
