// The ranks of one fabric world as threads of the test's own process: a Store on a free
// loopback port, a rank table of virtual nodes (launch::VirtualRankTable), and a thread
// per rank that connects (comm::ConnectFabric) and runs the test's body on its world.
// Peers on one virtual node talk over the intra-node provider (shm by default), peers on
// different ones over the inter-node one (tcp;ofi_rxm here), as separate processes would.
//
// Thread-safety: RunFabricRanks may be called from any thread; `body` runs on several
// at once (one per rank), so what it shares it must guard; gtest's EXPECT_* may be used.

#pragma once

#include <functional>

#include "worker/comm/communicator.h"
#include "worker/comm/fabric/fabric_communicator.h"

namespace meshtrain::testing {

// Runs body(world) on `ranks` ranks spread evenly over `nodes` virtual nodes, and
// returns once every rank's body has returned and its world has closed. Throws
// std::runtime_error naming the rank and its error when a rank's connect or body threw
// (the first such, after all threads have ended). REQUIRES: nodes divides ranks.
void RunFabricRanks(int ranks, int nodes, const comm::FabricOptions& options,
                    const std::function<void(comm::Communicator& world)>& body);

}  // namespace meshtrain::testing
