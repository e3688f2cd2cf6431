// The operator's Prometheus metrics (prefix meshtrain_operator_).
//
// Thread-safe (prometheus-cpp metrics are atomic).

#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/summary.h>

namespace meshtrain::controller {

class OperatorMetrics {
 public:
  OperatorMetrics();
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  void Reconciled(const std::string& result, double seconds);  // result: success | requeue | error
  // The CPU time one reconcile took on its worker's thread.
  void ReconcileCpu(double seconds);
  // A placement whose GPUs another gang reserved first (the job is placed again).
  void PlacementConflict();
  // A decision that took a pod or node missing from the caches as gone, checked with the
  // API server: "gone" when it agreed, "cache_lagging" when it still had them.
  void AbsenceChecked(bool gone);
  void SetQueueDepth(size_t depth);
  void SetJobsByPhase(const std::map<std::string, int>& counts);
  // (namespace, name) -> how many nodes fewer than spec.nodes the job's gang runs on, for
  // every job below its planned size (spec.elastic); a job left out has its series removed.
  void SetJobsBelowPlannedSize(const std::map<std::pair<std::string, std::string>, int64_t>& missing);
  void GangRestarted(const std::string& kind);  // in_place | recreated | shrunk | grown
  // A restarted gang trained its first step `seconds` after the failure.
  void Recovered(double seconds);
  // The pass that placed a gang decided in `seconds`: the placement search, the layout
  // and the gang's objects.
  void Placed(double seconds);
  void ApiRequest(const std::string& verb, int code, double seconds);
  void QueueWait(double seconds);  // from a key's Add to the worker's Get
  void SetLeader(bool leading);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& reconciles_;
  prometheus::Histogram& reconcile_seconds_;
  prometheus::Summary& reconcile_cpu_seconds_;
  prometheus::Counter& placement_conflicts_;
  prometheus::Family<prometheus::Counter>& absence_checks_;
  prometheus::Gauge& queue_depth_;
  prometheus::Family<prometheus::Gauge>& jobs_;
  prometheus::Family<prometheus::Gauge>& missing_nodes_;
  prometheus::Family<prometheus::Counter>& restarts_;
  prometheus::Histogram& recovery_seconds_;
  prometheus::Histogram& placement_seconds_;
  prometheus::Family<prometheus::Counter>& api_requests_;
  prometheus::Family<prometheus::Histogram>& api_request_seconds_;
  prometheus::Histogram& queue_wait_seconds_;
  prometheus::Gauge& leader_;
  std::mutex mu_;
  std::map<std::string, prometheus::Gauge*> phase_gauges_;
  std::map<std::pair<std::string, std::string>, prometheus::Gauge*> missing_gauges_;
};

}  // namespace meshtrain::controller
