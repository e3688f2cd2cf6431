#include "operator/controller/controller.h"

#include <time.h>

#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "api/json_codec.h"
#include "api/worker_contract.h"
#include "operator/controller/builders.h"
#include "operator/controller/cache_transforms.h"
#include "operator/controller/worker_readings.h"
#include "operator/kube/objects.h"

namespace meshtrain::controller {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

PodPollerOptions WithTarget(PodPollerOptions options, int port, const char* path) {
  options.port = port;
  options.path = path;
  return options;
}

std::optional<json> ProgressReading(const std::string& metrics_text) {
  api::ProgressStatus progress;
  if (!ParseProgress(metrics_text, &progress)) return std::nullopt;
  return api::ToJson(progress);
}

std::optional<json> LauncherReading(const std::string& body) {
  json answer = json::parse(body, nullptr, false);
  if (!ParseLauncherState(answer)) return std::nullopt;
  return answer;
}

}  // namespace

Controller::Controller(kube::Client& client, OperatorMetrics* metrics, ControllerOptions options)
    : client_(client),
      metrics_(metrics),
      options_(std::move(options)),
      jobs_(client, kube::resources::TrainingJobs(), options_.namespace_, {}, options_.informer),
      pods_(client, kube::resources::Pods(), options_.namespace_, kube::ListOptions{kJobNameLabel, "", ""},
            options_.informer),
      nodes_(client, kube::resources::Nodes(), "", {}, options_.informer),
      cluster_(options_.reconciler.in_flight_timeout),
      queue_(options_.queue),
      progress_(WithTarget(options_.progress, api::worker::kMetricsPort, "/metrics"), ProgressReading,
                [this](const std::string& job_key) { queue_.Add(job_key); }),
      launchers_(WithTarget(options_.launchers, api::worker::kLauncherPort, "/attempt"), LauncherReading,
                 [this](const std::string& job_key) { queue_.Add(job_key); }),
      reconciler_(client, jobs_, pods_, cluster_, &progress_, &launchers_, metrics, options_.reconciler) {
  auto enqueue = [this](const json& job) { queue_.Add(kube::KeyOf(job)); };
  jobs_.AddHandler({enqueue, [enqueue](const json&, const json& job) { enqueue(job); }, enqueue});
  // The pod and node caches keep only what their readers use (cache_transforms.h).
  pods_.SetTransform(PodForCache);
  nodes_.SetTransform(NodeForCache);
  if (options_.reconciler.decide.kueue) {
    workloads_ = std::make_unique<kube::Informer>(client, kube::resources::Workloads(), options_.namespace_,
                                                  kube::ListOptions{kJobNameLabel, "", ""}, options_.informer);
    // The cache keeps what names the job; the reconciler GETs the Workload it decides from.
    workloads_->SetTransform([](json workload) {
      const json& meta = workload["metadata"];
      return json{{"metadata",
                   {{"name", meta.value("name", "")},
                    {"namespace", meta.value("namespace", "")},
                    {"resourceVersion", meta.value("resourceVersion", "")},
                    {"labels", meta.value("labels", json::object())}}}};
    });
    auto enqueue_job = [this](const json& workload) {
      const json& meta = workload["metadata"];
      const std::string job = meta.value("labels", json::object()).value(kJobNameLabel, "");
      if (!job.empty()) queue_.Add(kube::ObjectKey(meta.value("namespace", ""), job));
    };
    workloads_->AddHandler(
        {enqueue_job, [enqueue_job](const json&, const json& workload) { enqueue_job(workload); }, enqueue_job});
  }
  pods_.AddIndex(kPodsByJob, PodJobKeys);
  pods_.AddIndex(kPodsByNode, PodNodes);
  pods_.AddHandler({[this](const json& pod) { OnPod(nullptr, &pod); },
                    [this](const json& old_pod, const json& pod) { OnPod(&old_pod, &pod); },
                    [this](const json& pod) { OnPod(&pod, nullptr); }});
  nodes_.AddHandler({[this](const json& node) { cluster_.NodeChanged(nullptr, &node); },
                     [this](const json& old_node, const json& node) {
                       cluster_.NodeChanged(&old_node, &node);
                       OnNodeChange(old_node, node);
                     },
                     [this](const json& node) {
                       cluster_.NodeChanged(&node, nullptr);
                       OnNodeChange(node, json());
                     }});
}

Controller::~Controller() { queue_.ShutDown(); }

void Controller::EnqueueJobOf(const json& pod) {
  const json& meta = pod["metadata"];
  const std::string job = meta.value("labels", json::object()).value(kJobNameLabel, "");
  if (!job.empty()) queue_.Add(kube::ObjectKey(meta.value("namespace", ""), job));
}

void Controller::OnPod(const json* old_pod, const json* pod) {
  cluster_.PodChanged(old_pod, pod);
  for (const std::string& job : PodJobKeys(pod ? *pod : *old_pod)) queue_.Add(job);
}

// A node that stops being Ready fails the gangs on it; one that becomes Ready may let a
// Pending job fit.
void Controller::OnNodeChange(const json& old_node, const json& node) {
  const bool was = kube::ConditionTrue(old_node, "Ready"), is = kube::ConditionTrue(node, "Ready");
  if (was == is) return;
  const std::string name = (node.is_object() ? node : old_node)["metadata"].value("name", "");
  if (was) {
    for (const json& pod : pods_.ByIndex(kPodsByNode, name)) EnqueueJobOf(pod);
  } else {
    jobs_.ForEach([&](const json& job) {
      if (job.value("status", json::object()).value("phase", "") == "Pending") queue_.Add(kube::KeyOf(job));
    });
  }
}

void Controller::Worker() {
  kube::WorkQueue::Clock::duration waited{};
  while (auto key = queue_.Get(&waited)) {
    if (metrics_) metrics_->QueueWait(std::chrono::duration<double>(waited).count());
    const auto started = Clock::now();
    timespec cpu_started{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu_started);
    const size_t slash = key->find('/');
    const std::string ns = slash == std::string::npos ? "" : key->substr(0, slash);
    const std::string name = slash == std::string::npos ? *key : key->substr(slash + 1);
    std::string result = "success";
    try {
      const ReconcileResult r = reconciler_.Reconcile(ns, name);
      queue_.Forget(*key);
      if (r.requeue_after.count() > 0) {
        queue_.AddAfter(*key, r.requeue_after);
        result = "requeue";
      }
    } catch (const std::exception& e) {
      result = "error";
      spdlog::warn("reconcile {}: {} (retry {})", *key, e.what(), queue_.NumRequeues(*key) + 1);
      queue_.AddRateLimited(*key);
    }
    if (metrics_) {
      timespec cpu_ended{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu_ended);
      metrics_->ReconcileCpu(double(cpu_ended.tv_sec - cpu_started.tv_sec) +
                             1e-9 * double(cpu_ended.tv_nsec - cpu_started.tv_nsec));
      metrics_->Reconciled(result, std::chrono::duration<double>(Clock::now() - started).count());
    }
    queue_.Done(*key);
  }
}

void Controller::Run(std::stop_token stop) {
  jobs_.Start();
  pods_.Start();
  nodes_.Start();
  if (workloads_) workloads_->Start();
  for (auto* informer : {&jobs_, &pods_, &nodes_, workloads_.get()}) {
    while (informer && !stop.stop_requested() && !informer->WaitForSync(std::chrono::milliseconds(200))) {
    }
  }
  if (!stop.stop_requested()) {
    ready_ = true;
    spdlog::info("controller: caches synced ({} jobs, {} pods, {} nodes); {} workers", jobs_.Size(), pods_.Size(),
                 nodes_.Size(), options_.workers);
  }
  progress_.Start();
  launchers_.Start();
  std::vector<std::thread> workers;
  for (int i = 0; i < options_.workers && !stop.stop_requested(); ++i) workers.emplace_back([this] { Worker(); });
  // Gauges, every second, until stopped.
  std::mutex mu;
  std::condition_variable_any cv;
  while (!stop.stop_requested()) {
    cluster_.Expire(Clock::now());
    if (metrics_) {
      metrics_->SetQueueDepth(queue_.Len());
      std::map<std::string, int> phases;
      std::map<std::pair<std::string, std::string>, int64_t> below_size;
      jobs_.ForEach([&](const json& job) {
        const json status = job.value("status", json::object());
        const std::string phase = status.value("phase", "");
        phases[phase.empty() ? "Pending" : phase]++;
        if (phase != "Starting" && phase != "Running") return;
        const auto placed = int64_t(status.value("placement", json::object()).value("nodes", json::array()).size());
        const int64_t planned = job.value("spec", json::object()).value("nodes", int64_t{1});
        if (placed > 0 && placed < planned)
          below_size[{job["metadata"].value("namespace", ""), job["metadata"].value("name", "")}] = planned - placed;
      });
      metrics_->SetJobsByPhase(phases);
      metrics_->SetJobsBelowPlannedSize(below_size);
    }
    std::unique_lock lock(mu);
    cv.wait_for(lock, stop, std::chrono::seconds(1), [] { return false; });
  }
  queue_.ShutDown();
  for (auto& w : workers) w.join();
  progress_.Stop();
  launchers_.Stop();
  jobs_.Stop();
  pods_.Stop();
  nodes_.Stop();
  if (workloads_) workloads_->Stop();
  ready_ = false;
}

}  // namespace meshtrain::controller
