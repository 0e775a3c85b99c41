#include "cuda/tuning.hpp"

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "cuda/engines/sm90/f1_gemm.hpp"
#include "cuda/engines/sm90/rows_gemm.hpp"

namespace moeblaze {
namespace cuda {

CudaTuning CudaTuning::from_environment(int device) {
  CudaTuning t;
  if (cudaDeviceGetAttribute(&t.sm_count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    t.sm_count = 0;
    (void)cudaGetLastError();  // not left behind for the next launch check
  }
  const auto is_zero = [](const char* v) { return v != nullptr && std::strcmp(v, "0") == 0; };
  t.sm90 = !is_zero(std::getenv("MOEBLAZE_CUDA_SM90"));
  if (const char* warps = std::getenv("MOEBLAZE_CUDA_MMA_WARPS")) {
    const int w = std::atoi(warps);
    t.mma_warps = w == 4 || w == 8 ? w : 0;
  }
  if (const char* chunks = std::getenv("MOEBLAZE_CUDA_GU_CHUNKS")) {
    const int c = std::atoi(chunks);
    t.gu_chunks = c > 0 ? c : 0;
  }
  if (const char* chunks = std::getenv("MOEBLAZE_CUDA_ROW_CHUNKS")) {
    const int c = std::atoi(chunks);
    t.row_chunks = c > 0 ? c : 0;
  }
  if (const char* chunks = std::getenv("MOEBLAZE_CUDA_F2_CHUNKS")) {
    const int c = std::atoi(chunks);
    t.f2_row_chunks = c > 0 ? c : 0;
  }
  t.f2_rows_form = sm90_parse_rows_form(std::getenv("MOEBLAZE_CUDA_F2_ROWS_FORM"));
  t.direct_rows = !is_zero(std::getenv("MOEBLAZE_CUDA_DIRECT_ROWS"));
  t.sm90_forms.f1_form = sm90_parse_f1_form(std::getenv("MOEBLAZE_CUDA_F1_FORM"));
  t.sm90_forms.f1_cluster = sm90_parse_f1_cluster(std::getenv("MOEBLAZE_CUDA_F1_CLUSTER"));
  t.sm90_forms.b1_form = sm90_parse_b1_form(std::getenv("MOEBLAZE_CUDA_B1_FORM"));
  t.sm90_forms.rows_cluster = sm90_parse_rows_cluster(std::getenv("MOEBLAZE_CUDA_ROWS_CLUSTER"));
  t.sm90_forms.rows_form = sm90_parse_rows_form(std::getenv("MOEBLAZE_CUDA_ROWS_FORM"));
  t.sm90_forms.band_mtiles = sm90_parse_band_mtiles(std::getenv("MOEBLAZE_CUDA_BAND_MTILES"));
  return t;
}

}  // namespace cuda
}  // namespace moeblaze
