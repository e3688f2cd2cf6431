// SwiGLU's kernels (launch.h): one thread per V hidden units of one row, reading gate and
// up (the two halves of the row of gate_up) and writing out, or both halves of dgate_up;
// V = 8 (128-bit access) where H and the pointers allow, else 1. fp32 math on bf16 values
// as stored.

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Thread i: row i / (H / V), units [j, j + V) with j = (i % (H / V)) V.
template <int V>
__global__ void SwiGluForwardKernel(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int64_t N, int H) {
  const int vectors = H / V;
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (thread >= N * vectors) return;
  const int64_t row = thread / vectors;
  const int j = int(thread % vectors) * V;
  const bf16* gate = gate_up + row * 2 * H + j;
  float g[V], u[V];
  Load<V>(gate, g);
  Load<V>(gate + H, u);
#pragma unroll
  for (int k = 0; k < V; ++k) g[k] = g[k] * Sigmoid(g[k]) * u[k];  // silu(gate) * up
  Store<V>(out + row * H + j, g);
}

template <int V>
__global__ void SwiGluBackwardKernel(bf16* __restrict__ dgate_up, const bf16* __restrict__ dout,
                                     const bf16* __restrict__ gate_up, int64_t N, int H) {
  const int vectors = H / V;
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (thread >= N * vectors) return;
  const int64_t row = thread / vectors;
  const int j = int(thread % vectors) * V;
  const bf16* gate = gate_up + row * 2 * H + j;
  float g[V], u[V], d[V], dg[V], du[V];
  Load<V>(gate, g);
  Load<V>(gate + H, u);
  Load<V>(dout + row * H + j, d);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    // d silu(x) / dx = sigmoid(x) (1 + x (1 - sigmoid(x)))
    const float sigmoid = Sigmoid(g[k]);
    dg[k] = d[k] * u[k] * sigmoid * (1.0f + g[k] * (1.0f - sigmoid));
    du[k] = d[k] * g[k] * sigmoid;
  }
  bf16* dgate = dgate_up + row * 2 * H + j;
  Store<V>(dgate, dg);
  Store<V>(dgate + H, du);
}

}  // namespace

void SwiGluForward(bf16* out, const bf16* gate_up, int64_t N, int H, cudaStream_t stream) {
  if (N == 0 || H == 0) return;
  if (H % 8 == 0 && Aligned(out, 16) && Aligned(gate_up, 16)) {
    SwiGluForwardKernel<8><<<Blocks(N * (H / 8)), kThreads, 0, stream>>>(out, gate_up, N, H);
  } else {
    SwiGluForwardKernel<1><<<Blocks(N * H), kThreads, 0, stream>>>(out, gate_up, N, H);
  }
  CheckLaunch("SwiGluForward", {{"N", N}, {"H", H}});
}

void SwiGluBackward(bf16* dgate_up, const bf16* dout, const bf16* gate_up, int64_t N, int H, cudaStream_t stream) {
  if (N == 0 || H == 0) return;
  if (H % 8 == 0 && Aligned(dgate_up, 16) && Aligned(dout, 16) && Aligned(gate_up, 16)) {
    SwiGluBackwardKernel<8><<<Blocks(N * (H / 8)), kThreads, 0, stream>>>(dgate_up, dout, gate_up, N, H);
  } else {
    SwiGluBackwardKernel<1><<<Blocks(N * H), kThreads, 0, stream>>>(dgate_up, dout, gate_up, N, H);
  }
  CheckLaunch("SwiGluBackward", {{"N", N}, {"H", H}});
}

}  // namespace meshtrain::kernels::cuda
