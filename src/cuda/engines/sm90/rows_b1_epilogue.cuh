// B1's epilogue in the rows kernel (rows_gemm.cu): the activation backward of a tile's v, in the
// consumers from their accumulators (b1_epilogue: the consumers' form and the split form) or from a
// hand-off of v (b1_epilogue_items: the epilogue warps, and the consumers of the two-group split);
// the forms are described in rows_layout.cuh. Private to rows_gemm.cu (an anonymous namespace).
#pragma once

#include "cuda/engines/sm90/rows_layout.cuh"

namespace moeblaze {
namespace cuda {
namespace {

#if MB_SM90_DEVICE

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
    const float s = act_math::sigmoid<float, kTanhSigmoid<T>>(a);
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
    u = have_u ? u_saved : round_to<T>(act_forward<T>(act, a, b));
    act_backward<T>(act, a, b, du, &da, &db);
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

// Early in a tile's main loop (rows_gemm.cu's tile bookkeeping): the a, b (and, under SAVE_ALL, u)
// chunks of this warp's 16 rows and the tile's first GROUPS 64-column groups that the consumers'
// epilogue will read after the main loop (all four groups in the consumers' form, the groups the
// consumers run in the split forms), prefetched into L2 (no registers held). The epilogue then
// finds them in L2 instead of DRAM: its first loads would otherwise stall both consumer warpgroups,
// and the tensor cores with them, for a DRAM latency. Lanes 0-15 take a's rows (and u's), lanes
// 16-31 b's; each chunk (64 columns, 128 bytes) gets its first and its last 16 bytes below n_out
// prefetched, which covers it wherever the row's stride puts it, and touches no address the
// epilogue would not read.
template <typename T, int GROUPS>
__device__ __forceinline__ void b1_prefetch_epilogue_rows(const RowsParams& p, const TileCoord& c,
                                                          int tile_row, int lane) {
  const int row = lane & 15;
  if (tile_row + row >= c.rows) return;
  const int64_t r = int64_t(c.row0) + tile_row + row;
  const T* ab = static_cast<const T*>(lane < 16 ? p.a : p.b);     // p.b is null when not gated
  const T* u = lane < 16 ? static_cast<const T*>(p.u) : nullptr;  // SAVE_ALL only
#pragma unroll
  for (int group = 0; group < GROUPS; ++group) {
    const int col0 = c.n0 + group * kStageCols;
    if (col0 >= p.n_out) break;
    const int last = min(col0 + kStageCols, p.n_out) - 8 - col0;  // n_out % 8 == 0
    if (ab != nullptr) {
      const T* chunk = ab + r * p.ab_ld + col0;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(chunk));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(chunk + last));
    }
    if (u != nullptr) {
      const T* chunk = u + r * p.u_ld + col0;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(chunk));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(chunk + last));
    }
  }
}

// B1's epilogue for one warp's 16 rows of a tile from its accumulators, in 2 steps of 8 rows x 64
// columns for each of the tile's first GROUPS 64-column groups (4: all of it, in the consumers'
// form; 1: group 0, in the split form): a, b (u under SAVE_ALL) come in by coalesced 16-byte loads
// into the warp's staging buffers (the next step's a, b loads are issued before this step's math),
// each lane turns its fragment words into da, db, g*u in place, and those go out by coalesced
// 16-byte stores. ROUND_V: v as the split form hands the other groups off, rounded once to T (the
// consumers' form uses the fp32 accumulator).
//
// Register 4j + q of lane (g, t4) holds row g (q < 2) or g + 8 (q >= 2), column 8j + 2 t4 + (q & 1)
// of the tile. Staging (coalesced 16-byte accesses instead of 8 rows x 16 bytes per instruction
// from the fragment layout) and the prefetch each pay (B1 13 % faster together on the H200): only
// two warps per scheduler run this epilogue, so nothing else hides the loads' latency. Against
// the 168-register budget the prefetch costs a few words of spill (ptxas: 4-68 bytes of spill
// stores per B1 kernel), and the spill-free form is the slower one.
//
// ACT is a template parameter: a runtime switch over the activations, inlined at each of the
// 64 unrolled elements, makes this epilogue four times slower, most likely from the code size.
template <typename T, int ACT, int GROUPS, bool ROUND_V>
__device__ __forceinline__ void b1_epilogue(const RowsParams& p, const TileCoord& c, int tile_row,
                                            int lane, uint32_t* stg, const float (&acc)[128]) {
  static_assert(GROUPS == 1 || GROUPS == 4, "the split form's group, or the tile");
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

// B1's epilogue from the hand-off `hb` (v rounded to T; hb: group FIRST's 64-column sub-tile, the
// next groups' after it), for the tile's groups FIRST..LAST-1, run by WARPS warps (w = 0 ..
// WARPS-1): the epilogue warps (warps 1-3 of the producer warpgroup) run groups
// consumer_groups(FORM)..3 while the consumers go on, and in the two-group split the 8 consumer
// warps run groups 0-1 themselves after handing off the whole tile. Item idx = 32 w + lane + 32
// WARPS i of the tile's 128 rows x 8 chunks: row idx >> 3 and 16-byte chunk idx & 7 of each of
// those groups, so a warp instruction covers 4 rows x 128 contiguous bytes of every operand (and
// reads 4 whole 128-byte rows of the hand-off, conflict-free), and the 8 lanes of a row are
// consecutive: three shuffles give each of its dg partials (its columns in ascending order within a
// lane, then a fixed tree: deterministic). Groups before SPLIT go to dg part 0, the others to part
// 1 (each side of a split writes only its own part). Per element the arithmetic of b1_epilogue
// (b1_element), with du = g * v for v as handed off: rounded once to T, as the PyTorch dataflow's
// grouped GEMM output is (the consumers' form uses the fp32 accumulator). Plain loads: a, b may
// live where da, db go (RECOMPUTE, CONSUME_SAVED); each lane reads its chunks before it writes the
// same chunks.
//
// Why the two-group split's consumers use this loop rather than b1_epilogue from their
// accumulators: ~25 instructions an element against b1_epilogue's ~42, and at 8 k-steps their
// epilogue is on B1's critical path (on the H200, B1 11-15 % faster at 8 k-steps; with the one
// group of the split form, at 9-16 k-steps, 1-2 % slower: b1_epilogue stays there).
//
// HAVE_U (p.u != nullptr: SAVE_ALL) and whether the activation is gated are template constants,
// not runtime flags: the item loop is these warps' critical path (they issue in about a fifth of
// its cycles and wait on their own dependency chains), and runtime forms would carry the u
// operand's load, unpacking and selects, and b's predicates, through every item.
template <typename T, int ACT, int FIRST, int LAST, int SPLIT, int WARPS, bool HAVE_U>
__device__ __forceinline__ void b1_epilogue_items(const RowsParams& p, const TileCoord& c, int w,
                                                  int lane, const uint32_t* hb) {
  static_assert(0 <= FIRST && FIRST < LAST && LAST <= 4, "a range of the tile's four groups");
  static_assert(SPLIT >= 1 && SPLIT <= 2, "dg part 0: the groups before SPLIT");
  constexpr int kGroups = LAST - FIRST;
  constexpr int kDgSplit = SPLIT;
  // The dg parts this range touches.
  constexpr int kFirstPart = FIRST < SPLIT ? 0 : 1, kEndPart = LAST > SPLIT ? 2 : 1;
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
  constexpr int kLanes = 32 * WARPS;
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
  prefetch_item(32 * w + lane + kLanes);
  float gval_next = load_gval(load_pair(32 * w + lane));
  int32_t pair_after_next = load_pair(32 * w + lane + kLanes);
  // A pass's dg partials are reduced over their row's 8 lanes (three dependent shuffle round
  // trips) and stored during the NEXT pass, once its a, b loads have left: at the end of the pass
  // they were a serial tail before the loop could issue those loads. Same tree, same bits (1-2 %
  // faster B1 at 16 k-steps on the H200).
  float pending_dot[2] = {0.f, 0.f};
  int64_t pending_grow = 0;
  bool pending_store = false;  // the previous item's row is in the tile and this lane holds chunk 0
  const auto store_pending_dg = [&]() {
#pragma unroll
    for (int part = kFirstPart; part < kEndPart; ++part) {
      float d = pending_dot[part];
      d += __shfl_xor_sync(0xffffffffu, d, 1);
      d += __shfl_xor_sync(0xffffffffu, d, 2);
      d += __shfl_xor_sync(0xffffffffu, d, 4);
      if (pending_store) dg_tile[part * p.N + pending_grow] = d;
    }
  };
  // An item's a, b chunks: zeros past the items, the tile's rows or h (h % 8 == 0: a chunk is all
  // in or all out).
  const auto load_item = [&](int idx, uint4(&av)[kGroups], uint4(&bv)[kGroups]) {
    const int row = idx >> 3, ch = idx & 7;
    const bool row_ok = idx < kItems && row < c.rows;
    const int col0 = item_col(ch);
    const int64_t ab0 = (int64_t(c.row0) + row) * p.ab_ld + col0;
    const T* a_item = a_src + ab0;
    const T* b_item = kGated ? b_src + ab0 : nullptr;  // no b operand otherwise
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      const bool in = row_ok && col0 + i * 64 < h;
      av[i] = in ? *reinterpret_cast<const uint4*>(a_item + i * 64) : make_uint4(0, 0, 0, 0);
      bv[i] =
          in && kGated ? *reinterpret_cast<const uint4*>(b_item + i * 64) : make_uint4(0, 0, 0, 0);
    }
  };
  // Where the registers allow it, the next pass's a, b are loaded during this pass: the item's
  // unpacks otherwise wait on loads issued in the same pass. The pass's own loads still precede
  // its stores, so each lane reads its chunks before it writes them (a, b may live where da, db
  // go). Not with a saved u: its loads, inside the group loop, then lose their head start (ptxas).
  constexpr bool kLoadAhead = !HAVE_U && b1_items_load_ahead(kGroups, kGated);
  uint4 next_a[kGroups], next_b[kGroups];  // the next pass's item (kLoadAhead)
  if constexpr (kLoadAhead) load_item(32 * w + lane, next_a, next_b);
#pragma unroll 1
  for (int base = 32 * w; base < kItems; base += kLanes) {  // warp-uniform: kItems % 32 == 0
    const int idx = base + lane;
    prefetch_item(idx + 2 * kLanes);
    const float gval = gval_next;
    gval_next = load_gval(pair_after_next);
    pair_after_next = load_pair(idx + 2 * kLanes);
    const int row = idx >> 3, ch = idx & 7;
    const bool row_ok = row < c.rows;
    const int64_t grow = int64_t(c.row0) + row;
    const int col0 = item_col(ch);
    uint4 av[kGroups], bv[kGroups];
    if constexpr (kLoadAhead) {
#pragma unroll
      for (int i = 0; i < kGroups; ++i) {
        av[i] = next_a[i];
        bv[i] = next_b[i];
      }
      load_item(idx + kLanes, next_a, next_b);
    } else {
      load_item(idx, av, bv);
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

}  // namespace
}  // namespace cuda
}  // namespace moeblaze
