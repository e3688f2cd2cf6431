// A model's parameters: one flat buffer with offsets, laid out by FSDP unit from its
// family's description (api/model_family.h): the embedding unit, one unit per block (the
// same tensors at the same offsets in each; a mixture's dense blocks hold theirs, the
// attention's at the sparse blocks' offsets), and the head unit when the head is untied.
//
// With tensor parallelism (Megatron), rank t of T holds a slice of the split tensors
// (api::TpSplit): the vocabulary rows [floor(t*V/T), floor((t+1)*V/T)) of an embedding or
// head, then zero rows up to a multiple of `vocab_multiple` (the engine's 128, as llm.c
// pads 50257 to 50304: products of odd widths run on slow kernels); its rows of a
// column-parallel product (its heads, its MLP units); its columns of a row-parallel one;
// and a whole copy of the rest, which are `tp_replicated`. Offsets are local; GlobalIndex
// maps a local element to its index in the single-rank tensor, and padding rows to none
// (-1): they are not part of the model, never train, and never reach a checkpoint or a file.
//
// With expert parallelism, rank j of EP holds the whole tensors of its experts [j E/EP,
// (j+1) E/EP) of each mixture-of-experts block and none of the others'; every other tensor
// it holds like any rank. Each block still holds its tensors at the same offsets.
//
// Initialisation is a pure function of (seed, tensor, global element index), so any
// shard of any TP slice initialises its own elements and gets exactly the single-rank model.

#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "api/model_family.h"
#include "api/model_shape.h"

namespace meshtrain::model {

using Param = api::Param;
using TpSplit = api::TpSplit;

struct ParamTensor {
  Param kind;
  int layer;  // -1 outside blocks
  std::string name;  // "wte", "h3.qkv.w"
  std::vector<int64_t> shape;  // this rank's slice
  int64_t offset = 0;
  int64_t size = 0;
  int64_t real = 0;  // the first `real` elements are the model's; the rest (vocabulary padding rows) are not
  bool decay = false;  // weight decay applies to matrices and embeddings, not biases or norms
  TpSplit split = TpSplit::kReplicated;
  int64_t slice_begin = 0;  // the first row (kRows, kVocab) or column (kColumns) of the slice in the whole tensor
  api::Init init = api::Init::kNormal;
  int whole_id = 0;     // its index in the single-rank model's tensors()
  bool expert = false;  // an expert's: one rank of an expert group holds it
  bool tp_replicated() const { return split == TpSplit::kReplicated; }
};

class ParameterLayout {
 public:
  // Rank `tp_rank` of a tensor-parallel group of `tp_size` (1: the whole model), its
  // vocabulary slices padded to a multiple of `vocab_multiple`. Throws
  // std::invalid_argument, naming spec.parallelism.tensorParallelDegree, when tp_size does
  // not divide the heads, the key/value heads or the MLP width.
  // Rank `ep_rank` of an expert group of `ep_size` holds its experts only; throws
  // std::invalid_argument, naming spec.parallelism.expertParallelDegree, when ep_size
  // does not divide the experts.
  explicit ParameterLayout(const api::ModelShape& shape, int tp_rank = 0, int tp_size = 1, int vocab_multiple = 1,
                           int ep_rank = 0, int ep_size = 1);

  const api::ModelShape& shape() const { return shape_; }
  int tp_rank() const { return tp_rank_; }
  int tp_size() const { return tp_size_; }
  int ep_rank() const { return ep_rank_; }
  int ep_size() const { return ep_size_; }
  // Where a block's experts start in its unit (the unit's end where it has none): what
  // comes before is every expert group member's alike.
  int64_t ExpertsInUnit() const { return experts_in_unit_; }
  // Whether unit u holds experts.
  bool UnitHasExperts(int u) const;
  // [begin, end) of the vocabulary (an embedding's real rows) on this rank.
  std::pair<int64_t, int64_t> VocabRange() const;
  // An embedding's or head's rows on this rank, padding included.
  int64_t padded_vocab_rows() const { return padded_vocab_rows_; }
  int vocab_multiple() const { return vocab_multiple_; }
  // For elements [begin, end) of this layout's flat buffer, their indices in the
  // single-rank model's flat buffer (unpadded), -1 for padding.
  std::vector<int64_t> WholeIndices(int64_t begin, int64_t end) const;
  // The runs of model elements (not padding) in [begin, end), in order.
  std::vector<std::pair<int64_t, int64_t>> RealRanges(int64_t begin, int64_t end) const;
  // The index in the single-rank tensor of element `local` of this rank's slice of `t`,
  // or -1 for padding.
  int64_t GlobalIndex(const ParamTensor& t, int64_t local) const;
  int64_t total() const { return total_; }
  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  // The tensor of `kind` (in block `layer`); throws std::out_of_range if there is none.
  const ParamTensor& Tensor(Param kind, int layer = -1) const;
  int64_t Offset(Param kind, int layer = -1) const { return Tensor(kind, layer).offset; }
  // Whether the family has a tensor of `kind`.
  bool Has(Param kind) const;
  // The offset of `kind` inside its unit: the same in every block that holds it.
  int64_t OffsetInUnit(Param kind) const;

  // Units: 0 the embedding, 1 + l block l, then the head's when the head is untied.
  int units() const { return int(unit_begin_.size()) - 1; }
  int blocks() const { return int(shape_.layers); }
  bool has_head_unit() const { return units() == blocks() + 2; }
  // The unit that holds the LM head: the head's, or the embedding's when tied.
  int head_unit() const { return has_head_unit() ? units() - 1 : 0; }
  // [begin, end) of FSDP unit u in the flat buffer.
  std::pair<int64_t, int64_t> Unit(int u) const { return {unit_begin_[size_t(u)], unit_begin_[size_t(u) + 1]}; }
  // The tensors of unit u (their indices in tensors()).
  std::pair<size_t, size_t> UnitTensors(int u) const {
    return {unit_first_tensor_[size_t(u)], unit_first_tensor_[size_t(u) + 1]};
  }

 private:
  api::ModelShape shape_;
  int tp_rank_, tp_size_, vocab_multiple_, ep_rank_ = 0, ep_size_ = 1;
  int64_t experts_in_unit_ = 0;
  int64_t padded_vocab_rows_ = 0;
  std::vector<ParamTensor> tensors_;
  std::vector<int64_t> unit_begin_;       // units() + 1 entries
  std::vector<size_t> unit_first_tensor_;  // units() + 1 entries
  int64_t total_ = 0;
};

// Fills `params` (layout.total() elements): normal(0, 0.02) weights, GPT-2's residual
// projections scaled by 1/sqrt(2 * layers), norm weights 1, biases 0 (api::Init).
template <class T>
void InitParameters(T* params, const ParameterLayout& layout, uint64_t seed);

// Elements [begin, end) of the flat buffer InitParameters fills for `layout` (a TP
// slice: its elements of the single-rank model), into out[0, end - begin): a shard
// initialises itself, and the full model never exists on one rank.
template <class T>
void InitParameterRange(T* out, const ParameterLayout& layout, uint64_t seed, int64_t begin, int64_t end);

// The counter-based standard normal for (seed, tensor, element): the same value
// whichever rank computes it.
double CounterNormal(uint64_t seed, uint64_t tensor, uint64_t element);

}  // namespace meshtrain::model
