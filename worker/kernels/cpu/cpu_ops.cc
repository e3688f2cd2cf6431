#include "worker/kernels/cpu/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "worker/kernels/cpu/attention_blocks.h"
#include "worker/kernels/cpu/kernels.h"
#include "worker/runtime/cpu_stream.h"
#include "worker/runtime/device_side.h"

namespace meshtrain::kernels {
namespace {

using runtime::DeviceSide;

template <class T>
T* At(runtime::DevicePtr<T> p) {
  return DeviceSide::Address(p);
}

template <class P>
class CpuOps final : public Ops<P> {
 public:
  using A = typename P::Act;
  using G = typename P::Acc;
  template <class T>
  using Out = runtime::DevicePtr<T>;
  template <class T>
  using In = runtime::DevicePtr<const T>;
  using Stream = runtime::Stream;

  std::string Describe() const override {
    if constexpr (std::is_same_v<P, Fp64>) return "cpu fp64 reference";
    if constexpr (std::is_same_v<P, Bf16>) return "cpu bf16 emulation";
    return "cpu fp32";
  }

  AttentionKind Attention(int, int, int, int, int) override { return AttentionKind::kScores; }
  int64_t AttentionStateElements(int B, int T, int NH, int, int) override { return int64_t(B) * NH * T * T; }
  int64_t AttentionScratchBytes(int, int, int, int, int) override { return 0; }

  void EncoderForward(Out<A> out, In<int32_t> tokens, In<A> wte, In<A> wpe, int B, int T, int C, int64_t v_begin,
                      int64_t v_rows, Stream& s) override {
    Run(s, [=, out = At(out), tokens = At(tokens), wte = At(wte), wpe = At(wpe)] {
      cpu::EncoderForward<A, G>(out, tokens, wte, wpe, B, T, C, v_begin, v_rows);
    });
  }
  void EncoderBackward(Out<G> dwte, Out<G> dwpe, In<A> dout, In<int32_t> tokens, int B, int T, int C, int64_t v_begin,
                       int64_t v_rows, Stream& s) override {
    Run(s, [=, dwte = At(dwte), dwpe = At(dwpe), dout = At(dout), tokens = At(tokens)] {
      cpu::EncoderBackward<A, G>(dwte, dwpe, dout, tokens, B, T, C, v_begin, v_rows);
    });
  }
  void LayerNormForward(Out<A> out, Out<G> mean, Out<G> rstd, In<A> inp, In<A> weight, In<A> bias, int64_t N, int C,
                        Stream& s) override {
    Run(s, [=, out = At(out), mean = At(mean), rstd = At(rstd), inp = At(inp), weight = At(weight), bias = At(bias)] {
      cpu::LayerNormForward<A, G>(out, mean, rstd, inp, weight, bias, N, C);
    });
  }
  void ResidualLayerNormForward(Out<A> residual, Out<A> out, Out<G> mean, Out<G> rstd, In<A> a, In<A> b,
                                In<A> weight, In<A> bias, int64_t N, int C, Stream& s) override {
    Run(s, [=, residual = At(residual), out = At(out), mean = At(mean), rstd = At(rstd), a = At(a), b = At(b),
             weight = At(weight), bias = At(bias)] {
      cpu::ResidualLayerNormForward<A, G>(residual, out, mean, rstd, a, b, weight, bias, N, C);
    });
  }
  void LayerNormBackward(Out<A> dinp, Out<G> dweight, Out<G> dbias, In<A> dout, In<A> inp, In<A> weight, In<G> mean,
                         In<G> rstd, int64_t N, int C, Stream& s) override {
    Run(s, [=, dinp = At(dinp), dweight = At(dweight), dbias = At(dbias), dout = At(dout), inp = At(inp),
             weight = At(weight), mean = At(mean), rstd = At(rstd)] {
      cpu::LayerNormBackward<A, G>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
    });
  }
  void MatmulForward(Out<A> out, Out<A> gelu_pre, In<A> inp, In<A> weight, In<A> bias, In<A> residual, int64_t N,
                     int K, int OC, Stream& s) override {
    this->CheckMatmulForward(out, gelu_pre, residual);
    Run(s, [=, out = At(out), gelu_pre = At(gelu_pre), inp = At(inp), weight = At(weight), bias = At(bias),
             residual = At(residual)] { cpu::MatmulForward<A, G>(out, gelu_pre, inp, weight, bias, residual, N, K, OC); });
  }
  void MatmulBackward(Out<A> dinp, Out<G> dweight, Out<G> dbias, In<A> dout, In<A> inp, In<A> weight, In<A> gelu_pre,
                      int64_t N, int K, int OC, Stream& s) override {
    Run(s, [=, dinp = At(dinp), dweight = At(dweight), dbias = At(dbias), dout = At(dout), inp = At(inp),
             weight = At(weight), gelu_pre = At(gelu_pre)] {
      cpu::MatmulBackward<A, G>(dinp, dweight, dbias, dout, inp, weight, gelu_pre, N, K, OC);
    });
  }
  void Float8Amax(Out<float> amax, In<A> x, int64_t rows, int cols, Float8Scaling scaling, Stream& s) override {
    Run(s, [=, amax = At(amax), x = At(x)] { cpu::Float8AmaxOf<A>(amax, x, rows, cols, scaling); });
  }
  void Float8Scales(Out<float> scale, In<float> amax, int64_t n, int copies, int64_t copy_stride, Float8 format,
                    bool power_of_2, Stream& s) override {
    Run(s, [=, scale = At(scale), amax = At(amax)] {
      for (int64_t i = 0; i < n; ++i) {
        float m = amax[i];
        for (int c = 1; c < copies; ++c) {
          const float a = amax[c * copy_stride + i];
          m = (std::isnan(a) || std::isnan(m)) ? std::numeric_limits<float>::quiet_NaN() : std::max(m, a);
        }
        scale[i] = Float8Scale(m, format, power_of_2);
      }
    });
  }
  void Float8MatmulForward(Out<A> out, Out<A> gelu_pre, In<A> inp, In<float> inp_scale, In<A> weight,
                           In<float> weight_scale, In<A> bias, In<A> residual, int64_t N, int K, int OC,
                           Float8Recipe recipe, Stream& s) override {
    this->CheckMatmulForward(out, gelu_pre, residual);
    Run(s, [=, out = At(out), gelu_pre = At(gelu_pre), inp = At(inp), inp_scale = At(inp_scale), weight = At(weight),
             weight_scale = At(weight_scale), bias = At(bias), residual = At(residual)] {
      cpu::Float8MatmulForward<A, G>(out, gelu_pre, inp, inp_scale, weight, weight_scale, bias, residual, N, K, OC,
                                     recipe);
    });
  }
  void Float8MatmulGradInput(Out<A> dinp, In<A> dout, In<float> dout_scale, In<A> weight, In<float> weight_scale,
                             In<A> gelu_pre, int64_t N, int K, int OC, Float8Recipe recipe, Stream& s) override {
    Run(s, [=, dinp = At(dinp), dout = At(dout), dout_scale = At(dout_scale), weight = At(weight),
             weight_scale = At(weight_scale), gelu_pre = At(gelu_pre)] {
      cpu::Float8MatmulGradInput<A, G>(dinp, dout, dout_scale, weight, weight_scale, gelu_pre, N, K, OC, recipe);
    });
  }
  void Float8MatmulGradWeight(Out<G> dweight, Out<G> dbias, In<A> dout, In<float> dout_scale, In<A> inp,
                              In<float> inp_scale, int64_t N, int K, int OC, Float8Recipe recipe, Stream& s) override {
    Run(s, [=, dweight = At(dweight), dbias = At(dbias), dout = At(dout), dout_scale = At(dout_scale), inp = At(inp),
             inp_scale = At(inp_scale)] {
      cpu::Float8MatmulGradWeight<A, G>(dweight, dbias, dout, dout_scale, inp, inp_scale, N, K, OC, recipe);
    });
  }
  void RmsNormForward(Out<A> out, Out<G> rstd, In<A> inp, In<A> weight, int64_t N, int C, float eps,
                      Stream& s) override {
    Run(s, [=, out = At(out), rstd = At(rstd), inp = At(inp), weight = At(weight)] {
      cpu::RmsNormForward<A, G>(out, rstd, inp, weight, N, C, eps);
    });
  }
  void ResidualRmsNormForward(Out<A> residual, Out<A> out, Out<G> rstd, In<A> a, In<A> b, In<A> weight, int64_t N,
                              int C, float eps, Stream& s) override {
    Run(s, [=, residual = At(residual), out = At(out), rstd = At(rstd), a = At(a), b = At(b), weight = At(weight)] {
      cpu::ResidualRmsNormForward<A, G>(residual, out, rstd, a, b, weight, N, C, eps);
    });
  }
  void RmsNormBackward(Out<A> dinp, Out<G> dweight, In<A> dout, In<A> inp, In<A> weight, In<G> rstd, int64_t N, int C,
                       Stream& s) override {
    Run(s, [=, dinp = At(dinp), dweight = At(dweight), dout = At(dout), inp = At(inp), weight = At(weight),
             rstd = At(rstd)] { cpu::RmsNormBackward<A, G>(dinp, dweight, dout, inp, weight, rstd, N, C); });
  }
  void HeadRmsNormForward(Out<A> x, Out<A> saved, Out<G> rstd, In<A> weight, int64_t N, int heads, int HS,
                          int64_t stride, float eps, Stream& s) override {
    Run(s, [=, x = At(x), saved = At(saved), rstd = At(rstd), weight = At(weight)] {
      cpu::HeadRmsNormForward<A, G>(x, saved, rstd, weight, N, heads, HS, stride, eps);
    });
  }
  void HeadRmsNormBackward(Out<A> dx, Out<G> dweight, In<A> saved, In<A> weight, In<G> rstd, int64_t N, int heads,
                           int HS, int64_t stride, Stream& s) override {
    Run(s, [=, dx = At(dx), dweight = At(dweight), saved = At(saved), weight = At(weight), rstd = At(rstd)] {
      cpu::HeadRmsNormBackward<A, G>(dx, dweight, saved, weight, rstd, N, heads, HS, stride);
    });
  }
  void AttentionForward(Out<A> out, Out<G> state, In<A> qkv, int B, int T, int NH, int KVH, int HS,
                        Stream& s) override {
    Run(s, [=, out = At(out), state = At(state), qkv = At(qkv)] {
      cpu::AttentionForward<A, G>(out, state, qkv, B, T, NH, KVH, HS);
    });
  }
  void AttentionBackward(Out<A> dqkv, Out<std::byte>, In<A> dout, In<A> qkv, In<A>, In<G> state, int B, int T, int NH,
                         int KVH, int HS, Stream& s) override {
    Run(s, [=, dqkv = At(dqkv), dout = At(dout), qkv = At(qkv), state = At(state)] {
      cpu::AttentionBackward<A, G>(dqkv, dout, qkv, state, B, T, NH, KVH, HS);
    });
  }
  // Attention by blocks (attention_blocks.h); the shape travels by value.
  void AttentionBlockForward(Out<G> out, Out<G> lse, In<A> q, In<A> k, In<A> v, const AttentionBlock& shape,
                             Stream& s) override {
    this->CheckAttentionBlock(shape, "AttentionBlockForward");
    Run(s, [=, out = At(out), lse = At(lse), q = At(q), k = At(k), v = At(v)] {
      cpu::AttentionBlockForward<A, G>(out, lse, q, k, v, shape);
    });
  }
  void AttentionMerge(Out<G> out, Out<G> lse, In<G> block_out, In<G> block_lse, const AttentionBlock& shape,
                      Stream& s) override {
    this->CheckAttentionBlock(shape, "AttentionMerge");
    Run(s, [=, out = At(out), lse = At(lse), block_out = At(block_out), block_lse = At(block_lse)] {
      cpu::AttentionMerge<G>(out, lse, block_out, block_lse, shape);
    });
  }
  void AttentionRowDot(Out<G> D, In<A> dout, In<A> out, const AttentionBlock& shape, Stream& s) override {
    this->CheckAttentionBlock(shape, "AttentionRowDot");
    Run(s, [=, D = At(D), dout = At(dout), out = At(out)] { cpu::AttentionRowDot<A, G>(D, dout, out, shape); });
  }
  void AttentionBlockBackward(Out<G> dq, Out<G> dk, Out<G> dv, In<A> dout, In<A> q, In<A> k, In<A> v, In<G> lse,
                              In<G> D, const AttentionBlock& shape, Stream& s) override {
    this->CheckAttentionBlock(shape, "AttentionBlockBackward");
    Run(s, [=, dq = At(dq), dk = At(dk), dv = At(dv), dout = At(dout), q = At(q), k = At(k), v = At(v), lse = At(lse),
             D = At(D)] { cpu::AttentionBlockBackward<A, G>(dq, dk, dv, dout, q, k, v, lse, D, shape); });
  }
  void RopeForward(Out<A> qkv, In<G> cos, In<G> sin, int B, int T, int NH, int KVH, int HS, Stream& s) override {
    Run(s, [=, qkv = At(qkv), cos = At(cos), sin = At(sin)] {
      cpu::Rope<A, G>(qkv, cos, sin, B, T, NH, KVH, HS, /*backward=*/false);
    });
  }
  void RopeBackward(Out<A> dqkv, In<G> cos, In<G> sin, int B, int T, int NH, int KVH, int HS, Stream& s) override {
    Run(s, [=, dqkv = At(dqkv), cos = At(cos), sin = At(sin)] {
      cpu::Rope<A, G>(dqkv, cos, sin, B, T, NH, KVH, HS, /*backward=*/true);
    });
  }
  void SwiGluForward(Out<A> out, In<A> gate_up, int64_t N, int H, Stream& s) override {
    Run(s, [=, out = At(out), gate_up = At(gate_up)] { cpu::SwiGluForward<A, G>(out, gate_up, N, H); });
  }
  void SwiGluBackward(Out<A> dgate_up, In<A> dout, In<A> gate_up, int64_t N, int H, Stream& s) override {
    Run(s, [=, dgate_up = At(dgate_up), dout = At(dout), gate_up = At(gate_up)] {
      cpu::SwiGluBackward<A, G>(dgate_up, dout, gate_up, N, H);
    });
  }
  void RouterTopKForward(Out<G> probs, Out<int32_t> experts, Out<G> weights, In<A> logits, int64_t N, int E, int k,
                         bool renormalize, Stream& s) override {
    Run(s, [=, probs = At(probs), experts = At(experts), weights = At(weights), logits = At(logits)] {
      cpu::RouterTopKForward<A, G>(probs, experts, weights, logits, N, E, k, renormalize);
    });
  }
  void RouterTopKBackward(Out<A> dlogits, In<G> dweights, In<G> dprobs, In<G> probs, In<int32_t> experts, int64_t N,
                          int E, int k, bool renormalize, Stream& s) override {
    Run(s, [=, dlogits = At(dlogits), dweights = At(dweights), dprobs = At(dprobs), probs = At(probs),
             experts = At(experts)] {
      cpu::RouterTopKBackward<A, G>(dlogits, dweights, dprobs, probs, experts, N, E, k, renormalize);
    });
  }
  void MoePermutePlan(Out<int32_t> counts, Out<int32_t> positions, In<int32_t> experts, int64_t N, int k, int E,
                      Stream& s) override {
    Run(s, [=, counts = At(counts), positions = At(positions), experts = At(experts)] {
      cpu::MoePermutePlan(counts, positions, experts, N, k, E);
    });
  }
  void MoePermute(Out<A> xs, In<A> x, In<int32_t> positions, int64_t N, int k, int C, Stream& s) override {
    Run(s, [=, xs = At(xs), x = At(x), positions = At(positions)] {
      cpu::MoePermute<A, G>(xs, x, positions, N, k, C);
    });
  }
  void MoePermuteBackward(Out<A> dx, In<A> dxs, In<int32_t> positions, int64_t N, int k, int C, Stream& s) override {
    Run(s, [=, dx = At(dx), dxs = At(dxs), positions = At(positions)] {
      cpu::MoePermuteBackward<A, G>(dx, dxs, positions, N, k, C);
    });
  }
  void MoeCombineForward(Out<A> out, In<A> ys, In<G> weights, In<int32_t> positions, In<A> residual, int64_t N, int k,
                         int C, Stream& s) override {
    Run(s, [=, out = At(out), ys = At(ys), weights = At(weights), positions = At(positions), residual = At(residual)] {
      cpu::MoeCombineForward<A, G>(out, ys, weights, positions, residual, N, k, C);
    });
  }
  void MoeCombineBackward(Out<A> dys, Out<G> dweights, In<A> dout, In<A> ys, In<G> weights, In<int32_t> positions,
                          int64_t N, int k, int C, Stream& s) override {
    Run(s, [=, dys = At(dys), dweights = At(dweights), dout = At(dout), ys = At(ys), weights = At(weights),
             positions = At(positions)] {
      cpu::MoeCombineBackward<A, G>(dys, dweights, dout, ys, weights, positions, N, k, C);
    });
  }
  // counts: copied, as the caller may reuse them once the call returns.
  void GroupedMatmulForward(Out<A> out, In<A> inp, In<A> weight, const int32_t* counts, int E, int K, int OC,
                            Stream& s) override {
    Run(s, [=, out = At(out), inp = At(inp), weight = At(weight), rows = std::vector<int32_t>(counts, counts + E)] {
      cpu::GroupedMatmulForward<A, G>(out, inp, weight, rows.data(), E, K, OC);
    });
  }
  void GroupedMatmulBackward(Out<A> dinp, Out<G> dweight, In<A> dout, In<A> inp, In<A> weight, const int32_t* counts,
                             int E, int K, int OC, Stream& s) override {
    Run(s, [=, dinp = At(dinp), dweight = At(dweight), dout = At(dout), inp = At(inp), weight = At(weight),
             rows = std::vector<int32_t>(counts, counts + E)] {
      cpu::GroupedMatmulBackward<A, G>(dinp, dweight, dout, inp, weight, rows.data(), E, K, OC);
    });
  }
  void Add(Out<A> out, In<A> a, In<A> b, int64_t n, Stream& s) override {
    Run(s, [=, out = At(out), a = At(a), b = At(b)] { cpu::Add<A, G>(out, a, b, n); });
  }
  void Dropout(Out<A> out, In<A> in, int64_t rows, int width, float p, uint64_t key, int64_t first_row,
               int64_t row_stride, int64_t first_column, Stream& s) override {
    Run(s, [=, out = At(out), in = At(in)] {
      cpu::Dropout<A, G>(out, in, rows, width, p, key, first_row, row_stride, first_column);
    });
  }
  void CrossEntropy(Out<G> losses, Out<A> dlogits, In<A> logits, In<int32_t> targets, int64_t R, int64_t v_rows,
                    int64_t Vp, float dloss, Stream& s) override {
    Run(s, [=, losses = At(losses), dlogits = At(dlogits), logits = At(logits), targets = At(targets)] {
      cpu::CrossEntropy<A, G>(losses, dlogits, logits, targets, R, v_rows, Vp, dloss);
    });
  }
  void VocabSliceStats(Out<G> stats, In<A> logits, In<int32_t> targets, int64_t R, int64_t v_rows, int64_t Vp,
                       int64_t v_begin, Stream& s) override {
    Run(s, [=, stats = At(stats), logits = At(logits), targets = At(targets)] {
      cpu::VocabSliceStats<A, G>(stats, logits, targets, R, v_rows, Vp, v_begin);
    });
  }
  void VocabSliceCrossEntropy(Out<G> losses, Out<A> dlogits, In<A> logits, In<G> all_stats, int slices,
                              In<int32_t> targets, int64_t R, int64_t v_rows, int64_t Vp, int64_t v_begin, float dloss,
                              Stream& s) override {
    Run(s, [=, losses = At(losses), dlogits = At(dlogits), logits = At(logits), all_stats = At(all_stats),
             targets = At(targets)] {
      cpu::VocabSliceCrossEntropy<A, G>(losses, dlogits, logits, all_stats, slices, targets, R, v_rows, Vp, v_begin,
                                        dloss);
    });
  }
  void AddLoss(Out<double> sum, In<G> losses, int64_t R, double scale, Stream& s) override {
    Run(s, [=, sum = At(sum), losses = At(losses)] { cpu::AddLoss<G>(sum, losses, R, scale); });
  }
  void Accumulate(Out<G> into, In<G> from, int64_t n, float scale, Stream& s) override {
    Run(s, [=, into = At(into), from = At(from)] { cpu::Accumulate<G>(into, from, n, scale); });
  }
  void Cast(Out<A> to, In<G> from, int64_t n, Stream& s) override {
    Run(s, [=, to = At(to), from = At(from)] { cpu::Cast<A, G>(to, from, n); });
  }
  void SumSquares(Out<double> sum, In<G> grads, In<ShardSegment> segments, int count, Stream& s) override {
    Run(s, [=, sum = At(sum), grads = At(grads), segments = At(segments)] {
      cpu::SumSquares<G>(sum, grads, segments, count);
    });
  }
  void ClipScale(Out<float> scale, In<double> sum_of_squares, float max_norm, Stream& s) override {
    Run(s, [=, scale = At(scale), sum_of_squares = At(sum_of_squares)] {
      cpu::ClipScale(scale, sum_of_squares, max_norm);
    });
  }
  void AdamW(Out<G> master, Out<A> params, In<G> grads, Out<G> m, Out<G> v, In<ShardSegment> segments, int count,
             const AdamWStep& step, In<float> clip_scale, Stream& s) override {
    Run(s, [=, master = At(master), params = At(params), grads = At(grads), m = At(m), v = At(v),
             segments = At(segments), clip_scale = At(clip_scale)] {
      cpu::AdamW<A, G>(master, params, grads, m, v, segments, count, step, clip_scale);
    });
  }

 private:
  template <class F>
  static void Run(Stream& stream, F&& task) {
    runtime::CpuStream::Of(stream).Enqueue(std::forward<F>(task));
  }
};

}  // namespace

template <class P>
std::unique_ptr<Ops<P>> MakeCpuOps() {
  return std::make_unique<CpuOps<P>>();
}

template std::unique_ptr<Ops<Fp32>> MakeCpuOps<Fp32>();
template std::unique_ptr<Ops<Bf16>> MakeCpuOps<Bf16>();
template std::unique_ptr<Ops<Fp64>> MakeCpuOps<Fp64>();

}  // namespace meshtrain::kernels
