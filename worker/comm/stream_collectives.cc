#include "worker/comm/stream_collectives.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <utility>

#include "worker/runtime/cpu_stream.h"
#include "worker/runtime/device_side.h"

namespace meshtrain::comm {
namespace {

using runtime::DeviceSide;
using Clock = std::chrono::steady_clock;

// Over a Communicator, from the host. On the CPU backend each operation is a task on the
// stream that runs the blocking collective on the device memory itself (host memory).
// On any other backend it is staged through pinned host memory at issue (the stream is
// synchronised first, so the result is in the stream's order), which is slow but lets
// ranks that share one GPU run every layout; there a Send is left running (pending_send_)
// until the next operation that needs its staging buffer.
class HostStreamCollectives final : public StreamCollectives {
 public:
  HostStreamCollectives(std::unique_ptr<Communicator> owned, Communicator* communicator, runtime::Backend* backend)
      : owned_(std::move(owned)),
        communicator_(communicator),
        backend_(backend),
        staged_(backend->device().is_cuda()),
        pinned_(&accounting_, backend->PinnedHostMemory()) {}

  ~HostStreamCollectives() override {
    try {
      FinishPendingSend();  // the communicator reads the staging buffer until then
    } catch (const std::exception&) {
      // A failed send: the group is going, and the peer's receive reports it.
    }
    for (void* p : {send_staging_, recv_staging_}) {
      if (p != nullptr) pinned_.Free(p);
    }
  }

  const Group& group() const override { return communicator_->group(); }
  std::string Describe() const override {
    return staged_ ? "staged through pinned host memory over the host communicator" : "host communicator";
  }

  void AllGather(runtime::ConstDeviceBytes send, runtime::DeviceBytes recv, size_t count, DataType type,
                 runtime::Stream& stream) override {
    const size_t block = count * ElementSize(type), total = block * size_t(size());
    Issue(stream, &seconds_.all_gather, block, total, send, recv,
          [=, this](const void* in, void* out) { communicator_->AllGather(in, out, count, type)->Wait(); },
          /*send_in_recv=*/DeviceSide::Address(send) == DeviceSide::Address(recv) + size_t(rank()) * block);
  }

  void ReduceScatter(runtime::ConstDeviceBytes send, runtime::DeviceBytes recv, size_t count, DataType type,
                     ReduceOp op, runtime::Stream& stream) override {
    const size_t block = count * ElementSize(type), total = block * size_t(size());
    Issue(stream, &seconds_.reduce_scatter, total, block, send, recv,
          [=, this](const void* in, void* out) { communicator_->ReduceScatter(in, out, count, type, op)->Wait(); },
          false);
  }

  void AllReduce(runtime::ConstDeviceBytes send, runtime::DeviceBytes recv, size_t count, DataType type, ReduceOp op,
                 runtime::Stream& stream) override {
    const size_t bytes = count * ElementSize(type);
    Issue(stream, &seconds_.all_reduce, bytes, bytes, send, recv,
          [=, this](const void* in, void* out) { communicator_->AllReduce(in, out, count, type, op)->Wait(); }, false);
  }

  void AllToAll(runtime::ConstDeviceBytes send, const std::vector<size_t>& send_counts,
                const std::vector<size_t>& send_offsets, runtime::DeviceBytes recv,
                const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_offsets, DataType type,
                runtime::Stream& stream) override {
    const auto [send_span, recv_span] = CheckAllToAll(group(), send_counts, send_offsets, recv_counts, recv_offsets);
    const size_t element = ElementSize(type);
    Issue(stream, &seconds_.all_to_all, send_span * element, recv_span * element, send, recv,
          [=, this](const void* in, void* out) {
            communicator_->AllToAll(in, send_counts, send_offsets, out, recv_counts, recv_offsets, type)->Wait();
          },
          false);
  }

  void Send(runtime::ConstDeviceBytes send, size_t count, DataType type, int peer, runtime::Stream& stream) override {
    CheckPeer(group(), peer, "send to");
    const size_t bytes = count * ElementSize(type);
    if (!staged_) {
      Issue(stream, &seconds_.send, bytes, 0, send, nullptr,
            [=, this](const void* in, void*) { communicator_->Send(in, count, type, peer)->Wait(); }, false);
      return;
    }
    // Staged: once in pinned memory the message leaves the stream's order, and the
    // communicator sends it while the host goes on. Its seconds are the host's: this
    // issue, and any wait for it to finish.
    RequireReserved(bytes);
    const Clock::time_point start = Clock::now();
    FinishPendingSend();
    stream.Synchronize();
    if (bytes > 0) {
      backend_->CopyToHost(send_staging_, send, bytes, stream);
      stream.Synchronize();
    }
    pending_send_ = communicator_->Send(send_staging_, count, type, peer);
    std::lock_guard lock(mutex_);
    seconds_.send += std::chrono::duration<double>(Clock::now() - start).count();
  }

  void Recv(runtime::DeviceBytes recv, size_t count, DataType type, int peer, runtime::Stream& stream) override {
    CheckPeer(group(), peer, "recv from");
    const size_t bytes = count * ElementSize(type);
    Issue(stream, &seconds_.recv, 0, bytes, nullptr, recv,
          [=, this](const void*, void* out) { communicator_->Recv(out, count, type, peer)->Wait(); }, false);
  }

  void Reserve(size_t bytes) override {
    if (!staged_ || bytes <= reserved_) return;
    FinishPendingSend();
    for (void** p : {&send_staging_, &recv_staging_}) {
      if (*p != nullptr) pinned_.Free(*p);
      *p = pinned_.Allocate(bytes, runtime::MemoryCategory::kComm);
    }
    reserved_ = bytes;
  }

  CollectiveSeconds Seconds() override {
    std::lock_guard lock(mutex_);
    return seconds_;
  }

  void Abort() override {}  // every operation is bounded by the communicator's own timeout

  std::unique_ptr<StreamCollectives> SplitAxis(const api::ParallelLayout& layout, api::Axis axis) override {
    std::unique_ptr<Communicator> group = communicator_->SplitAxis(layout, axis);
    if (group == nullptr) return nullptr;
    Communicator* borrowed = group.get();
    return std::make_unique<HostStreamCollectives>(std::move(group), borrowed, backend_);
  }

  // Communicator::NewGroup for every list, in order: each is a split of its own on a
  // backend that splits collectively (NCCL's host communicator).
  std::unique_ptr<StreamCollectives> SplitGroups(const std::vector<std::vector<int>>& groups,
                                                 const std::string& name) override {
    const int mine = SplitGroupOf(groups, size(), rank(), "splitting group " + group().Describe() + " into " + name);
    std::unique_ptr<Communicator> kept;
    for (size_t g = 0; g < groups.size(); ++g) {
      std::unique_ptr<Communicator> made = communicator_->NewGroup(groups[g], SplitGroupName(group(), groups[g], name));
      if (int(g) == mine) kept = std::move(made);
    }
    if (kept == nullptr) return nullptr;
    Communicator* borrowed = kept.get();
    return std::make_unique<HostStreamCollectives>(std::move(kept), borrowed, backend_);
  }

 private:
  // Runs `collective` (in, out) on the host, in `stream`'s order: a task on a CPU stream,
  // or staged through pinned memory (send_bytes in, recv_bytes out). With send_in_recv
  // the send buffer is part of the receive buffer (an in-place all-gather).
  template <class F>
  void Issue(runtime::Stream& stream, double* seconds, size_t send_bytes, size_t recv_bytes,
             runtime::ConstDeviceBytes send, runtime::DeviceBytes recv, F collective,
             bool send_in_recv) {
    auto timed = [this, seconds](auto&& run) {
      const Clock::time_point start = Clock::now();
      run();
      std::lock_guard lock(mutex_);
      *seconds += std::chrono::duration<double>(Clock::now() - start).count();
    };
    if (!staged_) {
      runtime::CpuStream::Of(stream).Enqueue(
          [in = DeviceSide::Address(send), out = DeviceSide::Address(recv), collective, timed] {
            timed([&] { collective(in, out); });
          });
      return;
    }
    RequireReserved(std::max(send_bytes, recv_bytes));
    if (send_bytes > 0) FinishPendingSend();  // a Recv leaves a pending Send's buffer alone
    stream.Synchronize();
    const size_t rank_offset = recv_bytes / size_t(size()) * size_t(rank());
    char* in = static_cast<char*>(send_staging_);
    char* out = static_cast<char*>(recv_staging_);
    if (send_in_recv) in = out + rank_offset;
    if (send_bytes > 0) {
      backend_->CopyToHost(in, send, send_bytes, stream);
      stream.Synchronize();
    }
    timed([&] { collective(in, out); });
    if (recv_bytes > 0) {
      backend_->CopyFromHost(recv, out, recv_bytes, stream);
      stream.Synchronize();  // the staging buffers are free again
    }
  }

  void RequireReserved(size_t bytes) const {
    if (bytes > reserved_) {
      throw std::logic_error("staged collectives over " + group().Describe() + ": a message of " +
                             std::to_string(bytes) + " bytes was not reserved (" + std::to_string(reserved_) + ")");
    }
  }

  // Waits for the staged Send still reading the send staging buffer, if any; throws its
  // failure.
  void FinishPendingSend() {
    if (pending_send_ == nullptr) return;
    std::shared_ptr<Work> send = std::move(pending_send_);
    pending_send_ = nullptr;
    const Clock::time_point start = Clock::now();
    send->Wait();
    std::lock_guard lock(mutex_);
    seconds_.send += std::chrono::duration<double>(Clock::now() - start).count();
  }

  std::unique_ptr<Communicator> owned_;
  Communicator* communicator_;
  runtime::Backend* backend_;
  const bool staged_;
  runtime::MemoryAccounting accounting_;  // the staging buffers; not the engine's device memory
  runtime::CachingAllocator pinned_;
  void* send_staging_ = nullptr;
  void* recv_staging_ = nullptr;
  size_t reserved_ = 0;
  std::shared_ptr<Work> pending_send_;  // a staged Send still reading send_staging_
  std::mutex mutex_;
  CollectiveSeconds seconds_;
};

}  // namespace

int SplitGroupOf(const std::vector<std::vector<int>>& groups, int size, int rank, const std::string& what) {
  std::set<int> seen;
  int mine = -1;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<int>& members = groups[g];
    auto fail = [&](const std::string& why) {
      throw std::invalid_argument(what + ": list " + std::to_string(g) + " (" +
                                  (members.empty() ? std::string("empty") : api::FormatRanks(members)) + ") " + why);
    };
    if (members.empty()) fail("has no members");
    for (size_t i = 0; i < members.size(); ++i) {
      const int m = members[i];
      if (m < 0 || m >= size) fail("names rank " + std::to_string(m) + ", outside 0.." + std::to_string(size - 1));
      if (i > 0 && m <= members[i - 1]) fail("is not increasing");
      if (!seen.insert(m).second) fail("repeats rank " + std::to_string(m) + " of an earlier list");
      if (m == rank) mine = int(g);
    }
  }
  return mine;
}

void CheckPeer(const Group& group, int peer, const char* op) {
  if (peer < 0 || peer >= group.size() || peer == group.rank()) {
    throw std::invalid_argument(std::string(op) + " member " + std::to_string(peer) + " on group " +
                                group.Describe() + ": not another member (members 0.." +
                                std::to_string(group.size() - 1) + ", this one " + std::to_string(group.rank()) +
                                ")");
  }
}

std::pair<size_t, size_t> CheckAllToAll(const Group& group, const std::vector<size_t>& send_counts,
                                        const std::vector<size_t>& send_offsets,
                                        const std::vector<size_t>& recv_counts,
                                        const std::vector<size_t>& recv_offsets) {
  const size_t n = size_t(group.size());
  for (const auto* list : {&send_counts, &send_offsets, &recv_counts, &recv_offsets}) {
    if (list->size() != n) {
      throw std::invalid_argument("all-to-all on group " + group.Describe() + ": a list of " +
                                  std::to_string(list->size()) + " counts or offsets for " + std::to_string(n) +
                                  " members");
    }
  }
  size_t send_span = 0, recv_span = 0;
  for (size_t p = 0; p < n; ++p) {
    send_span = std::max(send_span, send_offsets[p] + send_counts[p]);
    recv_span = std::max(recv_span, recv_offsets[p] + recv_counts[p]);
  }
  return {send_span, recv_span};
}

std::string SplitGroupName(const Group& parent, const std::vector<int>& members, const std::string& name) {
  std::vector<int> global;
  for (int m : members) global.push_back(parent.GlobalRank(m));
  return name + "{" + api::FormatRanks(global) + "}";
}

std::unique_ptr<StreamCollectives> HostCollectives(std::unique_ptr<Communicator> owned, runtime::Backend* backend) {
  Communicator* communicator = owned.get();
  return std::make_unique<HostStreamCollectives>(std::move(owned), communicator, backend);
}

std::unique_ptr<StreamCollectives> HostCollectives(Communicator* borrowed, runtime::Backend* backend) {
  return std::make_unique<HostStreamCollectives>(nullptr, borrowed, backend);
}

}  // namespace meshtrain::comm
