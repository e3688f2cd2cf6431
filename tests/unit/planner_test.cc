// The layout planner: its step model's schedule, the search, and what it refuses.

#include "operator/scheduler/planner.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>

#include <gtest/gtest.h>

#include "api/layout.h"
#include "api/manifest.h"

namespace meshtrain::scheduler {
namespace {

const api::ModelShape kShape{.layers = 4, .heads = 4, .hidden = 128, .vocab_size = 256, .seq_len = 64};

// 2 nodes of 2 ranks, one flat network; `network` bytes/s per rank between nodes.
Cluster TwoNodes(double network) {
  Cluster c;
  c.nodes = 2;
  c.gpus_per_node = 2;
  c.node_paths = {{"n0"}, {"n1"}};
  c.links = LinkModel({"kubernetes.io/hostname"});
  c.links.Override("nvlink", 2e9, 50e-6);
  c.links.Override("cluster", network, 100e-6);
  return c;
}

DeviceModel Cpu(int64_t mib) { return CpuDevice(mib << 20, 5e9); }

PlanRequest Request(double network, int64_t mib) {
  PlanRequest r;
  r.shape = kShape;
  r.seq = 64;
  r.global_batch_tokens = 16 * 64 * 4;
  r.cluster = TwoNodes(network);
  r.device = Cpu(mib);
  r.max_horizon = 2;
  return r;
}

TEST(StepModel, WithoutCommunicationAStepIsItsComputeAndUpdate) {
  Cluster one;
  one.node_paths = {{"n0"}};
  const DeviceModel device = Cpu(1024);
  const LayoutChoice choice{1, 1, 4, {}};
  const StepPrediction p = PredictStep(kShape, 64, 4 * 64 * 4, choice, one, device);
  EXPECT_EQ(p.micro_steps, 4);
  EXPECT_EQ(p.tp_seconds, 0);
  EXPECT_EQ(p.comm_seconds, 0);
  EXPECT_NEAR(p.seconds, p.compute_seconds + p.update_seconds, 1e-12);
  // 6N + 12LTC per token over the rate, less the embedding lookup's share of N.
  const double flops = 4 * 64 * 4 * (kShape.TrainingFlopsPerToken(64) - 6.0 * double(64 * 128 + 2 * 128 + 4 * 13 * 128));
  EXPECT_NEAR(p.compute_seconds, flops / 5e9, 1e-9 * p.compute_seconds);
  EXPECT_NEAR(p.tokens_per_second, 4 * 64 * 4 / p.seconds, 1e-6);
}

// Float8: on Hopper the blocks' linear layers run at twice the matrix rate, so a step
// saves half their FLOP time and nothing else; where the device has no float8 products
// (an A100, the CPU's emulation) the step is unchanged.
TEST(StepModel, Float8HalvesTheLinearLayersTimeOnHopperOnly) {
  Cluster one;
  one.node_paths = {{"n0"}};
  api::TrainingJobSpec spec;
  std::string why;
  const LayoutChoice choice{1, 1, 4, {}};
  const auto step = [&](const char* instance, const std::string& precision) {
    spec.training.precision = precision;
    const auto device = DeviceForNodes({{{"node.kubernetes.io/instance-type", instance}}}, spec, &why);
    EXPECT_TRUE(device) << why;
    return PredictStep(kShape, 64, 4 * 64 * 4, choice, one, *device);
  };
  const StepPrediction bf16 = step("p5.48xlarge", "bf16"), fp8 = step("p5.48xlarge", "fp8");
  // The linear layers' FLOPs of a step: 2 x their weights a token forward, three times
  // that with the backward, over every token and block.
  const double linear = 3 * 4 * 64 * 4 * double(kShape.layers) * api::BlockFloat8FlopsPerToken(kShape, 1);
  EXPECT_EQ(api::BlockFloat8FlopsPerToken(kShape, 1), 2.0 * 12 * 128 * 128);  // GPT-2: qkv, proj, fc, fcproj
  EXPECT_NEAR(bf16.compute_seconds - fp8.compute_seconds, linear / (0.40 * 989e12) / 2, 1e-6 * bf16.compute_seconds);
  EXPECT_EQ(step("p4d.24xlarge", "fp8").compute_seconds, step("p4d.24xlarge", "bf16").compute_seconds);
  // A mixture's experts and routers stay in the compute precision.
  api::ModelShape moe = *api::FindPreset("moe-tiny");
  const double dense_part = api::BlockFloat8FlopsPerToken(moe, 1);
  moe.experts *= 2;
  EXPECT_EQ(api::BlockFloat8FlopsPerToken(moe, 1), dense_part);
}

// Float8's memory: its amaxes and scales in the step buffer everywhere, and on a GPU the
// kernel table's scratch for its largest product. Llama 3.2 1B at 4 x 2048 rows on TP 2:
// the gate-and-up layer's input gradient (m 2048, n 8192, k 8192) and weight gradient
// (2048, 8192 over 8192) each cast 16 + 64 MiB of codes; rowwise each keeps 64 MiB of fp32
// sums besides (8192 rows of 2048 floats), 144 MiB and 512 bytes of descales and
// alignment; tensorwise neither keeps sums (no bias, no residual on TP 2): 80 MiB and 512.
TEST(MemoryModel, Float8CountsItsScalesAndOnAGpuItsLargestProduct) {
  const api::ModelShape shape = *api::FindPreset("llama3.2-1b");
  int64_t most = 0;
  for (const api::Float8Product& p : api::Float8LinearProducts(4, 2048, shape, 2, {.rowwise = true}))
    most = std::max(most, api::Float8ProductBytes(p, p.sums));
  EXPECT_EQ(most, (int64_t{144} << 20) + 512);
  EXPECT_EQ(api::Float8KernelScratchBytes(4, 2048, shape, 2, {.rowwise = true}), most);
  EXPECT_EQ(api::Float8KernelScratchBytes(4, 2048, shape, 2, {.rowwise = false}), (int64_t{80} << 20) + 512);
  EXPECT_EQ(api::Float8LinearProducts(4, 2048, shape, 2).size(), 12u);  // 4 layers x 3 products
  // A mixture casts its attention's two layers only.
  EXPECT_EQ(api::Float8LinearProducts(1, 64, *api::FindPreset("moe-tiny"), 1).size(), 6u);

  const LayoutChoice choice{2, 1, 4, {}};
  const MemoryPrediction bf16 = PredictMemory(shape, 2048, choice, 2, false, false, 1);
  const MemoryPrediction fp8 = PredictMemory(shape, 2048, choice, 2, false, false, 1, Float8Memory::kTensorwise);
  const MemoryPrediction rowwise = PredictMemory(shape, 2048, choice, 2, false, false, 1, Float8Memory::kRowwise);
  EXPECT_EQ(fp8.params, bf16.params);
  EXPECT_EQ(fp8.optimizer, bf16.optimizer);
  // The scratch (80 MiB and 512 bytes: 82 MiB held in 2 MiB blocks) and the step buffer's
  // few scales.
  EXPECT_GE(fp8.activations - bf16.activations, int64_t{82} << 20);
  EXPECT_LE(fp8.activations - bf16.activations, int64_t{84} << 20);
  EXPECT_GT(rowwise.activations, fp8.activations);  // a scale per row
  // The CPU's emulation keeps no scratch of its own: the scales alone.
  const MemoryPrediction cpu = PredictMemory(shape, 2048, choice, 4, true, false, 1);
  const MemoryPrediction cpu8 = PredictMemory(shape, 2048, choice, 4, true, false, 1, Float8Memory::kTensorwise);
  EXPECT_LE(cpu8.activations - cpu.activations, int64_t{2} << 20);
}

TEST(StepModel, CheckpointingAddsOneBlockForwardPerBlockAndMicroStep) {
  Cluster one;
  one.node_paths = {{"n0"}};
  const DeviceModel device = Cpu(1024);
  const StepPrediction keep = PredictStep(kShape, 64, 4 * 64, {1, 1, 4, {}}, one, device);
  const StepPrediction recompute = PredictStep(kShape, 64, 4 * 64, {1, 1, 4, {true, false, 2}}, one, device);
  const double block_forward = 4.0 * 64 * (24.0 * 128 * 128 + 4.0 * 64 * 128) / 5e9;
  EXPECT_NEAR(recompute.seconds - keep.seconds, 4 * block_forward, 1e-12);
}

TEST(StepModel, GathersHideBehindComputeOnAFastLinkAndNotOnASlowOne) {
  const DeviceModel device = Cpu(1024);
  const LayoutChoice full{1, 4, 4, {}};
  const StepPrediction fast = PredictStep(kShape, 64, 16 * 64 * 4, full, TwoNodes(10e9), device);
  const StepPrediction slow = PredictStep(kShape, 64, 16 * 64 * 4, full, TwoNodes(1e6), device);
  EXPECT_LT(fast.exposed_seconds, 0.05 * fast.seconds);
  EXPECT_GT(slow.exposed_seconds, 0.5 * slow.seconds);
  EXPECT_GT(slow.comm_seconds, 10 * fast.comm_seconds);
}

TEST(StepModel, OffloadStallsOnlyWhenCopiesOutrunTheHorizon) {
  DeviceModel device = Cpu(1024);
  Cluster one;
  one.node_paths = {{"n0"}};
  const api::ModelShape deep{.layers = 12, .heads = 4, .hidden = 128, .vocab_size = 256, .seq_len = 64};
  auto step = [&](int horizon) { return PredictStep(deep, 64, 4 * 64, {1, 1, 4, {true, true, horizon}}, one, device).seconds; };
  const double checkpointing = PredictStep(deep, 64, 4 * 64, {1, 1, 4, {true, false, 2}}, one, device).seconds;
  EXPECT_NEAR(step(2), checkpointing, 1e-9 * checkpointing);  // fast copies: hidden
  device.copy_bytes_per_second = 1e5;                         // copies far slower than a block
  EXPECT_GT(PredictStep(deep, 64, 4 * 64, {1, 1, 4, {true, true, 1}}, one, device).seconds, 2 * checkpointing);
}

// One node whose links cost nothing: only compute, the bubble and the update remain.
Cluster FreeLinks(int ranks) {
  Cluster c;
  c.gpus_per_node = ranks;
  c.node_paths = {{"n0"}};
  c.links.Override("nvlink", 1e30, 0);
  return c;
}

LayoutChoice Staged(LayoutChoice c, int stages, int virtual_stages = 1) {
  c.pipeline = {stages, virtual_stages,
                virtual_stages > 1 ? api::PipelineSchedule::kInterleaved : api::PipelineSchedule::kOneFOneB};
  return c;
}

// A step of M micro-batches through P stages is M + P - 1 micro-batches of the slowest
// stage (the bubble, (P - 1) / (M + P - 1) of it), and V chunks a stage shorten the fill.
TEST(StepModel, APipelineStepIsTheSlowestStagesMicroBatchesAndTheBubble) {
  const DeviceModel device = Cpu(1024);
  const api::ModelShape deep{.layers = 8, .heads = 4, .hidden = 128, .vocab_size = 256, .seq_len = 64};
  const int M = 4;
  const StepPrediction one = PredictStep(deep, 64, M * 2 * 64, {1, 1, 2, {}}, FreeLinks(1), device);
  const StepPrediction two = PredictStep(deep, 64, M * 2 * 64, Staged({1, 1, 2, {}}, 2), FreeLinks(2), device);
  EXPECT_EQ(two.micro_steps, M);
  EXPECT_EQ(two.bubble, api::BubbleFraction({2, 1}, M));
  EXPECT_NEAR(two.bubble, 1.0 / (M + 1), 1e-12);
  EXPECT_LT(two.p2p_seconds, 1e-12 * two.seconds);
  // The step less the update: M + 1 micro-batches of the slowest stage, whose compute is
  // its M micro-batches'.
  EXPECT_NEAR(two.seconds - two.update_seconds, two.compute_seconds * (M + 1) / M, 1e-9 * two.seconds);
  EXPECT_NEAR(two.bubble_seconds, two.compute_seconds / M, 1e-9 * two.seconds);
  // Each stage holds about half the model, the head weighing on the last.
  EXPECT_LT(two.compute_seconds, 0.75 * one.compute_seconds);
  EXPECT_GT(two.compute_seconds, 0.5 * one.compute_seconds);
  // Interleaved over 2 chunks a stage: the fill is half a micro-batch's time.
  const StepPrediction interleaved = PredictStep(deep, 64, M * 2 * 64, Staged({1, 1, 2, {}}, 2, 2), FreeLinks(2), device);
  EXPECT_NEAR(interleaved.bubble, 1.0 / (2 * M + 1), 1e-12);
  EXPECT_LT(interleaved.seconds, two.seconds);
  // A stage's rank sends one message a micro-batch (stage 0 its activations, stage 1 its
  // gradients) of micro-batch x seq x hidden fp32 values; interleaved, its chunks send more.
  EXPECT_EQ(two.p2p_bytes, M * 2 * 64 * 128 * 4);
  EXPECT_EQ(interleaved.p2p_bytes, 3 * M * 2 * 64 * 128 * 4);
}

// What crosses the link between stages is the activations: slow links make the fill and
// drain wait on them, and a stage whose messages outlast its compute paces the pipeline.
TEST(StepModel, PointToPointTimeIsTheFillAndWhatOutlastsCompute) {
  const DeviceModel device = Cpu(1024);
  const LayoutChoice staged = Staged({2, 1, 4, {}}, 2);  // a stage on each node
  const double message = 4.0 * 64 * 128 * 4;
  const StepPrediction fast = PredictStep(kShape, 64, 16 * 64 * 4, staged, TwoNodes(10e9), device);
  EXPECT_LT(fast.p2p_seconds, 0.01 * fast.seconds);
  const StepPrediction slow = PredictStep(kShape, 64, 16 * 64 * 4, staged, TwoNodes(1e6), device);
  // The fill's activations and the drain's gradients, then the tied head's embedding
  // gradients (the first stage's and the last's copies summed): at least two messages.
  EXPECT_GE(slow.p2p_seconds, 2 * message / 1e6);
  const StepPrediction crawl = PredictStep(kShape, 64, 16 * 64 * 4, staged, TwoNodes(1e4), device);
  EXPECT_GT(crawl.p2p_seconds, double(crawl.micro_steps) * message / 1e4);
  EXPECT_GT(crawl.p2p_seconds, 0.9 * (crawl.seconds - crawl.compute_seconds));
}

// (a) A rank holds its stage's part: the peak is the worst stage's, and a layout whose
// worst stage does not fit is refused even where the other would.
TEST(Planner, AStageHoldsItsPartAndTheWorstStageMustFit) {
  const api::ModelShape deep{.layers = 8, .heads = 4, .hidden = 128, .vocab_size = 256, .seq_len = 64};
  const LayoutChoice one{1, 1, 4, {}}, two = Staged(one, 2);
  const MemoryPrediction whole = PredictMemory(deep, 64, one, 4, true, false, 4);
  const MemoryPrediction staged = PredictMemory(deep, 64, two, 4, true, false, 4);
  EXPECT_LT(staged.params, 0.7 * double(whole.params));
  int64_t worst = 0;
  int worst_stage = -1;
  for (int p = 0; p < 2; ++p) {
    const api::EngineMemory e =
        api::EngineMemoryOf(deep, 4, 64, 0, 1, 1, {}, EngineTypesOf(4, true, deep, 4, 64, 1), false, false,
                            api::StageShapeOf(deep, two.pipeline, p, 4, 64));
    if (e.total() > worst) worst = e.total(), worst_stage = p;
  }
  EXPECT_EQ(staged.total(), worst);
  EXPECT_EQ(staged.stage, worst_stage);

  // Two ranks with memory for a stage's part and not for the whole model: the layout of
  // one stage is refused, the one of two fits, and a memory too small for the worst stage
  // refuses it, naming that stage. The plan's candidates are judged by the same model.
  PlanRequest r = Request(1e9, 1024);
  r.shape = deep;
  r.global_batch_tokens = 8 * 64;
  r.cluster = FreeLinks(2);
  r.device = CpuDevice(int64_t(double(staged.total()) / 0.9) + (1 << 20), 5e9);
  const Candidate unstaged = Evaluate(r, {1, 1, 4, {}});
  EXPECT_NE(unstaged.reason.find("needs "), std::string::npos) << MemorySize(unstaged.needed);
  EXPECT_EQ(Evaluate(r, two).reason, "");
  r.device = CpuDevice(staged.total() / 2, 5e9);
  const std::string refused = Evaluate(r, two).reason;
  EXPECT_NE(refused.find("with P=2 1F1B, T=1, S=1, micro-batch 4, keep all (stage " + std::to_string(staged.stage) +
                         " holds the most)"),
            std::string::npos)
      << refused;
  r.device = CpuDevice(int64_t(double(staged.total()) / 0.9) + (1 << 20), 5e9);
  const Plan plan = PlanLayouts(r);
  ASSERT_NE(plan.best(), nullptr);
  for (const Candidate& c : plan.feasible) {
    EXPECT_LE(c.needed, r.device.Usable()) << Describe(c.choice);
    EXPECT_EQ(c.needed, PredictMemory(deep, 64, c.choice, 4, true, false, int(c.step.micro_steps)).total());
  }
}

// The netns testbed's case (2 nodes x 2 ranks, 50 Mbit/s between them): a model of 30M
// parameters at a small micro-batch. Without stages, every layout moves the model's
// gradients (or its weights) across the slow link each step; with a stage on each node,
// gathers and reduce-scatters stay inside the node, and only a micro-batch's activations
// (256 KiB) cross it.
api::ModelShape Gpt2Of30M() {
  return {.layers = 8, .heads = 8, .hidden = 512, .vocab_size = 8192, .seq_len = 128};
}
PlanRequest SlowLinkRequest(double network) {
  PlanRequest r;
  r.shape = Gpt2Of30M();
  r.seq = 128;
  r.global_batch_tokens = 16 * 128;  // 16 sequences a step
  r.cluster = TwoNodes(network);
  r.device = CpuDevice(int64_t(2) << 30, kCpuMatrixFlops);
  r.max_horizon = 2;
  return r;
}

TEST(Planner, ChoosesAStageOnEachNodeOverASlowLink) {
  const PlanRequest r = SlowLinkRequest(50e6 / 8);
  const Plan plan = PlanLayouts(r);
  ASSERT_NE(plan.best(), nullptr);
  const Candidate& best = *plan.best();
  EXPECT_EQ(best.choice.pipeline.stages, 2) << Describe(best.choice);
  EXPECT_LE(best.choice.shard * best.choice.tp, 2) << Describe(best.choice);  // groups inside a node
  // The best layout without stages is far slower.
  const Candidate* flat = nullptr;
  for (const Candidate& c : plan.feasible) {
    if (c.choice.pipeline.stages == 1) {
      flat = &c;
      break;
    }
  }
  ASSERT_NE(flat, nullptr);
  EXPECT_GT(flat->step.seconds, 1.5 * best.step.seconds) << Describe(flat->choice) << " against " << Describe(best.choice);
  EXPECT_GT(best.step.p2p_bytes, 0);
  EXPECT_GT(best.step.bubble, 0);
}

TEST(Planner, KeepsOneStageWhereLinksAreFastOrTheModelTiny) {
  const Plan fast = PlanLayouts(SlowLinkRequest(10e9));
  ASSERT_NE(fast.best(), nullptr);
  EXPECT_EQ(fast.best()->choice.pipeline.stages, 1) << Describe(fast.best()->choice);
  // The tiny model on one node: no link worth avoiding, and the bubble to pay.
  PlanRequest tiny = Request(1e9, 1024);
  tiny.cluster = FreeLinks(4);
  const Plan one_node = PlanLayouts(tiny);
  ASSERT_NE(one_node.best(), nullptr);
  EXPECT_EQ(one_node.best()->choice.pipeline.stages, 1) << Describe(one_node.best()->choice);
  bool saw_stages = false;
  for (const Candidate& c : one_node.feasible) saw_stages |= c.choice.pipeline.stages > 1;
  EXPECT_TRUE(saw_stages);  // tried, and slower
}

TEST(Planner, OnASlowNetworkKeepsShardGroupsInsideANode) {
  const Plan plan = PlanLayouts(Request(1e6, 1024));
  ASSERT_NE(plan.best(), nullptr);
  const LayoutChoice& best = plan.best()->choice;
  EXPECT_LE(best.shard * best.tp, 2) << Describe(best);
  const Candidate full = Evaluate(Request(1e6, 1024), {1, 4, 8, {}});
  EXPECT_GT(full.step.seconds, 1.3 * plan.best()->step.seconds);
  for (size_t i = 1; i < plan.feasible.size(); ++i) {
    EXPECT_LE(plan.feasible[i - 1].step.seconds, plan.feasible[i].step.seconds);
  }
}

TEST(Planner, EveryCandidateFitsAndTheRejectedSayWhy) {
  const PlanRequest request = Request(1e9, 14);
  const Plan plan = PlanLayouts(request);
  ASSERT_FALSE(plan.feasible.empty());
  for (const Candidate& c : plan.feasible) {
    EXPECT_LE(c.needed, request.device.Usable()) << Describe(c.choice);
    // The request's CPU: fp32 compute copies, the CPU's kernels, no dropout; its memory is
    // host memory, so the offload pool counts too.
    EXPECT_EQ(c.needed, PredictMemory(kShape, 64, c.choice, 4, /*cpu_kernels=*/true, /*dropout=*/false,
                                      int(c.step.micro_steps)).total());
  }
  ASSERT_FALSE(plan.rejected.empty());
  for (const Candidate& c : plan.rejected) {
    EXPECT_GT(c.needed, request.device.Usable());
    EXPECT_NE(c.reason.find("needs "), std::string::npos) << c.reason;
    EXPECT_NE(c.reason.find("T=" + std::to_string(c.choice.tp) + ", S=" + std::to_string(c.choice.shard)),
              std::string::npos)
        << c.reason;
    EXPECT_NE(c.reason.find("usable with a 10% margin"), std::string::npos) << c.reason;
  }
}

TEST(Planner, NothingFitsInATinyMemory) {
  const Plan plan = PlanLayouts(Request(1e9, 1));
  EXPECT_EQ(plan.best(), nullptr);
  EXPECT_FALSE(plan.rejected.empty());
}

// The Llama class: T splits the key/value heads, so 4 query heads over 2 key/value heads
// take T = 1 and 2 on nodes of 4, never 4.
TEST(Planner, SearchesOnlyTensorParallelDegreesThatDivideTheKeyValueHeads) {
  PlanRequest r = Request(1e9, 1024);
  r.shape = *api::FindPreset("llama-tiny");
  r.shape.seq_len = 64;
  r.cluster.nodes = 1;
  r.cluster.gpus_per_node = 4;
  r.cluster.node_paths = {{"n0"}};
  const Plan plan = PlanLayouts(r);
  ASSERT_FALSE(plan.feasible.empty());
  bool saw_tp2 = false;
  for (const std::vector<Candidate>* list : {&plan.feasible, &plan.rejected}) {
    for (const Candidate& c : *list) {
      EXPECT_LE(c.choice.tp, 2) << Describe(c.choice);
      saw_tp2 |= c.choice.tp == 2;
    }
  }
  EXPECT_TRUE(saw_tp2);
}

TEST(Planner, SearchesOnlyTensorParallelDegreesThatDivideTheModelAndTheNode) {
  PlanRequest r = Request(1e9, 1024);
  r.shape.heads = 2;  // T = 4 would split 2 heads
  r.cluster.nodes = 1;
  r.cluster.gpus_per_node = 4;
  r.cluster.node_paths = {{"n0"}};
  const Plan plan = PlanLayouts(r);
  ASSERT_FALSE(plan.feasible.empty());
  bool saw_tp2 = false;
  for (const Candidate& c : plan.feasible) {
    EXPECT_LE(c.choice.tp, 2);
    saw_tp2 |= c.choice.tp == 2;
    EXPECT_EQ(r.global_batch_tokens % (int64_t(c.choice.micro_batch) * r.seq * (4 / (c.choice.tp * c.choice.context))),
              0);
  }
  EXPECT_TRUE(saw_tp2);
}

TEST(Planner, ResolvesTheWrittenSpecWithTheChoice) {
  const nlohmann::json written = {{"nodes", 2}, {"parallelism", {{"mode", "auto"}}}, {"training", {{"steps", 5}}}};
  const nlohmann::json resolved = ResolveWrittenSpec(written, {2, 1, 4, {true, true, 3}});
  EXPECT_EQ(resolved["parallelism"]["mode"], "manual");
  EXPECT_EQ(resolved["parallelism"]["tensorParallelDegree"], 2);
  EXPECT_EQ(resolved["parallelism"]["hybridShardDegree"], 1);
  EXPECT_EQ(resolved["parallelism"]["activationOffloading"], true);
  EXPECT_EQ(resolved["parallelism"]["activationLoadingHorizon"], 3);
  EXPECT_EQ(resolved["training"]["microBatchSize"], 4);
  EXPECT_EQ(resolved["training"]["steps"], 5);
  EXPECT_EQ(resolved["nodes"], 2);
  EXPECT_EQ(resolved["parallelism"]["pipelineParallelDegree"], 1);
  EXPECT_FALSE(resolved["parallelism"].contains("pipelineVirtualStages"));
  const nlohmann::json staged = ResolveWrittenSpec(written, Staged({1, 1, 2, {}}, 2, 2));
  EXPECT_EQ(staged["parallelism"]["pipelineParallelDegree"], 2);
  EXPECT_EQ(staged["parallelism"]["pipelineSchedule"], "Interleaved1F1B");
  EXPECT_EQ(staged["parallelism"]["pipelineVirtualStages"], 2);
}

TEST(Planner, KnowsTheDeviceOfEksInstanceTypesAndNeedsAMemoryOtherwise) {
  api::TrainingJobSpec spec;
  std::string why;
  const auto p5 = DeviceForNodes({{{"node.kubernetes.io/instance-type", "p5.48xlarge"}}}, spec, &why);
  ASSERT_TRUE(p5);
  EXPECT_EQ(p5->memory_bytes, 80LL << 30);
  spec.resources.memory_limit_mib = 1024;  // the engine's allocator holds no more
  spec.training.precision = "fp32";
  const auto capped = DeviceForNodes({{{"node.kubernetes.io/instance-type", "p5.48xlarge"}}}, spec, &why);
  ASSERT_TRUE(capped);
  EXPECT_EQ(capped->memory_bytes, 1LL << 30);
  EXPECT_EQ(capped->compute_bytes, 4);
  spec = {};
  EXPECT_FALSE(DeviceForNodes({{{"node.kubernetes.io/instance-type", "m5.large"}}}, spec, &why));
  EXPECT_NE(why.find("spec.resources.memoryLimitMiB"), std::string::npos) << why;
  spec.resources.memory_limit_mib = 512;
  const auto cpu = DeviceForNodes({{}}, spec, &why);
  ASSERT_TRUE(cpu);
  EXPECT_EQ(cpu->memory_bytes, 512LL << 20);
  EXPECT_TRUE(cpu->memory_is_host);
}

// Context parallelism: C ranks split each sequence.

const api::ModelShape& Llama8B() { return *api::FindPreset("llama3.1-8b"); }

LayoutChoice WithContext(LayoutChoice c, int context, std::string mode = "Ring") {
  c.context = context;
  c.context_mode = std::move(mode);
  return c;
}

TEST(ContextMemory, ARankHoldsItsRowsOfActivationsAndAShardOverSxC) {
  const api::ModelShape& shape = Llama8B();
  const int seq = 8192;
  const LayoutChoice one{1, 1, 1, {}};
  const MemoryPrediction whole = PredictMemory(shape, seq, one, 2, false, false, 1);
  const MemoryPrediction split = PredictMemory(shape, seq, WithContext(one, 4), 2, false, false, 1);
  // Every block's activations are a rank's rows: a quarter, less what does not scale.
  EXPECT_LT(double(split.activations), 0.27 * double(whole.activations));
  EXPECT_GT(double(split.activations), 0.2 * double(whole.activations));
  // FSDP shards over S x C = 4 ranks: as S = 4 without context.
  const MemoryPrediction sharded = PredictMemory(shape, seq, LayoutChoice{1, 4, 1, {}}, 2, false, false, 1);
  EXPECT_EQ(split.params, sharded.params);
  EXPECT_EQ(split.optimizer, sharded.optimizer);
  EXPECT_EQ(split.gathered, sharded.gathered);
  EXPECT_LT(split.params, whole.params / 3);
}

TEST(ContextMemory, EngineTypesCarryTheDegreeModeAndTheirScratch) {
  const api::ModelShape& shape = Llama8B();
  const int rows = 2048, C = 4, T = 2;
  const api::EngineTypes ring = EngineTypesOf(2, false, shape, 1, rows, T, C, "Ring");
  EXPECT_EQ(ring.context, C);
  EXPECT_FALSE(ring.context_all_to_all);
  api::EngineTypes kernel = ring;
  kernel.attention_scratch_bytes =
      api::FusedAttentionScratchBytes(1, rows, int(shape.heads / T), int(shape.HeadDim()), 0);
  EXPECT_EQ(ring.attention_scratch_bytes, api::ContextAttentionScratchBytes(1, rows, shape, T, kernel));

  const api::EngineTypes ulysses = EngineTypesOf(2, false, shape, 1, rows, T, C, "AllToAll");
  EXPECT_TRUE(ulysses.context_all_to_all);
  kernel = ulysses;
  // The kernel attends the whole sequence with 1/C of this TP rank's heads.
  kernel.attention_scratch_bytes =
      api::FusedAttentionScratchBytes(1, rows * C, int(shape.heads / T) / C, int(shape.HeadDim()), 0);
  EXPECT_EQ(ulysses.attention_scratch_bytes, api::ContextAttentionScratchBytes(1, rows, shape, T, kernel));
  EXPECT_NE(ulysses.attention_scratch_bytes, ring.attention_scratch_bytes);

  const api::EngineTypes plain = EngineTypesOf(2, false, shape, 1, rows, T);
  EXPECT_EQ(plain.context, 1);
  EXPECT_EQ(plain.attention_scratch_bytes,
            api::FusedAttentionScratchBytes(1, rows, int(shape.heads / T), int(shape.HeadDim()), 0));
}

TEST(ContextTraffic, RingPassesTheSequencesKeysAndValuesAndAllToAllItsTensors) {
  const api::ModelShape& shape = Llama8B();  // q 4096 wide, k and v 1024 each
  const double seq = 131072, T = 2, C = 4;
  const ContextTraffic ring = ContextTrafficOf(shape, 1, int(seq), int(T), int(C), false, 2);
  const double kv = seq * 2 * 1024 / T;  // the whole sequence's K and V on this TP rank
  EXPECT_DOUBLE_EQ(ring.forward_sent, (C - 1) / C * kv * 2);
  // Backward: K and V again, and their fp32 gradients all the way round, home.
  EXPECT_DOUBLE_EQ(ring.backward_sent, (C - 1) / C * kv * 2 + kv * 4);
  ASSERT_EQ(ring.backward.size(), 2u);
  EXPECT_EQ(ring.backward[1].steps, 4);

  const ContextTraffic ulysses = ContextTrafficOf(shape, 1, int(seq), int(T), int(C), true, 2);
  const double rows = seq / C * 2;  // this rank's rows, bf16
  const double q = 4096 / T, w = (4096 + 2 * 1024) / T;
  EXPECT_DOUBLE_EQ(ulysses.forward_sent, (C - 1) / C * rows * (w + q));   // q, k, v in; out back
  EXPECT_DOUBLE_EQ(ulysses.backward_sent, (C - 1) / C * rows * (q + w));  // dout in; dq, dk, dv back
  EXPECT_EQ(ulysses.forward.size(), 2u);

  const ContextTraffic none = ContextTrafficOf(shape, 1, int(seq), int(T), 1, false, 2);
  EXPECT_EQ(none.forward_sent + none.backward_sent, 0);
  EXPECT_TRUE(none.forward.empty());
}

TEST(ContextTraffic, AnExchangeIsItsStepsOverTheGroupsSlowestLink) {
  const api::ParallelLayout mesh(2, 4, 1, 0, 1, 4);  // context groups 0-3 and 4-7, one a node
  LinkModel links({"kubernetes.io/hostname"});
  links.Override("nvlink", 100e9, 2e-6);
  links.Override("cluster", 10e9, 20e-6);
  const std::vector<std::vector<std::string>> paths = {{"n0"}, {"n1"}};
  EXPECT_DOUBLE_EQ(ExchangeSeconds({4e9, 3}, {0, 1, 2, 3}, mesh, paths, links), 3 * (2e-6 + 1e9 / 100e9));
  EXPECT_DOUBLE_EQ(ExchangeSeconds({4e9, 3}, {2, 3, 4, 5}, mesh, paths, links), 3 * (20e-6 + 1e9 / 10e9));
  EXPECT_DOUBLE_EQ(ExchangeSeconds({4e9, 4}, {0, 1, 2, 3}, mesh, paths, links), 4 * (2e-6 + 1e9 / 100e9));
}

TEST(ContextStep, ARankComputesItsRowsAndWaitsForItsExchanges) {
  const api::ModelShape& shape = Llama8B();
  const int seq = 8192;
  DeviceModel device = *FindInstanceDevice("p5.48xlarge");
  Cluster node;
  node.gpus_per_node = 8;
  node.node_paths = {{"n0"}};
  const int64_t batch = 8 * int64_t(seq);  // a sequence per rank without context
  const StepPrediction one = PredictStep(shape, seq, batch, {1, 8, 1, {}}, node, device);
  const StepPrediction ring = PredictStep(shape, seq, batch, WithContext({1, 2, 1, {}}, 4), node, device);
  // Two sequences a step for 2 data-parallel ranks: four micro-steps of a quarter each.
  EXPECT_EQ(one.micro_steps, 1);
  EXPECT_EQ(ring.micro_steps, 4);
  EXPECT_NEAR(ring.compute_seconds / ring.micro_steps, one.compute_seconds / 4, 1e-9 * one.compute_seconds);
  EXPECT_EQ(one.context_seconds, 0);
  // Each block's ring pass forward and its two backward, every micro-step, over NVLink.
  const api::ParallelLayout mesh(1, 8, 1, 2, 1, 4);
  const ContextTraffic t = ContextTrafficOf(shape, 1, seq, 1, 4, false, 2);
  ASSERT_EQ(t.forward.size() + t.backward.size(), 3u);
  double exchanges = 0;
  for (const std::vector<Exchange>* pass : {&t.forward, &t.backward}) {
    for (const Exchange& e : *pass) exchanges += ExchangeSeconds(e, {0, 1, 2, 3}, mesh, node.node_paths, node.links);
  }
  EXPECT_NEAR(ring.context_seconds, 4 * double(shape.layers) * exchanges, 1e-9 * ring.context_seconds);
  EXPECT_GT(ring.seconds, one.seconds);  // the same work, and the exchanges besides
}

// Llama 3.1 8B on 4 p5 nodes, a global batch of 32 sequences.
PlanRequest LlamaOnP5(int seq) {
  PlanRequest r;
  r.shape = Llama8B();
  r.shape.seq_len = seq;
  r.seq = seq;
  r.global_batch_tokens = 32 * int64_t(seq);
  r.cluster.nodes = 4;
  r.cluster.gpus_per_node = 8;
  r.cluster.node_paths = {{"n0"}, {"n1"}, {"n2"}, {"n3"}};
  r.device = *FindInstanceDevice("p5.48xlarge");
  return r;
}

TEST(ContextPlanner, SplitsLongSequencesAndNotShortOnes) {
  const Plan long_plan = PlanLayouts(LlamaOnP5(131072));
  ASSERT_NE(long_plan.best(), nullptr);
  const Candidate& best = *long_plan.best();
  EXPECT_GT(best.choice.context, 1) << Describe(best.choice);
  // C = 1 was tried: a rank holds a whole sequence only by recomputing its blocks, which
  // is slower.
  EXPECT_GT(long_plan.candidates_by_context.at(1), 0);
  for (const Candidate& c : long_plan.feasible) {
    if (c.choice.context > 1) continue;
    EXPECT_TRUE(c.choice.activations.checkpointing) << Describe(c.choice);
    EXPECT_GT(c.step.seconds, best.step.seconds) << Describe(c.choice);
  }

  const Plan short_plan = PlanLayouts(LlamaOnP5(4096));
  ASSERT_NE(short_plan.best(), nullptr);
  EXPECT_EQ(short_plan.best()->choice.context, 1) << Describe(short_plan.best()->choice);
  // A rank keeps every activation of a sequence of 4096 at every P and T: none is split.
  EXPECT_EQ(short_plan.candidates_by_context.size(), 1u);
}

TEST(ContextPlanner, OffersOnlyDegreesTheSequenceHeadsAndMeshTake) {
  PlanRequest r = LlamaOnP5(131072);
  EXPECT_EQ(ContextDegrees(r, 1, 8, 8), (std::vector<int>{1, 2, 4}));  // 4 TP groups
  EXPECT_EQ(ContextDegrees(r, 1, 1, 8), (std::vector<int>{1, 2, 4, 8}));
  r.context_mode = "AllToAll";
  EXPECT_EQ(ContextDegrees(r, 1, 4, 8), (std::vector<int>{1, 2}));  // 2 key/value heads a TP rank
  r.context_mode = "Ring";
  r.seq = 12;  // 2C must divide it
  EXPECT_EQ(ContextDegrees(r, 1, 1, 8), (std::vector<int>{1, 2}));
  r.seq = 131072;
  r.dropout = true;
  EXPECT_EQ(ContextDegrees(r, 1, 1, 8), (std::vector<int>{1}));
}

TEST(ContextPlanner, WhereNothingFitsNamesTheShortfallAndAContextThatFits) {
  // A device just too small for the least of the layouts without context.
  PlanRequest r = LlamaOnP5(131072);
  r.max_context = 1;
  int64_t least_need = INT64_MAX;
  for (const Candidate& c : PlanLayouts(r).feasible) least_need = std::min(least_need, c.needed);
  r.device.memory_bytes = least_need;
  const Plan plan = PlanLayouts(r);
  ASSERT_EQ(plan.best(), nullptr);
  ASSERT_FALSE(plan.rejected.empty());
  auto by_need = [](const Candidate& a, const Candidate& b) { return a.needed < b.needed; };
  const Candidate& least = *std::min_element(plan.rejected.begin(), plan.rejected.end(), by_need);
  const std::string bytes = std::to_string(least.needed - r.device.Usable()) + " bytes more than the";
  EXPECT_NE(plan.shortfall.find(bytes), std::string::npos) << plan.shortfall;
  const size_t at = plan.shortfall.find("contextParallelDegree ");
  ASSERT_NE(at, std::string::npos) << plan.shortfall;
  const int C = std::atoi(plan.shortfall.c_str() + at + 22);
  ASSERT_GT(C, 1) << plan.shortfall;
  // That C fits, and half of it does not (at the micro-batches of the least one's step).
  const LayoutChoice& l = least.choice;
  const int64_t data_parallel = 32 / (l.pipeline.stages * l.tp);
  const int micro_batches = int(r.global_batch_tokens / (int64_t(l.micro_batch) * r.seq * data_parallel));
  auto needs = [&](int context) {
    return PredictMemory(r.shape, r.seq, WithContext(l, context), 2, false, false, micro_batches).device();
  };
  EXPECT_LE(needs(C), r.device.Usable());
  EXPECT_GT(needs(C / 2), r.device.Usable());

  // A layout that fits has none.
  EXPECT_EQ(SequenceShortfall(LlamaOnP5(4096), LayoutChoice{1, 32, 1, {true, false, 2}}), "");
}

TEST(ContextPlanner, WritesTheDegreeAndModeForTheWorkersAndTheStatus) {
  const nlohmann::json written = {{"parallelism", {{"mode", "auto"}}}};
  const LayoutChoice choice = WithContext({8, 1, 1, {true, false, 2}}, 4);
  const nlohmann::json resolved = ResolveWrittenSpec(written, choice);
  EXPECT_EQ(resolved["parallelism"]["contextParallelDegree"], 4);
  EXPECT_EQ(resolved["parallelism"]["contextParallelMode"], "Ring");
  EXPECT_EQ(ResolveWrittenSpec(written, {8, 1, 1, {}})["parallelism"]["contextParallelDegree"], 1);
  const api::LayoutStatus status = LayoutStatusOf(choice);
  EXPECT_EQ(status.context_parallel_degree, 4);
  EXPECT_EQ(status.context_parallel_mode, "Ring");
  EXPECT_EQ(Describe(choice), "T=8, S=1, C=4 ring, micro-batch 1, checkpointing");
  EXPECT_EQ(Describe({8, 1, 1, {}}), "T=8, S=1, micro-batch 1, keep all");
  EXPECT_EQ(Describe(WithContext({8, 1, 1, {}}, 2, "AllToAll")), "T=8, S=1, C=2 all-to-all, micro-batch 1, keep all");
}

// Expert parallelism: EP ranks split each mixture-of-experts block's experts.

const api::ModelShape& Qwen3Moe() { return *api::FindPreset("qwen3-30b-a3b"); }

LayoutChoice WithExperts(LayoutChoice c, int expert) {
  c.expert = expert;
  return c;
}

TEST(ExpertMemory, ARankHoldsEOverEPExpertsShardedOverTheRanksHoldingTheSame) {
  const api::ModelShape& shape = Qwen3Moe();
  const api::UnitElements all = api::UnitElementsOf(shape, 0, 1, api::kVocabMultiple, 1);
  const api::UnitElements eighth = api::UnitElementsOf(shape, 0, 1, api::kVocabMultiple, 8);
  // 128 experts of gate, up (768 x 2048) and down (2048 x 768) a block.
  EXPECT_EQ(all.block_experts, int64_t(128) * 3 * 768 * 2048);
  EXPECT_EQ(eighth.block_experts * 8, all.block_experts);
  EXPECT_EQ(eighth.block_shared(), all.block_shared());  // attention, norms and router: every member's
  EXPECT_EQ(eighth.embedding, all.embedding);
  EXPECT_EQ(api::UnitElementsOf(Llama8B(), 0, 1, api::kVocabMultiple, 8).block,
            api::UnitElementsOf(Llama8B(), 0, 1).block);  // a dense block has no experts to split

  // S = 8: without EP a block is sharded over 8 ranks; with EP = 8 each rank holds its 16
  // experts of each block whole (8 / 8 = 1 rank holds the same), beside the shared part.
  const int seq = 4096;
  const LayoutChoice base{1, 8, 1, {true, false, 2}};
  const MemoryPrediction one = PredictMemory(shape, seq, base, 2, false, false, 1);
  const MemoryPrediction split = PredictMemory(shape, seq, WithExperts(base, 8), 2, false, false, 1);
  const int64_t L = shape.layers;
  auto held = [](int64_t bytes) { return int64_t(api::AllocatorBlockBytes(size_t(bytes))); };
  const int64_t edge_master = held(api::ShardElements(all.embedding, 8) * 4) + held(api::ShardElements(all.head, 8) * 4);
  EXPECT_EQ(one.params, edge_master + L * held(api::ShardElements(all.block, 8) * 4));
  EXPECT_EQ(split.params, edge_master + L * held(eighth.block * 4));
  // The experts' part of a rank's shards is the same (1/8 of them either way); the shared
  // part is held by 8 times as many ranks.
  EXPECT_NEAR(double(split.params - one.params), double(L) * 4 * (eighth.block_shared() * 7.0 / 8), 4.0 * L * (2 << 20));
  // The compute copies of a block (bf16) and their gradients (fp32), two slots: E/EP experts.
  const int64_t edge_slot = held(api::ShardElements(all.edge(), 8) * 8 * 2) + held(api::ShardElements(all.edge(), 8) * 8 * 4);
  EXPECT_EQ(one.gathered, edge_slot + 2 * held(api::ShardElements(all.block, 8) * 8 * 2) +
                              2 * held(api::ShardElements(all.block, 8) * 8 * 4));
  EXPECT_EQ(split.gathered, edge_slot + 2 * held(eighth.block * 2) + 2 * held(eighth.block * 4));
  // Qwen3-30B-A3B's blocks are 97% experts: a block's slots fall 6.6 times.
  EXPECT_LT(double(split.gathered - edge_slot), 0.16 * double(one.gathered - edge_slot));
  // The rows a rank's experts may receive are sized EP x its tokens' copies.
  const api::EngineTypes types_one = EngineTypesOf(2, false, shape, 1, seq, 1);
  const api::EngineTypes types_split = EngineTypesOf(2, false, shape, 1, seq, 1, 1, "Ring", 8);
  EXPECT_EQ(types_split.experts, 8);
  EXPECT_GT(api::BlockActivationBytes(1, seq, shape, 1, types_split),
            api::BlockActivationBytes(1, seq, shape, 1, types_one) + int64_t(7) * seq * 8 * (2 * 768 + 768) * 2);
  EXPECT_GT(split.activations, one.activations);
}

TEST(ExpertMemory, AnExpertGroupOfOneShardStillReducesFromUnshardedGradients) {
  // moe-tiny, S = 2 and EP = 2: each block on one rank of its expert-shard group, its
  // gradients slots kept for the reduction over the expert group.
  const api::ModelShape& tiny = *api::FindPreset("moe-tiny");
  const api::EngineTypes types = EngineTypesOf(4, true, tiny, 1, 32, 1, 1, "Ring", 2);
  const api::EngineMemory m = api::EngineMemoryOf(tiny, 1, 32, 0, 1, 2, {}, types, false);
  const api::UnitElements units = api::UnitElementsOf(tiny, 0, 1, api::kVocabMultiple, 2);
  EXPECT_EQ(api::BlockShards(units, 2, 2), 1);
  auto held = [](int64_t bytes) { return int64_t(api::AllocatorBlockBytes(size_t(bytes))); };
  const int64_t edge = api::ShardElements(units.edge(), 2) * 2;
  EXPECT_EQ(m.gathered, held(edge * 4) + 2 * held(units.block * 4) + held(edge * 4) + 2 * held(units.block * 4));
  EXPECT_EQ(m.comm, held(std::max(api::ShardElements(units.edge(), 2), units.block) * 4));
}

// The planner's per-rank peak under EP is the engine's own count (api::EngineMemoryOf, the
// figures engine_test holds every rank's allocations to) with its types' experts = EP,
// category by category: both families at test size (4 experts), EP 2 and 4, expert-shard
// groups of one rank and of two, every activation policy. And that count is EP's, not
// the whole experts': smaller compute copies, larger shards.
TEST(ExpertMemory, ThePredictionIsTheEnginesCountAtEachEP) {
  const int seq = 32;
  for (const char* preset : {"moe-tiny", "qwen3-moe-tiny"}) {
    const api::ModelShape& shape = *api::FindPreset(preset);
    for (const LayoutChoice& c : {WithExperts({1, 2, 4, {}}, 2), WithExperts({1, 4, 2, {true, false, 2}}, 2),
                                  WithExperts({1, 4, 4, {true, true, 1}}, 4), WithExperts({1, 4, 8, {}}, 4)}) {
      SCOPED_TRACE(std::string(preset) + ": " + Describe(c));
      ASSERT_EQ(shape.experts % c.expert, 0);
      const MemoryPrediction predicted = PredictMemory(shape, seq, c, 4, true, false, 1);
      const api::EngineMemory engine =
          api::EngineMemoryOf(shape, c.micro_batch, seq, 0, 1, c.shard, c.activations,
                              EngineTypesOf(4, true, shape, c.micro_batch, seq, 1, 1, "Ring", c.expert), false);
      EXPECT_EQ(predicted.params, engine.params);
      EXPECT_EQ(predicted.grads, engine.grads);
      EXPECT_EQ(predicted.optimizer, engine.optimizer);
      EXPECT_EQ(predicted.activations, engine.activations);
      EXPECT_EQ(predicted.offload, engine.offload);
      EXPECT_EQ(predicted.gathered, engine.gathered);
      EXPECT_EQ(predicted.comm, engine.comm);
      EXPECT_EQ(predicted.total(), engine.total());
      const MemoryPrediction whole = PredictMemory(shape, seq, WithExperts(c, 1), 4, true, false, 1);
      EXPECT_LT(predicted.gathered, whole.gathered);
      EXPECT_GT(predicted.params, whole.params);
      EXPECT_GT(predicted.activations, whole.activations);  // the received rows: EP x the tokens' copies
    }
  }
}

// 2 p5.48xlarge nodes of 8 H100s, one network domain.
PlanRequest MoeOnP5(const api::ModelShape& shape, int nodes, int64_t global_batch_tokens) {
  PlanRequest r;
  r.shape = shape;
  r.shape.seq_len = 4096;
  r.seq = 4096;
  r.global_batch_tokens = global_batch_tokens;
  r.cluster.nodes = nodes;
  r.cluster.gpus_per_node = 8;
  for (int n = 0; n < nodes; ++n) r.cluster.node_paths.push_back({"n" + std::to_string(n)});
  r.device = *FindInstanceDevice("p5.48xlarge");
  return r;
}

TEST(ExpertStep, AllToAllsCarryEachMoeLayersTokensOverTheExpertGroupsLink) {
  const api::ModelShape& shape = Qwen3Moe();
  const PlanRequest r = MoeOnP5(shape, 2, 16 * 4096);  // one sequence a rank: one micro-step
  const LayoutChoice base{1, 16, 1, {}};
  const StepPrediction none = PredictStep(shape, 4096, r.global_batch_tokens, base, r.cluster, r.device);
  EXPECT_EQ(none.expert_bytes, 0);
  EXPECT_EQ(none.expert_seconds, 0);
  // EP = 8: two all-to-alls forward and two backward a block of 4096 x 8 rows of 2048 bf16,
  // 7/8 of them leaving the rank, over NVLink (the group is one node's ranks).
  const StepPrediction node = PredictStep(shape, 4096, r.global_batch_tokens, WithExperts(base, 8), r.cluster, r.device);
  const double rows = 4096.0 * 8 * 2048 * 2;
  EXPECT_NEAR(double(node.expert_bytes), 48 * 4 * rows * 7 / 8, 1.0);
  const Link& nvlink = r.cluster.links.IntraNode();
  EXPECT_NEAR(node.expert_seconds, 48 * 4 * 7 * (nvlink.latency_seconds + rows / 8 / nvlink.bytes_per_second), 1e-9);
  // Recomputing a block redoes its forward's two.
  const StepPrediction recompute =
      PredictStep(shape, 4096, r.global_batch_tokens, WithExperts({1, 16, 1, {true, false, 2}}, 8), r.cluster, r.device);
  EXPECT_NEAR(double(recompute.expert_bytes), 48 * 6 * rows * 7 / 8, 1.0);
  // EP = 16 spans both nodes: over the network, far slower a byte.
  const StepPrediction both = PredictStep(shape, 4096, r.global_batch_tokens, WithExperts(base, 16), r.cluster, r.device);
  EXPECT_NEAR(double(both.expert_bytes), 48 * 4 * rows * 15 / 16, 1.0);
  EXPECT_GT(both.expert_seconds, 4 * node.expert_seconds);
  // A block gathers and reduce-scatters its shared part and 1/EP of its experts, over the
  // 2 ranks holding the same experts (r and r + 8, one in each node) rather than all 16:
  // the comm stream's busy time halves (one micro-step: gathers, reduce-scatters, and the
  // replica all-reduce of none here).
  EXPECT_LT(node.comm_seconds, 0.6 * none.comm_seconds);
}

// Under TP each rank computes I / T units of every expert (their FLOPs and parameters fall
// by T) but routes all its group's tokens: the router's product is whole on each TP rank,
// and each sends its tokens' k copies, hidden wide, to its expert group (T divides
// neither); the backward adds the routing weights' gradients over the TP group.
// Qwen3-30B-A3B on one p5 node, one sequence of 4096 a rank, keeping every activation:
// T=1, S=8 against T=2, S=4, both with EP = 4 (a group in the node either way).
TEST(ExpertStep, TensorParallelismSplitsTheExpertsButNotTheRouterOrTheAllToAlls) {
  const api::ModelShape& shape = Qwen3Moe();
  const PlanRequest r = MoeOnP5(shape, 1, 0);
  const StepPrediction one = PredictStep(shape, 4096, 8 * 4096, WithExperts({1, 8, 1, {}}, 4), r.cluster, r.device);
  const StepPrediction two = PredictStep(shape, 4096, 4 * 4096, WithExperts({2, 4, 1, {}}, 4), r.cluster, r.device);
  ASSERT_EQ(one.micro_steps, 1);
  ASSERT_EQ(two.micro_steps, 1);
  const double C = 2048, Q = 32 * 128, KV = 4 * 128, E = 128, K = 8, I = 768, L = 48, V = 151936, tokens = 4096;
  // A token's forward FLOPs: attention's weights and scores and its k experts' gate, up
  // and down, split by T; the router, 2 x E x C, whole; the head, split by T. Its routing
  // (the permute of its row into k copies, the combine of the k outputs back) moves
  // 2 x (1 + k) rows of C bf16 through memory, whole too. A backward is twice its forward.
  const double split = 2 * (C * (Q + 2 * KV) + Q * C) + 4 * 4096 * Q + K * 2 * 3 * C * I, router = 2 * E * C;
  const double routing = 2 * (1 + K) * C * 2 / r.device.memory_bytes_per_second;
  auto compute = [&](double T) {
    const double flops = r.device.matrix_flops;
    return 3 * tokens * (L * ((split / T + router) / flops + routing) + 2 * V * C / T / flops);
  };
  EXPECT_NEAR(one.compute_seconds, compute(1), 1e-9 * one.compute_seconds);
  EXPECT_NEAR(two.compute_seconds, compute(2), 1e-9 * two.compute_seconds);
  // T = 2 halves all of it but the router's product and the routing, which each TP rank
  // does in full.
  EXPECT_NEAR(two.compute_seconds - one.compute_seconds / 2,
              3 * tokens * L * (router / r.device.matrix_flops + routing) / 2, 1e-9 * one.compute_seconds);
  // TP: each block's four all-reduces of the rank's rows, as a dense block's, and the
  // routing weights' gradients (4096 x 8 fp32 a rank) all-gathered; the head's two.
  const api::ParallelLayout mesh(1, 8, 2, 4, 1, 1, 4);
  auto collective = [&](Collective op, double bytes) {
    return CollectiveSeconds(op, bytes, {0, 1}, mesh, r.cluster.node_paths, r.cluster.links);
  };
  const double all_reduce = collective(Collective::kAllReduce, tokens * C * 2);
  EXPECT_EQ(one.tp_seconds, 0);
  EXPECT_NEAR(two.tp_seconds,
              L * (4 * all_reduce + collective(Collective::kAllGather, tokens * K * 4 * 2)) +
                  2 * (all_reduce + collective(Collective::kAllGather, tokens * 3 * 4 * 2)),
              1e-12);
  // The all-to-alls carry the same rows from each rank at T = 2 as at T = 1: 4096 x 8
  // copies of 2048 bf16, 3/4 of them leaving, four a block.
  EXPECT_NEAR(double(two.expert_bytes), L * 4 * (tokens * K * C * 2) * 3 / 4, 1.0);
  EXPECT_EQ(two.expert_bytes, one.expert_bytes);
  EXPECT_NEAR(two.expert_seconds, one.expert_seconds, 1e-12);
  // A TP rank holds I / T units of each of its E / EP experts, and the router whole.
  const api::UnitElements units = api::UnitElementsOf(shape, 0, 2, api::kVocabMultiple, 4);
  EXPECT_EQ(units.block_experts, int64_t(128 / 4) * 3 * 2048 * 768 / 2);
  EXPECT_EQ(units.block_shared(), int64_t(C * (Q + 2 * KV) + Q * C) / 2 + int64_t(E * C) + 2 * 2048 + 2 * 128);
}

// Qwen3-30B-A3B on 2 p5 nodes, one sequence of 4096 a rank a step: one micro-step, whose
// compute (0.38 s) cannot hide the gathers of blocks of 128 experts (623M elements, 1.2
// GB in bf16, each gathered twice and reduce-scattered once). With EP = 8 a rank gathers
// its 16 experts and the shared part from the rank holding the same ones in the other
// node; the all-to-alls stay in the node (NVLink) and cost less than the gathers saved.
// That is the fastest layout without TP; the fastest of all splits each expert over T = 4
// ranks of a node and the blocks over 4 pipeline stages, gathering nothing (S = 1).
TEST(ExpertPlanner, Qwen3MoeSplitsTheExpertsWhereGathersCannotHide) {
  const PlanRequest r = MoeOnP5(Qwen3Moe(), 2, 16 * 4096);
  const Plan plan = PlanLayouts(r);
  ASSERT_NE(plan.best(), nullptr);
  EXPECT_EQ(plan.best()->choice.tp, 4) << Describe(plan.best()->choice);
  EXPECT_EQ(plan.best()->choice.shard, 1) << Describe(plan.best()->choice);
  const auto untensored = std::find_if(plan.feasible.begin(), plan.feasible.end(),
                                       [](const Candidate& c) { return c.choice.tp == 1; });
  ASSERT_NE(untensored, plan.feasible.end());
  EXPECT_LT(plan.best()->step.seconds, untensored->step.seconds);
  const Candidate& best = *untensored;
  EXPECT_EQ(best.choice.expert, 8) << Describe(best.choice);
  EXPECT_LE(best.needed, r.device.Usable());
  EXPECT_GT(best.step.expert_seconds, 0);
  // The same layout with EP = 1 fits, but its gathers are exposed: more than the
  // all-to-alls that EP = 8 adds.
  const Candidate whole = Evaluate(r, WithExperts(best.choice, 1));
  EXPECT_TRUE(whole.reason.empty()) << whole.reason;
  EXPECT_GT(whole.step.exposed_seconds - best.step.exposed_seconds, best.step.expert_seconds);
  EXPECT_GT(whole.step.seconds, 1.5 * best.step.seconds);
  // And every layout with T = 1 and EP = 1 is slower.
  ASSERT_GT(plan.candidates_by_expert.at(1), 0);
  for (const Candidate& c : plan.feasible) {
    if (c.choice.expert == 1 && c.choice.tp == 1) {
      EXPECT_GT(c.step.seconds, 1.3 * best.step.seconds) << Describe(c.choice);
    }
  }
}

// With 4 sequences a rank the gathers hide behind compute, and EP's all-to-alls, on the
// compute stream, cost what they take: EP = 1 wins, without TP and overall (where T > 1
// with a pipeline is faster still).
TEST(ExpertPlanner, Qwen3MoeKeepsTheExpertsWholeWhereGathersHide) {
  const PlanRequest r = MoeOnP5(Qwen3Moe(), 2, 64 * 4096);
  const Plan plan = PlanLayouts(r);
  ASSERT_NE(plan.best(), nullptr);
  EXPECT_EQ(plan.best()->choice.expert, 1) << Describe(plan.best()->choice);
  const auto untensored = std::find_if(plan.feasible.begin(), plan.feasible.end(),
                                       [](const Candidate& c) { return c.choice.tp == 1; });
  ASSERT_NE(untensored, plan.feasible.end());
  const Candidate& best = *untensored;
  EXPECT_EQ(best.choice.expert, 1) << Describe(best.choice);
  EXPECT_LT(best.step.exposed_seconds, 0.05 * best.step.seconds);
  const auto split = std::find_if(plan.feasible.begin(), plan.feasible.end(),
                                  [](const Candidate& c) { return c.choice.expert > 1; });
  ASSERT_NE(split, plan.feasible.end());
  EXPECT_GT(split->step.seconds - best.step.seconds, 0.5 * split->step.expert_seconds) << Describe(split->choice);
}

// spec.training.routerAuxLossCoef: the engine sums the load-balancing loss's statistics
// over the pipeline stages, so the loss changes no layout the planner offers; pipelines
// among them.
TEST(ExpertPlanner, TheLoadBalancingLossLeavesPipelineStagesOpen) {
  api::TrainingJobSpec spec = api::LoadTrainingJobs("examples/qwen3-moe-30b-a3b-auto.yaml").at(0).job.spec;
  auto layouts = [&] {
    const Plan plan = PlanLayouts(
        RequestFor(spec, {{"n0"}, {"n1"}}, LinkModel({"kubernetes.io/hostname"}), *FindInstanceDevice("p5.48xlarge")));
    std::vector<std::string> out;
    for (const auto* list : {&plan.feasible, &plan.rejected})
      for (const Candidate& c : *list) out.push_back(Describe(c.choice));
    std::sort(out.begin(), out.end());
    return out;
  };
  const std::vector<std::string> without = layouts();
  spec.training.router_aux_loss_coef = 0.001;
  EXPECT_EQ(layouts(), without);
  EXPECT_TRUE(std::any_of(without.begin(), without.end(), [](const std::string& d) { return d.rfind("P=", 0) == 0; }));
}

TEST(ExpertPlanner, OffersTheDivisorsOfTheExpertsThatDivideTheShardGroup) {
  EXPECT_EQ(ExpertDegrees(Qwen3Moe(), 16), (std::vector<int>{1, 2, 4, 8, 16}));
  EXPECT_EQ(ExpertDegrees(*api::FindPreset("mixtral-8x7b"), 16), (std::vector<int>{1, 2, 4, 8}));
  EXPECT_EQ(ExpertDegrees(*api::FindPreset("mixtral-8x7b"), 12), (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(ExpertDegrees(Llama8B(), 32), (std::vector<int>{1}));
}

TEST(ExpertPlanner, DenseModelsKeepEP1) {
  const Plan plan = PlanLayouts(LlamaOnP5(4096));
  ASSERT_NE(plan.best(), nullptr);
  EXPECT_EQ(plan.candidates_by_expert.size(), 1u);
  EXPECT_EQ(plan.candidates_by_expert.at(1), plan.candidates);
  for (const Candidate& c : plan.feasible) EXPECT_EQ(c.choice.expert, 1) << Describe(c.choice);
}

TEST(ExpertPlanner, WritesTheDegreeForTheWorkersAndTheStatus) {
  const nlohmann::json written = {{"parallelism", {{"mode", "auto"}}}};
  const LayoutChoice choice = WithExperts({1, 8, 2, {true, false, 2}}, 8);
  EXPECT_EQ(ResolveWrittenSpec(written, choice)["parallelism"]["expertParallelDegree"], 8);
  EXPECT_EQ(ResolveWrittenSpec(written, {8, 1, 1, {}})["parallelism"]["expertParallelDegree"], 1);
  EXPECT_EQ(LayoutStatusOf(choice).expert_parallel_degree, 8);
  EXPECT_EQ(Describe(choice), "T=1, S=8, EP=8, micro-batch 2, checkpointing");
}

// A mixture of experts with dense blocks among its sparse ones (Qwen3-MoE's
// decoder_sparse_step, mlp_only_layers): each block computes, holds and sends its own
// kind's. Qwen3-30B-A3B with decoder_sparse_step 2: blocks 0, 2, ..., 46 dense (an MLP of
// 6144 units, its config.json's intermediate_size), 1, 3, ..., 47 sparse.
api::ModelShape Qwen3MoeEveryOtherDense(int64_t intermediate = 0) {
  api::ModelShape s = Qwen3Moe();
  s.decoder_sparse_step = 2;
  if (intermediate > 0) s.intermediate = intermediate;
  return s;
}

// The step's compute is each block's own kind's: a sparse block's attention, k experts,
// whole router and routing, a dense block's attention and dense MLP; between the model
// whose every block is dense and the one whose every block is sparse. Qwen3-30B-A3B's
// dense MLP (6144 units) does the FLOPs of a token's 8 experts (768 each): the dense
// blocks save their router and routing. With a narrower dense MLP (3072) they save half
// of those FLOPs too. TP: every block's four all-reduces, the routing weights'
// all-gather in the sparse blocks only.
TEST(DenseBlocks, EachBlockComputesItsOwnKindsFlops) {
  const api::ModelShape shape = Qwen3MoeEveryOtherDense();
  ASSERT_EQ(shape.DenseBlocks(), 24);
  ASSERT_TRUE(shape.DenseBlock(0));
  ASSERT_FALSE(shape.DenseBlock(1));
  const PlanRequest r = MoeOnP5(shape, 1, 0);
  const LayoutChoice t1 = WithExperts({1, 8, 1, {}}, 4), t2 = WithExperts({2, 4, 1, {}}, 4);
  const double C = 2048, Q = 32 * 128, KV = 4 * 128, E = 128, K = 8, I = 768, V = 151936, tokens = 4096;
  const double Ls = 24, Ld = 24, flops = r.device.matrix_flops;
  const double attention = 2 * (C * (Q + 2 * KV) + Q * C) + 4 * 4096 * Q;
  const double sparse = attention + K * 2 * 3 * C * I, router = 2 * E * C;
  const double routing = 2 * (1 + K) * C * 2 / r.device.memory_bytes_per_second;
  auto compute = [&](double T, double dense_width, double sparse_blocks, double dense_blocks) {
    const double dense = attention + 2 * 3 * C * dense_width;
    return 3 * tokens *
           (sparse_blocks * ((sparse / T + router) / flops + routing) + dense_blocks * dense / T / flops +
            2 * V * C / T / flops);
  };
  for (const int64_t width : {6144, 3072}) {
    SCOPED_TRACE("dense MLP " + std::to_string(width));
    const api::ModelShape mixed = Qwen3MoeEveryOtherDense(width);
    const StepPrediction one = PredictStep(mixed, 4096, 8 * 4096, t1, r.cluster, r.device);
    const StepPrediction two = PredictStep(mixed, 4096, 4 * 4096, t2, r.cluster, r.device);
    ASSERT_EQ(one.micro_steps, 1);
    ASSERT_EQ(two.micro_steps, 1);
    EXPECT_NEAR(one.compute_seconds, compute(1, double(width), Ls, Ld), 1e-9 * one.compute_seconds);
    EXPECT_NEAR(two.compute_seconds, compute(2, double(width), Ls, Ld), 1e-9 * two.compute_seconds);
    // Between every block dense and every block sparse.
    EXPECT_GT(one.compute_seconds, compute(1, double(width), 0, 48));
    EXPECT_LT(one.compute_seconds, compute(1, double(width), 48, 0));
  }
  const StepPrediction all_sparse = PredictStep(Qwen3Moe(), 4096, 8 * 4096, t1, r.cluster, r.device);
  const StepPrediction one = PredictStep(shape, 4096, 8 * 4096, t1, r.cluster, r.device);
  EXPECT_NEAR(all_sparse.compute_seconds, compute(1, 6144, 48, 0), 1e-9 * all_sparse.compute_seconds);
  EXPECT_NEAR(all_sparse.compute_seconds - one.compute_seconds, 3 * tokens * Ld * (router / flops + routing),
              1e-9 * one.compute_seconds);
  const StepPrediction two = PredictStep(shape, 4096, 4 * 4096, t2, r.cluster, r.device);
  const api::ParallelLayout mesh(1, 8, 2, 4, 1, 1, 4);
  auto collective = [&](Collective op, double bytes) {
    return CollectiveSeconds(op, bytes, {0, 1}, mesh, r.cluster.node_paths, r.cluster.links);
  };
  const double all_reduce = collective(Collective::kAllReduce, tokens * C * 2);
  EXPECT_NEAR(two.tp_seconds,
              48 * 4 * all_reduce + Ls * collective(Collective::kAllGather, tokens * K * 4 * 2) +
                  2 * (all_reduce + collective(Collective::kAllGather, tokens * 3 * 4 * 2)),
              1e-12);
}

// Only sparse blocks send their tokens to experts: half the all-to-alls' bytes and time of
// the model whose every block is sparse, recompute's included; in the cost model, half the
// expert group's time (all-to-alls and the shared part's all-reduce), and the dense
// blocks' units gathered over the shard group, not the expert-shard group.
TEST(DenseBlocks, OnlySparseBlocksSendTokensToExperts) {
  const PlanRequest r = MoeOnP5(Qwen3Moe(), 2, 16 * 4096);
  for (const api::ActivationPolicy policy : {api::ActivationPolicy{}, api::ActivationPolicy{true, false, 2}}) {
    const LayoutChoice c = WithExperts({1, 16, 1, policy}, 8);
    SCOPED_TRACE(Describe(c));
    const StepPrediction all = PredictStep(Qwen3Moe(), 4096, r.global_batch_tokens, c, r.cluster, r.device);
    const StepPrediction mixed =
        PredictStep(Qwen3MoeEveryOtherDense(), 4096, r.global_batch_tokens, c, r.cluster, r.device);
    const double rows = 4096.0 * 8 * 2048 * 2;
    EXPECT_NEAR(double(all.expert_bytes), 48 * (policy.checkpointing ? 6 : 4) * rows * 7 / 8, 1.0);
    EXPECT_NEAR(2 * double(mixed.expert_bytes), double(all.expert_bytes), 2.0);
    EXPECT_GT(mixed.expert_seconds, 0);
    EXPECT_NEAR(2 * mixed.expert_seconds, all.expert_seconds, 1e-12 * all.expert_seconds);
    // Half the blocks gather 1/8 of a sparse block's experts from one peer each; the other
    // half a dense block (57M elements) from all 16 ranks: far less comm in all.
    EXPECT_LT(mixed.comm_seconds, all.comm_seconds);
    EXPECT_LT(mixed.seconds, all.seconds);
  }

  api::TrainingJobSpec spec = api::LoadTrainingJobs("examples/qwen3-moe-30b-a3b-auto.yaml").at(0).job.spec;
  spec.parallelism.mode = "manual";
  spec.parallelism.tensor_parallel_degree = 1;
  spec.parallelism.hybrid_shard_degree = 16;
  spec.parallelism.expert_parallel_degree = 8;
  const std::vector<std::vector<std::string>> paths = {{"n0"}, {"n1"}};
  const LinkModel links({"kubernetes.io/hostname"});
  auto axis = [](const StepCost& cost, const std::string& name) {
    for (const AxisCost& a : cost.axes) {
      if (a.axis == name) return a.seconds;
    }
    ADD_FAILURE() << "no axis " << name;
    return 0.0;
  };
  const StepCost all = EstimateStepCost(spec, paths, links);
  spec.model.decoder_sparse_step = 2;
  const api::ModelShape shape = api::ShapeOf(spec.model);
  ASSERT_EQ(shape.DenseBlocks(), 24);
  const StepCost mixed = EstimateStepCost(spec, paths, links);
  EXPECT_GT(axis(mixed, "expert"), 0);
  EXPECT_NEAR(2 * axis(mixed, "expert"), axis(all, "expert"), 1e-12 * axis(all, "expert"));
  // The shard group gathers (twice, bf16) and reduce-scatters (fp32) the embedding, the
  // head and the 24 dense blocks each micro-step; the expert-shard group the 24 sparse ones.
  const api::ParallelLayout mesh = api::ParallelLayout::ForSpec(spec);
  const api::UnitElements units = api::UnitElementsOf(shape, 0, 1, api::kVocabMultiple, 8);
  const double steps = double(api::AccumulationSteps(spec));
  auto gathers = [&](api::Axis a, double elements) {
    double slowest = 0;
    for (const std::vector<int>& group : mesh.Groups(a)) {
      slowest = std::max(slowest, CollectiveSeconds(Collective::kAllGather, 2 * elements, group, mesh, paths, links) * 2 +
                                      CollectiveSeconds(Collective::kReduceScatter, 4 * elements, group, mesh, paths, links));
    }
    return steps * slowest;
  };
  EXPECT_NEAR(axis(mixed, "shard"), gathers(api::Axis::kShard, double(units.embedding + units.head + 24 * units.dense_block)),
              1e-12 * axis(mixed, "shard"));
  EXPECT_NEAR(axis(mixed, "expert-shard"), gathers(api::Axis::kExpertShard, 24.0 * double(units.block)),
              1e-12 * axis(mixed, "expert-shard"));
}

// Each block's unit is sharded as its kind is: a sparse one over the S / EP ranks holding
// the same experts, a dense one over all S; a rank's master weights are the sum of its
// blocks' shards, the embedding's and the head's (api::EngineMemoryOf, what the planner
// predicts), per pipeline stage its own blocks'. The step model's update streams those
// same shards (28 bytes an element).
TEST(DenseBlocks, EachBlockHoldsItsOwnKindsShard) {
  const api::ModelShape shape = Qwen3MoeEveryOtherDense();
  const PlanRequest r = MoeOnP5(shape, 1, 0);
  auto held = [](int64_t bytes) { return int64_t(api::AllocatorBlockBytes(size_t(bytes))); };
  for (const int EP : {1, 8}) {
    for (const int P : {1, 2}) {
      LayoutChoice c = WithExperts({1, 8 / P, 1, {true, false, 2}}, EP);
      c.pipeline.stages = P;
      if ((8 / P) % EP != 0) continue;
      SCOPED_TRACE(Describe(c));
      const int S = c.shard;
      const api::UnitElements u = api::UnitElementsOf(shape, 0, 1, api::kVocabMultiple, EP);
      ASSERT_GT(u.dense_block, 0);
      ASSERT_LT(u.dense_block, u.block);
      const api::EngineTypes types = EngineTypesOf(2, false, shape, 1, 4096, 1, 1, "Ring", EP);
      const std::vector<int> first = api::SplitBlocks(shape, 4096, P);
      int64_t most = 0;
      double most_elements = 0;
      for (int p = 0; p < P; ++p) {
        const api::StageShape stage = api::StageShapeOf(shape, c.pipeline, p, 4, 4096);
        const bool embedding = p == 0, head = p == P - 1;  // Qwen3-30B-A3B's head is untied
        int64_t params = (embedding ? held(api::ShardElements(u.embedding, S) * 4) : 0) +
                         (head ? held(api::ShardElements(u.head, S) * 4) : 0);
        double elements = double((embedding ? api::ShardElements(u.embedding, S) : 0) +
                                 (head ? api::ShardElements(u.head, S) : 0));
        for (int l = first[size_t(p)]; l < first[size_t(p) + 1]; ++l) {
          const int64_t shard =
              shape.DenseBlock(l) ? api::ShardElements(u.dense_block, S) : api::ShardElements(u.block, S / EP);
          params += held(shard * 4);
          elements += double(shard);
        }
        const api::EngineMemory m =
            api::EngineMemoryOf(shape, 1, 4096, 0, 1, S, c.activations, types, false, false, stage);
        EXPECT_EQ(m.params, params) << "stage " << p;
        most = std::max(most, params);
        most_elements = std::max(most_elements, elements);
      }
      const MemoryPrediction predicted = PredictMemory(shape, 4096, c, 2, false, false, 4);
      EXPECT_EQ(predicted.params, most);
      const StepPrediction step = PredictStep(shape, 4096, int64_t(4) * S * 4096, c, r.cluster, r.device);
      EXPECT_NEAR(step.update_seconds, most_elements * 28 / r.device.memory_bytes_per_second,
                  1e-12 * step.update_seconds);
    }
  }
}

// The planner finds a layout for the model with dense blocks that fits, faster than the
// same layout of the model whose every block is sparse (fewer experts to gather, half the
// routers, routing and all-to-alls).
TEST(DenseBlocks, Qwen3MoeWithDenseBlocksPlansALayoutThatFits) {
  PlanRequest r = MoeOnP5(Qwen3MoeEveryOtherDense(), 2, 16 * 4096);
  r.max_context = 1;
  r.max_horizon = 2;
  const Plan plan = PlanLayouts(r);
  ASSERT_NE(plan.best(), nullptr);
  const Candidate& best = *plan.best();
  EXPECT_TRUE(best.reason.empty()) << best.reason;
  EXPECT_LE(best.needed, r.device.Usable());
  EXPECT_GT(best.memory.params, 0);
  const Candidate all = Evaluate(MoeOnP5(Qwen3Moe(), 2, 16 * 4096), best.choice);
  EXPECT_LT(best.step.seconds, all.step.seconds) << Describe(best.choice);
  EXPECT_LT(best.memory.params, all.memory.params) << Describe(best.choice);
}

TEST(LinkFile, RoundTripsAndNamesWhatIsWrong) {
  const std::string path = ::testing::TempDir() + "/links.json";
  {
    std::ofstream(path) << LinkFileJson({{"nvlink", 3e9, 2e-4}, {"cluster", 4e6, 1e-4}}).dump();
  }
  LinkModel links({"kubernetes.io/hostname"});
  ApplyLinkFile(path, &links);
  EXPECT_EQ(links.IntraNode().bytes_per_second, 3e9);
  EXPECT_EQ(links.BetweenNodes(0).bytes_per_second, 4e6);
  EXPECT_EQ(links.BetweenNodes(0).latency_seconds, 1e-4);
  std::ofstream(path) << R"({"links": [{"name": "infiniband", "bytesPerSecond": 1, "latencySeconds": 0}]})";
  try {
    ApplyLinkFile(path, &links);
    FAIL() << "an unknown link was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("links[0]: no link named \"infiniband\""), std::string::npos) << e.what();
  }
  EXPECT_THROW(ApplyLinkFile(path + ".missing", &links), std::runtime_error);
}

}  // namespace
}  // namespace meshtrain::scheduler
