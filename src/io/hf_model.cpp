#include "shardtrain/io/hf_model.h"

#include <cmath>
#include <map>
#include <optional>
#include <vector>

#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/io/safetensors.h"

namespace shardtrain::io {

namespace {
// Checks that the checkpoint holds exactly the tensors `expected` names, at their shapes.
void check_hf_tensors(const SafetensorsCheckpoint& ckpt,
                      const std::map<std::string, Shape>& expected, bool tied_embeddings,
                      const std::string& dir) {
  for (const auto& [name, shape] : expected) {
    if (!ckpt.contains(name))
      throw FormatError("model weights in '" + dir + "' have no tensor '" + name +
                        "' (is the checkpoint for a different model shape?)");
    const Shape& stored = ckpt.info(name).shape;
    if (stored != shape)
      throw FormatError("model weights in '" + dir + "': tensor '" + name + "' has shape " +
                        shape_str(stored) + " but the model expects " + shape_str(shape) +
                        " (is the checkpoint for a different model shape?)");
  }
  for (const std::string& name : ckpt.names()) {
    if (expected.count(name)) continue;
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
}  // namespace

void load_hf_weights(nn::LlamaModel& model, const std::string& dir) {
  SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  autograd::NoGrad no_grad;
  std::map<std::string, Shape> expected;
  for (auto& [name, slot] : model.named_parameters()) expected[name] = slot->shape();
  check_hf_tensors(ckpt, expected, model.config().tie_embeddings, dir);
  model.materialize();  // a deferred model gets its storage here
  for (auto& [name, slot] : model.named_parameters()) {
    ckpt.load_into(name, *slot);
    // A NaN or infinity in the weights would surface steps later as a diverged loss; name the
    // tensor now (the sum of squares of finite weights stays finite in double precision).
    const double squares = backend_for(slot->device()).sum_squares(*slot);
    if (!std::isfinite(squares))
      throw FormatError("model weights in '" + dir + "': tensor '" + name +
                        "' holds NaN or infinite values (a damaged or wrongly converted file)");
  }
}

void load_hf_weights(fsdp::ShardedModel& model, const std::string& dir) {
  SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
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
}

namespace {

std::vector<TensorDecl> declare_parameters(fsdp::ShardedModel& model) {
  std::vector<TensorDecl> decls;
  for (int u = 0; u < model.num_units(); ++u)
    for (const auto& e : model.unit_layout(u).entries)
      decls.push_back({e.name, DType::F32, e.shape});
  return decls;
}

void write_hf_config(const nn::LlamaConfig& config, const std::string& dir) {
  write_file_atomically(dir + "/config.json", config.to_hf_json() + "\n");
}

constexpr const char* kHfMetadataFormat = "pt";

}  // namespace

void save_hf_model(nn::LlamaModel& model, const std::string& dir, int64_t max_shard_bytes) {
  NamedTensors tensors;
  for (auto& [name, slot] : model.named_parameters()) tensors.emplace_back(name, slot->detach());
  save_sharded(dir, tensors, max_shard_bytes, {{"format", kHfMetadataFormat}});
  write_hf_config(model.config(), dir);
}

void save_hf_model(fsdp::ShardedModel& model, const std::string& dir, int64_t max_shard_bytes) {
  dist::ProcessGroup* replicas = model.replicate_group();
  const bool writes =
      model.shard_group().rank() == 0 && (replicas == nullptr || replicas->rank() == 0);
  // The writing rank catches its errors and goes on joining the gathers: throwing out of them
  // would leave the other ranks blocked in the next one. Every rank learns of the failure below.
  std::string error;
  std::optional<ShardedSafetensorsWriter> out;
  if (writes) {
    try {
      out.emplace(dir, declare_parameters(model), max_shard_bytes,
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
        out->write(name, full);
      } catch (const std::exception& e) {
        error = e.what();
        out.reset();  // removes the temporary files
      }
    });
  }
  if (out) {
    try {
      out->commit();
      write_hf_config(model.model().config(), dir);
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
