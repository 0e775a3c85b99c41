// Handles: what moeblaze_context_t and moeblaze_layer_t point to, and a registry of live handles so
// that a destroyed, foreign or wrong-kind handle is reported as MOEBLAZE_ERR_INVALID_HANDLE instead
// of being dereferenced.
#pragma once

#include <memory>
#include <mutex>

#include "common/backend.hpp"
#include "common/layer_desc.hpp"

namespace moeblaze {
namespace api {

// Shared by a context handle and every layer created on it, so destroy order does not matter.
struct ContextState {
  std::unique_ptr<Backend> backend;
  int32_t backend_kind = 0;
  int32_t device = 0;
  // Execute calls on one context are serialised: the CPU backend's worker pool is per context, and
  // for CUDA the critical section only enqueues work.
  std::mutex execute_mutex;
};

}  // namespace api
}  // namespace moeblaze

struct moeblaze_context_s {
  std::shared_ptr<moeblaze::api::ContextState> state;
};

struct moeblaze_layer_s {
  std::shared_ptr<moeblaze::api::ContextState> context;
  moeblaze::LayerDesc desc;
  moeblaze_layer_config_t config;  // the validated config, struct_size = sizeof in this build
};

namespace moeblaze {
namespace api {

void register_handle(const void* handle, int kind);
void unregister_handle(const void* handle);
// Throws Error(INVALID_HANDLE) naming `argument` unless `handle` is a live handle of `kind`.
void require_handle(const void* handle, int kind, const char* argument);

constexpr int kContextHandle = 1;
constexpr int kLayerHandle = 2;
constexpr int kEpLayerHandle = 3;  // moeblaze_ep_layer_t (src/ep/ep_layer.hpp)
constexpr int kEpGroupHandle = 4;  // moeblaze_ep_group_t

}  // namespace api
}  // namespace moeblaze
