// A Kueue admission simulator for the test API server: NOT Kueue, a stand-in for tests.
// It plays one ClusterQueue's part towards the Workloads (kueue.x-k8s.io/v1beta2) created
// on the server, as Kueue's scheduler and its job-integration contract do:
//
// - a quota of `quota_nodes` pods (one a node; 0: none), set by the test at any time;
// - Workloads are admitted by priority (spec.priority, 0 without it, as Kueue reads it),
//   then in the order they were created (a requeued one as created again), each once its
//   pods fit the quota left: status.admission (the ClusterQueue, one
//   podSetAssignment per PodSet with the flavor `flavor` for every resource it requests)
//   with QuotaReserved=True and Admitted=True, and Evicted=False when it had one; the
//   server's GET /_test/created gets {kind "Admission", key, job, ms} for each admission;
// - with `topology` and a PodSet that asks for it (topologyRequest), a v1beta2
//   topologyAssignment over the first nodes of `nodes` that no other admitted Workload
//   holds, in that order: pod index r on the r-th (levels [kubernetes.io/hostname], one
//   slice, podCounts universal 1); ClusterQueue domains, preferences and fragmentation are
//   not simulated;
// - preemption within the ClusterQueue: a waiting Workload that does not fit evicts
//   admitted ones of lower priority (the lowest first, then the newest admitted) until what
//   they hold would make it fit, if it would; it waits, first in line, for their quota;
// - Evict, and preemption: Evicted=True (reason Preempted); the quota stays held until the
//   job gives it back (QuotaReserved=False, as the job integration writes once its pods
//   are gone), and the Workload is then queued again, behind those of its priority;
// - a Workload Finished=True, or deleted, gives its quota back.
//
// Test routes: POST /_test/kueue/quota {"nodes"}, POST /_test/kueue/evict {"namespace",
// "job"} (the Workload labelled meshtrain.dev/job-name=job), GET /_test/kueue/state.
//
// Thread-safety: public methods may be called from any thread.

#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/kube/api_server.h"

namespace meshtrain::testing {

struct KueueSimulatorOptions {
  int quota_nodes = 0;
  bool topology = true;            // TAS assignments for PodSets with a topologyRequest
  std::vector<std::string> nodes;  // the nodes TAS assigns, in order
  std::string cluster_queue = "training";
  std::string flavor = "default-flavor";
};

class KueueSimulator {
 public:
  KueueSimulator(ApiServer& server, KueueSimulatorOptions options);
  ~KueueSimulator();

  void Start();
  void Stop();
  void SetQuota(int nodes);
  // Evicts the admitted Workload of job `job` in `namespace_`; false when there is none.
  bool Evict(const std::string& namespace_, const std::string& job);
  nlohmann::json State() const;

  static constexpr const char* kWorkloads = "kueue.x-k8s.io/workloads";  // the server's resource key

 private:
  struct Held {
    int pods = 0;
    std::vector<std::string> nodes;  // TAS
    bool evicted = false;
    int priority = 0;
    uint64_t admitted = 0;  // the order of admissions
  };
  void Loop(std::stop_token stop);
  void Observe(const StoredEvent& event);  // REQUIRES: mu_ held
  void AdmitWaiting();                     // REQUIRES: mu_ held
  bool Admit(const std::string& key);      // REQUIRES: mu_ held
  // Evicts admitted Workloads of lower priority than `key`'s that together make room for
  // `pods` more, if they can. REQUIRES: mu_ held.
  void Preempt(const std::string& key, int pods, int free);
  bool EvictHeld(const std::string& key, const std::string& message);  // REQUIRES: mu_ held

  ApiServer& server_;
  KueueSimulatorOptions options_;
  mutable std::mutex mu_;
  std::deque<std::string> waiting_;     // Workload keys ("ns/name"), in admission order
  std::map<std::string, Held> held_;    // admitted Workloads -> what they hold
  std::map<std::string, std::string> jobs_;  // "ns/job" -> Workload key
  std::map<std::string, int> priorities_;    // Workload key -> spec.priority
  uint64_t admissions_ = 0;
  std::jthread thread_;
};

}  // namespace meshtrain::testing
