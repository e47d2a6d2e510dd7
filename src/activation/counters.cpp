#include "shardtrain/activation/counters.h"

#include <mutex>

namespace shardtrain::activation {

namespace {
std::mutex g_mutex;
ActivationCounters g_counters;
}  // namespace

ActivationCounters activation_counters() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_counters;
}

void reset_activation_counters() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_counters = {};
}

namespace detail {
void count_rerun(double seconds) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_counters.forward_reruns += 1;
  g_counters.recompute_seconds += seconds;
}

void count_offload(int64_t bytes, double seconds) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_counters.bytes_offloaded += bytes;
  g_counters.transfer_seconds += seconds;
}

void count_restore(int64_t bytes, double seconds) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_counters.bytes_restored += bytes;
  g_counters.transfer_seconds += seconds;
}

void count_transfer_wait(double seconds) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_counters.transfer_seconds += seconds;
}

void count_copy(double seconds) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_counters.copy_seconds += seconds;
}
}  // namespace detail

}  // namespace shardtrain::activation
