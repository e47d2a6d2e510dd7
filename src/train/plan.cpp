#include "shardtrain/train/plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include "shardtrain/core/error.h"
#include "shardtrain/core/units.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/train/bench.h"
#include "shardtrain/train/runtime.h"

namespace shardtrain::train {

namespace {

std::string pct(double fraction) {
  return fmt::format("{:.1f}%", 100.0 * fraction);
}

// Rows per chunk of the fused head + loss that the recipe sets: the power of two at or above
// tokens x hidden / vocab, so that one chunk's logits are about the size of one [tokens, hidden]
// activation (the logits of all tokens are vocab / hidden times that). A micro-batch of fewer
// tokens than that is one chunk: no saving, but the same recompute (the head's product again in
// backward), which the cost model counts.
int64_t fused_loss_chunk(const Config& c) {
  const nn::LlamaConfig m = llama_config_from(c.model);
  const int64_t tokens = c.train.micro_batch * c.train.seq_len;
  const int64_t rows =
      std::max<int64_t>(1, (tokens * m.hidden_size + m.vocab_size - 1) / m.vocab_size);
  int64_t chunk = 1;
  while (chunk < rows) chunk *= 2;
  return chunk;
}

// The recipe, cumulative: each step edits the configuration the previous one left.
struct RecipeStep {
  const char* name;
  const char* change;
  void (*apply)(Config&);
};

const std::vector<RecipeStep>& recipe_steps() {
  static const std::vector<RecipeStep> steps = {
      {"fp32 eager",
       "precision.compute=fp32 activation.strategy=none activation.attention=plain "
       "dist.sharding=no_shard optim.offload=none",
       [](Config& c) {
         c.precision.compute = "fp32";
         c.precision.param_dtype = "";
         c.activation.strategy = "none";
         c.activation.layers = "all";  // each step's strategy applies to every layer
         c.activation.attention = "plain";
         c.dist.sharding = "no_shard";
         c.optim.offload = "none";
       }},
      {"bf16", "precision.compute=bf16",
       [](Config& c) {
         c.precision.compute = "bf16";
         c.precision.param_dtype = "";
       }},
      {"fused kernels", "activation.attention=fused activation.loss_chunk_tokens=<chunk>",
       [](Config& c) {
         c.activation.attention = "fused";
         c.activation.loss_chunk_tokens = fused_loss_chunk(c);
       }},
      {"per_layer checkpointing", "activation.strategy=per_layer",
       [](Config& c) { c.activation.strategy = "per_layer"; }},
      {"offload_checkpoint", "activation.strategy=offload_checkpoint",
       [](Config& c) { c.activation.strategy = "offload_checkpoint"; }},
      {"full_shard over N ranks", "dist.sharding=full_shard",
       [](Config& c) { c.dist.sharding = "full_shard"; }},
      {"optimizer offload", "optim.offload=cpu", [](Config& c) { c.optim.offload = "cpu"; }},
  };
  return steps;
}

std::string cost_text(const RecipeRow& r) {
  std::string out = "recompute " + pct(r.cost.recompute_fraction()) + " of step FLOPs, " +
                    format_bytes(r.cost.pcie_bytes) + " over PCIe and " +
                    format_bytes(r.cost.link_bytes) + " over links per step per rank";
  return out;
}

int64_t physical_memory() {
  long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? static_cast<int64_t>(pages) * size : 0;
}

}  // namespace

Plan make_plan(const Config& config, int64_t device_bytes, int world_size) {
  ST_CHECK_AS(ConfigError, device_bytes > 0, "plan: the device memory must be positive, got ",
              device_bytes, " bytes");
  ST_CHECK_AS(ConfigError, world_size >= 1, "plan: the world size must be at least 1, got ",
              world_size);
  Plan plan;
  plan.device_bytes = device_bytes;
  plan.world_size = world_size;
  Config c = config;
  c.recipe = "manual";
  for (const RecipeStep& step : recipe_steps()) {
    step.apply(c);
    RecipeRow row;
    row.name = step.name;
    if (row.name == "full_shard over N ranks")
      row.name = "full_shard over " + std::to_string(world_size) +
                 (world_size == 1 ? " rank (nothing to shard)" : " ranks");
    row.change = step.change;
    if (const size_t at = row.change.find("<chunk>"); at != std::string::npos)
      row.change.replace(at, 7, std::to_string(c.activation.loss_chunk_tokens));
    row.config = c;
    row.input = MemoryModelInput::from_config(c, world_size);
    row.predicted = predict_memory(row.input);
    row.cost = predict_step_cost(row.input);
    if (c.optim.offload == "cpu" && c.optim.name != "adamw")
      row.unavailable = "optim.offload=cpu runs AdamW, optim.name is " + c.optim.name;
    row.fits = row.unavailable.empty() && row.predicted.peak <= device_bytes;
    if (row.fits && plan.first_fit < 0) plan.first_fit = static_cast<int>(plan.rows.size());
    plan.rows.push_back(std::move(row));
  }
  // The recipe is cumulative: a later step keeps offload_checkpoint although sharding or
  // optimizer offload may have made room for plain per_layer checkpointing, which moves nothing
  // over PCIe. Say so when it does.
  if (plan.first_fit > 4) {
    const RecipeRow& first = plan.rows[static_cast<size_t>(plan.first_fit)];
    MemoryModelInput in = first.input;
    in.activation_strategy = "per_layer";
    MemoryPrediction p = predict_memory(in);
    StepCost cost = predict_step_cost(in);
    if (p.peak <= device_bytes)
      plan.note =
          "with activation.strategy=per_layer instead of offload_checkpoint it still fits (" +
          format_bytes(p.peak) + " per rank) and moves " +
          format_bytes(first.cost.pcie_bytes - cost.pcie_bytes) + " less over PCIe per step";
  }
  return plan;
}

std::string Plan::table() const {
  bool any_measured = false;
  for (const RecipeRow& r : rows)
    any_measured = any_measured || r.measured || !r.measure_note.empty();
  std::string out =
      "| # | recipe step | sets | weights+optimizer | gradients | activations | other | "
      "peak/rank | fits " +
      format_bytes(device_bytes) + " |";
  out += any_measured ? " measured | error |\n" : "\n";
  out += "|---:|---|---|---:|---:|---:|---:|---:|---|";
  out += any_measured ? "---:|---:|\n" : "\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const RecipeRow& r = rows[i];
    const MemoryPrediction& p = r.predicted;
    auto at = [&](MemoryCategory c) { return p.at_peak[static_cast<size_t>(c)]; };
    // The columns add up to the peak: what is alive at the predicted peak moment.
    int64_t persistent =
        at(MemoryCategory::Parameters) - p.compute_copy_bytes + at(MemoryCategory::OptimizerState);
    int64_t other = p.compute_copy_bytes + at(MemoryCategory::Workspace);
    out += "| " + std::to_string(i + 1) + " | " + r.name + " | " + r.change + " | " +
           format_bytes(persistent) + " | " + format_bytes(at(MemoryCategory::Gradients)) + " | " +
           format_bytes(at(MemoryCategory::Activations)) + " | " + format_bytes(other) + " | " +
           format_bytes(p.peak) + " | " +
           (r.fits                  ? "yes"
            : r.unavailable.empty() ? "no"
                                    : "no (" + r.unavailable + ")") +
           (static_cast<int>(i) == first_fit ? " (first)" : "") + " |";
    if (any_measured) {
      if (r.measured) {
        double err = static_cast<double>(p.peak - r.measured_peak) /
                     static_cast<double>(std::max<int64_t>(r.measured_peak, 1));
        // A row predicted to fit that measures past the capacity is the prediction's error:
        // say so where the reader compares the two.
        const bool over = r.fits && r.measured_peak > device_bytes;
        out += " " + format_bytes(r.measured_peak) + (over ? " (over the capacity)" : "") + " | " +
               // Below 0.05 % in size, "0.0%" rather than "-0.0%" or "+0.0%".
               (std::fabs(100.0 * err) < 0.05 ? std::string("0.0%")
                                              : fmt::format("{:+.1f}%", 100.0 * err)) +
               (r.measure_note.empty() ? "" : " (" + r.measure_note + ")") + " |";
      } else {
        out += " " + (r.measure_note.empty() ? std::string("-") : r.measure_note) + " | - |";
      }
    }
    out += "\n";
  }
  return out;
}

std::string Plan::verdict() const {
  const std::string per = format_bytes(device_bytes) + " per rank on " +
                          std::to_string(world_size) + (world_size == 1 ? " rank" : " ranks");
  if (first_fit < 0) {
    const RecipeRow* last_available = &rows.back();
    for (const RecipeRow& r : rows)
      if (r.unavailable.empty()) last_available = &r;
    const RecipeRow& last = *last_available;
    return "nothing fits " + per + ": the last step still needs " +
           format_bytes(last.predicted.peak) + " per rank (peak at " + last.predicted.peak_moment +
           "); use more ranks, a shorter train.seq_len or a smaller train.micro_batch "
           "(gradient accumulation keeps the global batch), or a smaller model";
  }
  const RecipeRow& r = rows[static_cast<size_t>(first_fit)];
  return "first that fits " + per + ": #" + std::to_string(first_fit + 1) + " " + r.name + " (" +
         r.change + "): predicted peak " + format_bytes(r.predicted.peak) + " at " +
         r.predicted.peak_moment + "; cost: " + cost_text(r) +
         (note.empty() ? "" : "\nnote: " + note);
}

void measure_plan(Plan& plan, int64_t warmup_steps, int64_t measured_steps,
                  const std::function<void(const std::string&)>& log) {
  // Under mpirun every rank measures (the rows of this world size train across the ranks) and
  // the table shows the largest peak over ranks.
  const int world = dist::job_world_size();
  std::unique_ptr<dist::DistEnv> env;
  if (world > 1) env = std::make_unique<dist::DistEnv>();
  int64_t machine = physical_memory() / 4 * 3 / world;
  int64_t budget = machine > 0 ? std::min(machine, plan.device_bytes) : plan.device_bytes;
  for (RecipeRow& r : plan.rows) {
    if (!r.unavailable.empty()) {
      r.measure_note = "not run: " + r.unavailable;
      continue;
    }
    const bool replica = r.config.dist.sharding == "no_shard";
    Config c = r.config;
    c.train.device = "cpu";
    c.train.device_memory = "";
    if (world == 1 && r.input.world_size > 1) {
      if (!replica) {
        r.measure_note = "needs " + std::to_string(r.input.world_size) + " ranks";
        continue;
      }
      // A data-parallel replica's step on one process: one rank's batch, not the global one.
      c.train.global_batch = c.train.micro_batch * r.input.micro_batches_per_step;
      c.train.global_batch_tokens = 0;
    } else if (r.input.world_size != world) {
      r.measure_note = "needs " + std::to_string(r.input.world_size) + " ranks, this job has " +
                       std::to_string(world);
      continue;
    }
    if (r.predicted.peak > budget) {
      r.measure_note = r.predicted.peak > plan.device_bytes ? "predicted past the device memory"
                                                            : "too big for this machine's memory";
      continue;
    }
    const std::string row = "#" + std::to_string(&r - plan.rows.data() + 1) + " " + r.name;
    if (log)
      log("plan: measuring " + row + " (" + std::to_string(warmup_steps) + " + " +
          std::to_string(measured_steps) + " steps) ...");
    BenchRow m = measure_config(c, warmup_steps, measured_steps);
    if (env) {
      std::vector<int64_t> v = {m.ok() ? 0 : 1, m.peak_bytes};
      env->world().all_reduce_host(v, dist::ReduceOp::Max);
      if (v[0] != 0 && m.ok()) {
        m.status = BenchStatus::Unsupported;
        m.message = "another rank failed";
      }
      m.peak_bytes = v[1];
    }
    if (m.ok()) {
      r.measured = true;
      r.measured_peak = m.peak_bytes;
      if (c.optim.offload == "cpu" && m.host_optimizer_peak == 0 &&
          m.at_peak[static_cast<size_t>(MemoryCategory::OptimizerState)] > 0)
        r.measure_note = "optimizer state stayed on the device: this build ignores optim.offload";
      else if (world == 1 && r.input.world_size > 1)
        r.measure_note = "one process: no all-reduce buffers";
      if (log)
        log("plan: " + row + ": peak " + format_bytes(r.measured_peak) + " (predicted " +
            format_bytes(r.predicted.peak) + ")");
    } else {
      r.measure_note = std::string(bench_status_name(m.status)) + ": " + m.message;
      // Keep the table readable: the first line of the message only.
      size_t nl = r.measure_note.find('\n');
      if (nl != std::string::npos) r.measure_note.resize(nl);
      for (char& ch : r.measure_note)
        if (ch == '|') ch = '/';
    }
  }
}

namespace {
// Whether activation.layers selects every layer (the memory model predicts no subset).
bool strategy_on_every_layer(const Config& c) {
  for (int64_t i = 0; i < c.model.num_layers; ++i)
    if (!c.activation.applies_to_layer(i, c.model.num_layers)) return false;
  return true;
}

// The keys the recipe's steps set, in the order they first appear.
std::vector<std::string> keys_the_recipe_sets() {
  std::vector<std::string> keys = {"precision.param_dtype"};  // follows precision.compute
  for (const RecipeStep& step : recipe_steps()) {
    std::istringstream words(step.change);
    std::string word;
    while (words >> word) {
      const std::string key = word.substr(0, word.find('='));
      if (std::find(keys.begin(), keys.end(), key) == keys.end()) keys.push_back(key);
    }
  }
  return keys;
}
}  // namespace

void check_recipe_auto_settings(const Config& config) {
  ST_CHECK_AS(ConfigError, strategy_on_every_layer(config), "recipe: auto picks an activation ",
              "strategy for every layer (the memory model predicts no subset), but "
              "activation.layers is '",
              config.activation.layers,
              "': remove activation.layers, or choose the strategy yourself with recipe: manual");
  // A key the run config sets away from its default is a request the recipe would overrule
  // without a word (bf16 asked for, fp32 trained).
  const std::map<std::string, std::string> changed = config.values_away_from_defaults();
  std::vector<std::string> set;
  const std::vector<std::string> keys = keys_the_recipe_sets();
  for (const std::string& key : keys)
    if (auto it = changed.find(key); it != changed.end()) set.push_back(key + "=" + it->second);
  if (!set.empty())
    throw ConfigError("recipe: auto chooses " + fmt::format("{}", fmt::join(keys, ", ")) +
                      " itself, but the run config sets " +
                      fmt::format("{}", fmt::join(set, ", ")) +
                      ": remove them to let the recipe choose, or keep them with recipe: "
                      "manual (the default; `shardtrain plan` shows what each recipe step "
                      "would set)");
}

Config apply_recipe(const Config& config, int64_t device_bytes, int world_size, std::string* why) {
  check_recipe_auto_settings(config);
  Plan plan = make_plan(config, device_bytes, world_size);
  if (plan.first_fit < 0)
    throw ConfigError("recipe: auto: " + plan.verdict() + "\n" + plan.table());
  const RecipeRow& r = plan.rows[static_cast<size_t>(plan.first_fit)];
  if (why != nullptr)
    *why = "recipe: auto chose #" + std::to_string(plan.first_fit + 1) + " " + r.name + " (" +
           r.change + "): predicted peak " + format_bytes(r.predicted.peak) + " of " +
           format_bytes(device_bytes) + " per rank on " + std::to_string(world_size) +
           (world_size == 1 ? " rank" : " ranks") + "; cost: " + cost_text(r);
  return r.config;  // recipe: manual, the choice made
}

std::string out_of_memory_advice(const Config& config, int64_t device_bytes, int world_size) {
  try {
    const Plan plan = make_plan(config, device_bytes, world_size);
    std::string out;
    std::optional<MemoryPrediction> own;
    if (config.activation.strategy != "none" && !strategy_on_every_layer(config)) {
      out =
          "(The memory model predicts a strategy on every layer, so it gives no figure for "
          "activation.layers '" +
          config.activation.layers + "'.) ";
    } else {
      own = predict_memory(MemoryModelInput::from_config(config, world_size));
      out = "The memory model predicts a peak of " + format_bytes(own->peak) +
            " per rank for this configuration (at " + own->peak_moment + "). ";
    }
    if (plan.first_fit < 0) return out + "Along the scale-up recipe, " + plan.verdict() + ".";
    const std::string headroom =
        "the run needed more (the prediction's error is listed in docs/recipe.md): leave "
        "headroom by setting train.device_memory below the device's size";
    // Predicted to fit, yet it did not: a step merely predicted to fit is no answer (it may be
    // this very configuration); one predicted well below this configuration's figure is.
    if (own && own->peak <= device_bytes) {
      for (size_t i = 0; i < plan.rows.size(); ++i) {
        const RecipeRow& r = plan.rows[i];
        if (r.fits && 10 * r.predicted.peak < 9 * own->peak)
          return out + "That is within " + format_bytes(device_bytes) + ", but " + headroom +
                 ", or take step #" + std::to_string(i + 1) + " " + r.name +
                 " of the scale-up recipe (" + r.change +
                 " on top of the steps before it; predicted " + format_bytes(r.predicted.peak) +
                 "): `shardtrain plan` lists its settings.";
      }
      return out + "That is within " + format_bytes(device_bytes) + ", but " + headroom +
             ", or lower train.micro_batch or train.seq_len.";
    }
    const RecipeRow& r = plan.rows[static_cast<size_t>(plan.first_fit)];
    // Already that step: pointing at it again would send the user round in a circle.
    const Config& c = r.config;
    if (c.precision.compute == config.precision.compute &&
        c.activation.strategy == config.activation.strategy &&
        c.activation.attention == config.activation.attention &&
        c.dist.sharding == config.dist.sharding && c.optim.offload == config.optim.offload)
      return out + "This configuration is step #" + std::to_string(plan.first_fit + 1) + " " +
             r.name + " of the scale-up recipe, the first predicted to fit " +
             format_bytes(device_bytes) + ", but " + headroom +
             ", take a later step, or lower train.micro_batch or train.seq_len.";
    return out + "The first step of the scale-up recipe that fits " + format_bytes(device_bytes) +
           " is #" + std::to_string(plan.first_fit + 1) + " " + r.name + " (" + r.change +
           " on top of the steps before it; predicted " + format_bytes(r.predicted.peak) +
           "): `shardtrain plan` lists its settings, or set recipe: auto.";
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace shardtrain::train
