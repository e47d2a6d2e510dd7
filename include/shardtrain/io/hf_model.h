// A Llama in the Hugging Face layout on disk: config.json + model.safetensors (or shards with
// model.safetensors.index.json), under the parameter names the model already uses.
#pragma once
#include <string>

#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/nn/llama.h"

namespace shardtrain::io {

// Copies every parameter of `model` from the checkpoint in `dir` (converting dtypes to the
// parameter's). A missing tensor or a shape mismatch is a FormatError naming the file and
// tensor; tensors in the files that the model does not have are an error too (a wrong model).
void load_hf_weights(nn::LlamaModel& model, const std::string& dir);

// The same for a sharded model (no communication; every rank calls it): the same checks, then
// each rank copies only the elements of its own shards, one tensor at a time, straight from the
// memory-mapped files, so no rank ever holds the full model.
void load_hf_weights(fsdp::ShardedModel& model, const std::string& dir);

// Writes config.json and the weights (fp32, sharded past `max_shard_bytes`) into `dir`.
void save_hf_model(nn::LlamaModel& model, const std::string& dir,
                   int64_t max_shard_bytes = int64_t{5} << 30);

}  // namespace shardtrain::io
