// Central finite-difference checks, in F64 layers, of every gradient the CPU backend computes:
// experts backward (dx, dw_gate, dw_up, dw_down, dg) for every activation, router backward
// (d_logits with the aux and z-loss terms) for every score function, and the whole-layer backward
// (dx through the router too, dw_router, expert weights) for every activation x score function x
// renormalisation.
#include <functional>

#include "support/naive_reference.hpp"
#include "support/test_support.hpp"

using namespace mbtest;

namespace {

const int32_t kScoreFunctions[] = {MOEBLAZE_SCORE_SOFTMAX_TOPK, MOEBLAZE_SCORE_TOPK_SOFTMAX,
                                   MOEBLAZE_SCORE_SIGMOID};

constexpr double kStep = 1e-6;
// Truncation error ~ step^2, cancellation ~ 1e-16 / step: 1e-8 absolute is well clear of both.
const Tolerance kFdTolerance{1e-8, 1e-6};

// d loss / d param[i] for every element, by central differences.
std::vector<double> finite_difference(HostTensor& param, const std::function<double()>& loss) {
  std::vector<double> grad(static_cast<size_t>(param.numel()));
  for (int64_t i = 0; i < param.numel(); ++i) {
    const double saved = param.get(i);
    param.set(i, saved + kStep);
    const double plus = loss();
    param.set(i, saved - kStep);
    const double minus = loss();
    param.set(i, saved);
    grad[size_t(i)] = (plus - minus) / (2 * kStep);
  }
  return grad;
}

double dot(const HostTensor& a, const HostTensor& b) {
  double sum = 0;
  for (int64_t i = 0; i < a.numel(); ++i) sum += a.get(i) * b.get(i);
  return sum;
}

// Re-draws x and w_router until every token's k-th and (k+1)-th logits are at least `margin` apart,
// so that top-k cannot change under the finite-difference steps.
void draw_stable_routing(LayerRun& run, Rng& rng, double margin) {
  for (int attempt = 0; attempt < 1000; ++attempt) {
    run.init_random(rng);
    const std::vector<double> logits =
        naive::router_logits(run.cfg, run.T, run.x.to_vector(), run.w_router.to_vector());
    bool stable = true;
    for (int64_t t = 0; t < run.T && stable; ++t) {
      std::vector<double> row(logits.begin() + t * run.E, logits.begin() + (t + 1) * run.E);
      std::sort(row.begin(), row.end(), std::greater<double>());
      for (int64_t e = 0; e + 1 < run.E; ++e)
        stable = stable && row[size_t(e)] - row[size_t(e + 1)] > margin;
    }
    if (stable) return;
  }
  FAIL("could not draw inputs with a stable routing");
}

}  // namespace

TEST_SUITE("cpu") {
  TEST_CASE("gradients: experts backward matches finite differences (F64, every activation)") {
    Context context;
    context.set_num_threads(1);  // many tiny calls: skip the wake-ups
    Rng rng(test_seed(101));
    for (int32_t act : kAllActivations) {
      for (int32_t policy : {MOEBLAZE_CHECKPOINT_SAVE_PREACT, MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
        moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F64, 6, 5, 4, 2);
        cfg.activation = act;
        cfg.checkpoint = policy;
        CAPTURE(describe(cfg));
        Layer layer(context, cfg);
        LayerRun run(layer, 7);
        run.init_random(rng);
        MB_CHECK(run.experts_forward());
        run.clear_outputs();
        MB_CHECK(run.experts_backward());
        const HostTensor dx = run.dx, dw_gate = run.dw_gate, dw_up = run.dw_up,
                         dw_down = run.dw_down, dg = run.dg;

        const auto loss = [&] {
          MB_CHECK(run.experts_forward(false));
          return dot(run.y, run.dy);
        };
        compare("dx", dx, finite_difference(run.x, loss), kFdTolerance);
        compare("dw_gate", dw_gate, finite_difference(run.w_gate, loss), kFdTolerance);
        if (run.gated) compare("dw_up", dw_up, finite_difference(run.w_up, loss), kFdTolerance);
        compare("dw_down", dw_down, finite_difference(run.w_down, loss), kFdTolerance);
        compare("dg", dg, finite_difference(run.g, loss), kFdTolerance);
      }
    }
  }

  TEST_CASE("gradients: router backward matches finite differences (F64, aux and z losses)") {
    Context context;
    context.set_num_threads(1);
    Rng rng(test_seed(202));
    const int64_t T = 6, E = 5, k = 2;
    for (int32_t score : kScoreFunctions) {
      for (int32_t renormalize : {0, 1}) {
        for (bool explicit_d_losses : {false, true}) {
          moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F64, 4, 4, E, k);
          cfg.score_function = score;
          cfg.renormalize = renormalize;
          cfg.aux_loss_coeff = 0.3f;
          cfg.z_loss_coeff = 0.05f;
          CAPTURE(describe(cfg));
          CAPTURE(explicit_d_losses);
          Layer layer(context, cfg);

          // Logits: each token a shuffled ladder with steps of 0.5 plus noise, so no near-ties.
          HostTensor logits(MOEBLAZE_DTYPE_F64, {T, E});
          for (int64_t t = 0; t < T; ++t) {
            std::vector<int32_t> order = random_ids(rng, 1, E, E);
            for (int64_t e = 0; e < E; ++e) {
              logits.set(t * E + e, 0.5 * order[size_t(e)] - 1.0 + rng.uniform(-0.1, 0.1));
            }
          }
          HostTensor dg(MOEBLAZE_DTYPE_F64, {T, k});
          fill_normal(dg, rng, 1.0);
          HostTensor d_losses(MOEBLAZE_DTYPE_F64, {2});
          d_losses.set(0, explicit_d_losses ? 0.7 : 1.0);
          d_losses.set(1, explicit_d_losses ? -1.3 : 1.0);

          AlignedBytes forward_ws(layer.workspace_size(MOEBLAZE_PASS_ROUTER_FORWARD, T));
          AlignedBytes backward_ws(layer.workspace_size(MOEBLAZE_PASS_ROUTER_BACKWARD, T));
          std::vector<int32_t> ids(size_t(T * k));
          HostTensor g(MOEBLAZE_DTYPE_F64, {T, k});
          HostTensor losses(MOEBLAZE_DTYPE_F64, {2});
          MB_CHECK(moeblaze_router_forward(layer.get(), T, logits.data(), ids.data(), g.data(),
                                           nullptr, losses.data(), forward_ws.data(),
                                           forward_ws.size(), nullptr));
          const std::vector<int32_t> base_ids = ids;
          HostTensor d_logits(MOEBLAZE_DTYPE_F64, {T, E});
          d_logits.fill(NAN);
          MB_CHECK(moeblaze_router_backward(layer.get(), T, logits.data(), ids.data(), dg.data(),
                                            explicit_d_losses ? d_losses.data() : nullptr,
                                            d_logits.data(), backward_ws.data(), backward_ws.size(),
                                            nullptr));
          const auto loss = [&] {
            MB_CHECK(moeblaze_router_forward(layer.get(), T, logits.data(), ids.data(), g.data(),
                                             nullptr, losses.data(), forward_ws.data(),
                                             forward_ws.size(), nullptr));
            REQUIRE(ids == base_ids);
            return dot(g, dg) + d_losses.get(0) * losses.get(0) + d_losses.get(1) * losses.get(1);
          };
          compare("d_logits", d_logits, finite_difference(logits, loss), kFdTolerance);
          // The loss terms matter: without them the gradient must differ.
          CHECK(losses.get(0) > 0);
          CHECK(losses.get(1) > 0);
        }
      }
    }
  }

  TEST_CASE("gradients: whole-layer backward matches finite differences (F64)") {
    Context context;
    context.set_num_threads(1);
    Rng rng(test_seed(303));
    for (int32_t act : kAllActivations) {
      for (int32_t score : kScoreFunctions) {
        for (int32_t renormalize : {0, 1}) {
          moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F64, 6, 5, 4, 2);
          cfg.activation = act;
          cfg.score_function = score;
          cfg.renormalize = renormalize;
          cfg.aux_loss_coeff = 0.1f;
          cfg.z_loss_coeff = 0.01f;
          CAPTURE(describe(cfg));
          Layer layer(context, cfg);
          LayerRun run(layer, 6);
          draw_stable_routing(run, rng, 1e-3);
          run.use_d_losses = act % 2 == 1;  // alternate NULL ({1,1}) and explicit values
          run.d_losses.set(0, run.use_d_losses ? 0.5 : 1.0);
          run.d_losses.set(1, run.use_d_losses ? 2.0 : 1.0);
          MB_CHECK(run.layer_forward());
          const std::vector<int32_t> base_ids = run.ids_out;
          run.clear_outputs();
          MB_CHECK(run.layer_backward());
          const HostTensor dx = run.dx, dw_router = run.dw_router, dw_gate = run.dw_gate,
                           dw_up = run.dw_up, dw_down = run.dw_down;

          const auto loss = [&] {
            MB_CHECK(run.layer_forward(false));
            REQUIRE(run.ids_out == base_ids);
            return dot(run.y, run.dy) + run.d_losses.get(0) * run.losses.get(0) +
                   run.d_losses.get(1) * run.losses.get(1);
          };
          compare("dx", dx, finite_difference(run.x, loss), kFdTolerance);
          compare("dw_router", dw_router, finite_difference(run.w_router, loss), kFdTolerance);
          compare("dw_gate", dw_gate, finite_difference(run.w_gate, loss), kFdTolerance);
          if (run.gated) compare("dw_up", dw_up, finite_difference(run.w_up, loss), kFdTolerance);
          compare("dw_down", dw_down, finite_difference(run.w_down, loss), kFdTolerance);
        }
      }
    }
  }

}  // TEST_SUITE
