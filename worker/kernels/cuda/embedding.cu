// The embedding's kernels (launch.h): the forward gathers rows of wte and wpe with 128-bit
// loads; the backward sums without atomics, in row order, so it repeats bit for bit and
// adds in the order the CPU does.

#include <algorithm>
#include <stdexcept>
#include <string>

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

// One thread per V channels of one row.
template <int V>
__global__ void EncoderForwardKernel(bf16* __restrict__ out, const int32_t* __restrict__ tokens,
                                     const bf16* __restrict__ wte, const bf16* __restrict__ wpe, int64_t N, int T,
                                     int C, int64_t v_begin, int64_t v_rows) {
  const int vectors = C / V;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * vectors) return;
  const int64_t row = i / vectors;
  const int c = int(i % vectors) * V;
  const int64_t local = int64_t(tokens[row]) - v_begin;
  float sum[V] = {};
  if (local >= 0 && local < v_rows) Load<V>(wte + local * C + c, sum);
  if (wpe != nullptr) {
    float position[V];
    Load<V>(wpe + int64_t(row % T) * C + c, position);
#pragma unroll
    for (int j = 0; j < V; ++j) sum[j] += position[j];
  }
  Store<V>(out + row * C + c, sum);
}

// Rows are scanned a warp at a time: lane l looks at rows base + q*32 + l, q < kScanDepth.
constexpr int kScanDepth = 4;
constexpr int kScanRows = kScanDepth * kWarp;

// dwte: one warp per row i of the batch. Only the first row holding a token works: it adds
// every row holding that token, in row order, into registers that start from dwte's row,
// so no two warps touch a row and the order is the CPU's. Lane l owns channels
// (l + 32 k) V .. + V for k < VPL, within a pass of 32 V VPL channels.
// dwpe: the blocks after those of dwte, one thread per V channels of one position.
template <int V, int VPL>
__global__ void EncoderBackwardKernel(float* __restrict__ dwte, float* __restrict__ dwpe,
                                      const bf16* __restrict__ dout, const int32_t* __restrict__ tokens, int B,
                                      int T, int C, int64_t v_begin, int64_t v_rows, int wte_blocks) {
  const int64_t N = int64_t(B) * T;
  if (int(blockIdx.x) >= wte_blocks) {
    const int vectors = C / V;
    const int64_t i = int64_t(blockIdx.x - wte_blocks) * blockDim.x + threadIdx.x;
    if (i >= int64_t(T) * vectors) return;
    const int t = int(i / vectors), c = int(i % vectors) * V;
    float sum[V];
    Load<V>(dwpe + int64_t(t) * C + c, sum);
    for (int b = 0; b < B; ++b) {
      float d[V];
      Load<V>(dout + (int64_t(b) * T + t) * C + c, d);
#pragma unroll
      for (int j = 0; j < V; ++j) sum[j] += d[j];
    }
    Store<V>(dwpe + int64_t(t) * C + c, sum);
    return;
  }

  const int lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (row >= N) return;
  const int token = tokens[row];
  const int64_t local = int64_t(token) - v_begin;
  if (local < 0 || local >= v_rows) return;
  // Is an earlier row holding the same token? Then that row's warp does the work.
  for (int64_t base = 0; base < row; base += kScanRows) {
    bool earlier = false;
#pragma unroll
    for (int q = 0; q < kScanDepth; ++q) {
      const int64_t j = base + q * kWarp + lane;
      earlier |= j < row && tokens[j] == token;
    }
    if (__any_sync(0xffffffffu, earlier)) return;
  }

  float* dwte_row = dwte + local * C;
  const int pass_channels = kWarp * V * VPL;
  for (int pass = 0; pass < C; pass += pass_channels) {
    float sum[VPL][V];
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
      const int c = pass + (lane + k * kWarp) * V;
      if (c < C) Load<V>(dwte_row + c, sum[k]);
    }
    for (int64_t base = row; base < N; base += kScanRows) {
#pragma unroll
      for (int q = 0; q < kScanDepth; ++q) {
        const int64_t j = base + q * kWarp + lane;
        unsigned matches = __ballot_sync(0xffffffffu, j < N && tokens[j] == token);
        while (matches != 0) {  // the matching rows of this group, in row order
          const int source = __ffs(matches) - 1;
          matches &= matches - 1;
          const bf16* dout_row = dout + (base + q * kWarp + source) * C;
#pragma unroll
          for (int k = 0; k < VPL; ++k) {
            const int c = pass + (lane + k * kWarp) * V;
            if (c < C) {
              float d[V];
              Load<V>(dout_row + c, d);
#pragma unroll
              for (int e = 0; e < V; ++e) sum[k][e] += d[e];
            }
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
      const int c = pass + (lane + k * kWarp) * V;
      if (c < C) Store<V>(dwte_row + c, sum[k]);
    }
  }
}

template <int V>
void LaunchEncoderBackward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int B, int T, int C,
                           int64_t v_begin, int64_t v_rows, cudaStream_t stream) {
  const int64_t N = int64_t(B) * T;
  const int wte_blocks = dwte != nullptr ? Blocks(N, kWarpsPerBlock) : 0;
  const int wpe_blocks = dwpe != nullptr ? Blocks(int64_t(T) * (C / V)) : 0;
  if (wte_blocks + wpe_blocks == 0) return;
  // Registers for at most 8 vectors a lane; wider rows take several passes.
  const int vectors_per_lane = int(CeilDiv(C, kWarp * V));
  const dim3 grid(wte_blocks + wpe_blocks);
  if (vectors_per_lane <= 1) {
    EncoderBackwardKernel<V, 1><<<grid, kThreads, 0, stream>>>(dwte, dwpe, dout, tokens, B, T, C, v_begin, v_rows,
                                                               wte_blocks);
  } else if (vectors_per_lane <= 2) {
    EncoderBackwardKernel<V, 2><<<grid, kThreads, 0, stream>>>(dwte, dwpe, dout, tokens, B, T, C, v_begin, v_rows,
                                                               wte_blocks);
  } else if (vectors_per_lane <= 4) {
    EncoderBackwardKernel<V, 4><<<grid, kThreads, 0, stream>>>(dwte, dwpe, dout, tokens, B, T, C, v_begin, v_rows,
                                                               wte_blocks);
  } else {
    EncoderBackwardKernel<V, 8><<<grid, kThreads, 0, stream>>>(dwte, dwpe, dout, tokens, B, T, C, v_begin, v_rows,
                                                               wte_blocks);
  }
}

}  // namespace

void EncoderForward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                    int64_t v_begin, int64_t v_rows, cudaStream_t stream) {
  const int64_t N = int64_t(B) * T;
  if (N == 0 || C == 0) return;
  const bool vector = C % 8 == 0 && Aligned(out, 16) && Aligned(wte, 16) && Aligned(wpe, 16);
  if (vector) {
    EncoderForwardKernel<8><<<Blocks(N * C / 8), kThreads, 0, stream>>>(out, tokens, wte, wpe, N, T, C, v_begin,
                                                                         v_rows);
  } else {
    EncoderForwardKernel<1><<<Blocks(N * C), kThreads, 0, stream>>>(out, tokens, wte, wpe, N, T, C, v_begin, v_rows);
  }
  CheckLaunch("EncoderForward", {{"B", B}, {"T", T}, {"C", C}, {"v_begin", v_begin}, {"v_rows", v_rows}});
}

void EncoderBackward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int B, int T, int C,
                     int64_t v_begin, int64_t v_rows, cudaStream_t stream) {
  if (int64_t(B) * T == 0 || C == 0) return;
  if (C > kMaxEncoderChannels) {
    throw std::invalid_argument("EncoderBackward: C = " + std::to_string(C) + " exceeds the " +
                                std::to_string(kMaxEncoderChannels) + " channels the CUDA kernel supports");
  }
  const bool vector = C % 8 == 0 && Aligned(dwte, 16) && Aligned(dwpe, 16) && Aligned(dout, 16);
  if (vector) {
    LaunchEncoderBackward<8>(dwte, dwpe, dout, tokens, B, T, C, v_begin, v_rows, stream);
  } else {
    LaunchEncoderBackward<1>(dwte, dwpe, dout, tokens, B, T, C, v_begin, v_rows, stream);
  }
  CheckLaunch("EncoderBackward", {{"B", B}, {"T", T}, {"C", C}, {"v_begin", v_begin}, {"v_rows", v_rows}});
}

}  // namespace meshtrain::kernels::cuda
