// Data pipeline: byte tokenizer, HDF5 token datasets (and their validation), the deterministic
// sampler, micro-batch splitting, and the built-in corpus.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <unistd.h>
#include "expect_error.h"
#include "files.h"
#include "temp_dir.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include "shardtrain/core/error.h"
#include "shardtrain/core/hdf5.h"
#include "shardtrain/data/batch.h"
#include "shardtrain/data/corpus.h"
#include "shardtrain/data/prepare.h"
#include "shardtrain/data/sampler.h"
#include "shardtrain/data/splitmix.h"
#include "shardtrain/data/token_dataset.h"
#include "shardtrain/data/tokenizer.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

class DataTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return tmp_.str(name); }

  shardtrain::testing::TempDir tmp_{"data"};
};

using shardtrain::testing::expect_error;

// Tokens 0, 1, 2, ...: every window reveals where in the stream it starts.
TokenDataset counting_dataset(int64_t n) {
  std::vector<uint32_t> tokens(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tokens[static_cast<size_t>(i)] = static_cast<uint32_t>(i);
  return TokenDataset::from_tokens(std::move(tokens), 65536, "test", "counting");
}

// ---- tokenizer ------------------------------------------------------------------------------

TEST(ByteTokenizer, EncodesBytesAndRoundTrips) {
  ByteTokenizer tok;
  const std::string text = std::string("Hi \xff\x80", 5) + std::string(1, '\0') + "!";
  std::vector<uint32_t> ids = tok.encode(text);
  EXPECT_EQ(ids, (std::vector<uint32_t>{72, 105, 32, 255, 128, 0, 33}));
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(tok.vocab_size(), 256);
  expect_error<ConfigError>([&] { tok.decode({65, 256}); }, {"token 256", "position 1"});
  EXPECT_EQ(make_tokenizer("byte")->name(), "byte");
  expect_error<ConfigError>([] { make_tokenizer("bpe"); }, {"'bpe'", "byte"});
}

// ---- token datasets -------------------------------------------------------------------------

TEST_F(DataTest, TokenDatasetRoundTripUint16) {
  const std::string p = path("bytes.h5");
  std::vector<uint32_t> tokens = ByteTokenizer().encode("hello, world");
  write_token_dataset(p, tokens, 256, "byte");
  TokenDataset ds = TokenDataset::open(p);
  EXPECT_EQ(ds.tokens(), tokens);
  EXPECT_EQ(ds.vocab_size(), 256);
  EXPECT_EQ(ds.tokenizer(), "byte");
  EXPECT_EQ(ds.source(), p);
  h5::File f = h5::File::open(p);
  h5::TypeInfo type = f.open_dataset("tokens").type();
  EXPECT_EQ(type.describe(), "uint16");
  EXPECT_EQ(f.open_dataset("tokens").read_int64_attribute("vocab_size"), 256);
  // Nothing but the final file is left in the directory.
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp_.path), fs::directory_iterator()), 1);
}

// A memory-mapped dataset notices its file written over in place (the tokens under the run would
// change, or vanish with SIGBUS); another file renamed onto the path is no change to it.
TEST_F(DataTest, AMappedDatasetNoticesItsFileWrittenOverInPlace) {
  const std::string p = path("tokens.h5");
  std::vector<uint32_t> tokens(4096);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i % 251);
  write_token_dataset(p, tokens, 256, "byte");
  TokenDataset ds = TokenDataset::open(p);
  ASSERT_TRUE(ds.memory_mapped());
  EXPECT_EQ(ds.changed_on_disk(), "");
  // Renamed onto the path: the mapping keeps the file it opened.
  write_token_dataset(path("new.h5"), {1, 2, 3}, 256, "byte");
  fs::rename(path("new.h5"), p);
  EXPECT_EQ(ds.changed_on_disk(), "");
  EXPECT_EQ(ds.tokens(), tokens);
  // Written over in place (as cp onto an existing file does): noticed.
  TokenDataset reopened = TokenDataset::open(p);
  const auto size = fs::file_size(p);
  { std::ofstream(p, std::ios::in | std::ios::out | std::ios::binary | std::ios::app) << "x"; }
  EXPECT_NE(
      reopened.changed_on_disk().find("was written over in place (" + std::to_string(size) +
                                      " bytes when opened, " + std::to_string(size + 1) + " now)"),
      std::string::npos)
      << reopened.changed_on_disk();
  // Tokens held in memory are not affected by the file.
  EXPECT_EQ(TokenDataset::from_tokens({1, 2}, 256, "byte", p).changed_on_disk(), "");
}

TEST_F(DataTest, TokenDatasetRoundTripUint32ThroughManyAppends) {
  const std::string p = path("wide.h5");
  std::vector<uint32_t> all;
  {
    TokenDatasetWriter w(p, 100000, "custom");
    for (uint32_t chunk = 0; chunk < 3; ++chunk) {
      std::vector<uint32_t> part(70000);
      for (size_t i = 0; i < part.size(); ++i)
        part[i] = (chunk * 70000 + static_cast<uint32_t>(i)) % 99991;
      w.append(part);
      all.insert(all.end(), part.begin(), part.end());
    }
    EXPECT_FALSE(fs::exists(p));  // only the temporary file exists before commit
    w.commit();
  }
  TokenDataset ds = TokenDataset::open(p);
  EXPECT_EQ(h5::File::open(p).open_dataset("tokens").type().describe(), "uint32");
  EXPECT_EQ(ds.size(), 210000);
  EXPECT_EQ(ds.tokens(), all);
}

TEST_F(DataTest, WriterRejectsOutOfVocabularyTokensAndLeavesNoFile) {
  const std::string p = path("bad.h5");
  expect_error<ConfigError>(
      [&] {
        write_token_dataset(p, {1, 2, 300}, 256, "byte");
      },
      {p, "token 300", "position 2", "vocab_size 256"});
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp_.path), fs::directory_iterator()), 0);
}

// The finished dataset is renamed over the output path: never over a directory, FIFO or device.
TEST_F(DataTest, WriterRefusesAnOutputThatIsNotARegularFile) {
  const std::string fifo = path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error<ConfigError>(
      [&] {
        write_token_dataset(fifo, {1, 2}, 256, "byte");
      },
      {"cannot write the token dataset to '" + fifo +
       "': it exists and is not a regular file but a FIFO"});
  EXPECT_TRUE(fs::is_fifo(fifo));
  fs::create_directories(path("dir"));
  expect_error<ConfigError>(
      [&] { prepare_data("builtin", path("dir")); },
      {"but a directory; name a file in it, e.g. " + path("dir") + "/tokens.h5"});
  EXPECT_TRUE(fs::is_directory(path("dir")));
  // A regular file is replaced.
  std::ofstream(path("old.h5")) << "old";
  write_token_dataset(path("old.h5"), {1, 2}, 256, "byte");
  EXPECT_EQ(TokenDataset::open(path("old.h5")).tokens(), (std::vector<uint32_t>{1, 2}));
}

TEST_F(DataTest, MissingTokensDataset) {
  const std::string p = path("notokens.h5");
  {
    h5::File f = h5::File::create(p);
    f.create_dataset("ids", H5T_STD_U16LE, {10});
  }
  expect_error<FormatError>([&] { TokenDataset::open(p); }, {p, "no dataset 'tokens'"});
}

TEST_F(DataTest, MissingVocabSize) {
  const std::string p = path("novocab.h5");
  {
    h5::File f = h5::File::create(p);
    h5::Dataset ds = f.create_dataset("tokens", H5T_STD_U16LE, {10});
    std::vector<uint16_t> t(10, 1);
    ds.write(t.data(), H5T_NATIVE_UINT16);
    ds.write_string_attribute("tokenizer", "byte");
  }
  expect_error<FormatError>([&] { TokenDataset::open(p); }, {p, "no attribute 'vocab_size'"});
}

// The tokenizer's name is for the reader: a file without one (another writer's) opens, one
// whose name is not a string is malformed.
TEST_F(DataTest, TheTokenizerAttributeIsOptionalButMustBeAString) {
  for (const bool integer_name : {false, true}) {
    const std::string p = path(integer_name ? "intname.h5" : "noname.h5");
    {
      h5::File f = h5::File::create(p);
      h5::Dataset ds = f.create_dataset("tokens", H5T_STD_U16LE, {10});
      std::vector<uint16_t> t(10, 3);
      ds.write(t.data(), H5T_NATIVE_UINT16);
      ds.write_int64_attribute("vocab_size", 256);
      if (integer_name) ds.write_int64_attribute("tokenizer", 7);
    }
    if (integer_name) {
      expect_error<FormatError>([&] { TokenDataset::open(p); },
                                {p, "attribute 'tokenizer' is of type int64, expected a string"});
    } else {
      const TokenDataset data = TokenDataset::open(p);
      EXPECT_EQ(data.tokenizer(), "");
      EXPECT_EQ(data.size(), 10);
      EXPECT_EQ(data.vocab_size(), 256);
    }
  }
}

// Every layout reads back the same tokens, from any range (within a chunk, across chunks, to
// the partly used last chunk): mapped when stored as raw little-endian bytes (contiguous, or
// chunked as prepare-data writes), decoded into memory when compressed or big-endian.
TEST_F(DataTest, EveryStorageLayoutReadsTheSameTokens) {
  constexpr hsize_t kChunk = 1000;
  std::vector<uint32_t> tokens(10 * kChunk + 321);
  SplitMix64 rng(11);
  for (uint32_t& t : tokens) t = static_cast<uint32_t>(rng.below(70000));
  auto with_attributes = [](h5::Dataset& ds) {
    ds.write_int64_attribute("vocab_size", 70000);
    ds.write_string_attribute("tokenizer", "test");
  };
  // (name, element type, compressed, chunked, expect mapped, chunk size). More chunks than
  // h5::Dataset::kMaxChunksToMap are read into memory, with the reason.
  struct Layout {
    std::string name;
    hid_t type;
    bool deflate, chunked, mapped;
    hsize_t chunk = kChunk;
  };
  for (const Layout& layout : {Layout{"chunked", H5T_STD_U32LE, false, true, true},
                               Layout{"contiguous", H5T_STD_U32LE, false, false, true},
                               Layout{"compressed", H5T_STD_U32LE, true, true, false},
                               Layout{"big_endian", H5T_STD_U32BE, false, true, false},
                               Layout{"many_chunks", H5T_STD_U32LE, false, true, false, 2}}) {
    SCOPED_TRACE(layout.name);
    const std::string p = path(layout.name + ".h5");
    {
      h5::File f = h5::File::create(p);
      hsize_t dims = tokens.size();
      h5::Handle space(H5Screate_simple(1, &dims, nullptr), H5Sclose);
      h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
      if (layout.chunked) {
        ASSERT_GE(H5Pset_chunk(dcpl.get(), 1, &layout.chunk), 0);
      }
      if (layout.deflate) {
        ASSERT_GE(H5Pset_deflate(dcpl.get(), 4), 0);
      }
      hid_t id = H5Dcreate2(f.id(), "tokens", layout.type, space.get(), H5P_DEFAULT, dcpl.get(),
                            H5P_DEFAULT);
      ASSERT_GE(id, 0);
      h5::Dataset ds(h5::Handle(id, H5Dclose), p + ":/tokens");
      ds.write(tokens.data(), H5T_NATIVE_UINT32);
      with_attributes(ds);
    }
    TokenDataset ds = TokenDataset::open(p);
    EXPECT_EQ(ds.memory_mapped(), layout.mapped);
    if (layout.name == "many_chunks") {
      EXPECT_NE(ds.why_not_mapped().find("stored in 5161 chunks, more than the 4096"),
                std::string::npos)
          << ds.why_not_mapped();
    } else {
      EXPECT_EQ(ds.why_not_mapped(), "");
    }
    EXPECT_EQ(ds.tokens(), tokens);
    EXPECT_DOUBLE_EQ(ds.unigram_entropy_bits(), unigram_entropy_bits(tokens));
    for (int64_t begin : {int64_t{0}, int64_t{999}, int64_t{1000}, int64_t{4321}, int64_t{9950}}) {
      for (int64_t count : {int64_t{1}, int64_t{2}, int64_t{129}, int64_t{2500}}) {
        if (begin + count > ds.size()) continue;
        std::vector<uint32_t> got(static_cast<size_t>(count));
        ds.read(begin, count, got.data());
        EXPECT_TRUE(std::equal(got.begin(), got.end(), tokens.begin() + begin))
            << "[" << begin << ", " << begin + count << ")";
      }
    }
    // The last, partly used chunk to the end.
    std::vector<uint32_t> tail(400);
    ds.read(ds.size() - 400, 400, tail.data());
    EXPECT_TRUE(std::equal(tail.begin(), tail.end(), tokens.end() - 400));
  }
  // What prepare-data writes (uint16, 64Ki-element chunks) is mapped.
  write_token_dataset(path("written.h5"), {5, 6, 7}, 256, "byte");
  EXPECT_TRUE(TokenDataset::open(path("written.h5")).memory_mapped());
  // Its chunks grow with the size it expects (about 1024 of them, from 64 Ki tokens), so that a
  // large dataset stays mapped; each is allocated whole, so a small one keeps them small.
  auto chunk_of = [&](const std::string& file) {
    h5::File f = h5::File::open(file);
    h5::Handle ds(H5Dopen2(f.id(), "tokens", H5P_DEFAULT), H5Dclose);
    h5::Handle dcpl(H5Dget_create_plist(ds.get()), H5Pclose);
    hsize_t chunk = 0;
    EXPECT_EQ(H5Pget_chunk(dcpl.get(), 1, &chunk), 1);
    return chunk;
  };
  EXPECT_EQ(chunk_of(path("written.h5")), hsize_t{1} << 16);
  {
    TokenDatasetWriter writer(path("large.h5"), 256, "byte", int64_t{1} << 30);
    writer.append({1, 2, 3});
    writer.commit();
  }
  EXPECT_EQ(chunk_of(path("large.h5")), hsize_t{1} << 20) << "2^30 expected tokens / 1024";
  EXPECT_FALSE(load_token_source("builtin").memory_mapped());
}

// Files from other tools: HDF5 data after a user block (h5jam; the chunk addresses HDF5 before
// 1.14.4 reports leave it out), tokens reached through an external link (the target is what is
// mapped and watched), and an integer type that uses only some of its element's bits (HDF5
// decodes it; raw bytes would not).
TEST_F(DataTest, UserBlocksExternalLinksAndPartialBitsReadTheRightTokens) {
  constexpr hsize_t kChunk = 700;
  std::vector<uint32_t> tokens(5 * kChunk + 123);
  SplitMix64 rng(5);
  for (uint32_t& t : tokens) t = static_cast<uint32_t>(rng.below(60000));
  auto write = [&](const std::string& p, hid_t file_type, bool chunked, hsize_t user_block) {
    h5::Handle fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
    if (user_block > 0) {
      ASSERT_GE(H5Pset_userblock(fcpl.get(), user_block), 0);
    }
    h5::Handle file(H5Fcreate(p.c_str(), H5F_ACC_TRUNC, fcpl.get(), H5P_DEFAULT), H5Fclose);
    ASSERT_GE(file.get(), 0);
    hsize_t dims = tokens.size();
    h5::Handle space(H5Screate_simple(1, &dims, nullptr), H5Sclose);
    h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    if (chunked) {
      ASSERT_GE(H5Pset_chunk(dcpl.get(), 1, &kChunk), 0);
    }
    hid_t id = H5Dcreate2(file.get(), "tokens", file_type, space.get(), H5P_DEFAULT, dcpl.get(),
                          H5P_DEFAULT);
    ASSERT_GE(id, 0);
    h5::Dataset ds(h5::Handle(id, H5Dclose), p + ":/tokens");
    ds.write(tokens.data(), H5T_NATIVE_UINT32);
    ds.write_int64_attribute("vocab_size", 60000);
    ds.write_string_attribute("tokenizer", "test");
  };
  auto expect_tokens = [&](const std::string& p, bool mapped) {
    SCOPED_TRACE(p);
    TokenDataset ds = TokenDataset::open(p);
    EXPECT_EQ(ds.memory_mapped(), mapped);
    EXPECT_EQ(ds.tokens(), tokens);
  };
  write(path("ub_chunked.h5"), H5T_STD_U16LE, true, 512);
  expect_tokens(path("ub_chunked.h5"), true);
  write(path("ub_contiguous.h5"), H5T_STD_U16LE, false, 1024);
  expect_tokens(path("ub_contiguous.h5"), true);

  h5::Handle partial(H5Tcopy(H5T_STD_U32LE), H5Tclose);
  ASSERT_GE(H5Tset_precision(partial.get(), 16), 0);
  ASSERT_GE(H5Tset_offset(partial.get(), 16), 0);
  write(path("partial_bits.h5"), partial.get(), true, 0);
  expect_tokens(path("partial_bits.h5"), false);

  {
    h5::Handle file(H5Fcreate(path("link.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT),
                    H5Fclose);
    ASSERT_GE(H5Lcreate_external(path("ub_chunked.h5").c_str(), "/tokens", file.get(), "tokens",
                                 H5P_DEFAULT, H5P_DEFAULT),
              0);
  }
  expect_tokens(path("link.h5"), true);
  TokenDataset linked = TokenDataset::open(path("link.h5"));
  EXPECT_EQ(linked.changed_on_disk(), "");
  {
    std::ofstream(path("ub_chunked.h5"),
                  std::ios::in | std::ios::out | std::ios::binary | std::ios::app)
        << "x";
  }
  EXPECT_NE(linked.changed_on_disk().find("holds its tokens in '" + path("ub_chunked.h5") +
                                          "', which was written over in place"),
            std::string::npos)
      << linked.changed_on_disk();
}

TEST_F(DataTest, TokenAtOrAboveVocabSize) {
  const std::string p = path("oov.h5");
  {
    h5::File f = h5::File::create(p);
    h5::Dataset ds = f.create_dataset("tokens", H5T_STD_U16LE, {5});
    std::vector<uint16_t> t = {1, 2, 9, 10, 3};
    ds.write(t.data(), H5T_NATIVE_UINT16);
    ds.write_int64_attribute("vocab_size", 10);
    ds.write_string_attribute("tokenizer", "byte");
  }
  expect_error<FormatError>([&] { TokenDataset::open(p); },
                            {p, "token 10 at position 3", "vocab_size 10"});
}

// Datasets whose elements are not all stored in the file would read as fill values (zeros) and
// train on them in silence: never written (contiguous), chunks never written (an extendible
// dataset grown without its data), and a virtual dataset whose source file is missing.
TEST_F(DataTest, UnwrittenOrElsewhereStoredTokensAreRefused) {
  auto with_attributes = [](h5::Dataset& ds) {
    ds.write_int64_attribute("vocab_size", 256);
    ds.write_string_attribute("tokenizer", "byte");
  };
  const std::string contiguous = path("unwritten.h5");
  {
    h5::File f = h5::File::create(contiguous);
    h5::Dataset ds = f.create_dataset("tokens", H5T_STD_U16LE, {4096});
    with_attributes(ds);
  }
  expect_error<FormatError>([&] { TokenDataset::open(contiguous); },
                            {contiguous, "never completely written", "4096 elements"});

  const std::string chunked = path("unwritten-chunks.h5");
  {
    h5::File f = h5::File::create(chunked);
    h5::Dataset ds = f.create_extendible_1d("tokens", H5T_STD_U16LE, 1024);
    std::vector<uint16_t> first(1024, 7);
    ds.append(first.data(), H5T_NATIVE_UINT16, first.size());
    with_attributes(ds);
    // Grown to 4096 elements with only the first chunk written.
    const hsize_t grown = 4096;
    ASSERT_GE(H5Dset_extent(ds.id(), &grown), 0);
  }
  expect_error<FormatError>([&] { TokenDataset::open(chunked); },
                            {chunked, "never completely written"});

  const std::string virtual_path = path("virtual.h5");
  {
    hid_t file = H5Fcreate(virtual_path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    const hsize_t n = 4096;
    hid_t space = H5Screate_simple(1, &n, nullptr);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    ASSERT_GE(H5Pset_virtual(dcpl, space, path("missing-source.h5").c_str(), "tokens", space), 0);
    hid_t ds = H5Dcreate2(file, "tokens", H5T_STD_U16LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    ASSERT_GE(ds, 0);
    H5Dclose(ds);
    H5Pclose(dcpl);
    H5Sclose(space);
    H5Fclose(file);
    h5::File f = h5::File::open(virtual_path, true);
    h5::Dataset tokens = f.open_dataset("tokens");
    with_attributes(tokens);
  }
  expect_error<FormatError>([&] { TokenDataset::open(virtual_path); },
                            {virtual_path, "virtual dataset"});
}

TEST_F(DataTest, WrongTypeAndRank) {
  const std::string p = path("signed.h5");
  {
    h5::File f = h5::File::create(p);
    f.create_dataset("tokens", H5T_STD_I64LE, {4});
  }
  expect_error<FormatError>([&] { TokenDataset::open(p); }, {p, "int64", "uint16 or uint32"});
  const std::string q = path("rank.h5");
  {
    h5::File f = h5::File::create(q);
    f.create_dataset("tokens", H5T_STD_U16LE, {2, 3});
  }
  expect_error<FormatError>([&] { TokenDataset::open(q); }, {q, "rank 2"});
}

TEST_F(DataTest, NotAnHdf5File) {
  const std::string p = path("text.h5");
  std::ofstream(p) << "just some text, not HDF5\n";
  expect_error<FormatError>([&] { TokenDataset::open(p); }, {p, "not an HDF5 file"});
  expect_error<ConfigError>([&] { TokenDataset::open(path("absent.h5")); },
                            {"absent.h5", "does not exist"});
}

TEST_F(DataTest, TooShortForOneWindow) {
  const std::string p = path("short.h5");
  write_token_dataset(p, std::vector<uint32_t>(16, 7), 256, "byte");
  TokenDataset ds = TokenDataset::open(p);
  SamplerConfig cfg;
  cfg.seq_len = 16;
  expect_error<ConfigError>([&] { Sampler(ds, Split::Train, cfg); },
                            {p, "16 tokens", "seq_len + 1 = 17"});
  cfg.seq_len = 15;
  EXPECT_EQ(Sampler(ds, Split::Train, cfg).num_windows(), 1);
  cfg.eval_fraction = 0.5;  // 8 held-out tokens: too few for a window of 16
  expect_error<ConfigError>([&] { Sampler(ds, Split::Eval, cfg); },
                            {p, "held-out", "8 tokens", "a larger data.eval_fraction"});
}

TEST_F(DataTest, DatasetsAndAttributesThroughHdf5) {
  const std::string p = path("arrays.h5");
  const std::vector<int64_t> values = {-5, int64_t{1} << 40, 7};
  {
    h5::File f = h5::File::create(p);
    h5::Dataset ds = f.create_dataset("b", H5T_STD_I64LE, {3});
    ds.write(values.data(), H5T_NATIVE_INT64);
    f.write_double_attribute("lr", 0.25);
    f.close();
  }
  h5::File f = h5::File::open(p);
  h5::Dataset ds = f.open_dataset("b");
  EXPECT_EQ(ds.dims(), (std::vector<hsize_t>{3}));
  std::vector<int64_t> back(3);
  ds.read(back.data(), H5T_NATIVE_INT64);
  EXPECT_EQ(back, values);
  EXPECT_EQ(f.read_double_attribute("lr"), 0.25);
  expect_error<FormatError>([&] { f.read_string_attribute("lr"); }, {p, "'lr'", "string"});
  expect_error<FormatError>([&] { f.open_dataset("c"); }, {p, "no dataset 'c'"});

  // Unsigned 64-bit attributes read as they are, or are refused past int64 (HDF5's own
  // conversion would saturate them into INT64_MAX without a word).
  const std::string u = path("unsigned.h5");
  {
    h5::File w = h5::File::create(u);
    for (const auto& [name, value] :
         {std::pair<const char*, uint64_t>{"small", 1234}, {"huge", ~uint64_t{0}}}) {
      h5::Handle space(H5Screate(H5S_SCALAR), H5Sclose);
      hid_t a = H5Acreate2(w.id(), name, H5T_STD_U64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT);
      ASSERT_GE(a, 0);
      ASSERT_GE(H5Awrite(a, H5T_NATIVE_UINT64, &value), 0);
      H5Aclose(a);
    }
    w.close();
  }
  h5::File r = h5::File::open(u);
  EXPECT_EQ(r.read_int64_attribute("small"), 1234);
  expect_error<FormatError>([&] { r.read_int64_attribute("huge"); },
                            {u, "attribute 'huge' holds 18446744073709551615, past the largest"});
}

// ---- sampler --------------------------------------------------------------------------------

TEST(Sampler, TargetsAreInputsShiftedByOne) {
  TokenDataset ds = counting_dataset(1000);
  SamplerConfig cfg;
  cfg.seq_len = 16;
  cfg.seed = 3;
  Sampler s(ds, Split::Train, cfg);
  EXPECT_EQ(s.num_windows(), 999 / 16);
  Batch b = s.next_batch(4);
  EXPECT_EQ(b.input_ids.shape(), (Shape{4, 16}));
  EXPECT_EQ(b.targets.shape(), (Shape{4, 16}));
  EXPECT_EQ(b.input_ids.dtype(), DType::I64);
  EXPECT_TRUE(b.input_ids.device().is_cpu());
  EXPECT_EQ(b.num_target_tokens, 64);
  auto in = b.input_ids.to_int_vector();
  auto tg = b.targets.to_int_vector();
  for (int r = 0; r < 4; ++r) {
    const int64_t start = in[static_cast<size_t>(r * 16)];
    EXPECT_EQ(start % 16, 0);
    EXPECT_EQ(start, s.window_start(r));
    for (int t = 0; t < 16; ++t) {
      EXPECT_EQ(in[static_cast<size_t>(r * 16 + t)], start + t);
      EXPECT_EQ(tg[static_cast<size_t>(r * 16 + t)], start + t + 1);
    }
  }
}

std::vector<int64_t> starts_of(Sampler& s, int64_t batches, int64_t batch_size) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < batches; ++i) {
    auto v = s.next_batch(batch_size).input_ids.to_int_vector();
    for (int64_t r = 0; r < batch_size; ++r) out.push_back(v[static_cast<size_t>(r * s.seq_len())]);
  }
  return out;
}

TEST(Sampler, EachEpochIsASeededPermutation) {
  TokenDataset ds = counting_dataset(1001);  // 1000 / 10 = 100 windows
  SamplerConfig cfg;
  cfg.seq_len = 10;
  cfg.seed = 11;
  Sampler a(ds, Split::Train, cfg), b(ds, Split::Train, cfg);
  std::vector<int64_t> sa = starts_of(a, 60, 5);  // three epochs
  EXPECT_EQ(sa, starts_of(b, 60, 5));
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::vector<int64_t> e(sa.begin() + epoch * 100, sa.begin() + (epoch + 1) * 100);
    std::vector<int64_t> sorted = e;
    std::sort(sorted.begin(), sorted.end());
    for (int k = 0; k < 100; ++k) EXPECT_EQ(sorted[static_cast<size_t>(k)], k * 10);
    EXPECT_NE(e, sorted);  // shuffled
  }
  EXPECT_NE(std::vector<int64_t>(sa.begin(), sa.begin() + 100),
            std::vector<int64_t>(sa.begin() + 100, sa.begin() + 200));  // new order per epoch
  EXPECT_EQ(a.state(), (SamplerState{11, 3, 0, ds.checksum()}));
  cfg.seed = 12;
  Sampler c(ds, Split::Train, cfg);
  EXPECT_NE(starts_of(c, 20, 5), std::vector<int64_t>(sa.begin(), sa.begin() + 100));
}

TEST(Sampler, RestoreAndSkipContinueIdentically) {
  TokenDataset ds = counting_dataset(2000);
  SamplerConfig cfg;
  cfg.seq_len = 8;
  cfg.seed = 5;
  Sampler a(ds, Split::Train, cfg);
  starts_of(a, 70, 4);  // 280 windows: into the second epoch (249 per epoch)
  SamplerState saved = a.state();
  EXPECT_EQ(saved, (SamplerState{5, 1, 280 - 249, ds.checksum()}));
  std::vector<int64_t> expected = starts_of(a, 80, 4);

  cfg.seed = 999;  // the state carries the seed
  Sampler b(ds, Split::Train, cfg);
  b.restore(saved);
  EXPECT_EQ(starts_of(b, 80, 4), expected);

  cfg.seed = 5;
  Sampler c(ds, Split::Train, cfg);
  c.skip(280);
  EXPECT_EQ(c.state(), saved);
  EXPECT_EQ(starts_of(c, 80, 4), expected);

  expect_error<ConfigError>([&] { b.restore({5, 0, 249}); }, {"position 249", "[0, 249)"});
  expect_error<ConfigError>([&] { b.restore({5, -3, 6}); }, {"epoch -3", "the epoch is negative"});
}

// The checksum covers every token: one token changed anywhere changes it; the same tokens read
// from a file (memory-mapped) give the same checksum as in memory.
TEST_F(DataTest, ChecksumCoversEveryToken) {
  std::vector<uint32_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>((i * 31) % 256);
  const uint64_t sum = TokenDataset::from_tokens(tokens, 256, "bytes").checksum();
  write_token_dataset(path("t.h5"), tokens, 256, "bytes");
  EXPECT_EQ(TokenDataset::open(path("t.h5")).checksum(), sum);
  tokens[3333] ^= 1;
  EXPECT_NE(TokenDataset::from_tokens(tokens, 256, "bytes").checksum(), sum);
}

// Each rank reads only its rows of the global batch; together the ranks read exactly the
// global batch, and every rank's sampler ends where the whole batch would leave it, across
// epoch boundaries too.
TEST(Sampler, RanksReadTheirRowsOfTheGlobalBatch) {
  TokenDataset ds = counting_dataset(600);
  SamplerConfig cfg;
  cfg.seq_len = 8;  // 74 windows per epoch
  cfg.seed = 3;
  for (int64_t world : {1, 2, 3, 4}) {
    const int64_t global = 12;
    const int64_t per_rank = global / world;
    Sampler whole(ds, Split::Train, cfg);
    std::vector<Sampler> ranks(static_cast<size_t>(world), Sampler(ds, Split::Train, cfg));
    for (int step = 0; step < 15; ++step) {  // 180 windows: two epoch boundaries
      std::vector<int64_t> expected = whole.next_batch(global).input_ids.to_int_vector();
      std::vector<int64_t> gathered;
      for (int64_t r = 0; r < world; ++r) {
        Batch b = ranks[static_cast<size_t>(r)].next_batch_rows(global, r * per_rank, per_rank);
        ASSERT_EQ(b.batch_size(), per_rank);
        EXPECT_EQ(b.num_target_tokens, per_rank * 8);
        std::vector<int64_t> ids = b.input_ids.to_int_vector();
        gathered.insert(gathered.end(), ids.begin(), ids.end());
        EXPECT_EQ(ranks[static_cast<size_t>(r)].state(), whole.state()) << "world " << world;
      }
      EXPECT_EQ(gathered, expected) << "world " << world << " step " << step;
    }
  }
  Sampler s(ds, Split::Train, cfg);
  EXPECT_THROW(s.next_batch_rows(4, 3, 2), Error);
  EXPECT_THROW(s.next_batch_rows(4, -1, 2), Error);
}

TEST(Sampler, TrainAndEvalAreDisjoint) {
  TokenDataset ds = counting_dataset(1000);
  SamplerConfig cfg;
  cfg.seq_len = 16;
  cfg.eval_fraction = 0.2;
  Sampler train(ds, Split::Train, cfg);
  cfg.shuffle = false;
  Sampler eval(ds, Split::Eval, cfg);
  EXPECT_EQ(train.split_end(), 800);
  EXPECT_EQ(eval.split_begin(), 800);
  EXPECT_EQ(train.num_windows(), 799 / 16);
  EXPECT_EQ(eval.num_windows(), 199 / 16);
  // Every token a training batch touches (inputs and targets) lies below 800; eval above.
  for (int i = 0; i < train.num_windows(); ++i) {
    Batch b = train.next_batch(1);
    for (int64_t t : b.targets.to_int_vector()) EXPECT_LT(t, 800);
  }
  for (int i = 0; i < eval.num_windows(); ++i) {
    Batch b = eval.next_batch(1);
    auto in = b.input_ids.to_int_vector();
    EXPECT_EQ(in[0], 800 + 16 * i);  // unshuffled: stream order
    for (int64_t t : in) EXPECT_GE(t, 800);
    for (int64_t t : b.targets.to_int_vector()) EXPECT_LT(t, 1000);
  }
}

TEST(Batch, SplitsIntoMicroBatchesSharingStorage) {
  TokenDataset ds = counting_dataset(500);
  SamplerConfig cfg;
  cfg.seq_len = 6;
  Sampler s(ds, Split::Train, cfg);
  Batch b = s.next_batch(8);
  std::vector<Batch> micro = split_batch(b, 4);
  ASSERT_EQ(micro.size(), 4u);
  auto all = b.input_ids.to_int_vector();
  for (int m = 0; m < 4; ++m) {
    EXPECT_EQ(micro[static_cast<size_t>(m)].input_ids.shape(), (Shape{2, 6}));
    EXPECT_EQ(micro[static_cast<size_t>(m)].num_target_tokens, 12);
    auto part = micro[static_cast<size_t>(m)].input_ids.to_int_vector();
    EXPECT_EQ(part, std::vector<int64_t>(all.begin() + m * 12, all.begin() + (m + 1) * 12));
  }
  // Ignored targets are not counted.
  b.targets.data<int64_t>()[13] = kIgnoreIndex;
  EXPECT_EQ(b.slice(2, 2).num_target_tokens, 11);
  EXPECT_EQ(split_batch(b, 4)[1].num_target_tokens, 11);
  expect_error<ConfigError>([&] { split_batch(b, 3); }, {"8 sequences", "3"});
}

// ---- corpus ---------------------------------------------------------------------------------

TEST(Corpus, NumberWords) {
  EXPECT_EQ(number_word(0), "zero");
  EXPECT_EQ(number_word(13), "thirteen");
  EXPECT_EQ(number_word(40), "forty");
  EXPECT_EQ(number_word(42), "forty-two");
  EXPECT_EQ(number_word(305), "three hundred and five");
}

TEST(Corpus, UnigramEntropy) {
  EXPECT_DOUBLE_EQ(unigram_entropy_bits({0, 1, 2, 3}), 2.0);
  EXPECT_DOUBLE_EQ(unigram_entropy_bits({5, 5, 5}), 0.0);
  EXPECT_DOUBLE_EQ(unigram_entropy_bits({1, 1, 70000, 70000}), 1.0);
}

TEST(Corpus, DeterministicSizedAsciiWithLearnableStructure) {
  const std::string text = builtin_corpus();
  EXPECT_EQ(static_cast<int64_t>(text.size()), kBuiltinCorpusBytes);
  EXPECT_GE(text.size(), 1200000u);
  EXPECT_EQ(text, generate_corpus(kBuiltinCorpusBytes, kBuiltinCorpusSeed));
  EXPECT_NE(text.substr(0, 4096), generate_corpus(4096, kBuiltinCorpusSeed + 1));
  EXPECT_EQ(generate_corpus(1000, 7), generate_corpus(5000, 7).substr(0, 1000));
  for (char c : text) ASSERT_TRUE(c == '\n' || (c >= 32 && c < 127)) << int(c);

  std::vector<uint32_t> tokens = ByteTokenizer().encode(text);
  const double unigram = unigram_entropy_bits(tokens);
  EXPECT_GT(unigram, 3.0);
  EXPECT_LT(unigram, 5.0);
  // Context predicts much: the entropy of a byte given the three before it is far lower.
  std::map<uint32_t, std::map<uint32_t, int64_t>> counts;
  for (size_t i = 3; i < tokens.size(); ++i)
    ++counts[(tokens[i - 3] << 16) | (tokens[i - 2] << 8) | tokens[i - 1]][tokens[i]];
  double conditional = 0.0;
  for (const auto& [ctx, next] : counts) {
    int64_t total = 0;
    for (const auto& e : next) total += e.second;
    for (const auto& e : next) {
      const double p = static_cast<double>(e.second) / static_cast<double>(total);
      conditional -= static_cast<double>(e.second) * std::log2(p);
    }
  }
  conditional /= static_cast<double>(tokens.size() - 3);
  EXPECT_LT(conditional, 0.5 * unigram) << "unigram " << unigram << " conditional " << conditional;
}

TEST(Corpus, ArithmeticFactsAreTrue) {
  std::map<std::string, int> value;
  for (int n = 0; n <= 200; ++n) value[number_word(n)] = n;
  const std::string text = generate_corpus(300000, 99);
  const std::regex fact(R"(([A-Za-z-]+) (plus|minus|times) ([a-z-]+) is ([a-z-]+)\.)");
  int checked = 0;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), fact); it != std::sregex_iterator();
       ++it) {
    const auto& m = *it;
    std::string first = m[1];
    first[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(first[0])));
    if (!value.count(first) || !value.count(m[3]) || !value.count(m[4])) continue;  // cut at edge
    const int a = value[first], b = value[m[3]], c = value[m[4]];
    const int expected = m[2] == "plus" ? a + b : m[2] == "minus" ? a - b : a * b;
    EXPECT_EQ(c, expected) << m[0];
    ++checked;
  }
  EXPECT_GT(checked, 500);
}

// data.path: the file's content decides what it is; a name that disagrees is an error.
TEST_F(DataTest, DataPathIsTakenByContentAndItsNameMustAgree) {
  const std::string text = path("corpus.txt");
  std::ofstream(text) << "abca";
  EXPECT_EQ(load_token_source(text).tokens(), (std::vector<uint32_t>{97, 98, 99, 97}));
  prepare_data(text, path("tokens.h5"));
  EXPECT_EQ(load_token_source(path("tokens.h5")).tokens(), load_token_source(text).tokens());
  // Any name but .txt for a dataset: the signature, not the extension, makes it one.
  fs::copy_file(path("tokens.h5"), path("tokens.bin"));
  EXPECT_EQ(load_token_source(path("tokens.bin")).tokens(), load_token_source(text).tokens());

  // A dataset named .txt would be trained on as the bytes of its HDF5 structure.
  fs::copy_file(path("tokens.h5"), path("tokens.txt"));
  expect_error<ConfigError>(
      [&] { load_token_source(path("tokens.txt")); },
      {"data.path '" + path("tokens.txt") + "' is named .txt but is an HDF5 file"});
  // Text under another name: say how to use it.
  fs::copy_file(text, path("corpus.md"));
  expect_error<ConfigError>([&] { load_token_source(path("corpus.md")); },
                            {"data.path '" + path("corpus.md") +
                                 "' is not an HDF5 token dataset: give a text file the "
                                 ".txt extension",
                             "shardtrain prepare-data --input " + path("corpus.md")});
  // Binary data under another name: neither renaming nor converting it would help.
  std::ofstream(path("array.bin"), std::ios::binary) << std::string("ab\0\1cd", 6);
  expect_error<ConfigError>([&] { load_token_source(path("array.bin")); },
                            {"is neither an HDF5 token dataset nor text (a NUL byte at offset 2"});
  // A binary file named .txt.
  std::ofstream(path("array.txt"), std::ios::binary) << std::string("ab\0\1cd", 6);
  expect_error<ConfigError>([&] { load_token_source(path("array.txt")); },
                            {"holds a NUL byte at offset 2, so it is not text"});
  expect_error<ConfigError>([&] { load_token_source(path("absent.txt")); },
                            {"data.path '" + path("absent.txt") + "' does not exist"});
  expect_error<ConfigError>([&] { load_token_source(tmp_.path.string()); },
                            {"is not a regular file"});
}

TEST_F(DataTest, PrepareDataFromBuiltinAndFile) {
  const std::string out = path("builtin.h5");
  PrepareSummary s = prepare_data("builtin", out, "byte");
  EXPECT_EQ(s.num_tokens, kBuiltinCorpusBytes);
  TokenDataset ds = TokenDataset::open(out);
  const std::vector<uint32_t> expected = ByteTokenizer().encode(builtin_corpus());
  EXPECT_EQ(ds.tokens(), expected);
  EXPECT_EQ(ds.tokenizer(), "byte");
  EXPECT_DOUBLE_EQ(s.unigram_entropy_bits, unigram_entropy_bits(expected));

  const std::string txt = path("in.txt");
  std::ofstream(txt) << "abcabc";
  PrepareSummary t = prepare_data(txt, path("txt.h5"));
  EXPECT_EQ(t.num_tokens, 6);
  EXPECT_DOUBLE_EQ(t.unigram_entropy_bits, std::log2(3.0));
  EXPECT_EQ(TokenDataset::open(path("txt.h5")).tokens(),
            (std::vector<uint32_t>{97, 98, 99, 97, 98, 99}));

  expect_error<ConfigError>([&] { prepare_data(path("missing.txt"), path("x.h5")); },
                            {"missing.txt", "builtin"});
  expect_error<ConfigError>([&] { prepare_data("builtin", path("y.h5"), "wordpiece"); },
                            {"'wordpiece'"});
  EXPECT_FALSE(fs::exists(path("x.h5")));
  // A token dataset is not text, and the input is never the file the output replaces.
  const std::string before = shardtrain::testing::read_file_bytes(path("txt.h5"));
  expect_error<ConfigError>([&] { prepare_data(path("txt.h5"), path("txt.h5")); },
                            {"--input and --output are the same file"});
  expect_error<ConfigError>([&] { prepare_data(path("txt.h5"), path("z.h5")); },
                            {"is an HDF5 file"});
  EXPECT_EQ(shardtrain::testing::read_file_bytes(path("txt.h5")), before);
}

// Output names that cannot be a token dataset are refused before any input is read; input that is
// not text is refused; a stop between chunks leaves no file, temporary or final.
TEST_F(DataTest, PrepareDataRefusesBadNamesAndBinaryInputAndStopsCleanly) {
  const std::string txt = path("in.txt");
  std::ofstream(txt) << "some text";
  expect_error<ConfigError>([&] { prepare_data(txt, ""); }, {"--output is empty"});
  expect_error<ConfigError>([&] { prepare_data(txt, path("tokens.TXT")); },
                            {"is named like text", "name it .h5"});
  expect_error<ConfigError>([&] { prepare_data(txt, path("nowhere/tokens.h5")); },
                            {"the directory of --output", "does not exist: create it first"});
  {
    std::ofstream binary(path("packed.txt"), std::ios::binary);
    binary << "abc";
    binary.put('\0');
    binary << "def";
  }
  expect_error<ConfigError>([&] { prepare_data(path("packed.txt"), path("packed.h5")); },
                            {"holds a NUL byte at offset 3", "not text"});
  int asked = 0;
  expect_error<Error>(
      [&] { prepare_data(txt, path("stopped.h5"), "byte", [&] { return ++asked > 0; }); },
      {"stopped by a signal", "nothing was written"});
  EXPECT_EQ(asked, 1);
  for (const auto& entry : fs::directory_iterator(tmp_.path))
    EXPECT_EQ(entry.path().filename().string().find("stopped.h5"), std::string::npos)
        << entry.path();
  EXPECT_TRUE(names_text_corpus("corpus.TXT"));
  EXPECT_FALSE(names_text_corpus("corpus.txt.h5"));
}

}  // namespace
}  // namespace shardtrain
