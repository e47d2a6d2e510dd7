// Tensor shapes: a short vector of extents, row-major.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace shardtrain {

using Shape = std::vector<int64_t>;

int64_t numel(const Shape& shape);
std::string shape_str(const Shape& shape);  // "[2, 3, 4]"

}  // namespace shardtrain
