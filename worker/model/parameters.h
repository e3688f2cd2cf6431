// GPT-2 parameters: one flat buffer with offsets, laid out by FSDP unit (DESIGN.md):
//   unit 0, the root:   wte (V,C)  wpe (maxT,C)  lnf.w (C)  lnf.b (C)
//   unit 1+l, block l:  ln1.w (C)  ln1.b (C)  qkv.w (3C,C)  qkv.b (3C)  attproj.w (C,C)  attproj.b (C)
//                       ln2.w (C)  ln2.b (C)  fc.w (4C,C)  fc.b (4C)  fcproj.w (C,4C)  fcproj.b (C)
// The token embedding wte is tied to the LM head.
//
// Initialisation is a pure function of (seed, tensor, element index), so any shard
// of any layout can initialise its own elements and get exactly the single-rank model.

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

struct ParamTensor {
  Param kind;
  int layer;  // -1 for root tensors
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  int64_t size = 0;
  bool decay = false;  // weight decay applies to matrices and embeddings, not biases or LayerNorm
};

class ParameterLayout {
 public:
  explicit ParameterLayout(const api::ModelShape& shape);

  const api::ModelShape& shape() const { return shape_; }
  int64_t total() const { return total_; }
  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  int64_t Offset(Param kind, int layer = -1) const;
  int units() const { return int(shape_.layers) + 1; }
  // [begin, end) of FSDP unit u in the flat buffer.
  std::pair<int64_t, int64_t> Unit(int u) const;

 private:
  api::ModelShape shape_;
  std::vector<ParamTensor> tensors_;
  int64_t total_ = 0;
};

// Fills `params` (layout.total() elements): normal(0, 0.02) weights, residual
// projections scaled by 1/sqrt(2 * layers), LayerNorm weights 1, biases 0.
template <class T>
void InitParameters(T* params, const ParameterLayout& layout, uint64_t seed);

// Elements [begin, end) of the flat buffer InitParameters fills, into out[0, end - begin):
// a shard initialises itself, and the full model never exists on one rank.
template <class T>
void InitParameterRange(T* out, const ParameterLayout& layout, uint64_t seed, int64_t begin, int64_t end);

// The counter-based standard normal for (seed, tensor, element): the same value
// whichever rank computes it.
double CounterNormal(uint64_t seed, uint64_t tensor, uint64_t element);

}  // namespace meshtrain::model
