#include "worker/comm/nccl/nccl_communicator.h"

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "worker/comm/nccl/nccl_handle.h"
#include "worker/runtime/memory.h"

namespace meshtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;
using nccl::FormatDuration;
using nccl::NcclHandle;

void CheckCuda(cudaError_t result, const std::string& what) {
  if (result != cudaSuccess) {
    cudaGetLastError();  // clears an error that is not sticky
    throw CommError(what + ": " + cudaGetErrorString(result));
  }
}

// Polls `event` until it is reached or `timeout` passes; true if reached. A CUDA failure
// counts as reached: the caller only needs to know the stream is no longer running.
bool ReachedWithin(cudaEvent_t event, milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  std::chrono::microseconds pause{1};
  for (;;) {
    if (cudaEventQuery(event) != cudaErrorNotReady) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclHandle> handle, cudaEvent_t event, std::string what, milliseconds op_timeout)
      : handle_(std::move(handle)), event_(event), what_(std::move(what)), op_timeout_(op_timeout),
        started_(Clock::now()) {}
  ~NcclWork() override { cudaEventDestroy(event_); }

  void Wait(milliseconds timeout) override {
    const Clock::time_point deadline = std::min(Clock::now() + timeout, started_ + op_timeout_);
    std::chrono::microseconds pause{1};
    for (;;) {
      const cudaError_t query = cudaEventQuery(event_);
      if (query == cudaSuccess) return;
      if (query != cudaErrorNotReady) CheckCuda(query, what_);
      if (std::string failure = handle_->Failure(); !failure.empty()) throw CommError(what_ + ": " + failure);
      if (Clock::now() >= deadline) {
        if (Clock::now() >= started_ + op_timeout_) {
          handle_->Abort();  // a stuck peer: free the GPU, fail every later call
          throw CommError(what_ + ": timed out after " + FormatDuration(op_timeout_) +
                          "; the communicator was aborted");
        }
        throw CommError(what_ + ": not finished after " + FormatDuration(timeout) + " of waiting");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  bool IsCompleted() override { return cudaEventQuery(event_) == cudaSuccess; }

 private:
  std::shared_ptr<NcclHandle> handle_;  // outlives the communicator while the Work does
  cudaEvent_t event_;
  std::string what_;
  milliseconds op_timeout_;
  Clock::time_point started_;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclHandle> handle, Group group, NcclOptions options)
      : handle_(std::move(handle)), group_(std::move(group)), options_(options) {
    CheckCuda(cudaSetDevice(options_.device), "cudaSetDevice(" + std::to_string(options_.device) + ")");
    CheckCuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating the comm stream");
    CheckCuda(cudaEventCreateWithFlags(&compute_ready_, cudaEventDisableTiming), "creating the comm stream's event");
    CheckCuda(cudaEventCreateWithFlags(&drained_, cudaEventDisableTiming), "creating the comm stream's event");
    CheckCuda(cudaMalloc(&barrier_, sizeof(int)), "allocating the barrier word");
  }

  // Lets the comm stream finish, for at most the operation timeout; when it does not (a
  // stuck peer), aborts the communicator, which stops its kernels, rather than hang.
  ~NcclCommunicator() override {
    cudaSetDevice(options_.device);
    const bool drained = cudaEventRecord(drained_, stream_) == cudaSuccess && ReachedWithin(drained_, options_.timeout);
    if (drained) {
      handle_->Close(options_.timeout);
    } else {
      handle_->Abort();
    }
    cudaFree(barrier_);
    cudaEventDestroy(drained_);
    cudaEventDestroy(compute_ready_);
    cudaStreamDestroy(stream_);
    cudaGetLastError();
  }

  const Group& group() const override { return group_; }
  cudaStream_t stream() const { return stream_; }
  void set_compute(cudaStream_t compute) {
    std::lock_guard lock(issue_mutex_);
    compute_ = compute;
  }

  std::shared_ptr<Work> AllGather(const void* send, void* recv, size_t count, DataType type) override {
    return Issue("all_gather", count * size() * ElementSize(type), type, [&](ncclComm_t comm) {
      return ncclAllGather(send, recv, count, nccl::NcclType(type), comm, stream_);
    });
  }
  std::shared_ptr<Work> ReduceScatter(const void* send, void* recv, size_t count, DataType type,
                                      ReduceOp op) override {
    return Issue(std::string("reduce_scatter(") + ReduceOpName(op) + ")", count * size() * ElementSize(type), type,
                 [&](ncclComm_t comm) {
                   return ncclReduceScatter(send, recv, count, nccl::NcclType(type), nccl::NcclOp(op, size()), comm,
                                            stream_);
                 });
  }
  std::shared_ptr<Work> AllReduce(const void* send, void* recv, size_t count, DataType type,
                                  ReduceOp op) override {
    return Issue(std::string("all_reduce(") + ReduceOpName(op) + ")", count * ElementSize(type), type,
                 [&](ncclComm_t comm) {
                   return ncclAllReduce(send, recv, count, nccl::NcclType(type), nccl::NcclOp(op, size()), comm,
                                        stream_);
                 });
  }
  std::shared_ptr<Work> Broadcast(const void* send, void* recv, size_t count, DataType type,
                                  int root) override {
    return Issue("broadcast(root " + std::to_string(root) + ")", count * ElementSize(type), type,
                 [&](ncclComm_t comm) {
                   return ncclBroadcast(send, recv, count, nccl::NcclType(type), root, comm, stream_);
                 });
  }
  std::shared_ptr<Work> Barrier() override {
    return Issue("barrier", 0, DataType::kInt32, [&](ncclComm_t comm) {
      return ncclAllReduce(barrier_, barrier_, 1, ncclInt32, ncclSum, comm, stream_);
    });
  }
  // One grouped ncclSend and ncclRecv per peer (GroupedAllToAll).
  std::shared_ptr<Work> AllToAll(const void* send, const std::vector<size_t>& send_counts,
                                 const std::vector<size_t>& send_offsets, void* recv,
                                 const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_offsets,
                                 DataType type) override {
    for (const auto* list : {&send_counts, &send_offsets, &recv_counts, &recv_offsets}) {
      if (list->size() != size_t(size())) {
        throw CommError("all_to_all on group " + group_.Describe() + ": " + std::to_string(list->size()) +
                        " counts or offsets for " + std::to_string(size()) + " members");
      }
    }
    const size_t element = ElementSize(type);
    size_t total = 0;
    for (size_t c : send_counts) total += c * element;
    return Issue("all_to_all", total, type, [&](ncclComm_t comm) {
      return nccl::GroupedAllToAll(static_cast<const char*>(send), send_counts, send_offsets, static_cast<char*>(recv),
                                   recv_counts, recv_offsets, element, nccl::NcclType(type), comm, stream_);
    });
  }

  std::shared_ptr<Work> Send(const void* buf, size_t count, DataType type, int peer) override {
    return Issue("send to " + std::to_string(peer), count * ElementSize(type), type, [&](ncclComm_t comm) {
      return ncclSend(buf, count, nccl::NcclType(type), peer, comm, stream_);
    });
  }
  std::shared_ptr<Work> Recv(void* buf, size_t count, DataType type, int peer) override {
    return Issue("recv from " + std::to_string(peer), count * ElementSize(type), type, [&](ncclComm_t comm) {
      return ncclRecv(buf, count, nccl::NcclType(type), peer, comm, stream_);
    });
  }

  void* AllocateBuffer(size_t bytes) override {
    CheckCuda(cudaSetDevice(options_.device), "cudaSetDevice(" + std::to_string(options_.device) + ")");
    void* memory = nullptr;
    CheckCuda(cudaMalloc(&memory, bytes), "cudaMalloc of " + runtime::FormatBytes(bytes));
    return memory;
  }
  void FreeBuffer(void* buffer) override { cudaFree(buffer); }

  std::unique_ptr<Communicator> NewGroup(const std::vector<int>& members,
                                         const std::string& name) override {
    const bool member = std::find(members.begin(), members.end(), rank()) != members.end();
    const std::string what = "ncclCommSplit of group " + group_.Describe() + " into " + name;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    std::lock_guard lock(issue_mutex_);
    try {
      handle_->Run(what, options_.timeout, [&](ncclComm_t parent) {
        return ncclCommSplit(parent, member ? members.front() : NCCL_SPLIT_NOCOLOR, rank(), &child, &config);
      });
    } catch (...) {
      nccl::AbortUnowned(child);
      throw;
    }
    if (!member) return nullptr;
    auto child_handle = std::make_shared<NcclHandle>(child);
    child_handle->AwaitReady(what, "the members did not all join", options_.timeout);
    return std::make_unique<NcclCommunicator>(std::move(child_handle), group_.Subgroup(name, members), options_);
  }

 private:
  template <class Call>
  std::shared_ptr<Work> Issue(const std::string& op, size_t bytes, DataType type, Call call) {
    const std::string what = op + " of " + runtime::FormatBytes(bytes) + " " + DataTypeName(type) + " on group " +
                             group_.Describe() + " (nccl)";
    // One issuer at a time, so that operations reach NCCL in the order of the calls and
    // each is enqueued before its done event is recorded.
    std::lock_guard lock(issue_mutex_);
    CheckCuda(cudaSetDevice(options_.device), what);
    if (compute_ != nullptr) {  // inputs come from compute: wait for it on the GPU
      CheckCuda(cudaEventRecord(compute_ready_, compute_), what);
      CheckCuda(cudaStreamWaitEvent(stream_, compute_ready_, 0), what);
    }
    // Polls NCCL's asynchronous error first, and returns once NCCL has really enqueued
    // the operation (a non-blocking communicator may answer ncclInProgress before).
    handle_->Run(what, options_.timeout, call);
    cudaEvent_t done;
    CheckCuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), what);
    const cudaError_t recorded = cudaEventRecord(done, stream_);
    if (recorded != cudaSuccess) cudaEventDestroy(done);
    CheckCuda(recorded, what);
    return std::make_shared<NcclWork>(handle_, done, what, options_.timeout);
  }

  std::shared_ptr<NcclHandle> handle_;
  Group group_;
  NcclOptions options_;
  std::mutex issue_mutex_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t compute_ = nullptr;
  cudaEvent_t compute_ready_ = nullptr;
  cudaEvent_t drained_ = nullptr;
  int* barrier_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> ConnectNccl(const api::RankTable& table, int rank,
                                          std::shared_ptr<StoreClient> store,
                                          const NcclOptions& options) {
  Group world = Group::World(table, rank);
  const std::string what = "connecting NCCL: rank " + std::to_string(rank) + " of group " + world.Describe();
  CheckCuda(cudaSetDevice(options.device), "cudaSetDevice(" + std::to_string(options.device) + ")");
  auto handle = NcclHandle::StartInit(*store, "meshtrain/nccl/unique-id", world.size(), rank, what, options.timeout);
  handle->AwaitReady(what, "the " + std::to_string(world.size()) + " ranks did not all connect", options.timeout);
  return std::make_unique<NcclCommunicator>(std::move(handle), std::move(world), options);
}

void SetComputeStream(Communicator& communicator, cudaStream_t compute) {
  dynamic_cast<NcclCommunicator&>(communicator).set_compute(compute);
}

cudaStream_t CommStream(const Communicator& communicator) {
  return dynamic_cast<const NcclCommunicator&>(communicator).stream();
}

}  // namespace meshtrain::comm
