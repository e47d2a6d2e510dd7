// A job whose last rank arrives 60 s late, while the others give the start-up 3 s: they must end
// the job with a message naming the limit, not wait for it. With "after-init" every rank starts
// MPI first, so the others wait in the communicator set-up rather than in MPI's own start-up.
// Run by tests/mpi/launcher/rank_failure.cpp.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "shardtrain/dist/env.h"
#include "shardtrain/dist/mpi.h"

using namespace shardtrain;

int main(int argc, char** argv) {
  const bool after_init = argc > 1 && std::string(argv[1]) == "after-init";
  std::shared_ptr<dist::MpiRuntime> mpi;
  if (after_init) mpi = dist::MpiRuntime::acquire();
  const dist::LaunchInfo launch = dist::detect_launch();
  if (launch.rank == launch.world_size - 1) std::this_thread::sleep_for(std::chrono::seconds(60));
  dist::DistOptions options;
  options.timeout_s = 3;
  dist::DistEnv env(options);
  std::printf("rank %d joined the job\n", env.rank());
  return 0;
}
