// Checkpoints of a training run: what of a Runtime goes into one (io/checkpoint.h has the file
// format), when the loop saves (the `checkpoint` section), how a run resumes (`train.resume`),
// and stop requests by signal. docs/checkpoints.md describes the whole.
#pragma once
#include <signal.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <string>

#include "shardtrain/data/sampler.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/train/config.h"

namespace shardtrain::train {

class Runtime;

// ---- stop requests ----------------------------------------------------------------------------
// While a StopSignalHandlers lives, SIGTERM, SIGUSR1, SIGINT (Ctrl-C) and SIGHUP (a closed
// terminal; left ignored when it was, as under nohup) only record which signal arrived (the handler
// sets one flag: async-signal-safe). The training loop looks at the flag at the end of every step;
// when it is set on any rank, every rank saves a checkpoint and the loop returns. A second SIGINT
// ends the process at once, as Ctrl-C does elsewhere (no checkpoint). Destruction restores the
// previous handlers. Constructing one clears an earlier request, unless another is alive: the
// CLI installs them before a run starts (a stop during a long start-up then ends the run at its
// first step), and the trainer's own keep that request.
class StopSignalHandlers {
 public:
  StopSignalHandlers();
  ~StopSignalHandlers();
  StopSignalHandlers(const StopSignalHandlers&) = delete;
  StopSignalHandlers& operator=(const StopSignalHandlers&) = delete;

 private:
  struct sigaction previous_term_ {};
  struct sigaction previous_usr1_ {};
  struct sigaction previous_int_ {};
  struct sigaction previous_hup_ {};
};

// The signal that asked for a stop, 0 when none has.
int stop_signal();
// Asks for a stop as if `signal` had arrived (async-signal-safe).
void request_stop(int signal);
void clear_stop_request();

// ---- checkpoint <-> runtime -------------------------------------------------------------------

// This rank's part of a checkpoint of `runtime` after `step` optimizer steps: weights and
// optimizer state (this rank's shard pieces when sharded, whole tensors otherwise), loss scaler,
// generators, sampler, configuration and the flat-parameter layout. `lr` is the last step's.
io::SaveRequest make_save_request(Runtime& runtime, const std::string& dir, int64_t step,
                                  const SamplerState& sampler, float lr);

// Loads the checkpoint at `path` into `runtime`: weights, optimizer state and step count, loss
// scaler, and the generators when the job has as many ranks as the one that saved. Any number of
// ranks and any sharding read any checkpoint: each rank reads the ranges it holds, one unit at a
// time. Collective. Throws FormatError naming the file and tensor when the checkpoint does not
// fit the model or optimizer. Returns the checkpoint's training state (step, sampler, ...).
// `notes` (when given) receives what a user should know about the load: generators the model
// draws from that the checkpoint holds no state for (they start from their seeds).
io::TrainingState load_checkpoint(Runtime& runtime, const std::string& path,
                                  std::vector<std::string>* notes = nullptr);

// ---- the training loop's checkpointing --------------------------------------------------------

// A fresh run (train.resume none) whose checkpoint directory holds checkpoints is refused:
// ConfigError naming the directory, its newest step and the choices. Called before the model is
// built, and again by Checkpointing::resume(). Not collective.
void refuse_fresh_run_over_checkpoints(const Config& config);

struct ResumePoint {
  std::string path;
  int64_t step = 0;  // steps completed: the loop goes on with step + 1
  SamplerState sampler;
};

class Checkpointing {
 public:
  using Log = std::function<void(const std::string&)>;
  // `log` gets one line per event (saves, refused checkpoints, resume); rank 0's matter.
  Checkpointing(const Config& config, Runtime& runtime, Log log);

  // train.resume: none -> nothing; auto -> the newest checkpoint of the checkpoint directory
  // that verifies (a damaged or incomplete one is logged and the previous one tried; none at all
  // starts from scratch); a path -> that checkpoint (a checkpoint file, or a directory searched
  // like auto), which must verify or this throws FormatError. Loads it into the runtime.
  // Collective.
  std::optional<ResumePoint> resume();

  // Called by every rank at the end of step `step` (1-based): saves when checkpoint.every_steps
  // divides it, when checkpoint.every_minutes have passed since the last save (rank 0's clock
  // decides for all), at the last step when checkpointing is on, or when a stop was requested on
  // any rank. One small all-reduce per call. Returns true when the loop must stop.
  bool after_step(int64_t step, const SamplerState& sampler, float lr);

  // For a stop requested after step `step`'s after_step (during the final evaluation): when one
  // was requested on any rank, saves step `step` unless it is already saved and returns true.
  // Collective, one small all-reduce.
  bool stop_if_requested(int64_t step, const SamplerState& sampler, float lr);

  // Saves now (collective) and applies checkpoint.keep_last; returns the main file's path.
  std::string save(int64_t step, const SamplerState& sampler, float lr);

  const std::string& dir() const { return dir_; }
  const std::string& last_saved() const { return last_saved_; }
  int64_t last_saved_step() const { return last_saved_step_; }  // -1 when none

 private:
  void log_stopped(int signal, int64_t step);  // the stop's log line, after its save
  // What keeps resume from taking the checkpoint at `path` ("" when nothing): it does not verify
  // (incomplete, damaged) or its saved config does not parse. Collective.
  std::string resumable_problem(const std::string& path);
  // Throws ConfigError when the checkpoint directory holds a checkpoint resume could take at a
  // step past `step`, the one resumed. Collective.
  void refuse_later_checkpoints(int64_t step, const std::string& resumed);

  const Config& config_;
  Runtime& runtime_;
  Log log_;
  std::string dir_;
  std::string last_saved_;
  int64_t last_saved_step_ = -1;
  // Steps of checkpoints in dir_ that resume refused (damaged): kept out of keep_last's count.
  std::set<int64_t> refused_;
  std::chrono::steady_clock::time_point last_save_time_;
};

// Opens <out_dir>/metrics.jsonl for a run that starts after `resumed_step` steps: a fresh file
// when 0; otherwise the events of steps after `resumed_step` (written by the interrupted run
// after its last checkpoint) are dropped, and so is an evaluation at `resumed_step` when
// `reevaluates_resumed_step` (the resumed run evaluates that step again and records it anew);
// new ones are appended.
void open_metrics(std::ofstream& out, const std::string& path, int64_t resumed_step,
                  bool reevaluates_resumed_step);

}  // namespace shardtrain::train
