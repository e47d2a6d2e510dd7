// A Llama in the Hugging Face layout on disk: config.json + model.safetensors (or shards with
// model.safetensors.index.json), under the parameter names the model already uses.
#pragma once
#include <functional>
#include <string>
#include <vector>

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

// Loads the base of a QLoRA run from the Hugging Face directory `dir` into `model` (best built
// nn::ParameterStorage::Deferred; not yet adapted): each decoder projection becomes an
// nn::Nf4Linear (nn::install_nf4_projections), its codes taken as stored from a bitsandbytes
// 4-bit checkpoint (io/bnb.h) or quantized on the host from the dense weight, one projection at a
// time, so the model never exists dense on the device; then the other parameters are allocated
// and loaded dense (a weight bitsandbytes quantized outside the projections is dequantized into
// its parameter). The checks of load_hf_weights apply. apply_lora keeps these NF4 projections.
// `on_projection`, when given, is told after each projection how many of how many are done.
void load_nf4_base_from_hf(
    nn::LlamaModel& model, const std::string& dir,
    const std::function<void(int64_t done, int64_t total)>& on_projection = nullptr);

// A fingerprint of the weights in `dir` (hex): every tensor's name, dtype and shape and 1 KiB of
// its bytes sampled evenly across it. It tells two models of the same shape apart without
// reading them whole (a LoRA checkpoint records its frozen base this way); it is not a hash of
// every byte.
std::string hf_weights_fingerprint(const std::string& dir);

// After an export of a model loaded from `source_dir` (model.from_hf) into `export_dir`: copies
// what the export does not compute but tools downstream need. config.json's fields the export
// does not write (bos/eos/pad token ids, ...; not quantization_config, which described the
// source's storage) join the exported config.json, and the tokenizer and generation files
// (tokenizer.json, tokenizer_config.json, special_tokens_map.json, tokenizer.model,
// generation_config.json) are copied as they are. max_position_embeddings stays the source's
// unless the run trained on longer sequences (`trained_seq_len`): the model built for training
// may allow more (model.max_seq_len), which says nothing about what the weights learned.
// Returns the names carried over.
std::vector<std::string> carry_hf_metadata(const std::string& source_dir,
                                           const std::string& export_dir, int64_t trained_seq_len);

// Writes config.json and the weights, converted to `dtype` (f32, bf16 or f16; config.json's
// torch_dtype says which) and split into shard files past `max_shard_bytes` (see
// ShardedSafetensorsWriter), into `dir`. One tensor at a time is converted and copied to the
// host, so the export needs at most one weight's worth of memory beyond the model.
void save_hf_model(nn::LlamaModel& model, const std::string& dir,
                   int64_t max_shard_bytes = int64_t{5} << 30, DType dtype = DType::F32);

// The same for a sharded model, byte for byte the files save_hf_model writes for the equivalent
// full model, without ever building it. Collective: every rank calls it. The files are declared
// from the units' names and shapes, then every rank gathers the weights one unit at a time and
// the writing rank (rank 0 of both the shard and the replicate group: world rank 0 in a training
// job) streams each parameter into its place, so it holds at most one gathered unit, plus one
// parameter converted to `dtype` (unless f32) and one in host memory when the model is on a GPU.
// A failure on the writing rank (a full disk, an unwritable `dir`, an fp16 overflow) throws Error
// on every rank once the gathers are done, so no rank is left waiting in a collective; nothing
// is published under `dir` then (the files stay under temporary names, which are removed).
void save_hf_model(fsdp::ShardedModel& model, const std::string& dir,
                   int64_t max_shard_bytes = int64_t{5} << 30, DType dtype = DType::F32);

// `weight` (named `name`) converted to `dtype` for an export, on its device. Throws ConfigError
// naming the tensor when a finite value is beyond the dtype's range (fp16: 65504), which the
// conversion would have written as infinity.
Tensor weight_for_export(const std::string& name, const Tensor& weight, DType dtype);

}  // namespace shardtrain::io
