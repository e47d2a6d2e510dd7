#include "shardtrain/nn/lora.h"

#include <algorithm>
#include <cmath>
#include <typeinfo>

#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/core/suggest.h"
#include "shardtrain/nn/nf4.h"

namespace shardtrain::nn {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A seed per (layer, projection) so that each adapter's initialisation depends only on its place
// in the model, not on which other modules are targeted.
uint64_t module_seed(uint64_t seed, int layer, size_t projection) {
  return splitmix64(splitmix64(seed) + static_cast<uint64_t>(layer) * 16 + projection);
}

bool is_attention_projection(const std::string& name) {
  return name == "q_proj" || name == "k_proj" || name == "v_proj" || name == "o_proj";
}

std::unique_ptr<Linear>& projection_slot(DecoderLayer& layer, const std::string& name) {
  if (name == "q_proj") return layer.self_attn.q_proj;
  if (name == "k_proj") return layer.self_attn.k_proj;
  if (name == "v_proj") return layer.self_attn.v_proj;
  if (name == "o_proj") return layer.self_attn.o_proj;
  if (name == "gate_proj") return layer.mlp.gate_proj;
  if (name == "up_proj") return layer.mlp.up_proj;
  if (name == "down_proj") return layer.mlp.down_proj;
  throw ConfigError("no projection named '" + name + "'");
}

void install(DecoderLayer& layer, const std::string& name, std::unique_ptr<Linear> linear) {
  if (is_attention_projection(name))
    layer.self_attn.replace_projection(name, std::move(linear));
  else
    layer.mlp.replace_projection(name, std::move(linear));
}

bool is_adapter_parameter(const std::string& name) {
  auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends_with(".lora_A.weight") || ends_with(".lora_B.weight");
}

// Inverted dropout with a mask drawn on the host from a counter-based generator. The backward
// multiplies by the saved mask; the input itself is not kept.
struct LoraDropoutBackward : autograd::Node {
  autograd::SavedTensor mask;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor m = mask.unpack();
    Tensor dx = empty(g[0].shape(), g[0].dtype(), g[0].device());
    backend_for(g[0].device()).mul(g[0], m, dx);
    return {dx};
  }
  void release_saved() override { mask.release(); }
  std::string name() const override { return "LoraDropoutBackward"; }
};

Tensor lora_dropout(const Tensor& x, float p, Generator& gen) {
  std::vector<float> keep(static_cast<size_t>(x.numel()));
  gen.uniform(keep.data(), x.numel());
  const float kept = 1.0f / (1.0f - p);
  for (float& v : keep) v = v >= p ? kept : 0.0f;
  // An f32 mask keeps 1/(1-p) exact whatever the activation dtype.
  Tensor mask = from_floats(keep, x.shape(), DType::F32, x.device());
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).mul(x, mask, out);
  if (autograd::needs_graph({&x})) {
    auto node = std::make_shared<LoraDropoutBackward>();
    node->mask = autograd::SavedTensor(mask);
    autograd::attach(node, {&x}, {&out});
  }
  return out;
}

Tensor in_dtype(const Tensor& t, DType dtype) {
  return t.dtype() == dtype ? t : ops::cast(t, dtype);
}

}  // namespace

BaseQuantization parse_base_quantization(const std::string& name) {
  if (name == "nf4") return BaseQuantization::Nf4;
  if (name == "none") return BaseQuantization::None;
  throw ConfigError("lora.quantize_base: '" + name +
                    "' is not a base quantization; use nf4 or none");
}

const std::vector<std::string>& lora_projection_names() {
  static const std::vector<std::string> names = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"};
  return names;
}

void LoraOptions::validate() const {
  ST_CHECK_AS(ConfigError, r >= 1, "lora.r: the adapter rank must be at least 1, got ", r);
  ST_CHECK_AS(ConfigError, alpha > 0 && std::isfinite(alpha),
              "lora.alpha: must be a positive number, got ", alpha);
  ST_CHECK_AS(ConfigError, dropout >= 0 && dropout < 1, "lora.dropout: must be in [0, 1), got ",
              dropout);
  ST_CHECK_AS(ConfigError, !target_modules.empty(),
              "lora.target_modules: name at least one of q_proj, k_proj, v_proj, o_proj, "
              "gate_proj, up_proj, down_proj");
  const std::vector<std::string>& known = lora_projection_names();
  for (size_t i = 0; i < target_modules.size(); ++i) {
    const std::string& m = target_modules[i];
    if (std::find(known.begin(), known.end(), m) == known.end()) {
      std::string hint = closest_match(m, known);
      throw ConfigError("lora.target_modules: '" + m + "' is not a Llama projection" +
                        (hint.empty() ? "" : " (did you mean '" + hint + "'?)") +
                        "; use q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj");
    }
    for (size_t j = 0; j < i; ++j)
      ST_CHECK_AS(ConfigError, target_modules[j] != m, "lora.target_modules: '", m,
                  "' is listed twice");
  }
  ST_CHECK_AS(ConfigError, is_floating(frozen_dtype),
              "LoraOptions::frozen_dtype must be a float type, got ", dtype_name(frozen_dtype));
}

// ---- LoraLinear -----------------------------------------------------------------------------

LoraLinear::LoraLinear(std::unique_ptr<Linear> base, int64_t r, float alpha, float dropout,
                       uint64_t seed, Device device)
    : Linear(base ? base->in_features() : 0, base ? base->out_features() : 0),
      base_(std::move(base)),
      r_(r),
      alpha_(alpha),
      dropout_(dropout),
      dropout_gen_(splitmix64(seed ^ 0xD50F0A7D50F0A7D5ull)) {
  ST_CHECK_AS(ConfigError, base_ != nullptr, "LoraLinear needs a base projection");
  ST_CHECK_AS(ConfigError, r >= 1, "lora.r: the adapter rank must be at least 1, got ", r);
  {
    CategoryScope as_parameters(MemoryCategory::Parameters);
    Generator gen(seed);
    // kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in).
    const float bound = 1.0f / std::sqrt(static_cast<float>(in_features()));
    lora_A = rand_uniform({r, in_features()}, gen, -bound, bound, DType::F32, device);
    lora_B = zeros({out_features(), r}, DType::F32, device);
  }
  autograd::set_requires_grad(lora_A);
  autograd::set_requires_grad(lora_B);
  register_parameter("lora_A.weight", &lora_A);
  register_parameter("lora_B.weight", &lora_B);
  register_child("base_layer", base_.get());
}

Tensor LoraLinear::forward(const Tensor& x) {
  Tensor y = base_->forward(x);
  Tensor h = dropout_ > 0 && is_training() ? lora_dropout(x, dropout_, dropout_gen_) : x;
  // Scaling the [.., r] intermediate costs r/out of scaling the output and is the same product.
  Tensor z = ops::scale(ops::linear(h, in_dtype(lora_A, x.dtype())), scale());
  return ops::add(y, ops::linear(z, in_dtype(lora_B, x.dtype())));
}

Tensor LoraLinear::merged_weight() const {
  autograd::NoGrad no_grad;
  Tensor w = dense_weight(*base_);
  // An f32 base weight comes back as itself: merge into a copy.
  if (base_->weight.defined() && base_->weight.dtype() == DType::F32) w = w.clone();
  Tensor a = in_dtype(lora_A.detach(), DType::F32), b = in_dtype(lora_B.detach(), DType::F32);
  GemmArgs args;  // W [out, in] += scale * B [out, r] @ A [r, in]
  args.m = out_features();
  args.n = in_features();
  args.k = r_;
  args.alpha = scale();
  args.beta = 1.0f;
  backend_for(w.device()).gemm(args, b, a, w);
  return w;
}

// ---- apply_lora -----------------------------------------------------------------------------

LoraSummary apply_lora(LlamaModel& model, const LoraOptions& options) {
  options.validate();
  autograd::NoGrad no_grad;
  LoraSummary summary;
  const std::vector<std::string>& names = lora_projection_names();
  auto targeted = [&](const std::string& name) {
    return std::find(options.target_modules.begin(), options.target_modules.end(), name) !=
           options.target_modules.end();
  };
  for (int l = 0; l < model.num_layers(); ++l) {
    DecoderLayer& layer = *model.layers[static_cast<size_t>(l)];
    for (size_t p = 0; p < names.size(); ++p) {
      const std::string& name = names[p];
      std::unique_ptr<Linear>& slot = projection_slot(layer, name);
      ST_CHECK_AS(ConfigError, dynamic_cast<LoraLinear*>(slot.get()) == nullptr,
                  "apply_lora: model.layers.", l, ".", name,
                  " already has a LoRA adapter (apply_lora was called twice)");
      // Like bitsandbytes' load_in_4bit, every projection is quantized, targeted or not.
      std::unique_ptr<Linear> base;
      if (options.quantize_base == BaseQuantization::Nf4 &&
          dynamic_cast<Nf4Linear*>(slot.get()) == nullptr)
        base = Nf4Linear::from_linear(*slot);
      else
        base = std::move(slot);
      if (targeted(name)) {
        base =
            std::make_unique<LoraLinear>(std::move(base), options.r, options.alpha, options.dropout,
                                         module_seed(options.seed, l, p), model.device());
        ++summary.adapted_modules;
      }
      // Replacing the slot drops the dense projection when it was quantized.
      install(layer, name, std::move(base));
    }
  }

  for (auto& [name, slot] : model.named_parameters()) {
    if (is_adapter_parameter(name)) {
      summary.trainable_parameters += slot->numel();
      continue;
    }
    autograd::set_requires_grad(*slot, false);
    autograd::set_grad(*slot, Tensor());
    if (is_floating(slot->dtype()) && slot->dtype() != options.frozen_dtype) {
      CategoryScope as_parameters(MemoryCategory::Parameters);
      *slot = slot->to(options.frozen_dtype);
    }
    summary.frozen_parameters += slot->numel();
  }
  for (auto& layer : model.layers)
    for (const std::string& name : names) {
      const Linear* p = projection_slot(*layer, name).get();
      if (auto* lora = dynamic_cast<const LoraLinear*>(p)) p = &lora->base();
      if (auto* q = dynamic_cast<const Nf4Linear*>(p)) {
        summary.frozen_parameters += q->quantized_weight().numel();
        summary.nf4_bytes += q->quantized_weight().nbytes();
      }
    }
  return summary;
}

namespace {
// A projection's Hugging Face module path: "model.layers.<layer>.self_attn.q_proj", ...
std::string projection_path(int layer, const std::string& name) {
  return "model.layers." + std::to_string(layer) +
         (is_attention_projection(name) ? ".self_attn." : ".mlp.") + name;
}
}  // namespace

std::vector<std::pair<std::string, Linear*>> decoder_projections(LlamaModel& model) {
  std::vector<std::pair<std::string, Linear*>> out;
  for (int l = 0; l < model.num_layers(); ++l) {
    DecoderLayer& layer = *model.layers[static_cast<size_t>(l)];
    for (const std::string& name : lora_projection_names())
      out.emplace_back(projection_path(l, name), projection_slot(layer, name).get());
  }
  return out;
}

void install_nf4_projections(
    LlamaModel& model,
    const std::function<Nf4Tensor(const std::string&, const Shape&)>& weight_of) {
  autograd::NoGrad no_grad;
  for (int l = 0; l < model.num_layers(); ++l) {
    DecoderLayer& layer = *model.layers[static_cast<size_t>(l)];
    for (const std::string& name : lora_projection_names()) {
      Linear& dense = *projection_slot(layer, name);
      const std::string weight = projection_path(l, name) + ".weight";
      ST_CHECK_AS(ConfigError, typeid(dense) == typeid(Linear), "install_nf4_projections: ", weight,
                  " is already NF4 or adapted (install the NF4 base once, before "
                  "apply_lora)");
      const Shape shape = {dense.out_features(), dense.in_features()};
      Nf4Tensor q = weight_of(weight, shape);
      ST_CHECK_SHAPE(q.shape == shape, "install_nf4_projections: the NF4 weight for ", weight,
                     " has shape ", shape_str(q.shape), ", the projection ", shape_str(shape));
      if (q.device() != model.device()) {
        CategoryScope as_parameters(MemoryCategory::Parameters);
        q.codes = q.codes.to(model.device());
        q.absmax_q = q.absmax_q.to(model.device());
        q.absmax_scale = q.absmax_scale.to(model.device());
      }
      install(layer, name, std::make_unique<Nf4Linear>(std::move(q)));
    }
  }
}

std::vector<std::pair<std::string, LoraLinear*>> lora_modules(LlamaModel& model) {
  std::vector<std::pair<std::string, LoraLinear*>> out;
  for (auto& [path, projection] : decoder_projections(model))
    if (auto* lora = dynamic_cast<LoraLinear*>(projection)) out.emplace_back(path, lora);
  return out;
}

Tensor dense_weight(const Linear& linear) {
  if (auto* lora = dynamic_cast<const LoraLinear*>(&linear)) return lora->merged_weight();
  if (auto* q = dynamic_cast<const Nf4Linear*>(&linear)) return q->dequantized_weight(DType::F32);
  ST_CHECK_SHAPE(linear.weight.defined(), "dense_weight: the projection has no weight");
  return linear.weight.dtype() == DType::F32 ? linear.weight.detach()
                                             : linear.weight.to(DType::F32);
}

}  // namespace shardtrain::nn
