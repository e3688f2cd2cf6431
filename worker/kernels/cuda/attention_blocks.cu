// Attention by blocks (attention_blocks.h): one warp per row, HS/32 channels a lane (R of
// them, R = 1, 2, 4 or 8, a template parameter so that they stay in registers), fp32
// throughout.

#include "worker/kernels/cuda/attention_blocks.h"

#include <type_traits>

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

constexpr int kBlockRowsPerBlock = 4;  // warps, each a row, of one sequence and head
constexpr int kBlockThreads = kBlockRowsPerBlock * kWarp;

// A head's HS channels into the lane's R registers: channel lane + 32 r, 0 past HS.
template <int R>
__device__ __forceinline__ void LoadHead(const bf16* __restrict__ p, int HS, int lane, float (&x)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = lane + kWarp * r;
    x[r] = c < HS ? __bfloat162float(p[c]) : 0.0f;
  }
}

// a . b over the head, on every lane of the warp.
template <int R>
__device__ __forceinline__ float HeadDot(const float (&a)[R], const float (&b)[R]) {
  float partial = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) partial += a[r] * b[r];
  return WarpSum(partial);
}

__device__ __forceinline__ int64_t At(BlockRows rows, int b, int t, int head, int HS) {
  return int64_t(b) * rows.batch + int64_t(t) * rows.row + int64_t(head) * HS;
}
__device__ __forceinline__ int64_t At(BlockStats stats, int b, int h, int t) {
  return int64_t(b) * stats.batch + int64_t(h) * stats.head + t;
}

// Grid (row tiles, heads, sequences); a warp's row past the last returns (no block-wide
// synchronisation follows).
template <int R>
__global__ void __launch_bounds__(kBlockThreads)
    BlockForwardKernel(float* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ q,
                       const bf16* __restrict__ k, const bf16* __restrict__ v, AttentionBlockShape s, float scale) {
  const int lane = threadIdx.x % kWarp, i = blockIdx.x * kBlockRowsPerBlock + threadIdx.x / kWarp;
  const int h = blockIdx.y, b = blockIdx.z, HS = s.HS;
  if (i >= s.Tq) return;
  const int g = h / (s.NH / s.KVH), n = s.causal ? i + 1 : s.Tk;
  float query[R];
  LoadHead<R>(q + At(s.q, b, i, h, HS), HS, lane, query);
  const bf16* keys = k + At(s.k, b, 0, g, HS);
  const bf16* values = v + At(s.v, b, 0, g, HS);
  float largest = -INFINITY, denominator = 0, sum[R] = {};
  for (int j = 0; j < n; ++j) {
    float key[R], value[R];
    LoadHead<R>(keys + int64_t(j) * s.k.row, HS, lane, key);
    LoadHead<R>(values + int64_t(j) * s.v.row, HS, lane, value);
    const float score = HeadDot<R>(query, key) * scale;
    const float next = fmaxf(largest, score);
    const float correction = expf(largest - next);  // 0 at the first key
    const float p = expf(score - next);
    denominator = denominator * correction + p;
#pragma unroll
    for (int r = 0; r < R; ++r) sum[r] = sum[r] * correction + p * value[r];
    largest = next;
  }
  float* o = out + At(s.out, b, i, h, HS);
  const float inverse = n > 0 ? 1.0f / denominator : 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = lane + kWarp * r;
    if (c < HS) o[c] = n > 0 ? sum[r] * inverse : 0.0f;
  }
  if (lane == 0) lse[At(s.stats, b, h, i)] = n > 0 ? largest + logf(denominator) : -INFINITY;
}

__global__ void __launch_bounds__(kBlockThreads)
    BlockMergeKernel(float* __restrict__ out, float* __restrict__ lse, const float* __restrict__ block_out,
                     const float* __restrict__ block_lse, AttentionBlockShape s) {
  const int lane = threadIdx.x % kWarp, t = blockIdx.x * kBlockRowsPerBlock + threadIdx.x / kWarp;
  const int h = blockIdx.y, b = blockIdx.z, HS = s.HS;
  if (t >= s.Tq) return;
  const int64_t at = At(s.stats, b, h, t);
  const float mine = lse[at], theirs = block_lse[at];
  if (theirs == -INFINITY) return;  // an empty block changes nothing
  float* o = out + At(s.out, b, t, h, HS);
  const float* bo = block_out + At(s.out, b, t, h, HS);
  float merged;
  if (mine == -INFINITY) {  // an empty accumulator takes the block, unread
    for (int c = lane; c < HS; c += kWarp) o[c] = bo[c];
    merged = theirs;
  } else {
    const float m = fmaxf(mine, theirs);
    const float a = expf(mine - m), w = expf(theirs - m), total = a + w;
    for (int c = lane; c < HS; c += kWarp) o[c] = (a * o[c] + w * bo[c]) / total;
    merged = m + logf(total);
  }
  __syncwarp();  // every lane has read lse
  if (lane == 0) lse[at] = merged;
}

__global__ void __launch_bounds__(kBlockThreads)
    BlockRowDotKernel(float* __restrict__ D, const bf16* __restrict__ dout, const bf16* __restrict__ out,
                      AttentionBlockShape s) {
  const int lane = threadIdx.x % kWarp, t = blockIdx.x * kBlockRowsPerBlock + threadIdx.x / kWarp;
  const int h = blockIdx.y, b = blockIdx.z, HS = s.HS;
  if (t >= s.Tq) return;
  const bf16* d = dout + At(s.dout, b, t, h, HS);
  const bf16* o = out + At(s.dout, b, t, h, HS);
  float partial = 0;
  for (int c = lane; c < HS; c += kWarp) partial += __bfloat162float(d[c]) * __bfloat162float(o[c]);
  const float total = WarpSum(partial);
  if (lane == 0) D[At(s.stats, b, h, t)] = total;
}

// dq, a query row (of head h) a warp: the sum over the keys it sees of dS_ij k_j.
template <int R>
__global__ void __launch_bounds__(kBlockThreads)
    BlockBackwardQueryKernel(float* __restrict__ dq, const bf16* __restrict__ dout, const bf16* __restrict__ q,
                             const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ lse,
                             const float* __restrict__ D, AttentionBlockShape s, float scale) {
  const int lane = threadIdx.x % kWarp, i = blockIdx.x * kBlockRowsPerBlock + threadIdx.x / kWarp;
  const int h = blockIdx.y, b = blockIdx.z, HS = s.HS;
  if (i >= s.Tq) return;
  const int g = h / (s.NH / s.KVH), n = s.causal ? i + 1 : s.Tk;
  float query[R], d[R], sum[R] = {};
  LoadHead<R>(q + At(s.q, b, i, h, HS), HS, lane, query);
  LoadHead<R>(dout + At(s.dout, b, i, h, HS), HS, lane, d);
  const float row_lse = lse[At(s.stats, b, h, i)], row_d = D[At(s.stats, b, h, i)];
  const bf16* keys = k + At(s.k, b, 0, g, HS);
  const bf16* values = v + At(s.v, b, 0, g, HS);
  for (int j = 0; j < n; ++j) {
    float key[R], value[R];
    LoadHead<R>(keys + int64_t(j) * s.k.row, HS, lane, key);
    LoadHead<R>(values + int64_t(j) * s.v.row, HS, lane, value);
    const float p = expf(HeadDot<R>(query, key) * scale - row_lse);
    const float ds = p * (HeadDot<R>(d, value) - row_d);
#pragma unroll
    for (int r = 0; r < R; ++r) sum[r] += ds * key[r];
  }
  float* row = dq + At(s.dq, b, i, h, HS);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = lane + kWarp * r;
    if (c < HS) row[c] += scale * sum[r];
  }
}

// dk and dv, a key row (of key/value head g) a warp: sums over the query heads of g's
// group, in order, and over the query rows that see the key, in order.
template <int R>
__global__ void __launch_bounds__(kBlockThreads)
    BlockBackwardKeyValueKernel(float* __restrict__ dk, float* __restrict__ dv, const bf16* __restrict__ dout,
                                const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                                const float* __restrict__ lse, const float* __restrict__ D, AttentionBlockShape s,
                                float scale) {
  const int lane = threadIdx.x % kWarp, j = blockIdx.x * kBlockRowsPerBlock + threadIdx.x / kWarp;
  const int g = blockIdx.y, b = blockIdx.z, HS = s.HS, group = s.NH / s.KVH;
  if (j >= s.Tk) return;
  float key[R], value[R], key_sum[R] = {}, value_sum[R] = {};
  LoadHead<R>(k + At(s.k, b, j, g, HS), HS, lane, key);
  LoadHead<R>(v + At(s.v, b, j, g, HS), HS, lane, value);
  for (int h = g * group; h < (g + 1) * group; ++h) {
    for (int i = s.causal ? j : 0; i < s.Tq; ++i) {
      float query[R], d[R];
      LoadHead<R>(q + At(s.q, b, i, h, HS), HS, lane, query);
      LoadHead<R>(dout + At(s.dout, b, i, h, HS), HS, lane, d);
      const int64_t stat = At(s.stats, b, h, i);
      const float p = expf(HeadDot<R>(query, key) * scale - lse[stat]);
      const float ds = p * (HeadDot<R>(d, value) - D[stat]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        key_sum[r] += ds * query[r];
        value_sum[r] += p * d[r];
      }
    }
  }
  float* key_row = dk + At(s.dk, b, j, g, HS);
  float* value_row = dv + At(s.dv, b, j, g, HS);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = lane + kWarp * r;
    if (c < HS) {
      key_row[c] += scale * key_sum[r];
      value_row[c] += value_sum[r];
    }
  }
}

// Calls launch(std::integral_constant<int, R>) with the fewest channels a lane, R, that
// hold HS. REQUIRES: HS <= kMaxAttentionBlockHeadSize (the table checks).
template <class Launch>
void WithLanes(int HS, Launch&& launch) {
  static_assert(kMaxAttentionBlockHeadSize == 8 * kWarp);
  if (HS <= kWarp) launch(std::integral_constant<int, 1>{});
  else if (HS <= 2 * kWarp) launch(std::integral_constant<int, 2>{});
  else if (HS <= 4 * kWarp) launch(std::integral_constant<int, 4>{});
  else launch(std::integral_constant<int, 8>{});
}

dim3 Grid(int rows, int heads, int B) { return dim3(unsigned(CeilDiv(rows, kBlockRowsPerBlock)), unsigned(heads), unsigned(B)); }

float Scale(int HS) { return 1.0f / sqrtf(float(HS)); }

}  // namespace

void AttentionBlockForward(float* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                           const AttentionBlockShape& s, cudaStream_t stream) {
  if (int64_t(s.B) * s.Tq == 0) return;
  WithLanes(s.HS, [&](auto lanes) {
    BlockForwardKernel<decltype(lanes)::value>
        <<<Grid(s.Tq, s.NH, s.B), kBlockThreads, 0, stream>>>(out, lse, q, k, v, s, Scale(s.HS));
  });
  CheckLaunch("AttentionBlockForward", {{"B", s.B}, {"Tq", s.Tq}, {"Tk", s.Tk}, {"NH", s.NH}, {"HS", s.HS}});
}

void AttentionMerge(float* out, float* lse, const float* block_out, const float* block_lse,
                    const AttentionBlockShape& s, cudaStream_t stream) {
  if (int64_t(s.B) * s.Tq == 0) return;
  BlockMergeKernel<<<Grid(s.Tq, s.NH, s.B), kBlockThreads, 0, stream>>>(out, lse, block_out, block_lse, s);
  CheckLaunch("AttentionMerge", {{"B", s.B}, {"Tq", s.Tq}, {"NH", s.NH}, {"HS", s.HS}});
}

void AttentionRowDot(float* D, const bf16* dout, const bf16* out, const AttentionBlockShape& s, cudaStream_t stream) {
  if (int64_t(s.B) * s.Tq == 0) return;
  BlockRowDotKernel<<<Grid(s.Tq, s.NH, s.B), kBlockThreads, 0, stream>>>(D, dout, out, s);
  CheckLaunch("AttentionRowDot", {{"B", s.B}, {"Tq", s.Tq}, {"NH", s.NH}, {"HS", s.HS}});
}

void AttentionBlockBackward(float* dq, float* dk, float* dv, const bf16* dout, const bf16* q, const bf16* k,
                            const bf16* v, const float* lse, const float* D, const AttentionBlockShape& s,
                            cudaStream_t stream) {
  if (int64_t(s.B) * s.Tq * s.Tk == 0) return;  // no pair of rows: nothing to add
  WithLanes(s.HS, [&](auto lanes) {
    constexpr int R = decltype(lanes)::value;
    BlockBackwardQueryKernel<R>
        <<<Grid(s.Tq, s.NH, s.B), kBlockThreads, 0, stream>>>(dq, dout, q, k, v, lse, D, s, Scale(s.HS));
    CheckLaunch("AttentionBlockBackward (dq)", {{"B", s.B}, {"Tq", s.Tq}, {"Tk", s.Tk}, {"NH", s.NH}, {"HS", s.HS}});
    BlockBackwardKeyValueKernel<R>
        <<<Grid(s.Tk, s.KVH, s.B), kBlockThreads, 0, stream>>>(dk, dv, dout, q, k, v, lse, D, s, Scale(s.HS));
    CheckLaunch("AttentionBlockBackward (dk, dv)",
                {{"B", s.B}, {"Tq", s.Tq}, {"Tk", s.Tk}, {"KVH", s.KVH}, {"HS", s.HS}});
  });
}

}  // namespace meshtrain::kernels::cuda
