// meshtrain-worker: `launch` starts this node's ranks (a pod's command); `train` is one rank.

#include <cstdio>
#include <iostream>
#include <string>

#include "api/worker_contract.h"
#include "worker/entry/rank.h"
#include "worker/launch/local_launcher.h"
#include "worker/launch/node_launcher.h"

namespace {

constexpr const char* kUsage =
    "usage: meshtrain-worker launch   start one rank per GPU of this node (the worker contract's environment)\n"
    "       meshtrain-worker train    run one rank (RANK, LOCAL_RANK and WORLD_SIZE set too)\n";

}  // namespace

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "train" && argc == 2) return meshtrain::worker::RunRank(std::cout);
  if (command == "launch" && argc == 2) {
    try {
      meshtrain::launch::NodeLaunch launch;
      launch.command = meshtrain::launch::SelfCommand(argc, argv);
      launch.command[1] = "train";
      return meshtrain::launch::LaunchNode(launch, std::cerr);
    } catch (const std::exception& e) {
      std::cerr << "meshtrain-worker launch: " << e.what() << "\n";
      return meshtrain::api::worker::kExitConfigError;
    }
  }
  std::fputs(kUsage, stderr);
  return 2;
}
