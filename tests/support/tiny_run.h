// The tiny training run that whole-run tests (checkpoint and resume, on one process and under
// mpirun) share, and readers for what a run leaves behind. Header-only, so the launcher tests,
// which link no shardtrain library, use it too.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "files.h"

namespace shardtrain::testing {

// A 2-layer Llama (hidden 32, grouped-query heads) for 40 steps of 8 sequences of 16 tokens on
// the built-in corpus: a step takes milliseconds on a CPU rank. No periodic checkpoints or
// evaluation; tests turn on what they exercise with overrides (`--set` on the command line).
inline constexpr const char* kTinyRunYaml = R"(
model:
  vocab_size: 256
  hidden_size: 32
  intermediate_size: 64
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
  max_seq_len: 16
train:
  steps: 40
  seq_len: 16
  micro_batch: 1
  global_batch: 8
  eval_every: 0
  progress: none
  device: cpu
  seed: 7
optim:
  lr: 3.0e-3
  warmup_steps: 5
dist:
  timeout_s: 120
checkpoint:
  every_steps: 0
)";

// step -> training loss from a run's metrics.jsonl. A step logged twice is a test failure (a
// resumed run must continue the file, not repeat it).
inline std::map<int64_t, double> read_step_losses(const std::string& metrics_path) {
  std::map<int64_t, double> losses;
  std::ifstream in(metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j["event"] != "step") continue;
    const int64_t step = j["step"].get<int64_t>();
    EXPECT_EQ(losses.count(step), 0u) << "step " << step << " logged twice in " << metrics_path;
    losses[step] = j["loss"].get<double>();
  }
  return losses;
}

}  // namespace shardtrain::testing
