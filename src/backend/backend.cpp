#include "shardtrain/backend/backend.h"

#include <array>

namespace shardtrain {

namespace {
std::array<Backend*, 3>& backends() {
  static std::array<Backend*, 3> b{};
  return b;
}
}  // namespace

void register_backend(DeviceKind kind, Backend* backend) {
  backends()[static_cast<size_t>(kind)] = backend;
}

Backend& backend_for(Device device) {
  DeviceKind kind = device.is_host() ? DeviceKind::CPU : device.kind;
  Backend* b = backends()[static_cast<size_t>(kind)];
  if (b == nullptr)
    throw Error("no compute backend for " + device.str() +
                (device.is_cuda() ? ": this build has no CUDA backend or no GPU is usable"
                                  : ": the CPU backend was not linked"));
  return *b;
}

bool cuda_backend_available() { return backends()[static_cast<size_t>(DeviceKind::CUDA)] != nullptr; }

}  // namespace shardtrain
