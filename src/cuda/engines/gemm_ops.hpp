// The expert MLP's six grouped GEMMs, each described once: which rows, which operands, what the
// gather reads and what the epilogue writes. An engine (engine.hpp) computes them; experts.cu
// fills these descriptions and never sees an engine's own parameters. Notation as in
// docs/design/cuda-kernels.md: N = T*k routed rows sorted by expert, expert e owns rows
// [expert_offsets[e], expert_offsets[e+1]), tok_r = expert_token_indices[r] is routed row r's
// token and pair_r = row_pair[r] = t*k + j its (token, slot) pair. Every pointer is device memory;
// "[rows, cols]" is row-major with the stated leading dimension (elements between rows).
//
// Column ranges: F2 and B4 compute columns [col0, col0 + cols) of d, B1 and B2 columns
// [col0, col0 + cols) of h (cols = 0: all of them). B1's and B2's col0 is a multiple of
// kGemmColumnAlign (B1's dg partials are indexed by 256-column tile); F2's and B4's a multiple of
// their kernel's tile width (at least of 64). An element's bits do not depend on the range: its
// k order is the same in every tiling. Unless a field says otherwise, a pointer is the start of
// its whole buffer and the engine applies the range.
#pragma once

#include <cstdint>

#include "common/layer_desc.hpp"

namespace moeblaze {
namespace cuda {

// Every engine's tile width (sm90 256, mma.sync 128, SIMT 64) divides it.
constexpr int64_t kGemmColumnAlign = 256;

// The routed rows every op of one pass shares.
struct RoutedRows {
  int64_t T = 0;                                  // tokens; N = T * k
  const int32_t* expert_offsets = nullptr;        // [E + 1]
  const int32_t* expert_token_indices = nullptr;  // [N] tok_r (the gathered operands' rows)
  const int32_t* row_pair = nullptr;              // [N] pair_r
  // gemm_tile_scratch_ints(N, E) int32 of workspace the portable engines fill with their m-tile
  // table before each launch (the Hopper kernels build theirs in shared memory).
  int32_t* tile_scratch = nullptr;
};

// F1: a_r = x[tok_r] . w_gate[e]^T, b_r = x[tok_r] . w_up[e]^T (gated only), each rounded once to
// the storage dtype; u_r = act(a_r, b_r) from the rounded values, rounded once. Each output is
// optional (nullptr: not stored).
struct F1Op {
  RoutedRows rows;
  const void* x = nullptr;       // [T, d]
  const void* w_gate = nullptr;  // [E, h, d]
  const void* w_up = nullptr;    // [E, h, d], gated only
  void* out_a = nullptr;         // [N, ab_ld]
  void* out_b = nullptr;         // [N, ab_ld], gated only
  int64_t ab_ld = 0;             // 0 = h (the saved a|b block has 2h; recompute's da|db too)
  void* out_u = nullptr;         // [N, h]
};

// Where F2 / B4 put routed row r of their column range, in the storage dtype: row r of `rows`
// ([N, ld], the range's own buffer), or with by_pair (k = 1) row pair_r of it ([T, ld]: the
// token's output itself; `rows` then points at the range's first column). Each element is
// row_value(w, v) (cuda_util.cuh): w = weights[pair_r] (F2's g) or 1 (weights null).
struct RowsOut {
  void* rows = nullptr;
  int64_t ld = 0;                  // 0 = the range's width
  const float* weights = nullptr;  // [T*k]
  bool by_pair = false;
};

// F2: rows_r = g_pair_r * (u_r . w_down[e]^T) over a column range of d.
struct F2Op {
  RoutedRows rows;
  const void* u = nullptr;       // [N, h]
  const void* w_down = nullptr;  // [E, d, h]
  int64_t col0 = 0, cols = 0;
  RowsOut out;
};

// B4: rows_r = da_r . w_gate[e] + db_r . w_up[e] over a column range of d (K = 2h gated, h
// otherwise).
struct B4Op {
  RoutedRows rows;
  const void* dadb = nullptr;    // [N, 2h]: da at [0, h), db at [h, 2h); [N, h] non-gated
  const void* w_gate = nullptr;  // [E, h, d]
  const void* w_up = nullptr;    // [E, h, d], gated only
  int64_t col0 = 0, cols = 0;
  RowsOut out;
};

// B1: v_r = dy[tok_r] . w_down[e] over a column range of h, and in the epilogue the activation
// backward: u from u_src or recomputed from the rounded a, b; dg partial sums of v * u; du =
// g * v; da, db; g * u.
struct B1Op {
  RoutedRows rows;
  const void* dy = nullptr;      // [T, d]
  const void* w_down = nullptr;  // [E, d, h]
  const void* a_src = nullptr;   // [N, ab_ld] saved or recomputed a (may alias dadb: RECOMPUTE)
  const void* b_src = nullptr;   // [N, ab_ld] b, gated only (may alias dadb)
  int64_t ab_ld = 0;             // 0 = h
  const void* u_src = nullptr;   // [N, u_ld] saved u (SAVE_ALL), or nullptr: recomputed
  int64_t u_ld = 0;              // 0 = h
  const float* g = nullptr;      // [T*k] routing weights, read at pair_r
  void* dadb = nullptr;          // [N, dadb_ld]: da at column n, db at column h + n
  int64_t dadb_ld = 0;           // 0 = 2h (gated) or h
  void* gu = nullptr;            // [N, cols]: the range's own g * u buffer
  // The whole partial buffer, [parts, N] with parts = the engine's b1_dg_parts(h) (engine.hpp);
  // each engine writes the partials of its range's tiles.
  float* dg_part = nullptr;
  int64_t col0 = 0, cols = 0;
};

// B2: dw_down[e][:, range] (+)= sum_r dy[tok_r]^T gu_r (an expert without rows: zeros, or left
// alone when accumulating).
struct B2Op {
  RoutedRows rows;
  const void* dy = nullptr;  // [T, d]
  const void* gu = nullptr;  // [N, cols]: the range's own g * u buffer
  void* dw_down = nullptr;   // [E, d, h]
  bool accumulate = false;
  int64_t col0 = 0, cols = 0;
};

// B3: [dw_gate; dw_up][e] [2h, d] (+)= sum_r [da|db]_r^T x[tok_r] (non-gated: dw_gate from da).
// A nullptr gradient is neither computed nor stored.
struct B3Op {
  RoutedRows rows;
  const void* dadb = nullptr;  // [N, 2h] gated, [N, h] otherwise
  const void* x = nullptr;     // [T, d]
  void* dw_gate = nullptr;     // [E, h, d]
  void* dw_up = nullptr;       // [E, h, d], gated only
  bool accumulate = false;
};

}  // namespace cuda
}  // namespace moeblaze
