#include "shardtrain/core/hdf5.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <tuple>

#include "shardtrain/core/error.h"

namespace shardtrain::h5 {

using detail::concat;

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw FormatError(concat(what, " (", take_error_message(), ")"));
}

hid_t checked(hid_t id, const std::string& what) {
  if (id < 0) fail(what);
  return id;
}

void checked_status(herr_t status, const std::string& what) {
  if (status < 0) fail(what);
}

// No clean-up of the library at process exit, asked for during static initialisation, before
// any other HDF5 call (the library registers its clean-up on its first use). Every file is
// closed by its Handle; but a file whose write failed (a full disk) cannot be closed, and the
// exit-time clean-up then crashes on it after the error has been reported.
const bool kNoExitCleanup = H5dont_atexit() >= 0;

// The dataspaces that address elements [start, start + count) of a 1-D dataset: its file space
// with that range selected, and a memory space of `count` elements.
struct RangeSpaces {
  Handle file, memory;
};
RangeSpaces range_spaces(hid_t dataset, hsize_t start, hsize_t count, const std::string& what) {
  RangeSpaces spaces;
  spaces.file = dataspace(checked(H5Dget_space(dataset), what));
  checked_status(
      H5Sselect_hyperslab(spaces.file.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr),
      what);
  spaces.memory = dataspace(checked(H5Screate_simple(1, &count, nullptr), what));
  return spaces;
}

TypeInfo describe_type(hid_t type) {
  TypeInfo info;
  info.type_class = H5Tget_class(type);
  info.size = H5Tget_size(type);
  if (info.type_class == H5T_INTEGER) info.is_signed = H5Tget_sign(type) == H5T_SGN_2;
  if (info.type_class == H5T_FLOAT) info.is_signed = true;
  return info;
}

}  // namespace

std::string take_error_message() {
  std::string message;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* err, void* out) -> herr_t {
        if (n == 0 && err->desc != nullptr) *static_cast<std::string*>(out) = err->desc;
        return 0;
      },
      &message);
  H5Eclear2(H5E_DEFAULT);
  // A failed read or write of the file driver describes itself with a dump of its arguments
  // (over several lines); the operating system's message in it is what a user can act on.
  const std::string os_marker = "error message = '";
  if (const size_t at = message.find(os_marker); at != std::string::npos) {
    const size_t from = at + os_marker.size(), to = message.find('\'', from);
    if (to != std::string::npos) message = message.substr(from, to - from);
  }
  return message.empty() ? std::string("HDF5 reported an error") : message;
}

bool has_hdf5_signature(const std::string& path) {
  static constexpr char kSignature[8] = {'\x89', 'H', 'D', 'F', '\r', '\n', '\x1a', '\n'};
  // Only a regular file is opened: opening a FIFO would block until a writer appears.
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  // At the start of the file, or after a user block: at 512, 1024, 2048, ... bytes.
  for (std::streamoff at = 0;; at = at == 0 ? 512 : 2 * at) {
    char head[8] = {};
    in.seekg(at);
    if (!in.read(head, sizeof head)) return false;
    if (std::memcmp(head, kSignature, sizeof head) == 0) return true;
  }
}

void silence_library_errors() {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

// ---- Handle -----------------------------------------------------------------------------------

Handle& Handle::operator=(Handle&& other) noexcept {
  if (this != &other) {
    reset();
    id_ = other.id_;
    close_ = other.close_;
    other.id_ = -1;
  }
  return *this;
}

void Handle::reset() {
  if (id_ >= 0 && close_ != nullptr) close_(id_);
  id_ = -1;
}

bool Handle::close() {
  if (id_ < 0) return true;
  herr_t status = close_ != nullptr ? close_(id_) : 0;
  id_ = -1;
  return status >= 0;
}

Handle dataspace(hid_t id) {
  return Handle(id, H5Sclose);
}
Handle datatype(hid_t id) {
  return Handle(id, H5Tclose);
}
Handle plist(hid_t id) {
  return Handle(id, H5Pclose);
}

Handle v110_file_access() {
  Handle fapl = plist(checked(H5Pcreate(H5P_FILE_ACCESS), "cannot create a property list"));
  checked_status(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V110, H5F_LIBVER_V110),
                 "cannot select the HDF5 1.10 file format");
  return fapl;
}

std::string TypeInfo::describe() const {
  switch (type_class) {
    case H5T_INTEGER:
      return concat(is_signed ? "int" : "uint", size * 8);
    case H5T_FLOAT:
      return concat("float", size * 8);
    case H5T_STRING:
      return "string";
    case H5T_COMPOUND:
      return "compound";
    case H5T_ARRAY:
      return "array";
    case H5T_ENUM:
      return "enum";
    default:
      return concat("HDF5 type class ", static_cast<int>(type_class));
  }
}

// ---- attributes -------------------------------------------------------------------------------

bool Object::has_attribute(const std::string& name) const {
  silence_library_errors();
  htri_t exists = H5Aexists(id(), name.c_str());
  if (exists < 0) fail(concat(where_, ": cannot look up attribute '", name, "'"));
  return exists > 0;
}

Handle Object::open_attribute(const std::string& name) const {
  if (!has_attribute(name)) throw FormatError(concat(where_, ": missing attribute '", name, "'"));
  Handle attr(checked(H5Aopen(id(), name.c_str(), H5P_DEFAULT),
                      concat(where_, ": cannot open attribute '", name, "'")),
              H5Aclose);
  Handle space = dataspace(H5Aget_space(attr.get()));
  if (H5Sget_simple_extent_npoints(space.get()) != 1)
    throw FormatError(concat(where_, ": attribute '", name, "' must hold a single value"));
  return attr;
}

TypeInfo Object::attribute_type(const std::string& name) const {
  Handle attr = open_attribute(name);
  Handle type = datatype(H5Aget_type(attr.get()));
  return describe_type(type.get());
}

int64_t Object::read_int64_attribute(const std::string& name) const {
  Handle attr = open_attribute(name);
  Handle type = datatype(H5Aget_type(attr.get()));
  TypeInfo info = describe_type(type.get());
  if (info.type_class != H5T_INTEGER)
    throw FormatError(concat(where_, ": attribute '", name, "' is of type ", info.describe(),
                             ", expected an integer"));
  // HDF5 saturates an unsigned value past int64 into INT64_MAX: read those as they are.
  if (!info.is_signed && info.size >= 8) {
    uint64_t value = 0;
    checked_status(H5Aread(attr.get(), H5T_NATIVE_UINT64, &value),
                   concat(where_, ": cannot read attribute '", name, "'"));
    if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw FormatError(concat(where_, ": attribute '", name, "' holds ", value,
                               ", past the largest 64-bit signed integer"));
    return static_cast<int64_t>(value);
  }
  int64_t value = 0;
  checked_status(H5Aread(attr.get(), H5T_NATIVE_INT64, &value),
                 concat(where_, ": cannot read attribute '", name, "'"));
  return value;
}

double Object::read_double_attribute(const std::string& name) const {
  Handle attr = open_attribute(name);
  Handle type = datatype(H5Aget_type(attr.get()));
  TypeInfo info = describe_type(type.get());
  if (info.type_class != H5T_INTEGER && info.type_class != H5T_FLOAT)
    throw FormatError(concat(where_, ": attribute '", name, "' is of type ", info.describe(),
                             ", expected a number"));
  double value = 0;
  checked_status(H5Aread(attr.get(), H5T_NATIVE_DOUBLE, &value),
                 concat(where_, ": cannot read attribute '", name, "'"));
  return value;
}

std::string Object::read_string_attribute(const std::string& name) const {
  Handle attr = open_attribute(name);
  Handle type = datatype(H5Aget_type(attr.get()));
  if (H5Tget_class(type.get()) != H5T_STRING)
    throw FormatError(concat(where_, ": attribute '", name, "' is of type ",
                             describe_type(type.get()).describe(), ", expected a string"));
  const std::string what = concat(where_, ": cannot read attribute '", name, "'");
  if (H5Tis_variable_str(type.get()) > 0) {
    Handle mem = datatype(H5Tcopy(H5T_C_S1));
    H5Tset_size(mem.get(), H5T_VARIABLE);
    H5Tset_cset(mem.get(), H5Tget_cset(type.get()));
    char* text = nullptr;
    checked_status(H5Aread(attr.get(), mem.get(), &text), what);
    std::string out = text != nullptr ? text : "";
    H5free_memory(text);
    return out;
  }
  const size_t size = H5Tget_size(type.get());
  Handle mem = datatype(H5Tcopy(H5T_C_S1));
  H5Tset_size(mem.get(), size + 1);  // room for the terminator HDF5 writes on conversion
  H5Tset_strpad(mem.get(), H5T_STR_NULLTERM);
  std::string out(size + 1, '\0');
  checked_status(H5Aread(attr.get(), mem.get(), out.data()), what);
  out.resize(std::strlen(out.c_str()));
  while (!out.empty() && out.back() == ' ' && H5Tget_strpad(type.get()) == H5T_STR_SPACEPAD)
    out.pop_back();
  return out;
}

void Object::write_attribute(const std::string& name, hid_t file_type, hid_t mem_type,
                             const void* value) {
  silence_library_errors();
  const std::string what = concat(where_, ": cannot write attribute '", name, "'");
  if (has_attribute(name)) checked_status(H5Adelete(id(), name.c_str()), what);
  Handle space = dataspace(checked(H5Screate(H5S_SCALAR), what));
  Handle attr(
      checked(H5Acreate2(id(), name.c_str(), file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT),
              what),
      H5Aclose);
  checked_status(H5Awrite(attr.get(), mem_type, value), what);
}

void Object::write_int64_attribute(const std::string& name, int64_t value) {
  write_attribute(name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value);
}

void Object::write_double_attribute(const std::string& name, double value) {
  write_attribute(name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &value);
}

void Object::write_string_attribute(const std::string& name, const std::string& value) {
  // Variable-length UTF-8, which h5py reads back as a str.
  Handle type = datatype(H5Tcopy(H5T_C_S1));
  H5Tset_size(type.get(), H5T_VARIABLE);
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  const char* text = value.c_str();
  write_attribute(name, type.get(), type.get(), &text);
}

// ---- Dataset ----------------------------------------------------------------------------------

Dataset::Dataset(Handle handle, std::string where) : Object(std::move(handle), std::move(where)) {
  Handle space = dataspace(checked(H5Dget_space(id()), where_ + ": cannot read the dataspace"));
  int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 0) fail(where_ + ": cannot read the dataspace rank");
  dims_.resize(static_cast<size_t>(rank));
  if (rank > 0) H5Sget_simple_extent_dims(space.get(), dims_.data(), nullptr);
}

int64_t Dataset::num_elements() const {
  int64_t n = 1;
  for (hsize_t d : dims_) n *= static_cast<int64_t>(d);
  return n;
}

void Dataset::check_stored_here() const {
  Handle dcpl = plist(checked(H5Dget_create_plist(id()), where_ + ": cannot read its properties"));
  const H5D_layout_t layout = H5Pget_layout(dcpl.get());
  if (layout == H5D_VIRTUAL)
    throw FormatError(concat(where_,
                             " is a virtual dataset: its data lives in other files, whose "
                             "absence would read as zeros; store the data in the file"));
  if (H5Pget_external_count(dcpl.get()) > 0)
    throw FormatError(concat(where_, " keeps its data in external files; store it in the file"));
  // Unwritten storage: a contiguous dataset allocates all of it on the first write (none before);
  // a chunked one allocates each chunk as it is first written.
  const auto stored = static_cast<int64_t>(H5Dget_storage_size(id()));
  bool complete = true;
  if (layout == H5D_CONTIGUOUS) {
    complete = stored >= num_elements() * static_cast<int64_t>(type().size);
  } else if (layout == H5D_CHUNKED) {
    std::vector<hsize_t> chunk(dims_.size());
    if (H5Pget_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data()) < 0)
      fail(where_ + ": cannot read its chunk shape");
    hsize_t expected = 1;
    for (size_t i = 0; i < dims_.size(); ++i) expected *= (dims_[i] + chunk[i] - 1) / chunk[i];
    Handle space = dataspace(checked(H5Dget_space(id()), where_ + ": cannot read the dataspace"));
    hsize_t written = 0;
    checked_status(H5Dget_num_chunks(id(), space.get(), &written),
                   where_ + ": cannot count its chunks");
    complete = written >= expected;
  }
  if (!complete)
    throw FormatError(concat(where_, " was never completely written (", num_elements(),
                             " elements, not all of them stored): reading it would give fill "
                             "values; write the data again"));
  // The file that holds the dataset (another one when it was reached through an external link).
  Handle file(checked(H5Iget_file_id(id()), where_ + ": cannot find its file"), H5Fclose);
  hsize_t file_size = 0;
  checked_status(H5Fget_filesize(file.get(), &file_size), where_ + ": cannot read its file's size");
  const auto file_bytes = static_cast<int64_t>(file_size);
  if (stored > file_bytes)
    throw FormatError(concat(where_, " claims ", stored, " bytes of storage but the file holds ",
                             file_bytes, " (truncated?)"));
}

std::optional<std::vector<Dataset::RawBlock>> Dataset::raw_blocks() const {
  if (dims_.size() != 1) return std::nullopt;
  Handle type_id = datatype(checked(H5Dget_type(id()), where_ + ": cannot read the element type"));
  if (H5Tget_order(type_id.get()) != H5T_ORDER_LE) return std::nullopt;
  const auto element = static_cast<int64_t>(H5Tget_size(type_id.get()));
  // Raw bytes are the value only when every bit of the element is the integer's (HDF5 also
  // describes, say, 16 significant bits at bit offset 16 of a 4-byte element).
  if (H5Tget_precision(type_id.get()) != static_cast<size_t>(8 * element) ||
      H5Tget_offset(type_id.get()) != 0)
    return std::nullopt;
  Handle dcpl = plist(checked(H5Dget_create_plist(id()), where_ + ": cannot read its properties"));
  if (H5Pget_nfilters(dcpl.get()) != 0) return std::nullopt;
  const auto total = static_cast<int64_t>(dims_[0]);
  std::vector<RawBlock> blocks;
  const H5D_layout_t layout = H5Pget_layout(dcpl.get());
  if (layout == H5D_CONTIGUOUS) {
    const haddr_t offset = H5Dget_offset(id());
    if (offset == HADDR_UNDEF) return std::nullopt;
    blocks.push_back({0, total, static_cast<int64_t>(offset)});
    return blocks;
  }
  if (layout != H5D_CHUNKED) return std::nullopt;
  // Before HDF5 1.14.4, chunk addresses count from the end of the file's user block (a header
  // of 512 bytes or more that some tools put before the HDF5 data); H5Dget_offset, above, has
  // always counted from the start of the file.
  int64_t chunk_base = 0;
  {
    unsigned major = 0, minor = 0, release = 0;
    H5get_libversion(&major, &minor, &release);
    if (std::make_tuple(major, minor, release) < std::make_tuple(1u, 14u, 4u)) {
      Handle file(checked(H5Iget_file_id(id()), where_ + ": cannot find its file"), H5Fclose);
      Handle fcpl = plist(
          checked(H5Fget_create_plist(file.get()), where_ + ": cannot read its file's properties"));
      hsize_t user_block = 0;
      checked_status(H5Pget_userblock(fcpl.get(), &user_block),
                     where_ + ": cannot read its file's user block size");
      chunk_base = static_cast<int64_t>(user_block);
    }
  }
  // HDF5 before 1.14 finds chunk i (by index or by coordinate) by walking the chunk index from
  // its start: n chunks cost n^2 / 2 steps, minutes for 40,000. Past kMaxChunksToMap the data
  // is read through HDF5 instead.
  const auto count = static_cast<hsize_t>(num_chunks());
  if (count > static_cast<hsize_t>(kMaxChunksToMap)) return std::nullopt;
  Handle space = dataspace(checked(H5Dget_space(id()), where_ + ": cannot read the dataspace"));
  for (hsize_t i = 0; i < count; ++i) {
    hsize_t logical = 0, bytes = 0;
    unsigned filter_mask = 0;
    haddr_t address = HADDR_UNDEF;
    checked_status(
        H5Dget_chunk_info(id(), space.get(), i, &logical, &filter_mask, &address, &bytes),
        where_ + ": cannot read where chunk " + std::to_string(i) + " is stored");
    if (address == HADDR_UNDEF) return std::nullopt;
    const auto first = static_cast<int64_t>(logical);
    const int64_t in_chunk = static_cast<int64_t>(bytes) / element;
    const int64_t used = std::min(in_chunk, total - first);
    if (used <= 0) continue;
    blocks.push_back({first, used, chunk_base + static_cast<int64_t>(address)});
  }
  std::sort(blocks.begin(), blocks.end(),
            [](const RawBlock& a, const RawBlock& b) { return a.first_element < b.first_element; });
  // The chunks must tile [0, total) exactly (check_stored_here has already counted them).
  int64_t next = 0;
  for (const RawBlock& b : blocks) {
    if (b.first_element != next) return std::nullopt;
    next += b.num_elements;
  }
  if (next != total) return std::nullopt;
  if (!raw_bytes_match(blocks, element)) return std::nullopt;
  return blocks;
}

int64_t Dataset::num_chunks() const {
  Handle dcpl = plist(checked(H5Dget_create_plist(id()), where_ + ": cannot read its properties"));
  if (H5Pget_layout(dcpl.get()) != H5D_CHUNKED) return 0;
  Handle space = dataspace(checked(H5Dget_space(id()), where_ + ": cannot read the dataspace"));
  hsize_t count = 0;
  checked_status(H5Dget_num_chunks(id(), space.get(), &count), where_ + ": cannot count chunks");
  return static_cast<int64_t>(count);
}

bool Dataset::raw_bytes_match(const std::vector<RawBlock>& blocks, int64_t element) const {
  // The addresses come from HDF5's own bookkeeping, whose meaning has changed between versions
  // (the user block, above): read the first and last element of the first and last block both
  // ways before anyone trusts the raw bytes.
  if (blocks.empty() || (element != 2 && element != 4)) return blocks.empty();
  std::ifstream file(file_name(), std::ios::binary);
  if (!file) return false;
  const hid_t mem_type = element == 2 ? H5T_NATIVE_UINT16 : H5T_NATIVE_UINT32;
  for (const RawBlock* b : {&blocks.front(), &blocks.back()}) {
    for (int64_t at : {int64_t{0}, b->num_elements - 1}) {
      // Both little-endian (raw_blocks refused anything else): the element's first bytes.
      char via_hdf5[4] = {}, raw[4] = {};
      read_range(via_hdf5, mem_type, static_cast<hsize_t>(b->first_element + at), 1);
      file.seekg(b->file_offset + at * element);
      if (!file.read(raw, element)) return false;
      if (std::memcmp(via_hdf5, raw, static_cast<size_t>(element)) != 0) return false;
    }
  }
  return true;
}

std::string Dataset::file_name() const {
  const ssize_t length = H5Fget_name(id(), nullptr, 0);
  if (length < 0) fail(where_ + ": cannot read the name of its file");
  std::string name(static_cast<size_t>(length) + 1, '\0');
  if (H5Fget_name(id(), name.data(), name.size()) < 0)
    fail(where_ + ": cannot read the name of its file");
  name.resize(static_cast<size_t>(length));
  return name;
}

TypeInfo Dataset::type() const {
  Handle type = datatype(checked(H5Dget_type(id()), where_ + ": cannot read the element type"));
  return describe_type(type.get());
}

void Dataset::read(void* out, hid_t mem_type) const {
  silence_library_errors();
  if (num_elements() == 0) return;
  checked_status(H5Dread(id(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out),
                 where_ + ": cannot read the data");
}

void Dataset::read_range(void* out, hid_t mem_type, hsize_t start, hsize_t count) const {
  silence_library_errors();
  if (rank() != 1 || start + count > dims_[0])
    throw ConfigError(concat(where_, ": cannot read elements [", start, ", ", start + count,
                             ") of a dataset of shape ", dims_.empty() ? 0 : dims_[0]));
  if (count == 0) return;
  const std::string what =
      concat(where_, ": cannot read elements [", start, ", ", start + count, ")");
  const RangeSpaces spaces = range_spaces(id(), start, count, what);
  checked_status(H5Dread(id(), mem_type, spaces.memory.get(), spaces.file.get(), H5P_DEFAULT, out),
                 what);
}

void Dataset::write(const void* data, hid_t mem_type) {
  silence_library_errors();
  if (num_elements() == 0) return;
  checked_status(H5Dwrite(id(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data),
                 where_ + ": cannot write the data");
}

void Dataset::append(const void* data, hid_t mem_type, hsize_t count) {
  silence_library_errors();
  if (rank() != 1) throw ConfigError(where_ + ": append needs a 1-D dataset");
  if (count == 0) return;
  const std::string what = concat(where_, ": cannot append ", count, " elements");
  hsize_t start = dims_[0];
  hsize_t new_size = start + count;
  checked_status(H5Dset_extent(id(), &new_size), what);
  const RangeSpaces spaces = range_spaces(id(), start, count, what);
  checked_status(
      H5Dwrite(id(), mem_type, spaces.memory.get(), spaces.file.get(), H5P_DEFAULT, data), what);
  dims_[0] = new_size;
}

// ---- File -------------------------------------------------------------------------------------

File::File(Handle handle, std::string path)
    : Object(std::move(handle), path + ":/"), path_(std::move(path)) {}

File File::create(const std::string& path) {
  silence_library_errors();
  const Handle fapl = v110_file_access();
  hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get());
  if (id < 0)
    throw ConfigError(concat("cannot create HDF5 file '", path, "' (", take_error_message(), ")"));
  return File(Handle(id, H5Fclose), path);
}

File File::open(const std::string& path, bool writable) {
  silence_library_errors();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw ConfigError(concat("HDF5 file '", path, "' does not exist"));
  if (!std::filesystem::is_regular_file(path, ec))
    throw ConfigError(concat("'", path, "' is not a regular file"));
  htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
  if (is_hdf5 <= 0) {
    H5Eclear2(H5E_DEFAULT);
    throw FormatError(concat("'", path, "' is not an HDF5 file"));
  }
  hid_t id = H5Fopen(path.c_str(), writable ? H5F_ACC_RDWR : H5F_ACC_RDONLY, H5P_DEFAULT);
  if (id < 0)
    throw FormatError(concat("cannot open HDF5 file '", path, "' (", take_error_message(), ")"));
  return File(Handle(id, H5Fclose), path);
}

bool File::has(const std::string& name) const {
  silence_library_errors();
  htri_t exists = H5Lexists(id(), name.c_str(), H5P_DEFAULT);
  if (exists < 0) {
    H5Eclear2(H5E_DEFAULT);
    return false;
  }
  return exists > 0;
}

Dataset File::open_dataset(const std::string& name) const {
  if (!has(name)) throw FormatError(concat(path_, ": no dataset '", name, "'"));
  hid_t id = H5Dopen2(this->id(), name.c_str(), H5P_DEFAULT);
  if (id < 0) fail(concat(path_, ": '", name, "' is not a dataset"));
  return Dataset(Handle(id, H5Dclose), concat(path_, ":/", name));
}

Dataset File::create_dataset(const std::string& name, hid_t file_type,
                             const std::vector<hsize_t>& dims) {
  silence_library_errors();
  const std::string what = concat(path_, ": cannot create dataset '", name, "'");
  Handle space = dataspace(
      checked(dims.empty() ? H5Screate(H5S_SCALAR)
                           : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
              what));
  hid_t id = checked(H5Dcreate2(this->id(), name.c_str(), file_type, space.get(), H5P_DEFAULT,
                                H5P_DEFAULT, H5P_DEFAULT),
                     what);
  return Dataset(Handle(id, H5Dclose), concat(path_, ":/", name));
}

Dataset File::create_extendible_1d(const std::string& name, hid_t file_type, hsize_t chunk) {
  silence_library_errors();
  const std::string what = concat(path_, ": cannot create dataset '", name, "'");
  hsize_t initial = 0;
  hsize_t max = H5S_UNLIMITED;
  Handle space = dataspace(checked(H5Screate_simple(1, &initial, &max), what));
  Handle props = plist(checked(H5Pcreate(H5P_DATASET_CREATE), what));
  checked_status(H5Pset_chunk(props.get(), 1, &chunk), what);
  hid_t id = checked(H5Dcreate2(this->id(), name.c_str(), file_type, space.get(), H5P_DEFAULT,
                                props.get(), H5P_DEFAULT),
                     what);
  return Dataset(Handle(id, H5Dclose), concat(path_, ":/", name));
}

void File::flush() {
  silence_library_errors();
  checked_status(H5Fflush(id(), H5F_SCOPE_GLOBAL), path_ + ": cannot flush");
}

void File::close() {
  silence_library_errors();
  if (!handle_.close()) fail(path_ + ": closing the file failed");
}

}  // namespace shardtrain::h5
