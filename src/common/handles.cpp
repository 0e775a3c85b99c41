#include "common/handles.hpp"

#include <mutex>
#include <unordered_map>

#include "common/status.hpp"

namespace moeblaze {

namespace {

// A handle's value: a tag in the top 16 bits, where no user-space pointer of x86-64 or AArch64 has
// them, and the id below. Ids start at 1 and only grow. Where pointers are 32 bits wide the value
// is the odd number 2*id + 1 (no object pointer of this library is odd).
constexpr bool kWidePointers = sizeof(uintptr_t) >= 8;
constexpr uint64_t kTag = uint64_t(0x4D42) << 48;  // "MB"
constexpr uint64_t kIdMask = (uint64_t(1) << 48) - 1;
constexpr uint64_t kMaxId = kWidePointers ? kIdMask : uint64_t(INT32_MAX);

struct Entry {
  HandleKind kind;
  std::shared_ptr<void> object;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<uint64_t, Entry> live;
  uint64_t next_id = 1;
};

Registry& registry() {
  static auto* instance = new Registry();  // never destroyed: handles stay checkable at exit
  return *instance;
}

void* encode(uint64_t id) {
  const uint64_t value = kWidePointers ? (kTag | id) : (id << 1 | 1);
  return reinterpret_cast<void*>(static_cast<uintptr_t>(value));
}

// The id a handle value encodes, or 0 when it cannot be one of ours.
uint64_t decode(const void* handle) {
  const uint64_t value = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(handle));
  if (kWidePointers) return (value & ~kIdMask) == kTag ? (value & kIdMask) : 0;
  return (value & 1) ? (value >> 1) : 0;
}

// Registry lock held. Throws unless `handle` is live and of `kind`.
std::unordered_map<uint64_t, Entry>::iterator find_locked(Registry& r, const void* handle,
                                                          HandleKind kind, const char* argument) {
  const uint64_t id = decode(handle);
  MB_REQUIRE(id != 0, MOEBLAZE_ERR_INVALID_HANDLE,
             "%s (%p) is not a live moeblaze handle: not a %s this library created", argument,
             handle, handle_kind_name(kind));
  auto it = r.live.find(id);
  MB_REQUIRE(it != r.live.end(), MOEBLAZE_ERR_INVALID_HANDLE,
             "%s (%p) is not a live moeblaze handle: %s", argument, handle,
             id < r.next_id ? "it was destroyed" : "never created");
  MB_REQUIRE(it->second.kind == kind, MOEBLAZE_ERR_INVALID_HANDLE, "%s is a %s, not a %s", argument,
             handle_kind_name(it->second.kind), handle_kind_name(kind));
  return it;
}

}  // namespace

const char* handle_kind_name(HandleKind kind) {
  switch (kind) {
    case HandleKind::Context: return "moeblaze_context_t";
    case HandleKind::Layer: return "moeblaze_layer_t";
    case HandleKind::EpLayer: return "moeblaze_ep_layer_t";
    case HandleKind::EpGroup: return "moeblaze_ep_group_t";
  }
  return "moeblaze handle";
}

void* register_handle(std::shared_ptr<void> object, HandleKind kind) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  MB_REQUIRE(r.next_id <= kMaxId, MOEBLAZE_ERR_OUT_OF_MEMORY,
             "every handle id has been issued (%llu); ids are never reused",
             (unsigned long long)kMaxId);
  const uint64_t id = r.next_id;
  r.live.emplace(id, Entry{kind, std::move(object)});
  ++r.next_id;  // only after the insertion succeeded
  return encode(id);
}

std::shared_ptr<void> find_handle(const void* handle, HandleKind kind, const char* argument) {
  MB_REQUIRE(handle != nullptr, MOEBLAZE_ERR_INVALID_HANDLE, "%s is NULL", argument);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return find_locked(r, handle, kind, argument)->second.object;
}

std::shared_ptr<void> unregister_handle(const void* handle, HandleKind kind, const char* argument) {
  MB_REQUIRE(handle != nullptr, MOEBLAZE_ERR_INVALID_HANDLE, "%s is NULL", argument);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = find_locked(r, handle, kind, argument);
  std::shared_ptr<void> object = std::move(it->second.object);
  r.live.erase(it);
  return object;
}

}  // namespace moeblaze
