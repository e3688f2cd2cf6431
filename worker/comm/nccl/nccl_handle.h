// One non-blocking NCCL communicator (config.blocking = 0) and the rules of its use,
// shared by the Communicator (nccl_communicator.h) and the stream-ordered collectives
// (nccl_collectives.h). Internal to comm/nccl/.
//
// - Any call may answer ncclInProgress: the work is not enqueued until
//   ncclCommGetAsyncError stops saying so, and nothing else may be called on the
//   communicator until then. Run() waits for that, bounded, before it returns.
// - NCCL's asynchronous error is checked before every call, and thrown as CommError
//   naming the operation and the group.
// - The handle ends exactly once: Close() (finalize, then destroy) or Abort(), never
//   both. A close that does not finish in its bound (a peer that is gone) aborts instead.
// - Grouped calls (BeginGroup, Queue, then EndGroup or CancelGroup) batch operations of
//   this communicator into one launch. NCCL's group belongs to the calling thread: while
//   it is open, any other NCCL call of that thread would join it, so one thread makes all
//   of a group's calls and no other NCCL call (another handle's Run(), a split, a connect)
//   until it ends; each is refused with std::logic_error. Run() from another thread is
//   refused too, since it would go out of order with the other members. An Abort() or
//   Close() from another thread meanwhile is carried out when the group ends, because
//   the queued calls still refer to the communicator.
//
// Thread-safety: every method may be called from any thread, but for the group rules
// above; calls on one handle are serialised, except that Abort() may interrupt a wait in
// Run() or AwaitReady().

#pragma once

#include <nccl.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "worker/comm/store.h"
#include "worker/comm/types.h"

namespace meshtrain::comm::nccl {

using std::chrono::milliseconds;

ncclDataType_t NcclType(DataType type);
// The NCCL reduction for `op` over a group of `members`. Over one member the average is
// the sum: NCCL 2.28 (.3 and .9, seen on an H100) leaves the last element unwritten by a
// one-rank fp64 ncclAvg of an odd count of 4099 or more (all-reduce and reduce-scatter).
ncclRedOp_t NcclOp(ReduceOp op, int members);
// "100 ms", "2.5 s"
std::string FormatDuration(milliseconds duration);

// The all-to-all of per-peer counts as one NCCL group: for each member p of `comm` with a
// block, ncclSend of send_counts[p] elements at send + send_offsets[p] and ncclRecv of
// recv_counts[p] at recv + recv_offsets[p] (offsets and counts in elements of
// `element` bytes; the block to itself included, which NCCL copies locally). Grouped as
// nccl.h's all-to-all example, so that the sends and receives cannot deadlock. Returns
// the first failure, else ncclGroupEnd's result. REQUIRES: each list has one entry per
// member of `comm`.
ncclResult_t GroupedAllToAll(const char* send, const std::vector<size_t>& send_counts,
                             const std::vector<size_t>& send_offsets, char* recv,
                             const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_offsets,
                             size_t element, ncclDataType_t type, ncclComm_t comm, cudaStream_t stream);

// Aborts `comm`, a split's child no handle owns yet (NCCL made it, and the split then
// failed or timed out: an abort of the parent waits for the split's job, which sets it).
// Null: nothing.
void AbortUnowned(ncclComm_t comm);

class NcclHandle {
 public:
  // Starts a non-blocking ncclCommInitRankConfig of `rank` among `size` ranks: rank 0
  // makes the unique id and sets it at `key` in the Store, the others wait up to
  // `timeout` for it. The init may still be in progress: AwaitReady() waits for it.
  // Throws CommError "<what>: ..." when the id cannot be had or NCCL refuses the init.
  // REQUIRES: the calling thread has no group open; the rank's device is current.
  static std::shared_ptr<NcclHandle> StartInit(StoreClient& store, const std::string& key, int size, int rank,
                                               const std::string& what, milliseconds timeout);

  // Owns `comm`, just made by a non-blocking init or split (it may still be in progress).
  explicit NcclHandle(ncclComm_t comm);
  ~NcclHandle();  // Close(kCloseBound) unless it has ended
  NcclHandle(const NcclHandle&) = delete;
  NcclHandle& operator=(const NcclHandle&) = delete;

  // Throws std::logic_error naming `what` when the calling thread has a group open (on
  // any handle): an NCCL call now would join it.
  static void RequireNoGroupOnThisThread(const std::string& what);

  // Bound of the destructor's close.
  static constexpr milliseconds kCloseBound{10'000};

  // Throws CommError "<what>: ..." when NCCL reports an error on the communicator or
  // it has ended (aborted or closed).
  void ThrowIfFailed(const std::string& what);

  // Calls `call` with the communicator once ThrowIfFailed passes, then waits while NCCL
  // is still enqueueing it. When that takes longer than `timeout` (the first operation
  // connects to peers, so a missing peer shows here) it aborts the communicator and
  // throws CommError naming `what` and the timeout.
  void Run(const std::string& what, milliseconds timeout, const std::function<ncclResult_t(ncclComm_t)>& call);

  // Starts a group on the calling thread (ncclGroupStart). REQUIRES: the thread has no
  // group open, on any handle.
  void BeginGroup(const std::string& what);
  // Calls `call` inside the open group: NCCL only records it, so nothing waits here.
  // REQUIRES: the thread that began the group.
  void Queue(const std::string& what, const std::function<ncclResult_t(ncclComm_t)>& call);
  // Ends the group (ncclGroupEnd), which launches what was queued, and waits while NCCL
  // enqueues it, as Run() does. The group is closed even when this throws. REQUIRES: the
  // thread that began the group.
  void EndGroup(const std::string& what, milliseconds timeout);
  // Closes an open group whose batch failed, and aborts the communicator: the members
  // cannot agree on a batch that was cut short. No-op without a group this thread began.
  void CancelGroup() noexcept;

  // Waits until the communicator's init or split has finished; after `timeout` aborts
  // it and throws CommError "<what>: <waited_for> within <timeout>; ...".
  void AwaitReady(const std::string& what, const std::string& waited_for, milliseconds timeout);

  // Why the communicator cannot be used ("" while it can): NCCL's error, or that it has
  // ended. For polling; does not throw.
  std::string Failure();

  // Ends the communicator at once, stopping its kernels; later calls throw CommError.
  // Idempotent, and a no-op after Close().
  void Abort();
  // Flushes and frees the communicator (ncclCommFinalize, then ncclCommDestroy), or
  // aborts it when that fails or does not finish within `bound`. Idempotent.
  void Close(milliseconds bound);
  bool aborted();

 private:
  // REQUIRES: mutex_ held. NCCL's asynchronous state, or ncclInvalidUsage once ended.
  ncclResult_t State();
  // REQUIRES: mutex_ held. "NCCL reports <error> (<NCCL's last words>)", or that it ended.
  std::string Why(ncclResult_t error);
  // Waits while the state is ncclInProgress; true if it left that state in time.
  bool WaitWhileInProgress(milliseconds timeout, ncclResult_t* state);
  // REQUIRES: mutex_ held. Throws unless the communicator is usable, then calls `call`.
  void CallLocked(const std::string& what, const std::function<ncclResult_t(ncclComm_t)>& call);
  // After a call: waits while NCCL enqueues it; aborts after `timeout`.
  void AwaitEnqueued(const std::string& what, milliseconds timeout);
  void AbortLocked();

  std::mutex mutex_;
  ncclComm_t comm_;
  bool aborted_ = false, closed_ = false;
  bool in_group_ = false;
  bool abort_when_group_ends_ = false;  // an Abort() or Close() came during the group
};

}  // namespace meshtrain::comm::nccl
