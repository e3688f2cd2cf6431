#include "operator/scheduler/memory_model.h"

#include <algorithm>

namespace meshtrain::scheduler {

std::string Describe(const LayoutChoice& c) {
  std::string text;
  if (c.pipeline.stages > 1) {
    text = "P=" + std::to_string(c.pipeline.stages) + " " + api::PipelineScheduleName(c.pipeline.schedule) +
           (c.pipeline.virtual_stages > 1 ? " x" + std::to_string(c.pipeline.virtual_stages) : "") + ", ";
  }
  text += "T=" + std::to_string(c.tp) + ", S=" + std::to_string(c.shard) + ", ";
  if (c.context > 1) {
    text += "C=" + std::to_string(c.context) + (c.context_mode == "AllToAll" ? " all-to-all, " : " ring, ");
  }
  if (c.expert > 1) text += "EP=" + std::to_string(c.expert) + ", ";
  text += "micro-batch " + std::to_string(c.micro_batch) + ", ";
  if (c.activations.offload) return text + "offload (horizon " + std::to_string(c.activations.horizon) + ")";
  return text + (c.activations.checkpointing ? "checkpointing" : "keep all");
}

api::EngineTypes EngineTypesOf(int compute_bytes, bool cpu_kernels, const api::ModelShape& shape, int micro_batch,
                               int seq, int tp, int context, const std::string& context_mode, int experts,
                               Float8Memory float8) {
  api::EngineTypes types;
  types.experts = experts;
  types.act_bytes = compute_bytes;
  types.acc_bytes = 4;
  types.attention_keeps_scores = cpu_kernels;
  types.context = context;
  types.context_all_to_all = context > 1 && context_mode == "AllToAll";
  // cuDNN's backward, without the workspace its plan would add, on the shape it runs:
  // all-to-all attends the whole sequence with 1/C of this TP rank's heads.
  if (!cpu_kernels) {
    const int rows = types.context_all_to_all ? seq * context : seq;
    const int heads = int(shape.heads / tp) / (types.context_all_to_all ? context : 1);
    types.attention_scratch_bytes = api::FusedAttentionScratchBytes(micro_batch, rows, heads, int(shape.HeadDim()), 0);
  }
  if (context > 1) {
    types.attention_scratch_bytes = api::ContextAttentionScratchBytes(micro_batch, seq, shape, tp, types);
  }
  if (float8 != Float8Memory::kNone) {
    const bool rowwise = float8 == Float8Memory::kRowwise;
    types.float8_scales = api::Float8ScratchElements(micro_batch, seq, shape, tp, rowwise);
    // TP rank 0's: it adds the row-parallel layers' biases, and so keeps at least any rank's.
    if (!cpu_kernels) {
      types.float8_product_bytes = api::Float8KernelScratchBytes(micro_batch, seq, shape, tp, {rowwise, 0});
    }
  }
  return types;
}

MemoryPrediction PredictMemory(const api::ModelShape& shape, int seq, const LayoutChoice& c, int compute_bytes,
                               bool cpu_kernels, bool dropout, int micro_batches, Float8Memory float8) {
  // As the engine sees it: this rank's rows of each sequence, FSDP's S x C ranks.
  const int rows = seq / c.context, shard = c.shard * c.context;
  const api::EngineTypes types =
      EngineTypesOf(compute_bytes, cpu_kernels, shape, c.micro_batch, rows, c.tp, c.context, c.context_mode, c.expert,
                    float8);
  MemoryPrediction most;
  for (int p = 0; p < c.pipeline.stages; ++p) {
    const api::StageShape stage = api::StageShapeOf(shape, c.pipeline, p, micro_batches, rows);
    for (int t = 0; t < c.tp; ++t) {
      const api::EngineMemory e = api::EngineMemoryOf(shape, c.micro_batch, rows, t, c.tp, shard, c.activations, types,
                                                      dropout, /*keep_units_gathered=*/false, stage);
      const MemoryPrediction m{e.params, e.grads, e.optimizer, e.activations, e.offload, e.gathered, e.comm, p};
      if (m.total() > most.total()) most = m;
    }
  }
  return most;
}

}  // namespace meshtrain::scheduler
