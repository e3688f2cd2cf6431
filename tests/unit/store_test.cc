// The rendezvous Store over real TCP on 127.0.0.1.

#include "worker/comm/store.h"

#include <atomic>
#include <future>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace meshtrain::comm {
namespace {

using namespace std::chrono_literals;

std::string Address(const StoreServer& server) { return "127.0.0.1:" + std::to_string(server.port()); }

std::string ErrorOf(const std::function<void()>& call) {
  try {
    call();
  } catch (const StoreError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Store, SetGetAddCheckAndBinaryValues) {
  StoreServer server("127.0.0.1", 0);
  StoreClient client(Address(server), 5s);
  const std::string binary("a\0b\xff", 4);
  client.Set("endpoint/0", binary);
  EXPECT_EQ(client.Get("endpoint/0", 1s), binary);
  EXPECT_TRUE(client.Check("endpoint/0"));
  EXPECT_FALSE(client.Check("endpoint/1"));
  EXPECT_EQ(client.Add("counter", 5), 5);
  EXPECT_EQ(client.Add("counter", -2), 3);
  EXPECT_EQ(client.Get("counter", 1s), "3");
  client.Set("endpoint/0", "replaced");
  EXPECT_EQ(client.Get("endpoint/0", 1s), "replaced");
}

TEST(Store, GetAndWaitBlockUntilAnotherClientSets) {
  StoreServer server("127.0.0.1", 0);
  StoreClient waiter(Address(server), 5s), setter(Address(server), 5s);
  auto value = std::async(std::launch::async, [&] { return waiter.Get("nccl/unique-id", 10s); });
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(value.wait_for(0ms), std::future_status::timeout);
  setter.Set("nccl/unique-id", "id-123");
  EXPECT_EQ(value.get(), "id-123");
  auto both = std::async(std::launch::async, [&] { waiter.Wait({"a", "b"}, 10s); });
  setter.Set("a", "1");
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(both.wait_for(0ms), std::future_status::timeout);
  setter.Set("b", "2");
  both.get();
}

TEST(Store, TimeoutsNameTheOperationKeyAndCoordinator) {
  StoreServer server("127.0.0.1", 0);
  StoreClient client(Address(server), 5s);
  const auto start = std::chrono::steady_clock::now();
  const std::string error = ErrorOf([&] { client.Get("missing", 200ms); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  EXPECT_EQ(error, "store get(\"missing\") at coordinator " + Address(server) + ": timed out after 200 ms");
  EXPECT_NE(ErrorOf([&] { client.Wait({"x", "y"}, 100ms); }).find("wait(\"x\", \"y\")"), std::string::npos);
  client.Set("still", "works");  // a timed-out wait leaves the connection usable
  EXPECT_EQ(client.Get("still", 1s), "works");
}

TEST(Store, AddIsAtomicAcrossClients) {
  StoreServer server("127.0.0.1", 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      StoreClient client(Address(server), 5s);
      for (int i = 0; i < 100; ++i) client.Add("hits", 1);
    });
  }
  for (auto& t : threads) t.join();
  StoreClient client(Address(server), 5s);
  EXPECT_EQ(client.Add("hits", 0), 800);
}

TEST(Store, BarrierReleasesEveryoneAndCanBeReused) {
  StoreServer server("127.0.0.1", 0);
  constexpr int kWorld = 4;
  std::atomic<int> passed = 0;
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      StoreClient client(Address(server), 5s);
      for (int round = 0; round < 3; ++round) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5 * r));
        client.Barrier("step", kWorld, 10s);
        ++passed;
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(passed, 3 * kWorld);
}

TEST(Store, BarrierTimeoutSaysHowManyArrived) {
  StoreServer server("127.0.0.1", 0);
  StoreClient a(Address(server), 5s);
  EXPECT_EQ(ErrorOf([&] { a.Barrier("init", 3, 150ms); }),
            "barrier \"init\" at coordinator " + Address(server) + " timed out after 150 ms: 1 of 3 ranks arrived");
}

TEST(Store, UnreachableCoordinatorFailsAfterTheTimeout) {
  uint16_t unused;
  {
    StoreServer probe("127.0.0.1", 0);
    unused = probe.port();
  }
  const auto start = std::chrono::steady_clock::now();
  const std::string error = ErrorOf([&] { StoreClient client("127.0.0.1:" + std::to_string(unused), 300ms); });
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_NE(error.find("cannot reach the coordinator at 127.0.0.1:" + std::to_string(unused) + " within 300 ms"),
            std::string::npos)
      << error;
  EXPECT_LT(took, 3s);
  EXPECT_NE(ErrorOf([] { StoreClient client("no-port", 100ms); }).find("is not host:port"), std::string::npos);
}

TEST(Store, ACoordinatorThatStopsFailsWaitingClients) {
  auto server = std::make_unique<StoreServer>("127.0.0.1", 0);
  StoreClient client(Address(*server), 5s);
  const std::string address = Address(*server);
  auto waiting = std::async(std::launch::async, [&] { return ErrorOf([&] { client.Get("never", 30s); }); });
  std::this_thread::sleep_for(50ms);
  server.reset();
  ASSERT_EQ(waiting.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(waiting.get(), "store get(\"never\") at coordinator " + address +
                               ": the coordinator closed the connection (it stopped or died)");
  EXPECT_NE(ErrorOf([&] { client.Set("k", "v"); }).find("the connection was lost earlier"), std::string::npos);
}

}  // namespace
}  // namespace meshtrain::comm
