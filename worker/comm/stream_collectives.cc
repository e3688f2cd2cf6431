#include "worker/comm/stream_collectives.h"

#include <algorithm>
#include <chrono>
#include <mutex>
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
// ranks that share one GPU run every layout.
class HostStreamCollectives final : public StreamCollectives {
 public:
  HostStreamCollectives(std::unique_ptr<Communicator> owned, Communicator* communicator, runtime::Backend* backend)
      : owned_(std::move(owned)),
        communicator_(communicator),
        backend_(backend),
        staged_(backend->device().is_cuda()),
        pinned_(&accounting_, backend->PinnedHostMemory()) {}

  ~HostStreamCollectives() override {
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

  void Reserve(size_t bytes) override {
    if (!staged_ || bytes <= reserved_) return;
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
    const size_t needed = std::max(send_bytes, recv_bytes);
    if (needed > reserved_) {
      throw std::logic_error("staged collectives over " + group().Describe() + ": a message of " +
                             std::to_string(needed) + " bytes was not reserved (" + std::to_string(reserved_) + ")");
    }
    stream.Synchronize();
    const size_t rank_offset = recv_bytes / size_t(size()) * size_t(rank());
    char* in = static_cast<char*>(send_staging_);
    char* out = static_cast<char*>(recv_staging_);
    if (send_in_recv) in = out + rank_offset;
    backend_->CopyToHost(in, send, send_bytes, stream);
    stream.Synchronize();
    timed([&] { collective(in, out); });
    backend_->CopyFromHost(recv, out, recv_bytes, stream);
    stream.Synchronize();  // the staging buffers are free again
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
  std::mutex mutex_;
  CollectiveSeconds seconds_;
};

}  // namespace

std::unique_ptr<StreamCollectives> HostCollectives(std::unique_ptr<Communicator> owned, runtime::Backend* backend) {
  Communicator* communicator = owned.get();
  return std::make_unique<HostStreamCollectives>(std::move(owned), communicator, backend);
}

std::unique_ptr<StreamCollectives> HostCollectives(Communicator* borrowed, runtime::Backend* backend) {
  return std::make_unique<HostStreamCollectives>(nullptr, borrowed, backend);
}

}  // namespace meshtrain::comm
