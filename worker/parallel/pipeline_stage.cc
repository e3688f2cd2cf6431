#include "worker/parallel/pipeline_stage.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <utility>

#include "worker/comm/stream_collectives.h"
#include "worker/kernels/precision.h"

namespace meshtrain::parallel {
namespace {

using Key = std::pair<int, int>;  // (micro-batch, chunk): what a lane holds

Key KeyOf(const api::PipeAction& a) { return {a.micro, a.chunk}; }

// The index of each (micro-batch, chunk)'s last action in `program`.
std::map<Key, size_t> LastActions(const std::vector<api::PipeAction>& program) {
  std::map<Key, size_t> last;
  for (size_t i = 0; i < program.size(); ++i) last[KeyOf(program[i])] = i;
  return last;
}

// The most micro-batches each of a stage's `chunks` holds at once in `program`, from
// their first action to their last.
std::vector<int> LanesNeeded(const std::vector<api::PipeAction>& program, int stages, int chunks) {
  const std::map<Key, size_t> last = LastActions(program);
  std::vector<int> live(size_t(chunks), 0), most(size_t(chunks), 0);
  std::map<Key, bool> started;
  for (size_t i = 0; i < program.size(); ++i) {
    const size_t v = size_t(program[i].chunk / stages);
    if (!started[KeyOf(program[i])]) {
      started[KeyOf(program[i])] = true;
      most[v] = std::max(most[v], ++live[v]);
    }
    if (last.at(KeyOf(program[i])) == i) --live[v];
  }
  return most;
}

}  // namespace

template <class P>
PipelineStage<P>::PipelineStage(const api::Pipeline& pipeline, std::vector<int> first, int micro_batches,
                                const Mesh& mesh, int hidden, int64_t max_tokens, runtime::Backend& backend,
                                runtime::Stream& compute, const ActivationStore<P>& store)
    : pipeline_(pipeline),
      first_(std::move(first)),
      chunks_(api::ChunksOf(pipeline, mesh.stage())),
      mesh_(mesh),
      hidden_(hidden),
      compute_(compute),
      store_(store),
      linked_(pipeline.stages > 1),
      neighbour_wait_(backend.NewTimer()),
      produced_(backend.NewEvent()) {
  lane_base_.push_back(0);
  const std::vector<api::PipeAction> program = api::StageProgram(pipeline_, mesh_.stage(), std::max(micro_batches, 1));
  for (int lanes : LanesNeeded(program, pipeline_.stages, int(chunks_.size()))) {
    lane_base_.push_back(lane_base_.back() + lanes);
  }
  if (lane_base_.back() != store_.lanes()) {
    throw std::logic_error("pipeline stage " + std::to_string(mesh_.stage()) + ": its schedule needs " +
                           std::to_string(lane_base_.back()) + " activation lanes, the store has " +
                           std::to_string(store_.lanes()));
  }
  if (!linked_) return;
  send_next_ = backend.NewStream("send to the next stage");
  recv_prev_ = backend.NewStream("receive from the previous stage");
  send_prev_ = backend.NewStream("send to the previous stage");
  recv_next_ = backend.NewStream("receive from the next stage");
  for (int lane = 0; lane < store_.lanes(); ++lane) {
    for (auto* events : {&lane_free_, &lane_sent_, &received_}) events->push_back(backend.NewEvent());
  }
  // What a transfer moves at most, so that none allocates in a step.
  for (const Mesh::StageLink& link : {mesh_.send_next(), mesh_.recv_prev(), mesh_.send_prev(), mesh_.recv_next()}) {
    if (link.group != nullptr) link.group->Reserve(size_t(max_tokens * hidden) * sizeof(A));
  }
}

template <class P>
void PipelineStage<P>::Train(ChunkCompute& compute, const std::vector<MicroBatch>& micro_batches) {
  Run(compute, api::StageProgram(pipeline_, mesh_.stage(), int(micro_batches.size())), micro_batches,
      HeadWork::kTrain);
}

template <class P>
void PipelineStage<P>::Forward(ChunkCompute& compute, const MicroBatch& m, HeadWork head) {
  Run(compute, api::ForwardProgram(pipeline_, mesh_.stage()), {m}, head);
}

template <class P>
std::vector<typename PipelineStage<P>::Placed> PipelineStage<P>::Place(
    const std::vector<api::PipeAction>& program) const {
  // Each chunk's free lanes, the lowest taken first, and a freed lane the next.
  std::vector<std::vector<int>> free(chunks_.size());
  for (size_t v = 0; v < chunks_.size(); ++v) {
    for (int lane = lane_base_[v + 1] - 1; lane >= lane_base_[v]; --lane) free[v].push_back(lane);
  }
  const std::map<Key, size_t> last = LastActions(program);
  std::map<Key, int> lane_of;
  std::vector<Placed> placed(program.size());
  for (size_t i = 0; i < program.size(); ++i) {
    const Key key = KeyOf(program[i]);
    const size_t v = size_t(program[i].chunk / pipeline_.stages);
    auto it = lane_of.find(key);
    if (it == lane_of.end()) {
      if (free[v].empty()) {
        throw std::logic_error("pipeline stage " + std::to_string(mesh_.stage()) + ": no free activation lane for " +
                               api::ToString(program[i]) + " (chunk " + std::to_string(program[i].chunk) + " has " +
                               std::to_string(lane_base_[v + 1] - lane_base_[v]) +
                               "; the engine was built for fewer micro-batches)");
      }
      it = lane_of.emplace(key, free[v].back()).first;
      free[v].pop_back();
    }
    placed[i] = {it->second, last.at(key) == i};
    if (placed[i].frees) {
      free[v].push_back(it->second);
      lane_of.erase(it);
    }
  }
  return placed;
}

template <class P>
void PipelineStage<P>::Run(ChunkCompute& compute, const std::vector<api::PipeAction>& program,
                           const std::vector<MicroBatch>& micro_batches, HeadWork head) {
  using api::PipeOp;
  const std::vector<Placed> placed = Place(program);  // throws before any work
  const int C = pipeline_.chunks(), M = int(micro_batches.size());
  const bool train = head == HeadWork::kTrain;
  int loaded = -1;  // the micro-batch whose tokens are on the device
  for (size_t i = 0; i < program.size(); ++i) {
    const api::PipeAction& a = program[i];
    const MicroBatch& m = micro_batches[size_t(a.micro)];
    const size_t lane = size_t(placed[i].lane);
    const int64_t n = int64_t(m.B) * m.T * hidden_;
    const bool last = a.micro + 1 == M;
    const bool reads_tokens = (a.op == PipeOp::kForward && (a.chunk == 0 || a.chunk + 1 == C)) ||
                              (a.op == PipeOp::kBackward && a.chunk == 0);
    if (reads_tokens && loaded != a.micro) {
      compute.LoadTokens(m);
      loaded = a.micro;
    }
    switch (a.op) {
      case PipeOp::kRecvActivation:
        Transfer(false, mesh_.recv_prev(), store_.Input(0, int(lane)), n, *recv_prev_, *lane_free_[lane],
                 *received_[lane]);
        WaitNeighbour(*received_[lane]);
        break;
      case PipeOp::kForward: {
        if (linked_) {  // the lane's last micro-batch is done with it
          compute_.Wait(*lane_free_[lane]);
          compute_.Wait(*lane_sent_[lane]);
        }
        compute.ChunkForward(a.chunk, int(lane), m, head, /*keep=*/train);
        if (train && a.chunk + 1 == C) compute.ReduceHead(last);
        // Outside training the lane is free once the forward has read it (its output
        // leaves on the send, which the next forward in the lane waits for).
        if (!train && linked_) lane_free_[lane]->Record(compute_);
        break;
      }
      case PipeOp::kSendActivation:
        produced_->Record(compute_);
        Transfer(true, mesh_.send_next(), store_.Output(int(lane)), n, *send_next_, *produced_, *lane_sent_[lane]);
        break;
      case PipeOp::kRecvGradient:
        Transfer(false, mesh_.recv_next(), store_.Gradient(int(lane)), n, *recv_next_, *lane_free_[lane],
                 *received_[lane]);
        WaitNeighbour(*received_[lane]);
        break;
      case PipeOp::kBackward:
        compute.ChunkBackward(a.chunk, int(lane), m, last);
        if (a.chunk == 0 && linked_) lane_free_[lane]->Record(compute_);
        break;
      case PipeOp::kSendGradient:
        produced_->Record(compute_);
        Transfer(true, mesh_.send_prev(), store_.Gradient(int(lane)), n, *send_prev_, *produced_, *lane_free_[lane]);
        break;
      case PipeOp::kUnshardForward:
      case PipeOp::kUnshardBackward: compute.Unshard(a.chunk, a.op == PipeOp::kUnshardForward); break;
      case PipeOp::kReshard: compute.Reshard(); break;
    }
  }
}

template <class P>
void PipelineStage<P>::Transfer(bool send, const Mesh::StageLink& link, runtime::DevicePtr<A> data, int64_t n,
                                runtime::Stream& stream, runtime::Event& after, runtime::Event& done) {
  if (link.group == nullptr) {
    throw std::logic_error("stage " + std::to_string(mesh_.stage()) + " has no link to " + (send ? "send" : "receive") +
                           " on");
  }
  stream.Wait(after);
  if (send) {
    comm::Send<A>(*link.group, runtime::DevicePtr<const A>(data), size_t(n), link.peer, stream);
  } else {
    comm::Recv<A>(*link.group, data, size_t(n), link.peer, stream);
  }
  done.Record(stream);
}

template <class P>
void PipelineStage<P>::WaitNeighbour(runtime::Event& received) {
  neighbour_wait_->Begin(compute_);
  compute_.Wait(received);
  neighbour_wait_->End(compute_);
}

template <class P>
std::vector<runtime::Stream*> PipelineStage<P>::streams() const {
  std::vector<runtime::Stream*> streams;
  for (runtime::Stream* link : {send_next_.get(), recv_prev_.get(), send_prev_.get(), recv_next_.get()}) {
    if (link != nullptr) streams.push_back(link);
  }
  return streams;
}

template <class P>
void PipelineStage<P>::AddStats(CommStats* stats) const {
  for (const Mesh::StageLink& link : {mesh_.send_next(), mesh_.send_prev()}) {
    if (link.group != nullptr) stats->send += link.group->Seconds().send;
  }
  for (const Mesh::StageLink& link : {mesh_.recv_prev(), mesh_.recv_next()}) {
    if (link.group != nullptr) stats->recv += link.group->Seconds().recv;
  }
  stats->neighbour_wait += neighbour_wait_->Seconds();
}

template <class P>
std::string PipelineStage<P>::Describe(bool embedding) const {
  if (!linked_) return "";
  const int stage = mesh_.stage();
  std::string text = "; stage " + std::to_string(stage) + " of " + std::to_string(mesh_.stages()) + " (" +
                     api::PipelineScheduleName(pipeline_.schedule) + "): blocks";
  for (int c : chunks_) text += " " + std::to_string(first_[size_t(c)]) + "-" + std::to_string(first_[size_t(c) + 1] - 1);
  if (embedding) text += stage == 0 ? " and the embedding" : " and a copy of the tied embedding";
  if (stage + 1 == mesh_.stages()) text += " and the head";
  return text + ", " + std::to_string(store_.lanes()) + " activation lanes";
}

template class PipelineStage<kernels::Fp32>;
template class PipelineStage<kernels::Bf16>;
template class PipelineStage<kernels::Fp64>;

}  // namespace meshtrain::parallel
