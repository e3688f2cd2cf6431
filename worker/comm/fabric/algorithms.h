// Collective algorithms over an Exchange, as plain functions.
//
//   rings (large messages): chunked and pipelined: a chunk is forwarded as soon as it
//     arrives, so a ring of n ranks moves data at link speed after n-1 chunk delays;
//   log-depth (small messages): recursive doubling all-reduce, Bruck all-gather,
//     binomial-tree broadcast, dissemination barrier;
//   hierarchical (a group spread node by node over several nodes): an intra-node phase,
//     an inter-node phase between rail-aligned peers (the same local index on every
//     node), then an intra-node phase.
//
// A ring works on blocks, one per position; a block is a list of spans (the
// hierarchical phases move blocks made of strided pieces without packing them).
//
// Reduction order (sums are deterministic run to run; different algorithms may round
// differently, except integers and exactly representable values):
//   ring reduce-scatter, block b of n: ((x[b+1] + x[b+2]) + ...) + x[b], indices mod n;
//   recursive doubling: pairwise tree, x[0]+x[1] and x[2]+x[3] first (ranks past the
//     largest power of two first fold into their even neighbour);
//   hierarchical: the intra-node ring order per node, then the inter-node order over nodes.
// Every rank ends with bit-identical results, because a+b equals b+a bit for bit.

#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "worker/comm/fabric/exchange.h"
#include "worker/comm/types.h"

namespace meshtrain::comm::fabric {

struct Span {
  char* data = nullptr;
  size_t bytes = 0;
};
using Block = std::vector<Span>;

// The members taking part in one algorithm, in position order, and this rank's position.
struct Peers {
  std::vector<int> members;  // member indices of the exchange's group
  int me = 0;
  int size() const { return static_cast<int>(members.size()); }
  int member(int position) const { return members[position]; }
  int At(int offset) const { return members[((me + offset) % size() + size()) % size()]; }
};
Peers AllMembers(const Group& group);
// For a node-major group: the members on this rank's node, and its rail (same local
// index on every node).
Peers NodePeers(const Group& group);
Peers RailPeers(const Group& group);

// Work memory reused across operations (first touch and registration happen once).
class Scratch {
 public:
  char* Get(int slot, size_t bytes);

 private:
  struct Free {
    void operator()(char* p) const;
  };
  std::vector<std::unique_ptr<char, Free>> buffers_;
  std::vector<size_t> sizes_;
};

struct Context {
  Exchange& exchange;
  Scratch& scratch;
  DataType type;
  size_t chunk_bytes;  // ring chunk (grown so a block has at most 256 chunks)
};

// Splits `count` elements into `parts` near-equal contiguous spans of `base`.
Block SplitEven(char* base, size_t count, size_t element_size, int parts);

void RingAllGather(Context& ctx, const Peers& peers, const std::vector<Block>& blocks);
// out = sum over positions of in[my position]. With `acc` (same shapes as `in`), partial
// sums are kept there (all-reduce keeps them in its output) instead of in scratch.
void RingReduceScatter(Context& ctx, const Peers& peers, const std::vector<Block>& in,
                       const std::vector<Block>& acc, const Block& out);
void RingAllReduce(Context& ctx, const Peers& peers, const char* send, char* recv, size_t count);
void RecursiveDoublingAllReduce(Context& ctx, const Peers& peers, const char* send, char* recv,
                                size_t count);
// recv holds the blocks of all positions, contiguous, `block_bytes` each.
void BruckAllGather(Context& ctx, const Peers& peers, const char* send, char* recv,
                    size_t block_bytes);
void ChainBroadcast(Context& ctx, const Peers& peers, char* buf, size_t bytes, int root);
void BinomialBroadcast(Context& ctx, const Peers& peers, char* buf, size_t bytes, int root);
void DisseminationBarrier(Context& ctx, const Peers& peers);

// Hierarchical forms; REQUIRE group().IsNodeMajor(). `small_bytes` picks log-depth over
// ring for the inter-node phase.
void HierarchicalAllReduce(Context& ctx, const char* send, char* recv, size_t count,
                           size_t small_bytes);
void HierarchicalAllGather(Context& ctx, const char* send, char* recv, size_t block_bytes);
void HierarchicalReduceScatter(Context& ctx, const char* send, char* recv, size_t block_bytes);
void HierarchicalBroadcast(Context& ctx, char* buf, size_t bytes, int root, size_t small_bytes);

}  // namespace meshtrain::comm::fabric
