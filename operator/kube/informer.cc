#include "operator/kube/informer.h"

#include <spdlog/spdlog.h>

namespace meshtrain::kube {

using nlohmann::json;

Informer::Informer(Client& client, ResourceType type, std::string namespace_name, ListOptions selectors,
                   InformerOptions options)
    : client_(client),
      type_(std::move(type)),
      namespace_(std::move(namespace_name)),
      selectors_(std::move(selectors)),
      options_(options) {}

Informer::~Informer() { Stop(); }

void Informer::AddHandler(EventHandler handler) { handlers_.push_back(std::move(handler)); }

void Informer::AddIndex(const std::string& name, IndexFunc index) { indexes_[name].values = std::move(index); }

void Informer::SetTransform(TransformFunc transform) { transform_ = std::move(transform); }

void Informer::Unindex(const std::string& key, const json& object) {
  for (auto& [name, index] : indexes_) {
    for (const std::string& value : index.values(object)) {
      auto it = index.keys.find(value);
      if (it == index.keys.end()) continue;
      it->second.erase(key);
      if (it->second.empty()) index.keys.erase(it);
    }
  }
}

void Informer::Reindex(const std::string& key, const json& object) {
  for (auto& [name, index] : indexes_) {
    for (const std::string& value : index.values(object)) index.keys[value].insert(key);
  }
}

void Informer::Start() {
  thread_ = std::jthread([this](std::stop_token stop) { Run(stop); });
}

void Informer::Stop() {
  if (!thread_.joinable()) return;
  thread_.request_stop();
  sync_cv_.notify_all();
  thread_.join();
}

bool Informer::WaitForSync(std::chrono::milliseconds timeout) {
  std::unique_lock lock(sync_mu_);
  return sync_cv_.wait_for(lock, timeout, [this] { return synced_.load(); });
}

std::optional<json> Informer::Get(const std::string& key) const {
  std::shared_lock lock(mu_);
  auto it = cache_.find(key);
  if (it == cache_.end()) return std::nullopt;
  return it->second;
}

std::vector<json> Informer::List() const {
  std::shared_lock lock(mu_);
  std::vector<json> out;
  out.reserve(cache_.size());
  for (const auto& [key, object] : cache_) out.push_back(object);
  return out;
}

std::vector<json> Informer::Select(const std::function<bool(const json&)>& keep) const {
  std::shared_lock lock(mu_);
  std::vector<json> out;
  for (const auto& [key, object] : cache_)
    if (keep(object)) out.push_back(object);
  return out;
}

std::vector<json> Informer::ByIndex(const std::string& name, const std::string& value) const {
  std::shared_lock lock(mu_);
  std::vector<json> out;
  const Index& index = indexes_.at(name);
  const auto it = index.keys.find(value);
  if (it == index.keys.end()) return out;
  out.reserve(it->second.size());
  for (const std::string& key : it->second) out.push_back(cache_.at(key));
  return out;
}

void Informer::ForEach(const std::function<void(const json&)>& visit) const {
  std::shared_lock lock(mu_);
  for (const auto& [key, object] : cache_) visit(object);
}

size_t Informer::Size() const {
  std::shared_lock lock(mu_);
  return cache_.size();
}

bool Informer::SleepFor(std::chrono::milliseconds d, std::stop_token& stop) {
  std::unique_lock lock(sync_mu_);
  sync_cv_.wait_for(lock, stop, d, [] { return false; });
  return !stop.stop_requested();
}

json Informer::Transformed(json object) const {
  if (!transform_) return object;
  return transform_(std::move(object));
}

void Informer::Replace(json items) {
  // The items come transformed (Run lists through the transform), so the list's whole
  // objects and the cache's kept ones are never all held at once.
  std::map<std::string, json> fresh;
  if (items.is_array()) {
    for (json& item : items) {
      std::string key = KeyOf(item);
      fresh.emplace(std::move(key), std::move(item));
    }
  }
  items = nullptr;
  // The handlers run after the lock is released, on this thread, the only one that
  // changes the cache: they read the new objects in place, and the old ones from `old`.
  std::map<std::string, json> old;
  std::vector<std::pair<const json*, const json*>> updated;  // (old, new); old null for adds
  std::vector<const json*> deleted;
  {
    std::unique_lock lock(mu_);
    old = std::move(cache_);
    cache_ = std::move(fresh);
    for (const auto& [key, object] : cache_) {
      auto it = old.find(key);
      if (it == old.end()) {
        updated.emplace_back(nullptr, &object);
      } else if (it->second["metadata"].value("resourceVersion", "") != object["metadata"].value("resourceVersion", "")) {
        updated.emplace_back(&it->second, &object);
      }
    }
    for (const auto& [key, object] : old) {
      if (!cache_.count(key)) deleted.push_back(&object);
    }
    for (auto& [name, index] : indexes_) index.keys.clear();
    for (const auto& [key, object] : cache_) Reindex(key, object);
    ++version_;
  }
  for (const auto& h : handlers_) {
    for (const auto& [old_object, object] : updated) {
      if (!old_object) {
        if (h.on_add) h.on_add(*object);
      } else if (h.on_update) {
        h.on_update(*old_object, *object);
      }
    }
    for (const json* object : deleted) {
      if (h.on_delete) h.on_delete(*object);
    }
  }
}

void Informer::Apply(WatchEvent event) {
  const std::string rv = event.object["metadata"].value("resourceVersion", "");
  if (!rv.empty()) resource_version_ = rv;
  if (event.type == "BOOKMARK") return;
  const json object = Transformed(std::move(event.object));
  const std::string key = KeyOf(object);
  json old_object;
  {
    std::unique_lock lock(mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      Unindex(key, it->second);
      old_object = std::move(it->second);
    }
    if (event.type == "DELETED") {
      if (it != cache_.end()) cache_.erase(it);
    } else {
      if (it != cache_.end()) it->second = object;
      else cache_.emplace(key, object);
      Reindex(key, object);
    }
    ++version_;
  }
  for (const auto& h : handlers_) {
    if (event.type == "DELETED") {
      if (h.on_delete) h.on_delete(object);
    } else if (old_object.is_null()) {
      if (h.on_add) h.on_add(object);
    } else if (h.on_update) {
      h.on_update(old_object, object);
    }
  }
}

void Informer::Run(std::stop_token stop) {
  auto backoff = options_.min_backoff;
  bool first_list = true;
  while (!stop.stop_requested()) {
    try {
      // Each item is transformed as it is parsed.
      json list = client_.List(type_, namespace_, selectors_, transform_);
      resource_version_ = list["metadata"].value("resourceVersion", "");
      json items = list.contains("items") ? std::move(list["items"]) : json::array();
      list = nullptr;
      Replace(std::move(items));
      if (!first_list) ++relists_;
      first_list = false;
      {
        std::lock_guard lock(sync_mu_);
        synced_ = true;
      }
      sync_cv_.notify_all();
    } catch (const std::exception& e) {
      spdlog::warn("informer {}: list failed, retrying in {} ms: {}", type_.plural, backoff.count(), e.what());
      if (!SleepFor(backoff, stop)) return;
      backoff = std::min(backoff * 2, options_.max_backoff);
      continue;
    }
    // Watch until 410 forces a relist.
    while (!stop.stop_requested()) {
      ListOptions options = selectors_;
      options.resource_version = resource_version_;
      try {
        client_.Watch(type_, namespace_, options, options_.watch_timeout_seconds,
                      [this](const WatchEvent& event) {
                        Apply(event);
                        return true;
                      },
                      stop);
        backoff = options_.min_backoff;  // a clean end: the server's timeout
      } catch (const KubeError& e) {
        if (e.kind() == ErrorKind::kGone) {
          spdlog::info("informer {}: resourceVersion {} expired, relisting", type_.plural, resource_version_);
          break;
        }
        spdlog::warn("informer {}: watch failed, reconnecting in {} ms: {}", type_.plural, backoff.count(), e.what());
        if (!SleepFor(backoff, stop)) return;
        backoff = std::min(backoff * 2, options_.max_backoff);
      }
    }
  }
}

}  // namespace meshtrain::kube
