#include "shardtrain/activation/offload.h"

#include <any>
#include <chrono>
#include <unordered_map>
#include <vector>

#include "shardtrain/activation/counters.h"

namespace shardtrain::activation {

namespace detail {

namespace {
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}
}  // namespace

struct OffloadGroup;

// One offloaded tensor. Owned by the SavedTensors that packed it, so both copies go away once the
// last op that saved it has run its backward.
struct OffloadEntry {
  Tensor host;         // until restored
  Tensor device_copy;  // once restored
  Device device;
  std::shared_ptr<OffloadGroup> group;
  // Identity of the device tensor it was copied from, to move a tensor saved twice only once.
  std::weak_ptr<Storage> source;
  int64_t offset = 0;
  Shape shape;
  DType dtype = DType::F32;

  void restore() {
    if (device_copy.defined()) return;
    Clock::time_point start = Clock::now();
    device_copy = host.to(device, MemoryCategory::Activations);
    int64_t bytes = static_cast<int64_t>(host.nbytes());
    host = Tensor();
    count_restore(bytes, seconds_since(start));
  }
};

struct OffloadGroup {
  int64_t id = 0;
  bool started = false;  // backward has unpacked one of its tensors
  std::vector<std::weak_ptr<OffloadEntry>> entries;
};

struct OffloadState {
  int64_t min_bytes = 0;
  int64_t next_group = 0;
  std::vector<std::weak_ptr<OffloadGroup>> groups;  // creation order
  std::unordered_multimap<const Storage*, std::weak_ptr<OffloadEntry>> by_storage;

  void forget_expired() {
    std::erase_if(groups, [](const std::weak_ptr<OffloadGroup>& g) { return g.expired(); });
    std::erase_if(by_storage, [](const auto& kv) { return kv.second.expired(); });
  }

  // The group packed most recently before `g` that still holds offloaded tensors: the one
  // backward reaches next.
  std::shared_ptr<OffloadGroup> previous(const OffloadGroup& g) {
    std::shared_ptr<OffloadGroup> best;
    for (const auto& w : groups) {
      std::shared_ptr<OffloadGroup> candidate = w.lock();
      if (!candidate || candidate->id >= g.id || (best && candidate->id < best->id)) continue;
      bool holds = false;
      for (const auto& e : candidate->entries) holds = holds || !e.expired();
      if (holds) best = candidate;
    }
    return best;
  }

  std::shared_ptr<OffloadEntry> find(const Tensor& t) {
    auto range = by_storage.equal_range(t.impl()->storage.get());
    for (auto it = range.first; it != range.second; ++it) {
      std::shared_ptr<OffloadEntry> e = it->second.lock();
      if (e && e->source.lock() == t.impl()->storage && e->offset == t.impl()->offset &&
          e->shape == t.shape() && e->dtype == t.dtype())
        return e;
    }
    return nullptr;
  }

  bool keep_on_device(const Tensor& t) const {
    if (!t.defined() || t.device().is_host()) return true;
    if (static_cast<int64_t>(t.nbytes()) < min_bytes) return true;
    MemoryCategory c = t.category();
    return c == MemoryCategory::Parameters || c == MemoryCategory::Gradients;
  }

  std::any pack(const Tensor& t, const std::shared_ptr<OffloadGroup>& group) {
    if (keep_on_device(t)) return t;
    if (std::shared_ptr<OffloadEntry> existing = find(t)) return existing;
    Clock::time_point start = Clock::now();
    auto e = std::make_shared<OffloadEntry>();
    e->host = t.to(Device::host(), MemoryCategory::Offloaded);
    e->device = t.device();
    e->group = group;
    e->source = t.impl()->storage;
    e->offset = t.impl()->offset;
    e->shape = t.shape();
    e->dtype = t.dtype();
    group->entries.push_back(e);
    by_storage.emplace(t.impl()->storage.get(), e);
    count_offload(static_cast<int64_t>(t.nbytes()), seconds_since(start));
    return e;
  }

  Tensor unpack(std::any& handle) {
    if (const Tensor* kept = std::any_cast<Tensor>(&handle)) return *kept;
    auto e = std::any_cast<std::shared_ptr<OffloadEntry>>(handle);
    e->restore();
    OffloadGroup& g = *e->group;
    if (!g.started) {
      g.started = true;
      // Backward has reached this group: bring back the one it reaches next.
      if (std::shared_ptr<OffloadGroup> prev = previous(g)) {
        for (const auto& w : prev->entries)
          if (std::shared_ptr<OffloadEntry> p = w.lock()) p->restore();
      }
    }
    return e->device_copy;
  }
};

}  // namespace detail

OffloadHooks::OffloadHooks(int64_t min_bytes) : state_(std::make_shared<detail::OffloadState>()) {
  ST_CHECK_AS(ConfigError, min_bytes >= 0, "activation.offload_min_bytes must be >= 0, got ",
              min_bytes);
  state_->min_bytes = min_bytes;
}

OffloadHooks::~OffloadHooks() = default;

int64_t OffloadHooks::min_bytes() const {
  return state_->min_bytes;
}

autograd::SavedTensorHooksScope OffloadHooks::scope() {
  state_->forget_expired();
  auto group = std::make_shared<detail::OffloadGroup>();
  group->id = state_->next_group++;
  state_->groups.push_back(group);
  std::shared_ptr<detail::OffloadState> state = state_;
  autograd::SavedTensorHooks hooks;
  // The pack hook holds the group until the scope's last saved tensor is gone; entries hold it
  // after that, so an empty group disappears with the hooks.
  hooks.pack = [state, group](const Tensor& t) { return state->pack(t, group); };
  hooks.unpack = [state](std::any& handle) { return state->unpack(handle); };
  return autograd::SavedTensorHooksScope(std::move(hooks));
}

}  // namespace shardtrain::activation
