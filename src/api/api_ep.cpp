// The extern "C" entry points of expert parallelism (the "Expert parallelism" section of
// moeblaze.h): validate, then dispatch to the rank's ep::EpLayer. Every body runs inside
// api::guarded(), the exception barrier.
#include <memory>

#include "api/barrier.hpp"
#include "api/versioned_struct.hpp"
#include "common/checks.hpp"
#include "common/handles.hpp"
#include "ep/ep_layer.hpp"

using namespace moeblaze;
using namespace moeblaze::api;

namespace {

moeblaze_ep_config_t default_ep_config() {
  moeblaze_ep_config_t c = zeroed<moeblaze_ep_config_t>();
  c.transport = MOEBLAZE_EP_TRANSPORT_NCCL;
  c.rank = 0;
  c.world_size = 1;
  return c;
}

// First published sizes (v0.1 of the EP section).
constexpr size_t kEpConfigV0Size = sizeof(moeblaze_ep_config_t);
constexpr size_t kEpForwardArgsV0Size = sizeof(moeblaze_ep_forward_args_t);
constexpr size_t kEpBackwardArgsV0Size = sizeof(moeblaze_ep_backward_args_t);

// The layer config's defaults as moeblaze_layer_config_init() sets them (for older callers).
moeblaze_layer_config_t default_layer_config() {
  moeblaze_layer_config_t c;
  moeblaze_layer_config_init(&c, sizeof(c));
  return c;
}

std::shared_ptr<ep::EpLayer> ep_layer_of(moeblaze_ep_layer_t layer) {
  return acquire<ep::EpLayer>(layer, HandleKind::EpLayer, "layer");
}

}  // namespace

extern "C" {

moeblaze_status_t moeblaze_ep_local_group_create(moeblaze_ep_group_t* out, int32_t world_size) {
  if (out != nullptr) *out = nullptr;
  return guarded(__func__, [&] {
    MB_REQUIRE_ARG(out != nullptr, "out is NULL");
    MB_REQUIRE_ARG(world_size >= 1 && world_size <= MOEBLAZE_MAX_EXPERTS,
                   "world_size = %d must be in [1, %d]", int(world_size), MOEBLAZE_MAX_EXPERTS);
    *out = static_cast<moeblaze_ep_group_t>(
        register_handle(std::make_shared<ep::LocalGroupState>(world_size), HandleKind::EpGroup));
  });
}

moeblaze_status_t moeblaze_ep_local_group_destroy(moeblaze_ep_group_t group) {
  return guarded(__func__, [&] {
    if (group == nullptr) return;
    unregister_handle(group, HandleKind::EpGroup, "group");
  });
}

moeblaze_status_t moeblaze_ep_config_init(moeblaze_ep_config_t* config, size_t struct_size) {
  return guarded(__func__, [&] {
    init_versioned(config, struct_size, default_ep_config(), kEpConfigV0Size, "config");
  });
}

moeblaze_status_t moeblaze_ep_layer_create(moeblaze_ep_layer_t* out, moeblaze_context_t context,
                                           const moeblaze_layer_config_t* config,
                                           const moeblaze_ep_config_t* ep_config) {
  if (out != nullptr) *out = nullptr;
  return guarded(__func__, [&] {
    MB_REQUIRE_ARG(out != nullptr, "out is NULL");
    auto state = acquire<ContextState>(context, HandleKind::Context, "context");
    const moeblaze_layer_config_t cfg =
        read_versioned(config, default_layer_config(), sizeof(moeblaze_layer_config_t), "config");
    const LayerDesc desc = make_layer_desc(cfg);
    const moeblaze_ep_config_t ep =
        read_versioned(ep_config, default_ep_config(), kEpConfigV0Size, "ep_config");
    MB_REQUIRE(
        ep.transport == MOEBLAZE_EP_TRANSPORT_NCCL || ep.transport == MOEBLAZE_EP_TRANSPORT_LOCAL,
        MOEBLAZE_ERR_NOT_SUPPORTED,
        "ep_config->transport = %d is not a moeblaze_ep_transport_code (NCCL 1, LOCAL 2)",
        int(ep.transport));
    MB_REQUIRE_ARG(ep.world_size >= 1 && ep.world_size <= desc.E,
                   "ep_config->world_size = %d must be in [1, num_experts = %lld]: every rank "
                   "owns at least one expert",
                   int(ep.world_size), (long long)desc.E);
    MB_REQUIRE_ARG(ep.rank >= 0 && ep.rank < ep.world_size,
                   "ep_config->rank = %d must be in [0, world_size = %d)", int(ep.rank),
                   int(ep.world_size));
    MB_REQUIRE_ARG(ep.communicator != nullptr,
                   "ep_config->communicator is NULL (an ncclComm_t for NCCL, a "
                   "moeblaze_ep_group_t for LOCAL)");
    const int32_t backend_kind = state->backend_kind;
    std::shared_ptr<ep::LocalGroupState> group;
    if (ep.transport == MOEBLAZE_EP_TRANSPORT_LOCAL) {
      group = acquire<ep::LocalGroupState>(ep.communicator, HandleKind::EpGroup,
                                           "ep_config->communicator");
      MB_REQUIRE_ARG(group->world_size() == ep.world_size,
                     "ep_config->world_size = %d, but the LOCAL group has %d ranks",
                     int(ep.world_size), int(group->world_size()));
      group->check_backend(backend_kind, ep.rank);
    } else {
      MB_REQUIRE(backend_kind == MOEBLAZE_BACKEND_CUDA, MOEBLAZE_ERR_NOT_SUPPORTED,
                 "ep_config->transport = MOEBLAZE_EP_TRANSPORT_NCCL needs a CUDA context (this "
                 "context is on backend %d); use MOEBLAZE_EP_TRANSPORT_LOCAL on the CPU",
                 int(backend_kind));
    }
    auto plan = std::make_shared<ep::EpLayer>(std::move(state), desc, ep.transport, ep.rank,
                                              ep.world_size, ep.communicator, std::move(group));
    *out = static_cast<moeblaze_ep_layer_t>(register_handle(std::move(plan), HandleKind::EpLayer));
  });
}

moeblaze_status_t moeblaze_ep_layer_destroy(moeblaze_ep_layer_t layer) {
  return guarded(__func__, [&] {
    if (layer == nullptr) return;
    unregister_handle(layer, HandleKind::EpLayer, "layer");
  });
}

moeblaze_status_t moeblaze_ep_layer_get_experts(moeblaze_ep_layer_t layer, int64_t* begin,
                                                int64_t* end) {
  return guarded(__func__, [&] {
    const auto plan = ep_layer_of(layer);
    if (begin) *begin = plan->expert_begin();
    if (end) *end = plan->expert_end();
  });
}

moeblaze_status_t moeblaze_ep_layer_exchange_size(moeblaze_ep_layer_t layer, size_t* bytes) {
  if (bytes != nullptr) *bytes = 0;
  return guarded(__func__, [&] {
    const auto plan = ep_layer_of(layer);
    MB_REQUIRE_ARG(bytes != nullptr, "bytes is NULL");
    *bytes = plan->exchange_size();
  });
}

namespace {

// Both public workspace queries. `flags` matter for the backward only (the forward passes ignore
// them, as moeblaze_layer_workspace_size_with_flags() does).
void query_ep_workspace_size(moeblaze_ep_layer_t layer, int32_t pass, int64_t num_tokens,
                             int64_t recv_rows, uint32_t flags, size_t* bytes) {
  const auto plan = ep_layer_of(layer);
  MB_REQUIRE_ARG(bytes != nullptr, "bytes is NULL");
  MB_REQUIRE_ARG(pass >= MOEBLAZE_EP_PASS_FORWARD_BEGIN && pass <= MOEBLAZE_EP_PASS_BACKWARD,
                 "pass = %d is not a moeblaze_ep_pass_code (0..2)", int(pass));
  require_backward_flags(flags, "flags");
  require_num_tokens(plan->global_desc(), num_tokens, "num_tokens");
  if (pass == MOEBLAZE_EP_PASS_FORWARD_BEGIN) recv_rows = 0;
  plan->require_recv_rows(recv_rows, "recv_rows");
  const uint32_t backward_flags = pass == MOEBLAZE_EP_PASS_BACKWARD ? flags : 0u;
  *bytes =
      plan->workspace_size(static_cast<ep::EpPass>(pass), num_tokens, recv_rows, backward_flags);
}

}  // namespace

moeblaze_status_t moeblaze_ep_layer_workspace_size(moeblaze_ep_layer_t layer, int32_t pass,
                                                   int64_t num_tokens, int64_t recv_rows,
                                                   size_t* bytes) {
  if (bytes != nullptr) *bytes = 0;
  return guarded(__func__,
                 [&] { query_ep_workspace_size(layer, pass, num_tokens, recv_rows, 0u, bytes); });
}

moeblaze_status_t moeblaze_ep_layer_workspace_size_with_flags(moeblaze_ep_layer_t layer,
                                                              int32_t pass, int64_t num_tokens,
                                                              int64_t recv_rows, uint32_t flags,
                                                              size_t* bytes) {
  if (bytes != nullptr) *bytes = 0;
  return guarded(
      __func__, [&] { query_ep_workspace_size(layer, pass, num_tokens, recv_rows, flags, bytes); });
}

moeblaze_status_t moeblaze_ep_layer_saved_size(moeblaze_ep_layer_t layer, int32_t part,
                                               int64_t num_tokens, int64_t recv_rows,
                                               size_t* bytes) {
  if (bytes != nullptr) *bytes = 0;
  return guarded(__func__, [&] {
    const auto plan = ep_layer_of(layer);
    MB_REQUIRE_ARG(bytes != nullptr, "bytes is NULL");
    MB_REQUIRE_ARG(part == MOEBLAZE_EP_SAVED_HOME || part == MOEBLAZE_EP_SAVED_EXPERT,
                   "part = %d is not a moeblaze_ep_saved_code (HOME 0, EXPERT 1)", int(part));
    require_num_tokens(plan->global_desc(), num_tokens, "num_tokens");
    plan->require_recv_rows(recv_rows, "recv_rows");
    *bytes = plan->saved_size(static_cast<ep::EpSaved>(part), num_tokens, recv_rows);
  });
}

moeblaze_status_t moeblaze_ep_forward_args_init(moeblaze_ep_forward_args_t* args,
                                                size_t struct_size) {
  return guarded(__func__, [&] {
    init_versioned(args, struct_size, zeroed<moeblaze_ep_forward_args_t>(), kEpForwardArgsV0Size,
                   "args");
  });
}

moeblaze_status_t moeblaze_ep_backward_args_init(moeblaze_ep_backward_args_t* args,
                                                 size_t struct_size) {
  return guarded(__func__, [&] {
    init_versioned(args, struct_size, zeroed<moeblaze_ep_backward_args_t>(), kEpBackwardArgsV0Size,
                   "args");
  });
}

moeblaze_status_t moeblaze_ep_forward_begin(moeblaze_ep_layer_t layer,
                                            const moeblaze_ep_forward_args_t* args, void* exchange,
                                            size_t exchange_bytes, int64_t* recv_rows,
                                            void* stream) {
  if (recv_rows != nullptr) *recv_rows = 0;
  return guarded(__func__, [&] {
    const auto plan = ep_layer_of(layer);
    *recv_rows = plan->run_call([&] {
      const auto a =
          read_versioned(args, zeroed<moeblaze_ep_forward_args_t>(), kEpForwardArgsV0Size, "args");
      MB_REQUIRE_ARG(recv_rows != nullptr, "recv_rows is NULL");
      return plan->forward_begin(a, exchange, exchange_bytes, stream);
    });
  });
}

moeblaze_status_t moeblaze_ep_forward_finish(moeblaze_ep_layer_t layer,
                                             const moeblaze_ep_forward_args_t* args, void* exchange,
                                             size_t exchange_bytes, void* stream) {
  return guarded(__func__, [&] {
    const auto plan = ep_layer_of(layer);
    plan->run_call([&] {
      const auto a =
          read_versioned(args, zeroed<moeblaze_ep_forward_args_t>(), kEpForwardArgsV0Size, "args");
      plan->forward_finish(a, exchange, exchange_bytes, stream);
    });
  });
}

moeblaze_status_t moeblaze_ep_backward(moeblaze_ep_layer_t layer,
                                       const moeblaze_ep_backward_args_t* args,
                                       const void* exchange, size_t exchange_bytes, void* stream) {
  return guarded(__func__, [&] {
    const auto plan = ep_layer_of(layer);
    plan->run_call([&] {
      const auto a = read_versioned(args, zeroed<moeblaze_ep_backward_args_t>(),
                                    kEpBackwardArgsV0Size, "args");
      plan->backward(a, exchange, exchange_bytes, stream);
    });
  });
}

}  // extern "C"
