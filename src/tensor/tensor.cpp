#include "shardtrain/tensor/tensor.h"

#include <cmath>
#include <cstring>

namespace shardtrain {

namespace {
DeviceCastFn g_device_cast = nullptr;

std::shared_ptr<TensorImpl> make_impl(const Shape& shape, DType dtype, Device device,
                                      MemoryCategory category) {
  for (int64_t d : shape) ST_CHECK_SHAPE(d >= 0, "negative extent in shape ", shape_str(shape));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>();
  impl->storage->data =
      DataPtr(static_cast<size_t>(numel(shape)) * dtype_size(dtype), device, category);
  impl->shape = shape;
  impl->dtype = dtype;
  return impl;
}
}  // namespace

int64_t Tensor::size(int64_t d) const {
  int64_t n = dim();
  if (d < 0) d += n;
  ST_CHECK_SHAPE(d >= 0 && d < n, "dimension ", d, " out of range for ", describe());
  return impl_->shape[static_cast<size_t>(d)];
}

int64_t Tensor::numel() const {
  return shardtrain::numel(impl_->shape);
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined tensor";
  return std::string(dtype_name(dtype())) + shape_str(shape()) + " on " + device().str();
}

void* Tensor::data_ptr() const {
  return static_cast<char*>(impl_->storage->data.get()) +
         impl_->offset * static_cast<int64_t>(dtype_size(impl_->dtype));
}

void Tensor::check_cpu_access(size_t element_size) const {
  ST_CHECK(defined(), "access to an undefined tensor");
  ST_CHECK(device().cpu_addressable(), "CPU access to ", describe(),
           ": copy it to the CPU first with .to(Device::cpu())");
  ST_CHECK(element_size == dtype_size(dtype()), "typed access of ", element_size,
           "-byte elements to ", describe());
}

Tensor Tensor::view(Shape shape) const {
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      ST_CHECK_SHAPE(infer < 0, "view ", shape_str(shape), " has more than one -1");
      infer = static_cast<int>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    ST_CHECK_SHAPE(known > 0 && numel() % known == 0, "cannot view ", describe(), " as ",
                   shape_str(shape));
    shape[static_cast<size_t>(infer)] = numel() / known;
  }
  ST_CHECK_SHAPE(shardtrain::numel(shape) == numel(), "cannot view ", describe(), " as ",
                 shape_str(shape), ": element counts differ");
  auto impl = std::make_shared<TensorImpl>(*impl_);
  impl->shape = std::move(shape);
  impl->autograd.reset();
  return Tensor(impl);
}

Tensor Tensor::slice_rows(int64_t start, int64_t length) const {
  ST_CHECK_SHAPE(dim() >= 1 && start >= 0 && length >= 0 && start + length <= size(0), "rows [",
                 start, ", ", start + length, ") out of range for ", describe());
  auto impl = std::make_shared<TensorImpl>(*impl_);
  int64_t row = numel() / std::max<int64_t>(size(0), 1);
  impl->offset += start * row;
  impl->shape[0] = length;
  impl->autograd.reset();
  return Tensor(impl);
}

Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>(*impl_);
  impl->autograd.reset();
  return Tensor(impl);
}

Tensor Tensor::to(Device device) const {
  return to(device, category());
}

Tensor Tensor::to(Device device, MemoryCategory category) const {
  Tensor out(make_impl(shape(), dtype(), device, category));
  copy_bytes(out.data_ptr(), device, data_ptr(), this->device(), nbytes());
  return out;
}

Tensor Tensor::to(DType dtype) const {
  Tensor out(make_impl(shape(), dtype, device(), category()));
  out.copy_from(*this);
  return out;
}

Tensor Tensor::clone() const {
  return to(device(), CategoryScope::current());
}

void Tensor::copy_from(const Tensor& src) {
  ST_CHECK_SHAPE(src.numel() == numel(), "copy of ", src.describe(), " into ", describe(),
                 ": element counts differ");
  if (src.dtype() == dtype()) {
    copy_bytes(data_ptr(), device(), src.data_ptr(), src.device(), nbytes());
    return;
  }
  if (device().cpu_addressable() && src.device().cpu_addressable()) {
    convert_elements(src.data_ptr(), src.dtype(), data_ptr(), dtype(), numel());
    return;
  }
  if (device() == src.device() && g_device_cast != nullptr) {
    g_device_cast(src, *this);
    return;
  }
  // Mixed devices and dtypes: convert on the host side.
  Tensor staged = src.device().cpu_addressable() ? src : src.to(Device::host());
  Tensor converted = staged.to(dtype());
  copy_bytes(data_ptr(), device(), converted.data_ptr(), converted.device(), nbytes());
}

std::vector<float> Tensor::to_float_vector() const {
  Tensor h = device().cpu_addressable() ? *this : to(Device::host());
  std::vector<float> out(static_cast<size_t>(numel()));
  convert_elements(h.data_ptr(), dtype(), out.data(), DType::F32, numel());
  return out;
}

std::vector<int64_t> Tensor::to_int_vector() const {
  Tensor h = device().cpu_addressable() ? *this : to(Device::host());
  std::vector<int64_t> out(static_cast<size_t>(numel()));
  convert_elements(h.data_ptr(), dtype(), out.data(), DType::I64, numel());
  return out;
}

float Tensor::item() const {
  ST_CHECK_SHAPE(numel() == 1, "item() of ", describe(), ": needs exactly one element");
  return to_float_vector()[0];
}

// ---- conversions ---------------------------------------------------------------------------

namespace {
template <typename Get>
void store_all(Get get, void* dst, DType dst_type, int64_t n) {
  switch (dst_type) {
    case DType::F32: {
      auto* d = static_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(get(i));
      break;
    }
    case DType::BF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(static_cast<float>(get(i)));
      break;
    }
    case DType::F16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_f16(static_cast<float>(get(i)));
      break;
    }
    case DType::I32: {
      auto* d = static_cast<int32_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<int32_t>(get(i));
      break;
    }
    case DType::I64: {
      auto* d = static_cast<int64_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<int64_t>(get(i));
      break;
    }
    case DType::U8: {
      auto* d = static_cast<uint8_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint8_t>(get(i));
      break;
    }
  }
}
}  // namespace

void convert_elements(const void* src, DType st, void* dst, DType dt, int64_t n) {
  if (n <= 0) return;  // an empty tensor's data pointer may be null, which memcpy may not get
  if (st == dt) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(st));
    return;
  }
  switch (st) {
    case DType::F32: {
      auto* s = static_cast<const float*>(src);
      store_all([s](int64_t i) { return s[i]; }, dst, dt, n);
      break;
    }
    case DType::BF16: {
      auto* s = static_cast<const uint16_t*>(src);
      store_all([s](int64_t i) { return bf16_to_float(s[i]); }, dst, dt, n);
      break;
    }
    case DType::F16: {
      auto* s = static_cast<const uint16_t*>(src);
      store_all([s](int64_t i) { return f16_to_float(s[i]); }, dst, dt, n);
      break;
    }
    case DType::I32: {
      auto* s = static_cast<const int32_t*>(src);
      store_all([s](int64_t i) { return s[i]; }, dst, dt, n);
      break;
    }
    case DType::I64: {
      auto* s = static_cast<const int64_t*>(src);
      store_all([s](int64_t i) { return s[i]; }, dst, dt, n);
      break;
    }
    case DType::U8: {
      auto* s = static_cast<const uint8_t*>(src);
      store_all([s](int64_t i) { return s[i]; }, dst, dt, n);
      break;
    }
  }
}

void register_device_cast(DeviceCastFn fn) {
  g_device_cast = fn;
}

// ---- factories -------------------------------------------------------------------------------

Tensor empty(const Shape& shape, DType dtype, Device device) {
  return Tensor(make_impl(shape, dtype, device, CategoryScope::current()));
}

Tensor full(const Shape& shape, float value, DType dtype, Device device) {
  std::vector<float> v(static_cast<size_t>(numel(shape)), value);
  return from_floats(v, shape, dtype, device);
}

Tensor zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  zero_bytes(t.data_ptr(), device, t.nbytes());
  return t;
}

Tensor ones(const Shape& shape, DType dtype, Device device) {
  return full(shape, 1.0f, dtype, device);
}

Tensor from_buffer(const void* data, const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  copy_bytes(t.data_ptr(), device, data, Device::host(), t.nbytes());
  return t;
}

Tensor from_floats(const std::vector<float>& values, const Shape& shape, DType dtype,
                   Device device) {
  ST_CHECK_SHAPE(static_cast<int64_t>(values.size()) == numel(shape), values.size(),
                 " values for shape ", shape_str(shape));
  std::vector<char> buf(static_cast<size_t>(numel(shape)) * dtype_size(dtype));
  convert_elements(values.data(), DType::F32, buf.data(), dtype, numel(shape));
  return from_buffer(buf.data(), shape, dtype, device);
}

Tensor from_ints(const std::vector<int64_t>& values, const Shape& shape, DType dtype,
                 Device device) {
  ST_CHECK_SHAPE(static_cast<int64_t>(values.size()) == numel(shape), values.size(),
                 " values for shape ", shape_str(shape));
  std::vector<char> buf(static_cast<size_t>(numel(shape)) * dtype_size(dtype));
  convert_elements(values.data(), DType::I64, buf.data(), dtype, numel(shape));
  return from_buffer(buf.data(), shape, dtype, device);
}

// ---- random ----------------------------------------------------------------------------------

namespace {
uint64_t mix(uint64_t seed, uint64_t counter) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + counter + 0x632BE59BD9B4E5ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
float to_unit(uint64_t bits) {  // 24 random bits -> [0, 1)
  return static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
}
}  // namespace

void Generator::uniform(float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_unit(mix(seed_, offset_ + static_cast<uint64_t>(i)));
  offset_ += static_cast<uint64_t>(n);
}

void Generator::normal(float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint64_t c = 2 * (offset_ + static_cast<uint64_t>(i));
    double u1 = (static_cast<double>(mix(seed_, c) >> 11) + 1.0) * (1.0 / 9007199254740993.0);
    double u2 = static_cast<double>(mix(seed_, c + 1) >> 11) * (1.0 / 9007199254740992.0);
    out[i] = static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
  }
  offset_ += static_cast<uint64_t>(n);
}

Tensor randn(const Shape& shape, Generator& gen, float stddev, DType dtype, Device device) {
  std::vector<float> v(static_cast<size_t>(numel(shape)));
  gen.normal(v.data(), static_cast<int64_t>(v.size()));
  for (float& x : v) x *= stddev;
  return from_floats(v, shape, dtype, device);
}

Tensor rand_uniform(const Shape& shape, Generator& gen, float low, float high, DType dtype,
                    Device device) {
  std::vector<float> v(static_cast<size_t>(numel(shape)));
  gen.uniform(v.data(), static_cast<int64_t>(v.size()));
  for (float& x : v) x = low + (high - low) * x;
  return from_floats(v, shape, dtype, device);
}

}  // namespace shardtrain
