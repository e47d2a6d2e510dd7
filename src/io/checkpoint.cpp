// HDF5 training checkpoints: rank files, the main file of virtual datasets over them, atomic
// publication, verification and reading (see include/shardtrain/io/checkpoint.h).
#include "shardtrain/io/checkpoint.h"

#include <hdf5.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>

#include "shardtrain/core/child_process.h"
#include "shardtrain/core/files.h"
#include "shardtrain/core/hdf5.h"
#include "shardtrain/core/json_input.h"
#include "shardtrain/core/word_hash.h"
#include "shardtrain/memory/category.h"

namespace shardtrain::io {

using detail::concat;
namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "shardtrain-checkpoint";
constexpr const char* kRankFormat = "shardtrain-checkpoint-rank";
// 2: the main file ends in a whole-file checksum trailer (below). Version 1 files, without it,
// still read.
constexpr int64_t kFormatVersion = 2;
constexpr const char* kTmpSuffix = ".tmp";

// ---- HDF5 plumbing ----------------------------------------------------------------------------

template <typename E = Error>
[[noreturn]] void fail(const std::string& what) {
  throw E(concat(what, " (", h5::take_error_message(), ")"));
}

template <typename E = Error>
hid_t checked(hid_t id, const std::string& what) {
  if (id < 0) fail<E>(what);
  return id;
}

template <typename E = Error>
void checked_status(herr_t status, const std::string& what) {
  if (status < 0) fail<E>(what);
}

// A file, group or dataset, with h5::Object's attribute helpers.
class Node : public h5::Object {
 public:
  Node() = default;
  Node(h5::Handle handle, std::string where) : Object(std::move(handle), std::move(where)) {}
  // Closes now, reporting failure (e.g. the last write of a file hitting a full disk).
  void close() {
    if (!handle_.close()) fail(where_ + ": closing failed");
  }
};

// Link creation that makes the missing groups of a path ("optim/exp_avg/<name>").
h5::Handle intermediate_groups() {
  h5::Handle lcpl = h5::plist(checked(H5Pcreate(H5P_LINK_CREATE), "cannot create a property list"));
  checked_status(H5Pset_create_intermediate_group(lcpl.get(), 1), "cannot set link properties");
  return lcpl;
}

Node create_file(const std::string& path) {
  h5::silence_library_errors();
  h5::Handle fapl = h5::v110_file_access();
  hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get());
  if (id < 0) fail(concat("cannot create checkpoint file '", path, "'"));
  return Node(h5::Handle(id, H5Fclose), path + ":/");
}

Node open_file(const std::string& path) {
  h5::silence_library_errors();
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status))
    throw FormatError(concat("checkpoint file '", path, "' is missing"));
  // A FIFO under a checkpoint's name would block the open until a writer came (a hang no stop
  // signal ends), and a device would read without end.
  if (!fs::is_regular_file(status))
    throw FormatError(concat("checkpoint file '", path, "' is not a regular file but ",
                             fs::is_directory(status) ? "a directory" : "a FIFO, device or socket",
                             ": remove it, or name another checkpoint"));
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    throw FormatError(concat("'", path, "' is not an HDF5 file (truncated or overwritten?)"));
  }
  h5::Handle fapl = h5::v110_file_access();
  hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get());
  if (id < 0)
    fail<FormatError>(concat("cannot open checkpoint file '", path, "' (damaged or truncated?)"));
  return Node(h5::Handle(id, H5Fclose), path + ":/");
}

Node create_group(const Node& parent, const std::string& name) {
  h5::Handle lcpl = intermediate_groups();
  const std::string what = concat(parent.where(), ": cannot create group '", name, "'");
  hid_t id =
      checked(H5Gcreate2(parent.id(), name.c_str(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT), what);
  return Node(h5::Handle(id, H5Gclose), concat(parent.where(), name));
}

bool has_link(const Node& parent, const std::string& path) {
  // Each component must exist before the next may be asked about.
  size_t pos = 0;
  while (true) {
    size_t slash = path.find('/', pos);
    std::string prefix = path.substr(0, slash);
    htri_t exists = H5Lexists(parent.id(), prefix.c_str(), H5P_DEFAULT);
    if (exists <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return false;
    }
    if (slash == std::string::npos) return true;
    pos = slash + 1;
  }
}

Node open_group(const Node& parent, const std::string& name) {
  if (!has_link(parent, name))
    throw FormatError(concat(parent.where(), ": missing group '", name, "'"));
  hid_t id = checked<FormatError>(H5Gopen2(parent.id(), name.c_str(), H5P_DEFAULT),
                                  concat(parent.where(), ": '", name, "' is not a group"));
  return Node(h5::Handle(id, H5Gclose), concat(parent.where(), name));
}

Node open_dataset(const Node& parent, const std::string& name) {
  if (!has_link(parent, name))
    throw FormatError(concat(parent.where(), ": missing dataset '", name, "'"));
  hid_t id = checked<FormatError>(H5Dopen2(parent.id(), name.c_str(), H5P_DEFAULT),
                                  concat(parent.where(), ": '", name, "' is not a dataset"));
  return Node(h5::Handle(id, H5Dclose), concat(parent.where(), name));
}

std::vector<hsize_t> dataset_dims(const Node& ds) {
  h5::Handle space =
      h5::dataspace(checked<FormatError>(H5Dget_space(ds.id()), ds.where() + ": no dataspace"));
  int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 0) fail<FormatError>(ds.where() + ": cannot read the dataspace");
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  if (rank > 0 && H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) < 0)
    fail<FormatError>(ds.where() + ": cannot read the dataspace's dimensions");
  return dims;
}

template <typename T>
struct AttrType;
template <>
struct AttrType<int64_t> {
  static hid_t file() { return H5T_STD_I64LE; }
  static hid_t mem() { return H5T_NATIVE_INT64; }
};
template <>
struct AttrType<uint64_t> {
  static hid_t file() { return H5T_STD_U64LE; }
  static hid_t mem() { return H5T_NATIVE_UINT64; }
};

// A 1-D array attribute (or a scalar one when `scalar`), replacing one of the same name.
template <typename T>
void write_attr(const Node& obj, const std::string& name, const std::vector<T>& values,
                bool scalar = false) {
  const std::string what = concat(obj.where(), ": cannot write attribute '", name, "'");
  if (obj.has_attribute(name)) checked_status(H5Adelete(obj.id(), name.c_str()), what);
  hsize_t n = values.size();
  h5::Handle space = h5::dataspace(
      checked(scalar ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &n, nullptr), what));
  h5::Handle attr(checked(H5Acreate2(obj.id(), name.c_str(), AttrType<T>::file(), space.get(),
                                     H5P_DEFAULT, H5P_DEFAULT),
                          what),
                  H5Aclose);
  if (!values.empty())
    checked_status(H5Awrite(attr.get(), AttrType<T>::mem(), values.data()), what);
}

template <typename T>
std::vector<T> read_attr(const Node& obj, const std::string& name) {
  if (!obj.has_attribute(name))
    throw FormatError(concat(obj.where(), ": missing attribute '", name, "'"));
  const std::string what = concat(obj.where(), ": cannot read attribute '", name, "'");
  h5::Handle attr(checked<FormatError>(H5Aopen(obj.id(), name.c_str(), H5P_DEFAULT), what),
                  H5Aclose);
  h5::Handle space = h5::dataspace(checked<FormatError>(H5Aget_space(attr.get()), what));
  hssize_t n = H5Sget_simple_extent_npoints(space.get());
  if (n < 0) fail<FormatError>(what);
  std::vector<T> out(static_cast<size_t>(n));
  if (n > 0) checked_status<FormatError>(H5Aread(attr.get(), AttrType<T>::mem(), out.data()), what);
  return out;
}

// HDF5 converts a negative or fractional stored value to an unsigned one by clamping it (to 0):
// only unsigned integers, and signed ones of at least 0, are taken as they are.
uint64_t read_u64_attr(const Node& obj, const std::string& name) {
  if (!obj.has_attribute(name))
    throw FormatError(concat(obj.where(), ": missing attribute '", name, "'"));
  const std::string what = concat(obj.where(), ": attribute '", name, "'");
  H5T_class_t type_class = H5T_NO_CLASS;
  H5T_sign_t sign = H5T_SGN_ERROR;
  {
    h5::Handle attr(checked<FormatError>(H5Aopen(obj.id(), name.c_str(), H5P_DEFAULT), what),
                    H5Aclose);
    h5::Handle type(checked<FormatError>(H5Aget_type(attr.get()), what), H5Tclose);
    type_class = H5Tget_class(type.get());
    if (type_class == H5T_INTEGER) sign = H5Tget_sign(type.get());
  }
  if (type_class != H5T_INTEGER) throw FormatError(concat(what, " is not an integer (damaged?)"));
  uint64_t value = 0;
  if (sign == H5T_SGN_NONE) {
    std::vector<uint64_t> v = read_attr<uint64_t>(obj, name);
    if (v.size() != 1) throw FormatError(concat(what, " must hold one value"));
    value = v[0];
  } else {
    std::vector<int64_t> v = read_attr<int64_t>(obj, name);
    if (v.size() != 1) throw FormatError(concat(what, " must hold one value"));
    if (v[0] < 0) throw FormatError(concat(what, " is ", v[0], " (damaged: at least 0 expected)"));
    value = static_cast<uint64_t>(v[0]);
  }
  return value;
}

void write_u64_attr(const Node& obj, const std::string& name, uint64_t value) {
  write_attr<uint64_t>(obj, name, {value}, /*scalar=*/true);
}

// Virtual dataset mappings read '%' and '\' in file and dataset names as format characters.
std::string vds_escape(const std::string& name) {
  std::string out;
  for (char c : name) {
    if (c == '%' || c == '\\') out += c;
    out += c;
  }
  return out;
}

// ---- checksums --------------------------------------------------------------------------------

// WordHash (core/word_hash.h) checksums the data of every range and the main file.

// ---- the main file's whole-file checksum ------------------------------------------------------

// HDF5 checksums its object headers and B-trees but not its global heap, where the main file keeps
// the virtual datasets' mappings and variable-length strings: a damaged byte there can crash the
// library while it parses the file (seen: a segmentation fault in H5S_select_deserialize under
// H5Oget_info_by_name). So the main file (small: metadata and mappings) ends in a trailer past
// HDF5's end of file, which HDF5 ignores, holding the length and the checksum of everything
// before it, and the trailer is checked before HDF5 opens the file.
constexpr char kTrailerMagic[8] = {'s', 't', '-', 's', 'u', 'm', '0', '1'};
constexpr size_t kTrailerBytes = 24;  // magic, length, checksum (little-endian uint64s)

// The checksum of the first `length` bytes of `path`; throws Error when they cannot be read.
uint64_t file_checksum(const std::string& path, uint64_t length) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(concat("cannot open '", path, "' to checksum it: ", std::strerror(errno)));
  WordHash hash;
  std::vector<char> buffer(1 << 20);
  uint64_t left = length;
  while (left > 0) {
    const size_t take = static_cast<size_t>(std::min<uint64_t>(left, buffer.size()));
    if (!in.read(buffer.data(), static_cast<std::streamsize>(take)))
      throw Error(concat("cannot read '", path, "' to checksum it"));
    hash.update(buffer.data(), take);
    left -= take;
  }
  return hash.digest();
}

void append_checksum_trailer(const std::string& path) {
  std::error_code ec;
  const uint64_t length = fs::file_size(path, ec);
  if (ec) throw Error(concat("cannot read the size of '", path, "': ", ec.message()));
  const uint64_t checksum = file_checksum(path, length);
  char trailer[kTrailerBytes];
  std::memcpy(trailer, kTrailerMagic, 8);
  std::memcpy(trailer + 8, &length, 8);
  std::memcpy(trailer + 16, &checksum, 8);
  std::ofstream out(path, std::ios::binary | std::ios::app);
  out.write(trailer, kTrailerBytes);
  out.close();
  if (!out)
    throw Error(concat("cannot append the checksum to '", path, "': ", std::strerror(errno)));
}

enum class Trailer { Matches, Absent };

// Matches: the trailer is there and the bytes before it are the ones it describes. Absent: no
// trailer (a version-1 file, or one whose trailer was damaged: the caller checks the version).
// A trailer that does not match is a FormatError.
Trailer check_checksum_trailer(const std::string& path) {
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec || size < kTrailerBytes) return Trailer::Absent;
  char trailer[kTrailerBytes] = {};
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(size - kTrailerBytes));
  if (!in.read(trailer, kTrailerBytes) || std::memcmp(trailer, kTrailerMagic, 8) != 0)
    return Trailer::Absent;
  uint64_t length = 0, recorded = 0;
  std::memcpy(&length, trailer + 8, 8);
  std::memcpy(&recorded, trailer + 16, 8);
  if (length != size - kTrailerBytes)
    throw FormatError(concat("'", path, "' is ", size, " bytes but its checksum trailer covers ",
                             length, " (truncated or appended to)"));
  if (file_checksum(path, length) != recorded)
    throw FormatError(concat("'", path, "' does not match its whole-file checksum (damaged)"));
  return Trailer::Matches;
}

std::string hex(uint64_t v) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(v));
  return text;
}

// ---- flat ranges as hyperslabs ----------------------------------------------------------------

// One hyperslab block of an N-d tensor and the part of a flat range it holds.
struct Block {
  std::vector<hsize_t> start, count;
  hsize_t range_offset = 0;  // first element of the block within the range
  hsize_t size = 0;
};

// Splits the flat range [begin, end) of the sub-tensor shape[dim:] at index `prefix` into
// row-major hyperslab blocks: at each dimension a partial first slice, the whole slices, and a
// partial last slice (at most 2N - 1 blocks for N dimensions).
void split_range(const Shape& shape, size_t dim, std::vector<hsize_t>& prefix, int64_t begin,
                 int64_t end, std::vector<Block>& out) {
  const size_t n = shape.size();
  auto add_block = [&](int64_t first, int64_t count_here) {
    Block b;
    b.start = prefix;
    b.count.assign(prefix.size(), 1);
    b.start.push_back(static_cast<hsize_t>(first));
    b.count.push_back(static_cast<hsize_t>(count_here));
    for (size_t d = dim + 1; d < n; ++d) {
      b.start.push_back(0);
      b.count.push_back(static_cast<hsize_t>(shape[d]));
    }
    b.size = 1;
    for (hsize_t c : b.count) b.size *= c;
    b.range_offset = out.empty() ? 0 : out.back().range_offset + out.back().size;
    out.push_back(std::move(b));
  };
  if (dim + 1 == n) {
    add_block(begin, end - begin);
    return;
  }
  int64_t inner = 1;
  for (size_t d = dim + 1; d < n; ++d) inner *= shape[d];
  const int64_t first = begin / inner, last = (end - 1) / inner;  // inclusive
  auto recurse = [&](int64_t index, int64_t b, int64_t e) {
    prefix.push_back(static_cast<hsize_t>(index));
    split_range(shape, dim + 1, prefix, b, e, out);
    prefix.pop_back();
  };
  if (first == last) {
    recurse(first, begin - first * inner, end - first * inner);
    return;
  }
  int64_t whole_first = first, whole_last = last;
  if (begin % inner != 0) {
    recurse(first, begin % inner, inner);
    whole_first = first + 1;
  }
  if (end % inner != 0) whole_last = last - 1;
  if (whole_first <= whole_last) add_block(whole_first, whole_last - whole_first + 1);
  if (end % inner != 0) recurse(last, 0, end % inner);
}

std::vector<Block> range_blocks(const Shape& shape, int64_t begin, int64_t length) {
  std::vector<Block> out;
  std::vector<hsize_t> prefix;
  if (length > 0) split_range(shape, 0, prefix, begin, begin + length, out);
  return out;
}

// ---- records ----------------------------------------------------------------------------------

// One range as a rank file and the main file describe it.
struct RangeRecord {
  std::string tensor;
  Shape shape;
  int64_t begin = 0, length = 0;
  uint64_t checksum = 0;
  int rank = 0;
};

nlohmann::json to_json(const RangeRecord& r) {
  return {{"tensor", r.tensor},
          {"shape", r.shape},
          {"begin", r.begin},
          {"length", r.length},
          {"checksum", hex(r.checksum)}};
}

RangeRecord record_from_json(const nlohmann::json& j, int rank, const std::string& where) {
  try {
    RangeRecord r;
    r.tensor = j.at("tensor").get<std::string>();
    r.shape = j.at("shape").get<Shape>();
    r.begin = j.at("begin").get<int64_t>();
    r.length = j.at("length").get<int64_t>();
    r.checksum = std::stoull(j.at("checksum").get<std::string>(), nullptr, 16);
    r.rank = rank;
    return r;
  } catch (const std::exception& e) {
    throw FormatError(concat(where, ": malformed range index entry (", e.what(), ")"));
  }
}

std::string dir_of(const std::string& path) {
  fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// Set in the child process of read_in_child_first.
bool in_reading_child = false;

// A main file without a checksum trailer (format version 1) has nothing that proves its global
// heap intact before HDF5 parses it, and a damaged byte there can crash the library. So a child
// process reads everything a CheckpointReader reads first: if the child dies of a signal, the
// file is reported as damaged instead of taking the run down (and train.resume=auto falls back
// to an earlier checkpoint). A child that cannot start or ends otherwise leaves the reading to
// this process, as before the trailer existed.
void read_in_child_first(const std::string& path) {
  if (in_reading_child) return;
  const ChildOutcome outcome = run_in_child_process(
      [&] {
        in_reading_child = true;
        CheckpointReader reader(path);
      },
      std::chrono::seconds(60));
  if (outcome.crashed())
    throw FormatError(concat("'", path, "' is damaged: reading its HDF5 metadata crashed a ",
                             "separate process (", strsignal(outcome.code),
                             "); it has no whole-file checksum that would have caught the "
                             "damage first (format version 1, or its trailer was cut off)"));
}

// A checkpoint's main file, its checksum trailer checked before HDF5 reads a byte of it. Without
// a trailer it must say it predates them (format version 1), and is read in a child process first.
Node open_main_file(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw FormatError(concat("checkpoint file '", path, "' is missing"));
  const Trailer trailer = check_checksum_trailer(path);
  if (trailer == Trailer::Absent) read_in_child_first(path);
  Node file = open_file(path);
  if (trailer == Trailer::Absent && file.has_attribute("format_version") &&
      file.read_int64_attribute("format_version") >= 2)
    throw FormatError(
        concat("'", path, "' has lost its whole-file checksum trailer (truncated or damaged)"));
  return file;
}

void rename_file(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) throw Error(concat("cannot rename '", from, "' to '", to, "': ", ec.message()));
}

// fp32 host memory holding `t`'s elements (the tensor itself when it already is one).
Tensor host_f32(const Tensor& t) {
  CategoryScope scope(MemoryCategory::Workspace);
  Tensor out = t;
  if (!out.device().cpu_addressable()) out = out.to(Device::host());
  if (out.dtype() != DType::F32) out = out.to(DType::F32);
  return out;
}

// ---- the rank file ----------------------------------------------------------------------------

std::vector<RangeRecord> write_rank_file(const std::string& path, int64_t step, int rank, int world,
                                         const std::vector<TensorRange>& ranges) {
  Node file = create_file(path);
  file.write_string_attribute("format", kRankFormat);
  file.write_int64_attribute("format_version", kFormatVersion);
  file.write_int64_attribute("step", step);
  file.write_int64_attribute("rank", rank);
  file.write_int64_attribute("world_size", world);
  h5::Handle lcpl = intermediate_groups();
  std::vector<RangeRecord> records;
  nlohmann::json index = nlohmann::json::array();
  for (const TensorRange& range : ranges) {
    ST_CHECK_SHAPE(range.data.defined(), "checkpoint tensor '", range.name, "' has no data");
    ST_CHECK_SHAPE(!range.shape.empty() && numel(range.shape) > 0, "checkpoint tensor '",
                   range.name, "' must have at least one dimension and one element, got ",
                   shape_str(range.shape));
    const int64_t length = range.data.numel();
    ST_CHECK_SHAPE(range.begin >= 0 && range.begin + length <= numel(range.shape),
                   "checkpoint tensor '", range.name, "': elements [", range.begin, ", ",
                   range.begin + length, ") exceed its shape ", shape_str(range.shape));
    if (length == 0) continue;
    Tensor host = host_f32(range.data);
    const std::string what = concat(path, ": cannot write '", range.name, "'");
    ST_CHECK(!has_link(file, range.name), what, ": this rank gave two ranges of it");
    hsize_t n = static_cast<hsize_t>(length);
    h5::Handle space = h5::dataspace(checked(H5Screate_simple(1, &n, nullptr), what));
    Node ds(h5::Handle(checked(H5Dcreate2(file.id(), range.name.c_str(), H5T_IEEE_F32LE,
                                          space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT),
                               what),
                       H5Dclose),
            concat(path, ":/", range.name));
    checked_status(
        H5Dwrite(ds.id(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, host.data<float>()),
        what);
    WordHash hash;
    hash.update(host.data<float>(), static_cast<size_t>(length) * sizeof(float));
    RangeRecord r{range.name, range.shape, range.begin, length, hash.digest(), rank};
    ds.write_int64_attribute("begin", r.begin);
    write_attr<int64_t>(ds, "shape", r.shape);
    write_u64_attr(ds, "checksum", r.checksum);
    index.push_back(to_json(r));
    records.push_back(std::move(r));
  }
  file.write_string_attribute("index", index.dump());
  file.write_int64_attribute("complete", 1);  // last: a file without it was cut short
  file.close();
  sync_to_disk(path, false);
  return records;
}

std::vector<RangeRecord> read_rank_index(const std::string& path, int rank) {
  Node file = open_file(path);
  const std::string text = file.read_string_attribute("index");
  nlohmann::json index;
  try {
    index = parse_json_input(text);
  } catch (const std::exception& e) {
    throw FormatError(concat(path, ": the range index is not valid JSON (", e.what(), ")"));
  }
  std::vector<RangeRecord> out;
  for (const auto& entry : index) out.push_back(record_from_json(entry, rank, path));
  return out;
}

// ---- the main file ----------------------------------------------------------------------------

void write_generators(const Node& file, const TrainingState& state) {
  Node rng = create_group(file, "rng");
  write_u64_attr(rng, "init_seed", state.init_seed);
  rng.write_string_attribute(
      "description", "per generator: one row per rank of the saving job, columns (seed, offset)");
  if (state.rng.empty()) return;
  const size_t count = state.rng[0].size();
  for (size_t g = 0; g < count; ++g) {
    const std::string& name = state.rng[0][g].name;
    std::vector<uint64_t> values;
    for (const auto& rank_gens : state.rng) {
      values.push_back(rank_gens[g].seed);
      values.push_back(rank_gens[g].offset);
    }
    hsize_t dims[2] = {state.rng.size(), 2};
    const std::string what = concat(file.where(), ": cannot write generator '", name, "'");
    h5::Handle space = h5::dataspace(checked(H5Screate_simple(2, dims, nullptr), what));
    h5::Handle ds(checked(H5Dcreate2(rng.id(), name.c_str(), H5T_STD_U64LE, space.get(),
                                     H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                          what),
                  H5Dclose);
    checked_status(
        H5Dwrite(ds.get(), H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), what);
  }
}

// The virtual dataset of one tensor over the ranges of the rank files.
void write_virtual_tensor(const Node& file, int64_t step, const std::string& name,
                          const std::vector<RangeRecord>& ranges) {
  const std::string what = concat(file.where(), ": cannot create virtual dataset '", name, "'");
  const Shape& shape = ranges.front().shape;
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  h5::Handle vspace = h5::dataspace(
      checked(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), what));
  h5::Handle dcpl = h5::plist(checked(H5Pcreate(H5P_DATASET_CREATE), what));
  // Elements whose source cannot be read come back as NaN, never as plausible zeros.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  checked_status(H5Pset_fill_value(dcpl.get(), H5T_NATIVE_FLOAT, &nan), what);
  std::vector<int64_t> piece_rank, piece_begin, piece_length;
  std::vector<uint64_t> piece_checksum;
  for (const RangeRecord& r : ranges) {
    const std::string source_file = vds_escape(rank_file_name(step, r.rank));
    const std::string source_dataset = vds_escape("/" + name);
    hsize_t length = static_cast<hsize_t>(r.length);
    h5::Handle sspace = h5::dataspace(checked(H5Screate_simple(1, &length, nullptr), what));
    for (const Block& b : range_blocks(shape, r.begin, r.length)) {
      checked_status(H5Sselect_hyperslab(vspace.get(), H5S_SELECT_SET, b.start.data(), nullptr,
                                         b.count.data(), nullptr),
                     what);
      checked_status(H5Sselect_hyperslab(sspace.get(), H5S_SELECT_SET, &b.range_offset, nullptr,
                                         &b.size, nullptr),
                     what);
      checked_status(H5Pset_virtual(dcpl.get(), vspace.get(), source_file.c_str(),
                                    source_dataset.c_str(), sspace.get()),
                     what);
    }
    piece_rank.push_back(r.rank);
    piece_begin.push_back(r.begin);
    piece_length.push_back(r.length);
    piece_checksum.push_back(r.checksum);
  }
  checked_status(H5Sselect_all(vspace.get()), what);
  h5::Handle lcpl = intermediate_groups();
  Node ds(h5::Handle(checked(H5Dcreate2(file.id(), name.c_str(), H5T_IEEE_F32LE, vspace.get(),
                                        lcpl.get(), dcpl.get(), H5P_DEFAULT),
                             what),
                     H5Dclose),
          concat(file.where(), name));
  write_attr<int64_t>(ds, "piece_rank", piece_rank);
  write_attr<int64_t>(ds, "piece_begin", piece_begin);
  write_attr<int64_t>(ds, "piece_length", piece_length);
  write_attr<uint64_t>(ds, "piece_checksum", piece_checksum);
}

void write_main_file(const std::string& path, const TrainingState& state,
                     const std::vector<int>& writers, const std::vector<RangeRecord>& all_ranges) {
  // Group the ranges by tensor and check that they tile each tensor exactly.
  std::map<std::string, std::vector<RangeRecord>> by_tensor;
  for (const RangeRecord& r : all_ranges) by_tensor[r.tensor].push_back(r);
  for (auto& [name, ranges] : by_tensor) {
    std::sort(ranges.begin(), ranges.end(),
              [](const RangeRecord& a, const RangeRecord& b) { return a.begin < b.begin; });
    int64_t next = 0;
    for (const RangeRecord& r : ranges) {
      ST_CHECK_SHAPE(r.shape == ranges.front().shape, "checkpoint tensor '", name,
                     "': ranks disagree on its shape (", shape_str(r.shape), " on rank ", r.rank,
                     ", ", shape_str(ranges.front().shape), " on rank ", ranges.front().rank, ")");
      ST_CHECK_SHAPE(r.begin == next, "checkpoint tensor '", name, "': the ranks' ranges ",
                     r.begin > next ? "leave a gap" : "overlap", " at element ",
                     std::min(r.begin, next), " (rank ", r.rank, ")");
      next = r.begin + r.length;
    }
    ST_CHECK_SHAPE(next == numel(ranges.front().shape), "checkpoint tensor '", name,
                   "': the ranks' ranges end at element ", next, " of ",
                   numel(ranges.front().shape));
  }

  Node file = create_file(path);
  file.write_string_attribute("format", kFormat);
  file.write_int64_attribute("format_version", kFormatVersion);
  file.write_int64_attribute("step", state.step);
  file.write_int64_attribute("world_size", state.world_size);
  file.write_string_attribute("sharding", state.sharding);
  file.write_string_attribute("config", state.config_yaml);
  if (!state.frozen_base.empty()) file.write_string_attribute("frozen_base", state.frozen_base);
  if (!state.model_config_json.empty())
    file.write_string_attribute("model_config", state.model_config_json);
  std::vector<int64_t> writer_ranks(writers.begin(), writers.end());
  write_attr<int64_t>(file, "writer_ranks", writer_ranks);

  for (const auto& [name, ranges] : by_tensor) write_virtual_tensor(file, state.step, name, ranges);

  Node optim = has_link(file, "optim") ? open_group(file, "optim") : create_group(file, "optim");
  optim.write_string_attribute("name", state.optimizer);
  optim.write_int64_attribute("steps_taken", state.optimizer_steps);
  optim.write_double_attribute("lr", state.lr);
  optim.write_int64_attribute("schedule_step", state.step);
  Node scaler = create_group(file, "amp/grad_scaler");
  scaler.write_int64_attribute("enabled", state.scaler_enabled ? 1 : 0);
  scaler.write_double_attribute("scale", state.scaler.scale);
  scaler.write_int64_attribute("growth_tracker", state.scaler.growth_tracker);
  scaler.write_int64_attribute("skipped_steps", state.scaler.skipped_steps);
  Node sampler = create_group(file, "data/train_sampler");
  write_u64_attr(sampler, "seed", state.sampler.seed);
  sampler.write_int64_attribute("epoch", state.sampler.epoch);
  sampler.write_int64_attribute("position", state.sampler.position);
  write_u64_attr(sampler, "data_checksum", state.sampler.data_checksum);
  write_generators(file, state);
  if (!state.layout_json.empty()) {
    Node layout = create_group(file, "fsdp");
    layout.write_string_attribute("strategy", state.sharding);
    layout.write_string_attribute("flat_param_layout", state.layout_json);
  }
  file.write_int64_attribute("complete", 1);  // last: a file without it was cut short
  file.close();
  // The trailer and the sync come from the caller: HDF5 truncates the file to its own end when
  // the last handle into it closes, and this function's groups close only as it returns.
}

// ---- collective helpers -----------------------------------------------------------------------

bool any_rank(dist::ProcessGroup& group, bool flag) {
  return group.all_reduce_host(static_cast<int64_t>(flag ? 1 : 0), dist::ReduceOp::Max) > 0;
}

void remove_quietly(const std::string& path) {
  std::error_code ec;
  fs::remove(path, ec);
}

}  // namespace

// ---- public -----------------------------------------------------------------------------------

std::string checkpoint_file_name(int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "step-%08lld.h5", static_cast<long long>(step));
  return name;
}

std::string rank_file_name(int64_t step, int rank) {
  char name[80];
  std::snprintf(name, sizeof name, "step-%08lld.rank-%d.h5", static_cast<long long>(step), rank);
  return name;
}

std::string save_checkpoint(dist::ProcessGroup& group, const SaveRequest& request) {
  const int rank = group.rank(), world = group.size();
  const int64_t step = request.state.step;
  // Every rank takes part in this one comparison and every rank gets its verdict, so that they
  // all throw together (a rank that threw alone would leave the others in a collective).
  const int64_t gens = static_cast<int64_t>(request.generators.size());
  const std::vector<bool> differ =
      group.differs_between_ranks({static_cast<uint64_t>(step), static_cast<uint64_t>(gens)});
  ST_CHECK(!differ[0], "saving a checkpoint: the ranks disagree on the step (rank ", rank, " has ",
           step, ")");
  ST_CHECK(!differ[1],
           "saving a checkpoint: the ranks have different numbers of random generators");
  // Every rank's generators, and which ranks write ranges.
  std::vector<int64_t> gathered(static_cast<size_t>(world * (2 * gens + 1)), 0);
  {
    int64_t* mine = gathered.data() + rank * (2 * gens + 1);
    mine[0] = request.writes_ranges ? 1 : 0;
    for (int64_t g = 0; g < gens; ++g) {
      mine[1 + 2 * g] = static_cast<int64_t>(request.generators[static_cast<size_t>(g)].seed);
      mine[2 + 2 * g] = static_cast<int64_t>(request.generators[static_cast<size_t>(g)].offset);
    }
  }
  group.all_reduce_host(gathered, dist::ReduceOp::Sum);
  TrainingState state = request.state;
  state.world_size = world;
  state.rng.assign(static_cast<size_t>(world), request.generators);
  std::vector<int> writers;
  for (int r = 0; r < world; ++r) {
    const int64_t* theirs = gathered.data() + r * (2 * gens + 1);
    if (theirs[0] != 0) writers.push_back(r);
    for (int64_t g = 0; g < gens; ++g) {
      GeneratorState& gs = state.rng[static_cast<size_t>(r)][static_cast<size_t>(g)];
      gs.seed = static_cast<uint64_t>(theirs[1 + 2 * g]);
      gs.offset = static_cast<uint64_t>(theirs[2 + 2 * g]);
    }
  }
  ST_CHECK(!writers.empty(), "saving a checkpoint: no rank writes the tensors");

  const std::string& dir = request.dir;
  const std::string main_path = (fs::path(dir) / checkpoint_file_name(step)).string();
  auto rank_path = [&](int r) { return (fs::path(dir) / rank_file_name(step, r)).string(); };
  auto tmp = [](const std::string& p) { return p + kTmpSuffix; };

  // 1. Every writing rank writes and syncs its rank file under a temporary name.
  std::string error;
  try {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw Error(concat("cannot create checkpoint directory '", dir, "': ", ec.message()));
    if (request.writes_ranges)
      write_rank_file(tmp(rank_path(rank)), step, rank, world, request.ranges);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // 2. Every rank has finished and closed its file (this is the barrier).
  if (any_rank(group, !error.empty())) {
    remove_quietly(tmp(rank_path(rank)));
    if (!error.empty())
      throw Error(concat("saving checkpoint step ", step, " failed on rank ", rank, ": ", error));
    throw Error(concat("saving checkpoint step ", step,
                       " failed on another rank (see its message); nothing was published"));
  }
  // 3. Rank 0 writes the main file and publishes: rank files first, the main file last.
  if (rank == 0) {
    try {
      std::vector<RangeRecord> all;
      for (int r : writers) {
        // Every rank wrote its file and said so: rank 0 not seeing one means another directory.
        std::error_code ec;
        if (r != 0 && !fs::exists(tmp(rank_path(r)), ec))
          throw FormatError(concat("rank ", r, " wrote its part, but rank 0 cannot see '",
                                   tmp(rank_path(r)),
                                   "': the checkpoint directory must be on a file system every "
                                   "rank shares (give checkpoint.dir or train.out_dir as such "
                                   "a path, the same on every rank)"));
        std::vector<RangeRecord> records = read_rank_index(tmp(rank_path(r)), r);
        all.insert(all.end(), records.begin(), records.end());
      }
      write_main_file(tmp(main_path), state, writers, all);
      append_checksum_trailer(tmp(main_path));
      sync_to_disk(tmp(main_path), false);
      // A previous checkpoint of the same step (a rerun from an older one) must not stay
      // published while its rank files are being replaced.
      remove_quietly(main_path);
      for (int r : writers) rename_file(tmp(rank_path(r)), rank_path(r));
      rename_file(tmp(main_path), main_path);
      sync_to_disk(dir, true);
    } catch (const std::exception& e) {
      error = e.what();
      remove_quietly(tmp(main_path));
    }
  }
  if (any_rank(group, !error.empty())) {
    remove_quietly(tmp(rank_path(rank)));
    if (!error.empty())
      throw Error(concat("saving checkpoint step ", step, " failed on rank 0: ", error));
    throw Error(concat("saving checkpoint step ", step,
                       " failed on rank 0 (see its message); nothing was published"));
  }
  return main_path;
}

// ---- reader -----------------------------------------------------------------------------------

struct CheckpointReader::File {
  Node file;
  std::string dir;  // where the rank files are
  struct Tensor {
    Shape shape;
    std::vector<CheckpointPiece> pieces;  // in element order, tiling the tensor
  };
  std::map<std::string, Tensor> tensors;
  mutable std::map<int, Node> rank_files;  // opened on first read

  const Tensor& tensor(const std::string& path, const std::string& name) const {
    auto it = tensors.find(name);
    if (it == tensors.end())
      throw FormatError(concat(path, ": the checkpoint has no tensor '", name, "'"));
    return it->second;
  }
};

namespace {

// Datasets of the groups under `group_path` ("model", "optim/exp_avg"), as full paths.
void collect_datasets(const Node& file, const std::string& group_path,
                      std::vector<std::string>& out) {
  Node group = open_group(file, group_path);
  struct Visit {
    std::vector<std::string> datasets, groups;
  } visit;
  hsize_t index = 0;
  herr_t status = H5Literate(
      group.id(), H5_INDEX_NAME, H5_ITER_INC, &index,
      [](hid_t gid, const char* name, const H5L_info_t*, void* data) -> herr_t {
        auto* v = static_cast<Visit*>(data);
        H5O_info_t info;
        if (H5Oget_info_by_name(gid, name, &info, H5P_DEFAULT) < 0) return -1;
        if (info.type == H5O_TYPE_DATASET) v->datasets.push_back(name);
        if (info.type == H5O_TYPE_GROUP) v->groups.push_back(name);
        return 0;
      },
      &visit);
  if (status < 0) fail<FormatError>(concat(group.where(), ": cannot list the group"));
  for (const auto& d : visit.datasets) out.push_back(group_path + "/" + d);
  for (const auto& g : visit.groups) collect_datasets(file, group_path + "/" + g, out);
}

// Values a saving run cannot have written: FormatError naming the file and the value, so that
// train.resume=auto falls back to an earlier checkpoint instead of failing on it later.
void check_state_values(const std::string& path, const TrainingState& s) {
  auto damaged = [&](const std::string& what) {
    throw FormatError(concat("'", path, "' is damaged: ", what));
  };
  // A main file found by its name (train.resume=auto) must hold the step the name says: a renamed
  // one would be resumed in place of the checkpoint of that step.
  static const std::regex named(R"(step-(\d+)\.h5)");
  std::smatch m;
  const std::string name = fs::path(path).filename().string();
  if (std::regex_match(name, m, named)) {
    int64_t step = -1;
    const std::string digits = m[1].str();
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
    if (ec != std::errc() || end != digits.data() + digits.size() || step != s.step)
      damaged(concat("its name says step ", digits, " but it records step ", s.step,
                     " (renamed?); its rank files are those of step ", s.step));
  }
  if (s.sharding != "none" && s.sharding != "full_shard" && s.sharding != "grad_op_shard" &&
      s.sharding != "no_shard" && s.sharding != "hybrid_shard")
    damaged(concat("sharding is '", s.sharding,
                   "' (none, full_shard, grad_op_shard, no_shard or hybrid_shard expected)"));
  if (s.scaler.growth_tracker < 0 || s.scaler.skipped_steps < 0 || s.scaler.skipped_steps > s.step)
    damaged(concat("/amp/grad_scaler growth_tracker ", s.scaler.growth_tracker, ", skipped_steps ",
                   s.scaler.skipped_steps, " at step ", s.step,
                   " (counts of at least 0, skipped steps at most the step expected)"));
  if (s.sampler.epoch < 0 || s.sampler.position < 0)
    damaged(concat("/data/train_sampler epoch ", s.sampler.epoch, ", position ", s.sampler.position,
                   " (at least 0 expected)"));
}

// The pieces of one tensor as its main-file dataset records them; FormatError unless they tile
// the tensor, in order, from ranks that wrote rank files.
std::vector<CheckpointPiece> read_pieces(const Node& ds, const Shape& shape,
                                         const std::vector<int64_t>& writers) {
  const std::vector<int64_t> ranks = read_attr<int64_t>(ds, "piece_rank");
  const std::vector<int64_t> begins = read_attr<int64_t>(ds, "piece_begin");
  const std::vector<int64_t> lengths = read_attr<int64_t>(ds, "piece_length");
  const std::vector<uint64_t> sums = read_attr<uint64_t>(ds, "piece_checksum");
  if (begins.size() != ranks.size() || lengths.size() != ranks.size() ||
      sums.size() != ranks.size())
    throw FormatError(concat(ds.where(), ": inconsistent piece attributes (", ranks.size(),
                             " ranks, ", begins.size(), " begins, ", lengths.size(), " lengths, ",
                             sums.size(), " checksums)"));
  std::vector<CheckpointPiece> pieces(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (std::find(writers.begin(), writers.end(), ranks[i]) == writers.end())
      throw FormatError(concat(ds.where(), ": piece ", i, " is recorded on rank ", ranks[i],
                               ", which wrote no rank file (writer_ranks)"));
    pieces[i] = {static_cast<int>(ranks[i]), begins[i], lengths[i], sums[i]};
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const CheckpointPiece& a, const CheckpointPiece& b) { return a.begin < b.begin; });
  int64_t next = 0;
  for (const CheckpointPiece& p : pieces) {
    if (p.begin != next || p.length < 1 || p.length > numel(shape) - p.begin)
      throw FormatError(concat(ds.where(), ": its pieces do not tile the ", numel(shape),
                               " elements of the tensor (a piece of ", p.length,
                               " elements at element ", p.begin, " where element ", next,
                               " was next)"));
    next = p.begin + p.length;
  }
  if (next != numel(shape))
    throw FormatError(concat(ds.where(), ": its pieces cover ", next, " of the tensor's ",
                             numel(shape), " elements"));
  return pieces;
}

}  // namespace

CheckpointReader::CheckpointReader(const std::string& path)
    : path_(path), file_(std::make_unique<File>()) {
  file_->file = open_main_file(path);
  const Node& f = file_->file;
  if (!f.has_attribute("format") || f.read_string_attribute("format") != kFormat)
    throw FormatError(concat("'", path, "' is not a shardtrain checkpoint (no format attribute '",
                             kFormat, "')"));
  const int64_t version = f.read_int64_attribute("format_version");
  if (version < 1 || version > kFormatVersion)
    throw FormatError(concat("'", path, "' has checkpoint format version ", version,
                             "; this build reads up to ", kFormatVersion));
  if (!f.has_attribute("complete") || f.read_int64_attribute("complete") != 1)
    throw FormatError(concat(
        "'", path, "' is incomplete (",
        f.has_attribute("complete")
            ? concat("its 'complete' attribute is ", f.read_int64_attribute("complete"), ", not 1")
            : std::string("no 'complete' attribute"),
        "): the save that wrote it did not finish"));
  TrainingState& s = state_;
  s.step = f.read_int64_attribute("step");
  s.world_size = f.read_int64_attribute("world_size");
  // Ranks that saved it; it sizes what is read next. (A job of more than 2^20 ranks is not one
  // this reads; such a number is damage.)
  if (s.step < 0 || s.world_size < 1 || s.world_size > (int64_t{1} << 20))
    throw FormatError(concat("'", path, "' is damaged: step ", s.step, ", world_size ",
                             s.world_size, " (a step of at least 0 and 1 to 2^20 ranks expected)"));
  s.sharding = f.read_string_attribute("sharding");
  s.config_yaml = f.read_string_attribute("config");
  if (f.has_attribute("frozen_base")) s.frozen_base = f.read_string_attribute("frozen_base");
  if (f.has_attribute("model_config"))
    s.model_config_json = f.read_string_attribute("model_config");
  Node optim = open_group(f, "optim");
  s.optimizer = optim.read_string_attribute("name");
  s.optimizer_steps = optim.read_int64_attribute("steps_taken");
  // One optimizer step a training step at most (skipped fp16 steps take none).
  if (s.optimizer_steps < 0 || s.optimizer_steps > s.step)
    throw FormatError(concat("'", path, "' is damaged: /optim steps_taken is ", s.optimizer_steps,
                             " at step ", s.step, " (0 to the step expected)"));
  s.lr = optim.read_double_attribute("lr");
  Node scaler = open_group(f, "amp/grad_scaler");
  s.scaler_enabled = scaler.read_int64_attribute("enabled") != 0;
  const double scale = scaler.read_double_attribute("scale");
  // A loss scale is a positive float32 (a double that rounds to 0 or infinity is not one).
  if (!(scale >= std::numeric_limits<float>::min() && scale <= std::numeric_limits<float>::max()))
    throw FormatError(concat("'", path, "' is damaged: /amp/grad_scaler scale is ", scale,
                             " (a positive finite float32 expected)"));
  s.scaler.scale = static_cast<float>(scale);
  s.scaler.growth_tracker = scaler.read_int64_attribute("growth_tracker");
  s.scaler.skipped_steps = scaler.read_int64_attribute("skipped_steps");
  Node sampler = open_group(f, "data/train_sampler");
  s.sampler.seed = read_u64_attr(sampler, "seed");
  s.sampler.epoch = sampler.read_int64_attribute("epoch");
  s.sampler.position = sampler.read_int64_attribute("position");
  if (sampler.has_attribute("data_checksum"))
    s.sampler.data_checksum = read_u64_attr(sampler, "data_checksum");
  Node rng = open_group(f, "rng");
  s.init_seed = read_u64_attr(rng, "init_seed");
  std::vector<std::string> generators;
  collect_datasets(f, "rng", generators);
  s.rng.assign(static_cast<size_t>(s.world_size), {});
  for (const std::string& g : generators) {
    Node ds = open_dataset(f, g);
    std::vector<hsize_t> dims = dataset_dims(ds);
    if (dims.size() != 2 || dims[0] != static_cast<hsize_t>(s.world_size) || dims[1] != 2)
      throw FormatError(concat(ds.where(), ": expected [", s.world_size, ", 2] generator states"));
    std::vector<uint64_t> values(static_cast<size_t>(2 * s.world_size));
    checked_status<FormatError>(
        H5Dread(ds.id(), H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()),
        ds.where() + ": cannot read");
    for (int64_t r = 0; r < s.world_size; ++r)
      s.rng[static_cast<size_t>(r)].push_back({g.substr(4), values[static_cast<size_t>(2 * r)],
                                               values[static_cast<size_t>(2 * r + 1)]});
  }
  if (has_link(f, "fsdp")) {
    Node layout = open_group(f, "fsdp");
    s.layout_json = layout.read_string_attribute("flat_param_layout");
  }
  check_state_values(path, s);
  collect_datasets(f, "model", names_);
  collect_datasets(f, "optim", names_);
  std::sort(names_.begin(), names_.end());
  file_->dir = dir_of(path);
  writer_ranks_ = read_attr<int64_t>(f, "writer_ranks");
  for (const std::string& name : names_) {
    Node ds = open_dataset(f, name);
    const std::vector<hsize_t> dims = dataset_dims(ds);
    File::Tensor& t = file_->tensors[name];
    t.shape.assign(dims.begin(), dims.end());
    t.pieces = read_pieces(ds, t.shape, writer_ranks_);
  }
}

CheckpointReader::~CheckpointReader() = default;

bool CheckpointReader::has(const std::string& name) const {
  return std::binary_search(names_.begin(), names_.end(), name);
}

Shape CheckpointReader::shape(const std::string& name) const {
  return file_->tensor(path_, name).shape;
}

const std::vector<CheckpointPiece>& CheckpointReader::pieces(const std::string& name) const {
  return file_->tensor(path_, name).pieces;
}

Tensor CheckpointReader::read(const std::string& name) const {
  Shape s = shape(name);
  Tensor out = empty(s, DType::F32, Device::cpu());
  read_range(name, 0, out);
  return out;
}

void CheckpointReader::read_range(const std::string& name, int64_t begin, Tensor& out) const {
  const File::Tensor& t = file_->tensor(path_, name);
  const int64_t length = out.numel();
  ST_CHECK_SHAPE(begin >= 0 && begin + length <= numel(t.shape), path_, ": cannot read elements [",
                 begin, ", ", begin + length, ") of '", name, "' of shape ", shape_str(t.shape));
  if (length == 0) return;
  CategoryScope scope(MemoryCategory::Workspace);
  const bool direct = out.dtype() == DType::F32 && out.device().cpu_addressable();
  Tensor host = direct ? out : empty({length}, DType::F32, Device::host());
  const int64_t end = begin + length;
  for (const CheckpointPiece& p : t.pieces) {
    const int64_t from = std::max(begin, p.begin), to = std::min(end, p.begin + p.length);
    if (from >= to) continue;
    auto it = file_->rank_files.find(p.rank);
    if (it == file_->rank_files.end()) {
      const std::string rank_path =
          (fs::path(file_->dir) / rank_file_name(state_.step, p.rank)).string();
      it = file_->rank_files.emplace(p.rank, open_file(rank_path)).first;
    }
    Node ds = open_dataset(it->second, name);
    const std::vector<hsize_t> dims = dataset_dims(ds);
    if (dims.size() != 1 || dims[0] != static_cast<hsize_t>(p.length))
      throw FormatError(concat(ds.where(), ": holds ", dims.size() == 1 ? dims[0] : 0,
                               " elements where the main file records ", p.length));
    const std::string what =
        concat(ds.where(), ": cannot read elements [", from - p.begin, ", ", to - p.begin, ")");
    hsize_t start = static_cast<hsize_t>(from - p.begin), count = static_cast<hsize_t>(to - from);
    h5::Handle fspace = h5::dataspace(checked<FormatError>(H5Dget_space(ds.id()), what));
    checked_status<FormatError>(
        H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr), what);
    h5::Handle mspace =
        h5::dataspace(checked<FormatError>(H5Screate_simple(1, &count, nullptr), what));
    checked_status<FormatError>(H5Dread(ds.id(), H5T_NATIVE_FLOAT, mspace.get(), fspace.get(),
                                        H5P_DEFAULT, host.data<float>() + (from - begin)),
                                what);
  }
  if (!direct) out.copy_from(host);
}

// ---- verification -----------------------------------------------------------------------------

std::string verify_checkpoint(dist::ProcessGroup& group, const std::string& path) {
  struct Piece {
    std::string tensor;
    RangeRecord record;
  };
  std::string local;
  std::vector<Piece> pieces;
  int64_t step = 0;
  const std::string dir = dir_of(path);
  try {
    CheckpointReader reader(path);
    step = reader.state().step;
    for (int64_t r : reader.writer_ranks()) {
      const std::string rank_path =
          (fs::path(dir) / rank_file_name(step, static_cast<int>(r))).string();
      std::error_code ec;
      if (!fs::exists(rank_path, ec))
        throw FormatError(concat("rank file '", rank_path, "' of checkpoint '", path,
                                 "' is missing (it holds rank ", r, "'s part of the tensors)"));
      Node rf = open_file(rank_path);
      if (!rf.has_attribute("complete") || rf.read_int64_attribute("complete") != 1)
        throw FormatError(concat("rank file '", rank_path, "' is incomplete"));
      if (rf.read_int64_attribute("step") != step)
        throw FormatError(concat("rank file '", rank_path, "' belongs to step ",
                                 rf.read_int64_attribute("step"), ", not ", step));
    }
    for (const std::string& name : reader.tensor_names()) {
      for (const CheckpointPiece& p : reader.pieces(name)) {
        RangeRecord r;
        r.tensor = name;
        r.begin = p.begin;
        r.length = p.length;
        r.checksum = p.checksum;
        r.rank = p.rank;
        pieces.push_back({name, r});
      }
    }
  } catch (const Error& e) {
    local = e.what();
  }
  if (any_rank(group, !local.empty()))
    return local.empty()
               ? concat("'", path, "' could not be read on another rank (see its message)")
               : local;

  // The data behind every piece, split over the ranks; codes: 1 unreadable, 2 wrong length,
  // 3 checksum mismatch.
  int64_t failure = 0;
  std::map<int, Node> open_files;
  for (size_t i = static_cast<size_t>(group.rank()); i < pieces.size() && failure == 0;
       i += static_cast<size_t>(group.size())) {
    const RangeRecord& r = pieces[i].record;
    int code = 0;
    try {
      auto it = open_files.find(r.rank);
      if (it == open_files.end())
        it =
            open_files
                .emplace(r.rank, open_file((fs::path(dir) / rank_file_name(step, r.rank)).string()))
                .first;
      Node ds = open_dataset(it->second, r.tensor);
      std::vector<hsize_t> dims = dataset_dims(ds);
      if (dims.size() != 1 || dims[0] != static_cast<hsize_t>(r.length)) {
        code = 2;
      } else {
        // In bounded chunks: the hash is streamed.
        constexpr hsize_t kChunk = hsize_t{1} << 22;
        std::vector<float> buf(static_cast<size_t>(std::min<hsize_t>(kChunk, dims[0])));
        h5::Handle fspace = h5::dataspace(
            checked<FormatError>(H5Dget_space(ds.id()), ds.where() + ": no dataspace"));
        WordHash hash;
        for (hsize_t start = 0; start < dims[0]; start += kChunk) {
          hsize_t count = std::min(kChunk, dims[0] - start);
          checked_status<FormatError>(
              H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr),
              ds.where());
          h5::Handle mspace = h5::dataspace(
              checked(H5Screate_simple(1, &count, nullptr), "cannot create a dataspace"));
          checked_status<FormatError>(H5Dread(ds.id(), H5T_NATIVE_FLOAT, mspace.get(), fspace.get(),
                                              H5P_DEFAULT, buf.data()),
                                      ds.where());
          hash.update(buf.data(), static_cast<size_t>(count) * sizeof(float));
        }
        if (hash.digest() != r.checksum || read_u64_attr(ds, "checksum") != r.checksum) code = 3;
      }
    } catch (const Error&) {
      code = 1;
    }
    if (code != 0) failure = static_cast<int64_t>(i) * 4 + code;
  }
  failure = group.all_reduce_host(failure, dist::ReduceOp::Max);
  if (failure == 0) return "";
  const RangeRecord& r = pieces[static_cast<size_t>(failure / 4)].record;
  const std::string rank_path = (fs::path(dir) / rank_file_name(step, r.rank)).string();
  const char* reason = failure % 4 == 1   ? "cannot be read"
                       : failure % 4 == 2 ? "has the wrong length"
                                          : "does not match the checksum recorded in the main file";
  return concat("rank file '", rank_path, "' of checkpoint '", path, "': the data of '", r.tensor,
                "' (elements [", r.begin, ", ", r.begin + r.length, ")) ", reason);
}

// ---- listing and pruning ----------------------------------------------------------------------

namespace {

struct DirFile {
  std::string path;
  int64_t step = 0;
  bool main = false;  // the main file (complete name, not temporary)
  bool temporary = false;
};

std::vector<DirFile> checkpoint_files(const std::string& dir) {
  static const std::regex pattern(R"(step-(\d+)(\.rank-\d+)?\.h5(\.tmp)?)");
  std::vector<DirFile> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, pattern)) continue;
    DirFile f;
    f.path = entry.path().string();
    // A step too large for int64 is not a name this program writes: such a file is not ours.
    const std::string digits = m[1].str();
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), f.step);
    if (ec != std::errc() || end != digits.data() + digits.size()) continue;
    f.temporary = m[3].matched;
    f.main = !m[2].matched && !f.temporary;
    out.push_back(f);
  }
  return out;
}

bool is_complete(const std::string& path) {
  try {
    Node f = open_main_file(path);
    return f.has_attribute("complete") && f.read_int64_attribute("complete") == 1;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

std::optional<int64_t> rank_file_step(const std::string& name) {
  static const std::regex pattern(R"(step-(\d+)\.rank-\d+\.h5)");
  std::smatch m;
  const std::string file = fs::path(name).filename().string();
  int64_t step = 0;
  if (!std::regex_match(file, m, pattern)) return std::nullopt;
  const std::string digits = m[1].str();
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return step;
}

void reseal_checkpoint_file(const std::string& main_path) {
  std::error_code ec;
  if (!fs::exists(main_path, ec))
    throw FormatError(concat("checkpoint file '", main_path, "' is missing"));
  if (check_checksum_trailer(main_path) == Trailer::Absent) append_checksum_trailer(main_path);
}

std::vector<CheckpointEntry> list_checkpoints(const std::string& dir) {
  std::vector<CheckpointEntry> out;
  for (const DirFile& f : checkpoint_files(dir))
    if (f.main) out.push_back({f.step, f.path});
  std::sort(out.begin(), out.end(),
            [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step > b.step; });
  return out;
}

void prune_checkpoints(const std::string& dir, int64_t keep_last, int64_t saved_step,
                       const std::set<int64_t>& refused) {
  std::vector<int64_t> complete;  // steps, newest first
  for (const CheckpointEntry& e : list_checkpoints(dir))
    if (e.step <= saved_step && refused.count(e.step) == 0 && is_complete(e.path))
      complete.push_back(e.step);
  if (complete.empty()) return;
  const int64_t oldest_kept = keep_last > 0 && static_cast<int64_t>(complete.size()) > keep_last
                                  ? complete[static_cast<size_t>(keep_last - 1)]
                                  : std::numeric_limits<int64_t>::min();
  std::vector<DirFile> files = checkpoint_files(dir);
  std::map<int64_t, bool> has_main;
  for (const DirFile& f : files)
    if (f.main) has_main[f.step] = true;
  // Main files before rank files, so that an interrupted prune never leaves a main file whose
  // rank files are gone.
  std::stable_partition(files.begin(), files.end(), [](const DirFile& f) { return f.main; });
  for (const DirFile& f : files) {
    const bool old = f.step < oldest_kept;
    const bool leftover = f.step < saved_step && (f.temporary || (!f.main && !has_main[f.step]));
    if (old || leftover) remove_quietly(f.path);
  }
}

}  // namespace shardtrain::io
