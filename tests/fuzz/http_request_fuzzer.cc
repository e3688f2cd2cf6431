// libFuzzer target for the worker's HTTP endpoints (worker/metrics/http_request.h): the
// request parser, the query parser and the answer from a table of routes, as the
// endpoint's read loop drives them.
//
// Beyond "no crash", it checks on every input:
//   - kIncomplete only while fewer than kMaxRequestHead bytes are in;
//   - the parse is prefix-stable: reading the input in pieces (sizes taken from its
//     bytes), as the endpoint does, stops with the same result as parsing it whole, and a
//     complete head parses the same without the bytes after it;
//   - every answer is one well-formed response: a known status, Connection: close, and a
//     body as long as its Content-Length (none for HEAD), from the metrics endpoint's
//     routes and from routes that answer with the query parameters they read (as the pod
//     launcher's control endpoint does);
//   - a query parameter found is decoded: it is no longer than its encoding.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "worker/metrics/http_request.h"

namespace {

using meshtrain::metrics::HttpAnswer;
using meshtrain::metrics::HttpParse;
using meshtrain::metrics::HttpRequestHead;
using meshtrain::metrics::HttpResponse;
using meshtrain::metrics::HttpRoute;
using meshtrain::metrics::kMaxRequestHead;
using meshtrain::metrics::MetricsRoutes;
using meshtrain::metrics::ParseHttpRequest;
using meshtrain::metrics::QueryParameter;

[[noreturn]] void Fail(const char* what, std::string_view input) {
  std::fprintf(stderr, "%s (input of %zu bytes)\n", what, input.size());
  std::abort();
}

bool Same(const HttpParse& a, const HttpParse& b) {
  return a.status == b.status && a.code == b.code && a.error == b.error && a.head_bytes == b.head_bytes &&
         a.head.method == b.head.method && a.head.target == b.head.target && a.head.path == b.head.path &&
         a.head.minor_version == b.head.minor_version && a.head.has_body == b.head.has_body;
}

// Routes like the launcher's control endpoint: each answers with the query's parameters.
std::vector<HttpRoute> QueryRoutes() {
  const auto echo = [](const HttpRequestHead& head) {
    HttpResponse response;
    response.code = 409;
    response.content_type = "application/json";
    for (const char* name : {"attempt", "token"}) {
      if (const auto value = QueryParameter(head.target, name)) response.body += *value;
    }
    return response;
  };
  return {{"/attempt", {"GET"}, echo}, {"/attempt/stop", {"POST"}, echo}};
}

void CheckAnswer(const HttpParse& parse, const std::vector<HttpRoute>& routes, std::string_view input) {
  const std::string answer = HttpAnswer(parse, routes);
  if (answer.rfind("HTTP/1.1 ", 0) != 0 || answer.size() < 12) Fail("the answer has no status line", input);
  const int code = std::atoi(answer.substr(9, 3).c_str());
  if (code != 200 && code != 400 && code != 404 && code != 405 && code != 409 && code != 413 && code != 431 &&
      code != 505) {
    Fail("the answer has an unexpected status", input);
  }
  const size_t end = answer.find("\r\n\r\n");
  if (end == std::string::npos) Fail("the answer's head does not end", input);
  const std::string head = answer.substr(0, end + 2), body = answer.substr(end + 4);
  if (head.find("\r\nConnection: close\r\n") == std::string::npos) Fail("the answer keeps the connection", input);
  const size_t length = head.find("\r\nContent-Length: ");
  if (length == std::string::npos) Fail("the answer has no Content-Length", input);
  const size_t declared = std::strtoull(head.c_str() + length + 18, nullptr, 10);
  const bool head_only = parse.status == HttpParse::kComplete && parse.head.method == "HEAD";
  if (body.size() != (head_only ? 0 : declared)) Fail("the answer's body is not its Content-Length", input);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const HttpParse whole = ParseHttpRequest(input);
  if (whole.status == HttpParse::kIncomplete) {
    if (size >= kMaxRequestHead) Fail("kIncomplete with a full head's bytes in", input);
    return 0;
  }
  if (whole.status == HttpParse::kComplete) {
    if (whole.head_bytes == 0 || whole.head_bytes > std::min(size, kMaxRequestHead)) Fail("a bad head_bytes", input);
    if (!Same(ParseHttpRequest(input.substr(0, whole.head_bytes)), whole)) Fail("the bytes after the head count", input);
    if (whole.head.path.empty() || whole.head.path[0] != '/') Fail("a path that is not one", input);
    for (const char* name : {"attempt", "token", ""}) {
      const auto value = QueryParameter(whole.head.target, name);
      if (value && value->size() >= whole.head.target.size()) Fail("a query parameter longer than its target", input);
    }
  } else if (whole.code != 400 && whole.code != 431 && whole.code != 505) {
    Fail("a rejection with an unexpected code", input);
  }

  // The endpoint's loop: read a piece, parse all that is in, stop once it is decided.
  const size_t readable = std::min(size, kMaxRequestHead);  // the endpoint keeps no more
  std::string received;
  HttpParse piecewise;
  for (size_t i = 0; piecewise.status == HttpParse::kIncomplete; ++i) {
    if (received.size() == readable) Fail("the pieces ran out before the whole input decided", input);
    const size_t piece = 1 + data[i % size] * 16;  // 1 byte to 4 KiB
    received.append(input.substr(received.size(), std::min(piece, readable - received.size())));
    piecewise = ParseHttpRequest(received);
  }
  if (!Same(piecewise, whole)) Fail("read in pieces, the request parses otherwise", input);
  static const std::vector<HttpRoute> metrics_routes =
      MetricsRoutes([] { return std::string("meshtrain_train_step 1\n"); });
  static const std::vector<HttpRoute> query_routes = QueryRoutes();
  CheckAnswer(whole, metrics_routes, input);
  CheckAnswer(whole, query_routes, input);
  return 0;
}
