#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "shardtrain/core/files.h"
#include "shardtrain/core/json_input.h"
#include "shardtrain/nn/llama.h"

namespace shardtrain::nn {

void LlamaConfig::validate(FieldNames names) const {
  auto fail = [names](const std::string& what) {
    throw ConfigError((names == FieldNames::RunConfig ? "model: " : "") + what);
  };
  // A field's name where the values came from.
  auto field = [names](const std::string& name) -> std::string {
    if (names == FieldNames::RunConfig) return name;
    static const std::pair<const char*, const char*> hf[] = {
        {"num_layers", "num_hidden_layers"},
        {"num_heads", "num_attention_heads"},
        {"num_kv_heads", "num_key_value_heads"},
        {"max_seq_len", "max_position_embeddings"}};
    for (const auto& [ours, theirs] : hf)
      if (name == ours) return theirs;
    return name;
  };
  if (vocab_size <= 0 || hidden_size <= 0 || intermediate_size <= 0 || num_layers <= 0 ||
      num_heads <= 0 || num_kv_heads <= 0)
    fail(field("vocab_size") + ", " + field("hidden_size") + ", " + field("intermediate_size") +
         ", " + field("num_layers") + ", " + field("num_heads") + " and " + field("num_kv_heads") +
         " must all be positive");
  const std::pair<const char*, std::pair<int64_t, int64_t>> limits[] = {
      {"vocab_size", {vocab_size, kMaxVocabSize}},
      {"hidden_size", {hidden_size, kMaxHiddenSize}},
      {"intermediate_size", {intermediate_size, kMaxIntermediateSize}},
      {"num_layers", {num_layers, kMaxLayers}},
      {"num_heads", {num_heads, kMaxHeads}},
      {"num_kv_heads", {num_kv_heads, kMaxHeads}},
      {"max_seq_len", {max_seq_len, kMaxSeqLen}}};
  for (const auto& [name, value_and_limit] : limits)
    if (value_and_limit.first > value_and_limit.second)
      fail(field(name) + " = " + std::to_string(value_and_limit.first) +
           " is larger than this runtime allows (" + std::to_string(value_and_limit.second) +
           "): no model is that large; check the value");
  if (hidden_size % num_heads != 0)
    fail("hidden_size " + std::to_string(hidden_size) + " is not divisible by " +
         field("num_heads") + " " + std::to_string(num_heads));
  if (num_heads % num_kv_heads != 0)
    fail(field("num_heads") + " " + std::to_string(num_heads) + " is not a multiple of " +
         field("num_kv_heads") + " " + std::to_string(num_kv_heads));
  if (head_dim() % 2 != 0)
    fail("head dimension hidden_size/" + field("num_heads") + " = " + std::to_string(head_dim()) +
         " must be even for rotary embeddings");
  if (!(rms_norm_eps > 0)) fail("rms_norm_eps must be positive");
  if (!(rope_theta > 0)) fail("rope_theta must be positive");
  if (rope_scaling) {
    const std::string problem = llama3_rope_scaling_problem(*rope_scaling);
    if (!problem.empty()) fail("rope_scaling: " + problem);
  }
}

namespace {

using nlohmann::json;

// Reads one config.json. Every error names the file, the field and the value.
class HfConfigReader {
 public:
  HfConfigReader(const json& j, std::string path) : j_(j), path_(std::move(path)) {}

  FormatError error(const std::string& what) const {
    return FormatError("'" + path_ + "': " + what);
  }

  // The field's value; null when it is absent or JSON null (transformers' default applies).
  const json* find(const json& object, const std::string& key) const {
    auto it = object.find(key);
    return it == object.end() || it->is_null() ? nullptr : &*it;
  }
  const json& need(const std::string& key) const {
    const json* v = find(j_, key);
    if (v == nullptr) throw error("has no field '" + key + "' (a Llama config.json needs it)");
    return *v;
  }
  // A whole number, as JSON writes it (32, not 32.0 or 32.5): transformers builds the layers
  // from these and would fail on anything else.
  int64_t integer(const std::string& field, const json& v) const {
    if (v.is_number_integer() &&
        !(v.is_number_unsigned() &&
          v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())))
      return v.get<int64_t>();
    if (v.is_number())
      throw error(field + " = " + v.dump() + " is not a whole number (an integer is needed)");
    throw error(field + " = " + v.dump() + " has the wrong type: expected a whole number");
  }
  // A number the model keeps in fp32: one that becomes infinite or zero there is refused, as the
  // run config's keys are (rope_theta 1e39 would be inf, rms_norm_eps 1e-50 zero).
  double number(const std::string& field, const json& v) const {
    if (!v.is_number())
      throw error(field + " = " + v.dump() + " has the wrong type: expected a number");
    const double d = v.get<double>();
    const auto f = static_cast<float>(d);
    if (!std::isfinite(f) || (d != 0 && f == 0))
      throw error(field + " = " + v.dump() +
                  " is outside fp32's range (magnitudes from about 1.4e-45 to 3.4e38), in which "
                  "the model keeps it");
    return d;
  }
  bool boolean(const std::string& field, const json& v) const {
    if (!v.is_boolean())
      throw error(field + " = " + v.dump() + " has the wrong type: expected true or false");
    return v.get<bool>();
  }
  std::string string(const std::string& field, const json& v) const {
    if (!v.is_string())
      throw error(field + " = " + v.dump() + " has the wrong type: expected a string");
    return v.get<std::string>();
  }

  int64_t integer(const std::string& key) const { return integer(key, need(key)); }
  int64_t integer_or(const std::string& key, int64_t fallback) const {
    const json* v = find(j_, key);
    return v == nullptr ? fallback : integer(key, *v);
  }
  float number_or(const std::string& key, float fallback) const {
    const json* v = find(j_, key);
    return v == nullptr ? fallback : static_cast<float>(number(key, *v));
  }
  bool boolean_or(const std::string& key, bool fallback) const {
    const json* v = find(j_, key);
    return v == nullptr ? fallback : boolean(key, *v);
  }

  // A string field that, when present, must have the one value this implementation computes.
  void expect_string(const std::string& key, const std::string& supported,
                     const std::string& why) const {
    const json* v = find(j_, key);
    if (v == nullptr) return;
    std::string value = string(key, *v);
    if (value != supported)
      throw error(key + " = " + v->dump() + " is not supported: only \"" + supported + "\" is (" +
                  why + ")");
  }
  // A boolean field that, when present, must be false.
  void expect_false(const std::string& key, const std::string& why) const {
    const json* v = find(j_, key);
    if (v != nullptr && boolean(key, *v))
      throw error(key + " = true is not supported (" + why + ")");
  }

  // The rotary embedding's base and scaling. Transformers before version 5 write them as
  // top-level rope_theta and rope_scaling; version 5 writes one object, rope_parameters, that
  // holds rope_theta and the scaling's fields. Either form is read; a file with both must say
  // the same thing in each.
  struct Rope {
    float theta = 10000.0f;
    std::optional<Llama3RopeScaling> scaling;
  };
  Rope rope() const {
    // Either form may say that only part of each head rotates, which this model does not do.
    auto refuse_partial_rotation = [&](const json& object, const std::string& prefix) {
      if (const json* factor = find(object, "partial_rotary_factor"))
        if (number(prefix + "partial_rotary_factor", *factor) != 1.0)
          throw error(prefix + "partial_rotary_factor = " + factor->dump() +
                      " is not supported: the rotary embedding turns every dimension of a head");
    };
    const json* top_theta = find(j_, "rope_theta");
    const json* legacy = find(j_, "rope_scaling");
    refuse_partial_rotation(j_, "");
    Rope legacy_rope;
    if (top_theta != nullptr)
      legacy_rope.theta = static_cast<float>(number("rope_theta", *top_theta));
    if (legacy != nullptr) legacy_rope.scaling = scaling_from(*legacy, "rope_scaling", false);
    const json* params = find(j_, "rope_parameters");
    if (params == nullptr) return legacy_rope;

    if (!params->is_object())
      throw error("rope_parameters = " + params->dump() +
                  " has the wrong type: expected an object or null");
    if (find(*params, "rope_type") == nullptr && find(*params, "rope_theta") == nullptr &&
        !params->empty() && params->begin()->is_object())
      throw error("rope_parameters holds one set per attention type (" + params->begin().key() +
                  ", ...): per-layer RoPE is not supported, a Llama has one set");
    Rope rope;
    const json* params_theta = find(*params, "rope_theta");
    if (params_theta != nullptr)
      rope.theta = static_cast<float>(number("rope_parameters.rope_theta", *params_theta));
    refuse_partial_rotation(*params, "rope_parameters.");
    rope.scaling = scaling_from(*params, "rope_parameters", true);
    if (top_theta != nullptr && legacy_rope.theta != rope.theta)
      throw error(
          "rope_theta = " + top_theta->dump() + " and rope_parameters.rope_theta = " +
          (params_theta != nullptr ? params_theta->dump() : std::string("(absent: 10000)")) +
          " disagree: keep one of them (Transformers 5 reads rope_parameters)");
    if (legacy != nullptr && legacy_rope.scaling != rope.scaling)
      throw error(
          "rope_scaling and rope_parameters describe different RoPE scaling: keep one "
          "of them (Transformers 5 reads rope_parameters)");
    return rope;
  }

  // The scaling named by an object's rope_type (older files say "type"): "default" is plain
  // RoPE, "llama3" Llama-3 frequency scaling, anything else is refused. rope_parameters may
  // leave the type out for plain RoPE; rope_scaling must name it.
  std::optional<Llama3RopeScaling> scaling_from(const json& rs, const std::string& name,
                                                bool type_may_be_absent) const {
    if (!rs.is_object())
      throw error(name + " = " + rs.dump() + " has the wrong type: expected an object or null");
    const char* type_key = find(rs, "rope_type") != nullptr ? "rope_type" : "type";
    const json* type = find(rs, type_key);
    if (type == nullptr) {
      if (type_may_be_absent && find(rs, "factor") == nullptr) return std::nullopt;
      throw error(name + " has no rope_type (nor type): cannot tell which scaling it means");
    }
    const std::string field = name + "." + type_key;
    const std::string rope_type = string(field, *type);
    if (rope_type == "default") return std::nullopt;
    if (rope_type != "llama3")
      throw error(field + " = " + type->dump() +
                  " is not supported: only \"llama3\" RoPE scaling (Llama-3.1 and 3.2) is "
                  "implemented");
    auto required = [&](const std::string& key) -> const json& {
      const json* v = find(rs, key);
      if (v == nullptr) throw error(name + " has no field '" + key + "' (llama3 scaling needs it)");
      return *v;
    };
    Llama3RopeScaling s;
    s.factor = number(name + ".factor", required("factor"));
    s.low_freq_factor = number(name + ".low_freq_factor", required("low_freq_factor"));
    s.high_freq_factor = number(name + ".high_freq_factor", required("high_freq_factor"));
    s.original_max_position_embeddings = integer(name + ".original_max_position_embeddings",
                                                 required("original_max_position_embeddings"));
    const std::string problem = llama3_rope_scaling_problem(s);
    if (!problem.empty()) throw error(name + ": " + problem);
    return s;
  }

 private:
  const json& j_;
  std::string path_;
};

}  // namespace

LlamaConfig LlamaConfig::from_hf_json(const std::string& path) {
  check_regular_file(path, "model config");
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot open model config '" + path + "'");
  json j;
  try {
    // Parsed whole: text after the object is an error too (a file cut and pasted together).
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    j = parse_json_input(text);
  } catch (const std::exception& e) {
    throw FormatError("'" + path + "' is not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw FormatError("'" + path + "' is not a JSON object");
  const HfConfigReader r(j, path);
  r.expect_string("model_type", "llama", "this is a Llama implementation");
  r.expect_string("hidden_act", "silu", "the MLP is SwiGLU with SiLU");
  r.expect_false("attention_bias", "the attention projections have no bias");
  r.expect_false("mlp_bias", "the MLP projections have no bias");
  if (const double dropout = r.number_or("attention_dropout", 0.0f); dropout != 0.0)
    throw r.error("attention_dropout = " + (std::ostringstream() << dropout).str() +
                  " is not supported: the attention has no dropout (released Llama configs say "
                  "0.0)");

  LlamaConfig c;
  c.vocab_size = r.integer("vocab_size");
  c.hidden_size = r.integer("hidden_size");
  c.intermediate_size = r.integer("intermediate_size");
  c.num_layers = r.integer("num_hidden_layers");
  c.num_heads = r.integer("num_attention_heads");
  c.num_kv_heads = r.integer_or("num_key_value_heads", c.num_heads);
  c.rms_norm_eps = r.number_or("rms_norm_eps", 1e-6f);
  const auto rope = r.rope();
  c.rope_theta = rope.theta;
  c.rope_scaling = rope.scaling;
  c.tie_embeddings = r.boolean_or("tie_word_embeddings", false);
  c.max_seq_len = r.integer_or("max_position_embeddings", 2048);
  c.init_std = r.number_or("initializer_range", 0.02f);
  const int64_t head_dim = r.integer_or("head_dim", 0);
  // Compared by division: a huge head_dim times the heads could wrap around to hidden_size.
  if (head_dim != 0 && (c.num_heads <= 0 || c.hidden_size % c.num_heads != 0 ||
                        head_dim != c.hidden_size / c.num_heads))
    throw r.error("head_dim = " + std::to_string(head_dim) +
                  " with num_attention_heads = " + std::to_string(c.num_heads) +
                  " does not give hidden_size = " + std::to_string(c.hidden_size) +
                  ": head_dim * num_attention_heads != hidden_size is not supported");
  try {
    c.validate(FieldNames::HfConfigJson);
  } catch (const ConfigError& e) {
    throw ConfigError("'" + path + "' describes a model this runtime cannot build: " + e.what());
  }
  return c;
}

namespace {
// The shortest decimal that reads back as `value` in fp32: config.json then says 1e-05, not the
// float's exact double 9.999999747378752e-06.
double shortest_decimal(float value) {
  char text[32];
  const auto result = std::to_chars(text, text + sizeof text, value);
  return std::strtod(std::string(text, result.ptr).c_str(), nullptr);
}
}  // namespace

std::string LlamaConfig::to_hf_json(DType weights) const {
  ST_CHECK_AS(ConfigError, weights == DType::F32 || weights == DType::BF16 || weights == DType::F16,
              "config.json describes floating-point weights (f32, bf16 or f16), not ",
              dtype_name(weights));
  json scaling = nullptr;
  if (rope_scaling)
    scaling = {
        {"rope_type", "llama3"},
        {"factor", rope_scaling->factor},
        {"low_freq_factor", rope_scaling->low_freq_factor},
        {"high_freq_factor", rope_scaling->high_freq_factor},
        {"original_max_position_embeddings", rope_scaling->original_max_position_embeddings}};
  json j = {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"mlp_bias", false},
            {"vocab_size", vocab_size},
            {"hidden_size", hidden_size},
            {"intermediate_size", intermediate_size},
            {"num_hidden_layers", num_layers},
            {"num_attention_heads", num_heads},
            {"num_key_value_heads", num_kv_heads},
            {"rms_norm_eps", shortest_decimal(rms_norm_eps)},
            {"rope_theta", shortest_decimal(rope_theta)},
            {"rope_scaling", scaling},
            {"tie_word_embeddings", tie_embeddings},
            {"max_position_embeddings", max_seq_len},
            {"initializer_range", shortest_decimal(init_std)},
            {"torch_dtype", weights == DType::F32    ? "float32"
                            : weights == DType::BF16 ? "bfloat16"
                                                     : "float16"}};
  return j.dump(2);
}

int64_t LlamaConfig::num_parameters() const {
  int64_t h = hidden_size, kv = num_kv_heads * head_dim();
  int64_t per_layer = h * h * 2 + h * kv * 2 + 3 * h * intermediate_size + 2 * h;
  return vocab_size * h * (tie_embeddings ? 1 : 2) + num_layers * per_layer + h;
}

}  // namespace shardtrain::nn
