// `shardtrain train`: runs a training config to completion.
#include <cstdio>

#include "shardtrain/cli/command.h"
#include "shardtrain/core/units.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/train/checkpointing.h"
#include "shardtrain/train/trainer.h"

namespace shardtrain::cli {

Command train_command() {
  Command c;
  c.name = "train";
  c.summary = "train a model from a YAML config";
  c.description =
      "Trains the model of --config on its data, printing progress on stderr and writing\n"
      "<train.out_dir>/metrics.jsonl, config.yaml and (train.export) the model in Hugging Face\n"
      "layout. Under mpirun every rank runs this same command. SIGTERM, SIGUSR1, SIGINT or\n"
      "SIGHUP stops the run after the current step with a checkpoint (exit code 0);\n"
      "train.resume=auto continues it (docs/checkpoints.md).";
  c.flags = config_flags();
  c.run = [](const Args& args) {
    // Up before anything slow (MPI start-up, loading weights): a stop requested meanwhile ends
    // the run with a checkpoint after its first step instead of killing the process.
    train::StopSignalHandlers stop_signals;
    train::Config config = config_from_args(args);
    train::TrainSummary s = train::run_training(config);
    if (dist::job_rank() != 0) return 0;  // under mpirun, rank 0 reports for the job
    const int64_t run = s.steps - s.first_step;
    if (run == 0 && s.stopped_early) {  // a stop during the resumed run's first evaluation
      std::printf(
          "stopped early on a signal at step %lld before training further; continue "
          "with --set train.resume=auto\n",
          static_cast<long long>(s.steps));
      return 0;
    }
    if (run == 0) {
      std::printf("nothing left to train: the run is at step %lld = train.steps",
                  static_cast<long long>(s.steps));
      if (s.final_eval_loss >= 0) std::printf(", eval loss %.4f", s.final_eval_loss);
      std::printf("\n");
      if (!s.export_dir.empty()) std::printf("model: %s\n", s.export_dir.c_str());
      return 0;
    }
    if (s.first_step > 0)
      std::printf("trained steps %lld to %lld (resumed): loss %.4f -> %.4f",
                  static_cast<long long>(s.first_step + 1), static_cast<long long>(s.steps),
                  s.first_loss, s.final_loss);
    else
      std::printf("trained %lld step%s: loss %.4f -> %.4f", static_cast<long long>(s.steps),
                  s.steps == 1 ? "" : "s", s.first_loss, s.final_loss);
    // A stop may have abandoned the last evaluation: say which step the figure is from.
    if (s.final_eval_loss >= 0 && s.final_eval_step != s.steps)
      std::printf(", eval loss %.4f after step %lld", s.final_eval_loss,
                  static_cast<long long>(s.final_eval_step));
    else if (s.final_eval_loss >= 0)
      std::printf(", eval loss %.4f (unigram entropy of the data %.4f nats)", s.final_eval_loss,
                  s.unigram_entropy_nats);
    std::printf(", %s tokens/s\nmetrics: %s\n", format_rate(s.tokens_per_second).c_str(),
                s.metrics_path.c_str());
    if (!s.export_dir.empty()) std::printf("model: %s\n", s.export_dir.c_str());
    // The weights of the last step may be in no checkpoint (checkpoint.every_steps=0, or not a
    // multiple of the steps): the newest is then an earlier step's, perhaps the one resumed from.
    if (!s.last_checkpoint.empty() && s.last_checkpoint_step == s.steps)
      std::printf("checkpoint: %s\n", s.last_checkpoint.c_str());
    else if (!s.last_checkpoint.empty())
      std::printf(
          "checkpoint: %s (step %lld%s; the weights after step %lld are in no checkpoint)\n",
          s.last_checkpoint.c_str(), static_cast<long long>(s.last_checkpoint_step),
          s.last_checkpoint_step == s.first_step ? ", the one this run resumed from" : "",
          static_cast<long long>(s.steps));
    if (s.skipped_steps > 0) {
      // Overflow in an fp16 compute, or only in the fp16 reduction of bf16 or fp32 gradients.
      const std::string fix = config.precision.compute == "fp16"
                                  ? "lower precision.init_scale or use precision.compute=bf16"
                                  : "lower precision.init_scale or reduce the gradients in bf16 "
                                    "or fp32 (precision.reduce_dtype)";
      std::fprintf(stderr,
                   "warning: %lld of %lld steps were skipped (fp16 gradients overflowed, so the "
                   "loss scale was lowered and the update dropped)%s\n",
                   static_cast<long long>(s.skipped_steps), static_cast<long long>(run),
                   s.skipped_steps == run ? (": the weights never changed; " + fix).c_str() : "");
    }
    if (s.stopped_early)
      std::printf("stopped early on a signal; continue with --set train.resume=auto\n");
    return 0;
  };
  return c;
}

}  // namespace shardtrain::cli
