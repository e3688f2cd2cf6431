// A model family's math, one FSDP unit at a time (docs/design.md, "FSDP
// units"): the embedding, a block and the head, each a forward/backward pair over views.
// The family's description (api/model_family.h) says what the units hold; this says what
// they compute. GPT-2 (gpt2.cc) and the Llama class (llama.cc) implement it; the engine
// (parallel/) and the whole-model reference of the tests call it and name no family.
//
// Each call enqueues kernels of the table in a Context on its stream, in order, and owns
// no memory: the caller gives the unit's gathered parameters (or their gradients) and the
// activation buffers, all device handles, and runs them on any device. Backward functions
// accumulate (+=) into parameter gradients. The residual stream's gradient flows through
// one buffer, in place (llm.c's way): BlockBackward takes the gradient of the block's
// output in scratch.dresidual and leaves the gradient of its input there. Shapes: B
// sequences of T tokens, N = B*T rows, C channels.
//
// Tensor parallelism (Megatron; parameters.h says which slice a rank holds): q, k and v
// and the MLP's first product are column-parallel (this rank's heads and hidden units),
// attention's output projection and the MLP's last product row-parallel, joined by one
// all-reduce each in forward and one each in backward (for the input gradient of the
// column-parallel products); the embedding and the LM head are vocabulary-parallel, and
// the softmax is computed across the group from per-slice statistics, never gathering the
// logits. Every rank of the group ends with the same activations and loss, bit for bit.
// Activation buffers are sized for the largest micro-batch; a call uses the first N rows.
// Thread-safety: a Model is immutable; the work it enqueues follows the stream's rules.

#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string_view>
#include <vector>

#include "api/engine_memory.h"
#include "api/model_family.h"
#include "api/model_shape.h"
#include "worker/kernels/ops.h"
#include "worker/model/parameters.h"
#include "worker/runtime/backend.h"
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

// The documents of a micro-batch's sequences (spec.data.attention: document), host data:
// for each of its B sequences, the rows of the whole sequence (cp_size x T tokens) where a
// document starts, ascending, the first 0. A token attends only to the earlier tokens of
// its own document, and its position (RoPE's, GPT-2's learned table's) is its row less
// its document's start, as Hugging Face computes packed sequences with position_ids.
struct Documents {
  std::vector<std::vector<int64_t>> starts;
};

// Tokens each expert of each mixture-of-experts block received (by the block's index in
// the model; E counts each), added up over a step's training forwards on this rank.
using ExpertCounts = std::map<int, std::vector<int64_t>>;

// What a load-balancing loss needs of one micro-batch's training forward on this rank:
// the copies each expert received and the sum of each expert's router probability over
// the tokens, both summed over every mixture-of-experts block (E each), and the blocks.
struct RouterStats {
  std::vector<double> counts, probabilities;
  int blocks = 0;
};

// A run of one document's rows on this rank: rows [row, row + rows) of sequence b's T on
// this rank, which are rows [whole, whole + rows) of the whole sequence, of the document
// that starts at row `start` of the whole sequence (start <= whole).
struct Segment {
  int b = 0;
  int64_t row = 0, rows = 0, whole = 0, start = 0;
  int64_t position() const { return whole - start; }  // its first row's
};

// This rank's T rows of each of B sequences (with cp_size > 1, api::ContextRows's chunks
// of the cp_size x T rows) cut where a chunk or a document ends, in order of b and row.
// Throws std::invalid_argument when `documents` has not B sequences of ascending starts in
// [0, cp_size x T), the first 0.
std::vector<Segment> SegmentsOf(const Documents& documents, int B, int T, int cp_rank, int cp_size);

// Attention across the context-parallel group (api/layout.h): each rank holds two chunks
// of every sequence (api::ContextRows), and the layers call these instead of the table's
// AttentionForward and AttentionBackward, with the same contracts on this rank's rows:
// qkv (B,T,(NH+2*KVH)*HS) of its T rows, out (B,T,NH*HS), causal by position in the
// whole sequence. state holds api::AttentionStateElements of the engine's types (which
// know the group) and scratch their attention_scratch_bytes, shared by the forward and
// the backward. Every rank of the group makes the same calls in the same order.
template <class P>
class ContextParallelGroup {
 public:
  using A = typename P::Act;
  using G = typename P::Acc;
  virtual ~ContextParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void AttentionForward(kernels::Ops<P>& ops, Ptr<A> out, Ptr<G> state, runtime::DeviceBytes scratch,
                                Ptr<const A> qkv, int B, int T, int NH, int KVH, int HS, runtime::Stream& stream) = 0;
  virtual void AttentionBackward(kernels::Ops<P>& ops, Ptr<A> dqkv, runtime::DeviceBytes scratch, Ptr<const A> dout,
                                 Ptr<const A> qkv, Ptr<const A> out, Ptr<const G> state, int B, int T, int NH,
                                 int KVH, int HS, runtime::Stream& stream) = 0;
  // The same within the documents of the whole sequences (Documents), on this rank's
  // rows; the state and scratch are as above. A group without document attention throws
  // std::logic_error.
  virtual void DocumentAttentionForward(kernels::Ops<P>& ops, Ptr<A> out, Ptr<G> state, runtime::DeviceBytes scratch,
                                        Ptr<const A> qkv, int B, int T, int NH, int KVH, int HS,
                                        const Documents& documents, runtime::Stream& stream);
  virtual void DocumentAttentionBackward(kernels::Ops<P>& ops, Ptr<A> dqkv, runtime::DeviceBytes scratch,
                                         Ptr<const A> dout, Ptr<const A> qkv, Ptr<const A> out, Ptr<const G> state,
                                         int B, int T, int NH, int KVH, int HS, const Documents& documents,
                                         runtime::Stream& stream);
};

// The expert group of expert parallelism (api/layout.h) as a mixture's layers use it, in
// a stream's order: member j holds experts [j E/size, (j+1) E/size) of every block.
template <class P>
class ExpertParallelGroup {
 public:
  using A = typename P::Act;
  virtual ~ExpertParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // all (size x E) = every member's counts (E), in member order.
  virtual void AllGatherCounts(Ptr<const int32_t> counts, Ptr<int32_t> all, int E, runtime::Stream& stream) = 0;
  // Rows of `width` elements: send holds send_rows[p] rows for member p after member p-1's,
  // and recv gets recv_rows[p] from member p the same way; member r's send_rows[p] is
  // member p's recv_rows[r].
  virtual void AllToAll(Ptr<const A> send, const std::vector<int64_t>& send_rows, Ptr<A> recv,
                        const std::vector<int64_t>& recv_rows, int64_t width, runtime::Stream& stream) = 0;
};

// Named buffers carved out of one device allocation, in the order of an api list
// (api/model_family.h): what a family's layers take their activations from.
class Carving {
 public:
  Carving() = default;
  Carving(runtime::DeviceBytes base, std::vector<api::Buffer> buffers);
  // The buffer called `name`, of elements of T. Throws std::logic_error if there is none,
  // or if its elements are not of T's size.
  template <class T>
  Ptr<T> Get(std::string_view name) const {
    return At(name, int(sizeof(T)), /*required=*/true).template As<T>();
  }
  // The same, or null where the list has no such buffer.
  template <class T>
  Ptr<T> Find(std::string_view name) const {
    return At(name, int(sizeof(T)), /*required=*/false).template As<T>();
  }
  // The elements of the buffer called `name`. Throws std::logic_error if there is none.
  int64_t Elements(std::string_view name) const;
  int64_t bytes() const { return bytes_; }

 private:
  runtime::DeviceBytes At(std::string_view name, int element_bytes, bool required) const;
  runtime::DeviceBytes base_{};
  std::vector<api::Buffer> buffers_;
  std::vector<int64_t> offsets_;
  int64_t bytes_ = 0;
};

// What the layers run with: the kernel table, the stream they enqueue on, the TP group
// (null: every layer whole on this rank), the family's buffers (api::FamilyBuffers,
// filled by PrepareFamilyBuffers: the Llama class's RoPE table), the context group
// (null: whole sequences on this rank), and the micro-batch's documents (null: causal
// attention over each whole window; else the buffers hold positions 0 to cp_size x T - 1,
// WindowPositions, whatever this rank's rows).
// Float8 training (spec.training.precision fp8): the recipe the blocks' linear layers cast
// with (kernels/float8.h), and the scratch of their amaxes and scales, laid out as
// LinearForward (layers.h) uses it: amaxes (2 x width), the TP group's gathered amaxes
// (tp x 2 x width) and scales (2 x width) of float, api::Float8ScratchElements of them.
struct Float8Linear {
  kernels::Float8Recipe recipe = kernels::Float8Recipe::kTensorwise;
  Ptr<float> scratch;
  int64_t width = 1;  // the most scales one operand of a product takes
};

template <class P>
struct Context {
  kernels::Ops<P>& ops;
  runtime::Stream& stream;
  TensorParallelGroup<P>* tp = nullptr;
  Carving buffers{};
  ContextParallelGroup<P>* cp = nullptr;
  // What a layer downloads with when it needs a value on the host (a mixture of experts'
  // counts per expert); null where the family's layers need none.
  runtime::Backend* backend = nullptr;
  const Documents* documents = nullptr;
  // Where a training forward adds the tokens each expert of a mixture received (null:
  // nowhere, as in evaluation and in a checkpointed block's recompute).
  ExpertCounts* expert_counts = nullptr;
  // The expert group (null: every expert on this rank).
  ExpertParallelGroup<P>* ep = nullptr;
  // A load-balancing loss: where a training forward adds its routing (null: nowhere), and
  // the gradient of the loss by each router probability (N,E; null: none) that every
  // block's backward adds.
  RouterStats* router_stats = nullptr;
  Ptr<const typename P::Acc> router_dprobs = nullptr;
  // Float8 training: the blocks' linear layers cast to float8 (null: they do not).
  const Float8Linear* float8 = nullptr;
};

// Causal self-attention as the table's AttentionForward/AttentionBackward give it, or
// across k.cp where there is one, within k.documents where there are some: what the
// layers call.
template <class P>
void AttentionForward(const Context<P>& k, Ptr<typename P::Act> out, Ptr<typename P::Acc> state,
                      runtime::DeviceBytes scratch, Ptr<const typename P::Act> qkv, int B, int T, int NH, int KVH,
                      int HS);
template <class P>
void AttentionBackward(const Context<P>& k, Ptr<typename P::Act> dqkv, runtime::DeviceBytes scratch,
                       Ptr<const typename P::Act> dout, Ptr<const typename P::Act> qkv, Ptr<const typename P::Act> out,
                       Ptr<const typename P::Acc> state, int B, int T, int NH, int KVH, int HS);

// Causal self-attention within each document of whole sequences (documents.starts, rows
// of these T): AttentionForward's contract on qkv (B,T,(NH+2*KVH)*HS) and out
// (B,T,NH*HS), a row seeing the earlier rows of its own document only; the table's
// AttentionBlockForward, causal, once for each document. state (B,NH,T) of Acc: each
// row's log-sum-exp; scratch: DocumentAttentionScratchBytes. Context parallelism's
// all-to-all mode calls these on its slice of the heads.
template <class P>
void DocumentAttentionForward(kernels::Ops<P>& ops, Ptr<typename P::Act> out, Ptr<typename P::Acc> state,
                              runtime::DeviceBytes scratch, Ptr<const typename P::Act> qkv, int B, int T, int NH,
                              int KVH, int HS, const Documents& documents, runtime::Stream& stream);
// dqkv (B,T,(NH+2*KVH)*HS) = the gradient through DocumentAttentionForward of dout
// (B,T,NH*HS); out and state are the forward's. `backend` zeroes the scratch.
template <class P>
void DocumentAttentionBackward(kernels::Ops<P>& ops, runtime::Backend& backend, Ptr<typename P::Act> dqkv,
                               runtime::DeviceBytes scratch, Ptr<const typename P::Act> dout,
                               Ptr<const typename P::Act> qkv, Ptr<const typename P::Act> out,
                               Ptr<const typename P::Acc> state, int B, int T, int NH, int KVH, int HS,
                               const Documents& documents, runtime::Stream& stream);
// Bytes of scratch the two take: (B,T,(NH+2*KVH)*HS) and (B,NH,T) of Acc.
template <class P>
int64_t DocumentAttentionScratchBytes(int B, int T, int NH, int KVH, int HS);

// This rank's slice of the layers: its heads, MLP width and vocabulary rows (the real
// [vocab_begin, +vocab) and the padded count an embedding holds).
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
  int B = 0, T = 0;
  int C = 0;        // the residual stream's channels
  int NH = 0;       // query heads, whole
  int KVH = 0;      // key/value heads, whole
  int HS = 0;       // channels of a head
  int H = 0;        // the MLP's width, whole
  float eps = 1e-5f;  // the norms'
  int64_t V = 0;    // the vocabulary (the user's, unpadded)
  TpSlice tp{};
  // This rank's part of each sequence (api::ContextRows of T x cp_size tokens): its T rows
  // are the chunks rank and 2 x size - 1 - rank of the whole sequence.
  int cp_rank = 0, cp_size = 1;
  DropoutSpec dropout{};
  int64_t N() const { return int64_t(B) * T; }
  // This rank's query and key/value heads, their channels, and its MLP units.
  int heads() const { return NH / tp.size; }
  int kv_heads() const { return KVH / tp.size; }
  int query_width() const { return heads() * HS; }
  int kv_width() const { return kv_heads() * HS; }
  int hidden_units() const { return H / tp.size; }
  int layer = -1;  // the block these dims are for (ForLayer); -1 outside blocks
  // These dims for block l: its own dropout masks.
  Dims ForLayer(int l) const;
  // The dims of `shape` for micro-batches of B x T on `tp`.
  static Dims Of(const api::ModelShape& shape, int B, int T, TpSlice tp);
};

// What one block's forward keeps for its backward (api::BlockActivationBuffers); `output`
// is the block's output, which the caller may place elsewhere (the next block's input).
template <class P>
struct BlockActivations {
  Carving parts;
  Ptr<typename P::Act> output{};
  static BlockActivations At(runtime::DeviceBytes base, int batch, int seq, const api::ModelShape& shape, TpSlice tp,
                             const api::EngineTypes& types);
};

// The backward's working set, one for every block (api::BlockScratchBuffers): dresidual
// carries the residual stream's gradient.
template <class P>
struct BlockScratch {
  Carving parts;
  Ptr<typename P::Act> dresidual{};
  static BlockScratch At(runtime::DeviceBytes base, int batch, int seq, const api::ModelShape& shape, TpSlice tp,
                         const api::EngineTypes& types, bool dropout);
};

// The head (api::HeadBuffers): the final norm, the losses, and one chunk of `chunk_rows`
// rows of logits at a time.
template <class P>
struct HeadActivations {
  using A = typename P::Act;
  using G = typename P::Acc;
  Ptr<A> lnf, logits, dlnf;
  Ptr<G> lnf_mean, lnf_rstd, losses, stats, all_stats;  // lnf_mean: LayerNorm's only; stats: with TP only
  int64_t chunk_rows = 0;
  static HeadActivations At(runtime::DeviceBytes base, int batch, int seq, const api::ModelShape& shape, TpSlice tp,
                            const api::EngineTypes& types);
};

// The engine's element types and what its kernel table keeps for attention, or with a
// context group of `context` ranks (T: this rank's rows) what its ring attention keeps
// or, with `all_to_all`, its Ulysses attention (which runs the table's attention on the
// whole sequence and 1/context of the heads).
template <class P>
api::EngineTypes TypesOf(kernels::Ops<P>& ops, int B, int T, const api::ModelShape& shape, int tp_size,
                         int context = 1, bool all_to_all = false);

// cos, then sin, of angle position x frequency for each of `positions` and the HS/2
// frequencies of `shape`'s RoPE (its theta and rope_scaling, as transformers computes
// them), in fp64: the Llama class's "rope" buffer, (rows, HS/2) each.
std::vector<double> RopeTable(const api::ModelShape& shape, const std::vector<int64_t>& positions);

// One family's layers. `unit` pointers are a unit's gathered parameters (and `dunit` its
// gradients) in the layout's order (parameters.h): the embedding unit, a block, and the
// unit holding the LM head (the embedding unit when the head is tied).
template <class P>
class Model {
 public:
  using A = typename P::Act;
  using G = typename P::Acc;
  virtual ~Model() = default;

  // encoded (N,C) = the embedding of tokens (N), summed over the TP group's slices.
  virtual void EmbedForward(const Context<P>& k, Ptr<A> encoded, Ptr<const int32_t> tokens, Ptr<const A> unit,
                            const Dims& d) const = 0;
  // dunit += the gradient of EmbedForward for dencoded (N,C).
  virtual void EmbedBackward(const Context<P>& k, Ptr<G> dunit, Ptr<const A> dencoded, Ptr<const int32_t> tokens,
                             const Dims& d) const = 0;
  // a.output (N,C) = the block applied to residual (N,C).
  virtual void BlockForward(const Context<P>& k, const BlockActivations<P>& a, const BlockScratch<P>& scratch,
                            Ptr<const A> residual, Ptr<const A> block, const Dims& d) const = 0;
  // scratch.dresidual: the gradient of a.output in, of residual out; dblock += the
  // block's parameters'.
  virtual void BlockBackward(const Context<P>& k, Ptr<G> dblock, const BlockScratch<P>& scratch,
                             const BlockActivations<P>& a, Ptr<const A> residual, Ptr<const A> block,
                             const Dims& d) const = 0;
  // The final norm of x (N,C), the LM head and the cross-entropy against targets (N; -1:
  // masked, no loss), chunk by chunk: *loss_sum += loss_weight * (the sum of the losses).
  // In training (dunit non-null) the head's backward runs here too, as each chunk's
  // logits are made (llm.c's fused classifier): dx (N,C) += d(loss_weight * the sum)/dx
  // (the caller zeroes it), and dunit += the head's parameters'. Only one chunk of logits
  // ever exists.
  virtual void HeadForward(const Context<P>& k, const HeadActivations<P>& h, Ptr<const A> x, Ptr<const A> unit,
                           Ptr<const int32_t> targets, Ptr<double> loss_sum, double loss_weight, Ptr<G> dunit,
                           Ptr<A> dx, const Dims& d) const = 0;
  // h.logits (Vp) = the logits of row `row` of x (N,C): for sampling.
  virtual void HeadLogits(const Context<P>& k, const HeadActivations<P>& h, Ptr<const A> x, Ptr<const A> unit,
                          int64_t row, const Dims& d) const = 0;
  // The values of the family's buffer `name` (api::FamilyBuffers) for windows whose row t
  // holds the token at `positions[t]` of its sequence, in fp64. Throws std::logic_error
  // for a buffer the family has not.
  virtual std::vector<double> FamilyBufferValues(std::string_view name, const std::vector<int64_t>& positions) const;
};

// Carves the family's buffers for windows of positions.size() tokens at `positions`
// (api::FamilyBuffers) out of `base`, which holds api::CarvedBytes of them, uploads each
// one's values (Model::FamilyBufferValues) on `stream` and waits for them:
// Context::buffers.
template <class P>
Carving PrepareFamilyBuffers(const Model<P>& model, runtime::Backend& backend, runtime::DeviceBytes base,
                             const std::vector<int64_t>& positions, const api::ModelShape& shape,
                             const api::EngineTypes& types, runtime::Stream& stream);

// 0, 1, ..., seq - 1: the positions of whole windows.
std::vector<int64_t> WindowPositions(int seq);

// The layers of `layout`'s family (which must outlive them).
template <class P>
std::unique_ptr<Model<P>> MakeModel(const ParameterLayout& layout);

}  // namespace meshtrain::model
