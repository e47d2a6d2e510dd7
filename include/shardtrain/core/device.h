// Where a tensor's bytes live.
//
// Three kinds: CUDA devices; the CPU *device*, on which the CPU backend computes; and the *host*
// pool, which stands for pinned host memory (offload targets). The CPU device and the host pool
// are separate memories with separate statistics, so a tensor moved to host on a CPU-only machine
// is a real copy that frees device bytes, and memory experiments read the same on CPU and GPU.
#pragma once
#include <string>

namespace shardtrain {

enum class DeviceKind : uint8_t { Host, CPU, CUDA };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;

  static Device host() { return {DeviceKind::Host, 0}; }
  static Device cpu() { return {DeviceKind::CPU, 0}; }
  static Device cuda(int i = 0) { return {DeviceKind::CUDA, i}; }

  bool is_host() const { return kind == DeviceKind::Host; }
  bool is_cpu() const { return kind == DeviceKind::CPU; }
  bool is_cuda() const { return kind == DeviceKind::CUDA; }
  // Host and CPU-device memory are ordinary process memory that CPU code may touch directly.
  bool cpu_addressable() const { return kind != DeviceKind::CUDA; }

  bool operator==(const Device&) const = default;
  std::string str() const;  // "host", "cpu", "cuda:0"
};

// Parses "cpu", "cuda", "cuda:1"; throws ConfigError naming the value otherwise.
Device parse_device(const std::string& text);

}  // namespace shardtrain
