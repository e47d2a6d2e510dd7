// Reading and writing safetensors files (the Hugging Face weight format), single or sharded.
//
// Layout of a file: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor
// name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data section
// that follows the header) plus an optional "__metadata__" string->string map, then the data.
// Files are read memory-mapped, so opening a multi-gigabyte checkpoint costs nothing until a
// tensor is loaded. Every malformed input raises FormatError naming the file and the tensor.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardtrain/core/device.h"
#include "shardtrain/core/dtype.h"
#include "shardtrain/core/shape.h"
#include "shardtrain/tensor/tensor.h"

namespace shardtrain {

// "F32", "BF16", ... as written in safetensors headers; throws FormatError for other names.
std::string_view safetensors_dtype_name(DType dtype);

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  int64_t data_begin = 0;  // byte offsets into the data section
  int64_t data_end = 0;
  int64_t nbytes() const { return data_end - data_begin; }
};

class MappedFile;  // read-only memory mapping (defined in the source)

class SafetensorsFile {
 public:
  // Maps and validates the file; throws ConfigError when it cannot be opened and FormatError when
  // its header is malformed.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  // Throws FormatError listing a few available names when `name` is absent.
  const TensorInfo& info(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Copies a tensor into a new allocation on `device`, counted under the current CategoryScope,
  // converting to `convert_to` when given.
  Tensor load(const std::string& name, Device device = Device::cpu(),
              std::optional<DType> convert_to = std::nullopt) const;
  // Copies into an existing tensor (any device, converting dtype); its shape must match the file.
  void load_into(const std::string& name, Tensor& dst) const;
  // A zero-copy tensor on the CPU device over the mapped bytes (not counted by any allocator; it
  // keeps the mapping alive). Writes to it stay private to this process. Throws FormatError when
  // the tensor's bytes are not aligned to its element size (load() works for any alignment).
  Tensor view(const std::string& name) const;
  // The tensor's bytes as stored in the file (no copy, no conversion).
  std::string_view bytes(const std::string& name) const {
    const TensorInfo& i = info(name);
    return {data_of(i), static_cast<size_t>(i.nbytes())};
  }

 private:
  SafetensorsFile() = default;
  const char* data_of(const TensorInfo& info) const;

  std::string path_;
  std::shared_ptr<MappedFile> mapping_;
  int64_t data_start_ = 0;  // file offset of the data section
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// What a file's header says about one tensor, known before its bytes are.
struct TensorDecl {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  int64_t nbytes() const { return numel(shape) * static_cast<int64_t>(dtype_size(dtype)); }
};

// Writes one safetensors file whose tensors arrive one at a time, in any order, so that no
// tensor has to stay in memory past its own write (a sharded model's export holds one gathered
// unit at a time). The declarations fix the header, and with it every tensor's offset, so the
// header is written first; the bytes are exactly save_safetensors' for the same tensors (which
// writes through this class). The file is written under `path.tmp.<pid>` and appears at `path`
// only in commit(), fsynced and renamed; a writer destroyed without commit() removes its
// temporary file, so no partial file is ever seen under `path`.
class SafetensorsWriter {
 public:
  // Creates the temporary file and writes the header. Throws ConfigError on empty, reserved
  // ("__metadata__") or repeated names, and when the file cannot be created or written.
  SafetensorsWriter(std::string path, std::vector<TensorDecl> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(SafetensorsWriter&&) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&&) noexcept;
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Writes the bytes of declared tensor `name` from `tensor` (any device), whose dtype and shape
  // must be the declared ones. Throws ShapeError naming the tensor on a mismatch, Error when
  // `name` was not declared or is written a second time, ConfigError when the write fails.
  void write(const std::string& name, const Tensor& tensor);
  // The same from `bytes` bytes of host memory, which must be the declared size.
  void write(const std::string& name, const void* data, size_t bytes);
  // Checks that every declared tensor was written (Error naming the missing ones otherwise),
  // then fsyncs the file and renames it to `path`. Throws ConfigError when that fails.
  void commit();

  // The final path (the file is under a temporary name until commit()).
  const std::string& path() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Creates the directory a model or adapter is written to (and its parents); ConfigError naming
// it and the system's reason when it cannot be (a file in the way, no permission).
void create_output_dir(const std::string& dir);

// Writes `tensors` (any devices; dtypes kept) sorted by name, atomically: the bytes go to
// `path.tmp.<pid>`, are fsynced, and the file is renamed over `path`. Throws ConfigError on
// duplicate or empty names and when the file cannot be written.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

constexpr const char* kSingleCheckpointFile = "model.safetensors";
constexpr const char* kCheckpointIndexFile = "model.safetensors.index.json";

// Writes a checkpoint directory (save_sharded's layout) one tensor at a time, in any order.
// Which file holds which tensor is decided from the declarations alone, exactly as save_sharded
// decides it from the tensors: when their total bytes exceed `max_shard_bytes` they are split (in
// name order) into model-0000K-of-0000N.safetensors files of at most `max_shard_bytes` each (a
// larger single tensor gets a shard of its own) plus model.safetensors.index.json; otherwise a
// single model.safetensors is written. Every file is open under its temporary name until
// commit(), which publishes the shard files, then the index, then removes the files of an earlier
// checkpoint in the other layout, so that readers never see a mix. A writer destroyed without
// commit() leaves the directory as it found it (apart from creating it).
class ShardedSafetensorsWriter {
 public:
  // Creates `dir` if missing. Throws ConfigError for a non-positive `max_shard_bytes`, bad or
  // repeated names, and when the directory or a file cannot be created.
  ShardedSafetensorsWriter(std::string dir, std::vector<TensorDecl> tensors,
                           int64_t max_shard_bytes,
                           const std::map<std::string, std::string>& metadata = {});

  // As SafetensorsWriter::write, into the file that holds `name`.
  void write(const std::string& name, const Tensor& tensor);
  // Commits every file (see above) and returns the file names written (index last).
  std::vector<std::string> commit();

  // The file names commit() will write (index last), known from the declarations.
  std::vector<std::string> file_names() const;

 private:
  std::string dir_;
  std::vector<SafetensorsWriter> files_;
  std::vector<std::string> file_names_;    // parallel to files_
  std::map<std::string, size_t> file_of_;  // tensor name -> index into files_
  int64_t total_bytes_ = 0;
  bool sharded_ = false;  // shard files and an index, not one model.safetensors
  bool committed_ = false;
};

// Writes a checkpoint into directory `dir` (created if missing) in the layout described for
// ShardedSafetensorsWriter, from tensors already in memory. Returns the file names written
// (index last).
std::vector<std::string> save_sharded(const std::string& dir, const NamedTensors& tensors,
                                      int64_t max_shard_bytes,
                                      const std::map<std::string, std::string>& metadata = {});

// A checkpoint directory in either layout (or a single .safetensors path), read transparently.
class SafetensorsCheckpoint {
 public:
  static SafetensorsCheckpoint open(const std::string& dir_or_file);

  const std::string& path() const { return path_; }
  bool sharded() const { return files_.size() > 1 || has_index_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;
  // The bytes of all its tensors: what loading every one reads.
  int64_t tensor_bytes() const;
  // The file that holds `name`.
  const SafetensorsFile& file_of(const std::string& name) const;
  // __metadata__ of the shards, merged (they normally agree).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  Tensor load(const std::string& name, Device device = Device::cpu(),
              std::optional<DType> convert_to = std::nullopt) const;
  void load_into(const std::string& name, Tensor& dst) const;

 private:
  std::string path_;
  bool has_index_ = false;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> file_index_;  // tensor name -> index into files_
  std::map<std::string, std::string> metadata_;
};

}  // namespace shardtrain
