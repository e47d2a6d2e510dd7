// How the offload hooks move a saved tensor between its device and the host pool. One interface,
// two implementations: synchronous copies (the CPU device, or any device when asked for), and in
// CUDA builds copies that overlap compute on two copy streams per GPU, ordered with the compute
// stream by events. The hooks (offload.cpp) decide *when* to copy and when host buffers may go;
// this decides *how*, so both paths share every decision.
#pragma once
#include <memory>

#include "shardtrain/activation/offload.h"
#include "shardtrain/tensor/tensor.h"

namespace shardtrain::activation::detail {

// One copy between a device and the host pool, finished or in flight.
class Copy {
 public:
  virtual ~Copy() = default;
  // Whether the copy has finished, without waiting. The first time it is seen finished, its
  // duration is added to the copy_seconds counter.
  virtual bool finished() = 0;
  // Blocks the host until the copy has finished (then counts it as finished() does).
  virtual void wait() = 0;
  // For a copy to the device, before `result` (its destination) is handed to compute: work
  // issued from now on on the current stream of result's device runs after the copy.
  virtual void order_use(const Tensor& result) = 0;
  // For a copy to the device, before the last reference to `result` goes: its memory is handed
  // out again only after the copy has written it, even if it was never handed to compute.
  virtual void order_release(const Tensor& result) = 0;
};

struct Moved {
  Tensor tensor;               // the destination
  std::unique_ptr<Copy> copy;  // the copy that fills it
};

class Transfers {
 public:
  virtual ~Transfers() = default;
  // Copies `src` (device memory) into a new host-pool tensor counted as Offloaded. `src` may be
  // freed as soon as this returns.
  virtual Moved to_host(const Tensor& src) = 0;
  // Copies `host` (filled by `filled`, an earlier to_host of this object) into a new tensor on
  // `device` counted as Activations, allocated for the device's current stream. `host` must stay
  // allocated until the returned copy has finished.
  virtual Moved to_device(const Tensor& host, Device device, Copy& filled) = 0;
};

// Tensor::to on the current stream, waiting for each copy.
std::unique_ptr<Transfers> synchronous_transfers();
// What OffloadHooks uses for tensors of `device`: overlapped copies for a CUDA device in a CUDA
// build when `copies` asks for them, synchronous copies otherwise.
std::unique_ptr<Transfers> make_transfers(Device device, OffloadCopies copies);

}  // namespace shardtrain::activation::detail
