// What the rest of the CUDA backend is told when an owned Stream is destroyed.
//
// The driver may hand a destroyed stream's handle to the next stream created, so anything keyed
// by a raw handle (the caching allocator's per-stream blocks and deferred frees, cuBLASLt
// workspaces) must stop referring to a stream once it is gone. A Stream's destructor first waits
// for the stream's work, then calls every hook with the stream's device current, then destroys
// the stream: a hook may forget the handle and free what belonged to it, since nothing queued
// on it can still be running.
#pragma once
#include <cuda_runtime.h>

#include <functional>

namespace shardtrain::cuda {

// Hooks must not throw (they run in destructors); they run in the order they were added.
using StreamRetiredHook = std::function<void(int device, cudaStream_t stream)>;
void add_stream_retired_hook(StreamRetiredHook hook);

}  // namespace shardtrain::cuda
