// Edge cases of the CPU backend through the public API: empty and tiny token counts, k = 1 and
// k = E, experts with no tokens, every token on one expert, odd sizes, accumulation of weight
// gradients, NULL optional outputs, bitwise determinism across runs and thread counts, and the
// errors only the backend can detect (non-finite logits, a foreign saved buffer, bad ids).
#include <functional>

#include "support/naive_reference.hpp"
#include "support/test_support.hpp"

using namespace mbtest;

namespace {

// Copies every input of `from` into `to` (which may have another dtype).
void copy_inputs(const LayerRun& from, LayerRun& to) {
  to.x.from_vector(from.x.to_vector());
  to.w_router.from_vector(from.w_router.to_vector());
  to.w_gate.from_vector(from.w_gate.to_vector());
  to.w_up.from_vector(from.w_up.to_vector());
  to.w_down.from_vector(from.w_down.to_vector());
  to.dy.from_vector(from.dy.to_vector());
  to.g.from_vector(from.g.to_vector());
  to.ids = from.ids;
}

double rms(const std::vector<double>& v) {
  double sum = 0;
  for (double value : v) sum += value * value;
  return v.empty() ? 1.0 : std::sqrt(sum / double(v.size())) + 1e-30;
}

// Runs experts forward + backward for `cfg` and compares every output with the naive reference,
// which mirrors the contract's roundings (a, b, u, da, db in the storage dtype), so the remaining
// differences are accumulation order and rare one-ulp rounding flips. For F64 the F64 reference is
// itself checked against finite differences in test_gradients.cpp.
void check_against_naive(const Context& context, moeblaze_layer_config_t cfg, int64_t T,
                         const std::function<void(LayerRun&)>& set_ids, Rng& rng) {
  CAPTURE(describe(cfg));
  CAPTURE(T);
  Layer layer(context, cfg);
  LayerRun run(layer, T);
  run.init_random(rng);
  set_ids(run);
  run.clear_outputs();
  MB_CHECK(run.experts_forward());
  MB_CHECK(run.experts_backward());

  const std::vector<double> x = run.x.to_vector(), g = run.g.to_vector(),
                            w_gate = run.w_gate.to_vector(), w_up = run.w_up.to_vector(),
                            w_down = run.w_down.to_vector(), dy = run.dy.to_vector();
  const std::vector<double> y =
      naive::experts_forward(cfg, T, x, run.ids, g, w_gate, w_up, w_down, cfg.dtype);
  const naive::ExpertsGradients ref =
      naive::experts_backward(cfg, T, x, run.ids, g, w_gate, w_up, w_down, dy, cfg.dtype);

  const int64_t reduction = std::max({run.d, run.h, T}) * run.k;
  const auto check = [&](const char* name, const HostTensor& got, const std::vector<double>& want) {
    compare(name, got, want, tolerance_for(cfg.dtype, reduction, 2 * rms(want)));
  };
  check("y", run.y, y);
  check("dx", run.dx, ref.dx);
  check("dw_gate", run.dw_gate, ref.dw_gate);
  if (run.gated) check("dw_up", run.dw_up, ref.dw_up);
  check("dw_down", run.dw_down, ref.dw_down);
  check("dg", run.dg, ref.dg);
  std::vector<int32_t> counts(size_t(run.E), 0);
  for (int32_t id : run.ids) ++counts[size_t(id)];
  CHECK(run.expert_counts == counts);
}

void keep_random_ids(LayerRun&) {}

}  // namespace

TEST_SUITE("cpu") {
  TEST_CASE("edge: shapes (T=1, k=1, k=E, empty experts, one expert for all, odd sizes)") {
    Context context;
    Rng rng(test_seed(505));
    for (int32_t dtype :
         {MOEBLAZE_DTYPE_F32, MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16, MOEBLAZE_DTYPE_F64}) {
      for (int32_t act : {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_RELU}) {
        moeblaze_layer_config_t cfg = make_config(dtype, 16, 24, 4, 2);
        cfg.activation = act;
        SUBCASE("T = 1") {
          check_against_naive(context, cfg, 1, keep_random_ids, rng);
        }
        SUBCASE("k = 1") {
          cfg.top_k = 1;
          check_against_naive(context, cfg, 13, keep_random_ids, rng);
        }
        SUBCASE("k = E") {
          cfg.top_k = 4;
          check_against_naive(context, cfg, 11, keep_random_ids, rng);
        }
        SUBCASE("experts with no tokens") {
          cfg.num_experts = 7;
          check_against_naive(
              context, cfg, 10,
              [](LayerRun& run) {
                for (int64_t t = 0; t < run.T; ++t) {  // only experts 1 and 4 are used
                  run.ids[size_t(t * 2)] = t % 2 ? 1 : 4;
                  run.ids[size_t(t * 2 + 1)] = t % 2 ? 4 : 1;
                }
              },
              rng);
        }
        SUBCASE("every token on one expert") {
          cfg.top_k = 1;
          check_against_naive(
              context, cfg, 17, [](LayerRun& run) { std::fill(run.ids.begin(), run.ids.end(), 3); },
              rng);
        }
        SUBCASE("odd sizes d=33, h=70, E=5, k=3") {
          cfg.d_model = 33;
          cfg.d_ffn = 70;
          cfg.num_experts = 5;
          cfg.top_k = 3;
          check_against_naive(context, cfg, 19, keep_random_ids, rng);
        }
        SUBCASE("sizes past one stack tile (d=300, h=260)") {
          cfg.d_model = 300;
          cfg.d_ffn = 260;
          check_against_naive(context, cfg, 5, keep_random_ids, rng);
        }
      }
    }
  }

  TEST_CASE("edge: T = 0 is valid; weight gradients are zeroed (or left alone when accumulating)") {
    Context context;
    Rng rng(test_seed(606));
    moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 8, 12, 4, 2);
    cfg.aux_loss_coeff = 0.1f;
    cfg.z_loss_coeff = 0.1f;
    Layer layer(context, cfg);
    LayerRun run(layer, 0);
    run.init_random(rng);
    for (bool whole_layer : {false, true}) {
      CAPTURE(whole_layer);
      run.clear_outputs();
      MB_CHECK(whole_layer ? run.layer_forward() : run.experts_forward());
      CHECK(run.expert_counts == std::vector<int32_t>(4, 0));
      if (whole_layer) CHECK(run.losses.to_vector() == std::vector<double>{0, 0});
      MB_CHECK(whole_layer ? run.layer_backward() : run.experts_backward());
      for (const HostTensor* dw : {&run.dw_gate, &run.dw_up, &run.dw_down}) {
        CHECK(dw->to_vector() == std::vector<double>(size_t(dw->numel()), 0.0));
      }
      if (whole_layer) CHECK(run.dw_router.to_vector() == std::vector<double>(32, 0.0));

      run.dw_gate.fill(1.5);
      run.dw_router.fill(-2.5);
      MB_CHECK(whole_layer ? run.layer_backward({}, MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD)
                           : run.experts_backward({}, MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD));
      CHECK(run.dw_gate.to_vector() == std::vector<double>(size_t(run.dw_gate.numel()), 1.5));
      if (whole_layer) CHECK(run.dw_router.to_vector() == std::vector<double>(32, -2.5));
    }
  }

  TEST_CASE("edge: ACCUMULATE_WGRAD adds to the existing weight gradients") {
    Context context;
    Rng rng(test_seed(707));
    moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 20, 28, 5, 2);
    Layer layer(context, cfg);
    LayerRun run(layer, 23);
    run.init_random(rng);
    MB_CHECK(run.layer_forward());
    MB_CHECK(run.layer_backward());
    const LayerRun fresh = run;
    std::vector<HostTensor*> grads = {&run.dw_router, &run.dw_gate, &run.dw_up, &run.dw_down};
    std::vector<HostTensor> prior;
    for (HostTensor* grad : grads) {
      fill_normal(*grad, rng, 1.0);
      prior.push_back(*grad);
    }
    run.dx.fill(NAN);
    MB_CHECK(run.layer_backward({}, MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD));
    const std::vector<const HostTensor*> overwritten = {&fresh.dw_router, &fresh.dw_gate,
                                                        &fresh.dw_up, &fresh.dw_down};
    for (size_t i = 0; i < grads.size(); ++i) {
      CAPTURE(i);
      // F32 accumulates as float(prior + fresh gradient): exactly the float sum.
      std::vector<double> expected(size_t(prior[i].numel()));
      for (int64_t j = 0; j < prior[i].numel(); ++j) {
        expected[size_t(j)] = double(float(prior[i].get(j)) + float(overwritten[i]->get(j)));
      }
      CHECK(grads[i]->to_vector() == expected);
    }
    CHECK(run.dx.bitwise_equal(fresh.dx));  // dx is always overwritten
  }

  TEST_CASE("edge: CONSUME_SAVED is accepted, sized, and gives the same gradients") {
    Context context;
    Rng rng(test_seed(757));
    for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_SAVE_PREACT,
                         MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
      CAPTURE(ckpt);
      moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, 20, 28, 5, 2);
      cfg.checkpoint = ckpt;
      Layer layer(context, cfg);
      LayerRun run(layer, 23);
      run.init_random(rng);
      MB_CHECK(run.layer_forward());
      MB_CHECK(run.layer_backward());
      const LayerRun plain = run;
      run.clear_outputs();
      MB_CHECK(run.layer_backward({}, MOEBLAZE_BACKWARD_CONSUME_SAVED));
      for (const auto& pair :
           {std::make_pair(&run.dx, &plain.dx), std::make_pair(&run.dw_gate, &plain.dw_gate),
            std::make_pair(&run.dw_up, &plain.dw_up), std::make_pair(&run.dw_down, &plain.dw_down),
            std::make_pair(&run.dw_router, &plain.dw_router)}) {
        CHECK(pair.first->bitwise_equal(*pair.second));
      }
      // The CPU backend ignores the flag: every pass and flag combination has the plain size.
      for (int32_t pass = MOEBLAZE_PASS_ROUTER_FORWARD; pass <= MOEBLAZE_PASS_LAYER_BACKWARD;
           ++pass) {
        CAPTURE(pass);
        size_t plain_bytes = 0, flagged = 1;
        MB_CHECK(moeblaze_layer_workspace_size(layer.get(), pass, 23, &plain_bytes));
        MB_CHECK(moeblaze_layer_workspace_size_with_flags(
            layer.get(), pass, 23,
            MOEBLAZE_BACKWARD_CONSUME_SAVED | MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD, &flagged));
        CHECK(flagged == plain_bytes);
      }
    }
    moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 8, 12, 4, 2);
    Layer layer(context, cfg);
    size_t bytes = 7;
    CHECK(moeblaze_layer_workspace_size_with_flags(layer.get(), MOEBLAZE_PASS_LAYER_BACKWARD, 4, 8u,
                                                   &bytes) == MOEBLAZE_ERR_INVALID_ARGUMENT);
    CHECK(bytes == 0);
    CHECK(std::string(moeblaze_last_error()).find("flags = 8") != std::string::npos);
    CHECK(moeblaze_layer_workspace_size_with_flags(layer.get(), 9, 4, 0u, &bytes) ==
          MOEBLAZE_ERR_INVALID_ARGUMENT);
    CHECK(moeblaze_layer_workspace_size_with_flags(layer.get(), MOEBLAZE_PASS_LAYER_BACKWARD, 4, 0u,
                                                   nullptr) == MOEBLAZE_ERR_INVALID_ARGUMENT);
    CHECK(moeblaze_layer_workspace_size_with_flags(nullptr, MOEBLAZE_PASS_LAYER_BACKWARD, 4, 0u,
                                                   &bytes) == MOEBLAZE_ERR_INVALID_HANDLE);
  }

  TEST_CASE("edge: FORWARD_WITH_SAVED sizes a training forward's workspace; same bits either way") {
    // A forward given a saved buffer writes its routing indices, the router outputs (layer
    // forward) and, under SAVE_ALL, u into it, so MOEBLAZE_FORWARD_WITH_SAVED asks for a smaller
    // workspace. The training forward must run in exactly that size (LayerRun's default) and in the
    // plain one with the same bits, an inference forward must refuse it, and the flag must not
    // change any other pass's size.
    Context context;
    Rng rng(test_seed(767));
    const int64_t T = 23, k = 2, h = 28;
    for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_SAVE_PREACT,
                         MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
      for (int32_t pass : {MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_LAYER_FORWARD}) {
        CAPTURE(ckpt);
        CAPTURE(pass);
        moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, 20, h, 5, k);
        cfg.checkpoint = ckpt;
        Layer layer(context, cfg);
        const size_t plain = layer.workspace_size(pass, T);
        const size_t lean = layer.workspace_size(pass, T, MOEBLAZE_FORWARD_WITH_SAVED);
        // At least the two index arrays of N int32 (each carve is 256-byte aligned).
        CHECK(lean + 2 * sizeof(int32_t) * size_t(T * k) <= plain);
        if (ckpt == MOEBLAZE_CHECKPOINT_SAVE_ALL) CHECK(lean + size_t(T * k * h) * 2 <= plain);
        // A backward flag is ignored by a forward pass, the forward flag by every other pass.
        CHECK(layer.workspace_size(
                  pass, T, MOEBLAZE_FORWARD_WITH_SAVED | MOEBLAZE_BACKWARD_CONSUME_SAVED) == lean);
        for (int32_t other : {MOEBLAZE_PASS_ROUTER_FORWARD, MOEBLAZE_PASS_ROUTING_BUILD,
                              MOEBLAZE_PASS_EXPERTS_BACKWARD, MOEBLAZE_PASS_LAYER_BACKWARD}) {
          CAPTURE(other);
          CHECK(layer.workspace_size(other, T, MOEBLAZE_FORWARD_WITH_SAVED) ==
                layer.workspace_size(other, T));
        }

        const bool whole = pass == MOEBLAZE_PASS_LAYER_FORWARD;
        LayerRun run(layer, T);
        run.init_random(rng);
        run.clear_outputs();
        MB_CHECK(whole ? run.layer_forward() : run.experts_forward());  // the lean size
        CHECK(run.workspace.size() == lean);
        const auto saved_bytes = [&run] {
          const auto* p = static_cast<const unsigned char*>(run.saved.data());
          return std::vector<unsigned char>(p, p + run.saved.size());
        };
        const std::vector<unsigned char> lean_saved = saved_bytes();
        MB_CHECK(whole ? run.layer_backward() : run.experts_backward());
        const LayerRun with_lean = run;
        run.clear_outputs();
        run.lean_training_workspace = false;
        MB_CHECK(whole ? run.layer_forward() : run.experts_forward());  // the plain size
        CHECK(run.workspace.size() == plain);
        CHECK(saved_bytes() == lean_saved);
        MB_CHECK(whole ? run.layer_backward() : run.experts_backward());
        for (const auto& pair :
             {std::make_pair(&run.y, &with_lean.y), std::make_pair(&run.dx, &with_lean.dx),
              std::make_pair(&run.dw_gate, &with_lean.dw_gate),
              std::make_pair(&run.dw_up, &with_lean.dw_up),
              std::make_pair(&run.dw_down, &with_lean.dw_down),
              std::make_pair(&run.dw_router, &with_lean.dw_router),
              std::make_pair(&run.dg, &with_lean.dg)}) {
          CHECK(pair.first->bitwise_equal(*pair.second));
        }

        // A forward (with or without `saved`) in a workspace of `bytes`: its status.
        const auto forward_in = [&](bool with_saved, size_t bytes) {
          run.prepare(pass, with_saved);
          run.workspace.resize(bytes);
          moeblaze_forward_args_t a = run.forward_args(with_saved);
          if (!whole) return moeblaze_experts_forward(layer.get(), &a, nullptr);
          a.ids = nullptr;
          a.g = nullptr;
          return moeblaze_layer_forward(layer.get(), &a, nullptr);
        };
        // Inference (no saved buffer) in the lean size: refused, naming the plain query.
        CHECK(forward_in(false, lean) == MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE);
        CHECK(std::string(moeblaze_last_error())
                  .find("moeblaze_layer_workspace_size(MOEBLAZE_PASS_") != std::string::npos);
        // Training one byte short of the lean size: refused, naming the flagged query.
        CHECK(forward_in(true, lean - 1) == MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE);
        CHECK(std::string(moeblaze_last_error()).find("MOEBLAZE_FORWARD_WITH_SAVED") !=
              std::string::npos);
      }
    }
  }

  TEST_CASE("edge: NULL optional outputs are skipped, and the others do not change") {
    Context context;
    Rng rng(test_seed(808));
    moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, 16, 20, 4, 2);
    Layer layer(context, cfg);
    LayerRun run(layer, 15);
    run.init_random(rng);
    MB_CHECK(run.layer_forward());
    run.clear_outputs();
    MB_CHECK(run.layer_backward());
    const LayerRun full = run;
    const char* names[] = {"dx", "dw_router", "dw_gate", "dw_up", "dw_down", "d_logits"};
    for (int only = 0; only < 6; ++only) {
      CAPTURE(names[only]);
      BackwardOutputs out;
      out.dx = only == 0;
      out.dw_router = only == 1;
      out.dw_gate = only == 2;
      out.dw_up = only == 3;
      out.dw_down = only == 4;
      out.d_logits = only == 5;
      run.clear_outputs();
      MB_CHECK(run.layer_backward(out));
      const HostTensor* got[] = {&run.dx,    &run.dw_router, &run.dw_gate,
                                 &run.dw_up, &run.dw_down,   &run.d_logits};
      const HostTensor* want[] = {&full.dx,    &full.dw_router, &full.dw_gate,
                                  &full.dw_up, &full.dw_down,   &full.d_logits};
      for (int i = 0; i < 6; ++i) {
        if (i == only) {
          CHECK(got[i]->bitwise_equal(*want[i]));
        } else {
          CHECK(std::isnan(got[i]->get(0)));  // untouched
        }
      }
    }
    // Experts backward with nothing but dg.
    MB_CHECK(run.experts_forward());
    run.clear_outputs();
    MB_CHECK(run.experts_backward());
    const HostTensor dg = run.dg;
    run.clear_outputs();
    BackwardOutputs only_dg;
    only_dg.dx = only_dg.dw_gate = only_dg.dw_up = only_dg.dw_down = false;
    MB_CHECK(run.experts_backward(only_dg));
    CHECK(run.dg.bitwise_equal(dg));
    CHECK(std::isnan(run.dx.get(0)));
    // And forward without expert_counts.
    moeblaze_forward_args_t args = run.forward_args(true);
    args.expert_counts = nullptr;
    MB_CHECK(moeblaze_experts_forward(layer.get(), &args, nullptr));
  }

  TEST_CASE("edge: results are bitwise identical across runs and thread counts") {
    Rng rng(test_seed(909));
    // Every output of a layer forward + backward and an experts forward + backward.
    struct Snapshot {
      std::vector<HostTensor> tensors;
      std::vector<int32_t> ids;
    };
    for (int32_t dtype : {MOEBLAZE_DTYPE_F32, MOEBLAZE_DTYPE_BF16}) {
      moeblaze_layer_config_t cfg = make_config(dtype, 48, 80, 8, 3);
      cfg.aux_loss_coeff = 0.01f;
      cfg.z_loss_coeff = 0.001f;
      CAPTURE(describe(cfg));
      Context input_context;
      Layer input_layer(input_context, cfg);
      LayerRun inputs(input_layer, 101);
      inputs.init_random(rng);
      std::vector<Snapshot> snapshots;
      for (int32_t threads : {1, 2, 3, 7, 0}) {
        for (int repeat = 0; repeat < 2; ++repeat) {
          Context context;
          context.set_num_threads(threads);
          Layer layer(context, cfg);
          LayerRun run(layer, inputs.T);
          copy_inputs(inputs, run);
          run.clear_outputs();
          Snapshot snapshot;
          MB_CHECK(run.layer_forward());
          MB_CHECK(run.layer_backward());
          snapshot.tensors = {run.y,         run.logits,  run.g_out, run.losses,  run.dx,
                              run.dw_router, run.dw_gate, run.dw_up, run.dw_down, run.d_logits};
          snapshot.ids = run.ids_out;
          MB_CHECK(run.experts_forward());
          MB_CHECK(run.experts_backward());
          for (const HostTensor& t : {run.y, run.dx, run.dw_gate, run.dw_up, run.dw_down, run.dg}) {
            snapshot.tensors.push_back(t);
          }
          snapshots.push_back(snapshot);
        }
      }
      for (size_t s = 1; s < snapshots.size(); ++s) {
        CAPTURE(s);
        CHECK(snapshots[s].ids == snapshots[0].ids);
        for (size_t i = 0; i < snapshots[0].tensors.size(); ++i) {
          CAPTURE(i);
          CHECK(snapshots[s].tensors[i].bitwise_equal(snapshots[0].tensors[i]));
        }
      }
      CHECK(!std::isnan(snapshots[0].tensors[4].get(0)));  // dx was written
    }
  }

  TEST_CASE("errors: non-finite logits are MOEBLAZE_ERR_NON_FINITE") {
    Context context;
    moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 8, 8, 4, 2);
    Layer layer(context, cfg);
    AlignedBytes workspace(layer.workspace_size(MOEBLAZE_PASS_ROUTER_FORWARD, 3));
    std::vector<int32_t> ids(6);
    std::vector<float> g(6);
    for (float bad : {NAN, INFINITY, -INFINITY}) {
      std::vector<float> logits(12, 0.25f);
      logits[size_t(2 * 4 + 1)] = bad;  // token 2, expert 1
      MB_CHECK_STATUS(
          moeblaze_router_forward(layer.get(), 3, logits.data(), ids.data(), g.data(), nullptr,
                                  nullptr, workspace.data(), workspace.size(), nullptr),
          MOEBLAZE_ERR_NON_FINITE);
      const std::string message = moeblaze_last_error();
      CHECK_MESSAGE(message.find("t=2") != std::string::npos, message);
      CHECK_MESSAGE(message.find("e=1") != std::string::npos, message);
    }
    // Through the whole layer: a NaN in x makes that token's logits NaN.
    Rng rng(1);
    LayerRun run(layer, 5);
    run.init_random(rng);
    run.x.set(3 * 8 + 2, NAN);
    MB_CHECK_STATUS(run.layer_forward(), MOEBLAZE_ERR_NON_FINITE);
    // Router backward checks its logits too.
    std::vector<float> logits(12, 0.0f);
    logits[0] = NAN;
    std::vector<int32_t> good_ids = {0, 1, 1, 2, 2, 3};
    std::vector<float> dg(6, 1.0f), d_logits(12);
    AlignedBytes backward_ws(layer.workspace_size(MOEBLAZE_PASS_ROUTER_BACKWARD, 3));
    MB_CHECK_STATUS(
        moeblaze_router_backward(layer.get(), 3, logits.data(), good_ids.data(), dg.data(), nullptr,
                                 d_logits.data(), backward_ws.data(), backward_ws.size(), nullptr),
        MOEBLAZE_ERR_NON_FINITE);
  }

  TEST_CASE("errors: a saved buffer from another config, T, pass or nothing is VERSION_MISMATCH") {
    Context context;
    Rng rng(test_seed(1010));
    moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 8, 12, 4, 2);
    Layer layer(context, cfg);
    moeblaze_layer_config_t other_cfg = cfg;
    other_cfg.activation = MOEBLAZE_ACTIVATION_GEGLU;  // same sizes, so the same saved size
    Layer other(context, other_cfg);

    LayerRun run(layer, 10);
    run.init_random(rng);
    MB_CHECK(run.experts_forward());

    SUBCASE("another layer configuration") {
      LayerRun foreign(other, 10);
      foreign.init_random(rng);
      foreign.ids = run.ids;
      foreign.saved = run.saved;
      MB_CHECK_STATUS(foreign.experts_backward(), MOEBLAZE_ERR_VERSION_MISMATCH);
    }
    SUBCASE("another token count") {
      LayerRun fewer(layer, 8);
      fewer.init_random(rng);
      fewer.saved = run.saved;  // larger than T=8 needs, so the size check passes
      MB_CHECK_STATUS(fewer.experts_backward(), MOEBLAZE_ERR_VERSION_MISMATCH);
      CHECK(std::string(moeblaze_last_error()).find("num_tokens") != std::string::npos);
    }
    SUBCASE("an experts-forward buffer given to the layer backward") {
      const size_t layer_bytes = layer.saved_size(MOEBLAZE_PASS_LAYER_FORWARD, 10);
      AlignedBytes big(layer_bytes);
      std::memcpy(big.data(), run.saved.data(), run.saved.size());
      run.saved = big;
      MB_CHECK_STATUS(run.layer_backward(), MOEBLAZE_ERR_VERSION_MISMATCH);
    }
    SUBCASE("a buffer no forward pass wrote") {
      run.saved.fill_byte(0);
      MB_CHECK_STATUS(run.experts_backward(), MOEBLAZE_ERR_VERSION_MISMATCH);
    }
    SUBCASE("the matching buffer works") {
      MB_CHECK(run.experts_backward());
    }
  }

  TEST_CASE("errors: bad ids in the experts calls are INVALID_ARGUMENT") {
    Context context;
    Rng rng(test_seed(1111));
    Layer layer(context, make_config(MOEBLAZE_DTYPE_F32, 8, 12, 4, 2));
    LayerRun run(layer, 6);
    run.init_random(rng);
    SUBCASE("forward: out of range") {
      run.ids[5] = 4;
      MB_CHECK_STATUS(run.experts_forward(), MOEBLAZE_ERR_INVALID_ARGUMENT);
      CHECK(std::string(moeblaze_last_error()).find("out of range") != std::string::npos);
    }
    SUBCASE("forward: repeated within a token") {
      run.ids[4] = run.ids[5];
      MB_CHECK_STATUS(run.experts_forward(), MOEBLAZE_ERR_INVALID_ARGUMENT);
    }
    SUBCASE("backward: ids that differ from the forward pass") {
      MB_CHECK(run.experts_forward());
      std::swap(run.ids[0], run.ids[1]);
      MB_CHECK_STATUS(run.experts_backward(), MOEBLAZE_ERR_INVALID_ARGUMENT);
      run.ids[2] = 17;
      MB_CHECK_STATUS(run.experts_backward(), MOEBLAZE_ERR_INVALID_ARGUMENT);
    }
    SUBCASE("router backward: out of range or repeated") {
      std::vector<float> logits(24, 0.0f), dg(12, 1.0f), d_logits(24);
      AlignedBytes ws(layer.workspace_size(MOEBLAZE_PASS_ROUTER_BACKWARD, 6));
      run.ids[7] = -3;
      MB_CHECK_STATUS(
          moeblaze_router_backward(layer.get(), 6, logits.data(), run.ids.data(), dg.data(),
                                   nullptr, d_logits.data(), ws.data(), ws.size(), nullptr),
          MOEBLAZE_ERR_INVALID_ARGUMENT);
      run.ids[7] = run.ids[6];
      MB_CHECK_STATUS(
          moeblaze_router_backward(layer.get(), 6, logits.data(), run.ids.data(), dg.data(),
                                   nullptr, d_logits.data(), ws.data(), ws.size(), nullptr),
          MOEBLAZE_ERR_INVALID_ARGUMENT);
    }
  }

}  // TEST_SUITE
