// LoRA adapters on a frozen (optionally NF4-quantized) Llama, with PEFT's semantics:
//   y = base(x) + (alpha / r) * (dropout(x) @ A^T) @ B^T,   A [r, in], B [out, r]
// A starts Kaiming-uniform (PEFT: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in))),
// B starts at zero, so an adapted model computes exactly what its base computes until B moves.
//
// Use, in this order: build the model, load or initialise its weights, apply_lora(), then the
// wrappers (activation checkpointing, mixed precision) and the optimizer over the parameters that
// require a gradient (only the adapters). Loading base weights with io::load_hf_weights must come
// before apply_lora: afterwards the projections have new parameter names and NF4 bases have none.
// A base loaded already quantized (install_nf4_projections, io::load_nf4_base_from_hf) is kept.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/nn/llama.h"
#include "shardtrain/nn/nf4.h"

namespace shardtrain::nn {

enum class BaseQuantization { None, Nf4 };
// "none" | "nf4"; anything else throws ConfigError naming lora.quantize_base.
BaseQuantization parse_base_quantization(const std::string& name);

// The projections adapters can be put on, in Hugging Face order.
const std::vector<std::string>& lora_projection_names();

struct LoraOptions {
  int64_t r = 16;
  float alpha = 32.0f;
  float dropout = 0.0f;  // probability; 0 = off
  std::vector<std::string> target_modules = lora_projection_names();
  BaseQuantization quantize_base = BaseQuantization::Nf4;
  // The dtype frozen floating parameters (embeddings, norms, head, plain base projections) are
  // stored in after apply_lora. F32 keeps them; BF16 halves their memory (mixed precision leaves
  // non-F32 slots alone, so they are used as they are).
  DType frozen_dtype = DType::F32;
  uint64_t seed = 0;  // adapter initialisation and dropout masks

  float scale() const { return alpha / static_cast<float>(r); }
  // Throws ConfigError naming the lora.* key for an out-of-range value or unknown module.
  void validate() const;
};

// One adapted projection. Registers "lora_A.weight" and "lora_B.weight" (fp32, requiring a
// gradient) and the wrapped projection as child "base_layer" (PEFT's in-memory names).
class LoraLinear : public Linear {
 public:
  // `seed` fixes A's initialisation and the dropout masks. A and B live on `device`.
  LoraLinear(std::unique_ptr<Linear> base, int64_t r, float alpha, float dropout, uint64_t seed,
             Device device);

  Tensor forward(const Tensor& x) override;

  Linear& base() { return *base_; }
  const Linear& base() const { return *base_; }
  int64_t rank() const { return r_; }
  float alpha() const { return alpha_; }
  float scale() const { return alpha_ / static_cast<float>(r_); }
  float dropout() const { return dropout_; }
  // The generator of the dropout masks (state saved with checkpoints and restored for recompute
  // by code that needs bitwise-identical masks).
  Generator& dropout_generator() { return dropout_gen_; }

  // W + scale * B @ A as an f32 tensor on the module's device (the base dequantized if NF4).
  Tensor merged_weight() const;

  Tensor lora_A;  // [r, in]
  Tensor lora_B;  // [out, r]

 private:
  std::unique_ptr<Linear> base_;
  int64_t r_;
  float alpha_, dropout_;
  Generator dropout_gen_;
};

struct LoraSummary {
  int64_t adapted_modules = 0;
  int64_t trainable_parameters = 0;  // adapter elements
  int64_t frozen_parameters = 0;     // every other weight, NF4 ones included
  int64_t nf4_bytes = 0;             // storage of the quantized bases
};

// Wraps every target projection of every layer in a LoraLinear (its base quantized to NF4 first
// when options.quantize_base is Nf4, the dense weight then freed), freezes every other parameter
// (requires_grad false, gradients dropped) and converts frozen parameters to
// options.frozen_dtype. Throws ConfigError for invalid options and when a projection already
// has an adapter.
LoraSummary apply_lora(LlamaModel& model, const LoraOptions& options);

// Every decoder projection of the model (whatever it is now: dense, NF4, adapted) with its
// Hugging Face module path ("model.layers.3.self_attn.q_proj"), in layer and projection order.
std::vector<std::pair<std::string, Linear*>> decoder_projections(LlamaModel& model);

// Replaces every decoder projection, each a plain Linear (dense or deferred, see
// ParameterStorage; anything else is a ConfigError), by an Nf4Linear holding `weight_of(weight
// name, shape)`, moved to the model's device if it was produced elsewhere; weight names are Hugging
// Face's
// ("model.layers.0.self_attn.q_proj.weight"), in layer and projection order. With a model built
// Deferred no projection is ever dense on the device: a base of billions of weights is built in
// the memory of its NF4 codes plus whatever `weight_of` holds for one projection. apply_lora
// keeps these projections as its NF4 bases.
void install_nf4_projections(
    LlamaModel& model, const std::function<Nf4Tensor(const std::string&, const Shape&)>& weight_of);

// Every adapted projection with its module path ("model.layers.3.self_attn.q_proj"), in layer
// and projection order.
std::vector<std::pair<std::string, LoraLinear*>> lora_modules(LlamaModel& model);

// The f32 weight [out, in] a projection computes with: its weight, its dequantized NF4 weight, or
// the merged weight of an adapter (for export).
Tensor dense_weight(const Linear& linear);

}  // namespace shardtrain::nn
