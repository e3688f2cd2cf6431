// A pipeline stage's executor (docs/design.md, "Pipeline stages"), after
// torch.distributed.pipelining's schedule runtime: it runs the stage's program
// (api::StageProgram, api::ForwardProgram), a list of actions done one after another:
// a chunk's forward or backward, which the engine computes (ChunkCompute), and the
// receives and sends between neighbouring stages, which the stage does itself.
//
// The stage owns what the transfers need:
//   Lanes: a chunk's first action on a micro-batch takes a free lane of that chunk (the
//     ActivationStore's), which holds the micro-batch's activations, its output and the
//     output's gradient; the chunk's last action on it gives the lane back. A forward
//     waits on the compute stream until the lane's last backward and sends are done.
//   Links: a stream for each of the four links to the neighbours (mesh.h), activations
//     to the next stage and from the previous one, gradients to the previous and from
//     the next. A transfer runs on its link's stream, after the compute stream has
//     produced what it sends (or freed the lane it receives into); the compute stream
//     waits for a receive only right before the action that reads it, and the time it
//     stands waiting is the stage's bubble (CommStats::neighbour_wait).
//   Tokens: the micro-batch whose tokens are on the device; chunk 0's forward and
//     backward and the last chunk's forward load them when another's are there.
// A training forward on the last chunk is followed by the head's gradient reduction
// (ChunkCompute::ReduceHead), and a forward whose backward is the next action keeps its
// last block gathered for it.
// With one stage the program is each micro-batch's forward and then its backward, with
// one lane and no links: the stage adds nothing to the engine's work.
//
// Thread-safety: one thread (the engine's) drives a stage.

#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "api/pipeline.h"
#include "worker/parallel/activation_store.h"
#include "worker/parallel/engine.h"
#include "worker/parallel/mesh.h"
#include "worker/runtime/backend.h"

namespace meshtrain::parallel {

// What the head does at the end of the last chunk's forward: the loss; the loss and its
// backward (training); or the logits of the micro-batch's last position.
enum class HeadWork { kLoss, kTrain, kLogits };

// The chunk-level compute a stage's program calls: the engine's, enqueued on its compute
// stream in call order.
class ChunkCompute {
 public:
  virtual ~ChunkCompute() = default;
  // Copies m's tokens and targets to the device, where chunk 0 and the last chunk read them.
  virtual void LoadTokens(const MicroBatch& m) = 0;
  // Gathers the block chunk c's forward starts with (its first), or its backward (its
  // last) unless a forward kept it (api::PipeOp::kUnshardForward, kUnshardBackward).
  virtual void Unshard(int c, bool forward) = 0;
  // Releases the block the last training forward kept (api::PipeOp::kReshard).
  virtual void Reshard() = 0;
  // Chunk c's forward of m in `lane`, its first block gathered by Unshard: from the
  // lane's input (chunk 0: the tokens' embedding) through the chunk's blocks to the
  // lane's output, and on the last chunk the head's `head` work. `keep`: its last block
  // stays gathered, for the chunk's backward of m or until Reshard.
  virtual void ChunkForward(int c, int lane, const MicroBatch& m, HeadWork head, bool keep) = 0;
  // Right after the last chunk's training forward: the head's gradients are complete,
  // and are reduced (`last`: the step's last micro-batch, so also averaged over the
  // replicas), unless the head is tied and the embedding's backward adds to them here.
  virtual void ReduceHead(bool last) = 0;
  // Chunk c's backward of m in `lane`, its last block gathered by Unshard or kept by
  // its forward: from the gradient of the lane's output, in place,
  // to its input's (chunk 0: the embedding's gradients). `last`: as for ReduceHead.
  virtual void ChunkBackward(int c, int lane, const MicroBatch& m, bool last) = 0;
};

template <class P>
class PipelineStage {
 public:
  using A = typename P::Act;

  // Stage mesh.stage() of `pipeline`, whose chunk c holds blocks [first[c], first[c+1]),
  // with activations of `hidden` channels for micro-batches of up to `max_tokens`
  // tokens in the lanes of `store`: as many as a step of `micro_batches` needs
  // (api::StageShapeOf). Compute on `compute`. Throws std::logic_error when the store
  // has another number of lanes. REQUIRES: mesh, backend, compute and store outlive the
  // stage.
  PipelineStage(const api::Pipeline& pipeline, std::vector<int> first, int micro_batches, const Mesh& mesh,
                int hidden, int64_t max_tokens, runtime::Backend& backend, runtime::Stream& compute,
                const ActivationStore<P>& store);

  // The training forward and backward of every micro-batch, as api::StageProgram orders
  // them. Throws what StageProgram does for a number of micro-batches the schedule
  // cannot take, and std::logic_error, before any work, when a chunk would need more
  // lanes than the store has.
  void Train(ChunkCompute& compute, const std::vector<MicroBatch>& micro_batches);
  // A forward of m through the stage's chunks, not training (api::ForwardProgram).
  // REQUIRES: head is not kTrain.
  void Forward(ChunkCompute& compute, const MicroBatch& m, HeadWork head);

  // The links' streams (none with one stage).
  std::vector<runtime::Stream*> streams() const;
  // Adds the links' seconds sending and receiving and the compute stream's waiting for
  // receives to `stats`. REQUIRES: the streams are synchronized.
  void AddStats(CommStats* stats) const;
  // "; stage 1 of 2 (1F1B): blocks 2-3 and the head, 2 activation lanes", with
  // `embedding` (the stage holds the embedding's unit or a tied head's copy of it);
  // empty for one stage.
  std::string Describe(bool embedding) const;

 private:
  // Runs `program` on micro_batches, the head doing `head`.
  void Run(ChunkCompute& compute, const std::vector<api::PipeAction>& program,
           const std::vector<MicroBatch>& micro_batches, HeadWork head);
  // The lane of each action of `program`, and whether it is the last on its lane. Throws
  // std::logic_error when a chunk has no free lane for one.
  struct Placed {
    int lane = 0;
    bool frees = false;
  };
  std::vector<Placed> Place(const std::vector<api::PipeAction>& program) const;
  // Moves n activations over `link` on `stream` (send or receive) once `after` has
  // happened; `done` marks the end.
  void Transfer(bool send, const Mesh::StageLink& link, runtime::DevicePtr<A> data, int64_t n,
                runtime::Stream& stream, runtime::Event& after, runtime::Event& done);
  // The compute stream waits for a receive, timed as neighbour wait.
  void WaitNeighbour(runtime::Event& received);

  api::Pipeline pipeline_;
  std::vector<int> first_, chunks_;  // every chunk's first block (and L); this stage's chunks
  std::vector<int> lane_base_;       // the first lane of each of this stage's chunks, and the end
  const Mesh& mesh_;
  int hidden_;
  runtime::Stream& compute_;
  const ActivationStore<P>& store_;
  bool linked_;  // more than one stage: the links, the lanes' events
  std::unique_ptr<runtime::Stream> send_next_, recv_prev_, send_prev_, recv_next_;
  std::unique_ptr<runtime::StreamTimer> neighbour_wait_;
  // Per lane: its last backward (and the send of its input's gradient) is done, or a
  // forward outside training has read it; its output has been sent; a transfer into it
  // has arrived. And the compute stream's mark before a send.
  std::vector<std::unique_ptr<runtime::Event>> lane_free_, lane_sent_, received_;
  std::unique_ptr<runtime::Event> produced_;
};

}  // namespace meshtrain::parallel
