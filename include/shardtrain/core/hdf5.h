// Thin RAII wrappers over the HDF5 C API: files, datasets and attributes whose handles close
// themselves, and whose failures become exceptions naming the file and object.
//
// HDF5's own error-stack printing is switched off the first time any wrapper is used, because the
// wrappers report every failure as a ConfigError or FormatError instead.
#pragma once
#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardtrain::h5 {

// Turns off HDF5's automatic error printing (idempotent, called by every wrapper).
void silence_library_errors();

// The message of the innermost failing function on HDF5's error stack (the most specific one,
// e.g. "truncated file: eof = ..."), then clears the stack. For exception messages.
std::string take_error_message();

// Whether the file at `path` holds HDF5's 8-byte signature where HDF5 looks for it: at its
// start (every file this program writes), or after a user block of 512, 1024, 2048, ... bytes
// (`h5jam`). False for a file that cannot be read.
bool has_hdf5_signature(const std::string& path);

// One HDF5 identifier and the function that closes it.
class Handle {
 public:
  using CloseFn = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, CloseFn close) : id_(id), close_(close) {}
  ~Handle() { reset(); }
  Handle(Handle&& other) noexcept : id_(other.id_), close_(other.close_) { other.id_ = -1; }
  Handle& operator=(Handle&& other) noexcept;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes now and reports failure (destructors cannot); returns false when closing failed.
  bool close();

 private:
  void reset();
  hid_t id_ = -1;
  CloseFn close_ = nullptr;
};

Handle dataspace(hid_t id);  // H5Sclose
Handle datatype(hid_t id);   // H5Tclose
Handle plist(hid_t id);      // H5Pclose

// File access in the HDF5 1.10 format, for every file this project writes: its metadata is
// checksummed, so a torn or damaged file fails to open instead of giving wrong values, and it is
// what virtual datasets need.
Handle v110_file_access();

// What an HDF5 element type is, in the terms callers check.
struct TypeInfo {
  H5T_class_t type_class = H5T_NO_CLASS;
  size_t size = 0;
  bool is_signed = false;
  std::string describe() const;  // "uint16", "int64", "float32", "string", ...
};

// Anything that carries attributes: the file's root group, groups, datasets.
class Object {
 public:
  hid_t id() const { return handle_.get(); }
  // "<file>:<object path>" for messages.
  const std::string& where() const { return where_; }

  bool has_attribute(const std::string& name) const;
  TypeInfo attribute_type(const std::string& name) const;
  // Readers throw FormatError naming the object when the attribute is missing or of a type that
  // cannot be converted (e.g. a string read as an integer).
  int64_t read_int64_attribute(const std::string& name) const;
  double read_double_attribute(const std::string& name) const;
  std::string read_string_attribute(const std::string& name) const;  // fixed or variable length
  // Writers replace an existing attribute of the same name.
  void write_int64_attribute(const std::string& name, int64_t value);
  void write_double_attribute(const std::string& name, double value);
  void write_string_attribute(const std::string& name, const std::string& value);

 protected:
  Object() = default;
  Object(Handle handle, std::string where) : handle_(std::move(handle)), where_(std::move(where)) {}
  Handle open_attribute(const std::string& name) const;
  void write_attribute(const std::string& name, hid_t file_type, hid_t mem_type, const void* value);

  Handle handle_;
  std::string where_;
};

class Dataset : public Object {
 public:
  Dataset(Handle handle, std::string where);

  int rank() const { return static_cast<int>(dims_.size()); }
  const std::vector<hsize_t>& dims() const { return dims_; }
  int64_t num_elements() const;
  TypeInfo type() const;

  // Throws FormatError unless every element is stored in its file: HDF5 reads fill values (zeros)
  // in silence for a virtual dataset whose sources are missing, a dataset with external storage,
  // one whose chunks were never all written, and one that claims more bytes than the file holds.
  void check_stored_here() const;
  // Where a 1-D dataset's elements lie in its file, for reading them without HDF5 (mapped into
  // memory): one block per chunk, or one for a contiguous dataset, in element order. nullopt when
  // they cannot be read as raw bytes: filtered (compressed) chunks, another layout, elements
  // not little-endian or not using every bit, or addresses whose bytes do not read as HDF5
  // reads them (checked on a few elements). A chunk past the end of the data (the last, partly
  // used) is cut to it.
  struct RawBlock {
    int64_t first_element = 0;
    int64_t num_elements = 0;
    int64_t file_offset = 0;  // bytes
  };
  std::optional<std::vector<RawBlock>> raw_blocks() const;
  // A dataset of more chunks is not mapped (raw_blocks gives nullopt): HDF5 before 1.14 finds a
  // chunk's address by walking the chunk index from its start, n^2 / 2 steps for n chunks.
  static constexpr int64_t kMaxChunksToMap = 4096;
  // The chunks stored of a chunked dataset; 0 for another layout.
  int64_t num_chunks() const;
  // The path of the file that holds the dataset (another than the opened one when it was reached
  // through an external link).
  std::string file_name() const;

  // Reads the whole dataset, converting to `mem_type` (e.g. H5T_NATIVE_UINT32).
  void read(void* out, hid_t mem_type) const;
  // Reads elements [start, start + count) of a 1-D dataset.
  void read_range(void* out, hid_t mem_type, hsize_t start, hsize_t count) const;
  void write(const void* data, hid_t mem_type);
  // Appends `count` elements to a 1-D dataset created extendible.
  void append(const void* data, hid_t mem_type, hsize_t count);

 private:
  // Whether raw_blocks' addresses hold what HDF5 reads for a few elements.
  bool raw_bytes_match(const std::vector<RawBlock>& blocks, int64_t element) const;

  std::vector<hsize_t> dims_;
};

class File : public Object {
 public:
  // Creates (truncating) a file in the HDF5 1.10 format, whose metadata is checksummed (a
  // damaged chunk index fails to read instead of pointing at the wrong bytes); throws
  // ConfigError when it cannot.
  static File create(const std::string& path);
  // Opens an existing file; throws ConfigError when it does not exist and FormatError when it is
  // not HDF5.
  static File open(const std::string& path, bool writable = false);

  const std::string& path() const { return path_; }
  // Whether a link (dataset or group) of this name exists at the root.
  bool has(const std::string& name) const;
  Dataset open_dataset(const std::string& name) const;
  // A fixed-size dataset of `file_type` and `dims`.
  Dataset create_dataset(const std::string& name, hid_t file_type,
                         const std::vector<hsize_t>& dims);
  // An empty 1-D dataset that grows with Dataset::append, stored in chunks of `chunk` elements.
  Dataset create_extendible_1d(const std::string& name, hid_t file_type, hsize_t chunk);
  void flush();
  // Closes the file, throwing when HDF5 reports a failure (e.g. a full disk on the final write).
  void close();

 private:
  File(Handle handle, std::string path);
  std::string path_;
};

}  // namespace shardtrain::h5
