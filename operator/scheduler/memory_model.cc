#include "operator/scheduler/memory_model.h"

#include <algorithm>

namespace meshtrain::scheduler {

std::string Describe(const LayoutChoice& c) {
  std::string text = "T=" + std::to_string(c.tp) + ", S=" + std::to_string(c.shard) + ", micro-batch " +
                     std::to_string(c.micro_batch) + ", ";
  if (c.activations.offload) return text + "offload (horizon " + std::to_string(c.activations.horizon) + ")";
  return text + (c.activations.checkpointing ? "checkpointing" : "keep all");
}

namespace {

int64_t Held(int64_t elements, int bytes) { return int64_t(api::AllocatorBlockBytes(size_t(elements) * size_t(bytes))); }

MemoryPrediction PredictRank(const api::ModelShape& shape, int seq, const LayoutChoice& c, int compute_bytes,
                             int tp_rank) {
  const api::UnitElements units = api::UnitElementsOf(shape, tp_rank, c.tp);
  const int64_t root_shard = api::ShardElements(units.root, c.shard);
  const int64_t block_shard = api::ShardElements(units.block, c.shard);
  MemoryPrediction m;
  // FlatUnit: master (params), gradient, AdamW m and v, one allocation each per unit.
  m.params = Held(root_shard, 4) + shape.layers * Held(block_shard, 4);
  m.grads = m.params;
  m.optimizer = 2 * m.params;
  const api::ActivationElements acts =
      api::ActivationStoreElements(shape, c.micro_batch, seq, c.activations, tp_rank, c.tp);
  m.activations = Held(acts.kept, compute_bytes);
  m.offload = acts.offloaded > 0 ? Held(acts.offloaded, compute_bytes) : 0;
  const int64_t root_gathered = Held(root_shard * c.shard, compute_bytes);
  const int64_t block_gathered = Held(block_shard * c.shard, compute_bytes);
  m.gathered = 2 * root_gathered + std::min<int64_t>(3, shape.layers + 1) * block_gathered;
  m.comm = c.shard > 1 ? Held(block_shard, 4) : 0;
  return m;
}

}  // namespace

MemoryPrediction PredictMemory(const api::ModelShape& shape, int seq, const LayoutChoice& choice, int compute_bytes) {
  MemoryPrediction most;
  for (int t = 0; t < choice.tp; ++t) {
    const MemoryPrediction m = PredictRank(shape, seq, choice, compute_bytes, t);
    if (m.total() > most.total()) most = m;
  }
  return most;
}

}  // namespace meshtrain::scheduler
