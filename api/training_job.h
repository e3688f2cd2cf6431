// The meshtrain.dev/v1alpha1 TrainingJob resource: plain C++ types for its spec and status.
//
// These are value types with no behaviour. Their JSON field names live in json_codec.cc;
// defaults are the member initialisers below plus the derived ones that ApplyDefaults()
// fills in (defaults.h). Thread-safety: none needed, they are plain values.

#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace meshtrain::api {

inline constexpr std::string_view kGroup = "meshtrain.dev";
inline constexpr std::string_view kVersion = "v1alpha1";
inline constexpr std::string_view kApiVersion = "meshtrain.dev/v1alpha1";
inline constexpr std::string_view kKind = "TrainingJob";
inline constexpr std::string_view kPlural = "trainingjobs";
inline constexpr std::string_view kShortName = "tj";

// The subset of Kubernetes ObjectMeta that meshtrain reads. Other metadata
// fields (managedFields, finalizers, ...) belong to the API server and are ignored.
struct ObjectMeta {
  std::string name;
  std::string namespace_;
  std::string uid;
  std::string resource_version;
  int64_t generation = 0;
  std::string creation_timestamp;
  std::map<std::string, std::string> labels;
  std::map<std::string, std::string> annotations;
  bool operator==(const ObjectMeta&) const = default;
};

// Per-pod device requests. gpu defaults to spec.gpusPerNode.
struct ResourceSpec {
  std::optional<int64_t> gpu;
  int64_t efa = 0;  // vpc.amazonaws.com/efa interfaces per pod
  // The most memory one rank's engine allocator may hold, in MiB (host memory on the
  // CPU); unset: no limit beyond $MESHTRAIN_MEMORY_LIMIT_MIB, which tests set.
  std::optional<int64_t> memory_limit_mib;
  bool operator==(const ResourceSpec&) const = default;
};

// Where the weights of a new run come from (a resumed run takes its checkpoint's).
struct ModelInitSpec {
  // A Hugging Face model directory (config.json with model.safetensors, or
  // model.safetensors.index.json and its shards), or a single GPT-2 safetensors file;
  // empty: the seeded initialisation.
  std::string from;
  bool operator==(const ModelInitSpec&) const = default;
};

// Hugging Face's rope_scaling (api/model_shape.h, RopeScaling).
struct RopeScalingSpec {
  std::string type;  // linear | llama3
  std::optional<double> factor;
  std::optional<double> low_freq_factor;
  std::optional<double> high_freq_factor;
  std::optional<int64_t> original_max_positions;
  bool operator==(const RopeScalingSpec&) const = default;
};

// A model preset name, or an explicit shape; explicit fields override the preset's. The
// fields after seqLen belong to the Llama-class families (api/model_shape.h); on GPT-2
// they may only restate GPT-2's own values.
struct ModelSpec {
  std::string preset;
  std::string family;  // gpt2 | llama | mistral | qwen2 | qwen3 | mixtral | qwen3-moe; default: the preset's, else gpt2
  std::optional<int64_t> layers;
  std::optional<int64_t> heads;
  std::optional<int64_t> hidden;
  std::optional<int64_t> vocab_size;
  std::optional<int64_t> seq_len;  // the training window
  std::optional<int64_t> kv_heads;
  std::optional<int64_t> head_dim;
  std::optional<int64_t> intermediate_size;
  std::optional<int64_t> max_positions;
  std::optional<double> norm_eps;
  std::optional<double> rope_theta;
  std::optional<RopeScalingSpec> rope_scaling;
  std::optional<bool> tie_embeddings;
  // A mixture of experts (the families mixtral and qwen3-moe; api/model_shape.h): config.json's
  // num_local_experts or num_experts, num_experts_per_tok, moe_intermediate_size,
  // norm_topk_prob, decoder_sparse_step and mlp_only_layers.
  std::optional<int64_t> experts;
  std::optional<int64_t> experts_per_token;
  std::optional<int64_t> moe_intermediate_size;
  std::optional<bool> norm_topk_prob;
  std::optional<int64_t> decoder_sparse_step;
  std::vector<int64_t> mlp_only_layers;
  // Whether these fields make some blocks dense (api::ModelShape::DenseBlock): a block
  // listed in mlp_only_layers, or a decoder_sparse_step above 1.
  bool NamesDenseBlocks() const { return !mlp_only_layers.empty() || decoder_sparse_step.value_or(1) > 1; }
  // The probability of dropping an element of each block's attention output and of the
  // attention and MLP outputs added to the residual stream, in training; masks are keyed
  // by spec.parallelism.tensorParallelSeed.
  double dropout = 0;
  ModelInitSpec init;
  // A directory with the model's tokenizer (tokenizer.json, else SentencePiece's
  // tokenizer.model, else GPT-2's encoder.json and vocab.bpe): samples are decoded to text. Empty: byte tokens are text, larger vocabularies print ids.
  std::string tokenizer;
  bool operator==(const ModelSpec&) const = default;
};

// Token files or glob patterns. A single string is accepted where a list is expected.
struct DataSpec {
  std::vector<std::string> train;
  std::vector<std::string> validation;
  // auto: each file's header says (meshtrain's MTOK or llm.c's); uint16: raw uint16
  // tokens with no header (nanoGPT's train.bin), which nothing in the file announces.
  std::string format = "auto";
  // causal: a token attends to every earlier token of its window; document: only to the
  // earlier tokens of its own document, whose positions start at 0 (documents start where
  // the tokenizer's framing puts them: docs/trainingjob.md, spec.data).
  std::string attention = "causal";
  bool operator==(const DataSpec&) const = default;
};

// Float8 training's settings (spec.training.float8), acted on where precision is fp8.
struct Float8Spec {
  // tensorwise: one scale per tensor, E4M3 for inputs and weights, E5M2 for gradients;
  // rowwise: E4M3 throughout, a power-of-2 scale per row (torchao's recipes).
  std::string recipe = "tensorwise";
  bool operator==(const Float8Spec&) const = default;
};

// globalBatchTokens, microBatchSize and warmupSteps that the user did not write are
// derived from what was written, so that they always fit (ApplyDefaults); their
// initialisers are the usual values the derivation aims for.
struct TrainingSpec {
  int64_t steps = 1000;
  int64_t global_batch_tokens = 524288;  // about 0.5M tokens, as GPT-2 and GPT-3 small
  int64_t micro_batch_size = 8;
  double learning_rate = 6e-4;
  int64_t warmup_steps = 100;
  std::string schedule = "cosine";  // cosine | constant
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // 0 disables clipping
  int64_t seed = 1337;
  // auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp8 (the blocks' linear layers in
  // float8 by spec.training.float8's recipe, the rest as auto: bf16 on CUDA, fp32 on CPU)
  std::string precision = "auto";
  Float8Spec float8;
  int64_t eval_interval = 100;     // steps between validation losses; 0: only after the last step
  int64_t eval_batches = 10;       // micro-batches per validation loss
  // A mixture of experts' load-balancing loss: coef x transformers' load_balancing_loss_func,
  // added to the loss training minimises. Unset: config.json's router_aux_loss_coef where
  // its output_router_logits is true, else off.
  std::optional<double> router_aux_loss_coef;
  bool operator==(const TrainingSpec&) const = default;
};

// Also accepts the SageMaker model parallel v2 keys (tensor_parallel_degree, ...).
struct ParallelismSpec {
  // manual: the fields below as written; auto: the planner (operator/scheduler/planner.h)
  // chooses them and spec.training.microBatchSize when the job is placed, and they must
  // not be written.
  std::string mode = "manual";
  int64_t tensor_parallel_degree = 1;
  int64_t tensor_parallel_seed = 0;
  int64_t hybrid_shard_degree = 0;  // 0: shard across all data-parallel ranks
  bool activation_checkpointing = false;  // not written: on when activationOffloading is (as in SMP v2)
  bool activation_offloading = false;
  int64_t activation_loading_horizon = 2;
  // Stages of consecutive blocks (the outermost axis of the layout); the step's
  // micro-batches flow through them as the schedule says: GPipe (every forward, then
  // every backward), 1F1B (one forward, one backward once the pipeline is full) or
  // Interleaved1F1B (1F1B over pipelineVirtualStages chunks of blocks a rank).
  int64_t pipeline_parallel_degree = 1;
  std::string pipeline_schedule = "1F1B";
  int64_t pipeline_virtual_stages = 1;
  // Ranks that split each sequence (C; api/layout.h), and how attention crosses them:
  // Ring (key/value blocks circulate) or AllToAll (Ulysses: sequence-split q, k, v become
  // head-split for attention, and back).
  int64_t context_parallel_degree = 1;
  std::string context_parallel_mode = "Ring";
  // Ranks that split each mixture-of-experts block's experts (EP; api/layout.h): each
  // holds experts / EP of them, and tokens travel to their experts' ranks and back.
  int64_t expert_parallel_degree = 1;
  bool operator==(const ParallelismSpec&) const = default;
};

struct CheckpointSpec {
  std::string path;       // empty: no checkpoints
  int64_t interval = 1000;  // steps between checkpoints
  int64_t keep = 2;       // newest checkpoints kept on disk
  // true: start from the newest intact checkpoint under path, if any; false: only from
  // this run's own (metadata.uid's), so a gang restart still keeps its steps.
  bool resume = true;
  bool operator==(const CheckpointSpec&) const = default;
};

// Node-label levels from the outermost network domain to the node itself.
// With mode Required the whole gang must share one domain of requiredLevel;
// with Preferred placement falls back level by level up to the whole cluster.
struct TopologySpec {
  std::vector<std::string> levels;  // default: DefaultTopologyLevels()
  std::string mode = "Preferred";   // Required | Preferred
  std::string required_level;       // default: the deepest level above the node (levels[n-2])
  bool operator==(const TopologySpec&) const = default;
};

struct RunPolicy {
  int64_t backoff_limit = 3;
  // A rank that completes no step for this long (or whose heartbeat stops) fails the
  // gang, named as stuck (worker/comm/heartbeat.h); 0: no hang detection.
  int64_t hang_timeout_seconds = 300;
  std::optional<int64_t> active_deadline_seconds;
  std::optional<int64_t> ttl_seconds_after_finished;
  bool suspend = false;
  std::string clean_pod_policy = "Running";  // None | Running | All
  bool operator==(const RunPolicy&) const = default;
};

// What the operator may do when nodes are lost and no replacement exists.
struct ElasticSpec {
  // Unset: the job waits for nodes, Pending. Set: it runs on fewer nodes, down to this
  // many, with the same global batch through more accumulation, and grows back to
  // spec.nodes at a checkpoint once they fit again (torchrun's --nnodes=MIN:MAX).
  std::optional<int64_t> min_nodes;
  bool operator==(const ElasticSpec&) const = default;
};

struct Toleration {
  std::string key;
  std::string operator_ = "Equal";  // Equal | Exists
  std::string value;
  std::string effect;  // "" (all) | NoSchedule | PreferNoSchedule | NoExecute
  std::optional<int64_t> toleration_seconds;
  bool operator==(const Toleration&) const = default;
};

struct EnvVar {
  std::string name;
  std::string value;
  bool operator==(const EnvVar&) const = default;
};

struct VolumeMount {
  std::string name;
  std::string mount_path;
  bool read_only = false;
  bool operator==(const VolumeMount&) const = default;
};

// Overrides merged into every worker pod. Volumes are Kubernetes Volume objects,
// passed through as JSON (each must have a name).
struct PodTemplateOverrides {
  std::vector<Toleration> tolerations;
  std::map<std::string, std::string> node_selector;
  std::vector<nlohmann::json> volumes;
  std::vector<VolumeMount> volume_mounts;
  std::vector<EnvVar> env;
  bool operator==(const PodTemplateOverrides&) const = default;
};

struct TrainingJobSpec {
  std::string image;
  int64_t nodes = 1;
  int64_t gpus_per_node = 1;
  ResourceSpec resources;
  ModelSpec model;
  DataSpec data;
  TrainingSpec training;
  ParallelismSpec parallelism;
  CheckpointSpec checkpoint;
  TopologySpec topology;
  RunPolicy run_policy;
  ElasticSpec elastic;
  PodTemplateOverrides template_;
  bool operator==(const TrainingJobSpec&) const = default;
};

struct Condition {
  std::string type;
  std::string status;  // True | False | Unknown
  std::string reason;
  std::string message;
  std::string last_transition_time;  // RFC 3339
  int64_t observed_generation = 0;
  bool operator==(const Condition&) const = default;
};

struct PlacedNode {
  int64_t node_rank = 0;
  std::string name;
  std::vector<std::string> topology_path;
  bool operator==(const PlacedNode&) const = default;
};

struct PlacementStatus {
  std::vector<PlacedNode> nodes;
  double cost_seconds_per_step = 0;
  bool operator==(const PlacementStatus&) const = default;
};

// The layout the planner chose for spec.parallelism.mode auto, and what it predicted; or,
// for an elastic job (spec.elastic), the layout the gang runs at its current size.
struct LayoutStatus {
  int64_t tensor_parallel_degree = 1;
  int64_t hybrid_shard_degree = 1;
  int64_t pipeline_parallel_degree = 1;
  std::string pipeline_schedule = "1F1B";
  int64_t pipeline_virtual_stages = 1;
  int64_t micro_batch_size = 1;
  bool activation_checkpointing = false;
  bool activation_offloading = false;
  int64_t activation_loading_horizon = 0;  // 0 without offloading
  int64_t context_parallel_degree = 1;       // C: ranks that split each sequence
  std::string context_parallel_mode = "Ring";
  int64_t expert_parallel_degree = 1;        // EP: ranks that split each block's experts
  std::string device;                        // the device model it planned for
  int64_t predicted_memory_bytes = 0;        // per rank, at the peak
  double predicted_step_seconds = 0;
  double predicted_tokens_per_second = 0;
  int64_t nodes = 0;  // the gang's size: spec.nodes, or fewer while shrunk (spec.elastic)
  bool operator==(const LayoutStatus&) const = default;
};

struct ProgressStatus {
  int64_t step = 0;
  double loss = 0;
  double tokens_per_second = 0;
  int64_t eta_seconds = 0;
  std::optional<int64_t> resumed_from_step;  // the checkpoint the running gang started from
  std::optional<int64_t> checkpoint_step;    // the newest checkpoint written
  std::optional<int64_t> damaged_checkpoints;  // newer checkpoints the resume skipped as damaged
  bool operator==(const ProgressStatus&) const = default;
};

// A value that ApplyDefaults derived from other fields, shown to the user and kept in
// status so that what the job runs with is never a surprise.
struct DerivedDefault {
  std::string field;   // "spec.training.warmupSteps"
  std::string value;   // "1"
  std::string reason;  // "a tenth of spec.training.steps (10), at most 100"
  bool operator==(const DerivedDefault&) const = default;
};

struct TrainingJobStatus {
  std::string phase;  // Pending | Queued | Starting | Running | Restarting | Succeeded | Failed | Suspended
  std::vector<Condition> conditions;
  int64_t observed_generation = 0;
  // Every restart of the gang, in place or with new pods; the attempt its launchers follow.
  int64_t restarts = 0;
  // The restarts that a failure caused (not a re-plan, not growing back): what
  // spec.runPolicy.backoffLimit limits.
  int64_t failures = 0;
  // Which set of pods runs the job (their names and gang label): it changes when the gang
  // is recreated, not when it restarts in place. Unset until the operator places the job's
  // first gang; the operator reads an unset gang as `restarts` (controller::GangOf).
  std::optional<int64_t> gang;
  // When the failure that restarted the running gang was seen (MicroTime); cleared once
  // the gang trains a step, which measures the recovery.
  std::string last_failure_time;
  int64_t ready_workers = 0;
  std::string start_time;
  std::string completion_time;
  std::optional<PlacementStatus> placement;
  std::optional<LayoutStatus> layout;  // with spec.parallelism.mode auto
  std::optional<ProgressStatus> progress;
  std::vector<DerivedDefault> defaults;  // the values derived for fields the spec left out
  bool operator==(const TrainingJobStatus&) const = default;
};

struct TrainingJob {
  std::string api_version{kApiVersion};
  std::string kind{kKind};
  ObjectMeta metadata;
  TrainingJobSpec spec;
  TrainingJobStatus status;
  bool operator==(const TrainingJob&) const = default;
};

// EKS's network topology labels, outermost first, then the node itself.
std::vector<std::string> DefaultTopologyLevels();

}  // namespace meshtrain::api
