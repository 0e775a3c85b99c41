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
// k = 1: F2 / B4 write y and dx directly (default), or through fp32 rows and the per-token
// reduction (false; the same bits). Read at backend creation from MOEBLAZE_CUDA_DIRECT_ROWS.
void experts_set_direct_rows(bool enabled);

}  // namespace cuda
}  // namespace moeblaze
