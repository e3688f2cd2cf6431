// The worker's HTTP endpoint: its request parser, and the server over real sockets on
// 127.0.0.1.

#include "worker/metrics/http_endpoint.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "worker/metrics/http_request.h"

namespace meshtrain::metrics {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// The parser and the answers, without sockets.

TEST(HttpRequest, ParsesAHeadInPiecesAndStopsAtItsEnd) {
  const std::string request = "GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAccept-Encoding: gzip\r\n\r\nleftover";
  for (size_t n = 0; n < request.find("\r\n\r\n") + 4; ++n) {
    EXPECT_EQ(ParseHttpRequest(request.substr(0, n)).status, HttpParse::kIncomplete) << n;
  }
  const HttpParse parse = ParseHttpRequest(request);
  ASSERT_EQ(parse.status, HttpParse::kComplete) << parse.error;
  EXPECT_EQ(parse.head.method, "GET");
  EXPECT_EQ(parse.head.target, "/metrics?x=1");
  EXPECT_EQ(parse.head.path, "/metrics");
  EXPECT_EQ(parse.head.minor_version, 1);
  EXPECT_FALSE(parse.head.has_body);
  EXPECT_EQ(parse.head_bytes, request.size() - 8);
  EXPECT_EQ(ParseHttpRequest("HEAD /healthz HTTP/1.0\n\n").status, HttpParse::kComplete) << "bare LFs";
}

TEST(HttpRequest, RejectsWithTheCodeAndWhatIsWrong) {
  struct Case {
    std::string request;
    int code;
    std::string error;
  };
  const Case cases[] = {
      {"\x16\x03\x01\x02", 400, "control byte"},  // a TLS hello, turned away before any LF
      {"\r\nGET / HTTP/1.1\r\n\r\n", 400, "request line is empty"},
      {"GET /metrics\r\n\r\n", 400, "not \"METHOD TARGET HTTP/1.1\""},
      {"GET /a b HTTP/1.1\r\n\r\n", 400, "target"},
      {"G(T / HTTP/1.1\r\n\r\n", 400, "method"},
      {"GET / HTTP/1\r\n\r\n", 400, "version"},
      {"PRI * HTTP/2.0\r\n\r\n", 505, "HTTP/1.0 and HTTP/1.1"},
      {"GET http://a/metrics HTTP/1.1\r\n\r\n", 400, "not a path"},
      {"GET / HTTP/1.1\r\nHost a\r\n\r\n", 400, "header line 1 has no ':'"},
      {"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n", 400, "header line 2 is folded"},
      {"GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400, "header line 1: the name is not a token"},
      {"GET / HTTP/1.1\r\nContent-Length: 1x\r\n\r\n", 400, "Content-Length is not a number"},
      {"GET / HTTP/1.1\r\nHost: a\rb\r\n\r\n", 400, "control byte"},
      {"GET / HTTP/1.1\r\nX: " + std::string(kMaxRequestHead, 'a'), 431, "longer than 8192 bytes"},
  };
  for (const Case& c : cases) {
    const HttpParse parse = ParseHttpRequest(c.request);
    ASSERT_EQ(parse.status, HttpParse::kRejected) << c.request;
    EXPECT_EQ(parse.code, c.code) << c.request;
    EXPECT_NE(parse.error.find(c.error), std::string::npos) << c.request << ": " << parse.error;
  }
}

std::string Answer(const std::string& request) {
  return HttpAnswer(ParseHttpRequest(request), MetricsRoutes([] { return std::string("m 1\n"); }));
}

TEST(HttpRequest, AnswersEachPathAndMethod) {
  EXPECT_EQ(Answer("GET /metrics HTTP/1.1\r\n\r\n"),
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: 4\r\n"
            "Connection: close\r\n\r\nm 1\n");
  EXPECT_EQ(Answer("HEAD /metrics HTTP/1.1\r\n\r\n"),
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: 4\r\n"
            "Connection: close\r\n\r\n");
  EXPECT_EQ(Answer("GET /healthz HTTP/1.0\r\n\r\n"),
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 2\r\n"
            "Connection: close\r\n\r\nok");
  EXPECT_EQ(Answer("GET / HTTP/1.1\r\n\r\n").substr(0, 22), "HTTP/1.1 404 Not Found");
  const std::string post = Answer("POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\n");
  EXPECT_EQ(post.substr(0, 31), "HTTP/1.1 405 Method Not Allowed");
  EXPECT_NE(post.find("\r\nAllow: GET, HEAD\r\n"), std::string::npos);
  EXPECT_EQ(Answer("GET /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\n").substr(0, 30), "HTTP/1.1 413 Content Too Large");
  EXPECT_EQ(Answer("GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n").substr(0, 12), "HTTP/1.1 413");
  EXPECT_EQ(Answer("GET /metrics HTTP/1.1\r\nContent-Length: 00\r\n\r\n").substr(0, 12), "HTTP/1.1 200");
  const std::string failed =
      HttpAnswer(ParseHttpRequest("GET /metrics HTTP/1.1\r\n\r\n"),
                 MetricsRoutes([]() -> std::string { throw std::runtime_error("registry broken"); }));
  EXPECT_EQ(failed.substr(0, 12), "HTTP/1.1 500");
  EXPECT_NE(failed.find("cannot collect the metrics: registry broken"), std::string::npos);
}

TEST(HttpRequest, RoutesByPathThenMethodThenBody) {
  int answered = 0;
  const std::vector<HttpRoute> routes = {
      {"/a", {"POST"}, [&](const HttpRequestHead& head) {
         ++answered;
         HttpResponse response;
         response.code = 409;
         response.content_type = "application/json";
         response.body = "{\"target\":\"" + head.target + "\"}";
         response.headers = "X-Seen: yes\r\n";
         return response;
       }},
      {"/b", {"GET"}, [](const HttpRequestHead&) -> HttpResponse { throw std::runtime_error("broken"); }},
      {"/c", {"GET", "POST"}, [](const HttpRequestHead&) { return HttpResponse{}; }},
  };
  const auto answer = [&](const std::string& request) { return HttpAnswer(ParseHttpRequest(request), routes); };
  EXPECT_EQ(answer("POST /a?x=1 HTTP/1.1\r\n\r\n"),
            "HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\nContent-Length: 19\r\nConnection: close\r\n"
            "X-Seen: yes\r\n\r\n{\"target\":\"/a?x=1\"}");
  const std::string not_found = answer("GET /d HTTP/1.1\r\n\r\n");
  EXPECT_EQ(not_found.substr(0, 12), "HTTP/1.1 404");
  EXPECT_NE(not_found.find("this endpoint serves /a, /b and /c\n"), std::string::npos) << not_found;
  const std::string get_a = answer("GET /a HTTP/1.1\r\n\r\n");
  EXPECT_EQ(get_a.substr(0, 12), "HTTP/1.1 405");
  EXPECT_NE(get_a.find("\r\nAllow: POST\r\n"), std::string::npos) << get_a;
  EXPECT_NE(get_a.find("only POST is allowed"), std::string::npos) << get_a;
  const std::string head_a = answer("HEAD /a HTTP/1.1\r\n\r\n");
  EXPECT_EQ(head_a.substr(0, 12), "HTTP/1.1 405");
  EXPECT_EQ(head_a.substr(head_a.size() - 4), "\r\n\r\n") << "HEAD gets no body, whatever the answer";
  EXPECT_NE(answer("PUT /c HTTP/1.1\r\n\r\n").find("\r\nAllow: GET, HEAD, POST\r\n"), std::string::npos);
  EXPECT_EQ(answer("POST /a HTTP/1.1\r\nContent-Length: 2\r\n\r\n").substr(0, 12), "HTTP/1.1 413");
  EXPECT_EQ(answered, 1) << "only a request that passed every check is answered";
  const std::string broken = answer("GET /b HTTP/1.1\r\n\r\n");
  EXPECT_EQ(broken.substr(0, 12), "HTTP/1.1 500");
  EXPECT_NE(broken.find("cannot answer /b: broken"), std::string::npos) << broken;
}

TEST(HttpRequest, QueryParameterDecodesTheFirstOfItsName) {
  EXPECT_EQ(QueryParameter("/attempt/stop?attempt=3&token=abc", "attempt"), "3");
  EXPECT_EQ(QueryParameter("/attempt/stop?attempt=3&token=abc", "token"), "abc");
  EXPECT_EQ(QueryParameter("/x?a=1&a=2", "a"), "1");
  EXPECT_EQ(QueryParameter("/x?a", "a"), "");
  EXPECT_EQ(QueryParameter("/x?a=", "a"), "");
  EXPECT_EQ(QueryParameter("/x?b=%41%2b+c%3D&a=1", "b"), "A+ c=");
  EXPECT_EQ(QueryParameter("/x?aa=1&a=2#a=3", "a"), "2");
  EXPECT_EQ(QueryParameter("/x?a=1#frag", "a"), "1");
  EXPECT_EQ(QueryParameter("/x?&&a=1", "a"), "1");
  EXPECT_EQ(QueryParameter("/x", "a"), std::nullopt);
  EXPECT_EQ(QueryParameter("/x?", "a"), std::nullopt);
  EXPECT_EQ(QueryParameter("/x?b=1", "a"), std::nullopt);
  EXPECT_EQ(QueryParameter("/x?ab=1", "a"), std::nullopt);
  EXPECT_EQ(QueryParameter("/x?A=1", "a"), std::nullopt) << "names are case-sensitive";
  for (const char* malformed : {"/x?a=%", "/x?a=%4", "/x?a=%4g", "/x?a=1%"}) {
    EXPECT_EQ(QueryParameter(malformed, "a"), std::nullopt) << malformed;
  }
}

// ---------------------------------------------------------------------------
// The server.

// A raw TCP client of the endpoint.
class Client {
 public:
  explicit Client(int port) : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(uint16_t(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
      throw std::runtime_error("cannot connect to 127.0.0.1:" + std::to_string(port));
    }
  }
  ~Client() { ::close(fd_); }

  void Send(const std::string& bytes) {
    ASSERT_EQ(::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL), ssize_t(bytes.size()));
  }
  // Everything until the server closes, or what came within `patience`; *closed says which.
  std::string ReadToEnd(std::chrono::milliseconds patience = 5s, bool* closed = nullptr) {
    std::string got;
    const auto deadline = Clock::now() + patience;
    for (;;) {
      pollfd p{fd_, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0 || ::poll(&p, 1, int(left)) <= 0) break;
      char buffer[65536];
      const ssize_t n = ::recv(fd_, buffer, sizeof buffer, 0);
      if (n <= 0) {
        if (closed) *closed = true;
        return got;
      }
      got.append(buffer, size_t(n));
    }
    if (closed) *closed = false;
    return got;
  }

 private:
  int fd_;
};

std::string Body(const std::string& response) {
  const size_t end = response.find("\r\n\r\n");
  return end == std::string::npos ? "" : response.substr(end + 4);
}

std::vector<HttpRoute> TestRoutes() {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildGauge()
      .Name("meshtrain_train_step")
      .Help("Steps.")
      .Labels({{"job_name", "tiny"}})
      .Register(*registry)
      .Add({})
      .Set(42);
  return MetricsRoutes([registry] { return prometheus::TextSerializer().Serialize(registry->Collect()); });
}


TEST(HttpEndpoint, ServesTheRegistryAndHealth) {
  HttpEndpoint endpoint("127.0.0.1", 0, TestRoutes());
  ASSERT_GT(endpoint.port(), 0);
  {
    Client client(endpoint.port());
    client.Send("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept-Encoding: gzip\r\n\r\n");
    bool closed = false;
    const std::string response = client.ReadToEnd(5s, &closed);
    EXPECT_TRUE(closed) << "Connection: close";
    EXPECT_EQ(response.substr(0, 15), "HTTP/1.1 200 OK") << response;
    EXPECT_NE(response.find("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"), std::string::npos);
    const std::string body = Body(response);
    EXPECT_NE(body.find("# TYPE meshtrain_train_step gauge\n"), std::string::npos) << body;
    EXPECT_NE(body.find("meshtrain_train_step{job_name=\"tiny\"} 42\n"), std::string::npos) << body;
    EXPECT_NE(response.find("Content-Length: " + std::to_string(body.size()) + "\r\n"), std::string::npos);
  }
  Client health(endpoint.port());
  health.Send("GET /healthz HTTP/1.1\r\n\r\n");
  EXPECT_EQ(Body(health.ReadToEnd()), "ok");
}

TEST(HttpEndpoint, AnswersARequestSentByteByByte) {
  HttpEndpoint endpoint("127.0.0.1", 0, TestRoutes());
  Client client(endpoint.port());
  for (char c : std::string("HEAD /healthz HTTP/1.1\r\n\r\n")) client.Send(std::string(1, c));
  const std::string response = client.ReadToEnd();
  EXPECT_EQ(response.substr(0, 15), "HTTP/1.1 200 OK") << response;
  EXPECT_EQ(Body(response), "") << "HEAD has no body";
}

TEST(HttpEndpoint, RefusesGarbageTooLargeHeadsOtherPathsAndMethods) {
  HttpEndpoint endpoint("127.0.0.1", 0, TestRoutes());
  struct Case {
    std::string request, status;
  };
  const Case cases[] = {
      {std::string("\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", 11), "HTTP/1.1 400 Bad Request"},
      {"hello\r\n\r\n", "HTTP/1.1 400 Bad Request"},
      {"GET /metrics HTTP/1.1\r\nX-Filler: " + std::string(16384, 'a') + "\r\n\r\n",
       "HTTP/1.1 431 Request Header Fields Too Large"},
      {"GET /admin HTTP/1.1\r\n\r\n", "HTTP/1.1 404 Not Found"},
      {"DELETE /metrics HTTP/1.1\r\n\r\n", "HTTP/1.1 405 Method Not Allowed"},
      {"POST /healthz HTTP/1.1\r\nContent-Length: 100000\r\n\r\n" + std::string(100000, 'x'),
       "HTTP/1.1 405 Method Not Allowed"},
  };
  for (const Case& c : cases) {
    Client client(endpoint.port());
    client.Send(c.request);
    bool closed = false;
    const std::string response = client.ReadToEnd(5s, &closed);
    EXPECT_EQ(response.substr(0, c.status.size()), c.status) << c.request.substr(0, 40) << "\n" << response;
    EXPECT_TRUE(closed) << c.request.substr(0, 40);
  }
}

TEST(HttpEndpoint, DropsASilentOrSlowClientAndServesOthersMeanwhile) {
  HttpEndpoint endpoint("127.0.0.1", 0, TestRoutes(), {.timeout = 1000ms, .max_connections = 32});
  const auto start = Clock::now();
  Client silent(endpoint.port()), slow(endpoint.port());
  slow.Send("GET /metr");
  Client quick(endpoint.port());
  quick.Send("GET /healthz HTTP/1.1\r\n\r\n");
  EXPECT_EQ(Body(quick.ReadToEnd(2s)), "ok");
  EXPECT_LT(Clock::now() - start, 900ms) << "the quick client waited for the silent one";
  bool closed = false;
  EXPECT_EQ(silent.ReadToEnd(3s, &closed), "");
  EXPECT_TRUE(closed) << "the silent client was not dropped";
  EXPECT_EQ(slow.ReadToEnd(3s, &closed), "");
  EXPECT_TRUE(closed) << "the slow client was not dropped";
  EXPECT_GE(Clock::now() - start, 1000ms);
}

TEST(HttpEndpoint, HoldsAtMostMaxConnectionsAndServesTheRestLater) {
  HttpEndpoint endpoint("127.0.0.1", 0, TestRoutes(), {.timeout = 1000ms, .max_connections = 2});
  Client first(endpoint.port()), second(endpoint.port());
  std::this_thread::sleep_for(200ms);  // both accepted
  Client third(endpoint.port());  // completes in the backlog
  third.Send("GET /healthz HTTP/1.1\r\n\r\n");
  bool closed = false;
  EXPECT_EQ(third.ReadToEnd(300ms, &closed), "") << "answered beyond the limit";
  EXPECT_FALSE(closed);
  EXPECT_EQ(Body(third.ReadToEnd(3s)), "ok") << "not served once the silent ones were dropped";
}

TEST(HttpEndpoint, ListenFailureNamesTheAddress) {
  HttpEndpoint taken("127.0.0.1", 0, TestRoutes());
  try {
    HttpEndpoint again("127.0.0.1", taken.port(), TestRoutes(), {.name = "metrics"});
    FAIL() << "two endpoints listen on one port";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "cannot serve metrics on 127.0.0.1:" + std::to_string(taken.port()) + ": Address already in use");
  }
  try {
    HttpEndpoint named("metrics.invalid", 0, TestRoutes(), {.name = "metrics"});
    FAIL() << "a host name was looked up";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("cannot serve metrics on metrics.invalid:0: ", 0), 0u) << e.what();
  }
  EXPECT_THROW(HttpEndpoint("127.0.0.1", 65536, TestRoutes()), std::runtime_error);
  try {
    HttpEndpoint unnamed("127.0.0.1", taken.port(), TestRoutes());
    FAIL() << "two endpoints listen on one port";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("cannot serve HTTP on 127.0.0.1:", 0), 0u) << e.what();
  }
}

}  // namespace
}  // namespace meshtrain::metrics
