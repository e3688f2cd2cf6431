#include "worker/train/checkpoint_layout.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "worker/parallel/flat_unit.h"

namespace meshtrain::train {

ShardFileLayout LayOutShardFile(const model::ParameterLayout& slice, int shard_size, int shard_rank,
                                int64_t chunk_elements, const std::vector<int>& units) {
  const int ep = slice.ep_size();
  if (ep > 1 && (shard_size % ep != 0 || shard_rank % ep != slice.ep_rank())) {
    throw std::invalid_argument("shard " + std::to_string(shard_rank) + " of " + std::to_string(shard_size) +
                                " does not hold expert rank " + std::to_string(slice.ep_rank()) + " of " +
                                std::to_string(ep) + "'s experts");
  }
  ShardFileLayout file;
  file.chunk_elements = chunk_elements;
  std::vector<int> all;
  for (int u = 0; u < slice.units() && units.empty(); ++u) all.push_back(u);
  for (int u : units.empty() ? all : units) {
    const bool split = ep > 1 && slice.UnitHasExperts(u);  // over the ranks holding the same experts
    const parallel::UnitShard s =
        parallel::ShardOfUnit(slice, u, split ? shard_size / ep : shard_size, split ? shard_rank / ep : shard_rank);
    ShardFileLayout::Segment segment;
    segment.unit = u;
    segment.offset = file.elements;
    segment.first_chunk = file.chunks;
    segment.runs = slice.RealRanges(s.unit_begin + s.begin, s.unit_begin + s.begin + s.real);
    for (const auto& [a, b] : segment.runs) segment.elements += b - a;
    segment.chunks = int((segment.elements + chunk_elements - 1) / chunk_elements);
    file.elements += segment.elements;
    file.chunks += segment.chunks;
    file.units.push_back(std::move(segment));
  }
  return file;
}

const ShardFileLayout::Segment* ShardFileLayout::Find(int unit) const {
  for (const Segment& segment : units) {
    if (segment.unit == unit) return &segment;
  }
  return nullptr;
}

std::vector<int64_t> ShardFileLayout::WholeIndices(const model::ParameterLayout& slice, const Segment& segment,
                                                   int64_t from, int64_t to) const {
  std::vector<int64_t> indices;
  indices.reserve(size_t(to - from));
  int64_t at = 0;  // the segment position where the run begins
  for (const auto& [a, b] : segment.runs) {
    const int64_t begin = std::max(from, at), end = std::min(to, at + (b - a));
    if (begin < end) {
      const std::vector<int64_t> run = slice.WholeIndices(a + (begin - at), a + (end - at));
      indices.insert(indices.end(), run.begin(), run.end());
    }
    at += b - a;
    if (at >= to) break;
  }
  return indices;
}

}  // namespace meshtrain::train
