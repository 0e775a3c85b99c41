// Expert MLP forward/backward of the CUDA backend (carve-then-run, as in kernels.hpp).
#pragma once

#include "common/backend.hpp"
#include "common/carver.hpp"

namespace moeblaze {
namespace cuda {

void experts_forward(const LayerDesc& desc, const ExpertsForwardCall& call, Carver& ws, bool run);
void experts_backward(const LayerDesc& desc, const ExpertsBackwardCall& call, Carver& ws, bool run);

}  // namespace cuda
}  // namespace moeblaze
