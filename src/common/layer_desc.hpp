// The validated, immutable description of one MoE layer that every backend receives.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moeblaze.h"

namespace moeblaze {

enum class Dtype : int32_t {
  F32 = MOEBLAZE_DTYPE_F32,
  BF16 = MOEBLAZE_DTYPE_BF16,
  F16 = MOEBLAZE_DTYPE_F16,
  F64 = MOEBLAZE_DTYPE_F64,
};

// The activations, generated from common/activations.def (the one list).
enum class Activation : int32_t {
// clang-format off
#define MOEBLAZE_ACTIVATION(Name, CODE, GATED, FN) Name = CODE,
#include "common/activations.def"
  // clang-format on
};

// Every activation in code order; kActivationCount codes 0 .. kActivationCount - 1 are valid.
constexpr Activation kActivations[] = {
// clang-format off
#define MOEBLAZE_ACTIVATION(Name, CODE, GATED, FN) Activation::Name,
#include "common/activations.def"
    // clang-format on
};
constexpr int32_t kActivationCount = int32_t(sizeof(kActivations) / sizeof(kActivations[0]));

// The list must hold every code once, in order, so that a code indexes kActivations and the
// validation of a config is one range test.
constexpr bool activation_codes_are_dense() {
  for (int32_t i = 0; i < kActivationCount; ++i)
    if (static_cast<int32_t>(kActivations[i]) != i) return false;
  return true;
}
static_assert(
    activation_codes_are_dense(),
    "common/activations.def must list the moeblaze_activation_codes 0, 1, 2, ... in order");

enum class Checkpoint : int32_t {
  SaveAll = MOEBLAZE_CHECKPOINT_SAVE_ALL,
  SavePreact = MOEBLAZE_CHECKPOINT_SAVE_PREACT,
  Recompute = MOEBLAZE_CHECKPOINT_RECOMPUTE,
};

enum class ScoreFunction : int32_t {
  SoftmaxTopk = MOEBLAZE_SCORE_SOFTMAX_TOPK,
  TopkSoftmax = MOEBLAZE_SCORE_TOPK_SOFTMAX,
  Sigmoid = MOEBLAZE_SCORE_SIGMOID,
};

enum class Pass : int32_t {
  RouterForward = MOEBLAZE_PASS_ROUTER_FORWARD,
  RouterBackward = MOEBLAZE_PASS_ROUTER_BACKWARD,
  RoutingBuild = MOEBLAZE_PASS_ROUTING_BUILD,
  ExpertsForward = MOEBLAZE_PASS_EXPERTS_FORWARD,
  ExpertsBackward = MOEBLAZE_PASS_EXPERTS_BACKWARD,
  LayerForward = MOEBLAZE_PASS_LAYER_FORWARD,
  LayerBackward = MOEBLAZE_PASS_LAYER_BACKWARD,
  // Internal passes (not in the public enum): the router projection of the whole-layer calls.
  RouterProjectForward = 100,
  RouterProjectBackward = 101,
};

// Gated activations (u = f(a) * b) have w_up and a second pre-activation b.
constexpr bool is_gated(Activation act) {
  switch (act) {
// clang-format off
#define MOEBLAZE_ACTIVATION(Name, CODE, GATED, FN) \
  case Activation::Name: return GATED;
#include "common/activations.def"
    // clang-format on
  }
  return false;
}

inline size_t dtype_size(Dtype dtype) {
  switch (dtype) {
    case Dtype::F32: return 4;
    case Dtype::BF16: return 2;
    case Dtype::F16: return 2;
    case Dtype::F64: return 8;
  }
  return 0;
}

// Logits, g, dg, d_logits and the losses: F64 for F64 layers, else F32.
inline Dtype routing_dtype(Dtype dtype) {
  return dtype == Dtype::F64 ? Dtype::F64 : Dtype::F32;
}

const char* dtype_name(Dtype dtype);
const char* activation_name(Activation act);
const char* checkpoint_name(Checkpoint policy);
const char* score_function_name(ScoreFunction fn);

struct LayerDesc {
  int64_t d = 0;  // d_model
  int64_t h = 0;  // d_ffn, expert hidden dim
  int64_t E = 0;  // num_experts
  int64_t k = 0;  // top_k
  Dtype dtype = Dtype::BF16;
  Activation activation = Activation::SwiGLU;
  Checkpoint checkpoint = Checkpoint::SavePreact;
  ScoreFunction score_function = ScoreFunction::SoftmaxTopk;
  bool renormalize = false;
  float aux_loss_coeff = 0.0f;
  float z_loss_coeff = 0.0f;
  bool deterministic = true;

  bool gated() const { return is_gated(activation); }
  size_t elem_size() const { return dtype_size(dtype); }
  Dtype rdtype() const { return routing_dtype(dtype); }
  size_t relem_size() const { return dtype_size(rdtype()); }
  // A stable hash of every field, stored in the saved buffer's header to catch misuse.
  uint64_t hash() const;
};

// Builds a LayerDesc from a (struct-size-checked) public config; throws moeblaze::Error naming the
// offending field when something is out of range.
LayerDesc make_layer_desc(const moeblaze_layer_config_t& config);

}  // namespace moeblaze
