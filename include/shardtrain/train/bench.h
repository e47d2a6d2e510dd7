// The offload-vs-recompute lab: trains the same model on the same batches under every
// combination of activation strategy and precision, and records what each costs in memory and
// buys or loses in speed (`shardtrain bench`; docs/experiments.md shows how to read it).
//
// Every combination gets a fresh Runtime built from the same config (same seed, so the same
// initial weights) and a fresh sampler (the same batches), runs warm-up steps, then measured
// steps of real training. A combination that runs out of memory is reported as OOM with the
// request that failed, one that the build or the config rejects as unsupported, and the bench
// goes on with the next.
//
// Each row also gets its model FLOPs utilisation (MFU): the model FLOPs per token of the PaLM /
// llm.c convention (model_flops_per_token below) times tokens/s, over the device's peak
// (BenchOptions::peak_tflops, else the datasheet figure for the GPU's name and the row's
// precision, else none on a CPU).
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/data/batch.h"
#include "shardtrain/memory/category.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/train/config.h"

namespace shardtrain::train {

struct BenchOptions {
  std::vector<std::string> strategies = {"none",      "per_layer", "sqrt_segment",
                                         "selective", "offload",   "offload_checkpoint"};
  std::vector<std::string> precisions = {"fp32", "bf16", "fp16"};
  int64_t warmup_steps = 1;
  int64_t measured_steps = 3;
  // Peak of one device in TFLOP/s for the MFU column, applied to every row; 0 = the datasheet
  // figure for the GPU's name and each row's precision (peak_tflops_for_gpu), none on a CPU.
  double peak_tflops = 0;
  // Called with one line per finished combination (progress on stderr, say); may be empty.
  std::function<void(const std::string&)> log;
};

// Unsupported: the configuration was refused (a ConfigError: a combination this build or device
// does not run). Failed: any other error while it ran (a CUDA error, a shape error): a defect,
// which makes `shardtrain bench` exit non-zero.
enum class BenchStatus { Ok, OutOfMemory, Unsupported, Failed };
std::string_view bench_status_name(BenchStatus s);  // "ok", "oom", "unsupported", "failed"

// The figures of one combination on one rank.
struct BenchRow {
  std::string strategy, precision;
  BenchStatus status = BenchStatus::Ok;
  std::string message;              // the error's message (OOM, unsupported, failed)
  int64_t oom_requested_bytes = 0;  // the allocation that failed (OOM)
  int rank = 0;

  // Device memory, max over the measured steps.
  int64_t peak_bytes = 0;
  std::array<int64_t, kNumMemoryCategories> peak_by_category{};  // each category's own peak
  std::array<int64_t, kNumMemoryCategories> at_peak{};  // the breakdown when the total peaked
  // Host pool, max over the measured steps.
  int64_t host_offloaded_peak = 0;
  int64_t host_optimizer_peak = 0;

  // Wall time of one train_step.
  double step_ms_median = 0, step_ms_min = 0, step_ms_max = 0;
  int64_t tokens_per_step = 0;  // input tokens of one step on this rank
  double tokens_per_s = 0;      // tokens_per_step / median step time
  double final_loss = 0;
  // Measured steps that loss scaling skipped (fp16 overflow): their step time is not a real
  // step's, and a row whose every step was skipped trained nothing.
  int64_t skipped_steps = 0;
  int64_t measured_steps = 0;

  // Activation-layer counters per measured step (mean over the measured steps).
  double forward_reruns = 0;
  double bytes_offloaded = 0;
  double bytes_restored = 0;
  double recompute_ms = 0;
  double transfer_ms = 0;
  double copy_ms = 0;  // offload copies' own duration (overlaps compute on a GPU)

  // Against strategy none of the same precision (< 0 when that row has no figures).
  double peak_vs_none = -1;      // peak / none's peak
  double overhead_vs_none = -1;  // step time / none's step time - 1

  // Arithmetic rate (filled by run_bench; see model_flops_per_token).
  double model_flops_per_token = 0;
  double achieved_tflops = 0;  // tokens_per_s x model_flops_per_token / 1e12
  double peak_tflops = 0;      // of the devices this row ran on, each; 0 = unknown
  double mfu = -1;             // achieved / (peak x devices); < 0 when the peak is unknown
  bool ok() const { return status == BenchStatus::Ok; }
};

struct BenchReport {
  std::vector<BenchRow> rows;  // one per combination (over ranks: max memory and time)
  // Under a launcher with several ranks: every rank's rows, rank-major (empty otherwise).
  std::vector<BenchRow> rank_rows;
  int world_size = 1;
  std::string device;       // "cpu", "cuda:0"
  std::string device_name;  // the GPU's description ("NVIDIA H100 80GB HBM3 (sm_90, ...)"), or ""
  int cpu_threads = 0;      // OpenMP threads a rank's CPU work ran on (0: not on the CPU device)
  std::string config_summary;
  double model_flops_per_token = 0;
  int64_t flops_parameters = 0;  // N of model_flops_per_token
  std::string peak_source;       // where peak_tflops came from; "" when there is none
  std::string date;              // UTC, ISO 8601
  std::string host;

  // The table printed on stdout: strategy | precision | peak MiB | vs none | step ms |
  // tokens/s | overhead | recomputes | offloaded MiB | TFLOP/s | MFU, then each rank's figures
  // when there are several.
  std::string markdown() const;
  std::string csv() const;
  std::string json() const;  // every field, rows and rank_rows
};

// ---- model FLOPs and utilisation ------------------------------------------------------------
//
// Model FLOPs of one trained token (forward and backward), the convention of PaLM (Chowdhery et
// al. 2022, appendix B) and llm.c:
//
//   6 N + 12 L H S
//
// N = flops_parameter_count: the weights that multiply activations, i.e. every parameter except
// the input embedding table when it is separate from the LM head (a lookup does no
// arithmetic; a tied table is the head and counts once). Each such weight costs 2 FLOPs per
// token forward and 4 backward. L layers, H = heads x head_dim, S = seq_len: the attention
// scores and weighted sum (2 S H FLOPs each per token and layer forward, twice that backward).
// The causal mask is not credited (the full S x S is counted, as PaLM and llm.c do), nor is
// any recomputation: these are model FLOPs, so a checkpointing strategy that re-runs the
// forward has a lower MFU at the same hardware rate. Frozen (QLoRA) weights count as if trained,
// so a QLoRA row overstates its work by up to 2 FLOPs per frozen weight and token.
int64_t flops_parameter_count(const nn::LlamaConfig& model);
double model_flops_per_token(const nn::LlamaConfig& model, int64_t seq_len);

// Dense peak TFLOP/s of one GPU from its name (cuda::device_description) for a compute
// precision, from the vendor datasheets: bf16/fp16 tensor-core figures without sparsity, and
// for fp32 the plain (non-tensor-core) FP32 rate, since the CUDA backend computes fp32 products
// with CUBLAS_COMPUTE_32F (no TF32). H100 SXM, H200 and GH200: 989.4 / 67; H100 PCIe: 756.5 /
// 51; H100 NVL and H200 NVL: 835.5 / 60; A100: 312 / 19.5. 0 for any other GPU or precision.
double peak_tflops_for_gpu(const std::string& gpu_name, const std::string& precision);

// achieved TFLOP/s over devices x peak; -1 when peak_tflops <= 0.
double model_flops_utilization(double tokens_per_s, double flops_per_token, double peak_tflops,
                               int devices);

// Throws ConfigError naming the flag when an option is out of range or names an unknown
// strategy or precision (run_bench checks too; the CLI calls it before it creates --out).
void check_bench_options(const BenchOptions& options);

// Runs every combination of options.strategies x options.precisions on `config`.
BenchReport run_bench(const Config& config, const BenchOptions& options);

// Trains `config` as it is for warmup_steps + measured_steps steps on this process and returns
// its figures (strategy and precision taken from the config). OutOfMemoryError, ConfigError and
// any other shardtrain::Error are caught and reported in the row's status.
BenchRow measure_config(const Config& config, int64_t warmup_steps, int64_t measured_steps);

// Creates `dir` and checks that bench.csv and bench.json can be written there: called before
// the combinations run, so that a bad --out fails in seconds, not after the whole sweep. Throws
// ConfigError naming --out.
void prepare_bench_output(const std::string& dir);

// Writes bench.csv, bench.json and, when gnuplot is on PATH, frontier.{png,svg} (peak memory
// against tokens/s per strategy) and memory.{png,svg} (the peak by category, stacked), with the
// data and scripts they are drawn from. Returns the paths written. Throws ConfigError when `dir`
// cannot be created or written.
std::vector<std::string> write_bench_outputs(const BenchReport& report, const std::string& dir);

// The training batches of `config` as `shardtrain train` draws them: each call gives this rank's
// micro-batches of the next global batch (all of them on a single process). Two sources made
// from equal configs give equal batches.
class StepBatches {
 public:
  explicit StepBatches(const Config& config);
  ~StepBatches();
  StepBatches(const StepBatches&) = delete;
  StepBatches& operator=(const StepBatches&) = delete;
  std::vector<Batch> next();
  int64_t micro_batches() const { return accumulation_; }  // per rank

 private:
  struct State;
  std::unique_ptr<State> state_;
  int world_ = 1, rank_ = 0;
  int64_t global_batch_ = 0, accumulation_ = 1;
};

}  // namespace shardtrain::train
