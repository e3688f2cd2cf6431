#include "worker/model/parameters.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numbers>
#include <stdexcept>

#include "api/engine_memory.h"
#include "api/model_family.h"

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

ParameterLayout::ParameterLayout(const api::ModelShape& shape, int tp_rank, int tp_size, int vocab_multiple,
                                 int ep_rank, int ep_size)
    : shape_(shape.Resolved()), tp_rank_(tp_rank), tp_size_(tp_size), vocab_multiple_(vocab_multiple),
      ep_rank_(ep_rank), ep_size_(ep_size) {
  if (ep_size < 1 || (ep_size > 1 && (shape_.experts < 1 || shape_.experts % ep_size != 0))) {
    throw std::invalid_argument("spec.parallelism.expertParallelDegree: must divide the experts (" +
                                std::to_string(shape_.experts) + "), got " + std::to_string(ep_size));
  }
  if (ep_rank < 0 || ep_rank >= ep_size) throw std::out_of_range("expert-parallel rank outside the group");
  const int64_t local_experts = ep_size > 1 ? shape_.experts / ep_size : shape_.experts;
  const int64_t T = tp_size;
  auto require = [&](int64_t n, const std::string& what) {
    if (T < 1 || n % T != 0) {
      throw std::invalid_argument("spec.parallelism.tensorParallelDegree: must divide " + what + " (" +
                                  std::to_string(n) + "), got " + std::to_string(T));
    }
  };
  for (const auto& [n, what] : shape_.Family().TensorParallelSplits(shape_)) require(n, what);
  if (tp_rank < 0 || tp_rank >= T) throw std::out_of_range("tensor-parallel rank outside the group");
  if (vocab_multiple < 1) throw std::invalid_argument("ParameterLayout: vocab_multiple must be at least 1");
  padded_vocab_rows_ = api::PaddedVocabRows(api::VocabSlice(shape_.vocab_size, tp_rank, tp_size), vocab_multiple);
  using enum TpSplit;
  int whole_id = 0;
  auto add = [&](const api::TensorInfo& info, int layer, bool expert) {
    std::vector<int64_t> dims = info.shape;
    int64_t begin = 0, real_rows = dims[0];
    if (info.split == kVocab) {
      begin = VocabRange().first;
      real_rows = VocabRange().second - begin;
      dims[0] = padded_vocab_rows_;
    } else if (info.split == kColumns) {
      dims[1] /= T;
      begin = tp_rank * dims[1];
    } else if (info.split != kReplicated) {
      dims[0] /= T;
      begin = tp_rank * dims[0];
    }
    ParamTensor t{info.kind, layer, layer < 0 ? info.name : "h" + std::to_string(layer) + "." + info.name,
                  std::move(dims), total_, 1, 0, info.decay, info.split, begin, info.init, whole_id - 1, expert};
    for (int64_t d : t.shape) t.size *= d;
    t.real = info.split == kVocab ? real_rows * (t.size / t.shape[0]) : t.size;
    total_ += t.size;
    tensors_.push_back(std::move(t));
  };
  auto unit = [&](const std::vector<api::TensorInfo>& infos, int layer) {
    unit_begin_.push_back(total_);
    unit_first_tensor_.push_back(tensors_.size());
    // Each expert's gate and up, then each one's down (api::Param): the i-th of a kind is expert i's.
    std::map<Param, int64_t> seen;
    for (const api::TensorInfo& info : infos) {
      ++whole_id;
      const bool expert =
          info.kind == Param::kExpertGate || info.kind == Param::kExpertUp || info.kind == Param::kExpertDown;
      if (expert) {
        const int64_t e = seen[info.kind]++;
        if (e / local_experts != ep_rank) continue;
        if (layer >= 0 && experts_in_unit_ == 0) experts_in_unit_ = total_ - unit_begin_.back();
      }
      add(info, layer, expert);
    }
  };
  const api::FamilyTensors family = api::TensorsOf(shape_);
  unit(family.embedding, -1);
  for (int l = 0; l < int(shape_.layers); ++l) unit(family.Block(shape_, l), l);
  if (!family.head.empty()) unit(family.head, -1);
  unit_begin_.push_back(total_);
  unit_first_tensor_.push_back(tensors_.size());
  if (experts_in_unit_ == 0 && blocks() > 0) experts_in_unit_ = Unit(1).second - Unit(1).first;
}

bool ParameterLayout::UnitHasExperts(int u) const {
  const auto [first, last] = UnitTensors(u);
  for (size_t i = first; i < last; ++i) {
    if (tensors_[i].expert) return true;
  }
  return false;
}

const ParamTensor& ParameterLayout::Tensor(Param kind, int layer) const {
  if (layer >= 0 && layer < blocks()) {
    const auto [first, last] = UnitTensors(layer + 1);
    for (size_t i = first; i < last; ++i) {
      if (tensors_[i].kind == kind) return tensors_[i];
    }
  } else if (layer < 0) {
    for (const ParamTensor& t : tensors_) {
      if (t.kind == kind && t.layer < 0) return t;
    }
  }
  throw std::out_of_range("no parameter tensor of this kind" + (layer >= 0 ? " in block " + std::to_string(layer) : ""));
}

bool ParameterLayout::Has(Param kind) const {
  return std::any_of(tensors_.begin(), tensors_.end(), [kind](const ParamTensor& t) { return t.kind == kind; });
}

int64_t ParameterLayout::OffsetInUnit(Param kind) const {
  for (int u = 0; u < units(); ++u) {
    const auto [first, last] = UnitTensors(u);
    for (size_t i = first; i < last; ++i) {
      if (tensors_[i].kind == kind) return tensors_[i].offset - unit_begin_[size_t(u)];
    }
  }
  throw std::out_of_range("no parameter tensor of this kind");
}

std::vector<int64_t> ParameterLayout::WholeIndices(int64_t begin, int64_t end) const {
  std::vector<int64_t> indices;
  indices.reserve(size_t(std::max<int64_t>(0, end - begin)));
  const ParameterLayout whole(shape_);
  for (size_t id = 0; id < tensors_.size(); ++id) {
    const ParamTensor& t = tensors_[id];
    const int64_t from = std::max(begin, t.offset), to = std::min(end, t.offset + t.size);
    for (int64_t i = from; i < to; ++i) {
      const int64_t global = GlobalIndex(t, i - t.offset);
      indices.push_back(global < 0 ? -1 : whole.tensors_[size_t(t.whole_id)].offset + global);
    }
  }
  return indices;
}

std::vector<std::pair<int64_t, int64_t>> ParameterLayout::RealRanges(int64_t begin, int64_t end) const {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const ParamTensor& t : tensors_) {
    const int64_t from = std::max(begin, t.offset), to = std::min(end, t.offset + t.real);
    if (from >= to) continue;
    if (!ranges.empty() && ranges.back().second == from) {
      ranges.back().second = to;
    } else {
      ranges.emplace_back(from, to);
    }
  }
  return ranges;
}

std::pair<int64_t, int64_t> ParameterLayout::VocabRange() const {
  const int64_t V = shape_.vocab_size;
  return {api::VocabBegin(V, tp_rank_, tp_size_), api::VocabBegin(V, tp_rank_ + 1, tp_size_)};
}

int64_t ParameterLayout::GlobalIndex(const ParamTensor& t, int64_t local) const {
  if (local >= t.real) return -1;  // a padding row
  const int64_t T = tp_size_, r = tp_rank_;
  const int64_t row_size = t.shape.size() > 1 ? t.shape[1] : 1;  // local elements per row
  switch (t.split) {
    case TpSplit::kReplicated: return local;
    case TpSplit::kVocab:
    case TpSplit::kRows: return t.slice_begin * row_size + local;
    case TpSplit::kQkvRows: {
      // Three local parts (q, k, v); part p of the whole tensor is T times as large.
      const int64_t part = t.size / 3, p = local / part;
      return p * T * part + r * part + local % part;
    }
    case TpSplit::kColumns: {
      const int64_t row = local / row_size, column = local % row_size;
      return row * row_size * T + t.slice_begin + column;
    }
  }
  return local;
}

template <class T>
void InitParameterRange(T* out, const ParameterLayout& layout, uint64_t seed, int64_t begin, int64_t end) {
  const double residual_std = 0.02 / std::sqrt(2.0 * double(layout.shape().layers));
  for (size_t id = 0; id < layout.tensors().size(); ++id) {
    const ParamTensor& t = layout.tensors()[id];
    const int64_t from = std::max(begin, t.offset), to = std::min(end, t.offset + t.size);
    if (from >= to) continue;
    T* p = out + (from - begin);
    const double stddev = t.init == api::Init::kResidual ? residual_std : 0.02;
#pragma omp parallel for
    for (int64_t i = from; i < to; ++i) {
      const int64_t global = layout.GlobalIndex(t, i - t.offset);
      p[i - from] = global < 0                    ? T(0)  // padding
                    : t.init == api::Init::kOnes  ? T(1)
                    : t.init == api::Init::kZeros ? T(0)
                                                  : T(stddev * CounterNormal(seed, uint64_t(t.whole_id), uint64_t(global)));
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
template void InitParameterRange<double>(double*, const ParameterLayout&, uint64_t, int64_t, int64_t);

}  // namespace meshtrain::model
