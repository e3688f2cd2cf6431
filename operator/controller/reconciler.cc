#include "operator/controller/reconciler.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include <cpprest/http_client.h>
#include <spdlog/spdlog.h>

#include "api/json_codec.h"
#include "api/manifest.h"
#include "operator/controller/builders.h"
#include "operator/kube/objects.h"
#include "operator/kube/time.h"
#include "operator/scheduler/cluster.h"
#include "operator/scheduler/cost_model.h"
#include "operator/scheduler/placement.h"

namespace meshtrain::controller {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace res = kube::resources;

namespace {

std::string Phase(const json& pod) { return pod.value("status", json::object()).value("phase", ""); }

int64_t Gang(const json& pod) {
  const auto labels = pod["metadata"].value("labels", json::object());
  try {
    return std::stoll(labels.value(kGangLabel, "-1"));
  } catch (const std::exception&) {
    return -1;
  }
}

std::optional<int> ExitCode(const json& pod) {
  for (const auto& cs : pod.value("status", json::object()).value("containerStatuses", json::array())) {
    const json state = cs.value("state", json::object());
    if (state.contains("terminated")) return state["terminated"].value("exitCode", 0);
  }
  return std::nullopt;
}

void SetCondition(api::TrainingJobStatus& status, const std::string& type, bool value, const std::string& reason,
                  const std::string& message, int64_t generation) {
  const std::string s = value ? "True" : "False";
  for (auto& c : status.conditions) {
    if (c.type != type) continue;
    if (c.status != s) c.last_transition_time = kube::Rfc3339Now();
    c.status = s;
    c.reason = reason;
    c.message = message;
    c.observed_generation = generation;
    return;
  }
  status.conditions.push_back({type, s, reason, message, kube::Rfc3339Now(), generation});
}

bool Finished(const std::string& phase) { return phase == "Succeeded" || phase == "Failed"; }

}  // namespace

struct Reconciler::Context {
  std::string ns, name, key;
  json object;
  api::TrainingJob job;
  api::TrainingJobStatus status;
  api::TrainingJobStatus before;
  std::vector<json> pods;  // owned by this job, every gang
  ReconcileResult result;
  // Events that report a status change: emitted once the status write succeeds, so a
  // conflicting write, which is retried, never repeats them.
  struct PendingEvent {
    std::string type, reason, message;
  };
  std::vector<PendingEvent> events_after_status;

  int64_t generation() const { return job.metadata.generation; }
  void Requeue(std::chrono::milliseconds after) {
    if (result.requeue_after.count() == 0 || after < result.requeue_after) result.requeue_after = after;
  }
};

Reconciler::Reconciler(kube::Client& client, kube::Informer& jobs, kube::Informer& pods, kube::Informer& nodes,
                       OperatorMetrics* metrics, ReconcilerOptions options)
    : client_(client), jobs_(jobs), pods_(pods), nodes_(nodes), metrics_(metrics), options_(std::move(options)) {}

void Reconciler::Event(const Context& ctx, const std::string& type, const std::string& reason,
                       const std::string& message) {
  const std::string now = kube::Rfc3339Now();
  json event = {{"apiVersion", "v1"},
                {"kind", "Event"},
                {"metadata", {{"generateName", ctx.name + "."}, {"namespace", ctx.ns}}},
                {"involvedObject",
                 {{"apiVersion", std::string(api::kApiVersion)}, {"kind", std::string(api::kKind)}, {"name", ctx.name},
                  {"namespace", ctx.ns}, {"uid", ctx.job.metadata.uid},
                  {"resourceVersion", ctx.job.metadata.resource_version}}},
                {"type", type},
                {"reason", reason},
                {"message", message},
                {"source", {{"component", options_.component}}},
                {"firstTimestamp", now},
                {"lastTimestamp", now},
                {"count", 1}};
  try {
    client_.Create(res::Events(), ctx.ns, event);
  } catch (const std::exception& e) {
    spdlog::warn("{}: recording event {}: {}", ctx.key, reason, e.what());  // events are best effort
  }
}

void Reconciler::DeletePods(const std::vector<json>& pods) {
  for (const auto& pod : pods) {
    try {
      client_.Delete(res::Pods(), pod["metadata"].value("namespace", ""), pod["metadata"].value("name", ""));
    } catch (const kube::KubeError& e) {
      if (e.kind() != kube::ErrorKind::kNotFound) throw;
    }
  }
}

std::set<std::string> Reconciler::AvoidedNodes(const std::string& job_key) {
  std::lock_guard lock(mu_);
  std::set<std::string> out;
  auto& nodes = avoid_[job_key];
  for (auto it = nodes.begin(); it != nodes.end();) {
    if (Clock::now() - it->second > options_.avoid_failed_node) {
      it = nodes.erase(it);
    } else {
      out.insert(it->first);
      ++it;
    }
  }
  return out;
}

void Reconciler::Fail(Context& ctx, const std::string& reason, const std::string& message) {
  DeletePods(ctx.pods);
  ctx.status.phase = "Failed";
  ctx.status.ready_workers = 0;
  ctx.status.completion_time = kube::Rfc3339Now();
  SetCondition(ctx.status, "Failed", true, reason, message, ctx.generation());
  SetCondition(ctx.status, "Running", false, reason, message, ctx.generation());
}

void Reconciler::Restart(Context& ctx, const std::string& reason, const std::string& message,
                         const std::string& bad_node, bool failure) {
  if (failure && ctx.status.restarts + 1 > ctx.job.spec.run_policy.backoff_limit) {
    return Fail(ctx, "BackoffLimitExceeded",
                message + "; the gang already restarted " + std::to_string(ctx.status.restarts) +
                    " times (backoffLimit " + std::to_string(ctx.job.spec.run_policy.backoff_limit) + ")");
  }
  if (!bad_node.empty()) {
    std::lock_guard lock(mu_);
    avoid_[ctx.key][bad_node] = Clock::now();
  }
  DeletePods(ctx.pods);
  // Every new gang gets the next number, so its pod names never meet the old gang's.
  ctx.status.restarts += 1;
  if (metrics_) metrics_->GangRestarted();
  ctx.status.phase = "Restarting";
  ctx.status.ready_workers = 0;
  ctx.status.placement.reset();
  SetCondition(ctx.status, "Restarting", true, reason, message, ctx.generation());
  SetCondition(ctx.status, "Running", false, reason, message, ctx.generation());
  Event(ctx, "Warning", reason, message + "; restarting the gang");
  ctx.Requeue(std::chrono::milliseconds(200));
}

bool Reconciler::AwaitingCreatedPods(const std::string& job_key, const std::vector<json>& current) {
  std::lock_guard lock(mu_);
  auto it = unseen_pods_.find(job_key);
  if (it == unseen_pods_.end()) return false;
  for (const auto& pod : current) it->second.names.erase(pod["metadata"].value("name", ""));
  // A pod deleted before the cache ever showed it would be awaited forever: give up after a while.
  if (it->second.names.empty() || Clock::now() - it->second.since > options_.creation_observation_timeout) {
    unseen_pods_.erase(it);
    return false;
  }
  return true;
}

scheduler::ClusterSnapshot Reconciler::Snapshot() {
  // The nodes change rarely: rebuild their part only when the node cache changed.
  scheduler::ClusterSnapshot snapshot;
  {
    std::lock_guard lock(mu_);
    if (!nodes_snapshot_ || nodes_snapshot_version_ != nodes_.version()) {
      nodes_snapshot_version_ = nodes_.version();
      nodes_snapshot_ = scheduler::SnapshotFromKubectl(json{{"items", nodes_.List()}}, json());
    }
    snapshot = *nodes_snapshot_;
  }
  // The GPUs held by this operator's pods, bound or only pinned, that are still running.
  std::map<std::string, std::pair<int64_t, int64_t>> used;  // node -> (gpus, efa)
  pods_.ForEach([&](const json& pod) {
    const std::string phase = Phase(pod);
    if (phase == "Succeeded" || phase == "Failed") return;
    auto& [gpus, efa] = used[kube::PinnedNode(pod)];
    const std::string where = "pod " + kube::KeyOf(pod) + " spec";
    gpus += scheduler::PodRequest(pod["spec"], "nvidia.com/gpu", where);
    efa += scheduler::PodRequest(pod["spec"], "vpc.amazonaws.com/efa", where);
  });
  for (auto& node : snapshot.nodes) {
    if (auto it = used.find(node.name); it != used.end()) {
      node.gpus_used += it->second.first;
      node.efa_used += it->second.second;
    }
  }
  return snapshot;
}

bool Reconciler::CreateGang(Context& ctx) {
  const auto& job = ctx.job;
  const int64_t gang = ctx.status.restarts;
  // Reuse the rank table of an interrupted creation of this gang, else plan one.
  api::RankTable table;
  std::optional<json> existing;
  try {
    existing = client_.Get(res::ConfigMaps(), ctx.ns, ConfigMapName(ctx.name));
  } catch (const kube::KubeError& e) {
    if (e.kind() != kube::ErrorKind::kNotFound) throw;
  }
  bool reuse = false;
  if (existing && ctx.status.phase == "Pending" &&
      existing->value("metadata", json::object()).value("labels", json::object()).value(kGangLabel, "") ==
          std::to_string(gang)) {
    api::FieldErrors errors;
    table = api::DecodeRankTable(json::parse((*existing)["data"].value("rank-table.json", "{}"), nullptr, false), &errors);
    reuse = errors.empty() && static_cast<int64_t>(table.nodes.size()) == job.spec.nodes;
  }
  scheduler::Placement placement;
  const auto request = scheduler::PlacementRequest::ForJob(job, AvoidedNodes(ctx.key));
  if (!reuse) {
    const auto started = Clock::now();
    placement = scheduler::Place(request, Snapshot());
    if (metrics_) metrics_->Placed(std::chrono::duration<double>(Clock::now() - started).count());
    if (!placement.ok()) {
      const bool was = ctx.status.phase == "Pending";
      ctx.status.phase = "Pending";
      SetCondition(ctx.status, "Scheduled", false, "Unschedulable", placement.reason, ctx.generation());
      if (!was || ctx.before.conditions != ctx.status.conditions)
        Event(ctx, "Warning", "Unschedulable", placement.reason);
      ctx.Requeue(options_.unschedulable_retry);
      return false;
    }
    table = scheduler::MakeRankTable(placement, request.levels, job.spec.gpus_per_node);
  } else {
    for (const auto& n : table.nodes) {
      placement.nodes.push_back(n.name);
      placement.paths.push_back(n.topology_path);
    }
  }

  auto create = [&](const kube::ResourceType& type, const json& object) {
    try {
      client_.Create(type, ctx.ns, object);
    } catch (const kube::KubeError& e) {
      if (e.kind() != kube::ErrorKind::kConflict) throw;  // AlreadyExists: an earlier pass made it
    }
  };
  create(res::Services(), BuildService(job));
  const json config_map = BuildConfigMap(job, ctx.object.value("spec", json::object()), table, gang);
  if (existing && !reuse) {
    json replacement = config_map;
    replacement["metadata"]["resourceVersion"] = (*existing)["metadata"]["resourceVersion"];
    client_.Update(res::ConfigMaps(), ctx.ns, replacement);
  } else if (!existing) {
    create(res::ConfigMaps(), config_map);
  }
  {
    // Until the pod cache has shown each new pod once, a missing one is not yet seen, not deleted.
    std::lock_guard lock(mu_);
    auto& expected = unseen_pods_[ctx.key];
    expected.since = Clock::now();
    for (int64_t rank = 0; rank < job.spec.nodes; ++rank) expected.names.insert(PodName(ctx.name, gang, rank));
  }
  for (int64_t rank = 0; rank < job.spec.nodes; ++rank) create(res::Pods(), BuildPod(job, table, gang, rank));

  api::PlacementStatus summary;
  for (size_t i = 0; i < placement.nodes.size(); ++i)
    summary.nodes.push_back({static_cast<int64_t>(i), placement.nodes[i], placement.paths[i]});
  summary.cost_seconds_per_step =
      scheduler::EstimateStepCost(job.spec, placement.paths, scheduler::LinkModel(request.levels)).seconds;
  ctx.status.placement = summary;
  ctx.status.phase = "Starting";
  if (ctx.status.start_time.empty()) ctx.status.start_time = kube::Rfc3339Now();
  const std::string message = "gang " + std::to_string(gang) + " of " + std::to_string(job.spec.nodes) +
                              " pods placed" + (placement.domain.empty() ? "" : " in " + placement.domain);
  SetCondition(ctx.status, "Scheduled", true, "GangPlaced", message, ctx.generation());
  SetCondition(ctx.status, "Restarting", false, "GangPlaced", message, ctx.generation());
  Event(ctx, "Normal", "GangCreated", message);
  return true;
}

void Reconciler::ReportFieldsWithoutEffect(Context& ctx, const api::FieldErrors& warnings) {
  std::string message;
  for (const auto& w : warnings) message += (message.empty() ? "" : "; ") + w.ToString();
  const auto had = std::find_if(ctx.status.conditions.begin(), ctx.status.conditions.end(),
                                [](const api::Condition& c) { return c.type == kSpecWarningsCondition; });
  if (warnings.empty()) {
    if (had != ctx.status.conditions.end()) {
      SetCondition(ctx.status, kSpecWarningsCondition, false, "NoFieldsWithoutEffect", "", ctx.generation());
    }
    return;
  }
  const bool changed = had == ctx.status.conditions.end() || had->status != "True" || had->message != message;
  SetCondition(ctx.status, kSpecWarningsCondition, true, "FieldsWithoutEffect", message, ctx.generation());
  if (changed) ctx.events_after_status.push_back({"Warning", "FieldsWithoutEffect", message});
}

bool ParseProgress(const std::string& text, api::ProgressStatus* progress) {
  std::istringstream in(text);
  std::string line;
  bool any = false;
  double steps_total = 0, tokens_per_step = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    std::string name = line.substr(0, space);
    name = name.substr(0, name.find('{'));
    double value;
    try {
      value = std::stod(line.substr(space + 1));
    } catch (const std::exception&) {
      continue;
    }
    if (name == "meshtrain_train_step") progress->step = static_cast<int64_t>(value), any = true;
    else if (name == "meshtrain_train_loss") progress->loss = value, any = true;
    else if (name == "meshtrain_train_tokens_per_second") progress->tokens_per_second = std::round(value), any = true;
    else if (name == "meshtrain_train_steps") steps_total = value;
    else if (name == "meshtrain_train_tokens_per_step") tokens_per_step = value;
    else if (name == "meshtrain_train_resumed_from_step" && value >= 0) progress->resumed_from_step = int64_t(value);
    else if (name == "meshtrain_checkpoint_last_step" && value >= 0) progress->checkpoint_step = int64_t(value);
    else if (name == "meshtrain_train_resume_damaged_checkpoints" && value > 0) {
      progress->damaged_checkpoints = int64_t(value);
    }
  }
  if (any && steps_total > progress->step && tokens_per_step > 0 && progress->tokens_per_second > 0)
    progress->eta_seconds = static_cast<int64_t>((steps_total - progress->step) * tokens_per_step / progress->tokens_per_second);
  return any;
}

void Reconciler::ObserveProgress(Context& ctx, const json& rank0) {
  ctx.Requeue(options_.progress_interval);
  {
    std::lock_guard lock(mu_);
    auto& last = last_scrape_[ctx.key];
    if (Clock::now() - last < options_.progress_interval) return;
    last = Clock::now();
  }
  const std::string ip = rank0.value("status", json::object()).value("podIP", "");
  if (ip.empty()) return;
  try {
    web::http::client::http_client_config config;
    config.set_timeout(std::chrono::seconds(1));
    web::http::client::http_client http("http://" + ip + ":" + std::to_string(kMetricsPort), config);
    auto response = http.request(web::http::methods::GET, "/metrics").get();
    if (response.status_code() != 200) return;
    api::ProgressStatus progress;
    if (ParseProgress(response.extract_utf8string(true).get(), &progress)) {
      ctx.status.progress = progress;
      const std::optional<int64_t> before = ctx.before.progress ? ctx.before.progress->resumed_from_step : std::nullopt;
      if (progress.resumed_from_step && progress.resumed_from_step != before) {
        const int64_t damaged = progress.damaged_checkpoints.value_or(0);
        ctx.events_after_status.push_back(
            {damaged > 0 ? "Warning" : "Normal", "Resumed",
             "the gang (restart " + std::to_string(ctx.status.restarts) + ") resumed from the checkpoint of step " +
                 std::to_string(*progress.resumed_from_step) +
                 (damaged > 0 ? ", skipping " + std::to_string(damaged) +
                                    " newer damaged one(s) (rank 0's log names each file and what is wrong)"
                              : "")});
      }
    }
  } catch (const std::exception& e) {
    spdlog::debug("{}: reading progress from {}: {}", ctx.key, ip, e.what());  // workers may not serve yet
  }
}

void Reconciler::WriteStatus(Context& ctx) {
  ctx.status.observed_generation = ctx.generation();
  if (ctx.status == ctx.before) return;
  json object = ctx.object;
  object["status"] = api::ToJson(ctx.status);
  try {
    client_.UpdateStatus(res::TrainingJobs(), ctx.ns, object);
  } catch (const kube::KubeError& e) {
    if (e.kind() != kube::ErrorKind::kConflict) throw;
    // Our view was stale: re-read (the cache catches up) and reconcile again, rather
    // than overwrite a status computed from newer facts.
    ctx.Requeue(std::chrono::milliseconds(50));
    return;
  }
  {
    std::lock_guard lock(mu_);
    written_from_[ctx.key] = ctx.object["metadata"].value("resourceVersion", "");
  }
  for (const auto& e : ctx.events_after_status) Event(ctx, e.type, e.reason, e.message);
  if (ctx.status.phase != ctx.before.phase) {
    const bool bad = ctx.status.phase == "Failed";
    std::string message = "phase " + (ctx.before.phase.empty() ? "(new)" : ctx.before.phase) + " -> " + ctx.status.phase;
    for (const auto& c : ctx.status.conditions)
      if (c.type == ctx.status.phase && !c.message.empty()) message += ": " + c.message;
    Event(ctx, bad ? "Warning" : "Normal", ctx.status.phase, message);
    spdlog::info("{}: {}", ctx.key, message);
  }
}

ReconcileResult Reconciler::Reconcile(const std::string& ns, const std::string& name) {
  Context ctx;
  ctx.ns = ns;
  ctx.name = name;
  ctx.key = kube::ObjectKey(ns, name);

  // 1. The job, from the cache.
  auto cached = jobs_.Get(ctx.key);
  if (!cached) {
    std::lock_guard lock(mu_);
    avoid_.erase(ctx.key);
    last_scrape_.erase(ctx.key);
    written_from_.erase(ctx.key);
    unseen_pods_.erase(ctx.key);
    return {};
  }
  ctx.object = std::move(*cached);
  bool stale_cache = false;
  {
    // The cache still holds the version our last status write replaced: acting on that old
    // status would undo the write, so read the job from the API server instead.
    std::lock_guard lock(mu_);
    auto it = written_from_.find(ctx.key);
    if (it != written_from_.end()) {
      stale_cache = it->second == ctx.object["metadata"].value("resourceVersion", "");
      written_from_.erase(it);
    }
  }
  if (stale_cache) {
    try {
      ctx.object = client_.Get(res::TrainingJobs(), ns, name);
    } catch (const kube::KubeError& e) {
      if (e.kind() == kube::ErrorKind::kNotFound) return {};
      throw;
    }
  }
  api::CheckedJob checked = api::CheckTrainingJob(ctx.object, "TrainingJob " + ctx.key, 0);
  ctx.job = checked.job;
  ctx.job.metadata.generation = ctx.object["metadata"].value("generation", int64_t{1});
  ctx.job.metadata.uid = ctx.object["metadata"].value("uid", "");
  ctx.job.metadata.namespace_ = ns;
  {
    api::FieldErrors ignored;
    ctx.status = api::DecodeTrainingJobStatus(ctx.object.value("status", json::object()), &ignored);
  }
  ctx.before = ctx.status;
  ctx.pods = pods_.Select([&](const json& pod) {
    const json& meta = pod["metadata"];
    if (meta.value("namespace", "") != ns) return false;
    auto labels = meta.find("labels");
    if (labels == meta.end() || labels->value(kJobNameLabel, "") != name) return false;
    for (const auto& ref : meta.value("ownerReferences", json::array()))
      if (ref.value("uid", "") == ctx.job.metadata.uid) return true;
    return false;
  });

  // 2. Finished jobs: clean up, then wait for the TTL.
  if (Finished(ctx.status.phase)) {
    const std::string& policy = ctx.job.spec.run_policy.clean_pod_policy;
    std::vector<json> doomed;
    for (const auto& pod : ctx.pods) {
      const std::string phase = Phase(pod);
      if (policy == "All" || (policy == "Running" && (phase == "Running" || phase == "Pending"))) doomed.push_back(pod);
    }
    DeletePods(doomed);
    if (const auto ttl = ctx.job.spec.run_policy.ttl_seconds_after_finished) {
      const int64_t left = *ttl - kube::SecondsSince(ctx.status.completion_time);
      if (left <= 0) {
        client_.Delete(res::TrainingJobs(), ns, name);
        spdlog::info("{}: deleted {} s after it finished (ttlSecondsAfterFinished)", ctx.key, *ttl);
        return {};
      }
      ctx.Requeue(std::chrono::seconds(left));
    }
    WriteStatus(ctx);
    return ctx.result;
  }

  // 3. Validation.
  if (!checked.ok()) {
    std::string message;
    for (const auto& e : checked.errors) message += (message.empty() ? "" : "; ") + e.ToString();
    Fail(ctx, "InvalidSpec", message);
    WriteStatus(ctx);
    return ctx.result;
  }

  ctx.status.defaults = checked.defaults;
  ReportFieldsWithoutEffect(ctx, checked.warnings);

  // 4. runPolicy: suspend and the deadline.
  const auto& policy = ctx.job.spec.run_policy;
  if (policy.suspend) {
    DeletePods(ctx.pods);
    ctx.status.phase = "Suspended";
    ctx.status.ready_workers = 0;
    SetCondition(ctx.status, "Suspended", true, "Suspended", "spec.runPolicy.suspend is true; pods deleted",
                 ctx.generation());
    SetCondition(ctx.status, "Running", false, "Suspended", "suspended", ctx.generation());
    WriteStatus(ctx);
    return ctx.result;
  }
  if (ctx.status.phase == "Suspended") {
    ctx.status.phase = "Pending";
    ctx.status.placement.reset();
    SetCondition(ctx.status, "Suspended", false, "Resumed", "spec.runPolicy.suspend is false; re-planning",
                 ctx.generation());
  }
  if (policy.active_deadline_seconds && !ctx.status.start_time.empty()) {
    const int64_t left = *policy.active_deadline_seconds - kube::SecondsSince(ctx.status.start_time);
    if (left <= 0) {
      Fail(ctx, "DeadlineExceeded",
           "the job ran longer than spec.runPolicy.activeDeadlineSeconds (" +
               std::to_string(*policy.active_deadline_seconds) + " s)");
      WriteStatus(ctx);
      return ctx.result;
    }
    ctx.Requeue(std::chrono::seconds(left));
  }

  // 5. Judge the current gang; pods of older gangs are leftovers.
  const int64_t gang = ctx.status.restarts;
  std::vector<json> current, stale;
  for (const auto& pod : ctx.pods) (Gang(pod) == gang ? current : stale).push_back(pod);
  DeletePods(stale);
  const bool gang_started = ctx.status.phase == "Starting" || ctx.status.phase == "Running";
  int succeeded = 0, ready = 0;
  for (const auto& pod : current) {
    const std::string phase = Phase(pod);
    const std::string pod_name = pod["metadata"].value("name", "");
    const std::string node = kube::PinnedNode(pod);
    if (phase == "Failed") {
      const auto code = ExitCode(pod);
      const std::string what = "pod " + pod_name + " on node " + node + " failed" +
                               (code ? " with exit code " + std::to_string(*code) : "");
      if (code && *code == kPermanentErrorExitCode) {
        Fail(ctx, "PermanentError", what + " (a configuration error; not restarting)");
      } else {
        Restart(ctx, "PodFailed", what, node, true);
      }
      WriteStatus(ctx);
      return ctx.result;
    }
    if (phase == "Succeeded") ++succeeded;
    if (phase == "Running" && kube::ConditionTrue(pod, "Ready")) ++ready;
    if (phase != "Succeeded") {
      auto node_object = nodes_.Get(node);
      if (!node.empty() && !(node_object && kube::ConditionTrue(*node_object, "Ready"))) {
        Restart(ctx, "NodeNotReady", "node " + node + " of pod " + pod_name + (node_object ? " is not Ready" : " is gone"),
                node, true);
        WriteStatus(ctx);
        return ctx.result;
      }
    }
    if (phase == "Pending") {
      const int64_t age = kube::SecondsSince(pod["metadata"].value("creationTimestamp", ""));
      if (age >= options_.pending_timeout.count()) {
        Restart(ctx, "PodPendingTimeout",
                "pod " + pod_name + " stayed Pending on node " + node + " for " + std::to_string(age) + " s", node,
                false);
        WriteStatus(ctx);
        return ctx.result;
      }
      ctx.Requeue(std::chrono::seconds(options_.pending_timeout.count() - age + 1));
    }
  }
  if (AwaitingCreatedPods(ctx.key, current)) {
    ctx.Requeue(std::chrono::milliseconds(100));
    WriteStatus(ctx);
    return ctx.result;
  }
  if (gang_started && static_cast<int64_t>(current.size()) < ctx.job.spec.nodes) {
    Restart(ctx, "PodDeleted",
            std::to_string(ctx.job.spec.nodes - static_cast<int64_t>(current.size())) + " of " +
                std::to_string(ctx.job.spec.nodes) + " pods of the gang were deleted",
            "", true);
    WriteStatus(ctx);
    return ctx.result;
  }

  // 6. No pods of this gang: place and create it, once the old gang is gone.
  if (current.empty() || (!gang_started && static_cast<int64_t>(current.size()) < ctx.job.spec.nodes)) {
    if (!stale.empty()) {
      ctx.Requeue(std::chrono::milliseconds(500));
    } else {
      CreateGang(ctx);
    }
    WriteStatus(ctx);
    return ctx.result;
  }

  // 7. The gang exists: observe it.
  ctx.status.ready_workers = ready;
  if (succeeded == ctx.job.spec.nodes) {
    ctx.status.phase = "Succeeded";
    ctx.status.ready_workers = 0;
    ctx.status.completion_time = kube::Rfc3339Now();
    SetCondition(ctx.status, "Succeeded", true, "AllPodsSucceeded",
                 "all " + std::to_string(succeeded) + " pods exited with code 0", ctx.generation());
    SetCondition(ctx.status, "Running", false, "AllPodsSucceeded", "training finished", ctx.generation());
    if (policy.ttl_seconds_after_finished) ctx.Requeue(std::chrono::seconds(*policy.ttl_seconds_after_finished));
  } else if (ready == ctx.job.spec.nodes) {
    ctx.status.phase = "Running";
    SetCondition(ctx.status, "Running", true, "AllWorkersReady",
                 "all " + std::to_string(ready) + " workers are running", ctx.generation());
    for (const auto& pod : current)
      if (pod["metadata"].value("labels", json::object()).value(kNodeRankLabel, "") == "0") ObserveProgress(ctx, pod);
  } else if (succeeded == 0) {
    ctx.status.phase = "Starting";
  }
  WriteStatus(ctx);
  return ctx.result;
}

}  // namespace meshtrain::controller
