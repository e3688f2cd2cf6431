// The request side of the worker's HTTP endpoints (http_endpoint.h) without sockets: a
// parser for a request's head, a parser for its query, and the answer to it from a table
// of routes. Everything a client's bytes can do goes through these functions and the
// routes' answers; tests/fuzz/http_request_fuzzer.cc drives them.
//
// Only what a small control or metrics endpoint needs: HTTP/1.0 and 1.1 requests in
// origin form ("GET /metrics HTTP/1.1"), a head of at most kMaxRequestHead bytes, lines
// ending in CRLF or a bare LF, and no request bodies. Every answer closes the connection.
//
// Thread-safety: pure functions; a route's answer is called as its owner documents.

#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::metrics {

constexpr size_t kMaxRequestHead = 8192;  // the request line, the headers and the blank line
constexpr const char* kPrometheusTextType = "text/plain; version=0.0.4; charset=utf-8";

struct HttpRequestHead {
  std::string method;     // a token, as sent: "GET"
  std::string target;     // as sent: "/metrics?debug=1"
  std::string path;       // the target up to any '?': "/metrics"
  int minor_version = 1;  // HTTP/1.x
  bool has_body = false;  // a Content-Length other than 0, or a Transfer-Encoding
};

struct HttpParse {
  enum Status { kIncomplete, kComplete, kRejected } status = kIncomplete;
  HttpRequestHead head;   // kComplete
  size_t head_bytes = 0;  // kComplete: the head's size, through its blank line
  int code = 0;           // kRejected: 400 (malformed), 431 (too large) or 505 (not HTTP/1)
  std::string error;      // kRejected: what is wrong, for the answer's body
};

// Parses the request head at the front of `received`, the bytes read so far. kIncomplete
// means more bytes are needed; it is never the answer once kMaxRequestHead bytes are in.
// Once some bytes give kComplete or kRejected, every longer input gives the same.
HttpParse ParseHttpRequest(std::string_view received);

// What a route answers; HttpAnswer adds the status line and the framing headers.
struct HttpResponse {
  int code = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
  std::string headers;  // more header lines, each ending in CRLF
};

// One path an endpoint serves, the methods it allows (GET allows HEAD too) and its answer.
struct HttpRoute {
  std::string path;
  std::vector<std::string> methods;
  std::function<HttpResponse(const HttpRequestHead&)> answer;
};

// The whole response (status line, headers, body) to a parse that is not kIncomplete:
// a rejected request gets its code and error; then a path no route has gets 404, a
// method its route does not allow 405 (with Allow), a request with a body 413, and any
// other the route's answer. HEAD gets GET's headers only. If an answer throws, the
// response is 500 naming the error.
std::string HttpAnswer(const HttpParse& parse, const std::vector<HttpRoute>& routes);

// The metrics endpoint's routes: /metrics answers metrics() as the Prometheus text
// format, /healthz "ok"; both GET (and HEAD). `metrics` is called only for /metrics.
std::vector<HttpRoute> MetricsRoutes(std::function<std::string()> metrics);

// The value of the first parameter called `name` in the query of `target` (the part after
// '?', "a=1&b=2"), with %XX escapes and '+' decoded; nullopt when there is none, or when
// its value holds a malformed escape.
std::optional<std::string> QueryParameter(std::string_view target, std::string_view name);

}  // namespace meshtrain::metrics
