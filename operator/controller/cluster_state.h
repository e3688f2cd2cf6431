// What the operator knows of the cluster's nodes and of what its pods hold on them, kept
// current from the node and pod informers' events instead of recomputed by each reconcile:
//
// - each node as placement sees it (scheduler::NodeFromKubectl) and whether it is Ready;
//   an immutable scheduler::Topology of them, built again on the first View() after a
//   change placement sees (labels, allocatable, taints, readiness, cordon): a node's
//   heartbeat builds nothing;
// - the GPUs and EFA interfaces in use on each node: the requests of the operator's pods
//   that have not finished, on the node they are bound or pinned to, plus reservations,
//   what a placement took for pods created (or about to be) that the pod cache has not
//   shown yet. A pod's arrival in the cache takes over its reservation; a create that
//   failed gives it back (Release).
//
// Placement reads View(): the shared topology and live counters, copying neither. Reserve
// checks and takes capacity atomically with every other Reserve and every pod event, so
// two gangs placed at the same moment from the same counters never share a GPU: the
// second Reserve fails, and that job is decided again from the counters as they are then.
//
// Thread-safety: every method may be called from any thread.

#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "operator/controller/decide.h"
#include "operator/scheduler/topology.h"

namespace meshtrain::controller {

class ClusterState {
 public:
  using Clock = std::chrono::steady_clock;

  ClusterState();
  ~ClusterState();
  ClusterState(const ClusterState&) = delete;
  ClusterState& operator=(const ClusterState&) = delete;

  // The informers' events; `old_object` is null for an add, `object` null for a delete.
  void NodeChanged(const nlohmann::json* old_object, const nlohmann::json* object);
  void PodChanged(const nlohmann::json* old_object, const nlohmann::json* object);

  // kGone when no node of that name is known.
  NodeState Node(const std::string& name) const;
  // The topology and what is in use on it now.
  scheduler::ClusterView View();

  // Takes the capacity of `claims` (pods of job `job`) on their nodes. With `check`, takes
  // nothing and returns false unless every node has the claims free, counting a claim's
  // earlier reservation under the same pod as free. A claim whose pod the cache already
  // counts takes nothing more.
  bool Reserve(const std::string& job, const std::vector<PodClaim>& claims, bool check);
  // Gives back the reservation of pod `pod` (namespace/name): its create failed.
  void Release(const std::string& pod);
  // Gives back every reservation of `job` (it is gone).
  void ReleaseJob(const std::string& job);
  // Gives back the reservations older than `age`: their pods never reached the cache.
  void ExpireReservations(Clock::duration age);

  // In use on `node` (counted pods and reservations), for tests and metrics.
  std::pair<int64_t, int64_t> Used(const std::string& node) const;
  size_t Reservations() const;

 private:
  struct Slot;
  struct Held {  // what a pod holds on a node
    std::string node;
    int64_t gpus = 0, efa = 0;
  };
  struct Reservation {
    std::string job;
    Held held;
    Clock::time_point since;
  };
  // The slot of `node`, made when first named. REQUIRES: mu_ held.
  Slot& SlotOf(const std::string& node);
  void Add(const Held& held, int sign);  // REQUIRES: mu_ held

  mutable std::mutex mu_;
  std::map<std::string, scheduler::ClusterNode> nodes_;  // by name
  std::unordered_map<std::string, std::shared_ptr<Slot>> slots_;  // node -> its counters
  std::unordered_map<std::string, Held> counted_;  // pod key -> what the cache shows it holding
  std::map<std::string, Reservation> reserved_;    // pod key -> its reservation
  bool stale_ = true;  // nodes_ changed since view_ was built
  scheduler::ClusterView view_;
};

}  // namespace meshtrain::controller
