// Argument checks shared by the C API (src/api) and expert parallelism (src/ep). Each throws
// moeblaze::Error with a message that names the argument as the caller wrote it ("args->x", "ids").
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "common/backend.hpp"
#include "common/status.hpp"

namespace moeblaze {

// Maximum routed rows: indices are int32.
constexpr int64_t kMaxRoutedRows = int64_t(INT32_MAX);

inline void require_num_tokens(const LayerDesc& desc, int64_t T, const char* argument) {
  MB_REQUIRE_ARG(T >= 0, "%s = %lld must be >= 0", argument, (long long)T);
  MB_REQUIRE_ARG(T <= kMaxRoutedRows / desc.k,
                 "%s = %lld is too large: num_tokens * top_k (%lld) must be < 2^31", argument,
                 (long long)T, (long long)desc.k);
}

// A tensor argument: non-NULL when required (tensors with no elements may be NULL), aligned to its
// element size, and in memory the backend can use.
inline void require_tensor(const Backend& backend, const void* ptr, bool required, bool empty,
                           size_t element_size, const char* argument) {
  if (ptr == nullptr) {
    MB_REQUIRE_ARG(!required || empty, "%s is NULL", argument);
    return;
  }
  MB_REQUIRE_ARG(reinterpret_cast<uintptr_t>(ptr) % element_size == 0,
                 "%s (%p) is not aligned to its element size (%zu bytes)", argument, ptr,
                 element_size);
  MB_REQUIRE_ARG(backend.pointer_usable(ptr),
                 "%s (%p) is not memory the context's device can use (a host pointer given to "
                 "the CUDA backend, a GPU pointer given to the CPU backend, or memory of another "
                 "GPU)",
                 argument, ptr);
}

// The MOEBLAZE_BACKWARD_* flags of a backward call (the layer's and the expert-parallel one's).
inline void require_backward_flags(uint32_t flags, const char* argument) {
  constexpr uint32_t known = MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD | MOEBLAZE_BACKWARD_CONSUME_SAVED;
  MB_REQUIRE_ARG((flags & ~known) == 0,
                 "%s = %u has unknown bits (only MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD = 1 and "
                 "MOEBLAZE_BACKWARD_CONSUME_SAVED = 2)",
                 argument, flags);
}

// The flags of moeblaze_layer_workspace_size_with_flags(): the backward flags and the forward's
// MOEBLAZE_FORWARD_WITH_SAVED (each applies to its own passes and is ignored by the others).
inline void require_workspace_flags(uint32_t flags, const char* argument) {
  constexpr uint32_t known = MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD | MOEBLAZE_BACKWARD_CONSUME_SAVED |
                             MOEBLAZE_FORWARD_WITH_SAVED;
  MB_REQUIRE_ARG((flags & ~known) == 0,
                 "%s = %u has unknown bits (only MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD = 1, "
                 "MOEBLAZE_BACKWARD_CONSUME_SAVED = 2 and MOEBLAZE_FORWARD_WITH_SAVED = 4)",
                 argument, flags);
}

// A caller-owned scratch or saved buffer of at least `needed` bytes.
inline void require_buffer(const Backend& backend, const void* ptr, size_t bytes, size_t needed,
                           const char* argument, const char* bytes_argument, const char* query) {
  MB_REQUIRE(bytes >= needed, MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
             "%s = %zu bytes, but this call needs %zu (ask %s)", bytes_argument, bytes, needed,
             query);
  if (needed == 0) return;
  MB_REQUIRE_ARG(ptr != nullptr, "%s is NULL but %zu bytes are needed", argument, needed);
  MB_REQUIRE_ARG(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, "%s (%p) must be 16-byte aligned",
                 argument, ptr);
  MB_REQUIRE_ARG(backend.pointer_usable(ptr), "%s (%p) is not memory the context's device can use",
                 argument, ptr);
}

// One argument's bytes for require_disjoint: [ptr, ptr + bytes), and whether the call writes them.
struct ArgBytes {
  const void* ptr;  // NULL: absent (skipped)
  size_t bytes;
  bool written;  // an output, the workspace, a saved buffer being filled or consumed
  const char* argument;
};

// No byte a call writes may belong to another of its arguments. The execute calls read inputs
// after they have begun writing (the router's backward reads x after dx is written; the experts
// follow the routing index in `saved` after the workspace's scratch is written), so a shared byte
// gives wrong results or sends a checked index out of bounds. Arguments only read may share.
inline void require_disjoint(std::initializer_list<ArgBytes> args) {
  for (auto i = args.begin(); i != args.end(); ++i) {
    if (i->ptr == nullptr || i->bytes == 0) continue;
    const uintptr_t i_begin = reinterpret_cast<uintptr_t>(i->ptr), i_end = i_begin + i->bytes;
    for (auto j = args.begin(); j != i; ++j) {
      if (j->ptr == nullptr || j->bytes == 0 || !(i->written || j->written)) continue;
      const uintptr_t j_begin = reinterpret_cast<uintptr_t>(j->ptr), j_end = j_begin + j->bytes;
      MB_REQUIRE_ARG(i_end <= j_begin || j_end <= i_begin,
                     "%s (%p, %zu bytes) and %s (%p, %zu bytes) overlap: memory the call writes "
                     "must not be shared with another argument",
                     j->argument, j->ptr, j->bytes, i->argument, i->ptr, i->bytes);
    }
  }
}

}  // namespace moeblaze
