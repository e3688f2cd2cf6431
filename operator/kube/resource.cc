#include "operator/kube/resource.h"

#include "api/training_job.h"

namespace meshtrain::kube {

std::string ResourceType::Path(const std::string& namespace_, const std::string& name) const {
  std::string path = group.empty() ? "/api/" + version : "/apis/" + group + "/" + version;
  if (namespaced && !namespace_.empty()) path += "/namespaces/" + namespace_;
  path += "/" + plural;
  if (!name.empty()) path += "/" + name;
  return path;
}

namespace resources {
const ResourceType& Pods() {
  static const ResourceType r{"", "v1", "pods", "Pod", true};
  return r;
}
const ResourceType& Services() {
  static const ResourceType r{"", "v1", "services", "Service", true};
  return r;
}
const ResourceType& ConfigMaps() {
  static const ResourceType r{"", "v1", "configmaps", "ConfigMap", true};
  return r;
}
const ResourceType& Secrets() {
  static const ResourceType r{"", "v1", "secrets", "Secret", true};
  return r;
}
const ResourceType& NetworkPolicies() {
  static const ResourceType r{"networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", true};
  return r;
}
const ResourceType& Events() {
  static const ResourceType r{"", "v1", "events", "Event", true};
  return r;
}
const ResourceType& Nodes() {
  static const ResourceType r{"", "v1", "nodes", "Node", false};
  return r;
}
const ResourceType& Leases() {
  static const ResourceType r{"coordination.k8s.io", "v1", "leases", "Lease", true};
  return r;
}
const ResourceType& TrainingJobs() {
  static const ResourceType r{std::string(api::kGroup), std::string(api::kVersion), std::string(api::kPlural),
                              std::string(api::kKind), true};
  return r;
}
const ResourceType& Workloads() {
  static const ResourceType r{"kueue.x-k8s.io", "v1beta2", "workloads", "Workload", true};
  return r;
}
const ResourceType& ResourceFlavors() {
  static const ResourceType r{"kueue.x-k8s.io", "v1beta2", "resourceflavors", "ResourceFlavor", false};
  return r;
}
const ResourceType& WorkloadPriorityClasses() {
  static const ResourceType r{"kueue.x-k8s.io", "v1beta2", "workloadpriorityclasses", "WorkloadPriorityClass", false};
  return r;
}
}  // namespace resources

std::string ObjectKey(const std::string& namespace_, const std::string& name) {
  return namespace_.empty() ? name : namespace_ + "/" + name;
}

}  // namespace meshtrain::kube
