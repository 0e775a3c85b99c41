// The contract between the C API (src/api) and a backend (src/cpu, src/cuda).
//
// The API layer validates every argument (handles, NULLs, sizes, buffer sizes, alignment) before it
// calls a backend, so a backend may assume: T >= 0, T*k < 2^31, required pointers non-null when
// T > 0, workspace/saved buffers at least as large as the backend's own size functions said, and
// 16-byte aligned. A backend throws moeblaze::Error for what only it can detect (CPU: ids out of
// range, non-finite logits, a saved header that does not match; CUDA: runtime errors).
//
// Pointers are in the backend's memory space (host for CPU, device for CUDA). "rtype" = routing
// dtype (F64 for F64 layers, else F32). Every tensor is dense row-major.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "layer_desc.hpp"
#include "saved_layout.hpp"

namespace moeblaze {

struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
};

struct RouterForwardCall {
  int64_t T = 0;
  const void* logits = nullptr;      // [T,E] rtype
  int32_t* ids = nullptr;            // [T,k] out
  void* g = nullptr;                 // [T,k] rtype out
  int32_t* expert_counts = nullptr;  // [E] out, optional
  void* losses = nullptr;            // [2] rtype out, optional
  Buffer workspace;
  void* stream = nullptr;
};

struct RouterBackwardCall {
  int64_t T = 0;
  const void* logits = nullptr;    // [T,E] rtype
  const int32_t* ids = nullptr;    // [T,k]
  const void* dg = nullptr;        // [T,k] rtype
  const void* d_losses = nullptr;  // [2] rtype, optional: nullptr means {1, 1}
  void* d_logits = nullptr;        // [T,E] rtype out
  Buffer workspace;
  void* stream = nullptr;
};

struct RoutingBuildCall {
  int64_t T = 0;
  const int32_t* ids = nullptr;             // [T,k]
  int32_t* expert_offsets = nullptr;        // [E+1] out
  int32_t* expert_token_indices = nullptr;  // [N] out
  int32_t* token_index_map = nullptr;       // [N] out
  Buffer workspace;
  void* stream = nullptr;
};

// logits = x . w_router^T in the routing dtype (fp32 accumulation).
struct RouterProjectForwardCall {
  int64_t T = 0;
  const void* x = nullptr;         // [T,d] dtype
  const void* w_router = nullptr;  // [E,d] dtype
  void* logits = nullptr;          // [T,E] rtype out
  Buffer workspace;
  void* stream = nullptr;
};

// dx += d_logits . w_router (dx read and rounded back to dtype), dw_router (=|+=) d_logits^T . x.
struct RouterProjectBackwardCall {
  int64_t T = 0;
  const void* d_logits = nullptr;  // [T,E] rtype
  const void* x = nullptr;         // [T,d] dtype
  const void* w_router = nullptr;  // [E,d] dtype
  void* dx = nullptr;              // [T,d] dtype in/out, optional
  void* dw_router = nullptr;       // [E,d] dtype out, optional
  bool accumulate_wgrad = false;
  Buffer workspace;
  void* stream = nullptr;
};

struct ExpertsForwardCall {
  int64_t T = 0;
  const void* x = nullptr;           // [T,d]
  const int32_t* ids = nullptr;      // [T,k]
  const void* g = nullptr;           // [T,k] rtype
  const void* w_gate = nullptr;      // [E,h,d]
  const void* w_up = nullptr;        // [E,h,d], gated only (nullptr otherwise)
  const void* w_down = nullptr;      // [E,d,h]
  void* y = nullptr;                 // [T,d] out
  int32_t* expert_counts = nullptr;  // [E] out, optional
  // The caller's saved buffer, already carved (Pass::ExpertsForward or LayerForward layout), or all
  // nullptr for inference. The backend fills header, indices and the activations its policy keeps.
  bool has_saved = false;
  SavedView saved;
  Pass saved_pass = Pass::ExpertsForward;  // which layout `saved` has (for the header)
  Buffer workspace;
  void* stream = nullptr;
};

struct ExpertsBackwardCall {
  int64_t T = 0;
  const void* dy = nullptr;      // [T,d]
  const void* x = nullptr;       // [T,d]
  const int32_t* ids = nullptr;  // [T,k]
  const void* g = nullptr;       // [T,k] rtype
  const void* w_gate = nullptr;
  const void* w_up = nullptr;  // nullptr for non-gated
  const void* w_down = nullptr;
  SavedView saved;  // carved view of the caller's saved buffer (read only)
  Pass saved_pass = Pass::ExpertsForward;
  void* dx = nullptr;       // [T,d] out, optional
  void* dw_gate = nullptr;  // optional
  void* dw_up = nullptr;    // optional, gated only
  void* dw_down = nullptr;  // optional
  void* dg = nullptr;       // [T,k] rtype out, optional
  bool accumulate_wgrad = false;
  // MOEBLAZE_BACKWARD_CONSUME_SAVED: the backend may overwrite `saved`'s activations (and must then
  // have been asked for the workspace size with that flag). A backend may ignore it.
  bool consume_saved = false;
  Buffer workspace;
  void* stream = nullptr;
};

// The router losses of one rank's tokens with the global counts and token count, for expert
// parallelism (docs/design/expert-parallel.md, section 3).
struct LossShareCall {
  int64_t T = 0;                           // this rank's tokens
  int64_t global_tokens = 0;               // T over all ranks
  const void* logits = nullptr;            // [T,E] rtype
  const int32_t* global_counts = nullptr;  // [E] int32: routed rows per expert over all ranks
  void* scratch = nullptr;                 // [kLossShareScratchRows,E] rtype, workspace
  void* stream = nullptr;
};

// Rows of E routing-dtype values that the loss shares use as scratch (LossShareCall::scratch).
constexpr int64_t kLossShareScratchRows = 2;

class Backend {
 public:
  virtual ~Backend() = default;

  virtual int32_t kind() const = 0;  // MOEBLAZE_BACKEND_*
  virtual int32_t device() const = 0;

  // Throws Error(NOT_SUPPORTED) if this backend cannot run the layer (e.g. F64 on CUDA).
  virtual void check_supported(const LayerDesc& desc) const = 0;

  // Scratch bytes for one call of `pass` (any Pass except LayerForward/LayerBackward, which the API
  // layer composes from the others). `flags` matter for two passes: Pass::ExpertsBackward reads
  // MOEBLAZE_BACKWARD_CONSUME_SAVED, Pass::ExpertsForward MOEBLAZE_FORWARD_WITH_SAVED (the call
  // will have call.has_saved set); either may need less. The execute call must carve the same
  // layout from its own call fields.
  virtual size_t workspace_size(const LayerDesc& desc, Pass pass, int64_t T,
                                uint32_t flags) const = 0;

  virtual void router_forward(const LayerDesc& desc, const RouterForwardCall& call) = 0;
  virtual void router_backward(const LayerDesc& desc, const RouterBackwardCall& call) = 0;
  virtual void routing_build(const LayerDesc& desc, const RoutingBuildCall& call) = 0;
  virtual void router_project_forward(const LayerDesc& desc,
                                      const RouterProjectForwardCall& call) = 0;
  virtual void router_project_backward(const LayerDesc& desc,
                                       const RouterProjectBackwardCall& call) = 0;
  virtual void experts_forward(const LayerDesc& desc, const ExpertsForwardCall& call) = 0;
  virtual void experts_backward(const LayerDesc& desc, const ExpertsBackwardCall& call) = 0;

  // Asynchronous copy within the backend's memory space (on `stream`).
  virtual void copy(void* dst, const void* src, size_t bytes, void* stream) = 0;

  // ---- Row movement and loss shares of expert parallelism (src/ep) --------------------------
  // What the expert-parallel layer needs beyond the calls above. None allocates; every reduction
  // runs in a fixed order (bitwise repeatable). `index_rows` bounds the rows an index may name:
  // an entry outside [0, index_rows) is skipped (gather: the row is zeroed), never followed, so a
  // corrupted index buffer cannot move memory outside the buffers (the CPU EP layer also checks
  // the indices first and reports them; the CUDA one cannot read them without a host sync).

  // dst[i] = src[index[i]] for i < n; rows of row_bytes bytes (row_bytes a multiple of 2).
  virtual void gather_rows(void* dst, const void* src, const int32_t* index, int64_t n,
                           int64_t index_rows, size_t row_bytes, void* stream) = 0;
  // dst[index[i]] = src[i] for i < n; `index` is a permutation of 0..n-1 (no two writes collide).
  virtual void scatter_rows(void* dst, const void* src, const int32_t* index, int64_t n,
                            int64_t index_rows, size_t row_bytes, void* stream) = 0;
  // out[t] = sum_{j=0..k-1} rows[index[t*k+j]] in the accumulation type (F64 for F64, else F32),
  // j ascending from 0, rounded once to `dtype`. out [T,d], rows [index_rows,d], both `dtype`.
  virtual void combine_rows(Dtype dtype, void* out, const void* rows, const int32_t* index,
                            int64_t T, int64_t k, int64_t d, int64_t index_rows, void* stream) = 0;
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
  // Copies `bytes` to host memory and waits for `stream` (the one host synchronisation of EP).
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes, void* stream) = 0;
  // dst, src: memory of any rank of a LOCAL group (for CUDA: any device); synchronous.
  virtual void copy_between_ranks(void* dst, const void* src, size_t bytes) = 0;
  // Blocks until the work enqueued on `stream` is done (no-op on CPU).
  virtual void synchronize(void* stream) = 0;

  // CPU: worker threads (0 = hardware concurrency). Others: ignored.
  virtual void set_num_threads(int32_t num_threads) { (void)num_threads; }

  // Is `ptr` usable by this backend? Used by the API layer to reject host pointers on CUDA and
  // device pointers on CPU where the runtime can tell. Returning true means "cannot tell or yes".
  virtual bool pointer_usable(const void* ptr) const {
    (void)ptr;
    return true;
  }
};

// Factories, one per backend. Each throws Error(NOT_SUPPORTED) with a reason when the backend
// cannot be created (not compiled in, no device).
std::unique_ptr<Backend> make_cpu_backend();
std::unique_ptr<Backend> make_cuda_backend(int32_t device);
bool cuda_backend_available();  // compiled in and a usable GPU present; never throws
const char* cuda_build_info();  // "CUDA 13.0, sm_80 sm_90a" or "CUDA backend not built"
// True only when `ptr` is known to be device memory of some GPU (not host, pinned or managed
// memory): the CPU backend rejects such pointers instead of dereferencing them. False when CUDA is
// not built, no GPU is present, or the runtime cannot tell. Never throws.
bool cuda_pointer_is_device_memory(const void* ptr);

}  // namespace moeblaze
