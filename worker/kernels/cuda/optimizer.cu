// The shard operations' kernels (launch.h): the gradient norm in fp64 (a fixed grid of
// blocks, each summing a fixed share, then one block adding the blocks in order), the
// clipping factor on the device, and AdamW over every segment in one launch: each block
// takes chunks of the segments' elements, finding a chunk's segment in a table of chunk
// counts that it builds in shared memory from the segments.

#include <cub/block/block_scan.cuh>

#include <stdexcept>
#include <string>

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

constexpr int kAdamWThreads = 256;
constexpr int kAdamWElementsPerThread = 8;
constexpr int kAdamWChunk = kAdamWThreads * kAdamWElementsPerThread;
constexpr int kSegmentsPerThread = kMaxAdamWSegments / kAdamWThreads;

// Block b sums grid-strided elements of every counted segment, in segment order: the
// elements before the first 16-byte boundary, then 4 at a time, then the rest.
__global__ void SumSquaresKernel(double* __restrict__ partials, const float* __restrict__ grads,
                                 const Segment* __restrict__ segments, int count) {
  double local = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x, me = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  auto add = [&](float g) { local += double(g) * double(g); };
  for (int s = 0; s < count; ++s) {
    const Segment segment = segments[s];
    if (segment.in_norm == 0) continue;
    const float* g = grads + segment.offset;
    const int64_t misaligned = int64_t((16 - reinterpret_cast<uintptr_t>(g) % 16) / 4 % 4);
    const int64_t head = misaligned < segment.size ? misaligned : segment.size;
    const int64_t quads = (segment.size - head) / 4;
    if (me < head) add(g[me]);
    const float4* body = reinterpret_cast<const float4*>(g + head);
    for (int64_t q = me; q < quads; q += stride) {
      const float4 v = body[q];
      add(v.x);
      add(v.y);
      add(v.z);
      add(v.w);
    }
    const int64_t tail = head + 4 * quads;
    if (me < segment.size - tail) add(g[tail + me]);
  }
  const double total = BlockSum(local);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void SumSquaresFinishKernel(double* sum, const double* __restrict__ partials, int blocks) {
  double local = 0;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) local += partials[b];
  const double total = BlockSum(local);
  if (threadIdx.x == 0) *sum += total;
}

__global__ void ClipScaleKernel(float* scale, const double* sum_of_squares, float max_norm) {
  const double norm = sqrt(*sum_of_squares);
  *scale = max_norm > 0 && norm > double(max_norm) ? float(double(max_norm) / norm) : 1.0f;
}

__global__ void __launch_bounds__(kAdamWThreads)
    AdamWKernel(float* __restrict__ master, bf16* __restrict__ params, const float* __restrict__ grads,
                float* __restrict__ m, float* __restrict__ v, const Segment* __restrict__ segments, int count,
                AdamWConstants k, const float* __restrict__ clip_scale, bool vector) {
  // first_chunk[s]: the chunks of the segments before s; first_chunk[count]: all of them.
  __shared__ int64_t first_chunk[kMaxAdamWSegments + 1];
  using Scan = cub::BlockScan<int64_t, kAdamWThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  int64_t chunks[kSegmentsPerThread];
  int64_t mine = 0;
#pragma unroll
  for (int j = 0; j < kSegmentsPerThread; ++j) {
    const int s = threadIdx.x * kSegmentsPerThread + j;
    chunks[j] = s < count ? (segments[s].size + kAdamWChunk - 1) / kAdamWChunk : 0;
    mine += chunks[j];
  }
  int64_t before = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(mine, before, total);
#pragma unroll
  for (int j = 0; j < kSegmentsPerThread; ++j) {
    const int s = threadIdx.x * kSegmentsPerThread + j;
    if (s < count) first_chunk[s] = before;
    before += chunks[j];
  }
  if (threadIdx.x == 0) first_chunk[count] = total;
  __syncthreads();

  const float scale = clip_scale != nullptr ? *clip_scale : 1.0f;
  auto update = [&](int64_t i, float decay) {
    const float g = grads[i] * scale;
    const float mi = k.beta1 * m[i] + (1.0f - k.beta1) * g;
    const float vi = k.beta2 * v[i] + (1.0f - k.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float w = master[i];
    const float updated =
        w - k.learning_rate * ((mi / k.correction1) / (sqrtf(vi / k.correction2) + k.epsilon) + decay * w);
    master[i] = updated;
    if (params != nullptr) params[i] = __float2bfloat16(updated);
  };
  for (int64_t chunk = blockIdx.x; chunk < total; chunk += gridDim.x) {
    int low = 0, high = count;  // the last segment whose first chunk is <= chunk
    while (high - low > 1) {
      const int middle = (low + high) / 2;
      if (first_chunk[middle] <= chunk) {
        low = middle;
      } else {
        high = middle;
      }
    }
    const Segment segment = segments[low];
    const float decay = segment.decay != 0 ? k.weight_decay : 0.0f;
    const int64_t begin = (chunk - first_chunk[low]) * kAdamWChunk;
    if (vector && segment.offset % 4 == 0) {
      // 4 elements a thread at a time: 128-bit loads and stores (64-bit for params).
#pragma unroll
      for (int e = 0; e < kAdamWElementsPerThread / 4; ++e) {
        const int64_t local = begin + 4 * (e * kAdamWThreads + threadIdx.x);
        if (local >= segment.size) break;
        const int64_t i = segment.offset + local;
        if (local + 4 > segment.size) {
          for (int64_t j = i; j < segment.offset + segment.size; ++j) update(j, decay);
          break;
        }
        float g[4], mi[4], vi[4], w[4];
        Load<4>(grads + i, g);
        Load<4>(m + i, mi);
        Load<4>(v + i, vi);
        Load<4>(master + i, w);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float gj = g[j] * scale;
          mi[j] = k.beta1 * mi[j] + (1.0f - k.beta1) * gj;
          vi[j] = k.beta2 * vi[j] + (1.0f - k.beta2) * gj * gj;
          w[j] -= k.learning_rate * ((mi[j] / k.correction1) / (sqrtf(vi[j] / k.correction2) + k.epsilon) + decay * w[j]);
        }
        Store<4>(m + i, mi);
        Store<4>(v + i, vi);
        Store<4>(master + i, w);
        if (params != nullptr) {
          uint2 packed;
          __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
          pairs[0] = __floats2bfloat162_rn(w[0], w[1]);
          pairs[1] = __floats2bfloat162_rn(w[2], w[3]);
          *reinterpret_cast<uint2*>(params + i) = packed;
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < kAdamWElementsPerThread; ++e) {
        const int64_t local = begin + e * kAdamWThreads + threadIdx.x;
        if (local >= segment.size) break;
        update(segment.offset + local, decay);
      }
    }
  }
}

}  // namespace

void SumSquares(double* sum, const float* grads, const Segment* segments, int count, double* partials,
                cudaStream_t stream) {
  if (count == 0) return;
  SumSquaresKernel<<<kSumSquaresBlocks, kThreads, 0, stream>>>(partials, grads, segments, count);
  SumSquaresFinishKernel<<<1, kSumSquaresBlocks, 0, stream>>>(sum, partials, kSumSquaresBlocks);
  CheckLaunch("SumSquares", {{"segments", count}});
}

void ClipScale(float* scale, const double* sum_of_squares, float max_norm, cudaStream_t stream) {
  ClipScaleKernel<<<1, 1, 0, stream>>>(scale, sum_of_squares, max_norm);
  CheckLaunch("ClipScale", {});
}

void AdamW(float* master, bf16* params, const float* grads, float* m, float* v, const Segment* segments, int count,
           const AdamWConstants& constants, const float* clip_scale, int multiprocessors, cudaStream_t stream) {
  if (count == 0) return;
  if (count > kMaxAdamWSegments) {
    throw std::invalid_argument("AdamW: " + std::to_string(count) + " segments exceed the " +
                                std::to_string(kMaxAdamWSegments) + " the CUDA kernel takes");
  }
  // The chunk count is on the device; blocks stride over the chunks, so any grid covers them.
  // 128-bit access where every array allows it (and the segment's offset, checked there).
  const bool vector = Aligned(master, 16) && Aligned(grads, 16) && Aligned(m, 16) && Aligned(v, 16) &&
                      Aligned(params, 8);
  AdamWKernel<<<multiprocessors * 8, kAdamWThreads, 0, stream>>>(master, params, grads, m, v, segments, count,
                                                                 constants, clip_scale, vector);
  CheckLaunch("AdamW", {{"segments", count}});
}

}  // namespace meshtrain::kernels::cuda
