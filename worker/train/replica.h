// One rank's copy of the model with its optimizer state, on one device: what the
// Trainer drives, so that one training loop serves the CPU (fp32) and CUDA (bf16
// compute, fp32 master weights) alike (DESIGN.md, "Engine" and "Mixed precision").
//
// A step is ZeroGrad, then Forward/Backward per micro-batch, then AverageGradients
// over the data-parallel group, GradNorm, and Update. Token arrays are host memory.
// Not thread-safe: one Replica is driven from one thread.

#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "api/model_shape.h"
#include "worker/comm/communicator.h"
#include "worker/runtime/device.h"
#include "worker/runtime/memory.h"

namespace meshtrain::train {

struct OptimizerStep {
  float learning_rate = 0, beta1 = 0.9f, beta2 = 0.95f, epsilon = 1e-8f;
  float weight_decay = 0;  // on the tensors ParameterLayout marks for decay
  float max_norm = 0;      // global grad-norm clipping; 0: none
  int64_t t = 1;           // steps taken, this one included
};

class Replica {
 public:
  virtual ~Replica() = default;

  virtual runtime::Device device() const = 0;
  // Mean cross-entropy of inputs (B,T) against targets (B,T).
  virtual double Forward(const int32_t* inputs, const int32_t* targets, int B, int T) = 0;
  // grads += loss_scale * d(mean loss)/d(params) of the last Forward.
  virtual void Backward(float loss_scale) = 0;
  virtual void ZeroGrad() = 0;
  // Replaces the gradients by their mean over `group`; every member calls it.
  virtual void AverageGradients(comm::Communicator& group) = 0;
  // The global L2 norm of the gradients.
  virtual double GradNorm() = 0;
  // Clips the gradients to step.max_norm and takes one AdamW step.
  virtual void Update(const OptimizerStep& step) = 0;
  // Probabilities (V) of the token that follows tokens[0..n).
  virtual std::vector<float> NextTokenProbabilities(const int32_t* tokens, int n) = 0;
  // The fp32 weights the optimizer updates (the master copy on CUDA), in ParameterLayout order.
  virtual std::vector<float> Weights() = 0;
};

// A replica of `shape` on `device`, for micro-batches of batch x seq tokens, initialised
// by InitParameters(seed). Memory is counted in `accounting` (device memory on CUDA).
// Throws std::invalid_argument for a CUDA device when the CUDA plugin cannot be loaded,
// and runtime::cuda::CudaError (a std::runtime_error) for a device that does not exist.
std::unique_ptr<Replica> MakeReplica(runtime::Device device, const api::ModelShape& shape, int batch, int seq,
                                     uint64_t seed, runtime::MemoryAccounting* accounting);

// Devices the CUDA plugin sees. 0, with *why saying why, when there are none: no CUDA in
// this build, a plugin that does not load, or no device.
int CudaDeviceCount(std::string* why = nullptr);

// runtime::ChooseDevice for a job with `precision` on local rank `local_rank` of this machine.
runtime::DeviceChoice ChooseDeviceHere(const std::string& precision, int local_rank);

}  // namespace meshtrain::train
