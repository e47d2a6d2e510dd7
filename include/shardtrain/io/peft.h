// LoRA adapters in Hugging Face PEFT's on-disk format, merged exports, and NF4 base weights in
// safetensors.
//
// An adapter directory holds
//   adapter_config.json        PEFT LoraConfig (peft_type LORA, task_type CAUSAL_LM, r,
//                              lora_alpha, lora_dropout, target_modules, ...)
//   adapter_model.safetensors  base_model.model.<module>.lora_A.weight [r, in] and
//                              base_model.model.<module>.lora_B.weight [out, r], f32, where
//                              <module> is e.g. model.layers.0.self_attn.q_proj (PEFT drops the
//                              adapter name "default" when saving)
// so `PeftModel.from_pretrained(base, dir)` loads it, and a directory written by PEFT for these
// target modules loads here.
#pragma once
#include <cstdint>
#include <string>

#include "shardtrain/io/safetensors.h"
#include "shardtrain/nn/lora.h"
#include "shardtrain/nn/nf4.h"

namespace shardtrain::io {

constexpr const char* kAdapterConfigFile = "adapter_config.json";
constexpr const char* kAdapterWeightsFile = "adapter_model.safetensors";

// The safetensors name PEFT gives an adapter matrix: "base_model.model.<module>.lora_A.weight".
std::string peft_tensor_name(const std::string& module, bool lora_b);

// Writes both files into `dir` (created if missing). r, alpha, dropout and target_modules come
// from the model's adapters (which must agree across modules); `base_model` is recorded as
// base_model_name_or_path. Throws ConfigError when the model has no adapters.
void save_peft_adapter(nn::LlamaModel& model, const std::string& dir,
                       const std::string& base_model = "");

// Reads adapter_config.json into options (r, alpha, dropout, target_modules; quantize_base and
// seed keep their defaults). Throws ConfigError when the file is missing and FormatError naming
// the file and key for a wrong peft_type, a missing key or an unsupported feature (DoRA, rsLoRA,
// fan_in_fan_out, bias other than "none").
nn::LoraOptions read_peft_config(const std::string& dir, std::string* base_model = nullptr);

// Copies the adapter weights of `dir` into a model with matching adapters (apply_lora first,
// e.g. with read_peft_config's options). Throws FormatError naming the file and tensor when a
// tensor is missing, has another shape, or belongs to no adapter of the model, and when the
// config's r or lora_alpha differ from the model's.
void load_peft_adapter(nn::LlamaModel& model, const std::string& dir);

// Writes the model in the Hugging Face layout (config.json + model.safetensors, sharded past
// max_shard_bytes) with every projection dense: W + (alpha/r) B A for adapted ones, the
// dequantized NF4 weight for quantized ones. Tensors are `dtype` (f32, bf16 or f16, as for
// save_hf_model); each is moved to the host pool as it is produced so the device holds one dense
// weight at a time.
void save_merged_hf_model(nn::LlamaModel& model, const std::string& dir, DType dtype = DType::F32,
                          int64_t max_shard_bytes = int64_t{5} << 30);

// ---- NF4 tensors in safetensors ---------------------------------------------------------------
// A quantized weight named P is stored as five tensors:
//   P.nf4.codes          U8  [ceil(n/2)]
//   P.nf4.absmax         U8  [ceil(n/64)]
//   P.nf4.absmax_scale   F32 [ceil(n/64/256)]
//   P.nf4.absmax_offset  F32 [1]
//   P.nf4.shape          I64 [rank]
// (see backend/nf4_codebook.h for their meaning).
void append_nf4(NamedTensors& out, const std::string& name, const nn::Nf4Tensor& tensor);
// Throws FormatError naming the file and tensor when a piece is missing or inconsistent.
nn::Nf4Tensor read_nf4(const SafetensorsFile& file, const std::string& name,
                       Device device = Device::cpu());

// Saves every NF4 projection of the model (base of an adapter or not) under its Hugging Face
// weight name ("model.layers.0.self_attn.q_proj.weight") to one safetensors file, so a later run
// can skip quantization. Throws ConfigError when the model has no NF4 projection.
void save_nf4_base(nn::LlamaModel& model, const std::string& path);
// Replaces the codes of every NF4 projection of the model with those in `path` (on the model's
// device). Throws FormatError naming the file and tensor for missing or mismatched weights.
void load_nf4_base(nn::LlamaModel& model, const std::string& path);

}  // namespace shardtrain::io
