// Stream-ordered collectives over NCCL (comm/stream_collectives.h), part of the CUDA
// plugin: each operation is an NCCL call on the caller's stream (ncclSend and ncclRecv
// for point to point), so it completes in that stream's order with no host involvement;
// groups come from ncclCommSplit (SplitGroups: one split for all its lists).
//
// Communicators are non-blocking. A call that answers ncclInProgress is waited for
// before the next; NCCL's asynchronous error is polled before every call and thrown as
// CommError naming the operation and the group. A stuck peer leaves the stream
// unfinished: the engine's bounded Synchronize fails, and Abort() ends the communicators
// of the whole world (the world's and every group split from it) so that their kernels
// stop and the streams drain; every later operation on any of them throws CommError.
// (NCCL's abort stops the kernels that run; with NCCL 2.28 it was seen to wait for one
// still queued behind other work on its stream, which then starts and stops.) A group
// destroyed with operations still pending after a grace aborts its own communicator;
// otherwise it is closed (finalize, then destroy): a communicator is aborted or
// destroyed, never both.
// Groups are named as Communicator::SplitAxis and the host SplitGroups name them
// ("tp{0-3}"), so the engine's messages read the same on every backend. Seconds() times
// each operation with CUDA events on its stream.
// Thread-safety: one thread issues a group's operations; Abort may be called from any
// thread.

#pragma once

#include <chrono>
#include <memory>

#include "api/rank_table.h"
#include "worker/comm/store.h"
#include "worker/comm/stream_collectives.h"

namespace meshtrain::comm {

// NCCL over the world of `table` on CUDA device `device` (made current); every rank
// calls it. Rank 0 makes the unique id and shares it through `store`. Throws CommError
// when NCCL cannot connect within `timeout`, which then also bounds every split and
// every call's wait for NCCL to enqueue it (runtime::cuda::CudaError for a device that
// does not exist).
std::unique_ptr<StreamCollectives> ConnectNcclCollectives(const api::RankTable& table, int rank,
                                                          std::shared_ptr<StoreClient> store, int device,
                                                          std::chrono::milliseconds timeout);

}  // namespace meshtrain::comm
