// Sharded training against a single-process computation of the same global batch: every rank
// also runs the whole batch through an unsharded copy of the model and compares.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>

#include "shardtrain/activation/strategy.h"
#include "shardtrain/amp/mixed_precision.h"
#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/fsdp/fsdp.h"
#include "tiny_llama.h"

namespace shardtrain::fsdp {
namespace {

using test::MicroBatch;
using test::NamedValues;

constexpr uint64_t kInitSeed = 11;
constexpr int kPerRank = 2;  // micro-batches per rank per step
constexpr float kLr = 1e-2f;

struct Case {
  std::string name;
  ShardingStrategy strategy;
  bool prefetch = true;
  bool sync_every_microbatch = true;
  int ranks_per_node = 0;
  bool tie_embeddings = false;
  std::string activation = "none";  // activation strategy installed outside the sharding
  bool reentrant = false;
  int layers = 2;
  // Built deferred, each rank creating only its shards from the seed; false: built in full,
  // initialised, then sharded by copying.
  bool deferred = true;
  int64_t loss_chunk = 0;  // rows per chunk of the fused head + loss; 0 = whole logits
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

// The single-process result every rank computes for itself.
struct Reference {
  double loss = 0, eval_loss_after_step = 0, grad_sum_squares = 0;
  NamedValues grads, params_after_step;
};

std::vector<optim::NamedParam> all_params(nn::LlamaModel& model) {
  std::vector<optim::NamedParam> out;
  for (auto& [name, slot] : model.named_parameters()) out.push_back({name, slot});
  return out;
}

double eval_loss_sum(nn::LlamaModel& model, const std::vector<MicroBatch>& mbs) {
  autograd::NoGrad no_grad;
  double sum = 0;
  for (const auto& mb : mbs) sum += model.loss_sum(mb.ids, mb.targets).item();
  return sum;
}

Reference single_process(const nn::LlamaConfig& cfg, const std::vector<MicroBatch>& all) {
  Reference ref;
  nn::LlamaModel model(cfg, Device::cpu());
  model.init_weights(kInitSeed);
  const int64_t tokens = test::total_tokens(all);
  ref.loss = test::forward_backward(model, all, tokens) / static_cast<double>(tokens);
  ref.grads = test::grads_of(model);
  std::vector<optim::NamedParam> params = all_params(model);
  ref.grad_sum_squares = optim::grad_sum_squares(params);
  optim::AdamW opt(params, {});
  opt.step(kLr);
  ref.params_after_step = test::params_of(model);
  ref.eval_loss_after_step = eval_loss_sum(model, all) / static_cast<double>(tokens);
  return ref;
}

class FsdpMatchesSingleProcess : public ::testing::TestWithParam<Case> {};

TEST_P(FsdpMatchesSingleProcess, LossGradientsAndOneStep) {
  const Case& c = GetParam();
  dist::DistOptions dist_options;
  dist_options.ranks_per_node = c.ranks_per_node;
  dist_options.timeout_s = 60;
  dist::DistEnv env(dist_options);
  const int n = env.world_size(), rank = env.rank();

  nn::LlamaConfig cfg = test::tiny_config(c.layers);
  cfg.tie_embeddings = c.tie_embeddings;
  std::vector<MicroBatch> all = test::make_micro_batches(n * kPerRank, 2, 8, cfg.vocab_size, 5);
  const int64_t tokens = test::total_tokens(all);
  const Reference ref = single_process(cfg, all);

  nn::LlamaModel model(
      cfg, Device::cpu(),
      c.deferred ? nn::ParameterStorage::Deferred : nn::ParameterStorage::Allocated);
  if (!c.deferred) model.init_weights(kInitSeed);
  model.set_loss_chunk_rows(c.loss_chunk);  // the reference materialises the logits
  if (c.activation != "none") {
    // Installed first, so that the strategy's wrapper runs outside the sharding's: a recompute
    // runs the unit's forward again during backward.
    activation::ActivationOptions ao;
    ao.strategy = c.activation;
    ao.reentrant = c.reentrant;
    activation::apply_activation_strategy(model, ao);
  }
  FsdpOptions options;
  options.strategy = c.strategy;
  options.prefetch = c.prefetch;
  options.sync_every_microbatch = c.sync_every_microbatch;
  ShardedModel sharded(model, env, options,
                       c.deferred ? seeded_init(model, kInitSeed) : ParamRangeInit());
  if (c.strategy == ShardingStrategy::HybridShard) {
    EXPECT_EQ(sharded.shard_group().size(), c.ranks_per_node);
    if (n > c.ranks_per_node) {
      ASSERT_NE(sharded.replicate_group(), nullptr);
      EXPECT_EQ(sharded.replicate_group()->size(), n / c.ranks_per_node);
    } else {
      EXPECT_EQ(sharded.replicate_group(), nullptr) << "one node: nothing to replicate across";
    }
  }

  std::vector<MicroBatch> mine(all.begin() + rank * kPerRank, all.begin() + (rank + 1) * kPerRank);
  double local = 0;
  sharded.reset_comm_stats();
  for (int k = 0; k < kPerRank; ++k) {
    sharded.set_microbatch(k, kPerRank);
    local += test::forward_backward(model, {mine[static_cast<size_t>(k)]}, tokens);
    // Everything gathered for the micro-batch is released after its backward.
    EXPECT_EQ(sharded.num_gathered_units(), 0) << "after micro-batch " << k;
  }
  double loss =
      env.world().all_reduce_host(local, dist::ReduceOp::Sum) / static_cast<double>(tokens);
  EXPECT_NEAR(loss, ref.loss, 1e-5 * ref.loss);

  // Communication: each layer is gathered in forward and, unless its gathered parameters were
  // kept (grad_op_shard), once more for backward; a recompute never gathers again. The root is
  // gathered once. Gradients are reduced once per unit per synchronising micro-batch.
  const int64_t units = c.layers + 1;
  const bool regather = c.strategy == ShardingStrategy::FullShard ||
                        c.strategy == ShardingStrategy::HybridShard || c.reentrant;
  const bool split = sharded.shard_group().size() > 1;
  const int64_t syncs = c.sync_every_microbatch ? kPerRank : 1;
  const ShardedModel::CommStats& comm = sharded.comm_stats();
  EXPECT_EQ(comm.all_gathers, split ? kPerRank * (units + (regather ? c.layers : 0)) : 0);
  EXPECT_EQ(comm.reduce_scatters, split ? syncs * units : 0);
  EXPECT_EQ(comm.all_reduces, sharded.replicate_group() ? syncs * units : 0);

  size_t seen = 0;
  sharded.for_each_full_gradient([&](const std::string& name, const Tensor& full) {
    auto it = ref.grads.find(name);
    ASSERT_NE(it, ref.grads.end()) << name;
    EXPECT_LT(test::max_relative_error(full.to_float_vector(), it->second), 1e-5) << name;
    ++seen;
  });
  EXPECT_EQ(seen, ref.grads.size());
  EXPECT_NEAR(sharded.grad_sum_squares(), ref.grad_sum_squares, 1e-5 * ref.grad_sum_squares);

  // AdamW's first step moves a weight by lr * g / (|g| + eps): for a gradient element of 1e-6,
  // an absolute difference far below the gradient check's floor (a tenth of the largest element)
  // becomes a visible difference in the update. Summation orders that differ between the sharded
  // and the single-process products (and between OpenBLAS's AVX2 and AVX-512 kernels) put the
  // weights 1.6e-5 apart on an AVX2 machine. A shard updated wrongly is off by about lr (1e-2),
  // more than the comparison's floor itself.
  optim::AdamW opt(sharded.optimizer_params(), {});
  opt.step(kLr);
  size_t updated = 0;
  sharded.for_each_full_parameter([&](const std::string& name, const Tensor& full) {
    EXPECT_LT(test::max_relative_error(full.to_float_vector(), ref.params_after_step.at(name)),
              1e-4)
        << name;
    ++updated;
  });
  EXPECT_EQ(updated, ref.params_after_step.size());
  // Evaluation (no graph) sees the updated shards.
  double eval = env.world().all_reduce_host(eval_loss_sum(model, mine), dist::ReduceOp::Sum) /
                static_cast<double>(tokens);
  EXPECT_NEAR(eval, ref.eval_loss_after_step, 1e-5 * ref.eval_loss_after_step);
  EXPECT_EQ(sharded.num_gathered_units(), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, FsdpMatchesSingleProcess,
    ::testing::Values(Case{"full_shard", ShardingStrategy::FullShard},
                      Case{"full_shard_no_prefetch_sync_last", ShardingStrategy::FullShard, false,
                           false},
                      Case{"full_shard_tied", ShardingStrategy::FullShard, true, true, 0, true},
                      Case{"grad_op_shard", ShardingStrategy::GradOpShard},
                      Case{"no_shard", ShardingStrategy::NoShard},
                      Case{"no_shard_sync_last", ShardingStrategy::NoShard, true, false},
                      Case{"hybrid_shard", ShardingStrategy::HybridShard, true, true, 2},
                      Case{"hybrid_shard_sync_last", ShardingStrategy::HybridShard, true, false, 2},
                      Case{"full_shard_checkpoint", ShardingStrategy::FullShard, true, true, 0,
                           false, "per_layer"},
                      Case{"full_shard_checkpoint_reentrant", ShardingStrategy::FullShard, true,
                           true, 0, false, "per_layer", true},
                      Case{"grad_op_shard_checkpoint_reentrant", ShardingStrategy::GradOpShard,
                           true, true, 0, false, "per_layer", true},
                      Case{"full_shard_sqrt_segment_no_prefetch", ShardingStrategy::FullShard,
                           false, true, 0, false, "sqrt_segment", false, 4},
                      Case{"full_shard_copied_from_full_model", ShardingStrategy::FullShard, true,
                           true, 0, false, "none", false, 2, false},
                      Case{"hybrid_shard_copied_from_full_model", ShardingStrategy::HybridShard,
                           true, true, 2, false, "none", false, 2, false},
                      Case{"full_shard_chunked_loss", ShardingStrategy::FullShard, true, true, 0,
                           false, "none", false, 2, true, 5},
                      Case{"full_shard_tied_chunked_loss_checkpoint", ShardingStrategy::FullShard,
                           true, true, 0, true, "per_layer", false, 2, true, 7}),
    [](const auto& info) { return info.param.name; });

// ---- memory -----------------------------------------------------------------------------------

int64_t rounded(int64_t bytes) {
  return (bytes + 63) / 64 * 64;
}  // the allocators' granularity

int64_t model_state_bytes() {
  MemoryStats s = allocator_for(Device::cpu()).stats();
  return s.in_use_of(MemoryCategory::Parameters) + s.in_use_of(MemoryCategory::Gradients) +
         s.in_use_of(MemoryCategory::OptimizerState);
}

TEST(FsdpMemory, FullShardKeepsOneNthOfTheModelStatePerRank) {
  dist::DistEnv env;
  const int n = env.world_size();
  nn::LlamaConfig cfg = test::tiny_config(4);
  std::vector<MicroBatch> all = test::make_micro_batches(n, 2, 8, cfg.vocab_size, 9);
  const int64_t tokens = test::total_tokens(all);
  Allocator& cpu = allocator_for(Device::cpu());

  const int64_t before = model_state_bytes();
  const int64_t params_before = cpu.stats().in_use_of(MemoryCategory::Parameters);
  cpu.reset_peak();
  nn::LlamaModel model(cfg, Device::cpu(), nn::ParameterStorage::Deferred);
  // One process (N = 1) holds parameter, gradient and two AdamW moments for every parameter.
  int64_t single_process = 0;
  for (auto& [name, slot] : model.named_parameters()) single_process += 4 * rounded(slot->nbytes());

  ShardedModel sharded(model, env, {}, seeded_init(model, kInitSeed));
  int64_t shards = 0, pieces = 0, padding_and_rounding = 0, largest_layer = 0;
  for (int u = 0; u < sharded.num_units(); ++u) {
    const FlatParamLayout& l = sharded.unit_layout(u);
    shards += rounded(l.shard_numel * 4);
    padding_and_rounding +=
        4 * (l.padded - l.total) + 64 * 4 * (static_cast<int64_t>(l.entries.size()) + 1);
    if (u + 1 < sharded.num_units()) largest_layer = std::max(largest_layer, rounded(l.padded * 4));
  }
  for (const ParamPiece& p : sharded.param_pieces()) pieces += rounded(p.length * 4);
  EXPECT_EQ(model_state_bytes() - before, shards) << "only the shards remain after sharding";
  EXPECT_EQ(cpu.stats().peak_of(MemoryCategory::Parameters) - params_before, shards)
      << "building the sharded model never held more than this rank's shards";

  optim::AdamW opt(sharded.optimizer_params(), {});
  cpu.reset_peak();
  test::forward_backward(model, {all[static_cast<size_t>(env.rank())]}, tokens);
  opt.step(kLr);
  const int64_t per_rank = model_state_bytes() - before;
  EXPECT_EQ(per_rank, shards + 3 * pieces) << "shard + gradient + 2 moments of this rank's pieces";
  EXPECT_LE(std::abs(per_rank * n - single_process), n * padding_and_rounding)
      << "per rank " << per_rank << " x " << n << " ranks vs " << single_process
      << " in one process";

  // Gathered parameters are freed as the step goes: at most the root and two layers (one being
  // computed, one prefetched) are ever gathered at once.
  const int64_t root = rounded(sharded.unit_layout(sharded.num_units() - 1).padded * 4);
  const int64_t peak = cpu.stats().peak_of(MemoryCategory::Parameters) - params_before;
  EXPECT_LE(peak, shards + root + 2 * largest_layer);
  EXPECT_GT(peak, shards + root) << "the gathered parameters are counted as Parameters";
}

// ---- deferred construction ------------------------------------------------------------------

// Shards created from the seed on each rank hold exactly the full initialisation: gathered
// back, every parameter equals init_weights' bit for bit, for every split of the world.
TEST(FsdpDeferredInit, GatheredShardsEqualTheFullInitBitForBit) {
  for (bool tied : {false, true}) {
    for (ShardingStrategy strategy : {ShardingStrategy::FullShard, ShardingStrategy::HybridShard}) {
      dist::DistOptions dist_options;
      dist_options.ranks_per_node = strategy == ShardingStrategy::HybridShard ? 2 : 0;
      dist::DistEnv env(dist_options);
      nn::LlamaConfig cfg = test::tiny_config(3);
      cfg.tie_embeddings = tied;
      // 18 * 123 elements in the untied root unit: padded over 4 ranks.
      cfg.hidden_size = 18;
      cfg.num_heads = 3;
      cfg.num_kv_heads = 1;
      cfg.vocab_size = 61;
      nn::LlamaModel full(cfg, Device::cpu());
      full.init_weights(kInitSeed);
      NamedValues want = test::params_of(full);

      nn::LlamaModel model(cfg, Device::cpu(), nn::ParameterStorage::Deferred);
      FsdpOptions options;
      options.strategy = strategy;
      ShardedModel sharded(model, env, options, seeded_init(model, kInitSeed));
      size_t seen = 0;
      sharded.for_each_full_parameter([&](const std::string& name, const Tensor& got) {
        std::vector<float> g = got.to_float_vector();
        const std::vector<float>& w = want.at(name);
        ASSERT_EQ(g.size(), w.size()) << name;
        for (size_t i = 0; i < g.size(); ++i)
          ASSERT_EQ(float_bits(g[i]), float_bits(w[i]))
              << name << "[" << i << "] " << sharding_strategy_name(strategy);
        ++seen;
      });
      EXPECT_EQ(seen, want.size());
    }
  }
}

// ---- mixed precision --------------------------------------------------------------------------

TEST(FsdpMixedPrecision, Bf16ComputeMatchesSingleProcessCasts) {
  dist::DistEnv env;
  const int n = env.world_size(), rank = env.rank();
  nn::LlamaConfig cfg = test::tiny_config(2);
  std::vector<MicroBatch> all = test::make_micro_batches(n, 2, 8, cfg.vocab_size, 13);
  const int64_t tokens = test::total_tokens(all);

  // Single process: bf16 compute copies of fp32 masters, fp32 gradients.
  nn::LlamaModel ref(cfg, Device::cpu());
  ref.init_weights(kInitSeed);
  amp::install_mixed_precision(ref, {DType::BF16, DType::F32});
  double ref_loss = test::forward_backward(ref, all, tokens) / static_cast<double>(tokens);
  NamedValues ref_grads = test::grads_of(ref);

  for (DType reduce : {DType::F32, DType::BF16}) {
    nn::LlamaModel model(cfg, Device::cpu());
    model.init_weights(kInitSeed);
    FsdpOptions options;
    options.param_dtype = DType::BF16;
    options.reduce_dtype = reduce;
    ShardedModel sharded(model, env, options);
    double local = test::forward_backward(model, {all[static_cast<size_t>(rank)]}, tokens);
    double loss =
        env.world().all_reduce_host(local, dist::ReduceOp::Sum) / static_cast<double>(tokens);
    EXPECT_NEAR(loss, ref_loss, 1e-5 * ref_loss);
    // bf16 gradients reduced in fp32 differ from the single process only in summation order;
    // reduced in bf16 they are rounded once more (8 significant bits).
    double tolerance = reduce == DType::F32 ? 1e-5 : 1e-2;
    size_t compared = 0;
    sharded.for_each_full_gradient([&](const std::string& name, const Tensor& full) {
      EXPECT_LT(test::max_relative_error(full.to_float_vector(), ref_grads.at(name)), tolerance)
          << name << " reduced in " << dtype_name(reduce);
      ++compared;
    });
    EXPECT_EQ(compared, ref_grads.size()) << "reduced in " << dtype_name(reduce);
  }
}

// no_shard in 16 bits casts each unit around its forward and again for its backward, as
// full_shard gathers it: no compute-dtype copy of the whole model waits for the backward (plain
// data parallelism's memory is one process's). grad_op_shard keeps every unit; both compute the
// same gradients.
TEST(FsdpMixedPrecision, NoShardFreesEachUnitsCopyAfterItsForward) {
  dist::DistEnv env;
  const int rank = env.rank();
  nn::LlamaConfig cfg = test::tiny_config(3);
  std::vector<MicroBatch> all =
      test::make_micro_batches(env.world_size(), 2, 8, cfg.vocab_size, 17);
  const MicroBatch& mine = all[static_cast<size_t>(rank)];
  std::map<ShardingStrategy, NamedValues> grads;
  for (ShardingStrategy strategy : {ShardingStrategy::NoShard, ShardingStrategy::GradOpShard}) {
    nn::LlamaModel model(cfg, Device::cpu());
    model.init_weights(kInitSeed);
    FsdpOptions options;
    options.strategy = strategy;
    options.param_dtype = DType::BF16;
    ShardedModel sharded(model, env, options);
    Tensor loss = model.loss_sum(mine.ids, mine.targets);
    // The root unit (embeddings, head) stays for its backward; the layers' copies do not.
    EXPECT_EQ(sharded.num_gathered_units(),
              strategy == ShardingStrategy::NoShard ? 1 : cfg.num_layers + 1)
        << sharding_strategy_name(strategy);
    autograd::backward(loss);
    EXPECT_EQ(sharded.num_gathered_units(), 0) << sharding_strategy_name(strategy);
    sharded.for_each_full_gradient([&](const std::string& name, const Tensor& full) {
      grads[strategy][name] = full.to_float_vector();
    });
  }
  const size_t parameters = nn::LlamaModel(cfg, Device::cpu()).named_parameters().size();
  ASSERT_EQ(grads[ShardingStrategy::NoShard].size(), parameters);
  ASSERT_EQ(grads[ShardingStrategy::GradOpShard].size(), parameters);
  for (const auto& [name, g] : grads[ShardingStrategy::NoShard])
    EXPECT_LT(test::max_relative_error(g, grads[ShardingStrategy::GradOpShard].at(name)), 1e-6)
        << name;
}

// ---- loading and errors -----------------------------------------------------------------------

TEST(FsdpState, LoadFullParametersRoundTrips) {
  dist::DistEnv env;
  nn::LlamaConfig cfg = test::tiny_config(2);
  nn::LlamaModel source(cfg, Device::cpu());
  source.init_weights(77);
  NamedValues expected = test::params_of(source);

  nn::LlamaModel model(cfg, Device::cpu(), nn::ParameterStorage::Deferred);
  ShardedModel sharded(model, env, {});
  // Nothing to compute with until the weights are loaded: every rank refuses, before any
  // collective, so none is left waiting.
  std::vector<MicroBatch> one = test::make_micro_batches(1, 1, 4, cfg.vocab_size, 1);
  EXPECT_THROW(model.loss_sum(one[0].ids, one[0].targets), Error);
  std::map<std::string, Tensor*> slots;
  for (auto& [name, slot] : source.named_parameters()) slots[name] = slot;
  sharded.load_full_parameters(
      [&](const std::string& name) { return slots.at(name)->to(DType::BF16); });
  size_t loaded = 0;
  sharded.for_each_full_parameter([&](const std::string& name, const Tensor& full) {
    std::vector<float> got = full.to_float_vector(), want = expected.at(name);
    ++loaded;
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], round_to(DType::BF16, want[i])) << name << "[" << i << "]";
  });
  EXPECT_EQ(loaded, expected.size());
  EXPECT_THROW(sharded.load_full_parameters([](const std::string&) { return zeros({3}); }),
               ShapeError);
}

TEST(FsdpState, ParsesStrategies) {
  EXPECT_EQ(parse_sharding_strategy("hybrid_shard"), ShardingStrategy::HybridShard);
  EXPECT_EQ(sharding_strategy_name(ShardingStrategy::GradOpShard), "grad_op_shard");
  EXPECT_THROW(parse_sharding_strategy("zero3"), ConfigError);
}

TEST(FsdpState, ForwardWithGradientsTwiceWithoutBackwardIsAnError) {
  dist::DistEnv env;
  nn::LlamaConfig cfg = test::tiny_config(2);
  std::vector<MicroBatch> all = test::make_micro_batches(1, 1, 4, cfg.vocab_size, 1);
  nn::LlamaModel model(cfg, Device::cpu());
  model.init_weights(kInitSeed);
  ShardedModel sharded(model, env, {});
  Tensor kept = model.loss_sum(all[0].ids, all[0].targets);
  EXPECT_THROW(model.loss_sum(all[0].ids, all[0].targets), Error);
  // Once the first graph is dropped, a new forward starts cleanly.
  kept = Tensor();
  Tensor loss = model.loss_sum(all[0].ids, all[0].targets);
  autograd::backward(loss);
  EXPECT_EQ(sharded.num_gathered_units(), 0);
}

}  // namespace
}  // namespace shardtrain::fsdp
