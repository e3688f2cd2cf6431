// Checks the sharded engine across real processes against the single-rank run. Run
// without a worker environment, it trains the single-rank reference in-process, then
// launches itself as --ranks ranks on --nodes virtual nodes with tensor-parallel groups
// of --tp ranks and shard groups of --shard ranks, and compares; each rank runs one --mode:
//
//   equivalence  20 steps of a small model (units that do not divide by 3, 5 or 7, so
//                shards are padded): losses within 1e-5 relative of the single-rank run,
//                the gathered master weights at the end within 1e-5 (relative L2), and
//                per rank params + grads + optimizer equal to its TP slice's shards' exact
//                size, at most the slice's replicated figure / S plus padding, with at most two block
//                units unsharded at once. --repeat 2 runs the layout twice and needs
//                bitwise-identical losses. --activations checkpoint or offload:H runs the
//                ranks with activation checkpointing (and offload at horizon H) against
//                the same single-rank run without either. --dropout P trains both with
//                dropout, whose masks must drop the same elements in every layout.
//   kill         the last rank kills itself during a gather in step 3: every other rank
//                must fail within the timeout, naming the operation, the group and a peer.
//   limit        a per-rank memory limit (--limit-mib, as $MESHTRAIN_MEMORY_LIMIT_MIB) that
//                one rank holding the whole model cannot train under (the out-of-memory
//                error must name the category and the sizes) but the sharded ranks can,
//                with the same results as above.
//   reshard      the layout --from RANKS,NODES,TP,SHARD trains 10 of 20 steps and stops
//                after its checkpoint; the layout of --ranks, --tp and --shard resumes
//                from it: its weights right after loading equal the checkpoint's master
//                weights bit for bit, and its losses for steps 11-20 and final weights
//                match the uninterrupted single-rank run within 1e-5.

#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "api/manifest.h"
#include "api/model_shape.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/fabric/fabric_communicator.h"
#include "worker/launch/local_launcher.h"
#include "worker/model/parameters.h"
#include "worker/parallel/engine.h"
#include "worker/train/checkpoint.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace {

namespace fs = std::filesystem;
using namespace meshtrain;

constexpr int kSteps = 20, kSeq = 32, kAccumulation = 2;
constexpr int kExitNamedFailure = 3;

struct Options {
  std::string mode = "equivalence", dir, activations, from;
  int ranks = 2, nodes = 1, tp = 1, shard = 0, repeat = 1, limit_mib = 0;
  double dropout = 0;
};

int failures = 0;
void Expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

// The job: a small model whose units do not divide by 3, 5 or 7 (hidden 44: a block is
// 23804 elements, the root 12804), micro-batches of one sequence per rank.
nlohmann::json JobManifest(const Options& o, int nodes, int gpus, int tp, int shard, int micro_batch,
                           int ranks_in_batch) {
  nlohmann::json job = {
      {"apiVersion", "meshtrain.dev/v1alpha1"},
      {"kind", "TrainingJob"},
      {"metadata", {{"name", "engine-check"}}},
      {"spec",
       {{"image", "meshtrain:test"},
        {"nodes", nodes},
        {"gpusPerNode", gpus},
        {"parallelism", {{"tensorParallelDegree", tp}, {"hybridShardDegree", shard}, {"tensorParallelSeed", 5}}},
        {"model", {{"layers", 3}, {"heads", 4}, {"hidden", 44}, {"vocabSize", 256},
                   {"seqLen", kSeq}, {"dropout", o.dropout}}},
        {"data", {{"train", (fs::path(o.dir) / "train.bin").string()}}},
        {"training",
         {{"steps", kSteps}, {"microBatchSize", micro_batch},
          {"globalBatchTokens", ranks_in_batch * kSeq * kAccumulation}, {"learningRate", 3e-3}, {"warmupSteps", 2},
          {"weightDecay", 0.1}, {"gradClip", 1.0}, {"seed", 7}, {"precision", "fp32"}, {"evalInterval", 0}}}}}};
  return job;
}

api::TrainingJob CheckedJob(const nlohmann::json& manifest) {
  const api::CheckedJob checked = api::CheckTrainingJob(manifest, "engine-check", 0);
  if (!checked.ok()) throw std::runtime_error("job: " + checked.errors.front().ToString());
  return checked.job;
}

struct Run {
  std::vector<double> losses;
  std::vector<float> weights;
};

Run Train(train::Trainer& trainer) {
  Run run;
  trainer.Run([&](const train::StepReport& r) { run.losses.push_back(r.loss); });
  run.weights = trainer.Weights();
  return run;
}

template <class T>
void WriteVector(const fs::path& path, const std::vector<T>& values) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(values.data()),
                                              std::streamsize(values.size() * sizeof(T)));
}

template <class T>
std::vector<T> ReadVector(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

// Kills this process the n-th time a gather of `unit` begins.
class KillDuringGather : public parallel::ScheduleObserver {
 public:
  KillDuringGather(int unit, int n) : unit_(unit), n_(n) {}
  void Begin(parallel::Op op, int unit) override {
    if (op == parallel::Op::kGather && unit == unit_ && ++seen_ == n_) ::raise(SIGKILL);
  }
  void End(parallel::Op, int) override {}

 private:
  int unit_, n_, seen_ = 0;
};

constexpr int kReshardStep = 10;
struct StopRun {};

int RunRank(const Options& o) {
  const comm::WorkerEnvironment env = comm::WorkerEnvironment::FromEnvironment();
  const api::TrainingJob job = CheckedJob(nlohmann::json::parse(std::ifstream(fs::path(o.dir) / "job.json")));
  comm::Rendezvous rendezvous = comm::JoinRendezvous(env, std::chrono::seconds(60));
  auto world = comm::ConnectFabric(rendezvous.table, env.rank, rendezvous.store, comm::FabricOptions::FromEnvironment());
  train::Trainer trainer(job, world.get());
  if (o.mode == "reshard" && !trainer.resumed_from()) {
    // The first layout: train to the checkpoint and stop, as a failure would stop it.
    try {
      trainer.Run([](const train::StepReport& r) {
        if (r.step == kReshardStep) throw StopRun{};
      });
    } catch (const StopRun&) {
    }
    world->Barrier()->Wait();
    return 0;  // the Trainer's destructor waits for the checkpoint's files
  }
  if (o.mode == "reshard") {
    std::vector<float> resumed = trainer.Weights();
    if (env.rank == 0) WriteVector(fs::path(o.dir) / "resumed.bin", resumed);
  }
  auto& engine = dynamic_cast<parallel::ShardedEngine&>(trainer.model());
  // Step 3's forward: each step gathers every block twice per micro-batch.
  KillDuringGather kill(2, 2 * kAccumulation * 2 + 1);
  if (o.mode == "kill" && env.rank == env.world_size - 1) engine.set_observer(&kill);
  Run run;
  try {
    run = Train(trainer);
  } catch (const comm::CommError& e) {
    const std::string message = e.what();
    std::fprintf(stderr, "rank %d: %s\n", env.rank, message.c_str());
    const bool named = message.find("all_gather") != std::string::npos && message.find("shard{") != std::string::npos &&
                       message.find(" rank ") != std::string::npos;
    return o.mode == "kill" && named ? kExitNamedFailure : 1;
  }
  const train::MemoryReport m = trainer.memory();
  std::ofstream(fs::path(o.dir) / ("rank" + std::to_string(env.rank) + ".txt"))
      << m.params << " " << m.grads << " " << m.optimizer << " " << m.gathered << " " << engine.peak_unsharded_blocks()
      << "\n";
  if (env.rank == 0) {
    WriteVector(fs::path(o.dir) / "losses.bin", run.losses);
    WriteVector(fs::path(o.dir) / "weights.bin", run.weights);
  }
  world->Barrier()->Wait();
  return 0;
}

double RelativeL2(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), norm += double(b[i]) * b[i];
  return std::sqrt(diff / norm);
}

launch::LaunchResult Launch(const Options& o, int argc, char** argv, bool kill) {
  launch::LocalLaunch launch;
  launch.nodes = o.nodes;
  launch.ranks_per_node = o.ranks / o.nodes;
  launch.command = launch::SelfCommand(argc, argv);
  launch.environment["OMP_NUM_THREADS"] = "1";
  if (o.limit_mib > 0) launch.environment["MESHTRAIN_MEMORY_LIMIT_MIB"] = std::to_string(o.limit_mib);
  launch.timeout = std::chrono::minutes(5);
  if (kill) {
    launch.stop_others_on_failure = false;
    launch.environment["MESHTRAIN_COMM_TIMEOUT"] = "3";
    launch.timeout = std::chrono::seconds(60);
  }
  return launch::LaunchLocal(launch, std::cerr);
}

// The reshard mode's driver: the --from layout writes the checkpoint, this layout resumes.
int DriveReshard(const Options& o, int argc, char** argv) {
  Options from = o;
  if (std::sscanf(o.from.c_str(), "%d,%d,%d,%d", &from.ranks, &from.nodes, &from.tp, &from.shard) != 4) {
    throw std::invalid_argument("--from must be RANKS,NODES,TP,SHARD, got " + o.from);
  }
  train::WriteTextAsTokenFiles(MESHTRAIN_CORPUS, (fs::path(o.dir) / "train.bin").string(),
                               (fs::path(o.dir) / "val.bin").string(), 0.1);
  // 12 sequences a micro-step (2 a step) whatever the layout, so both train the same batches.
  const fs::path checkpoints = fs::path(o.dir) / "checkpoints";
  auto job_of = [&](const Options& l) {
    nlohmann::json job = JobManifest(l, l.nodes, l.ranks / l.nodes, l.tp, l.shard, 12 / (l.ranks / l.tp), 12);
    job["spec"]["checkpoint"] = {{"path", checkpoints.string()}, {"interval", kReshardStep}, {"keep", 2}};
    return job;
  };
  std::ofstream(fs::path(o.dir) / "job.json") << job_of(from).dump(2);
  if (Launch(from, argc, argv, false).status != 0) return 1;
  std::string written_directory;
  for (const train::CheckpointListing& c : train::ListCheckpoints(checkpoints.string(), false)) {
    if (c.step == kReshardStep) written_directory = c.directory;
  }
  const train::LoadedCheckpoint written =
      train::LoadCheckpoint(written_directory, api::ShapeOf(CheckedJob(job_of(o)).spec.model));
  std::ofstream(fs::path(o.dir) / "job.json", std::ios::trunc) << job_of(o).dump(2);
  if (Launch(o, argc, argv, false).status != 0) return 1;

  train::Trainer reference_trainer(CheckedJob(JobManifest(o, 1, 1, 1, 1, 12, 12)));
  const Run reference = Train(reference_trainer);
  const std::vector<float> resumed = ReadVector<float>(fs::path(o.dir) / "resumed.bin");
  const std::vector<double> losses = ReadVector<double>(fs::path(o.dir) / "losses.bin");
  const std::vector<float> weights = ReadVector<float>(fs::path(o.dir) / "weights.bin");
  Expect(resumed == written.state.master, "the weights after loading are the checkpoint's, bit for bit");
  Expect(losses.size() == size_t(kSteps - kReshardStep), "losses of the steps after the checkpoint");
  double worst = 0;
  for (size_t i = 0; i < losses.size(); ++i) {
    const double want = reference.losses[size_t(kReshardStep) + i];
    worst = std::max(worst, std::abs(losses[i] - want) / std::abs(want));
  }
  const double weight_error = weights.size() == reference.weights.size() ? RelativeL2(weights, reference.weights) : 1;
  std::printf("%d ranks (T=%d, S=%d) -> %d ranks (T=%d, S=%d) at step %d: weights after loading %s; steps %d-%d worst "
              "loss error %.2e, final weights %.2e\n",
              from.ranks, from.tp, from.shard, o.ranks, o.tp, o.shard, kReshardStep,
              resumed == written.state.master ? "bitwise equal" : "DIFFERENT", kReshardStep + 1, kSteps, worst,
              weight_error);
  Expect(worst <= 1e-5, "losses within 1e-5 relative of the single-rank run");
  Expect(weight_error <= 1e-5, "final weights within 1e-5 of the single-rank run");
  std::printf("reshard: %s\n", failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}

int Drive(const Options& o, int argc, char** argv) {
  if (o.mode == "reshard") return DriveReshard(o, argc, argv);
  const int dp = o.ranks / o.tp, S = o.shard == 0 ? dp : o.shard;
  const auto split = train::WriteTextAsTokenFiles(MESHTRAIN_CORPUS, (fs::path(o.dir) / "train.bin").string(),
                                                  (fs::path(o.dir) / "val.bin").string(), 0.1);
  (void)split;
  nlohmann::json ranks_job = JobManifest(o, o.nodes, o.ranks / o.nodes, o.tp, o.shard, 1, dp);
  if (!o.activations.empty()) {
    nlohmann::json& parallelism = ranks_job["spec"]["parallelism"];
    parallelism["activationCheckpointing"] = true;
    if (o.activations.starts_with("offload:")) {
      parallelism["activationOffloading"] = true;
      parallelism["activationLoadingHorizon"] = std::atoi(o.activations.c_str() + 8);
    } else if (o.activations != "checkpoint") {
      throw std::invalid_argument("--activations must be checkpoint or offload:H, got " + o.activations);
    }
  }
  std::ofstream(fs::path(o.dir) / "job.json") << ranks_job.dump(2);
  // The reference: one rank, the same global batch in micro-batches of `dp` sequences.
  const api::TrainingJob single = CheckedJob(JobManifest(o, 1, 1, 1, 1, dp, dp));

  if (o.mode == "kill") {
    const launch::LaunchResult result = Launch(o, argc, argv, true);
    for (const auto& exit : result.exits) {
      const int expected = exit.rank == o.ranks - 1 ? 128 + SIGKILL : kExitNamedFailure;
      std::printf("rank %d exited %d (expected %d)\n", exit.rank, exit.status, expected);
      Expect(exit.status == expected, "rank " + std::to_string(exit.rank) + "'s exit");
    }
    Expect(int(result.exits.size()) == o.ranks, "every rank exited");
    return failures == 0 ? 0 : 1;
  }

  if (o.mode == "limit") {
    ::setenv("MESHTRAIN_MEMORY_LIMIT_MIB", std::to_string(o.limit_mib).c_str(), 1);
    try {  // one rank of the same micro-batch holding the whole model: the replicated layout
      train::Trainer replicated(CheckedJob(JobManifest(o, 1, 1, 1, 1, 1, 1)));
      replicated.Step();
      Expect(false, "the single-rank model trained under " + std::to_string(o.limit_mib) + " MiB");
    } catch (const runtime::OutOfMemory& e) {
      const std::string message = e.what();
      std::printf("one rank under %d MiB: %s\n", o.limit_mib, message.c_str());
      Expect(message.find("would pass the limit of " + std::to_string(o.limit_mib) + ".0 MiB") != std::string::npos &&
                 message.find(" in use") != std::string::npos,
             "the error names the limit and what is in use: " + message);
    }
    ::unsetenv("MESHTRAIN_MEMORY_LIMIT_MIB");  // the reference below trains without it
  }

  train::Trainer reference_trainer(single);
  const Run reference = Train(reference_trainer);
  std::vector<std::vector<double>> repeats;
  for (int r = 0; r < o.repeat; ++r) {
    const launch::LaunchResult result = Launch(o, argc, argv, false);
    if (result.status != 0) {
      std::printf("%s: the ranks failed (status %d)\n", o.mode.c_str(), result.status);
      return 1;
    }
    repeats.push_back(ReadVector<double>(fs::path(o.dir) / "losses.bin"));
  }
  const std::vector<double>& losses = repeats.front();
  const std::vector<float> weights = ReadVector<float>(fs::path(o.dir) / "weights.bin");
  Expect(losses.size() == reference.losses.size(), "losses of every step");
  double worst = 0;
  for (size_t i = 0; i < losses.size() && i < reference.losses.size(); ++i) {
    worst = std::max(worst, std::abs(losses[i] - reference.losses[i]) / std::abs(reference.losses[i]));
  }
  const double weight_error = weights.size() == reference.weights.size() ? RelativeL2(weights, reference.weights) : 1;
  std::printf("%d ranks, T=%d, S=%d, R=%d%s, dropout %g: loss %.6f -> %.6f (one rank %.6f -> %.6f); worst loss error %.2e, "
              "weights %.2e\n",
              o.ranks, o.tp, S, dp / S, o.activations.empty() ? "" : (", " + o.activations).c_str(), o.dropout,
              losses.front(), losses.back(), reference.losses.front(),
              reference.losses.back(), worst, weight_error);
  Expect(worst <= 1e-5, "losses within 1e-5 relative of the single-rank run");
  Expect(weight_error <= 1e-5, "master weights within 1e-5 of the single-rank run");
  Expect(reference.losses.back() < reference.losses.front() - 0.5, "the model learns");
  for (size_t r = 1; r < repeats.size(); ++r) Expect(repeats[r] == repeats[0], "a second run repeats the losses bit for bit");

  for (int rank = 0; rank < o.ranks; ++rank) {
    // Memory: each unit of the rank's TP slice has shards of ceil(n / S) floats, in four
    // buffers (master, grads, m, v).
    const model::ParameterLayout layout(api::ShapeOf(single.spec.model), rank % o.tp, o.tp);
    int64_t sharded = 0, replicated = 0, padding = 0;
    for (int u = 0; u < layout.units(); ++u) {
      const int64_t n = layout.Unit(u).second - layout.Unit(u).first, shard = (n + S - 1) / S;
      sharded += 4 * int64_t(runtime::CachingAllocator::RoundedSize(size_t(shard) * 4));
      replicated += 4 * int64_t(runtime::CachingAllocator::RoundedSize(size_t(n) * 4));
      padding += 4 * (512 + 4 * S);  // the shard's padding and the allocator's rounding, per buffer
    }
    std::ifstream in(fs::path(o.dir) / ("rank" + std::to_string(rank) + ".txt"));
    int64_t params = 0, grads = 0, optimizer = 0, gathered = 0, peak_blocks = 0;
    in >> params >> grads >> optimizer >> gathered >> peak_blocks;
    const int64_t state = params + grads + optimizer;
    if (rank == 0) {
      std::printf("rank 0: params + grads + optimizer %lld bytes (its TP slice replicated %lld, / S = %lld), gathered "
                  "peak %lld, at most %lld blocks unsharded\n",
                  (long long)state, (long long)replicated, (long long)(replicated / S), (long long)gathered,
                  (long long)peak_blocks);
    }
    Expect(state == sharded, "rank " + std::to_string(rank) + ": params + grads + optimizer are the shards' size");
    Expect(state <= replicated / S + padding, "rank " + std::to_string(rank) + ": at most replicated / S plus padding");
    Expect(gathered > 0 && peak_blocks >= 1 && peak_blocks <= 2,
           "rank " + std::to_string(rank) + ": at most two blocks unsharded");
  }
  std::printf("%s: %s\n", o.mode.c_str(), failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--mode") o.mode = value;
    else if (flag == "--ranks") o.ranks = std::atoi(value.c_str());
    else if (flag == "--nodes") o.nodes = std::atoi(value.c_str());
    else if (flag == "--shard") o.shard = std::atoi(value.c_str());
    else if (flag == "--tp") o.tp = std::atoi(value.c_str());
    else if (flag == "--dropout") o.dropout = std::atof(value.c_str());
    else if (flag == "--from") o.from = value;
    else if (flag == "--repeat") o.repeat = std::atoi(value.c_str());
    else if (flag == "--limit-mib") o.limit_mib = std::atoi(value.c_str());
    else if (flag == "--activations") o.activations = value;
    else if (flag == "--dir") o.dir = value;
  }
  try {
    if (comm::WorkerEnvironment::Present()) return RunRank(o);
    if (o.ranks % o.nodes != 0) {
      std::fprintf(stderr, "--ranks must be a multiple of --nodes\n");
      return 2;
    }
    const fs::path dir = fs::temp_directory_path() / ("meshtrain-engine-check-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    o.dir = dir.string();
    // The ranks find the job and write their results in the same directory.
    std::vector<char*> args(argv, argv + argc);
    std::string dir_flag = "--dir", dir_value = o.dir;
    args.push_back(dir_flag.data());
    args.push_back(dir_value.data());
    const int status = Drive(o, int(args.size()), args.data());
    fs::remove_all(dir);
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "engine_check: %s\n", e.what());
    return 1;
  }
}
