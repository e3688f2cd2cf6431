#include "worker/comm/nccl/nccl_communicator.h"

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "worker/runtime/memory.h"

namespace meshtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t NcclType(DataType type) {
  switch (type) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
  }
  return ncclFloat32;
}

void CheckCuda(cudaError_t result, const std::string& what) {
  if (result != cudaSuccess) throw CommError(what + ": " + cudaGetErrorString(result));
}

// NCCL calls on a non-blocking communicator may answer ncclInProgress; that is fine.
void CheckNccl(ncclResult_t result, const std::string& what) {
  if (result != ncclSuccess && result != ncclInProgress) {
    throw CommError(what + ": " + ncclGetErrorString(result));
  }
}

// Waits until `comm` has finished initialising (or splitting), up to `timeout`.
void AwaitReady(ncclComm_t comm, milliseconds timeout, const std::string& what) {
  Clock::time_point deadline = Clock::now() + timeout;
  for (;;) {
    ncclResult_t state = ncclInProgress;
    CheckNccl(ncclCommGetAsyncError(comm, &state), what);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) throw CommError(what + ": " + ncclGetErrorString(state));
    if (Clock::now() > deadline) {
      ncclCommAbort(comm);
      throw CommError(what + ": not ready after " + std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

class NcclWork : public Work {
 public:
  NcclWork(ncclComm_t comm, cudaEvent_t event, std::string what, milliseconds op_timeout)
      : comm_(comm), event_(event), what_(std::move(what)), op_timeout_(op_timeout),
        started_(Clock::now()) {}
  ~NcclWork() override { cudaEventDestroy(event_); }

  void Wait(milliseconds timeout) override {
    Clock::time_point deadline = std::min(Clock::now() + timeout, started_ + op_timeout_);
    for (;;) {
      cudaError_t query = cudaEventQuery(event_);
      if (query == cudaSuccess) return;
      if (query != cudaErrorNotReady) CheckCuda(query, what_);
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        throw CommError(what_ + ": " + ncclGetErrorString(state));
      }
      if (Clock::now() > deadline) {
        if (Clock::now() > started_ + op_timeout_) {
          ncclCommAbort(comm_);  // a stuck peer: free the GPU, fail every later call
          throw CommError(what_ + ": timed out after " + std::to_string(op_timeout_.count()) +
                          " ms; the communicator was aborted");
        }
        throw CommError(what_ + ": not finished after " + std::to_string(timeout.count()) +
                        " ms of waiting");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  bool IsCompleted() override { return cudaEventQuery(event_) == cudaSuccess; }
  cudaEvent_t event() const { return event_; }

 private:
  ncclComm_t comm_;
  cudaEvent_t event_;
  std::string what_;
  milliseconds op_timeout_;
  Clock::time_point started_;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, Group group, NcclOptions options)
      : comm_(comm), group_(std::move(group)), options_(options) {
    CheckCuda(cudaSetDevice(options_.device), "cudaSetDevice");
    CheckCuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating the comm stream");
    CheckCuda(cudaMalloc(&barrier_, sizeof(int)), "allocating the barrier word");
  }
  ~NcclCommunicator() override {
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
    cudaFree(barrier_);
    cudaStreamDestroy(stream_);
  }

  const Group& group() const override { return group_; }
  cudaStream_t stream() const { return stream_; }
  void set_compute(cudaStream_t compute) { compute_ = compute; }

  std::shared_ptr<Work> AllGather(const void* send, void* recv, size_t count, DataType type) override {
    return Issue("all_gather", count * size() * ElementSize(type), type, [&] {
      return ncclAllGather(send, recv, count, NcclType(type), comm_, stream_);
    });
  }
  std::shared_ptr<Work> ReduceScatter(const void* send, void* recv, size_t count, DataType type,
                                      ReduceOp op) override {
    return Issue(std::string("reduce_scatter(") + ReduceOpName(op) + ")", count * size() * ElementSize(type), type, [&] {
      return ncclReduceScatter(send, recv, count, NcclType(type), Op(op), comm_, stream_);
    });
  }
  std::shared_ptr<Work> AllReduce(const void* send, void* recv, size_t count, DataType type,
                                  ReduceOp op) override {
    return Issue(std::string("all_reduce(") + ReduceOpName(op) + ")", count * ElementSize(type), type, [&] {
      return ncclAllReduce(send, recv, count, NcclType(type), Op(op), comm_, stream_);
    });
  }
  std::shared_ptr<Work> Broadcast(const void* send, void* recv, size_t count, DataType type,
                                  int root) override {
    return Issue("broadcast(root " + std::to_string(root) + ")", count * ElementSize(type), type, [&] {
      return ncclBroadcast(send, recv, count, NcclType(type), root, comm_, stream_);
    });
  }
  std::shared_ptr<Work> Barrier() override {
    return Issue("barrier", 0, DataType::kInt32, [&] {
      return ncclAllReduce(barrier_, barrier_, 1, ncclInt32, ncclSum, comm_, stream_);
    });
  }
  std::shared_ptr<Work> Send(const void* buf, size_t count, DataType type, int peer) override {
    return Issue("send to " + std::to_string(peer), count * ElementSize(type), type, [&] {
      return ncclSend(buf, count, NcclType(type), peer, comm_, stream_);
    });
  }
  std::shared_ptr<Work> Recv(void* buf, size_t count, DataType type, int peer) override {
    return Issue("recv from " + std::to_string(peer), count * ElementSize(type), type, [&] {
      return ncclRecv(buf, count, NcclType(type), peer, comm_, stream_);
    });
  }

  void* AllocateBuffer(size_t bytes) override {
    void* memory = nullptr;
    CheckCuda(cudaMalloc(&memory, bytes), "cudaMalloc of " + runtime::FormatBytes(bytes));
    return memory;
  }
  void FreeBuffer(void* buffer) override { cudaFree(buffer); }

  std::unique_ptr<Communicator> NewGroup(const std::vector<int>& members,
                                         const std::string& name) override {
    bool member = std::find(members.begin(), members.end(), rank()) != members.end();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    std::string what = "ncclCommSplit for group " + name;
    CheckNccl(ncclCommSplit(comm_, member ? members.front() : NCCL_SPLIT_NOCOLOR, rank(), &child, &config), what);
    AwaitReady(comm_, options_.timeout, what);
    if (!member) return nullptr;
    AwaitReady(child, options_.timeout, what);
    return std::make_unique<NcclCommunicator>(child, group_.Subgroup(name, members), options_);
  }

 private:
  static ncclRedOp_t Op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclAvg; }

  template <class Call>
  std::shared_ptr<Work> Issue(const std::string& op, size_t bytes, DataType type, Call call) {
    std::string what = op + " of " + runtime::FormatBytes(bytes) + " " + DataTypeName(type) +
                       " on group " + group_.Describe() + " (nccl)";
    if (compute_ != nullptr) {  // inputs come from compute: wait for it on the GPU
      cudaEvent_t ready;
      CheckCuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), what);
      CheckCuda(cudaEventRecord(ready, compute_), what);
      CheckCuda(cudaStreamWaitEvent(stream_, ready, 0), what);
      cudaEventDestroy(ready);
    }
    CheckNccl(call(), what);
    cudaEvent_t done;
    CheckCuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), what);
    CheckCuda(cudaEventRecord(done, stream_), what);
    return std::make_shared<NcclWork>(comm_, done, what, options_.timeout);
  }

  ncclComm_t comm_;
  Group group_;
  NcclOptions options_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t compute_ = nullptr;
  int* barrier_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> ConnectNccl(const api::RankTable& table, int rank,
                                          std::shared_ptr<StoreClient> store,
                                          const NcclOptions& options) {
  Group world = Group::World(table, rank);
  CheckCuda(cudaSetDevice(options.device), "cudaSetDevice(" + std::to_string(options.device) + ")");
  ncclUniqueId id;
  const std::string key = "meshtrain/nccl/unique-id";
  if (rank == 0) {
    CheckNccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    store->Set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  } else {
    std::string bytes = store->Get(key, options.timeout);
    if (bytes.size() != sizeof(id)) throw CommError("the NCCL unique id in the Store has the wrong size");
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  std::string what = "ncclCommInitRankConfig (rank " + std::to_string(rank) + " of " +
                     std::to_string(world.size()) + ")";
  CheckNccl(ncclCommInitRankConfig(&comm, world.size(), id, rank, &config), what);
  AwaitReady(comm, options.timeout, what);
  return std::make_unique<NcclCommunicator>(comm, std::move(world), options);
}

void SetComputeStream(Communicator& communicator, cudaStream_t compute) {
  dynamic_cast<NcclCommunicator&>(communicator).set_compute(compute);
}

cudaStream_t CommStream(const Communicator& communicator) {
  return dynamic_cast<const NcclCommunicator&>(communicator).stream();
}

}  // namespace meshtrain::comm
