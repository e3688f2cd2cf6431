#include "worker/text/bpe_model.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <queue>

#include "worker/text/tokenizer.h"
#include "worker/text/utf8.h"

namespace meshtrain::text {
namespace {

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
// Pre-tokens longer than this are merged without the cache, which would only grow.
constexpr size_t kLongestCached = 64;
constexpr size_t kCacheEntries = size_t(1) << 20;

// A byte's token as Hugging Face spells it: "<0x0A>".
std::string ByteFallbackName(uint8_t byte) {
  char name[8];
  std::snprintf(name, sizeof name, "<0x%02X>", byte);
  return name;
}

}  // namespace

BpeModel BpeModel::Build(const std::vector<std::pair<std::string, uint32_t>>& vocab,
                         const std::vector<std::pair<std::string, std::string>>& merges, const Options& options,
                         const std::string& source) {
  BpeModel m;
  m.options_ = options;
  for (const auto& [spelled, id] : vocab) {
    if (!m.id_of_.emplace(spelled, id).second) {
      throw TokenizerError(source + ": token \"" + spelled + "\" is listed twice in the vocabulary");
    }
  }
  std::fill(std::begin(m.byte_symbol_), std::end(m.byte_symbol_), kNone);
  std::fill(std::begin(m.byte_fallback_), std::end(m.byte_fallback_), kNone);
  m.all_byte_fallbacks_ = true;
  for (int b = 0; b < 256; ++b) {
    if (const auto id = m.IdOf(ByteFallbackName(uint8_t(b)))) m.byte_fallback_[b] = *id;
    else m.all_byte_fallbacks_ = false;
  }
  if (options.byte_level) {
    for (int b = 0; b < 256; ++b) {
      std::string spelled;
      AppendUtf8(Gpt2ByteCodePoint(uint8_t(b)), spelled);
      if (const auto id = m.IdOf(spelled)) m.byte_symbol_[b] = *id;
    }
  }
  if (options.byte_level && !options.unk_token) {
    for (int b = 0; b < 256; ++b) {
      if (m.byte_symbol_[b] == kNone) {
        throw TokenizerError(source + ": the vocabulary lacks the token of byte " + std::to_string(b));
      }
    }
  }
  if (options.unk_token) {
    m.unk_id_ = m.IdOf(*options.unk_token);
    if (!m.unk_id_) throw TokenizerError(source + ": model.unk_token \"" + *options.unk_token + "\" is not in the vocabulary");
  }
  // Pairs of symbols side by side in some token, and the byte spelling of tokens.
  static const std::unordered_map<uint32_t, uint8_t> byte_of = [] {
    std::unordered_map<uint32_t, uint8_t> map;
    for (int b = 0; b < 256; ++b) map[Gpt2ByteCodePoint(uint8_t(b))] = uint8_t(b);
    return map;
  }();
  if (options.byte_level) m.joinable_bytes_.assign(size_t(1) << 16, false);
  for (const auto& [spelled, id] : vocab) {
    std::vector<uint32_t> cps;
    for (size_t pos = 0; pos < spelled.size();) cps.push_back(NextCodePoint(spelled, &pos));
    if (options.byte_level) {
      std::string bytes;
      bool mapped = true;
      for (uint32_t cp : cps) {
        const auto it = byte_of.find(cp);
        if (it == byte_of.end()) {
          mapped = false;
          break;
        }
        bytes += char(it->second);
      }
      if (!mapped) continue;  // not made of bytes: no merge of byte symbols makes it
      for (size_t i = 1; i < bytes.size(); ++i) m.joinable_bytes_[size_t(uint8_t(bytes[i - 1])) << 8 | uint8_t(bytes[i])] = true;
      m.id_of_bytes_.emplace(bytes, id);
    } else {
      if (cps.size() == 1) m.char_symbol_.emplace(cps[0], id);
      for (size_t i = 1; i < cps.size(); ++i) m.joinable_chars_.insert(PairKey(cps[i - 1], cps[i]));
    }
  }
  const std::string& prefix = options.continuing_subword_prefix;
  uint32_t rank = 0;
  for (const auto& [left, right] : merges) {
    const auto l = m.IdOf(left), r = m.IdOf(right);
    // Hugging Face: the merged token drops the right part's continuing prefix.
    const std::string joined =
        left + (!prefix.empty() && right.compare(0, prefix.size(), prefix) == 0 ? right.substr(prefix.size()) : right);
    const auto result = m.IdOf(joined);
    if (!l || !r || !result) {
      throw TokenizerError(source + ": merge " + std::to_string(rank + 1) + " \"" + left + " " + right +
                           "\" names a token the vocabulary lacks" + (result ? "" : " (\"" + joined + "\")"));
    }
    // A pair listed twice keeps its first (lowest) rank, as Hugging Face's map does not:
    // there the later one wins. Both are rare enough to be an error instead.
    if (!m.merges_.emplace(PairKey(*l, *r), MergeRule{rank, *result}).second) {
      throw TokenizerError(source + ": merge " + std::to_string(rank + 1) + " \"" + left + " " + right +
                           "\" is listed twice");
    }
    ++rank;
  }
  m.cuttable_ = options.continuing_subword_prefix.empty() && options.end_of_word_suffix.empty();
  return m;
}

std::optional<uint32_t> BpeModel::IdOf(std::string_view spelled) const {
  const auto it = id_of_.find(std::string(spelled));
  if (it == id_of_.end()) return std::nullopt;
  return it->second;
}

bool BpeModel::Joinable(uint32_t left, uint32_t right) const {
  if (options_.byte_level) return joinable_bytes_[size_t(left) << 8 | right];
  return joinable_chars_.count(PairKey(left, right)) > 0;
}

bool BpeModel::CanCut(std::string_view piece, size_t pos) const {
  if (!cuttable_ || pos == 0 || pos >= piece.size()) return false;
  if (options_.byte_level) {
    const auto left = uint8_t(piece[pos - 1]), right = uint8_t(piece[pos]);
    return byte_symbol_[left] != kNone && byte_symbol_[right] != kNone && !Joinable(left, right);
  }
  if ((uint8_t(piece[pos]) & 0xC0) == 0x80) return false;  // inside a character
  size_t start = pos - 1;
  while (start > 0 && (uint8_t(piece[start]) & 0xC0) == 0x80) --start;
  size_t at = start;
  const uint32_t left = NextCodePoint(piece, &at);
  at = pos;
  const uint32_t right = NextCodePoint(piece, &at);
  // Both must be symbols of their own: unknown characters fall back or fuse across a cut.
  return char_symbol_.count(left) > 0 && char_symbol_.count(right) > 0 && !Joinable(left, right);
}

void BpeModel::Tokenize(std::string_view piece, bool whole, Scratch& scratch, std::vector<uint32_t>& ids) const {
  if (piece.empty()) return;
  if (options_.ignore_merges && whole) {
    const auto& table = options_.byte_level ? id_of_bytes_ : id_of_;
    if (const auto it = table.find(std::string(piece)); it != table.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  if (piece.size() <= kLongestCached || !cuttable_) {
    Merge(piece, scratch, ids);
    return;
  }
  // Long: merged in parts, cut where no merge can join the symbols either side.
  size_t start = 0;
  for (size_t pos = 1; pos < piece.size(); ++pos) {
    if (CanCut(piece, pos)) {
      Merge(piece.substr(start, pos - start), scratch, ids);
      start = pos;
    }
  }
  Merge(piece.substr(start), scratch, ids);
}

// The initial symbols of `piece` into scratch.initial_ (kNone for none: a dropped character).
void BpeModel::Symbols(std::string_view piece, Scratch& scratch) const {
  std::vector<uint32_t>& out = scratch.initial_;
  out.clear();
  const bool affixes = !options_.continuing_subword_prefix.empty() || !options_.end_of_word_suffix.empty();
  std::optional<uint32_t> pending_unk;
  auto flush_unk = [&] {
    if (pending_unk) out.push_back(*pending_unk);
    pending_unk.reset();
  };
  for (size_t pos = 0; pos < piece.size();) {
    const size_t start = pos;
    uint32_t id = kNone;
    if (options_.byte_level) {
      id = byte_symbol_[uint8_t(piece[pos])];
      ++pos;
    } else {
      const uint32_t cp = NextCodePoint(piece, &pos);
      if (!affixes) {
        const auto it = char_symbol_.find(cp);
        if (it != char_symbol_.end()) id = it->second;
      }
    }
    std::string spelled;
    if (id == kNone || affixes) {
      if (options_.byte_level) AppendUtf8(Gpt2ByteCodePoint(uint8_t(piece[start])), spelled);
      else spelled.assign(piece.substr(start, pos - start));
      if (affixes) {
        if (start > 0) spelled = options_.continuing_subword_prefix + spelled;
        if (pos == piece.size()) spelled += options_.end_of_word_suffix;
        if (const auto found = IdOf(spelled)) id = *found;
      }
    }
    if (id != kNone) {
      flush_unk();
      out.push_back(id);
      continue;
    }
    if (options_.byte_fallback) {
      bool all = true;
      for (char c : spelled) all = all && byte_fallback_[uint8_t(c)] != kNone;
      if (all) {
        flush_unk();
        for (char c : spelled) out.push_back(byte_fallback_[uint8_t(c)]);
        continue;
      }
    }
    if (unk_id_) {
      if (!(pending_unk && options_.fuse_unk)) {
        flush_unk();
        pending_unk = *unk_id_;
      }
    }
  }
  flush_unk();
}

void BpeModel::Merge(std::string_view piece, Scratch& s, std::vector<uint32_t>& ids) const {
  const bool cacheable = piece.size() <= kLongestCached;
  if (cacheable) {
    const auto hit = s.cache_.find(std::string(piece));
    if (hit != s.cache_.end()) {
      ids.insert(ids.end(), hit->second.begin(), hit->second.end());
      return;
    }
  }
  Symbols(piece, s);
  const auto n = uint32_t(s.initial_.size());
  s.symbol_.assign(s.initial_.begin(), s.initial_.end());
  s.next_.resize(n);
  s.prev_.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    s.next_[i] = i + 1 < n ? i + 1 : kNone;
    s.prev_[i] = i > 0 ? i - 1 : kNone;
  }
  // Candidates (rank, left position, left id, right id), lowest rank then leftmost first.
  // Stale ones are recognised by the symbols no longer being there.
  struct Candidate {
    uint32_t rank, pos, left, right;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto consider = [&](uint32_t pos) {
    if (pos == kNone || s.next_[pos] == kNone) return;
    const auto m = merges_.find(PairKey(s.symbol_[pos], s.symbol_[s.next_[pos]]));
    if (m != merges_.end()) heap.push({m->second.rank, pos, s.symbol_[pos], s.symbol_[s.next_[pos]]});
  };
  for (uint32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const uint32_t right = s.next_[c.pos];
    if (s.symbol_[c.pos] != c.left || right == kNone || s.symbol_[right] != c.right) continue;
    s.symbol_[c.pos] = merges_.at(PairKey(c.left, c.right)).result;
    s.symbol_[right] = kNone;
    s.next_[c.pos] = s.next_[right];
    if (s.next_[right] != kNone) s.prev_[s.next_[right]] = c.pos;
    consider(s.prev_[c.pos]);
    consider(c.pos);
  }
  const size_t first = ids.size();
  for (uint32_t i = n > 0 ? 0 : kNone; i != kNone; i = s.next_[i]) ids.push_back(s.symbol_[i]);
  if (cacheable) {
    if (s.cache_.size() >= kCacheEntries) s.cache_.clear();
    s.cache_.emplace(std::string(piece), std::vector<uint32_t>(ids.begin() + long(first), ids.end()));
  }
}

}  // namespace meshtrain::text
