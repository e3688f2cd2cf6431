// A group of ranks and where they sit: the global ranks of its members, in group-rank
// order, and the node (from the rank table) of each. Collectives use it to choose
// between flat and hierarchical algorithms and a transport per peer.
//
// Group is an immutable value; safe to share between threads.

#pragma once

#include <string>
#include <vector>

#include "api/rank_table.h"

namespace meshtrain::comm {

class Group {
 public:
  // `global_ranks[i]` is member i; `node_of_member[i]` its node index; `rank` this
  // process's member index.
  Group(std::string name, std::vector<int> global_ranks, std::vector<int> node_of_member, int rank);
  // The whole world of a rank table.
  static Group World(const api::RankTable& table, int global_rank);

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(global_ranks_.size()); }
  int GlobalRank(int member) const { return global_ranks_[member]; }
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  int NodeOf(int member) const { return node_of_member_[member]; }
  bool SameNode(int a, int b) const { return node_of_member_[a] == node_of_member_[b]; }

  // The nodes the group spans, in order of first member.
  int NodeCount() const { return static_cast<int>(node_members_.size()); }
  // True when members are laid out node by node with the same number on each node
  // (member = node_index * PerNode() + local index), the shape hierarchical algorithms use.
  bool IsNodeMajor() const { return node_major_; }
  int PerNode() const { return static_cast<int>(node_members_[0].size()); }

  // The sub-group of `members` (member indices of this group, increasing).
  Group Subgroup(std::string name, const std::vector<int>& members) const;
  // "world (8 ranks on 4 nodes)" for messages.
  std::string Describe() const;

 private:
  std::string name_;
  std::vector<int> global_ranks_;
  std::vector<int> node_of_member_;
  int rank_;
  std::vector<std::vector<int>> node_members_;
  bool node_major_ = false;
};

}  // namespace meshtrain::comm
