// The CUDA plugin, libmeshtrain-cuda.so (cuda_plugin.h): the bf16 Replica over
// model::Gpt2Cuda, and the plugin's entry points (the device probes are in cuda_probe.cc).

#include <algorithm>
#include <cmath>

#include "worker/model/gpt2_cuda.h"
#include "worker/runtime/cuda.h"
#include "worker/train/cuda_plugin.h"
#include "worker/train/cuda_probe.h"

namespace meshtrain::train {
namespace {

class CudaReplica final : public Replica {
 public:
  CudaReplica(int device_index, const api::ModelShape& shape, int batch, int seq, uint64_t seed,
              runtime::MemoryAccounting* accounting)
      : device_index_((runtime::cuda::UseDevice(device_index), device_index)),
        model_(shape, batch, seq, seed, accounting),
        pinned_(accounting, runtime::cuda::PinnedHostMemory()) {}

  ~CudaReplica() override {
    if (staging_ != nullptr) pinned_.Free(staging_);
  }

  runtime::Device device() const override { return runtime::Device::Cuda(device_index_); }

  // Checkpoints come from the CPU engine; the Trainer writes none on CUDA yet (it warns).
  void Snapshot(ShardState*) override { throw std::logic_error("checkpoints of the CUDA replica are not written yet"); }
  void Restore(const WholeState&) override {
    throw std::logic_error("checkpoints are not loaded into the CUDA replica yet");
  }

  // No dropout on CUDA yet: the Trainer refuses a job with any.
  double Forward(const int32_t* inputs, const int32_t* targets, int B, int T, const MicroBatchKey*) override {
    return model_.Forward(inputs, targets, B, T);
  }
  void Backward(float loss_scale, bool) override { model_.Backward(loss_scale); }
  void ZeroGrad() override { model_.ZeroGrad(); }

  // Through pinned host memory, so any communicator (the fabric one reads host memory) serves.
  void ReduceGradients(comm::Communicator* data_parallel) override {
    if (data_parallel == nullptr || data_parallel->size() == 1) return;
    comm::Communicator& group = *data_parallel;
    const size_t count = size_t(model_.layout().total());
    if (staging_ == nullptr) {
      staging_ = static_cast<float*>(pinned_.Allocate(count * sizeof(float), runtime::MemoryCategory::kComm));
    }
    model_.CopyGradientsTo(staging_);
    group.AllReduce(staging_, staging_, count, comm::DataType::kFloat32, comm::ReduceOp::kAverage)->Wait();
    model_.CopyGradientsFrom(staging_);
  }

  double GradNorm() override { return model_.GradNorm(); }

  void Update(const OptimizerStep& s) override {
    model_.Update(s.learning_rate, s.beta1, s.beta2, s.epsilon, s.weight_decay, s.max_norm, s.t);
  }

  std::vector<float> NextTokenProbabilities(const int32_t* tokens, int n) override {
    model_.Forward(tokens, nullptr, 1, n);
    std::vector<float> p = model_.Logits(0, n - 1);
    const float largest = *std::max_element(p.begin(), p.end());
    double sum = 0;
    for (float& x : p) sum += (x = std::exp(x - largest));
    for (float& x : p) x = float(x / sum);
    return p;
  }

  std::vector<float> Weights() override { return model_.MasterWeights(); }
  std::string Describe() const override { return "the whole model in bf16 with fp32 master weights, replicated"; }

 private:
  int device_index_;
  model::Gpt2Cuda model_;
  runtime::CachingAllocator pinned_;
  float* staging_ = nullptr;  // pinned, for AverageGradients
};

std::unique_ptr<Replica> MakeReplica(int device, const api::ModelShape& shape, int batch, int seq, uint64_t seed,
                                     runtime::MemoryAccounting* accounting) {
  return std::make_unique<CudaReplica>(device, shape, batch, seq, seed, accounting);
}

const CudaPlugin kPlugin{runtime::cuda::DeviceCount, ProbeDeviceFacts, MakeReplica, ProbeMatmulSeconds};

}  // namespace
}  // namespace meshtrain::train

extern "C" __attribute__((visibility("default"))) const char* MeshtrainCudaPluginBuild() { return MESHTRAIN_PLUGIN_BUILD; }

extern "C" __attribute__((visibility("default"))) const meshtrain::train::CudaPlugin* MeshtrainCudaPlugin() {
  return &meshtrain::train::kPlugin;
}
