// GoogleTest main for tests run under mpirun: MPI is initialised for the whole run, every rank
// runs every test, and only rank 0 prints the usual report; other ranks print their failures
// only, prefixed with their rank. Each rank's exit code reflects its own results, and mpirun
// exits non-zero when any rank does.
#include <gtest/gtest.h>

#include <cstdio>

#include "shardtrain/dist/env.h"
#include "shardtrain/dist/mpi.h"

namespace {

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  std::shared_ptr<shardtrain::dist::MpiRuntime> mpi = shardtrain::dist::MpiRuntime::acquire();
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = shardtrain::dist::job_rank();
  if (rank > 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  return RUN_ALL_TESTS();
}
