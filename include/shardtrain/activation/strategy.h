// Activation-memory strategies for a LlamaModel, installed as layer / attention-core wrappers.
//
//   none                nothing changes: every saved tensor stays on the device
//   per_layer           each decoder layer is a checkpoint region (keeps only its input)
//   sqrt_segment        ceil(sqrt(n)) regions of consecutive layers (keeps only segment inputs)
//   selective           only the attention core (scores, softmax, weighted sum) is a region
//   offload             every layer's saved tensors go to the host pool (OffloadHooks)
//   offload_checkpoint  per_layer, with each region's one kept input in the host pool
//
// docs/activation-memory.md says what each keeps, recomputes and moves.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/nn/llama.h"

namespace shardtrain::activation {

struct ActivationOptions {
  std::string strategy = "none";
  // Layers the strategy applies to (the others run as under none); empty means every layer.
  std::function<bool(int)> applies_to_layer;
  bool reentrant = false;         // checkpoint mechanism: reentrant or non-reentrant (default)
  int64_t offload_min_bytes = 0;  // offloading leaves smaller saved tensors on the device
};

// The accepted strategy names, in the order above.
const std::vector<std::string>& activation_strategies();

// Throws ConfigError naming `activation.strategy` and the accepted names unless `strategy` is
// one of them.
void check_strategy(const std::string& strategy);

// Installs the wrappers for `options.strategy` on `model`. Throws ConfigError naming
// `activation.strategy` for an unknown strategy. Call once per model, and before other layer
// wrappers (FSDP, mixed precision) are added: wrappers added later run inside the strategy's
// wrapper, so a checkpoint re-run repeats them (gathering parameters again, for example).
void apply_activation_strategy(nn::LlamaModel& model, const ActivationOptions& options);

// The segments sqrt_segment uses: the selected layers, split at unselected ones, cut into
// pieces of at most ceil(n / ceil(sqrt(n))) consecutive layers (n = number selected). Each pair
// is [first, last], inclusive.
std::vector<std::pair<int, int>> sqrt_segments(int num_layers,
                                               const std::function<bool(int)>& applies_to_layer);

}  // namespace shardtrain::activation
