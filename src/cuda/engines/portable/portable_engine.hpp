// The portable engines (gemm.cuh): one tiled grouped GEMM with a per-op epilogue, on tensor cores
// (mma.sync m16n8k16, sm_80 and newer, BF16/F16 with d and h multiples of 8 and 16-byte aligned
// tensors) or on SIMT cores (every dtype and shape; F32 exactly, without TF32).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "cuda/engines/engine.hpp"

namespace moeblaze {
namespace cuda {

class PortableEngine final : public GemmEngine {
 public:
  // tensor_cores: the mma.sync engine, else SIMT. mma_warps: its warp layout (CudaTuning).
  PortableEngine(bool tensor_cores, int mma_warps)
      : tensor_cores_(tensor_cores), mma_warps_(mma_warps) {}
  const char* name() const override { return tensor_cores_ ? "mma.sync" : "simt"; }

  bool supports(const LayerDesc& desc, const F1Op& op) const override;
  bool supports(const LayerDesc& desc, const F2Op& op) const override;
  bool supports(const LayerDesc& desc, const B1Op& op) const override;
  bool supports(const LayerDesc& desc, const B2Op& op) const override;
  bool supports(const LayerDesc& desc, const B3Op& op) const override;
  bool supports(const LayerDesc& desc, const B4Op& op) const override;

  void launch(const LayerDesc& desc, const F1Op& op, cudaStream_t stream) const override;
  void launch(const LayerDesc& desc, const F2Op& op, cudaStream_t stream) const override;
  void launch(const LayerDesc& desc, const B1Op& op, cudaStream_t stream) const override;
  void launch(const LayerDesc& desc, const B2Op& op, cudaStream_t stream) const override;
  void launch(const LayerDesc& desc, const B3Op& op, cudaStream_t stream) const override;
  void launch(const LayerDesc& desc, const B4Op& op, cudaStream_t stream) const override;

  int64_t b1_dg_parts(int64_t h) const override;

  // The most dg partials per row either portable engine writes, and the m-tile table's int32
  // (RoutedRows::tile_scratch).
  static int64_t max_b1_dg_parts(int64_t h);
  static size_t tile_scratch_ints(int64_t N, int64_t E);
  // The tensor-core kernels' shared-memory opt-in, once per device.
  static void prepare_device();

 private:
  bool tensor_core_shapes(const LayerDesc& desc, std::initializer_list<const void*> tensors) const;
  int tile_cols() const;

  bool tensor_cores_;
  int mma_warps_;
};

}  // namespace cuda
}  // namespace moeblaze
