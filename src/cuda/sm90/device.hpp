// Whether the Hopper kernels (sm90/) can run on the current device, found once per device.
#pragma once

namespace moeblaze {
namespace cuda {

// False when the environment variable MOEBLAZE_CUDA_SM90 is "0" (read once per process): every
// GEMM then runs on the portable mma.sync engine (gemm.cuh), as on sm_80.
bool sm90_enabled();

struct Sm90Device {
  int cc_major = 0, cc_minor = 0;
  int sms = 0;
  // Compute capability 9.0, the library's sm_90a image of every sm90 kernel picked by the runtime,
  // the shared-memory opt-in granted, and the driver's tensor-map encoder found.
  bool usable = false;
};

// The current device's facts (cached per device; the first query per device sets the kernels'
// shared-memory attributes, so call sm90_prepare_device outside any CUDA-graph capture first).
const Sm90Device& sm90_current_device();

// Warm-up for `device`, e.g. in the backend's constructor. Never throws.
void sm90_prepare_device(int device);

}  // namespace cuda
}  // namespace moeblaze
