// The CUDA backend's operations for expert parallelism (Backend's row movement and loss shares):
// small memory-bound kernels on the caller's stream. Each output element is written by one thread
// that reduces in a fixed order (no atomics): bitwise repeatable. An index outside the rows it may
// address is skipped (a gathered row is zeroed): the indices come from the caller's HOME saved
// buffer, which the host cannot check without a synchronisation, and must never move memory outside
// the buffers. The caller (CudaBackend) has made the context's device current.
#include <cuda_runtime.h>

#include "common/backend.hpp"
#include "common/layer_desc.hpp"
#include "common/status.hpp"
#include "cuda/cuda_util.cuh"
#include "cuda/ep_ops.hpp"
#include "cuda/token_reduce.hpp"

namespace moeblaze {
namespace cuda {
namespace {

constexpr int kThreads = 256;

int ep_blocks_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return int(blocks < 65535 * 32 ? (blocks > 0 ? blocks : 1) : 65535 * 32);
}

// Row moves in units of Unit (16, 8, 4 or 2 bytes, whatever divides the row and the pointers).
template <typename Unit, bool kScatter>
__global__ void move_rows_kernel(Unit* dst, const Unit* src, const int32_t* index, int64_t n,
                                 int64_t index_rows, int64_t units_per_row) {
  const int64_t total = n * units_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / units_per_row;
    const int64_t unit = i - row * units_per_row;
    const int64_t other = index[row];
    const bool valid = other >= 0 && other < index_rows;
    if (kScatter) {
      if (valid) dst[other * units_per_row + unit] = src[row * units_per_row + unit];
    } else {
      dst[row * units_per_row + unit] = valid ? src[other * units_per_row + unit] : Unit{};
    }
  }
}

template <bool kScatter>
void move_rows(void* dst, const void* src, const int32_t* index, int64_t n, int64_t index_rows,
               size_t row_bytes, cudaStream_t stream) {
  if (n == 0 || row_bytes == 0) return;
  const uintptr_t alignment =
      reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | uintptr_t(row_bytes);
  const int64_t total_bytes = n * int64_t(row_bytes);
  if (alignment % 16 == 0) {
    move_rows_kernel<uint4, kScatter><<<ep_blocks_for(total_bytes / 16), kThreads, 0, stream>>>(
        static_cast<uint4*>(dst), static_cast<const uint4*>(src), index, n, index_rows,
        row_bytes / 16);
  } else if (alignment % 4 == 0) {
    move_rows_kernel<uint32_t, kScatter><<<ep_blocks_for(total_bytes / 4), kThreads, 0, stream>>>(
        static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(src), index, n, index_rows,
        row_bytes / 4);
  } else {
    move_rows_kernel<uint16_t, kScatter><<<ep_blocks_for(total_bytes / 2), kThreads, 0, stream>>>(
        static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), index, n, index_rows,
        row_bytes / 2);
  }
  check_launch(kScatter ? "EP scatter_rows" : "EP gather_rows");
}

__global__ void local_ids_kernel(const int32_t* table, int64_t W, int64_t E, int64_t expert_begin,
                                 int64_t local_experts, int64_t R, int32_t* local_ids) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < R;
       i += int64_t(gridDim.x) * blockDim.x) {
    // Segments (source s, local expert e) in order; W * E_r <= E: a short scan per row.
    int64_t end = 0;
    int32_t id = 0;
    for (int64_t s = 0; s < W && end <= i; ++s) {
      for (int64_t e = 0; e < local_experts; ++e) {
        end += table[s * E + expert_begin + e];
        if (i < end) {
          id = int32_t(e);
          s = W;
          break;
        }
      }
    }
    local_ids[i] = id;
  }
}

__global__ void global_counts_kernel(const int32_t* table, int64_t W, int64_t E, int32_t* counts) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < E;
       e += int64_t(gridDim.x) * blockDim.x) {
    int32_t sum = 0;
    for (int64_t s = 0; s < W; ++s) sum += table[s * E + e];
    counts[e] = sum;
  }
}

// ---- router loss shares (design section 3) ------------------------------------------------------
// This rank's share of the aux and z losses, with the global expert counts and token count: the
// single-GPU router's formulas (cuda/router.cu) with T -> global_T and counts -> global counts.
// Every sum has a fixed order (no atomics), so the shares are bitwise repeatable.

constexpr int kLossWarps = 8;
constexpr int kLossThreads = kLossWarps * 32;
constexpr int kLossChunk = 1024;  // experts accumulated per pass (shared memory: 8 x 1024 floats)

__device__ __forceinline__ float loss_sigmoid(float l) {
  return 1.f / (1.f + expf(-l));
}

// SIGMOID scores up to a common factor, as the router's sigmoid_score (cuda/router.cu): scaled by
// exp(-m) when the token's largest logit m is below -60, so that normalised scores never are 0/0.
__device__ __forceinline__ float loss_sigmoid_score(float l, float m) {
  return m >= -60.f ? loss_sigmoid(l) : expf(l - m) / (1.f + expf(l));
}

// Softmax statistics of one row, in every lane of the warp: max and sum of exp(l - max).
__device__ __forceinline__ float2 loss_row_stats(const float* row, int E, int lane) {
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, row[e]);
  m = warp_max(m);
  float s = 0.f;
  for (int e = lane; e < E; e += 32) s += expf(row[e] - m);
  return make_float2(m, warp_sum(s));
}

struct LossShareParams {
  int64_t T, global_T;
  int E, k;
  bool sigmoid;
  float aux_coeff, z_coeff;
  const float* logits;           // [T, E]
  const int32_t* global_counts;  // [E]
  const float* d_losses;         // [2] or nullptr = {1, 1} (backward)
  float* losses;                 // [2] (forward)
  float* d_logits;               // [T, E], added to (backward)
};

// One block: warp w takes tokens w, w + 8, ...; per pass over a chunk of experts it adds the
// tokens' balance scores (softmax, or sigmoid normalised over the experts) into its own row of
// shared memory, then thread e sums the 8 rows in order and the block sums over e in a fixed tree.
__global__ void __launch_bounds__(kLossThreads) loss_share_forward_kernel(LossShareParams p) {
  __shared__ float acc[kLossWarps][kLossChunk];
  __shared__ float warp_part[kLossWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int E = p.E;
  float aux = 0.f;  // thread 0: the sum over experts, in chunk and tree order
  float z_warp = 0.f;
  for (int e0 = 0; e0 < E; e0 += kLossChunk) {
    const int chunk = min(kLossChunk, E - e0);
    for (int e = lane; e < chunk; e += 32) acc[warp][e] = 0.f;
    for (int64_t t = warp; t < p.T; t += kLossWarps) {
      const float* row = p.logits + t * E;
      const float2 st = loss_row_stats(row, E, lane);
      if (e0 == 0) {
        const float lse = st.x + logf(st.y);
        z_warp += lse * lse;  // every lane holds it; lane 0's is used
      }
      if (p.aux_coeff != 0.f) {
        float sig_sum = 1.f;
        if (p.sigmoid) {
          float s = 0.f;
          for (int e = lane; e < E; e += 32) s += loss_sigmoid_score(row[e], st.x);
          sig_sum = warp_sum(s);
        }
        for (int e = lane; e < chunk; e += 32) {
          const float l = row[e0 + e];
          acc[warp][e] += p.sigmoid ? loss_sigmoid_score(l, st.x) / sig_sum : expf(l - st.x) / st.y;
        }
      }
    }
    __syncthreads();
    float part = 0.f;
    for (int e = threadIdx.x; e < chunk; e += kLossThreads) {
      float score_sum = 0.f;
      for (int w = 0; w < kLossWarps; ++w) score_sum += acc[w][e];
      const float gT = float(p.global_T);
      part += (float(p.global_counts[e0 + e]) / float(p.global_T * p.k)) * (score_sum / gT);
    }
    part = warp_sum(part);
    if (lane == 0) warp_part[warp] = part;
    __syncthreads();
    if (threadIdx.x == 0)
      for (int w = 0; w < kLossWarps; ++w) aux += warp_part[w];
    __syncthreads();  // acc and warp_part are reused by the next chunk
  }
  if (lane == 0) warp_part[warp] = z_warp;
  __syncthreads();
  if (threadIdx.x == 0) {
    float z = 0.f;
    for (int w = 0; w < kLossWarps; ++w) z += warp_part[w];
    const bool any = p.global_T > 0;
    p.losses[0] = any && p.aux_coeff != 0.f ? p.aux_coeff * float(E) * aux : 0.f;
    p.losses[1] = any && p.z_coeff != 0.f ? p.z_coeff * z / float(p.global_T) : 0.f;
  }
}

// A warp per token: d_logits[t] += the gradient of d_aux * aux share + d_z * z share, as the
// router's backward computes its loss terms (cuda/router.cu), with the global counts and tokens.
__global__ void __launch_bounds__(kLossThreads) loss_share_backward_kernel(LossShareParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kLossWarps + (threadIdx.x >> 5);
  if (t >= p.T) return;
  const int E = p.E;
  const float* row = p.logits + t * E;
  float* out = p.d_logits + t * E;
  const float d_aux = p.d_losses ? p.d_losses[0] : 1.f;
  const float d_z = p.d_losses ? p.d_losses[1] : 1.f;
  const float2 st = loss_row_stats(row, E, lane);
  const bool aux = p.aux_coeff != 0.f;
  const float aux_scale =
      aux ? d_aux * p.aux_coeff * float(E) / (float(p.global_T) * float(p.global_T * p.k)) : 0.f;
  float sig_sum = 1.f, wq_dot = 0.f;
  if (aux) {
    float dot = 0.f;
    if (p.sigmoid) {
      float s = 0.f;
      for (int e = lane; e < E; e += 32) s += loss_sigmoid_score(row[e], st.x);
      sig_sum = warp_sum(s);
      for (int e = lane; e < E; e += 32)
        dot += aux_scale * float(p.global_counts[e]) * loss_sigmoid_score(row[e], st.x) / sig_sum;
    } else {
      for (int e = lane; e < E; e += 32)
        dot += aux_scale * float(p.global_counts[e]) * expf(row[e] - st.x) / st.y;
    }
    wq_dot = warp_sum(dot);
  }
  const float lse = st.x + logf(st.y);
  const float z_scale = p.z_coeff != 0.f ? d_z * p.z_coeff * 2.f * lse / float(p.global_T) : 0.f;
  for (int e = lane; e < E; e += 32) {
    const float l = row[e];
    const float pe = expf(l - st.x) / st.y;
    float grad = 0.f;
    if (aux) {
      const float w = aux_scale * float(p.global_counts[e]);
      if (p.sigmoid) {
        grad += (w - wq_dot) / sig_sum * loss_sigmoid_score(l, st.x) * (1.f - loss_sigmoid(l));
      } else {
        grad += pe * (w - wq_dot);
      }
    }
    if (p.z_coeff != 0.f) grad += z_scale * pe;
    out[e] += grad;
  }
}

LossShareParams loss_share_params(const LayerDesc& desc, const LossShareCall& call) {
  MB_REQUIRE(desc.rdtype() == Dtype::F32, MOEBLAZE_ERR_NOT_SUPPORTED,
             "EP on CUDA: router loss shares need F32 routing values (%s is CPU only)",
             dtype_name(desc.dtype));
  LossShareParams p{};
  p.T = call.T;
  p.global_T = call.global_tokens;
  p.E = int(desc.E);
  p.k = int(desc.k);
  p.sigmoid = desc.score_function == ScoreFunction::Sigmoid;
  p.aux_coeff = desc.aux_loss_coeff;
  p.z_coeff = desc.z_loss_coeff;
  p.logits = static_cast<const float*>(call.logits);
  p.global_counts = call.global_counts;
  return p;
}

}  // namespace

void ep_gather_rows(void* dst, const void* src, const int32_t* index, int64_t n, int64_t index_rows,
                    size_t row_bytes, cudaStream_t stream) {
  move_rows<false>(dst, src, index, n, index_rows, row_bytes, stream);
}

void ep_scatter_rows(void* dst, const void* src, const int32_t* index, int64_t n,
                     int64_t index_rows, size_t row_bytes, cudaStream_t stream) {
  move_rows<true>(dst, src, index, n, index_rows, row_bytes, stream);
}

void ep_combine_rows(Dtype dtype, void* out, const void* rows, const int32_t* index, int64_t T,
                     int64_t k, int64_t d, int64_t index_rows, cudaStream_t stream) {
  if (dtype == Dtype::F64)
    fail(MOEBLAZE_ERR_NOT_SUPPORTED, "EP on CUDA: %s is CPU only", dtype_name(dtype));
  // The one-device layer's per-token sums (token_reduce.hpp): the same bits.
  token_reduce(dtype, out, d, rows, d, index, index_rows, T, k, d, stream);
}

void ep_local_expert_ids(const int32_t* table, int64_t W, int64_t E, int64_t expert_begin,
                         int64_t local_experts, int64_t R, int32_t* local_ids,
                         cudaStream_t stream) {
  if (R == 0) return;
  local_ids_kernel<<<ep_blocks_for(R), kThreads, 0, stream>>>(table, W, E, expert_begin,
                                                              local_experts, R, local_ids);
  check_launch("EP local_expert_ids");
}

void ep_global_counts(const int32_t* table, int64_t W, int64_t E, int32_t* counts,
                      cudaStream_t stream) {
  global_counts_kernel<<<ep_blocks_for(E), kThreads, 0, stream>>>(table, W, E, counts);
  check_launch("EP global_counts");
}

void ep_loss_shares_forward(const LayerDesc& desc, const LossShareCall& call, void* losses) {
  const cudaStream_t s = as_stream(call.stream);
  if ((desc.aux_loss_coeff == 0.0f && desc.z_loss_coeff == 0.0f) || call.global_tokens == 0) {
    check(cudaMemsetAsync(losses, 0, 2 * desc.relem_size(), s), "cudaMemsetAsync (losses)");
    return;
  }
  LossShareParams p = loss_share_params(desc, call);
  p.losses = static_cast<float*>(losses);
  loss_share_forward_kernel<<<1, kLossThreads, 0, s>>>(p);
  check_launch("EP loss_share_forward_kernel");
}

void ep_loss_shares_backward(const LayerDesc& desc, const LossShareCall& call, const void* d_losses,
                             void* d_logits) {
  if ((desc.aux_loss_coeff == 0.0f && desc.z_loss_coeff == 0.0f) || call.global_tokens == 0 ||
      call.T == 0)
    return;
  LossShareParams p = loss_share_params(desc, call);
  p.d_losses = static_cast<const float*>(d_losses);
  p.d_logits = static_cast<float*>(d_logits);
  const int blocks = int((call.T + kLossWarps - 1) / kLossWarps);
  loss_share_backward_kernel<<<blocks, kLossThreads, 0, as_stream(call.stream)>>>(p);
  check_launch("EP loss_share_backward_kernel");
}

void ep_copy_to_host(void* host_dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes) {
    check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync (count table to the host)");
  }
  // The one host synchronisation of the EP forward.
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (count table)");
}

void ep_copy_between_ranks(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy (LOCAL transport)");
  // A device-to-device cudaMemcpy returns before the copy is done (no host synchronisation for
  // such transfers): wait for it, so the received data is complete when the exchange's closing
  // barrier lets this rank's (non-blocking) stream read it and the sender reuse its buffer
  // (without it a rank on another GPU can read its count table before the copy lands).
  check(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize (LOCAL transport copy)");
}

void ep_synchronize(cudaStream_t stream) {
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (LOCAL transport)");
}

}  // namespace cuda
}  // namespace moeblaze
