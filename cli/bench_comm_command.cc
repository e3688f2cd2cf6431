// meshtrain bench comm: collective bandwidth like nccl-tests, over the fabric backend,
// with the ranks started here as virtual nodes.
//
// all_to_all sends an even block to every rank; all_to_all_v the uneven blocks of
// UnevenCount (what bench/compare-openmpi.sh compares with MPI_Alltoallv). The size is
// what each rank sends; busbw uses the factor (n-1)/n for both.

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <vector>

#include "cli/bench_ranks.h"
#include "cli/commands.h"
#include "operator/scheduler/cost_model.h"
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
  return static_cast<double>(n - 1) / n;  // all_gather, reduce_scatter, all_to_all(_v)
}

// The all-to-all a mixture of experts sends: uneven blocks, the same pattern in every
// run. Rank r sends rank p the share (p + r + 1) / (sum over q of (q + r + 1)) of its
// `total_count` elements, rounded down, and the last rank the rest; so each rank sends
// `total_count` in all but receives unevenly (at 2 ranks, rank 0 sends 1/3 to itself and
// 2/3 to rank 1, rank 1 sends 2/5 to rank 0 and 3/5 to itself). Blocks lie in peer order.
size_t UnevenCount(int from, int to, int n, size_t total_count) {
  const size_t shares = size_t(n) * size_t(n + 1) / 2 + size_t(n) * size_t(from);
  size_t before = 0;  // what `from` sends the ranks below `to`
  for (int q = 0; q < to; ++q) before += total_count * size_t(q + from + 1) / shares;
  if (to == n - 1) return total_count - before;
  return total_count * size_t(to + from + 1) / shares;
}

// Counts and offsets of one rank's all-to-all: even blocks, or the uneven pattern above.
struct AllToAllLists {
  std::vector<size_t> send_counts, send_offsets, recv_counts, recv_offsets;
  size_t recv_total = 0;  // elements received
};
AllToAllLists AllToAllListsOf(int me, int n, size_t total_count, bool uneven) {
  AllToAllLists lists;
  size_t sent = 0;
  for (int p = 0; p < n; ++p) {
    const size_t out = uneven ? UnevenCount(me, p, n, total_count) : total_count / size_t(n);
    const size_t in = uneven ? UnevenCount(p, me, n, total_count) : total_count / size_t(n);
    lists.send_offsets.push_back(sent);
    lists.send_counts.push_back(out);
    lists.recv_offsets.push_back(lists.recv_total);
    lists.recv_counts.push_back(in);
    sent += out;
    lists.recv_total += in;
  }
  return lists;
}

std::shared_ptr<mc::Work> Issue(mc::Communicator& comm, const std::string& op, char* send, char* recv,
                                size_t total_count, bool in_place, const AllToAllLists& lists) {
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
  if (op == "all_to_all" || op == "all_to_all_v") {  // never in place
    return comm.AllToAll(send, lists.send_counts, lists.send_offsets, recv, lists.recv_counts, lists.recv_offsets,
                         f32);
  }
  return comm.Broadcast(send, in_place ? send : recv, total_count, f32, 0);
}


// The benchmark's send and receive buffers: the communicator's own memory, or the heap.
struct Buffers {
  Buffers(mc::Communicator& communicator, size_t send_bytes, size_t recv_bytes, bool use_heap)
      : comm(communicator), heap(use_heap) {
    send = static_cast<char*>(heap ? std::malloc(send_bytes) : comm.AllocateBuffer(send_bytes));
    recv = static_cast<char*>(heap ? std::malloc(recv_bytes) : comm.AllocateBuffer(recv_bytes));
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

// Seconds per all-gather of `bytes` (output) on `group`, every group of the kind at once.
double AllGatherSeconds(mc::Communicator& world, mc::Communicator* group, size_t bytes) {
  std::vector<float> in(bytes / 4 / size_t(group ? group->size() : 1)), out(bytes / 4);
  const int iterations = int(std::clamp<size_t>((size_t(64) << 20) / bytes, 5, 50));
  if (group) group->AllGather(in.data(), out.data(), in.size(), mc::DataType::kFloat32)->Wait();
  world.Barrier()->Wait();
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < iterations && group; ++i) {
    group->AllGather(in.data(), out.data(), in.size(), mc::DataType::kFloat32)->Wait();
  }
  double seconds = SecondsSince(start) / iterations;
  std::vector<double> times(size_t(world.size()));
  world.AllGather(&seconds, times.data(), 2, mc::DataType::kInt32)->Wait();  // 8 bytes each
  return *std::max_element(times.begin(), times.end());
}

// The alpha-beta link under a ring of n ranks: t = (n-1)(alpha + M/n/beta), fitted from
// all-gathers of a small and a large buffer, every group of the kind running at once.
scheduler::Link FitLink(const std::string& name, mc::Communicator& world, mc::Communicator* group, int n) {
  const size_t small = size_t(4) << 10, large = size_t(8) << 20;
  const double t_small = AllGatherSeconds(world, group, small), t_large = AllGatherSeconds(world, group, large);
  const double per_byte = std::max(1e-15, (t_large - t_small) / (n - 1) / (double(large - small) / n));
  const double latency = std::max(0.0, t_small / (n - 1) - double(small) / n * per_byte);
  return {name, 1 / per_byte, latency};
}

// --calibrate: the ranks of each node form a group, and the ranks of one local index
// across nodes (rails); each kind is timed with all its groups at once.
int Calibrate(const BenchCommOptions& options, mc::Communicator& world, const mc::WorkerEnvironment& env,
              std::ostream& out) {
  const int per_node = env.nproc_per_node, nodes = env.nnodes;
  std::vector<scheduler::Link> links;
  std::vector<std::unique_ptr<mc::Communicator>> intra(static_cast<size_t>(nodes)), rail(static_cast<size_t>(per_node));
  for (int n = 0; n < nodes && per_node > 1; ++n) {
    std::vector<int> members;
    for (int l = 0; l < per_node; ++l) members.push_back(n * per_node + l);
    intra[size_t(n)] = world.NewGroup(members, "node " + std::to_string(n));
  }
  for (int l = 0; l < per_node && nodes > 1; ++l) {
    std::vector<int> members;
    for (int n = 0; n < nodes; ++n) members.push_back(n * per_node + l);
    rail[size_t(l)] = world.NewGroup(members, "rail " + std::to_string(l));
  }
  if (per_node > 1) links.push_back(FitLink("nvlink", world, intra[size_t(env.node_rank)].get(), per_node));
  if (nodes > 1) links.push_back(FitLink("cluster", world, rail[size_t(env.local_rank)].get(), nodes));
  if (world.rank() == 0) {
    std::ofstream(options.calibrate) << scheduler::LinkFileJson(links).dump(2) << "\n";
    for (const scheduler::Link& l : links) {
      char row[200];
      std::snprintf(row, sizeof row, "%s: %.3f GB/s per rank, latency %.1f us\n",
                    l.name == "nvlink" ? "inside a node (nvlink)" : "between nodes (cluster)", l.bytes_per_second / 1e9,
                    l.latency_seconds * 1e6);
      out << row;
    }
    out << "wrote " << options.calibrate << "\n";
  }
  world.Barrier()->Wait();
  return kExitOk;
}

int RunRank(const BenchCommOptions& options, std::ostream& out) {
  auto env = mc::WorkerEnvironment::FromEnvironment();
  auto rendezvous = mc::JoinRendezvous(env, std::chrono::seconds(60));
  mc::FabricOptions fabric = mc::FabricOptions::FromEnvironment();
  if (!options.algorithm.empty()) fabric.algorithm = mc::ParseAlgorithm(options.algorithm);
  auto world = mc::ConnectFabric(rendezvous.table, env.rank, rendezvous.store, fabric);
  if (!options.calibrate.empty()) return Calibrate(options, *world, env, out);
  int n = world->size();
  bool leader = world->rank() == 0;
  const std::string& op = options.op;
  const bool uneven = op == "all_to_all_v";
  if (leader) {
    auto info = mc::InfoOf(*world);
    out << "# " << op << (uneven ? " (rank r sends rank p (p+r+1)/sum_q(q+r+1) of its size)" : "") << ", " << n << " ranks on " << env.nnodes << " nodes, fp32, "
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
    const AllToAllLists lists = AllToAllListsOf(world->rank(), n, total_count, uneven);
    const size_t recv_bytes = std::max(bytes, lists.recv_total * 4);
    Buffers buffers(*world, bytes, recv_bytes, options.heap_buffers);
    char* send = buffers.send;
    char* recv = buffers.recv;
    std::memset(send, 1, bytes);
    std::memset(recv, 0, recv_bytes);
    int iterations = static_cast<int>(std::clamp<size_t>((size_t{1} << 30) / bytes, 5, options.max_iterations));
    for (int i = 0; i < options.warmup; ++i) {
      Issue(*world, op, send, recv, total_count, options.in_place, lists)->Wait();
    }
    world->Barrier()->Wait();
    Clock::time_point start = Clock::now();
    for (int i = 0; i < iterations; ++i) {
      Issue(*world, op, send, recv, total_count, options.in_place, lists)->Wait();
    }
    double seconds = SecondsSince(start) / iterations;
    std::vector<double> times(n);
    world->AllGather(&seconds, times.data(), 2, mc::DataType::kInt32)->Wait();  // 8 bytes each
    double slowest = *std::max_element(times.begin(), times.end());
    if (leader) {
      double algbw = bytes / slowest / 1e9;
      char row[160];
      std::snprintf(row, sizeof(row), "%12zu %12zu %8d %12.1f %12.3f %12.3f\n", bytes, total_count, iterations,
                    slowest * 1e6, algbw, algbw * BusFactor(op, n));
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
    if ((options.op == "all_to_all" || options.op == "all_to_all_v") && options.in_place) {
      std::cerr << "meshtrain bench comm: --in-place: all_to_all sends and receives in separate buffers\n";
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
