// The contract between a worker and what starts and watches it (the operator's pods,
// `meshtrain run`, `meshtrain-worker launch`): its environment, its ports, its exit
// codes and the metric names the operator reads. Both sides use these names; nothing
// else spells them (docs/design.md, "How a job runs").
//
// Thread-safety: constants, and one pure function.

#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>

namespace meshtrain::api::worker {

// Exit status of a rank whose failure is permanent: do not restart. A restart would fail
// the same way: a malformed environment, spec, data or init.from file, a model too large
// for the rank's memory, or a loss that diverged (resumed from its newest checkpoint, the
// same data would lead it the same way). On it the operator fails the job at once, the
// node launcher ends its other ranks and `meshtrain run` stops; any other non-zero status
// restarts the gang. The value is EX_CONFIG of sysexits.h, the most common such cause.
inline constexpr int kExitPermanent = 78;
// Exit status of a rank that found the gang hung (EX_TEMPFAIL): rank 0 when a rank made no
// progress for spec.runPolicy.hangTimeoutSeconds, any other rank when rank 0 stopped
// answering (worker/comm/heartbeat.h). It restarts the gang like any other failure.
inline constexpr int kExitHang = 75;
// Exit status of a rank whose collective or Store call failed: most often the victim of
// another rank's failure, so the operator names a failure with another status first.
inline constexpr int kExitCommFailure = 76;
// The signal that asks a training rank to stop (SIGUSR1): the launcher sends it for the
// operator's suspend (a suspension, a Kueue eviction). SIGTERM still ends a rank at once,
// as a gang with a dead or hung rank needs.
inline constexpr int kStopSignal = 10;
// Exit status of a rank that was asked to stop (kStopSignal) and stopped at a step
// boundary with the whole gang, after a checkpoint of that step where
// spec.checkpoint.path is set and it trained since the last one; its failure file says at
// which step. Nothing failed: it is not restarted.
inline constexpr int kExitStopped = 79;
// The most of a failure reason (kFailureFile) that is kept: longer ones are cut.
inline constexpr size_t kFailureReasonBytes = 400;

// A failure reason as the rank writes it, the launcher reads it and the operator quotes it:
// one line (control characters become spaces) of at most kFailureReasonBytes bytes, cut
// at a UTF-8 character's boundary.
inline std::string FailureReasonLine(std::string_view text) {
  size_t cut = std::min(text.size(), kFailureReasonBytes);
  while (cut > 0 && cut < text.size() && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  std::string line(text.substr(0, cut));
  for (char& c : line) {
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  }
  return line;
}

inline constexpr int kCoordinatorPort = 29500;  // rank 0's rendezvous
inline constexpr int kMetricsPort = 9400;       // each node's local rank 0 serves /metrics here
// Each pod's launcher serves its control endpoint here (worker/launch/launcher_control.h):
// the operator restarts the ranks of a gang in place through it, not recreating the pods.
inline constexpr int kLauncherPort = 9401;

// The environment a worker reads.
namespace env {
inline constexpr const char* kJobName = "MESHTRAIN_JOB_NAME";
inline constexpr const char* kCoordinator = "MESHTRAIN_COORDINATOR";   // host:port of rank 0's rendezvous
inline constexpr const char* kConfig = "MESHTRAIN_CONFIG";             // the job spec (JSON or YAML)
// How messages name the job (default: kConfig's path): `meshtrain run` hands its ranks the
// job in memory, and names the user's file.
inline constexpr const char* kConfigName = "MESHTRAIN_CONFIG_NAME";
inline constexpr const char* kRankTable = "MESHTRAIN_RANK_TABLE";      // the placement's rank table (JSON)
// The job's rendezvous key (a file of at least 32 random bytes): the Store admits only
// clients that prove they hold it (worker/comm/store.h). Unset: it admits any client.
inline constexpr const char* kStoreKeyFile = "MESHTRAIN_STORE_KEY_FILE";
inline constexpr const char* kNodeRank = "MESHTRAIN_NODE_RANK";
inline constexpr const char* kNodes = "MESHTRAIN_NNODES";
inline constexpr const char* kRanksPerNode = "MESHTRAIN_NPROC_PER_NODE";
inline constexpr const char* kMetricsPort = "MESHTRAIN_METRICS_PORT";  // 0 or unset: no metrics served
inline constexpr const char* kPodIp = "MESHTRAIN_POD_IP";              // the address metrics are served on
inline constexpr const char* kSampleTokens = "MESHTRAIN_SAMPLE_TOKENS";  // rank 0 prints a sample this long
// The sample's length: meshtrain run's default, and the operator's for a job that names
// spec.model.tokenizer (it asks for samples as text; without it, pods sample nothing).
inline constexpr int kDefaultSampleTokens = 300;
// 0: as spec.checkpoint.resume false, whatever the spec says: resume only this run's own
// checkpoints (those of the job's metadata.uid), which only a restart finds.
inline constexpr const char* kResume = "MESHTRAIN_RESUME";
// A file holding the secret (at least 16 characters) that the operator's instructions to
// this pod's launcher carry: under the operator, the pod's own token from the job's Secret,
// mounted read-only. Unset or empty: the launcher serves no control endpoint and exits when
// a rank fails, so the operator recreates the pods.
inline constexpr const char* kLauncherTokenFile = "MESHTRAIN_LAUNCHER_TOKEN_FILE";
// The port of the launcher's control endpoint; unset: kLauncherPort (the operator's). For
// tests that run several launchers on one machine.
inline constexpr const char* kLauncherPort = "MESHTRAIN_LAUNCHER_PORT";
// How long a launcher whose ranks failed waits for the operator's next attempt (default
// 60, 0 to 3600 seconds), counted from the operator's last instruction; past it, it exits
// with the failed rank's status, and the pod's failure makes the operator recreate the pods.
inline constexpr const char* kLauncherHoldSeconds = "MESHTRAIN_LAUNCHER_HOLD_SECONDS";
// The attempt of the gang (an integer >= 0, default 0): the launcher starts its ranks at
// the pod's value and sets it in each rank's environment, one more at each in-place restart.
inline constexpr const char* kAttempt = "MESHTRAIN_ATTEMPT";
// "1": the launcher starts ready at its attempt and starts its ranks only at the operator's
// start (POST /attempt/start), with the rest of the gang: a pod that replaces a lost one of
// a gang restarting in place. Unset or "0": it starts them at once.
inline constexpr const char* kLauncherHeld = "MESHTRAIN_LAUNCHER_HELD";
// A file the launcher names for each rank: a rank that fails writes there, before it
// exits, one line saying why (api::WriteFailureReason), which its exit status alone
// cannot: the rank a hang detector found stuck, the peer a collective lost. The launcher
// reports it with the exit status (GET /attempt "reason"), and the operator's Restarted
// Event quotes it. Unset: the rank writes nothing.
inline constexpr const char* kFailureFile = "MESHTRAIN_FAILURE_FILE";
// torchrun's names, set per rank by the launcher.
inline constexpr const char* kRank = "RANK";
inline constexpr const char* kWorldSize = "WORLD_SIZE";
inline constexpr const char* kLocalRank = "LOCAL_RANK";
inline constexpr const char* kMasterAddr = "MASTER_ADDR";
inline constexpr const char* kMasterPort = "MASTER_PORT";
inline constexpr const char* kLocalWorldSize = "LOCAL_WORLD_SIZE";
inline constexpr const char* kTorchNodeRank = "NODE_RANK";
}  // namespace env

// The metrics the operator reads from rank 0 for a TrainingJob's status.progress.
namespace metric {
inline constexpr const char* kStep = "meshtrain_train_step";                 // optimizer steps done
inline constexpr const char* kSteps = "meshtrain_train_steps";               // steps in the job
inline constexpr const char* kLoss = "meshtrain_train_loss";
inline constexpr const char* kTokensPerSecond = "meshtrain_train_tokens_per_second";
inline constexpr const char* kTokensPerStep = "meshtrain_train_tokens_per_step";
inline constexpr const char* kResumedFromStep = "meshtrain_train_resumed_from_step";  // -1: none
inline constexpr const char* kResumeDamagedCheckpoints = "meshtrain_train_resume_damaged_checkpoints";
inline constexpr const char* kCheckpointLastStep = "meshtrain_checkpoint_last_step";  // -1: none yet
}  // namespace metric

}  // namespace meshtrain::api::worker
