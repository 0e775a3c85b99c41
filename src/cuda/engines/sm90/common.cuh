// The library's host helpers for its Hopper (sm_90a) kernels, on top of primitives.cuh (the
// device primitives and the tensor-map encoder, self-contained: it includes nothing of the
// library's): tensor maps with the library's error reporting, kernel preparation, alignment checks.
#pragma once

#include <algorithm>
#include <initializer_list>

#include <cstring>

#include "common/status.hpp"
#include "cuda/engines/sm90/primitives.cuh"

namespace moeblaze {
namespace cuda {
namespace sm90 {

// The tensor map of a RANK-dimensional tensor of T (dim 0 contiguous; byte strides of dims 1..)
// with 128B swizzle and element strides 1; coordinates past a dimension read as zeros. `what`
// names the kernel in error messages.
template <typename T, int RANK>
CUtensorMap encode_map(const void* base, const cuuint64_t (&dims)[RANK],
                       const cuuint64_t (&byte_strides)[RANK - 1], const cuuint32_t (&box)[RANK],
                       const char* what) {
  CUtensorMap map;
  std::memset(&map, 0, sizeof(map));
  cuuint32_t elem[RANK];
  for (int i = 0; i < RANK; ++i) elem[i] = 1;
  const CUtensorMapDataType type = std::is_same<T, __nv_bfloat16>::value
                                       ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const EncodeTiledFn encode = tensor_map_encoder();
  MB_REQUIRE(encode != nullptr, MOEBLAZE_ERR_CUDA,
             "sm90 %s: cuTensorMapEncodeTiled is not available from the driver", what);
  const CUresult r = encode(&map, type, RANK, const_cast<void*>(base), dims, byte_strides, box,
                            elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MB_REQUIRE(r == CUDA_SUCCESS, MOEBLAZE_ERR_CUDA, "sm90 %s: cuTensorMapEncodeTiled failed (%d)",
             what, int(r));
  return map;
}

// A 3-D tensor of T (strides of dims 1 and 2 in elements) with box {box0, box1, box2}.
template <typename T>
CUtensorMap make_map_3d(const void* base, uint64_t dim0, uint64_t dim1, uint64_t dim2,
                        uint64_t stride1, uint64_t stride2, uint32_t box0, uint32_t box1,
                        uint32_t box2, const char* what) {
  return encode_map<T, 3>(base, {dim0, dim1, dim2}, {stride1 * sizeof(T), stride2 * sizeof(T)},
                          {box0, box1, box2}, what);
}

// A 2-D tensor of T: dim1 rows of dim0 elements, rows stride1 elements apart, box {box0, box1}.
template <typename T>
CUtensorMap make_map_2d(const void* base, uint64_t dim0, uint64_t dim1, uint64_t stride1,
                        uint32_t box0, uint32_t box1, const char* what) {
  return encode_map<T, 2>(base, {dim0, dim1}, {stride1 * sizeof(T)}, {box0, box1}, what);
}

// With the device current: true when the image of `kernel` the runtime picked is an sm_90 one (a
// build without 90a in MOEBLAZE_CUDA_ARCHS would run the trapping sm_80 image), after granting it
// `smem_bytes` of dynamic shared memory. Called once per device (sm90/device.cu), never during a
// launch, so no such runtime call happens inside a CUDA-graph capture.
template <typename Kernel>
bool prepare_kernel(Kernel kernel, size_t smem_bytes) {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.binaryVersion >= 90 &&
         cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(smem_bytes)) == cudaSuccess;
}

// ---- the persistent warp-specialised kernels (f1_gemm.cu, rows_gemm.cu, wgrad_gemm.cu): 384
// threads, one CTA per SM.

// Experts the device-side tile schedule holds in shared memory (a prefix of E + 1 ints).
constexpr int kMaxExperts = 1024;
// Dynamic shared memory a block may have on the H100 / H200 (227 KB).
constexpr size_t kSmemPerBlock = 232448;

// Dynamic shared memory of F1 and the rows kernels (the forms with epilogue warps): 1 KB of
// alignment slack, the pipeline stages, the epilogue's buffer (the consumers' staging, or the
// epilogue warps' hand-off), the mbarriers (full, empty and each consumer warpgroup's a_full per
// stage, + handoff_full and handoff_empty) and the E + 1 tile starts.
constexpr size_t pipeline_smem_bytes(int stages, size_t stage_bytes, size_t epilogue_bytes, int E) {
  return 1024 + size_t(stages) * stage_bytes + epilogue_bytes + size_t(4 * stages + 2) * 8 +
         sizeof(int) * size_t(E + 1);
}

// F1 and the rows kernels have two kinds of form: 4 pipeline stages with the epilogue in the
// consumers (a staging buffer of staging_bytes), or 3 stages with epilogue warps, whose hand-off
// (handoff_bytes) takes the fourth stage's shared memory (B1's split forms have both buffers:
// rows_gemm.cu sizes its forms itself).
constexpr int stages_for(bool epi_warps) {
  return epi_warps ? 3 : 4;
}
constexpr size_t two_form_smem_bytes(int E, bool epi_warps, size_t stage_bytes,
                                     size_t staging_bytes, size_t handoff_bytes) {
  return pipeline_smem_bytes(stages_for(epi_warps), stage_bytes,
                             epi_warps ? handoff_bytes : staging_bytes, E);
}
// The larger form at kMaxExperts: what such a kernel opts in to (and must fit kSmemPerBlock).
constexpr size_t two_form_max_smem_bytes(size_t stage_bytes, size_t staging_bytes,
                                         size_t handoff_bytes) {
  return std::max(
      two_form_smem_bytes(kMaxExperts, false, stage_bytes, staging_bytes, handoff_bytes),
      two_form_smem_bytes(kMaxExperts, true, stage_bytes, staging_bytes, handoff_bytes));
}

// setmaxnreg counts (per thread, multiples of 8): the producer warpgroup's and the two consumer
// warpgroups' counts may sum to at most 3 x 168 (ptxas's entry count for 384 threads), or a
// consumer's .inc waits forever.
constexpr bool register_split_fits(int producer, int consumer) {
  return producer + 2 * consumer <= 3 * 168;
}

// The launch of a persistent kernel of `threads` threads: `units` CTAs, or with cluster = 2 that
// many clusters of two CTAs (a cluster-dimension attribute only then: one CTA launches plainly).
struct PersistentLaunch {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute[1] = {};
  PersistentLaunch(int units, int cluster, int threads, size_t smem_bytes, cudaStream_t stream) {
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = unsigned(cluster);
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    config.gridDim = dim3(unsigned(units * cluster));
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    config.attrs = attribute;
    config.numAttrs = cluster > 1 ? 1 : 0;
  }
  PersistentLaunch(const PersistentLaunch&) = delete;  // config points at attribute
  PersistentLaunch& operator=(const PersistentLaunch&) = delete;
};

// The 2-CTA clusters of each kernel that can be resident at once, the fewest over `kernels` (0
// where a query fails): their persistent grid. Called once per device, outside any capture.
template <typename Kernel>
int max_resident_2cta_clusters(std::initializer_list<Kernel> kernels, int threads,
                               size_t smem_bytes) {
  const PersistentLaunch launch(1, 2, threads, smem_bytes, nullptr);
  int fewest = 0x7fffffff;
  for (Kernel kernel : kernels) {
    int clusters = 0;
    if (kernel == nullptr ||
        cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    fewest = std::min(fewest, clusters);
  }
  return fewest;
}

}  // namespace sm90
}  // namespace cuda
}  // namespace moeblaze
