#include "worker/train/replica.h"

#include <cmath>
#include <optional>
#include <stdexcept>

#include "worker/kernels/cpu/kernels.h"
#include "worker/model/gpt2.h"
#include "worker/train/cuda_plugin.h"

namespace meshtrain::train {
namespace {

// fp32 on the CPU: the model, its gradients and the AdamW moments in host memory.
class CpuReplica final : public Replica {
 public:
  CpuReplica(const api::ModelShape& shape, int batch, int seq, uint64_t seed, runtime::MemoryAccounting* accounting)
      : allocator_(accounting), model_(shape, batch, seq, &allocator_) {
    model::InitParameters(model_.params().data(), model_.layout(), seed);
    const size_t P = model_.params().size();
    m_ = runtime::Buffer<float>(&allocator_, P, runtime::MemoryCategory::kOptimizer);
    v_ = runtime::Buffer<float>(&allocator_, P, runtime::MemoryCategory::kOptimizer);
  }

  runtime::Device device() const override { return runtime::Device::Cpu(); }

  double Forward(const int32_t* inputs, const int32_t* targets, int B, int T) override {
    return model_.Forward(inputs, targets, B, T);
  }

  void Backward(float loss_scale) override {
    norm_.reset();
    model_.Backward(loss_scale);
  }

  void ZeroGrad() override {
    norm_.reset();
    model_.ZeroGrad();
  }

  void AverageGradients(comm::Communicator& group) override {
    if (group.size() == 1) return;
    norm_.reset();
    runtime::Buffer<float>& grads = model_.grads();
    group.AllReduce(grads.data(), grads.data(), grads.size(), comm::DataType::kFloat32, comm::ReduceOp::kAverage)
        ->Wait();
  }

  double GradNorm() override {
    if (!norm_) {
      double squares = 0;
      for (float g : model_.grads()) squares += double(g) * g;
      norm_ = std::sqrt(squares);
    }
    return *norm_;
  }

  void Update(const OptimizerStep& s) override {
    runtime::Buffer<float>& grads = model_.grads();
    const double norm = GradNorm();
    if (s.max_norm > 0 && norm > s.max_norm) {
      const float scale = float(s.max_norm / norm);
      for (float& g : grads) g *= scale;
    }
    norm_.reset();
    for (const model::ParamTensor& p : model_.layout().tensors()) {
      kernels::cpu::AdamWUpdate(model_.params().data() + p.offset, grads.data() + p.offset, m_.data() + p.offset,
                                v_.data() + p.offset, p.size, s.learning_rate, s.beta1, s.beta2, s.epsilon,
                                p.decay ? s.weight_decay : 0.0f, s.t);
    }
  }

  std::vector<float> NextTokenProbabilities(const int32_t* tokens, int n) override {
    model_.Forward(tokens, nullptr, 1, n);
    const float* probs = model_.Probabilities(0, n - 1);
    return std::vector<float>(probs, probs + model_.layout().shape().vocab_size);
  }

  std::vector<float> Weights() override { return std::vector<float>(model_.params().begin(), model_.params().end()); }

 private:
  runtime::CachingAllocator allocator_;
  model::Gpt2<float> model_;
  runtime::Buffer<float> m_, v_;
  std::optional<double> norm_;  // of the current gradients, once computed
};

}  // namespace

std::unique_ptr<Replica> MakeReplica(runtime::Device device, const api::ModelShape& shape, int batch, int seq,
                                     uint64_t seed, runtime::MemoryAccounting* accounting) {
  if (!device.is_cuda()) return std::make_unique<CpuReplica>(shape, batch, seq, seed, accounting);
  std::string why;
  const CudaPlugin* cuda = CudaPluginOrNull(&why);
  if (cuda == nullptr) throw std::invalid_argument("device " + device.ToString() + ": " + why);
  return cuda->make_replica(device.index, shape, batch, seq, seed, accounting);
}

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

}  // namespace meshtrain::train
