// `shardtrain plan`: the scale-up recipe as a memory planner.
#include <fmt/format.h>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>

#include "shardtrain/cli/command.h"
#include "shardtrain/core/units.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/train/plan.h"

namespace shardtrain::cli {

namespace {

// 8030261248 -> "8.03 B", 124439808 -> "124.44 M".
std::string count_text(int64_t n) {
  if (n >= 1000000000) return fmt::format("{:.2f} B", static_cast<double>(n) / 1e9);
  if (n >= 1000000) return fmt::format("{:.2f} M", static_cast<double>(n) / 1e6);
  return fmt::format("{}", n);
}

}  // namespace

Command plan_command() {
  Command c;
  c.name = "plan";
  c.summary = "predict per-rank memory along the scale-up recipe and pick the first that fits";
  c.description =
      "Predicts the per-rank peak device memory of --config's model and batch shape for each\n"
      "step of the recipe (fp32 eager, bf16, fused kernels, per_layer checkpointing,\n"
      "offload_checkpoint, full_shard over --world-size ranks, optimizer offload), says which\n"
      "fit --device-memory and names the first that does with its cost: recomputed FLOPs and\n"
      "bytes moved over PCIe and links per step. --measure trains a few steps of every row that\n"
      "fits this machine on the CPU device and prints the measured peak beside the prediction.";
  c.flags = config_flags();
  c.flags.front().required = true;
  c.flags.push_back(Flag("device-memory", "BYTES",
                         "memory of one device, e.g. 80GiB, 24GB (default: train.device_memory "
                         "when set, else 80GiB)"));
  c.flags.push_back(Flag("world-size", "N", "ranks (default: the launcher's world size, else 1)"));
  c.flags.push_back(Flag("measure", "", "measure the rows that fit this machine (CPU device)"));
  c.flags.push_back(
      Flag("measure-steps", "N", "measured steps per row with --measure").defaults_to("2"));
  c.run = [](const Args& args) {
    train::Config config = config_from_args(args, {"activation", "precision", "optim"});
    // train.device_memory_bytes() is 0 when the key is unset.
    const int64_t configured = config.train.device_memory_bytes();
    const int64_t device_bytes = args.has("device-memory") ? parse_bytes(args.get("device-memory"))
                                 : configured > 0          ? configured
                                                           : int64_t{80} << 30;
    const long long world_arg =
        args.has("world-size") ? args.get_int("world-size") : dist::job_world_size();
    if (world_arg < 1 || world_arg > (1 << 24))
      throw UsageError("--world-size must be from 1 to 2^24 ranks, got " +
                       std::to_string(world_arg));
    const int world = static_cast<int>(world_arg);
    train::Plan plan = train::make_plan(config, device_bytes, world);
    if (args.has("measure-steps") && !args.has("measure"))
      throw UsageError(
          "--measure-steps sets the steps of --measure, which is not given: add "
          "--measure, or drop --measure-steps");
    if (args.has("measure")) {
      long long steps = args.get_int("measure-steps");
      if (steps < 1) throw UsageError("--measure-steps must be at least 1");
      // Rank 0 says what it is measuring: a row can take a while.
      std::function<void(const std::string&)> log;
      if (dist::job_rank() == 0) log = [](const std::string& line) { std::cerr << line << "\n"; };
      train::measure_plan(plan, 1, steps, log);
    }
    if (dist::job_rank() != 0) return 0;  // under mpirun rank 0 prints
    const train::RecipeRow& first = plan.rows.front();
    const train::MemoryPrediction& p = first.predicted;
    std::printf(
        "model: %s parameters (%s trainable), %lld x %lld tokens per micro-batch, %lld "
        "micro-batch(es) per step per rank; %d rank(s) of %s\n\n",
        count_text(p.total_parameters).c_str(), count_text(p.trainable_parameters).c_str(),
        static_cast<long long>(config.train.micro_batch),
        static_cast<long long>(config.train.seq_len),
        static_cast<long long>(first.input.micro_batches_per_step), world,
        format_bytes(device_bytes).c_str());
    std::printf("%s\n%s\n", plan.table().c_str(), plan.verdict().c_str());
    if (plan.first_fit >= 0) {
      const train::MemoryPrediction& f = plan.rows[static_cast<size_t>(plan.first_fit)].predicted;
      std::printf(
          "model states per rank there: %s fp32 weights + %s gradients + %s optimizer "
          "state on the device, %.2f bytes per trainable parameter of the model (%s of "
          "optimizer state on the host)\n",
          format_bytes(f.master_bytes).c_str(), format_bytes(f.gradient_bytes).c_str(),
          format_bytes(f.optimizer_bytes).c_str(),
          static_cast<double>(f.model_state_bytes()) /
              static_cast<double>(std::max<int64_t>(f.trainable_parameters, 1)),
          format_bytes(f.host_optimizer_bytes).c_str());
    }
    return 0;
  };
  return c;
}

}  // namespace shardtrain::cli
