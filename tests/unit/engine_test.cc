// The sharded engine on one rank (S = T = 1, the replicated case), on the strict CPU
// backend (jittered streams, poisoned memory):
// - the same numbers as the whole-model reference (tests/support/model_reference.h), bit
//   for bit: loss, gradients, grad norm, clipped AdamW, weights;
// - the schedule's promises, seen through its observer: gathers and reduce-scatters
//   overlap compute, at most two blocks are unsharded, a training micro-batch gathers the
//   root once;
// - memory: a limit too small is an error naming the category and the sizes, and every
//   byte is allocated when the engine is built (the planner's figures, and nothing more),
//   on each rank of an expert group too (its ranks as threads, tests/support/fabric_ranks.h);
// - the strict backend's jitter changes nothing: the same bits under any seed;
// - precisions: bf16 emulation and fp32 against the fp64 engine;
// - vocabulary padding: the padded engine trains as the unpadded one, and its padding
//   stays zero.
// Layouts over several ranks are checked against this in tests/integration/engine_check.cc.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "api/engine_memory.h"
#include "api/layout.h"
#include "api/model_shape.h"
#include "tests/support/fabric_ranks.h"
#include "tests/support/model_reference.h"
#include "worker/kernels/cpu/cpu_ops.h"
#include "worker/kernels/cpu/kernels.h"
#include "worker/parallel/sharded_engine.h"
#include "worker/runtime/cpu_backend.h"
#include "worker/runtime/device_side.h"

namespace meshtrain::parallel {
namespace {

using kernels::Bf16;
using kernels::Fp32;
using kernels::Fp64;
using runtime::MemoryCategory;

constexpr int B = 2, T = 16;
// The weight of each target in a micro-batch's loss that makes it the mean (engine.h).
constexpr float kMean = 1.0f / (B * T);

struct Batch {
  std::vector<int32_t> inputs = std::vector<int32_t>(B * T), targets = std::vector<int32_t>(B * T);
  Batch() {
    for (int i = 0; i < B * T; ++i) inputs[i] = (i * 7) % 256, targets[i] = (i * 13 + 5) % 256;
  }
};

template <class P>
std::unique_ptr<kernels::Ops<P>> CpuOps(runtime::Backend&, runtime::CachingAllocator*) {
  return kernels::MakeCpuOps<P>();
}

// Jittered streams and poisoned memory: a missing event or a read of what nothing wrote
// shows as a wrong number.
runtime::CpuBackendOptions StrictOptions(uint64_t jitter_seed = 7) { return {jitter_seed, true}; }
std::shared_ptr<runtime::Backend> Backend(runtime::CpuBackendOptions options = StrictOptions()) {
  return std::make_shared<runtime::CpuBackend>(options);
}

template <class P = Fp32>
std::unique_ptr<ShardedEngine<P>> OneRank(const api::ModelShape& shape, int batch, int seq, uint64_t seed,
                                          runtime::MemoryAccounting* accounting, const EngineOptions& options = {},
                                          std::shared_ptr<runtime::Backend> backend = Backend()) {
  return std::make_unique<ShardedEngine<P>>(shape, std::make_shared<const Mesh>(), batch, seq, seed, accounting, options,
                                            std::move(backend), CpuOps<P>);
}

// Every tensor of `layout` in unit u, as the unit's segment table holds it: offsets from
// the unit's start, the model's elements only, every tensor in the norm (one rank).
std::vector<kernels::ShardSegment> SegmentsOfUnit(const model::ParameterLayout& layout, int u) {
  const auto [begin, end] = layout.Unit(u);
  std::vector<kernels::ShardSegment> segments;
  for (const model::ParamTensor& t : layout.tensors()) {
    if (t.offset < begin || t.offset >= end) continue;
    segments.push_back({t.offset - begin, t.real, t.decay ? 1 : 0, 1});
  }
  return segments;
}

// The engine takes the Trainer's step: norm, clipping to max_norm, then AdamW, against
// the same arithmetic written out on the whole-model reference. On one rank the sums
// run in the same order, so the results agree bit for bit.
// GPT-2, the Llama class with an untied head (its own unit), and Qwen2's biases with a tied
// head and one key/value head.
const api::ModelShape kQwenTiny{.layers = 3, .heads = 4, .hidden = 64, .vocab_size = 256, .seq_len = 32,
                                .family = "qwen2", .kv_heads = 1, .head_dim = 16, .intermediate = 96,
                                .max_positions = 64, .norm_eps = 1e-6, .rope_theta = 1000, .tied = true};

// Qwen3's per-head norms of q and k, with heads x head_dim (96) past hidden (64).
const api::ModelShape kQwen3Tiny{.layers = 3, .heads = 4, .hidden = 64, .vocab_size = 256, .seq_len = 32,
                                 .family = "qwen3", .kv_heads = 2, .head_dim = 24, .intermediate = 96,
                                 .max_positions = 64, .norm_eps = 1e-6, .rope_theta = 1000, .tied = false};

TEST(ShardedEngine, OneRankMatchesTheWholeModelBitForBit) {
  for (const api::ModelShape& shape :
       {*api::FindPreset("gpt2-tiny"), *api::FindPreset("llama-tiny"), kQwenTiny, kQwen3Tiny,
        *api::FindPreset("moe-tiny"), *api::FindPreset("qwen3-moe-tiny")}) {
  SCOPED_TRACE(api::DescribeShape(shape));
  const Batch batch;
  runtime::MemoryAccounting accounting;
  const EngineOptions options;  // the padded vocabulary (api::kVocabMultiple), as in production
  auto engine = OneRank(shape, B, T, 99, &accounting, options);
  EXPECT_EQ(engine->device(), runtime::Device::Cpu());

  testing::ModelReference<Fp32> reference(shape, B, T, 99, options.vocab_multiple, StrictOptions(8));
  const testing::ModelReference<Fp32>::Training training{};
  const double loss = reference.Forward(batch.inputs.data(), batch.targets.data(), B, T, &training);
  reference.Backward();
  const std::vector<float> grads = reference.Grads();
  const model::ParameterLayout& layout = reference.layout();
  // The norm as the engine sums it: unit by unit, segment by segment.
  double squares = 0;
  for (int u = 0; u < layout.units(); ++u) {
    const std::vector<kernels::ShardSegment> segments = SegmentsOfUnit(layout, u);
    kernels::cpu::SumSquares(&squares, grads.data() + layout.Unit(u).first, segments.data(), int(segments.size()));
  }
  const double norm = std::sqrt(squares);

  engine->ZeroGrad();
  const MicroBatchKey key{0, 0};
  engine->Forward(batch.inputs.data(), batch.targets.data(), B, T, &key, kMean);
  engine->Backward(true);
  OptimizerStep step;
  step.learning_rate = 1e-2f;
  step.weight_decay = 0.1f;
  step.max_norm = float(norm / 4);  // clipping must bite
  engine->Update(step);
  EXPECT_EQ(engine->TakeLoss(), loss);
  EXPECT_EQ(engine->GradNorm(), norm);

  float scale = 0;
  kernels::cpu::ClipScale(&scale, &squares, step.max_norm);
  EXPECT_LT(scale, 0.3f);
  std::vector<float> master = reference.Params(), m(master.size(), 0.0f), v(master.size(), 0.0f);
  const kernels::AdamWStep adamw{step.learning_rate, step.beta1, step.beta2, step.epsilon, step.weight_decay, step.t};
  for (int u = 0; u < layout.units(); ++u) {
    const int64_t at = layout.Unit(u).first;
    const std::vector<kernels::ShardSegment> segments = SegmentsOfUnit(layout, u);
    kernels::cpu::AdamW<float, float>(master.data() + at, nullptr, grads.data() + at, m.data() + at, v.data() + at,
                                      segments.data(), int(segments.size()), adamw, &scale);
  }
  EXPECT_EQ(engine->Weights(), reference.ModelElements(master));

  // The units' own gradients, read on the device side (S = 1: each unit's shard is the
  // whole unit), are the reference's, bit for bit.
  for (const auto& unit : engine->units()) {
    const float* shard = runtime::DeviceSide::Address(unit->grads());
    const std::vector<float> got(shard, shard + unit->numel());
    const std::vector<float> want(grads.begin() + unit->begin(), grads.begin() + unit->begin() + unit->numel());
    EXPECT_EQ(got, want) << "unit " << unit->index();
  }
  EXPECT_GT(accounting.peak(MemoryCategory::kOptimizer), 0);
  EXPECT_GT(accounting.peak(MemoryCategory::kGathered), 0);

  // Sampling reads the same logits: the same distribution.
  reference.SetParams(master);
  const std::vector<float> probs = engine->NextTokenProbabilities(batch.inputs.data(), T);
  const std::vector<double> want = reference.NextTokenProbabilities(batch.inputs.data(), T);
  ASSERT_EQ(probs.size(), size_t(shape.vocab_size));
  double total = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    total += probs[i];
    ASSERT_NEAR(probs[i], want[i], 1e-6) << "token " << i;  // the engine's softmax subtracts in fp32
  }
  EXPECT_NEAR(total, 1.0, 1e-4);
  }
}

// An observer that holds the first run of an operation until another has begun, and
// records whether it had to give up: run one after the other, the wait would time out.
// It also counts the blocks that are unsharded at once, from each block's gather to its
// release.
class OverlapProbe : public ScheduleObserver {
 public:
  // (held, awaited): `held` waits, in its Begin, for `awaited` to begin.
  explicit OverlapProbe(std::vector<std::pair<std::pair<Op, int>, std::pair<Op, int>>> pairs)
      : pairs_(std::move(pairs)) {}

  void Begin(Op op, int unit) override {
    std::unique_lock lock(mutex_);
    begun_.insert({op, unit});
    if (unit > 0 && op == Op::kGather) peak_blocks_ = std::max(peak_blocks_, ++blocks_);
    if (unit > 0 && op == Op::kRelease) --blocks_;
    changed_.notify_all();
    for (auto it = pairs_.begin(); it != pairs_.end(); ++it) {
      if (it->first != std::pair(op, unit)) continue;
      const std::pair<Op, int> awaited = it->second;
      pairs_.erase(it);
      const bool overlapped =
          changed_.wait_for(lock, std::chrono::seconds(10), [&] { return begun_.count(awaited) > 0; });
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
  int blocks_ = 0, peak_blocks_ = 0;
};

// Units: 0 is the root, 1 + l is block l (gpt2-tiny has 4 blocks: units 1-4).
TEST(ShardedEngine, GathersAndReduceScattersRunWhileTheComputeStreamWorks) {
  const api::ModelShape& shape = *api::FindPreset("gpt2-tiny");
  const Batch batch;
  runtime::MemoryAccounting accounting;
  auto engine = OneRank(shape, B, T, 1, &accounting);
  // Forward: the gather of unit i+1 is in flight while unit i computes. Backward: the
  // reduce-scatter of unit i is in flight while unit i-1 computes its backward.
  OverlapProbe probe({{{Op::kGather, 2}, {Op::kForward, 1}},
                      {{Op::kGather, 3}, {Op::kForward, 2}},
                      {{Op::kReduceScatter, 4}, {Op::kBackward, 3}},
                      {{Op::kReduceScatter, 3}, {Op::kBackward, 2}}});
  engine->set_observer(&probe);
  engine->ZeroGrad();
  const MicroBatchKey key{0, 0};
  engine->Forward(batch.inputs.data(), batch.targets.data(), B, T, &key, kMean);
  engine->Backward(true);
  engine->TakeLoss();  // the observer is called from the streams: wait for them
  engine->set_observer(nullptr);
  EXPECT_EQ(probe.overlapped_.size(), 4u);
  EXPECT_TRUE(probe.serial_.empty()) << "ran alone: " << probe.serial_.front();
  EXPECT_LE(probe.peak_blocks_, 2);
  EXPECT_GE(probe.peak_blocks_, 2);  // the prefetch did overlap
  EXPECT_EQ(probe.blocks_, 0) << "a block was gathered and never released";
}

// A training micro-batch gathers the root and the last block once: its forward keeps
// them for the backward, which starts with them; every other block is gathered twice.
// An evaluation forward gathers and lets them go; so do Weights() and Update() after a
// forward whose backward never came, so nothing stays held or stale: the Backward that
// comes too late is refused.
TEST(ShardedEngine, ATrainingMicroBatchGathersTheRootAndTheLastBlockOnce) {
  class RootGathers : public ScheduleObserver {
   public:
    void Begin(Op op, int unit) override {
      if (op != Op::kGather) return;
      count += unit == 0;
      std::lock_guard lock(mutex);
      ++blocks[unit];
    }
    void End(Op, int) override {}
    std::atomic<int> count{0};
    std::mutex mutex;
    std::map<int, int> blocks;  // gathers by unit
  } gathers;
  const api::ModelShape& shape = *api::FindPreset("gpt2-tiny");
  const Batch batch;
  runtime::MemoryAccounting accounting;
  auto engine = OneRank(shape, B, T, 1, &accounting);
  engine->set_observer(&gathers);
  const MicroBatchKey key{0, 0};
  engine->ZeroGrad();
  for (int micro = 0; micro < 3; ++micro) {
    engine->Forward(batch.inputs.data(), batch.targets.data(), B, T, &key, kMean / 3);
    engine->Backward(micro == 2);
  }
  engine->TakeLoss();
  EXPECT_EQ(gathers.count.load(), 3);
  {
    std::lock_guard lock(gathers.mutex);
    EXPECT_EQ(gathers.blocks, (std::map<int, int>{{0, 3}, {1, 6}, {2, 6}, {3, 6}, {4, 3}}));
  }
  engine->Forward(batch.inputs.data(), batch.targets.data(), B, T, nullptr, kMean);  // evaluation
  engine->TakeLoss();
  EXPECT_EQ(gathers.count.load(), 4);
  EXPECT_THROW(engine->Backward(true), std::logic_error) << "an evaluation forward has no backward";
  engine->Forward(batch.inputs.data(), batch.targets.data(), B, T, &key, kMean);  // no backward follows
  engine->Weights();
  EXPECT_THROW(engine->Backward(true), std::logic_error) << "Weights() kept the root of a forward";
  engine->ZeroGrad();
  engine->Forward(batch.inputs.data(), batch.targets.data(), B, T, &key, kMean);
  engine->Update(OptimizerStep{});
  EXPECT_THROW(engine->Backward(true), std::logic_error) << "Update() kept the root of a forward";
  engine->TakeLoss();
  EXPECT_EQ(gathers.count.load(), 6);
}

// ForwardBackward over a step's micro-batches is each one's training Forward and Backward
// in turn, bit for bit: the same loss and gradients, for a tied head and an untied one.
TEST(ShardedEngine, ForwardBackwardIsEachForwardAndBackwardInTurn) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    const api::ModelShape& shape = *api::FindPreset(preset);
    std::vector<int32_t> inputs(3 * B * T), targets(3 * B * T);
    for (size_t i = 0; i < inputs.size(); ++i) inputs[i] = int32_t(i * 7 + 3) % 256, targets[i] = int32_t(i * 13 + 5) % 256;
    auto run = [&](bool together) {
      runtime::MemoryAccounting accounting;
      auto engine = OneRank(shape, B, T, 5, &accounting);
      engine->ZeroGrad();
      std::vector<MicroBatch> micro_batches;
      for (int m = 0; m < 3; ++m) {
        micro_batches.push_back(
            {inputs.data() + m * B * T, targets.data() + m * B * T, B, T, {0, m}, kMean / 3, nullptr});
      }
      if (together) {
        engine->ForwardBackward(micro_batches);
      } else {
        for (const MicroBatch& m : micro_batches) {
          engine->Forward(m.inputs, m.targets, m.B, m.T, &m.key, m.target_weight);
          engine->Backward(m.key.micro == 2);
        }
      }
      std::vector<float> grads;
      const double loss = engine->TakeLoss();
      for (const auto& unit : engine->units()) {
        const float* g = runtime::DeviceSide::Address(unit->grads());
        grads.insert(grads.end(), g, g + unit->numel());
      }
      return std::make_pair(loss, grads);
    };
    const auto [loss, grads] = run(false);
    const auto [together_loss, together_grads] = run(true);
    EXPECT_EQ(together_loss, loss);
    EXPECT_EQ(together_grads, grads);
  }
}

TEST(ShardedEngine, AMemoryLimitTooSmallIsAnErrorNamingTheCategoryAndSizes) {
  const api::ModelShape& shape = *api::FindPreset("gpt2-tiny");
  runtime::MemoryAccounting accounting;
  // The step buffer, the root's four arrays and block 0's fit in 4 MiB; block 1's master
  // shard (the third unit's) does not.
  const int64_t block_master = int64_t(api::AllocatorBlockBytes(size_t(api::UnitElementsOf(shape, 0, 1).block) * 4));
  try {
    EngineOptions options;
    options.memory_limit = int64_t(4) << 20;
    OneRank(shape, B, T, 1, &accounting, options, Backend(runtime::CpuBackendOptions{}));
    FAIL() << "the engine fitted in 4 MiB";
  } catch (const runtime::OutOfMemory& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("out of host memory: " + runtime::FormatBytes(size_t(block_master)) +
                           " for params would pass the limit of 4.0 MiB, with "),
              std::string::npos)
        << message;
    EXPECT_NE(message.find(" in use"), std::string::npos) << message;
  }
}

// Every figure of the accounting by category, current and peak.
std::vector<int64_t> Figures(const runtime::MemoryAccounting& accounting) {
  std::vector<int64_t> figures;
  for (size_t c = 0; c < runtime::kMemoryCategories; ++c) {
    figures.push_back(accounting.current(MemoryCategory(c)));
    figures.push_back(accounting.peak(MemoryCategory(c)));
  }
  return figures;
}

// Every buffer of a step is taken when the engine is built: what the accounting shows
// then is exactly what the planner counts (api::EngineMemoryOf), every allocation is
// still live (current = peak), and training, evaluation, sampling, checkpoint snapshots
// and reading the weights allocate nothing more, in any mode.
TEST(ShardedEngine, NothingIsAllocatedAfterConstruction) {
  const api::ModelShape shape{.layers = 4, .heads = 2, .hidden = 32, .vocab_size = 100, .seq_len = T};
  const Batch batch;
  std::vector<int32_t> inputs = batch.inputs, targets = batch.targets;
  for (int32_t& t : inputs) t %= 100;
  for (int32_t& t : targets) t %= 100;
  ActivationPolicy checkpointing{true, false, 2}, offload{true, true, 1};
  for (const ActivationPolicy& policy : {ActivationPolicy{}, checkpointing, offload}) {
    const std::string mode = policy.offload ? "offload" : policy.checkpointing ? "checkpointing" : "keep all";
    runtime::MemoryAccounting accounting;
    EngineOptions options;
    options.activations = policy;
    options.dropout = 0.1f;
    auto engine = OneRank(shape, B, T, 3, &accounting, options);

    auto ops = kernels::MakeCpuOps<Fp32>();
    api::EngineTypes types = model::TypesOf(*ops, B, T, shape, 1);
    types.vocab_multiple = options.vocab_multiple;
    const api::EngineMemory planned = api::EngineMemoryOf(shape, B, T, 0, 1, 1, policy, types, /*dropout=*/true);
    EXPECT_EQ(accounting.current(MemoryCategory::kParams), planned.params) << mode;
    EXPECT_EQ(accounting.current(MemoryCategory::kGrads), planned.grads) << mode;
    EXPECT_EQ(accounting.current(MemoryCategory::kOptimizer), planned.optimizer) << mode;
    EXPECT_EQ(accounting.current(MemoryCategory::kActivations), planned.activations) << mode;
    EXPECT_EQ(accounting.current(MemoryCategory::kOffload), planned.offload) << mode;
    EXPECT_EQ(accounting.current(MemoryCategory::kGathered), planned.gathered) << mode;
    EXPECT_EQ(accounting.current(MemoryCategory::kComm), planned.comm) << mode;
    for (size_t c = 0; c < runtime::kMemoryCategories; ++c) {
      EXPECT_EQ(accounting.current(MemoryCategory(c)), accounting.peak(MemoryCategory(c)))
          << mode << ": something of " << runtime::MemoryCategoryName(MemoryCategory(c))
          << " was freed while the engine was built";
    }
    const std::vector<int64_t> built = Figures(accounting);

    OptimizerStep step;
    step.learning_rate = 1e-3f;
    step.max_norm = 1.0f;
    for (int s = 0; s < 3; ++s) {
      engine->ZeroGrad();
      for (int micro = 0; micro < 2; ++micro) {
        const MicroBatchKey key{s, micro};
        engine->Forward(inputs.data(), targets.data(), B, T, &key, kMean / 2);
        engine->Backward(micro == 1);
      }
      step.t = s + 1;
      engine->Update(step);
      EXPECT_TRUE(std::isfinite(engine->TakeLoss())) << mode;
      EXPECT_GT(engine->GradNorm(), 0) << mode;
    }
    engine->Forward(inputs.data(), targets.data(), 1, T / 2, nullptr, 2.0f / T);  // a smaller evaluation batch
    engine->TakeLoss();
    engine->NextTokenProbabilities(inputs.data(), 5);
    engine->Weights();
    ShardState snapshot;
    engine->Snapshot(&snapshot);
    engine->comm_stats();
    EXPECT_EQ(Figures(accounting), built) << mode;
  }
}

// Expert parallelism: each rank of an expert group holds E/EP experts of each block,
// sharded over the S / EP ranks holding the same ones, its received rows sized for EP x
// its tokens' copies. Every rank's engine, built over the others (threads of this
// process), allocates exactly what the planner counts for it (api::EngineMemoryOf with
// the types' experts = EP), category by category, and a training step allocates nothing
// more. Both families; EP 2 and 4 (their 4 experts); an expert-shard group of one rank
// (S = EP) and of two; replicas; every activation policy; and TP 2, which splits each
// expert's width and adds the routing weights' gradients of every TP rank to the scratch.
// Qwen3-MoE with dense blocks among its sparse ones (decoderSparseStep 2: block 0 dense,
// block 1 sparse) has block units of two sizes, the dense one sharded over all S ranks.
TEST(ShardedEngine, UnderExpertParallelismEachRankAllocatesWhatThePlannerCounts) {
  struct Case {
    const char* preset;
    int ranks, shard, experts;  // one node of `ranks`; S; EP
    ActivationPolicy policy;
    int tp = 1;
    int sparse_step = 1;  // decoder_sparse_step
  };
  const ActivationPolicy keep{}, checkpointing{true, false, 2}, offload{true, true, 1};
  const Case cases[] = {
      {"moe-tiny", 2, 2, 2, keep},          {"moe-tiny", 4, 4, 2, checkpointing}, {"moe-tiny", 4, 4, 4, offload},
      {"moe-tiny", 4, 2, 2, keep},          {"qwen3-moe-tiny", 2, 2, 2, offload}, {"qwen3-moe-tiny", 4, 4, 2, keep},
      {"qwen3-moe-tiny", 4, 4, 4, checkpointing},
      {"moe-tiny", 4, 2, 2, checkpointing, 2}, {"qwen3-moe-tiny", 4, 2, 2, offload, 2},
      {"qwen3-moe-tiny", 2, 2, 2, keep, 1, 2},   {"qwen3-moe-tiny", 4, 4, 2, offload, 1, 2},
      {"qwen3-moe-tiny", 4, 2, 2, checkpointing, 2, 2},
  };
  comm::FabricOptions fabric;
  fabric.timeout = std::chrono::seconds(60);
  for (const Case& c : cases) {
    api::ModelShape shape = *api::FindPreset(c.preset);
    shape.decoder_sparse_step = c.sparse_step;
    ASSERT_EQ(shape.DenseBlocks(), c.sparse_step == 2 ? 1 : 0);
    const std::string name = std::string(c.preset) + (c.sparse_step > 1 ? " (dense block 0)" : "") + ", " +
                             std::to_string(c.ranks) + " ranks, T " +
                             std::to_string(c.tp) + ", S " + std::to_string(c.shard) + ", EP " +
                             std::to_string(c.experts) +
                             (c.policy.offload ? ", offload" : c.policy.checkpointing ? ", checkpointing" : ", keep all");
    SCOPED_TRACE(name);
    ASSERT_EQ(shape.experts % c.experts, 0);
    const api::ParallelLayout layout(1, c.ranks, c.tp, c.shard, 1, 1, c.experts);
    auto ops = kernels::MakeCpuOps<Fp32>();
    api::EngineTypes types = model::TypesOf(*ops, B, T, shape, c.tp);
    types.vocab_multiple = api::kVocabMultiple;
    types.experts = c.experts;
    // The split shows in the count: a block's compute copies hold E/EP experts, so its
    // slots shrink, while its shard holds the shared part over S / EP ranks, so it grows.
    api::EngineTypes whole_types = types;
    whole_types.experts = 1;
    const api::EngineMemory whole = api::EngineMemoryOf(shape, B, T, 0, c.tp, c.shard, c.policy, whole_types, false);
    const api::EngineMemory first = api::EngineMemoryOf(shape, B, T, 0, c.tp, c.shard, c.policy, types, false);
    EXPECT_LT(first.gathered, whole.gathered);
    EXPECT_GT(first.params, whole.params);
    Batch batch;
    testing::RunFabricRanks(c.ranks, 1, fabric, [&](comm::Communicator& world) {
      const std::shared_ptr<runtime::Backend> backend = Backend();
      const auto mesh = std::make_shared<const Mesh>(layout, &world, nullptr, backend.get());
      EXPECT_EQ(mesh->expert_size(), c.experts);
      runtime::MemoryAccounting accounting;
      EngineOptions options;
      options.activations = c.policy;
      ShardedEngine<Fp32> engine(shape, mesh, B, T, 11, &accounting, options, backend, CpuOps<Fp32>);
      const std::string rank = name + ", rank " + std::to_string(world.rank());
      const api::EngineMemory planned =
          api::EngineMemoryOf(shape, B, T, mesh->tp_rank(), c.tp, c.shard, c.policy, types, false);
      EXPECT_EQ(accounting.current(MemoryCategory::kParams), planned.params) << rank;
      EXPECT_EQ(accounting.current(MemoryCategory::kGrads), planned.grads) << rank;
      EXPECT_EQ(accounting.current(MemoryCategory::kOptimizer), planned.optimizer) << rank;
      EXPECT_EQ(accounting.current(MemoryCategory::kActivations), planned.activations) << rank;
      EXPECT_EQ(accounting.current(MemoryCategory::kOffload), planned.offload) << rank;
      EXPECT_EQ(accounting.current(MemoryCategory::kGathered), planned.gathered) << rank;
      EXPECT_EQ(accounting.current(MemoryCategory::kComm), planned.comm) << rank;
      EXPECT_EQ(accounting.peak_total(), planned.total()) << rank;
      const std::vector<int64_t> built = Figures(accounting);
      // A step: the tokens to their experts' ranks and back, the gradients reduced over
      // the expert-shard and expert groups; each rank reads its own sequences.
      std::vector<int32_t> inputs = batch.inputs;  // the same on the ranks of a TP group
      for (int32_t& t : inputs) t = (t + 3 * (world.rank() / c.tp)) % 256;
      engine.ZeroGrad();
      const MicroBatchKey key{0, 0};
      engine.Forward(inputs.data(), batch.targets.data(), B, T, &key, kMean);
      engine.Backward(true);
      engine.Update(OptimizerStep{1e-3f});
      EXPECT_TRUE(std::isfinite(engine.TakeLoss())) << rank;
      EXPECT_GT(engine.GradNorm(), 0) << rank;
      EXPECT_GT(engine.comm_stats().all_to_all, 0) << rank << ": no all-to-all carried the tokens";
      EXPECT_EQ(Figures(accounting), built) << rank << ": the step allocated";
    });
  }
}

// A pipeline stage of a mixture with dense blocks holds units of both sizes or of one:
// each stage's engine allocates what the planner counts for its stage (api::StageShapeOf
// says how many of its blocks are dense), under every schedule and activation policy.
TEST(ShardedEngine, APipelineStageOfDenseAndSparseBlocksAllocatesWhatThePlannerCounts) {
  api::ModelShape shape = *api::FindPreset("qwen3-moe-tiny");
  shape.layers = 5, shape.decoder_sparse_step = 2;  // blocks 0, 2 and 4 dense; 1 and 3 sparse
  const ActivationPolicy keep{}, offload{true, true, 1};
  struct Case {
    api::Pipeline pipeline;
    ActivationPolicy policy;
  };
  const Case cases[] = {{{2, 1, api::PipelineSchedule::kOneFOneB}, keep},
                        {{2, 1, api::PipelineSchedule::kGPipe}, offload},
                        {{2, 2, api::PipelineSchedule::kInterleaved}, keep}};
  comm::FabricOptions fabric;
  fabric.timeout = std::chrono::seconds(60);
  for (const Case& c : cases) {
    SCOPED_TRACE("P2 V" + std::to_string(c.pipeline.virtual_stages) + (c.policy.offload ? ", offload" : ""));
    const api::ParallelLayout layout(1, 2, 1, 1, 2);
    auto ops = kernels::MakeCpuOps<Fp32>();
    api::EngineTypes types = model::TypesOf(*ops, B, T, shape, 1);
    types.vocab_multiple = api::kVocabMultiple;
    const int micro_batches = c.pipeline.chunks();
    int dense_held = 0;
    std::mutex mutex;
    testing::RunFabricRanks(2, 1, fabric, [&](comm::Communicator& world) {
      const std::shared_ptr<runtime::Backend> backend = Backend();
      const auto mesh = std::make_shared<const Mesh>(layout, &world, nullptr, backend.get());
      runtime::MemoryAccounting accounting;
      EngineOptions options;
      options.activations = c.policy;
      options.pipeline = c.pipeline;
      options.micro_batches = micro_batches;
      ShardedEngine<Fp32> engine(shape, mesh, B, T, 11, &accounting, options, backend, CpuOps<Fp32>);
      const api::StageShape stage = api::StageShapeOf(shape, c.pipeline, mesh->stage(), micro_batches, T);
      {
        const std::lock_guard<std::mutex> lock(mutex);
        dense_held += stage.dense_blocks;
      }
      const api::EngineMemory planned =
          api::EngineMemoryOf(shape, B, T, 0, 1, 1, c.policy, types, false, false, stage);
      const std::string rank = "stage " + std::to_string(mesh->stage());
      EXPECT_EQ(accounting.current(MemoryCategory::kParams), planned.params) << rank;
      EXPECT_EQ(accounting.current(MemoryCategory::kGathered), planned.gathered) << rank;
      EXPECT_EQ(accounting.current(MemoryCategory::kActivations), planned.activations) << rank;
      EXPECT_EQ(accounting.current(MemoryCategory::kOffload), planned.offload) << rank;
      EXPECT_EQ(accounting.peak_total(), planned.total()) << rank;
    });
    EXPECT_EQ(dense_held, 3);  // the stages hold the model's dense blocks between them
  }
}

struct TrainingRun {
  std::vector<double> losses, norms;
  std::vector<float> weights;
};

// `steps` optimizer steps of two micro-batches each on data with a pattern to learn (the
// next token is the input plus one), then the weights.
template <class P>
TrainingRun Train(const api::ModelShape& shape, int batch, int steps, const EngineOptions& options,
          std::shared_ptr<runtime::Backend> backend, float learning_rate = 1e-2f) {
  runtime::MemoryAccounting accounting;
  auto engine = OneRank<P>(shape, batch, T, 5, &accounting, options, std::move(backend));
  const int64_t V = shape.vocab_size;
  std::vector<int32_t> inputs(size_t(batch) * T), targets(inputs.size());
  OptimizerStep step;
  step.learning_rate = learning_rate;
  step.weight_decay = 0.1f;
  step.max_norm = 1.0f;
  TrainingRun run;
  for (int s = 0; s < steps; ++s) {
    engine->ZeroGrad();
    for (int micro = 0; micro < 2; ++micro) {
      for (size_t i = 0; i < inputs.size(); ++i) {
        inputs[i] = int32_t((int64_t(i) * 7 + s * 5 + micro * 3) % V);
        targets[i] = int32_t((inputs[i] + 1) % V);
      }
      const MicroBatchKey key{s, micro};
      engine->Forward(inputs.data(), targets.data(), batch, T, &key, 0.5f / float(batch * T));
      engine->Backward(micro == 1);
    }
    step.t = s + 1;
    engine->Update(step);
    run.losses.push_back(engine->TakeLoss());
    run.norms.push_back(engine->GradNorm());
  }
  run.weights = engine->Weights();
  return run;
}

const api::ModelShape kSmall{.layers = 4, .heads = 2, .hidden = 32, .vocab_size = 64, .seq_len = T};

// Replicated at world 1 (EngineOptions::keep_units_gathered, what bench train --compare
// replicated measures): every unit's compute copy is made once and AdamW keeps it
// current, instead of a gather before each use. The numbers are the FSDP life cycle's,
// bit for bit, in fp32 and in the bf16 emulation (the copy AdamW writes rounds as the
// gather's cast does); the memory is the planner's figure for it.
TEST(ShardedEngine, KeepingUnitsGatheredGivesTheSameBitsAndGathersEachUnitOnce) {
  class Gathers : public ScheduleObserver {
   public:
    void Begin(Op op, int) override { count += op == Op::kGather; }
    void End(Op, int) override {}
    std::atomic<int> count{0};
  };
  EngineOptions kept;
  kept.keep_units_gathered = true;
  const TrainingRun fsdp = Train<Fp32>(kSmall, B, 3, {}, Backend());
  const TrainingRun replicated = Train<Fp32>(kSmall, B, 3, kept, Backend());
  EXPECT_EQ(replicated.losses, fsdp.losses);
  EXPECT_EQ(replicated.norms, fsdp.norms);
  EXPECT_EQ(replicated.weights, fsdp.weights);
  const TrainingRun fsdp16 = Train<Bf16>(kSmall, B, 3, {}, Backend());
  const TrainingRun replicated16 = Train<Bf16>(kSmall, B, 3, kept, Backend());
  EXPECT_EQ(replicated16.losses, fsdp16.losses);
  EXPECT_EQ(replicated16.weights, fsdp16.weights);

  runtime::MemoryAccounting accounting;
  auto engine = OneRank(kSmall, B, T, 5, &accounting, kept);
  auto ops = kernels::MakeCpuOps<Fp32>();
  api::EngineTypes types = model::TypesOf(*ops, B, T, kSmall, 1);
  types.vocab_multiple = kept.vocab_multiple;
  const api::EngineMemory planned = api::EngineMemoryOf(kSmall, B, T, 0, 1, 1, {}, types, false, true);
  EXPECT_EQ(accounting.current(MemoryCategory::kGathered), planned.gathered);
  EXPECT_GT(planned.gathered, api::EngineMemoryOf(kSmall, B, T, 0, 1, 1, {}, types, false).gathered);
  Gathers gathers;
  engine->set_observer(&gathers);
  const Batch batch;
  std::vector<int32_t> inputs = batch.inputs, targets = batch.targets;
  for (int32_t& t : inputs) t %= 64;
  for (int32_t& t : targets) t %= 64;
  for (int s = 0; s < 3; ++s) {
    engine->ZeroGrad();
    const MicroBatchKey key{s, 0};
    engine->Forward(inputs.data(), targets.data(), B, T, &key, kMean);
    engine->Backward(true);
    engine->Update(OptimizerStep{1e-3f});
  }
  engine->TakeLoss();
  EXPECT_EQ(gathers.count.load(), int(kSmall.layers) + 1) << "each unit once, in the first forward";
  // A restored state makes the kept copies stale: the next forward makes them again.
  WholeState state;
  state.master = engine->Weights();
  state.m.assign(state.master.size(), 0.0f);
  state.v.assign(state.master.size(), 0.0f);
  engine->Restore(state);
  engine->Forward(inputs.data(), targets.data(), B, T, nullptr, kMean);
  engine->TakeLoss();
  EXPECT_EQ(gathers.count.load(), 2 * (int(kSmall.layers) + 1));
  engine->set_observer(nullptr);
}

// Fine-tuning data masks the prompt's targets (-1): they add no loss and no gradient, and
// the loss is the mean over the global batch's unmasked targets, each weighing 1 over
// their number. Split into micro-batches holding very different numbers of targets, the
// step's loss and gradients are one micro-batch's, up to summation order; averaging each
// micro-batch's mean instead (a known bug of other trainers) is far off.
TEST(ShardedEngine, MaskedTargetsAddNothingAndTheLossIsTheMeanOverTheGlobalBatch) {
  const api::ModelShape& shape = *api::FindPreset("llama-tiny");
  constexpr int Bs = 4;
  std::vector<int32_t> inputs(Bs * T), targets(Bs * T);
  for (int i = 0; i < Bs * T; ++i) inputs[i] = (i * 7 + 3) % 256, targets[i] = (i * 13 + 5) % 256;
  // Row 0 keeps 2 targets, row 1 all 16, row 2 half, row 3 one: 2 + 16 + 8 + 1 = 27.
  const int kept[Bs] = {2, T, T / 2, 1};
  int64_t count = 0;
  for (int b = 0; b < Bs; ++b) {
    for (int t = kept[b]; t < T; ++t) targets[size_t(b * T + t)] = -1;
    count += kept[b];
  }
  ASSERT_EQ(count, 27);
  struct Result {
    double loss;
    std::vector<float> grads;
  };
  // One step of `micro` micro-batches of Bs / micro rows, each target weighing `weight(m)`.
  auto run = [&](const std::vector<int32_t>& in, const std::vector<int32_t>& out, int micro,
                 const std::function<float(int)>& weight) {
    runtime::MemoryAccounting accounting;
    auto engine = OneRank(shape, Bs, T, 5, &accounting);
    engine->ZeroGrad();
    const int rows = Bs / micro;
    for (int m = 0; m < micro; ++m) {
      const MicroBatchKey key{0, m};
      engine->Forward(in.data() + m * rows * T, out.data() + m * rows * T, rows, T, &key, weight(m));
      engine->Backward(m + 1 == micro);
    }
    Result r{engine->TakeLoss(), {}};
    for (const auto& unit : engine->units()) {
      const float* g = runtime::DeviceSide::Address(unit->grads());
      r.grads.insert(r.grads.end(), g, g + unit->numel());
    }
    return r;
  };
  const float per_target = 1.0f / float(count);
  const Result whole = run(inputs, targets, 1, [&](int) { return per_target; });
  const Result split = run(inputs, targets, 2, [&](int) { return per_target; });  // 18 and 9 targets
  EXPECT_NEAR(split.loss, whole.loss, 1e-6 * whole.loss);
  auto relative = [&](const std::vector<float>& got) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < whole.grads.size(); ++i) {
      diff += std::pow(double(got[i]) - whole.grads[i], 2);
      norm += std::pow(double(whole.grads[i]), 2);
    }
    return norm > 0 ? std::sqrt(diff / norm) : 1.0;
  };
  EXPECT_LT(relative(split.grads), 1e-5) << "micro-batching changes the gradients";
  // The mean of the micro-batches' means weighs the 9 targets of the second twice as much
  // (at initialisation every target's loss is near log 256, so the loss moves little).
  const Result means = run(inputs, targets, 2, [&](int m) { return 0.5f / float(m == 0 ? 18 : 9); });
  EXPECT_GT(std::abs(means.loss - whole.loss), 1e-4 * whole.loss);
  EXPECT_GT(relative(means.grads), 0.1);

  // A masked position's target is not read: other values there change nothing, bit for bit.
  std::vector<int32_t> other = targets;
  for (int32_t& t : other) t = t < 0 ? -1 : t;
  std::vector<int32_t> unmasked = targets;
  for (size_t i = 0; i < unmasked.size(); ++i) {
    if (unmasked[i] < 0) unmasked[i] = int32_t(i % 256);
  }
  const Result all = run(inputs, unmasked, 1, [&](int) { return 1.0f / float(Bs * T); });
  EXPECT_NE(all.loss, whole.loss) << "the mask took nothing away";
  const Result again = run(inputs, other, 1, [&](int) { return per_target; });
  EXPECT_EQ(again.loss, whole.loss);
  EXPECT_EQ(again.grads, whole.grads);
  // Every target masked: nothing to learn from, no gradient.
  std::vector<int32_t> none(targets.size(), -1);
  const Result empty = run(inputs, none, 1, [&](int) { return 1.0f; });
  EXPECT_EQ(empty.loss, 0.0);
  EXPECT_TRUE(std::all_of(empty.grads.begin(), empty.grads.end(), [](float g) { return g == 0.0f; }));
  // A target below -1 is not a mask.
  runtime::MemoryAccounting accounting;
  auto engine = OneRank(shape, Bs, T, 5, &accounting);
  std::vector<int32_t> bad = targets;
  bad[3] = -2;
  const MicroBatchKey key{0, 0};
  EXPECT_THROW(engine->Forward(inputs.data(), bad.data(), Bs, T, &key, per_target), std::out_of_range);
}

// The strict backend only changes when work runs, never what it computes: two jitter
// seeds and the plain backend give the same bits, with checkpointing (recompute in
// backward) and with offload at horizon 1 (the copy stream as busy as it gets), with
// dropout on.
TEST(ShardedEngine, TheStrictBackendGivesTheSameBitsWhateverItsJitter) {
  ActivationPolicy checkpointing{true, false, 2}, offload{true, true, 1};
  for (const ActivationPolicy& policy : {checkpointing, offload}) {
    const std::string mode = policy.offload ? "offload, horizon 1" : "checkpointing";
    EngineOptions options;
    options.activations = policy;
    options.dropout = 0.1f;
    options.dropout_seed = 3;
    const TrainingRun first = Train<Fp32>(kSmall, B, 5, options, Backend(StrictOptions(1)));
    for (double loss : first.losses) EXPECT_TRUE(std::isfinite(loss)) << mode << ": poisoned memory was read";
    const TrainingRun second = Train<Fp32>(kSmall, B, 5, options, Backend(StrictOptions(2)));
    EXPECT_EQ(second.losses, first.losses) << mode;
    EXPECT_EQ(second.norms, first.norms) << mode;
    EXPECT_EQ(second.weights, first.weights) << mode;
    const TrainingRun plain = Train<Fp32>(kSmall, B, 5, options, Backend(runtime::CpuBackendOptions{}));
    EXPECT_EQ(plain.losses, first.losses) << mode;
    EXPECT_EQ(plain.weights, first.weights) << mode;
  }
}

double RelativeError(double got, double want) { return std::abs(got - want) / std::abs(want); }

// Mixed precision on the CPU: the bf16 emulation (bf16 parameters and activations; fp32
// masters, gradients, AdamW state, statistics and loss) and fp32 against the fp64 engine,
// over 10 steps of the same model and data.
//
// Tolerances: bf16 keeps 8 significant bits, so each stored value is off by up to 2^-9
// (2e-3) relative. A loss is a mean over the batch of log-softmaxes after two blocks of
// such roundings; the errors are independent and partly cancel, so the first step's loss
// (the same weights, one forward) stays within 1e-3 (measured: 3e-5). Later losses also
// carry the difference of the updates so far, made from gradients with bf16's errors;
// masters and AdamW state stay in fp32, so that difference grows slowly at a moderate
// learning rate (3e-3: measured 1e-3 at worst over 10 steps; at 1e-2 the trajectories of
// this tiny model part by 4% after 9 steps, which is the training's sensitivity, not the
// kernels'). 2e-2 bounds it with room; a broken bf16 kernel (a wrong index, a missed
// rounding in a sum) is off by far more from the first step. fp32's 24 bits give errors
// near 1e-7 per value, so 1e-4 is the same margin. The losses must also fall: the
// emulation still learns.
TEST(ShardedEngine, Bf16EmulationAndFp32StayCloseToTheFp64Engine) {
  const api::ModelShape shape{.layers = 2, .heads = 2, .hidden = 64, .vocab_size = 64, .seq_len = T};
  const EngineOptions options;
  const float learning_rate = 3e-3f;
  const TrainingRun reference = Train<Fp64>(shape, 4, 10, options, Backend(), learning_rate);
  const TrainingRun bf16 = Train<Bf16>(shape, 4, 10, options, Backend(), learning_rate);
  const TrainingRun fp32 = Train<Fp32>(shape, 4, 10, options, Backend(), learning_rate);
  ASSERT_EQ(reference.losses.size(), 10u);
  EXPECT_LE(RelativeError(bf16.losses[0], reference.losses[0]), 1e-3) << "one forward from the same weights";
  double worst_bf16 = 0, worst_fp32 = 0;
  for (size_t s = 0; s < reference.losses.size(); ++s) {
    worst_bf16 = std::max(worst_bf16, RelativeError(bf16.losses[s], reference.losses[s]));
    worst_fp32 = std::max(worst_fp32, RelativeError(fp32.losses[s], reference.losses[s]));
    EXPECT_LE(RelativeError(bf16.losses[s], reference.losses[s]), 2e-2) << "step " << s + 1;
    EXPECT_LE(RelativeError(fp32.losses[s], reference.losses[s]), 1e-4) << "step " << s + 1;
    EXPECT_LE(RelativeError(fp32.norms[s], reference.norms[s]), 1e-4) << "step " << s + 1;
  }
  EXPECT_GT(worst_bf16, 0) << "the bf16 engine computed in fp64";
  EXPECT_LT(bf16.losses.back(), 0.8 * bf16.losses.front()) << "the bf16 engine did not learn";
  EXPECT_LT(reference.losses.back(), 0.8 * reference.losses.front());
  RecordProperty("worst_bf16_relative_loss_error", std::to_string(worst_bf16));
  RecordProperty("worst_fp32_relative_loss_error", std::to_string(worst_fp32));
}

// Whether element i of the single-rank model is a key bias (the middle third of a
// block's qkv.b). Its exact gradient is zero: q.(k_j + b) adds q.b to every score of a
// row, and the softmax does not change. AdamW normalises whatever rounding leaves there
// into steps of about the learning rate, so two runs that round differently move these
// elements apart by up to that much each step, whatever else they agree on.
bool IsKeyBias(const model::ParameterLayout& whole, int64_t i) {
  for (int l = 0; l < int(whole.shape().layers); ++l) {
    const int64_t k = whole.Offset(model::Param::kQkvB, l) + whole.shape().hidden;
    if (i >= k && i < k + whole.shape().hidden) return true;
  }
  return false;
}

// GPT-2's vocabulary of 50257 padded to 128 rows per TP slice (50304) trains as the
// unpadded engine does: the padded logits never take part in the softmax and the padded
// rows never train. Weights() and checkpoints see the user's shape only.
//
// The two differ only in rounding: the LM head's products sum over 50304 or 50257
// columns, blocked differently, and AdamW, which moves every element by about the
// learning rate whatever its gradient's size, carries such differences into the weights.
// Over 20 steps of one batch to memorise at a learning rate of 3e-3, the losses agree
// within 1e-5 relative (measured: 2e-8) and the weights within 1e-5 (measured: 4e-6),
// except the key biases, whose AdamW steps are rounding noise (IsKeyBias): those are held
// only to the bound of two full steps apart per step.
TEST(ShardedEngine, APaddedVocabularyTrainsAsTheUnpaddedOneAndItsPaddingStaysZero) {
  const api::ModelShape shape{.layers = 2, .heads = 2, .hidden = 32, .vocab_size = 50257, .seq_len = T};
  const int64_t V = shape.vocab_size, C = shape.hidden, Vp = api::PaddedVocabRows(V, 128);
  ASSERT_EQ(Vp, 50304);
  constexpr float kLearningRate = 3e-3f;
  constexpr int kSteps = 20;
  const model::ParameterLayout whole(shape);
  // How far apart two runs may be at element i.
  auto tolerance = [&](size_t i) { return IsKeyBias(whole, int64_t(i)) ? 2.0 * kLearningRate * kSteps : 1e-5; };
  struct Padded {
    std::vector<double> losses;
    std::vector<float> weights;
    ShardState snapshot;
    std::vector<float> padding;  // wte's padding rows of the master
  };
  auto train = [&](int vocab_multiple) {
    runtime::MemoryAccounting accounting;
    EngineOptions options;
    options.vocab_multiple = vocab_multiple;
    auto engine = OneRank(shape, B, T, 21, &accounting, options);
    EXPECT_EQ(engine->vocab_multiple(), vocab_multiple);
    // One batch, to memorise: the loss falls, so the steps are not noise.
    std::vector<int32_t> inputs(B * T), targets(B * T);
    for (int i = 0; i < B * T; ++i) {
      inputs[size_t(i)] = int32_t((int64_t(i) * 7919) % V);
      targets[size_t(i)] = int32_t((inputs[size_t(i)] * 31 + 17) % V);
    }
    OptimizerStep step;
    step.learning_rate = kLearningRate;
    step.weight_decay = 0.1f;  // would pull padding away from zero if a segment covered it
    step.max_norm = 1.0f;
    Padded run;
    for (int s = 0; s < kSteps; ++s) {
      engine->ZeroGrad();
      const MicroBatchKey key{s, 0};
      engine->Forward(inputs.data(), targets.data(), B, T, &key, kMean);
      engine->Backward(true);
      step.t = s + 1;
      engine->Update(step);
      run.losses.push_back(engine->TakeLoss());
    }
    run.weights = engine->Weights();
    engine->Snapshot(&run.snapshot);
    // The root unit starts with wte (S = 1: its shard is the whole unit); its rows
    // [V, Vp) are the padding, read where they live.
    const FlatUnit<Fp32>& root = *engine->units()[0];
    const int64_t rows = (root.numel() - (shape.seq_len + 2) * C) / C;
    EXPECT_EQ(rows, vocab_multiple == 1 ? V : Vp);
    if (rows != (vocab_multiple == 1 ? V : Vp)) return run;
    const float* master = runtime::DeviceSide::Address(root.master());
    run.padding.assign(master + V * C, master + rows * C);
    return run;
  };
  const Padded unpadded = train(1);
  const Padded padded = train(128);
  ASSERT_EQ(padded.losses.size(), size_t(kSteps));
  for (size_t s = 0; s < padded.losses.size(); ++s) {
    EXPECT_LE(RelativeError(padded.losses[s], unpadded.losses[s]), 1e-5) << "step " << s + 1;
  }
  EXPECT_LT(padded.losses.back(), 0.8 * padded.losses.front()) << "nothing was learnt";
  ASSERT_EQ(padded.weights.size(), size_t(shape.ParameterCount()));
  ASSERT_EQ(unpadded.weights.size(), size_t(shape.ParameterCount()));
  for (size_t i = 0; i < padded.weights.size(); ++i) {
    ASSERT_NEAR(padded.weights[i], unpadded.weights[i], tolerance(i)) << "element " << i;
  }
  // A checkpoint holds the model's elements only, in the same places.
  ASSERT_EQ(padded.snapshot.size, shape.ParameterCount());
  ASSERT_EQ(unpadded.snapshot.size, shape.ParameterCount());
  for (int64_t i = 0; i < padded.snapshot.size; ++i) {
    ASSERT_NEAR(padded.snapshot.master[i], unpadded.snapshot.master[i], tolerance(size_t(i))) << "element " << i;
  }
  EXPECT_TRUE(unpadded.padding.empty());
  ASSERT_EQ(padded.padding.size(), size_t((Vp - V) * C));
  for (size_t i = 0; i < padded.padding.size(); ++i) {
    ASSERT_EQ(padded.padding[i], 0.0f) << "padding element " << i << " trained";
  }
}

}  // namespace
}  // namespace meshtrain::parallel
