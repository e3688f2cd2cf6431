// The rank table: for every node of a job, its name, its topology path and the
// global ranks it holds. The operator (or `meshtrain run`) writes it as JSON to the
// file named by MESHTRAIN_RANK_TABLE; each worker's communicator reads it to learn
// which ranks share a node and a network domain.

#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/field_error.h"

namespace meshtrain::api {

struct RankTableNode {
  int64_t node_rank = 0;
  std::string name;
  std::vector<std::string> topology_path;  // one domain name per topology level
  std::vector<int64_t> ranks;
  bool operator==(const RankTableNode&) const = default;
};

struct RankTable {
  std::vector<std::string> levels;  // the node-label keys the paths are made of
  std::vector<RankTableNode> nodes;  // ordered by node_rank
  bool operator==(const RankTable&) const = default;
};

// {"levels": [...], "nodes": [{"nodeRank": 0, "name": ..., "topologyPath": [...], "ranks": [...]}]}
nlohmann::json ToJson(const RankTable& table);

// Decodes and checks a rank table: node ranks 0..n-1 in order, each node holding
// the same number of consecutive ranks, paths as long as the levels.
RankTable DecodeRankTable(const nlohmann::json& object, FieldErrors* errors);

}  // namespace meshtrain::api
