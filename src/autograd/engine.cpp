#include "shardtrain/autograd/engine.h"

#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "shardtrain/autograd/accumulate_grad.h"
#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/backend/backend.h"

namespace shardtrain::autograd {

namespace {
thread_local BackwardStats tls_stats;
// How many backward() calls are running on this thread. A node may itself call backward() (the
// reentrant activation checkpoint does); such an inner call adds to the outer call's statistics
// instead of resetting them.
thread_local int tls_backward_depth = 0;

struct BackwardDepth {
  BackwardDepth() { ++tls_backward_depth; }
  ~BackwardDepth() { --tls_backward_depth; }
  BackwardDepth(const BackwardDepth&) = delete;
  BackwardDepth& operator=(const BackwardDepth&) = delete;
};

// A gradient must have its tensor's shape and dtype: kernels size their loops from one operand
// and would read past the end of a smaller gradient. `what` names where it came from.
void check_gradient(const Tensor& grad, const Shape& shape, DType dtype, Device device,
                    const char* what) {
  ST_CHECK_SHAPE(grad.shape() == shape && grad.dtype() == dtype && grad.device() == device,
                 "backward: ", what, " is ", grad.describe(), " but its tensor is ",
                 shape_str(shape), " ", dtype_name(dtype), " on ", device.str());
}

// a + b into a fresh tensor (gradients arriving at the same output from several uses).
Tensor add_grads(const Tensor& a, const Tensor& b) {
  check_gradient(b, a.shape(), a.dtype(), a.device(), "a second gradient of one output");
  Tensor out = empty(a.shape(), a.dtype(), a.device());
  backend_for(a.device()).add(a, b, out, 1.0f, 1.0f);
  return out;
}

Tensor zeros_for(const OutputMeta& m) {
  return zeros(m.shape, m.dtype, m.device);
}

struct ReadyOrder {
  bool operator()(const Node* a, const Node* b) const {
    return a->sequence_nr() < b->sequence_nr();  // highest sequence number first
  }
};
}  // namespace

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor> grad_outputs) {
  Tensor g = std::move(grad_outputs.at(0));
  Tensor leaf(leaf_);
  auto& meta = *static_cast<AutogradMeta*>(leaf_->autograd.get());
  for (auto& hook : meta.grad_hooks) {
    Tensor replaced = hook(g);
    if (replaced.defined()) g = replaced;
  }
  check_gradient(g, leaf.shape(), leaf.dtype(), leaf.device(), "the gradient of a leaf");
  {
    CategoryScope scope(MemoryCategory::Gradients);
    if (!meta.grad.defined()) {
      bool sole_owner = g.impl_ptr().use_count() == 1 && g.impl()->storage.use_count() == 1 &&
                        g.impl()->offset == 0 && g.dtype() == leaf.dtype();
      if (sole_owner) {
        g.impl()->storage->data.set_category(MemoryCategory::Gradients);  // take it over
        meta.grad = g.view(leaf.shape());
      } else {
        meta.grad = empty(leaf.shape(), leaf.dtype(), leaf.device());
        meta.grad.copy_from(g);
      }
    } else {
      backend_for(leaf.device()).add(meta.grad, g, meta.grad, 1.0f, 1.0f);
    }
  }
  g = Tensor();
  for (auto& hook : meta.post_accumulate_hooks) hook(leaf);
  return {};
}

void backward(const Tensor& root, const Tensor& grad_root) {
  Edge root_edge = gradient_edge(root);
  ST_CHECK(root_edge.valid(),
           "backward() on a tensor that does not require a gradient (no parameter it depends on "
           "requires one, or it was computed under NoGrad)");
  Tensor seed = grad_root;
  if (!seed.defined()) {
    ST_CHECK(root.numel() == 1, "backward() without a gradient needs a scalar, got ",
             root.describe());
    seed = ones(root.shape(), root.dtype(), root.device());
  }
  check_gradient(seed, root.shape(), root.dtype(), root.device(),
                 "the gradient given for the root");
  NoGrad no_grad;  // backward functions do not record graphs (no double backward)
  CategoryScope workspace(MemoryCategory::Workspace);
  if (tls_backward_depth == 0) tls_stats = {};
  BackwardDepth depth;

  // Count, for every node reachable from the root, how many edges lead into it.
  std::unordered_map<Node*, int> dependencies;
  {
    std::vector<Node*> stack{root_edge.node.get()};
    std::unordered_set<Node*> seen{root_edge.node.get()};
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (const Edge& e : n->next_edges) {
        if (!e.valid()) continue;
        dependencies[e.node.get()] += 1;
        if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
      }
    }
  }

  // Gradients waiting for each node, one slot per forward output. Holding shared_ptrs keeps a
  // node alive until it has run even if the forward graph's owners are gone.
  std::unordered_map<Node*, std::pair<std::shared_ptr<Node>, std::vector<Tensor>>> pending;
  auto slot = [&](const std::shared_ptr<Node>& n) -> std::vector<Tensor>& {
    auto& entry = pending[n.get()];
    if (!entry.first) {
      entry.first = n;
      entry.second.resize(n->outputs.size());
    }
    return entry.second;
  };
  std::priority_queue<Node*, std::vector<Node*>, ReadyOrder> ready;
  slot(root_edge.node)[static_cast<size_t>(root_edge.input_nr)] = seed;
  seed = Tensor();
  ready.push(root_edge.node.get());

  while (!ready.empty()) {
    Node* raw = ready.top();
    ready.pop();
    auto it = pending.find(raw);
    std::shared_ptr<Node> node = std::move(it->second.first);
    std::vector<Tensor> grads = std::move(it->second.second);
    pending.erase(it);
    for (size_t i = 0; i < grads.size(); ++i)
      if (!grads[i].defined()) grads[i] = zeros_for(node->outputs[i]);
    for (auto& [output_nr, hook] : node->pre_hooks) {
      Tensor replaced = hook(grads[static_cast<size_t>(output_nr)]);
      if (replaced.defined()) grads[static_cast<size_t>(output_nr)] = replaced;
    }
    for (size_t i = 0; i < grads.size(); ++i)
      check_gradient(grads[i], node->outputs[i].shape, node->outputs[i].dtype,
                     node->outputs[i].device, "the gradient of an output");
    std::vector<Tensor> input_grads = node->apply(std::move(grads));
    node->release_saved();
    tls_stats.nodes_run += 1;

    for (size_t i = 0; i < node->next_edges.size(); ++i) {
      const Edge& e = node->next_edges[i];
      if (!e.valid()) continue;
      if (i < input_grads.size() && input_grads[i].defined()) {
        std::vector<Tensor>& s = slot(e.node);
        Tensor& dst = s[static_cast<size_t>(e.input_nr)];
        dst = dst.defined() ? add_grads(dst, input_grads[i]) : std::move(input_grads[i]);
      } else {
        slot(e.node);  // keeps the node alive until it runs
      }
      if (--dependencies[e.node.get()] == 0) ready.push(e.node.get());
    }
  }
}

BackwardStats last_backward_stats() {
  return tls_stats;
}

}  // namespace shardtrain::autograd
