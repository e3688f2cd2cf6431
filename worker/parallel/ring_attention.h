// Ring attention across a context group (docs/design.md, "Context parallelism"): each of
// the group's C ranks holds two chunks of every sequence (api::ContextRows: chunks c and
// 2C-1-c of 2C, so that causal attention's work is even), and the key/value heads of
// each rank's chunks pass round the ring, from rank c to rank c+1, one step at a time.
// At each step a rank attends its queries to the block it holds, where the block's
// positions come before theirs (its own chunks causally), with the table's
// AttentionBlockForward, and merges the block's result into its running one by
// log-sum-exp (AttentionMerge): the same attention as on one rank, up to the order of
// fp32 sums. The backward passes the blocks round again, each with its key/value
// gradients (AttentionBlockBackward), which travel on to their owner after the last
// step. The forward keeps one log-sum-exp per query row and head (the state); its
// working buffers are api::RingAttentionBuffers, in the block's attention scratch.
//
// Each pass is a Send to the next rank and a Recv from the previous one over the
// group's stream collectives, as one batch: on NCCL a grouped call; on the host
// implementation, which runs a group's operations one at a time, even ranks send first
// and odd ranks receive first, so that no cycle of waiting sends forms. The passes run
// on a stream of their own (ring_), ordered against the compute stream by events: the
// next block comes in while the current one's attention runs (forward and backward); the
// key/value gradients, which each step's blocks add to, go on after them.
// Thread-safety: as model::ContextParallelGroup (one thread issues its calls).

#pragma once

#include <memory>
#include <vector>

#include "api/model_family.h"
#include "worker/comm/stream_collectives.h"
#include "worker/model/model.h"

namespace meshtrain::parallel {

template <class P>
class RingAttention final : public model::ContextParallelGroup<P> {
 public:
  using A = typename P::Act;
  using G = typename P::Acc;

  // Over `group` (the mesh's device context group; this rank is its member rank()), for
  // the layers of `shape` on a TP group of `tp_size`, whose engine has `types`.
  // REQUIRES: group and backend outlive this.
  RingAttention(comm::StreamCollectives* group, runtime::Backend* backend, const api::ModelShape& shape, int tp_size,
                const api::EngineTypes& types);

  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  void AttentionForward(kernels::Ops<P>& ops, model::Ptr<A> out, model::Ptr<G> state, runtime::DeviceBytes scratch,
                        model::Ptr<const A> qkv, int B, int T, int NH, int KVH, int HS,
                        runtime::Stream& stream) override;
  void AttentionBackward(kernels::Ops<P>& ops, model::Ptr<A> dqkv, runtime::DeviceBytes scratch,
                         model::Ptr<const A> dout, model::Ptr<const A> qkv, model::Ptr<const A> out,
                         model::Ptr<const G> state, int B, int T, int NH, int KVH, int HS,
                         runtime::Stream& stream) override;
  // Within documents (model::Documents): at each step each query segment of a local
  // chunk (model::SegmentsOf) meets the keys of the block it may see, rows
  // [max(its document's start, the key chunk's first), the key chunk's end) of an earlier
  // chunk, unmasked, or its own rows causally; rows that see none of a block skip it.
  void DocumentAttentionForward(kernels::Ops<P>& ops, model::Ptr<A> out, model::Ptr<G> state,
                                runtime::DeviceBytes scratch, model::Ptr<const A> qkv, int B, int T, int NH, int KVH,
                                int HS, const model::Documents& documents, runtime::Stream& stream) override;
  void DocumentAttentionBackward(kernels::Ops<P>& ops, model::Ptr<A> dqkv, runtime::DeviceBytes scratch,
                                 model::Ptr<const A> dout, model::Ptr<const A> qkv, model::Ptr<const A> out,
                                 model::Ptr<const G> state, int B, int T, int NH, int KVH, int HS,
                                 const model::Documents& documents, runtime::Stream& stream) override;

 private:
  // Which local chunk of queries (0, 1) meets which chunk of the block held at step s
  // (the block of rank c - s), and how.
  struct Pair {
    int q, k;
    kernels::AttentionMask mask;
  };
  std::vector<Pair> PairsAt(int step) const;
  // One query segment against the keys it sees of the block held at a step: local query
  // rows [row, row + rows) of sequence b, key rows [key, key + keys) of the block's
  // (B,T) rows; `first`: the segment's own rows, causally, at step 0 (straight into the
  // result).
  struct DocumentPair {
    int b;
    int64_t row, rows, key, keys;
    kernels::AttentionMask mask;
    bool first;
  };
  std::vector<DocumentPair> DocumentPairsAt(int step, const std::vector<model::Segment>& segments, int T) const;
  // n elements of `send` to the next rank, as many from the previous one into `recv`, on
  // the ring stream once `stream` has reached this point; passed_ marks the end. The
  // caller makes `stream` wait for passed_ before it reads `recv` or writes `send`.
  template <class T>
  void StartPass(model::Ptr<const T> send, model::Ptr<T> recv, int64_t n, runtime::Stream& stream);
  // The two rings, their setup and their passes, around the blocks of a step (the
  // causal pairs or the documents'); see the .cc.
  template <class Blocks>
  void Forward(kernels::Ops<P>& ops, model::Ptr<A> out, runtime::DeviceBytes scratch, model::Ptr<const A> qkv, int B,
               int T, int NH, int KVH, int HS, runtime::Stream& stream, Blocks&& blocks);
  template <class Blocks>
  void Backward(kernels::Ops<P>& ops, model::Ptr<A> dqkv, runtime::DeviceBytes scratch, model::Ptr<const A> dout,
                model::Ptr<const A> qkv, model::Ptr<const A> out, int B, int T, int NH, int KVH, int HS,
                runtime::Stream& stream, Blocks&& blocks);
  // rows (B*T) of `width` elements from `from` (a row every from_row) to `to` (a row
  // every to_row).
  void CopyRows(model::Ptr<A> to, int64_t to_row, model::Ptr<const A> from, int64_t from_row, int64_t width,
                int64_t rows, runtime::Stream& stream);

  comm::StreamCollectives* group_;
  runtime::Backend* backend_;
  api::ModelShape shape_;
  int tp_size_;
  api::EngineTypes types_;
  std::unique_ptr<runtime::Stream> ring_;  // the passes, beside the blocks' kernels
  std::unique_ptr<runtime::Event> ready_, passed_;
};

}  // namespace meshtrain::parallel
