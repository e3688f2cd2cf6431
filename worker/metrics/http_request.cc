#include "worker/metrics/http_request.h"

#include <algorithm>
#include <exception>
#include <optional>

namespace meshtrain::metrics {
namespace {

HttpParse Rejected(int code, std::string error) {
  HttpParse parse;
  parse.status = HttpParse::kRejected;
  parse.code = code;
  parse.error = std::move(error);
  return parse;
}

bool IsTokenChar(unsigned char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         std::string_view("!#$%&'*+-.^_`|~").find(char(c)) != std::string_view::npos;
}

bool IsToken(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!IsTokenChar(uint8_t(c))) return false;
  }
  return true;
}

// A request target holds visible ASCII only.
bool IsTarget(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (uint8_t(c) <= 0x20 || uint8_t(c) >= 0x7F) return false;
  }
  return true;
}

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// Whether `line` (without its LF, which may not have arrived) holds a byte no head may
// hold: a control byte other than tab, or a CR anywhere but at its end.
bool HasBadByte(std::string_view line) {
  for (size_t i = 0; i < line.size(); ++i) {
    const uint8_t c = uint8_t(line[i]);
    if (c == '\r' && i + 1 == line.size()) continue;
    if ((c < 0x20 && c != '\t') || c == 0x7F) return true;
  }
  return false;
}

bool EqualsIgnoringCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = char(x - 'A' + 'a');
    if (y >= 'A' && y <= 'Z') y = char(y - 'A' + 'a');
    if (x != y) return false;
  }
  return true;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// "METHOD SP TARGET SP HTTP/1.x" into *head; the rejection if it is not.
std::optional<HttpParse> ReadRequestLine(std::string_view line, HttpRequestHead* head) {
  const size_t first = line.find(' '), last = line.rfind(' ');
  if (first == std::string_view::npos || first == last) {
    return Rejected(400, "the request line is not \"METHOD TARGET HTTP/1.1\"");
  }
  const std::string_view method = line.substr(0, first), target = line.substr(first + 1, last - first - 1),
                         version = line.substr(last + 1);
  if (!IsToken(method)) return Rejected(400, "the request line's method is not a token");
  if (!IsTarget(target)) return Rejected(400, "the request line's target is empty or holds a space or a non-ASCII byte");
  if (version.size() != 8 || version.substr(0, 5) != "HTTP/" || !IsDigit(version[5]) || version[6] != '.' ||
      !IsDigit(version[7])) {
    return Rejected(400, "the request line's version is not HTTP/x.y");
  }
  if (version[5] != '1') return Rejected(505, "this endpoint speaks HTTP/1.0 and HTTP/1.1 only");
  if (target[0] != '/') return Rejected(400, "the request target is not a path (it must begin with '/')");
  head->method = method;
  head->target = target;
  head->path = target.substr(0, target.find('?'));
  head->minor_version = version[7] - '0';
  return std::nullopt;
}

// "Name: value", the `number`th line of the head, into *head; the rejection if it is not.
std::optional<HttpParse> ReadHeaderLine(std::string_view line, size_t number, HttpRequestHead* head) {
  const std::string where = "header line " + std::to_string(number);
  if (line[0] == ' ' || line[0] == '\t') return Rejected(400, where + " is folded onto the one before (obsolete)");
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) return Rejected(400, where + " has no ':'");
  const std::string_view name = line.substr(0, colon), value = Trim(line.substr(colon + 1));
  if (!IsToken(name)) return Rejected(400, where + ": the name is not a token");
  if (EqualsIgnoringCase(name, "Content-Length")) {
    if (value.empty()) return Rejected(400, "Content-Length is empty");
    for (char c : value) {
      if (!IsDigit(c)) return Rejected(400, "Content-Length is not a number");
      if (c != '0') head->has_body = true;
    }
  } else if (EqualsIgnoringCase(name, "Transfer-Encoding")) {
    head->has_body = true;
  }
  return std::nullopt;
}

std::string Reason(int code) {
  switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 409: return "Conflict";
    case 413: return "Content Too Large";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Internal Server Error";
  }
}

std::string Response(const HttpResponse& response, bool head_only) {
  std::string out = "HTTP/1.1 " + std::to_string(response.code) + " " + Reason(response.code) +
                    "\r\nContent-Type: " + response.content_type +
                    "\r\nContent-Length: " + std::to_string(response.body.size()) + "\r\nConnection: close\r\n" +
                    response.headers + "\r\n";
  if (!head_only) out += response.body;
  return out;
}

std::string Text(int code, std::string body, bool head_only, std::string headers = "") {
  HttpResponse response;
  response.code = code;
  response.body = std::move(body);
  response.headers = std::move(headers);
  return Response(response, head_only);
}

// "a", "a and b", "a, b and c".
std::string Enumerate(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += i + 1 == items.size() ? " and " : ", ";
    out += items[i];
  }
  return out;
}

// A route's methods with HEAD after GET, as they are allowed.
std::vector<std::string> AllowedMethods(const HttpRoute& route) {
  std::vector<std::string> methods;
  for (const std::string& method : route.methods) {
    methods.push_back(method);
    if (method == "GET") methods.push_back("HEAD");
  }
  return methods;
}

// A %XX-and-'+' encoded query component decoded; nullopt when an escape is malformed.
std::optional<std::string> DecodeQueryComponent(std::string_view encoded) {
  const auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string decoded;
  for (size_t i = 0; i < encoded.size(); ++i) {
    if (encoded[i] == '+') {
      decoded += ' ';
    } else if (encoded[i] != '%') {
      decoded += encoded[i];
    } else if (i + 2 < encoded.size() && hex(encoded[i + 1]) >= 0 && hex(encoded[i + 2]) >= 0) {
      decoded += char(hex(encoded[i + 1]) * 16 + hex(encoded[i + 2]));
      i += 2;
    } else {
      return std::nullopt;
    }
  }
  return decoded;
}

}  // namespace

HttpParse ParseHttpRequest(std::string_view received) {
  const std::string_view window = received.substr(0, kMaxRequestHead);
  HttpParse parse;
  size_t start = 0;
  for (size_t number = 0;; ++number) {
    const size_t lf = window.find('\n', start);
    std::string_view line = window.substr(start, lf == std::string_view::npos ? std::string_view::npos : lf - start);
    // Checked before the LF arrives, so that a client sending binary is turned away at once.
    if (HasBadByte(line)) return Rejected(400, "the request head holds a control byte");
    if (lf == std::string_view::npos) break;
    start = lf + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (number == 0) {
      if (line.empty()) return Rejected(400, "the request line is empty");
      if (auto rejection = ReadRequestLine(line, &parse.head)) return *rejection;
    } else if (line.empty()) {
      parse.status = HttpParse::kComplete;
      parse.head_bytes = start;
      return parse;
    } else if (auto rejection = ReadHeaderLine(line, number, &parse.head)) {
      return *rejection;
    }
  }
  if (received.size() >= kMaxRequestHead) {
    return Rejected(431, "the request head is longer than " + std::to_string(kMaxRequestHead) + " bytes");
  }
  return HttpParse{};
}

std::string HttpAnswer(const HttpParse& parse, const std::vector<HttpRoute>& routes) {
  if (parse.status != HttpParse::kComplete) return Text(parse.code ? parse.code : 400, parse.error + "\n", false);
  const HttpRequestHead& head = parse.head;
  const bool head_only = head.method == "HEAD";
  const auto route =
      std::find_if(routes.begin(), routes.end(), [&](const HttpRoute& r) { return r.path == head.path; });
  if (route == routes.end()) {
    std::vector<std::string> paths;
    for (const HttpRoute& r : routes) paths.push_back(r.path);
    return Text(404, "no such path; this endpoint serves " + Enumerate(paths) + "\n", head_only);
  }
  const std::vector<std::string> allowed = AllowedMethods(*route);
  if (std::find(allowed.begin(), allowed.end(), head.method) == allowed.end()) {
    std::string allow;
    for (const std::string& method : allowed) allow += (allow.empty() ? "" : ", ") + method;
    return Text(405, "only " + Enumerate(allowed) + (allowed.size() == 1 ? " is" : " are") + " allowed\n", head_only,
                "Allow: " + allow + "\r\n");
  }
  if (head.has_body) return Text(413, "requests with a body are not accepted\n", head_only);
  try {
    return Response(route->answer(head), head_only);
  } catch (const std::exception& e) {
    return Text(500, "cannot answer " + head.path + ": " + e.what() + "\n", head_only);
  }
}

std::vector<HttpRoute> MetricsRoutes(std::function<std::string()> metrics) {
  const auto answer_metrics = [metrics = std::move(metrics)](const HttpRequestHead&) {
    HttpResponse response;
    try {
      response.body = metrics();
      response.content_type = kPrometheusTextType;
    } catch (const std::exception& e) {
      response.code = 500;
      response.body = std::string("cannot collect the metrics: ") + e.what() + "\n";
    }
    return response;
  };
  const auto answer_health = [](const HttpRequestHead&) {
    HttpResponse response;
    response.body = "ok";
    return response;
  };
  return {{"/metrics", {"GET"}, answer_metrics}, {"/healthz", {"GET"}, answer_health}};
}

std::optional<std::string> QueryParameter(std::string_view target, std::string_view name) {
  const size_t question = target.find('?');
  if (question == std::string_view::npos) return std::nullopt;
  std::string_view query = target.substr(question + 1);
  query = query.substr(0, query.find('#'));  // a fragment is no part of the query
  for (;;) {
    const size_t ampersand = query.find('&');
    const std::string_view pair = query.substr(0, ampersand);
    const size_t equals = pair.find('=');
    if (pair.substr(0, equals) == name) {
      return DecodeQueryComponent(equals == std::string_view::npos ? "" : pair.substr(equals + 1));
    }
    if (ampersand == std::string_view::npos) return std::nullopt;
    query.remove_prefix(ampersand + 1);
  }
}

}  // namespace meshtrain::metrics
