// A kubelet (and scheduler binder) for the test API server.
//
// It binds each pod to the node its required node affinity names (or spec.nodeName),
// admits it only while the node is Ready and has the GPUs and EFA interfaces the pod
// requests (otherwise the pod stays Pending with PodScheduled=False/Unschedulable), and
// runs it as a real local process in its own process group:
//   - run mode: the container's command and args, with its environment, and its
//     ConfigMap volumes written under the pod's directory (environment values under a
//     mount path are rewritten to the local copy);
//   - script mode: `sleep S; exit C`, where S and C are per job (or the defaults).
// The pod then moves Pending -> Running -> Succeeded/Failed with container statuses and
// exit codes, as a kubelet reports them.
//
// Every pod gets its own loopback address (127.N.x.y) as status.podIP, stable for its
// DNS name (hostname.subdomain.namespace), so the pods sharing this machine can all listen
// on the same ports; N is a block no other running simulator holds (an flock in /tmp). Cluster DNS is simulated: in environment values, a
// name `<hostname>.<subdomain>.<namespace>.svc[.cluster.local]` becomes that pod's address. Deleting a pod terminates its process group
// (SIGTERM, then SIGKILL on the next pass of the loop, about 50 ms later); a new pod with
// the same DNS name, and so the same address, starts once every process of the old
// one has exited.
//
// Test routes: POST /_test/kubelet/script {"job", "exitCode", "seconds"},
// POST /_test/kubelet/kill {"namespace", "name", "signal"}, POST /_test/kubelet/node
// {"name", "ready"}, GET /_test/kubelet/pods.
//
// Thread-safety: public methods may be called from any thread.

#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "operator/scheduler/cluster.h"
#include "tests/support/kube/api_server.h"

namespace meshtrain::testing {

struct KubeletOptions {
  std::string mode = "script";  // script | run
  int script_exit_code = 0;
  double script_seconds = 2;
  std::string workdir = "/tmp/meshtrain-kubelet";
  std::map<std::string, std::string> commands;  // run mode: command[0] -> local binary
};

class KubeletSimulator {
 public:
  KubeletSimulator(ApiServer& server, KubeletOptions options);
  ~KubeletSimulator();

  // Creates a Node object for every node of the snapshot.
  void AddNodes(const scheduler::ClusterSnapshot& snapshot);
  void Start();
  void Stop();

  void SetScript(const std::string& job, int exit_code, double seconds);
  bool KillPod(const std::string& namespace_, const std::string& name, int signal);
  bool SetNodeReady(const std::string& name, bool ready);

 private:
  struct Process {
    pid_t pid = 0;
    std::string node;
    int64_t gpus = 0, efa = 0;
    std::string address;
  };
  void Loop(std::stop_token stop);
  void TrySchedule(const std::string& key);
  void Reap();
  // Forgets the groups in ending_groups_ that have no process left; true if there were any.
  bool ForgetEndedGroups();
  pid_t Launch(const nlohmann::json& pod);
  // The loopback address of a DNS name, assigned on first use. REQUIRES: mu_ held.
  std::string AddressOf(const std::string& namespace_, const std::string& hostname, const std::string& subdomain);
  std::string AddressOf(const nlohmann::json& pod);
  // `value` with pod DNS names of `namespace_` replaced by their addresses. REQUIRES: mu_ held.
  std::string ResolveNames(const std::string& namespace_, const std::string& value);
  // This simulator's N of 127.N.0.0/16, locked on first use. REQUIRES: mu_ held.
  int AddressBlock();

  ApiServer& server_;
  const KubeletOptions options_;
  std::mutex mu_;
  std::map<std::string, Process> running_;  // "ns/name" -> process of a live pod
  // Process groups of pods deleted, or whose first process exited -> their pod address,
  // which no new pod takes until every process of the group has exited.
  std::map<pid_t, std::string> ending_groups_;
  std::map<std::string, bool> waiting_;     // pods not yet admitted -> reported Unschedulable
  std::map<std::string, std::pair<int, double>> scripts_;
  std::map<std::string, std::string> addresses_;  // "hostname.subdomain.namespace" -> 127.N.x.y
  int address_block_ = 0, address_lock_fd_ = -1;
  std::jthread thread_;
};

// The Node object a real kubelet would register for `node`.
nlohmann::json NodeObject(const scheduler::ClusterNode& node);

}  // namespace meshtrain::testing
