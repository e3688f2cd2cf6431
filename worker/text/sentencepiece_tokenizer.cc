// SentencePiece's tokenizer.model through Debian's libsentencepiece.
//
// A long text is encoded in parts on several threads only where that cannot change the ids:
// cut just before a single space between two ASCII characters that are not spaces ("x| y"),
// in a model whose pieces hold U+2581 (the escaped space) only in a leading run, so that no
// piece spans the cut. SentencePiece's normalizer makes the space a U+2581 before "y" either
// way: with remove_extra_whitespaces (and add_dummy_prefix) the part's leading space is
// dropped and the dummy prefix takes its place; without either, the part is encoded by the
// same model with add_dummy_prefix off. Other models encode a text on one thread.

#include <sentencepiece_processor.h>

#include <algorithm>

#include "worker/text/tokenizer.h"
#include "worker/text/tokenizer_engine.h"

namespace meshtrain::text {
namespace {

constexpr const char* kSpaceSymbol = "\xe2\x96\x81";  // U+2581

// The few fields of the serialized ModelProto that decide where a text may be cut.
struct ProtoFacts {
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
  bool treat_whitespace_as_suffix = false;
};

bool ReadVarint(std::string_view data, size_t* at, uint64_t* value) {
  *value = 0;
  for (int shift = 0; shift < 64 && *at < data.size(); shift += 7) {
    const auto byte = uint8_t(data[(*at)++]);
    *value |= uint64_t(byte & 0x7F) << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

// Calls field(number, varint value, bytes) for each field of a message; false if malformed.
template <class Field>
bool ForEachField(std::string_view data, Field&& field) {
  for (size_t at = 0; at < data.size();) {
    uint64_t key = 0, value = 0;
    if (!ReadVarint(data, &at, &key)) return false;
    switch (key & 7) {
      case 0:
        if (!ReadVarint(data, &at, &value)) return false;
        field(key >> 3, value, std::string_view());
        break;
      case 1:
        at += 8;
        break;
      case 2:
        if (!ReadVarint(data, &at, &value) || value > data.size() - std::min(at, data.size())) return false;
        field(key >> 3, 0, data.substr(at, value));
        at += value;
        break;
      case 5:
        at += 4;
        break;
      default:
        return false;
    }
    if (at > data.size()) return false;
  }
  return true;
}

ProtoFacts ReadFacts(std::string_view model) {
  ProtoFacts facts;
  ForEachField(model, [&](uint64_t number, uint64_t, std::string_view bytes) {
    if (number == 3) {  // normalizer_spec
      ForEachField(bytes, [&](uint64_t n, uint64_t v, std::string_view) {
        if (n == 3) facts.add_dummy_prefix = v != 0;
        if (n == 4) facts.remove_extra_whitespaces = v != 0;
        if (n == 5) facts.escape_whitespaces = v != 0;
      });
    } else if (number == 2) {  // trainer_spec
      ForEachField(bytes, [&](uint64_t n, uint64_t v, std::string_view) {
        if (n == 24) facts.treat_whitespace_as_suffix = v != 0;
      });
    }
  });
  return facts;
}

bool AsciiNonSpace(char c) { return uint8_t(c) > 0x20 && uint8_t(c) < 0x7F; }

class SentencePieceEngine : public TokenizerEngine {
 public:
  SentencePieceEngine(std::string_view model, const std::string& source) : source_(source) {
    if (const auto status = first_.LoadFromSerializedProto(model); !status.ok()) {
      throw TokenizerError(source + ": not a SentencePiece model: " + status.ToString());
    }
    const ProtoFacts facts = ReadFacts(model);
    bool pieces_cut = facts.escape_whitespaces && !facts.treat_whitespace_as_suffix &&
                      (facts.remove_extra_whitespaces == facts.add_dummy_prefix || !facts.remove_extra_whitespaces);
    for (int id = 0; id < first_.GetPieceSize() && pieces_cut; ++id) {
      const std::string& piece = first_.IdToPiece(id);
      size_t lead = 0;
      while (piece.compare(lead, 3, kSpaceSymbol) == 0) lead += 3;
      pieces_cut = piece.find(kSpaceSymbol, lead) == std::string::npos;
    }
    cuttable_ = pieces_cut;
    if (cuttable_ && !facts.remove_extra_whitespaces && facts.add_dummy_prefix) {
      // The same model with normalizer_spec.add_dummy_prefix = false: a second
      // normalizer_spec field is merged into the first, as protobuf does.
      std::string continued(model);
      continued += std::string("\x1a\x02\x18\x00", 4);
      continued_ = std::make_unique<sentencepiece::SentencePieceProcessor>();
      if (const auto status = continued_->LoadFromSerializedProto(continued); !status.ok()) {
        throw TokenizerError(source + ": cannot reload without the dummy prefix: " + status.ToString());
      }
    }
  }

  class SpSession : public Session {
   public:
    explicit SpSession(const SentencePieceEngine& engine) : engine_(engine) {}
    void Encode(std::string_view text, std::vector<uint32_t>& ids) override { engine_.EncodeWith(engine_.first_, text, ids); }

   private:
    const SentencePieceEngine& engine_;
  };

  std::unique_ptr<Session> NewSession() const override { return std::make_unique<SpSession>(*this); }

  void EncodeWith(const sentencepiece::SentencePieceProcessor& sp, std::string_view text, std::vector<uint32_t>& ids) const {
    std::vector<int> out;
    if (const auto status = sp.Encode(text, &out); !status.ok()) {
      throw TokenizerError(source_ + ": encoding failed: " + status.ToString());
    }
    ids.insert(ids.end(), out.begin(), out.end());
  }

  void EncodeParallel(std::string_view text, int threads, std::vector<uint32_t>& ids,
                      const ProgressFn& progress) const override {
    threads = std::max(1, threads);
    const size_t part_bytes = std::clamp<size_t>(text.size() / size_t(threads * 4), size_t(1) << 16, size_t(1) << 22);
    std::vector<size_t> cuts = {0};
    while (cuttable_ && text.size() - cuts.back() > part_bytes) {
      size_t p = cuts.back() + part_bytes;
      while (p + 1 < text.size() && !(text[p] == ' ' && AsciiNonSpace(text[p - 1]) && AsciiNonSpace(text[p + 1]))) ++p;
      if (p + 1 >= text.size()) break;
      cuts.push_back(p);
    }
    cuts.push_back(text.size());
    std::vector<std::vector<uint32_t>> parts(cuts.size() - 1);
    const sentencepiece::SentencePieceProcessor& rest = continued_ ? *continued_ : first_;
    RunTasks(
        parts.size(), threads,
        [&](size_t i, int) { EncodeWith(i == 0 ? first_ : rest, text.substr(cuts[i], cuts[i + 1] - cuts[i]), parts[i]); },
        [&](size_t i) { return cuts[i + 1] - cuts[i]; }, progress);
    for (const auto& part : parts) ids.insert(ids.end(), part.begin(), part.end());
  }

  std::string Decode(std::span<const uint32_t> ids) const override {
    std::vector<int> in;
    for (uint32_t id : ids) {
      if (id >= vocab_size()) {
        throw std::out_of_range("token id " + std::to_string(id) + " is past the tokenizer's vocabulary of " +
                                std::to_string(vocab_size()));
      }
      in.push_back(int(id));
    }
    std::string text;
    if (const auto status = first_.Decode(in, &text); !status.ok()) {
      throw TokenizerError(source_ + ": decoding failed: " + status.ToString());
    }
    return text;
  }

  uint32_t vocab_size() const override { return uint32_t(first_.GetPieceSize()); }

  std::optional<uint32_t> IdOf(std::string_view content) const override {
    const int id = first_.PieceToId(content);
    if (id < 0 || first_.IdToPiece(id) != content) return std::nullopt;
    return uint32_t(id);
  }

  Specials specials() const override {
    Specials s;
    if (first_.bos_id() >= 0) s.bos = uint32_t(first_.bos_id());
    if (first_.eos_id() >= 0) s.eos = uint32_t(first_.eos_id());
    return s;
  }

  std::string kind() const override { return "tokenizer.model (SentencePiece)"; }

 private:
  std::string source_;
  sentencepiece::SentencePieceProcessor first_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> continued_;  // parts after a cut, when it differs
  bool cuttable_ = false;
};

}  // namespace

std::shared_ptr<const TokenizerEngine> MakeSentencePieceEngine(std::string_view model, const std::string& source) {
  return std::make_shared<SentencePieceEngine>(model, source);
}

}  // namespace meshtrain::text
