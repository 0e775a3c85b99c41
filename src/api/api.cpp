// The extern "C" entry points of libmoeblaze: validate every argument, then dispatch to the backend
// bound to the layer's context. Every body runs inside api::guarded(), the exception barrier.
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "api/barrier.hpp"
#include "api/layer_composite.hpp"
#include "api/versioned_struct.hpp"
#include "common/checks.hpp"
#include "common/handles.hpp"
#include "common/saved_layout.hpp"
#include "moeblaze_revision.h"  // MOEBLAZE_GIT_REVISION, written at build time

using namespace moeblaze;
using namespace moeblaze::api;

namespace {

std::shared_ptr<ContextState> context_of(moeblaze_context_t context, const char* argument) {
  return acquire<ContextState>(context, HandleKind::Context, argument);
}

std::shared_ptr<LayerState> layer_of(moeblaze_layer_t layer) {
  return acquire<LayerState>(layer, HandleKind::Layer, "layer");
}

// The router and routing-build calls take each tensor as an argument. The layer and num_tokens are
// checked first, then the call's tensors, then its workspace (execute()).
struct PlainCall {
  std::shared_ptr<LayerState> plan;
  Backend& backend;
  bool empty;  // no tokens: a tensor with no elements may be NULL
  const LayerDesc& desc() const { return plan->desc; }
};

PlainCall plain_call(moeblaze_layer_t layer, int64_t num_tokens) {
  auto plan = layer_of(layer);
  Backend& backend = *plan->context->backend;
  require_num_tokens(plan->desc, num_tokens, "num_tokens");
  return PlainCall{std::move(plan), backend, num_tokens == 0};
}

// Checks the workspace against what `pass` needs for call.T tokens (`query` names the size query
// that gives it), then runs the call under the context's execute lock.
template <typename Call>
void execute(const PlainCall& c, Pass pass, Call& call, void* workspace, size_t workspace_bytes,
             void* stream, const char* query, void (Backend::*run)(const LayerDesc&, const Call&)) {
  require_buffer(c.backend, workspace, workspace_bytes,
                 c.backend.workspace_size(c.desc(), pass, call.T, 0), "workspace",
                 "workspace_bytes", query);
  call.workspace = {workspace, workspace_bytes};
  call.stream = stream;
  std::lock_guard<std::mutex> lock(c.plan->context->execute_mutex);
  (c.backend.*run)(c.desc(), call);
}

// The experts and layer passes: the layer handle first, then the args struct (the versioned-struct
// rules, src/api/versioned_struct.hpp), then `run` checks the fields and executes `pass`.
template <typename Args>
void run_pass(moeblaze_layer_t layer, const Args* args, size_t first_published_size, Pass pass,
              void* stream, void (*run)(LayerState&, const Args&, Pass, void*)) {
  const auto plan = layer_of(layer);
  const Args a = read_versioned(args, zeroed<Args>(), first_published_size, "args");
  run(*plan, a, pass, stream);
}

}  // namespace

#define MB_STRINGIFY2(x) #x
#define MB_STRINGIFY(x) MB_STRINGIFY2(x)

// ---- errors
// ---------------------------------------------------------------------------------------

namespace moeblaze {
namespace api {

static thread_local std::string t_last_error;

void set_last_error(const char* function, moeblaze_status_t status, const std::string& message) {
  try {
    t_last_error = std::string(function) + ": " + moeblaze_status_name(status) + ": " + message;
  } catch (...) {
    t_last_error.clear();  // out of memory while reporting: the status still says what happened
  }
}

void clear_last_error() {
  t_last_error.clear();
}

}  // namespace api
}  // namespace moeblaze

extern "C" {

int32_t moeblaze_get_version(void) {
  return MOEBLAZE_VERSION;
}

int32_t moeblaze_get_abi_version(void) {
  return MOEBLAZE_ABI_VERSION;
}

const char* moeblaze_get_build_info(void) {
  static const std::string info =
      std::string("moeblaze ") +
      MB_STRINGIFY(MOEBLAZE_VERSION_MAJOR) "." MB_STRINGIFY(
          MOEBLAZE_VERSION_MINOR) "." MB_STRINGIFY(MOEBLAZE_VERSION_PATCH) +
      " (git " MOEBLAZE_GIT_REVISION "), ABI " +
      MB_STRINGIFY(MOEBLAZE_ABI_VERSION) ", backends: CPU; " + cuda_build_info();
  return info.c_str();
}

const char* moeblaze_status_name(moeblaze_status_t status) {
  switch (status) {
    case MOEBLAZE_OK: return "MOEBLAZE_OK";
    case MOEBLAZE_ERR_INVALID_ARGUMENT: return "MOEBLAZE_ERR_INVALID_ARGUMENT";
    case MOEBLAZE_ERR_INVALID_HANDLE: return "MOEBLAZE_ERR_INVALID_HANDLE";
    case MOEBLAZE_ERR_NOT_SUPPORTED: return "MOEBLAZE_ERR_NOT_SUPPORTED";
    case MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE: return "MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE";
    case MOEBLAZE_ERR_OUT_OF_MEMORY: return "MOEBLAZE_ERR_OUT_OF_MEMORY";
    case MOEBLAZE_ERR_CUDA: return "MOEBLAZE_ERR_CUDA";
    case MOEBLAZE_ERR_VERSION_MISMATCH: return "MOEBLAZE_ERR_VERSION_MISMATCH";
    case MOEBLAZE_ERR_NON_FINITE: return "MOEBLAZE_ERR_NON_FINITE";
    case MOEBLAZE_ERR_INTERNAL: return "MOEBLAZE_ERR_INTERNAL";
    default: return "MOEBLAZE_ERR_UNKNOWN_STATUS";
  }
}

const char* moeblaze_status_string(moeblaze_status_t status) {
  switch (status) {
    case MOEBLAZE_OK: return "success";
    case MOEBLAZE_ERR_INVALID_ARGUMENT: return "invalid argument";
    case MOEBLAZE_ERR_INVALID_HANDLE: return "invalid handle";
    case MOEBLAZE_ERR_NOT_SUPPORTED: return "not supported";
    case MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE: return "workspace or saved buffer too small";
    case MOEBLAZE_ERR_OUT_OF_MEMORY: return "out of host memory";
    case MOEBLAZE_ERR_CUDA: return "CUDA error";
    case MOEBLAZE_ERR_VERSION_MISMATCH: return "version mismatch";
    case MOEBLAZE_ERR_NON_FINITE: return "non-finite input";
    case MOEBLAZE_ERR_INTERNAL: return "internal error";
    default: return "unknown status code";
  }
}

const char* moeblaze_last_error(void) {
  return t_last_error.c_str();
}

size_t moeblaze_copy_last_error(char* buffer, size_t buffer_size) {
  const size_t needed = t_last_error.size() + 1;
  if (buffer != nullptr && buffer_size > 0) {
    const size_t n = needed < buffer_size ? needed - 1 : buffer_size - 1;
    std::memcpy(buffer, t_last_error.data(), n);
    buffer[n] = '\0';
  }
  return needed;
}

// ---- contexts
// -------------------------------------------------------------------------------------

int32_t moeblaze_backend_available(int32_t backend) {
  if (backend == MOEBLAZE_BACKEND_CPU) return 1;
  if (backend == MOEBLAZE_BACKEND_CUDA) {
    try {
      return cuda_backend_available() ? 1 : 0;
    } catch (...) {
      return 0;
    }
  }
  return 0;
}

moeblaze_status_t moeblaze_context_create(moeblaze_context_t* out, int32_t backend,
                                          int32_t device) {
  if (out != nullptr) *out = nullptr;
  return guarded(__func__, [&] {
    MB_REQUIRE_ARG(out != nullptr, "out is NULL");
    MB_REQUIRE_ARG(backend == MOEBLAZE_BACKEND_CPU || backend == MOEBLAZE_BACKEND_CUDA,
                   "backend = %d is not a moeblaze_backend_code (CPU 1, CUDA 2)", backend);
    MB_REQUIRE_ARG(device >= 0, "device = %d must be >= 0", device);
    auto state = std::make_shared<ContextState>();
    if (backend == MOEBLAZE_BACKEND_CPU) {
      MB_REQUIRE_ARG(device == 0, "device = %d: the CPU backend has only device 0", device);
      state->backend = make_cpu_backend();
    } else {
      state->backend = make_cuda_backend(device);
    }
    state->backend_kind = backend;
    state->device = device;
    *out = static_cast<moeblaze_context_t>(register_handle(std::move(state), HandleKind::Context));
  });
}

moeblaze_status_t moeblaze_context_destroy(moeblaze_context_t context) {
  return guarded(__func__, [&] {
    if (context == nullptr) return;
    unregister_handle(context, HandleKind::Context, "context");
  });
}

moeblaze_status_t moeblaze_context_get_info(moeblaze_context_t context, int32_t* backend,
                                            int32_t* device) {
  return guarded(__func__, [&] {
    const auto state = context_of(context, "context");
    if (backend) *backend = state->backend_kind;
    if (device) *device = state->device;
  });
}

moeblaze_status_t moeblaze_context_set_num_threads(moeblaze_context_t context,
                                                   int32_t num_threads) {
  return guarded(__func__, [&] {
    const auto state = context_of(context, "context");
    MB_REQUIRE_ARG(num_threads >= 0 && num_threads <= 4096,
                   "num_threads = %d must be in [0, 4096] (0: one per hardware thread)",
                   num_threads);
    std::lock_guard<std::mutex> lock(state->execute_mutex);
    state->backend->set_num_threads(num_threads);
  });
}

// ---- layer plans
// ----------------------------------------------------------------------------------

static moeblaze_layer_config_t default_config() {
  moeblaze_layer_config_t c = zeroed<moeblaze_layer_config_t>();
  c.dtype = MOEBLAZE_DTYPE_BF16;
  c.top_k = 1;
  c.activation = MOEBLAZE_ACTIVATION_SWIGLU;
  c.checkpoint = MOEBLAZE_CHECKPOINT_SAVE_PREACT;
  c.score_function = MOEBLAZE_SCORE_SOFTMAX_TOPK;
  c.renormalize = 0;
  c.deterministic = 1;
  return c;
}

// The sizes of the structs as first published (v0.1). Older callers can never be smaller.
static constexpr size_t kConfigV0Size = sizeof(moeblaze_layer_config_t);
static constexpr size_t kForwardArgsV0Size = sizeof(moeblaze_forward_args_t);
static constexpr size_t kBackwardArgsV0Size = sizeof(moeblaze_backward_args_t);

moeblaze_status_t moeblaze_layer_config_init(moeblaze_layer_config_t* config, size_t struct_size) {
  return guarded(__func__, [&] {
    init_versioned(config, struct_size, default_config(), kConfigV0Size, "config");
  });
}

moeblaze_status_t moeblaze_layer_create(moeblaze_layer_t* out, moeblaze_context_t context,
                                        const moeblaze_layer_config_t* config) {
  if (out != nullptr) *out = nullptr;
  return guarded(__func__, [&] {
    MB_REQUIRE_ARG(out != nullptr, "out is NULL");
    auto state = context_of(context, "context");
    const moeblaze_layer_config_t cfg =
        read_versioned(config, default_config(), kConfigV0Size, "config");
    LayerDesc desc = make_layer_desc(cfg);
    state->backend->check_supported(desc);
    auto layer = std::make_shared<LayerState>(LayerState{std::move(state), desc, cfg});
    *out = static_cast<moeblaze_layer_t>(register_handle(std::move(layer), HandleKind::Layer));
  });
}

moeblaze_status_t moeblaze_layer_destroy(moeblaze_layer_t layer) {
  return guarded(__func__, [&] {
    if (layer == nullptr) return;
    unregister_handle(layer, HandleKind::Layer, "layer");
  });
}

moeblaze_status_t moeblaze_layer_get_config(moeblaze_layer_t layer,
                                            moeblaze_layer_config_t* config) {
  return guarded(__func__, [&] {
    const auto plan = layer_of(layer);
    MB_REQUIRE_ARG(config != nullptr, "config is NULL");
    uint32_t caller_size = 0;
    std::memcpy(&caller_size, config, sizeof(caller_size));
    require_struct_size(caller_size, kConfigV0Size, "config");
    // Fields this library does not know read as their defaults (zero) to a newer caller.
    std::memset(static_cast<void*>(config), 0, caller_size);
    std::memcpy(static_cast<void*>(config), &plan->config,
                caller_size < sizeof(plan->config) ? caller_size : sizeof(plan->config));
    config->struct_size = caller_size;
  });
}

static Pass require_pass(int32_t pass, bool forward_only, const char* argument) {
  if (forward_only) {
    MB_REQUIRE_ARG(
        pass == MOEBLAZE_PASS_EXPERTS_FORWARD || pass == MOEBLAZE_PASS_LAYER_FORWARD,
        "%s = %d: only MOEBLAZE_PASS_EXPERTS_FORWARD (3) and MOEBLAZE_PASS_LAYER_FORWARD "
        "(5) fill a saved buffer",
        argument, pass);
  } else {
    MB_REQUIRE_ARG(pass >= MOEBLAZE_PASS_ROUTER_FORWARD && pass <= MOEBLAZE_PASS_LAYER_BACKWARD,
                   "%s = %d is not a moeblaze_pass_code (0..6)", argument, pass);
  }
  return static_cast<Pass>(pass);
}

namespace {

// Both workspace queries: the MOEBLAZE_BACKWARD_* flags matter only for the backward passes,
// MOEBLAZE_FORWARD_WITH_SAVED only for the forward ones; the rest are ignored.
void query_workspace_size(moeblaze_layer_t layer, int32_t pass, int64_t num_tokens, uint32_t flags,
                          size_t* bytes) {
  const auto plan = layer_of(layer);
  MB_REQUIRE_ARG(bytes != nullptr, "bytes is NULL");
  const Pass p = require_pass(pass, false, "pass");
  require_num_tokens(plan->desc, num_tokens, "num_tokens");
  require_workspace_flags(flags, "flags");
  const bool backward = p == Pass::ExpertsBackward || p == Pass::LayerBackward;
  const bool forward = p == Pass::ExpertsForward || p == Pass::LayerForward;
  const uint32_t applies = backward  ? flags & ~MOEBLAZE_FORWARD_WITH_SAVED
                           : forward ? flags & MOEBLAZE_FORWARD_WITH_SAVED
                                     : 0u;
  *bytes = workspace_size_for(*plan, p, num_tokens, applies);
}

}  // namespace

moeblaze_status_t moeblaze_layer_workspace_size(moeblaze_layer_t layer, int32_t pass,
                                                int64_t num_tokens, size_t* bytes) {
  if (bytes != nullptr) *bytes = 0;
  return guarded(__func__, [&] { query_workspace_size(layer, pass, num_tokens, 0, bytes); });
}

moeblaze_status_t moeblaze_layer_workspace_size_with_flags(moeblaze_layer_t layer, int32_t pass,
                                                           int64_t num_tokens, uint32_t flags,
                                                           size_t* bytes) {
  if (bytes != nullptr) *bytes = 0;
  return guarded(__func__, [&] { query_workspace_size(layer, pass, num_tokens, flags, bytes); });
}

moeblaze_status_t moeblaze_layer_saved_size(moeblaze_layer_t layer, int32_t pass,
                                            int64_t num_tokens, size_t* bytes) {
  if (bytes != nullptr) *bytes = 0;
  return guarded(__func__, [&] {
    const auto plan = layer_of(layer);
    MB_REQUIRE_ARG(bytes != nullptr, "bytes is NULL");
    const Pass p = require_pass(pass, true, "pass");
    require_num_tokens(plan->desc, num_tokens, "num_tokens");
    *bytes = saved_size(plan->desc, p, num_tokens);
  });
}

// ---- router
// ---------------------------------------------------------------------------------------

moeblaze_status_t moeblaze_router_forward(moeblaze_layer_t layer, int64_t num_tokens,
                                          const void* logits, int32_t* ids, void* g,
                                          int32_t* expert_counts, void* losses, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  return guarded(__func__, [&] {
    const PlainCall c = plain_call(layer, num_tokens);
    const size_t relem = c.desc().relem_size();
    require_tensor(c.backend, logits, true, c.empty, relem, "logits");
    require_tensor(c.backend, ids, true, c.empty, sizeof(int32_t), "ids");
    require_tensor(c.backend, g, true, c.empty, relem, "g");
    require_tensor(c.backend, expert_counts, false, false, sizeof(int32_t), "expert_counts");
    require_tensor(c.backend, losses, false, false, relem, "losses");
    const size_t T = size_t(num_tokens), E = size_t(c.desc().E), k = size_t(c.desc().k);
    require_disjoint({{logits, T * E * relem, false, "logits"},
                      {ids, T * k * sizeof(int32_t), true, "ids"},
                      {g, T * k * relem, true, "g"},
                      {expert_counts, E * sizeof(int32_t), true, "expert_counts"},
                      {losses, 2 * relem, true, "losses"},
                      {workspace, workspace_bytes, true, "workspace"}});
    RouterForwardCall call;
    call.T = num_tokens;
    call.logits = logits;
    call.ids = ids;
    call.g = g;
    call.expert_counts = expert_counts;
    call.losses = losses;
    execute(c, Pass::RouterForward, call, workspace, workspace_bytes, stream,
            "moeblaze_layer_workspace_size(MOEBLAZE_PASS_ROUTER_FORWARD)",
            &Backend::router_forward);
  });
}

moeblaze_status_t moeblaze_router_backward(moeblaze_layer_t layer, int64_t num_tokens,
                                           const void* logits, const int32_t* ids, const void* dg,
                                           const void* d_losses, void* d_logits, void* workspace,
                                           size_t workspace_bytes, void* stream) {
  return guarded(__func__, [&] {
    const PlainCall c = plain_call(layer, num_tokens);
    const size_t relem = c.desc().relem_size();
    require_tensor(c.backend, logits, true, c.empty, relem, "logits");
    require_tensor(c.backend, ids, true, c.empty, sizeof(int32_t), "ids");
    require_tensor(c.backend, dg, true, c.empty, relem, "dg");
    require_tensor(c.backend, d_losses, false, false, relem, "d_losses");
    require_tensor(c.backend, d_logits, true, c.empty, relem, "d_logits");
    const size_t T = size_t(num_tokens), E = size_t(c.desc().E), k = size_t(c.desc().k);
    require_disjoint({{logits, T * E * relem, false, "logits"},
                      {ids, T * k * sizeof(int32_t), false, "ids"},
                      {dg, T * k * relem, false, "dg"},
                      {d_losses, 2 * relem, false, "d_losses"},
                      {d_logits, T * E * relem, true, "d_logits"},
                      {workspace, workspace_bytes, true, "workspace"}});
    RouterBackwardCall call;
    call.T = num_tokens;
    call.logits = logits;
    call.ids = ids;
    call.dg = dg;
    call.d_losses = d_losses;
    call.d_logits = d_logits;
    execute(c, Pass::RouterBackward, call, workspace, workspace_bytes, stream,
            "moeblaze_layer_workspace_size(MOEBLAZE_PASS_ROUTER_BACKWARD)",
            &Backend::router_backward);
  });
}

moeblaze_status_t moeblaze_routing_build(moeblaze_layer_t layer, int64_t num_tokens,
                                         const int32_t* ids, int32_t* expert_offsets,
                                         int32_t* expert_token_indices, int32_t* token_index_map,
                                         void* workspace, size_t workspace_bytes, void* stream) {
  return guarded(__func__, [&] {
    const PlainCall c = plain_call(layer, num_tokens);
    const size_t i32 = sizeof(int32_t);
    require_tensor(c.backend, ids, true, c.empty, i32, "ids");
    require_tensor(c.backend, expert_offsets, true, false, i32, "expert_offsets");
    require_tensor(c.backend, expert_token_indices, true, c.empty, i32, "expert_token_indices");
    require_tensor(c.backend, token_index_map, true, c.empty, i32, "token_index_map");
    const size_t N = size_t(num_tokens) * size_t(c.desc().k), E = size_t(c.desc().E);
    require_disjoint({{ids, N * i32, false, "ids"},
                      {expert_offsets, (E + 1) * i32, true, "expert_offsets"},
                      {expert_token_indices, N * i32, true, "expert_token_indices"},
                      {token_index_map, N * i32, true, "token_index_map"},
                      {workspace, workspace_bytes, true, "workspace"}});
    RoutingBuildCall call;
    call.T = num_tokens;
    call.ids = ids;
    call.expert_offsets = expert_offsets;
    call.expert_token_indices = expert_token_indices;
    call.token_index_map = token_index_map;
    execute(c, Pass::RoutingBuild, call, workspace, workspace_bytes, stream,
            "moeblaze_layer_workspace_size(MOEBLAZE_PASS_ROUTING_BUILD)", &Backend::routing_build);
  });
}

// ---- experts and whole layer
// ----------------------------------------------------------------------

moeblaze_status_t moeblaze_forward_args_init(moeblaze_forward_args_t* args, size_t struct_size) {
  return guarded(__func__, [&] {
    init_versioned(args, struct_size, zeroed<moeblaze_forward_args_t>(), kForwardArgsV0Size,
                   "args");
  });
}

moeblaze_status_t moeblaze_backward_args_init(moeblaze_backward_args_t* args, size_t struct_size) {
  return guarded(__func__, [&] {
    init_versioned(args, struct_size, zeroed<moeblaze_backward_args_t>(), kBackwardArgsV0Size,
                   "args");
  });
}

moeblaze_status_t moeblaze_experts_forward(moeblaze_layer_t layer,
                                           const moeblaze_forward_args_t* args, void* stream) {
  return guarded(__func__, [&] {
    run_pass(layer, args, kForwardArgsV0Size, Pass::ExpertsForward, stream, run_forward);
  });
}

moeblaze_status_t moeblaze_layer_forward(moeblaze_layer_t layer,
                                         const moeblaze_forward_args_t* args, void* stream) {
  return guarded(__func__, [&] {
    run_pass(layer, args, kForwardArgsV0Size, Pass::LayerForward, stream, run_forward);
  });
}

moeblaze_status_t moeblaze_experts_backward(moeblaze_layer_t layer,
                                            const moeblaze_backward_args_t* args, void* stream) {
  return guarded(__func__, [&] {
    run_pass(layer, args, kBackwardArgsV0Size, Pass::ExpertsBackward, stream, run_backward);
  });
}

moeblaze_status_t moeblaze_layer_backward(moeblaze_layer_t layer,
                                          const moeblaze_backward_args_t* args, void* stream) {
  return guarded(__func__, [&] {
    run_pass(layer, args, kBackwardArgsV0Size, Pass::LayerBackward, stream, run_backward);
  });
}

}  // extern "C"
