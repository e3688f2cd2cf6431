// meshtrain-operator: watches TrainingJobs and runs their gangs (docs/operator.md).

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include <CLI/CLI.hpp>
#include <cpprest/http_listener.h>
#include <prometheus/exposer.h>
#include <spdlog/spdlog.h>

#include "api/logging.h"
#include "operator/controller/controller.h"
#include "operator/controller/launcher_client.h"
#include "operator/controller/worker_defaults.h"
#include "operator/kube/config.h"
#include "operator/kube/leader_election.h"

namespace {

using namespace meshtrain;

// /healthz answers while the process serves; /readyz once the caches are synced (and,
// with --leader-elect, while this replica leads).
std::unique_ptr<web::http::experimental::listener::http_listener> ServeHealth(int port,
                                                                             const std::function<bool()>& ready) {
  auto listener = std::make_unique<web::http::experimental::listener::http_listener>(
      "http://0.0.0.0:" + std::to_string(port));
  listener->support(web::http::methods::GET, [ready](web::http::http_request request) {
    const std::string path = request.relative_uri().path();
    if (path == "/healthz") return void(request.reply(200, "ok"));
    if (path == "/readyz") return void(request.reply(ready() ? 200 : 503, ready() ? "ok" : "not ready"));
    request.reply(404, "not found");
  });
  listener->open().wait();
  return listener;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"meshtrain-operator: the TrainingJob controller"};
  std::string kubeconfig, namespace_, log_level = "info", lease_namespace, worker_defaults, launcher_key_file;
  bool leader_elect = false, all_namespaces = false, kueue = false;
  int workers = 4, metrics_port = 8080, health_port = 8081;
  double qps = 50;
  int burst = 100;
  int pending_timeout_s = 120, avoid_failed_node_s = 600, checkpoint_timeout_s = 130;
  int progress_interval_s = 5, launcher_interval_ms = 1000;
  app.add_option("--kubeconfig", kubeconfig, "kubeconfig file (default: $KUBECONFIG, in-cluster, ~/.kube/config)");
  app.add_option("--namespace", namespace_, "watch only this namespace (default: every namespace)");
  app.add_flag("--all-namespaces", all_namespaces, "watch every namespace (the default)");
  app.add_flag("--leader-elect", leader_elect, "run only while holding the meshtrain-operator Lease");
  app.add_option("--leader-election-namespace", lease_namespace, "namespace of the Lease (default: the config's)");
  app.add_option("--workers", workers, "concurrent reconciles")->check(CLI::Range(1, 64));
  app.add_option("--qps", qps, "client-side API request rate (<= 0: unlimited)");
  app.add_option("--burst", burst, "client-side API request burst")->check(CLI::Range(1, 100000));
  app.add_option("--metrics-port", metrics_port, "Prometheus /metrics port (0: off)")->check(CLI::Range(0, 65535));
  app.add_option("--health-port", health_port, "/healthz and /readyz port (0: off)")->check(CLI::Range(0, 65535));
  app.add_option("--avoid-failed-node", avoid_failed_node_s,
                 "seconds a node that failed a job (a failed pod, NotReady) is left out of its placements")
      ->check(CLI::Range(0, 86400));
  app.add_option("--pending-timeout", pending_timeout_s, "seconds a pod may stay Pending before its gang is re-planned")
      ->check(CLI::Range(1, 86400));
  app.add_option("--checkpoint-timeout", checkpoint_timeout_s,
                 "seconds a suspended or evicted gang's ranks may take to checkpoint before its pods go anyway "
                 "(keep it above the launchers' 100 s grace)")
      ->check(CLI::Range(1, 86400));
  app.add_option("--progress-interval", progress_interval_s, "seconds between reads of rank 0's training metrics")
      ->check(CLI::Range(1, 3600));
  app.add_option("--launcher-interval", launcher_interval_ms,
                 "milliseconds between reads of each pod launcher's attempt (how soon a failed rank is seen)")
      ->check(CLI::Range(100, 600000));
  app.add_option("--worker-defaults", worker_defaults,
                 "YAML file of what worker pods get unless their TrainingJob says otherwise (the Helm chart's)");
  app.add_option("--launcher-key-file", launcher_key_file,
                 "file of the operator's key (at least 32 bytes), from which each pod's launcher token derives "
                 "(the Helm chart's Secret); without it, a failed rank restarts its gang by recreating the pods");
  app.add_flag("--kueue", kueue,
               "Kueue is installed and the chart's kueue.enabled is true: a job labelled kueue.x-k8s.io/queue-name "
               "gets a Workload and runs once Kueue admits it; without it, the label is ignored with a Warning Event");
  app.add_option("--log-level", log_level, "log level")->check(CLI::IsMember(LogLevelNames()));
  CLI11_PARSE(app, argc, argv);
  InitLogging("meshtrain-operator", log_level);
  if (all_namespaces) namespace_.clear();

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  try {
    kube::KubeConfig config = kube::LoadConfig(kubeconfig);
    spdlog::info("API server {} (from {}); watching {}", config.server, config.source,
                 namespace_.empty() ? "every namespace" : "namespace " + namespace_);
    controller::OperatorMetrics metrics;
    kube::ClientOptions client_options;
    client_options.qps = qps;
    client_options.burst = burst;
    kube::Client client(config, client_options);
    client.SetRequestObserver(
        [&metrics](const std::string& verb, int code, double seconds) { metrics.ApiRequest(verb, code, seconds); });

    std::unique_ptr<prometheus::Exposer> exposer;
    if (metrics_port > 0) {
      exposer = std::make_unique<prometheus::Exposer>("0.0.0.0:" + std::to_string(metrics_port));
      exposer->RegisterCollectable(metrics.registry());
    }
    controller::ControllerOptions options;
    options.namespace_ = namespace_;
    options.workers = workers;
    options.reconciler.decide.pending_timeout = std::chrono::seconds(pending_timeout_s);
    options.reconciler.decide.kueue = kueue;
    options.reconciler.decide.checkpoint_timeout = std::chrono::seconds(checkpoint_timeout_s);
    options.reconciler.avoid_failed_node = std::chrono::seconds(avoid_failed_node_s);
    options.progress.interval = std::chrono::seconds(progress_interval_s);
    options.launchers.interval = std::chrono::milliseconds(launcher_interval_ms);
    if (!worker_defaults.empty()) options.reconciler.decide.worker = controller::LoadWorkerDefaults(worker_defaults);
    if (const auto& policy = options.reconciler.decide.worker.network_policy; !policy.enabled)
      spdlog::warn("networkPolicy.enabled is false: any pod in the cluster can reach the jobs' pods");
    else if (policy.operator_from.empty())
      spdlog::warn("networkPolicy.operatorFrom is empty: this operator cannot reach a job's metrics or launchers, so "
                   "it reads no progress, and a failed rank restarts its gang by recreating the pods");
    if (!launcher_key_file.empty()) {
      options.reconciler.launcher_key = controller::LoadLauncherKey(launcher_key_file);
    } else {
      spdlog::warn("no --launcher-key-file: pods get no launcher token, so a failed rank restarts its gang by "
                   "recreating the pods, not in place");
    }
    controller::Controller controller(client, &metrics, options);
    kube::LeaderElectionOptions election;
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    election.identity = std::string(host) + "_" + std::to_string(getpid());
    election.namespace_ = lease_namespace.empty() ? config.namespace_ : lease_namespace;
    kube::LeaderElector elector(client, election);

    std::unique_ptr<web::http::experimental::listener::http_listener> health;
    if (health_port > 0) {
      // A standby replica is ready (it serves, and campaigns); the leader once its caches synced.
      health = ServeHealth(health_port, [&] { return leader_elect && !elector.IsLeader() ? true : controller.Ready(); });
    }

    std::stop_source stop;
    std::thread waiter([&] {
      int sig = 0;
      sigwait(&signals, &sig);
      spdlog::info("signal {}: shutting down", sig);
      stop.request_stop();
    });
    waiter.detach();

    bool lost = false;
    if (leader_elect) {
      metrics.SetLeader(false);
      const bool led = elector.Run(stop.get_token(), [&](std::stop_token leading) {
        metrics.SetLeader(true);
        controller.Run(leading);
        metrics.SetLeader(false);
      });
      lost = led && !stop.stop_requested();
    } else {
      metrics.SetLeader(true);
      controller.Run(stop.get_token());
    }
    if (health) health->close().wait();
    if (lost) {
      spdlog::error("lost the leader lease; exiting so a fresh process can campaign");
      return 1;
    }
    spdlog::info("stopped");
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 1;
  }
  return 0;
}
