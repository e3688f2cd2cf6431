// Activation checkpointing and offloading in the sharded engine: the same bits as
// keeping every activation, and the memory the accounting promises.

#include <cstdint>
#include <mutex>
#include <vector>

#include <gtest/gtest.h>

#include "api/model_shape.h"
#include "worker/parallel/engine.h"

namespace meshtrain::parallel {
namespace {

constexpr int B = 2, T = 16;
// Six blocks, so that a horizon of 4 still leaves one input to offload.
const api::ModelShape kShape{.layers = 6, .heads = 2, .hidden = 32, .vocab_size = 64, .seq_len = T};

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
Result Train(const ActivationPolicy& policy, ScheduleObserver* observer = nullptr, float dropout = 0) {
  runtime::MemoryAccounting accounting;
  EngineOptions options;
  options.activations = policy;
  options.dropout = dropout;
  options.dropout_seed = 11;
  ShardedEngine engine(kShape, std::make_shared<const Mesh>(), B, T, 7, &accounting, options);
  engine.set_observer(observer);
  std::vector<int32_t> inputs(B * T), targets(B * T);
  Result run;
  train::OptimizerStep step;
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
      const train::MicroBatchKey key{s, micro};
      run.losses.push_back(engine.Forward(inputs.data(), targets.data(), B, T, &key));
      engine.Backward(0.5f, micro == 1);
    }
    engine.ReduceGradients(nullptr);
    step.t = s + 1;
    engine.Update(step);
  }
  run.weights = engine.Weights();
  run.activations = accounting.peak(runtime::MemoryCategory::kActivations);
  run.offload = accounting.peak(runtime::MemoryCategory::kOffload);
  run.copy_seconds = engine.comm_stats().copy;
  return run;
}

constexpr int64_t kBtc = int64_t(B) * T * 32;  // one block input, in floats
int64_t BlockFloats() { return model::BlockActivations<float>::Size(B, T, kShape); }
// The head's activations and their gradients, dblock, and the two residual gradients:
// kept in every mode.
int64_t ScratchFloats() {
  return 2 * model::HeadActivations<float>::Size(B, T, kShape) + BlockFloats() + 2 * kBtc;
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
  const Result offload = Train(Offload(1), nullptr, 0.2f);
  EXPECT_EQ(offload.losses, keep.losses);
  EXPECT_EQ(offload.weights, keep.weights);
}

// The accounting holds exactly what the modes promise: every block's activations; the
// block inputs, the head's input and one working set; or min(horizon+1, L) inputs in
// activation memory and the rest in the offload pool.
TEST(ActivationStore, TheAccountingShowsTheBoundsOfEachMode) {
  const int64_t L = kShape.layers;
  auto bytes = [](int64_t floats) { return int64_t(runtime::CachingAllocator::RoundedSize(size_t(floats) * sizeof(float))); };
  const Result keep = Train({});
  EXPECT_EQ(keep.activations, bytes(kBtc + L * BlockFloats() + ScratchFloats()));
  EXPECT_EQ(keep.offload, 0);
  const Result checkpoint = Train(Checkpointing());
  EXPECT_EQ(checkpoint.activations, bytes(L * kBtc + kBtc + BlockFloats() + ScratchFloats()));
  EXPECT_LT(checkpoint.activations, keep.activations / 2);
  EXPECT_EQ(checkpoint.offload, 0);
  for (int horizon : {1, 2, 4}) {
    const Result offload = Train(Offload(horizon));
    const int64_t resident = std::min<int64_t>(horizon + 1, L);
    EXPECT_EQ(offload.activations, bytes(resident * kBtc + kBtc + BlockFloats() + ScratchFloats()))
        << "horizon " << horizon;
    EXPECT_EQ(offload.offload, bytes((L - resident) * kBtc)) << "horizon " << horizon;
    EXPECT_GT(offload.copy_seconds, 0) << "horizon " << horizon;
  }
  const Result everything_fits = Train(Offload(9));
  EXPECT_EQ(everything_fits.offload, 0) << "a horizon past the last block leaves nothing to offload";
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
  Recorder with, without;
  Train(Checkpointing(), &with);
  Train({}, &without);
  ASSERT_FALSE(with.ops.empty());
  for (size_t i = 0; i < with.ops.size(); ++i) {
    if (with.ops[i].first != Op::kBackward || with.ops[i].second == 0) continue;  // unit 0: the root, never recomputed
    ASSERT_GT(i, 0u);
    EXPECT_EQ(with.ops[i - 1], std::make_pair(Op::kRecompute, with.ops[i].second));
  }
  for (const auto& op : without.ops) EXPECT_NE(op.first, Op::kRecompute);
}

TEST(ActivationStore, AnUnusablePolicyNamesTheField) {
  runtime::MemoryAccounting accounting;
  auto make = [&](const ActivationPolicy& policy) {
    EngineOptions options;
    options.activations = policy;
    ShardedEngine engine(kShape, std::make_shared<const Mesh>(), B, T, 7, &accounting, options);
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
}

}  // namespace
}  // namespace meshtrain::parallel
