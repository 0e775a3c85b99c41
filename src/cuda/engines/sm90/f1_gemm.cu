// F1 on Hopper (see f1_gemm.hpp), for BF16 / F16 and every activation.
//
// Tile: 128 routed rows x 256 columns of the dual B operand x 64 k, 4 stages of 48 KB.
//   gated:     B = 128 rows of w_gate[e] (n0..n0+127) next to the same 128 rows of w_up[e]:
//              one m64n256k16 wgmma computes a and b of the same (row, column) side by side;
//   non-gated: B = 256 rows of w_gate[e] (two TMA boxes, n0 and n0+128): a tile is 256 columns
//              of a, and b does not exist.
// 384 threads: warpgroup 0 produces (one thread issues the two TMA boxes), warpgroups 1 and 2
// consume (64 rows each, 128 fp32 accumulators per thread) and each gathers its own 64 A rows with
// 16-byte cp.async into the same 128-byte swizzle, 2 k-steps ahead (primitives.cuh's
// HalfTileGather: gathering in the consumers, not the producer warpgroup, keeps the producer's
// four warps free and measured 2-10 % faster). Persistent grid of one CTA per SM; every CTA turns
// expert_offsets into a prefix of tile counts in shared memory; tile ids map to (expert, m-tile,
// n-tile) by binary search, rasterised in bands of 8 m-tiles so concurrent CTAs share A rows and
// B tiles in L2. Three forms of one kernel, chosen per call by the k-steps of a tile (d / 64):
//   long K (> 64 k-steps: no benchmark shape): 4 stages; the consumers run the epilogue
//     after each tile's main loop: each consumer warp stages 16 rows x 64 columns of one output
//     at a time in an XOR-swizzled 2 KB buffer and writes it with coalesced 16-byte stores;
//   short K (<= 64 k-steps: every configuration with d <= 4096): EPILOGUE WARPS. 3 stages plus a
//     64 KB hand-off buffer; after a tile's last wgmma the consumers round a and b (or the 256
//     columns of a) into the hand-off and go straight on to the next tile's main loop, while
//     warps 1-3 of warpgroup 0 store a and b from it and form and store u (coalesced 16-byte
//     stores, the same rounding and activation arithmetic: bitwise the same outputs).
//   The epilogue warps win on every measured shape up to 64 k-steps (on the H200: conf3 -16 %,
//   conf4 -16 %, mixtral -8 % for F1), where the overlapped epilogue outweighs the third stage
//   the hand-off buffer takes; longer K keeps the 4-stage form, unmeasured.
//   SPLIT (non-gated, <= 8 k-steps: d <= 512): the epilogue-warp form whose consumers also store
//   the first quarter of the hand-off's rows before the next tile's main loop. A non-gated tile's
//   epilogue (a and u of 256 columns, 32k activations) outlasts 8 k-steps on three warps: the
//   consumers waited for the hand-off buffer 38 % of their time (Nsight Compute, conf5 SiLU).
//   On the H200 the split takes F1 0.70 -> 0.63 ms at conf5 SiLU; it is slower for gated tiles
//   (a lighter epilogue: 1.03 -> 1.08 ms at conf5 SwiGLU) and at 16 k-steps.
//
// The device code needs sm_90a (wgmma, setmaxnreg, TMA); the library is also compiled for other
// architectures, whose image of the kernel only traps. sm90_f1_supported refuses to launch unless
// the image the runtime picked for the current device is sm_90 or newer.
#include "cuda/engines/sm90/f1_gemm.hpp"

#include <algorithm>
#include <cstring>

#include "common/activation_math.hpp"
#include "common/status.hpp"
#include "cuda/cuda_util.cuh"
#include "cuda/engines/sm90/common.cuh"
#include "cuda/engines/sm90/device.hpp"

namespace moeblaze {
namespace cuda {
namespace {

using namespace sm90;

constexpr int kBM = 128;        // routed rows per tile
constexpr int kBBoxRows = 128;  // rows of one TMA weight box
constexpr int kThreads = 384;   // warpgroup 0: producer (+ epilogue warps); 1, 2: consumers
constexpr int kConsumerWarps = 8;
static_assert(kConsumerWarps * 32 == 256, "consumer_warps_sync's thread count");
constexpr int kEpiWarps = 3;  // the epilogue warps: 1, 2 and 3 (warp 0 holds the TMA thread)

// F1's epilogue forms (FORM; Sm90Forms::f1_form forces one, f1_gemm.hpp): the consumers store
// the tile; the epilogue warps store it from the hand-off; or (split) the consumers store the
// hand-off's first quarter of the rows and the epilogue warps the rest. Every form keeps every bit.
enum F1Form : int { kF1Consumers = 0, kF1Warps = 1, kF1Split = 2 };
// The policy per call by the k-steps of a tile (d / 64; see the top): the split form for
// non-gated activations up to kF1SplitMaxKTiles, the epilogue warps up to kEpiWarpsMaxKTiles, the
// consumers past it.
constexpr int kF1SplitMaxKTiles = 8;
constexpr int kEpiWarpsMaxKTiles = 64;
constexpr int kQuads = 32;  // row quads of a tile: the hand-off's unit of work
// Row quads [0, consumer_quads) of every tile are the consumers' (one per consumer warp).
constexpr int consumer_quads(int form) {
  return form == kF1Split ? kQuads / 4 : 0;
}

constexpr int kATileBytes = kBM * kBK * 2;       // 16 KB
constexpr int kBBoxBytes = kBBoxRows * kBK * 2;  // 16 KB, two per stage
constexpr int kStageBytes = kATileBytes + 2 * kBBoxBytes;
constexpr int kEpiWarpBytes = 16 * 64 * 2;  // 16 rows x 64 cols of 16-bit
constexpr int kEpiBytes = kConsumerWarps * kEpiWarpBytes;
// EPI_WARPS' hand-off: 4 sub-tiles of 128 rows x 64 columns (16-byte chunk c of row r at
// r * 128 + ((c ^ (r & 7)) << 4)): the tile's 256 accumulator columns in order (gated: a 0-63,
// a 64-127, b 0-63, b 64-127; non-gated: a 0-63 ... a 192-255).
constexpr int kHandoffSubBytes = kBM * 64 * 2;  // 16 KB
static_assert(kHandoffSubBytes == kHandoffGroupBytes, "store_handoff's group stride");
constexpr int kHandoffSubWords = kHandoffSubBytes / 4;
constexpr int kHandoffBytes = 4 * kHandoffSubBytes;  // 64 KB

// full, empty, a_full of each consumer warpgroup; EPI_WARPS: + handoff_full, handoff_empty.
constexpr size_t smem_bytes(int E, bool epi_warps) {
  return two_form_smem_bytes(E, epi_warps, kStageBytes, kEpiBytes, kHandoffBytes);
}
constexpr size_t kMaxSmemBytes = two_form_max_smem_bytes(kStageBytes, kEpiBytes, kHandoffBytes);
static_assert(kMaxSmemBytes <= kSmemPerBlock,
              "227 KB of shared memory per block on the H100 / H200");

// setmaxnreg counts (register_split_fits).
constexpr int kRegsWg0 = 40, kRegsConsumer = 232;
constexpr int kRegsWg0Epi = 72, kRegsConsumerEpi = 216;  // EPI_WARPS: the epilogue warps' math
static_assert(register_split_fits(kRegsWg0, kRegsConsumer), "register split");
static_assert(register_split_fits(kRegsWg0Epi, kRegsConsumerEpi),
              "register split (epilogue warps)");

// Columns of h one tile covers.
constexpr int tile_cols(bool gated) {
  return gated ? kBBoxRows : 2 * kBBoxRows;
}

struct F1Params {
  const void* x;               // [T, d]
  const int32_t* offsets;      // [E + 1]
  const int32_t* token_index;  // [N] token of each routed row
  void* out_a;                 // [N, ab_ld] (first h columns) or nullptr
  void* out_b;                 // [N, ab_ld] (first h columns) or nullptr
  void* out_u;                 // [N, h] or nullptr
  int64_t ab_ld;               // elements between rows of out_a / out_b (>= h, % 8 == 0)
  int d, h, E;
  int n_tiles;      // ceil(h / tile_cols)
  int k_tiles;      // ceil(d / kBK)
  int band_mtiles;  // rasterisation: the n-tiles sweep bands of this many m-tiles
};

struct TileCoord {
  int e;
  int row0;    // first routed row of the tile
  int rows;    // valid rows (1..128)
  int n_tile;  // columns [n_tile * tile_cols, +tile_cols) of h
};

#if MB_SM90_DEVICE

// Tile t of the schedule as CTA `rank` of a CLUSTER-CTA cluster runs it: a cluster's tiles are
// CLUSTER * 128 rows (each expert's m-tiles in groups of CLUSTER) and CTA rank takes the rank-th
// 128, which can be empty (rows 0) at the end of an expert.
template <int CLUSTER>
__device__ __forceinline__ TileCoord decode_tile(int t, const int* tile_start, const F1Params& p,
                                                 int rank) {
  const GroupedTile g =
      decode_grouped_tile<kBM * CLUSTER>(t, tile_start, p.offsets, p.E, p.n_tiles, p.band_mtiles);
  const int rows = min(kBM, g.rows - kBM * rank);
  return {g.e, g.row0 + kBM * rank, rows > 0 ? rows : 0, g.n_tile};
}

#endif  // MB_SM90_DEVICE

#if MB_SM90_DEVICE

// Eight outputs of u from a 16-byte chunk of a and one of b (the same columns): the values as the
// consumers' epilogue forms them (a, b rounded once; u = act(a, b) in fp32, rounded once).
template <typename T, Activation kAct>
__device__ __forceinline__ uint4 act_chunk(const uint4& a, const uint4& b) {
  const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
  uint32_t uw[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 af = unpack2<T>(aw[i]), bf = unpack2<T>(bw[i]);
    uw[i] = pack2<T>(act_forward<T>(kAct, af.x, bf.x), act_forward<T>(kAct, af.y, bf.y));
  }
  return make_uint4(uw[0], uw[1], uw[2], uw[3]);
}

// Stores the row quads q = first, first + STEP, ... < end of every 64-column group of a tile from
// the hand-off: each lane takes 16-byte chunk (lane & 7) of row 4 q + (lane >> 3), so a warp
// instruction reads 4 whole 128-byte rows of the buffer (conflict-free) and stores 4 rows x 128
// contiguous bytes of each output; u from the rounded a and b, as the consumers' form computes it.
// Stores are predicated, with no branch around a chunk: a branch kept ptxas from overlapping the
// work on either side of it. With PAIRS (the epilogue warps, several quads each; the split form's
// consumers store one quad each) SiLU and SwiGLU take two quads an iteration, both read before
// either is stored, so their 16 sigmoid chains run side by side (in sass_loops' issue model, bf16
// cycles an element: SiLU 24-26 -> 16, SwiGLU 26-28 -> 20, with the tanh sigmoid); the other
// activations' longer chains take one quad (two spilled in GeGLU; GeGLU 1.3x faster, GELU 6 %
// slower in the model). The hand-off holds all kQuads quads, so a quad past `end` is read
// (clamped), not stored.
template <typename T, Activation kAct, int STEP, bool PAIRS>
__device__ __forceinline__ void store_handoff_quads(const F1Params& p, const TileCoord& c,
                                                    const uint32_t* hb, int lane, int first,
                                                    int end) {
  constexpr bool kGated = is_gated(kAct);
  constexpr int kTileCols = tile_cols(kGated);
  constexpr int kGroups = kTileCols / 64;  // 64-column groups per tile
  const int n0 = c.n_tile * kTileCols;
  T* out_a = static_cast<T*>(p.out_a);
  T* out_b = static_cast<T*>(p.out_b);
  T* out_u = static_cast<T*>(p.out_u);
  constexpr int kPair = PAIRS && (kAct == Activation::SiLU || kAct == Activation::SwiGLU) ? 2 : 1;
  const int ch = lane & 7;
#pragma unroll 1
  for (int group = 0; group < kGroups; ++group) {
    const int col = n0 + group * 64 + ch * 8;
    const bool col_in = col < p.h;  // h % 8 == 0: a chunk is all in or all out
#pragma unroll 1
    for (int quad = first; quad < end; quad += kPair * STEP) {
      uint4 av[kPair], bv[kPair];
      bool in[kPair];
      int64_t grow[kPair];
#pragma unroll
      for (int j = 0; j < kPair; ++j) {
        const int q = quad + j * STEP;
        const int row = min(q, kQuads - 1) * 4 + (lane >> 3);
        in[j] = q < end && row < c.rows && col_in;
        grow[j] = int64_t(c.row0) + row;
        const int word = row * 32 + ((ch ^ (row & 7)) << 2);
        av[j] = *reinterpret_cast<const uint4*>(hb + group * kHandoffSubWords + word);
        bv[j] = make_uint4(0u, 0u, 0u, 0u);
        if constexpr (kGated)
          bv[j] = *reinterpret_cast<const uint4*>(hb + (2 + group) * kHandoffSubWords + word);
      }
#pragma unroll
      for (int j = 0; j < kPair; ++j) {
        if (out_a != nullptr) store16_if(in[j], out_a + grow[j] * p.ab_ld + col, av[j]);
        if (kGated && out_b != nullptr) store16_if(in[j], out_b + grow[j] * p.ab_ld + col, bv[j]);
      }
      if (out_u != nullptr) {
        uint4 uv[kPair];
#pragma unroll
        for (int j = 0; j < kPair; ++j) uv[j] = act_chunk<T, kAct>(av[j], bv[j]);
#pragma unroll
        for (int j = 0; j < kPair; ++j) store16_if(in[j], out_u + grow[j] * p.h + col, uv[j]);
      }
    }
  }
}

#endif  // MB_SM90_DEVICE

// ACT: the activation (Activation cast to int); gated ones read w_gate and w_up, non-gated ones
// read 256 rows of w_gate (tmap_second is then the w_gate map, second box at n0 + 128).
// FORM: the epilogue form (F1Form; the hand-off forms have 3 stages, see the top of the file).
// CLUSTER: 1, or 2 (the epilogue-warp form) for clusters of two CTAs on adjacent m-tiles of one
// expert that share B: each CTA's producer loads one of the stage's two B boxes into both CTAs (TMA
// multicast), so B crosses L2 once for the pair; a stage is refilled once both CTAs' consumers have
// released it.
template <typename T, int ACT, int FORM, int CLUSTER>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_f1_kernel(const __grid_constant__ CUtensorMap tmap_gate,
                   const __grid_constant__ CUtensorMap tmap_second, const F1Params p) {
#if MB_SM90_DEVICE
  constexpr Activation kAct = static_cast<Activation>(ACT);
  constexpr bool kGated = is_gated(kAct);
  constexpr int kTileCols = tile_cols(kGated);
  constexpr int kSecondRowOffset = kGated ? 0 : kBBoxRows;
  constexpr int kGroups = kTileCols / 64;           // 64-column epilogue groups per tile
  constexpr bool EPI_WARPS = FORM != kF1Consumers;  // epilogue warps and a hand-off
  constexpr int kConsumerQuads = consumer_quads(FORM);
  static_assert(CLUSTER == 1 || FORM == kF1Warps, "clusters: the epilogue-warp form");
  constexpr int kStages = stages_for(EPI_WARPS);

  extern __shared__ uint8_t smem_raw[];
  // The epilogue's buffer: the consumers' staging, or EPI_WARPS' hand-off.
  const GatherPipelineSmem<kStages, kStageBytes> shm(smem_raw,
                                                     EPI_WARPS ? kHandoffBytes : kEpiBytes);

  const int tid = threadIdx.x;
  // Broadcast from lane 0: the compiler then knows the warp index is warp-uniform (uniform
  // registers for the barrier and descriptor addresses derived from it).
  const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0), lane = tid & 31;

  // ---- prologue: barriers and the tile prefix (from the device-side offsets; no host sync)
  if (tid == 0) shm.init_barriers(kConsumerWarps, kEpiWarps, CLUSTER);
  const int total_tiles = build_tile_prefix<kBM * CLUSTER, kThreads>(shm.tile_start, p.offsets, p.E,
                                                                     p.n_tiles, tid, warp, lane);
  const PersistentPlace place = persistent_place<CLUSTER>();
  const int rank = place.rank, first_tile = place.first_tile, tile_step = place.tile_step;

  if (warp < 4) {
    // ================= producer warpgroup =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(EPI_WARPS ? kRegsWg0Epi : kRegsWg0)
                 : "memory");
    if constexpr (EPI_WARPS) {
      if (warp >= 4 - kEpiWarps) {
        // ================= epilogue warps 1, 2, 3 =================
        // Per tile (the same sequence of tile ids as every role): wait for the consumers'
        // hand-off, store its row quads from kConsumerQuads on (store_handoff_quads), then every
        // lane releases the buffer (its reads are done).
        const int ew = warp - (4 - kEpiWarps);
        const uint32_t* hb = reinterpret_cast<const uint32_t*>(shm.epi);
        uint32_t n = 0;  // this CTA's tiles so far: hand-off phase n
        for (int t = first_tile; t < total_tiles; t += tile_step, ++n) {
          const TileCoord c = decode_tile<CLUSTER>(t, shm.tile_start, p, rank);
          mbar_wait(smem_u32(shm.handoff_full), n & 1);
          store_handoff_quads<T, kAct, kEpiWarps, true>(p, c, hb, lane, kConsumerQuads + ew,
                                                        kQuads);
          mbar_arrive(smem_u32(shm.handoff_empty));  // every lane, after its own reads
        }
        // One CTA: leave here, not at the common end; ptxas then keeps the activation's MUFU
        // chains side by side (SiLU: 8, not 2). Clusters must reach the end's cluster barrier.
        if constexpr (CLUSTER == 1) return;
      }
    }
    // One thread issues the B boxes; the consumers gather A.
    if (tid == 0) {
      uint32_t it = 0;
      for (int t = first_tile; t < total_tiles; t += tile_step) {
        const TileCoord c = decode_tile<CLUSTER>(t, shm.tile_start, p, rank);
        const int n0 = c.n_tile * kTileCols;
        // Non-gated tiles at the end of h may have no row of their second box inside h: it is not
        // loaded, and the accumulator columns it feeds (past h) are never stored.
        const bool second_box = n0 + kSecondRowOffset < p.h;
        for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
          const int s = it % kStages;
          mbar_wait(smem_u32(shm.empty_bar + s), ((it / kStages) & 1) ^ 1);
          uint8_t* stage = shm.stage(s);
          const uint32_t full = smem_u32(shm.full_bar + s);
          mbar_arrive_expect_tx(full, second_box ? 2 * kBBoxBytes : kBBoxBytes);
          if (CLUSTER > 1) {  // CTA rank loads box rank (if any) into both CTAs
            constexpr uint16_t kBoth = (1u << CLUSTER) - 1;
            if (rank == 0)
              tma_load_3d_multicast(smem_u32(stage + kATileBytes), &tmap_gate, full, kt * kBK, n0,
                                    c.e, kBoth);
            else if (second_box)
              tma_load_3d_multicast(smem_u32(stage + kATileBytes + kBBoxBytes), &tmap_second, full,
                                    kt * kBK, n0 + kSecondRowOffset, c.e, kBoth);
            continue;
          }
          tma_load_3d(smem_u32(stage + kATileBytes), &tmap_gate, full, kt * kBK, n0, c.e);
          if (second_box)
            tma_load_3d(smem_u32(stage + kATileBytes + kBBoxBytes), &tmap_second, full, kt * kBK,
                        n0 + kSecondRowOffset, c.e);
        }
      }
    }
  } else {
    // ================= consumer warpgroups =================
    asm volatile(
        "setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(EPI_WARPS ? kRegsConsumerEpi : kRegsConsumer)
        : "memory");
    const int wg = (warp >> 2) - 1;   // 0 or 1: rows [64 wg, 64 wg + 64) of the tile
    const int warp_in_wg = warp & 3;  // rows [16 warp_in_wg, +16) of the warpgroup's 64
    const int cw = warp - 4;
    uint32_t* stg = reinterpret_cast<uint32_t*>(shm.epi + cw * kEpiWarpBytes);
    const int g = lane >> 2, t4 = lane & 3;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    const auto row_range = [&](int t) {
      const TileCoord c = decode_tile<CLUSTER>(t, shm.tile_start, p, rank);
      return make_int2(c.row0, c.rows);
    };
    uint64_t* my_a_full = shm.a_full_bar + wg * kStages;
    HalfTileGather<T> gather(static_cast<const T*>(p.x), p.d, p.d, p.k_tiles, p.token_index,
                             total_tiles, wg, first_tile, tile_step);
    // The long-K form (4 stages) issues the gather of k-step it + 2 between k-step it's commit
    // and its wait<1>, into the slot of k-step it - 2, so the gather runs while the tensor pipe
    // works; the 3-stage short-K form keeps a lead of 2 by issuing after the wait, into the slot
    // wgmma(it - 1) released (a lead of 1 would leave the rows one k-step to land).
    constexpr bool kGatherBeforeWait = kStages >= 4;
    constexpr int kGatherLead = kGatherBeforeWait ? kStages - 2 : kStages - 1;
    gather.start(row_range);
    for (int s = 0; s < kGatherLead; ++s)
      gather.issue(smem_u32(shm.stage(s)), smem_u32(my_a_full + s), row_range);
    const uint32_t stage0 = smem_u32(shm.stage(0));
    const StageDesc desc_a0(smem_desc_kmajor_sw128(stage0 + wg * (kATileBytes / 2)));
    const StageDesc desc_b0(smem_desc_kmajor_sw128(stage0 + kATileBytes));
    uint32_t it = 0;
    uint32_t n = 0;  // EPI_WARPS: this CTA's tiles so far, the hand-off's phase
    for (int t = first_tile; t < total_tiles; t += tile_step, ++n) {
      int prev_s = 0;
      for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(smem_u32(shm.full_bar + s), (it / kStages) & 1);
        mbar_wait(smem_u32(my_a_full + s), (it / kStages) & 1);
        // The A rows were written by cp.async (generic proxy); wgmma reads through the async proxy.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        const uint32_t stage_offset = uint32_t(s) * kStageBytes;
        wgmma_kstep<T, 0, 0>(acc, desc_a0.at(stage_offset), desc_b0.at(stage_offset), kt > 0);
        // This warpgroup's A of k-step it + kGatherLead (which may belong to the next tile: its
        // loads fly during this tile's epilogue).
        const int refill = int((it + kGatherLead) % kStages);
        if constexpr (kGatherBeforeWait)  // the slot of k-step it - 2: its wgmma has completed
          gather.issue(smem_u32(shm.stage(refill)), smem_u32(my_a_full + refill), row_range);
        wgmma_wait<1>();
        fence_accumulators(acc);
        if (kt > 0) release_stage<CLUSTER>(smem_u32(shm.empty_bar + prev_s), lane);
        if constexpr (!kGatherBeforeWait)  // the slot of k-step it - 1, released just now
          gather.issue(smem_u32(shm.stage(refill)), smem_u32(my_a_full + refill), row_range);
        prev_s = s;
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      release_stage<CLUSTER>(smem_u32(shm.empty_bar + prev_s), lane);

      if constexpr (EPI_WARPS) {
        // ---- hand-off: wait until the epilogue warps have released the previous tile's buffer
        // (for n = 0, parity 1 of a fresh barrier returns at once) and, in the split form, every
        // consumer warp has stored its quad of it; round the accumulators into it
        // (store_handoff; pack2 rounds as the epilogue below does), then (split form) store the
        // first kConsumerQuads row quads from it, and go on to the next tile.
        constexpr bool kSplit = kConsumerQuads > 0;
        if constexpr (kSplit) consumer_warps_sync();
        mbar_wait(smem_u32(shm.handoff_empty), (n & 1) ^ 1);
        store_handoff<0>(smem_u32(shm.epi), wg * 64 + warp_in_wg * 16, lane, acc,
                         [](int, float lo, float hi) { return pack2<T>(lo, hi); });
        mbar_arrive(smem_u32(shm.handoff_full));  // every lane, after its own writes
        if constexpr (kSplit) {
          // The accumulators are dead until the next tile's first k-step overwrites them: zeroed,
          // their registers are free for the stores.
#pragma unroll
          for (int i = 0; i < 128; ++i) acc[i] = 0.f;
          consumer_warps_sync();  // every consumer warp's rows are in the hand-off
          const TileCoord c = decode_tile<CLUSTER>(t, shm.tile_start, p, rank);
          store_handoff_quads<T, kAct, kConsumerWarps, false>(
              p, c, reinterpret_cast<const uint32_t*>(shm.epi), lane, cw, kConsumerQuads);
        }
        continue;
      }
      const TileCoord c = decode_tile<CLUSTER>(t, shm.tile_start, p, rank);
      const int n0 = c.n_tile * kTileCols;

      // ---- epilogue. Accumulator layout (wgmma m64n256, f32): register 4j + q of lane (g, t4)
      // holds row g (q < 2) or g + 8 (q >= 2), column 8j + 2 t4 + (q & 1) of the 256 B rows.
      // Gated: j < 16 is a (column n0 + 8j + ...), j >= 16 is b of the same column (j - 16).
      // Non-gated: every j is a, at column n0 + 8j + ... (the second box follows the first).
      const int tile_row = wg * 64 + warp_in_wg * 16;  // first tile row of this warp
#pragma unroll
      for (int group = 0; group < kGroups; ++group) {
#pragma unroll 1  // one output per pass; unrolling it only raises register pressure
        for (int out = 0; out < 3; ++out) {
          void* dst_base = out == 0 ? p.out_a : (out == 1 ? p.out_b : p.out_u);
          if (dst_base == nullptr) continue;  // uniform: not stored under this policy
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const int j = group * 8 + jj;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
              const float ra0 = round_to<T>(acc[4 * j + 2 * rr]);
              const float ra1 = round_to<T>(acc[4 * j + 2 * rr + 1]);
              float rb0 = 0.f, rb1 = 0.f;
              if constexpr (kGated) {
                rb0 = round_to<T>(acc[64 + 4 * j + 2 * rr]);
                rb1 = round_to<T>(acc[64 + 4 * j + 2 * rr + 1]);
              }
              uint32_t v;
              if (out == 0)
                v = pack2<T>(ra0, ra1);
              else if (out == 1)
                v = pack2<T>(rb0, rb1);
              else
                v = pack2<T>(act_forward<T>(kAct, ra0, rb0), act_forward<T>(kAct, ra1, rb1));
              const int row = g + 8 * rr;  // row & 7 == g
              stg[row * 32 + ((jj ^ g) << 2) + t4] = v;
            }
          }
          __syncwarp();
          T* dst = static_cast<T*>(dst_base);
          const int64_t ld = out == 2 ? int64_t(p.h) : p.ab_ld;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = i * 4 + (lane >> 3);
            const int ch = lane & 7;
            const uint4 v =
                *reinterpret_cast<const uint4*>(stg + row * 32 + ((ch ^ (row & 7)) << 2));
            const int col = n0 + group * 64 + ch * 8;
            if (tile_row + row < c.rows && col < p.h) {  // h % 8 == 0: a chunk is all in or out
              *reinterpret_cast<uint4*>(dst + (c.row0 + tile_row + row) * ld + col) = v;
            }
          }
          __syncwarp();
        }
      }
    }
  }
  // The peer may still arrive on our empty barriers (and we on its) until both are done.
  if (CLUSTER > 1) cluster_sync();
#else
  __trap();  // no sm_90a image: sm90_f1_supported never lets this run
#endif  // MB_SM90_DEVICE
}

// ---- host -----------------------------------------------------------------------------------

// Weights [E, h, d] as a 3-D tensor (d fastest); box = 64 k x 128 rows x 1 expert, 128B swizzle;
// rows past h and k past d read as zeros (never the next expert's rows).
template <typename T>
CUtensorMap make_weight_map(const void* w, int64_t E, int64_t h, int64_t d) {
  return make_map_3d<T>(w, uint64_t(d), uint64_t(h), uint64_t(E), uint64_t(d), uint64_t(h * d), kBK,
                        kBBoxRows, 1, "F1");
}

using KernelFn = void (*)(const CUtensorMap, const CUtensorMap, const F1Params);

template <typename T, int FORM, int CLUSTER>
KernelFn kernel_for_act(Activation act) {
  switch (act) {
    // clang-format off
#define MOEBLAZE_ACTIVATION(Name, CODE, GATED, FN) \
    case Activation::Name: return sm90_f1_kernel<T, int(Activation::Name), FORM, CLUSTER>;
#include "common/activations.def"
    // clang-format on
  }
  return nullptr;
}

constexpr F1Form kF1Forms[] = {kF1Consumers, kF1Warps, kF1Split};

// cluster 2 exists for the epilogue-warp form only (clusters are opt-in: f1_gemm.hpp).
template <typename T>
KernelFn kernel_for_type(Activation act, int form, int cluster) {
  if (cluster == 2) return form == kF1Warps ? kernel_for_act<T, kF1Warps, 2>(act) : nullptr;
  switch (form) {
    case kF1Consumers: return kernel_for_act<T, kF1Consumers, 1>(act);
    case kF1Warps: return kernel_for_act<T, kF1Warps, 1>(act);
    case kF1Split: return kernel_for_act<T, kF1Split, 1>(act);
  }
  return nullptr;
}

KernelFn kernel_for(Dtype dtype, Activation act, int form, int cluster = 1) {
  if (dtype == Dtype::BF16) return kernel_for_type<__nv_bfloat16>(act, form, cluster);
  if (dtype == Dtype::F16) return kernel_for_type<__half>(act, form, cluster);
  return nullptr;
}

// 2-CTA clusters of the epilogue-warp kernels that can be resident at once (0: none).
int max_clusters() {
  return max_resident_2cta_clusters({kernel_for(Dtype::BF16, Activation::SwiGLU, kF1Warps, 2),
                                     kernel_for(Dtype::F16, Activation::SwiGLU, kF1Warps, 2)},
                                    kThreads, kMaxSmemBytes);
}

// The form of a call: forced (Sm90Forms::f1_form), else the policy by the k-steps of a tile.
// Gated tiles' epilogue (a, b and u of 128 columns) is lighter than non-gated ones' (a and u of
// 256) for the same main loop: the split only pays off for non-gated ones.
int f1_form_for(int64_t k_tiles, bool gated, int forced) {
  if (forced >= kF1Consumers && forced <= kF1Split) return forced;
  if (!gated && k_tiles <= kF1SplitMaxKTiles) return kF1Split;
  return k_tiles <= kEpiWarpsMaxKTiles ? kF1Warps : kF1Consumers;
}

}  // namespace

size_t sm90_f1_max_smem_bytes() {
  return kMaxSmemBytes;
}

bool sm90_f1_prepare_kernels(int* max_2cta_clusters) {
  *max_2cta_clusters = 0;
  bool clusters_ok = true;
  for (Dtype dtype : {Dtype::BF16, Dtype::F16}) {
    for (Activation act : kActivations) {
      for (F1Form form : kF1Forms)
        if (!prepare_kernel(kernel_for(dtype, act, form), kMaxSmemBytes)) return false;
      // The opt-in cluster form: where it cannot be prepared, F1 runs one CTA.
      clusters_ok =
          clusters_ok && prepare_kernel(kernel_for(dtype, act, kF1Warps, 2), kMaxSmemBytes);
    }
  }
  if (clusters_ok) *max_2cta_clusters = max_clusters();
  (void)cudaGetLastError();
  return true;
}

int sm90_parse_f1_form(const char* value) {
  if (value == nullptr) return -1;
  if (std::strcmp(value, "consumers") == 0) return kF1Consumers;
  if (std::strcmp(value, "warps") == 0) return kF1Warps;
  if (std::strcmp(value, "split") == 0) return kF1Split;
  return -1;
}

int sm90_parse_f1_cluster(const char* value) {
  if (value == nullptr) return 0;
  if (std::strcmp(value, "1") == 0) return 1;
  if (std::strcmp(value, "2") == 0) return 2;
  return 0;
}

bool sm90_f1_supported(const LayerDesc& desc, const F1Op& op) {
  const int64_t T = op.rows.T, ab_ld = op.ab_ld;
  if (desc.dtype != Dtype::BF16 && desc.dtype != Dtype::F16) return false;
  if (kernel_for(desc.dtype, desc.activation, kF1Consumers) == nullptr) return false;
  if (desc.d <= 0 || desc.h <= 0 || desc.d % 8 != 0 || desc.h % 8 != 0) return false;
  if (desc.E < 1 || desc.E > kMaxExperts || desc.k < 1 || T < 0) return false;
  const int64_t N = T * desc.k;
  const int64_t cols = tile_cols(desc.gated());
  const int64_t n_tiles = (desc.h + cols - 1) / cols;
  const int64_t max_tiles = (N / kBM + desc.E) * n_tiles;  // sum_e ceil(count_e / kBM) * n_tiles
  constexpr int64_t kIntMax = 0x7fffffff;
  if (desc.d > kIntMax || desc.h > kIntMax || N > kIntMax || T > kIntMax || max_tiles > kIntMax)
    return false;
  if (ab_ld != 0 && (ab_ld < desc.h || ab_ld % 8 != 0)) return false;
  const void* required[] = {op.x, op.w_gate, desc.gated() ? op.w_up : op.w_gate};
  for (const void* ptr : required)
    if (ptr == nullptr || !aligned16(ptr)) return false;
  const void* outputs[] = {op.out_a, desc.gated() ? op.out_b : nullptr, op.out_u};
  for (const void* ptr : outputs)
    if (ptr != nullptr && !aligned16(ptr)) return false;
  return sm90_current_device().usable;
}

void sm90_f1_launch(const LayerDesc& desc, const F1Op& op, const Sm90Forms& forms,
                    cudaStream_t stream) {
  const int64_t N = op.rows.T * desc.k;
  const bool gated = desc.gated();
  void* const out_a = op.out_a;
  void* const out_b = gated ? op.out_b : nullptr;
  void* const out_u = op.out_u;
  if (N == 0 || (out_a == nullptr && out_b == nullptr && out_u == nullptr)) return;
  const Sm90Device& info = sm90_current_device();
  MB_REQUIRE(info.usable, MOEBLAZE_ERR_CUDA, "sm90 F1 launched on an unsupported device");
  const int64_t k_tiles = (desc.d + kBK - 1) / kBK;
  int form = f1_form_for(k_tiles, gated, forms.f1_form);
  // The policy is one CTA for every activation; clusters only when asked for (f1_gemm.hpp), in
  // the epilogue-warp form (also where the policy would split the epilogue).
  const bool want_cluster = forms.f1_cluster == 2 && info.f1_clusters > 0;
  if (want_cluster && forms.f1_form < 0 && form != kF1Consumers) form = kF1Warps;
  const bool epi_warps = form != kF1Consumers;
  const int cluster = form == kF1Warps && want_cluster ? 2 : 1;
  const KernelFn kernel = kernel_for(desc.dtype, desc.activation, form, cluster);
  MB_REQUIRE(kernel != nullptr, MOEBLAZE_ERR_CUDA, "sm90 F1: unsupported dtype or activation");

  F1Params p;
  p.x = op.x;
  p.offsets = op.rows.expert_offsets;
  p.token_index = op.rows.expert_token_indices;
  p.out_a = out_a;
  p.out_b = out_b;
  p.out_u = out_u;
  p.ab_ld = op.ab_ld != 0 ? op.ab_ld : desc.h;
  p.d = int(desc.d);
  p.h = int(desc.h);
  p.E = int(desc.E);
  const int cols = tile_cols(gated);
  p.n_tiles = int((desc.h + cols - 1) / cols);
  p.k_tiles = int((desc.d + kBK - 1) / kBK);
  p.band_mtiles = sm90_band_mtiles(Sm90Gemm::F1, p.n_tiles, forms.band_mtiles);

  CUtensorMap map_gate, map_second;
  if (desc.dtype == Dtype::BF16) {
    map_gate = make_weight_map<__nv_bfloat16>(op.w_gate, desc.E, desc.h, desc.d);
    map_second = gated ? make_weight_map<__nv_bfloat16>(op.w_up, desc.E, desc.h, desc.d) : map_gate;
  } else {
    map_gate = make_weight_map<__half>(op.w_gate, desc.E, desc.h, desc.d);
    map_second = gated ? make_weight_map<__half>(op.w_up, desc.E, desc.h, desc.d) : map_gate;
  }
  // Persistent: one CTA per SM (the shared memory allows no more), fewer when there are fewer
  // tiles than SMs (an upper bound from N: sum_e ceil(count_e / 128) <= N / 128 + E); clusters:
  // as many as can be resident at once.
  const int64_t max_tiles = (N / (kBM * cluster) + desc.E) * p.n_tiles;
  const int64_t slots = cluster > 1 ? info.f1_clusters : info.sms;
  const int units = int(max_tiles < slots ? max_tiles : slots);
  const PersistentLaunch launch(units, cluster, kThreads, smem_bytes(p.E, epi_warps), stream);
  check(cudaLaunchKernelEx(&launch.config, kernel, map_gate, map_second, p), "sm90_f1_kernel");
}

}  // namespace cuda
}  // namespace moeblaze
