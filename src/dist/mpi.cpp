// MpiRuntime, MpiCommunicator and MpiProcessGroup.
#include "shardtrain/dist/mpi.h"

#include <chrono>
#include <climits>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace shardtrain::dist {

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw DistributedError(detail::concat("MPI call ", call, " failed: ", text));
}

// ---- MpiRuntime -----------------------------------------------------------------------------

bool MpiRuntime::initialized() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init != 0 && fin == 0;
}

MpiRuntime::MpiRuntime() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (fin != 0)
    throw DistributedError(
        "MPI was already finalized in this process and cannot be started again; create one "
        "DistEnv (or MpiRuntime) for the whole program");
  if (init == 0) {
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &thread_level_),
              "MPI_Init_thread");
    owns_ = true;
  } else {
    MPI_Query_thread(&thread_level_);
  }
  // The start-up watchdog ends a job from its own thread (MPI_Abort) while the main thread may be
  // inside MPI: a library that serializes nothing between threads cannot take that safely.
  if (thread_level_ < MPI_THREAD_SERIALIZED)
    throw DistributedError(
        "the MPI library grants thread level " + std::to_string(thread_level_) +
        (owns_ ? "" : " (MPI was started before shardtrain)") +
        ", below MPI_THREAD_SERIALIZED, which shardtrain needs (a watchdog thread can end the "
        "job): use an MPI built with thread support (Open MPI is), or start MPI with "
        "MPI_Init_thread(..., MPI_THREAD_SERIALIZED, ...)");
}

MpiRuntime::~MpiRuntime() {
  // MPI_Finalize is collective: while an exception unwinds (this rank failed, and the others may
  // be blocked in a collective it will never join) it could wait forever, so MPI is left running
  // for the top-level handler to call abort_job(). A rank that exits without finalising makes
  // mpirun end the job as failed, too.
  if (owns_ && initialized() && std::uncaught_exceptions() == 0) MPI_Finalize();
}

std::shared_ptr<MpiRuntime> MpiRuntime::acquire() {
  static std::mutex mutex;
  static std::weak_ptr<MpiRuntime> live;
  std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<MpiRuntime> r = live.lock();
  if (!r) {
    r = std::shared_ptr<MpiRuntime>(new MpiRuntime());
    live = r;
  }
  return r;
}

// ---- MpiCommunicator ------------------------------------------------------------------------

MpiCommunicator::MpiCommunicator(MPI_Comm comm) : comm_(comm) {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
}

MpiCommunicator MpiCommunicator::duplicate(MPI_Comm comm) {
  MPI_Comm out = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(comm, &out), "MPI_Comm_dup");
  return MpiCommunicator(out);
}

MpiCommunicator MpiCommunicator::split(MPI_Comm comm, int color, int key) {
  MPI_Comm out = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(comm, color, key, &out), "MPI_Comm_split");
  return MpiCommunicator(out);
}

MpiCommunicator MpiCommunicator::split_shared(MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm out = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &out),
            "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)");
  return MpiCommunicator(out);
}

MpiCommunicator::~MpiCommunicator() {
  reset();
}

MpiCommunicator::MpiCommunicator(MpiCommunicator&& other) noexcept : comm_(other.comm_) {
  other.comm_ = MPI_COMM_NULL;
}

MpiCommunicator& MpiCommunicator::operator=(MpiCommunicator&& other) noexcept {
  if (this != &other) {
    reset();
    comm_ = other.comm_;
    other.comm_ = MPI_COMM_NULL;
  }
  return *this;
}

void MpiCommunicator::reset() {
  // Not while an exception unwinds: the job is failing and freeing may synchronise.
  if (comm_ != MPI_COMM_NULL && comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_SELF &&
      MpiRuntime::initialized() && std::uncaught_exceptions() == 0)
    MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
}

int MpiCommunicator::rank() const {
  int r = 0;
  check_mpi(MPI_Comm_rank(comm_, &r), "MPI_Comm_rank");
  return r;
}

int MpiCommunicator::size() const {
  int s = 0;
  check_mpi(MPI_Comm_size(comm_, &s), "MPI_Comm_size");
  return s;
}

// ---- MpiProcessGroup --------------------------------------------------------------------------

namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::BF16:
    case DType::F16:
      return MPI_UINT16_T;  // moved as bits; never reduced in 16-bit
    case DType::I32:
      return MPI_INT32_T;
    case DType::I64:
      return MPI_INT64_T;
    case DType::U8:
      return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(ReduceOp op) {
  return op == ReduceOp::Sum ? MPI_SUM : MPI_MAX;
}

// The dtype a reduction is carried out in: 16-bit floats go through f32.
DType reduction_dtype(DType t) {
  return t == DType::BF16 || t == DType::F16 ? DType::F32 : t;
}

int mpi_count(int64_t n, const char* what) {
  ST_CHECK_AS(DistributedError, n <= INT_MAX, what, ": ", n,
              " elements exceed the 2^31-1 elements one MPI call can move; use smaller units");
  return static_cast<int>(n);
}

// `t` itself when CPU code can use it in `dtype`, else a staging copy (host memory for CUDA
// tensors), counted as Workspace.
Tensor staged(const Tensor& t, DType dtype, bool copy_values) {
  if (t.device().cpu_addressable() && t.dtype() == dtype) return t;
  CategoryScope scope(MemoryCategory::Workspace);
  Device where = t.device().cpu_addressable() ? t.device() : Device::host();
  Tensor out = empty(t.shape(), dtype, where);
  if (copy_values) out.copy_from(t);
  return out;
}

class MpiWork : public Work {
 public:
  MpiWork(std::string what, int rank, double timeout_s)
      : what_(std::move(what)), rank_(rank), timeout_s_(timeout_s) {}
  ~MpiWork() override {
    if (done_) return;
    // Never block here: a Work dropped while an exception unwinds may wait on ranks that will
    // never join. Finish it if it is done; otherwise abandon it, keeping its buffers alive
    // forever so that the transfer cannot write into freed memory.
    int flag = 0;
    if (!failed_ && MPI_Test(&request, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag != 0) {
      try {
        complete();
        return;
      } catch (const std::exception& e) {
        // Nobody waits on this collective any more (an error is unwinding the step): say what
        // went wrong, as the error that ends the job may not.
        std::fprintf(stderr, "warning: dropped %s could not finish: %s\n", what_.c_str(), e.what());
      }
    }
    static_cast<void>(new std::vector<Tensor>(std::move(keep)));
    static_cast<void>(new std::shared_ptr<void>(std::move(keep_host)));
  }

  bool is_completed() override {
    if (done_) return true;
    int flag = 0;
    check_mpi(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), what_.c_str());
    if (flag != 0) complete();
    return done_;
  }

  void wait() override {
    if (done_) return;
    ST_CHECK_AS(DistributedError, !failed_, what_, " failed earlier on rank ", rank_);
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    for (int polls = 0;; ++polls) {
      int flag = 0;
      int code = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
      if (code != MPI_SUCCESS) {
        failed_ = true;
        check_mpi(code, what_.c_str());
      }
      if (flag != 0) break;
      if (timeout_s_ > 0 &&
          std::chrono::duration<double>(Clock::now() - start).count() > timeout_s_) {
        // The collective stays pending: a later wait() may still complete it.
        throw DistributedError(detail::concat(
            what_, " did not finish within ", timeout_s_, " s on rank ", rank_,
            ": another rank has probably failed or stopped issuing collectives (see its log); "
            "dist.timeout_s sets this limit"));
      }
      // Spin briefly (collectives of small tensors finish in microseconds), then back off so
      // that oversubscribed ranks leave the cores to the ranks doing work.
      if (polls < 200)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(polls < 2000 ? 20 : 200));
    }
    complete();
  }

  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<Tensor> keep;         // buffers MPI reads or writes until completion
  std::shared_ptr<void> keep_host;  // the same for host numbers
  std::function<void()> finish;     // copies staged results into the caller's tensor

 private:
  void complete() {
    done_ = true;
    if (finish) finish();
    finish = nullptr;
    keep.clear();
  }
  std::string what_;
  int rank_;
  double timeout_s_;
  bool done_ = false;
  bool failed_ = false;
};

}  // namespace

MpiProcessGroup::MpiProcessGroup(MPI_Comm comm, double timeout_s)
    : comm_(MpiCommunicator::duplicate(comm)) {
  rank_ = comm_.rank();
  size_ = comm_.size();
  timeout_s_ = timeout_s;
}

WorkPtr MpiProcessGroup::all_gather(const Tensor& input, Tensor& output) {
  check_all_gather(input, output);
  int n = mpi_count(input.numel(), "all_gather");
  auto work = std::make_shared<MpiWork>("all_gather of " + input.describe(), rank_, timeout_s_);
  Tensor out = staged(output, output.dtype(), false);
  size_t block = input.nbytes();
  bool in_place = out.is_same(output) && input.device() == output.device() &&
                  input.data_ptr() == static_cast<char*>(output.data_ptr()) + block * rank_;
  Tensor in = in_place ? input : staged(input, input.dtype(), true);
  MPI_Datatype type = mpi_type(input.dtype());
  check_mpi(MPI_Iallgather(in_place ? MPI_IN_PLACE : in.data_ptr(), n, type, out.data_ptr(), n,
                           type, comm_.get(), &work->request),
            "MPI_Iallgather");
  work->keep = {in, out, input, output};
  if (!out.is_same(output)) work->finish = [output, out]() mutable { output.copy_from(out); };
  return work;
}

WorkPtr MpiProcessGroup::reduce_scatter(const Tensor& input, Tensor& output) {
  check_reduce_scatter(input, output);
  int n = mpi_count(output.numel(), "reduce_scatter");
  DType rt = reduction_dtype(input.dtype());
  auto work = std::make_shared<MpiWork>("reduce_scatter of " + input.describe(), rank_, timeout_s_);
  Tensor in = staged(input, rt, true);
  Tensor out = staged(output, rt, false);
  check_mpi(MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), n, mpi_type(rt), MPI_SUM,
                                      comm_.get(), &work->request),
            "MPI_Ireduce_scatter_block");
  work->keep = {in, out, input, output};
  if (!out.is_same(output)) work->finish = [output, out]() mutable { output.copy_from(out); };
  return work;
}

WorkPtr MpiProcessGroup::all_reduce(Tensor& tensor, ReduceOp op) {
  check_reduce(tensor, "all_reduce");
  int n = mpi_count(tensor.numel(), "all_reduce");
  DType rt = reduction_dtype(tensor.dtype());
  auto work = std::make_shared<MpiWork>(
      detail::concat("all_reduce(", reduce_op_name(op), ") of ", tensor.describe()), rank_,
      timeout_s_);
  Tensor buf = staged(tensor, rt, true);
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buf.data_ptr(), n, mpi_type(rt), mpi_op(op), comm_.get(),
                           &work->request),
            "MPI_Iallreduce");
  work->keep = {buf, tensor};
  if (!buf.is_same(tensor)) work->finish = [tensor, buf]() mutable { tensor.copy_from(buf); };
  return work;
}

WorkPtr MpiProcessGroup::broadcast(Tensor& tensor, int root) {
  ST_CHECK_SHAPE(tensor.defined(), "broadcast: undefined tensor");
  ST_CHECK(root >= 0 && root < size_, "broadcast from rank ", root, " in a group of ", size_,
           " ranks");
  int n = mpi_count(tensor.numel(), "broadcast");
  auto work = std::make_shared<MpiWork>("broadcast of " + tensor.describe(), rank_, timeout_s_);
  Tensor buf = staged(tensor, tensor.dtype(), rank_ == root);
  check_mpi(
      MPI_Ibcast(buf.data_ptr(), n, mpi_type(tensor.dtype()), root, comm_.get(), &work->request),
      "MPI_Ibcast");
  work->keep = {buf, tensor};
  if (!buf.is_same(tensor)) work->finish = [tensor, buf]() mutable { tensor.copy_from(buf); };
  return work;
}

void MpiProcessGroup::barrier() {
  MpiWork work("barrier", rank_, timeout_s_);
  check_mpi(MPI_Ibarrier(comm_.get(), &work.request), "MPI_Ibarrier");
  work.wait();
}

namespace {
// A host all-reduce reduces a copy that its Work owns: when wait() times out and the Work is
// abandoned, the copy is kept alive for the late collective to write into, never the caller's
// (by then freed) vector.
template <typename T>
void all_reduce_host_values(std::vector<T>& values, ReduceOp op, MPI_Datatype type,
                            const char* what, MPI_Comm comm, int rank, double timeout_s) {
  MpiWork work(
      detail::concat("all_reduce(", reduce_op_name(op), ") of ", values.size(), " host ", what),
      rank, timeout_s);
  auto buffer = std::make_shared<std::vector<T>>(values);
  work.keep_host = buffer;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer->data(),
                           mpi_count(static_cast<int64_t>(buffer->size()), "all_reduce"), type,
                           mpi_op(op), comm, &work.request),
            "MPI_Iallreduce");
  work.wait();
  values = *buffer;
}
}  // namespace

void MpiProcessGroup::all_reduce_host(std::vector<double>& values, ReduceOp op) {
  all_reduce_host_values(values, op, MPI_DOUBLE, "numbers", comm_.get(), rank_, timeout_s_);
}

void MpiProcessGroup::all_reduce_host(std::vector<int64_t>& values, ReduceOp op) {
  all_reduce_host_values(values, op, MPI_INT64_T, "integers", comm_.get(), rank_, timeout_s_);
}

}  // namespace shardtrain::dist
