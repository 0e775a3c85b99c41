// Forward passes of the CPU backend against the naive double-precision reference of
// tests/support/naive_reference.hpp (which rounds a, b, u to the storage dtype as the contract
// says).
#include "support/naive_reference.hpp"
#include "support/test_support.hpp"

using namespace mbtest;

namespace {

std::vector<double> naive_experts_y(const LayerRun& run, const std::vector<int32_t>& ids,
                                    const std::vector<double>& g) {
  return naive::experts_forward(run.cfg, run.T, run.x.to_vector(), ids, g, run.w_gate.to_vector(),
                                run.w_up.to_vector(), run.w_down.to_vector(), run.dtype);
}

// y sums k products g * y2, each y2 a sum of h products: scale the tolerance by h * k.
Tolerance y_tolerance(const LayerRun& run) {
  return tolerance_for(run.dtype, run.h * run.k + run.d);
}

}  // namespace

TEST_SUITE("cpu") {
  TEST_CASE("forward: experts match the naive reference, every dtype and activation") {
    Context context;
    Rng rng(test_seed(7));
    for (int32_t dtype :
         {MOEBLAZE_DTYPE_F32, MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16, MOEBLAZE_DTYPE_F64}) {
      for (int32_t act : kAllActivations) {
        moeblaze_layer_config_t cfg = make_config(dtype, 24, 40, 6, 2);
        cfg.activation = act;
        CAPTURE(describe(cfg));
        Layer layer(context, cfg);
        LayerRun run(layer, 37);
        run.init_random(rng);
        run.clear_outputs();
        MB_CHECK(run.experts_forward());
        compare("y", run.y, naive_experts_y(run, run.ids, run.g.to_vector()), y_tolerance(run));
        std::vector<int32_t> counts(size_t(run.E), 0);
        for (int32_t id : run.ids) ++counts[size_t(id)];
        CHECK(run.expert_counts == counts);
      }
    }
  }

  TEST_CASE("forward: the activation list of the tests covers every code") {
    // The suites loop over kAllActivations; a code the library accepts beyond it would go untested.
    Context context;
    for (int32_t i = 0; i < kActivationCount; ++i) CHECK(kAllActivations[i] == i);
    for (int32_t act : {kActivationCount - 1, kActivationCount}) {
      moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 8, 8, 2, 1);
      cfg.activation = act;
      CAPTURE(act);
      moeblaze_layer_t layer = nullptr;
      const moeblaze_status_t status = moeblaze_layer_create(&layer, context.get(), &cfg);
      CHECK(status == (act < kActivationCount ? MOEBLAZE_OK : MOEBLAZE_ERR_INVALID_ARGUMENT));
      if (layer) moeblaze_layer_destroy(layer);
    }
  }

  TEST_CASE("forward: whole layer matches router + experts references") {
    Context context;
    Rng rng(test_seed(11));
    for (int32_t dtype : {MOEBLAZE_DTYPE_F32, MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16}) {
      for (int32_t score :
           {MOEBLAZE_SCORE_SOFTMAX_TOPK, MOEBLAZE_SCORE_TOPK_SOFTMAX, MOEBLAZE_SCORE_SIGMOID}) {
        for (int32_t renormalize : {0, 1}) {
          moeblaze_layer_config_t cfg = make_config(dtype, 32, 48, 8, 3);
          cfg.score_function = score;
          cfg.renormalize = renormalize;
          cfg.aux_loss_coeff = 0.01f;
          cfg.z_loss_coeff = 0.001f;
          CAPTURE(describe(cfg));
          Layer layer(context, cfg);
          LayerRun run(layer, 45);
          run.init_random(rng);
          run.clear_outputs();
          MB_CHECK(run.layer_forward());

          // Logits in the routing dtype (F32), accumulated in F32 over d.
          const std::vector<double> logits =
              naive::router_logits(cfg, run.T, run.x.to_vector(), run.w_router.to_vector());
          compare("logits", run.logits, logits, tolerance_for(MOEBLAZE_DTYPE_F32, run.d, 2.0));

          // Routing from the library's own logits, so a near-tie cannot flip the reference.
          const naive::RouterResult route =
              naive::router_forward(cfg, run.T, run.logits.to_vector());
          CHECK(run.ids_out == route.ids);
          compare("g", run.g_out, route.g, tolerance_for(MOEBLAZE_DTYPE_F32, run.E));
          CHECK(run.expert_counts == route.counts);
          compare("losses", run.losses, {route.aux_loss, route.z_loss},
                  tolerance_for(MOEBLAZE_DTYPE_F32, run.T * run.E));

          compare("y", run.y, naive_experts_y(run, run.ids_out, run.g_out.to_vector()),
                  y_tolerance(run));
        }
      }
    }
  }

  TEST_CASE("forward: inference (no saved buffer) gives the same y as training") {
    Context context;
    Rng rng(test_seed(12));
    for (int32_t policy : {MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_SAVE_PREACT,
                           MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
      moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, 16, 24, 4, 2);
      cfg.checkpoint = policy;
      Layer layer(context, cfg);
      LayerRun run(layer, 20);
      run.init_random(rng);
      MB_CHECK(run.experts_forward(true));
      const HostTensor y_training = run.y;
      MB_CHECK(run.experts_forward(false));
      CHECK(run.y.bitwise_equal(y_training));
      MB_CHECK(run.layer_forward(true));
      const HostTensor y_layer = run.y;
      MB_CHECK(run.layer_forward(false));
      CHECK(run.y.bitwise_equal(y_layer));
    }
  }

  TEST_CASE("forward: router top-k ties go to the lower expert id") {
    Context context;
    for (int32_t score :
         {MOEBLAZE_SCORE_SOFTMAX_TOPK, MOEBLAZE_SCORE_TOPK_SOFTMAX, MOEBLAZE_SCORE_SIGMOID}) {
      moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 4, 4, 6, 3);
      cfg.score_function = score;
      Layer layer(context, cfg);
      // Token 0: all equal. Token 1: experts 1, 3, 5 tie for the top, 0 and 4 tie next.
      const std::vector<float> logits = {0, 0, 0, 0, 0, 0, 0.5f, 2, -1, 2, 0.5f, 2};
      std::vector<int32_t> ids(6, -1);
      std::vector<float> g(6, NAN);
      AlignedBytes workspace(layer.workspace_size(MOEBLAZE_PASS_ROUTER_FORWARD, 2));
      MB_CHECK(moeblaze_router_forward(layer.get(), 2, logits.data(), ids.data(), g.data(), nullptr,
                                       nullptr, workspace.data(), workspace.size(), nullptr));
      CHECK(ids == std::vector<int32_t>{0, 1, 2, 1, 3, 5});
    }
  }

}  // TEST_SUITE
