#include "shardtrain/train/config.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>
#include <variant>

#include "shardtrain/backend/rope.h"
#include "shardtrain/core/device.h"
#include "shardtrain/core/error.h"
#include "shardtrain/core/files.h"
#include "shardtrain/core/suggest.h"
#include "shardtrain/core/units.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/train/runtime.h"

namespace shardtrain::train {
namespace {

// ---- Small text helpers ---------------------------------------------------------------------

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

std::optional<int64_t> read_int(const std::string& text) {
  std::string t = trim(text);
  if (!t.empty() && t[0] == '+') t.erase(0, 1);
  int64_t v = 0;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (ec != std::errc() || end != t.data() + t.size() || t.empty()) return std::nullopt;
  return v;
}

std::optional<double> read_float(const std::string& text) {
  std::string t = trim(text);
  if (!t.empty() && t[0] == '+') t.erase(0, 1);
  double v = 0;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (ec != std::errc() || end != t.data() + t.size() || t.empty() || !std::isfinite(v))
    return std::nullopt;
  return v;
}

// A well-formed number that a T cannot hold: an int64_t 99999999999999999999, a double 1e400 (or
// 1e-400, which rounds to nothing).
template <typename T>
bool beyond_range(const std::string& text) {
  std::string t = trim(text);
  if (!t.empty() && t[0] == '+') t.erase(0, 1);
  T v = 0;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  return ec == std::errc::result_out_of_range && end == t.data() + t.size();
}

std::optional<bool> read_bool(const std::string& text) {
  std::string t = trim(text);
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t == "true" || t == "yes" || t == "on") return true;
  if (t == "false" || t == "no" || t == "off") return false;
  return std::nullopt;
}

// Shortest text that reads back as the same double.
std::string format_float(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, end);
}

// A string as YAML: plain when a reader cannot mistake it for anything else, else double-quoted.
std::string yaml_string(const std::string& s) {
  static const std::set<std::string> kSpecialWords = {"true", "false", "yes", "no",   "on",
                                                      "off",  "y",     "n",   "null", "~"};
  std::string lower = s;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  bool plain = !s.empty() && !kSpecialWords.count(lower) && !read_float(s) && !read_int(s) &&
               s.front() != '-' && s.front() != ':' && s.back() != ':' &&
               std::all_of(s.begin(), s.end(), [](unsigned char c) {
                 return std::isalnum(c) || c == '_' || c == '.' || c == '/' || c == '-' || c == ':';
               });
  if (plain) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    if (c == '\t') {
      out += "\\t";
      continue;
    }
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// ---- Layer selection --------------------------------------------------------------------------

const char* kLayerForms =
    "expected all, a layer N, a range A-B, every:K, or a comma list such as 0,3-5 (layers count "
    "from 0)";

}  // namespace

LayerSelection LayerSelection::parse(const std::string& text) {
  LayerSelection sel;
  sel.text_ = text;
  auto fail = [&](const std::string& why) -> LayerSelection {
    throw ConfigError("activation.layers = '" + text + "' is not valid: " + why);
  };
  std::string t = trim(text);
  if (t == "all") {
    sel.all_ = true;
    return sel;
  }
  if (t.rfind("every:", 0) == 0) {
    auto k = read_int(t.substr(6));
    if (!k || *k < 1) return fail("every:K needs a whole number K >= 1");
    sel.every_ = *k;
    return sel;
  }
  if (t.empty()) return fail(kLayerForms);
  // getline drops a trailing empty item ("0-1,"), which ",," keeps: refuse both alike.
  if (t.back() == ',') return fail("it ends with a comma; " + std::string(kLayerForms));
  std::stringstream items(t);
  std::string item;
  while (std::getline(items, item, ',')) {
    item = trim(item);
    size_t dash = item.find('-', 1);
    std::optional<int64_t> first, last;
    if (dash == std::string::npos) {
      first = last = read_int(item);
    } else {
      first = read_int(item.substr(0, dash));
      last = read_int(item.substr(dash + 1));
    }
    if (!first || !last || *first < 0 || *last < 0) return fail(kLayerForms);
    if (*first > *last)
      return fail("the range " + item + " runs backwards; write it as " + std::to_string(*last) +
                  "-" + std::to_string(*first));
    sel.ranges_.push_back({*first, *last});
  }
  if (sel.ranges_.empty()) return fail(kLayerForms);
  return sel;
}

void LayerSelection::validate(int64_t num_layers) const {
  for (const Range& r : ranges_) {
    if (r.last >= num_layers)
      throw ConfigError("activation.layers = '" + text_ + "' names layer " +
                        std::to_string(r.last) + " but the model has " +
                        std::to_string(num_layers) + " layers (0-" +
                        std::to_string(num_layers - 1) + "; model.num_layers)");
  }
}

bool LayerSelection::applies_to_layer(int64_t layer, int64_t num_layers) const {
  validate(num_layers);
  ST_CHECK(layer >= 0 && layer < num_layers, "layer index ", layer, " is outside 0..",
           num_layers - 1);
  if (all_) return true;
  if (every_ > 0) return layer % every_ == 0;
  return std::any_of(ranges_.begin(), ranges_.end(),
                     [&](const Range& r) { return layer >= r.first && layer <= r.last; });
}

bool ActivationConfig::applies_to_layer(int64_t layer, int64_t num_layers) const {
  return LayerSelection::parse(layers).applies_to_layer(layer, num_layers);
}

int64_t TrainConfig::device_memory_bytes() const {
  return device_memory.empty() ? 0 : parse_bytes(device_memory);
}

int64_t TrainConfig::sequences_per_step(int64_t data_parallel_ranks) const {
  ST_CHECK(data_parallel_ranks >= 1, "data-parallel rank count must be >= 1, got ",
           data_parallel_ranks);
  const int64_t per_round = micro_batch * data_parallel_ranks;
  int64_t total = per_round;
  std::string given;
  if (global_batch > 0) {
    total = global_batch;
    given = "train.global_batch (" + std::to_string(global_batch) + ")";
  } else if (global_batch_tokens > 0) {
    total = global_batch_tokens / seq_len;
    given = "train.global_batch_tokens (" + std::to_string(global_batch_tokens) + ") / seq_len (" +
            std::to_string(seq_len) + ") = " + std::to_string(total) + " sequences";
  }
  if (total % per_round != 0 || total == 0) {
    int64_t below = total / per_round * per_round, above = below + per_round;
    // In the unit the user gave: sequences, or tokens for global_batch_tokens.
    const bool tokens = global_batch <= 0 && global_batch_tokens > 0;
    const int64_t unit = tokens ? seq_len : 1;
    std::string options = below > 0
                              ? std::to_string(below * unit) + " or " + std::to_string(above * unit)
                              : std::to_string(above * unit);
    throw ConfigError(given + " must be a multiple of train.micro_batch x data-parallel ranks (" +
                      std::to_string(micro_batch) + " x " + std::to_string(data_parallel_ranks) +
                      " = " + std::to_string(per_round) + "): use " + options +
                      (tokens ? " tokens (train.global_batch_tokens)" : " sequences"));
  }
  return total;
}

std::string PrecisionConfig::effective_loss_scale() const {
  if (loss_scale != "auto") return loss_scale;
  return compute == "fp16" ? "dynamic" : "none";
}

namespace {

// ---- The schema -------------------------------------------------------------------------------

using FieldRef = std::variant<bool*, int64_t*, double*, std::string*, std::vector<std::string>*>;

// Checks a string value's format; returns "" when fine, else what is expected.
using FormatCheck = std::string (*)(const std::string&);

struct Bound {
  double value = 0;
  bool inclusive = true;
};

// One row of the schema: a key, where it lives in Config, and what values it accepts.
struct Key {
  std::string path;  // "optim.lr"
  std::function<FieldRef(Config&)> field;
  std::optional<Bound> min, max;     // numbers
  std::vector<std::string> choices;  // strings: the allowed values; lists: the allowed items
  FormatCheck format = nullptr;      // strings with a structured format
  bool byte_size = false;            // integers that also accept "64KiB"
  std::string description;           // one-line help
  std::string type;                  // "integer", "number", ... for messages
  bool is_list = false;

  template <typename T>
  static constexpr bool is_list_type() {
    return std::is_same_v<T, std::vector<std::string>>;
  }
  template <typename T>
  static std::string type_of() {
    if constexpr (std::is_same_v<T, bool>) return "boolean";
    if constexpr (std::is_same_v<T, int64_t>) return "integer";
    if constexpr (std::is_same_v<T, double>) return "number";
    if constexpr (std::is_same_v<T, std::string>) return "string";
    return "list of strings";
  }

  template <typename T>
  Key(std::string p, T Config::*member) : path(std::move(p)), is_list(is_list_type<T>()) {
    field = [member](Config& c) -> FieldRef { return &(c.*member); };
    type = type_of<T>();
  }
  template <typename Section, typename T>
  Key(std::string p, Section Config::*section, T Section::*member)
      : path(std::move(p)), is_list(is_list_type<T>()) {
    field = [section, member](Config& c) -> FieldRef { return &(c.*section.*member); };
    type = type_of<T>();
  }
  // A key of a group inside a section (model.rope_scaling.factor).
  template <typename Section, typename Group, typename T>
  Key(std::string p, Section Config::*section, Group Section::*group, T Group::*member)
      : path(std::move(p)), is_list(is_list_type<T>()) {
    field = [section, group, member](Config& c) -> FieldRef {
      return &(c.*section.*group.*member);
    };
    type = type_of<T>();
  }

  Key& at_least(double v) { return min = Bound{v, true}, *this; }
  Key& above(double v) { return min = Bound{v, false}, *this; }
  Key& at_most(double v) { return max = Bound{v, true}, *this; }
  Key& below(double v) { return max = Bound{v, false}, *this; }
  Key& one_of(std::vector<std::string> values) { return choices = std::move(values), *this; }
  Key& checked_by(FormatCheck check) { return format = check, *this; }
  Key& accepts_byte_size() { return byte_size = true, *this; }
  Key& help(std::string text) { return description = std::move(text), *this; }

  std::string section() const {
    size_t dot = path.find('.');
    return dot == std::string::npos ? "" : path.substr(0, dot);
  }
  // The path below the section: "lr", or "rope_scaling.factor" for a key of a group.
  std::string leaf() const { return path.substr(path.find('.') + 1); }
  // "model.rope_scaling" for model.rope_scaling.factor; "" for a key directly in its section.
  std::string group() const {
    size_t last = path.rfind('.');
    return last == std::string::npos || last == path.find('.') ? "" : path.substr(0, last);
  }
  std::string name() const { return path.substr(path.rfind('.') + 1); }

  std::string type_name() const { return byte_size ? "integer or byte size" : type; }

  // Whether `v` is within the key's bounds (true without bounds).
  bool admits(double v) const {
    if (min && !(min->inclusive ? v >= min->value : v > min->value)) return false;
    if (max && !(max->inclusive ? v <= max->value : v < max->value)) return false;
    return true;
  }

  // The allowed values or range, e.g. "> 0", "in [0, 1)", "one of cosine, constant, linear".
  std::string allowed() const {
    auto show = [](const std::string& s) { return s.empty() ? std::string("\"\"") : s; };
    if (!choices.empty()) {
      std::vector<std::string> shown;
      for (const auto& c : choices) shown.push_back(show(c));
      return (is_list ? "items from " : "one of ") + join(shown, ", ");
    }
    if (min && max)
      return std::string(min->inclusive ? "in [" : "in (") + format_float(min->value) + ", " +
             format_float(max->value) + (max->inclusive ? "]" : ")");
    if (min) return (min->inclusive ? ">= " : "> ") + format_float(min->value);
    if (max) return (max->inclusive ? "<= " : "< ") + format_float(max->value);
    return "";
  }
};

std::string check_device(const std::string& text) {
  if (text == "auto") return "";
  try {
    if (!parse_device(text).is_host()) return "";
  } catch (const ConfigError&) {
  }
  return "expected auto, cpu, cuda or cuda:N";
}

std::string check_byte_size(const std::string& text) {
  if (text.empty()) return "";
  try {
    if (parse_bytes(text) > 0) return "";
  } catch (const ConfigError&) {
  }
  return "expected \"\" (no limit) or a positive byte size such as 24GiB or 512MiB";
}

std::string check_layers(const std::string& text) {
  try {
    LayerSelection::parse(text);
    return "";
  } catch (const ConfigError&) {
    return kLayerForms;
  }
}

std::string check_not_empty(const std::string& text) {
  return trim(text).empty() ? "expected a non-empty value" : "";
}

std::string check_rope_type(const std::string& text) {
  if (text == "none" || text == "llama3") return "";
  return "only llama3 RoPE scaling (Llama-3.1 and 3.2) is supported, or none; linear, dynamic, "
         "yarn and longrope scaling are not implemented";
}

const std::vector<std::string> kSections = {
    "model", "data", "train", "optim", "precision", "activation", "dist", "checkpoint", "lora"};

// Sizes carry an upper bound far past any real run: products of them (a step's tokens, a weight's
// elements) then stay far from int64's range, where they would wrap around to small or negative
// sizes.
const std::vector<Key>& schema() {
  using C = Config;
  static const std::vector<Key> keys = {
      Key("recipe", &C::recipe)
          .one_of({"manual", "auto"})
          .help("auto picks sharding, precision and activation strategy from the memory plan"),

      Key("model.from_hf", &C::model, &ModelConfig::from_hf)
          .help("Hugging Face model dir (config.json gives the model, safetensors the weights)"),
      Key("model.vocab_size", &C::model, &ModelConfig::vocab_size)
          .at_least(1)
          .at_most(static_cast<double>(nn::LlamaConfig::kMaxVocabSize))
          .help("vocabulary size"),
      Key("model.hidden_size", &C::model, &ModelConfig::hidden_size)
          .at_least(1)
          .at_most(static_cast<double>(nn::LlamaConfig::kMaxHiddenSize))
          .help("model width"),
      Key("model.intermediate_size", &C::model, &ModelConfig::intermediate_size)
          .at_least(1)
          .at_most(static_cast<double>(nn::LlamaConfig::kMaxIntermediateSize))
          .help("SwiGLU MLP width"),
      Key("model.num_layers", &C::model, &ModelConfig::num_layers)
          .at_least(1)
          .at_most(static_cast<double>(nn::LlamaConfig::kMaxLayers))
          .help("transformer blocks"),
      Key("model.num_heads", &C::model, &ModelConfig::num_heads)
          .at_least(1)
          .at_most(static_cast<double>(nn::LlamaConfig::kMaxHeads))
          .help("attention heads"),
      Key("model.num_kv_heads", &C::model, &ModelConfig::num_kv_heads)
          .at_least(0)
          .at_most(static_cast<double>(nn::LlamaConfig::kMaxHeads))
          .help("key/value heads for grouped-query attention; 0 = num_heads"),
      Key("model.rms_norm_eps", &C::model, &ModelConfig::rms_norm_eps)
          .above(0)
          .help("RMSNorm epsilon"),
      Key("model.rope_theta", &C::model, &ModelConfig::rope_theta)
          .above(0)
          .help("RoPE base frequency"),
      Key("model.rope_scaling.rope_type", &C::model, &ModelConfig::rope_scaling,
          &RopeScalingConfig::rope_type)
          .checked_by(check_rope_type)
          .help("RoPE frequency scaling: none, or llama3 (config.json rope_scaling of "
                "Llama-3.1/3.2)"),
      Key("model.rope_scaling.factor", &C::model, &ModelConfig::rope_scaling,
          &RopeScalingConfig::factor)
          .at_least(0)
          .help("llama3: divisor of the low frequencies (8 for Llama-3.1); 0 = unset"),
      Key("model.rope_scaling.low_freq_factor", &C::model, &ModelConfig::rope_scaling,
          &RopeScalingConfig::low_freq_factor)
          .at_least(0)
          .help("llama3: wavelengths above original/low_freq_factor are scaled (1); 0 = unset"),
      Key("model.rope_scaling.high_freq_factor", &C::model, &ModelConfig::rope_scaling,
          &RopeScalingConfig::high_freq_factor)
          .at_least(0)
          .help("llama3: wavelengths below original/high_freq_factor are kept (4); 0 = unset"),
      Key("model.rope_scaling.original_max_position_embeddings", &C::model,
          &ModelConfig::rope_scaling, &RopeScalingConfig::original_max_position_embeddings)
          .at_least(0)
          .help("llama3: context length of pre-training (8192); 0 = unset"),
      Key("model.tie_embeddings", &C::model, &ModelConfig::tie_embeddings)
          .help("share the input embedding with the output projection"),
      Key("model.max_seq_len", &C::model, &ModelConfig::max_seq_len)
          .at_least(1)
          .at_most(static_cast<double>(nn::LlamaConfig::kMaxSeqLen))
          .help("longest sequence the model supports (with model.from_hf: the longer of this "
                "and config.json's max_position_embeddings)"),
      Key("model.init_std", &C::model, &ModelConfig::init_std)
          .above(0)  // all-zero weights have all-zero gradients: such a model never learns
          .help("std of the normal weight initialisation"),

      Key("data.path", &C::data, &DataConfig::path)
          .checked_by(check_not_empty)
          .help("builtin (embedded corpus), a .h5 token dataset or a .txt file"),
      Key("data.eval_fraction", &C::data, &DataConfig::eval_fraction)
          .above(0)
          .at_most(0.5)
          .help("share of the data held out for evaluation"),
      Key("data.seed", &C::data, &DataConfig::seed)
          .at_least(0)
          .help("seed of the training windows' shuffle order"),

      Key("train.steps", &C::train, &TrainConfig::steps).at_least(1).help("optimizer steps"),
      Key("train.seq_len", &C::train, &TrainConfig::seq_len)
          .at_least(1)
          .at_most(static_cast<double>(nn::LlamaConfig::kMaxSeqLen))
          .help("tokens per sequence"),
      Key("train.micro_batch", &C::train, &TrainConfig::micro_batch)
          .at_least(1)
          .at_most(static_cast<double>(1ll << 20))
          .help("sequences per rank per forward/backward"),
      Key("train.global_batch", &C::train, &TrainConfig::global_batch)
          .at_least(0)
          .at_most(static_cast<double>(1ll << 30))
          .help("sequences per optimizer step over all ranks; 0 = micro_batch x world size"),
      Key("train.global_batch_tokens", &C::train, &TrainConfig::global_batch_tokens)
          .at_least(0)
          .at_most(static_cast<double>(1ll << 48))
          .help("tokens per optimizer step (instead of global_batch); 0 = unused"),
      Key("train.eval_every", &C::train, &TrainConfig::eval_every)
          .at_least(0)
          .help("steps between evaluations; 0 = never"),
      Key("train.eval_batches", &C::train, &TrainConfig::eval_batches)
          .at_least(1)
          .at_most(static_cast<double>(1ll << 20))
          .help("micro-batches per evaluation"),
      Key("train.log_every", &C::train, &TrainConfig::log_every)
          .at_least(1)
          .help("steps between log lines"),
      Key("train.seed", &C::train, &TrainConfig::seed)
          .at_least(0)
          .help("seed of initialisation and dropout"),
      Key("train.device", &C::train, &TrainConfig::device)
          .checked_by(check_device)
          .help("auto, cpu, cuda or cuda:N"),
      Key("train.device_memory", &C::train, &TrainConfig::device_memory)
          .checked_by(check_byte_size)
          .help("device capacity for the memory planner and allocator, e.g. 24GiB; \"\" = all"),
      Key("train.out_dir", &C::train, &TrainConfig::out_dir)
          .checked_by(check_not_empty)
          .help("run directory (logs, checkpoints, export); default runs/<config stem>, "
                "relative to the working directory"),
      Key("train.resume", &C::train, &TrainConfig::resume)
          .checked_by(check_not_empty)
          .help("none, auto (latest checkpoint in the checkpoint dir) or a checkpoint path"),
      Key("train.export", &C::train, &TrainConfig::export_model)
          .help("export the model when training ends"),
      Key("train.export_dtype", &C::train, &TrainConfig::export_dtype)
          .one_of({"fp32", "bf16", "fp16"})
          .help("dtype of the exported weights (a LoRA run's merged model too); the adapter and "
                "checkpoints stay fp32"),
      Key("train.progress", &C::train, &TrainConfig::progress)
          .one_of({"auto", "bar", "lines", "none"})
          .help("progress display; auto = bar on a terminal, lines otherwise (an evaluation "
                "shows its batches on the bar, and as a line every 30 s once it has run 2 s)"),

      Key("optim.name", &C::optim, &OptimConfig::name).one_of({"adamw", "sgd"}).help("optimizer"),
      Key("optim.lr", &C::optim, &OptimConfig::lr).above(0).help("peak learning rate"),
      Key("optim.min_lr", &C::optim, &OptimConfig::min_lr)
          .help("floor of the decay, reached just after the last step; < 0 = lr / 10"),
      Key("optim.warmup_steps", &C::optim, &OptimConfig::warmup_steps)
          .at_least(0)
          .help("linear warmup steps (step s of them runs at lr (s + 1) / warmup_steps)"),
      Key("optim.schedule", &C::optim, &OptimConfig::schedule)
          .one_of({"cosine", "constant", "linear"})
          .help("decay after warmup"),
      Key("optim.beta1", &C::optim, &OptimConfig::beta1)
          .at_least(0)
          .below(1)
          .help("AdamW first-moment decay"),
      Key("optim.beta2", &C::optim, &OptimConfig::beta2)
          .at_least(0)
          .below(1)
          .help("AdamW second-moment decay"),
      Key("optim.eps", &C::optim, &OptimConfig::eps).above(0).help("AdamW epsilon"),
      Key("optim.weight_decay", &C::optim, &OptimConfig::weight_decay)
          .at_least(0)
          .help("weight decay (adamw: decoupled; sgd: L2, added to the gradient)"),
      Key("optim.decay_norms_and_embeddings", &C::optim, &OptimConfig::decay_norms_and_embeddings)
          .help("apply weight decay to norm gains and embeddings too"),
      Key("optim.momentum", &C::optim, &OptimConfig::momentum)
          .at_least(0)
          .below(1)
          .help("SGD momentum (sgd only)"),
      Key("optim.grad_clip", &C::optim, &OptimConfig::grad_clip)
          .at_least(0)
          .help("max global gradient norm; 0 = no clipping"),
      Key("optim.offload", &C::optim, &OptimConfig::offload)
          .one_of({"none", "cpu"})
          .help("run the optimizer step on the CPU with host-resident state"),
      Key("optim.offload_moments", &C::optim, &OptimConfig::offload_moments)
          .one_of({"host", "device"})
          .help("where offloaded optimizer moments live"),

      Key("precision.compute", &C::precision, &PrecisionConfig::compute)
          .one_of({"fp32", "bf16", "fp16"})
          .help("dtype of forward/backward math inputs"),
      Key("precision.param_dtype", &C::precision, &PrecisionConfig::param_dtype)
          .one_of({"", "fp32", "bf16", "fp16"})
          .help("dtype of the gathered parameters: \"\" or precision.compute's"),
      Key("precision.reduce_dtype", &C::precision, &PrecisionConfig::reduce_dtype)
          .one_of({"fp32", "bf16", "fp16"})
          .help("dtype of gradient reduction"),
      Key("precision.loss_scale", &C::precision, &PrecisionConfig::loss_scale)
          .one_of({"auto", "dynamic", "none"})
          .help("auto = dynamic for fp16, none otherwise"),
      Key("precision.init_scale", &C::precision, &PrecisionConfig::init_scale)
          .above(0)
          .help("first dynamic loss scale"),
      Key("precision.growth_interval", &C::precision, &PrecisionConfig::growth_interval)
          .at_least(1)
          .help("finite steps before the loss scale grows"),
      Key("precision.growth_factor", &C::precision, &PrecisionConfig::growth_factor)
          .above(1)
          .help("loss scale growth factor"),
      Key("precision.backoff_factor", &C::precision, &PrecisionConfig::backoff_factor)
          .above(0)
          .below(1)
          .help("loss scale factor after an overflow"),

      Key("activation.strategy", &C::activation, &ActivationConfig::strategy)
          .one_of(
              {"none", "per_layer", "sqrt_segment", "selective", "offload", "offload_checkpoint"})
          .help("how saved activations are reduced"),
      Key("activation.layers", &C::activation, &ActivationConfig::layers)
          .checked_by(check_layers)
          .help("layers the strategy applies to: all, N, A-B, every:K or a list 0,3-5"),
      Key("activation.checkpoint_impl", &C::activation, &ActivationConfig::checkpoint_impl)
          .one_of({"non_reentrant", "reentrant"})
          .help("recomputation mechanism"),
      Key("activation.offload_min_bytes", &C::activation, &ActivationConfig::offload_min_bytes)
          .at_least(0)
          .accepts_byte_size()
          .help("smaller activations stay on the device"),
      Key("activation.attention", &C::activation, &ActivationConfig::attention)
          .one_of({"plain", "fused"})
          .help("fused never stores the attention matrix"),
      Key("activation.attention_backward", &C::activation, &ActivationConfig::attention_backward)
          .one_of({"deterministic", "atomic_dq"})
          .help("fused backward on GPU tensor cores: atomic_dq sums dQ with atomics (one pass, "
                "fewer products, not bit-reproducible)"),
      Key("activation.loss_chunk_tokens", &C::activation, &ActivationConfig::loss_chunk_tokens)
          .at_least(0)
          .help("tokens per chunk of the fused head + loss (recomputed logits); 0 = whole logits"),

      Key("dist.backend", &C::dist, &DistConfig::backend)
          .one_of({"auto", "mpi", "nccl"})
          .help("collective library; auto = nccl on CUDA, mpi otherwise"),
      Key("dist.sharding", &C::dist, &DistConfig::sharding)
          .one_of({"full_shard", "grad_op_shard", "no_shard", "hybrid_shard"})
          .help("what is sharded over ranks"),
      Key("dist.ranks_per_node", &C::dist, &DistConfig::ranks_per_node)
          .at_least(0)
          .help("ranks sharing a node (hybrid_shard); 0 = detect"),
      Key("dist.sync_every_microbatch", &C::dist, &DistConfig::sync_every_microbatch)
          .help("reduce gradients after every micro-batch instead of once per step"),
      Key("dist.timeout_s", &C::dist, &DistConfig::timeout_s)
          .at_least(1)
          .help("seconds before a stalled collective, or joining the job, is an error"),
      Key("dist.prefetch", &C::dist, &DistConfig::prefetch)
          .help("gather the next unit's parameters while computing"),

      Key("checkpoint.dir", &C::checkpoint, &CheckpointConfig::dir)
          .help("\"\" = <train.out_dir>/checkpoints"),
      Key("checkpoint.every_steps", &C::checkpoint, &CheckpointConfig::every_steps)
          .at_least(0)
          .help("save every N steps; 0 = never"),
      Key("checkpoint.every_minutes", &C::checkpoint, &CheckpointConfig::every_minutes)
          .at_least(0)
          .help("save every N minutes; 0 = never"),
      Key("checkpoint.keep_last", &C::checkpoint, &CheckpointConfig::keep_last)
          .at_least(0)
          .help("checkpoints kept; 0 = all"),

      Key("lora.enabled", &C::lora, &LoraConfig::enabled)
          .help("train low-rank adapters on a frozen base"),
      Key("lora.r", &C::lora, &LoraConfig::r)
          .at_least(1)
          .at_most(static_cast<double>(1ll << 16))
          .help("adapter rank"),
      Key("lora.alpha", &C::lora, &LoraConfig::alpha)
          .above(0)
          .help("adapter scale numerator (scale = alpha / r)"),
      Key("lora.dropout", &C::lora, &LoraConfig::dropout)
          .at_least(0)
          .below(1)
          .help("dropout on the adapter input"),
      Key("lora.target_modules", &C::lora, &LoraConfig::target_modules)
          .one_of({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
          .help("projections that get adapters"),
      Key("lora.quantize_base", &C::lora, &LoraConfig::quantize_base)
          .one_of({"nf4", "none"})
          .help("store the frozen base weights in NF4"),
      Key("lora.base_model", &C::lora, &LoraConfig::base_model)
          .help("Hugging Face dir of the base model; \"\" = model.from_hf"),
      Key("lora.adapter_out", &C::lora, &LoraConfig::adapter_out)
          .help("adapter output dir; \"\" = <train.out_dir>/adapter"),
      Key("lora.init_from", &C::lora, &LoraConfig::init_from)
          .help("PEFT adapter dir the adapters start from; \"\" = A random, B zero"),
      Key("lora.merge_on_export", &C::lora, &LoraConfig::merge_on_export)
          .help("merge the adapter into the exported weights"),
  };
  return keys;
}

const Key* find_key(const std::string& path) {
  for (const Key& k : schema())
    if (k.path == path) return &k;
  return nullptr;
}

// A group of keys inside a section (model.rope_scaling): written as a mapping below its name.
bool is_group(const std::string& path) {
  for (const Key& k : schema())
    if (!k.group().empty() && k.group() == path) return true;
  return false;
}

std::vector<std::string> keys_in_group(const std::string& group) {
  std::vector<std::string> out;
  for (const Key& k : schema())
    if (k.group() == group) out.push_back(k.name());
  return out;
}

bool is_section(const std::string& name) {
  return std::find(kSections.begin(), kSections.end(), name) != kSections.end();
}

std::vector<std::string> keys_in_section(const std::string& section) {
  std::vector<std::string> out;
  for (const Key& k : schema())
    if (k.section() == section) out.push_back(k.leaf());
  return out;
}

// ---- Messages -----------------------------------------------------------------------------

[[noreturn]] void fail_at(const std::string& origin, const std::string& what) {
  throw ConfigError(origin.empty() ? what : origin + ": " + what);
}

std::string where(const std::string& source, const YAML::Node& node) {
  YAML::Mark m = node.Mark();
  if (m.is_null()) return source;
  return source + ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1);
}

// A node as the user wrote it, for messages.
// `text` with control characters written as \xNN: a NUL would end the message where it is
// printed, and others would garble the terminal.
std::string printable(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c >= 0x20 && c != 0x7f) {
      out += static_cast<char>(c);
      continue;
    }
    char escaped[8];
    std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
    out += escaped;
  }
  return out;
}

std::string show(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return "(nothing)";
  if (node.IsScalar()) {
    const std::string& s = node.Scalar();
    return read_float(s) ? s : "'" + printable(s) + "'";
  }
  YAML::Emitter out;
  out << YAML::Flow << node;
  return printable(out.c_str());
}

std::string node_kind(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Scalar:
      return "a single value";
    default:
      return "nothing";
  }
}

[[noreturn]] void unknown_key(const std::string& path, const std::string& origin) {
  std::vector<std::string> all_paths;
  for (const Key& k : schema()) all_paths.push_back(k.path);
  size_t dot = path.find('.');
  std::string section = dot == std::string::npos ? "" : path.substr(0, dot);
  std::string leaf = path.substr(dot == std::string::npos ? 0 : dot + 1);

  if (dot == std::string::npos && is_section(path))
    fail_at(origin, "'" + path + "' is a section, not a key: set one of its keys, e.g. " + path +
                        "." + keys_in_section(path).front());

  // A key inside a group (model.rope_scaling.x): suggest from the group's own keys.
  const size_t last_dot = path.rfind('.');
  const std::string parent = last_dot == std::string::npos ? "" : path.substr(0, last_dot);
  if (is_group(parent)) {
    const std::string name = path.substr(last_dot + 1);
    const std::vector<std::string> names = keys_in_group(parent);
    std::string near;
    for (const std::string& known : names) {
      const bool cut = name.size() >= 2 && (known.rfind(name, 0) == 0 || name.rfind(known, 0) == 0);
      const bool suffix = known.size() > name.size() &&
                          known.compare(known.size() - name.size(), name.size(), name) == 0 &&
                          known[known.size() - name.size() - 1] == '_';
      if (near.empty() && (cut || suffix)) near = known;  // factor for f, rope_type for type
    }
    if (near.empty()) near = closest_match(name, names);
    std::string message = "unknown config key '" + path + "'";
    if (!near.empty()) message += ": did you mean '" + parent + "." + near + "'?";
    fail_at(origin, message + " (keys in " + parent + ": " + join(names, ", ") + ")");
  }

  std::string suggestion;
  if (is_section(section)) {
    // A key cut short or run on (optim.warmup for optim.warmup_steps), then a typo.
    std::vector<std::string> leaves = keys_in_section(section);
    for (const std::string& known : leaves) {
      if (leaf.size() >= 2 && (known.rfind(leaf, 0) == 0 || leaf.rfind(known, 0) == 0)) {
        suggestion = section + "." + known;
        break;
      }
    }
    if (suggestion.empty()) {
      std::string near = closest_match(leaf, leaves);
      if (!near.empty()) suggestion = section + "." + near;
    }
  }
  // The right key in the wrong section or outside any (train.lr or lr for optim.lr).
  for (const Key& k : schema())
    if (suggestion.empty() && (k.leaf() == leaf || k.name() == leaf)) suggestion = k.path;
  std::vector<std::string> top_level = kSections;
  for (const Key& k : schema())
    if (k.section().empty()) top_level.push_back(k.path);
  if (suggestion.empty() && dot == std::string::npos) {
    for (const std::string& name : top_level)
      if (path.size() >= 2 && (name.rfind(path, 0) == 0 || path.rfind(name, 0) == 0)) {
        suggestion = name;  // optimizer for optim
        break;
      }
    if (suggestion.empty()) suggestion = closest_match(path, top_level);
  }
  if (suggestion.empty()) suggestion = closest_match(path, all_paths);
  std::string message = "unknown config key '" + path + "'";
  if (!suggestion.empty()) message += ": did you mean '" + suggestion + "'?";
  if (is_section(section)) {
    message += " (keys in " + section + ": " + join(keys_in_section(section), ", ") + ")";
  } else {
    message += " (top level: " + join(top_level, ", ") + ")";
  }
  fail_at(origin, message);
}

// ---- Reading values -----------------------------------------------------------------------

[[noreturn]] void wrong_type(const Key& key, const YAML::Node& node, const std::string& origin,
                             const std::string& expected) {
  fail_at(origin, key.path + " = " + show(node) + " has the wrong type: expected " + expected +
                      " (" + key.description + ")");
}

void check_range(const Key& key, double v, const YAML::Node& node, const std::string& origin) {
  if (!key.admits(v))
    fail_at(origin, key.path + " = " + show(node) + " is out of range: must be " + key.allowed() +
                        " (" + key.description + ")");
}

void check_choice(const Key& key, const std::string& value, const YAML::Node& node,
                  const std::string& origin) {
  if (key.choices.empty() ||
      std::find(key.choices.begin(), key.choices.end(), value) != key.choices.end())
    return;
  std::string message =
      key.path + " = " + show(node) + " is not allowed: expected " + key.allowed();
  std::string near = closest_match(value, key.choices);
  if (!near.empty()) message += "; did you mean '" + near + "'?";
  fail_at(origin, message);
}

std::string scalar_text(const Key& key, const YAML::Node& node, const std::string& origin,
                        const std::string& expected) {
  if (!node.IsScalar()) wrong_type(key, node, origin, expected);
  return node.Scalar();
}

void assign(const Key& key, const YAML::Node& node, const std::string& origin, Config& config) {
  FieldRef field = key.field(config);
  if (auto* b = std::get_if<bool*>(&field)) {
    auto v = read_bool(scalar_text(key, node, origin, "true or false"));
    if (!v) wrong_type(key, node, origin, "true or false");
    **b = *v;
  } else if (auto* i = std::get_if<int64_t*>(&field)) {
    std::string expected =
        key.byte_size ? "a whole number of bytes or a size such as 64KiB" : "a whole number";
    std::string text = scalar_text(key, node, origin, expected);
    auto v = read_int(text);
    if (!v && key.byte_size) {
      try {
        v = parse_bytes(trim(text));
      } catch (const ConfigError&) {
      }
    }
    if (!v && beyond_range<int64_t>(text))
      fail_at(origin, key.path + " = " + trim(text) +
                          " is past what a 64-bit integer holds: must be " +
                          (key.allowed().empty() ? std::string("from -2^63 to 2^63 - 1")
                                                 : key.allowed() + " and below 2^63") +
                          " (" + key.description + ")");
    if (!v) wrong_type(key, node, origin, expected);
    check_range(key, static_cast<double>(*v), node, origin);
    **i = *v;
  } else if (auto* d = std::get_if<double*>(&field)) {
    const std::string text = scalar_text(key, node, origin, "a number");
    auto v = read_float(text);
    if (!v && !beyond_range<double>(text)) wrong_type(key, node, origin, "a number");
    // The values reach the kernels as fp32: one outside its range would arrive as inf or 0
    // (optim.eps = 1e-50 becomes a zero divisor) instead of failing here. A number beyond even
    // a double's range (1e400, 1e-400) does not read at all.
    const double magnitude = v ? std::fabs(*v) : HUGE_VAL;
    if (magnitude > std::numeric_limits<float>::max() ||
        (magnitude > 0 && magnitude < std::numeric_limits<float>::min()))
      fail_at(origin, key.path + " = " + trim(text) +
                          " is outside fp32's range, in which the runtime computes: use " +
                          (key.admits(0) ? "0 or " : "") +
                          "a magnitude between 1.2e-38 and 3.4e38" +
                          (key.allowed().empty() ? "" : ", " + key.allowed()) + " (" +
                          key.description + ")");
    check_range(key, *v, node, origin);
    // In range as a double, out of it as the fp32 the kernels get: optim.beta2 = 0.99999999 is
    // 1 in fp32, and an AdamW with beta2 = 1 divides by zero in its bias correction.
    const double as_fp32 = static_cast<double>(static_cast<float>(*v));
    if (as_fp32 != *v && !key.admits(as_fp32))
      fail_at(origin, key.path + " = " + trim(text) + " rounds to " + format_float(as_fp32) +
                          " in fp32, in which the runtime computes, and that is out of range: "
                          "must be " +
                          key.allowed() + " (" + key.description + ")");
    **d = *v;
  } else if (auto* s = std::get_if<std::string*>(&field)) {
    std::string v = node.IsNull() ? "" : scalar_text(key, node, origin, "a single value");
    check_choice(key, v, node, origin);
    if (key.format) {
      std::string problem = key.format(v);
      if (!problem.empty())
        fail_at(origin, key.path + " = " + show(node) + " is not valid: " + problem);
    }
    **s = v;
  } else if (auto* list = std::get_if<std::vector<std::string>*>(&field)) {
    const std::string expected = "a list such as [q_proj, v_proj]";
    std::vector<std::string> items;
    if (!node.IsNull() && !node.IsSequence()) wrong_type(key, node, origin, expected);
    for (const YAML::Node& item : node) {
      if (!item.IsScalar()) wrong_type(key, node, origin, expected);
      if (std::find(items.begin(), items.end(), item.Scalar()) != items.end())
        fail_at(origin, key.path + " = " + show(node) + " lists '" + item.Scalar() + "' twice");
      check_choice(key, item.Scalar(), item, origin);
      items.push_back(item.Scalar());
    }
    if (items.empty())
      fail_at(origin, key.path + " is empty: list at least one of " + join(key.choices, ", "));
    **list = items;
  }
}

// ---- Rules that tie keys together -----------------------------------------------------------

void validate_relations(const Config& c) {
  const TrainConfig& t = c.train;
  auto n = [](int64_t v) { return std::to_string(v); };
  if (t.global_batch > 0 && t.global_batch_tokens > 0)
    throw ConfigError("train.global_batch (" + n(t.global_batch) +
                      ") and train.global_batch_tokens (" + n(t.global_batch_tokens) +
                      ") both set the batch size: set one of them and leave the other at 0");
  if (t.global_batch > 0 && t.global_batch % t.micro_batch != 0)
    throw ConfigError("train.global_batch (" + n(t.global_batch) +
                      ") must be a multiple of train.micro_batch (" + n(t.micro_batch) + ")");
  if (t.global_batch_tokens > 0 && t.global_batch_tokens % (t.seq_len * t.micro_batch) != 0)
    throw ConfigError("train.global_batch_tokens (" + n(t.global_batch_tokens) +
                      ") must be a multiple of train.seq_len x train.micro_batch (" + n(t.seq_len) +
                      " x " + n(t.micro_batch) + " = " + n(t.seq_len * t.micro_batch) + ")");
  if (c.optim.min_lr >= 0 && c.optim.min_lr > c.optim.lr)
    throw ConfigError("optim.min_lr (" + format_float(c.optim.min_lr) + ") is above optim.lr (" +
                      format_float(c.optim.lr) + "): the schedule decays from lr to min_lr");

  // The gathered parameters are what every op computes on (FSDP's param_dtype is the compute
  // dtype): a different value would quietly run another precision than precision.compute names,
  // and loss scaling (keyed on precision.compute) would not match it.
  if (!c.precision.param_dtype.empty() && c.precision.param_dtype != c.precision.compute)
    throw ConfigError("precision.param_dtype (" + c.precision.param_dtype +
                      ") differs from precision.compute (" + c.precision.compute +
                      "): the gathered parameters are the compute dtype; set precision.compute=" +
                      c.precision.param_dtype + " and leave precision.param_dtype unset");

  LayerSelection layers = LayerSelection::parse(c.activation.layers);

  // RoPE scaling: all four numbers with llama3, none of them without it.
  const RopeScalingConfig& rs = c.model.rope_scaling;
  const std::vector<std::pair<std::string, double>> scaling_numbers = {
      {"factor", rs.factor},
      {"low_freq_factor", rs.low_freq_factor},
      {"high_freq_factor", rs.high_freq_factor},
      {"original_max_position_embeddings",
       static_cast<double>(rs.original_max_position_embeddings)}};
  if (rs.rope_type == "none") {
    for (const auto& [name, value] : scaling_numbers)
      if (value != 0)
        throw ConfigError("model.rope_scaling." + name + " (" + format_float(value) +
                          ") is set but model.rope_scaling.rope_type is none: set rope_type: "
                          "llama3 to scale the RoPE frequencies, or remove it");
  } else {
    std::vector<std::string> missing;
    for (const auto& [name, value] : scaling_numbers)
      if (value == 0) missing.push_back("model.rope_scaling." + name);
    if (!missing.empty())
      throw ConfigError("model.rope_scaling.rope_type " + rs.rope_type + " needs " +
                        join(missing, ", ") +
                        " (as in config.json's rope_scaling; Llama-3.1: factor 8, "
                        "low_freq_factor 1, high_freq_factor 4, "
                        "original_max_position_embeddings 8192)");
    const std::string problem = llama3_rope_scaling_problem(
        {rs.factor, rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings});
    if (!problem.empty()) throw ConfigError("model.rope_scaling: " + problem);
  }

  // With from_hf the shape comes from config.json, checked when it is read.
  if (!c.model.from_hf.empty()) return;
  const ModelConfig& m = c.model;
  if (m.hidden_size % m.num_heads != 0)
    throw ConfigError("model.hidden_size (" + n(m.hidden_size) +
                      ") must be divisible by model.num_heads (" + n(m.num_heads) + ")");
  if ((m.hidden_size / m.num_heads) % 2 != 0)
    throw ConfigError("the head size model.hidden_size / model.num_heads = " +
                      n(m.hidden_size / m.num_heads) + " must be even for rotary embeddings");
  if (m.effective_num_kv_heads() > m.num_heads || m.num_heads % m.effective_num_kv_heads() != 0)
    throw ConfigError("model.num_kv_heads (" + n(m.num_kv_heads) +
                      ") must divide model.num_heads (" + n(m.num_heads) + ")");
  if (t.seq_len > m.max_seq_len)
    throw ConfigError("train.seq_len (" + n(t.seq_len) + ") exceeds model.max_seq_len (" +
                      n(m.max_seq_len) + ")");
  layers.validate(m.num_layers);
}

// ---- Loading and overriding -----------------------------------------------------------------

YAML::Node load_yaml(const std::string& text, const std::string& source) {
  try {
    std::vector<YAML::Node> documents = YAML::LoadAll(text);
    if (documents.size() > 1)
      throw ConfigError(source + " holds " + std::to_string(documents.size()) +
                        " YAML documents (separated by '---'); a config is one document: merge "
                        "them, or put each in a file of its own");
    return documents.empty() ? YAML::Node() : documents.front();
  } catch (const YAML::DeepRecursion& e) {
    // yaml-cpp's parser gives up past its nesting limit with the message "bad file".
    throw ConfigError(source + ":" + std::to_string(e.mark.line + 1) + ":" +
                      std::to_string(e.mark.column + 1) + ": YAML nested more than " +
                      std::to_string(e.depth() - 1) +
                      " levels deep, past what the parser reads; a config nests three at most "
                      "(model: rope_scaling: factor: 8)");
  } catch (const YAML::ParserException& e) {
    throw ConfigError(source + ":" + std::to_string(e.mark.line + 1) + ":" +
                      std::to_string(e.mark.column + 1) + ": YAML syntax error: " + e.msg);
  }
}

// Applies one "section.key=value" to the tree; records where the value came from.
void apply_override(YAML::Node& root, const std::string& assignment,
                    std::map<std::string, std::string>& origins) {
  const std::string origin = "--set " + assignment;
  size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(origin + ": expected section.key=value, e.g. --set optim.lr=1e-3");
  std::string path = trim(assignment.substr(0, eq));
  std::string value_text = assignment.substr(eq + 1);
  if (!find_key(path) && !is_group(path)) unknown_key(path, origin);

  YAML::Node value;
  try {
    // One document: YAML::Load would read the first of several ("a\n---\nb") and drop the rest.
    const std::vector<YAML::Node> documents = YAML::LoadAll(value_text);
    if (documents.size() > 1)
      throw ConfigError(origin + ": the value holds " + std::to_string(documents.size()) +
                        " YAML documents (a line '---' separates them); give one value");
    if (!documents.empty()) value = documents.front();
  } catch (const YAML::ParserException& e) {
    throw ConfigError(origin + ": cannot read the value as YAML: " + e.msg);
  }
  // On a command line '#' is part of the value, not a YAML comment: --set
  // train.out_dir="runs/a #2" means all of it, not "runs/a". (A quoted value is YAML's own.)
  const std::string written = trim(value_text);
  const bool quoted = !written.empty() && (written.front() == '"' || written.front() == '\'');
  if (written.find('#') != std::string::npos && !quoted && !value.IsSequence() && !value.IsMap() &&
      (!value.IsScalar() || value.Scalar() != written))
    value = YAML::Node(written);
  // Walk down section and group mappings (created when the config lacks them) to the key.
  std::vector<std::string> parts;
  std::stringstream names(path);
  for (std::string part; std::getline(names, part, '.');) parts.push_back(part);
  std::function<void(YAML::Node, size_t)> set = [&](YAML::Node node, size_t i) {
    if (i + 1 == parts.size()) {
      node[parts[i]] = value;
      return;
    }
    YAML::Node child = node[parts[i]];
    if (child.IsDefined() && !child.IsNull() && !child.IsMap()) {
      std::string where_in = parts[0];
      for (size_t k = 1; k <= i; ++k) where_in += "." + parts[k];
      throw ConfigError(origin + ": cannot set it because '" + where_in +
                        "' in the config is not a mapping of keys");
    }
    set(child, i + 1);
  };
  set(root, 0);
  origins[path] = origin;
}

// "~" or "~/rest" with the home directory ($HOME) in place of the "~". Other paths, and these
// when HOME is not set, are returned as they are.
std::string expand_home(const std::string& path) {
  if (path.empty() || path[0] != '~' || (path.size() > 1 && path[1] != '/')) return path;
  const char* home = std::getenv("HOME");
  if (home == nullptr || *home == '\0') return path;
  return std::string(home) + path.substr(1);
}

struct Parsed {
  Config config;
  std::set<std::string> keys_given;
};

Parsed parse_tree(const std::string& text, const std::vector<std::string>& overrides,
                  const std::string& source) {
  YAML::Node root = load_yaml(text, source);
  if (root.IsNull() || !root.IsDefined()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap())
    throw ConfigError(source +
                      ": the top level must be a mapping of sections (model:, train:, "
                      "optim:, ...), found " +
                      node_kind(root));
  std::map<std::string, std::string> override_origins;
  for (const std::string& o : overrides) apply_override(root, o, override_origins);

  struct Found {
    const Key* key;
    YAML::Node value;
    std::string origin;
  };
  std::vector<Found> found;
  std::set<std::string> seen;
  auto take = [&](const std::string& path, const YAML::Node& name, const YAML::Node& value) {
    // An override of the key itself, or of the group holding it.
    const std::string group = path.substr(0, path.rfind('.'));
    std::string origin = override_origins.count(path) ? override_origins[path]
                         : override_origins.count(group)
                             ? override_origins[group]
                             : where(source, value.IsNull() ? name : value);
    const Key* key = find_key(path);
    if (!key) unknown_key(printable(path), where(source, name));
    if (!seen.insert(path).second) fail_at(where(source, name), path + " is given twice: keep one");
    found.push_back({key, value, origin});
  };

  for (const auto& top : root) {
    if (!top.first.IsScalar())
      fail_at(where(source, top.first),
              "config keys must be plain names, found " + show(top.first));
    std::string name = top.first.Scalar();
    if (!is_section(name)) {
      take(name, top.first, top.second);
      continue;
    }
    if (!seen.insert(name).second)
      fail_at(where(source, top.first), "section '" + name + "' is given twice: merge them");
    if (top.second.IsNull()) continue;  // an empty section
    if (!top.second.IsMap())
      fail_at(where(source, top.second),
              "'" + name + "' is a section and must hold its keys indented below it (such as " +
                  keys_in_section(name).front() + ": ...), found " + node_kind(top.second));
    for (const auto& entry : top.second) {
      if (!entry.first.IsScalar())
        fail_at(where(source, entry.first),
                "config keys must be plain names, found " + show(entry.first));
      const std::string path = name + "." + entry.first.Scalar();
      if (!is_group(path)) {
        take(path, entry.first, entry.second);
        continue;
      }
      if (!seen.insert(path).second)
        fail_at(where(source, entry.first), "'" + path + "' is given twice: merge them");
      if (entry.second.IsNull()) continue;  // an empty group (config.json writes null)
      if (!entry.second.IsMap())
        fail_at(override_origins.count(path) ? override_origins[path] : where(source, entry.second),
                "'" + path + "' is a group of keys and must hold them indented below it (such as " +
                    keys_in_group(path).front() + ": ...), found " + node_kind(entry.second));
      for (const auto& sub : entry.second) {
        if (!sub.first.IsScalar())
          fail_at(where(source, sub.first),
                  "config keys must be plain names, found " + show(sub.first));
        take(path + "." + sub.first.Scalar(), sub.first, sub.second);
      }
    }
  }

  Parsed parsed;
  for (const Found& f : found) {
    assign(*f.key, f.value, f.origin, parsed.config);
    parsed.keys_given.insert(f.key->path);
  }
  // A shell expands ~ only at the start of a word: not in a YAML file, nor in `--set
  // key=~/path`. Left as it is, train.out_dir: ~/runs would create a directory named "~".
  Config& paths = parsed.config;
  for (std::string* p : {&paths.train.out_dir, &paths.data.path, &paths.checkpoint.dir,
                         &paths.model.from_hf, &paths.lora.base_model, &paths.lora.init_from,
                         &paths.lora.adapter_out, &paths.train.resume})
    *p = expand_home(*p);
  // lora.base_model names the released weights the adapters are trained on: they are loaded
  // as model.from_hf loads them (one directory, named once).
  Config& c = parsed.config;
  if (!c.lora.base_model.empty()) {
    if (!c.lora.enabled)
      throw ConfigError("lora.base_model ('" + c.lora.base_model +
                        "') is the base of LoRA adapters, but lora.enabled is false: set "
                        "lora.enabled=true, or load full weights with model.from_hf");
    std::error_code ec;  // one directory may be named two ways (a trailing slash)
    const bool same_directory = std::filesystem::equivalent(c.model.from_hf, c.lora.base_model, ec);
    if (!c.model.from_hf.empty() && c.model.from_hf != c.lora.base_model && !same_directory)
      throw ConfigError("model.from_hf ('" + c.model.from_hf + "') and lora.base_model ('" +
                        c.lora.base_model +
                        "') name different base models: set one of them (lora.base_model "
                        "alone loads the base and records it in the adapter's config)");
    c.model.from_hf = c.lora.base_model;
  }
  if (!c.lora.init_from.empty() && !c.lora.enabled)
    throw ConfigError("lora.init_from ('" + c.lora.init_from +
                      "') starts LoRA adapters from a saved adapter, but lora.enabled is false: "
                      "set lora.enabled=true");
  validate_relations(parsed.config);
  return parsed;
}

// A key's current value as YAML text.
std::string value_text(const Key& key, const Config& config) {
  Config copy = config;  // the field accessor takes a mutable Config
  FieldRef field = key.field(copy);
  if (auto* b = std::get_if<bool*>(&field)) return **b ? "true" : "false";
  if (auto* i = std::get_if<int64_t*>(&field)) return std::to_string(**i);
  if (auto* d = std::get_if<double*>(&field)) return format_float(**d);
  if (auto* s = std::get_if<std::string*>(&field)) return yaml_string(**s);
  std::vector<std::string> items;
  for (const auto& item : *std::get<std::vector<std::string>*>(field))
    items.push_back(yaml_string(item));
  return "[" + join(items, ", ") + "]";
}

}  // namespace

Config Config::defaults() {
  return Config{};
}

Config Config::parse(const std::string& yaml_text, const std::vector<std::string>& overrides,
                     const std::string& source) {
  return parse_tree(yaml_text, overrides, source).config;
}

std::map<std::string, std::string> Config::values_away_from_defaults() const {
  const std::vector<std::pair<std::string, std::string>> values = key_values();
  const std::vector<std::pair<std::string, std::string>> defaults = Config().key_values();
  std::map<std::string, std::string> out;
  for (size_t i = 0; i < values.size(); ++i)  // both in schema order
    if (values[i].second != defaults[i].second) out.insert(values[i]);
  return out;
}

std::vector<std::string> Config::unused_settings() const {
  const std::map<std::string, std::string> changed = values_away_from_defaults();
  std::vector<std::string> out;
  // `keys` are not read when `unused` holds; `because` says why and how to make them count.
  auto rule = [&](bool unused, const std::vector<std::string>& keys, const std::string& because) {
    if (!unused) return;
    for (const std::string& key : keys) {
      if (find_key(key) == nullptr) throw std::logic_error("unused_settings: no key " + key);
      if (auto it = changed.find(key); it != changed.end())
        out.push_back(key + " = " + it->second + " has no effect: " + because);
    }
  };
  rule(optim.name == "sgd", {"optim.beta1", "optim.beta2", "optim.eps"},
       "it is an AdamW setting and optim.name is sgd");
  rule(optim.name == "adamw", {"optim.momentum"}, "it is an SGD setting and optim.name is adamw");
  // recipe: auto picks the precision, the activation strategy and the optimizer offload: a key
  // that waits for one of them may count in the configuration it picks.
  const bool recipe_picks = recipe == "auto";
  rule(!recipe_picks && optim.offload == "none", {"optim.offload_moments"},
       "it places offloaded optimizer state and optim.offload is none");
  rule(optim.schedule == "constant", {"optim.min_lr"},
       "optim.schedule is constant (the rate stays at optim.lr after warmup)");
  const bool loss_scaling = precision.loss_scale == "dynamic" ||
                            (precision.loss_scale == "auto" && precision.compute == "fp16");
  rule(!recipe_picks && !loss_scaling,
       {"precision.init_scale", "precision.growth_interval", "precision.growth_factor",
        "precision.backoff_factor"},
       "this run has no loss scaling (precision.loss_scale " + precision.loss_scale +
           " with precision.compute " + precision.compute + "; auto scales fp16 only)");
  rule(train.eval_every == 0, {"train.eval_batches"}, "train.eval_every is 0 (no evaluation)");
  const std::string& s = activation.strategy;
  rule(!recipe_picks && s == "none", {"activation.layers"}, "activation.strategy is none");
  rule(!recipe_picks && (s == "none" || s == "offload"), {"activation.checkpoint_impl"},
       "activation.strategy " + s + " recomputes nothing");
  rule(!recipe_picks && s != "offload" && s != "offload_checkpoint",
       {"activation.offload_min_bytes"}, "activation.strategy " + s + " offloads nothing");
  rule(activation.attention == "plain", {"activation.attention_backward"},
       "it chooses the fused attention's backward and activation.attention is plain");
  rule(!lora.enabled,
       {"lora.r", "lora.alpha", "lora.dropout", "lora.target_modules", "lora.quantize_base",
        "lora.adapter_out", "lora.merge_on_export"},
       "lora.enabled is false");
  return out;
}

std::vector<std::pair<std::string, std::string>> Config::key_values() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Key& key : schema()) out.emplace_back(key.path, value_text(key, *this));
  return out;
}

std::string Config::to_yaml() const {
  struct Line {
    std::string text, comment;
  };
  std::vector<Line> lines;
  std::string section, group;
  for (const Key& key : schema()) {
    if (key.section() != section) {
      section = key.section();
      group.clear();
      lines.push_back({section + ":", ""});
    }
    if (key.group() != group) {
      group = key.group();
      if (!group.empty()) lines.push_back({"  " + group.substr(group.rfind('.') + 1) + ":", ""});
    }
    std::string indent = section.empty() ? "" : group.empty() ? "  " : "    ";
    std::string comment = key.description;
    std::string allowed = key.allowed();
    if (!allowed.empty()) comment += "; " + allowed;
    lines.push_back({indent + key.name() + ": " + value_text(key, *this), comment});
  }
  size_t column = 0;
  for (const Line& l : lines)
    if (!l.comment.empty()) column = std::max(column, l.text.size());
  column = std::min<size_t>(column, 44);
  std::string out;
  for (const Line& l : lines) {
    out += l.text;
    if (!l.comment.empty())
      out += std::string(l.text.size() < column ? column - l.text.size() : 0, ' ') + "  # " +
             l.comment;
    out += "\n";
  }
  return out;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw ConfigError("config file '" + path + "' does not exist (try configs/tiny.yaml)");
  if (fs::is_directory(path, ec))
    throw ConfigError("config file '" + path + "' is a directory; give a .yaml file");
  // A FIFO would block the open, a device would be read for ever.
  check_regular_file(path, "config file");
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot open config file '" + path + "' for reading");
  std::stringstream text;
  text << in.rdbuf();
  // An empty file would train every default (a 133k-parameter model on the built-in corpus)
  // where the user meant a run of their own: a file cut short, or the wrong one.
  const YAML::Node root = load_yaml(text.str(), path);
  if (!root.IsDefined() || root.IsNull())
    throw ConfigError("config file '" + path +
                      "' holds no settings (it is empty or only comments): a run config names "
                      "at least its model and data; start from configs/tiny.yaml");
  Parsed parsed = parse_tree(text.str(), overrides, path);
  if (!parsed.keys_given.count("train.out_dir"))
    parsed.config.train.out_dir = "runs/" + fs::path(path).stem().string();
  // lora.base_model has become model.from_hf by now: errors name the key the user set.
  const bool base_model =
      !parsed.config.lora.base_model.empty() && !parsed.keys_given.count("model.from_hf");
  resolve_model_from_hf(parsed.config.model, parsed.keys_given,
                        base_model ? "lora.base_model" : "model.from_hf");
  return parsed.config;
}

std::string describe_config_keys() {
  const Config defaults;
  size_t path_width = 0, type_width = 0, default_width = 0;
  for (const Key& k : schema()) {
    path_width = std::max(path_width, k.path.size());
    type_width = std::max(type_width, k.type_name().size());
    default_width = std::max(default_width, value_text(k, defaults).size());
  }
  default_width = std::min<size_t>(default_width, 24);
  auto pad = [](std::string s, size_t w) {
    return s.size() < w ? s + std::string(w - s.size(), ' ') : s;
  };
  std::string out;
  for (const Key& k : schema()) {
    std::string allowed = k.allowed();
    out += pad(k.path, path_width) + "  " + pad(k.type_name(), type_width) + "  " +
           pad(value_text(k, defaults), default_width) + "  " + k.description +
           (allowed.empty() ? "" : "; " + allowed) + "\n";
  }
  return out;
}

}  // namespace shardtrain::train
