#include "shardtrain/train/memory_model.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "shardtrain/activation/estimate.h"
#include "shardtrain/activation/strategy.h"
#include "shardtrain/core/dtype.h"
#include "shardtrain/core/error.h"
#include "shardtrain/train/runtime.h"

namespace shardtrain::train {

namespace {

// The allocators hand out multiples of 64 bytes.
int64_t r64(int64_t bytes) {
  return bytes <= 0 ? 0 : (bytes + 63) / 64 * 64;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

int64_t dtype_bytes(const std::string& name, const char* key) {
  DType t = dtype_from_name(name);
  ST_CHECK_AS(ConfigError, is_floating(t), key, " = '", name, "': expected fp32, bf16 or fp16");
  return static_cast<int64_t>(dtype_size(t));
}

// One weight of the model, as the optimizer and the allocators see it.
struct Weight {
  std::string module;  // q_proj, ..., input_layernorm, embed_tokens, norm, lm_head
  int64_t in = 0, out = 0;
  int64_t numel() const { return in * out; }
};

std::vector<Weight> layer_weights(const nn::LlamaConfig& c) {
  int64_t h = c.hidden_size, kv = c.num_kv_heads * c.head_dim(), i = c.intermediate_size;
  return {{"q_proj", h, h},    {"k_proj", h, kv},         {"v_proj", h, kv},
          {"o_proj", h, h},    {"gate_proj", h, i},       {"up_proj", h, i},
          {"down_proj", i, h}, {"input_layernorm", 1, h}, {"post_attention_layernorm", 1, h}};
}

std::vector<Weight> root_weights(const nn::LlamaConfig& c) {
  std::vector<Weight> w = {{"embed_tokens", c.hidden_size, c.vocab_size},
                           {"norm", 1, c.hidden_size}};
  if (!c.tie_embeddings) w.push_back({"lm_head", c.hidden_size, c.vocab_size});
  return w;
}

bool is_projection(const std::string& m) {
  return m.size() > 5 && m.substr(m.size() - 5) == "_proj";
}

// Bytes of one unit (a decoder layer or the root: embeddings, final norm, head) by role.
struct UnitBytes {
  int64_t trainable_elems = 0;  // fp32 elements the optimizer updates
  int64_t trainable_tensors = 0;
  int64_t master = 0;        // fp32 trainable weights, per-tensor rounding
  int64_t frozen = 0;        // frozen weights (LoRA bases)
  int64_t compute_copy = 0;  // 16-bit copies of the trainable fp32 weights
  int64_t largest_grad = 0;  // the biggest single fp32 gradient
};

struct ModelBytes {
  UnitBytes layer, root;
  int64_t head_grad = 0;   // fp32 gradient of the output projection (tied: the embedding)
  int64_t embed_grad = 0;  // fp32 gradient of the embedding (0 when frozen)
  int64_t layer_elems = 0, root_elems = 0;  // every element of one layer / of the root
};

ModelBytes model_bytes(const MemoryModelInput& in, int64_t param_bytes, int64_t frozen_bytes) {
  const nn::LlamaConfig& c = in.model;
  ModelBytes mb;
  auto add = [&](UnitBytes& u, int64_t& elems, const Weight& w) {
    elems += w.numel();
    bool targeted = in.lora && std::find(in.lora_targets.begin(), in.lora_targets.end(),
                                         w.module) != in.lora_targets.end();
    if (in.lora) {
      // The base is frozen; NF4 packs two weights per byte plus a one-byte block scale per 64
      // weights and an fp32 per 256 blocks. Every decoder projection is quantized, targeted or
      // not (nn/lora.h, as bitsandbytes' load_in_4bit).
      if (is_projection(w.module) && in.quantize_base == "nf4") {
        int64_t blocks = ceil_div(w.numel(), 64);
        u.frozen += r64(ceil_div(w.numel(), 2)) + r64(blocks) + r64(4 * ceil_div(blocks, 256));
      } else {
        u.frozen += r64(w.numel() * frozen_bytes);
      }
      if (targeted) {
        for (int64_t n : {in.lora_r * w.in, w.out * in.lora_r}) {
          u.trainable_elems += n;
          u.trainable_tensors += 1;
          u.master += r64(4 * n);
          u.largest_grad = std::max(u.largest_grad, r64(4 * n));
          elems += n;
        }
      }
      return;
    }
    u.trainable_elems += w.numel();
    u.trainable_tensors += 1;
    u.master += r64(4 * w.numel());
    if (param_bytes != 4) u.compute_copy += r64(param_bytes * w.numel());
    u.largest_grad = std::max(u.largest_grad, r64(4 * w.numel()));
  };
  for (const Weight& w : layer_weights(c)) add(mb.layer, mb.layer_elems, w);
  for (const Weight& w : root_weights(c)) add(mb.root, mb.root_elems, w);
  if (!in.lora) {
    mb.head_grad = r64(4 * c.vocab_size * c.hidden_size);
    mb.embed_grad = c.tie_embeddings ? 0 : mb.head_grad;
  }
  return mb;
}

void check_choice(const std::string& value, std::initializer_list<const char*> allowed,
                  const char* key) {
  for (const char* a : allowed)
    if (value == a) return;
  throw ConfigError(
      fmt::format("{} = '{}': expected one of {}", key, value, fmt::join(allowed, ", ")));
}

// The sizes of one decoder layer's activations (see activation/estimate.h).
struct LayerActs {
  int64_t X = 0, KV = 0, M = 0, R = 0, P = 0, LSE = 0;
  bool plain = true;
};

LayerActs layer_acts(const MemoryModelInput& in, int64_t e) {
  const nn::LlamaConfig& c = in.model;
  int64_t t = in.micro_batch * in.seq_len;
  LayerActs a;
  a.plain = in.attention == "plain";
  a.X = r64(t * c.hidden_size * e);
  a.KV = r64(t * c.num_kv_heads * c.head_dim() * e);
  a.M = r64(t * c.intermediate_size * e);
  a.R = r64(4 * t);
  a.P = r64(in.micro_batch * c.num_heads * in.seq_len * in.seq_len * e);
  a.LSE = r64(4 * in.micro_batch * c.num_heads * in.seq_len);
  return a;
}

struct Moment {
  std::string name;
  int64_t copies = 0;       // compute copies / gathered units (Parameters)
  int64_t activations = 0;  // Activations
  int64_t gradients = 0;    // Gradients
  int64_t workspace = 0;    // Workspace
  int64_t total() const { return copies + activations + gradients + workspace; }
};

}  // namespace

MemoryModelInput MemoryModelInput::from_config(const Config& config, int world_size) {
  ST_CHECK_AS(ConfigError, world_size >= 1, "world size must be at least 1, got ", world_size);
  MemoryModelInput in;
  in.model = llama_config_from(config.model);
  in.micro_batch = config.train.micro_batch;
  in.seq_len = config.train.seq_len;
  int64_t sequences = config.train.sequences_per_step(world_size);
  in.micro_batches_per_step = std::max<int64_t>(1, sequences / (in.micro_batch * world_size));
  in.compute = config.precision.compute;
  in.param_dtype = config.precision.param_dtype;
  in.reduce_dtype = config.precision.reduce_dtype;
  in.reduced_by_mpi_on_cpu = world_size > 1 && training_device(config).is_cpu();
  in.activation_strategy = config.activation.strategy;
  in.attention = config.activation.attention;
  in.loss_chunk_tokens = config.activation.loss_chunk_tokens;
  in.offload_min_bytes = config.activation.offload_min_bytes;
  in.reentrant = config.activation.checkpoint_impl == "reentrant";
  in.world_size = world_size;
  in.sharding = config.dist.sharding;
  in.ranks_per_node = static_cast<int>(config.dist.ranks_per_node);
  in.prefetch = config.dist.prefetch;
  in.sync_every_microbatch = config.dist.sync_every_microbatch;
  in.optimizer = config.optim.name;
  in.momentum = config.optim.momentum;
  in.optimizer_offload = config.optim.offload;
  in.offload_moments = config.optim.offload_moments;
  in.lora = config.lora.enabled;
  in.lora_r = config.lora.r;
  in.lora_targets = config.lora.target_modules;
  in.quantize_base = config.lora.quantize_base;
  in.lora_dropout = config.lora.dropout;
  return in;
}

// The figures are int64 byte counts. Shapes whose products could pass 2^62 somewhere in them
// (no machine holds such a model or batch) are refused before any product wraps around and
// reads as a small or negative size. The bound, in doubles, covers every term with room to
// spare: weights and their states, per-layer activations (attention scores included), logits.
void check_plannable(const MemoryModelInput& in) {
  const nn::LlamaConfig& c = in.model;
  const double h = static_cast<double>(c.hidden_size), i = static_cast<double>(c.intermediate_size);
  const double v = static_cast<double>(c.vocab_size), l = static_cast<double>(c.num_layers);
  const double heads = static_cast<double>(c.num_heads), s = static_cast<double>(in.seq_len);
  const double t = static_cast<double>(in.micro_batch) * s;
  const double scores = in.attention == "fused" ? 0 : heads * s;  // fused: never materialised
  const double elements = l * (h * (4 * h + 3 * i) + t * (16 * h + 4 * i + scores)) + v * (h + t);
  const double bound = 1024.0 * elements;
  if (!(bound < 0x1p62))
    throw ConfigError(
        detail::concat("the model and batch are too large to plan: with model.hidden_size ",
                       c.hidden_size, ", model.intermediate_size ", c.intermediate_size,
                       ", model.num_layers ", c.num_layers, ", model.vocab_size ", c.vocab_size,
                       ", train.seq_len ", in.seq_len, " and train.micro_batch ", in.micro_batch,
                       " its byte counts could pass 2^62 (4 EiB) per rank; no device holds that"));
}

MemoryPrediction predict_memory(const MemoryModelInput& in) {
  const nn::LlamaConfig& c = in.model;
  c.validate();
  check_plannable(in);
  // As the job itself refuses it at start (dist/env.cpp).
  ST_CHECK_AS(ConfigError, in.ranks_per_node <= 0 || in.world_size % in.ranks_per_node == 0,
              "dist.ranks_per_node=", in.ranks_per_node, " does not divide the ", in.world_size,
              " ranks planned for; use a divisor of the world size or 0 to detect nodes");
  ST_CHECK_AS(ConfigError, in.world_size >= 1, "world size must be at least 1, got ",
              in.world_size);
  ST_CHECK_AS(ConfigError, in.micro_batch > 0 && in.seq_len > 0,
              "train.micro_batch and train.seq_len must be positive, got ", in.micro_batch, " and ",
              in.seq_len);
  check_choice(in.sharding, {"full_shard", "grad_op_shard", "no_shard", "hybrid_shard"},
               "dist.sharding");
  check_choice(in.optimizer, {"adamw", "sgd"}, "optim.name");
  check_choice(in.optimizer_offload, {"none", "cpu"}, "optim.offload");
  check_choice(in.attention, {"plain", "fused"}, "activation.attention");
  const std::string& strategy = in.activation_strategy;
  const int64_t e = dtype_bytes(in.compute, "precision.compute");
  const int64_t pe =
      dtype_bytes(in.param_dtype.empty() ? in.compute : in.param_dtype, "precision.param_dtype");
  const int64_t rb = dtype_bytes(in.reduce_dtype, "precision.reduce_dtype");
  // Frozen floating weights of a LoRA model are stored in bf16 when the parameter dtype is bf16,
  // else in fp32 (nn::LoraOptions::frozen_dtype as the runtime sets it).
  const std::string param_name = in.param_dtype.empty() ? in.compute : in.param_dtype;
  const int64_t frozen_bytes = dtype_from_name(param_name) == DType::BF16 ? 2 : 4;
  const ModelBytes mb = model_bytes(in, pe, frozen_bytes);
  const int64_t L = c.num_layers, V = c.vocab_size, H = c.hidden_size;
  const int64_t T = in.micro_batch * in.seq_len;

  // ---- sharding ------------------------------------------------------------------------------
  // Every run over several ranks goes through fsdp::ShardedModel; no_shard is its one-shard
  // case: each rank holds every unit whole, "gathers" it (casts it to the parameter dtype)
  // around its forward and again for its backward as full_shard does, and all-reduces the flat
  // gradients. In fp32 the gathered unit is the master itself (no copy).
  const bool fsdp = in.world_size > 1 && !in.lora;
  int64_t shards = 1;
  if (fsdp && in.sharding != "no_shard") {
    shards = in.world_size;
    if (in.sharding == "hybrid_shard")
      shards = in.ranks_per_node > 0 ? in.ranks_per_node : std::min(in.world_size, 8);
  }
  auto shard_of = [&](const UnitBytes& u) { return ceil_div(u.trainable_elems, shards); };
  // fp32 master, gradient and one optimizer-state tensor per rank, per unit.
  auto per_rank_fp32 = [&](const UnitBytes& u) { return fsdp ? r64(4 * shard_of(u)) : u.master; };
  const bool gathered_is_master = shards == 1 && pe == 4;
  auto gathered = [&](const UnitBytes& u) {
    return gathered_is_master ? 0 : r64(pe * shards * shard_of(u));
  };

  MemoryPrediction p;
  p.total_parameters = L * mb.layer_elems + mb.root_elems;
  p.trainable_parameters = L * mb.layer.trainable_elems + mb.root.trainable_elems;
  p.master_bytes = L * per_rank_fp32(mb.layer) + per_rank_fp32(mb.root);
  p.frozen_bytes = L * mb.layer.frozen + mb.root.frozen;
  p.gradient_bytes = p.master_bytes;
  int64_t state_tensors = in.optimizer == "adamw" ? 2 : (in.momentum > 0 ? 1 : 0);
  int64_t optimizer_total = state_tensors * p.master_bytes;
  // Optimizer offload (ZeRO-Offload): the host pool holds an fp32 master copy and, unless
  // optim.offload_moments=device, the moments; the device keeps the weights and gradients.
  p.optimizer_bytes = optimizer_total;
  if (in.optimizer_offload == "cpu") {
    p.host_optimizer_bytes = p.master_bytes;
    if (in.offload_moments == "host") {
      p.host_optimizer_bytes += optimizer_total;
      p.optimizer_bytes = 0;
    }
  }
  const int64_t persistent = p.master_bytes + p.frozen_bytes + p.optimizer_bytes;

  // ---- activations ---------------------------------------------------------------------------
  activation::ActivationModelShape shape;
  shape.batch = in.micro_batch;
  shape.seq = in.seq_len;
  shape.hidden = H;
  shape.heads = c.num_heads;
  shape.kv_heads = c.num_kv_heads;
  shape.intermediate = c.intermediate_size;
  shape.vocab = V;
  shape.layers = L;
  shape.dtype_bytes = e;
  shape.attention_impl = ops::parse_attention_impl(in.attention);
  shape.loss_chunk = in.loss_chunk_tokens;
  const activation::ActivationEstimate act =
      activation::activation_bytes_model(strategy, shape, in.reentrant, in.offload_min_bytes);
  p.host_activation_bytes = act.host_bytes;
  const LayerActs a = layer_acts(in, e);
  auto per_layer = [&](const std::string& s) {
    return activation::activation_bytes_per_layer(s, in.micro_batch, in.seq_len, H, c.num_heads,
                                                  c.num_kv_heads, c.intermediate_size, e,
                                                  shape.attention_impl, in.offload_min_bytes);
  };
  // LoRA changes what a layer saves (nn/lora.h): each adapter keeps its rank-r intermediate and,
  // with dropout, its own dropped-out input and an fp32 mask, while an NF4 base saves no input;
  // an NF4 weight is dequantized into a dense transient in forward and again in backward.
  int64_t lora_delta = 0, dequantized = 0;
  if (in.lora) {
    auto targeted = [&](const std::string& m) {
      return std::find(in.lora_targets.begin(), in.lora_targets.end(), m) != in.lora_targets.end();
    };
    struct Group {
      std::vector<std::string> modules;
      int64_t input_bytes, in_features, out_features;
    };
    const int64_t kv = c.num_kv_heads * c.head_dim(), I = c.intermediate_size;
    const std::vector<Group> groups = {{{"q_proj", "k_proj", "v_proj"}, a.X, H, H},
                                       {{"o_proj"}, a.X, H, H},
                                       {{"gate_proj", "up_proj"}, a.X, H, I},
                                       {{"down_proj"}, a.M, I, H}};
    const bool dropout = in.lora_dropout > 0, nf4 = in.quantize_base == "nf4";
    for (const Group& g : groups) {
      int64_t n = 0;
      for (const std::string& m : g.modules) n += targeted(m) ? 1 : 0;
      lora_delta += n * r64(T * in.lora_r * e);
      if (dropout) lora_delta += n * (r64(4 * T * g.in_features) + r64(e * T * g.in_features));
      // No op keeps the group's shared input any more: the NF4 bases save none, and the
      // adapters either are not there or keep their own dropped-out copies.
      if (nf4 && (n == 0 || dropout)) lora_delta -= g.input_bytes;
      if (nf4 && n > 0)
        dequantized = std::max(dequantized, r64(e * g.in_features * g.out_features));
    }
    if (nf4 && targeted("k_proj")) dequantized = std::max(dequantized, r64(e * H * kv));
  }
  const int64_t saved = per_layer("none") + lora_delta;  // everything one layer's ops save
  // What the strategy keeps of it on the device.
  const int64_t kept =
      per_layer(strategy) + (strategy == "none" || strategy == "selective" ? lora_delta : 0);
  // The activation estimate's totals, with the LoRA change of every layer that keeps its saves.
  int64_t after_forward = act.after_forward, forward_peak = act.forward_peak + dequantized;
  if (strategy == "none" || strategy == "selective") {
    after_forward += L * lora_delta;
    forward_peak += L * lora_delta;
  } else if (strategy == "offload") {
    p.host_activation_bytes += L * lora_delta;
  }
  const int64_t inputs = 2 * r64(8 * T);  // ids and targets
  const int64_t logits = activation::head_logit_bytes(T, V, e, 0);
  // The logits the head's backward holds at once: all of them, or one chunk of a chunked loss
  // (recomputed there; the forward saved none).
  const bool chunked_loss = in.loss_chunk_tokens > 0;
  const int64_t head_logits = activation::head_logit_bytes(T, V, e, in.loss_chunk_tokens);
  // Layer starts of the segments sqrt_segment keeps the input of.
  std::vector<std::pair<int, int>> segments;
  if (strategy == "sqrt_segment")
    segments = activation::sqrt_segments(static_cast<int>(L), nullptr);

  // Strategies whose saved tensors (and with them the weights the linears save) stay on the
  // device from a layer's forward to its backward.
  const bool keeps_layers = strategy == "none" || strategy == "selective" || strategy == "offload";

  // ---- the moments of a step -----------------------------------------------------------------
  // Gradients already present while later micro-batches run (accumulation).
  // Without dist.sync_every_microbatch every unit accumulates its unsharded gradient (fp32,
  // padded) until the last micro-batch reduces it.
  auto unsharded_fp32 = [&](const UnitBytes& u) { return r64(4 * shards * shard_of(u)); };
  const bool accumulates_unsharded = fsdp && !in.sync_every_microbatch;
  const int64_t acc_grads = in.micro_batches_per_step <= 1 ? 0
                            : accumulates_unsharded
                                ? L * unsharded_fp32(mb.layer) + unsharded_fp32(mb.root)
                                : p.gradient_bytes;
  const int64_t layer_grad = fsdp ? r64(4 * shard_of(mb.layer)) : mb.layer.master;
  const int64_t root_grad = fsdp ? r64(4 * shard_of(mb.root)) : mb.root.master;
  const bool mixed = pe != 4 && !fsdp;
  // Parameters alive beside the masters: 16-bit compute copies (mixed precision) or gathered
  // units (FSDP).
  const int64_t unit_copy = fsdp ? gathered(mb.layer) : (mixed ? mb.layer.compute_copy : 0);
  const int64_t root_copy = fsdp ? gathered(mb.root) : (mixed ? mb.root.compute_copy : 0);
  const int64_t head_copy = mixed ? r64(pe * V * H) : 0;
  const bool all_gathered = fsdp && in.sharding == "grad_op_shard";
  // The unit running and, with prefetch, the next one (none after the last of L layers).
  const int64_t in_flight_units = fsdp && in.prefetch && L > 1 ? 2 : 1;
  // FSDP's reduce-scatter of a unit: when the unit's backward ends, its gradients (compute
  // dtype) are concatenated into a flat buffer (reduce dtype) that is reduce-scattered into a
  // shard. One reduction stays in flight while the next unit's backward runs.
  auto flat = [&](const UnitBytes& u) { return r64(shards * shard_of(u) * rb); };
  auto reduce_out = [&](const UnitBytes& u) { return shards > 1 ? r64(shard_of(u) * rb) : 0; };
  // With one shard the reduction's output is the flat buffer itself (all-reduced in place).
  // Accumulating unsharded gradients, a unit's flat buffer is its accumulator (counted in
  // acc_grads, released when its reduction completes): only the reduction's output is extra.
  const bool unsharded_acc = accumulates_unsharded && in.micro_batches_per_step > 1;
  // MPI on the CPU device reduces 16 bits through fp32 copies: the reduce-scatter's of the flat
  // buffer and of the output, alive until the reduction has completed; the all-reduce over
  // replicas (no_shard, hybrid_shard) of the reduced shard, while it runs at completion.
  const bool staged = in.reduced_by_mpi_on_cpu && rb != 4 && !unsharded_acc;
  const int64_t replicas = fsdp ? in.world_size / shards : 1;
  auto staged_scatter = [&](const UnitBytes& u) {
    return staged && shards > 1 ? r64(4 * shards * shard_of(u)) + r64(4 * shard_of(u)) : 0;
  };
  auto staged_all_reduce = [&](const UnitBytes& u) {
    return staged && replicas > 1 ? r64(4 * shard_of(u)) : 0;
  };
  auto in_flight = [&](const UnitBytes& u) {
    if (unsharded_acc) return reduce_out(u);
    return (shards > 1 ? flat(u) + reduce_out(u) : flat(u)) + staged_scatter(u);
  };
  const int64_t in_flight_reduce = fsdp ? in_flight(mb.layer) : 0;
  // Completing the reduction in flight, when the next unit launches its own: the reduced
  // gradients (the output; with one shard the flat buffer) are copied into the unit's fp32
  // gradients (new ones unless earlier micro-batches left some) beside the next unit's flat.
  auto completing = [&](const UnitBytes& done, int64_t done_grad, const UnitBytes& next) {
    if (unsharded_acc) return reduce_out(done) + done_grad;
    // The all-reduce's staging comes and goes before the fp32 gradients are made.
    return (shards > 1 ? reduce_out(done) : flat(done)) + staged_scatter(done) +
           std::max(staged_all_reduce(done), acc_grads > 0 ? 0 : done_grad) + flat(next);
  };
  // A unit's gradients (parameter dtype) beside their flat copy: in the reduce dtype, or the
  // fp32 one added into the accumulator.
  const int64_t layer_flatten =
      fsdp ? r64(mb.layer.trainable_elems * pe) +
                 (unsharded_acc ? unsharded_fp32(mb.layer) : flat(mb.layer))
           : 0;
  const int64_t pending_head = fsdp && mb.head_grad > 0 ? r64(pe * V * H) : 0;

  std::vector<Moment> moments;
  {
    Moment m{"end of forward"};
    m.activations = forward_peak;
    m.gradients = acc_grads;
    int64_t layers_alive = all_gathered || (mixed && keeps_layers) ? L : in_flight_units;
    m.copies = root_copy + layers_alive * unit_copy;
    moments.push_back(m);
  }
  const int64_t copies_after_forward =
      (fsdp ? root_copy : head_copy) +
      (all_gathered || (mixed && keeps_layers) ? L * unit_copy : 0);
  {
    Moment m{"loss gradient"};
    m.activations = after_forward;
    // d(loss)/d(logits), same shape and dtype as the logits; a chunked loss has none yet.
    m.workspace = chunked_loss ? 0 : logits;
    m.gradients = acc_grads;
    m.copies = copies_after_forward;
    moments.push_back(m);
  }
  {
    Moment m{"backward of the output projection"};
    m.activations = after_forward - (chunked_loss ? 0 : logits);
    // The incoming gradient (a chunked loss: one chunk's), d(input) and d(weight) (in the
    // compute dtype and in fp32: a cast after the unfused product, the chunks' fp32 sum before
    // the chunked one's rounding).
    m.workspace = head_logits + r64(T * H * e) + (mb.head_grad > 0 ? r64(e * V * H) : 0) +
                  (e != 4 && mb.head_grad > 0 ? mb.head_grad : 0);
    m.gradients = acc_grads;
    m.copies = copies_after_forward;
    moments.push_back(m);
  }
  // Transient buffers of one decoder layer's backward: the MLP (incoming gradient, d(gate),
  // d(up) beside the saved swiglu inputs) or the attention core (d(probabilities) or the fused
  // kernel's d(q), d(k), d(v)).
  // Under FSDP the unit's flattening follows its ops, beside the previous unit's reduction in
  // flight, and the head's gradient waits (in the compute dtype) for the root unit's reduction
  // after the embedding's backward.
  const int64_t layer_ops =
      std::max(2 * a.M + a.X, a.plain ? a.P + 2 * a.X + 2 * a.KV : 3 * a.X + 2 * a.KV) +
      dequantized;
  for (int64_t i = L - 1; i >= 0; --i) {
    Moment m{"backward of layer " + std::to_string(i)};
    int64_t below = 0, here = saved;
    if (strategy == "sqrt_segment") {
      int first = 0;
      for (auto [f, l] : segments) {
        if (f < i) below += a.X;
        if (f <= i && i <= l) first = f;
      }
      here = (i - first + 1) * saved - (i > first ? a.X : 0);
    } else {
      below = i * kept;
      if (strategy == "offload" && i > 0) here += saved - kept;  // the prefetched layer
      if (strategy == "offload_checkpoint" && i > 0) here += a.X;
    }
    m.activations = inputs + below + here;
    if (!fsdp) {
      m.workspace = layer_ops;
      // The head's, the finished layers' and the largest weight gradient of this layer.
      m.gradients =
          (acc_grads > 0 ? acc_grads : root_grad - mb.embed_grad + (L - 1 - i) * layer_grad) +
          mb.layer.largest_grad;
      if (mixed) m.copies = (keeps_layers ? i + 1 : 1) * unit_copy;
      moments.push_back(m);
      continue;
    }
    // FSDP: sharded gradients appear unit by unit, as each reduction completes: the layers above
    // i but the one whose reduction is still in flight. The root unit's come last.
    const int64_t previous = i < L - 1 ? in_flight_reduce : 0;
    m.gradients = acc_grads > 0 ? acc_grads : std::max<int64_t>(0, L - 2 - i) * layer_grad;
    // The unit's weight gradients are produced in the parameter dtype as its ops run, the
    // largest of them beside the ops' transients.
    m.workspace = layer_ops + r64(mb.layer.largest_grad / 4 * pe) + previous + pending_head;
    // With prefetch the next layer down is gathered meanwhile; below layer 0 there is none.
    const int64_t gathered_here = i > 0 ? in_flight_units : 1;
    m.copies = root_copy + (all_gathered ? i + 1 : gathered_here) * unit_copy;
    moments.push_back(m);
    // When the unit's backward ends it is resharded (its gathered copy freed) and its gradients
    // are flattened and reduced; the gradient flowing to the layer below is alive meanwhile.
    Moment r = m;
    r.name = "gradient reduction of layer " + std::to_string(i);
    r.activations = inputs + below;
    // Flattening (the unit's gradients beside their flat copy), then launching its reduction
    // (the gradients freed, the reduction's buffers made) beside the one still in flight.
    r.workspace = a.X + pending_head +
                  std::max(std::max(layer_flatten, in_flight_reduce) + previous,
                           i < L - 1 ? completing(mb.layer, layer_grad, mb.layer) : 0);
    r.copies = root_copy + (all_gathered ? i : gathered_here - 1) * unit_copy;
    moments.push_back(r);
  }
  {
    Moment m{"backward of the embedding"};
    m.activations = inputs;
    // The incoming gradient and d(weight): an fp32 buffer, then its cast to the weight's dtype.
    m.workspace =
        r64(T * H * e) +
        (mb.embed_grad > 0 || c.tie_embeddings ? mb.head_grad + (e != 4 ? r64(e * V * H) : 0) : 0);
    m.gradients = acc_grads > 0 ? acc_grads
                                : (fsdp ? (L - 1) * layer_grad : p.gradient_bytes - mb.embed_grad);
    // FSDP: the head's pending gradient, then the root unit's reduce-scatter (its gradients in
    // the compute dtype and their flat copy in the reduce dtype).
    if (fsdp) {
      m.copies = root_copy;
      m.workspace =
          std::max(std::max({m.workspace + pending_head,
                             r64(mb.root.trainable_elems * pe) +
                                 (unsharded_acc ? unsharded_fp32(mb.root) : flat(mb.root)),
                             in_flight(mb.root)}) +
                       in_flight_reduce,
                   completing(mb.layer, layer_grad, mb.root));
    }
    moments.push_back(m);
  }
  if (fsdp) {
    // The root unit's reduction completes last: every gradient exists beside its output.
    Moment m{"end of backward"};
    m.gradients = p.gradient_bytes;
    m.workspace = unsharded_acc ? reduce_out(mb.root) + unsharded_fp32(mb.root)
                  : shards > 1  ? reduce_out(mb.root) + staged_scatter(mb.root)
                                : flat(mb.root);
    moments.push_back(m);
  }
  {
    Moment m{"optimizer step"};
    m.gradients = p.gradient_bytes;
    moments.push_back(m);
  }

  const Moment* top = &moments.front();
  for (const Moment& m : moments)
    if (m.total() > top->total()) top = &m;
  p.peak_moment = top->name;
  p.compute_copy_bytes = top->copies;
  p.activation_bytes = top->activations;
  p.workspace_bytes = top->workspace;
  p.peak = persistent + top->total();
  auto at = [&](MemoryCategory cat) -> int64_t& { return p.at_peak[static_cast<size_t>(cat)]; };
  at(MemoryCategory::Parameters) = p.master_bytes + p.frozen_bytes + top->copies;
  at(MemoryCategory::OptimizerState) = p.optimizer_bytes;
  at(MemoryCategory::Gradients) = top->gradients;
  at(MemoryCategory::Activations) = top->activations;
  at(MemoryCategory::Workspace) = top->workspace;
  return p;
}

StepCost predict_step_cost(const MemoryModelInput& in) {
  const nn::LlamaConfig& c = in.model;
  check_plannable(in);
  const int64_t H = c.hidden_size, L = c.num_layers, S = in.seq_len;
  int64_t layer_matmul = 0;
  for (const Weight& w : layer_weights(c))
    if (is_projection(w.module)) layer_matmul += w.numel();
  const double tokens_per_micro = static_cast<double>(in.micro_batch * S);
  const double tokens = tokens_per_micro * static_cast<double>(in.micro_batches_per_step);
  // Per token: 2 FLOPs per weight of every projection and of the head, and the attention core's
  // two S x S products (q k^T and p v), 2 * S * H each.
  const double layer_fwd = 2.0 * static_cast<double>(layer_matmul) + 4.0 * S * H;
  const double fwd = static_cast<double>(L) * layer_fwd + 2.0 * c.vocab_size * H;
  StepCost cost;
  cost.step_flops = 3.0 * fwd * tokens;
  const std::string& s = in.activation_strategy;
  if (s == "per_layer" || s == "sqrt_segment" || s == "offload_checkpoint")
    cost.recompute_flops = static_cast<double>(L) * layer_fwd * tokens;
  else if (s == "selective")
    cost.recompute_flops = static_cast<double>(L) * 4.0 * S * H * tokens;
  if (in.loss_chunk_tokens > 0) cost.recompute_flops += 2.0 * c.vocab_size * H * tokens;

  const MemoryPrediction p = predict_memory(in);
  const int64_t micro = in.micro_batches_per_step;
  cost.pcie_bytes = 2 * p.host_activation_bytes * micro;
  if (in.optimizer_offload == "cpu") {
    // Gradients go down, updated weights come back; moments kept on the device make the trip too.
    cost.pcie_bytes +=
        2 * p.master_bytes + (in.offload_moments == "host" ? 0 : 2 * p.optimizer_bytes);
  }
  const int64_t trainable = p.trainable_parameters;
  const int64_t pe = static_cast<int64_t>(
      dtype_size(dtype_from_name(in.param_dtype.empty() ? in.compute : in.param_dtype)));
  const int64_t rb = static_cast<int64_t>(dtype_size(dtype_from_name(in.reduce_dtype)));
  const double n = in.world_size;
  if (in.world_size > 1) {
    const int64_t syncs = in.sync_every_microbatch ? micro : 1;
    if (in.sharding == "no_shard" || in.lora) {
      cost.link_bytes = static_cast<int64_t>(2.0 * (n - 1) / n * trainable * rb) * syncs;
    } else {
      double shards = n;
      if (in.sharding == "hybrid_shard")
        shards = in.ranks_per_node > 0 ? in.ranks_per_node : std::min(in.world_size, 8);
      const double f = (shards - 1) / shards;
      // Gathers per micro-batch: full_shard gathers every layer in forward and again in
      // backward (the root once); grad_op_shard gathers once.
      int64_t root = 0;
      for (const Weight& w : root_weights(c)) root += w.numel();
      const double layers = static_cast<double>(trainable - root);
      const double gathers = in.sharding == "grad_op_shard" ? 1.0 : 2.0;
      double per_micro = f * (gathers * layers + static_cast<double>(root)) * pe;
      double reduce = f * static_cast<double>(trainable) * rb;
      if (in.sharding == "hybrid_shard" && n > shards) {
        double replicas = n / shards;
        reduce += 2.0 * (replicas - 1) / replicas * static_cast<double>(trainable) / shards * rb;
      }
      cost.link_bytes = static_cast<int64_t>(per_micro * micro + reduce * syncs);
    }
  }
  return cost;
}

}  // namespace shardtrain::train
