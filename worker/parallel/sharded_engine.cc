#include "worker/parallel/sharded_engine.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "worker/comm/stream_collectives.h"
#include "worker/kernels/dropout.h"
#include "worker/model/model.h"
#include "worker/parallel/ring_attention.h"
#include "worker/parallel/ulysses_attention.h"

namespace meshtrain::parallel {

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

// The expert group's collectives for a mixture's layers, in the compute stream's order.
template <class P>
class ShardedEngine<P>::ExpertParallel final : public model::ExpertParallelGroup<P> {
 public:
  explicit ExpertParallel(comm::StreamCollectives* group) : group_(group) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  void AllGatherCounts(Ptr<const int32_t> counts, Ptr<int32_t> all, int E, runtime::Stream& stream) override {
    comm::AllGather<int32_t>(*group_, counts, all, size_t(E), stream);
  }
  void AllToAll(Ptr<const A> send, const std::vector<int64_t>& send_rows, Ptr<A> recv,
                const std::vector<int64_t>& recv_rows, int64_t width, runtime::Stream& stream) override {
    const auto lay = [width](const std::vector<int64_t>& rows, std::vector<size_t>& counts,
                             std::vector<size_t>& offsets) {
      size_t at = 0;
      for (const int64_t r : rows) {
        counts.push_back(size_t(r * width));
        offsets.push_back(at);
        at += size_t(r * width);
      }
    };
    std::vector<size_t> send_counts, send_offsets, recv_counts, recv_offsets;
    lay(send_rows, send_counts, send_offsets);
    lay(recv_rows, recv_counts, recv_offsets);
    group_->AllToAll(runtime::ConstDeviceBytes(send), send_counts, send_offsets, runtime::DeviceBytes(recv),
                     recv_counts, recv_offsets, comm::DataTypeOf<A>(), stream);
  }

 private:
  comm::StreamCollectives* group_;
};

template <class P>
ShardedEngine<P>::ShardedEngine(const api::ModelShape& shape, std::shared_ptr<const Mesh> mesh, int batch, int seq,
                                uint64_t seed, runtime::MemoryAccounting* accounting, const EngineOptions& options,
                                std::shared_ptr<runtime::Backend> backend, const OpsFactory<P>& make_ops)
    : layout_(shape, mesh->tp_rank(), mesh->tp_size(), options.vocab_multiple, mesh->expert_rank(),
              mesh->expert_size()),
      model_(model::MakeModel<P>(layout_)),
      backend_(std::move(backend)),
      mesh_(std::move(mesh)),
      batch_(batch),
      seq_(seq),
      options_(options),
      // With one stage, virtual stages and schedules mean nothing: one chunk, each forward and then its backward.
      pipeline_(options.pipeline.stages > 1 ? options.pipeline : api::Pipeline{}),
      allocator_(accounting, backend_->DeviceMemory(), options.memory_limit),
      pinned_(accounting, backend_->PinnedHostMemory()),
      ops_(make_ops(*backend_, &allocator_)),
      compute_(backend_->NewStream("compute")),
      comm_(backend_->NewStream("comm")),
      exposed_(backend_->NewTimer()),
      tp_(mesh_->device_tp() ? std::make_unique<TensorParallel>(mesh_->device_tp()) : nullptr),
      ep_(mesh_->device_expert() ? std::make_unique<ExpertParallel>(mesh_->device_expert()) : nullptr),
      edge_free_(backend_->NewEvent()),
      edge_grads_free_(backend_->NewEvent()),
      comm_done_(backend_->NewEvent()),
      squares_done_(backend_->NewEvent()) {
  const api::ModelShape& s = layout_.shape();
  if (seq > s.seq_len) throw std::invalid_argument("sequence longer than the model's seqLen");
  ActivationStore<P>::Check(options.activations);
  const int S = mesh_->shard_size(), L = layout_.blocks(), H = layout_.head_unit();
  const model::TpSlice tp{mesh_->tp_rank(), mesh_->tp_size(), options.vocab_multiple};
  const int C = mesh_->context_size();
  const bool all_to_all = C > 1 && options.context_all_to_all;
  if (all_to_all) UlyssesAttention<P>::CheckHeads(s, tp.size, C);  // before the types, which split the heads
  api::EngineTypes types = model::TypesOf(*ops_, batch, seq, s, tp.size, C, all_to_all);
  types.vocab_multiple = options.vocab_multiple;
  types.experts = mesh_->expert_size();
  if (options.float8) {
    if (!std::is_same_v<G, float>) {
      throw std::invalid_argument(std::string("float8 training runs on fp32 or bf16 kernels, not ") + P::kName);
    }
    if (mesh_->context_size() > 1) {
      throw std::invalid_argument("float8 training with context parallelism (" + std::to_string(mesh_->context_size()) +
                                  " ranks a sequence) is not built: its activations' amaxes would need the context "
                                  "group's");
    }
    if (const std::string refusal = ops_->Float8Refusal(); !refusal.empty()) {
      throw std::invalid_argument("spec.training.precision fp8: " + refusal);
    }
    const bool rowwise = *options.float8 == kernels::Float8Recipe::kRowwise;
    types.float8_scales = api::Float8ScratchElements(batch, seq, s, tp.size, rowwise);
    const api::Float8Run run{rowwise, tp.rank};
    for (const api::Float8Product& p : api::Float8LinearProducts(batch, seq, s, tp.size, run)) {
      const int64_t bytes = ops_->Float8ScratchBytes(p.m, p.n, p.k, p.sums);
      types.float8_product_bytes = std::max(types.float8_product_bytes, bytes);
    }
  }
  const int heads = int(s.heads) / tp.size;
  const int64_t state = types.attention_keeps_scores ? int64_t(batch) * heads * seq * seq : int64_t(batch) * heads * seq;
  if (C == 1 && ops_->AttentionStateElements(batch, seq, heads, int(s.kv_heads) / tp.size, int(s.head_dim)) > state) {
    throw std::logic_error(ops_->Describe() + ": its attention keeps more per block than the engine counts");
  }
  if (options.documents && C == 1) {  // model::DocumentAttentionForward's working set
    const int kv_heads = int(s.KvHeads()) / tp.size;
    types.attention_scratch_bytes = std::max(
        types.attention_scratch_bytes, model::DocumentAttentionScratchBytes<P>(batch, seq, heads, kv_heads, int(s.head_dim)));
  }
  if (options.documents && all_to_all) {  // the same on whole sequences of 1/C of the heads
    const int whole = seq * C, h = heads / C, kh = int(s.KvHeads()) / tp.size / C, hs = int(s.head_dim);
    api::EngineTypes run = types;
    run.attention_scratch_bytes = std::max(ops_->AttentionScratchBytes(batch, whole, h, kh, hs),
                                           model::DocumentAttentionScratchBytes<P>(batch, whole, h, kh, hs));
    types.attention_scratch_bytes = api::ContextAttentionScratchBytes(batch, seq, s, tp.size, run);
  }
  if (C > 1) {  // seq: this rank's rows of each sequence, two chunks of seq / 2
    if (seq % 2 != 0) throw std::invalid_argument("context parallelism needs an even number of rows a rank");
    if (all_to_all) {
      const int whole = seq * C, h = heads / C, kh = int(s.KvHeads()) / tp.size / C;
      const std::vector<api::Buffer> kept =
          api::UlyssesAttentionBuffers(batch, seq, s, tp.size, types, api::UlyssesPart::kKept);
      if (ops_->AttentionStateElements(batch, whole, h, kh, int(s.head_dim)) > kept.back().elements) {
        throw std::logic_error(ops_->Describe() + ": its attention keeps more per block than the engine counts");
      }
      cp_ = std::make_unique<UlyssesAttention<P>>(mesh_->device_context(), backend_.get(), s, tp.size, types);
    } else {
      cp_ = std::make_unique<RingAttention<P>>(mesh_->device_context(), backend_.get(), s, tp.size, types);
    }
  }
  using runtime::MemoryCategory;

  // This rank's part of the pipeline (the whole model for one stage): its chunks' blocks
  // and lanes, the embedding's unit on the first stage and the head's on the last.
  if (mesh_->stages() != pipeline_.stages) {
    throw std::invalid_argument("a pipeline of " + std::to_string(pipeline_.stages) + " stages on a mesh of " +
                                std::to_string(mesh_->stages()));
  }
  if (options.keep_units_gathered && pipeline_.stages > 1) {
    throw std::invalid_argument("keeping every unit gathered needs one stage");
  }
  first_ = api::SplitBlocks(s, seq, pipeline_.chunks());
  const std::vector<int> chunks = api::ChunksOf(pipeline_, mesh_->stage());
  last_chunk_ = chunks.empty() ? -1 : *std::max_element(chunks.begin(), chunks.end());
  const api::StageShape part = api::StageShapeOf(s, pipeline_, mesh_->stage(), options.micro_batches, seq);

  // The step buffer, carved in api::StepBuffers's order.
  const std::vector<api::Buffer> step_buffers = api::StepBuffers(batch, seq, s, types);
  step_ = runtime::DeviceArray<std::byte>(&allocator_, api::CarvedBytes(step_buffers), MemoryCategory::kActivations);
  std::vector<runtime::DeviceBytes> at;
  int64_t offset = 0;
  for (const api::Buffer& b : step_buffers) {
    at.push_back(step_.get() + offset);
    offset += api::Aligned(b.elements * b.element_bytes);
  }
  for (size_t i = 0; i < step_buffers.size(); ++i) {
    if (step_buffers[i].name != "float8 amaxes and scales") continue;
    const bool rowwise = *options.float8 == kernels::Float8Recipe::kRowwise;
    float8_ = {*options.float8, at[i].template As<float>(), api::Float8ScaleWidth(batch, seq, s, tp.size, rowwise)};
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
  for (int c : chunks) {
    for (int l = first_[size_t(c)]; l < first_[size_t(c) + 1]; ++l) held[size_t(l) + 1] = true;
  }
  if (part.embedding_unit) held[0] = true;
  if (part.head) held[size_t(H)] = true;
  units_.resize(held.size());
  for (int u = 0; u < layout_.units(); ++u) {  // the segment tables follow the scalars, one per unit
    if (!held[size_t(u)]) continue;
    // A unit holding experts that an expert group splits: over the ranks holding the same ones.
    const bool split = mesh_->expert_size() > 1 && layout_.UnitHasExperts(u);
    const int unit_shards = split ? S / mesh_->expert_size() : S;
    const int unit_shard = split ? mesh_->expert_shard_rank() : mesh_->shard_rank();
    units_[size_t(u)] = std::make_unique<FlatUnit<P>>(layout_, u, unit_shards, unit_shard, seed,
                                                      /*counts_replicated=*/tp.rank == 0, &allocator_, *backend_,
                                                      at[size_t(3 + u)].template As<kernels::ShardSegment>(), *compute_);
  }
  // The family's buffers (RoPE's table) end the step buffer; its model fills them once.
  const size_t family_buffers = api::FamilyBuffers(seq, s, types).size();
  if (family_buffers > 0 && options.documents) {  // positions 0 to the whole sequence's last (model::Context)
    runtime::DeviceBytes base = at[at.size() - family_buffers];
    if (C > 1) {
      document_buffers_ = runtime::DeviceArray<std::byte>(
          &allocator_, api::CarvedBytes(api::FamilyBuffers(seq * C, s, types)), MemoryCategory::kActivations);
      base = document_buffers_.get();
    }
    family_buffers_ =
        model::PrepareFamilyBuffers<P>(*model_, *backend_, base, model::WindowPositions(seq * C), s, types, *compute_);
  } else if (family_buffers > 0) {
    std::vector<int64_t> positions = model::WindowPositions(seq);
    if (C > 1) {  // this rank's rows of the whole sequence
      const api::ContextRows rows(int64_t(seq) * C, mesh_->context_rank(), C);
      for (int t = 0; t < seq; ++t) positions[size_t(t)] = rows.Position(t);
    }
    family_buffers_ = model::PrepareFamilyBuffers<P>(*model_, *backend_, at[at.size() - family_buffers], positions, s,
                                                     types, *compute_);
  }

  // The compute copies' slots and, with S > 1, the unsharded gradients' and the
  // reduce-scatter's output.
  int64_t edge_padded = 0, block_padded = 0, widest_shard = 0;  // the largest unit's shard
  int blocks = 0;
  bool block_reduces = false;  // some block reduces from unsharded gradients
  for (int u = 0; u < layout_.units(); ++u) {
    if (!units_[size_t(u)]) continue;
    const FlatUnit<P>& unit = *units_[size_t(u)];
    const bool edge = u == 0 || (u == H && H != 0);
    (edge ? edge_padded : block_padded) = std::max(edge ? edge_padded : block_padded, unit.padded_numel());
    blocks += edge ? 0 : 1;
    block_reduces = block_reduces || (!edge && ReducesUnsharded(unit));
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
  if (S > 1 && edge_padded > 0) {
    edge_grads_ = runtime::DeviceArray<G>(&allocator_, edge_padded, MemoryCategory::kGathered);
  }
  if (block_reduces) {
    for (int b = 0; b < std::min(2, blocks); ++b) {
      block_grads_[size_t(b)] = runtime::DeviceArray<G>(&allocator_, block_padded, MemoryCategory::kGathered);
    }
  }
  if (S > 1) reduced_ = runtime::DeviceArray<G>(&allocator_, widest_shard, MemoryCategory::kComm);
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
  stage_ = std::make_unique<PipelineStage<P>>(pipeline_, first_, options.micro_batches, *mesh_, int(s.hidden), N,
                                              *backend_, *compute_, *store_);

  // What the collectives move at most, so that staged ones need not allocate in a step.
  const size_t widest = size_t(std::max(sizeof(A), sizeof(G)));
  if (comm::StreamCollectives* shard = mesh_->device_shard()) {
    shard->Reserve(size_t(std::max(edge_padded, block_padded)) * widest);
  }
  if (comm::StreamCollectives* replica = mesh_->device_replica()) replica->Reserve(size_t(widest_shard) * sizeof(G));
  if (comm::StreamCollectives* group = mesh_->device_expert_shard()) group->Reserve(size_t(block_padded) * widest);
  if (comm::StreamCollectives* group = mesh_->device_expert_grads()) group->Reserve(size_t(widest_shard) * sizeof(G));
  if (comm::StreamCollectives* group = mesh_->device_expert()) {  // all-to-alls of the rows, both ways
    const int64_t rows = int64_t(mesh_->expert_size()) * N * s.experts_per_token;
    group->Reserve(size_t(2 * rows * s.hidden) * sizeof(A));
  }
  if (comm::StreamCollectives* ends = mesh_->device_ends()) ends->Reserve(size_t(widest_shard) * sizeof(G));
  if (comm::StreamCollectives* group = mesh_->device_pipeline()) group->Reserve(sizeof(double));
  if (comm::StreamCollectives* group = mesh_->device_tp()) {
    // The layers' all-reduces, the head's statistics, and a mixture's routing weights' gradients.
    const int64_t rows = store_->head.chunk_rows;
    group->Reserve(size_t(std::max({N * s.hidden * int64_t(sizeof(A)), tp.size * rows * 3 * int64_t(sizeof(G)),
                                    tp.size * N * s.experts_per_token * int64_t(sizeof(G)), int64_t(sizeof(double))})));
  }
  if (options.router_aux_loss_coef) {
    if (s.experts < 1) throw std::invalid_argument("a load-balancing loss needs a mixture of experts");
    if (!(*options.router_aux_loss_coef >= 0)) throw std::invalid_argument("a negative load-balancing coefficient");
    aux_dprobs_ = runtime::DeviceArray<G>(&allocator_, N * s.experts, MemoryCategory::kActivations);
  }
  backend_->Zero(loss_sum_, 1, *compute_);
  compute_->Synchronize(options_.timeout);
}

template <class P>
ShardedEngine<P>::~ShardedEngine() {
  // The streams' work must not outlive the units and buffers it touches.
  try {
    Drain();
    DropStagedStats();
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
  return ReducesUnsharded(Block(l)) ? block_grads_[size_t(BlockSlotIndex(l))].get() : Block(l).grads();
}

template <class P>
comm::StreamCollectives* ShardedEngine<P>::ShardGroup(const FlatUnit<P>& unit) const {
  return unit.experts_split() ? mesh_->device_expert_shard() : mesh_->device_shard();
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
  d.cp_rank = mesh_->context_rank();
  d.cp_size = mesh_->context_size();
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
void ShardedEngine<P>::LoadTokens(const MicroBatch& m) {
  const int64_t N = int64_t(m.B) * m.T;
  // This slot's previous copy (two micro-batches ago) has long left; wait to be sure.
  const int st = staging_slot_;
  staging_slot_ ^= 1;
  if (!staged_[size_t(st)]->Synchronize(options_.timeout)) {
    throw runtime::StreamTimeout("stream compute: the tokens of two micro-batches ago were not copied within " +
                                 std::to_string(options_.timeout.count() / 1000) + " s");
  }
  int32_t* host = staging_ + int64_t(st) * 2 * batch_ * seq_;
  std::copy_n(m.inputs, N, host);
  backend_->Upload(tokens_, static_cast<const int32_t*>(host), N, *compute_);
  if (m.targets != nullptr) {
    std::copy_n(m.targets, N, host + N);
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
void ShardedEngine<P>::GatherEdge(int u) {
  if (options_.keep_units_gathered && !kept_stale_) return;
  comm_->Wait(*edge_free_);  // the compute stream is done with the slot's last unit
  Observed(*comm_, Op::kGather, u, [&] { units_[size_t(u)]->Gather(EdgeSlot(u), mesh_->device_shard(), *ops_, *comm_); });
}

template <class P>
void ShardedEngine<P>::GatherBlock(int l) {
  if (options_.keep_units_gathered && !kept_stale_) return;
  comm_->Wait(*param_slot_free_[size_t(BlockSlotIndex(l))]);
  Observed(*comm_, Op::kGather, l + 1, [&] { Block(l).Gather(BlockSlot(l), ShardGroup(Block(l)), *ops_, *comm_); });
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
void ShardedEngine<P>::Unshard(int c, bool forward) {
  const int l = forward ? first_[size_t(c)] : first_[size_t(c) + 1] - 1;
  if (!forward && held_ && held_block_ == l) return;  // its forward kept it
  ReleaseHeld();
  GatherBlock(l);
}

template <class P>
void ShardedEngine<P>::ChunkForward(int c, int lane, const MicroBatch& m, HeadWork head, bool keep) {
  const int a = first_[size_t(c)], b = first_[size_t(c) + 1], H = layout_.head_unit();
  const bool embeds = c == 0, ends = c + 1 == chunks();  // the chunk holds the embedding, the head
  const model::Dims d = DimsOf(m.B, m.T, head == HeadWork::kTrain ? &m.key : nullptr);
  model::Context<P> k = Context(m.documents);
  if (head == HeadWork::kTrain) k.expert_counts = &expert_counts_;
  const bool aux = head == HeadWork::kTrain && options_.router_aux_loss_coef.has_value();
  const bool staged = aux && pipeline_.stages > 1;  // the micro-batch's routing is summed over the stages
  if (aux && !staged) {
    router_stats_ = {};
    k.router_stats = &router_stats_;
  }
  if (staged) k.router_stats = &staged_stats_[m.key.micro].stats;  // this stage's chunks of it add up
  if (embeds) GatherEdge(0);  // block a is gathered already (Unshard)
  if (embeds) {
    WaitTimed(Embedding().ready());
    Observed(*compute_, Op::kForward, 0,
             [&] { model_->EmbedForward(k, store_->Input(0, lane), tokens_, EdgeSlot(0), d); });
    if (H != 0 || !ends) ReleaseEdge();  // an untied head's unit comes into the slot while the last block computes
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
    if (!keep || l + 1 < b) ReleaseBlock(l);
  }
  // A training forward keeps its last block: where its backward comes next (the program
  // says so by not releasing it, api::PipeOp::kReshard), a gather per micro-batch saved,
  // as torchtitan saves it. Held from here, so that a head that throws leaves it to the
  // next call to release.
  if (keep) {
    held_ = true;
    held_block_ = b - 1;
  }
  if (staged && c == last_chunk_) PostRouterStats(m.key.micro);
  if (!ends) return;  // the lane's output goes to the next stage
  if (H != 0 || !embeds) WaitTimed(HeadUnit().ready());
  Observed(*compute_, Op::kForward, H, [&] {
    if (head == HeadWork::kLogits) {
      model_->HeadLogits(k, store_->head, store_->Output(lane), EdgeSlot(H), d.N() - 1, d);
    } else if (head == HeadWork::kLoss) {
      model_->HeadForward(k, store_->head, store_->Output(lane), EdgeSlot(H), targets_, loss_sum_, m.target_weight,
                          nullptr, nullptr, d);
    } else {
      if (mesh_->shard_size() > 1) {
        compute_->Wait(*edge_grads_free_);  // the last unit's have been reduce-scattered
        backend_->Zero(edge_grads_.get(), HeadUnit().padded_numel(), *compute_);
      }
      backend_->Zero(store_->Gradient(lane), d.N() * d.C, *compute_);
      model_->HeadForward(k, store_->head, store_->Output(lane), EdgeSlot(H), targets_, loss_sum_, m.target_weight,
                          EdgeGrads(H), store_->Gradient(lane), d);
    }
  });
  ReleaseEdge();
  kept_stale_ = false;
  if (aux && !staged) FinishRouterStats(d.N());
}

template <class P>
void ShardedEngine<P>::FinishRouterStats(int64_t N) {
  model::RouterStats& s = router_stats_;
  if (s.blocks == 0) throw std::logic_error("a load-balancing loss, but no block routed the micro-batch");
  std::vector<double> both = SumOverDataRanks(s);
  AddAuxLoss(both, s.blocks, N, /*counts_loss=*/true, &aux_dprobs_host_);
  backend_->Upload(aux_dprobs_.get(), aux_dprobs_host_.data(), N * int64_t(layout_.shape().experts), *compute_);
}

template <class P>
std::vector<double> ShardedEngine<P>::SumOverDataRanks(const model::RouterStats& s) {
  // Every data-parallel rank's (the shard group holds the context ranks, each with its
  // own rows); every rank of one micro-step has N tokens. Each TP rank routes all of them.
  std::vector<double> both(s.counts);
  both.insert(both.end(), s.probabilities.begin(), s.probabilities.end());
  // (A host group of their own: the shard and replica groups' run on the comm stream.)
  const double ranks = double(mesh_->shard_size()) * double(mesh_->replicas());
  if (comm::Communicator* group = mesh_->data()) {
    group->AllReduce(both.data(), both.data(), both.size(), comm::DataType::kFloat64, comm::ReduceOp::kSum)->Wait();
  } else if (ranks > 1) {
    throw std::logic_error("a load-balancing loss over data ranks, but the mesh has no data group");
  }
  return both;
}

template <class P>
void ShardedEngine<P>::AddAuxLoss(const std::vector<double>& both, int blocks, int64_t N, bool counts_loss,
                                  std::vector<G>* dprobs) {
  const int E = int(layout_.shape().experts);
  const double ranks = double(mesh_->shard_size()) * double(mesh_->replicas());
  const double rows = double(blocks) * ranks * double(N);  // every block's tokens, as transformers concatenates them
  double aux = 0;
  for (int e = 0; e < E; ++e) aux += (both[size_t(e)] / rows) * (both[size_t(E + e)] / rows);
  aux *= E;
  if (counts_loss) aux_loss_sum_ += double(aux_weight_) * aux;
  aux_value_sum_ += aux;
  ++aux_micro_batches_;
  // d(weight x aux) / d(one router probability of one block's token) = weight x E x
  // f_e / rows, f_e = the expert's share of all copies; times the data-parallel ranks,
  // whose gradients are averaged.
  dprobs->resize(size_t(N) * size_t(E));
  for (int e = 0; e < E; ++e) {
    const double g = double(aux_weight_) * ranks * E * (both[size_t(e)] / rows) / rows;
    for (int64_t t = 0; t < N; ++t) (*dprobs)[size_t(t) * size_t(E) + size_t(e)] = G(g);
  }
}

template <class P>
void ShardedEngine<P>::PostRouterStats(int64_t micro) {
  StagedRouterStats& staged = staged_stats_[micro];
  // A stage of a mixture's dense blocks alone routes nothing: it adds zeros to the sum.
  const size_t E = size_t(layout_.shape().experts);
  staged.stats.counts.resize(E, 0), staged.stats.probabilities.resize(E, 0);
  staged.both = SumOverDataRanks(staged.stats);
  staged.both.push_back(double(staged.stats.blocks));
  // Asynchronous: the stages post theirs in the order of the micro-batches, each when its
  // last chunk of it has run forward, and the first backward of it here waits.
  comm::Communicator* stages = mesh_->pipeline();
  if (stages == nullptr) throw std::logic_error("a load-balancing loss across stages, but the mesh has no pipeline group");
  staged.summed = stages->AllReduce(staged.both.data(), staged.both.data(), staged.both.size(),
                                    comm::DataType::kFloat64, comm::ReduceOp::kSum);
}

template <class P>
void ShardedEngine<P>::DropStagedStats() {
  if (staged_stats_.empty()) return;
  compute_->Synchronize(options_.timeout);  // the uploads read the host copies
  for (auto& [micro, staged] : staged_stats_) {
    if (!staged.summed || !staged.dprobs.empty()) continue;
    try {  // a step cut short: its all-reduce still writes `both`
      staged.summed->Wait();
    } catch (...) {  // already reported by the call that failed
    }
  }
  staged_stats_.clear();
}

template <class P>
void ShardedEngine<P>::UploadStagedDprobs(int64_t micro, int64_t N) {
  const auto found = staged_stats_.find(micro);
  if (found == staged_stats_.end() || !found->second.summed) {
    throw std::logic_error("a backward of micro-batch " + std::to_string(micro) + " before its routing was posted");
  }
  StagedRouterStats& staged = found->second;
  if (staged.dprobs.empty()) {  // the first backward of the micro-batch on this stage
    staged.summed->Wait();
    const int blocks = int(staged.both.back());
    const int sparse = layout_.blocks() - int(layout_.shape().DenseBlocks());
    if (blocks != sparse) {
      throw std::logic_error("the stages routed " + std::to_string(blocks) + " blocks of the " +
                             std::to_string(sparse) + " that hold experts");
    }
    // The loss is the last stage's, as the cross-entropy's is (TakeLoss sums the stages).
    AddAuxLoss(staged.both, blocks, N, /*counts_loss=*/mesh_->stage() + 1 == mesh_->stages(), &staged.dprobs);
  }
  backend_->Upload(aux_dprobs_.get(), staged.dprobs.data(), N * int64_t(layout_.shape().experts), *compute_);
}

template <class P>
std::optional<double> ShardedEngine<P>::TakeAuxLoss() {
  if (!options_.router_aux_loss_coef) return std::nullopt;
  const double mean = aux_micro_batches_ > 0 ? aux_value_sum_ / aux_micro_batches_ : 0;
  aux_value_sum_ = 0, aux_micro_batches_ = 0;
  return mean;
}

template <class P>
void ShardedEngine<P>::ReduceHead(bool last) {
  // A tied head's gradients on the stage that also embeds wait for the embedding's.
  const int H = layout_.head_unit();
  if (H != 0 || mesh_->stage() != 0) ReduceEdge(H, last);
}

template <class P>
void ShardedEngine<P>::ChunkBackward(int c, int lane, const MicroBatch& m, bool last) {
  const int a = first_[size_t(c)], b = first_[size_t(c) + 1], S = mesh_->shard_size(), H = layout_.head_unit();
  const bool embeds = c == 0, ends = c + 1 == chunks();
  const model::Dims d = DimsOf(m.B, m.T, &m.key);
  comm::StreamCollectives* experts = mesh_->device_expert_grads();
  model::Context<P> k = Context(m.documents);
  if (options_.router_aux_loss_coef) k.router_dprobs = aux_dprobs_.get();
  if (options_.router_aux_loss_coef && pipeline_.stages > 1) UploadStagedDprobs(m.key.micro, d.N());
  const model::BlockScratch<P> scratch = store_->ScratchFor(lane);
  held_ = false;  // its last block: kept by its forward, or gathered by Unshard
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
    const bool unsharded = ReducesUnsharded(unit);
    if (unsharded) {
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
             [&] { unit.ReduceGrads(grads, reduced_.get(), ShardGroup(unit), *ops_, *comm_, experts); });
    if (unsharded) grad_slot_free_[size_t(BlockSlotIndex(l))]->Record(*comm_);
    if (last) unit.AllReduceReplicas(mesh_->device_replica(), *comm_);
  }
  if (!embeds) return;  // the input's gradient goes to the previous stage
  // The embedding's backward needs no parameters. A tied head's gradients are in the edge
  // buffer already when this chunk ends too; an untied head's have left it.
  if ((H != 0 || !ends) && S > 1) {
    compute_->Wait(*edge_grads_free_);
    backend_->Zero(edge_grads_.get(), Embedding().padded_numel(), *compute_);
  }
  Observed(*compute_, Op::kBackward, 0,
           [&] { model_->EmbedBackward(k, EdgeGrads(0), store_->Gradient(lane), tokens_, d); });
  ReduceEdge(0, last);
}

template <class P>
void ShardedEngine<P>::CheckDocuments(const model::Documents* documents, int B, int T) const {
  if (documents != nullptr && !options_.documents) {
    throw std::invalid_argument("a micro-batch with documents, but the engine was built without them");
  }
  // Under context parallelism the family's buffers hold the whole sequence's positions.
  if (documents == nullptr && options_.documents && mesh_->context_size() > 1) {
    throw std::invalid_argument("a micro-batch without documents, but the engine was built for them");
  }
  if (documents != nullptr) model::SegmentsOf(*documents, B, T, mesh_->context_rank(), mesh_->context_size());
}

template <class P>
void ShardedEngine<P>::Forward(const int32_t* inputs, const int32_t* targets, int B, int T,
                               const MicroBatchKey* training, float target_weight, const model::Documents* documents) {
  if (targets == nullptr) throw std::invalid_argument("Forward needs targets");
  ReleaseHeld();  // a training forward whose backward never came
  if (training != nullptr && chunks() > 1) {
    throw std::logic_error("a pipeline stage trains through ForwardBackward: a forward alone has no backward to come");
  }
  if (training != nullptr && options_.router_aux_loss_coef) {
    throw std::logic_error("a load-balancing loss trains through ForwardBackward, which knows the step's micro-batches");
  }
  CheckTokens(inputs, targets, B, T);
  CheckDocuments(documents, B, T);
  const MicroBatch m{inputs, targets, B, T, training ? *training : MicroBatchKey{}, target_weight, documents};
  if (training == nullptr) return stage_->Forward(*this, m, HeadWork::kLoss);
  LoadTokens(m);
  if (documents != nullptr) forwarded_documents_ = *documents;
  forwarded_ = {nullptr, nullptr, B, T, *training, target_weight, documents ? &forwarded_documents_ : nullptr};
  Unshard(0, /*forward=*/true);
  ChunkForward(0, 0, m, HeadWork::kTrain, /*keep=*/true);
}

template <class P>
void ShardedEngine<P>::Backward(bool last) {
  if (!held_) throw std::logic_error("Backward needs a training Forward before it");
  ReduceHead(last);
  ChunkBackward(0, 0, forwarded_, last);
  replicas_reduced_ = last;
}

template <class P>
void ShardedEngine<P>::ForwardBackward(const std::vector<MicroBatch>& micro_batches) {
  if (micro_batches.empty()) throw std::invalid_argument("ForwardBackward needs a micro-batch");
  for (const MicroBatch& m : micro_batches) {
    if (m.targets == nullptr) throw std::invalid_argument("ForwardBackward needs targets");
    CheckTokens(m.inputs, m.targets, m.B, m.T);
    CheckDocuments(m.documents, m.B, m.T);
  }
  ReleaseHeld();  // a training forward whose backward never came
  if (options_.router_aux_loss_coef) aux_weight_ = *options_.router_aux_loss_coef / float(micro_batches.size());
  DropStagedStats();
  stage_->Train(*this, micro_batches);
  replicas_reduced_ = true;
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
  double loss = readback_[0] + std::exchange(aux_loss_sum_, 0.0);
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
  CheckTokens(tokens, nullptr, 1, n);
  stage_->Forward(*this, {tokens, nullptr, 1, n, {}, 0, nullptr}, HeadWork::kLogits);
  // The last stage has them; the pipeline group's broadcast gives them to every stage.
  std::vector<float> probabilities(static_cast<size_t>(layout_.shape().vocab_size));
  if (mesh_->stage() + 1 == mesh_->stages()) probabilities = Probabilities();
  if (comm::Communicator* group = mesh_->pipeline()) {
    Drain();
    group->Broadcast(probabilities.data(), probabilities.data(), probabilities.size(), comm::DataType::kFloat32,
                     mesh_->stages() - 1)->Wait();
  }
  return probabilities;
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
  if (comm::StreamCollectives* group = mesh_->device_pipeline()) stats.all_reduce += group->Seconds().all_reduce;
  if (comm::StreamCollectives* group = mesh_->device_ends()) stats.all_reduce += group->Seconds().all_reduce;
  if (comm::StreamCollectives* group = mesh_->device_context()) {
    const comm::CollectiveSeconds s = group->Seconds();
    stats.ring += s.send + s.recv;
    stats.all_to_all += s.all_to_all;
  }
  if (comm::StreamCollectives* group = mesh_->device_expert()) {  // the tokens' dispatch and return
    const comm::CollectiveSeconds s = group->Seconds();
    stats.all_to_all += s.all_to_all;
    stats.all_gather += s.all_gather;
  }
  if (comm::StreamCollectives* group = mesh_->device_expert_shard()) {
    const comm::CollectiveSeconds s = group->Seconds();
    stats.all_gather += s.all_gather;
    stats.reduce_scatter += s.reduce_scatter;
  }
  if (comm::StreamCollectives* group = mesh_->device_expert_grads()) stats.all_reduce += group->Seconds().all_reduce;
  stats.exposed = exposed_->Seconds();
  stage_->AddStats(&stats);
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
  const std::string stage = stage_->Describe(units_[0] != nullptr);
  int held = 0;
  for (const auto& unit : units_) held += unit ? 1 : 0;
  const FlatUnit<P>* block = nullptr;
  for (size_t u = 1; u < units_.size() && block == nullptr; ++u) block = units_[u].get();
  // Float8 training: the blocks' linear layers (attention's and the dense MLPs'); a
  // mixture's routers and experts, the embedding and the head keep the compute precision.
  std::string precision = P::kName;
  if (options_.float8) {
    precision = std::string("fp8 (") + kernels::Float8RecipeName(*options_.float8) + ") with " + P::kName +
                (layout_.shape().experts > 0 ? " routers and experts" : "");
  }
  return precision + " FSDP, " + mesh_->Describe() + stage + activations + "; " +
         std::to_string(held) + " units" +
         (S == 1 || block == nullptr
              ? ", each whole on this rank"
              : ", each split in " + std::to_string(S) + " shards of " + std::to_string(block->shard_numel()) +
                    " elements (a block)") +
         (tp_ ? ", of this rank's tensor-parallel slice" : "") +
         (ep_ ? ", blocks' experts " + std::to_string(layout_.shape().experts / mesh_->expert_size()) +
                    " of " + std::to_string(layout_.shape().experts) + " on this rank"
              : "") +
         "; " + ops_->Describe() + " on " +
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
  for (runtime::Stream* link : stage_ ? stage_->streams() : std::vector<runtime::Stream*>{}) {
    synchronize([this, link] { link->Synchronize(options_.timeout); });
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
          mesh_->device_ends(), mesh_->device_context(), mesh_->device_expert(), mesh_->device_expert_shard(),
          mesh_->device_expert_grads(), mesh_->send_next().group, mesh_->recv_prev().group, mesh_->send_prev().group,
          mesh_->recv_next().group}) {
      if (group == nullptr) continue;
      group->Abort();
      groups += (groups.empty() ? "" : ", ") + group->group().Describe() + " (" + group->Describe() + ")";
    }
    if (groups.empty()) throw;
    const std::string stage = mesh_->stages() > 1 ? "stage " + std::to_string(mesh_->stage()) + " of " +
                                                        std::to_string(mesh_->stages()) + ": "
                                                  : "";
    throw runtime::StreamTimeout(stage + e.what() + "; the collectives of " + groups + " were aborted");
  }
}

template class ShardedEngine<kernels::Fp32>;
template class ShardedEngine<kernels::Bf16>;
template class ShardedEngine<kernels::Fp64>;

}  // namespace meshtrain::parallel
