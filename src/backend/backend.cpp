#include "shardtrain/backend/backend.h"

#include <array>

#include "builtin.h"

namespace shardtrain {

namespace {

using BackendTable = std::array<Backend*, 3>;

BackendTable& backends() {
  static BackendTable b{};
  return b;
}

// Registers the built-in backends on first use (thread-safe through the function-local static).
// Backends registered explicitly before that keep their slot.
void ensure_builtin_backends() {
  static const bool registered = [] {
    const BackendTable explicit_backends = backends();
    detail::register_builtin_backends();
    for (size_t i = 0; i < explicit_backends.size(); ++i)
      if (explicit_backends[i] != nullptr) backends()[i] = explicit_backends[i];
    return true;
  }();
  (void)registered;
}

}  // namespace

void register_backend(DeviceKind kind, Backend* backend) {
  backends()[static_cast<size_t>(kind)] = backend;
}

Backend& backend_for(Device device) {
  ensure_builtin_backends();
  DeviceKind kind = device.is_host() ? DeviceKind::CPU : device.kind;
  Backend* b = backends()[static_cast<size_t>(kind)];
  if (b == nullptr)
    throw Error("no compute backend for " + device.str() +
                (device.is_cuda() ? ": this build has no CUDA backend or no GPU is usable"
                                  : ": the CPU backend was not linked"));
  return *b;
}

bool cuda_backend_available() {
  ensure_builtin_backends();
  return backends()[static_cast<size_t>(DeviceKind::CUDA)] != nullptr;
}

}  // namespace shardtrain
