// The engines one pass may use, in order of preference, and what the orchestration (experts.cu)
// needs to know about all of them at once (workspace it carves for whichever engine runs).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/engines/engine.hpp"
#include "cuda/engines/portable/portable_engine.hpp"
#include "cuda/engines/sm90/sm90_engine.hpp"
#include "cuda/tuning.hpp"

namespace moeblaze {
namespace cuda {

// The Hopper engine (when tuning.sm90), the portable tensor-core engine (when `tensor_cores`: the
// caller has checked the pass's own operands, so every GEMM of a pass that leaves the Hopper
// engine runs on one portable engine), the SIMT engine (supports every op). pick() returns the
// first that supports the op.
class EngineSet {
 public:
  EngineSet(const CudaTuning& tuning, bool tensor_cores)
      : sm90_(tuning.sm90_forms),
        mma_(true, tuning.mma_warps),
        simt_(false, 0),
        use_sm90_(tuning.sm90),
        use_mma_(tensor_cores) {}

  template <typename Op>
  const GemmEngine& pick(const LayerDesc& desc, const Op& op) const {
    if (use_sm90_ && sm90_.supports(desc, op)) return sm90_;
    if (use_mma_ && mma_.supports(desc, op)) return mma_;
    return simt_;
  }

  template <typename Op>
  void launch(const LayerDesc& desc, const Op& op, cudaStream_t stream) const {
    pick(desc, op).launch(desc, op, stream);
  }

  // The most dg partials per row any engine writes over h (the workspace holds this many, so its
  // layout does not depend on which engine runs).
  static int64_t max_b1_dg_parts(int64_t h);
  // RoutedRows::tile_scratch's size in int32.
  static size_t tile_scratch_ints(int64_t N, int64_t E);
  // Once per device, outside any graph capture: every engine's kernel attributes and checks.
  static void prepare_device(int device);

 private:
  Sm90Engine sm90_;
  PortableEngine mma_;
  PortableEngine simt_;
  bool use_sm90_;
  bool use_mma_;
};

}  // namespace cuda
}  // namespace moeblaze
