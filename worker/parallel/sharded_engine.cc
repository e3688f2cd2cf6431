#include "worker/parallel/sharded_engine.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <type_traits>

#include "worker/comm/stream_collectives.h"
#include "worker/kernels/dropout.h"
#include "worker/model/model.h"

namespace meshtrain::parallel {

ShardFill FillFrom(const WholeState& whole, int64_t parameters) {
  if (int64_t(whole.master.size()) != parameters || int64_t(whole.m.size()) != parameters ||
      int64_t(whole.v.size()) != parameters) {
    throw std::invalid_argument("Restore: a state of " + std::to_string(whole.master.size()) +
                                " parameters for a model of " + std::to_string(parameters));
  }
  return [&whole](int, const std::vector<int64_t>& at, float* master, float* m, float* v) {
    for (size_t i = 0; i < at.size(); ++i) {
      const bool model = at[i] >= 0;
      master[i] = model ? whole.master[size_t(at[i])] : 0.0f;
      m[i] = model ? whole.m[size_t(at[i])] : 0.0f;
      v[i] = model ? whole.v[size_t(at[i])] : 0.0f;
    }
  };
}

const char* OpName(Op op) {
  switch (op) {
    case Op::kGather: return "gather";
    case Op::kForward: return "forward";
    case Op::kRecompute: return "recompute";
    case Op::kBackward: return "backward";
    case Op::kReduceScatter: return "reduce-scatter";
    case Op::kRelease: return "release";
  }
  return "?";
}

CommStats operator-(const CommStats& a, const CommStats& b) {
  return {a.all_gather - b.all_gather, a.reduce_scatter - b.reduce_scatter, a.all_reduce - b.all_reduce,
          a.exposed - b.exposed,       a.copy - b.copy,                     a.copy_exposed - b.copy_exposed,
          a.send - b.send,             a.recv - b.recv,                     a.neighbour_wait - b.neighbour_wait};
}

// The TP group's collectives for the layers, in the compute stream's order.
template <class P>
class ShardedEngine<P>::TensorParallel final : public model::TensorParallelGroup<P> {
 public:
  explicit TensorParallel(comm::StreamCollectives* group) : group_(group) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  void AllReduceSum(Ptr<A> data, int64_t n, runtime::Stream& stream) override {
    comm::AllReduce<A>(*group_, data, size_t(n), comm::ReduceOp::kSum, stream);
  }
  void AllGather(Ptr<const G> in, Ptr<G> out, int64_t n, runtime::Stream& stream) override {
    comm::AllGather<G>(*group_, in, out, size_t(n), stream);
  }

 private:
  comm::StreamCollectives* group_;
};

template <class P>
ShardedEngine<P>::ShardedEngine(const api::ModelShape& shape, std::shared_ptr<const Mesh> mesh, int batch, int seq,
                                uint64_t seed, runtime::MemoryAccounting* accounting, const EngineOptions& options,
                                std::shared_ptr<runtime::Backend> backend, const OpsFactory<P>& make_ops)
    : layout_(shape, mesh->tp_rank(), mesh->tp_size(), options.vocab_multiple),
      model_(model::MakeModel<P>(layout_)),
      backend_(std::move(backend)),
      mesh_(std::move(mesh)),
      batch_(batch),
      seq_(seq),
      options_(options),
      pipeline_(options.pipeline),
      allocator_(accounting, backend_->DeviceMemory(), options.memory_limit),
      pinned_(accounting, backend_->PinnedHostMemory()),
      ops_(make_ops(*backend_, &allocator_)),
      compute_(backend_->NewStream("compute")),
      comm_(backend_->NewStream("comm")),
      exposed_(backend_->NewTimer()),
      neighbour_wait_(backend_->NewTimer()),
      tp_(mesh_->device_tp() ? std::make_unique<TensorParallel>(mesh_->device_tp()) : nullptr),
      edge_free_(backend_->NewEvent()),
      edge_grads_free_(backend_->NewEvent()),
      comm_done_(backend_->NewEvent()),
      squares_done_(backend_->NewEvent()),
      produced_(backend_->NewEvent()) {
  const api::ModelShape& s = layout_.shape();
  if (seq > s.seq_len) throw std::invalid_argument("sequence longer than the model's seqLen");
  ActivationStore<P>::Check(options.activations);
  const int S = mesh_->shard_size(), L = layout_.blocks(), H = layout_.head_unit();
  const model::TpSlice tp{mesh_->tp_rank(), mesh_->tp_size(), options.vocab_multiple};
  api::EngineTypes types = model::TypesOf(*ops_, batch, seq, s, tp.size);
  types.vocab_multiple = options.vocab_multiple;
  const int heads = int(s.heads) / tp.size;
  const int64_t state = types.attention_keeps_scores ? int64_t(batch) * heads * seq * seq : int64_t(batch) * heads * seq;
  if (ops_->AttentionStateElements(batch, seq, heads, int(s.kv_heads) / tp.size, int(s.head_dim)) > state) {
    throw std::logic_error(ops_->Describe() + ": its attention keeps more per block than the engine counts");
  }
  using runtime::MemoryCategory;

  // This rank's part of the pipeline: the whole model on one stage.
  if (mesh_->stages() != pipeline_.stages) {
    throw std::invalid_argument("a pipeline of " + std::to_string(pipeline_.stages) + " stages on a mesh of " +
                                std::to_string(mesh_->stages()));
  }
  const int stage = mesh_->stage();
  api::StageShape part;
  if (pipelined()) {
    if (options.keep_units_gathered) throw std::invalid_argument("keeping every unit gathered needs one stage");
    first_ = api::SplitBlocks(s, seq, pipeline_.chunks());
    chunks_ = api::ChunksOf(pipeline_, stage);
    actions_ = api::StageActions(pipeline_, stage, options.micro_batches);
    part = api::StageShapeOf(s, pipeline_, stage, options.micro_batches, seq);
    lane_base_.push_back(0);
    for (int lanes : api::LanesOf(pipeline_, stage, options.micro_batches)) lane_base_.push_back(lane_base_.back() + lanes);
  } else {
    first_ = {0, L};
    chunks_ = {0};
    lane_base_ = {0, 1};
  }

  // The step buffer, carved in api::StepBuffers's order.
  const std::vector<api::Buffer> step_buffers = api::StepBuffers(batch, seq, s, types);
  step_ = runtime::DeviceArray<std::byte>(&allocator_, api::CarvedBytes(step_buffers), MemoryCategory::kActivations);
  std::vector<runtime::DeviceBytes> at;
  int64_t offset = 0;
  for (const api::Buffer& b : step_buffers) {
    at.push_back(step_.get() + offset);
    offset += api::Aligned(b.elements * b.element_bytes);
  }
  tokens_ = at[0].template As<int32_t>();
  targets_ = at[1].template As<int32_t>();
  loss_sum_ = at[2].template As<double>();
  squares_ = loss_sum_ + 1;
  clip_scale_ = (at[2] + 16).template As<float>();
  static_assert(sizeof(kernels::ShardSegment) == api::kShardSegmentBytes);
  // The units of this stage: its chunks' blocks, the embedding's on the first stage and
  // the head's on the last (for a tied head, the last stage's copy of the embedding's).
  std::vector<bool> held(size_t(layout_.units()), false);
  for (int c : chunks_) {
    for (int l = first_[size_t(c)]; l < first_[size_t(c) + 1]; ++l) held[size_t(l) + 1] = true;
  }
  if (part.embedding_unit) held[0] = true;
  if (part.head) held[size_t(H)] = true;
  units_.resize(held.size());
  for (int u = 0; u < layout_.units(); ++u) {  // the segment tables follow the scalars, one per unit
    if (!held[size_t(u)]) continue;
    units_[size_t(u)] = std::make_unique<FlatUnit<P>>(layout_, u, S, mesh_->shard_rank(), seed,
                                                      /*counts_replicated=*/tp.rank == 0, &allocator_, *backend_,
                                                      at[size_t(3 + u)].template As<kernels::ShardSegment>(), *compute_);
  }
  if (!api::FamilyBuffers(seq, s, types).empty()) {  // RoPE's table, the last buffer, uploaded once
    const std::vector<double> table = model::RopeTable(s, seq);
    const std::vector<G> narrow(table.begin(), table.end());
    const Ptr<G> rope = at.back().template As<G>();
    backend_->Upload(rope, narrow.data(), int64_t(narrow.size()), *compute_);
    compute_->Synchronize(options_.timeout);
    rope_cos_ = rope;
    rope_sin_ = rope + int64_t(narrow.size() / 2);
  }

  // The compute copies' slots and, with S > 1, the unsharded gradients' and the
  // reduce-scatter's output.
  int64_t edge_padded = 0, block_padded = 0, widest_shard = 0;  // the largest unit's shard
  int blocks = 0;
  for (int u = 0; u < layout_.units(); ++u) {
    if (!units_[size_t(u)]) continue;
    const FlatUnit<P>& unit = *units_[size_t(u)];
    const bool edge = u == 0 || (u == H && H != 0);
    (edge ? edge_padded : block_padded) = std::max(edge ? edge_padded : block_padded, unit.padded_numel());
    blocks += edge ? 0 : 1;
    widest_shard = std::max(widest_shard, unit.shard_numel());
  }
  if (options.keep_units_gathered && S > 1) {
    throw std::invalid_argument("keeping every unit gathered (replicated) needs shard groups of one rank, not " +
                                std::to_string(S));
  }
  if (options.keep_units_gathered) {
    edge_params_.emplace_back(&allocator_, Embedding().padded_numel(), MemoryCategory::kGathered);
    if (H != 0) edge_params_.emplace_back(&allocator_, HeadUnit().padded_numel(), MemoryCategory::kGathered);
  } else if (edge_padded > 0) {
    edge_params_.emplace_back(&allocator_, edge_padded, MemoryCategory::kGathered);
  }
  for (int b = 0; b < (options.keep_units_gathered ? L : std::min(2, blocks)); ++b) {
    block_params_.emplace_back(&allocator_, block_padded, MemoryCategory::kGathered);
  }
  if (S > 1) {
    if (edge_padded > 0) edge_grads_ = runtime::DeviceArray<G>(&allocator_, edge_padded, MemoryCategory::kGathered);
    for (int b = 0; b < std::min(2, blocks); ++b) {
      block_grads_[size_t(b)] = runtime::DeviceArray<G>(&allocator_, block_padded, MemoryCategory::kGathered);
    }
    reduced_ = runtime::DeviceArray<G>(&allocator_, widest_shard, MemoryCategory::kComm);
  }
  store_ = std::make_unique<ActivationStore<P>>(s, batch, seq, options.activations, types, options.dropout > 0, tp,
                                                *backend_, &allocator_, &pinned_, part);
  for (auto* events : {&param_slot_free_, &grad_slot_free_, &staged_}) {
    for (auto& event : *events) event = backend_->NewEvent();
  }
  const int64_t N = int64_t(batch) * seq;
  const runtime::MemorySource host = backend_->PinnedHostMemory();
  staging_ = static_cast<int32_t*>(host.allocate(size_t(4 * N) * sizeof(int32_t)));
  readback_ = static_cast<double*>(host.allocate(2 * sizeof(double)));
  if (staging_ == nullptr || readback_ == nullptr) throw runtime::OutOfMemory("out of pinned host memory for tokens");
  if (pipelined()) {
    send_next_ = backend_->NewStream("send to the next stage");
    recv_prev_ = backend_->NewStream("receive from the previous stage");
    send_prev_ = backend_->NewStream("send to the previous stage");
    recv_next_ = backend_->NewStream("receive from the next stage");
    for (int lane = 0; lane < store_->lanes(); ++lane) {
      for (auto* events : {&lane_free_, &lane_sent_, &received_}) events->push_back(backend_->NewEvent());
    }
  }

  // What the collectives move at most, so that staged ones need not allocate in a step.
  const size_t widest = size_t(std::max(sizeof(A), sizeof(G)));
  if (comm::StreamCollectives* shard = mesh_->device_shard()) {
    shard->Reserve(size_t(std::max(edge_padded, block_padded)) * widest);
  }
  if (comm::StreamCollectives* replica = mesh_->device_replica()) replica->Reserve(size_t(widest_shard) * sizeof(G));
  if (comm::StreamCollectives* ends = mesh_->device_ends()) ends->Reserve(size_t(widest_shard) * sizeof(G));
  if (comm::StreamCollectives* group = mesh_->device_pipeline()) group->Reserve(sizeof(double));
  for (const Mesh::StageLink& link : {mesh_->send_next(), mesh_->recv_prev(), mesh_->send_prev(), mesh_->recv_next()}) {
    if (link.group != nullptr) link.group->Reserve(size_t(N * s.hidden) * sizeof(A));
  }
  if (comm::StreamCollectives* group = mesh_->device_tp()) {
    const int64_t rows = store_->head.chunk_rows;
    group->Reserve(size_t(std::max({N * s.hidden * int64_t(sizeof(A)), tp.size * rows * 3 * int64_t(sizeof(G)),
                                    int64_t(sizeof(double))})));
  }
  backend_->Zero(loss_sum_, 1, *compute_);
  compute_->Synchronize(options_.timeout);
}

template <class P>
ShardedEngine<P>::~ShardedEngine() {
  // The streams' work must not outlive the units and buffers it touches.
  try {
    Drain();
  } catch (...) {  // already reported by the call that failed
  }
  const runtime::MemorySource host = backend_->PinnedHostMemory();
  if (staging_ != nullptr) host.free(staging_);
  if (readback_ != nullptr) host.free(readback_);
}

template <class P>
runtime::DevicePtr<typename P::Act> ShardedEngine<P>::EdgeSlot(int u) const {
  return edge_params_[options_.keep_units_gathered && u != 0 ? 1 : 0].get();
}

template <class P>
runtime::DevicePtr<typename P::Acc> ShardedEngine<P>::BlockGrads(int l) {
  return mesh_->shard_size() == 1 ? Block(l).grads() : block_grads_[size_t(BlockSlotIndex(l))].get();
}

template <class P>
runtime::DevicePtr<typename P::Acc> ShardedEngine<P>::EdgeGrads(int u) {
  return mesh_->shard_size() == 1 ? units_[size_t(u)]->grads() : edge_grads_.get();
}

template <class P>
std::vector<FlatUnit<P>*> ShardedEngine<P>::Held(bool counted) {
  std::vector<FlatUnit<P>*> held;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!units_[u] || (counted && u == 0 && mesh_->stage() != 0)) continue;
    held.push_back(units_[u].get());
  }
  return held;
}

template <class P>
model::Dims ShardedEngine<P>::DimsOf(int B, int T, const MicroBatchKey* training) const {
  model::Dims d = model::Dims::Of(layout_.shape(), B, T, {mesh_->tp_rank(), mesh_->tp_size(), options_.vocab_multiple});
  if (training != nullptr && options_.dropout > 0) {
    // Keyed by the step, indexed by the sample's place in the step's global batch.
    const int64_t first_sample = (training->micro * mesh_->data_parallel_size() + mesh_->data_parallel_rank()) * B;
    d.dropout = {options_.dropout, kernels::MixKey(options_.dropout_seed, uint64_t(training->step)), first_sample};
  }
  return d;
}

template <class P>
void ShardedEngine<P>::CheckTokens(const int32_t* inputs, const int32_t* targets, int B, int T) const {
  if (B > batch_ || T > seq_ || B < 1 || T < 1) {
    throw std::invalid_argument("a micro-batch of " + std::to_string(B) + " x " + std::to_string(T) +
                                " tokens, but the engine was built for at most " + std::to_string(batch_) + " x " +
                                std::to_string(seq_));
  }
  const int64_t N = int64_t(B) * T, V = layout_.shape().vocab_size;
  for (int64_t i = 0; i < N; ++i) {
    const bool bad_target = targets && (targets[i] < -1 || targets[i] >= V);  // -1: masked
    if (inputs[i] < 0 || inputs[i] >= V || bad_target) {
      throw std::out_of_range("token id " + std::to_string(bad_target ? targets[i] : inputs[i]) +
                              " outside the vocabulary of " + std::to_string(V));
    }
  }
}

template <class P>
void ShardedEngine<P>::Stage(const int32_t* inputs, const int32_t* targets, int B, int T) {
  CheckTokens(inputs, targets, B, T);
  const int64_t N = int64_t(B) * T;
  // This slot's previous copy (two micro-batches ago) has long left; wait to be sure.
  const int st = staging_slot_;
  staging_slot_ ^= 1;
  if (!staged_[size_t(st)]->Synchronize(options_.timeout)) {
    throw runtime::StreamTimeout("stream compute: the tokens of two micro-batches ago were not copied within " +
                                 std::to_string(options_.timeout.count() / 1000) + " s");
  }
  int32_t* host = staging_ + int64_t(st) * 2 * batch_ * seq_;
  std::copy_n(inputs, N, host);
  backend_->Upload(tokens_, static_cast<const int32_t*>(host), N, *compute_);
  if (targets != nullptr) {
    std::copy_n(targets, N, host + N);
    backend_->Upload(targets_, static_cast<const int32_t*>(host + N), N, *compute_);
  }
  staged_[size_t(st)]->Record(*compute_);
}

template <class P>
template <class F>
void ShardedEngine<P>::Observed(runtime::Stream& stream, Op op, int unit, F&& enqueue) {
  if (observer_ != nullptr) stream.HostCallback([observer = observer_, op, unit] { observer->Begin(op, unit); });
  enqueue();
  if (observer_ != nullptr) stream.HostCallback([observer = observer_, op, unit] { observer->End(op, unit); });
}

template <class P>
void ShardedEngine<P>::WaitTimed(runtime::Event& event) {
  exposed_->Begin(*compute_);
  compute_->Wait(event);
  exposed_->End(*compute_);
}

template <class P>
void ShardedEngine<P>::WaitNeighbour(runtime::Event& event) {
  neighbour_wait_->Begin(*compute_);
  compute_->Wait(event);
  neighbour_wait_->End(*compute_);
}

template <class P>
void ShardedEngine<P>::Transfer(bool send, const Mesh::StageLink& link, Ptr<A> data, int64_t n,
                                runtime::Stream& stream, runtime::Event& after, runtime::Event& done) {
  if (link.group == nullptr) {
    throw std::logic_error("stage " + std::to_string(mesh_->stage()) + " has no link to " + (send ? "send" : "receive") +
                           " on");
  }
  stream.Wait(after);
  if (send) {
    comm::Send<A>(*link.group, Ptr<const A>(data), size_t(n), link.peer, stream);
  } else {
    comm::Recv<A>(*link.group, data, size_t(n), link.peer, stream);
  }
  done.Record(stream);
}

template <class P>
void ShardedEngine<P>::GatherEdge(int u) {
  if (options_.keep_units_gathered && !kept_stale_) return;
  comm_->Wait(*edge_free_);  // the compute stream is done with the slot's last unit
  Observed(*comm_, Op::kGather, u, [&] { units_[size_t(u)]->Gather(EdgeSlot(u), mesh_->device_shard(), *ops_, *comm_); });
}

template <class P>
void ShardedEngine<P>::GatherBlock(int l) {
  if (options_.keep_units_gathered && !kept_stale_) return;
  comm_->Wait(*param_slot_free_[size_t(BlockSlotIndex(l))]);
  Observed(*comm_, Op::kGather, l + 1, [&] { Block(l).Gather(BlockSlot(l), mesh_->device_shard(), *ops_, *comm_); });
}

template <class P>
void ShardedEngine<P>::RefreshKept() {
  if (!options_.keep_units_gathered) return;
  kept_stale_ = true;  // the next forward casts each unit once; AdamW keeps them current from then on
}

template <class P>
void ShardedEngine<P>::ReleaseBlock(int l) {
  Observed(*compute_, Op::kRelease, l + 1, [] {});
  param_slot_free_[size_t(BlockSlotIndex(l))]->Record(*compute_);
}

template <class P>
void ShardedEngine<P>::ReleaseEdge() {
  edge_free_->Record(*compute_);
}

template <class P>
void ShardedEngine<P>::ReduceEdge(int u, bool last) {
  FlatUnit<P>& unit = *units_[size_t(u)];
  unit.backward_done().Record(*compute_);
  comm_->Wait(unit.backward_done());
  Observed(*comm_, Op::kReduceScatter, u,
           [&] { unit.ReduceGrads(edge_grads_.get(), reduced_.get(), mesh_->device_shard(), *ops_, *comm_); });
  if (mesh_->shard_size() > 1) edge_grads_free_->Record(*comm_);
  if (last) unit.AllReduceReplicas(mesh_->device_replica(), *comm_);
}

template <class P>
void ShardedEngine<P>::ReleaseHeld() {
  if (!held_) return;
  ReleaseBlock(held_block_);
  held_ = false;
}

template <class P>
void ShardedEngine<P>::ChunkForward(int c, int lane, const model::Dims& d, Head head, float loss_weight,
                                    int64_t logits_row, bool hold, bool last) {
  const int a = first_[size_t(c)], b = first_[size_t(c) + 1], H = layout_.head_unit();
  const bool embeds = c == 0, ends = c + 1 == chunks();  // the chunk holds the embedding, the head
  const model::Context<P> k = Context();
  const int64_t n = d.N() * d.C;
  if (pipelined()) {  // the lane's last micro-batch is done with it
    compute_->Wait(*lane_free_[size_t(lane)]);
    compute_->Wait(*lane_sent_[size_t(lane)]);
  }
  if (embeds) GatherEdge(0);
  GatherBlock(a);
  if (embeds) {
    WaitTimed(Embedding().ready());
    Observed(*compute_, Op::kForward, 0,
             [&] { model_->EmbedForward(k, store_->Input(0, lane), tokens_, EdgeSlot(0), d); });
    if (H != 0 || !ends) ReleaseEdge();  // an untied head's unit comes into the slot while the last block computes
  } else {
    Transfer(false, mesh_->recv_prev(), store_->Input(0, lane), n, *recv_prev_, *lane_free_[size_t(lane)],
             *received_[size_t(lane)]);
    WaitNeighbour(*received_[size_t(lane)]);
  }
  for (int l = a; l < b; ++l) {
    if (l + 1 < b) {
      GatherBlock(l + 1);
    } else if (ends && (H != 0 || !embeds)) {
      GatherEdge(H);
    }
    WaitTimed(Block(l).ready());
    store_->BeforeForward(l - a, *compute_, lane);
    Observed(*compute_, Op::kForward, l + 1, [&] {
      model_->BlockForward(k, store_->ForwardOutputs(l - a, lane), store_->scratch, store_->Input(l - a, lane),
                           BlockSlot(l), d.ForLayer(l));
    });
    store_->AfterForward(l - a, *compute_, lane);
    if (!hold || l + 1 < b) ReleaseBlock(l);
  }
  // A forward whose backward comes next keeps its last block for it (torchtitan keeps it
  // too): a gather per micro-batch saved. Held from here, so that a head that throws
  // leaves it to the next call to release.
  if (hold) {
    held_ = true;
    held_block_ = b - 1;
  }
  // Without a backward to come, the lane is free once its forward has read it (what
  // goes to the next stage is the output, which the next forward waits to have left).
  const bool forward_only = pipelined() && head != Head::kTrain;
  if (!ends) {
    produced_->Record(*compute_);
    if (forward_only) lane_free_[size_t(lane)]->Record(*compute_);
    Transfer(true, mesh_->send_next(), store_->Output(lane), n, *send_next_, *produced_, *lane_sent_[size_t(lane)]);
    return;
  }
  if (H != 0 || !embeds) WaitTimed(HeadUnit().ready());
  Observed(*compute_, Op::kForward, H, [&] {
    if (head == Head::kLogits) {
      model_->HeadLogits(k, store_->head, store_->Output(lane), EdgeSlot(H), logits_row, d);
    } else if (head == Head::kLoss) {
      model_->HeadForward(k, store_->head, store_->Output(lane), EdgeSlot(H), targets_, loss_sum_, loss_weight, nullptr,
                          nullptr, d);
    } else {
      if (mesh_->shard_size() > 1) {
        compute_->Wait(*edge_grads_free_);  // the last unit's have been reduce-scattered
        backend_->Zero(edge_grads_.get(), HeadUnit().padded_numel(), *compute_);
      }
      backend_->Zero(store_->Gradient(lane), n, *compute_);
      model_->HeadForward(k, store_->head, store_->Output(lane), EdgeSlot(H), targets_, loss_sum_, loss_weight,
                          EdgeGrads(H), store_->Gradient(lane), d);
    }
  });
  ReleaseEdge();
  if (forward_only) lane_free_[size_t(lane)]->Record(*compute_);
  // In a pipeline the head's gradients are final now (a tied head's are the last stage's
  // copy's, summed with the first stage's before the update).
  if (pipelined() && head == Head::kTrain) ReduceEdge(H, last);
  kept_stale_ = false;
}

template <class P>
void ShardedEngine<P>::ChunkBackward(int c, int lane, const model::Dims& d, bool last) {
  const int a = first_[size_t(c)], b = first_[size_t(c) + 1], S = mesh_->shard_size(), H = layout_.head_unit();
  const bool embeds = c == 0, ends = c + 1 == chunks();
  const model::Context<P> k = Context();
  const int64_t n = d.N() * d.C;
  // An untied head's gradients are complete: its backward ran in the forward.
  if (!pipelined() && ends && H != 0) ReduceEdge(H, last);
  if (!ends) {
    Transfer(false, mesh_->recv_next(), store_->Gradient(lane), n, *recv_next_, *lane_free_[size_t(lane)],
             *received_[size_t(lane)]);
    WaitNeighbour(*received_[size_t(lane)]);
  }
  const model::BlockScratch<P> scratch = store_->ScratchFor(lane);
  if (held_ && held_block_ == b - 1) {
    held_ = false;  // its forward kept it
  } else {
    ReleaseHeld();
    GatherBlock(b - 1);
  }
  for (int l = b - 1; l >= a; --l) {
    if (l > a) GatherBlock(l - 1);
    FlatUnit<P>& unit = Block(l);
    const Ptr<A> params = BlockSlot(l);
    store_->BeforeBackward(l - a, *compute_, lane);
    WaitTimed(unit.ready());
    if (store_->recompute()) {
      Observed(*compute_, Op::kRecompute, l + 1, [&] {
        model_->BlockForward(k, store_->Saved(l - a, lane), store_->scratch, store_->Input(l - a, lane), params,
                             d.ForLayer(l));
      });
    }
    const Ptr<G> grads = BlockGrads(l);
    if (S > 1) {
      compute_->Wait(*grad_slot_free_[size_t(BlockSlotIndex(l))]);
      backend_->Zero(grads, unit.padded_numel(), *compute_);
    }
    Observed(*compute_, Op::kBackward, l + 1, [&] {
      model_->BlockBackward(k, grads, scratch, store_->Saved(l - a, lane), store_->Input(l - a, lane), params,
                            d.ForLayer(l));
    });
    store_->AfterBackward(l - a, *compute_, lane);
    ReleaseBlock(l);
    unit.backward_done().Record(*compute_);
    comm_->Wait(unit.backward_done());
    Observed(*comm_, Op::kReduceScatter, l + 1,
             [&] { unit.ReduceGrads(grads, reduced_.get(), mesh_->device_shard(), *ops_, *comm_); });
    if (S > 1) grad_slot_free_[size_t(BlockSlotIndex(l))]->Record(*comm_);
    if (last) unit.AllReduceReplicas(mesh_->device_replica(), *comm_);
  }
  if (!embeds) {  // the input's gradient goes back to the previous stage
    produced_->Record(*compute_);
    Transfer(true, mesh_->send_prev(), store_->Gradient(lane), n, *send_prev_, *produced_, *lane_free_[size_t(lane)]);
    return;
  }
  // The embedding's backward needs no parameters; a tied head's gradients are in the edge
  // buffer already on a single stage, an untied head's have left it.
  if ((H != 0 || pipelined()) && S > 1) {
    compute_->Wait(*edge_grads_free_);
    backend_->Zero(edge_grads_.get(), Embedding().padded_numel(), *compute_);
  }
  Observed(*compute_, Op::kBackward, 0,
           [&] { model_->EmbedBackward(k, EdgeGrads(0), store_->Gradient(lane), tokens_, d); });
  ReduceEdge(0, last);
  if (pipelined()) lane_free_[size_t(lane)]->Record(*compute_);
}

template <class P>
void ShardedEngine<P>::Forward(const int32_t* inputs, const int32_t* targets, int B, int T,
                               const MicroBatchKey* training, float target_weight) {
  if (targets == nullptr) throw std::invalid_argument("Forward needs targets");
  ReleaseHeld();  // a training forward whose backward never came
  if (pipelined() && training != nullptr) {  // the step's last Backward runs it
    CheckTokens(inputs, targets, B, T);
    const int64_t N = int64_t(B) * T;
    queued_.push_back({std::vector<int32_t>(inputs, inputs + N), std::vector<int32_t>(targets, targets + N), B, T,
                       *training, target_weight});
    return;
  }
  if (pipelined()) return ForwardThrough(inputs, targets, B, T, Head::kLoss, target_weight, 0);
  Stage(inputs, targets, B, T);
  B_ = B, T_ = T;
  dims_ = DimsOf(B, T, training);
  const bool train = training != nullptr;
  ChunkForward(0, 0, dims_, train ? Head::kTrain : Head::kLoss, target_weight, 0, /*hold=*/train, false);
}

template <class P>
void ShardedEngine<P>::Backward(bool last) {
  if (pipelined()) {
    if (queued_.empty()) throw std::logic_error("Backward needs a training Forward before it");
    if (last) RunSchedule();
    replicas_reduced_ = last;
    return;
  }
  if (!held_) throw std::logic_error("Backward needs a training Forward before it");
  ChunkBackward(0, 0, dims_, last);
  replicas_reduced_ = last;
}

template <class P>
void ShardedEngine<P>::RunSchedule() {
  const int M = int(queued_.size()), Pn = pipeline_.stages;
  if (M != options_.micro_batches) {
    const int queued = M;
    queued_.clear();
    throw std::logic_error("a pipelined step of " + std::to_string(queued) + " micro-batches, but the engine was built for " +
                           std::to_string(options_.micro_batches));
  }
  // Each chunk's lanes, taken by a forward and given back by its backward.
  std::vector<std::vector<int>> free(chunks_.size());
  for (size_t v = 0; v < chunks_.size(); ++v) {
    for (int lane = lane_base_[v + 1] - 1; lane >= lane_base_[v]; --lane) free[v].push_back(lane);
  }
  std::vector<int> lane_of(size_t(M) * chunks_.size(), -1);
  try {
    for (size_t i = 0; i < actions_.size(); ++i) {
      const api::PipeAction& action = actions_[i];
      const size_t v = size_t(action.chunk / Pn);
      const Queued& q = queued_[size_t(action.micro)];
      const model::Dims d = DimsOf(q.B, q.T, &q.key);
      const bool embeds = action.chunk == 0, ends = action.chunk + 1 == chunks();
      const bool last = action.micro + 1 == M;
      if (action.op == api::PipeOp::kForward) {
        if (free[v].empty()) throw std::logic_error("pipeline: no free lane for " + api::ToString(action));
        const int lane = free[v].back();
        free[v].pop_back();
        lane_of[size_t(action.micro) * chunks_.size() + v] = lane;
        if (embeds || ends) Stage(q.inputs.data(), q.targets.data(), q.B, q.T);
        const bool hold = i + 1 < actions_.size() &&
                          actions_[i + 1] == api::PipeAction{api::PipeOp::kBackward, action.micro, action.chunk};
        ChunkForward(action.chunk, lane, d, Head::kTrain, q.weight, 0, hold, last);
      } else {
        const int lane = lane_of[size_t(action.micro) * chunks_.size() + v];
        if (embeds) Stage(q.inputs.data(), q.targets.data(), q.B, q.T);
        ChunkBackward(action.chunk, lane, d, last);
        free[v].push_back(lane);
      }
    }
  } catch (...) {
    queued_.clear();
    throw;
  }
  queued_.clear();
}

template <class P>
void ShardedEngine<P>::ForwardThrough(const int32_t* inputs, const int32_t* targets, int B, int T, Head head,
                                      float loss_weight, int64_t logits_row) {
  CheckTokens(inputs, targets, B, T);
  const model::Dims d = DimsOf(B, T, nullptr);
  for (size_t v = 0; v < chunks_.size(); ++v) {
    const int c = chunks_[v];
    if (c == 0 || c + 1 == chunks()) Stage(inputs, targets, B, T);
    ChunkForward(c, lane_base_[v], d, head, loss_weight, logits_row, false, false);
  }
}

template <class P>
void ShardedEngine<P>::ZeroGrad() {
  comm_done_->Record(*comm_);  // the last step's reductions into the shard gradients
  compute_->Wait(*comm_done_);
  for (FlatUnit<P>* unit : Held(false)) unit->ZeroShardGrads(*backend_, *compute_);
  replicas_reduced_ = false;
  updated_ = false;
  norm_.reset();
}

template <class P>
void ShardedEngine<P>::Update(const OptimizerStep& step) {
  ReleaseHeld();
  if (!queued_.empty()) throw std::logic_error("Update before the step's last Backward ran its pipeline");
  const std::vector<FlatUnit<P>*> held = Held(false);
  if (!replicas_reduced_) {  // independent all-reduces, one per unit: one batch
    comm::StreamCollectives* replica = mesh_->device_replica();
    comm::Batched(replica, [&] {
      for (FlatUnit<P>* unit : held) unit->AllReduceReplicas(replica, *comm_);
    });
  }
  // A tied embedding's two copies (the first stage's and the last's) get the sum of their
  // gradients, so that they take the same step.
  if (comm::StreamCollectives* ends = mesh_->device_ends(); ends != nullptr && layout_.head_unit() == 0) {
    comm::AllReduce<G>(*ends, units_[0]->grads(), size_t(units_[0]->shard_numel()), comm::ReduceOp::kSum, *comm_);
  }
  comm_done_->Record(*comm_);
  WaitTimed(*comm_done_);
  // The norm: every rank's squares, summed in fp64 over the shard, TP and pipeline groups
  // on the comm stream, where those groups' other operations run in order.
  backend_->Zero(squares_, 1, *compute_);
  for (FlatUnit<P>* unit : Held(true)) unit->AddSquares(squares_, *ops_, *compute_);
  squares_done_->Record(*compute_);
  comm_->Wait(*squares_done_);
  for (comm::StreamCollectives* group : {mesh_->device_shard(), mesh_->device_tp(), mesh_->device_pipeline()}) {
    if (group != nullptr) comm::AllReduce<double>(*group, squares_, 1, comm::ReduceOp::kSum, *comm_);
  }
  comm_done_->Record(*comm_);
  compute_->Wait(*comm_done_);
  ops_->ClipScale(clip_scale_, squares_, step.max_norm, *compute_);
  const kernels::AdamWStep adamw{step.learning_rate, step.beta1, step.beta2, step.epsilon, step.weight_decay, step.t};
  const int H = layout_.head_unit();
  for (int u = 0; u < int(units_.size()); ++u) {
    if (!units_[size_t(u)]) continue;
    // Replicated: AdamW writes the kept compute copy as it goes.
    const Ptr<A> kept = !options_.keep_units_gathered  ? nullptr
                        : u == 0 || (u == H && H != 0) ? EdgeSlot(u)
                                                       : BlockSlot(u - 1);
    units_[size_t(u)]->Update(adamw, clip_scale_, kept, *ops_, *compute_);
  }
  replicas_reduced_ = false;
  updated_ = true;
  norm_.reset();
}

template <class P>
double ShardedEngine<P>::TakeLoss() {
  backend_->Download(readback_, Ptr<const double>(loss_sum_), 1, *compute_);
  backend_->Zero(loss_sum_, 1, *compute_);
  Drain();
  double loss = readback_[0];
  // The last stage's loss (the others' is zero), on every stage.
  if (comm::Communicator* group = mesh_->pipeline()) {
    group->AllReduce(&loss, &loss, 1, comm::DataType::kFloat64, comm::ReduceOp::kSum)->Wait();
  }
  return loss;
}

template <class P>
double ShardedEngine<P>::GradNorm() {
  if (!updated_) throw std::logic_error("GradNorm: no Update since the last ZeroGrad");
  if (!norm_) {
    backend_->Download(readback_ + 1, Ptr<const double>(squares_), 1, *compute_);
    Drain();
    norm_ = std::sqrt(readback_[1]);
  }
  return *norm_;
}

template <class P>
std::vector<float> ShardedEngine<P>::NextTokenProbabilities(const int32_t* tokens, int n) {
  ReleaseHeld();
  const int64_t V = layout_.shape().vocab_size;
  if (pipelined()) {
    ForwardThrough(tokens, nullptr, 1, n, Head::kLogits, 0, n - 1);
    // The last stage has them; the pipeline group's broadcast gives them to every stage.
    std::vector<float> probabilities(static_cast<size_t>(V));
    if (mesh_->stage() + 1 == mesh_->stages()) probabilities = Probabilities();
    Drain();
    mesh_->pipeline()->Broadcast(probabilities.data(), probabilities.data(), probabilities.size(),
                                 comm::DataType::kFloat32, mesh_->stages() - 1)->Wait();
    return probabilities;
  }
  Stage(tokens, nullptr, 1, n);
  ChunkForward(0, 0, DimsOf(1, n, nullptr), Head::kLogits, 0, n - 1, false, false);
  return Probabilities();
}

template <class P>
std::vector<float> ShardedEngine<P>::Probabilities() {
  const int64_t V = layout_.shape().vocab_size;
  const model::TpSlice slice{mesh_->tp_rank(), mesh_->tp_size(), options_.vocab_multiple};
  std::vector<A> row(size_t(slice.padded_vocab(V)));
  backend_->Download(row.data(), Ptr<const A>(store_->head.logits), int64_t(row.size()), *compute_);
  Drain();
  // The slices differ in size by at most one: gather them padded to the widest.
  const int64_t widest = (V + slice.size - 1) / slice.size;
  std::vector<float> mine(size_t(widest), 0.0f), all(size_t(widest * slice.size)), logits;
  for (int64_t v = 0; v < slice.vocab(V); ++v) mine[size_t(v)] = float(row[size_t(v)]);
  if (mesh_->tp() == nullptr) {
    all = mine;
  } else {
    mesh_->tp()->AllGather(mine.data(), all.data(), size_t(widest), comm::DataType::kFloat32)->Wait();
  }
  for (int r = 0; r < slice.size; ++r) {
    const model::TpSlice other{r, slice.size};
    logits.insert(logits.end(), all.begin() + r * widest, all.begin() + r * widest + other.vocab(V));
  }
  const float largest = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(double(x - largest));
  for (float& x : logits) x = float(std::exp(double(x - largest)) / sum);
  return logits;
}

template <class P>
std::vector<float> ShardedEngine<P>::Weights() {
  ReleaseHeld();
  Drain();
  // This rank's TP slice, each unit gathered over its shard group.
  std::vector<G> local(size_t(layout_.total()));
  std::vector<G> shard, unit_whole;
  for (FlatUnit<P>* unit : Held(true)) {
    shard.resize(size_t(unit->shard_numel()));
    backend_->Download(shard.data(), Ptr<const G>(unit->master()), unit->shard_numel(), *compute_);
    Drain();
    const G* from = shard.data();
    if (comm::Communicator* group = mesh_->shard()) {
      unit_whole.resize(size_t(unit->padded_numel()));
      group->AllGather(shard.data(), unit_whole.data(), shard.size(), comm::DataTypeOf<G>())->Wait();
      from = unit_whole.data();
    }
    std::copy(from, from + unit->numel(), local.begin() + unit->begin());
  }
  // Each slice in its place of the whole model (the tensors every rank holds whole from
  // TP rank 0), summed over the TP group: every element comes from one rank.
  std::vector<G> whole(size_t(layout_.shape().ParameterCount()), G(0));
  for (const model::ParamTensor& t : layout_.tensors()) {
    if (t.tp_replicated() && mesh_->tp_rank() != 0) continue;
    const std::vector<int64_t> at = layout_.WholeIndices(t.offset, t.offset + t.size);
    for (size_t i = 0; i < at.size(); ++i) {
      if (at[i] >= 0) whole[size_t(at[i])] = local[size_t(t.offset) + i];
    }
  }
  if (comm::Communicator* group = mesh_->tp()) {
    group->AllReduce(whole.data(), whole.data(), whole.size(), comm::DataTypeOf<G>(), comm::ReduceOp::kSum)->Wait();
  }
  // And each stage's in its place: every element comes from one stage.
  if (comm::Communicator* group = mesh_->pipeline()) {
    group->AllReduce(whole.data(), whole.data(), whole.size(), comm::DataTypeOf<G>(), comm::ReduceOp::kSum)->Wait();
  }
  return std::vector<float>(whole.begin(), whole.end());
}

template <class P>
void ShardedEngine<P>::Snapshot(ShardState* into) {
  ReleaseHeld();
  Drain();
  const std::vector<FlatUnit<P>*> held = Held(true);
  int64_t total = 0;
  for (FlatUnit<P>* unit : held) {
    for (const auto& [a, b] : unit->model_runs()) total += b - a;
  }
  if (into->size != total || into->storage == nullptr) {
    const runtime::MemorySource host = backend_->PinnedHostMemory();
    void* arrays = host.allocate(size_t(3 * total) * sizeof(float));
    if (arrays == nullptr) throw runtime::OutOfMemory("out of pinned host memory for a checkpoint snapshot");
    into->storage = std::shared_ptr<void>(arrays, host.free);
    into->size = total;
    into->master = static_cast<float*>(arrays);
    into->m = into->master + total;
    into->v = into->m + total;
  }
  into->tp_rank = mesh_->tp_rank();
  into->shard_rank = mesh_->shard_rank();
  into->replica = mesh_->replica_index();
  into->stage = mesh_->stage();
  into->units.clear();
  for (FlatUnit<P>* unit : held) into->units.push_back(unit->index());
  // The model's elements of each shard, straight into the snapshot (fp64 through the host).
  std::vector<G> wide;
  int64_t at = 0;
  for (FlatUnit<P>* unit : held) {
    for (const auto& [a, b] : unit->model_runs()) {
      const int64_t n = b - a;
      const Ptr<G> from[3] = {unit->master(), unit->adam_m(), unit->adam_v()};
      float* to[3] = {into->master + at, into->m + at, into->v + at};
      for (int part = 0; part < 3; ++part) {
        if constexpr (std::is_same_v<G, float>) {
          backend_->Download(to[part], Ptr<const G>(from[part] + a), n, *compute_);
        } else {
          wide.resize(size_t(n));
          backend_->Download(wide.data(), Ptr<const G>(from[part] + a), n, *compute_);
          Drain();
          std::transform(wide.begin(), wide.end(), to[part], [](G x) { return float(x); });
        }
      }
      at += n;
    }
  }
  Drain();
}

template <class P>
void ShardedEngine<P>::Restore(const WholeState& whole) {
  RestoreShards(FillFrom(whole, layout_.shape().ParameterCount()));
}

template <class P>
void ShardedEngine<P>::RestoreShards(const ShardFill& fill) {
  ReleaseHeld();
  Drain();
  // One unit's shard staged at a time: the rank never holds more than its own state and
  // that unit's in host memory.
  std::vector<float> master, m, v;
  std::vector<G> narrow;
  for (FlatUnit<P>* held : Held(false)) {
    FlatUnit<P>& unit = *held;
    const int u = unit.index();
    const int64_t from = unit.begin() + unit.shard_begin(), n = unit.shard_numel();
    std::vector<int64_t> at = layout_.WholeIndices(from, from + unit.shard_real());
    at.resize(size_t(n), -1);  // the shard's tail past the unit is padding too
    for (std::vector<float>* part : {&master, &m, &v}) part->resize(size_t(n));
    fill(u, at, master.data(), m.data(), v.data());
    const std::pair<Ptr<G>, const std::vector<float>*> parts[3] = {
        {unit.master(), &master}, {unit.adam_m(), &m}, {unit.adam_v(), &v}};
    for (const auto& [to, values] : parts) {
      if constexpr (std::is_same_v<G, float>) {
        backend_->Upload(to, values->data(), n, *compute_);
      } else {
        narrow.assign(values->begin(), values->end());
        backend_->Upload(to, narrow.data(), n, *compute_);
        Drain();  // `narrow` is refilled for the next part
      }
    }
    Drain();  // the host vectors are refilled for the next unit
  }
  RefreshKept();
}

template <class P>
CommStats ShardedEngine<P>::comm_stats() {
  Drain();
  CommStats stats;
  if (comm::StreamCollectives* shard = mesh_->device_shard()) {
    const comm::CollectiveSeconds s = shard->Seconds();
    stats.all_gather += s.all_gather;
    stats.reduce_scatter += s.reduce_scatter;
    stats.all_reduce += s.all_reduce;
  }
  if (comm::StreamCollectives* replica = mesh_->device_replica()) stats.all_reduce += replica->Seconds().all_reduce;
  if (comm::StreamCollectives* tp = mesh_->device_tp()) {
    const comm::CollectiveSeconds s = tp->Seconds();
    stats.all_reduce += s.all_reduce + s.all_gather;  // the layers' all-reduces and the head's gathers
  }
  for (const Mesh::StageLink& link : {mesh_->send_next(), mesh_->send_prev()}) {
    if (link.group != nullptr) stats.send += link.group->Seconds().send;
  }
  for (const Mesh::StageLink& link : {mesh_->recv_prev(), mesh_->recv_next()}) {
    if (link.group != nullptr) stats.recv += link.group->Seconds().recv;
  }
  if (comm::StreamCollectives* group = mesh_->device_pipeline()) stats.all_reduce += group->Seconds().all_reduce;
  if (comm::StreamCollectives* group = mesh_->device_ends()) stats.all_reduce += group->Seconds().all_reduce;
  stats.exposed = exposed_->Seconds();
  stats.neighbour_wait = neighbour_wait_->Seconds();
  stats.copy = store_->copy_seconds();
  stats.copy_exposed = store_->copy_wait_seconds();
  return stats;
}

template <class P>
std::string ShardedEngine<P>::Describe() const {
  const int S = mesh_->shard_size();
  std::string activations;
  const ActivationPolicy& policy = store_->policy();
  if (policy.offload) {
    activations = "; activations: block inputs checkpointed, " + std::to_string(store_->slots()) +
                  " kept, the rest offloaded (horizon " + std::to_string(policy.horizon) + ")";
  } else if (policy.checkpointing) {
    activations = "; activations: block inputs checkpointed, blocks recomputed in backward";
  }
  std::string stage;
  if (pipelined()) {
    stage = "; stage " + std::to_string(mesh_->stage()) + " of " + std::to_string(mesh_->stages()) + " (" +
            api::PipelineScheduleName(pipeline_.schedule) + "): blocks";
    for (int c : chunks_) {
      stage += " " + std::to_string(first_[size_t(c)]) + "-" + std::to_string(first_[size_t(c) + 1] - 1);
    }
    if (units_[0]) stage += mesh_->stage() == 0 ? " and the embedding" : " and a copy of the tied embedding";
    if (mesh_->stage() + 1 == mesh_->stages()) stage += " and the head";
    stage += ", " + std::to_string(store_->lanes()) + " activation lanes";
  }
  int held = 0;
  for (const auto& unit : units_) held += unit ? 1 : 0;
  const FlatUnit<P>* block = nullptr;
  for (size_t u = 1; u < units_.size() && block == nullptr; ++u) block = units_[u].get();
  return std::string(P::kName) + " FSDP, " + mesh_->Describe() + stage + activations + "; " +
         std::to_string(held) + " units" +
         (S == 1 || block == nullptr
              ? ", each whole on this rank"
              : ", each split in " + std::to_string(S) + " shards of " + std::to_string(block->shard_numel()) +
                    " elements (a block)") +
         (tp_ ? ", of this rank's tensor-parallel slice" : "") + "; " + ops_->Describe() + " on " +
         backend_->Describe();
}

template <class P>
void ShardedEngine<P>::Drain() {
  std::exception_ptr failure;
  auto synchronize = [&failure](auto&& wait) {
    try {
      wait();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  };
  synchronize([this] { compute_->Synchronize(options_.timeout); });
  synchronize([this] { comm_->Synchronize(options_.timeout); });
  for (runtime::Stream* link : {send_next_.get(), recv_prev_.get(), send_prev_.get(), recv_next_.get()}) {
    if (link != nullptr) synchronize([this, link] { link->Synchronize(options_.timeout); });
  }
  if (store_) synchronize([this] { store_->Synchronize(options_.timeout); });
  if (!failure) return;
  try {
    std::rethrow_exception(failure);
  } catch (const runtime::StreamTimeout& e) {
    // A stream stuck past the timeout: most likely a collective whose peer is gone. End
    // the groups' operations so the device is freed, and say which groups they were.
    std::string groups;
    for (comm::StreamCollectives* group :
         {mesh_->device_tp(), mesh_->device_shard(), mesh_->device_replica(), mesh_->device_pipeline(),
          mesh_->device_ends(), mesh_->send_next().group, mesh_->recv_prev().group, mesh_->send_prev().group,
          mesh_->recv_next().group}) {
      if (group == nullptr) continue;
      group->Abort();
      groups += (groups.empty() ? "" : ", ") + group->group().Describe() + " (" + group->Describe() + ")";
    }
    if (groups.empty()) throw;
    const std::string stage = pipelined() ? "stage " + std::to_string(mesh_->stage()) + " of " +
                                                std::to_string(mesh_->stages()) + ": "
                                          : "";
    throw runtime::StreamTimeout(stage + e.what() + "; the collectives of " + groups + " were aborted");
  }
}

template class ShardedEngine<kernels::Fp32>;
template class ShardedEngine<kernels::Bf16>;
template class ShardedEngine<kernels::Fp64>;

}  // namespace meshtrain::parallel
