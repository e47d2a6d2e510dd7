// DistEnv: launch detection, MPI start-up, node-local and cross-node groups; abort_job.
#include "shardtrain/dist/env.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "shardtrain/dist/mpi.h"
#include "shardtrain/dist/nccl.h"

namespace shardtrain::dist {

namespace {

// The leading integer of an environment variable ("4(x2)" from SLURM_TASKS_PER_NODE gives 4).
std::optional<int> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  long value = std::strtol(v, &end, 10);
  if (end == v) return std::nullopt;
  return static_cast<int>(value);
}

}  // namespace

std::optional<int> slurm_tasks_on_node(const std::string& tasks_per_node, int node_id) {
  // "2(x3),1": entries separated by commas, each a count with an optional repeat "(xK)".
  if (node_id < 0) return std::nullopt;
  size_t at = 0;
  int64_t first_node = 0;
  while (at < tasks_per_node.size()) {
    size_t end = tasks_per_node.find(',', at);
    if (end == std::string::npos) end = tasks_per_node.size();
    const std::string entry = tasks_per_node.substr(at, end - at);
    int count = 0, repeat = 1, used = 0;
    if (std::sscanf(entry.c_str(), "%d%n", &count, &used) != 1 || count < 1) return std::nullopt;
    if (static_cast<size_t>(used) != entry.size()) {
      int more = 0;
      if (std::sscanf(entry.c_str() + used, "(x%d)%n", &repeat, &more) != 1 || repeat < 1 ||
          static_cast<size_t>(used + more) != entry.size())
        return std::nullopt;
    }
    if (node_id < first_node + repeat) return count;
    first_node += repeat;
    at = end + 1;
  }
  return std::nullopt;
}

namespace {

int world_rank_now() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size_now() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

// Ends the job when joining it takes longer than the collective timeout. MPI's start-up, the
// communicator splits and NCCL's set-up are blocking collectives that cannot be given a limit
// themselves: a rank that never arrives (stuck on a file system, or dead without ending the job)
// would leave the others waiting forever, where every later collective gives up after
// dist.timeout_s. Runs on its own thread, so it touches MPI only to abort.
class StartUpWatchdog {
 public:
  StartUpWatchdog(double timeout_s, int rank) {
    if (timeout_s <= 0) return;
    thread_ = std::thread([this, timeout_s, rank] {
      std::unique_lock<std::mutex> lock(mutex_);
      if (joined_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                           [this] { return done_; }))
        return;
      std::fprintf(stderr,
                   "rank %d: the job's start-up did not finish within %g s: every rank waits "
                   "for all the others to join (MPI, the node and world communicators, NCCL), "
                   "and at least one has not; it may still be reading its data or model, be "
                   "stuck, or have exited. dist.timeout_s sets this limit\n",
                   rank, timeout_s);
      std::fflush(stderr);
      if (MpiRuntime::initialized()) MPI_Abort(MPI_COMM_WORLD, 1);
      std::_Exit(1);  // MPI not up yet: a rank that exits non-zero makes mpirun end the job
    });
  }
  ~StartUpWatchdog() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    joined_.notify_all();
    thread_.join();
  }
  StartUpWatchdog(const StartUpWatchdog&) = delete;
  StartUpWatchdog& operator=(const StartUpWatchdog&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable joined_;
  bool done_ = false;
  std::thread thread_;
};

// A process group over `comm` on the chosen backend; a LocalProcessGroup for one rank.
std::unique_ptr<ProcessGroup> make_group(const MpiCommunicator& comm, const std::string& backend,
                                         const DistOptions& options) {
  std::unique_ptr<ProcessGroup> group;
  if (comm.size() == 1)
    group = std::make_unique<LocalProcessGroup>();
  else if (backend == "nccl")
    group = make_nccl_process_group(comm.get(), options.device.index, options.timeout_s);
  else
    group = std::make_unique<MpiProcessGroup>(comm.get(), options.timeout_s);
  group->set_timeout(options.timeout_s);
  return group;
}

}  // namespace

LaunchInfo detect_launch() {
  LaunchInfo info;
  auto fill = [&](const char* launcher, std::optional<int> rank, std::optional<int> size,
                  std::optional<int> local_rank, std::optional<int> local_size) {
    info.launcher = launcher;
    info.rank = rank.value_or(0);
    info.world_size = size.value_or(1);
    info.local_rank = local_rank.value_or(0);
    info.local_size = local_size.value_or(1);
  };
  if (env_int("OMPI_COMM_WORLD_RANK") && env_int("OMPI_COMM_WORLD_SIZE")) {
    fill("openmpi", env_int("OMPI_COMM_WORLD_RANK"), env_int("OMPI_COMM_WORLD_SIZE"),
         env_int("OMPI_COMM_WORLD_LOCAL_RANK"), env_int("OMPI_COMM_WORLD_LOCAL_SIZE"));
  } else if (env_int("PMI_RANK") && env_int("PMI_SIZE")) {
    fill("pmi", env_int("PMI_RANK"), env_int("PMI_SIZE"), env_int("MPI_LOCALRANKID"),
         env_int("MPI_LOCALNRANKS"));
  } else if (env_int("SLURM_PROCID") && env_int("SLURM_STEP_NUM_TASKS")) {
    // The step's variables, which srun sets for its tasks: the batch script's own shell has
    // SLURM_NTASKS of the whole allocation too, and a process it starts directly is one rank.
    // SLURM_STEP_TASKS_PER_NODE lists every node's count ("3,2", "2(x3)"): this node's is the
    // entry of SLURM_NODEID, not the first.
    std::optional<int> local_size;
    const char* per_node = std::getenv("SLURM_STEP_TASKS_PER_NODE");
    const std::optional<int> node = env_int("SLURM_NODEID");
    if (per_node != nullptr) local_size = slurm_tasks_on_node(per_node, node.value_or(0));
    if (!local_size) local_size = env_int("SLURM_NTASKS_PER_NODE");
    fill("slurm", env_int("SLURM_PROCID"), env_int("SLURM_STEP_NUM_TASKS"),
         env_int("SLURM_LOCALID"), local_size);
  }
  return info;
}

int job_rank() {
  if (MpiRuntime::initialized()) return world_rank_now();
  return detect_launch().rank;
}

int job_world_size() {
  if (MpiRuntime::initialized()) return world_size_now();
  return detect_launch().world_size;
}

void abort_job(const std::string& message, int exit_code) {
  std::fprintf(stderr, "rank %d: %s\n", job_rank(), message.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  if (MpiRuntime::initialized()) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

DistEnv::DistEnv(const DistOptions& options) : options_(options), launch_(detect_launch()) {
  ST_CHECK_AS(ConfigError, options.ranks_per_node >= 0, "dist.ranks_per_node must be >= 0, got ",
              options.ranks_per_node);
  std::string backend = options.backend;
  ST_CHECK_AS(ConfigError, backend == "auto" || backend == "mpi" || backend == "nccl",
              "dist.backend: '", backend, "' is not one of auto, mpi, nccl");
  if (backend == "auto") backend = options.device.is_cuda() && nccl_available() ? "nccl" : "mpi";
  if (backend == "nccl") {
    ST_CHECK_AS(ConfigError, nccl_available(),
                "dist.backend: nccl was asked for but this build has no NCCL; use mpi or auto");
    ST_CHECK_AS(ConfigError, options.device.is_cuda(),
                "dist.backend: nccl needs a CUDA device, "
                "but the training device is ",
                options.device.str(), "; use mpi or auto");
  }

  if (!launch_.launched() && !MpiRuntime::initialized()) {
    // Started on its own: a world of one, no MPI.
    ST_CHECK_AS(ConfigError, options.ranks_per_node <= 1,
                "dist.ranks_per_node=", options.ranks_per_node,
                " but this process was not started by mpirun or srun (a world of one rank)");
    world_ = std::make_unique<LocalProcessGroup>();
    intra_ = std::make_unique<LocalProcessGroup>();
    inter_ = std::make_unique<LocalProcessGroup>();
    return;
  }

  const StartUpWatchdog watchdog(options.timeout_s, launch_.rank);
  runtime_ = MpiRuntime::acquire();
  rank_ = world_rank_now();
  world_size_ = world_size_now();
  MpiCommunicator intra;
  if (options.ranks_per_node > 0) {
    ST_CHECK_AS(ConfigError, world_size_ % options.ranks_per_node == 0,
                "dist.ranks_per_node=", options.ranks_per_node, " does not divide the ",
                world_size_,
                " ranks of this job; use a divisor of the world size or 0 to detect nodes");
    intra = MpiCommunicator::split(MPI_COMM_WORLD, rank_ / options.ranks_per_node, rank_);
  } else {
    intra = MpiCommunicator::split_shared(MPI_COMM_WORLD);
  }
  local_rank_ = intra.rank();
  local_size_ = intra.size();
  MpiCommunicator inter = MpiCommunicator::split(MPI_COMM_WORLD, local_rank_, rank_);
  node_ = inter.rank();
  num_nodes_ = inter.size();

  MpiCommunicator world = MpiCommunicator::duplicate(MPI_COMM_WORLD);
  world_ = make_group(world, backend, options);
  intra_ = make_group(intra, backend, options);
  inter_ = make_group(inter, backend, options);
}

DistEnv::~DistEnv() {
  // Groups free their communicators before the MPI runtime may be finalised.
  inter_.reset();
  intra_.reset();
  world_.reset();
}

}  // namespace shardtrain::dist
