// GPT-2 parameters: one flat buffer with offsets, laid out by FSDP unit (DESIGN.md):
//   unit 0, the root:   wte (V,C)  wpe (maxT,C)  lnf.w (C)  lnf.b (C)
//   unit 1+l, block l:  ln1.w (C)  ln1.b (C)  qkv.w (3C,C)  qkv.b (3C)  attproj.w (C,C)  attproj.b (C)
//                       ln2.w (C)  ln2.b (C)  fc.w (4C,C)  fc.b (4C)  fcproj.w (C,4C)  fcproj.b (C)
// The token embedding wte is tied to the LM head.
//
// With tensor parallelism (Megatron), rank t of T holds a slice of the split tensors:
//   wte            rows VocabRange(): [floor(t*V/T), floor((t+1)*V/T)), so T need not
//                  divide V (GPT-2's 50257)   (vocabulary-parallel embedding and LM head),
//                  then zero rows up to a multiple of `vocab_multiple` (the engine's 128,
//                  as llm.c pads 50257 to 50304: products of odd widths run on slow kernels)
//   qkv.w, qkv.b   of each of q, k and v, rows [t*C/T, (t+1)*C/T): heads split (column-parallel)
//   attproj.w      columns [t*C/T, (t+1)*C/T)        (row-parallel)
//   fc.w, fc.b     rows [t*4C/T, (t+1)*4C/T)         (column-parallel)
//   fcproj.w       columns [t*4C/T, (t+1)*4C/T)      (row-parallel)
// and a whole copy of the rest (wpe, the LayerNorms, the row-parallel biases), which are
// `tp_replicated`. Offsets are local; GlobalIndex maps a local element to its index in
// the single-rank tensor, and the padding rows to none (-1): they are not part of the
// model, never train, and never reach a checkpoint or a file.
//
// Initialisation is a pure function of (seed, tensor, global element index), so any
// shard of any TP slice initialises its own elements and gets exactly the single-rank model.

#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "api/model_shape.h"

namespace meshtrain::model {

enum class Param {
  kWte, kWpe, kLnfW, kLnfB,
  kLn1W, kLn1B, kQkvW, kQkvB, kAttProjW, kAttProjB, kLn2W, kLn2B, kFcW, kFcB, kFcProjW, kFcProjB,
};

// How a tensor is split over the tensor-parallel group.
enum class TpSplit {
  kReplicated,  // whole on every rank
  kRows,        // dim 0 in T equal slices
  kQkvRows,     // dim 0 in three parts (q, k, v), each in T equal slices
  kColumns,     // dim 1 in T equal slices
};

struct ParamTensor {
  Param kind;
  int layer;  // -1 for root tensors
  std::string name;
  std::vector<int64_t> shape;  // this rank's slice
  int64_t offset = 0;
  int64_t size = 0;
  int64_t real = 0;  // the first `real` elements are the model's; the rest (wte's padding rows) are not
  bool decay = false;  // weight decay applies to matrices and embeddings, not biases or LayerNorm
  TpSplit split = TpSplit::kReplicated;
  int64_t slice_begin = 0;  // the first row (kRows) or column (kColumns) of the slice in the whole tensor
  bool tp_replicated() const { return split == TpSplit::kReplicated; }
};

class ParameterLayout {
 public:
  // Rank `tp_rank` of a tensor-parallel group of `tp_size` (1: the whole model), its
  // vocabulary slice padded to a multiple of `vocab_multiple`. Throws
  // std::invalid_argument, naming spec.parallelism.tensorParallelDegree, when tp_size does
  // not divide the heads or the MLP width.
  explicit ParameterLayout(const api::ModelShape& shape, int tp_rank = 0, int tp_size = 1, int vocab_multiple = 1);

  const api::ModelShape& shape() const { return shape_; }
  int tp_rank() const { return tp_rank_; }
  int tp_size() const { return tp_size_; }
  // [begin, end) of the vocabulary (wte's real rows) on this rank.
  std::pair<int64_t, int64_t> VocabRange() const;
  // wte's rows on this rank, padding included.
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
  int64_t Offset(Param kind, int layer = -1) const;
  int units() const { return int(shape_.layers) + 1; }
  // [begin, end) of FSDP unit u in the flat buffer.
  std::pair<int64_t, int64_t> Unit(int u) const;

 private:
  api::ModelShape shape_;
  int tp_rank_, tp_size_, vocab_multiple_;
  int64_t padded_vocab_rows_ = 0;
  std::vector<ParamTensor> tensors_;
  int64_t total_ = 0;
};

// Fills `params` (layout.total() elements): normal(0, 0.02) weights, residual
// projections scaled by 1/sqrt(2 * layers), LayerNorm weights 1, biases 0.
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
