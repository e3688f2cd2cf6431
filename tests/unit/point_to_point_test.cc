// Point to point over the stream-ordered collectives (stream_collectives.h) and the fabric
// communicator beneath them, with the ranks of a world as threads of this process
// (tests/support/fabric_ranks.h), on CPU streams: messages keep their order and arrive
// whole at tens of MiB, over shm (one node) and tcp (two); two groups of the same two
// members do not wait for each other; a peer that is not one is refused at issue; a peer
// that never answers fails the stream within the timeout, naming the operation, the group
// and the peer; a rank waiting for its peer leaves the cores to others; and SplitGroups
// makes the groups its lists say, named by their members' ranks.

#include <sys/resource.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/fabric_ranks.h"
#include "worker/comm/stream_collectives.h"
#include "worker/runtime/cpu_backend.h"
#include "worker/runtime/device_side.h"

namespace meshtrain::comm::point_to_point_test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using runtime::DeviceSide;
using testing::RunFabricRanks;

FabricOptions WithTimeout(milliseconds timeout) {
  FabricOptions options;
  options.timeout = timeout;
  return options;
}

// Host vectors as device memory: on the CPU backend they are the same thing.
template <class T>
runtime::DevicePtr<const T> In(const std::vector<T>& data) {
  return DeviceSide::Handle(data.data());
}
template <class T>
runtime::DevicePtr<T> Out(std::vector<T>& data) {
  return DeviceSide::Handle(data.data());
}

// CPU seconds this process has used so far, all threads.
double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return double(t.tv_sec) + double(t.tv_usec) / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

std::string ThrownBy(runtime::Stream& stream) {
  try {
    stream.Synchronize(60s);
  } catch (const std::exception& error) {
    return error.what();
  }
  return "";
}

class PointToPoint : public ::testing::TestWithParam<int> {};  // the virtual nodes: 1 (shm) or 2 (tcp)

TEST_P(PointToPoint, MessagesArriveInOrderAndWholeAtTensOfMiB) {
  const size_t large = size_t(40) << 20 >> 2;  // 40 MiB of fp32
  RunFabricRanks(2, GetParam(), WithTimeout(60s), [&](Communicator& world) {
    runtime::CpuBackend backend;
    auto group = HostCollectives(&world, &backend);
    auto stream = backend.NewStream("p2p");
    const int peer = 1 - world.rank();
    // Small, empty, large and small again, so that a large one overtaken shows.
    const std::vector<size_t> counts = {1, 0, 1000, large, 3, large / 2 + 1};
    std::vector<std::vector<float>> messages;
    for (size_t m = 0; m < counts.size(); ++m) {
      std::vector<float> data(counts[m]);
      for (size_t i = 0; i < data.size(); ++i) data[i] = float(m * 1000 + i % 997);
      messages.push_back(std::move(data));
    }
    if (world.rank() == 0) {
      for (const auto& message : messages) Send<float>(*group, In(message), message.size(), peer, *stream);
      stream->Synchronize();
    } else {
      std::vector<std::vector<float>> received;
      for (size_t count : counts) received.emplace_back(count, -1.0f);
      for (auto& into : received) Recv<float>(*group, Out(into), into.size(), peer, *stream);
      stream->Synchronize();
      for (size_t m = 0; m < counts.size(); ++m) EXPECT_EQ(received[m], messages[m]) << "message " << m;
      const CollectiveSeconds seconds = group->Seconds();
      EXPECT_GT(seconds.recv, 0);
      EXPECT_EQ(seconds.send, 0);
    }
  });
}

// Two groups of the same two members: a Send held on one (its receiver is not there yet)
// does not hold up the other, on which the receiver first answers a message of its own.
TEST_P(PointToPoint, TwoGroupsOfTheSameMembersDoNotWaitForEachOther) {
  const size_t count = size_t(8) << 20 >> 2;  // 8 MiB: the sender waits for its receiver
  RunFabricRanks(2, GetParam(), WithTimeout(30s), [&](Communicator& world) {
    runtime::CpuBackend backend;
    auto parent = HostCollectives(&world, &backend);
    auto forward = parent->SplitGroups({{0, 1}}, "forward");
    auto backward = parent->SplitGroups({{0, 1}}, "backward");
    ASSERT_TRUE(forward && backward);
    EXPECT_EQ(forward->group().name(), "forward{0,1}");
    auto sends = backend.NewStream("sends"), recvs = backend.NewStream("recvs");
    const int peer = 1 - world.rank();
    std::vector<float> mine(count, float(world.rank() + 1)), theirs(count, 0.0f);
    if (world.rank() == 0) {
      Send<float>(*forward, In(mine), count, peer, *sends);  // rank 1 takes it only after answering
      Recv<float>(*backward, Out(theirs), count, peer, *recvs);
    } else {
      Send<float>(*backward, In(mine), count, peer, *sends);
      sends->Synchronize();  // done only once rank 0 has received it, while its forward Send waits
      Recv<float>(*forward, Out(theirs), count, peer, *recvs);
    }
    sends->Synchronize();
    recvs->Synchronize();
    EXPECT_EQ(theirs.front(), float(peer + 1));
    EXPECT_EQ(theirs.back(), float(peer + 1));
  });
}

// A pipeline's traffic: activations one way and gradients the other, each on its own
// group and streams, hundreds of messages of a few KiB (past shm's inject size, short of
// the direct path), the receiver posting each receive late by a random pause.
TEST_P(PointToPoint, ManyMidSizedMessagesBothWaysWithLateReceives) {
  constexpr int kMessages = 300;
  constexpr size_t kCount = 1408;  // 5.5 KiB of fp32
  RunFabricRanks(2, GetParam(), WithTimeout(20s), [&](Communicator& world) {
    runtime::CpuBackend backend;
    auto parent = HostCollectives(&world, &backend);
    auto forward = parent->SplitGroups({{0, 1}}, "forward");
    auto backward = parent->SplitGroups({{0, 1}}, "backward");
    auto sends = backend.NewStream("sends"), recvs = backend.NewStream("recvs");
    const int peer = 1 - world.rank();
    std::vector<std::vector<float>> out(kMessages, std::vector<float>(kCount)), in(kMessages, std::vector<float>(kCount));
    for (int m = 0; m < kMessages; ++m) std::fill(out[size_t(m)].begin(), out[size_t(m)].end(), float(m + 1000 * world.rank()));
    std::mt19937 random(unsigned(world.rank() + 1));
    for (int m = 0; m < kMessages; ++m) {
      Send<float>(world.rank() == 0 ? *forward : *backward, In(out[size_t(m)]), kCount, peer, *sends);
      const int pause = int(random() % 400);
      recvs->HostCallback([pause] { std::this_thread::sleep_for(std::chrono::microseconds(pause)); });
      Recv<float>(world.rank() == 0 ? *backward : *forward, Out(in[size_t(m)]), kCount, peer, *recvs);
    }
    EXPECT_EQ(ThrownBy(*sends), "");
    EXPECT_EQ(ThrownBy(*recvs), "");
    for (int m = 0; m < kMessages; ++m) EXPECT_EQ(in[size_t(m)].back(), float(m + 1000 * peer)) << m;
  });
}

// A rank blocked in Recv for a second, its peer asleep: the process (both ranks, their
// streams and communicator threads) uses a small part of a core.
TEST_P(PointToPoint, ARankWaitingForItsPeerLeavesTheCoresToOthers) {
  RunFabricRanks(2, GetParam(), WithTimeout(30s), [&](Communicator& world) {
    runtime::CpuBackend backend;
    auto group = HostCollectives(&world, &backend);
    auto stream = backend.NewStream("p2p");
    std::vector<int32_t> value = {world.rank()};
    world.Barrier()->Wait();  // connected, and both here
    if (world.rank() == 0) {
      std::this_thread::sleep_for(1s);
      group->Send(runtime::ConstDeviceBytes(In(value)), 1, DataType::kInt32, 1, *stream);
      stream->Synchronize();
    } else {
      const double cpu_before = ProcessCpuSeconds();
      const Clock::time_point start = Clock::now();
      group->Recv(runtime::DeviceBytes(Out(value)), 1, DataType::kInt32, 0, *stream);
      stream->Synchronize();
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      const double cpu = ProcessCpuSeconds() - cpu_before;
      EXPECT_EQ(value[0], 0);
      EXPECT_GE(waited, 0.9);
      EXPECT_LT(cpu / waited, 0.3) << cpu << " s of CPU in " << waited << " s blocked";
      std::printf("blocked %.2f s in Recv (%d node%s): %.3f s of CPU (process)\n", waited, GetParam(),
                  GetParam() == 1 ? "" : "s", cpu);
    }
  });
}

// Eight ranks on this machine's two cores (the fabric then yields its core for less
// long), seven of them blocked for a second in Recv from the eighth, asleep. Ranks that
// spun would take the two cores' second, 2 s of CPU; backing off they took 0.18-0.30 s
// alone on this machine, and 0.36 s once beside another test under ctest -j2: the bound,
// 0.6 s, is far from either.
TEST(PointToPointWaiting, SevenRanksWaitingTakeLittleOfTheCores) {
  RunFabricRanks(8, 1, WithTimeout(30s), [&](Communicator& world) {
    runtime::CpuBackend backend;
    auto group = HostCollectives(&world, &backend);
    auto stream = backend.NewStream("p2p");
    std::vector<int32_t> value = {world.rank()};
    world.Barrier()->Wait();
    if (world.rank() == 0) {
      const double cpu_before = ProcessCpuSeconds();
      std::this_thread::sleep_for(1s);
      const double cpu = ProcessCpuSeconds() - cpu_before;
      EXPECT_LT(cpu, 0.6) << "seven ranks blocked for a second took " << cpu << " s of CPU";
      std::printf("7 ranks blocked 1 s in Recv: %.3f s of CPU (process)\n", cpu);
      for (int peer = 1; peer < 8; ++peer) {
        group->Send(runtime::ConstDeviceBytes(In(value)), 1, DataType::kInt32, peer, *stream);
      }
    } else {
      group->Recv(runtime::DeviceBytes(Out(value)), 1, DataType::kInt32, 0, *stream);
    }
    stream->Synchronize();
    EXPECT_EQ(value[0], 0);
  });
}

// The stream-ordered AllToAll (what Ulysses attention and expert dispatch use) in the
// stream's order: each rank's blocks, of uneven sizes and one empty, at offsets out of
// member order, reach their members where the lists say, between work queued before and
// after it on the same stream; and its seconds count to all_to_all.
TEST_P(PointToPoint, AllToAllOnAStreamDeliversEachBlockWhereTheListsSay) {
  constexpr int kRanks = 4;
  auto count = [](int from, int to) { return size_t(from == 2 && to == 0 ? 0 : 1 + from * 5 + to * 3); };
  auto value = [](int from, int to, size_t i) { return float(from * 10000 + to * 1000 + int(i)); };
  RunFabricRanks(kRanks, GetParam(), WithTimeout(60s), [&](Communicator& world) {
    runtime::CpuBackend backend;
    auto group = HostCollectives(&world, &backend);
    auto stream = backend.NewStream("all_to_all");
    const int me = world.rank();
    std::vector<size_t> send_counts(kRanks), send_offsets(kRanks), recv_counts(kRanks), recv_offsets(kRanks);
    size_t send_end = 0, recv_end = 0;
    for (int k = kRanks - 1; k >= 0; --k) {  // blocks laid out in reverse member order, with a gap
      send_counts[size_t(k)] = count(me, k), send_offsets[size_t(k)] = send_end, send_end += count(me, k) + 2;
      recv_counts[size_t(k)] = count(k, me), recv_offsets[size_t(k)] = recv_end, recv_end += count(k, me) + 2;
    }
    std::vector<float> send(send_end, -1), recv(recv_end, -7);
    // The blocks are written by a task queued before the exchange, and read after it.
    stream->HostCallback([&] {
      for (int p = 0; p < kRanks; ++p) {
        for (size_t i = 0; i < send_counts[size_t(p)]; ++i) send[send_offsets[size_t(p)] + i] = value(me, p, i);
      }
    });
    group->AllToAll(runtime::ConstDeviceBytes(In(send)), send_counts, send_offsets, runtime::DeviceBytes(Out(recv)),
                    recv_counts, recv_offsets, DataType::kFloat32, *stream);
    std::vector<float> seen;
    stream->HostCallback([&] { seen = recv; });
    stream->Synchronize();
    for (int p = 0; p < kRanks; ++p) {
      for (size_t i = 0; i < recv_counts[size_t(p)]; ++i) {
        ASSERT_EQ(seen[recv_offsets[size_t(p)] + i], value(p, me, i)) << "from member " << p << ", element " << i;
      }
      if (recv_counts[size_t(p)] > 0) {
        EXPECT_EQ(seen[recv_offsets[size_t(p)] + recv_counts[size_t(p)]], -7);  // the gap after the block
      }
    }
    EXPECT_GT(group->Seconds().all_to_all, 0);
    EXPECT_THROW(group->AllToAll(runtime::ConstDeviceBytes(In(send)), {1}, {0}, runtime::DeviceBytes(Out(recv)), {1},
                                 {0}, DataType::kFloat32, *stream),
                 std::invalid_argument);
  });
}

INSTANTIATE_TEST_SUITE_P(Nodes, PointToPoint, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& nodes) {
                           return nodes.param == 1 ? std::string("Shm") : std::string("Tcp");
                         });

TEST(PointToPointErrors, APeerThatIsNotAnotherMemberIsRefusedAtIssue) {
  RunFabricRanks(1, 1, WithTimeout(10s), [&](Communicator& world) {
    runtime::CpuBackend backend;
    auto group = HostCollectives(&world, &backend);
    auto stream = backend.NewStream("p2p");
    std::vector<float> data(4);
    for (int peer : {-1, 0, 1}) {
      try {
        Send<float>(*group, In(data), data.size(), peer, *stream);
        ADD_FAILURE() << "a send to member " << peer << " of a group of one was issued";
      } catch (const std::invalid_argument& error) {
        EXPECT_NE(std::string(error.what()).find("send to member " + std::to_string(peer) + " on group world"),
                  std::string::npos)
            << error.what();
      }
    }
    EXPECT_THROW(Recv<float>(*group, Out(data), data.size(), 3, *stream), std::invalid_argument);
    stream->Synchronize();  // nothing was issued
  });
}

// A Send whose peer never receives, and a Recv whose peer never sends: each fails its
// stream within the timeout, naming the operation, the group and the peer.
TEST(PointToPointErrors, APeerThatNeverAnswersFailsTheStreamWithinTheTimeout) {
  RunFabricRanks(2, 1, WithTimeout(1s), [&](Communicator& world) {
    runtime::CpuBackend backend;
    auto parent = HostCollectives(&world, &backend);
    auto quiet = parent->SplitGroups({{0, 1}}, "quiet");
    auto stream = backend.NewStream("p2p");
    std::vector<float> data(size_t(4) << 20 >> 2);  // 4 MiB: the sender waits for its receiver
    const Clock::time_point start = Clock::now();
    std::string error;
    if (world.rank() == 0) {
      Send<float>(*parent, In(data), data.size(), 1, *stream);  // rank 1 never receives it
      error = ThrownBy(*stream);
      for (const char* part : {"send to 1 of 4.0 MiB fp32", "group world", "rank 1", "timed out after 1000 ms"}) {
        EXPECT_NE(error.find(part), std::string::npos) << part << " not in: " << error;
      }
    } else {
      Recv<float>(*quiet, Out(data), 1, 0, *stream);  // rank 0 never sends on this group
      error = ThrownBy(*stream);
      for (const char* part : {"recv from 0 of 4 B fp32", "group quiet{0,1}", "rank 0", "timed out after 1000 ms"}) {
        EXPECT_NE(error.find(part), std::string::npos) << part << " not in: " << error;
      }
    }
    EXPECT_LT(Clock::now() - start, 5s);
  });
}

TEST(SplitGroups, EachMemberGetsTheGroupItsListSaysNamedByTheRanks) {
  RunFabricRanks(4, 1, WithTimeout(30s), [&](Communicator& world) {
    runtime::CpuBackend backend;
    auto parent = HostCollectives(&world, &backend);
    auto stream = backend.NewStream("split");
    const int me = world.rank();
    auto pairs = parent->SplitGroups({{0, 2}, {1, 3}}, "pairs");
    ASSERT_NE(pairs, nullptr);
    EXPECT_EQ(pairs->group().name(), me % 2 == 0 ? "pairs{0,2}" : "pairs{1,3}");
    EXPECT_EQ(pairs->size(), 2);
    EXPECT_EQ(pairs->rank(), me / 2);
    std::vector<double> sum = {double(me)};
    AllReduce<double>(*pairs, Out(sum), 1, ReduceOp::kSum, *stream);
    stream->Synchronize();
    EXPECT_EQ(sum[0], me % 2 == 0 ? 2.0 : 4.0);

    auto middle = parent->SplitGroups({{1, 2}}, "middle");
    EXPECT_EQ(middle != nullptr, me == 1 || me == 2);
    if (middle) {
      EXPECT_EQ(middle->group().global_ranks(), (std::vector<int>{1, 2}));
    }

    // A split of a split: the lists are ranks of the parent, the names global ranks.
    auto solo = pairs->SplitGroups({{1}}, "upper");
    EXPECT_EQ(solo != nullptr, me >= 2);
    if (solo) {
      EXPECT_EQ(solo->group().name(), "upper{" + std::to_string(me) + "}");
    }

    auto refused = [&](const std::vector<std::vector<int>>& lists, const std::string& why) {
      try {
        parent->SplitGroups(lists, "bad");
        ADD_FAILURE() << "lists accepted; expected: " << why;
      } catch (const std::invalid_argument& error) {
        EXPECT_NE(std::string(error.what()).find(why), std::string::npos) << error.what();
        EXPECT_NE(std::string(error.what()).find("splitting group world (4 ranks on 1 node) into bad"),
                  std::string::npos)
            << error.what();
      }
    };
    refused({{0, 0}}, "list 0 (0,0) is not increasing");
    refused({{2, 1}}, "list 0 (2,1) is not increasing");
    refused({{0, 1}, {1, 2}}, "list 1 (1,2) repeats rank 1 of an earlier list");
    refused({{0, 4}}, "names rank 4, outside 0..3");
    refused({{0}, {}}, "list 1 (empty) has no members");
    world.Barrier()->Wait();
  });
}

}  // namespace
}  // namespace meshtrain::comm::point_to_point_test

