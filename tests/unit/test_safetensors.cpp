// safetensors: byte-exact round trips of every dtype, the golden checkpoint, sharded checkpoints,
// streamed writing (byte for byte the files of the in-memory writers), and a precise error for
// every kind of malformed file or misuse of a writer.
#include <gtest/gtest.h>

#include <unistd.h>
#include "expect_error.h"
#include "files.h"
#include "temp_dir.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>

#include "shardtrain/core/error.h"
#include "shardtrain/io/safetensors.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return tmp_.str(name); }

  // A file with the given JSON header (unpadded) and data bytes.
  std::string write_raw(const std::string& name, const std::string& header, size_t data_bytes,
                        int64_t claimed_header_len = -1) {
    const std::string p = path(name);
    std::ofstream out(p, std::ios::binary);
    uint64_t n =
        claimed_header_len >= 0 ? static_cast<uint64_t>(claimed_header_len) : header.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
    out << header;
    for (size_t i = 0; i < data_bytes; ++i) out.put(static_cast<char>(i));
    return p;
  }

  shardtrain::testing::TempDir tmp_{"safetensors"};
};

std::vector<char> bytes_of(const Tensor& t) {
  const char* p = static_cast<const char*>(t.data_ptr());
  return std::vector<char>(p, p + t.nbytes());
}

using shardtrain::testing::expect_error;
using shardtrain::testing::files_in;
using shardtrain::testing::read_file_bytes;

NamedTensors every_dtype() {
  std::vector<float> f = {1.5f, -2.25f, 3.0e-3f, 65504.0f, -0.0f, 1.0e-8f};
  return {
      {"f32", from_floats(f, {2, 3}, DType::F32)},
      {"bf16", from_floats(f, {3, 2}, DType::BF16)},
      {"f16", from_floats(f, {6}, DType::F16)},
      {"i32", from_ints({-7, 0, 2147483647, -2147483647 - 1}, {4}, DType::I32)},
      {"i64", from_ints({int64_t{1} << 50, -3, 42}, {1, 3}, DType::I64)},
      {"u8", from_ints({0, 1, 127, 128, 255}, {5}, DType::U8)},
      {"scalar", from_floats({7.0f}, {}, DType::F32)},
      {"empty", zeros({0, 3}, DType::F32)},
  };
}

TEST_F(SafetensorsTest, RoundTripsEveryDtypeByteForByte) {
  const NamedTensors tensors = every_dtype();
  const std::string p = path("all.safetensors");
  save_safetensors(p, tensors, {{"format", "pt"}, {"step", "12"}});

  // Exact layout: 8-byte length, header padded to a multiple of 8, then the data back to back.
  int64_t data_bytes = 0;
  for (const auto& [name, t] : tensors) data_bytes += static_cast<int64_t>(t.nbytes());
  std::ifstream in(p, std::ios::binary);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(p)),
            8 + static_cast<int64_t>(header_len) + data_bytes);
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  EXPECT_EQ(header.rfind("{\"__metadata__\":{\"format\":\"pt\",\"step\":\"12\"}", 0), 0u) << header;
  auto json = nlohmann::json::parse(header);
  EXPECT_EQ(json["bf16"]["dtype"], "BF16");
  EXPECT_EQ(json["bf16"]["data_offsets"], nlohmann::json::array({0, 12}));  // sorted by name

  SafetensorsFile f = SafetensorsFile::open(p);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"bf16", "empty", "f16", "f32", "i32", "i64",
                                                 "scalar", "u8"}));
  EXPECT_EQ(f.metadata().at("step"), "12");
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(f.contains(name));
    EXPECT_EQ(f.info(name).dtype, t.dtype());
    EXPECT_EQ(f.info(name).shape, t.shape());
    Tensor loaded = f.load(name);
    EXPECT_EQ(loaded.dtype(), t.dtype());
    EXPECT_EQ(loaded.shape(), t.shape());
    EXPECT_EQ(bytes_of(loaded), bytes_of(t));
  }
  // No temporary file is left behind by the atomic write.
  int files = 0;
  for (const auto& e : fs::directory_iterator(tmp_.path)) files += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, 1);
}

TEST_F(SafetensorsTest, ConvertsOnLoadAndIntoExistingTensors) {
  std::vector<float> values = {0.1f, -1.7f, 3.14159f, 1000.5f};
  const std::string p = path("conv.safetensors");
  save_safetensors(p, {{"w", from_floats(values, {2, 2})}});
  SafetensorsFile f = SafetensorsFile::open(p);

  Tensor bf = f.load("w", Device::cpu(), DType::BF16);
  EXPECT_EQ(bf.dtype(), DType::BF16);
  const auto* bits = bf.data<uint16_t>();
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(bits[i], float_to_bf16(values[i]));

  Tensor dst = zeros({2, 2}, DType::F16);
  f.load_into("w", dst);
  std::vector<float> got = dst.to_float_vector();
  for (size_t i = 0; i < values.size(); ++i)
    EXPECT_EQ(got[i], f16_to_float(float_to_f16(values[i])));

  Tensor host = f.load("w", Device::host());
  EXPECT_TRUE(host.device().is_host());
  EXPECT_EQ(host.to_float_vector(), values);
}

TEST_F(SafetensorsTest, LoadIsCountedUnderTheCurrentCategoryAndViewIsNot) {
  const std::string p = path("count.safetensors");
  save_safetensors(p, {{"w", zeros({100, 10})}});  // 4000 bytes: a multiple of 64 when rounded
  SafetensorsFile f = SafetensorsFile::open(p);
  Allocator& cpu = allocator_for(Device::cpu());
  const int64_t before = cpu.stats().in_use_of(MemoryCategory::Parameters);
  {
    CategoryScope scope(MemoryCategory::Parameters);
    Tensor w = f.load("w");
    EXPECT_EQ(cpu.stats().in_use_of(MemoryCategory::Parameters), before + 4032);
    EXPECT_EQ(w.category(), MemoryCategory::Parameters);
    const int64_t total = cpu.stats().total_in_use;
    Tensor v = f.view("w");
    EXPECT_EQ(cpu.stats().total_in_use, total);
    EXPECT_EQ(v.shape(), (Shape{100, 10}));
    EXPECT_EQ(v.to_float_vector(), w.to_float_vector());
  }
  EXPECT_EQ(cpu.stats().in_use_of(MemoryCategory::Parameters), before);
}

TEST_F(SafetensorsTest, ViewOutlivesTheFileObject) {
  const std::string p = path("view.safetensors");
  save_safetensors(p, {{"a", from_floats({1, 2, 3}, {3})}});
  Tensor v;
  { v = SafetensorsFile::open(p).view("a"); }
  EXPECT_EQ(v.to_float_vector(), (std::vector<float>{1, 2, 3}));
}

TEST_F(SafetensorsTest, GoldenCheckpointOpens) {
  const std::string p =
      std::string(SHARDTRAIN_TEST_DATA) + "/golden/llama-tiny-gqa/model.safetensors";
  SafetensorsFile f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.contains("model.embed_tokens.weight"));
  const TensorInfo& info = f.info("model.embed_tokens.weight");
  EXPECT_EQ(info.dtype, DType::F32);
  EXPECT_EQ(info.shape, (Shape{256, 64}));
  EXPECT_EQ(info.data_begin, 65536);
  EXPECT_EQ(info.data_end, 131072);
  // The loaded values are the raw file bytes at 8 + header length (2136) + 65536.
  Tensor w = f.load("model.embed_tokens.weight");
  std::ifstream in(p, std::ios::binary);
  in.seekg(8 + 2136 + 65536);
  std::vector<char> raw(65536);
  in.read(raw.data(), 65536);
  EXPECT_EQ(bytes_of(w), raw);
  SafetensorsCheckpoint ck =
      SafetensorsCheckpoint::open(std::string(SHARDTRAIN_TEST_DATA) + "/golden/llama-tiny-gqa");
  EXPECT_FALSE(ck.sharded());
  EXPECT_EQ(ck.names(), f.names());
}

TEST_F(SafetensorsTest, ShardedSaveAndLoad) {
  NamedTensors tensors;
  for (int i = 0; i < 5; ++i) {
    std::vector<float> v(1024);
    for (int j = 0; j < 1024; ++j) v[static_cast<size_t>(j)] = static_cast<float>(i * 1000 + j);
    tensors.push_back({"layer." + std::to_string(i), from_floats(v, {32, 32})});  // 4096 bytes
  }
  tensors.push_back({"big", zeros({4096})});  // 16384 bytes: larger than a shard, sorts first
  const std::string d = path("ckpt");
  auto written = save_sharded(d, tensors, 10000, {{"kind", "test"}});
  EXPECT_EQ(written, (std::vector<std::string>{
                         "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                         "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
                         "model.safetensors.index.json"}));
  std::ifstream in(d + "/model.safetensors.index.json");
  auto index = nlohmann::json::parse(in);
  EXPECT_EQ(index["metadata"]["total_size"], 5 * 4096 + 16384);
  EXPECT_EQ(index["weight_map"]["big"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["layer.0"], "model-00002-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["layer.1"], "model-00002-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["layer.2"], "model-00003-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["layer.4"], "model-00004-of-00004.safetensors");

  SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(d);
  EXPECT_TRUE(ck.sharded());
  EXPECT_EQ(ck.names().size(), 6u);
  EXPECT_EQ(ck.metadata().at("kind"), "test");
  for (const auto& [name, t] : tensors) EXPECT_EQ(bytes_of(ck.load(name)), bytes_of(t)) << name;
  EXPECT_EQ(ck.file_of("layer.3").path(), d + "/model-00003-of-00004.safetensors");

  // Saving again below the limit switches to a single file and removes the shards and index.
  written = save_sharded(d, tensors, 1 << 20);
  EXPECT_EQ(written, (std::vector<std::string>{"model.safetensors"}));
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(d)) files.push_back(e.path().filename().string());
  EXPECT_EQ(files, (std::vector<std::string>{"model.safetensors"}));
  SafetensorsCheckpoint single = SafetensorsCheckpoint::open(d);
  EXPECT_FALSE(single.sharded());
  for (const auto& [name, t] : tensors) EXPECT_EQ(bytes_of(single.load(name)), bytes_of(t));
}

TEST_F(SafetensorsTest, CheckpointErrors) {
  expect_error<ConfigError>([&] { SafetensorsCheckpoint::open(path("nowhere")); },
                            {"nowhere", "does not exist"});
  fs::create_directories(path("emptydir"));
  expect_error<ConfigError>([&] { SafetensorsCheckpoint::open(path("emptydir")); },
                            {"emptydir", "model.safetensors"});
  const std::string d = path("ck");
  save_sharded(d, {{"a", zeros({100})}, {"b", zeros({100})}}, 500);
  fs::remove(d + "/model-00002-of-00002.safetensors");
  expect_error<FormatError>(
      [&] { SafetensorsCheckpoint::open(d); },
      {"model.safetensors.index.json", "'b'", "model-00002-of-00002", "does not exist"});
  save_sharded(d, {{"a", zeros({100})}, {"b", zeros({100})}}, 1 << 20);
  SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(d);
  expect_error<FormatError>([&] { ck.load("c"); }, {d, "no tensor 'c'", "'a', 'b'"});
}

// ---- streamed writing -------------------------------------------------------------------------

std::vector<TensorDecl> declarations(const NamedTensors& tensors) {
  std::vector<TensorDecl> decls;
  for (const auto& [name, t] : tensors) decls.push_back({name, t.dtype(), t.shape()});
  return decls;
}

TEST_F(SafetensorsTest, StreamedFileEqualsSaveSafetensorsByteForByte) {
  const NamedTensors tensors = every_dtype();
  for (const bool with_metadata : {true, false}) {
    const std::map<std::string, std::string> metadata =
        with_metadata ? std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}
                      : std::map<std::string, std::string>{};
    const std::string reference = path("reference.safetensors");
    save_safetensors(reference, tensors, metadata);

    // Declared in one order, written in another, partly from raw bytes.
    std::vector<TensorDecl> decls = declarations(tensors);
    std::reverse(decls.begin(), decls.end());
    const std::string streamed = path("streamed.safetensors");
    SafetensorsWriter out(streamed, decls, metadata);
    for (size_t i : {3u, 0u, 7u, 5u, 1u, 6u, 2u, 4u}) {
      const auto& [name, t] = tensors[i];
      if (i % 2 == 0)
        out.write(name, t);
      else
        out.write(name, t.data_ptr(), t.nbytes());
    }
    EXPECT_FALSE(fs::exists(streamed)) << "the file must not appear before commit";
    out.commit();
    EXPECT_EQ(out.path(), streamed);
    const std::string want = read_file_bytes(reference);
    ASSERT_GT(want.size(), 8u);
    EXPECT_TRUE(read_file_bytes(streamed) == want) << "metadata " << with_metadata;
    // Only the two files: the temporary one was renamed.
    EXPECT_EQ(files_in(tmp_.str()),
              (std::vector<std::string>{"reference.safetensors", "streamed.safetensors"}));
    fs::remove(reference);
    fs::remove(streamed);
  }
}

TEST_F(SafetensorsTest, StreamedWriterErrorsNameTheTensor) {
  const std::string p = path("errors.safetensors");
  SafetensorsWriter out(
      p, {{"a", DType::F32, {2, 3}}, {"b", DType::BF16, {4}}, {"c", DType::I64, {}}});
  Tensor a = from_floats({1, 2, 3, 4, 5, 6}, {2, 3});
  out.write("a", a);
  expect_error<Error>([&] { out.write("a", a); }, {p, "'a'", "already written"});
  expect_error<ShapeError>([&] { out.write("b", a.data_ptr(), 6); },
                           {p, "'b'", "BF16[4]", "8 bytes", "6 bytes were given"});
  expect_error<ShapeError>([&] { out.write("b", zeros({4})); }, {p, "'b'", "BF16[4]", "f32[4]"});
  expect_error<ShapeError>(
      [&] {
        out.write("b", zeros({2, 2}, DType::BF16));
      },
      {p, "'b'", "BF16[4]", "[2, 2]"});
  expect_error<Error>([&] { out.write("d", a); }, {p, "'d'", "not declared"});
  out.write("c", from_ints({42}, {}, DType::I64));
  expect_error<Error>([&] { out.commit(); }, {p, "1 of its 3", "never written", "'b'"});
  EXPECT_FALSE(fs::exists(p));
  // The failed writes did not count: "b" can still be written, and then the file is complete.
  out.write("b", from_floats({1, 2, 3, 4}, {4}, DType::BF16));
  out.commit();
  SafetensorsFile f = SafetensorsFile::open(p);
  EXPECT_EQ(f.load("a").to_float_vector(), a.to_float_vector());
  EXPECT_EQ(f.load("b").to_float_vector(), (std::vector<float>{1, 2, 3, 4}));
  expect_error<Error>([&] { out.write("a", a); }, {p, "'a'", "already committed"});

  expect_error<ConfigError>(
      [&] {
        SafetensorsWriter(path("dup.safetensors"),
                          {{"x", DType::F32, {1}}, {"x", DType::F32, {2}}});
      },
      {"dup.safetensors", "'x' appears twice"});
  expect_error<ConfigError>(
      [&] {
        SafetensorsWriter(path("meta.safetensors"), {{"__metadata__", DType::F32, {1}}});
      },
      {"meta.safetensors", "invalid tensor name '__metadata__'"});
  EXPECT_EQ(files_in(tmp_.str()), (std::vector<std::string>{"errors.safetensors"}));
}

TEST_F(SafetensorsTest, NoFileAppearsWithoutCommit) {
  const std::string p = path("uncommitted.safetensors");
  {
    SafetensorsWriter out(p, declarations(every_dtype()));
    for (const auto& [name, t] : every_dtype()) out.write(name, t);
    // The bytes exist, under a temporary name only.
    std::vector<std::string> names = files_in(tmp_.str());
    ASSERT_EQ(names.size(), 1u);
    EXPECT_EQ(names[0].rfind("uncommitted.safetensors.tmp.", 0), 0u) << names[0];
  }
  EXPECT_TRUE(files_in(tmp_.str()).empty());

  const std::string d = path("dir");
  {
    ShardedSafetensorsWriter out(d, declarations(every_dtype()), 40);
    for (const auto& [name, t] : every_dtype()) out.write(name, t);
  }
  EXPECT_TRUE(files_in(d).empty());
}

TEST_F(SafetensorsTest, StreamedCheckpointEqualsSaveShardedByteForByte) {
  NamedTensors tensors = every_dtype();
  for (int i = 0; i < 6; ++i) {
    std::vector<float> v(100 + 37 * static_cast<size_t>(i));
    for (size_t j = 0; j < v.size(); ++j)
      v[j] = static_cast<float>(i) * 0.5f - static_cast<float>(j);
    tensors.push_back(
        {"layer." + std::to_string(i) + ".w",
         from_floats(v, {static_cast<int64_t>(v.size())}, i % 2 == 0 ? DType::F32 : DType::BF16)});
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  for (const int64_t max_shard_bytes : {int64_t{700}, int64_t{1} << 20}) {
    const std::string ref = path("ref"), streamed = path("streamed");
    std::vector<std::string> ref_files = save_sharded(ref, tensors, max_shard_bytes, metadata);

    std::vector<TensorDecl> decls = declarations(tensors);
    std::reverse(decls.begin(), decls.end());
    ShardedSafetensorsWriter out(streamed, decls, max_shard_bytes, metadata);
    EXPECT_EQ(out.file_names(), ref_files) << "the split is known from the declarations";
    for (size_t k = 0; k < tensors.size(); ++k) {
      const auto& [name, t] = tensors[(k * 5 + 3) % tensors.size()];  // 5 is coprime to 14
      out.write(name, t);
    }
    EXPECT_EQ(files_in(streamed).size(), ref_files.size() - (ref_files.size() > 1 ? 1 : 0));
    for (const std::string& f : ref_files) EXPECT_FALSE(fs::exists(streamed + "/" + f)) << f;
    EXPECT_EQ(out.commit(), ref_files);
    if (max_shard_bytes == 700)
      EXPECT_GE(ref_files.size(), 5u);  // several shards and the index
    else
      EXPECT_EQ(ref_files, (std::vector<std::string>{"model.safetensors"}));
    EXPECT_EQ(files_in(streamed), files_in(ref));
    for (const std::string& f : ref_files)
      EXPECT_TRUE(read_file_bytes(streamed + "/" + f) == read_file_bytes(ref + "/" + f)) << f;
    fs::remove_all(ref);
    fs::remove_all(streamed);
  }
  expect_error<Error>(
      [&] {
        ShardedSafetensorsWriter out(path("d"), declarations(tensors), 700);
        out.write("layer.9.w", zeros({1}));
      },
      {path("d"), "'layer.9.w'", "not declared"});
}

// ---- malformed files ----------------------------------------------------------------------

TEST_F(SafetensorsTest, TruncatedHeaderLength) {
  const std::string p = path("short.safetensors");
  std::ofstream(p, std::ios::binary) << "abc";
  expect_error<FormatError>([&] { SafetensorsFile::open(p); }, {p, "truncated", "3 bytes"});
}

TEST_F(SafetensorsTest, HeaderLengthPastEndOfFile) {
  const std::string p = write_raw("past.safetensors", "{}", 4, 1000);
  expect_error<FormatError>([&] { SafetensorsFile::open(p); },
                            {p, "header length 1000", "14-byte file"});
}

TEST_F(SafetensorsTest, InvalidJson) {
  const std::string p = write_raw("json.safetensors", "{\"a\": [1, 2", 0);
  expect_error<FormatError>([&] { SafetensorsFile::open(p); }, {p, "invalid JSON"});
}

TEST_F(SafetensorsTest, UnknownDtype) {
  const std::string p = write_raw("dtype.safetensors",
                                  R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})", 16);
  expect_error<FormatError>([&] { SafetensorsFile::open(p); }, {p, "'w'", "F64", "unsupported"});
}

TEST_F(SafetensorsTest, MissingField) {
  const std::string p =
      write_raw("field.safetensors", R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", 8);
  expect_error<FormatError>([&] { SafetensorsFile::open(p); }, {p, "'w'", "missing field 'shape'"});
}

TEST_F(SafetensorsTest, OffsetsPastEndOfData) {
  const std::string p = write_raw(
      "offsets.safetensors", R"({"w":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}})", 16);
  expect_error<FormatError>([&] { SafetensorsFile::open(p); },
                            {p, "'w'", "[0, 400]", "past the end of the data section (16 bytes"});
}

TEST_F(SafetensorsTest, SizeInconsistentWithShape) {
  const std::string p = write_raw(
      "size.safetensors", R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", 24);
  expect_error<FormatError>([&] { SafetensorsFile::open(p); },
                            {p, "'w'", "hold 16 bytes", "F32[2, 3] needs 24 bytes"});
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  const std::string p = write_raw("overlap.safetensors",
                                  R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                                  R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                                  24);
  expect_error<FormatError>([&] { SafetensorsFile::open(p); }, {p, "'a'", "'b'", "overlap"});
}

// The tensors must tile the data section: a name given twice (the JSON reader keeps the last
// entry, leaving the first one's bytes to no tensor) and bytes past the last tensor are refused.
TEST_F(SafetensorsTest, TensorsMustTileTheDataSection) {
  const std::string twice = write_raw("twice.safetensors",
                                      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                                      16);
  expect_error<FormatError>(
      [&] { SafetensorsFile::open(twice); },
      {twice, "bytes [0, 8) of the data section belong to no tensor", "a tensor named twice"});
  const std::string trailing = write_raw(
      "trailing.safetensors", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12);
  expect_error<FormatError>([&] { SafetensorsFile::open(trailing); },
                            {trailing, "holds 12 bytes but its tensors end at byte 8"});
  const std::string tiled = write_raw(
      "tiled.safetensors",
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[0],)"
      R"("data_offsets":[8,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}})",
      11);
  EXPECT_EQ(SafetensorsFile::open(tiled).names().size(), 3u);
}

// The parser would stop at a NUL and never read what follows it; a header nested thousands deep
// would overflow the stack when printed in a message.
TEST_F(SafetensorsTest, HeadersWithANulOrDeepNestingAreRefused) {
  const std::string nul = write_raw(
      "nul.safetensors",
      std::string(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})") + '\0' + "junk", 8);
  expect_error<FormatError>([&] { SafetensorsFile::open(nul); },
                            {nul, "the JSON header holds a NUL byte at offset 62"});
  const std::string deep = write_raw("deep.safetensors",
                                     R"({"a":{"dtype":"F32","shape":)" + std::string(100000, '[') +
                                         std::string(100000, ']') + R"(,"data_offsets":[0,0]}})",
                                     0);
  expect_error<FormatError>([&] { SafetensorsFile::open(deep); },
                            {deep, "nested deeper than 64 levels"});
}

TEST_F(SafetensorsTest, MissingTensorListsAvailableNames) {
  const std::string p = path("names.safetensors");
  save_safetensors(p, {{"model.norm.weight", zeros({4})}, {"lm_head.weight", zeros({2, 4})}});
  SafetensorsFile f = SafetensorsFile::open(p);
  expect_error<FormatError>([&] { f.load("model.norm.weights"); },
                            {p, "no tensor 'model.norm.weights'",
                             "did you mean 'model.norm.weight'", "'lm_head.weight'"});
}

TEST_F(SafetensorsTest, ShapeMismatchOnLoadInto) {
  const std::string p = path("shape.safetensors");
  save_safetensors(p, {{"w", zeros({4, 8})}});
  SafetensorsFile f = SafetensorsFile::open(p);
  Tensor dst = zeros({8, 4});
  expect_error<FormatError>([&] { f.load_into("w", dst); },
                            {p, "'w'", "[4, 8] in the file", "expects [8, 4]"});
}

TEST_F(SafetensorsTest, SaveRejectsDuplicateNames) {
  expect_error<ConfigError>(
      [&] {
        save_safetensors(path("dup.safetensors"), {{"a", zeros({1})}, {"a", zeros({2})}});
      },
      {"dup.safetensors", "'a' appears twice"});
  EXPECT_FALSE(fs::exists(path("dup.safetensors")));
}

}  // namespace
}  // namespace shardtrain
