// Collective communication among a group of ranks (the processes of one training job).
//
// Every collective is asynchronous: it returns a Work handle, and its output may be read only
// after wait(). A group's collectives must be issued in the same order on every member (the
// usual MPI/NCCL rule); sharded training guarantees this because all ranks run the same program
// over the same model.
//
// Reductions always SUM or take the MAX elementwise. Backends:
//   - LocalProcessGroup: one rank; collectives are copies (single-process runs, and the "shard
//     group" of plain data parallelism).
//   - MpiProcessGroup (dist/mpi.h): MPI non-blocking collectives; host and CPU-device tensors
//     directly, CUDA tensors staged through host memory.
//   - NcclProcessGroup (dist/nccl.h): NCCL on CUDA tensors, in builds with NCCL.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/tensor/tensor.h"

namespace shardtrain::dist {

enum class ReduceOp { Sum, Max };
std::string_view reduce_op_name(ReduceOp op);

// A pending collective. wait() blocks until it has finished, throwing DistributedError when it
// failed or exceeded the group's timeout (after a timeout the collective stays pending and a
// later wait() may still complete it). Always wait() for a Work: destroying an unfinished one
// never blocks (an exception unwinding past it must reach the error handler) but abandons the
// collective and leaks its buffers, since the transfer might still write into them.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  // True once the collective has finished (wait() then returns at once).
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// A Work that is complete from the start (collectives of a one-rank group).
WorkPtr completed_work();

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend_name() const = 0;  // "local", "mpi", "nccl"

  // output [size * n] = concatenation of every rank's input [n], in rank order. Same dtype;
  // contiguous tensors of any shape (only element counts matter).
  virtual WorkPtr all_gather(const Tensor& input, Tensor& output) = 0;
  // output [n] = this rank's block of the elementwise sum of every rank's input [size * n].
  virtual WorkPtr reduce_scatter(const Tensor& input, Tensor& output) = 0;
  // tensor = elementwise op over every rank's tensor, in place.
  virtual WorkPtr all_reduce(Tensor& tensor, ReduceOp op) = 0;
  // tensor = root's tensor, in place.
  virtual WorkPtr broadcast(Tensor& tensor, int root) = 0;
  // Returns when every rank has entered the barrier (or throws after the timeout).
  virtual void barrier() = 0;

  // Host numbers (token counts, norms, flags), reduced exactly in fp64 / int64. Blocking.
  virtual void all_reduce_host(std::vector<double>& values, ReduceOp op) = 0;
  virtual void all_reduce_host(std::vector<int64_t>& values, ReduceOp op) = 0;
  double all_reduce_host(double value, ReduceOp op);
  int64_t all_reduce_host(int64_t value, ReduceOp op);
  // For each value (a hash, a count): whether some rank holds another value at that position.
  // Exact; every rank gets the same answer. Every rank must pass the same number of values.
  std::vector<bool> differs_between_ranks(const std::vector<uint64_t>& values);

  // How long wait() waits before declaring the collective failed (seconds; <= 0: forever).
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  double timeout() const { return timeout_s_; }

 protected:
  // Shape and dtype checks shared by the backends; throw ShapeError naming the collective.
  void check_all_gather(const Tensor& input, const Tensor& output) const;
  void check_reduce_scatter(const Tensor& input, const Tensor& output) const;
  void check_reduce(const Tensor& tensor, const char* what) const;

  double timeout_s_ = 600.0;
};

// The group of one rank.
class LocalProcessGroup : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend_name() const override { return "local"; }
  WorkPtr all_gather(const Tensor& input, Tensor& output) override;
  WorkPtr reduce_scatter(const Tensor& input, Tensor& output) override;
  WorkPtr all_reduce(Tensor& tensor, ReduceOp op) override;
  WorkPtr broadcast(Tensor& tensor, int root) override;
  void barrier() override {}
  void all_reduce_host(std::vector<double>&, ReduceOp) override {}
  void all_reduce_host(std::vector<int64_t>&, ReduceOp) override {}
  using ProcessGroup::all_reduce_host;
};

}  // namespace shardtrain::dist
