// What the operator's node and pod caches keep of each object (kube::Informer's
// transforms), as kube-scheduler's NodeInfo keeps of a Node what scheduling reads: at
// 50,000 nodes and thousands of pods, whole objects (managedFields, annotations, images,
// the pods' environment and volumes) would be most of the operator's memory.
//
// Each keeps every field a reader of that cache uses, and nothing else:
//
// - a Node: metadata.name, namespace, uid, resourceVersion and labels (topology levels are
//   the job's choice, so all of them); spec.unschedulable and spec.taints; the GPUs and EFA
//   interfaces of status.allocatable; the Ready condition's type and status. Read by
//   scheduler::NodeFromKubectl, ClusterState and the controller's Ready transitions.
// - a Pod: metadata.name, namespace, uid, resourceVersion, labels, ownerReferences,
//   creationTimestamp and deletionTimestamp; spec.nodeName, spec.affinity.nodeAffinity and
//   each container's and init container's name and resources; status.phase, podIP,
//   conditions (type, status) and each container status's name and state (a terminated
//   state's exit code, reason and signal). Read by the reconciler, Decide, ClusterState,
//   the pod indexes and the pollers.
//
// A field of an unexpected shape is kept as it came, so that its reader reports it as it
// would without the transform.

#pragma once

#include <nlohmann/json.hpp>

namespace meshtrain::controller {

nlohmann::json NodeForCache(nlohmann::json node);
nlohmann::json PodForCache(nlohmann::json pod);

}  // namespace meshtrain::controller
