#include "worker/comm/fabric/libfabric.h"

#include <dlfcn.h>

#include <csignal>
#include <cstring>
#include <iterator>
#include <string>

#include "worker/comm/types.h"

namespace meshtrain::comm::fabric {
namespace {

constexpr const char* kLibrary = "libfabric.so.1";  // ABI 1, as the headers built against
constexpr int kSignalsInfinipathTakes[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT,
                                           SIGINT,  SIGTERM, SIGQUIT, SIGHUP};

bool HandledByInfinipath(const struct sigaction& action) {
  if (action.sa_handler == SIG_DFL || action.sa_handler == SIG_IGN) return false;
  void* handler = (action.sa_flags & SA_SIGINFO) != 0 ? reinterpret_cast<void*>(action.sa_sigaction)
                                                      : reinterpret_cast<void*>(action.sa_handler);
  Dl_info library{};
  return ::dladdr(handler, &library) != 0 && library.dli_fname != nullptr &&
         std::strstr(library.dli_fname, "libinfinipath") != nullptr;
}

template <class F>
void Resolve(void* library, const char* name, F& entry) {
  ::dlerror();  // clear an older error
  entry = reinterpret_cast<F>(::dlsym(library, name));
  if (entry == nullptr) {
    const char* why = ::dlerror();
    throw CommError(std::string(kLibrary) + " has no " + name + (why != nullptr ? std::string(" (") + why + ")" : ""));
  }
}

LibFabric Load() {
  struct sigaction before[std::size(kSignalsInfinipathTakes)]{};
  for (size_t i = 0; i < std::size(kSignalsInfinipathTakes); ++i) ::sigaction(kSignalsInfinipathTakes[i], nullptr, &before[i]);
  void* library = ::dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  for (size_t i = 0; i < std::size(kSignalsInfinipathTakes); ++i) {
    struct sigaction now{};
    if (::sigaction(kSignalsInfinipathTakes[i], nullptr, &now) == 0 && HandledByInfinipath(now)) {
      ::sigaction(kSignalsInfinipathTakes[i], &before[i], nullptr);
    }
  }
  if (library == nullptr) {
    throw CommError(std::string("cannot load ") + kLibrary + " for the fabric backend (" + ::dlerror() +
                    "); install libfabric (Debian: libfabric1)");
  }
  LibFabric entries{};
  Resolve(library, "fi_getinfo", entries.getinfo);
  Resolve(library, "fi_freeinfo", entries.freeinfo);
  Resolve(library, "fi_dupinfo", entries.dupinfo);
  Resolve(library, "fi_fabric", entries.fabric);
  Resolve(library, "fi_strerror", entries.strerror);
  return entries;  // the library stays loaded for the life of the process
}

}  // namespace

const LibFabric& LibFabric::Get() {
  static const LibFabric loaded = Load();
  return loaded;
}

}  // namespace meshtrain::comm::fabric
