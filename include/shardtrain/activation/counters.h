// Process-wide counters of what the activation strategies did, for step metrics and tests.
#pragma once
#include <cstdint>

namespace shardtrain::activation {

struct ActivationCounters {
  int64_t forward_reruns = 0;    // checkpoint regions re-run during backward
  int64_t bytes_offloaded = 0;   // saved-tensor bytes copied from the device to the host pool
  int64_t bytes_restored = 0;    // bytes copied back from the host pool to the device
  double recompute_seconds = 0;  // wall time spent re-running regions
  double transfer_seconds = 0;   // wall time spent in offload and restore copies
};

// A consistent copy of the counters (they are updated under a lock from any thread).
ActivationCounters activation_counters();
void reset_activation_counters();

namespace detail {
void count_rerun(double seconds);
void count_offload(int64_t bytes, double seconds);
void count_restore(int64_t bytes, double seconds);
}  // namespace detail

}  // namespace shardtrain::activation
