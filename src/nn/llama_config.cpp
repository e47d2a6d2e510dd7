#include <fstream>
#include <nlohmann/json.hpp>

#include "shardtrain/nn/llama.h"

namespace shardtrain::nn {

void LlamaConfig::validate() const {
  auto fail = [](const std::string& what) { throw ConfigError("model: " + what); };
  if (vocab_size <= 0 || hidden_size <= 0 || intermediate_size <= 0 || num_layers <= 0 ||
      num_heads <= 0 || num_kv_heads <= 0)
    fail(
        "vocab_size, hidden_size, intermediate_size, num_layers, num_heads and num_kv_heads "
        "must all be positive");
  if (hidden_size % num_heads != 0)
    fail("hidden_size " + std::to_string(hidden_size) + " is not divisible by num_heads " +
         std::to_string(num_heads));
  if (num_heads % num_kv_heads != 0)
    fail("num_heads " + std::to_string(num_heads) + " is not a multiple of num_kv_heads " +
         std::to_string(num_kv_heads));
  if (head_dim() % 2 != 0)
    fail("head dimension hidden_size/num_heads = " + std::to_string(head_dim()) +
         " must be even for rotary embeddings");
  if (!(rms_norm_eps > 0)) fail("rms_norm_eps must be positive");
  if (!(rope_theta > 0)) fail("rope_theta must be positive");
  if (rope_scaling) {
    const std::string problem = llama3_rope_scaling_problem(*rope_scaling);
    if (!problem.empty()) fail("rope_scaling: " + problem);
  }
}

LlamaConfig LlamaConfig::from_hf_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot open model config '" + path + "'");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    throw FormatError("'" + path + "' is not valid JSON: " + e.what());
  }
  LlamaConfig c;
  auto need = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key))
      throw FormatError("'" + path + "' has no field '" + key + "' (a Llama config.json needs it)");
    return j.at(key);
  };
  try {
    c.vocab_size = need("vocab_size").get<int64_t>();
    c.hidden_size = need("hidden_size").get<int64_t>();
    c.intermediate_size = need("intermediate_size").get<int64_t>();
    c.num_layers = need("num_hidden_layers").get<int64_t>();
    c.num_heads = need("num_attention_heads").get<int64_t>();
    c.num_kv_heads = j.value("num_key_value_heads", c.num_heads);
    c.rms_norm_eps = j.value("rms_norm_eps", 1e-6f);
    c.rope_theta = j.value("rope_theta", 10000.0f);
    c.tie_embeddings = j.value("tie_word_embeddings", false);
    c.max_seq_len = j.value("max_position_embeddings", int64_t{2048});
    c.init_std = j.value("initializer_range", 0.02f);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError("'" + path + "': a field has the wrong type: " + e.what());
  }
  if (j.contains("head_dim") && j["head_dim"].is_number_integer() &&
      j["head_dim"].get<int64_t>() * c.num_heads != c.hidden_size)
    throw FormatError("'" + path +
                      "': head_dim * num_attention_heads != hidden_size is not "
                      "supported");
  c.validate();
  return c;
}

std::string LlamaConfig::to_hf_json() const {
  nlohmann::json j = {{"architectures", {"LlamaForCausalLM"}},
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
                      {"rms_norm_eps", rms_norm_eps},
                      {"rope_theta", rope_theta},
                      {"tie_word_embeddings", tie_embeddings},
                      {"max_position_embeddings", max_seq_len},
                      {"initializer_range", init_std},
                      {"torch_dtype", "float32"}};
  return j.dump(2);
}

int64_t LlamaConfig::num_parameters() const {
  int64_t h = hidden_size, kv = num_kv_heads * head_dim();
  int64_t per_layer = h * h * 2 + h * kv * 2 + 3 * h * intermediate_size + 2 * h;
  return vocab_size * h * (tie_embeddings ? 1 : 2) + num_layers * per_layer + h;
}

}  // namespace shardtrain::nn
