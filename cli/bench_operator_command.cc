// `meshtrain bench operator`: the operator against the test API server with a large
// synthetic cluster. Jobs are created one after another at a steady rate; for each, the
// time from its create to the create of its last pod, both as the server saw them.
//
// With --hanging-metrics N, the first half's jobs are deleted and a second half of as
// many jobs follows on the same free cluster, created while N more jobs run whose rank-0
// metrics endpoints accept connections and never answer: the ratio of the halves'
// latencies shows whether reading progress slows other jobs' reconciles.
//
// With --kueue, the jobs go through Kueue's admission: the server runs its Kueue
// admission simulator (tests/support/kube/kueue_simulator.h; not Kueue) with a quota of
// every node and TAS assignments, the operator runs with --kueue, and every job is in a
// queue. Each job's round trip, from the server's own timestamps, is then also reported in
// legs: job create -> Workload create (by the operator) -> admission (the simulator's
// Admitted=True) -> last pod create.
//
// It also reads the operator's own /metrics at the end: the CPU time of one reconcile on
// its worker's thread (median and p99 over the run), and prints the reason each restarted
// gang gives in its Restarting condition.
//
// It speaks to the test API server over plain HTTP (the CLI uses no operator/kube).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
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
#include <set>
#include <sstream>
#include <thread>

#include <cpprest/http_client.h>

#include "api/environment.h"
#include "api/manifest.h"
#include "cli/commands.h"
#include "api/worker_contract.h"

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

// A TCP port that was free on this machine a moment ago.
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof address;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) != 0) {
    ::close(fd);
    throw std::runtime_error(std::string("no free port: ") + std::strerror(errno));
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

// The value of one sample of a Prometheus text exposition, e.g.
// `meshtrain_operator_reconcile_cpu_seconds{quantile="0.5"}`; nullopt when absent.
std::optional<double> Sample(const std::string& exposition, const std::string& series) {
  std::istringstream lines(exposition);
  for (std::string line; std::getline(lines, line);) {
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 && line[series.size()] == ' ')
      return std::stod(line.substr(series.size() + 1));
  }
  return std::nullopt;
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

// The test API server, over plain HTTP.
class TestServer {
 public:
  explicit TestServer(const std::string& url) : http_(url) {}

  json Request(const web::http::method& method, const std::string& path, const json& body = nullptr) {
    web::http::http_request request(method);
    request.set_request_uri(path);
    request.headers().add("User-Agent", "meshtrain-bench");
    if (!body.is_null()) request.set_body(body.dump(), "application/json");
    web::http::http_response response = http_.request(request).get();
    const std::string text = response.extract_utf8string(true).get();
    if (response.status_code() >= 300)
      throw std::runtime_error(method + " " + path + ": HTTP " + std::to_string(response.status_code()) + ": " + text);
    return json::parse(text);
  }
  json Stats() { return Request(web::http::methods::GET, "/_test/stats"); }
  json Jobs() { return Request(web::http::methods::GET, "/apis/meshtrain.dev/v1alpha1/namespaces/default/trainingjobs"); }

  // API requests the operator made, of one verb ("" for all).
  int64_t OperatorRequests(const std::string& verb = "") {
    int64_t n = 0;
    const json stats = Stats();
    for (const auto& [key, count] : stats["requests"].items()) {
      if (key.rfind("meshtrain-operator ", 0) != 0) continue;
      if (!verb.empty() && key != "meshtrain-operator " + verb) continue;
      n += count.get<int64_t>();
    }
    return n;
  }

  // For each job key: when the server created it, its first Workload and the job's last
  // pod, and when the Kueue simulator first admitted the Workload.
  struct Created {
    double job_ms = -1, workload_ms = -1, admission_ms = -1, last_pod_ms = -1;
    int pods = 0;
  };
  std::map<std::string, Created> CreationTimes() {
    std::map<std::string, Created> out;
    const json created = Request(web::http::methods::GET, "/_test/created");
    for (const auto& c : created) {
      Created& job = out[c["job"].get<std::string>()];
      const std::string kind = c["kind"];
      const double ms = c["ms"];
      const auto first = [ms](double& at) { at = at < 0 ? ms : std::min(at, ms); };
      if (kind == "TrainingJob") {
        job.job_ms = ms;
      } else if (kind == "Workload") {
        first(job.workload_ms);
      } else if (kind == "Admission") {
        first(job.admission_ms);
      } else if (kind == "Pod") {
        job.pods++;
        job.last_pod_ms = std::max(job.last_pod_ms, ms);
      }
    }
    return out;
  }

 private:
  web::http::client::http_client http_;
};

constexpr const char* kQueueLabel = "kueue.x-k8s.io/queue-name";
constexpr const char* kQueue = "training";

json BenchJob(const std::string& name, const BenchOperatorOptions& options) {
  json metadata = {{"name", name}, {"namespace", "default"}};
  if (options.kueue) metadata["labels"] = {{kQueueLabel, kQueue}};
  return {{"apiVersion", "meshtrain.dev/v1alpha1"},
          {"kind", "TrainingJob"},
          {"metadata", metadata},
          {"spec",
           {{"image", "meshtrain:bench"},
            {"nodes", options.job_nodes},
            {"gpusPerNode", options.gpus_per_node},
            {"model", {{"preset", "gpt2-124m"}}},
            {"data", {{"train", "/data/train.bin"}}},
            {"training", {{"globalBatchTokens", 1024 * options.job_nodes * options.gpus_per_node * 8}}}}}};
}

// A metrics endpoint that never answers: a socket on a loopback address and the metrics
// port that listens and never accepts, so connections complete and requests go unread.
class HangingEndpoint {
 public:
  HangingEndpoint() {
    for (int last = 1; last < 64 && fd_ < 0; ++last) {
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in address{};
      address.sin_family = AF_INET;
      address.sin_port = htons(api::worker::kMetricsPort);
      address.sin_addr.s_addr = htonl((127u << 24) | (254u << 16) | static_cast<uint32_t>(last));
      if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 && ::listen(fd, 1024) == 0) {
        fd_ = fd;
        ip_ = "127.254.0." + std::to_string(last);
      } else {
        ::close(fd);
      }
    }
    if (fd_ < 0) throw std::runtime_error("no free 127.254.0.x:" + std::to_string(api::worker::kMetricsPort) + " to listen on");
  }
  ~HangingEndpoint() { ::close(fd_); }
  const std::string& ip() const { return ip_; }

 private:
  int fd_ = -1;
  std::string ip_;
};

struct Half {
  std::vector<double> ms;  // job create -> last pod created, of each complete job
  int64_t requests = 0;    // by the operator, while the half's jobs were created
  // With --kueue, of each complete job with a Workload and an admission: job create ->
  // Workload create, Workload create -> admission, admission -> last pod create.
  std::vector<double> to_workload, to_admission, to_pods;
};

double PercentileOfSorted(const std::vector<double>& sorted, double p) {
  return sorted.empty() ? 0.0 : sorted[std::min(sorted.size() - 1, static_cast<size_t>(p * sorted.size()))];
}

// Creates `names` at the steady rate and waits until each has all its pods (or the timeout).
Half CreateAndMeasure(TestServer& server, const std::vector<std::string>& names, const BenchOperatorOptions& options) {
  const int64_t before = server.OperatorRequests();
  for (const auto& name : names) {
    const auto start = Clock::now();
    server.Request(web::http::methods::POST, "/apis/meshtrain.dev/v1alpha1/namespaces/default/trainingjobs",
                   BenchJob(name, options));
    std::this_thread::sleep_until(start + std::chrono::milliseconds(options.interval_ms));
  }
  Half half;
  const auto deadline = Clock::now() + std::chrono::seconds(options.timeout_seconds);
  for (;;) {
    const auto created = server.CreationTimes();
    half.ms.clear();
    half.to_workload.clear();
    half.to_admission.clear();
    half.to_pods.clear();
    for (const auto& name : names) {
      auto it = created.find("default/" + name);
      if (it == created.end() || it->second.pods != options.job_nodes) continue;
      const TestServer::Created& c = it->second;
      half.ms.push_back(c.last_pod_ms - c.job_ms);
      if (options.kueue && c.workload_ms >= 0 && c.admission_ms >= 0) {
        half.to_workload.push_back(c.workload_ms - c.job_ms);
        half.to_admission.push_back(c.admission_ms - c.workload_ms);
        half.to_pods.push_back(c.last_pod_ms - c.admission_ms);
      }
    }
    if (half.ms.size() == names.size() || Clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  half.requests = server.OperatorRequests() - before;
  for (auto* leg : {&half.ms, &half.to_workload, &half.to_admission, &half.to_pods}) std::sort(leg->begin(), leg->end());
  return half;
}

// Deletes the jobs (their pods go with them) and waits until no pod of theirs is left, so
// that the next half places its gangs on the same free cluster.
void DeleteJobs(TestServer& server, const std::vector<std::string>& names, const BenchOperatorOptions& options) {
  for (const auto& name : names)
    server.Request(web::http::methods::DEL, "/apis/meshtrain.dev/v1alpha1/namespaces/default/trainingjobs/" + name);
  const std::set<std::string> doomed(names.begin(), names.end());
  const auto deadline = Clock::now() + std::chrono::seconds(options.timeout_seconds);
  for (;;) {
    int left = 0;
    const json pods = server.Request(web::http::methods::GET, "/api/v1/namespaces/default/pods");
    for (const auto& pod : pods["items"])
      left += doomed.count(pod["metadata"]["labels"].value("meshtrain.dev/job-name", "")) ? 1 : 0;
    if (left == 0) return;
    if (Clock::now() > deadline) throw std::runtime_error(std::to_string(left) + " pods outlived their deleted jobs");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Starts `count` jobs whose pods report Running and Ready at the hanging endpoint's address
// (the kubelet of this bench runs nothing), and waits until the operator has them Running.
// Their pods take one GPU each, so that the second half's jobs fit the cluster beside them.
void StartHangingJobs(TestServer& server, int count, const std::string& ip, const BenchOperatorOptions& options) {
  std::vector<std::string> names;
  for (int j = 0; j < count; ++j) names.push_back("hanging-" + std::to_string(j));
  BenchOperatorOptions small = options;
  small.gpus_per_node = 1;
  CreateAndMeasure(server, names, small);
  const auto pods = server.Request(web::http::methods::GET, "/api/v1/namespaces/default/pods")["items"];
  for (json pod : pods) {
    if (pod["metadata"]["name"].get<std::string>().rfind("hanging-", 0) != 0) continue;
    pod["status"] = {{"phase", "Running"},
                     {"podIP", ip},
                     {"conditions", json::array({{{"type", "Ready"}, {"status", "True"}}})}};
    server.Request(web::http::methods::PUT,
                   "/api/v1/namespaces/default/pods/" + pod["metadata"]["name"].get<std::string>() + "/status", pod);
  }
  const auto deadline = Clock::now() + std::chrono::seconds(options.timeout_seconds);
  for (;;) {
    int running = 0;
    const json jobs = server.Jobs();
    for (const auto& job : jobs["items"]) {
      if (job["metadata"]["name"].get<std::string>().rfind("hanging-", 0) == 0 &&
          job.value("status", json::object()).value("phase", "") == "Running")
        ++running;
    }
    if (running == count) return;
    if (Clock::now() > deadline) throw std::runtime_error("the jobs with hanging endpoints never ran");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void PrintHalf(std::ostream& out, const char* label, const Half& half, int jobs) {
  out << std::fixed << std::setprecision(1);
  out << "  " << label << ": " << half.ms.size() << " of " << jobs << " jobs with all pods created; job creation -> "
      << "all pods created: median " << PercentileOfSorted(half.ms, 0.5) << " ms, p90 "
      << PercentileOfSorted(half.ms, 0.9) << " ms, max " << (half.ms.empty() ? 0.0 : half.ms.back()) << " ms; " << std::setprecision(2)
      << static_cast<double>(half.requests) / jobs << " API requests per job\n";
}

// The legs of the Kueue round trip, each job's from the server's own timestamps.
void PrintKueueLegs(std::ostream& out, const Half& half, int jobs) {
  const auto leg = [&out](const char* label, const std::vector<double>& ms) {
    out << std::fixed << std::setprecision(1) << "    " << label << ": median " << PercentileOfSorted(ms, 0.5)
        << " ms, p90 " << PercentileOfSorted(ms, 0.9) << " ms\n";
  };
  out << "  Kueue round trip, " << half.to_workload.size() << " of " << jobs << " jobs:\n";
  leg("job created -> Workload created", half.to_workload);
  leg("Workload created -> admitted", half.to_admission);
  leg("admitted -> all pods created", half.to_pods);
  leg("round trip, job created -> all pods created", half.ms);
}

// Kueue's CRDs from `dir`, and the ResourceFlavor the simulator admits with (no node
// labels: with TAS the assignment alone says where the pods go).
void CreateKueueObjects(TestServer& server, const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".yaml") files.push_back(entry.path());
  if (files.empty()) throw std::runtime_error("no Kueue CRDs (*.yaml) in " + dir.string());
  std::sort(files.begin(), files.end());
  for (const auto& file : files)
    for (const auto& document : api::ReadManifestFile(file.string()))
      server.Request(web::http::methods::POST, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                     document.object);
  server.Request(web::http::methods::POST, "/apis/kueue.x-k8s.io/v1beta2/resourceflavors",
                 {{"apiVersion", "kueue.x-k8s.io/v1beta2"},
                  {"kind", "ResourceFlavor"},
                  {"metadata", {{"name", "default-flavor"}}},
                  {"spec", json::object()}});
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
    std::vector<std::string> server_argv = {server_bin.string(), "--kubeconfig-out", (dir / "kubeconfig").string(),
                                            "--port-file", (dir / "port").string(), "--synthetic-nodes",
                                            std::to_string(options.nodes), "--kubelet", "none"};
    if (options.kueue) {
      // Quota for every node (a pod a node), so that every job is admitted at once.
      server_argv.insert(server_argv.end(),
                         {"--kueue", "--kueue-quota-nodes", std::to_string(options.nodes), "--kueue-tas", "true"});
    }
    server_pid = Spawn(server_argv, (dir / "apiserver.log").string());
    for (int i = 0; i < 200 && !fs::exists(dir / "port"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (!fs::exists(dir / "port")) throw std::runtime_error("the test API server did not start; see " + (dir / "apiserver.log").string());
    std::string port;
    std::ifstream(dir / "port") >> port;
    TestServer server("http://127.0.0.1:" + port);
    server.Request(web::http::methods::POST, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                   api::ReadManifestFile(options.crd).at(0).object);
    if (options.kueue) CreateKueueObjects(server, options.kueue_crds);

    const int metrics_port = FreePort();
    std::vector<std::string> operator_argv = {
        operator_bin.string(), "--kubeconfig", (dir / "kubeconfig").string(), "--metrics-port",
        std::to_string(metrics_port), "--health-port", "0", "--workers", std::to_string(options.workers), "--qps",
        std::to_string(options.qps), "--burst", std::to_string(options.burst), "--progress-interval", "1",
        "--log-level", std::getenv("MESHTRAIN_BENCH_KEEP") ? "info" : "warn"};
    if (options.kueue) operator_argv.push_back("--kueue");
    operator_pid = Spawn(operator_argv, (dir / "operator.log").string());
    // The operator is ready once its informers watch: jobs, pods, nodes, and with --kueue Workloads.
    const int informers = options.kueue ? 4 : 3;
    for (int i = 0; i < 200 && server.OperatorRequests("watch") < informers; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));

    std::vector<std::string> first, second;
    for (int j = 0; j < options.jobs; ++j) {
      first.push_back("bench-" + std::to_string(j));
      second.push_back("bench-" + std::to_string(options.jobs + j));
    }
    const Half baseline = CreateAndMeasure(server, first, options);
    std::optional<Half> hanging;
    std::unique_ptr<HangingEndpoint> endpoint;
    if (options.hanging_metrics > 0) {
      DeleteJobs(server, first, options);
      endpoint = std::make_unique<HangingEndpoint>();
      StartHangingJobs(server, options.hanging_metrics, endpoint->ip(), options);
      // Let every hanging job's first reads start, and some time out.
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      hanging = CreateAndMeasure(server, second, options);
    }
    int64_t restarts = 0;  // every gang here is healthy: any restart is the operator's mistake
    std::vector<std::string> reasons;  // of each restarted gang, from its Restarting condition
    const json jobs = server.Jobs();
    for (const auto& job : jobs["items"]) {
      const json job_status = job.value("status", json::object());
      const int64_t n = job_status.value("restarts", int64_t{0});
      if (n == 0) continue;
      restarts += n;
      std::string why = "(no Restarting condition)";
      for (const auto& c : job_status.value("conditions", json::array()))
        if (c.value("type", "") == "Restarting") why = c.value("reason", "") + ": " + c.value("message", "");
      reasons.push_back(job["metadata"].value("name", "") + " (" + std::to_string(n) + "): " + why);
    }
    const int64_t peak = PeakRss(operator_pid);
    std::string exposition;
    try {
      web::http::client::http_client metrics("http://127.0.0.1:" + std::to_string(metrics_port));
      exposition = metrics.request(web::http::methods::GET, "/metrics").get().extract_utf8string(true).get();
    } catch (const std::exception& e) {
      std::cerr << "meshtrain bench operator: reading the operator's /metrics: " << e.what() << "\n";
    }
    const std::string cpu = "meshtrain_operator_reconcile_cpu_seconds";

    out << "meshtrain bench operator: " << options.nodes << " nodes, " << options.jobs << " jobs of "
        << options.job_nodes << " nodes x " << options.gpus_per_node << " GPUs, one job every " << options.interval_ms
        << " ms; operator --workers " << options.workers << " --qps " << options.qps << " --burst " << options.burst
        << " --progress-interval 1" << (options.kueue ? " --kueue" : "") << "\n";
    if (options.kueue) {
      out << "  Kueue path: the test server's Kueue admission simulator (not Kueue), ClusterQueue quota "
          << options.nodes << " nodes, TAS on (pod r on the r-th node of the topologyAssignment); every job in queue "
          << kQueue << "\n";
    }
    PrintHalf(out, "jobs", baseline, options.jobs);
    out << "  (target: median <= 200 ms)\n";
    if (options.kueue) PrintKueueLegs(out, baseline, options.jobs);
    if (hanging) {
      PrintHalf(out, ("then, with " + std::to_string(options.hanging_metrics) + " jobs' metrics endpoints hanging").c_str(),
                *hanging, options.jobs);
      const double ratio = PercentileOfSorted(hanging->ms, 0.5) / std::max(PercentileOfSorted(baseline.ms, 0.5), 1e-3);
      out << std::setprecision(2) << "  hanging / baseline median: " << ratio << "\n";
    }
    out << "  gang restarts (all gangs are healthy, so this must be 0): " << restarts << "\n";
    for (const std::string& reason : reasons) out << "    restarted " << reason << "\n";
    out << "  operator peak memory (VmHWM): " << std::setprecision(1) << peak / (1024.0 * 1024.0) << " MiB\n";
    const auto cpu_median = Sample(exposition, cpu + "{quantile=\"0.5\"}");
    const auto cpu_p99 = Sample(exposition, cpu + "{quantile=\"0.99\"}");
    const auto reconciles = Sample(exposition, cpu + "_count");
    if (cpu_median && cpu_p99 && reconciles) {
      out << std::setprecision(3) << "  CPU time per reconcile: median " << *cpu_median * 1e3 << " ms, p99 "
          << *cpu_p99 * 1e3 << " ms, over " << std::setprecision(0) << *reconciles << " reconciles\n";
    } else {
      out << "  CPU time per reconcile: not in the operator's /metrics\n";
      status = kExitInvalid;
    }
    for (const char* counter : {"meshtrain_operator_placement_conflicts_total",
                                "meshtrain_operator_absence_checks_total{result=\"gone\"}",
                                "meshtrain_operator_absence_checks_total{result=\"cache_lagging\"}"}) {
      if (const auto n = Sample(exposition, counter)) out << "  " << counter << " " << std::setprecision(0) << *n << "\n";
    }
    const bool complete = static_cast<int>(baseline.ms.size()) == options.jobs &&
                          (!options.kueue || static_cast<int>(baseline.to_workload.size()) == options.jobs) &&
                          (!hanging || static_cast<int>(hanging->ms.size()) == options.jobs);
    if (!complete || restarts != 0) status = kExitInvalid;
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
