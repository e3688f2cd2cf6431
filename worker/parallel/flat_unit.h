// One FSDP unit (DESIGN.md, "Who owns what in the engine"): a contiguous range of the
// model's flat parameter buffer, padded to a multiple of the shard group size S and
// split evenly, so shard s holds elements [s*n, (s+1)*n) of the padded unit.
//
// The unit owns this rank's shard: fp32 master weights, fp32 gradients, AdamW m and v,
// initialised from the counter-based RNG for exactly these elements. It also owns the
// life cycle of its gathered copy, each step enqueued on a stream and ordered by events:
//
//   Gather         on the comm stream: allocate the unsharded parameters, all-gather, record ready()
//   FreeParams     on the stream that used them last: return them to the allocator
//   AllocateGrads  inside a compute task: zeroed unsharded gradients for the backward
//   ReduceGrads    on the comm stream, once the caller has ordered it after the backward: reduce-scatter (mean over the shard
//                  group) into the shard gradients (+=, so micro-batches accumulate), free
//                  the unsharded gradients
//   AllReduceReplicas  on the comm stream: the mean of the shard gradients over the replica group
//
// Both unsharded copies are counted as MemoryCategory::kGathered. With S = 1 and no
// communicator, a gather is a copy and a reduce-scatter an add.
// Thread-safety: the host enqueues; the stream tasks touch the unit in event order.

#pragma once

#include <cstdint>
#include <vector>

#include "worker/comm/communicator.h"
#include "worker/model/parameters.h"
#include "worker/runtime/memory.h"
#include "worker/runtime/stream.h"
#include "worker/train/replica.h"

namespace meshtrain::parallel {

// Which elements of unit `index` of `layout` shard `shard_rank` of `shard_size` holds:
// the unit padded to a multiple of shard_size and split evenly. Offsets are in the
// layout's flat buffer; FlatUnit and checkpoints split units the same way.
struct UnitShard {
  int64_t unit_begin = 0, numel = 0;  // the unit: [unit_begin, unit_begin + numel)
  int64_t shard_numel = 0;            // every shard's size, padding included
  int64_t begin = 0, real = 0;        // this shard's real elements: [begin, begin + real) of the unit
};
UnitShard ShardOfUnit(const model::ParameterLayout& layout, int index, int shard_size, int shard_rank);

class FlatUnit {
 public:
  // Unit `index` of `layout`, sharded over `shard_size` ranks, this rank holding shard
  // `shard_rank`. Initialises the master shard from `seed`.
  FlatUnit(const model::ParameterLayout& layout, int index, int shard_size, int shard_rank, uint64_t seed,
           runtime::CachingAllocator* allocator);

  int index() const { return index_; }
  int64_t begin() const { return begin_; }  // in the model's flat buffer
  int64_t numel() const { return numel_; }
  int64_t shard_numel() const { return shard_numel_; }
  // This rank's real (unpadded) elements: [shard_begin, shard_begin + shard_real) of the unit.
  int64_t shard_begin() const { return shard_begin_; }
  int64_t shard_real() const { return shard_real_; }

  // The unsharded copies; valid between Gather's ready() and FreeParams, and between
  // AllocateGrads and ReduceGrads.
  float* params() const { return params_; }
  float* grads() const { return grads_; }
  const runtime::Event& ready() const { return ready_; }

  void Gather(comm::Communicator* shard, runtime::Stream& comm, train::CommStats* seconds);
  void FreeParams(runtime::Stream& stream);
  void AllocateGrads();
  void ReduceGrads(comm::Communicator* shard, runtime::Stream& comm, train::CommStats* seconds);
  void AllReduceReplicas(comm::Communicator* replica, runtime::Stream& comm, train::CommStats* seconds);

  // This rank's optimizer state, shard_real() elements each (checkpoints save and restore it).
  float* master() { return master_.data(); }
  float* adam_m() { return m_.data(); }
  float* adam_v() { return v_.data(); }

  void ZeroShardGrads();
  // The sum of squares of this rank's shard gradients; of the tensors every TP rank holds
  // whole, only with `tp_replicated` (so that the group counts them once).
  double ShardGradSquares(bool tp_replicated = true) const;
  // Gradients scaled by clip_scale, then AdamW on the shard (decay by tensor).
  void Update(const train::OptimizerStep& step, float clip_scale);

 private:
  struct Segment {  // a piece of one tensor inside the shard
    int64_t offset, size;
    bool decay, tp_replicated;
  };

  int index_;
  int64_t begin_, numel_, shard_numel_, shard_begin_, shard_real_;
  int shard_size_;
  runtime::CachingAllocator* allocator_;
  runtime::Buffer<float> master_, grad_, m_, v_;
  std::vector<Segment> segments_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  runtime::Event ready_;
};

}  // namespace meshtrain::parallel
