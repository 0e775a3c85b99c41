// Host-side entry points of the CUDA kernels, shared by the .cu files of src/cuda.
//
// Every function takes a Carver and `run`: with run == false it only carves (the workspace size
// query), with run == true it carves the same layout out of the caller's workspace and enqueues its
// kernels on `stream`. So the size query and the execution can never disagree.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/backend.hpp"
#include "common/carver.hpp"
#include "common/layer_desc.hpp"

namespace moeblaze {
namespace cuda {

// logits [T,E] fp32 -> ids [T,k], g [T,k], counts [E] (optional), losses [2] (optional).
void router_forward(const LayerDesc& desc, int64_t T, const float* logits, int32_t* ids, float* g,
                    int32_t* expert_counts, float* losses, Carver& ws, bool run,
                    cudaStream_t stream);

// d_logits [T,E] fp32 from dg [T,k] and d_losses [2] (nullptr = {1,1}).
void router_backward(const LayerDesc& desc, int64_t T, const float* logits, const int32_t* ids,
                     const float* dg, const float* d_losses, float* d_logits, Carver& ws, bool run,
                     cudaStream_t stream);

// The routing index structures (see moeblaze_routing_build). `row_pair` [N] (optional) receives,
// for each routed row, its pair index t*k+j. Pairs with an id out of range or repeated within the
// token are dropped: their token_index_map entry is -1, and expert_token_indices past
// expert_offsets[E] is -1.
void routing_build(const LayerDesc& desc, int64_t T, const int32_t* ids, int32_t* expert_offsets,
                   int32_t* expert_token_indices, int32_t* token_index_map, int32_t* row_pair,
                   Carver& ws, bool run, cudaStream_t stream);

// row_pair [N] from token_index_map (-1 entries skipped; rows no pair maps to are left alone).
void build_row_pair(int64_t N, const int32_t* token_index_map, int32_t* row_pair,
                    cudaStream_t stream);

// counts[e] = offsets[e+1] - offsets[e].
void counts_from_offsets(int64_t E, const int32_t* expert_offsets, int32_t* counts,
                         cudaStream_t stream);

}  // namespace cuda
}  // namespace moeblaze
