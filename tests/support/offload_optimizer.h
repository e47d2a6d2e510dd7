// The parameter sets, bit patterns, memory readings, golden configuration and comparisons that
// the CPU and GPU tests of the offloaded optimizer (OffloadedAdamW against AdamW) share.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bits.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/data/batch.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/optim/offload.h"
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/runtime.h"

namespace shardtrain::testing {

inline const std::string kGoldenModelDir =
    std::string(SHARDTRAIN_TEST_DATA) + "/golden/llama-tiny-gqa";

// The allocators' granularity (memory/allocator.cpp).
inline int64_t rounded(int64_t bytes) {
  return (bytes + 63) / 64 * 64;
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

// Decayed ("proj") and undecayed ("norm", "embed") names, sizes that are not multiples of the GPU
// kernel's 4-element vectors, a single element (1 + 1 + 6 + 5 + 1 pieces of 1000 elements), and
// identical values in every set built with the same dtype.
inline ParamSet make_params(Device device, DType dtype = DType::F32) {
  const std::vector<std::pair<std::string, Shape>> specs = {
      {"layers.0.q_proj.weight", {33, 17}}, {"layers.0.input_norm.weight", {7}},
      {"embed_tokens.weight", {5, 1003}},   {"layers.0.down_proj.weight", {4097}},
      {"layers.0.bias_like", {1}},
  };
  ParamSet s;
  uint64_t seed = 100;
  CategoryScope scope(MemoryCategory::Parameters);
  for (const auto& [name, shape] : specs) {
    Generator gen(seed++);
    s.names.push_back(name);
    s.tensors.push_back(randn(shape, gen, 1.0f, dtype, device));
  }
  return s;
}

// Gradients of step `step` (fp32, on each parameter's device); parameter `skip` gets none.
inline void set_random_grads(ParamSet& s, uint64_t step, size_t skip = SIZE_MAX) {
  CategoryScope scope(MemoryCategory::Gradients);
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    Tensor& p = s.tensors[i];
    if (i == skip) {
      autograd::set_grad(p, Tensor());
      continue;
    }
    Generator gen(step * 31 + i);
    autograd::set_grad(p, randn(p.shape(), gen, 1e-2f, DType::F32, p.device()));
  }
}

inline void expect_bitwise_equal(ParamSet& got, ParamSet& want, const std::string& what) {
  for (size_t i = 0; i < want.tensors.size(); ++i)
    EXPECT_EQ(bits_of(got.tensors[i]), bits_of(want.tensors[i])) << what << ": " << want.names[i];
}

// The ledger's bytes for one fp32 tensor per parameter (each rounded up to 64).
inline int64_t fp32_bytes_per_parameter(const std::vector<optim::NamedParam>& params) {
  int64_t bytes = 0;
  for (const optim::NamedParam& p : params) bytes += rounded(4 * p.param->numel());
  return bytes;
}

struct StateBytes {
  int64_t device, host;
};

// OptimizerState bytes in use on `device` and in the host pool.
inline StateBytes optimizer_state_in_use(Device device) {
  return {allocator_for(device).stats().in_use_of(MemoryCategory::OptimizerState),
          allocator_for(Device::host()).stats().in_use_of(MemoryCategory::OptimizerState)};
}

// The OptimizerState bytes added since `before`: `on_device` on `device`, `in_host_pool` there.
inline void expect_state_added(Device device, const StateBytes& before, int64_t on_device,
                               int64_t in_host_pool) {
  const StateBytes now = optimizer_state_in_use(device);
  EXPECT_EQ(now.device - before.device, on_device);
  EXPECT_EQ(now.host - before.host, in_host_pool);
}

// Two steps of `offloaded` (pieces of 1000 elements) on `params`: the first allocates the staging
// (three host-pool Workspace slots of one 1000-element fp32 piece) and keeps it; the second
// allocates no more. `workspace_before`: host-pool Workspace in use before the first step.
inline void expect_two_steps_keep_one_staging(optim::OffloadedAdamW& offloaded, ParamSet& params,
                                              int64_t workspace_before) {
  Allocator& host = allocator_for(Device::host());
  const int64_t staging = 3 * rounded(4 * 1000);
  set_random_grads(params, 1);
  offloaded.step(1e-3f);
  EXPECT_EQ(host.stats().in_use_of(MemoryCategory::Workspace) - workspace_before, staging);
  host.reset_peak();
  set_random_grads(params, 2);
  offloaded.step(1e-3f);
  EXPECT_EQ(host.stats().peak_of(MemoryCategory::Workspace) - workspace_before, staging);
}

// With the moments on `device`, OffloadedAdamW keeps them there (two fp32 tensors per parameter)
// and the master in the host pool; AdamW, for comparison, keeps both moments on `device`.
inline void expect_state_with_moments_on_the_device(ParamSet& params, Device device,
                                                    const StateBytes& before) {
  const int64_t per_tensor = fp32_bytes_per_parameter(params.named());
  {
    optim::OffloadOptions o;
    o.moments_on_device = true;
    optim::OffloadedAdamW offloaded(params.named(), {}, o);
    expect_state_added(device, before, 2 * per_tensor, per_tensor);
  }
  {
    optim::AdamW adamw(params.named(), {});
    expect_state_added(device, before, 2 * per_tensor, 0);
  }
}

// Three steps of AdamW and of OffloadedAdamW (several pieces in flight per large parameter) on
// equal parameter sets on `device`: the same weights after every step, the same moments, on
// `device` or in the host pool, and the host master equal to the weights, all to the bit. Step 2
// leaves one parameter without a gradient: it and its moments must not change.
inline void expect_offloaded_adamw_matches_adamw(Device device, const optim::AdamWOptions& opts,
                                                 bool moments_on_device) {
  ParamSet ref = make_params(device), off = make_params(device);
  optim::OffloadOptions offload;
  offload.moments_on_device = moments_on_device;
  offload.pipeline_chunk_elements = 1000;
  optim::AdamW adamw(ref.named(), opts);
  optim::OffloadedAdamW offloaded(off.named(), opts, offload);
  for (int step = 1; step <= 3; ++step) {
    const size_t skip = step == 2 ? 2 : SIZE_MAX;
    set_random_grads(ref, static_cast<uint64_t>(step), skip);
    set_random_grads(off, static_cast<uint64_t>(step), skip);
    const float lr = 1e-2f * static_cast<float>(step);
    const std::vector<uint32_t> skipped_before =
        step == 2 ? bits_of(off.tensors[2]) : std::vector<uint32_t>{};
    adamw.step(lr);
    offloaded.step(lr);
    expect_bitwise_equal(off, ref, "step " + std::to_string(step));
    // Matching AdamW is not enough: both could move a parameter without a gradient.
    if (step == 2) {
      EXPECT_EQ(bits_of(off.tensors[2]), skipped_before) << off.names[2] << " moved";
    }
    EXPECT_EQ(offloaded.steps_taken(), step);
  }
  const auto want = adamw.state(), got = offloaded.state();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_EQ(want[i].second->device(), device);
    EXPECT_EQ(got[i].second->device(), moments_on_device ? device : Device::host()) << got[i].first;
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

// bf16 weights on `device`: over two steps the fp32 master in the host pool follows fp32 AdamW
// from the same starting values exactly, and the weights are the master rounded to bf16 (on the
// host, nearest even).
inline void expect_bf16_weights_are_the_rounded_fp32_master(Device device) {
  ParamSet off = make_params(device, DType::BF16);
  ParamSet ref = make_params(device, DType::F32);
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

// ---- through Runtime ---------------------------------------------------------------------------

// The golden model (tests/data/golden/llama-tiny-gqa) on `device` ("cpu", "cuda"), without
// gradient clipping and with every parameter decayed, then `sets`.
inline train::Config golden_config(const std::string& device,
                                   const std::vector<std::string>& sets) {
  std::vector<std::string> all = {"train.device=" + device, "model.from_hf=" + kGoldenModelDir,
                                  "optim.grad_clip=0", "optim.decay_norms_and_embeddings=true"};
  all.insert(all.end(), sets.begin(), sets.end());
  return train::Config::parse("{}", all, "golden");
}

// The golden batch, as one micro-batch.
inline std::vector<Batch> golden_batch() {
  const SafetensorsFile file = SafetensorsFile::open(kGoldenModelDir + "/batch.safetensors");
  Batch b;
  b.input_ids = file.load("input_ids", Device::cpu(), DType::I64);
  b.targets = file.load("targets", Device::cpu(), DType::I64);
  b.num_target_tokens = count_target_tokens(b.targets);
  return {b};
}

// One training step of each Runtime on `batch` at `lr`: the same loss and gradient norm, and the
// same parameters and optimizer state, to the bit.
inline void expect_runtime_steps_bitwise_equal(train::Runtime& on_device, train::Runtime& offloaded,
                                               const std::vector<Batch>& batch, float lr) {
  const train::StepResult a = on_device.train_step(batch, lr);
  const train::StepResult b = offloaded.train_step(batch, lr);
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

}  // namespace shardtrain::testing
