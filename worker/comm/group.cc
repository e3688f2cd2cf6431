#include "worker/comm/group.h"

#include <algorithm>
#include <stdexcept>

#include "api/layout.h"

namespace meshtrain::comm {

Group::Group(std::string name, std::vector<int> global_ranks, std::vector<int> node_of_member,
             int rank)
    : name_(std::move(name)),
      global_ranks_(std::move(global_ranks)),
      node_of_member_(std::move(node_of_member)),
      rank_(rank) {
  if (global_ranks_.empty() || global_ranks_.size() != node_of_member_.size() || rank_ < 0 ||
      rank_ >= size()) {
    throw std::invalid_argument("group " + name_ + ": inconsistent members");
  }
  std::vector<int> node_order;  // node indices in order of first member
  for (int member = 0; member < size(); ++member) {
    auto it = std::find(node_order.begin(), node_order.end(), node_of_member_[member]);
    size_t index = it - node_order.begin();
    if (it == node_order.end()) {
      node_order.push_back(node_of_member_[member]);
      node_members_.emplace_back();
    }
    node_members_[index].push_back(member);
  }
  node_major_ = true;
  int per_node = PerNode();
  for (size_t n = 0; n < node_members_.size(); ++n) {
    for (size_t i = 0; i < node_members_[n].size(); ++i) {
      if (node_members_[n].size() != static_cast<size_t>(per_node) ||
          node_members_[n][i] != static_cast<int>(n) * per_node + static_cast<int>(i)) {
        node_major_ = false;
      }
    }
  }
}

Group Group::World(const api::RankTable& table, int global_rank) {
  std::vector<int> ranks, nodes;
  for (const api::RankTableNode& node : table.nodes) {
    for (int64_t r : node.ranks) {
      ranks.push_back(static_cast<int>(r));
      nodes.push_back(static_cast<int>(node.node_rank));
    }
  }
  std::vector<int> order(ranks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return ranks[a] < ranks[b]; });
  std::vector<int> sorted_ranks, sorted_nodes;
  for (int i : order) {
    sorted_ranks.push_back(ranks[i]);
    sorted_nodes.push_back(nodes[i]);
  }
  for (size_t i = 0; i < sorted_ranks.size(); ++i) {
    if (sorted_ranks[i] != static_cast<int>(i)) {
      throw std::invalid_argument("rank table does not hold ranks 0.." +
                                  std::to_string(sorted_ranks.size() - 1) + " exactly once");
    }
  }
  if (global_rank < 0 || global_rank >= static_cast<int>(sorted_ranks.size())) {
    throw std::invalid_argument("rank " + std::to_string(global_rank) +
                                " is not in the rank table (" +
                                std::to_string(sorted_ranks.size()) + " ranks)");
  }
  return Group("world", std::move(sorted_ranks), std::move(sorted_nodes), global_rank);
}

Group Group::Subgroup(std::string name, const std::vector<int>& members) const {
  std::vector<int> ranks, nodes;
  int my_index = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    int m = members[i];
    if (m < 0 || m >= size() || (i > 0 && m <= members[i - 1])) {
      throw std::invalid_argument("group " + name + ": members must be increasing ranks of " +
                                  name_ + " (0.." + std::to_string(size() - 1) + ")");
    }
    if (m == rank_) my_index = static_cast<int>(i);
    ranks.push_back(global_ranks_[m]);
    nodes.push_back(node_of_member_[m]);
  }
  if (my_index < 0) throw std::invalid_argument("group " + name + ": this rank is not a member");
  return Group(std::move(name), std::move(ranks), std::move(nodes), my_index);
}

std::string Group::Describe() const {
  return name_ + " (" + std::to_string(size()) + (size() == 1 ? " rank" : " ranks") + " on " +
         std::to_string(NodeCount()) + (NodeCount() == 1 ? " node)" : " nodes)");
}

}  // namespace meshtrain::comm
