// GPT-2's math, one FSDP unit at a time (DESIGN.md, "Who owns what in the engine").
//
// Each layer is a forward/backward pair of plain functions over views: a unit's
// parameters (or their gradients) inside its flat buffer, and the activations the
// forward keeps for the backward, all device handles. They enqueue kernels of the table
// in a Context on its stream, in order, and own no memory: the sharded engine
// (parallel/) gives them their buffers and runs them on any device.
//
// Backward functions accumulate (+=) into parameter gradients. The residual stream's
// gradient flows through one buffer, in place (llm.c's way): BlockBackward takes the
// gradient of the block's output in scratch.dresidual and leaves the gradient of its
// input there. Shapes: B sequences of T tokens, N = B*T rows, C channels, NH heads.
//
// Tensor parallelism (Megatron; parameters.h says which slice a rank holds): QKV and
// MLP-in are column-parallel (this rank's heads and hidden units), attention-out and
// MLP-out row-parallel, joined by one all-reduce each in forward and one each in backward
// (for the input gradient of the column-parallel products); the embedding and the LM head
// are vocabulary-parallel, and the softmax is computed across the group from per-slice
// statistics, never gathering the logits. Every rank of the group ends with the same
// activations and loss, bit for bit.
// Views are sized for the largest micro-batch; a call uses the first N rows.
// Thread-safety: plain functions; the work they enqueue follows the stream's rules.

#pragma once

#include <cstdint>

#include "api/engine_memory.h"
#include "api/model_shape.h"
#include "worker/kernels/ops.h"
#include "worker/model/parameters.h"
#include "worker/runtime/device_ptr.h"

namespace meshtrain::model {

template <class T>
using Ptr = runtime::DevicePtr<T>;

// The tensor-parallel group's collectives as the layers use them, in a stream's order.
template <class P>
class TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // data (n) = its sum over the group, in place; every rank gets the same bits.
  virtual void AllReduceSum(Ptr<typename P::Act> data, int64_t n, runtime::Stream& stream) = 0;
  // out (size x n) = every rank's in (n), in rank order.
  virtual void AllGather(Ptr<const typename P::Acc> in, Ptr<typename P::Acc> out, int64_t n,
                         runtime::Stream& stream) = 0;
};

// What the layers run with: the kernel table, the stream they enqueue on, and the TP
// group (null: every layer whole on this rank).
template <class P>
struct Context {
  kernels::Ops<P>& ops;
  runtime::Stream& stream;
  TensorParallelGroup<P>* tp = nullptr;
};

// This rank's slice of the layers: its heads, MLP width and vocabulary rows (the real
// [vocab_begin, +vocab) and the padded count the embedding holds).
struct TpSlice {
  int rank = 0, size = 1;
  int vocab_multiple = api::kVocabMultiple;
  int64_t vocab_begin(int64_t V) const { return api::VocabBegin(V, rank, size); }
  int64_t vocab(int64_t V) const { return api::VocabSlice(V, rank, size); }
  int64_t padded_vocab(int64_t V) const { return api::PaddedVocabRows(vocab(V), vocab_multiple); }
};

// Dropout in a training forward (p > 0) on each block's attention output and on the
// attention and MLP outputs added to the residual stream. Masks are keyed by `key` (the
// seed and the step; Dims::ForLayer mixes in the layer) and indexed by the element's
// place in the step's global batch, whose sample `first_sample` is this micro-batch's
// first sequence: every layout and every number of micro-steps drops what one rank drops.
struct DropoutSpec {
  float p = 0;
  uint64_t key = 0;
  int64_t first_sample = 0;
};

struct Dims {
  int B = 0, T = 0, C = 0, NH = 0;
  int64_t V = 0;  // the vocabulary (the user's, unpadded)
  TpSlice tp{};
  DropoutSpec dropout{};
  int64_t N() const { return int64_t(B) * T; }
  // These dims for block l: its own dropout masks.
  Dims ForLayer(int l) const;
};

// The root unit: wte (Vp,C), wpe (maxT,C), lnf.w (C), lnf.b (C).
template <class T>
struct RootParams {
  Ptr<T> wte, wpe, lnfw, lnfb;
  // Views into the root unit's flat buffer (layout.Unit(0)).
  static RootParams At(Ptr<T> unit, const ParameterLayout& layout);
};

// One block unit: ln1 (C)+(C), qkv (3C,C)+(3C), attproj (C,C)+(C), ln2, fc (4C,C)+(4C),
// fcproj (C,4C)+(C), this rank's slices. Every block has the same offsets in its unit.
template <class T>
struct BlockParams {
  Ptr<T> ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb;
  static BlockParams At(Ptr<T> unit, const ParameterLayout& layout);
};

// The engine's element types and what its kernel table keeps for attention.
template <class P>
api::EngineTypes TypesOf(kernels::Ops<P>& ops, int B, int T, int NH, int HS);

// What one block's forward keeps for its backward (api::BlockActivationBytes).
template <class P>
struct BlockActivations {
  using A = typename P::Act;
  using G = typename P::Acc;
  Ptr<A> ln1, qkv, atty, residual2, ln2, fch, fch_gelu, output;
  Ptr<G> ln1_mean, ln1_rstd, att_state, ln2_mean, ln2_rstd;
  static int64_t Bytes(int batch, int seq, const api::ModelShape& shape, TpSlice tp, const api::EngineTypes& types);
  static BlockActivations At(runtime::DeviceBytes base, int batch, int seq, const api::ModelShape& shape, TpSlice tp,
                             const api::EngineTypes& types);
};

// The backward's working set, one for every block (api::BlockScratchBytes): dresidual
// carries the residual stream's gradient; proj holds a projection's output in forward.
template <class P>
struct BlockScratch {
  using A = typename P::Act;
  Ptr<A> proj, dresidual, dln, dfch, datty, dqkv;
  Ptr<A> dmasked, dropped;  // with dropout only
  runtime::DeviceBytes attention;
  static int64_t Bytes(int batch, int seq, const api::ModelShape& shape, TpSlice tp, const api::EngineTypes& types,
                       bool dropout);
  static BlockScratch At(runtime::DeviceBytes base, int batch, int seq, const api::ModelShape& shape, TpSlice tp,
                         const api::EngineTypes& types, bool dropout);
};

// The head (api::HeadActivationBytes): the final LayerNorm, the losses, and one chunk of
// `chunk_rows` rows of logits at a time.
template <class P>
struct HeadActivations {
  using A = typename P::Act;
  using G = typename P::Acc;
  Ptr<A> lnf, logits, dlnf;
  Ptr<G> lnf_mean, lnf_rstd, losses, stats, all_stats;
  int64_t chunk_rows = 0;
  static int64_t Bytes(int batch, int seq, const api::ModelShape& shape, TpSlice tp, const api::EngineTypes& types);
  static HeadActivations At(runtime::DeviceBytes base, int batch, int seq, const api::ModelShape& shape, TpSlice tp,
                            const api::EngineTypes& types);
};

// encoded (N,C) = wte[tokens] + wpe[t], over the TP group's slices.
template <class P>
void EmbedForward(const Context<P>& k, Ptr<typename P::Act> encoded, Ptr<const int32_t> tokens,
                  const RootParams<const typename P::Act>& p, const Dims& d);
// dp.wte, dp.wpe += the gradient of EmbedForward for dencoded (N,C).
template <class P>
void EmbedBackward(const Context<P>& k, const RootParams<typename P::Acc>& dp, Ptr<const typename P::Act> dencoded,
                   Ptr<const int32_t> tokens, const Dims& d);

// a.output (N,C) = the block applied to residual (N,C).
template <class P>
void BlockForward(const Context<P>& k, const BlockActivations<P>& a, const BlockScratch<P>& scratch,
                  Ptr<const typename P::Act> residual, const BlockParams<const typename P::Act>& p, const Dims& d);
// scratch.dresidual: the gradient of a.output in, of residual out; dp += the parameters'.
template <class P>
void BlockBackward(const Context<P>& k, const BlockParams<typename P::Acc>& dp, const BlockScratch<P>& scratch,
                   const BlockActivations<P>& a, Ptr<const typename P::Act> residual,
                   const BlockParams<const typename P::Act>& p, const Dims& d);

// The final LayerNorm of x (N,C), the tied LM head and the cross-entropy against targets
// (N), chunk by chunk: *loss_sum += loss_weight * (the mean loss). In training (dp
// non-null) the head's backward runs here too, as each chunk's logits are made (llm.c's
// fused classifier): dx (N,C) += d(loss_weight * mean loss)/dx (the caller zeroes it), and
// dp's wte and lnf += theirs. Only one chunk of logits ever exists.
template <class P>
void HeadForward(const Context<P>& k, const HeadActivations<P>& h, Ptr<const typename P::Act> x,
                 const RootParams<const typename P::Act>& p, Ptr<const int32_t> targets, Ptr<double> loss_sum,
                 double loss_weight, const RootParams<typename P::Acc>* dp, Ptr<typename P::Act> dx, const Dims& d);
// h.logits (Vp) = the logits of row `row` of x (N,C): for sampling.
template <class P>
void HeadLogits(const Context<P>& k, const HeadActivations<P>& h, Ptr<const typename P::Act> x,
                const RootParams<const typename P::Act>& p, int64_t row, const Dims& d);

}  // namespace meshtrain::model
