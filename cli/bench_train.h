// What the CPU and CUDA training benches share: the matrix products of one GPT-2
// training step, the rate at which a backend runs them, and the FLOP count per token.
// Internal to cli/.

#pragma once

#include <functional>

#include "api/model_shape.h"

namespace meshtrain::cli {

// A (tokens x k) by (k x n) product that a training step runs `count` times forward
// (out = in @ W^T) and twice backward (dIn = dOut @ W, dW = dOut^T @ In).
struct StepProduct {
  int k, n, count;
};

// GFLOP/s over a step's products, each weighted as the step weights it. `seconds`
// gives the time of one product's forward and two backward multiplications.
inline double StepMatrixGflops(const api::ModelShape& s, int tokens,
                               const std::function<double(const StepProduct&)>& seconds) {
  const int C = int(s.hidden), V = int(s.vocab_size), L = int(s.layers);
  const StepProduct products[] = {{C, 3 * C, L}, {C, C, L}, {C, 4 * C, L}, {4 * C, C, L}, {C, V, 1}};
  double flops = 0, total = 0;
  for (const StepProduct& p : products) {
    flops += double(p.count) * 3 * 2.0 * tokens * p.k * p.n;
    total += double(p.count) * seconds(p);
  }
  return flops / total / 1e9;
}

// 6N + 12LTC: the matrix FLOPs of forward and backward per token, attention included.
inline double FlopsPerToken(const api::ModelShape& s, int seq) {
  return 6 * double(s.ParameterCount()) + 12.0 * double(s.layers) * seq * double(s.hidden);
}

}  // namespace meshtrain::cli
