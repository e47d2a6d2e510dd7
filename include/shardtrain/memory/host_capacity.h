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

// The most bytes the CPU device's (or the system host pool's) allocator holds, in use and
// cached for reuse together, when at most `peak_in_use` bytes were in use at once: it keeps
// freed blocks up to an eighth over that high-water mark plus 16 MiB (memory/allocator.cpp).
int64_t cpu_allocator_bound(int64_t peak_in_use);

}  // namespace shardtrain
