// Checkpointing of a training run: Runtime state to and from io checkpoints, save scheduling,
// resume selection and stop signals (see include/shardtrain/train/checkpointing.h).
#include "shardtrain/train/checkpointing.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/core/files.h"
#include "shardtrain/core/json_input.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/nn/lora.h"
#include "shardtrain/train/runtime.h"
#include "shardtrain/train/schedule.h"

namespace shardtrain::train {

using detail::concat;
namespace fs = std::filesystem;

// ---- stop requests ----------------------------------------------------------------------------

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void record_stop_signal(int signal) {
  if (signal == SIGINT && g_stop_signal == SIGINT) {  // Ctrl-C twice: stop now, default action
    ::signal(SIGINT, SIG_DFL);
    ::raise(SIGINT);
    return;
  }
  g_stop_signal = signal;
}

const char* signal_name(int signal) {
  switch (signal) {
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGINT:
      return "SIGINT";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "a stop request";
  }
}

}  // namespace

namespace {
int g_live_handlers = 0;  // StopSignalHandlers alive (nested: the CLI's, then the trainer's)
}  // namespace

StopSignalHandlers::StopSignalHandlers() {
  // The outermost clears an earlier run's request; a nested one keeps a request that arrived
  // while the run was starting (the CLI's handlers were up then).
  if (g_live_handlers++ == 0) clear_stop_request();
  struct sigaction action {};
  action.sa_handler = record_stop_signal;
  sigemptyset(&action.sa_mask);
  // Interrupted system calls (MPI, file writes) resume: the flag is all the handler changes.
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, &previous_term_);
  sigaction(SIGUSR1, &action, &previous_usr1_);
  sigaction(SIGINT, &action, &previous_int_);
  // A closed terminal (an ssh session that dropped) stops the run with a checkpoint rather than
  // killing it, except under nohup, whose ignoring of SIGHUP is the user's choice and is kept.
  sigaction(SIGHUP, nullptr, &previous_hup_);
  if (previous_hup_.sa_handler != SIG_IGN) sigaction(SIGHUP, &action, nullptr);
}

StopSignalHandlers::~StopSignalHandlers() {
  --g_live_handlers;
  sigaction(SIGTERM, &previous_term_, nullptr);
  sigaction(SIGUSR1, &previous_usr1_, nullptr);
  sigaction(SIGINT, &previous_int_, nullptr);
  sigaction(SIGHUP, &previous_hup_, nullptr);
}

int stop_signal() {
  return g_stop_signal;
}

void request_stop(int signal) {
  g_stop_signal = signal;
}

void clear_stop_request() {
  g_stop_signal = 0;
}

// ---- checkpoint <-> runtime -------------------------------------------------------------------

namespace {

// One trainable parameter as this rank holds it: elements [begin, begin + param->numel()) of the
// flattened full parameter.
struct Slot {
  std::string name;
  Shape full_shape;
  int64_t begin = 0;
  Tensor* param = nullptr;
};

std::vector<Slot> trainable_slots(Runtime& rt) {
  std::vector<optim::NamedParam> params = rt.trainable();
  std::vector<Slot> out;
  if (fsdp::ShardedModel* sharded = rt.sharded()) {
    // optimizer_params() and param_pieces() list the same pieces in the same order.
    std::vector<fsdp::ParamPiece> pieces = sharded->param_pieces();
    ST_CHECK(pieces.size() == params.size(), "internal: ", pieces.size(), " shard pieces but ",
             params.size(), " optimizer parameters");
    for (size_t i = 0; i < pieces.size(); ++i) {
      ST_CHECK(pieces[i].name == params[i].name, "internal: piece '", pieces[i].name,
               "' does not match optimizer parameter '", params[i].name, "'");
      out.push_back({pieces[i].name, pieces[i].full_shape, pieces[i].begin, params[i].param});
    }
  } else {
    for (const optim::NamedParam& p : params) out.push_back({p.name, p.param->shape(), 0, p.param});
  }
  return out;
}

// Optimizer state entries "exp_avg.<param>" -> ("exp_avg", "<param>").
std::pair<std::string, std::string> split_state_name(const std::string& name) {
  size_t dot = name.find('.');
  ST_CHECK(dot != std::string::npos, "internal: optimizer state '", name,
           "' is not named <kind>.<param>");
  return {name.substr(0, dot), name.substr(dot + 1)};
}

// The generators training draws from that this model has: LoRA dropout masks.
std::vector<std::pair<std::string, Generator*>> reachable_generators(nn::LlamaModel& model) {
  std::vector<std::pair<std::string, Generator*>> out;
  for (const auto& [path, adapter] : nn::lora_modules(model))
    out.emplace_back(path + ".lora_dropout", &adapter->dropout_generator());
  return out;
}

std::string layout_json(fsdp::ShardedModel& sharded, const std::string& strategy) {
  nlohmann::json units = nlohmann::json::array();
  for (int u = 0; u < sharded.num_units(); ++u) {
    const fsdp::FlatParamLayout& layout = sharded.unit_layout(u);
    nlohmann::json params = nlohmann::json::array();
    for (const auto& e : layout.entries)
      params.push_back(
          {{"name", e.name}, {"shape", e.shape}, {"offset", e.offset}, {"numel", e.numel}});
    units.push_back({{"unit", sharded.unit_name(u)},
                     {"num_shards", layout.num_shards},
                     {"total", layout.total},
                     {"padded", layout.padded},
                     {"padding", layout.padded - layout.total},
                     {"shard_numel", layout.shard_numel},
                     {"params", params}});
  }
  return nlohmann::json{
      {"strategy", strategy}, {"shard_group_size", sharded.shard_group().size()}, {"units", units}}
      .dump();
}

// Whether this rank writes its ranges: replicas of a shard (no_shard, hybrid_shard across nodes)
// leave them to the first replica.
bool writes_ranges(Runtime& rt) {
  fsdp::ShardedModel* sharded = rt.sharded();
  if (sharded == nullptr) return rt.dist().rank() == 0;
  dist::ProcessGroup* replicas = sharded->replicate_group();
  return replicas == nullptr || replicas->rank() == 0;
}

// True on every rank when `value` is the same on every rank.
bool ranks_agree(dist::ProcessGroup& group, int64_t value) {
  return !group.differs_between_ranks({static_cast<uint64_t>(value)})[0];
}

// The checkpoints of `dir`, newest first, checked to be the same list on every rank (a collective
// for the count, one for the steps): the ranks then take the same collective steps through them.
std::vector<io::CheckpointEntry> checkpoints_every_rank_sees(dist::ProcessGroup& world,
                                                             const std::string& dir) {
  std::vector<io::CheckpointEntry> entries = io::list_checkpoints(dir);
  const std::string not_shared =
      concat("train.resume: the ranks see different checkpoints in '", dir,
             "'; the checkpoint directory must be on a file system "
             "every rank shares");
  ST_CHECK(ranks_agree(world, static_cast<int64_t>(entries.size())), not_shared);
  std::vector<uint64_t> steps;
  for (const io::CheckpointEntry& e : entries) steps.push_back(static_cast<uint64_t>(e.step));
  if (!steps.empty())  // the same on every rank, checked above
    for (bool differs : world.differs_between_ranks(steps)) ST_CHECK(!differs, not_shared);
  return entries;
}

// A frozen-base identity in words; `from_hf` is the directory of the run it belongs to.
std::string describe_frozen_base(const std::string& identity, const std::string& from_hf) {
  if (identity.rfind("hf:", 0) == 0)
    return concat("the Hugging Face weights in '", from_hf, "' (fingerprint ", identity.substr(3),
                  ")");
  if (identity.rfind("init:", 0) == 0)
    return concat("weights initialised from ", identity.substr(5), " (no model.from_hf)");
  return concat("'", identity, "'");
}
}  // namespace

io::SaveRequest make_save_request(Runtime& rt, const std::string& dir, int64_t step,
                                  const SamplerState& sampler, float lr) {
  const Config& config = rt.config();
  io::SaveRequest req;
  req.dir = dir;
  io::TrainingState& s = req.state;
  s.step = step;
  s.optimizer = config.optim.name;
  s.optimizer_steps = rt.optimizer().steps_taken();
  s.lr = lr;
  s.scaler_enabled = rt.scaler().enabled();
  s.scaler = rt.scaler().state();
  s.sampler = {sampler.seed, sampler.epoch, sampler.position, sampler.data_checksum};
  s.init_seed = static_cast<uint64_t>(config.train.seed);
  s.config_yaml = config.to_yaml();
  s.frozen_base = rt.frozen_base();
  s.model_config_json = rt.model().config().to_hf_json();
  if (fsdp::ShardedModel* sharded = rt.sharded()) {
    s.sharding = config.dist.sharding;
    s.layout_json = layout_json(*sharded, config.dist.sharding);
  }
  for (const auto& [name, gen] : reachable_generators(rt.model()))
    req.generators.push_back({name, gen->seed(), gen->offset()});

  req.writes_ranges = writes_ranges(rt);
  std::vector<Slot> slots = trainable_slots(rt);
  std::map<std::string, const Slot*> by_name;
  for (const Slot& slot : slots) {
    by_name[slot.name] = &slot;
    req.ranges.push_back({"model/" + slot.name, slot.full_shape, slot.begin, *slot.param});
  }
  for (const auto& [state_name, tensor] : rt.optimizer().state()) {
    auto [kind, param] = split_state_name(state_name);
    auto it = by_name.find(param);
    ST_CHECK(it != by_name.end(), "internal: optimizer state '", state_name,
             "' of no trainable parameter");
    req.ranges.push_back(
        {"optim/" + kind + "/" + param, it->second->full_shape, it->second->begin, *tensor});
  }
  return req;
}

namespace {

// Whether a resolved-config key defines what the checkpoint's weights compute: the model's
// shape and numerics, and the adapters'. Shapes alone do not tell (4 heads of 8 and 8 heads of 4
// give the same tensors, and lora.alpha scales the adapters without changing one); where the
// weights come from, their initialisation and the longest sequence do not matter here.
bool defines_the_weights(const std::string& key) {
  if (key == "model.from_hf" || key == "model.init_std" || key == "model.max_seq_len") return false;
  return key.rfind("model.", 0) == 0 || key == "lora.enabled" || key == "lora.r" ||
         key == "lora.alpha" || key == "lora.target_modules" || key == "lora.quantize_base";
}

// Every checkpoint holds its resolved config, with a model section: without it the settings
// that keep the tensors' shapes (heads, RoPE) could not be compared with this run's, so one that
// does not parse or lacks it is damaged. What is wrong with it, or "" when nothing is.
std::string saved_config_problem(const std::string& saved_yaml, YAML::Node* parsed = nullptr) {
  YAML::Node saved;
  try {
    saved = YAML::Load(saved_yaml);
  } catch (const YAML::Exception& e) {
    return concat("its saved config does not parse (", e.what(), ")");
  }
  if (!saved.IsMap() || !saved["model"] || !saved["model"].IsMap())
    return "its saved config has no model section";
  if (parsed != nullptr) *parsed = saved;
  return "";
}

// The keys of `defines_the_weights` whose values differ between a checkpoint's resolved config
// and this run's, as "key: checkpoint X, this run Y". Both are Config::to_yaml text; a key only
// one of them has (a config of another version) is not compared, nor are the model keys when
// `model_compared_elsewhere` (the checkpoint's config.json text is compared with this run's
// model: with model.from_hf the model keys of a config saved by an older version were not
// resolved from config.json). A saved config with a problem (above) is a FormatError.
std::vector<std::string> weight_settings_that_differ(const std::string& path,
                                                     const std::string& saved_yaml,
                                                     const std::string& current_yaml,
                                                     bool model_compared_elsewhere) {
  std::vector<std::string> out;
  YAML::Node saved;
  if (std::string problem = saved_config_problem(saved_yaml, &saved); !problem.empty())
    throw FormatError(concat("checkpoint '", path, "': ", problem,
                             "; the checkpoint is damaged: resume from another one"));
  const YAML::Node current = YAML::Load(current_yaml);
  for (const auto& section : current) {
    if (!section.second.IsMap()) continue;
    const std::string name = section.first.Scalar();
    if (!saved[name] || !saved[name].IsMap()) continue;
    for (const auto& entry : section.second) {
      const std::string key = name + "." + entry.first.Scalar();
      const YAML::Node before = saved[name][entry.first.Scalar()];
      if (!defines_the_weights(key) || !before) continue;
      if (model_compared_elsewhere && name == "model") continue;
      const std::string was = YAML::Dump(before), now = YAML::Dump(entry.second);
      if (was != now) out.push_back(key + ": checkpoint " + was + ", this run " + now);
    }
  }
  return out;
}

// The config.json fields (LlamaConfig::to_hf_json) that differ between a checkpoint's model and
// this run's, as "field: checkpoint X, this run Y"; the limit on sequence length and the
// initialisation scale do not define the weights and are not compared.
std::vector<std::string> model_fields_that_differ(const std::string& saved_json,
                                                  const std::string& current_json) {
  nlohmann::json saved;
  try {
    saved = parse_json_input(saved_json);  // read from a file the user named
  } catch (const std::exception&) {
    return {"its recorded model_config does not parse"};
  }
  const nlohmann::json current = nlohmann::json::parse(current_json);
  std::vector<std::string> out;
  if (!saved.is_object()) return {"its recorded model_config does not parse"};
  for (const auto& [key, value] : current.items()) {
    if (key == "max_position_embeddings" || key == "initializer_range") continue;
    const auto it = saved.find(key);
    if (it == saved.end() || *it != value)
      out.push_back(key + ": checkpoint " + (it == saved.end() ? "(none)" : it->dump()) +
                    ", this run " + value.dump());
  }
  return out;
}

// What a resumed run changes about the training it continues, one note each: legitimate (a job
// grown or shrunk, a new data mix), but not silent. Empty when nothing changed; only the
// data.seed note (which reads the sampler state alone) when the saved config is of another
// version and does not parse.
//  - sequences per step: another rank count with global_batch 0 (micro_batch x ranks), or changed
//    batch keys. The note says which train.global_batch keeps the old batch.
//  - data.path or data.eval_fraction: the windows held out for evaluation are no longer the ones
//    the earlier steps never trained on.
//  - data.seed: the sampler keeps the checkpoint's shuffle order.
std::vector<std::string> resume_notes(const io::TrainingState& state, const Config& now,
                                      int64_t ranks) {
  std::vector<std::string> notes;
  // The sampler's seed is restored with its epoch and position: the order stays the saved one.
  if (state.sampler.seed != static_cast<uint64_t>(now.data.seed))
    notes.push_back(concat("note: data.seed is ", now.data.seed, " but the checkpoint's run ",
                           "shuffled with ", state.sampler.seed, "; the resumed run keeps that ",
                           "order (start a new run, train.resume=none, to shuffle with ",
                           now.data.seed, ")"));
  Config saved;
  int64_t before = 0;
  try {
    saved = Config::parse(state.config_yaml, {}, "saved config");
    before = saved.train.sequences_per_step(state.world_size);
  } catch (const std::exception&) {
    return notes;
  }
  const int64_t after = now.train.sequences_per_step(ranks);
  if (before != after) {
    TrainConfig same = now.train;
    same.global_batch = before;
    same.global_batch_tokens = 0;
    std::string keep;
    try {
      same.sequences_per_step(ranks);
      keep = concat("set train.global_batch=", before, " to keep it");
    } catch (const ConfigError&) {
      keep = concat("train.global_batch=", before, " would keep it but is not a multiple of ",
                    "train.micro_batch x ranks = ", now.train.micro_batch * ranks);
    }
    notes.push_back(concat("note: the checkpoint's run took ", before, " sequences per step (",
                           state.world_size, " rank(s)); this one takes ", after, " (", ranks,
                           " rank(s)), so the steps from here on see another batch size at the "
                           "same learning rates; ",
                           keep));
  }
  auto data_note = [&](const std::string& key, const std::string& was, const std::string& is) {
    if (was != is)
      notes.push_back(concat("note: ", key, " was ", was, " for the checkpoint's run and is ", is,
                             " now: the held-out windows are no longer those the earlier steps "
                             "never trained on, so evaluation losses may read low; keep ",
                             key, " to compare them with the run's earlier ones"));
  };
  if (saved.train.seq_len != now.train.seq_len)
    notes.push_back(concat("note: train.seq_len was ", saved.train.seq_len,
                           " for the checkpoint's run and is ", now.train.seq_len,
                           " now: the steps from here on take windows of another length, so the "
                           "data's windows no longer line up with those already trained on"));
  // The schedule is a function of the step and the optim/train keys: a changed train.steps (or
  // warmup, lr, min_lr, schedule) moves the rate of the next step away from where the
  // checkpoint's run was heading.
  const float would = lr_schedule(saved).at(state.step), will = lr_schedule(now).at(state.step);
  if (std::fabs(would - will) > 1e-6f * std::max(std::fabs(would), 1e-30f)) {
    std::vector<std::string> changed;
    auto compare = [&](const char* key, double a, double b) {
      if (a != b) changed.push_back(concat(key, " ", a, " -> ", b));
    };
    compare("train.steps", static_cast<double>(saved.train.steps),
            static_cast<double>(now.train.steps));
    compare("optim.warmup_steps", static_cast<double>(saved.optim.warmup_steps),
            static_cast<double>(now.optim.warmup_steps));
    compare("optim.lr", saved.optim.lr, now.optim.lr);
    compare("optim.min_lr", saved.optim.min_lr, now.optim.min_lr);
    if (saved.optim.schedule != now.optim.schedule)
      changed.push_back("optim.schedule " + saved.optim.schedule + " -> " + now.optim.schedule);
    const std::string list = fmt::format("{}", fmt::join(changed, ", "));
    const std::string rates =
        fmt::format("{:.3g} where the checkpoint's run would have used {:.3g}",
                    static_cast<double>(will), static_cast<double>(would));
    notes.push_back(concat("note: the learning-rate schedule differs from the checkpoint's run (",
                           list, "): step ", state.step + 1, " runs at ", rates));
  }
  std::error_code ec;  // one file may be named two ways (relative, through a link)
  if (!fs::equivalent(saved.data.path, now.data.path, ec))
    data_note("data.path", saved.data.path, now.data.path);
  data_note("data.eval_fraction", (std::ostringstream() << saved.data.eval_fraction).str(),
            (std::ostringstream() << now.data.eval_fraction).str());
  return notes;
}

}  // namespace

io::TrainingState load_checkpoint(Runtime& rt, const std::string& path,
                                  std::vector<std::string>* notes) {
  const Config& config = rt.config();
  io::CheckpointReader reader(path);
  const io::TrainingState& state = reader.state();
  const std::vector<std::string> differ = weight_settings_that_differ(
      path, state.config_yaml, config.to_yaml(),
      !config.model.from_hf.empty() && !state.model_config_json.empty());
  if (!differ.empty()) {
    std::string list;
    for (const std::string& d : differ) list += (list.empty() ? "" : "; ") + d;
    throw ConfigError(concat("train.resume: checkpoint '", path,
                             "' was saved with other model settings (", list,
                             "): resume with the settings it was saved with, or start a new run "
                             "(train.resume=none, or another train.out_dir)"));
  }
  // The same for the model itself: with model.from_hf the run config's model keys are not the
  // model (config.json is), so a config.json changed between the runs (another rope_theta, a
  // head split of the same shapes) shows only here.
  if (!state.model_config_json.empty()) {
    const std::vector<std::string> fields =
        model_fields_that_differ(state.model_config_json, rt.model().config().to_hf_json());
    if (!fields.empty())
      throw ConfigError(fmt::format(
          "train.resume: checkpoint '{}' was saved for another model ({}){}: resume with the "
          "model it was saved for, or start a new run (train.resume=none, or another "
          "train.out_dir)",
          path, fmt::join(fields, "; "),
          config.model.from_hf.empty()
              ? std::string()
              : ", and this run's model comes from " + config.model.from_hf + "/config.json"));
  }
  // A LoRA checkpoint holds the adapters, not the base they adapt: on another base they would
  // train on, from a wrong start, with no error anywhere else.
  if (config.lora.enabled && !state.frozen_base.empty()) {
    const std::string& now = rt.frozen_base();
    if (now != state.frozen_base) {
      std::string saved_from_hf;
      try {
        saved_from_hf = Config::parse(state.config_yaml, {}, "saved config").model.from_hf;
      } catch (const std::exception&) {
      }
      throw ConfigError(concat(
          "train.resume: the LoRA adapters in checkpoint '", path, "' were trained on ",
          describe_frozen_base(state.frozen_base, saved_from_hf), ", but this run's base is ",
          describe_frozen_base(now, config.model.from_hf),
          ": resume with the base they were trained on, or start a new run (train.resume=none, "
          "or another train.out_dir)"));
    }
  }
  if (!state.optimizer.empty() && state.optimizer != config.optim.name)
    throw FormatError(concat("checkpoint '", path, "' was saved with optimizer '", state.optimizer,
                             "' but optim.name is '", config.optim.name,
                             "'; resume with the same optimizer"));

  // The checkpoint's weights must be exactly the model's trainable parameters, at their shapes.
  std::map<std::string, Shape> expected;
  if (fsdp::ShardedModel* sharded = rt.sharded()) {
    for (int u = 0; u < sharded->num_units(); ++u)
      for (const auto& e : sharded->unit_layout(u).entries) expected[e.name] = e.shape;
  } else {
    for (const optim::NamedParam& p : rt.trainable()) expected[p.name] = p.param->shape();
  }
  for (const std::string& name : reader.tensor_names()) {
    if (name.rfind("model/", 0) != 0) continue;
    if (expected.count(name.substr(6)) == 0)
      throw FormatError(concat("checkpoint '", path, "' has tensor '", name,
                               "', which this model does not train (was it saved with another "
                               "model or lora configuration?)"));
  }
  for (const auto& [name, shape] : expected) {
    const std::string key = "model/" + name;
    if (!reader.has(key))
      throw FormatError(concat("checkpoint '", path, "' has no tensor '", key,
                               "' (was it saved with another model or lora configuration?)"));
    Shape saved = reader.shape(key);
    if (saved != shape)
      throw FormatError(concat("checkpoint '", path, "': tensor '", key, "' has shape ",
                               shape_str(saved), " but the model's parameter is ", shape_str(shape),
                               " (another model configuration?)"));
  }

  autograd::NoGrad no_grad;
  std::vector<Slot> slots = trainable_slots(rt);
  if (fsdp::ShardedModel* sharded = rt.sharded()) {
    // Unit by unit: only the full tensors of one unit are in memory at a time.
    sharded->load_full_parameters(
        [&](const std::string& name) { return reader.read("model/" + name); });
  } else {
    for (const Slot& slot : slots) reader.read_range("model/" + slot.name, 0, *slot.param);
  }
  std::map<std::string, const Slot*> by_name;
  for (const Slot& slot : slots) by_name[slot.name] = &slot;
  for (const auto& [state_name, tensor] : rt.optimizer().state()) {
    auto [kind, param] = split_state_name(state_name);
    const std::string key = "optim/" + kind + "/" + param;
    if (!reader.has(key))
      throw FormatError(concat("checkpoint '", path, "' has no optimizer state '", key, "'"));
    reader.read_range(key, by_name.at(param)->begin, *tensor);
  }
  rt.optimizer().reload_params();  // optimizers that keep their own copy of the weights
  rt.optimizer().set_steps_taken(state.optimizer_steps);
  if (rt.scaler().enabled() && state.scaler_enabled) rt.scaler().set_state(state.scaler);

  // Generators continue exactly only with the same ranks; otherwise they keep their seeds.
  const int rank = rt.dist().rank();
  if (state.world_size == rt.dist().world_size()) {
    std::map<std::string, io::GeneratorState> saved;
    for (const io::GeneratorState& g : state.rng[static_cast<size_t>(rank)]) saved[g.name] = g;
    std::vector<std::string> missing;
    for (const auto& [name, gen] : reachable_generators(rt.model())) {
      auto it = saved.find(name);
      if (it != saved.end())
        gen->set_state(it->second.seed, it->second.offset);
      else
        missing.push_back(name);
    }
    // Written by a run that did not draw from them (dropout turned on since), or lost.
    if (notes != nullptr && !missing.empty())
      notes->push_back(fmt::format(
          "note: checkpoint '{}' holds no state for {} random generator(s) the model draws from "
          "({}{}): they start from their seeds, so their draws (dropout masks) are not those an "
          "uninterrupted run would have made",
          path, missing.size(), missing.front(), missing.size() > 1 ? ", ..." : ""));
  }
  return state;
}

// ---- the training loop's checkpointing --------------------------------------------------------

void refuse_fresh_run_over_checkpoints(const Config& config) {
  const std::string& mode = config.train.resume;
  if (!mode.empty() && mode != "none") return;
  // A fresh run must not write into an earlier run's checkpoints: it would replace some of them
  // and leave the others, and a later resume=auto would continue whichever is newest.
  const std::string dir = config.effective_checkpoint_dir();
  const std::vector<io::CheckpointEntry> earlier = io::list_checkpoints(dir);
  ST_CHECK_AS(ConfigError, earlier.empty(), "the checkpoint directory '", dir,
              "' holds checkpoints of an earlier run (the newest at step ",
              earlier.empty() ? 0 : earlier.front().step,
              ") and train.resume is none: continue that run with train.resume=auto, or "
              "start this one in another train.out_dir (or checkpoint.dir), or delete them");
}

Checkpointing::Checkpointing(const Config& config, Runtime& runtime, Log log)
    : config_(config),
      runtime_(runtime),
      log_(std::move(log)),
      dir_(config.effective_checkpoint_dir()),
      last_save_time_(std::chrono::steady_clock::now()) {}

std::optional<ResumePoint> Checkpointing::resume() {
  const std::string& mode = config_.train.resume;
  dist::ProcessGroup& world = runtime_.dist().world();
  if (mode.empty() || mode == "none") {
    refuse_fresh_run_over_checkpoints(config_);
    return std::nullopt;
  }
  auto load = [&](const std::string& path) {
    std::vector<std::string> load_notes;
    io::TrainingState state = load_checkpoint(runtime_, path, &load_notes);
    log_(concat("resumed from ", path, " (step ", state.step, ", saved by ", state.world_size,
                " rank(s), sharding ", state.sharding, ")"));
    for (const std::string& note : load_notes) log_(note);
    last_saved_ = path;  // that step needs no second save (a stop before the next step)
    last_saved_step_ = state.step;
    for (const std::string& note : resume_notes(state, config_, world.size())) log_(note);
    return ResumePoint{path,
                       state.step,
                       {state.sampler.seed, state.sampler.epoch, state.sampler.position,
                        state.sampler.data_checksum}};
  };
  std::error_code ec;
  const bool explicit_file = mode != "auto" && !fs::is_directory(mode, ec);
  if (explicit_file) {
    if (const std::optional<int64_t> step = io::rank_file_step(mode))
      throw ConfigError(
          concat("train.resume='", mode, "' is one rank's file of checkpoint step ", *step,
                 "; resume from its main file, ",
                 (fs::path(mode).parent_path() / io::checkpoint_file_name(*step)).string()));
    std::string problem = io::verify_checkpoint(world, mode);
    if (!problem.empty())
      throw FormatError(concat("train.resume: cannot resume from '", mode, "': ", problem));
    refuse_later_checkpoints(io::CheckpointReader(mode).state().step, mode);
    return load(mode);
  }
  const std::string dir = mode == "auto" ? dir_ : mode;
  // Searching this run's own checkpoint directory, every later checkpoint there was refused on
  // the way down: only another directory needs refuse_later_checkpoints' look at this one.
  const bool searches_own_dir = mode == "auto" || fs::equivalent(dir, dir_, ec);
  const std::vector<io::CheckpointEntry> candidates = checkpoints_every_rank_sees(world, dir);
  for (const io::CheckpointEntry& c : candidates) {
    const std::string problem = resumable_problem(c.path);
    if (problem.empty()) {
      if (!searches_own_dir) refuse_later_checkpoints(c.step, c.path);
      return load(c.path);
    }
    if (searches_own_dir) refused_.insert(c.step);
    log_(concat("refusing checkpoint ", c.path, ": ", problem,
                "; falling back to the previous one"));
  }
  // auto starts from scratch when there is nothing to resume; a directory named explicitly was
  // meant to hold a checkpoint (a mistyped path would otherwise train from scratch in silence).
  ST_CHECK_AS(ConfigError, mode == "auto", "train.resume='", mode,
              "': no complete checkpoint in that directory",
              candidates.empty() ? "" : " (every one was refused, see above)",
              "; name another, or use train.resume=auto to start from scratch when there is none");
  log_(concat("train.resume=", mode, ": no complete checkpoint in '", dir,
              "'; starting from scratch"));
  return std::nullopt;
}

std::string Checkpointing::resumable_problem(const std::string& path) {
  std::string problem = io::verify_checkpoint(runtime_.dist().world(), path);
  if (problem.empty()) {
    try {  // reading the state changes nothing: any failure here is a reason to fall back
      problem = saved_config_problem(io::CheckpointReader(path).state().config_yaml);
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  return problem;
}

// This run saves into dir_, and pruning keeps the checkpoints of the highest steps: one there
// past the resumed step (the abandoned steps of a run rolled back to an earlier checkpoint) would
// outlive this run's saves, and a later resume=auto would continue it instead of this run.
void Checkpointing::refuse_later_checkpoints(int64_t step, const std::string& resumed) {
  std::vector<std::string> later;
  for (const io::CheckpointEntry& c : checkpoints_every_rank_sees(runtime_.dist().world(), dir_)) {
    if (c.step <= step) break;  // newest first
    if (resumable_problem(c.path).empty()) later.push_back(fs::path(c.path).filename().string());
  }
  if (later.empty()) return;
  throw ConfigError(fmt::format(
      "train.resume: resuming step {} from '{}', but the checkpoint directory '{}' also holds "
      "later checkpoints ({}), of the run being rolled back or of another: this run's saves "
      "there would be pruned in their favour, and train.resume=auto would later continue them. "
      "Move them out of the directory, or give this run another checkpoint.dir",
      step, resumed, dir_, fmt::join(later, ", ")));
}

bool Checkpointing::after_step(int64_t step, const SamplerState& sampler, float lr) {
  const CheckpointConfig& c = config_.checkpoint;
  const bool periodic = c.every_steps > 0 || c.every_minutes > 0;
  dist::ProcessGroup& world = runtime_.dist().world();
  // Rank 0's clock decides the timed saves; a stop request on any rank stops every rank.
  int64_t minutes_due = 0;
  if (c.every_minutes > 0 && world.rank() == 0) {
    double minutes =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - last_save_time_).count() /
        60.0;
    minutes_due = minutes >= c.every_minutes ? 1 : 0;
  }
  std::vector<int64_t> flags = {stop_signal(), minutes_due};
  world.all_reduce_host(flags, dist::ReduceOp::Max);
  const int signal = static_cast<int>(flags[0]);
  const bool due = (c.every_steps > 0 && step % c.every_steps == 0) || flags[1] != 0 ||
                   (periodic && step == config_.train.steps);
  if (due || signal != 0) save(step, sampler, lr);
  if (signal == 0) return false;
  log_stopped(signal, step);
  return true;
}

void Checkpointing::log_stopped(int signal, int64_t step) {
  log_(concat("received ", signal_name(signal), ": stopped after step ", step, " with checkpoint ",
              last_saved_, " (continue with train.resume=auto)"));
}

bool Checkpointing::stop_if_requested(int64_t step, const SamplerState& sampler, float lr) {
  const int signal = static_cast<int>(
      runtime_.dist().world().all_reduce_host(int64_t{stop_signal()}, dist::ReduceOp::Max));
  if (signal == 0) return false;
  if (last_saved_step_ != step) save(step, sampler, lr);
  log_stopped(signal, step);
  return true;
}

std::string Checkpointing::save(int64_t step, const SamplerState& sampler, float lr) {
  auto start = std::chrono::steady_clock::now();
  io::SaveRequest req = make_save_request(runtime_, dir_, step, sampler, lr);
  last_saved_ = io::save_checkpoint(runtime_.dist().world(), req);
  last_saved_step_ = step;
  refused_.erase(step);  // written over: this run's own now
  if (runtime_.dist().rank() == 0)
    io::prune_checkpoints(dir_, config_.checkpoint.keep_last, step, refused_);
  last_save_time_ = std::chrono::steady_clock::now();
  const std::string seconds =
      fmt::format("{:.2f}", std::chrono::duration<double>(last_save_time_ - start).count());
  log_(concat("saved checkpoint ", last_saved_, " (step ", step, ", ", seconds, " s)"));
  return last_saved_;
}

void open_metrics(std::ofstream& out, const std::string& path, int64_t resumed_step,
                  bool reevaluates_resumed_step) {
  std::error_code ec;
  auto check = [&] {
    ST_CHECK(out.good(), "cannot write ", path, " (", std::strerror(errno),
             "); train.out_dir must be a writable directory with free space");
  };
  if (resumed_step <= 0 || !fs::exists(path, ec)) {
    out.open(path);
    check();
    return;
  }
  std::vector<std::string> kept;
  {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object()) continue;
      // Every record this program writes has an event name and a whole step number: a line
      // without them (edited, or written by something else) is dropped like one that is not
      // JSON, rather than guessed at.
      const auto step_it = j.find("step");
      const auto event_it = j.find("event");
      if (step_it == j.end() || event_it == j.end() || !event_it->is_string()) continue;
      if (!step_it->is_number_integer() && !step_it->is_number_unsigned()) continue;
      if (step_it->is_number_unsigned() &&
          step_it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        continue;
      const int64_t step = step_it->get<int64_t>();
      if (step < 0) continue;
      // The resumed run evaluates its first step again when one was due there (it may have been
      // abandoned by the stop): the record it makes replaces the earlier one.
      const bool eval_at_resumed_step = reevaluates_resumed_step && step == resumed_step &&
                                        event_it->get<std::string>() == "eval";
      if (step <= resumed_step && !eval_at_resumed_step) kept.push_back(line);
    }
  }
  // The kept lines replace the old file whole: a failed write (a full disk, a kill) leaves the
  // earlier record as it was.
  std::string text;
  for (const std::string& line : kept) text += line + "\n";
  write_file_atomically(path, text, "train.out_dir must be a writable directory with free space");
  out.open(path, std::ios::app);
  check();
}

}  // namespace shardtrain::train
