#include "api/defaults.h"

#include <algorithm>

#include "api/layout.h"
#include "api/model_family.h"
#include "api/model_shape.h"
#include "api/validation.h"

namespace meshtrain::api {
namespace {

void DeriveWarmup(TrainingSpec& t, std::vector<DerivedDefault>* derived) {
  const int64_t usual = TrainingSpec{}.warmup_steps;
  t.warmup_steps = std::clamp<int64_t>(t.steps / 10, 0, usual);
  derived->push_back({"spec.training.warmupSteps", std::to_string(t.warmup_steps),
                      "a tenth of spec.training.steps (" + std::to_string(t.steps) + "), at most " +
                          std::to_string(usual)});
}

// The batch fields that were not written, from those that were. Nothing is derived when
// the sizes it needs are invalid: validation reports those.
void DeriveBatch(TrainingJobSpec& spec, bool global_written, bool micro_written,
                 std::vector<DerivedDefault>* derived) {
  TrainingSpec& t = spec.training;
  const ParallelismSpec& p = spec.parallelism;
  const std::optional<int64_t>& seq = spec.model.seq_len;
  if (!seq || *seq < 1 || *seq > kMaxSeqLen ||
      !ParallelLayout::Check(spec.nodes, spec.gpus_per_node, p.tensor_parallel_degree, p.hybrid_shard_degree,
                             p.pipeline_parallel_degree, p.context_parallel_degree, p.expert_parallel_degree)
           .empty()) {
    return;
  }
  const int64_t dp = ParallelLayout::ForSpec(spec).data_parallel();
  const TrainingSpec usual;
  auto number = [](int64_t n) { return std::to_string(n); };

  if (!global_written) {
    if (t.micro_batch_size < 1 || t.micro_batch_size > kMaxMicroBatchSize) return;
    const int64_t per_step = t.micro_batch_size * *seq * dp;
    // A pipeline needs as many micro-batches as stages.
    const int64_t micro_steps = std::max<int64_t>(std::max<int64_t>(1, p.pipeline_parallel_degree),
                                                  (usual.global_batch_tokens + per_step / 2) / per_step);
    t.global_batch_tokens = micro_steps * per_step;
    derived->push_back({"spec.training.globalBatchTokens", number(t.global_batch_tokens),
                        "the multiple of microBatchSize x seqLen x data-parallel ranks (" +
                            number(t.micro_batch_size) + " x " + number(*seq) + " x " + number(dp) + " = " +
                            number(per_step) + ") nearest to " + number(usual.global_batch_tokens) +
                            (p.pipeline_parallel_degree > 1 && micro_steps == p.pipeline_parallel_degree
                                 ? ", at least one micro-batch a stage"
                                 : "")});
    return;
  }
  if (micro_written || t.global_batch_tokens < 1) return;
  const int64_t per_sequence = *seq * dp;
  if (t.global_batch_tokens % per_sequence != 0) {
    // No micro-batch fits: validation names globalBatchTokens against the smallest unit.
    t.micro_batch_size = 1;
    return;
  }
  const int64_t sequences = t.global_batch_tokens / per_sequence;
  int64_t micro = std::min(usual.micro_batch_size, sequences);
  // With a pipeline, small enough that each stage gets a micro-batch, where that can be.
  const int64_t stages = std::max<int64_t>(1, p.pipeline_parallel_degree);
  while (micro > 1 && (sequences % micro != 0 || (sequences / micro < stages && sequences >= stages))) --micro;
  t.micro_batch_size = micro;
  derived->push_back({"spec.training.microBatchSize", number(micro),
                      "the largest micro-batch up to " + number(usual.micro_batch_size) +
                          " that divides the " + number(sequences) +
                          " sequences per rank and step (globalBatchTokens / (seqLen x data-parallel ranks) = " +
                          number(t.global_batch_tokens) + " / (" + number(*seq) + " x " + number(dp) + "))"});
}

// The preset's fields that were not written, then what the family derives from the
// rest (api/model_family.h: GPT-2 leaves the fields it has no choice in unset).
void DefaultModel(ModelSpec* m) {
  if (const ModelShape* preset = FindPreset(m->preset)) {
    const ModelShape p = preset->Resolved();
    if (!m->layers) m->layers = p.layers;
    if (!m->heads) m->heads = p.heads;
    if (!m->hidden) m->hidden = p.hidden;
    if (!m->vocab_size) m->vocab_size = p.vocab_size;
    if (!m->seq_len) m->seq_len = p.seq_len;
    if (m->family.empty()) m->family = p.family;
    if (m->family == p.family) p.Family().DefaultFromPreset(p, m);
  }
  if (m->family.empty()) m->family = kDefaultFamily;
  if (const ModelFamily* family = FindFamily(m->family)) family->Default(m);
}

}  // namespace

std::vector<std::string> DefaultTopologyLevels() {
  return {"topology.k8s.aws/network-node-layer-1", "topology.k8s.aws/network-node-layer-2",
          "topology.k8s.aws/network-node-layer-3", "kubernetes.io/hostname"};
}

std::vector<DerivedDefault> ApplyDefaults(TrainingJob* job, const FieldPaths& written) {
  TrainingJobSpec& spec = job->spec;
  if (!spec.resources.gpu) spec.resources.gpu = spec.gpus_per_node;

  DefaultModel(&spec.model);

  TopologySpec& topology = spec.topology;
  if (topology.levels.empty()) topology.levels = DefaultTopologyLevels();
  if (topology.required_level.empty()) {
    topology.required_level = topology.levels[topology.levels.size() >= 2 ? topology.levels.size() - 2 : 0];
  }

  std::vector<DerivedDefault> derived;
  if (!written.contains("spec.training.warmupSteps")) DeriveWarmup(spec.training, &derived);
  DeriveBatch(spec, written.contains("spec.training.globalBatchTokens"),
              written.contains("spec.training.microBatchSize"), &derived);
  ParallelismSpec& p = spec.parallelism;
  if (p.activation_offloading && !written.contains("spec.parallelism.activationCheckpointing")) {
    p.activation_checkpointing = true;
    derived.push_back({"spec.parallelism.activationCheckpointing", "true",
                       "spec.parallelism.activationOffloading offloads the checkpointed block inputs; SMP v2 configs "
                       "leave checkpointing to the training script"});
  }
  return derived;
}

}  // namespace meshtrain::api
