// All-to-all (Ulysses) attention across a context group (docs/design.md, "Context
// parallelism"): each of the group's C ranks holds two chunks of every sequence
// (api::ContextRows: chunks c and 2C-1-c of 2C), with all of its TP rank's heads. One
// all-to-all turns that into every row of the sequence for 1/C of the heads (rank c takes
// query heads [c NH/C, (c+1) NH/C) and key/value heads [c KVH/C, (c+1) KVH/C), so that GQA's
// query heads keep their key/value head), the table's ordinary causal AttentionForward
// runs on the whole sequence, and a second all-to-all brings the output back to this
// rank's rows: the same attention as on one rank, to the bit on the same kernels where
// the kernel's sums do not depend on the head count. The backward sends the output's
// gradient the same way, runs the table's AttentionBackward, and returns dq, dk and dv.
//
// The forward keeps the head-split q, k, v, the head-split output and the kernel's state
// in the attention state (api::UlyssesAttentionBuffers, UlyssesPart::kKept), so the
// backward makes two all-to-alls, not four. Its working buffers are the rest of
// api::UlyssesAttentionBuffers, in the block's attention scratch. The exchanges run on
// the group's stream collectives, on the compute stream between the kernels.
// REQUIRES: C divides this TP rank's heads and key/value heads (the constructor throws
// std::invalid_argument naming spec.parallelism.contextParallelDegree otherwise).
// Thread-safety: as model::ContextParallelGroup (one thread issues its calls).

#pragma once

#include <vector>

#include "api/model_family.h"
#include "worker/comm/stream_collectives.h"
#include "worker/model/model.h"

namespace meshtrain::parallel {

template <class P>
class UlyssesAttention final : public model::ContextParallelGroup<P> {
 public:
  using A = typename P::Act;
  using G = typename P::Acc;

  // Over `group` (the mesh's device context group), for the layers of `shape` on a TP
  // group of `tp_size`, whose engine has `types` (types.context_all_to_all).
  // REQUIRES: group and backend outlive this.
  UlyssesAttention(comm::StreamCollectives* group, runtime::Backend* backend, const api::ModelShape& shape,
                   int tp_size, const api::EngineTypes& types);
  // Throws std::invalid_argument naming spec.parallelism.contextParallelDegree unless C
  // divides `shape`'s heads and key/value heads on each of `tp_size` TP ranks.
  static void CheckHeads(const api::ModelShape& shape, int tp_size, int C);

  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  void AttentionForward(kernels::Ops<P>& ops, model::Ptr<A> out, model::Ptr<G> state, runtime::DeviceBytes scratch,
                        model::Ptr<const A> qkv, int B, int T, int NH, int KVH, int HS,
                        runtime::Stream& stream) override;
  void AttentionBackward(kernels::Ops<P>& ops, model::Ptr<A> dqkv, runtime::DeviceBytes scratch,
                         model::Ptr<const A> dout, model::Ptr<const A> qkv, model::Ptr<const A> out,
                         model::Ptr<const G> state, int B, int T, int NH, int KVH, int HS,
                         runtime::Stream& stream) override;
  // Within documents: the same exchanges around model::DocumentAttentionForward and
  // DocumentAttentionBackward, which see the whole sequences in position order.
  void DocumentAttentionForward(kernels::Ops<P>& ops, model::Ptr<A> out, model::Ptr<G> state,
                                runtime::DeviceBytes scratch, model::Ptr<const A> qkv, int B, int T, int NH, int KVH,
                                int HS, const model::Documents& documents, runtime::Stream& stream) override;
  void DocumentAttentionBackward(kernels::Ops<P>& ops, model::Ptr<A> dqkv, runtime::DeviceBytes scratch,
                                 model::Ptr<const A> dout, model::Ptr<const A> qkv, model::Ptr<const A> out,
                                 model::Ptr<const G> state, int B, int T, int NH, int KVH, int HS,
                                 const model::Documents& documents, runtime::Stream& stream) override;

 private:
  // The forward and the backward, causal (documents null) or within documents.
  void Forward(kernels::Ops<P>& ops, model::Ptr<A> out, model::Ptr<G> state, runtime::DeviceBytes scratch,
               model::Ptr<const A> qkv, int B, int T, int NH, int KVH, int HS, const model::Documents* documents,
               runtime::Stream& stream);
  void Backward(kernels::Ops<P>& ops, model::Ptr<A> dqkv, runtime::DeviceBytes scratch, model::Ptr<const A> dout,
                model::Ptr<const G> state, int B, int T, int NH, int KVH, int HS, const model::Documents* documents,
                runtime::Stream& stream);
  // Where the head-split operands of one call lie, for B sequences of T rows a rank.
  struct Split {
    int64_t B, T, L, S;  // sequences, this rank's rows, a chunk's rows, a sequence's rows
    int64_t HS, h, kh;   // channels a head; query and key/value heads a rank after the split
    int64_t Q, KV, W;    // this rank's widths before the split: q, k (or v), q + k + v
    int64_t q, w;        // after it: q, q + k + v
  };
  Split SplitOf(int B, int T, int NH, int KVH, int HS) const;
  // The whole-sequence chunk (0 .. 2C-1) that local chunk j (0, 1) of member p holds.
  int ChunkOf(int p, int j) const { return j == 0 ? p : 2 * size() - 1 - p; }
  // Every member's block of `each` elements, at member order: the lists of an AllToAll.
  void Exchange(model::Ptr<const A> send, model::Ptr<A> recv, int64_t each, runtime::Stream& stream);
  // rows of `width` elements from `from` (a row every from_row) to `to` (a row every to_row).
  void CopyRows(model::Ptr<A> to, int64_t to_row, model::Ptr<const A> from, int64_t from_row, int64_t width,
                int64_t rows, runtime::Stream& stream);
  // Rows: (B, T, width) blocks of every member, in `blocks`, to the whole sequences (B, S,
  // width) in position order, and back.
  void BlocksToSequence(model::Ptr<A> sequence, model::Ptr<const A> blocks, const Split& s, int64_t width,
                        runtime::Stream& stream);
  void SequenceToBlocks(model::Ptr<A> blocks, model::Ptr<const A> sequence, const Split& s, int64_t width,
                        runtime::Stream& stream);

  comm::StreamCollectives* group_;
  runtime::Backend* backend_;
  api::ModelShape shape_;
  int tp_size_;
  api::EngineTypes types_;
};

}  // namespace meshtrain::parallel
