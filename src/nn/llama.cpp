#include "shardtrain/nn/llama.h"

#include <algorithm>

#include "shardtrain/autograd/grad_mode.h"

namespace shardtrain::nn {

// ---- Attention ------------------------------------------------------------------------------

Attention::Attention(const LlamaConfig& c, int layer_index, Device device)
    : config_(c), layer_(layer_index) {
  int64_t h = c.hidden_size, kv = c.num_kv_heads * c.head_dim();
  q_proj = std::make_unique<Linear>(h, h, device);
  k_proj = std::make_unique<Linear>(h, kv, device);
  v_proj = std::make_unique<Linear>(h, kv, device);
  o_proj = std::make_unique<Linear>(h, h, device);
  register_child("q_proj", q_proj.get());
  register_child("k_proj", k_proj.get());
  register_child("v_proj", v_proj.get());
  register_child("o_proj", o_proj.get());
}

Linear& Attention::projection(const std::string& name) {
  if (name == "q_proj") return *q_proj;
  if (name == "k_proj") return *k_proj;
  if (name == "v_proj") return *v_proj;
  if (name == "o_proj") return *o_proj;
  throw ConfigError("no attention projection named '" + name + "'");
}

void Attention::replace_projection(const std::string& name, std::unique_ptr<Linear> linear) {
  std::unique_ptr<Linear>& slot =
      name == "q_proj"   ? q_proj
      : name == "k_proj" ? k_proj
      : name == "v_proj" ? v_proj
      : name == "o_proj" ? o_proj
                         : throw ConfigError("no attention projection named '" + name + "'");
  slot = std::move(linear);
  replace_child(name, slot.get());
}

Tensor Attention::forward(const Tensor& x) {
  int64_t b = x.size(0), s = x.size(1), d = config_.head_dim();
  int64_t hq = config_.num_heads, hkv = config_.num_kv_heads;
  // [B, S, H*D] -> [B, S, H, D] -> rotary -> [B, H, S, D]
  Tensor q = ops::swap_dims_12(
      ops::rope(ops::reshape(q_proj->forward(x), {b, s, hq, d}), config_.rope_theta));
  Tensor k = ops::swap_dims_12(
      ops::rope(ops::reshape(k_proj->forward(x), {b, s, hkv, d}), config_.rope_theta));
  Tensor v = ops::swap_dims_12(ops::reshape(v_proj->forward(x), {b, s, hkv, d}));

  ops::AttentionImpl impl_now = impl;
  AttentionCoreFn core = [impl_now](const Tensor& q_, const Tensor& k_, const Tensor& v_) {
    return ops::attention(q_, k_, v_, impl_now);
  };
  if (core_wrappers != nullptr) {
    for (auto it = core_wrappers->rbegin(); it != core_wrappers->rend(); ++it) {
      AttentionCoreFn inner = core;
      const AttentionCoreWrapper& w = *it;
      int layer = layer_;
      core = [w, inner, layer](const Tensor& q_, const Tensor& k_, const Tensor& v_) {
        return w(layer, inner, q_, k_, v_);
      };
    }
  }
  Tensor attn = core(q, k, v);  // [B, Hq, S, D]
  return o_proj->forward(ops::reshape(ops::swap_dims_12(attn), {b, s, hq * d}));
}

// ---- MLP ------------------------------------------------------------------------------------

MLP::MLP(const LlamaConfig& c, Device device) {
  gate_proj = std::make_unique<Linear>(c.hidden_size, c.intermediate_size, device);
  up_proj = std::make_unique<Linear>(c.hidden_size, c.intermediate_size, device);
  down_proj = std::make_unique<Linear>(c.intermediate_size, c.hidden_size, device);
  register_child("gate_proj", gate_proj.get());
  register_child("up_proj", up_proj.get());
  register_child("down_proj", down_proj.get());
}

Linear& MLP::projection(const std::string& name) {
  if (name == "gate_proj") return *gate_proj;
  if (name == "up_proj") return *up_proj;
  if (name == "down_proj") return *down_proj;
  throw ConfigError("no MLP projection named '" + name + "'");
}

void MLP::replace_projection(const std::string& name, std::unique_ptr<Linear> linear) {
  std::unique_ptr<Linear>& slot = name == "gate_proj" ? gate_proj
                                  : name == "up_proj" ? up_proj
                                  : name == "down_proj"
                                      ? down_proj
                                      : throw ConfigError("no MLP projection named '" + name + "'");
  slot = std::move(linear);
  replace_child(name, slot.get());
}

Tensor MLP::forward(const Tensor& x) {
  return down_proj->forward(ops::swiglu(gate_proj->forward(x), up_proj->forward(x)));
}

// ---- DecoderLayer ---------------------------------------------------------------------------

DecoderLayer::DecoderLayer(const LlamaConfig& c, int layer_index, Device device)
    : input_layernorm(c.hidden_size, c.rms_norm_eps, device),
      self_attn(c, layer_index, device),
      post_attention_layernorm(c.hidden_size, c.rms_norm_eps, device),
      mlp(c, device) {
  register_child("self_attn", &self_attn);
  register_child("mlp", &mlp);
  register_child("input_layernorm", &input_layernorm);
  register_child("post_attention_layernorm", &post_attention_layernorm);
}

Tensor DecoderLayer::forward(const Tensor& x) {
  Tensor h = ops::add(x, self_attn.forward(input_layernorm.forward(x)));
  return ops::add(h, mlp.forward(post_attention_layernorm.forward(h)));
}

// ---- LlamaModel -----------------------------------------------------------------------------

LlamaModel::LlamaModel(const LlamaConfig& c, Device device)
    : embed_tokens(c.vocab_size, c.hidden_size, device),
      norm(c.hidden_size, c.rms_norm_eps, device),
      config_(c),
      device_(device) {
  c.validate();
  register_child("model.embed_tokens", &embed_tokens);
  for (int i = 0; i < c.num_layers; ++i) {
    layers.push_back(std::make_unique<DecoderLayer>(c, i, device));
    layers.back()->self_attn.core_wrappers = &core_wrappers_;
    register_child("model.layers." + std::to_string(i), layers.back().get());
  }
  register_child("model.norm", &norm);
  if (!c.tie_embeddings) {
    lm_head = std::make_unique<Linear>(c.hidden_size, c.vocab_size, device);
    register_child("lm_head", lm_head.get());
  }
}

void LlamaModel::set_attention_impl(ops::AttentionImpl impl) {
  for (auto& l : layers) l->self_attn.impl = impl;
}

void LlamaModel::init_weights(uint64_t seed) {
  Generator gen(seed);
  autograd::NoGrad no_grad;
  for (auto& [name, slot] : named_parameters()) {
    bool is_norm = name.find("norm") != std::string::npos;
    Tensor values = is_norm
                        ? ones(slot->shape(), DType::F32, Device::host())
                        : randn(slot->shape(), gen, config_.init_std, DType::F32, Device::host());
    slot->copy_from(values);
  }
}

std::vector<std::pair<std::string, Tensor*>> LlamaModel::layer_parameters(int layer) {
  return layers.at(static_cast<size_t>(layer))
      ->named_parameters("model.layers." + std::to_string(layer));
}

std::vector<std::pair<std::string, Tensor*>> LlamaModel::root_parameters() {
  std::vector<std::pair<std::string, Tensor*>> out =
      embed_tokens.named_parameters("model.embed_tokens");
  auto n = norm.named_parameters("model.norm");
  out.insert(out.end(), n.begin(), n.end());
  if (lm_head) {
    auto h = lm_head->named_parameters("lm_head");
    out.insert(out.end(), h.begin(), h.end());
  }
  return out;
}

Tensor LlamaModel::run_layer(int i, const Tensor& x) {
  TensorFn fn = [this, i](const Tensor& in) { return layers[static_cast<size_t>(i)]->forward(in); };
  for (auto it = layer_wrappers_.rbegin(); it != layer_wrappers_.rend(); ++it) {
    TensorFn inner = fn;
    const LayerWrapper& w = *it;
    fn = [w, inner, i](const Tensor& in) { return w(i, inner, in); };
  }
  return fn(x);
}

Tensor LlamaModel::forward_unwrapped(const Tensor& ids) {
  ST_CHECK_SHAPE(ids.dim() == 2 && ids.dtype() == DType::I64,
                 "model input must be int64 token ids [batch, seq], got ", ids.describe());
  ST_CHECK_SHAPE(ids.size(1) <= config_.max_seq_len, "sequence length ", ids.size(1),
                 " exceeds model.max_seq_len ", config_.max_seq_len);
  Tensor x = embed_tokens.forward(ids);  // [B, S, H]
  for (int i = 0; i < num_layers(); ++i) x = run_layer(i, x);
  x = ops::reshape(norm.forward(x), {ids.numel(), config_.hidden_size});
  return lm_head ? lm_head->forward(x) : ops::linear(x, embed_tokens.weight);
}

Tensor LlamaModel::forward(const Tensor& ids) {
  TensorFn fn = [this](const Tensor& in) { return forward_unwrapped(in); };
  for (auto it = model_wrappers_.rbegin(); it != model_wrappers_.rend(); ++it) {
    TensorFn inner = fn;
    const ModelWrapper& w = *it;
    fn = [w, inner](const Tensor& in) { return w(inner, in); };
  }
  return fn(ids);
}

Tensor LlamaModel::loss_sum(const Tensor& ids, const Tensor& targets, int64_t* counted) {
  ST_CHECK_SHAPE(targets.shape() == ids.shape(), "targets ", targets.describe(),
                 " do not match input ids ", ids.describe());
  Tensor logits = forward(ids);
  return ops::cross_entropy_sum(logits, targets.view({targets.numel()}), counted);
}

}  // namespace shardtrain::nn
