// GPT-2's tokenizer against one nobody here wrote: the npm package gpt-3-encoder
// (scripts/install-gpt2-reference.sh), run by node on the same strings. Ids must be
// equal bit for bit, and decoding must give the input back.

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "worker/text/gpt2_tokenizer.h"
#include "worker/text/utf8.h"
#include "worker/train/prepare_data.h"
#include "worker/train/token_file.h"

namespace meshtrain::text {

// The reference package's directory, the source tree, and a whole file (shared with the
// prepare-data tests below).
std::string ReferenceDir() { return MESHTRAIN_GPT2_REFERENCE; }
std::string SourceDir() { return MESHTRAIN_SOURCE_DIR; }
std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const std::string kReference = ReferenceDir();
const std::string kSource = SourceDir();

class Gpt2TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_TRUE(fs::exists(kReference + "/vocab.bpe"))
        << kReference << " is missing: run scripts/install-gpt2-reference.sh (the README's test command does)";
    tokenizer_ = new Gpt2Tokenizer(Gpt2Tokenizer::Load(kReference));
  }
  static void TearDownTestSuite() { delete tokenizer_; }

  // The reference's ids of each string.
  static std::vector<std::vector<uint32_t>> ReferenceIds(const std::vector<std::string>& texts) {
    const fs::path dir = fs::temp_directory_path() / ("meshtrain-bpe-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    std::ofstream(dir / "in.json") << Json(texts).dump();
    const std::string command = "node " + kSource + "/tests/integration/gpt2_reference_encode.js " + kReference + " " +
                                (dir / "in.json").string() + " > " + (dir / "out.json").string();
    const int rc = std::system(command.c_str());
    const std::string out = ReadFile((dir / "out.json").string());
    fs::remove_all(dir);
    EXPECT_EQ(rc, 0) << command;
    return Json::parse(out).get<std::vector<std::vector<uint32_t>>>();
  }

  // Compares ours with the reference on every text; returns how many differ.
  static int CompareWithReference(const Gpt2Tokenizer& ours, const std::vector<std::string>& texts) {
    return CompareWithReference(ours, texts, ReferenceIds(texts));
  }

  static int CompareWithReference(const Gpt2Tokenizer& ours, const std::vector<std::string>& texts,
                                  const std::vector<std::vector<uint32_t>>& expected) {
    EXPECT_EQ(expected.size(), texts.size());
    int differ = 0;
    Gpt2Tokenizer::Session session(ours);
    for (size_t i = 0; i < texts.size() && i < expected.size(); ++i) {
      std::vector<uint32_t> ids;
      EXPECT_EQ(session.Encode(texts[i], ids), 0u);
      if (ids != expected[i] && ++differ <= 5) {
        ADD_FAILURE() << "text " << i << " (" << texts[i].size() << " bytes): " << Json(ids).dump().substr(0, 300)
                      << "\nreference: " << Json(expected[i]).dump().substr(0, 300);
      }
      EXPECT_EQ(ours.Decode(ids), texts[i]) << "text " << i;
    }
    return differ;
  }

  static Gpt2Tokenizer* tokenizer_;
};

Gpt2Tokenizer* Gpt2TokenizerTest::tokenizer_ = nullptr;

TEST_F(Gpt2TokenizerTest, KnowsGpt2sVocabulary) {
  EXPECT_EQ(tokenizer_->vocab_size(), 50257u);
  EXPECT_EQ(tokenizer_->end_of_text(), 50256u);
  EXPECT_EQ(tokenizer_->Decode(std::vector<uint32_t>{15496, 995}), "Hello world");
  EXPECT_EQ(tokenizer_->Encode("Hello world"), (std::vector<uint32_t>{15496, 995}));
  // "<|endoftext|>" in text is plain text, never the end-of-text token.
  for (uint32_t id : tokenizer_->Encode("<|endoftext|>")) EXPECT_NE(id, 50256u);
  EXPECT_THROW(tokenizer_->Decode(std::vector<uint32_t>{50257}), std::out_of_range);
}

TEST_F(Gpt2TokenizerTest, PrideAndPrejudiceEqualsTheReference) {
  const std::string book = ReadFile(kSource + "/examples/data/pride-and-prejudice.txt");
  ASSERT_GT(book.size(), 500000u);
  // The reference appends ids with Array.concat, quadratic in a text's length; it
  // encodes the book line by line, and ours the whole book. Lines are cut after "x\n"
  // before a letter (a lone newline between non-spaces), where GPT-2's pattern ends a
  // match anyway: after "\n\n" it would not, as the run's last newline is its own token.
  std::vector<std::string> paragraphs;
  auto letter = [&](size_t i) { return std::isalpha(static_cast<unsigned char>(book[i])) != 0; };
  size_t start = 0;
  for (size_t p = 2; p < book.size(); ++p) {
    if (book[p - 1] == '\n' && letter(p - 2) && letter(p)) {
      paragraphs.push_back(book.substr(start, p - start));
      start = p;
    }
  }
  paragraphs.push_back(book.substr(start));
  EXPECT_GT(paragraphs.size(), 5000u);
  std::vector<uint32_t> expected;
  for (const std::vector<uint32_t>& ids : ReferenceIds(paragraphs)) expected.insert(expected.end(), ids.begin(), ids.end());
  EXPECT_EQ(CompareWithReference(*tokenizer_, {book}, {expected}), 0);
  std::fprintf(stderr, "Pride and Prejudice: %zu bytes, %zu tokens\n", book.size(), tokenizer_->Encode(book).size());
}

TEST_F(Gpt2TokenizerTest, AccentsCjkEmojiAndWhitespaceEqualTheReference) {
  const std::vector<std::string> texts = {
      "Élise a reçu ses œuvres complètes à Noël, n'est-ce pas? Ça m'étonne: «déjà»!",
      "Straße, Ærøskøbing, Ñandú, Dvořák, İstanbul, ĳsselmeer",
      "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
      "emoji: 👍🏽 👨‍👩‍👧‍👦 🇯🇵 🤖🚀✨ and 😀😀😀",
      "tabs\tand\t\ttabs, CRLF\r\nlines\r\n\r\n  indented\n    more  \n\n\n",
      "non-breaking\u00a0space, ideographic\u3000space, BOM\ufeffinside, en\u2002space, line\u2028sep",
      "digits 3.14159 and ١٢٣ and ⅫⅬ and ²³, I'm, you're, we've, they'll, he'd, it's, don't",
      "    leading spaces and trailing    ",
      " ",
      "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย",
  };
  EXPECT_EQ(CompareWithReference(*tokenizer_, texts), 0);
}

// Code points drawn from those PCRE2 10.42 knows as assigned (Unicode 14). Node knows a
// later Unicode, and letters assigned since then are letters there but not here.
class AssignedCodePoints {
 public:
  AssignedCodePoints() {
    int error = 0;
    PCRE2_SIZE offset = 0;
    const std::string pattern = "^\\p{Cn}$";
    pcre2_code* unassigned = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF,
                                           &error, &offset, nullptr);
    pcre2_match_data* match = pcre2_match_data_create(2, nullptr);
    for (uint32_t cp = 1; cp < 0x110000; ++cp) {
      if (cp >= 0xD800 && cp < 0xE000) continue;
      std::string s;
      AppendUtf8(cp, s);
      if (pcre2_match(unassigned, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, 0, match, nullptr) < 0) {
        (cp < 0x10000 ? bmp_ : astral_).push_back(cp);
      }
    }
    pcre2_match_data_free(match);
    pcre2_code_free(unassigned);
  }

  // A string of 1 to 24 code points: ASCII, whitespace of every kind, Latin, any
  // assigned BMP character, emoji and other astral ones.
  std::string Draw(std::mt19937& rng) const {
    static const std::vector<uint32_t> spaces = {' ', '\t', '\n', '\r', 0x0B, 0x0C, 0xA0, 0x85, 0x1680, 0x180E,
                                                 0x2003, 0x2028, 0x202F, 0x3000, 0xFEFF};
    std::string s;
    const int length = std::uniform_int_distribution<int>(1, 24)(rng);
    for (int i = 0; i < length; ++i) {
      const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
      uint32_t cp;
      if (kind <= 3) cp = std::uniform_int_distribution<uint32_t>(0x20, 0x7E)(rng);
      else if (kind == 4) cp = spaces[std::uniform_int_distribution<size_t>(0, spaces.size() - 1)(rng)];
      else if (kind == 5) cp = std::uniform_int_distribution<uint32_t>(0xC0, 0x24F)(rng);
      else if (kind <= 7) cp = bmp_[std::uniform_int_distribution<size_t>(0, bmp_.size() - 1)(rng)];
      else if (kind == 8) cp = std::uniform_int_distribution<uint32_t>(0x1F300, 0x1F64F)(rng);
      else cp = astral_[std::uniform_int_distribution<size_t>(0, astral_.size() - 1)(rng)];
      AppendUtf8(cp, s);
    }
    return s;
  }

 private:
  std::vector<uint32_t> bmp_, astral_;
};

TEST_F(Gpt2TokenizerTest, TenThousandRandomUnicodeStringsEqualTheReference) {
  const AssignedCodePoints points;
  std::mt19937 rng(20240520);
  std::vector<std::string> texts;
  for (int i = 0; i < 10000; ++i) texts.push_back(points.Draw(rng));
  EXPECT_EQ(CompareWithReference(*tokenizer_, texts), 0);
}

// Hugging Face's tokenizer.json of the same model, made here from the OpenAI files, in
// both spellings of merges.
TEST_F(Gpt2TokenizerTest, HuggingFaceFileGivesTheSameIds) {
  const Json encoder = Json::parse(ReadFile(kReference + "/encoder.json"));
  std::istringstream lines(ReadFile(kReference + "/vocab.bpe"));
  Json strings = Json::array(), pairs = Json::array();
  std::string line;
  std::getline(lines, line);  // #version
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    strings.push_back(line);
    pairs.push_back({line.substr(0, line.find(' ')), line.substr(line.find(' ') + 1)});
  }
  const AssignedCodePoints points;
  std::vector<std::string> texts = {"Hello world, it's 2026.", "東京 👍🏽\u3000x"};
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) texts.push_back(points.Draw(rng));
  for (const Json& merges : {strings, pairs}) {
    Json doc = {{"version", "1.0"},
                {"added_tokens", {{{"id", 50256}, {"content", "<|endoftext|>"}, {"special", true}}}},
                {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
                {"model", {{"type", "BPE"}, {"vocab", encoder}, {"merges", merges}}}};
    const Gpt2Tokenizer hf = Gpt2Tokenizer::FromHuggingFaceFile(doc.dump(), "tokenizer.json");
    EXPECT_EQ(hf.end_of_text(), 50256u);
    for (const std::string& text : texts) EXPECT_EQ(hf.Encode(text), tokenizer_->Encode(text)) << text;
  }
}

TEST_F(Gpt2TokenizerTest, LongPreTokensAndInvalidUtf8) {
  // A million letters is one pre-token; the heap merges it in O(n log n), where
  // GPT-2's round-by-round loop is quadratic. (GPT-2 has no merge of two spaces.)
  const std::string letters(1000000, 'a');
  const std::vector<uint32_t> ids = tokenizer_->Encode(letters);
  EXPECT_EQ(tokenizer_->Decode(ids), letters);
  EXPECT_LE(ids.size(), letters.size() / 4);
  EXPECT_EQ(tokenizer_->Encode(std::string(1000, ' ')), std::vector<uint32_t>(1000, 220));
  // Invalid UTF-8 is replaced per maximal subpart, as TextDecoder does, and counted.
  Gpt2Tokenizer::Session session(*tokenizer_);
  std::vector<uint32_t> bad;
  EXPECT_EQ(session.Encode("a\xff" "b\xe2\x82" "c\xf0\x9f\x98", bad), 3u);
  EXPECT_EQ(tokenizer_->Decode(bad), "a\xef\xbf\xbd" "b\xef\xbf\xbd" "c\xef\xbf\xbd");
}

TEST(Gpt2TokenizerFiles, BadFilesAreNamed) {
  auto error = [](auto&& make) {
    try {
      make();
    } catch (const TokenizerError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(error([] { Gpt2Tokenizer::Load("/nonexistent/gpt2"); }).find("/nonexistent/gpt2: no GPT-2 tokenizer here"),
            std::string::npos);
  Json vocab;
  for (int b = 0; b < 256; ++b) {
    std::string spelled;
    AppendUtf8(Gpt2ByteCodePoint(uint8_t(b)), spelled);
    vocab[spelled] = b;
  }
  vocab["<|endoftext|>"] = 256;
  EXPECT_NO_THROW(Gpt2Tokenizer::FromOpenAiFiles(vocab.dump(), "#version: 0.2\n", "dir"));
  EXPECT_NE(error([&] { Gpt2Tokenizer::FromOpenAiFiles(vocab.dump(), "#version: 0.2\na b\n", "dir"); })
                .find("merge 1 \"a b\" names a token the vocabulary lacks"),
            std::string::npos);
  EXPECT_NE(error([&] { Gpt2Tokenizer::FromOpenAiFiles(vocab.dump(), "#version: 0.2\na b c\n", "dir"); })
                .find("line 2 is not a merge of two tokens"),
            std::string::npos);
  EXPECT_NE(error([&] { Gpt2Tokenizer::FromOpenAiFiles("{\"a\": ", "", "dir"); }).find("not valid JSON"),
            std::string::npos);
  Json no_eot = vocab;
  no_eot.erase("<|endoftext|>");
  EXPECT_NE(error([&] { Gpt2Tokenizer::FromOpenAiFiles(no_eot.dump(), "", "dir"); }).find("no \"<|endoftext|>\""),
            std::string::npos);
  EXPECT_NE(error([] { Gpt2Tokenizer::FromHuggingFaceFile("{\"model\": {\"type\": \"WordPiece\"}}", "t.json"); })
                .find("t.json: model.type is not \"BPE\""),
            std::string::npos);
}

}  // namespace
}  // namespace meshtrain::text

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;

class PrepareDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(text::ReferenceDir() + "/vocab.bpe")) << "run scripts/install-gpt2-reference.sh";
    dir_ = fs::temp_directory_path() / ("meshtrain-prepare-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Every token of the shards `result` lists, validation first.
  static std::vector<uint32_t> AllTokens(const PrepareResult& result) {
    std::vector<uint32_t> all;
    for (const auto* split : {&result.validation, &result.train}) {
      for (const PreparedShard& shard : *split) {
        const TokenFile file = TokenFile::Open(shard.path);
        EXPECT_EQ(file.format(), "llm.c");
        EXPECT_EQ(file.size(), shard.tokens);
        for (uint64_t i = 0; i < file.size(); ++i) all.push_back(file[i]);
      }
    }
    return all;
  }

  fs::path dir_;
};

TEST_F(PrepareDataTest, DocumentsStartWithEndOfTextAndTheThreadCountChangesNothing) {
  const text::Gpt2Tokenizer tokenizer = text::Gpt2Tokenizer::Load(text::ReferenceDir());
  const std::vector<std::string> docs = {"The first document.", "Le deuxième, avec des accents.", "",
                                         "第三个文件 with 👍🏽 emoji\nand two lines."};
  fs::create_directories(dir_ / "in");
  {
    std::ofstream jsonl(dir_ / "in" / "docs.jsonl");
    for (size_t i = 0; i < 3; ++i) jsonl << nlohmann::json{{"text", docs[i]}, {"id", i}}.dump() << "\n";
    jsonl << "\n";  // blank lines are skipped
  }
  std::ofstream(dir_ / "in" / "plain.txt") << docs[3];
  std::vector<uint32_t> expected;
  for (const std::string& doc : docs) {
    expected.push_back(50256);
    for (uint32_t id : tokenizer.Encode(doc)) expected.push_back(id);
  }
  PrepareOptions options;
  options.inputs = {(dir_ / "in" / "*").string()};
  options.validation_fraction = 0;
  options.shard_tokens = 10;
  options.threads = 1;
  options.prefix = (dir_ / "one").string();
  const PrepareResult one = PrepareTokenShards(tokenizer, options);
  options.threads = 3;
  options.prefix = (dir_ / "three").string();
  const PrepareResult three = PrepareTokenShards(tokenizer, options);
  EXPECT_EQ(one.documents, 4u);
  EXPECT_EQ(AllTokens(one), expected);
  EXPECT_EQ(AllTokens(three), expected);
  ASSERT_EQ(one.train.size(), (expected.size() + 9) / 10);  // shards of at most 10 tokens
  EXPECT_EQ(one.train.front().path, (dir_ / "one").string() + "_train_000001.bin");
  EXPECT_TRUE(one.validation.empty());
}

TEST_F(PrepareDataTest, ABookCutIntoPiecesTokenizesAsAWholeAndSplitsOffValidation) {
  const text::Gpt2Tokenizer tokenizer = text::Gpt2Tokenizer::Load(text::ReferenceDir());
  const std::string book = text::ReadFile(text::SourceDir() + "/examples/data/pride-and-prejudice.txt");
  std::ofstream(dir_ / "book.txt", std::ios::binary) << book;
  PrepareOptions options;
  options.inputs = {(dir_ / "book.txt").string()};
  options.prefix = (dir_ / "book").string();
  options.validation_fraction = 0.1;
  options.threads = 2;
  options.piece_bytes = 4096;  // many cuts, each of which must not change a token
  uint64_t reported = 0;
  const PrepareResult result =
      PrepareTokenShards(tokenizer, options, [&](uint64_t done, uint64_t total) { reported = done == total ? total : 0; });
  EXPECT_EQ(reported, book.size());
  std::vector<uint32_t> expected = {50256};
  for (uint32_t id : tokenizer.Encode(book)) expected.push_back(id);
  EXPECT_EQ(AllTokens(result), expected);  // cut only where GPT-2's pattern ends a match anyway
  ASSERT_EQ(result.validation.size(), 1u);
  EXPECT_EQ(result.validation[0].path, (dir_ / "book").string() + "_val_000000.bin");
  const double share = double(result.validation[0].tokens) / double(expected.size());
  EXPECT_GT(share, 0.09);
  EXPECT_LT(share, 0.11);
}

TEST_F(PrepareDataTest, BadInputIsNamed) {
  const text::Gpt2Tokenizer tokenizer = text::Gpt2Tokenizer::Load(text::ReferenceDir());
  std::ofstream(dir_ / "bad.jsonl") << "{\"text\": \"fine\"}\n{\"title\": \"no text\"}\n";
  PrepareOptions options;
  options.inputs = {(dir_ / "bad.jsonl").string()};
  options.prefix = (dir_ / "out").string();
  try {
    PrepareTokenShards(tokenizer, options);
    ADD_FAILURE();
  } catch (const TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:2: has no \"text\" string"), std::string::npos) << e.what();
  }
  std::ofstream(dir_ / "bad.jsonl") << "{\"text\": \"fine\"}\nnot json\n";
  try {
    PrepareTokenShards(tokenizer, options);
    ADD_FAILURE();
  } catch (const TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:2: not a JSON object"), std::string::npos) << e.what();
  }
  options.inputs = {(dir_ / "none-*.txt").string()};
  EXPECT_THROW(PrepareTokenShards(tokenizer, options), TokenFileError);
}

}  // namespace
}  // namespace meshtrain::train
