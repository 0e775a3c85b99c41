// Host side of the grouped GEMM engine: tile-start computation, grid sizing and the (few) template
// instantiations: 5 epilogues x {bf16, f16} x 2 warp layouts on tensor cores, 5 x {f32, bf16, f16}
// on the SIMT path (35 kernels; the whole CUDA part builds in about a minute on 2 cores).
#include "cuda/engines/portable/gemm.cuh"

#include <cstdlib>
#include <cstring>

namespace moeblaze {
namespace cuda {
namespace {

// mtile_start[e] = sum_{e' < e} ceil(count_e' / bm), one block (E <= 1024); tile_expert[t] = the
// expert of m-tile t (so a GEMM block finds its expert with one load instead of a binary search).
__global__ void __launch_bounds__(1024)
    mtile_start_kernel(int E, int bm, const int32_t* offsets, int32_t* mtile_start,
                       int32_t* tile_expert) {
  __shared__ int32_t s[1024];
  const int e = threadIdx.x;
  const int32_t tiles = e < E ? (offsets[e + 1] - offsets[e] + bm - 1) / bm : 0;
  s[e] = tiles;
  __syncthreads();
  for (int offset = 1; offset < 1024; offset <<= 1) {
    const int32_t add = e >= offset ? s[e - offset] : 0;
    __syncthreads();
    s[e] += add;
    __syncthreads();
  }
  if (e < E) {
    mtile_start[e + 1] = s[e];
    for (int32_t t = s[e] - tiles; t < s[e]; ++t) tile_expert[t] = e;
  }
  if (e == 0) mtile_start[0] = 0;
}

// mma_warps: 0 = per epilogue (below); 4 or 8 forced (CudaTuning::mma_warps).
template <typename T, Epi EPI>
void launch_typed(bool use_mma, int mma_warps, const GemmParams& p, unsigned grid,
                  cudaStream_t stream) {
  if constexpr (std::is_same<T, float>::value) {
    simt_gemm_kernel<T, EPI><<<grid, kSimtThreads, 0, stream>>>(p);
    check_launch("simt_gemm_kernel");
  } else {
    if (use_mma) {
      // 2x4 warps of 64x32 are faster for every epilogue but F2's plain row store, where 2x2 warps
      // of 64x64 win (on the H200, conf3 bf16).
      const bool wide_warps = mma_warps == 4 || (mma_warps != 8 && EPI == Epi::F2);
      if (wide_warps) {
        mma_gemm_kernel<T, EPI, 2><<<grid, MmaLayout<2>::threads, kMmaSmemBytes, stream>>>(p);
      } else {
        mma_gemm_kernel<T, EPI, 4><<<grid, MmaLayout<4>::threads, kMmaSmemBytes, stream>>>(p);
      }
      check_launch("mma_gemm_kernel");
    } else {
      simt_gemm_kernel<T, EPI><<<grid, kSimtThreads, 0, stream>>>(p);
      check_launch("simt_gemm_kernel");
    }
  }
}

template <typename T>
void launch_epi(Epi epi, bool use_mma, int mma_warps, const GemmParams& p, unsigned grid,
                cudaStream_t stream) {
  switch (epi) {
    case Epi::F1: launch_typed<T, Epi::F1>(use_mma, mma_warps, p, grid, stream); break;
    case Epi::F2: launch_typed<T, Epi::F2>(use_mma, mma_warps, p, grid, stream); break;
    case Epi::B1: launch_typed<T, Epi::B1>(use_mma, mma_warps, p, grid, stream); break;
    case Epi::Wgrad: launch_typed<T, Epi::Wgrad>(use_mma, mma_warps, p, grid, stream); break;
    case Epi::B4: launch_typed<T, Epi::B4>(use_mma, mma_warps, p, grid, stream); break;
  }
}

template <typename T, Epi EPI>
void set_attribute() {
  const int bytes = int(kMmaSmemBytes);
  check(cudaFuncSetAttribute(mma_gemm_kernel<T, EPI, 2>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
        "cudaFuncSetAttribute(mma_gemm_kernel)");
  check(cudaFuncSetAttribute(mma_gemm_kernel<T, EPI, 4>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
        "cudaFuncSetAttribute(mma_gemm_kernel)");
}

template <typename T>
void set_attributes() {
  set_attribute<T, Epi::F1>();
  set_attribute<T, Epi::F2>();
  set_attribute<T, Epi::B1>();
  set_attribute<T, Epi::Wgrad>();
  set_attribute<T, Epi::B4>();
}

}  // namespace

int gemm_bm(bool use_mma) {
  return use_mma ? kMmaBM : kSimtBM;
}

size_t gemm_tile_scratch_ints(int64_t N, int64_t E) {
  const int64_t bm = kSimtBM < kMmaBM ? kSimtBM : kMmaBM;
  return size_t(E + 1) + size_t((N + bm - 1) / bm + E);
}

void gemm_init_attributes() {
  set_attributes<__nv_bfloat16>();
  set_attributes<__half>();
}

// p.mtile_start must point at gemm_tile_scratch_ints(N, E) int32 of scratch for rows-M problems;
// it is filled here.
void launch_gemm(Dtype dtype, Epi epi, bool use_mma, GemmParams p, int rows_m_total, int mma_warps,
                 cudaStream_t stream) {
  if (dtype == Dtype::F32) use_mma = false;
  const int bm = use_mma ? kMmaBM : kSimtBM;
  const int bn = use_mma ? kMmaBN : kSimtBN;
  const int logical_bn = p.dual ? bn / 2 : bn;
  p.num_ntiles = (p.N + logical_bn - 1) / logical_bn;
  int64_t grid = 0;
  if (epi == Epi::Wgrad) {
    p.num_mtiles = (p.M + bm - 1) / bm;
    grid = int64_t(p.E) * p.num_mtiles * p.num_ntiles;
  } else {
    p.tile_expert = p.mtile_start + p.E + 1;
    mtile_start_kernel<<<1, 1024, 0, stream>>>(p.E, bm, p.offsets,
                                               const_cast<int32_t*>(p.mtile_start),
                                               const_cast<int32_t*>(p.tile_expert));
    check_launch("mtile_start_kernel");
    p.num_mtiles = (rows_m_total + bm - 1) / bm + p.E;
    grid = int64_t(p.num_mtiles) * p.num_ntiles;
  }
  if (grid == 0) return;
  MB_REQUIRE(grid < (int64_t(1) << 31), MOEBLAZE_ERR_NOT_SUPPORTED, "grouped GEMM grid too large");
  const unsigned g = unsigned(grid);
  switch (dtype) {
    case Dtype::F32: launch_epi<float>(epi, false, mma_warps, p, g, stream); break;
    case Dtype::BF16: launch_epi<__nv_bfloat16>(epi, use_mma, mma_warps, p, g, stream); break;
    case Dtype::F16: launch_epi<__half>(epi, use_mma, mma_warps, p, g, stream); break;
    default: fail(MOEBLAZE_ERR_NOT_SUPPORTED, "dtype not supported by the CUDA backend");
  }
}

}  // namespace cuda
}  // namespace moeblaze
