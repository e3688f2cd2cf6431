// spec.elastic: a gang smaller than spec.nodes, down to minNodes, when the whole does not
// fit, and its growth back once it does (decider.h).

#include "operator/controller/decider.h"

namespace meshtrain::controller {

using nlohmann::json;

// The job as a gang of `size` nodes runs it: the written spec with that many nodes,
// checked and defaulted as its workers will; nullopt when the layout cannot split so.
std::optional<api::TrainingJob> Decider::JobOfSize(int64_t size) const {
  if (size == nodes()) return job_;
  json object = o_.object;
  object["spec"]["nodes"] = size;
  object["spec"].erase("elastic");  // the operator shrinks and grows the gang; its workers need no more
  const api::CheckedJob checked = api::CheckTrainingJob(object, "spec.nodes " + std::to_string(size), 0);
  if (!checked.ok()) return std::nullopt;
  api::TrainingJob job = checked.job;
  job.metadata = job_.metadata;
  std::vector<api::DerivedDefault> derived;
  ApplyWorkerDefaults(options_.worker, object["spec"], &job, &derived);
  return job;
}

// spec.elastic: the largest smaller gang, down to minNodes, whose layout splits over it
// and which the cluster can place. False, with `*reason` saying so, when there is none.
bool Decider::PlaceSmaller(const scheduler::ClusterView& cluster, api::TrainingJob* sized,
                           scheduler::Placement* placement, scheduler::PlacementRequest* request,
                           std::string* reason) const {
  const std::optional<int64_t> min_nodes = job_.spec.elastic.min_nodes;
  if (!min_nodes || *min_nodes >= nodes()) return false;
  for (int64_t size = nodes() - 1; size >= *min_nodes; --size) {
    const std::optional<api::TrainingJob> job = JobOfSize(size);
    if (!job) continue;
    scheduler::PlacementRequest smaller = scheduler::PlacementRequest::ForJob(*job, o_.avoided_nodes);
    scheduler::Placement placed = scheduler::Place(smaller, cluster);
    if (!placed.ok()) continue;
    *sized = *job;
    *placement = std::move(placed);
    *request = std::move(smaller);
    return true;
  }
  *reason += "; nor does a smaller gang of " + std::to_string(*min_nodes) + " to " + std::to_string(nodes() - 1) +
             " nodes (spec.elastic.minNodes)";
  return false;
}

// An elastic gang below spec.nodes grows back at each new checkpoint, once the whole
// gang fits the cluster with the nodes it holds now counted as free.
void Decider::Grow(const std::vector<json>& current) {
  if (gang_size() >= nodes() || !o_.progress || !o_.progress->checkpoint_step) return;
  if (o_.status.progress && o_.status.progress->checkpoint_step == o_.progress->checkpoint_step) return;
  if (LacksCluster()) return;
  const scheduler::ClusterView& cluster = *o_.cluster;
  std::map<size_t, scheduler::ReleasedUsage::Released> released;
  for (const json& pod : current) {
    const PodClaim held = ClaimOf(pod);
    const std::optional<size_t> node = cluster.topology->Find(held.node);
    if (!node) continue;
    released[*node].gpus += held.gpus;
    released[*node].efa += held.efa;
  }
  const scheduler::ClusterView grown{cluster.topology,
                                     std::make_shared<scheduler::ReleasedUsage>(cluster.usage, std::move(released))};
  if (!scheduler::Place(scheduler::PlacementRequest::ForJob(job_, o_.avoided_nodes), grown).ok()) return;
  Restart("Growing",
          "all " + std::to_string(nodes()) + " nodes fit again; the gang of " + std::to_string(gang_size()) +
              " grows back from the checkpoint of step " + std::to_string(*o_.progress->checkpoint_step),
          "", false, "grown");
}

}  // namespace meshtrain::controller
