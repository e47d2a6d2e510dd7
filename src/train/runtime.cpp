#include "shardtrain/train/runtime.h"

#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/ops/ops.h"

namespace shardtrain::train {

Device resolve_device(const std::string& name) {
  if (name == "auto") return cuda_backend_available() ? Device::cuda(0) : Device::cpu();
  Device d = parse_device(name);
  if (d.is_cuda() && !cuda_backend_available())
    throw ConfigError("train.device: '" + name +
                      "' asked for a GPU but none is usable (no CUDA build, no driver or no "
                      "device); use train.device=cpu or auto");
  ST_CHECK_AS(ConfigError, !d.is_host(), "train.device: 'host' is the offload pool, not a device");
  return d;
}

nn::LlamaConfig llama_config_from(const ModelConfig& m) {
  nn::LlamaConfig c;
  if (!m.from_hf.empty()) return nn::LlamaConfig::from_hf_json(m.from_hf + "/config.json");
  c.vocab_size = m.vocab_size;
  c.hidden_size = m.hidden_size;
  c.intermediate_size = m.intermediate_size;
  c.num_layers = m.num_layers;
  c.num_heads = m.num_heads;
  c.num_kv_heads = m.effective_num_kv_heads();
  c.rms_norm_eps = static_cast<float>(m.rms_norm_eps);
  c.rope_theta = static_cast<float>(m.rope_theta);
  c.tie_embeddings = m.tie_embeddings;
  c.max_seq_len = m.max_seq_len;
  c.init_std = static_cast<float>(m.init_std);
  c.validate();
  return c;
}

Runtime::Runtime(const Config& config) : config_(config), device_(resolve_device(config.train.device)) {
  int64_t capacity = config_.train.device_memory_bytes();
  allocator_for(device_).set_capacity(capacity);

  nn::LlamaConfig mc = llama_config_from(config_.model);
  model_ = std::make_unique<nn::LlamaModel>(mc, device_);
  if (!config_.model.from_hf.empty())
    io::load_hf_weights(*model_, config_.model.from_hf);
  else
    model_->init_weights(static_cast<uint64_t>(config_.train.seed));
  model_->set_attention_impl(ops::parse_attention_impl(config_.activation.attention));

  ST_CHECK_AS(ConfigError, config_.activation.strategy == "none",
              "activation.strategy '", config_.activation.strategy,
              "' is not available in this build yet; use none");
  ST_CHECK_AS(ConfigError, config_.precision.compute == "fp32",
              "precision.compute '", config_.precision.compute,
              "' is not available in this build yet; use fp32");

  std::vector<optim::NamedParam> params = trainable();
  const OptimConfig& o = config_.optim;
  if (o.name == "adamw") {
    optim::AdamWOptions opts;
    opts.beta1 = static_cast<float>(o.beta1);
    opts.beta2 = static_cast<float>(o.beta2);
    opts.eps = static_cast<float>(o.eps);
    opts.weight_decay = static_cast<float>(o.weight_decay);
    opts.decay_all = o.decay_norms_and_embeddings;
    optimizer_ = std::make_unique<optim::AdamW>(params, opts);
  } else {
    optimizer_ = std::make_unique<optim::SGD>(params, static_cast<float>(o.momentum),
                                              static_cast<float>(o.weight_decay));
  }
}

Runtime::~Runtime() = default;

std::vector<optim::NamedParam> Runtime::trainable() const {
  std::vector<optim::NamedParam> out;
  for (auto& [name, slot] : model_->named_parameters())
    if (autograd::requires_grad(*slot)) out.push_back({name, slot});
  return out;
}

double Runtime::forward_backward(const std::vector<Batch>& micro_batches) {
  int64_t tokens = 0;
  for (const Batch& mb : micro_batches) tokens += mb.num_target_tokens;
  ST_CHECK(tokens > 0, "the batch has no target tokens to learn from (every target is -100)");
  double loss_total = 0;
  for (const Batch& mb : micro_batches) {
    Tensor ids = mb.input_ids.to(device_, MemoryCategory::Activations);
    Tensor targets = mb.targets.to(device_, MemoryCategory::Activations);
    Tensor loss_sum = model_->loss_sum(ids, targets);
    loss_total += loss_sum.item();
    // Token-weighted: every micro-batch is divided by the tokens of the whole global batch, so
    // any split into micro-batches gives the gradient of the whole batch.
    autograd::backward(ops::scale(loss_sum, 1.0f / static_cast<float>(tokens)));
  }
  return loss_total / static_cast<double>(tokens);
}

StepResult Runtime::train_step(const std::vector<Batch>& micro_batches, float lr) {
  Allocator& dev = allocator_for(device_);
  Allocator& host = allocator_for(Device::host());
  dev.reset_peak();
  host.reset_peak();
  StepResult r;
  for (const Batch& mb : micro_batches) r.tokens += mb.num_target_tokens;
  optimizer_->zero_grad();
  r.loss = forward_backward(micro_batches);
  std::vector<optim::NamedParam> params = trainable();
  r.grad_norm = optim::clip_grad_norm(params, config_.optim.grad_clip);
  optimizer_->step(lr);
  r.lr = lr;
  r.device_memory = dev.stats();
  r.host_memory = host.stats();
  return r;
}

double Runtime::eval_loss(const std::vector<Batch>& batches) {
  autograd::NoGrad no_grad;
  double total = 0;
  int64_t tokens = 0;
  for (const Batch& b : batches) {
    Tensor ids = b.input_ids.to(device_, MemoryCategory::Activations);
    Tensor targets = b.targets.to(device_, MemoryCategory::Activations);
    total += model_->loss_sum(ids, targets).item();
    tokens += b.num_target_tokens;
  }
  return tokens > 0 ? total / static_cast<double>(tokens) : 0.0;
}

}  // namespace shardtrain::train
