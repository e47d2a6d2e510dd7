// The layout of a flat parameter: a unit's parameters concatenated into one 1-d buffer, padded
// so that it splits into equal shards, one per rank of the shard group.
//
//   flat  = [ p0 (numel0) | p1 (numel1) | ... | padding ]     padded = shard_numel * num_shards
//   shard s = flat[s * shard_numel, (s + 1) * shard_numel)
//
// A parameter may straddle shards; the part of parameter i inside shard s is a "piece".
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/core/shape.h"

namespace shardtrain::fsdp {

struct FlatParamLayout {
  struct Entry {
    std::string name;
    Shape shape;
    int64_t offset = 0;  // first element in the flat buffer
    int64_t numel = 0;
  };
  // The elements [param_begin, param_begin + length) of parameter `param` (flattened row-major),
  // stored at shard_offset within the shard.
  struct Piece {
    int param = 0;
    int64_t param_begin = 0;
    int64_t length = 0;
    int64_t shard_offset = 0;
  };

  std::vector<Entry> entries;
  int num_shards = 1;
  int64_t total = 0;        // sum of the parameters' elements
  int64_t padded = 0;       // total rounded up to a multiple of num_shards
  int64_t shard_numel = 0;  // padded / num_shards

  // Lays the parameters out in the order given. Throws ShapeError for num_shards < 1.
  static FlatParamLayout build(const std::vector<std::pair<std::string, Shape>>& params,
                               int num_shards);
  // The non-empty pieces of shard `shard`, in flat order.
  std::vector<Piece> pieces_of_shard(int shard) const;
};

}  // namespace shardtrain::fsdp
