// The mixture-of-experts kernels (launch.h; contracts in kernels/ops.h): the router's
// softmax and top k (one warp a row), the dispatch order (chunks counted and ranked by one
// warp each, no atomics, so the order is the stable sort's on every run), and the row
// moves it drives. fp32 math on bf16 values as stored; every sum in a fixed order.

#include <climits>

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

constexpr unsigned kFullMask = 0xffffffffu;
// Chunks of the dispatch order's copies: at most this many, one warp (block) each.
constexpr int kPlanChunks = 256;

// --- The router ---

__global__ void RouterTopKForwardKernel(float* __restrict__ probs, int32_t* __restrict__ experts,
                                        float* __restrict__ weights, const bf16* __restrict__ logits, int64_t N,
                                        int E, int k, bool renormalize) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (row >= N) return;  // the whole warp
  const bf16* l = logits + row * E;
  float* p = probs + row * E;
  float max = -INFINITY;
  for (int e = lane; e < E; e += kWarp) max = fmaxf(max, __bfloat162float(l[e]));
  max = WarpMax(max);
  float sum = 0;
  for (int e = lane; e < E; e += kWarp) sum += expf(__bfloat162float(l[e]) - max);
  sum = WarpSum(sum);
  for (int e = lane; e < E; e += kWarp) p[e] = expf(__bfloat162float(l[e]) - max) / sum;
  // k passes over the probabilities as stored (each lane reads back its own), each taking
  // the first expert after the previous one in the order (probability descending, index
  // ascending); lane j keeps pass j's.
  float prev_p = INFINITY, total = 0, mine_p = 0;
  int prev_e = -1, mine_e = -1;
  for (int j = 0; j < k; ++j) {
    float best_p = -1.0f;
    int best_e = INT_MAX;
    for (int e = lane; e < E; e += kWarp) {
      const float v = p[e];
      if (!(v < prev_p || (v == prev_p && e > prev_e))) continue;
      if (v > best_p || (v == best_p && e < best_e)) best_p = v, best_e = e;
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const float other_p = __shfl_xor_sync(kFullMask, best_p, offset);
      const int other_e = __shfl_xor_sync(kFullMask, best_e, offset);
      if (other_p > best_p || (other_p == best_p && other_e < best_e)) best_p = other_p, best_e = other_e;
    }
    if (lane == j) mine_p = best_p, mine_e = best_e;
    total += best_p;
    prev_p = best_p, prev_e = best_e;
  }
  if (lane < k) {
    experts[row * k + lane] = mine_e;
    weights[row * k + lane] = renormalize ? mine_p / total : mine_p;
  }
}

// dp_e for expert e of a row: dprobs' plus, where e is chosen j, dw_j, or (dw_j - c) / s
// renormalised.
__device__ __forceinline__ float RouterDp(int e, const float* dprobs_row, const int32_t* chosen, const float* dw, int k,
                                          bool renormalize, float s, float c) {
  float dp = dprobs_row != nullptr ? dprobs_row[e] : 0.0f;
  for (int j = 0; j < k; ++j) {
    if (chosen[j] == e) dp += renormalize ? (dw[j] - c) / s : dw[j];
  }
  return dp;
}

__global__ void RouterTopKBackwardKernel(bf16* __restrict__ dlogits, const float* __restrict__ dweights,
                                         const float* __restrict__ dprobs, const float* __restrict__ probs,
                                         const int32_t* __restrict__ experts, int64_t N, int E, int k,
                                         bool renormalize) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (row >= N) return;
  const float* p = probs + row * E;
  const int32_t* chosen = experts + row * k;
  const float* dw = dweights + row * k;
  const float* dprobs_row = dprobs != nullptr ? dprobs + row * E : nullptr;
  float s = 0, c = 0;
  if (renormalize) {
    for (int j = 0; j < k; ++j) {
      if (chosen[j] >= 0 && chosen[j] < E) s += p[chosen[j]];
    }
    for (int j = 0; j < k; ++j) {
      if (chosen[j] >= 0 && chosen[j] < E) c += dw[j] * (p[chosen[j]] / s);
    }
  }
  float inner = 0;
  for (int e = lane; e < E; e += kWarp) inner += p[e] * RouterDp(e, dprobs_row, chosen, dw, k, renormalize, s, c);
  inner = WarpSum(inner);
  for (int e = lane; e < E; e += kWarp) {
    dlogits[row * E + e] = __float2bfloat16(p[e] * (RouterDp(e, dprobs_row, chosen, dw, k, renormalize, s, c) - inner));
  }
}

// --- The dispatch order ---

// The expert of copy i of a chunk ending at `end`, or -1 (past the end, or out of range).
__device__ __forceinline__ int PlanExpert(const int32_t* experts, int64_t i, int64_t end, int E) {
  if (i >= end) return -1;
  const int e = experts[i];
  return e >= 0 && e < E ? e : -1;
}

// One warp a block, block b the copies [b chunk, (b + 1) chunk): chunk_counts (chunks,E).
__global__ void PlanCountKernel(int32_t* __restrict__ chunk_counts, const int32_t* __restrict__ experts,
                                int64_t copies, int64_t chunk, int E) {
  extern __shared__ int32_t plan_counts[];
  const int lane = threadIdx.x;
  for (int e = lane; e < E; e += kWarp) plan_counts[e] = 0;
  __syncwarp();
  const int64_t begin = int64_t(blockIdx.x) * chunk;
  const int64_t end = begin + chunk < copies ? begin + chunk : copies;
  for (int64_t base = begin; base < end; base += kWarp) {
    const int e = PlanExpert(experts, base + lane, end, E);
    const unsigned same = __match_any_sync(kFullMask, e);
    if (e >= 0 && lane == __ffs(same) - 1) plan_counts[e] += __popc(same);
    __syncwarp();
  }
  for (int e = lane; e < E; e += kWarp) chunk_counts[int64_t(blockIdx.x) * E + e] = plan_counts[e];
}

// One block: counts (E) = the chunks' sums; then chunk_counts, in place, each chunk's first
// row per expert: the rows of the experts before, then of the chunks before.
__global__ void PlanScanKernel(int32_t* __restrict__ counts, int32_t* __restrict__ chunk_counts, int chunks, int E) {
  __shared__ int32_t first[kMaxMoeExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t total = 0;
    for (int b = 0; b < chunks; ++b) total += chunk_counts[int64_t(b) * E + e];
    counts[e] = total;
    first[e] = total;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int e = 0; e < E; ++e) {
      const int32_t count = first[e];
      first[e] = run;
      run += count;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t run = first[e];
    for (int b = 0; b < chunks; ++b) {
      const int32_t count = chunk_counts[int64_t(b) * E + e];
      chunk_counts[int64_t(b) * E + e] = run;
      run += count;
    }
  }
}

// One warp a block, walking its chunk in order, 32 copies at a time: a copy's row is its
// expert's next row in the chunk plus the copies of that expert on lower lanes.
__global__ void PlanRankKernel(int32_t* __restrict__ positions, const int32_t* __restrict__ chunk_first,
                               const int32_t* __restrict__ experts, int64_t copies, int64_t chunk, int E) {
  extern __shared__ int32_t plan_next[];
  const int lane = threadIdx.x;
  for (int e = lane; e < E; e += kWarp) plan_next[e] = chunk_first[int64_t(blockIdx.x) * E + e];
  __syncwarp();
  const int64_t begin = int64_t(blockIdx.x) * chunk;
  const int64_t end = begin + chunk < copies ? begin + chunk : copies;
  const unsigned lower_lanes = (1u << lane) - 1u;
  for (int64_t base = begin; base < end; base += kWarp) {
    const int64_t i = base + lane;
    const int e = PlanExpert(experts, i, end, E);
    const unsigned same = __match_any_sync(kFullMask, e);
    if (i < end) positions[i] = e >= 0 ? plan_next[e] + __popc(same & lower_lanes) : -1;
    __syncwarp();
    if (e >= 0 && lane == __ffs(same) - 1) plan_next[e] += __popc(same);
    __syncwarp();
  }
}

// --- Row moves: one thread a V channels of a row ---

template <int V>
__global__ void MoePermuteKernel(bf16* __restrict__ xs, const bf16* __restrict__ x,
                                 const int32_t* __restrict__ positions, int64_t copies, int k, int C) {
  const int vectors = C / V;
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (thread >= copies * vectors) return;
  const int64_t copy = thread / vectors;
  const int c = int(thread % vectors) * V;
  const int32_t to = positions[copy];
  if (to < 0) return;
  float v[V];
  Load<V>(x + (copy / k) * C + c, v);
  Store<V>(xs + int64_t(to) * C + c, v);
}

template <int V>
__global__ void MoePermuteBackwardKernel(bf16* __restrict__ dx, const bf16* __restrict__ dxs,
                                         const int32_t* __restrict__ positions, int64_t N, int k, int C) {
  const int vectors = C / V;
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (thread >= N * vectors) return;
  const int64_t n = thread / vectors;
  const int c = int(thread % vectors) * V;
  float sum[V] = {};
  for (int j = 0; j < k; ++j) {
    const int32_t from = positions[n * k + j];
    if (from < 0) continue;
    float d[V];
    Load<V>(dxs + int64_t(from) * C + c, d);
#pragma unroll
    for (int v = 0; v < V; ++v) sum[v] += d[v];
  }
  float o[V];
  Load<V>(dx + n * C + c, o);
#pragma unroll
  for (int v = 0; v < V; ++v) o[v] += sum[v];
  Store<V>(dx + n * C + c, o);
}

// out may be residual: each thread reads its elements of the residual before it writes them.
template <int V>
__global__ void MoeCombineForwardKernel(bf16* out, const bf16* __restrict__ ys, const float* __restrict__ weights,
                                        const int32_t* __restrict__ positions, const bf16* residual, int64_t N, int k,
                                        int C) {
  const int vectors = C / V;
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (thread >= N * vectors) return;
  const int64_t n = thread / vectors;
  const int c = int(thread % vectors) * V;
  float sum[V] = {};
  for (int j = 0; j < k; ++j) {
    const int32_t from = positions[n * k + j];
    if (from < 0) continue;
    const float w = weights[n * k + j];
    float y[V];
    Load<V>(ys + int64_t(from) * C + c, y);
#pragma unroll
    for (int v = 0; v < V; ++v) sum[v] += w * y[v];
  }
  if (residual != nullptr) {
    float r[V];
    Load<V>(residual + n * C + c, r);
#pragma unroll
    for (int v = 0; v < V; ++v) sum[v] += r[v];
  }
  Store<V>(out + n * C + c, sum);
}

// One block a row n; each of its k copies in turn: dys's row, and the dot product summed
// over the block (BlockSum: a fixed order).
template <int V>
__global__ void MoeCombineBackwardKernel(bf16* __restrict__ dys, float* __restrict__ dweights,
                                         const bf16* __restrict__ dout, const bf16* __restrict__ ys,
                                         const float* __restrict__ weights, const int32_t* __restrict__ positions,
                                         int k, int C) {
  const int64_t n = blockIdx.x;
  const bf16* d = dout + n * C;
  for (int j = 0; j < k; ++j) {
    const int32_t to = positions[n * k + j];
    const float w = weights[n * k + j];
    float dot = 0;
    if (to >= 0) {
      for (int c = threadIdx.x * V; c < C; c += blockDim.x * V) {
        float g[V], y[V], o[V];
        Load<V>(d + c, g);
        Load<V>(ys + int64_t(to) * C + c, y);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          dot += g[v] * y[v];
          o[v] = w * g[v];
        }
        Store<V>(dys + int64_t(to) * C + c, o);
      }
    }
    dot = BlockSum(dot);
    if (threadIdx.x == 0) dweights[n * k + j] = dot;
  }
}

}  // namespace

void RouterTopKForward(float* probs, int32_t* experts, float* weights, const bf16* logits, int64_t N, int E, int k,
                       bool renormalize, cudaStream_t stream) {
  if (N == 0) return;
  RouterTopKForwardKernel<<<Blocks(N, kWarpsPerBlock), kThreads, 0, stream>>>(probs, experts, weights, logits, N, E,
                                                                              k, renormalize);
  CheckLaunch("RouterTopKForward", {{"N", N}, {"E", E}, {"k", k}});
}

void RouterTopKBackward(bf16* dlogits, const float* dweights, const float* dprobs, const float* probs,
                        const int32_t* experts, int64_t N, int E, int k, bool renormalize, cudaStream_t stream) {
  if (N == 0) return;
  RouterTopKBackwardKernel<<<Blocks(N, kWarpsPerBlock), kThreads, 0, stream>>>(dlogits, dweights, dprobs, probs,
                                                                               experts, N, E, k, renormalize);
  CheckLaunch("RouterTopKBackward", {{"N", N}, {"E", E}, {"k", k}});
}

int64_t MoePermutePlanScratchInts(int max_experts) { return int64_t(kPlanChunks) * max_experts; }

void MoePermutePlan(int32_t* counts, int32_t* positions, const int32_t* experts, int64_t N, int k, int E,
                    int32_t* scratch, cudaStream_t stream) {
  if (E == 0) return;
  const int64_t copies = N * k;
  if (copies == 0) {
    const cudaError_t status = cudaMemsetAsync(counts, 0, sizeof(int32_t) * size_t(E), stream);
    if (status != cudaSuccess) ThrowLaunchError(status, "MoePermutePlan (no copies)", "E=" + std::to_string(E));
    return;
  }
  const int chunks = int(copies < int64_t(kPlanChunks) * kWarp ? CeilDiv(copies, kWarp) : kPlanChunks);
  const int64_t chunk = CeilDiv(copies, chunks);
  const size_t shared = sizeof(int32_t) * size_t(E);
  PlanCountKernel<<<chunks, kWarp, shared, stream>>>(scratch, experts, copies, chunk, E);
  CheckLaunch("MoePermutePlan (count)", {{"N", N}, {"k", k}, {"E", E}});
  PlanScanKernel<<<1, kThreads, 0, stream>>>(counts, scratch, chunks, E);
  CheckLaunch("MoePermutePlan (scan)", {{"N", N}, {"k", k}, {"E", E}});
  PlanRankKernel<<<chunks, kWarp, shared, stream>>>(positions, scratch, experts, copies, chunk, E);
  CheckLaunch("MoePermutePlan (rank)", {{"N", N}, {"k", k}, {"E", E}});
}

void MoePermute(bf16* xs, const bf16* x, const int32_t* positions, int64_t N, int k, int C, cudaStream_t stream) {
  const int64_t copies = N * k;
  if (copies == 0 || C == 0) return;
  if (C % 8 == 0 && Aligned(xs, 16) && Aligned(x, 16)) {
    MoePermuteKernel<8><<<Blocks(copies * (C / 8)), kThreads, 0, stream>>>(xs, x, positions, copies, k, C);
  } else {
    MoePermuteKernel<1><<<Blocks(copies * C), kThreads, 0, stream>>>(xs, x, positions, copies, k, C);
  }
  CheckLaunch("MoePermute", {{"N", N}, {"k", k}, {"C", C}});
}

void MoePermuteBackward(bf16* dx, const bf16* dxs, const int32_t* positions, int64_t N, int k, int C,
                        cudaStream_t stream) {
  if (N == 0 || C == 0) return;
  if (C % 8 == 0 && Aligned(dx, 16) && Aligned(dxs, 16)) {
    MoePermuteBackwardKernel<8><<<Blocks(N * (C / 8)), kThreads, 0, stream>>>(dx, dxs, positions, N, k, C);
  } else {
    MoePermuteBackwardKernel<1><<<Blocks(N * C), kThreads, 0, stream>>>(dx, dxs, positions, N, k, C);
  }
  CheckLaunch("MoePermuteBackward", {{"N", N}, {"k", k}, {"C", C}});
}

void MoeCombineForward(bf16* out, const bf16* ys, const float* weights, const int32_t* positions,
                       const bf16* residual, int64_t N, int k, int C, cudaStream_t stream) {
  if (N == 0 || C == 0) return;
  if (C % 8 == 0 && Aligned(out, 16) && Aligned(ys, 16) && (residual == nullptr || Aligned(residual, 16))) {
    MoeCombineForwardKernel<8><<<Blocks(N * (C / 8)), kThreads, 0, stream>>>(out, ys, weights, positions, residual,
                                                                              N, k, C);
  } else {
    MoeCombineForwardKernel<1><<<Blocks(N * C), kThreads, 0, stream>>>(out, ys, weights, positions, residual, N, k,
                                                                        C);
  }
  CheckLaunch("MoeCombineForward", {{"N", N}, {"k", k}, {"C", C}});
}

void MoeCombineBackward(bf16* dys, float* dweights, const bf16* dout, const bf16* ys, const float* weights,
                        const int32_t* positions, int64_t N, int k, int C, cudaStream_t stream) {
  if (N == 0 || k == 0) return;
  if (C % 8 == 0 && Aligned(dys, 16) && Aligned(dout, 16) && Aligned(ys, 16)) {
    MoeCombineBackwardKernel<8><<<int(N), kThreads, 0, stream>>>(dys, dweights, dout, ys, weights, positions, k, C);
  } else {
    MoeCombineBackwardKernel<1><<<int(N), kThreads, 0, stream>>>(dys, dweights, dout, ys, weights, positions, k, C);
  }
  CheckLaunch("MoeCombineBackward", {{"N", N}, {"k", k}, {"C", C}});
}

}  // namespace meshtrain::kernels::cuda
