// Where a rank's elements lie in its checkpoint shard file: the writer checksums its file
// by these chunks, and a reader of any layout finds in them the chunks that hold the
// elements it needs (docs/checkpoints.md).
//
// A shard file is three sections: the fp32 master weights, then AdamW m, then v. Each
// section holds the model's elements (never vocabulary padding) of the writer's shard of
// every unit of its TP slice (in a pipeline, of its stage's units), in unit order: one
// segment per unit. Each segment is cut
// into chunks of at most chunk_elements, each with its own CRC-32C, numbered through the
// section; the metadata lists the master section's checksums, then m's, then v's.

#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "worker/model/parameters.h"

namespace meshtrain::train {

// 1 MiB of fp32: what a reader reads at least, to verify, for one element it needs.
constexpr int64_t kChunkElements = int64_t(1) << 18;

struct ShardFileLayout {
  struct Segment {
    int unit = 0;          // of the slice
    int64_t offset = 0;    // of the segment's first element within its section
    int64_t elements = 0;  // model elements of the writer's shard of the unit
    int first_chunk = 0;   // within the section
    int chunks = 0;
    std::vector<std::pair<int64_t, int64_t>> runs;  // where the elements lie in the slice's flat buffer, in order
  };
  int64_t chunk_elements = kChunkElements;
  std::vector<Segment> units;
  int64_t elements = 0;  // of one section
  int chunks = 0;        // of one section

  // The segment of unit `unit`, or null when the file does not hold it.
  const Segment* Find(int unit) const;

  // The single-rank indices of elements [from, to) of `segment`, a segment of `slice`'s.
  std::vector<int64_t> WholeIndices(const model::ParameterLayout& slice, const Segment& segment, int64_t from,
                                    int64_t to) const;
};

// The file of the writer holding shard `shard_rank` of `shard_size` of each unit of `slice`
// (its TP slice, padded as its engine pads the vocabulary), or of `units` only (increasing;
// empty: all). With expert parallelism (slice.ep_size() > 1: the slice holds expert rank
// slice.ep_rank()'s experts, which must be shard_rank % ep_size), a unit holding experts
// is sharded as the engine shards it, over the shard_size / ep_size ranks holding the same
// experts, the writer's shard of it being shard_rank / ep_size; every other unit over
// shard_size. Throws std::invalid_argument when ep_size does not divide shard_size or
// shard_rank is not of the slice's expert rank.
ShardFileLayout LayOutShardFile(const model::ParameterLayout& slice, int shard_size, int shard_rank,
                                int64_t chunk_elements = kChunkElements, const std::vector<int>& units = {});

}  // namespace meshtrain::train
