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

// Writes `tensors` (any devices; dtypes kept) sorted by name, atomically: the bytes go to
// `path.tmp.<pid>`, are fsynced, and the file is renamed over `path`. Throws ConfigError on
// duplicate or empty names and when the file cannot be written.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

constexpr const char* kSingleCheckpointFile = "model.safetensors";
constexpr const char* kCheckpointIndexFile = "model.safetensors.index.json";

// Writes a checkpoint into directory `dir` (created if missing). When the tensors' total bytes
// exceed `max_shard_bytes`, they are split (in name order) into model-0000K-of-0000N.safetensors
// files of at most `max_shard_bytes` each (a larger single tensor gets a shard of its own) plus
// model.safetensors.index.json; otherwise a single model.safetensors is written. Files of an
// earlier checkpoint in the other layout are removed so that readers never see a mix. Returns the
// file names written (index last).
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
