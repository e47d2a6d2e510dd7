// Output files are written whole or not at all, and input files must be regular files.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "expect_error.h"
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

}  // namespace
}  // namespace shardtrain
