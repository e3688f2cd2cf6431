#include "operator/controller/cluster_state.h"

#include <spdlog/spdlog.h>

#include "operator/controller/builders.h"
#include "operator/kube/objects.h"

namespace meshtrain::controller {

using nlohmann::json;

// A node's counters, shared with the views that read them: a view keeps the slots of its
// topology's nodes alive, and reads them without the lock.
struct ClusterState::Slot {
  std::atomic<int64_t> gpus{0}, efa{0};
};

namespace {

// The live counters of one topology's nodes, by node index.
class SlotUsage : public scheduler::NodeUsage {
 public:
  explicit SlotUsage(std::vector<std::shared_ptr<const void>> keep, std::vector<const std::atomic<int64_t>*> gpus,
                     std::vector<const std::atomic<int64_t>*> efa)
      : keep_(std::move(keep)), gpus_(std::move(gpus)), efa_(std::move(efa)) {}
  int64_t GpusUsed(size_t node) const override { return gpus_[node]->load(std::memory_order_relaxed); }
  int64_t EfaUsed(size_t node) const override { return efa_[node]->load(std::memory_order_relaxed); }

 private:
  std::vector<std::shared_ptr<const void>> keep_;
  std::vector<const std::atomic<int64_t>*> gpus_, efa_;
};

bool Finished(const json& pod) {
  const std::string phase = kube::PodPhase(pod);
  return phase == "Succeeded" || phase == "Failed";
}

}  // namespace

ClusterState::ClusterState(Clock::duration in_flight_timeout) : in_flight_timeout_(in_flight_timeout) {}
ClusterState::~ClusterState() = default;

ClusterState::Slot& ClusterState::SlotOf(const std::string& node) {
  auto& slot = slots_[node];
  if (!slot) slot = std::make_shared<Slot>();
  return *slot;
}

void ClusterState::Add(const Held& held, int sign) {
  if (held.node.empty()) return;
  Slot& slot = SlotOf(held.node);
  slot.gpus.fetch_add(sign * held.gpus, std::memory_order_relaxed);
  slot.efa.fetch_add(sign * held.efa, std::memory_order_relaxed);
}

void ClusterState::NodeChanged(const json* old_object, const json* object) {
  const std::string name = (object ? *object : *old_object)["metadata"].value("name", "");
  std::lock_guard lock(mu_);
  if (!object) {
    if (nodes_.erase(name) > 0) stale_ = true;
    return;
  }
  scheduler::ClusterNode node;
  try {
    node = scheduler::NodeFromKubectl(*object);
  } catch (const scheduler::ClusterError& e) {
    spdlog::warn("node {}: {}; placing nothing on it", name, e.what());
    if (nodes_.erase(name) > 0) stale_ = true;
    return;
  }
  auto [it, added] = nodes_.try_emplace(name, node);
  if (added || !(it->second == node)) {
    it->second = std::move(node);
    stale_ = true;
  }
}

void ClusterState::PodChanged(const json* old_object, const json* object) {
  const json& pod = object ? *object : *old_object;
  const std::string key = kube::KeyOf(pod), job = JobKeyOf(pod);
  Held held;
  if (object && !Finished(*object)) {
    held.node = kube::PinnedNode(*object);
    const std::string where = "pod " + key + " spec";
    try {
      held.gpus = scheduler::PodRequest((*object)["spec"], "nvidia.com/gpu", where);
      held.efa = scheduler::PodRequest((*object)["spec"], "vpc.amazonaws.com/efa", where);
    } catch (const scheduler::ClusterError& e) {
      spdlog::warn("{}; counting no GPUs for it", e.what());
      held = {};
    }
  }
  std::lock_guard lock(mu_);
  if (auto it = counted_.find(key); it != counted_.end()) {
    Add(it->second, -1);
    counted_.erase(it);
  }
  // The cache shows the pod, or no longer does: its record in flight ends, and what the
  // pod holds is counted from the cache.
  if (auto entry = in_flight_.find(job); entry != in_flight_.end()) {
    JobInFlight& records = entry->second;
    if (object) {
      if (auto it = records.creates.find(key); it != records.creates.end()) EndCreate(records, it);
    } else {
      records.deletes.erase(kube::Uid(pod));
    }
    if (records.empty()) in_flight_.erase(entry);
  }
  if (object && !held.node.empty()) {
    Add(held, +1);
    counted_.emplace(key, std::move(held));
  }
}

NodeState ClusterState::Node(const std::string& name) const {
  std::lock_guard lock(mu_);
  const auto it = nodes_.find(name);
  if (it == nodes_.end()) return NodeState::kGone;
  return it->second.ready ? NodeState::kReady : NodeState::kNotReady;
}

scheduler::ClusterView ClusterState::View() {
  std::lock_guard lock(mu_);
  if (!stale_ && view_.topology) return view_;
  std::vector<scheduler::ClusterNode> nodes;
  nodes.reserve(nodes_.size());
  for (const auto& [name, node] : nodes_) nodes.push_back(node);
  auto topology = std::make_shared<const scheduler::Topology>(std::move(nodes));
  std::vector<std::shared_ptr<const void>> keep;
  std::vector<const std::atomic<int64_t>*> gpus, efa;
  for (const scheduler::ClusterNode& node : topology->nodes()) {
    SlotOf(node.name);
    const std::shared_ptr<Slot>& slot = slots_.at(node.name);
    keep.push_back(slot);
    gpus.push_back(&slot->gpus);
    efa.push_back(&slot->efa);
  }
  // Counters of nodes that are gone and hold nothing are no longer needed.
  for (auto it = slots_.begin(); it != slots_.end();) {
    const bool idle = it->second->gpus.load() == 0 && it->second->efa.load() == 0;
    it = idle && !nodes_.count(it->first) ? slots_.erase(it) : std::next(it);
  }
  view_ = {topology, std::make_shared<const SlotUsage>(std::move(keep), std::move(gpus), std::move(efa))};
  stale_ = false;
  return view_;
}

bool ClusterState::Reserve(const std::string& job, const std::vector<PodClaim>& claims, bool check,
                           Clock::time_point now) {
  std::lock_guard lock(mu_);
  const auto entry = in_flight_.find(job);
  // The record of `pod` in flight, if any.
  auto earlier = [&](const std::string& pod) -> const Record* {
    if (entry == in_flight_.end()) return nullptr;
    const auto it = entry->second.creates.find(pod);
    return it == entry->second.creates.end() ? nullptr : &it->second;
  };
  if (check) {
    std::map<std::string, std::pair<int64_t, int64_t>> need;  // node -> (gpus, efa)
    for (const PodClaim& claim : claims) {
      if (counted_.count(claim.pod)) continue;
      auto& [gpus, efa] = need[claim.node];
      gpus += claim.gpus;
      efa += claim.efa;
      if (const Record* record = earlier(claim.pod)) {
        auto& [held_gpus, held_efa] = need[record->held.node];
        held_gpus -= record->held.gpus;
        held_efa -= record->held.efa;
      }
    }
    for (const auto& [name, amount] : need) {
      if (name.empty()) continue;  // an earlier record that held nothing
      const auto node = nodes_.find(name);
      if (node == nodes_.end()) return false;
      const Slot& slot = SlotOf(name);
      if (node->second.gpus - slot.gpus.load() < amount.first || node->second.efa - slot.efa.load() < amount.second)
        return false;
    }
  }
  for (const PodClaim& claim : claims) {
    if (counted_.count(claim.pod)) continue;
    Record& record = in_flight_[job].creates[claim.pod];
    Add(record.held, -1);
    record.held = {claim.node, claim.gpus, claim.efa};
    record.since = now;
    Add(record.held, +1);
  }
  return true;
}

void ClusterState::Creating(const std::string& job, const std::vector<std::string>& pods, Clock::time_point now) {
  if (pods.empty()) return;
  std::lock_guard lock(mu_);
  JobInFlight& records = in_flight_[job];
  for (const std::string& pod : pods) {
    Record& record = records.creates[pod];
    record.sent = true;
    record.since = now;
  }
}

void ClusterState::Release(const std::string& job, const std::string& pod) {
  std::lock_guard lock(mu_);
  const auto entry = in_flight_.find(job);
  if (entry == in_flight_.end()) return;
  if (auto it = entry->second.creates.find(pod); it != entry->second.creates.end()) EndCreate(entry->second, it);
  if (entry->second.empty()) in_flight_.erase(entry);
}

void ClusterState::Deleting(const std::string& job, const std::string& uid, Clock::time_point now) {
  std::lock_guard lock(mu_);
  in_flight_[job].deletes[uid] = Record{.held = {}, .sent = true, .since = now};
}

void ClusterState::DeleteFailed(const std::string& job, const std::string& uid) {
  std::lock_guard lock(mu_);
  const auto entry = in_flight_.find(job);
  if (entry == in_flight_.end()) return;
  entry->second.deletes.erase(uid);
  if (entry->second.empty()) in_flight_.erase(entry);
}

void ClusterState::EndCreate(JobInFlight& job, std::map<std::string, Record>::iterator record) {
  Add(record->second.held, -1);
  job.creates.erase(record);
}

void ClusterState::ExpireJob(Ledger::iterator entry, Clock::time_point now) {
  JobInFlight& records = entry->second;
  auto late = [&](const Record& record) { return now - record.since > in_flight_timeout_; };
  auto seconds = [&](const Record& record) {
    return std::chrono::duration_cast<std::chrono::seconds>(now - record.since).count();
  };
  for (auto it = records.creates.begin(); it != records.creates.end();) {
    if (!late(it->second)) {
      ++it;
      continue;
    }
    const Record& record = it->second;
    if (!record.sent) {
      spdlog::warn("{}: pod {} was not created within {} s; giving back its claim on node {}", entry->first, it->first,
                   seconds(record), record.held.node);
    } else {
      spdlog::warn("{}: the pod cache never showed the create of pod {} ({} s ago); no longer waiting for it{}",
                   entry->first, it->first, seconds(record),
                   record.held.node.empty() ? "" : ", and its claim on node " + record.held.node + " is given back");
    }
    auto next = std::next(it);
    EndCreate(records, it);
    it = next;
  }
  for (auto it = records.deletes.begin(); it != records.deletes.end();) {
    if (!late(it->second)) {
      ++it;
      continue;
    }
    spdlog::warn("{}: the pod cache never showed the delete of pod {} ({} s ago); no longer waiting for it",
                 entry->first, it->first, seconds(it->second));
    it = records.deletes.erase(it);
  }
  if (records.empty()) in_flight_.erase(entry);
}

ClusterState::InFlightPods ClusterState::InFlight(const std::string& job, Clock::time_point now) {
  InFlightPods pods;
  std::lock_guard lock(mu_);
  auto entry = in_flight_.find(job);
  if (entry == in_flight_.end()) return pods;
  ExpireJob(entry, now);
  entry = in_flight_.find(job);
  if (entry == in_flight_.end()) return pods;
  for (const auto& [pod, record] : entry->second.creates)
    if (record.sent) pods.creations.insert(pod);
  for (const auto& [uid, record] : entry->second.deletes) pods.deletions.insert(uid);
  return pods;
}

void ClusterState::Expire(Clock::time_point now) {
  std::lock_guard lock(mu_);
  for (auto it = in_flight_.begin(); it != in_flight_.end();) ExpireJob(it++, now);
}

void ClusterState::Forget(const std::string& job) {
  std::lock_guard lock(mu_);
  const auto entry = in_flight_.find(job);
  if (entry == in_flight_.end()) return;
  for (auto it = entry->second.creates.begin(); it != entry->second.creates.end();) EndCreate(entry->second, it++);
  in_flight_.erase(entry);
}

std::pair<int64_t, int64_t> ClusterState::Used(const std::string& node) const {
  std::lock_guard lock(mu_);
  const auto it = slots_.find(node);
  if (it == slots_.end()) return {0, 0};
  return {it->second->gpus.load(), it->second->efa.load()};
}

size_t ClusterState::Reservations() const {
  std::lock_guard lock(mu_);
  size_t held = 0;
  for (const auto& [job, records] : in_flight_)
    for (const auto& [pod, record] : records.creates) held += !record.held.node.empty();
  return held;
}

}  // namespace meshtrain::controller
