// `shardtrain bench`: the figures of a short run, its CSV and JSON, OOM and unsupported
// combinations, and the plots.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include <unistd.h>

#include "shardtrain/cli/cli.h"
#include "shardtrain/core/error.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/memory/allocator.h"
#include "shardtrain/train/bench.h"
#include "shardtrain/train/memory_model.h"
#include "shardtrain/train/runtime.h"

namespace fs = std::filesystem;
using namespace shardtrain;
using train::BenchStatus;

namespace {

// hidden 32, 2 layers, seq 32, micro-batch 2: a step takes milliseconds.
const char* kTinyYaml = R"(
model:
  vocab_size: 256
  hidden_size: 32
  intermediate_size: 88
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
  max_seq_len: 64
train:
  seq_len: 32
  micro_batch: 2
  steps: 10
  device: cpu
  eval_every: 0
optim:
  warmup_steps: 2
)";

// A directory of this process's own (two runs of the suite at once must not share one).
fs::path temp_dir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() /
                 ("shardtrain_test_bench_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// One CSV record: comma-separated, fields with commas or quotes in double quotes.
std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    char ch = line[i];
    if (quoted) {
      if (ch == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        out.back() += '"';
        ++i;
      } else if (ch == '"') {
        quoted = false;
      } else {
        out.back() += ch;
      }
    } else if (ch == '"') {
      quoted = true;
    } else if (ch == ',') {
      out.emplace_back();
    } else {
      out.back() += ch;
    }
  }
  return out;
}

// The CSV as one map per line, keyed by the header.
std::vector<std::map<std::string, std::string>> read_csv(const fs::path& p) {
  std::stringstream in(read(p));
  std::string line;
  std::getline(in, line);
  std::vector<std::string> header = split_csv(line);
  std::vector<std::map<std::string, std::string>> rows;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::vector<std::string> cells = split_csv(line);
    EXPECT_EQ(cells.size(), header.size()) << "CSV line: " << line;
    std::map<std::string, std::string> row;
    for (size_t i = 0; i < header.size() && i < cells.size(); ++i) row[header[i]] = cells[i];
    rows.push_back(row);
  }
  return rows;
}

bool on_path(const std::string& program) {
  std::string cmd = "command -v " + program + " > /dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

}  // namespace

// fp16 rows whose every step overflowed (an absurd first loss scale) say so in every output:
// their step times are not real steps and their loss never moved.
TEST(Bench, SkippedFp16StepsAreReported) {
  train::Config config = train::Config::parse(kTinyYaml, {"precision.init_scale=1e30"}, "tiny");
  train::BenchOptions o;
  o.strategies = {"none"};
  o.precisions = {"fp16", "fp32"};
  o.warmup_steps = 0;
  o.measured_steps = 2;
  train::BenchReport report = train::run_bench(config, o);
  ASSERT_EQ(report.rows.size(), 2u);
  const train::BenchRow& fp16 = report.rows[0];
  ASSERT_TRUE(fp16.ok()) << fp16.message;
  ASSERT_EQ(fp16.precision, "fp16");
  EXPECT_EQ(fp16.measured_steps, 2);
  EXPECT_EQ(fp16.skipped_steps, 2);  // 1e30 and 5e29 both overflow fp16
  EXPECT_EQ(report.rows[1].skipped_steps, 0);
  EXPECT_NE(report.markdown().find("| none | fp16 (2 of 2 steps skipped) |"), std::string::npos)
      << report.markdown();
  fs::path dir = temp_dir("skipped");
  train::write_bench_outputs(report, dir.string());
  auto csv = read_csv(dir / "bench.csv");
  ASSERT_EQ(csv.size(), 2u);
  EXPECT_EQ(csv[0]["skipped_steps"], "2");
  EXPECT_EQ(csv[1]["skipped_steps"], "0");
  nlohmann::json j = nlohmann::json::parse(read(dir / "bench.json"));
  EXPECT_EQ(j["rows"][0]["skipped_steps"].get<int64_t>(), 2);
  fs::remove_all(dir);
}

TEST(Bench, ShortRunGivesSaneFiguresCsvAndJson) {
  train::Config config = train::Config::parse(kTinyYaml, {}, "tiny-bench");
  train::BenchOptions o;
  o.strategies = {"none", "per_layer"};
  o.precisions = {"fp32"};
  o.warmup_steps = 1;
  o.measured_steps = 2;
  train::BenchReport report = train::run_bench(config, o);
  ASSERT_EQ(report.rows.size(), 2u);
  EXPECT_EQ(report.world_size, 1);
  EXPECT_EQ(report.device, "cpu");

  const train::BenchRow& none = report.rows[0];
  ASSERT_TRUE(none.ok()) << none.message;
  EXPECT_EQ(none.strategy, "none");
  EXPECT_EQ(none.precision, "fp32");
  EXPECT_EQ(none.tokens_per_step, 2 * 32);
  EXPECT_GT(none.step_ms_median, 0.0);
  EXPECT_LE(none.step_ms_min, none.step_ms_median);
  EXPECT_LE(none.step_ms_median, none.step_ms_max);
  EXPECT_NEAR(none.tokens_per_s, 64.0 / (none.step_ms_median / 1e3), 1e-6 * none.tokens_per_s);
  EXPECT_GT(none.final_loss, 0.0);
  EXPECT_LT(none.final_loss, 7.0);  // about ln(256) = 5.5 at the start
  // The breakdown at the peak adds up to the peak, and each category's own peak is at least
  // its share then.
  int64_t sum = 0;
  for (size_t k = 0; k < none.at_peak.size(); ++k) {
    sum += none.at_peak[k];
    EXPECT_GE(none.peak_by_category[k], none.at_peak[k]);
  }
  EXPECT_EQ(sum, none.peak_bytes);
  EXPECT_GT(none.at_peak[static_cast<size_t>(MemoryCategory::Parameters)], 0);
  EXPECT_GT(none.at_peak[static_cast<size_t>(MemoryCategory::OptimizerState)], 0);
  EXPECT_EQ(none.forward_reruns, 0.0);
  EXPECT_EQ(none.bytes_offloaded, 0.0);
  EXPECT_EQ(none.copy_ms, 0.0);  // nothing offloaded, nothing copied
  EXPECT_DOUBLE_EQ(none.peak_vs_none, 1.0);
  EXPECT_DOUBLE_EQ(none.overhead_vs_none, 0.0);
  // The memory model agrees with the measurement (fp32, strategy none).
  train::MemoryPrediction predicted =
      train::predict_memory(train::MemoryModelInput::from_config(config, 1));
  EXPECT_NEAR(static_cast<double>(none.peak_bytes), static_cast<double>(predicted.peak),
              0.1 * static_cast<double>(none.peak_bytes));

  // per_layer runs and re-runs each layer once per step.
  const train::BenchRow& pl = report.rows[1];
  ASSERT_TRUE(pl.ok()) << pl.message;
  EXPECT_EQ(pl.forward_reruns, 2.0);
  EXPECT_GT(pl.peak_vs_none, 0.0);
  EXPECT_LT(pl.peak_vs_none, 1.0);

  fs::path dir = temp_dir("short");
  std::vector<std::string> written = train::write_bench_outputs(report, dir.string());
  auto csv = read_csv(dir / "bench.csv");
  ASSERT_EQ(csv.size(), 2u);
  for (const char* column :
       {"strategy", "precision", "status", "peak_bytes", "peak_vs_none", "step_ms_median",
        "tokens_per_s", "overhead_vs_none", "forward_reruns", "bytes_offloaded", "bytes_restored",
        "at_peak_activations", "at_peak_optimizer_state", "host_offloaded_peak",
        "oom_requested_bytes", "copy_ms"})
    EXPECT_TRUE(csv[0].count(column)) << "missing CSV column " << column;
  EXPECT_EQ(csv[0]["status"], "ok");
  EXPECT_EQ(std::stoll(csv[0]["peak_bytes"]), none.peak_bytes);
  EXPECT_GT(std::stod(csv[0]["tokens_per_s"]), 0.0);
  EXPECT_EQ(std::stoll(csv[0]["at_peak_parameters"]),
            none.at_peak[static_cast<size_t>(MemoryCategory::Parameters)]);
  EXPECT_EQ(csv[1]["strategy"], "per_layer");
  EXPECT_EQ(csv[1]["status"], pl.ok() ? "ok" : "unsupported");

  nlohmann::json j = nlohmann::json::parse(read(dir / "bench.json"));
  ASSERT_EQ(j["rows"].size(), 2u);
  EXPECT_EQ(j["rows"][0]["peak_bytes"].get<int64_t>(), none.peak_bytes);
  EXPECT_EQ(j["rows"][0]["tokens_per_step"].get<int64_t>(), 64);
  EXPECT_GT(j["rows"][0]["step_ms"]["median"].get<double>(), 0.0);
  EXPECT_EQ(j["rows"][0]["at_peak"]["activations"].get<int64_t>(),
            none.at_peak[static_cast<size_t>(MemoryCategory::Activations)]);
  EXPECT_EQ(j["world_size"].get<int>(), 1);

  std::string md = report.markdown();
  EXPECT_NE(md.find("| strategy | precision | peak MiB | vs none | step ms | tokens/s | overhead "
                    "| recomputes | offloaded MiB |"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("| none | fp32 | "), std::string::npos) << md;

  if (on_path("gnuplot")) {
    for (const char* image : {"frontier.png", "frontier.svg", "memory.png", "memory.svg"}) {
      EXPECT_TRUE(fs::exists(dir / image)) << image << " missing; see " << dir;
      if (fs::exists(dir / image)) {
        EXPECT_GT(fs::file_size(dir / image), 500u) << image;
      }
    }
    EXPECT_EQ(written.size(), 6u);
  } else {
    // Without gnuplot the images are not drawn (the data and scripts still are): said, not
    // silently passed over.
    std::printf("note: gnuplot is not installed: the plot images were not checked\n");
    EXPECT_EQ(written.size(), 2u) << "bench.csv and bench.json only";
  }
  fs::remove_all(dir);
}

TEST(Bench, RowsCarryModelFlopsAndMfu) {
  train::Config config = train::Config::parse(kTinyYaml, {}, "tiny-bench");
  train::BenchOptions o;
  o.strategies = {"none"};
  o.precisions = {"fp32"};
  o.warmup_steps = 0;
  o.measured_steps = 1;
  // On a CPU there is no default peak: no MFU.
  train::BenchReport cpu = train::run_bench(config, o);
  ASSERT_EQ(cpu.rows.size(), 1u);
  const train::BenchRow& plain = cpu.rows[0];
  ASSERT_TRUE(plain.ok()) << plain.message;
  // The tiny shape counted by hand in test_bench_formulas: 6 x 31392 + 12 x 2 x 32 x 32.
  EXPECT_DOUBLE_EQ(cpu.model_flops_per_token, 212928.0);
  EXPECT_EQ(cpu.flops_parameters, 31392);
  EXPECT_DOUBLE_EQ(plain.model_flops_per_token, 212928.0);
  EXPECT_NEAR(plain.achieved_tflops, plain.tokens_per_s * 212928.0 / 1e12,
              1e-9 * plain.achieved_tflops);
  EXPECT_LT(plain.mfu, 0.0);
  EXPECT_TRUE(cpu.peak_source.empty());
  EXPECT_TRUE(cpu.device_name.empty());
  std::string md = cpu.markdown();
  EXPECT_NE(md.find("| offloaded MiB | TFLOP/s | MFU |"), std::string::npos) << md;
  EXPECT_NE(md.find(" | - |\n"), std::string::npos) << "MFU cell of a CPU row: " << md;
  EXPECT_NE(md.find("peak: unknown"), std::string::npos) << md;

  // With a given peak every row gets achieved / peak.
  o.peak_tflops = 0.5;
  train::BenchReport given = train::run_bench(config, o);
  const train::BenchRow& r = given.rows[0];
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_DOUBLE_EQ(r.peak_tflops, 0.5);
  EXPECT_NEAR(r.mfu, r.tokens_per_s * 212928.0 / 0.5e12, 1e-9 * r.mfu);
  EXPECT_GT(r.mfu, 0.0);
  EXPECT_EQ(given.peak_source, "--peak-tflops");

  fs::path dir = temp_dir("mfu");
  train::write_bench_outputs(given, dir.string());
  auto csv = read_csv(dir / "bench.csv");
  ASSERT_EQ(csv.size(), 1u);
  EXPECT_DOUBLE_EQ(std::stod(csv[0]["model_flops_per_token"]), 212928.0);
  EXPECT_DOUBLE_EQ(std::stod(csv[0]["peak_tflops"]), 0.5);
  EXPECT_NEAR(std::stod(csv[0]["mfu"]), r.mfu, 1e-8 * r.mfu);
  EXPECT_NEAR(std::stod(csv[0]["achieved_tflops"]), r.achieved_tflops, 1e-8 * r.achieved_tflops);
  // The new columns come last: the earlier ones keep their positions.
  {
    std::ifstream in(dir / "bench.csv");
    std::string header;
    std::getline(in, header);
    const std::string tail =
        ",model_flops_per_token,achieved_tflops,peak_tflops,mfu,copy_ms,skipped_steps";
    ASSERT_GE(header.size(), tail.size());
    EXPECT_EQ(header.substr(header.size() - tail.size()), tail);
    EXPECT_EQ(header.rfind("strategy,precision,status,rank,message,oom_requested_bytes,", 0), 0u);
  }
  nlohmann::json j = nlohmann::json::parse(read(dir / "bench.json"));
  EXPECT_DOUBLE_EQ(j["model_flops_per_token"].get<double>(), 212928.0);
  EXPECT_EQ(j["flops_parameters"].get<int64_t>(), 31392);
  EXPECT_NEAR(j["rows"][0]["mfu"].get<double>(), r.mfu, 1e-12);
  EXPECT_DOUBLE_EQ(j["rows"][0]["peak_tflops"].get<double>(), 0.5);

  // The CLI flag, before anything runs: a value that is not a number is a usage error (exit 2),
  // a number out of range a bad value (exit 1), as for the integer flags.
  {
    std::ofstream out(dir / "shardtrain_test_bench_mfu.yaml");
    out << kTinyYaml;
  }
  const std::string yaml = (dir / "shardtrain_test_bench_mfu.yaml").string();
  EXPECT_EQ(cli::run({"bench", "--config", yaml, "--peak-tflops", "fast", "--strategies", "none",
                      "--precisions", "fp32"}),
            2);
  EXPECT_EQ(cli::run({"bench", "--config", yaml, "--peak-tflops=-3", "--strategies", "none",
                      "--precisions", "fp32"}),
            1);
  fs::remove_all(dir);
}

TEST(Bench, OutOfMemoryIsReportedAndTheRunGoesOn) {
  fs::path dir = temp_dir("oom");
  {
    std::ofstream out(dir / "tiny.yaml");
    out << kTinyYaml;
  }
  // A device that holds per_layer's step but not none's: none fails inside its step.
  train::Config config = train::Config::parse(kTinyYaml, {}, "tiny-bench");
  train::MemoryModelInput in = train::MemoryModelInput::from_config(config, 1);
  const int64_t none_peak = train::predict_memory(in).peak;
  in.activation_strategy = "per_layer";
  const int64_t per_layer_peak = train::predict_memory(in).peak;
  ASSERT_LT(per_layer_peak, none_peak * 85 / 100) << "the tiny model no longer separates them";
  const int64_t capacity = (none_peak + per_layer_peak) / 2;

  const int64_t capacity_before = allocator_for(Device::cpu()).stats().capacity;
  int code = cli::run({"bench", "--config", (dir / "tiny.yaml").string(), "--set",
                       "train.device_memory=" + std::to_string(capacity), "--strategies",
                       "none,per_layer,bogus_free", "--precisions", "fp32", "--warmup", "0",
                       "--steps", "1", "--out", (dir / "out").string()});
  EXPECT_EQ(code, 1) << "an unknown strategy name is a config error, reported before running";

  code = cli::run({"bench", "--config", (dir / "tiny.yaml").string(), "--set",
                   "train.device_memory=" + std::to_string(capacity), "--strategies",
                   "none,per_layer", "--precisions", "fp32,bf16", "--warmup", "0", "--steps", "1",
                   "--out", (dir / "out").string()});
  EXPECT_EQ(code, 0);
  EXPECT_EQ(allocator_for(Device::cpu()).stats().capacity, capacity_before)
      << "the bench must put the device's capacity back";

  auto csv = read_csv(dir / "out" / "bench.csv");
  ASSERT_EQ(csv.size(), 4u) << "every combination is reported";
  EXPECT_EQ(csv[0]["strategy"], "none");
  EXPECT_EQ(csv[0]["status"], "oom");
  EXPECT_GT(std::stoll(csv[0]["oom_requested_bytes"]), 0);
  EXPECT_LE(std::stoll(csv[0]["oom_requested_bytes"]), none_peak);
  EXPECT_NE(csv[0]["message"].find("out of memory"), std::string::npos) << csv[0]["message"];
  EXPECT_TRUE(csv[0]["peak_bytes"].empty());
  // per_layer fits the same device.
  EXPECT_EQ(csv[1]["strategy"], "per_layer");
  ASSERT_EQ(csv[1]["status"], "ok") << csv[1]["message"];
  EXPECT_LE(std::stoll(csv[1]["peak_bytes"]), capacity);
  EXPECT_TRUE(csv[1]["peak_vs_none"].empty()) << "none has no figures to compare with";
  EXPECT_EQ(csv[2]["precision"], "bf16");
  nlohmann::json j = nlohmann::json::parse(read(dir / "out" / "bench.json"));
  EXPECT_EQ(j["rows"][0]["status"], "oom");
  EXPECT_EQ(j["rows"][0]["oom_requested_bytes"].get<int64_t>(),
            std::stoll(csv[0]["oom_requested_bytes"]));

  // With no combination that ran, nothing was measured: the exit status says so.
  code = cli::run({"bench", "--config", (dir / "tiny.yaml").string(), "--set",
                   "train.device_memory=" + std::to_string(capacity), "--strategies", "none",
                   "--precisions", "fp32", "--warmup", "0", "--steps", "1", "--out",
                   (dir / "out2").string()});
  EXPECT_EQ(code, 1);
  EXPECT_EQ(read_csv(dir / "out2" / "bench.csv").at(0)["status"], "oom");
  fs::remove_all(dir);
}

// A combination that fails with an error other than running out of memory or a refused
// configuration is a defect: the row says "failed" with the message, the others still run, and
// the command exits 1 so that scripts do not take the table for a pass. Weights holding a NaN
// pass every config check and fail when each row's runtime loads them.
// train.device_memory caps the device allocator while a runtime lives; the allocators outlive
// it (bench builds one runtime per combination), so the cap is lifted when the runtime is gone,
// and also when building it fails part-way (here: the model does not fit).
TEST(Bench, ARuntimePutsTheDeviceCapacityBackEvenWhenBuildingItFails) {
  Allocator& cpu = allocator_for(Device::cpu());
  const int64_t before = cpu.stats().capacity;
  {
    train::Runtime rt(train::Config::parse(kTinyYaml, {"train.device_memory=64MiB"}, "tiny"));
    EXPECT_EQ(cpu.stats().capacity, int64_t{64} << 20);
  }
  EXPECT_EQ(cpu.stats().capacity, before);
  EXPECT_THROW(
      train::Runtime(train::Config::parse(kTinyYaml, {"train.device_memory=4KiB"}, "tiny")),
      OutOfMemoryError);
  EXPECT_EQ(cpu.stats().capacity, before);
}

TEST(Bench, AFailedCombinationIsReportedAndTheExitStatusSaysSo) {
  fs::path dir = temp_dir("failed");
  {
    std::ofstream out(dir / "tiny.yaml");
    out << kTinyYaml;
  }
  const train::Config config = train::Config::parse(kTinyYaml, {}, "tiny-bench");
  nn::LlamaModel model(train::llama_config_from(config.model), Device::cpu());
  model.init_weights(3);
  for (auto& [name, slot] : model.named_parameters())
    if (name == "model.norm.weight") slot->data<float>()[0] = std::nanf("");
  io::save_hf_model(model, (dir / "weights").string());

  const int code = cli::run({"bench", "--config", (dir / "tiny.yaml").string(), "--set",
                             "model.from_hf=" + (dir / "weights").string(), "--strategies",
                             "none,per_layer", "--precisions", "fp32", "--warmup", "0", "--steps",
                             "1", "--out", (dir / "out").string()});
  EXPECT_EQ(code, 1);
  auto csv = read_csv(dir / "out" / "bench.csv");
  ASSERT_EQ(csv.size(), 2u) << "every combination is reported";
  for (auto& row : csv) {
    EXPECT_EQ(row["status"], "failed");
    EXPECT_NE(row["message"].find("holds NaN or infinite values"), std::string::npos)
        << row["message"];
  }
  fs::remove_all(dir);
}

TEST(Bench, RejectsUnknownNamesAndEmptyLists) {
  train::Config config = train::Config::parse(kTinyYaml, {}, "tiny-bench");
  train::BenchOptions o;
  o.strategies = {"nonw"};
  EXPECT_THROW(train::run_bench(config, o), ConfigError);
  try {
    o.strategies = {"per_layr"};
    train::run_bench(config, o);
    ADD_FAILURE() << "an unknown strategy was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown name 'per_layr'; expected some of none,"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("did you mean 'per_layer'?"), std::string::npos)
        << e.what();
  }
  o.strategies = {"none"};
  o.precisions = {"fp64"};
  EXPECT_THROW(train::run_bench(config, o), ConfigError);
  o.precisions = {};
  EXPECT_THROW(train::run_bench(config, o), ConfigError);
  o.precisions = {"fp32"};
  o.measured_steps = 0;
  EXPECT_THROW(train::run_bench(config, o), ConfigError);
}

// A list with a name twice or an empty name, and an --out that cannot take the results, fail
// before any combination runs (the sweep can take hours on a GPU).
TEST(Bench, BadListsAndOutputDirectoriesFailBeforeTheSweep) {
  fs::path dir = temp_dir("bad-out");
  {
    std::ofstream out(dir / "tiny.yaml");
    out << kTinyYaml;
    std::ofstream(dir / "a-file") << "x";
  }
  auto bench = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {
        "bench",        "--config", (dir / "tiny.yaml").string(), "--warmup", "0", "--steps", "1",
        "--precisions", "fp32"};
    args.insert(args.end(), extra.begin(), extra.end());
    ::testing::internal::CaptureStderr();
    const int code = cli::run(args);
    return std::make_pair(code, ::testing::internal::GetCapturedStderr());
  };
  auto [code, err] = bench({"--strategies", "none,none", "--out", (dir / "o1").string()});
  EXPECT_EQ(code, 1);
  EXPECT_NE(err.find("--strategies: 'none' is listed twice"), std::string::npos) << err;
  std::tie(code, err) = bench({"--strategies", "none,", "--out", (dir / "o2").string()});
  EXPECT_EQ(code, 1);
  EXPECT_NE(err.find("--strategies: an empty name in the list"), std::string::npos) << err;
  std::tie(code, err) = bench({"--strategies", "none", "--out", (dir / "a-file").string()});
  EXPECT_EQ(code, 1);
  EXPECT_NE(
      err.find("bench --out = '" + (dir / "a-file").string() + "': cannot create the directory"),
      std::string::npos)
      << err;
  EXPECT_EQ(err.find("bench: none/fp32"), std::string::npos) << "a combination ran first:\n" << err;
  fs::create_directories(dir / "o3/bench.csv");
  std::tie(code, err) = bench({"--strategies", "none", "--out", (dir / "o3").string()});
  EXPECT_EQ(code, 1);
  EXPECT_NE(err.find("bench.csv' exists and is not a file"), std::string::npos) << err;
  fs::remove_all(dir);
}

TEST(Bench, SameConfigGivesSameBatches) {
  train::Config config = train::Config::parse(kTinyYaml, {"train.global_batch=4"}, "tiny-bench");
  train::StepBatches a(config), b(config);
  EXPECT_EQ(a.micro_batches(), 2);
  for (int step = 0; step < 3; ++step) {
    std::vector<Batch> x = a.next(), y = b.next();
    ASSERT_EQ(x.size(), 2u);
    ASSERT_EQ(y.size(), 2u);
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_EQ(x[i].input_ids.to_int_vector(), y[i].input_ids.to_int_vector());
      EXPECT_EQ(x[i].targets.to_int_vector(), y[i].targets.to_int_vector());
    }
  }
}
