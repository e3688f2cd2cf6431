#include "worker/comm/fabric/algorithms.h"

#include "worker/comm/fabric/bulk_copy.h"
#include "worker/comm/fabric/shared_memory.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

namespace meshtrain::comm::fabric {
namespace {

// How the blocks of a ring are cut into messages: every block has `spans` spans, each
// cut into `chunks` chunks of `chunk` bytes (trailing ones may be short or empty), so
// message m of every block covers the same byte range and scratch regions line up.
struct RingShape {
  size_t spans = 0, chunk = 0, chunks = 0;
  size_t messages() const { return spans * chunks; }
  size_t stride() const { return chunks * chunk; }  // scratch bytes per span
  size_t Offset(size_t m) const { return (m / chunks) * stride() + (m % chunks) * chunk; }
  Span Piece(const Block& block, size_t m) const {
    const Span& span = block[m / chunks];
    size_t offset = std::min(span.bytes, (m % chunks) * chunk);
    return Span{span.data + offset, std::min(chunk, span.bytes - offset)};
  }
};

RingShape ShapeOf(const std::vector<Block>& blocks, size_t element_size, size_t chunk_option) {
  RingShape shape;
  shape.spans = blocks[0].size();
  size_t largest = 0;
  for (const Block& block : blocks) {
    for (const Span& span : block) largest = std::max(largest, span.bytes);
  }
  if (largest == 0) return shape;
  size_t chunk = std::max(chunk_option, (largest + 255) / 256);
  shape.chunk = (chunk + element_size - 1) / element_size * element_size;
  shape.chunks = (largest + shape.chunk - 1) / shape.chunk;
  return shape;
}

uint32_t Slot(int step, const RingShape& shape, size_t m) {
  return static_cast<uint32_t>(static_cast<size_t>(step) * shape.messages() + m);
}

void CopySpans(const Block& to, const Block& from) {
  for (size_t k = 0; k < to.size(); ++k) {
    if (to[k].data != from[k].data) BulkCopy(to[k].data, from[k].data, to[k].bytes);
  }
}

// The node-major geometry of a group: L members per node on N nodes.
struct Grid {
  int per_node, nodes, local, node;
  explicit Grid(const Group& group)
      : per_node(group.PerNode()),
        nodes(group.NodeCount()),
        local(group.rank() % group.PerNode()),
        node(group.rank() / group.PerNode()) {}
};

Block Contiguous(char* base, size_t bytes) { return Block{Span{base, bytes}}; }

// Each span of `spans` as the one-span block of its position.
std::vector<Block> OnePerPosition(const Block& spans) {
  std::vector<Block> blocks;
  for (const Span& span : spans) blocks.push_back(Block{span});
  return blocks;
}

}  // namespace

Peers AllMembers(const Group& group) {
  Peers peers;
  for (int m = 0; m < group.size(); ++m) peers.members.push_back(m);
  peers.me = group.rank();
  return peers;
}

Peers NodePeers(const Group& group) {
  Grid grid(group);
  Peers peers;
  for (int i = 0; i < grid.per_node; ++i) peers.members.push_back(grid.node * grid.per_node + i);
  peers.me = grid.local;
  return peers;
}

Peers RailPeers(const Group& group) {
  Grid grid(group);
  Peers peers;
  for (int j = 0; j < grid.nodes; ++j) peers.members.push_back(j * grid.per_node + grid.local);
  peers.me = grid.node;
  return peers;
}

void Scratch::Free::operator()(char* p) const { FreeShared(p); }

char* Scratch::Get(int slot, size_t bytes) {
  if (buffers_.size() <= static_cast<size_t>(slot)) {
    buffers_.resize(slot + 1);
    sizes_.resize(slot + 1, 0);
  }
  if (sizes_[slot] < bytes) {
    // Shared, so intra-node peers copy partial sums straight out of it.
    buffers_[slot].reset(static_cast<char*>(AllocateShared(bytes)));
    sizes_[slot] = bytes;
  }
  return buffers_[slot].get();
}

Block SplitEven(char* base, size_t count, size_t element_size, int parts) {
  Block block;
  size_t offset = 0;
  for (int p = 0; p < parts; ++p) {
    size_t n = count / parts + (static_cast<size_t>(p) < count % parts ? 1 : 0);
    block.push_back(Span{base + offset * element_size, n * element_size});
    offset += n;
  }
  return block;
}

void RingAllGather(Context& ctx, const Peers& peers, const std::vector<Block>& blocks) {
  Exchange& ex = ctx.exchange;
  ex.BeginPhase();
  int n = peers.size();
  RingShape shape = ShapeOf(blocks, ElementSize(ctx.type), ctx.chunk_bytes);
  if (n == 1 || shape.messages() == 0) return;
  int right = peers.At(1), left = peers.At(-1);
  for (size_t m = 0; m < shape.messages(); ++m) {
    Span piece = shape.Piece(blocks[peers.me], m);
    ex.Send(right, piece.data, piece.bytes, Slot(0, shape, m));
  }
  // Step s receives the block of position me-s-1 and forwards it at step s+1.
  for (int s = 0; s < n - 1; ++s) {
    const Block& block = blocks[((peers.me - s - 1) % n + n) % n];
    for (size_t m = 0; m < shape.messages(); ++m) {
      Span piece = shape.Piece(block, m);
      Exchange::Callback forward;
      if (s + 1 < n - 1) {
        forward = [&ex, right, piece, slot = Slot(s + 1, shape, m)] {
          ex.Send(right, piece.data, piece.bytes, slot);
        };
      }
      ex.Recv(left, piece.data, piece.bytes, Slot(s, shape, m), std::move(forward));
    }
  }
  ex.WaitAll();
}

void RingReduceScatter(Context& ctx, const Peers& peers, const std::vector<Block>& in,
                       const std::vector<Block>& acc, const Block& out) {
  Exchange& ex = ctx.exchange;
  ex.BeginPhase();
  int n = peers.size();
  int me = peers.me;
  if (n == 1) {
    CopySpans(out, in[me]);
    return;
  }
  size_t element_size = ElementSize(ctx.type);
  RingShape shape = ShapeOf(in, element_size, ctx.chunk_bytes);
  if (shape.messages() == 0) return;
  int right = peers.At(1), left = peers.At(-1);
  // Received partial sums land in one of two scratch halves by step parity; a half is
  // reused two steps later, once the chunk it held has been sent on.
  size_t half = shape.spans * shape.stride();
  char* scratch = ctx.scratch.Get(0, 2 * half);
  auto position = [&](int step) { return ((me - step - 2) % n + n) % n; };

  // Recv(s, m) -> sum with own data -> Send(s+1, m) -> Recv(s+2, m) ...
  std::function<void(int, size_t)> post_recv = [&](int s, size_t m) {
    int b = position(s);
    Span own = shape.Piece(in[b], m);
    char* landing = scratch + (s % 2) * half + shape.Offset(m);
    auto add = [&, s, m, b, own, landing] {
      size_t count = own.bytes / element_size;
      if (s == n - 2) {  // b == me: the final sum
        Sum(shape.Piece(out, m).data, own.data, landing, count, ctx.type);
        return;
      }
      char* partial = acc.empty() ? landing : shape.Piece(acc[b], m).data;
      Sum(partial, own.data, landing, count, ctx.type);
      Exchange::Callback next;
      if (s + 2 <= n - 2) next = [&post_recv, s, m] { post_recv(s + 2, m); };
      ex.Send(right, partial, own.bytes, Slot(s + 1, shape, m), std::move(next));
    };
    ex.Recv(left, landing, own.bytes, Slot(s, shape, m), add, Exchange::Reading::kAtOnce);
  };
  const Block& first = in[((me - 1) % n + n) % n];
  for (size_t m = 0; m < shape.messages(); ++m) {
    Span piece = shape.Piece(first, m);
    ex.Send(right, piece.data, piece.bytes, Slot(0, shape, m));
    post_recv(0, m);
    if (n > 2) post_recv(1, m);
  }
  ex.WaitAll();
}

void RingAllReduce(Context& ctx, const Peers& peers, const char* send, char* recv, size_t count) {
  int n = peers.size();
  size_t element_size = ElementSize(ctx.type);
  std::vector<Block> in_blocks = OnePerPosition(SplitEven(const_cast<char*>(send), count, element_size, n));
  std::vector<Block> out_blocks = OnePerPosition(SplitEven(recv, count, element_size, n));
  RingReduceScatter(ctx, peers, in_blocks, out_blocks, out_blocks[peers.me]);
  RingAllGather(ctx, peers, out_blocks);
}

void RecursiveDoublingAllReduce(Context& ctx, const Peers& peers, const char* send, char* recv,
                                size_t count) {
  Exchange& ex = ctx.exchange;
  ex.BeginPhase();
  size_t bytes = count * ElementSize(ctx.type);
  if (send != recv) BulkCopy(recv, send, bytes);
  int n = peers.size(), me = peers.me;
  if (n == 1 || bytes == 0) return;
  char* incoming = ctx.scratch.Get(0, bytes);
  int power = 1;
  while (power * 2 <= n) power *= 2;
  int extra = n - power;  // the first 2*extra positions pair up: odd ones go on
  int virtual_rank = me >= 2 * extra ? me - extra : (me % 2 == 1 ? me / 2 : -1);
  uint32_t slot = 0;
  if (me < 2 * extra) {
    if (me % 2 == 0) {
      ex.Send(peers.member(me + 1), recv, bytes, slot);
      ex.WaitAll();
    } else {
      ex.Recv(peers.member(me - 1), incoming, bytes, slot);
      ex.WaitAll();
      Sum(recv, recv, incoming, count, ctx.type);
    }
  }
  if (virtual_rank >= 0) {
    for (int mask = 1; mask < power; mask <<= 1) {
      ++slot;
      int partner_virtual = virtual_rank ^ mask;
      int partner = partner_virtual < extra ? partner_virtual * 2 + 1 : partner_virtual + extra;
      ex.Send(peers.member(partner), recv, bytes, slot);
      ex.Recv(peers.member(partner), incoming, bytes, slot);
      ex.WaitAll();
      Sum(recv, recv, incoming, count, ctx.type);
    }
  }
  if (me < 2 * extra) {  // the folded ranks get the result back
    constexpr uint32_t kResultSlot = 64;
    if (me % 2 == 0) {
      ex.Recv(peers.member(me + 1), recv, bytes, kResultSlot);
    } else {
      ex.Send(peers.member(me - 1), recv, bytes, kResultSlot);
    }
    ex.WaitAll();
  }
}

void BruckAllGather(Context& ctx, const Peers& peers, const char* send, char* recv,
                    size_t block_bytes) {
  Exchange& ex = ctx.exchange;
  ex.BeginPhase();
  int n = peers.size(), me = peers.me;
  if (block_bytes == 0) return;
  char* gathered = ctx.scratch.Get(0, n * block_bytes);  // position me+i at block i
  std::memcpy(gathered, send, block_bytes);
  uint32_t slot = 0;
  for (int distance = 1; distance < n; distance *= 2, ++slot) {
    size_t blocks = std::min(distance, n - distance);
    ex.Send(peers.At(-distance), gathered, blocks * block_bytes, slot);
    ex.Recv(peers.At(distance), gathered + distance * block_bytes, blocks * block_bytes, slot);
    ex.WaitAll();
  }
  for (int i = 0; i < n; ++i) {
    char* target = recv + ((me + i) % n) * block_bytes;
    if (target != send || i != 0) std::memcpy(target, gathered + i * block_bytes, block_bytes);
  }
}

void ChainBroadcast(Context& ctx, const Peers& peers, char* buf, size_t bytes, int root) {
  Exchange& ex = ctx.exchange;
  ex.BeginPhase();
  int n = peers.size();
  if (n == 1 || bytes == 0) return;
  int from_root = ((peers.me - root) % n + n) % n;
  RingShape shape = ShapeOf({Contiguous(buf, bytes)}, 1, ctx.chunk_bytes);
  int next = peers.At(1), previous = peers.At(-1);
  Block block = Contiguous(buf, bytes);
  for (size_t m = 0; m < shape.messages(); ++m) {
    Span piece = shape.Piece(block, m);
    uint32_t slot = static_cast<uint32_t>(m);
    if (from_root == 0) {
      ex.Send(next, piece.data, piece.bytes, slot);
    } else if (from_root == n - 1) {
      ex.Recv(previous, piece.data, piece.bytes, slot);
    } else {
      ex.Recv(previous, piece.data, piece.bytes, slot,
              [&ex, next, piece, slot] { ex.Send(next, piece.data, piece.bytes, slot); });
    }
  }
  ex.WaitAll();
}

void BinomialBroadcast(Context& ctx, const Peers& peers, char* buf, size_t bytes, int root) {
  Exchange& ex = ctx.exchange;
  ex.BeginPhase();
  int n = peers.size();
  if (n == 1 || bytes == 0) return;
  int from_root = ((peers.me - root) % n + n) % n;
  int mask = 1;
  for (; mask < n; mask <<= 1) {
    if (from_root & mask) {  // receive from the parent, which clears this bit
      ex.Recv(peers.member((from_root - mask + root) % n), buf, bytes, 0);
      ex.WaitAll();
      break;
    }
  }
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (from_root + mask < n) ex.Send(peers.member((from_root + mask + root) % n), buf, bytes, 0);
  }
  ex.WaitAll();
}

void DisseminationBarrier(Context& ctx, const Peers& peers) {
  Exchange& ex = ctx.exchange;
  ex.BeginPhase();
  char token = 1;
  char received[64];
  uint32_t slot = 0;
  for (int distance = 1; distance < peers.size(); distance *= 2, ++slot) {
    ex.Send(peers.At(distance), &token, 1, slot);
    ex.Recv(peers.At(-distance), &received[slot], 1, slot);
    ex.WaitAll();
  }
}

void HierarchicalAllReduce(Context& ctx, const char* send, char* recv, size_t count,
                           size_t small_bytes) {
  const Group& group = ctx.exchange.group();
  Grid grid(group);
  Peers node = NodePeers(group), rail = RailPeers(group);
  size_t element_size = ElementSize(ctx.type);
  std::vector<Block> in_parts =
      OnePerPosition(SplitEven(const_cast<char*>(send), count, element_size, grid.per_node));
  std::vector<Block> out_parts = OnePerPosition(SplitEven(recv, count, element_size, grid.per_node));
  // 1. Each node sums its members' data; local index l holds part l of the node sum.
  RingReduceScatter(ctx, node, in_parts, out_parts, out_parts[grid.local]);
  // 2. Rail peers (one per node) sum part l across nodes.
  Span mine = out_parts[grid.local][0];
  size_t part_count = mine.bytes / element_size;
  if (mine.bytes < small_bytes) {
    RecursiveDoublingAllReduce(ctx, rail, mine.data, mine.data, part_count);
  } else {
    RingAllReduce(ctx, rail, mine.data, mine.data, part_count);
  }
  // 3. Each node shares its parts.
  RingAllGather(ctx, node, out_parts);
}

void HierarchicalAllGather(Context& ctx, const char* send, char* recv, size_t block_bytes) {
  const Group& group = ctx.exchange.group();
  Grid grid(group);
  char* own = recv + group.rank() * block_bytes;
  if (own != send) BulkCopy(own, send, block_bytes);
  auto block_of = [&](int node, int local) {
    return Span{recv + (node * grid.per_node + local) * block_bytes, block_bytes};
  };
  // 1. Rail peers gather the blocks of their local index from every node.
  std::vector<Block> rail_blocks;
  for (int j = 0; j < grid.nodes; ++j) rail_blocks.push_back(Block{block_of(j, grid.local)});
  RingAllGather(ctx, RailPeers(group), rail_blocks);
  // 2. Within the node, each local index shares what its rail gathered.
  std::vector<Block> node_blocks(grid.per_node);
  for (int i = 0; i < grid.per_node; ++i) {
    for (int j = 0; j < grid.nodes; ++j) node_blocks[i].push_back(block_of(j, i));
  }
  RingAllGather(ctx, NodePeers(group), node_blocks);
}

void HierarchicalReduceScatter(Context& ctx, const char* send, char* recv, size_t block_bytes) {
  const Group& group = ctx.exchange.group();
  Grid grid(group);
  char* node_sums = ctx.scratch.Get(1, grid.nodes * block_bytes);  // slot 0 is the ring's
  // 1. Within the node, local index l sums the blocks every node's index l will own.
  std::vector<Block> node_in(grid.per_node);
  for (int i = 0; i < grid.per_node; ++i) {
    for (int j = 0; j < grid.nodes; ++j) {
      node_in[i].push_back(
          Span{const_cast<char*>(send) + (j * grid.per_node + i) * block_bytes, block_bytes});
    }
  }
  Block node_out;
  for (int j = 0; j < grid.nodes; ++j) node_out.push_back(Span{node_sums + j * block_bytes, block_bytes});
  RingReduceScatter(ctx, NodePeers(group), node_in, {}, node_out);
  // 2. Rail peers reduce-scatter those node sums across nodes.
  std::vector<Block> rail_in;
  for (int j = 0; j < grid.nodes; ++j) rail_in.push_back(Block{node_out[j]});
  RingReduceScatter(ctx, RailPeers(group), rail_in, {}, Block{Span{recv, block_bytes}});
}

void HierarchicalBroadcast(Context& ctx, char* buf, size_t bytes, int root, size_t small_bytes) {
  const Group& group = ctx.exchange.group();
  Grid grid(group);
  int root_node = root / grid.per_node, root_local = root % grid.per_node;
  auto broadcast = [&](const Peers& peers, int from) {
    if (bytes < small_bytes) {
      BinomialBroadcast(ctx, peers, buf, bytes, from);
    } else {
      ChainBroadcast(ctx, peers, buf, bytes, from);
    }
  };
  // 1. The root's rail carries the data to every node.
  if (grid.local == root_local) {
    broadcast(RailPeers(group), root_node);
  } else {
    ctx.exchange.BeginPhase();  // keep phase numbers in step with the rail
  }
  // 2. Within each node, from the rail member.
  broadcast(NodePeers(group), root_local);
}

}  // namespace meshtrain::comm::fabric
