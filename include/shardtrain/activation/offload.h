// CPU activation offload: saved tensors move to the host pool when an op saves them and come back
// to their device when backward needs them (torch.autograd.graph.save_on_cpu, with prefetch).
#pragma once
#include <cstdint>
#include <memory>

#include "shardtrain/autograd/saved_tensor.h"

namespace shardtrain::activation {

namespace detail {
struct OffloadState;
}

// A factory of saved-tensor hook scopes. Every scope() starts a new *group* (one decoder layer,
// say). Inside it, pack copies each saved tensor of at least `min_bytes` to the host pool
// (counted as Offloaded there) and lets the device copy go; unpack copies it back to its device
// (counted as Activations). A tensor saved by several ops of one forward is moved once.
//
// Kept on the device: tensors smaller than min_bytes, tensors already in the host pool, and
// parameters and their gradients, recognised by their storage's memory category (Parameters or
// Gradients): the pack hook sees a detached tensor, so a leaf that requires a gradient but was
// allocated under another category is offloaded like any activation.
//
// Prefetch: when backward unpacks the first tensor of a group, every tensor of the group packed
// just before it (the next one backward will reach) is brought back. On a CPU-only build the copy
// is synchronous, so prefetching changes when bytes come back, not how long it takes. The same
// code runs on CUDA, where Tensor::to copies synchronously on the current stream; overlapping the
// copy with compute (a side stream with an event the unpack waits on) is not done here.
class OffloadHooks {
 public:
  explicit OffloadHooks(int64_t min_bytes = 0);
  ~OffloadHooks();
  OffloadHooks(const OffloadHooks&) = delete;
  OffloadHooks& operator=(const OffloadHooks&) = delete;

  autograd::SavedTensorHooksScope scope();
  int64_t min_bytes() const;

 private:
  std::shared_ptr<detail::OffloadState> state_;
};

}  // namespace shardtrain::activation
