// One rank of a pretend world, in one process, for unit tests of sharding without MPI: the
// group reports the rank and size it is given, and every collective a test does not override
// completes at once and leaves its buffers as they are.
#pragma once
#include <string>
#include <vector>

#include "shardtrain/dist/process_group.h"

namespace shardtrain::testing {

class PretendRank : public dist::ProcessGroup {
 public:
  PretendRank(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "pretend"; }
  dist::WorkPtr all_gather(const Tensor& input, Tensor& output) override {
    check_all_gather(input, output);
    return dist::completed_work();
  }
  dist::WorkPtr reduce_scatter(const Tensor& input, Tensor& output) override {
    check_reduce_scatter(input, output);
    return dist::completed_work();
  }
  dist::WorkPtr all_reduce(Tensor&, dist::ReduceOp) override { return dist::completed_work(); }
  dist::WorkPtr broadcast(Tensor&, int) override { return dist::completed_work(); }
  void barrier() override {}
  void all_reduce_host(std::vector<double>&, dist::ReduceOp) override {}
  void all_reduce_host(std::vector<int64_t>&, dist::ReduceOp) override {}
  using ProcessGroup::all_reduce_host;

 private:
  int rank_, size_;
};

}  // namespace shardtrain::testing
