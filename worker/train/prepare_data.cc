#include "worker/train/prepare_data.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "api/hf_config.h"
#include "worker/text/utf8.h"
#include "worker/train/token_file.h"

namespace meshtrain::train {
namespace {

using Json = nlohmann::json;

constexpr size_t kMostWarnings = 20;

struct Document {
  std::string text;                // a "text" document or a plain-text file
  std::string prompt, completion;  // a prompt/completion pair
  bool pair = false;
  bool whole_file = false;          // a plain-text file: may be cut between shards and splits
  bool validation = false;          // a JSON line before the validation boundary
  uint64_t validation_bytes = 0;    // a plain-text file: its bytes before the boundary
};

bool IsJsonl(const std::string& path) { return path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0; }

// Reads the inputs in order as documents.
class DocumentReader {
 public:
  DocumentReader(std::vector<std::string> files, uint64_t validation_bytes, PrepareResult* result)
      : files_(std::move(files)), validation_bytes_(validation_bytes), result_(result) {}

  // The next document, or false at the end. Throws TokenFileError naming the file, line and
  // JSON path.
  bool Next(Document* doc) {
    while (true) {
      if (jsonl_.is_open()) {
        if (NextJsonLine(doc)) return true;
        jsonl_.close();
      }
      if (next_file_ == files_.size()) return false;
      path_ = files_[next_file_++];
      line_number_ = 0;
      if (IsJsonl(path_)) {
        jsonl_.open(path_, std::ios::binary);
        if (!jsonl_) throw TokenFileError(path_ + ": cannot open");
        continue;
      }
      ReadTextFile(doc);
      return true;
    }
  }

  uint64_t bytes_done() const { return bytes_done_; }

 private:
  // `text` with invalid UTF-8 replaced, and a warning naming `where` and the byte offset.
  void Scrub(std::string& text, const std::string& where, uint64_t base_offset, bool count_lines) {
    const size_t bad = text::FirstInvalidUtf8(text);
    if (bad == text.size()) return;
    size_t replaced = 0;
    std::string line_part = where;
    if (count_lines) line_part += ":" + std::to_string(1 + std::count(text.begin(), text.begin() + long(bad), '\n'));
    text = text::ScrubUtf8(text, &replaced);
    result_->invalid_utf8 += replaced;
    if (result_->warnings.size() < kMostWarnings) {
      result_->warnings.push_back(line_part + ": invalid UTF-8 at byte offset " + std::to_string(base_offset + bad) + " (" +
                                  std::to_string(replaced) + " sequence" + (replaced == 1 ? "" : "s") +
                                  " replaced by U+FFFD)");
    }
  }

  void ReadTextFile(Document* doc) {
    std::ifstream in(path_, std::ios::binary);
    if (!in) throw TokenFileError(path_ + ": cannot open");
    *doc = Document{};
    doc->text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (in.bad()) throw TokenFileError(path_ + ": read error");
    const uint64_t start = bytes_done_;
    bytes_done_ += doc->text.size();
    doc->whole_file = true;
    doc->validation_bytes = std::min<uint64_t>(doc->text.size(), validation_bytes_ > start ? validation_bytes_ - start : 0);
    Scrub(doc->text, path_, 0, true);
  }

  [[noreturn]] void Fail(const std::string& what) const {
    throw TokenFileError(path_ + ":" + std::to_string(line_number_) + ": " + what);
  }

  // The string at `key`, or nullopt when absent; anything else is an error naming it.
  std::optional<std::string> StringAt(const Json& line, const char* key) const {
    if (!line.contains(key)) return std::nullopt;
    if (!line[key].is_string()) Fail(std::string(".") + key + ": expected a string, got " + line[key].dump().substr(0, 60));
    return line[key].get<std::string>();
  }

  bool NextJsonLine(Document* doc) {
    std::string line;
    while (std::getline(jsonl_, line)) {
      ++line_number_;
      const uint64_t start = bytes_done_;
      bytes_done_ += line.size() + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      Scrub(line, path_ + ":" + std::to_string(line_number_), 0, false);
      Json json;
      try {  // bounded nesting: a line is read from a file off the internet like a model's
        json = api::ParseModelJson(line, path_ + ":" + std::to_string(line_number_));
      } catch (const api::ModelJsonError& e) {
        Fail(std::string("not a JSON object: ") + e.reason());
      }
      if (!json.is_object()) Fail("not a JSON object: got " + json.dump().substr(0, 60));
      *doc = Document{};
      doc->validation = start < validation_bytes_;
      const auto text = StringAt(json, "text"), prompt = StringAt(json, "prompt"), completion = StringAt(json, "completion");
      if (text && (prompt || completion)) Fail("has both \"text\" and \"prompt\"/\"completion\"; give one or the other");
      if (text) {
        doc->text = *text;
      } else if (prompt || completion) {
        if (!prompt) Fail("has \"completion\" but no \"prompt\" string");
        if (!completion) Fail("has \"prompt\" but no \"completion\" string");
        if (completion->empty()) Fail(".completion: is empty; a prompt/completion pair needs a completion to train on");
        doc->pair = true;
        doc->prompt = *prompt;
        doc->completion = *completion;
      } else {
        Fail("has no \"text\" string (nor \"prompt\" and \"completion\" strings)");
      }
      return true;
    }
    if (jsonl_.bad()) throw TokenFileError(path_ + ": read error");
    return false;
  }

  std::vector<std::string> files_;
  uint64_t validation_bytes_;
  PrepareResult* result_;
  size_t next_file_ = 0;
  std::string path_;
  std::ifstream jsonl_;
  int64_t line_number_ = 0;
  uint64_t bytes_done_ = 0;
};

// A document's tokens and, for a prompt/completion pair, which are targets.
struct Encoded {
  std::vector<uint32_t> ids;
  std::vector<bool> targets;  // empty: every token is one
};

void EncodeDocument(const text::Tokenizer& tokenizer, text::Tokenizer::Session& session, const Document& doc,
                    Encoded* out) {
  const text::DocumentFrame& frame = tokenizer.frame();
  out->ids.assign(frame.before.begin(), frame.before.end());
  out->targets.clear();
  if (!doc.pair) {
    session.Encode(doc.text, out->ids);
    out->ids.insert(out->ids.end(), frame.after.begin(), frame.after.end());
    return;
  }
  session.Encode(doc.prompt, out->ids);
  const size_t context = out->ids.size();
  session.Encode(doc.completion, out->ids);
  out->ids.push_back(tokenizer.eos());  // always: the model learns to stop
  out->targets.assign(out->ids.size(), true);
  std::fill(out->targets.begin(), out->targets.begin() + long(context), false);
}

// Shards of one split, written as they fill.
class ShardWriter {
 public:
  ShardWriter(std::string prefix, const char* split, int first_index, uint64_t shard_tokens, uint64_t vocab_size,
              std::vector<PreparedShard>* written)
      : prefix_(std::move(prefix)), split_(split), index_(first_index), shard_tokens_(shard_tokens),
        vocab_size_(vocab_size), written_(written) {}

  // Adds a document's tokens; unless `cuttable`, all in one shard.
  void Add(const std::vector<uint32_t>& tokens, const std::vector<bool>& targets, bool cuttable) {
    if (!cuttable && !buffer_.empty() && buffer_.size() + tokens.size() > shard_tokens_) Flush();
    for (size_t taken = 0; taken < tokens.size();) {
      const size_t room = buffer_.size() < shard_tokens_ ? shard_tokens_ - buffer_.size() : 0;
      const size_t n = cuttable ? std::min<size_t>(tokens.size() - taken, room) : tokens.size();
      buffer_.insert(buffer_.end(), tokens.begin() + long(taken), tokens.begin() + long(taken + n));
      if (targets.empty()) {
        targets_.insert(targets_.end(), n, true);
      } else {
        targets_.insert(targets_.end(), targets.begin() + long(taken), targets.begin() + long(taken + n));
        masked_ = masked_ || std::find(targets.begin() + long(taken), targets.begin() + long(taken + n), false) !=
                                 targets.begin() + long(taken + n);
      }
      taken += n;
      if (buffer_.size() >= shard_tokens_) Flush();
    }
  }

  void Flush() {
    if (buffer_.empty()) return;
    char name[32];
    std::snprintf(name, sizeof name, "_%s_%06d.bin", split_, index_++);
    const std::string path = prefix_ + name;
    WriteLlmcTokenFile(path, buffer_, vocab_size_);
    written_->push_back({path, buffer_.size(), false});
    if (masked_) {
      WriteTokenMask(path + TokenMask::kSuffix, targets_);
      written_->back().masked = true;
    }
    buffer_.clear();
    targets_.clear();
    masked_ = false;
  }

 private:
  std::string prefix_;
  const char* split_;
  int index_;
  uint64_t shard_tokens_, vocab_size_;
  std::vector<PreparedShard>* written_;
  std::vector<uint32_t> buffer_;
  std::vector<bool> targets_;
  bool masked_ = false;
};

void RemoveWritten(const PrepareResult& result) {
  for (const auto* split : {&result.validation, &result.train}) {
    for (const PreparedShard& shard : *split) {
      std::remove(shard.path.c_str());
      if (shard.masked) std::remove((shard.path + TokenMask::kSuffix).c_str());
    }
  }
}

void Prepare(const text::Tokenizer& tokenizer, const PrepareOptions& options, const PrepareProgress& progress,
             PrepareResult& result) {
  const std::vector<std::string> files = ExpandGlobs(options.inputs);
  for (const std::string& f : files) {
    struct stat st {};
    if (::stat(f.c_str(), &st) != 0) throw TokenFileError(f + ": cannot open");
    if (!S_ISREG(st.st_mode)) throw TokenFileError(f + ": is not a regular file");
    result.bytes += uint64_t(st.st_size);
  }
  DocumentReader reader(files, uint64_t(double(result.bytes) * options.validation_fraction), &result);
  ShardWriter validation(options.prefix, "val", 0, options.shard_tokens, tokenizer.vocab_size(), &result.validation);
  ShardWriter train(options.prefix, "train", 1, options.shard_tokens, tokenizer.vocab_size(), &result.train);

  const int threads = options.threads > 0 ? options.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<text::Tokenizer::Session> sessions;
  for (int t = 0; t < threads; ++t) sessions.emplace_back(tokenizer);
  auto last_report = std::chrono::steady_clock::now();
  auto report = [&](uint64_t done) {
    const auto now = std::chrono::steady_clock::now();
    if (progress && now - last_report >= std::chrono::seconds(1)) {
      progress(done, result.bytes);
      last_report = now;
    }
  };
  // Rounds: read about piece_bytes of JSON lines per thread, give each thread a run of
  // documents of about that size, tokenize, write the documents in order. A plain-text file
  // ends the round and is tokenized by every thread at once.
  const uint64_t round_bytes = uint64_t(threads) * options.piece_bytes;
  std::vector<Document> docs;
  std::vector<Encoded> encoded;
  std::optional<Document> whole;
  for (bool more = true; more;) {
    size_t n = 0;
    uint64_t bytes = 0;
    std::vector<size_t> starts = {0};  // thread t encodes documents [starts[t], starts[t+1])
    while (bytes < round_bytes) {
      if (n == docs.size()) docs.emplace_back();
      if (!(more = reader.Next(&docs[n]))) break;
      if (docs[n].whole_file) {
        whole = std::move(docs[n]);
        break;
      }
      bytes += docs[n].text.size() + docs[n].prompt.size() + docs[n].completion.size() + 1;
      ++n;
      if (bytes >= starts.size() * options.piece_bytes && int(starts.size()) < threads) starts.push_back(n);
    }
    starts.push_back(n);
    encoded.resize(std::max(encoded.size(), n));
    std::vector<std::thread> workers;
    for (size_t t = 0; t + 1 < starts.size(); ++t) {
      workers.emplace_back([&, t] {
        for (size_t i = starts[t]; i < starts[t + 1]; ++i) EncodeDocument(tokenizer, sessions[t], docs[i], &encoded[i]);
      });
    }
    for (std::thread& w : workers) w.join();
    for (size_t i = 0; i < n; ++i) {
      (docs[i].validation ? validation : train).Add(encoded[i].ids, encoded[i].targets, false);
      ++result.documents;
      result.prompt_completion += docs[i].pair ? 1 : 0;
    }
    report(reader.bytes_done());
    if (whole) {
      const uint64_t base = reader.bytes_done() - whole->text.size();
      std::vector<uint32_t> ids(tokenizer.frame().before);
      tokenizer.EncodeParallel(whole->text, threads, ids, [&](size_t done) { report(base + done); });
      ids.insert(ids.end(), tokenizer.frame().after.begin(), tokenizer.frame().after.end());
      // The validation share of the file's bytes, as the same share of its tokens.
      const auto cut = size_t(double(ids.size()) * double(whole->validation_bytes) / double(std::max<size_t>(1, whole->text.size())));
      validation.Add(std::vector<uint32_t>(ids.begin(), ids.begin() + long(cut)), {}, true);
      train.Add(std::vector<uint32_t>(ids.begin() + long(cut), ids.end()), {}, true);
      ++result.documents;
      whole.reset();
      more = true;
    }
  }
  validation.Flush();
  train.Flush();
  if (progress) progress(result.bytes, result.bytes);
}

}  // namespace

PrepareResult PrepareTokenShards(const text::Tokenizer& tokenizer, const PrepareOptions& options,
                                 const PrepareProgress& progress) {
  if (options.shard_tokens == 0) throw std::invalid_argument("--shard-tokens must be positive");
  if (!(options.validation_fraction >= 0 && options.validation_fraction < 1)) {
    throw std::invalid_argument("--validation-fraction must be in [0, 1)");
  }
  PrepareResult result;
  try {
    Prepare(tokenizer, options, progress, result);
  } catch (...) {
    RemoveWritten(result);  // nothing half-done is left
    throw;
  }
  return result;
}

}  // namespace meshtrain::train
