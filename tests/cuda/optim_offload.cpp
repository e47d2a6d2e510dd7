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

#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "offload_optimizer.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/data/batch.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/optim/offload.h"
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/runtime.h"

namespace shardtrain {
namespace {

using testing::bits_of;
using testing::ParamSet;
using testing::set_random_grads;
using testing::StateBytes;

ParamSet make_params(DType dtype = DType::F32) {
  return testing::make_params(testing::cuda0(), dtype);
}

StateBytes optimizer_state_in_use() {
  return testing::optimizer_state_in_use(testing::cuda0());
}

class OffloadCuda : public ::testing::TestWithParam<bool> {};  // moments on the device

// On the parameter sets of the CPU test (testing::make_params), whose sizes are not multiples of
// the GPU kernel's 4-element vectors.
TEST_P(OffloadCuda, BitwiseEqualToTheGpuAdamWOverThreeSteps) {
  REQUIRE_CUDA();
  const bool moments_on_device = GetParam();
  for (bool decay_all : {false, true}) {
    SCOPED_TRACE("decay_all=" + std::to_string(decay_all));
    optim::AdamWOptions opts;
    opts.decay_all = decay_all;
    ASSERT_NO_FATAL_FAILURE(
        testing::expect_offloaded_adamw_matches_adamw(testing::cuda0(), opts, moments_on_device));
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
  testing::expect_bf16_weights_are_the_rounded_fp32_master(testing::cuda0());
}

// ---- memory --------------------------------------------------------------------------------

// The ledgers count each allocation's requested bytes rounded up to 64, on the GPU as on the CPU
// device (the caching allocator's block sizes only show in MemoryStats::reserved), so the CPU
// test's figures hold to the byte.
TEST(OffloadCudaMemory, StateIsOptimizerStateWhereItLives) {
  REQUIRE_CUDA();
  ParamSet params = make_params();
  const int64_t per_tensor = testing::fp32_bytes_per_parameter(params.named());
  Allocator& host = allocator_for(Device::host());
  const StateBytes before = optimizer_state_in_use();
  const int64_t workspace_before = host.stats().in_use_of(MemoryCategory::Workspace);
  {
    optim::OffloadOptions o;
    o.pipeline_chunk_elements = 1000;
    optim::OffloadedAdamW offloaded(params.named(), {}, o);
    // master, exp_avg, exp_avg_sq
    testing::expect_state_added(testing::cuda0(), before, 0, 3 * per_tensor);
    // Steps add no state.
    testing::expect_two_steps_keep_one_staging(offloaded, params, workspace_before);
    testing::expect_state_added(testing::cuda0(), before, 0, 3 * per_tensor);
  }
  EXPECT_EQ(host.stats().in_use_of(MemoryCategory::Workspace), workspace_before);
  EXPECT_EQ(optimizer_state_in_use().host, before.host) << "freed with the optimizer";
  testing::expect_state_with_moments_on_the_device(params, testing::cuda0(), before);
  const StateBytes after = optimizer_state_in_use();
  EXPECT_EQ(after.device, before.device);
  EXPECT_EQ(after.host, before.host);
}

// ---- through Runtime -------------------------------------------------------------------------

train::Config golden_config(const std::vector<std::string>& sets) {
  return testing::golden_config("cuda", sets);
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
  const int64_t per_tensor = testing::fp32_bytes_per_parameter(offloaded.trainable());
  testing::expect_state_added(testing::cuda0(), before, moments_on_device ? 2 * per_tensor : 0,
                              moments_on_device ? per_tensor : 3 * per_tensor);

  train::Runtime on_device(golden_config({}));
  ASSERT_NE(dynamic_cast<optim::AdamW*>(&on_device.optimizer()), nullptr);

  const std::vector<Batch> batch = testing::golden_batch();
  for (int step = 1; step <= 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_NO_FATAL_FAILURE(
        testing::expect_runtime_steps_bitwise_equal(on_device, offloaded, batch, 1e-2f));
  }
}

INSTANTIATE_TEST_SUITE_P(Moments, OffloadCudaRuntime, ::testing::Values(false, true),
                         [](const auto& info) {
                           return std::string(info.param ? "on_device" : "on_host");
                         });

}  // namespace
}  // namespace shardtrain
