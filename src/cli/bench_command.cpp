// `shardtrain bench`: the offload-vs-recompute lab.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "shardtrain/cli/command.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/train/bench.h"

namespace shardtrain::cli {

namespace {

// Items as written: an empty one (",," or a trailing comma) is kept for run_bench to refuse.
std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  if (text.empty()) return out;
  size_t start = 0;
  for (size_t comma = text.find(','); comma != std::string::npos; comma = text.find(',', start)) {
    out.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  out.push_back(text.substr(start));
  return out;
}

}  // namespace

Command bench_command() {
  Command c;
  c.name = "bench";
  c.summary = "measure memory and speed of every activation strategy and precision";
  c.description =
      "Trains the model of --config for --warmup + --steps steps under every combination of\n"
      "activation strategy and precision (a fresh model with the same seed and the same batches\n"
      "each time) and prints peak device memory, step time, tokens/s, forward re-runs and\n"
      "offloaded bytes, with ratios against strategy none of the same precision, and the model\n"
      "FLOPs rate and MFU (6N + 12*L*H*S FLOPs per token; peak from --peak-tflops, else the\n"
      "datasheet figure for the GPU and the row's precision, none on a CPU). Combinations\n"
      "that run out of memory or that this build does not support are reported and skipped.\n"
      "Writes bench.csv, bench.json and (with gnuplot) frontier.png/svg and memory.png/svg to\n"
      "--out. Under mpirun every rank runs the combinations; the table shows the max over ranks\n"
      "and each rank's figures.";
  c.flags = config_flags();
  c.flags.front().required = true;
  c.flags.push_back(Flag("strategies", "LIST", "activation strategies, comma-separated")
                        .defaults_to("none,per_layer,sqrt_segment,selective,offload,"
                                     "offload_checkpoint"));
  c.flags.push_back(Flag("precisions", "LIST", "compute precisions, comma-separated")
                        .defaults_to("fp32,bf16,fp16"));
  c.flags.push_back(Flag("warmup", "N", "warm-up steps per combination").defaults_to("1"));
  c.flags.push_back(Flag("steps", "N", "measured steps per combination").defaults_to("3"));
  c.flags.push_back(Flag("peak-tflops", "X",
                         "peak TFLOP/s of one device for the MFU column (default: from the GPU's "
                         "name and each row's precision; none on a CPU)"));
  c.flags.push_back(
      Flag("out", "DIR", "where CSV, JSON and plots go (default <train.out_dir>/bench)"));
  c.run = [](const Args& args) {
    train::Config config = config_from_args(args, {"activation", "precision"});
    train::BenchOptions o;
    o.strategies = split_list(args.get("strategies"));
    o.precisions = split_list(args.get("precisions"));
    o.warmup_steps = args.get_int("warmup");
    o.measured_steps = args.get_int("steps");
    if (args.has("peak-tflops"))
      o.peak_tflops = args.get_number("peak-tflops", false,
                                      "a positive number of TFLOP/s (989.4 for an H100 in bf16)");
    const bool leader = dist::job_rank() == 0;
    // Every row starts from the same initial weights, so that the rows compare: a checkpoint to
    // resume from is not read (said, not passed over).
    if (leader && config.train.resume != "none")
      std::cerr << "warning: train.resume=" << config.train.resume
                << " is not used by bench: every row starts from the same initial weights "
                   "(model.from_hf, or train.seed)\n";
    const std::string dir = args.has("out") ? args.get("out") : config.train.out_dir + "/bench";
    train::check_bench_options(o);  // a refused flag leaves no --out directory behind
    if (leader) train::prepare_bench_output(dir);  // before the sweep, not after it
    if (leader) o.log = [](const std::string& line) { std::cerr << line << "\n"; };
    train::BenchReport report = train::run_bench(config, o);
    if (!leader) return 0;
    std::printf("%s", report.markdown().c_str());
    std::vector<std::string> written = train::write_bench_outputs(report, dir);
    std::printf("\nwrote:");
    for (const std::string& path : written) std::printf(" %s", path.c_str());
    std::printf("\n");
    if (written.size() <= 2)
      std::printf(
          "(no plots: no combination ran, or gnuplot is not on PATH or failed; see "
          "%s/*.log)\n",
          dir.c_str());
    // A combination that failed (not one refused or out of memory) is a defect: say so in the
    // exit status, so that scripts do not take the table for a pass.
    int failed = 0;
    for (const train::BenchRow& r : report.rows) failed += r.status == train::BenchStatus::Failed;
    if (failed > 0) {
      std::fprintf(stderr, "bench: %d of %zu combinations failed (see the table)\n", failed,
                   report.rows.size());
      return 1;
    }
    // Nothing measured (every combination out of memory or unsupported) is no result either.
    int ran = 0;
    for (const train::BenchRow& r : report.rows) ran += r.status == train::BenchStatus::Ok;
    if (ran == 0) {
      std::fprintf(stderr,
                   "bench: none of the %zu combinations ran (out of memory or unsupported, see "
                   "the table): nothing was measured; give the device more room "
                   "(train.device_memory), a smaller train.micro_batch, or other --strategies "
                   "and --precisions\n",
                   report.rows.size());
      return 1;
    }
    return 0;
  };
  return c;
}

}  // namespace shardtrain::cli
