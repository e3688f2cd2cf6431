// The kernel table (docs/design.md, "The device seam"): every operation the model's layers
// (model/model.h) and the FSDP units (parallel/) run on a device, behind one interface,
// so that the one engine runs on every device. The layers are llm.c's forward/backward
// pairs; the shard operations are the optimizer's.
//
// Implementations (each checked against Fp64 by tests/unit/ops_conformance_test.cc, and
// on a GPU by tests/gpu/cuda_ops_test.cc):
//   kernels/cpu/cpu_ops.h   Ops<Fp32> (the CPU engine), Ops<Fp64> (the reference) and
//                           Ops<Bf16> (an emulation of the GPU's numerics: every value
//                           stored in bf16 is rounded as the GPU rounds it)
//   the CUDA plugin         Ops<Bf16>: cuBLASLt with epilogues, cuDNN fused attention,
//                           own kernels
//
// Conventions, as in llm.c:
// - Outputs come first; a `d` prefix names a gradient. Row-major, contiguous; N = B*T rows.
// - Every call enqueues its work on `stream` and returns at once. Pointers are device
//   handles (runtime/device_ptr.h). A nullable argument says so.
// - Parameter gradients (Acc) are accumulated (+=): a unit's gradients are zeroed once,
//   then micro-batches and both uses of a tied tensor add into them. Activation gradients
//   (Act) are written (=), except where a function says += (the residual stream's).
// - A value "as stored" is the value in its element type: what Act rounding gives. Where
//   a function computes from a sum it has not stored, it says so; the emulation follows.
// - Tensor parallelism: functions see this rank's slice (its heads, hidden units,
//   vocabulary rows); the collectives between them are the caller's.
// Thread-safety: a table may be used from one host thread at a time (it may keep
// per-shape plans); the work it enqueues follows the stream's rules.

#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "worker/kernels/float8.h"
#include "worker/kernels/precision.h"
#include "worker/runtime/device_ptr.h"
#include "worker/runtime/stream.h"

namespace meshtrain::kernels {

// A run of one tensor's elements inside a flat shard of parameters (parallel/flat_unit.h)
// and what the shard operations do with it. Elements no segment covers (a shard's padding,
// a padded vocabulary's rows) are left alone: they stay zero and never train.
struct ShardSegment {
  int64_t offset = 0, size = 0;  // elements, in the flat shard
  int32_t decay = 0;    // 1: AdamW's weight decay applies (matrices and embeddings)
  int32_t in_norm = 0;  // 1: counted in the gradient norm (a tensor every TP rank holds whole: on TP rank 0 only)
};

// One AdamW step, with decoupled weight decay; t counts steps from 1.
struct AdamWStep {
  float learning_rate = 0, beta1 = 0.9f, beta2 = 0.95f, epsilon = 1e-8f, weight_decay = 0;
  int64_t t = 1;
};

// Which attention the table runs, for the engine's and the planner's memory counts:
// kScores keeps the (B,NH,T,T) probabilities for the backward; kFused (flash attention)
// keeps one softmax statistic per row, (B,NH,T).
enum class AttentionKind { kScores, kFused };

// Which keys of an attention block (AttentionBlock) a query row sees.
//   kNone    every key (a block of keys that lie wholly before the queries)
//   kCausal  the queries' own rows (Tq == Tk): query i sees keys j <= i
enum class AttentionMask { kNone, kCausal };

// Where the rows of one operand of an attention block lie, in elements from the pointer
// passed: row t of sequence b at b * batch + t * row, its head h's HS channels from
// h * HS there. So an operand may lie inside a larger tensor: q of a packed
// (B,T,(NH+2*KVH)*HS) qkv has row = (NH+2*KVH)*HS and batch = T * row, and a block of
// its rows [t0, t0 + Tq) starts at qkv + t0 * row (k: + NH*HS, v: + (NH+KVH)*HS more).
struct AttentionRows {
  int64_t row = 0, batch = 0;
};

// Where an attention block's softmax statistics lie (lse and D: one per sequence, query
// head and query row), in elements from the pointer passed: (b, h, t) at b * batch +
// h * head + t.
struct AttentionStats {
  int64_t head = 0, batch = 0;
};

// One block of attention (Ops::AttentionBlockForward and the three that go with it): B
// sequences, Tq query rows against Tk key/value rows, NH query heads and KVH key/value
// heads of HS channels (KVH divides NH; query head h reads key/value head
// h / (NH / KVH)), scale 1/sqrt(HS), the mask, and where each operand lies. Row t of an
// operand is the block's t-th row, wherever it lies in the sequence. A call reads the
// layouts of its own operands only.
struct AttentionBlock {
  int B = 0, Tq = 0, Tk = 0, NH = 0, KVH = 0, HS = 0;
  AttentionMask mask = AttentionMask::kNone;
  AttentionRows q, k, v;     // the inputs (Act)
  AttentionRows out;         // a block's output and the merged one (Acc)
  AttentionStats stats;      // lse, a block's lse and D (Acc)
  AttentionRows dout;        // the final output as stored and its gradient (Act)
  AttentionRows dq, dk, dv;  // the gradients (Acc)

  // Every operand in an array of its own, contiguous: q, out, dout and dq (B,Tq,NH*HS);
  // k, v, dk and dv (B,Tk,KVH*HS); stats (B,NH,Tq).
  static AttentionBlock Contiguous(int B, int Tq, int Tk, int NH, int KVH, int HS, AttentionMask mask) {
    const int64_t query = int64_t(NH) * HS, key = int64_t(KVH) * HS;
    const AttentionRows queries{query, Tq * query}, keys{key, Tk * key};
    return {.B = B, .Tq = Tq, .Tk = Tk, .NH = NH, .KVH = KVH, .HS = HS, .mask = mask, .q = queries, .k = keys,
            .v = keys, .out = queries, .stats = {Tq, int64_t(NH) * Tq}, .dout = queries, .dq = queries, .dk = keys,
            .dv = keys};
  }
};

template <class P>
class Ops {
 public:
  using Act = typename P::Act;
  using Acc = typename P::Acc;
  template <class T>
  using Out = runtime::DevicePtr<T>;
  template <class T>
  using In = runtime::DevicePtr<const T>;
  using Stream = runtime::Stream;

  virtual ~Ops() = default;

  // "cpu fp32", "cpu fp64 reference", "cpu bf16 emulation", "cuda bf16 (cuBLASLt, cuDNN)"
  virtual std::string Describe() const = 0;

  // --- What the engine allocates for these kernels (it asks before the first step) ---
  // For micro-batches of B x T on NH query heads and KVH key/value heads of HS channels.
  // May build and cache plans.
  virtual AttentionKind Attention(int B, int T, int NH, int KVH, int HS) = 0;
  // Acc elements one block's AttentionForward keeps for its backward.
  virtual int64_t AttentionStateElements(int B, int T, int NH, int KVH, int HS) = 0;
  // Bytes of scratch AttentionBackward uses (shared by every block's backward).
  virtual int64_t AttentionScratchBytes(int B, int T, int NH, int KVH, int HS) = 0;

  // --- Embedding (the embedding unit; vocabulary-parallel) ---
  // out (B*T,C) = wte[tok - v_begin] + wpe[t] for t = row % T, where this slice holds the
  // real rows [v_begin, v_begin + v_rows) of the vocabulary (wte may have more, padding):
  // a token outside the slice gives 0, and a null wpe gives 0.
  virtual void EncoderForward(Out<Act> out, In<int32_t> tokens, In<Act> wte, In<Act> wpe, int B, int T, int C,
                              int64_t v_begin, int64_t v_rows, Stream& stream) = 0;
  // dwte[tok - v_begin] += dout's row for the tokens this slice holds; dwpe[t] += dout's
  // row (dwpe nullable).
  virtual void EncoderBackward(Out<Acc> dwte, Out<Acc> dwpe, In<Act> dout, In<int32_t> tokens, int B, int T, int C,
                               int64_t v_begin, int64_t v_rows, Stream& stream) = 0;

  // --- LayerNorm (eps 1e-5) ---
  // out (N,C) = (inp - mean) * rstd * weight + bias; mean, rstd (N) kept for the backward.
  virtual void LayerNormForward(Out<Act> out, Out<Acc> mean, Out<Acc> rstd, In<Act> inp, In<Act> weight,
                                In<Act> bias, int64_t N, int C, Stream& stream) = 0;
  // residual (N,C) = a + b, then LayerNormForward of residual as stored. residual may
  // alias a or b.
  virtual void ResidualLayerNormForward(Out<Act> residual, Out<Act> out, Out<Acc> mean, Out<Acc> rstd, In<Act> a,
                                        In<Act> b, In<Act> weight, In<Act> bias, int64_t N, int C,
                                        Stream& stream) = 0;
  // dinp += the gradient through the normalisation (the residual stream's, so +=);
  // dweight, dbias += theirs.
  virtual void LayerNormBackward(Out<Act> dinp, Out<Acc> dweight, Out<Acc> dbias, In<Act> dout, In<Act> inp,
                                 In<Act> weight, In<Acc> mean, In<Acc> rstd, int64_t N, int C, Stream& stream) = 0;

  // --- RMSNorm (the Llama class; eps given) ---
  // out (N,C) = inp * rstd * weight, rstd = 1 / sqrt(mean(inp^2) + eps) (N) kept for the
  // backward.
  virtual void RmsNormForward(Out<Act> out, Out<Acc> rstd, In<Act> inp, In<Act> weight, int64_t N, int C, float eps,
                              Stream& stream) = 0;
  // residual (N,C) = a + b, then RmsNormForward of residual as stored. residual may alias
  // a or b.
  virtual void ResidualRmsNormForward(Out<Act> residual, Out<Act> out, Out<Acc> rstd, In<Act> a, In<Act> b,
                                      In<Act> weight, int64_t N, int C, float eps, Stream& stream) = 0;
  // dinp += the gradient through the normalisation (the residual stream's, so +=);
  // dweight += its own.
  virtual void RmsNormBackward(Out<Act> dinp, Out<Acc> dweight, In<Act> dout, In<Act> inp, In<Act> weight,
                               In<Acc> rstd, int64_t N, int C, Stream& stream) = 0;

  // --- Per-head RMSNorm (Qwen3's q_norm and k_norm; eps given) ---
  // For each of the N rows of x (`stride` elements apart) and each of the `heads` heads of
  // HS channels from the row's start: saved (N*heads, HS) = the head as it was, rstd
  // (N*heads) = 1 / sqrt(mean(head^2) + eps), and the head = head * rstd * weight (HS),
  // in place.
  virtual void HeadRmsNormForward(Out<Act> x, Out<Act> saved, Out<Acc> rstd, In<Act> weight, int64_t N, int heads,
                                  int HS, int64_t stride, float eps, Stream& stream) = 0;
  // dx: the gradient of the forward's output in, of its input out, in place (the forward's
  // layout); dweight (HS) = its own, from these heads only (with TP the caller adds the
  // group's). saved and rstd as the forward left them.
  virtual void HeadRmsNormBackward(Out<Act> dx, Out<Acc> dweight, In<Act> saved, In<Act> weight, In<Acc> rstd,
                                   int64_t N, int heads, int HS, int64_t stride, Stream& stream) = 0;

  // --- Products ---
  // out (N,OC) = inp (N,K) @ weight (OC,K)^T + bias (OC; nullable) + residual (N,OC;
  // nullable; not out), from the sum not stored: a projection into the residual stream.
  // With gelu_pre (nullable; then residual is null): gelu_pre = that sum as stored, and
  // out = gelu(the sum), the tanh form.
  virtual void MatmulForward(Out<Act> out, Out<Act> gelu_pre, In<Act> inp, In<Act> weight, In<Act> bias,
                             In<Act> residual, int64_t N, int K, int OC, Stream& stream) = 0;
  // dinp (N,K) = dout (N,OC) @ weight; with gelu_pre (N,K; nullable), the input was
  // gelu(gelu_pre) and dinp = (dout @ weight) * gelu'(gelu_pre) instead.
  // dweight (OC,K) += dout^T @ inp; dbias (OC; nullable) += the column sums of dout.
  // dinp aliases none of dout, inp and gelu_pre: dweight's product reads inp after dinp
  // is written.
  virtual void MatmulBackward(Out<Act> dinp, Out<Acc> dweight, Out<Acc> dbias, In<Act> dout, In<Act> inp,
                              In<Act> weight, In<Act> gelu_pre, int64_t N, int K, int OC, Stream& stream) = 0;

  // --- Float8 products (spec.training.precision fp8; kernels/float8.h) ---
  // A linear layer's three products with their operands cast to float8 as `recipe` casts
  // them (Float8CastOf: format, scale axis): q(t) = EncodeFloat8(t * scale), rounded to
  // nearest even and saturated, each value taken as stored (Act) and scaled in fp32. The
  // scales are fp32, Float8ScaleCount of the operand's scaling over its shape. A device
  // computes the sum of q(a) q(b) / (scale_a scale_b) with fp32 accumulation; the CPU
  // dequantises each operand in fp32 and multiplies (cpu/float8_matmul.h): the two agree
  // to fp32 rounding. A table that cannot (a device below compute capability 8.9) throws
  // std::invalid_argument naming the device, before any work is enqueued; so does the CUDA
  // table for N, K or OC that are not multiples of 16 (cuBLASLt's float8 products; the
  // engine refuses such widths first, api/validation.cc).
  //
  // Why this table takes no float8 products ("cuda:0 (NVIDIA A100-SXM4-80GB, compute
  // capability 8.0) has no float8 tensor cores: ..."); empty when it takes them. The engine
  // asks before its first step.
  virtual std::string Float8Refusal() const { return ""; }
  // The most memory a float8 product D (m,n) = A^T B over k keeps in the table's own
  // scratch, beside what the engine allocates, run through fp32 sums or not
  // (api::Float8KeepsSums): the CUDA table's codes and sums (api::Float8ProductBytes), in
  // one scratch as large as its largest product's; 0 where products keep none (the CPU's).
  virtual int64_t Float8ScratchBytes(int64_t /*m*/, int64_t /*n*/, int64_t /*k*/, bool /*sums*/) const { return 0; }
  // amax (Float8ScaleCount) = max |x| over x (rows,cols), each row or each column, as
  // stored; NaN where a NaN is among the values.
  virtual void Float8Amax(Out<float> amax, In<Act> x, int64_t rows, int cols, Float8Scaling scaling,
                          Stream& stream) = 0;
  // scale (n) = Float8Scale(m_i, format, power_of_2) of m_i = the max over c < copies of
  // amax[c * copy_stride + i]: the scales of an amax reduced over the copies a group's
  // AllGather left (copies 1: amax itself).
  virtual void Float8Scales(Out<float> scale, In<float> amax, int64_t n, int copies, int64_t copy_stride,
                            Float8 format, bool power_of_2, Stream& stream) = 0;
  // MatmulForward's contract with out's sum = q(inp) @ q(weight)^T: inp (N,K) with
  // inp_scale, weight (OC,K) with weight_scale; the epilogue (bias, residual or GELU) in
  // fp32 after the product, as MatmulForward's.
  virtual void Float8MatmulForward(Out<Act> out, Out<Act> gelu_pre, In<Act> inp, In<float> inp_scale,
                                   In<Act> weight, In<float> weight_scale, In<Act> bias, In<Act> residual, int64_t N,
                                   int K, int OC, Float8Recipe recipe, Stream& stream) = 0;
  // dinp (N,K) = q(dout) @ q(weight), times gelu'(gelu_pre) with gelu_pre (N,K; nullable)
  // as MatmulBackward's; dout (N,OC) with dout_scale, weight (OC,K) with weight_scale.
  // dinp aliases none of the inputs.
  virtual void Float8MatmulGradInput(Out<Act> dinp, In<Act> dout, In<float> dout_scale, In<Act> weight,
                                     In<float> weight_scale, In<Act> gelu_pre, int64_t N, int K, int OC,
                                     Float8Recipe recipe, Stream& stream) = 0;
  // dweight (OC,K) += q(dout)^T @ q(inp); dbias (OC; nullable) += the column sums of dout
  // as stored (not cast). dout (N,OC) with dout_scale, inp (N,K) with inp_scale.
  virtual void Float8MatmulGradWeight(Out<Acc> dweight, Out<Acc> dbias, In<Act> dout, In<float> dout_scale,
                                      In<Act> inp, In<float> inp_scale, int64_t N, int K, int OC,
                                      Float8Recipe recipe, Stream& stream) = 0;

  // --- Causal self-attention: NH query heads and KVH key/value heads (KVH divides NH;
  // query head h reads key/value head h / (NH / KVH)) of HS channels, scale 1/sqrt(HS) ---
  // qkv (B,T,(NH+2*KVH)*HS) holds q (NH*HS channels), then k and v (KVH*HS each), head h of
  // each at its channels [h*HS, (h+1)*HS). out (B,T,NH*HS); state
  // (AttentionStateElements) is kept for the backward. K and V are read as they lie.
  virtual void AttentionForward(Out<Act> out, Out<Acc> state, In<Act> qkv, int B, int T, int NH, int KVH, int HS,
                                Stream& stream) = 0;
  // dqkv (B,T,(NH+2*KVH)*HS) = the gradient through attention of dout (B,T,NH*HS); a
  // key/value head's gradient sums those of the query heads that read it. out and state
  // are the forward's. scratch: AttentionScratchBytes.
  virtual void AttentionBackward(Out<Act> dqkv, Out<std::byte> scratch, In<Act> dout, In<Act> qkv, In<Act> out,
                                 In<Acc> state, int B, int T, int NH, int KVH, int HS, Stream& stream) = 0;

  // --- Attention by blocks (ring context parallelism: each sequence's rows split over
  // ranks, the key/value blocks passed round the ring): a rank's queries against one
  // block of keys and values at a time, the blocks' partial results merged exactly by
  // their log-sum-exp, as flash attention merges its tiles. Shapes, the mask and every
  // operand's layout in `shape` (AttentionBlock); outputs are Acc, written or added where
  // their layout says and nowhere else. Every sum is formed in Acc from the inputs as
  // stored, and nothing in between is stored as Act (the Bf16 tables keep P, dP and dS
  // in fp32): a bf16 caller rounds once, when it casts the merged output. Each throws
  // std::invalid_argument when the heads do not make groups, or a kCausal block has
  // Tq != Tk (the CUDA table also when HS > 256). Checked, the ring against
  // AttentionForward and AttentionBackward too, by
  // tests/support/attention_blocks_conformance.h. ---
  // out (B,Tq,NH*HS; shape.out) = softmax(scale q k^T) v over this block's keys alone
  // (masked per shape.mask), and lse (B,NH,Tq; shape.stats) = log sum_j exp(scale q_i .
  // k_j) over the keys query i sees: the natural log of the softmax's denominator, its
  // maximum folded in. A row that sees no key (Tk = 0) gets out 0 and lse -inf (an
  // empty result, which AttentionMerge takes as such). out and lse overlap neither each
  // other nor an input.
  virtual void AttentionBlockForward(Out<Acc> out, Out<Acc> lse, In<Act> q, In<Act> k, In<Act> v,
                                     const AttentionBlock& shape, Stream& stream) = 0;
  // In place, (out, lse) becomes the exact combination of itself and a block's
  // (block_out, block_lse), both pairs laid out as shape.out and shape.stats (the block's
  // shape; B, Tq, NH and HS matter): with m = max(lse, block_lse), a = exp(lse - m) and
  // c = exp(block_lse - m), out = (a out + c block_out) / (a + c) and lse = m + log(a + c).
  // lse = -inf marks an empty result: an empty (out, lse) takes the block's as it is,
  // its out not read (it may hold anything, NaN too), and an empty block leaves (out,
  // lse) as it was; no NaN comes of either. So a caller starts its accumulator at lse =
  // -inf, or writes its first block's AttentionBlockForward straight into it. The
  // block's arrays overlap neither out nor lse.
  virtual void AttentionMerge(Out<Acc> out, Out<Acc> lse, In<Acc> block_out, In<Acc> block_lse,
                              const AttentionBlock& shape, Stream& stream) = 0;
  // D (B,NH,Tq; shape.stats) = the sum over each head's HS channels of dout * out, out
  // the final output (merged over every block) as stored, dout its gradient, both laid
  // out as shape.dout: the D of AttentionBlockBackward.
  virtual void AttentionRowDot(Out<Acc> D, In<Act> dout, In<Act> out, const AttentionBlock& shape,
                               Stream& stream) = 0;
  // One block's share of the gradient through attention of dout (B,Tq,NH*HS;
  // shape.dout), with lse and D (shape.stats) those of the final result (merged over
  // every block; lse finite): P_ij = exp(scale q_i . k_j - lse_i) (0 where masked) and
  // dS_ij = P_ij (dout_i . v_j - D_i), and
  //   dq (B,Tq,NH*HS; shape.dq) += scale dS k,  dk (B,Tk,KVH*HS; shape.dk) += scale dS^T q,
  //   dv (B,Tk,KVH*HS; shape.dv) += P^T dout,
  // a key/value head's gradients summing those of the query heads that read it; each
  // sum is formed whole in Acc, then added. Summed over every block of a sequence (dk
  // and dv wherever their block travelled), they are AttentionBackward's dqkv. dq, dk
  // and dv overlap neither each other nor an input.
  virtual void AttentionBlockBackward(Out<Acc> dq, Out<Acc> dk, Out<Acc> dv, In<Act> dout, In<Act> q, In<Act> k,
                                      In<Act> v, In<Acc> lse, In<Acc> D, const AttentionBlock& shape,
                                      Stream& stream) = 0;

  // --- RoPE (rotate-half, as transformers applies it to Hugging Face's weights) ---
  // In place on the q and k heads of qkv (B,T,(NH+2*KVH)*HS), the token at row b*T + t at
  // position t: for i < HS/2, (x[i], x[i+HS/2]) becomes (x[i] cos - x[i+HS/2] sin,
  // x[i+HS/2] cos + x[i] sin), with cos and sin (rows by position, HS/2 columns) of angle
  // t * frequency i. v is left alone.
  virtual void RopeForward(Out<Act> qkv, In<Acc> cos, In<Acc> sin, int B, int T, int NH, int KVH, int HS,
                           Stream& stream) = 0;
  // The same on a gradient dqkv, rotating back: its backward.
  virtual void RopeBackward(Out<Act> dqkv, In<Acc> cos, In<Acc> sin, int B, int T, int NH, int KVH, int HS,
                            Stream& stream) = 0;

  // --- SwiGLU (the Llama class's MLP) ---
  // out (N,H) = silu(gate) * up, where gate_up (N,2H) holds gate in its first H columns
  // and up in the next H.
  virtual void SwiGluForward(Out<Act> out, In<Act> gate_up, int64_t N, int H, Stream& stream) = 0;
  // dgate_up (N,2H) = the gradients of gate and up for dout (N,H).
  virtual void SwiGluBackward(Out<Act> dgate_up, In<Act> dout, In<Act> gate_up, int64_t N, int H,
                              Stream& stream) = 0;

  // --- Mixture of experts (the sparse MLP of Mixtral and Qwen3-MoE, as transformers
  // computes it; dropless: every token reaches its k experts, none is dropped) ---
  // A layer over x (N,C), E experts of H hidden units, k of them a token:
  //   logits (N,E) = MatmulForward of x by the router (E,C)
  //   RouterTopKForward: probs, experts, weights     MoePermutePlan: counts, positions
  //   MoePermute: xs (N*k,C), grouped by expert      (counts downloaded to the host)
  //   GroupedMatmulForward of xs by gate_up (E,2H,C) into gate_up (N*k,2H); SwiGluForward
  //   into h (N*k,H); GroupedMatmulForward of h by down (E,C,H) into ys (N*k,C)
  //   MoeCombineForward: out (N,C) = the weighted sum of each token's k rows of ys
  // and back in reverse order; x's gradient is the router's MatmulBackward's (written)
  // plus MoePermuteBackward's (added).
  //
  // probs (N,E) = the softmax of logits (as stored) over the E experts, kept for the
  // backward and for a load-balancing loss; experts (N,k) = the k most probable, most
  // probable first, of equal probabilities the lower index first (deterministic, the
  // same on every table); weights (N,k) = their probabilities, divided by the sum of the
  // k when renormalize (Mixtral always; Qwen3-MoE where norm_topk_prob). Unlike
  // transformers, the weights stay in Acc (it casts them to the activations' type).
  // REQUIRES: 1 <= k <= E (on the CUDA table also k <= 32, and E <= 1024 in
  // MoePermutePlan).
  virtual void RouterTopKForward(Out<Acc> probs, Out<int32_t> experts, Out<Acc> weights, In<Act> logits, int64_t N,
                                 int E, int k, bool renormalize, Stream& stream) = 0;
  // dlogits (N,E) = the gradient through the softmax of: dweights (N,k) through the top k
  // (optionally renormalised; the choice of experts held fixed), plus dprobs (N,E;
  // nullable), a loss's gradient of probs (a load-balancing loss). probs and experts as
  // the forward left them.
  virtual void RouterTopKBackward(Out<Act> dlogits, In<Acc> dweights, In<Acc> dprobs, In<Acc> probs,
                                  In<int32_t> experts, int64_t N, int E, int k, bool renormalize,
                                  Stream& stream) = 0;
  // The dispatch order of the N*k copies of the tokens (copy (n,j) goes to expert
  // experts[n,j]): by expert, within an expert by token, then by j (a stable sort, the
  // same on every table). counts (E) = the copies each expert gets; positions (N,k) = the
  // row of copy (n,j) in that order, so expert e's rows are the counts[e] that follow the
  // rows of experts 0..e-1. Both stay on the device: the caller downloads counts (E int32,
  // then a wait on the stream) for what needs them on the host: GroupedMatmul's row
  // counts and, with experts spread over ranks (each a contiguous range of experts),
  // AllToAll's per-peer counts (the sums of counts over each peer's experts, times C).
  // REQUIRES: 0 <= experts < E; N*k < 2^31.
  virtual void MoePermutePlan(Out<int32_t> counts, Out<int32_t> positions, In<int32_t> experts, int64_t N, int k,
                              int E, Stream& stream) = 0;
  // xs (N*k,C): row positions[n,j] = x's row n.
  virtual void MoePermute(Out<Act> xs, In<Act> x, In<int32_t> positions, int64_t N, int k, int C,
                          Stream& stream) = 0;
  // dx (N,C) += the sum over j, in order, of dxs's row positions[n,j] (from the sum not
  // stored, then added to dx as stored): x's gradient from the experts, added to the
  // router's, which MatmulBackward wrote.
  virtual void MoePermuteBackward(Out<Act> dx, In<Act> dxs, In<int32_t> positions, int64_t N, int k, int C,
                                  Stream& stream) = 0;
  // out (N,C) = the sum over j, in order, of weights[n,j] * ys's row positions[n,j], plus
  // residual (N,C; nullable; may be out) last, from the sum not stored.
  virtual void MoeCombineForward(Out<Act> out, In<Act> ys, In<Acc> weights, In<int32_t> positions, In<Act> residual,
                                 int64_t N, int k, int C, Stream& stream) = 0;
  // dys (N*k,C): row positions[n,j] = weights[n,j] * dout's row n; dweights (N,k) =
  // dout's row n . ys's row positions[n,j]. (The residual's gradient is dout itself.)
  virtual void MoeCombineBackward(Out<Act> dys, Out<Acc> dweights, In<Act> dout, In<Act> ys, In<Acc> weights,
                                  In<int32_t> positions, int64_t N, int k, int C, Stream& stream) = 0;
  // For each expert e of E, on its counts[e] rows (rows grouped by expert as
  // MoePermutePlan leaves them: e's follow those of 0..e-1, from row 0): out_e (m_e,OC) =
  // inp_e (m_e,K) @ weight_e (OC,K)^T, weights stacked (E,OC,K). counts is a host array
  // of E, read during the call (the caller may reuse it when the call returns); an
  // expert with no rows is skipped.
  virtual void GroupedMatmulForward(Out<Act> out, In<Act> inp, In<Act> weight, const int32_t* counts, int E, int K,
                                    int OC, Stream& stream) = 0;
  // dinp_e (m_e,K) = dout_e (m_e,OC) @ weight_e; dweight_e (OC,K) += dout_e^T @ inp_e
  // (an expert with no rows adds nothing). dinp aliases neither dout nor inp.
  virtual void GroupedMatmulBackward(Out<Act> dinp, Out<Acc> dweight, In<Act> dout, In<Act> inp, In<Act> weight,
                                     const int32_t* counts, int E, int K, int OC, Stream& stream) = 0;

  // --- Elementwise ---
  // out = a + b (n elements); out may alias a or b.
  virtual void Add(Out<Act> out, In<Act> a, In<Act> b, int64_t n, Stream& stream) = 0;
  // Inverted dropout: out (rows, width) = in * keep / (1 - p), where element (i, j) is
  // element (first_row + i, first_column + j) of a tensor of row_stride columns and
  // keep = DropoutKeeps(key, its index in that tensor) (kernels/dropout.h). out may be in
  // (in place). The same call on a gradient is its backward.
  virtual void Dropout(Out<Act> out, In<Act> in, int64_t rows, int width, float p, uint64_t key, int64_t first_row,
                       int64_t row_stride, int64_t first_column, Stream& stream) = 0;

  // --- Loss (the LM head, a chunk of R rows at a time; vocabulary-parallel) ---
  // Over logits (R,Vp) whose first v_rows columns are real (the rest is padding, which
  // never takes part): losses (R) = -log softmax(logits)[target], targets in
  // [0, v_rows), or -1 for a masked position (a prompt's token in fine-tuning data), whose
  // loss and gradient are 0. With dlogits (nullable; may alias logits): dlogits =
  // (softmax - onehot) * dloss on the real columns, 0 on the padding and on masked rows.
  virtual void CrossEntropy(Out<Acc> losses, Out<Act> dlogits, In<Act> logits, In<int32_t> targets, int64_t R,
                            int64_t v_rows, int64_t Vp, float dloss, Stream& stream) = 0;
  // With the vocabulary split over TP ranks, this slice holding [v_begin, v_begin +
  // v_rows): stats (R,3) = the max of the real logits, the sum of exp(logit - max), and
  // the target's logit (0 when another slice holds the target).
  virtual void VocabSliceStats(Out<Acc> stats, In<Act> logits, In<int32_t> targets, int64_t R, int64_t v_rows,
                               int64_t Vp, int64_t v_begin, Stream& stream) = 0;
  // From every slice's stats (slices,R,3), in slice order: losses (R) as CrossEntropy's
  // (the same on every slice; 0 for a masked target, -1), and dlogits (nullable; may
  // alias logits) for this slice.
  virtual void VocabSliceCrossEntropy(Out<Acc> losses, Out<Act> dlogits, In<Act> logits, In<Acc> all_stats,
                                      int slices, In<int32_t> targets, int64_t R, int64_t v_rows, int64_t Vp,
                                      int64_t v_begin, float dloss, Stream& stream) = 0;
  // *sum += scale * (the sum of losses (R)), in fp64 and in a fixed order.
  virtual void AddLoss(Out<double> sum, In<Acc> losses, int64_t R, double scale, Stream& stream) = 0;

  // --- Shard operations (the units' flat buffers) ---
  // into += scale x from (n elements); scale 1 adds exactly.
  virtual void Accumulate(Out<Acc> into, In<Acc> from, int64_t n, float scale, Stream& stream) = 0;
  // to = from as Act (n elements): master weights into their compute copy.
  virtual void Cast(Out<Act> to, In<Acc> from, int64_t n, Stream& stream) = 0;
  // *sum += the sum of squares of grads over the segments marked in_norm, in fp64.
  virtual void SumSquares(Out<double> sum, In<Acc> grads, In<ShardSegment> segments, int count,
                          Stream& stream) = 0;
  // *scale = max_norm / norm when max_norm > 0 and norm = sqrt(*sum_of_squares) exceeds
  // it, else 1: clipping without a trip to the host.
  virtual void ClipScale(Out<float> scale, In<double> sum_of_squares, float max_norm, Stream& stream) = 0;
  // AdamW over the segments, with the gradients times *clip_scale (nullable: 1):
  //   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
  //   master -= lr (m / (1 - beta1^t) / (sqrt(v / (1 - beta2^t)) + eps) + wd master)
  // (wd only on segments marked decay), and params (nullable) = master as Act.
  virtual void AdamW(Out<Acc> master, Out<Act> params, In<Acc> grads, Out<Acc> m, Out<Acc> v,
                     In<ShardSegment> segments, int count, const AdamWStep& step, In<float> clip_scale,
                     Stream& stream) = 0;

 protected:
  // Throws std::invalid_argument when MatmulForward's arguments break its contract.
  static void CheckMatmulForward(Out<Act> out, Out<Act> gelu_pre, In<Act> residual) {
    if (residual && gelu_pre) throw std::invalid_argument("MatmulForward: a residual and a GELU output exclude each other");
    if (residual && residual == In<Act>(out)) throw std::invalid_argument("MatmulForward: the residual is the output");
  }
  // Throws std::invalid_argument when an attention block's shape breaks its contract
  // (`what` names the operation).
  static void CheckAttentionBlock(const AttentionBlock& s, const char* what) {
    if (s.B < 0 || s.Tq < 0 || s.Tk < 0 || s.NH <= 0 || s.KVH <= 0 || s.HS <= 0 || s.NH % s.KVH != 0) {
      throw std::invalid_argument(std::string(what) + ": B=" + std::to_string(s.B) + " Tq=" + std::to_string(s.Tq) +
                                  " Tk=" + std::to_string(s.Tk) + ", " + std::to_string(s.NH) +
                                  " query heads in groups over " + std::to_string(s.KVH) + " key/value heads of " +
                                  std::to_string(s.HS) + " channels");
    }
    if (s.mask == AttentionMask::kCausal && s.Tq != s.Tk) {
      throw std::invalid_argument(std::string(what) + ": a causal block of " + std::to_string(s.Tq) +
                                  " query rows against " + std::to_string(s.Tk) + " key rows (it takes Tq == Tk)");
    }
  }
};

}  // namespace meshtrain::kernels
