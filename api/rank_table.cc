#include "api/rank_table.h"

#include "api/json_fields.h"

namespace meshtrain::api {

using json_fields::Is;

template <Is<RankTableNode> S, class V>
void Fields(S& s, V& v) {
  v("nodeRank", s.node_rank);
  v("name", s.name);
  v("topologyPath", s.topology_path);
  v("ranks", s.ranks);
}

template <Is<RankTable> S, class V>
void Fields(S& s, V& v) {
  v("levels", s.levels);
  v("nodes", s.nodes);
}

nlohmann::json ToJson(const RankTable& table) { return json_fields::Encode(table); }

RankTable DecodeRankTable(const nlohmann::json& object, FieldErrors* errors) {
  RankTable table = json_fields::Decode<RankTable>(object, "", errors);
  if (!errors->empty()) return table;
  if (table.nodes.empty()) errors->push_back({"nodes", "must list at least one node"});
  const size_t per_node = table.nodes.empty() ? 0 : table.nodes[0].ranks.size();
  for (size_t i = 0; i < table.nodes.size(); ++i) {
    const RankTableNode& node = table.nodes[i];
    const std::string path = "nodes[" + std::to_string(i) + "]";
    if (node.node_rank != int64_t(i)) errors->push_back({path + ".nodeRank", "must be " + std::to_string(i)});
    if (node.name.empty()) errors->push_back({path + ".name", "is required"});
    if (node.topology_path.size() != table.levels.size()) {
      errors->push_back({path + ".topologyPath", "must have one entry per level (" +
                                                     std::to_string(table.levels.size()) + ")"});
    }
    bool consecutive = node.ranks.size() == per_node && per_node > 0;
    for (size_t k = 0; consecutive && k < per_node; ++k) consecutive = node.ranks[k] == int64_t(i * per_node + k);
    if (!consecutive) {
      errors->push_back({path + ".ranks", "must be the " + std::to_string(per_node) + " consecutive ranks from " +
                                              std::to_string(i * per_node)});
    }
  }
  return table;
}

}  // namespace meshtrain::api
