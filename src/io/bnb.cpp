#include "shardtrain/io/bnb.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/backend/nf4_codebook.h"
#include "shardtrain/core/files.h"
#include "shardtrain/core/json_input.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/memory/category.h"
#include "shardtrain/nn/lora.h"

namespace shardtrain::io {

namespace {

constexpr const char* kQuantStatePrefix = ".quant_state.bitsandbytes__";
// The tensors bitsandbytes stores beside a quantized weight W, as suffixes of W's name.
constexpr const char* kPieces[] = {".absmax", ".nested_absmax", ".quant_map", ".nested_quant_map",
                                   ".quant_state.bitsandbytes__nf4"};

std::vector<float> floats_of(const SafetensorsCheckpoint& ckpt, const std::string& name) {
  return ckpt.load(name, Device::host(), DType::F32).to_float_vector();
}

}  // namespace

std::set<std::string> bnb_quantized_weights(const SafetensorsCheckpoint& ckpt) {
  std::set<std::string> out;
  for (const std::string& name : ckpt.names()) {
    const size_t at = name.rfind(kQuantStatePrefix);
    if (at != std::string::npos) out.insert(name.substr(0, at));
  }
  return out;
}

std::vector<std::string> bnb_tensor_names(const std::string& weight_name) {
  std::vector<std::string> names = {weight_name, weight_name + kQuantStatePrefix + "fp4"};
  for (const char* piece : kPieces) names.push_back(weight_name + piece);
  return names;
}

bool holds_bnb_4bit_weights(const SafetensorsCheckpoint& ckpt) {
  return !bnb_quantized_weights(ckpt).empty();
}

nn::Nf4Tensor read_bnb_nf4(const SafetensorsCheckpoint& ckpt, const std::string& weight_name,
                           const Shape& expected, Device device) {
  const std::string where =
      "bitsandbytes weights in '" + ckpt.path() + "': tensor '" + weight_name + "'";
  auto fail = [&](const std::string& what) { throw FormatError(where + " " + what); };
  if (ckpt.contains(weight_name + kQuantStatePrefix + "fp4"))
    fail(
        "is quantized to FP4; only NF4 (bnb_4bit_quant_type \"nf4\") is read: quantize the "
        "dense model with NF4, or point lora.base_model at the dense model and let the run "
        "quantize it");
  for (const char* piece : kPieces)
    if (!ckpt.contains(weight_name + piece)) {
      if (std::string(piece) == ".nested_absmax" || std::string(piece) == ".nested_quant_map")
        fail(
            "has block statistics that are not double-quantized (bnb_4bit_use_double_quant "
            "false), which this runtime does not store; save it with double quantization, or "
            "point lora.base_model at the dense model and let the run quantize it");
      fail("is missing its piece '" + weight_name + piece + "'");
    }
  if (!ckpt.contains(weight_name)) fail("is missing (only its quantization state is stored)");

  // The non-tensor state, a JSON text stored as bytes.
  const std::string state_name = weight_name + kQuantStatePrefix + "nf4";
  if (ckpt.info(state_name).dtype != DType::U8) fail("has a quant_state that is not U8 bytes");
  const std::string_view state_bytes = ckpt.file_of(state_name).bytes(state_name);
  nlohmann::json state;
  try {
    state = parse_json_input(state_bytes);
  } catch (const std::exception& e) {
    fail("has a quant_state that is not JSON: " + std::string(e.what()));
  }
  auto integer = [&](const char* key) -> int64_t {
    const auto it = state.find(key);
    if (it == state.end() || !it->is_number_integer())
      fail(std::string("has a quant_state without an integer '") + key + "'");
    return it->get<int64_t>();
  };
  const auto quant_type = state.find("quant_type");
  if (quant_type == state.end() || !quant_type->is_string() || *quant_type != "nf4")
    fail("has quant_type " + (quant_type == state.end() ? "(none)" : quant_type->dump()) +
         " in its quant_state; only nf4 is read");
  if (integer("blocksize") != nf4::kNf4BlockSize)
    fail("has blocksize " + std::to_string(integer("blocksize")) +
         "; this runtime's NF4 blocks are 64 weights (bitsandbytes' default on CUDA)");
  if (integer("nested_blocksize") != nf4::kAbsmaxGroupSize)
    fail("has nested_blocksize " + std::to_string(integer("nested_blocksize")) +
         "; double quantization here groups 256 block statistics (bitsandbytes' value)");
  const auto offset = state.find("nested_offset");
  if (offset == state.end() || !offset->is_number() || !std::isfinite(offset->get<double>()))
    fail("has a quant_state without a finite nested_offset");
  const auto shape = state.find("shape");
  Shape stored_shape;
  if (shape == state.end() || !shape->is_array()) fail("has a quant_state without a shape");
  for (const auto& d : *shape) {
    if (!d.is_number_integer() || d.get<int64_t>() <= 0)
      fail("has a quant_state shape " + shape->dump() + " that is not sizes");
    stored_shape.push_back(d.get<int64_t>());
  }
  if (stored_shape != expected)
    fail("has shape " + shape_str(stored_shape) + " but the model expects " + shape_str(expected) +
         " (is the checkpoint for a different model shape?)");

  // The code books: the NF4 table and the dynamic map, as bitsandbytes computes them. Its
  // float32 arithmetic may differ from this runtime's in the last bits of a dynamic-map entry;
  // anything more is another code book, which the kernels (fixed tables) cannot decode.
  const std::vector<float> quant_map = floats_of(ckpt, weight_name + ".quant_map");
  if (quant_map.size() != nf4::kNf4Code.size())
    fail("has a quant_map of " + std::to_string(quant_map.size()) + " values, not 16");
  for (size_t i = 0; i < quant_map.size(); ++i)
    if (!(std::fabs(quant_map[i] - nf4::kNf4Code[i]) <= 2e-7f))
      fail("has a quant_map that is not the NF4 table (value " + std::to_string(i) + " is " +
           std::to_string(quant_map[i]) + ")");
  const std::vector<float> nested_map = floats_of(ckpt, weight_name + ".nested_quant_map");
  const std::array<float, 256>& dynamic = nf4::dynamic_map_8bit();
  if (nested_map.size() != dynamic.size())
    fail("has a nested_quant_map of " + std::to_string(nested_map.size()) + " values, not 256");
  for (size_t i = 0; i < nested_map.size(); ++i)
    if (!(std::fabs(nested_map[i] - dynamic[i]) <= 5e-7f * std::fabs(dynamic[i]) + 1e-12f))
      fail("has a nested_quant_map that is not bitsandbytes' dynamic 8-bit map (value " +
           std::to_string(i) + " is " + std::to_string(nested_map[i]) + ", expected " +
           std::to_string(dynamic[i]) + ")");

  const int64_t n = numel(expected);
  auto check_piece = [&](const std::string& name, DType dtype, int64_t count) {
    const TensorInfo& info = ckpt.info(name);
    if (info.dtype != dtype || numel(info.shape) != count)
      fail("has '" + name + "' of " + std::string(safetensors_dtype_name(info.dtype)) + " " +
           shape_str(info.shape) + "; a weight of " + std::to_string(n) + " elements needs " +
           std::string(safetensors_dtype_name(dtype)) + " with " + std::to_string(count) +
           " elements");
  };
  // The packed codes are bytes whatever dtype holds them: bnb_4bit_quant_storage (bf16, say,
  // for sharded QLoRA) views the same bytes as wider elements.
  const TensorInfo& codes_info = ckpt.info(weight_name);
  const bool codes_as_bytes = codes_info.dtype == DType::U8;
  if (codes_as_bytes)
    check_piece(weight_name, DType::U8, nf4::num_code_bytes(n));
  else if (codes_info.nbytes() != nf4::num_code_bytes(n))
    fail("holds " + std::to_string(codes_info.nbytes()) + " bytes of packed codes (" +
         std::string(safetensors_dtype_name(codes_info.dtype)) + " " + shape_str(codes_info.shape) +
         "); a weight of " + std::to_string(n) + " elements needs " +
         std::to_string(nf4::num_code_bytes(n)));
  check_piece(weight_name + ".absmax", DType::U8, nf4::num_blocks(n));
  check_piece(weight_name + ".nested_absmax", DType::F32, nf4::num_absmax_groups(n));

  nn::Nf4Tensor q;
  q.shape = expected;
  q.absmax_offset = static_cast<float>(offset->get<double>());
  {
    CategoryScope as_parameters(MemoryCategory::Parameters);
    if (codes_as_bytes) {
      q.codes = ckpt.load(weight_name, device).view({nf4::num_code_bytes(n)});
    } else {
      const std::string_view bytes = ckpt.file_of(weight_name).bytes(weight_name);
      Tensor codes = empty({nf4::num_code_bytes(n)}, DType::U8, Device::cpu());
      std::memcpy(codes.data_ptr(), bytes.data(), bytes.size());
      q.codes = codes.to(device);
    }
    q.absmax_q = ckpt.load(weight_name + ".absmax", device).view({nf4::num_blocks(n)});
    q.absmax_scale =
        ckpt.load(weight_name + ".nested_absmax", device).view({nf4::num_absmax_groups(n)});
  }
  for (float scale : q.absmax_scale.to_float_vector())
    if (!std::isfinite(scale)) fail("has a nested_absmax that holds NaN or infinite values");
  q.validate(where);
  return q;
}

void save_bnb_4bit_model(nn::LlamaModel& model, const std::string& dir, DType dense_dtype) {
  ST_CHECK_AS(ConfigError,
              dense_dtype == DType::BF16 || dense_dtype == DType::F16 || dense_dtype == DType::F32,
              "a 4-bit model's dense weights are bf16, fp16 or fp32, not ",
              dtype_name(dense_dtype));
  const std::string torch_dtype = dense_dtype == DType::BF16  ? "bfloat16"
                                  : dense_dtype == DType::F16 ? "float16"
                                                              : "float32";
  autograd::NoGrad no_grad;
  CategoryScope workspace(MemoryCategory::Workspace);
  NamedTensors tensors;
  const std::vector<float> nf4_table(nf4::kNf4Code.begin(), nf4::kNf4Code.end());
  const std::vector<float> dynamic(nf4::dynamic_map_8bit().begin(), nf4::dynamic_map_8bit().end());
  auto on_host = [](const Tensor& t) { return t.device().is_host() ? t : t.to(Device::host()); };
  for (auto& [path, projection] : nn::decoder_projections(model)) {
    const std::string weight = path + ".weight";
    const auto* q = dynamic_cast<const nn::Nf4Linear*>(projection);
    ST_CHECK_AS(ConfigError, q != nullptr, "save_bnb_4bit_model: ", weight,
                " is not an NF4 projection (load the model with io::load_nf4_base_from_hf, "
                "and save it before apply_lora)");
    const nn::Nf4Tensor& w = q->quantized_weight();
    const nlohmann::json state = {{"quant_type", "nf4"},
                                  {"blocksize", nf4::kNf4BlockSize},
                                  {"dtype", torch_dtype},
                                  {"shape", w.shape},
                                  {"nested_blocksize", nf4::kAbsmaxGroupSize},
                                  {"nested_offset", w.absmax_offset},
                                  {"nested_dtype", "float32"}};
    const std::string text = state.dump();
    Tensor state_bytes = empty({static_cast<int64_t>(text.size())}, DType::U8, Device::host());
    std::memcpy(state_bytes.data_ptr(), text.data(), text.size());
    tensors.emplace_back(weight, on_host(w.codes).view({w.codes.numel(), 1}));
    tensors.emplace_back(weight + ".absmax", on_host(w.absmax_q));
    tensors.emplace_back(weight + ".nested_absmax", on_host(w.absmax_scale));
    tensors.emplace_back(weight + ".quant_map", from_floats(nf4_table, {16}));
    tensors.emplace_back(weight + ".nested_quant_map", from_floats(dynamic, {256}));
    tensors.emplace_back(weight + kQuantStatePrefix + "nf4", state_bytes);
  }
  // (An adapted model fails above: its projections are LoraLinear, not NF4.)
  for (auto& [name, slot] : model.named_parameters())
    tensors.emplace_back(name, on_host(weight_for_export(name, *slot, dense_dtype)));
  // One file, however large: shards split in name order could part a weight's codes from its
  // quant state, which Transformers' per-shard loading refuses. (A 70B model's 4-bit file is
  // about 40 GB, within the Hub's 50 GB a file.)
  save_sharded(dir, tensors, std::numeric_limits<int64_t>::max(), {{"format", "pt"}});
  // Transformers' BitsAndBytesConfig as save_pretrained writes it for such a model.
  nlohmann::ordered_json config =
      nlohmann::ordered_json::parse(model.config().to_hf_json(dense_dtype));
  config["quantization_config"] = {{"_load_in_4bit", true},
                                   {"_load_in_8bit", false},
                                   {"bnb_4bit_compute_dtype", torch_dtype},
                                   {"bnb_4bit_quant_storage", "uint8"},
                                   {"bnb_4bit_quant_type", "nf4"},
                                   {"bnb_4bit_use_double_quant", true},
                                   {"llm_int8_enable_fp32_cpu_offload", false},
                                   {"llm_int8_has_fp16_weight", false},
                                   {"llm_int8_skip_modules", nullptr},
                                   {"llm_int8_threshold", 6.0},
                                   {"load_in_4bit", true},
                                   {"load_in_8bit", false},
                                   {"quant_method", "bitsandbytes"}};
  write_file_atomically(dir + "/config.json", config.dump(2) + "\n");
}

}  // namespace shardtrain::io
