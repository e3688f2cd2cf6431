#include "operator/scheduler/placement.h"

#include <algorithm>
#include <map>
#include <optional>

#include "api/layout.h"

namespace meshtrain::scheduler {
namespace {

// Kubernetes toleration semantics; PreferNoSchedule taints never block.
bool Tolerates(const std::vector<api::Toleration>& tolerations, const Taint& taint) {
  if (taint.effect == "PreferNoSchedule") return true;
  for (const api::Toleration& t : tolerations) {
    if (!t.effect.empty() && t.effect != taint.effect) continue;
    if (t.operator_ == "Exists" ? (t.key.empty() || t.key == taint.key) : (t.key == taint.key && t.value == taint.value)) {
      return true;
    }
  }
  return false;
}

std::string Plural(int64_t n, const std::string& one, const std::string& many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

std::string Needs(const PlacementRequest& request) {
  return "needs " + Plural(request.nodes, "node", "nodes") + " with " + std::to_string(request.gpus_per_node) +
         " free GPU" + (request.gpus_per_node == 1 ? "" : "s");
}

// Ineligibility with `gpus_used` and `efa_used` in use on `node`.
std::string IneligibilityWith(const PlacementRequest& request, const ClusterNode& node, int64_t gpus_used,
                              int64_t efa_used) {
  if (!node.ready) return "not Ready";
  if (!node.schedulable) return "cordoned";
  if (request.avoid.contains(node.name)) return "avoided after failures";
  for (const auto& [key, value] : request.node_selector) {
    auto it = node.labels.find(key);
    if (it == node.labels.end() || it->second != value) return "not matching the node selector";
  }
  for (const Taint& taint : node.taints) {
    if (!Tolerates(request.tolerations, taint)) {
      // As kubectl writes a taint: KEY[=VALUE]:EFFECT.
      return "with the untolerated taint " + taint.key + (taint.value.empty() ? "" : "=" + taint.value) + ":" +
             taint.effect;
    }
  }
  if (node.gpus - gpus_used < request.gpus_per_node) return "with too few free GPUs";
  if (node.efa - efa_used < request.efa_per_node) return "with too few free EFA interfaces";
  return "";
}

// The eligible nodes as positions in `index.order` (so in topology-path order), from the
// nodes the topology admits for the request, less the avoided and those too full. When
// fewer than the request's nodes, `*reason` says why, counting every node's reason.
std::vector<uint32_t> Eligible(const PlacementRequest& request, const ClusterView& cluster, const TopologyIndex& index,
                               std::string* reason) {
  const Topology& topology = *cluster.topology;
  const NodeUsage& usage = *cluster.usage;
  const std::shared_ptr<const std::vector<uint32_t>> admitting = topology.Admitting(request);
  std::vector<uint32_t> eligible;
  eligible.reserve(admitting->size());
  for (const uint32_t p : *admitting) {
    const size_t i = index.order[p];
    const ClusterNode& node = topology.nodes()[i];
    if (node.gpus - usage.GpusUsed(i) < request.gpus_per_node || node.efa - usage.EfaUsed(i) < request.efa_per_node)
      continue;
    if (!request.avoid.empty() && request.avoid.contains(node.name)) continue;
    eligible.push_back(p);
  }
  if (int64_t(eligible.size()) < request.nodes) {
    std::map<std::string, int64_t> why;
    for (size_t i = 0; i < topology.size(); ++i) {
      const std::string no = IneligibilityWith(request, topology.nodes()[i], usage.GpusUsed(i), usage.EfaUsed(i));
      if (!no.empty()) ++why[no];
    }
    *reason = Needs(request) + "; only " + std::to_string(eligible.size()) + " of " + std::to_string(topology.size()) +
              " nodes are eligible";
    std::string details;
    for (const auto& [what, count] : why) details += (details.empty() ? "" : ", ") + std::to_string(count) + " " + what;
    if (!details.empty()) *reason += " (" + details + ")";
  }
  return eligible;
}

// Chooses `need` untaken nodes among `members` (positions in `index.order` inside one
// domain of level - 1, ascending), looking at their domains at `level`, and appends them
// to `out` in node-rank order. `units` are the node counts to keep whole, largest first
// (a pipeline stage, then a shard group), each a multiple of the next.
void Select(const TopologyIndex& index, const std::vector<uint32_t>& members, size_t level, int64_t need,
            const std::vector<int64_t>& units, std::vector<char>* taken, std::vector<uint32_t>* out) {
  std::vector<uint32_t> free;
  for (const uint32_t p : members) {
    if (!(*taken)[p]) free.push_back(p);
  }
  if (level >= (free.empty() ? 0 : index.levels())) {  // below the last level: single nodes
    for (int64_t i = 0; i < need; ++i) {
      (*taken)[free[size_t(i)]] = 1;
      out->push_back(free[size_t(i)]);
    }
    return;
  }
  struct Child {
    uint32_t domain;
    std::vector<uint32_t> members;
    int64_t remaining;
  };
  std::vector<Child> children;
  for (const uint32_t p : free) {
    const uint32_t domain = index.domain[level][p];
    if (children.empty() || children.back().domain != domain) children.push_back({domain, {}, 0});
    children.back().members.push_back(p);
    ++children.back().remaining;
  }
  while (need > 0) {
    // 1. The smallest child that holds everything left (best fit).
    // 2. Else the child with the most whole stages, then shard groups: take whole ones.
    // 3. Else the largest child: shard groups must straddle children anyway.
    Child* pick = nullptr;
    int64_t take = 0;
    for (Child& c : children) {
      if (c.remaining >= need && (pick == nullptr || c.remaining < pick->remaining)) pick = &c;
    }
    if (pick != nullptr) {
      take = need;
    } else {
      for (const int64_t unit : units) {
        for (Child& c : children) {
          if (c.remaining >= unit && (pick == nullptr || c.remaining / unit > pick->remaining / unit ||
                                      (c.remaining / unit == pick->remaining / unit && c.remaining > pick->remaining))) {
            pick = &c;
          }
        }
        if (pick != nullptr) {
          take = pick->remaining / unit * unit;
          break;
        }
      }
      if (pick == nullptr) {
        for (Child& c : children) {
          if (c.remaining > 0 && (pick == nullptr || c.remaining > pick->remaining)) pick = &c;
        }
        take = pick->remaining;
      }
    }
    Select(index, pick->members, level + 1, take, units, taken, out);
    pick->remaining -= take;
    need -= take;
  }
}

}  // namespace

PlacementRequest PlacementRequest::ForJob(const api::TrainingJob& job, std::set<std::string> avoid) {
  const api::TrainingJobSpec& spec = job.spec;
  PlacementRequest r;
  r.nodes = spec.nodes;
  r.gpus_per_node = spec.gpus_per_node;
  r.efa_per_node = spec.resources.efa;
  r.tolerations = spec.template_.tolerations;
  r.node_selector = spec.template_.node_selector;
  r.levels = spec.topology.levels;
  r.required = spec.topology.mode == "Required";
  r.required_level = spec.topology.required_level;
  const api::ParallelLayout layout = api::ParallelLayout::ForSpec(spec);
  r.nodes_per_shard_group = layout.NodesPerShardGroup();
  if (layout.pipeline() > 1) r.nodes_per_stage = layout.NodesPerStage();
  r.avoid = std::move(avoid);
  return r;
}

std::string Ineligibility(const PlacementRequest& request, const ClusterNode& node) {
  return IneligibilityWith(request, node, node.gpus_used, node.efa_used);
}

bool Admits(const PlacementRequest& request, const ClusterNode& node) {
  if (!node.ready || !node.schedulable) return false;
  for (const auto& [key, value] : request.node_selector) {
    auto it = node.labels.find(key);
    if (it == node.labels.end() || it->second != value) return false;
  }
  for (const Taint& taint : node.taints) {
    if (!Tolerates(request.tolerations, taint)) return false;
  }
  return true;
}

std::vector<std::string> TopologyPath(const ClusterNode& node, const std::vector<std::string>& levels) {
  std::vector<std::string> path;
  for (const std::string& level : levels) {
    auto it = node.labels.find(level);
    path.push_back(it != node.labels.end() && !it->second.empty() ? it->second : "unlabelled:" + node.name);
  }
  return path;
}

Placement Place(const PlacementRequest& request, const ClusterView& cluster) {
  Placement placement;
  const std::shared_ptr<const TopologyIndex> held = cluster.topology->Index(request.levels);
  const TopologyIndex& index = *held;
  const std::vector<uint32_t> eligible = Eligible(request, cluster, index, &placement.reason);
  if (!placement.ok()) return placement;

  const int levels = int(request.levels.size());
  const auto found = std::find(request.levels.begin(), request.levels.end(), request.required_level);
  const int rack = found != request.levels.end() ? int(found - request.levels.begin()) : std::max(0, levels - 2);
  // The units to keep whole, largest first: a stage (when it is not the whole gang and
  // spans more than a shard group), then a shard group.
  const int64_t group = std::max<int64_t>(1, request.nodes_per_shard_group);
  std::vector<int64_t> units;
  if (request.nodes_per_stage > group && request.nodes_per_stage < request.nodes &&
      request.nodes_per_stage % group == 0) {
    units.push_back(request.nodes_per_stage);
  }
  units.push_back(group);
  const int64_t unit = units.front();

  // Eligible nodes per domain, per level.
  std::vector<std::vector<int64_t>> counts(static_cast<size_t>(levels));
  for (int l = 0; l < levels; ++l) {
    counts[size_t(l)].assign(index.key[size_t(l)].size(), 0);
    for (const uint32_t p : eligible) ++counts[size_t(l)][index.domain[size_t(l)][p]];
  }
  // At the rack level and above: the nodes in whole units (stages, else shard groups) a
  // domain can hold without one leaving its rack-level domains.
  std::vector<std::vector<int64_t>> aligned(static_cast<size_t>(levels));
  if (rack < levels) {
    aligned[size_t(rack)] = counts[size_t(rack)];
    for (int64_t& n : aligned[size_t(rack)]) n = n / unit * unit;
    for (int l = rack - 1; l >= 0; --l) {
      aligned[size_t(l)].assign(index.key[size_t(l)].size(), 0);
      for (size_t child = 0; child < aligned[size_t(l) + 1].size(); ++child)
        aligned[size_t(l)][index.parent[size_t(l) + 1][child]] += aligned[size_t(l) + 1][child];
    }
  }
  auto aligned_at = [&](int level, uint32_t domain) {
    return level > rack ? counts[size_t(level)][domain] : aligned[size_t(level)][domain];
  };

  // The deepest level with a domain that holds the gang; best fit among them: holding
  // whole shard groups first, then the fewest nodes left over, then the domain's name.
  const int64_t need = request.nodes;
  uint32_t chosen = 0;
  for (int l = levels - 1; l >= 0 && placement.domain_level < 0; --l) {
    bool found_one = false;
    std::pair<bool, int64_t> best{true, 0};
    for (uint32_t d = 0; d < counts[size_t(l)].size(); ++d) {
      const int64_t n = counts[size_t(l)][d];
      if (n < need) continue;
      const std::pair<bool, int64_t> score{aligned_at(l, d) < need, n - need};
      if (!found_one || score < best || (score == best && index.key[size_t(l)][d] < index.key[size_t(l)][chosen])) {
        best = score;
        chosen = d;
        found_one = true;
      }
    }
    if (found_one) {
      placement.domain_level = l;
      placement.domain = index.key[size_t(l)][chosen];
    }
  }
  if (request.required && placement.domain_level < rack) {
    int64_t largest = 0;
    for (const int64_t n : counts[size_t(rack)]) largest = std::max(largest, n);
    Placement none;
    none.reason = Needs(request) + " in one " + request.levels[size_t(rack)] + " domain; the largest such domain has " +
                  std::to_string(largest);
    return none;
  }

  std::vector<uint32_t> members;
  for (const uint32_t p : eligible) {
    if (placement.domain_level < 0 || index.domain[size_t(placement.domain_level)][p] == chosen) members.push_back(p);
  }
  std::vector<char> taken(index.order.size(), 0);
  std::vector<uint32_t> selected;
  Select(index, members, size_t(placement.domain_level + 1), need, units, &taken, &selected);
  for (const uint32_t p : selected) {
    const ClusterNode& node = cluster.topology->nodes()[index.order[p]];
    placement.nodes.push_back(node.name);
    placement.paths.push_back(TopologyPath(node, request.levels));
  }
  return placement;
}

Placement Place(const PlacementRequest& request, const ClusterSnapshot& snapshot) {
  return Place(request, ClusterView::Of(snapshot));
}

Placement PlaceReplacement(const PlacementRequest& request, const ClusterView& cluster, const Placement& gang,
                           size_t lost) {
  PlacementRequest one = request;
  one.nodes = 1;
  Placement placement;
  const std::shared_ptr<const TopologyIndex> held = cluster.topology->Index(request.levels);
  const TopologyIndex& index = *held;
  const std::vector<uint32_t> eligible = Eligible(one, cluster, index, &placement.reason);
  const std::vector<std::string>& lost_path = gang.paths.at(lost);
  const auto level = std::find(request.levels.begin(), request.levels.end(), request.required_level);
  const size_t required_depth =
      request.required && level != request.levels.end() ? size_t(level - request.levels.begin()) + 1 : 0;
  // The lost node's domain at each level, as the index writes it.
  std::vector<std::string> lost_keys;
  for (size_t l = 0; l < std::min(lost_path.size(), index.levels()); ++l)
    lost_keys.push_back((l == 0 ? "" : lost_keys.back() + "/") + lost_path[l]);
  std::optional<uint32_t> best;
  size_t best_shared = 0, outside = 0;
  for (const uint32_t p : eligible) {  // in path order: the first of equals wins
    const std::string& name = cluster.topology->nodes()[index.order[p]].name;
    if (std::find(gang.nodes.begin(), gang.nodes.end(), name) != gang.nodes.end()) continue;
    ++outside;
    size_t shared = 0;
    while (shared < lost_keys.size() && index.key[shared][index.domain[shared][p]] == lost_keys[shared]) ++shared;
    if (shared < required_depth) continue;
    if (!best || shared > best_shared) best = p, best_shared = shared;
  }
  if (!best) {
    if (placement.ok() && outside == 0) {
      placement.reason = "every eligible node holds the gang already";
    } else if (placement.ok()) {
      placement.reason = "none of the " + std::to_string(outside) + " eligible nodes outside the gang is in its " +
                         request.required_level + " domain " + lost_path.at(required_depth - 1);
    }
    placement.reason = "no node can replace " + gang.nodes.at(lost) + ": " + placement.reason;
    return placement;
  }
  const ClusterNode& node = cluster.topology->nodes()[index.order[*best]];
  placement = gang;
  placement.nodes[lost] = node.name;
  placement.paths[lost] = TopologyPath(node, request.levels);
  return placement;
}

Placement PlaceReplacement(const PlacementRequest& request, const ClusterSnapshot& snapshot, const Placement& gang,
                           size_t lost) {
  return PlaceReplacement(request, ClusterView::Of(snapshot), gang, lost);
}

Placement PlaceBlind(const PlacementRequest& request, const ClusterSnapshot& snapshot) {
  Placement placement;
  const ClusterView view = ClusterView::Of(snapshot);
  Eligible(request, view, *view.topology->Index(request.levels), &placement.reason);
  if (!placement.ok()) return placement;
  for (const ClusterNode& node : snapshot.nodes) {  // snapshots are in name order
    if (int64_t(placement.nodes.size()) == request.nodes) break;
    if (!Ineligibility(request, node).empty()) continue;
    placement.nodes.push_back(node.name);
    placement.paths.push_back(TopologyPath(node, request.levels));
  }
  return placement;
}

Placement InNameOrder(const Placement& placement) {
  std::vector<size_t> order(placement.nodes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return placement.nodes[a] < placement.nodes[b]; });
  Placement sorted = placement;
  for (size_t i = 0; i < order.size(); ++i) {
    sorted.nodes[i] = placement.nodes[order[i]];
    sorted.paths[i] = placement.paths[order[i]];
  }
  return sorted;
}

api::RankTable MakeRankTable(const Placement& placement, const std::vector<std::string>& levels,
                             int64_t gpus_per_node) {
  api::RankTable table{levels, {}};
  for (size_t i = 0; i < placement.nodes.size(); ++i) {
    api::RankTableNode node{int64_t(i), placement.nodes[i], placement.paths[i], {}};
    for (int64_t g = 0; g < gpus_per_node; ++g) node.ranks.push_back(int64_t(i) * gpus_per_node + g);
    table.nodes.push_back(std::move(node));
  }
  return table;
}

}  // namespace meshtrain::scheduler
