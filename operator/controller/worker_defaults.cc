#include "operator/controller/worker_defaults.h"

#include <stdexcept>

#include "api/manifest.h"

namespace meshtrain::controller {

using nlohmann::json;

namespace {

class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void Fail(const std::string& key, const std::string& what) const {
    throw std::runtime_error(source_ + ": " + key + ": " + what);
  }
  const json& Expect(const json& value, const std::string& key, json::value_t type, const char* name) const {
    const bool ok = value.type() == type || (type == json::value_t::number_integer && value.is_number_unsigned());
    if (!ok) Fail(key, std::string("must be ") + name + ", not " + value.type_name());
    return value;
  }
  std::string String(const json& value, const std::string& key) const {
    return Expect(value, key, json::value_t::string, "a string").get<std::string>();
  }
  void Keys(const json& object, const std::string& key, std::initializer_list<const char*> allowed) const {
    Expect(object, key, json::value_t::object, "a mapping");
    for (const auto& [name, _] : object.items()) {
      bool known = false;
      for (const char* a : allowed) known = known || name == a;
      if (!known) Fail(key.empty() ? name : key + "." + name, "unknown key");
    }
  }

 private:
  std::string source_;
};

api::Toleration DecodeToleration(const Reader& r, const json& t, const std::string& key) {
  r.Keys(t, key, {"key", "operator", "value", "effect", "tolerationSeconds"});
  api::Toleration out;
  if (t.contains("key")) out.key = r.String(t["key"], key + ".key");
  if (t.contains("operator")) out.operator_ = r.String(t["operator"], key + ".operator");
  if (out.operator_ != "Exists" && out.operator_ != "Equal") r.Fail(key + ".operator", "must be Exists or Equal");
  if (t.contains("value")) out.value = r.String(t["value"], key + ".value");
  if (t.contains("effect")) out.effect = r.String(t["effect"], key + ".effect");
  if (t.contains("tolerationSeconds"))
    out.toleration_seconds = r.Expect(t["tolerationSeconds"], key + ".tolerationSeconds", json::value_t::number_integer,
                                      "an integer").get<int64_t>();
  return out;
}

// A list of NetworkPolicyPeer objects at `key`.
json DecodePeers(const Reader& r, const json& value, const std::string& key) {
  const json& peers = r.Expect(value, key, json::value_t::array, "a list");
  for (size_t i = 0; i < peers.size(); ++i) {
    const std::string peer = key + "[" + std::to_string(i) + "]";
    r.Keys(peers[i], peer, {"podSelector", "namespaceSelector", "ipBlock"});
    if (peers[i].empty()) r.Fail(peer, "must name a podSelector, namespaceSelector or ipBlock");
    for (const auto& [field, selector] : peers[i].items())
      r.Expect(selector, peer + "." + field, json::value_t::object, "a mapping");
  }
  return peers;
}

NetworkPolicyDefaults DecodeNetworkPolicy(const Reader& r, const json& object) {
  r.Keys(object, "networkPolicy", {"enabled", "operatorFrom", "metricsFrom", "restrictEgress"});
  NetworkPolicyDefaults out;
  if (object.contains("enabled"))
    out.enabled = r.Expect(object["enabled"], "networkPolicy.enabled", json::value_t::boolean, "true or false").get<bool>();
  if (object.contains("restrictEgress"))
    out.restrict_egress =
        r.Expect(object["restrictEgress"], "networkPolicy.restrictEgress", json::value_t::boolean, "true or false").get<bool>();
  if (object.contains("operatorFrom"))
    out.operator_from = DecodePeers(r, object["operatorFrom"], "networkPolicy.operatorFrom");
  if (object.contains("metricsFrom")) out.metrics_from = DecodePeers(r, object["metricsFrom"], "networkPolicy.metricsFrom");
  return out;
}

}  // namespace

WorkerDefaults ParseWorkerDefaults(const json& object, const std::string& source) {
  const Reader r(source);
  WorkerDefaults d;
  if (object.is_null()) return d;  // an empty file
  r.Keys(object, "",
         {"efaPerInstanceType", "hugepages2Mi", "shmSizeLimit", "efaEnv", "tolerations", "topologyLevels", "networkPolicy"});
  if (object.contains("efaPerInstanceType")) {
    const json& m = r.Expect(object["efaPerInstanceType"], "efaPerInstanceType", json::value_t::object, "a mapping");
    for (const auto& [type, count] : m.items()) {
      const std::string key = "efaPerInstanceType." + type;
      const int64_t n = r.Expect(count, key, json::value_t::number_integer, "an integer").get<int64_t>();
      if (n < 0 || n > 64) r.Fail(key, "must be in [0, 64]");
      d.efa_per_instance_type[type] = n;
    }
  }
  if (object.contains("hugepages2Mi")) d.hugepages_2mi = r.String(object["hugepages2Mi"], "hugepages2Mi");
  if (object.contains("shmSizeLimit")) d.shm_size_limit = r.String(object["shmSizeLimit"], "shmSizeLimit");
  if (object.contains("efaEnv")) {
    const json& list = r.Expect(object["efaEnv"], "efaEnv", json::value_t::array, "a list");
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string key = "efaEnv[" + std::to_string(i) + "]";
      r.Keys(list[i], key, {"name", "value"});
      if (!list[i].contains("name")) r.Fail(key + ".name", "is required");
      d.efa_env.push_back({r.String(list[i]["name"], key + ".name"),
                           list[i].contains("value") ? r.String(list[i]["value"], key + ".value") : ""});
    }
  }
  if (object.contains("tolerations")) {
    const json& list = r.Expect(object["tolerations"], "tolerations", json::value_t::array, "a list");
    for (size_t i = 0; i < list.size(); ++i)
      d.tolerations.push_back(DecodeToleration(r, list[i], "tolerations[" + std::to_string(i) + "]"));
  }
  if (object.contains("topologyLevels")) {
    const json& list = r.Expect(object["topologyLevels"], "topologyLevels", json::value_t::array, "a list");
    for (size_t i = 0; i < list.size(); ++i) {
      d.topology_levels.push_back(r.String(list[i], "topologyLevels[" + std::to_string(i) + "]"));
      if (d.topology_levels.back().empty()) r.Fail("topologyLevels[" + std::to_string(i) + "]", "must not be empty");
    }
  }
  if (object.contains("networkPolicy")) d.network_policy = DecodeNetworkPolicy(r, object["networkPolicy"]);
  return d;
}

WorkerDefaults LoadWorkerDefaults(const std::string& path) {
  const auto documents = api::ReadManifestFile(path);  // throws naming the file
  if (documents.size() > 1) throw std::runtime_error(path + ": one document expected, found " + std::to_string(documents.size()));
  return ParseWorkerDefaults(documents.empty() ? json() : documents[0].object, path);
}

void ApplyWorkerDefaults(const WorkerDefaults& defaults, const json& written, api::TrainingJob* job,
                         std::vector<api::DerivedDefault>* derived) {
  auto& spec = job->spec;
  auto wrote = [&](std::initializer_list<const char*> path) {
    const json* at = &written;
    for (const char* key : path) {
      if (!at->is_object() || !at->contains(key)) return false;
      at = &(*at)[key];
    }
    return true;
  };
  if (!wrote({"resources", "efa"})) {
    const auto selector = spec.template_.node_selector.find(kInstanceTypeLabel);
    if (selector != spec.template_.node_selector.end()) {
      if (auto it = defaults.efa_per_instance_type.find(selector->second); it != defaults.efa_per_instance_type.end()) {
        spec.resources.efa = it->second;
        derived->push_back({"spec.resources.efa", std::to_string(it->second),
                            "the operator's worker defaults for " + selector->second + " nodes"});
      }
    }
  }
  if (!wrote({"template", "tolerations"}) && !defaults.tolerations.empty()) spec.template_.tolerations = defaults.tolerations;
  if (!wrote({"topology", "levels"}) && !defaults.topology_levels.empty() &&
      spec.topology.levels != defaults.topology_levels) {
    spec.topology.levels = defaults.topology_levels;
    if (!wrote({"topology", "requiredLevel"})) {
      const auto& levels = spec.topology.levels;
      spec.topology.required_level = levels[levels.size() >= 2 ? levels.size() - 2 : 0];
    }
    std::string joined;
    for (const auto& l : spec.topology.levels) joined += (joined.empty() ? "" : ",") + l;
    derived->push_back({"spec.topology.levels", joined, "the operator's worker defaults"});
  }
  if (spec.resources.efa > 0) {
    for (const auto& e : defaults.efa_env) {
      bool set = false;
      for (const auto& mine : spec.template_.env) set = set || mine.name == e.name;
      if (!set) spec.template_.env.push_back(e);
    }
  }
}

}  // namespace meshtrain::controller
