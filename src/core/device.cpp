#include "shardtrain/core/device.h"

#include "shardtrain/core/error.h"

namespace shardtrain {

std::string Device::str() const {
  switch (kind) {
    case DeviceKind::Host:
      return "host";
    case DeviceKind::CPU:
      return "cpu";
    case DeviceKind::CUDA:
      return "cuda:" + std::to_string(index);
  }
  return "?";
}

Device parse_device(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  if (text == "host") return Device::host();
  if (text == "cuda") return Device::cuda(0);
  if (text.rfind("cuda:", 0) == 0) {
    try {
      size_t used = 0;
      int index = std::stoi(text.substr(5), &used);
      if (used == text.size() - 5 && index >= 0) return Device::cuda(index);
    } catch (const std::exception&) {
    }
  }
  throw ConfigError("unknown device '" + text + "': expected cpu, cuda or cuda:N");
}

}  // namespace shardtrain
