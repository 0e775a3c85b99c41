#include "cuda/engines/sm90/device.hpp"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

#include "cuda/engines/sm90/common.cuh"
#include "cuda/engines/sm90/f1_gemm.hpp"
#include "cuda/engines/sm90/rows_gemm.hpp"
#include "cuda/engines/sm90/wgrad_gemm.hpp"

namespace moeblaze {
namespace cuda {
namespace {

Sm90Device query_device(int device) {
  Sm90Device info;
  int optin = 0;
  bool ok =
      cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, device) ==
          cudaSuccess &&
      cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, device) ==
          cudaSuccess &&
      cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
          cudaSuccess;
  const size_t needed =
      std::max({sm90_f1_max_smem_bytes(), sm90_rows_max_smem_bytes(), sm90_wgrad_max_smem_bytes()});
  ok = ok && info.cc_major == 9 && info.cc_minor == 0 && info.sms > 0 && size_t(optin) >= needed &&
       sm90::tensor_map_encoder() != nullptr;
  if (ok) {
    // The kernel attributes are per device: set them with `device` current, once, never during a
    // (possibly captured) launch.
    int previous = -1;
    ok = cudaGetDevice(&previous) == cudaSuccess;
    const bool switch_device = ok && previous != device;
    if (switch_device) ok = cudaSetDevice(device) == cudaSuccess;
    ok = ok && sm90_f1_prepare_kernels(&info.f1_clusters) &&
         sm90_rows_prepare_kernels(&info.rows_clusters) && sm90_wgrad_prepare_kernels();
    info.rows_pingpong = ok && sm90_rows_pingpong_prepare_kernels(&info.rows_pingpong_clusters);
    if (switch_device) cudaSetDevice(previous);
  }
  (void)cudaGetLastError();  // a refused query leaves no sticky error behind
  info.usable = ok;
  return info;
}

const Sm90Device& device_info(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, Sm90Device> infos;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = infos.find(device);
  if (found != infos.end()) return found->second;
  return infos.emplace(device, query_device(device)).first->second;
}

}  // namespace

int sm90_band_mtiles(Sm90Gemm gemm, int n_tiles, int forced_band) {
  if (forced_band >= 1 && forced_band <= 256) return forced_band;
  const bool narrow_rows_gemm =
      (gemm == Sm90Gemm::F2 || gemm == Sm90Gemm::B4) && n_tiles <= kSm90NarrowOutputNTiles;
  return narrow_rows_gemm ? 1 : kSm90DefaultBandMTiles;
}

int sm90_parse_band_mtiles(const char* value) {
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  const long band = std::strtol(value, &end, 10);
  return *end == '\0' && band >= 1 && band <= 256 ? int(band) : 0;
}

const Sm90Device& sm90_current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    static const Sm90Device none;
    return none;
  }
  return device_info(device);
}

void sm90_prepare_device(int device) {
  (void)device_info(device);
}

}  // namespace cuda
}  // namespace moeblaze
