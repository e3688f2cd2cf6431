// The embedding's kernels (launch.h): the forward gathers rows of wte and wpe with 128-bit
// loads; the backward sorts the rows by token and sums each token's rows without atomics,
// in an order fixed by the tokens, so it repeats bit for bit.

#include <cub/device/device_radix_sort.cuh>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>

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

// The backward sorts the batch's rows by token (cub's radix sort: stable, so rows stay in
// order within a token), then sums each token's run of rows into its row of dwte. A block
// takes kPositions sorted positions and the runs that start there: runs of up to kShortRun
// rows go one to a warp; longer ones are shared by all the block's warps, warp w taking
// the run's w-th, (w+8)-th, ... rows, and their sums added in warp order. No atomics, and
// an order fixed by the tokens: a run repeats bit for bit.
constexpr int kPositions = 64;
constexpr int kShortRun = 32;
constexpr int kBatch = 4;  // rows whose loads a warp has in flight at once

// The sort's arrays in the scratch, then cub's temporary storage.
struct SortScratch {
  int32_t *keys_in, *keys_out, *rows_in, *rows_out;
  void* temporary;
  size_t temporary_bytes;
};

size_t Up(size_t bytes) { return (bytes + 255) / 256 * 256; }

size_t SortTemporaryBytes(int64_t rows, int bits) {
  size_t bytes = 0;
  const int32_t* none = nullptr;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, none, static_cast<int32_t*>(nullptr), none,
                                  static_cast<int32_t*>(nullptr), int(rows), 0, bits);
  return bytes;
}

SortScratch Carve(void* scratch, int64_t max_rows) {
  auto* at = static_cast<std::byte*>(scratch);
  const size_t array = Up(size_t(max_rows) * sizeof(int32_t));
  SortScratch s;
  s.keys_in = reinterpret_cast<int32_t*>(at);
  s.keys_out = reinterpret_cast<int32_t*>(at + array);
  s.rows_in = reinterpret_cast<int32_t*>(at + 2 * array);
  s.rows_out = reinterpret_cast<int32_t*>(at + 3 * array);
  s.temporary = at + 4 * array;
  s.temporary_bytes = SortTemporaryBytes(max_rows, 32);
  return s;
}

// keys: the row's token in the slice, or v_rows (after every real one) for the others.
__global__ void SortKeysKernel(int32_t* __restrict__ keys, int32_t* __restrict__ rows,
                               const int32_t* __restrict__ tokens, int64_t N, int64_t v_begin, int64_t v_rows) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const int64_t local = int64_t(tokens[i]) - v_begin;
  keys[i] = int32_t(local >= 0 && local < v_rows ? local : v_rows);
  rows[i] = int32_t(i);
}

// V bf16 as loaded, widened only when added: a batch's loads stay in few registers.
template <int V>
using Packed = std::conditional_t<V == 8, int4, bf16>;

// sum (this lane's vectors of a pass) += the rows rows[first], rows[first + step], ...
// before rows[end], kBatch rows' loads in flight at once.
template <int V, int kVectorsPerLane>
__device__ __forceinline__ void SumRows(float (&sum)[kVectorsPerLane][V], const bf16* __restrict__ dout,
                                        const int32_t* __restrict__ rows, int first, int end, int step, int pass,
                                        int C) {
  const int lane = threadIdx.x % kWarp;
  for (int item = first; item < end; item += step * kBatch) {
    int64_t source[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) source[b] = item + b * step < end ? rows[item + b * step] : -1;
    Packed<V> d[kBatch][kVectorsPerLane];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
#pragma unroll
      for (int k = 0; k < kVectorsPerLane; ++k) {
        const int c = pass + (lane + k * kWarp) * V;
        if (source[b] >= 0 && c < C) d[b][k] = *reinterpret_cast<const Packed<V>*>(dout + source[b] * C + c);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
#pragma unroll
      for (int k = 0; k < kVectorsPerLane; ++k) {
        if (source[b] < 0 || pass + (lane + k * kWarp) * V >= C) continue;
        float widened[V];
        Load<V>(reinterpret_cast<const bf16*>(&d[b][k]), widened);
#pragma unroll
        for (int e = 0; e < V; ++e) sum[k][e] += widened[e];
      }
    }
  }
}

// dwte: blocks of kPositions sorted positions (lane l of a warp owns the vectors
// (l + 32 k) V, k < kVectorsPerLane, of a pass of 32 V kVectorsPerLane channels).
// dwpe: the blocks after those, one thread per V channels of one position, adding the
// batch's rows in order.
template <int V, int kVectorsPerLane>
__global__ void __launch_bounds__(kThreads)
    EncoderBackwardKernel(float* __restrict__ dwte, float* __restrict__ dwpe, const bf16* __restrict__ dout,
                          const int32_t* __restrict__ keys, const int32_t* __restrict__ rows, int B, int T, int C,
                          int32_t v_rows, int wte_blocks) {
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

  constexpr int kPassChannels = kWarp * V * kVectorsPerLane;
  __shared__ int run_start[kPositions], run_end[kPositions], runs;
  __shared__ bool starts[kPositions];
  __shared__ int ends[kPositions];
  __shared__ float warp_sums[kWarpsPerBlock][kPassChannels];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int first_position = int(blockIdx.x) * kPositions;

  // The runs of one real token that start in this block's positions, and where they end.
  if (threadIdx.x < kPositions) {
    const int position = first_position + int(threadIdx.x);
    const int32_t key = position < N ? keys[position] : v_rows;
    const bool start = key != v_rows && (position == 0 || keys[position - 1] != key);
    int end = position + 1;
    if (start) {  // gallop, then bisect: most runs are short
      int known = position, step = 1;
      while (position + step < N && keys[position + step] == key) {
        known = position + step;
        step *= 2;
      }
      int beyond = position + step < N ? position + step : int(N);  // the first index known past the run
      while (beyond - known > 1) {
        const int middle = (known + beyond) / 2;
        if (keys[middle] == key) {
          known = middle;
        } else {
          beyond = middle;
        }
      }
      end = beyond;
    }
    starts[threadIdx.x] = start;
    ends[threadIdx.x] = end;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int count = 0;
    for (int p = 0; p < kPositions; ++p) {
      if (!starts[p]) continue;
      run_start[count] = first_position + p;
      run_end[count] = ends[p];
      ++count;
    }
    runs = count;
  }
  __syncthreads();

  for (int pass = 0; pass < C; pass += kPassChannels) {
    // Short runs: a warp each.
    for (int r = warp; r < runs; r += kWarpsPerBlock) {
      if (run_end[r] - run_start[r] > kShortRun) continue;
      float sum[kVectorsPerLane][V] = {};
      SumRows<V, kVectorsPerLane>(sum, dout, rows, run_start[r], run_end[r], 1, pass, C);
      float* dwte_row = dwte + int64_t(keys[run_start[r]]) * C;
#pragma unroll
      for (int k = 0; k < kVectorsPerLane; ++k) {
        const int c = pass + (lane + k * kWarp) * V;
        if (c >= C) continue;
        float total[V];
        Load<V>(dwte_row + c, total);
#pragma unroll
        for (int e = 0; e < V; ++e) total[e] += sum[k][e];
        Store<V>(dwte_row + c, total);
      }
    }
    // Long runs: every warp a share, then the shares in warp order.
    for (int r = 0; r < runs; ++r) {
      if (run_end[r] - run_start[r] <= kShortRun) continue;
      float sum[kVectorsPerLane][V] = {};
      SumRows<V, kVectorsPerLane>(sum, dout, rows, run_start[r] + warp, run_end[r], kWarpsPerBlock, pass, C);
#pragma unroll
      for (int k = 0; k < kVectorsPerLane; ++k) {
#pragma unroll
        for (int e = 0; e < V; ++e) warp_sums[warp][(lane + k * kWarp) * V + e] = sum[k][e];
      }
      __syncthreads();
      float* dwte_row = dwte + int64_t(keys[run_start[r]]) * C;
      for (int c = threadIdx.x; c < kPassChannels && pass + c < C; c += blockDim.x) {
        float total = dwte_row[pass + c];
        for (int w = 0; w < kWarpsPerBlock; ++w) total += warp_sums[w][c];
        dwte_row[pass + c] = total;
      }
      __syncthreads();
    }
  }
}

template <int V>
void LaunchEncoderBackward(float* dwte, float* dwpe, const bf16* dout, const int32_t* keys, const int32_t* rows,
                           int B, int T, int C, int32_t v_rows, cudaStream_t stream) {
  const int64_t N = int64_t(B) * T;
  const int wte_blocks = dwte != nullptr ? Blocks(N, kPositions) : 0;
  const int wpe_blocks = dwpe != nullptr ? Blocks(int64_t(T) * (C / V)) : 0;
  if (wte_blocks + wpe_blocks == 0) return;
  // Registers for the vectors a lane owns in a pass: no more than the row needs, up to 4.
  const int64_t vectors_per_lane = CeilDiv(C, kWarp * V);
  const int blocks = wte_blocks + wpe_blocks;
  if (vectors_per_lane <= 1) {
    EncoderBackwardKernel<V, 1><<<blocks, kThreads, 0, stream>>>(dwte, dwpe, dout, keys, rows, B, T, C, v_rows,
                                                                 wte_blocks);
  } else if (vectors_per_lane == 2) {
    EncoderBackwardKernel<V, 2><<<blocks, kThreads, 0, stream>>>(dwte, dwpe, dout, keys, rows, B, T, C, v_rows,
                                                                 wte_blocks);
  } else if (vectors_per_lane == 3) {
    EncoderBackwardKernel<V, 3><<<blocks, kThreads, 0, stream>>>(dwte, dwpe, dout, keys, rows, B, T, C, v_rows,
                                                                 wte_blocks);
  } else {
    EncoderBackwardKernel<V, 4><<<blocks, kThreads, 0, stream>>>(dwte, dwpe, dout, keys, rows, B, T, C, v_rows,
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

size_t EncoderBackwardScratchBytes(int64_t max_rows) {
  return 4 * Up(size_t(max_rows) * sizeof(int32_t)) + SortTemporaryBytes(max_rows, 32);
}

void EncoderBackward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int B, int T, int C,
                     int64_t v_begin, int64_t v_rows, void* scratch, int64_t max_rows, cudaStream_t stream) {
  const int64_t N = int64_t(B) * T;
  if (N == 0 || C == 0) return;
  if (N > max_rows || v_rows >= (int64_t{1} << 31)) {
    throw std::invalid_argument("EncoderBackward: " + std::to_string(N) + " rows exceed the " +
                                std::to_string(max_rows) + " the CUDA table was built for");
  }
  const SortScratch sort = Carve(scratch, max_rows);
  const int bits = v_rows > 0 ? 32 - __builtin_clz(uint32_t(v_rows)) : 1;  // the keys go up to v_rows
  size_t temporary_bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, temporary_bytes, sort.keys_in, sort.keys_out, sort.rows_in, sort.rows_out,
                                  int(N), 0, bits, stream);
  if (dwte != nullptr) {
    SortKeysKernel<<<Blocks(N), kThreads, 0, stream>>>(sort.keys_in, sort.rows_in, tokens, N, v_begin, v_rows);
    CheckLaunch("EncoderBackward (sort keys)", {{"B", B}, {"T", T}});
    if (temporary_bytes > sort.temporary_bytes) {
      ThrowLaunchError(cudaErrorMemoryAllocation, "EncoderBackward (sort)", "rows=" + std::to_string(N));
    }
    const cudaError_t status =
        cub::DeviceRadixSort::SortPairs(sort.temporary, temporary_bytes, sort.keys_in, sort.keys_out, sort.rows_in,
                                        sort.rows_out, int(N), 0, bits, stream);
    if (status != cudaSuccess) ThrowLaunchError(status, "EncoderBackward (sort)", "rows=" + std::to_string(N));
  }
  const bool vector = C % 8 == 0 && Aligned(dwte, 16) && Aligned(dwpe, 16) && Aligned(dout, 16);
  if (vector) {
    LaunchEncoderBackward<8>(dwte, dwpe, dout, sort.keys_out, sort.rows_out, B, T, C, int32_t(v_rows), stream);
  } else {
    LaunchEncoderBackward<1>(dwte, dwpe, dout, sort.keys_out, sort.rows_out, B, T, C, int32_t(v_rows), stream);
  }
  CheckLaunch("EncoderBackward", {{"B", B}, {"T", T}, {"C", C}, {"v_begin", v_begin}, {"v_rows", v_rows}});
}

}  // namespace meshtrain::kernels::cuda
