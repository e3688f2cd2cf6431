#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <filesystem>
#include <random>

#include <unistd.h>
#include <thread>

#include <spdlog/spdlog.h>

#include "api/environment.h"
#include "api/worker_contract.h"
#include "api/layout.h"
#include "cli/commands.h"
#include "cli/job_report.h"
#include "cli/plan_report.h"
#include "operator/scheduler/placement.h"
#include "operator/scheduler/planner.h"
#include "worker/runtime/memory.h"
#include "worker/launch/local_launcher.h"
#include "worker/launch/memory_file.h"
#include "worker/train/configuration_error.h"
#include "worker/train/devices.h"
#include "worker/train/run_report.h"
#include "worker/train/trainer.h"

namespace meshtrain::cli {

namespace env = api::worker::env;
namespace {

constexpr int kExitTrainingFailed = 1;  // as a rank that failed (worker/entry/rank.h)

// The job's nodes as virtual nodes of this machine, placed and ranked by the same
// scheduler code the operator uses. Cluster-only constraints (node selector,
// tolerations, EFA, required topology) do not apply here.
api::RankTable LocalRankTable(const api::TrainingJob& job) {
  scheduler::ClusterSnapshot local;
  for (int64_t i = 0; i < job.spec.nodes; ++i) {
    scheduler::ClusterNode node;
    node.name = "local-" + std::to_string(i);
    node.gpus = job.spec.gpus_per_node;
    local.nodes.push_back(std::move(node));
  }
  scheduler::PlacementRequest request = scheduler::PlacementRequest::ForJob(job);
  request.node_selector.clear();
  request.tolerations.clear();
  request.efa_per_node = 0;
  request.required = false;
  const scheduler::Placement placement = scheduler::Place(request, local);
  return scheduler::MakeRankTable(placement, job.spec.topology.levels, job.spec.gpus_per_node);
}

// The fields `spec` (as written) sets that act on pods and nodes, which only the operator
// has: "spec.runPolicy.suspend", ... spec.template.env is among them when `env_applies`
// is false (the job trains in this process, whose environment is already set).
std::vector<std::string> OperatorOnlyFields(const nlohmann::json& spec, bool env_applies) {
  static const std::pair<const char*, const char*> kFields[] = {
      {"runPolicy", "suspend"}, {"runPolicy", "activeDeadlineSeconds"}, {"runPolicy", "ttlSecondsAfterFinished"},
      {"runPolicy", "cleanPodPolicy"}, {"resources", "gpu"}, {"resources", "efa"}, {"template", "tolerations"},
      {"template", "nodeSelector"}, {"template", "volumes"}, {"template", "volumeMounts"}, {"template", "env"}};
  std::vector<std::string> set;
  for (const auto& [group, field] : kFields) {
    if (env_applies && std::string_view(field) == "env") continue;
    if (spec.contains(group) && spec[group].is_object() && spec[group].contains(field)) {
      set.push_back(std::string("spec.") + group + "." + field);
    }
  }
  if (spec.contains("topology") && spec["topology"].is_object() && spec["topology"].value("mode", "") == "Required") {
    set.push_back("spec.topology.mode Required");
  }
  return set;
}

// meshtrain-worker: $MESHTRAIN_WORKER, next to this program (installed), beside it in
// the build tree (cli/ and worker/), or from PATH.
std::string WorkerProgram() {
  if (const char* explicit_path = std::getenv("MESHTRAIN_WORKER")) return explicit_path;
  if (const std::filesystem::path self = api::ThisProgram(); !self.empty()) {
    for (const auto& candidate : {self.parent_path() / "meshtrain-worker",
                                  self.parent_path().parent_path() / "worker" / "meshtrain-worker"}) {
      if (std::filesystem::exists(candidate)) return candidate.string();
    }
  }
  return "meshtrain-worker";
}

// A Kubernetes-style uid: 32 random hex digits as 8-4-4-4-12.
std::string NewUid() {
  std::random_device random;
  std::string uid;
  for (int i = 0; i < 32; ++i) {
    if (i == 8 || i == 12 || i == 16 || i == 20) uid += '-';
    uid += "0123456789abcdef"[random() % 16];
  }
  return uid;
}

// Runs every rank as a process on the job's virtual nodes; they print their own progress.
// A failed rank, or a hang the ranks' heartbeats find (spec.runPolicy.hangTimeoutSeconds),
// restarts the whole local gang, which resumes from the newest checkpoint, up to
// spec.runPolicy.backoffLimit times, as the operator restarts a gang; a configuration
// error (exit 78) ends the run at once.
int RunRanks(const api::CheckedJob& job, const api::RankTable& table, int sample_tokens, bool resume, std::ostream& out) {
  // The ranks read the job as this run holds it (its uid, a planned layout; the source may
  // be a pipe) from memory, which no signal or cleaner of /tmp can leave behind or take away.
  launch::MemoryFile config("meshtrain-job", launch::MemoryFile::Sharing::kInherited);
  config.Write(job.written.dump(2) + "\n");
  launch::LocalLaunch launch;
  launch.nodes = int(job.job.spec.nodes);
  launch.ranks_per_node = int(job.job.spec.gpus_per_node);
  launch.rank_table = table;
  launch.job_name = job.job.metadata.name;
  launch.command = {WorkerProgram(), "train"};
  launch.environment[env::kConfig] = config.path();
  launch.environment[env::kConfigName] = job.source;
  launch.environment[env::kSampleTokens] = std::to_string(sample_tokens);
  launch.environment[env::kResume] = resume ? "1" : "0";
  // The ranks share this machine's cores; oversubscribed OpenMP threads spin against each other.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
    launch.environment["OMP_NUM_THREADS"] = std::to_string(std::max(1, cores / (launch.nodes * launch.ranks_per_node)));
  }
  for (const api::EnvVar& e : job.job.spec.template_.env) launch.environment[e.name] = e.value;  // the job's own win
  out << "  launching " << launch.nodes * launch.ranks_per_node << " ranks: " << launch.command[0] << " train"
      << std::endl;
  const int64_t backoff_limit = job.job.spec.run_policy.backoff_limit;
  for (int64_t restarts = 0;; ++restarts) {
    const launch::LaunchResult result = launch::LaunchLocal(launch, out);
    if (result.status == 0) return kExitOk;
    if (result.stop_signal != 0) return result.status;  // stopped from outside: no restart
    if (result.status == api::worker::kExitStopped) {
      // A rank was signalled on its own (not through this command): the gang stopped with it.
      out << "  the ranks were told to stop and stopped together, after a checkpoint where one is configured; "
             "not restarting"
          << std::endl;
      return result.status;
    }
    if (result.status == api::worker::kExitPermanent) return result.status;
    if (restarts == backoff_limit) {
      out << "  the gang failed " << restarts + 1 << " time(s); spec.runPolicy.backoffLimit is " << backoff_limit
          << std::endl;
      return result.status;
    }
    const auto failed = std::find_if(result.exits.begin(), result.exits.end(),
                                     [](const launch::RankExit& e) { return e.status != 0; });
    out << "  rank " << (failed == result.exits.end() ? -1 : failed->rank) << " failed with status " << result.status
        << (result.status == api::worker::kExitHang ? " (it found a hang: the stuck rank is named above)" : "")
        << "; restarting the gang from the newest checkpoint (restart " << restarts + 1 << " of " << backoff_limit
        << ", spec.runPolicy.backoffLimit)" << std::endl;
  }
}

// Trains a one-rank job in this process. A failure (an exception: a device fault, a file
// lost under it) restarts the training from the newest checkpoint up to
// spec.runPolicy.backoffLimit times, as RunRanks restarts a gang; a configuration error
// (a bad spec, data or init.from file, a model too large for memory) or a diverged loss
// ends the run at once with the status a rank gives it. (A crash or a hang of this process ends it: only a gang
// of rank processes is watched by heartbeats.)
int TrainHere(api::CheckedJob job, const runtime::DeviceChoice& where, int sample_tokens, std::ostream& out) {
  const int64_t backoff_limit = job.job.spec.run_policy.backoff_limit;
  if (const int64_t hang = job.job.spec.run_policy.hang_timeout_seconds; hang > 0) {
    out << "  note: one rank trains in this process, which no heartbeat watches: spec.runPolicy.hangTimeoutSeconds ("
        << hang << " s) applies to gangs of rank processes\n";
  }
  for (int64_t restarts = 0;; ++restarts) {
    std::optional<train::Trainer> trainer;
    std::optional<train::RunReport> report;
    try {
      train::RethrowConfigurationErrors(job.Where(), [&] { trainer.emplace(job.job, nullptr, where.device); });
      out << "  model: " << trainer->Describe() << "\n";
      report.emplace(out, *trainer, where.device);
      report->Started();
      trainer->Run([&](const train::StepReport& r) { report->Step(r); });
    } catch (const train::ConfigurationError& e) {
      out << "configuration error: " << e.what() << std::endl;
      return api::worker::kExitPermanent;
    } catch (const train::TrainingDiverged& e) {
      out << "stopped: " << e.what() << std::endl;  // a restart would diverge again
      return api::worker::kExitPermanent;
    } catch (const std::exception& e) {
      if (restarts == backoff_limit) {
        out << "  training failed " << restarts + 1 << " time(s), last: " << e.what()
            << "; spec.runPolicy.backoffLimit is " << backoff_limit << std::endl;
        return kExitTrainingFailed;
      }
      out << "  training failed: " << e.what() << "; restarting from the newest checkpoint (restart " << restarts + 1
          << " of " << backoff_limit << ", spec.runPolicy.backoffLimit)" << std::endl;
      continue;
    }
    report->Finished(job.job.spec.checkpoint.path);
    if (sample_tokens > 0) report->Sample(trainer->SampleText(sample_tokens, 1));
    return kExitOk;
  }
}

// spec.parallelism.mode auto: plans the layout for this machine (each rank's memory is
// spec.resources.memoryLimitMiB, or this machine's memory shared by the ranks) and
// replaces *job with the job of that layout.
int PlanHere(api::CheckedJob* job, std::ostream& out) {
  api::TrainingJobSpec& spec = job->job.spec;
  const int64_t world = spec.nodes * spec.gpus_per_node;
  const int64_t memory = spec.resources.memory_limit_mib
                             ? *spec.resources.memory_limit_mib << 20
                             : int64_t(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE) / world;
  std::vector<std::vector<std::string>> paths;
  for (const api::RankTableNode& node : LocalRankTable(job->job).nodes) paths.push_back(node.topology_path);
  const scheduler::PlanRequest request = scheduler::RequestFor(
      spec, paths, scheduler::LinkModel(spec.topology.levels), scheduler::CpuDevice(memory, scheduler::kCpuMatrixFlops));
  const scheduler::Plan plan = scheduler::PlanLayouts(request);
  if (!plan.best()) {
    out << job->Where() << ": spec.parallelism.mode auto: no layout fits\n";
    PrintPlan(request, plan, 5, std::nullopt, out);
    return kExitInvalid;
  }
  nlohmann::json manifest = job->written;
  manifest["spec"] = scheduler::ResolveWrittenSpec(manifest["spec"], plan.best()->choice);
  api::CheckedJob resolved = api::CheckTrainingJob(manifest, job->source + " (planned)", 0);
  if (!resolved.ok()) {
    PrintErrors(resolved, out);
    return kExitInvalid;
  }
  char line[300];
  std::snprintf(line, sizeof line, "  planned (spec.parallelism.mode auto): %s; predicted %s per rank, %.3f s a step\n",
                scheduler::Describe(plan.best()->choice).c_str(), runtime::FormatBytes(size_t(plan.best()->needed)).c_str(),
                plan.best()->step.seconds);
  out << line;
  *job = std::move(resolved);
  return kExitOk;
}

}  // namespace

int RunCommand(const RunOptions& options, std::ostream& out) {
  api::CheckedJob job;
  if (int status = LoadOneValidJob(options.file, "run", &job, out); status != kExitOk) return status;
  out << job.Where() << ": ok\n";
  // This run's identity, as the API server gives a new object one: its checkpoints carry
  // it, so that its restarts resume them even when spec.checkpoint.resume is false.
  job.written["metadata"]["uid"] = job.job.metadata.uid = NewUid();
  if (job.job.spec.parallelism.mode == "auto") {
    if (int status = PlanHere(&job, out); status != kExitOk) return status;
  }
  PrintWarnings(job, out);
  if (const auto min_nodes = job.job.spec.elastic.min_nodes; min_nodes && *min_nodes < job.job.spec.nodes) {
    out << "  note: spec.elastic.minNodes (" << *min_nodes << ") acts under the operator, which shrinks a gang that lost "
        << "nodes; here every node of the job runs on this machine\n";
  }
  const bool ranks_as_processes = api::ParallelLayout::ForSpec(job.job.spec).world() > 1;
  if (const std::vector<std::string> fields = OperatorOnlyFields(job.written.value("spec", nlohmann::json::object()),
                                                                  ranks_as_processes);
      !fields.empty()) {
    out << "  note: only the operator acts on";
    for (size_t i = 0; i < fields.size(); ++i) out << (i == 0 ? " " : ", ") << fields[i];
    out << " (pods and nodes); here they have no effect\n";
  }
  PrintLayout(job, /*groups=*/false, out);
  out << "  rank table on this machine:";
  const api::RankTable table = LocalRankTable(job.job);
  for (const api::RankTableNode& node : table.nodes) {
    out << " " << node.name << " ranks " << api::FormatRanks(std::vector<int>(node.ranks.begin(), node.ranks.end()))
        << ";";
  }
  out << "\n";
  // Rank 0's choice; every rank makes its own (the same one on one machine).
  const runtime::DeviceChoice where = train::ChooseDeviceHere(job.job.spec.training.precision, 0);
  if (!where.note.empty()) spdlog::warn(where.note);
  if (!options.resume) job.job.spec.checkpoint.resume = false;
  if (ranks_as_processes) {
    return RunRanks(job, table, options.sample_tokens, options.resume, out);
  }

  out << "  device: " << where.device.ToString() << ", "
      << (where.device.is_cuda() ? where.precision + " compute with fp32 master weights" : where.precision) << ", kernels "
      << train::KernelsOn(where.device) << "\n";
  return TrainHere(std::move(job), where, options.sample_tokens, out);
}

}  // namespace meshtrain::cli
