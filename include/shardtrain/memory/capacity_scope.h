// A cap on an allocator's bytes in use for as long as one run lasts. The allocators live as long
// as the process (tests and `bench` build many runs in one), so a run's cap must be put back when
// the run ends, and also when building it throws part-way.
#pragma once
#include <cstdint>

#include "shardtrain/memory/allocator.h"

namespace shardtrain {

class CapacityScope {
 public:
  // Caps `allocator` at `bytes` (0 = no cap) until this scope ends, then restores the cap it had.
  CapacityScope(Allocator& allocator, int64_t bytes)
      : allocator_(allocator), previous_(allocator.stats().capacity) {
    allocator_.set_capacity(bytes);
  }
  ~CapacityScope() { allocator_.set_capacity(previous_); }
  CapacityScope(const CapacityScope&) = delete;
  CapacityScope& operator=(const CapacityScope&) = delete;

 private:
  Allocator& allocator_;
  int64_t previous_;
};

}  // namespace shardtrain
