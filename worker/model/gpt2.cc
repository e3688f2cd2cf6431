#include "worker/model/gpt2.h"

#include <algorithm>
#include <stdexcept>

#include "worker/kernels/cpu/kernels.h"

namespace meshtrain::model {

namespace k = kernels::cpu;

template <class T>
Gpt2<T>::Gpt2(const api::ModelShape& shape, int max_batch, int max_seq, runtime::CachingAllocator* allocator)
    : layout_(shape), max_batch_(max_batch), max_seq_(max_seq) {
  if (allocator == nullptr) {
    own_allocator_ = std::make_unique<runtime::CachingAllocator>(&own_accounting_);
    allocator = own_allocator_.get();
  }
  if (max_seq > shape.seq_len) throw std::invalid_argument("sequence longer than the model's seqLen");
  const int64_t B = max_batch, Tn = max_seq, C = shape.hidden, L = shape.layers, NH = shape.heads,
                V = shape.vocab_size;
  int64_t next = 0;
  auto take = [&](int64_t n) {
    const int64_t at = next;
    next += n;
    return at;
  };
  at_.encoded = take(B * Tn * C);
  at_.ln1 = take(L * B * Tn * C);
  at_.ln1_mean = take(L * B * Tn);
  at_.ln1_rstd = take(L * B * Tn);
  at_.qkv = take(L * B * Tn * 3 * C);
  at_.atty = take(L * B * Tn * C);
  at_.preatt = take(L * B * NH * Tn * Tn);
  at_.att = take(L * B * NH * Tn * Tn);
  at_.attproj = take(L * B * Tn * C);
  at_.residual2 = take(L * B * Tn * C);
  at_.ln2 = take(L * B * Tn * C);
  at_.ln2_mean = take(L * B * Tn);
  at_.ln2_rstd = take(L * B * Tn);
  at_.fch = take(L * B * Tn * 4 * C);
  at_.fch_gelu = take(L * B * Tn * 4 * C);
  at_.fcproj = take(L * B * Tn * C);
  at_.residual3 = take(L * B * Tn * C);
  at_.lnf = take(B * Tn * C);
  at_.lnf_mean = take(B * Tn);
  at_.lnf_rstd = take(B * Tn);
  at_.logits = take(B * Tn * V);
  at_.probs = take(B * Tn * V);
  at_.losses = take(B * Tn);
  at_.total = next;
  using runtime::MemoryCategory;
  params_ = runtime::Buffer<T>(allocator, size_t(layout_.total()), MemoryCategory::kParams);
  grads_ = runtime::Buffer<T>(allocator, size_t(layout_.total()), MemoryCategory::kGrads);
  acts_ = runtime::Buffer<T>(allocator, size_t(at_.total), MemoryCategory::kActivations);
  dacts_ = runtime::Buffer<T>(allocator, size_t(at_.total), MemoryCategory::kActivations);
}

template <class T>
double Gpt2<T>::Forward(const int32_t* inputs, const int32_t* targets, int B, int Tn) {
  const api::ModelShape& s = layout_.shape();
  if (B > max_batch_ || Tn > max_seq_) throw std::invalid_argument("micro-batch larger than the model was sized for");
  for (int i = 0; i < B * Tn; ++i) {
    if (inputs[i] < 0 || inputs[i] >= s.vocab_size || (targets && (targets[i] < 0 || targets[i] >= s.vocab_size))) {
      throw std::out_of_range("token id outside the vocabulary");
    }
  }
  B_ = B, Tn_ = Tn;
  inputs_.assign(inputs, inputs + B * Tn);
  if (targets) targets_.assign(targets, targets + B * Tn);
  else targets_.clear();
  const int C = int(s.hidden), NH = int(s.heads), V = int(s.vocab_size);
  const int64_t BTC = int64_t(B) * Tn * C;
  // Per-layer slices use the allocated maximum sizes, so that layer l's slice does not move with B and Tn.
  const int64_t btc = int64_t(max_batch_) * max_seq_ * C, bt = int64_t(max_batch_) * max_seq_,
                bhtt = int64_t(max_batch_) * NH * max_seq_ * max_seq_;
  T* a = acts_.data();

  k::EncoderForward(a + at_.encoded, inputs, P(Param::kWte), P(Param::kWpe), B, Tn, C);
  for (int l = 0; l < int(s.layers); ++l) {
    const T* residual = l == 0 ? a + at_.encoded : a + at_.residual3 + (l - 1) * btc;
    T* ln1 = a + at_.ln1 + l * btc;
    T* qkv = a + at_.qkv + l * 3 * btc;
    T* atty = a + at_.atty + l * btc;
    T* attproj = a + at_.attproj + l * btc;
    T* residual2 = a + at_.residual2 + l * btc;
    T* ln2 = a + at_.ln2 + l * btc;
    T* fch = a + at_.fch + l * 4 * btc;
    T* fch_gelu = a + at_.fch_gelu + l * 4 * btc;
    T* fcproj = a + at_.fcproj + l * btc;
    T* residual3 = a + at_.residual3 + l * btc;
    k::LayerNormForward(ln1, a + at_.ln1_mean + l * bt, a + at_.ln1_rstd + l * bt, residual, P(Param::kLn1W, l),
                        P(Param::kLn1B, l), B, Tn, C);
    k::MatmulForward(qkv, ln1, P(Param::kQkvW, l), P(Param::kQkvB, l), B, Tn, C, 3 * C);
    k::AttentionForward(atty, a + at_.preatt + l * bhtt, a + at_.att + l * bhtt, qkv, B, Tn, C, NH);
    k::MatmulForward(attproj, atty, P(Param::kAttProjW, l), P(Param::kAttProjB, l), B, Tn, C, C);
    k::ResidualForward(residual2, residual, attproj, BTC);
    k::LayerNormForward(ln2, a + at_.ln2_mean + l * bt, a + at_.ln2_rstd + l * bt, residual2, P(Param::kLn2W, l),
                        P(Param::kLn2B, l), B, Tn, C);
    k::MatmulForward(fch, ln2, P(Param::kFcW, l), P(Param::kFcB, l), B, Tn, C, 4 * C);
    k::GeluForward(fch_gelu, fch, 4 * BTC);
    k::MatmulForward(fcproj, fch_gelu, P(Param::kFcProjW, l), P(Param::kFcProjB, l), B, Tn, 4 * C, C);
    k::ResidualForward(residual3, residual2, fcproj, BTC);
  }
  const T* last = a + at_.residual3 + (s.layers - 1) * btc;
  k::LayerNormForward(a + at_.lnf, a + at_.lnf_mean, a + at_.lnf_rstd, last, P(Param::kLnfW), P(Param::kLnfB), B, Tn, C);
  k::MatmulForward(a + at_.logits, a + at_.lnf, P(Param::kWte), static_cast<const T*>(nullptr), B, Tn, C, V);
  if (!targets) {
    // Probabilities only: targets of 0 make the loss meaningless but the softmax right.
    std::vector<int32_t> zeros(size_t(B) * Tn, 0);
    k::SoftmaxCrossEntropyForward(a + at_.probs, a + at_.losses, a + at_.logits, zeros.data(), B, Tn, V);
    return 0;
  }
  k::SoftmaxCrossEntropyForward(a + at_.probs, a + at_.losses, a + at_.logits, targets, B, Tn, V);
  double sum = 0;
  for (int i = 0; i < B * Tn; ++i) sum += double(a[at_.losses + i]);
  return sum / (B * Tn);
}

template <class T>
void Gpt2<T>::Backward(T loss_scale) {
  if (targets_.empty()) throw std::logic_error("Backward needs a Forward with targets");
  const api::ModelShape& s = layout_.shape();
  const int B = B_, Tn = Tn_, C = int(s.hidden), NH = int(s.heads), V = int(s.vocab_size);
  const int64_t BTC = int64_t(B) * Tn * C;
  const int64_t btc = int64_t(max_batch_) * max_seq_ * C, bt = int64_t(max_batch_) * max_seq_,
                bhtt = int64_t(max_batch_) * NH * max_seq_ * max_seq_;
  std::fill(dacts_.begin(), dacts_.end(), T(0));
  const T* a = acts_.data();
  T* d = dacts_.data();

  k::SoftmaxCrossEntropyBackward(d + at_.logits, a + at_.probs, targets_.data(), loss_scale / T(B * Tn), B, Tn, V);
  k::MatmulBackward(d + at_.lnf, G(Param::kWte), static_cast<T*>(nullptr), d + at_.logits, a + at_.lnf, P(Param::kWte),
                    B, Tn, C, V);
  const int64_t last = at_.residual3 + (s.layers - 1) * btc;
  k::LayerNormBackward(d + last, G(Param::kLnfW), G(Param::kLnfB), d + at_.lnf, a + last, P(Param::kLnfW),
                       a + at_.lnf_mean, a + at_.lnf_rstd, B, Tn, C);
  for (int l = int(s.layers) - 1; l >= 0; --l) {
    const int64_t residual = l == 0 ? at_.encoded : at_.residual3 + (l - 1) * btc;
    const int64_t ln1 = at_.ln1 + l * btc, qkv = at_.qkv + l * 3 * btc, atty = at_.atty + l * btc,
                  attproj = at_.attproj + l * btc, residual2 = at_.residual2 + l * btc, ln2 = at_.ln2 + l * btc,
                  fch = at_.fch + l * 4 * btc, fch_gelu = at_.fch_gelu + l * 4 * btc, fcproj = at_.fcproj + l * btc,
                  residual3 = at_.residual3 + l * btc;
    k::ResidualBackward(d + residual2, d + fcproj, d + residual3, BTC);
    k::MatmulBackward(d + fch_gelu, G(Param::kFcProjW, l), G(Param::kFcProjB, l), d + fcproj, a + fch_gelu,
                      P(Param::kFcProjW, l), B, Tn, 4 * C, C);
    k::GeluBackward(d + fch, a + fch, d + fch_gelu, 4 * BTC);
    k::MatmulBackward(d + ln2, G(Param::kFcW, l), G(Param::kFcB, l), d + fch, a + ln2, P(Param::kFcW, l), B, Tn, C,
                      4 * C);
    k::LayerNormBackward(d + residual2, G(Param::kLn2W, l), G(Param::kLn2B, l), d + ln2, a + residual2,
                         P(Param::kLn2W, l), a + at_.ln2_mean + l * bt, a + at_.ln2_rstd + l * bt, B, Tn, C);
    k::ResidualBackward(d + residual, d + attproj, d + residual2, BTC);
    k::MatmulBackward(d + atty, G(Param::kAttProjW, l), G(Param::kAttProjB, l), d + attproj, a + atty,
                      P(Param::kAttProjW, l), B, Tn, C, C);
    k::AttentionBackward(d + qkv, d + at_.preatt + l * bhtt, d + at_.att + l * bhtt, d + atty, a + qkv,
                         a + at_.att + l * bhtt, B, Tn, C, NH);
    k::MatmulBackward(d + ln1, G(Param::kQkvW, l), G(Param::kQkvB, l), d + qkv, a + ln1, P(Param::kQkvW, l), B, Tn, C,
                      3 * C);
    k::LayerNormBackward(d + residual, G(Param::kLn1W, l), G(Param::kLn1B, l), d + ln1, a + residual,
                         P(Param::kLn1W, l), a + at_.ln1_mean + l * bt, a + at_.ln1_rstd + l * bt, B, Tn, C);
  }
  k::EncoderBackward(G(Param::kWte), G(Param::kWpe), d + at_.encoded, inputs_.data(), B, Tn, C);
}

template <class T>
void Gpt2<T>::ZeroGrad() {
  std::fill(grads_.begin(), grads_.end(), T(0));
}

template <class T>
const T* Gpt2<T>::Probabilities(int b, int t) const {
  return acts_.data() + at_.probs + (int64_t(b) * Tn_ + t) * layout_.shape().vocab_size;
}

template class Gpt2<float>;
template class Gpt2<double>;

}  // namespace meshtrain::model
