// Shared helpers of the CUDA backend: status checks that throw moeblaze::Error, the current-device
// guard, and the storage-dtype conversions every kernel uses.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/activation_math.hpp"
#include "common/layer_desc.hpp"
#include "common/status.hpp"

namespace moeblaze {
namespace cuda {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what) {
  fail(MOEBLAZE_ERR_CUDA, "%s: %s: %s", what, cudaGetErrorName(err), cudaGetErrorString(err));
}

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw_cuda(err, what);
}

// After every launch: configuration errors surface here, asynchronous faults in a later call.
inline void check_launch(const char* kernel) {
  check(cudaGetLastError(), kernel);
}

inline void check_lt(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    fail(MOEBLAZE_ERR_CUDA, "%s: cuBLASLt status %d", what, static_cast<int>(status));
  }
}

// Every entry point runs on the backend's device and gives the caller's device back on exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

inline cudaStream_t as_stream(void* stream) {
  return static_cast<cudaStream_t>(stream);
}

inline unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

// Whether a pointer is 16-byte aligned: what 16-byte vector loads, TMA and the mma kernels need.
inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// ---- storage dtype conversions (round-to-nearest-even) ------------------------------------------

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) {
  return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

// Whether the activation epilogues of storage type T take the sigmoid from tanh.approx
// (act_math::sigmoid's TANH): for bf16 only, whose rounding dwarfs its error. Every CUDA engine
// passes this one constant, so F1's u and B1's recomputed u keep the same bits in every engine.
template <typename T>
constexpr bool kTanhSigmoid = std::is_same<T, __nv_bfloat16>::value;

// act_math::forward and backward in fp32 with storage type T's sigmoid form.
template <typename T>
__device__ __forceinline__ float act_forward(Activation act, float a, float b) {
  return act_math::forward<float, kTanhSigmoid<T>>(act, a, b);
}
template <typename T>
__device__ __forceinline__ void act_backward(Activation act, float a, float b, float du, float* da,
                                             float* db) {
  act_math::backward<float, kTanhSigmoid<T>>(act, a, b, du, da, db);
}

// The value a float has once stored in T and read back.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_f32<T>(from_f32<T>(v));
}

// A token's output from its only routed row (k = 1, or an expert-parallel expert rank's rows):
// token_reduce_kernel's sum of one term, so the same bits: 0 + w * v, each operation rounded
// (w = 1 for B4's dx: the product is then exact and 0 + v turns -0 into +0 as the sum does).
__device__ __forceinline__ float one_term_sum(float w, float v) {
  return __fadd_rn(0.f, __fmul_rn(w, v));
}

// A routed row's element as F2 / B4 store it (storage type T): w * v rounded to T, then + 0 (so a
// -0 becomes +0, as the per-token sum that starts at +0 makes it). The per-token sum of rows gives
// the same bits whether a row is stored and summed or (k = 1) is the token's output itself.
template <typename T>
__device__ __forceinline__ float row_value(float w, float v) {
  return __fadd_rn(0.f, round_to<T>(one_term_sum(w, v)));
}

// Calls f.template operator()<T>() with T the storage type of `dtype` (F64 never reaches CUDA).
#define MB_CUDA_DISPATCH_DTYPE(dtype, ...)                                                     \
  switch (dtype) {                                                                             \
    case ::moeblaze::Dtype::F32: {                                                             \
      using scalar_t = float;                                                                  \
      __VA_ARGS__;                                                                             \
    } break;                                                                                   \
    case ::moeblaze::Dtype::BF16: {                                                            \
      using scalar_t = __nv_bfloat16;                                                          \
      __VA_ARGS__;                                                                             \
    } break;                                                                                   \
    case ::moeblaze::Dtype::F16: {                                                             \
      using scalar_t = __half;                                                                 \
      __VA_ARGS__;                                                                             \
    } break;                                                                                   \
    default:                                                                                   \
      ::moeblaze::fail(MOEBLAZE_ERR_NOT_SUPPORTED, "dtype not supported by the CUDA backend"); \
  }

// Butterfly reductions over a warp's 32 lanes: every lane ends with the result, combined in the
// same fixed order, so the sums are bitwise repeatable (the router, B1's dg, the EP loss shares).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

}  // namespace cuda
}  // namespace moeblaze
