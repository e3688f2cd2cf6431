#include "api/json_codec.h"

#include "api/json_fields.h"

namespace meshtrain::api {

using json_fields::Is;
using Json = nlohmann::json;

// Field tables: the single place where JSON names meet C++ members. Each one is
// visited by ObjectDecoder (reading) and ObjectEncoder (writing).

template <Is<ObjectMeta> S, class V>
void Fields(S& s, V& v) {
  v("name", s.name);
  v("namespace", s.namespace_);
  v("uid", s.uid);
  v("resourceVersion", s.resource_version);
  v("generation", s.generation);
  v("creationTimestamp", s.creation_timestamp);
  v("labels", s.labels);
  v("annotations", s.annotations);
}

template <Is<ResourceSpec> S, class V>
void Fields(S& s, V& v) {
  v("gpu", s.gpu);
  v("efa", s.efa);
  v("memoryLimitMiB", s.memory_limit_mib);
}

template <Is<ModelInitSpec> S, class V>
void Fields(S& s, V& v) {
  v("from", s.from);
}

template <Is<RopeScalingSpec> S, class V>
void Fields(S& s, V& v) {
  v("type", s.type);
  v("factor", s.factor);
  v("lowFreqFactor", s.low_freq_factor);
  v("highFreqFactor", s.high_freq_factor);
  v("originalMaxPositions", s.original_max_positions);
}

template <Is<ModelSpec> S, class V>
void Fields(S& s, V& v) {
  v("preset", s.preset);
  v("family", s.family);
  v("layers", s.layers);
  v("heads", s.heads);
  v("hidden", s.hidden);
  v("vocabSize", s.vocab_size);
  v("seqLen", s.seq_len);
  v("kvHeads", s.kv_heads);
  v("headDim", s.head_dim);
  v("intermediateSize", s.intermediate_size);
  v("maxPositions", s.max_positions);
  v("normEps", s.norm_eps);
  v("ropeTheta", s.rope_theta);
  v("ropeScaling", s.rope_scaling);
  v("tieEmbeddings", s.tie_embeddings);
  v("experts", s.experts);
  v("expertsPerToken", s.experts_per_token);
  v("moeIntermediateSize", s.moe_intermediate_size);
  v("normTopkProb", s.norm_topk_prob);
  v("decoderSparseStep", s.decoder_sparse_step);
  v("mlpOnlyLayers", s.mlp_only_layers);
  v("dropout", s.dropout);
  v("init", s.init);
  v("tokenizer", s.tokenizer);
}

template <Is<DataSpec> S, class V>
void Fields(S& s, V& v) {
  v("train", s.train);
  v("validation", s.validation);
  v("format", s.format);
  v("attention", s.attention);
}

template <Is<Float8Spec> S, class V>
void Fields(S& s, V& v) {
  v("recipe", s.recipe);
}

template <Is<TrainingSpec> S, class V>
void Fields(S& s, V& v) {
  v("steps", s.steps);
  v("globalBatchTokens", s.global_batch_tokens);
  v("microBatchSize", s.micro_batch_size);
  v("learningRate", s.learning_rate);
  v("warmupSteps", s.warmup_steps);
  v("schedule", s.schedule);
  v("weightDecay", s.weight_decay);
  v("gradClip", s.grad_clip);
  v("seed", s.seed);
  v("precision", s.precision);
  v("float8", s.float8);
  v("evalInterval", s.eval_interval);
  v("evalBatches", s.eval_batches);
  v("routerAuxLossCoef", s.router_aux_loss_coef);
}

// The snake_case aliases are SageMaker model parallel v2's config keys, so an SMP
// JSON config can be pasted in unchanged. SMP v2 calls the TP seed random_seed.
template <Is<ParallelismSpec> S, class V>
void Fields(S& s, V& v) {
  v("mode", s.mode);
  v("tensorParallelDegree", s.tensor_parallel_degree, {"tensor_parallel_degree"});
  v("tensorParallelSeed", s.tensor_parallel_seed, {"tensor_parallel_seed", "random_seed"});
  v("hybridShardDegree", s.hybrid_shard_degree, {"hybrid_shard_degree"});
  v("activationCheckpointing", s.activation_checkpointing);
  v("activationOffloading", s.activation_offloading, {"sm_activation_offloading"});
  v("activationLoadingHorizon", s.activation_loading_horizon, {"activation_loading_horizon"});
  v("pipelineParallelDegree", s.pipeline_parallel_degree, {"pipeline_parallel_degree"});
  v("pipelineSchedule", s.pipeline_schedule);
  v("pipelineVirtualStages", s.pipeline_virtual_stages);
  v("contextParallelDegree", s.context_parallel_degree, {"context_parallel_degree"});
  v("contextParallelMode", s.context_parallel_mode);
  v("expertParallelDegree", s.expert_parallel_degree, {"expert_parallel_degree"});
  // SMP switches that do not change meshtrain's behaviour: its caches never
  // flush, and padded shards may be empty.
  v.IgnoredFlag("fsdp_cache_flush_warnings");
  v.IgnoredFlag("allow_empty_shards");
}

template <Is<CheckpointSpec> S, class V>
void Fields(S& s, V& v) {
  v("path", s.path);
  v("interval", s.interval);
  v("keep", s.keep);
  v("resume", s.resume);
}

template <Is<TopologySpec> S, class V>
void Fields(S& s, V& v) {
  v("levels", s.levels);
  v("mode", s.mode);
  v("requiredLevel", s.required_level);
}

template <Is<RunPolicy> S, class V>
void Fields(S& s, V& v) {
  v("backoffLimit", s.backoff_limit);
  v("hangTimeoutSeconds", s.hang_timeout_seconds);
  v("activeDeadlineSeconds", s.active_deadline_seconds);
  v("ttlSecondsAfterFinished", s.ttl_seconds_after_finished);
  v("suspend", s.suspend);
  v("cleanPodPolicy", s.clean_pod_policy);
}

template <Is<ElasticSpec> S, class V>
void Fields(S& s, V& v) {
  v("minNodes", s.min_nodes);
}

template <Is<Toleration> S, class V>
void Fields(S& s, V& v) {
  v("key", s.key);
  v("operator", s.operator_);
  v("value", s.value);
  v("effect", s.effect);
  v("tolerationSeconds", s.toleration_seconds);
}

template <Is<EnvVar> S, class V>
void Fields(S& s, V& v) {
  v("name", s.name);
  v("value", s.value);
}

template <Is<VolumeMount> S, class V>
void Fields(S& s, V& v) {
  v("name", s.name);
  v("mountPath", s.mount_path);
  v("readOnly", s.read_only);
}

template <Is<PodTemplateOverrides> S, class V>
void Fields(S& s, V& v) {
  v("tolerations", s.tolerations);
  v("nodeSelector", s.node_selector);
  v("volumes", s.volumes);
  v("volumeMounts", s.volume_mounts);
  v("env", s.env);
}

template <Is<TrainingJobSpec> S, class V>
void Fields(S& s, V& v) {
  v("image", s.image);
  v("nodes", s.nodes);
  v("gpusPerNode", s.gpus_per_node);
  v("resources", s.resources);
  v("model", s.model);
  v("data", s.data);
  v("training", s.training);
  v("parallelism", s.parallelism);
  v("checkpoint", s.checkpoint);
  v("topology", s.topology);
  v("runPolicy", s.run_policy);
  v("elastic", s.elastic);
  v("template", s.template_);
}

template <Is<Condition> S, class V>
void Fields(S& s, V& v) {
  v("type", s.type);
  v("status", s.status);
  v("reason", s.reason);
  v("message", s.message);
  v("lastTransitionTime", s.last_transition_time);
  v("observedGeneration", s.observed_generation);
}

template <Is<PlacedNode> S, class V>
void Fields(S& s, V& v) {
  v("nodeRank", s.node_rank);
  v("name", s.name);
  v("topologyPath", s.topology_path);
}

template <Is<PlacementStatus> S, class V>
void Fields(S& s, V& v) {
  v("nodes", s.nodes);
  v("costSecondsPerStep", s.cost_seconds_per_step);
}

template <Is<LayoutStatus> S, class V>
void Fields(S& s, V& v) {
  v("nodes", s.nodes);
  v("tensorParallelDegree", s.tensor_parallel_degree);
  v("hybridShardDegree", s.hybrid_shard_degree);
  v("pipelineParallelDegree", s.pipeline_parallel_degree);
  v("pipelineSchedule", s.pipeline_schedule);
  v("pipelineVirtualStages", s.pipeline_virtual_stages);
  v("microBatchSize", s.micro_batch_size);
  v("activationCheckpointing", s.activation_checkpointing);
  v("activationOffloading", s.activation_offloading);
  v("activationLoadingHorizon", s.activation_loading_horizon);
  v("contextParallelDegree", s.context_parallel_degree);
  v("contextParallelMode", s.context_parallel_mode);
  v("expertParallelDegree", s.expert_parallel_degree);
  v("device", s.device);
  v("predictedMemoryBytes", s.predicted_memory_bytes);
  v("predictedStepSeconds", s.predicted_step_seconds);
  v("predictedTokensPerSecond", s.predicted_tokens_per_second);
}

template <Is<ProgressStatus> S, class V>
void Fields(S& s, V& v) {
  v("step", s.step);
  v("loss", s.loss);
  v("tokensPerSecond", s.tokens_per_second);
  v("etaSeconds", s.eta_seconds);
  v("resumedFromStep", s.resumed_from_step);
  v("checkpointStep", s.checkpoint_step);
  v("damagedCheckpoints", s.damaged_checkpoints);
}

template <Is<DerivedDefault> S, class V>
void Fields(S& s, V& v) {
  v("field", s.field);
  v("value", s.value);
  v("reason", s.reason);
}

template <Is<TrainingJobStatus> S, class V>
void Fields(S& s, V& v) {
  v("phase", s.phase);
  v("conditions", s.conditions);
  v("observedGeneration", s.observed_generation);
  v("restarts", s.restarts);
  v("failures", s.failures);
  v("gang", s.gang);
  v("lastFailureTime", s.last_failure_time);
  v("readyWorkers", s.ready_workers);
  v("startTime", s.start_time);
  v("completionTime", s.completion_time);
  v("placement", s.placement);
  v("layout", s.layout);
  v("progress", s.progress);
  v("defaults", s.defaults);
}

template <Is<TrainingJob> S, class V>
void Fields(S& s, V& v) {
  v("apiVersion", s.api_version);
  v("kind", s.kind);
  v("metadata", s.metadata);
  v("spec", s.spec);
  v("status", s.status);
}

// ObjectMeta carries fields owned by the API server (managedFields, finalizers, ...).
template <>
inline constexpr bool json_fields::kIgnoresUnknownFields<ObjectMeta> = true;

TrainingJob DecodeTrainingJob(const Json& object, FieldErrors* errors) {
  return json_fields::Decode<TrainingJob>(object, "", errors);
}

FieldPaths WrittenFields(const Json& object) { return json_fields::WrittenFields<TrainingJob>(object); }

TrainingJobStatus DecodeTrainingJobStatus(const Json& object, FieldErrors* errors) {
  return json_fields::Decode<TrainingJobStatus>(object, "status", errors);
}

Json ToJson(const TrainingJob& job) {
  Json out = json_fields::Encode(job);
  if (job.status == TrainingJobStatus{}) out.erase("status");
  return out;
}

Json ToJson(const ModelSpec& model) { return json_fields::Encode(model); }

ModelSpec DecodeModelSpec(const Json& object, const std::string& path, FieldErrors* errors) {
  return json_fields::Decode<ModelSpec>(object, path, errors);
}

Json ToJson(const TrainingJobSpec& spec) { return json_fields::Encode(spec); }
Json ToJson(const TrainingJobStatus& status) { return json_fields::Encode(status); }

Json ToJson(const ProgressStatus& progress) { return json_fields::Encode(progress); }

ProgressStatus DecodeProgressStatus(const Json& object, FieldErrors* errors) {
  return json_fields::Decode<ProgressStatus>(object, "status.progress", errors);
}

}  // namespace meshtrain::api
