// The simt scheduler: one fiber per CUDA thread, blocks run one after another (see simt.h).
//
// Fibers start with makecontext/swapcontext and then switch with GCC's __builtin_setjmp and
// __builtin_longjmp: swapcontext makes a system call per switch, and the attention kernels switch
// millions of times. The builtins save and restore only the frame and stack pointers and the
// resume address (the compiler reloads the other registers at the resume point), where the C
// library's longjmp also walks the thread's cleanup handlers on every jump: a third of a whole
// emulated training's time went to that.
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <exception>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "simt.h"

namespace simt {
namespace {

// Where a suspended fiber (or the scheduler) resumes: __builtin_setjmp's five words.
using JumpBuffer = void* [5];

// Resumes at `to`. Out of line: GCC does not allow __builtin_longjmp in the function that calls
// __builtin_setjmp.
[[noreturn, gnu::noinline]] void jump_to(JumpBuffer& to) {
  __builtin_longjmp(to, 1);
}

constexpr size_t kStackBytes = 256 * 1024;
constexpr int kWarp = 32;

enum class State { ready, at_barrier, at_warp_op, done };
enum class WarpOp { none, shuffle, any, mma, ldmatrix };

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::shuffle:
      return "__shfl_xor_sync";
    case WarpOp::any:
      return "__any_sync";
    case WarpOp::mma:
      return "mma.sync";
    case WarpOp::ldmatrix:
      return "ldmatrix";
    default:
      return "nothing";
  }
}

struct PendingCopy {
  void* dst;
  const void* src;
  int bytes, src_bytes;
};

struct Fiber {
  ThreadIndex index{};
  int slot = 0;  // linear thread index in the block
  State state = State::ready;
  bool started = false;     // entered fiber_entry at least once
  bool needs_start = true;  // its context must be made afresh (new, or abandoned mid-thread)
  ucontext_t context{};
  JumpBuffer jump{};
  void* stack = nullptr;  // kStackBytes plus a guard page below
  // The warp collective this thread waits in: its operands and where the result goes.
  WarpOp op = WarpOp::none;
  const void* op_in = nullptr;
  void* op_out = nullptr;
  int op_arg = 0;
  std::vector<PendingCopy> copies;  // deferred cp.async
};

// The block being run: who waits where, and who may run next.
struct BlockState {
  std::vector<Fiber*> threads;
  std::vector<int> warp_arrived;  // lanes of each warp waiting in a collective
  int at_barrier = 0, done = 0;
  std::deque<Fiber*> ready;
};

struct Emulator {
  Options options;
  BlockState block;
  Stats stats;
  std::deque<Fiber> fibers;  // a deque: growing it never moves a suspended fiber
  Fiber* running = nullptr;
  JumpBuffer scheduler{};
  const std::function<void()>* body = nullptr;
  std::exception_ptr error;
  GuardedBuffer shared;
  int allowed_dynamic_shared = 0;  // the latest cudaFuncAttributeMaxDynamicSharedMemorySize
  std::string kernel_name;
  std::mt19937_64 rng;
  uint64_t block_serial = 0;  // blocks run so far (never reset)
  // Each static __shared__ variable and the block_serial of the block that last poisoned it.
  std::unordered_map<const void*, uint64_t> static_shared;
};

Emulator g_emulator;  // a plain global: emu() is on every path and needs no guard check

Emulator& emu() {
  return g_emulator;
}

std::string where(const Fiber& f) {
  std::ostringstream s;
  s << emu().kernel_name << " block (" << f.index.block_idx.x << "," << f.index.block_idx.y << ","
    << f.index.block_idx.z << ") thread " << f.index.thread_idx.x;
  return s.str();
}

[[noreturn]] void fail(const std::string& message) {
  throw std::runtime_error("simt: " + message);
}

Fiber& self() {
  Emulator& e = emu();
  if (!e.running) fail("a device function was called outside a kernel launch");
  return *e.running;
}

// A kernel that touches memory past a guarded buffer faults; say which thread did before dying
// (on its own stack, since the fault may be a fiber's stack overflow).
void report_fault(int signal) {
  const Emulator& e = emu();
  std::string message = "simt: memory fault";
  if (e.running) message += " in " + where(*e.running);
  message += " (an access past a buffer, or a fiber stack overflow)\n";
  if (write(STDERR_FILENO, message.data(), message.size()) < 0) {
  }
  ::signal(signal, SIG_DFL);
  ::raise(signal);
}

void install_fault_report() {
  static bool installed = false;
  if (installed) return;
  installed = true;
  static std::vector<char> alternate(1 << 16);
  stack_t ss{};
  ss.ss_sp = alternate.data();
  ss.ss_size = alternate.size();
  sigaltstack(&ss, nullptr);
  struct sigaction action {};
  action.sa_handler = report_fault;
  action.sa_flags = SA_ONSTACK | SA_RESETHAND;
  sigaction(SIGSEGV, &action, nullptr);
  sigaction(SIGBUS, &action, nullptr);
}

// ---- fiber switching ------------------------------------------------------------------------

// A fiber runs thread after thread: when its thread of one block is done it waits, and the next
// block resumes it to run the body again. Fibers are made once, not per thread, since making a
// context costs system calls and small kernels are millions of threads.
void fiber_entry() {
  for (;;) {
    Emulator& e = emu();
    try {
      (*e.body)();
    } catch (...) {
      if (!e.error) e.error = std::current_exception();
    }
    Fiber& f = *e.running;
    f.state = State::done;
    ++e.block.done;
    if (__builtin_setjmp(f.jump) == 0) jump_to(e.scheduler);
  }
}

void resume(Fiber& f) {
  Emulator& e = emu();
  e.running = &f;
  if (__builtin_setjmp(e.scheduler) == 0) {
    if (!f.started) {
      f.started = true;
      ucontext_t from;
      swapcontext(&from, &f.context);
    }
    jump_to(f.jump);
  }
  e.running = nullptr;
}

// Back to the scheduler until it resumes this thread.
void wait_here(State state) {
  Fiber& f = self();
  f.state = state;
  if (__builtin_setjmp(f.jump) == 0) jump_to(emu().scheduler);
}

void prepare_fibers(int count) {
  Emulator& e = emu();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (static_cast<int>(e.fibers.size()) < count) {
    const size_t old = e.fibers.size();
    e.fibers.resize(static_cast<size_t>(count));
    for (size_t i = old; i < e.fibers.size(); ++i) {
      void* s = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (s == MAP_FAILED) fail("cannot map a fiber stack");
      mprotect(s, page, PROT_NONE);  // a stack overflow faults instead of corrupting memory
      e.fibers[i].stack = s;
    }
  }
  for (int i = 0; i < count; ++i) {
    Fiber& f = e.fibers[static_cast<size_t>(i)];
    f.state = State::ready;
    f.op = WarpOp::none;
    f.copies.clear();
    if (!f.needs_start) continue;  // done with its previous thread, waiting in fiber_entry
    f.needs_start = false;
    f.started = false;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = static_cast<char*>(f.stack) + page;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_entry, 0);
  }
}

// After an error the block's other threads are left in the middle of the kernel; their fibers
// start from scratch next time.
void abandon_fibers() {
  for (Fiber& f : emu().fibers) f.needs_start = true;
}

// ---- warp collectives -----------------------------------------------------------------------

uint16_t half_bits(uint32_t reg, int which) {
  return static_cast<uint16_t>(which ? reg >> 16 : reg & 0xffffu);
}

float decode16(uint16_t bits, bool bf16) {
  if (bf16) {
    const uint32_t word = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &word, 4);
    return f;
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

struct MmaIn {
  bool bf16;
  uint32_t a[4], b[2];
  float c[4];
};

// D = A B + C for the warp, A 16x16 (row), B 16x8 (col), fragments as the PTX ISA tables give
// them: groupID g = lane / 4, t = lane % 4.
void do_mma(Fiber* const* lanes) {
  float A[16][16], B[16][8], C[16][8];
  const bool bf16 = static_cast<const MmaIn*>(lanes[0]->op_in)->bf16;
  for (int l = 0; l < kWarp; ++l) {
    const MmaIn& in = *static_cast<const MmaIn*>(lanes[l]->op_in);
    if (in.bf16 != bf16) fail("mma.sync lanes disagree on the input type");
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 8; ++i) {  // a0..a7: a0,a1 in register 0 (a0 low half), ...
      const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const int col = t * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = decode16(half_bits(in.a[i / 2], i % 2), bf16);
    }
    for (int i = 0; i < 4; ++i) {  // b0..b3
      const int row = t * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      B[row][g] = decode16(half_bits(in.b[i / 2], i % 2), bf16);
    }
    for (int i = 0; i < 4; ++i) C[i < 2 ? g : g + 8][t * 2 + (i & 1)] = in.c[i];
  }
  for (int l = 0; l < kWarp; ++l) {
    float* d = static_cast<float*>(lanes[l]->op_out);
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = i < 2 ? g : g + 8, col = t * 2 + (i & 1);
      float sum = C[row][col];
      for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
      d[i] = sum;
    }
  }
}

void do_ldmatrix(Fiber* const* lanes) {
  const bool trans = lanes[0]->op_arg != 0;
  const uint16_t* rows[kWarp];
  for (int l = 0; l < kWarp; ++l) {
    if ((lanes[l]->op_arg != 0) != trans) fail("ldmatrix lanes disagree on .trans");
    rows[l] = static_cast<const uint16_t*>(lanes[l]->op_in);
    if (reinterpret_cast<uintptr_t>(rows[l]) % 16 != 0)
      fail("ldmatrix row address not 16-byte aligned in " + where(*lanes[l]));
    if (emu().shared.size() > 0 && !emu().shared.contains(rows[l], 16))
      fail("ldmatrix row address outside the dynamic shared memory in " + where(*lanes[l]));
  }
  // Each 8x8 matrix is read in one shared-memory wavefront of 8 x 16 bytes when its rows start in
  // different 16-byte groups of the 128 bytes the 32 banks span; rows that share a group
  // serialise (a bank conflict), which the padded tile layouts exist to avoid.
  for (int i = 0; i < 4; ++i) {
    int per_group[8] = {};
    for (int r = 0; r < 8; ++r)
      ++per_group[(reinterpret_cast<uintptr_t>(rows[8 * i + r]) / 16) % 8];
    emu().stats.ldmatrix_bank_conflicts += *std::max_element(per_group, per_group + 8) - 1;
  }
  // Element (r, c) of matrix i is rows[8 i + r][c].
  for (int l = 0; l < kWarp; ++l) {
    uint32_t* out = static_cast<uint32_t*>(lanes[l]->op_out);
    for (int i = 0; i < 4; ++i) {
      uint16_t lo, hi;
      if (!trans) {
        lo = rows[8 * i + l / 4][2 * (l % 4)];
        hi = rows[8 * i + l / 4][2 * (l % 4) + 1];
      } else {
        lo = rows[8 * i + 2 * (l % 4)][l / 4];
        hi = rows[8 * i + 2 * (l % 4) + 1][l / 4];
      }
      out[i] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
    }
  }
}

struct ShuffleIn {
  unsigned char bytes[8];
  int size, lane_mask, width;
};

void do_shuffle(Fiber* const* lanes) {
  const ShuffleIn& first = *static_cast<const ShuffleIn*>(lanes[0]->op_in);
  for (int l = 0; l < kWarp; ++l) {
    const ShuffleIn& in = *static_cast<const ShuffleIn*>(lanes[l]->op_in);
    if (in.size != first.size || in.width != first.width)
      fail("__shfl_xor_sync lanes disagree on the type or width in " + where(*lanes[l]));
    int src = l ^ in.lane_mask;
    // As the CUDA guide has it for width < 32: a lane may read from its own or an earlier
    // segment of `width` lanes; a later one gives it its own value.
    if (src / in.width > l / in.width || src >= kWarp) src = l;
    std::memcpy(lanes[l]->op_out, static_cast<const ShuffleIn*>(lanes[src]->op_in)->bytes,
                static_cast<size_t>(in.size));
  }
}

void do_any(Fiber* const* lanes) {
  int any = 0;
  for (int l = 0; l < kWarp; ++l) any |= *static_cast<const int*>(lanes[l]->op_in) != 0;
  for (int l = 0; l < kWarp; ++l) *static_cast<int*>(lanes[l]->op_out) = any;
}

// Blocks this lane until its warp has all arrived at the same collective; the scheduler runs it.
void perform(WarpOp op, Fiber* const* lanes) {
  for (int l = 1; l < kWarp; ++l)
    if (lanes[l]->op != op)
      fail("divergent warp: lane 0 is in " + std::string(op_name(op)) + ", lane " +
           std::to_string(l) + " in " + op_name(lanes[l]->op) + " (" + where(*lanes[l]) + ")");
  switch (op) {
    case WarpOp::shuffle:
      do_shuffle(lanes);
      break;
    case WarpOp::any:
      do_any(lanes);
      break;
    case WarpOp::mma:
      do_mma(lanes);
      break;
    case WarpOp::ldmatrix:
      do_ldmatrix(lanes);
      break;
    default:
      fail("unknown warp collective");
  }
}

// The lane that completes its warp carries the collective out and goes on without a switch;
// the others wait until then.
void warp_collective(WarpOp op, const void* in, void* out, int arg = 0) {
  Emulator& e = emu();
  Fiber& f = self();
  f.op = op;
  f.op_in = in;
  f.op_out = out;
  f.op_arg = arg;
  ++e.stats.warp_collectives;
  BlockState& b = e.block;
  const int w = f.slot / kWarp;
  if (++b.warp_arrived[static_cast<size_t>(w)] < kWarp) {
    wait_here(State::at_warp_op);
    return;
  }
  b.warp_arrived[static_cast<size_t>(w)] = 0;
  Fiber* const* lanes = &b.threads[static_cast<size_t>(w * kWarp)];
  perform(op, lanes);
  for (int l = 0; l < kWarp; ++l) {
    lanes[l]->op = WarpOp::none;
    if (lanes[l] == &f) continue;
    lanes[l]->state = State::ready;
    b.ready.push_back(lanes[l]);
  }
}

void check_full_mask(unsigned mask, const char* what) {
  if (mask != 0xffffffffu)
    fail(std::string(what) + " with a partial lane mask is not modelled (" + where(self()) + ")");
}

// ---- one block ------------------------------------------------------------------------------

std::string describe_states(const std::vector<Fiber*>& threads) {
  std::ostringstream s;
  int counts[4] = {};
  for (const Fiber* f : threads) ++counts[static_cast<int>(f->state)];
  s << counts[1] << " at __syncthreads, " << counts[2] << " in warp collectives, " << counts[3]
    << " exited";
  return s.str();
}

// Why a block stopped with threads still waiting.
[[noreturn]] void fail_stuck(const BlockState& b) {
  const int count = static_cast<int>(b.threads.size());
  for (int w = 0; w * kWarp < count; ++w) {
    const int waiting = b.warp_arrived[static_cast<size_t>(w)];
    if (waiting == 0) continue;
    const Fiber* first = nullptr;
    for (int l = 0; l < kWarp && w * kWarp + l < count; ++l) {
      const Fiber* f = b.threads[static_cast<size_t>(w * kWarp + l)];
      if (f->state == State::at_warp_op && first == nullptr) first = f;
    }
    fail(std::string(op_name(first->op)) + " (full mask) reached by " + std::to_string(waiting) +
         " of 32 lanes of warp " + std::to_string(w) + ", " + describe_states(b.threads) + ", in " +
         where(*first));
  }
  if (b.at_barrier > 0 && b.at_barrier + b.done == count)
    fail("__syncthreads reached by " + std::to_string(b.at_barrier) + " threads while " +
         std::to_string(b.done) + " have exited, in " + where(*b.threads[0]));
  fail("deadlock: " + describe_states(b.threads) + ", in " + where(*b.threads[0]));
}

void run_block(int count) {
  Emulator& e = emu();
  BlockState& b = e.block;
  b.threads.clear();
  for (int i = 0; i < count; ++i) b.threads.push_back(&e.fibers[static_cast<size_t>(i)]);
  b.warp_arrived.assign(static_cast<size_t>((count + kWarp - 1) / kWarp), 0);
  b.at_barrier = b.done = 0;
  b.ready.assign(b.threads.begin(), b.threads.end());
  while (!b.ready.empty()) {
    if (e.options.shuffle) {
      std::swap(b.ready.front(), b.ready[static_cast<size_t>(e.rng() % b.ready.size())]);
    }
    Fiber* f = b.ready.front();
    b.ready.pop_front();
    resume(*f);
    if (e.error) std::rethrow_exception(e.error);
  }
  if (b.done != count) fail_stuck(b);
}

}  // namespace

// ---- guarded memory -------------------------------------------------------------------------

GuardedBuffer::GuardedBuffer(size_t bytes) {
  reserve(bytes);
}

void GuardedBuffer::reserve(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t rounded = (bytes + 255) / 256 * 256;  // the start stays 256-byte aligned
  const size_t span = (rounded + page - 1) / page * page + page;
  if (span > span_) {
    release();
    void* base = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw std::runtime_error("simt: cannot map " + std::to_string(span));
    base_ = base;
    span_ = span;
    mprotect(static_cast<char*>(base_) + span - page, page, PROT_NONE);
  }
  data_ = static_cast<char*>(base_) + span_ - page - rounded;
  bytes_ = bytes;
}

void GuardedBuffer::release() {
  if (span_) munmap(base_, span_);
  span_ = 0;
  base_ = data_ = nullptr;
  bytes_ = 0;
}

GuardedBuffer::~GuardedBuffer() {
  release();
}

bool GuardedBuffer::contains(const void* p, size_t n) const {
  const char* c = static_cast<const char*>(p);
  return c >= data_ && c + n <= data_ + bytes_;
}

// ---- public interface -----------------------------------------------------------------------

void set_options(const Options& options) {
  emu().options = options;
  emu().rng.seed(options.seed);
}
const Options& options() {
  return emu().options;
}
const Stats& stats() {
  return emu().stats;
}
void reset_stats() {
  emu().stats = Stats{};
}

const ThreadIndex& current() {
  return self().index;
}

void launch(const char* name, const Config& config, const std::function<void()>& thread_body) {
  Emulator& e = emu();
  if (e.running) fail("kernel launched from inside a kernel");
  install_fault_report();
  e.kernel_name = name;
  const dim3 g = config.grid, b = config.block;
  const uint64_t threads = static_cast<uint64_t>(b.x) * b.y * b.z;
  if (threads == 0 || threads > 1024 || b.z > 64)
    fail(std::string(name) + ": invalid block of " + std::to_string(threads) + " threads");
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.y > 65535 || g.z > 65535)
    fail(std::string(name) + ": invalid grid (" + std::to_string(g.x) + ", " + std::to_string(g.y) +
         ", " + std::to_string(g.z) + ")");
  const size_t smem = config.dynamic_shared;
  if (smem > 48 * 1024 && static_cast<size_t>(e.allowed_dynamic_shared) < smem)
    fail(std::string(name) + ": " + std::to_string(smem) +
         " bytes of dynamic shared memory without cudaFuncAttributeMaxDynamicSharedMemorySize");
  e.shared.reserve(smem);
  ++e.stats.launches;
  e.body = &thread_body;
  e.error = nullptr;
  for (unsigned z = 0; z < g.z; ++z)
    for (unsigned y = 0; y < g.y; ++y)
      for (unsigned x = 0; x < g.x; ++x) {
        ++e.stats.blocks;
        ++e.block_serial;
        std::memset(e.shared.data(), 0xff, smem);  // unwritten shared memory reads as NaN
        prepare_fibers(static_cast<int>(threads));
        for (uint64_t t = 0; t < threads; ++t) {
          e.fibers[t].slot = static_cast<int>(t);
          ThreadIndex& ix = e.fibers[t].index;
          ix.thread_idx =
              uint3{static_cast<unsigned>(t % b.x), static_cast<unsigned>(t / b.x % b.y),
                    static_cast<unsigned>(t / (b.x * b.y))};
          ix.block_idx = uint3{x, y, z};
          ix.block_dim = b;
          ix.grid_dim = g;
        }
        try {
          run_block(static_cast<int>(threads));
        } catch (...) {
          abandon_fibers();
          e.body = nullptr;
          throw;
        }
      }
  e.body = nullptr;
}

void syncthreads() {
  Emulator& e = emu();
  Fiber& f = self();
  BlockState& b = e.block;
  if (++b.at_barrier < static_cast<int>(b.threads.size())) {
    wait_here(State::at_barrier);
    return;
  }
  // The last thread to arrive releases the others (exited threads never arrive: fail_stuck).
  b.at_barrier = 0;
  ++e.stats.barriers;
  for (Fiber* t : b.threads) {
    if (t == &f) continue;
    t->state = State::ready;
    b.ready.push_back(t);
  }
}

void* dynamic_shared() {
  self();
  return emu().shared.data();
}

bool static_shared(void* variable, size_t bytes) {
  Emulator& e = emu();
  uint64_t& poisoned_in = e.static_shared[variable];
  if (poisoned_in != e.block_serial) {
    poisoned_in = e.block_serial;
    std::memset(variable, 0xff, bytes);
  }
  return true;
}

void trap() {
  fail("__trap() in " + where(self()));
}

void warp_shuffle_xor(unsigned mask, const void* value, void* result, int bytes, int lane_mask,
                      int width) {
  check_full_mask(mask, "__shfl_xor_sync");
  if (width <= 0 || width > kWarp || (width & (width - 1)) != 0)
    fail("__shfl_xor_sync width must be a power of two up to 32");
  ShuffleIn in{};
  std::memcpy(in.bytes, value, static_cast<size_t>(bytes));
  in.size = bytes;
  in.lane_mask = lane_mask;
  in.width = width;
  warp_collective(WarpOp::shuffle, &in, result);
}

int any(unsigned mask, int predicate) {
  check_full_mask(mask, "__any_sync");
  int result = 0;
  warp_collective(WarpOp::any, &predicate, &result);
  return result;
}

void mma_m16n8k16(bool bf16, float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  MmaIn in{};
  in.bf16 = bf16;
  std::copy(a, a + 4, in.a);
  std::copy(b, b + 2, in.b);
  std::copy(c, c + 4, in.c);
  ++emu().stats.mma;
  warp_collective(WarpOp::mma, &in, c);
}

void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  warp_collective(WarpOp::ldmatrix, row, r, trans ? 1 : 0);
}

void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  Emulator& e = emu();
  Fiber& f = self();
  if (reinterpret_cast<uintptr_t>(dst) % static_cast<uintptr_t>(bytes) != 0 ||
      (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % static_cast<uintptr_t>(bytes) != 0))
    fail("cp.async of " + std::to_string(bytes) + " bytes from a misaligned address in " +
         where(f));
  if (!e.shared.contains(dst, static_cast<size_t>(bytes)))
    fail("cp.async destination outside the dynamic shared memory in " + where(f));
  ++e.stats.cp_async;
  if (e.options.cp_async == CpAsync::at_issue) {
    std::memcpy(dst, src, static_cast<size_t>(src_bytes));
    std::memset(static_cast<char*>(dst) + src_bytes, 0, static_cast<size_t>(bytes - src_bytes));
  } else {
    std::memset(dst, 0xff, static_cast<size_t>(bytes));
    f.copies.push_back({dst, src, bytes, src_bytes});
  }
}

void cp_async_wait_all() {
  Fiber& f = self();
  for (const PendingCopy& c : f.copies) {
    std::memcpy(c.dst, c.src, static_cast<size_t>(c.src_bytes));
    std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0,
                static_cast<size_t>(c.bytes - c.src_bytes));
  }
  f.copies.clear();
}

namespace {
std::atomic<size_t> shared_optin{163 * 1024};
}  // namespace

void set_shared_memory_per_block_optin(size_t bytes) {
  shared_optin.store(bytes);
}

size_t shared_memory_per_block_optin() {
  return shared_optin.load();
}

cudaError_t func_set_attribute(const void*, cudaFuncAttribute attribute, int value) {
  if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > shared_memory_per_block_optin())
      fail("kernel asks for " + std::to_string(value) +
           " bytes of dynamic shared memory; the device limit is " +
           std::to_string(shared_memory_per_block_optin()));
    emu().allowed_dynamic_shared = value;
  }
  return cudaSuccess;
}

}  // namespace simt
