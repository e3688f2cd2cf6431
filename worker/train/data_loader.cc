#include "worker/train/data_loader.h"

#include <algorithm>
#include <bit>
#include <stdexcept>

namespace meshtrain::train {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

// A four-round Feistel network over the smallest power of four at or above `count`,
// walked until it lands inside [0, count): a permutation in O(1) memory, however many
// windows there are (fewer than four steps of the walk on average).
uint64_t DataLoader::Permute(uint64_t index, uint64_t count, uint64_t seed, uint64_t pass) {
  const int bits = count <= 1 ? 0 : std::bit_width(count - 1);
  const int half = (bits + 1) / 2;
  const uint64_t mask = (uint64_t(1) << half) - 1;
  const uint64_t key = SplitMix64(seed ^ SplitMix64(pass));
  uint64_t x = index;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t mixed = left ^ (SplitMix64(key + round * 0x632BE59BD9B4E019ull + right) & mask);
      left = right;
      right = mixed;
    }
    x = left << half | right;
  } while (x >= count);
  return x;
}

DataLoader::DataLoader(const std::vector<std::string>& patterns, const DataOptions& options)
    : options_(options), window_(size_t(options.seq) + 1) {
  files_ = ExpandGlobs(patterns);
  const auto T = uint64_t(options.seq);
  window_starts_.push_back(0);
  for (const std::string& f : files_) {
    data_.push_back(TokenFile::Open(f, options.format));
    if (options.vocab_size > 0) data_.back().CheckVocabulary(options.vocab_size);
    const uint64_t n = data_.back().size();
    masks_.push_back(TokenMask::OpenBeside(f, n));
    tokens_ += n;
    window_starts_.push_back(window_starts_.back() + (n > T ? (n - 1) / T : 0));
  }
  const uint64_t needed = uint64_t(options.dp_size) * uint64_t(options.batch);
  if (windows() < needed) {
    throw std::invalid_argument(files_.front() + (files_.size() > 1 ? " and others" : "") + ": " +
                                std::to_string(tokens_) + " tokens make " + std::to_string(windows()) +
                                " windows of seqLen+1 = " + std::to_string(T + 1) + " tokens (none crossing a file's "
                                "end), fewer than one micro-batch of all data-parallel ranks needs (" +
                                std::to_string(needed) + ")");
  }
}

std::pair<size_t, uint64_t> DataLoader::Window(uint64_t index, uint64_t pass) const {
  const uint64_t window = Permute(index, windows(), options_.seed, pass);
  const size_t f =
      size_t(std::upper_bound(window_starts_.begin(), window_starts_.end(), window) - window_starts_.begin()) - 1;
  return {f, (window - window_starts_[f]) * uint64_t(options_.seq)};
}

void DataLoader::Next(int32_t* inputs, int32_t* targets) {
  const auto B = uint64_t(options_.batch), T = uint64_t(options_.seq);
  const uint64_t span = uint64_t(options_.dp_size) * B;
  const uint64_t per_pass = windows() / span * span;
  const uint64_t pass = position_ / per_pass, first = position_ % per_pass;
  for (uint64_t b = 0; b < B; ++b) {
    const auto [f, start] = Window(first + uint64_t(options_.dp_rank) * B + b, pass);
    data_[f].Read(start, T + 1, window_.data());
    std::copy_n(window_.begin(), T, inputs + b * T);
    std::copy_n(window_.begin() + 1, T, targets + b * T);
    if (masks_[f]) {
      for (uint64_t t = 0; t < T; ++t) {
        if (!masks_[f]->target(start + 1 + t)) targets[b * T + t] = -1;
      }
    }
  }
  position_ += span;
}

int64_t DataLoader::GlobalTargets(int64_t micro_steps) const {
  const auto B = uint64_t(options_.batch), T = uint64_t(options_.seq);
  const uint64_t span = uint64_t(options_.dp_size) * B;
  if (!masked()) return int64_t(uint64_t(micro_steps) * span * T);
  const uint64_t per_pass = windows() / span * span;
  uint64_t targets = 0;
  for (int64_t m = 0; m < micro_steps; ++m) {
    const uint64_t position = position_ + uint64_t(m) * span;
    const uint64_t pass = position / per_pass, first = position % per_pass;
    for (uint64_t w = 0; w < span; ++w) {
      const auto [f, start] = Window(first + w, pass);
      targets += masks_[f] ? masks_[f]->CountTargets(start + 1, T) : T;
    }
  }
  return int64_t(targets);
}

DocumentMarks DocumentMarks::Of(const std::vector<uint32_t>& before, const std::vector<uint32_t>& after) {
  DocumentMarks marks;
  if (!before.empty()) {
    marks.start = int32_t(before.front());
  } else if (!after.empty()) {
    marks.end = int32_t(after.back());
  }
  return marks;
}

std::vector<int64_t> DocumentMarks::Starts(const int32_t* tokens, int64_t n) const {
  std::vector<int64_t> starts{0};
  for (int64_t t = 1; t < n; ++t) {
    // Of start tokens in a row the last starts the document: GPT-2's prompt/completion pair
    // ends with <|endoftext|>, before the next document's.
    const bool starts_one = start && tokens[t] == *start && !(t + 1 < n && tokens[t + 1] == *start);
    if (starts_one || (end && tokens[t - 1] == *end)) starts.push_back(t);
  }
  return starts;
}

bool DocumentMarks::Found(const int32_t* tokens, int64_t n) const { return n > 1 && Starts(tokens, n).size() > 1; }

std::string DataLoader::FileWithoutDocuments(const DocumentMarks& marks, uint64_t tokens) const {
  std::vector<int32_t> head;
  for (const TokenFile& file : data_) {
    head.resize(size_t(std::min(tokens, file.size())));
    file.Read(0, head.size(), head.data());
    if (!marks.Found(head.data(), int64_t(head.size()))) return file.path();
  }
  return {};
}

bool DataLoader::masked() const {
  return std::any_of(masks_.begin(), masks_.end(), [](const auto& m) { return m.has_value(); });
}

}  // namespace meshtrain::train
