// A reference-counted, contiguous, row-major tensor.
//
// A Tensor is a cheap handle (shared_ptr) to a TensorImpl: storage + element offset + shape +
// dtype. Views (view/reshape, slicing along the first dimension, detach) share storage; ops that
// need other layouts (transposes, permutes) produce new contiguous tensors, which keeps every
// kernel simple. Autograd state hangs off the impl as an opaque AutogradMetaBase so that this
// layer does not depend on autograd.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/core/device.h"
#include "shardtrain/core/dtype.h"
#include "shardtrain/core/error.h"
#include "shardtrain/core/shape.h"
#include "shardtrain/memory/allocator.h"

namespace shardtrain {

struct Storage {
  DataPtr data;
  std::shared_ptr<void> keepalive;  // e.g. a memory-mapped file behind borrowed bytes
};

// Defined by the autograd layer.
struct AutogradMetaBase {
  virtual ~AutogradMetaBase() = default;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  int64_t offset = 0;  // in elements
  Shape shape;
  DType dtype = DType::F32;
  std::shared_ptr<AutogradMetaBase> autograd;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }

  const Shape& shape() const { return impl_->shape; }
  int64_t dim() const { return static_cast<int64_t>(impl_->shape.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const;
  DType dtype() const { return impl_->dtype; }
  Device device() const { return impl_->storage->data.device(); }
  MemoryCategory category() const { return impl_->storage->data.category(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype()); }
  std::string describe() const;  // "f32[2, 3] on cpu"

  void* data_ptr() const;
  // Typed access to CPU-addressable memory; checks the dtype's size matches T.
  template <typename T>
  T* data() const {
    check_cpu_access(sizeof(T));
    return static_cast<T*>(data_ptr());
  }

  // Same storage, new shape with the same number of elements; one extent may be -1.
  Tensor view(Shape shape) const;
  // Rows [start, start+length) of the first dimension, sharing storage.
  Tensor slice_rows(int64_t start, int64_t length) const;
  // Same storage, no autograd state.
  Tensor detach() const;

  // Copies to another device (or the host pool), counted under `category` there.
  Tensor to(Device device) const;
  Tensor to(Device device, MemoryCategory category) const;
  // Converts element type (round-to-nearest-even into 16-bit types).
  Tensor to(DType dtype) const;
  Tensor clone() const;
  // Copies src's elements into this tensor (same numel; converts dtype; any devices).
  void copy_from(const Tensor& src);

  // Host copies for tests, logging and checks.
  std::vector<float> to_float_vector() const;
  std::vector<int64_t> to_int_vector() const;
  float item() const;

 private:
  void check_cpu_access(size_t element_size) const;
  std::shared_ptr<TensorImpl> impl_;
};

// ---- Factories (allocations are counted under CategoryScope::current()) ----------------------
Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
Tensor ones(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
Tensor full(const Shape& shape, float value, DType dtype = DType::F32,
            Device device = Device::cpu());
// Copies `shape`'s worth of elements of `dtype` from a host buffer.
Tensor from_buffer(const void* data, const Shape& shape, DType dtype,
                   Device device = Device::cpu());
Tensor from_floats(const std::vector<float>& values, const Shape& shape, DType dtype = DType::F32,
                   Device device = Device::cpu());
Tensor from_ints(const std::vector<int64_t>& values, const Shape& shape, DType dtype = DType::I64,
                 Device device = Device::cpu());

// Counter-based random numbers: element i of draw number n depends only on (seed, offset + i),
// so a stream is reproducible on any device and its state is two integers (saved in checkpoints,
// restored for recompute).
class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_state(uint64_t seed, uint64_t offset) {
    seed_ = seed;
    offset_ = offset;
  }
  // Fills `out` with uniform [0,1) or standard normal floats and advances the offset.
  void uniform(float* out, int64_t n);
  void normal(float* out, int64_t n);

 private:
  uint64_t seed_;
  uint64_t offset_ = 0;
};

Tensor randn(const Shape& shape, Generator& gen, float stddev = 1.0f, DType dtype = DType::F32,
             Device device = Device::cpu());
Tensor rand_uniform(const Shape& shape, Generator& gen, float low, float high,
                    DType dtype = DType::F32, Device device = Device::cpu());

// Converts n elements between dtypes on CPU-addressable memory.
void convert_elements(const void* src, DType src_type, void* dst, DType dst_type, int64_t n);

// Device-side dtype conversion, registered by the CUDA backend.
using DeviceCastFn = void (*)(const Tensor& src, Tensor& dst);
void register_device_cast(DeviceCastFn fn);

}  // namespace shardtrain
