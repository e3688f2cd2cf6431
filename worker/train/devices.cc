#include "worker/train/devices.h"

#include <stdexcept>

#include "api/model_shape.h"
#include "worker/kernels/cpu/blas_core.h"
#include "worker/kernels/cpu/cpu_ops.h"
#include "worker/parallel/sharded_engine.h"
#include "worker/runtime/cpu_backend.h"
#include "worker/train/cuda_plugin.h"

namespace meshtrain::train {

int CudaDeviceCount(std::string* why) {
  std::string failure;
  const CudaPlugin* cuda = CudaPluginOrNull(&failure);
  const int count = cuda ? cuda->device_count() : 0;
  if (count == 0 && why != nullptr) *why = cuda ? "the CUDA runtime sees no device" : failure;
  return count;
}

runtime::DeviceChoice ChooseDeviceHere(const std::string& precision, int local_rank) {
  std::string why_none;
  const int devices = CudaDeviceCount(&why_none);
  return runtime::ChooseDevice(precision, local_rank, devices, why_none);
}

std::string KernelsOn(const runtime::Device& device) {
  if (device.is_cuda()) return "cuBLASLt and cuDNN (the CUDA plugin)";
  return kernels::cpu::CurrentBlasCore().Describe();
}

namespace {

void CheckSwitches(const EngineSwitches& s) {
  if (s.cpu_kernels != "fp32" && s.cpu_kernels != "bf16" && s.cpu_kernels != "fp64") {
    throw std::invalid_argument("EngineSwitches::cpu_kernels: '" + s.cpu_kernels + "' is not fp32, bf16 or fp64");
  }
  if (s.vocab_multiple < 1 || s.vocab_multiple > (1 << 16)) {
    throw std::invalid_argument("EngineSwitches::vocab_multiple: " + std::to_string(s.vocab_multiple) +
                                " is not 1 to 65536");
  }
}

template <class P>
std::unique_ptr<parallel::Engine> Make(const api::TrainingJob& job, std::shared_ptr<const parallel::Mesh> mesh,
                                       std::shared_ptr<runtime::Backend> backend,
                                       const parallel::OpsFactory<P>& make_ops, int batch, int seq,
                                       runtime::MemoryAccounting* accounting, const parallel::EngineOptions& options) {
  return std::make_unique<parallel::ShardedEngine<P>>(api::ShapeOf(job.spec.model), std::move(mesh), batch, seq,
                                                      uint64_t(job.spec.training.seed), accounting, options,
                                                      std::move(backend), make_ops);
}

template <class P>
std::unique_ptr<kernels::Ops<P>> CpuOps(runtime::Backend&, runtime::CachingAllocator*) {
  return kernels::MakeCpuOps<P>();
}

}  // namespace

std::unique_ptr<comm::StreamCollectives> ConnectDeviceWorld(const comm::WorkerEnvironment& env,
                                                            const runtime::Device& device,
                                                            const comm::Rendezvous& rendezvous,
                                                            comm::Communicator& world,
                                                            std::chrono::milliseconds timeout, std::string* note) {
  std::string why;
  const int devices = device.is_cuda() ? CudaDeviceCount(&why) : 0;
  // Per rank: [trains on a GPU, has one of its own]; summed over the world.
  int32_t counts[2] = {device.is_cuda() ? 1 : 0, device.is_cuda() && env.nproc_per_node <= devices ? 1 : 0};
  world.AllReduce(counts, counts, 2, comm::DataType::kInt32, comm::ReduceOp::kSum)->Wait();
  if (counts[0] != 0 && counts[0] != env.world_size) {
    throw std::invalid_argument(std::to_string(counts[0]) + " of " + std::to_string(env.world_size) +
                                " ranks have a GPU and the others do not; a job's ranks train on one kind of device");
  }
  if (counts[0] == 0) return nullptr;
  if (counts[1] < env.world_size) {
    *note = "ranks share a GPU (" + std::to_string(env.nproc_per_node) + " ranks on " + std::to_string(devices) +
            " device(s) of node " + std::to_string(env.node_rank) +
            ", or so on another node), which NCCL refuses: collectives are staged through pinned host memory over "
            "the fabric, slowly";
    return nullptr;
  }
  return CudaPluginOrNull(nullptr)->connect_nccl(rendezvous.table, env.rank, rendezvous.store, device.index, timeout);
}

parallel::ActivationPolicy ActivationPolicyOf(const api::ParallelismSpec& p) {
  return {p.activation_checkpointing, p.activation_offloading, int(p.activation_loading_horizon)};
}

std::unique_ptr<parallel::Engine> MakeEngine(const api::TrainingJob& job, const api::ParallelLayout& layout,
                                             comm::Communicator* world, comm::StreamCollectives* device_world,
                                             runtime::Device device, int batch, int seq,
                                             runtime::MemoryAccounting* accounting, const EngineSwitches& switches) {
  CheckSwitches(switches);
  const api::ParallelismSpec& p = job.spec.parallelism;
  parallel::EngineOptions options;
  const std::optional<int64_t>& limit_mib = job.spec.resources.memory_limit_mib;
  options.memory_limit = limit_mib ? *limit_mib << 20 : runtime::MemoryLimitFromEnvironment();
  options.activations = ActivationPolicyOf(p);
  options.dropout = float(job.spec.model.dropout);
  options.dropout_seed = uint64_t(p.tensor_parallel_seed);
  options.vocab_multiple = switches.vocab_multiple;
  options.keep_units_gathered = switches.keep_units_gathered;
  options.pipeline = api::Pipeline::Of(p);
  if (options.pipeline.stages > 1) options.micro_batches = int(api::AccumulationSteps(job.spec));
  options.context_all_to_all = p.context_parallel_mode == "AllToAll";
  options.documents = job.spec.data.attention == "document";
  if (job.spec.training.precision == "fp8") {
    options.float8 = job.spec.training.float8.recipe == "rowwise" ? kernels::Float8Recipe::kRowwise
                                                                  : kernels::Float8Recipe::kTensorwise;
  }
  if (job.spec.training.router_aux_loss_coef) options.router_aux_loss_coef = float(*job.spec.training.router_aux_loss_coef);
  const bool wrap = options.pipeline.virtual_stages > 1;  // chunks go round the stages more than once
  const bool data_group = options.router_aux_loss_coef.has_value();  // its statistics cross the data-parallel ranks

  std::shared_ptr<runtime::Backend> backend;
  if (device.is_cuda()) {
    std::string why;
    const CudaPlugin* cuda = CudaPluginOrNull(&why);
    if (cuda == nullptr) throw std::invalid_argument("device " + device.ToString() + ": " + why);
    backend = cuda->make_backend(device.index);
    auto mesh = std::make_shared<const parallel::Mesh>(layout, world, device_world, backend.get(), wrap, data_group);
    return Make<kernels::Bf16>(job, std::move(mesh), backend, cuda->make_ops, batch, seq, accounting, options);
  }
  backend = std::make_shared<runtime::CpuBackend>(switches.cpu_backend);
  auto mesh = std::make_shared<const parallel::Mesh>(layout, world, device_world, backend.get(), wrap, data_group);
  const std::string& kernels = switches.cpu_kernels;
  if (kernels == "bf16") return Make<kernels::Bf16>(job, mesh, backend, CpuOps<kernels::Bf16>, batch, seq, accounting, options);
  if (kernels == "fp64") return Make<kernels::Fp64>(job, mesh, backend, CpuOps<kernels::Fp64>, batch, seq, accounting, options);
  return Make<kernels::Fp32>(job, mesh, backend, CpuOps<kernels::Fp32>, batch, seq, accounting, options);
}

}  // namespace meshtrain::train
