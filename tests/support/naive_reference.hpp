// An independent, naive reference of the MoE layer in double precision: a per-token loop over the
// token's k experts, written from the formulas in moeblaze.h and sharing no code with the library.
// `storage_dtype` makes it round a, b and u to the storage dtype the way the numerics contract says
// (pass MOEBLAZE_DTYPE_F64 to keep everything in double).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "support/test_support.hpp"

namespace mbtest {
namespace naive {

inline double activation(int32_t act, double a, double b) {
  const double silu = a / (1.0 + std::exp(-a));
  const double gelu = 0.5 * a * (1.0 + std::erf(a / std::sqrt(2.0)));
  const double relu = a > 0 ? a : 0.0;
  switch (act) {
    case MOEBLAZE_ACTIVATION_SWIGLU: return silu * b;
    case MOEBLAZE_ACTIVATION_GEGLU: return gelu * b;
    case MOEBLAZE_ACTIVATION_REGLU: return relu * b;
    case MOEBLAZE_ACTIVATION_SILU: return silu;
    case MOEBLAZE_ACTIVATION_GELU: return gelu;
    case MOEBLAZE_ACTIVATION_RELU: return relu;
    case MOEBLAZE_ACTIVATION_RELU2: return relu * relu;
  }
  return NAN;
}

// y [T,d] of the experts given ids [T,k] and g [T,k].
inline std::vector<double> experts_forward(
    const moeblaze_layer_config_t& cfg, int64_t T, const std::vector<double>& x,
    const std::vector<int32_t>& ids, const std::vector<double>& g,
    const std::vector<double>& w_gate, const std::vector<double>& w_up,
    const std::vector<double>& w_down, int32_t storage_dtype) {
  const int64_t d = cfg.d_model, h = cfg.d_ffn, k = cfg.top_k;
  const bool gated = is_gated(cfg.activation);
  std::vector<double> y(size_t(T * d), 0.0);
  std::vector<double> u(static_cast<size_t>(h));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[size_t(t * k + j)];
      for (int64_t i = 0; i < h; ++i) {
        double a = 0, b = 0;
        for (int64_t c = 0; c < d; ++c) {
          a += x[size_t(t * d + c)] * w_gate[size_t((e * h + i) * d + c)];
          if (gated) b += x[size_t(t * d + c)] * w_up[size_t((e * h + i) * d + c)];
        }
        a = round_to(storage_dtype, a);
        b = round_to(storage_dtype, b);
        u[size_t(i)] = round_to(storage_dtype, activation(cfg.activation, a, b));
      }
      for (int64_t c = 0; c < d; ++c) {
        double y2 = 0;
        for (int64_t i = 0; i < h; ++i) y2 += u[size_t(i)] * w_down[size_t((e * d + c) * h + i)];
        y[size_t(t * d + c)] += g[size_t(t * k + j)] * y2;
      }
    }
  }
  return y;
}

// d act / d a and d act / d b (0 for non-gated activations).
inline void activation_grad(int32_t act, double a, double b, double* d_a, double* d_b) {
  const double sig = 1.0 / (1.0 + std::exp(-a));
  const double silu = a * sig, silu_grad = sig * (1.0 + a * (1.0 - sig));
  const double cdf = 0.5 * (1.0 + std::erf(a / std::sqrt(2.0)));
  const double gelu = a * cdf, gelu_grad = cdf + a * std::exp(-0.5 * a * a) / std::sqrt(2.0 * M_PI);
  const double relu = a > 0 ? a : 0.0, relu_grad = a > 0 ? 1.0 : 0.0;
  *d_b = 0;
  switch (act) {
    case MOEBLAZE_ACTIVATION_SWIGLU:
      *d_a = silu_grad * b;
      *d_b = silu;
      return;
    case MOEBLAZE_ACTIVATION_GEGLU:
      *d_a = gelu_grad * b;
      *d_b = gelu;
      return;
    case MOEBLAZE_ACTIVATION_REGLU:
      *d_a = relu_grad * b;
      *d_b = relu;
      return;
    case MOEBLAZE_ACTIVATION_SILU: *d_a = silu_grad; return;
    case MOEBLAZE_ACTIVATION_GELU: *d_a = gelu_grad; return;
    case MOEBLAZE_ACTIVATION_RELU: *d_a = relu_grad; return;
    case MOEBLAZE_ACTIVATION_RELU2: *d_a = 2.0 * relu; return;
  }
}

struct ExpertsGradients {
  std::vector<double> dx, dw_gate, dw_up, dw_down, dg;
};

// Backward of experts_forward() for the loss sum(dy * y), by the chain rule, per token and expert.
// Mirrors the contract's roundings: a, b, u and da, db are rounded to `storage_dtype`.
inline ExpertsGradients experts_backward(
    const moeblaze_layer_config_t& cfg, int64_t T, const std::vector<double>& x,
    const std::vector<int32_t>& ids, const std::vector<double>& g,
    const std::vector<double>& w_gate, const std::vector<double>& w_up,
    const std::vector<double>& w_down, const std::vector<double>& dy, int32_t storage_dtype) {
  const int64_t d = cfg.d_model, h = cfg.d_ffn, k = cfg.top_k, E = cfg.num_experts;
  const bool gated = is_gated(cfg.activation);
  ExpertsGradients out;
  out.dx.assign(static_cast<size_t>(T * d), 0.0);
  out.dw_gate.assign(static_cast<size_t>(E * h * d), 0.0);
  out.dw_up.assign(static_cast<size_t>(E * h * d), 0.0);
  out.dw_down.assign(static_cast<size_t>(E * d * h), 0.0);
  out.dg.assign(static_cast<size_t>(T * k), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[size_t(t * k + j)];
      const double gate_weight = g[size_t(t * k + j)];
      for (int64_t i = 0; i < h; ++i) {
        double a = 0, b = 0;
        for (int64_t c = 0; c < d; ++c) {
          a += x[size_t(t * d + c)] * w_gate[size_t((e * h + i) * d + c)];
          if (gated) b += x[size_t(t * d + c)] * w_up[size_t((e * h + i) * d + c)];
        }
        a = round_to(storage_dtype, a);
        b = round_to(storage_dtype, b);
        const double u = round_to(storage_dtype, activation(cfg.activation, a, b));
        double v = 0;  // dLoss/dy2 . w_down column i, without g
        for (int64_t c = 0; c < d; ++c)
          v += dy[size_t(t * d + c)] * w_down[size_t((e * d + c) * h + i)];
        out.dg[size_t(t * k + j)] += v * u;
        double d_a = 0, d_b = 0;
        activation_grad(cfg.activation, a, b, &d_a, &d_b);
        const double da = round_to(storage_dtype, gate_weight * v * d_a);
        const double db = round_to(storage_dtype, gate_weight * v * d_b);
        for (int64_t c = 0; c < d; ++c) {
          out.dw_down[size_t((e * d + c) * h + i)] += gate_weight * dy[size_t(t * d + c)] * u;
          out.dw_gate[size_t((e * h + i) * d + c)] += da * x[size_t(t * d + c)];
          out.dx[size_t(t * d + c)] += da * w_gate[size_t((e * h + i) * d + c)];
          if (gated) {
            out.dw_up[size_t((e * h + i) * d + c)] += db * x[size_t(t * d + c)];
            out.dx[size_t(t * d + c)] += db * w_up[size_t((e * h + i) * d + c)];
          }
        }
      }
    }
  }
  return out;
}

struct RouterResult {
  std::vector<int32_t> ids;     // [T,k]
  std::vector<double> g;        // [T,k]
  std::vector<int32_t> counts;  // [E]
  double aux_loss = 0;
  double z_loss = 0;
};

// Routing from logits [T,E], as documented for moeblaze_router_forward().
inline RouterResult router_forward(const moeblaze_layer_config_t& cfg, int64_t T,
                                   const std::vector<double>& logits) {
  const int64_t E = cfg.num_experts, k = cfg.top_k;
  RouterResult out;
  out.ids.resize(size_t(T * k));
  out.g.resize(size_t(T * k));
  out.counts.assign(size_t(E), 0);
  std::vector<double> mean_balance(size_t(E), 0.0);
  double z_sum = 0;
  for (int64_t t = 0; t < T; ++t) {
    const double* l = &logits[size_t(t * E)];
    double max_logit = l[0];
    for (int64_t e = 1; e < E; ++e) max_logit = std::max(max_logit, l[e]);
    double sum_exp = 0;
    for (int64_t e = 0; e < E; ++e) sum_exp += std::exp(l[e] - max_logit);
    const double lse = max_logit + std::log(sum_exp);
    std::vector<double> softmax(static_cast<size_t>(E)), sigmoid(static_cast<size_t>(E)),
        score(static_cast<size_t>(E));
    double sigmoid_sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      softmax[size_t(e)] = std::exp(l[e] - lse);
      sigmoid[size_t(e)] = 1.0 / (1.0 + std::exp(-l[e]));
      sigmoid_sum += sigmoid[size_t(e)];
    }
    switch (cfg.score_function) {
      case MOEBLAZE_SCORE_SOFTMAX_TOPK: score = softmax; break;
      case MOEBLAZE_SCORE_TOPK_SOFTMAX: score.assign(l, l + E); break;
      case MOEBLAZE_SCORE_SIGMOID: score = sigmoid; break;
    }
    // Top-k: stable sort by descending score keeps the lower id first among equal scores.
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) order[size_t(e)] = int32_t(e);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t p, int32_t q) { return score[size_t(p)] > score[size_t(q)]; });
    double picked_sum = 0, picked_exp_sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = order[size_t(j)];
      out.ids[size_t(t * k + j)] = e;
      ++out.counts[size_t(e)];
      picked_sum += score[size_t(e)];
      picked_exp_sum += std::exp(l[e] - l[order[0]]);
    }
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = order[size_t(j)];
      double weight = score[size_t(e)];
      if (cfg.score_function == MOEBLAZE_SCORE_TOPK_SOFTMAX) {
        weight = std::exp(l[e] - l[order[0]]) / picked_exp_sum;
      } else if (cfg.renormalize) {
        weight /= picked_sum;
      }
      out.g[size_t(t * k + j)] = weight;
    }
    for (int64_t e = 0; e < E; ++e) {
      mean_balance[size_t(e)] += cfg.score_function == MOEBLAZE_SCORE_SIGMOID
                                     ? sigmoid[size_t(e)] / sigmoid_sum
                                     : softmax[size_t(e)];
    }
    z_sum += lse * lse;
  }
  if (T > 0) {
    double total = 0;
    for (int64_t e = 0; e < E; ++e) {
      total +=
          double(out.counts[size_t(e)]) / double(T * k) * (mean_balance[size_t(e)] / double(T));
    }
    out.aux_loss = double(cfg.aux_loss_coeff) * double(E) * total;
    out.z_loss = double(cfg.z_loss_coeff) * z_sum / double(T);
  }
  return out;
}

// logits [T,E] = x [T,d] . w_router [E,d]^T
inline std::vector<double> router_logits(const moeblaze_layer_config_t& cfg, int64_t T,
                                         const std::vector<double>& x,
                                         const std::vector<double>& w_router) {
  const int64_t d = cfg.d_model, E = cfg.num_experts;
  std::vector<double> logits(size_t(T * E), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      double sum = 0;
      for (int64_t c = 0; c < d; ++c) sum += x[size_t(t * d + c)] * w_router[size_t(e * d + c)];
      logits[size_t(t * E + e)] = sum;
    }
  }
  return logits;
}

}  // namespace naive
}  // namespace mbtest
