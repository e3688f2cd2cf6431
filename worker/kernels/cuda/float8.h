// The bf16 table's own kernels around its float8 products (issue 56; kernels/ops.h,
// "Float8 products"; the products themselves are cuBLASLt's, in cuda_ops.cc): amaxes,
// scales, the casts of bf16 operands to float8 and the epilogues after a product.
// Internal to kernels/cuda. Like launch.h this header compiles as C++17 for nvcc and as
// C++20 for the table, so it names no meshtrain type beyond its own (the formats and axes
// mirror kernels/float8.h's; cuda_ops.cc maps them).
//
// Numerics, as kernels/float8.h and cpu/float8_matmul.h set them out:
// - An amax is computed on the bits (|x| of a bf16 is its bits without the sign, and
//   magnitudes order as those bits do), so it is exact, NaN-propagating (a NaN's bits lie
//   above infinity's), independent of the order of the reduction and of the fast-math
//   flags this library compiles with (no flush of subnormals).
// - A scale is kernels::Float8Scale's arithmetic: float(double(max) / max(double(amax),
//   1e-12)) in fp64 (which --use_fast_math leaves IEEE), NaN for a NaN amax, then for
//   power_of_2 the largest 2^e not above it, by clearing the mantissa's bits.
// - A cast is __nv_cvt_float_to_fp8(x * scale, __NV_SATFINITE): the product in fp32
//   (__fmul_rn), rounded to nearest even, saturated to the format's largest finite value,
//   NaN to NaN. (Flushing subnormal fp32 to zero cannot change a code: the smallest
//   float8 step is 2^-16, far above fp32's subnormals.)
// - An epilogue divides by the two scales with IEEE division (__fdiv_rn), not the fast
//   approximate one.
//
// Every launcher enqueues on `stream`, returns at once, allocates nothing and never
// synchronizes the host. A launch that fails throws runtime::cuda::CudaError naming the
// kernel and the shape (launch.h's ThrowLaunchError).
// Thread-safety: launchers share no state.

#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace meshtrain::kernels::cuda {

// kernels::Float8 and kernels::Float8Scaling, value for value (cuda_ops.cc maps them).
enum class Fp8Format { kE4M3, kE5M2 };
enum class Fp8Axis { kTensor, kRow, kColumn };

// amax (1, rows or cols floats) = max |x| over x (rows,cols) bf16, its rows or its
// columns; NaN where a NaN is among the values; 0 for none. Exact (computed on the bits).
void Fp8Amax(float* amax, const __nv_bfloat16* x, int64_t rows, int cols, Fp8Axis axis, cudaStream_t stream);

// scale (n) = Float8Scale(m_i, format, power_of_2), m_i = the max over c < copies of
// amax[c * copy_stride + i] (NaN when any is NaN).
void Fp8Scales(float* scale, const float* amax, int64_t n, int copies, int64_t copy_stride, Fp8Format format,
               bool power_of_2, cudaStream_t stream);

// q = the codes of x (rows,cols) times its scale (scale[0], scale[row] or scale[col] of x
// as `axis` says), in `format`. transpose false: q (rows,cols); true: q (cols,rows), the
// transpose of x's codes (q[col * rows + row]), so that a product contracting over x's
// rows reads its operand K-major, as cuBLASLt's float8 products ("TN") need.
void Fp8Cast(uint8_t* q, const __nv_bfloat16* x, const float* scale, int64_t rows, int cols, Fp8Format format,
             Fp8Axis axis, bool transpose, cudaStream_t stream);

// descale[0] = 1 / a[0], descale[1] = 1 / b[0] (IEEE): cuBLASLt's A and B scale pointers
// for a product of tensorwise-scaled operands.
void Fp8Descales(float* descale, const float* a, const float* b, cudaStream_t stream);

// After a product's fp32 sums acc (rows,cols), row-major: v = acc, divided by
// row_scale[r] * col_scale[c] where both are given (the rowwise recipe's product of unit
// scales), then
//   forward (bias, residual, gelu_pre nullable; residual excludes gelu_pre):
//     v += bias[c]; v += residual[r,c]; with gelu_pre: gelu_pre = v as stored, out = gelu(v);
//     else out = v
//   grad input (dgelu nullable): out = v * gelu'(dgelu[r,c])
// out, gelu_pre, residual and dgelu are (rows,cols) with leading dimension cols.
void Fp8Epilogue(__nv_bfloat16* out, __nv_bfloat16* gelu_pre, const float* acc, int64_t rows, int cols,
                 const float* row_scale, const float* col_scale, const __nv_bfloat16* bias,
                 const __nv_bfloat16* residual, const __nv_bfloat16* dgelu, cudaStream_t stream);

// into (rows,cols) += acc / (row_scale[r] * col_scale[c]): the rowwise recipe's weight
// gradient.
void Fp8AccumulateScaled(float* into, const float* acc, int64_t rows, int cols, const float* row_scale,
                         const float* col_scale, cudaStream_t stream);

}  // namespace meshtrain::kernels::cuda
