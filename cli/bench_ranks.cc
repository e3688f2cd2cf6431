#include "cli/bench_ranks.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <deque>
#include <fstream>
#include <random>
#include <thread>

#include "api/manifest.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/fabric/fabric_communicator.h"
#include "worker/launch/local_launcher.h"
#include "worker/train/devices.h"
#include "worker/train/token_file.h"

namespace meshtrain::cli {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

std::string Activations::Describe() const {
  return offload > 0 ? "offload, horizon " + std::to_string(offload) : checkpointing ? "checkpointing" : "keep all";
}

nlohmann::json BenchJob(const BenchTrainOptions& o, const std::string& data, int ranks, int nodes,
                        const RanksConfig& c, bool bf16) {
  const Activations& a = c.activations;
  nlohmann::json parallelism = {{"tensorParallelDegree", c.tp},
                                {"hybridShardDegree", c.shard},
                                {"activationCheckpointing", a.checkpointing || a.offload > 0}};
  if (a.offload > 0) parallelism.update({{"activationOffloading", true}, {"activationLoadingHorizon", a.offload}});
  if (c.pipeline.stages > 1) {
    parallelism.update({{"pipelineParallelDegree", c.pipeline.stages},
                        {"pipelineSchedule", api::PipelineScheduleName(c.pipeline.schedule)},
                        {"pipelineVirtualStages", c.pipeline.virtual_stages}});
  }
  if (c.context > 1) parallelism["contextParallelDegree"] = c.context;
  if (c.expert > 1) parallelism["expertParallelDegree"] = c.expert;
  nlohmann::json metadata = {{"name", "bench-train"}};
  if (c.keep_units_gathered) metadata["annotations"] = {{kKeepUnitsGatheredAnnotation, "true"}};
  return {{"apiVersion", "meshtrain.dev/v1alpha1"},
          {"kind", "TrainingJob"},
          {"metadata", metadata},
          {"spec",
           {{"image", "meshtrain"},
            {"nodes", nodes},
            {"gpusPerNode", ranks / nodes},
            {"parallelism", parallelism},
            {"model", o.layers > 0 ? nlohmann::json{{"preset", o.model}, {"seqLen", o.seq}, {"layers", o.layers}}
                                   : nlohmann::json{{"preset", o.model}, {"seqLen", o.seq}}},
            {"data", {{"train", data}}},
            {"training",
             {{"steps", o.steps + o.warmup}, {"warmupSteps", 1}, {"microBatchSize", c.MicroBatch(o)},
              {"globalBatchTokens", c.GlobalTokens(o)}, {"precision", bf16 ? "bf16" : "fp32"}}}}}};
}

std::filesystem::path WriteRandomTokens(int64_t tokens, const api::ModelShape& shape) {
  const std::filesystem::path data =
      std::filesystem::temp_directory_path() / ("meshtrain-bench-" + std::to_string(::getpid()) + ".bin");
  std::mt19937 rng(7);
  std::vector<uint32_t> random(size_t(tokens) + 1);
  for (uint32_t& t : random) t = rng() % uint32_t(shape.vocab_size);
  train::WriteTokenFile(data.string(), random);
  return data;
}

bool RefusedWithoutGpu(const std::string& device, const char* command, std::ostream& out) {
  std::string why;
  if (device != "cuda" || train::CudaDeviceCount(&why) > 0) return false;
  out << command << " --device cuda: " << why << "\n";
  return true;
}

int BenchTrainRank() {
  const comm::WorkerEnvironment env = comm::WorkerEnvironment::FromEnvironment();
  const api::CheckedJob job = api::LoadTrainingJobs(env.config).at(0);
  comm::Rendezvous rendezvous = comm::JoinRendezvous(env, std::chrono::seconds(60));
  const comm::FabricOptions fabric = comm::FabricOptions::FromEnvironment();
  auto world = comm::ConnectFabric(rendezvous.table, env.rank, rendezvous.store, fabric);
  // The job's precision says the device, as for meshtrain-worker: bf16 on the rank's GPU.
  const runtime::DeviceChoice where = train::ChooseDeviceHere(job.job.spec.training.precision, env.local_rank);
  std::string note;
  const std::unique_ptr<comm::StreamCollectives> device_world =
      train::ConnectDeviceWorld(env, where.device, rendezvous, *world, fabric.timeout, &note);
  if (env.rank == 0 && !note.empty()) std::fprintf(stderr, "note: %s\n", note.c_str());
  const auto& annotations = job.job.metadata.annotations;
  const auto keep = annotations.find(kKeepUnitsGatheredAnnotation);
  train::Trainer trainer(job.job, world.get(), where.device, device_world.get(), nullptr,
                         {.keep_units_gathered = keep != annotations.end() && keep->second == "true"});
  const int64_t steps = job.job.spec.training.steps, warmup = std::min<int64_t>(2, steps - 1);
  for (int64_t i = 0; i < warmup; ++i) trainer.Step();
  world->Barrier()->Wait();
  const auto start = Clock::now();
  parallel::CommStats seconds;
  for (int64_t i = warmup; i < steps; ++i) {
    const parallel::CommStats step = trainer.Step().comm;
    seconds.exposed += step.exposed;
    seconds.copy += step.copy;
  }
  world->Barrier()->Wait();
  const double measured = double(steps - warmup);
  const double step_seconds = SecondsSince(start) / measured;
  const train::MemoryReport m = trainer.memory();
  std::ofstream(env.config + ".rank" + std::to_string(env.rank))
      << step_seconds << " " << seconds.exposed / measured << " " << seconds.copy / measured << " " << m.params << " "
      << m.grads << " " << m.optimizer << " " << m.activations << " " << m.gathered << " " << m.offload << " "
      << trainer.accounting().peak_total() << "\n";
  return kExitOk;
}

std::optional<RanksResult> RunBenchRanks(const BenchTrainOptions& o, const std::vector<std::string>& self_argv,
                                         const std::string& data, const RanksConfig& config, std::ostream& out) {
  const RemovedOnExit job(std::filesystem::temp_directory_path() /
                          ("meshtrain-bench-" + std::to_string(::getpid()) + ".json"));
  std::ofstream(job.path()) << BenchJob(o, data, o.ranks, o.nodes, config, o.device == "cuda").dump(2);
  launch::LocalLaunch launch;
  launch.nodes = o.nodes;
  launch.ranks_per_node = o.ranks / o.nodes;
  launch.netbed = o.netbed;
  launch.netbed_hosts = config.hosts;
  launch.command = self_argv;
  launch.job_name = "bench-train";
  launch.environment["MESHTRAIN_CONFIG"] = job.string();
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  launch.environment["OMP_NUM_THREADS"] = std::to_string(std::max(1, cores / o.ranks));
  std::deque<RemovedOnExit> reports;  // each rank's, whether it wrote one or not
  for (int r = 0; r < o.ranks; ++r) reports.emplace_back(job.string() + ".rank" + std::to_string(r));
  const bool ok = launch::LaunchLocal(launch, out).status == 0;
  RanksResult result;
  for (int r = 0; r < o.ranks && ok; ++r) {
    std::ifstream in(reports[size_t(r)].path());
    double seconds = 0, exposed = 0, copy = 0;
    int64_t total = 0;
    train::MemoryReport m;
    in >> seconds >> exposed >> copy >> m.params >> m.grads >> m.optimizer >> m.activations >> m.gathered >> m.offload >>
        total;
    result.step_seconds = std::max(result.step_seconds, seconds);
    result.exposed_seconds = std::max(result.exposed_seconds, exposed);
    result.copy_seconds = std::max(result.copy_seconds, copy);
    result.peak_total = std::max(result.peak_total, total);
    train::MemoryReport& p = result.peak;
    for (auto [peak, rank] : {std::pair{&p.params, m.params}, {&p.grads, m.grads}, {&p.optimizer, m.optimizer},
                              {&p.activations, m.activations}, {&p.gathered, m.gathered}, {&p.offload, m.offload}}) {
      *peak = std::max(*peak, rank);
    }
  }
  if (!ok || result.step_seconds <= 0) return std::nullopt;
  result.tokens_per_second = double(config.GlobalTokens(o)) / result.step_seconds;
  return result;
}

}  // namespace meshtrain::cli
