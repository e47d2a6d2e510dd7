#include "shardtrain/train/check.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/core/word_hash.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/train/runtime.h"

namespace shardtrain::train {

namespace {

// One AdamW hyper-parameter of the reference step: the whole text a finite number that `allowed`
// accepts (a value the reference cannot have run with is a damaged or hand-edited file).
float metadata_float(const std::map<std::string, std::string>& meta, const std::string& key,
                     const std::string& file, bool (*allowed)(double), const char* range) {
  auto it = meta.find(key);
  if (it == meta.end())
    throw FormatError("'" + file + "' has no '" + key +
                      "' in its __metadata__ (the AdamW hyper-parameters of the reference step)");
  const std::string& text = it->second;
  double v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty() || !std::isfinite(v))
    throw FormatError("'" + file + "': __metadata__ '" + key + "' = '" + text +
                      "' is not a number");
  if (!allowed(v))
    throw FormatError("'" + file + "': __metadata__ '" + key + "' = " + text +
                      " is out of range: must be " + range);
  return static_cast<float>(v);
}

// What a reference case holds for a model: loss, logits, and each parameter's gradient and value
// after one step. All of them are compared: a case missing some would pass on the rest.
std::vector<std::string> reference_names(const std::vector<std::string>& parameters) {
  std::vector<std::string> names = {"loss", "logits"};
  for (const std::string& p : parameters) names.push_back("grad." + p);
  for (const std::string& p : parameters) names.push_back("step1." + p);
  return names;
}

std::string listed(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 8) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

// `extra_atol` (optional, per element) widens the absolute tolerance element by element.
TensorError compare(const std::string& name, const std::vector<float>& got,
                    const std::vector<float>& want, double rtol, double atol, bool normwise,
                    const std::vector<double>* extra_atol = nullptr) {
  TensorError e;
  e.name = name;
  e.normwise = normwise;
  e.numel = static_cast<int64_t>(want.size());
  if (got.size() != want.size()) {
    e.max_abs = e.max_rel = INFINITY;
    return e;
  }
  double sq = 0;
  for (float w : want) sq += static_cast<double>(w) * w;
  double rms = want.empty() ? 0 : std::sqrt(sq / static_cast<double>(want.size()));
  e.tolerance_rtol = rtol;
  e.widened_atol = extra_atol != nullptr;
  e.tolerance_atol = atol >= 0 ? atol : rtol * rms;
  e.ok = true;
  double err_sq = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    double diff = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!std::isfinite(static_cast<double>(got[i]))) diff = INFINITY;
    e.max_abs = std::max(e.max_abs, diff);
    e.max_rel = std::max(
        e.max_rel, diff / (std::fabs(static_cast<double>(want[i])) + e.tolerance_atol + 1e-30));
    double allowed = e.tolerance_atol + rtol * std::fabs(static_cast<double>(want[i]));
    if (extra_atol) allowed += (*extra_atol)[i];
    if (!(diff <= allowed)) e.ok = false;
    err_sq += diff * diff;
  }
  e.rel_l2 = sq > 0 ? std::sqrt(err_sq / sq) : std::sqrt(err_sq);
  if (normwise) e.ok = e.rel_l2 <= rtol;
  return e;
}

}  // namespace

bool CheckReport::ok() const {
  for (const TensorError& t : tensors)
    if (!t.ok) return false;
  return !tensors.empty();
}

std::string CheckReport::table() const {
  std::string out = setting.empty() ? std::string() : setting + "\n";
  // An element passes within atol + rtol x |reference|; the step's tensors add to atol, element
  // by element, what a gradient error allowed above moves an AdamW update by (at most 2 lr).
  out += fmt::format("{:<52} {:>10} {:>12} {:>12} {:>12} {:>10} {:>10}  {}\n", "tensor", "elements",
                     "max abs err", "max rel err", "rel L2 err", "rtol", "atol", "result");
  int failed = 0;
  for (const TensorError& t : tensors) {
    out += fmt::format("{:<52} {:>10} {:>12.3e} {:>12.3e} {:>12.3e} {:>10.1e} {:>10.1e}{} {}\n",
                       t.name, t.numel, t.max_abs, t.max_rel, t.rel_l2, t.tolerance_rtol,
                       t.tolerance_atol, t.widened_atol ? "+" : " ",
                       t.ok ? "ok" : (t.normwise ? "FAIL (L2)" : "FAIL"));
    failed += !t.ok;
  }
  return out + fmt::format("{} tensors compared, {} beyond tolerance: {}\n", tensors.size(), failed,
                           ok() ? "PASS" : "FAIL");
}

CheckReport run_check(Config config, const CheckOptions& options) {
  // The model is --model's config.json: a run config's model section (configs/tiny.yaml's
  // shape, say) describes another model and would be refused as contradicting it.
  config.model = ModelConfig{};
  config.model.from_hf = options.model_dir;
  resolve_model_from_hf(config.model, {}, "check --model");
  SafetensorsFile batch = SafetensorsFile::open(options.batch_file);
  SafetensorsFile expected = SafetensorsFile::open(options.expected_file);
  const auto& meta = expected.metadata();
  const std::string& ef = options.expected_file;
  if (auto it = meta.find("optimizer"); it != meta.end() && it->second != "adamw")
    throw FormatError("'" + ef + "': __metadata__ 'optimizer' = '" + it->second +
                      "': check reproduces one AdamW step, so the reference must be an AdamW one");
  ST_CHECK_AS(ConfigError, !config.lora.enabled,
              "check compares the gradients of every weight, and lora.enabled trains adapters "
              "only: run check without lora.enabled");
  auto unit = [](double v) { return v >= 0 && v < 1; };
  auto positive = [](double v) { return v > 0; };
  auto non_negative = [](double v) { return v >= 0; };
  config.optim.name = "adamw";
  config.optim.beta1 = metadata_float(meta, "beta1", ef, unit, "in [0, 1)");
  config.optim.beta2 = metadata_float(meta, "beta2", ef, unit, "in [0, 1)");
  config.optim.eps = metadata_float(meta, "eps", ef, positive, "> 0");
  config.optim.weight_decay = metadata_float(meta, "weight_decay", ef, non_negative, ">= 0");
  config.optim.decay_norms_and_embeddings = true;  // the reference decays every weight
  config.optim.grad_clip = 0;
  float lr = metadata_float(meta, "lr", ef, positive, "> 0");
  double eps = config.optim.eps;

  // The tolerance of the coarsest dtype the gradients pass through: the compute dtype, or the
  // reduce dtype they are rounded to when summed.
  const std::string& compute = config.precision.effective_param_dtype();
  const std::string& reduce = config.precision.reduce_dtype;
  const bool half = compute != "fp32" || reduce != "fp32";
  auto rtol_of = [](const std::string& dtype) {
    return dtype == "bf16" ? 5e-2 : dtype == "fp16" ? 1e-2 : 1e-4;
  };
  double rtol = options.rtol >= 0 ? options.rtol : std::max(rtol_of(compute), rtol_of(reduce));

  Batch full;
  // Token ids stored as floats would be truncated (or undefined, past int64) by the conversion.
  for (const char* name : {"input_ids", "targets"}) {
    const DType stored = batch.info(name).dtype;
    ST_CHECK_AS(FormatError, !is_floating(stored), "'", options.batch_file, "': ", name,
                " is stored as ", dtype_name(stored),
                "; token ids must be integers (I64, as the reference cases store them)");
  }
  full.input_ids = batch.load("input_ids", Device::cpu(), DType::I64);
  full.targets = batch.load("targets", Device::cpu(), DType::I64);
  ST_CHECK_AS(FormatError,
              full.input_ids.shape() == full.targets.shape() && full.input_ids.dim() == 2, "'",
              options.batch_file, "': input_ids ", full.input_ids.describe(), " and targets ",
              full.targets.describe(), " must both be [batch, seq]");
  ST_CHECK_AS(FormatError, full.input_ids.numel() > 0, "'", options.batch_file,
              "': the batch is empty (input_ids ", full.input_ids.describe(),
              "): a reference case needs at least one sequence");
  full.num_target_tokens = count_target_tokens(full.targets);
  int64_t b = full.batch_size();
  // The batch's tokens on the host, read once: checked, hashed across ranks and split below.
  const std::vector<int64_t> ids = full.input_ids.to_int_vector(),
                             tgt = full.targets.to_int_vector();
  {
    // Ids the model has no row for would stop the forward pass with a message that names no
    // file: say which tensor of which file, and where.
    const int64_t vocab = config.model.vocab_size;
    const int64_t s = full.seq_len();
    auto check_ids = [&](const std::vector<int64_t>& values, const char* name,
                         bool ignore_allowed) {
      for (size_t i = 0; i < values.size(); ++i) {
        const int64_t id = values[i];
        if ((id >= 0 && id < vocab) || (ignore_allowed && id == -100)) continue;
        throw FormatError(detail::concat(
            "'", options.batch_file, "': ", name, "[", i / s, ", ", i % s, "] = ", id,
            " is not a token id of the model's vocabulary of ", vocab, " (", options.model_dir,
            "/config.json)", ignore_allowed ? "; -100 marks a position without a target" : ""));
      }
    };
    check_ids(ids, "input_ids", false);
    check_ids(tgt, "targets", true);
  }

  Runtime rt(config);
  const int rank = rt.dist().rank(), world = rt.dist().world_size();
  if (world > 1) {
    // Runtime compared the ranks' configs; the files and tolerances are check's own: a rank given
    // others would compute another verdict than the one rank 0 prints.
    WordHash batch_hash, reference_hash;
    for (const std::vector<int64_t>* values : {&ids, &tgt})
      for (int64_t id : *values) batch_hash.update_value(id);
    for (const std::string& name : expected.names()) {
      const TensorInfo& info = expected.info(name);
      reference_hash.update(name.data(), name.size());
      reference_hash.update_value(static_cast<int>(info.dtype));
      for (int64_t d : info.shape) reference_hash.update_value(d);
    }
    for (const auto& [key, value] : meta) {
      reference_hash.update(key.data(), key.size());
      reference_hash.update(value.data(), value.size());
    }
    if (expected.contains("loss"))
      for (float v : expected.load("loss", Device::cpu(), DType::F32).to_float_vector())
        reference_hash.update_value(v);
    const std::vector<bool> differs = rt.dist().world().differs_between_ranks(
        {batch_hash.digest(), reference_hash.digest(), std::bit_cast<uint64_t>(options.rtol),
         std::bit_cast<uint64_t>(options.atol)});
    std::vector<std::string> differing;
    const char* flags[] = {"--batch", "--expected", "--rtol", "--atol"};
    for (size_t i = 0; i < differs.size(); ++i)
      if (differs[i]) differing.push_back(flags[i]);
    if (!differing.empty())
      throw ConfigError(fmt::format(
          "check: the ranks were given different {} (here, on rank {}: --batch '{}', --expected "
          "'{}'): give every rank the same command line",
          fmt::join(differing, ", "), rank, options.batch_file, options.expected_file));
  }
  // Under mpirun every rank takes an equal share of the sequences; ranks past the end get
  // padding sequences whose targets are all ignored (they still run every collective).
  int64_t per_rank = (b + world - 1) / world;
  int64_t micro = std::min<int64_t>(config.train.micro_batch, per_rank);
  ST_CHECK_AS(ConfigError, micro > 0 && per_rank % micro == 0, "train.micro_batch ", micro,
              " must divide the ", per_rank, " reference sequences each of the ", world,
              " ranks gets");
  Batch mine;
  {
    int64_t s = full.seq_len();
    std::vector<int64_t> my_ids(static_cast<size_t>(per_rank * s), 0),
        my_tgt(static_cast<size_t>(per_rank * s), -100);
    for (int64_t i = 0; i < per_rank; ++i) {
      int64_t row = rank * per_rank + i;
      if (row >= b) break;
      std::copy_n(ids.begin() + row * s, s, my_ids.begin() + i * s);
      std::copy_n(tgt.begin() + row * s, s, my_tgt.begin() + i * s);
    }
    mine.input_ids = from_ints(my_ids, {per_rank, s});
    mine.targets = from_ints(my_tgt, {per_rank, s});
    mine.num_target_tokens = count_target_tokens(mine.targets);
  }

  // The reference must hold every tensor there is to compare, and nothing else.
  std::vector<std::string> parameters;
  for (auto& [name, slot] : rt.model().named_parameters()) parameters.push_back(name);
  const std::vector<std::string> names = reference_names(parameters);
  std::vector<std::string> missing, unknown;
  for (const std::string& n : names)
    if (!expected.contains(n)) missing.push_back(n);
  for (const std::string& n : expected.names())
    if (std::find(names.begin(), names.end(), n) == names.end()) unknown.push_back(n);
  ST_CHECK_AS(FormatError, missing.empty(), "'", ef, "' lacks ", missing.size(), " of the ",
              names.size(), " reference tensors for this model: ", listed(missing),
              " (a reference case holds loss, logits, and grad.<name> and step1.<name> for "
              "every parameter of ",
              options.model_dir, ")");
  ST_CHECK_AS(FormatError, unknown.empty(), "'", ef, "' holds ", unknown.size(),
              " tensor(s) this model has no counterpart for: ", listed(unknown),
              " (misspelled? its parameters are named like ", parameters.front(), ")");

  CheckReport report;
  // The reference tensor `name`, whose shape must be `shape` (numel only for the loss).
  auto want = [&](const std::string& name, const Shape& shape) {
    Tensor t = expected.load(name);
    ST_CHECK_AS(FormatError, name == "loss" ? t.numel() == 1 : t.shape() == shape, "'", ef, "': '",
                name, "' is ", t.describe(), " but this model and batch give ",
                name == "loss" ? std::string("one number") : shape_str(shape));
    std::vector<float> values = t.to_float_vector();
    // An inf would make its element's tolerance (rtol x |reference|) and the tensor's default
    // atol (rtol x its RMS) infinite, and pass anything: a reference must be finite.
    for (size_t i = 0; i < values.size(); ++i)
      ST_CHECK_AS(FormatError, std::isfinite(values[i]), "'", ef, "': '", name, "' holds ",
                  values[i], " at element ", i,
                  ": a reference must hold finite numbers (regenerate it)");
    return values;
  };
  // Every parameter's full value (or gradient), gathered unit by unit when sharded.
  auto for_each_full = [&](bool gradients,
                           const std::function<void(const std::string&, const Tensor&)>& fn) {
    if (fsdp::ShardedModel* sharded = rt.sharded()) {
      if (gradients)
        sharded->for_each_full_gradient(fn);
      else
        sharded->for_each_full_parameter(fn);
      return;
    }
    for (auto& [name, slot] : rt.model().named_parameters()) {
      if (!gradients) {
        fn(name, *slot);
        continue;
      }
      Tensor g = autograd::grad(*slot);
      ST_CHECK(g.defined(), "parameter '", name, "' received no gradient");
      fn(name, g);
    }
  };

  // Logits without a graph (the same parameters, so the same numbers as the training forward);
  // every rank runs the whole reference batch so that sharded gathers line up.
  {
    autograd::NoGrad ng;
    Tensor logits = rt.model().forward(full.input_ids.to(rt.device()));
    const Shape shape = {full.batch_size(), full.seq_len(), logits.shape().back()};
    report.tensors.push_back(compare("logits", logits.to_float_vector(), want("logits", shape),
                                     rtol, options.atol, half));
  }
  std::vector<Batch> micro_batches = split_batch(mine, per_rank / micro);
  rt.optimizer().zero_grad();
  Runtime::Gradients grads = rt.forward_backward(micro_batches);
  ST_CHECK(!grads.found_inf, "the gradients overflowed at loss scale ", rt.scaler().scale(),
           "; lower precision.init_scale");
  report.tensors.push_back(compare("loss", {static_cast<float>(grads.loss)}, want("loss", {}), rtol,
                                   options.atol, half));
  for_each_full(true, [&](const std::string& name, const Tensor& g) {
    std::string key = "grad." + name;
    report.tensors.push_back(
        compare(key, g.to_float_vector(), want(key, g.shape()), rtol, options.atol, half));
  });
  rt.optimizer().step(lr);
  for_each_full(false, [&](const std::string& name, const Tensor& p) {
    std::string key = "step1." + name;
    // AdamW's first step moves each weight by lr * g / (|g| + eps): a gradient error d allowed
    // above moves it by up to lr * d / (|g| + eps), which is large where the reference gradient
    // is tiny (its sign is then decided by rounding). That bound, capped at 2 lr, is added per
    // element. In half precision rounding decides many signs: atol 2.5 lr throughout.
    double atol = half ? 2.5 * lr : options.atol;
    std::vector<double> slack;
    if (!half) {
      std::vector<float> g = want("grad." + name, p.shape());
      double sq = 0;
      for (float v : g) sq += static_cast<double>(v) * v;
      double grad_atol =
          (options.atol >= 0 ? options.atol : rtol * std::sqrt(sq / static_cast<double>(g.size())));
      slack.resize(g.size());
      for (size_t i = 0; i < g.size(); ++i)
        slack[i] = lr * std::min(2.0, grad_atol / (std::fabs(static_cast<double>(g[i])) + eps));
    }
    report.tensors.push_back(compare(key, p.to_float_vector(), want(key, p.shape()),
                                     half ? 1e-4 : rtol, atol, false,
                                     slack.empty() ? nullptr : &slack));
  });
  report.world_size = world;
  report.leader = rank == 0;
  report.setting = "on " + std::to_string(world) + (world == 1 ? " rank" : " ranks") + ", device " +
                   rt.device().str() + ", process group " + rt.dist().backend_name() +
                   (world > 1 ? ", sharding " + config.dist.sharding : std::string());
  return report;
}

}  // namespace shardtrain::train
