#include "shardtrain/io/peft.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/core/files.h"
#include "shardtrain/core/json_input.h"
#include "shardtrain/io/hf_model.h"

namespace shardtrain::io {

namespace {

using nlohmann::json;
using nlohmann::ordered_json;

// The NF4 weight behind a projection (itself or an adapter's base), or null.
nn::Nf4Linear* nf4_of(nn::Linear* linear) {
  if (auto* lora = dynamic_cast<nn::LoraLinear*>(linear)) linear = &lora->base();
  return dynamic_cast<nn::Nf4Linear*>(linear);
}

// A float as the short decimal a person wrote (0.05f -> 0.05, not 0.0500000007).
json decimal(float value) {
  if (std::nearbyint(value) == value && std::fabs(value) < 1e9f) return static_cast<int64_t>(value);
  char text[32];
  std::snprintf(text, sizeof text, "%.7g", static_cast<double>(value));
  return std::stod(text);
}

std::string config_path(const std::string& dir) {
  return (std::filesystem::path(dir) / kAdapterConfigFile).string();
}

}  // namespace

std::string peft_tensor_name(const std::string& module, bool lora_b) {
  return "base_model.model." + module + (lora_b ? ".lora_B.weight" : ".lora_A.weight");
}

// ---- save ------------------------------------------------------------------------------------

void save_peft_adapter(nn::LlamaModel& model, const std::string& dir,
                       const std::string& base_model) {
  auto modules = nn::lora_modules(model);
  ST_CHECK_AS(ConfigError, !modules.empty(),
              "save_peft_adapter: the model has no LoRA adapters (call apply_lora first)");
  const nn::LoraLinear& first = *modules.front().second;
  std::set<std::string> targeted;
  NamedTensors tensors;
  for (auto& [module, lora] : modules) {
    ST_CHECK(lora->rank() == first.rank() && lora->alpha() == first.alpha() &&
                 lora->dropout() == first.dropout(),
             "save_peft_adapter: ", module, " has r=", lora->rank(), " alpha=", lora->alpha(),
             " but ", modules.front().first, " has r=", first.rank(), " alpha=", first.alpha(),
             "; a PEFT adapter file holds one r and alpha");
    targeted.insert(module.substr(module.rfind('.') + 1));
    tensors.emplace_back(peft_tensor_name(module, false), lora->lora_A.detach());
    tensors.emplace_back(peft_tensor_name(module, true), lora->lora_B.detach());
  }
  std::vector<std::string> targets;
  for (const std::string& name : nn::lora_projection_names())
    if (targeted.count(name)) targets.push_back(name);

  create_output_dir(dir);
  save_safetensors((std::filesystem::path(dir) / kAdapterWeightsFile).string(), tensors,
                   {{"format", "pt"}});

  ordered_json config;
  config["peft_type"] = "LORA";
  config["task_type"] = "CAUSAL_LM";
  config["r"] = first.rank();
  config["lora_alpha"] = decimal(first.alpha());
  config["lora_dropout"] = decimal(first.dropout());
  config["target_modules"] = targets;
  config["base_model_name_or_path"] = base_model;
  config["bias"] = "none";
  config["fan_in_fan_out"] = false;
  config["inference_mode"] = true;
  config["init_lora_weights"] = true;
  config["modules_to_save"] = nullptr;
  config["revision"] = nullptr;
  config["use_rslora"] = false;
  config["use_dora"] = false;
  write_file_atomically(config_path(dir), config.dump(2) + "\n");
}

// ---- load ------------------------------------------------------------------------------------

nn::LoraOptions read_peft_config(const std::string& dir, std::string* base_model) {
  const std::string path = config_path(dir);
  check_regular_file(path, "PEFT adapter config");
  std::ifstream in(path);
  if (!in)
    throw ConfigError("cannot open '" + path + "': not a PEFT adapter directory (expected " +
                      kAdapterConfigFile + " and " + kAdapterWeightsFile + ")");
  json config;
  try {
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    config = parse_json_input(text);
  } catch (const std::exception& e) {
    throw FormatError("'" + path + "' is not valid JSON: " + e.what());
  }
  auto fail = [&](const std::string& key, const std::string& problem) {
    throw FormatError("'" + path + "': key '" + key + "' " + problem);
  };
  auto require = [&](const char* key) -> const json& {
    if (!config.contains(key)) fail(key, "is missing");
    return config[key];
  };
  auto flag = [&](const char* key) {
    return config.contains(key) && config[key].is_boolean() && config[key].get<bool>();
  };

  const json& type = require("peft_type");
  if (!type.is_string() || type.get<std::string>() != "LORA")
    fail("peft_type", "is " + type.dump() + "; only LORA adapters are supported");
  nn::LoraOptions options;
  const json& r = require("r");
  if (!r.is_number_integer() || r.get<int64_t>() < 1)
    fail("r", "must be a positive integer, got " + r.dump());
  options.r = r.get<int64_t>();
  const json& alpha = require("lora_alpha");
  if (!alpha.is_number() || alpha.get<double>() <= 0)
    fail("lora_alpha", "must be a positive number, got " + alpha.dump());
  options.alpha = alpha.get<float>();
  if (config.contains("lora_dropout") && !config["lora_dropout"].is_null()) {
    const json& d = config["lora_dropout"];
    if (!d.is_number() || d.get<double>() < 0 || d.get<double>() >= 1)
      fail("lora_dropout", "must be a number in [0, 1), got " + d.dump());
    options.dropout = d.get<float>();
  }
  const json& targets = require("target_modules");
  if (!targets.is_array() || targets.empty())
    fail("target_modules", "must be a non-empty list of projection names, got " + targets.dump());
  options.target_modules.clear();
  const auto& known = nn::lora_projection_names();
  for (const json& t : targets) {
    if (!t.is_string() ||
        std::find(known.begin(), known.end(), t.get<std::string>()) == known.end())
      fail("target_modules", "names " + t.dump() +
                                 "; supported are q_proj, k_proj, v_proj, o_proj, gate_proj, "
                                 "up_proj, down_proj");
    options.target_modules.push_back(t.get<std::string>());
  }
  if (flag("use_dora")) fail("use_dora", "is true; DoRA adapters are not supported");
  if (flag("use_rslora")) fail("use_rslora", "is true; rank-stabilised scaling is not supported");
  if (flag("fan_in_fan_out")) fail("fan_in_fan_out", "is true; Llama projections are not Conv1D");
  if (config.contains("bias") && config["bias"] != "none")
    fail("bias", "is " + config["bias"].dump() + "; only \"none\" is supported");
  for (const auto& [key, what] :
       {std::pair<const char*, const char*>{"rank_pattern", "ranks"}, {"alpha_pattern", "alphas"}})
    if (config.contains(key) && !config[key].is_null() && !config[key].empty())
      fail(key, std::string("is set; per-module ") + what + " are not supported");
  for (const char* key : {"layers_to_transform", "modules_to_save"})
    if (config.contains(key) && !config[key].is_null())
      fail(key, "is set; only adapters on every layer's projections are supported");
  const json& base =
      config.contains("base_model_name_or_path") ? config["base_model_name_or_path"] : json();
  // null (PEFT writes it for a model built in memory) records no base; a number or a list is a
  // damaged file, not a missing name.
  if (!base.is_null() && !base.is_string())
    fail("base_model_name_or_path", "must be a string or null, got " + base.dump());
  if (base_model != nullptr) *base_model = base.is_string() ? base.get<std::string>() : "";
  return options;
}

void load_peft_adapter(nn::LlamaModel& model, const std::string& dir) {
  const nn::LoraOptions config = read_peft_config(dir);
  auto modules = nn::lora_modules(model);
  ST_CHECK_AS(ConfigError, !modules.empty(), "load_peft_adapter: the model has no LoRA adapters ",
              "to load '", dir, "' into (call apply_lora with the adapter's options first)");
  const std::string cfg = config_path(dir);
  const std::string weights = (std::filesystem::path(dir) / kAdapterWeightsFile).string();
  for (auto& [module, lora] : modules) {
    ST_CHECK_AS(FormatError, lora->rank() == config.r, "'", cfg, "' has r=", config.r, " but ",
                module, " has an adapter of rank ", lora->rank());
    ST_CHECK_AS(FormatError, std::fabs(lora->alpha() - config.alpha) <= 1e-6f * config.alpha, "'",
                cfg, "' has lora_alpha=", config.alpha, " but ", module, " has alpha ",
                lora->alpha());
  }
  SafetensorsFile file = SafetensorsFile::open(weights);
  // Everything is checked before anything is copied, so a failed load leaves the model as it was.
  std::vector<std::pair<std::string, Tensor*>> slots;
  std::set<std::string> expected;
  for (auto& [module, lora] : modules) {
    for (bool b : {false, true}) {
      const std::string name = peft_tensor_name(module, b);
      Tensor& slot = b ? lora->lora_B : lora->lora_A;
      expected.insert(name);
      if (!file.contains(name))
        throw FormatError("'" + weights + "' has no tensor '" + name +
                          "' (was the adapter trained with other target_modules?)");
      const TensorInfo& info = file.info(name);
      if (!is_floating(info.dtype))
        throw FormatError("'" + weights + "': tensor '" + name + "' is stored as " +
                          std::string(safetensors_dtype_name(info.dtype)) +
                          ", an integer type; adapter weights must be F32, BF16 or F16 (a wrongly "
                          "converted or mislabelled file)");
      if (info.shape != slot.shape())
        throw FormatError("'" + weights + "': tensor '" + name + "' has shape " +
                          shape_str(info.shape) + " but the model's adapter is " +
                          shape_str(slot.shape()) + " (a different base model or rank?)");
      slots.emplace_back(name, &slot);
    }
  }
  for (const std::string& name : file.names())
    if (!expected.count(name))
      throw FormatError("'" + weights + "' has tensor '" + name +
                        "' that no adapter of this model takes (different target_modules or "
                        "number of layers?)");
  autograd::NoGrad no_grad;
  // Read and checked whole before any adapter changes: a NaN or infinity would surface steps
  // later as a diverged loss (the sum of squares of finite weights stays finite in double).
  std::vector<Tensor> loaded;
  for (auto& [name, slot] : slots) {
    loaded.push_back(empty(slot->shape(), slot->dtype(), slot->device()));
    file.load_into(name, loaded.back());
    if (!std::isfinite(backend_for(slot->device()).sum_squares(loaded.back())))
      throw FormatError("'" + weights + "': tensor '" + name +
                        "' holds NaN or infinite values (a damaged or wrongly converted file)");
  }
  for (size_t i = 0; i < slots.size(); ++i) slots[i].second->copy_from(loaded[i]);
}

// ---- merged export ----------------------------------------------------------------------------

void save_merged_hf_model(nn::LlamaModel& model, const std::string& dir, DType dtype,
                          int64_t max_shard_bytes) {
  autograd::NoGrad no_grad;
  CategoryScope workspace(MemoryCategory::Workspace);
  NamedTensors tensors;
  auto add = [&](const std::string& name, const Tensor& t) {
    Tensor out = weight_for_export(name, t, dtype);
    tensors.emplace_back(name, out.device().is_host() ? out : out.to(Device::host()));
  };
  add("model.embed_tokens.weight", model.embed_tokens.weight);
  auto projs = nn::decoder_projections(model);
  size_t next = 0;
  for (int l = 0; l < model.num_layers(); ++l) {
    nn::DecoderLayer& layer = *model.layers[static_cast<size_t>(l)];
    const std::string prefix = "model.layers." + std::to_string(l) + ".";
    add(prefix + "input_layernorm.weight", layer.input_layernorm.weight);
    add(prefix + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight);
    for (size_t p = 0; p < nn::lora_projection_names().size(); ++p, ++next)
      add(projs[next].first + ".weight", nn::dense_weight(*projs[next].second));
  }
  add("model.norm.weight", model.norm.weight);
  if (model.lm_head) add("lm_head.weight", nn::dense_weight(*model.lm_head));

  create_output_dir(dir);
  save_sharded(dir, tensors, max_shard_bytes, {{"format", "pt"}});
  write_file_atomically((std::filesystem::path(dir) / "config.json").string(),
                        model.config().to_hf_json(dtype) + "\n");
}

// ---- NF4 in safetensors -----------------------------------------------------------------------

void append_nf4(NamedTensors& out, const std::string& name, const nn::Nf4Tensor& tensor) {
  tensor.validate("append_nf4: '" + name + "'");
  out.emplace_back(name + ".nf4.codes", tensor.codes);
  out.emplace_back(name + ".nf4.absmax", tensor.absmax_q);
  out.emplace_back(name + ".nf4.absmax_scale", tensor.absmax_scale);
  out.emplace_back(name + ".nf4.absmax_offset",
                   from_floats({tensor.absmax_offset}, {1}, DType::F32, Device::host()));
  out.emplace_back(
      name + ".nf4.shape",
      from_ints(std::vector<int64_t>(tensor.shape.begin(), tensor.shape.end()),
                {static_cast<int64_t>(tensor.shape.size())}, DType::I64, Device::host()));
}

nn::Nf4Tensor read_nf4(const SafetensorsFile& file, const std::string& name, Device device) {
  auto piece = [&](const char* suffix) {
    const std::string full = name + ".nf4." + suffix;
    if (!file.contains(full))
      throw FormatError("'" + file.path() + "' has no tensor '" + full +
                        "' (an NF4 weight is stored as .nf4.codes, .nf4.absmax, "
                        ".nf4.absmax_scale, .nf4.absmax_offset and .nf4.shape)");
    return full;
  };
  nn::Nf4Tensor q;
  const std::string shape_name = piece("shape"), offset_name = piece("absmax_offset");
  if (file.info(shape_name).dtype != DType::I64 || file.info(offset_name).dtype != DType::F32 ||
      numel(file.info(offset_name).shape) != 1)
    throw FormatError("'" + file.path() + "': '" + shape_name + "' must be I64 and '" +
                      offset_name + "' a single F32");
  const std::vector<int64_t> shape = file.load(shape_name, Device::host()).to_int_vector();
  q.shape.assign(shape.begin(), shape.end());
  q.absmax_offset = file.load(offset_name, Device::host()).item();
  {
    CategoryScope as_parameters(MemoryCategory::Parameters);
    q.codes = file.load(piece("codes"), device);
    q.absmax_q = file.load(piece("absmax"), device);
    q.absmax_scale = file.load(piece("absmax_scale"), device);
  }
  q.validate("'" + file.path() + "' tensor '" + name + "'");
  return q;
}

void save_nf4_base(nn::LlamaModel& model, const std::string& path) {
  NamedTensors tensors;
  for (auto& [module, linear] : nn::decoder_projections(model))
    if (nn::Nf4Linear* q = nf4_of(linear))
      append_nf4(tensors, module + ".weight", q->quantized_weight());
  ST_CHECK_AS(ConfigError, !tensors.empty(), "save_nf4_base: the model has no NF4 projections ",
              "(apply_lora with quantize_base nf4 first)");
  save_safetensors(path, tensors, {{"format", "shardtrain-nf4"}});
}

void load_nf4_base(nn::LlamaModel& model, const std::string& path) {
  SafetensorsFile file = SafetensorsFile::open(path);
  std::set<std::string> expected;
  for (auto& [module, linear] : nn::decoder_projections(model)) {
    nn::Nf4Linear* q = nf4_of(linear);
    if (q == nullptr) continue;
    const std::string name = module + ".weight";
    for (const char* suffix : {"codes", "absmax", "absmax_scale", "absmax_offset", "shape"})
      expected.insert(name + ".nf4." + suffix);
    nn::Nf4Tensor loaded = read_nf4(file, name, model.device());
    if (loaded.shape != q->quantized_weight().shape)
      throw FormatError("'" + path + "': NF4 weight '" + name + "' has shape " +
                        shape_str(loaded.shape) + " but the model's is " +
                        shape_str(q->quantized_weight().shape));
    q->set_quantized_weight(std::move(loaded));
  }
  ST_CHECK_AS(ConfigError, !expected.empty(), "load_nf4_base: the model has no NF4 projections ",
              "to load '", path, "' into (apply_lora with quantize_base nf4 first)");
  for (const std::string& name : file.names())
    if (!expected.count(name))
      throw FormatError("'" + path + "' has tensor '" + name +
                        "' that this model's NF4 projections do not (a different model shape?)");
}

}  // namespace shardtrain::io
