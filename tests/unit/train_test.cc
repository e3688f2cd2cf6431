// The trainer's parts below the engine: CRC-32C, token files (MTOK, llm.c, raw), files written whole or not
// at all (safetensors), the seeded data loader, the learning-rate schedule, loading the CUDA plugin, and the
// engine factory (devices.h): which kernel table, padding and backend the environment asks for.

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <utility>

#include <gtest/gtest.h>

#include "api/layout.h"
#include "api/model_shape.h"
#include "api/training_job.h"
#include "worker/train/crc32c.h"
#include "worker/train/cuda_plugin.h"
#include "worker/train/data_loader.h"
#include "worker/train/devices.h"
#include "worker/train/safetensors.h"
#include "worker/train/schedule.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("meshtrain-test-" + std::to_string(::getpid()))) {
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string File(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::string OpenError(const std::string& path) {
  try {
    TokenFile::Open(path);
  } catch (const TokenFileError& e) {
    return e.what();
  }
  return "(no error)";
}

void WriteBytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The check value of CRC-32C (RFC 3720, B.4), and a sum continued over pieces.
TEST(Crc32c, MatchesTheStandardCheckValueAndContinues) {
  const std::string text = "123456789";
  EXPECT_EQ(Crc32c(text.data(), text.size()), 0xE3069283u);
  EXPECT_EQ(Crc32c(text.data() + 4, 5, Crc32c(text.data(), 4)), 0xE3069283u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
}

TEST(TokenFile, RoundTripsNarrowAndWideTokens) {
  TempDir dir;
  const std::vector<uint32_t> narrow = {0, 1, 65535, 42};
  WriteTokenFile(dir.File("a.bin"), narrow);
  const TokenFile a = TokenFile::Open(dir.File("a.bin"));
  EXPECT_EQ(a.width(), 2);
  ASSERT_EQ(a.size(), 4u);
  for (size_t i = 0; i < narrow.size(); ++i) EXPECT_EQ(a[i], narrow[i]);
  EXPECT_EQ(fs::file_size(dir.File("a.bin")), 24u + 8u);
  const std::vector<uint32_t> wide = {70000, 3, 4000000000u};
  WriteTokenFile(dir.File("b.bin"), wide);
  const TokenFile b = TokenFile::Open(dir.File("b.bin"));
  EXPECT_EQ(b.width(), 4);
  EXPECT_EQ(b[2], 4000000000u);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.File("")), fs::directory_iterator()), 2);  // no temporary left
}

// A FIFO would block the open until a writer came; a directory mapped says "No such device".
TEST(TokenFile, AFifoOrDirectoryIsNotARegularFile) {
  TempDir dir;
  const std::string fifo = dir.File("fifo.bin");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(OpenError(fifo), fifo + ": is not a regular file");
  fs::create_directory(dir.File("directory.bin"));
  EXPECT_EQ(OpenError(dir.File("directory.bin")), dir.File("directory.bin") + ": is not a regular file");
  for (const std::string& text : {fifo, dir.File("directory.bin")}) {
    try {
      WriteTextAsTokenFiles(text, dir.File("out.bin"), "", 0);
      ADD_FAILURE() << text << ": no error";
    } catch (const TokenFileError& e) {
      EXPECT_EQ(std::string(e.what()), text + ": is not a regular file");
    }
  }
}

// A write that fails part way (here past the file size limit, as on a full disk) leaves
// the file that was there whole and no temporary beside it, and says why.
TEST(WriteFileAtomically, AFailedWriteLeavesTheOldFileWhole) {
  TempDir dir;
  const std::string path = dir.File("model.safetensors");
  WriteSafetensors(path, {{"w", Tensor{{2}, {1.0f, 2.0f}}}});
  const std::string before = ReadBytes(path);

  rlimit old_limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // so the write fails with EFBIG instead
  rlimit small = old_limit;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string error = "(no error)";
  try {
    WriteSafetensors(path, {{"w", Tensor{{4096}, std::vector<float>(4096, 3.0f)}}});
  } catch (const SafetensorsError& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);

  EXPECT_NE(error.find(path + ": cannot write"), std::string::npos) << error;
  EXPECT_NE(error.find(std::strerror(EFBIG)), std::string::npos) << error;
  EXPECT_EQ(ReadBytes(path), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.File("")), fs::directory_iterator()), 1);
  EXPECT_EQ(ReadSafetensors(path).at("w").values, (std::vector<float>{1.0f, 2.0f}));
}

TEST(WriteFileAtomically, ADirectoryInTheWayIsNamedWithTheReason) {
  TempDir dir;
  fs::create_directory(dir.File("out.safetensors"));
  try {
    WriteSafetensors(dir.File("out.safetensors"), {{"w", Tensor{{1}, {1.0f}}}});
    FAIL() << "no error";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.File("out.safetensors") + ": "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::strerror(EISDIR)), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_directory(dir.File("out.safetensors")));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.File("")), fs::directory_iterator()), 1);
}

TEST(TokenFile, BadFilesGetErrorsNamingThem) {
  TempDir dir;
  const std::string f = dir.File("bad.bin");
  EXPECT_NE(OpenError(dir.File("missing.bin")).find("missing.bin: cannot open token file"), std::string::npos);
  WriteBytes(f, "MTOK");
  EXPECT_NE(OpenError(f).find("bad.bin: has no token file header: expected \"MTOK\" or llm.c's magic 20240520"),
            std::string::npos)
      << OpenError(f);
  WriteBytes(f, std::string(24, 'x'));
  EXPECT_NE(OpenError(f).find("a raw uint16 file (nanoGPT's train.bin) needs spec.data.format: uint16"),
            std::string::npos);
  WriteTokenFile(f, std::vector<uint32_t>{1, 2, 3});
  WriteBytes(f, ReadBytes(f).substr(0, 24 + 5));  // truncate the last token
  EXPECT_NE(OpenError(f).find("bad.bin: is truncated or padded: its MTOK header says 3 tokens of 2 bytes, but 5 bytes "
                              "follow it"),
            std::string::npos)
      << OpenError(f);
  std::string header = std::string("MTOK") + std::string("\x01\x00\x00\x00\x03\x00\x00\x00", 8) + std::string(12, '\0');
  WriteBytes(f, header);
  EXPECT_NE(OpenError(f).find("has token width 3"), std::string::npos);
  header[4] = 2;
  WriteBytes(f, header);
  EXPECT_NE(OpenError(f).find("has MTOK version 2, expected 1"), std::string::npos);
  try {
    WriteTokenFile(dir.File("no/such/dir/x.bin"), std::vector<uint32_t>{1});
    FAIL();
  } catch (const TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("no/such/dir/x.bin: cannot create"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::strerror(ENOENT)), std::string::npos) << e.what();
  }
}

// llm.c's shards as we write them, as Python's struct writes them (llm.c's own
// dev/data/data_common.py layout), and nanoGPT's raw uint16 files.
TEST(TokenFile, ReadsLlmcShardsAndRawUint16) {
  TempDir dir;
  std::vector<uint32_t> tokens(1000);
  for (uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = (i * 7919) % 50257;
  WriteLlmcTokenFile(dir.File("ours.bin"), tokens);
  EXPECT_EQ(fs::file_size(dir.File("ours.bin")), 1024u + 2 * tokens.size());
  const std::string script =
      "import struct, sys\n"
      "toks = [(i * 7919) % 50257 for i in range(1000)]\n"
      "header = [0] * 256\n"
      "header[0], header[1], header[2] = 20240520, 1, len(toks)\n"
      "with open(sys.argv[1], 'wb') as f:\n"
      "    f.write(struct.pack('<256i', *header))\n"
      "    f.write(struct.pack('<%dH' % len(toks), *toks))\n"
      "with open(sys.argv[2], 'wb') as f:\n"
      "    f.write(struct.pack('<%dH' % len(toks), *toks))\n";
  std::ofstream(dir.File("write.py")) << script;
  ASSERT_EQ(std::system(("python3 " + dir.File("write.py") + " " + dir.File("python.bin") + " " + dir.File("raw.bin")).c_str()), 0);
  for (const std::string name : {"ours.bin", "python.bin"}) {
    const TokenFile file = TokenFile::Open(dir.File(name));
    EXPECT_EQ(file.format(), "llm.c");
    EXPECT_EQ(file.width(), 2);
    ASSERT_EQ(file.size(), tokens.size()) << name;
    for (size_t i = 0; i < tokens.size(); ++i) ASSERT_EQ(file[i], tokens[i]) << name << " token " << i;
  }
  EXPECT_EQ(ReadBytes(dir.File("ours.bin")), ReadBytes(dir.File("python.bin")));
  // Raw uint16 only when the spec says so; a header under that format is a mistake.
  EXPECT_NE(OpenError(dir.File("raw.bin")).find("needs spec.data.format: uint16"), std::string::npos);
  const TokenFile raw = TokenFile::Open(dir.File("raw.bin"), TokenFormat::kUint16);
  EXPECT_EQ(raw.format(), "uint16");
  ASSERT_EQ(raw.size(), tokens.size());
  EXPECT_EQ(raw[999], tokens[999]);
  try {
    TokenFile::Open(dir.File("ours.bin"), TokenFormat::kUint16);
    ADD_FAILURE();
  } catch (const TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("ours.bin: starts with llm.c's header, but spec.data.format says raw uint16"),
              std::string::npos) << e.what();
  }
  WriteBytes(dir.File("odd.bin"), std::string(7, '\1'));
  try {
    TokenFile::Open(dir.File("odd.bin"), TokenFormat::kUint16);
    ADD_FAILURE();
  } catch (const TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("odd.bin: has 7 bytes, an odd count for raw uint16 tokens"), std::string::npos);
  }
  // A truncated llm.c shard, and a version-2 (uint32) one.
  WriteBytes(dir.File("short.bin"), ReadBytes(dir.File("ours.bin")).substr(0, 1024 + 1000));
  EXPECT_NE(OpenError(dir.File("short.bin")).find("short.bin: is truncated or padded: its llm.c header says 1000 tokens"),
            std::string::npos);
  // llm.c's magic with a version llm.c does not write, or a header cut short, says which.
  std::string wrong_version = ReadBytes(dir.File("ours.bin"));
  wrong_version[4] = 99;
  WriteBytes(dir.File("version.bin"), wrong_version);
  EXPECT_NE(OpenError(dir.File("version.bin")).find("version.bin: has llm.c's magic 20240520 with version 99"),
            std::string::npos) << OpenError(dir.File("version.bin"));
  WriteBytes(dir.File("cut.bin"), ReadBytes(dir.File("ours.bin")).substr(0, 500));
  EXPECT_NE(OpenError(dir.File("cut.bin")).find("cut.bin: starts with llm.c's magic 20240520 but has 500 bytes, short "
                                                "of its 1024-byte header"),
            std::string::npos) << OpenError(dir.File("cut.bin"));
  // Llama 3's shards: 20240801 with version 7, uint32; version 2 (meshtrain's before) reads too.
  WriteLlmcTokenFile(dir.File("wide.bin"), std::vector<uint32_t>{1, 128000, 3});
  const TokenFile wide = TokenFile::Open(dir.File("wide.bin"));
  EXPECT_EQ(wide.width(), 4);
  EXPECT_EQ(wide[1], 128000u);
  EXPECT_EQ(ReadBytes(dir.File("wide.bin"))[4], 7);
  std::string version2 = ReadBytes(dir.File("wide.bin"));
  version2[4] = 2;
  WriteBytes(dir.File("v2.bin"), version2);
  EXPECT_EQ(TokenFile::Open(dir.File("v2.bin"))[1], 128000u);
  WriteLlmcTokenFile(dir.File("narrow-ids.bin"), std::vector<uint32_t>{1, 2, 3}, 128256);  // the vocabulary decides
  EXPECT_EQ(TokenFile::Open(dir.File("narrow-ids.bin")).width(), 4);
  EXPECT_EQ(ParseTokenFormat("auto"), TokenFormat::kHeader);
  EXPECT_EQ(ParseTokenFormat("uint16"), TokenFormat::kUint16);
  EXPECT_THROW(ParseTokenFormat("int32"), std::invalid_argument);
}

TEST(TokenFile, ATokenPastTheVocabularyIsNamedWithItsOffset) {
  TempDir dir;
  std::vector<uint32_t> tokens(20000, 7);
  WriteTokenFile(dir.File("ok.bin"), tokens);
  TokenFile::Open(dir.File("ok.bin")).CheckVocabulary(8);
  tokens[12345] = 300;
  tokens[15000] = 999;
  WriteLlmcTokenFile(dir.File("big.bin"), tokens);
  try {
    TokenFile::Open(dir.File("big.bin")).CheckVocabulary(256);
    ADD_FAILURE();
  } catch (const TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("big.bin: token 12345 (byte offset 25714) is 300, outside the model's "
                                         "vocabulary of 256 (spec.model.vocabSize)"),
              std::string::npos)
        << e.what();
  }
  TokenFile::Open(dir.File("big.bin")).CheckVocabulary(1000);
}

// The data loader keeps its shards in a vector, so each is moved after Open: it keeps its
// format, and its header still counts in the offsets CheckVocabulary names.
TEST(TokenFile, AMovedFileKeepsItsFormatAndHeader) {
  TempDir dir;
  std::vector<uint32_t> tokens(100, 7);
  tokens[60] = 999;
  WriteLlmcTokenFile(dir.File("shard.bin"), tokens);
  std::vector<TokenFile> files;
  files.push_back(TokenFile::Open(dir.File("shard.bin")));
  TokenFile moved = std::move(files.back());
  EXPECT_EQ(moved.format(), "llm.c");
  EXPECT_EQ(moved.size(), 100u);
  try {
    moved.CheckVocabulary(256);
    ADD_FAILURE();
  } catch (const TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("shard.bin: token 60 (byte offset 1144) is 999"), std::string::npos)
        << e.what();
  }
  const std::vector<unsigned char> bytes(1024 + 6, 0);
  EXPECT_THROW(ReadTokenFileLayout(bytes, TokenFormat::kHeader, "x.bin"), TokenFileError);
  const TokenFileLayout raw = ReadTokenFileLayout(bytes, TokenFormat::kUint16, "x.bin");
  EXPECT_EQ(raw.format, "uint16");
  EXPECT_EQ(raw.count, 515u);
}

// A loss mask is read only once its header and size agree with its shard: a mask padded
// past its count is named before its bits are read.
TEST(TokenMask, AMaskIsReadOnlyWhenItsSizeIsItsShards) {
  TempDir dir;
  std::vector<bool> targets(21);
  for (size_t i = 0; i < targets.size(); ++i) targets[i] = i % 3 == 0;
  WriteTokenMask(dir.File("s.bin") + TokenMask::kSuffix, targets);
  const std::optional<TokenMask> mask = TokenMask::OpenBeside(dir.File("s.bin"), 21);
  ASSERT_TRUE(mask.has_value());
  EXPECT_EQ(mask->CountTargets(0, 21), 7u);
  EXPECT_TRUE(mask->target(18));
  EXPECT_FALSE(TokenMask::OpenBeside(dir.File("none.bin"), 21).has_value());
  const std::string bytes = ReadBytes(dir.File("s.bin") + TokenMask::kSuffix);
  EXPECT_EQ(TokenMask::Parse(bytes, 21, "m", "s").CountTargets(3, 10), 4u);  // 3, 6, 9, 12
  WriteBytes(dir.File("s.bin") + TokenMask::kSuffix, bytes + std::string(1 << 20, '\xff'));
  try {
    TokenMask::OpenBeside(dir.File("s.bin"), 21);
    ADD_FAILURE();
  } catch (const TokenFileError& e) {
    EXPECT_EQ(std::string(e.what()), dir.File("s.bin.mask") + ": is truncated or padded: 21 tokens need 3 bytes of "
                                                               "mask, but 1048579 follow the header");
  }
  WriteBytes(dir.File("s.bin") + TokenMask::kSuffix, bytes.substr(0, 20));
  EXPECT_THROW(TokenMask::OpenBeside(dir.File("s.bin"), 21), TokenFileError);
}

// A header the format's reference implementation (the safetensors crate) refuses is
// refused, naming the file and the tensor or key: tensors whose bytes overlap, a tensor
// named twice (JSON would keep one of the two), and a __metadata__ that is not an object
// of strings; and one nested 100,000 deep, whose parse recursed past the stack when printed.
TEST(Safetensors, HeadersTheReferenceRefusesAreNamed) {
  TempDir dir;
  const std::string path = dir.File("model.safetensors");
  // A file of `header` and 32 bytes of data.
  auto write = [&](const std::string& header) {
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[size_t(i)] = char((header.size() >> (8 * i)) & 0xFF);
    WriteBytes(path, file + header + std::string(32, '\0'));
  };
  auto error = [&](const std::string& header) {
    write(header);
    try {
      SafetensorsFile file(path);
    } catch (const SafetensorsError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  auto tensor = [](const char* name, int begin, int end) {
    return std::string("\"") + name + "\": {\"dtype\": \"F32\", \"shape\": [" + std::to_string((end - begin) / 4) +
           "], \"data_offsets\": [" + std::to_string(begin) + ", " + std::to_string(end) + "]}";
  };
  const std::string metadata = "\"__metadata__\": {\"format\": \"pt\"}";
  EXPECT_EQ(error("{" + metadata + ", " + tensor("a", 0, 8) + ", " + tensor("b", 8, 24) + "}"), "(no error)");
  write("{" + metadata + ", " + tensor("a", 0, 8) + ", " + tensor("b", 8, 24) + "}");
  EXPECT_EQ(SafetensorsFile(path).metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  // Overlaps, whichever comes first in the header, also past a tensor in between.
  EXPECT_EQ(error("{" + tensor("a", 0, 8) + ", " + tensor("b", 4, 12) + "}"),
            path + ": tensor b: data_offsets [4, 12) overlap tensor a's [0, 8)");
  EXPECT_EQ(error("{" + tensor("late", 16, 24) + ", " + tensor("whole", 0, 32) + ", " + tensor("mid", 8, 12) + "}"),
            path + ": tensor mid: data_offsets [8, 12) overlap tensor whole's [0, 32)");
  EXPECT_EQ(error("{" + tensor("empty", 4, 4) + ", " + tensor("a", 0, 8) + "}"), "(no error)");  // no bytes to share
  EXPECT_EQ(error("{" + tensor("a", 0, 8) + ", " + tensor("a", 8, 16) + "}"),
            path + ": tensor a is given twice in the header");
  EXPECT_EQ(error("{" + metadata + ", " + metadata + "}"), path + ": __metadata__ is given twice in the header");
  EXPECT_EQ(error("{\"__metadata__\": {\"format\": \"pt\", \"step\": 5}, " + tensor("a", 0, 8) + "}"),
            path + ": __metadata__ key \"step\" is not a string: 5");
  EXPECT_EQ(error("{\"__metadata__\": [\"pt\"]}"), path + ": __metadata__ is not an object of strings: [\"pt\"]");
  // Offsets and shapes are integers, two of them and non-negative.
  EXPECT_EQ(error("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8, 9]}}"),
            path + ": tensor a: data_offsets [0,8,9] is not [begin, end]");
  EXPECT_EQ(error("{\"a\": {\"dtype\": \"F32\", \"shape\": [2.5], \"data_offsets\": [0, 8]}}"),
            path + ": tensor a: shape [2.5] is not a tensor's");
  EXPECT_EQ(error("{\"a\": {\"dtype\": \"F32\", \"shape\": [0, 9223372036854775808], \"data_offsets\": [0, 0]}}"),
            path + ": tensor a: shape [0,9223372036854775808] is not a tensor's");
  EXPECT_EQ(error("{\"a\": 1}"), path + ": tensor a: expected {\"dtype\", \"shape\", \"data_offsets\"}, got 1");
  for (const int depth : {5000, 100000}) {
    EXPECT_EQ(error(std::string(size_t(depth), '[') + std::string(size_t(depth), ']')),
              path + ": header is JSON nested deeper than 512 at byte 512 (line 1, column 513)");
  }
  EXPECT_NE(error("{\"a\": }").find(path + ": header is not valid JSON at byte 6 (line 1, column 7): "),
            std::string::npos)
      << error("{\"a\": }");
  // The index of a sharded model: nesting bounded the same, files beside it.
  const std::string deep = "{\"weight_map\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  try {
    ParseSafetensorsIndex(deep, "dir/model.safetensors.index.json");
    ADD_FAILURE();
  } catch (const SafetensorsError& e) {
    EXPECT_EQ(std::string(e.what()),
              "dir/model.safetensors.index.json: JSON nested deeper than 512 at byte 526 (line 1, column 527)");
  }
  EXPECT_EQ(ParseSafetensorsIndex("{\"weight_map\": {\"a\": \"m-1.safetensors\"}}", "i").at("a"), "m-1.safetensors");
  EXPECT_THROW(ParseSafetensorsIndex("{\"weight_map\": {\"a\": \"../model.safetensors\"}}", "i"), SafetensorsError);
}

TEST(TokenFile, ByteTokenizerRoundTripsAndLargerVocabulariesPrintIds) {
  const std::string text = "It is a truth universally acknowledged\n\xc3\xa9";
  const auto tokens = ByteTokens(text);
  EXPECT_EQ(tokens.size(), text.size());
  EXPECT_EQ(tokens[0], uint32_t('I'));
  EXPECT_EQ(tokens.back(), 0xa9u);
  EXPECT_EQ(TokensToText(tokens), text);
  EXPECT_EQ(TokensToText(std::vector<uint32_t>{464, 50256, 3}, 50257), "464 50256 3");
}

TEST(DataLoader, PermuteIsABijectionThatChangesWithThePassAndSeed) {
  for (uint64_t count : {1u, 2u, 3u, 17u, 1000u, 4097u}) {
    std::vector<char> seen(count, 0);
    for (uint64_t i = 0; i < count; ++i) {
      const uint64_t j = DataLoader::Permute(i, count, 1337, 0);
      ASSERT_LT(j, count);
      EXPECT_FALSE(seen[j]) << "count " << count << ": " << j << " twice";
      seen[j] = 1;
    }
  }
  int moved_by_pass = 0, moved_by_seed = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    moved_by_pass += DataLoader::Permute(i, 1000, 1337, 0) != DataLoader::Permute(i, 1000, 1337, 1);
    moved_by_seed += DataLoader::Permute(i, 1000, 1337, 0) != DataLoader::Permute(i, 1000, 7, 0);
  }
  EXPECT_GT(moved_by_pass, 900);
  EXPECT_GT(moved_by_seed, 900);
}

TEST(DataLoader, RanksReadTheirOwnWindowsOfTheSeededOrder) {
  TempDir dir;
  std::vector<uint32_t> tokens(100);
  for (uint32_t i = 0; i < 100; ++i) tokens[i] = i;
  WriteTokenFile(dir.File("part-1.bin"), std::span(tokens).first(40));
  WriteLlmcTokenFile(dir.File("part-2.bin"), std::span(tokens).subspan(40));  // formats mix
  const int B = 2, T = 4;
  DataOptions options{.batch = B, .seq = T, .dp_rank = 0, .dp_size = 2, .vocab_size = 100, .seed = 1337};
  DataLoader rank0({dir.File("part-*.bin")}, options);
  options.dp_rank = 1;
  DataLoader rank1({dir.File("part-*.bin")}, options);
  EXPECT_EQ(rank0.files().size(), 2u);
  EXPECT_EQ(rank0.tokens(), 100u);
  EXPECT_EQ(rank0.windows(), 9u + 14u);  // (40-1)/4 and (60-1)/4: no window crosses a file's end
  // One pass is 20 windows (5 global micro-batches of 4); each is read once in it.
  std::vector<int32_t> in(B * T), target(B * T);
  std::set<int32_t> starts;
  std::vector<int32_t> first_pass;
  for (int step = 0; step < 5; ++step) {
    for (DataLoader* rank : {&rank0, &rank1}) {
      rank->Next(in.data(), target.data());
      for (int b = 0; b < B; ++b) {
        const int32_t start = in[size_t(b * T)];
        EXPECT_TRUE(start < 40 ? start % T == 0 && start + T < 40 : (start - 40) % T == 0 && start + T < 100) << start;
        for (int t = 0; t < T; ++t) {
          EXPECT_EQ(in[size_t(b * T + t)], start + t);
          EXPECT_EQ(target[size_t(b * T + t)], start + t + 1);
        }
        EXPECT_TRUE(starts.insert(start).second) << "window at " << start << " read twice in one pass";
        if (rank == &rank0 && b == 0) first_pass.push_back(start);
      }
    }
  }
  EXPECT_EQ(rank0.position(), 20u);
  // The next pass is another order; a restored position reads exactly the same windows.
  std::vector<int32_t> second_pass;
  for (int step = 0; step < 5; ++step) {
    rank0.Next(in.data(), target.data());
    second_pass.push_back(in[0]);
  }
  rank0.set_position(20);
  for (int step = 0; step < 5; ++step) {
    rank0.Next(in.data(), target.data());
    EXPECT_EQ(in[0], second_pass[size_t(step)]);
  }
  EXPECT_NE(first_pass, second_pass);
  options.dp_size = 1;
  options.dp_rank = 0;
  EXPECT_THROW(DataLoader({dir.File("nothing-*.bin")}, options), TokenFileError);
  options.batch = 10;
  EXPECT_THROW(DataLoader({dir.File("part-1.bin")}, options), std::invalid_argument);  // 9 windows
  options.batch = 1;
  options.vocab_size = 50;
  EXPECT_THROW(DataLoader({dir.File("part-*.bin")}, options), TokenFileError);  // 50..99 are past it
}

// Loss masks beside their shards (SHARD.mask): Next marks the targets that are context
// -1, inputs stay real, GlobalTargets counts the rest over every rank's windows without
// moving, and globs skip the masks.
// Where documents start (spec.data.attention document): the window's first row; each start
// token (a BOS; GPT-2's <|endoftext|>), the last of a run of them; or, for a tokenizer that
// puts nothing before a document, the token after each EOS.
TEST(DocumentMarks, StartTokensAndTheTokenAfterAnEnd) {
  const DocumentMarks bos = DocumentMarks::Of({1}, {2});  // Mistral's <s> ... </s>
  EXPECT_EQ(bos.start, 1);
  EXPECT_FALSE(bos.end);
  const std::vector<int32_t> llama = {7, 8, 2, 1, 9, 9, 2, 1, 5};
  EXPECT_EQ(bos.Starts(llama.data(), 9), (std::vector<int64_t>{0, 3, 7}));
  const DocumentMarks eot = DocumentMarks::Of({50256}, {});  // GPT-2: <|endoftext|> before each
  const std::vector<int32_t> gpt2 = {50256, 4, 5, 50256, 6, 50256, 50256, 7, 50256};
  EXPECT_EQ(eot.Starts(gpt2.data(), 9), (std::vector<int64_t>{0, 3, 6, 8}));  // 5: a pair's end
  const DocumentMarks eos = DocumentMarks::Of({}, {3});  // Qwen: the EOS after each
  const std::vector<int32_t> qwen = {4, 3, 5, 6, 3, 3};
  EXPECT_EQ(eos.Starts(qwen.data(), 6), (std::vector<int64_t>{0, 2, 5}));
  EXPECT_TRUE(eos.Found(qwen.data(), 6));
  EXPECT_FALSE(eos.Found(qwen.data() + 2, 3));  // an EOS at the end starts nothing here
  EXPECT_TRUE(DocumentMarks::Of({}, {}).empty());
}

TEST(DataLoader, MasksMarkContextTargetsAndGlobalTargetsCountsTheRest) {
  TempDir dir;
  std::vector<uint32_t> tokens(200);
  std::vector<bool> targets(200);
  for (uint32_t i = 0; i < 200; ++i) {
    tokens[i] = i % 50;
    targets[i] = (i / 7) % 3 == 0;  // runs of 7 targets, 14 context tokens
  }
  WriteLlmcTokenFile(dir.File("sft-1.bin"), std::span(tokens).first(120), 128256);
  WriteTokenMask(dir.File("sft-1.bin") + TokenMask::kSuffix, std::vector<bool>(targets.begin(), targets.begin() + 120));
  WriteTokenFile(dir.File("sft-2.bin"), std::span(tokens).subspan(120));  // no mask: every target real
  EXPECT_EQ(ExpandGlobs({dir.File("sft-*")}).size(), 2u);
  const int B = 2, T = 5, micro = 3;
  DataOptions options{.batch = B, .seq = T, .dp_rank = 0, .dp_size = 2, .vocab_size = 50, .seed = 9};
  DataLoader rank0({dir.File("sft-*")}, options);
  options.dp_rank = 1;
  DataLoader rank1({dir.File("sft-*")}, options);
  EXPECT_TRUE(rank0.masked());
  EXPECT_EQ(TokenFile::Open(dir.File("sft-1.bin")).width(), 4);  // a vocabulary past 65536
  for (int step = 0; step < 4; ++step) {
    const int64_t expected = rank0.GlobalTargets(micro);
    EXPECT_EQ(rank0.GlobalTargets(micro), expected);  // it does not move
    int64_t counted = 0, masked = 0;
    for (int m = 0; m < micro; ++m) {
      for (DataLoader* rank : {&rank0, &rank1}) {
        std::vector<int32_t> in(B * T), target(B * T);
        rank->Next(in.data(), target.data());
        for (int i = 0; i < B * T; ++i) {
          EXPECT_GE(in[size_t(i)], 0);
          counted += target[size_t(i)] >= 0;
          masked += target[size_t(i)] < 0;
        }
        // A -1 target is a context token: the window's next token where the mask says so.
        for (int b = 0; b < B; ++b) {
          for (int t = 0; t + 1 < T; ++t) {
            if (target[size_t(b * T + t)] >= 0) {
              EXPECT_EQ(target[size_t(b * T + t)], in[size_t(b * T + t + 1)]);
            }
          }
        }
      }
    }
    EXPECT_EQ(counted, expected) << "step " << step;
    EXPECT_LT(expected, int64_t(micro) * 2 * B * T);
    EXPECT_GT(masked, 0);
  }
  // Without masks, every target counts.
  DataLoader plain({dir.File("sft-2.bin")}, DataOptions{.batch = 1, .seq = T, .dp_size = 1, .vocab_size = 50});
  EXPECT_FALSE(plain.masked());
  EXPECT_EQ(plain.GlobalTargets(4), 4 * T);
  // A mask whose count is not its shard's, or that is not a mask, is named.
  WriteTokenMask(dir.File("sft-2.bin") + TokenMask::kSuffix, std::vector<bool>(79, true));
  try {
    DataLoader({dir.File("sft-2.bin")}, DataOptions{.batch = 1, .seq = T, .dp_size = 1});
    ADD_FAILURE();
  } catch (const TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("sft-2.bin.mask: is the loss mask of 79 tokens, but its shard"), std::string::npos)
        << e.what();
  }
  WriteBytes(dir.File("sft-2.bin") + TokenMask::kSuffix, "not a mask at all, long enough");
  EXPECT_THROW(DataLoader({dir.File("sft-2.bin")}, DataOptions{.batch = 1, .seq = T, .dp_size = 1}), TokenFileError);
}

TEST(Schedule, WarmupThenCosineOrConstant) {
  api::TrainingSpec t;
  t.steps = 110;
  t.warmup_steps = 10;
  t.learning_rate = 1e-3;
  EXPECT_DOUBLE_EQ(LearningRate(t, 0), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRate(t, 9), 1e-3);
  EXPECT_DOUBLE_EQ(LearningRate(t, 10), 1e-3);
  EXPECT_NEAR(LearningRate(t, 109), 1e-4, 1e-12);  // a tenth at the last step
  EXPECT_LT(LearningRate(t, 60), LearningRate(t, 30));
  t.schedule = "constant";
  EXPECT_DOUBLE_EQ(LearningRate(t, 109), 1e-3);
}

TEST(CudaPlugin, LoadingNamesWhatIsWrong) {
  std::string why;
  EXPECT_EQ(LoadCudaPlugin("/nonexistent/libmeshtrain-cuda.so", &why), nullptr);
  EXPECT_NE(why.find("cannot load the CUDA plugin /nonexistent/libmeshtrain-cuda.so"), std::string::npos) << why;
  EXPECT_EQ(LoadCudaPlugin("libm.so.6", &why), nullptr);  // a real library, but no plugin
  EXPECT_EQ(why, "libm.so.6 is not a meshtrain CUDA plugin: it has no MeshtrainCudaPlugin");
}

TEST(CudaPlugin, APluginFromAnotherBuildIsRefusedNamingBothBuilds) {
  const std::string theirs = MESHTRAIN_FOREIGN_BUILD, ours = CudaPluginBuild();
  ASSERT_NE(theirs, ours) << "the modified header must change the fingerprint";
  EXPECT_NE(ours.find("plugin boundary "), std::string::npos) << ours;
  std::string why;
  EXPECT_EQ(LoadCudaPlugin(MESHTRAIN_FOREIGN_PLUGIN, &why), nullptr);
  EXPECT_NE(why.find(std::string(MESHTRAIN_FOREIGN_PLUGIN) + " comes from another meshtrain build"), std::string::npos)
      << why;
  EXPECT_NE(why.find("\"" + theirs + "\""), std::string::npos) << why;
  EXPECT_NE(why.find("\"" + ours + "\""), std::string::npos) << why;
}

TEST(CudaPlugin, ThisBuildsPluginLoadsWhenBuiltWithCuda) {
  std::string why;
  const CudaPlugin* plugin = CudaPluginOrNull(&why);
#ifdef MESHTRAIN_HAVE_CUDA
  ASSERT_NE(plugin, nullptr) << why;
  std::string none;
  EXPECT_EQ(CudaDeviceCount(&none), plugin->device_count());
  if (plugin->device_count() == 0) {
    EXPECT_EQ(none, "the CUDA runtime sees no device");
  }
#else
  EXPECT_EQ(plugin, nullptr);
  EXPECT_NE(why.find("built without CUDA"), std::string::npos) << why;
  // A job sent to a GPU by a build without one is refused, saying why.
  api::TrainingJob job;
  job.spec.model.preset = "gpt2-tiny";
  runtime::MemoryAccounting accounting;
  try {
    MakeEngine(job, api::ParallelLayout(1, 1, 1, 1), nullptr, nullptr, runtime::Device::Cuda(0), 1, 8, &accounting);
    ADD_FAILURE() << "an engine was made on cuda:0 without CUDA";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("device cuda:0: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("built without CUDA"), std::string::npos) << e.what();
  }
#endif
}

api::TrainingJob SmallJob() {
  api::TrainingJob job;
  job.spec.model.layers = 3;
  job.spec.model.heads = 2;
  job.spec.model.hidden = 32;
  job.spec.model.vocab_size = 100;
  job.spec.model.seq_len = 16;
  job.spec.parallelism.activation_checkpointing = true;
  job.spec.parallelism.activation_offloading = true;
  job.spec.parallelism.activation_loading_horizon = 1;
  return job;
}

// Tests and benchmarks choose the CPU's kernel table, the engine's vocabulary padding, the
// replicated engine and the strict backend through EngineSwitches; a malformed switch is named.
TEST(MakeEngine, SwitchesChooseTheCpuTableThePaddingKeptUnitsAndTheStrictBackend) {
  const api::TrainingJob job = SmallJob();
  const api::ParallelLayout one(1, 1, 1, 1);
  runtime::MemoryAccounting accounting;
  {
    const auto engine = MakeEngine(job, one, nullptr, nullptr, runtime::Device::Cpu(), 2, 16, &accounting,
                                   {.cpu_kernels = "bf16", .vocab_multiple = 1, .cpu_backend = {3, true}});
    const std::string described = engine->Describe();
    EXPECT_EQ(described.rfind("bf16 FSDP", 0), 0u) << described;
    EXPECT_NE(described.find("cpu bf16 emulation on cpu (strict: jitter seed 3, poisoned memory)"), std::string::npos)
        << described;
    EXPECT_NE(described.find("block inputs checkpointed, 2 kept, the rest offloaded (horizon 1)"), std::string::npos)
        << described;
    EXPECT_EQ(engine->vocab_multiple(), 1);
    EXPECT_EQ(engine->device(), runtime::Device::Cpu());
  }
  {
    const auto engine = MakeEngine(job, one, nullptr, nullptr, runtime::Device::Cpu(), 2, 16, &accounting,
                                   {.cpu_kernels = "fp64"});
    EXPECT_EQ(engine->Describe().rfind("fp64 FSDP", 0), 0u) << engine->Describe();
    EXPECT_NE(engine->Describe().find("cpu fp64 reference on cpu"), std::string::npos) << engine->Describe();
    EXPECT_EQ(engine->vocab_multiple(), api::kVocabMultiple);
  }
  const auto plain = MakeEngine(job, one, nullptr, nullptr, runtime::Device::Cpu(), 2, 16, &accounting);
  EXPECT_EQ(plain->Describe().rfind("fp32 FSDP", 0), 0u) << plain->Describe();
  EXPECT_TRUE(plain->Describe().ends_with("; cpu fp32 on cpu")) << plain->Describe();
  {
    // Replicated at world 1: every block's compute copy is kept (EngineOptions::keep_units_gathered).
    runtime::MemoryAccounting kept;
    MakeEngine(job, one, nullptr, nullptr, runtime::Device::Cpu(), 2, 16, &kept, {.keep_units_gathered = true});
    runtime::MemoryAccounting slots;
    MakeEngine(job, one, nullptr, nullptr, runtime::Device::Cpu(), 2, 16, &slots);
    EXPECT_GT(kept.peak(runtime::MemoryCategory::kGathered), slots.peak(runtime::MemoryCategory::kGathered));
  }
  const std::pair<EngineSwitches, std::string> malformed[] = {
      {{.cpu_kernels = "fp16"}, "EngineSwitches::cpu_kernels: 'fp16' is not fp32, bf16 or fp64"},
      {{.vocab_multiple = 0}, "EngineSwitches::vocab_multiple: 0 is not 1 to 65536"}};
  for (const auto& [switches, error] : malformed) {
    try {
      MakeEngine(job, one, nullptr, nullptr, runtime::Device::Cpu(), 2, 16, &accounting, switches);
      ADD_FAILURE() << error << ": accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), error);
    }
  }
}

TEST(MakeEngine, TheActivationPolicyIsTheSpecs) {
  api::ParallelismSpec p;
  EXPECT_EQ(ActivationPolicyOf(p), (parallel::ActivationPolicy{false, false, 2}));
  p.activation_checkpointing = true;
  p.activation_offloading = true;
  p.activation_loading_horizon = 3;
  EXPECT_EQ(ActivationPolicyOf(p), (parallel::ActivationPolicy{true, true, 3}));
}

}  // namespace
}  // namespace meshtrain::train

namespace meshtrain::train {
namespace {

// The step line keeps its start and its evaluation field, then a load-balancing loss, a
// pipeline's bubbles, and ends with the most imbalanced mixture-of-experts block's max/mean.
TEST(StepLine, ExpertsLoadComesLastAsTheWorstBlocksMaxOverMean) {
  StepReport r;
  r.step = 3, r.steps = 10, r.loss = 2.5, r.learning_rate = 1e-3, r.grad_norm = 0.5, r.tokens_per_second = 1000;
  r.validation_loss = 2.25;
  EXPECT_EQ(FormatStepReport(r), "step     3/10 | loss 2.5000 | lr 1.00e-03 | norm 0.500 | 1000 tok/s | val loss 2.2500");
  r.expert_load[0] = {.max = 30, .mean = 25};
  r.expert_load[1] = {.max = 40, .mean = 25};  // the worse: 1.6
  r.stage_bubbles = {0.25, 0.5};
  r.bubble_model = 0.3;
  EXPECT_EQ(FormatStepReport(r),
            "step     3/10 | loss 2.5000 | lr 1.00e-03 | norm 0.500 | 1000 tok/s | val loss 2.2500"
            " | bubble by stage 25% 50% (model 30%) | experts max/mean 1.60");
  EXPECT_DOUBLE_EQ(r.expert_load[1].imbalance(), 1.6);
  EXPECT_EQ(StepReport::ExpertLoad{}.imbalance(), 0);  // an expert-less block: no ratio
  // A load-balancing loss follows the evaluation field, before the bubbles.
  r.aux_loss = 2.03125;
  EXPECT_EQ(FormatStepReport(r),
            "step     3/10 | loss 2.5000 | lr 1.00e-03 | norm 0.500 | 1000 tok/s | val loss 2.2500 | aux 2.0312"
            " | bubble by stage 25% 50% (model 30%) | experts max/mean 1.60");
}

}  // namespace
}  // namespace meshtrain::train
