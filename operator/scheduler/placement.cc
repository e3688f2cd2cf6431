#include "operator/scheduler/placement.h"

#include <algorithm>
#include <tuple>

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

struct PlacementCandidate {
  const ClusterNode* node;
  std::vector<std::string> path;
  bool taken = false;
};

// The domain of `c` at `level`: its path up to and including that level, as "a/b/c".
std::string DomainKey(const PlacementCandidate& c, int level) {
  std::string key;
  for (int i = 0; i <= level; ++i) {
    if (i > 0) key += '/';
    key += c.path[i];
  }
  return key;
}

bool InDomain(const std::string& key, const std::string& domain) {
  return domain.empty() || key == domain || (key.size() > domain.size() && key.starts_with(domain) && key[domain.size()] == '/');
}

// Chooses `need` untaken nodes among `members` (one domain, sorted by path), looking
// at the children at `level`, and appends them to `out` in node-rank order.
void Select(const std::vector<PlacementCandidate*>& members, size_t level, int64_t need, int64_t unit,
            std::vector<PlacementCandidate*>* out) {
  std::vector<PlacementCandidate*> free;
  for (PlacementCandidate* c : members) {
    if (!c->taken) free.push_back(c);
  }
  if (level >= (free.empty() ? 0 : free.front()->path.size())) {  // below the last level: single nodes
    for (int64_t i = 0; i < need; ++i) {
      free[i]->taken = true;
      out->push_back(free[i]);
    }
    return;
  }
  struct Child {
    std::string name;
    std::vector<PlacementCandidate*> members;
    int64_t remaining;
  };
  std::vector<Child> children;
  for (PlacementCandidate* c : free) {
    if (children.empty() || children.back().name != c->path[level]) children.push_back({c->path[level], {}, 0});
    children.back().members.push_back(c);
    ++children.back().remaining;
  }
  while (need > 0) {
    // 1. The smallest child that holds everything left (best fit).
    // 2. Else the child with the most whole shard groups: take whole groups.
    // 3. Else the largest child: shard groups must straddle children anyway.
    Child* pick = nullptr;
    int64_t take = 0;
    for (Child& c : children) {
      if (c.remaining >= need && (pick == nullptr || c.remaining < pick->remaining)) pick = &c;
    }
    if (pick != nullptr) {
      take = need;
    } else {
      for (Child& c : children) {
        if (c.remaining >= unit && (pick == nullptr || c.remaining / unit > pick->remaining / unit ||
                                    (c.remaining / unit == pick->remaining / unit && c.remaining > pick->remaining))) {
          pick = &c;
        }
      }
      if (pick != nullptr) {
        take = pick->remaining / unit * unit;
      } else {
        for (Child& c : children) {
          if (c.remaining > 0 && (pick == nullptr || c.remaining > pick->remaining)) pick = &c;
        }
        take = pick->remaining;
      }
    }
    Select(pick->members, level + 1, take, unit, out);
    pick->remaining -= take;
    need -= take;
  }
}

std::string Plural(int64_t n, const std::string& one, const std::string& many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

std::string Needs(const PlacementRequest& request) {
  return "needs " + Plural(request.nodes, "node", "nodes") + " with " + std::to_string(request.gpus_per_node) +
         " free GPU" + (request.gpus_per_node == 1 ? "" : "s");
}

// The eligible nodes, sorted by topology path then name; or, if too few, why not.
std::vector<PlacementCandidate> Eligible(const PlacementRequest& request, const ClusterSnapshot& snapshot, std::string* reason) {
  std::vector<PlacementCandidate> eligible;
  std::map<std::string, int64_t> why;
  for (const ClusterNode& node : snapshot.nodes) {
    std::string no = Ineligibility(request, node);
    if (no.empty()) eligible.push_back({&node, TopologyPath(node, request.levels)});
    else ++why[no];
  }
  if (int64_t(eligible.size()) < request.nodes) {
    *reason = Needs(request) + "; only " + std::to_string(eligible.size()) + " of " +
              std::to_string(snapshot.nodes.size()) + " nodes are eligible";
    std::string details;
    for (const auto& [what, count] : why) details += (details.empty() ? "" : ", ") + std::to_string(count) + " " + what;
    if (!details.empty()) *reason += " (" + details + ")";
  }
  std::sort(eligible.begin(), eligible.end(), [](const PlacementCandidate& a, const PlacementCandidate& b) {
    return std::tie(a.path, a.node->name) < std::tie(b.path, b.node->name);
  });
  return eligible;
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
  r.nodes_per_shard_group = api::ParallelLayout::ForSpec(spec).NodesPerShardGroup();
  r.avoid = std::move(avoid);
  return r;
}

std::string Ineligibility(const PlacementRequest& request, const ClusterNode& node) {
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
  if (node.FreeGpus() < request.gpus_per_node) return "with too few free GPUs";
  if (node.FreeEfa() < request.efa_per_node) return "with too few free EFA interfaces";
  return "";
}

std::vector<std::string> TopologyPath(const ClusterNode& node, const std::vector<std::string>& levels) {
  std::vector<std::string> path;
  for (const std::string& level : levels) {
    auto it = node.labels.find(level);
    path.push_back(it != node.labels.end() && !it->second.empty() ? it->second : "unlabelled:" + node.name);
  }
  return path;
}

Placement Place(const PlacementRequest& request, const ClusterSnapshot& snapshot) {
  Placement placement;
  std::vector<PlacementCandidate> eligible = Eligible(request, snapshot, &placement.reason);
  if (!placement.ok()) return placement;

  const int levels = int(request.levels.size());
  const auto found = std::find(request.levels.begin(), request.levels.end(), request.required_level);
  const int rack = found != request.levels.end() ? int(found - request.levels.begin()) : std::max(0, levels - 2);
  const int64_t unit = std::max<int64_t>(1, request.nodes_per_shard_group);

  // Nodes per domain, per level.
  std::vector<std::map<std::string, int64_t>> counts(levels);
  for (const PlacementCandidate& c : eligible) {
    for (int l = 0; l < levels; ++l) ++counts[l][DomainKey(c, l)];
  }
  // Nodes in whole shard groups a domain can hold without a group leaving its rack-level domains.
  auto aligned = [&](int level, const std::string& key) {
    if (level > rack) return counts[level].at(key);
    int64_t total = 0;
    for (const auto& [rack_key, n] : counts[rack]) {
      if (InDomain(rack_key, key)) total += n / unit * unit;
    }
    return total;
  };

  // The deepest level with a domain that holds the gang; best fit among them.
  const int64_t need = request.nodes;
  for (int l = levels - 1; l >= 0 && placement.domain.empty(); --l) {
    std::tuple<bool, int64_t, std::string> best{true, 0, ""};
    for (const auto& [key, n] : counts[l]) {
      if (n < need) continue;
      std::tuple<bool, int64_t, std::string> score{aligned(l, key) < need, n - need, key};
      if (placement.domain.empty() || score < best) best = score, placement.domain = key;
    }
    if (!placement.domain.empty()) placement.domain_level = l;
  }
  if (request.required && placement.domain_level < rack) {
    int64_t largest = 0;
    for (const auto& [key, n] : counts[rack]) largest = std::max(largest, n);
    Placement none;
    none.reason = Needs(request) + " in one " + request.levels[rack] + " domain; the largest such domain has " +
                  std::to_string(largest);
    return none;
  }

  std::vector<PlacementCandidate*> members;
  for (PlacementCandidate& c : eligible) {
    if (placement.domain_level < 0 || InDomain(DomainKey(c, placement.domain_level), placement.domain)) {
      members.push_back(&c);
    }
  }
  std::vector<PlacementCandidate*> chosen;
  Select(members, size_t(placement.domain_level + 1), need, unit, &chosen);
  for (const PlacementCandidate* c : chosen) {
    placement.nodes.push_back(c->node->name);
    placement.paths.push_back(c->path);
  }
  return placement;
}

Placement PlaceReplacement(const PlacementRequest& request, const ClusterSnapshot& snapshot, const Placement& gang,
                           size_t lost) {
  PlacementRequest one = request;
  one.nodes = 1;
  Placement placement;
  const std::vector<PlacementCandidate> eligible = Eligible(one, snapshot, &placement.reason);
  const std::vector<std::string>& lost_path = gang.paths.at(lost);
  const auto level = std::find(request.levels.begin(), request.levels.end(), request.required_level);
  const size_t required_depth =
      request.required && level != request.levels.end() ? size_t(level - request.levels.begin()) + 1 : 0;
  const PlacementCandidate* best = nullptr;
  size_t best_shared = 0, outside = 0;
  for (const PlacementCandidate& c : eligible) {
    if (std::find(gang.nodes.begin(), gang.nodes.end(), c.node->name) != gang.nodes.end()) continue;
    ++outside;
    size_t shared = 0;
    while (shared < lost_path.size() && shared < c.path.size() && c.path[shared] == lost_path[shared]) ++shared;
    if (shared < required_depth) continue;
    if (best == nullptr || shared > best_shared) best = &c, best_shared = shared;
  }
  if (best == nullptr) {
    if (placement.ok() && outside == 0) {
      placement.reason = "every eligible node holds the gang already";
    } else if (placement.ok()) {
      placement.reason = "none of the " + std::to_string(outside) + " eligible nodes outside the gang is in its " +
                         request.required_level + " domain " + lost_path.at(required_depth - 1);
    }
    placement.reason = "no node can replace " + gang.nodes.at(lost) + ": " + placement.reason;
    return placement;
  }
  placement = gang;
  placement.nodes[lost] = best->node->name;
  placement.paths[lost] = best->path;
  return placement;
}

Placement PlaceBlind(const PlacementRequest& request, const ClusterSnapshot& snapshot) {
  Placement placement;
  Eligible(request, snapshot, &placement.reason);
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
