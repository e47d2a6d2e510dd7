// Registration of the backends compiled into this build. backend_for() and
// cuda_backend_available() call register_builtin_backends() once, on first use, so no static
// initialiser order matters. The registration functions must not call backend_for() themselves.
#pragma once

namespace shardtrain::detail {

// Registers the CPU backend and, in CUDA builds, calls register_cuda_backend().
void register_builtin_backends();

// Defined by the CUDA backend (src/backend/cuda) and referenced only when SHARDTRAIN_HAVE_CUDA is
// defined, so CPU-only builds link without it. Registers the CUDA backend, allocators and copy
// functions when a GPU is usable; does nothing otherwise.
void register_cuda_backend();

}  // namespace shardtrain::detail
