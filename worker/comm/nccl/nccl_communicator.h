// The nccl backend (built when CUDA and NCCL are found): Communicators over NCCL on a
// dedicated CUDA stream (docs/design.md, "Collectives").
//
// Rank 0 makes the unique id and shares it through the Store; subgroups come from
// ncclCommSplit, which is why Communicator::NewGroup's contract has every rank of the
// parent call it (ranks outside `members` join no group and get nullptr).
// Communicators are non-blocking (ncclConfig blocking = 0, nccl_handle.h): every call
// first checks NCCL's asynchronous error (a CommError naming the op and the group), and
// returns only once NCCL has really enqueued the operation. A Work's Wait polls its CUDA
// event and NCCL's async error, and when the operation's timeout passes it aborts the
// communicator (ncclCommAbort) and throws CommError naming the op, group and size.
// The destructor lets the comm stream finish for at most the timeout, then closes the
// communicator (finalize and destroy), or aborts it when the stream did not finish:
// a communicator is aborted or destroyed, never both, and nothing hangs.
// Buffers are device memory (AllocateBuffer is cudaMalloc).
//
// Ordering against compute: SetComputeStream(s) makes every later operation wait for
// the work enqueued on `s` before it (an event recorded there). For stream-ordered use
// without the host, the engine uses nccl_collectives.h instead.
// Thread-safety: as communicator.h; operations are issued one at a time.

#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "api/rank_table.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"

namespace meshtrain::comm {

struct NcclOptions {
  int device = 0;  // CUDA device of this rank (usually LOCAL_RANK)
  milliseconds timeout = kDefaultTimeout;
};

// Connects this rank; every rank of `table` calls it. Throws CommError on failure.
std::unique_ptr<Communicator> ConnectNccl(const api::RankTable& table, int rank,
                                          std::shared_ptr<StoreClient> store,
                                          const NcclOptions& options);

// REQUIRES: `communicator` came from ConnectNccl or its NewGroup.
void SetComputeStream(Communicator& communicator, cudaStream_t compute);
cudaStream_t CommStream(const Communicator& communicator);

}  // namespace meshtrain::comm
