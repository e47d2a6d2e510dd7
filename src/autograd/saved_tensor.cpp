#include "shardtrain/autograd/saved_tensor.h"

#include <vector>

namespace shardtrain::autograd {

namespace {
// nullptr entries hide the pairs below them.
thread_local std::vector<std::shared_ptr<const SavedTensorHooks>> tls_hook_stack;
}  // namespace

SavedTensorHooksScope::SavedTensorHooksScope(SavedTensorHooks hooks) : active_(true) {
  tls_hook_stack.push_back(std::make_shared<const SavedTensorHooks>(std::move(hooks)));
}

SavedTensorHooksScope SavedTensorHooksScope::disabled() {
  SavedTensorHooksScope scope;
  tls_hook_stack.push_back(nullptr);
  scope.active_ = true;  // only once the push succeeded: the destructor pops it
  return scope;
}

SavedTensorHooksScope::SavedTensorHooksScope(SavedTensorHooksScope&& other) noexcept
    : active_(other.active_) {
  other.active_ = false;
}

SavedTensorHooksScope::~SavedTensorHooksScope() {
  if (active_) tls_hook_stack.pop_back();
}

const SavedTensorHooks* current_saved_tensor_hooks() {
  if (tls_hook_stack.empty()) return nullptr;
  return tls_hook_stack.back().get();
}

SavedTensor::SavedTensor(const Tensor& tensor) {
  if (!tensor.defined()) return;
  if (!tls_hook_stack.empty() && tls_hook_stack.back() != nullptr) {
    hooks_ = tls_hook_stack.back();
    // The pack hook sees a detached tensor: saved data never carries the graph.
    packed_ = std::make_shared<std::any>(hooks_->pack(tensor.detach()));
    state_ = State::Packed;
  } else {
    plain_ = tensor.detach();
    state_ = State::Plain;
  }
}

Tensor SavedTensor::unpack() const {
  switch (state_) {
    case State::Plain:
      return plain_;
    case State::Packed:
      return hooks_->unpack(*packed_);
    case State::Empty:
      return Tensor();
    case State::Released:
      break;
  }
  throw Error(
      "a saved tensor was used after its node's backward had run and freed it (backward through "
      "the same graph twice is not supported)");
}

void SavedTensor::release() {
  if (state_ == State::Empty) return;
  plain_ = Tensor();
  packed_.reset();
  hooks_.reset();
  state_ = State::Released;
}

}  // namespace shardtrain::autograd
