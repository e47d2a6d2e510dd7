// The Llama decoder (Hugging Face LlamaForCausalLM semantics and parameter names).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardtrain/backend/rope.h"
#include "shardtrain/nn/layers.h"
#include "shardtrain/ops/ops.h"

namespace shardtrain::nn {

struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 176;
  int64_t num_layers = 2;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 4;
  float rms_norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  // Llama-3 RoPE frequency scaling (config.json rope_scaling, rope_type "llama3"); none = plain.
  std::optional<Llama3RopeScaling> rope_scaling;
  bool tie_embeddings = false;
  int64_t max_seq_len = 2048;
  float init_std = 0.02f;

  // Upper bounds on the sizes, far past any model that exists and small enough that no product
  // of them (a weight's elements, a step's bytes) wraps around int64. validate() checks them;
  // the run config's model keys have the same bounds.
  static constexpr int64_t kMaxVocabSize = int64_t{1} << 32;
  static constexpr int64_t kMaxHiddenSize = int64_t{1} << 20;
  static constexpr int64_t kMaxIntermediateSize = int64_t{1} << 22;
  static constexpr int64_t kMaxLayers = int64_t{1} << 16;
  static constexpr int64_t kMaxHeads = int64_t{1} << 16;
  static constexpr int64_t kMaxSeqLen = int64_t{1} << 24;

  int64_t head_dim() const { return hidden_size / num_heads; }
  RopeParams rope_params() const { return RopeParams{rope_theta, rope_scaling}; }
  // Checks the shape is consistent (heads divide hidden, kv heads divide heads, ...) and the
  // RoPE scaling usable. Errors name the fields as the run config's model section does, or as
  // a Hugging Face config.json does (num_hidden_layers, num_attention_heads, ...).
  enum class FieldNames { RunConfig, HfConfigJson };
  void validate(FieldNames names = FieldNames::RunConfig) const;
  // Reads a Hugging Face config.json (LlamaConfig fields). Rejects what this implementation
  // does not compute (model_type other than llama, hidden_act other than silu, attention or MLP
  // biases, rope_scaling other than llama3) and non-integer values of integer fields; every
  // error is a FormatError naming the file, the field and the value.
  static LlamaConfig from_hf_json(const std::string& path);
  // config.json text for this config (rope_scaling included), read back by from_hf_json.
  // `weights` is the dtype of the tensors written beside it (torch_dtype: float32, bfloat16 or
  // float16).
  std::string to_hf_json(DType weights = DType::F32) const;
  int64_t num_parameters() const;
};

// A function of one tensor (a decoder layer's forward, the attention core, ...).
using TensorFn = std::function<Tensor(const Tensor&)>;

// Wraps how a decoder layer runs: activation checkpointing puts it in a recompute region, FSDP
// gathers its parameters around it, mixed precision swaps in compute copies. Wrappers compose:
// the first one added is the outermost.
using LayerWrapper = std::function<Tensor(int layer, const TensorFn& inner, const Tensor& x)>;
// Wraps the attention core (scores, softmax, weighted sum) of a layer: selective recompute.
using AttentionCoreFn = std::function<Tensor(const Tensor& q, const Tensor& k, const Tensor& v)>;
using AttentionCoreWrapper = std::function<Tensor(
    int layer, const AttentionCoreFn& inner, const Tensor& q, const Tensor& k, const Tensor& v)>;
// Wraps the whole forward (the root unit: embeddings, final norm, head).
using ModelWrapper = std::function<Tensor(const TensorFn& inner, const Tensor& ids)>;

class Attention : public Module {
 public:
  Attention(const LlamaConfig& config, int layer_index, Device device,
            ParameterStorage storage = ParameterStorage::Allocated);
  Tensor forward(const Tensor& x);  // x [B, S, H]
  void replace_projection(const std::string& name, std::unique_ptr<Linear> linear);
  Linear& projection(const std::string& name);

  std::unique_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  const std::vector<AttentionCoreWrapper>* core_wrappers = nullptr;
  ops::AttentionImpl impl = ops::AttentionImpl::Plain;
  AttentionBackwardAlgo backward_algo = AttentionBackwardAlgo::Deterministic;  // fused only

 private:
  LlamaConfig config_;
  int layer_;
};

class MLP : public Module {
 public:
  MLP(const LlamaConfig& config, Device device,
      ParameterStorage storage = ParameterStorage::Allocated);
  Tensor forward(const Tensor& x);
  void replace_projection(const std::string& name, std::unique_ptr<Linear> linear);
  Linear& projection(const std::string& name);
  std::unique_ptr<Linear> gate_proj, up_proj, down_proj;
};

class DecoderLayer : public Module {
 public:
  DecoderLayer(const LlamaConfig& config, int layer_index, Device device,
               ParameterStorage storage = ParameterStorage::Allocated);
  Tensor forward(const Tensor& x);
  RMSNorm input_layernorm;
  Attention self_attn;
  RMSNorm post_attention_layernorm;
  MLP mlp;
};

class LlamaModel : public Module {
 public:
  // With ParameterStorage::Deferred the parameters have shapes but no storage: give them values
  // with init_weights() (which allocates them), or shard the model with fsdp::ShardedModel, which
  // creates only this rank's part of each.
  LlamaModel(const LlamaConfig& config, Device device,
             ParameterStorage storage = ParameterStorage::Allocated);

  // ids I64 [B, S] -> logits [B*S, V] in the dtype of the parameters used. Throws Error while
  // parameters are deferred.
  Tensor forward(const Tensor& ids);
  // Summed cross-entropy over counted targets (-100 ignored); `counted` gets their number.
  Tensor loss_sum(const Tensor& ids, const Tensor& targets, int64_t* counted = nullptr);
  // With rows > 0, loss_sum fuses the head with the loss (ops::linear_cross_entropy_sum) and
  // never holds more than `rows` tokens' logits; 0 (the default) materialises them all.
  void set_loss_chunk_rows(int64_t rows);
  int64_t loss_chunk_rows() const { return loss_chunk_rows_; }

  // Normal(0, init_std) for projections and embeddings, ones for norms; deterministic per seed
  // and independent of the device. Allocates deferred parameters first. Covers the parameters
  // the model was built with: initialise before adapters (nn::apply_lora) rename projections.
  void init_weights(uint64_t seed);
  // Writes elements [begin, begin + length) of parameter `name` (flattened row-major) as
  // init_weights(seed) sets them into `out` (host memory): any range of any parameter, computed
  // on its own, is bit-identical to the same elements of the full initialisation. init_weights
  // is built on it, and so is sharded initialisation, so the two cannot drift apart. Throws
  // ConfigError for a name the model was not built with, ShapeError for a range outside it.
  void init_parameter_range(uint64_t seed, const std::string& name, int64_t begin, int64_t length,
                            float* out) const;

  void add_layer_wrapper(LayerWrapper w) { layer_wrappers_.push_back(std::move(w)); }
  void add_attention_core_wrapper(AttentionCoreWrapper w) {
    core_wrappers_.push_back(std::move(w));
  }
  void add_model_wrapper(ModelWrapper w) { model_wrappers_.push_back(std::move(w)); }
  void set_attention_impl(ops::AttentionImpl impl,
                          AttentionBackwardAlgo backward = AttentionBackwardAlgo::Deterministic);

  const LlamaConfig& config() const { return config_; }
  Device device() const { return device_; }
  int num_layers() const { return static_cast<int>(layers.size()); }
  // Parameters of one decoder layer (HF names) and of the root (embeddings, final norm, head).
  std::vector<std::pair<std::string, Tensor*>> layer_parameters(int layer);
  std::vector<std::pair<std::string, Tensor*>> root_parameters();

  Embedding embed_tokens;
  std::vector<std::unique_ptr<DecoderLayer>> layers;
  RMSNorm norm;
  std::unique_ptr<Linear> lm_head;  // null when tied to embed_tokens

 private:
  Tensor final_hidden(const Tensor& ids);                       // the final norm's output [B*S, H]
  Tensor run_wrapped(const TensorFn& body, const Tensor& ids);  // body inside model_wrappers_
  Tensor run_layer(int i, const Tensor& x);
  LlamaConfig config_;
  Device device_;
  // How init_weights draws each parameter: ones (norms) or init_std * normal numbers taken from
  // one generator stream, parameters in named_parameters() order, each `numel` numbers long.
  struct InitRecipe {
    int64_t numel = 0;
    bool ones = false;
    uint64_t stream_offset = 0;  // the generator offset of the parameter's first element
  };
  std::map<std::string, InitRecipe> init_recipes_;
  std::vector<LayerWrapper> layer_wrappers_;
  std::vector<AttentionCoreWrapper> core_wrappers_;
  std::vector<ModelWrapper> model_wrappers_;
  int64_t loss_chunk_rows_ = 0;
};

}  // namespace shardtrain::nn
