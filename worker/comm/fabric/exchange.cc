#include "worker/comm/fabric/exchange.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>

#include "worker/comm/fabric/bulk_copy.h"
#include "worker/comm/fabric/shared_memory.h"
#include "worker/comm/types.h"

namespace meshtrain::comm::fabric {
namespace {

// Posted messages per lane; the rest wait in order. Keeps provider queues short.
constexpr size_t kWindow = 64;

}  // namespace

// Where a direct message's data is (shared) or that it follows as a data message.
struct Exchange::Header {
  uint8_t shared = 0;
  SharedLocation location;
};

Exchange::Exchange(const Group& group, const std::vector<Route>& routes,
                   const std::vector<Endpoint*>& endpoints, uint32_t group_id, uint32_t sequence,
                   std::chrono::milliseconds timeout, std::string what, int idle_yields)
    : group_(group),
      routes_(routes),
      endpoints_(endpoints),
      group_id_(group_id),
      sequence_(sequence & 0x3ff),
      timeout_(timeout),
      deadline_(Clock::now() + timeout),
      what_(std::move(what)),
      idle_yields_(idle_yields) {}

Exchange::~Exchange() {
  for (Lane* lane : {&sends_, &recvs_, &ack_recvs_}) {
    for (Message& message : lane->posted) {
      routes_[message.member].endpoint->Abandon(std::move(message.request));
    }
  }
}

void Exchange::BeginPhase() {
  if (++phase_ >= kPointToPointPhase) {
    throw CommError(what_ + ": an algorithm used more than 14 phases");
  }
}

uint64_t Exchange::Tag(int sender, uint32_t slot, Kind kind) const {
  if (slot > kMaxSlot) {
    throw CommError(what_ + " on group " + group_.Describe() +
                    ": too many messages for one operation (slot " + std::to_string(slot) + ")");
  }
  return uint64_t{group_id_} << 50 | uint64_t(sender) << 38 | uint64_t{sequence_} << 28 |
         uint64_t(phase_) << 24 | uint64_t{kind} << 22 | slot;
}

bool Exchange::Direct(int member, size_t bytes) const {
  const size_t threshold = phase_ == kPointToPointPhase ? kPointToPointDirectBytes + 1 : kDirectBytes;
  return routes_[member].same_node && bytes >= threshold;
}

void Exchange::Queue(bool is_send, int member, const void* buf, size_t bytes, uint32_t slot,
                     Kind kind, Callback done, Order order) {
  Message message{std::make_unique<Request>(), is_send, member, const_cast<void*>(buf), bytes,
                  Tag(is_send ? group_.rank() : member, slot, kind), std::move(done)};
  std::deque<Message>& queue = (is_send ? sends_ : kind == kAck ? ack_recvs_ : recvs_).queued;
  if (order == Order::kFirst) {
    queue.push_front(std::move(message));
  } else {
    queue.push_back(std::move(message));
  }
}

void Exchange::SendDirect(int member, const void* buf, size_t bytes, uint32_t slot, Callback done) {
  Header& header = headers_.emplace_back();
  std::optional<SharedLocation> location = FindShared(buf, bytes);
  header.shared = location.has_value();
  if (location) header.location = *location;
  Queue(true, member, &header, sizeof(Header), slot, kHeader, {});
  if (header.shared) {  // done when the receiver says it has copied
    Queue(false, member, &tokens_.emplace_back(), 1, slot, kAck, std::move(done));
  } else {
    Queue(true, member, buf, bytes, slot, kData, std::move(done));
  }
}

void Exchange::RecvDirect(int member, void* buf, size_t bytes, uint32_t slot, Callback done,
                          Reading reading) {
  Header& header = headers_.emplace_back();
  auto arrived = [this, &header, member, buf, bytes, slot, reading,
                  done = std::move(done)]() mutable {
    if (header.shared) {
      const char* peer = MapPeer(header.location);
      if (reading == Reading::kAtOnce) {
        std::memcpy(buf, peer, bytes);
      } else {
        BulkCopy(buf, peer, bytes);
      }
      Queue(true, member, &tokens_.emplace_back(), 1, slot, kAck, {}, Order::kFirst);
      if (done) done();
    } else {
      Queue(false, member, buf, bytes, slot, kData, std::move(done), Order::kFirst);
    }
  };
  Queue(false, member, &header, sizeof(Header), slot, kHeader, std::move(arrived));
}

void Exchange::Send(int member, const void* buf, size_t bytes, uint32_t slot, Callback done) {
  if (Direct(member, bytes)) return SendDirect(member, buf, bytes, slot, std::move(done));
  Queue(true, member, buf, bytes, slot, kPlain, std::move(done));
}

void Exchange::Recv(int member, void* buf, size_t bytes, uint32_t slot, Callback done,
                    Reading reading) {
  if (Direct(member, bytes)) return RecvDirect(member, buf, bytes, slot, std::move(done), reading);
  Queue(false, member, buf, bytes, slot, kPlain, std::move(done));
}

void Exchange::PostQueued(Lane& lane) {
  while (!lane.queued.empty() && lane.posted.size() < kWindow) {
    Message& message = lane.queued.front();
    const Route& route = routes_[message.member];
    bool accepted = message.is_send ? route.endpoint->PostSend(message.buf, message.bytes,
                                                               route.address, message.tag,
                                                               message.request.get())
                                    : route.endpoint->PostRecv(message.buf, message.bytes,
                                                               message.tag, message.request.get());
    if (!accepted) return;  // provider busy: progress, then try again
    lane.posted.push_back(std::move(message));
    lane.queued.pop_front();
  }
}

std::string Exchange::Peer(int member) const {
  std::string text = "rank " + std::to_string(group_.GlobalRank(member));
  if (group_.name() != "world") text += " (member " + std::to_string(member) + ")";
  return text + " on node " + std::to_string(group_.NodeOf(member));
}

void Exchange::Fail(const Message& message, const std::string& reason) const {
  throw CommError(what_ + " on group " + group_.Describe() + " (rank " +
                  std::to_string(group_.GlobalRank(group_.rank())) + "): " + reason + " " +
                  (message.is_send ? "sending " : "receiving ") + runtime::FormatBytes(message.bytes) +
                  (message.is_send ? " to " : " from ") + Peer(message.member));
}

void Exchange::WaitAll() {
  std::vector<Callback> ready;
  int idle = 0;  // polls since a message last completed
  Clock::time_point idle_since = Clock::now();
  while (!sends_.empty() || !recvs_.empty() || !ack_recvs_.empty()) {
    for (Lane* lane : {&sends_, &recvs_, &ack_recvs_}) PostQueued(*lane);
    for (Endpoint* endpoint : endpoints_) endpoint->Progress();
    bool completed = false;
    for (std::vector<Message>* posted : {&sends_.posted, &recvs_.posted, &ack_recvs_.posted}) {
      for (size_t i = 0; i < posted->size();) {
        Message& message = (*posted)[i];
        int state = message.request->state.load(std::memory_order_acquire);
        if (state == Request::kPending) {
          ++i;
          continue;
        }
        if (state == Request::kFailed) Fail(message, "failed (" + message.request->error + ")");
        if (message.done) ready.push_back(std::move(message.done));
        (*posted)[i] = std::move(posted->back());
        posted->pop_back();
        completed = true;
      }
    }
    for (Callback& callback : ready) callback();
    ready.clear();
    const Clock::time_point now = Clock::now();
    if (completed) {
      idle = 0;
      idle_since = now;
      continue;
    }
    if (now > deadline_) {
      const Message& oldest = !recvs_.posted.empty()       ? recvs_.posted.front()
                              : !sends_.posted.empty()     ? sends_.posted.front()
                              : !ack_recvs_.posted.empty() ? ack_recvs_.posted.front()
                              : !recvs_.queued.empty()     ? recvs_.queued.front()
                              : !sends_.queued.empty()     ? sends_.queued.front()
                                                           : ack_recvs_.queued.front();
      Fail(oldest, "timed out after " + std::to_string(timeout_.count()) + " ms, still");
    }
    // Spin briefly for latency, yield the core for a while, then sleep between polls: 50
    // us at first, and the longer nothing has completed, the longer (an eighth of the
    // time since, up to 500 us). A rank that waits long for a peer (a pipeline stage for
    // its neighbour, a rank for a straggler) then takes about 5% of a core rather than a
    // quarter (measured on two cores), and the latency it gives up is at most an eighth
    // of what it has waited already.
    if (++idle > 64) {
      if (idle <= 64 + idle_yields_) {
        sched_yield();
      } else {
        const auto pause = std::chrono::duration_cast<std::chrono::microseconds>(now - idle_since) / 8;
        usleep(useconds_t(std::clamp<int64_t>(pause.count(), 50, 500)));
      }
    }
  }
}

}  // namespace meshtrain::comm::fabric
