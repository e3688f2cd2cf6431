// The request side of the worker's HTTP endpoint (http_endpoint.h) without sockets: a
// parser for a request's head and the answer to it. Everything a client's bytes can do
// goes through these two functions, which tests/fuzz/http_request_fuzzer.cc drives.
//
// Only what a metrics and health endpoint needs: HTTP/1.0 and 1.1 requests in origin
// form ("GET /metrics HTTP/1.1"), a head of at most kMaxRequestHead bytes, lines ending
// in CRLF or a bare LF, and no request bodies. Every answer closes the connection.
//
// Thread-safety: pure functions.

#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

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

// The whole response (status line, headers, body) to a parse that is not kIncomplete:
// a rejected request gets its code and error; then /metrics answers 200 with metrics()
// as the Prometheus text format, /healthz 200 "ok", any other path 404; a method other
// than GET and HEAD gets 405 and a request with a body 413. HEAD gets GET's headers
// only. `metrics` is called only for /metrics; if it throws, the answer is 500.
std::string HttpAnswer(const HttpParse& parse, const std::function<std::string()>& metrics);

}  // namespace meshtrain::metrics
