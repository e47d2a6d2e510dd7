#include "shardtrain/train/trainer.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "shardtrain/backend/attention.h"
#include "shardtrain/backend/cpu_threads.h"
#ifdef SHARDTRAIN_HAVE_CUDA
#include "shardtrain/backend/cuda.h"
#endif
#include "shardtrain/core/files.h"
#include "shardtrain/core/units.h"
#include "shardtrain/data/corpus.h"
#include "shardtrain/data/sampler.h"
#include "shardtrain/data/token_dataset.h"
#include "shardtrain/data/tokenizer.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/io/bnb.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/io/peft.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/memory/host_capacity.h"
#include "shardtrain/nn/lora.h"
#include "shardtrain/train/checkpointing.h"
#include "shardtrain/train/output_dir.h"
#include "shardtrain/train/plan.h"
#include "shardtrain/train/progress.h"
#include "shardtrain/train/run_lock.h"
#include "shardtrain/train/runtime.h"
#include "shardtrain/train/schedule.h"

namespace shardtrain::train {

using detail::concat;

namespace {

nlohmann::json memory_json(const MemoryStats& s) {
  nlohmann::json j;
  j["peak"] = s.total_peak;
  for (int i = 0; i < kNumMemoryCategories; ++i)
    j[std::string(category_name(static_cast<MemoryCategory>(i)))] = s.peak[static_cast<size_t>(i)];
  return j;
}

// The per-rank device memory a plan is made against: train.device_memory, else a GPU's total
// memory; 0 for a device of no fixed size (the CPU without a cap).
int64_t planning_capacity(const Config& config) {
  int64_t device_bytes = config.train.device_memory_bytes();
#ifdef SHARDTRAIN_HAVE_CUDA
  const Device device = training_device(config);
  if (device_bytes == 0 && device.is_cuda()) device_bytes = cuda::total_memory(device.index);
#endif
  return device_bytes;
}

// The memory model's host bytes (and a .txt corpus held in memory) for the ranks of this node
// against what the node has. A run past
// it would be ended by the kernel's out-of-memory killer part-way through a step (SIGKILL: no
// message, and under mpirun a dead rank), so it fails here with the figures. Only a prediction
// beyond the whole of the memory fails; below that the allocators' own errors speak, and a
// configuration the memory model cannot read is not checked.
void check_host_memory(const Config& config, int world) {
  const HostCapacity capacity = host_memory_capacity();
  if (capacity.bytes <= 0) return;
  MemoryPrediction p;
  try {
    p = predict_memory(MemoryModelInput::from_config(config, world));
  } catch (const std::exception&) {
    return;
  }
  const bool on_host = training_device(config).is_cpu();
  // A .txt corpus is read whole and held as uint32 tokens: 4 bytes a byte, plus the text while
  // it is tokenized. (Token datasets are memory-mapped: page cache, not this process's memory.)
  std::error_code ec;
  const std::string& data = config.data.path;
  const int64_t text_bytes =
      names_text_corpus(data) ? static_cast<int64_t>(std::filesystem::file_size(data, ec)) : 0;
  const int64_t data_bytes = ec ? 0 : 5 * text_bytes;
  // The CPU allocator keeps freed blocks for reuse: host memory the process holds on top of
  // the peak in use.
  const int64_t cached = on_host ? cpu_allocator_bound(p.peak) - p.peak : 0;
  const int64_t per_rank = p.host_bytes() + (on_host ? p.peak + cached : 0) + data_bytes;
  const int64_t ranks_here = std::max(1, dist::detect_launch().local_size);
  const int64_t needed = per_rank * ranks_here;
  if (needed <= capacity.bytes) return;
  std::string parts = on_host ? "a peak of " + format_bytes(p.peak) + " on the cpu device at " +
                                    p.peak_moment + " + up to " + format_bytes(cached) +
                                    " of freed blocks kept for reuse"
                              : "";
  if (p.host_bytes() > 0)
    parts += std::string(parts.empty() ? "" : " + ") + format_bytes(p.host_bytes()) +
             " of offloaded optimizer state and activations";
  if (data_bytes > 0)
    parts += std::string(parts.empty() ? "" : " + ") + format_bytes(data_bytes) + " for " + data +
             " read into memory and tokenized";
  const std::string ranks = ranks_here > 1 ? " x " + std::to_string(ranks_here) +
                                                 " ranks on this node = " + format_bytes(needed)
                                           : "";
  // What the model itself holds on this host at every step, whatever the batch: past the whole
  // memory, the batch keys are no answer.
  const int64_t model_states =
      (on_host ? p.model_state_bytes() + p.frozen_bytes : 0) + p.host_optimizer_bytes;
  const std::string fix =
      model_states * ranks_here > capacity.bytes
          ? concat("the model alone (", p.total_parameters,
                   " parameters: ", format_bytes(model_states),
                   " of weights, gradients and optimizer state a rank) does not fit: choose a "
                   "smaller model (model.vocab_size, model.hidden_size, "
                   "model.intermediate_size, model.num_layers)",
                   on_host ? ", shard it over more nodes (dist.sharding=full_shard), or train "
                             "on GPUs"
                           : ", or keep the optimizer state on the GPU (optim.offload=none)")
      : data_bytes > capacity.bytes / 2
          ? "convert " + data +
                " to a token dataset, which is memory-mapped instead (`shardtrain "
                "prepare-data --input " +
                data + " --output DATA.h5`)"
      : on_host ? "lower train.micro_batch or train.seq_len, use an activation.strategy that "
                  "recomputes (per_layer, sqrt_segment), put fewer ranks on each node, or train "
                  "on a GPU"
                : "keep the optimizer state on the GPU (optim.offload=none, or "
                  "optim.offload_moments=device), use an activation.strategy that recomputes "
                  "instead of offloading, or put fewer ranks on each node";
  throw HostOutOfMemoryError("out of host memory before the first step: this run needs about " +
                                 format_bytes(per_rank) + " of host memory per rank (" + parts +
                                 ")" + ranks + ", more than the " + format_bytes(capacity.bytes) +
                                 " of " + capacity.source + ": " + fix +
                                 " (`shardtrain plan --config ...` shows the figures)",
                             needed);
}

// Ranks that read different files under one data.path (a node-local copy that differs, a
// directory not shared) would train on different data without any error: the ranks compare the
// checksum of every token (TokenDataset::checksum, taken while the tokens were validated).
void check_same_data_on_every_rank(const TokenDataset& data, const std::string& path,
                                   dist::ProcessGroup& world) {
  if (world.size() == 1) return;
  ST_CHECK_AS(ConfigError, !world.differs_between_ranks({data.checksum()})[0], "data.path '", path,
              "' holds different tokens on different ranks (here, on rank ", world.rank(), ": ",
              data.size(),
              " tokens): every rank must read the same data; put it on a file "
              "system every rank shares, or give every node the same copy");
}

// Every rank writes its part of a checkpoint into the checkpoint directory and rank 0 reads them
// all: a path that is not one directory for every rank (node-local storage) would fail the first
// save, losing the steps before it. Rank 0 makes a file there that every rank must see.
void check_checkpoint_dir_shared(const std::string& dir, const std::string& key,
                                 dist::ProcessGroup& world) {
  if (world.size() == 1) return;
  const std::string probe = dir + "/.shardtrain-shared-check";
  // A token no earlier run left: rank 0's pid and clock, the same on every rank after the max.
  const int64_t mine = world.rank() != 0
                           ? 0
                           : (static_cast<int64_t>(::getpid()) << 32) ^
                                 std::chrono::steady_clock::now().time_since_epoch().count();
  const int64_t token = world.all_reduce_host(mine, dist::ReduceOp::Max);
  if (world.rank() == 0) std::ofstream(probe, std::ios::trunc) << token << "\n";
  world.all_reduce_host(int64_t{0}, dist::ReduceOp::Max);  // written before anyone reads
  // A network file system may show a new file to other clients a moment late: a few tries.
  int64_t seen = -1;
  for (int attempt = 0; attempt < 20 && seen != token; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::ifstream(probe) >> seen;
  }
  // The lowest rank that does not see it, or the world size when every rank does.
  const int64_t first_blind = -world.all_reduce_host(
      -(seen == token ? static_cast<int64_t>(world.size()) : world.rank()), dist::ReduceOp::Max);
  if (world.rank() == 0) {
    std::error_code ec;
    std::filesystem::remove(probe, ec);
  }
  ST_CHECK_AS(ConfigError, first_blind == world.size(), key, " '", dir,
              "' is not the same directory on every rank: rank ", first_blind,
              " does not see the file rank 0 made in it (node-local storage, or a relative path "
              "from different working directories); every rank writes its part of each "
              "checkpoint there, so put it on a file system every rank shares (an absolute "
              "path)");
}

Config resolve_recipe(const Config& requested) {
  if (requested.recipe != "auto") return requested;
  const int64_t device_bytes = planning_capacity(requested);
  const Device device = training_device(requested);
  ST_CHECK_AS(ConfigError, device_bytes > 0,
              "recipe: auto needs a device capacity to plan against: set train.device_memory "
              "(e.g. 24GiB); the ",
              device.str(), " device has no fixed size");
  std::string why;
  Config chosen = apply_recipe(requested, device_bytes, dist::job_world_size(), &why);
  if (dist::job_rank() == 0) std::fprintf(stderr, "%s\n", why.c_str());
  return chosen;
}

TrainSummary train_with(const Config& config);

}  // namespace

TrainSummary run_training(const Config& given) {
  // With model.from_hf the model keys take config.json's values: the run's config.yaml and its
  // checkpoints then say which model trained.
  Config requested = given;
  resolve_model_from_hf(requested.model);
  // recipe: auto walks the scale-up recipe and trains the first configuration that fits.
  const Config config = resolve_recipe(requested);
  try {
    return train_with(config);
  } catch (const HostOutOfMemoryError&) {
    throw;  // its message has the host's advice
  } catch (const OutOfMemoryError& e) {
    // The allocator says what did not fit; the planner adds which configuration would.
    const int64_t capacity = planning_capacity(config);
    // recipe: auto already took the first step predicted to fit: this is the model's error
    // (docs/recipe.md), and pointing at that same step again would help no one.
    const std::string advice =
        requested.recipe == "auto"
            ? "recipe: auto chose this configuration because the memory model predicted it fits " +
                  format_bytes(capacity) +
                  ", but the run needed more (the prediction's error is listed in "
                  "docs/recipe.md): leave headroom by setting train.device_memory below the "
                  "device's size (10-15 % less)" +
                  (config.optim.offload == "cpu"  // the recipe's last step
                       ? std::string(", or lower train.micro_batch or train.seq_len (this is the "
                                     "recipe's last step)")
                       : std::string(", or pick a later recipe step yourself with recipe: manual "
                                     "(`shardtrain plan` lists them with their settings)"))
        : capacity > 0 ? out_of_memory_advice(config, capacity, dist::job_world_size())
                       : "";
    // A cap the run config set is the first thing to look at.
    const std::string cap =
        config.train.device_memory_bytes() > 0
            ? "The capacity of " + format_bytes(config.train.device_memory_bytes()) +
                  " a rank is train.device_memory's: raise it, or remove it " +
                  (training_device(config).is_cuda() ? "to use the GPU's whole memory."
                                                     : "(the cpu device then has no cap).")
            : "";
    if (advice.empty() && cap.empty()) throw;
    throw OutOfMemoryError(
        std::string(e.what()) + "\n" + advice + (advice.empty() || cap.empty() ? "" : " ") + cap,
        e.requested_bytes());
  }
}

namespace {

// Writes the trained model in the Hugging Face layout to `dir` (a LoRA model merged).
void export_model(const Config& config, Runtime& rt, const std::string& dir, Progress& progress) {
  const DType dtype = dtype_from_name(config.train.export_dtype);
  constexpr int64_t kMaxShardBytes = int64_t{5} << 30;  // as Hugging Face's save_pretrained
  // A refused export (a weight past fp16's range, a full disk) leaves no empty directory.
  DirectoriesOfThisRun created;
  if (rt.dist().rank() == 0) {
    created.prepare(dir, "train.export (to <train.out_dir>/export)");
    created.take_back_at_end();
  }
  if (config.lora.enabled) {
    io::save_merged_hf_model(rt.model(), dir, dtype, kMaxShardBytes);
  } else if (rt.sharded() == nullptr) {
    io::save_hf_model(rt.model(), dir, kMaxShardBytes, dtype);
  } else {
    // Every rank gathers the weights one unit at a time and rank 0 streams them into the files:
    // no rank ever holds the full model.
    io::save_hf_model(*rt.sharded(), dir, kMaxShardBytes, dtype);
  }
  // A model fine-tuned from released weights keeps their token ids and tokenizer.
  if (!config.model.from_hf.empty() && rt.dist().rank() == 0) {
    const std::vector<std::string> carried =
        io::carry_hf_metadata(config.model.from_hf, dir, config.train.seq_len);
    if (!carried.empty())
      progress.message("carried " + std::to_string(carried.size()) + " field(s) and file(s) of " +
                       config.model.from_hf + " (token ids, tokenizer) into the export");
  }
  progress.message("exported the model to " + dir);
}

TrainSummary train_with(const Config& config) {
  const TrainConfig& t = config.train;
  TrainSummary summary;
  // From here on SIGTERM/SIGUSR1 end the run after the current step, with a checkpoint.
  StopSignalHandlers stop_signals;
  // Under mpirun every rank runs this function on its share of each global batch; rank 0 alone
  // writes files and prints progress.
  const int world = dist::job_world_size();
  const bool leader = dist::job_rank() == 0;
  // Refused on every rank before any creates a directory: a rank refusing later, in the runtime,
  // would take the directories back while another still works in them.
  check_lora_world_size(config, world);
  check_host_memory(config, world);
  // Declared before the locks, so that the locks are released when they clean up; the
  // checkpoint directory's after train.out_dir's, so that it goes first (it may lie inside).
  DirectoriesOfThisRun created_out_dirs, created_checkpoint_dirs;
  // Only rank 0 takes back what the run created and left empty: the ranks share the directories.
  // The other ranks give rank 0 a moment to create them: one that got there first would make
  // rank 0 take them for an earlier run's and leave them behind when the run is refused.
  // One wait for both directories: on storage the ranks do not share they never appear, and the
  // check after start-up (check_checkpoint_dir_shared) says so.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto prepare = [&](DirectoriesOfThisRun& created, const std::string& dir,
                     const std::string& key) {
    if (leader) {
      created.prepare(dir, key);
      return;
    }
    std::error_code ec;
    while (!std::filesystem::exists(dir, ec) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    prepare_output_dir(dir, key);
  };
  // One run at a time in a directory; rank 0 holds the locks for the job. Only a run that holds
  // a directory takes back those it created for it: one refused because another run holds it
  // (two started at once on a new directory) leaves them, and the lock file in them, to that
  // run. A run refused later (a checkpoint.dir that cannot be created) takes them back.
  std::optional<RunLock> out_lock, checkpoint_lock;
  prepare(created_out_dirs, t.out_dir, "train.out_dir");
  if (leader) {
    out_lock.emplace(t.out_dir, "train.out_dir");
    created_out_dirs.take_back_at_end();
  }
  // Every run may save: a stop signal does, whatever checkpoint.every_* say. The checkpoint
  // directory has its own lock, default or not: another run may name it as its checkpoint.dir.
  const std::string checkpoint_dir = config.effective_checkpoint_dir();
  const std::string checkpoint_key = config.checkpoint.dir.empty()
                                         ? "checkpoint.dir (default: under train.out_dir)"
                                         : "checkpoint.dir";
  prepare(created_checkpoint_dirs, checkpoint_dir, checkpoint_key);
  if (leader) {
    // A checkpoint.dir that is train.out_dir itself is locked already: a second flock from this
    // process would refuse the run as "in use".
    std::error_code ec;
    if (!std::filesystem::equivalent(checkpoint_dir, t.out_dir, ec))
      checkpoint_lock.emplace(checkpoint_dir, "checkpoint.dir");
    created_checkpoint_dirs.take_back_at_end();
    for (const RunLock* lock :
         {out_lock ? &*out_lock : nullptr, checkpoint_lock ? &*checkpoint_lock : nullptr})
      if (lock != nullptr && !lock->unlocked_reason().empty())
        std::fprintf(stderr, "%s\n", lock->unlocked_reason().c_str());
  }
  // The adapter and the export are written after the last step: a path that cannot take them
  // fails now, not after the whole run.
  const std::string adapter_dir =
      config.lora.adapter_out.empty() ? t.out_dir + "/adapter" : config.lora.adapter_out;
  const bool exports = t.export_model && (!config.lora.enabled || config.lora.merge_on_export);
  if (config.lora.enabled)
    check_output_dir(adapter_dir, config.lora.adapter_out.empty()
                                      ? "lora.adapter_out (default: <train.out_dir>/adapter)"
                                      : "lora.adapter_out");
  if (exports && leader)  // rank 0 writes the export
    check_output_dir(t.out_dir + "/export", "train.export (to <train.out_dir>/export)");
  // A fresh run in a directory of an earlier run's checkpoints is refused now, before the model
  // is built (or loaded from model.from_hf).
  refuse_fresh_run_over_checkpoints(config);
  // What an earlier run killed mid-write left in the directories this run holds (the run
  // directory, its export and its default adapter directory; checkpoints clean up their own).
  if (leader && out_lock && out_lock->unlocked_reason().empty()) {
    std::vector<std::string> held = {t.out_dir, t.out_dir + "/export"};
    if (config.lora.adapter_out.empty()) held.push_back(adapter_dir);
    const std::string note = remove_leftover_temporaries(held);
    if (!note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  }

  TokenDataset data = load_token_source(config.data.path);
  check_data_fits_model(data, config);
  summary.unigram_entropy_nats = data.unigram_entropy_bits() * std::log(2.0);
  // HDF5 storage allocated but never written (a writer that crashed after an early allocation)
  // reads as zeros that no check can tell from tokens: data that is nearly one token is worth a
  // word before hours of training on it.
  if (leader && data.size() > 0 && summary.unigram_entropy_nats < 0.05)
    std::fprintf(stderr,
                 "warning: data.path '%s' is nearly one token repeated (unigram entropy %.4f "
                 "nats over %lld tokens): a dataset written only in part reads as zeros; check "
                 "how it was written\n",
                 config.data.path.c_str(), summary.unigram_entropy_nats,
                 static_cast<long long>(data.size()));

  if (leader && !data.why_not_mapped().empty())
    std::fprintf(stderr,
                 "note: the tokens of data.path '%s' are read into memory, not mapped: %s\n",
                 config.data.path.c_str(), data.why_not_mapped().c_str());

  SamplerConfig sc;
  sc.seq_len = t.seq_len;
  sc.eval_fraction = config.data.eval_fraction;
  sc.seed = static_cast<uint64_t>(config.data.seed);
  Sampler train_sampler(data, Split::Train, sc);

  // Sequences per optimizer step over all ranks (checked to split evenly over them).
  int64_t global_batch = t.sequences_per_step(world);
  int64_t accumulation = global_batch / (t.micro_batch * world);  // micro-batches per rank
  // A step takes distinct windows of one epoch's order: a step larger than the epoch would train
  // on some windows twice in one step (ranks on the same window), in silence.
  ST_CHECK_AS(ConfigError, global_batch <= train_sampler.num_windows(), "a step takes ",
              global_batch, " sequences (train.micro_batch x micro-batches x ranks), but the ",
              "training split of ", data.source(), " holds only ", train_sampler.num_windows(),
              " windows of train.seq_len + 1 = ", t.seq_len + 1,
              " tokens: some would be trained on twice in one step; use more data, or lower "
              "train.global_batch, train.micro_batch or train.seq_len");

  // Released weights take a while to read (and, for QLoRA, to quantize): minutes for billions
  // of parameters, which would otherwise pass without a word. The size is the bytes of the
  // tensors the directory's checkpoint holds (what loading reads), found as loading finds them.
  const bool loads_weights = !config.model.from_hf.empty();
  const bool tells = leader && t.progress != "none";
  const auto load_start = std::chrono::steady_clock::now();
  if (loads_weights && tells) {
    const SafetensorsCheckpoint weights = SafetensorsCheckpoint::open(config.model.from_hf);
    const bool quantizes = config.lora.enabled && config.lora.quantize_base == "nf4";
    std::fprintf(stderr, "loading the model from %s (%s of safetensors)%s ...\n",
                 config.model.from_hf.c_str(), format_bytes(weights.tensor_bytes()).c_str(),
                 !quantizes                            ? ""
                 : io::holds_bnb_4bit_weights(weights) ? ", its projections already in NF4"
                                                       : ", quantizing the base to NF4");
  }
  // Building a QLoRA base (quantizing, or reading a 4-bit one) is counted in projections once it
  // has taken Progress::kEvalLineAfter, as an evaluation is: redrawn on a terminal, a line every
  // Progress::kEvalLineEvery in a log, and the last count.
  const bool nf4_base = config.lora.enabled && config.lora.quantize_base == "nf4";
  const bool redraw = t.progress == "bar" || (t.progress == "auto" && isatty(STDERR_FILENO) != 0);
  std::optional<std::chrono::steady_clock::time_point> shown;
  Runtime rt(config, [&](int64_t done, int64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (!tells || !nf4_base || now - load_start < Progress::kEvalLineAfter) return;
    if (!redraw && shown && done != total && now - *shown < Progress::kEvalLineEvery) return;
    shown = now;
    std::fprintf(stderr, "%sNF4 base: %lld/%lld projections%s", redraw ? "\r\033[K" : "",
                 static_cast<long long>(done), static_cast<long long>(total),
                 redraw && done != total ? "" : "\n");
    std::fflush(stderr);
  });
  if (loads_weights && tells)
    std::fprintf(
        stderr, "loaded the model in %.1f s\n",
        std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count());
  const int rank = rt.dist().rank();
  check_same_data_on_every_rank(data, config.data.path, rt.dist().world());
  check_checkpoint_dir_shared(checkpoint_dir, checkpoint_key, rt.dist().world());
  ST_CHECK(rt.dist().world_size() == world, "the launcher reported ", world,
           " ranks but MPI started ", rt.dist().world_size());
  optim::LrSchedule schedule = lr_schedule(config);

  // A fixed held-out set: the first eval_batches windows of the eval split, in stream order.
  std::vector<Batch> eval_set;
  if (t.eval_every > 0) {
    SamplerConfig ec = sc;
    ec.shuffle = false;
    Sampler eval_sampler(data, Split::Eval, ec);
    // More than the split holds would count some windows twice: a wrong figure, not a bigger
    // sample.
    const int64_t windows = eval_sampler.num_windows();
    if (t.eval_batches * t.micro_batch > windows) {
      const std::string fix = windows >= t.micro_batch
                                  ? "lower train.eval_batches to " +
                                        std::to_string(windows / t.micro_batch) +
                                        " or less, or raise data.eval_fraction"
                                  : "raise data.eval_fraction, or lower train.micro_batch";
      throw ConfigError(
          "train.eval_batches x train.micro_batch = " + std::to_string(t.eval_batches) + " x " +
          std::to_string(t.micro_batch) + " = " + std::to_string(t.eval_batches * t.micro_batch) +
          " held-out sequences, but the evaluation split of " + data.source() +
          " (data.eval_fraction " + (std::ostringstream() << config.data.eval_fraction).str() +
          ") holds " + std::to_string(windows) + " of train.seq_len " + std::to_string(t.seq_len) +
          ": " + fix);
    }
    for (int64_t i = 0; i < t.eval_batches; ++i)
      eval_set.push_back(eval_sampler.next_batch(t.micro_batch));
  }

  summary.metrics_path = t.out_dir + "/metrics.jsonl";
  std::ofstream metrics;
  metrics.precision(17);
  Progress progress(leader ? t.progress : "silent", t.steps, "train");
  // Sharded parameter slots are empty outside a forward: count from the configuration. A LoRA
  // model's frozen base is partly stored as NF4 codes, not parameters: count it from the
  // configuration too, plus the adapters, which are all that trains.
  int64_t num_parameters =
      rt.sharded() ? rt.model().config().num_parameters() : rt.model().num_parameters();
  std::string trainable;
  if (config.lora.enabled) {
    int64_t adapters = 0;
    for (auto& [name, lora] : nn::lora_modules(rt.model()))
      adapters += lora->lora_A.numel() + lora->lora_B.numel();
    num_parameters = rt.model().config().num_parameters() + adapters;
    trainable = concat(" (", adapters, " of them trainable: the LoRA adapters)");
  }
  const std::string ranks =
      world > 1 ? std::to_string(world) + " ranks (" + config.dist.sharding + "), " : "";
  // On the CPU the thread count sets the speed (and, with ranks sharing a node, was chosen for
  // them when OMP_NUM_THREADS is unset): say it.
  const int threads = rt.device().is_cpu() ? cpu_thread_count() : 0;
  const std::string device_text =
      rt.device().str() + (threads > 0
                               ? concat(" (", threads, threads == 1 ? " thread" : " threads",
                                        world > 1 ? " a rank)" : ")")
                               : "");
  progress.message("shardtrain: " + std::to_string(num_parameters) + " parameters on " + ranks +
                   device_text + trainable + ", " + std::to_string(global_batch) + " x " +
                   std::to_string(t.seq_len) + " tokens per step (" + std::to_string(accumulation) +
                   (accumulation == 1 ? " micro-batch" : " micro-batches") +
                   (world > 1 ? " a rank), data " : "), data ") + data.source() + " (" +
                   std::to_string(data.size()) +
                   (data.memory_mapped() ? " tokens, memory-mapped)" : " tokens, in memory)"));
  // The fused attention's CUDA-core kernels made an fp32 llama-125m step take 1.5 s on an H100
  // where bf16 on tensor cores takes 53 ms (docs/benchmarks.md): worth a word at the start.
  const int64_t head_dim = rt.model().config().head_dim();
  const bool fused_on_gpu = rt.device().is_cuda() && config.activation.attention == "fused";
  const DType compute_dtype = dtype_from_name(config.precision.compute);
  bool tensor_core_attention = false;
  int64_t block_smem_kib = 0;  // the most shared memory a block may take on this GPU
#ifdef SHARDTRAIN_HAVE_CUDA
  if (fused_on_gpu) {
    tensor_core_attention =
        cuda::attention_uses_tensor_cores(rt.device().index, compute_dtype, head_dim);
    block_smem_kib = cuda::shared_memory_per_block_optin(rt.device().index) / 1024;
  }
#endif
  if (fused_on_gpu && !tensor_core_attention) {
    if (cuda_attention_uses_tensor_cores(compute_dtype, head_dim))  // the GPU's blocks are small
      progress.message(
          concat("note: activation.attention=fused at head dim ", head_dim,
                 " runs on the exact CUDA-core attention kernels on this GPU, far slower than the "
                 "tensor-core ones, whose tiles need more shared memory than its blocks may take (",
                 block_smem_kib, " KiB); an A100 or H100 runs them"));
    else
      progress.message("note: activation.attention=fused with precision.compute=" +
                       config.precision.compute + " and head dim " + std::to_string(head_dim) +
                       " runs on the exact CUDA-core attention kernels, far slower than the "
                       "tensor-core ones (bf16 or fp16, head dim 64 or 128)");
  }
  // The one-pass backward changes what a run promises (bit-reproducible gradients), and it
  // exists only for the tensor-core kernels: say which of the two this run gets.
  if (config.activation.attention_backward == "atomic_dq") {
    if (tensor_core_attention)
      progress.message(
          "note: activation.attention_backward=atomic_dq: the attention's dQ is summed with "
          "atomics, so gradients (and a resumed run's losses) are not bit-reproducible");
    else
      progress.message(
          "note: activation.attention_backward=atomic_dq takes effect only with "
          "activation.attention=fused on a CUDA device in bf16 or fp16 with head dim 64 or 128; "
          "this run's attention backward is the deterministic one");
  }

  Checkpointing checkpoints(config, rt,
                            [&progress](const std::string& line) { progress.message(line); });
  int64_t first_step = 0;
  if (std::optional<ResumePoint> resumed = checkpoints.resume()) {
    first_step = resumed->step;
    ST_CHECK_AS(ConfigError, first_step <= t.steps, "train.resume: the checkpoint is at step ",
                first_step, ", past train.steps (", t.steps,
                "): raise train.steps to train further, or start a new run (train.resume=none)");
    SamplerState at = resumed->sampler;
    // Other data, seq_len or evaluation split give this run another number of windows: a
    // position past them has no window to continue at, so the next epoch begins.
    if (at.position >= train_sampler.num_windows()) {
      progress.message(concat("note: the checkpoint's run had taken ", at.position,
                              " windows of epoch ", at.epoch, ", more than the ",
                              train_sampler.num_windows(),
                              " training windows of this run's data (data.path, train.seq_len or "
                              "data.eval_fraction changed): continuing at the start of epoch ",
                              at.epoch + 1));
      at.epoch += 1;
      at.position = 0;
    }
    train_sampler.restore(at);
    // The sampler continues the checkpoint's order over the tokens it finds: say so when they
    // are not those the checkpoint's run read (only the data can tell; resume_notes has the
    // config's changes, data.seed among them).
    if (resumed->sampler.data_checksum != 0 && resumed->sampler.data_checksum != data.checksum())
      progress.message(concat("note: the tokens in data.path '", config.data.path,
                              "' differ from those the checkpoint's run trained on; the steps "
                              "from here on read the new tokens, continuing at epoch ",
                              at.epoch, ", window ", at.position));
  }
  summary.first_step = first_step;
  // Written once the run is sure to go ahead, whole or not at all (a temporary file renamed over
  // it): a refused or failed run keeps the earlier run's record.
  if (leader)
    write_file_atomically(t.out_dir + "/config.yaml", config.to_yaml(),
                          "the run's resolved config must be kept with its results; free space "
                          "(or raise the file-size limit), or choose another train.out_dir");
  if (first_step == t.steps && first_step > 0)
    progress.message("the checkpoint is at step " + std::to_string(first_step) +
                     " = train.steps: nothing left to train");
  // An evaluation is due after the last step and every eval_every steps. A resumed run repeats
  // the one due at its first step: a stop may have abandoned it, and the weights are the same, so
  // the figure is too. Then the final evaluation and the export happen even when no step is left.
  auto eval_due = [&](int64_t step) {
    return !eval_set.empty() && (step == t.steps || (t.eval_every > 0 && step % t.eval_every == 0));
  };
  const bool reevaluates_first_step = first_step > 0 && eval_due(first_step);
  if (leader) open_metrics(metrics, summary.metrics_path, first_step, reevaluates_first_step);
  // One event a line, flushed at once: a run killed later keeps every step up to its last
  // checkpoint. A line that cannot be written (a full disk) ends the run: training on without
  // its record would lose what it is for.
  auto record = [&](const nlohmann::json& event) {
    if (!leader) return;
    metrics << event.dump() << "\n" << std::flush;
    ST_CHECK(metrics.good(), "cannot write ", summary.metrics_path, " (", std::strerror(errno),
             "); free space or choose another train.out_dir, then continue with "
             "train.resume=auto");
  };

  // False when a stop request (a signal, on any rank) cut the evaluation short: the caller
  // saves and stops instead of waiting for the rest of the held-out set.
  double total_tokens = 0, total_seconds = 0, window_tokens = 0, window_seconds = 0;
  auto run_eval = [&](int64_t step) {
    std::optional<double> evaluated = rt.eval_loss(
        eval_set, [] { return stop_signal() != 0; },
        [&](int64_t done, int64_t total) { progress.evaluating(step, done, total); });
    if (!evaluated) {
      progress.message("the evaluation at step " + std::to_string(step) +
                       " was abandoned: a stop was requested");
      return false;
    }
    const double loss = *evaluated;
    summary.final_eval_loss = loss;
    summary.final_eval_step = step;
    record(nlohmann::json{{"event", "eval"}, {"step", step}, {"eval_loss", loss}});
    progress.message(fmt::format("eval step {}: loss {:.4f} (unigram entropy {:.4f} nats)", step,
                                 loss, summary.unigram_entropy_nats));
    return true;
  };
  auto stopped_after = [&](int64_t step) {
    progress.finish();
    summary.steps = step;
    summary.stopped_early = true;
    summary.last_checkpoint = checkpoints.last_saved();
    summary.last_checkpoint_step = checkpoints.last_saved_step();
    summary.tokens_per_second = total_seconds > 0 ? total_tokens / total_seconds : 0;
    return summary;
  };

  if (reevaluates_first_step && !run_eval(first_step) &&
      checkpoints.stop_if_requested(first_step, train_sampler.state(), schedule.at(first_step - 1)))
    return stopped_after(first_step);

  constexpr int kMaxNonFiniteLosses = 3;
  int non_finite_losses = 0;
  progress.start_at(first_step);
  for (int64_t step = first_step; step < t.steps; ++step) {
    // This rank's share of the global batch: rows [rank * per_rank, (rank + 1) * per_rank).
    const int64_t per_rank = accumulation * t.micro_batch;
    std::vector<Batch> micro = split_batch(
        train_sampler.next_batch_rows(global_batch, rank * per_rank, per_rank), accumulation);
    // The batch just read came from the file's pages: stop before training on tokens that a
    // write over the file may have changed (a stat(2) a step).
    if (const std::string change = data.changed_on_disk(); !change.empty())
      throw Error(concat(
          "data.path '", config.data.path, "' ", change,
          " while this run reads it (memory-mapped): the tokens under the run changed. Put the "
          "file back and continue from the last checkpoint with train.resume=auto; to train on "
          "new data, write a new file and rename it onto the path (as prepare-data does), which "
          "a running job does not see"));
    auto start = std::chrono::steady_clock::now();
    StepResult r = rt.train_step(micro, schedule.at(step));
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double tokens = static_cast<double>(global_batch * t.seq_len);
    total_tokens += tokens;
    total_seconds += seconds;
    if (step == first_step) summary.first_loss = r.loss;
    summary.final_loss = r.loss;
    summary.skipped_steps += r.skipped ? 1 : 0;
    ST_CHECK(std::isfinite(r.loss) || r.skipped, "the loss became ", r.loss, " at step ", step + 1,
             ": lower optim.lr, enable optim.grad_clip, or use fp32/bf16 instead of fp16");
    nlohmann::json j = {{"event", "step"},
                        {"step", step + 1},
                        {"loss", r.loss},
                        {"lr", r.lr},
                        {"grad_norm", r.grad_norm},
                        {"tokens", r.tokens},
                        {"tokens_per_s", tokens / seconds},
                        {"step_ms", seconds * 1e3},
                        {"loss_scale", r.loss_scale},
                        {"skipped", r.skipped},
                        {"forward_reruns", r.forward_reruns},
                        {"bytes_offloaded", r.bytes_offloaded},
                        {"bytes_restored", r.bytes_restored},
                        {"recompute_s", r.recompute_seconds},
                        {"transfer_s", r.transfer_seconds},
                        {"copy_s", r.copy_seconds},
                        {"device_memory", memory_json(r.device_memory)},
                        {"host_memory", memory_json(r.host_memory)}};
    record(j);
    // Loss scaling skips a step whose gradients overflowed, and a lower scale fixes those; a loss
    // that is itself inf or nan comes from the forward (fp16's range, or damaged weights), which
    // no scale fixes: a step or two may be an outlier batch, a run of them is a run going nowhere.
    non_finite_losses = std::isfinite(r.loss) ? 0 : non_finite_losses + 1;
    ST_CHECK(non_finite_losses < kMaxNonFiniteLosses, "the loss was ", r.loss, " for ",
             non_finite_losses, " steps in a row (the last at step ", step + 1,
             "): the forward pass itself overflows or the weights hold inf or nan, which loss "
             "scaling cannot fix (every such step was skipped); use precision.compute=bf16, "
             "lower optim.lr, or check the initial weights (model.init_std, model.from_hf)");
    // tokens/s over the steps since the last line (with log_every > 1, one step's rate would
    // stand for the window's).
    window_tokens += tokens;
    window_seconds += seconds;
    if ((step + 1) % std::max<int64_t>(t.log_every, 1) == 0 || step + 1 == t.steps) {
      progress.update(step + 1, fmt::format("loss {:.4f} lr {:.2e} | {} tok/s | peak {}", r.loss,
                                            r.lr, format_rate(window_tokens / window_seconds),
                                            format_bytes(r.device_memory.total_peak)));
      window_tokens = window_seconds = 0;
    }
    if (eval_due(step + 1)) run_eval(step + 1);
    // A stop request: the checkpoint is written; skip the final evaluation and export.
    if (checkpoints.after_step(step + 1, train_sampler.state(), r.lr))
      return stopped_after(step + 1);
  }
  // A stop during the final evaluation saved the last step and stopped above; the resumed run
  // has no step left and goes straight to that evaluation and the export.
  progress.finish();
  summary.last_checkpoint = checkpoints.last_saved();
  summary.last_checkpoint_step = checkpoints.last_saved_step();
  summary.steps = t.steps;
  summary.tokens_per_second = total_seconds > 0 ? total_tokens / total_seconds : 0;
  if (config.lora.enabled) {  // one rank: the runtime refuses to shard a LoRA model
    const std::string base =
        config.lora.base_model.empty() ? config.model.from_hf : config.lora.base_model;
    io::save_peft_adapter(rt.model(), adapter_dir, base);
    progress.message("saved the LoRA adapter (PEFT layout) to " + adapter_dir);
    if (base.empty())
      progress.message(
          "note: the adapter's base is a model initialised from train.seed (no lora.base_model), "
          "so its base_model_name_or_path is empty: it applies only to that same model");
    if (t.export_model && !config.lora.merge_on_export)
      progress.message(
          "note: a LoRA run's export is its adapter; set lora.merge_on_export=true to also "
          "write the merged model to " +
          t.out_dir + "/export");
  }
  if (!exports) return summary;
  summary.export_dir = t.out_dir + "/export";
  try {
    export_model(config, rt, summary.export_dir, progress);
  } catch (const std::exception& e) {
    // The trained weights are safe only in a checkpoint of the last step (and a LoRA run's
    // adapters in the adapter saved before the export): say where they are.
    const bool kept = !summary.last_checkpoint.empty() && checkpoints.last_saved_step() == t.steps;
    const std::string where =
        kept ? "\nThe trained weights are in " + summary.last_checkpoint +
                   ": fix the cause and run again with train.resume=" + summary.last_checkpoint +
                   ", which exports without training again"
        : config.lora.enabled
            ? "\nThe trained adapter was saved to " + adapter_dir +
                  " before the export; the merged model can be written again from it"
            : "\nThe run saved no checkpoint of its last step (checkpoint.every_steps is 0), so "
              "its trained weights are lost: set checkpoint.every_steps or "
              "checkpoint.every_minutes to keep them";
    throw Error(std::string(e.what()) + where);
  }
  return summary;
}

}  // namespace

}  // namespace shardtrain::train
