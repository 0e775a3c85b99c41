// What the CUDA test suites (tests/cuda, tests/ep) share: whether a GPU is there, the visible skip
// when it is not, and a REQUIRE for CUDA runtime calls. A suite built without the CUDA toolkit
// (MOEBLAZE_TESTS_WITH_CUDA undefined) compiles its cases to the skip alone.
#pragma once

#include "support/test_support.hpp"

#if defined(MOEBLAZE_TESTS_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace mbtest {

inline bool have_gpu() {
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
  return moeblaze_backend_available(MOEBLAZE_BACKEND_CUDA) == 1;
#else
  return false;
#endif
}

}  // namespace mbtest

// Returns from the test case with a visible message when there is no usable GPU (the suite's
// main then exits 77, which CTest reports as Skipped).
#define SKIP_WITHOUT_GPU()                                                \
  do {                                                                    \
    if (!::mbtest::have_gpu()) {                                          \
      MESSAGE("SKIPPED: no CUDA GPU (or the CUDA backend is not built)"); \
      return;                                                             \
    }                                                                     \
  } while (0)

#if defined(MOEBLAZE_TESTS_WITH_CUDA)
// REQUIREs that a CUDA runtime call succeeds, printing the runtime's error string.
#define CUDA_OK(call)                                                                             \
  do {                                                                                            \
    const cudaError_t cuda_ok_err_ = (call);                                                      \
    REQUIRE_MESSAGE(cuda_ok_err_ == cudaSuccess, #call ": " << cudaGetErrorString(cuda_ok_err_)); \
  } while (0)
#endif
