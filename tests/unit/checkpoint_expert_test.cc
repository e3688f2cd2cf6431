// Checkpoints of layouts that split the experts (format 5): each shard file's layout
// (checkpoint_layout.h) under EP holds its expert rank's experts, the units holding them
// sharded over the S / EP ranks with the same ones, and the metadata records EP and each
// file's expert rank, checked against its shard; metadata without them reads as EP 1.

#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "api/layout.h"
#include "worker/model/parameters.h"
#include "worker/parallel/flat_unit.h"
#include "worker/train/checkpoint_layout.h"
#include "worker/train/checkpoint_metadata.h"

namespace meshtrain::train {
namespace {

using Json = nlohmann::json;

// Mixtral of 2 blocks, each with 8 experts of 28 units, 2 a token.
api::ModelShape Mixtral() {
  const Json model = {{"family", "mixtral"}, {"layers", 2},       {"heads", 4},        {"hidden", 44},
                      {"vocabSize", 256},    {"seqLen", 32},      {"kvHeads", 2},      {"headDim", 12},
                      {"intermediateSize", 28}, {"ropeTheta", 1000.0}, {"tieEmbeddings", false},
                      {"experts", 8},        {"expertsPerToken", 2}};
  return ShapeOfCheckpointJson(model, "test");
}

// For S shards and EP: how many files of a TP slice hold each single-rank element, and the
// engine's shard elements of each file (FlatUnit's, which checkpoints must match).
TEST(CheckpointExpertTest, EachFileHoldsItsExpertsAndItsShardOfTheUnitsAsTheEngineShardsThem) {
  const api::ModelShape shape = Mixtral();
  const model::ParameterLayout whole(shape);
  // Which single-rank elements are experts'.
  std::vector<bool> expert(size_t(whole.total()), false);
  for (const model::ParamTensor& t : whole.tensors()) {
    if (!t.expert) continue;
    for (int64_t i = t.offset; i < t.offset + t.size; ++i) expert[size_t(i)] = true;
  }
  for (const auto& [S, EP] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {2, 2}, {4, 2}, {4, 4}, {8, 2}, {8, 4}}) {
    SCOPED_TRACE("S " + std::to_string(S) + ", EP " + std::to_string(EP));
    std::vector<int> held(size_t(whole.total()), 0);
    for (int s = 0; s < S; ++s) {
      const model::ParameterLayout slice(shape, 0, 1, 128, s % EP, EP);
      const ShardFileLayout file = LayOutShardFile(slice, S, s, /*chunk_elements=*/1000);
      int64_t engine_elements = 0;
      for (int u = 0; u < slice.units(); ++u) {
        const bool split = EP > 1 && slice.UnitHasExperts(u);
        const parallel::UnitShard shard = parallel::ShardOfUnit(slice, u, split ? S / EP : S, split ? s / EP : s);
        for (int64_t i : slice.WholeIndices(shard.unit_begin + shard.begin, shard.unit_begin + shard.begin + shard.real))
          engine_elements += i >= 0;
      }
      EXPECT_EQ(file.elements, engine_elements) << "shard " << s;
      for (const ShardFileLayout::Segment& segment : file.units) {
        const auto [begin, end] = whole.Unit(segment.unit);
        for (int64_t i : file.WholeIndices(slice, segment, 0, segment.elements)) {
          ASSERT_GE(i, begin);
          ASSERT_LT(i, end);
          ++held[size_t(i)];
        }
      }
    }
    // Every expert's element in one file; every other element of a unit holding experts
    // in EP files (one per expert rank), the other units' in one.
    for (int u = 0; u < whole.units(); ++u) {
      const auto [begin, end] = whole.Unit(u);
      const bool has_experts = whole.UnitHasExperts(u);
      for (int64_t i = begin; i < end; ++i) {
        const int want = has_experts && !expert[size_t(i)] ? EP : 1;
        ASSERT_EQ(held[size_t(i)], want) << "element " << i << " of unit " << u;
      }
    }
  }
}

TEST(CheckpointExpertTest, AShardOfAnotherExpertRankIsRefused) {
  const api::ModelShape shape = Mixtral();
  EXPECT_THROW(LayOutShardFile(model::ParameterLayout(shape, 0, 1, 128, 1, 2), 4, 2), std::invalid_argument);
  EXPECT_THROW(LayOutShardFile(model::ParameterLayout(shape, 0, 1, 128, 0, 4), 2, 0), std::invalid_argument);
  EXPECT_NO_THROW(LayOutShardFile(model::ParameterLayout(shape, 0, 1, 128, 1, 2), 4, 3));
}

// A checkpoint's metadata of S shards (no data: the parser reads the metadata only).
Json Metadata(const api::ModelShape& shape, int S, int EP) {
  Json files = Json::array();
  for (int s = 0; s < S; ++s) {
    files.push_back({{"name", CheckpointRankFile(s)}, {"rank", s}, {"tp", 0}, {"shard", s}, {"bytes", 0},
                     {"chunkElements", 1000}, {"chunkCrc32c", Json::array()}});
    if (EP > 1) files.back()["expert"] = s % EP;
  }
  Json meta = {{"format", kCheckpointFormat},
               {"version", EP > 1 ? 5 : 4},
               {"vocabMultiple", 128},
               {"step", 10},
               {"dataPosition", 0},
               {"dataOrder", "windows"},
               {"model", CheckpointShapeJson(shape)},
               {"layout", {{"tp", 1}, {"shard", S}, {"replicas", 1}, {"pipeline", 1}, {"world", S}}},
               {"files", files}};
  if (EP > 1) meta["layout"]["expert"] = EP;
  return meta;
}

TEST(CheckpointExpertTest, TheMetadataRecordsEpAndEachFilesExpertRank) {
  const api::ModelShape shape = Mixtral();
  EXPECT_EQ(kCheckpointVersion, 5);
  EXPECT_NO_THROW(ParseCheckpointMetadata(Metadata(shape, 4, 2).dump(), "m.json", shape));
  EXPECT_NO_THROW(ParseCheckpointMetadata(Metadata(shape, 4, 4).dump(), "m.json", shape));
  // Without EP fields (format 4 and before): EP 1.
  EXPECT_NO_THROW(ParseCheckpointMetadata(Metadata(shape, 4, 1).dump(), "m.json", shape));
  Json wrong = Metadata(shape, 4, 2);
  wrong["files"][1]["expert"] = 0;  // shard 1 of EP 2 holds expert rank 1's
  EXPECT_THROW(ParseCheckpointMetadata(wrong.dump(), "m.json", shape), CheckpointError);
  Json undivided = Metadata(shape, 4, 2);
  undivided["layout"]["expert"] = 3;
  for (Json& f : undivided["files"]) f.erase("expert");
  EXPECT_THROW(ParseCheckpointMetadata(undivided.dump(), "m.json", shape), CheckpointError);
  Json zero = Metadata(shape, 4, 2);
  zero["layout"]["expert"] = 0;
  EXPECT_THROW(ParseCheckpointMetadata(zero.dump(), "m.json", shape), CheckpointError);
}

}  // namespace
}  // namespace meshtrain::train
