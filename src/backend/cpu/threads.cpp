// Sharing a node's CPUs among the ranks that run on it (see cpu_threads.h).
#include "shardtrain/backend/cpu_threads.h"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

namespace shardtrain {

namespace {

int usable_cpu_count() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof mask, &mask) == 0) return std::max(1, CPU_COUNT(&mask));
  return std::max(1, omp_get_num_procs());
}

int online_cpu_count() {
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : usable_cpu_count();
}

}  // namespace

int fair_cpu_threads(int usable_cpus, int node_cpus, int processes_on_node) {
  const int share = std::max(1, node_cpus) / std::max(1, processes_on_node);
  return std::max(1, std::min(std::max(1, usable_cpus), share));
}

int cpu_thread_count() {
  return omp_get_max_threads();
}

CpuThreadShare share_cpu_threads(int processes_on_node) {
  CpuThreadShare share;
  share.usable_cpus = usable_cpu_count();
  share.node_cpus = std::max(online_cpu_count(), share.usable_cpus);
  const char* env = std::getenv("OMP_NUM_THREADS");
  share.from_environment = env != nullptr && *env != '\0';
  share.threads = omp_get_max_threads();
  if (share.from_environment || processes_on_node <= 1) return share;
  const int fair = fair_cpu_threads(share.usable_cpus, share.node_cpus, processes_on_node);
  if (fair < share.threads) {
    omp_set_num_threads(fair);
    share.threads = fair;
    share.changed = true;
  }
  return share;
}

}  // namespace shardtrain
