#include "worker/comm/nccl/nccl_collectives.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "worker/comm/nccl/nccl_handle.h"
#include "worker/runtime/cuda.h"
#include "worker/runtime/device_side.h"
#include "worker/runtime/memory.h"

namespace meshtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;
using nccl::NcclHandle;
using runtime::DeviceSide;

// How long a group destroyed with operations still queued lets them finish before it
// aborts its communicator.
constexpr milliseconds kPendingGrace{10'000};

void MakeCurrent(int device, const std::string& what) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) return;
  const cudaError_t set = cudaSetDevice(device);
  if (set != cudaSuccess) {
    cudaGetLastError();
    throw CommError(what + ": cudaSetDevice(" + std::to_string(device) + "): " + cudaGetErrorString(set));
  }
}

// The communicators of one world: the world's and those split from it, which Abort()
// ends together. Holds the CUDA backend whose timers time the operations.
class NcclWorld {
 public:
  NcclWorld(int device, milliseconds timeout)
      : device_(device), timeout_(timeout), backend_(runtime::cuda::MakeCudaBackend(device)) {}

  int device() const { return device_; }
  milliseconds timeout() const { return timeout_; }
  runtime::Backend& backend() { return *backend_; }

  void Add(const std::shared_ptr<NcclHandle>& handle) {
    std::lock_guard lock(mutex_);
    std::erase_if(handles_, [](const std::weak_ptr<NcclHandle>& h) { return h.expired(); });
    handles_.push_back(handle);
  }

  void AbortAll() {
    std::vector<std::shared_ptr<NcclHandle>> live;
    {
      std::lock_guard lock(mutex_);
      for (const std::weak_ptr<NcclHandle>& handle : handles_) {
        if (auto locked = handle.lock()) live.push_back(std::move(locked));
      }
    }
    for (const auto& handle : live) handle->Abort();
  }

 private:
  int device_;
  milliseconds timeout_;
  std::unique_ptr<runtime::Backend> backend_;
  std::mutex mutex_;
  std::vector<std::weak_ptr<NcclHandle>> handles_;
};

class NcclCollectives final : public StreamCollectives {
 public:
  NcclCollectives(std::shared_ptr<NcclWorld> world, std::shared_ptr<NcclHandle> handle, Group group)
      : world_(std::move(world)),
        handle_(std::move(handle)),
        group_(std::move(group)),
        all_gather_timer_(world_->backend().NewTimer()),
        reduce_scatter_timer_(world_->backend().NewTimer()),
        all_reduce_timer_(world_->backend().NewTimer()),
        send_timer_(world_->backend().NewTimer()),
        recv_timer_(world_->backend().NewTimer()),
        all_to_all_timer_(world_->backend().NewTimer()) {
    MakeCurrent(world_->device(), "group " + group_.Describe());
    const cudaError_t made = cudaEventCreateWithFlags(&last_done_, cudaEventDisableTiming);
    if (made != cudaSuccess) {
      cudaGetLastError();
      throw CommError("group " + group_.Describe() + ": cudaEventCreate: " + cudaGetErrorString(made));
    }
  }

  // Pending operations (the streams were not synchronized: an error path) get a grace,
  // then the communicator is aborted; otherwise it is closed. Never both, never a hang.
  ~NcclCollectives() override {
    CancelBatch();
    if (issued_ && cudaSetDevice(world_->device()) == cudaSuccess) {
      const Clock::time_point deadline = Clock::now() + std::min(kPendingGrace, world_->timeout());
      cudaError_t state;
      while ((state = cudaEventQuery(last_done_)) == cudaErrorNotReady && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (state == cudaErrorNotReady) handle_->Abort();
    }
    handle_->Close(NcclHandle::kCloseBound);
    cudaEventDestroy(last_done_);
    cudaGetLastError();
  }
  NcclCollectives(const NcclCollectives&) = delete;
  NcclCollectives& operator=(const NcclCollectives&) = delete;

  const Group& group() const override { return group_; }
  std::string Describe() const override { return "nccl"; }

  void AllGather(runtime::ConstDeviceBytes send, runtime::DeviceBytes recv, size_t count, DataType type,
                 runtime::Stream& stream) override {
    // In place when send is recv + rank * count, which NCCL recognises by the address.
    Issue("all_gather", count * size_t(size()) * ElementSize(type), count, type, stream, *all_gather_timer_,
          [&](ncclComm_t comm, cudaStream_t s) {
            return ncclAllGather(DeviceSide::Address(send), DeviceSide::Address(recv), count, nccl::NcclType(type),
                                 comm, s);
          });
  }

  void ReduceScatter(runtime::ConstDeviceBytes send, runtime::DeviceBytes recv, size_t count, DataType type,
                     ReduceOp op, runtime::Stream& stream) override {
    // In place when recv is send + rank * count.
    Issue(std::string("reduce_scatter(") + ReduceOpName(op) + ")", count * size_t(size()) * ElementSize(type), count,
          type, stream, *reduce_scatter_timer_, [&](ncclComm_t comm, cudaStream_t s) {
            return ncclReduceScatter(DeviceSide::Address(send), DeviceSide::Address(recv), count,
                                     nccl::NcclType(type), nccl::NcclOp(op, size()), comm, s);
          });
  }

  void AllReduce(runtime::ConstDeviceBytes send, runtime::DeviceBytes recv, size_t count, DataType type, ReduceOp op,
                 runtime::Stream& stream) override {
    Issue(std::string("all_reduce(") + ReduceOpName(op) + ")", count * ElementSize(type), count, type, stream,
          *all_reduce_timer_, [&](ncclComm_t comm, cudaStream_t s) {
            return ncclAllReduce(DeviceSide::Address(send), DeviceSide::Address(recv), count, nccl::NcclType(type),
                                 nccl::NcclOp(op, size()), comm, s);
          });
  }

  void Send(runtime::ConstDeviceBytes send, size_t count, DataType type, int peer, runtime::Stream& stream) override {
    CheckPeer(group_, peer, "send to");
    Issue("send to " + Peer(peer), count * ElementSize(type), count, type, stream, *send_timer_,
          [&](ncclComm_t comm, cudaStream_t s) {
            return ncclSend(DeviceSide::Address(send), count, nccl::NcclType(type), peer, comm, s);
          });
  }

  void Recv(runtime::DeviceBytes recv, size_t count, DataType type, int peer, runtime::Stream& stream) override {
    CheckPeer(group_, peer, "recv from");
    Issue("recv from " + Peer(peer), count * ElementSize(type), count, type, stream, *recv_timer_,
          [&](ncclComm_t comm, cudaStream_t s) {
            return ncclRecv(DeviceSide::Address(recv), count, nccl::NcclType(type), peer, comm, s);
          });
  }

  // One NCCL group of a send and a receive for every member with a block (GroupedAllToAll).
  void AllToAll(runtime::ConstDeviceBytes send, const std::vector<size_t>& send_counts,
                const std::vector<size_t>& send_offsets, runtime::DeviceBytes recv,
                const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_offsets, DataType type,
                runtime::Stream& stream) override {
    CheckAllToAll(group_, send_counts, send_offsets, recv_counts, recv_offsets);
    size_t total = 0;
    for (int p = 0; p < size(); ++p) total += send_counts[size_t(p)] + recv_counts[size_t(p)];
    const size_t element = ElementSize(type);
    Issue("all_to_all", total * element, total, type, stream, *all_to_all_timer_,
          [&](ncclComm_t comm, cudaStream_t s) {
            return nccl::GroupedAllToAll(reinterpret_cast<const char*>(DeviceSide::Address(send)), send_counts,
                                         send_offsets, reinterpret_cast<char*>(DeviceSide::Address(recv)), recv_counts,
                                         recv_offsets, element, nccl::NcclType(type), comm, s);
          });
  }

  void Reserve(size_t) override {}  // NCCL keeps its own buffers
  void Abort() override { AbortWorld(); }

  void BeginBatch() override {
    MakeCurrent(world_->device(), "a batch on group " + group_.Describe() + " (nccl)");
    handle_->BeginGroup("a batch on group " + group_.Describe() + " (nccl)");
    batch_ = Batch{};
    batching_ = true;
  }

  void EndBatch() override {
    if (!batching_) throw std::logic_error("EndBatch on group " + group_.Describe() + " without BeginBatch");
    batching_ = false;
    const std::string what = "a batch of " + std::to_string(batch_.operations) + " operations" +
                             (batch_.operations > 0 ? " (" + batch_.first + " first)" : "") + " on group " +
                             group_.Describe() + " (nccl)";
    handle_->EndGroup(what, world_->timeout());
    if (batch_.stream == nullptr) return;  // nothing was queued
    for (runtime::StreamTimer* timer : batch_.timed) timer->End(*batch_.stream);
    RecordDone(what, *batch_.stream);
  }

  void CancelBatch() noexcept override {
    if (!batching_) return;
    batching_ = false;
    handle_->CancelGroup();
    AbortWorld();
  }

  CollectiveSeconds Seconds() override {
    CollectiveSeconds seconds;
    seconds.all_gather = all_gather_timer_->Seconds();
    seconds.reduce_scatter = reduce_scatter_timer_->Seconds();
    seconds.all_reduce = all_reduce_timer_->Seconds();
    seconds.send = send_timer_->Seconds();
    seconds.recv = recv_timer_->Seconds();
    seconds.all_to_all = all_to_all_timer_->Seconds();
    return seconds;
  }

  // Every member of the world calls ncclCommSplit with its group's lowest rank as the
  // color, so the groups along the axis come out of one collective split.
  std::unique_ptr<StreamCollectives> SplitAxis(const api::ParallelLayout& layout, api::Axis axis) override {
    if (size() != layout.world()) {
      throw CommError("splitting on " + std::string(api::AxisName(axis)) + " needs the world (" +
                      std::to_string(layout.world()) + " ranks); group " + group_.Describe() + " is not it");
    }
    const std::vector<int> members = layout.GroupOf(axis, rank());
    const std::string name = std::string(api::AxisName(axis)) + "{" + api::FormatRanks(members) + "}";
    return Split(members.front(), members, name, "ncclCommSplit of group " + group_.Describe() + " into " + name);
  }

  // One collective ncclCommSplit of this group: the color is the index of the list
  // holding this member (NCCL_SPLIT_NOCOLOR for none: NCCL makes it no communicator).
  std::unique_ptr<StreamCollectives> SplitGroups(const std::vector<std::vector<int>>& groups,
                                                 const std::string& name) override {
    const std::string what = "splitting group " + group_.Describe() + " into ";
    const int mine = SplitGroupOf(groups, size(), rank(), what + name);
    if (mine < 0) {
      return Split(NCCL_SPLIT_NOCOLOR, {}, name, what + std::to_string(groups.size()) + " groups " + name +
                                                     " (none for this member) by ncclCommSplit");
    }
    const std::vector<int>& members = groups[size_t(mine)];
    const std::string child = SplitGroupName(group_, members, name);
    return Split(mine, members, child, "ncclCommSplit of group " + group_.Describe() + " into " + child);
  }

  void AbortWorld() { world_->AbortAll(); }

 private:
  // This member's part in one ncclCommSplit of this group: `color` tells its new group,
  // `members` (ranks here, increasing, this one among them), from the others; the key is
  // the rank here, so the new group keeps their order. Returns that group, named `name`,
  // or nullptr for NCCL_SPLIT_NOCOLOR.
  std::unique_ptr<StreamCollectives> Split(int color, const std::vector<int>& members, const std::string& name,
                                           const std::string& what_split) {
    const std::string what = what_split + " (nccl)";
    MakeCurrent(world_->device(), what);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    try {
      handle_->Run(what, world_->timeout(),
                   [&](ncclComm_t parent) { return ncclCommSplit(parent, color, rank(), &child, &config); });
    } catch (...) {
      nccl::AbortUnowned(child);
      throw;
    }
    if (color == NCCL_SPLIT_NOCOLOR) return nullptr;  // NCCL made this member none
    if (child == nullptr) throw CommError(what + ": NCCL made no communicator for this rank");
    auto child_handle = std::make_shared<NcclHandle>(child);
    world_->Add(child_handle);
    child_handle->AwaitReady(what, "the " + std::to_string(members.size()) + " members did not all join",
                             world_->timeout());
    return std::make_unique<NcclCollectives>(world_, std::move(child_handle), group_.Subgroup(name, members));
  }

  template <class Call>
  void Issue(const std::string& op, size_t bytes, size_t count, DataType type, runtime::Stream& stream,
             runtime::StreamTimer& timer, Call call) {
    const cudaStream_t s = runtime::cuda::StreamHandle(stream);  // std::logic_error for another backend's
    const std::string what = op + " of " + runtime::FormatBytes(bytes) + " " + DataTypeName(type) + " on group " +
                             group_.Describe() + " (nccl)";
    MakeCurrent(world_->device(), what);
    if (count == 0) {  // every member skips it alike; still report an earlier failure
      handle_->ThrowIfFailed(what);
      return;
    }
    if (batching_) {  // launched by EndBatch, which ends the timers begun here
      // Streams mixed in one NCCL group wait for each other: a batch keeps to one.
      if (batch_.stream != nullptr && batch_.stream != &stream) {
        throw std::logic_error(what + ": a batch's operations share one stream, and this one is on " + stream.name() +
                               ", not " + batch_.stream->name());
      }
      if (std::find(batch_.timed.begin(), batch_.timed.end(), &timer) == batch_.timed.end()) {
        timer.Begin(stream);
        batch_.timed.push_back(&timer);
      }
      handle_->Queue(what, [&](ncclComm_t comm) { return call(comm, s); });
      if (batch_.operations++ == 0) batch_.first = op;
      batch_.stream = &stream;
      return;
    }
    NcclHandle::RequireNoGroupOnThisThread(what);  // before the timer begins
    timer.Begin(stream);
    // Checks NCCL's asynchronous error first; returns once NCCL has enqueued the call.
    handle_->Run(what, world_->timeout(), [&](ncclComm_t comm) { return call(comm, s); });
    timer.End(stream);
    RecordDone(what, stream);
  }

  // "rank 5 (member 1)": a peer as errors name it.
  std::string Peer(int member) const {
    return "rank " + std::to_string(group_.GlobalRank(member)) + " (member " + std::to_string(member) + ")";
  }

  void RecordDone(const std::string& what, runtime::Stream& stream) {
    const cudaError_t recorded = cudaEventRecord(last_done_, runtime::cuda::StreamHandle(stream));
    if (recorded != cudaSuccess) {
      cudaGetLastError();
      throw CommError(what + ": cudaEventRecord on stream " + stream.name() + ": " + cudaGetErrorString(recorded));
    }
    issued_ = true;
  }

  // The operations queued since BeginBatch.
  struct Batch {
    int operations = 0;
    std::string first;                         // the first one's name
    runtime::Stream* stream = nullptr;         // theirs
    std::vector<runtime::StreamTimer*> timed;  // begun on it, to end after the launch
  };

  std::shared_ptr<NcclWorld> world_;
  std::shared_ptr<NcclHandle> handle_;
  Group group_;
  std::unique_ptr<runtime::StreamTimer> all_gather_timer_, reduce_scatter_timer_, all_reduce_timer_, send_timer_,
      recv_timer_, all_to_all_timer_;
  cudaEvent_t last_done_ = nullptr;  // after the last operation issued, on its stream
  bool issued_ = false;
  bool batching_ = false;
  Batch batch_;
};

}  // namespace

std::unique_ptr<StreamCollectives> ConnectNcclCollectives(const api::RankTable& table, int rank,
                                                          std::shared_ptr<StoreClient> store, int device,
                                                          std::chrono::milliseconds timeout) {
  Group world = Group::World(table, rank);
  const std::string what = "connecting NCCL: rank " + std::to_string(rank) + " of group " + world.Describe();
  auto shared = std::make_shared<NcclWorld>(device, timeout);  // makes `device` current
  // Not the Communicator's key (nccl_communicator.cc): a job may connect both.
  auto handle = NcclHandle::StartInit(*store, "meshtrain/nccl/collectives/unique-id", world.size(), rank, what,
                                      timeout);
  shared->Add(handle);
  handle->AwaitReady(what, "the " + std::to_string(world.size()) + " ranks did not all connect", timeout);
  return std::make_unique<NcclCollectives>(std::move(shared), std::move(handle), std::move(world));
}

}  // namespace meshtrain::comm
