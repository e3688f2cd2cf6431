// The worker's HTTP/1.1 endpoint: it answers each request from a table of routes
// (http_request.h), such as a rank's /metrics and /healthz (MetricsRoutes) or a pod
// launcher's control of its ranks (worker/launch/launcher_control.h). What the requests
// may be is in http_request.h; every answer closes its connection. It is ours rather than
// prometheus-cpp's Exposer so that every byte a client sends meets code that is fuzzed
// (tests/fuzz/http_request_fuzzer.cc).
//
// Limits, so that no client can hold it: a request head of kMaxRequestHead bytes, no
// request bodies, `max_connections` clients at once (later ones wait in the listen
// backlog), and `timeout` for a connection's whole life, after which a silent or slow
// client is dropped.
//
// Thread-safety: it serves on its own thread, which calls the routes' answers one request
// at a time (an answer that blocks holds every other client meanwhile); port() may be
// called from any thread.

#pragma once

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "worker/metrics/http_request.h"

namespace meshtrain::metrics {

struct HttpEndpointOptions {
  std::string name = "HTTP";  // what it serves, for errors: "cannot serve metrics on ..."
  std::chrono::milliseconds timeout{5000};  // from accept to close
  int max_connections = 32;
};

class HttpEndpoint {
 public:
  // Listens on host:port (port 0: any free one; host: a numeric IPv4 or IPv6 address,
  // "0.0.0.0" for every IPv4 interface). Throws std::runtime_error naming the address if
  // it cannot listen.
  HttpEndpoint(const std::string& host, int port, std::vector<HttpRoute> routes, HttpEndpointOptions options = {});
  // Stops serving and closes every connection.
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  int port() const { return port_; }

 private:
  void Serve();

  std::vector<HttpRoute> routes_;
  HttpEndpointOptions options_;
  int port_ = 0;
  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};  // a byte on the pipe stops the thread
  std::thread thread_;
};

}  // namespace meshtrain::metrics
