// Routing index build, atomic-free in the result and deterministic, with no host synchronisation:
//   1. per tile of 256 tokens, a shared-memory bitmap per expert (bit = token of the tile routed to
//      the expert) -> per-(expert, tile) counts;
//   2. one exclusive scan over (expert, tile) -> expert_offsets and each tile's base per expert;
//   3. per tile, the bitmap again; a pair's rank inside its (expert, tile) is the popcount of the
//      bits below its token, so rows are in ascending token order inside every expert.
// The bitmaps are built with shared atomicOr on integers, whose result is independent of order.
#include "cuda/cuda_util.cuh"
#include "cuda/kernels.hpp"

namespace moeblaze {
namespace cuda {
namespace {

constexpr int kTileTokens = 256;
constexpr int kTileWords = kTileTokens / 32;
constexpr int kScanThreads = 1024;

// A pair is kept when its id is in range and not repeated earlier in the same token.
__device__ __forceinline__ bool pair_valid(const int32_t* token_ids, int j, int E) {
  const int id = token_ids[j];
  if (id < 0 || id >= E) return false;
  for (int i = 0; i < j; ++i)
    if (token_ids[i] == id) return false;
  return true;
}

__device__ void build_tile_bitmap(int64_t T, int E, int k, const int32_t* ids, uint32_t* bits) {
  for (int i = threadIdx.x; i < E * kTileWords; i += blockDim.x) bits[i] = 0u;
  __syncthreads();
  const int64_t t = int64_t(blockIdx.x) * kTileTokens + threadIdx.x;
  if (t < T) {
    const int32_t* token_ids = ids + t * k;
    for (int j = 0; j < k; ++j) {
      if (!pair_valid(token_ids, j, E)) continue;
      atomicOr(&bits[token_ids[j] * kTileWords + (threadIdx.x >> 5)], 1u << (threadIdx.x & 31));
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kTileTokens)
    tile_count_kernel(int64_t T, int E, int k, const int32_t* ids, int32_t* tile_counts) {
  extern __shared__ uint32_t bits[];  // [E, kTileWords]
  build_tile_bitmap(T, E, k, ids, bits);
  const int tiles = gridDim.x;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int c = 0;
#pragma unroll
    for (int w = 0; w < kTileWords; ++w) c += __popc(bits[e * kTileWords + w]);
    tile_counts[int64_t(e) * tiles + blockIdx.x] = c;
  }
}

// Exclusive scan of `values` [n] in place (one block; each thread scans a contiguous chunk).
__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(int64_t n, int E, int tiles, int32_t* values, int32_t* expert_offsets) {
  __shared__ int32_t sums[kScanThreads];
  const int64_t chunk = (n + kScanThreads - 1) / kScanThreads;
  const int64_t begin = min((int64_t)int64_t(threadIdx.x) * chunk, n);
  const int64_t end = min((int64_t)begin + chunk, n);
  int32_t s = 0;
  for (int64_t i = begin; i < end; ++i) s += values[i];
  sums[threadIdx.x] = s;
  __syncthreads();
  // Hillis-Steele inclusive scan of the chunk sums.
  for (int offset = 1; offset < kScanThreads; offset <<= 1) {
    const int32_t add = threadIdx.x >= offset ? sums[threadIdx.x - offset] : 0;
    __syncthreads();
    sums[threadIdx.x] += add;
    __syncthreads();
  }
  int32_t running = threadIdx.x > 0 ? sums[threadIdx.x - 1] : 0;
  for (int64_t i = begin; i < end; ++i) {
    const int32_t v = values[i];
    values[i] = running;
    running += v;
  }
  __syncthreads();
  const int32_t total = sums[kScanThreads - 1];
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    expert_offsets[e] = tiles > 0 ? values[int64_t(e) * tiles] : 0;
  if (threadIdx.x == 0) expert_offsets[E] = total;
}

__global__ void __launch_bounds__(kTileTokens)
    scatter_kernel(int64_t T, int E, int k, const int32_t* ids, const int32_t* tile_base,
                   const int32_t* expert_offsets, int32_t* expert_token_indices,
                   int32_t* token_index_map, int32_t* row_pair) {
  extern __shared__ uint32_t bits[];  // [E, kTileWords]
  build_tile_bitmap(T, E, k, ids, bits);
  const int tiles = gridDim.x;
  const int64_t t = int64_t(blockIdx.x) * kTileTokens + threadIdx.x;
  const int word = threadIdx.x >> 5;
  const uint32_t below = (1u << (threadIdx.x & 31)) - 1u;
  if (t < T) {
    const int32_t* token_ids = ids + t * k;
    for (int j = 0; j < k; ++j) {
      const int64_t pair = t * k + j;
      if (!pair_valid(token_ids, j, E)) {
        token_index_map[pair] = -1;
        continue;
      }
      const int e = token_ids[j];
      const uint32_t* eb = bits + e * kTileWords;
      int rank = __popc(eb[word] & below);
      for (int w = 0; w < word; ++w) rank += __popc(eb[w]);
      const int32_t pos = tile_base[int64_t(e) * tiles + blockIdx.x] + rank;
      expert_token_indices[pos] = int32_t(t);
      token_index_map[pair] = pos;
      if (row_pair) row_pair[pos] = int32_t(pair);
    }
  }
  // Rows past the last kept pair (dropped pairs) hold -1.
  const int64_t N = T * k;
  for (int64_t i = expert_offsets[E] + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N;
       i += int64_t(gridDim.x) * blockDim.x) {
    expert_token_indices[i] = -1;
    if (row_pair) row_pair[i] = -1;
  }
}

__global__ void row_pair_kernel(int64_t N, const int32_t* token_index_map, int32_t* row_pair) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= N) return;
  const int32_t r = token_index_map[p];
  if (r >= 0) row_pair[r] = int32_t(p);
}

__global__ void counts_kernel(int64_t E, const int32_t* offsets, int32_t* counts) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < E) counts[e] = offsets[e + 1] - offsets[e];
}

}  // namespace

void routing_build(const LayerDesc& desc, int64_t T, const int32_t* ids, int32_t* expert_offsets,
                   int32_t* expert_token_indices, int32_t* token_index_map, int32_t* row_pair,
                   Carver& ws, bool run, cudaStream_t stream) {
  const int E = int(desc.E), k = int(desc.k);
  const int tiles = int((T + kTileTokens - 1) / kTileTokens);
  int32_t* tile_counts = ws.carve<int32_t>(sizeof(int32_t) * (size_t(E) * tiles + 1));
  if (!run) return;
  const size_t smem = sizeof(uint32_t) * size_t(E) * kTileWords;
  if (tiles > 0) {
    tile_count_kernel<<<tiles, kTileTokens, smem, stream>>>(T, E, k, ids, tile_counts);
    check_launch("tile_count_kernel");
  }
  scan_kernel<<<1, kScanThreads, 0, stream>>>(int64_t(E) * tiles, E, tiles, tile_counts,
                                              expert_offsets);
  check_launch("scan_kernel");
  if (tiles > 0) {
    scatter_kernel<<<tiles, kTileTokens, smem, stream>>>(
        T, E, k, ids, tile_counts, expert_offsets, expert_token_indices, token_index_map, row_pair);
    check_launch("scatter_kernel");
  }
}

void build_row_pair(int64_t N, const int32_t* token_index_map, int32_t* row_pair,
                    cudaStream_t stream) {
  if (N == 0) return;
  row_pair_kernel<<<blocks_for(N, 256), 256, 0, stream>>>(N, token_index_map, row_pair);
  check_launch("row_pair_kernel");
}

void counts_from_offsets(int64_t E, const int32_t* expert_offsets, int32_t* counts,
                         cudaStream_t stream) {
  counts_kernel<<<blocks_for(E, 256), 256, 0, stream>>>(E, expert_offsets, counts);
  check_launch("counts_kernel");
}

}  // namespace cuda
}  // namespace moeblaze
