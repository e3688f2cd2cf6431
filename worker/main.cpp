// meshtrain-worker: `launch` starts this node's ranks (a pod's command); `train` is one rank.

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "api/worker_contract.h"
#include "worker/entry/rank.h"
#include "worker/kernels/cpu/blas_core.h"
#include "worker/launch/local_launcher.h"
#include "worker/launch/node_launcher.h"

namespace {

constexpr const char* kUsage =
    "usage: meshtrain-worker launch [-- COMMAND [ARG...]]\n"
    "                                 start one rank per GPU of this node (the worker contract's environment);\n"
    "                                 each runs COMMAND if given (tests), else `meshtrain-worker train`\n"
    "       meshtrain-worker train    run one rank (RANK, LOCAL_RANK and WORLD_SIZE set too)\n";

}  // namespace

int main(int argc, char** argv) {
  // Before a rank runs a kernel, and so that the ranks a launcher starts inherit the choice
  // (worker/kernels/cpu/blas_core.h).
  meshtrain::kernels::cpu::StartWithBestBlasCore(argc, argv);
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "train" && argc == 2) return meshtrain::worker::RunRank(std::cout);
  if (command == "launch" && (argc == 2 || (argc > 3 && std::string(argv[2]) == "--"))) {
    try {
      std::vector<std::string> rank_command = {meshtrain::launch::SelfCommand(argc, argv)[0], "train"};
      if (argc > 2) rank_command.assign(argv + 3, argv + argc);
      const auto launch = meshtrain::launch::NodeLaunchFromEnvironment(std::move(rank_command));
      return meshtrain::launch::LaunchNode(launch, std::cerr);
    } catch (const std::exception& e) {
      std::cerr << "meshtrain-worker launch: " << e.what() << "\n";
      return meshtrain::api::worker::kExitPermanent;
    }
  }
  std::fputs(kUsage, stderr);
  return 2;
}
