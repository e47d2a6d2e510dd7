// The node at the end of every path to a leaf: adds the incoming gradient into the leaf's .grad
// (counted as Gradients memory), then runs the leaf's post-accumulate-grad hooks. The leaf holds
// it weakly, the graph strongly, so one accumulator serves every use of the leaf in a step.
#pragma once
#include "shardtrain/autograd/node.h"

namespace shardtrain::autograd {

class AccumulateGrad : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  std::vector<Tensor> apply(std::vector<Tensor> grad_outputs) override;
  std::string name() const override { return "AccumulateGrad"; }

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

}  // namespace shardtrain::autograd
