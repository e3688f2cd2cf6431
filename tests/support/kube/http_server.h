// A minimal HTTP/1.1 server for the test API server: one thread per connection,
// keep-alive, Content-Length or chunked request bodies, and chunked streaming
// responses for watches. It listens on 127.0.0.1 only.
//
// Thread-safety: the handler is called concurrently from connection threads.

#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace meshtrain::testing {

struct HttpRequest {
  std::string method;
  std::string path;                          // decoded, without the query
  std::map<std::string, std::string> query;  // decoded
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;

  std::string Header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? "" : it->second;
  }
  std::string Query(const std::string& name) const {
    auto it = query.find(name);
    return it == query.end() ? "" : it->second;
  }
};

// The connection a handler answers on.
class HttpResponder {
 public:
  explicit HttpResponder(int fd) : fd_(fd) {}
  // A complete response.
  bool Send(int status, const std::string& content_type, const std::string& body);
  // A streamed response: headers now, then chunks. Each call returns false once the peer is gone.
  bool BeginChunked(int status, const std::string& content_type);
  bool SendChunk(const std::string& data);
  bool EndChunked();
  // Drops the connection without finishing the response, as a failing proxy would.
  void Abort();
  bool aborted() const { return aborted_; }

 private:
  bool WriteAll(const std::string& data);
  int fd_;
  bool aborted_ = false;
};

using HttpHandler = std::function<void(const HttpRequest&, HttpResponder&)>;

class HttpServer {
 public:
  explicit HttpServer(HttpHandler handler);
  ~HttpServer();
  // Binds 127.0.0.1:port (0 picks a free port) and starts accepting. Returns the port.
  int Start(int port);
  void Stop();

 private:
  void AcceptLoop();
  void Serve(int fd);

  HttpHandler handler_;
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::mutex mu_;
  std::set<int> open_fds_;
  std::vector<std::thread> connections_;
};

std::string UrlDecode(const std::string& text);

}  // namespace meshtrain::testing
