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

bool Backend::unscale_and_check_multi(const std::vector<Tensor*>& tensors, float inv_scale) {
  bool found = false;
  for (Tensor* t : tensors) found = unscale_and_check(*t, inv_scale) || found;
  return found;
}

std::vector<double> Backend::sum_squares_multi(const std::vector<const Tensor*>& tensors) {
  std::vector<double> out;
  out.reserve(tensors.size());
  for (const Tensor* t : tensors) out.push_back(sum_squares(*t));
  return out;
}

void Backend::adamw_multi(const std::vector<AdamWTensor>& tensors, const AdamWArgs& args) {
  for (const AdamWTensor& t : tensors) {
    AdamWArgs own = args;
    if (!t.decay) own.weight_decay = 0.0f;
    adamw(*t.param, *t.grad, *t.m, *t.v, own);
  }
}

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
