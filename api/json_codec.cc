#include "api/json_codec.h"

#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <set>
#include <string>
#include <string_view>

namespace meshtrain::api {

using Json = nlohmann::json;

namespace {

// dump() for messages: never throws, whatever bytes the strings hold.
std::string Dump(const Json& value) { return value.dump(-1, ' ', false, Json::error_handler_t::replace); }

}  // namespace

std::string DescribeJson(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null: return "null (an empty value)";
    case Json::value_t::boolean: return value.get<bool>() ? "boolean true" : "boolean false";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
    case Json::value_t::number_float: return "number " + Dump(value);
    case Json::value_t::string: {
      std::string s = value.get<std::string>();
      if (s.size() > 40) s = s.substr(0, 40) + "...";
      return "string " + Dump(Json(s));
    }
    case Json::value_t::array: return "a list";
    case Json::value_t::object: return "an object";
    default: return "an unsupported value";
  }
}

namespace {

template <class S, class T>
concept Is = std::same_as<std::remove_const_t<S>, T>;

// ---------------------------------------------------------------------------
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
}

template <Is<ModelSpec> S, class V>
void Fields(S& s, V& v) {
  v("preset", s.preset);
  v("layers", s.layers);
  v("heads", s.heads);
  v("hidden", s.hidden);
  v("vocabSize", s.vocab_size);
  v("seqLen", s.seq_len);
}

template <Is<DataSpec> S, class V>
void Fields(S& s, V& v) {
  v("train", s.train);
  v("validation", s.validation);
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
}

// The snake_case aliases are SageMaker model parallel v2's config keys, so an SMP
// JSON config can be pasted in unchanged. SMP v2 calls the TP seed random_seed.
template <Is<ParallelismSpec> S, class V>
void Fields(S& s, V& v) {
  v("tensorParallelDegree", s.tensor_parallel_degree, {"tensor_parallel_degree"});
  v("tensorParallelSeed", s.tensor_parallel_seed, {"tensor_parallel_seed", "random_seed"});
  v("hybridShardDegree", s.hybrid_shard_degree, {"hybrid_shard_degree"});
  v("activationCheckpointing", s.activation_checkpointing);
  v("activationOffloading", s.activation_offloading, {"sm_activation_offloading"});
  v("activationLoadingHorizon", s.activation_loading_horizon, {"activation_loading_horizon"});
  // SMP switches that do not change meshtrain's behaviour: its caches never
  // flush, and padded shards may be empty.
  v.IgnoredFlag("fsdp_cache_flush_warnings");
  v.IgnoredFlag("allow_empty_shards");
  // SMP features meshtrain does not have: accepted only at their "off" value.
  v.OnlyValue("context_parallel_degree", 1);
  v.OnlyValue("expert_parallel_degree", 1);
}

template <Is<CheckpointSpec> S, class V>
void Fields(S& s, V& v) {
  v("path", s.path);
  v("interval", s.interval);
  v("keep", s.keep);
}

template <Is<TopologySpec> S, class V>
void Fields(S& s, V& v) {
  v("levels", s.levels);
  v("mode", s.mode);
}

template <Is<RunPolicy> S, class V>
void Fields(S& s, V& v) {
  v("backoffLimit", s.backoff_limit);
  v("activeDeadlineSeconds", s.active_deadline_seconds);
  v("ttlSecondsAfterFinished", s.ttl_seconds_after_finished);
  v("suspend", s.suspend);
  v("cleanPodPolicy", s.clean_pod_policy);
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

template <Is<ProgressStatus> S, class V>
void Fields(S& s, V& v) {
  v("step", s.step);
  v("loss", s.loss);
  v("tokensPerSecond", s.tokens_per_second);
  v("etaSeconds", s.eta_seconds);
}

template <Is<TrainingJobStatus> S, class V>
void Fields(S& s, V& v) {
  v("phase", s.phase);
  v("conditions", s.conditions);
  v("observedGeneration", s.observed_generation);
  v("restarts", s.restarts);
  v("readyWorkers", s.ready_workers);
  v("startTime", s.start_time);
  v("completionTime", s.completion_time);
  v("placement", s.placement);
  v("progress", s.progress);
}

template <Is<TrainingJob> S, class V>
void Fields(S& s, V& v) {
  v("apiVersion", s.api_version);
  v("kind", s.kind);
  v("metadata", s.metadata);
  v("spec", s.spec);
  v("status", s.status);
}

// ---------------------------------------------------------------------------
// Reading.

class ObjectDecoder;

template <class T>
concept Record = requires(T& t, ObjectDecoder& d) { Fields(t, d); };

void AddError(FieldErrors* errors, std::string path, std::string message) {
  errors->push_back({std::move(path), std::move(message), FieldErrorType::kUndecodable});
}

void Read(const Json& j, const std::string& path, FieldErrors* errors, int64_t& out) {
  if (j.is_number_unsigned() && j.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
    AddError(errors, path, "is out of range, got " + DescribeJson(j));
  } else if (j.is_number_integer()) {
    out = j.get<int64_t>();
  } else {
    AddError(errors, path, "must be an integer, got " + DescribeJson(j));
  }
}

void Read(const Json& j, const std::string& path, FieldErrors* errors, double& out) {
  if (j.is_number()) {
    out = j.get<double>();
  } else {
    AddError(errors, path, "must be a number, got " + DescribeJson(j));
  }
}

void Read(const Json& j, const std::string& path, FieldErrors* errors, bool& out) {
  if (j.is_boolean()) {
    out = j.get<bool>();
  } else {
    AddError(errors, path, "must be true or false, got " + DescribeJson(j));
  }
}

void Read(const Json& j, const std::string& path, FieldErrors* errors, std::string& out) {
  if (j.is_string()) {
    out = j.get<std::string>();
  } else {
    AddError(errors, path, "must be a string, got " + DescribeJson(j));
  }
}

// Opaque Kubernetes objects (volumes) are kept as they are; the API server checks them.
void Read(const Json& j, const std::string& path, FieldErrors* errors, Json& out) {
  if (j.is_object()) {
    out = j;
  } else {
    AddError(errors, path, "must be an object, got " + DescribeJson(j));
  }
}

void Read(const Json& j, const std::string& path, FieldErrors* errors,
          std::map<std::string, std::string>& out) {
  if (!j.is_object()) {
    AddError(errors, path, "must be a map of strings, got " + DescribeJson(j));
    return;
  }
  for (const auto& [key, value] : j.items()) {
    Read(value, path + "." + key, errors, out[key]);
  }
}

template <class T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, std::vector<T>& out);
template <class T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, std::optional<T>& out);
template <Record T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, T& out);
void Read(const Json& j, const std::string& path, FieldErrors* errors, ObjectMeta& out);

// Walks one JSON object for a Fields() table. Keys that no field claims are
// reported as unknown when the decoder goes out of scope, so a table can never
// forget to check for them.
class ObjectDecoder {
 public:
  // Lenient decoders skip the unknown-field check: ObjectMeta carries server-owned fields.
  ObjectDecoder(const Json& j, std::string path, FieldErrors* errors, bool lenient = false)
      : path_(std::move(path)), errors_(errors), lenient_(lenient) {
    if (j.is_object()) {
      object_ = &j;
    } else {
      AddError(errors_, path_, "must be an object, got " + DescribeJson(j));
    }
  }

  ~ObjectDecoder() {
    if (object_ == nullptr || lenient_) return;
    for (const auto& [key, value] : object_->items()) {
      if (!claimed_.contains(key)) errors_->push_back({Child(key), "unknown field", FieldErrorType::kUnknownField});
    }
  }

  ObjectDecoder(const ObjectDecoder&) = delete;
  ObjectDecoder& operator=(const ObjectDecoder&) = delete;

  bool ok() const { return object_ != nullptr; }

  template <class T>
  void operator()(std::string_view key, T& out, std::initializer_list<std::string_view> aliases = {}) {
    const Json* found = Claim(key);
    std::string found_key(key);
    for (std::string_view alias : aliases) {
      const Json* other = Claim(alias);
      if (other == nullptr) continue;
      if (found != nullptr && *found != *other) {
        AddError(errors_, Child(alias),
                 "conflicts with " + Child(found_key) + " (" + Dump(*other) + " vs " + Dump(*found) + ")");
      } else if (found == nullptr) {
        found = other;
        found_key = alias;
      }
    }
    if (found != nullptr) Read(*found, Child(found_key), errors_, out);
  }

  // A boolean switch that is accepted but changes nothing.
  void IgnoredFlag(std::string_view key) {
    const Json* value = Claim(key);
    if (value != nullptr && !value->is_boolean()) {
      AddError(errors_, Child(key), "must be true or false, got " + DescribeJson(*value));
    }
  }

  // A key for a feature meshtrain lacks: accepted only at its neutral value.
  void OnlyValue(std::string_view key, int64_t allowed) {
    const Json* value = Claim(key);
    if (value != nullptr && !(value->is_number_integer() && value->get<int64_t>() == allowed)) {
      AddError(errors_, Child(key),
               "is not supported by meshtrain; only " + std::to_string(allowed) + " is accepted, got " +
                   DescribeJson(*value));
    }
  }

 private:
  const Json* Claim(std::string_view key) {
    if (object_ == nullptr) return nullptr;
    auto it = object_->find(key);
    if (it == object_->end()) return nullptr;
    claimed_.emplace(key);
    return &*it;
  }

  std::string Child(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }

  const Json* object_ = nullptr;
  std::string path_;
  FieldErrors* errors_;
  bool lenient_;
  std::set<std::string, std::less<>> claimed_;
};

template <class T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, std::vector<T>& out) {
  out.clear();
  if constexpr (std::is_same_v<T, std::string>) {
    if (j.is_string()) {  // `train: data/*.bin` means a list of one
      out.push_back(j.get<std::string>());
      return;
    }
  }
  if (!j.is_array()) {
    AddError(errors, path, "must be a list, got " + DescribeJson(j));
    return;
  }
  out.resize(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    Read(j[i], path + "[" + std::to_string(i) + "]", errors, out[i]);
  }
}

template <class T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, std::optional<T>& out) {
  if (j.is_null()) {
    out.reset();
    return;
  }
  T value{};
  const size_t before = errors->size();
  Read(j, path, errors, value);
  if (errors->size() == before) out = std::move(value);
}

template <Record T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, T& out) {
  ObjectDecoder decoder(j, path, errors);
  if (decoder.ok()) Fields(out, decoder);
}

void Read(const Json& j, const std::string& path, FieldErrors* errors, ObjectMeta& out) {
  ObjectDecoder decoder(j, path, errors, /*lenient=*/true);
  if (decoder.ok()) Fields(out, decoder);
}

// ---------------------------------------------------------------------------
// Writing.

class ObjectEncoder;

template <class T>
concept EncodableRecord = requires(const T& t, ObjectEncoder& e) { Fields(t, e); };

template <class T>
bool IsEmpty(const T& value) {
  if constexpr (requires { value.has_value(); }) {
    return !value.has_value();
  } else if constexpr (requires { value.empty(); } && !std::is_same_v<T, Json>) {
    return value.empty();
  } else {
    return false;
  }
}

template <class T>
Json Write(const T& value);

class ObjectEncoder {
 public:
  explicit ObjectEncoder(Json& out) : out_(out) { out_ = Json::object(); }

  template <class T>
  void operator()(std::string_view key, const T& value, std::initializer_list<std::string_view> = {}) {
    if (!IsEmpty(value)) out_[std::string(key)] = Write(value);
  }
  void IgnoredFlag(std::string_view) {}
  void OnlyValue(std::string_view, int64_t) {}

 private:
  Json& out_;
};

template <class T>
Json Write(const T& value) {
  if constexpr (EncodableRecord<T>) {
    Json out;
    ObjectEncoder encoder(out);
    Fields(value, encoder);
    return out;
  } else if constexpr (requires { value.has_value(); }) {
    return Write(*value);
  } else if constexpr (requires { typename T::value_type; } && !std::is_same_v<T, std::string> &&
                       !std::is_same_v<T, Json> &&
                       !requires { typename T::mapped_type; }) {
    Json out = Json::array();
    for (const auto& item : value) out.push_back(Write(item));
    return out;
  } else {
    return Json(value);
  }
}

}  // namespace

TrainingJob DecodeTrainingJob(const Json& object, FieldErrors* errors) {
  TrainingJob job;
  Read(object, "", errors, job);
  return job;
}

TrainingJobStatus DecodeTrainingJobStatus(const Json& object, FieldErrors* errors) {
  TrainingJobStatus status;
  Read(object, "status", errors, status);
  return status;
}

Json ToJson(const TrainingJob& job) {
  Json out = Write(job);
  if (job.status == TrainingJobStatus{}) out.erase("status");
  return out;
}

Json ToJson(const TrainingJobSpec& spec) { return Write(spec); }
Json ToJson(const TrainingJobStatus& status) { return Write(status); }

}  // namespace meshtrain::api
