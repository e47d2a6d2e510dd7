// The offloaded optimizer on GPU parameters: OffloadedAdamW (gradients copied to the host pool,
// AdamW on the CPU, weights copied back, each direction on its own CUDA stream) gives the same
// bits as AdamW run by the GPU kernel, with the moments in the host pool or on the GPU; its state
// is counted as OptimizerState where it lives; and a Runtime training step with optim.offload=cpu
// on the GPU is bitwise the on-device step.
//
// Why bitwise: the offloaded update runs optim::cpu_adamw, which tests/unit/test_optim_offload.cpp
// shows bitwise equal to the CPU backend's Backend::adamw (every kernel, every thread count), and
// the CUDA AdamW kernel rounds every product, sum, quotient and square root on its own in the CPU
// backend's order (kernels/adamw.cu), which tests/cuda/kernels.cpp (CudaKernels.AdamW) checks
// bitwise against the CPU backend. The copies move bytes unchanged.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/data/batch.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/optim/offload.h"
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/runtime.h"

namespace shardtrain {
namespace {

const std::string kGolden = std::string(SHARDTRAIN_TEST_DATA) + "/golden/llama-tiny-gqa";

int64_t rounded(int64_t bytes) {  // the allocators' granularity (memory/allocator.cpp)
  return (bytes + 63) / 64 * 64;
}

// Bit patterns (as fp32), so that -0.0 against 0.0 and NaN payloads count as differences.
std::vector<uint32_t> bits_of(const Tensor& t) {
  const std::vector<float> f = t.to_float_vector();
  std::vector<uint32_t> out(f.size());
  std::memcpy(out.data(), f.data(), f.size() * sizeof(float));
  return out;
}

struct ParamSet {
  std::vector<std::string> names;
  std::vector<Tensor> tensors;
  std::vector<optim::NamedParam> named() {
    std::vector<optim::NamedParam> out;
    for (size_t i = 0; i < names.size(); ++i) out.push_back({names[i], &tensors[i]});
    return out;
  }
};

// The shapes of the CPU test: decayed ("proj") and undecayed ("norm", "embed") names, sizes that
// are not multiples of the GPU kernel's 4-element vectors, a single element; identical values in
// every set built with the same dtype.
ParamSet make_params(DType dtype = DType::F32) {
  const std::vector<std::pair<std::string, Shape>> specs = {
      {"layers.0.q_proj.weight", {33, 17}}, {"layers.0.input_norm.weight", {7}},
      {"embed_tokens.weight", {5, 1003}},   {"layers.0.down_proj.weight", {4097}},
      {"layers.0.bias_like", {1}},
  };
  ParamSet s;
  uint64_t seed = 100;
  for (const auto& [name, shape] : specs) {
    s.names.push_back(name);
    const Tensor values = testing::random_cpu(shape, dtype, seed++);
    s.tensors.push_back(values.to(testing::cuda0(), MemoryCategory::Parameters));
  }
  return s;
}

// Gradients of step `step` (fp32, on the GPU); parameter `skip` gets none.
void set_random_grads(ParamSet& s, uint64_t step, size_t skip = SIZE_MAX) {
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    Tensor& p = s.tensors[i];
    if (i == skip) {
      autograd::set_grad(p, Tensor());
      continue;
    }
    const Tensor g = testing::random_cpu(p.shape(), DType::F32, step * 31 + i, 1e-2f);
    autograd::set_grad(p, g.to(testing::cuda0(), MemoryCategory::Gradients));
  }
}

void expect_bitwise_equal(ParamSet& got, ParamSet& want, const std::string& what) {
  for (size_t i = 0; i < want.tensors.size(); ++i)
    EXPECT_EQ(bits_of(got.tensors[i]), bits_of(want.tensors[i])) << what << ": " << want.names[i];
}

class OffloadCuda : public ::testing::TestWithParam<bool> {};  // moments on the device

TEST_P(OffloadCuda, BitwiseEqualToTheGpuAdamWOverThreeSteps) {
  REQUIRE_CUDA();
  const bool moments_on_device = GetParam();
  for (bool decay_all : {false, true}) {
    SCOPED_TRACE("decay_all=" + std::to_string(decay_all));
    ParamSet ref = make_params(), off = make_params();
    optim::AdamWOptions opts;
    opts.decay_all = decay_all;
    optim::OffloadOptions offload;
    offload.moments_on_device = moments_on_device;
    offload.pipeline_chunk_elements = 1000;  // several pieces in flight per large parameter
    optim::AdamW adamw(ref.named(), opts);
    optim::OffloadedAdamW offloaded(off.named(), opts, offload);
    for (int step = 1; step <= 3; ++step) {
      // Step 2 leaves one parameter without a gradient: it and its moments must not change.
      const size_t skip = step == 2 ? 2 : SIZE_MAX;
      set_random_grads(ref, static_cast<uint64_t>(step), skip);
      set_random_grads(off, static_cast<uint64_t>(step), skip);
      const float lr = 1e-2f * static_cast<float>(step);
      adamw.step(lr);
      offloaded.step(lr);
      expect_bitwise_equal(off, ref, "step " + std::to_string(step));
      EXPECT_EQ(offloaded.steps_taken(), step);
    }
    const auto want = adamw.state(), got = offloaded.state();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].first, want[i].first);
      EXPECT_EQ(want[i].second->device(), testing::cuda0());
      EXPECT_EQ(got[i].second->device(), moments_on_device ? testing::cuda0() : Device::host())
          << got[i].first;
      EXPECT_EQ(bits_of(*got[i].second), bits_of(*want[i].second)) << want[i].first;
    }
    for (size_t i = 0; i < off.tensors.size(); ++i) {  // the host master is the weight, exactly
      EXPECT_EQ(offloaded.master(i).device(), Device::host());
      EXPECT_EQ(bits_of(offloaded.master(i)), bits_of(off.tensors[i])) << off.names[i];
    }
    // The last step's traffic: 4 bytes per gradient element down and per weight element up, 8
    // more each way with the moments on the device; ceil(numel / 1000) pieces per parameter.
    int64_t elems = 0;
    for (const Tensor& t : off.tensors) elems += t.numel();
    const optim::OffloadStepStats& s = offloaded.last_step_stats();
    EXPECT_EQ(s.bytes_down, elems * (moments_on_device ? 12 : 4));
    EXPECT_EQ(s.bytes_up, elems * (moments_on_device ? 12 : 4));
    EXPECT_EQ(s.pieces, 1 + 1 + 6 + 5 + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Moments, OffloadCuda, ::testing::Values(false, true),
                         [](const auto& info) {
                           return std::string(info.param ? "on_device" : "on_host");
                         });

// bf16 weights on the GPU: the fp32 master in the host pool follows fp32 AdamW on the GPU
// exactly, and the weights are the master rounded to bf16 (on the host, nearest even).
TEST(OffloadCudaBf16, ParametersAreTheRoundedFp32Master) {
  REQUIRE_CUDA();
  ParamSet off = make_params(DType::BF16);
  ParamSet ref = make_params(DType::F32);
  // The same starting values: the fp32 reference starts from the bf16 weights.
  for (size_t i = 0; i < ref.tensors.size(); ++i) ref.tensors[i].copy_from(off.tensors[i]);
  optim::AdamW adamw(ref.named(), {});
  optim::OffloadedAdamW offloaded(off.named(), {}, {});
  for (int step = 1; step <= 2; ++step) {
    set_random_grads(ref, static_cast<uint64_t>(step));
    set_random_grads(off, static_cast<uint64_t>(step));
    adamw.step(1e-2f);
    offloaded.step(1e-2f);
  }
  for (size_t i = 0; i < ref.tensors.size(); ++i) {
    SCOPED_TRACE(ref.names[i]);
    EXPECT_EQ(bits_of(offloaded.master(i)), bits_of(ref.tensors[i]));
    EXPECT_EQ(off.tensors[i].dtype(), DType::BF16);
    EXPECT_EQ(bits_of(off.tensors[i]), bits_of(ref.tensors[i].to(Device::cpu()).to(DType::BF16)));
  }
}

// ---- memory --------------------------------------------------------------------------------

struct StateBytes {
  int64_t device, host;
};

StateBytes optimizer_state_in_use() {
  return {allocator_for(testing::cuda0()).stats().in_use_of(MemoryCategory::OptimizerState),
          allocator_for(Device::host()).stats().in_use_of(MemoryCategory::OptimizerState)};
}

// The ledgers count each allocation's requested bytes rounded up to 64, on the GPU as on the CPU
// device (the caching allocator's block sizes only show in MemoryStats::reserved), so the CPU
// test's figures hold to the byte.
TEST(OffloadCudaMemory, StateIsOptimizerStateWhereItLives) {
  REQUIRE_CUDA();
  ParamSet params = make_params();
  int64_t per_tensor = 0;  // one fp32 tensor per parameter
  for (const Tensor& t : params.tensors) per_tensor += rounded(4 * t.numel());
  Allocator& host = allocator_for(Device::host());
  const StateBytes before = optimizer_state_in_use();
  const int64_t workspace_before = host.stats().in_use_of(MemoryCategory::Workspace);
  {
    optim::OffloadOptions o;
    o.pipeline_chunk_elements = 1000;
    optim::OffloadedAdamW offloaded(params.named(), {}, o);
    StateBytes now = optimizer_state_in_use();
    EXPECT_EQ(now.device - before.device, 0);
    EXPECT_EQ(now.host - before.host, 3 * per_tensor);  // master, exp_avg, exp_avg_sq

    // The first step allocates the staging (three host-pool Workspace slots of one 1000-element
    // fp32 piece) and keeps it; steps add no state.
    const int64_t staging = 3 * rounded(4 * 1000);
    set_random_grads(params, 1);
    offloaded.step(1e-3f);
    EXPECT_EQ(host.stats().in_use_of(MemoryCategory::Workspace) - workspace_before, staging);
    host.reset_peak();
    set_random_grads(params, 2);
    offloaded.step(1e-3f);
    EXPECT_EQ(host.stats().peak_of(MemoryCategory::Workspace) - workspace_before, staging);
    now = optimizer_state_in_use();
    EXPECT_EQ(now.device - before.device, 0);
    EXPECT_EQ(now.host - before.host, 3 * per_tensor);
  }
  EXPECT_EQ(host.stats().in_use_of(MemoryCategory::Workspace), workspace_before);
  EXPECT_EQ(optimizer_state_in_use().host, before.host) << "freed with the optimizer";
  {
    optim::OffloadOptions o;
    o.moments_on_device = true;
    optim::OffloadedAdamW offloaded(params.named(), {}, o);
    const StateBytes now = optimizer_state_in_use();
    EXPECT_EQ(now.device - before.device, 2 * per_tensor);  // the moments
    EXPECT_EQ(now.host - before.host, per_tensor);          // the master
  }
  {
    optim::AdamW adamw(params.named(), {});  // for comparison: everything on the GPU
    const StateBytes now = optimizer_state_in_use();
    EXPECT_EQ(now.device - before.device, 2 * per_tensor);
    EXPECT_EQ(now.host - before.host, 0);
  }
  const StateBytes after = optimizer_state_in_use();
  EXPECT_EQ(after.device, before.device);
  EXPECT_EQ(after.host, before.host);
}

// ---- through Runtime -------------------------------------------------------------------------

train::Config golden_config(const std::vector<std::string>& sets) {
  std::vector<std::string> all = {"train.device=cuda", "model.from_hf=" + kGolden,
                                  "optim.grad_clip=0", "optim.decay_norms_and_embeddings=true"};
  all.insert(all.end(), sets.begin(), sets.end());
  return train::Config::parse("{}", all, "golden");
}

std::vector<Batch> golden_batch() {
  const SafetensorsFile file = SafetensorsFile::open(kGolden + "/batch.safetensors");
  Batch b;
  b.input_ids = file.load("input_ids", Device::cpu(), DType::I64);
  b.targets = file.load("targets", Device::cpu(), DType::I64);
  b.num_target_tokens = count_target_tokens(b.targets);
  return {b};
}

class OffloadCudaRuntime : public ::testing::TestWithParam<bool> {};  // moments on the device

// Both runtimes compute the same gradients (the same kernels on the same GPU, deterministic), so
// the steps must agree to the bit. Two steps, so that the second reads moments the first wrote.
TEST_P(OffloadCudaRuntime, StepsAreBitwiseThoseOfTheOnDeviceOptimizer) {
  REQUIRE_CUDA();
  const bool moments_on_device = GetParam();
  const StateBytes before = optimizer_state_in_use();
  train::Runtime offloaded(
      golden_config({"optim.offload=cpu", std::string("optim.offload_moments=") +
                                              (moments_on_device ? "device" : "host")}));
  ASSERT_NE(dynamic_cast<optim::OffloadedAdamW*>(&offloaded.optimizer()), nullptr);
  ASSERT_EQ(offloaded.device(), testing::cuda0());
  int64_t per_tensor = 0;
  for (const optim::NamedParam& p : offloaded.trainable())
    per_tensor += rounded(4 * p.param->numel());
  StateBytes now = optimizer_state_in_use();
  EXPECT_EQ(now.device - before.device, moments_on_device ? 2 * per_tensor : 0);
  EXPECT_EQ(now.host - before.host, moments_on_device ? per_tensor : 3 * per_tensor);

  train::Runtime on_device(golden_config({}));
  ASSERT_NE(dynamic_cast<optim::AdamW*>(&on_device.optimizer()), nullptr);

  const std::vector<Batch> batch = golden_batch();
  for (int step = 1; step <= 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const train::StepResult a = on_device.train_step(batch, 1e-2f);
    const train::StepResult b = offloaded.train_step(batch, 1e-2f);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.grad_norm, b.grad_norm);
    const auto pa = on_device.model().named_parameters(), pb = offloaded.model().named_parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_EQ(bits_of(*pa[i].second), bits_of(*pb[i].second)) << pa[i].first;
    const auto sa = on_device.optimizer().state(), sb = offloaded.optimizer().state();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_EQ(sa[i].first, sb[i].first);
      EXPECT_EQ(bits_of(*sa[i].second), bits_of(*sb[i].second)) << sa[i].first;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Moments, OffloadCudaRuntime, ::testing::Values(false, true),
                         [](const auto& info) {
                           return std::string(info.param ? "on_device" : "on_host");
                         });

}  // namespace
}  // namespace shardtrain
