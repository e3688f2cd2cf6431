#include "worker/model/parameters.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>

namespace meshtrain::model {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

double CounterNormal(uint64_t seed, uint64_t tensor, uint64_t element) {
  const uint64_t bits = SplitMix64(SplitMix64(SplitMix64(seed) ^ tensor) ^ element);
  // Two uniforms in (0, 1] from the two halves, then Box-Muller.
  const double u1 = (double(bits >> 32) + 1.0) / 4294967296.0;
  const double u2 = double(bits & 0xFFFFFFFFull) / 4294967296.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

ParameterLayout::ParameterLayout(const api::ModelShape& shape) : shape_(shape) {
  const int64_t C = shape.hidden, V = shape.vocab_size, maxT = shape.seq_len;
  auto add = [&](Param kind, int layer, const char* name, std::vector<int64_t> dims, bool decay) {
    ParamTensor t{kind, layer, layer < 0 ? name : "h" + std::to_string(layer) + "." + name, std::move(dims), total_, 1,
                  decay};
    for (int64_t d : t.shape) t.size *= d;
    total_ += t.size;
    tensors_.push_back(std::move(t));
  };
  add(Param::kWte, -1, "wte", {V, C}, true);
  add(Param::kWpe, -1, "wpe", {maxT, C}, true);
  add(Param::kLnfW, -1, "lnf.w", {C}, false);
  add(Param::kLnfB, -1, "lnf.b", {C}, false);
  for (int l = 0; l < int(shape.layers); ++l) {
    add(Param::kLn1W, l, "ln1.w", {C}, false);
    add(Param::kLn1B, l, "ln1.b", {C}, false);
    add(Param::kQkvW, l, "qkv.w", {3 * C, C}, true);
    add(Param::kQkvB, l, "qkv.b", {3 * C}, false);
    add(Param::kAttProjW, l, "attproj.w", {C, C}, true);
    add(Param::kAttProjB, l, "attproj.b", {C}, false);
    add(Param::kLn2W, l, "ln2.w", {C}, false);
    add(Param::kLn2B, l, "ln2.b", {C}, false);
    add(Param::kFcW, l, "fc.w", {4 * C, C}, true);
    add(Param::kFcB, l, "fc.b", {4 * C}, false);
    add(Param::kFcProjW, l, "fcproj.w", {C, 4 * C}, true);
    add(Param::kFcProjB, l, "fcproj.b", {C}, false);
  }
}

int64_t ParameterLayout::Offset(Param kind, int layer) const {
  const int per_block = 12;
  const size_t index = layer < 0 ? size_t(kind) : 4 + size_t(layer) * per_block + (size_t(kind) - size_t(Param::kLn1W));
  if (index >= tensors_.size() || tensors_[index].kind != kind || tensors_[index].layer != layer) {
    throw std::out_of_range("no such parameter tensor");
  }
  return tensors_[index].offset;
}

std::pair<int64_t, int64_t> ParameterLayout::Unit(int u) const {
  if (u == 0) return {0, Offset(Param::kLnfB) + shape_.hidden};
  const int64_t begin = Offset(Param::kLn1W, u - 1);
  const int64_t end = u == units() - 1 ? total_ : Offset(Param::kLn1W, u);
  return {begin, end};
}

template <class T>
void InitParameterRange(T* out, const ParameterLayout& layout, uint64_t seed, int64_t begin, int64_t end) {
  const double residual_std = 0.02 / std::sqrt(2.0 * double(layout.shape().layers));
  for (size_t id = 0; id < layout.tensors().size(); ++id) {
    const ParamTensor& t = layout.tensors()[id];
    const int64_t from = std::max(begin, t.offset), to = std::min(end, t.offset + t.size);
    if (from >= to) continue;
    T* p = out + (from - begin);
    const bool is_ln_weight = t.kind == Param::kLn1W || t.kind == Param::kLn2W || t.kind == Param::kLnfW;
    const bool is_bias = !is_ln_weight && t.shape.size() == 1;
    const double stddev = (t.kind == Param::kAttProjW || t.kind == Param::kFcProjW) ? residual_std : 0.02;
#pragma omp parallel for
    for (int64_t i = from; i < to; ++i) {
      p[i - from] = is_ln_weight ? T(1)
                    : is_bias    ? T(0)
                                 : T(stddev * CounterNormal(seed, id, uint64_t(i - t.offset)));
    }
  }
}

template <class T>
void InitParameters(T* params, const ParameterLayout& layout, uint64_t seed) {
  InitParameterRange(params, layout, seed, 0, layout.total());
}

template void InitParameters<float>(float*, const ParameterLayout&, uint64_t);
template void InitParameters<double>(double*, const ParameterLayout&, uint64_t);
template void InitParameterRange<float>(float*, const ParameterLayout&, uint64_t, int64_t, int64_t);

}  // namespace meshtrain::model
