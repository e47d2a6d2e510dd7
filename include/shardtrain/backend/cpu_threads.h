// How many OpenMP threads a process's CPU work uses: the CPU backend's ops, OpenBLAS (the
// OpenMP build follows omp_set_num_threads) and the CPU AdamW of optimizer offload.
//
// OpenMP's default is one thread per CPU the process may run on. When several ranks of a job
// share a node without being pinned to their own cores (`mpirun --bind-to none`, an
// oversubscribed job, or ranks bound to a whole socket each), every rank then starts a thread per
// CPU, and the node runs ranks x CPUs threads that spin at each other's barriers: steps of the
// CPU backend slow down by an order of magnitude. torchrun sets OMP_NUM_THREADS=1 for the same
// reason; here each rank gets its share of the CPUs instead.
#pragma once

namespace shardtrain {

struct CpuThreadShare {
  int threads = 1;                // OpenMP threads per process, now in force
  int usable_cpus = 1;            // CPUs this process may run on (its affinity mask)
  int node_cpus = 1;              // CPUs online on the node
  bool from_environment = false;  // OMP_NUM_THREADS is set: left as it says
  bool changed = false;           // lowered from OpenMP's default by share_cpu_threads
};

// The thread count for one of `processes_on_node` processes that share the node's CPUs:
// min(usable_cpus, node_cpus / processes_on_node), at least 1.
int fair_cpu_threads(int usable_cpus, int node_cpus, int processes_on_node);

// The OpenMP threads this process's CPU work runs on now.
int cpu_thread_count();

// When OMP_NUM_THREADS is unset and `processes_on_node` > 1, lowers this process's OpenMP
// threads to fair_cpu_threads (never raises them). Call before the first parallel region.
CpuThreadShare share_cpu_threads(int processes_on_node);

}  // namespace shardtrain
