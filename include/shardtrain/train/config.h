// The run configuration: a typed tree read from YAML, checked against a schema before use.
//
// Defaults live in the member initialisers below; src/train/config.cpp holds the schema (one row
// per key: type, allowed values or range, one-line help) that parsing, validation, `to_yaml()` and
// `shardtrain config` all read. Every rejected value throws ConfigError naming the key's full path
// (`optim.lr`), the value given, where it came from (file:line:column or --set) and what is
// allowed.
//
// A few keys hold a sentinel that means "derive me" (num_kv_heads 0, min_lr < 0, param_dtype "",
// loss_scale auto, checkpoint.dir ""). They are kept as written so that a later change to the key
// they derive from (a recipe picking bf16, a Hugging Face config giving the head count) still
// takes effect; the `effective_*` helpers give the derived value.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain::train {

// model.rope_scaling: Llama-3 RoPE frequency scaling, Hugging Face's config.json rope_scaling
// (Llama-3.1: factor 8, Llama-3.2 1B/3B: factor 32; low 1, high 4, original 8192 for both).
// With rope_type none the numbers stay 0 (unset); with llama3 all four are needed.
struct RopeScalingConfig {
  std::string rope_type = "none";  // none | llama3
  double factor = 0;
  double low_freq_factor = 0;
  double high_freq_factor = 0;
  int64_t original_max_position_embeddings = 0;

  bool operator==(const RopeScalingConfig&) const = default;
};

struct ModelConfig {
  std::string
      from_hf;  // Hugging Face model dir (config.json + *.safetensors); "" = build from keys
  int64_t vocab_size = 256;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 176;
  int64_t num_layers = 2;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 0;  // 0 = num_heads (plain multi-head attention)
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScalingConfig rope_scaling;
  bool tie_embeddings = false;
  int64_t max_seq_len = 2048;
  double init_std = 0.02;

  int64_t effective_num_kv_heads() const { return num_kv_heads > 0 ? num_kv_heads : num_heads; }

  bool operator==(const ModelConfig&) const = default;
};

struct DataConfig {
  std::string path = "builtin";  // "builtin" (embedded corpus), a .h5 token dataset or a .txt file
  double eval_fraction = 0.05;
  int64_t seed = 1234;

  bool operator==(const DataConfig&) const = default;
};

struct TrainConfig {
  int64_t steps = 100;
  int64_t seq_len = 128;
  int64_t micro_batch = 8;
  // Sequences per optimizer step over all ranks; 0 = micro_batch x data-parallel world size.
  // Must be a multiple of micro_batch x world size (checked where the world size is known).
  int64_t global_batch = 0;
  int64_t global_batch_tokens = 0;  // alternative to global_batch in tokens; 0 = unused
  int64_t eval_every = 50;          // 0 = never
  int64_t eval_batches = 8;
  int64_t log_every = 1;
  int64_t seed = 0;
  std::string device = "auto";  // auto | cpu | cuda | cuda:N
  std::string device_memory;    // "" = unlimited; else a byte size such as "24GiB"
  // load_config() replaces this with runs/<config file stem> when the file does not set it.
  std::string out_dir = "runs/default";
  std::string resume = "none";        // none | auto | <checkpoint path>
  bool export_model = true;           // YAML key `export`
  std::string export_dtype = "fp32";  // fp32 | bf16 | fp16: the exported weights' dtype
  std::string progress = "auto";      // auto | bar | lines | none

  // device_memory in bytes; 0 = unlimited.
  int64_t device_memory_bytes() const;
  // Sequences per optimizer step over `data_parallel_ranks` ranks (global_batch, or
  // global_batch_tokens / seq_len, or micro_batch x ranks when both are 0). Throws ConfigError
  // naming the key, the ranks and the nearest valid values when it is not a multiple of
  // micro_batch x ranks. Gradient accumulation steps = result / (micro_batch x ranks).
  int64_t sequences_per_step(int64_t data_parallel_ranks) const;

  bool operator==(const TrainConfig&) const = default;
};

struct OptimConfig {
  std::string name = "adamw";  // adamw | sgd
  double lr = 3e-3;
  double min_lr = -1.0;  // < 0 = lr / 10
  int64_t warmup_steps = 10;
  std::string schedule = "cosine";  // cosine | constant | linear
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  bool decay_norms_and_embeddings = false;
  double momentum = 0.9;                 // sgd only
  double grad_clip = 1.0;                // 0 = no clipping
  std::string offload = "none";          // none | cpu
  std::string offload_moments = "host";  // host | device

  double effective_min_lr() const { return min_lr < 0 ? lr / 10.0 : min_lr; }

  bool operator==(const OptimConfig&) const = default;
};

struct PrecisionConfig {
  std::string compute = "fp32";       // fp32 | bf16 | fp16
  std::string param_dtype;            // "" = same as compute
  std::string reduce_dtype = "fp32";  // fp32 | bf16 | fp16
  std::string loss_scale = "auto";    // auto (dynamic for fp16, none otherwise) | dynamic | none
  double init_scale = 65536.0;
  int64_t growth_interval = 2000;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;

  std::string effective_param_dtype() const { return param_dtype.empty() ? compute : param_dtype; }
  // "dynamic" or "none".
  std::string effective_loss_scale() const;

  bool operator==(const PrecisionConfig&) const = default;
};

// Which layers an activation strategy applies to, parsed from `activation.layers`:
//   all        every layer
//   N          layer N (0-based)
//   A-B        layers A..B inclusive
//   every:K    layers 0, K, 2K, ...
// and comma-separated lists of N and A-B items ("0,3-5").
class LayerSelection {
 public:
  // Throws ConfigError naming `activation.layers`, the text and the accepted forms.
  static LayerSelection parse(const std::string& text);

  // Throws ConfigError when a listed layer is >= num_layers.
  void validate(int64_t num_layers) const;
  // Validates against num_layers, then says whether `layer` is selected.
  bool applies_to_layer(int64_t layer, int64_t num_layers) const;
  const std::string& text() const { return text_; }

 private:
  struct Range {
    int64_t first = 0, last = 0;  // inclusive
  };
  std::string text_;
  bool all_ = false;
  int64_t every_ = 0;  // > 0 for every:K
  std::vector<Range> ranges_;
};

struct ActivationConfig {
  // none | per_layer | sqrt_segment | selective | offload | offload_checkpoint
  std::string strategy = "none";
  std::string layers = "all";                     // see LayerSelection
  std::string checkpoint_impl = "non_reentrant";  // non_reentrant | reentrant
  int64_t offload_min_bytes = 0;    // activations smaller than this stay on the device
  std::string attention = "plain";  // plain | fused
  // deterministic | atomic_dq: how the fused attention's backward sums dQ (backend/attention.h)
  std::string attention_backward = "deterministic";
  // Tokens per chunk of the fused head + cross-entropy (the logits never exist for more tokens
  // than this); 0 = the head's logits are materialised whole.
  int64_t loss_chunk_tokens = 0;

  // Parses `layers` (throws ConfigError) and tests `layer` against it.
  bool applies_to_layer(int64_t layer, int64_t num_layers) const;

  bool operator==(const ActivationConfig&) const = default;
};

struct DistConfig {
  std::string backend = "auto";         // auto | mpi | nccl
  std::string sharding = "full_shard";  // full_shard | grad_op_shard | no_shard | hybrid_shard
  int64_t ranks_per_node = 0;           // 0 = detect
  bool sync_every_microbatch = true;
  int64_t timeout_s = 600;
  bool prefetch = true;

  bool operator==(const DistConfig&) const = default;
};

struct CheckpointConfig {
  std::string dir;           // "" = <train.out_dir>/checkpoints
  int64_t every_steps = 0;   // 0 = never by steps
  double every_minutes = 0;  // 0 = never by time
  int64_t keep_last = 3;     // 0 = keep all

  bool operator==(const CheckpointConfig&) const = default;
};

struct LoraConfig {
  bool enabled = false;
  int64_t r = 16;
  double alpha = 32.0;
  double dropout = 0.0;
  std::vector<std::string> target_modules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                             "gate_proj", "up_proj", "down_proj"};
  std::string quantize_base = "nf4";  // nf4 | none
  std::string base_model;             // Hugging Face dir of the frozen base model
  std::string adapter_out;            // where the adapter is written; "" = <out_dir>/adapter
  std::string init_from;              // PEFT adapter dir the adapters start from; "" = fresh
  bool merge_on_export = false;

  bool operator==(const LoraConfig&) const = default;
};

struct Config {
  std::string recipe = "manual";  // manual | auto
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  OptimConfig optim;
  PrecisionConfig precision;
  ActivationConfig activation;
  DistConfig dist;
  CheckpointConfig checkpoint;
  LoraConfig lora;

  // Every key at its default value.
  static Config defaults();

  // Parses YAML text (`source` names it in messages), applies `overrides` ("section.key=value",
  // the value read as a YAML scalar or flow list) to the tree, then validates every key and the
  // rules that tie keys together. Throws ConfigError.
  static Config parse(const std::string& yaml_text, const std::vector<std::string>& overrides = {},
                      const std::string& source = "<config>");

  // Every key, defaults included, with its help as a comment; parse(to_yaml()) gives back an equal
  // Config.
  std::string to_yaml() const;
  // Every key's full path and its value as YAML text, in to_yaml's order
  // ({"model.rope_scaling.factor", "8"}, {"lora.target_modules", "[q_proj, v_proj]"}).
  std::vector<std::pair<std::string, std::string>> key_values() const;
  // The keys whose value differs from the default, with that value as YAML text.
  std::map<std::string, std::string> values_away_from_defaults() const;

  // Keys set away from their defaults that this configuration never reads (optim.beta1 with
  // optim.name=sgd, lora.r with lora.enabled=false), one line each naming the key and what would
  // make it count. Not an error: a config may keep them for a switch made with --set. The CLI
  // prints them as warnings.
  std::vector<std::string> unused_settings() const;

  std::string effective_checkpoint_dir() const {
    return checkpoint.dir.empty() ? train.out_dir + "/checkpoints" : checkpoint.dir;
  }

  bool operator==(const Config&) const = default;
};

// Reads and parses a config file; a missing file or a YAML syntax error throws ConfigError with the
// file (and line and column). When neither the file nor an override sets train.out_dir it becomes
// runs/<file stem>. With model.from_hf the model keys are resolved (resolve_model_from_hf in
// runtime.h), every key the file or an override sets counting as a request.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// One line per key: "path  type  default  allowed  help" (for `shardtrain config --keys`).
std::string describe_config_keys();

}  // namespace shardtrain::train
