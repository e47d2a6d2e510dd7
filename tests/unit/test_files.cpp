// Output files are written whole or not at all, and input files must be regular files.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "expect_error.h"
#include "files.h"
#include "shardtrain/core/child_process.h"
#include "shardtrain/core/error.h"
#include "shardtrain/core/files.h"
#include "temp_dir.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;
using testing::expect_error;
using testing::TempDir;

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// The names in `dir`, so a test can see that no temporary file was left behind.
std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(AtomicFileWriter, CommitReplacesTheFileAndLeavesNoTemporary) {
  TempDir dir;
  const std::string path = dir.write("out.txt", "old contents");
  write_file_atomically(path, "new");
  EXPECT_EQ(read_all(path), "new");
  EXPECT_EQ(names_in(dir.str()), std::vector<std::string>{"out.txt"});
}

TEST(AtomicFileWriter, DroppedWithoutCommitLeavesTheEarlierFileAndNoTemporary) {
  TempDir dir;
  const std::string path = dir.write("out.txt", "old contents");
  {
    AtomicFileWriter out(path);
    out.write("partial", 7);
    EXPECT_TRUE(fs::exists(out.temporary_path()));
    EXPECT_EQ(read_all(path), "old contents");
  }
  EXPECT_EQ(read_all(path), "old contents");
  EXPECT_EQ(names_in(dir.str()), std::vector<std::string>{"out.txt"});
}

TEST(AtomicFileWriter, PartsWrittenOutOfOrderLandWhereTheyBelong) {
  TempDir dir;
  const std::string path = dir / "out.bin";
  AtomicFileWriter out(path);
  out.write("head", 4);        // 0..4
  out.write_at(8, "tail", 4);  // 8..12, leaving a gap
  out.write_at(4, "mid.", 4);  // fills the gap
  out.commit();
  EXPECT_EQ(read_all(path), "headmid.tail");
}

TEST(AtomicFileWriter, AFailureNamesThePathTheReasonAndTheAdvice) {
  TempDir dir;
  // The directory the file would go in does not exist.
  const std::string path = dir / "missing/out.txt";
  expect_error<Error>(
      [&] { write_file_atomically(path, "x", "choose a writable directory"); },
      {"cannot write " + path + " (No such file or directory)", ": choose a writable directory"});
  // A directory where the file should be: the rename over it fails, and the earlier directory
  // and no temporary are left.
  fs::create_directories(dir / "taken");
  expect_error<Error>([&] { write_file_atomically(dir / "taken", "x"); },
                      {"cannot write " + (dir / "taken") + " ("});
  EXPECT_TRUE(fs::is_directory(dir / "taken"));
  EXPECT_EQ(names_in(dir.str()), std::vector<std::string>{"taken"});
}

// What a writer killed before its rename leaves: `<name>.tmp.<pid>` regular files, this
// process's own excepted, for one name or any; nothing else that looks like them.
TEST(LeftoverTemporaries, FindsKilledWritersFilesByNameAndPid) {
  TempDir tmp("leftovers");
  auto make = [&](const std::string& name, size_t bytes) {
    std::ofstream(tmp / name, std::ios::binary) << std::string(bytes, 'x');
  };
  make("data.h5.tmp.123", 1000);
  make("data.h5.tmp." + std::to_string(::getpid()), 10);  // this process's: in use
  make("data.h5", 5);
  make("data.h5.tmp.12x", 5);
  make("data.h5.tmp.", 5);
  make("model.safetensors.tmp.77", 30);
  make("data.h5x.tmp.9", 5);
  fs::create_directory(tmp / "dir.tmp.5");
  auto paths = [](const std::vector<LeftoverTemporary>& found) {
    std::vector<std::string> names;
    for (const LeftoverTemporary& f : found)
      names.push_back(fs::path(f.path).filename().string() + " " + std::to_string(f.pid) + " " +
                      std::to_string(f.bytes));
    return names;
  };
  EXPECT_EQ(paths(leftover_temporaries(tmp.path.string(), "data.h5")),
            std::vector<std::string>{"data.h5.tmp.123 123 1000"});
  EXPECT_EQ(paths(leftover_temporaries(tmp.path.string())),
            (std::vector<std::string>{"data.h5.tmp.123 123 1000", "data.h5x.tmp.9 9 5",
                                      "model.safetensors.tmp.77 77 30"}));
  EXPECT_TRUE(leftover_temporaries(tmp / "missing").empty());

  EXPECT_TRUE(process_runs_here(::getpid()));
  EXPECT_TRUE(process_runs_here(1));  // init: another user's process, still running
  EXPECT_FALSE(process_runs_here(testing::pid_of_no_process()));
  EXPECT_FALSE(process_runs_here(0));
  EXPECT_FALSE(process_runs_here(int64_t{1} << 40));
}

TEST(CheckRegularFile, RefusesAFifoAndADirectoryButNotAFileOrAMissingPath) {
  TempDir dir;
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  expect_error<ConfigError>([&] { check_regular_file(dir / "fifo", "data.path"); },
                            {"data.path '" + (dir / "fifo") + "' is not a regular file"});
  expect_error<ConfigError>([&] { check_regular_file(dir.str(), "data.path"); },
                            {"is not a regular file"});
  EXPECT_NO_THROW(check_regular_file(dir.write("file", "x"), "data.path"));
  EXPECT_NO_THROW(check_regular_file(dir / "missing", "data.path"));
}

// Work that may crash its process (HDF5 parsing unchecked metadata) runs in a child: the parent
// learns how it ended, and nothing the child does reaches the parent.
TEST(ChildProcess, ACrashIsReportedAndTheParentGoesOn) {
  using Ended = ChildOutcome::Ended;
  int touched = 0;
  ChildOutcome crash = run_in_child_process(
      [&] {
        touched = 1;
        raise(SIGSEGV);
      },
      std::chrono::seconds(30));
  EXPECT_TRUE(crash.crashed());
  EXPECT_EQ(crash.ended, Ended::Signalled);
  EXPECT_EQ(crash.code, SIGSEGV);
  EXPECT_EQ(touched, 0);  // the child's memory is its own

  ChildOutcome fine = run_in_child_process([] {}, std::chrono::seconds(30));
  EXPECT_EQ(fine.ended, Ended::Exited);
  EXPECT_EQ(fine.code, 0);
  EXPECT_FALSE(fine.crashed());

  ChildOutcome threw =
      run_in_child_process([] { throw FormatError("damaged"); }, std::chrono::seconds(30));
  EXPECT_EQ(threw.ended, Ended::Exited);
  EXPECT_EQ(threw.code, 1);

  const auto start = std::chrono::steady_clock::now();
  ChildOutcome stuck =
      run_in_child_process([] { std::this_thread::sleep_for(std::chrono::seconds(60)); },
                           std::chrono::milliseconds(200));
  EXPECT_EQ(stuck.ended, Ended::TimedOut);
  EXPECT_FALSE(stuck.crashed());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

}  // namespace
}  // namespace shardtrain
