// Building a sharded model without a full copy: deferred parameters, range initialisation, and
// the shards a rank creates from them, checked bit for bit against the full initialisation and
// byte for byte against the memory ledger. One process plays any rank of any world through a
// process group that reports that rank and size.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "pretend_rank.h"
#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/ops/ops.h"
#include "temp_dir.h"
#include "uneven_llama.h"

namespace shardtrain::fsdp {
namespace {

constexpr uint64_t kSeed = 29;

// Rank `rank` of a world of `size`, in one process. Collectives see only this rank's data: a
// gather leaves the other ranks' blocks zero, a reduce-scatter keeps this rank's block. The
// numbers computed with it are not a real job's, but every buffer has its real size.
class SimulatedRank : public shardtrain::testing::PretendRank {
 public:
  using PretendRank::PretendRank;
  dist::WorkPtr all_gather(const Tensor& input, Tensor& output) override {
    check_all_gather(input, output);
    backend_for(output.device()).fill(output, 0.0f);
    output.view({output.numel()})
        .slice_rows(rank() * input.numel(), input.numel())
        .copy_from(input);
    return dist::completed_work();
  }
  dist::WorkPtr reduce_scatter(const Tensor& input, Tensor& output) override {
    check_reduce_scatter(input, output);
    output.copy_from(
        input.view({input.numel()}).slice_rows(rank() * output.numel(), output.numel()));
    return dist::completed_work();
  }
};

// Element counts chosen so that parameters straddle shard boundaries and units do not split
// evenly over 5, 7 or 8 ranks (padding): 1284 elements per layer, 900 in the root (untied).
nn::LlamaConfig small_config(bool tied = false) {
  return shardtrain::testing::uneven_llama_config(2, tied);
}

using Values = std::map<std::string, std::vector<float>>;

Values values_of(nn::LlamaModel& model) {
  Values out;
  for (auto& [name, slot] : model.named_parameters()) out[name] = slot->to_float_vector();
  return out;
}

Values full_init(const nn::LlamaConfig& config, uint64_t seed) {
  nn::LlamaModel model(config, Device::cpu());
  model.init_weights(seed);
  return values_of(model);
}

int64_t rounded(int64_t bytes) {
  return (bytes + 63) / 64 * 64;
}  // the allocators' granularity

int64_t parameter_bytes_in_use() {
  return allocator_for(Device::cpu()).stats().in_use_of(MemoryCategory::Parameters);
}

// Bytes of this rank's shards: what a rank must hold, nothing more.
int64_t shard_bytes(const ShardedModel& sharded) {
  int64_t n = 0;
  for (int u = 0; u < sharded.num_units(); ++u)
    n += rounded(sharded.unit_layout(u).shard_numel * 4);
  return n;
}

// Every optimizer piece of `sharded` against the same elements of `want`, bit for bit. Adds the
// elements each piece covers to `covered` (per parameter, per element).
void expect_pieces_equal(ShardedModel& sharded, const Values& want,
                         std::map<std::string, std::vector<int>>* covered, const std::string& tag) {
  std::vector<optim::NamedParam> params = sharded.optimizer_params();
  std::vector<ParamPiece> pieces = sharded.param_pieces();
  ASSERT_EQ(params.size(), pieces.size());
  for (size_t k = 0; k < pieces.size(); ++k) {
    const ParamPiece& p = pieces[k];
    const std::vector<float>& full = want.at(p.name);
    std::vector<float> got = params[k].param->to_float_vector();
    ASSERT_EQ(static_cast<int64_t>(got.size()), p.length) << tag << " " << p.name;
    for (int64_t i = 0; i < p.length; ++i)
      ASSERT_EQ(float_bits(got[static_cast<size_t>(i)]),
                float_bits(full[static_cast<size_t>(p.begin + i)]))
          << tag << " " << p.name << "[" << p.begin + i << "]";
    if (covered != nullptr) {
      std::vector<int>& c = (*covered)[p.name];
      c.resize(full.size());
      for (int64_t i = 0; i < p.length; ++i) ++c[static_cast<size_t>(p.begin + i)];
    }
  }
}

// ---- the model's initialisation ------------------------------------------------------------

// The initialisation as one generator stream walked over the parameters in order (what
// init_weights has always done): the range-based version must reproduce it exactly, or every
// recorded loss curve and golden file would change.
TEST(LlamaInit, InitWeightsIsTheSequentialGeneratorStream) {
  for (bool tied : {false, true}) {
    nn::LlamaConfig config = small_config(tied);
    nn::LlamaModel reference(config, Device::cpu());
    Generator gen(kSeed);
    Values want;
    for (auto& [name, slot] : reference.named_parameters()) {
      bool is_norm = name.find("norm") != std::string::npos;
      want[name] = is_norm ? std::vector<float>(static_cast<size_t>(slot->numel()), 1.0f)
                           : randn(slot->shape(), gen, config.init_std).to_float_vector();
    }
    Values got = full_init(config, kSeed);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, values] : want) {
      ASSERT_EQ(got.at(name).size(), values.size()) << name;
      for (size_t i = 0; i < values.size(); ++i)
        ASSERT_EQ(float_bits(got.at(name)[i]), float_bits(values[i])) << name << "[" << i << "]";
    }
    EXPECT_NE(got.at("model.layers.1.mlp.down_proj.weight"),
              full_init(config, kSeed + 1).at("model.layers.1.mlp.down_proj.weight"));
  }
}

TEST(LlamaInit, AnyRangeOfAnyParameterEqualsTheFullInit) {
  nn::LlamaConfig config = small_config();
  Values full = full_init(config, kSeed);
  nn::LlamaModel model(config, Device::cpu(), nn::ParameterStorage::Deferred);
  for (const auto& [name, values] : full) {
    const int64_t n = static_cast<int64_t>(values.size());
    for (auto [begin, length] : std::vector<std::pair<int64_t, int64_t>>{
             {0, n}, {0, 1}, {n - 1, 1}, {n / 3, n / 2}, {7, n - 7}, {n / 2, 0}}) {
      std::vector<float> out(static_cast<size_t>(length) + 1, -7.0f);
      model.init_parameter_range(kSeed, name, begin, length, out.data());
      for (int64_t i = 0; i < length; ++i)
        ASSERT_EQ(float_bits(out[static_cast<size_t>(i)]),
                  float_bits(values[static_cast<size_t>(begin + i)]))
            << name << "[" << begin + i << "] from a range starting at " << begin;
      EXPECT_EQ(out.back(), -7.0f) << "wrote past the range of " << name;
    }
  }
  float out[4];
  EXPECT_THROW(
      model.init_parameter_range(kSeed, "model.layers.0.mlp.gate_proj.lora_A.weight", 0, 1, out),
      ConfigError);
  EXPECT_THROW(model.init_parameter_range(kSeed, "model.norm.weight", 14, 3, out), ShapeError);
  EXPECT_THROW(model.init_parameter_range(kSeed, "model.norm.weight", -1, 1, out), ShapeError);
}

TEST(DeferredModel, HasShapesButNoStorageUntilInitialised) {
  nn::LlamaConfig config = small_config();
  const int64_t before = parameter_bytes_in_use();
  nn::LlamaModel allocated(config, Device::cpu());
  const int64_t full_bytes = parameter_bytes_in_use() - before;
  int64_t expected_full = 0;
  for (auto& [name, slot] : allocated.named_parameters()) expected_full += rounded(slot->nbytes());
  EXPECT_EQ(full_bytes, expected_full);

  nn::LlamaModel model(config, Device::cpu(), nn::ParameterStorage::Deferred);
  EXPECT_EQ(parameter_bytes_in_use() - before, full_bytes) << "a deferred model allocates nothing";
  EXPECT_TRUE(model.has_deferred_parameters());
  auto want = allocated.named_parameters();
  auto got = model.named_parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_EQ(got[i].second->shape(), want[i].second->shape()) << got[i].first;
    EXPECT_TRUE(nn::is_deferred(*got[i].second)) << got[i].first;
    EXPECT_TRUE(autograd::requires_grad(*got[i].second)) << got[i].first;
  }
  EXPECT_EQ(model.num_parameters(), config.num_parameters());
  Tensor ids = from_ints({1, 2, 3, 4}, {1, 4});
  EXPECT_THROW(model.forward(ids), Error) << "running a model without weights";

  model.init_weights(kSeed);
  EXPECT_FALSE(model.has_deferred_parameters());
  EXPECT_EQ(parameter_bytes_in_use() - before, 2 * full_bytes);
  allocated.init_weights(kSeed);
  EXPECT_EQ(values_of(model), values_of(allocated));
  EXPECT_EQ(model.forward(ids).to_float_vector(), allocated.forward(ids).to_float_vector());
}

// ---- shards created from a deferred model ---------------------------------------------------

// Every rank of every world size, ragged and padded: the shard a rank creates is exactly its
// slice of the full initialisation, and the ranks together cover every element once.
TEST(ShardedInit, EveryRanksShardIsItsSliceOfTheFullInitBitForBit) {
  for (bool tied : {false, true}) {
    nn::LlamaConfig config = small_config(tied);
    const Values full = full_init(config, kSeed);
    for (int world : {1, 2, 3, 4, 5, 7, 8}) {
      bool padded = false;
      std::map<std::string, std::vector<int>> covered;
      for (int rank = 0; rank < world; ++rank) {
        const std::string tag =
            "rank " + std::to_string(rank) + " of " + std::to_string(world) + (tied ? " tied" : "");
        SimulatedRank group(rank, world);
        nn::LlamaModel model(config, Device::cpu(), nn::ParameterStorage::Deferred);
        ShardedModel sharded(model, group, nullptr, {}, seeded_init(model, kSeed));
        for (auto& [name, slot] : model.named_parameters())
          EXPECT_FALSE(slot->defined()) << tag << ": " << name << " kept its deferred tensor";
        expect_pieces_equal(sharded, full, &covered, tag);
        for (int u = 0; u < sharded.num_units(); ++u)
          padded |= sharded.unit_layout(u).padded > sharded.unit_layout(u).total;

        // The same shard as copying out of a fully initialised model (the path it replaces).
        nn::LlamaModel allocated(config, Device::cpu());
        allocated.init_weights(kSeed);
        ShardedModel copied(allocated, group, nullptr, {});
        std::vector<optim::NamedParam> a = sharded.optimizer_params(),
                                       b = copied.optimizer_params();
        ASSERT_EQ(a.size(), b.size());
        for (size_t k = 0; k < a.size(); ++k)
          EXPECT_EQ(a[k].param->to_float_vector(), b[k].param->to_float_vector())
              << tag << " " << a[k].name;
      }
      ASSERT_EQ(covered.size(), full.size()) << world << " ranks";
      for (const auto& [name, counts] : covered)
        EXPECT_TRUE(std::all_of(counts.begin(), counts.end(), [](int c) { return c == 1; }))
            << name << " over " << world << " ranks: an element in no shard or in two";
      if (world >= 5) {
        EXPECT_TRUE(padded) << world << " ranks: the case is meant to include padding";
      }
    }
  }
}

// A rank of a world of 4 holds a quarter of the model at start-up, not all of it, and during a
// step its shards plus the gathered units in use, to the byte.
TEST(ShardedInit, PeakParametersOfARankOfFourAreItsShardsNotTheFullModel) {
  nn::LlamaConfig config = small_config();
  config.num_layers = 4;
  Allocator& cpu = allocator_for(Device::cpu());
  const int64_t before = parameter_bytes_in_use();
  int64_t full_model = 0;
  {
    nn::LlamaModel allocated(config, Device::cpu());
    full_model = parameter_bytes_in_use() - before;
  }

  // The old way, for contrast: the full model first, then the shards copied out of it.
  {
    cpu.reset_peak();
    SimulatedRank group(1, 4);
    nn::LlamaModel allocated(config, Device::cpu());
    allocated.init_weights(kSeed);
    ShardedModel sharded(allocated, group, nullptr, {});
    EXPECT_GT(cpu.stats().peak_of(MemoryCategory::Parameters) - before, full_model);
  }

  cpu.reset_peak();
  SimulatedRank group(1, 4);
  nn::LlamaModel model(config, Device::cpu(), nn::ParameterStorage::Deferred);
  FsdpOptions options;
  options.prefetch = false;
  ShardedModel sharded(model, group, nullptr, options, seeded_init(model, kSeed));
  const int64_t shards = shard_bytes(sharded);
  EXPECT_EQ(cpu.stats().peak_of(MemoryCategory::Parameters) - before, shards);
  EXPECT_EQ(parameter_bytes_in_use() - before, shards);
  // A quarter of the model, up to padding and the allocators' rounding.
  EXPECT_NEAR(4.0 * static_cast<double>(shards) / static_cast<double>(full_model), 1.0, 0.02)
      << "4 x " << shards << " bytes of shards vs a model of " << full_model;

  // One step: the root stays gathered from its forward to its backward, the layers are gathered
  // one at a time (no prefetch), each freed before the next.
  int64_t root = 0, largest_layer = 0;
  for (int u = 0; u < sharded.num_units(); ++u) {
    int64_t gathered = rounded(sharded.unit_layout(u).padded * 4);
    if (u + 1 == sharded.num_units())
      root = gathered;
    else
      largest_layer = std::max(largest_layer, gathered);
  }
  cpu.reset_peak();
  Tensor ids = from_ints({1, 5, 9, 3, 7, 2}, {2, 3});
  Tensor targets = from_ints({5, 9, -100, 7, 2, 11}, {2, 3});
  autograd::backward(ops::scale(model.loss_sum(ids, targets), 0.1f));
  EXPECT_EQ(sharded.num_gathered_units(), 0);
  EXPECT_EQ(cpu.stats().peak_of(MemoryCategory::Parameters) - before,
            shards + root + largest_layer);
}

// Loading a Hugging Face checkpoint into a deferred sharded model: each rank copies only its
// elements out of the mapped files (16-bit ones converted), never allocating a full tensor.
TEST(ShardedInit, LoadsHuggingFaceWeightsIntoTheShardsOnly) {
  nn::LlamaConfig config = small_config();
  testing::TempDir dir("fsdp-hf");
  Values want;
  {
    nn::LlamaModel source(config, Device::cpu());
    source.init_weights(77);
    NamedTensors tensors;
    for (auto& [name, slot] : source.named_parameters()) {
      tensors.emplace_back(name, slot->detach().to(DType::BF16));
      want[name] = tensors.back().second.to_float_vector();
    }
    save_sharded(dir.str(), tensors, 4096);  // several files and an index
  }
  ASSERT_TRUE(SafetensorsCheckpoint::open(dir.str()).sharded());

  Allocator& cpu = allocator_for(Device::cpu());
  for (int rank = 0; rank < 3; ++rank) {
    SimulatedRank group(rank, 3);
    const int64_t before = parameter_bytes_in_use();
    cpu.reset_peak();
    nn::LlamaModel model(config, Device::cpu(), nn::ParameterStorage::Deferred);
    ShardedModel sharded(model, group, nullptr, {});
    Tensor ids = from_ints({1, 2}, {1, 2});
    EXPECT_THROW(model.forward(ids), Error) << "no weights yet";
    io::load_hf_weights(sharded, dir.str());
    expect_pieces_equal(sharded, want, nullptr, "rank " + std::to_string(rank));
    EXPECT_EQ(cpu.stats().peak_of(MemoryCategory::Parameters) - before, shard_bytes(sharded));
    EXPECT_EQ(cpu.stats().peak_of(MemoryCategory::Workspace),
              cpu.stats().in_use_of(MemoryCategory::Workspace))
        << "no full tensor was staged";
  }

  // A checkpoint of another shape is refused, naming the tensor.
  nn::LlamaConfig other = config;
  other.intermediate_size = 24;
  nn::LlamaModel model(other, Device::cpu(), nn::ParameterStorage::Deferred);
  SimulatedRank group(0, 2);
  ShardedModel sharded(model, group, nullptr, {});
  try {
    io::load_hf_weights(sharded, dir.str());
    FAIL() << "loaded a checkpoint of another shape";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "down_proj.weight' has shape [12, 23] but the model expects [12, 24]"),
              std::string::npos)
        << e.what();
  }
}

TEST(ShardedInit, WithoutInitializerTheWeightsMustBeLoadedBeforeUse) {
  nn::LlamaConfig config = small_config();
  SimulatedRank group(0, 1);
  nn::LlamaModel model(config, Device::cpu(), nn::ParameterStorage::Deferred);
  ShardedModel sharded(model, group, nullptr, {});
  Tensor ids = from_ints({1, 2}, {1, 2});
  EXPECT_THROW(model.forward(ids), Error);
  EXPECT_THROW(sharded.for_each_full_parameter([](const std::string&, const Tensor&) {}), Error);

  nn::LlamaModel source(config, Device::cpu());
  source.init_weights(kSeed);
  std::map<std::string, Tensor*> slots;
  for (auto& [name, slot] : source.named_parameters()) slots[name] = slot;
  std::vector<std::string> asked;
  sharded.load_full_parameters([&](const std::string& name) {
    asked.push_back(name);
    return slots.at(name)->detach();
  });
  EXPECT_EQ(asked.size(), slots.size()) << "each parameter is asked for once";
  std::sort(asked.begin(), asked.end());
  EXPECT_TRUE(std::adjacent_find(asked.begin(), asked.end()) == asked.end());
  EXPECT_EQ(model.forward(ids).to_float_vector(), source.forward(ids).to_float_vector());
}

}  // namespace
}  // namespace shardtrain::fsdp
