#include "shardtrain/train/bench.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "shardtrain/activation/strategy.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/cpu_threads.h"
#include "shardtrain/core/error.h"
#include "shardtrain/core/files.h"
#include "shardtrain/core/suggest.h"
#include "shardtrain/data/corpus.h"
#include "shardtrain/data/sampler.h"
#include "shardtrain/data/tokenizer.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/memory/allocator.h"
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/output_dir.h"
#include "shardtrain/train/runtime.h"
#include "shardtrain/train/schedule.h"

#ifdef SHARDTRAIN_HAVE_CUDA
#include "shardtrain/backend/cuda.h"
#endif

namespace shardtrain::train {

namespace fs = std::filesystem;

// ---- batches --------------------------------------------------------------------------------

struct StepBatches::State {
  TokenDataset data;
  Sampler sampler;
  State(TokenDataset d, const SamplerConfig& sc)
      : data(std::move(d)), sampler(data, Split::Train, sc) {}
};

StepBatches::StepBatches(const Config& config)
    : world_(dist::job_world_size()), rank_(dist::job_rank()) {
  const TrainConfig& t = config.train;
  TokenDataset data = load_token_source(config.data.path);
  check_data_fits_model(data, config);
  SamplerConfig sc;
  sc.seq_len = t.seq_len;
  sc.eval_fraction = config.data.eval_fraction;
  sc.seed = static_cast<uint64_t>(config.data.seed);
  state_ = std::make_unique<State>(std::move(data), sc);
  global_batch_ = t.sequences_per_step(world_);
  accumulation_ = global_batch_ / (t.micro_batch * world_);
}

StepBatches::~StepBatches() = default;

std::vector<Batch> StepBatches::next() {
  const int64_t per_rank = global_batch_ / world_;
  return split_batch(state_->sampler.next_batch_rows(global_batch_, rank_ * per_rank, per_rank),
                     accumulation_);
}

// ---- model FLOPs and utilisation ------------------------------------------------------------

int64_t flops_parameter_count(const nn::LlamaConfig& model) {
  // An untied input embedding is a lookup: no multiply-adds.
  const int64_t input_embedding = model.tie_embeddings ? 0 : model.vocab_size * model.hidden_size;
  return model.num_parameters() - input_embedding;
}

double model_flops_per_token(const nn::LlamaConfig& model, int64_t seq_len) {
  const double attention_width = static_cast<double>(model.num_heads * model.head_dim());
  return 6.0 * static_cast<double>(flops_parameter_count(model)) +
         12.0 * static_cast<double>(model.num_layers) * attention_width *
             static_cast<double>(seq_len);
}

double peak_tflops_for_gpu(const std::string& gpu_name, const std::string& precision) {
  std::string name = gpu_name;
  for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  struct Peak {
    double half, fp32;  // dense bf16/fp16 tensor-core, plain fp32
  };
  Peak peak{0, 0};
  if (has("h100 pcie"))
    peak = {756.5, 51.0};
  else if (has("h100 nvl") || has("h200 nvl"))
    peak = {835.5, 60.0};
  else if (has("h100") || has("h200") || has("gh200"))
    peak = {989.4, 67.0};
  else if (has("a100"))
    peak = {312.0, 19.5};
  if (precision == "bf16" || precision == "fp16") return peak.half;
  if (precision == "fp32") return peak.fp32;
  return 0;
}

double model_flops_utilization(double tokens_per_s, double flops_per_token, double peak_tflops,
                               int devices) {
  if (peak_tflops <= 0 || devices <= 0) return -1;
  return tokens_per_s * flops_per_token / (peak_tflops * 1e12 * devices);
}

// ---- running the combinations ---------------------------------------------------------------

std::string_view bench_status_name(BenchStatus s) {
  switch (s) {
    case BenchStatus::Ok:
      return "ok";
    case BenchStatus::OutOfMemory:
      return "oom";
    case BenchStatus::Unsupported:
      return "unsupported";
    case BenchStatus::Failed:
      return "failed";
  }
  return "?";
}

namespace {

const std::vector<std::string>& known_precisions() {
  static const std::vector<std::string> names = {"fp32", "bf16", "fp16"};
  return names;
}

void check_names(const std::vector<std::string>& given, const std::vector<std::string>& known,
                 const char* flag) {
  ST_CHECK_AS(ConfigError, !given.empty(), flag, ": the list is empty");
  for (size_t i = 0; i < given.size(); ++i) {
    ST_CHECK_AS(ConfigError, !given[i].empty(), flag,
                ": an empty name in the list (a comma too many?)");
    ST_CHECK_AS(ConfigError,
                std::find(given.begin(), given.begin() + i, given[i]) == given.begin() + i, flag,
                ": '", given[i], "' is listed twice");
  }
  for (const std::string& g : given) {
    if (std::find(known.begin(), known.end(), g) != known.end()) continue;
    std::string list;
    for (const std::string& k : known) list += (list.empty() ? "" : ",") + k;
    const std::string near = closest_match(g, known);
    throw ConfigError(std::string(flag) + ": unknown name '" + g + "'; expected some of " + list +
                      (near.empty() ? "" : "; did you mean '" + near + "'?"));
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

BenchRow measure_config(const Config& config, int64_t warmup_steps, int64_t measured_steps) {
  BenchRow row;
  row.strategy = config.activation.strategy;
  row.precision = config.precision.compute;
  try {
    // Each combination starts with nothing cached by the one before, on the device and in
    // (pinned) host memory: their block sizes are not its own, a GPU cache full of them would
    // be split or given back mid-measurement, and the CPU cache's bound follows the bytes in
    // use since it was emptied.
    const Device device = training_device(config);
    allocator_for(device).empty_cache();
    if (device.is_cuda()) allocator_for(Device::host()).empty_cache();
    StepBatches batches(config);
    Runtime rt(config);  // caps the device allocator at train.device_memory while it lives
    optim::LrSchedule schedule = lr_schedule(config);
    int64_t step = 0;
    for (int64_t i = 0; i < warmup_steps; ++i, ++step)
      rt.train_step(batches.next(), schedule.at(step));
    std::vector<double> ms;
    double reruns = 0, offloaded = 0, restored = 0, recompute_s = 0, transfer_s = 0, copy_s = 0;
    for (int64_t i = 0; i < measured_steps; ++i, ++step) {
      std::vector<Batch> micro = batches.next();
      int64_t tokens = 0;
      for (const Batch& b : micro) tokens += b.input_ids.numel();
      Backend& backend = backend_for(rt.device());
      backend.synchronize();
      auto start = std::chrono::steady_clock::now();
      StepResult r = rt.train_step(micro, schedule.at(step));
      backend.synchronize();  // a GPU may still be running the optimizer step
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
      reruns += static_cast<double>(r.forward_reruns);
      offloaded += static_cast<double>(r.bytes_offloaded);
      restored += static_cast<double>(r.bytes_restored);
      recompute_s += r.recompute_seconds;
      transfer_s += r.transfer_seconds;
      copy_s += r.copy_seconds;
      row.tokens_per_step = tokens;
      row.final_loss = r.loss;
      row.skipped_steps += r.skipped ? 1 : 0;
      ++row.measured_steps;
      const MemoryStats& d = r.device_memory;
      if (d.total_peak > row.peak_bytes) {
        row.peak_bytes = d.total_peak;
        row.at_peak = d.at_peak;
      }
      for (int k = 0; k < kNumMemoryCategories; ++k)
        row.peak_by_category[static_cast<size_t>(k)] =
            std::max(row.peak_by_category[static_cast<size_t>(k)], d.peak[static_cast<size_t>(k)]);
      row.host_offloaded_peak =
          std::max(row.host_offloaded_peak, r.host_memory.peak_of(MemoryCategory::Offloaded));
      row.host_optimizer_peak =
          std::max(row.host_optimizer_peak, r.host_memory.peak_of(MemoryCategory::OptimizerState));
    }
    if (!ms.empty()) {
      double n = static_cast<double>(ms.size());
      row.step_ms_median = median(ms);
      row.step_ms_min = *std::min_element(ms.begin(), ms.end());
      row.step_ms_max = *std::max_element(ms.begin(), ms.end());
      row.tokens_per_s = static_cast<double>(row.tokens_per_step) / (row.step_ms_median / 1e3);
      row.forward_reruns = reruns / n;
      row.bytes_offloaded = offloaded / n;
      row.bytes_restored = restored / n;
      row.recompute_ms = recompute_s * 1e3 / n;
      row.transfer_ms = transfer_s * 1e3 / n;
      row.copy_ms = copy_s * 1e3 / n;
    }
  } catch (const OutOfMemoryError& e) {
    row.status = BenchStatus::OutOfMemory;
    row.message = e.what();
    row.oom_requested_bytes = e.requested_bytes();
  } catch (const ConfigError& e) {
    row.status = BenchStatus::Unsupported;
    row.message = e.what();
  } catch (const DistributedError&) {
    // A collective failed or timed out (another rank failed alone): the ranks no longer agree
    // on which collective comes next, so the sweep cannot go on. The job ends with the error.
    throw;
  } catch (const Error& e) {
    row.status = BenchStatus::Failed;
    row.message = e.what();
  }
  return row;
}

namespace {

// The figures of a row that travel between ranks, as doubles (exact for byte counts < 2^53).
constexpr int kPacked = 18 + 2 * kNumMemoryCategories;

std::array<double, kPacked> pack(const BenchRow& r) {
  std::array<double, kPacked> v{};
  size_t i = 0;
  v[i++] = static_cast<double>(r.status);
  v[i++] = static_cast<double>(r.oom_requested_bytes);
  v[i++] = static_cast<double>(r.peak_bytes);
  v[i++] = static_cast<double>(r.host_offloaded_peak);
  v[i++] = static_cast<double>(r.host_optimizer_peak);
  v[i++] = r.step_ms_median;
  v[i++] = r.step_ms_min;
  v[i++] = r.step_ms_max;
  v[i++] = static_cast<double>(r.tokens_per_step);
  v[i++] = r.final_loss;
  v[i++] = r.forward_reruns;
  v[i++] = r.bytes_offloaded;
  v[i++] = r.bytes_restored;
  v[i++] = r.recompute_ms;
  v[i++] = r.transfer_ms;
  v[i++] = r.copy_ms;
  v[i++] = static_cast<double>(r.skipped_steps);
  v[i++] = static_cast<double>(r.measured_steps);
  for (int64_t b : r.peak_by_category) v[i++] = static_cast<double>(b);
  for (int64_t b : r.at_peak) v[i++] = static_cast<double>(b);
  return v;
}

BenchRow unpack(const double* v, const BenchRow& shape, int rank) {
  BenchRow r;
  r.strategy = shape.strategy;
  r.precision = shape.precision;
  r.rank = rank;
  size_t i = 0;
  r.status = static_cast<BenchStatus>(static_cast<int>(v[i++]));
  r.oom_requested_bytes = static_cast<int64_t>(v[i++]);
  r.peak_bytes = static_cast<int64_t>(v[i++]);
  r.host_offloaded_peak = static_cast<int64_t>(v[i++]);
  r.host_optimizer_peak = static_cast<int64_t>(v[i++]);
  r.step_ms_median = v[i++];
  r.step_ms_min = v[i++];
  r.step_ms_max = v[i++];
  r.tokens_per_step = static_cast<int64_t>(v[i++]);
  r.final_loss = v[i++];
  r.forward_reruns = v[i++];
  r.bytes_offloaded = v[i++];
  r.bytes_restored = v[i++];
  r.recompute_ms = v[i++];
  r.transfer_ms = v[i++];
  r.copy_ms = v[i++];
  r.skipped_steps = static_cast<int64_t>(v[i++]);
  r.measured_steps = static_cast<int64_t>(v[i++]);
  for (int64_t& b : r.peak_by_category) b = static_cast<int64_t>(v[i++]);
  for (int64_t& b : r.at_peak) b = static_cast<int64_t>(v[i++]);
  r.tokens_per_s =
      r.step_ms_median > 0 ? static_cast<double>(r.tokens_per_step) / (r.step_ms_median / 1e3) : 0;
  if (rank == shape.rank) r.message = shape.message;
  return r;
}

// The numbers reach every rank, the failing rank's message does not: the first failing rank sends
// the start of its message (every rank knows which one that is from the numbers), so the row of
// the whole job says why it failed. Collective.
void share_first_failure_message(dist::ProcessGroup& world, std::vector<BenchRow>& ranks,
                                 const BenchRow& local) {
  constexpr size_t kMessageBytes = 4096;
  auto failed = std::find_if(ranks.begin(), ranks.end(),
                             [](const BenchRow& r) { return r.status != BenchStatus::Ok; });
  if (failed == ranks.end()) return;
  std::vector<int64_t> text(kMessageBytes, 0);
  if (failed->rank == local.rank)
    for (size_t i = 0; i < std::min(kMessageBytes, local.message.size()); ++i)
      text[i] = static_cast<unsigned char>(local.message[i]);
  world.all_reduce_host(text, dist::ReduceOp::Max);
  std::string message;
  for (int64_t c : text) {
    if (c == 0) break;
    message.push_back(static_cast<char>(c));
  }
  if (message.size() == kMessageBytes) message += " [...]";  // cut short
  failed->message = message;
}

// The row over all ranks: the worst status, the largest memory and step time; tokens/s of the
// whole job (every rank's tokens over the slowest rank's median step).
BenchRow combine(const std::vector<BenchRow>& ranks, const BenchRow& local) {
  BenchRow m = local;
  m.rank = -1;
  int64_t tokens = 0;
  for (const BenchRow& r : ranks) {
    if (r.status != BenchStatus::Ok && m.status == BenchStatus::Ok) {
      m.status = r.status;
      m.oom_requested_bytes = r.oom_requested_bytes;
      if (m.message.empty())
        m.message =
            "rank " + std::to_string(r.rank) + (r.message.empty() ? " failed" : ": ") + r.message;
    }
    if (r.peak_bytes > m.peak_bytes) {
      m.peak_bytes = r.peak_bytes;
      m.at_peak = r.at_peak;
    }
    for (size_t k = 0; k < m.peak_by_category.size(); ++k)
      m.peak_by_category[k] = std::max(m.peak_by_category[k], r.peak_by_category[k]);
    m.host_offloaded_peak = std::max(m.host_offloaded_peak, r.host_offloaded_peak);
    m.host_optimizer_peak = std::max(m.host_optimizer_peak, r.host_optimizer_peak);
    m.step_ms_median = std::max(m.step_ms_median, r.step_ms_median);
    m.step_ms_min = std::max(m.step_ms_min, r.step_ms_min);
    m.step_ms_max = std::max(m.step_ms_max, r.step_ms_max);
    m.forward_reruns = std::max(m.forward_reruns, r.forward_reruns);
    m.bytes_offloaded = std::max(m.bytes_offloaded, r.bytes_offloaded);
    m.bytes_restored = std::max(m.bytes_restored, r.bytes_restored);
    m.recompute_ms = std::max(m.recompute_ms, r.recompute_ms);
    m.transfer_ms = std::max(m.transfer_ms, r.transfer_ms);
    m.copy_ms = std::max(m.copy_ms, r.copy_ms);
    m.skipped_steps = std::max(m.skipped_steps, r.skipped_steps);
    tokens += r.tokens_per_step;
  }
  m.tokens_per_step = tokens;
  m.tokens_per_s =
      m.step_ms_median > 0 ? static_cast<double>(tokens) / (m.step_ms_median / 1e3) : 0;
  return m;
}

// Each row against strategy none at its precision (and, among one rank's rows, on its rank).
void fill_ratios(std::vector<BenchRow>& rows) {
  for (BenchRow& r : rows) {
    r.peak_vs_none = r.overhead_vs_none = -1;
    if (!r.ok()) continue;
    for (const BenchRow& n : rows) {
      if (n.strategy != "none" || n.precision != r.precision || n.rank != r.rank || !n.ok())
        continue;
      if (n.peak_bytes > 0)
        r.peak_vs_none = static_cast<double>(r.peak_bytes) / static_cast<double>(n.peak_bytes);
      if (n.step_ms_median > 0) r.overhead_vs_none = r.step_ms_median / n.step_ms_median - 1.0;
    }
  }
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

// The arithmetic figures of a row that ran on `devices` devices of `peak_tflops` each.
void fill_rate(BenchRow& r, double flops_per_token, double peak_tflops, int devices) {
  r.model_flops_per_token = flops_per_token;
  r.peak_tflops = peak_tflops;
  r.achieved_tflops = 0;
  r.mfu = -1;
  if (!r.ok()) return;
  r.achieved_tflops = r.tokens_per_s * flops_per_token / 1e12;
  r.mfu = model_flops_utilization(r.tokens_per_s, flops_per_token, peak_tflops, devices);
}

}  // namespace

void check_bench_options(const BenchOptions& options) {
  check_names(options.strategies, activation::activation_strategies(), "--strategies");
  check_names(options.precisions, known_precisions(), "--precisions");
  ST_CHECK_AS(ConfigError, options.warmup_steps >= 0, "--warmup must be 0 or more, got ",
              options.warmup_steps);
  ST_CHECK_AS(ConfigError, options.measured_steps >= 1, "--steps must be at least 1, got ",
              options.measured_steps);
}

BenchReport run_bench(const Config& config, const BenchOptions& options) {
  check_bench_options(options);
  StepBatches validate(config);  // data and batch errors concern every combination: fail now

  std::unique_ptr<dist::DistEnv> env;
  if (dist::detect_launch().world_size > 1) env = std::make_unique<dist::DistEnv>();
  const int world = env ? env->world_size() : 1;
  const int rank = env ? env->rank() : 0;
  if (env) {
    // Every rank must run the same combinations and steps, or the collectives inside them pair
    // up wrongly and the job hangs until dist.timeout_s. (The run configs are compared when the
    // first combination's runtime starts.)
    std::string flags =
        std::to_string(options.warmup_steps) + "/" + std::to_string(options.measured_steps);
    for (const std::string& s : options.strategies) flags += "/" + s;
    flags += "|";
    for (const std::string& p : options.precisions) flags += "/" + p;
    const auto mine = static_cast<int64_t>(std::hash<std::string>{}(flags) >> 1);
    std::vector<int64_t> extremes = {mine, -mine};  // max of x and of -x: max and -min
    env->world().all_reduce_host(extremes, dist::ReduceOp::Max);
    ST_CHECK_AS(ConfigError, extremes[0] == -extremes[1],
                "bench: the ranks were started with different --strategies, --precisions, "
                "--warmup or --steps; start every rank with the same command");
  }

  BenchReport report;
  report.world_size = world;
  report.device = resolve_device(config.train.device).str();
  if (training_device(config).is_cpu()) report.cpu_threads = cpu_thread_count();
  report.date = utc_now();
  report.host = host_name();
#ifdef SHARDTRAIN_HAVE_CUDA
  if (const Device d = training_device(config); d.is_cuda())
    report.device_name = cuda::device_description(d.index);
#endif
  {
    const nn::LlamaConfig model = llama_config_from(config.model);
    report.flops_parameters = flops_parameter_count(model);
    report.model_flops_per_token = model_flops_per_token(model, config.train.seq_len);
  }
  auto peak_for = [&](const std::string& precision) {
    return options.peak_tflops > 0 ? options.peak_tflops
                                   : peak_tflops_for_gpu(report.device_name, precision);
  };
  if (options.peak_tflops > 0) {
    report.peak_source = "--peak-tflops";
  } else if (!report.device_name.empty()) {
    bool known = false;
    for (const std::string& p : options.precisions) known = known || peak_for(p) > 0;
    if (known)
      report.peak_source = "datasheet figure for " + report.device_name;
    else if (options.log)
      options.log("bench: no datasheet peak for '" + report.device_name +
                  "'; give --peak-tflops for the MFU column");
  }
  {
    const ModelConfig& m = config.model;
    std::ostringstream s;
    s << "hidden " << m.hidden_size << ", " << m.num_layers << " layers, " << m.num_heads
      << " heads (" << m.effective_num_kv_heads() << " kv), vocab " << m.vocab_size << "; seq "
      << config.train.seq_len << ", micro-batch " << config.train.micro_batch;
    // Each measured step runs every micro-batch of the global batch on this rank.
    const int64_t world = dist::job_world_size();
    const int64_t accumulation =
        config.train.sequences_per_step(world) / (config.train.micro_batch * world);
    if (accumulation > 1) s << " x " << accumulation << " micro-batches per step";
    s << ", attention " << config.activation.attention
      << (config.activation.attention == "fused" &&
                  config.activation.attention_backward != "deterministic"
              ? " (backward " + config.activation.attention_backward + ")"
              : std::string())
      << ", loss "
      << (config.activation.loss_chunk_tokens > 0
              ? "in chunks of " + std::to_string(config.activation.loss_chunk_tokens) + " tokens"
              : std::string("over whole logits"))
      << "; " << options.warmup_steps << " warm-up + " << options.measured_steps
      << " measured steps";
    report.config_summary = s.str();
  }

  for (const std::string& precision : options.precisions) {
    for (const std::string& strategy : options.strategies) {
      Config c = config;
      c.activation.strategy = strategy;
      c.precision.compute = precision;
      c.precision.param_dtype = "";  // the compute dtype: each row means what its name says
      BenchRow local = measure_config(c, options.warmup_steps, options.measured_steps);
      local.rank = rank;
      const double peak = peak_for(precision);
      fill_rate(local, report.model_flops_per_token, peak, 1);
      if (env) {
        std::vector<double> all(static_cast<size_t>(world) * kPacked, 0.0);
        std::array<double, kPacked> mine = pack(local);
        std::copy(mine.begin(), mine.end(), all.begin() + static_cast<ptrdiff_t>(rank) * kPacked);
        env->world().all_reduce_host(all, dist::ReduceOp::Sum);
        std::vector<BenchRow> ranks;
        for (int r = 0; r < world; ++r) {
          ranks.push_back(unpack(all.data() + static_cast<size_t>(r) * kPacked, local, r));
          fill_rate(ranks.back(), report.model_flops_per_token, peak, 1);
        }
        share_first_failure_message(env->world(), ranks, local);
        report.rows.push_back(combine(ranks, local));
        fill_rate(report.rows.back(), report.model_flops_per_token, peak, world);
        report.rank_rows.insert(report.rank_rows.end(), ranks.begin(), ranks.end());
      } else {
        report.rows.push_back(local);
      }
      if (options.log) {
        const BenchRow& r = report.rows.back();
        char line[256];
        if (r.ok()) {
          char mfu[32] = "";
          if (r.mfu >= 0) std::snprintf(mfu, sizeof mfu, ", MFU %.1f%%", 100.0 * r.mfu);
          std::snprintf(line, sizeof line,
                        "bench: %s/%s: peak %.2f MiB, %.1f ms/step, %.0f tokens/s, %.3g TFLOP/s%s",
                        strategy.c_str(), precision.c_str(),
                        static_cast<double>(r.peak_bytes) / (1 << 20), r.step_ms_median,
                        r.tokens_per_s, r.achieved_tflops, mfu);
        } else
          std::snprintf(line, sizeof line, "bench: %s/%s: %s", strategy.c_str(), precision.c_str(),
                        std::string(bench_status_name(r.status)).c_str());
        options.log(line);
      }
    }
  }
  fill_ratios(report.rows);
  fill_ratios(report.rank_rows);
  return report;
}

// ---- output ---------------------------------------------------------------------------------

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// A message inside a Markdown table cell: one line, no column separators.
std::string cell(std::string text) {
  for (char& ch : text)
    if (ch == '\n' || ch == '\r') ch = ' ';
  std::string out;
  for (char ch : text) out += ch == '|' ? std::string("\\|") : std::string(1, ch);
  return out;
}

std::string csv_field(std::string text) {
  for (char& ch : text)
    if (ch == '\n' || ch == '\r') ch = ' ';  // one record per line
  if (text.find_first_of(",\"") == std::string::npos) return text;
  std::string out = "\"";
  for (char ch : text) out += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return out + "\"";
}

std::string category_key(int k) {
  return std::string(category_name(static_cast<MemoryCategory>(k)));
}

nlohmann::json row_json(const BenchRow& r) {
  nlohmann::json j;
  j["strategy"] = r.strategy;
  j["precision"] = r.precision;
  j["status"] = std::string(bench_status_name(r.status));
  j["message"] = r.message;
  if (r.rank >= 0) j["rank"] = r.rank;
  if (r.status == BenchStatus::OutOfMemory) j["oom_requested_bytes"] = r.oom_requested_bytes;
  j["model_flops_per_token"] = r.model_flops_per_token;
  if (r.peak_tflops > 0) j["peak_tflops"] = r.peak_tflops;
  if (!r.ok()) return j;
  j["peak_bytes"] = r.peak_bytes;
  nlohmann::json by, at;
  for (int k = 0; k < kNumMemoryCategories; ++k) {
    by[category_key(k)] = r.peak_by_category[static_cast<size_t>(k)];
    at[category_key(k)] = r.at_peak[static_cast<size_t>(k)];
  }
  j["peak_by_category"] = by;
  j["at_peak"] = at;
  j["host_offloaded_peak"] = r.host_offloaded_peak;
  j["host_optimizer_state_peak"] = r.host_optimizer_peak;
  j["step_ms"] = {{"median", r.step_ms_median}, {"min", r.step_ms_min}, {"max", r.step_ms_max}};
  j["tokens_per_step"] = r.tokens_per_step;
  j["tokens_per_s"] = r.tokens_per_s;
  j["final_loss"] = r.final_loss;
  j["skipped_steps"] = r.skipped_steps;
  j["measured_steps"] = r.measured_steps;
  j["per_step"] = {{"forward_reruns", r.forward_reruns}, {"bytes_offloaded", r.bytes_offloaded},
                   {"bytes_restored", r.bytes_restored}, {"recompute_ms", r.recompute_ms},
                   {"transfer_ms", r.transfer_ms},       {"copy_ms", r.copy_ms}};
  if (r.peak_vs_none >= 0) j["peak_vs_none"] = r.peak_vs_none;
  if (r.overhead_vs_none > -1) j["overhead_vs_none"] = r.overhead_vs_none;
  j["achieved_tflops"] = r.achieved_tflops;
  if (r.mfu >= 0) j["mfu"] = r.mfu;
  return j;
}

std::string markdown_rows(const std::vector<BenchRow>& rows, bool with_rank) {
  std::string out = with_rank ? "| rank " : "";
  out +=
      "| strategy | precision | peak MiB | vs none | step ms | tokens/s | overhead | recomputes "
      "| offloaded MiB | TFLOP/s | MFU |\n";
  out += with_rank ? "|---:" : "";
  out += "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const BenchRow& r : rows) {
    std::string line = with_rank ? "| " + std::to_string(r.rank) + " " : "";
    // A row whose steps loss scaling skipped did not train as its figures suggest: say so.
    const std::string skipped = r.ok() && r.skipped_steps > 0
                                    ? " (" + std::to_string(r.skipped_steps) + " of " +
                                          std::to_string(r.measured_steps) + " steps skipped)"
                                    : "";
    line += "| " + r.strategy + " | " + r.precision + skipped + " | ";
    if (r.status == BenchStatus::OutOfMemory) {
      line += "OOM (" + fmt("%.2f", static_cast<double>(r.oom_requested_bytes) / kMiB) +
              " MiB requested) | - | - | - | - | - | - | - | - |";
    } else if (r.status == BenchStatus::Unsupported || r.status == BenchStatus::Failed) {
      // Only rank 0's message travels: another rank's row has its status alone.
      line += std::string(bench_status_name(r.status)) +
              (r.message.empty() ? std::string() : ": " + cell(r.message)) +
              " | - | - | - | - | - | - | - | - |";
    } else {
      line += fmt("%.2f", static_cast<double>(r.peak_bytes) / kMiB) + " | " +
              (r.peak_vs_none >= 0 ? fmt("%.2fx", r.peak_vs_none) : "-") + " | " +
              fmt("%.1f", r.step_ms_median) + " | " + fmt("%.0f", r.tokens_per_s) + " | " +
              (r.overhead_vs_none > -1 ? fmt("%+.1f%%", 100.0 * r.overhead_vs_none) : "-") + " | " +
              fmt("%.1f", r.forward_reruns) + " | " + fmt("%.2f", r.bytes_offloaded / kMiB) +
              " | " + fmt("%.3g", r.achieved_tflops) + " | " +
              (r.mfu >= 0 ? fmt("%.1f%%", 100.0 * r.mfu) : "-") + " |";
    }
    out += line + "\n";
  }
  return out;
}

}  // namespace

std::string BenchReport::markdown() const {
  std::string out = markdown_rows(rows, false);
  const std::string threads = cpu_threads > 0 ? std::to_string(cpu_threads) + " OpenMP thread" +
                                                    (cpu_threads == 1 ? "" : "s") +
                                                    (world_size == 1 ? "" : " a rank")
                                              : "";
  const std::string about = !device_name.empty() ? device_name : threads;
  out += "\n" + config_summary + "; device " + device + (about.empty() ? "" : " (" + about + ")") +
         ", " + std::to_string(world_size) +
         (world_size == 1 ? " rank" : " ranks (memory and step time: max over ranks)") + "; " +
         date + " on " + host + ".\n";
  out += "Model FLOPs per token " + fmt("%.4g", model_flops_per_token) +
         " (6N + 12·L·H·S, N = " + std::to_string(flops_parameters) +
         "); MFU = tokens/s x that / (" +
         (world_size == 1 ? std::string("peak") : "peak x " + std::to_string(world_size)) +
         "), peak: " + (peak_source.empty() ? "unknown (give --peak-tflops)" : peak_source) + ".\n";
  if (!rank_rows.empty()) out += "\nPer rank:\n\n" + markdown_rows(rank_rows, true);
  return out;
}

std::string BenchReport::csv() const {
  std::string out =
      "strategy,precision,status,rank,message,oom_requested_bytes,peak_bytes,peak_vs_none,"
      "step_ms_median,step_ms_min,step_ms_max,tokens_per_step,tokens_per_s,overhead_vs_none,"
      "forward_reruns,bytes_offloaded,bytes_restored,recompute_ms,transfer_ms,"
      "host_offloaded_peak,host_optimizer_state_peak,final_loss";
  for (int k = 0; k < kNumMemoryCategories; ++k) out += ",at_peak_" + category_key(k);
  for (int k = 0; k < kNumMemoryCategories; ++k) out += ",peak_" + category_key(k);
  out += ",model_flops_per_token,achieved_tflops,peak_tflops,mfu,copy_ms,skipped_steps\n";
  auto emit = [&](const BenchRow& r) {
    std::ostringstream s;
    s.precision(10);
    s << r.strategy << ',' << r.precision << ',' << bench_status_name(r.status) << ','
      << (r.rank >= 0 ? std::to_string(r.rank) : std::string("max")) << ',' << csv_field(r.message)
      << ',';
    if (r.status == BenchStatus::OutOfMemory) s << r.oom_requested_bytes;
    s << ',';
    if (r.ok()) {
      s << r.peak_bytes << ',';
      if (r.peak_vs_none >= 0) s << r.peak_vs_none;
      s << ',' << r.step_ms_median << ',' << r.step_ms_min << ',' << r.step_ms_max << ','
        << r.tokens_per_step << ',' << r.tokens_per_s << ',';
      if (r.overhead_vs_none > -1) s << r.overhead_vs_none;
      s << ',' << r.forward_reruns << ',' << r.bytes_offloaded << ',' << r.bytes_restored << ','
        << r.recompute_ms << ',' << r.transfer_ms << ',' << r.host_offloaded_peak << ','
        << r.host_optimizer_peak << ',' << r.final_loss;
      for (int64_t b : r.at_peak) s << ',' << b;
      for (int64_t b : r.peak_by_category) s << ',' << b;
    } else {
      s << std::string(15 + 2 * kNumMemoryCategories, ',');
    }
    s << ',' << r.model_flops_per_token << ',';
    if (r.ok()) s << r.achieved_tflops;
    s << ',';
    if (r.peak_tflops > 0) s << r.peak_tflops;
    s << ',';
    if (r.mfu >= 0) s << r.mfu;
    s << ',';
    if (r.ok()) s << r.copy_ms;
    s << ',';
    if (r.ok()) s << r.skipped_steps;
    out += s.str() + "\n";
  };
  for (const BenchRow& r : rows) emit(r);
  for (const BenchRow& r : rank_rows) emit(r);
  return out;
}

std::string BenchReport::json() const {
  nlohmann::json j;
  j["date"] = date;
  j["host"] = host;
  j["device"] = device;
  j["device_name"] = device_name;
  j["cpu_threads"] = cpu_threads;
  j["world_size"] = world_size;
  j["config"] = config_summary;
  j["model_flops_per_token"] = model_flops_per_token;
  j["flops_parameters"] = flops_parameters;
  j["flops_convention"] = "6N + 12*L*H*S (PaLM appendix B, llm.c)";
  j["peak_source"] = peak_source;
  j["rows"] = nlohmann::json::array();
  for (const BenchRow& r : rows) j["rows"].push_back(row_json(r));
  j["rank_rows"] = nlohmann::json::array();
  for (const BenchRow& r : rank_rows) j["rank_rows"].push_back(row_json(r));
  return j.dump(2) + "\n";
}

namespace {

std::string find_on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  std::stringstream dirs(path);
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (dir.empty()) continue;
    fs::path candidate = fs::path(dir) / program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
  }
  return "";
}

// Whole or not at all: a report cut short by a full disk would read as a shorter sweep.
void write_file(const fs::path& path, const std::string& text) {
  write_file_atomically(path.string(), text, "free space, or choose another --out");
}

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// The gnuplot terminal lines: pngcairo when gnuplot has it, else png; then SVG.
const char* kPngTerminal =
    "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
    "  set terminal pngcairo size 1000,640 noenhanced font ',10'\n"
    "} else {\n"
    "  set terminal png size 1000,640\n"
    "}\n"
    "set termoption noenhanced\n";

// Draws frontier.{png,svg} and memory.{png,svg} from data files next to them. Returns the
// images written.
std::vector<std::string> draw_plots(const BenchReport& report, const fs::path& dir) {
  std::vector<std::string> written;
  const std::string gnuplot = find_on_path("gnuplot");
  if (gnuplot.empty()) return written;
  std::vector<const BenchRow*> ok;
  for (const BenchRow& r : report.rows)
    if (r.ok()) ok.push_back(&r);
  if (ok.empty()) return written;

  // frontier.dat: one block per precision, rows sorted by peak memory.
  std::vector<std::string> precisions;
  for (const BenchRow* r : ok)
    if (std::find(precisions.begin(), precisions.end(), r->precision) == precisions.end())
      precisions.push_back(r->precision);
  std::string data;
  for (const std::string& p : precisions) {
    std::vector<const BenchRow*> block;
    for (const BenchRow* r : ok)
      if (r->precision == p) block.push_back(r);
    std::sort(block.begin(), block.end(),
              [](const BenchRow* a, const BenchRow* b) { return a->peak_bytes < b->peak_bytes; });
    data += "\"" + p + "\" \"peak MiB\" \"tokens/s\"\n";
    for (const BenchRow* r : block)
      data += r->strategy + " " + fmt("%.4f", static_cast<double>(r->peak_bytes) / kMiB) + " " +
              fmt("%.2f", r->tokens_per_s) + "\n";
    data += "\n\n";
  }
  write_file(dir / "frontier.dat", data);
  std::string script = std::string("set datafile separator whitespace\n") +
                       "set title 'Peak device memory against throughput (" + report.device +
                       ")'\n"
                       "set xlabel 'peak device memory per rank (MiB)'\n"
                       "set ylabel 'tokens/s'\n"
                       "set grid\nset key outside right top\n"
                       "set offsets graph 0.05, graph 0.15, graph 0.1, graph 0.1\n"
                       "plot for [i=0:" +
                       std::to_string(precisions.size() - 1) +
                       "] 'frontier.dat' index i using 2:3 with linespoints pt 7 ps 1.3 "
                       "title columnheader(1), \\\n"
                       "     for [i=0:" +
                       std::to_string(precisions.size() - 1) +
                       "] 'frontier.dat' index i using 2:3:1 with labels offset 0,1 font ',8' "
                       "notitle\n";
  write_file(dir / "frontier.gp", std::string(kPngTerminal) + "set output 'frontier.png'\n" +
                                      script +
                                      "set terminal svg size 1000,640 noenhanced\n"
                                      "set output 'frontier.svg'\nreplot\n");

  // memory.dat: one row per combination, the device's peak by category (MiB). A category no
  // row has on the device (offloaded bytes live in the host pool) would be an empty column.
  std::vector<int> shown;
  for (int k = 0; k < kNumMemoryCategories; ++k)
    if (std::any_of(ok.begin(), ok.end(),
                    [&](const BenchRow* r) { return r->at_peak[static_cast<size_t>(k)] > 0; }))
      shown.push_back(k);
  std::string mem = "combination";
  for (int k : shown) mem += " " + category_key(k);
  mem += "\n";
  for (const BenchRow* r : ok) {
    mem += r->strategy + "/" + r->precision;
    for (int k : shown)
      mem += " " + fmt("%.4f", static_cast<double>(r->at_peak[static_cast<size_t>(k)]) / kMiB);
    mem += "\n";
  }
  write_file(dir / "memory.dat", mem);
  std::string mscript =
      "set title 'Device memory at the peak, by category (" + report.device +
      ")'\n"
      "set ylabel 'MiB'\nset style data histograms\nset style histogram rowstacked\n"
      "set style fill solid 0.85 border -1\nset boxwidth 0.75\nset key outside right top\n"
      "set xtics rotate by -40 noenhanced\nset grid ytics\n"
      "plot for [c=2:" +
      std::to_string(1 + shown.size()) + "] 'memory.dat' using c:xtic(1) title columnheader(c)\n";
  write_file(dir / "memory.gp", std::string(kPngTerminal) + "set output 'memory.png'\n" + mscript +
                                    "set terminal svg size 1000,640 noenhanced\n"
                                    "set output 'memory.svg'\nreplot\n");

  for (const char* name : {"frontier", "memory"}) {
    std::string command = "cd " + quoted(dir.string()) + " && " + quoted(gnuplot) + " " + name +
                          ".gp > " + name + ".log 2>&1";
    const int status = std::system(command.c_str());
    // gnuplot's own output is kept only when it has something to say (a failed plot's reason).
    const fs::path log = dir / (std::string(name) + ".log");
    std::error_code ec;
    if (fs::exists(log, ec) && fs::file_size(log, ec) == 0) fs::remove(log, ec);
    if (status != 0) continue;
    for (const char* ext : {".png", ".svg"}) {
      fs::path image = dir / (std::string(name) + ext);
      if (fs::exists(image) && fs::file_size(image) > 0) written.push_back(image.string());
    }
  }
  return written;
}

}  // namespace

void prepare_bench_output(const std::string& dir) {
  ST_CHECK_AS(ConfigError, !dir.empty(), "bench --out: an empty path; name a directory");
  prepare_output_dir(dir, "bench --out");
  std::error_code ec;
  for (const char* name : {"bench.csv", "bench.json"}) {
    const fs::path path = fs::path(dir) / name;
    ST_CHECK_AS(ConfigError, !fs::exists(path, ec) || fs::is_regular_file(path, ec),
                "bench --out = '", dir, "': '", path.string(),
                "' exists and is not a file; remove it or choose another directory");
  }
}

std::vector<std::string> write_bench_outputs(const BenchReport& report, const std::string& dir) {
  prepare_bench_output(dir);
  std::vector<std::string> written;
  write_file(fs::path(dir) / "bench.csv", report.csv());
  written.push_back((fs::path(dir) / "bench.csv").string());
  write_file(fs::path(dir) / "bench.json", report.json());
  written.push_back((fs::path(dir) / "bench.json").string());
  for (const std::string& image : draw_plots(report, dir)) written.push_back(image);
  return written;
}

}  // namespace shardtrain::train
