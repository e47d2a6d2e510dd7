// CPU activation offload: saved tensors move to the host pool when an op saves them and come back
// to their device when backward needs them (torch.autograd.graph.save_on_cpu(pin_memory=True),
// with a prefetch of the next layer and, on a GPU, copies on side streams that overlap compute).
#pragma once
#include <cstdint>
#include <memory>

#include "shardtrain/autograd/saved_tensor.h"

namespace shardtrain::activation {

namespace detail {
struct OffloadState;
}

// How copies between a GPU and the host pool run. The CPU device always copies synchronously.
enum class OffloadCopies {
  // On two copy streams per GPU, ordered with the compute stream by CUDA events; pack and unpack
  // do not wait on the host (see OffloadHooks for the few waits there are).
  Overlapped,
  // Tensor::to on the compute stream, waiting for every copy (for comparison and debugging).
  Synchronous,
};

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
// just before it (the next one backward will reach) is brought back, so on a GPU its copies run
// while this group's backward computes. Tensors of the group packed last (the first one backward
// reaches) come back one at a time, when they are needed.
//
// Overlapped copies on a GPU (the host pool is page-locked memory there):
//   pack:   an event on the compute stream; the device-to-host stream waits for it and copies into
//           a new host buffer. The device tensor's memory is marked as used by that stream
//           (cuda::record_stream), so the caching allocator hands it out again only after the
//           copy, however soon the caller frees it. Pack returns without waiting.
//   unpack: a new device buffer is allocated for the compute stream; the host-to-device stream
//           waits for the compute stream (the block may have been freed there by work still
//           queued) and for the copy that filled the host buffer, then copies. Before the tensor
//           is returned, the compute stream waits for that copy (cudaStreamWaitEvent, not the
//           host). A buffer that is never returned is ordered the same way before it is freed.
//   A host buffer returns to the pool only once the host has seen every copy that reads or writes
//   it finish: when a copy back is seen finished (checked at every pack and unpack, without
//   waiting), and at the latest when the last offloaded tensor of these hooks is released, which
//   waits. A pack also first waits for copies back still in flight from an earlier backward.
//   Saved tensors are not modified in place after they are saved (no op here does so); the
//   device-to-host copy relies on it, as it runs after pack has returned.
//
// Memory: allocations are the same as with synchronous copies, at the same points, for the same
// bytes; device memory is freed at the same points; a host buffer is freed at the same point or
// later, but before the next host buffer is allocated, so the Offloaded peak, the figures after
// forward and those once backward has released every offloaded tensor are the same. During
// backward the host's Offloaded bytes in use can be higher by the buffers whose copy back is still
// in flight.
class OffloadHooks {
 public:
  explicit OffloadHooks(int64_t min_bytes = 0, OffloadCopies copies = OffloadCopies::Overlapped);
  ~OffloadHooks();
  OffloadHooks(const OffloadHooks&) = delete;
  OffloadHooks& operator=(const OffloadHooks&) = delete;

  autograd::SavedTensorHooksScope scope();
  int64_t min_bytes() const;
  OffloadCopies copies() const;

 private:
  std::shared_ptr<detail::OffloadState> state_;
};

}  // namespace shardtrain::activation
