// The Communicator: asynchronous collectives and point-to-point transfers over one
// group of ranks, modelled on PyTorch c10d's Backend (docs/design.md, "Collectives").
//
// Every operation returns at once with a Work; Work::Wait(timeout) returns when the
// operation has finished, or throws CommError naming the operation, the group, the
// size and the peer when it failed or did not finish in time. Operations on one
// communicator run in the order they were issued, the same order on every member
// (as with NCCL, every member must issue the same collectives in the same order).
// Buffers must stay valid and untouched until the Work is done.
//
// Counts are elements of `type`. send == recv (or, for AllGather, send equal to this
// rank's block of recv) makes an operation in place.
//
// Thread-safety: a Communicator may be used from several threads, but the order of
// operations is the order of the calls, so concurrent callers get an arbitrary one.

#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "api/layout.h"
#include "worker/comm/group.h"
#include "worker/comm/types.h"

namespace meshtrain::comm {

using std::chrono::milliseconds;

// The default bound on every operation (issue: 300 s, configurable).
inline constexpr milliseconds kDefaultTimeout{300'000};

class Work {
 public:
  virtual ~Work() = default;
  // Returns when the operation has completed. Throws CommError if it failed, or if it
  // is still running after `timeout` (the operation itself then fails the communicator).
  virtual void Wait(milliseconds timeout = kDefaultTimeout) = 0;
  virtual bool IsCompleted() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  int rank() const { return group().rank(); }
  int size() const { return group().size(); }
  // Members, their nodes and the group's name ("world", "tp{0-3}"...).
  virtual const Group& group() const = 0;

  // recv[r*count .. (r+1)*count) = send of rank r.
  virtual std::shared_ptr<Work> AllGather(const void* send, void* recv, size_t count,
                                          DataType type) = 0;
  // recv = op over ranks of send[rank*count .. (rank+1)*count).
  virtual std::shared_ptr<Work> ReduceScatter(const void* send, void* recv, size_t count,
                                              DataType type, ReduceOp op) = 0;
  // recv = op over ranks of send.
  virtual std::shared_ptr<Work> AllReduce(const void* send, void* recv, size_t count,
                                          DataType type, ReduceOp op) = 0;
  // recv = send of `root` (root's recv too).
  virtual std::shared_ptr<Work> Broadcast(const void* send, void* recv, size_t count,
                                          DataType type, int root) = 0;
  virtual std::shared_ptr<Work> Barrier() = 0;
  // Each rank sends send[send_offsets[p] .. + send_counts[p]) to each rank p (itself
  // included) and receives rank p's block for it into recv[recv_offsets[p] ..
  // + recv_counts[p]). Counts and offsets are elements, one entry per member; rank r's
  // send_counts[p] must equal rank p's recv_counts[r]. send and recv do not overlap.
  // Throws CommError at issue for lists of the wrong length.
  virtual std::shared_ptr<Work> AllToAll(const void* send, const std::vector<size_t>& send_counts,
                                         const std::vector<size_t>& send_offsets, void* recv,
                                         const std::vector<size_t>& recv_counts,
                                         const std::vector<size_t>& recv_offsets, DataType type) = 0;
  // Messages between a pair of ranks are received in the order they were sent. A Send may
  // not complete until the peer has posted its matching Recv (as with NCCL, and with
  // fabric over 1 KiB to a peer on the same node), and a communicator runs its operations
  // in order: two ranks that each send to the other before receiving deadlock on one
  // communicator. Order them by rank, or send and receive on two communicators (the
  // pipeline's one-direction links).
  virtual std::shared_ptr<Work> Send(const void* buf, size_t count, DataType type, int peer) = 0;
  virtual std::shared_ptr<Work> Recv(void* buf, size_t count, DataType type, int peer) = 0;

  // Memory for buffers this communicator moves often. On the fabric backend, peers on
  // the same node read it directly, and an all-to-all's senders write their blocks straight
  // into it (one copy at memory speed, no provider copy); any memory works with every
  // operation, this is only faster.
  virtual void* AllocateBuffer(size_t bytes) = 0;
  virtual void FreeBuffer(void* buffer) = 0;

  // A communicator over `members` (ranks of this group, increasing). One contract on
  // every backend: every rank of this group calls it, members or not, in the same order
  // relative to its other NewGroup calls (NCCL splits the parent collectively; the
  // fabric backend lets a non-member return at once); a rank outside `members` gets
  // nullptr. `name` labels the group in errors.
  virtual std::unique_ptr<Communicator> NewGroup(const std::vector<int>& members,
                                                 const std::string& name) = 0;

  // This rank's group along a layout axis (tp, shard, replica). REQUIRES: this
  // communicator is the world of `layout`. Every rank calls it.
  std::unique_ptr<Communicator> SplitAxis(const api::ParallelLayout& layout, api::Axis axis);
};

}  // namespace meshtrain::comm
