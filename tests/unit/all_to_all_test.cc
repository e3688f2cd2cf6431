// AllToAll (worker/comm/communicator.h) on the fabric backend, with the ranks of a world
// as threads of this process (tests/support/fabric_ranks.h): blocks of uneven sizes (some
// empty, one of 1 MiB that goes direct between same-node peers), at offsets with gaps,
// over shm (one node) and shm plus tcp (two), equal bit for bit to the same exchange
// done pair by pair with Send and Recv; lists of the wrong length are refused at issue.

#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "tests/support/fabric_ranks.h"

namespace meshtrain::comm {
namespace {

using testing::RunFabricRanks;

// Elements rank `from` sends rank `to`: uneven, some none, one pair 1 MiB.
size_t CountOf(int from, int to) {
  if (from == 1 && to == 2) return 262144;
  return size_t((from * 3 + to * 5) % 7) * 37;
}

float ValueOf(int from, int to, size_t i) { return float(from * 1000000 + to * 10000) + float(i % 9973); }

// Offsets of consecutive blocks with a gap of `gap` elements after each.
std::vector<size_t> OffsetsOf(const std::vector<size_t>& counts, size_t gap) {
  std::vector<size_t> offsets(counts.size());
  size_t at = 0;
  for (size_t p = 0; p < counts.size(); ++p) offsets[p] = at, at += counts[p] + gap;
  return offsets;
}

void CheckAllToAll(int ranks, int nodes) {
  RunFabricRanks(ranks, nodes, FabricOptions{}, [&](Communicator& world) {
    const int n = world.size(), me = world.rank();
    std::vector<size_t> send_counts(static_cast<size_t>(n)), recv_counts(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) send_counts[size_t(p)] = CountOf(me, p), recv_counts[size_t(p)] = CountOf(p, me);
    const std::vector<size_t> send_offsets = OffsetsOf(send_counts, 3), recv_offsets = OffsetsOf(recv_counts, 5);
    std::vector<float> send(send_offsets.back() + send_counts.back() + 3, -1.0f);
    for (int p = 0; p < n; ++p) {
      for (size_t i = 0; i < send_counts[size_t(p)]; ++i) send[send_offsets[size_t(p)] + i] = ValueOf(me, p, i);
    }
    const size_t recv_size = recv_offsets.back() + recv_counts.back() + 5;
    std::vector<float> got(recv_size, -2.0f);
    world.AllToAll(send.data(), send_counts, send_offsets, got.data(), recv_counts, recv_offsets, DataType::kFloat32)
        ->Wait();

    // The reference: pair by pair, the lower rank sending first, and the block to itself copied.
    std::vector<float> want(recv_size, -2.0f);
    for (int p = 0; p < n; ++p) {
      float* into = want.data() + recv_offsets[size_t(p)];
      const float* from = send.data() + send_offsets[size_t(p)];
      if (p == me) {
        std::copy(from, from + send_counts[size_t(p)], into);
        continue;
      }
      auto send_block = [&] { world.Send(from, send_counts[size_t(p)], DataType::kFloat32, p)->Wait(); };
      auto recv_block = [&] { world.Recv(into, recv_counts[size_t(p)], DataType::kFloat32, p)->Wait(); };
      if (me < p) send_block(), recv_block();
      else recv_block(), send_block();
    }
    EXPECT_EQ(got, want) << "rank " << me;
    for (int p = 0; p < n; ++p) {  // and what each block is
      for (size_t i = 0; i < recv_counts[size_t(p)]; i += 997) {
        ASSERT_EQ(got[recv_offsets[size_t(p)] + i], ValueOf(p, me, i)) << "rank " << me << " from " << p;
      }
    }
    EXPECT_THROW(world.AllToAll(send.data(), {1}, {0}, got.data(), {1}, {0}, DataType::kFloat32), CommError);
  });
}

TEST(AllToAll, UnevenBlocksOnOneNodeEqualSendAndRecvPairByPair) { CheckAllToAll(4, 1); }

TEST(AllToAll, UnevenBlocksOnTwoNodesEqualSendAndRecvPairByPair) { CheckAllToAll(4, 2); }

}  // namespace
}  // namespace meshtrain::comm
