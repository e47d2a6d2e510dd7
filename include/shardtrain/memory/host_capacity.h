// How much memory this process may use on the host: what a training run's predicted host
// footprint is checked against before it starts (a run past it would be ended by the kernel's
// out-of-memory killer, with no message, part-way through a step).
#pragma once
#include <cstdint>
#include <string>

namespace shardtrain {

struct HostCapacity {
  int64_t bytes = 0;   // 0 = unknown
  std::string source;  // "physical memory" or "the cgroup limit (/sys/fs/cgroup/memory.max)"
};

// Physical memory, or the control group's limit when that is lower (containers, Slurm jobs
// with --mem). Never throws.
HostCapacity host_memory_capacity();

}  // namespace shardtrain
