#include "api/engine_memory.h"

#include <algorithm>

#include "common/allocator_blocks.h"

namespace meshtrain::api {
namespace {

int64_t Held(int64_t bytes) { return int64_t(AllocatorBlockBytes(size_t(bytes))); }

int64_t Sum(const std::vector<TensorInfo>& tensors, int64_t vocab, int tp_rank, int tp_size, int vocab_multiple) {
  int64_t n = 0;
  for (const TensorInfo& t : tensors) n += LocalElements(t, vocab, tp_rank, tp_size, vocab_multiple);
  return n;
}

// Of `tensors`, the experts' elements (all experts).
int64_t ExpertSum(const std::vector<TensorInfo>& tensors, int64_t vocab, int tp_rank, int tp_size, int vocab_multiple) {
  int64_t n = 0;
  for (const TensorInfo& t : tensors) {
    if (IsExpertTensor(t)) n += LocalElements(t, vocab, tp_rank, tp_size, vocab_multiple);
  }
  return n;
}

}  // namespace

int64_t LocalElements(const TensorInfo& t, int64_t vocab, int tp_rank, int tp_size, int vocab_multiple) {
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  switch (t.split) {
    case TpSplit::kReplicated: return n;
    case TpSplit::kVocab: return PaddedVocabRows(VocabSlice(vocab, tp_rank, tp_size), vocab_multiple) * (n / vocab);
    case TpSplit::kRows:
    case TpSplit::kQkvRows:
    case TpSplit::kColumns: return n / tp_size;
  }
  return n;
}

bool IsExpertTensor(const TensorInfo& t) {
  return t.kind == Param::kExpertGate || t.kind == Param::kExpertUp || t.kind == Param::kExpertDown;
}

UnitElements UnitElementsOf(const ModelShape& s, int tp_rank, int tp_size, int vocab_multiple, int expert_size) {
  const FamilyTensors f = TensorsOf(s);
  UnitElements u{Sum(f.embedding, s.vocab_size, tp_rank, tp_size, vocab_multiple),
                 Sum(f.block, s.vocab_size, tp_rank, tp_size, vocab_multiple),
                 Sum(f.head, s.vocab_size, tp_rank, tp_size, vocab_multiple)};
  // Every expert is the same size: a rank of an expert group holds E/EP of them.
  const int64_t experts = ExpertSum(f.block, s.vocab_size, tp_rank, tp_size, vocab_multiple);
  const int EP = expert_size > 1 && experts > 0 ? expert_size : 1;
  u.block_experts = experts / EP;
  u.block -= experts - u.block_experts;
  u.dense_block = Sum(f.dense_block, s.vocab_size, tp_rank, tp_size, vocab_multiple);
  return u;
}

int64_t FusedAttentionScratchBytes(int batch, int seq, int heads, int head_dim, int64_t workspace) {
  const int64_t rows = int64_t(batch) * heads * seq;
  return Aligned(rows * 4) + Aligned(rows * head_dim * 4) + Aligned(workspace) + kCarveAlignment;
}

int64_t CarvedBytes(const std::vector<Buffer>& buffers) {
  int64_t bytes = 0;
  for (const Buffer& b : buffers) bytes += Aligned(b.elements * b.element_bytes);
  return bytes;
}

int64_t BlockActivationBytes(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t) {
  return CarvedBytes(BlockActivationBuffers(batch, seq, s, tp_size, t));
}

int64_t HeadActivationBytes(int batch, int seq, const ModelShape& s, int tp_rank, int tp_size, const EngineTypes& t) {
  return CarvedBytes(HeadBuffers(batch, seq, s, tp_rank, tp_size, t));
}

int64_t BlockScratchBytes(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t, bool dropout) {
  return CarvedBytes(BlockScratchBuffers(batch, seq, s, tp_size, t, dropout));
}

// The order parallel/activation_store.cc carves them in; it checks its total against this.
ActivationBytes ActivationStoreBytes(const ModelShape& s, int batch, int seq, const ActivationPolicy& policy,
                                     int tp_rank, int tp_size, const EngineTypes& types, bool dropout,
                                     const StageShape& stage) {
  const std::vector<int> lanes = stage.lanes.empty() ? std::vector<int>{int(s.layers)} : stage.lanes;
  const int64_t input = Aligned(int64_t(batch) * seq * s.hidden * types.act_bytes);
  const int64_t block = BlockActivationBytes(batch, seq, s, tp_size, types);
  ActivationBytes a;
  int64_t inputs = 0, blocks = 0;
  for (const int layers : lanes) {
    // Each lane: its block inputs (slots) or whole blocks, its output when only inputs
    // are kept (otherwise the last block's), and when pipelined its gradient.
    const int slots = !policy.checkpointing ? 1 : policy.offload ? std::min(policy.horizon + 1, layers) : layers;
    a.inputs += slots;
    inputs += slots + (policy.checkpointing ? 1 : 0) + (stage.pipelined ? 1 : 0);
    blocks += policy.checkpointing ? 0 : layers;
    a.offloaded += policy.offload ? input * std::max(0, layers - slots) : 0;
  }
  if (policy.checkpointing) blocks += 1;  // the recompute's working set
  a.kept = input * inputs + block * blocks +
           (stage.head ? HeadActivationBytes(batch, seq, s, tp_rank, tp_size, types) : 0) +
           BlockScratchBytes(batch, seq, s, tp_size, types, dropout);
  return a;
}

int64_t Float8ScaleWidth(int batch, int seq, const ModelShape& s, int tp, bool rowwise) {
  if (!rowwise) return 1;
  int64_t width = int64_t(batch) * seq;
  for (const Float8Product& p : Float8LinearProducts(batch, seq, s, tp)) width = std::max({width, p.m, p.k});
  return width;
}

int64_t Float8ScratchElements(int batch, int seq, const ModelShape& s, int tp, bool rowwise) {
  return (int64_t(tp) + 2) * 2 * Float8ScaleWidth(batch, seq, s, tp, rowwise);
}

std::vector<Float8Product> Float8LinearProducts(int batch, int seq, const ModelShape& shape, int tp,
                                                const Float8Run& run) {
  const int64_t N = int64_t(batch) * seq;
  std::vector<Float8Product> products;
  for (const BlockProduct& l : EveryBlockProduct(shape)) {
    if (!l.float8) continue;
    const bool row_parallel = l.split == TpSplit::kColumns;
    const int64_t K = row_parallel ? l.k / tp : l.k, OC = row_parallel ? l.n : l.n / tp;
    // By the rules worker/model's blocks run their epilogues by (AddsBias,
    // ProjectsIntoResidual), without dropout: evaluation, which every run ends with, drops
    // nothing.
    const LinearEpilogue& e = l.epilogue;
    const bool bias = e.bias && AddsBias(l.split, run.tp_rank);
    const bool residual = e.residual && ProjectsIntoResidual(tp, /*dropout=*/false);
    products.push_back({OC, N, K, Float8KeepsSums(run.rowwise, bias || residual || e.gelu)});
    products.push_back({K, N, OC, Float8KeepsSums(run.rowwise, e.gelu_input)});
    products.push_back({K, OC, N, Float8KeepsSums(run.rowwise, false)});
  }
  return products;
}

int64_t Float8SumRows(int64_t m, int64_t n) { return std::clamp<int64_t>(kFloat8SumBytes / (4 * m) / 16 * 16, 16, n); }

int64_t Float8ProductBytes(const Float8Product& p, bool with_sums) {
  constexpr int64_t kAlign = 256;
  auto up = [](int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; };
  const int64_t sums = with_sums ? up(Float8SumRows(p.m, p.n) * p.m * 4) : 0;
  return up(p.m * p.k) + up(p.n * p.k) + kAlign + sums + kAlign;
}

int64_t Float8KernelScratchBytes(int batch, int seq, const ModelShape& shape, int tp, const Float8Run& run) {
  int64_t bytes = 0;
  for (const Float8Product& p : Float8LinearProducts(batch, seq, shape, tp, run)) {
    bytes = std::max(bytes, Float8ProductBytes(p, p.sums));
  }
  return bytes;
}

std::vector<Buffer> StepBuffers(int batch, int seq, const ModelShape& s, const EngineTypes& t) {
  const int64_t N = int64_t(batch) * seq;
  const FamilyTensors f = TensorsOf(s);
  std::vector<Buffer> b = {
      {"tokens", N, 4},
      {"targets", N, 4},
      {"scalars", 3, 8},  // the loss's sum, the squares' sum, the clip scale
      {"embedding segments", int64_t(f.embedding.size()), int(kShardSegmentBytes)},
  };
  for (int64_t l = 0; l < s.layers; ++l) {
    b.push_back({"block segments", int64_t(f.Block(s, l).size()), int(kShardSegmentBytes)});
  }
  if (!f.head.empty()) b.push_back({"head segments", int64_t(f.head.size()), int(kShardSegmentBytes)});
  if (t.float8_scales > 0) b.push_back({"float8 amaxes and scales", t.float8_scales, 4});
  for (const Buffer& family : FamilyBuffers(seq, s, t)) b.push_back(family);  // RoPE's table
  return b;
}

int64_t StepBufferBytes(int batch, int seq, const ModelShape& s, const EngineTypes& t) {
  return CarvedBytes(StepBuffers(batch, seq, s, t));
}

EngineMemory EngineMemoryOf(const ModelShape& s, int batch, int seq, int tp_rank, int tp_size, int shard_size,
                            const ActivationPolicy& policy, const EngineTypes& types, bool dropout,
                            bool keep_units_gathered, const StageShape& stage) {
  const UnitElements units = UnitElementsOf(s, tp_rank, tp_size, types.vocab_multiple, types.experts);
  const int S = shard_size, A = types.act_bytes, G = types.acc_bytes;
  // A block whose experts an expert group splits: sharded over the S / EP ranks holding the
  // same experts; it reduces from unsharded gradients even where that is one rank.
  const int block_shards = BlockShards(units, S, types.experts);
  const bool experts_split = block_shards != S;
  const int64_t blocks = stage.blocks < 0 ? s.layers : stage.blocks;
  const int64_t dense = stage.blocks < 0 ? s.DenseBlocks() : stage.dense_blocks, sparse = blocks - dense;
  const int64_t embedding = stage.embedding_unit ? ShardElements(units.embedding, S) : 0;
  // A sparse block's shard (the only kind's without dense blocks) and a dense block's, over
  // all S ranks; the compute slots fit the larger of the two as gathered.
  const int64_t block = sparse > 0 ? ShardElements(units.block, block_shards) : 0;
  const int64_t dense_block = dense > 0 ? ShardElements(units.dense_block, S) : 0;
  const int64_t slot = std::max(block * block_shards, dense_block * S);
  const int64_t head = stage.head && units.head > 0 ? ShardElements(units.head, S) : 0, edge = std::max(embedding, head);
  const int64_t slots = keep_units_gathered ? blocks : std::min<int64_t>(2, blocks);
  auto held = [](int64_t bytes) { return bytes > 0 ? Held(bytes) : 0; };
  EngineMemory m;
  // Every unit's shard: master weights, gradients, AdamW m and v, one allocation each.
  m.params = held(embedding * G) + sparse * held(block * G) + dense * held(dense_block * G) + held(head * G);
  m.grads = m.params;
  m.optimizer = 2 * m.params;
  // The compute copies: the edge slot (the embedding's or the head's) and two block slots;
  // kept, every unit's own. With S > 1 their gradients too (with S = 1 the backward adds
  // straight into the shard's gradients).
  if (keep_units_gathered) {
    m.gathered = held(embedding * A) + held(head * A) + slots * held(slot * A);
  } else {
    m.gathered = held(edge * S * A) + slots * held(slot * A);
  }
  if (S > 1) m.gathered += held(edge * S * G);
  if (S > 1 || (experts_split && sparse > 0)) m.gathered += slots * held(slot * G);
  m.comm = S > 1 ? Held(std::max({edge, block, dense_block}) * G) : 0;
  const ActivationBytes store = ActivationStoreBytes(s, batch, seq, policy, tp_rank, tp_size, types, dropout, stage);
  m.activations = Held(store.kept) + Held(StepBufferBytes(batch, seq, s, types)) + held(types.float8_product_bytes);
  m.offload = store.offloaded > 0 ? Held(store.offloaded) : 0;
  return m;
}

size_t AllocatorBlockBytes(size_t bytes) { return common::AllocatorBlockBytes(bytes); }

}  // namespace meshtrain::api
