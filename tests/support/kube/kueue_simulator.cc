#include "tests/support/kube/kueue_simulator.h"

#include <algorithm>
#include <set>

#include <spdlog/spdlog.h>

#include "operator/kube/time.h"

namespace meshtrain::testing {
namespace {

using nlohmann::json;

std::string KeyOf(const json& object) {
  const json meta = object.value("metadata", json::object());
  return meta.value("namespace", "") + "/" + meta.value("name", "");
}

const json* ConditionOf(const json& object, const std::string& type) {
  const auto status = object.find("status");
  if (status == object.end() || !status->is_object() || !status->contains("conditions")) return nullptr;
  for (const json& c : (*status)["conditions"])
    if (c.value("type", "") == type) return &c;
  return nullptr;
}

bool IsTrue(const json& object, const std::string& type) {
  const json* c = ConditionOf(object, type);
  return c && c->value("status", "") == "True";
}

void SetCondition(json* object, const std::string& type, const std::string& status, const std::string& reason,
                  const std::string& message) {
  json& s = (*object)["status"];
  if (!s.is_object()) s = json::object();
  if (!s.contains("conditions")) s["conditions"] = json::array();
  const std::string now = kube::Rfc3339Now();
  for (json& c : s["conditions"]) {
    if (c.value("type", "") != type) continue;
    if (c.value("status", "") != status) c["lastTransitionTime"] = now;
    c["status"] = status;
    c["reason"] = reason;
    c["message"] = message;
    return;
  }
  s["conditions"].push_back(
      {{"type", type}, {"status", status}, {"reason", reason}, {"message", message}, {"lastTransitionTime", now}});
}

std::pair<std::string, std::string> Split(const std::string& key) {
  const size_t slash = key.find('/');
  return {key.substr(0, slash), key.substr(slash + 1)};
}

}  // namespace

KueueSimulator::KueueSimulator(ApiServer& server, KueueSimulatorOptions options)
    : server_(server), options_(std::move(options)) {
  server_.AddTestRoute("/_test/kueue/", [this](const HttpRequest& request, HttpResponder& responder) {
    json body = json::parse(request.body, nullptr, false);
    if (!body.is_object()) body = json::object();
    bool ok = true;
    json reply = json::object();
    if (request.path == "/_test/kueue/quota") {
      SetQuota(body.value("nodes", 0));
    } else if (request.path == "/_test/kueue/evict") {
      ok = Evict(body.value("namespace", "default"), body.value("job", ""));
    } else if (request.path == "/_test/kueue/state") {
      reply = State();
    } else {
      ok = false;
    }
    responder.Send(ok ? 200 : 404, "application/json", reply.dump());
  });
}

KueueSimulator::~KueueSimulator() { Stop(); }

void KueueSimulator::Start() {
  thread_ = std::jthread([this](std::stop_token stop) { Loop(stop); });
}

void KueueSimulator::Stop() {
  if (thread_.joinable()) {
    thread_.request_stop();
    thread_.join();
  }
}

void KueueSimulator::SetQuota(int nodes) {
  std::lock_guard lock(mu_);
  options_.quota_nodes = nodes;
  spdlog::info("kueue simulator: quota {} nodes", nodes);
  AdmitWaiting();
}

bool KueueSimulator::Evict(const std::string& ns, const std::string& job) {
  std::lock_guard lock(mu_);
  const auto it = jobs_.find(ns + "/" + job);
  if (it == jobs_.end()) return false;
  return EvictHeld(it->second, "Preempted by the Kueue simulator (a test)");
}

bool KueueSimulator::EvictHeld(const std::string& key, const std::string& message) {
  const auto held = held_.find(key);
  if (held == held_.end()) return false;
  const auto [ns, name] = Split(key);
  held->second.evicted = true;
  spdlog::info("kueue simulator: evicting Workload {}: {}", key, message);
  return server_.Mutate(kWorkloads, ns, name,
                        [&](json& w) { SetCondition(&w, "Evicted", "True", "Preempted", message); });
}

void KueueSimulator::Preempt(const std::string& key, int pods, int free) {
  const int priority = priorities_[key];
  std::vector<std::pair<std::string, const Held*>> lower;
  int freeing = 0;  // what evicted Workloads will give back
  for (const auto& [k, h] : held_) {
    if (h.evicted) freeing += h.pods;
    else if (h.priority < priority) lower.push_back({k, &h});
  }
  // The lowest priority first, then the newest admitted, as Kueue's preemption orders them.
  std::sort(lower.begin(), lower.end(), [](const auto& a, const auto& b) {
    return a.second->priority != b.second->priority ? a.second->priority < b.second->priority
                                                    : a.second->admitted > b.second->admitted;
  });
  std::vector<std::string> victims;
  for (const auto& [k, h] : lower) {
    if (free + freeing >= pods) break;
    victims.push_back(k);
    freeing += h->pods;
  }
  if (free + freeing < pods) return;  // evicting them all would not make room
  for (const std::string& victim : victims)
    EvictHeld(victim, "Preempted to accommodate a workload (" + key + ", priority " + std::to_string(priority) +
                          ") due to prioritization in the ClusterQueue");
}

json KueueSimulator::State() const {
  std::lock_guard lock(mu_);
  json admitted = json::object();
  for (const auto& [key, held] : held_)
    admitted[key] = {{"pods", held.pods}, {"nodes", held.nodes}, {"evicted", held.evicted}, {"priority", held.priority}};
  return {{"quotaNodes", options_.quota_nodes}, {"waiting", json(std::vector<std::string>(waiting_.begin(), waiting_.end()))},
          {"admitted", admitted}};
}

void KueueSimulator::Loop(std::stop_token stop) {
  uint64_t seq = 0;
  while (!stop.stop_requested()) {
    const auto events = server_.EventsSince(seq, 100);
    std::lock_guard lock(mu_);
    for (const auto& event : events) {
      seq = event.seq;
      if (event.resource == kWorkloads) Observe(event);
    }
    if (!events.empty()) AdmitWaiting();
  }
}

void KueueSimulator::Observe(const StoredEvent& event) {
  const std::string key = KeyOf(event.object);
  const auto unqueue = [&] { waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), key), waiting_.end()); };
  if (event.type == "DELETED") {
    held_.erase(key);
    priorities_.erase(key);
    unqueue();
    return;
  }
  const json& priority = event.object.value("spec", json::object()).value("priority", json());
  priorities_[key] = priority.is_number_integer() ? priority.get<int>() : 0;
  const std::string job =
      event.object["metadata"].value("labels", json::object()).value("meshtrain.dev/job-name", "");
  if (!job.empty()) jobs_[event.object["metadata"].value("namespace", "") + "/" + job] = key;
  if (IsTrue(event.object, "Finished")) {
    if (held_.erase(key)) spdlog::info("kueue simulator: Workload {} finished; its quota is free", key);
    unqueue();
    return;
  }
  const auto held = held_.find(key);
  if (held != held_.end()) {
    // The job gave the quota back (after an eviction): queued again, at the back.
    if (!IsTrue(event.object, "QuotaReserved")) {
      spdlog::info("kueue simulator: Workload {} gave its quota back; requeued", key);
      held_.erase(held);
      waiting_.push_back(key);
    }
    return;
  }
  if (std::find(waiting_.begin(), waiting_.end(), key) == waiting_.end() && !IsTrue(event.object, "QuotaReserved"))
    waiting_.push_back(key);
}

void KueueSimulator::AdmitWaiting() {
  // The highest priority first, in queue order among equals (a stable sort).
  std::stable_sort(waiting_.begin(), waiting_.end(),
                   [this](const std::string& a, const std::string& b) { return priorities_[a] > priorities_[b]; });
  while (!waiting_.empty() && Admit(waiting_.front())) waiting_.pop_front();
}

// StrictFIFO: the first Workload waits until it fits (preempting lower priorities where
// that makes room), and those behind it with it.
bool KueueSimulator::Admit(const std::string& key) {
  const auto [ns, name] = Split(key);
  const auto workload = server_.Get(kWorkloads, ns, name);
  if (!workload || IsTrue(*workload, "Finished")) return true;  // gone: dropped from the queue
  const json podsets = (*workload)["spec"].value("podSets", json::array());
  int pods = 0;
  bool topology = false;
  for (const json& p : podsets) {
    pods += p.value("count", 1);
    topology = topology || (options_.topology && p.contains("topologyRequest"));
  }
  int used = 0;
  std::set<std::string> taken;
  for (const auto& [k, h] : held_) {
    used += h.pods;
    taken.insert(h.nodes.begin(), h.nodes.end());
  }
  if (used + pods > options_.quota_nodes) {
    Preempt(key, pods, options_.quota_nodes - used);
    return false;
  }
  std::vector<std::string> nodes;
  if (topology) {
    for (const std::string& n : options_.nodes)
      if (!taken.count(n) && int(nodes.size()) < pods) nodes.push_back(n);
    if (int(nodes.size()) < pods) return false;
  }
  json assignments = json::array();
  size_t next = 0;
  for (const json& p : podsets) {
    json flavors = json::object();
    const json containers = p.value("template", json::object()).value("spec", json::object()).value("containers", json::array());
    for (const json& c : containers) {
      const json requests = c.value("resources", json::object()).value("requests", json::object());
      for (const auto& [resource, quantity] : requests.items()) flavors[resource] = options_.flavor;
    }
    const int count = p.value("count", 1);
    json assignment = {{"name", p.value("name", "main")}, {"count", count}, {"flavors", flavors}};
    if (topology && p.contains("topologyRequest")) {
      std::vector<std::string> roots(nodes.begin() + long(next), nodes.begin() + long(next) + count);
      next += size_t(count);
      assignment["topologyAssignment"] = {
          {"levels", json::array({"kubernetes.io/hostname"})},
          {"slices", json::array({{{"domainCount", count},
                                   {"valuesPerLevel", json::array({{{"individual", {{"roots", roots}}}}})},
                                   {"podCounts", {{"universal", 1}}}}})}};
    }
    assignments.push_back(assignment);
  }
  const std::string queue = options_.cluster_queue;
  server_.Mutate(kWorkloads, ns, name, [&](json& w) {
    w["status"]["admission"] = {{"clusterQueue", queue}, {"podSetAssignments", assignments}};
    if (ConditionOf(w, "Evicted")) SetCondition(&w, "Evicted", "False", "QuotaReserved", "Previously: evicted");
    SetCondition(&w, "QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue " + queue);
    SetCondition(&w, "Admitted", "True", "Admitted", "The workload is admitted");
  });
  const std::string job = (*workload)["metadata"].value("labels", json::object()).value("meshtrain.dev/job-name", "");
  server_.RecordTime("Admission", key, ns + "/" + job);
  held_[key] = {pods, nodes, false, priorities_[key], ++admissions_};
  spdlog::info("kueue simulator: admitted Workload {} ({} pods{})", key, pods,
               topology ? ", TAS on " + std::to_string(nodes.size()) + " nodes" : "");
  return true;
}

}  // namespace meshtrain::testing
