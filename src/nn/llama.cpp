#include "shardtrain/nn/llama.h"

#include <algorithm>

#include "shardtrain/autograd/grad_mode.h"

namespace shardtrain::nn {

// ---- Attention ------------------------------------------------------------------------------

Attention::Attention(const LlamaConfig& c, int layer_index, Device device, ParameterStorage storage)
    : config_(c), layer_(layer_index) {
  int64_t h = c.hidden_size, kv = c.num_kv_heads * c.head_dim();
  q_proj = std::make_unique<Linear>(h, h, device, storage);
  k_proj = std::make_unique<Linear>(h, kv, device, storage);
  v_proj = std::make_unique<Linear>(h, kv, device, storage);
  o_proj = std::make_unique<Linear>(h, h, device, storage);
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
  const RopeParams rope = config_.rope_params();
  Tensor q = ops::swap_dims_12(ops::rope(ops::reshape(q_proj->forward(x), {b, s, hq, d}), rope));
  Tensor k = ops::swap_dims_12(ops::rope(ops::reshape(k_proj->forward(x), {b, s, hkv, d}), rope));
  Tensor v = ops::swap_dims_12(ops::reshape(v_proj->forward(x), {b, s, hkv, d}));

  const ops::AttentionImpl impl_now = impl;
  const AttentionBackwardAlgo backward_now = backward_algo;
  AttentionCoreFn core = [impl_now, backward_now](const Tensor& q_, const Tensor& k_,
                                                  const Tensor& v_) {
    return ops::attention(q_, k_, v_, impl_now, backward_now);
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

MLP::MLP(const LlamaConfig& c, Device device, ParameterStorage storage) {
  gate_proj = std::make_unique<Linear>(c.hidden_size, c.intermediate_size, device, storage);
  up_proj = std::make_unique<Linear>(c.hidden_size, c.intermediate_size, device, storage);
  down_proj = std::make_unique<Linear>(c.intermediate_size, c.hidden_size, device, storage);
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

DecoderLayer::DecoderLayer(const LlamaConfig& c, int layer_index, Device device,
                           ParameterStorage storage)
    : input_layernorm(c.hidden_size, c.rms_norm_eps, device, storage),
      self_attn(c, layer_index, device, storage),
      post_attention_layernorm(c.hidden_size, c.rms_norm_eps, device, storage),
      mlp(c, device, storage) {
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

LlamaModel::LlamaModel(const LlamaConfig& c, Device device, ParameterStorage storage)
    : embed_tokens(c.vocab_size, c.hidden_size, device, storage),
      norm(c.hidden_size, c.rms_norm_eps, device, storage),
      config_(c),
      device_(device) {
  c.validate();
  register_child("model.embed_tokens", &embed_tokens);
  for (int i = 0; i < c.num_layers; ++i) {
    layers.push_back(std::make_unique<DecoderLayer>(c, i, device, storage));
    layers.back()->self_attn.core_wrappers = &core_wrappers_;
    register_child("model.layers." + std::to_string(i), layers.back().get());
  }
  register_child("model.norm", &norm);
  if (!c.tie_embeddings) {
    lm_head = std::make_unique<Linear>(c.hidden_size, c.vocab_size, device, storage);
    register_child("lm_head", lm_head.get());
  }
  // The generator stream is consumed in registration order, norms taking none of it.
  uint64_t stream = 0;
  for (auto& [name, slot] : named_parameters()) {
    InitRecipe r;
    r.numel = slot->numel();
    r.ones = name.find("norm") != std::string::npos;
    r.stream_offset = stream;
    if (!r.ones) stream += static_cast<uint64_t>(r.numel);
    init_recipes_[name] = r;
  }
}

void LlamaModel::set_attention_impl(ops::AttentionImpl impl, AttentionBackwardAlgo backward) {
  for (auto& l : layers) {
    l->self_attn.impl = impl;
    l->self_attn.backward_algo = backward;
  }
}

void LlamaModel::init_parameter_range(uint64_t seed, const std::string& name, int64_t begin,
                                      int64_t length, float* out) const {
  auto it = init_recipes_.find(name);
  ST_CHECK_AS(ConfigError, it != init_recipes_.end(), "cannot initialise parameter '", name,
              "': the model was not built with it (adapters such as LoRA rename projections; "
              "initialise the weights before applying them)");
  const InitRecipe& r = it->second;
  ST_CHECK_SHAPE(begin >= 0 && length >= 0 && begin + length <= r.numel,
                 "cannot initialise elements [", begin, ", ", begin + length, ") of parameter '",
                 name, "', which has ", r.numel, " elements");
  if (r.ones) {
    std::fill(out, out + length, 1.0f);
    return;
  }
  // Element i of a normal stream depends only on (seed, offset + i): a range needs no others,
  // so chunks are drawn in parallel and the values do not depend on the thread count (an 8 B
  // model's init takes minutes on one core).
  constexpr int64_t kChunk = int64_t{1} << 16;
  const int64_t chunks = (length + kChunk - 1) / kChunk;
  const float stddev = config_.init_std;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, n = std::min(kChunk, length - lo);
    Generator gen;
    gen.set_state(seed, r.stream_offset + static_cast<uint64_t>(begin + lo));
    gen.normal(out + lo, n);
    for (int64_t i = lo; i < lo + n; ++i) out[i] *= stddev;
  }
}

void LlamaModel::init_weights(uint64_t seed) {
  materialize();
  autograd::NoGrad no_grad;
  for (auto& [name, slot] : named_parameters()) {
    const int64_t n = slot->numel();
    if (slot->device().cpu_addressable() && slot->dtype() == DType::F32) {
      init_parameter_range(seed, name, 0, n, slot->data<float>());
      continue;
    }
    CategoryScope scope(MemoryCategory::Workspace);
    Tensor values = empty(slot->shape(), DType::F32, Device::host());
    init_parameter_range(seed, name, 0, n, values.data<float>());
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

Tensor LlamaModel::final_hidden(const Tensor& ids) {
  ST_CHECK_SHAPE(ids.dim() == 2 && ids.dtype() == DType::I64,
                 "model input must be int64 token ids [batch, seq], got ", ids.describe());
  ST_CHECK_SHAPE(ids.size(1) <= config_.max_seq_len, "sequence length ", ids.size(1),
                 " exceeds the model's longest sequence, ", config_.max_seq_len,
                 " (model.max_seq_len; with model.from_hf, config.json's max_position_embeddings "
                 "unless model.max_seq_len is set)");
  Tensor x = embed_tokens.forward(ids);  // [B, S, H]
  for (int i = 0; i < num_layers(); ++i) x = run_layer(i, x);
  return ops::reshape(norm.forward(x), {ids.numel(), config_.hidden_size});
}

Tensor LlamaModel::run_wrapped(const TensorFn& body, const Tensor& ids) {
  ST_CHECK(!has_deferred_parameters(),
           "the model's parameters are deferred (built without storage): initialise them with "
           "init_weights, or shard the model with fsdp::ShardedModel, before running it");
  TensorFn fn = body;
  for (auto it = model_wrappers_.rbegin(); it != model_wrappers_.rend(); ++it) {
    TensorFn inner = fn;
    const ModelWrapper& w = *it;
    fn = [w, inner](const Tensor& in) { return w(inner, in); };
  }
  return fn(ids);
}

Tensor LlamaModel::forward(const Tensor& ids) {
  return run_wrapped(
      [this](const Tensor& in) {
        Tensor x = final_hidden(in);
        return lm_head ? lm_head->forward(x) : ops::linear(x, embed_tokens.weight);
      },
      ids);
}

void LlamaModel::set_loss_chunk_rows(int64_t rows) {
  ST_CHECK_AS(ConfigError, rows >= 0,
              "activation.loss_chunk_tokens: must be 0 (whole logits) or a positive number of "
              "tokens, got ",
              rows);
  loss_chunk_rows_ = rows;
}

Tensor LlamaModel::loss_sum(const Tensor& ids, const Tensor& targets, int64_t* counted) {
  ST_CHECK_SHAPE(targets.shape() == ids.shape(), "targets ", targets.describe(),
                 " do not match input ids ", ids.describe());
  Tensor flat_targets = targets.view({targets.numel()});
  if (loss_chunk_rows_ == 0) return ops::cross_entropy_sum(forward(ids), flat_targets, counted);
  // The head and the loss as one op that never holds all the logits. The head's weight is read
  // inside the wrappers, where it is the gathered (FSDP) or compute-dtype copy.
  // The targets are captured by handle, not as a reference to this frame: a wrapper may keep
  // the function beyond this call.
  return run_wrapped(
      [this, flat_targets, counted](const Tensor& in) {
        Tensor x = final_hidden(in);
        const Tensor& w = lm_head ? lm_head->weight : embed_tokens.weight;
        return ops::linear_cross_entropy_sum(x, w, flat_targets, loss_chunk_rows_, counted);
      },
      ids);
}

}  // namespace shardtrain::nn
