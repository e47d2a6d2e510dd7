#include "shardtrain/backend/backend.h"

#include <array>
#include <string>

#include "shardtrain/core/error.h"

#include "builtin.h"

namespace shardtrain {

namespace {

using BackendTable = std::array<Backend*, 3>;

BackendTable& backends() {
  static BackendTable b{};
  return b;
}

// Registers the built-in backends on first use (thread-safe through the function-local static).
// Backends registered explicitly before that keep their slot.
void ensure_builtin_backends() {
  static const bool registered = [] {
    const BackendTable explicit_backends = backends();
    detail::register_builtin_backends();
    for (size_t i = 0; i < explicit_backends.size(); ++i)
      if (explicit_backends[i] != nullptr) backends()[i] = explicit_backends[i];
    return true;
  }();
  (void)registered;
}

}  // namespace

void check_gemm_args(const GemmArgs& g, const Tensor& a, const Tensor& b, const Tensor& c) {
  ST_CHECK_SHAPE(g.m >= 0 && g.n >= 0 && g.k >= 0 && g.batch >= 0, "gemm: negative size (m ", g.m,
                 ", n ", g.n, ", k ", g.k, ", batch ", g.batch, ")");
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  for (const Tensor* t : {&a, &b, &c})
    ST_CHECK_SHAPE(t->defined() && is_floating(t->dtype()),
                   "gemm: operands must be float tensors, got ",
                   t->defined() ? t->describe() : std::string("an undefined tensor"));
  struct Operand {
    const char* name;
    const Tensor& tensor;
    int64_t offset, stride, elements;
  };
  // A and B are not read when there is nothing to multiply.
  const bool reads_ab = g.k > 0 && g.alpha != 0.0f;
  for (const Operand& o : {Operand{"A", a, g.offset_a, g.stride_a, reads_ab ? g.m * g.k : 0},
                           Operand{"B", b, g.offset_b, g.stride_b, reads_ab ? g.k * g.n : 0},
                           Operand{"C", c, g.offset_c, g.stride_c, g.m * g.n}}) {
    if (o.elements == 0) continue;
    ST_CHECK_SHAPE(o.offset >= 0 && o.stride >= 0, "gemm: ", o.name,
                   " has a negative offset or stride (offset ", o.offset, ", stride ", o.stride,
                   ")");
    const int64_t end = o.offset + (g.batch - 1) * o.stride + o.elements;
    ST_CHECK_SHAPE(end <= o.tensor.numel(), "gemm: ", g.batch, " matrices of ", o.elements,
                   " elements at offset ", o.offset, " with stride ", o.stride, " need ", end,
                   " elements of ", o.name, ", which is ", o.tensor.describe());
  }
  ST_CHECK_SHAPE(g.batch == 1 || g.stride_c >= g.m * g.n, "gemm: the ", g.batch, " C matrices of ",
                 g.m * g.n, " elements overlap (stride_c ", g.stride_c,
                 "); a batch needs a C matrix of its own per product");
}

bool Backend::unscale_and_check_multi(const std::vector<Tensor*>& tensors, float inv_scale) {
  bool found = false;
  for (Tensor* t : tensors) found = unscale_and_check(*t, inv_scale) || found;
  return found;
}

std::vector<double> Backend::sum_squares_multi(const std::vector<const Tensor*>& tensors) {
  std::vector<double> out;
  out.reserve(tensors.size());
  for (const Tensor* t : tensors) out.push_back(sum_squares(*t));
  return out;
}

void Backend::adamw_multi(const std::vector<AdamWTensor>& tensors, const AdamWArgs& args) {
  for (const AdamWTensor& t : tensors) {
    AdamWArgs own = args;
    if (!t.decay) own.weight_decay = 0.0f;
    adamw(*t.param, *t.grad, *t.m, *t.v, own);
  }
}

void register_backend(DeviceKind kind, Backend* backend) {
  backends()[static_cast<size_t>(kind)] = backend;
}

Backend& backend_for(Device device) {
  ensure_builtin_backends();
  DeviceKind kind = device.is_host() ? DeviceKind::CPU : device.kind;
  Backend* b = backends()[static_cast<size_t>(kind)];
  if (b == nullptr)
    throw Error("no compute backend for " + device.str() +
                (device.is_cuda() ? ": this build has no CUDA backend or no GPU is usable"
                                  : ": the CPU backend was not linked"));
  return *b;
}

bool cuda_backend_available() {
  ensure_builtin_backends();
  return backends()[static_cast<size_t>(DeviceKind::CUDA)] != nullptr;
}

}  // namespace shardtrain
