// F2 and B4 on Hopper with ping-pong consumers: F2's form for h <= 1024 (192 columns, 2-CTA
// clusters; sm90_f2_rows_form), B4's only when forced (MOEBLAZE_CUDA_ROWS_FORM=pingpong,
// pingpong128 or pingpong2cta). See rows_gemm.hpp for what F2 and B4 compute.
//
// Why: where a tile's main loop is short (F2 at h = 768 runs 12 k-steps), rows_gemm.cu's
// cooperative tile (both consumer warpgroups on one 128 x 256 tile) leaves the tensor cores idle
// at every tile boundary while the accumulators drain and are handed off: on the H200, F2 reaches
// 536 TFLOP/s on qwen3-30b-a3b against F1's 606 at 32 k-steps. Here each consumer warpgroup owns
// a whole tile of 128 rows x TILE_N columns (TILE_N = 192 or 128, two m64nTILE_Nk16 wgmmas per 16
// k, TILE_N accumulators a thread) and takes every other tile of its CTA: while one runs its
// epilogue, the other's main loop keeps the tensor cores busy.
//
// Layout: warpgroup 0 produces (one thread issues the TMA loads; the other threads exit); 1 and 2
// consume. Stages of A (128 rows x 64 k, 16 KB, TMA box {64 k, 1, 128 rows}) and B (TILE_N x 64,
// boxes of 64: K-major {64 k, 64 rows} for F2, MN-major {64 n, 64 k} for B4), as many as fit
// (5 of 40 KB, or 6 of 32 KB). The stages are used in the CTA's tile order, each by the one
// warpgroup whose tile it holds: a stage's empty barrier takes that warpgroup's 4 warps. The two
// main loops take turns (a turn barrier each; tools/models/rows_pingpong_protocol_model.py checks
// the protocol, and that it fails without the turns). Each warp stores its rows (row_value of the
// row's weight, rounded once) through its own 2 KB staging buffer after the stages, 64 columns at a
// time, with 16-byte stores; the rows' pairs and weights are loaded during the main loop. The k
// order of every element is the cooperative kernel's (16-k wgmmas in k order), so the two give the
// same bits (the CUDA suite checks it).
#include <algorithm>

#include "cuda/engines/sm90/rows_layout.cuh"

namespace moeblaze {
namespace cuda {
namespace {

using namespace sm90;

constexpr int kPingThreads = 384;
constexpr int kPingATileBytes = kBM * kBK * 2;         // 16 KB
constexpr int kPingBoxCols = 64;                       // B box width along n
constexpr int kPingBoxBytes = kPingBoxCols * kBK * 2;  // 8 KB

template <int TILE_N>
struct PingLayout {
  static_assert(TILE_N == 192 || TILE_N == 128, "ping-pong tiles are 192 or 128 columns wide");
  static constexpr int kStageBytes = kPingATileBytes + TILE_N * kBK * 2;
  // As many stages as fit beside the barriers and the schedule of kMaxExperts (no hand-off).
  static constexpr int kStages = TILE_N == 192 ? 5 : 6;
  static constexpr int kAcc = TILE_N / 2;  // accumulators a thread per m64 half
  // Each consumer warp's staging buffer for its rows' stores: 16 rows x 64 columns (2 KB).
  static constexpr int kStagingWarpBytes = 16 * 64 * 2;
  static constexpr int kStagingBytes = 8 * kStagingWarpBytes;
  static constexpr size_t smem_bytes(int E) {
    return pipeline_smem_bytes(kStages, kStageBytes, kStagingBytes, E);
  }
};
static_assert(PingLayout<192>::smem_bytes(kMaxExperts) <= kSmemPerBlock, "227 KB per block");
static_assert(PingLayout<128>::smem_bytes(kMaxExperts) <= kSmemPerBlock, "227 KB per block");

// setmaxnreg: the producer thread needs few; each consumer holds 2 x kAcc accumulators.
constexpr int kPingRegsProducer = 24, kPingRegsConsumer = 240;
static_assert(register_split_fits(kPingRegsProducer, kPingRegsConsumer), "register split");

#if MB_SM90_DEVICE

// Tile t of the schedule, as CTA `rank` of a CLUSTER-CTA cluster runs it: the cluster's tiles are
// CLUSTER * 128 rows (each expert's m-tiles in groups of CLUSTER), and CTA rank takes the rank-th
// 128 of them, which can be empty (rows 0) at the end of an expert.
template <int TILE_N, int CLUSTER>
__device__ __forceinline__ TileCoord ping_decode(int t, const int* tile_start, const RowsParams& p,
                                                 int rank) {
  const GroupedTile g =
      decode_grouped_tile<kBM * CLUSTER>(t, tile_start, p.offsets, p.E, p.n_tiles, p.band_mtiles);
  const int rows = min(kBM, g.rows - kBM * rank);
  return {g.e, g.row0 + kBM * rank, rows > 0 ? rows : 0, g.n_tile * TILE_N};
}

// A consumer thread's rows of a tile: i = 2 half + rr is row 64 half + 16 warp + g + 8 rr.
__device__ __forceinline__ int ping_row(int i, int warp_in_wg, int g) {
  return 64 * (i >> 1) + 16 * warp_in_wg + g + 8 * (i & 1);
}

// The rows' (token, j) pairs where the store needs them (F2's weights, k = 1's direct rows), and
// then their weights: issued during the main loop, so that the epilogue, which the other
// warpgroup's main loop has to cover, waits for no load (it took two dependent loads a row).
struct PingRowInfo {
  int32_t pair[4];
  float w[4];
};

__device__ __forceinline__ bool ping_needs_pair(const RowsParams& p) {
  return p.row_pair != nullptr && (p.out_w != nullptr || p.out_by_pair);
}

__device__ __forceinline__ void ping_load_pairs(const RowsParams& p, const TileCoord& c,
                                                int warp_in_wg, int g, PingRowInfo& info) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = ping_row(i, warp_in_wg, g);
    info.pair[i] = c.row0 + row;
    if (ping_needs_pair(p) && row < c.rows) info.pair[i] = __ldg(p.row_pair + c.row0 + row);
  }
}

__device__ __forceinline__ void ping_load_weights(const RowsParams& p, const TileCoord& c,
                                                  int warp_in_wg, int g, PingRowInfo& info) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    info.w[i] = 1.f;
    if (p.out_w != nullptr && ping_row(i, warp_in_wg, g) < c.rows)
      info.w[i] = __ldg(p.out_w + info.pair[i]);
  }
}

// One m64 half of a warpgroup's tile, through the warp's 2 KB staging buffer: per 64-column group,
// the warp's 16 rows go in by stmatrix (register 4j + q of lane (g, t4) holds row 8 (q >> 1) + g
// of them, column 8j + 2 t4 + (q & 1); 16-byte chunk c of row r at r * 128 + ((c ^ (r & 7)) <<
// 4), so neither side has bank conflicts) and out by 16-byte stores, eight lanes a 128-byte row
// segment. Each row weighted (F2's g; B4: 1) and rounded once, as stored. Against storing 4-byte
// column pairs from registers: a quarter of the store instructions, each writing whole sectors.
template <typename T, int TILE_N>
__device__ __forceinline__ void ping_store_half(const RowsParams& p, const TileCoord& c, int half,
                                                int warp_in_wg, int lane, uint32_t* stg,
                                                const PingRowInfo& info,
                                                const float (&acc)[TILE_N / 2]) {
  const int first_row = 64 * half + 16 * warp_in_wg;  // the warp's rows of the tile
  const uint32_t stg_addr = smem_u32(stg);
  // stmatrix: lane l addresses row l & 7 (+ 8 for matrices 1 and 3) of block j + (l >> 4).
  const int st_row = (lane & 7) + 8 * ((lane >> 3) & 1);
  const int st_block = lane >> 4;
  // Copy-out: lane l moves chunk l & 7 of rows (l >> 3) + 4 i.
  const int chunk = lane & 7;
#pragma unroll
  for (int grp = 0; grp < TILE_N / 64; ++grp) {
    if (c.n0 + 64 * grp >= p.n_out) break;  // n_out % 8 == 0: whole chunks in or out below
#pragma unroll
    for (int j = 8 * grp; j < 8 * grp + 8; j += 2) {
      uint32_t m[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int jj = j + (q >> 1), rr = q & 1;
        m[q] = row_value_pair<T>(info.w[2 * half + rr], acc[4 * jj + 2 * rr],
                                 acc[4 * jj + 2 * rr + 1]);
      }
      const int jj = (j + st_block) & 7;
      stmatrix_x4(stg_addr + uint32_t(st_row * 128 + ((jj ^ (st_row & 7)) << 4)), m[0], m[1], m[2],
                  m[3]);
    }
    __syncwarp();
    const int col = c.n0 + 64 * grp + 8 * chunk;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = (lane >> 3) + 4 * i;  // the warp's row: its 8 (i >> 1) + (r & 7)
      // k = 1's direct rows: the row's pair, from a lane holding the row (g = r & 7).
      const int32_t pair =
          p.out_by_pair ? __shfl_sync(0xffffffffu, info.pair[2 * half + (i >> 1)], (r & 7) * 4) : 0;
      const uint4 v = *reinterpret_cast<const uint4*>(stg + r * 32 + ((chunk ^ (r & 7)) << 2));
      const int row = first_row + r;
      if (row < c.rows && col < p.n_out) {
        const int64_t out_row = p.out_by_pair ? int64_t(pair) : int64_t(c.row0) + row;
        *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + out_row * p.out_ld + col) = v;
      }
    }
    __syncwarp();  // every lane's reads before the next group's stmatrix
  }
}

#endif  // MB_SM90_DEVICE

// KIND: kF2 or kB4 (rows_layout.cuh). TILE_N: 192 or 128. CLUSTER: 1, or 2 for clusters of two
// CTAs that share each stage's B tile (TILE_N 192 only; the producer below says how).
template <typename T, int KIND, int TILE_N, int CLUSTER>
__global__ void __launch_bounds__(kPingThreads, 1)
    sm90_rows_pingpong_kernel(const __grid_constant__ CUtensorMap tmap_a,
                              const __grid_constant__ CUtensorMap tmap_b0,
                              const __grid_constant__ CUtensorMap tmap_b1, const RowsParams p) {
#if MB_SM90_DEVICE
  static_assert(KIND == kF2 || KIND == kB4, "F2 and B4 only (B1 gathers A and has its epilogue)");
  static_assert(CLUSTER == 1 || (CLUSTER == 2 && TILE_N == 192), "2-CTA clusters: 192 columns");
  using L = PingLayout<TILE_N>;
  constexpr int kStages = L::kStages;
  constexpr bool kBMn = KIND == kB4;  // B4's B is MN-major, F2's K-major
  constexpr uint32_t kBTileBytes = uint32_t(TILE_N) * kBK * 2;
  extern __shared__ uint8_t smem_raw[];
  const GatherPipelineSmem<kStages, L::kStageBytes> shm(smem_raw, L::kStagingBytes);

  const int tid = threadIdx.x;
  const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0), lane = tid & 31;
  // Empty barriers: one arrival per warp of the one consumer warpgroup that used the stage, in
  // every CTA of the cluster (each CTA's producer fills that stage in all of them). The hand-off's
  // two barriers (no hand-off here) serve as the turn barriers below: 128 arrivals.
  if (tid == 0) shm.init_barriers(4, 4, CLUSTER);
  const int total_tiles = build_tile_prefix<kBM * CLUSTER, kPingThreads>(
      shm.tile_start, p.offsets, p.E, p.n_tiles, tid, warp, lane);
  const PersistentPlace place = persistent_place<CLUSTER>();
  const int rank = place.rank, first_tile = place.first_tile, tile_step = place.tile_step;
  const int k_tiles = p.halves * p.kt_half;

  if (warp < 4) {
    // ================= producer =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kPingRegsProducer) : "memory");
    if (tid == 0) {
      uint32_t it = 0;
      for (int t = first_tile; t < total_tiles; t += tile_step) {
        const TileCoord c = ping_decode<TILE_N, CLUSTER>(t, shm.tile_start, p, rank);
        // One CTA: B boxes that start past n_out are neither issued nor expected (never stored).
        // A cluster issues and expects all of B (the peer's share lands here whatever our rows),
        // and no A where the CTA has no rows.
        const int b_boxes =
            min(TILE_N / kPingBoxCols, (p.n_out - c.n0 + kPingBoxCols - 1) / kPingBoxCols);
        const uint32_t tx = CLUSTER > 1
                                ? (c.rows > 0 ? uint32_t(kPingATileBytes) : 0u) + kBTileBytes
                                : uint32_t(kPingATileBytes) + uint32_t(b_boxes) * kPingBoxBytes;
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const int s = int(it % kStages);
          const int half = kt >= p.kt_half ? 1 : 0;
          const int k0 = (kt - half * p.kt_half) * kBK;
          mbar_wait(smem_u32(shm.empty_bar + s), ((it / kStages) & 1) ^ 1);
          uint8_t* stage = shm.stage(s);
          const uint32_t full = smem_u32(shm.full_bar + s);
          mbar_arrive_expect_tx(full, tx);
          if (CLUSTER == 1 || c.rows > 0)
            tma_load_3d(smem_u32(stage), &tmap_a, full, k0, half, c.row0);
          const CUtensorMap* mb = half ? &tmap_b1 : &tmap_b0;
          const uint32_t b_dst = smem_u32(stage + kPingATileBytes);
          if (CLUSTER > 1) {
            // Our half of B, to both CTAs: F2's (K-major) rows [96 rank, +96) of the tile's n, one
            // box of {64 k, 96 n}; B4's (MN-major) k rows [32 rank, +32) of each 64-column box,
            // boxes of {64 n, 32 k}. Each half starts at a multiple of 1024 bytes, so the 128-byte
            // swizzle (a function of the address) is the whole tile's.
            constexpr uint16_t kBoth = (1u << CLUSTER) - 1;
            if (kBMn) {
              for (int i = 0; i < TILE_N / kPingBoxCols; ++i)
                tma_load_3d_multicast(b_dst + i * kPingBoxBytes + rank * (kPingBoxBytes / 2), mb,
                                      full, c.n0 + kPingBoxCols * i, k0 + (kBK / 2) * rank, c.e,
                                      kBoth);
            } else {
              tma_load_3d_multicast(b_dst + rank * (kBTileBytes / 2), mb, full, k0,
                                    c.n0 + (TILE_N / 2) * rank, c.e, kBoth);
            }
          } else {
            for (int i = 0; i < b_boxes; ++i) {
              const uint32_t dst = b_dst + i * kPingBoxBytes;
              const int n = c.n0 + kPingBoxCols * i;
              if (kBMn)
                tma_load_3d(dst, mb, full, n, k0, c.e);  // {n, k, e}
              else
                tma_load_3d(dst, mb, full, k0, n, c.e);  // {k, n, e}
            }
          }
        }
      }
    }
  } else {
    // ================= consumer warpgroups =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kPingRegsConsumer) : "memory");
    const int wg = (warp >> 2) - 1;   // this warpgroup takes the CTA's tiles n with n % 2 == wg
    const int warp_in_wg = warp & 3;  // rows [16 warp_in_wg, +16) of each m64 half
    const int g = lane >> 2;
    uint32_t* stg = reinterpret_cast<uint32_t*>(shm.epi + (warp - 4) * L::kStagingWarpBytes);
    float acc0[L::kAcc], acc1[L::kAcc];  // rows [0, 64) and [64, 128) of the tile
#pragma unroll
    for (int i = 0; i < L::kAcc; ++i) acc0[i] = acc1[i] = 0.f;
    // Turns: the main loop of tile n >= 1 waits until the other warpgroup's main loop of tile
    // n - 1 is past its full waits (its 128 threads arrive on our turn barrier). Our k-step
    // counter jumps over the other's tiles, so without it we could wait on a full barrier two
    // phases behind, whose parity already reads "passed"
    // (tools/models/rows_pingpong_protocol_model.py); it also makes the two main loops alternate,
    // one's epilogue under the other's main loop.
    const uint32_t my_turn = smem_u32(wg == 0 ? shm.handoff_full : shm.handoff_empty);
    const uint32_t other_turn = smem_u32(wg == 0 ? shm.handoff_empty : shm.handoff_full);
    uint32_t turns = 0;  // our waits on my_turn so far
    const uint32_t stage0 = smem_u32(shm.stage(0));
    const StageDesc desc_a0_stage0(smem_desc_kmajor_sw128(stage0));
    const StageDesc desc_a1_stage0(smem_desc_kmajor_sw128(stage0 + kPingATileBytes / 2));
    const StageDesc desc_b_stage0(kBMn ? smem_desc_mnmajor_sw128(stage0 + kPingATileBytes)
                                       : smem_desc_kmajor_sw128(stage0 + kPingATileBytes));
    uint32_t it = 0;
    uint32_t n = 0;  // the CTA's tiles so far
    for (int t = first_tile; t < total_tiles; t += tile_step, ++n) {
      if (int(n & 1) != wg) {  // the other warpgroup's tile: its stages are not ours
        it += uint32_t(k_tiles);
        continue;
      }
      const TileCoord c = ping_decode<TILE_N, CLUSTER>(t, shm.tile_start, p, rank);
      const bool live = c.rows > 0;  // a cluster's CTA past its expert's rows only passes B on
      if (n >= 1) mbar_wait(my_turn, turns++ & 1);
      PingRowInfo info = {};
      // The rows' pairs once the first k-step's wgmmas are issued, their weights three k-steps
      // later, so neither load's latency falls on the main loop or the epilogue.
      const int weights_kt = min(3, k_tiles - 1);
      int prev_s = 0;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = int(it % kStages);
        mbar_wait(smem_u32(shm.full_bar + s), (it / kStages) & 1);
        if (live) {
          const uint32_t stage_offset = uint32_t(s) * L::kStageBytes;
          const uint64_t desc_a0 = desc_a0_stage0.at(stage_offset);
          const uint64_t desc_a1 = desc_a1_stage0.at(stage_offset);
          const uint64_t desc_b = desc_b_stage0.at(stage_offset);
          // Inside a 128-byte swizzle row a K-major operand advances 32 bytes per 16 k (+2 in the
          // descriptor), an MN-major one 16 rows of 128 bytes (+128): wgmma_kstep's steps.
          constexpr uint64_t kStepA = 2, kStepB = kBMn ? 128 : 2;
          fence_accumulators(acc0);
          fence_accumulators(acc1);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBK / 16; ++kk) {
            const int scale = (kt > 0 || kk > 0) ? 1 : 0;
            wgmma_m64nk16<T, TILE_N, 0, kBMn ? 1 : 0>(acc0, desc_a0 + kStepA * kk,
                                                      desc_b + kStepB * kk, scale);
            wgmma_m64nk16<T, TILE_N, 0, kBMn ? 1 : 0>(acc1, desc_a1 + kStepA * kk,
                                                      desc_b + kStepB * kk, scale);
          }
          wgmma_commit();
          if (kt == 0) ping_load_pairs(p, c, warp_in_wg, g, info);
          if (kt == weights_kt) ping_load_weights(p, c, warp_in_wg, g, info);
          wgmma_wait<1>();
          fence_accumulators(acc0);
          fence_accumulators(acc1);
        }
        if (kt > 0) release_stage<CLUSTER>(smem_u32(shm.empty_bar + prev_s), lane);
        prev_s = s;
      }
      mbar_arrive(other_turn);  // every thread: its full waits of this tile are behind it
      wgmma_wait<0>();
      fence_accumulators(acc0);
      fence_accumulators(acc1);
      release_stage<CLUSTER>(smem_u32(shm.empty_bar + prev_s), lane);

      // Epilogue, while the other warpgroup's main loop runs.
      ping_store_half<T, TILE_N>(p, c, 0, warp_in_wg, lane, stg, info, acc0);
      ping_store_half<T, TILE_N>(p, c, 1, warp_in_wg, lane, stg, info, acc1);
    }
  }
  // The peer may still arrive on our empty barriers (and we on its) until both are done.
  if (CLUSTER > 1) cluster_sync();
#else
  __trap();  // no sm_90a image: sm90_rows_supported never lets this run
#endif  // MB_SM90_DEVICE
}

using PingKernelFn = void (*)(const CUtensorMap, const CUtensorMap, const CUtensorMap,
                              const RowsParams);

template <typename T, int KIND>
PingKernelFn ping_kernel_for_kind(int tile_n, int cluster) {
  if (cluster == 2) return sm90_rows_pingpong_kernel<T, KIND, 192, 2>;
  return tile_n == 192 ? sm90_rows_pingpong_kernel<T, KIND, 192, 1>
                       : sm90_rows_pingpong_kernel<T, KIND, 128, 1>;
}

PingKernelFn ping_kernel_for(Dtype dtype, int kind, int tile_n, int cluster) {
  if (dtype == Dtype::BF16)
    return kind == kF2 ? ping_kernel_for_kind<__nv_bfloat16, kF2>(tile_n, cluster)
                       : ping_kernel_for_kind<__nv_bfloat16, kB4>(tile_n, cluster);
  if (dtype == Dtype::F16)
    return kind == kF2 ? ping_kernel_for_kind<__half, kF2>(tile_n, cluster)
                       : ping_kernel_for_kind<__half, kB4>(tile_n, cluster);
  return nullptr;
}

size_t ping_smem_bytes(int tile_n, int E) {
  return tile_n == 192 ? PingLayout<192>::smem_bytes(E) : PingLayout<128>::smem_bytes(E);
}

void ping_launch(const LayerDesc& desc, const Sm90Device& info, int kind, int tile_n, int cluster,
                 const CUtensorMap& a, const CUtensorMap& b0, const CUtensorMap& b1,
                 const RowsParams& params, const Sm90Forms& forms, cudaStream_t stream,
                 const char* what) {
  RowsParams p = params;
  p.n_tiles = (p.n_out + tile_n - 1) / tile_n;
  p.band_mtiles =
      sm90_band_mtiles(kind == kF2 ? Sm90Gemm::F2 : Sm90Gemm::B4, p.n_tiles, forms.band_mtiles);
  MB_REQUIRE(info.usable, MOEBLAZE_ERR_CUDA, "sm90 %s launched on an unsupported device", what);
  // Persistent, one CTA per SM (fewer when there are fewer tiles; an upper bound of the count);
  // clusters: as many as can be resident at once (not every SM can join a cluster).
  const int64_t max_tiles = (p.N / (kBM * cluster) + desc.E) * p.n_tiles;
  MB_REQUIRE(max_tiles <= 0x7fffffff, MOEBLAZE_ERR_NOT_SUPPORTED,
             "sm90 %s: %lld tiles of %d columns exceed the kernel's int tile ids; unset "
             "MOEBLAZE_CUDA_ROWS_FORM",
             what, static_cast<long long>(max_tiles), tile_n);
  const int64_t slots = cluster > 1 ? info.rows_pingpong_clusters : info.sms;
  const int units = int(max_tiles < slots ? max_tiles : slots);
  const PingKernelFn kernel = ping_kernel_for(desc.dtype, kind, tile_n, cluster);
  MB_REQUIRE(kernel != nullptr && units > 0, MOEBLAZE_ERR_CUDA, "sm90 %s: unsupported dtype", what);
  const PersistentLaunch launch(units, cluster, kPingThreads, ping_smem_bytes(tile_n, p.E), stream);
  check(cudaLaunchKernelEx(&launch.config, kernel, a, b0, b1, p), what);
}

// 2-CTA clusters of the ping-pong kernel that can be resident at once on the current device (0:
// none), found with the kernels prepared.
int ping_max_clusters() {
  return max_resident_2cta_clusters(
      {ping_kernel_for(Dtype::BF16, kF2, 192, 2), ping_kernel_for(Dtype::BF16, kB4, 192, 2),
       ping_kernel_for(Dtype::F16, kF2, 192, 2), ping_kernel_for(Dtype::F16, kB4, 192, 2)},
      kPingThreads, ping_smem_bytes(192, kMaxExperts));
}

}  // namespace

bool sm90_rows_pingpong_prepare_kernels(int* max_clusters) {
  *max_clusters = 0;
  for (Dtype dtype : {Dtype::BF16, Dtype::F16})
    for (int kind : {kF2, kB4})
      for (int tile_n : {192, 128})
        for (int cluster : {1, 2}) {
          if (tile_n == 128 && cluster == 2) continue;
          if (!prepare_kernel(ping_kernel_for(dtype, kind, tile_n, cluster),
                              ping_smem_bytes(tile_n, kMaxExperts)))
            return false;
        }
  *max_clusters = ping_max_clusters();
  (void)cudaGetLastError();
  return true;
}

void sm90_f2_pingpong_launch(const LayerDesc& desc, const F2Op& op, const Sm90Device& device,
                             int tile_n, int cluster, const Sm90Forms& forms, cudaStream_t stream) {
  if (op.rows.T * desc.k == 0) return;
  // w_down in boxes of 64 rows of n; a cluster's CTA loads half the tile's rows at once.
  const RowsOperands o = f2_operands(desc, op, cluster > 1 ? 192 / 2 : kPingBoxCols);
  ping_launch(desc, device, kF2, tile_n, cluster, o.a, o.b0, o.b1, o.p, forms, stream,
              "sm90_rows_pingpong_kernel (F2)");
}

void sm90_b4_pingpong_launch(const LayerDesc& desc, const B4Op& op, const Sm90Device& device,
                             int tile_n, int cluster, const Sm90Forms& forms, cudaStream_t stream) {
  if (op.rows.T * desc.k == 0) return;
  // w_gate, w_up in boxes of 64 k; a cluster's CTA loads half of each box's k.
  const RowsOperands o = b4_operands(desc, op, cluster > 1 ? kBK / 2 : kBK);
  ping_launch(desc, device, kB4, tile_n, cluster, o.a, o.b0, o.b1, o.p, forms, stream,
              "sm90_rows_pingpong_kernel (B4)");
}

}  // namespace cuda
}  // namespace moeblaze
