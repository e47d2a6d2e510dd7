// Hugging Face config.json: what LlamaConfig::from_hf_json accepts and refuses (every refusal a
// FormatError naming the file, the field and the value), Llama-3 rope_scaling read, written
// back by to_hf_json and used by the model, and a run config that contradicts the config.json
// of model.from_hf.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "expect_error.h"
#include "files.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/train/config.h"
#include "shardtrain/train/runtime.h"
#include "temp_dir.h"

namespace shardtrain {
namespace {

using nlohmann::json;
using testing::expect_error;
using testing::TempDir;

// A small Llama-3.2-style config.json (head dim 16, llama3 scaling with factor 32).
json small_llama3() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"vocab_size", 64},
          {"hidden_size", 32},
          {"intermediate_size", 48},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 2},
          {"num_key_value_heads", 1},
          {"head_dim", 16},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 500000.0},
          {"rope_scaling",
           {{"rope_type", "llama3"},
            {"factor", 32.0},
            {"low_freq_factor", 1.0},
            {"high_freq_factor", 4.0},
            {"original_max_position_embeddings", 8192}}},
          {"tie_word_embeddings", true},
          {"max_position_embeddings", 131072},
          {"initializer_range", 0.02}};
}

std::string write_config(const TempDir& dir, const json& j) {
  return dir.write("config.json", j.dump(2));
}

nn::LlamaConfig read(const TempDir& dir, const json& j) {
  return nn::LlamaConfig::from_hf_json(write_config(dir, j));
}

// Expects from_hf_json of `j` to fail with a FormatError naming the file and every part.
void expect_refused(const json& j, std::initializer_list<std::string> parts) {
  TempDir dir("hf-config");
  const std::string path = write_config(dir, j);
  SCOPED_TRACE(j.dump());
  expect_error<FormatError>([&] { nn::LlamaConfig::from_hf_json(path); }, {"'" + path + "'"});
  expect_error<FormatError>([&] { nn::LlamaConfig::from_hf_json(path); }, parts);
}

TEST(HfConfig, ReadsLlama3RopeScaling) {
  TempDir dir("hf-config");
  nn::LlamaConfig c = read(dir, small_llama3());
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(*c.rope_scaling, (Llama3RopeScaling{32.0, 1.0, 4.0, 8192}));
  EXPECT_EQ(c.rope_theta, 500000.0f);
  EXPECT_EQ(c.head_dim(), 16);
  EXPECT_EQ(c.max_seq_len, 131072);
  EXPECT_EQ(c.rope_params(), (RopeParams{500000.0f, Llama3RopeScaling{32.0, 1.0, 4.0, 8192}}));

  // Older files name the type "type"; "default" and null mean plain RoPE.
  json j = small_llama3();
  j["rope_scaling"].erase("rope_type");
  j["rope_scaling"]["type"] = "llama3";
  EXPECT_EQ(read(dir, j).rope_scaling, c.rope_scaling);
  j["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_FALSE(read(dir, j).rope_scaling.has_value());
  j["rope_scaling"] = nullptr;
  EXPECT_FALSE(read(dir, j).rope_scaling.has_value());
  j.erase("rope_scaling");
  EXPECT_FALSE(read(dir, j).rope_scaling.has_value());
  // Fields that may be absent take transformers' defaults.
  for (const char* key : {"model_type", "hidden_act", "attention_bias", "mlp_bias", "head_dim"})
    j.erase(key);
  EXPECT_EQ(read(dir, j).hidden_size, 32);
}

// Transformers 5 writes rope_theta and the scaling inside one object, rope_parameters.
json in_transformers5_form(json j) {
  json params = j.contains("rope_scaling") && !j["rope_scaling"].is_null()
                    ? j["rope_scaling"]
                    : json{{"rope_type", "default"}};
  params["rope_theta"] = j.value("rope_theta", 10000.0);
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = params;
  return j;
}

TEST(HfConfig, ReadsTransformers5RopeParameters) {
  TempDir dir("hf-config");
  const nn::LlamaConfig legacy = read(dir, small_llama3());
  const json v5 = in_transformers5_form(small_llama3());
  nn::LlamaConfig c = read(dir, v5);
  EXPECT_EQ(c.rope_params(), legacy.rope_params());
  EXPECT_EQ(c.rope_theta, 500000.0f);

  // Plain RoPE with another base: the base is not the default 10000.
  json plain = small_llama3();
  plain.erase("rope_scaling");
  plain["rope_theta"] = 250000.0;
  c = read(dir, in_transformers5_form(plain));
  EXPECT_EQ(c.rope_theta, 250000.0f);
  EXPECT_FALSE(c.rope_scaling.has_value());
  // rope_type may be left out for plain RoPE.
  json untyped = in_transformers5_form(plain);
  untyped["rope_parameters"].erase("rope_type");
  EXPECT_EQ(read(dir, untyped).rope_theta, 250000.0f);

  // Both forms in one file: read when they agree.
  json both = v5;
  both["rope_theta"] = 500000.0;
  both["rope_scaling"] = small_llama3()["rope_scaling"];
  EXPECT_EQ(read(dir, both).rope_params(), legacy.rope_params());
}

TEST(HfConfig, RefusesTransformers5RopeParametersItCannotFollow) {
  json j = in_transformers5_form(small_llama3());
  for (const char* type : {"linear", "dynamic", "yarn", "longrope"}) {
    j["rope_parameters"]["rope_type"] = type;
    expect_refused(j, {"rope_parameters.rope_type = \"" + std::string(type) + "\"",
                       "only \"llama3\" RoPE scaling"});
  }
  j = in_transformers5_form(small_llama3());
  j["rope_parameters"].erase("high_freq_factor");
  expect_refused(j, {"rope_parameters has no field 'high_freq_factor'"});
  j = in_transformers5_form(small_llama3());
  j["rope_parameters"].erase("rope_type");
  expect_refused(j, {"rope_parameters has no rope_type"});
  j = in_transformers5_form(small_llama3());
  j["rope_parameters"] = 500000.0;
  expect_refused(j, {"rope_parameters = 500000.0 has the wrong type"});
  // One set per attention type (hybrid models).
  j = in_transformers5_form(small_llama3());
  j["rope_parameters"] = {{"full_attention", j["rope_parameters"]}};
  expect_refused(j, {"rope_parameters holds one set per attention type (full_attention",
                     "per-layer RoPE is not supported"});
  // Both forms, saying different things.
  j = in_transformers5_form(small_llama3());
  j["rope_theta"] = 10000.0;
  expect_refused(j, {"rope_theta = 10000.0 and rope_parameters.rope_theta = 500000.0 disagree"});
  j = in_transformers5_form(small_llama3());
  j["rope_scaling"] = {{"rope_type", "default"}};
  expect_refused(j, {"rope_scaling and rope_parameters describe different RoPE scaling"});
  // Rotating part of each head.
  j = in_transformers5_form(small_llama3());
  j["rope_parameters"]["partial_rotary_factor"] = 0.5;
  expect_refused(j, {"rope_parameters.partial_rotary_factor = 0.5 is not supported"});
  j = small_llama3();
  j["partial_rotary_factor"] = 0.5;
  expect_refused(j, {"partial_rotary_factor = 0.5 is not supported"});
}

TEST(HfConfig, RefusesRopeScalingItDoesNotImplement) {
  for (const char* type : {"linear", "dynamic", "yarn", "longrope"}) {
    json j = small_llama3();
    j["rope_scaling"]["rope_type"] = type;
    expect_refused(j, {"rope_scaling.rope_type = \"" + std::string(type) + "\"",
                       "only \"llama3\" RoPE scaling"});
  }
  json j = small_llama3();
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  expect_refused(j, {"rope_scaling.type = \"linear\" is not supported"});
  j["rope_scaling"] = {{"factor", 2.0}};
  expect_refused(j, {"rope_scaling has no rope_type"});
  j["rope_scaling"] = "llama3";
  expect_refused(j, {"rope_scaling = \"llama3\" has the wrong type"});

  j = small_llama3();
  j["rope_scaling"].erase("low_freq_factor");
  expect_refused(j, {"rope_scaling has no field 'low_freq_factor'"});
  j = small_llama3();
  j["rope_scaling"]["low_freq_factor"] = 4.0;
  j["rope_scaling"]["high_freq_factor"] = 1.0;
  expect_refused(j, {"high_freq_factor (1) must be greater than low_freq_factor (4)"});
  j = small_llama3();
  j["rope_scaling"]["factor"] = 0.0;
  expect_refused(j, {"factor (0) must be a number > 0"});
  j = small_llama3();
  j["rope_scaling"]["factor"] = "32";
  expect_refused(j, {"rope_scaling.factor = \"32\" has the wrong type: expected a number"});
  j = small_llama3();
  j["rope_scaling"]["original_max_position_embeddings"] = 0;
  expect_refused(j, {"original_max_position_embeddings (0) must be > 0"});
  j = small_llama3();
  j["rope_scaling"]["original_max_position_embeddings"] = 8192.5;
  expect_refused(j, {"rope_scaling.original_max_position_embeddings = 8192.5 is not a whole"});
}

TEST(HfConfig, RefusesWhatTheModelDoesNotCompute) {
  json j = small_llama3();
  j["hidden_act"] = "gelu";
  expect_refused(j, {"hidden_act = \"gelu\" is not supported", "only \"silu\""});
  j = small_llama3();
  j["attention_bias"] = true;
  expect_refused(j, {"attention_bias = true is not supported"});
  j = small_llama3();
  j["mlp_bias"] = true;
  expect_refused(j, {"mlp_bias = true is not supported"});
  j = small_llama3();
  j["model_type"] = "mistral";
  expect_refused(j, {"model_type = \"mistral\" is not supported", "only \"llama\""});
  j = small_llama3();
  j["attention_dropout"] = 0.1;
  expect_refused(j, {"attention_dropout = 0.1", "is not supported: the attention has no dropout"});
  j = small_llama3();
  j["attention_dropout"] = 0.0;  // what released configs say
  EXPECT_NO_THROW(read(TempDir("hf-config"), j));
  j = small_llama3();
  j["attention_bias"] = "no";
  expect_refused(j, {"attention_bias = \"no\" has the wrong type: expected true or false"});
}

// Sizes past any real model are refused before anything is allocated, and a head_dim whose
// product with the heads would wrap around int64 to hidden_size is compared by division.
TEST(HfConfig, RefusesSizesNoModelHasAndAFifo) {
  json j = small_llama3();
  j["num_hidden_layers"] = int64_t{1} << 40;
  TempDir dir("hf-config");
  expect_error<ConfigError>(
      [&] { read(dir, j); },
      {"num_hidden_layers = 1099511627776 is larger than this runtime allows (65536)"});
  j = small_llama3();
  j["num_attention_heads"] = 4;
  j["head_dim"] = (int64_t{1} << 62) + 8;  // x 4 heads = 2^64 + 32: wraps around to hidden_size
  expect_refused(j, {"head_dim = 4611686018427387912", "does not give hidden_size = 32"});
  // A FIFO would block the open until some writer came.
  TempDir fifo_dir("hf-fifo");
  const std::string fifo = fifo_dir.str("config.json");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error<ConfigError>([&] { nn::LlamaConfig::from_hf_json(fifo); },
                            {"model config '" + fifo + "' is not a regular file"});
}

// A value nested a million deep parses, but printing it (in an error message) or copying it (into
// an export) overflowed the stack: nesting past 64 levels is refused as it is read.
TEST(HfConfig, RefusesDeeplyNestedValues) {
  TempDir dir("hf-deep");
  std::string text = small_llama3().dump();
  text.insert(text.size() - 1,
              ", \"extra\": " + std::string(1000000, '[') + std::string(1000000, ']'));
  const std::string path = dir.write("config.json", text);
  expect_error<FormatError>([&] { nn::LlamaConfig::from_hf_json(path); },
                            {"'" + path + "' is not valid JSON", "nested deeper than 64 levels"});
}

TEST(HfConfig, RefusesNonIntegerNumbersForIntegerFields) {
  for (const char* key :
       {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "head_dim"}) {
    json j = small_llama3();
    j[key] = 32.5;
    expect_refused(j, {std::string(key) + " = 32.5 is not a whole number"});
    j[key] = 32.0;  // integral, but written as a float: transformers would not build layers
    expect_refused(j, {std::string(key) + " = 32.0 is not a whole number"});
    j[key] = "32";
    expect_refused(j, {std::string(key) + " = \"32\" has the wrong type: expected a whole number"});
  }
  json j = small_llama3();
  j["rope_theta"] = "500000";
  expect_refused(j, {"rope_theta = \"500000\" has the wrong type: expected a number"});
  j = small_llama3();
  j.erase("hidden_size");
  expect_refused(j, {"has no field 'hidden_size'"});
  j = small_llama3();
  j["head_dim"] = 8;
  expect_refused(j, {"head_dim = 8 with num_attention_heads = 2 does not give hidden_size = 32"});
}

TEST(HfConfig, ToHfJsonRoundTripsRopeScaling) {
  TempDir dir("hf-config");
  nn::LlamaConfig c;
  c.hidden_size = 64;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.rope_theta = 500000.0f;
  c.rope_scaling = Llama3RopeScaling{8.0, 1.0, 4.0, 8192};
  json written = json::parse(c.to_hf_json());
  EXPECT_EQ(written["rope_scaling"], (json{{"rope_type", "llama3"},
                                           {"factor", 8.0},
                                           {"low_freq_factor", 1.0},
                                           {"high_freq_factor", 4.0},
                                           {"original_max_position_embeddings", 8192}}));
  nn::LlamaConfig back = nn::LlamaConfig::from_hf_json(dir.write("config.json", c.to_hf_json()));
  EXPECT_EQ(back.rope_scaling, c.rope_scaling);
  EXPECT_EQ(back.rope_theta, c.rope_theta);
  EXPECT_EQ(back.hidden_size, c.hidden_size);
  EXPECT_EQ(back.num_kv_heads, c.num_kv_heads);

  c.rope_scaling.reset();
  EXPECT_TRUE(json::parse(c.to_hf_json())["rope_scaling"].is_null());
  back = nn::LlamaConfig::from_hf_json(dir.write("config.json", c.to_hf_json()));
  EXPECT_FALSE(back.rope_scaling.has_value());
}

TEST(HfConfig, ExportedModelKeepsItsRopeScaling) {
  // An exported model reads back with its scaling and computes what it computed; without the
  // scaling the same weights compute something else (positions past the short wavelengths).
  TempDir dir("hf-export");
  nn::LlamaConfig c = read(dir, small_llama3());
  c.rope_scaling = Llama3RopeScaling{4.0, 1.0, 4.0, 64};  // scaled frequencies within 40 tokens
  nn::LlamaModel model(c, Device::cpu());
  model.init_weights(7);
  io::save_hf_model(model, dir.str("export"));

  nn::LlamaConfig back = nn::LlamaConfig::from_hf_json(dir.str("export/config.json"));
  ASSERT_EQ(back.rope_scaling, c.rope_scaling);
  nn::LlamaModel loaded(back, Device::cpu());
  io::load_hf_weights(loaded, dir.str("export"));
  back.rope_scaling.reset();
  nn::LlamaModel unscaled(back, Device::cpu());
  io::load_hf_weights(unscaled, dir.str("export"));

  std::vector<int64_t> tokens(40);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>((i * 7 + 3) % 64);
  Tensor ids = from_ints(tokens, {1, 40});
  const std::vector<float> want = model.forward(ids).to_float_vector();
  EXPECT_EQ(loaded.forward(ids).to_float_vector(), want);
  const std::vector<float> other = unscaled.forward(ids).to_float_vector();
  float diff = 0;
  for (size_t i = 0; i < want.size(); ++i) diff = std::max(diff, std::fabs(want[i] - other[i]));
  EXPECT_GT(diff, 1e-4f);
}

// With tie_word_embeddings an export may still store lm_head.weight, as a copy of the embedding:
// it loads. A head that differs would be silently replaced by the embedding: refused.
TEST(HfConfig, ATiedHeadStoredAsACopyLoadsAndADifferentOneIsRefused) {
  TempDir dir("hf-tied");
  nn::LlamaConfig c = read(dir, small_llama3());
  ASSERT_TRUE(c.tie_embeddings);
  nn::LlamaModel model(c, Device::cpu());
  model.init_weights(7);
  io::save_hf_model(model, dir.str("export"));
  const std::string weights = dir.str("export/model.safetensors");
  SafetensorsFile saved = SafetensorsFile::open(weights);
  ASSERT_FALSE(saved.contains("lm_head.weight"));
  NamedTensors tensors;
  for (const std::string& name : saved.names()) tensors.emplace_back(name, saved.load(name));
  const Tensor embedding = saved.load("model.embed_tokens.weight");

  tensors.emplace_back("lm_head.weight", embedding.clone());
  save_safetensors(weights, tensors);
  nn::LlamaModel copy(c, Device::cpu());
  io::load_hf_weights(copy, dir.str("export"));

  std::vector<float> other = embedding.to_float_vector();
  other[5] += 1.0f;
  tensors.back().second = from_floats(other, embedding.shape());
  save_safetensors(weights, tensors);
  nn::LlamaModel different(c, Device::cpu());
  expect_error<FormatError>(
      [&] { io::load_hf_weights(different, dir.str("export")); },
      {"an lm_head.weight that differs from model.embed_tokens.weight", "tie_word_embeddings"});
}

// Numbers the model keeps in fp32 must stay finite and non-zero there; text after the object is
// not a config.json.
TEST(HfConfig, RefusesNumbersOutsideFp32AndTrailingText) {
  json j = small_llama3();
  j["rope_theta"] = 1e39;
  expect_refused(j, {"rope_theta = 1e+39", "outside fp32's range"});
  j = small_llama3();
  j["rms_norm_eps"] = 1e-50;
  expect_refused(j, {"rms_norm_eps = 1e-50", "outside fp32's range"});
  TempDir dir("hf-trailing");
  const std::string path = dir.write("config.json", small_llama3().dump() + "\n{}\n");
  expect_error<FormatError>([&] { nn::LlamaConfig::from_hf_json(path); },
                            {"'" + path + "'", "not valid JSON"});
  dir.write("config.json", small_llama3().dump() + std::string(1, '\0') + "garbage");
  expect_error<FormatError>([&] { nn::LlamaConfig::from_hf_json(path); },
                            {"'" + path + "'", "NUL byte"});
}

// A weight stored as an integer type (a mislabelled or wrongly converted file) would load as
// numbers of another scale: refused by name. The fingerprint of two models of one shape differs,
// and the export carries the source's token ids and tokenizer files.
TEST(HfConfig, IntegerWeightsAreRefusedFingerprintsAndMetadataCarry) {
  TempDir dir("hf-dtype");
  nn::LlamaConfig c = read(dir, small_llama3());
  nn::LlamaModel model(c, Device::cpu());
  model.init_weights(7);
  io::save_hf_model(model, dir.str("a"));
  model.init_weights(8);
  io::save_hf_model(model, dir.str("b"));
  const std::string fa = io::hf_weights_fingerprint(dir.str("a"));
  EXPECT_EQ(fa.size(), 16u);
  EXPECT_EQ(io::hf_weights_fingerprint(dir.str("a")), fa);
  EXPECT_NE(io::hf_weights_fingerprint(dir.str("b")), fa);

  const std::string weights = dir.str("b/model.safetensors");
  SafetensorsFile saved = SafetensorsFile::open(weights);
  NamedTensors tensors;
  for (const std::string& name : saved.names())
    tensors.emplace_back(name, name == "model.norm.weight"
                                   ? from_ints(std::vector<int64_t>(32, 1), {32}, DType::I32)
                                   : saved.load(name));
  save_safetensors(weights, tensors);
  nn::LlamaModel loaded(c, Device::cpu());
  expect_error<FormatError>([&] { io::load_hf_weights(loaded, dir.str("b")); },
                            {"'model.norm.weight' is stored as I32", "F32, BF16 or F16"});

  // The source's extra config fields (not quantization_config) and tokenizer files carry over.
  json source = json::parse(testing::read_file_bytes(dir.str("a/config.json")));
  source["bos_token_id"] = 128000;
  source["eos_token_id"] = {128001, 128009};
  source["quantization_config"] = {{"load_in_4bit", true}};
  // Transformers 5's form of the RoPE settings is not copied next to the written rope_theta.
  source["rope_parameters"] = {{"rope_theta", c.rope_theta}, {"rope_type", "default"}};
  // Nor the source's dtype, in either spelling: the export's own torch_dtype says what it holds.
  source["dtype"] = "bfloat16";
  source["torch_dtype"] = "bfloat16";
  dir.write("a/config.json", source.dump());
  dir.write("a/tokenizer.json", "{\"version\": \"1.0\"}");
  io::save_hf_model(model, dir.str("export"));
  const std::vector<std::string> carried =
      io::carry_hf_metadata(dir.str("a"), dir.str("export"), 128);
  EXPECT_EQ(carried, (std::vector<std::string>{"config.json:bos_token_id",
                                               "config.json:eos_token_id", "tokenizer.json"}));
  const json exported = json::parse(testing::read_file_bytes(dir.str("export/config.json")));
  EXPECT_EQ(exported["bos_token_id"], 128000);
  EXPECT_EQ(exported["eos_token_id"], json({128001, 128009}));
  EXPECT_FALSE(exported.contains("quantization_config"));
  EXPECT_FALSE(exported.contains("rope_parameters"));
  EXPECT_FALSE(exported.contains("dtype"));
  EXPECT_EQ(exported["torch_dtype"], "float32");
  EXPECT_EQ(testing::read_file_bytes(dir.str("export/tokenizer.json")), "{\"version\": \"1.0\"}");
  // Floats are written as the shortest decimal that reads back as the same fp32 value.
  EXPECT_NE(testing::read_file_bytes(dir.str("export/config.json")).find("\"rms_norm_eps\": 1e-05"),
            std::string::npos);
  // The source's max_position_embeddings stays, not the longer limit the training model was
  // built with; sequences longer than the source's, when trained on, replace it.
  EXPECT_EQ(exported["max_position_embeddings"], 131072);
  source["max_position_embeddings"] = 64;
  dir.write("a/config.json", source.dump());
  nn::LlamaConfig longer = c;
  longer.max_seq_len = 2048;
  nn::LlamaModel built_longer(longer, Device::cpu());
  built_longer.init_weights(7);
  for (int64_t trained : {32, 256}) {
    io::save_hf_model(built_longer, dir.str("export"));
    io::carry_hf_metadata(dir.str("a"), dir.str("export"), trained);
    const json written = json::parse(testing::read_file_bytes(dir.str("export/config.json")));
    EXPECT_EQ(written["max_position_embeddings"], std::max<int64_t>(64, trained));
  }
  io::save_hf_model(model, dir.str("export"));
  io::carry_hf_metadata(dir.str("a"), dir.str("export"), 128);
  // The exported model still loads.
  nn::LlamaModel again(nn::LlamaConfig::from_hf_json(dir.str("export/config.json")), Device::cpu());
  io::load_hf_weights(again, dir.str("export"));
}

// A config.json the model cannot be built from names the file.
TEST(HfConfig, AShapeTheModelCannotTakeNamesTheFile) {
  TempDir dir("hf-shape");
  json j = small_llama3();
  j.erase("head_dim");
  j["num_attention_heads"] = 3;
  j["num_key_value_heads"] = 1;
  const std::string path = write_config(dir, j);
  expect_error<Error>([&] { nn::LlamaConfig::from_hf_json(path); },
                      {"'" + path + "'", "not divisible by num_attention_heads 3"});
  // Fields are named as config.json names them, not as the run config's model section does.
  j = small_llama3();
  j["num_hidden_layers"] = 2000000;
  write_config(dir, j);
  expect_error<Error>([&] { nn::LlamaConfig::from_hf_json(path); },
                      {"'" + path + "'", "num_hidden_layers = 2000000 is larger than"});
  j = small_llama3();
  j["num_key_value_heads"] = 3;
  write_config(dir, j);
  expect_error<Error>([&] { nn::LlamaConfig::from_hf_json(path); },
                      {"num_attention_heads 2 is not a multiple of num_key_value_heads 3"});
}

// ---- the run config against config.json ----------------------------------------------------

train::ModelConfig model_section(const std::string& yaml) {
  return train::Config::parse(yaml, {}, "run.yaml").model;
}

// The longest sequence is not part of the weights: the model takes the longer of config.json's
// max_position_embeddings and model.max_seq_len (against which train.seq_len was checked), the
// default 2048 included.
TEST(HfConfig, RunConfigMaxSeqLenExtendsMaxPositionEmbeddings) {
  TempDir dir("hf-maxpos");
  json j = small_llama3();
  j["max_position_embeddings"] = 32;
  write_config(dir, j);
  const std::string from = "model:\n  from_hf: " + dir.str() + "\n";
  EXPECT_EQ(train::llama_config_from(model_section(from)).max_seq_len, 2048);
  EXPECT_EQ(train::llama_config_from(model_section(from + "  max_seq_len: 64\n")).max_seq_len, 64);
  j["max_position_embeddings"] = 131072;
  write_config(dir, j);
  EXPECT_EQ(train::llama_config_from(model_section(from + "  max_seq_len: 64\n")).max_seq_len,
            131072);
}

// Data with a larger vocabulary than config.json's model is refused before training starts, as it
// is without model.from_hf, instead of at the first batch that holds a token the model lacks.
TEST(HfConfig, DataWithALargerVocabularyThanTheModelIsRefused) {
  TempDir dir("hf-vocab");
  json j = small_llama3();
  j["vocab_size"] = 256;
  write_config(dir, j);
  train::Config config =
      train::Config::parse("model:\n  from_hf: " + dir.str() + "\n", {}, "test_hf_config");
  const TokenDataset fits = TokenDataset::from_tokens({1, 2, 255}, 256, "bytes");
  EXPECT_NO_THROW(train::check_data_fits_model(fits, config));
  const TokenDataset larger = TokenDataset::from_tokens({1, 2, 3}, 300, "other");
  expect_error<ConfigError>(
      [&] { train::check_data_fits_model(larger, config); },
      {"has vocabulary size 300", "model.from_hf '" + dir.str() + "'", "has vocab_size 256"});
  // Without from_hf the run config's model.vocab_size is the limit.
  config.model.from_hf.clear();
  config.model.vocab_size = 512;
  EXPECT_NO_THROW(train::check_data_fits_model(larger, config));
  config.model.vocab_size = 299;
  expect_error<ConfigError>([&] { train::check_data_fits_model(larger, config); },
                            {"has vocabulary size 300 but model.vocab_size is 299"});
}

TEST(HfConfig, RunConfigThatContradictsConfigJsonIsAnError) {
  TempDir dir("hf-run");
  write_config(dir, small_llama3());
  const std::string from = "model:\n  from_hf: " + dir.path.string() + "\n";

  // Keys left at their defaults take config.json's values.
  nn::LlamaConfig c = train::llama_config_from(model_section(from));
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.rope_scaling, (Llama3RopeScaling{32.0, 1.0, 4.0, 8192}));
  // Keys that agree, and max_seq_len (a limit on the training sequences), are fine.
  c =
      train::llama_config_from(model_section(
          from + "  vocab_size: 64\n  hidden_size: 32\n  intermediate_size: 48\n  num_layers: 2\n"
                 "  num_heads: 2\n  num_kv_heads: 1\n  rms_norm_eps: 1.0e-5\n  rope_theta: 500000\n"
                 "  tie_embeddings: true\n  max_seq_len: 2048\n"
                 "  rope_scaling:\n    rope_type: llama3\n    factor: 32\n    low_freq_factor: 1\n"
                 "    high_freq_factor: 4\n    original_max_position_embeddings: 8192\n"));
  EXPECT_EQ(c.max_seq_len, 131072);

  auto conflict = [&](const std::string& keys, std::initializer_list<std::string> parts) {
    SCOPED_TRACE(keys);
    const train::ModelConfig m = model_section(from + keys);
    expect_error<ConfigError>([&] { train::llama_config_from(m); },
                              {"model.from_hf", dir.str("config.json"), "remove these model keys"});
    expect_error<ConfigError>([&] { train::llama_config_from(m); }, parts);
  };
  conflict("  hidden_size: 48\n  num_heads: 3\n",
           {"model.hidden_size = 48 but hidden_size = 32",
            "model.num_heads = 3 but num_attention_heads = 2"});
  conflict("  vocab_size: 128256\n", {"model.vocab_size = 128256 but vocab_size = 64"});
  conflict("  num_layers: 16\n", {"model.num_layers = 16 but num_hidden_layers = 2"});
  conflict("  num_kv_heads: 2\n", {"model.num_kv_heads = 2 but num_key_value_heads = 1"});
  conflict("  rope_theta: 10000.5\n", {"model.rope_theta = 10000.5 but rope_theta = 500000"});
  conflict("  rms_norm_eps: 1.0e-6\n", {"model.rms_norm_eps = 1e-06 but rms_norm_eps = 1e-05"});
  conflict("  intermediate_size: 64\n",
           {"model.intermediate_size = 64 but intermediate_size = 48"});
  conflict(
      "  rope_scaling:\n    rope_type: llama3\n    factor: 8\n    low_freq_factor: 1\n"
      "    high_freq_factor: 4\n    original_max_position_embeddings: 8192\n",
      {"model.rope_scaling.factor = 8 but rope_scaling.factor = 32"});

  json plain = small_llama3();
  plain.erase("rope_scaling");
  plain["tie_word_embeddings"] = false;
  write_config(dir, plain);
  conflict("  tie_embeddings: true\n",
           {"model.tie_embeddings = true but tie_word_embeddings = false"});
  conflict(
      "  rope_scaling:\n    rope_type: llama3\n    factor: 8\n    low_freq_factor: 1\n"
      "    high_freq_factor: 4\n    original_max_position_embeddings: 8192\n",
      {"model.rope_scaling.rope_type = llama3 but config.json has no rope_scaling"});
}

// A run config file says which keys it sets: with model.from_hf, one set to its default value
// that config.json contradicts is a request too, and the keys it leaves out take config.json's
// values, so that the resolved config (`shardtrain config`, the run's config.yaml) shows the model
// that trains and reads back to the same config.
TEST(HfConfig, LoadConfigResolvesTheModelKeysFromConfigJson) {
  TempDir dir("hf-load");
  write_config(dir, small_llama3());
  const std::string from = "model:\n  from_hf: " + dir.str() + "\n";
  const train::Config c = train::load_config(dir.write("run.yaml", from));
  EXPECT_EQ(c.model.vocab_size, 64);
  EXPECT_EQ(c.model.hidden_size, 32);
  EXPECT_EQ(c.model.intermediate_size, 48);
  EXPECT_EQ(c.model.num_layers, 2);
  EXPECT_EQ(c.model.num_heads, 2);
  EXPECT_EQ(c.model.num_kv_heads, 1);
  EXPECT_EQ(c.model.rope_theta, 500000.0);
  EXPECT_EQ(c.model.rope_scaling, (train::RopeScalingConfig{"llama3", 32.0, 1.0, 4.0, 8192}));
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_EQ(c.model.max_seq_len, 131072);
  EXPECT_EQ(c.model.rms_norm_eps, 1e-5) << "config.json's fp32 value, as written";
  EXPECT_NE(c.to_yaml().find("  rms_norm_eps: 1e-05"), std::string::npos) << c.to_yaml();
  // The resolved config is the same config when read again (a run's config.yaml).
  EXPECT_EQ(train::load_config(dir.write("resolved.yaml", c.to_yaml())), c);

  // hidden_size: 64 and num_kv_heads: 0 are the defaults, but written down they ask for a model
  // config.json does not describe.
  expect_error<ConfigError>(
      [&] { train::load_config(dir.write("run.yaml", from + "  hidden_size: 64\n")); },
      {"model.hidden_size = 64 but hidden_size = 32", "remove these model keys"});
  expect_error<ConfigError>(
      [&] { train::load_config(dir.write("run.yaml", from), {"model.num_kv_heads=0"}); },
      {"model.num_kv_heads = 0 (as many as the query heads) but num_key_value_heads = 1"});
  expect_error<ConfigError>(
      [&] {
        train::load_config(dir.write("run.yaml", from + "  rope_scaling:\n    rope_type: none\n"));
      },
      {"model.rope_scaling.rope_type = none but config.json's rope_scaling is llama3"});
  // Without config.json there is no model to train: said before anything starts.
  expect_error<ConfigError>(
      [&] {
        train::load_config(dir.write("run.yaml", "model:\n  from_hf: " + dir.str("none") + "\n"));
      },
      {"model.from_hf '" + dir.str("none") + "' does not exist", "Hugging Face model"});
  std::filesystem::create_directories(dir.str("empty"));
  expect_error<ConfigError>(
      [&] {
        train::load_config(dir.write("run.yaml", "model:\n  from_hf: " + dir.str("empty") + "\n"));
      },
      {"model.from_hf '" + dir.str("empty") + "' has no config.json"});
}

TEST(HfConfig, RunConfigRopeScalingReachesTheModel) {
  const nn::LlamaConfig c = train::llama_config_from(model_section(
      "model:\n  rope_theta: 500000\n  rope_scaling:\n    rope_type: llama3\n    factor: 8\n"
      "    low_freq_factor: 1\n    high_freq_factor: 4\n"
      "    original_max_position_embeddings: 8192\n"));
  EXPECT_EQ(c.rope_params(), (RopeParams{500000.0f, Llama3RopeScaling{8.0, 1.0, 4.0, 8192}}));
  EXPECT_FALSE(train::llama_config_from(model_section("")).rope_scaling.has_value());
}

}  // namespace
}  // namespace shardtrain
