#include "tests/support/kube/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <signal.h>

#include <cstring>
#include <sstream>
#include <stdexcept>

namespace meshtrain::testing {
namespace {

const char* StatusText(int status) {
  switch (status) {
    case 200: return "OK";
    case 201: return "Created";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 406: return "Not Acceptable";
    case 409: return "Conflict";
    case 410: return "Gone";
    case 415: return "Unsupported Media Type";
    case 422: return "Unprocessable Entity";
    case 429: return "Too Many Requests";
    case 500: return "Internal Server Error";
    default: return "Status";
  }
}

// Reads into buf until it holds `needle` or `want` bytes. False on EOF or error.
bool ReadUntil(Connection& connection, std::string& buf, const std::string& needle, size_t want) {
  char chunk[16384];
  while ((needle.empty() || buf.find(needle) == std::string::npos) && (needle.size() || buf.size() < want)) {
    const long n = connection.Read(chunk, sizeof chunk);
    if (n <= 0) return false;
    buf.append(chunk, static_cast<size_t>(n));
    if (buf.size() > (64u << 20)) return false;
  }
  return true;
}

std::string OpenSslError() {
  char text[256] = "unknown error";
  if (const unsigned long code = ERR_get_error(); code != 0) ERR_error_string_n(code, text, sizeof text);
  return text;
}

}  // namespace

long Connection::Read(char* buf, size_t n) {
  if (ssl_ != nullptr) return SSL_read(ssl_, buf, static_cast<int>(n));
  return ::recv(fd_, buf, n, 0);
}

bool Connection::WriteAll(const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    const long n = ssl_ != nullptr ? SSL_write(ssl_, data.data() + off, static_cast<int>(data.size() - off))
                                   : ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

void Connection::Shutdown() { ::shutdown(fd_, SHUT_RDWR); }

std::string UrlDecode(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '%' && i + 2 < text.size()) {
      out.push_back(static_cast<char>(std::stoi(text.substr(i + 1, 2), nullptr, 16)));
      i += 2;
    } else if (text[i] == '+') {
      out.push_back(' ');
    } else {
      out.push_back(text[i]);
    }
  }
  return out;
}

bool HttpResponder::WriteAll(const std::string& data) { return !aborted_ && connection_.WriteAll(data); }

bool HttpResponder::Send(int status, const std::string& content_type, const std::string& body) {
  std::ostringstream head;
  head << "HTTP/1.1 " << status << " " << StatusText(status) << "\r\nContent-Type: " << content_type
       << "\r\nContent-Length: " << body.size() << "\r\n\r\n";
  return WriteAll(head.str() + body);
}

bool HttpResponder::BeginChunked(int status, const std::string& content_type) {
  std::ostringstream head;
  head << "HTTP/1.1 " << status << " " << StatusText(status) << "\r\nContent-Type: " << content_type
       << "\r\nTransfer-Encoding: chunked\r\n\r\n";
  return WriteAll(head.str());
}

bool HttpResponder::SendChunk(const std::string& data) {
  char size[32];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  return WriteAll(size + data + "\r\n");
}

bool HttpResponder::EndChunked() { return WriteAll("0\r\n\r\n"); }

void HttpResponder::Abort() {
  aborted_ = true;
  connection_.Shutdown();
}

HttpServer::HttpServer(HttpHandler handler) : handler_(std::move(handler)) {}

HttpServer::~HttpServer() {
  Stop();
  if (tls_ != nullptr) SSL_CTX_free(tls_);
}

int HttpServer::Start(int port, const TlsOptions& tls) {
  if (!tls.cert_file.empty()) {
    ::signal(SIGPIPE, SIG_IGN);  // OpenSSL writes with write(2), which raises SIGPIPE on a closed peer
    tls_ = SSL_CTX_new(TLS_server_method());
    if (SSL_CTX_use_certificate_chain_file(tls_, tls.cert_file.c_str()) != 1)
      throw std::runtime_error("test API server: certificate " + tls.cert_file + ": " + OpenSslError());
    if (SSL_CTX_use_PrivateKey_file(tls_, tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1)
      throw std::runtime_error("test API server: key " + tls.key_file + ": " + OpenSslError());
    if (!tls.client_ca_file.empty()) {
      if (SSL_CTX_load_verify_locations(tls_, tls.client_ca_file.c_str(), nullptr) != 1)
        throw std::runtime_error("test API server: client CA " + tls.client_ca_file + ": " + OpenSslError());
      SSL_CTX_set_client_CA_list(tls_, SSL_load_client_CA_file(tls.client_ca_file.c_str()));
      SSL_CTX_set_verify(tls_, SSL_VERIFY_PEER, nullptr);  // a certificate is asked for, not required
    }
  }
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listen_fd_, 512) != 0)
    throw std::runtime_error("test API server: cannot listen on 127.0.0.1:" + std::to_string(port) + ": " +
                             std::strerror(errno));
  socklen_t len = sizeof addr;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  acceptor_ = std::thread([this] { AcceptLoop(); });
  return ntohs(addr.sin_port);
}

void HttpServer::Stop() {
  if (stopping_.exchange(true)) return;
  if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(mu_);
    for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);
    threads.swap(connections_);
  }
  for (auto& t : threads) t.join();
}

void HttpServer::AcceptLoop() {
  while (!stopping_) {
    const int fd = ::accept(listen_fd_, nullptr, nullptr);
    if (fd < 0) {
      if (stopping_) return;
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::lock_guard lock(mu_);
    open_fds_.insert(fd);
    connections_.emplace_back([this, fd] { Serve(fd); });
  }
}

void HttpServer::Serve(int fd) {
  SSL* ssl = nullptr;
  bool open = true;
  std::string client_common_name;
  if (tls_ != nullptr) {
    ssl = SSL_new(tls_);
    SSL_set_fd(ssl, fd);
    open = SSL_accept(ssl) == 1;  // a client that does not trust us gives up here
    if (X509* peer = open ? SSL_get_peer_certificate(ssl) : nullptr) {
      char name[256] = "";
      if (SSL_get_verify_result(ssl) == X509_V_OK)
        X509_NAME_get_text_by_NID(X509_get_subject_name(peer), NID_commonName, name, sizeof name);
      client_common_name = name;
      X509_free(peer);
    }
  }
  Connection connection(fd, ssl);
  std::string buf;
  while (open && !stopping_) {
    if (!ReadUntil(connection, buf, "\r\n\r\n", 0)) break;
    const size_t header_end = buf.find("\r\n\r\n");
    std::istringstream head(buf.substr(0, header_end));
    buf.erase(0, header_end + 4);
    HttpRequest request;
    request.client_common_name = client_common_name;
    std::string target, version, line;
    std::getline(head, line);
    std::istringstream(line) >> request.method >> target >> version;
    while (std::getline(head, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      const size_t colon = line.find(':');
      if (colon == std::string::npos) continue;
      std::string name = line.substr(0, colon);
      for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      size_t v = colon + 1;
      while (v < line.size() && line[v] == ' ') ++v;
      request.headers[name] = line.substr(v);
    }
    const size_t q = target.find('?');
    request.path = UrlDecode(target.substr(0, q));
    if (q != std::string::npos) {
      std::istringstream query(target.substr(q + 1));
      std::string kv;
      while (std::getline(query, kv, '&')) {
        const size_t eq = kv.find('=');
        request.query[UrlDecode(kv.substr(0, eq))] = eq == std::string::npos ? "" : UrlDecode(kv.substr(eq + 1));
      }
    }
    if (request.Header("transfer-encoding") == "chunked") {
      for (bool more = true; more && open;) {
        open = ReadUntil(connection, buf, "\r\n", 0);
        if (!open) break;
        const size_t eol = buf.find("\r\n");
        const size_t size = std::stoul(buf.substr(0, eol), nullptr, 16);
        buf.erase(0, eol + 2);
        open = ReadUntil(connection, buf, "", size + 2);
        if (!open) break;
        request.body += buf.substr(0, size);
        buf.erase(0, size + 2);
        more = size != 0;
      }
      if (!open) break;
    } else if (const std::string cl = request.Header("content-length"); !cl.empty()) {
      const size_t size = std::stoul(cl);
      if (!ReadUntil(connection, buf, "", size)) break;
      request.body = buf.substr(0, size);
      buf.erase(0, size);
    }
    HttpResponder responder(connection);
    handler_(request, responder);
    if (responder.aborted() || request.Header("connection") == "close") break;
  }
  connection.Shutdown();
  if (ssl != nullptr) SSL_free(ssl);
  std::lock_guard lock(mu_);
  open_fds_.erase(fd);
  ::close(fd);
}

}  // namespace meshtrain::testing
