// Internal error handling: core code throws moeblaze::Error; the extern "C" barrier in src/api
// turns it into a status code and the thread-local message. Nothing here may escape the C ABI.
#pragma once

#include <cstdarg>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "moeblaze.h"

namespace moeblaze {

class Error : public std::runtime_error {
 public:
  Error(moeblaze_status_t status, std::string message)
      : std::runtime_error(std::move(message)), status_(status) {}
  moeblaze_status_t status() const noexcept { return status_; }

 private:
  moeblaze_status_t status_;
};

// printf-style formatting into a std::string (messages only; never on a hot path).
std::string format(const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

[[noreturn]] void fail(moeblaze_status_t status, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

}  // namespace moeblaze

// Throws moeblaze::Error(status, message) unless cond holds. The message should name the argument.
#define MB_REQUIRE(cond, status, ...)          \
  do {                                         \
    if (!(cond)) {                             \
      ::moeblaze::fail((status), __VA_ARGS__); \
    }                                          \
  } while (0)

#define MB_REQUIRE_ARG(cond, ...) MB_REQUIRE(cond, MOEBLAZE_ERR_INVALID_ARGUMENT, __VA_ARGS__)
