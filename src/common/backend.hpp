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
