// `meshtrain-worker launch`: the entry point of a pod (docs/design.md, "How a job runs").
// It starts one rank process per GPU of this node with the torchrun variables (RANK,
// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK) and MESHTRAIN_ATTEMPT added to the
// pod's environment, and passes the kubelet's SIGTERM on to them.
//
// When a rank fails, it stops the others. Without a token it then exits with the failed
// rank's status, so the pod fails and the operator recreates the gang's pods. With one
// (in the file MESHTRAIN_LAUNCHER_TOKEN_FILE names) it serves the operator's control endpoint
// (launcher_control.h) and holds: the operator stops every pod's ranks and starts the
// next attempt in place; if no instruction comes within the hold, it exits as without a
// token. Either way a rank's permanent-error code (78) ends the launcher at once with 78,
// which reaches the operator unchanged, and every rank exiting 0 ends it with 0.
//
// A suspend from the operator (POST /attempt/suspend) sends the ranks kStopSignal
// (SIGUSR1), on which they stop together after one step with a checkpoint of it
// (kExitStopped); those still
// running after `grace` are killed, and the launcher reports how each ended, then holds
// until its pod is deleted.

#pragma once

#include <chrono>
#include <ostream>
#include <string>
#include <vector>

#include "api/worker_contract.h"
#include "worker/launch/process_group.h"

namespace meshtrain::launch {

// The ranks of this node from MESHTRAIN_NODE_RANK, MESHTRAIN_NNODES and
// MESHTRAIN_NPROC_PER_NODE. Throws std::runtime_error naming a missing or malformed variable.
std::vector<RankProcess> RanksOfThisNode();

struct NodeLaunch {
  std::vector<std::string> command;  // argv of every rank
  // SIGTERM (the kubelet's) or a suspend's kStopSignal to SIGKILL; below the pod's 120 s
  // termination grace, so that ranks can checkpoint (the operator waits 130 s at most).
  std::chrono::milliseconds grace{100'000};
  int attempt = 0;  // the first attempt's number
  // Ready at `attempt`, its ranks started by the operator's start (with a token only).
  bool held = false;
  // The operator's secret; empty: no control endpoint, a failed rank ends the launcher.
  std::string token;
  std::string control_host = "0.0.0.0";
  int control_port = api::worker::kLauncherPort;
  // How long a launcher waits for the operator's next instruction once its ranks failed,
  // or once they were stopped for an attempt that has not been started; each instruction
  // renews it.
  std::chrono::milliseconds hold{60'000};
  // SIGTERM to SIGKILL when ranks are stopped for a restart: a gang with a dead rank has
  // nothing to save (its ranks wait in collectives), and every moment here is recovery time.
  std::chrono::milliseconds restart_grace{100};
};

// The launch of this pod that the worker contract's environment asks for (the token from
// its file, MESHTRAIN_ATTEMPT, MESHTRAIN_LAUNCHER_HELD, the hold, MESHTRAIN_POD_IP and the
// control port), with the ranks running `command`. Throws std::runtime_error naming a
// malformed variable, or the token's file when it cannot be read or is too short.
NodeLaunch NodeLaunchFromEnvironment(std::vector<std::string> command);

// Runs this node's ranks; returns the exit status for the pod. Throws std::runtime_error
// if it cannot start them or serve the control endpoint.
int LaunchNode(const NodeLaunch& launch, std::ostream& log);

}  // namespace meshtrain::launch
