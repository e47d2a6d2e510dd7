// Running work in a child process (see include/shardtrain/core/child_process.h).
#include "shardtrain/core/child_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

namespace shardtrain {

ChildOutcome run_in_child_process(const std::function<void()>& work,
                                  std::chrono::milliseconds limit) {
  std::fflush(nullptr);  // nothing buffered before the fork is written twice
  const pid_t pid = fork();
  if (pid < 0) return {};
  if (pid == 0) {
    int code = 0;
    try {
      work();
    } catch (...) {
      code = 1;
    }
    _exit(code);
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(pid, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  if (done == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return {ChildOutcome::Ended::TimedOut, SIGKILL};
  }
  if (done < 0) return {};
  if (WIFSIGNALED(status)) return {ChildOutcome::Ended::Signalled, WTERMSIG(status)};
  return {ChildOutcome::Ended::Exited, WIFEXITED(status) ? WEXITSTATUS(status) : 0};
}

}  // namespace shardtrain
