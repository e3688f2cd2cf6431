// libfabric's few exported entry points, loaded on first use, so that only a process that
// opens an endpoint loads libfabric. (Everything else of libfabric's API is inline calls
// through the objects these return.)
//
// Why not link it: Debian's libfabric links the PSM libraries, and their constructors
// time the CPU's clock by sleeping 100 ms each. Linked, they cost every process of a
// program with the fabric backend 0.2 s at start, fabric or not: `meshtrain validate`,
// the launcher, each test case.
//
// Loading also lets libinfinipath install handlers for the fatal signals (SIGSEGV,
// SIGTERM, ...) that print a backtrace and call exit(): static destructors, libfabric's
// among them, then run under threads still inside libfabric. A rank sent SIGTERM exited 1
// instead of dying of the signal, and one that crashed in libfabric crashed again in exit
// and hung until SIGKILL. So the load puts back the actions those signals had before it.
//
// Thread-safety: Get() may be called from any thread; the first call loads.

#pragma once

#include <rdma/fabric.h>

namespace meshtrain::comm::fabric {

struct LibFabric {
  decltype(&::fi_getinfo) getinfo;
  decltype(&::fi_freeinfo) freeinfo;
  decltype(&::fi_dupinfo) dupinfo;
  decltype(&::fi_fabric) fabric;
  decltype(&::fi_strerror) strerror;

  // The loaded library; throws CommError naming libfabric.so.1 and the loader's reason
  // when it is missing or lacks an entry point.
  static const LibFabric& Get();
};

}  // namespace meshtrain::comm::fabric
