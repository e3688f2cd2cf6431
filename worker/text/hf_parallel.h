// Encoding the stretches of text between added tokens, whole (one Session) or cut into
// parts for several threads (EncodeInParts), with the same ids either way. Internal to
// worker/text.
//
// Where the first pre-tokenizer is a regular expression whose matches are isolated (kScan),
// each part is scanned from a guessed cut with PCRE2's hard partial matching, which stops
// at the first match that could end otherwise with more text; joining the parts, the true
// scan runs from there until it meets a match start that the next part found, from which
// on both scans are the same. Where there is no regular expression (kExact), parts are
// cut only where no merge joins the symbols either side (BpeModel::CanCut). Otherwise
// (kWhole) each stretch is one part.
//
// Encoding throws TokenizerError where a pattern fails on the text (past PCRE2's match
// limit). Thread-safety: a PartEncoder is one thread's; EncodeInParts runs one thread per
// encoder.

#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "worker/text/bpe_model.h"
#include "worker/text/hf_pre_tokenizers.h"
#include "worker/text/hf_regex.h"
#include "worker/text/tokenizer_engine.h"

namespace meshtrain::text::hf {

inline constexpr uint32_t kNoToken = std::numeric_limits<uint32_t>::max();

// A stretch of text between added tokens, as the first pre-tokenizer sees it, or an added
// token (subject empty).
struct Item {
  uint32_t token = kNoToken;
  std::string subject;
  bool at_origin = false;  // at offset 0 of the document (Metaspace's prepend_scheme first)
};

// One part of a stretch encoded by one thread.
struct Part {
  size_t item = 0, from = 0, to = 0;
  bool last = false;  // reaches the stretch's end
  std::vector<uint32_t> ids;
  std::vector<std::pair<size_t, size_t>> starts;  // (pre-token start, ids before it), the first few
  size_t complete_until = 0, complete_count = 0;  // the part is the true scan up to here
};

enum class Chunking { kWhole, kExact, kScan };

// How the stretches of a tokenizer with these pre-tokenizers and this model may be cut.
Chunking ChunkingOf(const PreTokenizers& pre, const BpeModel& model);

// One thread's encoding of parts: its match data and the model's scratch. Holds references
// to the pre-tokenizers and the model, which must outlive it.
class PartEncoder {
 public:
  PartEncoder(const PreTokenizers& pre, const BpeModel& model, Chunking chunking);

  // Encodes item[from, to): the true scan when the part starts at a pre-token's start.
  void EncodePart(const Item& item, Part& part);
  // Appends the ids of the next pre-token from `at` of the whole stretch; returns its end.
  size_t EncodeNext(const Item& item, size_t at, std::vector<uint32_t>& ids);

  // This thread's match data, for the normalizers too.
  Matchers& matchers() { return matchers_; }

 private:
  // Pre-tokenizer `step` and those after it, then the model, on one piece.
  void Apply(size_t step, std::string_view piece, bool at_origin, std::vector<uint32_t>& ids);
  // The first piece of step 0's Isolated scan from `at`: kMatch (a match or a gap), kPartial
  // (from there on the scan needs more text), kNone (at the end).
  Matcher::Result Piece(const Item& item, size_t length, size_t at, bool partial, size_t* end);

  const PreTokenizers& pre_;
  const BpeModel& model_;
  Chunking chunking_;
  BpeModel::Scratch scratch_;
  Matchers matchers_;
};

// Appends the ids of `items` (from a text of `text_bytes`): each added token's id, and each
// stretch cut into parts encoded on one thread per encoder (at least one), then joined.
// Calls `progress` as RunTasks does.
void EncodeInParts(const std::vector<Item>& items, size_t text_bytes, const BpeModel& model, Chunking chunking,
                   std::vector<PartEncoder>& encoders, std::vector<uint32_t>& ids, const ProgressFn& progress);

}  // namespace meshtrain::text::hf
