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
    EXPECT_EQ(c.needed, PredictMemory(kShape, 64, c.choice, 4, /*cpu_kernels=*/true, /*dropout=*/false).total());
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
