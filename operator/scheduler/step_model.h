// The step-time model of the planner: one optimizer step of the sharded engine for a
// layout choice on placed nodes, by replaying the engine's schedule (parallel/engine.h)
// over three streams with modelled durations:
//   compute  each block's forward, recompute and backward: FLOPs over the device's
//            measured matrix rate, plus the layer's TP all-reduces and, with C context
//            ranks, attention's exchanges across the context group (ContextTrafficOf;
//            both block the stream). A context rank computes seq / C rows of each
//            sequence, and 1/C of its attention (its chunks are balanced); with EP
//            expert ranks, each mixture-of-experts block's all-to-alls across the expert
//            group (ExpertTrafficOf: two forward, two backward, redone on recompute). An
//            expert rank computes as many expert rows as without EP (routing taken as
//            even: EP x N x k / EP), so its FLOPs do not change. With T TP ranks a
//            mixture's experts are split as the dense MLP is (I / T units of each, their
//            FLOPs over T, the output all-reduced over the TP group as the MLP's is), but
//            every TP rank routes the same tokens: the router's product (2 x E x C FLOPs a
//            token) is whole on each, the all-to-alls carry each rank's k copies of its
//            tokens C wide (T divides neither), and the backward adds an all-gather of the
//            routing weights' gradients (tokens x k fp32) over the TP group
//   comm     gathers (two slots: block l+1's waits until block l-1 is freed), each unit's
//            reduce-scatter after its backward, and on the last micro-batch its replica
//            all-reduce, in the order the engine enqueues them; with EP, a block's over the
//            S x C / EP ranks holding the same experts, its shared part's gradients then
//            summed over the expert group
//   copy     offloaded block inputs out after their forward, back H blocks ahead
// A mixture of experts with dense blocks among its sparse ones (api::ModelShape::DenseBlock,
// Qwen3-MoE's decoder_sparse_step and mlp_only_layers) replays each block with its own
// kind's durations: a dense block computes the dense MLP's FLOPs and has no router, no
// routing, no all-to-alls and no routing weights to all-gather, and its unit
// (api::UnitElements::dense_block) is gathered and reduce-scattered over all S x C ranks
// (EP never splits it); a sparse block's as above.
// Forward and backward each end when all three streams drain, as the engine's do.
// Collective times come from cost_model.h, per group and link tier.
//
// With P pipeline stages (api/pipeline.h) each stage replays the same for its chunks of
// blocks (api::SplitBlocks; the embedding's unit on the first chunk, the head on the last),
// its collectives within its own groups. With M micro-batches, V chunks a stage and t the
// slowest stage's time for one micro-batch through all its chunks, a step takes
//   t x (V x M + P - 1) / V
// (the schedule's bubble, api::BubbleFraction, is (P - 1) / (V x M + P - 1) of that), plus
// the last micro-batch's replica all-reduces, the update, and the point-to-point time the
// step waits for: each micro-batch's activations (micro-batch x seq / C x hidden elements) go
// forward and their gradients back across every link between neighbouring chunks, one
// message per rank to its peer, over the link between their nodes. Those overlap compute,
// except while the pipeline fills and drains (the first micro-batch's activations and the
// last one's gradients crossing the P - 1 links) and where a stage's sends for a
// micro-batch outlast its compute (t is then their time). A tied head's second copy of the
// embedding sums its gradients with the first stage's after the drain.
// Thread-safety: pure functions.

#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "api/layout.h"
#include "api/model_shape.h"
#include "operator/scheduler/cost_model.h"
#include "operator/scheduler/memory_model.h"

namespace meshtrain::scheduler {

// What the planner knows of one rank's device.
struct DeviceModel {
  std::string name;              // "H100 80GB HBM3 (p5.48xlarge)", "cpu"
  int64_t memory_bytes = 0;      // per rank
  double margin = 0.1;           // the share of memory kept free (allocator, runtime, fragmentation)
  bool memory_is_host = false;   // the CPU: the offload pool counts against the same memory
  int compute_bytes = 2;         // gathered parameters and activations: 4 (fp32) or 2 (bf16)
  double matrix_flops = 0;       // FLOP/s one rank's training kernels reach (measured)
  std::map<int, double> matrix_flops_by_micro_batch;  // measured per micro-batch, where known
  // A recomputed block forward (activation checkpointing) over the block forward's FLOP
  // time: 1 where matrix products dominate; measured where elementwise kernels weigh more.
  double recompute_factor = 1;
  double copy_bytes_per_second = 0;    // offload copies between device and host
  double memory_bytes_per_second = 0;  // the optimizer's streaming update
  // The dense float8 peak over the bf16 one (2 on Hopper); 0: the device has no float8
  // products (an A100 refuses them; the CPU emulates them, at about its matrix rate).
  double float8_ratio = 0;
  // The job multiplies its blocks' linear layers in float8 (AsJobUsesIt): those products
  // run at float8_ratio x the matrix rate. float8_rowwise: by torchao's rowwise recipe,
  // whose scales the memory model counts per row.
  bool float8 = false;
  bool float8_rowwise = false;

  double FlopsFor(int micro_batch) const;
  // The memory a layout may use: memory_bytes less the margin.
  int64_t Usable() const { return int64_t(double(memory_bytes) * (1 - margin)); }
};

// Where a job runs: its mesh (nodes x GPUs per node), node topology paths and links.
struct Cluster {
  int nodes = 1, gpus_per_node = 1;
  std::vector<std::vector<std::string>> node_paths;  // one per node rank
  LinkModel links{{"kubernetes.io/hostname"}};
};

// Of the slowest stage where there are several (`stage`).
struct StepPrediction {
  double seconds = 0;           // one optimizer step
  double compute_seconds = 0;   // math on the compute stream
  double tp_seconds = 0;        // TP collectives on the compute stream
  double context_seconds = 0;   // attention's exchanges across the context group, on the compute stream
  double expert_seconds = 0;    // the mixture's all-to-alls across the expert group, on the compute stream
  int64_t expert_bytes = 0;     // per rank per step, sent by those all-to-alls (recompute's included)
  double comm_seconds = 0;      // gathers, reduce-scatters, replica all-reduces (comm stream busy)
  double exposed_seconds = 0;   // what the step waits beyond compute, TP, context, experts and the update (bubble included)
  double update_seconds = 0;    // AdamW over the shards
  int64_t micro_steps = 0;      // M: accumulation steps, with stages the pipeline's micro-batches
  double tokens_per_second = 0;
  int stage = 0;                // the slowest stage
  double bubble = 0;            // the schedule's idle share of a step, api::BubbleFraction; 0 for one stage
  double bubble_seconds = 0;    // the fill and drain: (P - 1) / V micro-batches' time
  int64_t p2p_bytes = 0;        // per rank per step, sent to neighbouring stages (the busiest stage's rank)
  double p2p_seconds = 0;       // the point-to-point time the step waits for
};

// REQUIRES: the choice divides the model (api::TensorParallelDivides), the mesh and the batch
// (2 x C | seq);
// with stages, P x V <= layers and micro-batches its schedule takes.
StepPrediction PredictStep(const api::ModelShape& shape, int seq, int64_t global_batch_tokens,
                           const LayoutChoice& choice, const Cluster& cluster, const DeviceModel& device);

}  // namespace meshtrain::scheduler
