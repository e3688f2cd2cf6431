// Each CUDA kernel of worker/kernels/cuda against its CPU reference in kernels/cpu, on
// random inputs (never zeros). Inputs are rounded to bf16 first, so both sides see the
// same numbers; the tolerance covers bf16 rounding of outputs and intermediates.

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tests/support/gpu.h"
#include "worker/kernels/cpu/kernels.h"
#include "worker/kernels/cuda/kernels.h"
#include "worker/runtime/cuda.h"

namespace meshtrain::kernels {
namespace {

using cuda::bf16;
using runtime::cuda::Check;

float RoundToBf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Values of `scale` times a standard normal, rounded to bf16.
std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(n);
  for (float& v : values) v = RoundToBf16(normal(rng));
  return values;
}

// A device array; uploads and downloads as float whatever the element type.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    Check(cudaMalloc(reinterpret_cast<void**>(&data_), std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  }
  explicit DeviceArray(const std::vector<float>& values) : DeviceArray(values.size()) { Upload(values); }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() { return data_; }
  void Upload(const std::vector<float>& values) {
    std::vector<T> host(values.size());
    for (size_t i = 0; i < values.size(); ++i) host[i] = T(values[i]);
    Check(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<float> Download() {
    Check(cudaDeviceSynchronize(), "kernels under test");
    std::vector<T> host(n_);
    Check(cudaMemcpy(host.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    std::vector<float> values(n_);
    for (size_t i = 0; i < n_; ++i) values[i] = float(host[i]);
    return values;
  }

 private:
  size_t n_;
  T* data_ = nullptr;
};

using Bf16Array = DeviceArray<bf16>;
using FloatArray = DeviceArray<float>;

// |got - want| <= tolerance * (|want| + rms(want)) everywhere.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, float tolerance,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double squares = 0;
  for (float w : want) squares += double(w) * w;
  const double rms = std::sqrt(squares / std::max<size_t>(want.size(), 1));
  ASSERT_GT(rms, 0) << what << ": the reference is all zeros, so the test would prove nothing";
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tolerance * (std::fabs(want[i]) + rms)) << what << " at " << i;
  }
}

std::vector<int32_t> RandomTokens(size_t n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(n);
  for (int32_t& t : tokens) t = int32_t(rng() % uint32_t(vocab));
  return tokens;
}

DeviceArray<int32_t>* UploadTokens(const std::vector<int32_t>& tokens) {
  auto* array = new DeviceArray<int32_t>(tokens.size());
  Check(cudaMemcpy(array->get(), tokens.data(), tokens.size() * sizeof(int32_t), cudaMemcpyHostToDevice), "upload");
  return array;
}

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override { MESHTRAIN_SKIP_WITHOUT_GPU(); }
  cudaStream_t stream = nullptr;  // the default stream: every check synchronises the device
};

TEST_F(CudaKernels, EncoderMatchesCpu) {
  const int B = 3, T = 17, C = 40, V = 50;
  auto wte = Random(size_t(V) * C, 1), wpe = Random(size_t(T) * C, 2), dout = Random(size_t(B) * T * C, 3);
  auto tokens = RandomTokens(size_t(B) * T, V, 4);
  std::unique_ptr<DeviceArray<int32_t>> d_tokens(UploadTokens(tokens));
  Bf16Array d_wte(wte), d_wpe(wpe), d_out(size_t(B) * T * C), d_dout(dout);
  auto dwte = Random(wte.size(), 5), dwpe = Random(wpe.size(), 6);
  FloatArray d_dwte(dwte), d_dwpe(dwpe);
  cuda::EncoderForward(d_out.get(), d_tokens->get(), d_wte.get(), d_wpe.get(), B * T, T, C, stream);
  cuda::EncoderBackward(d_dwte.get(), d_dwpe.get(), d_dout.get(), d_tokens->get(), B * T, T, C, stream);
  std::vector<float> out(size_t(B) * T * C);
  cpu::EncoderForward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  cpu::EncoderBackward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  ExpectClose(d_out.Download(), out, 1e-2f, "out");
  ExpectClose(d_dwte.Download(), dwte, 1e-4f, "dwte");
  ExpectClose(d_dwpe.Download(), dwpe, 1e-4f, "dwpe");
}

TEST_F(CudaKernels, LayerNormMatchesCpu) {
  const int N = 70, C = 96;
  auto inp = Random(size_t(N) * C, 1, 2.0f), weight = Random(C, 2), bias = Random(C, 3), dout = Random(inp.size(), 4);
  auto dinp = Random(inp.size(), 5), dweight = Random(C, 6), dbias = Random(C, 7);
  Bf16Array d_inp(inp), d_weight(weight), d_bias(bias), d_out(inp.size()), d_dout(dout), d_dinp(dinp);
  FloatArray d_mean(N), d_rstd(N), d_dweight(dweight), d_dbias(dbias);
  cuda::LayerNormForward(d_out.get(), d_mean.get(), d_rstd.get(), d_inp.get(), d_weight.get(), d_bias.get(), N, C,
                         stream);
  cuda::LayerNormBackward(d_dinp.get(), d_dweight.get(), d_dbias.get(), d_dout.get(), d_inp.get(), d_weight.get(),
                          d_mean.get(), d_rstd.get(), N, C, stream);
  std::vector<float> out(inp.size()), mean(N), rstd(N);
  cpu::LayerNormForward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, 1, C);
  cpu::LayerNormBackward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(),
                         mean.data(), rstd.data(), N, 1, C);
  ExpectClose(d_out.Download(), out, 1e-2f, "out");
  ExpectClose(d_mean.Download(), mean, 1e-4f, "mean");
  ExpectClose(d_rstd.Download(), rstd, 1e-4f, "rstd");
  ExpectClose(d_dinp.Download(), dinp, 2e-2f, "dinp");
  ExpectClose(d_dweight.Download(), dweight, 1e-3f, "dweight");
  ExpectClose(d_dbias.Download(), dbias, 1e-3f, "dbias");
}

TEST_F(CudaKernels, MatmulMatchesCpu) {
  const int N = 66, C = 64, OC = 96;
  auto inp = Random(size_t(N) * C, 1), weight = Random(size_t(OC) * C, 2, 0.1f), bias = Random(OC, 3);
  auto dout = Random(size_t(N) * OC, 4), dinp = Random(inp.size(), 5), dweight = Random(weight.size(), 6),
       dbias = Random(OC, 7);
  Bf16Array d_inp(inp), d_weight(weight), d_bias(bias), d_out(size_t(N) * OC), d_dout(dout), d_dinp(dinp);
  FloatArray d_dweight(dweight), d_dbias(dbias);
  cuda::Blas blas;
  cuda::MatmulForward(blas, d_out.get(), d_inp.get(), d_weight.get(), d_bias.get(), N, C, OC, stream);
  cuda::MatmulBackward(blas, d_dinp.get(), d_dweight.get(), d_dbias.get(), d_dout.get(), d_inp.get(), d_weight.get(),
                       N, C, OC, stream);
  std::vector<float> out(size_t(N) * OC);
  cpu::MatmulForward(out.data(), inp.data(), weight.data(), bias.data(), N, 1, C, OC);
  cpu::MatmulBackward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(), N, 1, C, OC);
  ExpectClose(d_out.Download(), out, 1e-2f, "out");
  ExpectClose(d_dinp.Download(), dinp, 1e-2f, "dinp");
  ExpectClose(d_dweight.Download(), dweight, 1e-3f, "dweight");
  ExpectClose(d_dbias.Download(), dbias, 1e-3f, "dbias");
}

TEST_F(CudaKernels, AttentionMatchesCpu) {
  const int B = 2, T = 37, C = 64, NH = 4;
  const size_t btc = size_t(B) * T * C, bhtt = size_t(B) * NH * T * T;
  auto inp = Random(3 * btc, 1), dout = Random(btc, 2), dinp = Random(3 * btc, 3);
  Bf16Array d_inp(inp), d_out(btc), d_qkvr(3 * btc), d_att(bhtt), d_heads(btc), d_dout(dout), d_dinp(dinp),
      d_dqkvr(3 * btc), d_datt(bhtt), d_dy(btc);
  cuda::Blas blas;
  cuda::AttentionForward(blas, d_out.get(), d_qkvr.get(), d_att.get(), d_heads.get(), d_inp.get(), B, T, C, NH, stream);
  cuda::AttentionBackward(blas, d_dinp.get(), d_dqkvr.get(), d_datt.get(), d_dy.get(), d_dout.get(), d_qkvr.get(),
                          d_att.get(), B, T, C, NH, stream);
  std::vector<float> out(btc), preatt(bhtt), att(bhtt), dpreatt(bhtt), datt(bhtt);
  cpu::AttentionForward(out.data(), preatt.data(), att.data(), inp.data(), B, T, C, NH);
  cpu::AttentionBackward(dinp.data(), dpreatt.data(), datt.data(), dout.data(), inp.data(), att.data(), B, T, C, NH);
  ExpectClose(d_att.Download(), att, 2e-2f, "att");
  ExpectClose(d_out.Download(), out, 2e-2f, "out");
  ExpectClose(d_dinp.Download(), dinp, 5e-2f, "dinp");
}

TEST_F(CudaKernels, ElementwiseMatchCpu) {
  const int64_t N = 10007;
  auto inp = Random(N, 1, 2.0f), other = Random(N, 2), dout = Random(N, 3), dinp = Random(N, 4);
  Bf16Array d_inp(inp), d_other(other), d_dout(dout), d_dinp(dinp), d_gelu(N), d_sum(N);
  cuda::GeluForward(d_gelu.get(), d_inp.get(), N, stream);
  cuda::GeluBackward(d_dinp.get(), d_inp.get(), d_dout.get(), N, stream);
  cuda::ResidualForward(d_sum.get(), d_inp.get(), d_other.get(), N, stream);
  std::vector<float> gelu(N), sum(N);
  cpu::GeluForward(gelu.data(), inp.data(), N);
  cpu::GeluBackward(dinp.data(), inp.data(), dout.data(), N);
  cpu::ResidualForward(sum.data(), inp.data(), other.data(), N);
  ExpectClose(d_gelu.Download(), gelu, 1e-2f, "gelu");
  ExpectClose(d_dinp.Download(), dinp, 1e-2f, "gelu backward");
  ExpectClose(d_sum.Download(), sum, 1e-2f, "residual");
}

TEST_F(CudaKernels, CrossEntropyMatchesCpu) {
  const int N = 19, V = 1000;
  const float dloss = 1.0f / N;
  auto logits = Random(size_t(N) * V, 1, 3.0f);
  auto targets = RandomTokens(N, V, 2);
  std::unique_ptr<DeviceArray<int32_t>> d_targets(UploadTokens(targets));
  Bf16Array d_logits(logits);
  FloatArray d_losses(N), d_losses_only(N);
  cuda::CrossEntropy(d_losses_only.get(), nullptr, d_logits.get(), d_targets->get(), dloss, N, V, stream);
  cuda::CrossEntropy(d_losses.get(), d_logits.get(), d_logits.get(), d_targets->get(), dloss, N, V, stream);  // in place
  std::vector<float> probs(logits.size()), losses(N), dlogits(logits.size(), 0.0f);
  cpu::SoftmaxCrossEntropyForward(probs.data(), losses.data(), logits.data(), targets.data(), N, 1, V);
  cpu::SoftmaxCrossEntropyBackward(dlogits.data(), probs.data(), targets.data(), dloss, N, 1, V);
  ExpectClose(d_losses_only.Download(), losses, 1e-4f, "losses");
  ExpectClose(d_losses.Download(), losses, 1e-4f, "losses (with backward)");
  ExpectClose(d_logits.Download(), dlogits, 1e-2f, "dlogits");
}

TEST_F(CudaKernels, AdamWWithClippingMatchesCpu) {
  const int64_t N = 5003;
  const float max_norm = 1.0f;
  auto master = Random(N, 1), grads = Random(N, 2, 0.5f), m = Random(N, 3, 0.01f), v = Random(N, 4, 0.01f);
  for (float& x : v) x = std::fabs(x);
  FloatArray d_master(master), d_grads(grads), d_m(m), d_v(v), d_sum(std::vector<float>{0.0f}), d_scale(1);
  Bf16Array d_params(N);
  cuda::AddSquares(d_sum.get(), d_grads.get(), N, stream);
  cuda::ClipScale(d_scale.get(), d_sum.get(), max_norm, stream);
  cuda::AdamWUpdate(d_master.get(), d_params.get(), d_grads.get(), d_m.get(), d_v.get(), N, 3e-3f, 0.9f, 0.95f, 1e-8f,
                    0.1f, 3, d_scale.get(), stream);
  double squares = 0;
  for (float g : grads) squares += double(g) * g;
  const float norm = float(std::sqrt(squares));
  ASSERT_GT(norm, max_norm);  // so clipping is exercised
  ExpectClose(d_sum.Download(), {float(squares)}, 1e-4f, "sum of squares");
  ExpectClose(d_scale.Download(), {max_norm / norm}, 1e-4f, "clip scale");
  for (float& g : grads) g *= max_norm / norm;
  cpu::AdamWUpdate(master.data(), grads.data(), m.data(), v.data(), N, 3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3);
  const std::vector<float> got = d_master.Download();
  ExpectClose(got, master, 1e-5f, "master");
  ExpectClose(d_m.Download(), m, 1e-4f, "m");
  ExpectClose(d_v.Download(), v, 1e-4f, "v");
  std::vector<float> rounded(got.size());
  for (size_t i = 0; i < got.size(); ++i) rounded[i] = RoundToBf16(got[i]);
  ExpectClose(d_params.Download(), rounded, 0.0f, "bf16 params");
}

}  // namespace
}  // namespace meshtrain::kernels
