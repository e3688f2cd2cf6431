#include "api/engine_memory.h"

#include <algorithm>

namespace meshtrain::api {
namespace {

// Adds up buffers carved out of one allocation, each starting aligned.
struct Carving {
  int64_t bytes = 0;
  void Take(int64_t elements, int element_bytes) { bytes += Aligned(elements * element_bytes); }
};

int64_t Held(int64_t bytes) { return int64_t(AllocatorBlockBytes(size_t(bytes))); }

}  // namespace

UnitElements UnitElementsOf(const ModelShape& s, int tp_rank, int tp_size, int vocab_multiple) {
  const int64_t C = s.hidden, T = tp_size;
  UnitElements u;
  u.root = PaddedVocabRows(VocabSlice(s.vocab_size, tp_rank, tp_size), vocab_multiple) * C + s.seq_len * C + 2 * C;
  // Split: qkv (3C,C)+(3C), attproj.w (C,C), fc (4C,C)+(4C), fcproj.w (C,4C);
  // whole: ln1, ln2 (2C each), attproj.b and fcproj.b (C each).
  u.block = (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C) / T + 6 * C;
  return u;
}

int64_t HeadChunkRows(int64_t rows, int64_t padded_vocab) {
  constexpr int64_t kChunkElements = int64_t(1) << 27;
  if (padded_vocab <= 0) return rows;
  return std::min(rows, std::max<int64_t>(1, kChunkElements / padded_vocab));
}

// The carvings below are the order model/blocks.cc and parallel/activation_store.cc take
// the buffers in; they check their totals against these.
int64_t BlockActivationBytes(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t) {
  const int64_t N = int64_t(batch) * seq, C = s.hidden, Cl = C / tp_size, heads = s.heads / tp_size;
  const int A = t.act_bytes, G = t.acc_bytes;
  Carving c;
  c.Take(N * C, A);          // ln1
  c.Take(N, G);              // ln1 mean
  c.Take(N, G);              // ln1 rstd
  c.Take(N * 3 * Cl, A);     // qkv
  c.Take(N * Cl, A);         // attention's output
  c.Take(t.attention_keeps_scores ? int64_t(batch) * heads * seq * seq : int64_t(batch) * heads * seq, G);
  c.Take(N * C, A);          // residual2
  c.Take(N * C, A);          // ln2
  c.Take(N, G);              // ln2 mean
  c.Take(N, G);              // ln2 rstd
  c.Take(N * 4 * Cl, A);     // the MLP's pre-activation
  c.Take(N * 4 * Cl, A);     // its GELU
  c.Take(N * C, A);          // the block's output
  return c.bytes;
}

int64_t HeadActivationBytes(int batch, int seq, const ModelShape& s, int tp_rank, int tp_size, const EngineTypes& t) {
  const int64_t N = int64_t(batch) * seq, C = s.hidden;
  const int64_t Vp = PaddedVocabRows(VocabSlice(s.vocab_size, tp_rank, tp_size), t.vocab_multiple);
  const int64_t R = HeadChunkRows(N, Vp);
  const int A = t.act_bytes, G = t.acc_bytes;
  Carving c;
  c.Take(N * C, A);  // lnf
  c.Take(N, G);      // lnf mean
  c.Take(N, G);      // lnf rstd
  c.Take(N, G);      // losses
  c.Take(R * Vp, A);  // a chunk of logits (and, in place, their gradient)
  c.Take(R * C, A);   // the chunk's gradient of lnf
  if (tp_size > 1) {
    c.Take(R * 3, G);            // this slice's softmax statistics
    c.Take(tp_size * R * 3, G);  // every slice's
  }
  return c.bytes;
}

int64_t BlockScratchBytes(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t, bool dropout) {
  const int64_t N = int64_t(batch) * seq, C = s.hidden, Cl = C / tp_size;
  const int A = t.act_bytes;
  Carving c;
  c.Take(N * C, A);       // a projection's output, before its residual add
  c.Take(N * C, A);       // the residual stream's gradient
  c.Take(N * C, A);       // a LayerNorm's output gradient
  c.Take(N * 4 * Cl, A);  // the MLP's
  c.Take(N * Cl, A);      // attention's output gradient
  c.Take(N * 3 * Cl, A);  // QKV's
  if (dropout) {
    c.Take(N * C, A);  // a masked residual gradient
    c.Take(N * C, A);  // attention's output after dropout (the forward keeps it before)
  }
  c.Take(t.attention_scratch_bytes, 1);
  return c.bytes;
}

ActivationBytes ActivationStoreBytes(const ModelShape& s, int batch, int seq, const ActivationPolicy& policy,
                                     int tp_rank, int tp_size, const EngineTypes& types, bool dropout) {
  const int layers = int(s.layers);
  const int64_t input = Aligned(int64_t(batch) * seq * s.hidden * types.act_bytes);
  ActivationBytes a;
  a.inputs = !policy.checkpointing ? 1 : policy.offload ? std::min(policy.horizon + 1, layers) : layers;
  const int kept_blocks = policy.checkpointing ? 1 : layers;
  const int head_inputs = policy.checkpointing ? 1 : 0;  // otherwise the last block's output
  a.kept = input * (a.inputs + head_inputs) + BlockActivationBytes(batch, seq, s, tp_size, types) * kept_blocks +
           HeadActivationBytes(batch, seq, s, tp_rank, tp_size, types) +
           BlockScratchBytes(batch, seq, s, tp_size, types, dropout);
  a.offloaded = policy.offload ? input * std::max(0, layers - a.inputs) : 0;
  return a;
}

int64_t StepBufferBytes(int batch, int seq, const ModelShape& s) {
  const int64_t N = int64_t(batch) * seq;
  Carving c;
  c.Take(N, 4);  // tokens
  c.Take(N, 4);  // targets
  c.Take(3, 8);  // the loss's sum, the squares' sum, the clip scale
  c.Take(4, kShardSegmentBytes);  // the root's segments: at most one per tensor
  for (int64_t l = 0; l < s.layers; ++l) c.Take(12, kShardSegmentBytes);
  return c.bytes;
}

EngineMemory EngineMemoryOf(const ModelShape& s, int batch, int seq, int tp_rank, int tp_size, int shard_size,
                            const ActivationPolicy& policy, const EngineTypes& types, bool dropout,
                            bool keep_units_gathered) {
  const UnitElements units = UnitElementsOf(s, tp_rank, tp_size, types.vocab_multiple);
  const int64_t root = ShardElements(units.root, shard_size), block = ShardElements(units.block, shard_size);
  const int S = shard_size, A = types.act_bytes, G = types.acc_bytes;
  const int64_t slots = keep_units_gathered ? s.layers : std::min<int64_t>(2, s.layers);
  EngineMemory m;
  // Every unit's shard: master weights, gradients, AdamW m and v, one allocation each.
  m.params = Held(root * G) + s.layers * Held(block * G);
  m.grads = m.params;
  m.optimizer = 2 * m.params;
  // The compute copies: the root's and two block slots (or every block's, kept); with S > 1
  // their gradients too
  // (with S = 1 the backward adds straight into the shard's gradients).
  m.gathered = Held(root * S * A) + slots * Held(block * S * A);
  if (S > 1) m.gathered += Held(root * S * G) + slots * Held(block * S * G);
  m.comm = S > 1 ? Held(std::max(root, block) * G) : 0;
  const ActivationBytes store = ActivationStoreBytes(s, batch, seq, policy, tp_rank, tp_size, types, dropout);
  m.activations = Held(store.kept) + Held(StepBufferBytes(batch, seq, s));
  m.offload = store.offloaded > 0 ? Held(store.offloaded) : 0;
  return m;
}

size_t AllocatorBlockBytes(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t(2) << 20, kLargeFrom = size_t(1) << 20;
  const size_t unit = bytes < kLargeFrom ? kSmall : kLarge;
  return std::max(unit, (bytes + unit - 1) / unit * unit);
}

}  // namespace meshtrain::api
