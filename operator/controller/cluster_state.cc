#include "operator/controller/cluster_state.h"

#include <spdlog/spdlog.h>

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

ClusterState::ClusterState() = default;
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
  const std::string key = kube::KeyOf(object ? *object : *old_object);
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
  if (object) {
    // The cache shows the pod: what it holds is counted from it, not from a reservation.
    if (auto it = reserved_.find(key); it != reserved_.end()) {
      Add(it->second.held, -1);
      reserved_.erase(it);
    }
    if (!held.node.empty()) {
      Add(held, +1);
      counted_.emplace(key, std::move(held));
    }
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

bool ClusterState::Reserve(const std::string& job, const std::vector<PodClaim>& claims, bool check) {
  std::lock_guard lock(mu_);
  if (check) {
    std::map<std::string, std::pair<int64_t, int64_t>> need;  // node -> (gpus, efa)
    for (const PodClaim& claim : claims) {
      if (counted_.count(claim.pod)) continue;
      auto& [gpus, efa] = need[claim.node];
      gpus += claim.gpus;
      efa += claim.efa;
      if (auto it = reserved_.find(claim.pod); it != reserved_.end()) {
        auto& [held_gpus, held_efa] = need[it->second.held.node];
        held_gpus -= it->second.held.gpus;
        held_efa -= it->second.held.efa;
      }
    }
    for (const auto& [name, amount] : need) {
      const auto node = nodes_.find(name);
      if (node == nodes_.end()) return false;
      const Slot& slot = SlotOf(name);
      if (node->second.gpus - slot.gpus.load() < amount.first || node->second.efa - slot.efa.load() < amount.second)
        return false;
    }
  }
  const auto now = Clock::now();
  for (const PodClaim& claim : claims) {
    if (counted_.count(claim.pod)) continue;
    if (auto it = reserved_.find(claim.pod); it != reserved_.end()) {
      Add(it->second.held, -1);
      reserved_.erase(it);
    }
    Held held{claim.node, claim.gpus, claim.efa};
    Add(held, +1);
    reserved_.emplace(claim.pod, Reservation{job, std::move(held), now});
  }
  return true;
}

void ClusterState::Release(const std::string& pod) {
  std::lock_guard lock(mu_);
  if (auto it = reserved_.find(pod); it != reserved_.end()) {
    Add(it->second.held, -1);
    reserved_.erase(it);
  }
}

void ClusterState::ReleaseJob(const std::string& job) {
  std::lock_guard lock(mu_);
  for (auto it = reserved_.begin(); it != reserved_.end();) {
    if (it->second.job != job) {
      ++it;
      continue;
    }
    Add(it->second.held, -1);
    it = reserved_.erase(it);
  }
}

void ClusterState::ExpireReservations(Clock::duration age) {
  const auto now = Clock::now();
  std::lock_guard lock(mu_);
  for (auto it = reserved_.begin(); it != reserved_.end();) {
    if (now - it->second.since < age) {
      ++it;
      continue;
    }
    spdlog::warn("{}: pod {} never reached the cache; giving back its reservation on node {}", it->second.job,
                 it->first, it->second.held.node);
    Add(it->second.held, -1);
    it = reserved_.erase(it);
  }
}

std::pair<int64_t, int64_t> ClusterState::Used(const std::string& node) const {
  std::lock_guard lock(mu_);
  const auto it = slots_.find(node);
  if (it == slots_.end()) return {0, 0};
  return {it->second->gpus.load(), it->second->efa.load()};
}

size_t ClusterState::Reservations() const {
  std::lock_guard lock(mu_);
  return reserved_.size();
}

}  // namespace meshtrain::controller
