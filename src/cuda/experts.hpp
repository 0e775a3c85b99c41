// Expert MLP forward/backward of the CUDA backend (carve-then-run, as in kernels.hpp).
#pragma once

#include "common/backend.hpp"
#include "common/carver.hpp"

namespace moeblaze {
namespace cuda {

void experts_forward(const LayerDesc& desc, const ExpertsForwardCall& call, Carver& ws, bool run);
void experts_backward(const LayerDesc& desc, const ExpertsBackwardCall& call, Carver& ws, bool run);

// The number of column chunks of h that B1 and B2 run in (0: experts.cu's policy). A tuning and
// test switch: set once at backend creation (MOEBLAZE_CUDA_GU_CHUNKS), never between a workspace
// query and the call it sizes.
void experts_set_gu_chunks(int chunks);

}  // namespace cuda
}  // namespace moeblaze
