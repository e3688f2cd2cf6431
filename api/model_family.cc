#include "api/model_family.h"

#include <algorithm>

#include "api/engine_memory.h"

namespace meshtrain::api {

FamilyTensors TensorsOf(const ModelShape& shape) {
  const ModelShape s = shape.Resolved();
  return s.Family().Tensors(s);
}

std::string HuggingFaceName(const TensorInfo& t, int layer) {
  std::string name = t.hf_name;
  if (const size_t at = name.find("{l}"); at != std::string::npos) name.replace(at, 3, std::to_string(layer));
  return name;
}

bool IgnoredOnImport(const ModelShape& shape, std::string_view hf_name) {
  if (shape.tied && hf_name == "lm_head.weight") return true;
  return shape.Family().Ignored(hf_name);
}

bool TensorParallelDivides(const ModelShape& shape, int64_t tp) {
  const ModelShape s = shape.Resolved();
  if (tp < 1) return false;
  for (const auto& [n, what] : s.Family().TensorParallelSplits(s)) {
    if (n % tp != 0) return false;
  }
  return true;
}

int64_t HeadChunkRows(int64_t rows, int64_t padded_vocab) {
  constexpr int64_t kChunkElements = int64_t(1) << 27;
  if (padded_vocab <= 0) return rows;
  return std::min(rows, std::max<int64_t>(1, kChunkElements / padded_vocab));
}

std::vector<Buffer> BlockActivationBuffers(int batch, int seq, const ModelShape& shape, int tp_size,
                                           const EngineTypes& t) {
  const ModelShape s = shape.Resolved();
  return s.Family().BlockActivationBuffers(batch, seq, s, tp_size, t);
}

std::vector<Buffer> BlockScratchBuffers(int batch, int seq, const ModelShape& shape, int tp_size, const EngineTypes& t,
                                        bool dropout) {
  const ModelShape s = shape.Resolved();
  return s.Family().BlockScratchBuffers(batch, seq, s, tp_size, t, dropout);
}

std::vector<Buffer> HeadBuffers(int batch, int seq, const ModelShape& s, int tp_rank, int tp_size,
                                const EngineTypes& t) {
  const int64_t N = int64_t(batch) * seq, C = s.hidden;
  const int64_t Vp = PaddedVocabRows(VocabSlice(s.vocab_size, tp_rank, tp_size), t.vocab_multiple);
  const int64_t R = HeadChunkRows(N, Vp);
  const int A = t.act_bytes, G = t.acc_bytes;
  std::vector<Buffer> b = {{"lnf", N * C, A}};
  if (s.Family().NormKeepsMean()) b.push_back({"lnf_mean", N, G});
  b.insert(b.end(), {
                        {"lnf_rstd", N, G},
                        {"losses", N, G},
                        {"logits", R * Vp, A},  // a chunk of logits (and, in place, their gradient)
                        {"dlnf", R * C, A},     // the chunk's gradient of the final norm's output
                    });
  if (tp_size > 1) {
    b.push_back({"stats", R * 3, G});              // this slice's softmax statistics
    b.push_back({"all_stats", tp_size * R * 3, G});  // every slice's
  }
  return b;
}

std::vector<Buffer> FamilyBuffers(int seq, const ModelShape& shape, const EngineTypes& types) {
  const ModelShape s = shape.Resolved();
  return s.Family().FamilyBuffers(seq, s, types);
}

std::vector<BlockProduct> BlockProducts(const ModelShape& shape, int64_t layer) {
  const ModelShape s = shape.Resolved();
  return s.Family().BlockProducts(s, layer);
}

std::vector<BlockProduct> EveryBlockProduct(const ModelShape& shape) {
  const ModelShape s = shape.Resolved();
  std::vector<BlockProduct> all;
  bool kinds[2] = {false, false};  // sparse (or the one kind), dense
  for (int64_t l = 0; l < s.layers; ++l) {
    bool& seen = kinds[s.DenseBlock(l) ? 1 : 0];
    if (seen) continue;
    seen = true;
    for (const BlockProduct& p : BlockProducts(s, l)) {
      const bool known = std::any_of(all.begin(), all.end(), [&](const BlockProduct& q) { return q.weight == p.weight; });
      if (!known) all.push_back(p);
    }
  }
  return all;
}

int64_t FirstBlockOfKind(const ModelShape& shape, bool dense) {
  int64_t l = 0;
  while (l < shape.layers && shape.DenseBlock(l) != dense) ++l;
  return l;
}

double BlockForwardFlopsPerToken(const ModelShape& shape, int64_t seq, int tp_size, int64_t layer) {
  const ModelShape s = shape.Resolved();
  const FamilyTensors f = TensorsOf(s);
  double weights = 0;
  for (const TensorInfo& t : f.Block(s, layer)) {
    if (t.shape.size() != 2) continue;
    // A token passes through k of the E experts.
    const double share = IsExpertTensor(t) ? double(s.experts_per_token) / double(s.experts) : 1.0;
    weights += share * double(t.shape[0]) * double(t.shape[1]);
  }
  return (2 * weights + 4.0 * double(seq) * double(s.QueryWidth())) / tp_size;
}

double BlockFloat8FlopsPerToken(const ModelShape& shape, int tp_size, int64_t layer) {
  double weights = 0;
  for (const BlockProduct& p : BlockProducts(shape, layer)) {
    if (p.float8) weights += double(p.k) * double(p.n);
  }
  return 2 * weights / tp_size;
}

namespace {

// f(l) for one block of each kind, weighted by the blocks of that kind, over the blocks.
template <class PerBlock>
double MeanOverBlocks(const ModelShape& s, PerBlock f) {
  if (s.layers <= 0) return 0;
  const int64_t dense = s.DenseBlocks();
  if (dense == 0) return f(0);  // one kind of block
  double sum = 0;
  if (dense < s.layers) sum += double(s.layers - dense) * f(FirstBlockOfKind(s, false));
  if (dense > 0) sum += double(dense) * f(FirstBlockOfKind(s, true));
  return sum / double(s.layers);
}

}  // namespace

double BlockForwardFlopsPerToken(const ModelShape& shape, int64_t seq, int tp_size) {
  return MeanOverBlocks(shape, [&](int64_t l) { return BlockForwardFlopsPerToken(shape, seq, tp_size, l); });
}

double BlockFloat8FlopsPerToken(const ModelShape& shape, int tp_size) {
  return MeanOverBlocks(shape, [&](int64_t l) { return BlockFloat8FlopsPerToken(shape, tp_size, l); });
}

}  // namespace meshtrain::api
