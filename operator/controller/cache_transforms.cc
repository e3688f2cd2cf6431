#include "operator/controller/cache_transforms.h"

#include <initializer_list>

namespace meshtrain::controller {

using nlohmann::json;

namespace {

// The named fields of `from` (an object), moved into a new object; absent ones stay absent.
json Take(json& from, std::initializer_list<const char*> names) {
  json out = json::object();
  for (const char* name : names) {
    auto it = from.find(name);
    if (it != from.end()) out[name] = std::move(*it);
  }
  return out;
}

// Sets out[name] to what `keep` makes of from[name] when it is of the expected shape
// (`keep` is called only then), to from[name] as it came when not, and leaves it
// absent when from has no such field.
template <typename F>
void Keep(json& from, const char* name, json& out, bool (json::*shape)() const noexcept, F keep) {
  auto it = from.find(name);
  if (it == from.end()) return;
  out[name] = ((*it).*shape)() ? keep(*it) : std::move(*it);
}

// Each element of `array` as `keep` makes it when it is an object, else as it came.
template <typename F>
json EachObject(json& array, F keep) {
  json out = json::array();
  for (json& element : array) out.push_back(element.is_object() ? keep(element) : std::move(element));
  return out;
}

// The Ready conditions' type and status: all that kube::ConditionTrue and
// scheduler::NodeFromKubectl read. A condition of another type (a string) is dropped; one
// of an unexpected shape is kept, so that its reader fails on it as it would have.
json ReadyConditions(json& conditions) {
  json out = json::array();
  for (json& c : conditions) {
    if (!c.is_object()) {
      out.push_back(std::move(c));
      continue;
    }
    const auto type = c.find("type");
    if (type != c.end() && type->is_string() && type->get_ref<const std::string&>() != "Ready") continue;
    out.push_back(Take(c, {"type", "status"}));
  }
  return out;
}

}  // namespace

json NodeForCache(json node) {
  if (!node.is_object()) return node;
  json out = json::object();
  Keep(node, "metadata", out, &json::is_object,
       [](json& meta) { return Take(meta, {"name", "namespace", "uid", "resourceVersion", "labels"}); });
  Keep(node, "spec", out, &json::is_object, [](json& spec) { return Take(spec, {"unschedulable", "taints"}); });
  Keep(node, "status", out, &json::is_object, [](json& status) {
    json kept = json::object();
    Keep(status, "allocatable", kept, &json::is_object,
         [](json& allocatable) { return Take(allocatable, {"nvidia.com/gpu", "vpc.amazonaws.com/efa"}); });
    Keep(status, "conditions", kept, &json::is_array, ReadyConditions);
    return kept;
  });
  return out;
}

json PodForCache(json pod) {
  if (!pod.is_object()) return pod;
  json out = json::object();
  Keep(pod, "metadata", out, &json::is_object, [](json& meta) {
    return Take(meta, {"name", "namespace", "uid", "resourceVersion", "labels", "ownerReferences", "creationTimestamp",
                       "deletionTimestamp"});
  });
  Keep(pod, "spec", out, &json::is_object, [](json& spec) {
    json kept = Take(spec, {"nodeName"});
    Keep(spec, "affinity", kept, &json::is_object, [](json& affinity) { return Take(affinity, {"nodeAffinity"}); });
    for (const char* containers : {"containers", "initContainers"}) {
      Keep(spec, containers, kept, &json::is_array, [](json& list) {
        return EachObject(list, [](json& container) { return Take(container, {"name", "resources"}); });
      });
    }
    return kept;
  });
  Keep(pod, "status", out, &json::is_object, [](json& status) {
    json kept = Take(status, {"phase", "podIP"});
    Keep(status, "conditions", kept, &json::is_array, ReadyConditions);
    Keep(status, "containerStatuses", kept, &json::is_array, [](json& statuses) {
      return EachObject(statuses, [](json& s) {
        json container = Take(s, {"name"});
        Keep(s, "state", container, &json::is_object, [](json& state) {
          // Which state it is, and of a terminated one what Decide reports.
          json which = json::object();
          for (auto& [name, detail] : state.items()) {
            if (name == "terminated" && detail.is_object()) which[name] = Take(detail, {"exitCode", "reason", "signal"});
            else which[name] = detail.is_object() ? json::object() : std::move(detail);
          }
          return which;
        });
        return container;
      });
    });
    return kept;
  });
  return out;
}

}  // namespace meshtrain::controller
