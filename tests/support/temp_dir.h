// A fresh temporary directory for one test, removed with everything in it when it goes away.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

namespace shardtrain::testing {

class TempDir {
 public:
  // `tag` names the directory (with the process id and a counter, so parallel tests and
  // several directories in one test never collide).
  explicit TempDir(const std::string& tag = "test") {
    static int counter = 0;
    path =
        std::filesystem::temp_directory_path() /
        ("shardtrain-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // The path of `name` inside the directory.
  std::string str(const std::string& name = "") const { return (path / name).string(); }
  std::string operator/(const std::string& name) const { return str(name); }
  // Writes `text` to `name` and returns its path.
  std::string write(const std::string& name, const std::string& text) const {
    std::string p = str(name);
    std::ofstream(p) << text;
    return p;
  }

  std::filesystem::path path;
};

}  // namespace shardtrain::testing
