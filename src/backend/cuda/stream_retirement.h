// What the rest of the CUDA backend is told when an owned Stream is destroyed.
//
// The driver may hand a destroyed stream's handle to the next stream created, so anything keyed
// by a raw handle (the caching allocator's per-stream blocks and deferred frees, cuBLASLt
// workspaces) must stop referring to a stream once it is gone. A Stream's destructor first waits
// for the stream's work, then calls forget_stream with the stream's device current, then
// destroys the stream: what belonged to the handle may be freed, since nothing queued on it can
// still be running.
#pragma once
#include <cuda_runtime.h>

namespace shardtrain::cuda {

// Tells the device's caching allocator and the registered CUDA backend (register.cpp) that
// `stream` is gone; nothing to do before the backend is registered. Never throws.
void forget_stream(int device, cudaStream_t stream) noexcept;

}  // namespace shardtrain::cuda
