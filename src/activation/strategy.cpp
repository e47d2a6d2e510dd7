#include "shardtrain/activation/strategy.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "shardtrain/activation/checkpoint.h"
#include "shardtrain/activation/offload.h"
#include "shardtrain/core/error.h"
#include "shardtrain/nn/lora.h"

namespace shardtrain::activation {

const std::vector<std::string>& activation_strategies() {
  static const std::vector<std::string> names = {"none",      "per_layer", "sqrt_segment",
                                                 "selective", "offload",   "offload_checkpoint"};
  return names;
}

void check_strategy(const std::string& strategy) {
  const auto& names = activation_strategies();
  if (std::find(names.begin(), names.end(), strategy) != names.end()) return;
  throw ConfigError(
      fmt::format("activation.strategy = '{}' is not a known strategy; expected one of {}",
                  strategy, fmt::join(names, ", ")));
}

std::vector<std::pair<int, int>> sqrt_segments(int num_layers,
                                               const std::function<bool(int)>& applies) {
  auto selected = [&](int i) { return !applies || applies(i); };
  int n = 0;
  for (int i = 0; i < num_layers; ++i) n += selected(i) ? 1 : 0;
  std::vector<std::pair<int, int>> out;
  if (n == 0) return out;
  int count = static_cast<int>(std::ceil(std::sqrt(static_cast<double>(n))));
  int size = (n + count - 1) / count;
  for (int i = 0; i < num_layers;) {
    if (!selected(i)) {
      ++i;
      continue;
    }
    int first = i, last = i;
    while (last + 1 < num_layers && selected(last + 1) && last + 1 - first < size) ++last;
    out.emplace_back(first, last);
    i = last + 1;
  }
  return out;
}

namespace {

// The segment regions of sqrt_segment. The model runs a segment's layers one wrapper call at a
// time; the region is opened by the first layer's call, each layer's inner function is one piece
// of it (so the re-run repeats exactly those), and the last layer's call closes it.
struct SegmentRunner {
  std::vector<int> first_of;  // per layer: first layer of its segment, or -1
  std::vector<int> last_of;
  CheckpointOptions checkpoint;
  std::unique_ptr<CheckpointRegion> open;
  int next_layer = -1;  // the layer the open region expects next

  Tensor run(int layer, const TensorFn& inner, const Tensor& x) {
    auto i = static_cast<size_t>(layer);
    if (i >= first_of.size() || first_of[i] < 0) return inner(x);
    if (layer == first_of[i]) {
      open = std::make_unique<CheckpointRegion>(std::vector<Tensor>{x}, checkpoint);
    } else if (!open || next_layer != layer) {
      // Entered in the middle of a segment (a forward that does not start at layer 0): this
      // layer is a region of its own.
      open.reset();
      return activation::checkpoint(inner, x, checkpoint);
    }
    Tensor y = open->run(inner, x);
    next_layer = layer + 1;
    if (layer == last_of[i]) {
      y = open->finish(y);
      open.reset();
      next_layer = -1;
    }
    return y;
  }
};

}  // namespace

void apply_activation_strategy(nn::LlamaModel& model, const ActivationOptions& options) {
  const std::string& s = options.strategy;
  std::function<bool(int)> applies = options.applies_to_layer;
  if (!applies) applies = [](int) { return true; };
  CheckpointOptions ckpt;
  ckpt.reentrant = options.reentrant;
  // A re-run must draw what the first run drew: the LoRA adapters' dropout masks come from
  // their generators, which every region records and replays (those the region does not use
  // come back unchanged).
  for (const auto& [name, adapter] : nn::lora_modules(model))
    ckpt.generators.push_back(&adapter->dropout_generator());

  if (s == "none") return;
  if (s == "per_layer") {
    model.add_layer_wrapper([applies, ckpt](int layer, const TensorFn& inner, const Tensor& x) {
      return applies(layer) ? checkpoint(inner, x, ckpt) : inner(x);
    });
    return;
  }
  if (s == "sqrt_segment") {
    auto runner = std::make_shared<SegmentRunner>();
    runner->checkpoint = ckpt;
    int n = model.num_layers();
    runner->first_of.assign(static_cast<size_t>(n), -1);
    runner->last_of.assign(static_cast<size_t>(n), -1);
    for (auto [first, last] : sqrt_segments(n, applies)) {
      for (int i = first; i <= last; ++i) {
        runner->first_of[static_cast<size_t>(i)] = first;
        runner->last_of[static_cast<size_t>(i)] = last;
      }
    }
    model.add_layer_wrapper([runner](int layer, const TensorFn& inner, const Tensor& x) {
      return runner->run(layer, inner, x);
    });
    return;
  }
  if (s == "selective") {
    model.add_attention_core_wrapper([applies, ckpt](int layer, const nn::AttentionCoreFn& inner,
                                                     const Tensor& q, const Tensor& k,
                                                     const Tensor& v) {
      if (!applies(layer)) return inner(q, k, v);
      TensorsFn core = [inner](const std::vector<Tensor>& a) {
        return std::vector<Tensor>{inner(a.at(0), a.at(1), a.at(2))};
      };
      return checkpoint_multi(core, {q, k, v}, ckpt).at(0);
    });
    return;
  }
  if (s == "offload" || s == "offload_checkpoint") {
    auto hooks = std::make_shared<OffloadHooks>(options.offload_min_bytes);
    bool recompute = s == "offload_checkpoint";
    model.add_layer_wrapper(
        [applies, ckpt, hooks, recompute](int layer, const TensorFn& inner, const Tensor& x) {
          if (!applies(layer)) return inner(x);
          // offload: the layer's saved tensors are packed by these hooks. offload_checkpoint:
          // only the region's kept input is (the region's own pair is innermost inside it).
          autograd::SavedTensorHooksScope scope = hooks->scope();
          return recompute ? checkpoint(inner, x, ckpt) : inner(x);
        });
    return;
  }
  check_strategy(s);  // throws: each known strategy returned above
}

}  // namespace shardtrain::activation
