#include "operator/scheduler/cost_model.h"

#include <algorithm>

#include <gtest/gtest.h>

#include "api/defaults.h"
#include "api/engine_memory.h"
#include "api/manifest.h"

namespace meshtrain::scheduler {
namespace {

const std::vector<std::string> kLevels = {"l1", "l2", "l3", "kubernetes.io/hostname"};

api::TrainingJobSpec Spec(int nodes, int gpus, int tp, int shard) {
  api::TrainingJob job = api::LoadTrainingJobs("examples/gpt2-tiny-local.yaml").at(0).job;
  job.spec.nodes = nodes;
  job.spec.gpus_per_node = gpus;
  job.spec.resources.gpu = gpus;
  job.spec.parallelism.tensor_parallel_degree = tp;
  job.spec.parallelism.hybrid_shard_degree = shard;
  job.spec.model.heads = 8;
  job.spec.training.micro_batch_size = 1;
  job.spec.training.global_batch_tokens = 128 * nodes * gpus / tp;  // one micro-step
  return job.spec;
}

TEST(CostModel, ReplicaAllReduceMatchesTheRingFormula) {
  // Two nodes of one GPU, no TP, no sharding: one replica group across the two nodes,
  // which share a layer-3 domain: 2(n-1) x (15 us + (4P/n) / 40 GB/s), P = 842496.
  const StepCost cost = EstimateStepCost(Spec(2, 1, 1, 1), {{"a", "b", "c", "n0"}, {"a", "b", "c", "n1"}}, LinkModel(kLevels));
  const double expected = 2 * (15e-6 + 4.0 * 842496 / 2 / 40e9);
  EXPECT_NEAR(cost.seconds, expected, 1e-12);
  ASSERT_EQ(cost.axes.size(), 3u);
  for (const AxisCost& axis : cost.axes) {
    if (axis.axis == "replica") EXPECT_EQ(axis.groups_by_link.at("within l3"), 1);
    else EXPECT_EQ(axis.seconds, 0) << axis.axis;
  }
}

TEST(CostModel, GroupsUseTheSlowestLinkTheySpan) {
  // 2 nodes x 8 GPUs, TP 8, shard 2: TP groups stay in a node, shard groups span both nodes.
  // A GPT-2 124M-sized model, so that the shard collectives are bandwidth-bound.
  api::TrainingJobSpec spec = Spec(2, 8, 8, 2);
  spec.model.layers = 12, spec.model.heads = 16, spec.model.hidden = 768, spec.model.vocab_size = 50257;
  const LinkModel links(kLevels);
  const StepCost near = EstimateStepCost(spec, {{"a", "b", "c", "n0"}, {"a", "b", "c", "n1"}}, links);
  const StepCost far = EstimateStepCost(spec, {{"a", "b", "c", "n0"}, {"z", "y", "x", "n1"}}, links);
  EXPECT_EQ(near.axes[0].axis, "tp");
  EXPECT_EQ(near.axes[0].groups_by_link.at("nvlink"), 2);
  EXPECT_EQ(near.axes[1].axis, "shard");
  EXPECT_EQ(near.axes[1].groups_by_link.at("within l3"), 8);
  EXPECT_EQ(far.axes[1].groups_by_link.at("cluster"), 8);
  EXPECT_EQ(far.axes[0].seconds, near.axes[0].seconds);
  EXPECT_GT(far.axes[1].seconds, 5 * near.axes[1].seconds);  // 40 vs 6.25 GB/s, bandwidth-bound
}

// A stage on each node: shard groups stay inside the node with part of the model each (the
// split balances FLOPs, so the head's stage holds fewer blocks; a tied head's stage keeps
// a copy of the embedding), and only activations and their gradients cross between the
// nodes, one message each way per micro-step: 2 x (15 us + microBatch x seqLen x hidden x
// 4 / 40 GB/s).
TEST(CostModel, StagesSendOnlyActivationsBetweenTheirNodes) {
  api::TrainingJobSpec spec = Spec(2, 8, 1, 8);
  spec.model.layers = 12, spec.model.hidden = 768, spec.model.vocab_size = 50257;
  const std::vector<std::vector<std::string>> paths = {{"a", "b", "c", "n0"}, {"a", "b", "c", "n1"}};
  const StepCost flat = EstimateStepCost(spec, paths, LinkModel(kLevels));
  spec.parallelism.hybrid_shard_degree = 0;
  spec.parallelism.pipeline_parallel_degree = 2;
  spec.training.global_batch_tokens = 128 * 8 * 2;  // two micro-steps of the 8 ranks of a stage
  const StepCost staged = EstimateStepCost(spec, paths, LinkModel(kLevels));
  ASSERT_EQ(staged.axes.size(), 4u);
  EXPECT_EQ(staged.axes[1].axis, "shard");
  EXPECT_EQ(staged.axes[1].groups_by_link.at("nvlink"), 2);
  EXPECT_LT(staged.axes[1].seconds / 2, 0.9 * flat.axes[1].seconds);  // per micro-step
  EXPECT_EQ(staged.axes[3].axis, "pipeline");
  EXPECT_EQ(staged.axes[3].groups_by_link.at("within l3"), 8);
  EXPECT_NEAR(staged.axes[3].seconds, 2 * 2 * (15e-6 + 128.0 * 768 * 4 / 40e9), 1e-12);
}

// One node of 8 GPUs, C = 4 (two context groups over NVLink): each block's ring pass of
// the sequence's keys and values forward, and backward those again and their fp32
// gradients, every micro-step; and the TP messages of a rank's seq / C rows.
TEST(CostModel, ContextGroupsExchangeEachBlocksKeysAndValues) {
  api::TrainingJobSpec spec = Spec(1, 8, 2, 0);
  spec.model.layers = 12, spec.model.hidden = 768, spec.model.heads = 8;
  const std::vector<std::vector<std::string>> paths = {{"a", "b", "c", "n0"}};
  const StepCost plain = EstimateStepCost(spec, paths, LinkModel(kLevels));
  spec.parallelism.context_parallel_degree = 4;
  const StepCost split = EstimateStepCost(spec, paths, LinkModel(kLevels));
  ASSERT_EQ(split.axes.size(), 4u);
  EXPECT_EQ(split.axes[3].axis, "context");
  EXPECT_EQ(split.axes[3].groups_by_link.at("nvlink"), 2);
  // Micro-steps: 512 tokens / (128 x 1 data-parallel rank) = 4 (1 without context).
  const api::ParallelLayout mesh = api::ParallelLayout::ForSpec(spec);
  const LinkModel links(kLevels);
  const double kv = 128.0 * 2 * 768 / 2 * 4;  // the sequence's K and V on a TP rank, fp32
  const double step = 3e-6 + kv / 4 / 360e9;   // NVLink
  EXPECT_NEAR(split.axes[3].seconds, 4 * 12 * (3 * step + 3 * step + 4 * step), 1e-12);
  // TP: 4 all-reduces a block and micro-step, of a rank's 32 rows.
  const double rows = 32.0 * 768 * 4;
  const double all_reduce = CollectiveSeconds(Collective::kAllReduce, rows, {0, 1}, mesh, paths, links);
  EXPECT_NEAR(split.axes[0].seconds, 4 * 4 * 12 * all_reduce, 1e-12);
  EXPECT_EQ(plain.axes.size(), 3u);
}

// Qwen3-30B-A3B on 2 nodes of 8 GPUs, S = 16, one sequence of 4096 a rank: EP = 8 splits
// each block's 128 experts over a node's ranks. Each MoE block sends a rank's 4096 x 8
// copies of 2048 bf16 to their experts and back, forward and backward (4 all-to-alls of
// 7 steps over NVLink), and sums its shared part's gradients over the group; the blocks'
// gathers and reduce-scatters run over the 2 ranks holding the same experts (r, r + 8).
TEST(CostModel, ExpertGroupsAllToAllEachMoeBlocksTokens) {
  api::TrainingJobSpec spec = api::LoadTrainingJobs("examples/qwen3-moe-30b-a3b-auto.yaml").at(0).job.spec;
  spec.parallelism.mode = "manual";
  spec.parallelism.hybrid_shard_degree = 0;
  spec.training.micro_batch_size = 1;
  spec.training.global_batch_tokens = 16 * 4096;
  const std::vector<std::vector<std::string>> paths = {{"a", "b", "c", "n0"}, {"a", "b", "c", "n1"}};
  const LinkModel links(kLevels);
  const StepCost plain = EstimateStepCost(spec, paths, links);
  ASSERT_EQ(plain.axes.size(), 3u);
  spec.parallelism.expert_parallel_degree = 8;
  const StepCost split = EstimateStepCost(spec, paths, links);
  ASSERT_EQ(split.axes.size(), 5u);
  EXPECT_EQ(split.axes[3].axis, "expert-shard");
  EXPECT_EQ(split.axes[3].groups_by_link.at("within l3"), 8);
  EXPECT_EQ(split.axes[4].axis, "expert");
  EXPECT_EQ(split.axes[4].groups_by_link.at("nvlink"), 2);
  const api::ModelShape shape = api::ShapeOf(spec.model);
  const double rows = 4096.0 * 8 * 2048 * 2;
  const ExpertTraffic traffic = ExpertTrafficOf(shape, 1, 4096, 8, 2);
  EXPECT_DOUBLE_EQ(traffic.forward_sent, 2 * rows * 7 / 8);
  EXPECT_DOUBLE_EQ(traffic.backward_sent, 2 * rows * 7 / 8);
  const api::UnitElements units = api::UnitElementsOf(shape, 0, 1, api::kVocabMultiple, 8);
  const double alike = std::min(double(api::ShardElements(units.block, 2)), double(units.block_shared()));
  const api::ParallelLayout mesh = api::ParallelLayout::ForSpec(spec);
  const double shared = CollectiveSeconds(Collective::kAllReduce, 4 * alike, {0, 1, 2, 3, 4, 5, 6, 7}, mesh, paths, links);
  EXPECT_NEAR(split.axes[4].seconds, 48 * (4 * 7 * (3e-6 + rows / 8 / 360e9) + shared), 1e-9);
  // The shard group gathers only the embedding's and the head's units now.
  EXPECT_LT(split.axes[1].seconds, 0.5 * plain.axes[1].seconds);
  // EP = 16 spans both nodes: its all-to-alls go over the network.
  spec.parallelism.expert_parallel_degree = 16;
  const StepCost wide = EstimateStepCost(spec, paths, links);
  EXPECT_EQ(wide.axes[4].groups_by_link.at("within l3"), 1);
  EXPECT_GT(wide.axes[4].seconds, 4 * split.axes[4].seconds);
  // Nothing for a dense model or EP = 1.
  EXPECT_TRUE(ExpertTrafficOf(shape, 1, 4096, 1, 2).forward.empty());
  EXPECT_TRUE(ExpertTrafficOf(*api::FindPreset("llama3.1-8b"), 1, 4096, 8, 2).forward.empty());
}

// Qwen3-30B-A3B at T = 2 (EP = 4, one sequence of 4096 a rank): each block's TP group
// all-reduces the rank's rows four times, as a dense block's, and all-gathers the routing
// weights' gradients (4096 x 8 fp32 a rank); its all-to-alls carry the same rows as at
// T = 1, every TP rank routing the same tokens.
TEST(CostModel, TensorParallelMoeBlocksAddTheirRoutingGradients) {
  api::TrainingJobSpec spec = api::LoadTrainingJobs("examples/qwen3-moe-30b-a3b-auto.yaml").at(0).job.spec;
  spec.parallelism.mode = "manual";
  spec.parallelism.tensor_parallel_degree = 2;
  spec.parallelism.hybrid_shard_degree = 0;
  spec.parallelism.expert_parallel_degree = 4;
  spec.training.micro_batch_size = 1;
  spec.training.global_batch_tokens = 8 * 4096;  // one micro-step
  const std::vector<std::vector<std::string>> paths = {{"a", "b", "c", "n0"}, {"a", "b", "c", "n1"}};
  const LinkModel links(kLevels);
  const StepCost cost = EstimateStepCost(spec, paths, links);
  ASSERT_EQ(cost.axes[0].axis, "tp");
  const api::ParallelLayout mesh = api::ParallelLayout::ForSpec(spec);
  const double all_reduce = CollectiveSeconds(Collective::kAllReduce, 4096.0 * 2048 * 2, {0, 1}, mesh, paths, links);
  const double all_gather = CollectiveSeconds(Collective::kAllGather, 4096.0 * 8 * 4 * 2, {0, 1}, mesh, paths, links);
  EXPECT_GT(all_gather, 0);
  EXPECT_NEAR(cost.axes[0].seconds, 48 * (4 * all_reduce + all_gather), 1e-12);
  const api::ModelShape shape = api::ShapeOf(spec.model);
  EXPECT_DOUBLE_EQ(ExpertTrafficOf(shape, 1, 4096, 4, 2).forward_sent, 2 * 4096.0 * 8 * 2048 * 2 * 3 / 4);
}

TEST(CostModel, OverridesReplaceALink) {
  const api::TrainingJobSpec spec = Spec(2, 1, 1, 1);
  const std::vector<std::vector<std::string>> paths = {{"a", "b", "c", "n0"}, {"a", "b", "d", "n1"}};
  LinkModel links(kLevels);
  EXPECT_EQ(links.BetweenNodes(2).name, "within l2");
  const double before = EstimateStepCost(spec, paths, links).seconds;
  EXPECT_TRUE(links.Override("l2", 50e9, 25e-6));  // twice the default 25 GB/s
  const double after = EstimateStepCost(spec, paths, links).seconds;
  EXPECT_LT(after, before);
  EXPECT_NEAR(after, 2 * (25e-6 + 4.0 * 842496 / 2 / 50e9), 1e-12);
  EXPECT_TRUE(links.Override("nvlink", 900e9, 2e-6));
  EXPECT_TRUE(links.Override("cluster", 1e9, 1e-4));
  EXPECT_FALSE(links.Override("l9", 1, 1));
}

}  // namespace
}  // namespace meshtrain::scheduler
