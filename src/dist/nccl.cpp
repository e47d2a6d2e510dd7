// NcclProcessGroup (compiled only with NCCL; see include/shardtrain/dist/nccl.h for its status).
#include "shardtrain/dist/nccl.h"

#include "shardtrain/dist/mpi.h"

#ifdef SHARDTRAIN_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <exception>
#include <thread>

#include "shardtrain/backend/cuda.h"
#endif

namespace shardtrain::dist {

#ifndef SHARDTRAIN_HAVE_NCCL

bool nccl_available() {
  return false;
}

namespace {
[[noreturn]] void no_nccl() {
  throw ConfigError(
      "the NCCL backend is not part of this build (configure with CUDA and NCCL available); use "
      "dist.backend=mpi");
}
}  // namespace

std::unique_ptr<ProcessGroup> make_nccl_process_group(MPI_Comm, int, double) {
  no_nccl();
}

std::unique_ptr<ProcessGroup> make_single_rank_nccl_group(int, double) {
  no_nccl();
}

#else

bool nccl_available() {
  return true;
}

namespace {

void check_nccl(ncclResult_t r, const char* call) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  throw DistributedError(
      detail::concat("NCCL call ", call, " failed: ", ncclGetErrorString(r),
                     " (set NCCL_DEBUG=INFO for NCCL's own account of the failure)"));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32:
      return ncclFloat32;
    case DType::BF16:
      return ncclBfloat16;
    case DType::F16:
      return ncclFloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
    case DType::U8:
      return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  return op == ReduceOp::Sum ? ncclSum : ncclMax;
}

cudaStream_t as_stream(void* h) {
  return static_cast<cudaStream_t>(h);
}

// Shared by the group and its pending works: aborting it makes every pending work fail.
struct NcclComm {
  ncclComm_t comm = nullptr;
  bool aborted = false;
  // A collective was abandoned unfinished (its Work destroyed while an error unwound): a peer
  // may never join it, and ncclCommDestroy would wait for it.
  bool abandoned = false;
  ~NcclComm() {
    if (comm == nullptr || aborted) return;
    if (abandoned)
      ncclCommAbort(comm);  // frees the communicator without waiting for its collectives
    else
      ncclCommDestroy(comm);
  }
  void abort() {
    if (comm != nullptr && !aborted) ncclCommAbort(comm);
    aborted = true;
  }
};

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclComm> comm, std::string what, double timeout_s)
      : comm_(std::move(comm)), what_(std::move(what)), timeout_s_(timeout_s) {}
  ~NcclWork() override {
    // Never block here (see MpiWork): abandon an unfinished collective with its buffers.
    if (done_) return;
    try {
      if (done_event.query()) return;
    } catch (const std::exception&) {
      // A CUDA error (sticky after a fault) must not escape a destructor that may run while an
      // exception unwinds: treat the collective as unfinished.
    }
    static_cast<void>(new std::vector<Tensor>(std::move(keep)));
    comm_->abandoned = true;
  }

  bool is_completed() override {
    if (!done_ && done_event.query()) finish();
    return done_;
  }

  void wait() override {
    if (done_) return;
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    for (int polls = 0; !done_event.query(); ++polls) {
      ST_CHECK_AS(DistributedError, !comm_->aborted, what_,
                  ": the NCCL communicator was aborted after an earlier failure");
      ncclResult_t async = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm_->comm, &async), "ncclCommGetAsyncError");
      if (async != ncclSuccess && async != ncclInProgress) {
        comm_->abort();
        check_nccl(async, what_.c_str());
      }
      if (timeout_s_ > 0 &&
          std::chrono::duration<double>(Clock::now() - start).count() > timeout_s_) {
        comm_->abort();
        throw DistributedError(detail::concat(
            what_, " did not finish within ", timeout_s_,
            " s; the NCCL communicator was aborted. Another rank has probably failed (see its "
            "log); dist.timeout_s sets this limit"));
      }
      if (polls > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    finish();
  }

  cuda::Event done_event;
  std::vector<Tensor> keep;

 private:
  void finish() {
    done_ = true;
    // Later kernels on the caller's stream see the result.
    done_event.block(cuda::current_stream());
    keep.clear();
  }
  std::shared_ptr<NcclComm> comm_;
  std::string what_;
  double timeout_s_;
  bool done_ = false;
};

class NcclProcessGroup : public ProcessGroup {
 public:
  // Over the ranks of `comm`: rank 0 makes the unique id, MPI broadcasts it.
  NcclProcessGroup(MPI_Comm comm, int device, double timeout_s)
      : host_(std::make_unique<MpiProcessGroup>(comm, timeout_s)),
        device_(device),
        stream_(device) {
    cuda::DeviceGuard guard(device_);
    ncclUniqueId id{};
    if (host_->rank() == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    auto& mpi = static_cast<MpiProcessGroup&>(*host_);
    check_mpi(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, mpi.comm()), "MPI_Bcast(ncclUniqueId)");
    init(id, timeout_s);
  }

  // This process alone: the unique id never leaves it.
  NcclProcessGroup(int device, double timeout_s)
      : host_(std::make_unique<LocalProcessGroup>()), device_(device), stream_(device) {
    cuda::DeviceGuard guard(device_);
    ncclUniqueId id{};
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    init(id, timeout_s);
  }
  ~NcclProcessGroup() override = default;

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string backend_name() const override { return "nccl"; }

  WorkPtr all_gather(const Tensor& input, Tensor& output) override {
    check_all_gather(input, output);
    check_device(input, "all_gather");
    check_device(output, "all_gather");
    return launch("all_gather of " + input.describe(), {input, output}, [&](cudaStream_t s) {
      return ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                           nccl_type(input.dtype()), comm_->comm, s);
    });
  }

  WorkPtr reduce_scatter(const Tensor& input, Tensor& output) override {
    check_reduce_scatter(input, output);
    check_device(input, "reduce_scatter");
    check_device(output, "reduce_scatter");
    return launch("reduce_scatter of " + input.describe(), {input, output}, [&](cudaStream_t s) {
      return ncclReduceScatter(input.data_ptr(), output.data_ptr(),
                               static_cast<size_t>(output.numel()), nccl_type(input.dtype()),
                               ncclSum, comm_->comm, s);
    });
  }

  WorkPtr all_reduce(Tensor& tensor, ReduceOp op) override {
    check_reduce(tensor, "all_reduce");
    check_device(tensor, "all_reduce");
    return launch("all_reduce of " + tensor.describe(), {tensor}, [&](cudaStream_t s) {
      return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(),
                           static_cast<size_t>(tensor.numel()), nccl_type(tensor.dtype()),
                           nccl_op(op), comm_->comm, s);
    });
  }

  WorkPtr broadcast(Tensor& tensor, int root) override {
    check_device(tensor, "broadcast");
    ST_CHECK(root >= 0 && root < size(), "broadcast from rank ", root, " in a group of ", size(),
             " ranks");
    return launch("broadcast of " + tensor.describe(), {tensor}, [&](cudaStream_t s) {
      return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(),
                           static_cast<size_t>(tensor.numel()), nccl_type(tensor.dtype()), root,
                           comm_->comm, s);
    });
  }

  void barrier() override { host_->barrier(); }
  void all_reduce_host(std::vector<double>& values, ReduceOp op) override {
    host_->all_reduce_host(values, op);
  }
  void all_reduce_host(std::vector<int64_t>& values, ReduceOp op) override {
    host_->all_reduce_host(values, op);
  }
  using ProcessGroup::all_reduce_host;

 private:
  void init(const ncclUniqueId& id, double timeout_s) {
    timeout_s_ = timeout_s;
    comm_ = std::make_shared<NcclComm>();
    check_nccl(ncclCommInitRank(&comm_->comm, host_->size(), id, host_->rank()),
               "ncclCommInitRank");
  }

  void check_device(const Tensor& t, const char* what) const {
    ST_CHECK_SHAPE(t.device().is_cuda() && t.device().index == device_, what,
                   " on the NCCL backend needs tensors on cuda:", device_, ", got ", t.describe());
  }

  template <typename Call>
  WorkPtr launch(std::string what, std::vector<Tensor> tensors, Call call) {
    ST_CHECK_AS(DistributedError, !comm_->aborted, what,
                ": the NCCL communicator was aborted after an earlier failure");
    cuda::DeviceGuard guard(device_);
    // The collective starts after the work already queued on the caller's stream.
    cuda::Event ready;
    ready.record(cuda::current_stream(device_));
    ready.block(stream_.view());
    check_nccl(call(as_stream(stream_.handle())), what.c_str());
    auto work = std::make_shared<NcclWork>(comm_, std::move(what), timeout_s_);
    work->done_event.record(stream_.view());
    work->keep = std::move(tensors);
    return work;
  }

  // The unique-id broadcast, barriers and host-number reductions: MPI, or the local group of a
  // one-rank group.
  std::unique_ptr<ProcessGroup> host_;
  int device_;
  cuda::Stream stream_;
  std::shared_ptr<NcclComm> comm_;
};

}  // namespace

std::unique_ptr<ProcessGroup> make_nccl_process_group(MPI_Comm comm, int device, double timeout_s) {
  return std::make_unique<NcclProcessGroup>(comm, device, timeout_s);
}

std::unique_ptr<ProcessGroup> make_single_rank_nccl_group(int device, double timeout_s) {
  return std::make_unique<NcclProcessGroup>(device, timeout_s);
}

#endif

}  // namespace shardtrain::dist
