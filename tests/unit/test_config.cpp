// The run config: schema validation (with the exact wording users see), --set overrides, YAML
// round trips, activation.layers parsing and the shipped configs/.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "temp_dir.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>

#include "shardtrain/core/error.h"
#include "shardtrain/core/suggest.h"
#include "shardtrain/core/units.h"
#include "shardtrain/train/config.h"

using shardtrain::ConfigError;
using shardtrain::train::Config;
using shardtrain::train::LayerSelection;
using shardtrain::train::load_config;

namespace {

// The message of the ConfigError `f` throws; fails the test when it throws none.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError";
  return "";
}

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "in: " << (text)

std::string parse_error(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  return error_of([&] { Config::parse(yaml, sets, "run.yaml"); });
}

using shardtrain::testing::TempDir;

}  // namespace

TEST(Suggest, EditDistanceAndClosest) {
  EXPECT_EQ(shardtrain::edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(shardtrain::edit_distance("", "abc"), 3u);
  EXPECT_EQ(shardtrain::edit_distance("lr", "lr"), 0u);
  EXPECT_EQ(shardtrain::closest_match("cosin", {"cosine", "constant", "linear"}), "cosine");
  EXPECT_EQ(shardtrain::closest_match("zzzzzz", {"cosine", "constant", "linear"}), "");
}

// Rates read as whole numbers when large and with three significant digits when small, so a
// slow step shows 0.812 tokens/s, not 0.
TEST(Units, RatesKeepThreeSignificantDigitsBelowAHundred) {
  EXPECT_EQ(shardtrain::format_rate(12345.6), "12346");
  EXPECT_EQ(shardtrain::format_rate(100.0), "100");
  EXPECT_EQ(shardtrain::format_rate(45.26), "45.3");
  EXPECT_EQ(shardtrain::format_rate(0.8123), "0.812");
  EXPECT_EQ(shardtrain::format_rate(0.0), "0");
}

TEST(Config, DefaultsMatchTheDocumentedValues) {
  Config c = Config::defaults();
  EXPECT_EQ(c.recipe, "manual");
  EXPECT_EQ(c.model.vocab_size, 256);
  EXPECT_EQ(c.model.hidden_size, 64);
  EXPECT_EQ(c.model.intermediate_size, 176);
  EXPECT_EQ(c.model.effective_num_kv_heads(), 4);
  EXPECT_DOUBLE_EQ(c.model.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.data.path, "builtin");
  EXPECT_DOUBLE_EQ(c.data.eval_fraction, 0.05);
  EXPECT_EQ(c.train.steps, 100);
  EXPECT_EQ(c.train.device, "auto");
  EXPECT_EQ(c.train.device_memory_bytes(), 0);
  EXPECT_DOUBLE_EQ(c.optim.lr, 3e-3);
  EXPECT_DOUBLE_EQ(c.optim.effective_min_lr(), 3e-4);
  EXPECT_EQ(c.precision.effective_param_dtype(), "fp32");
  EXPECT_EQ(c.precision.effective_loss_scale(), "none");
  EXPECT_EQ(c.activation.layers, "all");
  EXPECT_EQ(c.lora.target_modules.size(), 7u);
  EXPECT_EQ(c.effective_checkpoint_dir(), "runs/default/checkpoints");
  // An empty document is the defaults.
  EXPECT_TRUE(Config::parse("") == c);
  EXPECT_TRUE(Config::parse("# only a comment\n") == c);
}

TEST(Config, ReadsEveryKindOfValue) {
  Config c = Config::parse(R"(
recipe: auto
model:
  hidden_size: 96
  num_heads: 6
  num_kv_heads: 2
  tie_embeddings: yes
  rope_theta: 5.0e5
optim:
  lr: 1e-3
  min_lr: 0
  name: sgd
precision:
  compute: fp16
train:
  device: cuda:1
  device_memory: 24GiB
activation:
  offload_min_bytes: 64KiB
  layers: 1-1
lora:
  target_modules: [q_proj, v_proj]
  base_model:
)");
  EXPECT_EQ(c.recipe, "auto");
  EXPECT_EQ(c.model.hidden_size, 96);
  EXPECT_EQ(c.model.effective_num_kv_heads(), 2);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_DOUBLE_EQ(c.model.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.optim.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.optim.effective_min_lr(), 0.0);
  EXPECT_EQ(c.optim.name, "sgd");
  EXPECT_EQ(c.precision.effective_loss_scale(), "dynamic");
  EXPECT_EQ(c.precision.effective_param_dtype(), "fp16");
  EXPECT_EQ(c.train.device, "cuda:1");
  EXPECT_EQ(c.train.device_memory_bytes(), 24ll << 30);
  EXPECT_EQ(c.activation.offload_min_bytes, 65536);
  EXPECT_EQ(c.lora.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(c.lora.base_model, "");
  // Untouched keys keep their defaults.
  EXPECT_EQ(c.train.steps, 100);
  EXPECT_DOUBLE_EQ(c.optim.beta2, 0.95);
}

// Sizes far past any real run are refused by key: their products (a step's tokens, a weight's
// elements) would wrap around int64 into small or negative sizes, and crash or train nothing.
TEST(Config, SizesHaveAnUpperBound) {
  EXPECT_CONTAINS(parse_error("", {"train.seq_len=4611686018427387904"}),
                  "train.seq_len = 4611686018427387904 is out of range: must be in [1, 16777216]");
  EXPECT_CONTAINS(parse_error("", {"train.global_batch=4611686018427387904"}),
                  "train.global_batch = 4611686018427387904 is out of range");
  EXPECT_CONTAINS(parse_error("", {"lora.r=4611686018427387904"}), "lora.r = ");
  EXPECT_CONTAINS(parse_error("", {"model.num_layers=1099511627776"}), "must be in [1, 65536]");
  EXPECT_CONTAINS(parse_error("", {"train.eval_batches=4611686018427387904"}),
                  "train.eval_batches = ");
  EXPECT_NO_THROW(Config::parse("", {"train.seq_len=131072", "model.max_seq_len=131072"}, "x"));
  // One value per --set: a second YAML document in it was dropped without a word.
  EXPECT_CONTAINS(parse_error("", {"train.out_dir=a\n---\nb"}),
                  "--set train.out_dir=a\n---\nb: the value holds 2 YAML documents");
}

TEST(Config, UnknownKeyNamesPathLocationAndSuggestion) {
  std::string msg = parse_error("optim:\n  lr: 1e-3\n  lrr: 2\n");
  EXPECT_CONTAINS(msg, "run.yaml:3:3");
  EXPECT_CONTAINS(msg, "unknown config key 'optim.lrr'");
  EXPECT_CONTAINS(msg, "did you mean 'optim.lr'?");
  EXPECT_CONTAINS(msg, "keys in optim: name, lr, min_lr");

  EXPECT_CONTAINS(parse_error("optim:\n  warmup: 5\n"), "did you mean 'optim.warmup_steps'?");
  // The right key in the wrong section.
  EXPECT_CONTAINS(parse_error("train:\n  lr: 1\n"), "did you mean 'optim.lr'?");
  // An unknown section.
  msg = parse_error("optimizer:\n  lr: 1\n");
  EXPECT_CONTAINS(msg, "unknown config key 'optimizer'");
  EXPECT_CONTAINS(msg, "did you mean 'optim'?");
  // Nothing close: no guess, but the known keys are listed.
  msg = parse_error("data:\n  zzzzzzzz: 1\n");
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
  EXPECT_CONTAINS(msg, "keys in data: path, eval_fraction, seed");
}

TEST(Config, WrongTypeNamesValueAndExpectedType) {
  std::string msg = parse_error("train:\n  steps: ten\n");
  EXPECT_CONTAINS(msg, "run.yaml:2:10");
  EXPECT_CONTAINS(msg, "train.steps = 'ten' has the wrong type: expected a whole number");
  EXPECT_CONTAINS(parse_error("train:\n  steps: 2.5\n"), "train.steps = 2.5 has the wrong type");
  EXPECT_CONTAINS(parse_error("optim:\n  lr: fast\n"),
                  "optim.lr = 'fast' has the wrong type: expected a number");
  EXPECT_CONTAINS(parse_error("model:\n  tie_embeddings: 3\n"),
                  "model.tie_embeddings = 3 has the wrong type: expected true or false");
  EXPECT_CONTAINS(parse_error("data:\n  path: [a, b]\n"),
                  "data.path = [a, b] has the wrong type: expected a single value");
  EXPECT_CONTAINS(parse_error("lora:\n  target_modules: q_proj\n"),
                  "lora.target_modules = 'q_proj' has the wrong type: expected a list");
  EXPECT_CONTAINS(parse_error("train:\n  steps:\n"), "train.steps = (nothing) has the wrong type");
  EXPECT_CONTAINS(parse_error("optim:\n  lr: .inf\n"), "optim.lr = '.inf' has the wrong type");
  EXPECT_CONTAINS(parse_error("activation:\n  offload_min_bytes: lots\n"),
                  "a whole number of bytes or a size such as 64KiB");
  EXPECT_CONTAINS(parse_error("optim: 3\n"), "'optim' is a section and must hold its keys");
  EXPECT_CONTAINS(parse_error("- a\n- b\n"), "the top level must be a mapping of sections");
}

TEST(Config, OutOfRangeNamesTheAllowedRange) {
  EXPECT_CONTAINS(parse_error("optim:\n  lr: 0\n"),
                  "optim.lr = 0 is out of range: must be > 0 (peak learning rate)");
  EXPECT_CONTAINS(parse_error("optim:\n  lr: -1e-3\n"), "optim.lr = -1e-3 is out of range");
  EXPECT_CONTAINS(parse_error("train:\n  steps: 0\n"),
                  "train.steps = 0 is out of range: must be >= 1");
  EXPECT_CONTAINS(parse_error("data:\n  eval_fraction: 0.6\n"),
                  "data.eval_fraction = 0.6 is out of range: must be in (0, 0.5]");
  EXPECT_CONTAINS(parse_error("data:\n  eval_fraction: 0\n"), "must be in (0, 0.5]");
  EXPECT_NO_THROW(Config::parse("data:\n  eval_fraction: 0.5\n"));
  EXPECT_CONTAINS(parse_error("optim:\n  beta1: 1\n"), "must be in [0, 1)");
  EXPECT_CONTAINS(parse_error("precision:\n  growth_factor: 1\n"), "must be > 1");
  // In range as written, out of range as the fp32 the kernels compute with.
  EXPECT_CONTAINS(parse_error("optim:\n  beta2: 0.99999999\n"),
                  "optim.beta2 = 0.99999999 rounds to 1 in fp32, in which the runtime computes, "
                  "and that is out of range: must be in [0, 1) (AdamW second-moment decay)");
  EXPECT_CONTAINS(parse_error("precision:\n  growth_factor: 1.00000000001\n"),
                  "precision.growth_factor = 1.00000000001 rounds to 1 in fp32");
  EXPECT_EQ(Config::parse("optim:\n  beta2: 0.9999999\n").optim.beta2, 0.9999999);
  // Integers past 64 bits are out of range, not of the wrong type.
  EXPECT_CONTAINS(parse_error("model:\n  hidden_size: 99999999999999999999\n"),
                  "model.hidden_size = 99999999999999999999 is past what a 64-bit integer holds: "
                  "must be in [1, ");
  EXPECT_CONTAINS(parse_error("data:\n  seed: 18446744073709551615\n"),
                  "must be >= 0 and below 2^63");
  // A model whose weights start at zero has zero gradients and never learns.
  EXPECT_CONTAINS(parse_error("model:\n  init_std: 0\n"), "model.init_std = 0 is out of range");
}

TEST(Config, ControlCharactersInValuesAndKeysAreEscapedInMessages) {
  // A NUL would end the message where it is printed.
  EXPECT_CONTAINS(parse_error(std::string("optim:\n  schedule: \"cos\\0ine\"\n")),
                  "optim.schedule = 'cos\\x00ine' is not allowed");
  EXPECT_CONTAINS(parse_error(std::string("optim:\n  \"l\\x01r\": 1\n")),
                  "unknown config key 'optim.l\\x01r'");
}

TEST(Config, NumbersMustFitFp32) {
  // fp32 would make these inf or 0; beyond a double they do not read at all.
  EXPECT_CONTAINS(parse_error("optim:\n  lr: 1e39\n"),
                  "optim.lr = 1e39 is outside fp32's range, in which the runtime computes: use a "
                  "magnitude between 1.2e-38 and 3.4e38, > 0 (peak learning rate)");
  // 0 is offered only where the key takes it.
  EXPECT_CONTAINS(parse_error("optim:\n  weight_decay: 1e39\n"), "use 0 or a magnitude between");
  EXPECT_CONTAINS(parse_error("data:\n  eval_fraction: 1e-300\n"),
                  "use a magnitude between 1.2e-38 and 3.4e38, in (0, 0.5]");
  EXPECT_CONTAINS(parse_error("optim:\n  eps: 1e-50\n"), "optim.eps = 1e-50 is outside fp32's");
  EXPECT_CONTAINS(parse_error("optim:\n  weight_decay: 1e400\n"),
                  "optim.weight_decay = 1e400 is outside fp32's");
  EXPECT_CONTAINS(parse_error("model:\n  init_std: 1e-400\n"),
                  "model.init_std = 1e-400 is outside fp32's");
  EXPECT_CONTAINS(parse_error("", {"optim.lr=-1e39"}), "optim.lr = -1e39 is outside fp32's");
  // Not a number at all stays a type error.
  EXPECT_CONTAINS(parse_error("optim:\n  lr: 1e5e5\n"), "has the wrong type: expected a number");
  // The edges of the range read.
  EXPECT_EQ(Config::parse("optim:\n  lr: 3e38\n").optim.lr, 3e38);
  EXPECT_EQ(Config::parse("optim:\n  eps: 2e-38\n").optim.eps, 2e-38);
  EXPECT_EQ(Config::parse("optim:\n  weight_decay: 0\n").optim.weight_decay, 0.0);
}

TEST(Config, SettingsThatTheRunNeverReadsAreListed) {
  auto unused = [](const std::string& yaml) { return Config::parse(yaml).unused_settings(); };
  EXPECT_TRUE(Config::defaults().unused_settings().empty());
  EXPECT_EQ(unused("optim:\n  name: sgd\n  beta1: 0.8\n  eps: 1e-6\n  momentum: 0.5\n"),
            (std::vector<std::string>{
                "optim.beta1 = 0.8 has no effect: it is an AdamW setting and optim.name is sgd",
                "optim.eps = 1e-06 has no effect: it is an AdamW setting and optim.name is sgd"}));
  EXPECT_EQ(unused("optim:\n  momentum: 0.5\n"),
            (std::vector<std::string>{"optim.momentum = 0.5 has no effect: it is an SGD setting "
                                      "and optim.name is adamw"}));
  // A key at its default value is not reported (every dumped config holds every key).
  EXPECT_TRUE(unused("optim:\n  name: sgd\n  beta1: 0.9\n").empty());
  EXPECT_EQ(unused("precision:\n  compute: bf16\n  init_scale: 1024\n"),
            (std::vector<std::string>{
                "precision.init_scale = 1024 has no effect: this run has no loss scaling "
                "(precision.loss_scale auto with precision.compute bf16; auto scales fp16 "
                "only)"}));
  EXPECT_TRUE(unused("precision:\n  compute: fp16\n  init_scale: 1024\n").empty());
  EXPECT_TRUE(unused("precision:\n  loss_scale: dynamic\n  init_scale: 1024\n").empty());
  EXPECT_EQ(unused("activation:\n  strategy: offload\n  checkpoint_impl: reentrant\n"),
            (std::vector<std::string>{"activation.checkpoint_impl = reentrant has no effect: "
                                      "activation.strategy offload recomputes nothing"}));
  EXPECT_TRUE(unused("activation:\n  strategy: offload_checkpoint\n  checkpoint_impl: reentrant\n  "
                     "offload_min_bytes: 4096\n")
                  .empty());
  EXPECT_EQ(unused("activation:\n  strategy: per_layer\n  offload_min_bytes: 4096\n").size(), 1u);
  EXPECT_EQ(unused("activation:\n  layers: \"0\"\n").size(), 1u);
  EXPECT_EQ(unused("activation:\n  attention_backward: atomic_dq\n").size(), 1u);
  EXPECT_TRUE(unused("activation:\n  attention: fused\n  attention_backward: atomic_dq\n").empty());
  EXPECT_EQ(unused("lora:\n  r: 8\n  target_modules: [q_proj]\n").size(), 2u);
  EXPECT_TRUE(unused("lora:\n  enabled: true\n  r: 8\n").empty());
  EXPECT_EQ(unused("train:\n  eval_every: 0\n  eval_batches: 2\n").size(), 1u);
  EXPECT_EQ(unused("optim:\n  offload_moments: device\n").size(), 1u);
  // recipe: auto picks the strategy, the precision and the offload: keys waiting for them count.
  EXPECT_TRUE(unused("recipe: auto\nactivation:\n  checkpoint_impl: reentrant\n  "
                     "offload_min_bytes: 4096\nprecision:\n  init_scale: 1024\noptim:\n  "
                     "offload_moments: device\n")
                  .empty());
  EXPECT_EQ(unused("optim:\n  schedule: constant\n  min_lr: 1e-4\n").size(), 1u);
}

TEST(Config, BadEnumListsChoicesAndSuggests) {
  std::string msg = parse_error("optim:\n  schedule: cosin\n");
  EXPECT_CONTAINS(msg, "run.yaml:2:13");
  EXPECT_CONTAINS(msg,
                  "optim.schedule = 'cosin' is not allowed: expected one of cosine, "
                  "constant, linear; did you mean 'cosine'?");
  EXPECT_CONTAINS(parse_error("precision:\n  param_dtype: fp8\n"),
                  "expected one of \"\", fp32, bf16, fp16");
  EXPECT_CONTAINS(parse_error("lora:\n  target_modules: [q_proj, qkv]\n"),
                  "lora.target_modules = 'qkv' is not allowed: expected items from q_proj");
  EXPECT_CONTAINS(parse_error("lora:\n  target_modules: [q_proj, q_proj]\n"),
                  "lists 'q_proj' twice");
  EXPECT_CONTAINS(parse_error("lora:\n  target_modules: []\n"), "lora.target_modules is empty");
  EXPECT_CONTAINS(parse_error("train:\n  device: gpu\n"),
                  "train.device = 'gpu' is not valid: expected auto, cpu, cuda or cuda:N");
  EXPECT_CONTAINS(parse_error("train:\n  device: host\n"), "expected auto, cpu, cuda or cuda:N");
  EXPECT_CONTAINS(parse_error("train:\n  device_memory: 24 parsecs\n"),
                  "train.device_memory = '24 parsecs' is not valid");
  // A fraction of a byte is refused, not rounded away; a fraction of a larger unit is a size.
  for (const std::string fraction : {"0.5", "0.1B", "1024.5"}) {
    EXPECT_CONTAINS(parse_error("activation:\n  offload_min_bytes: " + fraction + "\n"),
                    "expected a whole number of bytes");
    EXPECT_CONTAINS(parse_error("", {"activation.offload_min_bytes=" + fraction}),
                    "expected a whole number of bytes");
  }
  EXPECT_EQ(Config::parse("train:\n  device_memory: 1.5GiB\n").train.device_memory_bytes(),
            int64_t{3} << 29);
}

TEST(Config, SetOverridesApplyBeforeValidation) {
  const std::string file = "optim:\n  lr: 1e-3\ntrain:\n  steps: 7\n";
  Config c = Config::parse(file, {"optim.lr=5e-4", "train.micro_batch=3",
                                  "model.from_hf=", "lora.target_modules=[up_proj, down_proj]",
                                  "recipe=auto", "activation.layers=every:2"});
  EXPECT_DOUBLE_EQ(c.optim.lr, 5e-4);  // the override wins over the file
  EXPECT_EQ(c.train.steps, 7);         // the file wins over the default
  EXPECT_EQ(c.train.micro_batch, 3);
  EXPECT_EQ(c.model.from_hf, "");
  EXPECT_EQ(c.lora.target_modules, (std::vector<std::string>{"up_proj", "down_proj"}));
  EXPECT_EQ(c.recipe, "auto");
  EXPECT_EQ(c.activation.layers, "every:2");
  // Later overrides of the same key win; a section missing from the file is created.
  c = Config::parse("", {"dist.timeout_s=5", "dist.timeout_s=9"});
  EXPECT_EQ(c.dist.timeout_s, 9);

  // A bad value names the --set it came from.
  EXPECT_CONTAINS(parse_error(file, {"optim.lr=-1"}),
                  "--set optim.lr=-1: optim.lr = -1 is out of range: must be > 0");
  std::string msg = parse_error(file, {"optim.lrr=1"});
  EXPECT_CONTAINS(msg, "--set optim.lrr=1: unknown config key 'optim.lrr'");
  EXPECT_CONTAINS(msg, "did you mean 'optim.lr'?");
  EXPECT_CONTAINS(parse_error(file, {"optim.lr"}), "expected section.key=value");
  EXPECT_CONTAINS(parse_error(file, {"optim=1"}), "'optim' is a section, not a key");
  EXPECT_CONTAINS(parse_error(file, {"lora.target_modules=[q_proj"}),
                  "--set lora.target_modules=[q_proj: cannot read the value as YAML");
  EXPECT_CONTAINS(parse_error("optim: 3\n", {"optim.lr=1"}), "'optim' in the config is not a");

  // '#' on a command line is text, not a comment; quoted values stay YAML's.
  c = Config::parse("",
                    {"train.out_dir=runs/a #2", "data.path=#1.txt", "model.from_hf=\"dir #3\""});
  EXPECT_EQ(c.train.out_dir, "runs/a #2");
  EXPECT_EQ(c.data.path, "#1.txt");
  EXPECT_EQ(c.model.from_hf, "dir #3");
  EXPECT_CONTAINS(parse_error("", {"train.steps=5 #6"}),
                  "train.steps = '5 #6' has the wrong type: expected a whole number");
}

// A shell expands ~ only at the start of a word, never inside a YAML file or `key=~/x`: the
// path keys expand a leading "~" or "~/" themselves (train.out_dir: ~/runs once made a
// directory named "~" in the working directory).
TEST(Config, PathKeysExpandALeadingTilde) {
  const char* before = std::getenv("HOME");
  const std::string saved = before != nullptr ? before : "";
  ::setenv("HOME", "/home/someone", 1);
  Config c =
      Config::parse("train:\n  out_dir: ~/runs/a\ndata:\n  path: ~/corpus.txt\n",
                    {"checkpoint.dir=~/ck", "model.from_hf=~other/model", "lora.enabled=true",
                     "lora.init_from=a/~/b", "train.resume=~/runs/a/checkpoints"});
  EXPECT_EQ(c.train.out_dir, "/home/someone/runs/a");
  EXPECT_EQ(c.data.path, "/home/someone/corpus.txt");
  EXPECT_EQ(c.checkpoint.dir, "/home/someone/ck");
  EXPECT_EQ(c.model.from_hf, "~other/model");  // another user's home is not guessed
  EXPECT_EQ(c.lora.init_from, "a/~/b");
  EXPECT_EQ(c.train.resume, "/home/someone/runs/a/checkpoints");
  if (before != nullptr)
    ::setenv("HOME", saved.c_str(), 1);
  else
    ::unsetenv("HOME");
}

TEST(Config, YamlSyntaxErrorNamesFileLineAndColumn) {
  std::string msg = parse_error("model:\n  hidden_size: 64\n   num_layers: 2\n");
  EXPECT_CONTAINS(msg, "run.yaml:3:");
  EXPECT_CONTAINS(msg, "YAML syntax error");

  TempDir dir;
  std::string path = dir.write("broken.yaml", "train:\n  steps: 3\n  seq_len: [1, 2\n");
  msg = error_of([&] { load_config(path); });
  EXPECT_CONTAINS(msg, path + ":4:1: YAML syntax error");
  msg = error_of([&] { load_config(dir.write("x.yaml", "") + ".missing"); });
  EXPECT_CONTAINS(msg, "x.yaml.missing' does not exist");
  // Past the parser's nesting limit yaml-cpp says only "bad file".
  msg = parse_error("model: " + std::string(3000, '[') + std::string(3000, ']') + "\n");
  EXPECT_CONTAINS(msg, "run.yaml:1:");
  EXPECT_CONTAINS(msg, " levels deep, past what the parser reads; a config nests three at most");
}

TEST(Config, DuplicateKeysAreRejected) {
  EXPECT_CONTAINS(parse_error("optim:\n  lr: 1\n  lr: 2\n"),
                  "run.yaml:3:3: optim.lr is given twice");
}

TEST(Config, RulesThatTieKeysTogether) {
  EXPECT_CONTAINS(parse_error("train:\n  global_batch: 64\n  global_batch_tokens: 8192\n"),
                  "train.global_batch (64) and train.global_batch_tokens (8192) both set");
  EXPECT_CONTAINS(parse_error("train:\n  global_batch: 20\n  micro_batch: 8\n"),
                  "train.global_batch (20) must be a multiple of train.micro_batch (8)");
  EXPECT_CONTAINS(parse_error("train:\n  global_batch_tokens: 1000\n"),
                  "multiple of train.seq_len x train.micro_batch (128 x 8 = 1024)");
  EXPECT_NO_THROW(Config::parse("train:\n  global_batch_tokens: 4096\n"));
  EXPECT_CONTAINS(parse_error("optim:\n  lr: 1e-3\n  min_lr: 1e-2\n"),
                  "optim.min_lr (0.01) is above optim.lr (0.001)");
  EXPECT_CONTAINS(parse_error("model:\n  hidden_size: 100\n  num_heads: 3\n"),
                  "model.hidden_size (100) must be divisible by model.num_heads (3)");
  EXPECT_CONTAINS(parse_error("model:\n  hidden_size: 60\n  num_heads: 4\n"),
                  "head size model.hidden_size / model.num_heads = 15 must be even");
  EXPECT_CONTAINS(parse_error("model:\n  num_kv_heads: 3\n"),
                  "model.num_kv_heads (3) must divide model.num_heads (4)");
  EXPECT_CONTAINS(parse_error("train:\n  seq_len: 4096\n"),
                  "train.seq_len (4096) exceeds model.max_seq_len (2048)");
  // With from_hf the shape is read from config.json later, so the shape keys are not checked.
  EXPECT_NO_THROW(Config::parse("model:\n  from_hf: /m\n  hidden_size: 100\n  num_heads: 3\n"));
}

TEST(Config, LoraBaseModelLoadsTheBaseWeights) {
  Config c = Config::parse("", {"lora.enabled=true", "lora.base_model=/models/base"});
  EXPECT_EQ(c.model.from_hf, "/models/base") << "the base is loaded as model.from_hf loads it";
  c = Config::parse("", {"lora.enabled=true", "lora.base_model=/m", "model.from_hf=/m"});
  EXPECT_EQ(c.model.from_hf, "/m");
  try {
    Config::parse("", {"lora.enabled=true", "lora.base_model=/a", "model.from_hf=/b"});
    ADD_FAILURE() << "two different base models accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("name different base models"), std::string::npos)
        << e.what();
  }
  // A base directory that is missing or holds no model is named by the key the user set.
  TempDir dir;
  const std::string config = dir.write("run.yaml", "train:\n  steps: 2\n");
  const std::string missing = dir.str("missing");
  EXPECT_CONTAINS(error_of([&] {
                    load_config(config, {"lora.enabled=true", "lora.base_model=" + missing});
                  }),
                  "lora.base_model '" + missing + "' does not exist");
  EXPECT_CONTAINS(error_of([&] {
                    load_config(config, {"lora.enabled=true", "lora.base_model=" + dir.str()});
                  }),
                  "lora.base_model '" + dir.str() + "' has no config.json");
  EXPECT_CONTAINS(error_of([&] { load_config(config, {"model.from_hf=" + missing}); }),
                  "model.from_hf '" + missing + "' does not exist");
  try {
    Config::parse("", {"lora.base_model=/a"});
    ADD_FAILURE() << "a LoRA base without LoRA accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("lora.enabled is false"), std::string::npos) << e.what();
  }
}

TEST(Config, SeveralYamlDocumentsAreRejected) {
  try {
    Config::parse("train:\n  steps: 3\n---\ntrain:\n  steps: 5\n", {}, "two.yaml");
    ADD_FAILURE() << "the second document would be ignored";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("two.yaml holds 2 YAML documents"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(Config::parse("---\ntrain:\n  steps: 3\n", {}, "one.yaml").train.steps, 3);
}

TEST(Config, SequencesPerStepDependOnTheRanks) {
  Config c = Config::parse("train:\n  micro_batch: 4\n");
  EXPECT_EQ(c.train.sequences_per_step(1), 4);
  EXPECT_EQ(c.train.sequences_per_step(8), 32);  // 0 = micro_batch x ranks
  c = Config::parse("train:\n  micro_batch: 4\n  global_batch: 24\n");
  EXPECT_EQ(c.train.sequences_per_step(1), 24);
  EXPECT_EQ(c.train.sequences_per_step(3), 24);
  EXPECT_CONTAINS(error_of([&] { c.train.sequences_per_step(4); }),
                  "train.global_batch (24) must be a multiple of train.micro_batch x "
                  "data-parallel ranks (4 x 4 = 16): use 16 or 32 sequences");
  EXPECT_CONTAINS(error_of([&] { c.train.sequences_per_step(8); }),
                  "(4 x 8 = 32): use 32 sequences");
  c = Config::parse("train:\n  micro_batch: 2\n  seq_len: 64\n  global_batch_tokens: 1024\n");
  EXPECT_EQ(c.train.sequences_per_step(2), 16);
  EXPECT_CONTAINS(error_of([&] { c.train.sequences_per_step(3); }),
                  "train.global_batch_tokens (1024) / seq_len (64) = 16 sequences must be a "
                  "multiple of train.micro_batch x data-parallel ranks (2 x 3 = 6): use 768 or "
                  "1152 tokens (train.global_batch_tokens)");
}

TEST(Config, LayerSelectionParsesEveryForm) {
  auto selected = [](const std::string& text, int64_t num_layers) {
    std::string out;
    LayerSelection s = LayerSelection::parse(text);
    for (int64_t l = 0; l < num_layers; ++l) out += s.applies_to_layer(l, num_layers) ? '1' : '0';
    return out;
  };
  EXPECT_EQ(selected("all", 6), "111111");
  EXPECT_EQ(selected("2-4", 6), "001110");
  EXPECT_EQ(selected("3", 6), "000100");
  EXPECT_EQ(selected("every:2", 6), "101010");
  EXPECT_EQ(selected("every:4", 6), "100010");
  EXPECT_EQ(selected("0, 3-4", 6), "100110");

  EXPECT_CONTAINS(error_of([] { LayerSelection::parse("5-2"); }),
                  "activation.layers = '5-2' is not valid: the range 5-2 runs backwards; write "
                  "it as 2-5");
  EXPECT_CONTAINS(error_of([] { LayerSelection::parse("every:0"); }), "K >= 1");
  EXPECT_CONTAINS(error_of([] { LayerSelection::parse("first"); }),
                  "expected all, a layer N, a range A-B, every:K");
  EXPECT_CONTAINS(error_of([] { LayerSelection::parse(""); }), "expected all");
  EXPECT_CONTAINS(error_of([] { LayerSelection::parse("1,,2"); }), "expected all");
  EXPECT_CONTAINS(error_of([] { LayerSelection::parse("0-1,"); }), "ends with a comma");
  EXPECT_CONTAINS(error_of([] { LayerSelection::parse("2-5").applies_to_layer(0, 4); }),
                  "names layer 5 but the model has 4 layers (0-3");

  // Through the config: syntax is checked on load, bounds against model.num_layers.
  shardtrain::train::ActivationConfig a;
  a.layers = "1-2";
  EXPECT_FALSE(a.applies_to_layer(0, 4));
  EXPECT_TRUE(a.applies_to_layer(2, 4));
  EXPECT_CONTAINS(parse_error("activation:\n  layers: 2to5\n"),
                  "run.yaml:2:11: activation.layers = '2to5' is not valid: expected all");
  EXPECT_CONTAINS(parse_error("activation:\n  layers: 0-2\n"),
                  "names layer 2 but the model has 2 layers");
}

TEST(Config, ToYamlListsEveryKeyAndRoundTrips) {
  Config defaults = Config::defaults();
  std::string yaml = defaults.to_yaml();
  for (const char* line :
       {"recipe: manual", "  from_hf: \"\"", "  rms_norm_eps: 1e-05", "  out_dir: runs/default",
        "  export: true", "  min_lr: -1", "  layers: all", "  param_dtype: \"\"",
        "  target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj]",
        "\nlora:\n  enabled: false"})
    EXPECT_CONTAINS(yaml, line);
  EXPECT_TRUE(Config::parse(yaml, {}, "dump") == defaults);

  // Every key of the schema appears once: as many key lines as describe_config_keys() rows.
  size_t key_lines = 0, rows = 0;
  for (char ch : shardtrain::train::describe_config_keys()) rows += ch == '\n';
  std::istringstream lines(yaml);
  for (std::string l; std::getline(lines, l);)
    if (l.find(": ") != std::string::npos && l.rfind("#", 0) != 0) ++key_lines;
  EXPECT_EQ(key_lines, rows);
  EXPECT_EQ(rows, 86u);

  // Values that need quoting or exact float text survive the trip.
  Config c = Config::parse(
      "", {"data.path=yes", "train.out_dir=runs/a b", "optim.lr=1.2345678e-4",
           "activation.layers=every:3", "train.resume=\"123\"", "checkpoint.every_minutes=2.5",
           "lora.adapter_out=\"a\\nb\"", "lora.enabled=true", "lora.base_model=\"a\\\"q\""});
  EXPECT_EQ(c.data.path, "yes");
  EXPECT_EQ(c.train.resume, "123");
  EXPECT_EQ(c.lora.base_model, "a\"q");
  EXPECT_EQ(c.lora.adapter_out, "a\nb");
  Config back = Config::parse(c.to_yaml(), {}, "dump");
  EXPECT_TRUE(back == c);
  EXPECT_DOUBLE_EQ(back.optim.lr, 1.2345678e-4);
  EXPECT_EQ(back.train.out_dir, "runs/a b");
}

TEST(Config, RopeScalingIsAGroupOfModelKeys) {
  const std::string llama3 =
      "model:\n  rope_scaling:\n    rope_type: llama3\n    factor: 8.0\n"
      "    low_freq_factor: 1.0\n    high_freq_factor: 4.0\n"
      "    original_max_position_embeddings: 8192\n";
  Config c = Config::parse(llama3);
  EXPECT_EQ(c.model.rope_scaling.rope_type, "llama3");
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.model.rope_scaling.original_max_position_embeddings, 8192);
  // The default is no scaling; an empty group (config.json writes null) is the same.
  EXPECT_EQ(Config::defaults().model.rope_scaling.rope_type, "none");
  EXPECT_TRUE(Config::parse("model:\n  rope_scaling:\n") == Config::defaults());

  // Dumped as a nested mapping, and read back.
  const std::string yaml = c.to_yaml();
  EXPECT_CONTAINS(yaml, "\n  rope_scaling:\n    rope_type: llama3");
  EXPECT_CONTAINS(yaml, "\n    original_max_position_embeddings: 8192");
  EXPECT_TRUE(Config::parse(yaml, {}, "dump") == c);
  EXPECT_CONTAINS(shardtrain::train::describe_config_keys(), "model.rope_scaling.factor");

  // --set reaches into the group, whether the file has it, has an empty one, or has no model.
  c = Config::parse(llama3, {"model.rope_scaling.factor=32"});
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.factor, 32.0);
  EXPECT_EQ(c.model.rope_scaling.original_max_position_embeddings, 8192);
  const std::vector<std::string> sets = {
      "model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=32",
      "model.rope_scaling.low_freq_factor=1", "model.rope_scaling.high_freq_factor=4",
      "model.rope_scaling.original_max_position_embeddings=8192"};
  for (const std::string& base : {std::string(""), std::string("model:\n  rope_scaling:\n"),
                                  std::string("model:\n  hidden_size: 64\n")}) {
    c = Config::parse(base, sets);
    EXPECT_EQ(c.model.rope_scaling.rope_type, "llama3") << base;
    EXPECT_DOUBLE_EQ(c.model.rope_scaling.factor, 32.0) << base;
  }
  c = Config::parse("", {"model.rope_scaling={rope_type: llama3, factor: 8, low_freq_factor: 1, "
                         "high_freq_factor: 4, original_max_position_embeddings: 8192}"});
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.factor, 8.0);

  // Only llama3 is implemented.
  for (const char* type : {"linear", "dynamic", "yarn"}) {
    std::string msg = parse_error("model:\n  rope_scaling:\n    rope_type: " + std::string(type) +
                                  "\n    factor: 8\n");
    EXPECT_CONTAINS(msg, "run.yaml:3:16: model.rope_scaling.rope_type = '" + std::string(type) +
                             "' is not valid: only llama3 RoPE scaling");
  }
  // llama3 needs all four numbers, and they must make sense; without it none may be set.
  EXPECT_CONTAINS(parse_error("model:\n  rope_scaling:\n    rope_type: llama3\n    factor: 8\n"),
                  "model.rope_scaling.rope_type llama3 needs model.rope_scaling.low_freq_factor, "
                  "model.rope_scaling.high_freq_factor, "
                  "model.rope_scaling.original_max_position_embeddings");
  EXPECT_CONTAINS(parse_error(llama3, {"model.rope_scaling.low_freq_factor=4"}),
                  "model.rope_scaling: high_freq_factor (4) must be greater than "
                  "low_freq_factor (4)");
  EXPECT_CONTAINS(parse_error(llama3, {"model.rope_scaling.factor=-1"}),
                  "model.rope_scaling.factor = -1 is out of range: must be >= 0");
  EXPECT_CONTAINS(parse_error("model:\n  rope_scaling:\n    factor: 8\n"),
                  "model.rope_scaling.factor (8) is set but model.rope_scaling.rope_type is none");
  // Structure and spelling.
  EXPECT_CONTAINS(parse_error("model:\n  rope_scaling: llama3\n"),
                  "'model.rope_scaling' is a group of keys and must hold them indented below it "
                  "(such as rope_type: ...), found a single value");
  std::string msg = parse_error("model:\n  rope_scaling:\n    type: llama3\n");
  EXPECT_CONTAINS(msg,
                  "run.yaml:3:5: unknown config key 'model.rope_scaling.type': did you mean "
                  "'model.rope_scaling.rope_type'?");
  EXPECT_CONTAINS(msg, "keys in model.rope_scaling: rope_type, factor, low_freq_factor");
  EXPECT_CONTAINS(parse_error("model:\n  factor: 8\n"),
                  "did you mean 'model.rope_scaling.factor'?");
  EXPECT_CONTAINS(parse_error("", {"model.rope_scaling.fator=8"}),
                  "did you mean 'model.rope_scaling.factor'?");
  EXPECT_CONTAINS(parse_error("model:\n  rope_scaling:\n    factor: 8\n  rope_scaling:\n"),
                  "given twice");
}

TEST(Config, LoadConfigDerivesOutDirFromTheFileName) {
  TempDir dir;
  Config c = load_config(dir.write("my-run.yaml", "train:\n  steps: 2\n"));
  EXPECT_EQ(c.train.out_dir, "runs/my-run");
  EXPECT_EQ(c.effective_checkpoint_dir(), "runs/my-run/checkpoints");
  c = load_config(dir.write("b.yaml", "train:\n  out_dir: /tmp/elsewhere\n"));
  EXPECT_EQ(c.train.out_dir, "/tmp/elsewhere");
  c = load_config(dir.write("c.yaml", "train:\n  steps: 2\n"), {"train.out_dir=o"});
  EXPECT_EQ(c.train.out_dir, "o");
  // A file with no settings at all (empty, or comments only) is refused: every default would
  // train where a run of the user's own was meant.
  for (const char* text : {"", "# just a comment\n", "\n\n"}) {
    const std::string empty = dir.write("empty.yaml", text);
    EXPECT_CONTAINS(error_of([&] { load_config(empty); }),
                    "config file '" + empty + "' holds no settings (it is empty or only comments)");
  }
  // A FIFO or a device is no config file: opening or reading it would never end.
  const std::string fifo = dir.str("fifo.yaml");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& special : {fifo, std::string("/dev/zero")})
    EXPECT_CONTAINS(error_of([&] { load_config(special); }),
                    "config file '" + special + "' is not a regular file");
  // A bad key in a file names the file.
  std::string path = dir.write("bad.yaml", "model:\n  hiden_size: 8\n");
  EXPECT_CONTAINS(error_of([&] { load_config(path); }),
                  path +
                      ":2:3: unknown config key 'model.hiden_size': did you mean "
                      "'model.hidden_size'?");
}

namespace {
// Parameters of a Llama built from the config's shape (embeddings, attention, SwiGLU MLP, norms).
int64_t llama_parameters(const shardtrain::train::ModelConfig& m) {
  int64_t head_dim = m.hidden_size / m.num_heads;
  int64_t kv = m.effective_num_kv_heads() * head_dim;
  int64_t attention = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * kv;
  int64_t mlp = 3 * m.hidden_size * m.intermediate_size;
  int64_t per_layer = attention + mlp + 2 * m.hidden_size;
  int64_t embeddings = m.vocab_size * m.hidden_size * (m.tie_embeddings ? 1 : 2);
  return m.num_layers * per_layer + embeddings + m.hidden_size;
}
}  // namespace

TEST(Config, EveryShippedConfigLoads) {
  const std::filesystem::path dir = std::filesystem::path(SHARDTRAIN_SOURCE_DIR) / "configs";
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".yaml") continue;
    SCOPED_TRACE(entry.path().string());
    Config c;
    EXPECT_NO_THROW(c = load_config(entry.path().string()));
    EXPECT_EQ(c.train.out_dir, "runs/" + entry.path().stem().string());
    // A dump of a shipped config reads back to the same config.
    EXPECT_TRUE(Config::parse(c.to_yaml(), {}, "dump") == c);
    // Nothing in it is set for nothing.
    EXPECT_EQ(c.unused_settings(), std::vector<std::string>{});
    ++count;
  }
  EXPECT_GE(count, 4);

  Config tiny = load_config((dir / "tiny.yaml").string());
  EXPECT_EQ(tiny.model.vocab_size, 256);
  EXPECT_EQ(tiny.train.seq_len, 128);
  int64_t tiny_params = llama_parameters(tiny.model);
  EXPECT_EQ(tiny_params, 803968);
  EXPECT_GE(tiny_params, 300000);
  EXPECT_LE(tiny_params, 1000000);

  Config small = load_config((dir / "llama-125m.yaml").string());
  EXPECT_EQ(small.model.hidden_size, 768);
  EXPECT_EQ(small.model.num_layers, 12);
  EXPECT_EQ(small.model.vocab_size, 32000);
  EXPECT_EQ(small.train.seq_len, 2048);

  Config one_b = load_config((dir / "llama-1b.yaml").string());
  EXPECT_EQ(one_b.model.hidden_size, 2048);
  EXPECT_EQ(one_b.model.effective_num_kv_heads(), 8);
  EXPECT_TRUE(one_b.model.tie_embeddings);
  EXPECT_DOUBLE_EQ(one_b.model.rope_theta, 500000.0);
  // Llama-3.2-1B has 1,235,814,400 parameters.
  EXPECT_EQ(llama_parameters(one_b.model), 1235814400);

  // Llama-3.2-1B's config.json: rope_scaling llama3 with factor 32, 1, 4, 8192.
  EXPECT_EQ(one_b.model.rope_scaling.rope_type, "llama3");
  EXPECT_DOUBLE_EQ(one_b.model.rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(one_b.model.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(one_b.model.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(one_b.model.rope_scaling.original_max_position_embeddings, 8192);

  Config eight_b = load_config((dir / "llama-3.1-8b.yaml").string());
  // Llama-3.1-8B's config.json: rope_scaling llama3 with factor 8, 1, 4, 8192.
  for (const char* name : {"llama-3.1-8b.yaml", "qlora-llama-3.1-8b.yaml"}) {
    const auto& rs = load_config((dir / name).string()).model.rope_scaling;
    EXPECT_EQ(rs.rope_type, "llama3") << name;
    EXPECT_DOUBLE_EQ(rs.factor, 8.0) << name;
    EXPECT_DOUBLE_EQ(rs.low_freq_factor, 1.0) << name;
    EXPECT_DOUBLE_EQ(rs.high_freq_factor, 4.0) << name;
    EXPECT_EQ(rs.original_max_position_embeddings, 8192) << name;
  }
  EXPECT_FALSE(eight_b.model.tie_embeddings);
  EXPECT_EQ(eight_b.model.intermediate_size, 14336);
  // Llama-3.1-8B has 8,030,261,248 parameters.
  EXPECT_EQ(llama_parameters(eight_b.model), 8030261248);
}

// The gathered parameters are the compute dtype: a param_dtype that differs would quietly run
// another precision than precision.compute names (and loss scaling keys on the latter).
TEST(Config, ParamDtypeMustBeTheComputeDtype) {
  EXPECT_EQ(Config::parse("precision:\n  compute: bf16\n  param_dtype: bf16\n")
                .precision.effective_param_dtype(),
            "bf16");
  for (const char* yaml : {"precision:\n  compute: bf16\n  param_dtype: fp32\n",
                           "precision:\n  compute: fp32\n  param_dtype: bf16\n",
                           "precision:\n  compute: bf16\n  param_dtype: fp16\n"}) {
    try {
      Config::parse(yaml);
      ADD_FAILURE() << "accepted:\n" << yaml;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("differs from precision.compute"), std::string::npos)
          << e.what();
    }
  }
}

// docs/config.md lists every key of the schema.
TEST(ConfigDocs, EveryKeyIsDocumented) {
  std::ifstream in(std::string(SHARDTRAIN_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(in) << "docs/config.md is missing";
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int keys = 0;
  for (const auto& [key, value] : Config::defaults().key_values()) {
    ++keys;
    EXPECT_NE(text.find("| `" + key + "` |"), std::string::npos)
        << key << " is missing from docs/config.md (`shardtrain config --keys` lists it)";
  }
  EXPECT_GT(keys, 60);
}
