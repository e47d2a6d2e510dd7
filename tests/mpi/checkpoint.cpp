// Checkpoints inside one job of several ranks: ranges written by every rank come back as whole
// tensors (also through arbitrary flat ranges), and 20 steps saved and resumed on the same ranks
// give the 40-step run bit for bit under every sharding strategy. The Hugging Face export of a
// sharded model is byte for byte the unsharded export of the same weights, rank 0 holding one
// gathered unit at a time, and a failure to write it fails every rank instead of leaving them
// waiting.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "shardtrain/dist/env.h"
#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/train/trainer.h"
#include "tiny_llama.h"
#include "tiny_run.h"

using namespace shardtrain;
namespace fs = std::filesystem;

namespace {

// A directory every rank names the same (rank 0's pid), removed by rank 0 at the end.
struct SharedDir {
  dist::ProcessGroup& world;
  fs::path path;
  explicit SharedDir(dist::ProcessGroup& group) : world(group) {
    static int counter = 0;
    int64_t pid = world.all_reduce_host(world.rank() == 0 ? int64_t{::getpid()} : int64_t{0},
                                        dist::ReduceOp::Max);
    path = fs::temp_directory_path() /
           ("shardtrain-mpi-ckpt-" + std::to_string(pid) + "-" + std::to_string(counter++));
    if (world.rank() == 0) {
      fs::remove_all(path);
      fs::create_directories(path);
    }
    world.barrier();
  }
  ~SharedDir() {
    world.barrier();
    std::error_code ec;
    if (world.rank() == 0) fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

float value_of(int tensor, int64_t index) {
  return static_cast<float>(tensor * 1000) + 0.5f * static_cast<float>(index);
}

// `parts` contiguous ranges of [0, n) with uneven boundaries.
std::vector<int64_t> boundaries(int64_t n, int parts) {
  std::vector<int64_t> b(static_cast<size_t>(parts + 1));
  for (int k = 0; k <= parts; ++k) b[static_cast<size_t>(k)] = k * n / parts;
  for (int k = 1; k < parts; ++k)
    b[static_cast<size_t>(k)] =
        std::min(b[static_cast<size_t>(k)] + (k % 2) * 3, b[static_cast<size_t>(k + 1)]);
  return b;
}

TEST(CheckpointAcrossRanks, EveryRanksRangesFormWholeTensors) {
  dist::DistEnv env;
  dist::ProcessGroup& world = env.world();
  SharedDir dir(world);
  const int W = world.size(), rank = world.rank();
  // With more than two ranks the last one is a replica: it writes nothing.
  const int writers = W > 2 ? W - 1 : W;
  const std::vector<std::pair<std::string, Shape>> tensors = {
      {"model/a", {5, 7, 3}}, {"model/b.weight", {10}}, {"optim/exp_avg/c", {4, 6}}};

  io::SaveRequest req;
  req.dir = dir.path.string();
  req.state.step = 5;
  req.state.optimizer = "adamw";
  req.state.sampler = {3, 1, 2};
  req.generators = {{"gen", 100u + static_cast<uint64_t>(rank), 7u * static_cast<uint64_t>(rank)}};
  req.writes_ranges = rank < writers;
  for (size_t t = 0; t < tensors.size() && req.writes_ranges; ++t) {
    std::vector<int64_t> b = boundaries(numel(tensors[t].second), writers);
    const int64_t begin = b[static_cast<size_t>(rank)], end = b[static_cast<size_t>(rank + 1)];
    std::vector<float> values;
    for (int64_t i = begin; i < end; ++i) values.push_back(value_of(static_cast<int>(t), i));
    req.ranges.push_back(
        {tensors[t].first, tensors[t].second, begin, from_floats(values, {end - begin})});
  }
  const std::string path = io::save_checkpoint(world, req);
  EXPECT_EQ(path, dir / "step-00000005.h5");
  EXPECT_EQ(io::verify_checkpoint(world, path), "");
  for (int r = 0; r < W; ++r)
    EXPECT_EQ(fs::exists(dir / io::rank_file_name(5, r)), r < writers) << "rank " << r;

  io::CheckpointReader reader(path);
  EXPECT_EQ(reader.state().world_size, W);
  EXPECT_EQ(reader.state().sampler, (io::SamplerPosition{3, 1, 2}));
  ASSERT_EQ(reader.state().rng.size(), static_cast<size_t>(W));
  for (int r = 0; r < W; ++r)
    EXPECT_EQ(reader.state().rng[static_cast<size_t>(r)],
              (std::vector<io::GeneratorState>{
                  {"gen", 100u + static_cast<uint64_t>(r), 7u * static_cast<uint64_t>(r)}}));
  for (size_t t = 0; t < tensors.size(); ++t) {
    const auto& [name, shape] = tensors[t];
    Tensor full = reader.read(name);
    ASSERT_EQ(full.shape(), shape) << name;
    std::vector<float> got = full.to_float_vector();
    for (int64_t i = 0; i < numel(shape); ++i)
      ASSERT_EQ(got[static_cast<size_t>(i)], value_of(static_cast<int>(t), i)) << name << " " << i;
    // Flat ranges that start and end inside rows and cross the writers' boundaries.
    for (auto [begin, length] : {std::pair<int64_t, int64_t>{1, numel(shape) - 2},
                                 {3, numel(shape) / 2},
                                 {numel(shape) - 1, 1}}) {
      Tensor part = empty({length}, DType::F32, Device::cpu());
      reader.read_range(name, begin, part);
      std::vector<float> p = part.to_float_vector();
      for (int64_t i = 0; i < length; ++i)
        ASSERT_EQ(p[static_cast<size_t>(i)], value_of(static_cast<int>(t), begin + i))
            << name << " [" << begin << ", " << begin + length << ")";
    }
  }
}

// ---- whole runs -------------------------------------------------------------------------------

train::Config tiny_config(const std::string& out_dir, std::vector<std::string> overrides) {
  overrides.push_back("train.out_dir=" + out_dir);
  return train::Config::parse(shardtrain::testing::kTinyRunYaml, overrides, "mpi checkpoint test");
}

using shardtrain::testing::expect_same_files;
using shardtrain::testing::files_in;
using shardtrain::testing::read_file_bytes;
using shardtrain::testing::read_step_losses;

class ResumeOnTheSameRanks : public ::testing::TestWithParam<std::string> {};

TEST_P(ResumeOnTheSameRanks, TwentyPlusTwentyStepsGiveTheFortyStepRunBitwise) {
  dist::DistEnv env;
  SharedDir dir(env.world());
  const int W = env.world().size();
  std::vector<std::string> sharding = {"dist.sharding=" + GetParam()};
  if (GetParam() == "hybrid_shard")  // two pretend nodes
    sharding.push_back("dist.ranks_per_node=" + std::to_string(W / 2));
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), sharding.begin(), sharding.end());
    return extra;
  };
  train::TrainSummary ref = train::run_training(tiny_config(dir / "ref", with({})));
  train::TrainSummary saving = train::run_training(
      tiny_config(dir / "saving", with({"checkpoint.every_steps=20", "checkpoint.keep_last=0"})));
  const std::string at20 = dir / "saving/checkpoints/step-00000020.h5";
  train::TrainSummary resumed =
      train::run_training(tiny_config(dir / "resumed", with({"train.resume=" + at20})));
  if (env.rank() != 0) return;  // rank 0 writes the metrics and the export
  std::map<int64_t, double> ref_losses = read_step_losses(ref.metrics_path);
  ASSERT_EQ(ref_losses.size(), 40u);
  EXPECT_EQ(read_step_losses(saving.metrics_path), ref_losses);
  std::map<int64_t, double> losses = read_step_losses(resumed.metrics_path);
  ASSERT_EQ(losses.size(), 20u);
  for (const auto& [step, loss] : losses) EXPECT_EQ(loss, ref_losses.at(step)) << "step " << step;
  EXPECT_TRUE(read_file_bytes(resumed.export_dir + "/model.safetensors") ==
              read_file_bytes(ref.export_dir + "/model.safetensors"))
      << "the exported weights differ from the uninterrupted run's";
  io::CheckpointReader reader(at20);
  EXPECT_EQ(reader.state().world_size, W);
  EXPECT_EQ(reader.state().sharding, GetParam());
  EXPECT_FALSE(reader.state().layout_json.empty());
}

INSTANTIATE_TEST_SUITE_P(Sharding, ResumeOnTheSameRanks,
                         ::testing::Values("full_shard", "grad_op_shard", "no_shard",
                                           "hybrid_shard"));

// ---- Hugging Face export of a sharded model ---------------------------------------------------

dist::DistOptions dist_options_for(const std::string& sharding, int world_size) {
  dist::DistOptions options;
  options.timeout_s = 120;
  if (sharding == "hybrid_shard") options.ranks_per_node = world_size / 2;  // two pretend nodes
  return options;
}

// A Llama built deferred and sharded with `strategy`, each rank initialising its shard from
// `seed`, as the trainer builds one.
struct SeededShardedLlama {
  SeededShardedLlama(const nn::LlamaConfig& config, dist::DistEnv& env, const std::string& strategy,
                     uint64_t seed)
      : model(config, Device::cpu(), nn::ParameterStorage::Deferred),
        sharded(model, env, options_for(strategy), fsdp::seeded_init(model, seed)) {}
  static fsdp::FsdpOptions options_for(const std::string& strategy) {
    fsdp::FsdpOptions options;
    options.strategy = fsdp::parse_sharding_strategy(strategy);
    return options;
  }
  nn::LlamaModel model;
  fsdp::ShardedModel sharded;
};

class ShardedExport : public ::testing::TestWithParam<std::string> {};

// Deferred shards initialised from a seed hold exactly the full initialisation's values, so the
// export must be the full model's export, file for file. Several shard files and the index.
TEST_P(ShardedExport, EqualsTheUnshardedExportOfTheSameWeightsHoldingOneUnitAtATime) {
  constexpr uint64_t kSeed = 17;
  constexpr int64_t kMaxShardBytes = 40000;  // a layer is 31 KB, the model 140 KB
  dist::DistEnv env(dist_options_for(GetParam(), dist::job_world_size()));
  SharedDir dir(env.world());
  const nn::LlamaConfig config = test::tiny_config(4);
  SeededShardedLlama seeded(config, env, GetParam(), kSeed);
  fsdp::ShardedModel& sharded = seeded.sharded;
  int64_t largest_unit = 0, full_model = 0;
  for (int u = 0; u < sharded.num_units(); ++u) {
    // The gathered flat parameter, rounded to the allocators' 64 bytes.
    largest_unit = std::max(largest_unit, (sharded.unit_layout(u).padded * 4 + 63) / 64 * 64);
    full_model += sharded.unit_layout(u).total * 4;
  }
  ASSERT_LT(2 * largest_unit, full_model) << "the case must tell one unit from the whole model";

  Allocator& cpu = allocator_for(Device::cpu());
  Allocator& host = allocator_for(Device::host());
  cpu.reset_peak();
  host.reset_peak();
  const int64_t cpu_before = cpu.stats().total_in_use, host_before = host.stats().total_in_use;
  io::save_hf_model(sharded, dir / "sharded", kMaxShardBytes);
  // What the export added on top of the shards: CPU-device memory (where the units are gathered)
  // and the host pool (staging, for models on a GPU) together.
  const int64_t export_peak =
      (cpu.stats().total_peak - cpu_before) + (host.stats().total_peak - host_before);
  EXPECT_LE(export_peak, largest_unit)
      << "rank " << env.rank() << " held more than one gathered unit during the export";
  if (sharded.shard_group().size() > 1) {
    EXPECT_EQ(export_peak, largest_unit) << "rank " << env.rank() << ": one gathered unit";
  }
  EXPECT_EQ(cpu.stats().total_in_use, cpu_before) << "the gathered units must be released";

  if (env.rank() == 0) {
    nn::LlamaModel full(config, Device::cpu());
    full.init_weights(kSeed);
    io::save_hf_model(full, dir / "full", kMaxShardBytes);
    expect_same_files(dir / "sharded", dir / "full");
    EXPECT_GE(files_in(dir / "sharded").size(), 6u) << "meant to write several shard files";
    EXPECT_TRUE(fs::exists(dir / "sharded/model.safetensors.index.json"));
  }

  // In bf16 (train.export_dtype) as well: each gathered parameter is converted as it is written.
  io::save_hf_model(sharded, dir / "sharded-bf16", kMaxShardBytes, DType::BF16);
  if (env.rank() == 0) {
    nn::LlamaModel full(config, Device::cpu());
    full.init_weights(kSeed);
    io::save_hf_model(full, dir / "full-bf16", kMaxShardBytes, DType::BF16);
    expect_same_files(dir / "sharded-bf16", dir / "full-bf16");
    EXPECT_GE(files_in(dir / "sharded-bf16").size(), 4u) << "meant to write several shard files";
  }
}

// A trained run: the export the trainer writes from the shards is the export of an unsharded
// model holding the weights of the run's final checkpoint (read from its HDF5 files).
TEST_P(ShardedExport, TrainerExportEqualsTheUnshardedExportOfTheFinalCheckpoint) {
  dist::DistEnv env;
  SharedDir dir(env.world());
  std::vector<std::string> overrides = {"dist.sharding=" + GetParam(), "train.steps=3",
                                        "checkpoint.every_steps=3", "checkpoint.keep_last=0"};
  if (GetParam() == "hybrid_shard")
    overrides.push_back("dist.ranks_per_node=" + std::to_string(env.world_size() / 2));
  const train::Config config = tiny_config(dir / "run", overrides);
  train::TrainSummary run = train::run_training(config);
  if (env.rank() != 0) return;  // rank 0 writes the export
  ASSERT_FALSE(run.export_dir.empty());
  io::CheckpointReader reader(run.last_checkpoint);
  nn::LlamaModel full(nn::LlamaConfig::from_hf_json(run.export_dir + "/config.json"),
                      Device::cpu());
  for (auto& [name, slot] : full.named_parameters()) slot->copy_from(reader.read("model/" + name));
  io::save_hf_model(full, dir / "full");
  expect_same_files(run.export_dir, dir / "full");
}

// The export cannot be written on rank 0: every rank gets an error (none is left waiting in a
// collective for it), rank 0's naming the cause. Then a failure part-way through the writes
// (rank 0 may write no file over 20 KB), after which nothing is published.
TEST_P(ShardedExport, AFailureOnRankZeroFailsEveryRank) {
  dist::DistEnv env(dist_options_for(GetParam(), dist::job_world_size()));
  SharedDir dir(env.world());
  SeededShardedLlama seeded(test::tiny_config(4), env, GetParam(), 3);
  fsdp::ShardedModel& sharded = seeded.sharded;
  const bool rank0 = env.rank() == 0;

  if (rank0) std::ofstream(dir / "blocked") << "a file where the export directory would go";
  env.world().barrier();
  std::string message;
  try {
    io::save_hf_model(sharded, dir / "blocked", 40000);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find(dir / "blocked"), std::string::npos) << message;
  EXPECT_NE(message.find(rank0 ? "cannot create" : "failed on the writing rank (rank 0"),
            std::string::npos)
      << "rank " << env.rank() << ": " << message;

  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* previous_handler = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of a signal
  if (rank0) {
    struct rlimit limited = saved;
    limited.rlim_cur = 20000;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  }
  message.clear();
  try {
    io::save_hf_model(sharded, dir / "export", 40000);
  } catch (const Error& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous_handler);
  EXPECT_NE(message.find(rank0 ? std::strerror(EFBIG) : "failed on the writing rank (rank 0"),
            std::string::npos)
      << "rank " << env.rank() << ": " << message;
  if (rank0) {
    EXPECT_TRUE(files_in(dir / "export").empty()) << "a failed export published files";
  }
}

INSTANTIATE_TEST_SUITE_P(Sharding, ShardedExport,
                         ::testing::Values("full_shard", "grad_op_shard", "no_shard",
                                           "hybrid_shard"));

TEST(CheckpointAcrossRanks, TimedSavesAreDecidedTogether) {
  // Rank 0's clock decides; if the ranks decided alone, their collectives would not match and
  // the job would fail or hang.
  dist::DistEnv env;
  SharedDir dir(env.world());
  train::TrainSummary s = train::run_training(
      tiny_config(dir / "run",
                  {"train.steps=6", "checkpoint.every_minutes=0.00001", "checkpoint.keep_last=0"}));
  EXPECT_EQ(s.steps, 6);
  std::vector<io::CheckpointEntry> saved = io::list_checkpoints(dir / "run/checkpoints");
  // 0.6 ms is due after every step: a save a step (the last step alone is saved anyway), each
  // taken by every rank together.
  ASSERT_EQ(saved.size(), 6u);
  EXPECT_EQ(saved.front().step, 6);
  EXPECT_EQ(saved.back().step, 1);
  EXPECT_EQ(io::verify_checkpoint(env.world(), saved.front().path), "");
}

}  // namespace
