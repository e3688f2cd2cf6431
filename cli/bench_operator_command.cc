// `meshtrain bench operator`: the operator against the test API server with a large
// synthetic cluster. Jobs are created one after another at a steady rate; for each, the
// time from its create request to the moment all its pods exist (seen through a watch).

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <mutex>
#include <thread>

#include <cpprest/http_client.h>

#include "api/environment.h"
#include "api/manifest.h"
#include "cli/commands.h"
#include "operator/kube/client.h"
#include "operator/kube/informer.h"

namespace meshtrain::cli {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

extern "C" char** environ;

pid_t Spawn(const std::vector<std::string>& argv, const std::string& log) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("cannot start " + argv[0] + ": " + std::strerror(rc));
  return pid;
}

void Stop(pid_t pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGTERM);
  for (int i = 0; i < 100; ++i) {
    if (::waitpid(pid, nullptr, WNOHANG) == pid) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

// VmHWM (peak resident memory) of a process, in bytes.
int64_t PeakRss(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

fs::path SiblingBinary(const std::string& given, const std::string& relative) {
  if (!given.empty()) return given;
  return api::ThisProgram().parent_path().parent_path() / relative;
}

json TestStats(const std::string& server) {
  web::http::client::http_client http(server);
  return json::parse(http.request(web::http::methods::GET, "/_test/stats").get().extract_utf8string(true).get());
}

int64_t OperatorRequests(const json& stats, const std::string& verb_filter = "") {
  int64_t n = 0;
  for (const auto& [key, count] : stats["requests"].items()) {
    if (key.rfind("meshtrain-operator ", 0) != 0) continue;
    if (!verb_filter.empty() && key.find(verb_filter) == std::string::npos) continue;
    n += count.get<int64_t>();
  }
  return n;
}

}  // namespace

int BenchOperatorCommand(const BenchOperatorOptions& options, std::ostream& out) {
  const fs::path server_bin = SiblingBinary(options.apiserver, "tests/support/kube/meshtrain-test-apiserver");
  const fs::path operator_bin = SiblingBinary(options.operator_binary, "operator/meshtrain-operator");
  for (const auto& bin : {server_bin, operator_bin}) {
    if (!fs::exists(bin)) {
      std::cerr << "meshtrain bench operator: " << bin.string() << " not found (build it, or pass --apiserver/--operator)\n";
      return kExitUnreadable;
    }
  }
  const fs::path dir = fs::temp_directory_path() / ("meshtrain-bench-operator-" + std::to_string(getpid()));
  fs::create_directories(dir);
  pid_t server_pid = -1, operator_pid = -1;
  int status = kExitOk;
  try {
    server_pid = Spawn({server_bin.string(), "--kubeconfig-out", (dir / "kubeconfig").string(), "--port-file",
                        (dir / "port").string(), "--synthetic-nodes", std::to_string(options.nodes), "--kubelet", "none"},
                       (dir / "apiserver.log").string());
    for (int i = 0; i < 200 && !fs::exists(dir / "port"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (!fs::exists(dir / "port")) throw std::runtime_error("the test API server did not start; see " + (dir / "apiserver.log").string());
    kube::KubeConfig config = kube::ParseKubeconfig(
        [&] { std::ifstream in(dir / "kubeconfig"); return std::string(std::istreambuf_iterator<char>(in), {}); }(),
        (dir / "kubeconfig").string());
    kube::ClientOptions client_options;
    client_options.qps = 0;
    client_options.user_agent = "meshtrain-bench";
    kube::Client client(config, client_options);
    const kube::ResourceType crds{"apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", false};
    client.Create(crds, "", api::ReadManifestFile(options.crd).at(0).object);

    operator_pid = Spawn({operator_bin.string(), "--kubeconfig", (dir / "kubeconfig").string(), "--metrics-port", "0",
                          "--health-port", "0", "--workers", std::to_string(options.workers), "--qps",
                          std::to_string(options.qps), "--burst", std::to_string(options.burst), "--log-level", std::getenv("MESHTRAIN_BENCH_KEEP") ? "info" : "warn"},
                         (dir / "operator.log").string());

    std::mutex mu;
    std::map<std::string, int> pods_seen;
    std::map<std::string, Clock::time_point> created, complete;
    kube::Informer pods(client, kube::resources::Pods(), "default", {"meshtrain.dev/job-name", "", ""});
    pods.AddHandler({[&](const json& pod) {
                       const std::string job = pod["metadata"]["labels"].value("meshtrain.dev/job-name", "");
                       std::lock_guard lock(mu);
                       if (++pods_seen[job] == options.job_nodes) complete[job] = Clock::now();
                     },
                     nullptr, nullptr});
    pods.Start();
    pods.WaitForSync(std::chrono::seconds(10));
    // The operator is ready once its three informers watch.
    for (int i = 0; i < 200 && OperatorRequests(TestStats(config.server), " watch") < 3; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const json before = TestStats(config.server);

    for (int j = 0; j < options.jobs; ++j) {
      const std::string name = "bench-" + std::to_string(j);
      json job = {{"apiVersion", "meshtrain.dev/v1alpha1"},
                  {"kind", "TrainingJob"},
                  {"metadata", {{"name", name}, {"namespace", "default"}}},
                  {"spec",
                   {{"image", "meshtrain:bench"},
                    {"nodes", options.job_nodes},
                    {"gpusPerNode", options.gpus_per_node},
                    {"model", {{"preset", "gpt2-124m"}}},
                    {"data", {{"train", "/data/train.bin"}}},
                    {"training", {{"globalBatchTokens", 1024 * options.job_nodes * options.gpus_per_node * 8}}}}}};
      const auto start = Clock::now();
      {
        std::lock_guard lock(mu);
        created[name] = start;
      }
      client.Create(kube::resources::TrainingJobs(), "default", job);
      std::this_thread::sleep_until(start + std::chrono::milliseconds(options.interval_ms));
    }
    const auto deadline = Clock::now() + std::chrono::seconds(options.timeout_seconds);
    while (Clock::now() < deadline) {
      {
        std::lock_guard lock(mu);
        if (static_cast<int>(complete.size()) == options.jobs) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const json after = TestStats(config.server);
    int64_t restarts = 0;  // every gang here is healthy: any restart is the operator's mistake
    for (const auto& job : client.List(kube::resources::TrainingJobs(), "default")["items"])
      restarts += job.value("status", json::object()).value("restarts", int64_t{0});
    const int64_t peak = PeakRss(operator_pid);
    pods.Stop();

    std::vector<double> ms;
    {
      std::lock_guard lock(mu);
      for (const auto& [name, done] : complete) ms.push_back(std::chrono::duration<double, std::milli>(done - created[name]).count());
    }
    std::sort(ms.begin(), ms.end());
    auto pct = [&](double p) { return ms.empty() ? 0.0 : ms[std::min(ms.size() - 1, static_cast<size_t>(p * ms.size()))]; };
    const int64_t requests = OperatorRequests(after) - OperatorRequests(before);
    out << std::fixed << std::setprecision(1);
    out << "meshtrain bench operator: " << options.nodes << " nodes, " << options.jobs << " jobs of "
        << options.job_nodes << " nodes x " << options.gpus_per_node << " GPUs, one job every " << options.interval_ms
        << " ms; operator --workers " << options.workers << " --qps " << options.qps << " --burst " << options.burst << "\n";
    out << "  jobs with all pods created: " << ms.size() << " of " << options.jobs << "\n";
    out << "  job creation -> all pods created: median " << pct(0.5) << " ms, p90 " << pct(0.9) << " ms, max "
        << (ms.empty() ? 0.0 : ms.back()) << " ms  (target: median <= 200 ms)\n";
    out << "  API requests by the operator: " << requests << " (" << std::setprecision(2)
        << static_cast<double>(requests) / options.jobs << " per job, counted while the jobs were created)\n";
    out << "  gang restarts (all gangs are healthy, so this must be 0): " << restarts << "\n";
    out << "  operator peak memory (VmHWM): " << std::setprecision(1) << peak / (1024.0 * 1024.0) << " MiB\n";
    if (static_cast<int>(ms.size()) != options.jobs || restarts != 0) status = kExitInvalid;
  } catch (const std::exception& e) {
    std::cerr << "meshtrain bench operator: " << e.what() << "\n";
    status = kExitInvalid;
  }
  Stop(operator_pid);
  Stop(server_pid);
  if (status == kExitOk && !std::getenv("MESHTRAIN_BENCH_KEEP")) fs::remove_all(dir);
  else std::cerr << "logs kept in " << dir.string() << "\n";
  return status;
}

}  // namespace meshtrain::cli
