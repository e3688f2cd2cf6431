// Reading fields of Kubernetes objects (plain JSON) that several parts of the operator
// and its test server need.

#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace meshtrain::kube {

// The ObjectKey ("namespace/name", or "name" when cluster-scoped) of an object.
std::string KeyOf(const nlohmann::json& object);

// metadata.uid ("" if it has none).
std::string Uid(const nlohmann::json& object);

// Whether status.conditions holds `type` with status "True" (a Node's or Pod's Ready).
bool ConditionTrue(const nlohmann::json& object, const std::string& type);

// A pod's status.phase ("" before the kubelet reports one).
std::string PodPhase(const nlohmann::json& pod);

// The node a pod is bound to (spec.nodeName), else the one its required node affinity
// names by kubernetes.io/hostname; "" if neither.
std::string PinnedNode(const nlohmann::json& pod);

}  // namespace meshtrain::kube
