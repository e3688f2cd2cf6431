#include "tests/support/kube/kubelet_simulator.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <regex>

#include <spdlog/spdlog.h>

#include "operator/kube/base64.h"
#include "operator/kube/objects.h"
#include "operator/kube/time.h"

namespace meshtrain::testing {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

json ReadBody(const HttpRequest& request) {
  json body = json::parse(request.body, nullptr, false);
  return body.is_object() ? body : json::object();
}

}  // namespace

json NodeObject(const scheduler::ClusterNode& node) {
  json labels = json::object();
  for (const auto& [k, v] : node.labels) labels[k] = v;
  labels["kubernetes.io/hostname"] = node.name;
  json resources = {{"nvidia.com/gpu", std::to_string(node.gpus)}, {"vpc.amazonaws.com/efa", std::to_string(node.efa)},
                    {"cpu", "96"}, {"memory", "1048576Mi"}, {"pods", "110"}};
  json taints = json::array();
  for (const auto& t : node.taints) taints.push_back({{"key", t.key}, {"value", t.value}, {"effect", t.effect}});
  json spec = {{"unschedulable", !node.schedulable}};
  if (!taints.empty()) spec["taints"] = taints;
  json conditions = json::array({{{"type", "Ready"}, {"status", node.ready ? "True" : "False"},
                                   {"reason", "KubeletReady"}, {"lastTransitionTime", kube::Rfc3339Now()}}});
  json addresses = json::array({{{"type", "InternalIP"}, {"address", "127.0.0.1"}},
                                {{"type", "Hostname"}, {"address", node.name}}});
  json status = {{"capacity", resources}, {"allocatable", resources}, {"conditions", conditions},
                 {"addresses", addresses}};
  return {{"apiVersion", "v1"},
          {"kind", "Node"},
          {"metadata", {{"name", node.name}, {"labels", labels}}},
          {"spec", spec},
          {"status", status}};
}

KubeletSimulator::KubeletSimulator(ApiServer& server, KubeletOptions options)
    : server_(server), options_(std::move(options)) {
  server_.AddTestRoute("/_test/kubelet/", [this](const HttpRequest& request, HttpResponder& responder) {
    const json body = ReadBody(request);
    bool ok = true;
    json reply = json::object();
    if (request.path == "/_test/kubelet/script") {
      SetScript(body.value("job", ""), body.value("exitCode", 0), body.value("seconds", 1.0));
    } else if (request.path == "/_test/kubelet/kill") {
      ok = KillPod(body.value("namespace", "default"), body.value("name", ""), body.value("signal", SIGKILL));
    } else if (request.path == "/_test/kubelet/node") {
      ok = SetNodeReady(body.value("name", ""), body.value("ready", true));
    } else if (request.path == "/_test/kubelet/pods") {
      std::lock_guard lock(mu_);
      reply = json::array();
      for (const auto& [key, p] : running_) reply.push_back({{"pod", key}, {"pid", p.pid}, {"node", p.node}});
    } else {
      ok = false;
    }
    responder.Send(ok ? 200 : 404, "application/json", reply.dump());
  });
}

KubeletSimulator::~KubeletSimulator() {
  Stop();
  if (address_lock_fd_ >= 0) ::close(address_lock_fd_);
}

void KubeletSimulator::AddNodes(const scheduler::ClusterSnapshot& snapshot) {
  for (const auto& node : snapshot.nodes) server_.Create("/nodes", "", NodeObject(node));
}

void KubeletSimulator::Start() {
  // A pod's workers are the children of its launcher: when the launcher dies first, they
  // become this process's children, so that Reap collects them and a pod's process group
  // ends when its last process has.
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) throw std::runtime_error("prctl(PR_SET_CHILD_SUBREAPER) failed");
  thread_ = std::jthread([this](std::stop_token stop) { Loop(stop); });
}

void KubeletSimulator::Stop() {
  if (thread_.joinable()) {
    thread_.request_stop();
    thread_.join();
  }
  std::lock_guard lock(mu_);
  for (auto& [key, p] : running_) ::kill(-p.pid, SIGKILL);
  for (auto& [group, address] : ending_groups_) ::kill(-group, SIGKILL);
  for (auto& [key, p] : running_) ::waitpid(p.pid, nullptr, 0);
  for (auto& [group, address] : ending_groups_) ::waitpid(group, nullptr, 0);
  running_.clear();
  ending_groups_.clear();
}

void KubeletSimulator::SetScript(const std::string& job, int exit_code, double seconds) {
  std::lock_guard lock(mu_);
  scripts_[job] = {exit_code, seconds};
}

bool KubeletSimulator::KillPod(const std::string& ns, const std::string& name, int signal) {
  std::lock_guard lock(mu_);
  auto it = running_.find(ns + "/" + name);
  if (it == running_.end()) return false;
  return ::kill(-it->second.pid, signal) == 0;
}

bool KubeletSimulator::SetNodeReady(const std::string& name, bool ready) {
  return server_.Mutate("/nodes", "", name, [&](json& node) {
    for (auto& c : node["status"]["conditions"]) {
      if (c.value("type", "") != "Ready") continue;
      c["status"] = ready ? "True" : "False";
      c["reason"] = ready ? "KubeletReady" : "NodeStatusUnknown";
      c["lastTransitionTime"] = kube::Rfc3339Now();
    }
  });
}

int KubeletSimulator::AddressBlock() {
  // Simulators running at once (parallel tests) must not hand out the same addresses, or
  // their pods would meet on each other's ports: each holds an flock on its block's file.
  for (int block = 1; address_block_ == 0 && block < 255; ++block) {
    const std::string path = "/tmp/meshtrain-kubelet-addresses-127." + std::to_string(block) + ".lock";
    const int fd = ::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0666);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
      address_lock_fd_ = fd;
      address_block_ = block;
    } else {
      ::close(fd);
    }
  }
  if (address_block_ == 0) throw std::runtime_error("the kubelet simulator found no free block of 127.N.0.0/16");
  return address_block_;
}

std::string KubeletSimulator::AddressOf(const std::string& ns, const std::string& hostname,
                                        const std::string& subdomain) {
  const std::string name = hostname + "." + subdomain + "." + ns;
  auto it = addresses_.find(name);
  if (it != addresses_.end()) return it->second;
  const size_t n = addresses_.size();
  if (n >= 250 * 250) throw std::runtime_error("the kubelet simulator ran out of loopback addresses");
  const std::string address = "127." + std::to_string(AddressBlock()) + "." + std::to_string(1 + n / 250) + "." +
                              std::to_string(1 + n % 250);
  return addresses_[name] = address;
}

std::string KubeletSimulator::AddressOf(const json& pod) {
  const std::string name = pod["metadata"].value("name", "");
  return AddressOf(pod["metadata"].value("namespace", ""), pod["spec"].value("hostname", name),
                   pod["spec"].value("subdomain", ""));
}

std::string KubeletSimulator::ResolveNames(const std::string& ns, const std::string& value) {
  static const std::regex dns_label_pair(R"(([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.)");
  std::string out;
  auto begin = value.cbegin();
  std::smatch m;
  while (std::regex_search(begin, value.cend(), m, dns_label_pair)) {
    const std::string rest(m[0].second, value.cend());
    std::string suffix = ns + ".svc.cluster.local";
    if (rest.rfind(suffix, 0) != 0) suffix = ns + ".svc";
    auto ends_name = [&](size_t at) {
      return at == rest.size() || !(std::isalnum(static_cast<unsigned char>(rest[at])) || rest[at] == '.' || rest[at] == '-');
    };
    const bool whole_name = rest.rfind(suffix, 0) == 0 && ends_name(suffix.size());
    if (!whole_name) {
      out.append(begin, m[0].second);
      begin = m[0].second;
      continue;
    }
    out.append(begin, m[0].first);
    out += AddressOf(ns, m[1].str(), m[3].str());
    begin = m[0].second + long(suffix.size());
  }
  out.append(begin, value.cend());
  return out;
}

pid_t KubeletSimulator::Launch(const json& pod) {
  const json& container = pod["spec"]["containers"][0];
  const std::string ns = pod["metadata"].value("namespace", ""), name = pod["metadata"].value("name", "");
  const fs::path dir = fs::path(options_.workdir) / (ns + "_" + name);
  fs::create_directories(dir);

  // ConfigMap and Secret volumes become files under the pod's directory; a Secret volume
  // with items holds only those keys, each at its path. A Secret, or an item's key, that
  // does not exist fails the pod (a kubelet would retry the mount; the operator creates
  // the Secret before its pods, so here that is a bug to see).
  std::map<std::string, std::string> mounts;  // container path -> local path
  for (const auto& mount : container.value("volumeMounts", json::array())) {
    for (const auto& volume : pod["spec"].value("volumes", json::array())) {
      if (volume.value("name", "") != mount.value("name", "")) continue;
      const fs::path local = dir / fs::path(mount.value("mountPath", "/")).relative_path();
      fs::create_directories(local);
      mounts[mount.value("mountPath", "")] = local.string();
      if (volume.contains("configMap")) {
        auto cm = server_.Get("/configmaps", ns, volume["configMap"].value("name", ""));
        if (!cm) continue;
        const json data = cm->value("data", json::object());  // items() must not outlive it
        for (const auto& [key, value] : data.items())
          std::ofstream(local / key) << value.get<std::string>();
      } else if (volume.contains("secret")) {
        const std::string secret_name = volume["secret"].value("secretName", "");
        auto secret = server_.Get("/secrets", ns, secret_name);
        if (!secret) throw std::runtime_error("MountVolume.SetUp failed: secret \"" + secret_name + "\" not found");
        const json data = secret->value("data", json::object());
        std::map<std::string, std::string> files;  // key -> path in the volume
        for (const auto& [key, value] : data.items()) files[key] = key;
        if (volume["secret"].contains("items")) {
          files.clear();
          for (const auto& item : volume["secret"]["items"]) {
            const std::string key = item.value("key", "");
            if (!data.contains(key))
              throw std::runtime_error("MountVolume.SetUp failed: secret \"" + secret_name + "\" has no key \"" + key + "\"");
            files[key] = item.value("path", "");
          }
        }
        for (const auto& [key, path] : files) {
          const auto bytes = kube::DecodeBase64(data[key].get<std::string>());
          if (!bytes) throw std::runtime_error("secret \"" + secret_name + "\": data." + key + " is not base64");
          const fs::path file = local / path;
          std::ofstream(file, std::ios::binary) << *bytes;
          fs::permissions(file, fs::perms(volume["secret"].value("defaultMode", 0644)));
        }
      }
    }
  }

  std::vector<std::string> env = {"PATH=/usr/local/bin:/usr/bin:/bin", "HOSTNAME=" + pod["spec"].value("hostname", name)};
  for (const auto& e : container.value("env", json::array())) {
    std::string value = e.value("value", "");
    if (e.contains("valueFrom") && e["valueFrom"].contains("fieldRef")) {
      const std::string field = e["valueFrom"]["fieldRef"].value("fieldPath", "");
      if (field == "metadata.name") value = name;
      else if (field == "metadata.namespace") value = ns;
      else if (field == "spec.nodeName") value = kube::PinnedNode(pod);
      else if (field == "status.podIP") value = AddressOf(pod);
    }
    value = ResolveNames(ns, value);
    for (const auto& [path, local] : mounts)
      if (value.rfind(path, 0) == 0) value = local + value.substr(path.size());
    env.push_back(e.value("name", "") + "=" + value);
  }

  std::vector<std::string> argv;
  if (options_.mode == "run") {
    for (const auto& a : container.value("command", json::array())) argv.push_back(a);
    for (const auto& a : container.value("args", json::array())) argv.push_back(a);
    if (argv.empty()) throw std::runtime_error("pod " + ns + "/" + name + " has no command to run");
    if (auto it = options_.commands.find(argv[0]); it != options_.commands.end()) argv[0] = it->second;
  } else {
    int code = options_.script_exit_code;
    double seconds = options_.script_seconds;
    const std::string job = pod["metadata"].value("labels", json::object()).value("meshtrain.dev/job-name", "");
    if (auto it = scripts_.find(job); it != scripts_.end()) std::tie(code, seconds) = it->second;
    argv = {"/bin/sh", "-c", "sleep " + std::to_string(seconds) + "; exit " + std::to_string(code)};
  }
  std::vector<char*> cargv, cenv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  for (auto& e : env) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  const std::string log = (dir / "log").string(), cwd = dir.string();

  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::setpgid(0, 0);
    // A container starts with no signal blocked: the server's threads block SIGTERM and
    // SIGINT for its sigwait, and a pod must not inherit that (its launcher and ranks take
    // signals).
    sigset_t none;
    sigemptyset(&none);
    ::pthread_sigmask(SIG_SETMASK, &none, nullptr);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    if (::chdir(cwd.c_str()) != 0) ::_exit(126);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::execvpe(cargv[0], cargv.data(), cenv.data());
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  return pid;
}

void KubeletSimulator::TrySchedule(const std::string& key) {
  const std::string ns = key.substr(0, key.find('/')), name = key.substr(key.find('/') + 1);
  auto pod = server_.Get("/pods", ns, name);
  if (!pod || (*pod)["status"].value("phase", "") != "Pending") {
    waiting_.erase(key);
    return;
  }
  const std::string node_name = kube::PinnedNode(*pod);
  const std::string where = "pod " + key + " spec";
  const int64_t gpus = scheduler::PodRequest((*pod)["spec"], "nvidia.com/gpu", where);
  const int64_t efa = scheduler::PodRequest((*pod)["spec"], "vpc.amazonaws.com/efa", where);
  std::string why;
  auto node = node_name.empty() ? std::nullopt : server_.Get("/nodes", "", node_name);
  if (!node) {
    why = node_name.empty() ? "the pod names no node" : "node " + node_name + " does not exist";
  } else {
    const bool ready = kube::ConditionTrue(*node, "Ready");
    int64_t used_gpus = 0, used_efa = 0;
    for (const auto& [k, p] : running_)
      if (p.node == node_name) used_gpus += p.gpus, used_efa += p.efa;
    const json& allocatable = (*node)["status"]["allocatable"];
    const std::string at = "node " + node_name + " status.allocatable";
    if (!ready) why = "node " + node_name + " is not Ready";
    else if (used_gpus + gpus > scheduler::ResourceQuantity(allocatable, "nvidia.com/gpu", at))
      why = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu";
    else if (used_efa + efa > scheduler::ResourceQuantity(allocatable, "vpc.amazonaws.com/efa", at))
      why = "0/1 nodes are available: 1 Insufficient vpc.amazonaws.com/efa";
  }
  if (!why.empty()) {
    if (!waiting_[key]) {
      waiting_[key] = true;
      server_.Mutate("/pods", ns, name, [&](json& p) {
        p["status"]["conditions"] = {{{"type", "PodScheduled"}, {"status", "False"}, {"reason", "Unschedulable"},
                                      {"message", why}, {"lastTransitionTime", kube::Rfc3339Now()}}};
      });
    }
    return;
  }
  // A pod that takes the DNS name of an ended one gets its address: it waits until the
  // old pod's processes have all exited, as a CNI never gives one address to two live
  // pods (a worker of the old pod may still hold its ports, e.g. busy in the kernel when
  // SIGKILL came).
  const std::string address = AddressOf(*pod);
  for (const auto& [group, old_address] : ending_groups_)
    if (old_address == address) return;
  waiting_.erase(key);
  pid_t pid;
  std::string error;
  try {
    pid = Launch(*pod);
  } catch (const std::exception& e) {
    error = e.what();
    pid = -1;
  }
  if (pid < 0) {
    server_.Mutate("/pods", ns, name, [&](json& p) {
      p["spec"]["nodeName"] = node_name;
      p["status"]["phase"] = "Failed";
      p["status"]["message"] = error;
    });
    return;
  }
  running_[key] = {pid, node_name, gpus, efa, address};
  const std::string container = (*pod)["spec"]["containers"][0].value("name", "worker");
  server_.Mutate("/pods", ns, name, [&](json& p) {
    p["spec"]["nodeName"] = node_name;
    p["status"] = {{"phase", "Running"},
                   {"hostIP", "127.0.0.1"},
                   {"podIP", address},
                   {"startTime", kube::Rfc3339Now()},
                   {"conditions", {{{"type", "PodScheduled"}, {"status", "True"}}, {{"type", "Ready"}, {"status", "True"}}}},
                   {"containerStatuses",
                    {{{"name", container}, {"ready", true}, {"restartCount", 0}, {"state", {{"running", {{"startedAt", kube::Rfc3339Now()}}}}}}}}};
  });
}

void KubeletSimulator::Reap() {
  for (;;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& kv) { return kv.second.pid == pid; });
    if (it == running_.end()) continue;
    const std::string key = it->first;
    ending_groups_[pid] = it->second.address;  // its other processes are killed, as a kubelet does
    running_.erase(it);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    const std::string ns = key.substr(0, key.find('/')), name = key.substr(key.find('/') + 1);
    server_.Mutate("/pods", ns, name, [&](json& p) {
      p["status"]["phase"] = code == 0 ? "Succeeded" : "Failed";
      p["status"]["conditions"] = {{{"type", "PodScheduled"}, {"status", "True"}}, {{"type", "Ready"}, {"status", "False"}}};
      for (auto& cs : p["status"]["containerStatuses"]) {
        cs["ready"] = false;
        cs["state"] = {{"terminated", {{"exitCode", code}, {"reason", code == 0 ? "Completed" : "Error"}, {"finishedAt", kube::Rfc3339Now()}}}};
      }
    });
  }
}

bool KubeletSimulator::ForgetEndedGroups() {
  // kill(-group, 0) fails with ESRCH once no process (zombies included) is left in it.
  const auto ended = [](const auto& group) { return ::kill(-group.first, 0) != 0 && errno == ESRCH; };
  return std::erase_if(ending_groups_, ended) > 0;
}

void KubeletSimulator::Loop(std::stop_token stop) {
  uint64_t seq = 0;
  auto last_pass = std::chrono::steady_clock::now();
  while (!stop.stop_requested()) {
    const auto events = server_.EventsSince(seq, 50);
    std::lock_guard lock(mu_);
    for (const auto& ev : events) {
      seq = ev.seq;
      if (ev.resource != "/pods") continue;
      const std::string key = kube::KeyOf(ev.object);
      if (ev.type == "DELETED") {
        waiting_.erase(key);
        if (auto it = running_.find(key); it != running_.end()) {
          ::kill(-it->second.pid, SIGTERM);
          ending_groups_[it->second.pid] = it->second.address;
          running_.erase(it);
        }
      } else if (ev.type == "ADDED" && !running_.count(key)) {
        waiting_.emplace(key, false);
      }
    }
    for (auto& [group, address] : ending_groups_) ::kill(-group, SIGKILL);  // the grace period is one loop
    Reap();
    const bool freed_address = ForgetEndedGroups();
    // Waiting pods are retried whenever something changed, and at least every second.
    const auto now = std::chrono::steady_clock::now();
    if (!events.empty() || freed_address || now - last_pass > std::chrono::seconds(1)) {
      last_pass = now;
      std::vector<std::string> keys;
      for (const auto& [key, reported] : waiting_) keys.push_back(key);
      for (const auto& key : keys) {
        try {
          TrySchedule(key);
        } catch (const std::exception& e) {  // a pod this kubelet cannot read stays Pending
          spdlog::warn("kubelet: pod {}: {}", key, e.what());
          waiting_.erase(key);
        }
      }
    }
  }
}

}  // namespace meshtrain::testing
