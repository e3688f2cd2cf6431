// meshtrain-test-apiserver: the test API server plus the kubelet simulator (and, with
// --kueue, the Kueue admission simulator of kueue_simulator.h), as one process that e2e tests and `meshtrain bench operator` start. It writes a kubeconfig
// for kubectl and the operator, then serves until SIGTERM or SIGINT.

#include <signal.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <thread>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "api/logging.h"
#include "operator/scheduler/cluster.h"
#include "operator/scheduler/synthetic_cluster.h"
#include "tests/support/kube/api_server.h"
#include "tests/support/kube/kubelet_simulator.h"
#include "tests/support/kube/kueue_simulator.h"

int main(int argc, char** argv) {
  using namespace meshtrain;
  CLI::App app{"meshtrain-test-apiserver: a Kubernetes API server and kubelet simulator for tests"};
  int port = 0;
  std::string kubeconfig, cluster_file, port_file, record_dir;
  int synthetic_nodes = 0, bookmark_ms = 1000;
  testing::KubeletOptions kubelet;
  std::string worker_binary;
  app.add_option("--port", port, "port on 127.0.0.1 (0: any free one)");
  app.add_option("--kubeconfig-out", kubeconfig, "write a kubeconfig for this server here")->required();
  app.add_option("--port-file", port_file, "write the port here once listening");
  app.add_option("--cluster", cluster_file, "nodes to register (compact cluster description, as for meshtrain plan)");
  app.add_option("--synthetic-nodes", synthetic_nodes, "register a synthetic EKS-like cluster of this many idle nodes");
  app.add_option("--kubelet", kubelet.mode, "script, run or none")->check(CLI::IsMember({"script", "run", "none"}));
  app.add_option("--script-exit-code", kubelet.script_exit_code, "script mode: exit code of every pod");
  app.add_option("--script-seconds", kubelet.script_seconds, "script mode: how long every pod runs");
  app.add_option("--workdir", kubelet.workdir, "directory for pod files and logs");
  app.add_option("--worker-binary", worker_binary, "run mode: the local meshtrain-worker");
  app.add_option("--record-dir", record_dir, "save every Pod, Service and ConfigMap the operator writes here");
  app.add_option("--bookmark-ms", bookmark_ms, "interval between watch bookmarks");
  bool kueue = false;
  testing::KueueSimulatorOptions kueue_options;
  std::vector<std::string> kueue_nodes;
  app.add_flag("--kueue", kueue, "run the Kueue admission simulator (not Kueue: kueue_simulator.h)");
  app.add_option("--kueue-quota-nodes", kueue_options.quota_nodes, "the simulated ClusterQueue's quota, in nodes");
  app.add_option("--kueue-tas", kueue_options.topology, "TAS assignments for PodSets with a topologyRequest");
  app.add_option("--kueue-nodes", kueue_nodes,
                 "the nodes TAS assigns, in order (default: every node, in reverse name order)")
      ->delimiter(',');
  testing::ApiServer::Options options;
  app.add_option("--tls-cert-file", options.tls.cert_file, "serve HTTPS with this certificate (PEM)");
  app.add_option("--tls-key-file", options.tls.key_file, "the key of --tls-cert-file");
  app.add_option("--client-ca-file", options.tls.client_ca_file, "accept client certificates signed by this CA");
  app.add_option("--ca-file", options.ca_file, "the CA of --tls-cert-file, for the kubeconfig written");
  app.add_option("--kubeconfig-client-cert", options.client_cert_file, "the kubeconfig authenticates with this certificate");
  app.add_option("--kubeconfig-client-key", options.client_key_file, "the key of --kubeconfig-client-cert");
  CLI11_PARSE(app, argc, argv);
  InitLogging("meshtrain-test-apiserver", "info");
  if (!worker_binary.empty()) kubelet.commands["meshtrain-worker"] = worker_binary;

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // threads inherit it; sigwait below takes them

  try {
    options.bookmark_interval_ms = bookmark_ms;
    options.record_dir = record_dir;
    testing::ApiServer server(options);
    scheduler::ClusterSnapshot snapshot;
    if (!cluster_file.empty()) snapshot = scheduler::ReadClusterFile(cluster_file);
    if (synthetic_nodes > 0) {
      scheduler::SyntheticClusterOptions synthetic;
      synthetic.nodes = synthetic_nodes;
      synthetic.gpu_used_fraction = 0;
      snapshot = scheduler::MakeSyntheticCluster(synthetic);
    }
    testing::KubeletSimulator simulator(server, kubelet);
    simulator.AddNodes(snapshot);
    kueue_options.nodes = kueue_nodes;
    if (kueue_options.nodes.empty())
      for (auto it = snapshot.nodes.rbegin(); it != snapshot.nodes.rend(); ++it) kueue_options.nodes.push_back(it->name);
    std::unique_ptr<testing::KueueSimulator> kueue_simulator;
    if (kueue) kueue_simulator = std::make_unique<testing::KueueSimulator>(server, kueue_options);
    port = server.Start(port);
    server.WriteKubeconfig(kubeconfig);
    if (kubelet.mode != "none") simulator.Start();
    if (kueue_simulator) kueue_simulator->Start();
    if (!port_file.empty()) {
      std::ofstream(port_file + ".tmp") << port << "\n";
      std::rename((port_file + ".tmp").c_str(), port_file.c_str());
    }
    spdlog::info("serving on {} with {} nodes, kubelet {}", server.Url(), snapshot.nodes.size(), kubelet.mode);
    int sig = 0;
    sigwait(&signals, &sig);
    spdlog::info("signal {}: stopping", sig);
    if (kueue_simulator) kueue_simulator->Stop();
    simulator.Stop();
    server.Stop();
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 1;
  }
  return 0;
}
