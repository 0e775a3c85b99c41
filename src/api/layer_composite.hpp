// The experts and whole-layer execute calls: argument validation, carving of the saved buffer and
// the workspace, and the composition of the whole layer from backend operations (router projection
// -> router -> experts, and the reverse).
#pragma once

#include "api/layer_state.hpp"

namespace moeblaze {
namespace api {

// `flags`: for a backward pass the MOEBLAZE_BACKWARD_* flags the call will be made with, for a
// forward pass MOEBLAZE_FORWARD_WITH_SAVED if it will be given a saved buffer (else 0).
size_t workspace_size_for(const LayerState& layer, Pass pass, int64_t T, uint32_t flags);

// pass: Pass::ExpertsForward or Pass::LayerForward.
void run_forward(LayerState& layer, const moeblaze_forward_args_t& args, Pass pass, void* stream);
// pass: Pass::ExpertsBackward or Pass::LayerBackward.
void run_backward(LayerState& layer, const moeblaze_backward_args_t& args, Pass pass, void* stream);

}  // namespace api
}  // namespace moeblaze
