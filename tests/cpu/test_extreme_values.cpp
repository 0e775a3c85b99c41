// Finite inputs at the edges of the routing dtype: the router either computes the exact values or
// returns MOEBLAZE_ERR_NON_FINITE; it never returns NaN or Inf with MOEBLAZE_OK.
//  - SIGMOID scores of logits so negative that every sigmoid underflows to 0 (<= -89 in F32,
//    <= -746 in F64): the top-k, the renormalised weights, the aux loss and every gradient must be
//    the exact (finite) values, not 0/0.
//  - the z-loss of logits near the largest finite value: its square is not representable, which
//    is reported, not returned as Inf.
// And a NaN in a token's input reaches that token's output under every activation (ReLU's
// `a > 0 ? a : 0` turned it into 0).
#include <cfloat>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "support/test_support.hpp"

using namespace mbtest;

namespace {

// log(sigmoid(l)) in double, exact for every finite l.
double log_sigmoid(double l) {
  return l < 0 ? l - std::log1p(std::exp(l)) : -std::log1p(std::exp(-l));
}

struct RouterResult {
  moeblaze_status_t forward = MOEBLAZE_OK, backward = MOEBLAZE_OK;
  std::string forward_error, backward_error;
  std::vector<int32_t> ids;
  HostTensor g, losses, d_logits;
};

RouterResult run_router(const Layer& layer, int64_t T, const HostTensor& logits,
                        const HostTensor& dg, bool with_losses) {
  const moeblaze_layer_config_t& c = layer.config();
  const int32_t rdtype = routing_dtype(c.dtype);
  RouterResult r;
  r.ids.assign(size_t(T * c.top_k), -1);
  r.g.reset(rdtype, {T, c.top_k});
  r.losses.reset(rdtype, {2});
  r.d_logits.reset(rdtype, {T, c.num_experts});
  r.g.fill(NAN);
  r.losses.fill(NAN);
  r.d_logits.fill(NAN);
  AlignedBytes ws(std::max(layer.workspace_size(MOEBLAZE_PASS_ROUTER_FORWARD, T),
                           layer.workspace_size(MOEBLAZE_PASS_ROUTER_BACKWARD, T)));
  r.forward = moeblaze_router_forward(layer.get(), T, logits.data(), r.ids.data(), r.g.data(),
                                      nullptr, with_losses ? r.losses.data() : nullptr, ws.data(),
                                      ws.size(), nullptr);
  r.forward_error = moeblaze_last_error();
  if (r.forward != MOEBLAZE_OK) return r;
  r.backward = moeblaze_router_backward(layer.get(), T, logits.data(), r.ids.data(), dg.data(),
                                        nullptr, r.d_logits.data(), ws.data(), ws.size(), nullptr);
  r.backward_error = moeblaze_last_error();
  return r;
}

bool all_finite(const HostTensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (!std::isfinite(t.get(i))) return false;
  }
  return true;
}

}  // namespace

TEST_SUITE("cpu") {
  TEST_CASE("extreme values: SIGMOID with every sigmoid underflowing stays exact") {
    Context context;
    const int64_t E = 6, k = 2, T = 5;
    for (int32_t dtype : {MOEBLAZE_DTYPE_F32, MOEBLAZE_DTYPE_F64}) {
      for (int32_t renormalize : {1, 0}) {
        CAPTURE(dtype);
        CAPTURE(renormalize);
        // Below the dtype's sigmoid underflow (F32: -88.7; F64: -745), and one ordinary token.
        const double u = dtype == MOEBLAZE_DTYPE_F32 ? -89.0 : -746.0;
        const double big = dtype == MOEBLAZE_DTYPE_F32 ? 3.0e38 : 1.0e308;
        const std::vector<double> rows = {
            u - 11, u - 1, u - 6,  u - 31, u - 0.5, u - 111,  // every logit <= u
            -1000,  -1000, -1000,  -1000,  -1000,   -1000,    // ties: the lower ids
            -big,   -1e30, u,      u,      u - 400, -1e5,     // down to -FLT_MAX
            -0.7,   2.0,   0.25,   -3.0,   1.5,     0.0,      // the ordinary case
            u - 20, -big,  u - 20, -big,   -big,    -big,     // two equal picks among -max
        };
        moeblaze_layer_config_t cfg = make_config(dtype, 8, 8, E, k);
        cfg.score_function = MOEBLAZE_SCORE_SIGMOID;
        cfg.renormalize = renormalize;
        Layer layer(context, cfg);
        const int32_t rdtype = routing_dtype(dtype);
        HostTensor logits(rdtype, {T, E}), dg(rdtype, {T, k});
        logits.from_vector(rows);
        for (int64_t i = 0; i < T * k; ++i) dg.set(i, 0.3 + 0.1 * double(i % 5) - 0.2 * (i % 2));
        const RouterResult r = run_router(layer, T, logits, dg, false);
        MB_CHECK(r.forward);
        MB_CHECK(r.backward);
        CHECK(all_finite(r.g));
        CHECK(all_finite(r.d_logits));

        for (int64_t t = 0; t < T; ++t) {
          CAPTURE(t);
          // Reference in double: top-k of the logits (sigmoid is monotonic; ties to the lower
          // id), weights sigmoid or sigmoid / sum over the picks, from log-sigmoids.
          std::vector<int32_t> order(E);
          for (int64_t e = 0; e < E; ++e) order[size_t(e)] = int32_t(e);
          std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
            return rows[size_t(t * E + a)] > rows[size_t(t * E + b)];
          });
          double top_ls = log_sigmoid(rows[size_t(t * E + order[0])]);
          double sum = 0;
          for (int64_t j = 0; j < k; ++j) {
            sum += std::exp(log_sigmoid(rows[size_t(t * E + order[size_t(j)])]) - top_ls);
          }
          std::vector<double> g_ref(k), s(k);
          for (int64_t j = 0; j < k; ++j) {
            const double l = rows[size_t(t * E + order[size_t(j)])];
            s[size_t(j)] = std::exp(log_sigmoid(l));
            g_ref[size_t(j)] = renormalize ? std::exp(log_sigmoid(l) - top_ls) / sum : s[size_t(j)];
          }
          for (int64_t j = 0; j < k; ++j) {
            CHECK(r.ids[size_t(t * k + j)] == order[size_t(j)]);
            const double got = r.g.get(t * k + j);
            const double want = round_to(rdtype, g_ref[size_t(j)]);
            // Weights below the smallest normal number may flush to 0.
            const double tiny = dtype == MOEBLAZE_DTYPE_F32 ? double(FLT_MIN) : DBL_MIN;
            CHECK_MESSAGE(std::fabs(got - want) <= 1e-6 * std::fabs(want) + tiny,
                          "g[" << t << "," << j << "] = " << got << ", expected " << want);
          }
          // d_logits of the picks: (1 - s_i) g_i (dg_i - <g, dg>) renormalised, dg_i s_i (1 - s_i)
          // otherwise; 0 elsewhere.
          double g_dot_dg = 0;
          for (int64_t j = 0; j < k; ++j) g_dot_dg += g_ref[size_t(j)] * dg.get(t * k + j);
          for (int64_t e = 0; e < E; ++e) {
            double want = 0;
            for (int64_t j = 0; j < k; ++j) {
              if (order[size_t(j)] != e) continue;
              const double dgj = dg.get(t * k + j);
              want = renormalize ? (1 - s[size_t(j)]) * g_ref[size_t(j)] * (dgj - g_dot_dg)
                                 : dgj * s[size_t(j)] * (1 - s[size_t(j)]);
            }
            const double got = r.d_logits.get(t * E + e);
            CHECK_MESSAGE(std::fabs(got - want) <= 1e-5 * std::fabs(want) + 1e-7,
                          "d_logits[" << t << "," << e << "] = " << got << ", expected " << want);
          }
        }
      }
    }
  }

  TEST_CASE("extreme values: SIGMOID aux loss with underflowing sigmoids is finite") {
    Context context;
    const int64_t E = 4, k = 2, T = 3;
    moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 8, 8, E, k);
    cfg.score_function = MOEBLAZE_SCORE_SIGMOID;
    cfg.renormalize = 1;
    cfg.aux_loss_coeff = 0.01f;
    Layer layer(context, cfg);
    HostTensor logits(MOEBLAZE_DTYPE_F32, {T, E}), dg(MOEBLAZE_DTYPE_F32, {T, k});
    logits.from_vector({-100, -90, -95, -120, -1e4, -1e4, -2e4, -1e4, -200, -300, -250, -89});
    dg.fill(0.5);
    const RouterResult r = run_router(layer, T, logits, dg, true);
    MB_CHECK(r.forward);
    MB_CHECK(r.backward);
    CHECK(all_finite(r.g));
    CHECK(all_finite(r.losses));
    CHECK(all_finite(r.d_logits));
    // Each token's normalised scores put (almost) all weight on its top expert: P_e is the share
    // of tokens whose top expert is e. Tops: 1, 0 (tie of 0, 1, 3 -> 0), 3. Picks count f_e.
    // aux = c * E * sum_e f_e P_e with f = counts / (T k).
    CHECK(r.losses.get(0) > 0.0);
    CHECK(r.losses.get(0) < 0.01 * E);
  }

  TEST_CASE("extreme values: a z-loss that overflows the routing dtype is an error, not Inf") {
    Context context;
    const int64_t E = 4, k = 2, T = 2;
    moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 8, 8, E, k);
    cfg.z_loss_coeff = 1e-3f;
    Layer layer(context, cfg);
    HostTensor logits(MOEBLAZE_DTYPE_F32, {T, E}), dg(MOEBLAZE_DTYPE_F32, {T, k});
    dg.fill(1.0);
    for (double extreme : {3.0e38, -3.0e38, double(FLT_MAX), -double(FLT_MAX)}) {
      CAPTURE(extreme);
      logits.from_vector({0.5, 1.0, -2.0, 0.0, extreme, 1.0, -extreme, 2.0});
      const RouterResult r = run_router(layer, T, logits, dg, true);
      CHECK(r.forward == MOEBLAZE_ERR_NON_FINITE);
      CHECK_MESSAGE(r.forward_error.find("z-loss") != std::string::npos, r.forward_error);
      CHECK_MESSAGE(r.forward_error.find("t=1") != std::string::npos, r.forward_error);
      // Without losses requested the forward computes no z-loss: routing works and is finite.
      const RouterResult no_losses = run_router(layer, T, logits, dg, false);
      MB_CHECK(no_losses.forward);
      CHECK(all_finite(no_losses.g));
      // The backward always includes the z-loss gradient (d_losses NULL means {1, 1}).
      CHECK(no_losses.backward == MOEBLAZE_ERR_NON_FINITE);
      CHECK_MESSAGE(no_losses.backward_error.find("z-loss") != std::string::npos,
                    no_losses.backward_error);
    }
    // Large but representable: logsumexp^2 = 1e36, times 1e-3.
    logits.from_vector({1.0e18, 0.0, 1.0, -1.0e18, 2.0, 3.0, 4.0, 5.0});
    const RouterResult r = run_router(layer, T, logits, dg, true);
    MB_CHECK(r.forward);
    MB_CHECK(r.backward);
    CHECK(all_finite(r.losses));
    CHECK(all_finite(r.d_logits));
    CHECK(r.losses.get(1) == doctest::Approx(1e-3 * (1e36 + 25.0) / 2).epsilon(1e-5));
  }

  TEST_CASE("extreme values: softmax scores of logits at +-FLT_MAX are finite") {
    Context context;
    const int64_t E = 4, k = 2, T = 2;
    for (int32_t fn : {MOEBLAZE_SCORE_SOFTMAX_TOPK, MOEBLAZE_SCORE_TOPK_SOFTMAX}) {
      CAPTURE(fn);
      moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 8, 8, E, k);
      cfg.score_function = fn;
      cfg.renormalize = fn == MOEBLAZE_SCORE_SOFTMAX_TOPK;
      cfg.aux_loss_coeff = 0.01f;
      Layer layer(context, cfg);
      HostTensor logits(MOEBLAZE_DTYPE_F32, {T, E}), dg(MOEBLAZE_DTYPE_F32, {T, k});
      logits.from_vector({FLT_MAX, -FLT_MAX, FLT_MAX, 0.0, -FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX});
      dg.fill(0.25);
      const RouterResult r = run_router(layer, T, logits, dg, true);
      MB_CHECK(r.forward);
      MB_CHECK(r.backward);
      CHECK(all_finite(r.g));
      CHECK(all_finite(r.losses));
      CHECK(all_finite(r.d_logits));
    }
  }

  TEST_CASE("extreme values: a NaN in x reaches y under every activation") {
    Context context;
    Rng rng(test_seed(2601));
    const int64_t T = 4;
    for (int32_t activation : kAllActivations) {
      CAPTURE(activation);
      moeblaze_layer_config_t config = make_config(MOEBLAZE_DTYPE_F32, 8, 12, 4, 2);
      config.activation = activation;
      Layer layer(context, config);
      LayerRun run(layer, T);
      run.init_random(rng);
      run.x.set(1 * run.d + 3, NAN);  // token 1
      MB_CHECK(run.experts_forward());
      for (int64_t t = 0; t < T; ++t) {
        bool has_nan = false;
        for (int64_t j = 0; j < run.d; ++j) has_nan |= std::isnan(run.y.get(t * run.d + j));
        CHECK_MESSAGE(has_nan == (t == 1), "token " << t);
      }
    }
  }
}
