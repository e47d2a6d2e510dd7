#include "shardtrain/io/hf_model.h"

#include <filesystem>
#include <fstream>
#include <map>

#include "shardtrain/autograd/grad_mode.h"
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
    if (name == "lm_head.weight" && tied_embeddings) continue;
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
  for (auto& [name, slot] : model.named_parameters()) ckpt.load_into(name, *slot);
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

void save_hf_model(nn::LlamaModel& model, const std::string& dir, int64_t max_shard_bytes) {
  std::filesystem::create_directories(dir);
  NamedTensors tensors;
  for (auto& [name, slot] : model.named_parameters()) tensors.emplace_back(name, slot->detach());
  save_sharded(dir, tensors, max_shard_bytes, {{"format", "pt"}});
  std::string tmp = dir + "/config.json.tmp";
  {
    std::ofstream out(tmp);
    out << model.config().to_hf_json() << "\n";
    if (!out) throw Error("cannot write '" + tmp + "'");
  }
  std::filesystem::rename(tmp, dir + "/config.json");
}

}  // namespace shardtrain::io
