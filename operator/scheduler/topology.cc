#include "operator/scheduler/topology.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include "operator/scheduler/placement.h"

namespace meshtrain::scheduler {

namespace {

// Memos are bounded: requests with ever new selectors or levels cannot grow them forever.
constexpr size_t kMaxMemos = 64;

// The key of a request's static eligibility: its levels, node selector and tolerations.
std::string AdmittingKey(const PlacementRequest& request) {
  std::string key;
  auto add = [&key](const std::string& s) {
    key += std::to_string(s.size());
    key += ':';
    key += s;
  };
  for (const std::string& level : request.levels) add(level);
  key += '|';
  for (const auto& [label, value] : request.node_selector) add(label), add(value);
  key += '|';
  for (const api::Toleration& t : request.tolerations) add(t.key), add(t.operator_), add(t.value), add(t.effect);
  return key;
}

}  // namespace

Topology::Topology(std::vector<ClusterNode> nodes) : nodes_(std::move(nodes)) {
  std::sort(nodes_.begin(), nodes_.end(), [](const ClusterNode& a, const ClusterNode& b) { return a.name < b.name; });
  for (size_t i = 1; i < nodes_.size(); ++i) {
    if (nodes_[i - 1].name == nodes_[i].name) throw ClusterError("node " + nodes_[i].name + " is listed twice");
  }
}

std::optional<size_t> Topology::Find(std::string_view name) const {
  const auto it = std::lower_bound(nodes_.begin(), nodes_.end(), name,
                                   [](const ClusterNode& n, std::string_view v) { return n.name < v; });
  if (it == nodes_.end() || it->name != name) return std::nullopt;
  return size_t(it - nodes_.begin());
}

std::shared_ptr<const TopologyIndex> Topology::Index(const std::vector<std::string>& levels) const {
  {
    std::lock_guard lock(mu_);
    if (auto it = indexes_.find(levels); it != indexes_.end()) return it->second;
  }
  auto index = std::make_shared<TopologyIndex>();
  const size_t n = nodes_.size(), depth = levels.size();
  std::vector<std::vector<std::string>> paths(n);
  for (size_t i = 0; i < n; ++i) paths[i] = TopologyPath(nodes_[i], levels);
  index->order.resize(n);
  std::iota(index->order.begin(), index->order.end(), 0u);
  // Names are unique and sorted, so ties on the path fall to the index.
  std::sort(index->order.begin(), index->order.end(),
            [&](uint32_t a, uint32_t b) { return paths[a] != paths[b] ? paths[a] < paths[b] : a < b; });
  index->domain.assign(depth, std::vector<uint32_t>(n));
  index->key.assign(depth, {});
  index->parent.assign(depth, {});
  for (size_t l = 0; l < depth; ++l) {
    for (size_t p = 0; p < n; ++p) {
      const std::vector<std::string>& path = paths[index->order[p]];
      // A new domain at level l wherever the path prefix up to l changes; in path order,
      // equal prefixes are adjacent.
      const bool same = p > 0 && (l == 0 || index->domain[l - 1][p] == index->domain[l - 1][p - 1]) &&
                        paths[index->order[p - 1]][l] == path[l];
      if (!same) {
        index->key[l].push_back((l == 0 ? "" : index->key[l - 1][index->domain[l - 1][p]] + "/") + path[l]);
        index->parent[l].push_back(l == 0 ? 0 : index->domain[l - 1][p]);
      }
      index->domain[l][p] = uint32_t(index->key[l].size() - 1);
    }
  }
  std::lock_guard lock(mu_);
  if (indexes_.size() >= kMaxMemos) indexes_.clear();
  return indexes_.emplace(levels, std::move(index)).first->second;  // a racing thread's equal one may win
}

std::shared_ptr<const std::vector<uint32_t>> Topology::Admitting(const PlacementRequest& request) const {
  const std::string key = AdmittingKey(request);
  {
    std::lock_guard lock(mu_);
    if (auto it = admitting_.find(key); it != admitting_.end()) return it->second;
  }
  const std::shared_ptr<const TopologyIndex> index = Index(request.levels);
  auto admitting = std::make_shared<std::vector<uint32_t>>();
  for (uint32_t p = 0; p < index->order.size(); ++p) {
    if (Admits(request, nodes_[index->order[p]])) admitting->push_back(p);
  }
  std::lock_guard lock(mu_);
  if (admitting_.size() >= kMaxMemos) admitting_.clear();
  return admitting_.emplace(key, std::move(admitting)).first->second;
}

int64_t ReleasedUsage::GpusUsed(size_t node) const {
  const auto it = released_.find(node);
  return base_->GpusUsed(node) - (it == released_.end() ? 0 : it->second.gpus);
}

int64_t ReleasedUsage::EfaUsed(size_t node) const {
  const auto it = released_.find(node);
  return base_->EfaUsed(node) - (it == released_.end() ? 0 : it->second.efa);
}

ClusterView ClusterView::Of(const ClusterSnapshot& snapshot) {
  auto topology = std::make_shared<const Topology>(snapshot.nodes);
  return {topology, std::make_shared<const RecordedUsage>(topology)};
}

const ClusterNode* ClusterView::Node(std::string_view name) const {
  const std::optional<size_t> i = topology->Find(name);
  return i ? &topology->nodes()[*i] : nullptr;
}

}  // namespace meshtrain::scheduler
