// The few data-movement and loss operations of the expert-parallel layer that the Backend interface
// does not offer (gathers and scatters of rows by an index list, the per-token combine, the local
// expert ids of received rows, the router losses with global statistics), one implementation per
// memory space: host memory for the CPU backend (ep_ops_cpu.cpp), device memory for the CUDA
// backend (ep_ops_cuda.cu). Every reduction runs in a fixed order: results are bitwise repeatable.
//
// Pointers are in the backend's memory space unless named host_*. "rtype" = routing dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/layer_desc.hpp"

namespace moeblaze {
namespace ep {

// Rows of E routing-dtype values that the loss shares use as scratch (LossShareCall::scratch).
constexpr int64_t kLossShareScratchRows = 2;

// The router losses of one rank's tokens with the global counts and token count (design section 3).
struct LossShareCall {
  int64_t T = 0;                           // this rank's tokens
  int64_t global_tokens = 0;               // T over all ranks
  const void* logits = nullptr;            // [T,E] rtype
  const int32_t* global_counts = nullptr;  // [E] int32: routed rows per expert over all ranks
  void* scratch = nullptr;                 // [2,E] rtype, workspace (kLossShareScratchRows rows)
  void* stream = nullptr;
};

// None of these operations allocates: scratch comes from the caller (the EP layer's workspace).
class EpOps {
 public:
  virtual ~EpOps() = default;

  // dst[i] = src[index[i]] for i < n; rows of row_bytes bytes (row_bytes a multiple of 2).
  virtual void gather_rows(void* dst, const void* src, const int32_t* index, int64_t n,
                           size_t row_bytes, void* stream) = 0;
  // dst[index[i]] = src[i] for i < n; `index` is a permutation of 0..n-1 (no two writes collide).
  virtual void scatter_rows(void* dst, const void* src, const int32_t* index, int64_t n,
                            size_t row_bytes, void* stream) = 0;
  // out[t] = sum_{j=0..k-1} rows[index[t*k+j]] in the accumulation type (F64 for F64, else F32),
  // j ascending from 0, rounded once to `dtype`. out [T,d], rows [T*k,d], both `dtype`.
  virtual void combine_rows(Dtype dtype, void* out, const void* rows, const int32_t* index,
                            int64_t T, int64_t k, int64_t d, void* stream) = 0;
  // Received rows arrive by source rank, then local expert, then token: local_ids[i] is the local
  // expert of row i. table [W,E] int32 (row s = per-expert counts of source s); this rank owns the
  // experts [expert_begin, expert_begin + local_experts). R = rows received.
  virtual void local_expert_ids(const int32_t* table, int64_t W, int64_t E, int64_t expert_begin,
                                int64_t local_experts, int64_t R, int32_t* local_ids,
                                void* stream) = 0;
  // counts[e] = sum_s table[s][e] (int32), s ascending.
  virtual void global_counts(const int32_t* table, int64_t W, int64_t E, int32_t* counts,
                             void* stream) = 0;
  // losses [2] rtype = this rank's shares of {aux, z} of the global batch; as the router's
  // definitions (moeblaze_router_forward()) with the global counts and token count.
  virtual void loss_shares_forward(const LayerDesc& desc, const LossShareCall& call,
                                   void* losses) = 0;
  // d_logits [T,E] rtype += the gradient of d_losses[0] * aux share + d_losses[1] * z share, the
  // same per-token arithmetic as the router's backward (d_losses [2] rtype; NULL means {1, 1}).
  virtual void loss_shares_backward(const LayerDesc& desc, const LossShareCall& call,
                                    const void* d_losses, void* d_logits) = 0;
  // Synchronous copies, for the one host synchronisation and the LOCAL transport.
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes, void* stream) = 0;
  // dst, src: memory of any rank of a LOCAL group (for CUDA: any device; synchronous).
  virtual void copy_between_ranks(void* dst, const void* src, size_t bytes) = 0;
  // Blocks until the work enqueued on `stream` is done (no-op on CPU).
  virtual void synchronize(void* stream) = 0;
};

std::unique_ptr<EpOps> make_cpu_ep_ops();
// Throws Error(NOT_SUPPORTED) when the CUDA backend is not built.
std::unique_ptr<EpOps> make_cuda_ep_ops(int32_t device);

}  // namespace ep
}  // namespace moeblaze
