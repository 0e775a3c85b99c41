// Compiled instead of src/cuda/ when the build has no CUDA compiler: the CUDA backend reports
// itself unavailable with a reason instead of existing as a stub.
#include "common/backend.hpp"
#include "common/status.hpp"

namespace moeblaze {

std::unique_ptr<Backend> make_cuda_backend(int32_t device) {
  (void)device;
  fail(MOEBLAZE_ERR_NOT_SUPPORTED,
       "the CUDA backend is not compiled into this build of libmoeblaze (configure with nvcc on "
       "PATH, or -DMOEBLAZE_CUDA=ON)");
}

bool cuda_backend_available() {
  return false;
}

const char* cuda_build_info() {
  return "CUDA backend not built";
}

bool cuda_pointer_is_device_memory(const void* ptr) {
  (void)ptr;
  return false;
}

}  // namespace moeblaze
