#include "operator/scheduler/step_model.h"

#include <algorithm>
#include <vector>

namespace meshtrain::scheduler {

double DeviceModel::FlopsFor(int micro_batch) const {
  const auto it = matrix_flops_by_micro_batch.find(micro_batch);
  return it != matrix_flops_by_micro_batch.end() ? it->second : matrix_flops;
}

namespace {

// A stream of the engine: operations run in the order they are enqueued, each once the
// stream is free and what it waits for has ended.
struct Stream {
  double free = 0;
  double busy = 0;
  double Run(double ready, double seconds) {
    free = std::max(free, ready) + seconds;
    busy += seconds;
    return free;
  }
};

// Durations of one micro-step's operations for this rank.
struct Durations {
  double block_forward = 0, block_backward = 0, block_recompute = 0, head_forward = 0, head_backward = 0;  // math
  double tp_forward = 0, tp_backward = 0, tp_head = 0;  // TP collectives inside them
  // The embedding unit's, a block's and an untied head's (0 when the head is tied).
  double gather_embedding = 0, gather_block = 0, gather_head = 0;
  double reduce_embedding = 0, reduce_block = 0, reduce_head = 0;
  double replica_embedding = 0, replica_block = 0, replica_head = 0;
  double copy_input = 0;  // one block input, one way
};

Durations DurationsOf(const api::ModelShape& s, int seq, const LayoutChoice& c, const api::ParallelLayout& mesh,
                      const Cluster& cluster, const DeviceModel& device) {
  const double tokens = double(c.micro_batch) * seq, C = double(s.hidden), T = c.tp;
  const double rate = device.FlopsFor(c.micro_batch);
  Durations d;
  // Matrix FLOPs of a forward per token, as 6N + 12LTQ counts them: 2 per weight and
  // 4 x seq x the query width for attention per layer; a backward is twice its forward.
  d.block_forward = tokens * api::BlockForwardFlopsPerToken(s, seq, c.tp) / rate;
  d.block_backward = 2 * d.block_forward;
  d.block_recompute = device.recompute_factor * d.block_forward;
  d.head_forward = tokens * 2 * double(s.vocab_size) * C / T / rate;
  d.head_backward = 2 * d.head_forward;
  auto axis = [&](api::Axis a, Collective op, double bytes) {
    return AxisSeconds(a, op, bytes, mesh, cluster.node_paths, cluster.links);
  };
  // Two all-reduces of the (tokens, C) activations in each block's forward and in its
  // backward; the vocabulary-parallel embedding sums its output, the head its statistics.
  const double activation = tokens * C * device.compute_bytes;
  d.tp_forward = 2 * axis(api::Axis::kTensor, Collective::kAllReduce, activation);
  d.tp_backward = d.tp_forward;
  d.tp_head = axis(api::Axis::kTensor, Collective::kAllReduce, activation) +
              axis(api::Axis::kTensor, Collective::kAllGather, tokens * 3 * 4 * T);
  const api::UnitElements units = api::UnitElementsOf(s, c.tp - 1, c.tp);
  auto unsharded = [&](int64_t elements) { return double(api::ShardElements(elements, c.shard)) * c.shard; };
  const double embedding = unsharded(units.embedding), block = unsharded(units.block);
  const double head = units.head > 0 ? unsharded(units.head) : 0;
  d.gather_embedding = axis(api::Axis::kShard, Collective::kAllGather, embedding * device.compute_bytes);
  d.gather_block = axis(api::Axis::kShard, Collective::kAllGather, block * device.compute_bytes);
  d.reduce_embedding = axis(api::Axis::kShard, Collective::kReduceScatter, embedding * 4);
  d.reduce_block = axis(api::Axis::kShard, Collective::kReduceScatter, block * 4);
  d.replica_embedding = axis(api::Axis::kReplica, Collective::kAllReduce, embedding / c.shard * 4);
  d.replica_block = axis(api::Axis::kReplica, Collective::kAllReduce, block / c.shard * 4);
  if (head > 0) {
    d.gather_head = axis(api::Axis::kShard, Collective::kAllGather, head * device.compute_bytes);
    d.reduce_head = axis(api::Axis::kShard, Collective::kReduceScatter, head * 4);
    d.replica_head = axis(api::Axis::kReplica, Collective::kAllReduce, head / c.shard * 4);
  }
  if (device.copy_bytes_per_second > 0) d.copy_input = activation / device.copy_bytes_per_second;
  return d;
}

// The engine's three streams; Forward and Backward each start with them drained (at 0)
// and return when they drain again.
struct Streams {
  Stream compute, comm, copy;
  void Start() { compute.free = comm.free = copy.free = 0; }
  double Drain() const { return std::max({compute.free, comm.free, copy.free}); }
};

// One training forward (the last block kept for the backward), from drained streams; an
// untied head's unit is gathered while the last block computes, and its gradients
// reduce-scattered right after the head.
double Forward(int L, const LayoutChoice& c, const Durations& d, bool last, Streams& s) {
  const int slots = api::ActivationStoreBytes({.layers = L}, 1, 1, c.activations, 0, 1, {}, false).inputs;
  const bool offload = c.activations.offload;
  std::vector<double> freed(size_t(L), 0), offloaded(size_t(L), 0);
  s.Start();
  const double embedding = s.comm.Run(0, d.gather_embedding);
  std::vector<double> gathered(size_t(L), 0);
  gathered[0] = s.comm.Run(0, d.gather_block);
  s.compute.Run(embedding, 0);  // the embedding
  double head = 0;
  for (int l = 0; l < L; ++l) {
    if (l + 1 < L) gathered[size_t(l) + 1] = s.comm.Run(l >= 1 ? freed[size_t(l) - 1] : 0, d.gather_block);
    if (l + 1 == L && d.gather_head > 0) head = s.comm.Run(0, d.gather_head);
    double ready = gathered[size_t(l)];
    // Block l writes input l+1 over input l+1-n, which must have reached the host first.
    if (offload && l + 1 < L && l + 1 >= slots) ready = std::max(ready, offloaded[size_t(l + 1 - slots)]);
    freed[size_t(l)] = s.compute.Run(ready, d.block_forward + d.tp_forward);
    if (offload && l < L - slots) offloaded[size_t(l)] = s.copy.Run(freed[size_t(l)], d.copy_input);
  }
  // The head computes its backward as each chunk of logits is made (the fused classifier).
  const double computed = s.compute.Run(head, d.head_forward + d.head_backward + 2 * d.tp_head);
  if (d.reduce_head > 0) {
    const double reduced = s.comm.Run(computed, d.reduce_head);
    if (last) s.comm.Run(reduced, d.replica_head);
  }
  return s.Drain();
}

// One backward; with `last`, each unit's replica all-reduce follows its reduce-scatter.
double Backward(int L, const LayoutChoice& c, const Durations& d, bool last, Streams& s) {
  const int slots = api::ActivationStoreBytes({.layers = L}, 1, 1, c.activations, 0, 1, {}, false).inputs;
  const bool offload = c.activations.offload;
  const double recompute = c.activations.checkpointing ? d.block_recompute + d.tp_forward : 0;
  std::vector<double> gathered(size_t(L), 0), done(size_t(L) + 1, 0), loaded(size_t(L), 0);
  s.Start();
  gathered[size_t(L) - 1] = s.comm.Run(0, d.gather_block);
  int next_load = L - slots - 1;  // the last n inputs never left their slots
  for (int l = L - 1; l >= 0; --l) {
    if (l > 0) gathered[size_t(l) - 1] = s.comm.Run(l + 1 < L ? done[size_t(l) + 1] : 0, d.gather_block);
    double ready = gathered[size_t(l)];
    if (offload) {
      // Input j goes into the slot block j+n used, once block j+n's backward has ended.
      for (; next_load >= 0 && next_load >= l - c.activations.horizon; --next_load) {
        loaded[size_t(next_load)] = s.copy.Run(done[size_t(next_load + slots)], d.copy_input);
      }
      if (l < L - slots) ready = std::max(ready, loaded[size_t(l)]);
    }
    done[size_t(l)] = s.compute.Run(ready, recompute + d.block_backward + d.tp_backward);
    const double reduced = s.comm.Run(done[size_t(l)], d.reduce_block);
    if (last) s.comm.Run(reduced, d.replica_block);
  }
  const double reduced = s.comm.Run(s.compute.free, d.reduce_embedding);
  if (last) s.comm.Run(reduced, d.replica_embedding);
  return s.Drain();
}

}  // namespace

StepPrediction PredictStep(const api::ModelShape& shape, int seq, int64_t global_batch_tokens,
                           const LayoutChoice& choice, const Cluster& cluster, const DeviceModel& device) {
  const api::ParallelLayout mesh(cluster.nodes, cluster.gpus_per_node, choice.tp, choice.shard);
  const Durations d = DurationsOf(shape, seq, choice, mesh, cluster, device);
  const int L = int(shape.layers);
  StepPrediction p;
  p.micro_steps = std::max<int64_t>(1, global_batch_tokens / (int64_t(choice.micro_batch) * seq * mesh.data_parallel()));
  // Every micro-step but the last is alike; the last adds the replica all-reduces.
  Streams alike, last;
  const double micro = Forward(L, choice, d, false, alike) + Backward(L, choice, d, false, alike);
  const double final_micro = Forward(L, choice, d, true, last) + Backward(L, choice, d, true, last);
  const api::UnitElements units = api::UnitElementsOf(shape, choice.tp - 1, choice.tp);
  const double shard = double(api::ShardElements(units.embedding, choice.shard) +
                              shape.layers * api::ShardElements(units.block, choice.shard) +
                              api::ShardElements(units.head, choice.shard));
  // AdamW reads the master weights, gradients, m and v and writes three of them: 28 bytes.
  if (device.memory_bytes_per_second > 0) p.update_seconds = shard * 28 / device.memory_bytes_per_second;
  const double others = double(p.micro_steps - 1);
  p.seconds = others * micro + final_micro + p.update_seconds;
  p.compute_seconds = double(p.micro_steps) * (double(L) * (d.block_forward + d.block_backward +
                                                            (choice.activations.checkpointing ? d.block_recompute : 0)) +
                                               d.head_forward + d.head_backward);
  p.tp_seconds = double(p.micro_steps) *
                 (double(L) * (d.tp_forward * (choice.activations.checkpointing ? 2 : 1) + d.tp_backward) + 2 * d.tp_head);
  p.comm_seconds = others * alike.comm.busy + last.comm.busy;
  p.exposed_seconds = std::max(0.0, p.seconds - p.compute_seconds - p.tp_seconds - p.update_seconds);
  p.tokens_per_second = double(global_batch_tokens) / p.seconds;
  return p;
}

}  // namespace meshtrain::scheduler
