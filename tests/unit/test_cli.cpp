// The command-line framework: flag parsing, help, exit codes and error messages of `shardtrain`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "files.h"
#include "shardtrain/cli/cli.h"
#include "shardtrain/cli/command.h"
#include "shardtrain/train/config.h"
#include "shardtrain/train/progress.h"
#include "temp_dir.h"

namespace cli = shardtrain::cli;

namespace {

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "in: " << (text)

struct Result {
  int code;
  std::string out, err;
};

// Runs `shardtrain args...` in-process with stdout and stderr captured.
Result run(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  std::streambuf* old_out = std::cout.rdbuf(out.rdbuf());
  std::streambuf* old_err = std::cerr.rdbuf(err.rdbuf());
  int code = cli::run(args);
  std::cout.rdbuf(old_out);
  std::cerr.rdbuf(old_err);
  return {code, out.str(), err.str()};
}

cli::Command demo_command() {
  cli::Command c;
  c.name = "demo";
  c.summary = "a command for tests";
  c.flags = {cli::Flag("input", "FILE", "what to read").mandatory(),
             cli::Flag("count", "N", "how many").defaults_to("3"),
             cli::Flag("tag", "T", "a label").repeated(), cli::Flag("verbose", "", "talk more")};
  return c;
}

std::string usage_error(const std::vector<std::string>& args) {
  try {
    cli::parse_args(demo_command(), args);
  } catch (const cli::UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a UsageError";
  return "";
}

}  // namespace

TEST(CliArgs, ParsesValuesSwitchesDefaultsAndRepeats) {
  cli::Args a =
      cli::parse_args(demo_command(), {"--input", "x.txt", "--tag=a", "--tag", "b", "--verbose"});
  EXPECT_EQ(a.get("input"), "x.txt");
  EXPECT_TRUE(a.has("verbose"));
  EXPECT_FALSE(a.has("count"));
  EXPECT_EQ(a.get("count"), "3");
  EXPECT_EQ(a.get_int("count"), 3);
  EXPECT_EQ(a.all("tag"), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(a.positional().empty());
  // A value may start with '-' (a negative number).
  a = cli::parse_args(demo_command(), {"--input=-", "--count", "-2"});
  EXPECT_EQ(a.get("input"), "-");
  EXPECT_EQ(a.get_int("count"), -2);
}

TEST(CliArgs, MistakesAreUsageErrors) {
  EXPECT_CONTAINS(usage_error({"--input", "x", "--cuont", "2"}),
                  "unknown flag '--cuont' for 'shardtrain demo': did you mean '--count'?");
  EXPECT_CONTAINS(usage_error({"--input", "x", "-v"}), "unknown flag '-v'");
  EXPECT_CONTAINS(usage_error({"--input"}), "--input needs a value: --input FILE");
  EXPECT_CONTAINS(usage_error({"--input", "--verbose"}), "--input needs a value");
  EXPECT_CONTAINS(usage_error({"--count", "2"}), "'shardtrain demo' needs --input FILE");
  EXPECT_CONTAINS(usage_error({"--input", "a", "--input", "b"}),
                  "--input is given more than once (a, b)");
  EXPECT_CONTAINS(usage_error({"--input", "a", "--verbose=yes"}),
                  "--verbose is a switch and takes no value");
  EXPECT_CONTAINS(usage_error({"--input", "a", "stray"}),
                  "'shardtrain demo' takes no argument 'stray'");
  cli::Args a = cli::parse_args(demo_command(), {"--input", "a", "--count", "x"});
  EXPECT_THROW(a.get_int("count"), cli::UsageError);
}

TEST(CliArgs, NumbersAreReadWhole) {
  auto number = [](const std::string& text, bool zero_allowed) {
    cli::Args a = cli::parse_args(demo_command(), {"--input", "a", "--count", text});
    return a.get_number("count", zero_allowed, "a count");
  };
  EXPECT_EQ(number("2.5", false), 2.5);
  EXPECT_EQ(number("1e-4", false), 1e-4);
  EXPECT_EQ(number("0", true), 0.0);
  // Not a number: a usage error (exit 2). A number out of range: a bad value (exit 1), as for
  // the integer flags.
  for (const char* bad : {"abc", "1e5x", "1e400", ""})
    EXPECT_THROW(number(bad, true), cli::UsageError) << bad;
  for (const char* bad : {"-1", "nan", "inf"}) {
    EXPECT_THROW(number(bad, true), shardtrain::ConfigError) << bad;
    try {
      number(bad, true);
    } catch (const cli::UsageError&) {
      ADD_FAILURE() << bad << " is a number out of range, not a usage error";
    } catch (const shardtrain::ConfigError&) {
    }
  }
  EXPECT_THROW(number("0", false), shardtrain::ConfigError);
  try {
    number("-3", false);
    ADD_FAILURE() << "-3 was taken";
  } catch (const shardtrain::ConfigError& e) {
    EXPECT_CONTAINS(e.what(), "--count -3: expected a count");
  }
  // As the check command reads its tolerances: a bad one is a usage error (exit 2).
  Result r = run({"check", "--model", "m", "--batch", "b", "--expected", "e", "--rtol", "abc"});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "--rtol abc: expected a positive relative tolerance");
}

TEST(CliArgs, HelpListsEveryFlag) {
  std::string help = cli::command_help(demo_command());
  EXPECT_CONTAINS(help,
                  "usage: shardtrain demo --input FILE [--count N] [--tag T ...] [--verbose]");
  EXPECT_CONTAINS(help, "  --input FILE  what to read (required)\n");
  EXPECT_CONTAINS(help, "  --count N     how many (default: 3)\n");
  EXPECT_CONTAINS(help, "  --tag T       a label (repeatable)\n");
  EXPECT_CONTAINS(help, "  -h, --help    show this help\n");
}

TEST(Cli, TopLevelHelpAndExitCodes) {
  Result r = run({"--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_CONTAINS(r.out, "usage: shardtrain <command>");
  for (const cli::Command& c : cli::commands()) EXPECT_CONTAINS(r.out, "  " + c.name + " ");
  EXPECT_EQ(run({"help"}).out, r.out);

  r = run({});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "usage: shardtrain <command>");

  r = run({"confgi"});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "error: unknown command 'confgi': did you mean 'config'?");

  r = run({"--verbose"});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "error: unknown option '--verbose': give a command first");

  r = run({"config", "--keys", "--bogus"});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "error: unknown flag '--bogus' for 'shardtrain config'");
  EXPECT_CONTAINS(r.err, "run 'shardtrain config --help' for usage");

  r = run({"config", "--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_CONTAINS(r.out, "usage: shardtrain config [--config FILE] [--set KEY=VALUE ...]");
  EXPECT_EQ(run({"help", "config"}).out, r.out);
}

// Tens of thousands of OpenMP threads crash libgomp (or start, and crawl): refused up front.
// The variable is read by the CLI only (OpenMP has read it already, at start-up), so setting it
// here starts no threads.
TEST(Cli, AnAbsurdOpenMpThreadCountIsRefused) {
  const char* before = std::getenv("OMP_NUM_THREADS");
  const std::string saved = before != nullptr ? before : "";
  ::setenv("OMP_NUM_THREADS", "100000", 1);
  Result r = run({"config", "--keys"});
  EXPECT_EQ(r.code, 1);
  EXPECT_CONTAINS(r.err, "error: OMP_NUM_THREADS=100000 asks for 100000 CPU threads per process");
  EXPECT_CONTAINS(r.err, "set OMP_NUM_THREADS to at most");
  EXPECT_EQ(run({"config", "--help"}).code, 0);  // help needs no threads
  ::setenv("OMP_NUM_THREADS", "2,1", 1);         // a nested list: its first level counts
  EXPECT_EQ(run({"config", "--keys"}).code, 0);
  if (before != nullptr)
    ::setenv("OMP_NUM_THREADS", saved.c_str(), 1);
  else
    ::unsetenv("OMP_NUM_THREADS");
}

// plan: the device size comes from --device-memory, else train.device_memory, else 80 GiB; sizes
// and rank counts past what 64 and 32 bits hold are refused, not wrapped round.
TEST(Cli, PlanTakesTheDeviceSizeFromTheConfigAndRefusesOverflowingNumbers) {
  const std::string config = std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/tiny.yaml";
  // The table goes to stdout through printf: capture the file descriptor, not std::cout.
  auto plan_output = [&](std::vector<std::string> args) {
    ::testing::internal::CaptureStdout();
    Result r = run(args);
    r.out += ::testing::internal::GetCapturedStdout();
    return r;
  };
  Result r = plan_output({"plan", "--config", config, "--set", "train.device_memory=1GiB"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "1 rank(s) of 1.00 GiB");
  r = plan_output({"plan", "--config", config, "--set", "train.device_memory=1GiB",
                   "--device-memory", "24GiB"});
  EXPECT_CONTAINS(r.out, "1 rank(s) of 24.00 GiB");
  r = plan_output({"plan", "--config", config});
  EXPECT_CONTAINS(r.out, "1 rank(s) of 80.00 GiB");

  r = run({"plan", "--config", config, "--device-memory", "9223372036854775807"});
  EXPECT_EQ(r.code, 1);
  EXPECT_CONTAINS(r.err, "byte size '9223372036854775807' is too large");
  r = run({"plan", "--config", config, "--world-size", "2147483648"});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "--world-size must be from 1 to 2^24 ranks, got 2147483648");
  // Flags and settings that a run would refuse are refused by the plan too.
  r = run({"plan", "--config", config, "--measure-steps", "3"});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "--measure-steps sets the steps of --measure, which is not given");
  r = run({"plan", "--config", config, "--world-size", "4", "--set", "dist.sharding=hybrid_shard",
           "--set", "dist.ranks_per_node=3"});
  EXPECT_EQ(r.code, 1);
  EXPECT_CONTAINS(r.err, "dist.ranks_per_node=3 does not divide the 4 ranks planned for");
}

// An evaluation on the progress bar: one line, drawn below the step's bar (which stays), that
// the evaluation's result then replaces. As plain lines, a short evaluation prints nothing of its
// own (a long one says how far it got: the EvaluationSignals tests wait for that line).
TEST(Progress, AnEvaluationTakesOneReplacedLineOnTheBarAndNoneInAShortPlainLog) {
  ::testing::internal::CaptureStderr();
  {
    shardtrain::train::Progress bar("bar", 10, "train");
    bar.update(3, "loss 1.0");
    bar.evaluating(3, 0, 8);
    bar.message("eval step 3: loss 0.9");
    bar.update(4, "loss 0.8");
    bar.finish();
  }
  const std::string drawn = ::testing::internal::GetCapturedStderr();
  const std::string step3 = "\r\033[Ktrain [#######.................] 3/10 loss 1.0 eta ";
  const std::string eval =
      "\n\r\033[Ktrain eval step 3: 0/8 batches\r\033[Keval step 3: loss 0.9\n";
  const std::string step4 = "\r\033[Ktrain [#########...............] 4/10 loss 0.8 eta ";
  ASSERT_EQ(drawn.find(step3), 0u) << drawn;
  const size_t at = drawn.find(eval);
  ASSERT_NE(at, std::string::npos) << drawn;
  EXPECT_EQ(drawn.find(step4), at + eval.size()) << drawn;
  EXPECT_EQ(drawn.back(), '\n') << "finish ends the bar's line";

  ::testing::internal::CaptureStderr();
  {
    shardtrain::train::Progress lines("lines", 10, "train");
    lines.evaluating(3, 0, 8);
    lines.evaluating(3, 8, 8);
    lines.message("eval step 3: loss 0.9");
  }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "eval step 3: loss 0.9\n");
}

// The closing lines name the checkpoint that holds the run's weights, and say when the last
// step's are in none: a resumed run that saved nothing has only the checkpoint it started from.
TEST(Cli, TrainSaysWhetherTheLastStepIsInACheckpoint) {
  const std::string config = std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/tiny.yaml";
  const shardtrain::testing::TempDir tmp("cli-train");
  const std::string dir = tmp.path.string();
  auto train = [&](std::vector<std::string> sets) {
    std::vector<std::string> args = {"train", "--config", config};
    sets.insert(sets.end(), {"train.device=cpu", "train.seq_len=32", "train.micro_batch=2",
                             "train.eval_every=0", "train.export=false", "train.progress=none",
                             "train.out_dir=" + dir + "/run"});
    for (const std::string& s : sets) args.insert(args.end(), {"--set", s});
    ::testing::internal::CaptureStdout();
    Result r = run(args);
    r.out += ::testing::internal::GetCapturedStdout();
    return r;
  };
  const std::string step2 = dir + "/run/checkpoints/step-00000002.h5";
  Result r = train({"train.steps=2", "checkpoint.every_steps=2"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "checkpoint: " + step2 + "\n");
  r = train({"train.steps=3", "checkpoint.every_steps=0", "train.resume=auto"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "checkpoint: " + step2 +
                             " (step 2, the one this run resumed from; the weights after step 3 "
                             "are in no checkpoint)");
}

// Temporary files that an earlier run killed mid-write left in its directory (an export's shard,
// a config.yaml) are removed by the next run there, which holds the directory's lock, and named.
// Kept: a file of a process still running, one written in the last minute (perhaps by another
// machine), and files whose names are not the run's own.
TEST(Cli, TrainRemovesTheTemporaryFilesOfAKilledRun) {
  namespace fs = std::filesystem;
  const std::string config = std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/tiny.yaml";
  const shardtrain::testing::TempDir tmp("cli-leftovers");
  const fs::path run_dir = tmp.path / "run";
  fs::create_directories(run_dir / "export");
  const std::string dead = std::to_string(shardtrain::testing::pid_of_no_process());
  const std::string live = std::to_string(::getppid());
  auto write = [&](const fs::path& path, size_t bytes, bool old) {
    std::ofstream(path) << std::string(bytes, 'x');
    if (old) fs::last_write_time(path, fs::file_time_type::clock::now() - std::chrono::minutes(5));
  };
  const fs::path shard = run_dir / ("export/model-00001-of-00002.safetensors.tmp." + dead);
  const fs::path config_yaml = run_dir / ("config.yaml.tmp." + dead);
  write(shard, 3000, true);
  write(config_yaml, 10, true);
  const std::vector<fs::path> kept = {run_dir / ("export/config.json.tmp." + live),
                                      run_dir / ("metrics.jsonl.tmp." + dead),
                                      run_dir / ("data.h5.tmp." + dead), run_dir / "notes.txt"};
  write(kept[0], 10, true);   // its process runs
  write(kept[1], 10, false);  // written just now
  write(kept[2], 10, true);   // not a file a run writes (a prepare-data output, say)
  write(kept[3], 10, true);
  ::testing::internal::CaptureStderr();
  Result r =
      run({"train", "--config", config, "--set", "train.device=cpu", "--set", "train.seq_len=32",
           "--set", "train.steps=1", "--set", "train.eval_every=0", "--set", "train.export=false",
           "--set", "train.progress=none", "--set", "train.out_dir=" + run_dir.string()});
  r.err += ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err,
                  "note: removed 2 temporary file(s) (2.94 KiB) that an earlier run, killed "
                  "while writing, left behind: " +
                      config_yaml.string() + ", " + shard.string() + "\n");
  EXPECT_FALSE(fs::exists(shard));
  EXPECT_FALSE(fs::exists(config_yaml));
  for (const fs::path& path : kept) EXPECT_TRUE(fs::exists(path)) << path;
}

// quantize writes a model's NF4 base in bitsandbytes' layout, which a QLoRA run then reads as
// its base; the output may not be the model's own directory.
TEST(Cli, QuantizeWritesABaseAQloraRunReads) {
  namespace fs = std::filesystem;
  const std::string golden = std::string(SHARDTRAIN_TEST_DATA) + "/golden/llama-tiny-gqa";
  const shardtrain::testing::TempDir tmp("cli-quantize");
  const std::string out = (tmp.path / "nf4").string();
  ::testing::internal::CaptureStderr();
  Result r = run({"quantize", "--model", golden, "--output", out});
  r.err += ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "wrote " + out + ": ");
  EXPECT_CONTAINS(r.err, "NF4 projections: 14/14\n");
  EXPECT_CONTAINS(shardtrain::testing::read_file_bytes(out + "/config.json"),
                  "\"quant_method\": \"bitsandbytes\"");
  const std::string run_yaml = (tmp.path / "qlora.yaml").string();
  std::ofstream(run_yaml) << "model:\n  from_hf: " << out
                          << "\ntrain:\n  steps: 1\n  seq_len: 16\n  micro_batch: 2\n"
                             "  device: cpu\n  progress: lines\n  eval_every: 0\n"
                             "lora:\n  enabled: true\n  r: 4\n";
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  r = run({"train", "--config", run_yaml, "--set", "train.out_dir=" + (tmp.path / "run").string()});
  r.out += ::testing::internal::GetCapturedStdout();
  r.err += ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "its projections already in NF4");

  // The golden model's torch_dtype is float32: its dense weights stay fp32.
  EXPECT_CONTAINS(shardtrain::testing::read_file_bytes(out + "/config.json"),
                  "\"torch_dtype\": \"float32\"");
  // On a copy: were the check ever broken, the source itself would be overwritten.
  const std::string copy = (tmp.path / "golden-copy").string();
  fs::copy(golden, copy);
  r = run({"quantize", "--model", copy, "--output", copy + "/."});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "is --model's directory");
  // "The source's dtype" is the one its weights are stored in, not config.json's label.
  {
    std::string text = shardtrain::testing::read_file_bytes(copy + "/config.json");
    const std::string label = "\"torch_dtype\": \"float32\"";
    ASSERT_NE(text.find(label), std::string::npos);
    text.replace(text.find(label), label.size(), "\"torch_dtype\": \"bfloat16\"");
    std::ofstream(copy + "/config.json") << text;
  }
  const std::string relabelled = (tmp.path / "nf4-relabelled").string();
  ::testing::internal::CaptureStderr();
  r = run({"quantize", "--model", copy, "--output", relabelled});
  r.err += ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(shardtrain::testing::read_file_bytes(relabelled + "/config.json"),
                  "\"torch_dtype\": \"float32\"");
  r = run({"quantize", "--model", golden, "--output", out, "--dtype", "int8"});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "--dtype must be bf16, fp16 or fp32, got 'int8'");
  // An output that cannot be created fails before any projection is quantized.
  const std::string blocked = (tmp.path / "a-file").string();
  std::ofstream(blocked) << "x";
  ::testing::internal::CaptureStderr();
  r = run({"quantize", "--model", golden, "--output", blocked + "/nf4"});
  r.err += ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(r.code, 1);
  EXPECT_CONTAINS(r.err, "cannot create the output directory '" + blocked + "/nf4'");
  EXPECT_EQ(r.err.find("NF4 projections"), std::string::npos) << r.err;
}

TEST(Cli, ConfigCommandPrintsTheResolvedConfig) {
  const std::string tiny = std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/tiny.yaml";
  Result r = run({"config", "--config", tiny, "--set", "optim.lr=1e-4", "--set=train.steps=9"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "  lr: 1e-04 ");
  EXPECT_CONTAINS(r.out, "  steps: 9 ");
  EXPECT_CONTAINS(r.out, "  out_dir: runs/tiny ");
  // What it prints is itself a config that loads to the same values.
  shardtrain::train::Config printed = shardtrain::train::Config::parse(r.out);
  EXPECT_TRUE(printed == shardtrain::train::load_config(tiny, {"optim.lr=1e-4", "train.steps=9"}));

  // recipe: auto refuses what train would refuse before planning, and says the recipe chooses.
  r = run({"config", "--config", tiny, "--set", "recipe=auto", "--set", "precision.compute=bf16"});
  EXPECT_EQ(r.code, 1);
  EXPECT_CONTAINS(r.err, "the run config sets precision.compute=bf16");
  r = run({"config", "--config", tiny, "--set", "recipe=auto"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "# recipe: auto: train chooses the sharding, precision");

  // A setting the run would never read is a warning on stderr, not an error.
  r = run({"config", "--config", tiny, "--set", "optim.name=sgd", "--set", "optim.beta2=0.99"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err,
            "warning: optim.beta2 = 0.99 has no effect: it is an AdamW setting and optim.name is "
            "sgd\n");
  EXPECT_CONTAINS(r.out, "  beta2: 0.99 ");

  // A config error exits with 1 and names the key.
  r = run({"config", "--config", tiny, "--set", "optim.lr=0"});
  EXPECT_EQ(r.code, 1);
  EXPECT_CONTAINS(r.err, "error: --set optim.lr=0: optim.lr = 0 is out of range: must be > 0");
  r = run({"config", "--config", "/nonexistent/x.yaml"});
  EXPECT_EQ(r.code, 1);
  EXPECT_CONTAINS(r.err, "error: config file '/nonexistent/x.yaml' does not exist");
  r = run({"config"});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "--config FILE");
  // A --set that is not KEY=VALUE is a malformed command line, as a missing value is.
  r = run({"config", "--config", tiny, "--set", "optim.lr"});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "--set optim.lr: expected KEY=VALUE");

  r = run({"config", "--keys"});
  EXPECT_EQ(r.code, 0);
  EXPECT_CONTAINS(r.out, "optim.lr ");
  EXPECT_CONTAINS(r.out, "peak learning rate; > 0");
  // --keys reads no config: one given with it (and any --set) would be ignored, so it is refused.
  r = run({"config", "--keys", "--config", "/nonexistent/x.yaml"});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "--keys lists every key of the schema and reads no config");
  r = run({"config", "--keys", "--set", "train.steps=abc"});
  EXPECT_EQ(r.code, 2);
}

TEST(Cli, PrepareDataWritesATokenDataset) {
  const shardtrain::testing::TempDir tmp("cli-prepare");
  const std::filesystem::path dir = tmp.path;
  const std::string text = (dir / "in.txt").string(), h5 = (dir / "out.h5").string();
  std::ofstream(text) << "hello, world\n";  // 13 bytes = 13 byte tokens

  Result r = run({"prepare-data", "--input", text, "--output", h5});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "wrote " + h5 + ": 13 tokens from " + text);
  EXPECT_CONTAINS(r.out, "tokenizer byte, vocabulary 256");
  EXPECT_GT(std::filesystem::file_size(h5), 13u);
  EXPECT_EQ(r.err.find("note: "), std::string::npos) << r.err;

  // A killed earlier run's temporary file is named (with its size), not removed: on a shared
  // file system it may be another machine's, still being written. A live process's is not.
  const int64_t reaped = shardtrain::testing::pid_of_no_process();
  const std::string dead = h5 + ".tmp." + std::to_string(reaped);
  const std::string live = h5 + ".tmp." + std::to_string(::getppid());
  std::ofstream(dead) << std::string(2048, 'x');
  std::ofstream(live) << "x";
  r = run({"prepare-data", "--input", text, "--output", h5});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "note: " + dead +
                             " (2.00 KiB) is the temporary file of an earlier "
                             "prepare-data (process " +
                             std::to_string(reaped) + ", no longer running on this machine)");
  EXPECT_EQ(r.err.find(live), std::string::npos) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dead));

  r = run({"prepare-data", "--input", text});
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "'shardtrain prepare-data' needs --output FILE.h5");
  r = run({"prepare-data", "--input", text, "--output", h5, "--tokenizer", "bpe"});
  EXPECT_EQ(r.code, 1);
  EXPECT_CONTAINS(r.err, "error: unknown tokenizer 'bpe'");
  std::filesystem::remove_all(dir);
}
