// The exception barrier every extern "C" entry point runs its body through: success clears the
// calling thread's last error; moeblaze::Error, std::bad_alloc and anything else become a status
// and a message. No exception ever crosses the C ABI.
#pragma once

#include <string>

#include "common/status.hpp"

namespace moeblaze {
namespace api {

void set_last_error(const char* function, moeblaze_status_t status, const std::string& message);
void clear_last_error();

template <typename Body>
moeblaze_status_t guarded(const char* function, Body&& body) noexcept {
  try {
    body();
    clear_last_error();
    return MOEBLAZE_OK;
  } catch (const Error& e) {
    set_last_error(function, e.status(), e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    set_last_error(function, MOEBLAZE_ERR_OUT_OF_MEMORY, "a host allocation failed");
    return MOEBLAZE_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(function, MOEBLAZE_ERR_INTERNAL, std::string("internal error: ") + e.what());
    return MOEBLAZE_ERR_INTERNAL;
  } catch (...) {
    set_last_error(function, MOEBLAZE_ERR_INTERNAL, "internal error: unknown exception");
    return MOEBLAZE_ERR_INTERNAL;
  }
}

}  // namespace api
}  // namespace moeblaze
