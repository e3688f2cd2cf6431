#include "operator/scheduler/step_model.h"

#include <algorithm>
#include <vector>

#include "api/model_family.h"

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

// Durations of one block's operations for this rank, for one micro-step.
struct BlockTimes {
  double forward = 0, backward = 0, recompute = 0;  // math
  double tp_forward = 0, tp_backward = 0;  // TP collectives inside them
  double cp_forward = 0, cp_backward = 0;  // its exchanges across its context group, inside them
  double ep_forward = 0, ep_backward = 0;  // its all-to-alls across its expert group, inside them
  double gather = 0, reduce = 0, replica = 0;  // its unit's
};

// Durations of one micro-step's operations for this rank.
struct Durations {
  // A block's: the model's one kind, or a mixture's sparse blocks (those that hold
  // experts); and a mixture's dense blocks (ModelShape::DenseBlock), all 0 where it has none.
  BlockTimes block, dense;
  double head_forward = 0, head_backward = 0, tp_head = 0;  // math, and the head's TP collectives
  // The embedding unit's and an untied head's (0 when the head is tied).
  double gather_embedding = 0, gather_head = 0;
  double reduce_embedding = 0, reduce_head = 0;
  double replica_embedding = 0, replica_head = 0;
  double copy_input = 0;  // one block input, one way
  const BlockTimes& Of(const api::ModelShape& s, int64_t layer) const { return s.DenseBlock(layer) ? dense : block; }
};

// The weights of block `layer`'s products that tensor parallelism keeps whole on every TP
// rank (api::BlockProduct's kReplicated: a mixture's router); 0 for a dense block.
double WholeBlockWeights(const api::ModelShape& s, int64_t layer) {
  double whole = 0;
  for (const api::BlockProduct& p : api::BlockProducts(s, layer)) {
    if (p.split == api::TpSplit::kReplicated) whole += double(p.k) * double(p.n);
  }
  return whole;
}

// The bytes a mixture's permute and combine move through memory per block forward for
// `tokens` rows of `bytes`-wide elements: 2 x (1 + k) x tokens x C.
double RoutingBytes(const api::ModelShape& s, double tokens, int bytes) {
  return 2 * (1 + double(s.experts_per_token)) * tokens * double(s.hidden) * bytes;
}

Durations DurationsOf(const api::ModelShape& s, int seq, const LayoutChoice& c, const api::ParallelLayout& mesh,
                      const Cluster& cluster, const DeviceModel& device) {
  // This rank's tokens: seq / context rows of each sequence.
  const double tokens = double(c.micro_batch) * seq / c.context, C = double(s.hidden), T = c.tp;
  const double rate = device.FlopsFor(c.micro_batch);
  auto axis = [&](api::Axis a, Collective op, double bytes) {
    return AxisSeconds(a, op, bytes, mesh, cluster.node_paths, cluster.links);
  };
  const double activation = tokens * C * device.compute_bytes;
  // The math of block `layer`, and of every block of its kind; `experts`: the kind holds
  // experts (a mixture's sparse blocks).
  auto math = [&](int64_t layer, bool experts, BlockTimes& b) {
    // Matrix FLOPs of a forward per token, as 6N + 12LTQ counts them: 2 per weight and
    // 4 x seq x the query width for attention per layer; a backward is twice its forward.
    // A context rank's rows attend the whole sequence, its chunks balanced: 1/C of the work.
    b.forward = tokens * api::BlockForwardFlopsPerToken(s, seq, c.tp, layer) / rate;
    // That splits every product by T; a block's whole weights (a mixture's router,
    // worker/model/moe_block.h) every TP rank multiplies in full, by all its tokens. Each
    // expert's slice (I / T of its units) is split like the dense MLP.
    if (c.tp > 1) b.forward += tokens * 2 * WholeBlockWeights(s, layer) * (1 - 1 / T) / rate;
    if (device.float8 && device.float8_ratio > 0) {  // the linear layers' share at the float8 rate
      const double cast = tokens * api::BlockFloat8FlopsPerToken(s, c.tp, layer);
      b.forward -= cast / rate - cast / (rate * device.float8_ratio);
    }
    // A mixture's routing moves each token's row through memory on every TP rank, whatever
    // T: the permute into expert order reads (tokens, C) and writes its k copies, and the
    // combine reads the k expert outputs and writes (tokens, C).
    if (experts && device.memory_bytes_per_second > 0) {
      b.forward += RoutingBytes(s, tokens, device.compute_bytes) / device.memory_bytes_per_second;
    }
    b.backward = 2 * b.forward;
    b.recompute = device.recompute_factor * b.forward;
    // Two all-reduces of the (tokens, C) activations in each block's forward and in its
    // backward.
    b.tp_forward = 2 * axis(api::Axis::kTensor, Collective::kAllReduce, activation);
    b.tp_backward = b.tp_forward;
    // A mixture's backward also adds the routing weights' gradients over the TP group (each
    // rank's are from its slice of the experts): an all-gather of tokens x k fp32 a rank.
    if (experts) {
      b.tp_backward += axis(api::Axis::kTensor, Collective::kAllGather, tokens * double(s.experts_per_token) * 4 * T);
    }
  };
  const bool mixed = s.DenseBlocks() > 0;
  Durations d;
  math(api::FirstBlockOfKind(s, false), s.experts > 0, d.block);
  if (mixed) math(api::FirstBlockOfKind(s, true), false, d.dense);
  d.head_forward = tokens * 2 * double(s.vocab_size) * C / T / rate;
  d.head_backward = 2 * d.head_forward;
  // The vocabulary-parallel embedding sums its output, the head its statistics.
  d.tp_head = axis(api::Axis::kTensor, Collective::kAllReduce, activation) +
              axis(api::Axis::kTensor, Collective::kAllGather, tokens * 3 * 4 * T);
  // Attention's exchanges across the context group run on the compute stream: every
  // block's alike.
  const ContextTraffic context = ContextTrafficOf(s, c.micro_batch, seq, c.tp, c.context,
                                                  c.context_mode == "AllToAll", device.compute_bytes);
  if (c.context > 1) {
    auto exchanges = [&](const std::vector<Exchange>& each, const std::vector<int>& group) {
      double seconds = 0;
      for (const Exchange& e : each) seconds += ExchangeSeconds(e, group, mesh, cluster.node_paths, cluster.links);
      return seconds;
    };
    for (const std::vector<int>& group : mesh.Groups(api::Axis::kContext)) {
      const double forward = exchanges(context.forward, group), backward = exchanges(context.backward, group);
      d.block.cp_forward = std::max(d.block.cp_forward, forward);
      d.block.cp_backward = std::max(d.block.cp_backward, backward);
    }
    if (mixed) {
      d.dense.cp_forward = d.block.cp_forward;
      d.dense.cp_backward = d.block.cp_backward;
    }
  }
  // A mixture's all-to-alls across the expert group (its tokens' copies to their experts'
  // ranks and back, forward and backward) run on the compute stream, in its sparse blocks
  // only.
  const ExpertTraffic experts = ExpertTrafficOf(s, c.micro_batch, seq / c.context, c.expert, device.compute_bytes);
  if (c.expert > 1) {
    for (const std::vector<int>& group : mesh.Groups(api::Axis::kExpert)) {
      auto seconds = [&](const std::vector<Exchange>& each) {
        double sum = 0;
        for (const Exchange& e : each) sum += ExchangeSeconds(e, group, mesh, cluster.node_paths, cluster.links);
        return sum;
      };
      d.block.ep_forward = std::max(d.block.ep_forward, seconds(experts.forward));
      d.block.ep_backward = std::max(d.block.ep_backward, seconds(experts.backward));
    }
  }
  // FSDP shards over S x C ranks; a block whose experts EP splits (E/EP of them on a rank)
  // over the S x C / EP ranks holding the same experts. A mixture's dense block holds no
  // experts: over all S x C ranks.
  const int shard = c.shard * c.context;
  const api::UnitElements units = api::UnitElementsOf(s, c.tp - 1, c.tp, api::kVocabMultiple, c.expert);
  const int block_shards = api::BlockShards(units, shard, c.expert);
  const api::Axis block_axis = block_shards != shard ? api::Axis::kExpertShard : api::Axis::kShard;
  auto unsharded = [&](int64_t elements) { return double(api::ShardElements(elements, shard)) * shard; };
  const double embedding = unsharded(units.embedding);
  const double block = double(api::ShardElements(units.block, block_shards)) * block_shards;
  const double head = units.head > 0 ? unsharded(units.head) : 0;
  d.gather_embedding = axis(api::Axis::kShard, Collective::kAllGather, embedding * device.compute_bytes);
  d.block.gather = axis(block_axis, Collective::kAllGather, block * device.compute_bytes);
  d.reduce_embedding = axis(api::Axis::kShard, Collective::kReduceScatter, embedding * 4);
  d.block.reduce = axis(block_axis, Collective::kReduceScatter, block * 4);
  if (block_shards != shard) {
    // The shard's part before the experts (every expert group member's alike) is summed
    // over the expert group: the first expert-shard rank's holds the most of it.
    const double alike = std::min(block / block_shards, double(units.block_shared()));
    d.block.reduce += axis(api::Axis::kExpert, Collective::kAllReduce, alike * 4);
  }
  d.replica_embedding = axis(api::Axis::kReplica, Collective::kAllReduce, embedding / shard * 4);
  d.block.replica = axis(api::Axis::kReplica, Collective::kAllReduce, block / block_shards * 4);
  if (mixed) {
    const double dense = unsharded(units.dense_block);
    d.dense.gather = axis(api::Axis::kShard, Collective::kAllGather, dense * device.compute_bytes);
    d.dense.reduce = axis(api::Axis::kShard, Collective::kReduceScatter, dense * 4);
    d.dense.replica = axis(api::Axis::kReplica, Collective::kAllReduce, dense / shard * 4);
  }
  if (head > 0) {
    d.gather_head = axis(api::Axis::kShard, Collective::kAllGather, head * device.compute_bytes);
    d.reduce_head = axis(api::Axis::kShard, Collective::kReduceScatter, head * 4);
    d.replica_head = axis(api::Axis::kReplica, Collective::kAllReduce, head / shard * 4);
  }
  if (device.copy_bytes_per_second > 0) d.copy_input = activation / device.copy_bytes_per_second;
  return d;
}

// The durations of a chunk of blocks that holds, or not, the embedding's unit and the head
// (api::StageShape): what it does not hold takes no time.
Durations ChunkDurations(Durations d, bool embedding_unit, bool head) {
  if (!embedding_unit) d.gather_embedding = d.reduce_embedding = d.replica_embedding = 0;
  if (!head) {
    d.head_forward = d.head_backward = d.tp_head = 0;
    d.gather_head = d.reduce_head = d.replica_head = 0;
  }
  return d;
}

// The engine's three streams; Forward and Backward each start with them drained (at 0)
// and return when they drain again.
struct Streams {
  Stream compute, comm, copy;
  void Start() { compute.free = comm.free = copy.free = 0; }
  double Drain() const { return std::max({compute.free, comm.free, copy.free}); }
};

// One training forward (the last block kept for the backward), from drained streams, of a
// chunk of blocks of durations `blocks` (each its kind's); an untied head's unit is
// gathered while the last block computes, and its gradients reduce-scattered right after
// the head.
double Forward(const std::vector<const BlockTimes*>& blocks, const LayoutChoice& c, const Durations& d, bool last,
               Streams& s) {
  const int L = int(blocks.size());
  const int slots = api::ActivationStoreBytes({.layers = L}, 1, 1, c.activations, 0, 1, {}, false).inputs;
  const bool offload = c.activations.offload;
  std::vector<double> freed(size_t(L), 0), offloaded(size_t(L), 0);
  s.Start();
  const double embedding = s.comm.Run(0, d.gather_embedding);
  std::vector<double> gathered(size_t(L), 0);
  gathered[0] = s.comm.Run(0, blocks[0]->gather);
  s.compute.Run(embedding, 0);  // the embedding
  double head = 0;
  for (int l = 0; l < L; ++l) {
    const BlockTimes& b = *blocks[size_t(l)];
    if (l + 1 < L) gathered[size_t(l) + 1] = s.comm.Run(l >= 1 ? freed[size_t(l) - 1] : 0, blocks[size_t(l) + 1]->gather);
    if (l + 1 == L && d.gather_head > 0) head = s.comm.Run(0, d.gather_head);
    double ready = gathered[size_t(l)];
    // Block l writes input l+1 over input l+1-n, which must have reached the host first.
    if (offload && l + 1 < L && l + 1 >= slots) ready = std::max(ready, offloaded[size_t(l + 1 - slots)]);
    freed[size_t(l)] = s.compute.Run(ready, b.forward + b.tp_forward + b.cp_forward + b.ep_forward);
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
double Backward(const std::vector<const BlockTimes*>& blocks, const LayoutChoice& c, const Durations& d, bool last,
                Streams& s) {
  const int L = int(blocks.size());
  const int slots = api::ActivationStoreBytes({.layers = L}, 1, 1, c.activations, 0, 1, {}, false).inputs;
  const bool offload = c.activations.offload;
  std::vector<double> gathered(size_t(L), 0), done(size_t(L) + 1, 0), loaded(size_t(L), 0);
  s.Start();
  gathered[size_t(L) - 1] = s.comm.Run(0, blocks[size_t(L) - 1]->gather);
  int next_load = L - slots - 1;  // the last n inputs never left their slots
  for (int l = L - 1; l >= 0; --l) {
    const BlockTimes& b = *blocks[size_t(l)];
    const double recompute = c.activations.checkpointing ? b.recompute + b.tp_forward + b.cp_forward + b.ep_forward : 0;
    if (l > 0) gathered[size_t(l) - 1] = s.comm.Run(l + 1 < L ? done[size_t(l) + 1] : 0, blocks[size_t(l) - 1]->gather);
    double ready = gathered[size_t(l)];
    if (offload) {
      // Input j goes into the slot block j+n used, once block j+n's backward has ended.
      for (; next_load >= 0 && next_load >= l - c.activations.horizon; --next_load) {
        loaded[size_t(next_load)] = s.copy.Run(done[size_t(next_load + slots)], d.copy_input);
      }
      if (l < L - slots) ready = std::max(ready, loaded[size_t(l)]);
    }
    done[size_t(l)] = s.compute.Run(ready, recompute + b.backward + b.tp_backward + b.cp_backward + b.ep_backward);
    const double reduced = s.comm.Run(done[size_t(l)], b.reduce);
    if (last) s.comm.Run(reduced, b.replica);
  }
  const double reduced = s.comm.Run(s.compute.free, d.reduce_embedding);
  if (last) s.comm.Run(reduced, d.replica_embedding);
  return s.Drain();
}

}  // namespace

StepPrediction PredictStep(const api::ModelShape& shape, int seq, int64_t global_batch_tokens,
                           const LayoutChoice& choice, const Cluster& cluster, const DeviceModel& device) {
  const api::Pipeline& pipeline = choice.pipeline;
  const int P = pipeline.stages, V = pipeline.virtual_stages, C = pipeline.chunks();
  const api::ParallelLayout mesh(cluster.nodes, cluster.gpus_per_node, choice.tp, choice.shard, P, choice.context,
                                 choice.expert);
  const int shard = mesh.shard();  // S x C
  StepPrediction p;
  p.micro_steps = std::max<int64_t>(1, global_batch_tokens / (int64_t(choice.micro_batch) * seq * mesh.data_parallel()));
  const std::vector<int> first = api::SplitBlocks(shape, seq, C);
  const api::UnitElements units =
      api::UnitElementsOf(shape, choice.tp - 1, choice.tp, api::kVocabMultiple, choice.expert);
  const int block_shards = api::BlockShards(units, shard, choice.expert);
  const bool recompute = choice.activations.checkpointing;
  // Every stage's groups are alike: one set of durations, less what a chunk does not hold.
  const Durations model = DurationsOf(shape, seq, choice, mesh, cluster, device);
  const ExpertTraffic experts =
      ExpertTrafficOf(shape, choice.micro_batch, seq / choice.context, choice.expert, device.compute_bytes);

  // Per stage: a micro-batch's forward and backward through each of its chunks, every
  // micro-batch but the last alike, the last adding the replica all-reduces.
  struct StageTimes {
    double micro = 0, final_micro = 0, update = 0, compute = 0, tp = 0, context = 0, expert = 0, comm = 0,
           final_comm = 0;
    double expert_bytes = 0;  // sent by the stage's all-to-alls, per micro-batch
  };
  std::vector<StageTimes> stages(static_cast<size_t>(P));
  for (int stage = 0; stage < P; ++stage) {
    StageTimes& t = stages[size_t(stage)];
    double elements = 0;  // of the stage's shards
    for (int chunk : api::ChunksOf(pipeline, stage)) {
      const int begin = first[size_t(chunk)], end = first[size_t(chunk) + 1];
      // The chunk's blocks, each of its kind: a mixture's sparse blocks and its dense ones
      // (none without), `sparse` and `dense` of them.
      std::vector<const BlockTimes*> blocks;
      for (int l = begin; l < end; ++l) blocks.push_back(&model.Of(shape, l));
      const double dense = double(shape.DenseBlocks(begin, end)), sparse = double(end - begin) - dense;
      auto per_kind = [&](auto f) { return sparse * f(model.block) + dense * f(model.dense); };
      const bool embedding = chunk == 0 || (chunk == C - 1 && shape.tied), head = chunk == C - 1;
      const Durations d = ChunkDurations(model, embedding, head);
      Streams alike, last;
      t.micro += Forward(blocks, choice, d, false, alike) + Backward(blocks, choice, d, false, alike);
      t.final_micro += Forward(blocks, choice, d, true, last) + Backward(blocks, choice, d, true, last);
      t.comm += alike.comm.busy;
      t.final_comm += last.comm.busy;
      t.compute += per_kind([&](const BlockTimes& b) {
                     return b.forward + b.backward + (recompute ? b.recompute : 0);
                   }) +
                   d.head_forward + d.head_backward;
      t.tp += per_kind([&](const BlockTimes& b) { return b.tp_forward * (recompute ? 2 : 1) + b.tp_backward; }) +
              2 * d.tp_head;
      t.context += per_kind([&](const BlockTimes& b) { return b.cp_forward * (recompute ? 2 : 1) + b.cp_backward; });
      t.expert += per_kind([&](const BlockTimes& b) { return b.ep_forward * (recompute ? 2 : 1) + b.ep_backward; });
      // Only a mixture's sparse blocks send their tokens to experts.
      t.expert_bytes += sparse * (experts.forward_sent * (recompute ? 2 : 1) + experts.backward_sent);
      // A sparse block's shard (the one kind's without dense blocks), over its BlockShards;
      // a dense block's over all S x C ranks.
      elements += sparse * double(api::ShardElements(units.block, block_shards)) +
                  dense * double(api::ShardElements(units.dense_block, shard));
      if (embedding) elements += double(api::ShardElements(units.embedding, shard));
      if (head) elements += double(api::ShardElements(units.head, shard));
    }
    // AdamW reads the master weights, gradients, m and v and writes three of them: 28 bytes.
    if (device.memory_bytes_per_second > 0) t.update = elements * 28 / device.memory_bytes_per_second;
  }
  // The slowest stage sets the pace: the others wait on it.
  size_t slowest = 0;
  for (size_t i = 1; i < stages.size(); ++i) {
    if (stages[i].micro > stages[slowest].micro) slowest = i;
  }
  const StageTimes& pace = stages[slowest];
  double final_extra = 0, update = 0;
  for (const StageTimes& t : stages) {
    final_extra = std::max(final_extra, t.final_micro - t.micro);
    update = std::max(update, t.update);
  }
  const double M = double(p.micro_steps);

  // Point-to-point: each micro-batch's activations leave every chunk but the last, and
  // their gradients every chunk but the first, one message of micro-batch x seq x hidden
  // each, from a rank to its peer in the neighbouring stage.
  double micro = pace.micro, fill = 0;
  if (P > 1) {
    const double message =
        double(choice.micro_batch) * seq / choice.context * double(shape.hidden) * device.compute_bytes;
    // The slowest peer pair of each link from stage q to the next (q + 1 mod P).
    std::vector<double> hop(static_cast<size_t>(P), 0.0);
    for (int q = 0; q < P; ++q) {
      for (int i = 0; i < mesh.stage_ranks(); ++i) {
        const int from = q * mesh.stage_ranks() + i, to = (q + 1) % P * mesh.stage_ranks() + i;
        hop[size_t(q)] = std::max(hop[size_t(q)], PointToPointSeconds(message, from, to, mesh, cluster.node_paths,
                                                                      cluster.links));
      }
    }
    // A stage's sends per micro-batch; they overlap its compute, and a stage whose sends
    // outlast it paces the pipeline at their time.
    int64_t most_messages = 0;
    for (int stage = 0; stage < P; ++stage) {
      double sends = 0;
      int64_t messages = 0;
      for (int chunk : api::ChunksOf(pipeline, stage)) {
        if (chunk + 1 < C) sends += hop[size_t(stage)], ++messages;                  // activations forward
        if (chunk > 0) sends += hop[size_t(stage + P - 1) % size_t(P)], ++messages;  // gradients back
      }
      micro = std::max(micro, sends);
      most_messages = std::max(most_messages, messages);
    }
    // While the pipeline fills, the first micro-batch's activations cross each of the
    // P - 1 links before the last stage can start; while it drains, the last one's
    // gradients cross them back.
    for (int q = 0; q + 1 < P; ++q) fill += 2 * hop[size_t(q)];
    // A tied head: the last stage's copy of the embedding sums its gradients with the
    // first stage's once a step, after the drain.
    if (shape.tied) {
      const double bytes = 4.0 * double(api::ShardElements(units.embedding, shard));
      double slowest_pair = 0;
      for (int i = 0; i < mesh.stage_ranks(); ++i) {
        slowest_pair = std::max(slowest_pair, CollectiveSeconds(Collective::kAllReduce, bytes,
                                                                {i, (P - 1) * mesh.stage_ranks() + i}, mesh,
                                                                cluster.node_paths, cluster.links));
      }
      fill += slowest_pair;
    }
    p.p2p_bytes = int64_t(M * double(most_messages) * message);
    p.bubble = api::BubbleFraction(pipeline, int(p.micro_steps));
  }
  // A step: M micro-batches on each of V chunks, and the fill and drain of P - 1 chunks'
  // time, the schedule's bubble (P - 1) / (V x M + P - 1) (api::BubbleFraction).
  const double steady = M * pace.micro;
  p.seconds = micro * (V * M + P - 1) / V + final_extra + update + fill;
  p.p2p_seconds = (micro - pace.micro) * (V * M + P - 1) / V + fill;
  p.bubble_seconds = P > 1 ? pace.micro * (V * M + P - 1) / V - steady : 0;
  p.update_seconds = update;
  p.compute_seconds = M * pace.compute;
  p.tp_seconds = M * pace.tp;
  p.context_seconds = M * pace.context;
  p.expert_seconds = M * pace.expert;
  p.expert_bytes = int64_t(M * pace.expert_bytes);
  p.comm_seconds = (M - 1) * pace.comm + pace.final_comm;
  p.exposed_seconds =
      std::max(0.0, p.seconds - p.compute_seconds - p.tp_seconds - p.context_seconds - p.expert_seconds -
                        p.update_seconds);
  p.stage = int(slowest);
  p.tokens_per_second = double(global_batch_tokens) / p.seconds;
  return p;
}

}  // namespace meshtrain::scheduler
