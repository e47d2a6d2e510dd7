// Tensors that an op keeps for its backward, and the pack/unpack hooks they pass through.
//
// This is the mechanism of torch.autograd.graph.saved_tensors_hooks: when an op saves a tensor,
// the innermost active hook pair's `pack` turns it into an opaque handle; when backward needs the
// tensor, `unpack` turns the handle back into a tensor. Activation checkpointing (pack: remember
// nothing, unpack: recompute) and CPU activation offload (pack: copy to host, unpack: copy back)
// are both written as hook pairs on top of this.
#pragma once
#include <any>
#include <functional>
#include <memory>

#include "shardtrain/tensor/tensor.h"

namespace shardtrain::autograd {

struct SavedTensorHooks {
  std::function<std::any(const Tensor&)> pack;
  std::function<Tensor(std::any&)> unpack;
};

// RAII: pushes a hook pair onto this thread's stack for the scope's lifetime. A scope made with
// `SavedTensorHooksScope::disabled()` pushes an entry that hides every outer pair (tensors saved
// inside are kept as they are).
class SavedTensorHooksScope {
 public:
  explicit SavedTensorHooksScope(SavedTensorHooks hooks);
  static SavedTensorHooksScope disabled();
  ~SavedTensorHooksScope();
  SavedTensorHooksScope(SavedTensorHooksScope&&) noexcept;
  SavedTensorHooksScope(const SavedTensorHooksScope&) = delete;
  SavedTensorHooksScope& operator=(const SavedTensorHooksScope&) = delete;

 private:
  SavedTensorHooksScope() = default;
  bool active_ = false;
};

// The innermost active pair, or nullptr when none (or when hidden by a disabled scope).
const SavedTensorHooks* current_saved_tensor_hooks();

// One saved tensor. Saving stores only the data (a detached view), never the autograd graph, so
// a node saving its own output creates no reference cycle.
class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(const Tensor& tensor);

  bool defined() const { return state_ != State::Empty; }
  // The saved tensor (through the unpack hook if it was packed). Throws if released.
  Tensor unpack() const;
  // Drops the saved data (called by the engine once the node's backward has run).
  void release();

 private:
  enum class State { Empty, Plain, Packed, Released };
  State state_ = State::Empty;
  Tensor plain_;
  std::shared_ptr<std::any> packed_;
  std::shared_ptr<const SavedTensorHooks> hooks_;  // the pair that packed it
};

}  // namespace shardtrain::autograd
