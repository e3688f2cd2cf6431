// Elementwise kernels (launch.h): one thread per 128 bits (8 bf16 or 4 fp32) where every
// pointer is 16-byte aligned (a partial last vector element by element), else one thread
// per element.

#include <type_traits>

#include "worker/kernels/cuda/common.cuh"
#include "worker/kernels/dropout.h"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

// Thread i handles elements [i V, i V + V); the last, partial vector element by element.
template <int V, class Body>
__device__ __forceinline__ void ForVector(int64_t n, Body body) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (i + V <= n) {
    body(i, std::integral_constant<int, V>());
  } else {
    for (int64_t e = i; e < n; ++e) body(e, std::integral_constant<int, 1>());
  }
}

template <int V>
__global__ void AddKernel(bf16* out, const bf16* a, const bf16* b, int64_t n) {  // out may alias a or b
  ForVector<V>(n, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    float x[W], y[W];
    Load<W>(a + i, x);
    Load<W>(b + i, y);
#pragma unroll
    for (int j = 0; j < W; ++j) x[j] += y[j];
    Store<W>(out + i, x);
  });
}

template <int V>
__global__ void AccumulateKernel(float* __restrict__ into, const float* __restrict__ from, int64_t n, float scale) {
  ForVector<V>(n, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    float x[W], y[W];
    Load<W>(into + i, x);
    Load<W>(from + i, y);
#pragma unroll
    for (int j = 0; j < W; ++j) x[j] += scale * y[j];
    Store<W>(into + i, x);
  });
}

template <int V>
__global__ void CastKernel(bf16* __restrict__ to, const float* __restrict__ from, int64_t n) {
  ForVector<V>(n, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    float x[W];
    Load<W>(from + i, x);
    Store<W>(to + i, x);
  });
}

// Element (i, j) of (rows, width) is element (first_row + i) row_stride + first_column + j
// of the tensor its mask belongs to. out may be in.
template <int V>
__global__ void DropoutKernel(bf16* out, const bf16* in, int64_t rows, int width, float p, float scale, uint64_t key,
                              int64_t first_row, int64_t row_stride, int64_t first_column) {
  const int vectors = width / V;
  const int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= rows * vectors) return;
  const int64_t i = v / vectors;
  const int j = int(v % vectors) * V;
  const uint64_t index = uint64_t((first_row + i) * row_stride + first_column + j);
  float values[V];
  Load<V>(in + i * width + j, values);
#pragma unroll
  for (int e = 0; e < V; ++e) values[e] = DropoutKeeps(key, index + uint64_t(e), p) ? values[e] * scale : 0.0f;
  Store<V>(out + i * width + j, values);
}

}  // namespace

void Add(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (Aligned(out, 16) && Aligned(a, 16) && Aligned(b, 16)) {
    AddKernel<8><<<Blocks(CeilDiv(n, 8)), kThreads, 0, stream>>>(out, a, b, n);
  } else {
    AddKernel<1><<<Blocks(n), kThreads, 0, stream>>>(out, a, b, n);
  }
  CheckLaunch("Add", {{"n", n}});
}

void Accumulate(float* into, const float* from, int64_t n, float scale, cudaStream_t stream) {
  if (n == 0) return;
  if (Aligned(into, 16) && Aligned(from, 16)) {
    AccumulateKernel<4><<<Blocks(CeilDiv(n, 4)), kThreads, 0, stream>>>(into, from, n, scale);
  } else {
    AccumulateKernel<1><<<Blocks(n), kThreads, 0, stream>>>(into, from, n, scale);
  }
  CheckLaunch("Accumulate", {{"n", n}});
}

void Cast(bf16* to, const float* from, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (Aligned(to, 16) && Aligned(from, 16)) {
    CastKernel<8><<<Blocks(CeilDiv(n, 8)), kThreads, 0, stream>>>(to, from, n);
  } else {
    CastKernel<1><<<Blocks(n), kThreads, 0, stream>>>(to, from, n);
  }
  CheckLaunch("Cast", {{"n", n}});
}

void Dropout(bf16* out, const bf16* in, int64_t rows, int width, float p, uint64_t key, int64_t first_row,
             int64_t row_stride, int64_t first_column, cudaStream_t stream) {
  if (rows == 0 || width == 0) return;
  if (p <= 0) {  // nothing dropped: out = in
    if (out != in) {
      const cudaError_t status = cudaMemcpyAsync(out, in, size_t(rows) * width * sizeof(bf16), cudaMemcpyDeviceToDevice,
                                                 stream);
      if (status != cudaSuccess) ThrowLaunchError(status, "Dropout (copy)", "rows=" + std::to_string(rows));
    }
    return;
  }
  const float scale = 1.0f / (1.0f - p);
  if (width % 8 == 0 && Aligned(out, 16) && Aligned(in, 16)) {
    DropoutKernel<8><<<Blocks(rows * (width / 8)), kThreads, 0, stream>>>(out, in, rows, width, p, scale, key,
                                                                            first_row, row_stride, first_column);
  } else {
    DropoutKernel<1><<<Blocks(rows * width), kThreads, 0, stream>>>(out, in, rows, width, p, scale, key, first_row,
                                                                      row_stride, first_column);
  }
  CheckLaunch("Dropout", {{"rows", rows}, {"width", width}, {"first_row", first_row}, {"row_stride", row_stride},
                          {"first_column", first_column}});
}

}  // namespace meshtrain::kernels::cuda
