#include "operator/scheduler/cluster.h"

#include <algorithm>
#include <charconv>
#include <set>

#include "api/json_fields.h"
#include "api/manifest.h"

namespace meshtrain::scheduler {

using api::json_fields::Is;
using Json = nlohmann::json;

template <Is<Taint> S, class V>
void Fields(S& s, V& v) {
  v("key", s.key);
  v("value", s.value);
  v("effect", s.effect);
}

template <Is<ClusterNode> S, class V>
void Fields(S& s, V& v) {
  v("name", s.name);
  v("labels", s.labels);
  v("gpus", s.gpus);
  v("gpusUsed", s.gpus_used);
  v("efa", s.efa);
  v("efaUsed", s.efa_used);
  v("taints", s.taints);
  v("ready", s.ready);
  v("schedulable", s.schedulable);
}

template <Is<ClusterSnapshot> S, class V>
void Fields(S& s, V& v) {
  v("nodes", s.nodes);
}

namespace {

// Sorts by name and rejects duplicates and impossible counts.
ClusterSnapshot Finish(ClusterSnapshot snapshot, const std::string& source) {
  std::sort(snapshot.nodes.begin(), snapshot.nodes.end(),
            [](const ClusterNode& a, const ClusterNode& b) { return a.name < b.name; });
  for (size_t i = 0; i < snapshot.nodes.size(); ++i) {
    const ClusterNode& n = snapshot.nodes[i];
    if (n.name.empty()) throw ClusterError(source + ": a node has no name");
    if (i > 0 && snapshot.nodes[i - 1].name == n.name) throw ClusterError(source + ": node " + n.name + " is listed twice");
    if (n.gpus < 0 || n.gpus_used < 0 || n.efa < 0 || n.efa_used < 0) {
      throw ClusterError(source + ": node " + n.name + " has a negative GPU or EFA count");
    }
  }
  return snapshot;
}

// A Kubernetes quantity for a countable resource: "8" or 8. Extended resources are whole numbers.
int64_t Count(const Json& quantity, const std::string& where) {
  if (quantity.is_number_integer()) return quantity.get<int64_t>();
  if (quantity.is_string()) {
    const std::string s = quantity.get<std::string>();
    int64_t value = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
    if (ec == std::errc() && end == s.data() + s.size() && value >= 0) return value;
  }
  throw ClusterError(where + ": expected a whole number, got " + api::DescribeJson(quantity));
}


const Json& Items(const Json& list, const char* what) {
  static const Json kEmpty = Json::array();
  if (list.is_null()) return kEmpty;
  if (!list.is_object() || !list.contains("items") || !list["items"].is_array()) {
    throw ClusterError(std::string(what) + ": expected a kubectl list with \"items\"");
  }
  return list["items"];
}

}  // namespace

int64_t ResourceQuantity(const Json& resources, const char* name, const std::string& where) {
  if (!resources.is_object() || !resources.contains(name)) return 0;
  return Count(resources[name], where + "." + name);
}

int64_t PodRequest(const Json& spec, const char* resource, const std::string& where) {
  auto request = [&](const Json& container, const std::string& at) {
    const Json& r = container.value("resources", Json::object());
    // Extended resources set limits; requests default to them.
    const int64_t req = ResourceQuantity(r.value("requests", Json::object()), resource, at + ".resources.requests");
    return req > 0 ? req : ResourceQuantity(r.value("limits", Json::object()), resource, at + ".resources.limits");
  };
  int64_t sum = 0, init = 0;
  for (const Json& c : spec.value("containers", Json::array())) sum += request(c, where + ".containers");
  for (const Json& c : spec.value("initContainers", Json::array())) init = std::max(init, request(c, where + ".initContainers"));
  return std::max(sum, init);
}


ClusterNode NodeFromKubectl(const Json& item) try {
  ClusterNode node;
  const Json& meta = item.value("metadata", Json::object());
  node.name = meta.value("name", "");
  const std::string where = "node " + node.name;
  const Json labels = meta.value("labels", Json::object());  // items() must not outlive it
  for (const auto& [key, value] : labels.items()) {
    if (value.is_string()) node.labels[key] = value.get<std::string>();
  }
  const Json& status = item.value("status", Json::object());
  const Json& allocatable = status.value("allocatable", Json::object());
  node.gpus = ResourceQuantity(allocatable, "nvidia.com/gpu", where + " status.allocatable");
  node.efa = ResourceQuantity(allocatable, "vpc.amazonaws.com/efa", where + " status.allocatable");
  node.ready = false;
  for (const Json& c : status.value("conditions", Json::array())) {
    if (c.value("type", "") == "Ready") node.ready = c.value("status", "") == "True";
  }
  const Json& spec = item.value("spec", Json::object());
  node.schedulable = !spec.value("unschedulable", false);
  for (const Json& t : spec.value("taints", Json::array())) {
    node.taints.push_back({t.value("key", ""), t.value("value", ""), t.value("effect", "")});
  }
  return node;
} catch (const Json::exception& e) {  // a field of the wrong JSON type
  throw ClusterError(std::string("node has an unexpected shape: ") + e.what());
}

ClusterSnapshot SnapshotFromKubectl(const Json& node_list, const Json& pod_list) try {
  ClusterSnapshot snapshot;
  std::map<std::string, size_t> index;
  for (const Json& item : Items(node_list, "nodes")) {
    ClusterNode node = NodeFromKubectl(item);
    index[node.name] = snapshot.nodes.size();
    snapshot.nodes.push_back(std::move(node));
  }
  for (const Json& pod : Items(pod_list, "pods")) {
    const Json& spec = pod.value("spec", Json::object());
    const std::string phase = pod.value("status", Json::object()).value("phase", "");
    auto it = index.find(spec.value("nodeName", ""));
    if (it == index.end() || phase == "Succeeded" || phase == "Failed") continue;
    const std::string where = "pod " + pod.value("metadata", Json::object()).value("namespace", "") + "/" +
                              pod.value("metadata", Json::object()).value("name", "") + " spec";
    snapshot.nodes[it->second].gpus_used += PodRequest(spec, "nvidia.com/gpu", where);
    snapshot.nodes[it->second].efa_used += PodRequest(spec, "vpc.amazonaws.com/efa", where);
  }
  return Finish(std::move(snapshot), "kubectl output");
} catch (const Json::exception& e) {  // a field of the wrong JSON type
  throw ClusterError(std::string("kubectl output has an unexpected shape: ") + e.what());
}

ClusterSnapshot SnapshotFromDescription(const Json& description, const std::string& source) {
  api::FieldErrors errors;
  ClusterSnapshot snapshot = api::json_fields::Decode<ClusterSnapshot>(description, "", &errors);
  if (!errors.empty()) throw ClusterError(source + ": " + errors.front().ToString());
  return Finish(std::move(snapshot), source);
}

ClusterSnapshot ReadClusterFile(const std::string& path) {
  std::vector<api::ManifestDocument> documents;
  try {
    documents = api::ReadManifestFile(path);
  } catch (const api::ManifestError& e) {
    throw ClusterError(e.what());
  }
  const std::string name = api::ManifestSourceName(path);
  if (documents.size() != 1) throw ClusterError(name + ": expected one cluster description document");
  return SnapshotFromDescription(documents[0].object, name);
}

ClusterSnapshot ReadKubectlFiles(const std::string& nodes_path, const std::string& pods_path) {
  // kubectl prints a `kind: List` (which ReadManifestFile expands into its items) or a
  // NodeList/PodList; either way, gather the objects into one list.
  auto read = [](const std::string& path) -> Json {
    if (path.empty()) return nullptr;
    Json list = {{"items", Json::array()}};
    try {
      for (api::ManifestDocument& doc : api::ReadManifestFile(path)) {
        const Json* kind = doc.object.is_object() && doc.object.contains("kind") ? &doc.object["kind"] : nullptr;
        const bool is_list = doc.object.is_object() && (doc.object.contains("items") ||
                                                        (kind != nullptr && kind->is_string() &&
                                                         kind->get<std::string>().ends_with("List")));
        if (is_list) {
          if (!doc.object.contains("items") || !doc.object["items"].is_array()) {
            throw ClusterError(api::ManifestSourceName(path) + ": document " + std::to_string(doc.index + 1) +
                               " is a list whose \"items\" is not an array");
          }
          for (Json& item : doc.object["items"]) list["items"].push_back(std::move(item));
        } else {
          list["items"].push_back(std::move(doc.object));
        }
      }
    } catch (const api::ManifestError& e) {
      throw ClusterError(e.what());
    }
    return list;
  };
  const Json nodes = read(nodes_path);
  const Json pods = read(pods_path);
  try {
    return SnapshotFromKubectl(nodes, pods);
  } catch (const ClusterError& e) {
    throw ClusterError(api::ManifestSourceName(nodes_path) + ": " + e.what());
  }
}

Json ToDescription(const ClusterSnapshot& snapshot) { return api::json_fields::Encode(snapshot); }

}  // namespace meshtrain::scheduler
