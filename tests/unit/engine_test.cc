// The sharded engine on one rank (S = 1, the replicated case): the same numbers as the
// whole-model reference, and the schedule's promises, seen through its observer.
// Layouts over several ranks are checked against this in tests/integration/engine_check.cc.

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <set>
#include <utility>

#include <gtest/gtest.h>

#include "api/model_shape.h"
#include "worker/kernels/cpu/kernels.h"
#include "worker/model/gpt2.h"
#include "worker/parallel/engine.h"

namespace meshtrain::parallel {
namespace {

constexpr int B = 2, T = 16;

struct Batch {
  std::vector<int32_t> inputs = std::vector<int32_t>(B * T), targets = std::vector<int32_t>(B * T);
  Batch() {
    for (int i = 0; i < B * T; ++i) inputs[i] = (i * 7) % 256, targets[i] = (i * 13 + 5) % 256;
  }
};

// The engine takes the Trainer's step: norm, clipping to max_norm, then AdamW, against
// the same arithmetic written out on the whole-model reference. On one rank the sums
// run in the same order, so the results agree bit for bit.
TEST(ShardedEngine, OneRankMatchesTheWholeModelBitForBit) {
  const api::ModelShape& shape = *api::FindPreset("gpt2-tiny");
  const Batch batch;
  runtime::MemoryAccounting accounting;
  ShardedEngine engine(shape, std::make_shared<const Mesh>(), B, T, 99, &accounting);
  EXPECT_EQ(engine.device(), runtime::Device::Cpu());
  engine.ZeroGrad();
  const double loss = engine.Forward(batch.inputs.data(), batch.targets.data(), B, T);
  engine.Backward(1.0f, true);
  engine.ReduceGradients(nullptr);
  const double norm = engine.GradNorm();
  train::OptimizerStep step;
  step.learning_rate = 1e-2f;
  step.weight_decay = 0.1f;
  step.max_norm = float(norm / 4);  // clipping must bite
  engine.Update(step);

  model::Gpt2<float> reference(shape, B, T);
  model::InitParameters(reference.params().data(), reference.layout(), 99);
  reference.ZeroGrad();
  EXPECT_EQ(reference.Forward(batch.inputs.data(), batch.targets.data(), B, T), loss);
  reference.Backward(1.0f);
  double squares = 0;  // unit by unit, as shards are summed
  for (int u = 0; u < reference.layout().units(); ++u) {
    double unit = 0;
    for (int64_t i = reference.layout().Unit(u).first; i < reference.layout().Unit(u).second; ++i) {
      unit += double(reference.grads()[size_t(i)]) * reference.grads()[size_t(i)];
    }
    squares += unit;
  }
  EXPECT_EQ(std::sqrt(squares), norm);
  std::vector<float> m(reference.params().size()), v(m.size());
  const float scale = float(step.max_norm / norm);
  for (float& g : reference.grads()) g *= scale;
  for (const model::ParamTensor& p : reference.layout().tensors()) {
    kernels::cpu::AdamWUpdate(reference.params().data() + p.offset, reference.grads().data() + p.offset,
                              m.data() + p.offset, v.data() + p.offset, p.size, step.learning_rate, step.beta1,
                              step.beta2, step.epsilon, p.decay ? step.weight_decay : 0.0f, 1);
  }
  const std::vector<float> want(reference.params().begin(), reference.params().end());
  EXPECT_EQ(engine.Weights(), want);
  EXPECT_GT(accounting.peak(runtime::MemoryCategory::kOptimizer), 0);
  EXPECT_GT(accounting.peak(runtime::MemoryCategory::kGathered), 0);
  EXPECT_EQ(accounting.current(runtime::MemoryCategory::kGathered), 0);  // nothing stays unsharded

  const std::vector<float> probs = engine.NextTokenProbabilities(batch.inputs.data(), T);
  ASSERT_EQ(probs.size(), size_t(shape.vocab_size));
  double total = 0;
  for (float p : probs) total += p;
  EXPECT_NEAR(total, 1.0, 1e-4);
}

// An observer that holds the first run of an operation until another has begun, and
// records whether it had to give up. Run one after the other, the wait would time out.
class OverlapProbe : public ScheduleObserver {
 public:
  // (held, awaited): `held` waits, in its Begin, for `awaited` to begin.
  explicit OverlapProbe(std::vector<std::pair<std::pair<Op, int>, std::pair<Op, int>>> pairs)
      : pairs_(std::move(pairs)) {}

  void Begin(Op op, int unit) override {
    std::unique_lock lock(mutex_);
    begun_.insert({op, unit});
    changed_.notify_all();
    for (auto it = pairs_.begin(); it != pairs_.end(); ++it) {
      if (it->first != std::pair(op, unit)) continue;
      const std::pair<Op, int> awaited = it->second;
      pairs_.erase(it);
      const bool overlapped = changed_.wait_for(lock, std::chrono::seconds(10), [&] { return begun_.count(awaited) > 0; });
      (overlapped ? overlapped_ : serial_).push_back(std::string(OpName(op)) + " of unit " + std::to_string(unit));
      break;
    }
  }
  void End(Op, int) override {}

  std::mutex mutex_;
  std::condition_variable changed_;
  std::set<std::pair<Op, int>> begun_;
  std::vector<std::string> overlapped_, serial_;
  std::vector<std::pair<std::pair<Op, int>, std::pair<Op, int>>> pairs_;
};

// Units: 0 is the root, 1 + l is block l (gpt2-tiny has 4 blocks: units 1-4).
TEST(ShardedEngine, GathersAndReduceScattersRunWhileTheComputeStreamWorks) {
  const api::ModelShape& shape = *api::FindPreset("gpt2-tiny");
  const Batch batch;
  runtime::MemoryAccounting accounting;
  ShardedEngine engine(shape, std::make_shared<const Mesh>(), B, T, 1, &accounting);
  // Forward: the gather of unit i+1 is in flight while unit i computes. Backward: the
  // reduce-scatter of unit i is in flight while unit i-1 computes its backward.
  OverlapProbe probe({{{Op::kGather, 2}, {Op::kForward, 1}},
                      {{Op::kGather, 3}, {Op::kForward, 2}},
                      {{Op::kReduceScatter, 4}, {Op::kBackward, 3}},
                      {{Op::kReduceScatter, 3}, {Op::kBackward, 2}}});
  engine.set_observer(&probe);
  engine.ZeroGrad();
  engine.Forward(batch.inputs.data(), batch.targets.data(), B, T);
  engine.Backward(1.0f, true);
  engine.set_observer(nullptr);
  EXPECT_EQ(probe.overlapped_.size(), 4u);
  EXPECT_TRUE(probe.serial_.empty()) << "ran alone: " << probe.serial_.front();
  EXPECT_LE(engine.peak_unsharded_blocks(), 2);
  EXPECT_GE(engine.peak_unsharded_blocks(), 2);  // the prefetch did overlap
}

// A training micro-batch gathers the root once: its forward keeps it for the backward.
// An evaluation forward gathers and frees it; so do Weights() and Update() after a
// forward whose backward never came, so nothing stays unsharded or stale.
TEST(ShardedEngine, ATrainingMicroBatchGathersTheRootOnce) {
  class RootGathers : public ScheduleObserver {
   public:
    void Begin(Op op, int unit) override { count += op == Op::kGather && unit == 0; }
    void End(Op, int) override {}
    std::atomic<int> count{0};
  } gathers;
  const api::ModelShape& shape = *api::FindPreset("gpt2-tiny");
  const Batch batch;
  runtime::MemoryAccounting accounting;
  ShardedEngine engine(shape, std::make_shared<const Mesh>(), B, T, 1, &accounting);
  engine.set_observer(&gathers);
  const train::MicroBatchKey key{0, 0};
  for (int micro = 0; micro < 3; ++micro) {
    engine.Forward(batch.inputs.data(), batch.targets.data(), B, T, &key);
    engine.Backward(1.0f, micro == 2);
  }
  EXPECT_EQ(gathers.count.load(), 3);
  EXPECT_EQ(accounting.current(runtime::MemoryCategory::kGathered), 0);
  engine.Forward(batch.inputs.data(), batch.targets.data(), B, T);  // evaluation
  EXPECT_EQ(gathers.count.load(), 4);
  EXPECT_EQ(accounting.current(runtime::MemoryCategory::kGathered), 0);
  engine.Forward(batch.inputs.data(), batch.targets.data(), B, T, &key);  // no backward follows
  EXPECT_GT(accounting.current(runtime::MemoryCategory::kGathered), 0);
  engine.Weights();
  EXPECT_EQ(accounting.current(runtime::MemoryCategory::kGathered), 0);
}

TEST(ShardedEngine, AMemoryLimitTooSmallIsAnErrorNamingTheCategoryAndSizes) {
  const api::ModelShape& shape = *api::FindPreset("gpt2-tiny");
  runtime::MemoryAccounting accounting;
  try {
    EngineOptions options;
    options.memory_limit = int64_t(4) << 20;
    ShardedEngine engine(shape, std::make_shared<const Mesh>(), B, T, 1, &accounting, options);
    FAIL() << "the engine fitted in 4 MiB";
  } catch (const runtime::OutOfMemory& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("out of host memory"), std::string::npos) << message;
    EXPECT_NE(message.find("the limit of 4.0 MiB"), std::string::npos) << message;
    EXPECT_NE(message.find(" for params"), std::string::npos) << message;  // the third unit's master shard
    EXPECT_NE(message.find("in use"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace meshtrain::parallel
