// The pipeline (docs/design.md, "Pipeline stages"): how a model's blocks split into
// chunks, which stage holds which, and the order of each stage's work under each
// schedule. Each stage's executor (worker/parallel/pipeline_stage.h) runs its
// StageProgram: StageActions with the sends and receives between stages made explicit;
// the planner models the same schedule.
//
// P stages, V chunks a stage (virtual stages), C = P x V chunks of consecutive blocks.
// Chunk c runs on stage c % P: stage p holds chunks p, p + P, ..., so a micro-batch
// visits the stages V times in turn. Chunk 0 also holds the embedding, chunk C - 1 the
// head. Each step's M micro-batches flow through the chunks as the schedule orders them:
//   GPipe            every forward, then every backward.
//   1F1B             P - 1 - p forwards to fill the pipeline, then one forward and one
//                    backward in turn, then the backwards left (Megatron's, torchtitan's).
//   Interleaved1F1B  1F1B over V chunks a stage (Megatron's interleaved schedule): a
//                    stage's forwards go P micro-batches through chunk 0, the same P
//                    through chunk 1, and so on; M must be a multiple of P.
// On every link between neighbouring stages, the sender's messages come in the order
// the receiver consumes them (SimulateSchedule checks that).
// Thread-safety: pure functions.

#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "api/engine_memory.h"
#include "api/model_shape.h"
#include "api/training_job.h"

namespace meshtrain::api {

enum class PipelineSchedule { kGPipe, kOneFOneB, kInterleaved };
// "GPipe", "1F1B", "Interleaved1F1B"; throws std::invalid_argument for another name.
PipelineSchedule ParsePipelineSchedule(const std::string& name);
const char* PipelineScheduleName(PipelineSchedule schedule);

struct Pipeline {
  int stages = 1;          // P
  int virtual_stages = 1;  // V
  PipelineSchedule schedule = PipelineSchedule::kOneFOneB;
  int chunks() const { return stages * virtual_stages; }
  bool operator==(const Pipeline&) const = default;
  // spec.parallelism's pipeline fields. REQUIRES: they are valid.
  static Pipeline Of(const ParallelismSpec& parallelism);
};

// The first block of each of `chunks` chunks, and L after the last: chunk c holds blocks
// [first[c], first[c + 1]). Every chunk gets at least one block; the others go one at a
// time where they leave the costliest chunk cheapest, the last chunk counting the head's
// FLOPs at `seq` tokens (a vocabulary x hidden product, several blocks' worth in a small
// model) and the first the embedding's (none). REQUIRES: 1 <= chunks <= shape.layers.
std::vector<int> SplitBlocks(const ModelShape& shape, int64_t seq, int chunks);

// The chunks stage `stage` runs, in order: stage, stage + P, ...
std::vector<int> ChunksOf(const Pipeline& pipeline, int stage);

// A stage's work on micro-batch `micro` in chunk `chunk`: its forward or backward, a
// transfer between neighbouring stages (torch.distributed.pipelining's SEND_F, RECV_F,
// SEND_B, RECV_B), or FSDP's gather and release at the chunk's edges (its UNSHARD and
// RESHARD):
//   kRecvActivation  chunk's input (chunk - 1's output), from chunk - 1's stage;
//   kSendActivation  chunk's output, to chunk + 1's stage;
//   kRecvGradient    the gradient of chunk's output, from chunk + 1's stage;
//   kSendGradient    the gradient of chunk's input, to chunk - 1's stage;
//   kUnshardForward  gathers the block the chunk's forward of `micro` starts with (its
//                    first); the forward gathers the others as it goes, a block ahead;
//   kUnshardBackward gathers the block its backward starts with (its last), where it is
//                    not still gathered: a training forward keeps its last block;
//   kReshard         releases the block the chunk's training forward of `micro` kept,
//                    when its backward does not come next.
enum class PipeOp {
  kForward,
  kBackward,
  kRecvActivation,
  kSendActivation,
  kRecvGradient,
  kSendGradient,
  kUnshardForward,
  kUnshardBackward,
  kReshard
};
struct PipeAction {
  PipeOp op = PipeOp::kForward;
  int micro = 0;  // the micro-batch, 0 .. M-1
  int chunk = 0;  // global, 0 .. C-1
  bool operator==(const PipeAction&) const = default;
};
// "F3.1" (the forward of micro-batch 3 through chunk 1), "B0.0", for transfers
// "RECV_F3.1", "SEND_F3.1", "RECV_B3.1", "SEND_B3.1", and "UNSHARD_F3.1", "UNSHARD_B3.1",
// "RESHARD3.1".
std::string ToString(const PipeAction& action);

// Stage `stage`'s training work for a step of `micro_batches`, in order: a forward and a
// backward of each micro-batch through each of its chunks. REQUIRES: micro_batches >= P,
// and a multiple of P for Interleaved1F1B.
std::vector<PipeAction> StageActions(const Pipeline& pipeline, int stage, int micro_batches);

// `compute` (forwards and backwards of a C-chunk pipeline) with the transfers and the
// gathers and releases they need: each receive right before the compute that reads it,
// each send right after the compute that produces it. Chunk 0 receives no activation and
// sends no gradient; chunk C - 1 sends no activation and receives no gradient. Each
// compute's first block is gathered before all of that (so that the gather overlaps the
// wait for a neighbour), but a backward's that directly follows its forward (kept); with
// `training`, a forward's kept block is released right after it unless its backward
// follows.
std::vector<PipeAction> WithTransfers(const Pipeline& pipeline, const std::vector<PipeAction>& compute,
                                      bool training);

// What stage `stage` runs for a training step of `micro_batches`: StageActions with their
// transfers. With one stage, whatever the schedule, each micro-batch's forward and then
// its backward. REQUIRES: as StageActions.
std::vector<PipeAction> StageProgram(const Pipeline& pipeline, int stage, int micro_batches);

// What stage `stage` runs for a forward outside training: micro-batch 0's forward through
// each of its chunks in order, with their transfers.
std::vector<PipeAction> ForwardProgram(const Pipeline& pipeline, int stage);

// The most micro-batches of each of the stage's chunks (ChunksOf order) between their
// forward and their backward: the activation lanes the stage keeps.
std::vector<int> LanesOf(const Pipeline& pipeline, int stage, int micro_batches);

// Runs every stage's actions with a forward taking `forward` and a backward `backward`
// seconds on every chunk, each waiting for the action it needs (the same micro-batch's
// forward on the chunk before, or its backward on the chunk after) and communication
// free. Throws std::logic_error naming the stuck actions when the schedule deadlocks, or
// when a link's messages would come in another order than the receiver consumes them.
struct PipelineTimeline {
  double makespan = 0;
  std::vector<double> busy;  // each stage's seconds of work
  // The stage's idle share of the makespan (the bubble).
  double Bubble(int stage) const { return makespan > 0 ? 1 - busy[size_t(stage)] / makespan : 0; }
};
PipelineTimeline SimulateSchedule(const Pipeline& pipeline, int micro_batches, double forward, double backward);

// What stage `stage` holds and keeps activations for, for a step of `micro_batches` of
// `seq` tokens: the blocks of its chunks, a lane per micro-batch in flight on a chunk
// (LanesOf), the embedding's unit on the first stage (and for a tied head the last's
// copy), the head on the last. The whole model for P = 1.
StageShape StageShapeOf(const ModelShape& shape, const Pipeline& pipeline, int stage, int micro_batches, int64_t seq);

// The schedule model of the bubble: (P - 1) / (V x M + P - 1), the share of a step a
// stage idles while the pipeline fills and drains (1F1B and GPipe: V = 1).
double BubbleFraction(const Pipeline& pipeline, int micro_batches);

}  // namespace meshtrain::api
