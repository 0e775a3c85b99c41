// Expert parallelism on the CPU backend with the LOCAL transport (ranks are threads): every rank's
// outputs against moeblaze_layer_forward/backward of the global batch on one CPU layer, at world
// sizes 1, 2, 4, 8, uneven token and expert splits, ranks without tokens, experts without rows,
// k up to 4, every checkpoint policy, F64/F32/BF16, router losses; each step run twice and
// required to repeat bitwise.
//
// Bitwise (all dtypes, design section 5): ids, g, logits, global counts, dg, d_logits, dw_gate,
// dw_up, dw_down; y too for F32 and F64 (for BF16/F16 each expert row is rounded to the storage
// dtype before it travels home: one extra rounding). Tolerance: dx (per-row partial sums, and one
// more rounding per row in 16-bit), the sum of the ranks' dw_router shares and loss shares (partial
// sums in rank order; 16-bit shares are rounded each).
#include <thread>

#include "ep/ep_support.hpp"

using namespace mbtest;
using namespace mbtest::ep;

namespace {

// One rank's whole step through the public API; returns the first failure in `result`.
void run_rank(const EpCase& c, const Global& g, moeblaze_ep_group_t group, int32_t rank, int steps,
              std::vector<RankResult>* results_per_step) {
  const int32_t W = c.world();
  const int64_t T = c.tokens[size_t(rank)];
  const int64_t E = c.E, k = c.k, d = c.d, h = c.h;
  const int32_t rdtype = routing_dtype(c.dtype);
  RankResult failed;
  auto fail_with = [&](moeblaze_status_t status, const char* what) {
    failed.status = status;
    failed.error = std::string(what) + ": " + status_text(status);
    for (auto& r : *results_per_step) r = failed;
  };
#define RANK_CHECK(call)                                \
  do {                                                  \
    const moeblaze_status_t s_ = (call);                \
    if (s_ != MOEBLAZE_OK) return fail_with(s_, #call); \
  } while (0)

  moeblaze_context_t context = nullptr;
  RANK_CHECK(moeblaze_context_create(&context, MOEBLAZE_BACKEND_CPU, 0));
  struct ContextGuard {
    moeblaze_context_t c;
    ~ContextGuard() { moeblaze_context_destroy(c); }
  } context_guard{context};
  RANK_CHECK(moeblaze_context_set_num_threads(context, 2));
  const moeblaze_layer_config_t config = c.config();
  moeblaze_ep_config_t ep;
  RANK_CHECK(moeblaze_ep_config_init(&ep, sizeof ep));
  ep.transport = MOEBLAZE_EP_TRANSPORT_LOCAL;
  ep.rank = rank;
  ep.world_size = W;
  ep.communicator = group;
  moeblaze_ep_layer_t layer = nullptr;
  RANK_CHECK(moeblaze_ep_layer_create(&layer, context, &config, &ep));
  struct LayerGuard {
    moeblaze_ep_layer_t l;
    ~LayerGuard() { moeblaze_ep_layer_destroy(l); }
  } layer_guard{layer};

  int64_t begin = -1, end = -1;
  RANK_CHECK(moeblaze_ep_layer_get_experts(layer, &begin, &end));
  const int64_t Er = end - begin;
  const int64_t t0 = c.token_begin(rank);
  const HostTensor x = slice_rows(g.x, t0, T, d, {T, d});
  const HostTensor dy = slice_rows(g.dy, t0, T, d, {T, d});
  const HostTensor w_gate = slice_rows(g.w_gate, begin, Er, h * d, {Er, h, d});
  const HostTensor w_up = slice_rows(g.w_up, begin, Er, h * d, {Er, h, d});
  const HostTensor w_down = slice_rows(g.w_down, begin, Er, d * h, {Er, d, h});

  size_t exchange_bytes = 0, home_bytes = 0, begin_ws = 0;
  RANK_CHECK(moeblaze_ep_layer_exchange_size(layer, &exchange_bytes));
  RANK_CHECK(moeblaze_ep_layer_saved_size(layer, MOEBLAZE_EP_SAVED_HOME, T, 0, &home_bytes));
  RANK_CHECK(
      moeblaze_ep_layer_workspace_size(layer, MOEBLAZE_EP_PASS_FORWARD_BEGIN, T, 0, &begin_ws));

  for (int step = 0; step < steps; ++step) {
    RankResult r;
    r.expert_begin = begin;
    r.expert_end = end;
    r.y.reset(c.dtype, {T, d});
    r.dx.reset(c.dtype, {T, d});
    r.dw_router.reset(c.dtype, {E, d});
    r.dw_gate.reset(c.dtype, {Er, h, d});
    r.dw_up.reset(c.dtype, {Er, h, d});
    r.dw_down.reset(c.dtype, {Er, d, h});
    r.dg.reset(rdtype, {T, k});
    r.d_logits.reset(rdtype, {T, E});
    r.logits.reset(rdtype, {T, E});
    r.g.reset(rdtype, {T, k});
    r.losses.reset(rdtype, {2});
    for (HostTensor* t : {&r.y, &r.dx, &r.dw_router, &r.dw_gate, &r.dw_up, &r.dw_down, &r.dg,
                          &r.d_logits, &r.logits, &r.g, &r.losses}) {
      t->fill(NAN);  // a skipped write is visible
    }
    r.ids.assign(size_t(T * k), -1);
    r.counts.assign(size_t(E), -1);

    AlignedBytes exchange(exchange_bytes), home(home_bytes), workspace(begin_ws);
    workspace.fill_byte(0xff);
    moeblaze_ep_forward_args_t fa;
    RANK_CHECK(moeblaze_ep_forward_args_init(&fa, sizeof fa));
    fa.num_tokens = T;
    fa.x = x.data();
    fa.w_router = g.w_router.data();
    fa.w_gate = w_gate.data();
    fa.w_up = c.gated() ? w_up.data() : nullptr;
    fa.w_down = w_down.data();
    fa.y = r.y.data();
    fa.logits_out = r.logits.data();
    fa.ids_out = r.ids.data();
    fa.g_out = r.g.data();
    fa.expert_counts = r.counts.data();
    fa.losses = r.losses.data();
    fa.home_saved = home.data();
    fa.home_saved_bytes = home.size();
    fa.workspace = workspace.data();
    fa.workspace_bytes = workspace.size();
    int64_t R = -1;
    RANK_CHECK(
        moeblaze_ep_forward_begin(layer, &fa, exchange.data(), exchange.size(), &R, nullptr));
    r.recv_rows = R;

    size_t expert_bytes = 0, finish_ws = 0, backward_ws = 0;
    RANK_CHECK(moeblaze_ep_layer_saved_size(layer, MOEBLAZE_EP_SAVED_EXPERT, T, R, &expert_bytes));
    RANK_CHECK(
        moeblaze_ep_layer_workspace_size(layer, MOEBLAZE_EP_PASS_FORWARD_FINISH, T, R, &finish_ws));
    RANK_CHECK(moeblaze_ep_layer_workspace_size_with_flags(layer, MOEBLAZE_EP_PASS_BACKWARD, T, R,
                                                           c.backward_flags, &backward_ws));
    AlignedBytes expert(expert_bytes);
    workspace.resize(finish_ws);
    workspace.fill_byte(0xff);
    fa.expert_saved = expert.data();
    fa.expert_saved_bytes = expert.size();
    fa.workspace = workspace.data();
    fa.workspace_bytes = workspace.size();
    RANK_CHECK(moeblaze_ep_forward_finish(layer, &fa, exchange.data(), exchange.size(), nullptr));

    workspace.resize(backward_ws);
    workspace.fill_byte(0xff);
    moeblaze_ep_backward_args_t ba;
    RANK_CHECK(moeblaze_ep_backward_args_init(&ba, sizeof ba));
    ba.num_tokens = T;
    ba.flags = c.backward_flags;
    ba.dy = dy.data();
    ba.d_losses = g.d_losses.data();
    ba.x = x.data();
    ba.w_router = g.w_router.data();
    ba.w_gate = w_gate.data();
    ba.w_up = c.gated() ? w_up.data() : nullptr;
    ba.w_down = w_down.data();
    ba.home_saved = home.data();
    ba.home_saved_bytes = home.size();
    ba.expert_saved = expert.data();
    ba.expert_saved_bytes = expert.size();
    ba.dx = r.dx.data();
    ba.dw_router = r.dw_router.data();
    ba.dw_gate = r.dw_gate.data();
    ba.dw_up = c.gated() ? r.dw_up.data() : nullptr;
    ba.dw_down = r.dw_down.data();
    ba.dg = r.dg.data();
    ba.d_logits = r.d_logits.data();
    ba.workspace = workspace.data();
    ba.workspace_bytes = workspace.size();
    RANK_CHECK(moeblaze_ep_backward(layer, &ba, exchange.data(), exchange.size(), nullptr));
    (*results_per_step)[size_t(step)] = std::move(r);
  }
#undef RANK_CHECK
}

// [step][rank]
std::vector<std::vector<RankResult>> run_ep(const EpCase& c, const Global& g, int steps) {
  const int32_t W = c.world();
  moeblaze_ep_group_t group = nullptr;
  MB_CHECK(moeblaze_ep_local_group_create(&group, W));
  std::vector<std::vector<RankResult>> per_rank(
      static_cast<size_t>(W), std::vector<RankResult>(static_cast<size_t>(steps)));
  std::vector<std::thread> threads;
  for (int32_t rank = 0; rank < W; ++rank) {
    threads.emplace_back(run_rank, std::cref(c), std::cref(g), group, rank, steps,
                         &per_rank[size_t(rank)]);
  }
  for (auto& t : threads) t.join();
  MB_CHECK(moeblaze_ep_local_group_destroy(group));
  std::vector<std::vector<RankResult>> out(static_cast<size_t>(steps),
                                           std::vector<RankResult>(static_cast<size_t>(W)));
  for (int32_t rank = 0; rank < W; ++rank) {
    for (int s = 0; s < steps; ++s) {
      const RankResult& r = per_rank[size_t(rank)][size_t(s)];
      REQUIRE_MESSAGE(r.status == MOEBLAZE_OK, "rank " << rank << ": " << r.error);
      out[size_t(s)][size_t(rank)] = r;
    }
  }
  return out;
}

void check_case(const EpCase& c) {
  INFO(c.describe());
  MESSAGE("case: " << c.describe());
  const Global g = make_global(c, true);
  const auto runs = run_ep(c, g, 2);
  const auto& ranks = runs[0];
  const int32_t W = c.world();
  const int64_t E = c.E, k = c.k, d = c.d, h = c.h;

  double worst_dx = 0;  // largest |error| relative to the largest |dx|, for the report
  std::vector<double> dw_router_sum(size_t(E * d), 0.0);
  double aux = 0, z = 0;
  int64_t recv_total = 0;
  for (int32_t rank = 0; rank < W; ++rank) {
    const RankResult& r = ranks[size_t(rank)];
    const std::string who = "rank " + std::to_string(rank) + ": ";
    const int64_t t0 = c.token_begin(rank);
    const auto range = expert_range(E, W, rank);
    CHECK(r.expert_begin == range.first);
    CHECK(r.expert_end == range.second);
    recv_total += r.recv_rows;

    check_bitwise(who + "logits", r.logits, g.logits, t0 * E);
    check_bitwise(who + "g", r.g, g.g, t0 * k);
    CHECK_MESSAGE(std::equal(r.ids.begin(), r.ids.end(), g.ids.begin() + t0 * k),
                  who << "ids differ from the one-device router's");
    CHECK_MESSAGE(r.counts == g.counts, who << "expert_counts are not the global counts");
    check_bitwise(who + "dg", r.dg, g.dg, t0 * k);
    check_bitwise(who + "d_logits", r.d_logits, g.d_logits, t0 * E);
    check_bitwise(who + "dw_gate", r.dw_gate, g.dw_gate, range.first * h * d);
    if (c.gated()) check_bitwise(who + "dw_up", r.dw_up, g.dw_up, range.first * h * d);
    check_bitwise(who + "dw_down", r.dw_down, g.dw_down, range.first * d * h);

    const HostTensor dx_ref =
        slice_rows(g.dx, t0, c.tokens[size_t(rank)], d, {c.tokens[size_t(rank)], d});
    // Every dtype: both layers round each routed row to the storage dtype before the k-way sum.
    check_bitwise(who + "y", r.y, g.y, t0 * d);
    const CompareResult dx_error =
        compare(who + "dx", r.dx, dx_ref.to_vector(),
                tolerance_for(c.dtype, k * h + E, std::max(1.0, max_abs(dx_ref.to_vector()))));
    worst_dx = std::max(worst_dx, dx_error.max_abs / std::max(1e-300, max_abs(dx_ref.to_vector())));
    for (int64_t i = 0; i < E * d; ++i) dw_router_sum[size_t(i)] += r.dw_router.get(i);
    aux += r.losses.get(0);
    z += r.losses.get(1);

    // Run to run: every output bitwise the same.
    const RankResult& again = runs[1][size_t(rank)];
    CHECK(again.recv_rows == r.recv_rows);
    check_same_run(who + "y", r.y, again.y);
    check_same_run(who + "dx", r.dx, again.dx);
    check_same_run(who + "dw_router", r.dw_router, again.dw_router);
    check_same_run(who + "dw_gate", r.dw_gate, again.dw_gate);
    check_same_run(who + "dw_up", r.dw_up, again.dw_up);
    check_same_run(who + "dw_down", r.dw_down, again.dw_down);
    check_same_run(who + "dg", r.dg, again.dg);
    check_same_run(who + "d_logits", r.d_logits, again.d_logits);
    check_same_run(who + "losses", r.losses, again.losses);
  }
  CHECK(recv_total == c.global_tokens() * k);  // every routed pair reached exactly one expert

  const std::vector<double> dw_router_ref = g.dw_router.to_vector();
  // Each share is rounded to the storage dtype; W of them add up in rank order.
  const CompareResult router_error =
      compare("sum of the ranks' dw_router shares", dw_router_sum, dw_router_ref,
              tolerance_for(c.dtype, c.global_tokens() + W,
                            double(W) * std::max(1.0, max_abs(dw_router_ref))));
  const double loss_rtol = c.dtype == MOEBLAZE_DTYPE_F64 ? 1e-13 : 2e-6;
  const CompareResult loss_error =
      compare("sum of the ranks' loss shares", {aux, z}, {g.losses.get(0), g.losses.get(1)},
              {loss_rtol, loss_rtol});
  MESSAGE("errors relative to the largest magnitude: dx "
          << worst_dx << ", dw_router "
          << router_error.max_abs / std::max(1e-300, max_abs(dw_router_ref)) << ", losses "
          << loss_error.max_rel << "; y bitwise");
  if (W == 1) {
    CHECK_MESSAGE(ranks[0].losses.bitwise_equal(g.losses),
                  "one rank: the loss shares are the router's losses, bitwise");
    check_bitwise("one rank: dw_router", ranks[0].dw_router, g.dw_router, 0);
  }
}

}  // namespace

TEST_CASE("ep cpu: world sizes 1, 2, 4, 8, F32 SwiGLU k=2, uneven tokens, a rank without tokens") {
  const uint64_t seed = test_seed(20261201);
  for (int32_t W : {1, 2, 4, 8}) {
    EpCase c;
    c.E = 8;
    c.k = 2;
    c.seed = seed + uint64_t(W);
    c.tokens.clear();
    for (int32_t r = 0; r < W; ++r) c.tokens.push_back(r == 1 ? 0 : 5 + 3 * r);
    SUBCASE(("W=" + std::to_string(W)).c_str()) {
      check_case(c);
    }
  }
}

TEST_CASE("ep cpu: uneven experts over ranks (E=6 on W=4, E=5 on W=2), k=3") {
  const uint64_t seed = test_seed(20261202);
  EpCase c;
  c.seed = seed;
  c.k = 3;
  SUBCASE("E=6 W=4") {
    c.E = 6;
    c.tokens = {7, 4, 9, 3};
    check_case(c);
  }
  SUBCASE("E=5 W=2, aux and z losses") {
    c.E = 5;
    c.aux = 0.01f;
    c.z = 0.001f;
    c.tokens = {6, 11};
    check_case(c);
  }
}

TEST_CASE("ep cpu: empty experts and ranks that receive no rows (E=8, k=1, W=4, 3 tokens)") {
  EpCase c;
  c.seed = test_seed(20261203);
  c.E = 8;
  c.k = 1;
  c.tokens = {2, 0, 1, 0};
  check_case(c);
}

TEST_CASE("ep cpu: an empty global batch") {
  EpCase c;
  c.seed = test_seed(20261204);
  c.tokens = {0, 0};
  c.aux = 0.01f;
  check_case(c);
}

TEST_CASE("ep cpu: k=4, activations, score functions") {
  const uint64_t seed = test_seed(20261205);
  EpCase c;
  c.seed = seed;
  c.E = 8;
  c.k = 4;
  c.tokens = {6, 9};
  SUBCASE("GeGLU, top-k then softmax") {
    c.activation = MOEBLAZE_ACTIVATION_GEGLU;
    c.score_function = MOEBLAZE_SCORE_TOPK_SOFTMAX;
    check_case(c);
  }
  SUBCASE("ReLU (not gated), sigmoid, renormalised, aux and z") {
    c.activation = MOEBLAZE_ACTIVATION_RELU;
    c.score_function = MOEBLAZE_SCORE_SIGMOID;
    c.renormalize = 1;
    c.aux = 0.02f;
    c.z = 0.003f;
    check_case(c);
  }
}

TEST_CASE("ep cpu: MOEBLAZE_BACKWARD_CONSUME_SAVED is accepted (the CPU backend ignores it)") {
  // The same outputs as without the flag (check_case compares with the one-device layer); the
  // CUDA suite checks the GPU's in-place backward.
  EpCase c;
  c.tokens = {7, 0, 12};
  c.seed = test_seed(20261204);
  c.backward_flags = MOEBLAZE_BACKWARD_CONSUME_SAVED;
  for (int32_t checkpoint : {MOEBLAZE_CHECKPOINT_SAVE_PREACT, MOEBLAZE_CHECKPOINT_SAVE_ALL}) {
    c.checkpoint = checkpoint;
    check_case(c);
  }
}

TEST_CASE("ep cpu: every checkpoint policy") {
  const uint64_t seed = test_seed(20261206);
  for (int32_t policy : {MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_SAVE_PREACT,
                         MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
    EpCase c;
    c.seed = seed;
    c.checkpoint = policy;
    c.tokens = {5, 8, 3};
    SUBCASE(("checkpoint " + std::to_string(policy)).c_str()) {
      check_case(c);
    }
  }
}

TEST_CASE("ep cpu: F64 and BF16 (and F16), with router losses") {
  const uint64_t seed = test_seed(20261207);
  EpCase c;
  c.seed = seed;
  c.aux = 0.01f;
  c.z = 0.001f;
  c.tokens = {7, 0, 5, 6};
  SUBCASE("F64, SiLU, sigmoid, k=3") {
    c.dtype = MOEBLAZE_DTYPE_F64;
    c.activation = MOEBLAZE_ACTIVATION_SILU;
    c.score_function = MOEBLAZE_SCORE_SIGMOID;
    c.k = 3;
    check_case(c);
  }
  SUBCASE("BF16 SwiGLU k=2") {
    c.dtype = MOEBLAZE_DTYPE_BF16;
    check_case(c);
  }
  SUBCASE("F16 ReGLU k=2") {
    c.dtype = MOEBLAZE_DTYPE_F16;
    c.activation = MOEBLAZE_ACTIVATION_REGLU;
    check_case(c);
  }
}
