// Expert MLP forward/backward of the CUDA backend (carve-then-run, as in kernels.hpp): run = false
// only carves the workspace regions (the size query), run = true carves the same regions and
// enqueues the kernels. `tuning` is the backend's (tuning.hpp); the size query and the call it
// sizes must see the same one, which a backend's never-changing tuning guarantees.
#pragma once

#include "common/backend.hpp"
#include "common/carver.hpp"
#include "cuda/tuning.hpp"

namespace moeblaze {
namespace cuda {

void experts_forward(const LayerDesc& desc, const ExpertsForwardCall& call, Carver& ws, bool run,
                     const CudaTuning& tuning);
void experts_backward(const LayerDesc& desc, const ExpertsBackwardCall& call, Carver& ws, bool run,
                      const CudaTuning& tuning);

}  // namespace cuda
}  // namespace moeblaze
