// The batch contract of StreamCollectives (stream_collectives.h): Batched() begins and
// ends a batch around what it issues, and cancels it when that throws. NCCL's grouped
// calls behind it are tested on a GPU (tests/gpu/nccl_test.cc).

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "worker/comm/stream_collectives.h"

namespace meshtrain::comm {
namespace {

// Records the calls made on it, in order.
class RecordingCollectives final : public StreamCollectives {
 public:
  std::vector<std::string> calls;

  const Group& group() const override { return group_; }
  std::string Describe() const override { return "recording"; }
  void AllGather(runtime::ConstDeviceBytes, runtime::DeviceBytes, size_t, DataType, runtime::Stream&) override {
    calls.push_back("all_gather");
  }
  void ReduceScatter(runtime::ConstDeviceBytes, runtime::DeviceBytes, size_t, DataType, ReduceOp,
                     runtime::Stream&) override {
    calls.push_back("reduce_scatter");
  }
  void AllReduce(runtime::ConstDeviceBytes, runtime::DeviceBytes, size_t, DataType, ReduceOp,
                 runtime::Stream&) override {
    calls.push_back("all_reduce");
  }
  void AllToAll(runtime::ConstDeviceBytes, const std::vector<size_t>&, const std::vector<size_t>&, runtime::DeviceBytes,
                const std::vector<size_t>&, const std::vector<size_t>&, DataType, runtime::Stream&) override {
    calls.push_back("all_to_all");
  }
  void Send(runtime::ConstDeviceBytes, size_t, DataType, int, runtime::Stream&) override { calls.push_back("send"); }
  void Recv(runtime::DeviceBytes, size_t, DataType, int, runtime::Stream&) override { calls.push_back("recv"); }
  void BeginBatch() override { calls.push_back("begin"); }
  void EndBatch() override { calls.push_back("end"); }
  void CancelBatch() noexcept override { calls.push_back("cancel"); }
  void Reserve(size_t) override {}
  CollectiveSeconds Seconds() override { return {}; }
  void Abort() override {}
  std::unique_ptr<StreamCollectives> SplitAxis(const api::ParallelLayout&, api::Axis) override { return nullptr; }
  std::unique_ptr<StreamCollectives> SplitGroups(const std::vector<std::vector<int>>&, const std::string&) override {
    return nullptr;
  }

 private:
  Group group_{"world", {0}, {0}, 0};
};

TEST(StreamCollectives, BatchedBeginsAndEndsABatchAroundWhatItIssues) {
  RecordingCollectives group;
  int issued = 0;
  Batched(&group, [&] {
    group.calls.push_back("all_reduce");
    group.calls.push_back("all_reduce");
    ++issued;
  });
  EXPECT_EQ(issued, 1);
  EXPECT_EQ(group.calls, (std::vector<std::string>{"begin", "all_reduce", "all_reduce", "end"}));
}

TEST(StreamCollectives, ABatchWhoseIssueThrowsIsCancelledAndNotEnded) {
  RecordingCollectives group;
  EXPECT_THROW(Batched(&group,
                       [&] {
                         group.calls.push_back("all_reduce");
                         throw CommError("all_reduce failed");
                       }),
               CommError);
  EXPECT_EQ(group.calls, (std::vector<std::string>{"begin", "all_reduce", "cancel"}));
}

TEST(StreamCollectives, WithoutAGroupBatchedOnlyRunsTheIssue) {
  int issued = 0;
  Batched(nullptr, [&] { ++issued; });
  EXPECT_EQ(issued, 1);
}

}  // namespace
}  // namespace meshtrain::comm
