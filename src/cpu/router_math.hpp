// The router's per-token math, shared by the CPU backend's router (cpu/router.cpp) and the
// expert-parallel layer's loss shares on the CPU (ep/ep_ops_cpu.cpp): one definition, so the loss
// shares of an expert-parallel layer are computed with exactly the operations of the one-device
// router (the EP tests assert the resulting bitwise equalities). R is float or double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

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

}  // namespace cpu
}  // namespace moeblaze
