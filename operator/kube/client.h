// A small Kubernetes REST client on cpprestsdk, speaking JSON (nlohmann).
//
// Get, list, create, update (PUT), JSON merge patch and delete for any ResourceType,
// the status subresource, and watch streams. Failures throw KubeError. Throttling
// (429), server errors (5xx) and connection failures are retried with exponential
// backoff (429 honours Retry-After) before they are thrown. Every request, retries
// included, first takes a token from the client-side QPS/burst bucket.
//
// Thread-safe: one Client serves every thread of the operator.

#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <stop_token>
#include <optional>
#include <string>

#include <cpprest/http_msg.h>
#include <nlohmann/json.hpp>

#include "operator/kube/config.h"
#include "operator/kube/errors.h"
#include "operator/kube/rate_limiter.h"
#include "operator/kube/resource.h"

namespace meshtrain::kube {

struct ClientOptions {
  double qps = 50;  // <= 0: unlimited
  int burst = 100;
  int max_retries = 5;  // for retryable errors; then the error is thrown
  std::chrono::milliseconds initial_backoff{100};
  std::chrono::milliseconds max_backoff{5000};
  std::chrono::seconds request_timeout{30};
  std::string user_agent = "meshtrain-operator";
};

struct ListOptions {
  std::string label_selector;
  std::string field_selector;
  std::string resource_version;
};

struct WatchEvent {
  std::string type;  // ADDED, MODIFIED, DELETED, BOOKMARK
  nlohmann::json object;
};

// Called after every HTTP exchange: the Kubernetes verb (get, list, watch, create, update,
// patch, delete) and the status code (0 when no response came).
// Called after each request: its verb, HTTP code (0: no response) and seconds from send
// to the whole response (a watch's: to its headers).
using RequestObserver = std::function<void(const std::string& verb, int code, double seconds)>;

class Client {
 public:
  Client(KubeConfig config, ClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const KubeConfig& config() const { return config_; }

  nlohmann::json Get(const ResourceType& type, const std::string& namespace_, const std::string& name);
  // A List object (items, metadata.resourceVersion). An empty namespace lists across all namespaces.
  nlohmann::json List(const ResourceType& type, const std::string& namespace_, const ListOptions& options = {});
  // The same, with each item replaced by item_transform(item) as it is parsed, so that the
  // list's whole objects are never all held at once (an informer's transform).
  nlohmann::json List(const ResourceType& type, const std::string& namespace_, const ListOptions& options,
                      const std::function<nlohmann::json(nlohmann::json)>& item_transform);
  nlohmann::json Create(const ResourceType& type, const std::string& namespace_, const nlohmann::json& object);
  // PUT of the whole object; its metadata.resourceVersion makes it conditional (409 when stale).
  nlohmann::json Update(const ResourceType& type, const std::string& namespace_, const nlohmann::json& object);
  nlohmann::json UpdateStatus(const ResourceType& type, const std::string& namespace_, const nlohmann::json& object);
  nlohmann::json MergePatch(const ResourceType& type, const std::string& namespace_, const std::string& name,
                            const nlohmann::json& patch, bool status_subresource = false);
  // Deletes with the given propagation policy (Background, Foreground or Orphan) and, if
  // given, grace period (0: at once, as for a pod on a lost node).
  void Delete(const ResourceType& type, const std::string& namespace_, const std::string& name,
              const std::string& propagation = "Background", std::optional<int64_t> grace_period_seconds = {});

  // Streams a watch from options.resource_version (with bookmarks) and calls on_event for
  // each event until the server ends the stream (after about timeout_seconds), on_event
  // returns false, or `stop` is requested. An in-stream ERROR event throws the KubeError it
  // carries (410 Gone: the caller must relist); a broken connection throws kUnavailable.
  void Watch(const ResourceType& type, const std::string& namespace_, const ListOptions& options, int timeout_seconds,
             const std::function<bool(const WatchEvent&)>& on_event, std::stop_token stop);

  void SetRequestObserver(RequestObserver observer);

 private:
  struct Impl;
  // With `list_item`, the response is a List whose items are parsed through it.
  nlohmann::json Request(const std::string& verb, const std::string& method, const std::string& path,
                         const nlohmann::json* body, const std::string& content_type,
                         const std::function<nlohmann::json(nlohmann::json)>* list_item = nullptr);
  // Waits for a token and returns a request with the headers every call carries.
  web::http::http_request NewRequest(const std::string& method, const std::string& path);
  void Observe(const std::string& verb, int code, std::chrono::steady_clock::time_point sent);

  KubeConfig config_;
  ClientOptions options_;
  TokenBucket bucket_;
  std::unique_ptr<Impl> impl_;
};

// Builds a path with a query string from `options` plus extra "k=v" parameters (already encoded).
std::string WithQuery(const std::string& path, const ListOptions& options, const std::string& extra = "");

}  // namespace meshtrain::kube
