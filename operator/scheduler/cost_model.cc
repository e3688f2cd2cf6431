#include "operator/scheduler/cost_model.h"

#include <algorithm>
#include <fstream>
#include <stdexcept>

#include "api/engine_memory.h"
#include "api/layout.h"
#include "api/model_shape.h"
#include "api/pipeline.h"

namespace meshtrain::scheduler {

LinkModel::LinkModel(std::vector<std::string> levels)
    : levels_(std::move(levels)), intra_node_{"nvlink", 360e9, 3e-6} {
  // Network defaults from the deepest network level outwards.
  const Link network[] = {{"", 40e9, 15e-6}, {"", 25e9, 25e-6}, {"", 12.5e9, 40e-6}, {"", 6.25e9, 60e-6}};
  const size_t n = levels_.size();
  by_shared_.resize(n + 1);
  for (size_t shared = 0; shared <= n; ++shared) {
    // Two nodes share at most n-1 levels when the last level is the node itself.
    const size_t distance = shared + 1 >= n ? 0 : n - 1 - shared;
    by_shared_[shared] = network[std::min<size_t>(distance, 3)];
    by_shared_[shared].name = shared == 0 ? "cluster" : "within " + levels_[shared - 1];
  }
}

const Link* LinkModel::Find(const std::string& which) const {
  if (which == intra_node_.name) return &intra_node_;
  for (const Link& l : by_shared_) {
    if (l.name == which || l.name == "within " + which) return &l;
  }
  return nullptr;
}

bool LinkModel::Override(const std::string& which, double bytes_per_second, double latency_seconds) {
  Link* link = const_cast<Link*>(Find(which));
  if (link == nullptr) return false;
  link->bytes_per_second = bytes_per_second;
  link->latency_seconds = latency_seconds;
  return true;
}

const Link& LinkModel::BetweenNodes(size_t shared_levels) const {
  return by_shared_[std::min(shared_levels, by_shared_.size() - 1)];
}

namespace {

double RingSeconds(Collective op, double bytes, int n, const Link& link) {
  if (n <= 1 || bytes <= 0) return 0;
  const double steps = op == Collective::kAllReduce ? 2.0 * (n - 1) : double(n - 1);
  return steps * (link.latency_seconds + bytes / n / link.bytes_per_second);
}

// How many nodes a group's ranks sit on, and how many topology levels all those nodes share.
struct Span {
  int nodes = 0;
  size_t shared_levels = 0;
};

Span SpanOf(const std::vector<int>& group, const api::ParallelLayout& mesh,
            const std::vector<std::vector<std::string>>& paths) {
  const int first = mesh.NodeOf(group.front());
  Span span{0, paths[first].size()};
  std::vector<int> nodes;
  for (int rank : group) {
    const int node = mesh.NodeOf(rank);
    if (std::find(nodes.begin(), nodes.end(), node) != nodes.end()) continue;
    nodes.push_back(node);
    size_t common = 0;
    while (common < span.shared_levels && paths[node][common] == paths[first][common]) ++common;
    span.shared_levels = common;
  }
  span.nodes = int(nodes.size());
  return span;
}

// The slowest link among the nodes of `group` (the one its collectives are named by).
const Link& GroupLink(const Span& span, const LinkModel& links) {
  return span.nodes == 1 ? links.IntraNode() : links.BetweenNodes(span.shared_levels);
}

}  // namespace

double CollectiveSeconds(Collective op, double bytes, const std::vector<int>& group, const api::ParallelLayout& mesh,
                         const std::vector<std::vector<std::string>>& paths, const LinkModel& links) {
  const Span span = SpanOf(group, mesh, paths);
  const int n = int(group.size()), per_node = n / span.nodes;
  if (span.nodes == 1 || per_node == 1) return RingSeconds(op, bytes, n, GroupLink(span, links));
  // Hierarchical (comm/fabric/algorithms.cc): inside the node over the whole buffer (an
  // all-reduce's reduce-scatter and all-gather phases), and between rail peers over a
  // per_node-th of it.
  return RingSeconds(op, bytes, per_node, links.IntraNode()) +
         RingSeconds(op, bytes / per_node, span.nodes, GroupLink(span, links));
}

const Link& LinkBetween(int from, int to, const api::ParallelLayout& mesh,
                        const std::vector<std::vector<std::string>>& paths, const LinkModel& links) {
  return GroupLink(SpanOf({from, to}, mesh, paths), links);
}

double PointToPointSeconds(double bytes, int from, int to, const api::ParallelLayout& mesh,
                           const std::vector<std::vector<std::string>>& paths, const LinkModel& links) {
  if (bytes <= 0 || from == to) return 0;
  const Link& link = LinkBetween(from, to, mesh, paths, links);
  return link.latency_seconds + bytes / link.bytes_per_second;
}

double ExchangeSeconds(const Exchange& exchange, const std::vector<int>& group, const api::ParallelLayout& mesh,
                       const std::vector<std::vector<std::string>>& paths, const LinkModel& links) {
  const int n = int(group.size());
  if (n <= 1 || exchange.bytes <= 0) return 0;
  const Link& link = GroupLink(SpanOf(group, mesh, paths), links);
  return exchange.steps * (link.latency_seconds + exchange.bytes / n / link.bytes_per_second);
}

ContextTraffic ContextTrafficOf(const api::ModelShape& shape, int batch, int seq, int tp, int context,
                                bool all_to_all, int act_bytes) {
  ContextTraffic t;
  if (context <= 1) return t;
  const double Q = double(shape.QueryWidth()) / tp, KV = double(shape.KvWidth()) / tp;
  const int C = context;
  if (all_to_all) {
    const double rows = double(batch) * seq / C * act_bytes;
    t.forward = {{rows * (Q + 2 * KV), C - 1}, {rows * Q, C - 1}};   // q, k, v in; the output back
    t.backward = {{rows * Q, C - 1}, {rows * (Q + 2 * KV), C - 1}};  // dout in; dq, dk, dv back
  } else {
    const double kv = double(batch) * seq * 2 * KV;  // elements
    t.forward = {{kv * act_bytes, C - 1}};
    t.backward = {{kv * act_bytes, C - 1}, {kv * 4, C}};  // the blocks again; their fp32 gradients, home
  }
  for (const Exchange& e : t.forward) t.forward_sent += e.bytes / C * e.steps;
  for (const Exchange& e : t.backward) t.backward_sent += e.bytes / C * e.steps;
  return t;
}

ExpertTraffic ExpertTrafficOf(const api::ModelShape& shape, int batch, int seq, int expert_size, int act_bytes) {
  ExpertTraffic t;
  if (expert_size <= 1 || shape.experts <= 0) return t;
  const int EP = expert_size;
  const double rows = double(batch) * seq * double(shape.experts_per_token) * double(shape.hidden) * act_bytes;
  t.forward = {{rows, EP - 1}, {rows, EP - 1}};   // the copies to their experts; the outputs back
  t.backward = {{rows, EP - 1}, {rows, EP - 1}};  // the outputs' gradients in; the copies' back
  for (const Exchange& e : t.forward) t.forward_sent += e.bytes / EP * e.steps;
  for (const Exchange& e : t.backward) t.backward_sent += e.bytes / EP * e.steps;
  return t;
}

double AxisSeconds(api::Axis axis, Collective op, double bytes, const api::ParallelLayout& mesh,
                   const std::vector<std::vector<std::string>>& paths, const LinkModel& links) {
  if (mesh.Degree(axis) <= 1) return 0;
  double slowest = 0;
  for (const std::vector<int>& group : mesh.Groups(axis)) {
    slowest = std::max(slowest, CollectiveSeconds(op, bytes, group, mesh, paths, links));
  }
  return slowest;
}

void ApplyLinkFile(const std::string& path, LinkModel* links) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open the link file");
  const nlohmann::json file = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!file.is_object() || !file.contains("links") || !file["links"].is_array()) {
    throw std::runtime_error(path + ": not a link file: expected {\"links\": [{\"name\", \"bytesPerSecond\", "
                             "\"latencySeconds\"}, ...]}");
  }
  for (size_t i = 0; i < file["links"].size(); ++i) {
    const nlohmann::json& link = file["links"][i];
    const std::string where = path + ": links[" + std::to_string(i) + "]";
    if (!link.is_object() || !link.value("name", nlohmann::json()).is_string() ||
        !link.value("bytesPerSecond", nlohmann::json()).is_number() ||
        !link.value("latencySeconds", nlohmann::json()).is_number()) {
      throw std::runtime_error(where + ": needs a string name and numbers bytesPerSecond and latencySeconds");
    }
    const double rate = link["bytesPerSecond"], latency = link["latencySeconds"];
    if (rate <= 0 || latency < 0) throw std::runtime_error(where + ": bytesPerSecond must be positive, latencySeconds not negative");
    if (!links->Override(link["name"], rate, latency)) {
      throw std::runtime_error(where + ": no link named \"" + link["name"].get<std::string>() +
                               "\"; use nvlink, cluster or a topology level of the job");
    }
  }
}

nlohmann::json LinkFileJson(const std::vector<Link>& measured) {
  nlohmann::json links = nlohmann::json::array();
  for (const Link& l : measured) {
    links.push_back({{"name", l.name}, {"bytesPerSecond", l.bytes_per_second}, {"latencySeconds", l.latency_seconds}});
  }
  return {{"links", links}};
}

StepCost EstimateStepCost(const api::TrainingJobSpec& spec, const std::vector<std::vector<std::string>>& node_paths,
                          const LinkModel& links) {
  const api::ParallelLayout mesh = api::ParallelLayout::ForSpec(spec);
  const api::ModelShape shape = api::ShapeOf(spec.model);
  const api::Pipeline pipeline = api::Pipeline::Of(spec.parallelism);
  // The stage that holds the most: its blocks, the embedding's unit on the first (and for a
  // tied head the last), the head's on the last; for a mixture of experts counted by unit
  // (a TP rank's slice of each expert, the router whole), its dense blocks (ModelShape::
  // DenseBlock) by their own unit. With EP > 1 a sparse block holds E/EP experts, and its
  // units go over the expert-shard group rather than the shard group; a dense block's, as
  // the embedding's and the head's, over the shard group.
  const int EP = shape.experts > 0 ? mesh.expert() : 1;
  const api::UnitElements units = api::UnitElementsOf(shape, 0, mesh.tp(), api::kVocabMultiple, EP);
  const std::vector<int> first = api::SplitBlocks(shape, shape.seq_len, pipeline.chunks());
  double params_per_tp_rank = 0, block_params = 0;
  double sparse_held = double(shape.layers - shape.DenseBlocks());  // the sparse blocks of that stage
  const bool by_unit = pipeline.stages > 1 || shape.experts > 0;
  for (int p = 0; p < pipeline.stages && by_unit; ++p) {
    const bool last = p == pipeline.stages - 1;
    const double edge =
        (p == 0 || (last && shape.tied) ? double(units.embedding) : 0) + (last ? double(units.head) : 0);
    double sparse = 0, dense = 0;
    for (int c : api::ChunksOf(pipeline, p)) {
      const double d = double(shape.DenseBlocks(first[size_t(c)], first[size_t(c) + 1]));
      sparse += double(first[size_t(c) + 1] - first[size_t(c)]) - d;
      dense += d;
    }
    const double sparse_params = sparse * double(units.block), dense_params = dense * double(units.dense_block);
    if (edge + sparse_params + dense_params > params_per_tp_rank + block_params) {
      params_per_tp_rank = EP > 1 ? edge + dense_params : edge + sparse_params + dense_params;
      block_params = EP > 1 ? sparse_params : 0;
      sparse_held = sparse;
    }
  }
  if (!by_unit) params_per_tp_rank = double(shape.ParameterCount()) / mesh.tp();
  const double param_bytes = spec.training.precision == "fp32" ? 4 : 2;
  const double micro_steps = double(api::AccumulationSteps(spec));
  // A rank's rows of each sequence: seq / C.
  const double activation_bytes =
      double(spec.training.micro_batch_size * shape.seq_len / mesh.context() * shape.hidden) * param_bytes;
  const ContextTraffic context =
      ContextTrafficOf(shape, int(spec.training.micro_batch_size), int(shape.seq_len), mesh.tp(), mesh.context(),
                       spec.parallelism.context_parallel_mode == "AllToAll", int(param_bytes));

  struct Traffic {
    Collective op;
    double bytes;
    double times;  // per step
  };
  std::map<api::Axis, std::vector<Traffic>> traffic = {
      {api::Axis::kTensor, {{Collective::kAllReduce, activation_bytes, micro_steps * 4 * double(shape.layers)}}},
      {api::Axis::kShard,
       {{Collective::kAllGather, param_bytes * params_per_tp_rank, 2 * micro_steps},
        {Collective::kReduceScatter, 4 * params_per_tp_rank, micro_steps}}},
      {api::Axis::kReplica, {{Collective::kAllReduce, 4 * params_per_tp_rank / mesh.shard(), 1}}},
  };
  if (shape.experts > 0) {  // each sparse block's backward: its routing weights' gradients over the TP group
    const double tokens = double(spec.training.micro_batch_size * shape.seq_len / mesh.context());
    traffic[api::Axis::kTensor].push_back({Collective::kAllGather,
                                           tokens * double(shape.experts_per_token) * 4 * mesh.tp(),
                                           micro_steps * double(shape.layers - shape.DenseBlocks())});
  }
  if (EP > 1) {  // the sparse blocks' shards, of S x C / EP ranks each
    traffic[api::Axis::kReplica].push_back({Collective::kAllReduce, 4 * block_params / (mesh.shard() / EP), 1});
  }

  StepCost cost;
  for (const auto& [axis, work] : traffic) {
    AxisCost axis_cost{api::AxisName(axis), 0, {}};
    for (const std::vector<int>& group : mesh.Groups(axis)) {
      const Link& link = GroupLink(SpanOf(group, mesh, node_paths), links);
      ++axis_cost.groups_by_link[link.name];
      double seconds = 0;
      for (const Traffic& t : work) seconds += t.times * CollectiveSeconds(t.op, t.bytes, group, mesh, node_paths, links);
      axis_cost.seconds = std::max(axis_cost.seconds, seconds);
    }
    cost.seconds += axis_cost.seconds;
    cost.axes.push_back(std::move(axis_cost));
  }
  if (mesh.context() > 1) {
    // Every block's exchanges, forward and backward, each micro-step.
    AxisCost axis_cost{api::AxisName(api::Axis::kContext), 0, {}};
    for (const std::vector<int>& group : mesh.Groups(api::Axis::kContext)) {
      ++axis_cost.groups_by_link[GroupLink(SpanOf(group, mesh, node_paths), links).name];
      double seconds = 0;
      for (const std::vector<Exchange>* pass : {&context.forward, &context.backward}) {
        for (const Exchange& e : *pass) seconds += ExchangeSeconds(e, group, mesh, node_paths, links);
      }
      axis_cost.seconds = std::max(axis_cost.seconds, micro_steps * double(shape.layers) * seconds);
    }
    cost.seconds += axis_cost.seconds;
    cost.axes.push_back(std::move(axis_cost));
  }
  if (EP > 1) {
    // The sparse blocks' gathers and reduce-scatters over the ranks holding the same
    // experts, and their shared part's gradients summed over the expert group (the first
    // expert-shard rank's shard holds the most of it); every sparse block's all-to-alls,
    // each micro-step (a mixture's dense blocks have neither).
    const int expert_shards = mesh.shard() / EP;
    AxisCost shards{api::AxisName(api::Axis::kExpertShard), 0, {}};
    for (const std::vector<int>& group : mesh.Groups(api::Axis::kExpertShard)) {
      ++shards.groups_by_link[GroupLink(SpanOf(group, mesh, node_paths), links).name];
      const double seconds =
          micro_steps * (2 * CollectiveSeconds(Collective::kAllGather, param_bytes * block_params, group, mesh,
                                               node_paths, links) +
                         CollectiveSeconds(Collective::kReduceScatter, 4 * block_params, group, mesh, node_paths, links));
      shards.seconds = std::max(shards.seconds, seconds);
    }
    cost.seconds += shards.seconds;
    cost.axes.push_back(std::move(shards));
    const double shard_elements = double(api::ShardElements(units.block, expert_shards));
    const double alike = std::min(shard_elements, double(units.block_shared()));
    const ExpertTraffic experts = ExpertTrafficOf(shape, int(spec.training.micro_batch_size),
                                                  int(shape.seq_len / mesh.context()), EP, int(param_bytes));
    AxisCost axis_cost{api::AxisName(api::Axis::kExpert), 0, {}};
    for (const std::vector<int>& group : mesh.Groups(api::Axis::kExpert)) {
      ++axis_cost.groups_by_link[GroupLink(SpanOf(group, mesh, node_paths), links).name];
      double seconds = 0;
      for (const std::vector<Exchange>* pass : {&experts.forward, &experts.backward}) {
        for (const Exchange& e : *pass) seconds += ExchangeSeconds(e, group, mesh, node_paths, links);
      }
      seconds += CollectiveSeconds(Collective::kAllReduce, 4 * alike, group, mesh, node_paths, links);
      axis_cost.seconds = std::max(axis_cost.seconds, micro_steps * sparse_held * seconds);
    }
    cost.seconds += axis_cost.seconds;
    cost.axes.push_back(std::move(axis_cost));
  }
  if (pipeline.stages > 1) {
    // Each pipeline group (a rank and its peers in the other stages) sends along its
    // chain of stages, and with virtual stages from the last back to the first.
    AxisCost axis_cost{api::AxisName(api::Axis::kPipeline), 0, {}};
    const int P = pipeline.stages, V = pipeline.virtual_stages;
    for (const std::vector<int>& group : mesh.Groups(api::Axis::kPipeline)) {
      double seconds = 0;
      const Link* slowest = nullptr;
      for (int p = 0; p < P; ++p) {
        if (p + 1 == P && V == 1) break;
        const int from = group[size_t(p)], to = group[size_t(p + 1) % size_t(P)];
        const Link& link = LinkBetween(from, to, mesh, node_paths, links);
        if (slowest == nullptr || link.bytes_per_second < slowest->bytes_per_second) slowest = &link;
        seconds = std::max(seconds, PointToPointSeconds(activation_bytes, from, to, mesh, node_paths, links));
      }
      ++axis_cost.groups_by_link[slowest->name];
      axis_cost.seconds = std::max(axis_cost.seconds, micro_steps * 2 * V * seconds);
    }
    cost.seconds += axis_cost.seconds;
    cost.axes.push_back(std::move(axis_cost));
  }
  return cost;
}

}  // namespace meshtrain::scheduler
