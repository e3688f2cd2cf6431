#include "worker/parallel/ulysses_attention.h"

#include <stdexcept>
#include <string>

#include "api/engine_memory.h"

namespace meshtrain::parallel {

namespace {

// The kept buffers' places in the attention state, as api::UlyssesAttentionBuffers carves
// them (each start aligned).
struct Kept {
  int64_t qkv = 0, out = 0, state = 0;  // byte offsets
};
Kept KeptOffsets(const std::vector<api::Buffer>& kept) {
  return {0, api::CarvedBytes({kept[0]}), api::CarvedBytes({kept[0], kept[1]})};
}

}  // namespace

template <class P>
UlyssesAttention<P>::UlyssesAttention(comm::StreamCollectives* group, runtime::Backend* backend,
                                      const api::ModelShape& shape, int tp_size, const api::EngineTypes& types)
    : group_(group), backend_(backend), shape_(shape.Resolved()), tp_size_(tp_size), types_(types) {
  if (group_ == nullptr || group_->size() < 2) throw std::logic_error("UlyssesAttention needs a group of two or more");
  CheckHeads(shape_, tp_size, group_->size());
}

template <class P>
void UlyssesAttention<P>::CheckHeads(const api::ModelShape& shape, int tp_size, int C) {
  const api::ModelShape s = shape.Resolved();
  for (const auto& [field, heads] : {std::pair{"heads", s.heads}, std::pair{"kvHeads", s.KvHeads()}}) {
    if (heads % tp_size == 0 && (heads / tp_size) % C == 0) continue;
    throw std::invalid_argument("spec.parallelism.contextParallelDegree: must divide the model's " +
                                std::string(field) + " per TP rank (" + std::to_string(heads) + " / " +
                                std::to_string(tp_size) +
                                ") with contextParallelMode AllToAll, which splits each rank's heads C ways, got " +
                                std::to_string(C));
  }
}

template <class P>
typename UlyssesAttention<P>::Split UlyssesAttention<P>::SplitOf(int B, int T, int NH, int KVH, int HS) const {
  const int64_t C = size();
  Split s{};
  s.B = B, s.T = T, s.L = T / 2, s.S = int64_t(T) * C;
  s.HS = HS, s.h = NH / C, s.kh = KVH / C;
  s.Q = int64_t(NH) * HS, s.KV = int64_t(KVH) * HS, s.W = s.Q + 2 * s.KV;
  s.q = s.h * HS, s.w = (s.h + 2 * s.kh) * HS;
  return s;
}

template <class P>
void UlyssesAttention<P>::Exchange(model::Ptr<const A> send, model::Ptr<A> recv, int64_t each,
                                   runtime::Stream& stream) {
  const size_t C = size_t(size());
  std::vector<size_t> counts(C, size_t(each)), offsets(C);
  for (size_t p = 0; p < C; ++p) offsets[p] = p * size_t(each);
  group_->AllToAll(send, counts, offsets, recv, counts, offsets, comm::DataTypeOf<A>(), stream);
}

template <class P>
void UlyssesAttention<P>::CopyRows(model::Ptr<A> to, int64_t to_row, model::Ptr<const A> from, int64_t from_row,
                                   int64_t width, int64_t rows, runtime::Stream& stream) {
  backend_->Copy2D(to, size_t(to_row) * sizeof(A), from, size_t(from_row) * sizeof(A), size_t(width) * sizeof(A),
                   size_t(rows), stream);
}

// Member p's block is (B, T, width): its chunk j's rows of sequence b are one run of
// L x width elements, which goes to chunk ChunkOf(p, j) of sequence b.
template <class P>
void UlyssesAttention<P>::BlocksToSequence(model::Ptr<A> sequence, model::Ptr<const A> blocks, const Split& s,
                                           int64_t width, runtime::Stream& stream) {
  for (int p = 0; p < size(); ++p) {
    for (int j = 0; j < 2; ++j) {
      CopyRows(sequence + ChunkOf(p, j) * s.L * width, s.S * width, blocks + (p * s.B * s.T + j * s.L) * width,
               s.T * width, s.L * width, s.B, stream);
    }
  }
}

template <class P>
void UlyssesAttention<P>::SequenceToBlocks(model::Ptr<A> blocks, model::Ptr<const A> sequence, const Split& s,
                                           int64_t width, runtime::Stream& stream) {
  for (int p = 0; p < size(); ++p) {
    for (int j = 0; j < 2; ++j) {
      CopyRows(blocks + (p * s.B * s.T + j * s.L) * width, s.T * width, sequence + ChunkOf(p, j) * s.L * width,
               s.S * width, s.L * width, s.B, stream);
    }
  }
}

template <class P>
void UlyssesAttention<P>::AttentionForward(kernels::Ops<P>& ops, model::Ptr<A> out, model::Ptr<G> state,
                                           runtime::DeviceBytes scratch, model::Ptr<const A> qkv, int B, int T,
                                           int NH, int KVH, int HS, runtime::Stream& stream) {
  Forward(ops, out, state, scratch, qkv, B, T, NH, KVH, HS, nullptr, stream);
}

template <class P>
void UlyssesAttention<P>::DocumentAttentionForward(kernels::Ops<P>& ops, model::Ptr<A> out, model::Ptr<G> state,
                                                   runtime::DeviceBytes scratch, model::Ptr<const A> qkv, int B,
                                                   int T, int NH, int KVH, int HS,
                                                   const model::Documents& documents, runtime::Stream& stream) {
  Forward(ops, out, state, scratch, qkv, B, T, NH, KVH, HS, &documents, stream);
}

template <class P>
void UlyssesAttention<P>::AttentionBackward(kernels::Ops<P>& ops, model::Ptr<A> dqkv, runtime::DeviceBytes scratch,
                                            model::Ptr<const A> dout, model::Ptr<const A>, model::Ptr<const A>,
                                            model::Ptr<const G> state, int B, int T, int NH, int KVH, int HS,
                                            runtime::Stream& stream) {
  Backward(ops, dqkv, scratch, dout, state, B, T, NH, KVH, HS, nullptr, stream);
}

template <class P>
void UlyssesAttention<P>::DocumentAttentionBackward(kernels::Ops<P>& ops, model::Ptr<A> dqkv,
                                                    runtime::DeviceBytes scratch, model::Ptr<const A> dout,
                                                    model::Ptr<const A>, model::Ptr<const A>,
                                                    model::Ptr<const G> state, int B, int T, int NH, int KVH, int HS,
                                                    const model::Documents& documents, runtime::Stream& stream) {
  Backward(ops, dqkv, scratch, dout, state, B, T, NH, KVH, HS, &documents, stream);
}

template <class P>
void UlyssesAttention<P>::Forward(kernels::Ops<P>& ops, model::Ptr<A> out, model::Ptr<G> state,
                                  runtime::DeviceBytes scratch, model::Ptr<const A> qkv, int B, int T, int NH,
                                  int KVH, int HS, const model::Documents* documents, runtime::Stream& stream) {
  const Split s = SplitOf(B, T, NH, KVH, HS);
  const int64_t N = s.B * s.T;
  const int64_t run_scratch =
      documents ? model::DocumentAttentionScratchBytes<P>(B, int(s.S), int(s.h), int(s.kh), HS) : 0;
  const model::Carving work(scratch, api::UlyssesAttentionBuffers(B, T, shape_, tp_size_, types_,
                                                                  api::UlyssesPart::kForward, run_scratch));
  const model::Carving kept(state, api::UlyssesAttentionBuffers(B, T, shape_, tp_size_, types_,
                                                                api::UlyssesPart::kKept));
  const model::Ptr<A> send = work.Get<A>("send"), recv = work.Get<A>("recv");
  const model::Ptr<A> qkv_heads = kept.Get<A>("qkv"), out_heads = kept.Get<A>("out");
  // Member p's block: this rank's rows of its query heads, then its key and value heads.
  for (int p = 0; p < size(); ++p) {
    const model::Ptr<A> block = send + p * N * s.w;
    CopyRows(block, s.w, qkv + p * s.q, s.W, s.q, N, stream);
    CopyRows(block + s.q, s.w, qkv + s.Q + p * s.kh * s.HS, s.W, s.kh * s.HS, N, stream);
    CopyRows(block + s.q + s.kh * s.HS, s.w, qkv + s.Q + s.KV + p * s.kh * s.HS, s.W, s.kh * s.HS, N, stream);
  }
  Exchange(send, recv, N * s.w, stream);
  BlocksToSequence(qkv_heads, recv, s, s.w, stream);
  if (documents != nullptr) {  // the rows are the whole sequences', in position order, as the starts count them
    model::DocumentAttentionForward<P>(ops, out_heads, kept.Get<G>("state"), work.Get<std::byte>("attention"),
                                       qkv_heads, B, int(s.S), int(s.h), int(s.kh), HS, *documents, stream);
  } else {
    ops.AttentionForward(out_heads, kept.Get<G>("state"), qkv_heads, B, int(s.S), int(s.h), int(s.kh), HS, stream);
  }
  // Back: member p gets its rows of this rank's heads, which go to their heads' channels.
  SequenceToBlocks(send, out_heads, s, s.q, stream);
  Exchange(send, recv, N * s.q, stream);
  for (int p = 0; p < size(); ++p) CopyRows(out + p * s.q, s.Q, recv + p * N * s.q, s.q, s.q, N, stream);
}

template <class P>
void UlyssesAttention<P>::Backward(kernels::Ops<P>& ops, model::Ptr<A> dqkv, runtime::DeviceBytes scratch,
                                   model::Ptr<const A> dout, model::Ptr<const G> state, int B, int T, int NH, int KVH,
                                   int HS, const model::Documents* documents, runtime::Stream& stream) {
  const Split s = SplitOf(B, T, NH, KVH, HS);
  const int64_t N = s.B * s.T;
  const int64_t kernel_scratch = documents ? model::DocumentAttentionScratchBytes<P>(B, int(s.S), int(s.h), int(s.kh), HS)
                                           : ops.AttentionScratchBytes(B, int(s.S), int(s.h), int(s.kh), HS);
  const model::Carving work(scratch, api::UlyssesAttentionBuffers(B, T, shape_, tp_size_, types_,
                                                                  api::UlyssesPart::kBackward, kernel_scratch));
  const Kept at = KeptOffsets(api::UlyssesAttentionBuffers(B, T, shape_, tp_size_, types_, api::UlyssesPart::kKept));
  const runtime::ConstDeviceBytes base = state;
  const model::Ptr<const A> qkv_heads = (base + at.qkv).template As<const A>();
  const model::Ptr<const A> out_heads = (base + at.out).template As<const A>();
  const model::Ptr<const G> kernel_state = (base + at.state).template As<const G>();
  const model::Ptr<A> send = work.Get<A>("send"), recv = work.Get<A>("recv");
  const model::Ptr<A> dout_heads = work.Get<A>("dout"), dqkv_heads = work.Get<A>("dqkv");
  // The output's gradient goes where the output came from, as the forward's output went back.
  for (int p = 0; p < size(); ++p) CopyRows(send + p * N * s.q, s.q, dout + p * s.q, s.Q, s.q, N, stream);
  Exchange(send, recv, N * s.q, stream);
  BlocksToSequence(dout_heads, recv, s, s.q, stream);
  if (documents != nullptr) {
    model::DocumentAttentionBackward<P>(ops, *backend_, dqkv_heads, work.Get<std::byte>("attention"), dout_heads,
                                        qkv_heads, out_heads, kernel_state, B, int(s.S), int(s.h), int(s.kh), HS,
                                        *documents, stream);
  } else {
    ops.AttentionBackward(dqkv_heads, work.Get<std::byte>("attention"), dout_heads, qkv_heads, out_heads,
                          kernel_state, B, int(s.S), int(s.h), int(s.kh), HS, stream);
  }
  // dq, dk, dv back to the rows they came from, into their heads' channels.
  SequenceToBlocks(send, dqkv_heads, s, s.w, stream);
  Exchange(send, recv, N * s.w, stream);
  for (int p = 0; p < size(); ++p) {
    const model::Ptr<const A> block = recv + p * N * s.w;
    CopyRows(dqkv + p * s.q, s.W, block, s.w, s.q, N, stream);
    CopyRows(dqkv + s.Q + p * s.kh * s.HS, s.W, block + s.q, s.w, s.kh * s.HS, N, stream);
    CopyRows(dqkv + s.Q + s.KV + p * s.kh * s.HS, s.W, block + s.q + s.kh * s.HS, s.w, s.kh * s.HS, N, stream);
  }
}

template class UlyssesAttention<kernels::Fp32>;
template class UlyssesAttention<kernels::Bf16>;
template class UlyssesAttention<kernels::Fp64>;

}  // namespace meshtrain::parallel
