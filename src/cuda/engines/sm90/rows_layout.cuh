// The rows kernel's (rows_gemm.cu) tile geometry, epilogue forms, shared-memory budget, kernel
// parameters, tile decoding and host-side tensor maps. Private to the rows kernels: rows_gemm.cu
// with its B1 epilogue, and rows_pingpong_gemm.cu (an anonymous namespace: each of the two
// translation units has its own copy).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/activation_math.hpp"
#include "cuda/cuda_util.cuh"
#include "cuda/engines/sm90/common.cuh"
#include "cuda/engines/sm90/rows_gemm.hpp"

namespace moeblaze {
namespace cuda {
namespace {

using namespace sm90;

enum RowsKind : int { kF2 = 0, kB4 = 1, kB1 = 2 };

constexpr int kBM = 128;              // routed rows per tile
constexpr int kBN = kSm90B1TileCols;  // output columns per tile (256)
// Pipeline stages: stages_for (common.cuh): 4, or 3 in B1's forms with epilogue warps (B1Form).
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;

constexpr int kATileBytes = kBM * kBK * 2;         // 16 KB
constexpr int kBTileBytes = kBN * kBK * 2;         // 32 KB
constexpr int kBMnBoxBytes = 64 * kBK * 2;         // 8 KB: one 64-column box of an MN-major B
constexpr int kBKBoxRows = 128;                    // K-major B: two boxes of 128 rows of n
constexpr int kBKBoxBytes = kBKBoxRows * kBK * 2;  // 16 KB
constexpr int kStageBytes = kATileBytes + kBTileBytes;
// B1's epilogue staging where the consumers run groups from their accumulators (the consumers'
// form and the split form): per consumer warp three 8-row x 64-column buffers (a -> da, b -> db,
// u -> g*u), common.cuh's swizzled layout.
constexpr int kB1StageRows = 8;
constexpr int kB1StageWords = kB1StageRows * kStageCols / 2;  // 256 words = 1 KB
constexpr int kB1StageWarpBytes = 3 * kB1StageWords * 4;

constexpr int kEpiBytes = kConsumerWarps * kB1StageWarpBytes;  // 24 KB

// B1's epilogue-warp form (kB1Warps; tiles of kB1EpiWarpsMinKTiles..kB1EpiWarpsMaxKTiles
// k-steps, 448 < d <= 4096): the consumers round v = dy . w_down into a 64 KB hand-off (4
// sub-tiles of 128 rows x 64 columns, 3 in the split form below; 16-byte chunk c of row r at
// r * 128 + ((c ^ (r & 7)) << 4), F1's layout) and go on to the next tile's main loop, while warps
// 1-3 of the producer warpgroup run the activation backward from it (a, b in; da, db, g*u out; dg
// partials). In the 4-stage form the consumers run it after each tile's main loop, where it takes
// about 40 % of B1's time at 16 k-steps.
//
// The epilogue warps pay from 8 k-steps (with the split forms below) up to 64 (on the H200, B1
// 4-8 % faster at 16-64 k-steps against the 4-stage form); past 64 k-steps (d > 4096) is unmeasured
// and keeps the 4-stage form.
constexpr int kB1EpiWarpsMinKTiles = 8;
constexpr int kB1EpiWarpsMaxKTiles = 64;
constexpr int kB1EpiWarps = 3;
// Whether B1's item loop (b1_epilogue_items) loads the next pass's a, b during each pass: in the
// split forms (items of 2 or 3 64-column groups), where an item's first unpacks wait on loads
// issued in the same pass (sass_loops' issue model: 20-40 % fewer cycles an item loop), and where
// the item's 16-byte chunks (groups x gated operands) are at most 6, which the epilogue warps' 104
// registers hold twice without spilling. In the whole tile's loop (4 groups) the model showed no
// gain: only the first group's loads wait there.
constexpr bool b1_items_load_ahead(int groups, bool gated) {
  return groups < 4 && groups * (gated ? 2 : 1) <= 6;
}
constexpr int kHandoffSubBytes = kBM * 64 * 2;  // 16 KB: one 64-column group of the tile
static_assert(kHandoffSubBytes == kHandoffGroupBytes, "store_handoff's group stride");
constexpr int kHandoffSubWords = kHandoffSubBytes / 4;

// B1's four epilogue forms (the kernel's FORM; F2 and B4 take kB1Consumers, which for them only
// means 4 stages):
//   kB1Consumers: 4 stages; the consumers run the whole epilogue after each main loop.
//   kB1Warps:     3 stages; the epilogue warps run all four 64-column groups of every tile from
//                 the hand-off while the consumers go on (above).
//   kB1Split:     3 stages; the consumers hand off groups 1-3 and run group 0 themselves (from
//                 their accumulators, rounded to T as the hand-off is), then go on.
//   kB1Split2:    3 stages; the consumers hand off the whole tile, run groups 0-1 themselves from
//                 the hand-off (the epilogue warps' item loop over the 8 consumer warps) while the
//                 epilogue warps run groups 2-3, then go on.
//
// Why the split: where the main loop is short (16 k-steps), the epilogue-warp form leaves the
// consumers waiting for the hand-off buffer a third of the time (the epilogue warps' 327 KB a tile
// outlast the main loop, stalled on their a, b loads: latency-bound, not bandwidth-bound). A
// quarter of the epilogue on the consumers balances the two sides (on the H200, B1 8 % faster than
// the epilogue warps alone at 16 k-steps, conf3; 9-14 % slower at 32, qwen3-30b-a3b and conf4,
// where the epilogue warps keep up: hence kB1SplitMaxKTiles). At 8 k-steps the main loop is half
// as long again and the two-group split wins (15-18 % against the consumers' form; B1 11-15 %
// faster again since its consumers run their groups with the item loop), while at 16 it loses to
// the split (with the item loop too: B1 4-8 % slower on conf2 and conf6): hence
// kB1Split2MaxKTiles. Below 8 k-steps is unmeasured and keeps the consumers' form.
enum B1Form : int { kB1Consumers = 0, kB1Warps = 1, kB1Split = 2, kB1Split2 = 3 };
constexpr int kB1Split2MaxKTiles = 8;
constexpr int kB1SplitMaxKTiles = 16;
// 64-column groups of a tile the consumers run themselves (the epilogue warps run the others), and
// the first group of the hand-off: the split form keeps its group in the accumulators, the
// two-group split hands off the whole tile and reads its groups back.
constexpr int consumer_groups(int form) {
  return form == kB1Consumers ? 4 : form == kB1Split ? 1 : form == kB1Split2 ? 2 : 0;
}
constexpr int handoff_first_group(int form) {
  return form == kB1Split ? 1 : 0;
}
constexpr int handoff_groups(int form) {
  return form == kB1Consumers ? 0 : 4 - handoff_first_group(form);
}
// Whether the consumers run their groups from their accumulators, through the staging buffers.
constexpr bool consumers_stage(int form) {
  return form == kB1Consumers || form == kB1Split;
}
// The epilogue's shared memory after the stages: the hand-off's groups, then the consumers'
// staging buffers.
constexpr size_t epilogue_bytes(int form) {
  return size_t(handoff_groups(form)) * kHandoffSubBytes +
         (consumers_stage(form) ? size_t(kEpiBytes) : 0);
}
constexpr size_t smem_bytes(int E, int form) {
  return pipeline_smem_bytes(stages_for(form != kB1Consumers), kStageBytes, epilogue_bytes(form),
                             E);
}
constexpr size_t kMaxSmemBytes =
    std::max({smem_bytes(kMaxExperts, kB1Consumers), smem_bytes(kMaxExperts, kB1Warps),
              smem_bytes(kMaxExperts, kB1Split), smem_bytes(kMaxExperts, kB1Split2)});
static_assert(kMaxSmemBytes <= kSmemPerBlock,
              "227 KB of shared memory per block on the H100 / H200");

// B1's dg partials: two per row and tile, part 0 over the tile's first dg_split_groups 64-column
// groups and part 1 over the rest, so the split forms' two sides each write their own (no combine
// between them; dg_reduce adds the partials in a fixed order: deterministic). Every form writes
// both. The argument is the form's consumer_groups (the split point of the split forms; one group
// for the forms where one side runs the whole tile).
constexpr int kDgParts = kSm90B1DgPartsPerTile;
static_assert(kDgParts == 2, "part 0: the consumers' side of a split, part 1: the rest");
constexpr int dg_split_groups(int consumer_groups_) {
  return consumer_groups_ == 0 || consumer_groups_ == 4 ? 1 : consumer_groups_;
}

// setmaxnreg counts (register_split_fits).
constexpr int kRegsWg0 = 40, kRegsConsumer = 232;
constexpr int kRegsWg0Epi = 104, kRegsConsumerEpi = 200;  // the epilogue warps' math
static_assert(register_split_fits(kRegsWg0, kRegsConsumer), "register split");
static_assert(register_split_fits(kRegsWg0Epi, kRegsConsumerEpi),
              "register split (epilogue warps)");

struct RowsParams {
  const void* a_src;           // B1: dy [T, lda] (gathered rows)
  const int32_t* offsets;      // [E + 1]
  const int32_t* token_index;  // [N] (B1)
  // F2 / B4: routed row r as row_value(w, v) in the storage dtype, w = out_w[row_pair[r]] (F2's
  // g) or 1 (out_w null), to row r of out ([N, n_out]) or, out_by_pair (k = 1), to row
  // row_pair[r] ([T, n_out]: the token's output row).
  void* out;
  int64_t out_ld;  // elements between rows of out
  const float* out_w;
  bool out_by_pair;
  int n_out;   // output columns
  int k_half;  // K of one half (K = halves * k_half)
  int halves;  // 2 for gated B4, else 1
  int lda;     // B1: elements per dy row
  int E;
  int n_tiles;      // ceil(n_out / kBN)
  int kt_half;      // ceil(k_half / kBK)
  int band_mtiles;  // rasterisation: the n-tiles sweep bands of this many m-tiles
  int64_t N;        // routed rows (dg_part stride)
  // B1 epilogue. n_out is the width of the column range this launch covers (all of h, or one
  // chunk of it: experts.cu); a, b, u, dadb, gu and dg_part point at the range's first column, and
  // the row strides of the full-width buffers are explicit.
  bool gated;
  int64_t ab_ld;
  int64_t dadb_ld;    // elements between rows of da|db ([N, 2h] gated, [N, h] otherwise)
  int64_t db_offset;  // elements from da to db within a da|db row (the full h)
  int64_t u_ld;       // elements between rows of the saved u (SAVE_ALL)
  const void* a;
  const void* b;
  const void* u;
  const float* g;
  const int32_t* row_pair;
  void* dadb;
  void* gu;
  float* dg_part;
};

struct TileCoord {
  int e, row0, rows, n0;
};

// ---- host: the operands' tensor maps and the kernel parameters (rows_gemm.cu and
// rows_pingpong_gemm.cu) ----

// [count2, count1, count0] row-major with dim 0 contiguous; see make_map_3d.
template <typename T>
inline CUtensorMap map_for(const void* base, int64_t dim0, int64_t dim1, int64_t dim2,
                           int64_t stride1, int64_t stride2, uint32_t box0, uint32_t box1,
                           uint32_t box2, const char* what) {
  return make_map_3d<T>(base, uint64_t(dim0), uint64_t(dim1), uint64_t(dim2), uint64_t(stride1),
                        uint64_t(stride2), box0, box1, box2, what);
}

// Columns [col0, col0 + cols) of a weight operand [E, rows, ld] (ld contiguous; 16-bit elements):
// MN-major boxes {64 cols, 64 rows} when the GEMM's n runs along the columns, K-major boxes
// {64 cols, 128 rows} when k does. Columns past the range read as zeros. mn_box_k: the MN-major
// boxes' rows of k (the 2-CTA ping-pong kernel's CTAs load half a box each).
inline CUtensorMap weight_map_range(Dtype dtype, const void* w, int64_t E, int64_t rows, int64_t ld,
                                    int64_t col0, int64_t cols, bool mn_major, const char* what,
                                    uint32_t mn_box_k = kBK) {
  const uint32_t box1 = mn_major ? mn_box_k : uint32_t(kBKBoxRows);
  const void* base = static_cast<const uint16_t*>(w) + col0;
  if (dtype == Dtype::BF16)
    return map_for<__nv_bfloat16>(base, cols, rows, E, ld, rows * ld, 64, box1, 1, what);
  return map_for<__half>(base, cols, rows, E, ld, rows * ld, 64, box1, 1, what);
}

// Rows [row0, row0 + rows) of a K-major weight operand [E, total_rows, ld] (ld contiguous, the
// GEMM's k): boxes {64 k, box_rows}; rows past the range read as zeros.
inline CUtensorMap weight_rows_map(Dtype dtype, const void* w, int64_t E, int64_t total_rows,
                                   int64_t ld, int64_t row0, int64_t rows, uint32_t box_rows,
                                   const char* what) {
  const void* base = static_cast<const uint16_t*>(w) + row0 * ld;
  if (dtype == Dtype::BF16)
    return map_for<__nv_bfloat16>(base, ld, rows, E, ld, total_rows * ld, 64, box_rows, 1, what);
  return map_for<__half>(base, ld, rows, E, ld, total_rows * ld, 64, box_rows, 1, what);
}

// A row operand [N, halves * k_half] as {k_half, halves, N}, box {64 k, 1, 128 rows}.
inline CUtensorMap rows_map(Dtype dtype, const void* a, int64_t N, int64_t k_half, int halves,
                            const char* what) {
  if (dtype == Dtype::BF16)
    return map_for<__nv_bfloat16>(a, k_half, halves, N, k_half, halves * k_half, kBK, 1, kBM, what);
  return map_for<__half>(a, k_half, halves, N, k_half, halves * k_half, kBK, 1, kBM, what);
}

inline RowsParams base_params(const LayerDesc& desc, const int32_t* offsets, int n_out,
                              int64_t k_half, int halves, int64_t T) {
  RowsParams p = {};
  p.offsets = offsets;
  p.n_out = n_out;
  p.k_half = int(k_half);
  p.halves = halves;
  p.E = int(desc.E);
  p.n_tiles = (n_out + kBN - 1) / kBN;
  p.kt_half = int((k_half + kBK - 1) / kBK);
  p.N = T * desc.k;
  return p;
}

inline void set_rows_out(RowsParams& p, const RowsOut& out, const int32_t* row_pair) {
  p.out = out.rows;
  p.out_ld = out.ld != 0 ? out.ld : p.n_out;
  p.row_pair = row_pair;
  p.out_w = out.weights;
  p.out_by_pair = out.by_pair;
}

// A launch's operands: the kernel parameters and the A, B (B4: w_gate, w_up) tensor maps.
struct RowsOperands {
  RowsParams p;
  CUtensorMap a, b0, b1;
};

// F2 over the op's column range: A = u [N, h]; B = w_down [E, d, h] (n over the range's rows of d,
// k over h: K-major, in boxes of b_box_rows rows of n).
inline RowsOperands f2_operands(const LayerDesc& desc, const F2Op& op, uint32_t b_box_rows) {
  const int64_t T = op.rows.T, N = T * desc.k;
  const int64_t cols = op.cols != 0 ? op.cols : desc.d;
  RowsOperands o;
  o.p = base_params(desc, op.rows.expert_offsets, int(cols), desc.h, 1, T);
  set_rows_out(o.p, op.out, op.rows.row_pair);
  o.a = rows_map(desc.dtype, op.u, N, desc.h, 1, "F2");
  o.b0 = o.b1 = weight_rows_map(desc.dtype, op.w_down, desc.E, desc.d, desc.h, op.col0, cols,
                                b_box_rows, "F2");
  return o;
}

// B4 over the op's column range: A = da|db [N, halves * h]; B = w_gate, w_up [E, h, d] (k over h,
// n over the range's columns of d: MN-major, boxes of {64 n, b_box_k}).
inline RowsOperands b4_operands(const LayerDesc& desc, const B4Op& op, uint32_t b_box_k = kBK) {
  const int64_t T = op.rows.T, N = T * desc.k;
  const int halves = desc.gated() ? 2 : 1;
  const int64_t cols = op.cols != 0 ? op.cols : desc.d;
  RowsOperands o;
  o.p = base_params(desc, op.rows.expert_offsets, int(cols), desc.h, halves, T);
  set_rows_out(o.p, op.out, op.rows.row_pair);
  o.a = rows_map(desc.dtype, op.dadb, N, desc.h, halves, "B4");
  o.b0 = weight_map_range(desc.dtype, op.w_gate, desc.E, desc.h, desc.d, op.col0, cols, true, "B4",
                          b_box_k);
  o.b1 = desc.gated() ? weight_map_range(desc.dtype, op.w_up, desc.E, desc.h, desc.d, op.col0, cols,
                                         true, "B4", b_box_k)
                      : o.b0;
  return o;
}

#if MB_SM90_DEVICE

// Tile t of the schedule as CTA `rank` of a CLUSTER-CTA cluster runs it: a cluster's tiles are
// CLUSTER * 128 rows (each expert's m-tiles in groups of CLUSTER) and CTA rank takes the rank-th
// 128, which can be empty (rows 0) at the end of an expert.
template <int CLUSTER = 1>
__device__ __forceinline__ TileCoord decode_tile(int t, const int* tile_start, const RowsParams& p,
                                                 int rank = 0) {
  const GroupedTile g =
      decode_grouped_tile<kBM * CLUSTER>(t, tile_start, p.offsets, p.E, p.n_tiles, p.band_mtiles);
  const int rows = min(kBM, g.rows - kBM * rank);
  return {g.e, g.row0 + kBM * rank, rows > 0 ? rows : 0, g.n_tile * kBN};
}

// B1's dg partials of tile c: part q of routed row r at [q * p.N + r] (kDgParts; the layout
// experts.cu sizes and dg_reduce_kernel reads).
__device__ __forceinline__ float* dg_tile_parts(const RowsParams& p, const TileCoord& c) {
  return p.dg_part + int64_t(c.n0 / kBN) * kDgParts * p.N;
}

#endif  // MB_SM90_DEVICE

}  // namespace
}  // namespace cuda
}  // namespace moeblaze
