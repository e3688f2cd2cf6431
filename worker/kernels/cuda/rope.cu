// RoPE's kernel (launch.h): one launch rotates every q and k head of qkv in place, forward
// or backward (the negative angle). A thread takes V pairs (x[i], x[i + HS/2]) of one head
// of one token: 8 pairs, as 128-bit loads of both halves and of the fp32 cos and sin
// rows, where the head size and the pointers allow, else one.

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

// Over rows * heads * (half / V) threads: row r (position r % T), head h of the first
// `heads` of a row of `width` channels, pairs [i, i + V).
template <int V>
__global__ void RopeKernel(bf16* __restrict__ qkv, const float* __restrict__ cos, const float* __restrict__ sin,
                           int64_t rows, int T, int heads, int width, int HS, float direction) {
  const int half = HS / 2, vectors = half / V;
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (thread >= rows * heads * vectors) return;
  const int64_t row = thread / (int64_t(heads) * vectors);
  const int within = int(thread % (int64_t(heads) * vectors));
  const int head = within / vectors, i = (within % vectors) * V;
  const int64_t t = row % T;
  bf16* x = qkv + row * width + int64_t(head) * HS + i;
  float x1[V], x2[V], c[V], s[V];
  Load<V>(x, x1);
  Load<V>(x + half, x2);
  Load<V>(cos + t * half + i, c);
  Load<V>(sin + t * half + i, s);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float sj = direction * s[j];
    const float first = x1[j] * c[j] - x2[j] * sj;
    const float second = x2[j] * c[j] + x1[j] * sj;
    x1[j] = first;
    x2[j] = second;
  }
  Store<V>(x, x1);
  Store<V>(x + half, x2);
}

}  // namespace

void Rope(bf16* qkv, const float* cos, const float* sin, int B, int T, int NH, int KVH, int HS, bool backward,
          cudaStream_t stream) {
  const int64_t rows = int64_t(B) * T;
  const int heads = NH + KVH, half = HS / 2, width = (NH + 2 * KVH) * HS;
  if (rows == 0 || heads == 0 || half == 0) return;
  const float direction = backward ? -1.0f : 1.0f;
  // 8 pairs a thread: each half of a head is whole 16-byte vectors (HS a multiple of 16,
  // so rows and heads start on them too), and the cos and sin rows are whole float4s.
  const bool vector = half % 8 == 0 && Aligned(qkv, 16) && Aligned(cos, 16) && Aligned(sin, 16);
  if (vector) {
    RopeKernel<8><<<Blocks(rows * heads * (half / 8)), kThreads, 0, stream>>>(qkv, cos, sin, rows, T, heads, width,
                                                                              HS, direction);
  } else {
    RopeKernel<1><<<Blocks(rows * heads * half), kThreads, 0, stream>>>(qkv, cos, sin, rows, T, heads, width, HS,
                                                                        direction);
  }
  CheckLaunch(backward ? "RopeBackward" : "RopeForward",
              {{"B", B}, {"T", T}, {"NH", NH}, {"KVH", KVH}, {"HS", HS}});
}

}  // namespace meshtrain::kernels::cuda
