// Llama checkpoints quantized by bitsandbytes to 4 bits (Transformers' BitsAndBytesConfig with
// load_in_4bit, bnb_4bit_quant_type "nf4" and bnb_4bit_use_double_quant, saved with
// save_pretrained), read as the frozen NF4 base of a QLoRA run without a dense copy on disk. Each
// quantized weight W (a projection's "<module>.weight") is stored as
//   W                                        U8  [ceil(n/2), 1]  the packed 4-bit codes
//   W.absmax                                 U8  [ceil(n/64)]    double-quantized block absmax
//   W.nested_absmax                          F32 [ceil(n/64/256)]
//   W.quant_map                              F32 [16]            the NF4 table
//   W.nested_quant_map                       F32 [256]           the dynamic 8-bit map
//   W.quant_state.bitsandbytes__nf4          U8  [k]             JSON: quant_type, blocksize,
//                                                                dtype, shape, nested_blocksize,
//                                                                nested_offset, nested_dtype
// which is this project's NF4 layout (backend/nf4_codebook.h) under other names: the codes, the
// absmax indices, the group scales and the offset are taken as they are. Everything else
// (embeddings, norms, the head) is stored dense, in the model's dtype.
#pragma once
#include <set>
#include <string>
#include <vector>

#include "shardtrain/io/safetensors.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/nn/nf4.h"

namespace shardtrain::io {

// Whether `ckpt` holds bitsandbytes 4-bit weights (any "*.quant_state.bitsandbytes__*" tensor).
// io::load_nf4_base_from_hf (hf_model.h) loads such a checkpoint as a QLoRA base.
bool holds_bnb_4bit_weights(const SafetensorsCheckpoint& ckpt);

// The NF4 weight stored under `weight_name` (e.g. "model.layers.0.self_attn.q_proj.weight") on
// `device`, counted as Parameters memory. Throws FormatError naming the directory, the tensor and
// what is wrong: a missing piece, FP4 or another quant type, a block size other than 64 (nested:
// 256), block statistics that are not double-quantized, a quant map that is not the NF4 table or
// a nested map that is not the dynamic 8-bit map (beyond float rounding), another shape than
// `expected`, or pieces of the wrong size or dtype. The packed codes are read as bytes whatever
// dtype stores them (bnb_4bit_quant_storage).
nn::Nf4Tensor read_bnb_nf4(const SafetensorsCheckpoint& ckpt, const std::string& weight_name,
                           const Shape& expected, Device device);

// The weights of `ckpt` stored quantized: the W of every "W.quant_state.bitsandbytes__<type>".
std::set<std::string> bnb_quantized_weights(const SafetensorsCheckpoint& ckpt);
// The names bitsandbytes may store for the quantized weight W: W, its NF4 pieces, and the FP4
// quant state (which read_bnb_nf4 refuses by name).
std::vector<std::string> bnb_tensor_names(const std::string& weight_name);

// Writes `model`, whose decoder projections are all nn::Nf4Linear (not adapted: an
// io::load_nf4_base_from_hf result), into `dir` in the layout above: each projection's codes,
// absmax indices, group scales and offset as bitsandbytes stores them, the other parameters dense
// in `dense_dtype` (bf16, f16 or f32), and config.json with bitsandbytes' quantization_config, so
// that Transformers loads it as a 4-bit model and lora.base_model skips the quantization. Files
// are written whole or not at all (temporary names, renamed when complete). Throws ConfigError
// when a projection is dense or adapted.
void save_bnb_4bit_model(nn::LlamaModel& model, const std::string& dir,
                         DType dense_dtype = DType::BF16);

}  // namespace shardtrain::io
