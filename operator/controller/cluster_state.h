// What the operator knows of the cluster's nodes, of what its pods hold on them, and of its
// own pod writes that the pod cache has not shown yet, kept current from the node and pod
// informers' events instead of recomputed by each reconcile:
//
// - each node as placement sees it (scheduler::NodeFromKubectl) and whether it is Ready;
//   an immutable scheduler::Topology of them, built again on the first View() after a
//   change placement sees (labels, allocatable, taints, readiness, cordon): a node's
//   heartbeat builds nothing;
// - the GPUs and EFA interfaces in use on each node: the requests of the operator's pods
//   the cache shows that have not finished, on the node they are bound or pinned to, plus
//   the claims of its pods in flight;
// - its pods in flight, one record each, in one ledger: kube-controller-manager's
//   expectations and kube-scheduler's assumed pods together. A pod to be created has a
//   record from Reserve, which holds its claim so that no other gang is placed on those
//   GPUs; once its create is sent (Creating), the pod cache is expected to show it, and
//   until it does the job is not judged from the cache (InFlight). A pod deleted has a
//   record (Deleting) until the cache drops it. The pod's event ends its record, and the
//   cache's own view of the pod counts from then on; a create that failed ends it at once
//   (Release). A record older than the timeout ends on the next Expire, or the next
//   InFlight of its job (the same rule, one path): a pod created and deleted between two
//   lists of a relisting informer never shows, and its claim is given back with it.
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
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "operator/controller/cluster_types.h"
#include "operator/scheduler/topology.h"

namespace meshtrain::controller {

class ClusterState {
 public:
  using Clock = std::chrono::steady_clock;

  // A pod in flight for longer than `in_flight_timeout` is no longer waited for.
  explicit ClusterState(Clock::duration in_flight_timeout = std::chrono::seconds(60));
  ~ClusterState();
  ClusterState(const ClusterState&) = delete;
  ClusterState& operator=(const ClusterState&) = delete;

  // The informers' events; `old_object` is null for an add, `object` null for a delete. A
  // pod's event ends its record in flight: the cache shows it, or no longer does.
  void NodeChanged(const nlohmann::json* old_object, const nlohmann::json* object);
  void PodChanged(const nlohmann::json* old_object, const nlohmann::json* object);

  // kGone when no node of that name is known.
  NodeState Node(const std::string& name) const;
  // The topology and what is in use on it now.
  scheduler::ClusterView View();

  // Records the pods of `claims` (of job `job`) in flight, each taking its claim's
  // capacity on its node. With `check`, records nothing and returns false unless every
  // node has the claims free, counting a claim's earlier record under the same pod as
  // free. A claim whose pod the cache already shows takes nothing more.
  bool Reserve(const std::string& job, const std::vector<PodClaim>& claims, bool check, Clock::time_point now);
  // The creates of `pods` (namespace/name) of `job` are sent: the pod cache is expected to
  // show them.
  void Creating(const std::string& job, const std::vector<std::string>& pods, Clock::time_point now);
  // Ends the record of pod `pod` (namespace/name) of `job`: its create failed, or was
  // never sent.
  void Release(const std::string& job, const std::string& pod);
  // The delete of pod `uid` of `job` is sent: the pod cache is expected to drop it.
  void Deleting(const std::string& job, const std::string& uid, Clock::time_point now);
  // Ends the record of the delete of pod `uid`: it failed, or the pod was gone (404).
  void DeleteFailed(const std::string& job, const std::string& uid);

  struct InFlightPods {
    std::set<std::string> creations;  // pods (namespace/name) created that the cache has not shown
    std::set<std::string> deletions;  // uids of pods deleted that the cache still shows
    bool empty() const { return creations.empty() && deletions.empty(); }
  };
  // What the pod cache has not shown yet of `job`'s creates and deletes, less the records
  // that waited past the timeout (ended). Read it before the cache: whatever is no longer
  // in flight by then is in what the cache shows.
  InFlightPods InFlight(const std::string& job, Clock::time_point now);
  // Ends every record older than the timeout.
  void Expire(Clock::time_point now);
  // Ends every record of `job` (it is gone).
  void Forget(const std::string& job);

  // In use on `node` (counted pods and pods in flight), for tests and metrics.
  std::pair<int64_t, int64_t> Used(const std::string& node) const;
  // The pods in flight that hold a claim.
  size_t Reservations() const;

 private:
  struct Slot;
  struct Held {  // what a pod holds on a node; an empty node: nothing
    std::string node;
    int64_t gpus = 0, efa = 0;
  };
  struct Record {  // a pod in flight
    Held held;          // a create's claim
    bool sent = false;  // a create: its request went out
    Clock::time_point since;
  };
  struct JobInFlight {
    std::map<std::string, Record> creates;  // by pod key
    std::map<std::string, Record> deletes;  // by pod uid
    bool empty() const { return creates.empty() && deletes.empty(); }
  };
  using Ledger = std::unordered_map<std::string, JobInFlight>;  // by job key

  // The slot of `node`, made when first named. REQUIRES: mu_ held.
  Slot& SlotOf(const std::string& node);
  void Add(const Held& held, int sign);  // REQUIRES: mu_ held
  // Ends a create's record, giving back its claim. REQUIRES: mu_ held.
  void EndCreate(JobInFlight& job, std::map<std::string, Record>::iterator record);
  // Ends the records of `job` (the ledger's entry `it`) older than the timeout; erases
  // the entry once it holds none. REQUIRES: mu_ held.
  void ExpireJob(Ledger::iterator it, Clock::time_point now);

  const Clock::duration in_flight_timeout_;
  mutable std::mutex mu_;
  std::map<std::string, scheduler::ClusterNode> nodes_;  // by name
  std::unordered_map<std::string, std::shared_ptr<Slot>> slots_;  // node -> its counters
  std::unordered_map<std::string, Held> counted_;  // pod key -> what the cache shows it holding
  Ledger in_flight_;
  bool stale_ = true;  // nodes_ changed since view_ was built
  scheduler::ClusterView view_;
};

}  // namespace meshtrain::controller
