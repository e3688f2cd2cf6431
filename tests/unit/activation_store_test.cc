// Activation checkpointing and offloading (parallel/activation_store.h), in the sharded
// engine on the strict CPU backend: the same bits as keeping every activation (with
// dropout too, and in the bf16 emulation), the memory each mode promises
// (api::ActivationStoreBytes, and the sizes it adds up), recomputation right before each
// block's backward, and policies the store refuses, naming the field.

#include "worker/parallel/activation_store.h"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "api/engine_memory.h"
#include "api/model_shape.h"
#include "worker/kernels/cpu/cpu_ops.h"
#include "worker/parallel/sharded_engine.h"
#include "worker/runtime/cpu_backend.h"

namespace meshtrain::parallel::activation_store_test {
namespace {

using kernels::Bf16;
using kernels::Fp32;

constexpr int B = 2, T = 16;
// Six blocks, so that a horizon of 4 still leaves one input to offload.
const api::ModelShape kShape{.layers = 6, .heads = 2, .hidden = 32, .vocab_size = 64, .seq_len = T};

template <class P>
std::unique_ptr<kernels::Ops<P>> CpuOps(runtime::Backend&, runtime::CachingAllocator*) {
  return kernels::MakeCpuOps<P>();
}

// Jittered streams and poisoned memory: a copy the schedule does not wait for, or a slot
// read before it is loaded, gives other bits.
std::shared_ptr<runtime::Backend> StrictBackend() {
  return std::make_shared<runtime::CpuBackend>(runtime::CpuBackendOptions{5, true});
}

struct Result {
  std::vector<double> losses;
  std::vector<float> weights;
  int64_t activations = 0, offload = 0;
  double copy_seconds = 0;
};

ActivationPolicy Checkpointing() {
  ActivationPolicy policy;
  policy.checkpointing = true;
  return policy;
}

ActivationPolicy Offload(int horizon) {
  ActivationPolicy policy = Checkpointing();
  policy.offload = true;
  policy.horizon = horizon;
  return policy;
}

// Three optimizer steps of two micro-batches each, then the weights.
template <class P = Fp32>
Result Train(const ActivationPolicy& policy, ScheduleObserver* observer = nullptr, float dropout = 0) {
  runtime::MemoryAccounting accounting;
  EngineOptions options;
  options.activations = policy;
  options.dropout = dropout;
  options.dropout_seed = 11;
  ShardedEngine<P> engine(kShape, std::make_shared<const Mesh>(), B, T, 7, &accounting, options, StrictBackend(),
                          CpuOps<P>);
  engine.set_observer(observer);
  std::vector<int32_t> inputs(B * T), targets(B * T);
  Result run;
  OptimizerStep step;
  step.learning_rate = 1e-2f;
  step.weight_decay = 0.1f;
  step.max_norm = 1.0f;
  for (int s = 0; s < 3; ++s) {
    engine.ZeroGrad();
    for (int micro = 0; micro < 2; ++micro) {
      for (int i = 0; i < B * T; ++i) {
        inputs[i] = (i * 7 + s * 3 + micro) % 64;
        targets[i] = (i * 13 + 5 + s) % 64;
      }
      const MicroBatchKey key{s, micro};
      engine.Forward(inputs.data(), targets.data(), B, T, &key, 0.5f / (B * T));  // half of the mean
      engine.Backward(micro == 1);
    }
    step.t = s + 1;
    engine.Update(step);
    run.losses.push_back(engine.TakeLoss());  // read once per step: micro-batches overlap as in training
  }
  run.weights = engine.Weights();
  run.copy_seconds = engine.comm_stats().copy;
  engine.set_observer(nullptr);
  run.activations = accounting.peak(runtime::MemoryCategory::kActivations);
  run.offload = accounting.peak(runtime::MemoryCategory::kOffload);
  return run;
}

TEST(ActivationStore, CheckpointingAndOffloadGiveTheSameBitsAsKeepingEverything) {
  const Result keep = Train({});
  const Result checkpoint = Train(Checkpointing());
  EXPECT_EQ(checkpoint.losses, keep.losses);
  EXPECT_EQ(checkpoint.weights, keep.weights);
  for (int horizon : {1, 2, 4, 5, 9}) {
    const Result offload = Train(Offload(horizon));
    EXPECT_EQ(offload.losses, checkpoint.losses) << "horizon " << horizon;
    EXPECT_EQ(offload.weights, checkpoint.weights) << "horizon " << horizon;
  }
  EXPECT_EQ(Train(Offload(2)).losses, keep.losses) << "run twice";
}

// Dropout masks are a pure function of the key and the element: the recomputed block
// drops what its forward dropped, so checkpointing and offload stay bitwise equal.
TEST(ActivationStore, WithDropoutCheckpointingAndOffloadStillGiveTheSameBits) {
  const Result keep = Train({}, nullptr, 0.2f);
  EXPECT_NE(keep.losses, Train({}).losses) << "dropout must change the run";
  EXPECT_EQ(Train({}, nullptr, 0.2f).losses, keep.losses) << "the same masks run after run";
  const Result checkpoint = Train(Checkpointing(), nullptr, 0.2f);
  EXPECT_EQ(checkpoint.losses, keep.losses);
  EXPECT_EQ(checkpoint.weights, keep.weights);
  for (int horizon : {1, 2}) {
    const Result offload = Train(Offload(horizon), nullptr, 0.2f);
    EXPECT_EQ(offload.losses, keep.losses) << "horizon " << horizon;
    EXPECT_EQ(offload.weights, keep.weights) << "horizon " << horizon;
  }
}

// The GPU's precision: block inputs in bf16 go to the host and back, and recomputation
// rounds as the forward did.
TEST(ActivationStore, InTheBf16EmulationTooCheckpointingAndOffloadGiveTheSameBits) {
  const Result keep = Train<Bf16>({}, nullptr, 0.2f);
  for (const ActivationPolicy& policy : {Checkpointing(), Offload(1), Offload(2)}) {
    const Result other = Train<Bf16>(policy, nullptr, 0.2f);
    EXPECT_EQ(other.losses, keep.losses) << "offload " << policy.offload << ", horizon " << policy.horizon;
    EXPECT_EQ(other.weights, keep.weights) << "offload " << policy.offload << ", horizon " << policy.horizon;
  }
}

// The bytes the engine's fp32 kernels keep for each buffer the store carves.
api::EngineTypes Fp32Types() {
  auto ops = kernels::MakeCpuOps<Fp32>();
  return model::TypesOf(*ops, B, T, kShape, 1);
}
int64_t Held(int64_t bytes) { return int64_t(runtime::CachingAllocator::RoundedSize(size_t(bytes))); }

// The accounting holds exactly what the modes promise: every block's activations; the
// block inputs, the head's input and one working set; or min(horizon+1, L) inputs in
// activation memory and the rest in the offload pool. The head and the backward's working
// set are kept in every mode, and the step buffer (tokens, scalars) sits beside them.
TEST(ActivationStore, TheAccountingShowsTheBoundsOfEachMode) {
  const int L = int(kShape.layers);
  const api::EngineTypes types = Fp32Types();
  const int64_t input = api::Aligned(int64_t(B) * T * kShape.hidden * 4);
  const int64_t block = api::BlockActivationBytes(B, T, kShape, 1, types);
  const int64_t always = api::HeadActivationBytes(B, T, kShape, 0, 1, types) +
                         api::BlockScratchBytes(B, T, kShape, 1, types, /*dropout=*/false);
  const int64_t step_buffer = Held(api::StepBufferBytes(B, T, kShape, types));
  // What the store promises, checked against the planner's function of the same name.
  auto expect = [&](const ActivationPolicy& policy, int64_t kept, int64_t offloaded, const std::string& mode) {
    const api::ActivationBytes planned = api::ActivationStoreBytes(kShape, B, T, policy, 0, 1, types, false);
    EXPECT_EQ(planned.kept, kept) << mode;
    EXPECT_EQ(planned.offloaded, offloaded) << mode;
    const Result run = Train(policy);
    EXPECT_EQ(run.activations, Held(kept) + step_buffer) << mode;
    EXPECT_EQ(run.offload, offloaded > 0 ? Held(offloaded) : 0) << mode;
    return run;
  };
  const Result keep = expect({}, input + L * block + always, 0, "keep all");
  const Result checkpoint = expect(Checkpointing(), L * input + input + block + always, 0, "checkpointing");
  EXPECT_LT(checkpoint.activations, keep.activations / 2);
  for (int horizon : {1, 2, 4}) {
    const int resident = std::min(horizon + 1, L);
    const Result offload = expect(Offload(horizon), resident * input + input + block + always, (L - resident) * input,
                                  "horizon " + std::to_string(horizon));
    EXPECT_GT(offload.copy_seconds, 0) << "horizon " << horizon;
  }
  const Result everything_fits = Train(Offload(9));
  EXPECT_EQ(everything_fits.offload, 0) << "a horizon past the last block leaves nothing to offload";
}

// The store on its own: n = min(H+1, L) slots, block l's input in slot l % n, the first
// L - n inputs in the pool; without offload, every input its own place.
TEST(ActivationStore, InputsShareSlotsAsTheHorizonSays) {
  runtime::CpuBackend backend;
  runtime::MemoryAccounting accounting;
  runtime::CachingAllocator device(&accounting, backend.DeviceMemory()), pinned(&accounting, backend.PinnedHostMemory());
  const api::EngineTypes types = Fp32Types();
  const int L = int(kShape.layers);
  for (int horizon : {1, 2, 4, 9}) {
    ActivationStore<Fp32> store(kShape, B, T, Offload(horizon), types, false, {}, backend, &device, &pinned);
    const int n = std::min(horizon + 1, L);
    EXPECT_EQ(store.slots(), n) << "horizon " << horizon;
    EXPECT_EQ(store.offloaded_blocks(), L - n) << "horizon " << horizon;
    EXPECT_TRUE(store.recompute());
    for (int l = 0; l < L; ++l) {
      EXPECT_TRUE(store.Input(l) == store.Input(l % n)) << "horizon " << horizon << ", block " << l;
      if (l > 0 && l < n) {
        EXPECT_FALSE(store.Input(l) == store.Input(0)) << "horizon " << horizon;
      }
      // The recompute's working set is one for all blocks, and its output is not an input.
      EXPECT_TRUE(store.Saved(l).parts.Get<float>("qkv") == store.Saved(0).parts.Get<float>("qkv"));
      EXPECT_FALSE(store.Saved(l).output == store.Input(l));
    }
    EXPECT_TRUE(store.ForwardOutputs(L - 1).output == store.head_input());
    EXPECT_TRUE(store.ForwardOutputs(0).output == store.Input(1)) << "a forward writes the next block's input";
  }
  ActivationStore<Fp32> keep(kShape, B, T, {}, types, false, {}, backend, &device, &pinned);
  EXPECT_EQ(keep.slots(), 1);
  EXPECT_FALSE(keep.recompute());
  for (int l = 1; l < L; ++l) EXPECT_TRUE(keep.Input(l) == keep.Saved(l - 1).output) << "block " << l;
  EXPECT_TRUE(keep.head_input() == keep.Saved(L - 1).output);
}

// With checkpointing, each block's backward is preceded by its recompute, on the same
// gathered parameters; without it there is no recompute.
class Recorder : public ScheduleObserver {
 public:
  void Begin(Op op, int unit) override {
    std::lock_guard lock(mutex_);
    if (op == Op::kRecompute || op == Op::kBackward) ops.push_back({op, unit});
  }
  void End(Op, int) override {}
  std::vector<std::pair<Op, int>> ops;

 private:
  std::mutex mutex_;
};

TEST(ActivationStore, CheckpointingRecomputesEachBlockRightBeforeItsBackward) {
  Recorder with, without, offloaded;
  Train(Checkpointing(), &with);
  Train({}, &without);
  Train(Offload(1), &offloaded);
  for (Recorder* recorder : {&with, &offloaded}) {
    ASSERT_FALSE(recorder->ops.empty());
    int recomputes = 0;
    for (size_t i = 0; i < recorder->ops.size(); ++i) {
      recomputes += recorder->ops[i].first == Op::kRecompute;
      if (recorder->ops[i].first != Op::kBackward || recorder->ops[i].second == 0) continue;  // the root: never recomputed
      ASSERT_GT(i, 0u);
      EXPECT_EQ(recorder->ops[i - 1], std::make_pair(Op::kRecompute, recorder->ops[i].second));
    }
    EXPECT_EQ(recomputes, 6 * int(kShape.layers)) << "one per block and micro-batch";
  }
  ASSERT_FALSE(without.ops.empty());
  for (const auto& op : without.ops) EXPECT_NE(op.first, Op::kRecompute);
}

TEST(ActivationStore, AnUnusablePolicyNamesTheField) {
  runtime::MemoryAccounting accounting;
  auto make = [&](const ActivationPolicy& policy) {
    EngineOptions options;
    options.activations = policy;
    ShardedEngine<Fp32> engine(kShape, std::make_shared<const Mesh>(), B, T, 7, &accounting, options, StrictBackend(),
                               CpuOps<Fp32>);
  };
  try {
    make(Offload(0));
    ADD_FAILURE() << "a horizon of 0 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("spec.parallelism.activationLoadingHorizon"), std::string::npos) << e.what();
  }
  try {
    ActivationPolicy offload_only = Offload(2);
    offload_only.checkpointing = false;
    make(offload_only);
    ADD_FAILURE() << "offloading without checkpointing was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("spec.parallelism.activationCheckpointing"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(ActivationStore<Fp32>::Check(Offload(1)));
  EXPECT_THROW(ActivationStore<Fp32>::Check(Offload(-3)), std::invalid_argument);
}

}  // namespace
}  // namespace meshtrain::parallel::activation_store_test
