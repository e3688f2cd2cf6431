// One FSDP unit (docs/design.md, "FSDP units"): a contiguous range of the
// model's flat parameter buffer, padded to a multiple of the shard group size S and split
// evenly, so shard s holds elements [s*n, (s+1)*n) of the padded unit.
//
// The unit owns this rank's shard in device memory: master weights, gradients and AdamW
// m and v (Acc), initialised from the counter-based RNG for exactly these elements, and a
// table of its segments (one per tensor it holds part of) for the optimizer. It also owns
// the life cycle of its compute copy, each step enqueued on a stream and ordered by its
// events; the engine lends it the buffers (two block slots, or the edge slot of the
// embedding and the head):
//
//   Gather         on the comm stream: the master shard cast to Act into its place in the
//                  slot, all-gathered over the shard group in place; records ready()
//   ReduceGrads    on the comm stream, after the caller has ordered it after the unit's
//                  backward: the unsharded gradients reduce-scattered (mean over the shard
//                  group) and added to the shard's (+=, so micro-batches accumulate). With
//                  S = 1 the backward adds into the shard's gradients itself.
//   AllReduceReplicas  on the comm stream: the mean of the shard gradients over replicas
//
// Under expert parallelism (the layout's ep_size() > 1) a unit that holds experts is
// sharded over the expert-shard group (the ranks holding the same experts), and its
// expert group splits what the shard group's mean covers: ReduceGrads then sums the
// shard's elements before the experts (every member's alike) over the expert group, and
// adds the shard's gradients divided by the group's size, so that every element gets the
// mean over all the shard group's tokens, as without expert parallelism. Such a unit
// always reduces from unsharded gradients, even on one rank. Its tensors before the
// experts count in the norm on expert rank 0 only.
//
// Padding (of the unit to S shards, and of the vocabulary) is zero and no segment covers
// it, so it never trains.
// Thread-safety: the host enqueues; the work runs in event order.

#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "worker/comm/stream_collectives.h"
#include "worker/kernels/ops.h"
#include "worker/model/parameters.h"
#include "worker/runtime/backend.h"
#include "worker/runtime/device_memory.h"
#include "worker/runtime/memory.h"

namespace meshtrain::parallel {

// Which elements of unit `index` of `layout` shard `shard_rank` of `shard_size` holds:
// the unit padded to a multiple of shard_size and split evenly. Offsets are in the
// layout's flat buffer; FlatUnit and checkpoints split units the same way.
struct UnitShard {
  int64_t unit_begin = 0, numel = 0;  // the unit: [unit_begin, unit_begin + numel)
  int64_t shard_numel = 0;            // every shard's size, padding included
  int64_t begin = 0, real = 0;        // this shard's elements of the unit: [begin, begin + real) of the unit
};
UnitShard ShardOfUnit(const model::ParameterLayout& layout, int index, int shard_size, int shard_rank);

template <class P>
class FlatUnit {
 public:
  using A = typename P::Act;
  using G = typename P::Acc;
  template <class T>
  using Ptr = runtime::DevicePtr<T>;

  // Unit `index` of `layout`, this rank holding shard `shard_rank` of `shard_size`; its
  // segment table goes to `segments` (room for one per tensor of the unit), and every
  // tensor each TP rank holds whole counts in the norm only when `counts_replicated`.
  // Initialises the shard from `seed` with uploads on `stream`; the caller synchronizes
  // `stream` before the host buffers of the upload go (the constructor's end).
  FlatUnit(const model::ParameterLayout& layout, int index, int shard_size, int shard_rank, uint64_t seed,
           bool counts_replicated, runtime::CachingAllocator* allocator, runtime::Backend& backend,
           Ptr<kernels::ShardSegment> segments, runtime::Stream& stream);

  int index() const { return index_; }
  int shard_size() const { return shard_size_; }
  // Whether expert parallelism splits this unit's experts (see above).
  bool experts_split() const { return expert_size_ > 1; }
  int64_t begin() const { return shard_.unit_begin; }  // in the model's flat buffer
  int64_t numel() const { return shard_.numel; }
  int64_t shard_numel() const { return shard_.shard_numel; }
  int64_t padded_numel() const { return shard_.shard_numel * shard_size_; }
  // This rank's elements of the unit: [shard_begin, shard_begin + shard_real), and of them
  // the runs that are the model's (not vocabulary padding), as offsets into the shard.
  int64_t shard_begin() const { return shard_.begin; }
  int64_t shard_real() const { return shard_.real; }
  const std::vector<std::pair<int64_t, int64_t>>& model_runs() const { return model_runs_; }

  Ptr<G> master() const { return master_.get(); }
  Ptr<G> grads() const { return grads_.get(); }
  Ptr<G> adam_m() const { return m_.get(); }
  Ptr<G> adam_v() const { return v_.get(); }

  // Marks that the gather finished (comm), that the unit's backward finished (the engine
  // records it on compute), and that its gradients were reduced (comm).
  runtime::Event& ready() { return *ready_; }
  runtime::Event& backward_done() { return *backward_done_; }

  void Gather(Ptr<A> slot, comm::StreamCollectives* shard, kernels::Ops<P>& ops, runtime::Stream& comm);
  // `reduced`: room for a shard of Acc, the reduce-scatter's output; `experts`: the
  // expert group for the gradients where experts_split().
  void ReduceGrads(Ptr<G> unsharded, Ptr<G> reduced, comm::StreamCollectives* shard, kernels::Ops<P>& ops,
                   runtime::Stream& comm, comm::StreamCollectives* experts = nullptr);
  void AllReduceReplicas(comm::StreamCollectives* replica, runtime::Stream& comm);

  void ZeroShardGrads(runtime::Backend& backend, runtime::Stream& stream);
  // *sum += the squares of the shard's gradients the norm counts.
  void AddSquares(Ptr<double> sum, kernels::Ops<P>& ops, runtime::Stream& stream);
  // AdamW on the shard, the gradients times *clip_scale; with `params` (a unit kept
  // gathered, S = 1) the new weights also go to that compute copy.
  void Update(const kernels::AdamWStep& step, Ptr<const float> clip_scale, Ptr<A> params, kernels::Ops<P>& ops,
              runtime::Stream& stream);

 private:
  int index_, shard_size_, shard_rank_;
  int expert_size_ = 1;
  int64_t before_experts_ = 0;  // the unit's elements before its experts
  UnitShard shard_;
  std::vector<std::pair<int64_t, int64_t>> model_runs_;
  runtime::DeviceArray<G> master_, grads_, m_, v_;
  Ptr<kernels::ShardSegment> segments_;
  int segment_count_ = 0;
  std::unique_ptr<runtime::Event> ready_, backward_done_;
};

}  // namespace meshtrain::parallel
