#include "worker/entry/rank.h"

#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <optional>
#include <stdexcept>

#include "api/environment.h"
#include "api/worker_contract.h"
#include "api/manifest.h"
#include "api/model_shape.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/fabric/fabric_communicator.h"
#include "worker/comm/heartbeat.h"
#include "worker/kernels/cpu/blas_core.h"
#include "worker/metrics/training_metrics.h"
#include "worker/runtime/device_peak.h"
#include "worker/train/configuration_error.h"
#include "worker/train/cuda_plugin.h"
#include "worker/train/devices.h"
#include "worker/train/run_report.h"
#include "worker/train/trainer.h"

namespace meshtrain::worker {

namespace env = api::worker::env;
namespace {

// The bound on joining: every rank of a gang starts within it, or the gang fails.
constexpr comm::milliseconds kRendezvousTimeout{300'000};

// A problem no restart can fix: the environment, the spec or a file it names.
using ConfigError = train::ConfigurationError;

// kStopSignal (SIGUSR1) while the rank trains: kept for the Trainer's stop agreement (the
// launcher sends it for the operator's suspend). A second one ends the rank as the
// signal's default would.
std::atomic<int> stop_signal{0};

void AskToStop(int signal) {
  if (stop_signal.exchange(signal) != 0) {
    ::signal(signal, SIG_DFL);
    ::raise(signal);
  }
}

// While it lives, kStopSignal asks the rank to stop at the next step boundary instead of
// ending it; before and after, it ends the rank as its default does (a rank waiting in its
// rendezvous has nothing to save). SIGTERM and SIGINT end the rank at any time.
class StopOnSignal {
 public:
  StopOnSignal() {
    static_assert(api::worker::kStopSignal == SIGUSR1);
    struct sigaction action{};
    action.sa_handler = AskToStop;
    sigemptyset(&action.sa_mask);
    ::sigaction(api::worker::kStopSignal, &action, &previous_);
  }
  ~StopOnSignal() { ::sigaction(api::worker::kStopSignal, &previous_, nullptr); }
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

 private:
  struct sigaction previous_{};
};

// What a rank that stopped says of it (its failure file, rank 0's output): "stopped after
// step 12 (asked by ranks 0, 1); checkpoint of step 12 written under /ckpt".
std::string StoppedLine(const train::RunEnd& end, const std::string& path) {
  std::string line = "stopped after step " + std::to_string(end.step) + " (asked by rank" +
                     (end.asked.size() > 1 ? "s " : " ");
  for (size_t i = 0; i < end.asked.size(); ++i) line += (i ? ", " : "") + std::to_string(end.asked[i]);
  line += ")";
  if (end.wrote) line += "; checkpoint of step " + std::to_string(end.step) + " written under " + path;
  else if (end.checkpointed) line += "; step " + std::to_string(end.step) + " already had a checkpoint under " + path;
  else if (path.empty()) line += "; no checkpoint (spec.checkpoint.path is not set)";
  else line += "; no checkpoint (no step trained)";
  return line;
}

// The job at `path`, named `name` in messages.
api::CheckedJob LoadJob(const std::string& path, const std::string& name) {
  if (path.empty()) throw ConfigError("the worker environment lacks MESHTRAIN_CONFIG");
  std::vector<api::CheckedJob> jobs;
  try {
    jobs = api::LoadTrainingJobs(path, name, api::ModelDirectory::kRequired);
  } catch (const api::ManifestError& e) {
    throw ConfigError(e.what());
  }
  if (jobs.size() != 1) {
    throw ConfigError(name + " (MESHTRAIN_CONFIG): holds " + std::to_string(jobs.size()) +
                      " documents; a worker takes one TrainingJob");
  }
  if (!jobs[0].ok()) throw ConfigError(jobs[0].Where() + ": " + jobs[0].errors[0].ToString());
  return std::move(jobs[0]);
}

// The device's dense bf16 peak FLOP/s for MFU; 0 on the CPU, where none is known.
double DensePeakFlops(const runtime::Device& device) {
  if (!device.is_cuda()) return 0;
  const train::CudaPlugin* plugin = train::CudaPluginOrNull(nullptr);
  return plugin ? runtime::DenseBf16Peak(plugin->device_facts(device.index)).flops : 0;
}

int Train(std::ostream& out) {
  comm::WorkerEnvironment env;
  api::CheckedJob checked;
  comm::FabricOptions fabric;
  int metrics_port = 0, sample_tokens = 0;
  std::string config_name;  // the job file as messages name it
  try {
    env = comm::WorkerEnvironment::FromEnvironment();
    config_name = api::EnvironmentString(env::kConfigName, env.config);
    checked = LoadJob(env.config, config_name);
    fabric = comm::FabricOptions::FromEnvironment();
    metrics_port = int(api::EnvironmentInteger(env::kMetricsPort, 0, 65535, 0));
    sample_tokens = int(api::EnvironmentInteger(env::kSampleTokens, 0, 100000, 0));
  } catch (const std::runtime_error& e) {
    throw ConfigError(e.what());
  }
  api::TrainingJob job = checked.job;
  // `meshtrain run --no-resume` reaches its ranks through the environment.
  if (api::EnvironmentInteger(env::kResume, 0, 1, 1) == 0) job.spec.checkpoint.resume = false;
  // Every rank finds a bad spec or data file on its own, before it waits for the others,
  // so the whole gang exits 78 rather than some ranks dying of their peers' exit.
  train::RethrowConfigurationErrors(config_name, [&] { train::CheckTrainable(job, env.rank, env.world_size); });
  std::optional<metrics::TrainingMetrics> exported;
  if (env.local_rank == 0 && metrics_port > 0) {
    exported.emplace(env.job_name, env.rank, job.spec.training.steps, job.spec.training.global_batch_tokens);
    exported->Serve(api::EnvironmentString(env::kPodIp, "0.0.0.0"), metrics_port);
  }

  comm::Rendezvous rendezvous = comm::JoinRendezvous(env, kRendezvousTimeout);
  std::unique_ptr<comm::Communicator> world;
  try {
    world = comm::ConnectFabric(rendezvous.table, env.rank, rendezvous.store, fabric);
  } catch (const comm::ProviderUnavailable& e) {
    throw ConfigError(e.what());
  }
  // Started once every rank is connected, so a silent rank is stuck, not late; stopped
  // (destroyed) before rank 0's Store.
  comm::Watchdog watchdog({.coordinator = env.coordinator,
                           .key = rendezvous.key,
                           .rank = env.rank,
                           .world = env.world_size,
                           .stages = int(job.spec.parallelism.pipeline_parallel_degree),
                           .timeout = std::chrono::seconds(job.spec.run_policy.hang_timeout_seconds),
                           .on_stuck = {}});  // the default: name it and end the attempt

  const runtime::DeviceChoice where = train::ChooseDeviceHere(job.spec.training.precision, env.local_rank);
  std::string device_note;
  std::unique_ptr<comm::StreamCollectives> device_world;
  try {
    device_world = train::ConnectDeviceWorld(env, where.device, rendezvous, *world, fabric.timeout, &device_note);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  // Checkpoint writers meet rank 0 on a connection of their own: rank 0's waits on it
  // must not hold up anyone else's use of the Store.
  std::unique_ptr<comm::StoreClient> checkpoint_store;
  if (!job.spec.checkpoint.path.empty() && env.world_size > 1) {
    checkpoint_store = std::make_unique<comm::StoreClient>(env.coordinator, kRendezvousTimeout, rendezvous.key);
  }
  std::optional<train::Trainer> trainer;
  train::RethrowConfigurationErrors(config_name, [&] {
    trainer.emplace(job, world.get(), where.device, device_world.get(), checkpoint_store.get());
  });
  if (exported) {
    exported->Flops(api::ShapeOf(job.spec.model).TrainingFlopsPerToken(*job.spec.model.seq_len),
                    DensePeakFlops(where.device) * env.world_size);  // ranks share one kind of device    exported->DeviceInfo(where.device.ToString(), train::KernelsOn(where.device));
  }
  if (env.rank == 0) {
    for (const api::FieldError& w : checked.warnings) out << "warning: " << w.ToString() << std::endl;
    if (!where.note.empty()) out << "note: " << where.note << std::endl;
    if (!device_note.empty()) out << "note: " << device_note << std::endl;
    out << "job " << env.job_name << ": " << env.world_size << " rank(s) on " << env.nnodes << " node(s), "
        << job.spec.training.steps << " steps, rank 0 on " << where.device.ToString() << " in " << where.precision
        << ", kernels " << train::KernelsOn(where.device) << std::endl;
    if (!where.device.is_cuda()) {
      if (const std::string w = kernels::cpu::CurrentBlasCore().warning; !w.empty()) out << "warning: " << w << std::endl;
    }
    out << "rank 0 model: " << trainer->Describe() << std::endl;
  }
  train::RunReport printed(out, *trainer, where.device);  // by rank 0
  if (env.rank == 0) printed.Started();
  if (exported) {
    exported->Memory(trainer->accounting());
    if (trainer->resumed_from()) {
      exported->ResumedFrom(*trainer->resumed_from(), int64_t(trainer->checkpoint_warnings().size()));
    }
  }
  watchdog.Progress(comm::Phase::kTraining, trainer->resumed_from().value_or(0));
  train::RunEnd end;
  {
    const StopOnSignal stop_on_signal;
    end = trainer->Run(
        [&](const train::StepReport& step) {
          watchdog.Progress(comm::Phase::kTraining, step.step);
          if (exported) {
            exported->Step(step);
            exported->Memory(trainer->accounting());
            exported->Checkpoints(trainer->checkpoint_stats());
          }
          if (env.rank == 0) printed.Step(step);
        },
        [] { return stop_signal.load() != 0; });
  }
  watchdog.Progress(comm::Phase::kFinishing, job.spec.training.steps);
  if (exported) exported->Checkpoints(trainer->checkpoint_stats());  // the last one, written after its step
  if (end.stopped) {
    // Asked to stop: the gang stopped together after one step, with its checkpoint.
    const std::string line = StoppedLine(end, job.spec.checkpoint.path);
    if (env.rank == 0) out << "rank 0: " << line << std::endl;
    api::WriteFailureReason(line);
    world->Barrier()->Wait();  // rank 0 serves the Store: it leaves last
    return api::worker::kExitStopped;
  }
  if (env.rank == 0) printed.Finished(job.spec.checkpoint.path);
  if (sample_tokens > 0) {
    // Every rank samples: the forward gathers each unit from the shard group. The same
    // seed and weights make the same text everywhere; rank 0 prints it.
    const std::string sample = trainer->SampleText(sample_tokens, 1);
    if (env.rank == 0) printed.Sample(sample);
  }
  world->Barrier()->Wait();  // rank 0 serves the Store: it leaves last
  return 0;
}

}  // namespace

int RunRank(std::ostream& out) {
  // Says why on `out` and to the launcher (api::WriteFailureReason); returns `status`. The
  // launcher and the operator already say that the rank failed, with its status: the file
  // gets only why, and a permanent failure says which (a configuration error, or stopped).
  auto failed = [&out](const char* what, const std::exception& e, int status) {
    out << "rank " << api::EnvironmentString(env::kRank, "?") << ": " << what << ": " << e.what() << std::endl;
    api::WriteFailureReason(status == api::worker::kExitPermanent ? std::string(what) + ": " + e.what() : e.what());
    return status;
  };
  try {
    return Train(out);
  } catch (const ConfigError& e) {
    return failed("configuration error", e, api::worker::kExitPermanent);
  } catch (const train::TrainingDiverged& e) {
    // Resumed from its newest checkpoint, the same data would lead it the same way.
    return failed("stopped", e, api::worker::kExitPermanent);
  } catch (const comm::CommError& e) {
    return failed("failed", e, api::worker::kExitCommFailure);
  } catch (const comm::StoreError& e) {
    return failed("failed", e, api::worker::kExitCommFailure);
  } catch (const std::exception& e) {
    return failed("failed", e, 1);
  }
}

}  // namespace meshtrain::worker
