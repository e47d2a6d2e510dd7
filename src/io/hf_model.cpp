#include "shardtrain/io/hf_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <vector>

#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/core/files.h"
#include "shardtrain/core/json_input.h"
#include "shardtrain/core/word_hash.h"
#include "shardtrain/io/bnb.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/memory/category.h"
#include "shardtrain/nn/lora.h"

namespace shardtrain::io {

namespace {
// Checks that the checkpoint holds the dense weight `name` at `shape`, in a float dtype.
void check_dense_tensor(const SafetensorsCheckpoint& ckpt, const std::string& name,
                        const Shape& shape, const std::string& dir) {
  if (!ckpt.contains(name))
    throw FormatError("model weights in '" + dir + "' have no tensor '" + name +
                      "' (is the checkpoint for a different model shape?)");
  const DType stored_dtype = ckpt.info(name).dtype;
  if (!is_floating(stored_dtype))
    throw FormatError("model weights in '" + dir + "': tensor '" + name + "' is stored as " +
                      std::string(safetensors_dtype_name(stored_dtype)) +
                      ", an integer type; weights must be F32, BF16 or F16 (a wrongly "
                      "converted or mislabelled file)");
  const Shape& stored = ckpt.info(name).shape;
  if (stored != shape)
    throw FormatError("model weights in '" + dir + "': tensor '" + name + "' has shape " +
                      shape_str(stored) + " but the model expects " + shape_str(shape) +
                      " (is the checkpoint for a different model shape?)");
}

// Refuses a tensor in the checkpoint that is not in `loaded` (the names the model took).
void check_no_other_tensors(const SafetensorsCheckpoint& ckpt, const std::set<std::string>& loaded,
                            bool tied_embeddings, const std::string& dir) {
  for (const std::string& name : ckpt.names()) {
    if (loaded.count(name)) continue;
    // Hugging Face stores rotary inverse frequencies in some exports; they are recomputed here.
    if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;
    // Tied: the head is the embedding. An export may store it anyway, as a copy; a head that
    // differs would be silently replaced, so it is compared (bytes as stored, once, at load).
    if (name == "lm_head.weight" && tied_embeddings) {
      const std::string embedding = "model.embed_tokens.weight";
      const TensorInfo& head = ckpt.info(name);
      const bool same = ckpt.contains(embedding) && head.shape == ckpt.info(embedding).shape &&
                        head.dtype == ckpt.info(embedding).dtype &&
                        ckpt.load(name).to_float_vector() == ckpt.load(embedding).to_float_vector();
      if (!same)
        throw FormatError("model weights in '" + dir +
                          "' have an lm_head.weight that differs from model.embed_tokens.weight, "
                          "but config.json ties them (tie_word_embeddings): the head would be "
                          "replaced by the embedding; set tie_word_embeddings to false to keep it");
      continue;
    }
    throw FormatError("model weights in '" + dir + "' have tensor '" + name +
                      "' that this model does not (model section of the config does not match "
                      "the checkpoint)");
  }
}

// Checks that the checkpoint holds exactly the tensors `expected` names, at their shapes.
void check_hf_tensors(const SafetensorsCheckpoint& ckpt,
                      const std::map<std::string, Shape>& expected, bool tied_embeddings,
                      const std::string& dir) {
  std::set<std::string> names;
  for (const auto& [name, shape] : expected) {
    check_dense_tensor(ckpt, name, shape, dir);
    names.insert(name);
  }
  check_no_other_tensors(ckpt, names, tied_embeddings, dir);
}

// A NaN or infinity in the weights would surface steps later as a diverged loss; name the tensor
// now (the sum of squares of finite weights stays finite in double precision).
void check_finite(const Tensor& weights, const std::string& name, const std::string& dir) {
  if (!std::isfinite(backend_for(weights.device()).sum_squares(weights)))
    throw FormatError("model weights in '" + dir + "': tensor '" + name +
                      "' holds NaN or infinite values (a damaged or wrongly converted file)");
}
// 4-bit weights are frozen: they load only as a QLoRA base (io/bnb.h), never as weights to train.
void refuse_bnb_4bit(const SafetensorsCheckpoint& ckpt, const std::string& dir) {
  if (holds_bnb_4bit_weights(ckpt))
    throw ConfigError("'" + dir +
                      "' holds weights quantized to 4 bits by bitsandbytes, which load only as "
                      "the frozen base of a QLoRA run (lora.enabled: true with lora.quantize_base: "
                      "nf4); to train every weight, start from the dense (unquantized) model");
}
}  // namespace

std::string hf_weights_fingerprint(const std::string& dir) {
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  WordHash hash;
  constexpr int64_t kPieces = 16, kPieceBytes = 64;
  for (const std::string& name : ckpt.names()) {
    const TensorInfo& info = ckpt.info(name);
    hash.update(name.data(), name.size() + 1);  // with its terminator: names stay apart
    hash.update_value(static_cast<int64_t>(info.dtype));
    for (int64_t d : info.shape) hash.update_value(d);
    const std::string_view stored = ckpt.file_of(name).bytes(name);
    const char* data = stored.data();
    const auto bytes = static_cast<int64_t>(stored.size());
    for (int64_t k = 0; k < kPieces && bytes > 0; ++k) {
      const int64_t begin = std::min(bytes - 1, bytes * k / kPieces);
      hash.update(data + begin, static_cast<size_t>(std::min(kPieceBytes, bytes - begin)));
    }
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash.digest()));
  return hex;
}

std::vector<std::string> carry_hf_metadata(const std::string& source_dir,
                                           const std::string& export_dir, int64_t trained_seq_len) {
  namespace fs = std::filesystem;
  using nlohmann::json;
  std::vector<std::string> carried;
  auto read_json = [](const fs::path& path) {
    check_regular_file(path.string(), "model metadata file");
    std::ifstream in(path);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) throw Error("cannot read '" + path.string() + "'");
    return parse_json_input(text);
  };
  const fs::path source_config = fs::path(source_dir) / "config.json";
  const fs::path export_config = fs::path(export_dir) / "config.json";
  json source = read_json(source_config), exported = read_json(export_config);
  // Not carried: what the exported weights no longer are (quantized; in the source's dtype,
  // which Transformers 5 writes as `dtype` beside or instead of torch_dtype), and Transformers
  // 5's rope_parameters, which the written rope_theta and rope_scaling state already (a copy
  // could only repeat them, or contradict them where the run changed the RoPE).
  for (const auto& [key, value] : source.items()) {
    if (exported.contains(key) || key == "quantization_config" || key == "rope_parameters" ||
        key == "dtype" || key == "torch_dtype")
      continue;
    exported[key] = value;
    carried.push_back("config.json:" + key);
  }
  // The source's reach, or the longest sequences the run trained on when they are longer.
  const auto reach = source.find("max_position_embeddings");
  if (reach != source.end() && reach->is_number_integer()) {
    const int64_t positions = std::max(reach->get<int64_t>(), trained_seq_len);
    if (exported.value("max_position_embeddings", int64_t{0}) != positions) {
      exported["max_position_embeddings"] = positions;
      carried.push_back("config.json:max_position_embeddings");
    }
  }
  if (!carried.empty()) write_file_atomically(export_config.string(), exported.dump(2) + "\n");
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "tokenizer.model", "generation_config.json"}) {
    const fs::path from = fs::path(source_dir) / name;
    std::error_code ec;
    if (!fs::is_regular_file(from, ec)) continue;
    fs::copy_file(from, fs::path(export_dir) / name, fs::copy_options::overwrite_existing, ec);
    if (ec)
      throw Error("cannot copy '" + from.string() + "' into '" + export_dir + "': " + ec.message());
    carried.push_back(name);
  }
  return carried;
}

void load_hf_weights(nn::LlamaModel& model, const std::string& dir) {
  SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  refuse_bnb_4bit(ckpt, dir);
  autograd::NoGrad no_grad;
  std::map<std::string, Shape> expected;
  for (auto& [name, slot] : model.named_parameters()) expected[name] = slot->shape();
  check_hf_tensors(ckpt, expected, model.config().tie_embeddings, dir);
  model.materialize();  // a deferred model gets its storage here
  for (auto& [name, slot] : model.named_parameters()) {
    ckpt.load_into(name, *slot);
    check_finite(*slot, name, dir);
  }
}

void load_nf4_base_from_hf(nn::LlamaModel& model, const std::string& dir,
                           const std::function<void(int64_t done, int64_t total)>& on_projection) {
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  const std::set<std::string> quantized = bnb_quantized_weights(ckpt);
  autograd::NoGrad no_grad;
  // Every name and shape first, once, as load_hf_weights does: a wrong checkpoint is refused
  // before minutes of reading and quantizing (the quantized weights' pieces are checked as they
  // are read).
  {
    std::set<std::string> expected;
    for (auto& [name, slot] : model.named_parameters()) {
      if (quantized.count(name)) {
        for (const std::string& stored : bnb_tensor_names(name)) expected.insert(stored);
        continue;
      }
      check_dense_tensor(ckpt, name, slot->shape(), dir);
      expected.insert(name);
    }
    check_no_other_tensors(ckpt, expected, model.config().tie_embeddings, dir);
  }
  // The projections, one at a time: as stored, or quantized on the host from the dense weight
  // (the bits apply_lora's quantization of a loaded model gives).
  auto nf4_of = [&](const std::string& weight, const Shape& shape) {
    if (quantized.count(weight)) return read_bnb_nf4(ckpt, weight, shape, model.device());
    CategoryScope workspace(MemoryCategory::Workspace);
    const Tensor dense = ckpt.load(weight, Device::cpu(), DType::F32);
    check_finite(dense, weight, dir);
    return nn::Nf4Tensor::quantize(dense);
  };
  const int64_t total =
      model.num_layers() * static_cast<int64_t>(nn::lora_projection_names().size());
  int64_t done = 0;
  nn::install_nf4_projections(model, [&](const std::string& weight, const Shape& shape) {
    nn::Nf4Tensor q = nf4_of(weight, shape);
    if (on_projection) on_projection(++done, total);
    return q;
  });
  // Everything else dense: as stored, or dequantized when bitsandbytes quantized it too.
  model.materialize();
  for (auto& [name, slot] : model.named_parameters()) {
    if (quantized.count(name)) {
      CategoryScope workspace(MemoryCategory::Workspace);
      slot->copy_from(
          read_bnb_nf4(ckpt, name, slot->shape(), model.device()).dequantize(slot->dtype()));
    } else {
      ckpt.load_into(name, *slot);
    }
    check_finite(*slot, name, dir);
  }
}

void load_hf_weights(fsdp::ShardedModel& model, const std::string& dir) {
  SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  refuse_bnb_4bit(ckpt, dir);
  std::map<std::string, Shape> expected;
  for (int u = 0; u < model.num_units(); ++u)
    for (const auto& e : model.unit_layout(u).entries) expected[e.name] = e.shape;
  check_hf_tensors(ckpt, expected, model.model().config().tie_embeddings, dir);
  autograd::NoGrad no_grad;
  model.load_full_parameters([&](const std::string& name) {
    // A zero-copy view of the mapped bytes: only the elements this rank keeps are read.
    try {
      return ckpt.file_of(name).view(name);
    } catch (const FormatError&) {
      // Bytes not aligned to the element size cannot be viewed: copy this one tensor.
      CategoryScope scope(MemoryCategory::Workspace);
      return ckpt.load(name, Device::host());
    }
  });
  // As the unsharded load does, refuse NaN or infinite weights by name. Each rank checks the
  // elements it keeps, and all of them agree before any throws (one throwing alone would leave
  // the others waiting in the next collective).
  std::string bad;
  for (const optim::NamedParam& piece : model.optimizer_params())
    if (bad.empty() && !std::isfinite(backend_for(piece.param->device()).sum_squares(*piece.param)))
      bad = piece.name;
  if (model.any_rank(!bad.empty()))
    throw FormatError(
        "model weights in '" + dir + "': " +
        (bad.empty() ? std::string("another rank found a tensor") : "tensor '" + bad + "'") +
        " holds NaN or infinite values (a damaged or wrongly converted file)");
}

namespace {

std::vector<TensorDecl> declare_parameters(fsdp::ShardedModel& model, DType dtype) {
  std::vector<TensorDecl> decls;
  for (int u = 0; u < model.num_units(); ++u)
    for (const auto& e : model.unit_layout(u).entries) decls.push_back({e.name, dtype, e.shape});
  return decls;
}

void write_hf_config(const nn::LlamaConfig& config, const std::string& dir, DType dtype) {
  write_file_atomically(dir + "/config.json", config.to_hf_json(dtype) + "\n");
}

constexpr const char* kHfMetadataFormat = "pt";

void check_export_dtype(DType dtype) {
  ST_CHECK_AS(ConfigError, dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16,
              "a model is exported in f32, bf16 or f16 (train.export_dtype), not ",
              dtype_name(dtype));
}

}  // namespace

Tensor weight_for_export(const std::string& name, const Tensor& weight, DType dtype) {
  check_export_dtype(dtype);
  if (weight.dtype() == dtype) return weight.detach();
  Tensor converted = weight.to(dtype);
  // Only a narrowing to fp16 can overflow (bf16 has fp32's range). A weight that was finite and
  // is not after the conversion held a value past 65504: refuse it rather than write infinity.
  if (dtype == DType::F16 &&
      !std::isfinite(backend_for(converted.device()).sum_squares(converted)) &&
      std::isfinite(backend_for(weight.device()).sum_squares(weight)))
    throw ConfigError("tensor '" + name +
                      "' has values beyond fp16's range (65504), which an fp16 export would "
                      "write as infinity: set train.export_dtype to bf16 or fp32");
  return converted;
}

void save_hf_model(nn::LlamaModel& model, const std::string& dir, int64_t max_shard_bytes,
                   DType dtype) {
  check_export_dtype(dtype);
  // Declared first and streamed one converted tensor at a time: the files are the ones
  // save_sharded would write, without a converted copy of the whole model.
  std::vector<std::pair<std::string, Tensor*>> params = model.named_parameters();
  std::vector<TensorDecl> decls;
  for (const auto& [name, slot] : params) decls.push_back({name, dtype, slot->shape()});
  ShardedSafetensorsWriter out(dir, decls, max_shard_bytes, {{"format", kHfMetadataFormat}});
  {
    autograd::NoGrad no_grad;
    CategoryScope workspace(MemoryCategory::Workspace);
    for (const auto& [name, slot] : params) out.write(name, weight_for_export(name, *slot, dtype));
  }
  out.commit();
  write_hf_config(model.config(), dir, dtype);
}

void save_hf_model(fsdp::ShardedModel& model, const std::string& dir, int64_t max_shard_bytes,
                   DType dtype) {
  check_export_dtype(dtype);
  dist::ProcessGroup* replicas = model.replicate_group();
  const bool writes =
      model.shard_group().rank() == 0 && (replicas == nullptr || replicas->rank() == 0);
  // The writing rank catches its errors and goes on joining the gathers: throwing out of them
  // would leave the other ranks blocked in the next one. Every rank learns of the failure below.
  std::string error;
  std::optional<ShardedSafetensorsWriter> out;
  if (writes) {
    try {
      out.emplace(dir, declare_parameters(model, dtype), max_shard_bytes,
                  std::map<std::string, std::string>{{"format", kHfMetadataFormat}});
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  {
    autograd::NoGrad no_grad;
    model.for_each_full_parameter([&](const std::string& name, const Tensor& full) {
      if (!out) return;
      try {
        CategoryScope workspace(MemoryCategory::Workspace);
        out->write(name, weight_for_export(name, full, dtype));
      } catch (const std::exception& e) {
        error = e.what();
        out.reset();  // removes the temporary files
      }
    });
  }
  if (out) {
    try {
      out->commit();
      write_hf_config(model.model().config(), dir, dtype);
    } catch (const std::exception& e) {
      error = e.what();
    }
    out.reset();
  }
  if (model.any_rank(!error.empty())) {
    if (!error.empty())
      throw Error("exporting the model to '" + dir + "' failed on the writing rank: " + error);
    throw Error("exporting the model to '" + dir +
                "' failed on the writing rank (rank 0; see its message)");
  }
}

}  // namespace shardtrain::io
