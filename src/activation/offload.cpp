#include "shardtrain/activation/offload.h"

#include <any>
#include <chrono>
#include <cstdio>
#include <exception>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardtrain/activation/counters.h"
#include "transfer.h"

namespace shardtrain::activation {

namespace detail {

namespace {
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Errors on release paths are reported, not thrown: they run inside destructors.
void warn(const char* what, const std::exception& e) {
  std::fprintf(stderr, "shardtrain: activation offload: %s failed: %s\n", what, e.what());
}
}  // namespace

struct OffloadGroup;

// One offloaded tensor. Owned by the SavedTensors that packed it, so both copies go away once the
// last op that saved it has run its backward.
struct OffloadEntry {
  // Set once the copy to the host is queued; the state counts the entry as live from then on.
  std::shared_ptr<OffloadState> state;
  Tensor host;                      // until the copy back has finished
  std::unique_ptr<Copy> to_host;    // fills `host`
  Tensor device_copy;               // once restored
  std::unique_ptr<Copy> to_device;  // fills `device_copy`
  Device device;
  std::shared_ptr<OffloadGroup> group;
  // Identity of the device tensor it was copied from, to move a tensor saved twice only once.
  std::weak_ptr<Storage> source;
  int64_t offset = 0;
  Shape shape;
  DType dtype = DType::F32;

  ~OffloadEntry();

  // Frees the host copy once the copy back has finished (waiting for it when `wait`). True when
  // the host copy is gone.
  bool release_host(bool wait) {
    if (!host.defined()) return true;
    if (wait) {
      to_device->wait();
    } else if (!to_device->finished()) {
      return false;
    }
    // The copy back started after the copy here had finished, so this returns at once; it
    // counts the copy's time.
    to_host->wait();
    host = Tensor();
    return true;
  }
};

struct OffloadGroup {
  int64_t id = 0;
  bool started = false;  // backward has unpacked one of its tensors
  std::vector<std::weak_ptr<OffloadEntry>> entries;
};

// The host copy of an entry that is gone, kept until the copies that read or write it finish.
struct RetiredCopy {
  Tensor host;
  std::unique_ptr<Copy> to_host, to_device;

  // True when no copy uses `host` any more (after waiting for them, when `wait`).
  bool settle(bool wait) {
    for (Copy* c : {to_device.get(), to_host.get()}) {
      if (c == nullptr) continue;
      if (wait) {
        c->wait();
      } else if (!c->finished()) {
        return false;
      }
    }
    return true;
  }
};

struct OffloadState : std::enable_shared_from_this<OffloadState> {
  int64_t min_bytes = 0;
  OffloadCopies copies = OffloadCopies::Overlapped;
  int64_t next_group = 0;
  std::vector<std::weak_ptr<OffloadGroup>> groups;  // creation order
  std::unordered_multimap<const Storage*, std::weak_ptr<OffloadEntry>> by_storage;
  std::vector<std::pair<Device, std::unique_ptr<Transfers>>> transfers;  // by device, made on use
  // Restored entries whose host copy is kept until the copy back is seen finished.
  std::vector<std::weak_ptr<OffloadEntry>> returning;
  // Host copies of entries that are gone, kept until their copies are seen finished.
  std::vector<RetiredCopy> retired;
  int64_t live_entries = 0;  // entries with a copy to the host queued, not yet destroyed

  ~OffloadState() {
    // Entries hold the state, so none is left, and the last one waited for everything; this
    // only matters if that wait failed.
    try {
      release_finished(true);
    } catch (const std::exception& e) {
      warn("waiting for offload copies", e);
    }
  }

  Transfers& transfers_for(Device device) {
    for (auto& [d, t] : transfers)
      if (d == device) return *t;
    transfers.emplace_back(device, make_transfers(device, copies));
    return *transfers.back().second;
  }

  void forget_expired() {
    std::erase_if(groups, [](const std::weak_ptr<OffloadGroup>& g) { return g.expired(); });
    std::erase_if(by_storage, [](const auto& kv) { return kv.second.expired(); });
  }

  // Frees the host copies that no copy uses any more: all of them, waiting for their copies, when
  // `wait`.
  void release_finished(bool wait) {
    const Clock::time_point start = Clock::now();
    // Kept until both lists are settled, so no entry is destroyed (and calls entry_gone) while
    // they are being edited.
    std::vector<std::shared_ptr<OffloadEntry>> alive;
    alive.reserve(returning.size());
    std::erase_if(returning, [&](const std::weak_ptr<OffloadEntry>& w) {
      std::shared_ptr<OffloadEntry> e = w.lock();
      if (!e) return true;
      alive.push_back(e);
      return e->release_host(wait);
    });
    std::erase_if(retired, [&](RetiredCopy& r) { return r.settle(wait); });
    if (wait) count_transfer_wait(seconds_since(start));
  }

  // Called by an entry's destructor with its host copy and its copies.
  void entry_gone(RetiredCopy copy) noexcept {
    --live_entries;
    try {
      // With synchronous copies (or finished ones) the host copy goes here and now.
      if (copy.host.defined() && !copy.settle(false)) retired.push_back(std::move(copy));
      // The last offloaded tensor is gone (backward is over, or the graph was dropped): no host
      // copy stays behind, so the host pool reads as after synchronous copies.
      release_finished(live_entries == 0);
    } catch (const std::exception& e) {
      warn("releasing host copies", e);
    }
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
    // Copies back of an earlier backward still in flight: their host copies, which synchronous
    // copies would have freed by now, go before a new one is allocated, so the host pool's peak
    // is the same.
    if (!returning.empty() || !retired.empty()) release_finished(true);
    Clock::time_point start = Clock::now();
    auto e = std::make_shared<OffloadEntry>();
    Moved moved = transfers_for(t.device()).to_host(t);
    e->host = std::move(moved.tensor);
    e->to_host = std::move(moved.copy);
    // From here on the entry's destructor takes care of the copy, whatever happens.
    e->state = shared_from_this();
    ++live_entries;
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

  // Starts the copy back of `e` (once).
  void restore(const std::shared_ptr<OffloadEntry>& e) {
    if (e->device_copy.defined()) return;
    Clock::time_point start = Clock::now();
    Moved moved = transfers_for(e->device).to_device(e->host, e->device, *e->to_host);
    e->device_copy = std::move(moved.tensor);
    e->to_device = std::move(moved.copy);
    const int64_t bytes = static_cast<int64_t>(e->host.nbytes());
    // A synchronous copy has finished and the host copy goes now; others are looked at again at
    // every pack and unpack.
    if (!e->release_host(false)) returning.push_back(e);
    count_restore(bytes, seconds_since(start));
  }

  Tensor unpack(std::any& handle) {
    if (const Tensor* kept = std::any_cast<Tensor>(&handle)) return *kept;
    auto e = std::any_cast<std::shared_ptr<OffloadEntry>>(handle);
    restore(e);
    OffloadGroup& g = *e->group;
    if (!g.started) {
      g.started = true;
      // Backward has reached this group: bring back the one it reaches next, while this one
      // computes (queued after e's copy, which this group needs first).
      if (std::shared_ptr<OffloadGroup> prev = previous(g)) {
        for (const auto& w : prev->entries)
          if (std::shared_ptr<OffloadEntry> p = w.lock()) restore(p);
      }
    }
    release_finished(false);
    e->to_device->order_use(e->device_copy);
    return e->device_copy;
  }
};

OffloadEntry::~OffloadEntry() {
  if (!state) return;  // nothing was queued
  if (to_device) {
    // Before device_copy (destroyed after this body) can be freed.
    try {
      to_device->order_release(device_copy);
    } catch (const std::exception& e) {
      warn("ordering the release of a restored tensor", e);
      try {
        to_device->wait();
      } catch (const std::exception& e2) {
        warn("waiting for a copy back", e2);
      }
    }
  }
  state->entry_gone({std::move(host), std::move(to_host), std::move(to_device)});
}

}  // namespace detail

OffloadHooks::OffloadHooks(int64_t min_bytes, OffloadCopies copies)
    : state_(std::make_shared<detail::OffloadState>()) {
  ST_CHECK_AS(ConfigError, min_bytes >= 0, "activation.offload_min_bytes must be >= 0, got ",
              min_bytes);
  state_->min_bytes = min_bytes;
  state_->copies = copies;
}

OffloadHooks::~OffloadHooks() = default;

int64_t OffloadHooks::min_bytes() const {
  return state_->min_bytes;
}

OffloadCopies OffloadHooks::copies() const {
  return state_->copies;
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
