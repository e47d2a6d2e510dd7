#include "shardtrain/train/runtime.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "shardtrain/activation/counters.h"
#include "shardtrain/activation/strategy.h"
#include "shardtrain/amp/mixed_precision.h"
#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/core/word_hash.h"
#ifdef SHARDTRAIN_HAVE_CUDA
#include "shardtrain/backend/cuda.h"
#endif
#include "shardtrain/dist/env.h"
#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/io/peft.h"
#include "shardtrain/nn/lora.h"
#include "shardtrain/ops/ops.h"
#include "shardtrain/optim/offload.h"

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

Device training_device(const Config& config) {
  Device d = resolve_device(config.train.device);
  const dist::LaunchInfo launch = dist::detect_launch();
  if (d.is_cuda() && launch.local_size > 1 &&
      (config.train.device == "auto" || config.train.device == "cuda")) {
    d = Device::cuda(launch.local_rank);
#ifdef SHARDTRAIN_HAVE_CUDA
    const int gpus = cuda::device_count();
    ST_CHECK_AS(ConfigError, launch.local_rank < gpus, "train.device: ", config.train.device,
                " gives each rank of a node its own GPU, but this node runs ", launch.local_size,
                " ranks and has ", gpus, " usable GPU(s) (local rank ", launch.local_rank,
                " has none): start at most ", gpus, " ranks per node");
#endif
  }
  return d;
}

namespace {

// A number config.json gives and the model computes with in fp32, as the double whose shortest
// text is the fp32 value's (1e-05, not 9.99999974737875e-06): a resolved config reads as written.
double as_written(float value) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, value).ptr;
  return std::strtod(std::string(text, end).c_str(), nullptr);
}

// The model keys of the run config that ask for something other than what config.json says, as
// "model.key = yaml but field = json". A key asks when it was given or is away from its default.
std::vector<std::string> disagreements_with_hf(const ModelConfig& m, const nn::LlamaConfig& hf,
                                               const std::set<std::string>& keys_given) {
  const ModelConfig d;
  std::vector<std::string> conflicts;
  auto text = [](auto v) {
    std::ostringstream out;
    out << std::boolalpha << v;
    return out.str();
  };
  auto asked = [&](const std::string& key, bool away_from_default) {
    return away_from_default || keys_given.count("model." + key) > 0;
  };
  auto compare = [&](const std::string& key, auto yaml, auto yaml_default, auto json,
                     const std::string& field) {
    if (!asked(key, yaml != yaml_default) || yaml == json) return;
    conflicts.push_back("model." + key + " = " + text(yaml) + " but " + field + " = " + text(json));
  };
  compare("vocab_size", m.vocab_size, d.vocab_size, hf.vocab_size, "vocab_size");
  compare("hidden_size", m.hidden_size, d.hidden_size, hf.hidden_size, "hidden_size");
  compare("intermediate_size", m.intermediate_size, d.intermediate_size, hf.intermediate_size,
          "intermediate_size");
  compare("num_layers", m.num_layers, d.num_layers, hf.num_layers, "num_hidden_layers");
  compare("num_heads", m.num_heads, d.num_heads, hf.num_heads, "num_attention_heads");
  // 0 asks for as many key/value heads as query heads: config.json's, or a disagreement above.
  const int64_t kv_heads = m.num_kv_heads > 0 ? m.num_kv_heads : hf.num_heads;
  if (asked("num_kv_heads", m.num_kv_heads != d.num_kv_heads) && kv_heads != hf.num_kv_heads)
    conflicts.push_back("model.num_kv_heads = " + text(m.num_kv_heads) +
                        (m.num_kv_heads > 0 ? "" : " (as many as the query heads)") +
                        " but num_key_value_heads = " + text(hf.num_kv_heads));
  // config.json's numbers are used in fp32: compare there.
  compare("rms_norm_eps", static_cast<float>(m.rms_norm_eps), static_cast<float>(d.rms_norm_eps),
          hf.rms_norm_eps, "rms_norm_eps");
  compare("rope_theta", static_cast<float>(m.rope_theta), static_cast<float>(d.rope_theta),
          hf.rope_theta, "rope_theta");
  compare("tie_embeddings", m.tie_embeddings, d.tie_embeddings, hf.tie_embeddings,
          "tie_word_embeddings");
  const RopeScalingConfig& rs = m.rope_scaling;
  const bool type_asked = asked("rope_scaling.rope_type", rs.rope_type != d.rope_scaling.rope_type);
  if (type_asked && rs.rope_type == "llama3" && !hf.rope_scaling)
    conflicts.push_back(
        "model.rope_scaling.rope_type = llama3 but config.json has no rope_scaling");
  if (type_asked && rs.rope_type != "llama3" && hf.rope_scaling)
    conflicts.push_back("model.rope_scaling.rope_type = " + rs.rope_type +
                        " but config.json's rope_scaling is llama3");
  if (rs.rope_type == "llama3" && hf.rope_scaling) {
    const Llama3RopeScaling& h = *hf.rope_scaling;
    const RopeScalingConfig& none = d.rope_scaling;
    compare("rope_scaling.factor", rs.factor, none.factor, h.factor, "rope_scaling.factor");
    compare("rope_scaling.low_freq_factor", rs.low_freq_factor, none.low_freq_factor,
            h.low_freq_factor, "rope_scaling.low_freq_factor");
    compare("rope_scaling.high_freq_factor", rs.high_freq_factor, none.high_freq_factor,
            h.high_freq_factor, "rope_scaling.high_freq_factor");
    compare("rope_scaling.original_max_position_embeddings", rs.original_max_position_embeddings,
            none.original_max_position_embeddings, h.original_max_position_embeddings,
            "rope_scaling.original_max_position_embeddings");
  }
  return conflicts;
}

}  // namespace

std::optional<nn::LlamaConfig> resolve_model_from_hf(ModelConfig& m,
                                                     const std::set<std::string>& keys_given,
                                                     const std::string& given_as) {
  if (m.from_hf.empty()) return std::nullopt;
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string alternative =
      given_as == "model.from_hf"     ? ", or remove model.from_hf to build the model from the "
                                        "model keys"
      : given_as == "lora.base_model" ? ", or remove lora.base_model to train the adapters on a "
                                        "base built from the model keys"
                                      : "";
  if (!fs::is_directory(m.from_hf, ec))
    throw ConfigError(given_as + " '" + m.from_hf +
                      (fs::exists(m.from_hf, ec) ? "' is not a directory" : "' does not exist") +
                      ": give the directory of a Hugging Face model (config.json and "
                      "*.safetensors)" +
                      alternative);
  const std::string file = m.from_hf + "/config.json";
  if (!fs::exists(file, ec))
    throw ConfigError(given_as + " '" + m.from_hf +
                      "' has no config.json: give the directory of a Hugging Face model "
                      "(config.json and *.safetensors), such as a run's export/ directory");
  const nn::LlamaConfig hf = nn::LlamaConfig::from_hf_json(file);
  const std::vector<std::string> conflicts = disagreements_with_hf(m, hf, keys_given);
  if (!conflicts.empty()) {
    std::string message =
        "model.from_hf: the run config and '" + file + "' describe different models: ";
    for (size_t i = 0; i < conflicts.size(); ++i) message += (i ? "; " : "") + conflicts[i];
    throw ConfigError(message +
                      ". With model.from_hf the model comes from config.json: remove these model "
                      "keys from the run config or make them agree with it");
  }
  m.vocab_size = hf.vocab_size;
  m.hidden_size = hf.hidden_size;
  m.intermediate_size = hf.intermediate_size;
  m.num_layers = hf.num_layers;
  m.num_heads = hf.num_heads;
  m.num_kv_heads = hf.num_kv_heads;
  m.rms_norm_eps = as_written(hf.rms_norm_eps);
  m.rope_theta = as_written(hf.rope_theta);
  m.rope_scaling = RopeScalingConfig{};
  if (hf.rope_scaling)
    m.rope_scaling = RopeScalingConfig{
        "llama3", hf.rope_scaling->factor, hf.rope_scaling->low_freq_factor,
        hf.rope_scaling->high_freq_factor, hf.rope_scaling->original_max_position_embeddings};
  m.tie_embeddings = hf.tie_embeddings;
  // The longest sequence is not part of the weights (RoPE is computed, not learned): the longer
  // of config.json's max_position_embeddings and model.max_seq_len, against which the run
  // config's seq_len was checked.
  m.max_seq_len = std::max(m.max_seq_len, hf.max_seq_len);
  return hf;
}

void check_lora_world_size(const Config& config, int world_size) {
  ST_CHECK_AS(ConfigError, !config.lora.enabled || world_size == 1,
              "lora.enabled trains on one rank (single-GPU QLoRA), but this job has ", world_size,
              " ranks: start it without mpirun (or with -np 1), or train the full model "
              "(lora.enabled=false) to use several ranks");
}

nn::LlamaConfig llama_config_from(const ModelConfig& m) {
  nn::LlamaConfig c;
  if (!m.from_hf.empty()) {
    ModelConfig resolved = m;
    c = *resolve_model_from_hf(resolved);
    c.max_seq_len = resolved.max_seq_len;
    return c;
  }
  c.vocab_size = m.vocab_size;
  c.hidden_size = m.hidden_size;
  c.intermediate_size = m.intermediate_size;
  c.num_layers = m.num_layers;
  c.num_heads = m.num_heads;
  c.num_kv_heads = m.effective_num_kv_heads();
  c.rms_norm_eps = static_cast<float>(m.rms_norm_eps);
  c.rope_theta = static_cast<float>(m.rope_theta);
  if (m.rope_scaling.rope_type == "llama3")
    c.rope_scaling = Llama3RopeScaling{m.rope_scaling.factor, m.rope_scaling.low_freq_factor,
                                       m.rope_scaling.high_freq_factor,
                                       m.rope_scaling.original_max_position_embeddings};
  c.tie_embeddings = m.tie_embeddings;
  c.max_seq_len = m.max_seq_len;
  c.init_std = static_cast<float>(m.init_std);
  c.validate();
  return c;
}

void check_data_fits_model(const TokenDataset& data, const Config& config) {
  const std::string& hf = config.model.from_hf;
  const int64_t model_vocab =
      hf.empty() ? config.model.vocab_size : llama_config_from(config.model).vocab_size;
  ST_CHECK_AS(ConfigError, data.vocab_size() <= model_vocab, "data.path '", config.data.path,
              "' has vocabulary size ", data.vocab_size(), " but ",
              hf.empty() ? std::string("model.vocab_size is ")
                         : "the model in model.from_hf '" + hf + "' has vocab_size ",
              model_vocab,
              ": tokenize the data with the model's tokenizer, or train a model with the "
              "data's vocabulary");
}

namespace {

// Ranks that disagree on a shape, a batch size or the step count would exchange messages of
// different sizes or wait at different places: a crash or a hang, long after start-up. Every
// rank compares a hash of each key and value of its resolved config with the other ranks', and
// all of them stop, naming the keys that differ.
void check_same_config_on_every_rank(const Config& config, dist::ProcessGroup& world) {
  std::vector<std::string> keys;
  std::vector<uint64_t> hashes;
  for (const auto& [key, value] : config.key_values()) {
    keys.push_back(key);
    const std::string line = key + "=" + value;
    WordHash hash;
    hash.update(line.data(), line.size());
    hashes.push_back(hash.digest());
  }
  // The same build gives every rank the same keys; check the count before the vectors meet.
  std::vector<int64_t> count = {static_cast<int64_t>(keys.size()),
                                -static_cast<int64_t>(keys.size())};
  world.all_reduce_host(count, dist::ReduceOp::Max);
  ST_CHECK_AS(ConfigError, count[0] == -count[1],
              "the ranks run different shardtrain builds (their configs have ", count[0], " and ",
              -count[1], " keys): start every rank with the same binary");
  const std::vector<bool> differs = world.differs_between_ranks(hashes);
  std::vector<std::string> differing;
  for (size_t i = 0; i < keys.size(); ++i)
    if (differs[i]) differing.push_back(keys[i]);
  if (differing.empty()) return;
  throw ConfigError("the ranks were started with different configurations: " +
                    fmt::format("{}", fmt::join(differing, ", ")) +
                    (differing.size() == 1 ? " differs" : " differ") +
                    " between ranks; give every rank the same --config file and --set flags");
}

using detail::concat;

// lora.init_from must hold adapters of this run's shape (rank, scale, projections), and when it
// records a base directory, this run's base: adapters only fit the base they were trained on.
// `frozen_base` is this run's (Runtime::frozen_base). Checked before the base weights load,
// which can take minutes.
void check_initial_adapter(const Config& config, const std::string& frozen_base) {
  const std::string& dir = config.lora.init_from;
  std::string base;
  const nn::LoraOptions saved = io::read_peft_config(dir, &base);
  std::vector<std::string> differ;
  if (saved.r != config.lora.r)
    differ.push_back(concat("r ", saved.r, " (lora.r is ", config.lora.r, ")"));
  if (std::abs(saved.alpha - config.lora.alpha) > 1e-6 * config.lora.alpha)
    differ.push_back(
        concat("lora_alpha ", saved.alpha, " (lora.alpha is ", config.lora.alpha, ")"));
  std::vector<std::string> saved_targets = saved.target_modules;
  std::vector<std::string> run_targets = config.lora.target_modules;
  std::sort(saved_targets.begin(), saved_targets.end());
  std::sort(run_targets.begin(), run_targets.end());
  run_targets.erase(std::unique(run_targets.begin(), run_targets.end()), run_targets.end());
  if (saved_targets != run_targets)
    differ.push_back(fmt::format("target_modules [{}] (lora.target_modules is [{}])",
                                 fmt::join(saved_targets, ", "), fmt::join(run_targets, ", ")));
  if (!differ.empty()) {
    throw ConfigError(concat("lora.init_from: the adapter in '", dir, "' has ",
                             fmt::format("{}", fmt::join(differ, "; ")),
                             ": set lora.r, lora.alpha and lora.target_modules to the adapter's "
                             "values to start from it"));
  }
  // The weights file must open now, not after the base has loaded (shapes are checked then).
  try {
    SafetensorsFile::open(dir + "/" + io::kAdapterWeightsFile);
  } catch (const std::exception& e) {
    throw ConfigError(concat("lora.init_from: ", e.what()));
  }
  auto note = [](const std::string& line) {
    if (dist::job_rank() == 0) std::fprintf(stderr, "note: lora.init_from: %s\n", line.c_str());
  };
  if (base.empty()) {
    note(concat("the adapter in '", dir,
                "' records no base model (base_model_name_or_path), so it cannot be checked "
                "against this run's base; make sure it was trained on the same weights"));
    return;
  }
  std::error_code ec;
  if (!std::filesystem::is_directory(base, ec)) {
    note(concat("the adapter names its base '", base,
                "', which is not a directory here (relative paths are taken from the working "
                "directory), so it cannot be compared with this run's base; make sure they are "
                "the same model"));
    return;
  }
  // The weights decide, not the path: a copy of the base directory is the same base.
  const std::string& ours = config.model.from_hf;
  std::string theirs;
  try {
    theirs = io::hf_weights_fingerprint(base);
  } catch (const std::exception& e) {
    note(concat("the adapter's base '", base, "' holds no weights this run can read (", e.what(),
                "), so it cannot be compared with this run's base"));
    return;
  }
  ST_CHECK_AS(ConfigError, "hf:" + theirs == frozen_base, "lora.init_from: the adapter in '", dir,
              "' was trained on the base model in '", base, "', but this run's base is ",
              ours.empty() ? std::string("initialised from train.seed (no model.from_hf)")
                           : "'" + ours + "', whose weights differ",
              ": set lora.base_model to '", base, "' (adapters only fit their own base)");
}

}  // namespace

Runtime::Runtime(const Config& config,
                 const std::function<void(int64_t done, int64_t total)>& on_base_projection)
    : config_(config), device_(training_device(config)) {
#ifdef SHARDTRAIN_HAVE_CUDA
  // This rank's GPU becomes the process's current device, so that nothing (a device guard
  // restoring "the previous device", NCCL, a library call) creates a context on GPU 0 in every
  // rank of the node.
  if (device_.is_cuda()) cuda::set_device(device_.index);
#endif
  dist::DistOptions dist_options;
  dist_options.backend = config_.dist.backend;
  dist_options.ranks_per_node = static_cast<int>(config_.dist.ranks_per_node);
  dist_options.timeout_s = static_cast<double>(config_.dist.timeout_s);
  dist_options.device = device_;
  dist_ = std::make_unique<dist::DistEnv>(dist_options);
  if (dist_->world_size() > 1) check_same_config_on_every_rank(config_, dist_->world());

  device_capacity_.emplace(allocator_for(device_), config_.train.device_memory_bytes());

  // Sharded strategies never build the full model: the parameters are deferred (shapes, no
  // storage) and each rank creates only its shards, from the seed or from the checkpoint's
  // files. no_shard keeps full replicas; QLoRA quantizes full base weights and is refused by the
  // sharding below with its own message.
  // QLoRA quantizes whole base weights on one device; the sharded and replicated paths both
  // need trainable fp32 parameters everywhere.
  check_lora_world_size(config_, dist_->world_size());
  const bool deferred =
      dist_->world_size() > 1 && !config_.lora.enabled &&
      fsdp::parse_sharding_strategy(config_.dist.sharding) != fsdp::ShardingStrategy::NoShard;
  if (!config_.lora.init_from.empty()) check_initial_adapter(config_, frozen_base());
  nn::LlamaConfig mc = llama_config_from(config_.model);
  // A QLoRA base is built projection by projection in NF4 (below), so it too starts deferred:
  // built dense first, an 8B model would need 32 GB of device memory for a moment.
  const bool nf4_base =
      config_.lora.enabled &&
      nn::parse_base_quantization(config_.lora.quantize_base) == nn::BaseQuantization::Nf4;
  model_ = std::make_unique<nn::LlamaModel>(
      mc, device_,
      deferred || nf4_base ? nn::ParameterStorage::Deferred : nn::ParameterStorage::Allocated);
  const auto seed = static_cast<uint64_t>(config_.train.seed);
  if (nf4_base && !config_.model.from_hf.empty()) {
    // A bitsandbytes 4-bit checkpoint's codes are kept as stored, not dequantized and quantized
    // again (which would change the block statistics); dense weights are quantized one
    // projection at a time.
    io::load_nf4_base_from_hf(*model_, config_.model.from_hf, on_base_projection);
  } else if (nf4_base) {
    // The random base init_weights would draw, one projection at a time on the host.
    const int64_t total = mc.num_layers * static_cast<int64_t>(nn::lora_projection_names().size());
    int64_t done = 0;
    nn::install_nf4_projections(*model_, [&](const std::string& weight, const Shape& shape) {
      CategoryScope workspace(MemoryCategory::Workspace);
      Tensor dense = empty(shape, DType::F32, Device::cpu());
      model_->init_parameter_range(seed, weight, 0, numel(shape), dense.data<float>());
      nn::Nf4Tensor q = nn::Nf4Tensor::quantize(dense);
      if (on_base_projection) on_base_projection(++done, total);
      return q;
    });
    model_->init_weights(seed);
  } else if (!deferred) {  // a deferred model gets its values when it is sharded, below
    if (!config_.model.from_hf.empty())
      io::load_hf_weights(*model_, config_.model.from_hf);
    else
      model_->init_weights(seed);
  }
  model_->set_attention_impl(ops::parse_attention_impl(config_.activation.attention),
                             parse_attention_backward(config_.activation.attention_backward));
  model_->set_loss_chunk_rows(config_.activation.loss_chunk_tokens);

  if (config_.lora.enabled) {
    // QLoRA: adapters on the target projections, every other weight frozen (the base quantized
    // to NF4 unless lora.quantize_base is none). Must come before the wrappers below.
    nn::LoraOptions lo;
    lo.r = config_.lora.r;
    lo.alpha = static_cast<float>(config_.lora.alpha);
    lo.dropout = static_cast<float>(config_.lora.dropout);
    lo.target_modules = config_.lora.target_modules;
    lo.quantize_base = nn::parse_base_quantization(config_.lora.quantize_base);
    lo.frozen_dtype =
        config_.precision.effective_param_dtype() == "bf16" ? DType::BF16 : DType::F32;
    lo.seed = static_cast<uint64_t>(config_.train.seed);
    nn::apply_lora(*model_, lo);
    // A saved adapter replaces the fresh start (A random, B zero); a resumed checkpoint's
    // adapters replace both later.
    if (!config_.lora.init_from.empty()) io::load_peft_adapter(*model_, config_.lora.init_from);
  }

  // Wrappers added first run outermost: the activation strategy wraps everything below it, so a
  // recompute repeats the parameter casts (and, under FSDP, the gathers).
  activation::ActivationOptions act;
  act.strategy = config_.activation.strategy;
  int64_t num_layers = mc.num_layers;
  ActivationConfig ac = config_.activation;
  act.applies_to_layer = [ac, num_layers](int layer) {
    return ac.applies_to_layer(layer, num_layers);
  };
  act.reentrant = config_.activation.checkpoint_impl == "reentrant";
  act.offload_min_bytes = config_.activation.offload_min_bytes;
  activation::apply_activation_strategy(*model_, act);
  if (dist_->world_size() > 1) {
    // Sharded data parallelism over the job's ranks. It gathers the parameters in the compute
    // dtype itself, so the mixed-precision wrappers below find nothing left to cast.
    fsdp::FsdpOptions sharding;
    sharding.strategy = fsdp::parse_sharding_strategy(config_.dist.sharding);
    sharding.param_dtype = dtype_from_name(config_.precision.effective_param_dtype());
    sharding.reduce_dtype = dtype_from_name(config_.precision.reduce_dtype);
    sharding.prefetch = config_.dist.prefetch;
    sharding.sync_every_microbatch = config_.dist.sync_every_microbatch;
    const bool from_seed = deferred && config_.model.from_hf.empty();
    sharded_ = std::make_unique<fsdp::ShardedModel>(
        *model_, *dist_, sharding,
        from_seed ? fsdp::seeded_init(*model_, static_cast<uint64_t>(config_.train.seed))
                  : fsdp::ParamRangeInit());
    if (deferred && !config_.model.from_hf.empty())
      io::load_hf_weights(*sharded_, config_.model.from_hf);
  }
  // Mixed precision goes last so that its compute copies are made innermost (a recompute casts
  // again rather than keeping 16-bit copies alive).
  amp::PrecisionPolicy policy;
  policy.param_dtype = dtype_from_name(config_.precision.effective_param_dtype());
  policy.reduce_dtype = dtype_from_name(config_.precision.reduce_dtype);
  amp::install_mixed_precision(*model_, policy);
  amp::GradScalerOptions scaling;
  scaling.enabled = config_.precision.effective_loss_scale() == "dynamic";
  scaling.init_scale = static_cast<float>(config_.precision.init_scale);
  scaling.growth_factor = static_cast<float>(config_.precision.growth_factor);
  scaling.backoff_factor = static_cast<float>(config_.precision.backoff_factor);
  scaling.growth_interval = config_.precision.growth_interval;
  scaler_ = std::make_unique<amp::GradScaler>(scaling);

  std::vector<optim::NamedParam> params = trainable();
  const OptimConfig& o = config_.optim;
  if (o.name == "adamw") {
    optim::AdamWOptions opts;
    opts.beta1 = static_cast<float>(o.beta1);
    opts.beta2 = static_cast<float>(o.beta2);
    opts.eps = static_cast<float>(o.eps);
    opts.weight_decay = static_cast<float>(o.weight_decay);
    opts.decay_all = o.decay_norms_and_embeddings;
    if (o.offload == "cpu") {
      optim::OffloadOptions offload;
      offload.moments_on_device = o.offload_moments == "device";
      optimizer_ = std::make_unique<optim::OffloadedAdamW>(params, opts, offload);
    } else {
      optimizer_ = std::make_unique<optim::AdamW>(params, opts);
    }
  } else {
    ST_CHECK_AS(ConfigError, o.offload == "none",
                "optim.offload: 'cpu' runs AdamW on the CPU, "
                "but optim.name is '",
                o.name, "'; set optim.name=adamw or optim.offload=none");
    optimizer_ = std::make_unique<optim::SGD>(params, static_cast<float>(o.momentum),
                                              static_cast<float>(o.weight_decay),
                                              o.decay_norms_and_embeddings);
  }
}

Runtime::~Runtime() = default;

const std::string& Runtime::frozen_base() {
  if (!frozen_base_) {
    if (!config_.lora.enabled) {
      frozen_base_ = "";
    } else if (!config_.model.from_hf.empty()) {
      frozen_base_ = "hf:" + io::hf_weights_fingerprint(config_.model.from_hf);
    } else {
      std::ostringstream os;
      os.precision(9);
      os << "init:train.seed=" << config_.train.seed
         << ",model.init_std=" << config_.model.init_std;
      frozen_base_ = os.str();
    }
  }
  return *frozen_base_;
}

std::vector<optim::NamedParam> Runtime::trainable() const {
  if (sharded_) return sharded_->optimizer_params();
  std::vector<optim::NamedParam> out;
  for (auto& [name, slot] : model_->named_parameters())
    if (autograd::requires_grad(*slot)) out.push_back({name, slot});
  return out;
}

double Runtime::accumulate_gradients(const std::vector<Batch>& micro_batches) {
  int64_t tokens = 0;
  for (const Batch& mb : micro_batches) tokens += mb.num_target_tokens;
  // The normaliser is the whole global batch's count, over every rank: gradients are then summed
  // over ranks (never averaged).
  tokens = dist_->world().all_reduce_host(tokens, dist::ReduceOp::Sum);
  ST_CHECK(tokens > 0, "the batch has no target tokens to learn from (every target is -100)");
  const int count = static_cast<int>(micro_batches.size());
  // The losses are read after the last backward: reading one is a wait for the device, which
  // between a forward and its backward would leave a GPU idle while the host queues more work.
  std::vector<Tensor> loss_sums;
  for (int k = 0; k < count; ++k) {
    const Batch& mb = micro_batches[static_cast<size_t>(k)];
    if (sharded_) sharded_->set_microbatch(k, count);
    Tensor ids = mb.input_ids.to(device_, MemoryCategory::Activations);
    Tensor targets = mb.targets.to(device_, MemoryCategory::Activations);
    Tensor loss_sum = model_->loss_sum(ids, targets);
    loss_sums.push_back(loss_sum.detach());
    // Token-weighted: every micro-batch is divided by the tokens of the whole global batch, so
    // any split into micro-batches gives the gradient of the whole batch. The loss scale (fp16)
    // multiplies in here; the callers divide it out.
    float factor =
        static_cast<float>(static_cast<double>(scaler_->scale()) / static_cast<double>(tokens));
    autograd::backward(ops::scale(loss_sum, factor));
  }
  double loss_total = 0;
  for (const Tensor& l : loss_sums) loss_total += l.item();
  loss_total = dist_->world().all_reduce_host(loss_total, dist::ReduceOp::Sum);
  return loss_total / static_cast<double>(tokens);
}

Runtime::Gradients Runtime::forward_backward(const std::vector<Batch>& micro_batches) {
  Gradients g;
  g.loss = accumulate_gradients(micro_batches);
  g.found_inf = scaler_->unscale_and_check(trainable());
  if (sharded_) g.found_inf = sharded_->any_rank(g.found_inf);  // every rank skips together
  return g;
}

StepResult Runtime::train_step(const std::vector<Batch>& micro_batches, float lr) {
  Allocator& dev = allocator_for(device_);
  Allocator& host = allocator_for(Device::host());
  dev.reset_peak();
  host.reset_peak();
  activation::reset_activation_counters();
  StepResult r;
  for (const Batch& mb : micro_batches) r.tokens += mb.num_target_tokens;
  r.tokens = dist_->world().all_reduce_host(r.tokens, dist::ReduceOp::Sum);
  optimizer_->zero_grad();
  r.loss_scale = scaler_->scale();
  r.loss = accumulate_gradients(micro_batches);
  // The gradients still hold the loss scale; neither it nor the clipping factor gets a pass of
  // its own over them: the optimizer multiplies by both as it reads each gradient. Their sum of
  // squares (sharded: over every rank's shard, so every rank decides alike) gives the norm and
  // the overflow check: fp32 squares summed in fp64 cannot overflow, so it is finite exactly
  // when every gradient is. With a power-of-two scale, dividing the norm by it and multiplying
  // the gradients by its reciprocal are exact: the step is the one on unscaled gradients.
  const double sum_squares =
      sharded_ ? sharded_->grad_sum_squares() : optim::grad_sum_squares(trainable());
  r.skipped = scaler_->enabled() && !std::isfinite(sum_squares);
  // Without loss scaling nothing skips such a step: the update would write inf or nan into every
  // weight (through the clipping factor too), and a checkpoint could keep them before the next
  // step's loss showed it. Every rank sees the same sum, so every rank stops here.
  if (!r.skipped && !std::isfinite(sum_squares)) {
    // Before any update the learning rate has played no part: the weights as initialised or
    // loaded (or fp16's range in the forward) give the inf.
    const std::string fix =
        optimizer_->steps_taken() == 0
            ? "This was the first update, so the learning rate is not the cause: "
              "check the initial weights (model.init_std, the files of model.from_hf), or use "
              "precision.compute=bf16 or fp32 if this is fp16 overflowing"
            : "Lower optim.lr or lengthen optim.warmup_steps; fp16 with "
              "precision.loss_scale=dynamic skips such steps instead of stopping";
    throw Error(concat("the gradients hold inf or nan (their sum of squares is ", sum_squares,
                       ", the loss ", r.loss, "); the weights were not updated. ", fix));
  }
  if (!r.skipped) {
    r.grad_norm = std::sqrt(sum_squares) / static_cast<double>(scaler_->scale());
    optimizer_->step(
        lr, optim::clip_factor(r.grad_norm, config_.optim.grad_clip) * scaler_->inv_scale());
  } else {
    r.grad_norm = INFINITY;  // weights and optimizer state stay untouched
  }
  scaler_->update(r.skipped);
  r.lr = lr;
  activation::ActivationCounters c = activation::activation_counters();
  r.forward_reruns = c.forward_reruns;
  r.bytes_offloaded = c.bytes_offloaded;
  r.bytes_restored = c.bytes_restored;
  r.recompute_seconds = c.recompute_seconds;
  r.transfer_seconds = c.transfer_seconds;
  r.copy_seconds = c.copy_seconds;
  r.device_memory = dev.stats();
  r.host_memory = host.stats();
  return r;
}

double Runtime::eval_loss(const std::vector<Batch>& batches) {
  return *eval_loss(batches, nullptr);
}

std::optional<double> Runtime::eval_loss(
    const std::vector<Batch>& batches, const std::function<bool()>& stop_requested,
    const std::function<void(int64_t done, int64_t total)>& on_progress) {
  autograd::NoGrad no_grad;
  model_->train(false);  // no adapter dropout
  struct BackToTraining {
    nn::LlamaModel& m;
    ~BackToTraining() { m.train(true); }
  } restore{*model_};
  // Rank r takes batches r, r + W, r + 2W, ... A forward of a sharded model is collective (it
  // gathers parameters), so every rank runs the same number of them: a rank whose share is one
  // short runs some batch again and does not count it.
  dist::ProcessGroup& world = dist_->world();
  const int64_t ranks = world.size(), rank = world.rank();
  const int64_t count = static_cast<int64_t>(batches.size());
  const int64_t rounds = (count + ranks - 1) / ranks;
  double total = 0;
  int64_t tokens = 0;
  for (int64_t round = 0; round < rounds; ++round) {
    if (on_progress) on_progress(std::min(round * ranks, count), count);
    if (stop_requested &&
        world.all_reduce_host(int64_t{stop_requested() ? 1 : 0}, dist::ReduceOp::Max) != 0)
      return std::nullopt;
    const int64_t index = round * ranks + rank;
    const bool counted = index < count;
    const Batch& b = batches[static_cast<size_t>(counted ? index : rank % count)];
    Tensor ids = b.input_ids.to(device_, MemoryCategory::Activations);
    Tensor targets = b.targets.to(device_, MemoryCategory::Activations);
    const double loss_sum = model_->loss_sum(ids, targets).item();
    if (!counted) continue;
    total += loss_sum;
    tokens += b.num_target_tokens;
  }
  if (on_progress) on_progress(count, count);
  total = world.all_reduce_host(total, dist::ReduceOp::Sum);
  tokens = world.all_reduce_host(tokens, dist::ReduceOp::Sum);
  return tokens > 0 ? total / static_cast<double>(tokens) : 0.0;
}

}  // namespace shardtrain::train
