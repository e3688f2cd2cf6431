// The TrainingJob controller: informers for TrainingJobs, their Pods (by label) and
// Nodes, and the PodPollers' new readings (rank 0's progress, the launchers' attempts),
// (and with Kueue, the jobs' Workloads) feed a rate-limited work queue of job keys; `workers` threads run the Reconciler, so
// independent jobs reconcile in parallel. The pod and node informers' events also keep
// the ClusterState (nodes, topology, GPUs in use, the operator's pods in flight) current,
// and each job's pods are indexed by job and by node.
//
// Thread-safety: Run() once; Ready() from any thread.

#pragma once

#include <atomic>
#include <memory>
#include <stop_token>
#include <string>

#include "operator/controller/metrics.h"
#include "operator/controller/pod_poller.h"
#include "operator/controller/reconciler.h"
#include "operator/kube/client.h"
#include "operator/kube/informer.h"
#include "operator/kube/work_queue.h"

namespace meshtrain::controller {

struct ControllerOptions {
  std::string namespace_;  // empty: every namespace
  int workers = 4;
  ReconcilerOptions reconciler;
  // Their port and path are the worker contract's; the rest is the caller's.
  PodPollerOptions progress;                                             // rank 0's /metrics
  PodPollerOptions launchers{.port = 0,  // every launcher's /attempt
                             .path = "",
                             .interval = std::chrono::milliseconds(1000),
                             .timeout = std::chrono::milliseconds(1000)};
  kube::WorkQueueOptions queue;
  kube::InformerOptions informer;
};

class Controller {
 public:
  Controller(kube::Client& client, OperatorMetrics* metrics, ControllerOptions options);
  ~Controller();

  // Starts the informers, waits for their first lists, and reconciles until `stop`.
  void Run(std::stop_token stop);
  bool Ready() const { return ready_.load(); }

 private:
  void Worker();
  void EnqueueJobOf(const nlohmann::json& pod);
  void OnPod(const nlohmann::json* old_pod, const nlohmann::json* pod);
  void OnNodeChange(const nlohmann::json& old_node, const nlohmann::json& node);

  kube::Client& client_;
  OperatorMetrics* metrics_;
  const ControllerOptions options_;
  kube::Informer jobs_;
  kube::Informer pods_;
  kube::Informer nodes_;
  // With Kueue (DecideOptions::kueue): the Workloads of the jobs, whose changes (an
  // admission, an eviction) enqueue their job; the reconciler reads them live.
  std::unique_ptr<kube::Informer> workloads_;
  ClusterState cluster_;
  kube::WorkQueue queue_;
  PodPoller progress_;
  PodPoller launchers_;
  Reconciler reconciler_;
  std::atomic<bool> ready_{false};
};

}  // namespace meshtrain::controller
