// Exporting a sharded model in the Hugging Face layout: the files are byte for byte those of the
// full model's export (single file and several shards with the index), the writing rank holds one
// gathered unit and nothing more (to the byte, on the memory ledgers), the other ranks write
// nothing, and a failure while writing publishes nothing. One process plays a rank of a larger
// world through a process group whose gathers hand back the full unit.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>

#include "expect_error.h"
#include "files.h"
#include "pretend_rank.h"
#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/train/config.h"
#include "shardtrain/train/trainer.h"
#include "temp_dir.h"
#include "tiny_run.h"
#include "uneven_llama.h"

namespace shardtrain::fsdp {
namespace {

namespace fs = std::filesystem;
using shardtrain::testing::expect_error;
using shardtrain::testing::expect_same_files;
using shardtrain::testing::files_in;
using shardtrain::testing::read_file_bytes;
using shardtrain::testing::TempDir;

constexpr uint64_t kSeed = 41;

// Sizes that do not split evenly over 3 or 4 ranks (padding), with parameters from 12 to 444
// elements, so that a few kilobytes per shard file give several files.
nn::LlamaConfig small_config(bool tied) {
  return shardtrain::testing::uneven_llama_config(3, tied);
}

// The reference: the full model, initialised the usual way, exported the usual way.
void export_full_model(const nn::LlamaConfig& config, const std::string& dir,
                       int64_t max_shard_bytes, DType dtype = DType::F32) {
  nn::LlamaModel full(config, Device::cpu());
  full.init_weights(kSeed);
  io::save_hf_model(full, dir, max_shard_bytes, dtype);
}

// Rank `rank` of a world of `size` whose all-gathers return the whole unit, as a real job's
// would: the other ranks' blocks come from the full initialisation (`units`, the padded flat
// parameter of each unit), and this rank's block is checked against it bit for bit.
class GatheringRank : public shardtrain::testing::PretendRank {
 public:
  using PretendRank::PretendRank;
  dist::WorkPtr all_gather(const Tensor& input, Tensor& output) override {
    check_all_gather(input, output);
    const float* mine = input.data<float>();
    for (const std::vector<float>& flat : units) {
      if (static_cast<int64_t>(flat.size()) != output.numel()) continue;
      if (std::memcmp(mine, flat.data() + rank() * input.numel(), input.nbytes()) != 0) continue;
      std::memcpy(output.data_ptr(), flat.data(), output.nbytes());
      ++gathers;
      return dist::completed_work();
    }
    ADD_FAILURE() << "all_gather of " << input.describe() << ": no unit has this rank's block";
    return dist::completed_work();
  }

  std::vector<std::vector<float>> units;
  int gathers = 0;
};

// The padded flat parameter of every unit of `sharded`, from the full initialisation.
std::vector<std::vector<float>> full_units(const ShardedModel& sharded,
                                           const nn::LlamaConfig& config) {
  nn::LlamaModel full(config, Device::cpu());
  full.init_weights(kSeed);
  std::map<std::string, std::vector<float>> values;
  for (auto& [name, slot] : full.named_parameters()) values[name] = slot->to_float_vector();
  std::vector<std::vector<float>> units;
  for (int u = 0; u < sharded.num_units(); ++u) {
    const FlatParamLayout& layout = sharded.unit_layout(u);
    std::vector<float> flat(static_cast<size_t>(layout.padded), 0.0f);
    for (const auto& e : layout.entries)
      std::copy(values.at(e.name).begin(), values.at(e.name).end(),
                flat.begin() + static_cast<std::ptrdiff_t>(e.offset));
    units.push_back(std::move(flat));
  }
  return units;
}

int64_t rounded(int64_t bytes) {
  return (bytes + 63) / 64 * 64;
}  // the allocators' granularity

// A single file, and shard files of at most 2 KB (a layer's 1284 elements are 5 KB) with the
// index: the sharded export is the full model's, byte for byte, in every export dtype.
TEST(ShardedExport, OneRankEqualsTheFullModelsExportByteForByte) {
  for (const bool tied : {false, true}) {
    const nn::LlamaConfig config = small_config(tied);
    for (const auto& [max_shard_bytes, dtype] :
         {std::pair{int64_t{2000}, DType::F32}, std::pair{int64_t{5} << 30, DType::F32},
          std::pair{int64_t{1000}, DType::BF16}, std::pair{int64_t{5} << 30, DType::F16}}) {
      const std::string tag = std::string(tied ? "tied" : "untied") + ", " +
                              std::string(dtype_name(dtype)) + ", shards of at most " +
                              std::to_string(max_shard_bytes) + " bytes";
      TempDir tmp("export");
      export_full_model(config, tmp / "full", max_shard_bytes, dtype);

      dist::LocalProcessGroup group;
      nn::LlamaModel model(config, Device::cpu(), nn::ParameterStorage::Deferred);
      ShardedModel sharded(model, group, nullptr, {}, seeded_init(model, kSeed));
      io::save_hf_model(sharded, tmp / "sharded", max_shard_bytes, dtype);

      expect_same_files(tmp / "sharded", tmp / "full", tag);
      const std::vector<std::string> files = files_in(tmp / "sharded");
      if (max_shard_bytes < 5000) {
        EXPECT_GE(files.size(), 10u) << tag << ": meant to produce several shard files";
        EXPECT_TRUE(fs::exists(tmp / "sharded/model.safetensors.index.json")) << tag;
      } else {
        EXPECT_EQ(files, (std::vector<std::string>{"config.json", "model.safetensors"})) << tag;
      }
    }
  }
}

// Rank 0 of 4, every gather returning the whole unit: the same bytes, and the export's peak
// memory is exactly one gathered unit (the largest), far below the full model.
TEST(ShardedExport, RankZeroOfFourHoldsOneGatheredUnitAtATime) {
  const nn::LlamaConfig config = small_config(false);
  TempDir tmp("export");
  export_full_model(config, tmp / "full", 2000);

  GatheringRank group(0, 4);
  nn::LlamaModel model(config, Device::cpu(), nn::ParameterStorage::Deferred);
  ShardedModel sharded(model, group, nullptr, {}, seeded_init(model, kSeed));
  group.units = full_units(sharded, config);
  int64_t largest_unit = 0, full_model = 0;
  for (int u = 0; u < sharded.num_units(); ++u) {
    largest_unit = std::max(largest_unit, rounded(sharded.unit_layout(u).padded * 4));
    full_model += sharded.unit_layout(u).total * 4;
  }

  Allocator& cpu = allocator_for(Device::cpu());
  Allocator& host = allocator_for(Device::host());
  cpu.reset_peak();
  host.reset_peak();
  const int64_t cpu_before = cpu.stats().total_in_use, host_before = host.stats().total_in_use;
  io::save_hf_model(sharded, tmp / "sharded", 2000);
  const int64_t cpu_peak = cpu.stats().total_peak - cpu_before;
  const int64_t host_peak = host.stats().total_peak - host_before;

  EXPECT_EQ(group.gathers, sharded.num_units());
  expect_same_files(tmp / "sharded", tmp / "full", "rank 0 of 4");
  EXPECT_EQ(cpu_peak, largest_unit) << "the export must hold one gathered unit, nothing more";
  EXPECT_EQ(host_peak, 0) << "a model on the CPU device needs no host staging";
  EXPECT_LT(2 * largest_unit, full_model) << "the case must tell one unit from the whole model";
  EXPECT_EQ(cpu.stats().total_in_use, cpu_before) << "the gathered units must be released";
}

// Only rank 0 writes: another rank joins the gathers and leaves no file, not even the directory.
TEST(ShardedExport, OtherRanksWriteNothing) {
  const nn::LlamaConfig config = small_config(false);
  TempDir tmp("export");
  GatheringRank group(2, 4);
  nn::LlamaModel model(config, Device::cpu(), nn::ParameterStorage::Deferred);
  ShardedModel sharded(model, group, nullptr, {}, seeded_init(model, kSeed));
  group.units = full_units(sharded, config);
  io::save_hf_model(sharded, tmp / "sharded", 2000);
  EXPECT_EQ(group.gathers, sharded.num_units()) << "rank 2 must take part in every gather";
  EXPECT_FALSE(fs::exists(tmp / "sharded"));
}

// Writing fails part-way (the process may write no file larger than 3000 bytes, so the first
// shard file over it fails after others were written): an error naming the export, and nothing
// published, no temporary file left behind, an earlier export in the directory left intact.
TEST(ShardedExport, AFailedWritePublishesNothing) {
  const nn::LlamaConfig config = small_config(false);
  TempDir tmp("export");
  const std::string dir = tmp / "sharded";
  dist::LocalProcessGroup group;
  nn::LlamaModel model(config, Device::cpu(), nn::ParameterStorage::Deferred);
  ShardedModel sharded(model, group, nullptr, {}, seeded_init(model, kSeed));
  io::save_hf_model(sharded, dir, int64_t{5} << 30);  // an earlier export, one file
  const std::string earlier = read_file_bytes(dir + "/model.safetensors");

  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* previous_handler = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of a signal
  struct rlimit limited = saved;
  limited.rlim_cur = 3000;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  std::string message;
  try {
    io::save_hf_model(sharded, dir, 4500);
  } catch (const Error& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous_handler);

  EXPECT_NE(message.find(dir), std::string::npos) << message;
  EXPECT_NE(message.find("failed on the writing rank"), std::string::npos) << message;
  EXPECT_NE(message.find(std::strerror(EFBIG)), std::string::npos) << message;
  EXPECT_EQ(files_in(dir), (std::vector<std::string>{"config.json", "model.safetensors"}));
  EXPECT_TRUE(read_file_bytes(dir + "/model.safetensors") == earlier);

  // An export directory that cannot be created.
  const std::string blocked = tmp.write("a-file", "not a directory") + "/export";
  expect_error<Error>([&] { io::save_hf_model(sharded, blocked, 2000); },
                      {blocked, "failed on the writing rank", "cannot create"});
}

}  // namespace
}  // namespace shardtrain::fsdp

namespace shardtrain::io {
namespace {

namespace fs = std::filesystem;
using shardtrain::testing::read_file_bytes;

// Loading weights with a NaN or an infinity names the tensor at once, instead of a diverged loss
// some steps later.
TEST(HfWeights, NonFiniteValuesNameTheTensor) {
  const nn::LlamaConfig config = shardtrain::testing::uneven_llama_config(3, false);
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    shardtrain::testing::TempDir tmp("nonfinite");
    nn::LlamaModel saved(config, Device::cpu());
    saved.init_weights(5);
    for (auto& [name, slot] : saved.named_parameters())
      if (name == "model.norm.weight") slot->data<float>()[1] = bad;
    save_hf_model(saved, tmp / "model");
    nn::LlamaModel loaded(config, Device::cpu());
    shardtrain::testing::expect_error<FormatError>(
        [&] { load_hf_weights(loaded, tmp / "model"); },
        {"tensor 'model.norm.weight' holds NaN or infinite values"});
  }
  shardtrain::testing::TempDir tmp("finite");
  nn::LlamaModel saved(config, Device::cpu());
  saved.init_weights(5);
  save_hf_model(saved, tmp / "model");
  nn::LlamaModel loaded(config, Device::cpu());
  load_hf_weights(loaded, tmp / "model");  // finite weights load
}

// An export in bf16 or fp16 holds each weight rounded to nearest even, and config.json says which
// dtype it is; a weight past fp16's range (here 1e5, which bf16 holds) is refused by name in an
// fp16 export, and nothing is published, rather than written as infinity.
TEST(HfWeights, AnExportInBf16OrFp16HoldsTheRoundedWeightsAndSaysSo) {
  const nn::LlamaConfig config = shardtrain::testing::uneven_llama_config(3, false);
  nn::LlamaModel saved(config, Device::cpu());
  saved.init_weights(9);
  for (auto& [name, slot] : saved.named_parameters())
    if (name == "model.norm.weight") slot->data<float>()[2] = 1.0e5f;
  struct Case {
    DType dtype;
    const char* torch_dtype;
    float (*rounded)(float);
  };
  for (const Case& c :
       {Case{DType::BF16, "bfloat16", [](float x) { return bf16_to_float(float_to_bf16(x)); }},
        Case{DType::F32, "float32", [](float x) { return x; }}}) {
    shardtrain::testing::TempDir tmp("narrow");
    save_hf_model(saved, tmp / "model", int64_t{5} << 30, c.dtype);
    const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(tmp / "model");
    for (const std::string& name : ckpt.names()) EXPECT_EQ(ckpt.info(name).dtype, c.dtype) << name;
    EXPECT_NE(read_file_bytes(tmp / "model/config.json")
                  .find(std::string("\"torch_dtype\": \"") + c.torch_dtype + "\""),
              std::string::npos);
    nn::LlamaModel loaded(config, Device::cpu());
    load_hf_weights(loaded, tmp / "model");
    auto loaded_params = loaded.named_parameters();
    int64_t changed = 0;
    for (auto& [name, slot] : saved.named_parameters()) {
      const std::vector<float> want = slot->to_float_vector();
      const Tensor* got = nullptr;
      for (auto& [other, other_slot] : loaded_params)
        if (other == name) got = other_slot;
      ASSERT_NE(got, nullptr) << name;
      const std::vector<float> have = got->to_float_vector();
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(have[i], c.rounded(want[i])) << name << "[" << i << "]";
        changed += have[i] != want[i];
      }
    }
    // The bf16 case rounds most weights (else this would not test the conversion).
    if (c.dtype == DType::BF16) {
      EXPECT_GT(changed, 100);
    }
  }

  shardtrain::testing::TempDir tmp("overflow");
  shardtrain::testing::expect_error<ConfigError>(
      [&] { save_hf_model(saved, tmp / "model", int64_t{5} << 30, DType::F16); },
      {"tensor 'model.norm.weight'", "fp16's range (65504)", "train.export_dtype to bf16 or fp32"});
  EXPECT_FALSE(fs::exists(tmp / "model/model.safetensors"));
  EXPECT_FALSE(fs::exists(tmp / "model/config.json"));
  // In range, fp16 holds the rounded weights too.
  for (auto& [name, slot] : saved.named_parameters())
    if (name == "model.norm.weight") slot->data<float>()[2] = 3.0f;
  save_hf_model(saved, tmp / "model", int64_t{5} << 30, DType::F16);
  nn::LlamaModel loaded(config, Device::cpu());
  load_hf_weights(loaded, tmp / "model");
  for (auto& [name, slot] : loaded.named_parameters())
    if (name == "model.layers.0.self_attn.q_proj.weight") {
      nn::LlamaModel again(config, Device::cpu());
      again.init_weights(9);
      for (auto& [other, original] : again.named_parameters())
        if (other == name) {
          const std::vector<float> want = original->to_float_vector(),
                                   have = slot->to_float_vector();
          for (size_t i = 0; i < want.size(); ++i)
            ASSERT_EQ(have[i], f16_to_float(float_to_f16(want[i]))) << name << "[" << i << "]";
        }
    }
}

// A run whose fp16 export is refused (weights past fp16's range) leaves no empty export
// directory; its checkpoint keeps the weights.
TEST(TrainExport, ARefusedFp16ExportLeavesNoExportDirectory) {
  shardtrain::testing::TempDir tmp("refused-export");
  const train::Config config =
      train::Config::parse(shardtrain::testing::kTinyRunYaml,
                           {"train.steps=1", "model.init_std=100000", "train.export_dtype=fp16",
                            "checkpoint.every_steps=1", "train.out_dir=" + (tmp / "run")},
                           "refused export");
  try {
    train::run_training(config);
    ADD_FAILURE() << "an fp16 export of weights past its range went ahead";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("beyond fp16's range (65504)"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("The trained weights are in"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(tmp / "run/export"));
  EXPECT_TRUE(fs::exists(tmp / "run/checkpoints/step-00000001.h5"));
}

}  // namespace
}  // namespace shardtrain::io
