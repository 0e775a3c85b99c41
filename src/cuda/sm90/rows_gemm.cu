// F2, B4, B1 on Hopper (see rows_gemm.hpp).
//
// Tile: 128 routed rows x 256 output columns x 64 k, 4 stages of 48 KB (A 16 KB + B 32 KB).
// 384 threads: warpgroup 0 produces, warpgroups 1 and 2 consume 64 rows each with
// wgmma m64n256k16 (128 fp32 accumulators per thread); setmaxnreg 40 / 232.
//   A, not gathered (F2: u; B4: da|db): one TMA box {64 k, 1, 128 rows} per stage from the 3-D
//     map {k_half, halves, rows}; B4's K runs over two halves (da with w_gate, then db with w_up)
//     into one accumulator, and k past k_half is zero-filled inside each half, so the da/db
//     boundary needs no h % 64. A ragged last m-tile reads rows of the next expert; their results
//     are never stored (rows of a GEMM are independent).
//   A, gathered (B1: dy rows by token): each consumer warpgroup gathers its own 64 rows, 2 k-steps
//     ahead (primitives.cuh's HalfTileGather: 16-byte cp.async with zero-fill into the 128-byte
//     swizzle, completing on the warpgroup's own per-slot barrier); the consumers
//     fence.proxy.async after their waits (primitives.cuh says why not the producer).
//   B, K-major (F2: w_down [E, d, h] read as n rows of k): two TMA boxes {64 k, 128 n}.
//   B, MN-major (B4: w_gate/w_up [E, h, d]; B1: w_down [E, d, h] read as k rows of n): four TMA
//     boxes {64 n, 64 k}, the transposed-B wgmma with the MN-major descriptor of common.cuh. A box
//     that starts past n_out is neither issued nor expected.
// Epilogues: F2 / B4 store each row weighted (F2: g) and rounded to the storage dtype straight
// from registers, two elements a lane per 4-byte store. B1 works on 64 columns at a time through
// each consumer warp's 2 KB staging buffer (common.cuh): a, b (and u under SAVE_ALL) in by
// coalesced 16-byte loads, then da, db, g*u (rounded once) out by coalesced 16-byte stores, and the
// row's dg partial for this 256-column tile (the quad's lanes hold the row's columns: two
// shuffles). B1 with 8-64 k-steps a tile (448 < d <= 4096) takes a form with epilogue warps instead
// (B1Form, kB1EpiWarpsMinKTiles): 3 stages, setmaxnreg 104 / 200, the consumers hand v off in bf16
// and warps 1-3 of the producer warpgroup run the epilogue above while the consumers go on; with
// 9-32 k-steps (the split form) the consumers keep the tile's first 64 columns and run their
// epilogue themselves after the hand-off, with 8 (the two-group split) its first 128.
#include "cuda/sm90/rows_gemm.hpp"

#include <algorithm>
#include <cstring>

#include "common/activation_math.hpp"
#include "common/status.hpp"
#include "cuda/cuda_util.cuh"
#include "cuda/sm90/common.cuh"
#include "cuda/sm90/device.hpp"

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
// B1's epilogue staging: per consumer warp three 8-row x 64-column buffers (a -> da, b -> db,
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
constexpr int kHandoffSubBytes = kBM * 64 * 2;  // 16 KB: one 64-column group of the tile
constexpr int kHandoffSubWords = kHandoffSubBytes / 4;

// B1's four epilogue forms (the kernel's FORM; F2 and B4 take kB1Consumers, which for them only
// means 4 stages):
//   kB1Consumers: 4 stages; the consumers run the whole epilogue after each main loop.
//   kB1Warps:     3 stages; the epilogue warps run all four 64-column groups of every tile from
//                 the hand-off while the consumers go on (above).
//   kB1Split:     3 stages; the consumers hand off groups 1-3 and run group 0 themselves (from
//                 their accumulators, rounded to T as the hand-off is), then go on.
//   kB1Split2:    as kB1Split with groups 0-1 on the consumers and 2-3 on the epilogue warps.
//
// Why the split: where the main loop is short (16 k-steps), the epilogue-warp form leaves the
// consumers waiting for the hand-off buffer a third of the time (the epilogue warps' 327 KB a tile
// outlast the main loop, stalled on their a, b loads: latency-bound, not bandwidth-bound). A
// quarter of the epilogue on the consumers balances the two sides (B1 7-15 % faster at 16 k-steps,
// 3 % at 32; 4 % slower at 64, where the epilogue warps keep up: hence kB1SplitMaxKTiles). At 8
// k-steps the main loop is half as long again and the two-group split wins (15-18 % against the
// consumers' form), while at 16-32 it loses to the split: hence kB1Split2MaxKTiles. Below 8
// k-steps is unmeasured and keeps the consumers' form.
enum B1Form : int { kB1Consumers = 0, kB1Warps = 1, kB1Split = 2, kB1Split2 = 3 };
constexpr int kB1Split2MaxKTiles = 8;
constexpr int kB1SplitMaxKTiles = 32;
// 64-column groups of a tile the consumers run themselves, and those they hand off.
constexpr int consumer_groups(int form) {
  return form == kB1Consumers ? 4 : form == kB1Split ? 1 : form == kB1Split2 ? 2 : 0;
}
constexpr int handoff_groups(int form) {
  return form == kB1Consumers ? 0 : 4 - consumer_groups(form);
}
// The epilogue's shared memory after the stages: the hand-off's groups, then (when the consumers
// run any group) their staging buffers.
constexpr size_t epilogue_bytes(int form) {
  return size_t(handoff_groups(form)) * kHandoffSubBytes +
         (consumer_groups(form) > 0 ? size_t(kEpiBytes) : 0);
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

#if MB_SM90_DEVICE

__device__ __forceinline__ TileCoord decode_tile(int t, const int* tile_start,
                                                 const RowsParams& p) {
  const GroupedTile g =
      decode_grouped_tile<kBM>(t, tile_start, p.offsets, p.E, p.n_tiles, p.band_mtiles);
  return {g.e, g.row0, g.rows, g.n_tile * kBN};
}

// B1's dg partials of tile c: part q of routed row r at [q * p.N + r] (kDgParts; the layout
// experts.cu sizes and dg_reduce_kernel reads).
__device__ __forceinline__ float* dg_tile_parts(const RowsParams& p, const TileCoord& c) {
  return p.dg_part + int64_t(c.n0 / kBN) * kDgParts * p.N;
}

// One element of B1's activation backward: u (the saved one, or act(a, b) rounded once) and da, db
// for du = g * v. SwiGLU and SiLU evaluate the sigmoid once and reuse it: the same operations in
// the same order as act_math::forward / backward (hence the same bits, and the same u as F1's), but
// one sigmoid per element instead of three. With IEEE division (whose slow path is an out-of-line
// call) and 128 elements per thread, fully unrolled, the act_math form made the epilogue ~22k
// instructions, far past the instruction cache (2.4x slower B1 on the H200); act_math's sigmoid is
// the MUFU form on the GPU.
template <typename T, int ACT>
__device__ __forceinline__ void b1_element(float a, float b, float du, bool have_u, float u_saved,
                                           float& u, float& da, float& db) {
  constexpr Activation act = static_cast<Activation>(ACT);
  if constexpr (act == Activation::SwiGLU || act == Activation::SiLU) {
    const float s = act_math::sigmoid(a);
    const float silu = a * s;
    const float silu_grad = s * (1.f + a * (1.f - s));
    if constexpr (act == Activation::SwiGLU) {
      u = have_u ? u_saved : round_to<T>(silu * b);
      da = du * b * silu_grad;
      db = du * silu;
    } else {
      u = have_u ? u_saved : round_to<T>(silu);
      da = du * silu_grad;
      db = 0.f;
    }
  } else {
    u = have_u ? u_saved : round_to<T>(act_math::forward(act, a, b));
    act_math::backward(act, a, b, du, &da, &db);
  }
}

// 8 rows x 64 columns of a 16-bit [*, ld] matrix from `base` (row 0, column col0), coalesced:
// lane loads chunk (lane & 7) of rows (lane >> 3) + 4 i. Rows at or past `rows` and columns at or
// past `cols` read as zeros. Plain (coherent) loads: under RECOMPUTE and CONSUME_SAVED, a and b
// live in the da|db buffer this epilogue writes (each element is read before its warp writes it).
template <typename T>
__device__ __forceinline__ void b1_load_chunks(uint4 (&v)[2], const T* base, int64_t ld, int rows,
                                               int col0, int cols, int lane) {
  const int ch = lane & 7;
  const bool col_ok = col0 + ch * 8 < cols;  // cols % 8 == 0: a chunk is all in or all out
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = (lane >> 3) + 4 * i;
    v[i] = make_uint4(0u, 0u, 0u, 0u);
    if (base != nullptr && col_ok && row < rows)
      v[i] = *reinterpret_cast<const uint4*>(base + int64_t(row) * ld + col0 + ch * 8);
  }
}

__device__ __forceinline__ void b1_stage_chunks(uint32_t* buf, const uint4 (&v)[2], int lane) {
#pragma unroll
  for (int i = 0; i < 2; ++i)
    *reinterpret_cast<uint4*>(buf + stage_chunk_word((lane >> 3) + 4 * i, lane & 7)) = v[i];
}

// The staged 8 x 64 block back out to a 16-bit [*, ld] matrix, coalesced (rows < `rows`, columns
// < `cols` only).
template <typename T>
__device__ __forceinline__ void b1_store_chunks(const uint32_t* buf, T* base, int64_t ld, int rows,
                                                int col0, int cols, int lane) {
  const int ch = lane & 7;
  const bool col_ok = col0 + ch * 8 < cols;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = (lane >> 3) + 4 * i;
    const uint4 v = *reinterpret_cast<const uint4*>(buf + stage_chunk_word(row, ch));
    if (col_ok && row < rows)
      *reinterpret_cast<uint4*>(base + int64_t(row) * ld + col0 + ch * 8) = v;
  }
}

// B1's epilogue for one warp's 16 rows of a tile (see the file comment), in 2 steps of 8 rows x 64
// columns for each of the tile's first GROUPS 64-column groups (4: all of it, in the consumers'
// form; 1 or 2: groups 0 or 0-1, in the split forms): a, b (u under SAVE_ALL) come in by
// coalesced 16-byte loads into the warp's staging buffers (the next step's a, b loads are issued
// before this step's math), each lane turns its fragment words into da, db, g*u in place, and
// those go out by coalesced 16-byte stores. ROUND_V: v as the split forms hand the other groups
// off, rounded once to T (the consumers' form uses the fp32 accumulator).
//
// Register 4j + q of lane (g, t4) holds row g (q < 2) or g + 8 (q >= 2), column 8j + 2 t4 + (q & 1)
// of the tile. Staging (coalesced 16-byte accesses instead of 8 rows x 16 bytes per instruction
// from the fragment layout) and the prefetch each pay (B1 13 % faster together on the H200): only
// two warps per scheduler run this epilogue, so nothing else hides the loads' latency. Against
// the 168-register budget the prefetch costs a few words of spill (ptxas: 4-68 bytes of spill
// stores per B1 kernel), and the spill-free form is the slower one.
//
// ACT is a template parameter: a runtime switch over the seven activations, inlined at each of the
// 64 unrolled elements, makes this epilogue four times slower, most likely from the code size.
template <typename T, int ACT, int GROUPS, bool ROUND_V>
__device__ __forceinline__ void b1_epilogue(const RowsParams& p, const TileCoord& c, int tile_row,
                                            int lane, uint32_t* stg, const float (&acc)[128]) {
  static_assert(GROUPS == 1 || GROUPS == 2 || GROUPS == 4, "the split forms' groups, or the tile");
  constexpr int kDgSplit = dg_split_groups(GROUPS);
  const int g = lane >> 2, t4 = lane & 3;
  const int h = p.n_out;
  const int64_t dadb_ld = p.dadb_ld;
  const int rows = c.rows - tile_row;  // valid rows of this warp's 16 (may be <= 0)
  const int64_t grow0 = int64_t(c.row0) + tile_row;
  const bool have_u = p.u != nullptr;
  uint32_t* buf_a = stg;
  uint32_t* buf_b = stg + kB1StageWords;
  uint32_t* buf_u = stg + 2 * kB1StageWords;
  float gval[2];
  float dot[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // [dg part (kDgSplit)][8-row half]
#pragma unroll
  for (int rr = 0; rr < 2; ++rr)
    gval[rr] = g + 8 * rr < rows ? __ldg(p.g + __ldg(p.row_pair + grow0 + g + 8 * rr)) : 0.f;

  // Step = (64-column group, 8-row half): group-major, so dg sums its columns in the same order
  // as before (row by row, column pairs ascending).
  constexpr int kSteps = GROUPS * 2;
  uint4 pa[2], pb[2];  // the next step's a, b chunks
  {
    const int64_t ab_row = grow0 * p.ab_ld;
    b1_load_chunks<T>(pa, static_cast<const T*>(p.a) + ab_row, p.ab_ld, rows, c.n0, h, lane);
    b1_load_chunks<T>(pb, p.gated ? static_cast<const T*>(p.b) + ab_row : nullptr, p.ab_ld, rows,
                      c.n0, h, lane);
  }
#pragma unroll  // step indexes the accumulators: a runtime index would move them to local memory
  for (int step = 0; step < kSteps; ++step) {
    const int group = step >> 1, rr = step & 1;
    const int part = group < kDgSplit ? 0 : 1;
    const int col0 = c.n0 + group * kStageCols;
    const int r0 = 8 * rr;  // first row of this step within the warp's 16
    b1_stage_chunks(buf_a, pa, lane);
    b1_stage_chunks(buf_b, pb, lane);
    if (step + 1 < kSteps) {  // the next step's loads fly during this step's math and stores
      const int next_col0 = c.n0 + ((step + 1) >> 1) * kStageCols;
      const int next_r0 = 8 * ((step + 1) & 1);
      const int64_t ab_row = (grow0 + next_r0) * p.ab_ld;
      b1_load_chunks<T>(pa, static_cast<const T*>(p.a) + ab_row, p.ab_ld, rows - next_r0, next_col0,
                        h, lane);
      b1_load_chunks<T>(pb, p.gated ? static_cast<const T*>(p.b) + ab_row : nullptr, p.ab_ld,
                        rows - next_r0, next_col0, h, lane);
    }
    if (have_u) {  // SAVE_ALL only
      uint4 vu[2];
      b1_load_chunks<T>(vu, static_cast<const T*>(p.u) + (grow0 + r0) * p.u_ld, p.u_ld, rows - r0,
                        col0, h, lane);
      b1_stage_chunks(buf_u, vu, lane);
    }
    __syncwarp();
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int j = group * 8 + jj;
      const int w = stage_fragment_word(g, jj, t4);
      const float2 af = unpack2<T>(buf_a[w]);
      const float2 bf = unpack2<T>(buf_b[w]);                // zeros when not gated
      const float2 uf = unpack2<T>(have_u ? buf_u[w] : 0u);  // used only under SAVE_ALL
      float v0 = acc[4 * j + 2 * rr], v1 = acc[4 * j + 2 * rr + 1];
      if constexpr (ROUND_V) {
        v0 = round_to<T>(v0);
        v1 = round_to<T>(v1);
      }
      float u0, u1, da0, db0, da1, db1;
      b1_element<T, ACT>(af.x, bf.x, gval[rr] * v0, have_u, uf.x, u0, da0, db0);
      b1_element<T, ACT>(af.y, bf.y, gval[rr] * v1, have_u, uf.y, u1, da1, db1);
      if (col0 + 8 * jj < h) {  // h % 8 == 0; columns past h hold stale B data: keep them out of dg
        dot[part][rr] += v0 * u0;
        dot[part][rr] += v1 * u1;
      }
      buf_a[w] = pack2<T>(da0, da1);  // each lane rewrites only the words it read
      buf_b[w] = pack2<T>(db0, db1);
      buf_u[w] = pack2<T>(gval[rr] * u0, gval[rr] * u1);
    }
    __syncwarp();
    T* da_rows = static_cast<T*>(p.dadb) + (grow0 + r0) * dadb_ld;
    b1_store_chunks<T>(buf_a, da_rows, dadb_ld, rows - r0, col0, h, lane);
    if (p.gated)
      b1_store_chunks<T>(buf_b, da_rows + p.db_offset, dadb_ld, rows - r0, col0, h, lane);
    b1_store_chunks<T>(buf_u, static_cast<T*>(p.gu) + (grow0 + r0) * h, h, rows - r0, col0, h,
                       lane);
    __syncwarp();
  }
  float* dg_tile = dg_tile_parts(p, c);
#pragma unroll
  for (int part = 0; part < (GROUPS == 4 ? 2 : 1); ++part) {  // a split: part 0 alone
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float d = dot[part][rr];
      d += __shfl_xor_sync(0xffffffffu, d, 1);
      d += __shfl_xor_sync(0xffffffffu, d, 2);
      if (g + 8 * rr < rows && t4 == 0) dg_tile[part * p.N + grow0 + g + 8 * rr] = d;
    }
  }
}

// B1's epilogue in the forms with epilogue warps, run by warps 1-3 of the producer warpgroup (ew =
// 0..2) for one tile whose v the consumers left in the hand-off `hb`, rounded to T: the tile's
// 64-column groups FIRST..3 (FIRST = 0 in the epilogue-warp form, 1 or 2 in the split forms, where
// the consumers run the groups before FIRST), group g in the hand-off's sub-tile g - FIRST. Item
// idx = 32 ew + lane + 96 i of the tile's 128 rows x 8 chunks: row idx >> 3 and 16-byte chunk idx &
// 7 of each of those groups, so a warp instruction covers 4 rows x 128 contiguous bytes of every
// operand (and reads 4 whole 128-byte rows of the hand-off, conflict-free), and the 8 lanes of a
// row are consecutive: three shuffles give each of its dg partials (its columns in ascending order
// within a lane, then a fixed tree: deterministic). Per element the arithmetic of b1_epilogue
// (b1_element), with du = g * v for v as handed off: rounded once to T, as the PyTorch dataflow's
// grouped GEMM output is (the consumers' form uses the fp32 accumulator). Plain loads: a, b may
// live where da, db go (RECOMPUTE, CONSUME_SAVED); each lane reads its chunks before it writes the
// same chunks.
//
// HAVE_U (p.u != nullptr: SAVE_ALL) and whether the activation is gated are template constants,
// not runtime flags: the item loop is these warps' critical path (they issue in about a fifth of
// its cycles and wait on their own dependency chains), and runtime forms would carry the u
// operand's load, unpacking and selects, and b's predicates, through every item.
template <typename T, int ACT, int FIRST, bool HAVE_U>
__device__ __forceinline__ void b1_epilogue_warps(const RowsParams& p, const TileCoord& c, int ew,
                                                  int lane, const uint32_t* hb) {
  static_assert(FIRST >= 0 && FIRST <= 2, "all four groups, groups 1-3 or groups 2-3");
  constexpr int kGroups = 4 - FIRST;
  constexpr int kDgSplit = dg_split_groups(FIRST);
  constexpr bool kGated = is_gated(static_cast<Activation>(ACT));  // B1's runtime flag, known
  const int h = p.n_out;
  constexpr bool have_u = HAVE_U;
  const T* a_src = static_cast<const T*>(p.a);
  const T* b_src = static_cast<const T*>(p.b);
  const T* u_src = static_cast<const T*>(p.u);
  T* dadb = static_cast<T*>(p.dadb);
  T* gu = static_cast<T*>(p.gu);
  float* dg_tile = dg_tile_parts(p, c);
  constexpr int kItems = kBM * 8;
  constexpr int kLanes = 32 * kB1EpiWarps;
  // Bytes in flight: 96 threads cannot reach the DRAM rate with one column group's loads at a time
  // (~3 KB per SM against the ~24 KB that 3 TB/s at ~1 us needs: B1 1.5-2x slower). So each item
  // loads all its groups' a, b before its first store (the stores may alias
  // the loads under CONSUME_SAVED, so the compiler would not hoist them itself), and the item two
  // iterations ahead is prefetched into L2 (no registers held). Every operand's address is the
  // item's first chunk (group FIRST, column item_col) plus i * 64 elements for group FIRST + i: one
  // 64-bit address per operand and item, the groups at immediate offsets.
  const auto item_col = [&](int ch) { return c.n0 + FIRST * 64 + ch * 8; };
  const auto prefetch_item = [&](int idx) {
    const int row = idx >> 3, ch = idx & 7;
    if (idx >= kItems || row >= c.rows) return;
    const int col0 = item_col(ch);
    const int64_t ab0 = (int64_t(c.row0) + row) * p.ab_ld + col0;
    const T* a_item = a_src + ab0;
    const T* b_item = kGated ? b_src + ab0 : nullptr;  // no b operand otherwise
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      if (col0 + i * 64 >= h) break;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(a_item + i * 64));
      if constexpr (kGated) asm volatile("prefetch.global.L2 [%0];" ::"l"(b_item + i * 64));
    }
  };
  // The routing weight of an item's row takes two dependent loads (row_pair, then g) that every
  // element of the item waits for; in one pass the compiler issues them ahead of the item's a, b
  // loads, so each item paid an L2 round trip before its DRAM loads left. Pipelined instead: the
  // row_pair entry two passes ahead, the weight one pass ahead, from the entry loaded the pass
  // before (no dependent wait inside a pass).
  const auto load_pair = [&](int idx) {
    const int row = idx >> 3;
    return idx < kItems && row < c.rows ? __ldg(p.row_pair + (int64_t(c.row0) + row)) : -1;
  };
  const auto load_gval = [&](int32_t pair) { return pair >= 0 ? __ldg(p.g + pair) : 0.f; };
  prefetch_item(32 * ew + lane + kLanes);
  float gval_next = load_gval(load_pair(32 * ew + lane));
  int32_t pair_after_next = load_pair(32 * ew + lane + kLanes);
  // A pass's dg partials are reduced over their row's 8 lanes (three dependent shuffle round
  // trips) and stored during the NEXT pass, once its a, b loads have left: at the end of the pass
  // they were a serial tail before the loop could issue those loads. Same tree, same bits (1-2 %
  // faster B1 at 16 k-steps on the H200).
  float pending_dot[2] = {0.f, 0.f};
  int64_t pending_grow = 0;
  bool pending_store = false;  // the previous item's row is in the tile and this lane holds chunk 0
  const auto store_pending_dg = [&]() {
#pragma unroll
    for (int part = FIRST == 0 ? 0 : 1; part < 2; ++part) {
      float d = pending_dot[part];
      d += __shfl_xor_sync(0xffffffffu, d, 1);
      d += __shfl_xor_sync(0xffffffffu, d, 2);
      d += __shfl_xor_sync(0xffffffffu, d, 4);
      if (pending_store) dg_tile[part * p.N + pending_grow] = d;
    }
  };
#pragma unroll 1
  for (int base = 32 * ew; base < kItems; base += kLanes) {  // warp-uniform: kItems % 32 == 0
    const int idx = base + lane;
    prefetch_item(idx + 2 * kLanes);
    const float gval = gval_next;
    gval_next = load_gval(pair_after_next);
    pair_after_next = load_pair(idx + 2 * kLanes);
    const int row = idx >> 3, ch = idx & 7;
    const bool row_ok = row < c.rows;
    const int64_t grow = int64_t(c.row0) + row;
    const int col0 = item_col(ch);
    const int64_t ab0 = grow * p.ab_ld + col0;
    const T* a_item = a_src + ab0;
    const T* b_item = kGated ? b_src + ab0 : nullptr;  // no b operand otherwise
    uint4 av[kGroups], bv[kGroups];
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      const bool in = row_ok && col0 + i * 64 < h;  // h % 8 == 0: a chunk is all in or all out
      av[i] = in ? *reinterpret_cast<const uint4*>(a_item + i * 64) : make_uint4(0, 0, 0, 0);
      bv[i] =
          in && kGated ? *reinterpret_cast<const uint4*>(b_item + i * 64) : make_uint4(0, 0, 0, 0);
    }
    store_pending_dg();  // the previous pass's (nothing stored on the first)
    T* const da_item = dadb + grow * p.dadb_ld + col0;
    T* const gu_item = gu + grow * h + col0;
    float dot[2] = {0.f, 0.f};  // dg parts (kDgSplit)
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      const int group = FIRST + i;
      if (!row_ok || col0 + i * 64 >= h) continue;
      const uint4 vv = *reinterpret_cast<const uint4*>(hb + i * kHandoffSubWords + row * 32 +
                                                       ((ch ^ (row & 7)) << 2));
      uint4 uv = make_uint4(0, 0, 0, 0);
      if constexpr (HAVE_U)
        uv = *reinterpret_cast<const uint4*>(u_src + grow * p.u_ld + col0 + i * 64);
      const uint32_t vw[4] = {vv.x, vv.y, vv.z, vv.w};
      const uint32_t aw[4] = {av[i].x, av[i].y, av[i].z, av[i].w};
      const uint32_t bw[4] = {bv[i].x, bv[i].y, bv[i].z, bv[i].w};
      const uint32_t uw[4] = {uv.x, uv.y, uv.z, uv.w};
      uint32_t daw[4], dbw[4], guw[4];
      float& part_dot = dot[group < kDgSplit ? 0 : 1];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 vf = unpack2<T>(vw[q]), af = unpack2<T>(aw[q]);
        const float2 bf = unpack2<T>(bw[q]), uf = unpack2<T>(uw[q]);
        float u0, u1, da0, db0, da1, db1;
        b1_element<T, ACT>(af.x, bf.x, gval * vf.x, have_u, uf.x, u0, da0, db0);
        b1_element<T, ACT>(af.y, bf.y, gval * vf.y, have_u, uf.y, u1, da1, db1);
        part_dot += vf.x * u0;
        part_dot += vf.y * u1;
        daw[q] = pack2<T>(da0, da1);
        dbw[q] = pack2<T>(db0, db1);
        guw[q] = pack2<T>(gval * u0, gval * u1);
      }
      *reinterpret_cast<uint4*>(da_item + i * 64) = make_uint4(daw[0], daw[1], daw[2], daw[3]);
      if constexpr (kGated)
        *reinterpret_cast<uint4*>(da_item + p.db_offset + i * 64) =
            make_uint4(dbw[0], dbw[1], dbw[2], dbw[3]);
      *reinterpret_cast<uint4*>(gu_item + i * 64) = make_uint4(guw[0], guw[1], guw[2], guw[3]);
    }
    pending_dot[0] = dot[0];
    pending_dot[1] = dot[1];
    pending_grow = grow;
    pending_store = row_ok && ch == 0;
  }
  store_pending_dg();  // the last pass's
}

#endif  // MB_SM90_DEVICE

// ACT: the activation (Activation cast to int) for B1's epilogue; 0 for F2 and B4.
// FORM: B1's epilogue form (B1Form); kB1Consumers for F2 and B4.
template <typename T, int KIND, int ACT, int FORM>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_rows_kernel(const __grid_constant__ CUtensorMap tmap_a,
                     const __grid_constant__ CUtensorMap tmap_b0,
                     const __grid_constant__ CUtensorMap tmap_b1, const RowsParams p) {
#if MB_SM90_DEVICE
  constexpr bool kGather = KIND == kB1;
  constexpr bool kBMn = KIND != kF2;
  constexpr bool kEpiWarps = FORM != kB1Consumers;  // epilogue warps and a hand-off
  static_assert(!kEpiWarps || KIND == kB1, "the epilogue-warp forms are B1's");
  constexpr int kStages = stages_for(kEpiWarps);
  constexpr int kConsumerGroups = consumer_groups(FORM);  // B1: 64-column groups run here
  // B1's consumers gather their A half this many k-steps ahead. With 4 stages the gather of k-step
  // it + 2 is issued between k-step it's commit and its wait<1>, into the slot of k-step it - 2;
  // the 3-stage form issues it after the wait, into the slot wgmma(it - 1) released (as F1's
  // short-K form does; a lead of 1 would leave the rows one k-step to land).
  constexpr bool kGatherBeforeWait = kStages >= 4;
  constexpr int kGatherLead = kGatherBeforeWait ? kStages - 2 : kStages - 1;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  // B1's epilogue buffers: the hand-off (epilogue-warp forms), then the consumers' staging.
  uint8_t* epi = smem + kStages * kStageBytes;
  uint8_t* staging = epi + handoff_groups(FORM) * kHandoffSubBytes;
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(epi + epilogue_bytes(FORM));
  uint64_t* empty_bar = full_bar + kStages;
  uint64_t* a_full_bar = empty_bar + kStages;  // B1: [2][kStages], consumer warpgroup wg's A half
  uint64_t* handoff_full = a_full_bar + 2 * kStages;  // epilogue-warp forms only
  uint64_t* handoff_empty = handoff_full + 1;
  int* tile_start = reinterpret_cast<int*>(handoff_empty + 1);  // [E + 1]

  const int tid = threadIdx.x;
  // Broadcast from lane 0: the compiler then knows the warp index is warp-uniform (uniform
  // registers for the barrier and descriptor addresses derived from it).
  const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0), lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_u32(full_bar + s), 1);  // the TMA thread's expect_tx
      mbar_init(smem_u32(empty_bar + s), kConsumerWarps);
      mbar_init(smem_u32(a_full_bar + s), 128);  // B1: one cp.async arrival per consumer thread
      mbar_init(smem_u32(a_full_bar + kStages + s), 128);
    }
    // One arrival per thread on both (each releases its own shared-memory accesses; F1's
    // hand-off, where one arrival per warp made racecheck report hazards).
    mbar_init(smem_u32(handoff_full), 32 * kConsumerWarps);
    mbar_init(smem_u32(handoff_empty), 32 * kB1EpiWarps);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  for (int e = tid; e < p.E; e += kThreads) {
    const int count = __ldg(p.offsets + e + 1) - __ldg(p.offsets + e);
    tile_start[e + 1] = ((count + kBM - 1) / kBM) * p.n_tiles;
  }
  __syncthreads();
  if (warp == 0) warp_prefix_tiles(tile_start, p.E, lane);
  __syncthreads();
  const int total_tiles = tile_start[p.E];
  const int k_tiles = p.halves * p.kt_half;

  if (warp < 4) {
    // ================= producer warpgroup =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kEpiWarps ? kRegsWg0Epi : kRegsWg0)
                 : "memory");
    if constexpr (kEpiWarps) {
      if (warp >= 1) {
        // ================= epilogue warps 1-3 =================
        // Per tile (the same sequence of tile ids as every role): wait for the consumers'
        // hand-off, run the tile's epilogue from it, then every lane releases the buffer.
        const uint32_t* hb = reinterpret_cast<const uint32_t*>(epi);
        const bool have_u = p.u != nullptr;  // SAVE_ALL; uniform over the grid
        uint32_t n = 0;                      // this CTA's tiles so far: hand-off phase n
        for (int t = blockIdx.x; t < total_tiles; t += gridDim.x, ++n) {
          const TileCoord c = decode_tile(t, tile_start, p);
          mbar_wait(smem_u32(handoff_full), n & 1);
          if (have_u)
            b1_epilogue_warps<T, ACT, kConsumerGroups, true>(p, c, warp - 1, lane, hb);
          else
            b1_epilogue_warps<T, ACT, kConsumerGroups, false>(p, c, warp - 1, lane, hb);
          mbar_arrive(smem_u32(handoff_empty));  // every lane, after its own reads
        }
        return;
      }
    }
    if (tid != 0) return;  // one thread issues every TMA (B1: the consumers gather A)
    uint32_t it = 0;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = decode_tile(t, tile_start, p);
      // B boxes (MN-major: 64 columns each; K-major: 128 rows each) that start past n_out are not
      // issued nor expected: their accumulator columns are never stored.
      constexpr int kBoxCols = kBMn ? 64 : kBKBoxRows;
      constexpr uint32_t kBoxBytes = kBMn ? uint32_t(kBMnBoxBytes) : uint32_t(kBKBoxBytes);
      const int b_boxes = min(kBN / kBoxCols, (p.n_out - c.n0 + kBoxCols - 1) / kBoxCols);
      const uint32_t b_bytes = uint32_t(b_boxes) * kBoxBytes;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        const int half = kt >= p.kt_half ? 1 : 0;
        const int k0 = (kt - half * p.kt_half) * kBK;
        mbar_wait(smem_u32(empty_bar + s), ((it / kStages) & 1) ^ 1);
        uint8_t* stage = smem + s * kStageBytes;
        const uint32_t full = smem_u32(full_bar + s);
        mbar_arrive_expect_tx(full, b_bytes + (kGather ? 0u : uint32_t(kATileBytes)));
        if (!kGather) tma_load_3d(smem_u32(stage), &tmap_a, full, k0, half, c.row0);
        const CUtensorMap* mb = half ? &tmap_b1 : &tmap_b0;
        for (int i = 0; i < b_boxes; ++i) {
          const uint32_t dst = smem_u32(stage + kATileBytes + i * kBoxBytes);
          const int cb0 = kBMn ? c.n0 + 64 * i : k0;          // MN: {n, k, e}
          const int cb1 = kBMn ? k0 : c.n0 + kBKBoxRows * i;  // K:  {k, n, e}
          tma_load_3d(dst, mb, full, cb0, cb1, c.e);
        }
      }
    }
  } else {
    // ================= consumer warpgroups =================
    asm volatile(
        "setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kEpiWarps ? kRegsConsumerEpi : kRegsConsumer)
        : "memory");
    const int wg = (warp >> 2) - 1;   // rows [64 wg, 64 wg + 64) of the tile
    const int warp_in_wg = warp & 3;  // rows [16 warp_in_wg, +16) of those
    const int g = lane >> 2, t4 = lane & 3;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    const auto row_range = [&](int t) {
      const TileCoord c = decode_tile(t, tile_start, p);
      return make_int2(c.row0, c.rows);
    };
    uint64_t* my_a_full = a_full_bar + wg * kStages;
    // B1 only (halves == 1): k runs over dy's d columns.
    HalfTileGather<T> gather(static_cast<const T*>(p.a_src), p.lda, p.k_half, k_tiles,
                             p.token_index, total_tiles, wg);
    if constexpr (kGather) {
      gather.start(row_range);
      for (int s = 0; s < kGatherLead; ++s)
        gather.issue(smem_u32(smem + s * kStageBytes), smem_u32(my_a_full + s), row_range);
    }
    uint32_t it = 0;
    uint32_t n = 0;  // epilogue-warp forms: this CTA's tiles so far, the hand-off's phase
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x, ++n) {
      const TileCoord c = decode_tile(t, tile_start, p);
      int prev_s = 0;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(smem_u32(full_bar + s), (it / kStages) & 1);
        if constexpr (kGather) {
          mbar_wait(smem_u32(my_a_full + s), (it / kStages) & 1);
          // cp.async (generic proxy) wrote A; wgmma reads through the async proxy.
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        }
        const uint32_t stage = smem_u32(smem + s * kStageBytes);
        const uint64_t desc_a = smem_desc_kmajor_sw128(stage + wg * (kATileBytes / 2));
        const uint64_t desc_b = kBMn ? smem_desc_mnmajor_sw128(stage + kATileBytes)
                                     : smem_desc_kmajor_sw128(stage + kATileBytes);
        wgmma_kstep<T, 0, kBMn ? 1 : 0>(acc, desc_a, desc_b, kt > 0);
        if constexpr (kGather && kGatherBeforeWait) {
          // While wgmma(it - 1) and wgmma(it) run: our A of k-step it + kGatherLead into the slot
          // of k-step it - 2, whose wgmma completed before the previous k-step's wait<1>.
          const int refill = int((it + kGatherLead) % kStages);
          gather.issue(smem_u32(smem + refill * kStageBytes), smem_u32(my_a_full + refill),
                       row_range);
        }
        wgmma_wait<1>();
        fence_accumulators(acc);
        if (kt > 0 && lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));
        if constexpr (kGather && !kGatherBeforeWait) {  // the slot of k-step it - 1, released now
          const int refill = int((it + kGatherLead) % kStages);
          gather.issue(smem_u32(smem + refill * kStageBytes), smem_u32(my_a_full + refill),
                       row_range);
        }
        prev_s = s;
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));

      const int tile_row = wg * 64 + warp_in_wg * 16;
      uint32_t* stg = reinterpret_cast<uint32_t*>(staging + (warp - 4) * kB1StageWarpBytes);
      if constexpr (kEpiWarps) {
        // ---- hand-off: wait until the epilogue warps have released the previous tile's buffer
        // (for n = 0, parity 1 of a fresh barrier returns at once), round v of the groups they run
        // into it and go on (the split form: after group 0's epilogue here). Register 4j + q of
        // lane (g, t4): row g + 8 (q >> 1) of the warp's 16, column 8j + 2 t4 + (q & 1): group
        // j >> 3 (sub-tile (j >> 3) - kConsumerGroups), chunk j & 7, word t4; a warp instruction
        // (fixed j, rr) writes 8 rows (row & 7 == g) at chunks (j & 7) ^ g: all 32 banks once.
        mbar_wait(smem_u32(handoff_empty), (n & 1) ^ 1);
        uint32_t* hb = reinterpret_cast<uint32_t*>(epi);
#pragma unroll
        for (int j = 8 * kConsumerGroups; j < 32; ++j) {
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            const int row = tile_row + g + 8 * rr;
            hb[((j >> 3) - kConsumerGroups) * kHandoffSubWords + row * 32 + (((j & 7) ^ g) << 2) +
               t4] = pack2<T>(acc[4 * j + 2 * rr], acc[4 * j + 2 * rr + 1]);
          }
        }
        mbar_arrive(smem_u32(handoff_full));  // every lane, after its own writes
        if constexpr (kConsumerGroups > 0)
          b1_epilogue<T, ACT, kConsumerGroups, true>(p, c, tile_row, lane, stg, acc);
      } else if constexpr (KIND == kB1) {
        b1_epilogue<T, ACT, 4, false>(p, c, tile_row, lane, stg, acc);
      } else {
        // Each lane stores its column pairs of a row as one 4-byte word (n_out % 8 == 0: a pair
        // is all in or all out).
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int row = tile_row + g + 8 * rr;
          if (row < c.rows) {
            const int64_t r = int64_t(c.row0) + row;
            const int64_t pair = p.row_pair != nullptr ? int64_t(p.row_pair[r]) : r;
            const float w = p.out_w != nullptr ? p.out_w[pair] : 1.f;
            T* orow =
                static_cast<T*>(p.out) + (p.out_by_pair ? pair : r) * p.out_ld + c.n0 + 2 * t4;
#pragma unroll
            for (int j = 0; j < 32; ++j) {
              if (c.n0 + 8 * j < p.n_out)
                *reinterpret_cast<uint32_t*>(orow + 8 * j) = pack2<T>(
                    row_value<T>(w, acc[4 * j + 2 * rr]), row_value<T>(w, acc[4 * j + 2 * rr + 1]));
            }
          }
        }
      }
    }
  }
#else
  __trap();  // no sm_90a image: sm90_rows_supported never lets this run
#endif  // MB_SM90_DEVICE
}

// ---- host -----------------------------------------------------------------------------------

using KernelFn = void (*)(const CUtensorMap, const CUtensorMap, const CUtensorMap,
                          const RowsParams);

template <typename T, int FORM>
KernelFn b1_kernel_for(Activation act) {
  switch (act) {
    // clang-format off
#define MOEBLAZE_ACTIVATION(Name, CODE, GATED, FN) \
    case Activation::Name: return sm90_rows_kernel<T, kB1, int(Activation::Name), FORM>;
#include "common/activations.def"
    // clang-format on
  }
  return nullptr;
}

template <typename T>
KernelFn kernel_for_type(int kind, Activation act, int form) {
  if (kind == kF2) return sm90_rows_kernel<T, kF2, 0, kB1Consumers>;
  if (kind == kB4) return sm90_rows_kernel<T, kB4, 0, kB1Consumers>;
  if (form == kB1Warps) return b1_kernel_for<T, kB1Warps>(act);
  if (form == kB1Split) return b1_kernel_for<T, kB1Split>(act);
  if (form == kB1Split2) return b1_kernel_for<T, kB1Split2>(act);
  return b1_kernel_for<T, kB1Consumers>(act);
}

// form: B1's epilogue form (B1Form; kind == kB1 only).
KernelFn kernel_for(Dtype dtype, int kind, Activation act, int form) {
  if (dtype == Dtype::BF16) return kernel_for_type<__nv_bfloat16>(kind, act, form);
  if (dtype == Dtype::F16) return kernel_for_type<__half>(kind, act, form);
  return nullptr;
}

// B1's form for tiles of k_tiles k-steps (see B1Form and the measurements at
// kB1EpiWarpsMinKTiles): the two-group split at 8 k-steps, where the main loop is short enough
// that the consumers can take half the epilogue; the split for medium K, where the epilogue warps
// alone would still be the slower side; the epilogue warps alone for long K; the consumers' form
// below 8 and past 64 k-steps (unmeasured). forced (Sm90Forms::b1_form) >= 0 overrides it.
int b1_form_for(int k_tiles, int forced) {
  if (forced >= kB1Consumers && forced <= kB1Split2) return forced;
  if (k_tiles < kB1EpiWarpsMinKTiles || k_tiles > kB1EpiWarpsMaxKTiles) return kB1Consumers;
  if (k_tiles <= kB1Split2MaxKTiles) return kB1Split2;
  return k_tiles <= kB1SplitMaxKTiles ? kB1Split : kB1Warps;
}

// [count2, count1, count0] row-major with dim 0 contiguous; see make_map_3d.
template <typename T>
CUtensorMap map_for(const void* base, int64_t dim0, int64_t dim1, int64_t dim2, int64_t stride1,
                    int64_t stride2, uint32_t box0, uint32_t box1, uint32_t box2,
                    const char* what) {
  return make_map_3d<T>(base, uint64_t(dim0), uint64_t(dim1), uint64_t(dim2), uint64_t(stride1),
                        uint64_t(stride2), box0, box1, box2, what);
}

// Columns [col0, col0 + cols) of a weight operand [E, rows, ld] (ld contiguous; 16-bit elements):
// MN-major boxes {64 cols, 64 rows} when the GEMM's n runs along the columns, K-major boxes
// {64 cols, 128 rows} when k does. Columns past the range read as zeros.
CUtensorMap weight_map_range(Dtype dtype, const void* w, int64_t E, int64_t rows, int64_t ld,
                             int64_t col0, int64_t cols, bool mn_major, const char* what) {
  const uint32_t box1 = mn_major ? uint32_t(kBK) : uint32_t(kBKBoxRows);
  const void* base = static_cast<const uint16_t*>(w) + col0;
  if (dtype == Dtype::BF16)
    return map_for<__nv_bfloat16>(base, cols, rows, E, ld, rows * ld, 64, box1, 1, what);
  return map_for<__half>(base, cols, rows, E, ld, rows * ld, 64, box1, 1, what);
}

// Rows [row0, row0 + rows) of a K-major weight operand [E, total_rows, ld] (ld contiguous, the
// GEMM's k): boxes {64 k, 128 rows}; rows past the range read as zeros.
CUtensorMap weight_rows_map(Dtype dtype, const void* w, int64_t E, int64_t total_rows, int64_t ld,
                            int64_t row0, int64_t rows, const char* what) {
  const void* base = static_cast<const uint16_t*>(w) + row0 * ld;
  if (dtype == Dtype::BF16)
    return map_for<__nv_bfloat16>(base, ld, rows, E, ld, total_rows * ld, 64, kBKBoxRows, 1, what);
  return map_for<__half>(base, ld, rows, E, ld, total_rows * ld, 64, kBKBoxRows, 1, what);
}

// A row operand [N, halves * k_half] as {k_half, halves, N}, box {64 k, 1, 128 rows}.
CUtensorMap rows_map(Dtype dtype, const void* a, int64_t N, int64_t k_half, int halves,
                     const char* what) {
  if (dtype == Dtype::BF16)
    return map_for<__nv_bfloat16>(a, k_half, halves, N, k_half, halves * k_half, kBK, 1, kBM, what);
  return map_for<__half>(a, k_half, halves, N, k_half, halves * k_half, kBK, 1, kBM, what);
}

RowsParams base_params(const LayerDesc& desc, const int32_t* offsets, int n_out, int64_t k_half,
                       int halves, int64_t T) {
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

void launch(const LayerDesc& desc, int kind, const CUtensorMap& a, const CUtensorMap& b0,
            const CUtensorMap& b1, const RowsParams& params, const Sm90Forms& forms,
            cudaStream_t stream, const char* what) {
  RowsParams p = params;
  p.band_mtiles = sm90_band_mtiles(kind == kF2   ? Sm90Gemm::F2
                                   : kind == kB4 ? Sm90Gemm::B4
                                                 : Sm90Gemm::B1,
                                   p.n_tiles, forms.band_mtiles);
  const Sm90Device& info = sm90_current_device();
  MB_REQUIRE(info.usable, MOEBLAZE_ERR_CUDA, "sm90 %s launched on an unsupported device", what);
  // Persistent: one CTA per SM (the shared memory allows no more), fewer when there are fewer
  // tiles than SMs (an upper bound: sum_e ceil(count_e / 128) <= N / 128 + E).
  const int64_t max_tiles = (p.N / kBM + desc.E) * p.n_tiles;
  const int grid = int(max_tiles < info.sms ? max_tiles : info.sms);
  const int form = kind == kB1 ? b1_form_for(p.halves * p.kt_half, forms.b1_form) : kB1Consumers;
  const KernelFn kernel = kernel_for(desc.dtype, kind, desc.activation, form);
  MB_REQUIRE(kernel != nullptr, MOEBLAZE_ERR_CUDA, "sm90 %s: unsupported dtype", what);
  kernel<<<grid, kThreads, smem_bytes(p.E, form), stream>>>(a, b0, b1, p);
  check_launch(what);
}

}  // namespace

size_t sm90_rows_max_smem_bytes() {
  return kMaxSmemBytes;
}

bool sm90_rows_prepare_kernels() {
  for (Dtype dtype : {Dtype::BF16, Dtype::F16}) {
    for (int kind : {kF2, kB4, kB1}) {
      for (Activation act : kActivations) {
        if (kind != kB1 && act != Activation::SwiGLU) continue;  // one kernel, any activation
        for (int form : {kB1Consumers, kB1Warps, kB1Split, kB1Split2}) {
          if (form != kB1Consumers && kind != kB1) continue;
          if (!prepare_kernel(kernel_for(dtype, kind, act, form), kMaxSmemBytes)) return false;
        }
      }
    }
  }
  return true;
}

int sm90_parse_b1_form(const char* value) {
  if (value == nullptr) return -1;
  if (std::strcmp(value, "consumers") == 0) return kB1Consumers;
  if (std::strcmp(value, "warps") == 0) return kB1Warps;
  if (std::strcmp(value, "split") == 0) return kB1Split;
  if (std::strcmp(value, "split2") == 0) return kB1Split2;
  return -1;
}

bool sm90_rows_supported(const LayerDesc& desc, int64_t T,
                         std::initializer_list<const void*> tensors) {
  if (desc.dtype != Dtype::BF16 && desc.dtype != Dtype::F16) return false;
  if (desc.d <= 0 || desc.h <= 0 || desc.d % 8 != 0 || desc.h % 8 != 0) return false;
  if (desc.E < 1 || desc.E > kMaxExperts || desc.k < 1 || T < 0) return false;
  const int64_t N = T * desc.k;
  const int64_t widest = desc.d > 2 * desc.h ? desc.d : 2 * desc.h;
  const int64_t max_tiles = (N / kBM + desc.E) * ((widest + kBN - 1) / kBN);
  constexpr int64_t kIntMax = 0x7fffffff;
  if (widest > kIntMax || N > kIntMax || T > kIntMax || max_tiles > kIntMax) return false;
  for (const void* ptr : tensors)
    if (ptr != nullptr && !aligned16(ptr)) return false;
  return sm90_current_device().usable;
}

void set_rows_out(RowsParams& p, const Sm90RowsOut& out) {
  p.out = out.rows;
  p.out_ld = out.ld != 0 ? out.ld : p.n_out;
  p.row_pair = out.pair;
  p.out_w = out.weights;
  p.out_by_pair = out.by_pair;
}

void sm90_f2_launch(const LayerDesc& desc, int64_t T, const void* u, const int32_t* expert_offsets,
                    const void* w_down, const Sm90Columns& range, const Sm90RowsOut& out,
                    const Sm90Forms& forms, cudaStream_t stream) {
  const int64_t N = T * desc.k;
  if (N == 0) return;
  const int64_t cols = range.cols != 0 ? range.cols : desc.d;
  RowsParams p = base_params(desc, expert_offsets, int(cols), desc.h, 1, T);
  set_rows_out(p, out);
  const CUtensorMap a = rows_map(desc.dtype, u, N, desc.h, 1, "F2");
  // w_down [E, d, h]: the GEMM's n runs over d (rows: those of the range), k over h
  // (contiguous): K-major.
  const CUtensorMap b =
      weight_rows_map(desc.dtype, w_down, desc.E, desc.d, desc.h, range.col0, cols, "F2");
  launch(desc, kF2, a, b, b, p, forms, stream, "sm90_rows_kernel (F2)");
}

void sm90_b4_launch(const LayerDesc& desc, int64_t T, const void* dadb,
                    const int32_t* expert_offsets, const void* w_gate, const void* w_up,
                    const Sm90Columns& range, const Sm90RowsOut& out, const Sm90Forms& forms,
                    cudaStream_t stream) {
  const int64_t N = T * desc.k;
  if (N == 0) return;
  const int halves = desc.gated() ? 2 : 1;
  const int64_t cols = range.cols != 0 ? range.cols : desc.d;
  RowsParams p = base_params(desc, expert_offsets, int(cols), desc.h, halves, T);
  set_rows_out(p, out);
  const CUtensorMap a = rows_map(desc.dtype, dadb, N, desc.h, halves, "B4");
  // w_gate / w_up [E, h, d]: k runs over h (rows), n over the range's columns of d: MN-major.
  const CUtensorMap b0 =
      weight_map_range(desc.dtype, w_gate, desc.E, desc.h, desc.d, range.col0, cols, true, "B4");
  const CUtensorMap b1 = desc.gated() ? weight_map_range(desc.dtype, w_up, desc.E, desc.h, desc.d,
                                                         range.col0, cols, true, "B4")
                                      : b0;
  launch(desc, kB4, a, b0, b1, p, forms, stream, "sm90_rows_kernel (B4)");
}

void sm90_b1_launch(const LayerDesc& desc, int64_t T, const void* dy, const int32_t* expert_offsets,
                    const int32_t* expert_token_indices, const void* w_down,
                    const Sm90B1Epilogue& ep, const Sm90Forms& forms, cudaStream_t stream) {
  const int64_t N = T * desc.k;
  if (N == 0) return;
  const int64_t cols = ep.cols != 0 ? ep.cols : desc.h;
  RowsParams p = base_params(desc, expert_offsets, int(cols), desc.d, 1, T);
  p.a_src = dy;
  p.token_index = expert_token_indices;
  p.lda = int(desc.d);
  p.gated = desc.gated();
  p.ab_ld = ep.ab_ld != 0 ? ep.ab_ld : desc.h;
  p.dadb_ld = ep.dadb_ld != 0 ? ep.dadb_ld : (p.gated ? 2 * desc.h : desc.h);
  p.db_offset = desc.h;
  p.u_ld = ep.u_ld != 0 ? ep.u_ld : desc.h;
  p.a = ep.a_src;
  p.b = p.gated ? ep.b_src : nullptr;
  p.u = ep.u_src;
  p.g = ep.g;
  p.row_pair = ep.row_pair;
  p.dadb = ep.dadb;
  p.gu = ep.gu;
  p.dg_part = ep.dg_part;
  // w_down [E, d, h]: k runs over d (rows), n over the range's columns of h: MN-major. A is
  // gathered (no map; the kernel never reads tmap_a, the B map stands in for it).
  const CUtensorMap b =
      weight_map_range(desc.dtype, w_down, desc.E, desc.d, desc.h, ep.col0, cols, true, "B1");
  launch(desc, kB1, b, b, b, p, forms, stream, "sm90_rows_kernel (B1)");
}

}  // namespace cuda
}  // namespace moeblaze
