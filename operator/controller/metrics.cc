#include "operator/controller/metrics.h"

namespace meshtrain::controller {

using namespace prometheus;

namespace {
Histogram::BucketBoundaries SecondsBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
}
}  // namespace

OperatorMetrics::OperatorMetrics()
    : registry_(std::make_shared<Registry>()),
      reconciles_(BuildCounter().Name("meshtrain_operator_reconcile_total").Help("Reconciles by result").Register(*registry_)),
      reconcile_seconds_(BuildHistogram()
                             .Name("meshtrain_operator_reconcile_duration_seconds")
                             .Help("Time spent in one reconcile")
                             .Register(*registry_)
                             .Add({}, SecondsBuckets())),
      // Quantiles over the last 10 minutes: `meshtrain bench operator` reads them.
      reconcile_cpu_seconds_(BuildSummary()
                                 .Name("meshtrain_operator_reconcile_cpu_seconds")
                                 .Help("CPU time of one reconcile on its worker's thread")
                                 .Register(*registry_)
                                 .Add({}, Summary::Quantiles{{0.5, 0.005}, {0.9, 0.005}, {0.99, 0.001}},
                                      std::chrono::minutes(10), 5)),
      placement_conflicts_(BuildCounter()
                               .Name("meshtrain_operator_placement_conflicts_total")
                               .Help("Placements made again because another gang reserved their GPUs first")
                               .Register(*registry_)
                               .Add({})),
      absence_checks_(BuildCounter()
                          .Name("meshtrain_operator_absence_checks_total")
                          .Help("Decisions that took a pod or node missing from the caches as gone, checked with the "
                                "API server, by what it said")
                          .Register(*registry_)),
      queue_depth_(BuildGauge().Name("meshtrain_operator_workqueue_depth").Help("Keys waiting in the work queue").Register(*registry_).Add({})),
      jobs_(BuildGauge().Name("meshtrain_operator_jobs").Help("TrainingJobs by phase").Register(*registry_)),
      missing_nodes_(BuildGauge()
                         .Name("meshtrain_operator_job_missing_nodes")
                         .Help("Nodes fewer than spec.nodes that a shrunk elastic job's gang runs on")
                         .Register(*registry_)),
      // The kind of restart: "in_place" (the same pods, the next attempt of their ranks),
      // "replaced" (a lost node's pod moved to another node, the others in place),
      // "recreated" (the gang's pods deleted and placed anew), "shrunk" (a recreated gang
      // placed on fewer nodes, spec.elastic) or "grown" (recreated at spec.nodes again).
      restarts_(BuildCounter()
                    .Name("meshtrain_operator_gang_restarts_total")
                    .Help("Gangs restarted, by kind")
                    .Register(*registry_)),
      recovery_seconds_(BuildHistogram()
                            .Name("meshtrain_operator_recovery_seconds")
                            .Help("From the failure that restarted a gang to the operator seeing it train a step")
                            .Register(*registry_)
                            .Add({}, Histogram::BucketBoundaries{1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800})),
      placement_seconds_(BuildHistogram()
                             .Name("meshtrain_operator_placement_duration_seconds")
                             .Help("Time to plan one gang placement")
                             .Register(*registry_)
                             .Add({}, SecondsBuckets())),
      api_requests_(BuildCounter().Name("meshtrain_operator_api_requests_total").Help("Kubernetes API requests by verb and code").Register(*registry_)),
      api_request_seconds_(BuildHistogram()
                               .Name("meshtrain_operator_api_request_duration_seconds")
                               .Help("Kubernetes API request latency by verb")
                               .Register(*registry_)),
      queue_wait_seconds_(BuildHistogram()
                              .Name("meshtrain_operator_workqueue_wait_seconds")
                              .Help("Time a job key waited in the work queue before a worker took it")
                              .Register(*registry_)
                              .Add({}, SecondsBuckets())),
      leader_(BuildGauge().Name("meshtrain_operator_leader").Help("1 while this replica holds the leader Lease").Register(*registry_).Add({})) {
  for (const char* kind : {"in_place", "replaced", "recreated", "shrunk", "grown"}) restarts_.Add({{"kind", kind}});  // 0s, so dashboards have a series
  for (const char* result : {"gone", "cache_lagging"}) absence_checks_.Add({{"result", result}});
}

void OperatorMetrics::Reconciled(const std::string& result, double seconds) {
  reconciles_.Add({{"result", result}}).Increment();
  reconcile_seconds_.Observe(seconds);
}

void OperatorMetrics::ReconcileCpu(double seconds) { reconcile_cpu_seconds_.Observe(seconds); }

void OperatorMetrics::PlacementConflict() { placement_conflicts_.Increment(); }

void OperatorMetrics::AbsenceChecked(bool gone) { absence_checks_.Add({{"result", gone ? "gone" : "cache_lagging"}}).Increment(); }

void OperatorMetrics::SetQueueDepth(size_t depth) { queue_depth_.Set(static_cast<double>(depth)); }

void OperatorMetrics::SetJobsByPhase(const std::map<std::string, int>& counts) {
  std::lock_guard lock(mu_);
  for (auto& [phase, gauge] : phase_gauges_) gauge->Set(0);
  for (const auto& [phase, n] : counts) {
    auto& gauge = phase_gauges_[phase];
    if (!gauge) gauge = &jobs_.Add({{"phase", phase}});
    gauge->Set(n);
  }
}

void OperatorMetrics::SetJobsBelowPlannedSize(const std::map<std::pair<std::string, std::string>, int64_t>& missing) {
  std::lock_guard lock(mu_);
  for (auto it = missing_gauges_.begin(); it != missing_gauges_.end();) {
    if (missing.count(it->first)) {
      ++it;
      continue;
    }
    missing_nodes_.Remove(it->second);
    it = missing_gauges_.erase(it);
  }
  for (const auto& [job, n] : missing) {
    auto& gauge = missing_gauges_[job];
    if (!gauge) gauge = &missing_nodes_.Add({{"job_namespace", job.first}, {"job_name", job.second}});
    gauge->Set(double(n));
  }
}

void OperatorMetrics::GangRestarted(const std::string& kind) { restarts_.Add({{"kind", kind}}).Increment(); }

void OperatorMetrics::Recovered(double seconds) { recovery_seconds_.Observe(seconds); }

void OperatorMetrics::Placed(double seconds) { placement_seconds_.Observe(seconds); }

void OperatorMetrics::ApiRequest(const std::string& verb, int code, double seconds) {
  api_requests_.Add({{"verb", verb}, {"code", std::to_string(code)}}).Increment();
  api_request_seconds_.Add({{"verb", verb}}, SecondsBuckets()).Observe(seconds);
}

void OperatorMetrics::QueueWait(double seconds) { queue_wait_seconds_.Observe(seconds); }

void OperatorMetrics::SetLeader(bool leading) { leader_.Set(leading ? 1 : 0); }

}  // namespace meshtrain::controller
