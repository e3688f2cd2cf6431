// An alpha-beta model of one training step's communication for a placement.
//
// Each group of the layout (docs/design.md, "The parallel layout": TP, shard and replica groups) runs its
// collectives as the fabric does: a ring over its one link when it sits in one node or
// has one rank per node, else hierarchically (a phase inside each node over NVLink, one
// between rail-aligned peers over the network link of the deepest topology domain all
// its nodes share, and for all-reduce a last phase inside the node). A ring of n ranks
// moving M bytes costs, per step of the ring, alpha + (M/n)/beta:
//   all-gather, reduce-scatter: (n-1) steps;  all-reduce: 2(n-1) steps.
// Groups of one kind run at the same time, so a kind costs its slowest group. Link
// bandwidths are per GPU, with every GPU of a node moving data at once.
//
// Per step, with P parameters, A accumulation steps and bf16 parameters:
//   shard:   A x (2 all-gathers of 2P/T bytes [forward, backward] + 1 reduce-scatter of 4P/T bytes)
//   replica: 1 all-reduce of 4P/(T*S) bytes (the fp32 shard gradients)
//   tp:      A x 4 x layers all-reduces of microBatch x seqLen x hidden x 2 bytes (2 forward, 2 backward);
//            for a mixture of experts, whose experts T splits as the dense MLP and whose
//            router it keeps whole, also A x layers all-gathers of the routing weights'
//            gradients, microBatch x seqLen x k x 4 bytes from each TP rank
// With C context ranks (contextParallelDegree) a rank holds seq / C rows: the TP messages
// above fall by C, the shard group is S x C, and
//   context: A x layers exchanges across the C group's ranks, each of steps moving 1/C of
//            a buffer per rank (ContextTrafficOf): for Ring, the sequence's K/V on this TP
//            rank forward, and backward those again and their fp32 gradients; for
//            AllToAll, q, k, v and the output forward, their gradients backward
// With EP expert ranks (expertParallelDegree) a block's experts are E/EP on a rank, the
// blocks' all-gathers and reduce-scatters run over the S x C / EP ranks holding the same
// experts (the expert-shard group) on the block's shared part and this rank's experts,
// the shared part's gradients are summed over the expert group, and
//   expert:  A x layers x 4 all-to-alls (2 forward, 2 backward) of microBatch x seqLen / C x
//            k x hidden x 2 bytes over the EP group, (EP - 1)/EP of them leaving each rank
//            (ExpertTrafficOf): NVLink where the group sits in a node (EP x T <= GPUs per
//            node, the group being EP consecutive shard ranks of T ranks each), else the
//            network. Every TP rank routes the same tokens and sends their copies whole
//            (hidden wide) to its own expert group: T does not divide these bytes
// A mixture with dense blocks among its sparse ones (api::ModelShape::DenseBlock) counts
// each block by its own unit (api::UnitElements::dense_block: no experts, over the shard
// group whatever EP), and the routing weights' all-gathers, the all-to-alls and the expert
// group's all-reduces in its sparse blocks only.
// With pipeline stages, P is the parameters of the stage that holds the most, its groups
// run inside each stage, and
//   pipeline: A x 2V point-to-point messages of microBatch x seqLen x hidden x 2 bytes
//             (activations forward, their gradients back) from each rank to its peer in
//             the next stage, over the link between the two ranks' nodes.

#pragma once

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/layout.h"
#include "api/model_shape.h"
#include "api/training_job.h"

namespace meshtrain::scheduler {

struct Link {
  std::string name;           // "nvlink", "within topology.k8s.aws/network-node-layer-3", "cluster"
  double bytes_per_second;    // per GPU
  double latency_seconds;
};

class LinkModel {
 public:
  // Defaults for EKS-like p5 clusters: NVLink 360 GB/s, 3 us; then, by the deepest shared
  // domain from the deepest network level outwards, 40, 25, 12.5 and 6.25 GB/s per GPU
  // at 15, 25, 40 and 60 us.
  explicit LinkModel(std::vector<std::string> levels);

  // The link called `which`: "nvlink", a level key (nodes sharing that level's domain
  // and no deeper one), or "cluster" (nodes sharing no domain); nullptr if none.
  const Link* Find(const std::string& which) const;

  // Replaces the figures of the link called `which`. Returns false if there is none.
  bool Override(const std::string& which, double bytes_per_second, double latency_seconds);

  const Link& IntraNode() const { return intra_node_; }
  // The link between different nodes whose paths share their first `shared_levels` entries.
  const Link& BetweenNodes(size_t shared_levels) const;
  const std::vector<std::string>& levels() const { return levels_; }

 private:
  std::vector<std::string> levels_;
  Link intra_node_;
  std::vector<Link> by_shared_;  // index: shared levels, 0 (cluster) .. levels
};

enum class Collective { kAllGather, kReduceScatter, kAllReduce };

// Seconds for `group` (ranks of `mesh`) to run `op` over `bytes` (the whole buffer: an
// all-gather's output, a reduce-scatter's input), on nodes at `node_paths`.
double CollectiveSeconds(Collective op, double bytes, const std::vector<int>& group, const api::ParallelLayout& mesh,
                         const std::vector<std::vector<std::string>>& node_paths, const LinkModel& links);
// Seconds for rank `from` of `mesh` to send `bytes` to rank `to`: one message over the link
// between their nodes (NVLink inside one).
double PointToPointSeconds(double bytes, int from, int to, const api::ParallelLayout& mesh,
                           const std::vector<std::vector<std::string>>& node_paths, const LinkModel& links);
// The link rank `from` sends to rank `to` over.
const Link& LinkBetween(int from, int to, const api::ParallelLayout& mesh,
                        const std::vector<std::vector<std::string>>& node_paths, const LinkModel& links);

// One exchange across a group of n ranks: `steps` steps, in each of which every rank sends
// 1/n of `bytes` to another (a ring attention pass: `bytes` the keys and values of the
// whole sequence; an all-to-all: the rank's own tensor, n - 1 steps).
struct Exchange {
  double bytes = 0;
  int steps = 0;
};
// Seconds for every rank of `group` to make `exchange`: a latency and 1/n of the bytes a
// step, over the slowest link among the group's nodes.
double ExchangeSeconds(const Exchange& exchange, const std::vector<int>& group, const api::ParallelLayout& mesh,
                       const std::vector<std::vector<std::string>>& node_paths, const LinkModel& links);

// One block's attention exchanges across a context group of C ranks for one micro-batch of
// `batch` sequences of `seq` tokens (the whole sequence), per rank, and the bytes a rank
// sends (as parallel/ring_attention.cc and the all-to-all pass them):
//   Ring: forward, the sequence's K and V on this TP rank (batch x seq x 2 KV / T of
//         act_bytes) in C - 1 steps; backward, those again in C - 1 steps and their
//         gradients (fp32, 4 bytes) in C steps, the last taking them home
//   AllToAll: forward q, k and v in and the output back; backward the output's gradient in
//         and q's, k's and v's back; each this rank's seq / C rows of this TP rank's
//         heads, in C - 1 steps
// Nothing with C = 1.
struct ContextTraffic {
  std::vector<Exchange> forward, backward;
  double forward_sent = 0, backward_sent = 0;
};
ContextTraffic ContextTrafficOf(const api::ModelShape& shape, int batch, int seq, int tp, int context,
                                bool all_to_all, int act_bytes);

// One mixture-of-experts block's all-to-alls across an expert group of EP ranks for one
// micro-batch of `batch` sequences of `seq` rows on this rank (seq / C of each), per rank,
// and the bytes a rank sends (as model::ExpertParallelGroup passes them): forward, the
// tokens' k copies (batch x seq x k rows of hidden, act_bytes) go to their experts' ranks
// and the experts' outputs come back; backward, the outputs' gradients go and the inputs'
// come back. Each all-to-all moves a rank's rows in EP - 1 steps of 1/EP (routing taken as
// even: (EP - 1)/EP of the rows leave the rank). The counts' all-gather (E integers) is
// left out. Per TP rank and the same at any T: each rank of a TP group routes all its
// group's tokens and sends their rows whole (the experts' slices meet them; the outputs
// coming back are that rank's part of the sum). Nothing with EP = 1 or a dense model; a
// mixture's dense blocks (api::ModelShape::DenseBlock) have none: callers count it per
// sparse block.
struct ExpertTraffic {
  std::vector<Exchange> forward, backward;
  double forward_sent = 0, backward_sent = 0;
};
ExpertTraffic ExpertTrafficOf(const api::ModelShape& shape, int batch, int seq, int expert_size, int act_bytes);

// The slowest group of `axis`: all of them run at once.
double AxisSeconds(api::Axis axis, Collective op, double bytes, const api::ParallelLayout& mesh,
                   const std::vector<std::vector<std::string>>& node_paths, const LinkModel& links);

// A link file, as `meshtrain bench comm --calibrate` writes it:
//   {"links": [{"name": "nvlink", "bytesPerSecond": 1.1e9, "latencySeconds": 4e-5}, ...]}
// Applies each entry to `links` with Override. Throws std::runtime_error naming the file
// and the entry for a file that cannot be read, is not such JSON, or names no link of `links`.
void ApplyLinkFile(const std::string& path, LinkModel* links);
nlohmann::json LinkFileJson(const std::vector<Link>& measured);

struct AxisCost {
  std::string axis;                       // "tp", "shard", "replica", and with stages "pipeline"
  double seconds = 0;                     // per step, the slowest group
  std::map<std::string, int> groups_by_link;  // how many groups use each link
};

struct StepCost {
  double seconds = 0;
  std::vector<AxisCost> axes;
};

// REQUIRES: `spec` is defaulted and valid; node_paths has one path per node rank.
StepCost EstimateStepCost(const api::TrainingJobSpec& spec, const std::vector<std::vector<std::string>>& node_paths,
                          const LinkModel& links);

}  // namespace meshtrain::scheduler
