// Helpers for the tests that run kernels/*.cu on the simt emulator: a Scratch in guarded host
// memory and the schedules every kernel is run under (simt_kernel_checks.h adds the operands).
#pragma once
// simt.h defines CUDA keywords that must precede the CUDA headers kernels.h brings in.
#include "simt.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../cuda/cuda_test_util.h"
#include "kernels.h"

namespace shardtrain::testing {

// Scratch memory in guarded buffers, each poisoned with 0xff bytes.
class GuardedScratch : public kernels::Scratch {
 public:
  void* get(size_t bytes) override {
    buffers_.push_back(std::make_unique<simt::GuardedBuffer>(bytes));
    std::memset(buffers_.back()->data(), 0xff, bytes);
    return buffers_.back()->data();
  }

 private:
  std::vector<std::unique_ptr<simt::GuardedBuffer>> buffers_;
};

// In-order with copies at issue, then shuffled thread orders with cp.async landing at issue and
// at the wait: a kernel whose results depend on the schedule is missing a barrier or reads a
// copy before it has landed.
inline std::vector<simt::Options> schedules() {
  simt::Options in_order;
  simt::Options shuffled_deferred;
  shuffled_deferred.shuffle = true;
  shuffled_deferred.seed = 7;
  shuffled_deferred.cp_async = simt::CpAsync::deferred;
  simt::Options shuffled_at_issue;
  shuffled_at_issue.shuffle = true;
  shuffled_at_issue.seed = 11;
  return {in_order, shuffled_deferred, shuffled_at_issue};
}

inline std::string describe(const simt::Options& o) {
  return std::string(o.shuffle ? "shuffled (seed " + std::to_string(o.seed) + ")" : "in order") +
         (o.cp_async == simt::CpAsync::deferred ? ", cp.async at wait" : ", cp.async at issue");
}

// Restores the default schedule when a test ends.
struct ScheduleGuard {
  explicit ScheduleGuard(const simt::Options& o) { simt::set_options(o); }
  ~ScheduleGuard() { simt::set_options(simt::Options{}); }
};

}  // namespace shardtrain::testing
