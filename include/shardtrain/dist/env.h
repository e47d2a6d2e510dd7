// The distributed environment of one process: who launched it, its rank, and the process groups
// sharded training communicates over.
//
// A process started by mpirun (Open MPI), by srun (Slurm) or by another PMI launcher initialises
// MPI and joins the job. A process started on its own runs as the single rank of a world of one,
// without initialising MPI at all (so a plain `shardtrain train` needs no MPI runtime).
//
// Groups:
//   world       every rank
//   intra_node  the ranks of this node (MPI_Comm_split_type SHARED, or blocks of
//               `ranks_per_node` consecutive ranks when that is set, which lets tests pretend
//               one machine is several nodes)
//   inter_node  the ranks with this rank's local rank, one per node (hybrid sharding's
//               replica group)
//   self        this rank alone (a LocalProcessGroup)
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "shardtrain/core/device.h"
#include "shardtrain/dist/process_group.h"

namespace shardtrain::dist {

class MpiRuntime;

// What the launcher's environment variables say, read before MPI starts (the local rank picks
// the GPU). Open MPI: OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}; Slurm (tasks srun
// started): SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE; other
// PMI launchers: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID. A process the batch script starts itself,
// without srun, is one rank whatever the allocation's SLURM_NTASKS says.
struct LaunchInfo {
  std::string launcher = "none";  // "openmpi", "slurm", "pmi", or "none"
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_size = 1;
  bool launched() const { return launcher != "none"; }
};
LaunchInfo detect_launch();

// The tasks Slurm starts on node `node_id` (SLURM_NODEID) by its per-node list, as in
// SLURM_STEP_TASKS_PER_NODE: "4" (one node), "3,2" (one entry per node), "2(x3),1" (a count
// repeated for several nodes). Empty when the list is malformed or too short.
std::optional<int> slurm_tasks_on_node(const std::string& tasks_per_node, int node_id);

struct DistOptions {
  // auto: NCCL for CUDA devices when the build has it, MPI otherwise; mpi; nccl.
  std::string backend = "auto";
  // Ranks per node for the node-local groups; 0 detects the real nodes.
  int ranks_per_node = 0;
  // Seconds a collective may take before it is declared failed (<= 0: no limit).
  double timeout_s = 600.0;
  // The device tensors live on (decides the auto backend; NCCL uses this CUDA device).
  Device device = Device::cpu();
};

class DistEnv {
 public:
  // Joins the job (initialising MPI when launched) and builds the groups. Throws ConfigError for
  // a backend that is not available or a ranks_per_node that does not divide the world size,
  // DistributedError for MPI/NCCL failures.
  explicit DistEnv(const DistOptions& options = {});
  ~DistEnv();
  DistEnv(const DistEnv&) = delete;
  DistEnv& operator=(const DistEnv&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  int node() const { return node_; }
  int num_nodes() const { return num_nodes_; }
  bool is_distributed() const { return world_size_ > 1; }
  bool uses_mpi() const { return runtime_ != nullptr; }
  std::string backend_name() const { return world_->backend_name(); }
  const LaunchInfo& launch() const { return launch_; }
  const DistOptions& options() const { return options_; }

  ProcessGroup& world() { return *world_; }
  ProcessGroup& intra_node() { return *intra_; }
  ProcessGroup& inter_node() { return *inter_; }
  ProcessGroup& self() { return self_; }

 private:
  DistOptions options_;
  LaunchInfo launch_;
  std::shared_ptr<MpiRuntime> runtime_;  // declared first: outlives the groups
  int rank_ = 0, world_size_ = 1, local_rank_ = 0, local_size_ = 1, node_ = 0, num_nodes_ = 1;
  std::unique_ptr<ProcessGroup> world_, intra_, inter_;
  LocalProcessGroup self_;
};

// The rank of this process in the job: MPI's when MPI is running, else the launcher's, else 0.
int job_rank();
// The number of ranks in the job, by the same rule.
int job_world_size();

// Ends the whole job because this rank cannot go on: writes "rank R: <message>" to stderr and
// calls MPI_Abort on MPI_COMM_WORLD, which makes the launcher kill every rank and exit non-zero.
// Without MPI it exits the process with `exit_code`. Use it in top-level error handlers when
// the world has more than one rank: an exception that merely ends one rank would leave the
// others blocked in their next collective.
[[noreturn]] void abort_job(const std::string& message, int exit_code = 1);

}  // namespace shardtrain::dist
