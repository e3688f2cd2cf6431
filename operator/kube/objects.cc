#include "operator/kube/objects.h"

#include "operator/kube/resource.h"

namespace meshtrain::kube {

using nlohmann::json;

std::string Uid(const json& object) { return object.value("metadata", json::object()).value("uid", ""); }

std::string KeyOf(const json& object) {
  const json& meta = object.at("metadata");
  return ObjectKey(meta.value("namespace", ""), meta.value("name", ""));
}

bool ConditionTrue(const json& object, const std::string& type) {
  if (!object.is_object() || !object.contains("status")) return false;
  for (const auto& c : object["status"].value("conditions", json::array()))
    if (c.value("type", "") == type) return c.value("status", "") == "True";
  return false;
}

std::string PodPhase(const json& pod) { return pod.value("status", json::object()).value("phase", ""); }

std::string PinnedNode(const json& pod) {
  const json spec = pod.value("spec", json::object());
  if (const std::string bound = spec.value("nodeName", ""); !bound.empty()) return bound;
  const json terms = spec.value("affinity", json::object())
                         .value("nodeAffinity", json::object())
                         .value("requiredDuringSchedulingIgnoredDuringExecution", json::object())
                         .value("nodeSelectorTerms", json::array());
  for (const auto& term : terms) {
    for (const auto& e : term.value("matchExpressions", json::array())) {
      const json values = e.value("values", json::array());
      if (e.value("key", "") == "kubernetes.io/hostname" && e.value("operator", "") == "In" && !values.empty() &&
          values[0].is_string())
        return values[0];
    }
  }
  return "";
}

}  // namespace meshtrain::kube
