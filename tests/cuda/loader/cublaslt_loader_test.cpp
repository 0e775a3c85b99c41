// The run-time cuBLASLt loader (src/cuda/cublaslt_api.cpp, compiled into this program on its own):
// it finds the library of the CUDA toolkit the build used and resolves every function, and an
// explicit MOEBLAZE_CUBLASLT_LIBRARY that cannot be loaded is an error naming it, never a silent
// fallback. No GPU needed: loading cuBLASLt does not touch a device. Each case is its own process
// (the search runs once per process): CTest runs it twice, with and without the override.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/status.hpp"
#include "cuda/cublaslt_api.hpp"

int main() {
  const char* override_path = std::getenv("MOEBLAZE_CUBLASLT_LIBRARY");
  const bool expect_failure = override_path != nullptr && std::strstr(override_path, "nonexistent");
  try {
    const moeblaze::cuda::CublasLtApi& api = moeblaze::cuda::cublaslt_api();
    if (expect_failure) {
      std::printf("FAIL: loaded %s although MOEBLAZE_CUBLASLT_LIBRARY=%s\n", api.source.c_str(),
                  override_path);
      return 1;
    }
    if (!moeblaze::cuda::cublaslt_available() || api.create == nullptr || api.matmul == nullptr) {
      std::printf("FAIL: incomplete cuBLASLt functions from %s\n", api.source.c_str());
      return 1;
    }
    std::printf("cuBLASLt loaded from %s\n", api.source.c_str());
    return 0;
  } catch (const moeblaze::Error& error) {
    if (expect_failure && error.status() == MOEBLAZE_ERR_NOT_SUPPORTED &&
        std::strstr(error.what(), "libcublasLt") != nullptr &&
        std::strstr(error.what(), override_path) != nullptr &&
        !moeblaze::cuda::cublaslt_available()) {
      std::printf("refused as expected: %s\n", error.what());
      return 0;
    }
    std::printf("FAIL: %s\n", error.what());
    return 1;
  }
}
