// Helpers of the expert-parallel suites (tests/ep): the global problem (every rank's tokens
// concatenated in rank order, full weights), its one-device reference through the public layer
// calls, and the per-rank results of an EP run, compared bitwise where the design says the values
// are the same numbers (docs/design/expert-parallel.md, section 5) and with the tolerance table
// elsewhere.
#pragma once

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "support/test_support.hpp"

namespace mbtest {
namespace ep {

struct EpCase {
  int32_t dtype = MOEBLAZE_DTYPE_F32;
  int64_t d = 16, h = 24, E = 8, k = 2;
  int32_t activation = MOEBLAZE_ACTIVATION_SWIGLU;
  int32_t checkpoint = MOEBLAZE_CHECKPOINT_SAVE_PREACT;
  int32_t score_function = MOEBLAZE_SCORE_SOFTMAX_TOPK;
  int32_t renormalize = 0;
  float aux = 0.0f, z = 0.0f;
  std::vector<int64_t> tokens;  // per rank; world size = tokens.size()
  uint64_t seed = 1;
  uint32_t backward_flags = 0;  // MOEBLAZE_BACKWARD_CONSUME_SAVED or 0 (moeblaze_ep_backward)

  int32_t world() const { return int32_t(tokens.size()); }
  int64_t global_tokens() const {
    int64_t total = 0;
    for (int64_t t : tokens) total += t;
    return total;
  }
  int64_t token_begin(int32_t rank) const {
    int64_t begin = 0;
    for (int32_t r = 0; r < rank; ++r) begin += tokens[size_t(r)];
    return begin;
  }
  bool gated() const { return is_gated(activation); }
  moeblaze_layer_config_t config() const {
    moeblaze_layer_config_t c = make_config(dtype, d, h, E, k);
    c.activation = activation;
    c.checkpoint = checkpoint;
    c.score_function = score_function;
    c.renormalize = renormalize;
    c.aux_loss_coeff = aux;
    c.z_loss_coeff = z;
    return c;
  }
  std::string describe() const {
    std::ostringstream s;
    s << mbtest::describe(config()) << " W=" << world() << " tokens={";
    for (size_t r = 0; r < tokens.size(); ++r) s << (r ? "," : "") << tokens[r];
    s << "} seed=" << seed;
    if (backward_flags & MOEBLAZE_BACKWARD_CONSUME_SAVED) s << " CONSUME_SAVED";
    return s.str();
  }
};

// The contiguous split of E experts over W ranks (the library's rule, restated independently).
inline std::pair<int64_t, int64_t> expert_range(int64_t E, int32_t W, int32_t rank) {
  const int64_t base = E / W, extra = E % W;
  int64_t begin = 0;
  for (int32_t r = 0; r < rank; ++r) begin += base + (r < extra ? 1 : 0);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

// A copy of rows [row_begin, row_begin + rows) of a tensor whose rows hold row_elems elements.
inline HostTensor slice_rows(const HostTensor& t, int64_t row_begin, int64_t rows,
                             int64_t row_elems, std::vector<int64_t> shape) {
  HostTensor out(t.dtype(), std::move(shape));
  const size_t es = dtype_bytes(t.dtype());
  REQUIRE(out.numel() == rows * row_elems);
  if (out.bytes()) {
    std::memcpy(out.data(),
                static_cast<const unsigned char*>(t.data()) + row_begin * row_elems * es,
                out.bytes());
  }
  return out;
}

// Inputs of the global problem and the one-device reference outputs.
struct Global {
  HostTensor x, dy, w_router, w_gate, w_up, w_down, d_losses;
  // reference (moeblaze_layer_forward/backward on the global batch; dg from the experts calls)
  HostTensor y, dx, dw_router, dw_gate, dw_up, dw_down, dg, d_logits, logits, g, losses;
  std::vector<int32_t> ids, counts;
};

inline Global make_global(const EpCase& c, bool with_reference) {
  const int64_t T = c.global_tokens();
  const int32_t rdtype = routing_dtype(c.dtype);
  Global g;
  Rng rng(c.seed);
  g.x.reset(c.dtype, {T, c.d});
  g.dy.reset(c.dtype, {T, c.d});
  g.w_router.reset(c.dtype, {c.E, c.d});
  g.w_gate.reset(c.dtype, {c.E, c.h, c.d});
  g.w_up.reset(c.dtype, {c.E, c.h, c.d});
  g.w_down.reset(c.dtype, {c.E, c.d, c.h});
  g.d_losses.reset(rdtype, {2});
  fill_normal(g.x, rng, 1.0);
  fill_normal(g.dy, rng, 1.0);
  fill_normal(g.w_router, rng, 1.0 / std::sqrt(double(c.d)));
  fill_normal(g.w_gate, rng, 1.0 / std::sqrt(double(c.d)));
  fill_normal(g.w_up, rng, 1.0 / std::sqrt(double(c.d)));
  fill_normal(g.w_down, rng, 1.0 / std::sqrt(double(c.h)));
  g.d_losses.set(0, 0.75);
  g.d_losses.set(1, 1.25);
  if (!with_reference) return g;

  Context context;
  Layer layer(context, c.config());
  auto copy_in = [](HostTensor& dst, const HostTensor& src) {
    REQUIRE(dst.bytes() == src.bytes());
    if (src.bytes()) std::memcpy(dst.data(), src.data(), src.bytes());
  };
  LayerRun run(layer, T);
  copy_in(run.x, g.x);
  copy_in(run.dy, g.dy);
  copy_in(run.w_router, g.w_router);
  copy_in(run.w_gate, g.w_gate);
  copy_in(run.w_up, g.w_up);
  copy_in(run.w_down, g.w_down);
  copy_in(run.d_losses, g.d_losses);
  run.use_d_losses = true;
  run.clear_outputs();
  MB_CHECK(run.layer_forward());
  MB_CHECK(run.layer_backward());
  g.y = run.y;
  g.dx = run.dx;
  g.dw_router = run.dw_router;
  g.dw_gate = run.dw_gate;
  g.dw_up = run.dw_up;
  g.dw_down = run.dw_down;
  g.d_logits = run.d_logits;
  g.logits = run.logits;
  g.g = run.g_out;
  g.losses = run.losses;
  g.ids = run.ids_out;
  g.counts = run.expert_counts;

  // dg of the routed pairs: the experts backward with the router's ids and g (the layer backward
  // computes exactly this internally but does not expose it).
  LayerRun experts(layer, T);
  copy_in(experts.x, g.x);
  copy_in(experts.dy, g.dy);
  copy_in(experts.w_gate, g.w_gate);
  copy_in(experts.w_up, g.w_up);
  copy_in(experts.w_down, g.w_down);
  experts.ids = g.ids;
  copy_in(experts.g, g.g);
  experts.clear_outputs();
  MB_CHECK(experts.experts_forward());
  MB_CHECK(experts.experts_backward());
  g.dg = experts.dg;
  return g;
}

// What one rank produced in one EP step (host copies).
struct RankResult {
  moeblaze_status_t status = MOEBLAZE_OK;
  std::string error;
  int64_t expert_begin = -1, expert_end = -1, recv_rows = -1;
  HostTensor y, dx, dw_router, dw_gate, dw_up, dw_down, dg, d_logits, logits, g, losses;
  std::vector<int32_t> ids, counts;
};

// Bitwise equality of got (whole tensor) with rows [row_begin, ...) of ref; reports the first
// difference.
inline void check_bitwise(const std::string& name, const HostTensor& got, const HostTensor& ref,
                          int64_t elem_begin) {
  const size_t es = dtype_bytes(got.dtype());
  REQUIRE(got.dtype() == ref.dtype());
  REQUIRE(elem_begin + got.numel() <= ref.numel());
  const bool same = got.bytes() == 0 || std::memcmp(got.data(),
                                                    static_cast<const unsigned char*>(ref.data()) +
                                                        size_t(elem_begin) * es,
                                                    got.bytes()) == 0;
  if (same) return;
  int64_t first = -1, count = 0;
  double worst = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double a = got.get(i), b = ref.get(elem_begin + i);
    if (std::memcmp(static_cast<const unsigned char*>(got.data()) + size_t(i) * es,
                    static_cast<const unsigned char*>(ref.data()) + size_t(elem_begin + i) * es,
                    es) != 0) {
      if (first < 0) first = i;
      ++count;
      worst = std::max(worst, std::fabs(a - b));
    }
  }
  FAIL_CHECK(name << ": not bitwise equal to the one-device layer: " << count << " of "
                  << got.numel() << " differ, max |diff| = " << worst << ", first at [" << first
                  << "]: got " << got.get(first) << " expected " << ref.get(elem_begin + first));
}

inline void check_same_run(const std::string& name, const HostTensor& a, const HostTensor& b) {
  CHECK_MESSAGE(a.bitwise_equal(b), name << ": the two runs differ (not bitwise repeatable)");
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

}  // namespace ep
}  // namespace mbtest
