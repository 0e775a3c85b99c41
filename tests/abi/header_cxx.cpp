// The public header must compile as C++11 and C++17 with every warning an error, be idempotent, and
// give C linkage to every function (checked by taking their addresses as extern "C" types).
#include "moeblaze.h"

#include <cstddef>
#include <type_traits>

static_assert(std::is_standard_layout<moeblaze_layer_config_t>::value, "config must be POD-like");
static_assert(std::is_standard_layout<moeblaze_forward_args_t>::value, "args must be POD-like");
static_assert(std::is_standard_layout<moeblaze_backward_args_t>::value, "args must be POD-like");
static_assert(std::is_trivially_copyable<moeblaze_layer_config_t>::value, "config must be trivial");
static_assert(offsetof(moeblaze_layer_config_t, struct_size) == 0, "struct_size comes first");
static_assert(offsetof(moeblaze_forward_args_t, struct_size) == 0, "struct_size comes first");
static_assert(offsetof(moeblaze_backward_args_t, struct_size) == 0, "struct_size comes first");
static_assert(sizeof(moeblaze_status_t) == 4, "status is int32_t");

int moeblaze_abi_header_cxx_probe();
int moeblaze_abi_header_cxx_probe() {
  moeblaze_status_t (*destroy)(moeblaze_layer_t) = &moeblaze_layer_destroy;
  const char* (*name)(moeblaze_status_t) = &moeblaze_status_name;
  return (destroy != nullptr) + (name != nullptr) + MOEBLAZE_VERSION;
}
