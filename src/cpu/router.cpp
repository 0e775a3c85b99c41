// Router: score function, top-k (ties to the lower expert id), renormalisation, per-expert counts,
// the load-balancing (aux) and z losses, and the gradient of all of it with respect to the logits.
// Everything is computed in the routing type R (float, or double for F64 layers).
#include <cmath>
#include <limits>

#include "cpu/cpu_kernels.hpp"
#include "cpu/router_math.hpp"

namespace moeblaze {
namespace cpu {

RouterForwardScratch carve_router_forward_scratch(Carver& carver, const LayerDesc& desc,
                                                  int64_t T) {
  const size_t row_bytes = desc.relem_size() * size_t(desc.E);
  RouterForwardScratch scratch;
  scratch.scores = carver.carve(row_bytes * size_t(T));
  scratch.balance_scores = carver.carve(row_bytes * size_t(T));
  scratch.lse = carver.carve(desc.relem_size() * size_t(T));
  scratch.counts = carver.carve<int32_t>(sizeof(int32_t) * size_t(desc.E));
  return scratch;
}

RouterBackwardScratch carve_router_backward_scratch(Carver& carver, const LayerDesc& desc,
                                                    int64_t T) {
  RouterBackwardScratch scratch;
  scratch.probs = carver.carve(desc.relem_size() * size_t(desc.E) * size_t(T));
  scratch.counts = carver.carve<int32_t>(sizeof(int32_t) * size_t(desc.E));
  return scratch;
}

namespace {

template <typename R>
void check_finite_logits(const R* logits, int64_t T, int64_t E) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const R value = logits[t * E + e];
      MB_REQUIRE(std::isfinite(value), MOEBLAZE_ERR_NON_FINITE,
                 "logits[t=%lld, e=%lld] = %g is not finite", (long long)t, (long long)e,
                 double(value));
    }
  }
}

// The k largest scores in descending order; among equal scores the lower expert id comes first.
// `scores` is used as scratch: picked entries become NaN.
template <typename R>
void top_k(R* scores, int64_t E, int64_t k, int32_t* ids) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (std::isnan(scores[e])) continue;
      if (best < 0 || scores[e] > scores[best]) best = e;
    }
    ids[j] = int32_t(best);
    scores[best] = std::numeric_limits<R>::quiet_NaN();
  }
}

// The routing weights of one token from its logits and its selected ids. `probs` receives the
// softmax (SOFTMAX_TOPK, TOPK_SOFTMAX) or the sigmoid_scores() (SIGMOID: sigmoid up to a common
// factor) of all E experts. Returns the renormalisation denominator S (1 when there is none).
template <typename R>
R routing_weights(const LayerDesc& desc, const R* logits, const int32_t* ids, R* probs, R* g) {
  const int64_t E = desc.E;
  const int64_t k = desc.k;
  switch (desc.score_function) {
    case ScoreFunction::SoftmaxTopk: softmax(logits, E, probs); break;
    case ScoreFunction::Sigmoid:
      if (sigmoid_scores(logits, E, probs) && !desc.renormalize) {
        // Scaled scores: the weights are the plain sigmoid (tiny or 0, as exact as R allows).
        for (int64_t j = 0; j < k; ++j) g[j] = sigmoid(logits[ids[j]]);
        return R(1);
      }
      break;
    case ScoreFunction::TopkSoftmax: {
      softmax(logits, E, probs);
      // Softmax over the selected logits; ids[0] holds the largest.
      const R max_logit = logits[ids[0]];
      R sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        g[j] = std::exp(logits[ids[j]] - max_logit);
        sum += g[j];
      }
      for (int64_t j = 0; j < k; ++j) g[j] /= sum;
      return R(1);
    }
  }
  for (int64_t j = 0; j < k; ++j) g[j] = probs[ids[j]];
  if (!desc.renormalize) return R(1);
  R sum = 0;
  for (int64_t j = 0; j < k; ++j) sum += g[j];
  for (int64_t j = 0; j < k; ++j) g[j] /= sum;
  return sum;
}

void count_experts(const int32_t* ids, int64_t T, const LayerDesc& desc, int32_t* counts) {
  std::fill(counts, counts + desc.E, 0);
  for (int64_t i = 0; i < T * desc.k; ++i) {
    const int32_t e = ids[i];
    MB_REQUIRE_ARG(e >= 0 && e < desc.E, "ids[t=%lld, j=%lld] = %d is out of range [0, E=%lld)",
                   (long long)(i / desc.k), (long long)(i % desc.k), int(e), (long long)desc.E);
    ++counts[e];
  }
}

template <typename R>
void router_forward_typed(const LayerDesc& desc, const RouterForwardCall& call, ThreadPool& pool) {
  const int64_t T = call.T;
  const int64_t E = desc.E;
  const int64_t k = desc.k;
  const R* logits = static_cast<const R*>(call.logits);  // [T, E]
  R* g = static_cast<R*>(call.g);                        // [T, k]
  Carver carver(call.workspace.ptr);
  const RouterForwardScratch scratch = carve_router_forward_scratch(carver, desc, T);
  R* scores = static_cast<R*>(scratch.scores);                  // [T, E]
  R* balance_scores = static_cast<R*>(scratch.balance_scores);  // [T, E]
  R* lse = static_cast<R*>(scratch.lse);                        // [T]

  check_finite_logits(logits, T, E);

  pool.parallel_for(T, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const R* row = logits + t * E;
      R* score_row = scores + t * E;
      R* balance_row = balance_scores + t * E;
      lse[t] = softmax(row, E, balance_row);
      if (desc.score_function == ScoreFunction::Sigmoid) {
        // Aux loss uses sigmoid scores normalised over the experts (any common factor cancels).
        sigmoid_scores(row, E, score_row);
        R sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += score_row[e];
        for (int64_t e = 0; e < E; ++e) balance_row[e] = score_row[e] / sum;
      } else if (desc.score_function == ScoreFunction::SoftmaxTopk) {
        std::copy(balance_row, balance_row + E, score_row);
      } else {
        std::copy(row, row + E, score_row);
      }
      top_k(score_row, E, k, call.ids + t * k);
      routing_weights(desc, row, call.ids + t * k, score_row, g + t * k);
    }
  });

  int32_t* counts = call.expert_counts ? call.expert_counts : scratch.counts;
  count_experts(call.ids, T, desc, counts);

  if (call.losses) {
    R* losses = static_cast<R*>(call.losses);
    losses[0] = 0;
    losses[1] = 0;
    if (T > 0 && desc.aux_loss_coeff != 0.0f) {
      // sum_e f_e * P_e with P_e = mean_t balance[t, e]; each P_e sums tokens in ascending order.
      R total = 0;
      for (int64_t e = 0; e < E; ++e) {
        R mean_score = 0;
        for (int64_t t = 0; t < T; ++t) mean_score += balance_scores[t * E + e];
        mean_score /= R(T);
        total += (R(counts[e]) / R(T * k)) * mean_score;
      }
      losses[0] = R(desc.aux_loss_coeff) * R(E) * total;
    }
    if (T > 0 && desc.z_loss_coeff != 0.0f) {
      R total = 0;
      for (int64_t t = 0; t < T; ++t) {
        check_z_loss_term(desc.z_loss_coeff, lse[t], t);
        total += lse[t] * lse[t];
      }
      losses[1] = R(desc.z_loss_coeff) * total / R(T);
      MB_REQUIRE(std::isfinite(losses[1]), MOEBLAZE_ERR_NON_FINITE,
                 "losses[1]: the z-loss z_loss_coeff * mean_t logsumexp(logits[t])^2 overflows "
                 "the routing dtype (the sum of the squares does); scale the logits down or set "
                 "z_loss_coeff to 0");
    }
    MB_REQUIRE(std::isfinite(losses[0]), MOEBLAZE_ERR_NON_FINITE,
               "losses[0]: the aux loss overflows the routing dtype (aux_loss_coeff = %g is too "
               "large)",
               double(desc.aux_loss_coeff));
  }
}

template <typename R>
void router_backward_typed(const LayerDesc& desc, const RouterBackwardCall& call,
                           ThreadPool& pool) {
  const int64_t T = call.T;
  const int64_t E = desc.E;
  const int64_t k = desc.k;
  const R* logits = static_cast<const R*>(call.logits);  // [T, E]
  const int32_t* ids = call.ids;                         // [T, k]
  const R* dg = static_cast<const R*>(call.dg);          // [T, k]
  R* d_logits = static_cast<R*>(call.d_logits);          // [T, E]
  const R* d_losses = static_cast<const R*>(call.d_losses);
  const R d_aux = d_losses ? d_losses[0] : R(1);
  const R d_z = d_losses ? d_losses[1] : R(1);

  Carver carver(call.workspace.ptr);
  const RouterBackwardScratch scratch = carve_router_backward_scratch(carver, desc, T);
  R* probs_all = static_cast<R*>(scratch.probs);  // [T, E]

  check_finite_logits(logits, T, E);
  count_experts(ids, T, desc, scratch.counts);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      for (int64_t i = 0; i < j; ++i) {
        MB_REQUIRE_ARG(ids[t * k + i] != ids[t * k + j],
                       "ids[t=%lld, j=%lld] = %d repeats ids[t=%lld, j=%lld]", (long long)t,
                       (long long)j, int(ids[t * k + j]), (long long)t, (long long)i);
      }
    }
  }
  const bool with_aux = T > 0 && desc.aux_loss_coeff != 0.0f;
  const bool with_z = T > 0 && desc.z_loss_coeff != 0.0f;
  if (with_z) {  // before the threads, so that the first failing token is the one reported
    for (int64_t t = 0; t < T; ++t)
      check_z_loss_term(desc.z_loss_coeff, logsumexp(logits + t * E, E), t);
  }

  pool.parallel_for(T, [&](int64_t begin, int64_t end) {
    R g[MOEBLAZE_MAX_TOP_K];
    R d_score[MOEBLAZE_MAX_TOP_K];  // dLoss/d(score of the j-th pick)
    for (int64_t t = begin; t < end; ++t) {
      const R* row = logits + t * E;
      const int32_t* token_ids = ids + t * k;
      const R* token_dg = dg + t * k;
      R* probs = probs_all + t * E;
      R* out = d_logits + t * E;
      std::fill(out, out + E, R(0));

      const R denominator = routing_weights(desc, row, token_ids, probs, g);
      // <g, dg>: the renormalisation (and the selected-softmax) couples the k picks through it.
      R g_dot_dg = 0;
      for (int64_t j = 0; j < k; ++j) g_dot_dg += g[j] * token_dg[j];

      switch (desc.score_function) {
        case ScoreFunction::TopkSoftmax:
          for (int64_t j = 0; j < k; ++j) out[token_ids[j]] = g[j] * (token_dg[j] - g_dot_dg);
          break;
        case ScoreFunction::SoftmaxTopk:
        case ScoreFunction::Sigmoid: {
          for (int64_t j = 0; j < k; ++j) {
            d_score[j] = desc.renormalize ? (token_dg[j] - g_dot_dg) / denominator : token_dg[j];
          }
          if (desc.score_function == ScoreFunction::Sigmoid) {
            // dg/dlogit: renormalised, the scores' common factor cancels (probs may be scaled);
            // otherwise g is the plain sigmoid s, with ds/dlogit = s (1 - s).
            for (int64_t j = 0; j < k; ++j) {
              const R s = sigmoid(row[token_ids[j]]);
              const R score = desc.renormalize ? probs[token_ids[j]] : s;
              out[token_ids[j]] = d_score[j] * score * (R(1) - s);
            }
          } else {
            // Softmax Jacobian: d_logits = p * (dp - <p, dp>), dp nonzero on the picks only.
            R p_dot_dp = 0;
            for (int64_t j = 0; j < k; ++j) p_dot_dp += probs[token_ids[j]] * d_score[j];
            for (int64_t e = 0; e < E; ++e) out[e] = -probs[e] * p_dot_dp;
            for (int64_t j = 0; j < k; ++j) {
              out[token_ids[j]] += probs[token_ids[j]] * d_score[j];
            }
          }
          break;
        }
      }

      if (with_aux) {
        // losses[0] = c * E * sum_e f_e * mean_t q[t, e]: dLoss/dq[t, e] = d_aux * c * E * f_e / T.
        const R scale = d_aux * R(desc.aux_loss_coeff) * R(E) / (R(T) * R(T * k));
        if (desc.score_function == ScoreFunction::Sigmoid) {
          // q = s / sum(s): dq_e/ds_i = (delta_ei - q_e) / sum(s); then ds/dlogit = s (1 - s).
          // probs holds the scores up to a common factor, which cancels in q and in this product.
          R sum = 0;
          for (int64_t e = 0; e < E; ++e) sum += probs[e];
          R q_dot_w = 0;
          for (int64_t e = 0; e < E; ++e) {
            q_dot_w += (probs[e] / sum) * (scale * R(scratch.counts[e]));
          }
          for (int64_t e = 0; e < E; ++e) {
            const R w = scale * R(scratch.counts[e]);
            out[e] += (w - q_dot_w) / sum * probs[e] * (R(1) - sigmoid(row[e]));
          }
        } else {
          // Softmax score functions: q = softmax(logits), which routing_weights left in probs.
          R q_dot_w = 0;
          for (int64_t e = 0; e < E; ++e) q_dot_w += probs[e] * (scale * R(scratch.counts[e]));
          for (int64_t e = 0; e < E; ++e) {
            out[e] += probs[e] * (scale * R(scratch.counts[e]) - q_dot_w);
          }
        }
      }

      if (with_z) {
        // losses[1] = c * mean_t lse_t^2: dLoss/dlogit[t, e] = d_z * c * 2 * lse_t * softmax_e / T.
        // probs holds the softmax already, except for SIGMOID (the aux term above is done with it).
        const R lse = desc.score_function == ScoreFunction::Sigmoid ? softmax(row, E, probs)
                                                                    : logsumexp(row, E);
        const R scale = d_z * R(desc.z_loss_coeff) * R(2) * lse / R(T);
        for (int64_t e = 0; e < E; ++e) out[e] += scale * probs[e];
      }
    }
  });
}

}  // namespace

void router_forward(const LayerDesc& desc, const RouterForwardCall& call, ThreadPool& pool) {
  dispatch_routing(desc.dtype, [&](auto tag) {
    using R = decltype(tag);
    router_forward_typed<R>(desc, call, pool);
  });
}

void router_backward(const LayerDesc& desc, const RouterBackwardCall& call, ThreadPool& pool) {
  dispatch_routing(desc.dtype, [&](auto tag) {
    using R = decltype(tag);
    router_backward_typed<R>(desc, call, pool);
  });
}

}  // namespace cpu
}  // namespace moeblaze
