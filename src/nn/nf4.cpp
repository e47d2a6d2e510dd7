#include "shardtrain/nn/nf4.h"

#include <algorithm>
#include <cmath>

#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/nf4_codebook.h"
#include "shardtrain/ops/ops.h"

namespace shardtrain::nn {

namespace {

// Midpoints between consecutive NF4 values. A normalised weight x gets the code
// count(x > threshold), which is bitsandbytes' dQuantizeNF4 decision tree (ties go down).
std::array<float, 15> nf4_thresholds() {
  std::array<float, 15> t{};
  for (size_t k = 0; k < t.size(); ++k)
    t[k] = static_cast<float>((static_cast<double>(nf4::kNf4Code[k]) + nf4::kNf4Code[k + 1]) / 2);
  return t;
}

uint8_t nearest_nf4(float x, const std::array<float, 15>& thresholds) {
  uint8_t code = 0;
  for (float t : thresholds) code = static_cast<uint8_t>(code + (x > t ? 1 : 0));
  return code;
}

// Index of the dynamic-map value nearest to x (ties to the lower one).
uint8_t nearest_dynamic(float x, const std::array<float, 256>& map) {
  auto it = std::lower_bound(map.begin(), map.end(), x);
  if (it == map.end()) return 255;
  size_t hi = static_cast<size_t>(it - map.begin());
  if (hi == 0) return 0;
  size_t lo = hi - 1;
  return static_cast<uint8_t>(x - map[lo] <= map[hi] - x ? lo : hi);
}

Tensor upload_bytes(const std::vector<uint8_t>& bytes, Device device) {
  return from_buffer(bytes.data(), {static_cast<int64_t>(bytes.size())}, DType::U8, device);
}

struct Nf4LinearBackward : autograd::Node {
  std::shared_ptr<const Nf4Tensor> weight;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    const Tensor& dy = g[0];
    const int64_t out_features = weight->shape[0], in_features = weight->shape[1];
    Tensor w;
    {
      CategoryScope workspace(MemoryCategory::Workspace);
      w = weight->dequantize(dy.dtype());
    }
    Shape dx_shape = dy.shape();
    dx_shape.back() = in_features;
    Tensor dx = empty(dx_shape, dy.dtype(), dy.device());
    GemmArgs args;  // dx [rows, in] = dy [rows, out] @ W [out, in]
    args.m = dy.numel() / out_features;
    args.n = in_features;
    args.k = out_features;
    backend_for(dy.device()).gemm(args, dy, w, dx);
    return {dx};
  }
  std::string name() const override { return "Nf4LinearBackward"; }
};

}  // namespace

// ---- Nf4Tensor ------------------------------------------------------------------------------

Nf4Tensor Nf4Tensor::quantize(const Tensor& w) {
  ST_CHECK_SHAPE(w.defined() && is_floating(w.dtype()),
                 "NF4 quantization needs a float tensor, got ",
                 w.defined() ? w.describe() : "an undefined tensor");
  const int64_t n = w.numel();
  ST_CHECK_SHAPE(n > 0, "NF4 quantization of an empty tensor ", w.describe());
  const std::vector<float> values = w.to_float_vector();
  const int64_t blocks = nf4::num_blocks(n), groups = nf4::num_absmax_groups(n);
  const std::array<float, 15> thresholds = nf4_thresholds();

  // Codes and exact block absmax values.
  std::vector<uint8_t> codes(static_cast<size_t>(nf4::num_code_bytes(n)), 0);
  std::vector<float> absmax(static_cast<size_t>(blocks));
  bool finite = true;
#pragma omp parallel for schedule(static) reduction(&& : finite) if (blocks > 64)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * nf4::kNf4BlockSize, hi = std::min(n, lo + nf4::kNf4BlockSize);
    float m = 0.0f;
    for (int64_t i = lo; i < hi; ++i) m = std::max(m, std::fabs(values[static_cast<size_t>(i)]));
    finite = finite && std::isfinite(m);
    absmax[static_cast<size_t>(b)] = m;
    // bitsandbytes multiplies by the reciprocal; an all-zero block codes every weight as 0.
    // A subnormal absmax has no finite reciprocal (0 x inf would code zeros as NaN): such a
    // block, as small as a weight can be, codes as zeros too.
    const float inv = m > 0.0f && std::isfinite(1.0f / m) ? 1.0f / m : 0.0f;
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t c = nearest_nf4(values[static_cast<size_t>(i)] * inv, thresholds);
      uint8_t& byte = codes[static_cast<size_t>(i / 2)];
      byte = static_cast<uint8_t>(i % 2 == 0 ? (byte & 0x0f) | (c << 4) : (byte & 0xf0) | c);
    }
  }
  ST_CHECK_SHAPE(finite, "NF4 quantization of ", w.describe(),
                 ": the tensor holds inf or nan values");

  // Double quantization: absmax - mean, 8-bit dynamic codes per group of 256 blocks.
  double sum = 0;
  for (float m : absmax) sum += m;
  const float offset = static_cast<float>(sum / static_cast<double>(blocks));
  const std::array<float, 256>& map = nf4::dynamic_map_8bit();
  std::vector<uint8_t> absmax_q(static_cast<size_t>(blocks));
  std::vector<float> scales(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t lo = g * nf4::kAbsmaxGroupSize;
    const int64_t hi = std::min(blocks, lo + nf4::kAbsmaxGroupSize);
    float s = 0.0f;
    for (int64_t b = lo; b < hi; ++b)
      s = std::max(s, std::fabs(absmax[static_cast<size_t>(b)] - offset));
    scales[static_cast<size_t>(g)] = s;
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (int64_t b = lo; b < hi; ++b)
      absmax_q[static_cast<size_t>(b)] =
          nearest_dynamic((absmax[static_cast<size_t>(b)] - offset) * inv, map);
  }

  Nf4Tensor q;
  CategoryScope as_parameters(MemoryCategory::Parameters);
  q.codes = upload_bytes(codes, w.device());
  q.absmax_q = upload_bytes(absmax_q, w.device());
  q.absmax_scale = from_floats(scales, {groups}, DType::F32, w.device());
  q.absmax_offset = offset;
  q.shape = w.shape();
  return q;
}

Tensor Nf4Tensor::dequantize(DType dtype) const {
  Tensor out = empty(shape, dtype, device());
  backend_for(device()).nf4_dequantize(codes, absmax_q, absmax_scale, absmax_offset, out);
  return out;
}

std::vector<float> Nf4Tensor::block_absmax() const {
  const std::vector<int64_t> q = absmax_q.to_int_vector();
  const std::vector<float> scales = absmax_scale.to_float_vector();
  const std::array<float, 256>& map = nf4::dynamic_map_8bit();
  std::vector<float> out(q.size());
  for (size_t b = 0; b < q.size(); ++b) {
    const float scaled =
        map[static_cast<size_t>(q[b])] * scales[b / static_cast<size_t>(nf4::kAbsmaxGroupSize)];
    out[b] = scaled + absmax_offset;
  }
  return out;
}

int64_t Nf4Tensor::nbytes() const {
  return static_cast<int64_t>(codes.nbytes() + absmax_q.nbytes() + absmax_scale.nbytes());
}

void Nf4Tensor::validate(const std::string& what) const {
  auto fail = [&](const std::string& problem) { throw FormatError(what + ": " + problem); };
  if (!codes.defined() || !absmax_q.defined() || !absmax_scale.defined())
    fail("the NF4 tensor is missing codes, absmax or absmax_scale");
  const int64_t n = numel();
  if (shape.empty() || n <= 0) fail("the NF4 tensor has an empty shape " + shape_str(shape));
  auto expect = [&](const Tensor& t, DType dtype, int64_t count, const char* name) {
    if (t.dtype() != dtype || t.numel() != count)
      fail(std::string(name) + " should be " + std::string(dtype_name(dtype)) + "[" +
           std::to_string(count) + "] for a weight of shape " + shape_str(shape) + ", got " +
           t.describe());
    if (t.device() != codes.device())
      fail(std::string(name) + " is on " + t.device().str() + " but the codes are on " +
           codes.device().str());
  };
  expect(codes, DType::U8, nf4::num_code_bytes(n), "codes");
  expect(absmax_q, DType::U8, nf4::num_blocks(n), "absmax");
  expect(absmax_scale, DType::F32, nf4::num_absmax_groups(n), "absmax_scale");
  if (!std::isfinite(absmax_offset)) fail("absmax_offset is not finite");
}

// ---- nf4_linear -----------------------------------------------------------------------------

Tensor nf4_linear(const Tensor& x, const std::shared_ptr<const Nf4Tensor>& w) {
  ST_CHECK_SHAPE(w != nullptr && w->shape.size() == 2, "nf4_linear: the weight must be 2-d");
  ST_CHECK_SHAPE(x.defined() && is_floating(x.dtype()) && x.dim() >= 1 && x.size(-1) == w->shape[1],
                 "nf4_linear: input ", x.defined() ? x.describe() : "undefined",
                 " does not match the NF4 weight ", shape_str(w->shape), " (expected [..., ",
                 w->shape[1], "])");
  ST_CHECK_SHAPE(x.device() == w->device(), "nf4_linear: input ", x.describe(),
                 " is not on the weight's device ", w->device().str());
  Tensor out;
  {
    Tensor dense;
    {
      CategoryScope workspace(MemoryCategory::Workspace);
      dense = w->dequantize(x.dtype());
    }
    autograd::NoGrad no_grad;
    out = ops::linear(x, dense);
  }
  if (autograd::needs_graph({&x})) {
    auto node = std::make_shared<Nf4LinearBackward>();
    node->weight = w;
    autograd::attach(node, {&x}, {&out});
  }
  return out;
}

// ---- Nf4Linear ------------------------------------------------------------------------------

Nf4Linear::Nf4Linear(Nf4Tensor weight)
    : Linear(weight.shape.size() == 2 ? weight.shape[1] : 0,
             weight.shape.size() == 2 ? weight.shape[0] : 0) {
  ST_CHECK_SHAPE(weight.shape.size() == 2, "Nf4Linear needs a 2-d weight [out, in], got ",
                 shape_str(weight.shape));
  weight.validate("Nf4Linear");
  weight_ = std::make_shared<const Nf4Tensor>(std::move(weight));
}

std::unique_ptr<Nf4Linear> Nf4Linear::from_linear(const Linear& linear) {
  ST_CHECK_SHAPE(linear.weight.defined(),
                 "Nf4Linear::from_linear: the projection has no dense "
                 "weight (is it already quantized or an adapter?)");
  return std::make_unique<Nf4Linear>(Nf4Tensor::quantize(linear.weight));
}

Tensor Nf4Linear::forward(const Tensor& x) {
  return nf4_linear(x, weight_);
}

void Nf4Linear::set_quantized_weight(Nf4Tensor weight) {
  ST_CHECK_SHAPE(weight.shape == weight_->shape, "Nf4Linear: new weight of shape ",
                 shape_str(weight.shape), " does not match ", shape_str(weight_->shape));
  weight.validate("Nf4Linear");
  weight_ = std::make_shared<const Nf4Tensor>(std::move(weight));
}

}  // namespace shardtrain::nn
