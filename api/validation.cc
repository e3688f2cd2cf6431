#include "api/validation.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "api/field_checker.h"
#include "api/layout.h"
#include "api/model_family.h"
#include "api/worker_contract.h"
#include "api/model_shape.h"

namespace meshtrain::api {

namespace env = api::worker::env;
namespace {

// RFC 1123 label: lowercase alphanumerics and '-', starting and ending alphanumeric.
bool IsDnsLabel(const std::string& s, size_t max_length) {
  if (s.empty() || s.size() > max_length) return false;
  for (char c : s) {
    if (!(std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) || c == '-')) {
      return false;
    }
  }
  return s.front() != '-' && s.back() != '-';
}

// A label value or the name part of a key: [A-Za-z0-9] at both ends, [-_.A-Za-z0-9] inside, at most 63.
bool IsLabelName(const std::string& s, bool allow_empty) {
  if (s.empty()) return allow_empty;
  if (s.size() > 63) return false;
  auto alnum = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; };
  for (char c : s) {
    if (!alnum(c) && c != '-' && c != '_' && c != '.') return false;
  }
  return alnum(s.front()) && alnum(s.back());
}

// A label key: an optional DNS-subdomain prefix and '/', then a name.
bool IsLabelKey(const std::string& key) {
  const size_t slash = key.find('/');
  if (slash == std::string::npos) return IsLabelName(key, false);
  const std::string prefix = key.substr(0, slash);
  if (prefix.empty() || prefix.size() > 253) return false;
  size_t start = 0;
  while (start <= prefix.size()) {
    size_t dot = prefix.find('.', start);
    if (dot == std::string::npos) dot = prefix.size();
    if (!IsDnsLabel(prefix.substr(start, dot - start), 63)) return false;
    start = dot + 1;
  }
  return IsLabelName(key.substr(slash + 1), false);
}

// An environment variable name: [A-Za-z_][A-Za-z0-9_]*.
bool IsEnvName(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

// Names the operator sets on every worker (docs/design.md, "How a job runs").
bool IsReservedEnvName(const std::string& s) {
  for (const char* reserved : {env::kRank, env::kWorldSize, env::kLocalRank, env::kMasterAddr, env::kMasterPort}) {
    if (s == reserved) return true;
  }
  return s.starts_with("MESHTRAIN_");
}

void CheckMetadata(const TrainingJob& job, FieldChecker& c) {
  if (job.api_version != kApiVersion) {
    c.Fail("apiVersion", "must be \"" + std::string(kApiVersion) + "\", got \"" + job.api_version + "\"");
  }
  if (job.kind != kKind) c.Fail("kind", "must be \"" + std::string(kKind) + "\", got \"" + job.kind + "\"");
  const ObjectMeta& m = job.metadata;
  // Pods are named <job>-<node rank>, and hostnames must stay DNS labels: leave room for the suffix.
  if (m.name.empty()) c.Fail("metadata.name", "is required");
  else if (!IsDnsLabel(m.name, 50)) {
    c.Fail("metadata.name", "must be at most 50 lowercase letters, digits and '-', starting and ending with a "
                            "letter or digit; got \"" + m.name + "\"");
  }
  if (!m.namespace_.empty() && !IsDnsLabel(m.namespace_, 63)) {
    c.Fail("metadata.namespace", "must be a DNS label (lowercase letters, digits and '-'), got \"" +
                                     m.namespace_ + "\"");
  }
}

void CheckModel(const ModelSpec& m, FieldChecker& c) {
  const ModelShape* preset = FindPreset(m.preset);
  if (!m.preset.empty() && preset == nullptr) {
    std::string known;
    for (std::string_view name : PresetNames()) known += (known.empty() ? "" : ", ") + std::string(name);
    c.Fail("spec.model.preset", "unknown preset \"" + m.preset + "\"; known presets: " + known);
    return;  // the shape is unknown, so its fields are not worth checking
  }
  const ModelFamily* family = FindFamily(m.family.empty() ? kDefaultFamily : std::string_view(m.family));
  if (family == nullptr) {
    c.Fail("spec.model.family", "must be one of " + FamilyList() + "; got \"" + m.family + "\"");
    return;
  }
  if (preset != nullptr && preset->family != family->name()) {
    c.Fail("spec.model.family", "the preset " + m.preset + " is of family " + preset->family + ", got " + m.family);
    return;  // the preset filled none of this family's fields
  }
  struct Dim {
    const char* name;
    const std::optional<int64_t>& value;
    int64_t max;
  };
  for (const Dim& d : {Dim{"layers", m.layers, 1024}, Dim{"heads", m.heads, 1024}, Dim{"hidden", m.hidden, 1 << 17},
                       Dim{"vocabSize", m.vocab_size, int64_t(1) << 24}, Dim{"seqLen", m.seq_len, kMaxSeqLen}}) {
    const std::string path = std::string("spec.model.") + d.name;
    if (!d.value) c.Fail(path, "is required when spec.model.preset is not set");
    else c.Range(path, *d.value, 1, d.max);
  }
  c.Finite("spec.model.dropout", m.dropout, 0, false);
  if (std::isfinite(m.dropout) && m.dropout >= 1) {
    c.Fail("spec.model.dropout", "must be below 1 (the probability of dropping an element), got " + FieldChecker::Show(m.dropout));
  }
  if (!family->HasExperts()) {  // the mixture-of-experts fields belong to the families that have experts
    for (const auto& [name, set] : {std::pair{"experts", m.experts.has_value()},
                                    std::pair{"expertsPerToken", m.experts_per_token.has_value()},
                                    std::pair{"moeIntermediateSize", m.moe_intermediate_size.has_value()},
                                    std::pair{"normTopkProb", m.norm_topk_prob.has_value()},
                                    std::pair{"decoderSparseStep", m.decoder_sparse_step.has_value()},
                                    std::pair{"mlpOnlyLayers", !m.mlp_only_layers.empty()}}) {
      if (!set) continue;
      c.Fail(std::string("spec.model.") + name,
             "only a mixture of experts takes it (" + std::string(family->name()) + " has none)");
    }
  }
  family->Check(m, c);
  // GPT-2's position table has maxPositions rows; RoPE reaches as far as the model was trained.
  if (m.max_positions && c.Range("spec.model.maxPositions", *m.max_positions, 1, int64_t(1) << 24) && m.seq_len &&
      *m.seq_len > *m.max_positions) {
    c.Fail("spec.model.seqLen", "must not exceed spec.model.maxPositions (" + std::to_string(*m.max_positions) +
                                    "), got " + std::to_string(*m.seq_len));
  }
}

void CheckData(const DataSpec& d, FieldChecker& c) {
  if (d.train.empty()) c.Fail("spec.data.train", "is required: give at least one token file or glob");
  for (const auto* list : {&d.train, &d.validation}) {
    const std::string base = list == &d.train ? "spec.data.train" : "spec.data.validation";
    for (size_t i = 0; i < list->size(); ++i) {
      if ((*list)[i].empty()) c.Fail(base + "[" + std::to_string(i) + "]", "must not be empty");
    }
  }
  c.OneOf("spec.data.format", d.format, {"auto", "uint16"});
  c.OneOf("spec.data.attention", d.attention, {"causal", "document"});
}

void CheckTraining(const TrainingSpec& t, FieldChecker& c) {
  c.Range("spec.training.steps", t.steps, 1, FieldChecker::kNoMax);
  c.Range("spec.training.globalBatchTokens", t.global_batch_tokens, 1, FieldChecker::kNoMax);
  c.Range("spec.training.microBatchSize", t.micro_batch_size, 1, kMaxMicroBatchSize);
  c.Finite("spec.training.learningRate", t.learning_rate, 0, /*min_exclusive=*/true);
  if (c.Range("spec.training.warmupSteps", t.warmup_steps, 0, FieldChecker::kNoMax) && t.steps >= 1 &&
      t.warmup_steps > t.steps) {
    c.Fail("spec.training.warmupSteps", "must not exceed spec.training.steps (" + std::to_string(t.steps) +
                                            "), got " + std::to_string(t.warmup_steps));
  }
  c.OneOf("spec.training.schedule", t.schedule, {"cosine", "constant"});
  c.Finite("spec.training.weightDecay", t.weight_decay, 0, false);
  c.Finite("spec.training.gradClip", t.grad_clip, 0, false);
  c.Range("spec.training.seed", t.seed, 0, FieldChecker::kNoMax);
  c.OneOf("spec.training.precision", t.precision, {"auto", "fp32", "bf16", "fp8"});
  c.OneOf("spec.training.float8.recipe", t.float8.recipe, {"tensorwise", "rowwise"});
  if (t.precision != "fp8" && t.float8.recipe != Float8Spec{}.recipe) {
    c.Fail("spec.training.float8.recipe", "is float8 training's, acted on with spec.training.precision fp8 only (" +
                                              t.precision + " here), got " + t.float8.recipe);
  }
  c.Range("spec.training.evalInterval", t.eval_interval, 0, FieldChecker::kNoMax);
  c.Range("spec.training.evalBatches", t.eval_batches, 1, 1 << 20);
}

// Float8 training against the model and the layout: cuBLASLt's float8 products need every
// dimension of a linear layer's operands on a TP rank to be a multiple of 16, and the
// amaxes of its activations are not reduced over a context group.
void CheckFloat8(const TrainingJobSpec& spec, FieldChecker& c) {
  if (spec.training.precision != "fp8") return;
  const ModelSpec& m = spec.model;
  const int64_t tp = spec.parallelism.tensor_parallel_degree;
  if (tp < 1) return;
  const auto width = [&](const std::string& what, std::optional<int64_t> whole) {
    if (!whole || *whole < 1 || *whole % tp != 0 || (*whole / tp) % 16 == 0) return;
    c.Fail("spec.training.precision", "fp8 needs " + what + " per TP rank to be a multiple of 16 (cuBLASLt's float8 "
                                          "products), got " + std::to_string(*whole) + " / " + std::to_string(tp) +
                                          " = " + std::to_string(*whole / tp));
  };
  width("spec.model.hidden", m.hidden);
  const std::optional<int64_t> head_dim =
      m.head_dim ? m.head_dim : (m.hidden && m.heads && *m.heads > 0 ? std::optional(*m.hidden / *m.heads) : std::nullopt);
  if (head_dim && m.heads) width("the query width (heads x head dim)", *m.heads * *head_dim);
  const std::optional<int64_t> kv_heads = m.kv_heads ? m.kv_heads : m.heads;
  if (head_dim && kv_heads) width("the key and value width (kvHeads x head dim)", *kv_heads * *head_dim);
  if (m.intermediate_size) {
    width("spec.model.intermediateSize", m.intermediate_size);
  } else if (m.hidden) {
    width("the MLP width (4 x spec.model.hidden)", 4 * *m.hidden);
  }
  if (spec.parallelism.context_parallel_degree > 1) {
    c.Fail("spec.training.precision", "fp8 with spec.parallelism.contextParallelDegree " +
                                          std::to_string(spec.parallelism.context_parallel_degree) +
                                          " is not built: a context group's activation amaxes are not reduced; use "
                                          "bf16, or contextParallelDegree 1");
  }
}

// Context parallelism against the model and the rest of the spec: each rank holds two
// chunks of every sequence, and Ulysses splits this TP rank's heads C ways.
void CheckContext(const TrainingJobSpec& spec, FieldChecker& c) {
  const ParallelismSpec& p = spec.parallelism;
  const int64_t C = p.context_parallel_degree, tp = p.tensor_parallel_degree;
  if (C <= 1 || tp < 1) return;
  const ModelSpec& m = spec.model;
  const std::string degree = std::to_string(C);
  if (m.seq_len && *m.seq_len % (2 * C) != 0) {
    c.Fail("spec.model.seqLen", "must be a multiple of 2 x spec.parallelism.contextParallelDegree (" +
                                    std::to_string(2 * C) + ": each rank holds two chunks of every sequence), got " +
                                    std::to_string(*m.seq_len));
  }
  if (p.context_parallel_mode == "AllToAll") {
    // Ulysses gives each rank of the group heads / (T x C) query heads and as many key/value
    // heads over C; a key/value head cannot be split.
    const auto check = [&](const char* field, const std::optional<int64_t>& heads) {
      if (!heads || *heads < 1 || *heads % tp != 0 || (*heads / tp) % C == 0) return;
      c.Fail("spec.parallelism.contextParallelDegree",
             std::string("must divide spec.model.") + field + " per TP rank (" + std::to_string(*heads) + " / " +
                 std::to_string(tp) + " = " + std::to_string(*heads / tp) +
                 ") with contextParallelMode AllToAll, which splits each rank's heads C ways (Ring does not), got " +
                 degree);
    };
    check("heads", m.heads);
    check("kvHeads", m.kv_heads ? m.kv_heads : m.heads);
  }
  if (spec.model.dropout > 0) {
    c.Fail("spec.parallelism.contextParallelDegree",
           "must be 1 with spec.model.dropout (" + std::to_string(spec.model.dropout) +
               "): dropout's masks are not split by sequence chunk, got " + degree);
  }
}

// Expert parallelism against the model: a mixture of experts whose experts EP divides.
// (ParallelLayout::Check holds it to the shard group.)
void CheckExperts(const TrainingJobSpec& spec, FieldChecker& c) {
  const ModelSpec& m = spec.model;
  // The load-balancing loss: of a mixture's routers, over one micro-step of every rank
  // (each pipeline stage's blocks summed over the stages).
  if (const std::optional<double>& coef = spec.training.router_aux_loss_coef) {
    const std::string given = std::to_string(*coef);
    if (!(*coef >= 0) || !std::isfinite(*coef)) {
      c.Fail("spec.training.routerAuxLossCoef", "must be a number of at least 0, got " + given);
    } else if (!m.experts) {
      c.Fail("spec.training.routerAuxLossCoef",
             "is a mixture of experts' load-balancing loss, and this model has no experts, got " + given);
    }
  }
  const int64_t EP = spec.parallelism.expert_parallel_degree;
  if (EP <= 1) return;
  const std::string degree = std::to_string(EP);
  if (!m.experts) {
    c.Fail("spec.parallelism.expertParallelDegree",
           "must be 1 for a model without experts (expert parallelism splits a mixture of experts), got " + degree);
  } else if (*m.experts >= 1 && *m.experts % EP != 0) {
    c.Fail("spec.parallelism.expertParallelDegree", "must divide spec.model.experts (" + std::to_string(*m.experts) +
                                                        "), got " + degree);
  }
}

// Checks that need the sizes of several blocks at once: the mesh, TP against the
// model, and the batch against the data-parallel size.
void CheckLayout(const TrainingJobSpec& spec, FieldChecker& c) {
  const ParallelismSpec& p = spec.parallelism;
  FieldErrors layout = ParallelLayout::Check(spec.nodes, spec.gpus_per_node, p.tensor_parallel_degree,
                                             p.hybrid_shard_degree, p.pipeline_parallel_degree,
                                             p.context_parallel_degree, p.expert_parallel_degree);
  const bool layout_ok = layout.empty();
  for (FieldError& e : layout) c.errors.push_back(std::move(e));

  const int64_t tp = p.tensor_parallel_degree;
  const ModelSpec& m = spec.model;
  if (tp >= 1 && m.heads && *m.heads >= 1 && *m.heads % tp != 0) {
    c.Fail("spec.parallelism.tensorParallelDegree",
           "must divide spec.model.heads (" + std::to_string(*m.heads) + "), got " + std::to_string(tp));
  }
  if (tp >= 1 && m.kv_heads && *m.kv_heads >= 1 && *m.kv_heads % tp != 0) {
    c.Fail("spec.parallelism.tensorParallelDegree", "must divide spec.model.kvHeads (" + std::to_string(*m.kv_heads) +
                                                        "), the key/value heads it splits, got " + std::to_string(tp));
  }
  // A mixture whose experts have a width of their own (Qwen3-MoE's moeIntermediateSize)
  // has no dense MLP but in its dense blocks (mlpOnlyLayers, decoderSparseStep): without
  // them its intermediateSize sizes nothing, and TP splits only the experts.
  const bool dense_mlp = m.NamesDenseBlocks() ||
                         !(m.experts && m.moe_intermediate_size && m.moe_intermediate_size != m.intermediate_size);
  if (tp >= 1 && dense_mlp && m.intermediate_size && *m.intermediate_size >= 1 && *m.intermediate_size % tp != 0) {
    c.Fail("spec.parallelism.tensorParallelDegree", "must divide the MLP width (spec.model.intermediateSize = " +
                                                        std::to_string(*m.intermediate_size) + "), got " +
                                                        std::to_string(tp));
  } else if (tp >= 1 && !m.intermediate_size && m.hidden && *m.hidden >= 1 && (4 * *m.hidden) % tp != 0) {
    c.Fail("spec.parallelism.tensorParallelDegree", "must divide the MLP width (4 x spec.model.hidden = " +
                                                        std::to_string(4 * *m.hidden) + "), got " + std::to_string(tp));
  }
  // A mixture of experts' experts are split as the dense MLP is: TP divides their width
  // (Mixtral's is intermediateSize, checked above).
  if (tp > 1 && m.experts && m.moe_intermediate_size && *m.moe_intermediate_size >= 1 &&
      m.moe_intermediate_size != m.intermediate_size && *m.moe_intermediate_size % tp != 0) {
    c.Fail("spec.parallelism.tensorParallelDegree", "must divide the experts' width (spec.model.moeIntermediateSize = " +
                                                        std::to_string(*m.moe_intermediate_size) + "), got " +
                                                        std::to_string(tp));
  }
  CheckContext(spec, c);
  CheckExperts(spec, c);
  // Each rank of a stage holds whole blocks: P x V chunks of at least one block each.
  const int64_t chunks = p.pipeline_parallel_degree * std::max<int64_t>(1, p.pipeline_virtual_stages);
  if (p.pipeline_parallel_degree > 1 && m.layers && *m.layers >= 1 && chunks > *m.layers) {
    c.Fail("spec.parallelism.pipelineParallelDegree",
           "gives " + std::to_string(chunks) + " chunks of blocks (pipelineParallelDegree " +
               std::to_string(p.pipeline_parallel_degree) + " x pipelineVirtualStages " +
               std::to_string(p.pipeline_virtual_stages) + "), more than spec.model.layers (" +
               std::to_string(*m.layers) + ")");
  }
  if (!layout_ok || !m.seq_len || *m.seq_len < 1 || spec.training.micro_batch_size < 1) return;

  const ParallelLayout mesh = ParallelLayout::ForSpec(spec);
  const int64_t per_step = TokensPerMicroStep(spec);
  if (spec.training.global_batch_tokens >= 1 && spec.training.global_batch_tokens % per_step != 0) {
    c.Fail("spec.training.globalBatchTokens",
           "must be a multiple of microBatchSize x seqLen x data-parallel ranks (" +
               std::to_string(spec.training.micro_batch_size) + " x " + std::to_string(*m.seq_len) + " x " +
               std::to_string(mesh.data_parallel()) + " = " + std::to_string(per_step) + "), got " +
               std::to_string(spec.training.global_batch_tokens));
    return;
  }
  // The step's micro-batches are what flows through the pipeline: at least P of them.
  const int64_t micro_steps = spec.training.global_batch_tokens / per_step, P = p.pipeline_parallel_degree;
  if (P > 1 && micro_steps < P) {
    c.Fail("spec.training.globalBatchTokens",
           "gives " + std::to_string(micro_steps) + " micro-batches a step (" +
               std::to_string(spec.training.global_batch_tokens) + " / " + std::to_string(per_step) +
               "), fewer than the " + std::to_string(P) + " stages of spec.parallelism.pipelineParallelDegree; a "
               "pipeline needs at least as many micro-batches as stages");
  } else if (P > 1 && p.pipeline_schedule == "Interleaved1F1B" && micro_steps % P != 0) {
    c.Fail("spec.training.globalBatchTokens",
           "gives " + std::to_string(micro_steps) + " micro-batches a step, not a multiple of the " +
               std::to_string(P) + " stages, as spec.parallelism.pipelineSchedule Interleaved1F1B needs");
  }
}

void CheckParallelism(const ParallelismSpec& p, FieldChecker& c) {
  c.OneOf("spec.parallelism.mode", p.mode, {"manual", "auto"});
  c.Range("spec.parallelism.tensorParallelSeed", p.tensor_parallel_seed, 0, FieldChecker::kNoMax);
  c.Range("spec.parallelism.activationLoadingHorizon", p.activation_loading_horizon, 1, 1024);
  c.OneOf("spec.parallelism.pipelineSchedule", p.pipeline_schedule, {"GPipe", "1F1B", "Interleaved1F1B"});
  c.OneOf("spec.parallelism.contextParallelMode", p.context_parallel_mode, {"Ring", "AllToAll"});
  if (c.Range("spec.parallelism.pipelineVirtualStages", p.pipeline_virtual_stages, 1, 64)) {
    if (p.pipeline_schedule == "Interleaved1F1B" && p.pipeline_virtual_stages < 2) {
      c.Fail("spec.parallelism.pipelineVirtualStages",
             "must be 2 or more for spec.parallelism.pipelineSchedule Interleaved1F1B (chunks of blocks a rank), got " +
                 std::to_string(p.pipeline_virtual_stages));
    } else if (p.pipeline_schedule == "Interleaved1F1B" && p.pipeline_parallel_degree < 2) {
      c.Fail("spec.parallelism.pipelineSchedule",
             "Interleaved1F1B needs spec.parallelism.pipelineParallelDegree of 2 or more, got " +
                 std::to_string(p.pipeline_parallel_degree));
    } else if (p.pipeline_schedule != "Interleaved1F1B" && p.pipeline_virtual_stages > 1) {
      c.Fail("spec.parallelism.pipelineVirtualStages",
             "needs spec.parallelism.pipelineSchedule Interleaved1F1B; " + p.pipeline_schedule +
                 " runs one chunk of blocks a rank, got " + std::to_string(p.pipeline_virtual_stages));
    }
  }
  if (p.activation_offloading && !p.activation_checkpointing) {
    c.Fail("spec.parallelism.activationOffloading",
           "requires spec.parallelism.activationCheckpointing: the offloaded tensors are the checkpointed block inputs");
  }
}

void CheckCheckpoint(const CheckpointSpec& k, FieldChecker& c) {
  c.Range("spec.checkpoint.interval", k.interval, 1, FieldChecker::kNoMax);
  c.Range("spec.checkpoint.keep", k.keep, 1, 1000);
}

void CheckTopology(const TopologySpec& t, FieldChecker& c) {
  std::set<std::string> seen;
  for (size_t i = 0; i < t.levels.size(); ++i) {
    const std::string path = "spec.topology.levels[" + std::to_string(i) + "]";
    if (!IsLabelKey(t.levels[i])) c.Fail(path, "must be a node label key such as kubernetes.io/hostname, got \"" +
                                                   t.levels[i] + "\"");
    else if (!seen.insert(t.levels[i]).second) c.Fail(path, "repeats the level \"" + t.levels[i] + "\"");
  }
  c.OneOf("spec.topology.mode", t.mode, {"Required", "Preferred"});
  if (std::find(t.levels.begin(), t.levels.end(), t.required_level) == t.levels.end()) {
    c.Fail("spec.topology.requiredLevel", "must be one of spec.topology.levels, got \"" + t.required_level + "\"");
  }
}

void CheckRunPolicy(const RunPolicy& r, FieldChecker& c) {
  c.Range("spec.runPolicy.backoffLimit", r.backoff_limit, 0, 1000);
  c.Range("spec.runPolicy.hangTimeoutSeconds", r.hang_timeout_seconds, 0, FieldChecker::kNoMax);
  if (r.active_deadline_seconds) c.Range("spec.runPolicy.activeDeadlineSeconds", *r.active_deadline_seconds, 1, FieldChecker::kNoMax);
  if (r.ttl_seconds_after_finished) {
    c.Range("spec.runPolicy.ttlSecondsAfterFinished", *r.ttl_seconds_after_finished, 0, FieldChecker::kNoMax);
  }
  c.OneOf("spec.runPolicy.cleanPodPolicy", r.clean_pod_policy, {"None", "Running", "All"});
}

void CheckTemplate(const PodTemplateOverrides& t, FieldChecker& c) {
  for (size_t i = 0; i < t.tolerations.size(); ++i) {
    const Toleration& tol = t.tolerations[i];
    const std::string path = "spec.template.tolerations[" + std::to_string(i) + "]";
    c.OneOf(path + ".operator", tol.operator_, {"Equal", "Exists"});
    if (tol.operator_ == "Exists" && !tol.value.empty()) c.Fail(path + ".value", "must be empty when operator is Exists");
    if (tol.operator_ == "Equal" && tol.key.empty()) c.Fail(path + ".key", "is required when operator is Equal");
    if (!tol.key.empty() && !IsLabelKey(tol.key)) c.Fail(path + ".key", "must be a label key, got \"" + tol.key + "\"");
    if (!tol.effect.empty()) c.OneOf(path + ".effect", tol.effect, {"NoSchedule", "PreferNoSchedule", "NoExecute"});
    if (tol.toleration_seconds && tol.effect != "NoExecute") {
      c.Fail(path + ".tolerationSeconds", "is only meaningful with effect NoExecute");
    }
  }
  for (const auto& [key, value] : t.node_selector) {
    const std::string path = "spec.template.nodeSelector." + key;
    if (!IsLabelKey(key)) c.Fail(path, "is not a valid label key");
    else if (!IsLabelName(value, true)) c.Fail(path, "must be a label value (at most 63 of [-_.A-Za-z0-9]), got \"" + value + "\"");
  }
  std::set<std::string> volume_names;
  for (size_t i = 0; i < t.volumes.size(); ++i) {
    const std::string path = "spec.template.volumes[" + std::to_string(i) + "].name";
    const nlohmann::json& v = t.volumes[i];
    if (!v.contains("name") || !v["name"].is_string() || v["name"].get<std::string>().empty()) {
      c.Fail(path, "is required");
      continue;
    }
    const std::string name = v["name"].get<std::string>();
    if (!IsDnsLabel(name, 63)) c.Fail(path, "must be a DNS label, got \"" + name + "\"");
    else if (!volume_names.insert(name).second) c.Fail(path, "repeats the volume \"" + name + "\"");
  }
  for (size_t i = 0; i < t.volume_mounts.size(); ++i) {
    const VolumeMount& vm = t.volume_mounts[i];
    const std::string path = "spec.template.volumeMounts[" + std::to_string(i) + "]";
    if (!volume_names.contains(vm.name)) c.Fail(path + ".name", "names no volume in spec.template.volumes: \"" + vm.name + "\"");
    if (!vm.mount_path.starts_with("/")) c.Fail(path + ".mountPath", "must be an absolute path, got \"" + vm.mount_path + "\"");
  }
  for (size_t i = 0; i < t.env.size(); ++i) {
    const std::string path = "spec.template.env[" + std::to_string(i) + "].name";
    const std::string& name = t.env[i].name;
    if (!IsEnvName(name)) c.Fail(path, "must be a variable name ([A-Za-z_][A-Za-z0-9_]*), got \"" + name + "\"");
    else if (IsReservedEnvName(name)) c.Fail(path, "\"" + name + "\" is set by meshtrain for every worker and cannot be overridden");
  }
}

}  // namespace

FieldErrors ValidateTrainingJob(const TrainingJob& job) {
  FieldChecker c;
  const TrainingJobSpec& spec = job.spec;
  CheckMetadata(job, c);
  if (spec.image.empty()) c.Fail("spec.image", "is required: the container image that holds meshtrain-worker");
  if (spec.resources.gpu && *spec.resources.gpu != spec.gpus_per_node) {
    c.Fail("spec.resources.gpu", "must equal spec.gpusPerNode (" + std::to_string(spec.gpus_per_node) +
                                     "), one rank per GPU; got " + std::to_string(*spec.resources.gpu));
  }
  c.Range("spec.resources.efa", spec.resources.efa, 0, 64);
  if (spec.resources.memory_limit_mib) {
    c.Range("spec.resources.memoryLimitMiB", *spec.resources.memory_limit_mib, 1, int64_t(1) << 30);
  }
  CheckModel(spec.model, c);
  CheckData(spec.data, c);
  if (spec.data.attention == "document" && spec.model.tokenizer.empty()) {
    c.Fail("spec.data.attention", "document needs spec.model.tokenizer: its framing (the BOS before each document, "
                                  "or GPT-2's <|endoftext|>, or else the EOS after each) says where documents start");
  }
  CheckTraining(spec.training, c);
  CheckFloat8(spec, c);
  CheckLayout(spec, c);
  CheckParallelism(spec.parallelism, c);
  CheckCheckpoint(spec.checkpoint, c);
  CheckTopology(spec.topology, c);
  CheckRunPolicy(spec.run_policy, c);
  if (spec.elastic.min_nodes) c.Range("spec.elastic.minNodes", *spec.elastic.min_nodes, 1, spec.nodes);
  CheckTemplate(spec.template_, c);
  return c.errors;
}

FieldErrors FieldsThePlannerChooses(const TrainingJob& job, const FieldPaths& written) {
  FieldErrors errors;
  if (job.spec.parallelism.mode != "auto") return errors;
  for (const char* field : kPlannedFields) {
    if (written.contains(field)) {
      errors.push_back({field, "is chosen by the planner with spec.parallelism.mode auto; remove it, or set mode manual"});
    }
  }
  return errors;
}

}  // namespace meshtrain::api
