// The rendezvous Store over real TCP on 127.0.0.1.

#include "worker/comm/store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/support/store_intruder.h"

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

// A socket listening on a free port of 127.0.0.1, "127.0.0.1:PORT" into *address, that
// only the test answers (or nothing does); -1 if it cannot listen.
int Listener(std::string* address) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  socklen_t len = sizeof addr;
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(listener);
    return -1;
  }
  *address = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  return listener;
}

// A stopped coordinator: the kernel accepts the connection and takes the request, and no
// reply ever comes. A set with a patience (a heartbeat's) fails once it has passed.
TEST(Store, ASetWithAPatienceFailsWhenTheCoordinatorDoesNotAnswer) {
  std::string address;
  const int listener = Listener(&address);
  ASSERT_GE(listener, 0);
  StoreClient client(address, 5s);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NE(ErrorOf([&] { client.Set("heartbeat/1", "1 training 0", 300ms); }).find(": no reply within "),
            std::string::npos);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 2s);
  ::close(listener);
}

// The same stopped coordinator met on connecting: the kernel accepts, the challenge never
// comes, and the handshake fails by the connect deadline (a heartbeat's reconnect relies on
// it), not after the coordinator's 10 s allowance for a client's handshake.
TEST(Store, AHandshakeThatIsNotAnsweredFailsByTheConnectDeadline) {
  std::string address;
  const int listener = Listener(&address);
  ASSERT_GE(listener, 0);
  const auto start = std::chrono::steady_clock::now();
  const std::string error = ErrorOf([&] { StoreClient client(address, 300ms, std::string(32, 'k')); });
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_NE(error.find("authentication at coordinator " + address + ": no reply within "), std::string::npos)
      << error;
  EXPECT_GE(took, 100ms);
  EXPECT_LT(took, 2s);
  ::close(listener);
}

// Accepts the next connection on `listener` and resets it (SO_LINGER 0) before a byte is
// sent: what a coordinator's listening socket does to a connection it queued as it stopped.
bool AcceptAndReset(int listener) {
  const int fd = ::accept(listener, nullptr, nullptr);
  if (fd < 0) return false;
  const linger reset{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
  ::close(fd);
  return true;
}

// A new gang's rank can reach the coordinator's address while the previous gang's
// coordinator there is stopping: its kernel accepts, then the connection is reset before
// any challenge. The client tries again, as for a refused connect, and meets the new
// coordinator on the same port.
TEST(Store, AConnectionResetBeforeTheChallengeIsTriedAgain) {
  std::string address;
  const int listener = Listener(&address);
  ASSERT_GE(listener, 0);
  const auto port = uint16_t(std::stoi(address.substr(address.rfind(':') + 1)));
  std::unique_ptr<StoreServer> coordinator;
  std::thread stopping([&] {
    AcceptAndReset(listener);
    ::close(listener);
    std::this_thread::sleep_for(50ms);
    coordinator = std::make_unique<StoreServer>("127.0.0.1", port, std::string(32, 'k'));
  });
  std::string error;
  try {
    StoreClient client(address, 5s, std::string(32, 'k'));
    client.Set("k", "v");
    EXPECT_EQ(client.Get("k", 1s), "v");
  } catch (const StoreError& e) {
    error = e.what();
  }
  stopping.join();
  EXPECT_EQ(error, "") << "the rank gave up on the first reset connection";
  ASSERT_NE(coordinator, nullptr);
  EXPECT_EQ(coordinator->refused(), 0);
}

// Only reset connections until the deadline: the error says so.
TEST(Store, ConnectionsResetUntilTheDeadlineFailNamingWhy) {
  std::string address;
  const int listener = Listener(&address);
  ASSERT_GE(listener, 0);
  std::atomic<bool> done{false};
  int resets = 0;
  std::thread stopping([&] {
    while (!done)
      if (AcceptAndReset(listener)) ++resets;
  });
  const auto start = std::chrono::steady_clock::now();
  const std::string error = ErrorOf([&] { StoreClient client(address, 300ms, std::string(32, 'k')); });
  const auto took = std::chrono::steady_clock::now() - start;
  done = true;
  ::shutdown(listener, SHUT_RDWR);  // wakes the accept
  stopping.join();
  ::close(listener);
  EXPECT_EQ(error, "cannot reach the coordinator at " + address +
                       " within 300 ms: the connection ended before the coordinator's challenge (a coordinator "
                       "stopping there)");
  EXPECT_GE(resets, 2) << "the client connected once only";
  EXPECT_LT(took, 2s);
}

// ---------------------------------------------------------------------------
// Authentication: strangers on the Store's port, played over raw sockets.

const std::string kKey(32, 'k'), kOtherKey(32, 'o');

using testing::U32;

TEST(StoreAuthentication, ClientsWithTheKeyAreAdmitted) {
  StoreServer server("127.0.0.1", 0, kKey);
  StoreClient a(Address(server), 5s, kKey), b(Address(server), 5s, kKey);
  a.Set("endpoint/0", "x");
  EXPECT_EQ(b.Get("endpoint/0", 1s), "x");
  EXPECT_EQ(server.refused(), 0);
  EXPECT_NE(ErrorOf([] { StoreServer short_key("127.0.0.1", 0, "too short"); }).find("too short; it needs 32"),
            std::string::npos);
}

TEST(StoreAuthentication, StrangersAreRefusedAndTheJobGoesOn) {
  StoreServer server("127.0.0.1", 0, kKey);
  StoreClient rank(Address(server), 5s, kKey);
  rank.Set("before", "1");

  EXPECT_NE(ErrorOf([&] { StoreClient wrong(Address(server), 5s, kOtherKey); })
                .find("authentication at coordinator " + Address(server) + ": the coordinator refused this rank's key"),
            std::string::npos);
  StoreClient keyless(Address(server), 5s);
  const std::string keyless_error = ErrorOf([&] { keyless.Set("k", "v"); });
  EXPECT_NE(keyless_error.find("admits only clients with the job's key, and this rank has none"), std::string::npos)
      << keyless_error;
  // Raw strangers: a wrong key, no key, a replayed handshake, garbage, a huge length
  // prefix, and half a message then a hang-up.
  const auto intrusions = testing::IntrudeOnStore("127.0.0.1", server.port(), kKey);
  EXPECT_EQ(intrusions.size(), 6u);
  for (const auto& i : intrusions) EXPECT_TRUE(i.refused) << i.what << ": " << i.detail;
  EXPECT_EQ(rank.Get("before", 1s), "1");  // the job's own client never noticed
  rank.Set("after", "2");
  EXPECT_EQ(rank.Get("after", 1s), "2");
  EXPECT_EQ(server.refused(), 7);  // the two clients, then all but the half message
}

TEST(StoreAuthentication, AClientRefusesACoordinatorWithoutTheKey) {
  // A fake coordinator that challenges but cannot answer with the key's proof.
  std::string address;
  const int listener = Listener(&address);
  ASSERT_GE(listener, 0);
  std::thread fake([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    const std::string challenge = U32(33) + '\3' + std::string(32, 'n');
    (void)!::send(fd, challenge.data(), challenge.size(), MSG_NOSIGNAL);
    char answer[69];
    size_t got = 0;
    while (got < sizeof answer) {
      const ssize_t n = ::recv(fd, answer + got, sizeof answer - got, 0);
      if (n <= 0) break;
      got += size_t(n);
    }
    const std::string bogus = U32(33) + '\0' + std::string(32, 'p');
    (void)!::send(fd, bogus.data(), bogus.size(), MSG_NOSIGNAL);
    ::close(fd);
  });
  EXPECT_NE(ErrorOf([&] { StoreClient client(address, 5s, kKey); })
                .find("the coordinator could not prove that it holds the job's key"),
            std::string::npos);
  fake.join();
  ::close(listener);
}

TEST(StoreAuthentication, KeysAreRandomAndKeyFilesLongEnough) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("store-key-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "key").string();
  const std::string key = NewStoreKey();
  EXPECT_EQ(key.size(), 32u);
  std::ofstream(path, std::ios::binary) << key;
  EXPECT_EQ(ReadStoreKey(path), key);
  EXPECT_NE(NewStoreKey(), key);  // random each time
  std::ofstream(dir / "short") << "0123456789";
  EXPECT_NE(ErrorOf([&] { ReadStoreKey((dir / "short").string()); }).find("short holds 10 bytes; it needs at least 32"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { ReadStoreKey((dir / "missing").string()); }).find("cannot read the store key"),
            std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace meshtrain::comm
