#include "tests/support/fabric_ranks.h"

#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "worker/comm/store.h"
#include "worker/launch/local_launcher.h"

namespace meshtrain::testing {

void RunFabricRanks(int ranks, int nodes, const comm::FabricOptions& options,
                    const std::function<void(comm::Communicator& world)>& body) {
  if (nodes < 1 || ranks < 1 || ranks % nodes != 0) {
    throw std::invalid_argument("RunFabricRanks: " + std::to_string(ranks) + " ranks on " + std::to_string(nodes) +
                                " nodes");
  }
  comm::StoreServer server("127.0.0.1", 0);
  const std::string coordinator = "127.0.0.1:" + std::to_string(server.port());
  const api::RankTable table = launch::VirtualRankTable(nodes, ranks / nodes);
  std::mutex mutex;
  std::string first_error;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto store = std::make_shared<comm::StoreClient>(coordinator, std::chrono::seconds(10));
        std::unique_ptr<comm::Communicator> world = comm::ConnectFabric(table, rank, store, options);
        body(*world);
      } catch (const std::exception& error) {
        std::lock_guard lock(mutex);
        if (first_error.empty()) first_error = "rank " + std::to_string(rank) + ": " + error.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  if (!first_error.empty()) throw std::runtime_error(first_error);
}

}  // namespace meshtrain::testing
