// A CUDA backend's tuning: choices between equivalent ways of running the same computation, read
// once when the backend (a moeblaze context) is created and passed to every launch, so two
// contexts in one process can differ and nothing is written while execute calls run. Every field
// but `sm90` and B1's form keeps the results bit for bit (the CUDA suite checks each); B1's forms
// sum dg's column groups in other orders (dg's last bits), and `sm90` picks the engine (the
// portable engine accumulates in another order: last-bit differences).
#pragma once

#include "cuda/engines/sm90/device.hpp"

namespace moeblaze {
namespace cuda {

struct CudaTuning {
  // MOEBLAZE_CUDA_SM90=0: every GEMM on the portable engines (engines/portable), as on sm_80.
  bool sm90 = true;
  // MOEBLAZE_CUDA_MMA_WARPS: the portable tensor-core engine's warp layout, 4 (2x2 warps of
  // 64x64) or 8 (2x4 of 64x32); 0 = its per-GEMM default.
  int mma_warps = 0;
  // MOEBLAZE_CUDA_GU_CHUNKS: B1/B2's column chunks of h (experts.cu, gu_chunk_cols); 0 = its
  // policy, n > 0 = n chunks.
  int gu_chunks = 0;
  // MOEBLAZE_CUDA_ROW_CHUNKS: F2/B4's column chunks of d (experts.cu, row_chunk_cols); 0 = its
  // policy, n > 0 = n chunks.
  int row_chunks = 0;
  // MOEBLAZE_CUDA_F2_CHUNKS, MOEBLAZE_CUDA_F2_ROWS_FORM: the same two choices for F2 alone (B4
  // keeps row_chunks and sm90_forms.rows_form); 0 / -1 = as for B4.
  int f2_row_chunks = 0;
  int f2_rows_form = -1;
  // MOEBLAZE_CUDA_DIRECT_ROWS=0: with k = 1, y and dx through the rows and the per-token reduction
  // instead of straight from F2 / B4's epilogue.
  bool direct_rows = true;
  // MOEBLAZE_CUDA_F1_FORM, MOEBLAZE_CUDA_F1_CLUSTER, MOEBLAZE_CUDA_B1_FORM,
  // MOEBLAZE_CUDA_ROWS_FORM, MOEBLAZE_CUDA_ROWS_CLUSTER, MOEBLAZE_CUDA_BAND_MTILES: the Hopper
  // kernels' epilogue forms, 2-CTA clusters and tile rasterisation (engines/sm90/device.hpp).
  Sm90Forms sm90_forms;
  // Not a choice: the backend's device's SM count, which B1/B2's chunk policy weighs (B2's waves
  // of tiles, experts.cu); 0 = not weighed.
  int sm_count = 0;

  // The defaults above, overridden by the MOEBLAZE_CUDA_* variables that are set (values that do
  // not parse keep the default), with `device`'s SM count.
  static CudaTuning from_environment(int device);
  // This tuning with F2's overrides in row_chunks and sm90_forms.rows_form (the forward's).
  CudaTuning for_f2() const {
    CudaTuning t = *this;
    if (f2_row_chunks > 0) t.row_chunks = f2_row_chunks;
    if (f2_rows_form >= 0) t.sm90_forms.rows_form = f2_rows_form;
    return t;
  }
};

}  // namespace cuda
}  // namespace moeblaze
