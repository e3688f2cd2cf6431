// The resource types the operator uses, and the REST paths that address them.

#pragma once

#include <string>

namespace meshtrain::kube {

struct ResourceType {
  std::string group;  // "" for the core group
  std::string version;
  std::string plural;
  std::string kind;
  bool namespaced = true;

  std::string ApiVersion() const { return group.empty() ? version : group + "/" + version; }
  // /api/v1/namespaces/NS/pods[/NAME], /apis/G/V/nodes[/NAME]; an empty namespace lists across all.
  std::string Path(const std::string& namespace_, const std::string& name = "") const;
};

namespace resources {
const ResourceType& Pods();
const ResourceType& Services();
const ResourceType& ConfigMaps();
const ResourceType& Secrets();
const ResourceType& NetworkPolicies();
const ResourceType& Events();
const ResourceType& Nodes();
const ResourceType& Leases();
const ResourceType& TrainingJobs();
// Kueue's (kueue.x-k8s.io/v1beta2), used with --kueue.
const ResourceType& Workloads();
const ResourceType& ResourceFlavors();
const ResourceType& WorkloadPriorityClasses();
}  // namespace resources

// "namespace/name", or "name" for cluster-scoped objects: the key of caches and work queues.
std::string ObjectKey(const std::string& namespace_, const std::string& name);

}  // namespace meshtrain::kube
