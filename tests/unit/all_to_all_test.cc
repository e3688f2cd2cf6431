// AllToAll (worker/comm/communicator.h) on the fabric backend, with the ranks of a world
// as threads of this process (tests/support/fabric_ranks.h), equal bit for bit to the
// same exchange done pair by pair with Send and Recv; lists of the wrong length are
// refused at issue. The cases:
//   - blocks of uneven sizes (some empty, one of 1 MiB that goes direct between
//     same-node peers), at offsets with gaps, over shm (one node) and shm plus tcp (two);
//   - the same blocks with send, recv or both from AllocateBuffer: a same-node sender then
//     writes into the receiver's recv (push), or the receiver reads the sender's send in
//     place (pull), rather than going through a staged copy;
//   - large uneven blocks (1 to 6 MiB, beyond the ring chunk and the direct threshold),
//     with a rank that sends nothing to anyone and one that receives nothing, from heap
//     and from AllocateBuffer memory;
//   - blocks that lie in the buffers in an order other than the peers' (reversed in
//     send, rotated by rank in recv);
//   - counts that disagree between a sender and its receiver: nothing is written.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "tests/support/fabric_ranks.h"

namespace meshtrain::comm {
namespace {

using testing::RunFabricRanks;

// Elements rank `from` sends rank `to`.
using CountFunction = std::function<size_t(int from, int to)>;

// Uneven, some none, one pair 1 MiB.
size_t SmallCount(int from, int to) {
  if (from == 1 && to == 2) return 262144;
  return size_t((from * 3 + to * 5) % 7) * 37;
}

// 1 to 6 MiB and odd, except that rank 0 sends nothing (not even to itself), rank 3
// receives nothing, and a few other pairs are empty.
size_t LargeCount(int from, int to) {
  if (from == 0 || to == 3 || (from + 2 * to) % 5 == 0) return 0;
  return size_t(1 + (from * 3 + to * 5) % 6) * 262144 + size_t(from * 17 + to);
}

float ValueOf(int from, int to, size_t i) { return float(from * 1000000 + to * 10000) + float(i % 9973); }

enum class Order { kPeers, kReversed, kRotatedByRank };

// Offsets of the blocks laid out one after another in `order` (block p at position k of
// the order), with a gap of `gap` elements after each; *end is the buffer's size.
std::vector<size_t> OffsetsOf(const std::vector<size_t>& counts, size_t gap, Order order, int me, size_t* end) {
  const int n = int(counts.size());
  std::vector<size_t> offsets(counts.size());
  size_t at = 0;
  for (int k = 0; k < n; ++k) {
    const int p = order == Order::kPeers ? k : order == Order::kReversed ? n - 1 - k : (k + me + 1) % n;
    offsets[size_t(p)] = at;
    at += counts[size_t(p)] + gap;
  }
  *end = at;
  return offsets;
}

struct Case {
  CountFunction count = SmallCount;
  Order send_order = Order::kPeers, recv_order = Order::kPeers;
  bool shared = false;       // send and recv from AllocateBuffer, not the heap
  bool send_shared = false;  // send alone from AllocateBuffer
  bool recv_shared = false;  // recv alone from AllocateBuffer
};

// A buffer of `size` floats from the heap or from AllocateBuffer, filled with `fill`.
class Floats {
 public:
  Floats(Communicator& comm, size_t size, float fill, bool shared) : comm_(comm), shared_(shared) {
    if (shared_) {
      data_ = static_cast<float*>(comm.AllocateBuffer(std::max<size_t>(size, 1) * sizeof(float)));
    } else {
      heap_.resize(std::max<size_t>(size, 1));
      data_ = heap_.data();
    }
    std::fill(data_, data_ + size, fill);
  }
  ~Floats() {
    if (shared_) comm_.FreeBuffer(data_);
  }
  Floats(const Floats&) = delete;
  Floats& operator=(const Floats&) = delete;
  float* data() { return data_; }

 private:
  Communicator& comm_;
  bool shared_;
  std::vector<float> heap_;
  float* data_ = nullptr;
};

void CheckAllToAll(int ranks, int nodes, const Case& c) {
  RunFabricRanks(ranks, nodes, FabricOptions{}, [&](Communicator& world) {
    const int n = world.size(), me = world.rank();
    std::vector<size_t> send_counts(static_cast<size_t>(n)), recv_counts(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) send_counts[size_t(p)] = c.count(me, p), recv_counts[size_t(p)] = c.count(p, me);
    size_t send_size = 0, recv_size = 0;
    const std::vector<size_t> send_offsets = OffsetsOf(send_counts, 3, c.send_order, me, &send_size);
    const std::vector<size_t> recv_offsets = OffsetsOf(recv_counts, 5, c.recv_order, me, &recv_size);
    Floats send(world, send_size, -1.0f, c.shared || c.send_shared);
    for (int p = 0; p < n; ++p) {
      for (size_t i = 0; i < send_counts[size_t(p)]; ++i) send.data()[send_offsets[size_t(p)] + i] = ValueOf(me, p, i);
    }
    Floats got(world, recv_size, -2.0f, c.shared || c.recv_shared);
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
    EXPECT_TRUE(std::equal(want.begin(), want.end(), got.data())) << "rank " << me;
    for (int p = 0; p < n; ++p) {  // and what each block is
      for (size_t i = 0; i < recv_counts[size_t(p)]; i += 997) {
        ASSERT_EQ(got.data()[recv_offsets[size_t(p)] + i], ValueOf(p, me, i)) << "rank " << me << " from " << p;
      }
      if (const size_t count = recv_counts[size_t(p)]; count > 0) {
        ASSERT_EQ(got.data()[recv_offsets[size_t(p)] + count - 1], ValueOf(p, me, count - 1))
            << "rank " << me << " from " << p;
      }
    }
    // The send buffer is read, never written.
    for (int p = 0; p < n; ++p) {
      if (const size_t count = send_counts[size_t(p)]; count > 0) {
        ASSERT_EQ(send.data()[send_offsets[size_t(p)] + count - 1], ValueOf(me, p, count - 1)) << "rank " << me;
      }
    }
    EXPECT_THROW(world.AllToAll(send.data(), {1}, {0}, got.data(), {1}, {0}, DataType::kFloat32), CommError);
  });
}

TEST(AllToAll, UnevenBlocksOnOneNodeEqualSendAndRecvPairByPair) { CheckAllToAll(4, 1, Case{}); }

TEST(AllToAll, UnevenBlocksOnTwoNodesEqualSendAndRecvPairByPair) { CheckAllToAll(4, 2, Case{}); }

TEST(AllToAll, UnevenBlocksFromAllocateBufferOnOneNode) { CheckAllToAll(4, 1, Case{.shared = true}); }

TEST(AllToAll, LargeUnevenBlocksWithEmptyRanksOnOneNode) {
  CheckAllToAll(4, 1, Case{.count = LargeCount});
  CheckAllToAll(4, 1, Case{.count = LargeCount, .shared = true});
  CheckAllToAll(4, 1, Case{.count = LargeCount, .send_shared = true});  // pulled in place
  CheckAllToAll(4, 1, Case{.count = LargeCount, .recv_shared = true});  // pushed from the heap
}

TEST(AllToAll, LargeUnevenBlocksWithEmptyRanksOnTwoNodes) {
  CheckAllToAll(4, 2, Case{.count = LargeCount, .shared = true});
}

TEST(AllToAll, BlocksOutOfPeerOrder) {
  for (bool shared : {false, true}) {
    for (int nodes : {1, 2}) {
      CheckAllToAll(4, nodes,
                    Case{.count = LargeCount, .send_order = Order::kReversed, .recv_order = Order::kRotatedByRank,
                         .shared = shared});
    }
  }
  CheckAllToAll(4, 1, Case{.send_order = Order::kRotatedByRank, .recv_order = Order::kReversed, .shared = true});
}

// A sender whose count disagrees with its same-node receiver's writes nothing into the
// receiver's buffer: its operation fails naming both sizes, and the receiver's times out.
TEST(AllToAll, MismatchedCountsFailWithoutWritingThePeersBuffer) {
  FabricOptions options;
  options.timeout = std::chrono::seconds(3);
  RunFabricRanks(2, 1, options, [&](Communicator& world) {
    const int me = world.rank();
    const size_t elements = 1 << 20;  // 4 MiB each way: above the direct threshold
    auto* send = static_cast<float*>(world.AllocateBuffer(elements * sizeof(float)));
    auto* recv = static_cast<float*>(world.AllocateBuffer(2 * elements * sizeof(float)));
    std::fill(send, send + elements, 1.0f);
    std::fill(recv, recv + 2 * elements, -2.0f);
    // Rank 0 says it sends rank 1 half its buffer; rank 1 expects a quarter of it.
    const std::vector<size_t> send_counts = me == 0 ? std::vector<size_t>{0, elements / 2}
                                                    : std::vector<size_t>{0, 0};
    const std::vector<size_t> recv_counts = me == 1 ? std::vector<size_t>{elements / 4, 0}
                                                    : std::vector<size_t>{0, 0};
    const std::vector<size_t> offsets{0, 0};
    try {
      world.AllToAll(send, send_counts, offsets, recv, recv_counts, offsets, DataType::kFloat32)->Wait();
      ADD_FAILURE() << "rank " << me << ": a mismatched all_to_all succeeded";
    } catch (const CommError& error) {
      if (me == 0) {
        EXPECT_NE(std::string(error.what()).find("which expects"), std::string::npos) << error.what();
      }
    }
    EXPECT_TRUE(std::all_of(recv, recv + 2 * elements, [](float v) { return v == -2.0f; })) << "rank " << me;
    world.FreeBuffer(send);
    world.FreeBuffer(recv);
  });
}

}  // namespace
}  // namespace meshtrain::comm
