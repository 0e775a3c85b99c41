// Reading the caller's versioned structs (struct_size first). The rules, as in the header:
//  - struct_size smaller than the first published size: VERSION_MISMATCH;
//  - larger than kMaxStructSize (1 MiB): INVALID_ARGUMENT (an uninitialised struct, not a version:
//    the library reads and writes struct_size bytes of the caller's memory, so it must be bounded);
//  - smaller than ours but published: copy what the caller has, keep defaults for the rest;
//  - larger than ours: accepted only if every byte we do not know is zero, else NOT_SUPPORTED.
#pragma once

#include <cstring>

#include "common/status.hpp"

namespace moeblaze {
namespace api {

constexpr size_t kMaxStructSize = size_t(1) << 20;

// The struct_size rules every versioned struct shares; `argument` names the struct ("config").
inline void require_struct_size(size_t caller_size, size_t first_published_size,
                                const char* argument) {
  MB_REQUIRE(caller_size >= first_published_size, MOEBLAZE_ERR_VERSION_MISMATCH,
             "%s->struct_size = %zu is smaller than any published version (%zu bytes); fill the "
             "struct with its *_init function",
             argument, caller_size, first_published_size);
  MB_REQUIRE_ARG(caller_size <= kMaxStructSize,
                 "%s->struct_size = %zu is implausibly large (more than %zu bytes): fill the "
                 "struct with its *_init function",
                 argument, caller_size, kMaxStructSize);
}

// A struct of this library's version, all zero: the defaults before a struct's own.
template <typename Struct>
Struct zeroed() {
  Struct s;
  std::memset(&s, 0, sizeof(s));
  s.struct_size = static_cast<uint32_t>(sizeof(s));
  return s;
}

template <typename Struct>
Struct read_versioned(const Struct* user, const Struct& defaults, size_t first_published_size,
                      const char* argument) {
  MB_REQUIRE_ARG(user != nullptr, "%s is NULL", argument);
  uint32_t caller_size = 0;
  std::memcpy(&caller_size, user, sizeof(caller_size));
  require_struct_size(caller_size, first_published_size, argument);
  if (caller_size > sizeof(Struct)) {
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(user);
    for (size_t i = sizeof(Struct); i < caller_size; ++i) {
      MB_REQUIRE(bytes[i] == 0, MOEBLAZE_ERR_NOT_SUPPORTED,
                 "%s->struct_size = %u: byte %zu, beyond the %zu bytes this library version "
                 "knows, is set (a field from a newer moeblaze.h that this library cannot honour)",
                 argument, caller_size, i, sizeof(Struct));
    }
  }
  Struct result = defaults;
  std::memcpy(&result, user, caller_size < sizeof(Struct) ? caller_size : sizeof(Struct));
  result.struct_size = static_cast<uint32_t>(sizeof(Struct));
  return result;
}

// *_init(p, size): zero the caller's whole struct, write the defaults we know, record their size.
template <typename Struct>
void init_versioned(Struct* user, size_t caller_size, const Struct& defaults,
                    size_t first_published_size, const char* argument) {
  MB_REQUIRE_ARG(user != nullptr, "%s is NULL", argument);
  MB_REQUIRE(caller_size >= first_published_size, MOEBLAZE_ERR_VERSION_MISMATCH,
             "struct_size = %zu is smaller than any published version of %s (%zu bytes)",
             caller_size, argument, first_published_size);
  MB_REQUIRE_ARG(caller_size <= kMaxStructSize,
                 "struct_size = %zu is implausibly large (more than %zu bytes)", caller_size,
                 kMaxStructSize);
  std::memset(static_cast<void*>(user), 0, caller_size);
  std::memcpy(static_cast<void*>(user), &defaults,
              caller_size < sizeof(Struct) ? caller_size : sizeof(Struct));
  user->struct_size = static_cast<uint32_t>(caller_size);
}

}  // namespace api
}  // namespace moeblaze
