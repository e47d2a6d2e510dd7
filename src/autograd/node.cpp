#include "shardtrain/autograd/node.h"

#include "shardtrain/autograd/accumulate_grad.h"
#include "shardtrain/autograd/grad_mode.h"

namespace shardtrain::autograd {

namespace {
thread_local uint64_t tls_next_sequence_nr = 0;

AutogradMeta* meta_of(const Tensor& t) {
  if (!t.defined() || !t.impl()->autograd) return nullptr;
  return static_cast<AutogradMeta*>(t.impl()->autograd.get());
}

AutogradMeta& ensure_meta(const Tensor& t) {
  ST_CHECK(t.defined(), "autograd on an undefined tensor");
  if (!t.impl()->autograd) t.impl()->autograd = std::make_shared<AutogradMeta>();
  return *static_cast<AutogradMeta*>(t.impl()->autograd.get());
}
}  // namespace

Node::Node() : sequence_nr_(tls_next_sequence_nr++) {}

bool requires_grad(const Tensor& t) {
  AutogradMeta* m = meta_of(t);
  return m != nullptr && m->requires_grad;
}

void set_requires_grad(Tensor& t, bool value) {
  AutogradMeta& m = ensure_meta(t);
  ST_CHECK(m.grad_fn == nullptr,
           "requires_grad can only be set on leaf tensors (this one is the result of ",
           m.grad_fn->name(), ")");
  ST_CHECK(!value || is_floating(t.dtype()),
           "only floating-point tensors can require gradients, not ", t.describe());
  m.requires_grad = value;
}

bool is_leaf(const Tensor& t) {
  AutogradMeta* m = meta_of(t);
  return m == nullptr || m->grad_fn == nullptr;
}

Tensor grad(const Tensor& t) {
  AutogradMeta* m = meta_of(t);
  return m ? m->grad : Tensor();
}

void set_grad(Tensor& t, Tensor g) {
  ensure_meta(t).grad = std::move(g);
}

std::shared_ptr<Node> grad_fn(const Tensor& t) {
  AutogradMeta* m = meta_of(t);
  return m ? m->grad_fn : nullptr;
}

void register_hook(Tensor& t, GradHook hook) {
  AutogradMeta& m = ensure_meta(t);
  ST_CHECK(m.requires_grad, "register_hook on a tensor that does not require a gradient");
  if (m.grad_fn) {
    m.grad_fn->pre_hooks.emplace_back(m.output_nr, std::move(hook));
  } else {
    m.grad_hooks.push_back(std::move(hook));
  }
}

void register_post_accumulate_grad_hook(Tensor& t, PostAccumulateGradHook hook) {
  AutogradMeta& m = ensure_meta(t);
  ST_CHECK(m.requires_grad && m.grad_fn == nullptr,
           "post-accumulate-grad hooks are for leaf tensors that require a gradient");
  m.post_accumulate_hooks.push_back(std::move(hook));
}

Edge gradient_edge(const Tensor& t) {
  AutogradMeta* m = meta_of(t);
  if (m == nullptr || !m->requires_grad) return {};
  if (m->grad_fn) return {m->grad_fn, m->output_nr};
  std::shared_ptr<Node> acc = m->grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    acc->outputs.push_back({t.shape(), t.dtype(), t.device()});
    m->grad_accumulator = acc;
  }
  return {acc, 0};
}

bool needs_graph(std::initializer_list<const Tensor*> inputs) {
  if (!grad_enabled()) return false;
  for (const Tensor* t : inputs)
    if (t != nullptr && requires_grad(*t)) return true;
  return false;
}

static void set_output(const std::shared_ptr<Node>& node, Tensor& out, int nr) {
  AutogradMeta& m = ensure_meta(out);
  m.requires_grad = true;
  m.grad_fn = node;
  m.output_nr = nr;
  node->outputs.push_back({out.shape(), out.dtype(), out.device()});
}

void attach(const std::shared_ptr<Node>& node, std::initializer_list<const Tensor*> inputs,
            std::initializer_list<Tensor*> outputs) {
  for (const Tensor* t : inputs) node->next_edges.push_back(t ? gradient_edge(*t) : Edge{});
  int nr = 0;
  for (Tensor* t : outputs) set_output(node, *t, nr++);
}

void attach(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
            std::vector<Tensor>& outputs) {
  for (const Tensor& t : inputs) node->next_edges.push_back(gradient_edge(t));
  int nr = 0;
  for (Tensor& t : outputs) set_output(node, t, nr++);
}

}  // namespace shardtrain::autograd
