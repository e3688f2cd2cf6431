#include "worker/comm/fabric/fabric_communicator.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include "api/environment.h"
#include "worker/comm/fabric/algorithms.h"
#include "worker/comm/fabric/bulk_copy.h"
#include "worker/comm/fabric/endpoint.h"
#include "worker/comm/fabric/exchange.h"
#include "worker/comm/fabric/shared_memory.h"
#include "worker/comm/work.h"
#include "worker/runtime/cpu_stream.h"

namespace meshtrain::comm {

using fabric::Context;
using fabric::Endpoint;
using fabric::Exchange;
using runtime::FormatBytes;
using fabric::Route;

const char* AlgorithmName(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRing: return "ring";
    case Algorithm::kLogDepth: return "log";
    case Algorithm::kHierarchical: return "hierarchical";
  }
  return "?";
}

Algorithm ParseAlgorithm(const std::string& name) {
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kLogDepth,
                      Algorithm::kHierarchical}) {
    if (name == AlgorithmName(a)) return a;
  }
  throw CommError("unknown collective algorithm \"" + name +
                  "\" (expected auto, ring, log or hierarchical)");
}

namespace {

int64_t PositiveFromEnvironment(const char* variable, int64_t fallback) {
  try {
    return api::EnvironmentInteger(variable, 1, INT64_MAX, fallback);
  } catch (const std::runtime_error& e) {
    throw CommError(e.what());
  }
}

}  // namespace

FabricOptions FabricOptions::FromEnvironment() {
  FabricOptions options;
  options.intra_provider = api::EnvironmentString("MESHTRAIN_FABRIC_INTRA_PROVIDER", options.intra_provider);
  options.inter_provider = api::EnvironmentString("MESHTRAIN_FABRIC_INTER_PROVIDER", options.inter_provider);
  options.timeout = std::chrono::seconds(
      PositiveFromEnvironment("MESHTRAIN_COMM_TIMEOUT", options.timeout.count() / 1000));
  options.algorithm = ParseAlgorithm(api::EnvironmentString("MESHTRAIN_COMM_ALGORITHM", "auto"));
  options.small_bytes = PositiveFromEnvironment("MESHTRAIN_COMM_SMALL_BYTES", options.small_bytes);
  options.chunk_bytes = PositiveFromEnvironment("MESHTRAIN_COMM_CHUNK_BYTES", options.chunk_bytes);
  options.register_always = api::EnvironmentString("MESHTRAIN_FABRIC_REGISTER", "0") == "1";
  return options;
}

namespace {

// What the world communicator and its subgroups share: the endpoints, the route to
// every global rank, the store and the options.
struct FabricWorld {
  FabricOptions options;
  std::shared_ptr<StoreClient> store;
  std::unique_ptr<Endpoint> intra, inter;
  std::vector<Endpoint*> endpoints;
  std::vector<Route> routes;  // by global rank
  std::mutex mutex;
  std::map<std::string, int> group_ordinals;  // NewGroup calls per (parent, members)
  int idle_yields = 0;                        // Exchange's, by how crowded this node's cores are
};

// How many times a waiting collective yields its core before it sleeps between polls.
// A rank with a core of its own yields long, for latency. Where this node's ranks
// outnumber the cores they may run on (the launcher starts them all with its own
// affinity), a yielding rank would take turns from the very peers it waits for, so it
// soon sleeps instead.
int IdleYields(int ranks_on_node) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const size_t slots = size_t(std::max({sysconf(_SC_NPROCESSORS_CONF), cores, 1L}));
  if (cpu_set_t* mask = CPU_ALLOC(slots); mask != nullptr) {  // sized for hosts past 1024 CPUs
    if (sched_getaffinity(0, CPU_ALLOC_SIZE(slots), mask) == 0) cores = CPU_COUNT_S(CPU_ALLOC_SIZE(slots), mask);
    CPU_FREE(mask);
  }
  return ranks_on_node > std::max(cores, 1L) ? 128 : 20000;
}

std::string Join(const std::vector<int>& values) {
  std::string text;
  for (int v : values) text += (text.empty() ? "" : ",") + std::to_string(v);
  return text;
}

class FabricCommunicator : public Communicator {
 public:
  FabricCommunicator(std::shared_ptr<FabricWorld> world, Group group, uint32_t id)
      : world_(std::move(world)), group_(std::move(group)), id_(id),
        stream_("comm:" + group_.name()) {
    if (group_.size() > fabric::kMaxMembers) {
      throw CommError("group " + group_.Describe() + " has more than " +
                      std::to_string(fabric::kMaxMembers) + " members");
    }
    for (int m = 0; m < group_.size(); ++m) routes_.push_back(world_->routes[group_.GlobalRank(m)]);
  }

  const Group& group() const override { return group_; }
  const FabricWorld& world() const { return *world_; }

  std::shared_ptr<Work> AllGather(const void* send, void* recv, size_t count,
                                  DataType type) override {
    size_t block = count * ElementSize(type);
    size_t total = block * size();
    auto* in = static_cast<const char*>(send);
    auto* out = static_cast<char*>(recv);
    return Submit("all_gather", total, type, [=, this](Context& ctx) {
      switch (Choose(total)) {
        case Algorithm::kHierarchical:
          return fabric::HierarchicalAllGather(ctx, in, out, block);
        case Algorithm::kLogDepth:
          return fabric::BruckAllGather(ctx, fabric::AllMembers(group_), in, out, block);
        default: {
          char* own = out + rank() * block;
          if (own != in) fabric::BulkCopy(own, in, block);
          std::vector<fabric::Block> blocks;
          for (int p = 0; p < size(); ++p) blocks.push_back({{out + p * block, block}});
          return fabric::RingAllGather(ctx, fabric::AllMembers(group_), blocks);
        }
      }
    });
  }

  std::shared_ptr<Work> ReduceScatter(const void* send, void* recv, size_t count, DataType type,
                                      ReduceOp op) override {
    size_t block = count * ElementSize(type);
    size_t total = block * size();
    auto* in = static_cast<const char*>(send);
    auto* out = static_cast<char*>(recv);
    return Submit(std::string("reduce_scatter(") + ReduceOpName(op) + ")", total, type,
                  [=, this](Context& ctx) {
      switch (Choose(total)) {
        case Algorithm::kHierarchical:
          fabric::HierarchicalReduceScatter(ctx, in, out, block);
          break;
        case Algorithm::kLogDepth: {  // all-reduce everything, keep this rank's block
          char* everything = ctx.scratch.Get(1, total);
          fabric::RecursiveDoublingAllReduce(ctx, fabric::AllMembers(group_), in, everything,
                                             count * size());
          if (block > 0) std::memmove(out, everything + rank() * block, block);
          break;
        }
        default: {
          std::vector<fabric::Block> blocks;
          for (int p = 0; p < size(); ++p) {
            blocks.push_back({{const_cast<char*>(in) + p * block, block}});
          }
          fabric::RingReduceScatter(ctx, fabric::AllMembers(group_), blocks, {}, {{out, block}});
        }
      }
      if (op == ReduceOp::kAverage) DivideBy(out, count, type, size());
    });
  }

  std::shared_ptr<Work> AllReduce(const void* send, void* recv, size_t count, DataType type,
                                  ReduceOp op) override {
    size_t total = count * ElementSize(type);
    auto* in = static_cast<const char*>(send);
    auto* out = static_cast<char*>(recv);
    return Submit(std::string("all_reduce(") + ReduceOpName(op) + ")", total, type,
                  [=, this](Context& ctx) {
      switch (Choose(total)) {
        case Algorithm::kHierarchical:
          fabric::HierarchicalAllReduce(ctx, in, out, count, world_->options.small_bytes);
          break;
        case Algorithm::kLogDepth:
          fabric::RecursiveDoublingAllReduce(ctx, fabric::AllMembers(group_), in, out, count);
          break;
        default:
          fabric::RingAllReduce(ctx, fabric::AllMembers(group_), in, out, count);
      }
      if (op == ReduceOp::kAverage) DivideBy(out, count, type, size());
    });
  }

  std::shared_ptr<Work> Broadcast(const void* send, void* recv, size_t count, DataType type,
                                  int root) override {
    CheckMember(root, "broadcast root", /*may_be_self=*/true);
    size_t total = count * ElementSize(type);
    auto* in = static_cast<const char*>(send);
    auto* out = static_cast<char*>(recv);
    return Submit("broadcast(root " + std::to_string(root) + ")", total, type,
                  [=, this](Context& ctx) {
      if (rank() == root && in != out) fabric::BulkCopy(out, in, total);
      switch (Choose(total)) {
        case Algorithm::kHierarchical:
          return fabric::HierarchicalBroadcast(ctx, out, total, root, world_->options.small_bytes);
        case Algorithm::kLogDepth:
          return fabric::BinomialBroadcast(ctx, fabric::AllMembers(group_), out, total, root);
        default:
          return fabric::ChainBroadcast(ctx, fabric::AllMembers(group_), out, total, root);
      }
    });
  }

  std::shared_ptr<Work> Barrier() override {
    return Submit("barrier", 0, DataType::kInt32, [this](Context& ctx) {
      fabric::DisseminationBarrier(ctx, fabric::AllMembers(group_));
    });
  }

  // Every pair's block in one phase: each rank posts its messages to and from every
  // other at once, nearest peers first, and copies its own block with BulkCopy.
  //
  // A block of at least kDirectBytes between two ranks on one node is pushed when the
  // receiver's block lies in shared memory (AllocateBuffer): the receiver offers its
  // location, the sender copies straight into it and says so, so each rank copies what
  // it sends (a mixture of experts sends about as much from every rank but receives
  // unevenly, and the copies stay balanced). Otherwise the receiver's "not shared" offer
  // asks for the block through the Exchange's direct path: read by the receiver in place
  // if the sender's block is in shared memory, else from a copy in shared scratch (so no
  // large intra-node message is left to a provider rendezvous). Smaller blocks and blocks
  // to another node go from `send` as they are.
  std::shared_ptr<Work> AllToAll(const void* send, const std::vector<size_t>& send_counts,
                                 const std::vector<size_t>& send_offsets, void* recv,
                                 const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_offsets,
                                 DataType type) override {
    CheckAllToAllLists(send_counts, send_offsets, recv_counts, recv_offsets);
    const size_t element = ElementSize(type);
    size_t total = 0;
    for (size_t c : send_counts) total += c * element;
    return Submit("all_to_all", total, type, [=, this](Context& ctx) {
      fabric::Exchange& ex = ctx.exchange;
      ex.BeginPhase();
      const int n = size(), me = rank();
      auto* in = static_cast<const char*>(send);
      auto* out = static_cast<char*>(recv);
      constexpr uint32_t kDataSlot = 0, kOfferSlot = 1, kPushedSlot = 2;
      // Where a block is negotiated: the receiver's offer decides between a push into its
      // shared memory and a send, which then never finds its receive unposted. Every
      // same-node block past a header's size, as for point-to-point (exchange.h,
      // kPointToPointDirectBytes): a rendezvous-sized send of libfabric's shm provider
      // whose receive was posted late may never complete at the sender, and all-to-alls
      // of a few KiB a member (a mixture of experts' tokens) were seen to hang so.
      auto negotiated = [&](int peer, size_t bytes) {
        return routes_[size_t(peer)].same_node && bytes > fabric::kPointToPointDirectBytes;
      };
      std::vector<Offer> offers_out(static_cast<size_t>(n)), offers_in(static_cast<size_t>(n));  // stable in flight
      std::vector<char> pushed(static_cast<size_t>(n));
      const char token = 1;
      // Scratch for the blocks a pull may need staged: those not in shared memory.
      size_t staging = 0;
      for (int p = 0; p < n; ++p) {
        const size_t bytes = send_counts[size_t(p)] * element;
        if (p != me && negotiated(p, bytes) && !fabric::FindShared(in + send_offsets[size_t(p)] * element, bytes)) {
          staging += bytes;
        }
      }
      char* staged = staging > 0 ? ctx.scratch.Get(0, staging) : nullptr;
      for (int step = 1; step < n; ++step) {
        const int source = (me - step + n) % n, target = (me + step) % n;
        if (const size_t bytes = recv_counts[size_t(source)] * element; bytes > 0) {
          char* block = out + recv_offsets[size_t(source)] * element;
          if (!negotiated(source, bytes)) {
            ex.Recv(source, block, bytes, kDataSlot);
          } else {
            Offer& offer = offers_out[size_t(source)];
            const std::optional<fabric::SharedLocation> location = fabric::FindShared(block, bytes);
            offer.shared = location.has_value();
            offer.bytes = bytes;
            if (location) offer.location = *location;
            ex.Send(source, &offer, sizeof(Offer), kOfferSlot);
            if (offer.shared) {
              ex.Recv(source, &pushed[size_t(source)], 1, kPushedSlot);
            } else {
              ex.Recv(source, block, bytes, kDataSlot);
            }
          }
        }
        if (const size_t bytes = send_counts[size_t(target)] * element; bytes > 0) {
          const char* block = in + send_offsets[size_t(target)] * element;
          if (!negotiated(target, bytes)) {
            ex.Send(target, block, bytes, kDataSlot);
            continue;
          }
          char* scratch = nullptr;
          if (!fabric::FindShared(block, bytes)) scratch = staged, staged += bytes;
          Offer& offer = offers_in[size_t(target)];
          ex.Recv(target, &offer, sizeof(Offer), kOfferSlot,
                  [this, &ex, &offer, &token, target, block, bytes, scratch] {
                    if (offer.bytes != bytes) {  // the peer's lists disagree with ours: write nothing
                      throw CommError("all_to_all on group " + group_.Describe() + ": member " +
                                      std::to_string(rank()) + " sends " + FormatBytes(bytes) + " to member " +
                                      std::to_string(target) + ", which expects " + FormatBytes(offer.bytes));
                    }
                    if (offer.shared) {
                      fabric::BulkCopy(fabric::MapPeerWritable(offer.location), block, bytes);
                      ex.Send(target, &token, 1, kPushedSlot);
                    } else if (scratch != nullptr) {
                      fabric::BulkCopy(scratch, block, bytes);
                      ex.Send(target, scratch, bytes, kDataSlot);
                    } else {
                      ex.Send(target, block, bytes, kDataSlot);
                    }
                  });
        }
      }
      fabric::BulkCopy(out + recv_offsets[size_t(me)] * element, in + send_offsets[size_t(me)] * element,
                       send_counts[size_t(me)] * element);
      ex.WaitAll();
    });
  }

  std::shared_ptr<Work> Send(const void* buf, size_t count, DataType type, int peer) override {
    CheckMember(peer, "send peer", /*may_be_self=*/false);
    size_t bytes = count * ElementSize(type);
    return Submit("send to " + std::to_string(peer), bytes, type, [=, this](Context& ctx) {
      ctx.exchange.SetPointToPoint();
      const void* from = buf;
      if (routes_[size_t(peer)].same_node && bytes > fabric::kPointToPointDirectBytes) {
        // The direct path from shared memory (exchange.h, kPointToPointDirectBytes): the
        // peer copies out of the staging buffer before it acknowledges.
        if (staging_.bytes < bytes) {
          fabric::FreeShared(staging_.data);
          staging_.data = nullptr;
          staging_.data = fabric::AllocateShared(bytes);
          staging_.bytes = bytes;
        }
        std::memcpy(staging_.data, buf, bytes);
        from = staging_.data;
      }
      ctx.exchange.Send(peer, from, bytes, sent_[peer]++ & fabric::kMaxSlot);
      ctx.exchange.WaitAll();
    }, /*collective=*/false);
  }

  std::shared_ptr<Work> Recv(void* buf, size_t count, DataType type, int peer) override {
    CheckMember(peer, "recv peer", /*may_be_self=*/false);
    size_t bytes = count * ElementSize(type);
    return Submit("recv from " + std::to_string(peer), bytes, type, [=, this](Context& ctx) {
      ctx.exchange.SetPointToPoint();
      ctx.exchange.Recv(peer, buf, bytes, received_[peer]++ & fabric::kMaxSlot);
      ctx.exchange.WaitAll();
    }, /*collective=*/false);
  }

  void* AllocateBuffer(size_t bytes) override { return fabric::AllocateShared(bytes); }
  void FreeBuffer(void* buffer) override { fabric::FreeShared(buffer); }

  std::unique_ptr<Communicator> NewGroup(const std::vector<int>& members,
                                         const std::string& name) override {
    if (std::find(members.begin(), members.end(), rank()) == members.end()) return nullptr;
    Group group = group_.Subgroup(name, members);  // checks the member list
    std::string key = "meshtrain/group/" + std::to_string(id_) + "/" + Join(group.global_ranks());
    {
      std::lock_guard lock(world_->mutex);
      key += "#" + std::to_string(world_->group_ordinals[key]++);
    }
    uint32_t id;
    if (group.rank() == 0) {
      id = static_cast<uint32_t>(world_->store->Add("meshtrain/group-ids", 1));
      world_->store->Set(key, std::to_string(id));
    } else {
      id = static_cast<uint32_t>(std::stoul(world_->store->Get(key, world_->options.timeout)));
    }
    if (id > fabric::kMaxGroupId) {
      throw CommError("group " + name + ": more than " + std::to_string(fabric::kMaxGroupId) +
                      " groups were created");
    }
    return std::make_unique<FabricCommunicator>(world_, std::move(group), id);
  }

 private:
  void CheckAllToAllLists(const std::vector<size_t>& send_counts, const std::vector<size_t>& send_offsets,
                          const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_offsets) const {
    for (const auto* list : {&send_counts, &send_offsets, &recv_counts, &recv_offsets}) {
      if (list->size() != size_t(size())) {
        throw CommError("all_to_all on group " + group_.Describe() + ": " + std::to_string(list->size()) +
                        " counts or offsets for " + std::to_string(size()) + " members");
      }
    }
    if (recv_counts[size_t(rank())] != send_counts[size_t(rank())]) {
      throw CommError("all_to_all on group " + group_.Describe() + ": rank " + std::to_string(rank()) + " sends " +
                      std::to_string(send_counts[size_t(rank())]) + " elements to itself but receives " +
                      std::to_string(recv_counts[size_t(rank())]));
    }
  }

  // What an all-to-all receiver tells a same-node sender about its block: its size, and
  // where it lies in shared memory, to be written there, or that it does not.
  struct Offer {
    uint8_t shared = 0;
    uint64_t bytes = 0;
    fabric::SharedLocation location;
  };

  void CheckMember(int member, const char* what, bool may_be_self) const {
    if (member < 0 || member >= size() || (member == rank() && !may_be_self)) {
      throw CommError(std::string(what) + " " + std::to_string(member) + " is not " +
                      (may_be_self ? "a" : "another") + " member of group " + group_.Describe());
    }
  }

  Algorithm Choose(size_t bytes) const {
    bool hierarchical = group_.IsNodeMajor() && group_.NodeCount() >= 2 && group_.PerNode() >= 2;
    Algorithm forced = world_->options.algorithm;
    if (forced == Algorithm::kHierarchical) return hierarchical ? forced : Algorithm::kRing;
    if (forced != Algorithm::kAuto) return forced;
    if (bytes < world_->options.small_bytes) return Algorithm::kLogDepth;
    return hierarchical ? Algorithm::kHierarchical : Algorithm::kRing;
  }

  std::shared_ptr<Work> Submit(const std::string& op, size_t bytes, DataType type,
                               std::function<void(Context&)> body, bool collective = true) {
    std::string what = op + " of " + FormatBytes(bytes) + " " + DataTypeName(type);
    auto work = std::make_shared<HostWork>(what + " on group " + group_.Describe());
    stream_.Enqueue([this, work, what, type, collective, body = std::move(body)] {
      if (!broken_.empty()) {
        work->Complete(what + " on group " + group_.Describe() +
                       ": the group is unusable after an earlier failure: " + broken_);
        return;
      }
      try {
        Exchange exchange(group_, routes_, world_->endpoints, id_, collective ? sequence_++ : 0,
                          world_->options.timeout, what, world_->idle_yields);
        Context ctx{exchange, scratch_, type, world_->options.chunk_bytes};
        body(ctx);
        work->Complete();
      } catch (const std::exception& error) {
        broken_ = error.what();
        work->Complete(error.what());
      }
    });
    return work;
  }

  std::shared_ptr<FabricWorld> world_;
  Group group_;
  uint32_t id_;
  std::vector<Route> routes_;  // by member
  // Touched only on the communicator's thread:
  fabric::Scratch scratch_;
  uint32_t sequence_ = 0;
  std::map<int, uint32_t> sent_, received_;  // point-to-point messages per peer
  // Shared memory a send to a peer on this node is copied into; freed after the stream stops.
  struct Staging {
    void* data = nullptr;
    size_t bytes = 0;
    ~Staging() { fabric::FreeShared(data); }
  } staging_;
  std::string broken_;
  runtime::CpuStream stream_;  // last: stops (finishing queued work) before the rest goes
};

}  // namespace

std::unique_ptr<Communicator> ConnectFabric(const api::RankTable& table, int rank,
                                            std::shared_ptr<StoreClient> store,
                                            const FabricOptions& options) {
  Group world_group = Group::World(table, rank);
  auto world = std::make_shared<FabricWorld>();
  world->options = options;
  world->store = store;
  bool local_peers = false, remote_peers = false;
  int ranks_on_node = 1;
  for (int r = 0; r < world_group.size(); ++r) {
    if (r == rank) continue;
    const bool same_node = world_group.SameNode(r, rank);
    (same_node ? local_peers : remote_peers) = true;
    ranks_on_node += same_node;
  }
  world->idle_yields = IdleYields(ranks_on_node);
  if (local_peers) world->intra = std::make_unique<Endpoint>(options.intra_provider, options.register_always);
  if (remote_peers) {
    if (!options.inter_provider.empty()) {
      world->inter = std::make_unique<Endpoint>(options.inter_provider, options.register_always);
    } else {
      try {
        world->inter = std::make_unique<Endpoint>("efa", options.register_always);
      } catch (const CommError&) {
        world->inter = std::make_unique<Endpoint>("tcp;ofi_rxm", options.register_always);
      }
    }
  }
  for (Endpoint* e : {world->intra.get(), world->inter.get()}) {
    if (e != nullptr) world->endpoints.push_back(e);
  }
  std::string prefix = "meshtrain/fabric/";
  if (world->intra) store->Set(prefix + "intra/" + std::to_string(rank), world->intra->Address());
  if (world->inter) store->Set(prefix + "inter/" + std::to_string(rank), world->inter->Address());
  world->routes.resize(world_group.size());
  for (int r = 0; r < world_group.size(); ++r) {
    if (r == rank) continue;
    bool local = world_group.SameNode(r, rank);
    Endpoint* endpoint = local ? world->intra.get() : world->inter.get();
    std::string address =
        store->Get(prefix + (local ? "intra/" : "inter/") + std::to_string(r), options.timeout);
    world->routes[r] = Route{endpoint, endpoint->Insert(address), local};
  }
  return std::make_unique<FabricCommunicator>(world, std::move(world_group), 0);
}

FabricInfo InfoOf(const Communicator& communicator) {
  const auto& fabric = dynamic_cast<const FabricCommunicator&>(communicator);
  FabricInfo info;
  const FabricWorld& world = fabric.world();
  if (world.intra) info.intra_provider = world.intra->opened_provider();
  if (world.inter) info.inter_provider = world.inter->opened_provider();
  for (Endpoint* e : world.endpoints) info.registrations += e->registrations();
  return info;
}

}  // namespace meshtrain::comm
