// Where a rank trains, and the engine made for it (docs/design.md, "The device seam"): the
// CPU backend with a CPU kernel table, or a GPU's backend and bf16 table from the CUDA
// plugin. The engine above them is the same.
// Thread-safety: functions may be called from any thread.

#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "api/engine_memory.h"
#include "api/layout.h"
#include "api/training_job.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/communicator.h"
#include "worker/comm/stream_collectives.h"
#include "worker/parallel/engine.h"
#include "worker/runtime/cpu_backend.h"
#include "worker/runtime/device.h"
#include "worker/runtime/memory.h"

namespace meshtrain::train {

// Devices the CUDA plugin sees. 0, with *why saying why, when there are none: no CUDA in
// this build, a plugin that does not load, or no device.
int CudaDeviceCount(std::string* why = nullptr);

// runtime::ChooseDevice for a job with `precision` on local rank `local_rank` of this machine.
runtime::DeviceChoice ChooseDeviceHere(const std::string& precision, int local_rank);

// What runs a rank's kernels on `device`: on the CPU the BLAS library and its core with
// where that came from (kernels/cpu/blas_core.h), "OpenBLAS 0.3.21 SkylakeX (Prescott
// detected; CPU has AVX-512)"; on a GPU the CUDA plugin's libraries.
std::string KernelsOn(const runtime::Device& device);

// What tests and benchmarks choose of the engine beyond the job's spec. A job never sets
// these: meshtrain-worker and `meshtrain run` take the defaults; a test passes its own to
// MakeEngine or train::Trainer (tests/integration/engine_check.cc: --kernels, --reference),
// and `meshtrain bench train --compare replicated` to its ranks.
struct EngineSwitches {
  // The CPU's kernel table: "fp32", "bf16" (the emulation of the GPU's numerics) or
  // "fp64" (the reference). A GPU always trains in bf16.
  std::string cpu_kernels = "fp32";
  // The engine's vocabulary padding: api::kVocabMultiple, or 1 for tests that compare
  // against the unpadded engine. 1 to 65536.
  int vocab_multiple = api::kVocabMultiple;
  // Replicated: every unit's compute copy kept (EngineOptions::keep_units_gathered), what
  // bench train --compare replicated measures at world 1.
  bool keep_units_gathered = false;
  // The CPU backend's strict mode (runtime::CpuBackendOptions): streams sleep a random
  // time before each task, seeded from this (0: no jitter), and new device memory is
  // poisoned. A GPU ignores it.
  runtime::CpuBackendOptions cpu_backend = {};
};

// The world's collectives on the device for a rank on `device`: NCCL when every rank
// trains on a GPU of its own; null otherwise (the host's, through `world`: on GPUs that
// ranks share, the staged fallback), with *note saying why. Collective: every rank of
// `world` calls it. Throws std::invalid_argument when some ranks have a GPU and others do
// not, and comm::CommError when NCCL cannot connect within `timeout`.
std::unique_ptr<comm::StreamCollectives> ConnectDeviceWorld(const comm::WorkerEnvironment& env,
                                                            const runtime::Device& device,
                                                            const comm::Rendezvous& rendezvous,
                                                            comm::Communicator& world,
                                                            std::chrono::milliseconds timeout, std::string* note);

// How the job keeps activations (spec.parallelism's checkpointing, offloading, horizon).
parallel::ActivationPolicy ActivationPolicyOf(const api::ParallelismSpec& parallelism);

// The sharded engine of `job` for `layout`, on `device`, for micro-batches of batch x
// seq, counting into `accounting`. `world` is the host communicator of the layout's world
// (null for one rank); `device_world` its stream-ordered collectives on the device (NCCL),
// or null for the host's (on a GPU: the staged fallback). Throws std::invalid_argument for
// a job the engine cannot run (naming the field), runtime::OutOfMemory when the memory
// limit is too small, and runtime::cuda::CudaError (a std::runtime_error) for a CUDA
// device that cannot be used; std::invalid_argument naming EngineSwitches' field for a
// malformed `switches`.
std::unique_ptr<parallel::Engine> MakeEngine(const api::TrainingJob& job, const api::ParallelLayout& layout,
                                             comm::Communicator* world, comm::StreamCollectives* device_world,
                                             runtime::Device device, int batch, int seq,
                                             runtime::MemoryAccounting* accounting,
                                             const EngineSwitches& switches = {});

}  // namespace meshtrain::train
