#include "tests/support/model_reference.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "worker/kernels/cpu/cpu_ops.h"

namespace meshtrain::testing {

using runtime::MemoryCategory;

template <class P>
ModelReference<P>::ModelReference(const api::ModelShape& shape, int max_batch, int max_seq, uint64_t seed,
                                 int vocab_multiple, runtime::CpuBackendOptions backend, bool documents)
    : layout_(shape, 0, 1, vocab_multiple),
      max_batch_(max_batch),
      max_seq_(max_seq),
      backend_(std::make_shared<runtime::CpuBackend>(backend)),
      allocator_(&accounting_, backend_->DeviceMemory()),
      model_(model::MakeModel<P>(layout_)),
      ops_(kernels::MakeCpuOps<P>()),
      stream_(backend_->NewStream("reference")) {
  if (max_seq > shape.seq_len) throw std::invalid_argument("sequence longer than the model's seqLen");
  types_ = model::TypesOf(*ops_, max_batch, max_seq, shape, 1);
  types_.vocab_multiple = vocab_multiple;
  if (documents) {
    const api::ModelShape s = shape.Resolved();
    types_.attention_scratch_bytes =
        std::max(types_.attention_scratch_bytes,
                 model::DocumentAttentionScratchBytes<P>(max_batch, max_seq, int(s.heads), int(s.KvHeads()),
                                                         int(s.head_dim)));
  }
  const model::TpSlice tp{0, 1, vocab_multiple};
  const int64_t total = layout_.total(), N = int64_t(max_batch) * max_seq;

  master_ = runtime::DeviceArray<G>(&allocator_, total, MemoryCategory::kParams);
  params_ = runtime::DeviceArray<A>(&allocator_, total, MemoryCategory::kGathered);
  grads_ = runtime::DeviceArray<G>(&allocator_, total, MemoryCategory::kGrads);
  encoded_ = runtime::DeviceArray<A>(&allocator_, N * shape.hidden, MemoryCategory::kActivations);
  tokens_ = runtime::DeviceArray<int32_t>(&allocator_, N, MemoryCategory::kActivations);
  targets_ = runtime::DeviceArray<int32_t>(&allocator_, N, MemoryCategory::kActivations);
  loss_ = runtime::DeviceArray<double>(&allocator_, 1, MemoryCategory::kActivations);

  // Every block's activations kept, one head, one working set (with dropout's buffers, so
  // that any Forward may drop).
  const int64_t block_bytes = api::BlockActivationBytes(max_batch, max_seq, shape, 1, types_);
  blocks_memory_ = runtime::DeviceArray<std::byte>(&allocator_, block_bytes * shape.layers, MemoryCategory::kActivations);
  for (int l = 0; l < int(shape.layers); ++l) {
    blocks_.push_back(
        model::BlockActivations<P>::At(blocks_memory_.get() + block_bytes * l, max_batch, max_seq, shape, tp, types_));
  }
  head_memory_ = runtime::DeviceArray<std::byte>(&allocator_, api::HeadActivationBytes(max_batch, max_seq, shape, 0, 1, types_),
                                                 MemoryCategory::kActivations);
  head_ = model::HeadActivations<P>::At(head_memory_.get(), max_batch, max_seq, shape, tp, types_);
  scratch_memory_ = runtime::DeviceArray<std::byte>(
      &allocator_, api::BlockScratchBytes(max_batch, max_seq, shape, 1, types_, /*dropout=*/true),
      MemoryCategory::kActivations);
  const std::vector<api::Buffer> family = api::FamilyBuffers(max_seq, shape, types_);
  if (!family.empty()) {
    family_memory_ = runtime::DeviceArray<std::byte>(&allocator_, api::CarvedBytes(family), MemoryCategory::kActivations);
    family_buffers_ = model::PrepareFamilyBuffers<P>(*model_, *backend_, family_memory_.get(),
                                                     model::WindowPositions(max_seq), shape, types_, *stream_);
  }
  scratch_ = model::BlockScratch<P>::At(scratch_memory_.get(), max_batch, max_seq, shape, tp, types_, true);

  std::vector<G> initial(static_cast<size_t>(total));
  model::InitParameters(initial.data(), layout_, seed);
  SetParams(initial);
  ZeroGrad();
}

template <class P>
ModelReference<P>::~ModelReference() {
  try {
    stream_->Synchronize();
  } catch (...) {  // reported by the call that failed
  }
}

template <class P>
void ModelReference<P>::Stage(const int32_t* inputs, const int32_t* targets, int B, int T) {
  if (B < 1 || T < 1 || B > max_batch_ || T > max_seq_) {
    throw std::invalid_argument("a micro-batch of " + std::to_string(B) + " x " + std::to_string(T) +
                                " tokens, but the reference was built for at most " + std::to_string(max_batch_) +
                                " x " + std::to_string(max_seq_));
  }
  const int64_t N = int64_t(B) * T, V = layout_.shape().vocab_size;
  for (int64_t i = 0; i < N; ++i) {
    for (const int32_t* tokens : {inputs, targets}) {
      if (tokens != nullptr && (tokens[i] < 0 || tokens[i] >= V)) {
        throw std::out_of_range("token id " + std::to_string(tokens[i]) + " outside the vocabulary of " +
                                std::to_string(V));
      }
    }
  }
  // The uploads read host memory when they run: synchronize before the caller's arrays go.
  backend_->Upload(tokens_.get(), inputs, N, *stream_);
  if (targets != nullptr) backend_->Upload(targets_.get(), targets, N, *stream_);
  stream_->Synchronize();
}

template <class P>
model::Dims ModelReference<P>::DimsOf(int B, int T) const {
  return model::Dims::Of(layout_.shape(), B, T, {0, 1, layout_.vocab_multiple()});
}

template <class P>
model::Context<P> ModelReference<P>::Context() {
  return {*ops_, *stream_, nullptr, family_buffers_, nullptr, backend_.get(), documents_};
}

template <class P>
runtime::DevicePtr<typename P::Act> ModelReference<P>::Input(int l) const {
  return l == 0 ? encoded_.get() : blocks_[size_t(l) - 1].output;
}

template <class P>
void ModelReference<P>::RunTrunk(const model::Dims& d) {
  const model::Context<P> k = Context();
  model_->EmbedForward(k, encoded_.get(), tokens_.get(), params_.get(), d);
  for (int l = 0; l < int(layout_.shape().layers); ++l) {
    model_->BlockForward(k, blocks_[size_t(l)], scratch_, Input(l), params_.get() + layout_.Unit(1 + l).first,
                         d.ForLayer(l));
  }
}

template <class P>
double ModelReference<P>::Forward(const int32_t* inputs, const int32_t* targets, int B, int T,
                                 const Training* training) {
  if (targets == nullptr) throw std::invalid_argument("Forward needs targets");
  Stage(inputs, targets, B, T);
  model::Dims d = DimsOf(B, T);
  if (training != nullptr) d.dropout = training->dropout;
  can_backward_ = false;  // the activations of an earlier training forward are overwritten
  RunTrunk(d);
  const model::Context<P> k = Context();
  const int64_t head = layout_.Unit(layout_.head_unit()).first;
  backend_->Zero(loss_.get(), 1, *stream_);
  const runtime::DevicePtr<const A> x = blocks_.back().output;
  if (training != nullptr) {
    // The head's backward runs in its forward: the residual stream's gradient starts here.
    backend_->Zero(scratch_.dresidual, d.N() * d.C, *stream_);
    model_->HeadForward(k, head_, x, params_.get() + head, targets_.get(), loss_.get(),
                        double(training->loss_weight / float(d.N())), grads_.get() + head, scratch_.dresidual, d);
  } else {
    model_->HeadForward(k, head_, x, params_.get() + head, targets_.get(), loss_.get(), double(1.0f / float(d.N())),
                        nullptr, nullptr, d);
  }
  double loss = 0;
  backend_->Download(&loss, runtime::DevicePtr<const double>(loss_.get()), 1, *stream_);
  stream_->Synchronize();
  if (training != nullptr) {
    trained_ = d;
    can_backward_ = true;
  }
  return loss;
}

template <class P>
void ModelReference<P>::Backward() {
  if (!can_backward_) throw std::logic_error("Backward needs a training Forward before it");
  can_backward_ = false;
  const model::Context<P> k = Context();
  const model::Dims& d = trained_;
  for (int l = int(layout_.shape().layers) - 1; l >= 0; --l) {
    const int64_t unit = layout_.Unit(1 + l).first;
    model_->BlockBackward(k, grads_.get() + unit, scratch_, blocks_[size_t(l)], Input(l), params_.get() + unit,
                          d.ForLayer(l));
  }
  model_->EmbedBackward(k, grads_.get(), scratch_.dresidual, tokens_.get(), d);
  stream_->Synchronize();
}

template <class P>
void ModelReference<P>::ZeroGrad() {
  backend_->Zero(grads_.get(), grads_.size(), *stream_);
  stream_->Synchronize();
}

template <class P>
std::vector<typename P::Acc> ModelReference<P>::Params() {
  std::vector<G> host(size_t(master_.size()));
  backend_->Download(host.data(), runtime::DevicePtr<const G>(master_.get()), master_.size(), *stream_);
  stream_->Synchronize();
  return host;
}

template <class P>
std::vector<typename P::Acc> ModelReference<P>::Grads() {
  std::vector<G> host(size_t(grads_.size()));
  backend_->Download(host.data(), runtime::DevicePtr<const G>(grads_.get()), grads_.size(), *stream_);
  stream_->Synchronize();
  return host;
}

template <class P>
void ModelReference<P>::SetParams(const std::vector<G>& params) {
  if (int64_t(params.size()) != layout_.total()) {
    throw std::invalid_argument("SetParams: " + std::to_string(params.size()) + " elements for a layout of " +
                                std::to_string(layout_.total()));
  }
  backend_->Upload(master_.get(), params.data(), master_.size(), *stream_);
  ops_->Cast(params_.get(), master_.get(), master_.size(), *stream_);
  stream_->Synchronize();
  can_backward_ = false;  // the last forward ran on other weights
}

template <class P>
std::vector<typename P::Acc> ModelReference<P>::ModelElements(const std::vector<G>& layout_order) const {
  std::vector<G> model(size_t(layout_.shape().ParameterCount()));
  const std::vector<int64_t> at = layout_.WholeIndices(0, layout_.total());
  for (size_t i = 0; i < at.size(); ++i) {
    if (at[i] >= 0) model[size_t(at[i])] = layout_order[i];
  }
  return model;
}

template <class P>
std::vector<double> ModelReference<P>::NextTokenProbabilities(const int32_t* tokens, int n) {
  Stage(tokens, nullptr, 1, n);
  const model::Dims d = DimsOf(1, n);
  can_backward_ = false;
  RunTrunk(d);
  model_->HeadLogits(Context(), head_, runtime::DevicePtr<const A>(blocks_.back().output),
                     params_.get() + layout_.Unit(layout_.head_unit()).first, n - 1, d);
  const int64_t V = layout_.shape().vocab_size;
  std::vector<A> logits(size_t(layout_.padded_vocab_rows()));
  backend_->Download(logits.data(), runtime::DevicePtr<const A>(head_.logits), int64_t(logits.size()), *stream_);
  stream_->Synchronize();
  // The padding's logits are not the model's: the softmax is over the first V.
  double largest = -INFINITY, sum = 0;
  for (int64_t v = 0; v < V; ++v) largest = std::max(largest, double(logits[size_t(v)]));
  std::vector<double> probabilities(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) sum += probabilities[size_t(v)] = std::exp(double(logits[size_t(v)]) - largest);
  for (double& p : probabilities) p /= sum;
  return probabilities;
}

template class ModelReference<kernels::Fp32>;
template class ModelReference<kernels::Bf16>;
template class ModelReference<kernels::Fp64>;

}  // namespace meshtrain::testing
