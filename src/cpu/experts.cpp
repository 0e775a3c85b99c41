// Expert MLPs, forward and backward, on index-based routing (no permuted copy of the tokens).
//
// Forward:  build indices -> first GEMM (a, b gathered from x; u = act(a, b) in its epilogue)
//           -> second GEMM u . w_down^T, reduced per token over j = 0..k-1 with weights g -> y.
// Backward: check the saved header -> a, b (saved or recomputed), u (saved or recomputed)
//           -> per routed row: v = dy . w_down[e], dg = <v, u>, dU = g v, (da, db) = act'(a, b) dU
//           -> dw_down = (g dy)^T u, dw_gate = da^T x, dw_up = db^T x (grouped, ascending rows)
//           -> dx = sum_j da . w_gate[e] + db . w_up[e], reduced per token.
// Rounding (the numerics contract, docs/design/routing.md): a, b, u, da, db are rounded to the
// storage dtype; v stays in the accumulation type; each routed row of the second GEMM (times g)
// and of dx is rounded to the storage dtype, and y and dx are their per-token sums over j
// ascending in the accumulation type, rounded once: the expert-parallel layer's sums, bit for bit.
#include <cstring>

#include "common/activation_math.hpp"
#include "common/routing_index.hpp"
#include "cpu/cpu_kernels.hpp"

namespace moeblaze {
namespace cpu {

ExpertsForwardScratch carve_experts_forward_scratch(Carver& carver, const LayerDesc& desc,
                                                    int64_t T, bool with_saved) {
  const int64_t N = T * desc.k;
  ExpertsForwardScratch scratch;
  // With a saved buffer the indices (and, under SAVE_ALL, u) are written there instead.
  if (!with_saved) {
    scratch.expert_offsets = carver.carve<int32_t>(sizeof(int32_t) * size_t(desc.E + 1));
    scratch.expert_token_indices = carver.carve<int32_t>(sizeof(int32_t) * size_t(N));
    scratch.token_index_map = carver.carve<int32_t>(sizeof(int32_t) * size_t(N));
  }
  scratch.routing = carve_routing_scratch(carver, desc, T);
  if (!(with_saved && desc.checkpoint == Checkpoint::SaveAll)) {
    scratch.u = carver.carve(desc.elem_size() * size_t(N) * size_t(desc.h));
  }
  return scratch;
}

ExpertsBackwardScratch carve_experts_backward_scratch(Carver& carver, const LayerDesc& desc,
                                                      int64_t T) {
  const int64_t N = T * desc.k;
  const size_t act_bytes = desc.elem_size() * size_t(N) * size_t(desc.h);
  ExpertsBackwardScratch scratch;
  if (desc.checkpoint == Checkpoint::Recompute) {
    scratch.a = carver.carve(act_bytes);
    if (desc.gated()) scratch.b = carver.carve(act_bytes);
  }
  if (desc.checkpoint != Checkpoint::SaveAll) scratch.u = carver.carve(act_bytes);
  scratch.da = carver.carve(act_bytes);
  if (desc.gated()) scratch.db = carver.carve(act_bytes);
  scratch.row_g = carver.carve(desc.relem_size() * size_t(N));
  return scratch;
}

namespace {

// The index arrays of one forward pass.
struct RoutingIndex {
  const int32_t* expert_offsets;        // [E+1]
  const int32_t* expert_token_indices;  // [N]
  const int32_t* token_index_map;       // [N]
};

// First GEMM with its activation epilogue, for every routed row r (token t =
// expert_token_indices[r], expert e): a[r] = x[t] . w_gate[e]^T, b[r] = x[t] . w_up[e]^T, u[r] =
// act(a[r], b[r]), each rounded to S. a and b rows are ab_ld elements apart (the saved buffer's
// [N, 2h] a|b block, or h), u rows h. Outputs that are nullptr are not written. Forward and
// backward's recomputation both run this one function, so every checkpoint policy sees the same a,
// b and u bit for bit.
template <typename S>
void first_gemm(const LayerDesc& desc, const RoutingIndex& index, int64_t N, const S* x,
                const S* w_gate, const S* w_up, S* a_out, S* b_out, int64_t ab_ld, S* u_out,
                ThreadPool& pool) {
  using Acc = acc_t<S>;
  const int64_t d = desc.d;
  const int64_t h = desc.h;
  const bool gated = desc.gated();
  pool.parallel_for(N, [&](int64_t begin, int64_t end) {
    // The expert of row `begin`: the last e with expert_offsets[e] <= begin.
    int64_t e =
        std::upper_bound(index.expert_offsets, index.expert_offsets + desc.E + 1, int32_t(begin)) -
        index.expert_offsets - 1;
    for (int64_t r = begin; r < end; ++r) {
      while (r >= index.expert_offsets[e + 1]) ++e;
      const S* x_row = x + int64_t(index.expert_token_indices[r]) * d;
      const S* gate = w_gate + e * h * d;
      const S* up = gated ? w_up + e * h * d : nullptr;
      for (int64_t i = 0; i < h; ++i) {
        const S a = from_acc<S>(dot<Acc>(x_row, gate + i * d, d));
        const S b = gated ? from_acc<S>(dot<Acc>(x_row, up + i * d, d)) : from_acc<S>(Acc(0));
        if (a_out) a_out[r * ab_ld + i] = a;
        if (b_out) b_out[r * ab_ld + i] = b;
        if (u_out) {
          u_out[r * h + i] =
              from_acc<S>(act_math::forward<Acc>(desc.activation, to_acc(a), to_acc(b)));
        }
      }
    }
  });
}

template <typename S>
void experts_forward_typed(const LayerDesc& desc, const ExpertsForwardCall& call,
                           ThreadPool& pool) {
  using Acc = acc_t<S>;
  const int64_t T = call.T;
  const int64_t k = desc.k;
  const int64_t d = desc.d;
  const int64_t h = desc.h;
  const int64_t N = T * k;
  const S* x = static_cast<const S*>(call.x);            // [T, d]
  const Acc* g = static_cast<const Acc*>(call.g);        // [T, k] routing dtype
  const S* w_down = static_cast<const S*>(call.w_down);  // [E, d, h]
  S* y = static_cast<S*>(call.y);                        // [T, d]

  Carver carver(call.workspace.ptr);
  const ExpertsForwardScratch scratch =
      carve_experts_forward_scratch(carver, desc, T, call.has_saved);
  const SavedView& saved = call.saved;
  int32_t* offsets = call.has_saved ? saved.expert_offsets : scratch.expert_offsets;
  int32_t* token_indices =
      call.has_saved ? saved.expert_token_indices : scratch.expert_token_indices;
  int32_t* index_map = call.has_saved ? saved.token_index_map : scratch.token_index_map;
  build_routing(desc, T, call.ids, offsets, token_indices, index_map, scratch.routing, pool);
  const RoutingIndex index{offsets, token_indices, index_map};

  if (call.expert_counts) {
    for (int64_t e = 0; e < desc.E; ++e) call.expert_counts[e] = offsets[e + 1] - offsets[e];
  }

  // What the checkpoint policy keeps goes straight to the saved buffer; u is transient otherwise.
  S* a_saved = call.has_saved ? static_cast<S*>(saved.a) : nullptr;
  S* b_saved = call.has_saved ? static_cast<S*>(saved.b) : nullptr;
  S* u = call.has_saved && saved.u ? static_cast<S*>(saved.u) : static_cast<S*>(scratch.u);
  first_gemm<S>(desc, index, N, x, static_cast<const S*>(call.w_gate),
                static_cast<const S*>(call.w_up), a_saved, b_saved, saved.ab_ld, u, pool);

  // Second GEMM and combine: y[t, c] = sum_j S(g[t, j] * (u[r_j] . w_down[e_j][c])), j
  // ascending in Acc, each weighted row rounded to S first.
  pool.parallel_for(T, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < d; ++c) {
        Acc acc = 0;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t r = index_map[t * k + j];
          const int64_t e = call.ids[t * k + j];
          const Acc row = Acc(g[t * k + j]) * dot<Acc>(u + r * h, w_down + (e * d + c) * h, h);
          acc += Acc(to_acc(from_acc<S>(row)));
        }
        y[t * d + c] = from_acc<S>(acc);
      }
    }
  });

  if (call.has_saved) *saved.header = make_saved_header(desc, call.saved_pass, T);
}

void check_saved_header(const LayerDesc& desc, const ExpertsBackwardCall& call) {
  const SavedHeader* header = call.saved.header;
  MB_REQUIRE(header->magic == kSavedMagic, MOEBLAZE_ERR_VERSION_MISMATCH,
             "saved: not a buffer written by a moeblaze forward pass (magic 0x%08x, expected "
             "0x%08x)",
             unsigned(header->magic), unsigned(kSavedMagic));
  MB_REQUIRE(header->version == uint32_t(MOEBLAZE_VERSION), MOEBLAZE_ERR_VERSION_MISMATCH,
             "saved: written by moeblaze version %u, this is version %u", unsigned(header->version),
             unsigned(MOEBLAZE_VERSION));
  MB_REQUIRE(header->pass == uint32_t(call.saved_pass), MOEBLAZE_ERR_VERSION_MISMATCH,
             "saved: written by pass %u, but this backward pass needs the buffer of pass %u "
             "(experts and layer forward buffers are not interchangeable)",
             unsigned(header->pass), unsigned(call.saved_pass));
  MB_REQUIRE(header->reserved == 0, MOEBLAZE_ERR_VERSION_MISMATCH,
             "saved: header field `reserved` = %u, but this library writes 0 (the buffer was "
             "overwritten or comes from another version)",
             unsigned(header->reserved));
  MB_REQUIRE(header->layer_hash == desc.hash(), MOEBLAZE_ERR_VERSION_MISMATCH,
             "saved: written by a layer with another configuration (hash 0x%016llx, this layer "
             "0x%016llx)",
             (unsigned long long)header->layer_hash, (unsigned long long)desc.hash());
  MB_REQUIRE(header->num_tokens == call.T, MOEBLAZE_ERR_VERSION_MISMATCH,
             "saved: written for num_tokens = %lld, but backward got num_tokens = %lld",
             (long long)header->num_tokens, (long long)call.T);
}

template <typename S>
void experts_backward_typed(const LayerDesc& desc, const ExpertsBackwardCall& call,
                            ThreadPool& pool) {
  using Acc = acc_t<S>;
  const int64_t T = call.T;
  const int64_t E = desc.E;
  const int64_t k = desc.k;
  const int64_t d = desc.d;
  const int64_t h = desc.h;
  const int64_t N = T * k;
  const bool gated = desc.gated();
  const S* dy = static_cast<const S*>(call.dy);          // [T, d]
  const S* x = static_cast<const S*>(call.x);            // [T, d]
  const Acc* g = static_cast<const Acc*>(call.g);        // [T, k] routing dtype
  const S* w_gate = static_cast<const S*>(call.w_gate);  // [E, h, d]
  const S* w_up = static_cast<const S*>(call.w_up);      // [E, h, d], gated only
  const S* w_down = static_cast<const S*>(call.w_down);  // [E, d, h]

  check_saved_header(desc, call);
  const SavedView& saved = call.saved;
  const RoutingIndex index{saved.expert_offsets, saved.expert_token_indices, saved.token_index_map};
  // The saved buffer is the caller's memory: its indices are checked before any is followed, and
  // the ids given to backward must be those they were built from (the whole-layer backward takes
  // them from `saved` too).
  check_routing_index(T, k, E, index.expert_offsets, index.expert_token_indices,
                      index.token_index_map, "saved");
  check_ids_match_routing_index(T, k, E, call.ids, index.expert_offsets, index.token_index_map,
                                call.ids == saved.ids ? "saved ids" : "ids", "saved");

  Carver carver(call.workspace.ptr);
  const ExpertsBackwardScratch scratch = carve_experts_backward_scratch(carver, desc, T);

  // a, b, u exactly as the forward pass computed them.
  const S* a = static_cast<const S*>(saved.a);
  const S* b = static_cast<const S*>(saved.b);
  const S* u = static_cast<const S*>(saved.u);
  int64_t ab_ld = saved.ab_ld;  // a, b rows: [r * ab_ld, + h)
  if (desc.checkpoint == Checkpoint::Recompute) {
    first_gemm<S>(desc, index, N, x, w_gate, w_up, static_cast<S*>(scratch.a),
                  static_cast<S*>(scratch.b), h, static_cast<S*>(scratch.u), pool);
    a = static_cast<const S*>(scratch.a);
    b = static_cast<const S*>(scratch.b);
    u = static_cast<const S*>(scratch.u);
    ab_ld = h;
  } else if (!u) {
    S* u_out = static_cast<S*>(scratch.u);
    pool.parallel_for(N, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < h; ++i) {
          const Acc b_value = gated ? Acc(to_acc(b[r * ab_ld + i])) : Acc(0);
          u_out[r * h + i] = from_acc<S>(
              act_math::forward<Acc>(desc.activation, to_acc(a[r * ab_ld + i]), b_value));
        }
      }
    });
    u = u_out;
  }

  const bool want_dx = call.dx != nullptr;
  const bool want_dw_gate = call.dw_gate != nullptr;
  const bool want_dw_up = gated && call.dw_up != nullptr;
  const bool want_dw_down = call.dw_down != nullptr;
  const bool want_da = want_dx || want_dw_gate || want_dw_up;
  S* da = static_cast<S*>(scratch.da);            // [N, h]
  S* db = static_cast<S*>(scratch.db);            // [N, h], gated only
  Acc* row_g = static_cast<Acc*>(scratch.row_g);  // [N]
  Acc* dg = static_cast<Acc*>(call.dg);           // [T, k] routing dtype, optional

  // Per routed row: v = dy[t] . w_down[e] (unscaled), dg = <v, u>, dU = g v, (da, db) from act'.
  if (want_da || call.dg || want_dw_down) {
    pool.parallel_for(T, [&](int64_t begin, int64_t end) {
      Acc v[kTile];
      for (int64_t t = begin; t < end; ++t) {
        const S* dy_row = dy + t * d;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t r = index.token_index_map[t * k + j];
          const int64_t e = call.ids[t * k + j];
          const Acc g_value = g[t * k + j];
          row_g[r] = g_value;
          if (!want_da && !call.dg) continue;
          Acc dg_value = 0;
          for (int64_t i0 = 0; i0 < h; i0 += kTile) {
            const int64_t width = std::min(kTile, h - i0);
            std::fill(v, v + width, Acc(0));
            for (int64_t c = 0; c < d; ++c) {
              const Acc dy_value = to_acc(dy_row[c]);
              const S* w_row = w_down + (e * d + c) * h + i0;
              for (int64_t i = 0; i < width; ++i) v[i] += dy_value * Acc(to_acc(w_row[i]));
            }
            for (int64_t i = 0; i < width; ++i) {
              const int64_t at = r * h + i0 + i;
              dg_value += v[i] * Acc(to_acc(u[at]));
              if (!want_da) continue;
              const int64_t ab_at = r * ab_ld + i0 + i;
              const Acc b_value = gated ? Acc(to_acc(b[ab_at])) : Acc(0);
              Acc da_value, db_value;
              act_math::backward<Acc>(desc.activation, to_acc(a[ab_at]), b_value, g_value * v[i],
                                      &da_value, &db_value);
              da[at] = from_acc<S>(da_value);
              if (gated) db[at] = from_acc<S>(db_value);
            }
          }
          if (dg) dg[t * k + j] = dg_value;
        }
      }
    });
  }

  const int32_t* token_indices = index.expert_token_indices;
  if (want_dw_down) {
    // dw_down[e][c][i] = sum_r g_r dy[t_r, c] u[r, i]
    grouped_outer_product<S, Acc>(
        pool, E, index.expert_offsets, d, h,
        [&](int64_t r, int64_t c) { return row_g[r] * Acc(to_acc(dy[token_indices[r] * d + c])); },
        [&](int64_t r) { return u + r * h; }, static_cast<S*>(call.dw_down), call.accumulate_wgrad);
  }
  if (want_dw_gate) {
    // dw_gate[e][i][c] = sum_r da[r, i] x[t_r, c]
    grouped_outer_product<S, Acc>(
        pool, E, index.expert_offsets, h, d,
        [&](int64_t r, int64_t i) { return Acc(to_acc(da[r * h + i])); },
        [&](int64_t r) { return x + token_indices[r] * d; }, static_cast<S*>(call.dw_gate),
        call.accumulate_wgrad);
  }
  if (want_dw_up) {
    grouped_outer_product<S, Acc>(
        pool, E, index.expert_offsets, h, d,
        [&](int64_t r, int64_t i) { return Acc(to_acc(db[r * h + i])); },
        [&](int64_t r) { return x + token_indices[r] * d; }, static_cast<S*>(call.dw_up),
        call.accumulate_wgrad);
  }

  if (want_dx) {
    // dx[t] = sum_j S(da[r_j] . w_gate[e_j] + db[r_j] . w_up[e_j]), j ascending in Acc, each
    // row (i ascending) rounded to S first.
    S* dx = static_cast<S*>(call.dx);
    pool.parallel_for(T, [&](int64_t begin, int64_t end) {
      Acc acc[kTile];
      Acc row[kTile];
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t c0 = 0; c0 < d; c0 += kTile) {
          const int64_t width = std::min(kTile, d - c0);
          std::fill(acc, acc + width, Acc(0));
          for (int64_t j = 0; j < k; ++j) {
            const int64_t r = index.token_index_map[t * k + j];
            const int64_t e = call.ids[t * k + j];
            std::fill(row, row + width, Acc(0));
            for (int64_t i = 0; i < h; ++i) {
              const Acc da_value = to_acc(da[r * h + i]);
              const S* gate_row = w_gate + (e * h + i) * d + c0;
              for (int64_t c = 0; c < width; ++c) row[c] += da_value * Acc(to_acc(gate_row[c]));
              if (!gated) continue;
              const Acc db_value = to_acc(db[r * h + i]);
              const S* up_row = w_up + (e * h + i) * d + c0;
              for (int64_t c = 0; c < width; ++c) row[c] += db_value * Acc(to_acc(up_row[c]));
            }
            for (int64_t c = 0; c < width; ++c) acc[c] += Acc(to_acc(from_acc<S>(row[c])));
          }
          for (int64_t c = 0; c < width; ++c) dx[t * d + c0 + c] = from_acc<S>(acc[c]);
        }
      }
    });
  }
}

}  // namespace

void experts_forward(const LayerDesc& desc, const ExpertsForwardCall& call, ThreadPool& pool) {
  dispatch_storage(desc.dtype,
                   [&](auto tag) { experts_forward_typed<decltype(tag)>(desc, call, pool); });
}

void experts_backward(const LayerDesc& desc, const ExpertsBackwardCall& call, ThreadPool& pool) {
  dispatch_storage(desc.dtype,
                   [&](auto tag) { experts_backward_typed<decltype(tag)>(desc, call, pool); });
}

}  // namespace cpu
}  // namespace moeblaze
