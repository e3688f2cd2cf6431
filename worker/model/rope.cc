// RoPE's table of cos and sin (model.h, RopeTable), as transformers computes its
// frequencies: the default 1 / theta^(2i / HS), rope_scaling "linear" dividing every one
// by the factor, and "llama3" dividing only the low frequencies (wavelengths past
// original_max_positions / low_freq_factor) by it, keeping the high ones (wavelengths
// below original_max_positions / high_freq_factor), and blending the band between.

#include <cmath>
#include <numbers>

#include "worker/model/model.h"

namespace meshtrain::model {

std::vector<double> RopeTable(const api::ModelShape& shape, const std::vector<int64_t>& positions) {
  const int64_t seq = int64_t(positions.size());
  const api::ModelShape s = shape.Resolved();
  const int half = int(s.head_dim / 2);
  const api::RopeScaling& scaling = s.rope_scaling;
  std::vector<double> frequencies(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(s.rope_theta, double(2 * i) / double(s.head_dim));
    if (scaling.type == "linear") {
      f /= scaling.factor;
    } else if (scaling.type == "llama3") {
      const double original = double(scaling.original_max_positions);
      const double low_wavelength = original / scaling.low_freq_factor;
      const double high_wavelength = original / scaling.high_freq_factor;
      const double wavelength = 2 * std::numbers::pi / f;
      if (wavelength > low_wavelength) {
        f /= scaling.factor;
      } else if (wavelength >= high_wavelength) {
        const double smooth =
            (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor);
        f = (1 - smooth) * f / scaling.factor + smooth * f;
      }
    }
    frequencies[size_t(i)] = f;
  }
  std::vector<double> table(2 * size_t(seq) * size_t(half));
  double* cos = table.data();
  double* sin = cos + seq * half;
  for (int64_t t = 0; t < seq; ++t) {
    for (int i = 0; i < half; ++i) {
      const double angle = double(positions[size_t(t)]) * frequencies[size_t(i)];
      cos[int64_t(t) * half + i] = std::cos(angle);
      sin[int64_t(t) * half + i] = std::sin(angle);
    }
  }
  return table;
}

}  // namespace meshtrain::model
