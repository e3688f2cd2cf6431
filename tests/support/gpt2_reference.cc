#include "tests/support/gpt2_reference.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "worker/kernels/cpu/cpu_ops.h"

namespace meshtrain::testing {

using runtime::MemoryCategory;

template <class P>
Gpt2Reference<P>::Gpt2Reference(const api::ModelShape& shape, int max_batch, int max_seq, uint64_t seed,
                                 int vocab_multiple, runtime::CpuBackendOptions backend)
    : layout_(shape, 0, 1, vocab_multiple),
      max_batch_(max_batch),
      max_seq_(max_seq),
      backend_(std::make_shared<runtime::CpuBackend>(backend)),
      allocator_(&accounting_, backend_->DeviceMemory()),
      ops_(kernels::MakeCpuOps<P>()),
      stream_(backend_->NewStream("reference")) {
  if (max_seq > shape.seq_len) throw std::invalid_argument("sequence longer than the model's seqLen");
  const int heads = int(shape.heads), head_size = int(shape.hidden / shape.heads);
  types_ = model::TypesOf(*ops_, max_batch, max_seq, heads, head_size);
  types_.vocab_multiple = vocab_multiple;
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
  const int64_t block_bytes = model::BlockActivations<P>::Bytes(max_batch, max_seq, shape, tp, types_);
  blocks_memory_ = runtime::DeviceArray<std::byte>(&allocator_, block_bytes * shape.layers, MemoryCategory::kActivations);
  for (int l = 0; l < int(shape.layers); ++l) {
    blocks_.push_back(
        model::BlockActivations<P>::At(blocks_memory_.get() + block_bytes * l, max_batch, max_seq, shape, tp, types_));
  }
  head_memory_ = runtime::DeviceArray<std::byte>(
      &allocator_, model::HeadActivations<P>::Bytes(max_batch, max_seq, shape, tp, types_), MemoryCategory::kActivations);
  head_ = model::HeadActivations<P>::At(head_memory_.get(), max_batch, max_seq, shape, tp, types_);
  scratch_memory_ = runtime::DeviceArray<std::byte>(
      &allocator_, model::BlockScratch<P>::Bytes(max_batch, max_seq, shape, tp, types_, /*dropout=*/true),
      MemoryCategory::kActivations);
  scratch_ = model::BlockScratch<P>::At(scratch_memory_.get(), max_batch, max_seq, shape, tp, types_, true);

  std::vector<G> initial(static_cast<size_t>(total));
  model::InitParameters(initial.data(), layout_, seed);
  SetParams(initial);
  ZeroGrad();
}

template <class P>
Gpt2Reference<P>::~Gpt2Reference() {
  try {
    stream_->Synchronize();
  } catch (...) {  // reported by the call that failed
  }
}

template <class P>
void Gpt2Reference<P>::Stage(const int32_t* inputs, const int32_t* targets, int B, int T) {
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
model::Dims Gpt2Reference<P>::DimsOf(int B, int T) const {
  const api::ModelShape& s = layout_.shape();
  model::Dims d;
  d.B = B, d.T = T, d.C = int(s.hidden), d.NH = int(s.heads), d.V = s.vocab_size;
  d.tp = {0, 1, layout_.vocab_multiple()};
  return d;
}

template <class P>
runtime::DevicePtr<typename P::Act> Gpt2Reference<P>::Input(int l) const {
  return l == 0 ? encoded_.get() : blocks_[size_t(l) - 1].output;
}

template <class P>
void Gpt2Reference<P>::RunTrunk(const model::Dims& d) {
  const model::Context<P> k = Context();
  const auto root = model::RootParams<const A>::At(params_.get(), layout_);
  model::EmbedForward(k, encoded_.get(), tokens_.get(), root, d);
  for (int l = 0; l < int(layout_.shape().layers); ++l) {
    const auto params = model::BlockParams<const A>::At(params_.get() + layout_.Unit(1 + l).first, layout_);
    model::BlockForward(k, blocks_[size_t(l)], scratch_, Input(l), params, d.ForLayer(l));
  }
}

template <class P>
double Gpt2Reference<P>::Forward(const int32_t* inputs, const int32_t* targets, int B, int T,
                                 const Training* training) {
  if (targets == nullptr) throw std::invalid_argument("Forward needs targets");
  Stage(inputs, targets, B, T);
  model::Dims d = DimsOf(B, T);
  if (training != nullptr) d.dropout = training->dropout;
  can_backward_ = false;  // the activations of an earlier training forward are overwritten
  RunTrunk(d);
  const model::Context<P> k = Context();
  const auto root = model::RootParams<const A>::At(params_.get(), layout_);
  backend_->Zero(loss_.get(), 1, *stream_);
  const runtime::DevicePtr<const A> x = blocks_.back().output;
  if (training != nullptr) {
    // The head's backward runs in its forward: the residual stream's gradient starts here.
    backend_->Zero(scratch_.dresidual, d.N() * d.C, *stream_);
    const auto droot = model::RootParams<G>::At(grads_.get(), layout_);
    model::HeadForward(k, head_, x, root, targets_.get(), loss_.get(), training->loss_weight, &droot,
                       scratch_.dresidual, d);
  } else {
    model::HeadForward<P>(k, head_, x, root, targets_.get(), loss_.get(), 1.0, nullptr, nullptr, d);
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
void Gpt2Reference<P>::Backward() {
  if (!can_backward_) throw std::logic_error("Backward needs a training Forward before it");
  can_backward_ = false;
  const model::Context<P> k = Context();
  const model::Dims& d = trained_;
  for (int l = int(layout_.shape().layers) - 1; l >= 0; --l) {
    const int64_t unit = layout_.Unit(1 + l).first;
    model::BlockBackward(k, model::BlockParams<G>::At(grads_.get() + unit, layout_), scratch_, blocks_[size_t(l)],
                         Input(l), model::BlockParams<const A>::At(params_.get() + unit, layout_), d.ForLayer(l));
  }
  model::EmbedBackward(k, model::RootParams<G>::At(grads_.get(), layout_), scratch_.dresidual, tokens_.get(), d);
  stream_->Synchronize();
}

template <class P>
void Gpt2Reference<P>::ZeroGrad() {
  backend_->Zero(grads_.get(), grads_.size(), *stream_);
  stream_->Synchronize();
}

template <class P>
std::vector<typename P::Acc> Gpt2Reference<P>::Params() {
  std::vector<G> host(size_t(master_.size()));
  backend_->Download(host.data(), runtime::DevicePtr<const G>(master_.get()), master_.size(), *stream_);
  stream_->Synchronize();
  return host;
}

template <class P>
std::vector<typename P::Acc> Gpt2Reference<P>::Grads() {
  std::vector<G> host(size_t(grads_.size()));
  backend_->Download(host.data(), runtime::DevicePtr<const G>(grads_.get()), grads_.size(), *stream_);
  stream_->Synchronize();
  return host;
}

template <class P>
void Gpt2Reference<P>::SetParams(const std::vector<G>& params) {
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
std::vector<typename P::Acc> Gpt2Reference<P>::ModelElements(const std::vector<G>& layout_order) const {
  std::vector<G> model(size_t(layout_.shape().ParameterCount()));
  const std::vector<int64_t> at = layout_.WholeIndices(0, layout_.total());
  for (size_t i = 0; i < at.size(); ++i) {
    if (at[i] >= 0) model[size_t(at[i])] = layout_order[i];
  }
  return model;
}

template <class P>
std::vector<double> Gpt2Reference<P>::NextTokenProbabilities(const int32_t* tokens, int n) {
  Stage(tokens, nullptr, 1, n);
  const model::Dims d = DimsOf(1, n);
  can_backward_ = false;
  RunTrunk(d);
  model::HeadLogits(Context(), head_, runtime::DevicePtr<const A>(blocks_.back().output),
                    model::RootParams<const A>::At(params_.get(), layout_), n - 1, d);
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

template class Gpt2Reference<kernels::Fp32>;
template class Gpt2Reference<kernels::Bf16>;
template class Gpt2Reference<kernels::Fp64>;

}  // namespace meshtrain::testing
