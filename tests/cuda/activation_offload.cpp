// Activation offload with copies that overlap compute: on a GPU, gradients bit for bit those of no
// offload and of synchronous copies, the memory ledger figures of synchronous copies, and neither
// pack nor unpack waiting for the compute stream; on the CPU device, synchronous copies whatever
// is asked for.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "model_step.h"
#include "shardtrain/activation/counters.h"
#include "shardtrain/activation/offload.h"
#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/autograd/saved_tensor.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/ops/ops.h"
#ifdef SHARDTRAIN_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace shardtrain {
namespace {

using activation::OffloadCopies;
using activation::OffloadHooks;

const char* name(OffloadCopies copies) {
  return copies == OffloadCopies::Overlapped ? "overlapped" : "synchronous";
}

int64_t offloaded_in_use() {
  return allocator_for(Device::host()).stats().in_use_of(MemoryCategory::Offloaded);
}

// Packs `x` under `hooks` as an op saving it would.
std::unique_ptr<autograd::SavedTensor> save(OffloadHooks& hooks, const Tensor& x) {
  autograd::SavedTensorHooksScope scope = hooks.scope();
  return std::make_unique<autograd::SavedTensor>(x);
}

// Runs everywhere: the CPU device has no streams, so both modes copy synchronously and the host
// copy is freed as soon as the copy back has been made.
TEST(ActivationOffload, CpuDeviceCopiesSynchronouslyInEitherMode) {
  const Tensor x = testing::random_cpu({64, 100}, DType::F32, 5);
  const int64_t bytes = static_cast<int64_t>(x.nbytes());  // 25600, a multiple of 64
  for (OffloadCopies copies : {OffloadCopies::Overlapped, OffloadCopies::Synchronous}) {
    SCOPED_TRACE(name(copies));
    const int64_t before = offloaded_in_use();
    activation::reset_activation_counters();
    OffloadHooks hooks(0, copies);
    EXPECT_EQ(hooks.copies(), copies);
    std::unique_ptr<autograd::SavedTensor> saved = save(hooks, x);
    EXPECT_EQ(offloaded_in_use() - before, bytes);
    const Tensor got = saved->unpack();
    EXPECT_EQ(offloaded_in_use() - before, 0);
    EXPECT_EQ(got.device(), Device::cpu());
    EXPECT_FALSE(got.is_same(x));
    testing::expect_bitwise_equal(got, x, "restored tensor");
    const activation::ActivationCounters c = activation::activation_counters();
    EXPECT_EQ(c.bytes_offloaded, bytes);
    EXPECT_EQ(c.bytes_restored, bytes);
    EXPECT_GT(c.copy_seconds, 0.0);
    EXPECT_GE(c.transfer_seconds, c.copy_seconds) << "a synchronous copy is part of the host time";
  }
}

#ifdef SHARDTRAIN_HAVE_CUDA

TEST(ActivationOffloadCuda, HostPoolIsPageLocked) {
  REQUIRE_CUDA();
  const Tensor h = empty({1024}, DType::F32, Device::host());
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, h.data_ptr()), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost) << "copies from pageable memory would not overlap";
}

// Queues `n` products of `a` (4096 x 4096 fp32: some 2 ms of GPU work each) with itself on the
// current stream, returning as soon as they are queued.
Tensor queue_busy_work(const Tensor& a, int n) {
  autograd::NoGrad no_grad;
  Tensor out;
  for (int i = 0; i < n; ++i) out = ops::linear(a, a);
  return out;
}

// Pack and unpack return while the compute stream is still busy (synchronous copies wait for
// it), and the data survive the source's memory being reused and the destination's memory
// having been used by queued compute.
TEST(ActivationOffloadCuda, PackAndUnpackDoNotWaitForCompute) {
  REQUIRE_CUDA();
  const Device gpu = testing::cuda0();
  cuda::Stream compute(0);
  cuda::StreamGuard on_compute(compute.view());
  const Shape shape{2048, 4096};  // 32 MiB
  const Tensor want = testing::random_cpu(shape, DType::F32, 21);
  const int64_t bytes = static_cast<int64_t>(want.nbytes());
  Generator gen(11);
  const Tensor a = randn({4096, 4096}, gen, 1.0f, DType::F32, gpu);
  queue_busy_work(a, 1);  // cuBLAS set-up, outside what is measured
  { const Tensor warm = empty(shape, DType::F32, Device::host()); }  // a cached pinned block
  compute.synchronize();

  for (OffloadCopies copies : {OffloadCopies::Overlapped, OffloadCopies::Synchronous}) {
    SCOPED_TRACE(name(copies));
    const int64_t before = offloaded_in_use();
    activation::reset_activation_counters();
    OffloadHooks hooks(0, copies);
    Tensor x = want.to(gpu);
    Tensor busy = queue_busy_work(a, 40);
    std::unique_ptr<autograd::SavedTensor> saved = save(hooks, x);
    const bool pack_waited = compute.view().query();
    // x's block goes back to the compute stream's cache; the next tensor of its size would get
    // it and overwrite it while the copy to the host may still be waiting for `busy`.
    x = Tensor();
    Tensor clobber = empty(shape, DType::F32, gpu);
    testing::gpu().fill(clobber, -1.0f);
    clobber = Tensor();
    busy = queue_busy_work(a, 40);  // frees the first batch's output on the compute stream
    const Tensor got = saved->unpack();
    const bool unpack_waited = compute.view().query();
    if (copies == OffloadCopies::Overlapped) {
      EXPECT_FALSE(pack_waited) << "pack waited for the compute stream";
      EXPECT_FALSE(unpack_waited) << "unpack waited for the compute stream";
    } else {
      EXPECT_TRUE(pack_waited);
      EXPECT_TRUE(unpack_waited);
    }
    EXPECT_EQ(got.device(), gpu);
    testing::expect_bitwise_equal(got, want, "restored tensor");  // reads on the compute stream
    EXPECT_EQ(offloaded_in_use() - before, copies == OffloadCopies::Overlapped ? bytes : 0)
        << "an overlapped copy back keeps the host copy until it is seen finished";
    saved.reset();  // the last offloaded tensor: every host copy goes
    EXPECT_EQ(offloaded_in_use() - before, 0);
    const activation::ActivationCounters c = activation::activation_counters();
    EXPECT_EQ(c.bytes_offloaded, bytes);
    EXPECT_EQ(c.bytes_restored, bytes);
    // Both copies are counted. Overlapped copies are timed on their stream, so the time is the
    // copies' alone: waiting for `busy` (tens of milliseconds) would bring the rate far below
    // any host link's. A synchronous copy's wall time includes that wait.
    ASSERT_GT(c.copy_seconds, 0.0);
    if (copies == OffloadCopies::Overlapped) {
      EXPECT_GT(2.0 * static_cast<double>(bytes) / c.copy_seconds, 2e9)
          << "copy_seconds " << c.copy_seconds;
    }
  }
}

// ---- a model --------------------------------------------------------------------------------

nn::LlamaConfig model_config() {
  nn::LlamaConfig c;
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.num_layers = 4;
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.max_seq_len = 512;
  return c;
}
constexpr int64_t kBatch = 2, kSeq = 512;  // plain attention probabilities: 16 MiB per layer

std::unique_ptr<nn::LlamaModel> make_model(const std::shared_ptr<OffloadHooks>& hooks) {
  auto model = std::make_unique<nn::LlamaModel>(model_config(), testing::cuda0());
  model->init_weights(1234);
  model->set_attention_impl(ops::AttentionImpl::Plain);
  if (hooks) {
    // What apply_activation_strategy does for "offload", with the copy mode chosen here.
    model->add_layer_wrapper([hooks](int, const nn::TensorFn& inner, const Tensor& x) {
      autograd::SavedTensorHooksScope scope = hooks->scope();
      return inner(x);
    });
  }
  return model;
}

struct Batch {
  Tensor ids, targets;
};

Batch make_batch() {
  const int64_t n = kBatch * kSeq;
  const int64_t vocab = model_config().vocab_size;
  return {
      from_ints(testing::random_ids(n, vocab, 3), {kBatch, kSeq}, DType::I64, testing::cuda0()),
      from_ints(testing::random_ids(n, vocab, 4), {kBatch, kSeq}, DType::I64, testing::cuda0())};
}

struct StepFigures : testing::LossAndGradients {
  int64_t activations_after_forward = 0;  // device
  int64_t activations_peak = 0;
  int64_t offloaded_after_forward = 0;  // host pool
  int64_t offloaded_peak = 0;
  int64_t offloaded_after_backward = 0;
  activation::ActivationCounters counters;
};

StepFigures run_step(nn::LlamaModel& model, const Batch& batch) {
  testing::clear_gradients(model);
  activation::reset_activation_counters();
  Allocator& device = allocator_for(testing::cuda0());
  Allocator& host = allocator_for(Device::host());
  device.reset_peak();
  host.reset_peak();
  StepFigures f;
  {
    // No host synchronisation between forward and backward: the copies race compute for real.
    const Tensor loss = model.loss_sum(batch.ids, batch.targets);
    f.activations_after_forward = device.stats().in_use_of(MemoryCategory::Activations);
    f.offloaded_after_forward = host.stats().in_use_of(MemoryCategory::Offloaded);
    autograd::backward(loss);
    f.loss = loss.item();
  }
  f.activations_peak = device.stats().peak_of(MemoryCategory::Activations);
  f.offloaded_peak = host.stats().peak_of(MemoryCategory::Offloaded);
  f.offloaded_after_backward = host.stats().in_use_of(MemoryCategory::Offloaded);
  f.counters = activation::activation_counters();
  f.grads = testing::gradients_of(model);
  return f;
}

void expect_same_gradients(const StepFigures& got, const StepFigures& want,
                           const std::string& what) {
  testing::expect_bitwise_equal_step(got, want, what, "no offload");
}

TEST(ActivationOffloadCuda, LlamaStepMatchesNoOffloadAndSynchronousCopies) {
  REQUIRE_CUDA();
  const Batch batch = make_batch();
  auto plain = make_model(nullptr);
  const StepFigures none = run_step(*plain, batch);
  plain.reset();

  auto sync_model = make_model(std::make_shared<OffloadHooks>(0, OffloadCopies::Synchronous));
  const StepFigures sync = run_step(*sync_model, batch);
  sync_model.reset();

  auto model = make_model(std::make_shared<OffloadHooks>(0, OffloadCopies::Overlapped));
  const StepFigures first = run_step(*model, batch);
  // Again, now from the allocators' cached blocks, where a missing wait would read stale data.
  const StepFigures second = run_step(*model, batch);

  expect_same_gradients(sync, none, "synchronous");
  expect_same_gradients(first, none, "overlapped");
  expect_same_gradients(second, none, "overlapped, second step");

  for (const StepFigures* f : {&first, &second}) {
    // Device: the same allocations and frees at the same points as synchronous copies.
    EXPECT_EQ(f->activations_after_forward, sync.activations_after_forward);
    EXPECT_EQ(f->activations_peak, sync.activations_peak);
    EXPECT_LT(f->activations_peak, none.activations_peak);
    // Host pool: the same peak; nothing left once backward has released everything.
    EXPECT_GT(f->offloaded_after_forward, 0);
    EXPECT_EQ(f->offloaded_after_forward, sync.offloaded_after_forward);
    EXPECT_EQ(f->offloaded_peak, sync.offloaded_peak);
    EXPECT_EQ(f->offloaded_peak, f->offloaded_after_forward);
    EXPECT_EQ(f->offloaded_after_backward, 0);
    EXPECT_EQ(sync.offloaded_after_backward, 0);
    EXPECT_EQ(f->counters.bytes_offloaded, sync.counters.bytes_offloaded);
    EXPECT_EQ(f->counters.bytes_restored, f->counters.bytes_offloaded);
    EXPECT_GT(f->counters.copy_seconds, 0.0);
  }
  EXPECT_EQ(none.offloaded_peak, 0);
}

// A graph dropped after forward: every host copy is freed (after its copy finished), device
// memory reads as before, and the next step is still exact.
TEST(ActivationOffloadCuda, DroppedGraphFreesEveryCopy) {
  REQUIRE_CUDA();
  const Batch batch = make_batch();
  auto plain = make_model(nullptr);
  const StepFigures none = run_step(*plain, batch);
  plain.reset();

  auto model = make_model(std::make_shared<OffloadHooks>());
  Allocator& device = allocator_for(testing::cuda0());
  const int64_t activations_before = device.stats().in_use_of(MemoryCategory::Activations);
  const int64_t offloaded_before = offloaded_in_use();
  {
    const Tensor loss = model->loss_sum(batch.ids, batch.targets);
    EXPECT_GT(offloaded_in_use(), offloaded_before);
  }
  EXPECT_EQ(offloaded_in_use(), offloaded_before);
  EXPECT_EQ(device.stats().in_use_of(MemoryCategory::Activations), activations_before);
  expect_same_gradients(run_step(*model, batch), none, "after a dropped graph");
}

#endif  // SHARDTRAIN_HAVE_CUDA

}  // namespace
}  // namespace shardtrain
