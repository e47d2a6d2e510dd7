#include "shardtrain/train/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>

namespace shardtrain::train {

Progress::Progress(std::string mode, int64_t total_steps, std::string label)
    : total_(total_steps), label_(std::move(label)), start_(std::chrono::steady_clock::now()) {
  if (mode == "auto")
    bar_ = isatty(STDERR_FILENO) != 0;
  else
    bar_ = mode == "bar";
  silent_ = mode == "silent";
  quiet_ = mode == "none" || silent_;
}

void Progress::start_at(int64_t step) {
  first_step_ = step;
  start_ = std::chrono::steady_clock::now();
}

void Progress::update(int64_t step, const std::string& text) {
  if (quiet_) return;
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const int64_t done = step - first_step_;
  double eta =
      done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(total_ - step) : 0;
  const int64_t eta_s = static_cast<int64_t>(eta);
  const std::string eta_text =
      eta_s >= 3600 ? fmt::format("{}:{:02d}:{:02d}", eta_s / 3600, eta_s / 60 % 60, eta_s % 60)
                    : fmt::format("{:02d}:{:02d}", eta_s / 60, eta_s % 60);
  if (bar_) {
    const int width = 24;
    int filled = total_ > 0 ? static_cast<int>(width * step / total_) : width;
    std::string bar(static_cast<size_t>(filled), '#');
    bar += std::string(static_cast<size_t>(width - filled), '.');
    // fputs, not fmt::print: a reader that went away (a closed pipe) must not end the run,
    // and fmt::print throws on a failed write where fputs only returns EOF.
    std::fputs(
        fmt::format("\r\033[K{} [{}] {}/{} {} eta {}", label_, bar, step, total_, text, eta_text)
            .c_str(),
        stderr);
    open_line_ = true;
    eval_line_ = false;
  } else {
    std::fputs(
        fmt::format("{} step {}/{} {} eta {}\n", label_, step, total_, text, eta_text).c_str(),
        stderr);
  }
  std::fflush(stderr);
}

void Progress::message(const std::string& text) {
  if (silent_) return;
  auto begins = [&](const char* prefix) { return text.rfind(prefix, 0) == 0; };
  if (quiet_ && !begins("note: ") && !begins("warning: ") && !begins("refusing ")) return;
  if (open_line_) std::fputs(eval_line_ ? "\r\033[K" : "\n", stderr);
  open_line_ = eval_line_ = false;
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
}

void Progress::evaluating(int64_t step, int64_t done, int64_t total) {
  if (quiet_) return;
  const auto now = std::chrono::steady_clock::now();
  if (done == 0) eval_start_ = eval_shown_ = now;
  if (bar_) {
    // At most ten redraws a second: a terminal redrawn per batch would slow a fast evaluation.
    if (done != 0 && now - eval_shown_ < std::chrono::milliseconds(100)) return;
    eval_shown_ = now;
    if (open_line_ && !eval_line_) std::fputs("\n", stderr);  // keep the step's bar above
    std::fputs(
        fmt::format("\r\033[K{} eval step {}: {}/{} batches", label_, step, done, total).c_str(),
        stderr);
    open_line_ = eval_line_ = true;
  } else {
    const bool first = eval_shown_ == eval_start_;
    if (now - eval_start_ < kEvalLineAfter || (!first && now - eval_shown_ < kEvalLineEvery))
      return;
    eval_shown_ = now;
    std::fputs(fmt::format("evaluating step {}: {}/{} batches\n", step, done, total).c_str(),
               stderr);
  }
  std::fflush(stderr);
}

void Progress::finish() {
  if (open_line_) std::fputs(eval_line_ ? "\r\033[K" : "\n", stderr);
  open_line_ = eval_line_ = false;
}

}  // namespace shardtrain::train
