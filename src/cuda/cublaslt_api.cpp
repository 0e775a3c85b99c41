// See cublaslt_api.hpp for why cuBLASLt is loaded at run time and where it is searched.
#include "cuda/cublaslt_api.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "common/status.hpp"

#ifndef MOEBLAZE_CUDA_LIBRARY_DIR
#define MOEBLAZE_CUDA_LIBRARY_DIR ""
#endif

#define MB_CUBLASLT_STRINGIFY2(x) #x
#define MB_CUBLASLT_STRINGIFY(x) MB_CUBLASLT_STRINGIFY2(x)

namespace moeblaze {
namespace cuda {
namespace {

constexpr const char* kSoname = "libcublasLt.so." MB_CUBLASLT_STRINGIFY(CUBLAS_VER_MAJOR);

struct LoadResult {
  bool ok = false;
  CublasLtApi api;
  std::string error;  // what was tried and why it failed, when !ok
};

template <typename Function>
void resolve(void* handle, const char* name, Function& out, std::string& missing) {
  out = reinterpret_cast<Function>(dlsym(handle, name));
  if (out == nullptr) missing += missing.empty() ? name : std::string(", ") + name;
}

std::string last_dl_error() {
  const char* message = dlerror();
  return message ? message : "unknown dlerror";
}

LoadResult resolve_all(void* handle, const std::string& source) {
  LoadResult result;
  CublasLtApi& api = result.api;
  std::string missing;
  resolve(handle, "cublasLtCreate", api.create, missing);
  resolve(handle, "cublasLtDestroy", api.destroy, missing);
  resolve(handle, "cublasLtMatmulDescCreate", api.matmul_desc_create, missing);
  resolve(handle, "cublasLtMatmulDescDestroy", api.matmul_desc_destroy, missing);
  resolve(handle, "cublasLtMatmulDescSetAttribute", api.matmul_desc_set_attribute, missing);
  resolve(handle, "cublasLtMatrixLayoutCreate", api.matrix_layout_create, missing);
  resolve(handle, "cublasLtMatrixLayoutDestroy", api.matrix_layout_destroy, missing);
  resolve(handle, "cublasLtMatmulPreferenceCreate", api.preference_create, missing);
  resolve(handle, "cublasLtMatmulPreferenceDestroy", api.preference_destroy, missing);
  resolve(handle, "cublasLtMatmulPreferenceSetAttribute", api.preference_set_attribute, missing);
  resolve(handle, "cublasLtMatmulAlgoGetHeuristic", api.algo_get_heuristic, missing);
  resolve(handle, "cublasLtMatmul", api.matmul, missing);
  api.source = source;
  if (!missing.empty()) {
    result.error = source + " lacks " + missing;
    return result;
  }
  result.ok = true;
  return result;
}

LoadResult load() {
  std::string tried;
  // 0. MOEBLAZE_CUBLASLT_LIBRARY: that file and nothing else (an explicit choice that cannot be
  //    honoured is an error, never a silent fallback).
  const char* override_path = std::getenv("MOEBLAZE_CUBLASLT_LIBRARY");
  if (override_path != nullptr && override_path[0] != '\0') {
    if (void* handle = dlopen(override_path, RTLD_NOW | RTLD_LOCAL)) {
      return resolve_all(handle, std::string(override_path) + " (MOEBLAZE_CUBLASLT_LIBRARY)");
    }
    LoadResult result;
    result.error =
        "MOEBLAZE_CUBLASLT_LIBRARY=" + std::string(override_path) + ": " + last_dl_error();
    return result;
  }
  // 1. Already in the process.
  if (void* handle = dlopen(kSoname, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) {
    return resolve_all(handle, std::string(kSoname) + " (already loaded)");
  }
  // 2. The system's search path; 3. the toolkit this library was built against.
  std::string candidates[2] = {kSoname, ""};
  if (MOEBLAZE_CUDA_LIBRARY_DIR[0] != '\0') {
    candidates[1] = std::string(MOEBLAZE_CUDA_LIBRARY_DIR) + "/" + kSoname;
  }
  for (const std::string& path : candidates) {
    if (path.empty()) continue;
    if (void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL))
      return resolve_all(handle, path);
    tried += (tried.empty() ? "" : "; ") + last_dl_error();
  }
  LoadResult result;
  result.error = tried;
  return result;
}

const LoadResult& process_result() {
  static std::once_flag once;
  static LoadResult* result = nullptr;  // never destroyed: usable at exit
  std::call_once(once, [] { result = new LoadResult(load()); });
  return *result;
}

}  // namespace

const CublasLtApi& cublaslt_api() {
  const LoadResult& result = process_result();
  MB_REQUIRE(result.ok, MOEBLAZE_ERR_NOT_SUPPORTED,
             "the CUDA backend needs cuBLASLt (%s), which could not be loaded: %s. Install the "
             "CUDA %d runtime libraries (e.g. the libcublas package or the nvidia-cublas wheel) "
             "or add their folder to LD_LIBRARY_PATH",
             kSoname, result.error.c_str(), int(CUBLAS_VER_MAJOR));
  return result.api;
}

bool cublaslt_available() {
  return process_result().ok;
}

}  // namespace cuda
}  // namespace moeblaze
