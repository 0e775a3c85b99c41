// The handle registry: what the opaque C handles (moeblaze_context_t, moeblaze_layer_t,
// moeblaze_ep_layer_t, moeblaze_ep_group_t) stand for.
//
// A handle is never an address. It is a fresh 64-bit id that the registry maps to the object it
// names, and an id is never issued twice. So a destroyed handle stays invalid forever, even when
// the allocator hands the destroyed object's memory to the next create (which an address-keyed
// registry would mistake for the old handle), and a foreign pointer or a handle of the wrong kind
// is rejected without being dereferenced. A lookup returns shared ownership of the object, so a
// call that is running keeps its object alive even if another thread destroys the handle meanwhile.
#pragma once

#include <cstdint>
#include <memory>

namespace moeblaze {

enum class HandleKind : int32_t {
  Context = 1,  // moeblaze_context_t -> ContextState (common/context.hpp)
  Layer = 2,    // moeblaze_layer_t -> api::LayerState
  EpLayer = 3,  // moeblaze_ep_layer_t -> ep::EpLayer
  EpGroup = 4,  // moeblaze_ep_group_t -> ep::LocalGroupState
};

const char* handle_kind_name(HandleKind kind);  // "moeblaze_layer_t"

// Registers `object` and returns its new handle (never NULL, never a valid address).
void* register_handle(std::shared_ptr<void> object, HandleKind kind);

// The live object of `handle`. Throws Error(INVALID_HANDLE), naming `argument`, when `handle` is
// NULL, destroyed, not a handle of this library, or of another kind.
std::shared_ptr<void> find_handle(const void* handle, HandleKind kind, const char* argument);

// Unregisters `handle` (checked as by find_handle) and returns its object, so that the caller
// drops the last reference outside the registry's lock.
std::shared_ptr<void> unregister_handle(const void* handle, HandleKind kind, const char* argument);

template <typename Object>
std::shared_ptr<Object> acquire(const void* handle, HandleKind kind, const char* argument) {
  return std::static_pointer_cast<Object>(find_handle(handle, kind, argument));
}

}  // namespace moeblaze
