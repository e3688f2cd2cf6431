// Dropout masks as pure functions of a key and an element's index, the same on the host
// and in CUDA kernels (this header compiles as C++17 and as CUDA): every layout, every
// device and the backward drop exactly the elements the single-rank forward drops, and
// nothing is saved between them.
//
// The engine keys a step's masks by (seed, step), mixes in the layer and the site, and
// indexes an element by (its sample's index in the step's global batch, position,
// channel), so the number of ranks or micro-steps never changes a mask.
// Thread-safety: pure functions.

#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MESHTRAIN_HOST_DEVICE __host__ __device__
#else
#define MESHTRAIN_HOST_DEVICE
#endif

namespace meshtrain::kernels {

// A key from a parent key and a counter (the step, the layer, the site).
MESHTRAIN_HOST_DEVICE inline uint64_t MixKey(uint64_t key, uint64_t counter) {
  uint64_t x = key ^ (counter + 0x9E3779B97F4A7C15ull + (key << 6) + (key >> 2));
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Whether element `index` under `key` is kept at drop probability p: 24 random bits, a
// uniform in [0, 1) that a float holds exactly, against p.
MESHTRAIN_HOST_DEVICE inline bool DropoutKeeps(uint64_t key, uint64_t index, float p) {
  return float(MixKey(key, index) >> 40) * (1.0f / 16777216.0f) >= p;
}

}  // namespace meshtrain::kernels
