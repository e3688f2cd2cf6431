// A Kubernetes API server for tests. It keeps objects in memory and speaks the real
// wire protocol well enough for the real kubectl and for meshtrain's operator:
//
// - discovery: /version, /api, /api/v1, /apis, /apis/G, /apis/G/V, including the
//   groups of CustomResourceDefinitions created through apiextensions.k8s.io/v1;
// - create/get/list/update/patch/delete, namespaced and cluster-scoped, with label
//   selectors and field selectors (metadata.name, metadata.namespace, spec.nodeName,
//   status.phase);
// - watch as a chunked stream of JSON events from a resourceVersion, with bookmarks,
//   and an in-stream 410 ERROR for versions older than the kept history;
// - the status subresource (spec and status written separately), metadata.generation,
//   uid, creationTimestamp and optimistic concurrency (409 on a stale resourceVersion);
// - JSON merge patch and the strategic-merge subset kubectl apply sends;
// - Tables (as=Table) with CRD printer columns, so `kubectl get` prints them;
// - owner-reference garbage collection (deleting an owner deletes its dependents);
// - custom resources checked against their CRD's structural schema;
// - ServiceAccount tokens (POST .../serviceaccounts/NAME/token) and RBAC: a request with
//   such a token is authorized against the Roles and ClusterRoles bound to its account
//   (403 Forbidden otherwise), as the real authorizer does; the kubeconfig's own token or
//   certificate (or, over plain HTTP, no token) is the cluster admin.
//
// Faults on demand (SetFaults or POST /_test/faults): dropped watches, 410s for the
// next watches, 500s, 409 storms, 429s, latency, and watches that lag: each event of a
// delayed watch goes out that long after it happened (a watch cache seconds behind),
// while gets and lists answer at once. GET /_test/stats counts requests by
// verb and client, and the faults not yet spent. GET /_test/created gives, for each
// TrainingJob, Pod and (Kueue) Workload created, the server's time of the create (ms since
// it started) and, for a pod or Workload, its meshtrain.dev/job-name label: creation
// latencies without a client's lag; RecordTime adds other moments to it (the Kueue
// simulator's admissions).
//
// Thread-safety: every public method may be called from any thread.

#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/kube/http_server.h"

namespace meshtrain::testing {

struct ResourceInfo {
  std::string group;  // "" for core
  std::string version;
  std::string plural;
  std::string singular;
  std::string kind;
  bool namespaced = true;
  std::vector<std::string> short_names;
  bool status_subresource = false;
  bool custom = false;              // defined by a CustomResourceDefinition
  nlohmann::json schema;           // openAPIV3Schema, for custom resources
  nlohmann::json printer_columns;  // additionalPrinterColumns
  std::string Key() const { return group + "/" + plural; }
  std::string ApiVersion() const { return group.empty() ? version : group + "/" + version; }
};

struct Faults {
  int drop_watches = 0;     // close this many open watch streams now, mid-stream
  int gone_watches = 0;     // the next N watches get an ERROR 410 event
  int server_errors = 0;    // the next N non-watch requests get 500
  int conflicts = 0;        // the next N updates and patches get 409
  std::string conflict_path;  // when set, only those whose path ends with it (".../tiny/status")
  int throttles = 0;        // the next N non-watch requests get 429 with Retry-After: 1
  int latency_ms = 0;       // added to every request from now on
  int watch_delay_ms = 0;   // watches (of watch_delay_resource) send each event this long after it
  std::string watch_delay_resource;  // a plural ("pods"); empty: every watch
};

// A ServiceAccount a token was issued to (TokenRequest); its requests are checked
// against RBAC, and get 403 where no bound Role or ClusterRole allows them.
struct ServiceAccountRef {
  std::string namespace_, name;
};

struct StoredEvent {
  uint64_t seq = 0;  // the resourceVersion it produced
  std::string resource;  // ResourceInfo::Key()
  std::string type;      // ADDED, MODIFIED, DELETED
  nlohmann::json object;
  nlohmann::json old_object;  // null for ADDED
  std::chrono::steady_clock::time_point at;  // when it happened
};

class ApiServer {
 public:
  struct Options {
    int bookmark_interval_ms = 1000;
    size_t event_history = 50000;
    std::string record_dir;  // when set, objects the operator writes are saved here as JSON
    // Serve HTTPS with this certificate. Requests must then authenticate, with the
    // kubeconfig's bearer token or a client certificate signed by tls.client_ca_file
    // (else 401), as a real API server does.
    TlsOptions tls;
    std::string ca_file;  // the CA that signed tls.cert_file, named in the kubeconfig written
    std::string client_cert_file, client_key_file;  // the kubeconfig authenticates with these instead of the token
  };
  explicit ApiServer(Options options);
  ~ApiServer();

  int Start(int port);  // returns the port
  void Stop();
  std::string Url() const {
    return (options_.tls.cert_file.empty() ? "http" : "https") + std::string("://127.0.0.1:") + std::to_string(port_);
  }
  // Writes a kubeconfig that points kubectl and the operator at this server.
  void WriteKubeconfig(const std::string& path) const;

  void SetFaults(const Faults& faults);

  // In-process access, for the kubelet simulator and test set-up. Types by resource key
  // ("/pods", "/nodes", "coordination.k8s.io/leases", ...). Throw std::runtime_error on failure.
  nlohmann::json Create(const std::string& resource, const std::string& namespace_, nlohmann::json object);
  std::optional<nlohmann::json> Get(const std::string& resource, const std::string& namespace_,
                                    const std::string& name) const;
  // Applies `mutate` to the stored object and stores it with a new resourceVersion. False if absent.
  bool Mutate(const std::string& resource, const std::string& namespace_, const std::string& name,
              const std::function<void(nlohmann::json&)>& mutate);
  // Adds {kind, key, job, ms: now} to GET /_test/created (`job`: "ns/name" of the job).
  void RecordTime(const std::string& kind, const std::string& key, const std::string& job);
  // Events after `seq`, waiting up to `timeout_ms` for one. Returns the events (maybe none).
  std::vector<StoredEvent> EventsSince(uint64_t seq, int timeout_ms) const;
  nlohmann::json Stats() const;

  // Extra test-only routes under /_test/ (the kubelet simulator adds its own).
  using TestRoute = std::function<void(const HttpRequest&, HttpResponder&)>;
  void AddTestRoute(const std::string& prefix, TestRoute route);

 private:
  struct Store;
  void Handle(const HttpRequest& request, HttpResponder& responder);
  void HandleResource(const HttpRequest& request, HttpResponder& responder, const ResourceInfo& info,
                      const std::string& namespace_, const std::string& name, const std::string& subresource);
  void Watch(const HttpRequest& request, HttpResponder& responder, const ResourceInfo& info,
             const std::string& namespace_);
  bool Discovery(const HttpRequest& request, HttpResponder& responder);

  Options options_;
  std::unique_ptr<Store> store_;
  HttpServer http_;
  int port_ = 0;
  std::mutex routes_mu_;
  std::map<std::string, TestRoute> test_routes_;
};

}  // namespace meshtrain::testing
