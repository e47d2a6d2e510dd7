// Whether ops record a graph. Thread-local, like torch.no_grad().
#pragma once

namespace shardtrain::autograd {

bool grad_enabled();

// RAII: ops inside do not record a graph.
class NoGrad {
 public:
  NoGrad();
  ~NoGrad();
  NoGrad(const NoGrad&) = delete;
  NoGrad& operator=(const NoGrad&) = delete;

 private:
  bool previous_;
};

// RAII: ops inside record a graph even within NoGrad (used to re-run a region in backward).
class EnableGrad {
 public:
  EnableGrad();
  ~EnableGrad();
  EnableGrad(const EnableGrad&) = delete;
  EnableGrad& operator=(const EnableGrad&) = delete;

 private:
  bool previous_;
};

}  // namespace shardtrain::autograd
