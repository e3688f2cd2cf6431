// The loss's kernels (launch.h): one block per row of logits. An online softmax (a running
// max and sum of exponentials per thread, combined in a fixed tree) reads the row once for
// its statistics, and once more to write dlogits, which may overwrite the logits: every
// read of the first pass (and of the target's logit) comes before the block's barrier.

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

constexpr int kRowThreads = 512;
constexpr int kAddLossThreads = 1024;

// The row's (max, sum of exp(x - max)) over its first v_rows columns; every thread gets it.
template <int V>
__device__ MaxSum RowStatistics(const bf16* __restrict__ x, int64_t v_rows) {
  MaxSum local{-INFINITY, 0.0f};
  const int64_t vectors = (v_rows + V - 1) / V;
  for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
    float values[V];
    Load<V>(x + v * V, values);
    float largest = -INFINITY;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (v * V + j < v_rows) largest = fmaxf(largest, values[j]);
    }
    if (largest > local.max) {
      local.sum = local.max == -INFINITY ? 0.0f : local.sum * expf(local.max - largest);
      local.max = largest;
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (v * V + j < v_rows) local.sum += expf(values[j] - local.max);
    }
  }
  return BlockCombine(local);
}

// dlogits row = (exp(x - max) / sum - onehot(target)) * dloss on the real columns, 0 on
// the padding. target outside [0, v_rows): no one-hot (another slice holds it).
template <int V>
__device__ void WriteGradient(bf16* dlogits, const bf16* x, int64_t v_rows, int64_t Vp, float max, float sum,
                              int64_t target, float dloss) {
  const float inverse = 1.0f / sum;
  const int64_t vectors = Vp / V;
  for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
    float values[V] = {};
    if (v * V < v_rows) Load<V>(x + v * V, values);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t column = v * V + j;
      const float p = expf(values[j] - max) * inverse;
      values[j] = column < v_rows ? (p - (column == target ? 1.0f : 0.0f)) * dloss : 0.0f;
    }
    Store<V>(dlogits + v * V, values);
  }
}

// A masked row (target -1): no loss, and a zero gradient over the whole row.
template <int V>
__device__ void MaskedRow(float* losses, bf16* dlogits, int64_t row, int64_t Vp) {
  if (threadIdx.x == 0) losses[row] = 0.0f;
  if (dlogits == nullptr) return;
  float zeros[V] = {};
  for (int64_t v = threadIdx.x; v < Vp / V; v += blockDim.x) Store<V>(dlogits + row * Vp + v * V, zeros);
}

template <int V>
__global__ void CrossEntropyKernel(float* __restrict__ losses, bf16* dlogits, const bf16* logits,
                                   const int32_t* __restrict__ targets, int64_t v_rows, int64_t Vp, float dloss) {
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * Vp;
  const int64_t target = targets[row];
  if (target < 0) return MaskedRow<V>(losses, dlogits, row, Vp);
  const float target_logit = __bfloat162float(x[target]);
  const MaxSum stats = RowStatistics<V>(x, v_rows);  // ends with a barrier: the row is read
  if (threadIdx.x == 0) losses[row] = logf(stats.sum) + stats.max - target_logit;
  if (dlogits != nullptr) WriteGradient<V>(dlogits + row * Vp, x, v_rows, Vp, stats.max, stats.sum, target, dloss);
}

template <int V>
__global__ void VocabSliceStatsKernel(float* __restrict__ stats, const bf16* __restrict__ logits,
                                      const int32_t* __restrict__ targets, int64_t v_rows, int64_t Vp,
                                      int64_t v_begin) {
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * Vp;
  const MaxSum row_stats = RowStatistics<V>(x, v_rows);
  if (threadIdx.x == 0) {
    const int64_t local = targets != nullptr ? targets[row] - v_begin : -1;
    stats[3 * row] = row_stats.max;
    stats[3 * row + 1] = row_stats.sum;
    stats[3 * row + 2] = local >= 0 && local < v_rows ? __bfloat162float(x[local]) : 0.0f;
  }
}

// Every slice's (max, sum, target logit) for this row, combined in slice order.
template <int V>
__global__ void VocabSliceCrossEntropyKernel(float* __restrict__ losses, bf16* dlogits, const bf16* logits,
                                             const float* __restrict__ all_stats, int slices,
                                             const int32_t* __restrict__ targets, int64_t R, int64_t v_rows,
                                             int64_t Vp, int64_t v_begin, float dloss) {
  const int64_t row = blockIdx.x;
  if (targets[row] < 0) return MaskedRow<V>(losses, dlogits, row, Vp);
  float max = -INFINITY;
  for (int s = 0; s < slices; ++s) max = fmaxf(max, all_stats[3 * (s * R + row)]);
  float sum = 0, target_logit = 0;
  for (int s = 0; s < slices; ++s) {
    const float* st = all_stats + 3 * (s * R + row);
    sum += st[1] * expf(st[0] - max);
    target_logit += st[2];
  }
  if (threadIdx.x == 0) losses[row] = logf(sum) + max - target_logit;
  if (dlogits != nullptr) {
    WriteGradient<V>(dlogits + row * Vp, logits + row * Vp, v_rows, Vp, max, sum, targets[row] - v_begin, dloss);
  }
}

__global__ void AddLossKernel(double* sum, const float* __restrict__ losses, int64_t R, double scale) {
  double local = 0;
  for (int64_t r = threadIdx.x; r < R; r += blockDim.x) local += double(losses[r]);
  const double total = BlockSum(local);
  if (threadIdx.x == 0) *sum += scale * total;
}

bool VectorRows(const void* a, const void* b, int64_t Vp) { return Vp % 8 == 0 && Aligned(a, 16) && Aligned(b, 16); }

}  // namespace

void CrossEntropy(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets, int64_t R, int64_t v_rows,
                  int64_t Vp, float dloss, cudaStream_t stream) {
  if (R == 0) return;
  if (VectorRows(logits, dlogits, Vp)) {
    CrossEntropyKernel<8><<<R, kRowThreads, 0, stream>>>(losses, dlogits, logits, targets, v_rows, Vp, dloss);
  } else {
    CrossEntropyKernel<1><<<R, kRowThreads, 0, stream>>>(losses, dlogits, logits, targets, v_rows, Vp, dloss);
  }
  CheckLaunch("CrossEntropy", {{"R", R}, {"v_rows", v_rows}, {"Vp", Vp}});
}

void VocabSliceStats(float* stats, const bf16* logits, const int32_t* targets, int64_t R, int64_t v_rows, int64_t Vp,
                     int64_t v_begin, cudaStream_t stream) {
  if (R == 0) return;
  if (VectorRows(logits, nullptr, Vp)) {
    VocabSliceStatsKernel<8><<<R, kRowThreads, 0, stream>>>(stats, logits, targets, v_rows, Vp, v_begin);
  } else {
    VocabSliceStatsKernel<1><<<R, kRowThreads, 0, stream>>>(stats, logits, targets, v_rows, Vp, v_begin);
  }
  CheckLaunch("VocabSliceStats", {{"R", R}, {"v_rows", v_rows}, {"Vp", Vp}, {"v_begin", v_begin}});
}

void VocabSliceCrossEntropy(float* losses, bf16* dlogits, const bf16* logits, const float* all_stats, int slices,
                            const int32_t* targets, int64_t R, int64_t v_rows, int64_t Vp, int64_t v_begin,
                            float dloss, cudaStream_t stream) {
  if (R == 0) return;
  // Without dlogits a row is a few loads: one warp does it.
  const int threads = dlogits != nullptr ? kRowThreads : kWarp;
  if (VectorRows(logits, dlogits, Vp)) {
    VocabSliceCrossEntropyKernel<8><<<R, threads, 0, stream>>>(losses, dlogits, logits, all_stats, slices, targets, R,
                                                               v_rows, Vp, v_begin, dloss);
  } else {
    VocabSliceCrossEntropyKernel<1><<<R, threads, 0, stream>>>(losses, dlogits, logits, all_stats, slices, targets, R,
                                                               v_rows, Vp, v_begin, dloss);
  }
  CheckLaunch("VocabSliceCrossEntropy", {{"slices", slices}, {"R", R}, {"v_rows", v_rows}, {"Vp", Vp},
                                         {"v_begin", v_begin}});
}

void AddLoss(double* sum, const float* losses, int64_t R, double scale, cudaStream_t stream) {
  if (R == 0) return;
  AddLossKernel<<<1, kAddLossThreads, 0, stream>>>(sum, losses, R, scale);
  CheckLaunch("AddLoss", {{"R", R}});
}

}  // namespace meshtrain::kernels::cuda
