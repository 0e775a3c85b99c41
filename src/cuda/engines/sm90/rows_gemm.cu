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
// 9-16 k-steps (the split form) the consumers keep the tile's first 64 columns and run their
// epilogue themselves after the hand-off; with 8 (the two-group split) they hand off the whole
// tile and run its first 128 columns from the hand-off with the epilogue warps' item loop.
#include "cuda/engines/sm90/rows_gemm.hpp"

#include <algorithm>
#include <cstring>

#include "common/activation_math.hpp"
#include "common/status.hpp"
#include "cuda/cuda_util.cuh"
#include "cuda/engines/sm90/common.cuh"
#include "cuda/engines/sm90/device.hpp"
#include "cuda/engines/sm90/rows_b1_epilogue.cuh"
#include "cuda/engines/sm90/rows_layout.cuh"

namespace moeblaze {
namespace cuda {
namespace {

using namespace sm90;

#if MB_SM90_DEVICE

// F2 / B4 in the epilogue-warp form (FORM kB1Warps): the hand-off holds the tile's rows as stored
// (row_value, rounded to T, B1's hand-off layout); epilogue warp ew (0..2) stores rows ew, ew + 3,
// ... and lane q copies 16-byte chunk q & 7 of 64-column group q >> 3, so one warp instruction
// writes a whole 512-byte row. Rows past c.rows and chunks past n_out (n_out % 8 == 0: a chunk is
// all in or all out) are not stored. tools/models/b1_epilogue_warps_model.py checks the indexing.
template <typename T>
__device__ __forceinline__ void rows_store_warps(const RowsParams& p, const TileCoord& c, int ew,
                                                 int lane, const uint32_t* hb) {
  const int group = lane >> 3, chunk = lane & 7;
  const int col = c.n0 + 8 * lane;
  const bool col_in = col < p.n_out;
  const uint32_t* src = hb + group * kHandoffSubWords;
  const uint64_t out_col = reinterpret_cast<uint64_t>(p.out) + uint64_t(col) * sizeof(T);
  const uint64_t row_bytes = uint64_t(p.out_ld) * sizeof(T);
  if (!p.out_by_pair) {
    // Consecutive rows: a running address, where forming each row's from its index took ~30
    // instructions a row (SASS).
    uint64_t dst = out_col + uint64_t(int64_t(c.row0) + ew) * row_bytes;
    for (int row = ew; row < c.rows; row += kB1EpiWarps, dst += kB1EpiWarps * row_bytes) {
      const uint4 v = *reinterpret_cast<const uint4*>(src + row * 32 + ((chunk ^ (row & 7)) << 2));
      store16_if(col_in, reinterpret_cast<void*>(dst), v);
    }
    return;
  }
  for (int row = ew; row < c.rows; row += kB1EpiWarps) {
    const uint64_t out_row = uint64_t(p.row_pair[int64_t(c.row0) + row]);
    const uint4 v = *reinterpret_cast<const uint4*>(src + row * 32 + ((chunk ^ (row & 7)) << 2));
    store16_if(col_in, reinterpret_cast<void*>(out_col + out_row * row_bytes), v);
  }
}

#endif  // MB_SM90_DEVICE

static_assert(kConsumerWarps * 32 == 256, "consumer_warps_sync's thread count");

// ACT: the activation (Activation cast to int) for B1's epilogue; 0 for F2 and B4.
// FORM: B1's epilogue form (B1Form); F2 and B4: kB1Consumers (the consumers store their rows) or
// kB1Warps (the epilogue warps store them from the hand-off while the consumers go on).
// CLUSTER: 1, or 2 (FORM kB1Warps) for clusters of two CTAs on adjacent m-tiles of one expert
// that share B: each CTA's producer loads every other B box of a stage into both CTAs (TMA
// multicast), so B crosses L2 once for the pair; a stage is refilled once both CTAs' consumers
// have released it.
template <typename T, int KIND, int ACT, int FORM, int CLUSTER>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_rows_kernel(const __grid_constant__ CUtensorMap tmap_a,
                     const __grid_constant__ CUtensorMap tmap_b0,
                     const __grid_constant__ CUtensorMap tmap_b1, const RowsParams p) {
#if MB_SM90_DEVICE
  constexpr bool kGather = KIND == kB1;
  constexpr bool kBMn = KIND != kF2;
  constexpr bool kEpiWarps = FORM != kB1Consumers;  // epilogue warps and a hand-off
  static_assert(KIND == kB1 || FORM == kB1Consumers || FORM == kB1Warps,
                "F2 and B4 run their store in the consumers or wholly in the epilogue warps");
  constexpr int kStages = stages_for(kEpiWarps);
  constexpr int kConsumerGroups = consumer_groups(FORM);  // B1: 64-column groups run here
  // B1's consumers gather their A half this many k-steps ahead. With 4 stages the gather of k-step
  // it + 2 is issued between k-step it's commit and its wait<1>, into the slot of k-step it - 2;
  // the 3-stage form issues it after the wait, into the slot wgmma(it - 1) released (as F1's
  // short-K form does; a lead of 1 would leave the rows one k-step to land).
  constexpr bool kGatherBeforeWait = kStages >= 4;
  constexpr int kGatherLead = kGatherBeforeWait ? kStages - 2 : kStages - 1;
  extern __shared__ uint8_t smem_raw[];
  const GatherPipelineSmem<kStages, kStageBytes> shm(smem_raw, epilogue_bytes(FORM));
  // The epilogue buffers: the hand-off (epilogue-warp forms), then the consumers' staging.
  uint8_t* staging = shm.epi + handoff_groups(FORM) * kHandoffSubBytes;

  const int tid = threadIdx.x;
  // Broadcast from lane 0: the compiler then knows the warp index is warp-uniform (uniform
  // registers for the barrier and descriptor addresses derived from it).
  const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0), lane = tid & 31;

  static_assert(CLUSTER == 1 || (CLUSTER == 2 && FORM == kB1Warps), "clusters: the warps form");
  if (tid == 0) shm.init_barriers(kConsumerWarps, kB1EpiWarps, CLUSTER);
  const int total_tiles = build_tile_prefix<kBM * CLUSTER, kThreads>(shm.tile_start, p.offsets, p.E,
                                                                     p.n_tiles, tid, warp, lane);
  const PersistentPlace place = persistent_place<CLUSTER>();
  const int rank = place.rank, first_tile = place.first_tile, tile_step = place.tile_step;
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
        const uint32_t* hb = reinterpret_cast<const uint32_t*>(shm.epi);
        const bool have_u = p.u != nullptr;  // SAVE_ALL; uniform over the grid
        uint32_t n = 0;                      // this CTA's tiles so far: hand-off phase n
        for (int t = first_tile; t < total_tiles; t += tile_step, ++n) {
          const TileCoord c = decode_tile<CLUSTER>(t, shm.tile_start, p, rank);
          mbar_wait(smem_u32(shm.handoff_full), n & 1);
          // Their first group's sub-tile of the hand-off.
          const uint32_t* hb_first =
              hb + (kConsumerGroups - handoff_first_group(FORM)) * kHandoffSubWords;
          constexpr int kSplit = dg_split_groups(kConsumerGroups);
          if constexpr (KIND != kB1)
            rows_store_warps<T>(p, c, warp - 1, lane, hb);
          else if (have_u)
            b1_epilogue_items<T, ACT, kConsumerGroups, 4, kSplit, kB1EpiWarps, true>(
                p, c, warp - 1, lane, hb_first);
          else
            b1_epilogue_items<T, ACT, kConsumerGroups, 4, kSplit, kB1EpiWarps, false>(
                p, c, warp - 1, lane, hb_first);
          mbar_arrive(smem_u32(shm.handoff_empty));  // every lane, after its own reads
        }
      }
    }
    // One thread issues every TMA (B1: the consumers gather A).
    uint32_t it = 0;
    for (int t = first_tile; tid == 0 && t < total_tiles; t += tile_step) {
      const TileCoord c = decode_tile<CLUSTER>(t, shm.tile_start, p, rank);
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
        mbar_wait(smem_u32(shm.empty_bar + s), ((it / kStages) & 1) ^ 1);
        uint8_t* stage = shm.stage(s);
        const uint32_t full = smem_u32(shm.full_bar + s);
        // A cluster's CTA without rows (past its expert's end) loads no A.
        const bool load_a = !kGather && (CLUSTER == 1 || c.rows > 0);
        mbar_arrive_expect_tx(full, b_bytes + (load_a ? uint32_t(kATileBytes) : 0u));
        if (load_a) tma_load_3d(smem_u32(stage), &tmap_a, full, k0, half, c.row0);
        const CUtensorMap* mb = half ? &tmap_b1 : &tmap_b0;
        // Clusters: CTA rank issues boxes rank, rank + CLUSTER, ... into every CTA.
        for (int i = CLUSTER > 1 ? rank : 0; i < b_boxes; i += CLUSTER) {
          const uint32_t dst = smem_u32(stage + kATileBytes + i * kBoxBytes);
          const int cb0 = kBMn ? c.n0 + 64 * i : k0;          // MN: {n, k, e}
          const int cb1 = kBMn ? k0 : c.n0 + kBKBoxRows * i;  // K:  {k, n, e}
          if (CLUSTER > 1)
            tma_load_3d_multicast(dst, mb, full, cb0, cb1, c.e, uint16_t((1u << CLUSTER) - 1));
          else
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
      const TileCoord c = decode_tile<CLUSTER>(t, shm.tile_start, p, rank);
      return make_int2(c.row0, c.rows);
    };
    uint64_t* my_a_full = shm.a_full_bar + wg * kStages;
    // B1 only (halves == 1): k runs over dy's d columns.
    HalfTileGather<T> gather(static_cast<const T*>(p.a_src), p.lda, p.k_half, k_tiles,
                             p.token_index, total_tiles, wg, first_tile, tile_step);
    if constexpr (kGather) {
      gather.start(row_range);
      for (int s = 0; s < kGatherLead; ++s)
        gather.issue(smem_u32(shm.stage(s)), smem_u32(my_a_full + s), row_range);
    }
    const uint32_t stage0 = smem_u32(shm.stage(0));
    const StageDesc desc_a0(smem_desc_kmajor_sw128(stage0 + wg * (kATileBytes / 2)));
    const StageDesc desc_b0(kBMn ? smem_desc_mnmajor_sw128(stage0 + kATileBytes)
                                 : smem_desc_kmajor_sw128(stage0 + kATileBytes));
    uint32_t it = 0;
    uint32_t n = 0;  // epilogue-warp forms: this CTA's tiles so far, the hand-off's phase
    const int tile_row = wg * 64 + warp_in_wg * 16;  // this warp's first row of a tile
    for (int t = first_tile; t < total_tiles; t += tile_step, ++n) {
      // The tile's bookkeeping runs inside the main loop, once one or two k-steps are queued on the
      // tensor cores (bookkeeping_kt): its loads' latency then costs nothing, while at the top of
      // the tile the tensor cores waited for it. The main loop itself needs none of it. F2's
      // weights take two dependent loads (row_pair, then g): the first is issued with the decode,
      // the second two k-steps later (weights_kt), so no warp waits on a load's latency.
      TileCoord c = {};
      float w[2] = {1.f, 1.f};      // F2's row weights
      int64_t out_row[2] = {0, 0};  // the rows' output rows (the consumers' store form)
      int32_t pair[2] = {0, 0};     // the rows' (token, j) pairs, loaded at bookkeeping_kt
      const auto tile_bookkeeping = [&] {
        c = decode_tile<CLUSTER>(t, shm.tile_start, p, rank);
        // B1's forms whose consumers run epilogue groups: those groups' a, b into L2.
        if constexpr (KIND == kB1 && kConsumerGroups > 0)
          b1_prefetch_epilogue_rows<T, kConsumerGroups>(p, c, tile_row, lane);
        if constexpr (KIND != kB1) {
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            const int row = tile_row + g + 8 * rr;
            if (row < c.rows && p.row_pair != nullptr)
              pair[rr] = __ldg(p.row_pair + int64_t(c.row0) + row);
          }
        }
      };
      const auto row_weights = [&] {
        if constexpr (KIND != kB1) {
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            const int row = tile_row + g + 8 * rr;
            if (row < c.rows) {
              const int64_t r = int64_t(c.row0) + row;
              const int64_t pr = p.row_pair != nullptr ? int64_t(pair[rr]) : r;
              if (p.out_w != nullptr) w[rr] = __ldg(p.out_w + pr);
              out_row[rr] = p.out_by_pair ? pr : r;
            }
          }
        }
      };
      const int bookkeeping_kt = k_tiles > 1 ? 1 : 0;
      const int weights_kt = min(bookkeeping_kt + 2, k_tiles - 1);
      int prev_s = 0;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(smem_u32(shm.full_bar + s), (it / kStages) & 1);
        if constexpr (kGather) {
          mbar_wait(smem_u32(my_a_full + s), (it / kStages) & 1);
          // cp.async (generic proxy) wrote A; wgmma reads through the async proxy.
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        }
        const uint32_t stage_offset = uint32_t(s) * kStageBytes;
        wgmma_kstep<T, 0, kBMn ? 1 : 0>(acc, desc_a0.at(stage_offset), desc_b0.at(stage_offset),
                                        kt > 0);
        if constexpr (kGather && kGatherBeforeWait) {
          // While wgmma(it - 1) and wgmma(it) run: our A of k-step it + kGatherLead into the slot
          // of k-step it - 2, whose wgmma completed before the previous k-step's wait<1>.
          const int refill = int((it + kGatherLead) % kStages);
          gather.issue(smem_u32(shm.stage(refill)), smem_u32(my_a_full + refill), row_range);
        }
        if (kt == bookkeeping_kt) tile_bookkeeping();
        if (kt == weights_kt) row_weights();
        wgmma_wait<1>();
        fence_accumulators(acc);
        if (kt > 0) release_stage<CLUSTER>(smem_u32(shm.empty_bar + prev_s), lane);
        if constexpr (kGather && !kGatherBeforeWait) {  // the slot of k-step it - 1, released now
          const int refill = int((it + kGatherLead) % kStages);
          gather.issue(smem_u32(shm.stage(refill)), smem_u32(my_a_full + refill), row_range);
        }
        prev_s = s;
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      release_stage<CLUSTER>(smem_u32(shm.empty_bar + prev_s), lane);

      uint32_t* stg = reinterpret_cast<uint32_t*>(staging + (warp - 4) * kB1StageWarpBytes);
      if constexpr (kEpiWarps) {
        // ---- hand-off: wait until the epilogue warps have released the previous tile's buffer
        // (for n = 0, parity 1 of a fresh barrier returns at once) and, in the two-group split,
        // every consumer warp has run its items of it; round v of the groups from
        // handoff_first_group on into it (store_handoff) and go on (the split forms: after the
        // consumers' groups' epilogue). F2 / B4 hand off their rows as stored: row_value(w, v) of
        // the row's weight.
        constexpr bool kItemsHere = KIND == kB1 && FORM == kB1Split2;  // consumers' item loop
        if constexpr (kItemsHere) consumer_warps_sync();
        mbar_wait(smem_u32(shm.handoff_empty), (n & 1) ^ 1);
        store_handoff<handoff_first_group(FORM)>(
            smem_u32(shm.epi), tile_row, lane, acc, [&](int rr, float lo, float hi) {
              return KIND == kB1 ? pack2<T>(lo, hi) : row_value_pair<T>(w[rr], lo, hi);
            });
        mbar_arrive(smem_u32(shm.handoff_full));  // every lane, after its own writes
        if constexpr (KIND == kB1 && FORM == kB1Split) {
          b1_epilogue<T, ACT, 1, true>(p, c, tile_row, lane, stg, acc);
        } else if constexpr (kItemsHere) {
          // The accumulators are dead until the next tile's first k-step overwrites them: zeroed,
          // their registers are free for the item loop.
#pragma unroll
          for (int i = 0; i < 128; ++i) acc[i] = 0.f;
          consumer_warps_sync();  // every consumer warp's rows are in the hand-off
          const uint32_t* hb = reinterpret_cast<const uint32_t*>(shm.epi);
          if (p.u != nullptr)
            b1_epilogue_items<T, ACT, 0, kConsumerGroups, kConsumerGroups, kConsumerWarps, true>(
                p, c, warp - 4, lane, hb);
          else
            b1_epilogue_items<T, ACT, 0, kConsumerGroups, kConsumerGroups, kConsumerWarps, false>(
                p, c, warp - 4, lane, hb);
        }
      } else if constexpr (KIND == kB1) {
        b1_epilogue<T, ACT, 4, false>(p, c, tile_row, lane, stg, acc);
      } else {
        // Each lane stores its column pairs of a row as one 4-byte word (n_out % 8 == 0: a pair
        // is all in or all out).
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int row = tile_row + g + 8 * rr;
          if (row < c.rows) {
            T* orow = static_cast<T*>(p.out) + out_row[rr] * p.out_ld + c.n0 + 2 * t4;
#pragma unroll
            for (int j = 0; j < 32; ++j) {
              if (c.n0 + 8 * j < p.n_out)
                *reinterpret_cast<uint32_t*>(orow + 8 * j) =
                    row_value_pair<T>(w[rr], acc[4 * j + 2 * rr], acc[4 * j + 2 * rr + 1]);
            }
          }
        }
      }
    }
  }
  // The peer may still arrive on our empty barriers (and we on its) until both are done.
  if (CLUSTER > 1) cluster_sync();
#else
  __trap();  // no sm_90a image: sm90_rows_supported never lets this run
#endif  // MB_SM90_DEVICE
}

// ---- host -----------------------------------------------------------------------------------

using KernelFn = void (*)(const CUtensorMap, const CUtensorMap, const CUtensorMap,
                          const RowsParams);

template <typename T, int FORM, int CLUSTER = 1>
KernelFn b1_kernel_for(Activation act) {
  switch (act) {
    // clang-format off
#define MOEBLAZE_ACTIVATION(Name, CODE, GATED, FN) \
    case Activation::Name: return sm90_rows_kernel<T, kB1, int(Activation::Name), FORM, CLUSTER>;
#include "common/activations.def"
    // clang-format on
  }
  return nullptr;
}

template <typename T>
KernelFn kernel_for_type(int kind, Activation act, int form, int cluster) {
  if (cluster == 2) {  // the epilogue-warp forms only
    if (form != kB1Warps) return nullptr;
    if (kind == kF2) return sm90_rows_kernel<T, kF2, 0, kB1Warps, 2>;
    if (kind == kB4) return sm90_rows_kernel<T, kB4, 0, kB1Warps, 2>;
    return b1_kernel_for<T, kB1Warps, 2>(act);
  }
  if (kind == kF2)
    return form == kB1Warps ? sm90_rows_kernel<T, kF2, 0, kB1Warps, 1>
                            : sm90_rows_kernel<T, kF2, 0, kB1Consumers, 1>;
  if (kind == kB4)
    return form == kB1Warps ? sm90_rows_kernel<T, kB4, 0, kB1Warps, 1>
                            : sm90_rows_kernel<T, kB4, 0, kB1Consumers, 1>;
  if (form == kB1Warps) return b1_kernel_for<T, kB1Warps>(act);
  if (form == kB1Split) return b1_kernel_for<T, kB1Split>(act);
  if (form == kB1Split2) return b1_kernel_for<T, kB1Split2>(act);
  return b1_kernel_for<T, kB1Consumers>(act);
}

// form: B1's epilogue form (B1Form); F2 / B4: kB1Consumers or kB1Warps (their store form).
// cluster: 1, or 2 for the kB1Warps forms (nullptr otherwise).
KernelFn kernel_for(Dtype dtype, int kind, Activation act, int form, int cluster = 1) {
  if (dtype == Dtype::BF16) return kernel_for_type<__nv_bfloat16>(kind, act, form, cluster);
  if (dtype == Dtype::F16) return kernel_for_type<__half>(kind, act, form, cluster);
  return nullptr;
}

// 2-CTA clusters of the rows kernels' epilogue-warp forms that can be resident at once (0: none).
int max_clusters() {
  const Activation act = Activation::SwiGLU;
  return max_resident_2cta_clusters({kernel_for(Dtype::BF16, kF2, act, kB1Warps, 2),
                                     kernel_for(Dtype::BF16, kB4, act, kB1Warps, 2),
                                     kernel_for(Dtype::BF16, kB1, act, kB1Warps, 2)},
                                    kThreads, kMaxSmemBytes);
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

// F2's and B4's store form: the epilogue warps' (kB1Warps, 3 stages), whose row stores overlap the
// next tile's main loop (5 % off the whole step on the fine-grained shapes), unless forced to the
// consumers' (Sm90Forms::rows_form = 0: kB1Consumers, 4 stages). Both give the same bits.
int rows_store_form(int forced) {
  return forced == 0 ? kB1Consumers : kB1Warps;
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
  const int form = kind == kB1 ? b1_form_for(p.halves * p.kt_half, forms.b1_form)
                               : rows_store_form(forms.rows_form);
  const int cluster = form == kB1Warps && forms.rows_cluster == 2 && info.rows_clusters > 0 ? 2 : 1;
  // Persistent: one CTA per SM (the shared memory allows no more), fewer when there are fewer
  // tiles than SMs (an upper bound: sum_e ceil(count_e / 128) <= N / 128 + E); clusters: as many
  // as can be resident at once.
  const int64_t max_tiles = (p.N / (kBM * cluster) + desc.E) * p.n_tiles;
  const int64_t slots = cluster > 1 ? info.rows_clusters : info.sms;
  const int units = int(max_tiles < slots ? max_tiles : slots);
  const KernelFn kernel = kernel_for(desc.dtype, kind, desc.activation, form, cluster);
  MB_REQUIRE(kernel != nullptr, MOEBLAZE_ERR_CUDA, "sm90 %s: unsupported dtype", what);
  const PersistentLaunch launch(units, cluster, kThreads, smem_bytes(p.E, form), stream);
  check(cudaLaunchKernelEx(&launch.config, kernel, a, b0, b1, p), what);
}

}  // namespace

size_t sm90_rows_max_smem_bytes() {
  return kMaxSmemBytes;  // the ping-pong kernels', optional, are checked by their own preparation
}

bool sm90_rows_prepare_kernels(int* max_2cta_clusters) {
  *max_2cta_clusters = 0;
  bool clusters_ok = true;
  for (Dtype dtype : {Dtype::BF16, Dtype::F16}) {
    for (int kind : {kF2, kB4, kB1}) {
      for (Activation act : kActivations) {
        if (kind != kB1 && act != Activation::SwiGLU) continue;  // one kernel, any activation
        for (int form : {kB1Consumers, kB1Warps, kB1Split, kB1Split2}) {
          if (kind != kB1 && form != kB1Consumers && form != kB1Warps) continue;
          if (!prepare_kernel(kernel_for(dtype, kind, act, form), kMaxSmemBytes)) return false;
        }
        // The opt-in cluster forms: where they cannot be prepared, the kernels run one CTA.
        clusters_ok =
            clusters_ok && prepare_kernel(kernel_for(dtype, kind, act, kB1Warps, 2), kMaxSmemBytes);
      }
    }
  }
  if (clusters_ok) *max_2cta_clusters = max_clusters();
  (void)cudaGetLastError();
  return true;
}

int sm90_parse_rows_cluster(const char* value) {
  if (value == nullptr) return 0;
  if (std::strcmp(value, "1") == 0) return 1;
  if (std::strcmp(value, "2") == 0) return 2;
  return 0;
}

int sm90_parse_rows_form(const char* value) {
  if (value == nullptr) return -1;
  if (std::strcmp(value, "consumers") == 0) return 0;
  if (std::strcmp(value, "warps") == 0) return 1;
  if (std::strcmp(value, "pingpong") == 0) return kSm90RowsFormPingpong192;
  if (std::strcmp(value, "pingpong128") == 0) return kSm90RowsFormPingpong128;
  if (std::strcmp(value, "pingpong2cta") == 0) return kSm90RowsFormPingpong2Cta;
  return -1;
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

// The ping-pong kernel's tile width and cluster size when `forms` selects it and the device has it
// prepared, with the device's facts for the launch, else tile_n 0 (the other forms).
struct PingpongChoice {
  int tile_n = 0, cluster = 1;
  const Sm90Device* device = nullptr;
};
PingpongChoice pingpong_choice(const Sm90Forms& forms) {
  PingpongChoice c;
  if (forms.rows_form == kSm90RowsFormPingpong192) c.tile_n = 192;
  if (forms.rows_form == kSm90RowsFormPingpong128) c.tile_n = 128;
  if (forms.rows_form == kSm90RowsFormPingpong2Cta) c.tile_n = 192, c.cluster = 2;
  if (c.tile_n == 0) return c;
  // The device lookup (a lock and cudaGetDevice) only for the ping-pong forms, once a launch.
  c.device = &sm90_current_device();
  if (!c.device->rows_pingpong || (c.cluster > 1 && c.device->rows_pingpong_clusters == 0))
    c.tile_n = 0;
  return c;
}

int sm90_f2_rows_form(const LayerDesc& desc, const Sm90Forms& forms) {
  if (forms.rows_form >= 0) return forms.rows_form;
  return desc.h <= kSm90F2PingpongMaxH ? kSm90RowsFormPingpong2Cta : -1;
}

void sm90_f2_launch(const LayerDesc& desc, const F2Op& op, const Sm90Forms& forms,
                    cudaStream_t stream) {
  const PingpongChoice ping = pingpong_choice(forms);
  if (ping.tile_n != 0) {
    sm90_f2_pingpong_launch(desc, op, *ping.device, ping.tile_n, ping.cluster, forms, stream);
    return;
  }
  if (op.rows.T * desc.k == 0) return;
  const RowsOperands o = f2_operands(desc, op, kBKBoxRows);
  launch(desc, kF2, o.a, o.b0, o.b1, o.p, forms, stream, "sm90_rows_kernel (F2)");
}

void sm90_b4_launch(const LayerDesc& desc, const B4Op& op, const Sm90Forms& forms,
                    cudaStream_t stream) {
  const PingpongChoice ping = pingpong_choice(forms);
  if (ping.tile_n != 0) {
    sm90_b4_pingpong_launch(desc, op, *ping.device, ping.tile_n, ping.cluster, forms, stream);
    return;
  }
  if (op.rows.T * desc.k == 0) return;
  const RowsOperands o = b4_operands(desc, op);
  launch(desc, kB4, o.a, o.b0, o.b1, o.p, forms, stream, "sm90_rows_kernel (B4)");
}

void sm90_b1_launch(const LayerDesc& desc, const B1Op& op, const Sm90Forms& forms,
                    cudaStream_t stream) {
  const int64_t T = op.rows.T, N = T * desc.k;
  if (N == 0) return;
  const int64_t cols = op.cols != 0 ? op.cols : desc.h;
  const size_t es = desc.elem_size();
  // The range's columns of the activation buffers; its first tile's dg partials.
  const auto column = [&](const void* base) -> void* {
    return base == nullptr ? nullptr
                           : const_cast<unsigned char*>(static_cast<const unsigned char*>(base)) +
                                 es * size_t(op.col0);
  };
  RowsParams p = base_params(desc, op.rows.expert_offsets, int(cols), desc.d, 1, T);
  p.a_src = op.dy;
  p.token_index = op.rows.expert_token_indices;
  p.lda = int(desc.d);
  p.gated = desc.gated();
  p.ab_ld = op.ab_ld != 0 ? op.ab_ld : desc.h;
  p.dadb_ld = op.dadb_ld != 0 ? op.dadb_ld : (p.gated ? 2 * desc.h : desc.h);
  p.db_offset = desc.h;
  p.u_ld = op.u_ld != 0 ? op.u_ld : desc.h;
  p.a = column(op.a_src);
  p.b = p.gated ? column(op.b_src) : nullptr;
  p.u = column(op.u_src);
  p.g = op.g;
  p.row_pair = op.rows.row_pair;
  p.dadb = column(op.dadb);
  p.gu = op.gu;
  p.dg_part = op.dg_part + size_t(op.col0 / kSm90B1TileCols * kSm90B1DgPartsPerTile) * size_t(N);
  // w_down [E, d, h]: k runs over d (rows), n over the range's columns of h: MN-major. A is
  // gathered (no map; the kernel never reads tmap_a, the B map stands in for it).
  const CUtensorMap b =
      weight_map_range(desc.dtype, op.w_down, desc.E, desc.d, desc.h, op.col0, cols, true, "B1");
  launch(desc, kB1, b, b, b, p, forms, stream, "sm90_rows_kernel (B1)");
}

}  // namespace cuda
}  // namespace moeblaze
