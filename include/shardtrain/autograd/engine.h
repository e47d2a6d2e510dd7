// Runs backward over the graph that ops recorded.
#pragma once
#include "shardtrain/autograd/node.h"

namespace shardtrain::autograd {

// Computes gradients of `root` (a scalar unless `grad_root` is given) with respect to every leaf
// that requires one, accumulating into their .grad. Nodes run in dependency order, highest
// sequence number first among those ready (the reverse of forward order), and each node's saved
// tensors are freed as soon as it has run. Transient gradients are counted as Workspace memory,
// leaf gradients as Gradients.
void backward(const Tensor& root, const Tensor& grad_root = Tensor());

// Statistics of the last backward on this thread (for tests and metrics). A backward() called from
// inside a node's apply (reentrant checkpointing) counts towards the outer call.
struct BackwardStats {
  int64_t nodes_run = 0;
};
BackwardStats last_backward_stats();

}  // namespace shardtrain::autograd
