// The router's per-token math, shared by the CPU backend's router (cpu/router.cpp) and its loss
// shares for expert parallelism (cpu/ep_ops.cpp): one definition, so the loss
// shares of an expert-parallel layer are computed with exactly the operations of the one-device
// router (the EP tests assert the resulting bitwise equalities). R is float or double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/status.hpp"

namespace moeblaze {
namespace cpu {

template <typename R>
R logsumexp(const R* logits, int64_t n) {
  R max_logit = logits[0];
  for (int64_t e = 1; e < n; ++e) max_logit = std::max(max_logit, logits[e]);
  R sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += std::exp(logits[e] - max_logit);
  return max_logit + std::log(sum);
}

// probs = softmax(logits) over n values; returns logsumexp(logits), bitwise equal to logsumexp().
template <typename R>
R softmax(const R* logits, int64_t n, R* probs) {
  R max_logit = logits[0];
  for (int64_t e = 1; e < n; ++e) max_logit = std::max(max_logit, logits[e]);
  R sum = 0;
  for (int64_t e = 0; e < n; ++e) {
    probs[e] = std::exp(logits[e] - max_logit);
    sum += probs[e];
  }
  for (int64_t e = 0; e < n; ++e) probs[e] /= sum;
  return max_logit + std::log(sum);
}

template <typename R>
R sigmoid(R x) {
  return R(1) / (R(1) + std::exp(-x));
}

// Below this largest logit of a token, sigmoid_scores() scales: sigmoid(-60) = 8.8e-27 is still a
// normal float, so the sums and quotients of unscaled scores neither underflow nor lose precision.
constexpr double kSigmoidScaleBelow = -60.0;

// The SIGMOID scores of one token, up to a common factor K > 0: scores[e] = sigmoid(logits[e]) * K.
// K = 1 (the plain sigmoid) when the largest logit m is at least kSigmoidScaleBelow; otherwise
// K = exp(-m), i.e. scores[e] = exp(logits[e] - m) / (1 + exp(logits[e])), whose largest value is
// about 1. Top-k, renormalised weights (scores[j] / sum over the picks) and the aux loss's
// normalised scores (scores[e] / sum over experts) do not depend on K, so they stay exact where the
// plain sigmoid of every logit underflows to 0 (all logits below about -88 in F32), which would
// make them 0/0. Returns true when it scaled. The CUDA router (cuda/router.cu) uses the same rule.
template <typename R>
bool sigmoid_scores(const R* logits, int64_t n, R* scores) {
  R max_logit = logits[0];
  for (int64_t e = 1; e < n; ++e) max_logit = std::max(max_logit, logits[e]);
  if (max_logit >= R(kSigmoidScaleBelow)) {
    for (int64_t e = 0; e < n; ++e) scores[e] = sigmoid(logits[e]);
    return false;
  }
  for (int64_t e = 0; e < n; ++e) {
    scores[e] = std::exp(logits[e] - max_logit) / (R(1) + std::exp(logits[e]));
  }
  return true;
}

// The z-loss term of token t, z_loss_coeff * logsumexp^2, must be representable in the routing
// dtype: logits near the dtype's largest magnitude overflow it (F32: |logsumexp| > 1.8e19 for a
// coefficient of 1). That is an error, not an Inf loss or gradient.
template <typename R>
void check_z_loss_term(float z_loss_coeff, R lse, int64_t t) {
  MB_REQUIRE(std::isfinite(R(z_loss_coeff) * lse * lse), MOEBLAZE_ERR_NON_FINITE,
             "logits[t=%lld]: logsumexp = %g, so the z-loss term z_loss_coeff * logsumexp^2 = "
             "%g * %g^2 overflows the routing dtype; scale the logits down or set z_loss_coeff "
             "to 0",
             (long long)t, double(lse), double(z_loss_coeff), double(lse));
}

}  // namespace cpu
}  // namespace moeblaze
