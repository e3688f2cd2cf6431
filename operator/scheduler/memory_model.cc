#include "operator/scheduler/memory_model.h"

#include <algorithm>

namespace meshtrain::scheduler {

std::string Describe(const LayoutChoice& c) {
  std::string text;
  if (c.pipeline.stages > 1) {
    text = "P=" + std::to_string(c.pipeline.stages) + " " + api::PipelineScheduleName(c.pipeline.schedule) +
           (c.pipeline.virtual_stages > 1 ? " x" + std::to_string(c.pipeline.virtual_stages) : "") + ", ";
  }
  text += "T=" + std::to_string(c.tp) + ", S=" + std::to_string(c.shard) + ", micro-batch " +
                     std::to_string(c.micro_batch) + ", ";
  if (c.activations.offload) return text + "offload (horizon " + std::to_string(c.activations.horizon) + ")";
  return text + (c.activations.checkpointing ? "checkpointing" : "keep all");
}

api::EngineTypes EngineTypesOf(int compute_bytes, bool cpu_kernels, const api::ModelShape& shape, int micro_batch,
                               int seq, int tp) {
  api::EngineTypes types;
  types.act_bytes = compute_bytes;
  types.acc_bytes = 4;
  types.attention_keeps_scores = cpu_kernels;
  // cuDNN's backward, without the workspace its plan would add.
  if (!cpu_kernels) {
    types.attention_scratch_bytes =
        api::FusedAttentionScratchBytes(micro_batch, seq, int(shape.heads / tp), int(shape.HeadDim()), 0);
  }
  return types;
}

MemoryPrediction PredictMemory(const api::ModelShape& shape, int seq, const LayoutChoice& c, int compute_bytes,
                               bool cpu_kernels, bool dropout, int micro_batches) {
  const api::EngineTypes types = EngineTypesOf(compute_bytes, cpu_kernels, shape, c.micro_batch, seq, c.tp);
  MemoryPrediction most;
  for (int p = 0; p < c.pipeline.stages; ++p) {
    const api::StageShape stage = api::StageShapeOf(shape, c.pipeline, p, micro_batches, seq);
    for (int t = 0; t < c.tp; ++t) {
      const api::EngineMemory e = api::EngineMemoryOf(shape, c.micro_batch, seq, t, c.tp, c.shard, c.activations, types,
                                                      dropout, /*keep_units_gathered=*/false, stage);
      const MemoryPrediction m{e.params, e.grads, e.optimizer, e.activations, e.offload, e.gathered, e.comm, p};
      if (m.total() > most.total()) most = m;
    }
  }
  return most;
}

}  // namespace meshtrain::scheduler
