// The CUDA half of the engine is a plugin, libmeshtrain-cuda.so, which meshtrain and
// meshtrain-worker load when a job trains on a GPU (docs/design.md, "The device seam"). It
// exports what sits below the seam: the CUDA device backend, the bf16 kernel table and
// NCCL's stream-ordered collectives. The engine itself (parallel/) lives in the programs,
// one for every device.
//
// Why not link it in: a program linked with cuBLAS cannot start where the CUDA
// libraries are missing, and cuBLASLt's 92 KiB of static thread-local storage leaves
// too little of civetweb's 100 KiB thread stacks, so pthread_create fails and the
// metrics server cannot start. Loaded with dlopen, its thread-local storage is
// allocated only in the threads that use it.
//
// Thread-safety: CudaPluginOrNull may be called from any thread; the plugin's
// functions follow the contracts of the objects they make.

#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "api/rank_table.h"
#include "worker/comm/store.h"
#include "worker/comm/stream_collectives.h"
#include "worker/kernels/ops.h"
#include "worker/runtime/backend.h"
#include "worker/runtime/device_peak.h"
#include "worker/runtime/memory.h"

namespace meshtrain::train {

// The plugin's two C entry points. The loader calls the first, and compares the build it
// names with CudaPluginBuild(), before it calls the second or reads what that returns.
inline constexpr const char* kCudaPluginBuildEntry = "MeshtrainCudaPluginBuild";  // extern "C" const char* ()
inline constexpr const char* kCudaPluginEntry = "MeshtrainCudaPlugin";  // extern "C" const CudaPlugin* ()
inline constexpr const char* kCudaPluginFile = "libmeshtrain-cuda.so";

struct CudaPlugin {
  // Devices the CUDA runtime sees (0 without a driver or a device).
  int (*device_count)();
  // Name, SMs, clock and compute capability; throws runtime::cuda::CudaError for a
  // missing device.
  runtime::CudaDeviceFacts (*device_facts)(int device);
  // The backend of CUDA device `device`, which becomes the calling thread's current
  // device. Throws runtime::cuda::CudaError for a device that does not exist.
  std::unique_ptr<runtime::Backend> (*make_backend)(int device);
  // The bf16 kernel table on `backend`'s device; its own device memory (library
  // workspaces) comes from `allocator`, a CachingAllocator over backend.DeviceMemory().
  std::unique_ptr<kernels::Ops<kernels::Bf16>> (*make_ops)(runtime::Backend& backend,
                                                          runtime::CachingAllocator* allocator);
  // NCCL over the world of `table` on `device` as stream-ordered collectives, every
  // operation bounded by `timeout`: rank 0 makes the unique id and shares it through
  // `store`. Every rank calls it; throws comm::CommError when NCCL cannot connect.
  std::unique_ptr<comm::StreamCollectives> (*connect_nccl)(const api::RankTable& table, int rank,
                                                           std::shared_ptr<comm::StoreClient> store, int device,
                                                           std::chrono::milliseconds timeout);
  // Seconds that one bf16 product (tokens x k)(k x n)^T and its two backward products
  // take on `device`, measured there: the matrix rate a step's products could reach.
  double (*matmul_seconds)(int device, int tokens, int k, int n);
};

// This build's name for the boundary: "meshtrain VERSION, plugin boundary HASH", where
// HASH covers this header and every project header it includes
// (cmake/MeshtrainPluginFingerprint.cmake).
const char* CudaPluginBuild();

// Loads the plugin at `path`. nullptr, with *why saying what failed, when the file
// cannot be loaded, lacks the entry points, or comes from another build (*why names both).
const CudaPlugin* LoadCudaPlugin(const std::string& path, std::string* why);

// The plugin of this build, loaded once: from $MESHTRAIN_CUDA_PLUGIN, else beside this
// program or in ../lib, else where the build put it. nullptr, with *why, when this
// build has no CUDA or no candidate loads.
const CudaPlugin* CudaPluginOrNull(std::string* why);

}  // namespace meshtrain::train
