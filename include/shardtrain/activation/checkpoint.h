// Activation checkpointing: run a region of the forward without keeping what its ops save for
// backward, and re-run it when backward needs those tensors.
//
// Two mechanisms, as in torch.utils.checkpoint:
//
//  * non-reentrant (default): the region runs with gradients on, under a saved-tensor hook pair
//    whose pack stores only an index. The region's inputs are kept (saved through whatever hook
//    pair is active outside, so an enclosing checkpoint or offload applies to them). The first
//    unpack in backward re-runs the region on the detached inputs under a hook pair that captures
//    the tensors the ops save, in order, and stops the re-run as soon as the last one the forward
//    packed exists. The autograd graph is the forward's own; the re-run's graph is discarded.
//    Regions nest, and outputs that backward never reaches cost nothing.
//  * reentrant: the region runs under NoGrad and its outputs hang off one CheckpointBackward
//    node. Its apply re-runs the whole region with gradients on and calls autograd::backward on
//    the re-run's outputs (a backward inside a backward), then returns the inputs' gradients.
//    Gradients of parameters used inside reach their accumulators through that inner backward.
//
// Code inside a region must be deterministic given its inputs and the generators listed in
// CheckpointOptions, and exception-safe (the non-reentrant re-run is stopped by an exception).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "shardtrain/nn/llama.h"

namespace shardtrain::activation {

using nn::TensorFn;
// A function of several tensors returning several tensors (the multi-input, multi-output form).
using TensorsFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// The two integers that determine a Generator's future draws.
struct RngState {
  uint64_t seed = 0;
  uint64_t offset = 0;
};
RngState snapshot_rng(const Generator& gen);
void restore_rng(Generator& gen, const RngState& state);

struct CheckpointOptions {
  bool reentrant = false;
  // Generators the region draws from. Their state is recorded when the region starts and
  // restored for the re-run (and put back afterwards), so the re-run draws the same numbers.
  std::vector<Generator*> generators;
};

// y = fn(input) inside a checkpoint region.
Tensor checkpoint(const TensorFn& fn, const Tensor& input, const CheckpointOptions& options = {});
// The multi-input, multi-output form (e.g. the attention core on q, k, v).
std::vector<Tensor> checkpoint_multi(const TensorsFn& fn, const std::vector<Tensor>& inputs,
                                     const CheckpointOptions& options = {});

namespace detail {
class RegionState;
}

// A checkpoint region whose forward is spread over several calls, e.g. a segment of decoder
// layers that the model runs one layer at a time. Each run() is one piece; the re-run chains the
// pieces in order, so the arguments of each run() must be the results of the previous one (the
// first run() gets the region's inputs). finish() ends the region and returns the outputs that
// the rest of the forward must use (the reentrant form attaches its node to them).
//
// Outside grad mode a region just runs its pieces.
class CheckpointRegion {
 public:
  CheckpointRegion(const std::vector<Tensor>& inputs, const CheckpointOptions& options = {});
  ~CheckpointRegion();
  CheckpointRegion(const CheckpointRegion&) = delete;
  CheckpointRegion& operator=(const CheckpointRegion&) = delete;

  std::vector<Tensor> run(const TensorsFn& piece, const std::vector<Tensor>& args);
  Tensor run(const TensorFn& piece, const Tensor& arg);
  std::vector<Tensor> finish(const std::vector<Tensor>& outputs);
  Tensor finish(const Tensor& output);

 private:
  std::unique_ptr<detail::RegionState> state_;
};

}  // namespace shardtrain::activation
