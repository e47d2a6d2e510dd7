// Progress reporting on stderr: a redrawn bar on a terminal, plain lines otherwise.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace shardtrain::train {

class Progress {
 public:
  // mode: auto (bar when stderr is a terminal) | bar | lines | none | silent (nothing at all:
  // the ranks other than rank 0 of a job, which would repeat rank 0's every line)
  Progress(std::string mode, int64_t total_steps, std::string label);
  // The step training starts from (a resumed run's checkpoint step), from now: the time left is
  // estimated from the steps this process has run, not from the run's whole step count.
  void start_at(int64_t step);
  // Called after each step; `text` is the status (loss, tokens/s, memory).
  void update(int64_t step, const std::string& text);
  // A line that must not be overwritten by the bar (evaluations, checkpoints). Silenced by
  // mode none, except notices: lines beginning "note: ", "warning: " or "refusing " say
  // something about the run itself (a changed schedule, a damaged checkpoint passed over),
  // which turning the display off must not hide.
  void message(const std::string& text);
  // Progress through the evaluation at `step`: `done` of `total` held-out batches (done = 0
  // starts it). The bar shows it at once (a message then replaces that line). Plain lines
  // ("evaluating step S: D/T batches") come only for an evaluation still running after
  // kEvalLineAfter, then every kEvalLineEvery, so short evaluations add nothing to a log.
  void evaluating(int64_t step, int64_t done, int64_t total);
  void finish();

  static constexpr std::chrono::seconds kEvalLineAfter{2}, kEvalLineEvery{30};

 private:
  bool bar_ = false, quiet_ = false, silent_ = false, open_line_ = false;
  bool eval_line_ = false;  // the open line is an evaluation's, to be replaced, not kept
  int64_t total_, first_step_ = 0;
  std::string label_;
  std::chrono::steady_clock::time_point start_, eval_start_, eval_shown_;
};

}  // namespace shardtrain::train
