// The memory model of the planner: what one rank of the sharded engine holds at its
// peak, for a layout choice, added up from the sizes the engine allocates
// (api/engine_memory.h), so that the model and the engine's accounting cannot drift.
//
// Per rank, in the engine's accounting categories (api::EngineMemoryOf says each):
// params, grads, optimizer (the shards), gathered (the compute copies' slots), comm,
// activations (the ActivationStore and the step buffer) and offload (the host pool). The
// engine allocates all of them when it is built, so its peak is their sum.
// On a GPU the attention backward's scratch is api::FusedAttentionScratchBytes, as the CUDA
// table allocates it, less cuDNN's workspace, which only its plan knows (a few MiB).
// With context parallelism (C ranks split every sequence; api/layout.h) a rank holds
// seq / C rows of each sequence, so its activations and attention fall by C, attention
// works in api::ContextAttentionScratchBytes, and FSDP shards every unit over S x C ranks.
// With expert parallelism (EP ranks split each mixture-of-experts block's experts) a rank
// holds E/EP experts of each block beside the block's other tensors, and those units are
// sharded over the S x C / EP ranks holding the same experts (api::EngineMemoryOf); the
// rows its experts receive are sized EP x its tokens' k copies (api::EngineTypes::experts).
// A mixture's dense blocks (api::ModelShape::DenseBlock) hold no experts: their units
// (api::UnitElements::dense_block) are sharded over all S x C ranks, a stage's counted by
// api::StageShape::dense_blocks.
// With a pipeline a rank holds its stage's part (api::StageShapeOf): its blocks' units, the
// embedding's on the first stage, the head's on the last, and activations for the
// micro-batches its chunks hold between forward and backward; the peak is the worst stage's.
// Thread-safety: pure functions.

#pragma once

#include <cstdint>
#include <string>

#include "api/engine_memory.h"
#include "api/model_shape.h"
#include "api/pipeline.h"

namespace meshtrain::scheduler {

// One candidate layout of a job: what the planner chooses.
struct LayoutChoice {
  int tp = 1;     // tensorParallelDegree
  int shard = 1;  // hybridShardDegree (never 0 here: the resolved S)
  int micro_batch = 1;  // microBatchSize: sequences per data-parallel rank and micro-step
  api::ActivationPolicy activations;
  // pipelineParallelDegree, pipelineSchedule and pipelineVirtualStages; one stage by default.
  api::Pipeline pipeline = {};
  int context = 1;                    // contextParallelDegree C: ranks that split each sequence
  std::string context_mode = "Ring";  // contextParallelMode: "Ring" or "AllToAll"
  int expert = 1;  // expertParallelDegree EP: ranks that split each mixture-of-experts block's experts
  bool operator==(const LayoutChoice&) const = default;
};

// "T=2, S=4, micro-batch 8, checkpointing" / "..., offload (horizon 2)"; with stages
// "P=2 1F1B, T=1, ..." or "P=2 Interleaved1F1B x2, T=1, ..."; with C > 1
// "T=8, S=2, C=4 ring, ..." or "..., C=4 all-to-all, ..."; with EP > 1 "T=1, S=8, EP=8, ...".
std::string Describe(const LayoutChoice& choice);

struct MemoryPrediction {
  int64_t params = 0, grads = 0, optimizer = 0, activations = 0, offload = 0, gathered = 0, comm = 0;
  int stage = 0;  // the pipeline stage whose rank holds this (0 without a pipeline)
  // Device memory (everything but the offload pool, which lives in host memory).
  int64_t device() const { return params + grads + optimizer + activations + gathered + comm; }
  // Everything the rank's allocator accounts (on the CPU, device and host are one memory).
  int64_t total() const { return device() + offload; }
};

// The engine's element types on a device: `compute_bytes` for gathered parameters and
// activations (4: fp32; 2: bf16), fp32 for the rest, and the CPU's attention (which keeps
// the scores) or fused attention on a GPU. `seq`: this rank's rows of each sequence (the
// sequence / context). With context > 1, attention across the context group in
// `context_mode` ("Ring" or "AllToAll"), whose scratch is api::ContextAttentionScratchBytes
// around the fused kernel's own (on the shape the mode runs it: this rank's rows and
// heads for Ring, the whole sequence and 1/context of the heads for AllToAll). `experts`:
// the expert group's EP (api::EngineTypes::experts: a mixture's received rows are sized
// EP x the local tokens' copies).
// `float8`: float8 training's amaxes and scales (api::Float8ScratchElements) and, on a
// GPU, the kernel table's scratch for its largest float8 product, with fp32 sums where
// that product keeps them (api::Float8KernelScratchBytes of TP rank 0, which keeps at
// least any rank's).
enum class Float8Memory { kNone, kTensorwise, kRowwise };
api::EngineTypes EngineTypesOf(int compute_bytes, bool cpu_kernels, const api::ModelShape& shape, int micro_batch,
                               int seq, int tp, int context = 1, const std::string& context_mode = "Ring",
                               int experts = 1, Float8Memory float8 = Float8Memory::kNone);

// The peak of the rank that holds the most (the largest vocabulary slice, of the stage
// that holds the most), for sequences of `seq` tokens (each rank holding seq / C rows of
// each, its units sharded over S x C ranks; with EP > 1 its blocks hold E/EP experts each,
// sharded over S x C / EP ranks, and its MoE buffers are sized for EP); `dropout`: the model drops
// activations (spec.model.dropout > 0). `micro_batches`: the step's micro-batches (its
// accumulation steps), which set how many a pipeline stage keeps activations for; any for
// one stage. REQUIRES: with stages, a number of micro-batches the schedule takes
// (api::StageActions); seq a multiple of 2 x C.
MemoryPrediction PredictMemory(const api::ModelShape& shape, int seq, const LayoutChoice& choice, int compute_bytes,
                               bool cpu_kernels, bool dropout, int micro_batches,
                               Float8Memory float8 = Float8Memory::kNone);

}  // namespace meshtrain::scheduler
