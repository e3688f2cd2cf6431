// The layout planner: its step model's schedule, the search, and what it refuses.

#include "operator/scheduler/planner.h"

#include <fstream>

#include <gtest/gtest.h>

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
    EXPECT_EQ(r.global_batch_tokens % (int64_t(c.choice.micro_batch) * r.seq * (4 / c.choice.tp)), 0);
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
