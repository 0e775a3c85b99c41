// The cuBLASLt functions the CUDA backend calls (the router projection's GEMMs), resolved at run
// time (dlopen/dlsym) instead of linked: libmoeblaze.so then has no NEEDED libcublasLt, so a
// CUDA build loads, and runs the CPU backend, on a machine without the CUDA libraries. cuBLASLt is
// loaded when the first CUDA context is created; its absence is an error of that call, naming the
// library. Search order:
//   0. MOEBLAZE_CUBLASLT_LIBRARY=/path/to/libcublasLt.so.<major>, when set: that file only;
//   1. a libcublasLt.so.<major> the process has already loaded (RTLD_NOLOAD: e.g. PyTorch's);
//   2. dlopen("libcublasLt.so.<major>") through the system's search path (LD_LIBRARY_PATH, ...);
//   3. the same file in the CUDA toolkit's library folder this library was built against.
// <major> is the cuBLAS major version of the headers (CUBLAS_VER_MAJOR): other majors are not
// ABI-compatible. RTLD_NOW | RTLD_LOCAL: missing symbols fail here, not in the middle of a call,
// and cuBLASLt's symbols stay out of the global scope. A loaded library is never closed.
#pragma once

#include <cublasLt.h>

#include <string>

namespace moeblaze {
namespace cuda {

struct CublasLtApi {
  decltype(&::cublasLtCreate) create = nullptr;
  decltype(&::cublasLtDestroy) destroy = nullptr;
  decltype(&::cublasLtMatmulDescCreate) matmul_desc_create = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) matmul_desc_destroy = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) matmul_desc_set_attribute = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) matrix_layout_create = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) matrix_layout_destroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) preference_create = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) preference_destroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) preference_set_attribute = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) algo_get_heuristic = nullptr;
  decltype(&::cublasLtMatmul) matmul = nullptr;
  std::string source;  // the file the functions came from, for messages
};

// The process's one search, done at the first call (thread-safe) and remembered, failure
// included. Throws Error(NOT_SUPPORTED) naming the library and what was tried when it failed.
const CublasLtApi& cublaslt_api();

// True when cuBLASLt can be loaded (runs the search); never throws.
bool cublaslt_available();

}  // namespace cuda
}  // namespace moeblaze
