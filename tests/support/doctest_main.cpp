// The doctest runner shared by every C++ test suite.
//
// A suite whose tests need a GPU sets MOEBLAZE_TEST_NEEDS_CUDA=1 (tests/CMakeLists.txt does this
// for moeblaze_tests_cuda). Without a usable CUDA backend its cases print "SKIPPED: ..." and pass
// vacuously; the runner then exits with 77, which CTest reports as "Skipped" (SKIP_RETURN_CODE), so
// a machine without a GPU shows the suite as skipped rather than passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "moeblaze.h"

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int status = context.run();
  if (context.shouldExit()) return status;
  const char* needs_cuda = std::getenv("MOEBLAZE_TEST_NEEDS_CUDA");
  if (status == 0 && needs_cuda != nullptr && std::strcmp(needs_cuda, "1") == 0 &&
      !moeblaze_backend_available(MOEBLAZE_BACKEND_CUDA)) {
    std::printf("SKIPPED: this suite needs a CUDA GPU and the CUDA backend (%s)\n",
                moeblaze_get_build_info());
    return 77;
  }
  return status;
}
