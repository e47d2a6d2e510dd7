// The autograd graph: nodes created by ops as they run, and the per-tensor autograd state.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/autograd/saved_tensor.h"
#include "shardtrain/tensor/tensor.h"

namespace shardtrain::autograd {

class Node;

using GradHook = std::function<Tensor(const Tensor& grad)>;
using PostAccumulateGradHook = std::function<void(Tensor& leaf)>;

// Where a gradient flows: input `input_nr` of `node`.
struct Edge {
  std::shared_ptr<Node> node;
  int input_nr = 0;
  bool valid() const { return node != nullptr; }
};

// Shape, dtype and device of one output, so the engine can make zeros for unused outputs.
struct OutputMeta {
  Shape shape;
  DType dtype = DType::F32;
  Device device;
};

// A backward function. `apply` receives one gradient per forward output (zeros when an output
// got none) and returns one gradient per forward input (undefined where not needed).
class Node : public std::enable_shared_from_this<Node> {
 public:
  Node();
  virtual ~Node() = default;
  virtual std::vector<Tensor> apply(std::vector<Tensor> grad_outputs) = 0;
  virtual std::string name() const = 0;
  // Frees saved tensors; the engine calls it right after apply (retain_graph is never used).
  virtual void release_saved() {}

  uint64_t sequence_nr() const { return sequence_nr_; }
  std::vector<Edge> next_edges;     // one per forward input
  std::vector<OutputMeta> outputs;  // one per forward output
  // Hooks on the gradient of output `first`, run before apply (tensor hooks of non-leaves).
  std::vector<std::pair<int, GradHook>> pre_hooks;

 private:
  uint64_t sequence_nr_;
};

struct AutogradMeta : AutogradMetaBase {
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<Node> grad_fn;
  int output_nr = 0;
  std::weak_ptr<Node> grad_accumulator;
  std::vector<GradHook> grad_hooks;  // run on the gradient flowing into this tensor
  std::vector<PostAccumulateGradHook> post_accumulate_hooks;  // leaves only
};

// ---- per-tensor autograd state ----------------------------------------------------------------
bool requires_grad(const Tensor& t);
// Marks a leaf as requiring a gradient (throws for a non-leaf).
void set_requires_grad(Tensor& t, bool value = true);
bool is_leaf(const Tensor& t);
Tensor grad(const Tensor& t);
void set_grad(Tensor& t, Tensor g);
std::shared_ptr<Node> grad_fn(const Tensor& t);
// Tensor gradient hook: may return a replacement gradient (or the same one).
void register_hook(Tensor& t, GradHook hook);
// Runs after a leaf's .grad has been updated by backward (sharding reduce-scatters here).
void register_post_accumulate_grad_hook(Tensor& t, PostAccumulateGradHook hook);

// ---- for op implementations -------------------------------------------------------------------
// The edge a gradient for `t` should flow to (its grad_fn, or its leaf accumulator), or an
// invalid edge when `t` does not require a gradient.
Edge gradient_edge(const Tensor& t);
// True when grad mode is on and any input requires a gradient.
bool needs_graph(std::initializer_list<const Tensor*> inputs);
// Connects `node` to the inputs' gradient edges and makes each output a result of `node`.
void attach(const std::shared_ptr<Node>& node, std::initializer_list<const Tensor*> inputs,
            std::initializer_list<Tensor*> outputs);
void attach(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
            std::vector<Tensor>& outputs);

}  // namespace shardtrain::autograd
