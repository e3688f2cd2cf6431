// The nccl backend at world size 1 on a lent GPU (skipped, and saying so, elsewhere).

#include <gtest/gtest.h>
#include <cuda_runtime_api.h>

#include <vector>

#include "tests/support/gpu.h"
#include "worker/comm/nccl/nccl_communicator.h"
#include "worker/comm/store.h"
#include "worker/launch/local_launcher.h"

namespace meshtrain::comm {
namespace {

TEST(NcclCommunicator, EveryOperationAtWorldSizeOne) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  StoreServer server("127.0.0.1", 0);
  auto store = std::make_shared<StoreClient>("127.0.0.1:" + std::to_string(server.port()), milliseconds(2000));
  auto world = ConnectNccl(launch::VirtualRankTable(1, 1), 0, store, NcclOptions{0, milliseconds(30000)});
  const size_t count = 1 << 20;
  std::vector<float> host(count), back(count);
  for (size_t i = 0; i < count; ++i) host[i] = 0.25f * static_cast<float>(i % 1000) - 7.0f;
  auto* send = static_cast<float*>(world->AllocateBuffer(count * 4));
  auto* recv = static_cast<float*>(world->AllocateBuffer(count * 4));
  ASSERT_EQ(cudaMemcpy(send, host.data(), count * 4, cudaMemcpyHostToDevice), cudaSuccess);
  auto check = [&](const char* what) {
    ASSERT_EQ(cudaMemcpy(back.data(), recv, count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(back, host) << what;
    ASSERT_EQ(cudaMemset(recv, 0, count * 4), cudaSuccess);
  };
  world->AllReduce(send, recv, count, DataType::kFloat32, ReduceOp::kSum)->Wait();
  check("all_reduce");
  world->AllReduce(send, recv, count, DataType::kFloat32, ReduceOp::kAverage)->Wait();
  check("all_reduce avg");
  world->AllGather(send, recv, count, DataType::kFloat32)->Wait();
  check("all_gather");
  world->ReduceScatter(send, recv, count, DataType::kFloat32, ReduceOp::kSum)->Wait();
  check("reduce_scatter");
  world->Broadcast(send, recv, count, DataType::kFloat32, 0)->Wait();
  check("broadcast");
  world->Barrier()->Wait();
  auto alone = world->NewGroup({0}, "alone");
  ASSERT_NE(alone, nullptr);
  alone->AllReduce(send, recv, count, DataType::kFloat32, ReduceOp::kSum)->Wait();
  check("all_reduce on a split group");
  world->FreeBuffer(send);
  world->FreeBuffer(recv);
}

}  // namespace
}  // namespace meshtrain::comm
