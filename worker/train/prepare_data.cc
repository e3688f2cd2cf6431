#include "worker/train/prepare_data.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <thread>

#include <nlohmann/json.hpp>

#include "worker/train/token_file.h"

namespace meshtrain::train {
namespace {

// Consecutive text of one document, and whether it is the document's start (which gets
// the end-of-text token) and in the validation split.
struct Piece {
  std::string text;
  bool starts_document = false;
  bool validation = false;
};

bool AsciiNonSpace(char c) {
  return uint8_t(c) > 0x20 && uint8_t(c) < 0x7F;
}

// Where a plain text may be cut without changing its tokens: at a lone line break between
// two ASCII non-spaces, "x\n|y". The newline is a token of its own either way (alone in
// its run, it is not the optional space of " ?\p{L}+"), and GPT-2's pattern never looks
// back past it. After a longer run ("\n\n|y") it would not be: at the end of a piece the
// run is one match, inside the text its last newline is split off for the next word.
size_t SafeCut(std::string_view text, size_t from) {
  for (size_t p = std::max<size_t>(from, 2); p < text.size(); ++p) {
    if (text[p - 1] == '\n' && AsciiNonSpace(text[p - 2]) && AsciiNonSpace(text[p])) return p;
  }
  return text.size();
}

std::string ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TokenFileError(path + ": cannot open");
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw TokenFileError(path + ": read error");
  return data;
}

bool IsJsonl(const std::string& path) { return path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0; }

// Reads the inputs in order as pieces, marking those before the validation boundary
// (`validation_bytes` of input) as validation.
class PieceReader {
 public:
  PieceReader(std::vector<std::string> files, uint64_t validation_bytes, size_t piece_bytes)
      : files_(std::move(files)), validation_bytes_(validation_bytes), piece_bytes_(piece_bytes) {}

  // The next piece, or false at the end. Throws TokenFileError naming the file (and line).
  bool Next(Piece* piece) {
    while (true) {
      if (IsJsonl(current_path_) && jsonl_.is_open()) {
        if (NextJsonLine(piece)) return true;
        jsonl_.close();
        current_path_.clear();
      } else if (offset_ < text_.size()) {
        NextTextPiece(piece);
        return true;
      }
      if (next_file_ == files_.size()) return false;
      Open(files_[next_file_++]);
    }
  }

  uint64_t bytes_done() const { return bytes_done_; }

 private:
  void Open(const std::string& path) {
    current_path_ = path;
    line_number_ = 0;
    text_.clear();
    offset_ = 0;
    if (IsJsonl(path)) {
      jsonl_.open(path, std::ios::binary);
      if (!jsonl_) throw TokenFileError(path + ": cannot open");
    } else {
      text_ = ReadWhole(path);
      document_start_ = true;
    }
  }

  bool NextJsonLine(Piece* piece) {
    std::string line;
    while (std::getline(jsonl_, line)) {
      ++line_number_;
      bytes_done_ += line.size() + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json doc;
      try {
        doc = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        throw TokenFileError(current_path_ + ":" + std::to_string(line_number_) + ": not a JSON object: " + e.what());
      }
      if (!doc.is_object() || !doc.contains("text") || !doc["text"].is_string()) {
        throw TokenFileError(current_path_ + ":" + std::to_string(line_number_) + ": has no \"text\" string");
      }
      piece->text = doc["text"].get<std::string>();
      piece->starts_document = true;
      piece->validation = bytes_done_ - line.size() - 1 < validation_bytes_;
      return true;
    }
    if (jsonl_.bad()) throw TokenFileError(current_path_ + ": read error");
    return false;
  }

  void NextTextPiece(Piece* piece) {
    // A piece never straddles the validation boundary: it ends at the first safe cut
    // after the boundary or after piece_bytes, whichever comes first.
    const uint64_t start = bytes_done_;
    size_t end = SafeCut(text_, offset_ + piece_bytes_);
    const bool validation = start < validation_bytes_;
    if (validation && start + (end - offset_) > validation_bytes_) {
      end = SafeCut(text_, offset_ + size_t(validation_bytes_ - start));
    }
    piece->text = text_.substr(offset_, end - offset_);
    piece->starts_document = document_start_;
    piece->validation = validation;
    document_start_ = false;
    bytes_done_ += end - offset_;
    offset_ = end;
  }

  std::vector<std::string> files_;
  uint64_t validation_bytes_;
  size_t piece_bytes_;
  size_t next_file_ = 0;
  std::string current_path_;
  std::ifstream jsonl_;
  int64_t line_number_ = 0;
  std::string text_;
  size_t offset_ = 0;
  bool document_start_ = false;
  uint64_t bytes_done_ = 0;
};

// Shards of one split, written as they fill.
class ShardWriter {
 public:
  ShardWriter(std::string prefix, const char* split, int first_index, uint64_t shard_tokens,
              std::vector<PreparedShard>* written)
      : prefix_(std::move(prefix)), split_(split), index_(first_index), shard_tokens_(shard_tokens), written_(written) {}

  void Add(const std::vector<uint32_t>& tokens) {
    for (size_t taken = 0; taken < tokens.size();) {
      const size_t n = std::min<size_t>(tokens.size() - taken, shard_tokens_ - buffer_.size());
      buffer_.insert(buffer_.end(), tokens.begin() + long(taken), tokens.begin() + long(taken + n));
      taken += n;
      if (buffer_.size() == shard_tokens_) Flush();
    }
  }

  void Flush() {
    if (buffer_.empty()) return;
    char name[32];
    std::snprintf(name, sizeof name, "_%s_%06d.bin", split_, index_++);
    written_->push_back({prefix_ + name, buffer_.size()});
    WriteLlmcTokenFile(written_->back().path, buffer_);
    buffer_.clear();
  }

 private:
  std::string prefix_;
  const char* split_;
  int index_;
  uint64_t shard_tokens_;
  std::vector<PreparedShard>* written_;
  std::vector<uint32_t> buffer_;
};

}  // namespace

PrepareResult PrepareTokenShards(const text::Gpt2Tokenizer& tokenizer, const PrepareOptions& options,
                                 const PrepareProgress& progress) {
  if (options.shard_tokens == 0) throw std::invalid_argument("--shard-tokens must be positive");
  if (!(options.validation_fraction >= 0 && options.validation_fraction < 1)) {
    throw std::invalid_argument("--validation-fraction must be in [0, 1)");
  }
  const std::vector<std::string> files = ExpandGlobs(options.inputs);
  PrepareResult result;
  for (const std::string& f : files) {
    struct stat st {};
    if (::stat(f.c_str(), &st) != 0) throw TokenFileError(f + ": cannot open");
    result.bytes += uint64_t(st.st_size);
  }
  PieceReader reader(files, uint64_t(double(result.bytes) * options.validation_fraction), options.piece_bytes);
  ShardWriter validation(options.prefix, "val", 0, options.shard_tokens, &result.validation);
  ShardWriter train(options.prefix, "train", 1, options.shard_tokens, &result.train);

  const int threads = options.threads > 0 ? options.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<text::Gpt2Tokenizer::Session> sessions;
  for (int t = 0; t < threads; ++t) sessions.emplace_back(tokenizer);
  // Rounds: read about piece_bytes of text per thread, give each thread a run of pieces of
  // about that size (JSONL documents are small), tokenize, write the pieces in order.
  const uint64_t round_bytes = uint64_t(threads) * options.piece_bytes;
  std::vector<Piece> pieces;
  std::vector<std::vector<uint32_t>> tokens;
  std::vector<uint64_t> replaced;
  auto last_report = std::chrono::steady_clock::now();
  for (bool more = true; more;) {
    size_t n = 0;
    uint64_t bytes = 0;
    std::vector<size_t> starts = {0};  // thread t encodes pieces [starts[t], starts[t+1])
    while (bytes < round_bytes) {
      if (n == pieces.size()) pieces.emplace_back();
      if (!(more = reader.Next(&pieces[n]))) break;
      bytes += pieces[n++].text.size() + 1;
      if (bytes >= starts.size() * options.piece_bytes && int(starts.size()) < threads) starts.push_back(n);
    }
    starts.push_back(n);
    tokens.resize(std::max(tokens.size(), n));
    replaced.resize(std::max(replaced.size(), n));
    std::vector<std::thread> workers;
    for (size_t t = 0; t + 1 < starts.size(); ++t) {
      workers.emplace_back([&, t] {
        for (size_t i = starts[t]; i < starts[t + 1]; ++i) {
          tokens[i].clear();
          if (pieces[i].starts_document) tokens[i].push_back(tokenizer.end_of_text());
          replaced[i] = sessions[t].Encode(pieces[i].text, tokens[i]);
        }
      });
    }
    for (std::thread& w : workers) w.join();
    for (size_t i = 0; i < n; ++i) {
      (pieces[i].validation ? validation : train).Add(tokens[i]);
      result.documents += pieces[i].starts_document ? 1 : 0;
      result.invalid_utf8 += replaced[i];
    }
    const auto now = std::chrono::steady_clock::now();
    if (progress && now - last_report >= std::chrono::seconds(1)) {
      progress(reader.bytes_done(), result.bytes);
      last_report = now;
    }
  }
  validation.Flush();
  train.Flush();
  if (progress) progress(result.bytes, result.bytes);
  return result;
}

}  // namespace meshtrain::train
