// simt: runs the CUDA kernels of kernels/*.cu on the CPU, for tests on machines without a GPU.
//
// The .cu files are compiled by the host C++ compiler with this header included first (after
// simt_translate has rewritten `<<<...>>>` launches and `extern __shared__` arrays). Every CUDA
// thread is a fiber; the threads of a block run one at a time on the calling thread, each until it
// reaches a synchronisation point:
//   - __syncthreads(): released when every thread of the block is there;
//   - a warp collective (__shfl_xor_sync, __any_sync, ldmatrix, mma.sync): carried out when all
//     32 lanes of the warp have arrived, as the hardware does with a full mask.
// So the kernels' own index arithmetic, fragment layouts, masking, barriers and host launch code
// are what runs; only the instructions below are modelled, from the PTX ISA:
//   - mma.sync.m16n8k16.row.col (bf16/f16 in, f32 accumulate) through the ISA's fragment tables;
//   - ldmatrix.sync.m8n8.x4{.trans}.b16: lane 8i + r gives row r of matrix i, register i of lane l
//     receives M_i[l/4][2(l%4) + {0,1}] (transposed with .trans);
//   - cp.async with zero fill: performed at issue or, in the deferred mode, at the issuing
//     thread's cp.async.wait_all with the destination poisoned (0xff bytes: NaN) until then.
// Mistakes it finds: wrong fragment or index arithmetic (wrong results), divergent barriers and
// warp collectives (reported), missing barriers and early reads of cp.async destinations
// (results that change with the schedule: Options::shuffle and CpAsync::deferred), reads of
// shared memory that no thread of the block has written (NaN, dynamic and static alike), misaligned
// ldmatrix/cp.async addresses, shared memory requests past the device limit, and out-of-range
// accesses to the dynamic shared buffer (it ends at a guard page).
//
// What it does not model: timing, real concurrency between blocks (blocks run one after
// another), the memory model beyond barrier order, and the exact rounding of the hardware's
// transcendental functions and tensor-core sums (the host's libm and fp32 sums stand in).
#pragma once

// Storage keywords must be defined before the CUDA headers, which keep existing definitions:
// static storage is shared by every fiber of the block (blocks run one at a time).
#define __shared__ static

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "shardtrain/backend/cuda.h"

#define __launch_bounds__(...)

namespace simt {

// ---- launching ------------------------------------------------------------------------------

struct Config {
  dim3 grid;
  dim3 block;
  size_t dynamic_shared = 0;
  cudaStream_t stream = nullptr;
};

// Runs `thread_body` once per thread of the grid (see the header comment). A launch with more
// than 48 KiB of dynamic shared memory must follow a cudaFuncSetAttribute that allows at least
// that much (the kernels set it right before each launch; the emulator checks the latest value,
// since a launch of a template with deduced arguments names no function it could look up).
void launch(const char* name, const Config& config, const std::function<void()>& thread_body);

// How blocks are scheduled; tests run kernels under several options and compare results.
enum class CpAsync { at_issue, deferred };
struct Options {
  bool shuffle = false;  // run the ready threads of a block in a random order at every step
  uint64_t seed = 1;
  CpAsync cp_async = CpAsync::at_issue;
};
void set_options(const Options& options);
const Options& options();

// The device's opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin), which
// launches are checked against: 163 KiB, sm_80's (the smaller of sm_80 and sm_90), unless a test
// models another GPU (99 KiB: compute capability 8.6 and 8.9). Not a schedule: set_options
// leaves it alone.
void set_shared_memory_per_block_optin(size_t bytes);
size_t shared_memory_per_block_optin();

// Counters since the last reset, for tests that check a kernel really took a path.
struct Stats {
  int64_t launches = 0, blocks = 0, barriers = 0, warp_collectives = 0, mma = 0, cp_async = 0;
  // Extra shared-memory wavefronts ldmatrix would take on the hardware: for each 8x8 matrix, the
  // most rows that start in the same 16-byte group of the 128-byte bank span, minus one.
  int64_t ldmatrix_bank_conflicts = 0;
};
const Stats& stats();
void reset_stats();

// ---- memory ---------------------------------------------------------------------------------

// Host memory standing in for a device allocation: its end is followed by an inaccessible page,
// so a kernel that reads or writes past it faults at once. The start is 256-byte aligned.
class GuardedBuffer {
 public:
  GuardedBuffer() = default;
  explicit GuardedBuffer(size_t bytes);
  ~GuardedBuffer();
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  // Resizes (contents are lost); the mapping is kept when it is large enough.
  void reserve(size_t bytes);
  char* data() const { return data_; }
  size_t size() const { return bytes_; }
  bool contains(const void* p, size_t n) const;

 private:
  void release();
  void* base_ = nullptr;
  size_t span_ = 0;
  char* data_ = nullptr;
  size_t bytes_ = 0;
};

// ---- what a running thread sees -------------------------------------------------------------

struct ThreadIndex {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
};
const ThreadIndex& current();

void syncthreads();
void* dynamic_shared();
// Called by every thread where a static __shared__ variable is declared (simt_translate adds the
// call): the first call of each block fills the variable with 0xff bytes (NaN), before any
// thread of the block can have written it, as a block finds the dynamic shared memory. Without
// it the variable would hold what the previous block left, which for a table that every block
// fills alike hides a missing barrier.
bool static_shared(void* variable, size_t bytes);
[[noreturn]] void trap();

void warp_shuffle_xor(unsigned mask, const void* value, void* result, int bytes, int lane_mask,
                      int width);
template <typename T>
T shfl_xor(unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  T result;
  warp_shuffle_xor(mask, &value, &result, static_cast<int>(sizeof(T)), lane_mask, width);
  return result;
}
int any(unsigned mask, int predicate);

// Tensor-core and asynchronous-copy instructions (called from the kernels' helpers).
void mma_m16n8k16(bool bf16, float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans);
void cp_async(void* dst, const void* src, int bytes, int src_bytes);
void cp_async_wait_all();

// cudaFuncSetAttribute, which the kernels' host code calls before launches that need more than
// 48 KiB of shared memory: the emulator checks launches against it. The rest of the runtime API
// they call (copies, memsets, device attributes) is fake_cuda_runtime.cpp's.
cudaError_t func_set_attribute(const void* kernel, cudaFuncAttribute attribute, int value);
template <typename... P>
cudaError_t func_set_attribute(void (*kernel)(P...), cudaFuncAttribute attribute, int value) {
  return func_set_attribute(reinterpret_cast<const void*>(kernel), attribute, value);
}

// Exactly rounded fp32 operations (the build uses -ffp-contract=off, so nothing is fused).
inline float add_rn(float a, float b) {
  return a + b;
}
inline float sub_rn(float a, float b) {
  return a - b;
}
inline float mul_rn(float a, float b) {
  return a * b;
}
inline float div_rn(float a, float b) {
  return a / b;
}
inline float sqrt_rn(float a) {
  return std::sqrt(a);
}

}  // namespace simt

// Device code calls these unqualified.
using std::isfinite;
using std::isinf;
using std::isnan;

// CUDA's device min/max: fminf/fmaxf for floating types (a NaN operand yields the other one),
// the usual comparison for integers, of the two operands' common type.
template <typename A, typename B>
constexpr std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>)
    return std::fmin(C(a), C(b));
  else
    return C(b) < C(a) ? C(b) : C(a);
}
template <typename A, typename B>
constexpr std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>)
    return std::fmax(C(a), C(b));
  else
    return C(a) < C(b) ? C(b) : C(a);
}

#define threadIdx (::simt::current().thread_idx)
#define blockIdx (::simt::current().block_idx)
#define blockDim (::simt::current().block_dim)
#define gridDim (::simt::current().grid_dim)
#define __syncthreads() ::simt::syncthreads()
#define __shfl_xor_sync(...) ::simt::shfl_xor(__VA_ARGS__)
#define __any_sync(mask, predicate) ::simt::any(mask, predicate)
#define __trap() ::simt::trap()
#define __fadd_rn(a, b) ::simt::add_rn(a, b)
#define __fsub_rn(a, b) ::simt::sub_rn(a, b)
#define __fmul_rn(a, b) ::simt::mul_rn(a, b)
#define __fdiv_rn(a, b) ::simt::div_rn(a, b)
#define __fsqrt_rn(a) ::simt::sqrt_rn(a)
#define cudaFuncSetAttribute(...) ::simt::func_set_attribute(__VA_ARGS__)

// ---- atomics and library calls the kernels make ---------------------------------------------

// Fibers never preempt each other, so a read-modify-write is atomic as it stands. Blocks run one
// after another, so atomic float sums come out in block order: bit-reproducible here, unlike on
// the hardware.
inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  if (value < old) *address = value;
  return old;
}
inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}

namespace cub {
// cub's stable radix sort of (key, value) pairs on key bits [begin_bit, end_bit), as a stable
// sort on the host. The first call (temp == nullptr) asks for the workspace size.
struct DeviceRadixSort {
  template <typename K, typename V>
  static cudaError_t SortPairs(void* temp, size_t& temp_bytes, const K* keys_in, K* keys_out,
                               const V* values_in, V* values_out, int items, int begin_bit = 0,
                               int end_bit = static_cast<int>(sizeof(K) * 8),
                               cudaStream_t = nullptr) {
    if (temp == nullptr) {
      temp_bytes = 256;
      return cudaSuccess;
    }
    const int bits = end_bit - begin_bit;
    const K mask = bits >= static_cast<int>(sizeof(K) * 8) ? ~K(0) : (K(1) << bits) - 1;
    auto sort_key = [&](int i) { return static_cast<K>((keys_in[i] >> begin_bit) & mask); };
    std::vector<int> order(static_cast<size_t>(items));
    for (int i = 0; i < items; ++i) order[static_cast<size_t>(i)] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return sort_key(a) < sort_key(b); });
    for (int i = 0; i < items; ++i) {
      keys_out[i] = keys_in[order[static_cast<size_t>(i)]];
      values_out[i] = values_in[order[static_cast<size_t>(i)]];
    }
    return cudaSuccess;
  }
};
}  // namespace cub
