#include "tests/support/kube/api_server.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "api/manifest.h"
#include "operator/kube/time.h"
#include "tests/support/kube/protobuf.h"
#include "tests/support/kube/schema_validation.h"

namespace meshtrain::testing {
namespace {

using nlohmann::json;

std::string NewUid() {
  static std::mutex mu;
  static std::mt19937_64 rng(std::random_device{}());
  std::lock_guard lock(mu);
  char buf[40];
  const uint64_t a = rng(), b = rng();
  std::snprintf(buf, sizeof buf, "%08x-%04x-4%03x-a%03x-%012llx", static_cast<unsigned>(a >> 32),
                static_cast<unsigned>(a >> 16) & 0xffff, static_cast<unsigned>(a) & 0xfff,
                static_cast<unsigned>(b >> 52) & 0xfff, static_cast<unsigned long long>(b & 0xffffffffffffULL));
  return buf;
}

std::string ObjKey(const std::string& ns, const std::string& name) { return ns + "/" + name; }

// "5s", "3m20s", "2h": kubectl's human-readable ages.
std::string HumanAge(const std::string& timestamp) {
  const int64_t s = std::max<int64_t>(0, kube::SecondsSince(timestamp));
  if (s < 120) return std::to_string(s) + "s";
  if (s < 600) return std::to_string(s / 60) + "m" + (s % 60 ? std::to_string(s % 60) + "s" : "");
  if (s < 3 * 3600) return std::to_string(s / 60) + "m";
  if (s < 48 * 3600) return std::to_string(s / 3600) + "h";
  return std::to_string(s / 86400) + "d";
}

constexpr const char* kBearerToken = "test-token";

json StatusBody(int code, const std::string& reason, const std::string& message) {
  return {{"kind", "Status"}, {"apiVersion", "v1"}, {"metadata", json::object()}, {"status", "Failure"},
          {"message", message}, {"reason", reason}, {"code", code}};
}

struct HttpError : std::runtime_error {
  HttpError(int c, std::string r, const std::string& m) : std::runtime_error(m), code(c), reason(std::move(r)) {}
  int code;
  std::string reason;
};

// --- selectors ---------------------------------------------------------------------------

struct Requirement {
  std::string key, op;  // op: =, !=, in, notin, exists, !exists
  std::set<std::string> values;
};

std::string Trim(std::string s) {
  while (!s.empty() && s.front() == ' ') s.erase(s.begin());
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

std::vector<Requirement> ParseSelector(const std::string& text) {
  std::vector<Requirement> out;
  size_t i = 0;
  while (i < text.size()) {
    // Split on commas outside parentheses.
    size_t j = i;
    int depth = 0;
    while (j < text.size() && (text[j] != ',' || depth > 0)) {
      if (text[j] == '(') ++depth;
      if (text[j] == ')') --depth;
      ++j;
    }
    std::string term = Trim(text.substr(i, j - i));
    i = j + 1;
    if (term.empty()) continue;
    Requirement r;
    size_t p;
    if (term[0] == '!') {
      r.key = Trim(term.substr(1));
      r.op = "!exists";
    } else if ((p = term.find(" notin ")) != std::string::npos || (p = term.find(" in ")) != std::string::npos) {
      r.op = term.compare(p, 7, " notin ") == 0 ? "notin" : "in";
      r.key = Trim(term.substr(0, p));
      const size_t open = term.find('('), close = term.rfind(')');
      if (open == std::string::npos || close == std::string::npos) throw HttpError(400, "BadRequest", "bad selector: " + term);
      std::istringstream values(term.substr(open + 1, close - open - 1));
      std::string v;
      while (std::getline(values, v, ',')) r.values.insert(Trim(v));
    } else if ((p = term.find("!=")) != std::string::npos) {
      r.key = Trim(term.substr(0, p));
      r.op = "!=";
      r.values.insert(Trim(term.substr(p + 2)));
    } else if ((p = term.find('=')) != std::string::npos) {
      r.key = Trim(term.substr(0, p));
      r.op = "=";
      r.values.insert(Trim(term.substr(term[p + 1] == '=' ? p + 2 : p + 1)));
    } else {
      r.key = term;
      r.op = "exists";
    }
    out.push_back(std::move(r));
  }
  return out;
}

bool Matches(const std::vector<Requirement>& reqs, const std::function<std::optional<std::string>(const std::string&)>& get) {
  for (const auto& r : reqs) {
    const auto v = get(r.key);
    if (r.op == "exists" && !v) return false;
    if (r.op == "!exists" && v) return false;
    if (r.op == "=" && (!v || !r.values.count(*v))) return false;
    if (r.op == "!=" && v && r.values.count(*v)) return false;
    if (r.op == "in" && (!v || !r.values.count(*v))) return false;
    if (r.op == "notin" && v && r.values.count(*v)) return false;
  }
  return true;
}

struct Filter {
  std::vector<Requirement> labels, fields;
  std::string namespace_;
  bool Accepts(const json& object) const {
    const json& meta = object["metadata"];
    if (!namespace_.empty() && meta.value("namespace", "") != namespace_) return false;
    const json labels_json = meta.value("labels", json::object());
    if (!Matches(labels, [&](const std::string& k) -> std::optional<std::string> {
          if (!labels_json.contains(k)) return std::nullopt;
          return labels_json[k].get<std::string>();
        }))
      return false;
    return Matches(fields, [&](const std::string& k) -> std::optional<std::string> {
      if (k == "metadata.name") return meta.value("name", "");
      if (k == "metadata.namespace") return meta.value("namespace", "");
      if (k == "spec.nodeName") return object.contains("spec") ? object["spec"].value("nodeName", "") : "";
      if (k == "status.phase") return object.contains("status") ? object["status"].value("phase", "") : "";
      throw HttpError(400, "BadRequest", "field label not supported: " + k);
    });
  }
};

// --- patches -----------------------------------------------------------------------------

void MergePatch(json& target, const json& patch) {
  if (!patch.is_object()) {
    target = patch;
    return;
  }
  if (!target.is_object()) target = json::object();
  for (auto it = patch.begin(); it != patch.end(); ++it) {
    if (it.value().is_null()) target.erase(it.key());
    else MergePatch(target[it.key()], it.value());
  }
}

// Server-side apply, simplified to one field manager's view: what `applied` names is set
// (maps merge, lists replace), and what the manager's previous apply named but this one
// does not is removed. Fields others wrote and this manager never named stay.
void Apply(json& target, const json& previous, const json& applied) {
  if (!applied.is_object() || !target.is_object()) {
    target = applied;
    return;
  }
  if (previous.is_object()) {
    for (auto it = previous.begin(); it != previous.end(); ++it)
      if (!applied.contains(it.key())) target.erase(it.key());
  }
  for (auto it = applied.begin(); it != applied.end(); ++it) {
    const json none;
    const json& before = previous.is_object() && previous.contains(it.key()) ? previous[it.key()] : none;
    if (target.contains(it.key())) Apply(target[it.key()], before, it.value());
    else target[it.key()] = it.value();
  }
}

// The subset of strategic merge patch that kubectl apply produces: maps merge, lists of
// objects with a `name` merge by name, other lists replace, `$patch: delete` removes, and
// the $setElementOrder / $retainKeys / $deleteFromPrimitiveList directives are honoured
// loosely (ordering and retention are not enforced).
void StrategicMergePatch(json& target, const json& patch) {
  if (!patch.is_object()) {
    target = patch;
    return;
  }
  if (!target.is_object()) target = json::object();
  for (auto it = patch.begin(); it != patch.end(); ++it) {
    const std::string& key = it.key();
    if (key.rfind("$setElementOrder/", 0) == 0 || key == "$retainKeys" || key == "$patch") continue;
    if (key.rfind("$deleteFromPrimitiveList/", 0) == 0) {
      const std::string list = key.substr(25);
      if (target.contains(list) && target[list].is_array()) {
        json kept = json::array();
        for (const auto& v : target[list])
          if (std::find(it.value().begin(), it.value().end(), v) == it.value().end()) kept.push_back(v);
        target[list] = kept;
      }
      continue;
    }
    const json& value = it.value();
    if (value.is_null()) {
      target.erase(key);
    } else if (value.is_object() && value.value("$patch", "") == "delete") {
      target.erase(key);
    } else if (value.is_array() && !value.empty() && value[0].is_object() && value[0].contains("name") &&
               target.contains(key) && target[key].is_array()) {
      json& list = target[key];
      for (const auto& item : value) {
        auto existing = std::find_if(list.begin(), list.end(), [&](const json& e) {
          return e.is_object() && e.value("name", "") == item.value("name", "");
        });
        if (item.value("$patch", "") == "delete") {
          if (existing != list.end()) list.erase(existing);
        } else if (existing != list.end()) {
          StrategicMergePatch(*existing, item);
        } else {
          list.push_back(item);
        }
      }
    } else {
      StrategicMergePatch(target[key], value);
    }
  }
}

json SpecOf(const json& object) {
  json copy = object;
  copy.erase("metadata");
  copy.erase("status");
  return copy;
}

}  // namespace

// --- the store ---------------------------------------------------------------------------

struct ApiServer::Store {
  mutable std::mutex mu;
  mutable std::condition_variable changed;
  std::map<std::string, ResourceInfo> resources;  // by Key()
  std::map<std::string, std::map<std::string, json>> objects;  // resource -> ns/name -> object
  // owner uid -> (resource, ns/name) of each object naming it in ownerReferences
  std::map<std::string, std::set<std::pair<std::string, std::string>>> dependents;

  // Files `object` (at resource/key) under each owner it names, or unfiles it.
  void Link(const std::string& resource, const std::string& key, const json& object, bool add) {
    const json& meta = object["metadata"];
    const auto refs = meta.find("ownerReferences");
    if (refs == meta.end() || !refs->is_array()) return;
    for (const auto& ref : *refs) {
      const std::string uid = ref.value("uid", "");
      if (add) {
        dependents[uid].emplace(resource, key);
        continue;
      }
      auto it = dependents.find(uid);
      if (it == dependents.end()) continue;
      it->second.erase({resource, key});
      if (it->second.empty()) dependents.erase(it);
    }
  }
  uint64_t rv = 1;
  std::deque<StoredEvent> events;
  uint64_t oldest_kept = 1;  // watches from below this get 410
  Faults faults;
  int drop_epoch = 0;
  std::map<std::string, int64_t> requests;  // "client verb" -> count
  std::map<std::string, ServiceAccountRef> tokens;  // issued by TokenRequest
  std::map<std::string, json> applied;  // "resource|ns/name|fieldManager" -> the manager's last server-side apply
  const std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  json created = json::array();  // {kind, key, job, ms}: TrainingJob, Pod and Workload creates; RecordTime's
  size_t history = 0;
  std::string record_dir;
  int record_seq = 0;

  const ResourceInfo* Find(const std::string& group, const std::string& plural) const {
    auto it = resources.find(group + "/" + plural);
    return it == resources.end() ? nullptr : &it->second;
  }

  void Emit(const ResourceInfo& info, const std::string& type, const json& object, json old_object) {
    events.push_back({rv, info.Key(), type, object, std::move(old_object), std::chrono::steady_clock::now()});
    while (events.size() > history) {
      oldest_kept = events.front().seq + 1;
      events.pop_front();
    }
    changed.notify_all();
  }

  // Registers a CRD's resource, or refreshes it on update.
  void RegisterCrd(const json& crd) {
    const json& spec = crd["spec"];
    ResourceInfo info;
    info.custom = true;
    info.group = spec.value("group", "");
    info.plural = spec["names"].value("plural", "");
    info.singular = spec["names"].value("singular", "");
    info.kind = spec["names"].value("kind", "");
    info.short_names = spec["names"].value("shortNames", std::vector<std::string>{});
    info.namespaced = spec.value("scope", "Namespaced") == "Namespaced";
    for (const auto& version : spec.value("versions", json::array())) {
      if (!version.value("storage", false) && !info.version.empty()) continue;
      info.version = version.value("name", "");
      info.schema = version.contains("schema") ? version["schema"].value("openAPIV3Schema", json()) : json();
      info.printer_columns = version.value("additionalPrinterColumns", json::array());
      info.status_subresource = version.contains("subresources") && version["subresources"].contains("status");
    }
    resources[info.Key()] = info;
  }

  json Insert(const ResourceInfo& info, const std::string& ns, json object) {
    json& given = object["metadata"];
    if (!given.contains("name") || given["name"].get<std::string>().empty()) {
      if (given.contains("generateName")) {
        static const char kChars[] = "bcdfghjklmnpqrstvwxz2456789";
        std::string suffix;
        for (int i = 0; i < 5; ++i) suffix += kChars[(rv * 7 + i * 13 + std::hash<std::string>{}(NewUid())) % 27];
        given["name"] = given["generateName"].get<std::string>() + suffix;
      } else {
        throw HttpError(422, "Invalid", info.kind + " is invalid: metadata.name: Required value: name or generateName is required");
      }
    }
    const std::string name = given["name"];
    if (info.namespaced) {
      if (ns.empty()) throw HttpError(400, "BadRequest", "the namespace of the object does not match the namespace on the request");
      if (!objects["/namespaces"].count(ObjKey("", ns)))
        throw HttpError(404, "NotFound", "namespaces \"" + ns + "\" not found");
      given["namespace"] = ns;
    } else {
      given.erase("namespace");
    }
    auto& bucket = objects[info.Key()];
    const std::string key = ObjKey(info.namespaced ? ns : "", name);
    if (bucket.count(key))
      throw HttpError(409, "AlreadyExists", info.plural + (info.group.empty() ? "" : "." + info.group) + " \"" + name + "\" already exists");
    if (!info.schema.is_null()) {
      auto errors = ValidateAgainstSchema(info.schema, object, false);  // replaces `object`: `meta` is stale
      if (!errors.empty()) throw Invalid(info, name, errors);
    }
    object["metadata"]["uid"] = NewUid();
    json& meta = object["metadata"];
    meta["creationTimestamp"] = kube::Rfc3339Now();
    meta["generation"] = 1;
    meta["resourceVersion"] = std::to_string(++rv);
    object["apiVersion"] = info.ApiVersion();
    object["kind"] = info.kind;
    if (info.Key() == "/pods") {
      object["status"] = {{"phase", "Pending"}};
    } else if (info.custom && info.status_subresource) {
      object.erase("status");
    }
    if (info.Key() == "apiextensions.k8s.io/customresourcedefinitions") {
      object["status"] = {{"conditions", json::array({{{"type", "Established"}, {"status", "True"}},
                                                      {{"type", "NamesAccepted"}, {"status", "True"}}})},
                          {"acceptedNames", object["spec"]["names"]}};
      RegisterCrd(object);
    }
    bucket[key] = object;
    Link(info.Key(), key, object, true);
    if (info.kind == "Pod" || info.kind == "TrainingJob" || info.kind == "Workload") {
      const auto labels = object["metadata"].value("labels", json::object());
      created.push_back({{"kind", info.kind},
                         {"key", key},
                         {"job", info.kind == "TrainingJob" ? key : ns + "/" + labels.value("meshtrain.dev/job-name", "")},
                         {"ms", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count()}});
    }
    Emit(info, "ADDED", object, nullptr);
    return object;
  }

  static HttpError Invalid(const ResourceInfo& info, const std::string& name, const std::vector<std::string>& errors) {
    std::string message = info.kind + "." + info.group + " \"" + name + "\" is invalid: ";
    for (size_t i = 0; i < errors.size(); ++i) message += (i ? ", " : "") + errors[i];
    if (errors.size() > 1) message = info.kind + "." + info.group + " \"" + name + "\" is invalid: [" + message.substr(message.find(": ") + 2) + "]";
    return HttpError(422, "Invalid", message);
  }

  // Replaces an object. `status_only`: take only its status; otherwise keep the stored
  // status when the type has a status subresource.
  json Replace(const ResourceInfo& info, const std::string& ns, const std::string& name, json object, bool status_only) {
    auto& bucket = objects[info.Key()];
    const std::string key = ObjKey(info.namespaced ? ns : "", name);
    auto it = bucket.find(key);
    if (it == bucket.end()) throw NotFound(info, name);
    json& current = it->second;
    const std::string given_rv = object["metadata"].value("resourceVersion", "");
    if (!given_rv.empty() && given_rv != current["metadata"]["resourceVersion"].get<std::string>())
      throw HttpError(409, "Conflict", "Operation cannot be fulfilled on " + info.plural + (info.group.empty() ? "" : "." + info.group) + " \"" + name +
                                           "\": the object has been modified; please apply your changes to the latest version and try again");
    json updated;
    if (status_only) {
      updated = current;
      updated["status"] = object.value("status", json::object());
    } else {
      updated = object;
      json& meta = updated["metadata"];
      for (const char* field : {"uid", "creationTimestamp", "generation", "namespace", "name"}) {
        if (current["metadata"].contains(field)) meta[field] = current["metadata"][field];
      }
      if (info.status_subresource || info.Key() == "/pods") {
        if (current.contains("status")) updated["status"] = current["status"];
        else updated.erase("status");
      }
      updated["apiVersion"] = info.ApiVersion();
      updated["kind"] = info.kind;
      if (!info.schema.is_null()) {
        auto errors = ValidateAgainstSchema(info.schema, updated, false);
        if (!errors.empty()) throw Invalid(info, name, errors);
      }
      if (SpecOf(updated) != SpecOf(current))
        updated["metadata"]["generation"] = current["metadata"].value("generation", 1) + 1;
    }
    updated["metadata"]["resourceVersion"] = std::to_string(++rv);
    if (info.Key() == "apiextensions.k8s.io/customresourcedefinitions") RegisterCrd(updated);
    Link(info.Key(), key, current, false);
    Link(info.Key(), key, updated, true);
    json old = std::move(current);
    current = updated;
    Emit(info, "MODIFIED", updated, std::move(old));
    return updated;
  }

  static HttpError NotFound(const ResourceInfo& info, const std::string& name) {
    return HttpError(404, "NotFound", info.plural + (info.group.empty() ? "" : "." + info.group) + " \"" + name + "\" not found");
  }

  // Deletes an object and, transitively, every object that names it as an owner.
  json Remove(const ResourceInfo& info, const std::string& ns, const std::string& name) {
    auto& bucket = objects[info.Key()];
    auto it = bucket.find(ObjKey(info.namespaced ? ns : "", name));
    if (it == bucket.end()) throw NotFound(info, name);
    json object = std::move(it->second);
    Link(info.Key(), it->first, object, false);
    bucket.erase(it);
    object["metadata"]["resourceVersion"] = std::to_string(++rv);
    Emit(info, "DELETED", object, nullptr);
    const std::string uid = object["metadata"].value("uid", "");
    std::vector<std::tuple<const ResourceInfo*, std::string, std::string>> dependents_of;
    if (auto found = dependents.find(uid); found != dependents.end()) {
      for (const auto& [resource, key] : found->second) {
        const json& dependent = objects[resource].at(key);
        dependents_of.emplace_back(&resources.at(resource), dependent["metadata"].value("namespace", ""),
                                   dependent["metadata"].value("name", ""));
      }
    }
    for (const auto& [dep_info, dep_ns, dep_name] : dependents_of) {
      if (objects[dep_info->Key()].count(ObjKey(dep_info->namespaced ? dep_ns : "", dep_name)))
        Remove(*dep_info, dep_ns, dep_name);
    }
    return object;
  }

  // RBAC as the API server evaluates it: the rules of every Role and ClusterRole bound to
  // `who` (RoleBindings of `ns`, and ClusterRoleBindings), matched on API group, resource
  // ("pods" or "trainingjobs/status"), verb and, when a rule names them, resource names.
  bool Allowed(const ServiceAccountRef& who, const std::string& verb, const std::string& group,
               const std::string& resource, const std::string& ns, const std::string& name) const {
    auto has = [](const json& list, const std::string& value) {
      if (!list.is_array()) return false;
      for (const auto& v : list)
        if (v == "*" || v == value) return true;
      return false;
    };
    auto rules_allow = [&](const json& rules) {
      for (const auto& rule : rules) {
        if (!has(rule.value("apiGroups", json::array()), group) || !has(rule.value("resources", json::array()), resource) ||
            !has(rule.value("verbs", json::array()), verb))
          continue;
        const json names = rule.value("resourceNames", json::array());
        if (names.empty() || has(names, name)) return true;
      }
      return false;
    };
    auto binds = [&](const json& binding) {
      for (const auto& s : binding.value("subjects", json::array()))
        if (s.value("kind", "") == "ServiceAccount" && s.value("name", "") == who.name &&
            s.value("namespace", "") == who.namespace_)
          return true;
      return false;
    };
    auto role = [&](const std::string& resource_key, const std::string& role_ns, const std::string& role_name) {
      const auto bucket = objects.find(resource_key);
      if (bucket == objects.end()) return json::array();
      const auto it = bucket->second.find(ObjKey(role_ns, role_name));
      return it == bucket->second.end() ? json::array() : it->second.value("rules", json::array());
    };
    if (auto bucket = objects.find("rbac.authorization.k8s.io/clusterrolebindings"); bucket != objects.end()) {
      for (const auto& [key, binding] : bucket->second)
        if (binds(binding) && rules_allow(role("rbac.authorization.k8s.io/clusterroles", "", binding["roleRef"].value("name", ""))))
          return true;
    }
    if (ns.empty()) return false;
    if (auto bucket = objects.find("rbac.authorization.k8s.io/rolebindings"); bucket != objects.end()) {
      for (const auto& [key, binding] : bucket->second) {
        if (binding["metadata"].value("namespace", "") != ns || !binds(binding)) continue;
        const json& ref = binding["roleRef"];
        const bool cluster = ref.value("kind", "") == "ClusterRole";
        if (rules_allow(role(cluster ? "rbac.authorization.k8s.io/clusterroles" : "rbac.authorization.k8s.io/roles",
                             cluster ? "" : ns, ref.value("name", ""))))
          return true;
      }
    }
    return false;
  }

  void Record(const ResourceInfo& info, const json& object) {
    if (record_dir.empty()) return;
    static const std::set<std::string> recorded = {"/pods", "/services", "/configmaps", "/secrets",
                                                   "networking.k8s.io/networkpolicies"};
    if (!recorded.count(info.Key())) return;
    std::ofstream(record_dir + "/" + info.kind + "-" + std::to_string(++record_seq) + ".json") << object.dump(2);
  }
};

// --- built-in resources ------------------------------------------------------------------

namespace {

std::vector<ResourceInfo> BuiltinResources() {
  auto r = [](std::string group, std::string version, std::string plural, std::string singular, std::string kind,
              bool namespaced, std::vector<std::string> shorts, bool status) {
    ResourceInfo info;
    info.group = std::move(group);
    info.version = std::move(version);
    info.plural = std::move(plural);
    info.singular = std::move(singular);
    info.kind = std::move(kind);
    info.namespaced = namespaced;
    info.short_names = std::move(shorts);
    info.status_subresource = status;
    return info;
  };
  return {
      r("", "v1", "namespaces", "namespace", "Namespace", false, {"ns"}, true),
      r("", "v1", "nodes", "node", "Node", false, {"no"}, true),
      r("", "v1", "pods", "pod", "Pod", true, {"po"}, true),
      r("", "v1", "services", "service", "Service", true, {"svc"}, true),
      r("", "v1", "configmaps", "configmap", "ConfigMap", true, {"cm"}, false),
      r("", "v1", "events", "event", "Event", true, {"ev"}, false),
      r("", "v1", "serviceaccounts", "serviceaccount", "ServiceAccount", true, {"sa"}, false),
      r("", "v1", "secrets", "secret", "Secret", true, {}, false),
      r("apps", "v1", "deployments", "deployment", "Deployment", true, {"deploy"}, true),
      r("networking.k8s.io", "v1", "networkpolicies", "networkpolicy", "NetworkPolicy", true, {"netpol"}, false),
      r("policy", "v1", "poddisruptionbudgets", "poddisruptionbudget", "PodDisruptionBudget", true, {"pdb"}, true),
      r("rbac.authorization.k8s.io", "v1", "clusterroles", "clusterrole", "ClusterRole", false, {}, false),
      r("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "clusterrolebinding", "ClusterRoleBinding", false, {}, false),
      r("rbac.authorization.k8s.io", "v1", "roles", "role", "Role", true, {}, false),
      r("rbac.authorization.k8s.io", "v1", "rolebindings", "rolebinding", "RoleBinding", true, {}, false),
      r("coordination.k8s.io", "v1", "leases", "lease", "Lease", true, {}, false),
      r("apiextensions.k8s.io", "v1", "customresourcedefinitions", "customresourcedefinition",
        "CustomResourceDefinition", false, {"crd", "crds"}, true),
  };
}

json ResourceListEntry(const ResourceInfo& info) {
  json verbs = {"create", "delete", "get", "list", "patch", "update", "watch"};
  json entry = {{"name", info.plural}, {"singularName", info.singular}, {"namespaced", info.namespaced},
                {"kind", info.kind}, {"verbs", verbs}};
  if (!info.short_names.empty()) entry["shortNames"] = info.short_names;
  if (info.custom || info.group == "apps") entry["categories"] = {"all"};
  return entry;
}

// kubectl's default columns for built-in kinds: enough to read `kubectl get` output.
json DefaultColumns(const ResourceInfo& info) {
  json columns = json::array();
  auto column = [&](const std::string& name, const std::string& path, const std::string& type) {
    columns.push_back({{"name", name}, {"jsonPath", path}, {"type", type}});
  };
  if (info.kind == "Pod") {
    column("Status", ".status.phase", "string");
    column("Node", ".spec.nodeName", "string");
  } else if (info.kind == "Node") {
    column("Status", ".status.conditions[?(@.type==\"Ready\")].status", "string");
  } else if (info.kind == "Event") {
    column("Type", ".type", "string");
    column("Reason", ".reason", "string");
    column("Object", ".involvedObject.name", "string");
    column("Message", ".message", "string");
  }
  column("Age", ".metadata.creationTimestamp", "date");
  return columns;
}

// Evaluates the simple JSONPaths printer columns use: .a.b.c, and .list[?(@.k=="v")].f.
json EvalPath(const json& object, const std::string& path) {
  const json* at = &object;
  size_t i = path.empty() || path[0] != '.' ? 0 : 1;
  while (i < path.size()) {
    size_t end = path.find_first_of(".[", i);
    const std::string key = path.substr(i, end == std::string::npos ? std::string::npos : end - i);
    if (!key.empty()) {
      if (!at->is_object() || !at->contains(key)) return nullptr;
      at = &(*at)[key];
    }
    if (end == std::string::npos) break;
    if (path[end] == '[') {
      const size_t close = path.find(']', end);
      const std::string filter = path.substr(end + 1, close - end - 1);  // ?(@.type=="Ready")
      const size_t eq = filter.find("==");
      const std::string field = filter.substr(4, eq - 4);
      std::string want = filter.substr(eq + 2);
      want = want.substr(1, want.size() - 3);
      if (!at->is_array()) return nullptr;
      const json* found = nullptr;
      for (const auto& item : *at)
        if (item.is_object() && item.value(field, "") == want) found = &item;
      if (!found) return nullptr;
      at = found;
      i = close + 1;
    } else {
      i = end;
    }
    if (i < path.size() && path[i] == '.') ++i;
  }
  return *at;
}

json ToTable(const ResourceInfo& info, const std::vector<json>& items, const std::string& rv) {
  json columns = info.printer_columns.is_array() && !info.printer_columns.empty() ? info.printer_columns
                                                                                     : DefaultColumns(info);
  json definitions = json::array({{{"name", "Name"}, {"type", "string"}, {"format", "name"},
                                   {"description", "Name must be unique within a namespace."}, {"priority", 0}}});
  for (const auto& c : columns) {
    definitions.push_back({{"name", c.value("name", "")}, {"type", c.value("type", "string") == "date" ? "string" : c.value("type", "string")},
                           {"format", ""}, {"description", c.value("description", "")}, {"priority", c.value("priority", 0)}});
  }
  json rows = json::array();
  for (const auto& item : items) {
    json cells = json::array({item["metadata"]["name"]});
    for (const auto& c : columns) {
      json v = EvalPath(item, c.value("jsonPath", ""));
      if (c.value("type", "") == "date" && v.is_string()) v = HumanAge(v.get<std::string>());
      cells.push_back(v.is_null() ? json("<none>") : v);
    }
    json meta = {{"name", item["metadata"]["name"]}, {"uid", item["metadata"].value("uid", "")},
                 {"resourceVersion", item["metadata"].value("resourceVersion", "")},
                 {"creationTimestamp", item["metadata"].value("creationTimestamp", "")}};
    if (item["metadata"].contains("namespace")) meta["namespace"] = item["metadata"]["namespace"];
    rows.push_back({{"cells", cells},
                    {"object", {{"kind", "PartialObjectMetadata"}, {"apiVersion", "meta.k8s.io/v1"}, {"metadata", meta}}}});
  }
  return {{"kind", "Table"}, {"apiVersion", "meta.k8s.io/v1"}, {"metadata", {{"resourceVersion", rv}}},
          {"columnDefinitions", definitions}, {"rows", rows}};
}

std::string ClientOf(const HttpRequest& request) {
  const std::string agent = request.Header("user-agent");
  return agent.substr(0, agent.find_first_of("/ "));
}

}  // namespace

// --- the server --------------------------------------------------------------------------

ApiServer::ApiServer(Options options)
    : options_(std::move(options)),
      store_(std::make_unique<Store>()),
      http_([this](const HttpRequest& request, HttpResponder& responder) { Handle(request, responder); }) {
  store_->history = options_.event_history;
  store_->record_dir = options_.record_dir;
  for (auto& info : BuiltinResources()) store_->resources[info.Key()] = info;
  for (const char* ns : {"default", "kube-system"}) Create("/namespaces", "", {{"metadata", {{"name", ns}}}});
}

ApiServer::~ApiServer() { Stop(); }

int ApiServer::Start(int port) {
  port_ = http_.Start(port, options_.tls);
  return port_;
}

void ApiServer::Stop() {
  {
    std::lock_guard lock(store_->mu);
    store_->drop_epoch += 1000000;  // ends every watch
    store_->changed.notify_all();
  }
  http_.Stop();
}

void ApiServer::WriteKubeconfig(const std::string& path) const {
  std::ofstream out(path);
  out << "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: " << Url() << "\n";
  if (!options_.ca_file.empty()) out << "    certificate-authority: " << options_.ca_file << "\n";
  out << "contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n    namespace: default\n"
      << "current-context: test\nusers:\n- name: test\n  user:\n";
  if (options_.client_cert_file.empty()) {
    out << "    token: " << kBearerToken << "\n";
  } else {
    out << "    client-certificate: " << options_.client_cert_file << "\n    client-key: " << options_.client_key_file
        << "\n";
  }
  if (!out) throw std::runtime_error("cannot write kubeconfig " + path);
}

void ApiServer::SetFaults(const Faults& faults) {
  std::lock_guard lock(store_->mu);
  store_->faults = faults;
  store_->drop_epoch += faults.drop_watches > 0 ? 1 : 0;
  store_->changed.notify_all();
}

void ApiServer::AddTestRoute(const std::string& prefix, TestRoute route) {
  std::lock_guard lock(routes_mu_);
  test_routes_[prefix] = std::move(route);
}

json ApiServer::Create(const std::string& resource, const std::string& ns, json object) {
  std::lock_guard lock(store_->mu);
  auto it = store_->resources.find(resource);
  if (it == store_->resources.end()) throw std::runtime_error("unknown resource " + resource);
  return store_->Insert(it->second, ns, std::move(object));
}

std::optional<json> ApiServer::Get(const std::string& resource, const std::string& ns, const std::string& name) const {
  std::lock_guard lock(store_->mu);
  auto bucket = store_->objects.find(resource);
  if (bucket == store_->objects.end()) return std::nullopt;
  auto it = bucket->second.find(ObjKey(ns, name));
  if (it == bucket->second.end()) return std::nullopt;
  return it->second;
}

bool ApiServer::Mutate(const std::string& resource, const std::string& ns, const std::string& name,
                       const std::function<void(json&)>& mutate) {
  std::lock_guard lock(store_->mu);
  auto& bucket = store_->objects[resource];
  auto it = bucket.find(ObjKey(ns, name));
  if (it == bucket.end()) return false;
  json old = it->second;
  store_->Link(resource, it->first, it->second, false);
  mutate(it->second);
  store_->Link(resource, it->first, it->second, true);
  it->second["metadata"]["resourceVersion"] = std::to_string(++store_->rv);
  store_->Emit(store_->resources.at(resource), "MODIFIED", it->second, std::move(old));
  return true;
}

void ApiServer::RecordTime(const std::string& kind, const std::string& key, const std::string& job) {
  std::lock_guard lock(store_->mu);
  store_->created.push_back(
      {{"kind", kind},
       {"key", key},
       {"job", job},
       {"ms", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - store_->started).count()}});
}

std::vector<StoredEvent> ApiServer::EventsSince(uint64_t seq, int timeout_ms) const {
  std::unique_lock lock(store_->mu);
  auto has_new = [&] { return !store_->events.empty() && store_->events.back().seq > seq; };
  store_->changed.wait_for(lock, std::chrono::milliseconds(timeout_ms), has_new);
  auto first = std::upper_bound(store_->events.begin(), store_->events.end(), seq,
                                [](uint64_t s, const StoredEvent& e) { return s < e.seq; });
  return std::vector<StoredEvent>(first, store_->events.end());
}

json ApiServer::Stats() const {
  std::lock_guard lock(store_->mu);
  json by = json::object();
  for (const auto& [k, n] : store_->requests) by[k] = n;
  const Faults& f = store_->faults;
  return {{"requests", by},
          {"resourceVersion", store_->rv},
          {"faultsLeft",
           {{"goneWatches", f.gone_watches}, {"serverErrors", f.server_errors}, {"conflicts", f.conflicts},
            {"throttles", f.throttles}}}};
}

bool ApiServer::Discovery(const HttpRequest& request, HttpResponder& responder) {
  const std::string& path = request.path;
  auto send = [&](const json& body) { responder.Send(200, "application/json", body.dump()); };
  if (path == "/version") {
    send({{"major", "1"}, {"minor", "33"}, {"gitVersion", "v1.33.0-meshtrain-test"}, {"platform", "linux/amd64"}});
    return true;
  }
  std::lock_guard lock(store_->mu);
  if (path == "/api") {
    send({{"kind", "APIVersions"}, {"versions", {"v1"}},
          {"serverAddressByClientCIDRs", {{{"clientCIDR", "0.0.0.0/0"}, {"serverAddress", "127.0.0.1:" + std::to_string(port_)}}}}});
    return true;
  }
  std::map<std::string, std::string> groups;  // group -> version
  for (const auto& [key, info] : store_->resources) groups[info.group] = info.version;
  auto group_doc = [&](const std::string& g) {
    const std::string gv = g + "/" + groups[g];
    return json{{"name", g}, {"versions", {{{"groupVersion", gv}, {"version", groups[g]}}}},
                {"preferredVersion", {{"groupVersion", gv}, {"version", groups[g]}}}};
  };
  if (path == "/apis") {
    json list = json::array();
    for (const auto& [g, v] : groups)
      if (!g.empty()) list.push_back(group_doc(g));
    send({{"kind", "APIGroupList"}, {"apiVersion", "v1"}, {"groups", list}});
    return true;
  }
  auto resource_list = [&](const std::string& group, const std::string& version) {
    json list = json::array();
    for (const auto& [key, info] : store_->resources) {
      if (info.group != group || info.version != version) continue;
      list.push_back(ResourceListEntry(info));
      if (info.status_subresource)
        list.push_back({{"name", info.plural + "/status"}, {"singularName", ""}, {"namespaced", info.namespaced},
                        {"kind", info.kind}, {"verbs", {"get", "patch", "update"}}});
    }
    send({{"kind", "APIResourceList"}, {"apiVersion", "v1"},
          {"groupVersion", group.empty() ? version : group + "/" + version}, {"resources", list}});
  };
  if (path == "/api/v1") {
    resource_list("", "v1");
    return true;
  }
  // OpenAPI v3, as far as kubectl reads it: one PATCH operation per resource that names its
  // kind and accepts fieldValidation, so kubectl validates through the server.
  if (path == "/openapi/v3") {
    json paths = json::object();
    for (const auto& [g, v] : groups) {
      const std::string gv = g.empty() ? "api/" + v : "apis/" + g + "/" + v;
      paths[gv] = {{"serverRelativeURL", "/openapi/v3/" + gv}};
    }
    send({{"paths", paths}});
    return true;
  }
  if (path.rfind("/openapi/v3/", 0) == 0) {
    const std::string gv = path.substr(12);
    json paths = json::object();
    for (const auto& [key, info] : store_->resources) {
      const std::string own = info.group.empty() ? "api/" + info.version : "apis/" + info.group + "/" + info.version;
      if (own != gv) continue;
      const json parameters = json::array({{{"name", "fieldValidation"}, {"in", "query"}, {"schema", {{"type", "string"}}}}});
      const std::string at = "/" + gv + (info.namespaced ? "/namespaces/{namespace}/" : "/") + info.plural + "/{name}";
      paths[at] = {{"parameters", parameters},
                   {"patch", {{"operationId", "patch" + info.kind},
                              {"parameters", parameters},
                              {"x-kubernetes-action", "patch"},
                              {"x-kubernetes-group-version-kind",
                               {{"group", info.group}, {"version", info.version}, {"kind", info.kind}}}}}};
    }
    if (paths.empty()) return false;
    send({{"openapi", "3.0.0"}, {"info", {{"title", "meshtrain test API server"}, {"version", "v1.33.0"}}},
          {"paths", paths}, {"components", {{"schemas", json::object()}}}});
    return true;
  }
  if (path.rfind("/apis/", 0) == 0) {
    std::vector<std::string> parts;
    std::istringstream s(path.substr(6));
    std::string part;
    while (std::getline(s, part, '/')) parts.push_back(part);
    if (parts.size() == 1 && groups.count(parts[0]) && !parts[0].empty()) {
      json doc = group_doc(parts[0]);
      doc["kind"] = "APIGroup";
      doc["apiVersion"] = "v1";
      send(doc);
      return true;
    }
    if (parts.size() == 2 && groups.count(parts[0]) && groups[parts[0]] == parts[1]) {
      resource_list(parts[0], parts[1]);
      return true;
    }
  }
  return false;
}

void ApiServer::Handle(const HttpRequest& request, HttpResponder& responder) {
  auto fail = [&](int code, const std::string& reason, const std::string& message) {
    responder.Send(code, "application/json", StatusBody(code, reason, message).dump());
  };
  // Who asks: a ServiceAccount, by a token issued to it, or else the admin (the
  // kubeconfig's token or certificate; over plain HTTP, also no token at all).
  std::optional<ServiceAccountRef> account;
  const std::string authorization = request.Header("authorization");
  const bool admin_token = authorization == std::string("Bearer ") + kBearerToken;
  if (authorization.rfind("Bearer ", 0) == 0 && !admin_token) {
    std::lock_guard lock(store_->mu);
    auto it = store_->tokens.find(authorization.substr(7));
    if (it == store_->tokens.end()) return fail(401, "Unauthorized", "the bearer token was not issued by this server");
    account = it->second;
  } else if (!options_.tls.cert_file.empty() && !admin_token && request.client_common_name.empty()) {
    return fail(401, "Unauthorized", "no valid bearer token or client certificate");
  }
  const std::string user = account ? "system:serviceaccount:" + account->namespace_ + ":" + account->name : "";
  if (account && request.path.rfind("/_test/", 0) == 0)
    return fail(403, "Forbidden", "User \"" + user + "\" cannot use the test routes");
  if (request.path.rfind("/_test/", 0) == 0) {
    if (request.path == "/_test/faults" && request.method == "POST") {
      const json f = json::parse(request.body, nullptr, false);
      Faults faults;
      faults.drop_watches = f.value("dropWatches", 0);
      faults.gone_watches = f.value("goneWatches", 0);
      faults.server_errors = f.value("serverErrors", 0);
      faults.conflicts = f.value("conflicts", 0);
      faults.conflict_path = f.value("conflictPath", "");
      faults.throttles = f.value("throttles", 0);
      faults.latency_ms = f.value("latencyMs", 0);
      faults.watch_delay_ms = f.value("watchDelayMs", 0);
      faults.watch_delay_resource = f.value("watchDelayResource", "");
      SetFaults(faults);
      responder.Send(200, "application/json", "{}");
      return;
    }
    if (request.path == "/_test/stats") {
      responder.Send(200, "application/json", Stats().dump());
      return;
    }
    if (request.path == "/_test/created") {
      std::lock_guard lock(store_->mu);
      responder.Send(200, "application/json", store_->created.dump());
      return;
    }
    std::lock_guard lock(routes_mu_);
    for (const auto& [prefix, route] : test_routes_) {
      if (request.path.rfind(prefix, 0) == 0) {
        route(request, responder);
        return;
      }
    }
    fail(404, "NotFound", "no test route " + request.path);
    return;
  }

  const bool is_watch = request.Query("watch") == "true" || request.Query("watch") == "1";
  int latency_ms;
  {
    std::lock_guard lock(store_->mu);
    const std::string verb = is_watch ? "watch" : request.method;
    store_->requests[ClientOf(request) + " " + verb]++;
    latency_ms = store_->faults.latency_ms;
    if (!is_watch && request.path.rfind("/api", 0) == 0 && request.path != "/api" && request.path != "/apis") {
      if (store_->faults.server_errors > 0) {
        store_->faults.server_errors--;
        responder.Send(500, "application/json", StatusBody(500, "InternalError", "injected server error").dump());
        return;
      }
      if (store_->faults.throttles > 0) {
        store_->faults.throttles--;
        responder.Send(429, "application/json", StatusBody(429, "TooManyRequests", "injected throttling").dump());
        return;
      }
      const std::string& only = store_->faults.conflict_path;
      const bool path_matches = only.empty() || (request.path.size() >= only.size() &&
                                                 request.path.compare(request.path.size() - only.size(), only.size(), only) == 0);
      if ((request.method == "PUT" || request.method == "PATCH") && store_->faults.conflicts > 0 && path_matches) {
        store_->faults.conflicts--;
        fail(409, "Conflict", "injected conflict: the object has been modified; please apply your changes to the latest version and try again");
        return;
      }
    }
  }
  if (latency_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(latency_ms));

  try {
    HttpRequest decoded;
    if (request.method != "DELETE" &&  // a DELETE's body (DeleteOptions) is not read here
        request.Header("content-type").rfind(kProtobufContentType, 0) == 0) {
      // A typed client's protobuf body, as JSON; its answer is JSON, which it also accepts.
      try {
        decoded = request;
        decoded.body = DecodeKubernetesProtobuf(request.body).dump();
        decoded.headers["content-type"] = "application/json";
      } catch (const std::runtime_error& e) {
        throw HttpError(415, "UnsupportedMediaType", e.what());
      }
    }
    const HttpRequest& req = decoded.method.empty() ? request : decoded;
    if (request.method == "GET" && Discovery(request, responder)) return;
    // /api/v1/... or /apis/G/V/..., then [namespaces/NS/]PLURAL[/NAME[/SUB]].
    std::vector<std::string> parts;
    {
      std::istringstream s(request.path);
      std::string part;
      while (std::getline(s, part, '/'))
        if (!part.empty()) parts.push_back(part);
    }
    std::string group;
    size_t i;
    if (parts.size() >= 2 && parts[0] == "api") {
      i = 2;
    } else if (parts.size() >= 3 && parts[0] == "apis") {
      group = parts[1];
      i = 3;
    } else {
      fail(404, "NotFound", "the server could not find the requested resource");
      return;
    }
    std::string ns;
    if (parts.size() >= i + 3 && parts[i] == "namespaces") {
      ns = parts[i + 1];
      i += 2;
    }
    if (parts.size() <= i) {
      fail(404, "NotFound", "the server could not find the requested resource");
      return;
    }
    ResourceInfo info;
    {
      std::lock_guard lock(store_->mu);
      const ResourceInfo* found = store_->Find(group, parts[i]);
      if (!found) {
        fail(404, "NotFound", "the server could not find the requested resource");
        return;
      }
      info = *found;
    }
    const std::string name = parts.size() > i + 1 ? parts[i + 1] : "";
    const std::string sub = parts.size() > i + 2 ? parts[i + 2] : "";
    if (!info.namespaced) ns.clear();
    if (account) {
      const std::string verb = request.method == "GET"     ? (name.empty() ? (is_watch ? "watch" : "list") : "get")
                               : request.method == "POST"  ? "create"
                               : request.method == "PUT"   ? "update"
                               : request.method == "PATCH" ? "patch"
                               : name.empty()              ? "deletecollection"
                                                           : "delete";
      const std::string resource = sub.empty() ? info.plural : info.plural + "/" + sub;
      bool allowed;
      {
        std::lock_guard lock(store_->mu);
        allowed = store_->Allowed(*account, verb, info.group, resource, ns, name);
      }
      if (!allowed) {
        throw HttpError(403, "Forbidden",
                        resource + (name.empty() ? "" : " \"" + name + "\"") + " is forbidden: User \"" + user +
                            "\" cannot " + verb + " resource \"" + resource + "\" in API group \"" + info.group + "\" " +
                            (ns.empty() ? "at the cluster scope" : "in the namespace \"" + ns + "\""));
      }
    }
    if (is_watch && request.method == "GET" && name.empty()) {
      Watch(request, responder, info, ns);
      return;
    }
    HandleResource(req, responder, info, ns, name, sub);
  } catch (const HttpError& e) {
    fail(e.code, e.reason, e.what());
  } catch (const json::exception& e) {
    fail(400, "BadRequest", std::string("malformed JSON: ") + e.what());
  }
}

void ApiServer::HandleResource(const HttpRequest& request, HttpResponder& responder, const ResourceInfo& info,
                               const std::string& ns, const std::string& name, const std::string& sub) {
  const bool table = request.Header("accept").find("as=Table") != std::string::npos;
  auto send = [&](int code, const json& body) { responder.Send(code, "application/json", body.dump()); };
  if (info.Key() == "/serviceaccounts" && sub == "token" && request.method == "POST") {
    // TokenRequest: a token that authenticates as the account (it does not expire here).
    std::lock_guard lock(store_->mu);
    if (!store_->objects["/serviceaccounts"].count(ObjKey(ns, name))) throw Store::NotFound(info, name);
    const std::string token = "sa." + ns + "." + name + "." + NewUid();
    store_->tokens[token] = {ns, name};
    send(201, {{"apiVersion", "authentication.k8s.io/v1"},
               {"kind", "TokenRequest"},
               {"metadata", {{"name", name}, {"namespace", ns}}},
               {"spec", {{"audiences", json::array()}}},
               {"status", {{"token", token}, {"expirationTimestamp", "2099-01-01T00:00:00Z"}}}});
    return;
  }
  if (!sub.empty() && !(sub == "status" && info.status_subresource))
    throw HttpError(404, "NotFound", "the server could not find the requested resource");
  const bool strict = request.Query("fieldValidation") == "Strict";
  std::lock_guard lock(store_->mu);
  const std::string client = ClientOf(request);
  if (request.method == "GET" && name.empty()) {
    Filter filter{ParseSelector(request.Query("labelSelector")), ParseSelector(request.Query("fieldSelector")), ns};
    std::vector<json> items;
    for (const auto& [key, object] : store_->objects[info.Key()])
      if (filter.Accepts(object)) items.push_back(object);
    const std::string rv = std::to_string(store_->rv);
    if (table) return send(200, ToTable(info, items, rv)), void();
    send(200, {{"kind", info.kind + "List"}, {"apiVersion", info.ApiVersion()}, {"metadata", {{"resourceVersion", rv}}},
               {"items", items}});
    return;
  }
  if (request.method == "POST" && name.empty()) {
    json object = json::parse(request.body);
    if (!object.is_object()) throw HttpError(400, "BadRequest", "the body must be a JSON object");
    if (!info.schema.is_null() && strict) {
      json copy = object;
      auto errors = ValidateAgainstSchema(info.schema, copy, true);
      if (!errors.empty()) throw Store::Invalid(info, object["metadata"].value("name", ""), errors);
    }
    json created = store_->Insert(info, ns, std::move(object));
    if (client == "meshtrain-operator") store_->Record(info, created);
    send(201, created);
    return;
  }
  if (name.empty()) throw HttpError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource");
  const std::string key = ObjKey(ns, name);
  auto& bucket = store_->objects[info.Key()];
  if (request.method == "GET") {
    auto it = bucket.find(key);
    if (it == bucket.end()) throw Store::NotFound(info, name);
    if (table) return send(200, ToTable(info, {it->second}, std::to_string(store_->rv))), void();
    send(200, it->second);
    return;
  }
  if (request.method == "PUT") {
    json object = json::parse(request.body);
    json updated = store_->Replace(info, ns, name, std::move(object), sub == "status");
    if (client == "meshtrain-operator") store_->Record(info, updated);
    send(200, updated);
    return;
  }
  if (request.method == "PATCH" && request.Header("content-type").rfind("application/apply-patch", 0) == 0) {
    json object = json::parse(request.body, nullptr, false);
    if (object.is_discarded()) {  // YAML, as the content type allows
      const auto documents = api::ParseManifestText(request.body, "apply patch");
      if (documents.size() != 1) throw HttpError(400, "BadRequest", "an apply patch must be one object");
      object = documents[0].object;
    }
    const std::string manager = request.Query("fieldManager");
    if (manager.empty()) throw HttpError(422, "Invalid", "fieldManager is required for apply patch");
    json& previous = store_->applied[info.Key() + "|" + key + "|" + manager];
    auto it = bucket.find(key);
    if (it == bucket.end()) {
      object["metadata"]["name"] = name;
      json created = store_->Insert(info, ns, object);
      previous = object;
      send(201, created);
      return;
    }
    json patched = it->second;
    Apply(patched, previous, object);
    patched["metadata"]["resourceVersion"] = it->second["metadata"]["resourceVersion"];
    json updated = store_->Replace(info, ns, name, std::move(patched), sub == "status");
    previous = object;
    send(200, updated);
    return;
  }
  if (request.method == "PATCH") {
    auto it = bucket.find(key);
    if (it == bucket.end()) throw Store::NotFound(info, name);
    const json patch = json::parse(request.body);
    const std::string type = request.Header("content-type");
    json patched = it->second;
    if (type.rfind("application/merge-patch+json", 0) == 0) {
      MergePatch(patched, patch);
    } else if (type.rfind("application/strategic-merge-patch+json", 0) == 0) {
      StrategicMergePatch(patched, patch);
    } else {
      throw HttpError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json");
    }
    if (!patch.contains("metadata") || !patch["metadata"].contains("resourceVersion"))
      patched["metadata"]["resourceVersion"] = it->second["metadata"]["resourceVersion"];
    send(200, store_->Replace(info, ns, name, std::move(patched), sub == "status"));
    return;
  }
  if (request.method == "DELETE") {
    // The object goes at once: no kubelet here confirms a pod's end. A forced deletion
    // (DeleteOptions gracePeriodSeconds 0) is counted as its own verb, for tests.
    const json options = json::parse(request.body.empty() ? "{}" : request.body, nullptr, false);
    if (options.is_object() && options.value("gracePeriodSeconds", int64_t{-1}) == 0)
      store_->requests[client + " DELETE-force"]++;  // under the store's lock, held above
    json removed = store_->Remove(info, ns, name);
    send(200, removed);
    return;
  }
  throw HttpError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource");
}

void ApiServer::Watch(const HttpRequest& request, HttpResponder& responder, const ResourceInfo& info,
                      const std::string& ns) {
  const Filter filter{ParseSelector(request.Query("labelSelector")), ParseSelector(request.Query("fieldSelector")), ns};
  const bool bookmarks = request.Query("allowWatchBookmarks") == "true";
  const int timeout_s = request.Query("timeoutSeconds").empty() ? 1800 : std::stoi(request.Query("timeoutSeconds"));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  const std::string from = request.Query("resourceVersion");

  auto line = [](const std::string& type, const json& object) {
    return json{{"type", type}, {"object", object}}.dump() + "\n";
  };
  std::vector<std::string> initial;
  uint64_t cursor;
  int epoch;
  bool gone = false;
  {
    std::lock_guard lock(store_->mu);
    epoch = store_->drop_epoch;
    if (store_->faults.gone_watches > 0) {
      store_->faults.gone_watches--;
      gone = true;
    }
    if (from.empty() || from == "0") {
      // No version: the current state as ADDED events, then changes.
      for (const auto& [key, object] : store_->objects[info.Key()])
        if (filter.Accepts(object)) initial.push_back(line("ADDED", object));
      cursor = store_->rv;
    } else {
      cursor = std::stoull(from);
      if (cursor + 1 < store_->oldest_kept) gone = true;
    }
  }
  if (!responder.BeginChunked(200, "application/json")) return;
  if (gone) {
    responder.SendChunk(line("ERROR", StatusBody(410, "Expired", "too old resource version: " + from)));
    responder.EndChunked();
    return;
  }
  for (const auto& l : initial)
    if (!responder.SendChunk(l)) return;

  auto last_sent = std::chrono::steady_clock::now();
  const auto bookmark_every = std::chrono::milliseconds(options_.bookmark_interval_ms);
  uint64_t examined = cursor;  // events up to here were sent, or were not due yet
  auto next_due = std::chrono::steady_clock::time_point::max();  // of the first event held back
  for (;;) {
    std::vector<std::string> out;
    {
      std::unique_lock lock(store_->mu);
      const auto wake = std::min({deadline, last_sent + bookmark_every, next_due});
      store_->changed.wait_until(lock, wake, [&] {
        return store_->drop_epoch != epoch || (!store_->events.empty() && store_->events.back().seq > examined);
      });
      if (store_->drop_epoch != epoch) {
        lock.unlock();
        responder.Abort();
        return;
      }
      const Faults& faults = store_->faults;
      const auto delay = faults.watch_delay_resource.empty() || faults.watch_delay_resource == info.plural
                             ? std::chrono::milliseconds(faults.watch_delay_ms)
                             : std::chrono::milliseconds(0);
      if (cursor + 1 < store_->oldest_kept) {  // a lagging watch fell out of the history
        lock.unlock();
        responder.SendChunk(line("ERROR", StatusBody(410, "Expired", "too old resource version: " + std::to_string(cursor))));
        responder.EndChunked();
        return;
      }
      const auto now = std::chrono::steady_clock::now();
      next_due = std::chrono::steady_clock::time_point::max();
      auto first = std::upper_bound(store_->events.begin(), store_->events.end(), cursor,
                                    [](uint64_t c, const StoredEvent& e) { return c < e.seq; });
      for (auto ev_it = first; ev_it != store_->events.end(); ++ev_it) {
        const StoredEvent& ev = *ev_it;
        if (delay.count() > 0 && ev.at + delay > now) {
          next_due = ev.at + delay;
          break;
        }
        cursor = ev.seq;
        if (ev.resource != info.Key()) continue;
        const bool now_matches = filter.Accepts(ev.object);
        const bool was_matching = !ev.old_object.is_null() && filter.Accepts(ev.old_object);
        if (now_matches) out.push_back(line(ev.type == "MODIFIED" && !was_matching ? "ADDED" : ev.type, ev.object));
        else if (was_matching) out.push_back(line("DELETED", ev.object));
      }
      examined = store_->events.empty() ? cursor : store_->events.back().seq;
      if (out.empty() && bookmarks && now >= last_sent + bookmark_every) {
        out.push_back(line("BOOKMARK", {{"kind", info.kind}, {"apiVersion", info.ApiVersion()},
                                        {"metadata", {{"resourceVersion", std::to_string(cursor)}}}}));
      }
    }
    for (const auto& l : out) {
      if (!responder.SendChunk(l)) return;
    }
    if (!out.empty()) last_sent = std::chrono::steady_clock::now();
    if (std::chrono::steady_clock::now() >= deadline) {
      responder.EndChunked();
      return;
    }
  }
}

}  // namespace meshtrain::testing
