// A minimal HTTP/1.1 server for the test API server: one thread per connection,
// keep-alive, Content-Length or chunked request bodies, and chunked streaming
// responses for watches, in plain HTTP or over TLS (OpenSSL) with optional client
// certificates. It listens on 127.0.0.1 only.
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

typedef struct ssl_st SSL;
typedef struct ssl_ctx_st SSL_CTX;

namespace meshtrain::testing {

struct TlsOptions {
  std::string cert_file, key_file;  // the server's certificate (chain) and key, PEM; empty: plain HTTP
  std::string client_ca_file;       // when set, clients may present certificates signed by this CA
};

struct HttpRequest {
  std::string method;
  std::string path;                          // decoded, without the query
  std::map<std::string, std::string> query;  // decoded
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
  std::string client_common_name;  // of a client certificate the client CA verified; empty if none

  std::string Header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? "" : it->second;
  }
  std::string Query(const std::string& name) const {
    auto it = query.find(name);
    return it == query.end() ? "" : it->second;
  }
};

// One accepted connection, plain or TLS. Not thread-safe: one thread serves it.
class Connection {
 public:
  Connection(int fd, SSL* ssl) : fd_(fd), ssl_(ssl) {}
  // Bytes read into buf (at most n); 0 or less at EOF or on error.
  long Read(char* buf, size_t n);
  bool WriteAll(const std::string& data);
  void Shutdown();

 private:
  int fd_;
  SSL* ssl_;
};

// The connection a handler answers on.
class HttpResponder {
 public:
  explicit HttpResponder(Connection& connection) : connection_(connection) {}
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
  Connection& connection_;
  bool aborted_ = false;
};

using HttpHandler = std::function<void(const HttpRequest&, HttpResponder&)>;

class HttpServer {
 public:
  explicit HttpServer(HttpHandler handler);
  ~HttpServer();
  // Binds 127.0.0.1:port (0 picks a free port) and starts accepting, over TLS if
  // `tls` names a certificate. Returns the port. Throws std::runtime_error naming the
  // port or the file at fault.
  int Start(int port, const TlsOptions& tls = {});
  void Stop();

 private:
  void AcceptLoop();
  void Serve(int fd);

  HttpHandler handler_;
  SSL_CTX* tls_ = nullptr;
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::mutex mu_;
  std::set<int> open_fds_;
  std::vector<std::thread> connections_;
};

std::string UrlDecode(const std::string& text);

}  // namespace meshtrain::testing
