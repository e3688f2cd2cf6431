// meshtrain's own CUDA kernels behind the bf16 table (cuda_ops.h): one launcher per
// operation of kernels/ops.h that is not a library call, over raw device addresses.
// Internal to kernels/cuda. This header compiles as C++17 for nvcc and as C++20 for the
// table, so it names no meshtrain type beyond its own.
//
// Every launcher enqueues on `stream`, returns at once, allocates nothing and never
// synchronizes the host; scratch comes in from the caller, taken once when the table
// was built. A launch that fails throws runtime::cuda::CudaError naming the kernel and
// the shape (ThrowLaunchError). Sums whose order could change a result (over rows into
// a parameter gradient, a norm, a loss) run in a fixed order: a run repeats bit for bit.
// Thread-safety: launchers share no state; scratch belongs to the caller.

#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace meshtrain::kernels::cuda {

using bf16 = __nv_bfloat16;

// kernels::ShardSegment, field for field (cuda_ops.cc checks the layout).
struct Segment {
  int64_t offset, size;
  int32_t decay, in_norm;
};

// Throws runtime::cuda::CudaError("launch of <kernel> (<shape>): ..."). Defined with the
// table, which sees runtime/cuda.h.
[[noreturn]] void ThrowLaunchError(cudaError_t status, const char* kernel, const std::string& shape);

// --- Embedding ---
void EncoderForward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                    int64_t v_begin, int64_t v_rows, cudaStream_t stream);
// Deterministic without atomics: the rows sorted by token (in scratch), each token's rows
// summed into its row of dwte in an order fixed by the tokens; dwpe sums over the batch
// in order. `scratch`: EncoderBackwardScratchBytes(max_rows) bytes, 256-byte aligned.
// REQUIRES: B * T <= max_rows.
size_t EncoderBackwardScratchBytes(int64_t max_rows);
void EncoderBackward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int B, int T, int C,
                     int64_t v_begin, int64_t v_rows, void* scratch, int64_t max_rows, cudaStream_t stream);

// --- LayerNorm ---
// With a and b: residual = a + b (residual may alias either), then the LayerNorm of the
// residual as stored. With b null: the LayerNorm of a (residual unused).
void LayerNormForward(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* a, const bf16* b,
                      const bf16* weight, const bf16* bias, int64_t N, int C, cudaStream_t stream);
// Per-block partial sums of dweight and dbias land in `partials` (capacity floats), then a
// second pass adds them (AddColumnSums). REQUIRES: C <= kMaxLayerNormChannels and
// 2 * C <= partial_capacity.
constexpr int kMaxLayerNormChannels = 16384;
void LayerNormBackward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                       const bf16* weight, const float* mean, const float* rstd, int64_t N, int C, float* partials,
                       int64_t partial_capacity, cudaStream_t stream);

// --- RMSNorm (eps given) ---
// With a and b: residual = a + b (residual may alias either), then the RMSNorm of the
// residual as stored. With b null: the RMSNorm of a (residual unused).
void RmsNormForward(bf16* residual, bf16* out, float* rstd, const bf16* a, const bf16* b, const bf16* weight,
                    int64_t N, int C, float eps, cudaStream_t stream);
// dinp += the normalisation's gradient; per-block partial sums of dweight land in
// `partials` (capacity floats), then AddColumnSums adds them in order into dweight.
// REQUIRES: C <= kMaxRmsNormChannels and C <= partial_capacity.
constexpr int kMaxRmsNormChannels = 32768;
void RmsNormBackward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                     const float* rstd, int64_t N, int C, float* partials, int64_t partial_capacity,
                     cudaStream_t stream);

// --- Per-head RMSNorm (Qwen3's q_norm and k_norm) ---
// For each of the N rows of x (`stride` apart) and each of its `heads` heads of HS
// channels: saved (N*heads, HS) = the head, rstd (N*heads), and the head normalised in
// place. The backward replaces dx's heads in place by their input gradient; per-block
// partial sums of dweight land in `partials` (capacity floats), then AddColumnSums adds
// them in order into dweight, zeroed first (dweight = these heads' gradient). REQUIRES: HS <= kMaxHeadRmsNormChannels and HS <= capacity.
constexpr int kMaxHeadRmsNormChannels = 1024;
void HeadRmsNormForward(bf16* x, bf16* saved, float* rstd, const bf16* weight, int64_t N, int heads, int HS,
                        int64_t stride, float eps, cudaStream_t stream);
void HeadRmsNormBackward(bf16* dx, float* dweight, const bf16* saved, const bf16* weight, const float* rstd,
                         int64_t N, int heads, int HS, int64_t stride, float* partials, int64_t partial_capacity,
                         cudaStream_t stream);

// --- RoPE (rotate-half) ---
// In place on the NH q heads and KVH k heads of qkv (B,T,(NH+2*KVH)*HS); cos and sin
// (T,HS/2) fp32 rows by position; backward: the negative angle. REQUIRES: HS even.
void Rope(bf16* qkv, const float* cos, const float* sin, int B, int T, int NH, int KVH, int HS, bool backward,
          cudaStream_t stream);

// --- SwiGLU ---
// out (N,H) = silu(gate) * up, gate_up (N,2H) = [gate | up].
void SwiGluForward(bf16* out, const bf16* gate_up, int64_t N, int H, cudaStream_t stream);
// dgate_up (N,2H) = [dgate | dup] for dout (N,H).
void SwiGluBackward(bf16* dgate_up, const bf16* dout, const bf16* gate_up, int64_t N, int H, cudaStream_t stream);

// --- Mixture of experts (moe.cu) ---
// The router: one warp a row of logits (N,E): probs (N,E) fp32 softmax; experts and
// weights (N,k) by k passes, each taking the most probable expert after the previous one
// (probability descending, then index ascending), over the probabilities as stored;
// renormalised by their sum (in order of j) when asked. REQUIRES: 1 <= k <= E,
// k <= kMaxMoeTopK.
constexpr int kMaxMoeTopK = 32;
void RouterTopKForward(float* probs, int32_t* experts, float* weights, const bf16* logits, int64_t N, int E, int k,
                       bool renormalize, cudaStream_t stream);
// dlogits (N,E) = p (dp - p . dp), dp from dweights through the (renormalised) top k plus
// dprobs (nullable). One warp a row.
void RouterTopKBackward(bf16* dlogits, const float* dweights, const float* dprobs, const float* probs,
                        const int32_t* experts, int64_t N, int E, int k, bool renormalize, cudaStream_t stream);
// The stable dispatch order of the N*k copies (kernels/ops.h), without atomics: the copies
// in chunks, one warp a chunk counting its copies per expert, one block turning the counts
// into each chunk's first row per expert, and each warp walking its chunk again in order,
// ranking copies of the same expert within 32 at a time (__match_any_sync). `scratch`:
// MoePermutePlanScratchInts(max_experts) ints. An expert outside [0, E) is not counted and
// its copy's position is -1 (MoePermute and the rest skip it). REQUIRES: E <=
// kMaxMoeExperts, E <= max_experts.
constexpr int kMaxMoeExperts = 1024;
int64_t MoePermutePlanScratchInts(int max_experts);
void MoePermutePlan(int32_t* counts, int32_t* positions, const int32_t* experts, int64_t N, int k, int E,
                    int32_t* scratch, cudaStream_t stream);
// xs (N*k,C): row positions[n,j] = x's row n.
void MoePermute(bf16* xs, const bf16* x, const int32_t* positions, int64_t N, int k, int C, cudaStream_t stream);
// dx (N,C) = dx + the sum over j of dxs's rows positions[n,j] (fp32, rounded once).
void MoePermuteBackward(bf16* dx, const bf16* dxs, const int32_t* positions, int64_t N, int k, int C,
                        cudaStream_t stream);
// out (N,C) = sum_j weights[n,j] ys's row positions[n,j] + residual (nullable; may be out).
void MoeCombineForward(bf16* out, const bf16* ys, const float* weights, const int32_t* positions,
                       const bf16* residual, int64_t N, int k, int C, cudaStream_t stream);
// One block a row n: dys's rows positions[n,j] = weights[n,j] dout's row n, and
// dweights[n,j] = their dot product with ys's rows (BlockSum: a fixed order).
void MoeCombineBackward(bf16* dys, float* dweights, const bf16* dout, const bf16* ys, const float* weights,
                        const int32_t* positions, int64_t N, int k, int C, cudaStream_t stream);

// --- Around the products (where cuBLASLt's epilogues cannot serve a shape) ---
// dbias (OC) += the column sums of dout (N,OC): partial sums per row range, then a
// second pass in order. REQUIRES: OC <= partial_capacity.
void BiasBackward(float* dbias, const bf16* dout, int64_t N, int OC, float* partials, int64_t partial_capacity,
                  cudaStream_t stream);
// dbias (OC) += sums (OC): the column sums cuBLASLt's BGRADB epilogue wrote.
void AddBiasGradient(float* dbias, const float* sums, int OC, cudaStream_t stream);
// The second pass of all four: for each column c of partials (rows, columns), first[c] (c <
// split) or second[c - split] += the column's sum, its rows added in a fixed order.
void AddColumnSums(float* first, float* second, int split, const float* partials, int rows, int columns,
                   cudaStream_t stream);
// out (N,OC) = out + bias (bias nullable); with gelu_pre: gelu_pre = that sum as
// stored, out = gelu(the sum).
void BiasGelu(bf16* out, bf16* gelu_pre, const bf16* bias, int64_t N, int OC, cudaStream_t stream);
// dinp (n) = dinp * gelu'(gelu_pre).
void GeluBackwardInPlace(bf16* dinp, const bf16* gelu_pre, int64_t n, cudaStream_t stream);

// --- Attention without cuDNN: the scores path ---
// Over rows of T scores (rows = B*NH*T, row r is query position r % T): probs = the
// causal softmax of scores, in place (masked entries 0), and the same as bf16.
void CausalSoftmaxForward(float* probs, bf16* probs_bf16, int64_t rows, int T, cudaStream_t stream);
// dscores = scale * probs * (dprobs - sum(probs * dprobs)) as bf16 (masked entries 0),
// and probs_bf16 = probs as bf16.
void CausalSoftmaxBackward(bf16* dscores, bf16* probs_bf16, const float* dprobs, const float* probs, int64_t rows,
                           int T, float scale, cudaStream_t stream);
// out[r * out_stride + c] = in (rows,width)[r][c] as bf16: gradients summed in fp32 over a
// group of query heads, stored into their channels of dqkv.
void StoreRows(bf16* out, int64_t out_stride, const float* in, int64_t rows, int width, cudaStream_t stream);

// --- Elementwise ---
void Add(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream);
// out may be in.
void Dropout(bf16* out, const bf16* in, int64_t rows, int width, float p, uint64_t key, int64_t first_row,
             int64_t row_stride, int64_t first_column, cudaStream_t stream);

// --- Loss ---
void CrossEntropy(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets, int64_t R, int64_t v_rows,
                  int64_t Vp, float dloss, cudaStream_t stream);
void VocabSliceStats(float* stats, const bf16* logits, const int32_t* targets, int64_t R, int64_t v_rows, int64_t Vp,
                     int64_t v_begin, cudaStream_t stream);
void VocabSliceCrossEntropy(float* losses, bf16* dlogits, const bf16* logits, const float* all_stats, int slices,
                            const int32_t* targets, int64_t R, int64_t v_rows, int64_t Vp, int64_t v_begin,
                            float dloss, cudaStream_t stream);
void AddLoss(double* sum, const float* losses, int64_t R, double scale, cudaStream_t stream);

// --- Shard operations ---
void Accumulate(float* into, const float* from, int64_t n, float scale, cudaStream_t stream);
void Cast(bf16* to, const float* from, int64_t n, cudaStream_t stream);
// `partials`: kSumSquaresBlocks doubles.
constexpr int kSumSquaresBlocks = 1024;
void SumSquares(double* sum, const float* grads, const Segment* segments, int count, double* partials,
                cudaStream_t stream);
void ClipScale(float* scale, const double* sum_of_squares, float max_norm, cudaStream_t stream);
// One launch over every segment. REQUIRES: count <= kMaxAdamWSegments.
constexpr int kMaxAdamWSegments = 2048;
struct AdamWConstants {
  float learning_rate, beta1, beta2, epsilon, weight_decay;
  float correction1, correction2;  // 1 - beta^t
};
void AdamW(float* master, bf16* params, const float* grads, float* m, float* v, const Segment* segments, int count,
           const AdamWConstants& constants, const float* clip_scale, int multiprocessors, cudaStream_t stream);

}  // namespace meshtrain::kernels::cuda
