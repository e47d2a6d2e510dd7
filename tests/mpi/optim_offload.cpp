// The offloaded optimizer on FSDP shards: on every rank it leaves the same shards, bit for bit, as
// AdamW on the device, with 12 bytes of state per shard element in the host pool and none on the
// device.
#include <gtest/gtest.h>

#include "bits.h"
#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/optim/offload.h"
#include "tiny_llama.h"

namespace shardtrain::fsdp {
namespace {

using shardtrain::testing::bits_of;

constexpr uint64_t kInitSeed = 11;
constexpr float kLr = 1e-2f;

int64_t rounded(int64_t bytes) {
  return (bytes + 63) / 64 * 64;
}  // the allocators' granularity

int64_t optimizer_state(Device device) {
  return allocator_for(device).stats().in_use_of(MemoryCategory::OptimizerState);
}

TEST(OffloadOnShards, FullShardStepsAreBitwiseEqualToAdamWWithTheStateOnTheHost) {
  dist::DistEnv env;
  const int n = env.world_size(), rank = env.rank();
  nn::LlamaConfig cfg = test::tiny_config(2);
  std::vector<test::MicroBatch> all = test::make_micro_batches(n, 2, 8, cfg.vocab_size, 21);
  const int64_t tokens = test::total_tokens(all);
  const std::vector<test::MicroBatch> mine = {all[static_cast<size_t>(rank)]};

  nn::LlamaModel ref_model(cfg, Device::cpu()), off_model(cfg, Device::cpu());
  ref_model.init_weights(kInitSeed);
  off_model.init_weights(kInitSeed);
  ShardedModel ref(ref_model, env, {}), off(off_model, env, {});

  const int64_t device_before = optimizer_state(Device::cpu());
  const int64_t host_before = optimizer_state(Device::host());
  optim::OffloadOptions options;
  options.pipeline_chunk_elements = 100;  // several pieces per shard
  optim::OffloadedAdamW offloaded(off.optimizer_params(), {}, options);
  int64_t shard_elements = 0, per_tensor = 0;
  for (const optim::NamedParam& p : off.optimizer_params()) {
    shard_elements += p.param->numel();
    per_tensor += rounded(4 * p.param->numel());
  }
  EXPECT_GT(shard_elements, 0);
  EXPECT_EQ(optimizer_state(Device::cpu()) - device_before, 0);
  // Master and both moments of this rank's 1/N of the model.
  EXPECT_EQ(optimizer_state(Device::host()) - host_before, 3 * per_tensor);
  EXPECT_LE(3 * per_tensor,
            12 * shard_elements + 3 * 64 * static_cast<int64_t>(off.optimizer_params().size()));

  optim::AdamW adamw(ref.optimizer_params(), {});
  for (int step = 1; step <= 2; ++step) {
    adamw.zero_grad();
    offloaded.zero_grad();
    test::forward_backward(ref_model, mine, tokens);
    test::forward_backward(off_model, mine, tokens);
    adamw.step(kLr);
    offloaded.step(kLr);
    const auto a = ref.optimizer_params(), b = off.optimizer_params();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(bits_of(*a[i].param), bits_of(*b[i].param))
          << "rank " << rank << " step " << step << " " << a[i].name;
  }
  auto sa = adamw.state(), sb = offloaded.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    EXPECT_EQ(bits_of(*sa[i].second), bits_of(*sb[i].second)) << sa[i].first;
  }
}

}  // namespace
}  // namespace shardtrain::fsdp
