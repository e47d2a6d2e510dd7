// shardtrain-adamw-bench: how fast the CPU AdamW kernels run, against the machine's memory
// bandwidth.
//
//   shardtrain-adamw-bench [--sizes 10M,100M] [--iters N] [--threads N] [--json PATH]
//
// AdamW with fp32 parameters, gradients and moments reads 16 bytes per parameter (p, g, m, v) and
// writes 12 (p, m, v): 28 B/param, so at best it runs at bandwidth / 28 parameters per second. The
// bandwidth is measured here with a STREAM-style triad (a[i] = b[i] + s * c[i], counted as 12 B per
// element like STREAM does, i.e. without the write-allocate read of a[]) at the same thread
// count, and each kernel's result is reported as a fraction of that bound. Every measurement is
// the median of `iters` runs after one warm-up run. The CPU backend's Backend::adamw (the
// on-device optimizer's kernel on the CPU device) and a whole OffloadedAdamW step on the CPU
// device are timed as well for comparison.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
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

constexpr double kAdamBytesPerParam = 28.0;  // reads p, g, m, v (16 B); writes p, m, v (12 B)
constexpr double kTriadBytesPerElement = 12.0;

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

// Median seconds of `iters` runs of fn after one warm-up run.
template <typename Fn>
double median_seconds(int iters, Fn&& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const Clock::time_point start = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Fills in parallel so that pages are first touched by the threads that will use them.
void fill(std::vector<float>& x, float base, int threads) {
  const int64_t n = static_cast<int64_t>(x.size());
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) x[i] = base + static_cast<float>(i % 1009) * 1e-4f;
}

double triad_gbps(int64_t n, int threads, int iters) {
  std::vector<float> a(n), b(n), c(n);
  fill(a, 0.0f, threads);
  fill(b, 1.0f, threads);
  fill(c, 2.0f, threads);
  const float s = 3.0f;
  float* ap = a.data();
  const float* bp = b.data();
  const float* cp = c.data();
  const double t = median_seconds(iters, [&] {
#pragma omp parallel for simd schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) ap[i] = bp[i] + s * cp[i];
  });
  if (a[static_cast<size_t>(n / 2)] < 0) std::puts("");  // keep the loop's result alive
  return kTriadBytesPerElement * static_cast<double>(n) / t / 1e9;
}

struct Row {
  std::string kernel;
  int64_t params = 0;
  int threads = 1;
  double seconds = 0, params_per_s = 0, gbps = 0, triad_gbps = 0;
};

void print_row(const Row& r) {
  std::printf("| %-22s | %5lldM | %7d | %9.2f | %10.1f | %6.1f | %11.1f | %4.0f%% |\n",
              r.kernel.c_str(), static_cast<long long>(r.params / 1'000'000), r.threads,
              r.seconds * 1e3, r.params_per_s / 1e6, r.gbps, r.triad_gbps,
              100.0 * r.gbps / r.triad_gbps);
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
        "CPU AdamW, fp32 p/g/m/v: 28 B/param moved (16 read + 12 written); the bound is "
        "triad bandwidth / 28.\n");
    std::printf("best kernel here: %s; OpenMP threads: %d\n\n",
                std::string(optim::cpu_adam_kernel_name(optim::cpu_adam_best_kernel())).c_str(),
                all);
    std::printf("| %-22s | %6s | %7s | %9s | %10s | %6s | %11s | %5s |\n", "kernel", "params",
                "threads", "ms/step", "Mparam/s", "GB/s", "triad GB/s", "bound");
    std::printf(
        "|%s|%s|%s|%s|%s|%s|%s|%s|\n", std::string(24, '-').c_str(), std::string(8, '-').c_str(),
        std::string(9, '-').c_str(), std::string(11, '-').c_str(), std::string(12, '-').c_str(),
        std::string(8, '-').c_str(), std::string(13, '-').c_str(), std::string(7, '-').c_str());
    std::vector<Row> rows;
    for (int64_t n : o.sizes) {
      for (int threads : thread_counts) {
        const double triad = triad_gbps(n, threads, o.iters);
        std::vector<float> p(n), g(n), m(n), v(n);
        fill(p, 0.5f, threads);
        fill(g, 1e-3f, threads);
        fill(m, 1e-4f, threads);
        fill(v, 1e-6f, threads);
        auto record = [&](const std::string& name, double seconds) {
          Row r;
          r.kernel = name;
          r.params = n;
          r.threads = threads;
          r.seconds = seconds;
          r.params_per_s = static_cast<double>(n) / seconds;
          r.gbps = kAdamBytesPerParam * r.params_per_s / 1e9;
          r.triad_gbps = triad;
          print_row(r);
          rows.push_back(r);
        };
        for (optim::CpuAdamKernel k : {optim::CpuAdamKernel::Scalar, optim::CpuAdamKernel::Avx2,
                                       optim::CpuAdamKernel::Avx512}) {
          if (!optim::cpu_adam_kernel_supported(k)) continue;
          record(std::string(optim::cpu_adam_kernel_name(k)), median_seconds(o.iters, [&] {
                   optim::cpu_adamw(p.data(), g.data(), DType::F32, m.data(), v.data(), n, args,
                                    {k, threads});
                 }));
        }
        {
          // The CPU backend's kernel (OpenMP threads as set here) on CPU-device tensors.
          omp_set_num_threads(threads);
          Tensor tp = from_buffer(p.data(), {n}, DType::F32),
                 tg = from_buffer(g.data(), {n}, DType::F32);
          Tensor tm = from_buffer(m.data(), {n}, DType::F32),
                 tv = from_buffer(v.data(), {n}, DType::F32);
          Backend& cpu = backend_for(Device::cpu());
          record("cpu backend adamw",
                 median_seconds(o.iters, [&] { cpu.adamw(tp, tg, tm, tv, args); }));
          // A whole offloaded step on the CPU device: gradient to the host pool, update, weights
          // back (the "copies" are memcpys on the pipeline's copy threads).
          std::vector<optim::NamedParam> named = {{"w", &tp}};
          optim::OffloadOptions offload;
          offload.cpu.threads = threads;
          optim::OffloadedAdamW offloaded(named, {}, offload);
          autograd::set_grad(tp, tg);
          record("OffloadedAdamW step", median_seconds(o.iters, [&] { offloaded.step(1e-3f); }));
          omp_set_num_threads(all);
        }
      }
    }
    if (!o.json.empty()) {
      nlohmann::json j = nlohmann::json::array();
      for (const Row& r : rows)
        j.push_back({{"kernel", r.kernel},
                     {"params", r.params},
                     {"threads", r.threads},
                     {"seconds", r.seconds},
                     {"params_per_s", r.params_per_s},
                     {"gbps", r.gbps},
                     {"triad_gbps", r.triad_gbps},
                     {"fraction_of_bound", r.gbps / r.triad_gbps}});
      std::ofstream(o.json) << j.dump(2) << "\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardtrain-adamw-bench: %s\n", e.what());
    return 1;
  }
}
