// GPT-2's math, one FSDP unit at a time (DESIGN.md, "Who owns what in the engine").
//
// Each layer is a forward/backward pair of plain functions over views: a unit's
// parameters (or their gradients) inside its flat buffer, and the activations the
// forward keeps for the backward. Outputs come first; `d` names a gradient. The
// functions own no memory and know nothing of sharding, so the single-device model
// (gpt2.h) and the sharded engine (parallel/engine.h) run the same code.
//
// Backward functions accumulate into parameter gradients (+=) and into the gradient
// of their input, which the caller zeroes; the scratch gradients of a block are
// zeroed here. Shapes: B sequences of Tn tokens, C channels, NH heads, V vocabulary.
//
// Tensor parallelism (Megatron; parameters.h says which slice a rank holds): with a
// TensorParallelGroup in Dims, QKV and MLP-in are column-parallel (this rank's heads and
// hidden units), attention-out and MLP-out row-parallel, joined by one all-reduce each
// in forward (and one each in backward, for the input gradient of the column-parallel
// products); the embedding and the LM head are vocabulary-parallel, and the softmax is
// computed across the group from per-slice statistics, never gathering the logits.
// Every rank of the group ends with the same activations and loss, bit for bit.
// Views are sized for the largest micro-batch (max_batch x max_seq); a call uses the
// first B*Tn rows. Thread-safety: plain functions; kernels use OpenMP inside.

#pragma once

#include <cstdint>
#include <vector>

#include "api/engine_memory.h"
#include "api/model_shape.h"
#include "worker/model/parameters.h"

namespace meshtrain::model {

// The tensor-parallel group a layer runs in. Float only.
class TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // data (n) = its sum over the group, in place; every rank gets the same bits.
  virtual void AllReduceSum(float* data, int64_t n) = 0;
  // out (size x n) = every rank's in (n), in rank order.
  virtual void AllGather(const float* in, float* out, int64_t n) = 0;
};

// Local widths for rank `tp_rank` of `tp_size`: heads, attention width C/T, MLP width
// 4C/T and the vocabulary slice [V*t/T, V*(t+1)/T).
struct TpSlice {
  int rank = 0, size = 1;
  int64_t vocab_begin(int64_t V) const { return api::VocabBegin(V, rank, size); }
  int64_t vocab(int64_t V) const { return api::VocabSlice(V, rank, size); }
};

// Dropout in a training forward (p > 0) on each block's attention output and on the
// attention and MLP outputs added to the residual stream. Masks are keyed by `key` (the
// seed, step and micro-batch mixed in; Dims::ForLayer mixes in the layer) and by the
// element's index in the global micro-batch, whose sample `first_sample` is this
// rank's first sequence: every layout drops what the single-rank run drops.
struct DropoutSpec {
  float p = 0;
  uint64_t key = 0;
  int64_t first_sample = 0;
};

struct Dims {
  int B, Tn, C, NH, V;
  TensorParallelGroup* tp = nullptr;  // null: every layer whole on this rank
  DropoutSpec dropout{};
  TpSlice slice() const { return tp ? TpSlice{tp->rank(), tp->size()} : TpSlice{}; }
  // These dims for block l: its own dropout masks.
  Dims ForLayer(int l) const;
};

// The tokens of a forward, kept for its backward.
struct MicroBatch {
  int B = 0, Tn = 0;
  std::vector<int32_t> inputs, targets;  // targets empty: a forward without a loss
  // Throws std::invalid_argument for more than max_batch x max_seq tokens and
  // std::out_of_range for a token outside the vocabulary.
  void Set(const int32_t* inputs, const int32_t* targets, int B, int Tn, int max_batch, int max_seq, int64_t vocab);
  const int32_t* targets_or_null() const { return targets.empty() ? nullptr : targets.data(); }
};

// The root unit: wte (V,C), wpe (maxT,C), lnf.w (C), lnf.b (C). T may be const.
template <class T>
struct RootParams {
  T *wte, *wpe, *lnfw, *lnfb;
  // Views into the root unit's flat buffer (layout.Unit(0)).
  static RootParams At(T* unit, const ParameterLayout& layout);
};

// One block unit: ln1 (C,C), qkv (3C,C)+(3C), attproj (C,C)+(C), ln2, fc (4C,C)+(4C),
// fcproj (C,4C)+(C). Every block has the same offsets inside its unit.
template <class T>
struct BlockParams {
  T *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb, *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
  static BlockParams At(T* unit, const ParameterLayout& layout);
};

// What one block's forward keeps (and, as the backward's scratch, their gradients).
template <class T>
struct BlockActivations {
  T *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *preatt, *att, *attproj, *residual2, *ln2, *ln2_mean, *ln2_rstd, *fch,
      *fch_gelu, *fcproj, *residual3;  // residual3: the block's output
  T* base;
  int64_t size;
  // Elements for micro-batches up to max_batch x max_seq, on TP slice `tp`.
  static int64_t Size(int max_batch, int max_seq, const api::ModelShape& shape, TpSlice tp = {});
  static BlockActivations At(T* base, int max_batch, int max_seq, const api::ModelShape& shape, TpSlice tp = {});
};

// The final LayerNorm, the tied LM head (this slice's logits and probs) and the loss;
// with TP, the softmax statistics of this slice (B*T,3) and of all (T,B*T,3).
template <class T>
struct HeadActivations {
  T *lnf, *lnf_mean, *lnf_rstd, *logits, *probs, *losses, *stats, *all_stats;
  static int64_t Size(int max_batch, int max_seq, const api::ModelShape& shape, TpSlice tp = {});
  static HeadActivations At(T* base, int max_batch, int max_seq, const api::ModelShape& shape, TpSlice tp = {});
};

// Every activation of a micro-batch, as views into one buffer: what the forward keeps
// for each block, and the backward's scratch (one block's gradients, the head's, and
// the residual stream's gradient in and out of a block).
template <class T>
struct ModelActivations {
  T* encoded;  // (B,Tn,C): the first block's input
  std::vector<BlockActivations<T>> blocks;
  HeadActivations<T> head, dhead;
  BlockActivations<T> dblock;
  T* dresidual[2];  // (B,Tn,C) each; the gradient of a block's output and of its input
  static int64_t Size(int max_batch, int max_seq, const api::ModelShape& shape);
  static ModelActivations At(T* base, int max_batch, int max_seq, const api::ModelShape& shape);
  // The input of block l: encoded, or block l-1's output.
  const T* Input(int l) const { return l == 0 ? encoded : blocks[size_t(l) - 1].residual3; }
};

// encoded (B,Tn,C) = wte[inputs] + wpe[t].
template <class T>
void EmbedForward(T* encoded, const int32_t* inputs, const RootParams<const T>& p, const Dims& d);
template <class T>
void EmbedBackward(const RootParams<T>& dp, const T* dencoded, const int32_t* inputs, const Dims& d);

// out.residual3 (B,Tn,C) = the block applied to residual (B,Tn,C).
template <class T>
void BlockForward(const BlockActivations<T>& out, const T* residual, const BlockParams<const T>& p, const Dims& d);
// dresidual += d(block)/d(residual) . dout; dp += d(block)/d(params) . dout, where dout is
// the gradient of out.residual3. `scratch` holds the block's internal gradients.
template <class T>
void BlockBackward(const BlockParams<T>& dp, T* dresidual, const BlockActivations<T>& scratch, const T* dout,
                   const BlockActivations<T>& a, const T* residual, const BlockParams<const T>& p, const Dims& d);

// Final LayerNorm of x (B,Tn,C), logits, and softmax. With targets, returns the mean
// cross-entropy loss; without, returns 0 (targets of 0 keep the softmax right).
template <class T>
double HeadForward(const HeadActivations<T>& out, const T* x, const RootParams<const T>& p, const int32_t* targets,
                   const Dims& d);
// dx += d(loss_scale * mean loss)/dx; dp += the same over wte and lnf. `scratch`
// receives the head's internal gradients.
template <class T>
void HeadBackward(const RootParams<T>& dp, T* dx, const HeadActivations<T>& scratch, const HeadActivations<T>& a,
                  const T* x, const RootParams<const T>& p, const int32_t* targets, T loss_scale, const Dims& d);

}  // namespace meshtrain::model
