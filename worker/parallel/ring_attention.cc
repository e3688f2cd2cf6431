#include "worker/parallel/ring_attention.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "api/engine_memory.h"
#include "api/layout.h"

namespace meshtrain::parallel {

using kernels::AttentionBlock;
using kernels::AttentionMask;

template <class P>
RingAttention<P>::RingAttention(comm::StreamCollectives* group, runtime::Backend* backend,
                                const api::ModelShape& shape, int tp_size, const api::EngineTypes& types)
    : group_(group),
      backend_(backend),
      shape_(shape.Resolved()),
      tp_size_(tp_size),
      types_(types),
      ring_(backend->NewStream("ring")),
      ready_(backend->NewEvent()),
      passed_(backend->NewEvent()) {
  if (group_ == nullptr || group_->size() < 2) throw std::logic_error("RingAttention needs a group of two or more");
}

// Rank c's chunks are c and 2C-1-c; at step s it holds rank j = c - s's (mod C), chunks j
// and 2C-1-j. Its first chunk meets key chunk j where j < c (no wrap: s <= c); its
// second meets chunk j always (j < C <= 2C-1-c) and chunk 2C-1-j where j > c (a wrap).
// At step 0 each meets its own causally, and the second the first.
template <class P>
std::vector<typename RingAttention<P>::Pair> RingAttention<P>::PairsAt(int step) const {
  if (step == 0) return {{0, 0, AttentionMask::kCausal}, {1, 1, AttentionMask::kCausal}, {1, 0, AttentionMask::kNone}};
  std::vector<Pair> pairs;
  const bool wrapped = step > rank();
  if (!wrapped) pairs.push_back({0, 0, AttentionMask::kNone});
  pairs.push_back({1, 0, AttentionMask::kNone});
  if (wrapped) pairs.push_back({1, 1, AttentionMask::kNone});
  return pairs;
}

template <class P>
std::vector<typename RingAttention<P>::DocumentPair> RingAttention<P>::DocumentPairsAt(
    int step, const std::vector<model::Segment>& segments, int T) const {
  const int C = size(), holder = (rank() - step + C) % C;
  const int64_t L = T / 2;
  const api::ContextRows keys(int64_t(T) * C, holder, C);
  std::vector<DocumentPair> pairs;
  for (const Pair& p : PairsAt(step)) {
    for (const model::Segment& s : segments) {
      if (s.row / L != p.q) continue;
      if (p.mask == AttentionMask::kCausal) {
        pairs.push_back({s.b, s.row, s.rows, s.row, s.rows, AttentionMask::kCausal, true});
        continue;
      }
      const int64_t first = keys.first[p.k], from = std::max(s.start, first), end = first + L;
      if (from < end) {
        pairs.push_back({s.b, s.row, s.rows, p.k * L + from - first, end - from, AttentionMask::kNone, false});
      }
    }
  }
  return pairs;
}

template <class P>
template <class T>
void RingAttention<P>::StartPass(model::Ptr<const T> send, model::Ptr<T> recv, int64_t n, runtime::Stream& stream) {
  const int C = size(), next = (rank() + 1) % C, previous = (rank() + C - 1) % C;
  ready_->Record(stream);
  ring_->Wait(*ready_);
  comm::Batched(group_, [&] {
    if (rank() % 2 == 0) {
      comm::Send<T>(*group_, send, size_t(n), next, *ring_);
      comm::Recv<T>(*group_, recv, size_t(n), previous, *ring_);
    } else {
      comm::Recv<T>(*group_, recv, size_t(n), previous, *ring_);
      comm::Send<T>(*group_, send, size_t(n), next, *ring_);
    }
  });
  passed_->Record(*ring_);
}

template <class P>
void RingAttention<P>::CopyRows(model::Ptr<A> to, int64_t to_row, model::Ptr<const A> from, int64_t from_row,
                                int64_t width, int64_t rows, runtime::Stream& stream) {
  backend_->Copy2D(to, size_t(to_row) * sizeof(A), from, size_t(from_row) * sizeof(A), size_t(width) * sizeof(A),
                   size_t(rows), stream);
}

namespace {

// One pair's block: queries of local chunk q of qkv (B,T,W), keys and values of chunk k
// of a circulating (B,T,2 KV) block; outputs, statistics and gradients laid out as
// (B,T,Q), (B,NH,T) and (B,T,2 KV) arrays whose chunk the caller points at.
AttentionBlock BlockOf(int B, int T, int NH, int KVH, int HS, AttentionMask mask) {
  const int64_t L = T / 2, W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, KV2 = 2 * int64_t(KVH) * HS;
  const kernels::AttentionRows queries{W, T * W}, keys{KV2, T * KV2}, outputs{Q, T * Q};
  return {.B = B, .Tq = int(L), .Tk = int(L), .NH = NH, .KVH = KVH, .HS = HS, .mask = mask, .q = queries, .k = keys,
          .v = keys, .out = outputs, .stats = {T, int64_t(NH) * T}, .dout = outputs, .dq = outputs, .dk = keys,
          .dv = keys};
}

}  // namespace

// The forward's ring: the block of this rank's keys and values first; at each step
// blocks(step, kv) enqueues the step's attention against the block kv on `stream` while,
// on the ring stream, the block goes on to the next rank and the next one comes in.
template <class P>
template <class Blocks>
void RingAttention<P>::Forward(kernels::Ops<P>& ops, model::Ptr<A> out, runtime::DeviceBytes scratch,
                               model::Ptr<const A> qkv, int B, int T, int NH, int KVH, int HS,
                               runtime::Stream& stream, Blocks&& blocks) {
  const int64_t W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, KV = int64_t(KVH) * HS, N = int64_t(B) * T;
  const model::Carving c(scratch, api::RingAttentionBuffers(B, T, shape_, tp_size_, types_, /*backward=*/false));
  model::Ptr<A> kv = c.Get<A>("kv"), kv_next = c.Get<A>("kv_next");
  CopyRows(kv, 2 * KV, qkv + Q, W, 2 * KV, N, stream);  // this rank's keys and values
  for (int step = 0; step < size(); ++step) {
    const bool more = step + 1 < size();
    // kv is written and kv_next no longer read (the last step's blocks) once `stream` is here.
    if (more) StartPass<A>(kv, kv_next, N * 2 * KV, stream);
    blocks(step, kv, c);
    if (more) {
      stream.Wait(*passed_);
      std::swap(kv, kv_next);
    }
  }
  ops.Cast(out, c.Get<G>("out"), N * Q, stream);
}

// The backward's ring: the keys and values go round again, the next block coming in
// while blocks(step, kv, dkv) runs; their gradients dkv follow each step once its blocks
// have added to them, and after the last step go on to the block's owner, the next rank.
template <class P>
template <class Blocks>
void RingAttention<P>::Backward(kernels::Ops<P>& ops, model::Ptr<A> dqkv, runtime::DeviceBytes scratch,
                                model::Ptr<const A> dout, model::Ptr<const A> qkv, model::Ptr<const A> out, int B,
                                int T, int NH, int KVH, int HS, runtime::Stream& stream, Blocks&& blocks) {
  const int64_t W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, KV = int64_t(KVH) * HS, N = int64_t(B) * T;
  const model::Carving c(scratch, api::RingAttentionBuffers(B, T, shape_, tp_size_, types_, /*backward=*/true));
  model::Ptr<A> kv = c.Get<A>("kv"), kv_next = c.Get<A>("kv_next");
  model::Ptr<G> dkv = c.Get<G>("dkv"), dkv_next = c.Get<G>("dkv_next");
  const model::Ptr<G> dq = c.Get<G>("dq");
  const model::Ptr<A> cast = c.Get<A>("cast");
  // D over all T rows at once: the two chunks' rows lie as one block's would.
  AttentionBlock whole = BlockOf(B, T, NH, KVH, HS, AttentionMask::kNone);
  whole.Tq = whole.Tk = T;
  ops.AttentionRowDot(c.Get<G>("D"), dout, out, whole, stream);
  CopyRows(kv, 2 * KV, qkv + Q, W, 2 * KV, N, stream);
  backend_->Zero(dkv, N * 2 * KV, stream);
  backend_->Zero(dq, N * Q, stream);
  for (int step = 0; step < size(); ++step) {
    const bool more = step + 1 < size();
    if (more) StartPass<A>(kv, kv_next, N * 2 * KV, stream);
    blocks(step, kv, dkv, c);
    StartPass<G>(dkv, dkv_next, N * 2 * KV, stream);
    stream.Wait(*passed_);  // both blocks have come in
    if (more) std::swap(kv, kv_next);
    std::swap(dkv, dkv_next);
  }
  ops.Cast(cast, dq, N * Q, stream);
  CopyRows(dqkv, W, cast, Q, Q, N, stream);
  ops.Cast(cast, dkv, N * 2 * KV, stream);
  CopyRows(dqkv + Q, W, cast, 2 * KV, 2 * KV, N, stream);
}

template <class P>
void RingAttention<P>::AttentionForward(kernels::Ops<P>& ops, model::Ptr<A> out, model::Ptr<G> state,
                                        runtime::DeviceBytes scratch, model::Ptr<const A> qkv, int B, int T, int NH,
                                        int KVH, int HS, runtime::Stream& stream) {
  const int64_t L = T / 2, W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, KV = int64_t(KVH) * HS;
  Forward(ops, out, scratch, qkv, B, T, NH, KVH, HS, stream,
          [&](int step, model::Ptr<const A> kv, const model::Carving& c) {
            const model::Ptr<G> merged = c.Get<G>("out"), block_out = c.Get<G>("block_out");
            const model::Ptr<G> block_lse = c.Get<G>("block_lse");
            for (const Pair& p : PairsAt(step)) {
              const AttentionBlock b = BlockOf(B, T, NH, KVH, HS, p.mask);
              const model::Ptr<const A> q = qkv + p.q * L * W, k = kv + p.k * L * 2 * KV, v = k + KV;
              const model::Ptr<G> into = merged + p.q * L * Q, lse = state + p.q * L;
              if (step == 0 && p.mask == AttentionMask::kCausal) {  // a chunk's first block: straight into the result
                ops.AttentionBlockForward(into, lse, q, k, v, b, stream);
              } else {
                ops.AttentionBlockForward(block_out + p.q * L * Q, block_lse + p.q * L, q, k, v, b, stream);
                ops.AttentionMerge(into, lse, block_out + p.q * L * Q, block_lse + p.q * L, b, stream);
              }
            }
          });
}

template <class P>
void RingAttention<P>::AttentionBackward(kernels::Ops<P>& ops, model::Ptr<A> dqkv, runtime::DeviceBytes scratch,
                                         model::Ptr<const A> dout, model::Ptr<const A> qkv, model::Ptr<const A> out,
                                         model::Ptr<const G> state, int B, int T, int NH, int KVH, int HS,
                                         runtime::Stream& stream) {
  const int64_t L = T / 2, W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, KV = int64_t(KVH) * HS;
  Backward(ops, dqkv, scratch, dout, qkv, out, B, T, NH, KVH, HS, stream,
           [&](int step, model::Ptr<const A> kv, model::Ptr<G> dkv, const model::Carving& c) {
             const model::Ptr<G> dq = c.Get<G>("dq"), D = c.Get<G>("D");
             for (const Pair& p : PairsAt(step)) {
               const AttentionBlock b = BlockOf(B, T, NH, KVH, HS, p.mask);
               const model::Ptr<const A> q = qkv + p.q * L * W, k = kv + p.k * L * 2 * KV, v = k + KV;
               const model::Ptr<G> dk = dkv + p.k * L * 2 * KV;
               ops.AttentionBlockBackward(dq + p.q * L * Q, dk, dk + KV, dout + p.q * L * Q, q, k, v, state + p.q * L,
                                          D + p.q * L, b, stream);
             }
           });
}

template <class P>
void RingAttention<P>::DocumentAttentionForward(kernels::Ops<P>& ops, model::Ptr<A> out, model::Ptr<G> state,
                                                runtime::DeviceBytes scratch, model::Ptr<const A> qkv, int B, int T,
                                                int NH, int KVH, int HS, const model::Documents& documents,
                                                runtime::Stream& stream) {
  const int64_t W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, KV = int64_t(KVH) * HS;
  const std::vector<model::Segment> segments = model::SegmentsOf(documents, B, T, rank(), size());
  Forward(ops, out, scratch, qkv, B, T, NH, KVH, HS, stream,
          [&](int step, model::Ptr<const A> kv, const model::Carving& c) {
            const model::Ptr<G> merged = c.Get<G>("out"), block_out = c.Get<G>("block_out");
            const model::Ptr<G> block_lse = c.Get<G>("block_lse");
            for (const DocumentPair& p : DocumentPairsAt(step, segments, T)) {
              AttentionBlock b = BlockOf(B, T, NH, KVH, HS, p.mask);
              b.B = 1, b.Tq = int(p.rows), b.Tk = int(p.keys);
              const int64_t row = int64_t(p.b) * T + p.row, stat = int64_t(p.b) * NH * T + p.row;
              const model::Ptr<const A> q = qkv + row * W, k = kv + (int64_t(p.b) * T + p.key) * 2 * KV, v = k + KV;
              if (p.first) {
                ops.AttentionBlockForward(merged + row * Q, state + stat, q, k, v, b, stream);
              } else {
                ops.AttentionBlockForward(block_out + row * Q, block_lse + stat, q, k, v, b, stream);
                ops.AttentionMerge(merged + row * Q, state + stat, block_out + row * Q, block_lse + stat, b, stream);
              }
            }
          });
}

template <class P>
void RingAttention<P>::DocumentAttentionBackward(kernels::Ops<P>& ops, model::Ptr<A> dqkv, runtime::DeviceBytes scratch,
                                                 model::Ptr<const A> dout, model::Ptr<const A> qkv,
                                                 model::Ptr<const A> out, model::Ptr<const G> state, int B, int T,
                                                 int NH, int KVH, int HS, const model::Documents& documents,
                                                 runtime::Stream& stream) {
  const int64_t W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, KV = int64_t(KVH) * HS;
  const std::vector<model::Segment> segments = model::SegmentsOf(documents, B, T, rank(), size());
  Backward(ops, dqkv, scratch, dout, qkv, out, B, T, NH, KVH, HS, stream,
           [&](int step, model::Ptr<const A> kv, model::Ptr<G> dkv, const model::Carving& c) {
             const model::Ptr<G> dq = c.Get<G>("dq"), D = c.Get<G>("D");
             for (const DocumentPair& p : DocumentPairsAt(step, segments, T)) {
               AttentionBlock b = BlockOf(B, T, NH, KVH, HS, p.mask);
               b.B = 1, b.Tq = int(p.rows), b.Tk = int(p.keys);
               const int64_t row = int64_t(p.b) * T + p.row, stat = int64_t(p.b) * NH * T + p.row;
               const int64_t key = (int64_t(p.b) * T + p.key) * 2 * KV;
               const model::Ptr<const A> q = qkv + row * W, k = kv + key, v = k + KV;
               ops.AttentionBlockBackward(dq + row * Q, dkv + key, dkv + key + KV, dout + row * Q, q, k, v,
                                          state + stat, D + stat, b, stream);
             }
           });
}

template class RingAttention<kernels::Fp32>;
template class RingAttention<kernels::Bf16>;
template class RingAttention<kernels::Fp64>;

}  // namespace meshtrain::parallel
