#include "worker/train/data_loader.h"

#include <glob.h>

#include <algorithm>
#include <stdexcept>

namespace meshtrain::train {

DataLoader::DataLoader(const std::vector<std::string>& patterns, int batch, int seq, int dp_rank, int dp_size)
    : batch_(batch), seq_(seq), dp_rank_(dp_rank), dp_size_(dp_size) {
  for (const std::string& pattern : patterns) {
    glob_t g{};
    const int rc = ::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g);
    std::vector<std::string> matched(g.gl_pathv, g.gl_pathv + (rc == 0 ? g.gl_pathc : 0));
    ::globfree(&g);
    if (matched.empty()) throw TokenFileError(pattern + ": no token file matches");
    std::sort(matched.begin(), matched.end());
    files_.insert(files_.end(), matched.begin(), matched.end());
  }
  for (const std::string& f : files_) {
    data_.push_back(TokenFile::Open(f));
    starts_.push_back(total_);
    total_ += data_.back().size();
  }
  const uint64_t needed = uint64_t(dp_size_) * batch_ * seq_ + 1;
  if (total_ < needed) {
    throw std::invalid_argument(files_.front() + (files_.size() > 1 ? " and others" : "") + ": " +
                                std::to_string(total_) + " tokens are fewer than one micro-batch needs (" +
                                std::to_string(needed) + ")");
  }
}

uint32_t DataLoader::Token(uint64_t index) const {
  const size_t f = size_t(std::upper_bound(starts_.begin(), starts_.end(), index) - starts_.begin()) - 1;
  return data_[f][index - starts_[f]];
}

void DataLoader::Next(int32_t* inputs, int32_t* targets) {
  const uint64_t span = uint64_t(dp_size_) * batch_ * seq_;
  if (position_ + span + 1 > total_) position_ = 0;
  for (int b = 0; b < batch_; ++b) {
    const uint64_t start = position_ + uint64_t(dp_rank_ * batch_ + b) * seq_;
    for (int t = 0; t < seq_; ++t) {
      inputs[b * seq_ + t] = int32_t(Token(start + t));
      targets[b * seq_ + t] = int32_t(Token(start + t + 1));
    }
  }
  position_ += span;
}

}  // namespace meshtrain::train
