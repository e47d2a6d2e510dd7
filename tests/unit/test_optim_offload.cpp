// The CPU AdamW kernels and the offloaded optimizer: bitwise equality with the on-device AdamW,
// exact memory accounting on the device and in the host pool, and the training step through
// Runtime with optim.offload=cpu.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "offload_optimizer.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/optim/cpu_adam.h"
#include "shardtrain/optim/offload.h"
#include "shardtrain/train/runtime.h"

namespace shardtrain {
namespace {

using optim::CpuAdamKernel;

using testing::bits_of;
using testing::expect_bitwise_equal;
using testing::ParamSet;
using testing::rounded;
using testing::set_random_grads;
using testing::StateBytes;

std::vector<float> random_floats(int64_t n, uint64_t seed, float scale) {
  Generator gen(seed);
  std::vector<float> out(static_cast<size_t>(n));
  gen.normal(out.data(), n);
  for (float& x : out) x *= scale;
  return out;
}

std::vector<float> random_second_moments(int64_t n, uint64_t seed) {
  std::vector<float> out = random_floats(n, seed, 1e-3f);
  for (float& x : out) x = x * x;  // non-negative, spread over many exponents
  return out;
}

const CpuAdamKernel kKernels[] = {CpuAdamKernel::Scalar, CpuAdamKernel::Avx2,
                                  CpuAdamKernel::Avx512};

// GTEST_SKIP returns from the function it is written in, so a helper that skipped would let the
// test body run on: the check is a macro that returns from the test itself.
#define SKIP_UNLESS_SUPPORTED(kernel)                        \
  if (!optim::cpu_adam_kernel_supported(kernel))             \
  GTEST_SKIP() << "this CPU lacks the instructions of the '" \
               << optim::cpu_adam_kernel_name(kernel) << "' kernel"

// ---- the CPU AdamW kernels ---------------------------------------------------------------------

// Lengths around every vector width and block boundary, and long enough to run multi-threaded.
const int64_t kLengths[] = {1, 7, 8, 9, 15, 16, 17, 31, 4095, 4096, 4097, 40001};

class CpuAdamKernelTest : public ::testing::TestWithParam<CpuAdamKernel> {};

TEST_P(CpuAdamKernelTest, BitwiseEqualToTheCpuBackendOnRandomData) {
  SKIP_UNLESS_SUPPORTED(GetParam());
  Backend& cpu = backend_for(Device::cpu());
  for (DType grad_dtype : {DType::F32, DType::BF16}) {
    for (int64_t n : kLengths) {
      for (int threads : {1, 2}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " threads=" + std::to_string(threads) + " grad " +
                     std::string(dtype_name(grad_dtype)));
        std::vector<float> p0 = random_floats(n, 1, 1.0f), g0 = random_floats(n, 2, 1e-2f);
        std::vector<float> m0 = random_floats(n, 3, 1e-3f), v0 = random_second_moments(n, 4);
        // The reference: the CPU backend's kernel on tensors.
        Tensor p = from_floats(p0, {n}), m = from_floats(m0, {n}), v = from_floats(v0, {n});
        Tensor g = from_floats(g0, {n}, grad_dtype);
        std::vector<float> p1 = p0, m1 = m0, v1 = v0;
        for (int64_t step = 1; step <= 3; ++step) {
          // Step 3 is clipped: its gradients enter scaled by 0.37.
          Backend::AdamWArgs args{
              1e-3f, 0.9f, 0.95f, 1e-8f, step == 2 ? 0.0f : 0.1f, step, step == 3 ? 0.37f : 1.0f};
          cpu.adamw(p, g, m, v, args);
          optim::cpu_adamw(p1.data(), g.data_ptr(), grad_dtype, m1.data(), v1.data(), n, args,
                           {GetParam(), threads});
        }
        ASSERT_EQ(bits_of(p1), bits_of(p));
        ASSERT_EQ(bits_of(m1), bits_of(m));
        ASSERT_EQ(bits_of(v1), bits_of(v));
        ASSERT_NE(bits_of(p1), bits_of(p0)) << "the step changed nothing";
      }
    }
  }
}

TEST_P(CpuAdamKernelTest, FirstStepMovesEachWeightByLrTimesTheGradientSign) {
  SKIP_UNLESS_SUPPORTED(GetParam());
  // Step 1 from zero moments: m/bc1 = g and sqrt(v/bc2) = |g|, so p -= lr * g / (|g| + eps).
  const int64_t n = 37;
  std::vector<float> p = random_floats(n, 5, 1.0f), g = random_floats(n, 6, 1.0f);
  std::vector<float> p0 = p, m(n, 0.0f), v(n, 0.0f);
  optim::cpu_adamw(p.data(), g.data(), DType::F32, m.data(), v.data(), n,
                   {0.01f, 0.9f, 0.999f, 1e-8f, 0.0f, 1}, {GetParam(), 1});
  for (int64_t i = 0; i < n; ++i) {
    const double want = p0[i] - 0.01 * (g[i] > 0 ? 1.0 : -1.0);
    EXPECT_NEAR(p[i], want, 1e-6) << i;
    EXPECT_FLOAT_EQ(m[i], 0.1f * g[i]) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, CpuAdamKernelTest, ::testing::ValuesIn(kKernels),
                         [](const auto& info) {
                           return std::string(optim::cpu_adam_kernel_name(info.param));
                         });

TEST(CpuAdam, EveryKernelGivesTheSameBitsAsEveryOther) {
  const int64_t n = 12345;  // odd: tails in every kernel
  std::vector<std::vector<float>> results;
  for (CpuAdamKernel k : kKernels) {
    if (!optim::cpu_adam_kernel_supported(k)) continue;
    std::vector<float> p = random_floats(n, 7, 1.0f), g = random_floats(n, 8, 1.0f);
    std::vector<float> m = random_floats(n, 9, 0.1f), v = random_second_moments(n, 10);
    for (int64_t step = 1; step <= 3; ++step)
      optim::cpu_adamw(p.data(), g.data(), DType::F32, m.data(), v.data(), n,
                       {3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step}, {k, 2});
    p.insert(p.end(), m.begin(), m.end());
    p.insert(p.end(), v.begin(), v.end());
    results.push_back(p);
  }
  ASSERT_GE(results.size(), 1u);
  for (size_t i = 1; i < results.size(); ++i) EXPECT_EQ(bits_of(results[i]), bits_of(results[0]));
}

TEST(CpuAdam, AutoPicksTheWidestSupportedKernelAndRejectsUnsupportedOnes) {
  CpuAdamKernel best = optim::cpu_adam_best_kernel();
  EXPECT_TRUE(optim::cpu_adam_kernel_supported(best));
  EXPECT_TRUE(optim::cpu_adam_kernel_supported(CpuAdamKernel::Scalar));
  if (optim::cpu_adam_kernel_supported(CpuAdamKernel::Avx512)) {
    EXPECT_EQ(best, CpuAdamKernel::Avx512);
  }
  for (CpuAdamKernel k : kKernels) {
    if (optim::cpu_adam_kernel_supported(k)) continue;
    float x = 0;
    EXPECT_THROW(optim::cpu_adamw(&x, &x, DType::F32, &x, &x, 1,
                                  {1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 1}, {k, 1}),
                 Error);
  }
  float x = 0;
  EXPECT_THROW(
      optim::cpu_adamw(&x, &x, DType::I32, &x, &x, 1, {1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 1}), Error);
}

TEST(CpuAdam, Bf16MomentsMatchOnTheFirstStepThenDriftByRoundingOnly) {
  const int64_t n = 5003;
  std::vector<float> g = random_floats(n, 11, 1e-2f);
  std::vector<float> p32 = random_floats(n, 12, 1.0f), p16 = p32;
  std::vector<float> m32(n, 0.0f), v32(n, 0.0f);
  std::vector<uint16_t> m16(n, 0), v16(n, 0);
  Backend::AdamWArgs args{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
  optim::cpu_adamw(p32.data(), g.data(), DType::F32, m32.data(), v32.data(), n, args);
  optim::cpu_adamw_bf16_moments(p16.data(), g.data(), DType::F32, m16.data(), v16.data(), n, args);
  // The first update uses the fp32 moments before they are stored: the same weights; the stored
  // moments are those moments rounded to bf16.
  EXPECT_EQ(bits_of(p16), bits_of(p32));
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(m16[i], float_to_bf16(m32[i])) << i;
    ASSERT_EQ(v16[i], float_to_bf16(v32[i])) << i;
  }
  // Later steps read rounded moments: not bitwise equal any more, but each weight's update
  // differs by about bf16's relative precision (2^-8) of the update itself (about lr).
  std::vector<float> before = p32;
  args.step = 2;
  optim::cpu_adamw(p32.data(), g.data(), DType::F32, m32.data(), v32.data(), n, args);
  optim::cpu_adamw_bf16_moments(p16.data(), g.data(), DType::F32, m16.data(), v16.data(), n, args);
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double update = std::fabs(static_cast<double>(p32[i]) - before[i]);
    EXPECT_LE(std::fabs(static_cast<double>(p16[i]) - p32[i]), 2e-2 * update + 1e-7) << i;
    differ += p16[i] != p32[i];
  }
  EXPECT_GT(differ, 0) << "the bf16 path should not be bitwise equal after the first step";
}

// ---- OffloadedAdamW against AdamW
// ----------------------------------------------------------------

ParamSet make_params(Device device, DType dtype = DType::F32) {
  return testing::make_params(device, dtype);
}

class OffloadMatchesAdamW : public ::testing::TestWithParam<bool> {};  // moments on the device

TEST_P(OffloadMatchesAdamW, BitwiseOverThreeStepsWithAndWithoutWeightDecay) {
  for (bool decay_all : {false, true}) {
    for (float wd : {0.0f, 0.1f}) {
      SCOPED_TRACE("decay_all=" + std::to_string(decay_all) + " wd=" + std::to_string(wd));
      optim::AdamWOptions opts;
      opts.weight_decay = wd;
      opts.decay_all = decay_all;
      ASSERT_NO_FATAL_FAILURE(
          testing::expect_offloaded_adamw_matches_adamw(Device::cpu(), opts, GetParam()));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Moments, OffloadMatchesAdamW, ::testing::Values(false, true),
                         [](const auto& info) {
                           return std::string(info.param ? "on_device" : "on_host");
                         });

TEST(OffloadedAdamW, Bf16ParametersGetTheRoundedFp32Master) {
  testing::expect_bf16_weights_are_the_rounded_fp32_master(Device::cpu());
}

TEST(OffloadedAdamW, WeightsWrittenAfterConstructionOrOnReloadAreTheOnesUpdated) {
  ParamSet ref = make_params(Device::cpu()), off = make_params(Device::cpu());
  optim::AdamW adamw(ref.named(), {});
  optim::OffloadedAdamW offloaded(off.named(), {}, {});
  // A checkpoint loaded into the parameters after the optimizer was created.
  for (size_t i = 0; i < ref.tensors.size(); ++i) {
    Tensor loaded =
        from_floats(random_floats(ref.tensors[i].numel(), 900 + i, 0.5f), ref.tensors[i].shape());
    ref.tensors[i].copy_from(loaded);
    off.tensors[i].copy_from(loaded);
  }
  set_random_grads(ref, 1);
  set_random_grads(off, 1);
  adamw.step(1e-2f);
  offloaded.step(1e-2f);
  expect_bitwise_equal(off, ref, "after the loaded weights");
  // Later writes are seen after reload_params() (and only then: the master is the truth).
  Backend& cpu = backend_for(Device::cpu());
  for (size_t i = 0; i < ref.tensors.size(); ++i) {
    cpu.scale(ref.tensors[i], ref.tensors[i], 0.5f);
    cpu.scale(off.tensors[i], off.tensors[i], 0.5f);
  }
  offloaded.reload_params();
  set_random_grads(ref, 2);
  set_random_grads(off, 2);
  adamw.step(1e-2f);
  offloaded.step(1e-2f);
  expect_bitwise_equal(off, ref, "after reload_params()");
}

TEST(OffloadedAdamW, RejectsAnEmptyPipelinePiece) {
  ParamSet off = make_params(Device::cpu());
  optim::OffloadOptions o;
  o.pipeline_chunk_elements = 0;
  EXPECT_THROW(optim::OffloadedAdamW(off.named(), {}, o), ConfigError);
}

// ---- memory -------------------------------------------------------------------------------------

StateBytes optimizer_state_in_use() {
  return testing::optimizer_state_in_use(Device::cpu());
}

TEST(OffloadedAdamW, StateLivesInTheHostPoolTwelveBytesPerElement) {
  ParamSet off = make_params(Device::cpu());
  const int64_t per_tensor = testing::fp32_bytes_per_parameter(off.named());
  EXPECT_EQ(per_tensor, rounded(4 * 33 * 17) + rounded(4 * 7) + rounded(4 * 5 * 1003) +
                            rounded(4 * 4097) + rounded(4));

  const StateBytes before = optimizer_state_in_use();
  const int64_t workspace_before =
      allocator_for(Device::host()).stats().in_use_of(MemoryCategory::Workspace);
  {
    optim::OffloadOptions o;
    o.pipeline_chunk_elements = 1000;
    optim::OffloadedAdamW offloaded(off.named(), {}, o);
    // master, exp_avg, exp_avg_sq
    testing::expect_state_added(Device::cpu(), before, 0, 3 * per_tensor);
    // Steps add no state; the staging stays allocated for later steps.
    testing::expect_two_steps_keep_one_staging(offloaded, off, workspace_before);
    EXPECT_EQ(allocator_for(Device::host()).stats().in_use_of(MemoryCategory::Workspace) -
                  workspace_before,
              3 * rounded(4 * 1000));
    testing::expect_state_added(Device::cpu(), before, 0, 3 * per_tensor);
  }
  EXPECT_EQ(allocator_for(Device::host()).stats().in_use_of(MemoryCategory::Workspace),
            workspace_before);
  EXPECT_EQ(optimizer_state_in_use().host, before.host);  // freed with the optimizer
  testing::expect_state_with_moments_on_the_device(off, Device::cpu(), before);
}

// ---- through Runtime
// ------------------------------------------------------------------------------

train::Config golden_config(const std::vector<std::string>& sets) {
  return testing::golden_config("cpu", sets);
}

TEST(OffloadedAdamW, RuntimeStepIsBitwiseEqualToTheOnDeviceOptimizer) {
  const StateBytes before = optimizer_state_in_use();
  train::Runtime offloaded(golden_config({"optim.offload=cpu"}));
  ASSERT_NE(dynamic_cast<optim::OffloadedAdamW*>(&offloaded.optimizer()), nullptr);
  const int64_t per_tensor = testing::fp32_bytes_per_parameter(offloaded.trainable());
  testing::expect_state_added(Device::cpu(), before, 0, 3 * per_tensor);

  train::Runtime on_device(golden_config({}));
  ASSERT_NE(dynamic_cast<optim::AdamW*>(&on_device.optimizer()), nullptr);
  testing::expect_state_added(Device::cpu(), before, 2 * per_tensor, 3 * per_tensor);

  ASSERT_NO_FATAL_FAILURE(testing::expect_runtime_steps_bitwise_equal(
      on_device, offloaded, testing::golden_batch(), 1e-2f));
}

TEST(OffloadedAdamW, RuntimeRejectsOffloadWithSgd) {
  try {
    train::Runtime rt(golden_config({"optim.offload=cpu", "optim.name=sgd"}));
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("optim.offload"), std::string::npos) << msg;
    EXPECT_NE(msg.find("optim.name"), std::string::npos) << msg;
    EXPECT_NE(msg.find("sgd"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace shardtrain
