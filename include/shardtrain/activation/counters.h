// Process-wide counters of what the activation strategies did, for step metrics and tests.
#pragma once
#include <cstdint>

namespace shardtrain::activation {

struct ActivationCounters {
  int64_t forward_reruns = 0;    // checkpoint regions re-run during backward
  int64_t bytes_offloaded = 0;   // saved-tensor bytes copied from the device to the host pool
  int64_t bytes_restored = 0;    // bytes copied back from the host pool to the device
  double recompute_seconds = 0;  // wall time spent re-running regions
  // Host wall time the offload hooks spent on copies: whole copies where they are synchronous
  // (the CPU device, OffloadCopies::Synchronous); where they overlap compute (GPUs), the time to
  // issue them (allocation, events, queueing) plus any wait for one to finish before its host
  // buffer is freed. This is what offload adds to the host's critical path.
  double transfer_seconds = 0;
  // Time the copies themselves took, summed over both directions: the wall time of each copy
  // when synchronous (on a GPU that includes waiting for the work queued on the stream before
  // it); with overlapped copies on a GPU, the copy streams' busy time, measured with CUDA events
  // around each copy. Overlapped copies run beside compute, so this is bus time, not time
  // added to a step. It is added when a copy is seen finished, at the latest when backward has
  // released the tensor, so it is complete once backward has returned.
  double copy_seconds = 0;
};

// A consistent copy of the counters (they are updated under a lock from any thread).
ActivationCounters activation_counters();
void reset_activation_counters();

namespace detail {
void count_rerun(double seconds);
void count_offload(int64_t bytes, double seconds);
void count_restore(int64_t bytes, double seconds);
// Host time spent waiting for a copy (counted in transfer_seconds).
void count_transfer_wait(double seconds);
void count_copy(double seconds);
}  // namespace detail

}  // namespace shardtrain::activation
