// The NCCL process group and sharded training on one GPU, in one process without mpirun.
//
// What runs where:
//   - A process started on its own is a world of one on the local group, and a ShardedModel over
//     it on the GPU trains exactly like the plain model; NCCL itself (a one-rank communicator
//     from ncclCommInitAll) works on this GPU.
//   - The one-rank NcclProcessGroup (dist::make_single_rank_nccl_group, no MPI): every
//     collective is an identity in every dtype it accepts, a collective starts only after the
//     work queued on the caller's stream, and a ShardedModel communicating over it trains
//     exactly like the plain model and like the same sharding over the local group.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/data/batch.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/dist/mpi.h"
#include "shardtrain/dist/nccl.h"
#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/ops/ops.h"
#include "shardtrain/optim/optimizer.h"
#ifdef SHARDTRAIN_HAVE_NCCL
#include <nccl.h>
#endif

namespace shardtrain {
namespace {

// Collectives of one rank finish in microseconds; a minute means something hangs.
constexpr double kTimeoutS = 60.0;

// The one-rank NCCL group, shared by every test that uses it.
std::unique_ptr<dist::ProcessGroup>& nccl_group_slot() {
  static std::unique_ptr<dist::ProcessGroup> group;
  return group;
}

// Destroys the group when the tests are over, inside main, while the CUDA runtime and NCCL are
// fully alive. Left to static destruction after main returns, ncclCommDestroy and
// cudaStreamDestroy would run in an unspecified order with the CUDA runtime's and NCCL's own
// teardown (the reason the backend never destroys its allocators, src/backend/cuda/register.cpp);
// a crash there fails the executable after every test passed, and a hang there runs into the
// test's ctest timeout.
class DestroyNcclGroup : public ::testing::Environment {
 public:
  void TearDown() override { nccl_group_slot().reset(); }
};
[[maybe_unused]] ::testing::Environment* const kDestroyNcclGroup =
    ::testing::AddGlobalTestEnvironment(new DestroyNcclGroup);

// The one-rank NCCL group on cuda:0 (no MPI: make_single_rank_nccl_group makes its unique id
// locally), made on first use and kept for every test; null, with the reason in `why`, in builds
// without NCCL.
dist::ProcessGroup* single_rank_nccl_group(std::string& why) {
  std::unique_ptr<dist::ProcessGroup>& group = nccl_group_slot();
  if (!dist::nccl_available()) {
    why = "this build has no NCCL (dist::nccl_available() is false)";
    return nullptr;
  }
  if (!group) group = dist::make_single_rank_nccl_group(0, kTimeoutS);
  return group.get();
}

// ---- training on one GPU, plain or sharded ------------------------------------------------

// Every parameter's size is a multiple of 64 elements, so each one starts 256-byte aligned inside
// a flat parameter, as a parameter allocated on its own does. That keeps the sharded and the plain
// model bitwise comparable: cuBLASLt picks its algorithm by the alignment it is promised, capped
// at 256 bytes (src/backend/cuda/gemm.cpp), and a different algorithm may round differently.
nn::LlamaConfig tiny() {
  nn::LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;  // k_proj and v_proj: 32 x 64
  c.max_seq_len = 16;
  c.init_std = 0.2f;
  return c;
}
constexpr int kSteps = 4;

struct Tokens {
  Tensor ids, targets;
};

// The batch of every step (random targets, one ignored): the model memorises it, so the loss
// falls from step to step.
Tokens batch_tokens() {
  constexpr int64_t kBatch = 2, kSeq = 16;
  const int64_t vocab = tiny().vocab_size;
  std::vector<int64_t> targets = testing::random_ids(kBatch * kSeq, vocab, 200);
  targets[3] = kIgnoreIndex;
  return {from_ints(testing::random_ids(kBatch * kSeq, vocab, 201), {kBatch, kSeq}, DType::I64,
                    testing::cuda0()),
          from_ints(targets, {kBatch, kSeq}, DType::I64, testing::cuda0())};
}

struct Trained {
  std::vector<uint32_t> loss_bits;  // per step, as fp32 bit patterns
  std::vector<float> losses;
  std::map<std::string, std::vector<float>> params;  // full parameters after the last step
};

std::vector<uint32_t> bits_of(const std::vector<float>& f) {
  std::vector<uint32_t> out(f.size());
  std::memcpy(out.data(), f.data(), f.size() * sizeof(float));
  return out;
}

// kSteps AdamW steps on the mean loss of the batch.
void run_steps(nn::LlamaModel& model, optim::Optimizer& optimizer, Trained& out) {
  const Tokens t = batch_tokens();
  for (int step = 0; step < kSteps; ++step) {
    optimizer.zero_grad();
    int64_t counted = 0;
    const Tensor loss = model.loss_sum(t.ids, t.targets, &counted);
    out.losses.push_back(loss.item());
    autograd::backward(ops::scale(loss, 1.0f / static_cast<float>(counted)));
    optimizer.step(1e-2f);
  }
  out.loss_bits = bits_of(out.losses);
}

Trained train_plain() {
  nn::LlamaModel model(tiny(), testing::cuda0());
  model.init_weights(5);
  std::vector<optim::NamedParam> params;
  for (auto& [name, slot] : model.named_parameters()) params.push_back({name, slot});
  optim::AdamW optimizer(params, {});
  Trained out;
  run_steps(model, optimizer, out);
  for (auto& [name, slot] : model.named_parameters()) out.params[name] = slot->to_float_vector();
  return out;
}

// The same training with the model sharded over `shard` (and its gradients all-reduced over
// `replicate` when given).
Trained train_sharded(dist::ProcessGroup& shard, dist::ProcessGroup* replicate,
                      const fsdp::FsdpOptions& options,
                      fsdp::ShardedModel::CommStats* stats = nullptr) {
  nn::LlamaModel model(tiny(), testing::cuda0());
  model.init_weights(5);
  fsdp::ShardedModel sharded(model, shard, replicate, options);
  optim::AdamW optimizer(sharded.optimizer_params(), {});
  Trained out;
  run_steps(model, optimizer, out);
  sharded.for_each_full_parameter([&](const std::string& name, const Tensor& full) {
    out.params[name] = full.to_float_vector();
  });
  if (stats != nullptr) *stats = sharded.comm_stats();
  return out;
}

void expect_same_training(const Trained& got, const Trained& want, const std::string& what) {
  EXPECT_EQ(got.loss_bits, want.loss_bits)
      << what << ": losses differ (first step " << got.losses.at(0) << " vs " << want.losses.at(0)
      << ")";
  ASSERT_EQ(got.params.size(), want.params.size()) << what;
  for (const auto& [name, w] : want.params) {
    ASSERT_EQ(got.params.count(name), 1u) << what << ": no parameter " << name;
    EXPECT_EQ(bits_of(got.params.at(name)), bits_of(w)) << what << ": parameter " << name;
  }
}

// ---- without MPI ----------------------------------------------------------------------------

TEST(DistEnvCuda, AProcessOnItsOwnIsAWorldOfOneWithoutMpi) {
  REQUIRE_CUDA();
  // Run first, MPI is not running yet; if a test that starts it ran before, DistEnv joins that
  // world of one instead, and the groups are still local.
  const bool mpi_running = dist::MpiRuntime::initialized();
  for (const char* backend : {"auto", "mpi"}) {
    SCOPED_TRACE(backend);
    dist::DistOptions options;
    options.device = testing::cuda0();
    options.backend = backend;
    dist::DistEnv env(options);
    EXPECT_EQ(env.uses_mpi(), mpi_running);
    EXPECT_EQ(env.world_size(), 1);
    EXPECT_EQ(env.world().backend_name(), "local");
  }
  dist::DistOptions nccl;
  nccl.device = testing::cuda0();
  nccl.backend = "nccl";
  if (dist::nccl_available()) {
    dist::DistEnv env(nccl);  // one rank needs no communicator at all
    EXPECT_EQ(env.world().backend_name(), "local");
  } else {
    EXPECT_THROW(dist::DistEnv{nccl}, ConfigError);
  }
  EXPECT_EQ(dist::MpiRuntime::initialized(), mpi_running) << "a world of one started MPI";
}

// One rank on the local group: a full_shard model computes from its (whole) shard without copies
// and a no_shard model from its replica, so both train bit for bit like the plain model.
TEST(ShardedModelCuda, OneRankOnTheLocalGroupTrainsLikeThePlainModel) {
  REQUIRE_CUDA();
  const Trained plain = train_plain();
  EXPECT_LT(plain.losses.back(), plain.losses.front()) << "the reference run did not train";
  dist::DistOptions options;
  options.device = testing::cuda0();
  dist::DistEnv env(options);
  for (fsdp::ShardingStrategy s :
       {fsdp::ShardingStrategy::FullShard, fsdp::ShardingStrategy::NoShard}) {
    const std::string what(fsdp::sharding_strategy_name(s));
    fsdp::FsdpOptions o;
    o.strategy = s;
    nn::LlamaModel model(tiny(), testing::cuda0());
    model.init_weights(5);
    fsdp::ShardedModel sharded(model, env, o);
    optim::AdamW optimizer(sharded.optimizer_params(), {});
    Trained got;
    run_steps(model, optimizer, got);
    sharded.for_each_full_parameter([&](const std::string& name, const Tensor& full) {
      EXPECT_EQ(full.device(), testing::cuda0()) << name;
      got.params[name] = full.to_float_vector();
    });
    expect_same_training(got, plain, what);
  }
}

#ifdef SHARDTRAIN_HAVE_NCCL
// NCCL itself on this GPU, without MPI: a one-rank communicator, an all-reduce and an all-gather
// that must copy their input exactly. When this passes and the NcclGroup tests fail, the fault is
// this project's; when it fails, NCCL cannot run here at all (NCCL_DEBUG=INFO says why).
TEST(NcclLibrary, OneRankCommunicatorWorksWithoutMpi) {
  REQUIRE_CUDA();
  int version = 0;
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  ncclComm_t comm = nullptr;
  int devices[1] = {0};
  const ncclResult_t init = ncclCommInitAll(&comm, 1, devices);
  ASSERT_EQ(init, ncclSuccess) << "ncclCommInitAll: " << ncclGetErrorString(init) << " (NCCL "
                               << version << ")";
  struct Destroy {
    ncclComm_t c;
    ~Destroy() { ncclCommDestroy(c); }
  } destroy{comm};

  const int64_t n = 4099;
  const Tensor in = testing::random_cpu({n}, DType::F32, 3).to(testing::cuda0());
  Tensor reduced = full({n}, -1.0f, DType::F32, testing::cuda0());
  Tensor gathered = full({n}, -1.0f, DType::F32, testing::cuda0());
  testing::gpu().synchronize();  // the fills ran on this thread's stream, not on `stream`
  cuda::Stream stream(0);
  const auto s = static_cast<cudaStream_t>(stream.handle());
  ASSERT_EQ(ncclAllReduce(in.data_ptr(), reduced.data_ptr(), static_cast<size_t>(n), ncclFloat32,
                          ncclSum, comm, s),
            ncclSuccess);
  ASSERT_EQ(ncclAllGather(in.data_ptr(), gathered.data_ptr(), static_cast<size_t>(n), ncclFloat32,
                          comm, s),
            ncclSuccess);
  stream.synchronize();
  testing::expect_bitwise_equal(reduced, in, "ncclAllReduce over one rank");
  testing::expect_bitwise_equal(gathered, in, "ncclAllGather over one rank");
}
#endif

// ---- the NCCL process group -----------------------------------------------------

class NcclGroup : public ::testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_CUDA();
    std::string why;
    group_ = single_rank_nccl_group(why);
    if (group_ == nullptr) GTEST_SKIP() << "no NCCL process group: " << why;
    ASSERT_EQ(group_->size(), 1);
    ASSERT_EQ(group_->rank(), 0);
    ASSERT_EQ(group_->backend_name(), "nccl");
  }
  dist::ProcessGroup& group() { return *group_; }

 private:
  dist::ProcessGroup* group_ = nullptr;
};

// n values of `dtype` on the GPU: normal numbers for floating types, signed integers otherwise
// (0..255 for U8).
Tensor values_of(DType dtype, int64_t n, uint64_t seed) {
  if (is_floating(dtype)) return testing::random_cpu({n}, dtype, seed).to(testing::cuda0());
  std::vector<int64_t> v = testing::random_ids(n, 256, seed);
  if (dtype != DType::U8)
    for (size_t i = 0; i < v.size(); i += 2) v[i] = -v[i] * 1000003;
  return from_ints(v, {n}, dtype, testing::cuda0());
}

// A tensor whose every element differs from what values_of gives, so that a collective that
// copies too few bytes (a wrong NCCL data type) leaves it visible.
Tensor sentinel(DType dtype, int64_t n) {
  if (is_floating(dtype)) return full({n}, 1e4f, dtype, testing::cuda0());
  return from_ints(std::vector<int64_t>(static_cast<size_t>(n), dtype == DType::U8 ? 0 : 7777777),
                   {n}, dtype, testing::cuda0());
}

TEST_F(NcclGroup, OneRankCollectivesAreIdentitiesInEveryDtype) {
  const int64_t n = 1027;  // odd: no vector width divides it
  for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8}) {
    const std::string what(dtype_name(dtype));
    SCOPED_TRACE(what);
    const Tensor in = values_of(dtype, n, 40 + static_cast<uint64_t>(dtype));
    // Gathers and broadcasts move any dtype.
    Tensor gathered = sentinel(dtype, n);
    group().all_gather(in, gathered)->wait();
    EXPECT_EQ(gathered.dtype(), dtype);
    testing::expect_bitwise_equal(gathered, in, what + " all_gather");
    Tensor broadcast = in.clone();
    group().broadcast(broadcast, 0)->wait();
    testing::expect_bitwise_equal(broadcast, in, what + " broadcast");
    if (dtype == DType::U8) {
      Tensor t = in.clone();
      EXPECT_THROW(group().all_reduce(t, dist::ReduceOp::Sum), ShapeError) << "u8 is not reduced";
      continue;
    }
    // Reductions over one rank: the sum and the max of one value are that value, in its dtype.
    for (dist::ReduceOp op : {dist::ReduceOp::Sum, dist::ReduceOp::Max}) {
      Tensor t = in.clone();
      group().all_reduce(t, op)->wait();
      EXPECT_EQ(t.dtype(), dtype);
      testing::expect_bitwise_equal(t, in,
                                    what + " all_reduce " + std::string(dist::reduce_op_name(op)));
    }
    Tensor scattered = sentinel(dtype, n);
    group().reduce_scatter(in, scattered)->wait();
    testing::expect_bitwise_equal(scattered, in, what + " reduce_scatter");
  }
}

// The collective runs on the group's own stream, after an event recorded on the caller's stream:
// it must see an input that a kernel queued behind some 50 ms of matrix products has yet to
// write. (Without that wait it would copy the old values at once.)
TEST_F(NcclGroup, CollectivesStartAfterTheWorkQueuedOnTheCallersStream) {
  Generator gen(9);
  const Tensor a = randn({4096, 4096}, gen, 1.0f, DType::F32, testing::cuda0());
  const int64_t n = int64_t{1} << 22;
  Tensor in = full({n}, -1.0f, DType::F32, testing::cuda0());
  Tensor out = full({n}, -2.0f, DType::F32, testing::cuda0());
  {
    autograd::NoGrad no_grad;
    Tensor busy = ops::linear(a, a);  // cuBLASLt set-up, outside the measured part
    testing::gpu().synchronize();
    for (int i = 0; i < 20; ++i) busy = ops::linear(a, a);  // ~2.7 ms each on an H100
  }
  testing::gpu().fill(in, 3.0f);
  dist::WorkPtr work = group().all_gather(in, out);
  work->wait();
  EXPECT_TRUE(work->is_completed());
  testing::expect_bitwise_equal(out, full({n}, 3.0f, DType::F32, Device::cpu()),
                                "all_gather of a tensor filled by queued work");
}

TEST_F(NcclGroup, RejectsTensorsItCannotCommunicate) {
  Tensor on_cpu = zeros({8});
  EXPECT_THROW(group().all_reduce(on_cpu, dist::ReduceOp::Sum), ShapeError);
  const Tensor in = zeros({8}, DType::F32, testing::cuda0());
  Tensor too_small = zeros({4}, DType::F32, testing::cuda0());
  EXPECT_THROW(group().all_gather(in, too_small), ShapeError);
  Tensor other_dtype = zeros({8}, DType::BF16, testing::cuda0());
  EXPECT_THROW(group().all_gather(in, other_dtype), ShapeError);
}

// Gradients all-reduced over NCCL (the group as the replica group of a one-rank shard): the sum
// over one rank changes nothing, so training is bit for bit the plain model's. Each backward
// all-reduces one flat gradient per unit (2 layers and the root).
TEST_F(NcclGroup, ShardedTrainingWithGradientsAllReducedOverNcclMatchesThePlainModel) {
  const Trained plain = train_plain();
  dist::LocalProcessGroup local;
  fsdp::FsdpOptions o;
  fsdp::ShardedModel::CommStats stats;
  const Trained sharded = train_sharded(local, &group(), o, &stats);
  expect_same_training(sharded, plain, "gradients all-reduced over NCCL");
  EXPECT_EQ(stats.all_reduces, (tiny().num_layers + 1) * kSteps);
}

// Parameters gathered over NCCL in bf16 (a one-rank shard group with param_dtype bf16 is not
// zero-copy: every unit's forward all-gathers a bf16 copy of its shard) train bit for bit as the
// same sharding over the local group, whose gather is a plain device copy.
TEST_F(NcclGroup, Bf16ParameterGathersOverNcclMatchTheLocalGroup) {
  fsdp::FsdpOptions o;
  o.param_dtype = DType::BF16;
  dist::LocalProcessGroup local;
  const Trained over_local = train_sharded(local, nullptr, o);
  const Trained over_nccl = train_sharded(group(), nullptr, o);
  expect_same_training(over_nccl, over_local, "bf16 gathers over NCCL");
  // The gathers really were bf16: the losses are not those of fp32 parameters.
  const Trained plain = train_plain();
  EXPECT_NE(over_nccl.loss_bits.at(0), plain.loss_bits.at(0));
  EXPECT_NEAR(over_nccl.losses.at(0), plain.losses.at(0), 2e-2 * std::fabs(plain.losses.at(0)));
}

}  // namespace
}  // namespace shardtrain
