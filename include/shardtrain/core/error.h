// Exception types. Every message says what was wrong and what the user can do about it; the CLI
// catches these at the top and exits non-zero with the message.
#pragma once
#include <stdexcept>
#include <string>

namespace shardtrain {

// Base of every shardtrain error.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad user input: a config key, a file, a command-line flag.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A tensor shape or dtype that an operation cannot accept.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// A malformed or inconsistent file (safetensors, HDF5, config.json).
class FormatError : public Error {
 public:
  using Error::Error;
};

// A device (or host pool) could not satisfy an allocation.
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(const std::string& message, long long requested_bytes)
      : Error(message), requested_bytes_(requested_bytes) {}
  long long requested_bytes() const { return requested_bytes_; }

 private:
  long long requested_bytes_;
};

// The host's physical memory cannot hold what a run needs: device-memory advice (the scale-up
// recipe, optimizer offload) does not apply, as offloading moves state into host memory.
class HostOutOfMemoryError : public OutOfMemoryError {
 public:
  using OutOfMemoryError::OutOfMemoryError;
};

// A failure of a communication layer (MPI, NCCL) or of another rank.
class DistributedError : public Error {
 public:
  using Error::Error;
};

}  // namespace shardtrain

// Throws ErrorType with a formatted message when cond is false. The message is built only on
// failure.
#define ST_CHECK_AS(ErrorType, cond, ...)                                    \
  do {                                                                       \
    if (!(cond)) throw ErrorType(::shardtrain::detail::concat(__VA_ARGS__)); \
  } while (0)
#define ST_CHECK(cond, ...) ST_CHECK_AS(::shardtrain::Error, cond, __VA_ARGS__)
#define ST_CHECK_SHAPE(cond, ...) ST_CHECK_AS(::shardtrain::ShapeError, cond, __VA_ARGS__)

#include <sstream>
namespace shardtrain::detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace shardtrain::detail
