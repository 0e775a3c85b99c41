#include "handles.hpp"

#include <unordered_map>

#include "common/status.hpp"

namespace moeblaze {
namespace api {

namespace {

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<const void*, int>& registry() {
  static auto* live = new std::unordered_map<const void*, int>();  // never destroyed: safe at exit
  return *live;
}

const char* kind_name(int kind) {
  switch (kind) {
    case kContextHandle: return "moeblaze_context_t";
    case kLayerHandle: return "moeblaze_layer_t";
    case kEpLayerHandle: return "moeblaze_ep_layer_t";
    case kEpGroupHandle: return "moeblaze_ep_group_t";
    default: return "moeblaze handle";
  }
}

}  // namespace

void register_handle(const void* handle, int kind) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[handle] = kind;
}

void unregister_handle(const void* handle) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(handle);
}

void require_handle(const void* handle, int kind, const char* argument) {
  MB_REQUIRE(handle != nullptr, MOEBLAZE_ERR_INVALID_HANDLE, "%s is NULL", argument);
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(handle);
  MB_REQUIRE(it != registry().end(), MOEBLAZE_ERR_INVALID_HANDLE,
             "%s (%p) is not a live moeblaze handle (destroyed, or never created)", argument,
             handle);
  MB_REQUIRE(it->second == kind, MOEBLAZE_ERR_INVALID_HANDLE, "%s is a %s, not a %s", argument,
             kind_name(it->second), kind_name(kind));
}

}  // namespace api
}  // namespace moeblaze
