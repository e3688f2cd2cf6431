// `meshtrain-worker train`: one rank of a job, started by `meshtrain-worker launch` in a
// pod or by `meshtrain run` on one machine (docs/design.md, "How a job runs").
//
// The rank reads the worker environment and the job spec (MESHTRAIN_CONFIG), joins the
// rendezvous, connects the fabric communicator, trains, and exports its metrics. Local
// rank 0 of each node serves them on MESHTRAIN_METRICS_PORT (0 or unset: none), bound to
// MESHTRAIN_POD_IP when set, else to every interface. Rank 0 prints the progress.
//
// Exit status: 0 when training finished; api::worker::kExitPermanent (78), "do not
// restart", for a problem no restart can fix (a malformed environment, spec, data or
// init.from file, a libfabric provider the node lacks, a model too large for the rank's
// memory) or a diverged loss (train::TrainingDiverged: resumed, it would diverge again); api::worker::kExitHang (75) when its heartbeat watchdog
// found the gang hung (worker/comm/heartbeat.h: rank 0 names a stuck rank, the others a
// stuck rank 0); api::worker::kExitCommFailure (76) when a collective or Store call
// failed (most often a dead peer); 1 for anything else. The operator restarts the gang
// after any but 78.

#pragma once

#include <ostream>

namespace meshtrain::worker {

int RunRank(std::ostream& out);

}  // namespace meshtrain::worker
