// The three checkpoint policies (SAVE_ALL, SAVE_PREACT, RECOMPUTE) must give bitwise identical
// outputs and gradients: backward uses exactly the a, b, u the forward pass computed, whether it
// reads them from the saved buffer or recomputes them.
#include "support/test_support.hpp"

using namespace mbtest;

namespace {

const int32_t kPolicies[] = {MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_SAVE_PREACT,
                             MOEBLAZE_CHECKPOINT_RECOMPUTE};

struct Results {
  HostTensor y, dx, dw_router, dw_gate, dw_up, dw_down, dg, d_logits;
};

Results run_policy(const Context& context, moeblaze_layer_config_t cfg, int64_t T, uint64_t seed,
                   bool whole_layer) {
  Layer layer(context, cfg);
  LayerRun run(layer, T);
  Rng rng(seed);
  run.init_random(rng);
  run.clear_outputs();
  if (whole_layer) {
    MB_CHECK(run.layer_forward());
    MB_CHECK(run.layer_backward());
  } else {
    MB_CHECK(run.experts_forward());
    MB_CHECK(run.experts_backward());
  }
  return {run.y, run.dx, run.dw_router, run.dw_gate, run.dw_up, run.dw_down, run.dg, run.d_logits};
}

}  // namespace

TEST_SUITE("cpu") {
  TEST_CASE("policies: SAVE_ALL, SAVE_PREACT and RECOMPUTE give bitwise identical results") {
    Context context;
    const uint64_t seed = test_seed(404);
    for (int32_t dtype : {MOEBLAZE_DTYPE_F32, MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16}) {
      for (int32_t act : {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_GEGLU,
                          MOEBLAZE_ACTIVATION_GELU, MOEBLAZE_ACTIVATION_RELU2}) {
        for (bool whole_layer : {false, true}) {
          moeblaze_layer_config_t cfg = make_config(dtype, 40, 72, 6, 2);
          cfg.activation = act;
          cfg.aux_loss_coeff = 0.01f;
          cfg.z_loss_coeff = 0.001f;
          CAPTURE(describe(cfg));
          CAPTURE(whole_layer);
          std::vector<Results> results;
          for (int32_t policy : kPolicies) {
            cfg.checkpoint = policy;
            results.push_back(run_policy(context, cfg, 29, seed, whole_layer));
          }
          for (size_t p = 1; p < results.size(); ++p) {
            CAPTURE(p);
            CHECK(results[p].y.bitwise_equal(results[0].y));
            CHECK(results[p].dx.bitwise_equal(results[0].dx));
            CHECK(results[p].dw_gate.bitwise_equal(results[0].dw_gate));
            CHECK(results[p].dw_up.bitwise_equal(results[0].dw_up));
            CHECK(results[p].dw_down.bitwise_equal(results[0].dw_down));
            if (whole_layer) {
              CHECK(results[p].dw_router.bitwise_equal(results[0].dw_router));
              CHECK(results[p].d_logits.bitwise_equal(results[0].d_logits));
            } else {
              CHECK(results[p].dg.bitwise_equal(results[0].dg));
            }
          }
          // And the outputs are real numbers, not NaN left from clear_outputs().
          CHECK(std::isfinite(results[0].dx.get(0)));
          CHECK(std::isfinite(results[0].dw_down.get(results[0].dw_down.numel() - 1)));
        }
      }
    }
  }

  TEST_CASE("policies: saved buffer sizes shrink SAVE_ALL > SAVE_PREACT > RECOMPUTE") {
    Context context;
    for (int32_t act : {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_SILU}) {
      size_t previous = SIZE_MAX;
      for (int32_t policy : kPolicies) {
        moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, 64, 128, 8, 2);
        cfg.activation = act;
        cfg.checkpoint = policy;
        Layer layer(context, cfg);
        const size_t bytes = layer.saved_size(MOEBLAZE_PASS_EXPERTS_FORWARD, 100);
        CHECK(bytes < previous);
        // At least what the policy keeps: N*h values per saved activation.
        const size_t per_activation = 2u * 200u * 128u;
        const size_t kept = policy == MOEBLAZE_CHECKPOINT_SAVE_ALL
                                ? (act == MOEBLAZE_ACTIVATION_SWIGLU ? 3 : 2)
                            : policy == MOEBLAZE_CHECKPOINT_SAVE_PREACT
                                ? (act == MOEBLAZE_ACTIVATION_SWIGLU ? 2 : 1)
                                : 0;
        CHECK(bytes >= kept * per_activation);
        CHECK(bytes < kept * per_activation + 8192);  // header + indices, nothing else
        previous = bytes;
      }
    }
  }

}  // TEST_SUITE
