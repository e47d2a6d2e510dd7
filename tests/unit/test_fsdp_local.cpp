// Sharding in a process started without mpirun: a world of one rank, no MPI at all. Also the
// flat-parameter layout arithmetic, which does not depend on the world size.
#include <gtest/gtest.h>

#include "shardtrain/autograd/engine.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/dist/mpi.h"
#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/ops/ops.h"

namespace shardtrain::fsdp {
namespace {

TEST(FlatParamLayout, PadsToEqualShardsAndSplitsParametersIntoPieces) {
  // 6 + 4 + 3 = 13 elements over 4 shards: shard_numel 4, padded 16.
  FlatParamLayout l = FlatParamLayout::build({{"a", {2, 3}}, {"b", {4}}, {"c", {3}}}, 4);
  EXPECT_EQ(l.total, 13);
  EXPECT_EQ(l.shard_numel, 4);
  EXPECT_EQ(l.padded, 16);
  EXPECT_EQ(l.entries[1].offset, 6);
  EXPECT_EQ(l.entries[2].offset, 10);
  // Shard 1 = flat [4, 8): a[4..6) then b[0..2).
  auto p1 = l.pieces_of_shard(1);
  ASSERT_EQ(p1.size(), 2u);
  EXPECT_EQ(p1[0].param, 0);
  EXPECT_EQ(p1[0].param_begin, 4);
  EXPECT_EQ(p1[0].length, 2);
  EXPECT_EQ(p1[0].shard_offset, 0);
  EXPECT_EQ(p1[1].param, 1);
  EXPECT_EQ(p1[1].param_begin, 0);
  EXPECT_EQ(p1[1].length, 2);
  EXPECT_EQ(p1[1].shard_offset, 2);
  // Shard 3 = flat [12, 16): c[2] and three padding elements.
  auto p3 = l.pieces_of_shard(3);
  ASSERT_EQ(p3.size(), 1u);
  EXPECT_EQ(p3[0].param, 2);
  EXPECT_EQ(p3[0].param_begin, 2);
  EXPECT_EQ(p3[0].length, 1);
  // Every element of every parameter is in exactly one piece.
  int64_t covered = 0;
  for (int s = 0; s < 4; ++s)
    for (const auto& p : l.pieces_of_shard(s)) covered += p.length;
  EXPECT_EQ(covered, l.total);
  EXPECT_THROW(FlatParamLayout::build({{"a", {2}}}, 0), ShapeError);
  EXPECT_THROW(l.pieces_of_shard(4), ShapeError);
}

TEST(DistEnvLocal, StartsAWorldOfOneWithoutMpi) {
  dist::DistEnv env;
  EXPECT_FALSE(env.uses_mpi());
  EXPECT_FALSE(dist::MpiRuntime::initialized());
  EXPECT_EQ(env.world_size(), 1);
  EXPECT_EQ(env.world().backend_name(), "local");
  EXPECT_EQ(env.world().all_reduce_host(2.5, dist::ReduceOp::Sum), 2.5);
  Tensor in = from_floats({1, 2, 3}, {3});
  Tensor out = zeros({3});
  env.world().all_gather(in, out)->wait();
  EXPECT_EQ(out.to_float_vector(), in.to_float_vector());
  dist::DistOptions options;
  options.ranks_per_node = 2;
  EXPECT_THROW(dist::DistEnv{options}, ConfigError);
}

TEST(DistEnvLocal, AbortJobWithoutMpiExitsWithTheRanksMessage) {
  EXPECT_EXIT(dist::abort_job("cannot go on", 3), ::testing::ExitedWithCode(3),
              "rank 0: cannot go on");
}

nn::LlamaConfig tiny() {
  nn::LlamaConfig c;
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.max_seq_len = 8;
  c.init_std = 0.2f;
  return c;
}

double loss_and_backward(nn::LlamaModel& model, int micro_batches) {
  double total = 0;
  for (int m = 0; m < micro_batches; ++m) {
    Tensor ids = from_ints({1, 5, 9, 3 + m, 7, 2}, {2, 3});
    Tensor targets = from_ints({5, 9, -100, 7, 2, 11 + m}, {2, 3});
    Tensor loss = model.loss_sum(ids, targets);
    total += loss.item();
    autograd::backward(ops::scale(loss, 1.0f / 10.0f));
  }
  return total;
}

// One rank: every strategy degenerates to the plain model, bit for bit.
TEST(ShardedModelLocal, OneRankReproducesThePlainModelExactly) {
  for (ShardingStrategy s : {ShardingStrategy::FullShard, ShardingStrategy::GradOpShard,
                             ShardingStrategy::NoShard, ShardingStrategy::HybridShard}) {
    nn::LlamaModel plain(tiny(), Device::cpu());
    plain.init_weights(4);
    double want = loss_and_backward(plain, 2);
    std::map<std::string, std::vector<float>> grads;
    for (auto& [name, slot] : plain.named_parameters())
      grads[name] = autograd::grad(*slot).to_float_vector();

    dist::DistEnv env;
    nn::LlamaModel model(tiny(), Device::cpu());
    model.init_weights(4);
    FsdpOptions options;
    options.strategy = s;
    ShardedModel sharded(model, env, options);
    for (auto& [name, slot] : model.named_parameters())
      EXPECT_FALSE(slot->defined()) << name << " still holds its full weights";
    EXPECT_EQ(loss_and_backward(model, 2), want);
    size_t n = 0;
    sharded.for_each_full_gradient([&](const std::string& name, const Tensor& g) {
      EXPECT_EQ(g.to_float_vector(), grads.at(name)) << name;
      ++n;
    });
    EXPECT_EQ(n, grads.size());
    // One optimizer entry per parameter, named as the parameter, covering all of it.
    auto params = sharded.optimizer_params();
    EXPECT_EQ(params.size(), grads.size());
    for (const auto& p : params)
      EXPECT_EQ(static_cast<size_t>(p.param->numel()), grads.at(p.name).size()) << p.name;
  }
}

TEST(ShardedModelLocal, RejectsFrozenParameters) {
  dist::DistEnv env;
  nn::LlamaModel model(tiny(), Device::cpu());
  autograd::set_requires_grad(model.norm.weight, false);
  EXPECT_THROW(ShardedModel(model, env, {}), ConfigError);
}

}  // namespace
}  // namespace shardtrain::fsdp
