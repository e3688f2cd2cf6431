#include "worker/parallel/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "worker/kernels/cpu/kernels.h"

namespace meshtrain::parallel {

const char* OpName(Op op) {
  switch (op) {
    case Op::kGather: return "gather";
    case Op::kForward: return "forward";
    case Op::kRecompute: return "recompute";
    case Op::kBackward: return "backward";
    case Op::kReduceScatter: return "reduce-scatter";
  }
  return "?";
}

ShardedEngine::ShardedEngine(const api::ModelShape& shape, std::shared_ptr<const Mesh> mesh, int batch, int seq,
                             uint64_t seed, runtime::MemoryAccounting* accounting, const EngineOptions& options)
    : layout_(shape, mesh->tp_rank(), mesh->tp_size()),
      mesh_(std::move(mesh)),
      tp_(mesh_->tp() ? std::make_unique<TensorParallel>(mesh_->tp()) : nullptr),
      batch_(batch),
      seq_(seq),
      allocator_(accounting, runtime::HostMemory(), options.memory_limit),
      dropout_(options.dropout),
      dropout_seed_(options.dropout_seed) {
  if (seq > shape.seq_len) throw std::invalid_argument("sequence longer than the model's seqLen");
  for (int u = 0; u < layout_.units(); ++u) {
    units_.push_back(std::make_unique<FlatUnit>(layout_, u, mesh_->shard_size(), mesh_->shard_rank(), seed, &allocator_));
  }
  grads_done_.resize(units_.size());
  acts_ = std::make_unique<ActivationStore>(shape, batch, seq, options.activations, &allocator_,
                                            model::TpSlice{mesh_->tp_rank(), mesh_->tp_size()});
}

void ShardedEngine::TensorParallel::AllReduceSum(float* data, int64_t n) {
  const auto start = std::chrono::steady_clock::now();
  group_->AllReduce(data, data, size_t(n), comm::DataType::kFloat32, comm::ReduceOp::kSum)->Wait();
  seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void ShardedEngine::TensorParallel::AllGather(const float* in, float* out, int64_t n) {
  const auto start = std::chrono::steady_clock::now();
  group_->AllGather(in, out, size_t(n), comm::DataType::kFloat32)->Wait();
  seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

model::Dims ShardedEngine::DimsOf(int B, int Tn) {
  const api::ModelShape& s = layout_.shape();
  model::Dims d{B, Tn, int(s.hidden), int(s.heads), int(s.vocab_size), tp_.get()};
  if (training_ && dropout_ > 0) {
    namespace k = kernels::cpu;
    d.dropout = {dropout_, k::MixKey(k::MixKey(dropout_seed_, uint64_t(training_->step)), uint64_t(training_->micro)),
                 int64_t(mesh_->data_parallel_rank()) * batch_};
  }
  return d;
}

ShardedEngine::~ShardedEngine() {
  // The streams' threads must not outlive the units and buffers their tasks touch.
  try {
    Drain();
  } catch (...) {  // already reported by the call that failed
  }
}

void ShardedEngine::ReleaseRoot() {
  if (!root_held_) return;
  units_[0]->FreeParams(compute_);
  root_held_ = false;
  Drain();
}

void ShardedEngine::Drain() {
  std::exception_ptr failure;
  auto synchronize = [&failure](auto&& wait) {
    try {
      wait();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  };
  synchronize([this] { compute_.Synchronize(); });
  synchronize([this] { comm_.Synchronize(); });
  if (acts_) synchronize([this] { acts_->Synchronize(); });
  if (failure) std::rethrow_exception(failure);
}

template <class F>
void ShardedEngine::Compute(Op op, int unit, F&& f) {
  compute_.Enqueue([this, op, unit, f = std::forward<F>(f)] {
    if (observer_) observer_->Begin(op, unit);
    f();
    if (observer_) observer_->End(op, unit);
  });
}

void ShardedEngine::GatherBlock(int l) {
  FlatUnit& unit = Block(l);
  comm_.Wait(slot_free_[l % 2]);
  comm_.Enqueue([this, u = unit.index()] {
    const int now = ++unsharded_blocks_;
    int peak = peak_unsharded_blocks_.load();
    while (now > peak && !peak_unsharded_blocks_.compare_exchange_weak(peak, now)) {
    }
    if (observer_) observer_->Begin(Op::kGather, u);
  });
  unit.Gather(mesh_->shard(), comm_, &comm_seconds_);
  comm_.Enqueue([this, u = unit.index()] {
    if (observer_) observer_->End(Op::kGather, u);
  });
}

void ShardedEngine::GatherRoot() {
  comm_.Enqueue([this] {
    if (observer_) observer_->Begin(Op::kGather, 0);
  });
  units_[0]->Gather(mesh_->shard(), comm_, &comm_seconds_);
  comm_.Enqueue([this] {
    if (observer_) observer_->End(Op::kGather, 0);
  });
}

void ShardedEngine::ReleaseBlock(int l) {
  Block(l).FreeParams(compute_);
  compute_.Enqueue([this] { --unsharded_blocks_; });
  slot_free_[l % 2].Record(compute_);
}

double ShardedEngine::Forward(const int32_t* inputs, const int32_t* targets, int B, int Tn,
                              const train::MicroBatchKey* training) {
  const api::ModelShape& s = layout_.shape();
  batch_tokens_.Set(inputs, targets, B, Tn, batch_, seq_, s.vocab_size);
  training_ = training ? std::optional(*training) : std::nullopt;
  const model::Dims d = DimsOf(B, Tn);
  const int L = int(s.layers);
  FlatUnit& root = *units_[0];
  if (!root_held_) GatherRoot();
  GatherBlock(0);
  compute_.Wait(root.ready(), &exposed_seconds_);
  Compute(Op::kForward, 0, [this, &root, d] {
    model::EmbedForward(acts_->embedded(), batch_tokens_.inputs.data(), model::RootParams<const float>::At(root.params(), layout_), d);
  });
  for (int l = 0; l < L; ++l) {
    if (l + 1 < L) GatherBlock(l + 1);
    FlatUnit& unit = Block(l);
    compute_.Wait(unit.ready(), &exposed_seconds_);
    acts_->BeforeForward(l, compute_);
    Compute(Op::kForward, unit.index(), [this, &unit, l, d = d.ForLayer(l)] {
      model::BlockForward(acts_->ForwardOutputs(l), acts_->Input(l),
                          model::BlockParams<const float>::At(unit.params(), layout_), d);
    });
    acts_->AfterForward(l, compute_);
    ReleaseBlock(l);
  }
  Compute(Op::kForward, 0, [this, &root, d] {
    loss_ = model::HeadForward(acts_->head, acts_->head_input(),
                               model::RootParams<const float>::At(root.params(), layout_),
                               batch_tokens_.targets_or_null(), d);
  });
  // A training forward keeps the root for its backward (FSDP2 keeps the root unsharded
  // after forward too): wte is the largest unit, and this saves a gather per micro-batch.
  root_held_ = training != nullptr && targets != nullptr;
  if (!root_held_) root.FreeParams(compute_);
  Drain();
  return loss_;
}

void ShardedEngine::Backward(float loss_scale, bool last) {
  if (batch_tokens_.targets.empty()) throw std::logic_error("Backward needs a Forward with targets");
  norm_current_ = false;
  const api::ModelShape& s = layout_.shape();
  const model::Dims d = DimsOf(batch_tokens_.B, batch_tokens_.Tn);
  const int L = int(s.layers);
  const int64_t btc = int64_t(batch_tokens_.B) * batch_tokens_.Tn * s.hidden;
  FlatUnit& root = *units_[0];
  if (!root_held_) GatherRoot();
  root_held_ = false;  // freed at the end of this backward
  GatherBlock(L - 1);
  compute_.Wait(root.ready(), &exposed_seconds_);
  // dresidual[out] holds the gradient of the current block's output, dresidual[in] of its input.
  int out = 0;
  Compute(Op::kBackward, 0, [this, &root, d, btc, out, loss_scale] {
    root.AllocateGrads();
    std::fill(acts_->dresidual[out], acts_->dresidual[out] + btc, 0.0f);
    model::HeadBackward(model::RootParams<float>::At(root.grads(), layout_), acts_->dresidual[out], acts_->dhead,
                        acts_->head, acts_->head_input(),
                        model::RootParams<const float>::At(root.params(), layout_), batch_tokens_.targets.data(), loss_scale, d);
  });
  for (int l = L - 1; l >= 0; --l) {
    if (l > 0) GatherBlock(l - 1);
    FlatUnit& unit = Block(l);
    const int in = 1 - out;
    acts_->BeforeBackward(l, compute_);
    compute_.Wait(unit.ready(), &exposed_seconds_);
    if (acts_->recompute()) {
      Compute(Op::kRecompute, unit.index(), [this, &unit, l, d = d.ForLayer(l)] {
        model::BlockForward(acts_->Saved(l), acts_->Input(l), model::BlockParams<const float>::At(unit.params(), layout_), d);
      });
    }
    Compute(Op::kBackward, unit.index(), [this, &unit, l, d = d.ForLayer(l), btc, in, out] {
      unit.AllocateGrads();
      std::fill(acts_->dresidual[in], acts_->dresidual[in] + btc, 0.0f);
      model::BlockBackward(model::BlockParams<float>::At(unit.grads(), layout_), acts_->dresidual[in], acts_->dblock,
                           acts_->dresidual[out], acts_->Saved(l), acts_->Input(l),
                           model::BlockParams<const float>::At(unit.params(), layout_), d);
    });
    acts_->AfterBackward(l, compute_);
    ReleaseBlock(l);
    grads_done_[size_t(unit.index())].Record(compute_);
    comm_.Wait(grads_done_[size_t(unit.index())]);
    comm_.Enqueue([this, u = unit.index()] {
      if (observer_) observer_->Begin(Op::kReduceScatter, u);
    });
    unit.ReduceGrads(mesh_->shard(), comm_, &comm_seconds_);
    comm_.Enqueue([this, u = unit.index()] {
      if (observer_) observer_->End(Op::kReduceScatter, u);
    });
    if (last) unit.AllReduceReplicas(mesh_->replica(), comm_, &comm_seconds_);
    out = in;
  }
  Compute(Op::kBackward, 0, [this, &root, d, out] {
    model::EmbedBackward(model::RootParams<float>::At(root.grads(), layout_), acts_->dresidual[out], batch_tokens_.inputs.data(), d);
  });
  root.FreeParams(compute_);
  grads_done_[0].Record(compute_);
  comm_.Wait(grads_done_[0]);
  root.ReduceGrads(mesh_->shard(), comm_, &comm_seconds_);
  if (last) root.AllReduceReplicas(mesh_->replica(), comm_, &comm_seconds_);
  replicas_reduced_ = last;
  Drain();
}

void ShardedEngine::ZeroGrad() {
  norm_current_ = false;
  replicas_reduced_ = false;
  for (auto& unit : units_) unit->ZeroShardGrads();
}

void ShardedEngine::ReduceGradients(comm::Communicator*) {
  norm_current_ = false;
  if (replicas_reduced_) {  // the last Backward did it
    replicas_reduced_ = false;
    return;
  }
  for (auto& unit : units_) unit->AllReduceReplicas(mesh_->replica(), comm_, &comm_seconds_);
  Drain();
}

double ShardedEngine::GradNorm() {
  if (!norm_current_) {
    double squares = 0;
    for (auto& unit : units_) squares += unit->ShardGradSquares(/*tp_replicated=*/mesh_->tp_rank() == 0);
    // Each rank's squares are one term of the sum; fp32 carries the norm well enough to clip by.
    for (comm::Communicator* group : {mesh_->shard(), mesh_->tp()}) {
      if (group == nullptr) continue;
      float partial = float(squares);
      group->AllReduce(&partial, &partial, 1, comm::DataType::kFloat32, comm::ReduceOp::kSum)->Wait();
      squares = partial;
    }
    norm_ = std::sqrt(squares);
    norm_current_ = true;
  }
  return norm_;
}

void ShardedEngine::Update(const train::OptimizerStep& step) {
  ReleaseRoot();  // its gathered copy is about to go stale
  const double norm = GradNorm();
  const float clip = step.max_norm > 0 && norm > step.max_norm ? float(step.max_norm / norm) : 1.0f;
  for (auto& unit : units_) unit->Update(step, clip);
  norm_current_ = false;
}

std::vector<float> ShardedEngine::NextTokenProbabilities(const int32_t* tokens, int n) {
  Forward(tokens, nullptr, 1, n);
  const int64_t V = layout_.shape().vocab_size;
  const model::TpSlice slice{mesh_->tp_rank(), mesh_->tp_size()};
  const float* probs = acts_->head.probs + int64_t(n - 1) * slice.vocab(V);
  if (!tp_) return std::vector<float>(probs, probs + V);
  // The slices differ in size by at most one: gather them padded to the largest.
  const int64_t widest = (V + slice.size - 1) / slice.size;
  std::vector<float> mine(static_cast<size_t>(widest)), all(static_cast<size_t>(widest * slice.size)), whole;
  std::copy(probs, probs + slice.vocab(V), mine.begin());
  tp_->AllGather(mine.data(), all.data(), widest);
  for (int r = 0; r < slice.size; ++r) {
    const model::TpSlice other{r, slice.size};
    whole.insert(whole.end(), all.begin() + r * widest, all.begin() + r * widest + other.vocab(V));
  }
  return whole;
}

std::vector<float> ShardedEngine::Weights() {
  ReleaseRoot();
  // This rank's TP slice, gathered over its shard group unit by unit.
  std::vector<float> local(size_t(layout_.total()));
  for (auto& unit : units_) {
    unit->Gather(mesh_->shard(), comm_, &comm_seconds_);
    Drain();
    std::memcpy(local.data() + unit->begin(), unit->params(), size_t(unit->numel()) * sizeof(float));
    unit->FreeParams(comm_);
  }
  Drain();
  if (!tp_) return local;
  // Each slice in its place of the whole model (the whole tensors from TP rank 0), then
  // summed over the TP group: every element comes from one rank, the rest add zeros.
  std::vector<float> whole(size_t(layout_.shape().ParameterCount()), 0.0f);
  for (const model::ParamTensor& t : layout_.tensors()) {
    if (t.tp_replicated() && mesh_->tp_rank() != 0) continue;
    const std::vector<int64_t> at = layout_.WholeIndices(t.offset, t.offset + t.size);
    for (size_t i = 0; i < at.size(); ++i) whole[size_t(at[i])] = local[size_t(t.offset) + i];
  }
  tp_->AllReduceSum(whole.data(), int64_t(whole.size()));
  return whole;
}

void ShardedEngine::Snapshot(train::ShardState* into) {
  into->tp_rank = mesh_->tp_rank();
  into->shard_rank = mesh_->shard_rank();
  into->replica = mesh_->replica_index();
  size_t total = 0;
  for (auto& unit : units_) total += size_t(unit->shard_real());
  for (std::vector<float>* part : {&into->master, &into->m, &into->v}) part->resize(total);
  size_t at = 0;
  for (auto& unit : units_) {
    const int64_t n = unit->shard_real();
    const float* from[3] = {unit->master(), unit->adam_m(), unit->adam_v()};
    float* to[3] = {into->master.data() + at, into->m.data() + at, into->v.data() + at};
    // The step waits for this copy: spread it over the cores.
#pragma omp parallel for collapse(2)
    for (int part = 0; part < 3; ++part) {
      for (int64_t chunk = 0; chunk < (n + 65535) / 65536; ++chunk) {
        const int64_t begin = chunk * 65536, count = std::min<int64_t>(65536, n - begin);
        std::memcpy(to[part] + begin, from[part] + begin, size_t(count) * sizeof(float));
      }
    }
    at += size_t(n);
  }
}

void ShardedEngine::Restore(const train::WholeState& whole) {
  ReleaseRoot();
  for (auto& unit : units_) {
    const int64_t from = unit->begin() + unit->shard_begin();
    const std::vector<int64_t> at = layout_.WholeIndices(from, from + unit->shard_real());
    for (size_t i = 0; i < at.size(); ++i) {
      unit->master()[i] = whole.master[size_t(at[i])];
      unit->adam_m()[i] = whole.m[size_t(at[i])];
      unit->adam_v()[i] = whole.v[size_t(at[i])];
    }
  }
  norm_current_ = false;
}

train::CommStats ShardedEngine::comm_stats() const {
  train::CommStats stats = comm_seconds_;
  if (tp_) stats.all_reduce += tp_->seconds;  // the layers' all-reduces and gathers
  stats.exposed = exposed_seconds_;
  stats.copy = acts_->copy_seconds();
  stats.copy_exposed = acts_->copy_wait_seconds();
  return stats;
}

std::string ShardedEngine::Describe() const {
  const int S = mesh_->shard_size();
  std::string activations = "";
  if (acts_->policy().offload) {
    activations = "; activations: block inputs checkpointed, " + std::to_string(acts_->slots()) +
                  " kept, the rest offloaded (horizon " + std::to_string(acts_->policy().horizon) + ")";
  } else if (acts_->policy().checkpointing) {
    activations = "; activations: block inputs checkpointed, blocks recomputed in backward";
  }
  return "fp32 FSDP, " + mesh_->Describe() + activations + "; " + std::to_string(units_.size()) + " units" +
         (S == 1 ? ", each whole on this rank" : ", each split in " + std::to_string(S) + " shards of " +
                                                     std::to_string(units_[1 % units_.size()]->shard_numel()) +
                                                     " elements (a block)") +
         (tp_ ? ", of this rank's tensor-parallel slice" : "");
}

}  // namespace meshtrain::parallel
