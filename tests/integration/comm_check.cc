// Checks the fabric communicator across real processes. Run without a worker
// environment, it launches itself as --ranks ranks on --nodes virtual nodes and
// reports; each rank then runs one --mode:
//
//   collectives  every operation, every dtype, sizes 0, 1, primes and sizes that do not
//                divide by the world, up to 2 MiB (in the tests' 64 KiB ring chunks, more
//                messages than an exchange posts at once), in and out of place, against a
//                reference each rank computes for the whole world; integer-valued data
//                so sums are exact in every dtype and every algorithm must match bitwise;
//                random fp32 data must give bit-identical results on every rank and, for
//                rings, exactly the documented reduction order.
//   groups       tp/shard/replica groups from a layout, several operations in flight on
//                different groups at once, completing in issue order per group.
//   p2p          point to point between the ranks of each pair (0,1), (2,3)...: messages
//                of 0 bytes to 48 MiB arrive whole and in order, both ways; two groups of
//                the same pair do not wait for each other (a send held on one while the
//                peer first answers on the other); a rank blocked in Recv for a second
//                while its peer sleeps uses under 0.3 s of CPU (it prints how much).
//   kill         all-reduces until the last rank kills itself mid-way: every other rank
//                must fail with an error naming the operation and a peer (exit 3).
//   kill-p2p     the same for receives from a sender that kills itself (two ranks): the
//                receiver fails naming the receive and the sender (exit 3).
//
// The algorithm comes from MESHTRAIN_COMM_ALGORITHM (auto, ring, log, hierarchical).

#include <signal.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "api/layout.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/communicator.h"
#include "worker/comm/fabric/fabric_communicator.h"
#include "worker/launch/local_launcher.h"

namespace mc = meshtrain::comm;
using mc::DataType;

namespace {

int failures = 0;

void Expect(bool ok, const std::string& what) {
  if (!ok && ++failures <= 20) std::fprintf(stderr, "rank check failed: %s\n", what.c_str());
}

// memcmp that accepts the null pointers of empty buffers.
bool Same(const void* a, const void* b, size_t bytes) { return bytes == 0 || std::memcmp(a, b, bytes) == 0; }

// Element i of rank r's data as a small integer, exact in every dtype even when summed.
int64_t SmallValue(int rank, size_t i) { return static_cast<int64_t>((rank * 131 + i * 31) % 17) - 8; }

void Store(DataType type, void* buf, size_t i, double value) {
  switch (type) {
    case DataType::kFloat32: static_cast<float*>(buf)[i] = static_cast<float>(value); break;
    case DataType::kBFloat16: static_cast<uint16_t*>(buf)[i] = mc::FloatToBf16(static_cast<float>(value)); break;
    case DataType::kFloat16: static_cast<uint16_t*>(buf)[i] = mc::FloatToFp16(static_cast<float>(value)); break;
    case DataType::kFloat64: static_cast<double*>(buf)[i] = value; break;
    case DataType::kInt32: static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(value); break;
    case DataType::kInt64: static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(value); break;
  }
}

std::vector<char> Fill(DataType type, int rank, size_t count, size_t offset = 0) {
  std::vector<char> data(count * mc::ElementSize(type));
  for (size_t i = 0; i < count; ++i) Store(type, data.data(), i, static_cast<double>(SmallValue(rank, offset + i)));
  return data;
}

// Sum over ranks of elements [offset, offset+count), in the dtype, then the average if asked.
std::vector<char> ReferenceSum(DataType type, int world, size_t offset, size_t count, mc::ReduceOp op) {
  std::vector<char> sum(count * mc::ElementSize(type));
  for (size_t i = 0; i < count; ++i) {
    int64_t total = 0;
    for (int r = 0; r < world; ++r) total += SmallValue(r, offset + i);
    Store(type, sum.data(), i, static_cast<double>(total));
  }
  if (op == mc::ReduceOp::kAverage) mc::DivideBy(sum.data(), count, type, world);
  return sum;
}

std::string Describe(const char* op, DataType type, size_t count, bool in_place) {
  return std::string(op) + " " + mc::DataTypeName(type) + " count " + std::to_string(count) +
         (in_place ? " in place" : " out of place");
}

// With MESHTRAIN_TEST_BUFFERS=communicator the operations run on memory from
// AllocateBuffer (the direct intra-node path) instead of the heap.
class Staging {
 public:
  explicit Staging(mc::Communicator& comm) : comm_(comm) {
    const char* mode = std::getenv("MESHTRAIN_TEST_BUFFERS");
    if (mode != nullptr && std::string(mode) == "communicator") {
      for (char*& p : pool_) p = static_cast<char*>(comm_.AllocateBuffer(kBytes));
    }
  }
  ~Staging() {
    for (char* p : pool_) if (p != nullptr) comm_.FreeBuffer(p);
  }
  // The memory an operation uses for `data`: pool buffer `which` holding a copy, or data itself.
  char* In(std::vector<char>& data, int which) {
    if (pool_[which] == nullptr) return data.data();
    if (data.size() > kBytes) throw std::runtime_error("staging buffer too small");
    if (!data.empty()) std::memcpy(pool_[which], data.data(), data.size());
    return pool_[which];
  }
  void Out(std::vector<char>& data, const char* used) {
    if (used != data.data() && !data.empty()) std::memcpy(data.data(), used, data.size());
  }

 private:
  static constexpr size_t kBytes = 96 << 20;
  mc::Communicator& comm_;
  char* pool_[2] = {nullptr, nullptr};
};

void CheckCollectives(mc::Communicator& world) {
  const int n = world.size(), me = world.rank();
  Staging staging(world);
  const std::vector<size_t> counts = {0, 1, 2, 3, 5, 7, 13, 31, 61, 127, 257, 1021, 4099, 65537, 262147};
  for (DataType type : mc::kAllDataTypes) {
    size_t es = mc::ElementSize(type);
    for (size_t count : counts) {
      for (bool in_place : {false, true}) {
        // all_reduce (sum and avg)
        for (mc::ReduceOp op : {mc::ReduceOp::kSum, mc::ReduceOp::kAverage}) {
          std::vector<char> send = Fill(type, me, count), recv(count * es, 0x5a);
          char* in = staging.In(send, 0);
          char* out = in_place ? in : staging.In(recv, 1);
          world.AllReduce(in, out, count, type, op)->Wait();
          Expect(Same(out, ReferenceSum(type, n, 0, count, op).data(), count * es),
                 Describe(op == mc::ReduceOp::kSum ? "all_reduce sum" : "all_reduce avg", type, count, in_place));
        }
        // reduce_scatter: count per rank, input holds n blocks
        size_t per_rank = count / n + 1;
        {
          std::vector<char> send = Fill(type, me, per_rank * n), recv(per_rank * es, 0x5a);
          char* in = staging.In(send, 0);
          char* out = in_place ? in + me * per_rank * es : staging.In(recv, 1);
          world.ReduceScatter(in, out, per_rank, type, mc::ReduceOp::kSum)->Wait();
          Expect(Same(out, ReferenceSum(type, n, me * per_rank, per_rank, mc::ReduceOp::kSum).data(),
                             per_rank * es),
                 Describe("reduce_scatter", type, per_rank, in_place));
        }
        // all_gather: rank r contributes its data at offset r*count
        {
          std::vector<char> recv(count * n * es, 0x5a);
          std::vector<char> own = Fill(type, me, count, me * count);
          if (in_place && count > 0) std::memcpy(recv.data() + me * count * es, own.data(), count * es);
          char* out = staging.In(recv, 1);
          const char* send = in_place ? out + me * count * es : staging.In(own, 0);
          world.AllGather(send, out, count, type)->Wait();
          staging.Out(recv, out);
          bool ok = true;
          for (int r = 0; r < n && ok; ++r) {
            ok = Same(recv.data() + r * count * es, Fill(type, r, count, r * count).data(), count * es);
          }
          Expect(ok, Describe("all_gather", type, count, in_place));
        }
        // broadcast from a root that moves with the size
        {
          int root = static_cast<int>(count % n);
          std::vector<char> send = Fill(type, me, count), recv(count * es, 0x5a);
          char* in = staging.In(send, 0);
          char* out = in_place ? in : staging.In(recv, 1);
          world.Broadcast(in, out, count, type, root)->Wait();
          Expect(Same(out, Fill(type, root, count).data(), count * es),
                 Describe(("broadcast root " + std::to_string(root)).c_str(), type, count, in_place));
        }
      }
    }
  }
  world.Barrier()->Wait();

  // Random fp32 data: every rank ends with the same bits; rings follow the documented order.
  for (size_t count : {size_t{1000}, size_t{262147}}) {
    auto random = [count](int rank) {
      std::vector<float> v(count);
      std::mt19937 generator(1234 + rank);
      std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
      for (float& x : v) x = uniform(generator);
      return v;
    };
    std::vector<float> send = random(me), out(count);
    world.AllReduce(send.data(), out.data(), count, DataType::kFloat32, mc::ReduceOp::kSum)->Wait();
    std::vector<float> everyone(count * n);
    world.AllGather(out.data(), everyone.data(), count, DataType::kFloat32)->Wait();
    bool identical = true, close = true;
    for (int r = 1; r < n; ++r) identical &= Same(everyone.data(), everyone.data() + r * count, count * 4);
    std::vector<std::vector<float>> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back(random(r));
    for (size_t i = 0; i < count; ++i) {
      double exact = 0;
      for (int r = 0; r < n; ++r) exact += inputs[r][i];
      close &= std::abs(out[i] - exact) <= 1e-5 * n;
    }
    Expect(identical, "random all_reduce bits differ between ranks, count " + std::to_string(count));
    Expect(close, "random all_reduce far from the exact sum, count " + std::to_string(count));
    const char* algorithm = std::getenv("MESHTRAIN_COMM_ALGORITHM");
    if (algorithm != nullptr && std::string(algorithm) == "ring" && n > 1) {
      // Block b (of the ring's even split) is ((x[b+1] + x[b+2]) + ...) + x[b].
      bool ordered = true;
      size_t offset = 0;
      for (int b = 0; b < n; ++b) {
        size_t length = count / n + (static_cast<size_t>(b) < count % n ? 1 : 0);
        for (size_t i = offset; i < offset + length; ++i) {
          float sum = inputs[(b + 1) % n][i];
          for (int k = 2; k <= n; ++k) sum = inputs[(b + k) % n][i] + sum;
          ordered &= Same(&sum, &out[i], 4);
        }
        offset += length;
      }
      Expect(ordered, "ring all_reduce does not follow the documented order, count " + std::to_string(count));
    }
  }
}

// With MESHTRAIN_FABRIC_REGISTER=1 every buffer is registered: repeating operations on
// the same buffers must not register again.
void CheckRegistrationCache(mc::Communicator& world) {
  std::vector<float> data(1 << 18, 1.0f);
  world.AllReduce(data.data(), data.data(), data.size(), DataType::kFloat32, mc::ReduceOp::kSum)->Wait();
  int64_t after_first = mc::InfoOf(world).registrations;
  for (int i = 0; i < 10; ++i) {
    world.AllReduce(data.data(), data.data(), data.size(), DataType::kFloat32, mc::ReduceOp::kSum)->Wait();
  }
  Expect(after_first > 0, "no buffer was registered although MESHTRAIN_FABRIC_REGISTER=1");
  Expect(mc::InfoOf(world).registrations == after_first,
         "registrations grew from " + std::to_string(after_first) + " to " +
             std::to_string(mc::InfoOf(world).registrations) + " over repeated operations");
}

void CheckGroups(mc::Communicator& world) {
  const int n = world.size(), me = world.rank();
  if (n % 4 != 0) {
    std::fprintf(stderr, "groups mode needs a world divisible by 4\n");
    failures++;
    return;
  }
  int nodes = std::atoi(std::getenv("MESHTRAIN_NNODES"));
  meshtrain::api::ParallelLayout layout(nodes, n / nodes, 2, 2);
  auto tp = world.SplitAxis(layout, meshtrain::api::Axis::kTensor);
  auto shard = world.SplitAxis(layout, meshtrain::api::Axis::kShard);
  auto replica = world.SplitAxis(layout, meshtrain::api::Axis::kReplica);
  Expect(tp->size() == 2 && shard->size() == 2 && replica->size() == n / 4, "group sizes");
  auto group_sum = [&](const std::vector<int>& members, int64_t base) {
    int64_t total = 0;
    for (int r : members) total += base + r;
    return total;
  };
  const size_t count = 300000;  // rings on every group
  for (int round = 0; round < 5; ++round) {
    std::vector<std::vector<int64_t>> buffers(6, std::vector<int64_t>(count));
    std::vector<std::shared_ptr<mc::Work>> works;
    mc::Communicator* groups[3] = {tp.get(), shard.get(), replica.get()};
    // Two operations per group, the second on the first's output: order matters.
    for (int g = 0; g < 3; ++g) {
      auto& first = buffers[2 * g];
      std::fill(first.begin(), first.end(), int64_t{me + round});
      works.push_back(groups[g]->AllReduce(first.data(), first.data(), count, DataType::kInt64, mc::ReduceOp::kSum));
      works.push_back(groups[g]->Broadcast(first.data(), buffers[2 * g + 1].data(), count, DataType::kInt64, 1 % groups[g]->size()));
    }
    for (int i = static_cast<int>(works.size()) - 1; i >= 0; i -= 2) {  // wait the last of each group first
      works[i]->Wait();
      Expect(works[i - 1]->IsCompleted(), "an earlier operation on a group finished after a later one");
    }
    for (int g = 0; g < 3; ++g) {
      int64_t want = group_sum(groups[g]->group().global_ranks(), round);
      Expect(buffers[2 * g][count - 1] == want && buffers[2 * g + 1][0] == want && buffers[2 * g + 1][count - 1] == want,
             "group " + groups[g]->group().name() + " round " + std::to_string(round));
    }
  }
  // NewGroup's one contract: every rank calls it, members or not; non-members get null.
  auto ends = world.NewGroup({0, n - 1}, "ends");
  Expect((ends != nullptr) == (me == 0 || me == n - 1), "NewGroup gives a communicator to its members only");
  if (ends) {
    int64_t value = me, sum = 0;
    ends->AllReduce(&value, &sum, 1, DataType::kInt64, mc::ReduceOp::kSum)->Wait();
    Expect(sum == n - 1 && ends->size() == 2, "an all-reduce over the ends group");
  }
  // Point to point inside the tp group, several messages in order; the lower rank sends
  // first (a send may wait for its receive: communicator.h).
  std::vector<int32_t> a(1000, me), b(1000, -1), c(1000, -1);
  int peer = 1 - tp->rank();
  std::vector<int32_t> a2(1000, me + 1000);
  std::vector<std::shared_ptr<mc::Work>> works;
  auto sends = [&] {
    works.push_back(tp->Send(a.data(), a.size(), DataType::kInt32, peer));
    works.push_back(tp->Send(a2.data(), a2.size(), DataType::kInt32, peer));
  };
  auto receives = [&] {
    works.push_back(tp->Recv(b.data(), b.size(), DataType::kInt32, peer));
    works.push_back(tp->Recv(c.data(), c.size(), DataType::kInt32, peer));
  };
  if (tp->rank() == 0) sends(), receives();
  else receives(), sends();
  for (auto& w : works) w->Wait();
  int other = tp->group().GlobalRank(peer);
  Expect(b[999] == other && c[0] == other + 1000, "point to point in order");
}

// CPU seconds this process has used so far.
double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
}

void CheckPointToPoint(mc::Communicator& world) {
  const int n = world.size(), me = world.rank();
  if (n % 2 != 0) {
    std::fprintf(stderr, "p2p mode needs an even world\n");
    failures++;
    return;
  }
  const int peer = me ^ 1;
  const bool even = me % 2 == 0;
  // Whole and in order, both ways: each message's elements say which message it is.
  const std::vector<size_t> counts = {1, 0, size_t(48) << 20 >> 2, 3, size_t(5) << 20 >> 2, 1000};
  for (int direction = 0; direction < 2; ++direction) {
    const bool sending = even == (direction == 0);
    std::vector<std::vector<int32_t>> messages;
    std::vector<std::shared_ptr<mc::Work>> works;
    for (size_t m = 0; m < counts.size(); ++m) {
      messages.emplace_back(counts[m], sending ? int32_t(m * 1000 + me) : -1);
      auto* data = messages.back().data();
      works.push_back(sending ? world.Send(data, counts[m], DataType::kInt32, peer)
                              : world.Recv(data, counts[m], DataType::kInt32, peer));
    }
    for (auto& work : works) work->Wait();
    if (!sending) {
      for (size_t m = 0; m < counts.size(); ++m) {
        bool whole = true;
        for (int32_t v : messages[m]) whole &= v == int32_t(m * 1000 + peer);
        Expect(whole, "message " + std::to_string(m) + " (" + std::to_string(counts[m]) + " int32) from rank " +
                          std::to_string(peer));
      }
    }
  }
  // Two groups of the same pair; every rank makes every pair's, in order.
  std::unique_ptr<mc::Communicator> forward, backward;
  for (int lower = 0; lower < n; lower += 2) {
    const std::string members = "{" + std::to_string(lower) + "," + std::to_string(lower + 1) + "}";
    if (auto group = world.NewGroup({lower, lower + 1}, "forward" + members)) forward = std::move(group);
    if (auto group = world.NewGroup({lower, lower + 1}, "backward" + members)) backward = std::move(group);
  }
  const size_t large = size_t(8) << 20 >> 2;  // a sender waits for its receiver
  std::vector<int32_t> mine(large, me), theirs(large, -1);
  const int member = 1 - forward->rank();
  if (even) {
    auto held = forward->Send(mine.data(), large, DataType::kInt32, member);  // taken only after the answer
    backward->Recv(theirs.data(), large, DataType::kInt32, member)->Wait();
    held->Wait();
  } else {
    backward->Send(mine.data(), large, DataType::kInt32, member)->Wait();
    forward->Recv(theirs.data(), large, DataType::kInt32, member)->Wait();
  }
  Expect(theirs.front() == peer && theirs.back() == peer, "the two groups of a pair");
  // Blocked in Recv while the peer sleeps.
  world.Barrier()->Wait();
  int32_t token = me;
  if (even) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    world.Send(&token, 1, DataType::kInt32, peer)->Wait();
  } else {
    const double before = ProcessCpuSeconds();
    const auto start = std::chrono::steady_clock::now();
    world.Recv(&token, 1, DataType::kInt32, peer)->Wait();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double cpu = ProcessCpuSeconds() - before;
    std::fprintf(stderr, "rank %d: blocked %.2f s in Recv, %.3f s of CPU\n", me, waited, cpu);
    Expect(token == peer, "the token after the wait");
    Expect(waited > 0.5 && cpu < 0.3 * waited, "CPU while blocked: " + std::to_string(cpu) + " s in " +
                                                   std::to_string(waited) + " s");
  }
}

// Rank 1 sends 4 MiB messages to rank 0 and kills itself after five.
int KillPointToPoint(mc::Communicator& world) {
  std::vector<float> data(1 << 20, 1.0f);
  for (int i = 0; i < 1000; ++i) {
    if (world.rank() == 1) {
      if (i == 5) ::raise(SIGKILL);
      world.Send(data.data(), data.size(), DataType::kFloat32, 0)->Wait();
      continue;
    }
    try {
      world.Recv(data.data(), data.size(), DataType::kFloat32, 1)->Wait();
    } catch (const mc::CommError& error) {
      std::string message = error.what();
      std::fprintf(stderr, "rank %d: %s\n", world.rank(), message.c_str());
      bool named = message.find("recv from 1 of 4.0 MiB fp32") != std::string::npos &&
                   message.find("group world") != std::string::npos && message.find("rank 1") != std::string::npos;
      return named ? 3 : 4;
    }
  }
  return 0;
}

int Kill(mc::Communicator& world) {
  const int n = world.size();
  std::vector<float> data(1 << 20, 1.0f);
  for (int i = 0; i < 1000; ++i) {
    if (i == 5 && world.rank() == n - 1) ::raise(SIGKILL);
    try {
      world.AllReduce(data.data(), data.data(), data.size(), DataType::kFloat32, mc::ReduceOp::kAverage)->Wait();
    } catch (const mc::CommError& error) {
      std::string message = error.what();
      std::fprintf(stderr, "rank %d: %s\n", world.rank(), message.c_str());
      bool named = message.find("all_reduce") != std::string::npos && message.find("4.0 MiB") != std::string::npos &&
                   message.find("group world") != std::string::npos && message.find(" rank ") != std::string::npos;
      return named ? 3 : 4;
    }
  }
  return 0;  // a survivor that never noticed: a failure of the test
}

int RunRank(const std::string& mode) {
  auto env = mc::WorkerEnvironment::FromEnvironment();
  auto rendezvous = mc::JoinRendezvous(env, std::chrono::seconds(30));
  auto world = mc::ConnectFabric(rendezvous.table, env.rank, rendezvous.store, mc::FabricOptions::FromEnvironment());
  if (mode == "kill") return Kill(*world);
  if (mode == "kill-p2p") return KillPointToPoint(*world);
  if (mode == "groups") {
    CheckGroups(*world);
  } else if (mode == "p2p") {
    CheckPointToPoint(*world);
  } else {
    CheckCollectives(*world);
    const char* registering = std::getenv("MESHTRAIN_FABRIC_REGISTER");
    if (registering != nullptr && std::string(registering) == "1" && world->size() > 1) {
      CheckRegistrationCache(*world);
    }
  }
  auto info = mc::InfoOf(*world);
  if (env.rank == 0) {
    std::fprintf(stderr, "providers: intra \"%s\", inter \"%s\"\n", info.intra_provider.c_str(),
                 info.inter_provider.c_str());
  }
  world->Barrier()->Wait();
  if (failures > 0) std::fprintf(stderr, "rank %d: %d checks failed\n", env.rank, failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 2, nodes = 1;
  std::string mode = "collectives";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--ranks") ranks = std::atoi(argv[i + 1]);
    else if (flag == "--nodes") nodes = std::atoi(argv[i + 1]);
    else if (flag == "--mode") mode = argv[i + 1];
  }
  try {
    if (mc::WorkerEnvironment::Present()) return RunRank(mode);
    if (ranks % nodes != 0) {
      std::fprintf(stderr, "--ranks must be a multiple of --nodes\n");
      return 2;
    }
    meshtrain::launch::LocalLaunch launch;
    launch.nodes = nodes;
    launch.ranks_per_node = ranks / nodes;
    launch.command = meshtrain::launch::SelfCommand(argc, argv);
    launch.timeout = std::chrono::minutes(5);
    const bool kill = mode == "kill" || mode == "kill-p2p";
    if (kill) {
      launch.stop_others_on_failure = false;
      launch.environment["MESHTRAIN_COMM_TIMEOUT"] = "3";
      launch.timeout = std::chrono::seconds(60);
    }
    auto result = meshtrain::launch::LaunchLocal(launch, std::cerr);
    if (!kill) {
      std::printf("%s: %d ranks on %d nodes: %s\n", mode.c_str(), ranks, nodes, result.status == 0 ? "ok" : "FAILED");
      return result.status == 0 ? 0 : 1;
    }
    bool ok = true;
    for (const auto& exit : result.exits) {
      int expected = exit.rank == ranks - 1 ? 128 + SIGKILL : 3;
      std::printf("rank %d exited %d (expected %d)\n", exit.rank, exit.status, expected);
      ok &= exit.status == expected;
    }
    ok &= static_cast<int>(result.exits.size()) == ranks;
    std::printf("%s: %s\n", mode.c_str(), ok ? "every surviving rank failed with a named error" : "FAILED");
    return ok ? 0 : 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "comm_check: %s\n", error.what());
    return 1;
  }
}
