#include "cuda/engines/sm90/sm90_engine.hpp"

#include "cuda/engines/sm90/f1_gemm.hpp"
#include "cuda/engines/sm90/rows_gemm.hpp"
#include "cuda/engines/sm90/wgrad_gemm.hpp"

namespace moeblaze {
namespace cuda {

bool Sm90Engine::supports(const LayerDesc& desc, const F1Op& op) const {
  return sm90_f1_supported(desc, op);
}

bool Sm90Engine::supports(const LayerDesc& desc, const F2Op& op) const {
  return sm90_rows_supported(desc, op.rows.T, {op.u, op.w_down, op.out.rows});
}

bool Sm90Engine::supports(const LayerDesc& desc, const B4Op& op) const {
  return sm90_rows_supported(desc, op.rows.T,
                             {op.dadb, op.w_gate, desc.gated() ? op.w_up : nullptr, op.out.rows});
}

bool Sm90Engine::supports(const LayerDesc& desc, const B1Op& op) const {
  return sm90_rows_supported(desc, op.rows.T,
                             {op.dy, op.w_down, op.a_src, op.b_src, op.u_src, op.dadb, op.gu});
}

bool Sm90Engine::supports(const LayerDesc& desc, const B2Op& op) const {
  return sm90_wgrad_supported(desc, op.rows.T, {op.dy, op.gu, op.dw_down});
}

bool Sm90Engine::supports(const LayerDesc& desc, const B3Op& op) const {
  return sm90_wgrad_supported(desc, op.rows.T,
                              {op.dadb, op.x, op.dw_gate, desc.gated() ? op.dw_up : nullptr});
}

void Sm90Engine::launch(const LayerDesc& desc, const F1Op& op, cudaStream_t stream) const {
  sm90_f1_launch(desc, op, forms_, stream);
}

void Sm90Engine::launch(const LayerDesc& desc, const F2Op& op, cudaStream_t stream) const {
  sm90_f2_launch(desc, op, forms_, stream);
}

void Sm90Engine::launch(const LayerDesc& desc, const B1Op& op, cudaStream_t stream) const {
  sm90_b1_launch(desc, op, forms_, stream);
}

void Sm90Engine::launch(const LayerDesc& desc, const B2Op& op, cudaStream_t stream) const {
  sm90_b2_launch(desc, op, stream);
}

void Sm90Engine::launch(const LayerDesc& desc, const B3Op& op, cudaStream_t stream) const {
  sm90_b3_launch(desc, op, stream);
}

void Sm90Engine::launch(const LayerDesc& desc, const B4Op& op, cudaStream_t stream) const {
  sm90_b4_launch(desc, op, forms_, stream);
}

int64_t Sm90Engine::b1_dg_parts(int64_t h) const {
  return (h + kSm90B1TileCols - 1) / kSm90B1TileCols * kSm90B1DgPartsPerTile;
}

}  // namespace cuda
}  // namespace moeblaze
