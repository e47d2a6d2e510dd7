#include "shardtrain/io/hf_model.h"

#include <filesystem>
#include <fstream>
#include <set>

#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/io/safetensors.h"

namespace shardtrain::io {

void load_hf_weights(nn::LlamaModel& model, const std::string& dir) {
  SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  autograd::NoGrad no_grad;
  std::set<std::string> expected;
  for (auto& [name, slot] : model.named_parameters()) {
    expected.insert(name);
    if (!ckpt.contains(name))
      throw FormatError("model weights in '" + dir + "' have no tensor '" + name +
                        "' (is the checkpoint for a different model shape?)");
    ckpt.load_into(name, *slot);
  }
  for (const std::string& name : ckpt.names()) {
    if (expected.count(name)) continue;
    // Hugging Face stores rotary inverse frequencies in some exports; they are recomputed here.
    if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;
    if (name == "lm_head.weight" && model.config().tie_embeddings) continue;
    throw FormatError("model weights in '" + dir + "' have tensor '" + name +
                      "' that this model does not (model section of the config does not match "
                      "the checkpoint)");
  }
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
