#include "worker/text/hf_parallel.h"

#include <algorithm>

namespace meshtrain::text::hf {
namespace {

// Of a part's pre-token starts, those kept for joining it to the previous part.
constexpr size_t kRecordedStarts = 4096;

// The model, taking each pre-token whole.
class ModelSink final : public PreTokenSink {
 public:
  ModelSink(const BpeModel& model, BpeModel::Scratch& scratch, std::vector<uint32_t>& ids)
      : model_(model), scratch_(scratch), ids_(ids) {}
  void Add(std::string_view pre_token) override { model_.Tokenize(pre_token, true, scratch_, ids_); }

 private:
  const BpeModel& model_;
  BpeModel::Scratch& scratch_;
  std::vector<uint32_t>& ids_;
};

// The next place at or after `from` to cut a long stretch for another thread.
size_t Cut(const Item& item, size_t from, const BpeModel& model, Chunking chunking) {
  const std::string_view s = item.subject;
  if (chunking == Chunking::kExact) {
    for (size_t p = std::max<size_t>(from, 1); p < s.size(); ++p) {
      if (model.CanCut(s, p)) return p;
    }
    return s.size();
  }
  // A guess, checked when the parts are joined: after a line break, before a letter.
  const size_t limit = std::min(s.size(), from + 4096);
  for (size_t p = std::max<size_t>(from, 1); p < limit; ++p) {
    if (s[p - 1] == '\n' && ((s[p] >= 'a' && s[p] <= 'z') || (s[p] >= 'A' && s[p] <= 'Z'))) return p;
  }
  size_t p = std::min(from, s.size());
  while (p < s.size() && (uint8_t(s[p]) & 0xC0) == 0x80) ++p;
  return p;
}

}  // namespace

Chunking ChunkingOf(const PreTokenizers& pre, const BpeModel& model) {
  const std::vector<PreStep>& steps = pre.steps();
  if (steps.empty() || (steps.size() == 1 && steps[0].kind != PreStep::kSplit && !steps[0].regex)) {
    return model.cuttable() ? Chunking::kExact : Chunking::kWhole;
  }
  if (steps[0].regex && steps[0].behavior == Behavior::kIsolated && !steps[0].invert) return Chunking::kScan;
  return Chunking::kWhole;
}

PartEncoder::PartEncoder(const PreTokenizers& pre, const BpeModel& model, Chunking chunking)
    : pre_(pre), model_(model), chunking_(chunking) {}

void PartEncoder::Apply(size_t step, std::string_view piece, bool at_origin, std::vector<uint32_t>& ids) {
  ModelSink sink(model_, scratch_, ids);
  pre_.Apply(step, piece, at_origin, matchers_, sink);
}

Matcher::Result PartEncoder::Piece(const Item& item, size_t length, size_t at, bool partial, size_t* end) {
  const Regex& regex = *pre_.steps()[0].regex;
  size_t begin = 0;
  const Matcher::Result r = matchers_.Of(regex).Find(regex, item.subject, length, at, partial, &begin, end);
  if (r == Matcher::kNone) {  // the rest is a gap, which more text may lengthen
    *end = length;
    return at == length ? Matcher::kNone : partial ? Matcher::kPartial : Matcher::kMatch;
  }
  if (begin > at) {  // a gap: final, since no match (even a partial one) starts inside it
    *end = begin;
    return Matcher::kMatch;
  }
  return r;
}

size_t PartEncoder::EncodeNext(const Item& item, size_t at, std::vector<uint32_t>& ids) {
  size_t end = 0;
  Piece(item, item.subject.size(), at, false, &end);
  Apply(1, std::string_view(item.subject).substr(at, end - at), item.at_origin && at == 0, ids);
  return end;
}

void PartEncoder::EncodePart(const Item& item, Part& part) {
  part.ids.clear();
  part.starts.clear();
  const std::string_view subject = item.subject;
  switch (chunking_) {
    case Chunking::kWhole:
    case Chunking::kExact:
      if (pre_.steps().empty()) {
        model_.Tokenize(subject.substr(part.from, part.to - part.from), part.from == 0 && part.to == subject.size(),
                        scratch_, part.ids);
      } else {
        ModelSink sink(model_, scratch_, part.ids);
        pre_.Split(0, subject.substr(part.from, part.to - part.from), item.at_origin && part.from == 0, matchers_, sink);
      }
      part.starts = {{part.from, 0}};
      part.complete_until = part.to;
      break;
    case Chunking::kScan: {
      size_t at = part.from;
      while (at < part.to) {
        size_t end = 0;
        const Matcher::Result r = Piece(item, part.to, at, !part.last, &end);
        if (r != Matcher::kMatch) break;
        if (part.starts.size() < kRecordedStarts) part.starts.emplace_back(at, part.ids.size());
        Apply(1, subject.substr(at, end - at), item.at_origin && at == 0, part.ids);
        at = end;
      }
      part.complete_until = at;
      break;
    }
  }
  part.complete_count = part.ids.size();
}

void EncodeInParts(const std::vector<Item>& items, size_t text_bytes, const BpeModel& model, Chunking chunking,
                   std::vector<PartEncoder>& encoders, std::vector<uint32_t>& ids, const ProgressFn& progress) {
  const int threads = int(encoders.size());
  // Parts of about a quarter of a thread's share, from 64 KiB to 4 MiB.
  const size_t part_bytes = std::clamp<size_t>(text_bytes / size_t(threads * 4), size_t(1) << 16, size_t(1) << 22);
  std::vector<Part> parts;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].token != kNoToken) continue;
    const size_t size = items[i].subject.size();
    size_t from = 0;
    while (true) {
      Part part;
      part.item = i;
      part.from = from;
      part.to = chunking == Chunking::kWhole || size - from <= part_bytes ? size
                                                                          : Cut(items[i], from + part_bytes, model, chunking);
      part.last = part.to == size;
      parts.push_back(std::move(part));
      if (parts.back().last) break;
      from = parts.back().to;
    }
  }
  RunTasks(
      parts.size(), threads, [&](size_t p, int worker) { encoders[size_t(worker)].EncodePart(items[parts[p].item], parts[p]); },
      [&](size_t p) { return parts[p].to - parts[p].from; }, progress);
  // Join in order. A part's ids are the true ones from the first of its pre-token starts
  // that the true scan reaches.
  PartEncoder& joiner = encoders[0];
  size_t next = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    if (item.token != kNoToken) {
      ids.push_back(item.token);
      continue;
    }
    size_t pos = 0;  // the ids are final up to here
    for (; next < parts.size() && parts[next].item == i; ++next) {
      Part& part = parts[next];
      while (pos < part.complete_until) {
        if (pos >= part.from) {
          const auto it = std::lower_bound(part.starts.begin(), part.starts.end(), std::make_pair(pos, size_t(0)));
          if (it != part.starts.end() && it->first == pos) {
            ids.insert(ids.end(), part.ids.begin() + long(it->second), part.ids.begin() + long(part.complete_count));
            pos = part.complete_until;
            break;
          }
        }
        pos = joiner.EncodeNext(item, pos, ids);
      }
      part.ids = {};
    }
    while (pos < item.subject.size()) pos = joiner.EncodeNext(item, pos, ids);
  }
}

}  // namespace meshtrain::text::hf
