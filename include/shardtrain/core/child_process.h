// Running a piece of work in a child process, for work that can crash the process it runs in:
// HDF5 parsing metadata that no checksum has vouched for can fault on a damaged byte. The parent
// learns how the child ended and carries on, whatever happened there.
#pragma once
#include <chrono>
#include <functional>

namespace shardtrain {

struct ChildOutcome {
  enum class Ended { Exited, Signalled, TimedOut, NotStarted };
  Ended ended = Ended::NotStarted;
  int code = 0;  // the exit status (Exited) or the signal (Signalled)
  bool crashed() const { return ended == Ended::Signalled; }
};

// Forks, runs `work` in the child and ends the child with _exit(0) (1 when `work` throws): no
// atexit handlers, no stdio flush, nothing of the parent's state is touched. The child must only
// read (files, memory it inherited). A child still running after `limit` (a lock another thread
// held at the fork never comes free in it) is killed: TimedOut. NotStarted when fork fails.
ChildOutcome run_in_child_process(const std::function<void()>& work,
                                  std::chrono::milliseconds limit);

}  // namespace shardtrain
