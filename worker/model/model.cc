#include "worker/model/model.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "worker/kernels/dropout.h"
#include "worker/model/layers.h"

namespace meshtrain::model {

Carving::Carving(runtime::DeviceBytes base, std::vector<api::Buffer> buffers)
    : base_(base), buffers_(std::move(buffers)) {
  for (const api::Buffer& b : buffers_) {
    offsets_.push_back(bytes_);
    bytes_ += api::Aligned(b.elements * b.element_bytes);
  }
}

runtime::DeviceBytes Carving::At(std::string_view name, int element_bytes, bool required) const {
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (buffers_[i].name != name) continue;
    if (buffers_[i].element_bytes != element_bytes && element_bytes != 1) {
      throw std::logic_error("Carving: buffer " + std::string(name) + " holds elements of " +
                             std::to_string(buffers_[i].element_bytes) + " bytes, not " + std::to_string(element_bytes));
    }
    return base_ + offsets_[i];
  }
  if (required) throw std::logic_error("Carving: no buffer " + std::string(name));
  return {};
}

int64_t Carving::Elements(std::string_view name) const {
  for (const api::Buffer& b : buffers_) {
    if (b.name == name) return b.elements;
  }
  throw std::logic_error("Carving: no buffer " + std::string(name));
}

template <class P>
std::vector<double> Model<P>::FamilyBufferValues(std::string_view name, const std::vector<int64_t>&) const {
  throw std::logic_error("Model: the family has no buffer " + std::string(name));
}

std::vector<int64_t> WindowPositions(int seq) {
  std::vector<int64_t> positions(static_cast<size_t>(seq));
  for (int t = 0; t < seq; ++t) positions[size_t(t)] = t;
  return positions;
}

template <class P>
void AttentionForward(const Context<P>& k, Ptr<typename P::Act> out, Ptr<typename P::Acc> state,
                      runtime::DeviceBytes scratch, Ptr<const typename P::Act> qkv, int B, int T, int NH, int KVH,
                      int HS) {
  if (k.documents != nullptr) {
    if (k.cp == nullptr) {
      return DocumentAttentionForward(k.ops, out, state, scratch, qkv, B, T, NH, KVH, HS, *k.documents, k.stream);
    }
    return k.cp->DocumentAttentionForward(k.ops, out, state, scratch, qkv, B, T, NH, KVH, HS, *k.documents, k.stream);
  }
  if (k.cp == nullptr) return k.ops.AttentionForward(out, state, qkv, B, T, NH, KVH, HS, k.stream);
  k.cp->AttentionForward(k.ops, out, state, scratch, qkv, B, T, NH, KVH, HS, k.stream);
}

template <class P>
void AttentionBackward(const Context<P>& k, Ptr<typename P::Act> dqkv, runtime::DeviceBytes scratch,
                       Ptr<const typename P::Act> dout, Ptr<const typename P::Act> qkv, Ptr<const typename P::Act> out,
                       Ptr<const typename P::Acc> state, int B, int T, int NH, int KVH, int HS) {
  if (k.documents != nullptr) {
    if (k.cp == nullptr) {
      if (k.backend == nullptr) throw std::logic_error("AttentionBackward: document attention needs Context::backend");
      return DocumentAttentionBackward(k.ops, *k.backend, dqkv, scratch, dout, qkv, out, state, B, T, NH, KVH, HS,
                                       *k.documents, k.stream);
    }
    return k.cp->DocumentAttentionBackward(k.ops, dqkv, scratch, dout, qkv, out, state, B, T, NH, KVH, HS,
                                           *k.documents, k.stream);
  }
  if (k.cp == nullptr) {
    return k.ops.AttentionBackward(dqkv, scratch, dout, qkv, out, state, B, T, NH, KVH, HS,
                                   k.stream);
  }
  k.cp->AttentionBackward(k.ops, dqkv, scratch, dout, qkv, out, state, B, T, NH, KVH, HS, k.stream);
}

template <class P>
Carving PrepareFamilyBuffers(const Model<P>& model, runtime::Backend& backend, runtime::DeviceBytes base,
                             const std::vector<int64_t>& positions, const api::ModelShape& shape,
                             const api::EngineTypes& types, runtime::Stream& stream) {
  using G = typename P::Acc;
  const std::vector<api::Buffer> buffers = api::FamilyBuffers(int(positions.size()), shape, types);
  Carving carving(base, buffers);
  for (const api::Buffer& b : buffers) {
    const std::vector<double> values = model.FamilyBufferValues(b.name, positions);
    if (int64_t(values.size()) != b.elements) {
      throw std::logic_error("PrepareFamilyBuffers: " + std::string(b.name) + " has " + std::to_string(values.size()) +
                             " values for " + std::to_string(b.elements) + " elements");
    }
    const std::vector<G> narrow(values.begin(), values.end());
    backend.Upload(carving.template Get<G>(b.name), narrow.data(), int64_t(narrow.size()), stream);
    stream.Synchronize();  // the upload reads `narrow`
  }
  return carving;
}

template <class P>
BlockActivations<P> BlockActivations<P>::At(runtime::DeviceBytes base, int batch, int seq,
                                            const api::ModelShape& shape, TpSlice tp, const api::EngineTypes& types) {
  BlockActivations a;
  a.parts = Carving(base, api::BlockActivationBuffers(batch, seq, shape, tp.size, types));
  a.output = a.parts.template Get<typename P::Act>("output");
  return a;
}

template <class P>
BlockScratch<P> BlockScratch<P>::At(runtime::DeviceBytes base, int batch, int seq, const api::ModelShape& shape,
                                    TpSlice tp, const api::EngineTypes& types, bool dropout) {
  BlockScratch s;
  s.parts = Carving(base, api::BlockScratchBuffers(batch, seq, shape, tp.size, types, dropout));
  s.dresidual = s.parts.template Get<typename P::Act>("dresidual");
  return s;
}

template <class P>
HeadActivations<P> HeadActivations<P>::At(runtime::DeviceBytes base, int batch, int seq, const api::ModelShape& s,
                                          TpSlice tp, const api::EngineTypes& types) {
  const Carving c(base, api::HeadBuffers(batch, seq, s, tp.rank, tp.size, types));
  HeadActivations h;
  h.chunk_rows = api::HeadChunkRows(int64_t(batch) * seq, tp.padded_vocab(s.vocab_size));
  h.lnf = c.Get<A>("lnf");
  h.lnf_mean = c.Find<G>("lnf_mean");
  h.lnf_rstd = c.Get<G>("lnf_rstd");
  h.losses = c.Get<G>("losses");
  h.logits = c.Get<A>("logits");
  h.dlnf = c.Get<A>("dlnf");
  h.stats = c.Find<G>("stats");
  h.all_stats = c.Find<G>("all_stats");
  return h;
}

template <class P>
api::EngineTypes TypesOf(kernels::Ops<P>& ops, int B, int T, const api::ModelShape& shape, int tp_size,
                         int context, bool all_to_all) {
  const api::ModelShape s = shape.Resolved();
  const int NH = int(s.heads) / tp_size, KVH = int(s.kv_heads) / tp_size, HS = int(s.head_dim);
  api::EngineTypes types;
  types.act_bytes = int(sizeof(typename P::Act));
  types.acc_bytes = int(sizeof(typename P::Acc));
  types.attention_keeps_scores = ops.Attention(B, T, NH, KVH, HS) == kernels::AttentionKind::kScores;
  types.attention_scratch_bytes = ops.AttentionScratchBytes(B, T, NH, KVH, HS);
  types.context = context;
  types.context_all_to_all = context > 1 && all_to_all;
  if (types.context_all_to_all) {  // the table's attention on whole sequences of NH / C heads
    const int S = T * context, h = NH / context, kh = KVH / context;
    types.attention_keeps_scores = ops.Attention(B, S, h, kh, HS) == kernels::AttentionKind::kScores;
    types.attention_scratch_bytes = ops.AttentionScratchBytes(B, S, h, kh, HS);
  }
  if (context > 1) types.attention_scratch_bytes = api::ContextAttentionScratchBytes(B, T, s, tp_size, types);
  return types;
}

Dims Dims::ForLayer(int l) const {
  Dims d = *this;
  d.dropout.key = kernels::MixKey(dropout.key, uint64_t(l));
  d.layer = l;
  return d;
}

Dims Dims::Of(const api::ModelShape& shape, int B, int T, TpSlice tp) {
  const api::ModelShape s = shape.Resolved();
  Dims d;
  d.B = B, d.T = T, d.C = int(s.hidden), d.NH = int(s.heads), d.KVH = int(s.kv_heads), d.HS = int(s.head_dim);
  d.H = int(s.intermediate), d.eps = float(s.norm_eps), d.V = s.vocab_size, d.tp = tp;
  return d;
}

// The layers of each kind a family's description may name (api::ModelFamily::layers).
template <class P>
std::unique_ptr<Model<P>> MakeModel(const ParameterLayout& layout) {
  using Factory = std::unique_ptr<Model<P>> (*)(const ParameterLayout&);
  static constexpr std::pair<std::string_view, Factory> kLayers[] = {{"gpt2", &MakeGpt2<P>}, {"llama", &MakeLlama<P>}};
  const std::string_view layers = layout.shape().Family().layers();
  for (const auto& [name, make] : kLayers) {
    if (name == layers) return make(layout);
  }
  throw std::logic_error("MakeModel: no layers \"" + std::string(layers) + "\" for the family " +
                         layout.shape().family);
}

#define MESHTRAIN_MODEL(P)                                                                          \
  template struct BlockActivations<P>;                                                              \
  template struct BlockScratch<P>;                                                                  \
  template struct HeadActivations<P>;                                                               \
  template api::EngineTypes TypesOf<P>(kernels::Ops<P>&, int, int, const api::ModelShape&, int, int, bool); \
  template std::unique_ptr<Model<P>> MakeModel<P>(const ParameterLayout&);                          \
  template class Model<P>;                                                                          \
  template Carving PrepareFamilyBuffers<P>(const Model<P>&, runtime::Backend&, runtime::DeviceBytes,              \
                                           const std::vector<int64_t>&, const api::ModelShape&,                     \
                                           const api::EngineTypes&, runtime::Stream&);                              \
  template void AttentionForward<P>(const Context<P>&, Ptr<P::Act>, Ptr<P::Acc>, runtime::DeviceBytes,             \
                                    Ptr<const P::Act>, int, int, int, int, int);                                    \
  template void AttentionBackward<P>(const Context<P>&, Ptr<P::Act>, runtime::DeviceBytes, Ptr<const P::Act>,      \
                                     Ptr<const P::Act>, Ptr<const P::Act>, Ptr<const P::Acc>, int, int, int, int, \
                                     int);

MESHTRAIN_MODEL(kernels::Fp32)
MESHTRAIN_MODEL(kernels::Bf16)
MESHTRAIN_MODEL(kernels::Fp64)
#undef MESHTRAIN_MODEL

}  // namespace meshtrain::model
