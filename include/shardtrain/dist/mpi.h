// MPI as RAII types: the library's lifetime (init/finalize), communicators, and the MPI
// process group.
#pragma once
// The C API only: Open MPI's deprecated C++ bindings would need libmpi_cxx at link time.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <memory>
#include <string>

#include "shardtrain/dist/process_group.h"

namespace shardtrain::dist {

// MPI_Init_thread / MPI_Finalize. Several owners may share one runtime (the test main and a
// DistEnv, say): acquire() returns the live instance or initialises MPI. MPI is finalised when
// the last owner lets go, and only if this code initialised it.
class MpiRuntime {
 public:
  static std::shared_ptr<MpiRuntime> acquire();
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  // The thread support level MPI granted (MPI_THREAD_SERIALIZED is asked for: collectives are
  // issued by one thread at a time).
  int thread_level() const { return thread_level_; }
  static bool initialized();  // MPI_Init done and MPI_Finalize not yet

 private:
  MpiRuntime();
  bool owns_ = false;
  int thread_level_ = 0;
};

// An owned communicator (MPI_Comm_free on destruction; the predefined ones are never freed).
// Errors on it are returned, not fatal, so that they surface as DistributedError.
class MpiCommunicator {
 public:
  MpiCommunicator() = default;
  // Takes ownership of `comm` (a communicator made by MPI_Comm_dup/split).
  explicit MpiCommunicator(MPI_Comm comm);
  // A duplicate of `comm`, so that this library's traffic never matches anyone else's.
  static MpiCommunicator duplicate(MPI_Comm comm);
  // MPI_Comm_split: ranks with the same color form one communicator, ordered by key.
  static MpiCommunicator split(MPI_Comm comm, int color, int key);
  // MPI_Comm_split_type(MPI_COMM_TYPE_SHARED): the ranks sharing this node's memory.
  static MpiCommunicator split_shared(MPI_Comm comm);
  ~MpiCommunicator();
  MpiCommunicator(MpiCommunicator&& other) noexcept;
  MpiCommunicator& operator=(MpiCommunicator&& other) noexcept;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  MPI_Comm get() const { return comm_; }
  int rank() const;
  int size() const;

 private:
  void reset();
  MPI_Comm comm_ = MPI_COMM_NULL;
};

// Throws DistributedError naming the call and MPI's error string when `code` is not
// MPI_SUCCESS.
void check_mpi(int code, const char* call);

// Collectives over an MPI communicator with non-blocking MPI calls (MPI_Iallgather,
// MPI_Ireduce_scatter_block, MPI_Iallreduce, MPI_Ibcast, MPI_Ibarrier).
//   - f32 reductions run in MPI_FLOAT, integer ones in MPI_INT32_T / MPI_INT64_T.
//   - bf16 and f16 have no MPI reduction type: they are staged through an f32 copy, reduced in
//     f32 and rounded once into the output (more accurate than a reduction in 16-bit, and the
//     staging costs 2x the traffic of the 16-bit data). Gathers and broadcasts move 16-bit data
//     as is.
//   - CUDA tensors are copied to host memory, communicated, and copied back on wait().
// wait() polls with MPI_Test so that it can give up after the timeout. Open MPI progresses
// non-blocking collectives inside MPI calls, so a prefetched collective mostly advances when the
// next one is issued or waited on.
class MpiProcessGroup : public ProcessGroup {
 public:
  // Communicates over a duplicate of `comm`.
  explicit MpiProcessGroup(MPI_Comm comm, double timeout_s = 600.0);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "mpi"; }
  WorkPtr all_gather(const Tensor& input, Tensor& output) override;
  WorkPtr reduce_scatter(const Tensor& input, Tensor& output) override;
  WorkPtr all_reduce(Tensor& tensor, ReduceOp op) override;
  WorkPtr broadcast(Tensor& tensor, int root) override;
  void barrier() override;
  void all_reduce_host(std::vector<double>& values, ReduceOp op) override;
  void all_reduce_host(std::vector<int64_t>& values, ReduceOp op) override;
  using ProcessGroup::all_reduce_host;

  MPI_Comm comm() const { return comm_.get(); }

 private:
  MpiCommunicator comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace shardtrain::dist
