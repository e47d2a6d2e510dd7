#include "shardtrain/io/safetensors.h"

#include <algorithm>
#include <bit>
#include <boost/iostreams/device/mapped_file.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "shardtrain/core/error.h"
#include "shardtrain/core/files.h"
#include "shardtrain/core/json_input.h"
#include "shardtrain/core/suggest.h"

namespace shardtrain {

namespace fs = std::filesystem;
using detail::concat;

// ---- memory mapping ---------------------------------------------------------------------------

// A whole file mapped copy-on-write (Boost.Iostreams' private mapping): reads come from the page
// cache, and writes through a zero-copy view stay private to the process and never reach the
// file.
// safetensors stores little-endian numbers (the header length, every element), which tensors
// take from the mapping as they are.
static_assert(std::endian::native == std::endian::little,
              "safetensors files are read as little-endian host numbers");
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    std::error_code ec;
    const fs::file_status status = fs::status(path, ec);
    if (ec || !fs::exists(status))
      throw ConfigError(concat("cannot open safetensors file '", path,
                               "': ", ec ? ec.message() : std::string("no such file")));
    if (!fs::is_regular_file(status))
      throw ConfigError(concat("'", path, "' is not a regular file"));
    const std::uintmax_t bytes = fs::file_size(path, ec);
    if (ec) throw ConfigError(concat("cannot read the size of '", path, "': ", ec.message()));
    if (bytes == 0) return;  // nothing to map (an empty mapping is refused); the reader says why
    boost::iostreams::mapped_file_params params(path);
    params.flags = boost::iostreams::mapped_file::priv;
    try {
      file_.open(params);
    } catch (const std::exception& e) {
      throw ConfigError(concat("cannot memory-map '", path, "': ", e.what()));
    }
  }

  char* data() const { return file_.is_open() ? file_.data() : nullptr; }
  size_t size() const { return file_.is_open() ? file_.size() : 0; }

 private:
  boost::iostreams::mapped_file file_;
};

namespace {

constexpr std::pair<DType, const char*> kDTypeNames[] = {
    {DType::F32, "F32"}, {DType::BF16, "BF16"}, {DType::F16, "F16"},
    {DType::I32, "I32"}, {DType::I64, "I64"},   {DType::U8, "U8"},
};

std::optional<DType> parse_dtype(const std::string& name) {
  for (const auto& [dtype, text] : kDTypeNames)
    if (name == text) return dtype;
  return std::nullopt;
}

// "did you mean 'x'? " plus a few of the available names, for a missing-tensor message.
std::string available_names(const std::string& wanted, const std::vector<std::string>& names) {
  if (names.empty()) return "it holds no tensors";
  std::string out;
  const std::string close = closest_match(wanted, names);
  if (!close.empty()) out = concat("did you mean '", close, "'? ");
  out += concat("it holds ", names.size(), " tensors: ");
  for (size_t i = 0; i < names.size() && i < 5; ++i) out += (i == 0 ? "'" : ", '") + names[i] + "'";
  if (names.size() > 5) out += ", ...";
  return out;
}

// Reads a non-negative integer from a header field; FormatError otherwise.
int64_t header_int(const nlohmann::json& value, const std::string& where) {
  if (value.is_number_unsigned()) {
    auto v = value.get<uint64_t>();
    if (v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return static_cast<int64_t>(v);
  } else if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    return value.get<int64_t>();
  }
  throw FormatError(concat(where, " must be a non-negative integer, got ", value.dump()));
}

Tensor borrowed_tensor(const TensorInfo& info, const char* bytes,
                       const std::shared_ptr<MappedFile>& keepalive) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>();
  impl->storage->data = DataPtr::borrowed(const_cast<char*>(bytes),
                                          static_cast<size_t>(info.nbytes()), Device::cpu());
  impl->storage->keepalive = keepalive;
  impl->shape = info.shape;
  impl->dtype = info.dtype;
  return Tensor(impl);
}

bool aligned_for(const void* p, DType dtype) {
  return reinterpret_cast<uintptr_t>(p) % dtype_size(dtype) == 0;
}

}  // namespace

std::string_view safetensors_dtype_name(DType dtype) {
  for (const auto& [d, text] : kDTypeNames)
    if (d == dtype) return text;
  throw FormatError(concat("dtype ", dtype_name(dtype), " has no safetensors name"));
}

// ---- reading ----------------------------------------------------------------------------------

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  f.mapping_ = std::make_shared<MappedFile>(path);
  const size_t size = f.mapping_->size();
  const char* bytes = f.mapping_->data();
  if (size < 8)
    throw FormatError(concat(path, ": truncated safetensors file (", size,
                             " bytes); it must start with an 8-byte header length"));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i)
    header_len = (header_len << 8) | static_cast<unsigned char>(bytes[i]);
  if (header_len > size - 8)
    throw FormatError(concat(path, ": header length ", header_len, " runs past the end of the ",
                             size, "-byte file (truncated, or not a safetensors file)"));
  f.data_start_ = static_cast<int64_t>(8 + header_len);
  const int64_t data_size = static_cast<int64_t>(size) - f.data_start_;

  // The JSON parser takes a NUL for the end of its input: what follows one would go unread (the
  // format pads headers with spaces).
  if (const void* nul = std::memchr(bytes + 8, '\0', header_len); nul != nullptr)
    throw FormatError(concat(path, ": the JSON header holds a NUL byte at offset ",
                             static_cast<const char*>(nul) - bytes,
                             " (a damaged file; headers are padded with spaces)"));
  nlohmann::json header;
  try {
    header = parse_json_input(std::string_view(bytes + 8, header_len));
  } catch (const std::exception& e) {
    throw FormatError(concat(path, ": invalid JSON header: ", e.what()));
  }
  if (!header.is_object())
    throw FormatError(
        concat(path, ": the JSON header must be an object, got ", header.type_name()));

  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object())
        throw FormatError(concat(path, ": __metadata__ must be an object of strings"));
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          throw FormatError(
              concat(path, ": __metadata__ value of '", mk, "' must be a string, got ", mv.dump()));
        f.metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    const std::string where = concat(path, ": tensor '", key, "'");
    if (!value.is_object())
      throw FormatError(concat(where,
                               ": entry must be an object with dtype, shape and "
                               "data_offsets"));
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!value.contains(field)) throw FormatError(concat(where, ": missing field '", field, "'"));

    TensorInfo info;
    info.name = key;
    if (!value["dtype"].is_string())
      throw FormatError(concat(where, ": dtype must be a string, got ", value["dtype"].dump()));
    const auto dtype_text = value["dtype"].get<std::string>();
    auto dtype = parse_dtype(dtype_text);
    if (!dtype)
      throw FormatError(concat(where, ": unsupported dtype '", dtype_text,
                               "' (supported: F32, BF16, F16, I32, I64, U8)"));
    info.dtype = *dtype;

    if (!value["shape"].is_array())
      throw FormatError(concat(where, ": shape must be an array, got ", value["shape"].dump()));
    // Element counts are bounded by the data section, which keeps the product from overflowing.
    int64_t count = 1;
    for (const auto& extent : value["shape"]) {
      int64_t e = header_int(extent, where + ": shape extent");
      info.shape.push_back(e);
      if (count != 0 && e > 0 && count > data_size / e + 1)
        count = data_size + 1;
      else
        count *= e;
    }

    const auto& offsets = value["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2)
      throw FormatError(concat(where, ": data_offsets must be [begin, end], got ", offsets.dump()));
    info.data_begin = header_int(offsets[0], where + ": data_offsets[0]");
    info.data_end = header_int(offsets[1], where + ": data_offsets[1]");
    if (info.data_end < info.data_begin)
      throw FormatError(concat(where, ": data_offsets [", info.data_begin, ", ", info.data_end,
                               "] end before they begin"));
    if (info.data_end > data_size)
      throw FormatError(concat(where, ": data_offsets [", info.data_begin, ", ", info.data_end,
                               "] run past the end of the data section (", data_size,
                               " bytes; is the file truncated?)"));
    const int64_t expected = count * static_cast<int64_t>(dtype_size(info.dtype));
    if (count > data_size || expected != info.nbytes())
      throw FormatError(
          concat(where, ": data_offsets [", info.data_begin, ", ", info.data_end, "] hold ",
                 info.nbytes(), " bytes but ", dtype_text, shape_str(info.shape), " needs ",
                 count > data_size ? std::string("more than the whole file") : concat(expected),
                 " bytes"));
    f.tensors_.emplace(key, std::move(info));
  }

  // No two tensors may share bytes.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& entry : f.tensors_)
    if (entry.second.nbytes() > 0) by_offset.push_back(&entry.second);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->data_begin < b->data_begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo& a = *by_offset[i - 1];
    const TensorInfo& b = *by_offset[i];
    if (b.data_begin < a.data_end)
      throw FormatError(concat(path, ": tensors '", a.name, "' [", a.data_begin, ", ", a.data_end,
                               ") and '", b.name, "' [", b.data_begin, ", ", b.data_end,
                               ") overlap"));
  }
  // The tensors tile the data section, as the format requires: a gap is bytes no tensor owns (a
  // damaged file, or a tensor named twice in the header, whose first entry the JSON reader
  // drops), and bytes past the last tensor are no part of the contents.
  int64_t end = 0;
  for (const TensorInfo* t : by_offset) {
    if (t->data_begin != end)
      throw FormatError(concat(path, ": bytes [", end, ", ", t->data_begin,
                               ") of the data section belong to no tensor (a damaged file, or a "
                               "tensor named twice in the header)"));
    end = t->data_end;
  }
  if (end != data_size)
    throw FormatError(concat(path, ": the data section holds ", data_size,
                             " bytes but its tensors end at byte ", end,
                             " (bytes appended to the file, or a damaged header)"));
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& entry : tensors_) out.push_back(entry.first);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const {
  return tensors_.count(name) > 0;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end())
    throw FormatError(
        concat(path_, ": no tensor '", name, "' (", available_names(name, names()), ")"));
  return it->second;
}

const char* SafetensorsFile::data_of(const TensorInfo& info) const {
  return mapping_->data() + data_start_ + info.data_begin;
}

Tensor SafetensorsFile::load(const std::string& name, Device device,
                             std::optional<DType> convert_to) const {
  const TensorInfo& ti = info(name);
  const DType out_dtype = convert_to.value_or(ti.dtype);
  const char* src = data_of(ti);
  Tensor out = empty(ti.shape, out_dtype, device);
  if (out_dtype == ti.dtype) {
    copy_bytes(out.data_ptr(), device, src, Device::cpu(), static_cast<size_t>(ti.nbytes()));
    return out;
  }
  // Conversion reads typed elements, so the source must be aligned for its element type.
  std::vector<char> staged;
  if (!aligned_for(src, ti.dtype)) {
    staged.assign(src, src + ti.nbytes());  // std::vector storage is suitably aligned
    src = staged.data();
  }
  if (device.cpu_addressable()) {
    convert_elements(src, ti.dtype, out.data_ptr(), out_dtype, out.numel());
  } else {
    std::vector<char> converted(out.nbytes());
    convert_elements(src, ti.dtype, converted.data(), out_dtype, out.numel());
    copy_bytes(out.data_ptr(), device, converted.data(), Device::cpu(), out.nbytes());
  }
  return out;
}

void SafetensorsFile::load_into(const std::string& name, Tensor& dst) const {
  const TensorInfo& ti = info(name);
  if (!dst.defined())
    throw ConfigError(concat(path_, ": load_into('", name, "') needs a defined destination"));
  if (dst.shape() != ti.shape)
    throw FormatError(concat(path_, ": tensor '", name, "' has shape ", shape_str(ti.shape),
                             " in the file but the destination expects ", shape_str(dst.shape())));
  const char* src = data_of(ti);
  std::vector<char> staged;
  if (!aligned_for(src, ti.dtype)) {
    staged.assign(src, src + ti.nbytes());
    src = staged.data();
  }
  dst.copy_from(borrowed_tensor(ti, src, mapping_));
}

Tensor SafetensorsFile::view(const std::string& name) const {
  const TensorInfo& ti = info(name);
  const char* src = data_of(ti);
  if (!aligned_for(src, ti.dtype))
    throw FormatError(concat(path_, ": tensor '", name,
                             "' starts at a byte offset that is not a "
                             "multiple of its ",
                             dtype_size(ti.dtype),
                             "-byte element size, so it cannot be viewed in place; use "
                             "load() to copy it"));
  return borrowed_tensor(ti, src, mapping_);
}

// ---- writing ----------------------------------------------------------------------------------

namespace {

// Rejects empty, reserved and repeated names; `sorted` is in name order. `where` names the file
// or directory being written.
void check_tensor_names(const std::string& where, const std::vector<TensorDecl>& sorted) {
  for (size_t i = 0; i < sorted.size(); ++i) {
    const std::string& name = sorted[i].name;
    if (name.empty() || name == "__metadata__")
      throw ConfigError(concat("cannot save '", where, "': invalid tensor name '", name, "'"));
    if (i > 0 && name == sorted[i - 1].name)
      throw ConfigError(
          concat("cannot save '", where, "': tensor name '", name, "' appears twice"));
  }
}

std::vector<TensorDecl> sorted_by_name(std::vector<TensorDecl> tensors) {
  std::stable_sort(tensors.begin(), tensors.end(),
                   [](const TensorDecl& a, const TensorDecl& b) { return a.name < b.name; });
  return tensors;
}

std::string decl_str(const TensorDecl& d) {
  return concat(safetensors_dtype_name(d.dtype), shape_str(d.shape));
}

// A write of a tensor that `declared` (keyed by tensor name) does not hold, into `target`.
template <typename Map>
[[noreturn]] void throw_undeclared(const std::string& name, const std::string& target,
                                   const Map& declared) {
  std::vector<std::string> names;
  names.reserve(declared.size());
  for (const auto& entry : declared) names.push_back(entry.first);
  throw Error(concat("cannot write tensor '", name, "' to ", target,
                     ": it was not declared when the writer was created (",
                     available_names(name, names), ")"));
}

// The declarations of `tensors` (each must be defined), and the tensors in name order: the
// order a writer lays them out in, so writing them in it is sequential.
std::vector<TensorDecl> declare(const NamedTensors& tensors, const std::string& where) {
  std::vector<TensorDecl> decls;
  decls.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (!t.defined())
      throw ConfigError(concat("cannot save '", where, "': tensor '", name, "' is undefined"));
    decls.push_back({name, t.dtype(), t.shape()});
  }
  return decls;
}

std::vector<const std::pair<std::string, Tensor>*> in_name_order(const NamedTensors& tensors) {
  std::vector<const std::pair<std::string, Tensor>*> sorted;
  sorted.reserve(tensors.size());
  for (const auto& entry : tensors) sorted.push_back(&entry);
  std::sort(sorted.begin(), sorted.end(),
            [](const auto* a, const auto* b) { return a->first < b->first; });
  return sorted;
}

}  // namespace

struct SafetensorsWriter::State {
  struct Slot {
    TensorDecl decl;
    int64_t begin = 0;  // offset in the data section
    bool written = false;
  };

  explicit State(const std::string& file_path) : path(file_path), file(file_path) {}

  std::string path;
  AtomicFileWriter file;
  std::map<std::string, Slot> slots;
  int64_t data_start = 0;  // file offset of the data section
  bool committed = false;

  Slot& slot_for_write(const std::string& name) {
    ST_CHECK(!committed, "cannot write tensor '", name, "' to '", path,
             "': the file was already committed");
    auto it = slots.find(name);
    if (it == slots.end()) throw_undeclared(name, concat("'", path, "'"), slots);
    ST_CHECK(!it->second.written, "cannot write tensor '", name, "' to '", path,
             "': it was already written (each tensor is written exactly once)");
    return it->second;
  }
};

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<TensorDecl> tensors,
                                     const std::map<std::string, std::string>& metadata) {
  std::vector<TensorDecl> sorted = sorted_by_name(std::move(tensors));
  check_tensor_names(path, sorted);

  // The reference writer puts __metadata__ first, then the tensors in file order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::map<std::string, State::Slot> slots;
  uint64_t offset = 0;
  for (TensorDecl& d : sorted) {
    const auto bytes = static_cast<uint64_t>(d.nbytes());
    nlohmann::ordered_json desc;
    desc["dtype"] = std::string(safetensors_dtype_name(d.dtype));
    desc["shape"] = d.shape;
    desc["data_offsets"] = {offset, offset + bytes};
    header[d.name] = std::move(desc);
    const std::string name = d.name;
    slots[name] = State::Slot{std::move(d), static_cast<int64_t>(offset), false};
    offset += bytes;
  }
  std::string text = header.dump();
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');

  state_ = std::make_unique<State>(path);
  state_->slots = std::move(slots);
  state_->data_start = static_cast<int64_t>(8 + text.size());
  unsigned char len[8];
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xffu);
  state_->file.write(len, 8);
  state_->file.write(text.data(), text.size());
}

SafetensorsWriter::~SafetensorsWriter() = default;
SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&&) noexcept = default;
SafetensorsWriter& SafetensorsWriter::operator=(SafetensorsWriter&&) noexcept = default;

const std::string& SafetensorsWriter::path() const {
  return state_->path;
}

void SafetensorsWriter::write(const std::string& name, const Tensor& tensor) {
  State::Slot& slot = state_->slot_for_write(name);
  const TensorDecl& d = slot.decl;
  ST_CHECK_SHAPE(tensor.defined() && tensor.dtype() == d.dtype && tensor.shape() == d.shape,
                 "cannot write tensor '", name, "' to '", state_->path, "': it is declared as ",
                 decl_str(d), " but the tensor given is ",
                 tensor.defined() ? tensor.describe() : std::string("undefined"));
  if (tensor.device().cpu_addressable()) {
    write(name, tensor.data_ptr(), tensor.nbytes());
  } else {
    // One tensor at a time in host memory: the most a streamed write ever holds.
    Tensor host = tensor.to(Device::host());
    write(name, host.data_ptr(), host.nbytes());
  }
}

void SafetensorsWriter::write(const std::string& name, const void* data, size_t bytes) {
  State::Slot& slot = state_->slot_for_write(name);
  const int64_t expected = slot.decl.nbytes();
  ST_CHECK_SHAPE(static_cast<int64_t>(bytes) == expected, "cannot write tensor '", name, "' to '",
                 state_->path, "': it is declared as ", decl_str(slot.decl), " (", expected,
                 " bytes) but ", bytes, " bytes were given");
  if (bytes > 0) state_->file.write_at(state_->data_start + slot.begin, data, bytes);
  slot.written = true;
}

void SafetensorsWriter::commit() {
  State& st = *state_;
  ST_CHECK(!st.committed, "'", st.path, "' was already committed");
  std::vector<std::string> missing;
  for (const auto& [name, slot] : st.slots)
    if (!slot.written) missing.push_back(name);
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 5; ++i)
      list += (i == 0 ? "'" : ", '") + missing[i] + "'";
    if (missing.size() > 5) list += ", ...";
    throw Error(concat("cannot commit '", st.path, "': ", missing.size(), " of its ",
                       st.slots.size(), " declared tensors were never written: ", list));
  }
  st.file.commit();
  st.committed = true;
}

void create_output_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw ConfigError(concat("cannot create the output directory '", dir, "': ", ec.message(),
                             "; choose a writable path"));
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter out(path, declare(tensors, path), metadata);
  for (const auto* entry : in_name_order(tensors)) out.write(entry->first, entry->second);
  out.commit();
}

namespace {

const std::regex& shard_name_pattern() {
  static const std::regex pattern(R"(model-\d{5}-of-\d{5}\.safetensors)");
  return pattern;
}

void remove_quietly(const fs::path& p) {
  std::error_code ec;
  fs::remove(p, ec);
}

}  // namespace

ShardedSafetensorsWriter::ShardedSafetensorsWriter(
    std::string dir, std::vector<TensorDecl> tensors, int64_t max_shard_bytes,
    const std::map<std::string, std::string>& metadata)
    : dir_(std::move(dir)) {
  if (max_shard_bytes <= 0)
    throw ConfigError(concat("cannot save checkpoint '", dir_,
                             "': max_shard_bytes must be positive, got ", max_shard_bytes));
  std::vector<TensorDecl> sorted = sorted_by_name(std::move(tensors));
  check_tensor_names(dir_, sorted);
  create_output_dir(dir_);
  for (const TensorDecl& d : sorted) total_bytes_ += d.nbytes();

  // Greedy packing in name order; a tensor larger than the limit gets a shard of its own. Only
  // names and sizes decide, so a writer that has none of the bytes yet splits like one that has.
  std::vector<std::vector<TensorDecl>> shards(1);
  if (total_bytes_ <= max_shard_bytes) {
    shards[0] = std::move(sorted);
  } else {
    int64_t shard_bytes = 0;
    for (TensorDecl& d : sorted) {
      const int64_t bytes = d.nbytes();
      if (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes) {
        shards.emplace_back();
        shard_bytes = 0;
      }
      shards.back().push_back(std::move(d));
      shard_bytes += bytes;
    }
  }
  sharded_ = total_bytes_ > max_shard_bytes;
  const fs::path root(dir_);
  for (size_t i = 0; i < shards.size(); ++i) {
    std::string name = kSingleCheckpointFile;
    if (sharded_) {
      char text[64];
      std::snprintf(text, sizeof(text), "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
      name = text;
    }
    for (const TensorDecl& d : shards[i]) file_of_[d.name] = i;
    files_.emplace_back((root / name).string(), std::move(shards[i]), metadata);
    file_names_.push_back(name);
  }
}

std::vector<std::string> ShardedSafetensorsWriter::file_names() const {
  std::vector<std::string> names = file_names_;
  if (sharded_) names.push_back(kCheckpointIndexFile);
  return names;
}

void ShardedSafetensorsWriter::write(const std::string& name, const Tensor& tensor) {
  auto it = file_of_.find(name);
  if (it == file_of_.end()) throw_undeclared(name, concat("checkpoint '", dir_, "'"), file_of_);
  files_[it->second].write(name, tensor);
}

std::vector<std::string> ShardedSafetensorsWriter::commit() {
  ST_CHECK(!committed_, "checkpoint '", dir_, "' was already committed");
  const fs::path root(dir_);
  std::error_code ec;
  for (SafetensorsWriter& file : files_) file.commit();
  if (!sharded_) {
    remove_quietly(root / kCheckpointIndexFile);
    for (const auto& e : fs::directory_iterator(root, ec))
      if (std::regex_match(e.path().filename().string(), shard_name_pattern()))
        remove_quietly(e.path());
  } else {
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    for (const auto& [name, file] : file_of_) weight_map[name] = file_names_[file];
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total_bytes_}};
    index["weight_map"] = std::move(weight_map);
    write_file_atomically((root / kCheckpointIndexFile).string(), index.dump(2) + "\n");

    remove_quietly(root / kSingleCheckpointFile);
    const std::set<std::string> ours(file_names_.begin(), file_names_.end());
    for (const auto& e : fs::directory_iterator(root, ec)) {
      const std::string fname = e.path().filename().string();
      if (std::regex_match(fname, shard_name_pattern()) && ours.count(fname) == 0)
        remove_quietly(e.path());
    }
  }
  committed_ = true;
  return file_names();
}

std::vector<std::string> save_sharded(const std::string& dir, const NamedTensors& tensors,
                                      int64_t max_shard_bytes,
                                      const std::map<std::string, std::string>& metadata) {
  ShardedSafetensorsWriter out(dir, declare(tensors, dir), max_shard_bytes, metadata);
  for (const auto* entry : in_name_order(tensors)) out.write(entry->first, entry->second);
  return out.commit();
}

// ---- checkpoints ------------------------------------------------------------------------------

SafetensorsCheckpoint SafetensorsCheckpoint::open(const std::string& dir_or_file) {
  SafetensorsCheckpoint ck;
  ck.path_ = dir_or_file;
  const fs::path root(dir_or_file);
  std::error_code ec;
  if (!fs::exists(root, ec))
    throw ConfigError(concat("checkpoint '", dir_or_file, "' does not exist"));

  if (!fs::is_directory(root, ec)) {
    ck.files_.push_back(SafetensorsFile::open(dir_or_file));
  } else if (fs::exists(root / kCheckpointIndexFile, ec)) {
    ck.has_index_ = true;
    const std::string index_path = (root / kCheckpointIndexFile).string();
    std::map<std::string, std::string> weight_map;
    {
      check_regular_file(index_path, "safetensors index");
      std::ifstream in(index_path, std::ios::binary);
      if (!in) throw ConfigError(concat("cannot open '", index_path, "': ", std::strerror(errno)));
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      nlohmann::json index;
      try {
        index = parse_json_input(text);
      } catch (const std::exception& e) {
        throw FormatError(concat(index_path, ": invalid JSON: ", e.what()));
      }
      if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
        throw FormatError(concat(index_path, ": missing the \"weight_map\" object"));
      for (const auto& [name, file] : index["weight_map"].items()) {
        if (!file.is_string())
          throw FormatError(concat(index_path, ": weight_map entry '", name,
                                   "' must be a file name, got ", file.dump()));
        weight_map[name] = file.get<std::string>();
      }
    }
    std::map<std::string, size_t> file_number;
    for (const auto& [name, file] : weight_map) {
      auto it = file_number.find(file);
      if (it == file_number.end()) {
        const fs::path shard = root / file;
        if (!fs::exists(shard, ec))
          throw FormatError(concat(index_path, ": tensor '", name, "' is mapped to '", file,
                                   "', which does not exist in ", dir_or_file));
        it = file_number.emplace(file, ck.files_.size()).first;
        ck.files_.push_back(SafetensorsFile::open(shard.string()));
      }
      if (!ck.files_[it->second].contains(name))
        throw FormatError(concat(index_path, ": tensor '", name, "' is mapped to '", file,
                                 "', but that file has no such tensor"));
      ck.file_index_[name] = it->second;
    }
  } else if (fs::exists(root / kSingleCheckpointFile, ec)) {
    ck.files_.push_back(SafetensorsFile::open((root / kSingleCheckpointFile).string()));
  } else {
    throw ConfigError(concat("model directory '", dir_or_file, "' holds neither ",
                             kSingleCheckpointFile, " nor ", kCheckpointIndexFile));
  }

  if (!ck.has_index_)
    for (const auto& name : ck.files_[0].names()) ck.file_index_[name] = 0;
  for (const auto& file : ck.files_)
    for (const auto& [k, v] : file.metadata()) ck.metadata_.emplace(k, v);
  return ck;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(file_index_.size());
  for (const auto& entry : file_index_) out.push_back(entry.first);
  return out;
}

int64_t SafetensorsCheckpoint::tensor_bytes() const {
  int64_t total = 0;
  for (const auto& [name, file] : file_index_) total += files_[file].info(name).nbytes();
  return total;
}

bool SafetensorsCheckpoint::contains(const std::string& name) const {
  return file_index_.count(name) > 0;
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(const std::string& name) const {
  auto it = file_index_.find(name);
  if (it == file_index_.end())
    throw FormatError(concat("checkpoint '", path_, "': no tensor '", name, "' (",
                             available_names(name, names()), ")"));
  return files_[it->second];
}

const TensorInfo& SafetensorsCheckpoint::info(const std::string& name) const {
  return file_of(name).info(name);
}

Tensor SafetensorsCheckpoint::load(const std::string& name, Device device,
                                   std::optional<DType> convert_to) const {
  return file_of(name).load(name, device, convert_to);
}

void SafetensorsCheckpoint::load_into(const std::string& name, Tensor& dst) const {
  file_of(name).load_into(name, dst);
}

}  // namespace shardtrain
