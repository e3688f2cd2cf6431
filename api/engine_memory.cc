#include "api/engine_memory.h"

#include <algorithm>

namespace meshtrain::api {

UnitElements UnitElementsOf(const ModelShape& s, int tp_rank, int tp_size) {
  const int64_t C = s.hidden, T = tp_size;
  UnitElements u;
  u.root = VocabSlice(s.vocab_size, tp_rank, tp_size) * C + s.seq_len * C + 2 * C;
  // Split: qkv (3C,C)+(3C), attproj.w (C,C), fc (4C,C)+(4C), fcproj.w (C,4C);
  // whole: ln1, ln2 (2C each), attproj.b and fcproj.b (C each).
  u.block = (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C) / T + 6 * C;
  return u;
}

int64_t BlockActivationElements(int batch, int seq, const ModelShape& s, int tp_size) {
  const int64_t bt = int64_t(batch) * seq, btc = bt * s.hidden, btc_local = btc / tp_size,
                bhtt = int64_t(batch) * (s.heads / tp_size) * seq * seq;
  // ln1 + mean/rstd, qkv, atty, preatt, att, attproj, residual2, ln2 + mean/rstd, fch,
  // fch_gelu, fcproj, residual3: the order model/blocks.cc carves them in.
  return btc + 2 * bt + 3 * btc_local + btc_local + 2 * bhtt + 3 * btc + 2 * bt + 8 * btc_local + 2 * btc;
}

int64_t HeadActivationElements(int batch, int seq, const ModelShape& s, int tp_rank, int tp_size) {
  const int64_t bt = int64_t(batch) * seq, vocab = VocabSlice(s.vocab_size, tp_rank, tp_size);
  // lnf + mean/rstd, logits, probs, losses; with TP the statistics (3 per position) of
  // this slice and of every slice.
  int64_t n = bt * s.hidden + 2 * bt + 2 * bt * vocab + bt;
  if (tp_size > 1) n += 3 * bt + 3 * bt * tp_size;
  return n;
}

ActivationElements ActivationStoreElements(const ModelShape& s, int batch, int seq, const ActivationPolicy& policy,
                                           int tp_rank, int tp_size) {
  const int layers = int(s.layers);
  const int64_t btc = int64_t(batch) * seq * s.hidden;
  const int64_t block = BlockActivationElements(batch, seq, s, tp_size);
  const int64_t head = HeadActivationElements(batch, seq, s, tp_rank, tp_size);
  ActivationElements a;
  a.inputs = !policy.checkpointing ? 1 : policy.offload ? std::min(policy.horizon + 1, layers) : layers;
  const int kept_blocks = policy.checkpointing ? 1 : layers;
  const int head_inputs = policy.checkpointing ? 1 : 0;  // otherwise the last block's residual3
  // inputs, the head's input, the kept blocks, head and dhead, dblock, dresidual[2]
  a.kept = btc * (a.inputs + head_inputs) + block * (kept_blocks + 1) + 2 * head + 2 * btc;
  a.offloaded = policy.offload ? btc * std::max(0, layers - a.inputs) : 0;
  return a;
}

size_t AllocatorBlockBytes(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t(2) << 20, kLargeFrom = size_t(1) << 20;
  const size_t unit = bytes < kLargeFrom ? kSmall : kLarge;
  return std::max(unit, (bytes + unit - 1) / unit * unit);
}

}  // namespace meshtrain::api
