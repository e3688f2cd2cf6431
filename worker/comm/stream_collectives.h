// Stream-ordered collectives (docs/design.md, "The device seam"): all-gather, reduce-scatter
// and all-reduce over one group, and point-to-point send and receive between two of its
// members, on device memory, completing in a stream's order. The engine's FSDP units, its
// tensor-parallel layers and its gradient norm use the collectives, pipeline stages the
// sends and receives (activations forward, their gradients back), and order them against
// compute with events like any other stream work.
//
// Every member issues the same collectives in the same order; a send is matched by its
// peer's receive (see Send). A failure or a timeout (a dead or stuck peer) fails the
// stream: its Synchronize throws an error that names the operation, the group and, where
// known, the peer.
//
// Implementations:
//   HostStreamCollectives (below)  over any Communicator, from the host. On a backend
//       whose device memory the host can address (the CPU), each operation is a task on
//       the stream. On a GPU it is the staged fallback for ranks that share one GPU,
//       which NCCL refuses: at issue, the host waits for the stream, copies device to
//       pinned host memory, runs the collective, and copies back.
//   the CUDA plugin's NCCL collectives  NCCL on the stream (ncclCommSplit for groups).
// Thread-safety: one thread issues a group's operations.

#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "api/layout.h"
#include "worker/comm/communicator.h"
#include "worker/comm/group.h"
#include "worker/comm/types.h"
#include "worker/runtime/backend.h"
#include "worker/runtime/bf16.h"
#include "worker/runtime/device_ptr.h"

namespace meshtrain::comm {

// Seconds the group's operations took, by kind, on their streams' timelines.
struct CollectiveSeconds {
  double all_gather = 0, reduce_scatter = 0, all_reduce = 0;
  double send = 0, recv = 0;
  double all_to_all = 0;
};

class StreamCollectives {
 public:
  virtual ~StreamCollectives() = default;

  virtual const Group& group() const = 0;
  int rank() const { return group().rank(); }
  int size() const { return group().size(); }
  // "fabric", "nccl", "staged through pinned host memory over fabric"
  virtual std::string Describe() const = 0;

  // recv (size * count) = every member's send (count), in member order. send may be
  // recv + rank * count (in place).
  virtual void AllGather(runtime::ConstDeviceBytes send, runtime::DeviceBytes recv, size_t count, DataType type,
                         runtime::Stream& stream) = 0;
  // recv (count) = op over the members of send[rank * count, (rank + 1) * count). recv
  // may be send + rank * count (in place).
  virtual void ReduceScatter(runtime::ConstDeviceBytes send, runtime::DeviceBytes recv, size_t count, DataType type,
                             ReduceOp op, runtime::Stream& stream) = 0;
  // recv (count) = op over the members of send (count); recv may be send.
  virtual void AllReduce(runtime::ConstDeviceBytes send, runtime::DeviceBytes recv, size_t count, DataType type,
                         ReduceOp op, runtime::Stream& stream) = 0;

  // Each member sends send[send_offsets[p], + send_counts[p]) to each member p (itself
  // included) and receives member p's block for it into recv[recv_offsets[p], +
  // recv_counts[p]), as Communicator::AllToAll: counts and offsets in elements of `type`,
  // one entry per member, member r's send_counts[p] equal to member p's recv_counts[r];
  // send and recv do not overlap. Throws std::invalid_argument at issue for lists of the
  // wrong length.
  virtual void AllToAll(runtime::ConstDeviceBytes send, const std::vector<size_t>& send_counts,
                        const std::vector<size_t>& send_offsets, runtime::DeviceBytes recv,
                        const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_offsets,
                        DataType type, runtime::Stream& stream) = 0;

  // Point to point: send (count) goes to member `peer` of this group, whose Recv of the
  // same count and type from this member takes it into recv. Messages from one member to
  // another arrive in the order they were sent; only those two members take part. A Send
  // may not complete before the peer's matching Recv runs (NCCL's may wait for it, the
  // fabric backend's does beyond a few KiB), so both may hold their streams until the
  // transfer ends; and the host implementation runs a group's operations one at a time.
  // So two members that send to each other at once must use two groups (one for each
  // direction, as Mesh's stage links do): over one group each Send can wait for a Recv
  // queued behind the other's Send, a deadlock until the timeout. A Recv waiting for its
  // peer holds its stream, up to the timeout, without busying a core. Throws
  // std::invalid_argument at issue when `peer` is not another member of this group.
  virtual void Send(runtime::ConstDeviceBytes send, size_t count, DataType type, int peer,
                    runtime::Stream& stream) = 0;
  virtual void Recv(runtime::DeviceBytes recv, size_t count, DataType type, int peer, runtime::Stream& stream) = 0;

  // Batches: the operations issued between BeginBatch() and EndBatch(), all on one
  // stream, may go out as one launch (NCCL's grouped calls: many small operations pay one
  // launch and one meeting of the members). Each completes in the stream's order as if
  // issued alone; nothing may wait on the stream before EndBatch(). One thread makes all
  // of a batch's calls, and no operation on another group until it ends (NCCL's group is
  // the thread's: the operation would join it, so it is refused). When an operation of
  // the batch throws, the issuer calls CancelBatch(), which ends the batch and aborts
  // (NCCL: the whole world, as Abort() does), since the members cannot agree on a batch
  // cut short. A batch's time counts to each kind it holds. Batches do not nest. Batched()
  // below pairs the calls. The host implementation, whose operations run one by one
  // anyway, does nothing here.
  virtual void BeginBatch() {}
  virtual void EndBatch() {}
  virtual void CancelBatch() noexcept {}

  // Readies what operations on messages of up to `bytes` need (the staged fallback's
  // pinned buffers), so that no step allocates. The engine calls it when it is built.
  virtual void Reserve(size_t bytes) = 0;
  // Seconds spent so far; REQUIRES: the streams the operations ran on have been synchronized.
  virtual CollectiveSeconds Seconds() = 0;
  // Ends the operations in flight and fails every later one: for a stream that did not
  // finish in time, a stuck peer holding it up. NCCL aborts the communicators of the
  // whole world (the engine cannot tell which group is stuck); the host implementation's
  // operations end by their own timeouts, so there it does nothing. Any thread; idempotent.
  virtual void Abort() = 0;

  // This member's group along a layout axis. REQUIRES: this is the world of `layout`;
  // every member calls it, for every axis, in the same order.
  virtual std::unique_ptr<StreamCollectives> SplitAxis(const api::ParallelLayout& layout, api::Axis axis) = 0;
  // Splits this group into the groups `groups` lists (each list the increasing ranks, in
  // this group, of one new group's members; no rank in two lists; a rank may be in none)
  // and returns the one holding this member, or nullptr when no list holds it. Each is
  // named `name` + "{" + api::FormatRanks(its members' global ranks) + "}" (for the
  // world, its members' ranks: "forward{0,4}"), as SplitAxis names groups. Every member
  // of this group calls it with the same lists, in the same order relative to its other
  // splits (NCCL: one collective ncclCommSplit of this group, whatever the lists; the
  // host implementation: Communicator::NewGroup for every list, in order). Throws
  // std::invalid_argument naming the list at fault when the lists are not as above (every
  // member alike, before any split).
  virtual std::unique_ptr<StreamCollectives> SplitGroups(const std::vector<std::vector<int>>& groups,
                                                         const std::string& name) = 0;
};

// For the implementations. The index in `groups` of the list holding `rank`, or -1 when
// none does, once the lists are checked as SplitGroups requires of them over a group of
// `size` members; throws std::invalid_argument "<what>: ..." naming the list at fault
// otherwise.
int SplitGroupOf(const std::vector<std::vector<int>>& groups, int size, int rank, const std::string& what);
// name + "{" + api::FormatRanks(the global ranks of `members`, ranks of `parent`) + "}".
std::string SplitGroupName(const Group& parent, const std::vector<int>& members, const std::string& name);
// Throws std::invalid_argument naming `op` ("send to", "recv from") and `group` when
// `peer` is not another member of it.
void CheckPeer(const Group& group, int peer, const char* op);

// Throws std::invalid_argument naming `group` unless the four lists of an AllToAll have
// one entry per member; returns the elements the send and the receive blocks span (the
// largest offset + count of each).
std::pair<size_t, size_t> CheckAllToAll(const Group& group, const std::vector<size_t>& send_counts,
                                        const std::vector<size_t>& send_offsets,
                                        const std::vector<size_t>& recv_counts,
                                        const std::vector<size_t>& recv_offsets);

// The element type of T: kFloat32, kBFloat16, kFloat64, kInt32.
template <class T>
constexpr DataType DataTypeOf();
template <>
constexpr DataType DataTypeOf<float>() { return DataType::kFloat32; }
template <>
constexpr DataType DataTypeOf<runtime::bf16>() { return DataType::kBFloat16; }
template <>
constexpr DataType DataTypeOf<double>() { return DataType::kFloat64; }
template <>
constexpr DataType DataTypeOf<int32_t>() { return DataType::kInt32; }

// Typed forms, counts in elements.
template <class T>
void AllGather(StreamCollectives& group, runtime::DevicePtr<const T> send, runtime::DevicePtr<T> recv, size_t count,
               runtime::Stream& stream) {
  group.AllGather(send, recv, count, DataTypeOf<std::remove_const_t<T>>(), stream);
}
template <class T>
void ReduceScatter(StreamCollectives& group, runtime::DevicePtr<const T> send, runtime::DevicePtr<T> recv,
                   size_t count, ReduceOp op, runtime::Stream& stream) {
  group.ReduceScatter(send, recv, count, DataTypeOf<std::remove_const_t<T>>(), op, stream);
}
template <class T>
void AllReduce(StreamCollectives& group, runtime::DevicePtr<T> data, size_t count, ReduceOp op,
               runtime::Stream& stream) {
  group.AllReduce(data, data, count, DataTypeOf<std::remove_const_t<T>>(), op, stream);
}
template <class T>
void Send(StreamCollectives& group, runtime::DevicePtr<const T> send, size_t count, int peer,
          runtime::Stream& stream) {
  group.Send(send, count, DataTypeOf<std::remove_const_t<T>>(), peer, stream);
}
template <class T>
void Recv(StreamCollectives& group, runtime::DevicePtr<T> recv, size_t count, int peer, runtime::Stream& stream) {
  group.Recv(recv, count, DataTypeOf<std::remove_const_t<T>>(), peer, stream);
}

// Runs `issue`, which issues operations on `group`, as one batch of it; without a group
// (nullptr) just runs it.
template <class Issue>
void Batched(StreamCollectives* group, Issue&& issue) {
  if (group == nullptr) return issue();
  group->BeginBatch();
  try {
    issue();
  } catch (...) {
    group->CancelBatch();
    throw;
  }
  group->EndBatch();
}

// Over `communicator` (owned, or borrowed when `owned` is false), with `backend`'s copies
// and pinned memory. REQUIRES: the communicator outlives this if borrowed.
// Staged (a GPU backend), each operation blocks the issuing thread until it has finished,
// but for a Send, which returns once its message is in pinned memory and handed to the
// communicator: a host that sends to a neighbour and then receives from it (over another
// group) does not wait for the neighbour to receive first. A staged Send that fails
// throws at the group's next operation other than a Recv (the peer's Recv fails too).
std::unique_ptr<StreamCollectives> HostCollectives(std::unique_ptr<Communicator> owned, runtime::Backend* backend);
std::unique_ptr<StreamCollectives> HostCollectives(Communicator* borrowed, runtime::Backend* backend);

}  // namespace meshtrain::comm
