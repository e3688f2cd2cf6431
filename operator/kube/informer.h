// An informer: a cache of one resource type kept current by list-then-watch.
//
// It lists, then watches from the list's resourceVersion with bookmarks. When the
// server ends a watch (its timeout) or the connection drops, it watches again from the
// last resourceVersion it saw, after a backoff when the stream failed. On 410 Gone (as
// an HTTP status or an in-stream ERROR event) it relists and turns the difference
// between the old cache and the new list into add, update and delete events, so
// handlers never miss a change, they only see it late.
//
// Indexes (as client-go's Indexers) file each cached object under the values an index
// function gives it, so that a lookup such as "the pods of job J" costs the objects found,
// not the whole cache.
//
// A transform (as client-go's SetTransform) turns each object into what the cache keeps
// before it is filed, indexed or handed to a handler: the fields the informer's readers
// use, not the whole object, so that a cache of 50,000 nodes holds what placement reads
// and no managedFields, images or annotations. Handlers, indexes and every lookup see
// the transformed object.
//
// Handlers run on the informer's thread, after the cache is updated, one at a time.
// Thread-safe: the cache may be read from any thread.

#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "operator/kube/client.h"
#include "operator/kube/objects.h"

namespace meshtrain::kube {

struct InformerOptions {
  int watch_timeout_seconds = 300;  // the server ends each watch after about this long
  std::chrono::milliseconds min_backoff{200};
  std::chrono::milliseconds max_backoff{30000};
};

struct EventHandler {
  std::function<void(const nlohmann::json& object)> on_add;
  std::function<void(const nlohmann::json& old_object, const nlohmann::json& object)> on_update;
  std::function<void(const nlohmann::json& object)> on_delete;
};

class Informer {
 public:
  Informer(Client& client, ResourceType type, std::string namespace_name, ListOptions selectors,
           InformerOptions options = {});
  ~Informer();
  Informer(const Informer&) = delete;
  Informer& operator=(const Informer&) = delete;

  // The values an object is filed under in an index (none: it is not in the index).
  using IndexFunc = std::function<std::vector<std::string>(const nlohmann::json& object)>;
  // What the cache keeps of an object. It must keep metadata.name, metadata.namespace
  // and metadata.resourceVersion, and anything the indexes and handlers read.
  using TransformFunc = std::function<nlohmann::json(nlohmann::json object)>;

  // Handlers, indexes and the transform must be set before Start().
  void AddHandler(EventHandler handler);
  void AddIndex(const std::string& name, IndexFunc index);
  void SetTransform(TransformFunc transform);
  void Start();
  void Stop();

  bool HasSynced() const { return synced_.load(); }
  // Waits until the first list has filled the cache; false on timeout.
  bool WaitForSync(std::chrono::milliseconds timeout);

  // Lookups by ObjectKey(namespace, name). Copies, so callers never hold the lock.
  std::optional<nlohmann::json> Get(const std::string& key) const;
  std::vector<nlohmann::json> List() const;
  // Copies of the cached objects for which `keep` is true; `keep` runs under the cache's
  // read lock, so it must not call back into this informer.
  std::vector<nlohmann::json> Select(const std::function<bool(const nlohmann::json&)>& keep) const;
  // Copies of the cached objects filed under `value` in index `name`, in key order.
  // REQUIRES: the index was added.
  std::vector<nlohmann::json> ByIndex(const std::string& name, const std::string& value) const;
  // Calls `visit` on every cached object under the read lock (same restriction as Select).
  void ForEach(const std::function<void(const nlohmann::json&)>& visit) const;
  size_t Size() const;
  // Changes every time the cache changes: a cheap way to know a derived value is stale.
  uint64_t version() const { return version_.load(); }

  const ResourceType& type() const { return type_; }
  int64_t relists() const { return relists_.load(); }      // lists after the first one

 private:
  struct Index {
    IndexFunc values;
    std::map<std::string, std::set<std::string>> keys;  // value -> keys of the objects filed under it
  };
  void Run(std::stop_token stop);
  // File or unfile `object` (at `key`) in every index. REQUIRES: mu_ held exclusively.
  void Unindex(const std::string& key, const nlohmann::json& object);
  void Reindex(const std::string& key, const nlohmann::json& object);
  // The object as the cache keeps it (the transform's result, else the object itself).
  nlohmann::json Transformed(nlohmann::json object) const;
  // Makes the cache the listed `items` (already transformed), with an event for each change.
  void Replace(nlohmann::json items);
  void Apply(WatchEvent event);
  bool SleepFor(std::chrono::milliseconds d, std::stop_token& stop);

  Client& client_;
  const ResourceType type_;
  const std::string namespace_;
  const ListOptions selectors_;
  const InformerOptions options_;
  std::vector<EventHandler> handlers_;
  TransformFunc transform_;

  mutable std::shared_mutex mu_;
  std::map<std::string, nlohmann::json> cache_;
  std::map<std::string, Index> indexes_;  // by name
  std::string resource_version_;  // touched by the informer thread only

  std::atomic<uint64_t> version_{0};
  std::atomic<bool> synced_{false};
  std::atomic<int64_t> relists_{0};
  std::mutex sync_mu_;
  std::condition_variable_any sync_cv_;
  std::jthread thread_;
};

}  // namespace meshtrain::kube
