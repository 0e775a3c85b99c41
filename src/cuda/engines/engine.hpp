// A GEMM engine computes the expert GEMMs of gemm_ops.hpp: it answers supports(op) (can it run
// this op on the current device, with these shapes and pointers) and launch(op) (enqueue it on a
// stream; no host sync, no allocation). Engines:
//   sm90/      Hopper wgmma + TMA kernels (sm_90a)
//   portable/  mma.sync tensor-core kernels (sm_80 and newer, BF16/F16), SIMT kernels (any dtype)
// A new architecture is a new folder with a GemmEngine, listed in EngineSet (engine_set.hpp). Every
// engine computes the same contract (fp32 accumulation, the rounding points of include/moeblaze.h);
// their summation orders differ, so two engines may differ in the last bit, and each is bitwise
// repeatable on its own.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/layer_desc.hpp"
#include "cuda/engines/gemm_ops.hpp"

namespace moeblaze {
namespace cuda {

class GemmEngine {
 public:
  virtual ~GemmEngine() = default;
  virtual const char* name() const = 0;

  virtual bool supports(const LayerDesc& desc, const F1Op& op) const = 0;
  virtual bool supports(const LayerDesc& desc, const F2Op& op) const = 0;
  virtual bool supports(const LayerDesc& desc, const B1Op& op) const = 0;
  virtual bool supports(const LayerDesc& desc, const B2Op& op) const = 0;
  virtual bool supports(const LayerDesc& desc, const B3Op& op) const = 0;
  virtual bool supports(const LayerDesc& desc, const B4Op& op) const = 0;

  // Precondition: supports(desc, op).
  virtual void launch(const LayerDesc& desc, const F1Op& op, cudaStream_t stream) const = 0;
  virtual void launch(const LayerDesc& desc, const F2Op& op, cudaStream_t stream) const = 0;
  virtual void launch(const LayerDesc& desc, const B1Op& op, cudaStream_t stream) const = 0;
  virtual void launch(const LayerDesc& desc, const B2Op& op, cudaStream_t stream) const = 0;
  virtual void launch(const LayerDesc& desc, const B3Op& op, cudaStream_t stream) const = 0;
  virtual void launch(const LayerDesc& desc, const B4Op& op, cudaStream_t stream) const = 0;

  // The dg partials B1 writes per routed row over all of h (B1Op::dg_part has this many rows);
  // the dg reduction sums them in index order.
  virtual int64_t b1_dg_parts(int64_t h) const = 0;
};

}  // namespace cuda
}  // namespace moeblaze
