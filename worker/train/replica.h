// One rank's part of the model with its optimizer state, on one device: what the
// Trainer drives, so that one training loop serves every layout and device (DESIGN.md,
// "Engine" and "Mixed precision"). On the CPU it is the sharded engine
// (parallel/engine.h), replicated training being its case S = 1; on CUDA it is still a
// whole bf16 replica (fp32 master weights) whose gradients are averaged through host
// memory: the CUDA units of the sharded engine are yet to come.
//
// A step is ZeroGrad, then Forward/Backward per micro-batch, then ReduceGradients,
// GradNorm, and Update. Token arrays are host memory.
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

// Seconds spent in collectives since the start, by operation, and the part of them the
// compute stream waited for (exposed communication); likewise for activation copies
// (offload and load) on the copy stream.
struct CommStats {
  double all_gather = 0, reduce_scatter = 0, all_reduce = 0, exposed = 0;
  double copy = 0, copy_exposed = 0;
};

// One rank's part of the training state, for a checkpoint: the real elements of its
// shard of every unit, in unit order, of fp32 master weights and AdamW m and v; and the
// rank's place in the layout.
struct ShardState {
  int tp_rank = 0, shard_rank = 0, replica = 0;
  std::vector<float> master, m, v;
};

// The whole model's optimizer state in the single-rank layout (ParameterLayout order).
struct WholeState {
  std::vector<float> master, m, v;
};

// Which micro-batch of which step a training forward computes; it keys dropout masks.
struct MicroBatchKey {
  int64_t step = 0;   // 0-based
  int64_t micro = 0;  // within the step
};

class Replica {
 public:
  virtual ~Replica() = default;

  virtual runtime::Device device() const = 0;
  // Mean cross-entropy of inputs (B,T) against targets (B,T). With `training`, dropout
  // (if the model has any) drops what that micro-batch's masks say; without, nothing.
  virtual double Forward(const int32_t* inputs, const int32_t* targets, int B, int T,
                         const MicroBatchKey* training = nullptr) = 0;
  // grads += loss_scale * d(mean loss)/d(params) of the last Forward. `last`: this is the
  // step's last micro-batch, so a replica may start ReduceGradients' work as each
  // gradient becomes final, overlapping the rest of this backward.
  virtual void Backward(float loss_scale, bool last) = 0;
  virtual void ZeroGrad() = 0;
  // After the last micro-batch, on every rank: completes the mean of the gradients over
  // the data-parallel ranks, `data_parallel` (null for one rank). The sharded engine
  // reduces over its own mesh and ignores it.
  virtual void ReduceGradients(comm::Communicator* data_parallel) = 0;
  // The global L2 norm of the gradients (collective on every rank).
  virtual double GradNorm() = 0;
  // Clips the gradients to step.max_norm and takes one AdamW step.
  virtual void Update(const OptimizerStep& step) = 0;
  // Probabilities (V) of the token that follows tokens[0..n).
  virtual std::vector<float> NextTokenProbabilities(const int32_t* tokens, int n) = 0;
  // The fp32 weights the optimizer updates (the master copy on CUDA), whole, in
  // ParameterLayout order; collective on every rank.
  virtual std::vector<float> Weights() = 0;
  virtual CommStats comm_stats() const { return {}; }
  // Copies this rank's optimizer state into `into`, reusing its memory (checkpoints
  // write it in the background).
  virtual void Snapshot(ShardState* into) = 0;
  // This rank's elements of `whole` (a checkpoint's, any layout's) as its optimizer state.
  virtual void Restore(const WholeState& whole) = 0;
  // How the model is laid out on this rank, for the startup lines.
  virtual std::string Describe() const = 0;
};

// A whole bf16 replica of `shape` on CUDA device `device`, for micro-batches of batch x
// seq tokens, initialised by InitParameters(seed); device memory is counted in
// `accounting`. Throws std::invalid_argument when the CUDA plugin cannot be loaded, and
// runtime::cuda::CudaError (a std::runtime_error) for a device that does not exist.
std::unique_ptr<Replica> MakeCudaReplica(int device, const api::ModelShape& shape, int batch, int seq, uint64_t seed,
                                         runtime::MemoryAccounting* accounting);

// Devices the CUDA plugin sees. 0, with *why saying why, when there are none: no CUDA in
// this build, a plugin that does not load, or no device.
int CudaDeviceCount(std::string* why = nullptr);

// runtime::ChooseDevice for a job with `precision` on local rank `local_rank` of this machine.
runtime::DeviceChoice ChooseDeviceHere(const std::string& precision, int local_rank);

}  // namespace meshtrain::train
