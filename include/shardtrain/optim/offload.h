// AdamW with its state in host memory (ZeRO-Offload style): the device keeps only the parameters
// and their gradients; the fp32 master weights and both moments live in the host pool
// (Device::host(), MemoryCategory::OptimizerState there), and the update runs on the CPU.
//
// One step, for every parameter with a gradient, in pieces of at most
// OffloadOptions::pipeline_chunk_elements elements:
//   1. download: the gradient piece is copied from the device into a host staging slot;
//   2. update:   CPU AdamW (cpu_adam.h) on the host master, moments and staged gradient;
//   3. upload:   the updated master piece is copied into the device parameter (rounded first, on
//                the host, into the parameter's dtype when that is not f32).
// The three stages form a pipeline: a download thread, the calling thread (updates, with OpenMP
// inside) and an upload thread, joined by queues over three staging slots, so the download of
// piece k+1 and the upload of piece k-1 run while piece k is updated. On a GPU each copy thread
// issues its copies on its own CUDA stream (both ordered after the work already queued on the
// caller's stream), so device-to-host and host-to-device copies use separate copy engines and
// overlap each other and the CPU update. On the CPU device the "copies" are memcpys between the CPU
// device's memory and the host pool on the copy threads, overlapping the update of another piece
// on the remaining cores.
//
// Staging is three slots of one piece each in the host pool, counted there as
// MemoryCategory::Workspace: allocated at the first step (grown if a later step has larger pieces)
// and kept until the optimizer is destroyed. By default a slot holds one 4M-element piece of
// gradient, so the host keeps 48 MiB of staging (more with offload_moments=device or 16-bit
// parameters: each adds two or one buffers of the same size per slot).
//
// The results are bitwise equal to AdamW on the CPU device (and to any backend whose adamw kernel
// matches it bitwise). state() names the moments as AdamW does ("exp_avg.<name>",
// "exp_avg_sq.<name>"), so checkpoints are interchangeable; the master copy is not part of the
// state: it is read from the parameters at construction, before the first step (so weights loaded
// after the optimizer was created are picked up) and on reload_params().
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/optim/cpu_adam.h"
#include "shardtrain/optim/optimizer.h"

namespace shardtrain::optim {

struct OffloadOptions {
  // optim.offload_moments=device: the moments stay on the parameters' device (8 B per element
  // there) and only the fp32 master is on the host. They are then copied down and up with every
  // piece (16 more bytes per element over the bus each step); for experiments.
  bool moments_on_device = false;
  // Elements per pipeline piece: bounds the staging memory (3 pieces) and sets the granularity
  // of the overlap. 4M elements = 16 MiB of fp32 gradient per slot.
  int64_t pipeline_chunk_elements = int64_t{1} << 22;
  CpuAdamOptions cpu;  // kernel and OpenMP threads of the update
};

// Where the time of the last step went.
struct OffloadStepStats {
  double wall_seconds = 0;
  // Busy time of each stage, summed over the pieces; with overlap their sum exceeds the wall time.
  double download_seconds = 0, update_seconds = 0, upload_seconds = 0;
  int64_t bytes_down = 0, bytes_up = 0;  // over the device <-> host link
  int64_t pieces = 0;
};

class OffloadedAdamW : public Optimizer {
 public:
  // Parameters may be of any float dtype on any device (the master is fp32 either way).
  OffloadedAdamW(std::vector<NamedParam> params, AdamWOptions options, OffloadOptions offload = {});
  ~OffloadedAdamW() override;

  std::vector<std::pair<std::string, Tensor*>> state() override;
  void reload_params() override;

  // The fp32 master copy of parameter i (host pool).
  const Tensor& master(size_t i) const { return master_[i]; }
  const OffloadOptions& offload_options() const { return offload_; }
  const OffloadStepStats& last_step_stats() const { return stats_; }

 private:
  struct Pipeline;  // staging slots and the copy stages' CUDA streams
  void update(float lr, float grad_scale) override;
  void read_masters();

  AdamWOptions options_;
  OffloadOptions offload_;
  std::vector<Tensor> master_, exp_avg_, exp_avg_sq_;
  std::vector<bool> decay_;
  bool masters_stale_ = true;
  std::unique_ptr<Pipeline> pipeline_;
  OffloadStepStats stats_;
};

}  // namespace shardtrain::optim
