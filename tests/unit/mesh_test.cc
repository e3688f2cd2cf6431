// The pipeline axis of the Mesh (worker/parallel/mesh.h), with the ranks of a world as
// threads of this process over the fabric backend (tests/support/fabric_ranks.h), on CPU
// streams: for 2, 3 and 4 stages, with and without the wrap-around links, each rank's
// stage, pipeline group, ends group and links to its neighbours; activations passed
// forward and gradients backward around the whole pipeline at once, all four directions
// of every rank in flight together (messages large enough that a send waits for its
// receiver), arriving in order from the right neighbour.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "tests/support/fabric_ranks.h"
#include "worker/parallel/mesh.h"
#include "worker/runtime/cpu_backend.h"
#include "worker/runtime/device_side.h"

namespace meshtrain::parallel::mesh_test {
namespace {

using namespace std::chrono_literals;
using runtime::DeviceSide;

struct Case {
  int stages, nodes, gpus_per_node, tp, shard;
  bool wrap;
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << c.stages << " stages, " << c.nodes << " x " << c.gpus_per_node << " ranks, tp " << c.tp << ", shard "
       << c.shard << (c.wrap ? ", wrapped" : "");
}

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "P" + std::to_string(c.stages) + "W" + std::to_string(c.nodes * c.gpus_per_node) + "N" +
         std::to_string(c.nodes) + (c.wrap ? "Wrap" : "");
}

class MeshPipeline : public ::testing::TestWithParam<Case> {};

// A message's value: who sent it, which round, which direction.
double Value(int sender, int round, bool forward) { return (forward ? 1 : -1) * (sender * 100.0 + round + 1); }

TEST_P(MeshPipeline, LinksJoinEachStageToItsNeighboursOneDirectionAGroup) {
  const Case c = GetParam();
  const api::ParallelLayout layout(c.nodes, c.gpus_per_node, c.tp, c.shard, c.stages);
  const int world_size = layout.world(), stage_ranks = layout.stage_ranks(), P = c.stages;
  comm::FabricOptions options;
  options.timeout = 30s;
  testing::RunFabricRanks(world_size, c.nodes, options, [&](comm::Communicator& world) {
    runtime::CpuBackend backend;
    const Mesh mesh(layout, &world, nullptr, &backend, c.wrap);
    const int rank = world.rank(), p = mesh.stage();
    EXPECT_EQ(mesh.stages(), P);
    EXPECT_EQ(p, rank / stage_ranks);
    EXPECT_EQ(mesh.wrap_stages(), c.wrap);
    // The same coordinate on another stage.
    auto on_stage = [&](int stage) { return ((stage % P + P) % P) * stage_ranks + rank % stage_ranks; };

    ASSERT_NE(mesh.pipeline(), nullptr);
    ASSERT_NE(mesh.device_pipeline(), nullptr);
    std::vector<int> pipeline;
    for (int s = 0; s < P; ++s) pipeline.push_back(on_stage(s));
    EXPECT_EQ(mesh.device_pipeline()->group().global_ranks(), pipeline);
    EXPECT_EQ(mesh.device_pipeline()->rank(), p);
    EXPECT_EQ(mesh.pipeline()->group().name(), "pipeline{" + api::FormatRanks(pipeline) + "}");
    EXPECT_EQ(mesh.Describe().rfind(std::to_string(P) + " stages x ", 0), 0u) << mesh.Describe();

    const bool end = p == 0 || p == P - 1;
    ASSERT_EQ(mesh.device_ends() != nullptr, end);
    if (end) {
      EXPECT_EQ(mesh.device_ends()->group().global_ranks(), (std::vector<int>{on_stage(0), on_stage(P - 1)}));
      EXPECT_EQ(mesh.device_ends()->group().name(),
                "ends{" + api::FormatRanks({on_stage(0), on_stage(P - 1)}) + "}");
    }

    // Which links exist, and to whom.
    struct Expected {
      Mesh::StageLink link;
      bool present;
      int neighbour;  // its global rank
      const char* name;
    };
    const Expected links[] = {{mesh.send_next(), p < P - 1 || c.wrap, on_stage(p + 1), "send_next"},
                              {mesh.recv_prev(), p > 0 || c.wrap, on_stage(p - 1), "recv_prev"},
                              {mesh.send_prev(), p > 0 || c.wrap, on_stage(p - 1), "send_prev"},
                              {mesh.recv_next(), p < P - 1 || c.wrap, on_stage(p + 1), "recv_next"}};
    std::set<const comm::StreamCollectives*> groups;
    for (const Expected& e : links) {
      ASSERT_EQ(e.link.group != nullptr, e.present) << e.name << " of stage " << p;
      if (!e.present) {
        EXPECT_EQ(e.link.peer, -1) << e.name;
        continue;
      }
      EXPECT_EQ(e.link.group->size(), 2) << e.name;
      EXPECT_EQ(e.link.group->group().GlobalRank(e.link.peer), e.neighbour) << e.name << " of stage " << p;
      EXPECT_TRUE(groups.insert(e.link.group).second) << e.name << " shares a group with another link";
      EXPECT_NE(e.link.group, mesh.device_ends()) << e.name;
    }

    // Activations forward and gradients backward, two rounds of each, every link in flight
    // at once on a stream of its own: 1 MiB messages, so that every send waits for its
    // receiver (the direct path of one node, tcp's rendezvous between two).
    const size_t count = (size_t(1) << 20) / sizeof(double);
    const int rounds = 2;
    std::vector<std::unique_ptr<runtime::Stream>> streams;
    for (const Expected& e : links) streams.push_back(backend.NewStream(e.name));
    std::vector<std::vector<double>> sent, received(2 * rounds, std::vector<double>(count, 0.0));
    for (int round = 0; round < rounds; ++round) {
      sent.emplace_back(count, Value(rank, round, true));
      sent.emplace_back(count, Value(rank, round, false));
    }
    for (int round = 0; round < rounds; ++round) {
      if (links[0].present) {
        comm::Send<double>(*links[0].link.group, DeviceSide::Handle<const double>(sent[2 * round].data()), count,
                           links[0].link.peer, *streams[0]);
      }
      if (links[1].present) {
        comm::Recv<double>(*links[1].link.group, DeviceSide::Handle(received[2 * round].data()), count,
                           links[1].link.peer, *streams[1]);
      }
      if (links[2].present) {
        comm::Send<double>(*links[2].link.group, DeviceSide::Handle<const double>(sent[2 * round + 1].data()), count,
                           links[2].link.peer, *streams[2]);
      }
      if (links[3].present) {
        comm::Recv<double>(*links[3].link.group, DeviceSide::Handle(received[2 * round + 1].data()), count,
                           links[3].link.peer, *streams[3]);
      }
    }
    for (auto& stream : streams) stream->Synchronize();
    for (int round = 0; round < rounds; ++round) {
      if (links[1].present) {
        EXPECT_EQ(received[2 * round].front(), Value(on_stage(p - 1), round, true)) << "activations, round " << round;
        EXPECT_EQ(received[2 * round].back(), Value(on_stage(p - 1), round, true));
      }
      if (links[3].present) {
        EXPECT_EQ(received[2 * round + 1].front(), Value(on_stage(p + 1), round, false)) << "gradients, round "
                                                                                        << round;
        EXPECT_EQ(received[2 * round + 1].back(), Value(on_stage(p + 1), round, false));
      }
    }

    // The ends' group: each end's rank, summed.
    if (end) {
      std::vector<double> sum = {double(rank)};
      comm::AllReduce<double>(*mesh.device_ends(), DeviceSide::Handle(sum.data()), 1, comm::ReduceOp::kSum,
                              *streams[0]);
      streams[0]->Synchronize();
      EXPECT_EQ(sum[0], double(on_stage(0) + on_stage(P - 1)));
    }
    world.Barrier()->Wait();
  });
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, MeshPipeline,
    ::testing::Values(Case{2, 1, 4, 2, 0, false}, Case{2, 1, 4, 2, 0, true},   // stages of one TP group
                      Case{3, 3, 2, 1, 2, false}, Case{3, 3, 2, 1, 2, true},   // of one shard group, a node each
                      Case{4, 2, 4, 1, 1, false}, Case{4, 2, 4, 1, 1, true}),  // of two replicas, two a node
    Name);

TEST(Mesh, OneRankHasOneStageAndNoLinks) {
  const Mesh mesh;
  EXPECT_EQ(mesh.stages(), 1);
  EXPECT_EQ(mesh.stage(), 0);
  EXPECT_EQ(mesh.pipeline(), nullptr);
  EXPECT_EQ(mesh.device_pipeline(), nullptr);
  EXPECT_EQ(mesh.device_ends(), nullptr);
  EXPECT_EQ(mesh.send_next().group, nullptr);
  EXPECT_EQ(mesh.recv_prev().peer, -1);
  EXPECT_EQ(mesh.Describe(), "1 replica x 1 shard x tp 1");
}

}  // namespace
}  // namespace meshtrain::parallel::mesh_test
