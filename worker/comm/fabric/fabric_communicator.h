// The fabric backend: Communicators over libfabric RDM endpoints (docs/design.md,
// "Collectives").
//
// Each rank opens an intra-node endpoint (shm by default) when it has peers on its
// node and an inter-node endpoint (efa where libfabric offers it, else tcp;ofi_rxm)
// when it has peers on other nodes, publishes their addresses through the Store and
// reaches every peer over the one that fits. A communicator runs its operations in
// order on its own thread; groups share the endpoints and progress each other's
// messages.
//
// Algorithm choice (FabricOptions::algorithm = auto): a group laid out node by node
// over 2+ nodes with 2+ members per node uses the hierarchical algorithms for messages
// of at least small_bytes; otherwise log-depth below small_bytes and rings above.
// A forced algorithm applies to every operation that has one (hierarchical falls back
// to rings on a group without that shape).

#pragma once

#include <memory>
#include <string>

#include "api/rank_table.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"

namespace meshtrain::comm {

enum class Algorithm { kAuto, kRing, kLogDepth, kHierarchical };
const char* AlgorithmName(Algorithm algorithm);  // "auto", "ring", "log", "hierarchical"
// Throws CommError for an unknown name.
Algorithm ParseAlgorithm(const std::string& name);

struct FabricOptions {
  std::string intra_provider = "shm";
  std::string inter_provider;  // empty: efa if libfabric offers it, else "tcp;ofi_rxm"
  milliseconds timeout = kDefaultTimeout;  // bound on every operation
  Algorithm algorithm = Algorithm::kAuto;
  size_t small_bytes = 64 << 10;  // below: log-depth algorithms
  size_t chunk_bytes = 1 << 20;   // ring pipeline chunk
  bool register_always = false;   // register buffers even if the provider does not ask

  // Defaults overridden by MESHTRAIN_FABRIC_INTRA_PROVIDER, MESHTRAIN_FABRIC_INTER_PROVIDER,
  // MESHTRAIN_COMM_TIMEOUT (seconds), MESHTRAIN_COMM_ALGORITHM, MESHTRAIN_COMM_SMALL_BYTES,
  // MESHTRAIN_COMM_CHUNK_BYTES and MESHTRAIN_FABRIC_REGISTER=1. Throws CommError naming a
  // malformed variable.
  static FabricOptions FromEnvironment();
};

// What a fabric communicator reports about its endpoints (for logs and tests).
struct FabricInfo {
  std::string intra_provider, inter_provider;  // opened providers, empty if not needed
  int64_t registrations = 0;                   // memory registrations made so far
};

// Connects this rank (`rank` of the world in `table`) through `store`. Every rank of
// the table calls it. Throws CommError (or StoreError) saying what failed.
std::unique_ptr<Communicator> ConnectFabric(const api::RankTable& table, int rank,
                                            std::shared_ptr<StoreClient> store,
                                            const FabricOptions& options);

// The endpoints behind a fabric communicator; REQUIRES: made by ConnectFabric or its NewGroup.
FabricInfo InfoOf(const Communicator& communicator);

}  // namespace meshtrain::comm
