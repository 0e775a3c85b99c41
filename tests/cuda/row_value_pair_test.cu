// The Hopper kernels' pairwise row rounding (sm90 primitives.cuh, row_value_pair) against the
// element-wise definition it replaces (cuda_util.cuh, row_value), bit for bit, in bf16 and f16:
// every pair of special fp32 values (+-0, subnormals, the normal range's ends, values on rounding
// ties, infinities, NaNs) under weights from 0 to 1e30, then random bit patterns and random
// magnitudes near the storage types' underflow. F2's and B4's rows (and with k = 1 the layer's y
// and dx) are these values, so the CPU oracle and the expert-parallel layer keep their bits only
// if the two agree everywhere. Needs an sm_90 GPU: exits 77 (CTest: Skipped) without one.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/cuda_util.cuh"
#include "cuda/engines/sm90/primitives.cuh"

namespace {

constexpr int kSkipped = 77;

template <typename T>
__global__ void round_pairs(const float* w, const float2* v, int n, uint32_t* by_element,
                            uint32_t* by_pair) {
#if MB_SM90_DEVICE  // the sm90 primitives exist in the sm_90a device pass only
  using namespace moeblaze::cuda;
  using namespace moeblaze::cuda::sm90;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  by_element[i] = pack2<T>(row_value<T>(w[i], v[i].x), row_value<T>(w[i], v[i].y));
  by_pair[i] = row_value_pair<T>(w[i], v[i].x, v[i].y);
#endif
}

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::printf("FAIL: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

template <typename Kernel>
bool launch(Kernel kernel, int n, const float* w, const float2* v, uint32_t* by_element,
            uint32_t* by_pair) {
  kernel<<<(n + 255) / 256, 256>>>(w, v, n, by_element, by_pair);
  return ok(cudaGetLastError(), "launch") && ok(cudaDeviceSynchronize(), "round_pairs");
}

// Mismatches of one storage type over the inputs (-1 on a CUDA error).
template <typename T>
int mismatches(const char* name, const std::vector<float>& w, const std::vector<float2>& v) {
  const int n = int(w.size());
  float* dw = nullptr;
  float2* dv = nullptr;
  uint32_t *d_element = nullptr, *d_pair = nullptr;
  std::vector<uint32_t> by_element(w.size()), by_pair(w.size());
  const bool ran =
      ok(cudaMalloc(&dw, n * sizeof(float)), "cudaMalloc") &&
      ok(cudaMalloc(&dv, n * sizeof(float2)), "cudaMalloc") &&
      ok(cudaMalloc(&d_element, n * sizeof(uint32_t)), "cudaMalloc") &&
      ok(cudaMalloc(&d_pair, n * sizeof(uint32_t)), "cudaMalloc") &&
      ok(cudaMemcpy(dw, w.data(), n * sizeof(float), cudaMemcpyHostToDevice), "copy w") &&
      ok(cudaMemcpy(dv, v.data(), n * sizeof(float2), cudaMemcpyHostToDevice), "copy v") &&
      launch(round_pairs<T>, n, dw, dv, d_element, d_pair) &&
      ok(cudaMemcpy(by_element.data(), d_element, n * 4, cudaMemcpyDeviceToHost), "copy back") &&
      ok(cudaMemcpy(by_pair.data(), d_pair, n * 4, cudaMemcpyDeviceToHost), "copy back");
  cudaFree(dw);
  cudaFree(dv);
  cudaFree(d_element);
  cudaFree(d_pair);
  if (!ran) return -1;
  int bad = 0, zero_halves = 0;
  for (int i = 0; i < n; ++i) {
    zero_halves += (by_element[i] & 0x7fffu) == 0 || (by_element[i] & 0x7fff0000u) == 0;
    if (by_element[i] == by_pair[i]) continue;
    if (bad++ < 8)
      std::printf("%s: w %a, v (%a, %a): row_value %08x, row_value_pair %08x\n", name, w[i], v[i].x,
                  v[i].y, by_element[i], by_pair[i]);
  }
  std::printf("%s: %d pairs (%d with a zero), %d mismatches\n", name, n, zero_halves, bad);
  return bad;
}

}  // namespace

int main() {
  int devices = 0;
  cudaDeviceProp prop = {};
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 ||
      cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9 || prop.minor != 0) {
    std::printf("SKIPPED: no sm_90 GPU (the Hopper kernels' rounding needs one)\n");
    return kSkipped;
  }
  const uint32_t special_bits[] = {
      0x00000000u, 0x80000000u,                                         // +-0
      0x00000001u, 0x80000001u, 0x007fffffu, 0x807fffffu,               // fp32 subnormals
      0x00800000u, 0x80800000u, 0x7f7fffffu, 0xff7fffffu,               // the normal range's ends
      0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u,  // inf, NaNs
      0x3f800000u, 0xbf800000u, 0x3f808000u, 0x3f818000u, 0x3f807fffu,  // bf16 ties around 1
      0x00008000u, 0x80008000u, 0x00010000u, 0x00007fffu,               // bf16 subnormal boundaries
      0x477fe000u, 0x477ff000u,  // f16's largest finite value and its overflow tie
      0x33800000u, 0xb3800000u, 0x33000000u, 0xb3000000u,  // f16's smallest subnormal, half of it
      0x387fc000u, 0xb87fc000u, 0x38800000u};              // f16's subnormal / normal boundary
  const float weights[] = {1.f, 0.5f, 0.25f, 0.123f, 1e-30f, 3e-39f, -1.f, 0.f, 1e30f, 0.9999f};
  std::vector<float> w;
  std::vector<float2> v;
  for (float weight : weights)
    for (uint32_t a : special_bits)
      for (uint32_t b : special_bits) {
        w.push_back(weight);
        v.push_back(make_float2(from_bits(a), from_bits(b)));
      }
  const unsigned seed = 20261203u;
  std::printf("random inputs: seed %u\n", seed);
  std::mt19937 rng(seed);
  for (int i = 0; i < (1 << 20); ++i) {
    const uint32_t x = rng(), y = rng(), z = rng();
    float a = from_bits(x), b = from_bits(y);
    if ((z >> 30) == 0) {  // magnitudes from 2^24 down to 2^-160: the types' underflow
      a = std::ldexp(float(int32_t(x) >> 8), -int(y % 184));
      b = -a;
    }
    const float weight =
        (z & 1) ? 1.f : std::ldexp(float((z >> 8) & 0xffff) / 65536.f, int((z >> 1) & 0x3f) - 40);
    w.push_back(weight);
    v.push_back(make_float2(a, b));
  }
  const int bf16 = mismatches<__nv_bfloat16>("bf16", w, v);
  const int f16 = mismatches<__half>("f16", w, v);
  if (bf16 != 0 || f16 != 0) {
    std::printf("FAIL\n");
    return 1;
  }
  std::printf("PASS\n");
  return 0;
}
