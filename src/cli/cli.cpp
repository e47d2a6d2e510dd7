#include "shardtrain/cli/cli.h"

#include <unistd.h>
#include <algorithm>
#include <chrono>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <new>
#include <thread>

#include "shardtrain/backend/cpu_threads.h"
#include "shardtrain/cli/command.h"
#include "shardtrain/core/suggest.h"
#include "shardtrain/dist/env.h"

namespace shardtrain::cli {

// Each subcommand lives in its own file in this folder; adding one means writing that file and
// adding its line here (and to the list below, in the order --help shows them).
Command config_command();
Command prepare_data_command();
Command train_command();
Command check_command();
Command bench_command();
Command plan_command();
Command quantize_command();

const std::vector<Command>& commands() {
  static const std::vector<Command> all = {
      train_command(),  check_command(),        bench_command(),    plan_command(),
      config_command(), prepare_data_command(), quantize_command(),
  };
  return all;
}

namespace {

std::string overview() {
  std::string out =
      "usage: shardtrain <command> [flags]\n\n"
      "Train transformer language models with sharded data parallelism, activation\n"
      "checkpointing/offload, mixed precision and QLoRA.\n\ncommands:\n";
  size_t width = 0;
  for (const Command& c : commands()) width = std::max(width, c.name.size());
  for (const Command& c : commands())
    out += "  " + c.name + std::string(width - c.name.size() + 2, ' ') + c.summary + "\n";
  out += "\nRun 'shardtrain <command> --help' for a command's flags.\n";
  return out;
}

const Command* find_command(const std::string& name) {
  for (const Command& c : commands())
    if (c.name == name) return &c;
  return nullptr;
}

[[noreturn]] void unknown_command(const std::string& name) {
  std::vector<std::string> names;
  for (const Command& c : commands()) names.push_back(c.name);
  std::string message = "unknown command '" + name + "'";
  std::string near = closest_match(name, names);
  if (!near.empty()) message += ": did you mean '" + near + "'?";
  throw UsageError(message);
}

bool asks_for_help(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--") return false;
    if (a == "-h" || a == "--help") return true;
  }
  return false;
}

// OpenMP starts OMP_NUM_THREADS threads per process at the first parallel region, and sizes
// per-thread scratch (the CPU attention's) by it: far past the CPUs it only slows every step,
// and tens of thousands make libgomp fail to create them or crash. Caught before any work.
void check_openmp_threads() {
  const char* value = std::getenv("OMP_NUM_THREADS");
  if (value == nullptr || *value == '\0') return;
  char* end = nullptr;
  const long threads = std::strtol(value, &end, 10);  // "8" or a nested list "8,2": the first
  if (end == value) return;                           // OpenMP itself reports what it cannot read
  const long cpus = std::max(1u, std::thread::hardware_concurrency());
  const long most = std::max(64L, 16 * cpus);
  if (threads <= most) return;
  throw ConfigError("OMP_NUM_THREADS=" + std::string(value) + " asks for " +
                    std::to_string(threads) + " CPU threads per process on a machine with " +
                    std::to_string(cpus) + " CPU(s); past " + std::to_string(most) +
                    " they only slow the run, or fail to start: set OMP_NUM_THREADS to at most " +
                    std::to_string(cpus) +
                    " (divided by the ranks per node under mpirun), or "
                    "unset it");
}

// Several ranks on one node, OMP_NUM_THREADS unset: each takes its share of the CPUs instead of
// a thread per CPU (cpu_threads.h), and rank 0 says so, since it changes the speed of CPU work.
void share_cpus_with_local_ranks() {
  const dist::LaunchInfo launch = dist::detect_launch();
  const CpuThreadShare share = share_cpu_threads(launch.local_size);
  if (!share.changed || launch.rank != 0) return;
  std::cerr << "note: OMP_NUM_THREADS is unset and " << launch.local_size
            << " ranks share this node's " << share.node_cpus << " CPUs: each rank uses "
            << share.threads << (share.threads == 1 ? " OpenMP thread" : " OpenMP threads")
            << " (set OMP_NUM_THREADS to choose)\n";
}

// Under mpirun one failing rank must end the whole job: the others may be blocked in a
// collective it will never join. Every rank usually fails alike (a refused configuration), and
// rank 0, unwinding, takes back the directories the run created: the other ranks give it a
// moment before they end the job, so that an abort from one of them does not kill rank 0
// half-way (a refused run would leave its empty directories). Rank 0 ends the job at once.
// The others print their message only once that moment has passed: when rank 0 failed alike,
// its abort has ended them by then, and the job shows the message once, not once a rank.
[[noreturn]] void end_job(const std::string& message, int exit_code) {
  const int rank = dist::job_rank();
  if (rank == 0) dist::abort_job(message, exit_code);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  std::fprintf(stderr, "rank %d: %s\n", rank, message.c_str());
  std::fflush(stderr);
  dist::abort_job("ending the job", exit_code);
}

}  // namespace

int run(const std::vector<std::string>& args) {
  std::string hint = "run 'shardtrain --help' for usage";
  try {
    if (args.empty()) {
      std::cerr << overview();
      return 2;
    }
    const std::string& first = args[0];
    if (first == "-h" || first == "--help" || first == "help") {
      if (first == "help" && args.size() > 1) {
        const Command* c = find_command(args[1]);
        if (!c) unknown_command(args[1]);
        std::cout << command_help(*c);
      } else {
        std::cout << overview();
      }
      return 0;
    }
    if (first.rfind("-", 0) == 0)
      throw UsageError("unknown option '" + first + "': give a command first");
    const Command* command = find_command(first);
    if (!command) unknown_command(first);
    hint = "run 'shardtrain " + command->name + " --help' for usage";

    std::vector<std::string> rest(args.begin() + 1, args.end());
    if (asks_for_help(rest)) {
      std::cout << command_help(*command);
      return 0;
    }
    check_openmp_threads();
    share_cpus_with_local_ranks();
    Args parsed = parse_args(*command, rest);
    int code = command->run(parsed);
    std::cout.flush();
    return code;
  } catch (const UsageError& e) {
    // Every rank of a job usually has the same command line: rank 0 speaks for them. A rank
    // whose line alone is wrong (a wrapper script that adds flags to some ranks) says so itself
    // once rank 0, failing alike, would have ended the job (end_job).
    if (dist::job_rank() != 0 && dist::job_world_size() > 1)
      end_job(std::string("error: ") + e.what() + " (" + hint + ")", 2);
    std::cerr << "error: " << e.what() << "\n" << hint << "\n";
    return 2;
  } catch (const Error& e) {
    if (dist::job_world_size() > 1) end_job(std::string("error: ") + e.what(), 1);
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    // The host refused memory outside the allocators' ledgers (a model too large to build, a
    // buffer sized from a huge config value): a resource problem, not a defect.
    const std::string message =
        "error: out of host memory (the C++ runtime could not allocate): the configuration "
        "needs more memory than this machine has; `shardtrain plan --config ...` predicts what it "
        "needs and which scale-up recipe step fits";
    if (dist::job_world_size() > 1) end_job(message, 1);
    std::cerr << message << "\n";
    return 1;
  } catch (const std::exception& e) {
    if (dist::job_world_size() > 1) end_job(std::string("internal error: ") + e.what(), 3);
    std::cerr << "internal error: " << e.what() << "\n";
    return 3;
  } catch (...) {
    const std::string message =
        "internal error: an exception of unknown type; this is a defect: please report it with "
        "the command and config that gave it";
    if (dist::job_world_size() > 1) end_job(message, 3);
    std::cerr << message << "\n";
    return 3;
  }
}

namespace {

// A memory-mapped file cut short under the process (a token dataset truncated in place) faults
// with SIGBUS when its missing pages are read: say so before the signal ends the process.
void on_bus_error(int signal) {
  static const char kMessage[] =
      "error: bus error (SIGBUS): a memory-mapped file, most likely the token dataset of "
      "data.path, was truncated or written over while this process read it; put it back and "
      "continue from the last checkpoint with train.resume=auto\n";
  const ssize_t written = ::write(STDERR_FILENO, kMessage, sizeof kMessage - 1);
  (void)written;  // nothing more can be done about a failed write here
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

}  // namespace

int main(int argc, char** argv) {
  // Past a file-size limit (ulimit -f, a batch system's) a write fails with EFBIG, which every
  // writer turns into a message naming the file; the default SIGXFSZ would kill the process
  // without a word and leave its temporary files behind.
  std::signal(SIGXFSZ, SIG_IGN);
  // Output piped into `tee` or `head`: when the reader goes first (Ctrl-C reaches the whole
  // pipeline, `head` has its lines), the default SIGPIPE would kill the run before its stop
  // checkpoint. Ignored, the write fails instead, and the progress lines go nowhere while the
  // run stops or finishes as it would have.
  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGBUS, on_bus_error);
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  return run(args);
}

}  // namespace shardtrain::cli
