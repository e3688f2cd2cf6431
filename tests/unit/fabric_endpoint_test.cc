// The shm endpoint of a process whose pid a SIGKILLed rank once had: the dead rank's
// regions are still in /dev/shm under that pid.

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "worker/comm/fabric/endpoint.h"

namespace meshtrain::comm::fabric {
namespace {

TEST(FabricEndpoint, ShmOpensOverRegionsLeftByADeadProcessWithThisPid) {
  const std::string pid = std::to_string(::getpid());
  std::vector<std::filesystem::path> leftovers;
  for (const char* suffix : {":0:0", ":1:0"}) {
    leftovers.push_back(std::filesystem::path("/dev/shm") / (pid + suffix));
    std::ofstream(leftovers.back()) << std::string(4096, '\x5a');  // not a region the provider can map
  }
  Endpoint endpoint("shm", false);
  EXPECT_FALSE(endpoint.Address().empty());
  for (const auto& path : leftovers) EXPECT_FALSE(std::filesystem::exists(path) && std::filesystem::file_size(path) == 4096) << path;
}

}  // namespace
}  // namespace meshtrain::comm::fabric
