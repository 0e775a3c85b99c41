// The Hopper engine: F1 (f1_gemm), F2, B4, B1 (rows_gemm), B2, B3 (wgrad_gemm) on sm_90a
// warp-specialised TMA + wgmma kernels, BF16 and F16, every tensor 16-byte aligned.
#pragma once

#include "cuda/engines/engine.hpp"
#include "cuda/engines/sm90/device.hpp"

namespace moeblaze {
namespace cuda {

class Sm90Engine final : public GemmEngine {
 public:
  explicit Sm90Engine(const Sm90Forms& forms) : forms_(forms) {}
  const char* name() const override { return "sm90"; }

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

 private:
  Sm90Forms forms_;
};

}  // namespace cuda
}  // namespace moeblaze
