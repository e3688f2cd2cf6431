#include "worker/model/gpt2_cuda.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace meshtrain::model {

namespace k = kernels::cuda;
using runtime::MemoryCategory;
using runtime::cuda::Check;

template <class T>
T* Gpt2Cuda::Take(int64_t n, MemoryCategory category) {
  return static_cast<T*>(allocator_.Allocate(size_t(n) * sizeof(T), category));
}

Gpt2Cuda::Gpt2Cuda(const api::ModelShape& shape, int max_batch, int max_seq, uint64_t seed,
                   runtime::MemoryAccounting* accounting)
    : layout_(shape), max_batch_(max_batch), max_seq_(max_seq), allocator_(accounting, runtime::cuda::DeviceMemory()) {
  if (max_seq > shape.seq_len) throw std::invalid_argument("sequence longer than the model's seqLen");
  const int64_t P = layout_.total(), L = shape.layers, N = int64_t(max_batch) * max_seq, C = shape.hidden,
                NH = shape.heads, V = shape.vocab_size, TT = int64_t(max_seq) * max_seq;
  params_ = Take<bf16>(P, MemoryCategory::kParams);
  master_ = Take<float>(P, MemoryCategory::kParams);
  grads_ = Take<float>(P, MemoryCategory::kGrads);
  m_ = Take<float>(P, MemoryCategory::kOptimizer);
  v_ = Take<float>(P, MemoryCategory::kOptimizer);
  scalars_ = Take<float>(2, MemoryCategory::kOptimizer);
  inputs_ = Take<int32_t>(N, MemoryCategory::kActivations);
  targets_ = Take<int32_t>(N, MemoryCategory::kActivations);
  const auto A = MemoryCategory::kActivations;
  kept_ = {Take<bf16>(L * N * C, A),      Take<bf16>(L * N * 3 * C, A), Take<bf16>(L * N * 3 * C, A),
           Take<bf16>(L * max_batch * NH * TT, A), Take<bf16>(L * N * C, A), Take<bf16>(L * N * C, A),
           Take<bf16>(L * N * C, A),      Take<bf16>(L * N * 4 * C, A), Take<bf16>(L * N * 4 * C, A),
           Take<bf16>(L * N * C, A),      Take<float>(L * N, A),        Take<float>(L * N, A),
           Take<float>(L * N, A),         Take<float>(L * N, A)};
  encoded_ = Take<bf16>(N * C, A);
  lnf_ = Take<bf16>(N * C, A);
  logits_ = Take<bf16>(N * V, A);
  scratch_ = Take<bf16>(N * C, A);
  heads_ = Take<bf16>(N * C, A);
  lnf_mean_ = Take<float>(N, A);
  lnf_rstd_ = Take<float>(N, A);
  losses_ = Take<float>(N, A);
  dresidual_ = Take<bf16>(N * C, A);
  dln_ = Take<bf16>(N * C, A);
  datty_ = Take<bf16>(N * C, A);
  dqkv_ = Take<bf16>(N * 3 * C, A);
  dfch_ = Take<bf16>(N * 4 * C, A);
  dfch_gelu_ = Take<bf16>(N * 4 * C, A);
  dqkvr_ = Take<bf16>(N * 3 * C, A);
  datt_ = Take<bf16>(max_batch * NH * TT, A);
  dy_ = Take<bf16>(N * C, A);

  std::vector<float> init(static_cast<size_t>(P));
  InitParameters(init.data(), layout_, seed);
  Check(cudaMemcpyAsync(master_, init.data(), size_t(P) * sizeof(float), cudaMemcpyHostToDevice, stream_.handle()),
        "upload of the initial weights");
  k::ToBf16(params_, master_, P, stream_.handle());
  Check(cudaMemsetAsync(m_, 0, size_t(P) * sizeof(float), stream_.handle()), "zeroing AdamW state");
  Check(cudaMemsetAsync(v_, 0, size_t(P) * sizeof(float), stream_.handle()), "zeroing AdamW state");
  ZeroGrad();
  stream_.Synchronize();  // `init` goes out of scope
}

double Gpt2Cuda::Forward(const int32_t* inputs, const int32_t* targets, int B, int Tn) {
  const api::ModelShape& s = layout_.shape();
  if (B > max_batch_ || Tn > max_seq_) throw std::invalid_argument("micro-batch larger than the model was sized for");
  const int C = int(s.hidden), NH = int(s.heads), V = int(s.vocab_size), N = B * Tn;
  for (int i = 0; i < N; ++i) {
    if (inputs[i] < 0 || inputs[i] >= V || (targets && (targets[i] < 0 || targets[i] >= V))) {
      throw std::out_of_range("token id outside the vocabulary");
    }
  }
  B_ = B, Tn_ = Tn;
  has_targets_ = targets != nullptr;
  cudaStream_t st = stream_.handle();
  Check(cudaMemcpyAsync(inputs_, inputs, size_t(N) * sizeof(int32_t), cudaMemcpyHostToDevice, st), "upload of inputs");
  if (targets) {
    Check(cudaMemcpyAsync(targets_, targets, size_t(N) * sizeof(int32_t), cudaMemcpyHostToDevice, st),
          "upload of targets");
  }
  // Per-layer slices use the allocated maximum sizes, so that they do not move with B and Tn.
  const int64_t nc = int64_t(max_batch_) * max_seq_ * C, n = int64_t(max_batch_) * max_seq_,
                htt = int64_t(max_batch_) * NH * max_seq_ * max_seq_;
  k::EncoderForward(encoded_, inputs_, P(Param::kWte), P(Param::kWpe), N, Tn, C, st);
  for (int l = 0; l < int(s.layers); ++l) {
    const bf16* residual = l == 0 ? encoded_ : kept_.residual3 + (l - 1) * nc;
    bf16 *ln1 = kept_.ln1 + l * nc, *qkv = kept_.qkv + l * 3 * nc, *qkvr = kept_.qkvr + l * 3 * nc,
         *att = kept_.att + l * htt, *atty = kept_.atty + l * nc, *residual2 = kept_.residual2 + l * nc,
         *ln2 = kept_.ln2 + l * nc, *fch = kept_.fch + l * 4 * nc, *fch_gelu = kept_.fch_gelu + l * 4 * nc,
         *residual3 = kept_.residual3 + l * nc;
    k::LayerNormForward(ln1, kept_.ln1_mean + l * n, kept_.ln1_rstd + l * n, residual, P(Param::kLn1W, l),
                        P(Param::kLn1B, l), N, C, st);
    k::MatmulForward(blas_, qkv, ln1, P(Param::kQkvW, l), P(Param::kQkvB, l), N, C, 3 * C, st);
    k::AttentionForward(blas_, atty, qkvr, att, heads_, qkv, B, Tn, C, NH, st);
    k::MatmulForward(blas_, scratch_, atty, P(Param::kAttProjW, l), P(Param::kAttProjB, l), N, C, C, st);
    k::ResidualForward(residual2, residual, scratch_, int64_t(N) * C, st);
    k::LayerNormForward(ln2, kept_.ln2_mean + l * n, kept_.ln2_rstd + l * n, residual2, P(Param::kLn2W, l),
                        P(Param::kLn2B, l), N, C, st);
    k::MatmulForward(blas_, fch, ln2, P(Param::kFcW, l), P(Param::kFcB, l), N, C, 4 * C, st);
    k::GeluForward(fch_gelu, fch, int64_t(N) * 4 * C, st);
    k::MatmulForward(blas_, scratch_, fch_gelu, P(Param::kFcProjW, l), P(Param::kFcProjB, l), N, 4 * C, C, st);
    k::ResidualForward(residual3, residual2, scratch_, int64_t(N) * C, st);
  }
  const bf16* last = kept_.residual3 + (s.layers - 1) * nc;
  k::LayerNormForward(lnf_, lnf_mean_, lnf_rstd_, last, P(Param::kLnfW), P(Param::kLnfB), N, C, st);
  k::MatmulForward(blas_, logits_, lnf_, P(Param::kWte), nullptr, N, C, V, st);
  if (!targets) return 0;
  k::CrossEntropy(losses_, nullptr, logits_, targets_, 0.0f, N, V, st);
  host_losses_.resize(size_t(N));
  Check(cudaMemcpyAsync(host_losses_.data(), losses_, size_t(N) * sizeof(float), cudaMemcpyDeviceToHost, st),
        "download of losses");
  stream_.Synchronize();
  double sum = 0;
  for (float loss : host_losses_) sum += loss;
  return sum / N;
}

void Gpt2Cuda::Backward(float loss_scale) {
  if (!has_targets_) throw std::logic_error("Backward needs a Forward with targets");
  squares_current_ = false;
  const api::ModelShape& s = layout_.shape();
  const int B = B_, Tn = Tn_, C = int(s.hidden), NH = int(s.heads), V = int(s.vocab_size), N = B * Tn;
  const int64_t nc = int64_t(max_batch_) * max_seq_ * C, n = int64_t(max_batch_) * max_seq_,
                htt = int64_t(max_batch_) * NH * max_seq_ * max_seq_, NC = int64_t(N) * C;
  cudaStream_t st = stream_.handle();
  auto zero = [&](bf16* buffer, int64_t count) {
    Check(cudaMemsetAsync(buffer, 0, size_t(count) * sizeof(bf16), st), "zeroing a gradient buffer");
  };
  // The logits become their own gradient.
  k::CrossEntropy(losses_, logits_, logits_, targets_, loss_scale / float(N), N, V, st);
  zero(dln_, NC);
  k::MatmulBackward(blas_, dln_, G(Param::kWte), nullptr, logits_, lnf_, P(Param::kWte), N, C, V, st);
  zero(dresidual_, NC);
  const bf16* last = kept_.residual3 + (s.layers - 1) * nc;
  k::LayerNormBackward(dresidual_, G(Param::kLnfW), G(Param::kLnfB), dln_, last, P(Param::kLnfW), lnf_mean_,
                       lnf_rstd_, N, C, st);
  // dresidual_ carries the gradient of the residual stream down through the blocks; each
  // residual addition hands it unchanged to its branch (as dout) and to its input.
  for (int l = int(s.layers) - 1; l >= 0; --l) {
    const bf16* residual = l == 0 ? encoded_ : kept_.residual3 + (l - 1) * nc;
    const bf16 *ln1 = kept_.ln1 + l * nc, *qkvr = kept_.qkvr + l * 3 * nc, *att = kept_.att + l * htt,
               *atty = kept_.atty + l * nc, *residual2 = kept_.residual2 + l * nc, *ln2 = kept_.ln2 + l * nc,
               *fch = kept_.fch + l * 4 * nc, *fch_gelu = kept_.fch_gelu + l * 4 * nc;
    zero(dfch_gelu_, 4 * NC);
    k::MatmulBackward(blas_, dfch_gelu_, G(Param::kFcProjW, l), G(Param::kFcProjB, l), dresidual_, fch_gelu,
                      P(Param::kFcProjW, l), N, 4 * C, C, st);
    zero(dfch_, 4 * NC);
    k::GeluBackward(dfch_, fch, dfch_gelu_, 4 * NC, st);
    zero(dln_, NC);
    k::MatmulBackward(blas_, dln_, G(Param::kFcW, l), G(Param::kFcB, l), dfch_, ln2, P(Param::kFcW, l), N, C, 4 * C,
                      st);
    k::LayerNormBackward(dresidual_, G(Param::kLn2W, l), G(Param::kLn2B, l), dln_, residual2, P(Param::kLn2W, l),
                         kept_.ln2_mean + l * n, kept_.ln2_rstd + l * n, N, C, st);
    zero(datty_, NC);
    k::MatmulBackward(blas_, datty_, G(Param::kAttProjW, l), G(Param::kAttProjB, l), dresidual_, atty,
                      P(Param::kAttProjW, l), N, C, C, st);
    zero(dqkv_, 3 * NC);
    k::AttentionBackward(blas_, dqkv_, dqkvr_, datt_, dy_, datty_, qkvr, att, B, Tn, C, NH, st);
    zero(dln_, NC);
    k::MatmulBackward(blas_, dln_, G(Param::kQkvW, l), G(Param::kQkvB, l), dqkv_, ln1, P(Param::kQkvW, l), N, C, 3 * C,
                      st);
    k::LayerNormBackward(dresidual_, G(Param::kLn1W, l), G(Param::kLn1B, l), dln_, residual, P(Param::kLn1W, l),
                         kept_.ln1_mean + l * n, kept_.ln1_rstd + l * n, N, C, st);
  }
  k::EncoderBackward(G(Param::kWte), G(Param::kWpe), dresidual_, inputs_, N, Tn, C, st);
}

void Gpt2Cuda::ZeroGrad() {
  squares_current_ = false;
  Check(cudaMemsetAsync(grads_, 0, size_t(layout_.total()) * sizeof(float), stream_.handle()), "zeroing gradients");
}

void Gpt2Cuda::SumSquares() {
  if (squares_current_) return;
  Check(cudaMemsetAsync(scalars_, 0, sizeof(float), stream_.handle()), "zeroing the norm");
  k::AddSquares(scalars_, grads_, layout_.total(), stream_.handle());
  squares_current_ = true;
}

double Gpt2Cuda::GradNorm() {
  SumSquares();
  float squares = 0;
  Check(cudaMemcpyAsync(&squares, scalars_, sizeof(float), cudaMemcpyDeviceToHost, stream_.handle()),
        "download of the norm");
  stream_.Synchronize();
  return std::sqrt(double(squares));
}

void Gpt2Cuda::Update(float lr, float beta1, float beta2, float eps, float weight_decay, float max_norm, int64_t t) {
  cudaStream_t st = stream_.handle();
  SumSquares();
  squares_current_ = false;  // the step clips the gradients
  k::ClipScale(scalars_ + 1, scalars_, max_norm, st);
  for (const ParamTensor& p : layout_.tensors()) {
    k::AdamWUpdate(master_ + p.offset, params_ + p.offset, grads_ + p.offset, m_ + p.offset, v_ + p.offset, p.size, lr,
                   beta1, beta2, eps, p.decay ? weight_decay : 0.0f, t, scalars_ + 1, st);
  }
}

std::vector<float> Gpt2Cuda::Logits(int b, int t) {
  if (has_targets_ || b >= B_ || t >= Tn_) throw std::logic_error("Logits needs a Forward without targets covering (b, t)");
  const int64_t V = layout_.shape().vocab_size;
  std::vector<bf16> row(static_cast<size_t>(V));
  Check(cudaMemcpyAsync(row.data(), logits_ + (int64_t(b) * Tn_ + t) * V, size_t(V) * sizeof(bf16),
                        cudaMemcpyDeviceToHost, stream_.handle()),
        "download of logits");
  stream_.Synchronize();
  return std::vector<float>(row.begin(), row.end());
}

void Gpt2Cuda::CopyGradientsTo(float* host) {
  Check(cudaMemcpyAsync(host, grads_, size_t(layout_.total()) * sizeof(float), cudaMemcpyDeviceToHost,
                        stream_.handle()),
        "download of gradients");
  stream_.Synchronize();
}

void Gpt2Cuda::CopyGradientsFrom(const float* host) {
  squares_current_ = false;
  Check(cudaMemcpyAsync(grads_, host, size_t(layout_.total()) * sizeof(float), cudaMemcpyHostToDevice,
                        stream_.handle()),
        "upload of gradients");
  stream_.Synchronize();  // `host` may be reused as soon as this returns
}

std::vector<float> Gpt2Cuda::MasterWeights() {
  std::vector<float> host(static_cast<size_t>(layout_.total()));
  Check(cudaMemcpyAsync(host.data(), master_, host.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_.handle()),
        "download of the master weights");
  stream_.Synchronize();
  return host;
}

std::vector<float> Gpt2Cuda::Gradients() {
  std::vector<float> host(static_cast<size_t>(layout_.total()));
  CopyGradientsTo(host.data());
  return host;
}

}  // namespace meshtrain::model
