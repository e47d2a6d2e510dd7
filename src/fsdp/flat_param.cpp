#include "shardtrain/fsdp/flat_param.h"

#include <algorithm>

#include "shardtrain/core/error.h"

namespace shardtrain::fsdp {

FlatParamLayout FlatParamLayout::build(const std::vector<std::pair<std::string, Shape>>& params,
                                       int num_shards) {
  ST_CHECK_SHAPE(num_shards >= 1, "a flat parameter needs at least one shard, got ", num_shards);
  FlatParamLayout layout;
  layout.num_shards = num_shards;
  for (const auto& [name, shape] : params) {
    Entry e{name, shape, layout.total, numel(shape)};
    layout.total += e.numel;
    layout.entries.push_back(std::move(e));
  }
  layout.shard_numel = (layout.total + num_shards - 1) / num_shards;
  layout.padded = layout.shard_numel * num_shards;
  return layout;
}

std::vector<FlatParamLayout::Piece> FlatParamLayout::pieces_of_shard(int shard) const {
  ST_CHECK_SHAPE(shard >= 0 && shard < num_shards, "shard ", shard, " of a flat parameter with ",
                 num_shards, " shards");
  const int64_t lo = shard * shard_numel, hi = lo + shard_numel;
  std::vector<Piece> out;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    int64_t begin = std::max(lo, e.offset), end = std::min(hi, e.offset + e.numel);
    if (begin >= end) continue;
    out.push_back({static_cast<int>(i), begin - e.offset, end - begin, begin - lo});
  }
  return out;
}

}  // namespace shardtrain::fsdp
