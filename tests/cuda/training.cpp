// Whole training on a GPU against the CPU device: the same model, initialisation and batches give
// the same losses step after step, in fp32 and under bf16 autocast; every activation strategy
// gives bit for bit the gradients of none; fused attention agrees with plain attention; and the
// device memory ledger reads as it does on the CPU device and as the activation formulas predict.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "model_step.h"
#include "shardtrain/activation/counters.h"
#include "shardtrain/activation/estimate.h"
#include "shardtrain/activation/strategy.h"
#include "shardtrain/amp/mixed_precision.h"
#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/train/runtime.h"
#include "strategy_memory.h"

namespace shardtrain {
namespace {

using activation::ActivationEstimate;
using activation::ActivationModelShape;

// ---- training runs through the Runtime ---------------------------------------------------

// A 2-layer Llama with grouped-query heads, 10 steps of 8 sequences of 32 tokens in two
// micro-batches (so gradient accumulation runs too). At lr 3e-3 the loss falls from ln(256) = 5.55
// to about 4.85 over the 10 steps: the runs really train.
constexpr const char* kRunYaml = R"(
model:
  vocab_size: 256
  hidden_size: 64
  intermediate_size: 128
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
  max_seq_len: 32
train:
  seq_len: 32
  micro_batch: 4
  global_batch: 8
  seed: 11
  progress: none
)";
constexpr int kSteps = 10;
constexpr float kLr = 3e-3f;

// Step `step`'s global batch: arithmetic token sequences (learnable: the next token follows from
// the last two) with a start drawn per sequence, every 11th target ignored; two micro-batches.
std::vector<Batch> step_batches(int step) {
  constexpr int64_t kSequences = 8, kSeq = 32;
  Generator gen(1000 + static_cast<uint64_t>(step));
  std::vector<float> u(kSequences);
  gen.uniform(u.data(), kSequences);
  std::vector<int64_t> ids, targets;
  for (int64_t b = 0; b < kSequences; ++b) {
    const int64_t start = static_cast<int64_t>(u[static_cast<size_t>(b)] * 200.0f);
    const int64_t stride = 1 + b % 3;
    for (int64_t t = 0; t <= kSeq; ++t) {
      const int64_t token = (start + stride * t) % 256;
      if (t < kSeq) ids.push_back(token);
      if (t > 0) targets.push_back(t % 11 == 3 ? kIgnoreIndex : token);
    }
  }
  Batch full;
  full.input_ids = from_ints(ids, {kSequences, kSeq});
  full.targets = from_ints(targets, {kSequences, kSeq});
  full.num_target_tokens = count_target_tokens(full.targets);
  return split_batch(full, 2);
}

struct RunLog {
  std::vector<double> loss, grad_norm;
};

RunLog train_run(const std::string& device, const std::string& compute) {
  const train::Config config = train::Config::parse(
      kRunYaml, {"train.device=" + device, "precision.compute=" + compute}, "training test");
  train::Runtime runtime(config);
  RunLog log;
  for (int step = 0; step < kSteps; ++step) {
    const train::StepResult r = runtime.train_step(step_batches(step), kLr);
    EXPECT_FALSE(r.skipped) << device << " " << compute << " step " << step;
    log.loss.push_back(r.loss);
    log.grad_norm.push_back(r.grad_norm);
  }
  return log;
}

double relative(double got, double want) {
  return std::fabs(got - want) / std::fabs(want);
}

// Tolerance, fp32: both devices compute every op in fp32 and differ only in summation order
// (cuBLASLt's tiling against OpenBLAS's, the CUDA kernels' block reductions against the CPU
// loops), a few ulps (~1e-7 relative) per op. src/backend/cuda/gemm.cpp asks cuBLASLt for
// CUBLAS_COMPUTE_32F, which keeps fp32 inputs in full fp32: TF32 is not used and cannot be
// here, since its 10-bit mantissa rounds every operand by up to 2^-11 (~5e-4 relative). On the
// CPU, moving every weight by about 4 ulps (either way, at random) before each of these 10 steps
// changes the losses by at most 2e-7 and the gradient norms by at most 3e-6 (relative); 1e-4 for
// the losses and 1e-3 for the gradient norms leave a wide margin for the GPU's rounding
// differences, while a real error (a wrong kernel, TF32) lands far outside them.
TEST(TrainingCuda, Fp32LossesMatchTheCpuDeviceStepByStep) {
  REQUIRE_CUDA();
  const RunLog cpu = train_run("cpu", "fp32");
  const RunLog gpu = train_run("cuda", "fp32");
  ASSERT_EQ(gpu.loss.size(), cpu.loss.size());
  EXPECT_LT(cpu.loss.back(), cpu.loss.front() - 0.3) << "the reference run did not train";
  for (size_t s = 0; s < cpu.loss.size(); ++s) {
    EXPECT_LE(relative(gpu.loss[s], cpu.loss[s]), 1e-4)
        << "step " << s << ": loss " << gpu.loss[s] << " on cuda, " << cpu.loss[s] << " on cpu";
    EXPECT_LE(relative(gpu.grad_norm[s], cpu.grad_norm[s]), 1e-3)
        << "step " << s << ": grad norm " << gpu.grad_norm[s] << " on cuda, " << cpu.grad_norm[s]
        << " on cpu";
  }
}

// Tolerance, bf16 autocast: both devices round the same tensors to bf16 (ops output the dtype of
// their inputs, math inside each kernel is fp32, one rounding per output), so they differ only
// where a value's fp32 summation-order difference moves it across a bf16 rounding boundary: one
// bf16 ulp (2^-8 relative) on a small fraction of the elements. That is a perturbation of the
// same kind as, and much smaller than, moving 2% of the weights by a whole bf16 ulp before every
// step, which on the CPU changes these losses by at most 3e-4 relative over the 10 steps. 5e-3 is
// an order of magnitude above that, and still ten times tighter than the golden check's bf16
// tolerance against fp32 (5e-2).
TEST(TrainingCuda, Bf16AutocastLossesMatchTheCpuDevice) {
  REQUIRE_CUDA();
  const RunLog cpu = train_run("cpu", "bf16");
  const RunLog gpu = train_run("cuda", "bf16");
  ASSERT_EQ(gpu.loss.size(), cpu.loss.size());
  EXPECT_LT(cpu.loss.back(), cpu.loss.front() - 0.3) << "the reference run did not train";
  for (size_t s = 0; s < cpu.loss.size(); ++s)
    EXPECT_LE(relative(gpu.loss[s], cpu.loss[s]), 5e-3)
        << "step " << s << ": loss " << gpu.loss[s] << " on cuda, " << cpu.loss[s] << " on cpu";
}

// ---- one step of a model under each activation strategy ------------------------------------

// Head dim 64 and sequences of whole 64-row tiles: under bf16 the fused attention runs on tensor
// cores (kernels/flash_attention.cu); three layers make two sqrt_segment segments.
nn::LlamaConfig tensor_core_config() {
  nn::LlamaConfig c;
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = 128;
  return c;
}
constexpr int64_t kTcBatch = 2, kTcSeq = 128;

struct Tokens {
  Tensor ids, targets;
};

// Random ids and targets (every 17th target ignored) on `device`.
Tokens make_tokens(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed, Device device) {
  const int64_t n = batch * seq;
  std::vector<int64_t> ids = testing::random_ids(n, vocab, seed);
  std::vector<int64_t> targets = testing::random_ids(n, vocab, seed + 1);
  for (int64_t i = 5; i < n; i += 17) targets[static_cast<size_t>(i)] = kIgnoreIndex;
  return {from_ints(ids, {batch, seq}, DType::I64, device),
          from_ints(targets, {batch, seq}, DType::I64, device)};
}

struct ModelOptions {
  nn::LlamaConfig config;
  Device device;
  ops::AttentionImpl attention = ops::AttentionImpl::Plain;
  std::string strategy = "none";
  bool reentrant = false;
  DType compute = DType::F32;
  AttentionBackwardAlgo attention_backward = AttentionBackwardAlgo::Deterministic;
};

// Built as the Runtime builds it: strategy wrappers first, mixed precision innermost.
std::unique_ptr<nn::LlamaModel> make_model(const ModelOptions& o) {
  auto model = std::make_unique<nn::LlamaModel>(o.config, o.device);
  model->init_weights(1234);
  model->set_attention_impl(o.attention, o.attention_backward);
  activation::ActivationOptions act;
  act.strategy = o.strategy;
  act.reentrant = o.reentrant;
  activation::apply_activation_strategy(*model, act);
  if (o.compute != DType::F32) amp::install_mixed_precision(*model, {o.compute, DType::F32});
  return model;
}

struct StepFigures : testing::LossAndGradients {
  int64_t baseline = 0;       // device activations before the forward (ids, targets)
  int64_t after_forward = 0;  // device activations when loss_sum returned
  int64_t forward_peak = 0;
  int64_t peak = 0;                // device activation peak over forward and backward
  int64_t host_after_forward = 0;  // host pool Offloaded bytes added by the forward
  int64_t host_after_backward = 0;
  activation::ActivationCounters counters;
};

// Forward and backward of the summed loss, measured as tests/unit/test_activation.cpp does.
StepFigures run_step(nn::LlamaModel& model, const Tokens& batch) {
  testing::clear_gradients(model);
  activation::reset_activation_counters();
  Allocator& dev = allocator_for(model.device());
  Allocator& host = allocator_for(Device::host());
  StepFigures f;
  const int64_t host_before = host.stats().in_use_of(MemoryCategory::Offloaded);
  dev.reset_peak();
  host.reset_peak();
  f.baseline = dev.stats().in_use_of(MemoryCategory::Activations);
  {
    const Tensor loss = model.loss_sum(batch.ids, batch.targets);
    f.after_forward = dev.stats().in_use_of(MemoryCategory::Activations);
    f.forward_peak = dev.stats().peak_of(MemoryCategory::Activations);
    f.host_after_forward = host.stats().in_use_of(MemoryCategory::Offloaded) - host_before;
    f.loss = loss.item();
    autograd::backward(loss);
  }
  f.peak = dev.stats().peak_of(MemoryCategory::Activations);
  f.host_after_backward = host.stats().in_use_of(MemoryCategory::Offloaded) - host_before;
  f.counters = activation::activation_counters();
  f.grads = testing::gradients_of(model);
  return f;
}

void expect_bitwise_equal(const StepFigures& got, const StepFigures& want,
                          const std::string& what) {
  testing::expect_bitwise_equal_step(got, want, what, "strategy none");
}

class StrategyCudaTest : public ::testing::TestWithParam<ops::AttentionImpl> {};

// Gradients: a strategy re-runs a region's forward (or copies its saved tensors to the host pool
// and back) and must give the gradients of none bit for bit. On the GPU that holds because
// recomputation repeats the same kernels on the same shapes: cuBLASLt runs the algorithm cached
// for the problem (src/backend/cuda/gemm.cpp keys its plans by shapes, dtypes and operand
// alignment, and every block of the caching allocator is 512-byte aligned, so a re-run tensor has
// the alignment of the first one), and a given cuBLAS algorithm is bitwise reproducible on one
// GPU; every kernel of kernels/ is deterministic (no atomics; fixed reduction trees).
//
// Memory: the ledger of every allocator, the CUDA caching allocator included, counts the bytes
// requested rounded up to 64 (memory/allocator.cpp), not the caching allocator's 512-byte block
// classes or 2 MiB segments, which appear only in MemoryStats::reserved. The same allocations at
// the same points therefore read the same on the GPU as on the CPU device, and the CPU test's
// comparison with the formulas carries over with its 5% tolerance. The CUDA backend's own
// temporaries (converted operands, reduction scratch, the cuBLASLt workspace) are Workspace, not
// Activations.
TEST_P(StrategyCudaTest, GradientsAreThoseOfNoneAndMemoryReadsAsOnTheCpu) {
  REQUIRE_CUDA();
  const ops::AttentionImpl impl = GetParam();
  // The model of the CPU strategy tests: head dim 8, so fused attention runs the exact fp32
  // CUDA-core kernels.
  const nn::LlamaConfig c = testing::memory_config();
  const int64_t batch = testing::kMemoryBatch, seq = testing::kMemorySeq;
  const Tokens gpu_batch = make_tokens(batch, seq, c.vocab_size, 99, testing::cuda0());
  const Tokens cpu_batch = make_tokens(batch, seq, c.vocab_size, 99, Device::cpu());
  const ActivationModelShape shape = testing::shape_of(c, batch, seq, impl);
  const int64_t L = c.num_layers;

  auto none_model = make_model({c, testing::cuda0(), impl});
  const StepFigures none = run_step(*none_model, gpu_batch);
  none_model.reset();
  const StepFigures none_cpu = run_step(*make_model({c, Device::cpu(), impl}), cpu_batch);
  EXPECT_EQ(none.after_forward, none_cpu.after_forward);
  EXPECT_EQ(none.forward_peak, none_cpu.forward_peak);
  EXPECT_EQ(none.peak, none_cpu.peak);
  testing::expect_none_as_estimated(none, shape);

  std::map<std::string, int64_t> peaks{{"none", none.peak}};
  for (const testing::StrategyVariant& v : testing::strategy_variants()) {
    SCOPED_TRACE(v.name());
    auto model = make_model({c, testing::cuda0(), impl, v.strategy, v.reentrant});
    const StepFigures r = run_step(*model, gpu_batch);
    model.reset();
    expect_bitwise_equal(r, none, v.name());
    EXPECT_EQ(r.counters.forward_reruns, testing::rerun_regions(v.strategy, L));

    // The CPU device, same model and batch: the same figures to the byte.
    const StepFigures on_cpu =
        run_step(*make_model({c, Device::cpu(), impl, v.strategy, v.reentrant}), cpu_batch);
    EXPECT_EQ(r.baseline, on_cpu.baseline);
    EXPECT_EQ(r.after_forward, on_cpu.after_forward);
    EXPECT_EQ(r.forward_peak, on_cpu.forward_peak);
    EXPECT_EQ(r.peak, on_cpu.peak);
    EXPECT_EQ(r.host_after_forward, on_cpu.host_after_forward);
    EXPECT_EQ(r.counters.bytes_offloaded, on_cpu.counters.bytes_offloaded);
    EXPECT_EQ(r.counters.bytes_restored, r.counters.bytes_offloaded);

    // The formulas, with the CPU test's tolerance.
    testing::expect_as_estimated(r, v, shape);
    if (!v.reentrant) peaks[v.strategy] = r.peak;
  }

  // What each strategy buys (the order the CPU test finds).
  testing::expect_strategy_peak_order(peaks);
}

INSTANTIATE_TEST_SUITE_P(Attention, StrategyCudaTest,
                         ::testing::Values(ops::AttentionImpl::Plain, ops::AttentionImpl::Fused),
                         [](const auto& info) {
                           return info.param == ops::AttentionImpl::Plain ? "plain" : "fused";
                         });

// Under bf16 autocast with the tensor-core attention kernels, recomputation (which repeats the
// parameter casts as well) still gives the gradients of none bit for bit.
TEST(StrategyCuda, Bf16TensorCoreAttentionGradientsAreThoseOfNone) {
  REQUIRE_CUDA();
  const nn::LlamaConfig c = tensor_core_config();
  const Tokens batch = make_tokens(kTcBatch, kTcSeq, c.vocab_size, 7, testing::cuda0());
  ModelOptions base{c, testing::cuda0(), ops::AttentionImpl::Fused};
  base.compute = DType::BF16;
  const StepFigures none = run_step(*make_model(base), batch);
  for (const testing::StrategyVariant& v : testing::strategy_variants()) {
    SCOPED_TRACE(v.name());
    ModelOptions o = base;
    o.strategy = v.strategy;
    o.reentrant = v.reentrant;
    const StepFigures r = run_step(*make_model(o), batch);
    expect_bitwise_equal(r, none, v.name() + " bf16 fused");
    EXPECT_EQ(r.host_after_backward, 0);
  }
}

// ||got - want|| / ||want|| over one tensor.
double relative_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    err += d * d;
    ref += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(err / ref);
}

// Fused attention against plain attention on the whole model.
//
// fp32: the fused CUDA-core kernels are exact fp32 and differ from scores -> softmax -> product
// only in summation order and in exp2f with a pre-scaled exponent against expf, a few ulps per
// element; a gradient passes through some twenty ops of three layers. 1e-3 of each tensor's
// largest element is ten times the op-level bound of tests/cuda/attention.cpp (1e-4).
//
// bf16: both runs round the same tensors to bf16 except inside attention, where plain attention
// rounds the scores and the probabilities (bf16 tensors) and the fused kernel keeps the scores in
// fp32 and rounds the probabilities once for the tensor-core product: one bf16 rounding (2^-9
// relative) apart on a part of the computation. Each parameter's gradient within 5e-2 in
// relative L2, the golden check's bf16 bound (about 8 bf16 ulps), covers that with room (the CPU
// backend's fused and plain attention differ by at most 1.3e-2 here). The summed losses agree
// far better (to 1e-5 relative on the CPU): 1e-5 for fp32 and 1e-3 for bf16.
TEST(AttentionCuda, FusedMatchesPlainOnTheWholeModel) {
  REQUIRE_CUDA();
  const nn::LlamaConfig c = tensor_core_config();
  const Tokens batch = make_tokens(kTcBatch, kTcSeq, c.vocab_size, 31, testing::cuda0());
  for (DType compute : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(testing::name(compute));
    const StepFigures plain = run_step(
        *make_model({c, testing::cuda0(), ops::AttentionImpl::Plain, "none", false, compute}),
        batch);
    const StepFigures fused = run_step(
        *make_model({c, testing::cuda0(), ops::AttentionImpl::Fused, "none", false, compute}),
        batch);
    EXPECT_LE(std::fabs(fused.loss - plain.loss),
              (compute == DType::F32 ? 1e-5 : 1e-3) * std::fabs(static_cast<double>(plain.loss)))
        << "loss " << fused.loss << " fused, " << plain.loss << " plain";
    for (const auto& [name, want] : plain.grads) {
      const std::vector<float>& got = fused.grads.at(name);
      if (compute == DType::F32) {
        const Shape shape{static_cast<int64_t>(want.size())};
        testing::expect_close_scaled(from_floats(got, shape), from_floats(want, shape), 1e-3f,
                                     "fp32 gradient of " + name);
      } else {
        EXPECT_LE(relative_l2(got, want), 5e-2) << "bf16 gradient of " << name;
      }
    }
  }
}

// The one-pass backward (dQ summed with atomics) on the whole model, bf16 on tensor cores: it
// computes dK and dV as the deterministic backward does and dQ with its sums in another order,
// so dQ's fp32 sums differ in their last bits and, rounded to bf16, by an ulp here and there.
// Every parameter's gradient stays within 1e-2 in relative L2 of the deterministic backward's
// (a fifth of the bf16 fused-against-plain bound above), and the loss, computed before any
// backward, is the same.
TEST(AttentionCuda, AtomicDqBackwardMatchesTheDeterministicOne) {
  REQUIRE_CUDA();
  const nn::LlamaConfig c = tensor_core_config();
  const Tokens batch = make_tokens(kTcBatch, kTcSeq, c.vocab_size, 37, testing::cuda0());
  ModelOptions o{c, testing::cuda0(), ops::AttentionImpl::Fused};
  o.compute = DType::BF16;
  Allocator& dev = allocator_for(testing::cuda0());
  // The allocations a step makes on the device.
  auto step = [&](StepFigures& figures) {
    auto model = make_model(o);
    const int64_t before = dev.stats().num_allocs;
    figures = run_step(*model, batch);
    return dev.stats().num_allocs - before;
  };
  StepFigures deterministic, atomic;
  step(deterministic);  // the backend's lasting buffers (cuBLASLt's workspace) come first
  const int64_t deterministic_allocs = step(deterministic);
  o.attention_backward = AttentionBackwardAlgo::AtomicDq;
  const int64_t atomic_allocs = step(atomic);
  EXPECT_EQ(atomic.loss, deterministic.loss);
  ASSERT_EQ(atomic.grads.size(), deterministic.grads.size());
  for (const auto& [name, want] : deterministic.grads)
    EXPECT_LE(relative_l2(atomic.grads.at(name), want), 1e-2) << "bf16 gradient of " << name;
  // The gradients may well be the same bits (dQ is rounded to bf16, which hides most fp32
  // differences), so what shows that every layer ran the one-pass backward is its fp32 dQ
  // buffer: one workspace allocation more per layer, and nothing else different.
  EXPECT_EQ(atomic_allocs - deterministic_allocs, c.num_layers)
      << atomic_allocs << " device allocations with atomic_dq, " << deterministic_allocs
      << " deterministic";
}

}  // namespace
}  // namespace shardtrain
