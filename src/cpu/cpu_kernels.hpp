// Internal building blocks of the CPU reference backend: type plumbing, the few loop kernels every
// op is written with, and the per-op entry points and workspace layouts.
//
// Determinism rule for every kernel here: work is split over OUTPUT elements only, and each output
// element is reduced in a fixed order that does not depend on the split, so results are bitwise
// identical for any thread count.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/backend.hpp"
#include "common/carver.hpp"
#include "common/layer_desc.hpp"
#include "common/status.hpp"
#include "cpu/half.hpp"
#include "cpu/thread_pool.hpp"

namespace moeblaze {
namespace cpu {

// Accumulation type for a storage type: double for F64 layers, float otherwise. The routing dtype
// (logits, g, dg, d_logits, losses) is the same type.
template <typename Storage>
using acc_t = std::conditional_t<std::is_same<Storage, double>::value, double, float>;

// Calls fn(Storage{}) with the C++ storage type of `dtype`.
template <typename Fn>
void dispatch_storage(Dtype dtype, Fn&& fn) {
  switch (dtype) {
    case Dtype::F32: fn(float{}); return;
    case Dtype::BF16: fn(bf16{}); return;
    case Dtype::F16: fn(f16{}); return;
    case Dtype::F64: fn(double{}); return;
  }
  fail(MOEBLAZE_ERR_INTERNAL, "CPU backend: unknown dtype %d", int(dtype));
}

// Calls fn(Routing{}) with the C++ routing type (float or double) of the layer.
template <typename Fn>
void dispatch_routing(Dtype dtype, Fn&& fn) {
  if (routing_dtype(dtype) == Dtype::F64) {
    fn(double{});
  } else {
    fn(float{});
  }
}

// Columns per stack tile in the axpy-style kernels (accumulators live on the stack).
constexpr int64_t kTile = 256;

// sum_c a[c] * b[c] in Acc, with eight interleaved partial sums combined in a fixed tree: the order
// depends only on n, never on threads.
template <typename Acc, typename TA, typename TB>
inline Acc dot(const TA* a, const TB* b, int64_t n) {
  Acc lanes[8] = {};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] += Acc(to_acc(a[c + l])) * Acc(to_acc(b[c + l]));
  }
  for (int l = 0; c < n; ++c, ++l) lanes[l] += Acc(to_acc(a[c])) * Acc(to_acc(b[c]));
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// Writes an accumulated value to storage: overwrite, or add to what is there and round once.
template <typename Storage, typename Acc>
inline void store(Storage* out, Acc value, bool accumulate) {
  *out = accumulate ? from_acc<Storage>(Acc(to_acc(*out)) + value) : from_acc<Storage>(value);
}

// Weight-gradient shaped GEMM over ragged row groups (the "varlen K" GEMM):
//   out[grp][m][n] (= or +=) sum over rows r of group grp, ascending, of a_value(r, m) *
//   b_row(r)[n]
// Group grp owns rows offsets[grp] .. offsets[grp+1]-1 (an empty group gives zeros, or leaves `out`
// unchanged when accumulating). out is [groups, M, N] row-major. Work items are blocks of
// kRowsPerItem output rows (one B row load feeds all of them); every element still sums its rows
// in ascending order, whatever the blocking and the thread count.
template <typename Storage, typename Acc, typename AValue, typename BRow>
void grouped_outer_product(ThreadPool& pool, int64_t groups, const int32_t* offsets, int64_t M,
                           int64_t N, AValue a_value, BRow b_row, Storage* out, bool accumulate) {
  constexpr int64_t kRowsPerItem = 4;
  const int64_t blocks_per_group = (M + kRowsPerItem - 1) / kRowsPerItem;
  pool.parallel_for(groups * blocks_per_group, [&](int64_t begin, int64_t end) {
    Acc acc[kRowsPerItem][kTile];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t grp = item / blocks_per_group;
      const int64_t m0 = (item % blocks_per_group) * kRowsPerItem;
      const int64_t rows = std::min(kRowsPerItem, M - m0);
      const int64_t row_begin = offsets[grp];
      const int64_t row_end = offsets[grp + 1];
      for (int64_t n0 = 0; n0 < N; n0 += kTile) {
        const int64_t width = std::min(kTile, N - n0);
        for (int64_t m = 0; m < rows; ++m) std::fill(acc[m], acc[m] + width, Acc(0));
        for (int64_t r = row_begin; r < row_end; ++r) {
          const auto* b = b_row(r) + n0;
          Acc a[kRowsPerItem];
          for (int64_t m = 0; m < rows; ++m) a[m] = a_value(r, m0 + m);
          if (rows == kRowsPerItem) {
            for (int64_t n = 0; n < width; ++n) {
              const Acc b_value = to_acc(b[n]);
              acc[0][n] += a[0] * b_value;
              acc[1][n] += a[1] * b_value;
              acc[2][n] += a[2] * b_value;
              acc[3][n] += a[3] * b_value;
            }
          } else {
            for (int64_t m = 0; m < rows; ++m) {
              for (int64_t n = 0; n < width; ++n) acc[m][n] += a[m] * Acc(to_acc(b[n]));
            }
          }
        }
        for (int64_t m = 0; m < rows; ++m) {
          Storage* out_row = out + (grp * M + m0 + m) * N + n0;
          for (int64_t n = 0; n < width; ++n) store(out_row + n, acc[m][n], accumulate);
        }
      }
    }
  });
}

// ---- workspace layouts (carved by the same code for the size query and for execution)
// --------------

struct RoutingScratch {
  int32_t* dense_map = nullptr;  // [T, E] int32: j of (t, e), or -1
  int32_t* counts = nullptr;     // [E] int32
};
RoutingScratch carve_routing_scratch(Carver& carver, const LayerDesc& desc, int64_t T);

struct RouterForwardScratch {
  void* scores = nullptr;          // [T, E] routing dtype: the values top-k selects on
  void* balance_scores = nullptr;  // [T, E] routing dtype: normalised scores of the aux loss
  void* lse = nullptr;             // [T] routing dtype: logsumexp of each token's logits
  int32_t* counts = nullptr;       // [E] int32
};
RouterForwardScratch carve_router_forward_scratch(Carver& carver, const LayerDesc& desc, int64_t T);

struct RouterBackwardScratch {
  void* probs = nullptr;      // [T, E] routing dtype: per-token softmax / sigmoid scores
  int32_t* counts = nullptr;  // [E] int32
};
RouterBackwardScratch carve_router_backward_scratch(Carver& carver, const LayerDesc& desc,
                                                    int64_t T);

struct ExpertsForwardScratch {
  int32_t* expert_offsets = nullptr;        // [E+1], used when there is no saved buffer
  int32_t* expert_token_indices = nullptr;  // [N]
  int32_t* token_index_map = nullptr;       // [N]
  RoutingScratch routing;
  void* u = nullptr;  // [N, h] dtype, used unless u goes to the saved buffer
};
// with_saved: the layout of a forward given a saved buffer (MOEBLAZE_FORWARD_WITH_SAVED).
ExpertsForwardScratch carve_experts_forward_scratch(Carver& carver, const LayerDesc& desc,
                                                    int64_t T, bool with_saved);

struct ExpertsBackwardScratch {
  void* a = nullptr;      // [N, h] dtype, RECOMPUTE only
  void* b = nullptr;      // [N, h] dtype, RECOMPUTE and gated only
  void* u = nullptr;      // [N, h] dtype, unless SAVE_ALL
  void* da = nullptr;     // [N, h] dtype
  void* db = nullptr;     // [N, h] dtype, gated only
  void* row_g = nullptr;  // [N] accumulation type: g of each routed row
};
ExpertsBackwardScratch carve_experts_backward_scratch(Carver& carver, const LayerDesc& desc,
                                                      int64_t T);

// ---- ops ----------------------------------------------------------------------------------------

void router_forward(const LayerDesc& desc, const RouterForwardCall& call, ThreadPool& pool);
void router_backward(const LayerDesc& desc, const RouterBackwardCall& call, ThreadPool& pool);

// Validates ids (range, distinct within a token) and builds the three index arrays.
void build_routing(const LayerDesc& desc, int64_t T, const int32_t* ids, int32_t* expert_offsets,
                   int32_t* expert_token_indices, int32_t* token_index_map,
                   const RoutingScratch& scratch, ThreadPool& pool);

void router_project_forward(const LayerDesc& desc, const RouterProjectForwardCall& call,
                            ThreadPool& pool);
void router_project_backward(const LayerDesc& desc, const RouterProjectBackwardCall& call,
                             ThreadPool& pool);

void experts_forward(const LayerDesc& desc, const ExpertsForwardCall& call, ThreadPool& pool);
void experts_backward(const LayerDesc& desc, const ExpertsBackwardCall& call, ThreadPool& pool);

// The row movement and loss shares of expert parallelism (Backend's declarations; cpu/ep_ops.cpp).
void ep_gather_rows(void* dst, const void* src, const int32_t* index, int64_t n, int64_t index_rows,
                    size_t row_bytes);
void ep_scatter_rows(void* dst, const void* src, const int32_t* index, int64_t n,
                     int64_t index_rows, size_t row_bytes);
void ep_combine_rows(Dtype dtype, void* out, const void* rows, const int32_t* index, int64_t T,
                     int64_t k, int64_t d, int64_t index_rows);
void ep_local_expert_ids(const int32_t* table, int64_t W, int64_t E, int64_t expert_begin,
                         int64_t local_experts, int64_t R, int32_t* local_ids);
void ep_global_counts(const int32_t* table, int64_t W, int64_t E, int32_t* counts);
void ep_loss_shares_forward(const LayerDesc& desc, const LossShareCall& call, void* losses);
void ep_loss_shares_backward(const LayerDesc& desc, const LossShareCall& call, const void* d_losses,
                             void* d_logits);

}  // namespace cpu
}  // namespace moeblaze
