// Document attention (model.h, Documents): the rows of each document as a causal block
// of the table's block attention, and the segments the layers cut this rank's rows into.

#include <algorithm>
#include <stdexcept>
#include <string>

#include "api/layout.h"
#include "worker/model/model.h"

namespace meshtrain::model {

std::vector<Segment> SegmentsOf(const Documents& documents, int B, int T, int cp_rank, int cp_size) {
  const int64_t whole = int64_t(T) * cp_size;
  if (int64_t(documents.starts.size()) != B) {
    throw std::invalid_argument("Documents: " + std::to_string(documents.starts.size()) + " sequences for " +
                                std::to_string(B));
  }
  for (const std::vector<int64_t>& starts : documents.starts) {
    if (starts.empty() || starts[0] != 0) throw std::invalid_argument("Documents: a sequence's first start is not 0");
    for (size_t i = 1; i < starts.size(); ++i) {
      if (starts[i] <= starts[i - 1] || starts[i] >= whole) {
        throw std::invalid_argument("Documents: starts must ascend within the " + std::to_string(whole) +
                                    " rows of a sequence, got " + std::to_string(starts[i]) + " after " +
                                    std::to_string(starts[i - 1]));
      }
    }
  }
  // This rank's rows as runs of the whole sequence: [first, first + rows) at local row `row`.
  struct Run {
    int64_t row, first, rows;
  };
  std::vector<Run> runs;
  if (cp_size == 1) {
    runs.push_back({0, 0, T});
  } else {
    const api::ContextRows rows(whole, cp_rank, cp_size);
    runs.push_back({0, rows.first[0], rows.chunk});
    runs.push_back({rows.chunk, rows.first[1], rows.chunk});
  }
  std::vector<Segment> segments;
  for (int b = 0; b < B; ++b) {
    const std::vector<int64_t>& starts = documents.starts[size_t(b)];
    for (const Run& run : runs) {
      // The document holding the run's first row, then each that starts inside the run.
      auto next = std::upper_bound(starts.begin(), starts.end(), run.first);
      int64_t start = *(next - 1), at = run.first;
      const int64_t end = run.first + run.rows;
      while (at < end) {
        const int64_t stop = next == starts.end() ? end : std::min(end, *next);
        segments.push_back({b, run.row + (at - run.first), stop - at, at, start});
        at = stop;
        if (next != starts.end() && *next == stop) start = *next++;
      }
    }
  }
  return segments;
}

namespace {

// Rows of a qkv (B,T,W) slice of one sequence, the queries' and keys' the segment's own.
kernels::AttentionBlock SegmentBlock(int T, int NH, int KVH, int HS, int64_t rows) {
  const int64_t W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS;
  const kernels::AttentionRows packed{W, T * W}, outputs{Q, T * Q};
  return {.B = 1, .Tq = int(rows), .Tk = int(rows), .NH = NH, .KVH = KVH, .HS = HS,
          .mask = kernels::AttentionMask::kCausal, .q = packed, .k = packed, .v = packed, .out = outputs,
          .stats = {T, int64_t(NH) * T}, .dout = outputs, .dq = packed, .dk = packed, .dv = packed};
}

}  // namespace

template <class P>
int64_t DocumentAttentionScratchBytes(int B, int T, int NH, int KVH, int HS) {
  const int64_t N = int64_t(B) * T;
  return (N * (NH + 2 * KVH) * HS + N * NH) * int64_t(sizeof(typename P::Acc));
}

template <class P>
void DocumentAttentionForward(kernels::Ops<P>& ops, Ptr<typename P::Act> out, Ptr<typename P::Acc> state,
                              runtime::DeviceBytes scratch, Ptr<const typename P::Act> qkv, int B, int T, int NH,
                              int KVH, int HS, const Documents& documents, runtime::Stream& stream) {
  using G = typename P::Acc;
  const int64_t W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, KV = int64_t(KVH) * HS;
  const Ptr<G> merged = scratch.As<G>();  // (B,T,Q)
  for (const Segment& s : SegmentsOf(documents, B, T, 0, 1)) {
    const int64_t r = int64_t(s.b) * T + s.row;
    const Ptr<const typename P::Act> q = qkv + r * W;
    ops.AttentionBlockForward(merged + r * Q, state + int64_t(s.b) * NH * T + s.row, q, q + Q, q + Q + KV,
                              SegmentBlock(T, NH, KVH, HS, s.rows), stream);
  }
  ops.Cast(out, merged, int64_t(B) * T * Q, stream);
}

template <class P>
void DocumentAttentionBackward(kernels::Ops<P>& ops, runtime::Backend& backend, Ptr<typename P::Act> dqkv,
                               runtime::DeviceBytes scratch, Ptr<const typename P::Act> dout,
                               Ptr<const typename P::Act> qkv, Ptr<const typename P::Act> out,
                               Ptr<const typename P::Acc> state, int B, int T, int NH, int KVH, int HS,
                               const Documents& documents, runtime::Stream& stream) {
  using G = typename P::Acc;
  const int64_t W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, KV = int64_t(KVH) * HS;
  const int64_t N = int64_t(B) * T;
  const Ptr<G> grad = scratch.As<G>();  // (B,T,W): dq, dk and dv where qkv holds q, k and v
  const Ptr<G> D = grad + N * W;         // (B,NH,T)
  kernels::AttentionBlock whole = SegmentBlock(T, NH, KVH, HS, T);  // its outputs and statistics
  whole.B = B;
  ops.AttentionRowDot(D, dout, out, whole, stream);
  backend.Zero(grad, N * W, stream);
  for (const Segment& s : SegmentsOf(documents, B, T, 0, 1)) {
    const int64_t r = int64_t(s.b) * T + s.row, stat = int64_t(s.b) * NH * T + s.row;
    const Ptr<const typename P::Act> q = qkv + r * W;
    ops.AttentionBlockBackward(grad + r * W, grad + r * W + Q, grad + r * W + Q + KV, dout + r * Q, q, q + Q,
                               q + Q + KV, state + stat, D + stat, SegmentBlock(T, NH, KVH, HS, s.rows), stream);
  }
  ops.Cast(dqkv, grad, N * W, stream);
}

template <class P>
void ContextParallelGroup<P>::DocumentAttentionForward(kernels::Ops<P>&, Ptr<A>, Ptr<G>, runtime::DeviceBytes,
                                                       Ptr<const A>, int, int, int, int, int, const Documents&,
                                                       runtime::Stream&) {
  throw std::logic_error("this context-parallel mode has no document attention");
}

template <class P>
void ContextParallelGroup<P>::DocumentAttentionBackward(kernels::Ops<P>&, Ptr<A>, runtime::DeviceBytes, Ptr<const A>,
                                                        Ptr<const A>, Ptr<const A>, Ptr<const G>, int, int, int, int,
                                                        int, const Documents&, runtime::Stream&) {
  throw std::logic_error("this context-parallel mode has no document attention");
}

#define MESHTRAIN_DOCUMENTS(P)                                                                                       \
  template class ContextParallelGroup<P>;                                                                            \
  template int64_t DocumentAttentionScratchBytes<P>(int, int, int, int, int);                                       \
  template void DocumentAttentionForward<P>(kernels::Ops<P>&, Ptr<P::Act>, Ptr<P::Acc>, runtime::DeviceBytes,      \
                                            Ptr<const P::Act>, int, int, int, int, int, const Documents&,           \
                                            runtime::Stream&);                                                      \
  template void DocumentAttentionBackward<P>(kernels::Ops<P>&, runtime::Backend&, Ptr<P::Act>, runtime::DeviceBytes, \
                                             Ptr<const P::Act>, Ptr<const P::Act>, Ptr<const P::Act>,               \
                                             Ptr<const P::Acc>, int, int, int, int, int, const Documents&,          \
                                             runtime::Stream&);

MESHTRAIN_DOCUMENTS(kernels::Fp32)
MESHTRAIN_DOCUMENTS(kernels::Bf16)
MESHTRAIN_DOCUMENTS(kernels::Fp64)
#undef MESHTRAIN_DOCUMENTS

}  // namespace meshtrain::model
