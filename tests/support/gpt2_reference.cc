#include "worker/model/gpt2.h"

#include <algorithm>
#include <stdexcept>


namespace meshtrain::model {

template <class T>
Gpt2<T>::Gpt2(const api::ModelShape& shape, int max_batch, int max_seq, runtime::CachingAllocator* allocator)
    : layout_(shape), max_batch_(max_batch), max_seq_(max_seq) {
  if (allocator == nullptr) {
    own_allocator_ = std::make_unique<runtime::CachingAllocator>(&own_accounting_);
    allocator = own_allocator_.get();
  }
  if (max_seq > shape.seq_len) throw std::invalid_argument("sequence longer than the model's seqLen");
  using runtime::MemoryCategory;
  params_ = runtime::Buffer<T>(allocator, size_t(layout_.total()), MemoryCategory::kParams);
  grads_ = runtime::Buffer<T>(allocator, size_t(layout_.total()), MemoryCategory::kGrads);
  acts_buffer_ = runtime::Buffer<T>(allocator, size_t(ModelActivations<T>::Size(max_batch, max_seq, shape)),
                                    MemoryCategory::kActivations);
  acts_ = ModelActivations<T>::At(acts_buffer_.data(), max_batch, max_seq, shape);
}

template <class T>
double Gpt2<T>::Forward(const int32_t* inputs, const int32_t* targets, int B, int Tn) {
  const api::ModelShape& s = layout_.shape();
  batch_tokens_.Set(inputs, targets, B, Tn, max_batch_, max_seq_, s.vocab_size);
  const Dims d{B, Tn, int(s.hidden), int(s.heads), int(s.vocab_size)};
  const RootParams<const T> root = RootParams<const T>::At(params_.data(), layout_);
  EmbedForward(acts_.encoded, inputs, root, d);
  for (int l = 0; l < int(s.layers); ++l) {
    BlockForward(acts_.blocks[size_t(l)], acts_.Input(l),
                 BlockParams<const T>::At(params_.data() + layout_.Unit(1 + l).first, layout_), d);
  }
  return HeadForward(acts_.head, acts_.blocks.back().residual3, root, targets, d);
}

template <class T>
void Gpt2<T>::Backward(T loss_scale) {
  if (batch_tokens_.targets.empty()) throw std::logic_error("Backward needs a Forward with targets");
  const api::ModelShape& s = layout_.shape();
  const Dims d{batch_tokens_.B, batch_tokens_.Tn, int(s.hidden), int(s.heads), int(s.vocab_size)};
  const int64_t btc = int64_t(batch_tokens_.B) * batch_tokens_.Tn * s.hidden;
  const RootParams<const T> root = RootParams<const T>::At(params_.data(), layout_);
  const RootParams<T> droot = RootParams<T>::At(grads_.data(), layout_);
  // dresidual[out] holds the gradient of the current block's output, dresidual[in] of its input.
  int out = 0;
  std::fill(acts_.dresidual[out], acts_.dresidual[out] + btc, T(0));
  HeadBackward(droot, acts_.dresidual[out], acts_.dhead, acts_.head, acts_.blocks.back().residual3, root,
               batch_tokens_.targets.data(), loss_scale, d);
  for (int l = int(s.layers) - 1; l >= 0; --l) {
    const int in = 1 - out;
    std::fill(acts_.dresidual[in], acts_.dresidual[in] + btc, T(0));
    const int64_t unit = layout_.Unit(1 + l).first;
    BlockBackward(BlockParams<T>::At(grads_.data() + unit, layout_), acts_.dresidual[in], acts_.dblock,
                  acts_.dresidual[out], acts_.blocks[size_t(l)], acts_.Input(l),
                  BlockParams<const T>::At(params_.data() + unit, layout_), d);
    out = in;
  }
  EmbedBackward(droot, acts_.dresidual[out], batch_tokens_.inputs.data(), d);
}

template <class T>
void Gpt2<T>::ZeroGrad() {
  std::fill(grads_.begin(), grads_.end(), T(0));
}

template <class T>
const T* Gpt2<T>::Probabilities(int b, int t) const {
  return acts_.head.probs + (int64_t(b) * batch_tokens_.Tn + t) * layout_.shape().vocab_size;
}

template class Gpt2<float>;
template class Gpt2<double>;

}  // namespace meshtrain::model
