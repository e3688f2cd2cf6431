// The shm endpoint of a process whose pid a SIGKILLed rank once had: the dead rank's
// regions are still in /dev/shm under that pid. libfabric is loaded by the first
// endpoint, keeping the signal handlers set before it, and a process that uses the fabric
// dies of a fatal signal, whatever libinfinipath installed.

#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "worker/comm/fabric/endpoint.h"

namespace meshtrain::comm::fabric {
namespace {

bool LibFabricLoaded() {
  void* library = ::dlopen("libfabric.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (library != nullptr) ::dlclose(library);
  return library != nullptr;
}

void Noted(int) {}

// In a process of its own (a death test in the threadsafe style execs this binary
// afresh), because the other tests load libfabric into theirs. The child exits 0 when the
// load kept the handler, else it says what it found and exits 1.
void OpenTheFirstEndpointKeepingAHandler() {
  if (LibFabricLoaded()) {
    std::fprintf(stderr, "libfabric was loaded before any endpoint was opened\n");
    std::_Exit(1);
  }
  struct sigaction noted{}, before{};
  noted.sa_handler = Noted;
  ::sigaction(SIGTERM, &noted, &before);
  {
    // tcp: shm installs handlers of its own when it opens, which clean up its regions and
    // then chain to the ones before them.
    Endpoint endpoint("tcp;ofi_rxm", false);
    if (!LibFabricLoaded()) {
      std::fprintf(stderr, "an endpoint is open, but libfabric is not loaded\n");
      std::_Exit(1);
    }
  }
  struct sigaction after{};
  ::sigaction(SIGTERM, &before, &after);
  if (after.sa_handler != &Noted) {
    Dl_info owner{};
    ::dladdr(reinterpret_cast<void*>(after.sa_handler), &owner);
    std::fprintf(stderr, "loading libfabric replaced the SIGTERM handler set before it with one in %s\n",
                 owner.dli_fname != nullptr ? owner.dli_fname : "no library");
    std::_Exit(1);
  }
  std::_Exit(0);
}

TEST(FabricEndpoint, TheFirstEndpointLoadsLibfabricAndKeepsTheHandlersSetBefore) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(OpenTheFirstEndpointKeepingAHandler(), ::testing::ExitedWithCode(0), "");
}

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

// Debian's libinfinipath, loaded with libfabric, turns SIGTERM and SIGSEGV into a
// backtrace and exit(1); a launcher then sees status 1, or a process stuck in exit.
TEST(FabricEndpoint, AProcessThatUsesTheFabricDiesOfTheSignalItIsSent) {
  Endpoint endpoint("shm", false);  // libfabric is loaded and in use
  for (int signal : {SIGTERM, SIGSEGV, SIGINT, SIGABRT}) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::raise(signal);
      ::_exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFSIGNALED(status)) << "signal " << signal << ": exit status " << WEXITSTATUS(status);
    if (WIFSIGNALED(status)) {
      EXPECT_EQ(WTERMSIG(status), signal);
    }
  }
}

}  // namespace
}  // namespace meshtrain::comm::fabric
