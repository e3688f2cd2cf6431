#include "worker/parallel/engine.h"

#include <stdexcept>
#include <string>

namespace meshtrain::parallel {

ShardFill FillFrom(const WholeState& whole, int64_t parameters) {
  if (int64_t(whole.master.size()) != parameters || int64_t(whole.m.size()) != parameters ||
      int64_t(whole.v.size()) != parameters) {
    throw std::invalid_argument("Restore: a state of " + std::to_string(whole.master.size()) +
                                " parameters for a model of " + std::to_string(parameters));
  }
  return [&whole](int, const std::vector<int64_t>& at, float* master, float* m, float* v) {
    for (size_t i = 0; i < at.size(); ++i) {
      const bool model = at[i] >= 0;
      master[i] = model ? whole.master[size_t(at[i])] : 0.0f;
      m[i] = model ? whole.m[size_t(at[i])] : 0.0f;
      v[i] = model ? whole.v[size_t(at[i])] : 0.0f;
    }
  };
}

const char* OpName(Op op) {
  switch (op) {
    case Op::kGather: return "gather";
    case Op::kForward: return "forward";
    case Op::kRecompute: return "recompute";
    case Op::kBackward: return "backward";
    case Op::kReduceScatter: return "reduce-scatter";
    case Op::kRelease: return "release";
  }
  return "?";
}

CommStats operator-(const CommStats& a, const CommStats& b) {
  return {a.all_gather - b.all_gather, a.reduce_scatter - b.reduce_scatter, a.all_reduce - b.all_reduce,
          a.exposed - b.exposed,       a.copy - b.copy,                     a.copy_exposed - b.copy_exposed,
          a.send - b.send,             a.recv - b.recv,                     a.neighbour_wait - b.neighbour_wait,
          a.ring - b.ring,             a.all_to_all - b.all_to_all};
}

}  // namespace meshtrain::parallel
