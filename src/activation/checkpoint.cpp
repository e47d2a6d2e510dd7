#include "shardtrain/activation/checkpoint.h"

#include <any>
#include <chrono>

#include "shardtrain/activation/counters.h"
#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/autograd/node.h"

namespace shardtrain::activation {

RngState snapshot_rng(const Generator& gen) {
  return {gen.seed(), gen.offset()};
}

void restore_rng(Generator& gen, const RngState& state) {
  gen.set_state(state.seed, state.offset);
}

namespace {

using autograd::SavedTensor;
using autograd::SavedTensorHooks;
using autograd::SavedTensorHooksScope;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Puts the generators into the states recorded at the start of the region for the lifetime of
// the object, then back into the states they had before (like torch's fork_rng).
class RngReplay {
 public:
  RngReplay(const std::vector<Generator*>& gens, const std::vector<RngState>& recorded)
      : gens_(gens) {
    for (size_t i = 0; i < gens_.size(); ++i) {
      current_.push_back(snapshot_rng(*gens_[i]));
      restore_rng(*gens_[i], recorded[i]);
    }
  }
  ~RngReplay() {
    for (size_t i = 0; i < gens_.size(); ++i) restore_rng(*gens_[i], current_[i]);
  }
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  const std::vector<Generator*>& gens_;
  std::vector<RngState> current_;
};

std::vector<RngState> snapshot_all(const std::vector<Generator*>& gens) {
  std::vector<RngState> out;
  for (Generator* g : gens) {
    ST_CHECK(g != nullptr, "CheckpointOptions::generators holds a null generator");
    out.push_back(snapshot_rng(*g));
  }
  return out;
}

// Runs the pieces in order on `args`.
std::vector<Tensor> run_pieces(const std::vector<TensorsFn>& pieces, std::vector<Tensor> args) {
  for (const TensorsFn& piece : pieces) args = piece(args);
  return args;
}

// The region's inputs as the re-run sees them: detached, requiring a gradient where the
// forward's inputs did (so every op records, and saves, exactly what it did in the forward).
std::vector<Tensor> detached_inputs(const std::vector<SavedTensor>& saved,
                                    const std::vector<bool>& needs_grad) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < saved.size(); ++i) {
    Tensor t = saved[i].unpack();
    if (t.defined()) {
      t = t.detach();
      if (needs_grad[i]) autograd::set_requires_grad(t);
    }
    out.push_back(std::move(t));
  }
  return out;
}

// ---- non-reentrant -----------------------------------------------------------------------------

// Thrown by the capture hook once the re-run has produced every tensor the forward packed; caught
// by the re-run driver. Not derived from std::exception so that no error handler mistakes it for
// a failure.
struct StopRecompute {};

// What the forward's pack hook returns: the position of the tensor among the region's saves, and
// (after the re-run) the tensor itself. Owned by the SavedTensor, so a recomputed tensor is freed
// as soon as the node that saved it has run.
struct Slot {
  int64_t index = 0;
  Shape shape;
  DType dtype = DType::F32;
  Tensor value;
};

class Frame : public std::enable_shared_from_this<Frame> {
 public:
  std::vector<SavedTensor> inputs;
  std::vector<bool> input_requires_grad;
  std::vector<TensorsFn> pieces;
  std::vector<Generator*> generators;
  std::vector<RngState> rng;

  // Pack: remember an index, not the tensor. Unpack: re-run the region once, then hand out the
  // captured tensor.
  SavedTensorHooks forward_hooks() {
    std::shared_ptr<Frame> self = shared_from_this();
    SavedTensorHooks hooks;
    hooks.pack = [self](const Tensor& t) -> std::any {
      auto slot = std::make_shared<Slot>();
      slot->index = static_cast<int64_t>(self->slots_.size());
      slot->shape = t.shape();
      slot->dtype = t.dtype();
      self->slots_.push_back(slot);
      return slot;
    };
    hooks.unpack = [self](std::any& handle) -> Tensor {
      auto slot = std::any_cast<std::shared_ptr<Slot>>(handle);
      self->recompute();
      ST_CHECK(slot->value.defined(), "checkpoint: saved tensor ", slot->index,
               " of a region was not produced by its re-run");
      return slot->value;
    };
    return hooks;
  }

 private:
  // State shared with the capture hook (which the discarded re-run graph may outlive).
  struct Capture {
    std::vector<std::weak_ptr<Slot>> slots;
    int64_t count = 0;
  };

  void recompute() {
    if (recomputed_) return;
    ST_CHECK(!recomputing_,
             "checkpoint: a region needed its own saved tensors while being re-run (a region's "
             "function must not run backward on its own outputs)");
    recomputing_ = true;
    struct ClearFlag {
      bool& flag;
      ~ClearFlag() { flag = false; }
    } clear{recomputing_};

    // Unpacking the inputs may re-run an enclosing region first; that is not this region's time.
    std::vector<Tensor> args = detached_inputs(inputs, input_requires_grad);
    Clock::time_point start = Clock::now();
    auto capture = std::make_shared<Capture>();
    capture->slots = slots_;
    const int64_t needed = static_cast<int64_t>(slots_.size());
    {
      autograd::EnableGrad grad_on;
      CategoryScope activations(MemoryCategory::Activations);
      RngReplay replay(generators, rng);
      SavedTensorHooks hooks;
      hooks.pack = [capture, needed](const Tensor& t) -> std::any {
        ST_CHECK(capture->count < needed,
                 "checkpoint: the re-run of a region saved more tensors "
                 "than its forward did (",
                 needed, "); the region is not deterministic");
        if (std::shared_ptr<Slot> slot =
                capture->slots[static_cast<size_t>(capture->count)].lock()) {
          ST_CHECK(slot->shape == t.shape() && slot->dtype == t.dtype(),
                   "checkpoint: saved tensor ", capture->count, " of a region was ",
                   dtype_name(slot->dtype), shape_str(slot->shape), " in the forward but ",
                   t.describe(), " in the re-run; the region is not deterministic");
          slot->value = t;
        }
        capture->count += 1;
        if (capture->count == needed) throw StopRecompute{};
        return std::any();
      };
      hooks.unpack = [](std::any&) -> Tensor {
        throw Error("checkpoint: the graph of a region's re-run was used for backward");
      };
      SavedTensorHooksScope scope(std::move(hooks));
      try {
        run_pieces(pieces, std::move(args));
      } catch (const StopRecompute&) {
      }
    }
    ST_CHECK(capture->count == needed, "checkpoint: the re-run of a region saved ", capture->count,
             " tensors but its forward saved ", needed, "; the region is not deterministic");
    recomputed_ = true;
    // The slots now hold what backward needs (the inputs too, where an op saved them).
    for (SavedTensor& s : inputs) s.release();
    detail::count_rerun(seconds_since(start));
  }

  std::vector<std::weak_ptr<Slot>> slots_;
  bool recomputed_ = false;
  bool recomputing_ = false;
};

// ---- reentrant ---------------------------------------------------------------------------------

// Seeds a backward over several roots at once: its one output is a dummy scalar, its inputs are
// the roots, and its apply hands each root its gradient.
struct MultiRoot : autograd::Node {
  std::vector<Tensor> grads;
  std::vector<Tensor> apply(std::vector<Tensor>) override { return std::move(grads); }
  std::string name() const override { return "CheckpointRoots"; }
};

struct CheckpointBackward : autograd::Node {
  std::vector<SavedTensor> inputs;
  std::vector<bool> input_requires_grad;
  std::vector<TensorsFn> pieces;
  std::vector<Generator*> generators;
  std::vector<RngState> rng;

  std::string name() const override { return "CheckpointBackward"; }
  void release_saved() override {
    for (SavedTensor& s : inputs) s.release();
  }

  std::vector<Tensor> apply(std::vector<Tensor> grad_outputs) override {
    std::vector<Tensor> args = detached_inputs(inputs, input_requires_grad);
    Clock::time_point start = Clock::now();
    std::vector<Tensor> outputs;
    {
      autograd::EnableGrad grad_on;
      CategoryScope activations(MemoryCategory::Activations);
      RngReplay replay(generators, rng);
      // The re-run's graph is backpropagated right here; hooks active around the outer
      // backward must not move its saved tensors.
      SavedTensorHooksScope plain = SavedTensorHooksScope::disabled();
      outputs = run_pieces(pieces, args);
    }
    detail::count_rerun(seconds_since(start));
    ST_CHECK(outputs.size() == grad_outputs.size(), "checkpoint: the re-run of a region returned ",
             outputs.size(), " outputs, the forward ", grad_outputs.size());
    for (size_t i = 0; i < outputs.size(); ++i)
      ST_CHECK(outputs[i].shape() == grad_outputs[i].shape() &&
                   outputs[i].dtype() == grad_outputs[i].dtype(),
               "checkpoint: output ", i, " of a region's re-run is ", outputs[i].describe(),
               " where its forward's was ", grad_outputs[i].describe(),
               "; the region is not deterministic");

    std::vector<size_t> roots;
    for (size_t i = 0; i < outputs.size(); ++i)
      if (autograd::requires_grad(outputs[i])) roots.push_back(i);
    if (roots.size() == 1) {
      autograd::backward(outputs[roots[0]], grad_outputs[roots[0]]);
    } else if (roots.size() > 1) {
      auto node = std::make_shared<MultiRoot>();
      std::vector<Tensor> root_tensors;
      for (size_t i : roots) {
        root_tensors.push_back(outputs[i]);
        node->grads.push_back(grad_outputs[i]);
      }
      std::vector<Tensor> seed{zeros({1}, DType::F32, outputs[roots[0]].device())};
      autograd::attach(node, root_tensors, seed);
      autograd::backward(seed[0]);
    }
    outputs.clear();
    grad_outputs.clear();

    std::vector<Tensor> grads;
    for (size_t i = 0; i < args.size(); ++i) {
      Tensor g = input_requires_grad[i] ? autograd::grad(args[i]) : Tensor();
      // The inner backward accumulated this into a leaf's .grad (counted as Gradients); it is a
      // transient gradient of the outer backward.
      if (g.defined() && g.category() == MemoryCategory::Gradients)
        g.impl()->storage->data.set_category(MemoryCategory::Workspace);
      grads.push_back(std::move(g));
    }
    return grads;
  }
};

}  // namespace

// ---- regions -----------------------------------------------------------------------------------

namespace detail {

class RegionState {
 public:
  RegionState(const std::vector<Tensor>& inputs, const CheckpointOptions& options)
      : reentrant_(options.reentrant), active_(autograd::grad_enabled()) {
    if (!active_) return;
    std::vector<SavedTensor> saved;
    std::vector<bool> needs_grad;
    // Saved through the hooks active here: an enclosing region packs an index, offload hooks
    // move the input to the host.
    for (const Tensor& t : inputs) {
      saved.emplace_back(t);
      needs_grad.push_back(autograd::requires_grad(t));
    }
    std::vector<RngState> rng = snapshot_all(options.generators);
    if (reentrant_) {
      node_ = std::make_shared<CheckpointBackward>();
      node_->inputs = std::move(saved);
      node_->input_requires_grad = std::move(needs_grad);
      node_->generators = options.generators;
      node_->rng = std::move(rng);
      original_inputs_ = inputs;
    } else {
      frame_ = std::make_shared<Frame>();
      frame_->inputs = std::move(saved);
      frame_->input_requires_grad = std::move(needs_grad);
      frame_->generators = options.generators;
      frame_->rng = std::move(rng);
    }
  }

  std::vector<Tensor> run(const TensorsFn& piece, const std::vector<Tensor>& args) {
    ST_CHECK(!finished_, "checkpoint: run() on a region that has finished");
    if (!active_) return piece(args);
    std::vector<Tensor> out;
    if (reentrant_) {
      autograd::NoGrad no_grad;
      out = piece(args);
      node_->pieces.push_back(piece);
    } else {
      SavedTensorHooksScope scope(frame_->forward_hooks());
      out = piece(args);
      frame_->pieces.push_back(piece);
    }
    return out;
  }

  std::vector<Tensor> finish(const std::vector<Tensor>& outputs) {
    ST_CHECK(!finished_, "checkpoint: finish() called twice on a region");
    finished_ = true;
    if (!active_ || !reentrant_) {
      frame_.reset();  // the saved tensors of the region keep it alive
      return outputs;
    }
    std::vector<Tensor> attached;
    for (const Tensor& t : outputs) {
      ST_CHECK(t.defined() && is_floating(t.dtype()),
               "checkpoint (reentrant): every output of a region must be a floating tensor, got ",
               t.defined() ? t.describe() : std::string("an undefined tensor"));
      attached.push_back(t.detach());  // a fresh handle: an output may alias an input
    }
    autograd::attach(node_, original_inputs_, attached);
    node_.reset();
    original_inputs_.clear();
    return attached;
  }

 private:
  bool reentrant_;
  bool active_;
  bool finished_ = false;
  std::shared_ptr<Frame> frame_;
  std::shared_ptr<CheckpointBackward> node_;
  std::vector<Tensor> original_inputs_;  // for the reentrant node's gradient edges
};

}  // namespace detail

CheckpointRegion::CheckpointRegion(const std::vector<Tensor>& inputs,
                                   const CheckpointOptions& options)
    : state_(std::make_unique<detail::RegionState>(inputs, options)) {}

CheckpointRegion::~CheckpointRegion() = default;

std::vector<Tensor> CheckpointRegion::run(const TensorsFn& piece, const std::vector<Tensor>& args) {
  return state_->run(piece, args);
}

Tensor CheckpointRegion::run(const TensorFn& piece, const Tensor& arg) {
  TensorsFn wrapped = [piece](const std::vector<Tensor>& a) {
    return std::vector<Tensor>{piece(a.at(0))};
  };
  return state_->run(wrapped, {arg}).at(0);
}

std::vector<Tensor> CheckpointRegion::finish(const std::vector<Tensor>& outputs) {
  return state_->finish(outputs);
}

Tensor CheckpointRegion::finish(const Tensor& output) {
  return state_->finish({output}).at(0);
}

std::vector<Tensor> checkpoint_multi(const TensorsFn& fn, const std::vector<Tensor>& inputs,
                                     const CheckpointOptions& options) {
  CheckpointRegion region(inputs, options);
  return region.finish(region.run(fn, inputs));
}

Tensor checkpoint(const TensorFn& fn, const Tensor& input, const CheckpointOptions& options) {
  CheckpointRegion region({input}, options);
  return region.finish(region.run(fn, input));
}

}  // namespace shardtrain::activation
