// The message layer one operation runs on: tagged sends and receives to the members
// of a group, each with an optional completion callback that may post more (this is
// how rings pipeline chunk by chunk), and WaitAll(), which drives progress until
// nothing is outstanding or the operation's deadline passes.
//
// A tag is (group id:14 | sender's member index:12 | sequence:10 | phase:4 | kind:2 |
// slot:22): every message of an operation has its own slot, so matching never depends
// on arrival order, and operations of different groups or phases never mix.
//
// Large messages between ranks on one node go direct: the sender sends a small header
// saying where the data is; if it lies in shared memory (shared_memory.h) the receiver
// copies it straight from the sender's buffer and acknowledges, so the sender knows its
// buffer is free again; otherwise the data follows as a second message.
//
// At most kWindow messages of each lane are posted to the provider; the rest wait in
// order. The lanes keep that bound from deadlocking a ring, whose members all wait for
// their left neighbour: receives of acknowledgements (which complete only once the
// peer has taken the header) have a lane of their own, so they cannot fill the window
// that the headers need; and what continues a message already under way (the data
// receive after its header, the acknowledgement after the copy) goes ahead of
// messages of later steps, which may wait on it around the ring.
//
// Thread-safety: one Exchange belongs to one thread (the communicator's); it shares
// the endpoints, which are thread-safe, with other groups' exchanges.

#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "worker/comm/fabric/endpoint.h"
#include "worker/comm/group.h"
#include "worker/runtime/memory.h"

namespace meshtrain::comm::fabric {

// How to reach one member of a group.
struct Route {
  Endpoint* endpoint = nullptr;
  fi_addr_t address = FI_ADDR_UNSPEC;
  bool same_node = false;
};

inline constexpr int kMaxMembers = 1 << 12;
inline constexpr uint32_t kMaxGroupId = (1u << 14) - 1;
inline constexpr uint32_t kMaxSlot = (1u << 22) - 1;
// Intra-node messages at least this large take the direct path.
inline constexpr size_t kDirectBytes = 64 << 10;
// And point-to-point ones (SetPointToPoint) larger than this: their sender stages them in
// shared memory, so that no message the provider carries is larger than a header. With
// libfabric 1.17's shm provider, a rendezvous-sized send whose receive was posted late
// was seen to complete at the receiver but never at the sender (about one pipeline run in
// two hung so); a pipeline's receives are posted late by design.
inline constexpr size_t kPointToPointDirectBytes = 1024;
inline constexpr int kPointToPointPhase = 15;

class Exchange {
 public:
  using Callback = std::function<void()>;
  using Clock = std::chrono::steady_clock;

  // `what` describes the operation for errors ("all_reduce of 4.0 MiB fp32"). An idle
  // wait yields the core `idle_yields` times before it sleeps between polls, the longer
  // the longer nothing has completed (up to 500 us).
  Exchange(const Group& group, const std::vector<Route>& routes,
           const std::vector<Endpoint*>& endpoints, uint32_t group_id, uint32_t sequence,
           std::chrono::milliseconds timeout, std::string what, int idle_yields);
  // Abandons (cancels) whatever is still outstanding after a failure.
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  const Group& group() const { return group_; }
  // Starts the next phase: each part of an algorithm (a ring, a tree) runs in its own
  // phase, so its slots never meet another part's messages.
  void BeginPhase();
  void SetPointToPoint() { phase_ = kPointToPointPhase; }

  // Whether the caller reads received bytes at once (a partial sum to add), so a direct
  // copy keeps them in the cache, or not (gathered data), so it streams past it.
  enum class Reading { kLater, kAtOnce };

  void Send(int member, const void* buf, size_t bytes, uint32_t slot, Callback done = {});
  void Recv(int member, void* buf, size_t bytes, uint32_t slot, Callback done = {},
            Reading reading = Reading::kLater);
  // Progresses until every posted and queued message has completed and its callback
  // run. Throws CommError naming the operation, the group and the peer on a failed
  // message or when the deadline passes.
  void WaitAll();

 private:
  struct Message {
    std::unique_ptr<Request> request;
    bool is_send;
    int member;
    void* buf;
    size_t bytes;
    uint64_t tag;
    Callback done;
  };
  // Messages waiting to be posted, in order, and those posted.
  struct Lane {
    std::deque<Message> queued;
    std::vector<Message> posted;
    bool empty() const { return queued.empty() && posted.empty(); }
  };
  enum Kind : uint32_t { kPlain = 0, kHeader = 1, kData = 2, kAck = 3 };
  // Where Queue puts a message in its lane: after the others, or (what continues a
  // message under way) before them.
  enum class Order { kLast, kFirst };
  struct Header;
  uint64_t Tag(int sender, uint32_t slot, Kind kind = kPlain) const;
  // Queues a send (to `member`, tagged as from this rank) or a receive (from `member`).
  void Queue(bool is_send, int member, const void* buf, size_t bytes, uint32_t slot, Kind kind,
             Callback done, Order order = Order::kLast);
  bool Direct(int member, size_t bytes) const;
  void SendDirect(int member, const void* buf, size_t bytes, uint32_t slot, Callback done);
  void RecvDirect(int member, void* buf, size_t bytes, uint32_t slot, Callback done,
                  Reading reading);
  void PostQueued(Lane& lane);
  std::string Peer(int member) const;
  [[noreturn]] void Fail(const Message& message, const std::string& reason) const;

  const Group& group_;
  const std::vector<Route>& routes_;
  const std::vector<Endpoint*>& endpoints_;
  uint32_t group_id_, sequence_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_;
  std::string what_;
  int idle_yields_;
  int phase_ = -1;
  Lane sends_, recvs_, ack_recvs_;
  std::deque<Header> headers_;  // stable addresses while messages are in flight
  std::deque<char> tokens_;     // acknowledgements
};

}  // namespace meshtrain::comm::fabric
