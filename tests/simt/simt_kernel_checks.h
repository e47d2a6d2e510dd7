// What the tests of the emulated elementwise, row and reduction kernels share: operands placed
// where a kernel's vector or scalar path is taken and where a stray access shows, and the loop
// that runs a kernel under every schedule.
#pragma once
#include "simt_test_util.h"

#include <functional>
#include <string>
#include <vector>

namespace shardtrain::testing {

// Where an operand starts inside its guarded mapping.
enum class Place {
  aligned,       // 256-byte aligned start: the kernels' vector paths
  offset,        // one element past an aligned start: their scalar paths
  end_at_guard,  // the last byte touches the guard page: a read or write past the end faults
};

inline const char* place_name(Place p) {
  return p == Place::aligned  ? "aligned"
         : p == Place::offset ? "offset by one element"
                              : "at guard";
}

// The float dtypes, and the two starts (aligned: the vector paths; offset: the scalar paths), that
// the kernel tests run every case under.
constexpr DType kFloatTypes[] = {DType::F32, DType::BF16, DType::F16};
constexpr Place kAlignments[] = {Place::aligned, Place::offset};

// A tensor's bytes in guarded memory, as a kernel argument, with the start placed as asked. Every
// byte of the mapping around the operand is 0xff: a float read past either end is NaN, which spoils
// the result, and expect_margins_untouched() finds writes there.
class Operand {
 public:
  explicit Operand(const Tensor& t, Place place = Place::aligned)
      : Operand(t.shape(), t.dtype(), place, false) {
    std::memcpy(data(), t.data_ptr(), bytes_);
  }
  // Uninitialised (0xff bytes: NaN for every float type) memory for a result.
  Operand(const Shape& shape, DType dtype, Place place = Place::aligned)
      : Operand(shape, dtype, place, false) {}

  void* data() const { return mem_->data() + lead_; }
  float* f32() const { return static_cast<float*>(data()); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data());
  }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return shardtrain::numel(shape_); }
  Tensor to_tensor() const {
    Tensor t = empty(shape_, dtype_);
    std::memcpy(t.data_ptr(), data(), bytes_);
    return t;
  }
  void expect_margins_untouched(const std::string& what) const {
    const auto* p = reinterpret_cast<const unsigned char*>(mem_->data());
    size_t changed = 0, first = 0;
    for (size_t i = 0; i < mem_->size(); ++i) {
      if (i >= lead_ && i < lead_ + bytes_) continue;
      if (p[i] != 0xff && changed++ == 0) first = i;
    }
    EXPECT_EQ(changed, 0u) << what << ": " << changed
                           << " bytes written outside the operand, the first at byte "
                           << static_cast<int64_t>(first) - static_cast<int64_t>(lead_)
                           << " from its start (" << bytes_ << " bytes long)";
  }

 private:
  Operand(const Shape& shape, DType dtype, Place place, bool)
      : shape_(shape),
        dtype_(dtype),
        bytes_(static_cast<size_t>(shardtrain::numel(shape)) * dtype_size(dtype)) {
    // At least 256 bytes before the operand (a margin that keeps the aligned start aligned),
    // and a mapping of whole 256-byte units, so that its end is the guard page.
    const size_t unit = 256;
    const size_t lead = unit + (place == Place::offset ? dtype_size(dtype) : 0);
    const size_t total = (lead + bytes_ + unit - 1) / unit * unit;
    mem_ = std::make_unique<simt::GuardedBuffer>(total);
    std::memset(mem_->data(), 0xff, total);
    lead_ = place == Place::end_at_guard ? total - bytes_ : lead;
  }

  Shape shape_;
  DType dtype_;
  size_t bytes_;
  size_t lead_ = 0;
  std::unique_ptr<simt::GuardedBuffer> mem_;
};

// Runs `run` under every schedule of schedules(): the first schedule's results go to `check`
// (against the CPU backend), and every later schedule must give the same bits, since a result
// that depends on the order of the threads means a missing barrier.
inline void under_every_schedule(
    const std::string& what, const std::function<std::vector<Tensor>(const std::string&)>& run,
    const std::function<void(const std::vector<Tensor>&, const std::string&)>& check) {
  std::vector<Tensor> first;
  for (const simt::Options& schedule : schedules()) {
    ScheduleGuard guard(schedule);
    const std::string label = what + ", " + describe(schedule);
    std::vector<Tensor> got = run(label);
    if (first.empty()) {
      check(got, label);
      first = std::move(got);
      continue;
    }
    ASSERT_EQ(got.size(), first.size()) << label;
    for (size_t i = 0; i < got.size(); ++i)
      expect_bitwise_equal(got[i], first[i],
                           label + ", result " + std::to_string(i) + " against the first schedule");
  }
}

// Floats of `values` as a tensor of `dtype` (rounded into it).
inline Tensor floats_as(const std::vector<float>& values, DType dtype) {
  return from_floats(values, {static_cast<int64_t>(values.size())}, dtype);
}

}  // namespace shardtrain::testing
