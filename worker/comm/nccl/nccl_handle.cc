#include "worker/comm/nccl/nccl_handle.h"

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <stdexcept>
#include <thread>

namespace meshtrain::comm::nccl {
namespace {

using Clock = std::chrono::steady_clock;

// What State() answers once the handle has ended: no NCCL call may touch it then.
constexpr ncclResult_t kEnded = ncclInvalidUsage;

// The handle whose group this thread has open (NCCL's group is the thread's), if any.
thread_local const NcclHandle* open_group = nullptr;

}  // namespace

ncclDataType_t NcclType(DataType type) {
  switch (type) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kFloat64: return ncclFloat64;
  }
  throw CommError("no NCCL type for data type " + std::to_string(int(type)));
}

ncclRedOp_t NcclOp(ReduceOp op, int members) {
  return op == ReduceOp::kSum || members == 1 ? ncclSum : ncclAvg;
}

std::string FormatDuration(milliseconds duration) {
  if (duration.count() < 1000) return std::to_string(duration.count()) + " ms";
  char text[32];
  std::snprintf(text, sizeof(text), "%g s", double(duration.count()) / 1000);
  return text;
}

std::shared_ptr<NcclHandle> NcclHandle::StartInit(StoreClient& store, const std::string& key, int size, int rank,
                                                   const std::string& what, milliseconds timeout) {
  RequireNoGroupOnThisThread(what);  // the init would join the group
  ncclUniqueId id;
  if (rank == 0) {
    const ncclResult_t made = ncclGetUniqueId(&id);
    if (made != ncclSuccess) throw CommError(what + ": ncclGetUniqueId: " + ncclGetErrorString(made));
    store.Set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  } else {
    std::string bytes;
    try {
      bytes = store.Get(key, timeout);
    } catch (const StoreError& e) {
      throw CommError(what + ": waiting for rank 0's NCCL unique id: " + e.what());
    }
    if (bytes.size() != sizeof(id)) {
      throw CommError(what + ": the NCCL unique id in the Store has " + std::to_string(bytes.size()) +
                      " bytes, not " + std::to_string(sizeof(id)));
    }
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t started = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (started != ncclSuccess && started != ncclInProgress) {
    throw CommError(what + ": ncclCommInitRankConfig: " + ncclGetErrorString(started));
  }
  return std::make_shared<NcclHandle>(comm);
}

NcclHandle::NcclHandle(ncclComm_t comm) : comm_(comm) {}

void NcclHandle::RequireNoGroupOnThisThread(const std::string& what) {
  if (open_group != nullptr) {
    throw std::logic_error(what + ": this thread has a group of NCCL calls open, which the call would join");
  }
}

NcclHandle::~NcclHandle() { Close(kCloseBound); }

ncclResult_t NcclHandle::State() {
  if (aborted_ || closed_) return kEnded;
  ncclResult_t state = ncclSuccess;
  const ncclResult_t asked = ncclCommGetAsyncError(comm_, &state);
  return asked != ncclSuccess ? asked : state;
}

ncclResult_t GroupedAllToAll(const char* send, const std::vector<size_t>& send_counts,
                             const std::vector<size_t>& send_offsets, char* recv,
                             const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_offsets,
                             size_t element, ncclDataType_t type, ncclComm_t comm, cudaStream_t stream) {
  ncclResult_t result = ncclGroupStart();
  if (result != ncclSuccess) return result;
  for (size_t p = 0; p < send_counts.size() && result == ncclSuccess; ++p) {
    if (send_counts[p] > 0) result = ncclSend(send + send_offsets[p] * element, send_counts[p], type, int(p), comm, stream);
    if (result == ncclSuccess && recv_counts[p] > 0) {
      result = ncclRecv(recv + recv_offsets[p] * element, recv_counts[p], type, int(p), comm, stream);
    }
  }
  const ncclResult_t ended = ncclGroupEnd();
  return result != ncclSuccess ? result : ended;
}

void AbortUnowned(ncclComm_t comm) {
  if (comm != nullptr) ncclCommAbort(comm);
}

std::string NcclHandle::Why(ncclResult_t error) {
  if (aborted_) return "the NCCL communicator was aborted";
  if (closed_) return "the NCCL communicator was closed";
  std::string why = std::string("NCCL reports ") + ncclGetErrorString(error);
  const char* detail = ncclGetLastError(comm_);
  if (detail != nullptr && detail[0] != '\0') why += std::string(" (") + detail + ")";
  return why;
}

void NcclHandle::ThrowIfFailed(const std::string& what) {
  std::lock_guard lock(mutex_);
  const ncclResult_t state = State();
  if (state != ncclSuccess && state != ncclInProgress) throw CommError(what + ": " + Why(state));
}

std::string NcclHandle::Failure() {
  std::lock_guard lock(mutex_);
  const ncclResult_t state = State();
  if (state == ncclSuccess || state == ncclInProgress) return "";
  return Why(state);
}

bool NcclHandle::WaitWhileInProgress(milliseconds timeout, ncclResult_t* state) {
  const Clock::time_point start = Clock::now(), deadline = start + timeout;
  std::chrono::microseconds pause{10};
  for (;;) {
    {
      std::lock_guard lock(mutex_);
      *state = State();
    }
    if (*state != ncclInProgress) return true;
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return false;
    // An enqueue mostly takes microseconds, and the shortest sleep costs about 50 (timer
    // slack): yield for the first 100 us, then sleep 100 us at a time, and past 10 ms (an
    // init, a first operation's connect: up to seconds) 1 ms.
    if (now - start < std::chrono::microseconds(100)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      const auto cap = now - start < std::chrono::milliseconds(10) ? std::chrono::microseconds(100)
                                                                    : std::chrono::microseconds(1000);
      pause = std::min(pause * 2, cap);
    }
  }
}

void NcclHandle::CallLocked(const std::string& what, const std::function<ncclResult_t(ncclComm_t)>& call) {
  const ncclResult_t state = State();
  if (state != ncclSuccess) throw CommError(what + ": " + Why(state));
  const ncclResult_t called = call(comm_);
  if (called != ncclSuccess && called != ncclInProgress) throw CommError(what + ": " + Why(called));
}

void NcclHandle::AwaitEnqueued(const std::string& what, milliseconds timeout) {
  ncclResult_t state;
  if (!WaitWhileInProgress(timeout, &state)) {
    Abort();
    throw CommError(what + ": NCCL had not enqueued it after " + FormatDuration(timeout) +
                    " (a peer that does not take part?); the communicator was aborted");
  }
  if (state != ncclSuccess) {
    std::lock_guard lock(mutex_);
    throw CommError(what + ": " + Why(state));
  }
}

void NcclHandle::Run(const std::string& what, milliseconds timeout,
                     const std::function<ncclResult_t(ncclComm_t)>& call) {
  RequireNoGroupOnThisThread(what);
  ncclResult_t state;
  if (!WaitWhileInProgress(timeout, &state)) {  // an earlier call still in progress
    Abort();
    throw CommError(what + ": the NCCL communicator was still busy after " + FormatDuration(timeout) +
                    "; it was aborted");
  }
  {
    std::lock_guard lock(mutex_);
    if (in_group_) throw std::logic_error(what + ": another thread has a group of calls open on the communicator");
    CallLocked(what, call);
  }
  AwaitEnqueued(what, timeout);
}

void NcclHandle::BeginGroup(const std::string& what) {
  RequireNoGroupOnThisThread(what);
  std::lock_guard lock(mutex_);
  if (in_group_) throw std::logic_error(what + ": another thread has a group of calls open on the communicator");
  const ncclResult_t state = State();
  if (state != ncclSuccess) throw CommError(what + ": " + Why(state));
  const ncclResult_t started = ncclGroupStart();
  if (started != ncclSuccess) throw CommError(what + ": ncclGroupStart: " + ncclGetErrorString(started));
  in_group_ = true;
  open_group = this;
}

void NcclHandle::Queue(const std::string& what, const std::function<ncclResult_t(ncclComm_t)>& call) {
  if (open_group != this) throw std::logic_error(what + ": queued without a group this thread began");
  std::lock_guard lock(mutex_);
  if (abort_when_group_ends_) throw CommError(what + ": the NCCL communicator is being aborted");
  CallLocked(what, call);
}

void NcclHandle::EndGroup(const std::string& what, milliseconds timeout) {
  if (open_group != this) throw std::logic_error(what + ": this thread began no group of NCCL calls here");
  {
    std::lock_guard lock(mutex_);
    const ncclResult_t ended = ncclGroupEnd();
    in_group_ = false;
    open_group = nullptr;
    if (abort_when_group_ends_) {
      AbortLocked();
      throw CommError(what + ": the NCCL communicator was aborted while the batch was queued");
    }
    if (ended != ncclSuccess && ended != ncclInProgress) {
      // Peers may have launched the batch this rank did not: a batch cut short aborts.
      const std::string message = what + ": " + Why(ended);
      AbortLocked();
      throw CommError(message);
    }
  }
  AwaitEnqueued(what, timeout);
}

void NcclHandle::CancelGroup() noexcept {
  if (open_group != this) return;
  std::lock_guard lock(mutex_);
  ncclGroupEnd();  // leaves the thread's group; what it launches, the abort stops
  in_group_ = false;
  open_group = nullptr;
  AbortLocked();
}

void NcclHandle::AwaitReady(const std::string& what, const std::string& waited_for, milliseconds timeout) {
  RequireNoGroupOnThisThread(what);
  ncclResult_t state;
  if (!WaitWhileInProgress(timeout, &state)) {
    Abort();
    throw CommError(what + ": " + waited_for + " within " + FormatDuration(timeout) +
                    "; the communicator was aborted");
  }
  if (state != ncclSuccess) {
    std::lock_guard lock(mutex_);
    const std::string message = what + ": " + Why(state);
    AbortLocked();  // a failed init leaves nothing to finalize
    throw CommError(message);
  }
}

void NcclHandle::AbortLocked() {
  if (aborted_ || closed_) return;
  if (in_group_) {  // queued calls refer to the communicator until the group ends
    abort_when_group_ends_ = true;  // stays set: the handle has ended once the group does
    return;
  }
  aborted_ = true;
  ncclCommAbort(comm_);  // blocking, and bounded: it stops the kernels rather than waiting for them
}

void NcclHandle::Abort() {
  std::lock_guard lock(mutex_);
  AbortLocked();
}

bool NcclHandle::aborted() {
  std::lock_guard lock(mutex_);
  return aborted_;
}

void NcclHandle::Close(milliseconds bound) {
  {
    std::lock_guard lock(mutex_);
    if (aborted_ || closed_) return;
    if (in_group_) return AbortLocked();  // another thread's group: ended when the group ends
    const ncclResult_t finalized = ncclCommFinalize(comm_);
    if (finalized != ncclSuccess && finalized != ncclInProgress) return AbortLocked();
  }
  ncclResult_t state;
  const bool quiet = WaitWhileInProgress(bound, &state);
  std::lock_guard lock(mutex_);
  if (aborted_ || closed_) return;  // aborted by another thread meanwhile
  if (!quiet || state != ncclSuccess) return AbortLocked();
  closed_ = true;
  ncclCommDestroy(comm_);  // after a finished finalize, frees local resources without blocking
}

}  // namespace meshtrain::comm::nccl
