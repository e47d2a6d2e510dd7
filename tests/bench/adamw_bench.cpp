// shardtrain-adamw-bench: how fast the CPU AdamW kernels run, against the machine's memory
// bandwidth.
//
//   shardtrain-adamw-bench [--sizes 10M,100M] [--iters N] [--threads N] [--json PATH]
//
// AdamW with fp32 parameters, gradients and moments reads 16 bytes per parameter (p, g, m, v) and
// writes 12 (p, m, v back in place): 28 B/param, so at best it runs at bandwidth / 28 parameters
// per second. Two bandwidths are measured at the same size and thread count:
//  - STREAM triad, a[i] = b[i] + s * c[i], counted as STREAM counts it (12 B per element, not
//    counting the read that allocates a[]'s lines before they are written);
//  - the AdamW access pattern with trivial arithmetic (p = p*a + g, m = m*b + g, v = v*c + g, in
//    place: 28 B per element). This is the bound: no AdamW can move its bytes faster. In-place
//    updates need no write-allocate reads, so this is usually above the triad figure.
// Each bandwidth is the best of its loop compiled for the baseline, AVX2 and AVX-512 (whichever
// the CPU has).
// Every figure is the best of `iters` runs after one warm-up run (STREAM's convention: the least
// disturbed run), the runs of all kernels and both bandwidths interleaved. The CPU backend's
// Backend::adamw (the on-device optimizer's kernel on the CPU device) and a whole OffloadedAdamW
// step on the CPU device are timed as well.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardtrain/autograd/node.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/core/error.h"
#include "shardtrain/optim/cpu_adam.h"
#include "shardtrain/optim/offload.h"

namespace {

using namespace shardtrain;
using Clock = std::chrono::steady_clock;

constexpr double kAdamBytesPerParam = 28.0;     // reads p, g, m, v (16 B); writes p, m, v (12 B)
constexpr double kTriadBytesPerElement = 12.0;  // STREAM's count

struct Options {
  std::vector<int64_t> sizes = {10'000'000, 100'000'000};
  int iters = 5;
  int max_threads = 0;  // 0 = OpenMP's default
  std::string json;
};

int64_t parse_count(const std::string& text) {
  std::size_t used = 0;
  double value = std::stod(text, &used);
  std::string suffix = text.substr(used);
  if (suffix == "K" || suffix == "k")
    value *= 1e3;
  else if (suffix == "M" || suffix == "m")
    value *= 1e6;
  else if (suffix == "G" || suffix == "g")
    value *= 1e9;
  else if (!suffix.empty())
    throw ConfigError("--sizes: '" + text + "' is not a count (e.g. 10M, 100M, 2500000)");
  if (value < 1) throw ConfigError("--sizes: '" + text + "' must be at least 1");
  return static_cast<int64_t>(value);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw ConfigError(a + " needs a value");
      return argv[++i];
    };
    if (a == "--sizes") {
      o.sizes.clear();
      std::string list = value();
      for (std::size_t start = 0; start <= list.size();) {
        std::size_t comma = list.find(',', start);
        if (comma == std::string::npos) comma = list.size();
        o.sizes.push_back(parse_count(list.substr(start, comma - start)));
        start = comma + 1;
      }
    } else if (a == "--iters") {
      o.iters = std::max(1, std::stoi(value()));
    } else if (a == "--threads") {
      o.max_threads = std::max(1, std::stoi(value()));
    } else if (a == "--json") {
      o.json = value();
    } else if (a == "--help" || a == "-h") {
      std::cout << "usage: shardtrain-adamw-bench [--sizes 10M,100M] [--iters N] [--threads N] "
                   "[--json PATH]\n";
      std::exit(0);
    } else {
      throw ConfigError("unknown argument '" + a + "' (see --help)");
    }
  }
  return o;
}

// Runs every timed function once to warm up, then `iters` rounds that each run every function
// once, and returns each one's best (least) seconds. Interleaving the rounds exposes every
// measurement, the bandwidth bounds included, to the same disturbances from other processes.
std::vector<double> best_seconds_interleaved(int iters,
                                             const std::vector<std::function<void()>>& fns) {
  std::vector<double> best(fns.size(), 1e300);
  for (const auto& fn : fns) fn();
  for (int round = 0; round < iters; ++round) {
    for (size_t i = 0; i < fns.size(); ++i) {
      const Clock::time_point start = Clock::now();
      fns[i]();
      best[i] = std::min(best[i], std::chrono::duration<double>(Clock::now() - start).count());
    }
  }
  return best;
}

// A CPU-device tensor over memory the caller owns (no copy, not counted).
Tensor borrow(std::vector<float>& x) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>();
  impl->storage->data = DataPtr::borrowed(x.data(), x.size() * sizeof(float), Device::cpu());
  impl->shape = {static_cast<int64_t>(x.size())};
  impl->dtype = DType::F32;
  return Tensor(impl);
}

// The bandwidth loops in three instruction sets: on one core the widest one usually moves the
// most bytes (fewer instructions per cache line keep more misses in flight), and a bound must be
// the best the machine can do.
#define ST_TRIAD_LOOP                                                                            \
  _Pragma("omp parallel for simd schedule(static) num_threads(threads)") for (int64_t i = 0;     \
                                                                              i < n; ++i) a[i] = \
      b[i] + 3.0f * c[i];
#define ST_ADAM_STREAMS_LOOP                                                                 \
  _Pragma("omp parallel for simd schedule(static) num_threads(threads)") for (int64_t i = 0; \
                                                                              i < n; ++i) {  \
    p[i] = p[i] * 0.999f + g[i];                                                             \
    m[i] = m[i] * 0.9f + g[i];                                                               \
    v[i] = v[i] * 0.95f + g[i];                                                              \
  }

void triad_base(float* a, const float* b, const float* c, int64_t n, int threads) {
  ST_TRIAD_LOOP
}
__attribute__((target("avx2"))) void triad_avx2(float* a, const float* b, const float* c, int64_t n,
                                                int threads) {
  ST_TRIAD_LOOP
}
__attribute__((target("avx512f"))) void triad_avx512(float* a, const float* b, const float* c,
                                                     int64_t n, int threads) {
  ST_TRIAD_LOOP
}
// AdamW's streams (read p, g, m, v; write p, m, v in place) with a multiply-add each.
void adam_streams_base(float* p, const float* g, float* m, float* v, int64_t n, int threads) {
  ST_ADAM_STREAMS_LOOP
}
__attribute__((target("avx2"))) void adam_streams_avx2(float* p, const float* g, float* m, float* v,
                                                       int64_t n, int threads) {
  ST_ADAM_STREAMS_LOOP
}
__attribute__((target("avx512f"))) void adam_streams_avx512(float* p, const float* g, float* m,
                                                            float* v, int64_t n, int threads) {
  ST_ADAM_STREAMS_LOOP
}

// Fills in parallel so that pages are first touched by the threads that will use them.
void fill(std::vector<float>& x, float base, int threads) {
  const int64_t n = static_cast<int64_t>(x.size());
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) x[i] = base + static_cast<float>(i % 1009) * 1e-4f;
}

struct Row {
  std::string kernel;
  int64_t params = 0;
  int threads = 1;
  double seconds = 0, params_per_s = 0, gbps = 0;
  double bound_gbps = 0, triad_gbps = 0;  // of this size and thread count
};

struct OffloadRow {
  int64_t params = 0;
  int threads = 1;
  optim::OffloadStepStats stats;
};

void print_row(const Row& r) {
  std::printf("| %-19s | %5lldM | %7d | %8.2f | %8.0f | %6.1f | %4.0f%% | %11.1f | %10.1f |\n",
              r.kernel.c_str(), static_cast<long long>(r.params / 1'000'000), r.threads,
              r.seconds * 1e3, r.params_per_s / 1e6, r.gbps, 100.0 * r.gbps / r.bound_gbps,
              r.bound_gbps, r.triad_gbps);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    const int all = o.max_threads > 0 ? o.max_threads : omp_get_max_threads();
    std::vector<int> thread_counts = {1};
    if (all > 1) thread_counts.push_back(all);
    const Backend::AdamWArgs args{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3};

    std::printf(
        "CPU AdamW with fp32 p/g/m/v moves 28 B/param (16 read + 12 written). bound = the same "
        "streams with trivial arithmetic; triad = STREAM triad (12 B/element). Best of %d runs.\n",
        o.iters);
    std::printf("best kernel here: %s; OpenMP threads: %d\n\n",
                std::string(optim::cpu_adam_kernel_name(optim::cpu_adam_best_kernel())).c_str(),
                all);
    std::printf("| %-19s | %6s | %7s | %8s | %8s | %6s | %5s | %11s | %10s |\n", "kernel", "params",
                "threads", "ms/step", "Mparam/s", "GB/s", "bound", "bound GB/s", "triad GB/s");
    std::printf(
        "|---------------------|--------|---------|----------|----------|--------|-------|"
        "-------------|------------|\n");
    std::vector<Row> rows;
    std::vector<OffloadRow> offload_rows;
    for (int64_t n : o.sizes) {
      std::vector<float> a(n), b(n), c(n), p(n), g(n), m(n), v(n);
      for (int threads : thread_counts) {
        fill(a, 0.0f, threads);
        fill(b, 1.0f, threads);
        fill(c, 2.0f, threads);
        fill(p, 0.5f, threads);
        fill(g, 1e-3f, threads);
        fill(m, 1e-4f, threads);
        fill(v, 1e-6f, threads);
        float *ap = a.data(), *pp = p.data(), *mp = m.data(), *vp = v.data();
        const float *bp = b.data(), *cp = c.data(), *gp = g.data();
        // The bandwidth measurements first: triads, then AdamW's streams, one per instruction set.
        std::vector<std::string> names;
        std::vector<std::function<void()>> fns;
        const bool avx2 = __builtin_cpu_supports("avx2"),
                   avx512 = __builtin_cpu_supports("avx512f");
        fns.push_back([=] { triad_base(ap, bp, cp, n, threads); });
        if (avx2) fns.push_back([=] { triad_avx2(ap, bp, cp, n, threads); });
        if (avx512) fns.push_back([=] { triad_avx512(ap, bp, cp, n, threads); });
        const size_t triads = fns.size();
        fns.push_back([=] { adam_streams_base(pp, gp, mp, vp, n, threads); });
        if (avx2) fns.push_back([=] { adam_streams_avx2(pp, gp, mp, vp, n, threads); });
        if (avx512) fns.push_back([=] { adam_streams_avx512(pp, gp, mp, vp, n, threads); });
        const size_t bandwidths = fns.size();
        names.resize(bandwidths);
        for (optim::CpuAdamKernel k : {optim::CpuAdamKernel::Scalar, optim::CpuAdamKernel::Avx2,
                                       optim::CpuAdamKernel::Avx512}) {
          if (!optim::cpu_adam_kernel_supported(k)) continue;
          names.emplace_back(optim::cpu_adam_kernel_name(k));
          fns.push_back([=, &args] {
            optim::cpu_adamw(pp, gp, DType::F32, mp, vp, n, args, {k, threads});
          });
        }
        // The CPU backend's kernel (with this many OpenMP threads) on the same memory.
        Tensor tp = borrow(p), tg = borrow(g), tm = borrow(m), tv = borrow(v);
        Backend& cpu = backend_for(Device::cpu());
        names.emplace_back("cpu backend adamw");
        fns.push_back([&, threads] {
          omp_set_num_threads(threads);
          cpu.adamw(tp, tg, tm, tv, args);
          omp_set_num_threads(all);
        });
        // A whole offloaded step on the CPU device: gradient to the host pool, update, weights
        // back (the "copies" are memcpys on the pipeline's copy threads).
        std::vector<optim::NamedParam> named = {{"w", &tp}};
        optim::OffloadOptions offload;
        offload.cpu.threads = threads;
        optim::OffloadedAdamW offloaded(named, {}, offload);
        autograd::set_grad(tp, tg);
        names.emplace_back("OffloadedAdamW step");
        fns.push_back([&] { offloaded.step(1e-3f); });
        OffloadRow breakdown;

        const std::vector<double> t = best_seconds_interleaved(o.iters, fns);
        const double fastest_triad = *std::min_element(t.begin(), t.begin() + triads);
        const double fastest_streams =
            *std::min_element(t.begin() + triads, t.begin() + bandwidths);
        const double triad = kTriadBytesPerElement * static_cast<double>(n) / fastest_triad / 1e9;
        const double bound = kAdamBytesPerParam * static_cast<double>(n) / fastest_streams / 1e9;
        for (size_t i = bandwidths; i < fns.size(); ++i) {
          Row r;
          r.kernel = names[i];
          r.params = n;
          r.threads = threads;
          r.seconds = t[i];
          r.params_per_s = static_cast<double>(n) / t[i];
          r.gbps = kAdamBytesPerParam * r.params_per_s / 1e9;
          r.bound_gbps = bound;
          r.triad_gbps = triad;
          print_row(r);
          rows.push_back(r);
        }
        breakdown.params = n;
        breakdown.threads = threads;
        breakdown.stats = offloaded.last_step_stats();
        offload_rows.push_back(breakdown);
      }
    }
    std::printf(
        "\nOffloadedAdamW, last step: busy seconds of each pipeline stage (they overlap)\n\n");
    std::printf("| params | threads | wall ms | download ms | update ms | upload ms | pieces |\n");
    std::printf("|--------|---------|---------|-------------|-----------|-----------|--------|\n");
    for (const OffloadRow& r : offload_rows)
      std::printf("| %5lldM | %7d | %7.1f | %11.1f | %9.1f | %9.1f | %6lld |\n",
                  static_cast<long long>(r.params / 1'000'000), r.threads,
                  r.stats.wall_seconds * 1e3, r.stats.download_seconds * 1e3,
                  r.stats.update_seconds * 1e3, r.stats.upload_seconds * 1e3,
                  static_cast<long long>(r.stats.pieces));
    if (!o.json.empty()) {
      nlohmann::json j = nlohmann::json::array();
      for (const Row& r : rows)
        j.push_back({{"kernel", r.kernel},
                     {"params", r.params},
                     {"threads", r.threads},
                     {"seconds", r.seconds},
                     {"params_per_s", r.params_per_s},
                     {"gbps", r.gbps},
                     {"bound_gbps", r.bound_gbps},
                     {"triad_gbps", r.triad_gbps},
                     {"fraction_of_bound", r.gbps / r.bound_gbps}});
      std::ofstream(o.json) << j.dump(2) << "\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardtrain-adamw-bench: %s\n", e.what());
    return 1;
  }
}
