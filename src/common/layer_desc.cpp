#include "layer_desc.hpp"

#include <cmath>
#include <cstring>

#include "status.hpp"

namespace moeblaze {

const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::F32: return "F32";
    case Dtype::BF16: return "BF16";
    case Dtype::F16: return "F16";
    case Dtype::F64: return "F64";
  }
  return "?";
}

const char* activation_name(Activation act) {
  switch (act) {
// clang-format off
#define MOEBLAZE_ACTIVATION(Name, CODE, GATED, FN) \
  case Activation::Name: return #Name;
#include "common/activations.def"
    // clang-format on
  }
  return "?";
}

const char* checkpoint_name(Checkpoint policy) {
  switch (policy) {
    case Checkpoint::SaveAll: return "SAVE_ALL";
    case Checkpoint::SavePreact: return "SAVE_PREACT";
    case Checkpoint::Recompute: return "RECOMPUTE";
  }
  return "?";
}

const char* score_function_name(ScoreFunction fn) {
  switch (fn) {
    case ScoreFunction::SoftmaxTopk: return "SOFTMAX_TOPK";
    case ScoreFunction::TopkSoftmax: return "TOPK_SOFTMAX";
    case ScoreFunction::Sigmoid: return "SIGMOID";
  }
  return "?";
}

namespace {

// FNV-1a, 64-bit: stable across runs and builds of the same version.
class Fnv1a {
 public:
  template <typename T>
  void add(const T& value) {
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    for (unsigned char byte : bytes) {
      hash_ ^= byte;
      hash_ *= 1099511628211ull;
    }
  }
  uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = 14695981039346656037ull;
};

}  // namespace

uint64_t LayerDesc::hash() const {
  Fnv1a fnv;
  fnv.add(d);
  fnv.add(h);
  fnv.add(E);
  fnv.add(k);
  fnv.add(static_cast<int32_t>(dtype));
  fnv.add(static_cast<int32_t>(activation));
  fnv.add(static_cast<int32_t>(checkpoint));
  fnv.add(static_cast<int32_t>(score_function));
  fnv.add(static_cast<int32_t>(renormalize));
  fnv.add(aux_loss_coeff);
  fnv.add(z_loss_coeff);
  return fnv.value();
}

// Dimensions above this are rejected: they would overflow the 32-bit row indices the kernels use
// long before memory runs out, and no real layer comes near.
static constexpr int64_t kMaxDim = int64_t(1) << 20;

LayerDesc make_layer_desc(const moeblaze_layer_config_t& c) {
  MB_REQUIRE_ARG(c.dtype >= MOEBLAZE_DTYPE_F32 && c.dtype <= MOEBLAZE_DTYPE_F64,
                 "config.dtype = %d is not a moeblaze_dtype_code (F32 0, BF16 1, F16 2, F64 3)",
                 c.dtype);
  MB_REQUIRE_ARG(c.d_model > 0 && c.d_model <= kMaxDim,
                 "config.d_model = %lld must be in [1, %lld]", (long long)c.d_model,
                 (long long)kMaxDim);
  MB_REQUIRE_ARG(c.d_ffn > 0 && c.d_ffn <= kMaxDim, "config.d_ffn = %lld must be in [1, %lld]",
                 (long long)c.d_ffn, (long long)kMaxDim);
  MB_REQUIRE_ARG(c.num_experts > 0 && c.num_experts <= MOEBLAZE_MAX_EXPERTS,
                 "config.num_experts = %lld must be in [1, %d]", (long long)c.num_experts,
                 MOEBLAZE_MAX_EXPERTS);
  MB_REQUIRE_ARG(c.top_k > 0 && c.top_k <= c.num_experts && c.top_k <= MOEBLAZE_MAX_TOP_K,
                 "config.top_k = %lld must be in [1, min(num_experts = %lld, %d)]",
                 (long long)c.top_k, (long long)c.num_experts, MOEBLAZE_MAX_TOP_K);
  MB_REQUIRE_ARG(c.activation >= 0 && c.activation < kActivationCount,
                 "config.activation = %d is not a moeblaze_activation_code (0..%d)", c.activation,
                 kActivationCount - 1);
  MB_REQUIRE_ARG(
      c.checkpoint >= MOEBLAZE_CHECKPOINT_SAVE_ALL && c.checkpoint <= MOEBLAZE_CHECKPOINT_RECOMPUTE,
      "config.checkpoint = %d is not a moeblaze_checkpoint_code (0..2)", c.checkpoint);
  MB_REQUIRE_ARG(
      c.score_function >= MOEBLAZE_SCORE_SOFTMAX_TOPK && c.score_function <= MOEBLAZE_SCORE_SIGMOID,
      "config.score_function = %d is not a moeblaze_score_function_code (0..2)", c.score_function);
  MB_REQUIRE_ARG(c.renormalize == 0 || c.renormalize == 1, "config.renormalize = %d must be 0 or 1",
                 c.renormalize);
  MB_REQUIRE_ARG(std::isfinite(c.aux_loss_coeff) && c.aux_loss_coeff >= 0.0f,
                 "config.aux_loss_coeff = %g must be finite and >= 0", double(c.aux_loss_coeff));
  MB_REQUIRE_ARG(std::isfinite(c.z_loss_coeff) && c.z_loss_coeff >= 0.0f,
                 "config.z_loss_coeff = %g must be finite and >= 0", double(c.z_loss_coeff));
  MB_REQUIRE_ARG(c.deterministic == 0 || c.deterministic == 1,
                 "config.deterministic = %d must be 0 or 1", c.deterministic);
  MB_REQUIRE_ARG(c.reserved0 == 0, "config.reserved0 = %d must be 0", c.reserved0);

  LayerDesc desc;
  desc.d = c.d_model;
  desc.h = c.d_ffn;
  desc.E = c.num_experts;
  desc.k = c.top_k;
  desc.dtype = static_cast<Dtype>(c.dtype);
  desc.activation = static_cast<Activation>(c.activation);
  desc.checkpoint = static_cast<Checkpoint>(c.checkpoint);
  desc.score_function = static_cast<ScoreFunction>(c.score_function);
  desc.renormalize = c.renormalize != 0;
  desc.aux_loss_coeff = c.aux_loss_coeff;
  desc.z_loss_coeff = c.z_loss_coeff;
  desc.deterministic = c.deterministic != 0;
  return desc;
}

}  // namespace moeblaze
