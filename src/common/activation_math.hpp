// The activation functions and their partial derivatives, shared by the CPU reference and the CUDA
// kernels so both compute the same formulas. T is float or double.
//
// Gated:     u = f(a) * b,  du/da = f'(a) * b,  du/db = f(a)
// Non-gated: u = f(a),      du/da = f'(a)       (b is ignored)
#pragma once

#include <cmath>
#include <type_traits>

#include "layer_desc.hpp"

#if defined(__CUDACC__)
#define MB_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MB_HOST_DEVICE inline
#endif

namespace moeblaze {
namespace act_math {

// `using std::exp` (and erf) so float arguments pick the float overloads on the host too: the math
// is then done in the accumulation type, exactly as on the GPU, not silently in double.
//
// On the GPU the float sigmoid is the MUFU form: ex2.approx for the exponential, an approximate
// division (rcp.approx and one multiply) instead of IEEE division. Both are within a few ulp of
// fp32 (far below the bf16/fp16 rounding that follows, and below the fp32 tests' 1e-4), while the
// IEEE division's out-of-line slow path and expf's range reduction would dominate the cost of the
// activation in the fused GEMM epilogues. Every CUDA engine calls this one function, so they still
// agree bitwise with each other; the CPU reference keeps the accurate form. For a < -87 the
// denominator passes 2^126 and the division returns 0, the limit.
#if defined(__CUDA_ARCH__)
// 2^x by MUFU.EX2 with subnormal inputs and results flushed to zero. Against __expf's form (which
// is ex2.approx without .ftz) this drops a range test and two rescaling multiplies. In sigmoid the
// result only meets 1 + 2^x, where a subnormal 2^x (x < -126) rounds away and a subnormal x gives
// 2^x = 1 either way: the same bits as __expf(-a), for every a.
__device__ __forceinline__ float ex2_approx_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh by one MUFU.TANH (relative error about 2^-11).
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

// TANH (GPU, float only; ignored elsewhere): sigmoid(a) = 0.5 + 0.5 tanh(a / 2), one MUFU
// instruction instead of two (ex2 and rcp). Its error (at most 3.6e-6 over every bf16 a on the
// H200, against 8.4e-8) is far within bf16's rounding but not f16's or f32's: the callers pass
// it for bf16 only (kTanhSigmoid, cuda_util.cuh). Every function below hands TANH on.
template <typename T, bool TANH = false>
MB_HOST_DEVICE T sigmoid(T a) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same<T, float>::value && TANH) {
    return fmaf(0.5f, tanh_approx(0.5f * a), 0.5f);
  } else if constexpr (std::is_same<T, float>::value) {
    // exp(-a) = 2^(-a log2 e), the multiply __expf does (log2 e rounded to float, 0x3FB8AA3B).
    return __fdividef(1.f, 1.f + ex2_approx_ftz(-a * 1.44269502162933349609375f));
  } else {
    using std::exp;
    return T(1) / (T(1) + exp(-a));
  }
#else
  using std::exp;
  return T(1) / (T(1) + exp(-a));
#endif
}

template <typename T, bool TANH = false>
MB_HOST_DEVICE T silu(T a) {
  return a * sigmoid<T, TANH>(a);
}

template <typename T, bool TANH = false>
MB_HOST_DEVICE T silu_grad(T a) {
  const T s = sigmoid<T, TANH>(a);
  return s * (T(1) + a * (T(1) - s));
}

// Exact GELU: a * Phi(a), Phi the standard normal CDF.
template <typename T, bool TANH = false>
MB_HOST_DEVICE T gelu(T a) {
  using std::erf;
  return T(0.5) * a * (T(1) + erf(a * T(0.70710678118654752440)));
}

template <typename T, bool TANH = false>
MB_HOST_DEVICE T gelu_grad(T a) {
  using std::erf;
  using std::exp;
  const T cdf = T(0.5) * (T(1) + erf(a * T(0.70710678118654752440)));
  const T pdf = T(0.39894228040143267794) * exp(T(-0.5) * a * a);
  return cdf + a * pdf;
}

// NaN passes through (as torch.relu's), so ReLU, ReLU^2 and ReGLU never hide one; -0 gives +0.
template <typename T, bool TANH = false>
MB_HOST_DEVICE T relu(T a) {
  return !(a <= T(0)) ? a : T(0);
}

template <typename T, bool TANH = false>
MB_HOST_DEVICE T relu_grad(T a) {
  return a > T(0) ? T(1) : T(0);
}

template <typename T, bool TANH = false>
MB_HOST_DEVICE T relu2(T a) {
  return relu<T, TANH>(a) * relu<T, TANH>(a);
}

template <typename T, bool TANH = false>
MB_HOST_DEVICE T relu2_grad(T a) {
  return T(2) * relu<T, TANH>(a);
}

// u = act(a, b). One case per line of activations.def: f(a) * b (gated) or f(a).
template <typename T, bool TANH = false>
MB_HOST_DEVICE T forward(Activation act, T a, T b) {
  switch (act) {
// clang-format off
#define MOEBLAZE_ACTIVATION(Name, CODE, GATED, FN)           \
  case Activation::Name: return (GATED) ? FN<T, TANH>(a) * b : FN<T, TANH>(a);
#include "common/activations.def"
    // clang-format on
  }
  return T(0);
}

// Given du (dLoss/du), the gradients with respect to a and b: gated da = du * b * f'(a) and
// db = du * f(a); otherwise da = du * f'(a) and db = 0.
template <typename T, bool TANH = false>
MB_HOST_DEVICE void backward(Activation act, T a, T b, T du, T* da, T* db) {
  switch (act) {
// clang-format off
#define MOEBLAZE_ACTIVATION(Name, CODE, GATED, FN) \
  case Activation::Name:                           \
    if (GATED) {                                   \
      *da = du * b * FN##_grad<T, TANH>(a);        \
      *db = du * FN<T, TANH>(a);                   \
    } else {                                       \
      *da = du * FN##_grad<T, TANH>(a);            \
      *db = T(0);                                  \
    }                                              \
    return;
#include "common/activations.def"
    // clang-format on
  }
  *da = T(0);
  *db = T(0);
}

}  // namespace act_math
}  // namespace moeblaze
