// The kernels around the float8 products (float8.h): amaxes on the bits, scales in fp64,
// casts to float8 (plain or transposing, through a shared-memory tile) and the fp32
// epilogues after a product.

#include <cuda_fp8.h>

#include <algorithm>

#include "worker/kernels/cuda/common.cuh"
#include "worker/kernels/cuda/float8.h"

namespace meshtrain::kernels::cuda {
namespace {
// A namespace of its own: this file shares unity units with the other kernel files.
namespace fp8 {

using namespace detail;

constexpr unsigned kFullMask = 0xffffffffu;

// |x|'s bits: the bf16's without its sign. Magnitudes order as these do; a NaN's lie above
// infinity's (0x7F80), so the max of a set holding a NaN is a NaN.
__device__ __forceinline__ unsigned Magnitude(bf16 x) { return unsigned(__bfloat16_as_ushort(x)) & 0x7FFFu; }
// The float of a magnitude's bits (exact: a bf16 is a float's upper half).
__device__ __forceinline__ float FloatOf(unsigned magnitude) { return __uint_as_float(magnitude << 16); }

__device__ __forceinline__ bool IsNaN(float x) { return (__float_as_uint(x) & 0x7FFFFFFFu) > 0x7F800000u; }

// One warp a row; V bf16 at a time (V = 8: 128-bit loads, cols a multiple of 8).
template <int V>
__global__ void AmaxRowsKernel(float* __restrict__ amax, const bf16* __restrict__ x, int64_t rows, int cols) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;  // the whole warp
  const bf16* p = x + row * cols;
  unsigned m = 0;
  for (int c = lane * V; c < cols; c += kWarp * V) {
    if constexpr (V == 8) {
      const int4 raw = *reinterpret_cast<const int4*>(p + c);
      const bf16* v = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) m = max(m, Magnitude(v[j]));
    } else {
      m = max(m, Magnitude(p[c]));
    }
  }
  m = __reduce_max_sync(kFullMask, m);
  if (lane == 0) amax[row] = FloatOf(m);
}

// A grid-stride sweep, each block's max then one atomicMax on the float's bits (amax
// zeroed first; non-negative floats order as their bits do).
__global__ void AmaxTensorKernel(float* __restrict__ amax, const bf16* __restrict__ x, int64_t n) {
  __shared__ unsigned warps[kWarpsPerBlock];
  unsigned m = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    m = max(m, Magnitude(x[i]));
  }
  m = __reduce_max_sync(kFullMask, m);
  if (threadIdx.x % kWarp == 0) warps[threadIdx.x / kWarp] = m;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kWarpsPerBlock; ++w) m = max(m, warps[w]);  // m is warps[0]
  if (m != 0) atomicMax(reinterpret_cast<unsigned*>(amax), m << 16);
}

// Block (32, 8): column c = 32 blockIdx.x + x over the rows of range blockIdx.y, 8 lanes
// of rows, then one atomicMax a column (amax zeroed first).
constexpr int kColumnLanes = 8;

__global__ void AmaxColumnsKernel(float* __restrict__ amax, const bf16* __restrict__ x, int64_t rows, int cols,
                                  int64_t rows_per_range) {
  __shared__ unsigned lanes[kColumnLanes][kWarp];
  const int c = blockIdx.x * kWarp + threadIdx.x;
  const int64_t begin = int64_t(blockIdx.y) * rows_per_range;
  const int64_t end = begin + rows_per_range < rows ? begin + rows_per_range : rows;
  unsigned m = 0;
  if (c < cols) {
    for (int64_t r = begin + threadIdx.y; r < end; r += kColumnLanes) m = max(m, Magnitude(x[r * cols + c]));
  }
  lanes[threadIdx.y][threadIdx.x] = m;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  for (int y = 1; y < kColumnLanes; ++y) m = max(m, lanes[y][threadIdx.x]);
  if (m != 0) atomicMax(reinterpret_cast<unsigned*>(amax + c), m << 16);
}

// kernels::Float8Scale of the max over the copies.
__global__ void ScalesKernel(float* __restrict__ scale, const float* __restrict__ amax, int64_t n, int copies,
                             int64_t copy_stride, double max_finite, bool power_of_2) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float m = amax[i];
  bool nan = IsNaN(m);
  for (int c = 1; c < copies; ++c) {
    const float a = amax[int64_t(c) * copy_stride + i];
    nan |= IsNaN(a);
    m = m < a ? a : m;
  }
  if (nan) {
    scale[i] = __uint_as_float(0x7FC00000u);
    return;
  }
  // torchao's amax_to_scale: in fp64 (IEEE whatever the fast-math flags), rounded once.
  const double clamped = double(m) > 1e-12 ? double(m) : 1e-12;
  float s = __double2float_rn(max_finite / clamped);
  const unsigned bits = __float_as_uint(s);
  if (power_of_2 && s > 0.0f && (bits & 0x7F800000u) != 0x7F800000u) {
    // The largest 2^e <= s: a normal's exponent alone; a subnormal's highest set bit.
    s = __uint_as_float((bits & 0x7F800000u) != 0 ? (bits & 0xFF800000u) : (1u << (31 - __clz(int(bits)))));
  }
  scale[i] = s;
}

__device__ __forceinline__ float ScaleOf(const float* scale, int axis, int64_t row, int64_t col) {
  return axis == int(Fp8Axis::kTensor) ? scale[0] : axis == int(Fp8Axis::kRow) ? scale[row] : scale[col];
}

__device__ __forceinline__ uint8_t Code(float x, float scale, __nv_fp8_interpretation_t format) {
  return uint8_t(__nv_cvt_float_to_fp8(__fmul_rn(x, scale), __NV_SATFINITE, format));
}

// V elements a thread, all in one row (V = 8: cols a multiple of 8, 16-byte aligned x and
// 8-byte aligned q).
template <int V>
__global__ void CastKernel(uint8_t* __restrict__ q, const bf16* __restrict__ x, const float* __restrict__ scale,
                           int64_t rows, int cols, int axis, __nv_fp8_interpretation_t format) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (i >= rows * cols) return;
  const int64_t row = i / cols;
  const int col = int(i - row * cols);
  float v[V];
  Load<V>(x + i, v);
  if constexpr (V == 8) {
    uint2 packed;
    uint8_t* codes = reinterpret_cast<uint8_t*>(&packed);
#pragma unroll
    for (int j = 0; j < 8; ++j) codes[j] = Code(v[j], ScaleOf(scale, axis, row, col + j), format);
    *reinterpret_cast<uint2*>(q + i) = packed;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) q[i + j] = Code(v[j], ScaleOf(scale, axis, row, col + j), format);
  }
}

// q (cols,rows) = the codes of x (rows,cols), transposed through a 32 x 32 tile; block
// (32, 8), rows along blockIdx.x (the longer axis: up to 2^31 tiles), columns along y.
constexpr int kTile = 32;
constexpr int kTileLanes = 8;

__global__ void CastTransposedKernel(uint8_t* __restrict__ q, const bf16* __restrict__ x,
                                     const float* __restrict__ scale, int64_t rows, int cols, int axis,
                                     __nv_fp8_interpretation_t format) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const int64_t r0 = int64_t(blockIdx.x) * kTile;
  const int c0 = blockIdx.y * kTile;
  for (int j = threadIdx.y; j < kTile; j += kTileLanes) {
    const int64_t r = r0 + j;
    const int c = c0 + threadIdx.x;
    if (r < rows && c < cols) {
      tile[j][threadIdx.x] = Code(__bfloat162float(x[r * cols + c]), ScaleOf(scale, axis, r, c), format);
    }
  }
  __syncthreads();
  for (int j = threadIdx.y; j < kTile; j += kTileLanes) {
    const int c = c0 + j;
    const int64_t r = r0 + threadIdx.x;
    if (r < rows && c < cols) q[int64_t(c) * rows + r] = tile[threadIdx.x][j];
  }
}

__global__ void DescalesKernel(float* descale, const float* a, const float* b) {
  descale[0] = __frcp_rn(a[0]);
  descale[1] = __frcp_rn(b[0]);
}

__global__ void EpilogueKernel(bf16* __restrict__ out, bf16* __restrict__ gelu_pre, const float* __restrict__ acc,
                               int64_t rows, int cols, const float* __restrict__ row_scale,
                               const float* __restrict__ col_scale, const bf16* __restrict__ bias,
                               const bf16* __restrict__ residual, const bf16* __restrict__ dgelu) {
  const int64_t n = rows * cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols;
    const int c = int(i - r * cols);
    float v = acc[i];
    if (row_scale != nullptr) v = __fdiv_rn(v, __fmul_rn(row_scale[r], col_scale[c]));
    if (bias != nullptr) v = __fadd_rn(v, __bfloat162float(bias[c]));
    if (residual != nullptr) v = __fadd_rn(v, __bfloat162float(residual[i]));
    if (gelu_pre != nullptr) {
      gelu_pre[i] = __float2bfloat16(v);
      out[i] = __float2bfloat16(Gelu(v));
    } else if (dgelu != nullptr) {
      out[i] = __float2bfloat16(__fmul_rn(v, GeluGrad(__bfloat162float(dgelu[i]))));
    } else {
      out[i] = __float2bfloat16(v);
    }
  }
}

__global__ void AccumulateScaledKernel(float* __restrict__ into, const float* __restrict__ acc, int64_t rows,
                                       int cols, const float* __restrict__ row_scale,
                                       const float* __restrict__ col_scale) {
  const int64_t n = rows * cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols;
    const int c = int(i - r * cols);
    into[i] = __fadd_rn(into[i], __fdiv_rn(acc[i], __fmul_rn(row_scale[r], col_scale[c])));
  }
}

__nv_fp8_interpretation_t Interpretation(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
}

// Blocks for a grid-stride sweep over n elements: enough to fill any device many times.
int StrideBlocks(int64_t n) { return int(std::min<int64_t>(CeilDiv(std::max<int64_t>(n, 1), kThreads), 65536)); }

void CheckMemset(cudaError_t status, const char* kernel, int64_t rows, int cols) {
  if (status != cudaSuccess) {
    ThrowLaunchError(status, kernel, "rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
  }
}

}  // namespace fp8
}  // namespace

void Fp8Amax(float* amax, const bf16* x, int64_t rows, int cols, Fp8Axis axis, cudaStream_t stream) {
  using namespace fp8;
  const int64_t n = rows * int64_t(cols);
  switch (axis) {
    case Fp8Axis::kRow: {
      if (rows == 0) return;
      const int blocks = int(CeilDiv(rows, kWarpsPerBlock));
      if (cols % 8 == 0 && Aligned(x, 16)) {
        AmaxRowsKernel<8><<<blocks, kThreads, 0, stream>>>(amax, x, rows, cols);
      } else {
        AmaxRowsKernel<1><<<blocks, kThreads, 0, stream>>>(amax, x, rows, cols);
      }
      CheckLaunch("Fp8AmaxRows", {{"rows", rows}, {"cols", cols}});
      return;
    }
    case Fp8Axis::kTensor: {
      CheckMemset(cudaMemsetAsync(amax, 0, sizeof(float), stream), "Fp8AmaxTensor (zeroing)", rows, cols);
      if (n == 0) return;
      AmaxTensorKernel<<<int(std::min<int64_t>(CeilDiv(n, kThreads), 1024)), kThreads, 0, stream>>>(amax, x, n);
      CheckLaunch("Fp8AmaxTensor", {{"rows", rows}, {"cols", cols}});
      return;
    }
    case Fp8Axis::kColumn: {
      if (cols == 0) return;
      CheckMemset(cudaMemsetAsync(amax, 0, sizeof(float) * size_t(cols), stream), "Fp8AmaxColumns (zeroing)", rows,
                  cols);
      if (rows == 0) return;
      // Enough row ranges to fill the device when there are few columns; at least 64 rows each.
      const int64_t column_blocks = CeilDiv(cols, kWarp);
      const int64_t ranges = std::clamp<int64_t>(CeilDiv(1024, column_blocks), 1, std::max<int64_t>(1, rows / 64));
      const int64_t rows_per_range = CeilDiv(rows, ranges);
      const dim3 grid(unsigned(column_blocks), unsigned(CeilDiv(rows, rows_per_range)));
      AmaxColumnsKernel<<<grid, dim3(kWarp, kColumnLanes), 0, stream>>>(amax, x, rows, cols, rows_per_range);
      CheckLaunch("Fp8AmaxColumns", {{"rows", rows}, {"cols", cols}});
      return;
    }
  }
}

void Fp8Scales(float* scale, const float* amax, int64_t n, int copies, int64_t copy_stride, Fp8Format format,
               bool power_of_2, cudaStream_t stream) {
  using namespace fp8;
  if (n == 0) return;
  const double max_finite = format == Fp8Format::kE4M3 ? 448.0 : 57344.0;
  ScalesKernel<<<Blocks(n), kThreads, 0, stream>>>(scale, amax, n, std::max(copies, 1), copy_stride, max_finite,
                                                   power_of_2);
  CheckLaunch("Fp8Scales", {{"n", n}, {"copies", copies}});
}

void Fp8Cast(uint8_t* q, const bf16* x, const float* scale, int64_t rows, int cols, Fp8Format format, Fp8Axis axis,
             bool transpose, cudaStream_t stream) {
  using namespace fp8;
  const int64_t n = rows * int64_t(cols);
  if (n == 0) return;
  const __nv_fp8_interpretation_t interpretation = Interpretation(format);
  if (transpose) {
    const dim3 grid(unsigned(CeilDiv(rows, kTile)), unsigned(CeilDiv(cols, kTile)));
    CastTransposedKernel<<<grid, dim3(kTile, kTileLanes), 0, stream>>>(q, x, scale, rows, cols, int(axis),
                                                                       interpretation);
    CheckLaunch("Fp8CastTransposed", {{"rows", rows}, {"cols", cols}});
    return;
  }
  if (cols % 8 == 0 && Aligned(x, 16) && Aligned(q, 8)) {
    CastKernel<8><<<Blocks(n / 8), kThreads, 0, stream>>>(q, x, scale, rows, cols, int(axis), interpretation);
  } else {
    CastKernel<1><<<Blocks(n), kThreads, 0, stream>>>(q, x, scale, rows, cols, int(axis), interpretation);
  }
  CheckLaunch("Fp8Cast", {{"rows", rows}, {"cols", cols}});
}

void Fp8Descales(float* descale, const float* a, const float* b, cudaStream_t stream) {
  fp8::DescalesKernel<<<1, 1, 0, stream>>>(descale, a, b);
  detail::CheckLaunch("Fp8Descales", {});
}

void Fp8Epilogue(bf16* out, bf16* gelu_pre, const float* acc, int64_t rows, int cols, const float* row_scale,
                 const float* col_scale, const bf16* bias, const bf16* residual, const bf16* dgelu,
                 cudaStream_t stream) {
  using namespace fp8;
  const int64_t n = rows * int64_t(cols);
  if (n == 0) return;
  EpilogueKernel<<<StrideBlocks(n), kThreads, 0, stream>>>(out, gelu_pre, acc, rows, cols, row_scale, col_scale, bias,
                                                           residual, dgelu);
  CheckLaunch("Fp8Epilogue", {{"rows", rows}, {"cols", cols}});
}

void Fp8AccumulateScaled(float* into, const float* acc, int64_t rows, int cols, const float* row_scale,
                         const float* col_scale, cudaStream_t stream) {
  using namespace fp8;
  const int64_t n = rows * int64_t(cols);
  if (n == 0) return;
  AccumulateScaledKernel<<<StrideBlocks(n), kThreads, 0, stream>>>(into, acc, rows, cols, row_scale, col_scale);
  CheckLaunch("Fp8AccumulateScaled", {{"rows", rows}, {"cols", cols}});
}

}  // namespace meshtrain::kernels::cuda
