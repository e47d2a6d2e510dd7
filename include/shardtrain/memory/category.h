// What an allocation is for. Every byte a device or the host pool hands out is counted under one
// category, chosen by the innermost CategoryScope on the allocating thread (default: Activations).
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

namespace shardtrain {

enum class MemoryCategory : uint8_t {
  Parameters,
  Gradients,
  OptimizerState,
  Activations,
  Offloaded,
  Workspace,
};
constexpr int kNumMemoryCategories = 6;
std::string_view category_name(MemoryCategory c);  // "parameters", "gradients", ...

// RAII: allocations on this thread inside the scope are counted under `category`.
class CategoryScope {
 public:
  explicit CategoryScope(MemoryCategory category);
  ~CategoryScope();
  CategoryScope(const CategoryScope&) = delete;
  CategoryScope& operator=(const CategoryScope&) = delete;

  static MemoryCategory current();

 private:
  MemoryCategory previous_;
};

}  // namespace shardtrain
