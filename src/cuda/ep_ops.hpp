// The CUDA backend's operations for expert parallelism (cuda/ep_ops.cu), behind the Backend
// interface's row movement and loss shares (common/backend.hpp documents each). Callers make the
// context's device current.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/backend.hpp"

namespace moeblaze {
namespace cuda {

void ep_gather_rows(void* dst, const void* src, const int32_t* index, int64_t n, int64_t index_rows,
                    size_t row_bytes, cudaStream_t stream);
void ep_scatter_rows(void* dst, const void* src, const int32_t* index, int64_t n,
                     int64_t index_rows, size_t row_bytes, cudaStream_t stream);
void ep_combine_rows(Dtype dtype, void* out, const void* rows, const int32_t* index, int64_t T,
                     int64_t k, int64_t d, int64_t index_rows, cudaStream_t stream);
void ep_local_expert_ids(const int32_t* table, int64_t W, int64_t E, int64_t expert_begin,
                         int64_t local_experts, int64_t R, int32_t* local_ids, cudaStream_t stream);
void ep_global_counts(const int32_t* table, int64_t W, int64_t E, int32_t* counts,
                      cudaStream_t stream);
void ep_loss_shares_forward(const LayerDesc& desc, const LossShareCall& call, void* losses);
void ep_loss_shares_backward(const LayerDesc& desc, const LossShareCall& call, const void* d_losses,
                             void* d_logits);
void ep_copy_to_host(void* host_dst, const void* src, size_t bytes, cudaStream_t stream);
void ep_copy_between_ranks(void* dst, const void* src, size_t bytes);
void ep_synchronize(cudaStream_t stream);

}  // namespace cuda
}  // namespace moeblaze
