#include "operator/kube/client.h"

#include <mutex>
#include <thread>

#include <cpprest/http_client.h>
#include <cpprest/containerstream.h>

namespace meshtrain::kube {
namespace {

using nlohmann::json;
namespace http = web::http;

std::string Encode(const std::string& value) { return web::uri::encode_data_string(value); }

http::client::http_client_config MakeHttpConfig(const KubeConfig& config, std::chrono::seconds timeout) {
  http::client::http_client_config http_config;
  http_config.set_timeout(timeout);
  http_config.set_validate_certificates(!config.insecure_skip_tls_verify);
  const std::string ca = config.ca_pem, cert = config.client_cert_pem, key = config.client_key_pem;
  if (!ca.empty() || !cert.empty()) {
    http_config.set_ssl_context_callback([ca, cert, key](boost::asio::ssl::context& ctx) {
      if (!ca.empty()) ctx.add_certificate_authority(boost::asio::buffer(ca.data(), ca.size()));
      if (!cert.empty()) {
        ctx.use_certificate_chain(boost::asio::buffer(cert.data(), cert.size()));
        ctx.use_private_key(boost::asio::buffer(key.data(), key.size()), boost::asio::ssl::context::pem);
      }
    });
  }
  return http_config;
}

// Builds a List object from its text, each of its items (the elements of the top-level
// "items" array) replaced by transform(item) as soon as the item is parsed, so that a
// list of 50,000 whole objects is never held at once. A SAX handler for
// nlohmann::json::sax_parse; a container's place is stable while it is open, since its
// parent takes no other element until it closes.
class TransformingListParser {
 public:
  explicit TransformingListParser(const std::function<json(json)>& transform) : transform_(transform) {}

  json& result() { return root_; }

  bool null() { return Value(nullptr); }
  bool boolean(bool b) { return Value(b); }
  bool number_integer(json::number_integer_t n) { return Value(n); }
  bool number_unsigned(json::number_unsigned_t n) { return Value(n); }
  bool number_float(json::number_float_t x, const json::string_t&) { return Value(x); }
  bool string(json::string_t& s) { return Value(std::move(s)); }
  bool binary(json::binary_t& b) { return Value(json::binary(b)); }
  bool start_object(std::size_t) { return Open(json::object()); }
  bool key(json::string_t& k) {
    key_ = std::move(k);
    return true;
  }
  bool end_object() { return Close(); }
  bool start_array(std::size_t) { return Open(json::array()); }
  bool end_array() { return Close(); }
  bool parse_error(std::size_t, const std::string&, const json::exception&) { return false; }

 private:
  // Puts `value` where the parse is: the root, the next element of the open array, or the
  // open object's member under the last key (a repeated key keeps the last value).
  json* Place(json value) {
    if (open_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(value));
      return &parent.back();
    }
    json& slot = parent[key_];
    slot = std::move(value);
    return &slot;
  }
  bool Value(json value) {
    json* placed = Place(std::move(value));
    if (!open_.empty() && open_.back() == items_) *placed = transform_(std::move(*placed));
    return true;
  }
  bool Open(json container) {
    const bool items = container.is_array() && open_.size() == 1 && root_.is_object() && key_ == "items";
    open_.push_back(Place(std::move(container)));
    if (items) items_ = open_.back();
    return true;
  }
  bool Close() {
    json* done = open_.back();
    open_.pop_back();
    if (!open_.empty() && open_.back() == items_) *done = transform_(std::move(*done));
    return true;
  }

  const std::function<json(json)>& transform_;
  json root_;
  std::vector<json*> open_;  // the containers being parsed, outermost first
  json* items_ = nullptr;    // the list's "items" array, once open
  std::string key_;
};

// The KubeError for a non-2xx response, from its Status body when it has one.
KubeError ErrorFromResponse(const std::string& verb, const std::string& path, int code, const std::string& body) {
  std::string reason, message = body;
  if (auto status = json::parse(body, nullptr, false); status.is_object()) {
    reason = status.value("reason", "");
    message = status.value("message", body);
  }
  if (message.size() > 2000) message.resize(2000);
  return KubeError(ErrorKindForStatus(code), code, reason, message,
                   verb + " " + path + ": " + std::to_string(code) + (reason.empty() ? "" : " " + reason) + ": " +
                       message);
}

}  // namespace

struct Client::Impl {
  Impl(const KubeConfig& config, const ClientOptions& options)
      : http(config.server, MakeHttpConfig(config, options.request_timeout)) {}
  http::client::http_client http;
  std::mutex observer_mu;
  RequestObserver observer;
};

std::string WithQuery(const std::string& path, const ListOptions& options, const std::string& extra) {
  std::string query;
  auto add = [&](const std::string& kv) { query += (query.empty() ? "?" : "&") + kv; };
  if (!options.label_selector.empty()) add("labelSelector=" + Encode(options.label_selector));
  if (!options.field_selector.empty()) add("fieldSelector=" + Encode(options.field_selector));
  if (!options.resource_version.empty()) add("resourceVersion=" + Encode(options.resource_version));
  if (!extra.empty()) add(extra);
  return path + query;
}

Client::Client(KubeConfig config, ClientOptions options)
    : config_(std::move(config)),
      options_(std::move(options)),
      bucket_(options_.qps, options_.burst),
      impl_(std::make_unique<Impl>(config_, options_)) {}

Client::~Client() = default;

void Client::SetRequestObserver(RequestObserver observer) {
  std::lock_guard lock(impl_->observer_mu);
  impl_->observer = std::move(observer);
}

http::http_request Client::NewRequest(const std::string& method, const std::string& path) {
  bucket_.Wait();
  http::http_request request(method);
  request.set_request_uri(path);
  request.headers().add("Accept", "application/json");
  request.headers().add("User-Agent", options_.user_agent);
  if (!config_.token.empty()) request.headers().add("Authorization", "Bearer " + config_.token);
  return request;
}

void Client::Observe(const std::string& verb, int code, std::chrono::steady_clock::time_point sent) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
  std::lock_guard lock(impl_->observer_mu);
  if (impl_->observer) impl_->observer(verb, code, seconds);
}

json Client::Request(const std::string& verb, const std::string& method, const std::string& path, const json* body,
                     const std::string& content_type, const std::function<json(json)>* list_item) {
  const std::string payload = body ? body->dump() : std::string();
  auto backoff = options_.initial_backoff;
  for (int attempt = 0;; ++attempt) {
    http::http_request request = NewRequest(method, path);
    if (body) request.set_body(payload, content_type);
    const auto sent = std::chrono::steady_clock::now();
    int code = 0;
    std::string text;
    std::chrono::milliseconds retry_after{0};
    std::optional<KubeError> error;
    try {
      http::http_response response = impl_->http.request(request).get();
      code = response.status_code();
      text = response.extract_utf8string(true).get();
      if (code == 429 && response.headers().has("Retry-After")) {
        try {
          retry_after = std::chrono::seconds(std::stoi(response.headers().find("Retry-After")->second));
        } catch (const std::exception&) {
        }
      }
    } catch (const std::exception& e) {
      error.emplace(ErrorKind::kUnavailable, 0, "", e.what(), verb + " " + path + ": no response: " + e.what());
    }
    Observe(verb, code, sent);
    if (!error && code >= 200 && code < 300) {
      if (text.empty()) return json::object();
      json parsed;
      if (list_item) {
        TransformingListParser parser(*list_item);
        if (json::sax_parse(text, &parser)) parsed = std::move(parser.result());
        else parsed = json::value_t::discarded;
      } else {
        parsed = json::parse(text, nullptr, false);
      }
      if (parsed.is_discarded())
        throw KubeError(ErrorKind::kOther, code, "", "response is not JSON", verb + " " + path + ": response is not JSON");
      return parsed;
    }
    if (!error) error.emplace(ErrorFromResponse(verb, path, code, text));
    if (!error->retryable() || attempt >= options_.max_retries) throw *error;
    std::this_thread::sleep_for(std::max<std::chrono::milliseconds>(backoff, retry_after));
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

json Client::Get(const ResourceType& type, const std::string& ns, const std::string& name) {
  return Request("get", "GET", type.Path(ns, name), nullptr, "");
}

json Client::List(const ResourceType& type, const std::string& ns, const ListOptions& options) {
  return Request("list", "GET", WithQuery(type.Path(ns), options), nullptr, "");
}

json Client::List(const ResourceType& type, const std::string& ns, const ListOptions& options,
                  const std::function<json(json)>& item_transform) {
  if (!item_transform) return List(type, ns, options);
  return Request("list", "GET", WithQuery(type.Path(ns), options), nullptr, "", &item_transform);
}

json Client::Create(const ResourceType& type, const std::string& ns, const json& object) {
  return Request("create", "POST", type.Path(ns), &object, "application/json");
}

json Client::Update(const ResourceType& type, const std::string& ns, const json& object) {
  return Request("update", "PUT", type.Path(ns, object["metadata"]["name"].get<std::string>()), &object,
                 "application/json");
}

json Client::UpdateStatus(const ResourceType& type, const std::string& ns, const json& object) {
  return Request("update", "PUT", type.Path(ns, object["metadata"]["name"].get<std::string>()) + "/status", &object,
                 "application/json");
}

json Client::MergePatch(const ResourceType& type, const std::string& ns, const std::string& name, const json& patch,
                        bool status_subresource) {
  return Request("patch", "PATCH", type.Path(ns, name) + (status_subresource ? "/status" : ""), &patch,
                 "application/merge-patch+json");
}

void Client::Delete(const ResourceType& type, const std::string& ns, const std::string& name,
                    const std::string& propagation, std::optional<int64_t> grace_period_seconds) {
  json options = {{"kind", "DeleteOptions"}, {"apiVersion", "v1"}, {"propagationPolicy", propagation}};
  if (grace_period_seconds) options["gracePeriodSeconds"] = *grace_period_seconds;
  Request("delete", "DELETE", type.Path(ns, name), &options, "application/json");
}

void Client::Watch(const ResourceType& type, const std::string& ns, const ListOptions& options, int timeout_seconds,
                   const std::function<bool(const WatchEvent&)>& on_event, std::stop_token stop) {
  const std::string path = WithQuery(type.Path(ns), options,
                                     "watch=true&allowWatchBookmarks=true&timeoutSeconds=" + std::to_string(timeout_seconds));
  // The idle timeout covers the stream's quiet periods: the server sends bookmarks well inside it.
  http::client::http_client stream_client(config_.server,
                                          MakeHttpConfig(config_, std::chrono::seconds(timeout_seconds + 30)));
  pplx::cancellation_token_source cancel;
  std::stop_callback on_stop(stop, [&cancel] { cancel.cancel(); });

  http::http_request request = NewRequest("GET", path);
  const auto sent = std::chrono::steady_clock::now();
  http::http_response response;
  try {
    response = stream_client.request(request, cancel.get_token()).get();
  } catch (const std::exception& e) {
    Observe("watch", 0, sent);
    if (stop.stop_requested()) return;
    throw KubeError(ErrorKind::kUnavailable, 0, "", e.what(), "watch " + path + ": no response: " + e.what());
  }
  Observe("watch", response.status_code(), sent);
  if (response.status_code() != 200)
    throw ErrorFromResponse("watch", path, response.status_code(), response.extract_utf8string(true).get());

  auto body = response.body();
  try {
    while (!stop.stop_requested()) {
      concurrency::streams::container_buffer<std::string> line;
      body.read_line(line).get();
      const std::string& text = line.collection();
      if (text.empty()) {
        if (body.is_eof()) return;
        continue;
      }
      json event = json::parse(text, nullptr, false);
      if (!event.is_object() || !event.contains("type"))
        throw KubeError(ErrorKind::kOther, 200, "", "malformed watch event", "watch " + path + ": malformed event");
      WatchEvent ev{event["type"].get<std::string>(), std::move(event["object"])};
      if (ev.type == "ERROR") {
        const int code = ev.object.value("code", 500);
        throw ErrorFromResponse("watch", path, code, ev.object.dump());
      }
      if (!on_event(ev)) return;
    }
  } catch (const KubeError&) {
    throw;
  } catch (const std::exception& e) {
    if (stop.stop_requested()) return;
    throw KubeError(ErrorKind::kUnavailable, 0, "", e.what(), "watch " + path + ": stream broke: " + e.what());
  }
}

}  // namespace meshtrain::kube
