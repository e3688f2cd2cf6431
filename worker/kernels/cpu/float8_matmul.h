// The CPU emulation of float8 training's matmuls (issue 56): a linear layer's three
// products with their operands quantised to float8 as torchao's float8 training does
// (torchao/float8: Float8LinearConfig, hp_tensor_to_float8_dynamic), dequantised, and
// multiplied in fp32 by OpenBLAS's sgemm. Plain functions over host arrays, llm.c style:
// outputs first, a `d` prefix for a gradient, row-major and contiguous, each buffer's shape
// beside it.
//
// The linear layer is y (N,OC) = x (N,K) @ W (OC,K)^T, and its products
//   forward      out     (N,OC)  = q(inp)  (N,K)   @ q(weight) (OC,K)^T   contracts K
//   grad input   dinp    (N,K)   = q(dout) (N,OC)  @ q(weight) (OC,K)     contracts OC
//   grad weight  dweight (OC,K) += q(dout)^T (OC,N) @ q(inp)   (N,K)      contracts N
// where q(t) = DecodeFloat8(EncodeFloat8(t * scale)) / scale, elementwise, in fp32.
//
// Recipes (torchao's Float8LinearRecipeName):
//   kTensorwise  one scale per tensor, the same in every product it enters. E4M3 for inp
//                and weight, E5M2 for dout. Scales as computed (not rounded).
//   kRowwise     E4M3 throughout; a scale per row of each operand as it enters its
//                product, i.e. along that product's contraction axis, so each operand is
//                scaled along a different axis in the two products it enters:
//                  forward      inp per row (N scales, over K), weight per row (OC, over K)
//                  grad input   dout per row (N, over OC),     weight per column (K, over OC)
//                  grad weight  dout per column (OC, over N),  inp per column (K, over N)
//                Scales rounded down to a power of 2.
// Float8CastOf gives each operand's format and scale axis in each product.
//
// The steps, so that a caller can reduce across shards in between:
//   1. Float8Amax: amax = max |t| over the tensor, or per row, or per column. A max is
//      exact and order-free: the amax of a sharded tensor is the elementwise max of its
//      shards' amaxes (a MAX all-reduce over TP slices and FSDP shards), and a scale then
//      never depends on the layout.
//   2. Float8Scales: scale = the format's max / max(amax, 1e-12), as torchao's
//      amax_to_scale computes it (in fp64, rounded once to fp32), rounded down to a power
//      of 2 for the rowwise recipe.
//   3. The products take the scales (the reduced amaxes' scales) and quantise, dequantise
//      and multiply. QuantizeFloat8 and DequantizeFloat8 are the quantisation on its own
//      (the products call them): for float8 all-gathers, checks and tests.
// NaN: an amax of a tensor holding a NaN is NaN, and so is its scale; everything quantised
// with it is then NaN (0x7F codes), as in torchao. An infinite amax gives a scale of 0.
//
// Thread-safety: pure functions over the caller's arrays; loops run on OpenMP threads and
// the products use per-thread scratch, so calls with disjoint outputs may run concurrently
// from different threads. Every result is deterministic: the elementwise steps do not
// depend on the number of threads, and the products are sgemm's.

#pragma once

#include <cstdint>

#include "worker/kernels/float8.h"

namespace meshtrain::kernels::cpu {

// The recipe types and the scale of one amax (kernels/float8.h), as this file names them.
using kernels::Float8Cast;
using kernels::Float8CastOf;
using kernels::Float8Operand;
using kernels::Float8Recipe;
using kernels::Float8Scale;
using kernels::Float8ScaleCount;
using kernels::Float8Scaling;

// amax (Float8ScaleCount) = max |x| over the tensor, each row or each column of
// x (rows,cols); NaN where a NaN is among the values. An empty tensor's (or row's) is 0.
void Float8Amax(float* amax, const float* x, int64_t rows, int64_t cols, Float8Scaling scaling);

// scale (n) = Float8Scale of each amax (n).
void Float8Scales(float* scale, const float* amax, int64_t n, Float8 format, bool power_of_2);

// q (rows,cols) = EncodeFloat8(x * scale) of x (rows,cols), the product in fp32, rounded to
// nearest even and saturated; scale (Float8ScaleCount) as `scaling` lays them out.
void QuantizeFloat8(uint8_t* q, const float* x, const float* scale, int64_t rows, int64_t cols, Float8 format,
                    Float8Scaling scaling);
// x (rows,cols) = DecodeFloat8(q) / scale, in fp32, of q (rows,cols).
void DequantizeFloat8(float* x, const uint8_t* q, const float* scale, int64_t rows, int64_t cols, Float8 format,
                      Float8Scaling scaling);

// The products. Each operand's scales are those of its Float8CastOf(recipe, operand): one
// scale for kTensorwise; for kRowwise as many as the recipe's table above says, i.e.
// Float8ScaleCount of its scaling over the operand's shape. Outputs alias no input.
//
// out (N,OC) = q(inp) @ q(weight)^T; inp (N,K), inp_scale; weight (OC,K), weight_scale.
void Float8MatmulForward(float* out, const float* inp, const float* inp_scale, const float* weight,
                         const float* weight_scale, int64_t N, int K, int OC, Float8Recipe recipe);
// dinp (N,K) = q(dout) @ q(weight); dout (N,OC), dout_scale; weight (OC,K), weight_scale.
void Float8MatmulGradInput(float* dinp, const float* dout, const float* dout_scale, const float* weight,
                           const float* weight_scale, int64_t N, int K, int OC, Float8Recipe recipe);
// dweight (OC,K) += q(dout)^T @ q(inp); dout (N,OC), dout_scale; inp (N,K), inp_scale.
// Accumulated, as parameter gradients are (kernels/ops.h).
void Float8MatmulGradWeight(float* dweight, const float* dout, const float* dout_scale, const float* inp,
                            const float* inp_scale, int64_t N, int K, int OC, Float8Recipe recipe);

}  // namespace meshtrain::kernels::cpu
