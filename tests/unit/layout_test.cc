// The layout math, checked exhaustively for every valid layout up to 512 ranks.

#include "api/layout.h"

#include <algorithm>
#include <set>

#include <gtest/gtest.h>

namespace meshtrain::api {
namespace {

struct Sizes {
  int nodes, gpus, tp, shard;  // shard as written in the spec (0 = all data-parallel ranks)
};

std::vector<Sizes> AllValidLayouts(int max_world) {
  std::vector<Sizes> out;
  for (int gpus : {1, 2, 4, 8, 16}) {
    for (int nodes = 1; nodes * gpus <= max_world; ++nodes) {
      for (int tp = 1; tp <= gpus; ++tp) {
        for (int shard = 0; shard <= nodes * gpus; ++shard) {
          if (ParallelLayout::Check(nodes, gpus, tp, shard).empty()) out.push_back({nodes, gpus, tp, shard});
        }
      }
    }
  }
  return out;
}

// Checks that `groups` partition the world into groups of `size`.
void ExpectPartition(const std::vector<std::vector<int>>& groups, int world, int size, const char* what) {
  std::vector<int> seen(world, 0);
  for (const auto& g : groups) {
    ASSERT_EQ(int(g.size()), size) << what;
    ASSERT_TRUE(std::is_sorted(g.begin(), g.end())) << what;
    for (int r : g) ++seen[r];
  }
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; })) << what;
}

TEST(Layout, EveryValidLayoutUpTo512Ranks) {
  const auto layouts = AllValidLayouts(512);
  ASSERT_GT(layouts.size(), 3000u);
  for (const Sizes& s : layouts) {
    SCOPED_TRACE(testing::Message() << s.nodes << " nodes x " << s.gpus << " gpus, tp " << s.tp << ", shard " << s.shard);
    const ParallelLayout mesh(s.nodes, s.gpus, s.tp, s.shard);
    const int world = s.nodes * s.gpus;
    ASSERT_EQ(mesh.world(), world);
    ASSERT_EQ(mesh.replicas() * mesh.shard() * mesh.tp(), world);
    if (s.shard == 0) EXPECT_EQ(mesh.replicas(), 1);
    else EXPECT_EQ(mesh.shard(), s.shard);

    for (int rank = 0; rank < world; ++rank) {
      const LayoutCoord c = mesh.CoordOf(rank);
      ASSERT_EQ(mesh.RankOf(c), rank);
      ASSERT_EQ(rank, (c.replica * mesh.shard() + c.shard) * mesh.tp() + c.tp);  // docs/design.md's formula at P = 1
      ASSERT_EQ(mesh.NodeOf(rank) * s.gpus + mesh.LocalRankOf(rank), rank);
    }
    const auto tp = mesh.Groups(Axis::kTensor);
    const auto shard = mesh.Groups(Axis::kShard);
    const auto replica = mesh.Groups(Axis::kReplica);
    ExpectPartition(tp, world, mesh.tp(), "tp");
    ExpectPartition(shard, world, mesh.shard(), "shard");
    ExpectPartition(replica, world, mesh.replicas(), "replica");

    // A TP group sits inside one node, on consecutive ranks.
    for (const auto& g : tp) {
      EXPECT_EQ(mesh.NodeOf(g.front()), mesh.NodeOf(g.back()));
      EXPECT_EQ(g.back() - g.front(), mesh.tp() - 1);
    }
    // A shard group's ranks fill exactly NodesPerShardGroup() whole, neighbouring nodes,
    // together with the other tp lanes of the same replica.
    for (const auto& g : shard) {
      std::set<int> nodes;
      for (int r : g) nodes.insert(mesh.NodeOf(r));
      EXPECT_EQ(int(nodes.size()), mesh.NodesPerShardGroup());
      EXPECT_EQ(*nodes.rbegin() - *nodes.begin() + 1, int(nodes.size()));
    }
    // Every member of a group agrees on the group, along every axis.
    for (int rank = 0; rank < world; ++rank) {
      for (Axis axis : {Axis::kTensor, Axis::kShard, Axis::kReplica}) {
        const auto g = mesh.GroupOf(axis, rank);
        ASSERT_NE(std::find(g.begin(), g.end(), rank), g.end());
        EXPECT_EQ(mesh.GroupOf(axis, g.back()), g);
      }
    }
  }
}

// With stages: P outermost, each stage's ranks contiguous and laid out as a world of
// their own; the stages of one (replica, shard, tp) coordinate read the same data.
TEST(Layout, EveryValidPipelinedLayoutUpTo64Ranks) {
  int layouts = 0;
  for (int gpus : {1, 2, 4, 8}) {
    for (int nodes = 1; nodes * gpus <= 64; ++nodes) {
      const int world = nodes * gpus;
      for (int P = 2; P <= world; ++P) {
        for (int tp = 1; tp <= gpus; ++tp) {
          for (int shard = 0; shard <= world; ++shard) {
            if (!ParallelLayout::Check(nodes, gpus, tp, shard, P).empty()) continue;
            ++layouts;
            SCOPED_TRACE(testing::Message() << nodes << " x " << gpus << ", P " << P << ", tp " << tp << ", shard " << shard);
            const ParallelLayout mesh(nodes, gpus, tp, shard, P);
            ASSERT_EQ(mesh.pipeline() * mesh.replicas() * mesh.shard() * mesh.tp(), world);
            ASSERT_EQ(mesh.stage_ranks() * P, world);
            for (int rank = 0; rank < world; ++rank) {
              const LayoutCoord c = mesh.CoordOf(rank);
              ASSERT_EQ(mesh.RankOf(c), rank);
              ASSERT_EQ(rank, ((c.pipeline * mesh.replicas() + c.replica) * mesh.shard() + c.shard) * mesh.tp() + c.tp);
              ASSERT_EQ(mesh.StageOf(rank), c.pipeline);
              ASSERT_EQ(mesh.DataParallelRankOf(rank), c.replica * mesh.shard() + c.shard);
            }
            ExpectPartition(mesh.Groups(Axis::kPipeline), world, P, "pipeline");
            ExpectPartition(mesh.Groups(Axis::kShard), world, mesh.shard(), "shard");
            for (const auto& g : mesh.Groups(Axis::kPipeline)) {
              for (size_t i = 0; i < g.size(); ++i) {
                EXPECT_EQ(mesh.StageOf(g[i]), int(i));
                EXPECT_EQ(mesh.DataParallelRankOf(g[i]), mesh.DataParallelRankOf(g[0]));
              }
            }
            // A TP group stays in one node and one stage; a shard group in one stage.
            for (const auto& g : mesh.Groups(Axis::kTensor)) EXPECT_EQ(mesh.NodeOf(g.front()), mesh.NodeOf(g.back()));
            for (const auto& g : mesh.Groups(Axis::kShard)) EXPECT_EQ(mesh.StageOf(g.front()), mesh.StageOf(g.back()));
            // Stages that fill whole nodes own them.
            if (mesh.stage_ranks() % gpus == 0) {
              for (int rank = 0; rank + 1 < world; ++rank) {
                if (mesh.StageOf(rank) != mesh.StageOf(rank + 1)) {
                  EXPECT_NE(mesh.NodeOf(rank), mesh.NodeOf(rank + 1));
                }
              }
              EXPECT_EQ(mesh.NodesPerStage(), mesh.stage_ranks() / gpus);
            }
          }
        }
      }
    }
  }
  EXPECT_GT(layouts, 1000);
}

TEST(Layout, PipelineErrorsNameTheField) {
  auto first = [](const FieldErrors& errors) { return errors.empty() ? std::string() : errors[0].ToString(); };
  EXPECT_NE(first(ParallelLayout::Check(1, 8, 1, 0, 3)).find("spec.parallelism.pipelineParallelDegree"),
            std::string::npos);
  EXPECT_NE(first(ParallelLayout::Check(1, 8, 4, 0, 4)).find("spec.parallelism.pipelineParallelDegree"),
            std::string::npos);  // stages of 2 GPUs cannot hold TP groups of 4
  EXPECT_NE(first(ParallelLayout::Check(1, 8, 1, 0, 0)).find("must be at least 1"), std::string::npos);
  EXPECT_TRUE(ParallelLayout::Check(3, 8, 2, 2, 2).empty());  // a stage of 12 GPUs over a node and a half
}

TEST(Layout, TheTwoPointSevenBillionExample) {
  const ParallelLayout mesh(32, 8, 8, 16);
  EXPECT_EQ(mesh.world(), 256);
  EXPECT_EQ(mesh.replicas(), 2);
  EXPECT_EQ(mesh.NodesPerShardGroup(), 16);
  EXPECT_EQ(mesh.GroupOf(Axis::kTensor, 13), (std::vector<int>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(FormatRanks(mesh.GroupOf(Axis::kShard, 3)), "3-123 step 8");
  EXPECT_EQ(mesh.GroupOf(Axis::kReplica, 3), (std::vector<int>{3, 131}));
  EXPECT_EQ(mesh.CoordOf(131), (LayoutCoord{1, 0, 3}));
}

TEST(Layout, InvalidSizesThrowWithTheFieldPath) {
  EXPECT_THROW(ParallelLayout(2, 8, 3, 0), std::invalid_argument);
  try {
    ParallelLayout(3, 8, 2, 3);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("spec.parallelism.hybridShardDegree"), std::string::npos);
  }
  const ParallelLayout mesh(1, 8, 2, 0);
  EXPECT_THROW(mesh.CoordOf(8), std::out_of_range);
  EXPECT_THROW(mesh.RankOf({0, 0, 2}), std::out_of_range);
}

TEST(Layout, FormatRanks) {
  EXPECT_EQ(FormatRanks({}), "");
  EXPECT_EQ(FormatRanks({5}), "5");
  EXPECT_EQ(FormatRanks({0, 128}), "0,128");
  EXPECT_EQ(FormatRanks({0, 1, 2, 3}), "0-3");
  EXPECT_EQ(FormatRanks({1, 3, 4}), "1,3,4");
}

}  // namespace
}  // namespace meshtrain::api

namespace meshtrain::api {
namespace {

// rank = (((p*R + r)*S + s)*C + c)*T + t: the context group sits between TP and shard,
// FSDP's group is its S x C ranks, and the C ranks of a sequence read the same data.
TEST(Layout, TheContextAxisSitsBetweenShardAndTensor) {
  const ParallelLayout mesh(2, 8, 2, 2, 1, 2);  // 16 ranks: T 2, C 2, S 2, R 2
  EXPECT_EQ(mesh.context(), 2);
  EXPECT_EQ(mesh.shard(), 4);
  EXPECT_EQ(mesh.replicas(), 2);
  EXPECT_EQ(mesh.data_parallel(), 4);
  EXPECT_EQ(mesh.GroupOf(Axis::kContext, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(mesh.GroupOf(Axis::kShard, 5), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(mesh.GroupOf(Axis::kReplica, 5), (std::vector<int>{5, 13}));
  for (int rank = 0; rank < mesh.world(); ++rank) {
    const int t = rank % 2, c = rank / 2 % 2, s = rank / 4 % 2, r = rank / 8;
    EXPECT_EQ(mesh.ContextRankOf(rank), c);
    EXPECT_EQ(mesh.DataParallelRankOf(rank), r * 2 + s);
    EXPECT_EQ(mesh.CoordOf(rank), (LayoutCoord{r, s * 2 + c, t, 0}));
  }
  // hybridShardDegree 0: every data-parallel rank of the stage, C apart.
  EXPECT_EQ(ParallelLayout(1, 8, 1, 0, 1, 4).shard(), 8);
  EXPECT_EQ(ParallelLayout(1, 8, 1, 0, 1, 4).replicas(), 1);
  auto first = [](const FieldErrors& errors) { return errors.empty() ? std::string() : errors[0].ToString(); };
  EXPECT_NE(first(ParallelLayout::Check(1, 8, 2, 0, 1, 3)).find("spec.parallelism.contextParallelDegree"),
            std::string::npos);
  EXPECT_NE(first(ParallelLayout::Check(1, 8, 1, 0, 1, 0)).find("spec.parallelism.contextParallelDegree"),
            std::string::npos);
}

// Of 2C chunks, rank c holds chunks c and 2C-1-c: every rank the same causal work.
TEST(Layout, ContextRowsBalanceCausalAttention) {
  const ContextRows first(16, 0, 2), second(16, 1, 2);
  EXPECT_EQ(first.rows(), 8);
  std::vector<int64_t> a, b;
  for (int i = 0; i < 8; ++i) a.push_back(first.Position(i)), b.push_back(second.Position(i));
  EXPECT_EQ(a, (std::vector<int64_t>{0, 1, 2, 3, 12, 13, 14, 15}));
  EXPECT_EQ(b, (std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  // Every position once over the group, and equal sums of causal work (position + 1).
  for (int C : {2, 3, 4}) {
    std::set<int64_t> seen;
    std::set<int64_t> work;
    for (int c = 0; c < C; ++c) {
      const ContextRows rows(48, c, C);
      int64_t sum = 0;
      for (int64_t i = 0; i < rows.rows(); ++i) seen.insert(rows.Position(i)), sum += rows.Position(i) + 1;
      work.insert(sum);
    }
    EXPECT_EQ(seen.size(), 48u);
    EXPECT_EQ(work.size(), 1u) << C;
  }
}

}  // namespace
}  // namespace meshtrain::api
