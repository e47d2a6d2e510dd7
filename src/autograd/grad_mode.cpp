#include "shardtrain/autograd/grad_mode.h"

namespace shardtrain::autograd {

namespace {
thread_local bool tls_grad_enabled = true;
}

bool grad_enabled() {
  return tls_grad_enabled;
}

NoGrad::NoGrad() : previous_(tls_grad_enabled) {
  tls_grad_enabled = false;
}
NoGrad::~NoGrad() {
  tls_grad_enabled = previous_;
}

EnableGrad::EnableGrad() : previous_(tls_grad_enabled) {
  tls_grad_enabled = true;
}
EnableGrad::~EnableGrad() {
  tls_grad_enabled = previous_;
}

}  // namespace shardtrain::autograd
