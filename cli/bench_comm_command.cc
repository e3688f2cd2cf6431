// meshtrain bench comm: collective bandwidth like nccl-tests, over the fabric backend,
// with the ranks started here as virtual nodes.

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <vector>

#include "cli/commands.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/fabric/fabric_communicator.h"
#include "worker/launch/local_launcher.h"

namespace meshtrain::cli {
namespace {

using Clock = std::chrono::steady_clock;
namespace mc = meshtrain::comm;

// nccl-tests' bus bandwidth factors: what each rank's links carry relative to the size.
double BusFactor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast") return 1.0;
  return static_cast<double>(n - 1) / n;  // all_gather, reduce_scatter
}

std::shared_ptr<mc::Work> Issue(mc::Communicator& comm, const std::string& op, char* send, char* recv,
                                size_t total_count, bool in_place) {
  int n = comm.size();
  size_t block = total_count / n;  // all_gather / reduce_scatter: per-rank count
  constexpr auto f32 = mc::DataType::kFloat32;
  if (op == "all_gather") {
    return comm.AllGather(in_place ? recv + comm.rank() * block * 4 : send, recv, block, f32);
  }
  if (op == "reduce_scatter") {
    return comm.ReduceScatter(send, in_place ? send + comm.rank() * block * 4 : recv, block, f32,
                              mc::ReduceOp::kSum);
  }
  if (op == "all_reduce") return comm.AllReduce(send, in_place ? send : recv, total_count, f32, mc::ReduceOp::kSum);
  return comm.Broadcast(send, in_place ? send : recv, total_count, f32, 0);
}

// The benchmark's send and receive buffers: the communicator's own memory, or the heap.
struct Buffers {
  Buffers(mc::Communicator& communicator, size_t bytes, bool use_heap) : comm(communicator), heap(use_heap) {
    send = static_cast<char*>(heap ? std::malloc(bytes) : comm.AllocateBuffer(bytes));
    recv = static_cast<char*>(heap ? std::malloc(bytes) : comm.AllocateBuffer(bytes));
    if (send == nullptr || recv == nullptr) throw std::bad_alloc();
  }
  ~Buffers() {
    for (char* buffer : {send, recv}) heap ? std::free(buffer) : comm.FreeBuffer(buffer);
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  mc::Communicator& comm;
  bool heap;
  char* send = nullptr;
  char* recv = nullptr;
};

int RunRank(const BenchCommOptions& options, std::ostream& out) {
  auto env = mc::WorkerEnvironment::FromEnvironment();
  auto rendezvous = mc::JoinRendezvous(env, std::chrono::seconds(60));
  mc::FabricOptions fabric = mc::FabricOptions::FromEnvironment();
  if (!options.algorithm.empty()) fabric.algorithm = mc::ParseAlgorithm(options.algorithm);
  auto world = mc::ConnectFabric(rendezvous.table, env.rank, rendezvous.store, fabric);
  int n = world->size();
  bool leader = world->rank() == 0;
  if (leader) {
    auto info = mc::InfoOf(*world);
    out << "# " << options.op << ", " << n << " ranks on " << env.nnodes << " nodes, fp32, "
        << (options.in_place ? "in place" : "out of place") << ", "
        << (options.heap_buffers ? "heap buffers" : "buffers from AllocateBuffer") << ", algorithm "
        << mc::AlgorithmName(fabric.algorithm) << "; providers: intra "
        << (info.intra_provider.empty() ? "-" : info.intra_provider) << ", inter "
        << (info.inter_provider.empty() ? "-" : info.inter_provider) << "\n";
    char header[160];
    std::snprintf(header, sizeof(header), "%12s %12s %8s %12s %12s %12s\n", "size(B)", "count", "iters",
                  "time(us)", "algbw(GB/s)", "busbw(GB/s)");
    out << header << std::flush;
  }
  for (size_t size = options.min_bytes; size <= options.max_bytes; size *= 2) {
    size_t total_count = std::max<size_t>(size / 4 / n * n, n);  // whole blocks per rank
    size_t bytes = total_count * 4;
    Buffers buffers(*world, bytes, options.heap_buffers);
    char* send = buffers.send;
    char* recv = buffers.recv;
    std::memset(send, 1, bytes);
    std::memset(recv, 0, bytes);
    int iterations = static_cast<int>(std::clamp<size_t>((size_t{1} << 30) / bytes, 5, options.max_iterations));
    for (int i = 0; i < options.warmup; ++i) {
      Issue(*world, options.op, send, recv, total_count, options.in_place)->Wait();
    }
    world->Barrier()->Wait();
    Clock::time_point start = Clock::now();
    for (int i = 0; i < iterations; ++i) {
      Issue(*world, options.op, send, recv, total_count, options.in_place)->Wait();
    }
    double seconds = std::chrono::duration<double>(Clock::now() - start).count() / iterations;
    std::vector<double> times(n);
    world->AllGather(&seconds, times.data(), 2, mc::DataType::kInt32)->Wait();  // 8 bytes each
    double slowest = *std::max_element(times.begin(), times.end());
    if (leader) {
      double algbw = bytes / slowest / 1e9;
      char row[160];
      std::snprintf(row, sizeof(row), "%12zu %12zu %8d %12.1f %12.3f %12.3f\n", bytes, total_count, iterations,
                    slowest * 1e6, algbw, algbw * BusFactor(options.op, n));
      out << row << std::flush;
    }
  }
  world->Barrier()->Wait();
  return kExitOk;
}

}  // namespace

int BenchCommCommand(const BenchCommOptions& options, const std::vector<std::string>& self_argv,
                     std::ostream& out) {
  try {
    if (mc::WorkerEnvironment::Present()) return RunRank(options, out);
    if (options.ranks % options.nodes != 0) {
      std::cerr << "meshtrain bench comm: --ranks (" << options.ranks << ") must be a multiple of --nodes ("
                << options.nodes << ")\n";
      return kExitInvalid;
    }
    launch::LocalLaunch launch;
    launch.nodes = options.nodes;
    launch.ranks_per_node = options.ranks / options.nodes;
    launch.command = self_argv;
    launch.job_name = "bench-comm";
    launch.netbed = options.netbed;
    return launch::LaunchLocal(launch, std::cerr).status == 0 ? kExitOk : kExitInvalid;
  } catch (const std::exception& error) {
    std::cerr << "meshtrain bench comm: " << error.what() << "\n";
    return kExitInvalid;
  }
}

int LaunchCommand(const LaunchOptions& options, std::ostream& out) {
  try {
    launch::LocalLaunch launch;
    launch.nodes = options.nodes;
    launch.ranks_per_node = options.ranks_per_node;
    launch.command = options.command;
    launch.timeout = std::chrono::seconds(options.timeout_seconds);
    auto result = launch::LaunchLocal(launch, std::cerr);
    out << "launch: " << launch.nodes * launch.ranks_per_node << " ranks on " << launch.nodes
        << " virtual nodes " << (result.status == 0 ? "succeeded" : "failed") << "\n";
    return result.status;
  } catch (const std::exception& error) {
    std::cerr << "meshtrain launch: " << error.what() << "\n";
    return kExitUnreadable;
  }
}

}  // namespace meshtrain::cli
