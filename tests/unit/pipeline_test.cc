// The pipeline's split, schedules and bubble model (api/pipeline.h).

#include "api/pipeline.h"

#include <map>
#include <numeric>
#include <set>

#include <gtest/gtest.h>

namespace meshtrain::api {
namespace {

const PipelineSchedule kSchedules[] = {PipelineSchedule::kGPipe, PipelineSchedule::kOneFOneB,
                                       PipelineSchedule::kInterleaved};

TEST(Pipeline, ScheduleNames) {
  for (PipelineSchedule s : kSchedules) EXPECT_EQ(ParsePipelineSchedule(PipelineScheduleName(s)), s);
  EXPECT_THROW(ParsePipelineSchedule("1f1b"), std::invalid_argument);
}

TEST(Pipeline, SplitGivesEveryChunkABlockAndWeighsTheHead) {
  for (const char* preset : {"gpt2-124m", "llama-tiny", "llama3.1-8b"}) {
    const ModelShape shape = *FindPreset(preset);
    for (int chunks = 1; chunks <= shape.layers; ++chunks) {
      const std::vector<int> first = SplitBlocks(shape, 256, chunks);
      ASSERT_EQ(int(first.size()), chunks + 1);
      EXPECT_EQ(first.front(), 0);
      EXPECT_EQ(first.back(), shape.layers);
      for (int c = 0; c < chunks; ++c) EXPECT_GE(first[size_t(c) + 1] - first[size_t(c)], 1) << preset;
    }
  }
  // GPT-2 124M's head (768 x 50257) costs several blocks at 256 tokens: the last stage
  // gets fewer blocks. Llama 3.1 8B's (4096 x 128256) is about two of its 32.
  const std::vector<int> gpt2 = SplitBlocks(*FindPreset("gpt2-124m"), 256, 2);
  EXPECT_GE(gpt2[1], 8);
  const std::vector<int> llama = SplitBlocks(*FindPreset("llama3.1-8b"), 256, 4);
  EXPECT_EQ(llama, (std::vector<int>{0, 9, 18, 26, 32}));
  EXPECT_THROW(SplitBlocks(*FindPreset("llama-tiny"), 256, 99), std::invalid_argument);
}

// Every stage runs a forward and then a backward of every micro-batch through each of
// its chunks, exactly once.
TEST(Pipeline, EveryStageRunsEachOfItsWorkOnce) {
  for (PipelineSchedule schedule : kSchedules) {
    for (int P = 2; P <= 5; ++P) {
      for (int V : schedule == PipelineSchedule::kInterleaved ? std::vector<int>{2, 3} : std::vector<int>{1}) {
        const Pipeline pipeline{P, V, schedule};
        for (int M : {P, 2 * P, 3 * P}) {
          for (int p = 0; p < P; ++p) {
            const std::vector<PipeAction> actions = StageActions(pipeline, p, M);
            ASSERT_EQ(int(actions.size()), 2 * M * V);
            std::set<std::pair<int, int>> forwards;
            for (const PipeAction& a : actions) {
              ASSERT_EQ(a.chunk % P, p);
              if (a.op == PipeOp::kForward) {
                EXPECT_TRUE(forwards.insert({a.micro, a.chunk}).second) << ToString(a);
              } else {
                EXPECT_EQ(forwards.erase({a.micro, a.chunk}), 1u) << ToString(a) << " before its forward";
              }
            }
            EXPECT_TRUE(forwards.empty());
          }
        }
      }
    }
  }
}

TEST(Pipeline, OneFOneBAndGPipeOrders) {
  const Pipeline one{4, 1, PipelineSchedule::kOneFOneB};
  std::string text;
  for (const PipeAction& a : StageActions(one, 1, 4)) text += ToString(a) + " ";
  EXPECT_EQ(text, "F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 B2.1 B3.1 ");
  text.clear();
  for (const PipeAction& a : StageActions(one, 3, 4)) text += ToString(a) + " ";
  EXPECT_EQ(text, "F0.3 B0.3 F1.3 B1.3 F2.3 B2.3 F3.3 B3.3 ");
  text.clear();
  for (const PipeAction& a : StageActions({2, 1, PipelineSchedule::kGPipe}, 0, 3)) text += ToString(a) + " ";
  EXPECT_EQ(text, "F0.0 F1.0 F2.0 B0.0 B1.0 B2.0 ");
  EXPECT_EQ(LanesOf(one, 0, 8), (std::vector<int>{4}));
  EXPECT_EQ(LanesOf(one, 3, 8), (std::vector<int>{1}));
  EXPECT_EQ(LanesOf({4, 1, PipelineSchedule::kGPipe}, 3, 8), (std::vector<int>{8}));
  EXPECT_THROW(StageActions(one, 0, 3), std::invalid_argument);
  EXPECT_THROW(StageActions({2, 2, PipelineSchedule::kInterleaved}, 0, 3), std::invalid_argument);
}

// A stage's program: each receive right before the compute that reads it, each send
// right after the compute that produces it, each compute's first block gathered before
// both; a training forward keeps its last block, released right after it unless its
// backward follows; with one stage, each forward and then its backward whatever the
// schedule; a forward outside training goes through the chunks and keeps nothing.
TEST(Pipeline, ProgramsMakeTheTransfersAndGathersExplicit) {
  auto text = [](const std::vector<PipeAction>& actions) {
    std::string s;
    for (const PipeAction& a : actions) s += ToString(a) + " ";
    return s;
  };
  const Pipeline two{2, 1, PipelineSchedule::kOneFOneB};
  EXPECT_EQ(text(StageProgram(two, 0, 2)),
            "UNSHARD_F0.0 F0.0 RESHARD0.0 SEND_F0.0 UNSHARD_F1.0 F1.0 RESHARD1.0 SEND_F1.0 "
            "UNSHARD_B0.0 RECV_B0.0 B0.0 UNSHARD_B1.0 RECV_B1.0 B1.0 ");
  EXPECT_EQ(text(StageProgram(two, 1, 2)),
            "UNSHARD_F0.1 RECV_F0.1 F0.1 B0.1 SEND_B0.1 UNSHARD_F1.1 RECV_F1.1 F1.1 B1.1 SEND_B1.1 ");
  EXPECT_EQ(text(StageProgram({1, 1, PipelineSchedule::kGPipe}, 0, 2)), "UNSHARD_F0.0 F0.0 B0.0 UNSHARD_F1.0 F1.0 B1.0 ");
  const Pipeline interleaved{2, 2, PipelineSchedule::kInterleaved};
  EXPECT_EQ(text(ForwardProgram(interleaved, 1)), "UNSHARD_F0.1 RECV_F0.1 F0.1 SEND_F0.1 UNSHARD_F0.3 RECV_F0.3 F0.3 ");
  EXPECT_EQ(text(ForwardProgram(interleaved, 0)), "UNSHARD_F0.0 F0.0 SEND_F0.0 UNSHARD_F0.2 RECV_F0.2 F0.2 SEND_F0.2 ");
  for (PipelineSchedule schedule : kSchedules) {
    for (int V : schedule == PipelineSchedule::kInterleaved ? std::vector<int>{2, 3} : std::vector<int>{1}) {
      const Pipeline pipeline{3, V, schedule};
      for (int p = 0; p < 3; ++p) {
        SCOPED_TRACE(testing::Message() << PipelineScheduleName(schedule) << " V " << V << " stage " << p);
        // Every compute action of StageActions is there, in its order.
        std::vector<PipeAction> compute;
        const std::vector<PipeAction> program = StageProgram(pipeline, p, 6);
        for (const PipeAction& a : program) {
          if (a.op == PipeOp::kForward || a.op == PipeOp::kBackward) compute.push_back(a);
        }
        EXPECT_EQ(compute, StageActions(pipeline, p, 6));
        // At most one block is kept, by the forward just run; each compute starts from
        // a block gathered for it or kept for it.
        const PipeAction none{PipeOp::kReshard, -1, -1};
        PipeAction kept = none, gathered = none;
        for (const PipeAction& a : program) {
          const PipeAction key{PipeOp::kReshard, a.micro, a.chunk};
          switch (a.op) {
            case PipeOp::kUnshardForward:
            case PipeOp::kUnshardBackward:
              EXPECT_EQ(kept, none) << ToString(a) << " while a block is kept";
              gathered = a;
              break;
            case PipeOp::kForward:
              EXPECT_EQ(gathered, (PipeAction{PipeOp::kUnshardForward, a.micro, a.chunk})) << ToString(a);
              gathered = none;
              kept = key;
              break;
            case PipeOp::kBackward:
              EXPECT_TRUE((kept == key || gathered == PipeAction{PipeOp::kUnshardBackward, a.micro, a.chunk}))
                  << ToString(a);
              kept = gathered = none;
              break;
            case PipeOp::kReshard:
              EXPECT_EQ(kept, key) << ToString(a);
              kept = none;
              break;
            default: break;
          }
        }
        EXPECT_EQ(kept, none);
      }
    }
  }
}

// No schedule deadlocks, every link's messages come in the order they are wanted, and
// with equal chunks the simulated bubble is the model's: (P-1)/(m+P-1) for 1F1B and
// GPipe, and with interleaving no more than (P-1)/(V m + P-1) plus a slack.
TEST(Pipeline, SchedulesRunAndTheirBubbleIsTheModels) {
  for (PipelineSchedule schedule : kSchedules) {
    for (int P = 2; P <= 6; ++P) {
      for (int V : schedule == PipelineSchedule::kInterleaved ? std::vector<int>{2, 3, 4} : std::vector<int>{1}) {
        const Pipeline pipeline{P, V, schedule};
        for (int M : {P, 2 * P, 4 * P}) {
          SCOPED_TRACE(testing::Message() << PipelineScheduleName(schedule) << " P " << P << " V " << V << " M " << M);
          // A chunk's forward and backward take 1/V of the stage's.
          const PipelineTimeline t = SimulateSchedule(pipeline, M, 1.0 / V, 2.0 / V);
          for (int p = 0; p < P; ++p) {
            EXPECT_NEAR(t.busy[size_t(p)], 3.0 * M, 1e-9);
            if (V == 1) {
              EXPECT_NEAR(t.Bubble(p), BubbleFraction(pipeline, M), 1e-9);
            } else {
              EXPECT_LT(t.Bubble(p), BubbleFraction({P, 1, PipelineSchedule::kOneFOneB}, M));
            }
          }
        }
      }
    }
  }
  EXPECT_NEAR(BubbleFraction({4, 1, PipelineSchedule::kOneFOneB}, 8), 3.0 / 11, 1e-12);
  EXPECT_NEAR(BubbleFraction({4, 2, PipelineSchedule::kInterleaved}, 8), 3.0 / 19, 1e-12);
}

TEST(Pipeline, StageShapes) {
  const ModelShape tiny = *FindPreset("llama-tiny");
  EXPECT_EQ(StageShapeOf(tiny, {}, 0, 4, 64), StageShape{});
  const Pipeline one{2, 1, PipelineSchedule::kOneFOneB};
  const StageShape first = StageShapeOf(tiny, one, 0, 4, 64), last = StageShapeOf(tiny, one, 1, 4, 64);
  EXPECT_TRUE(first.embedding_unit);
  EXPECT_FALSE(first.head);
  EXPECT_EQ(first.lanes.size(), 2u);
  EXPECT_EQ(last.lanes.size(), 1u);
  EXPECT_EQ(last.embedding_unit, tiny.tied);
  EXPECT_TRUE(last.head);
  EXPECT_EQ(first.blocks + last.blocks, tiny.layers);
  // The stages' activation memory: 1F1B's first stage keeps two micro-batches, GPipe's four.
  const ActivationPolicy keep;
  const EngineTypes types{};
  const int64_t one_lane = ActivationStoreBytes(tiny, 2, 64, keep, 0, 1, types, false, last).kept;
  StageShape gpipe = StageShapeOf(tiny, {2, 1, PipelineSchedule::kGPipe}, 1, 4, 64);
  EXPECT_EQ(gpipe.lanes.size(), 4u);
  EXPECT_GT(ActivationStoreBytes(tiny, 2, 64, keep, 0, 1, types, false, gpipe).kept, one_lane);
  // One stage of everything is the unpipelined engine.
  StageShape whole;
  whole.lanes = {int(tiny.layers)};
  EXPECT_EQ(ActivationStoreBytes(tiny, 2, 64, keep, 0, 1, types, false, whole).kept,
            ActivationStoreBytes(tiny, 2, 64, keep, 0, 1, types, false).kept);
}

}  // namespace
}  // namespace meshtrain::api
