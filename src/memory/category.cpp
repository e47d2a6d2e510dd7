#include "shardtrain/memory/category.h"

namespace shardtrain {

namespace {
thread_local MemoryCategory tls_category = MemoryCategory::Activations;
}

std::string_view category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::Parameters:
      return "parameters";
    case MemoryCategory::Gradients:
      return "gradients";
    case MemoryCategory::OptimizerState:
      return "optimizer_state";
    case MemoryCategory::Activations:
      return "activations";
    case MemoryCategory::Offloaded:
      return "offloaded";
    case MemoryCategory::Workspace:
      return "workspace";
  }
  return "?";
}

CategoryScope::CategoryScope(MemoryCategory category) : previous_(tls_category) {
  tls_category = category;
}
CategoryScope::~CategoryScope() {
  tls_category = previous_;
}
MemoryCategory CategoryScope::current() {
  return tls_category;
}

}  // namespace shardtrain
