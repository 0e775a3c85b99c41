// Kernel workshop probe: does loading the GATHERED A operand of our Hopper GEMMs with one TMA per
// row (instead of 16-byte cp.async by 128 producer threads) close the gap between the gathered
// kernels (~500-530 TFLOP/s on an H200) and the contiguous-A ones (~730-750 TFLOP/s)?
//
// Build (from the repository root; no -lcuda: the tensor-map encoder comes from the driver through
// the runtime's entry-point query):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v -I src \
//        -o /tmp/probe dev/cuda/sm90_gather_probe.cu
// With a cuBLAS dense GEMM of the same FLOPs in the table: add -DWITH_CUBLAS -lcublas.
// The device primitives (mbarrier, cp.async, TMA, wgmma m64n256k16, the K-major SW128 descriptor)
// and the tensor-map encoder come from src/cuda/sm90/primitives.cuh, which has no dependency on
// the rest of the library (common.cuh, which needs include/moeblaze.h, is not included).
//
// Run:
//   ./probe                   # edge shape checked, then conf3 / mixtral / qwen timed
//   ./probe --check-only      # every selected shape checked (fp32 C vs the reference), no timing
//   ./probe --shape conf3     # one shape: edge | conf3 | mixtral | qwen
//   ./probe --versions 1,2,5  # versions to check / time (default 1,2,3,4,5,6)
//   ./probe --tail zero       # v3-v6: rows past an expert's count load a real zero row of x
//                             # (default "oob": a fully out-of-bounds row coordinate)
//   ./probe --seed 7
// Exit code 0 only if every check (and every timed run's cross-version checksum) passed.
//
// The problem: a grouped GEMM with gathered rows, as F1 (K-major A and B):
//   for expert e, routed row r in [off[e], off[e+1]):  C[r, :] = x[tok[r], :] . W[e]^T  (fp32 acc)
//   x [T, K] bf16, W [E, N, K] bf16, C [M, N] fp32, M = T * k routed rows grouped by expert,
//   tokens ascending inside an expert (host-built expert_offsets / token_index, skewed routing
//   with one empty expert). TFLOP/s = 2 M K N / time.
//
// The kernel is the library's F1 (src/cuda/sm90/f1_gemm.cu) main loop, non-gated path: persistent
// grid of one CTA per SM, tile 128 rows x 256 columns x 64 k, 4 stages of 48 KB (A 16 KB + two
// 128-row B boxes of 16 KB, 3-D map over W so rows past N and k past K are zeros), 384 threads:
// warpgroup 0 produces (setmaxnreg 40), warpgroups 1, 2 consume 64 rows each with wgmma
// m64n256k16 (setmaxnreg 232), wait_group 1 and release of the previous stage, tiles decoded from
// a shared-memory prefix of per-expert tile counts, rasterised in bands of 8 m-tiles. Tiles never
// straddle experts. Only the way the A tile reaches shared memory differs between versions:
//   v1 "contiguous": the upper bound. A is a pre-gathered copy xg [M, K] (xg[r] = x[tok[r]], built
//      outside the timed region), loaded by thread 0 as two TMA boxes {64 k, 64 rows} per stage
//      (2-D map, SWIZZLE_128B). The last partial tile of an expert reads the next expert's rows
//      (never stored: rows of a GEMM are independent; what rows_gemm.cu's F2 does). No fence.
//   v2 "cp.async": the library today (f1_gemm.cu's A path, copied): the tile's 128 token ids go
//      through shared memory, all 128 producer threads issue 8 x 16-byte cp.async.cg each
//      (zero-fill for rows past the count and k past K) into the 128-byte swizzle (chunk c of row
//      r at r*128 + ((c ^ (r & 7)) << 4)), then cp.async.mbarrier.arrive.noinc; full barrier
//      count 129; the consumers fence.proxy.async after every full-barrier wait.
//   v3-v6 "row TMA": one cp.async.bulk.tensor.2d per row from a 2-D map over x [T, K] with box
//      {64 elements = 128 bytes, 1 row}, SWIZZLE_128B, row r of the stage written at
//      a_tile + r*128; all complete on the stage's full barrier (complete_tx); no proxy fence in
//      the consumers; full barrier count = issuing warps, each arriving once with expect_tx of its
//      rows' bytes (+ the B boxes for warp 0). Two ways to issue, each with 1 and 4 warps (the
//      template knob WARPS):
//        v3: per-lane, 1 warp: each of the 32 lanes issues its 4 rows (r = lane + 32 i);
//        v4: per-lane, 4 warps: each of the 128 producer lanes issues 1 row;
//          per-lane operands are divergent, so ptxas serialises the instruction over the active
//          lanes: a loop of ELECT, R2UR of every operand, UTMALDG, BRA.U.ANY (~10 instructions
//          and a loop-back branch per row, on the issuing warp's scheduler);
//        v5: warp-uniform, 1 warp: warp 0 walks the 128 rows with warp-uniform operands (row
//            counter, token id read from a uniform shared-memory address), each TMA predicated by
//            elect.sync inside the asm: ptxas issues one uniform-datapath UTMALDG per row with
//            ~9 uniform instructions (LDS, R2UR, ISETP/VOTEU/USEL for the tail, UIADD3s) and no
//            ELECT or per-lane loop;
//        v6: warp-uniform, 4 warps: the same, 32 rows per producer warp.
//      Getting v5/v6's code out of ptxas needed three things (checked in the SASS; each one alone
//      fell back to ELECT + ~9 R2UR per row): the issuing warps run their own tile loop (no
//      warp-dependent branch after setmaxnreg: v5's idle warps get a zero trip count), the B
//      boxes' condition is a predicate inside the asm, and the warp index comes from
//      __shfl_sync(.., warp, 0) (ptxas does not treat threadIdx.x >> 5 as warp-uniform).
//      Rows past the expert's count are still issued, with the row coordinate T: fully out of
//      bounds of the map (dims {K, T}), so TMA zero-fills the 128 bytes and still counts them
//      (expect_tx is a constant 128 x 128 bytes per stage; nothing is read from the next expert).
//      --tail zero instead maps {K, T + 1} over an x with a zero row T (in bounds): the fallback
//      if fully out-of-bounds boxes misbehave. K not a multiple of 64: the box's columns past K are
//      out of bounds, zero-filled, counted (as the library's B boxes already rely on).
//   Why the per-row box lands in the same layout as v2's cp.async (and as the wgmma descriptor
//   expects): the 128B swizzle is a function of the shared-memory ADDRESS, not of the box (CUDA C
//   Programming Guide, "TMA Swizzle": a destination not aligned to the 1024-byte repeat is offset
//   into the pattern by (addr / 128) % 8, i.e. chunk x of box row y lands at chunk
//   ((y + offset) % 8) ^ x; shared memory needs only 128-byte alignment; the box's inner dimension
//   must be <= 128 bytes; other sources describe it as bits [4:6] ^= bits [7:9] of the address).
//   With a 1024-byte aligned tile, a 1-row box at a_tile + r*128 has offset r & 7 and y = 0, so
//   its chunk c lands at r*128 + ((c ^ (r & 7)) << 4): exactly v2's layout. The checked mode
//   verifies it end to end (a wrong layout gives a wrong C).
// The consumers are the same code in every version (plus v2's fence). Epilogue, two modes of one
// kernel (a uniform runtime branch after each tile's main loop):
//   timed:   the accumulators of valid rows and columns are folded into one float per consumer
//            warp (8 per CTA, written once at exit) so the wgmmas are kept; the host sums them in
//            double and compares the versions (same tiles per CTA, same data: the same sum);
//   checked: C stored in fp32 (float2 from registers), compared with a SIMT fp32 reference kernel
//            (relative L2 < 1e-4, per element |d| <= 1e-3 + 1e-3 |ref|; C is poisoned with NaN
//            first so unwritten elements fail); plus, after every full-barrier wait, the consumers
//            read the stage's A tile and count 16-byte chunks that must be zero but are not (rows
//            past the count for v2-v6, columns past K for all): a row TMA that loaded a real row,
//            or nothing at all (stale data), into a tail row shows here although it cannot change
//            C; and a second run must give bitwise the same C.
// The edge shape (T=777, K=200, N=264, E=5, k=2, one empty expert) is always checked: partial last
// tiles of every expert, K % 64 = 8 (one valid chunk in the last k-tile), N % 256 = 8 (second B
// box skipped: the expect_tx bytes change), T odd, an empty expert.
//
// Results (session 4, dev/cuda/results/2026-11-29-nvidia-h200-round8-gather-probe.txt): per-row
// TMA is slower than the cp.async gather (conf3 v4 472, v6 447 vs v2 539, v1 729 TFLOP/s); v7-v11
// (round 8b, see AMode) did not find the gap either. The expectations written before any run:
//   - v2 should reproduce the library's ~500-530 TFLOP/s (a little more: no real epilogue), v1
//     the ~730-750 of the contiguous kernels.
//   - At 750 TFLOP/s a 128x256x64 stage lasts ~1100-1400 SM cycles and carries 128 row boxes + 2 B
//     boxes: a row TMA must be issued AND processed by the SM's TMA unit every ~8-10 cycles.
//     v5/v6 issue a row in ~9 uniform instructions, so their issue fits (v5 only just, on one
//     scheduler; v6 spreads it over four); v3 (~10 instructions + a branch per row, one warp)
//     probably does not. My guess: v6 within ~10-15% of v1 if the TMA unit keeps up with 128-byte
//     boxes, v5 a little behind v6, v3 near or below v2, v4 between. If v5 == v6 and both are well
//     below v1, the TMA unit's per-box rate (not instruction issue) is the limit, and per-row TMA
//     on Hopper does not pay; if v6 >> v5, issue is the limit.
// What a reviewer with a GPU should check first:
//   1. the edge check of v3-v6 (zero-fill counter, rel_l2). If they trap (mbarrier watchdog,
//      "unspecified launch failure") with the default --tail oob but pass with --tail zero, a
//      fully out-of-bounds box does not complete its transaction bytes as a partial one does; the
//      run script retries with --tail zero by itself.
//   2. the SASS counts the run script prints (UTMALDG, ELECT, R2UR per kernel): v5/v6 must show
//      few ELECT / R2UR (3 and ~21 here, with CUDA 13.0's ptxas); a different ptxas may fall back.
//   3. whether v1 really reaches ~730+: if not, this main loop is not representative.
//   4. L2 promotion (L2_256B, the library's) on 128-byte row boxes: it fetches the next 128 bytes
//      of the row, which the next k-step uses; not varied here.
// Preconditions (host-checked): K % 8 == 0, N % 8 == 0, E <= 1024, M >= 1.

#include <cuda.h>  // CUtensorMap and the encoder's types only: no libcuda link
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#ifdef WITH_CUBLAS
#include <cublas_v2.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "sm90_gather_probe.cu needs -gencode=arch=compute_90a,code=sm_90a (wgmma, setmaxnreg, TMA)"
#endif

// ---------------------------------------------------------------------------------------------
// error checking (a workshop program: print file:line and exit)

#define CUDA_CHECK(call)                                                                          \
  do {                                                                                            \
    cudaError_t err_ = (call);                                                                    \
    if (err_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(err_), __FILE__, __LINE__, \
              cudaGetErrorString(err_));                                                          \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

#define REQUIRE(cond, ...)                                \
  do {                                                    \
    if (!(cond)) {                                        \
      fprintf(stderr, "requirement failed: %s: ", #cond); \
      fprintf(stderr, __VA_ARGS__);                       \
      fprintf(stderr, "\n");                              \
      exit(1);                                            \
    }                                                     \
  } while (0)

typedef __nv_bfloat16 bf16;

// ---------------------------------------------------------------------------------------------
// device primitives: the library's (src/cuda/sm90/primitives.cuh, on -I src), with this probe's
// 2^24-poll mbarrier watchdog; below, the probe's own (an L2 prefetch-size variant of cp.async,
// the tensor-map prefetch, the warp-converged TMA forms of v5/v6). Until session 5 this file
// carried copies of the library's; the sm_90a cubin is byte-identical before and after.

#define MB_SM90_MBAR_POLL_LIMIT (1u << 24)
#include "cuda/sm90/primitives.cuh"

using namespace moeblaze::cuda::sm90;  // kBK (64 k per stage) comes from here too

#if MB_SM90_DEVICE

__device__ __forceinline__ void cp_async16_zfill_l2_256(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Warp-converged forms (v5, v6; not in common.cuh): every lane of the warp executes them with
// warp-uniform operands and elect.sync picks the one lane that issues, so ptxas keeps the operands
// in uniform registers and emits a single UTMALDG / arrive (no per-lane loop). All 32 lanes must
// execute them (membermask 0xffffffff); tma_load_3d_elect issues only where `issue` holds.
__device__ __forceinline__ void mbar_arrive_expect_tx_elect(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\n"
      "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
}

__device__ __forceinline__ void tma_load_2d_elect(uint32_t dst, const CUtensorMap* map,
                                                  uint32_t bar, int c0, int c1) {
  asm volatile(
      "{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\n"
      "@p cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n}\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d_elect(uint32_t dst, const CUtensorMap* map,
                                                  uint32_t bar, int c0, int c1, int c2,
                                                  bool issue) {
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.b32 q, %6, 0;\nelect.sync _|p, 0xffffffff;\n"
      "and.pred p, p, q;\n"
      "@p cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n}\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "r"(int(issue))
      : "memory");
}

#endif  // MB_SM90_DEVICE

// ---------------------------------------------------------------------------------------------
// the probe kernel

constexpr int kBM = 128;            // routed rows per tile
constexpr int kBN = 256;            // output columns per tile
constexpr int kBBoxRows = 128;      // rows of W per TMA box (two boxes per stage)
constexpr int kContigBoxRows = 64;  // v1: rows of xg per TMA box (two boxes per stage)
constexpr int kStages = 4;
constexpr int kThreads = 384;  // warpgroup 0: producer; 1, 2: consumers
constexpr int kProducerThreads = 128;
constexpr int kConsumerWarps = 8;
constexpr int kBandMTiles = 8;  // rasterisation: n-tiles sweep a band of 8 m-tiles
constexpr int kMaxExperts = 1024;

constexpr int kRowBytes = kBK * 2;                 // 128: one row of the A tile
constexpr int kATileBytes = kBM * kRowBytes;       // 16 KB
constexpr int kBBoxBytes = kBBoxRows * kRowBytes;  // 16 KB, two per stage
constexpr int kStageBytes = kATileBytes + 2 * kBBoxBytes;
constexpr int kPipeBytes = kStages * kStageBytes;  // 192 KB
constexpr int kBarrierBytes = 4 * kStages * 8;     // full, empty, a_full[2]
constexpr int kTokenBytes = kBM * 4;

static size_t probe_smem_bytes(int E) {
  return 1024 /* alignment slack */ + kPipeBytes + kBarrierBytes + kTokenBytes +
         sizeof(int) * size_t(E + 1);
}

// How the A tile reaches shared memory (see the header comment).
enum AMode : int {
  kAContig = 0,
  kACpAsync = 1,
  kARowTmaLanes = 2,
  kARowTmaWarp = 3,
  // Round 8b. v7: v2 without the consumers' proxy fence: a MEASUREMENT of the fence's cost only
  // (wgmma may read the stage before the generic-proxy writes are visible to the async proxy).
  kACpAsyncNoFence = 4,
  // v8, v9: v2's cp.async gather, but each producer thread commits a cp.async group per stage and,
  // LAG stages later, waits for that group (cp.async.wait_group LAG), fences it into the async
  // proxy itself (fence.proxy.async), and the warp arrives once (lane 0 after __syncwarp): the
  // full barrier counts 4 warp arrivals + the TMA thread's instead of 128 per-thread noinc
  // arrivals, and the consumers need no fence. LAG = the template's WARPS argument (2 or 3).
  kACpAsyncWarp = 5,
  // v10: both paths at once: rows [0, 64) by v2's cp.async from producer warps 2, 3 (8 chunks
  // each), rows [64, 128) by one row TMA per lane from warps 0, 1 (v4's issue). If the gather is
  // limited per path (L1TEX miss tracking for cp.async, the TMA unit's box rate for row TMAs),
  // splitting the rows between them should add the two rates. The consumers fence (cp.async half).
  kAHybrid = 6,
  // v11: v2 with the .L2::256B prefetch-size hint on every cp.async (the next k-step's 128 bytes
  // of the same row come into L2 with this one's).
  kACpAsyncL2 = 7,
  // v12 (round 11): the CONSUMERS gather their own A rows. Round 10 measured the gather's rate
  // against the number of warps issuing it: the same main loop with 2 gathering warps instead of
  // 4 ran 32 % slower (conf3 10.98 vs 8.30 ms), so the cp.async gather is limited per issuing
  // warp (loads in flight per warp), not by L2 or by the SM's shared-memory bandwidth. Here each
  // consumer warpgroup loads the 64 rows it alone reads (its half of the A tile) with cp.async,
  // 4 x 16 bytes per thread per stage, kStages - 1 stages ahead, into the slot its own previous
  // wgmma has just released (wait_group 1); completion on a per-(warpgroup, slot) mbarrier of 128
  // noinc arrivals. 8 warps gather instead of 4, and no other warpgroup is involved in A, so no
  // barrier crosses warpgroups for it. The producer warpgroup issues only B (thread 0). The token
  // ids of the next tile are fetched one tile ahead, into registers.
  kAConsumerGather = 8,
  // v13 (round 13, session 5, prepared): v12 plus two of the producer's idle warps. The fit of the
  // gather's time against its issuing warps (round 10: 2 warps 10.98 ms, 4 warps 8.30; round 11:
  // 8 warps 7.28 on conf3) is t ~ 5.6 + 10.7 / warps ms, so 10 warps should give ~6.7 ms (~655
  // TFLOP/s). The consumers gather rows [0, 48) of their half (3 chunks a thread), producer warps
  // 1 and 2 rows [48, 64) of both halves (4 chunks a thread, the k-step's slot once its empty
  // barrier completes, as the B boxes), each arriving on both halves' a_full barrier, which then
  // counts 128 + 64.
  kAConsumerPlusProducer = 9
};

struct ProbeParams {
  const bf16* x;               // [T + 1, K]: token rows (row T is zeros), v2's cp.async source
  const int32_t* offsets;      // [E + 1]
  const int32_t* token_index;  // [M] token of each routed row
  float* out;                  // checked mode: C [M, N] fp32; nullptr: timed mode
  float* fold;                 // [gridDim.x * 8] per consumer-warp sums of C (both modes)
  unsigned long long* nonzero_chunks;  // checked mode: 16-byte A chunks that should be zero
  int K, N, E;
  int tail_row;  // v3-v6: row coordinate for rows past an expert's count (zero-filled or zero row)
  int n_tiles;   // ceil(N / kBN)
  int k_tiles;   // ceil(K / kBK)
};

struct TileCoord {
  int e;
  int row0;  // first routed row of the tile
  int rows;  // valid rows (1..128)
  int n0;    // first output column
};

// tile_start[e] = first linear tile id of expert e (prefix of ceil(count_e / kBM) * n_tiles).
// f1_gemm.cu's decode_tile.
__device__ __forceinline__ TileCoord decode_tile(int t, const int* tile_start,
                                                 const ProbeParams& p) {
  int lo = 0, hi = p.E - 1;  // largest e with tile_start[e] <= t (never an empty expert)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int e = lo;
  const int off = __ldg(p.offsets + e);
  const int count = __ldg(p.offsets + e + 1) - off;
  const int m_tiles = (count + kBM - 1) / kBM;
  const int local = t - tile_start[e];
  const int band = local / (kBandMTiles * p.n_tiles);
  const int band_m0 = band * kBandMTiles;
  const int band_h = min(kBandMTiles, m_tiles - band_m0);
  const int r = local - band * kBandMTiles * p.n_tiles;
  const int m_tile = band_m0 + r % band_h;
  TileCoord c;
  c.e = e;
  c.row0 = off + m_tile * kBM;
  c.rows = min(kBM, count - m_tile * kBM);
  c.n0 = (r / band_h) * kBN;
  return c;
}

// Thread 0 of the producer: the stage's B boxes (the second only if it starts inside N; rows past
// N and k past K are zeros from the 3-D map). Returns their bytes for expect_tx.
__device__ __forceinline__ uint32_t b_tile_bytes(const TileCoord& c, const ProbeParams& p) {
  return c.n0 + kBBoxRows < p.N ? 2 * kBBoxBytes : kBBoxBytes;
}
#if MB_SM90_DEVICE
__device__ __forceinline__ void load_b_tile(uint32_t stage, const CUtensorMap* tmap_b,
                                            uint32_t full, const TileCoord& c, int kt,
                                            const ProbeParams& p) {
  tma_load_3d(stage + kATileBytes, tmap_b, full, kt * kBK, c.n0, c.e);
  if (c.n0 + kBBoxRows < p.N)
    tma_load_3d(stage + kATileBytes + kBBoxBytes, tmap_b, full, kt * kBK, c.n0 + kBBoxRows, c.e);
}
#endif  // MB_SM90_DEVICE

// AMODE: kAContig (v1), kACpAsync (v2), kARowTmaLanes (v3, v4), kARowTmaWarp (v5, v6); WARPS:
// the producer warps that issue the row TMAs (1 or 4; ignored by v1, v2).
// tmap_a: v1 the map over xg [M, K] with box {64, 64}; v3-v6 the map over x with box {64, 1};
// v2 ignores it. tmap_b: W [E, N, K] with box {64, 128, 1}.
template <int AMODE, int WARPS>
__global__ void __launch_bounds__(kThreads, 1)
    probe_kernel(const __grid_constant__ CUtensorMap tmap_a,
                 const __grid_constant__ CUtensorMap tmap_b, const ProbeParams p) {
#if MB_SM90_DEVICE
  static_assert(AMODE == kACpAsyncWarp || WARPS == 1 || WARPS == 4, "row TMA: 1 or 4 warps");
  static_assert(AMODE != kACpAsyncWarp || (WARPS >= 1 && WARPS < kStages), "0 < LAG < stages");
  constexpr bool kCpAsync = AMODE == kACpAsync || AMODE == kACpAsyncNoFence ||
                            AMODE == kACpAsyncWarp || AMODE == kACpAsyncL2 || AMODE == kAHybrid;
  constexpr bool kRowTma = AMODE == kARowTmaLanes || AMODE == kARowTmaWarp;
  // A (or part of it) written by the generic proxy.
  constexpr bool kProxyFence =
      AMODE == kACpAsync || AMODE == kACpAsyncL2 || AMODE == kAHybrid || AMODE == kAConsumerGather;
  constexpr bool kConsumerGather = AMODE == kAConsumerGather || AMODE == kAConsumerPlusProducer;
  constexpr bool kProducerShare = AMODE == kAConsumerPlusProducer;  // v13
  constexpr int kConsumerRows = kProducerShare ? 48 : 64;  // rows of its half a warpgroup gathers
  constexpr int kIssueLanes = 32 * WARPS;                  // v3, v4
  constexpr int kRowsPerLane = kBM / kIssueLanes;          // v3, v4: 4 or 1
  constexpr uint32_t kWarpABytes = uint32_t(kBM / WARPS) * kRowBytes;
  constexpr uint32_t kFullCount = kConsumerGather          ? 1
                                  : AMODE == kACpAsyncWarp ? 4 + 1
                                  : AMODE == kAHybrid      ? 64 + 2
                                  : kCpAsync               ? kProducerThreads + 1
                                                           : (kRowTma ? WARPS : 1);

  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment (128B swizzle atoms) by an offset from smem_raw, so the compiler still
  // knows every derived pointer is shared memory.
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + kPipeBytes);
  uint64_t* empty_bar = full_bar + kStages;
  uint64_t* a_full_bar = empty_bar + kStages;  // v12: [2][kStages], one per consumer warpgroup
  int* tok_s = reinterpret_cast<int*>(a_full_bar + 2 * kStages);  // [kBM]
  int* tile_start = tok_s + kBM;                                  // [E + 1]

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;

  // ---- prologue: barriers and the tile prefix (from the device-side offsets; no host sync)
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_u32(full_bar + s), kFullCount);
      mbar_init(smem_u32(empty_bar + s), kConsumerWarps);
      mbar_init(smem_u32(a_full_bar + s), kProducerShare ? 128 + 64 : 128);
      mbar_init(smem_u32(a_full_bar + kStages + s), kProducerShare ? 128 + 64 : 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    if (!kCpAsync || AMODE == kAHybrid) prefetch_tensormap(&tmap_a);
    prefetch_tensormap(&tmap_b);
  }
  for (int e = tid; e < p.E; e += kThreads) {
    const int count = __ldg(p.offsets + e + 1) - __ldg(p.offsets + e);
    tile_start[e + 1] = ((count + kBM - 1) / kBM) * p.n_tiles;
  }
  __syncthreads();
  if (warp == 0) {  // inclusive prefix of tile_start[1..E] (common.cuh's warp_prefix_tiles)
    const int chunk = (p.E + 31) / 32;
    const int begin = min(p.E, lane * chunk), end = min(p.E, begin + chunk);
    int sum = 0;
    for (int i = begin; i < end; ++i) sum += tile_start[i + 1];
    int prefix = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, prefix, o);
      if (lane >= o) prefix += v;
    }
    int run = prefix - sum;
    for (int i = begin; i < end; ++i) {
      run += tile_start[i + 1];
      tile_start[i + 1] = run;
    }
    if (lane == 0) tile_start[0] = 0;
  }
  __syncthreads();
  const int total_tiles = tile_start[p.E];

  if (warp < 4) {
    // ================= producer warpgroup =================
    // v13's gathering producer warps need more than 40 registers (they spilled at 40): 56 / 224.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerShare ? 56 : 40)
                 : "memory");
    uint32_t it = 0;
    if constexpr (kConsumerGather) {
      // v13: producer warps 1, 2 gather rows [48, 64) of both halves of every k-step's A tile,
      // into the slot once its empty barrier completes (as the B boxes). Thread pt: chunk pt & 7
      // of the 32 rows (pt >> 3) + 8 i, i < 4: row q of those is row 48 + (q & 15) of half q >> 4.
      if (kProducerShare && (warp == 1 || warp == 2)) {
        const int pt = tid - 32;
        const int chunk = pt & 7;
        for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
          const TileCoord c = decode_tile(t, tile_start, p);
          int tok[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int q = (pt >> 3) + 8 * i;
            const int r = (q >> 4) * 64 + 48 + (q & 15);  // tile row
            tok[i] = r < c.rows ? __ldg(p.token_index + c.row0 + r) : -1;
          }
          for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
            const int s = it % kStages;
            mbar_wait(smem_u32(empty_bar + s), ((it / kStages) & 1) ^ 1);
            const uint32_t a_tile = smem_u32(smem + s * kStageBytes);
            const int k = kt * kBK + chunk * 8;
            const bool k_ok = k < p.K;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int q = (pt >> 3) + 8 * i;
              const int r = (q >> 4) * 64 + 48 + (q & 15);
              const bool ok = k_ok && tok[i] >= 0;
              const bf16* src = ok ? p.x + size_t(tok[i]) * p.K + k : p.x;
              cp_async16_zfill(a_tile + r * kRowBytes + ((chunk ^ (r & 7)) << 4), src, ok);
            }
            cp_async_mbar_arrive_noinc(smem_u32(a_full_bar + s));
            cp_async_mbar_arrive_noinc(smem_u32(a_full_bar + kStages + s));
          }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
      }
      // v12, v13: thread 0 issues the B boxes; the consumers gather (the rest of) A.
      if (tid == 0) {
        for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
          const TileCoord c = decode_tile(t, tile_start, p);
          for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
            const int s = it % kStages;
            mbar_wait(smem_u32(empty_bar + s), ((it / kStages) & 1) ^ 1);
            const uint32_t stage = smem_u32(smem + s * kStageBytes);
            const uint32_t full = smem_u32(full_bar + s);
            mbar_arrive_expect_tx(full, b_tile_bytes(c, p));
            load_b_tile(stage, &tmap_b, full, c, kt, p);
          }
        }
      }
    } else if constexpr (AMODE == kAContig) {
      // v1: thread 0 issues everything; the token ids are not needed.
      if (tid == 0) {
        for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
          const TileCoord c = decode_tile(t, tile_start, p);
          for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
            const int s = it % kStages;
            mbar_wait(smem_u32(empty_bar + s), ((it / kStages) & 1) ^ 1);
            const uint32_t stage = smem_u32(smem + s * kStageBytes);
            const uint32_t full = smem_u32(full_bar + s);
            mbar_arrive_expect_tx(full, kATileBytes + b_tile_bytes(c, p));
            load_b_tile(stage, &tmap_b, full, c, kt, p);
            tma_load_2d(stage, &tmap_a, full, kt * kBK, c.row0);
            tma_load_2d(stage + kContigBoxRows * kRowBytes, &tmap_a, full, kt * kBK,
                        c.row0 + kContigBoxRows);
          }
        }
      }
    } else if constexpr (AMODE == kARowTmaWarp) {
      // v5, v6: one TMA per row, each issuing warp converged on warp-uniform operands (row
      // counter, token id read from a uniform shared-memory address) and the instructions
      // predicated by elect.sync inside the asm. The issuing warps run their own tile loop (they
      // also stage the token ids) and the B boxes' condition is a predicate of the asm, not a
      // branch: nested in a loop that non-issuing warps also run, or under a C++ branch, the
      // same code compiles to one ELECT + R2UR of every operand per row instead of a few uniform
      // instructions (LDS, R2UR, USEL, UTMALDG). Warp w loads rows [w, w + 1) * 128 / WARPS.
      {
        // ptxas does not treat threadIdx.x >> 5 as warp-uniform: values derived from it would
        // live in regular registers. A shuffle from lane 0 makes the warp index provably uniform.
        const int warp_u = __shfl_sync(0xffffffffu, warp, 0);
        constexpr int kWarpRows = kBM / WARPS;
        const int r0 = warp_u * kWarpRows;
        // Non-issuing warps (v5: 1..3) run no tile: a trip count, not a branch (see above).
        const int t_first = warp_u < WARPS ? int(blockIdx.x) : total_tiles;
        for (int t = t_first; t < total_tiles; t += gridDim.x) {
          const TileCoord c = decode_tile(t, tile_start, p);
          asm volatile("bar.sync 1, %0;\n" ::"n"(32 * WARPS) : "memory");
#pragma unroll
          for (int j = 0; j < kBM / (32 * WARPS); ++j) {
            const int i = tid + 32 * WARPS * j;
            tok_s[i] = i < c.rows ? __ldg(p.token_index + c.row0 + i) : -1;
          }
          asm volatile("bar.sync 1, %0;\n" ::"n"(32 * WARPS) : "memory");
          const uint32_t b_bytes = b_tile_bytes(c, p);
          const bool second_box = c.n0 + kBBoxRows < p.N;
          for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
            const int s = it % kStages;
            mbar_wait(smem_u32(empty_bar + s), ((it / kStages) & 1) ^ 1);
            const uint32_t stage = smem_u32(smem + s * kStageBytes);
            const uint32_t full = smem_u32(full_bar + s);
            const int k0 = kt * kBK;
            mbar_arrive_expect_tx_elect(full, kWarpABytes + (warp_u == 0 ? b_bytes : 0u));
            tma_load_3d_elect(stage + kATileBytes, &tmap_b, full, k0, c.n0, c.e, warp_u == 0);
            tma_load_3d_elect(stage + kATileBytes + kBBoxBytes, &tmap_b, full, k0, c.n0 + kBBoxRows,
                              c.e, warp_u == 0 && second_box);
#pragma unroll 8
            for (int i = 0; i < kWarpRows; ++i) {
              const int r = r0 + i;
              const int v = tok_s[r];
              tma_load_2d_elect(stage + r * kRowBytes, &tmap_a, full, k0, v >= 0 ? v : p.tail_row);
            }
          }
        }
      }
    } else {
      for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        const TileCoord c = decode_tile(t, tile_start, p);
        // The tile's token ids go through shared memory (f1_gemm.cu); -1 marks rows past the count.
        __syncwarp();
        asm volatile("bar.sync 1, 128;\n" ::: "memory");  // previous tile's ids no longer read
        tok_s[tid] = tid < c.rows ? __ldg(p.token_index + c.row0 + tid) : -1;
        asm volatile("bar.sync 1, 128;\n" ::: "memory");
        if constexpr (AMODE == kAHybrid) {
          const bool tma_warp = warp < 2;
          int tok_row = 0;
          if (tma_warp) {
            const int v = tok_s[64 + tid];
            tok_row = v >= 0 ? v : p.tail_row;
          }
          const int ct = tid - 64;  // cp.async threads 0..63
          const int chunk = ct & 7, row_base = ct >> 3;
          for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
            const int s = it % kStages;
            mbar_wait(smem_u32(empty_bar + s), ((it / kStages) & 1) ^ 1);
            const uint32_t stage = smem_u32(smem + s * kStageBytes);
            const uint32_t full = smem_u32(full_bar + s);
            const int k0 = kt * kBK;
            if (tma_warp) {
              if (lane == 0)
                mbar_arrive_expect_tx(full, 32u * kRowBytes + (tid == 0 ? b_tile_bytes(c, p) : 0u));
              if (tid == 0) load_b_tile(stage, &tmap_b, full, c, kt, p);
              tma_load_2d(stage + (64 + tid) * kRowBytes, &tmap_a, full, k0, tok_row);
            } else {
              const int k = k0 + chunk * 8;
              const bool k_ok = k < p.K;
#pragma unroll
              for (int i = 0; i < 8; ++i) {
                const int r = row_base + 8 * i;
                const int tok = tok_s[r];
                const bool ok = k_ok && tok >= 0;
                const bf16* src = ok ? p.x + size_t(tok) * p.K + k : p.x;
                cp_async16_zfill(stage + r * kRowBytes + ((chunk ^ (r & 7)) << 4), src, ok);
              }
              cp_async_mbar_arrive_noinc(full);
            }
          }
        } else if constexpr (kCpAsync) {
          // v2: f1_gemm.cu's A path, unchanged (v7, v8, v9, v11: see AMode).
          const int chunk = tid & 7;  // 16-byte chunk of a 128-byte row slice
          const int row_base = tid >> 3;
          for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
            const int s = it % kStages;
            mbar_wait(smem_u32(empty_bar + s), ((it / kStages) & 1) ^ 1);
            const uint32_t stage = smem_u32(smem + s * kStageBytes);
            const uint32_t full = smem_u32(full_bar + s);
            if (tid == 0) {
              mbar_arrive_expect_tx(full, b_tile_bytes(c, p));
              load_b_tile(stage, &tmap_b, full, c, kt, p);
            }
            const int k = kt * kBK + chunk * 8;
            const bool k_ok = k < p.K;
#pragma unroll
            for (int i = 0; i < kBM / 16; ++i) {
              const int r = row_base + 16 * i;
              const int tok = tok_s[r];
              const bool ok = k_ok && tok >= 0;
              const bf16* src = ok ? p.x + size_t(tok) * p.K + k : p.x;
              if constexpr (AMODE == kACpAsyncL2)
                cp_async16_zfill_l2_256(stage + r * kRowBytes + ((chunk ^ (r & 7)) << 4), src, ok);
              else
                cp_async16_zfill(stage + r * kRowBytes + ((chunk ^ (r & 7)) << 4), src, ok);
            }
            if constexpr (AMODE == kACpAsyncWarp) {
              constexpr int kLag = WARPS;
              asm volatile("cp.async.commit_group;\n" ::: "memory");
              if (it >= uint32_t(kLag)) {
                asm volatile("cp.async.wait_group %0;\n" ::"n"(kLag) : "memory");
                fence_proxy_async();
                __syncwarp();
                if (lane == 0) mbar_arrive(smem_u32(full_bar + (it - kLag) % kStages));
              }
            } else {
              cp_async_mbar_arrive_noinc(full);
            }
          }
        } else if constexpr (AMODE == kARowTmaLanes) {
          // v3, v4: one TMA per row, each of the 32 * WARPS issuing lanes its own rows
          // (r = tid + 32 * WARPS * i). Rows past the count use p.tail_row (see the header).
          if (warp < WARPS) {
            int tok[kRowsPerLane];
#pragma unroll
            for (int i = 0; i < kRowsPerLane; ++i) {
              const int v = tok_s[tid + kIssueLanes * i];
              tok[i] = v >= 0 ? v : p.tail_row;
            }
            for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
              const int s = it % kStages;
              mbar_wait(smem_u32(empty_bar + s), ((it / kStages) & 1) ^ 1);
              const uint32_t stage = smem_u32(smem + s * kStageBytes);
              const uint32_t full = smem_u32(full_bar + s);
              // One arrival per issuing warp: its rows' bytes (+ B for warp 0). Another lane's row
              // may complete before this expect_tx (the tx-count goes transiently negative, as
              // with a peer CTA's multicast); the phase cannot complete before the arrival.
              if (lane == 0)
                mbar_arrive_expect_tx(full, kWarpABytes + (tid == 0 ? b_tile_bytes(c, p) : 0u));
              if (tid == 0) load_b_tile(stage, &tmap_b, full, c, kt, p);
              const int k0 = kt * kBK;
#pragma unroll
              for (int i = 0; i < kRowsPerLane; ++i) {
                const int r = tid + kIssueLanes * i;
                // Per-lane operands: ptxas issues this UTMALDG once per active lane (a loop of
                // ELECT, R2UR of every operand, UTMALDG, BRA.U.ANY).
                tma_load_2d(stage + r * kRowBytes, &tmap_a, full, k0, tok[i]);
              }
            }
          }
        }
      }
    }
    if constexpr (AMODE == kACpAsyncWarp) {
      // The last LAG stages: wait for all, fence, one arrival per warp each.
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      fence_proxy_async();
      __syncwarp();
      for (uint32_t j = it >= uint32_t(WARPS) ? it - WARPS : 0u; j < it; ++j)
        if (lane == 0) mbar_arrive(smem_u32(full_bar + j % kStages));
    } else if constexpr (kCpAsync) {
      asm volatile("cp.async.wait_all;\n" ::: "memory");
    }
  } else {
    // ================= consumer warpgroups =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kProducerShare ? 224 : 232)
                 : "memory");
    const int wg = (warp >> 2) - 1;   // 0 or 1: rows [64 wg, 64 wg + 64) of the tile
    const int warp_in_wg = warp & 3;  // rows [16 warp_in_wg, +16) of the warpgroup's 64
    const int cw = warp - 4;
    const int ct = tid - 128;  // 0..255
    const int g = lane >> 2, t4 = lane & 3;
    const int my_row = wg * 64 + warp_in_wg * 16 + g;  // tile row of registers 4j, 4j + 1
    const bool check = p.out != nullptr;
    const int k_tail_chunks = (p.K % kBK) / 8;  // valid 16-byte chunks of the last k-tile (0: all)
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    float fold = 0.f;
    uint32_t it = 0;
    // v12: this warpgroup's A gather, a cursor over the same (tile, k-tile) sequence as the main
    // loop, kStages - 1 iterations ahead. Thread wt of the warpgroup loads 16-byte chunk wt & 7 of
    // rows (wt >> 3) + 16 i, i < 4, of the warpgroup's 64.
    const int wt = tid & 127;
    const int g_chunk = wt & 7, g_row = wt >> 3;
    int g_t = blockIdx.x, g_kt = 0;
    int g_tok[4], g_next_tok[4];
    auto fetch_ids = [&](int t, int(&tok)[4]) {
      if (t < total_tiles) {
        const TileCoord c = decode_tile(t, tile_start, p);
#pragma unroll
        for (int i = 0; i < kConsumerRows / 16; ++i) {
          const int r = wg * 64 + g_row + 16 * i;
          tok[i] = r < c.rows ? __ldg(p.token_index + c.row0 + r) : -1;
        }
      }
    };
    // Issues the cursor's loads into `slot` (this warpgroup's half) and advances the cursor.
    auto gather_a = [&](int slot) {
      if (g_t >= total_tiles) return;
      const uint32_t half = smem_u32(smem + slot * kStageBytes) + wg * (kATileBytes / 2);
      const int k = g_kt * kBK + g_chunk * 8;
      const bool k_ok = k < p.K;
#pragma unroll
      for (int i = 0; i < kConsumerRows / 16; ++i) {
        const int r = g_row + 16 * i;  // row of the half; (r & 7) is the tile row's too
        const bool ok = k_ok && g_tok[i] >= 0;
        const bf16* src = ok ? p.x + size_t(g_tok[i]) * p.K + k : p.x;
        cp_async16_zfill(half + r * kRowBytes + ((g_chunk ^ (r & 7)) << 4), src, ok);
      }
      cp_async_mbar_arrive_noinc(smem_u32(a_full_bar + wg * kStages + slot));
      if (++g_kt == p.k_tiles) {
        g_kt = 0;
        g_t += gridDim.x;
#pragma unroll
        for (int i = 0; i < kConsumerRows / 16; ++i) g_tok[i] = g_next_tok[i];
        fetch_ids(g_t + gridDim.x, g_next_tok);
      }
    };
    if constexpr (kConsumerGather) {
      fetch_ids(g_t, g_tok);
      fetch_ids(g_t + gridDim.x, g_next_tok);
      for (int j = 0; j < kStages - 1; ++j) gather_a(j);
    }
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = decode_tile(t, tile_start, p);
      int prev_s = 0;
      for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(smem_u32(full_bar + s), (it / kStages) & 1);
        if constexpr (kConsumerGather)
          mbar_wait(smem_u32(a_full_bar + wg * kStages + s), (it / kStages) & 1);
        // v2: the A rows were written by cp.async (generic proxy); wgmma reads through the async
        // proxy. TMA-written tiles (v1, v3-v6) need no fence.
        if constexpr (kProxyFence) fence_proxy_async();
        const uint8_t* stage_ptr = smem + s * kStageBytes;
        const uint32_t stage = smem_u32(stage_ptr);
        if (check) {
          // Checked mode: 16-byte chunks of A that must be zero (rows past the count, except v1
          // whose contiguous boxes read the next expert's rows; columns past K, all versions).
          // Reads only: wgmma reads the same stage, nothing writes it until it is released.
          const int valid_chunks = (kt == p.k_tiles - 1 && k_tail_chunks != 0) ? k_tail_chunks : 8;
          int bad = 0;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            // 1024 chunks of the 128 x 128-byte tile; v12: the 512 of this warpgroup's half (the
            // other half may still be in flight).
            const int id = kConsumerGather ? wg * 512 + wt * 4 + i : ct * 4 + i;
            const int r = id >> 3, ch = id & 7;
            const bool must_be_zero = ch >= valid_chunks || (AMODE != kAContig && r >= c.rows);
            if (must_be_zero) {
              const uint4 v = *reinterpret_cast<const uint4*>(stage_ptr + r * kRowBytes +
                                                              ((ch ^ (r & 7)) << 4));
              bad += (v.x | v.y | v.z | v.w) != 0u;
            }
          }
          if (bad) atomicAdd(p.nonzero_chunks, (unsigned long long)bad);
        }
        const uint64_t desc_a = smem_desc_kmajor_sw128(stage + wg * (kATileBytes / 2));
        const uint64_t desc_b = smem_desc_kmajor_sw128(stage + kATileBytes);
        fence_accumulators(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          // +32 bytes per 16 k inside the swizzle row: +2 in the descriptor's address field.
          wgmma_m64n256k16<bf16, 0, 0>(acc, desc_a + 2 * kk, desc_b + 2 * kk,
                                       (kt > 0 || kk > 0) ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_accumulators(acc);
        if (kt > 0 && lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));
        // v12: wgmma(it - 1) has completed (wait_group 1): its slot, (it + kStages - 1) % kStages,
        // takes this warpgroup's A of iteration it + kStages - 1.
        if constexpr (kConsumerGather) gather_a((it + kStages - 1) % kStages);
        prev_s = s;
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));

      // ---- epilogue. Register 4j + q of lane (g, t4) holds tile row my_row (q < 2) or my_row + 8
      // (q >= 2), column n0 + 8j + 2 t4 + (q & 1).
      const bool row_ok0 = my_row < c.rows, row_ok1 = my_row + 8 < c.rows;
      if (check) {
        float* out0 = p.out + size_t(c.row0 + my_row) * p.N;
        float* out1 = out0 + size_t(8) * p.N;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int col = c.n0 + 8 * j + 2 * t4;
          if (col < p.N) {  // N % 8 == 0: a float2 is all in or all out
            if (row_ok0)
              *reinterpret_cast<float2*>(out0 + col) = make_float2(acc[4 * j], acc[4 * j + 1]);
            if (row_ok1)
              *reinterpret_cast<float2*>(out1 + col) = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
          }
        }
      }
      // Both modes: the valid rows' and columns' sum (4 partial sums: short dependency chains).
      float f[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const bool col_ok = c.n0 + 8 * j + 2 * t4 < p.N;
        const float v0 = acc[4 * j] + acc[4 * j + 1];
        const float v1 = acc[4 * j + 2] + acc[4 * j + 3];
        f[j & 3] += (col_ok && row_ok0 ? v0 : 0.f) + (col_ok && row_ok1 ? v1 : 0.f);
      }
      fold += (f[0] + f[1]) + (f[2] + f[3]);
    }
    if constexpr (kConsumerGather) asm volatile("cp.async.wait_all;\n" ::: "memory");
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) fold += __shfl_xor_sync(0xffffffffu, fold, o);
    if (lane == 0) p.fold[blockIdx.x * kConsumerWarps + cw] = fold;
  }
#else
  __trap();  // no sm_90a device pass (the #error above rejects any other device target)
#endif  // MB_SM90_DEVICE
}

// ---------------------------------------------------------------------------------------------
// reference, fill, gather, compare, checksum

constexpr int kRefTile = 64, kRefK = 16;

// C[r, n] = sum_k x[tok[r], k] * W[e(r), n, k] in fp32 (SIMT, 64 x 64 tiles, 4 x 4 per thread).
// A tile may straddle experts: it loops over the experts of its rows, zeroing other rows' x.
__global__ void __launch_bounds__(256)
    reference_kernel(const bf16* x, const int32_t* offsets, const int32_t* token_index,
                     const bf16* w, int M, int K, int N, int E, float* ref) {
  __shared__ float xs[kRefK][kRefTile + 4];
  __shared__ float ws[kRefK][kRefTile + 4];
  __shared__ int tok_s[kRefTile], exp_s[kRefTile];
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int row0 = blockIdx.y * kRefTile, n0 = blockIdx.x * kRefTile;
  if (tid < kRefTile) {
    const int r = row0 + tid;
    int e = -1;
    if (r < M) {  // largest e with offsets[e] <= r: the expert of row r (never an empty one)
      int lo = 0, hi = E - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (offsets[mid] <= r)
          lo = mid;
        else
          hi = mid - 1;
      }
      e = lo;
    }
    tok_s[tid] = r < M ? token_index[r] : 0;
    exp_s[tid] = e;
  }
  __syncthreads();
  float acc[4][4] = {};
  const int e_first = exp_s[0], e_last = exp_s[min(kRefTile, M - row0) - 1];
  for (int e = e_first; e <= e_last; ++e) {
    for (int k0 = 0; k0 < K; k0 += kRefK) {
      for (int i = tid; i < kRefK * kRefTile; i += 256) {
        const int rr = i / kRefK, kk = i % kRefK;
        const int k = k0 + kk;
        const bool ok = exp_s[rr] == e && k < K;
        xs[kk][rr] = ok ? __bfloat162float(x[size_t(tok_s[rr]) * K + k]) : 0.f;
        const int n = n0 + rr;
        ws[kk][rr] = (n < N && k < K) ? __bfloat162float(w[(size_t(e) * N + n) * K + k]) : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kRefK; ++kk) {
        float xv[4], wv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[i] = xs[kk][ty * 4 + i];
#pragma unroll
        for (int j = 0; j < 4; ++j) wv[j] = ws[kk][tx * 4 + j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(xv[i], wv[j], acc[i][j]);
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = row0 + ty * 4 + i, n = n0 + tx * 4 + j;
      if (r < M && n < N) ref[size_t(r) * N + n] = acc[i][j];
    }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_normal_bf16(bf16* out, size_t n, uint64_t seed, float stddev) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(seed * 0x100000001b3ull + i);
    const float u1 = (float((r >> 40) & 0xffffff) + 0.5f) * (1.f / 16777216.f);
    const float u2 = float((r >> 16) & 0xffffff) * (1.f / 16777216.f);
    const float z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    out[i] = __float2bfloat16_rn(z * stddev);
  }
}

// xg[r] = x[tok[r]] (v1's contiguous A and cuBLAS's dense A), 16 bytes at a time (K % 8 == 0).
__global__ void gather_rows(const bf16* x, const int32_t* token_index, int M, int K, bf16* xg) {
  const int chunks = K / 8;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(M) * chunks;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / chunks, ch = i % chunks;
    reinterpret_cast<uint4*>(xg + r * K)[ch] =
        reinterpret_cast<const uint4*>(x + size_t(token_index[r]) * K)[ch];
  }
}

struct CompareResult {
  unsigned long long nonfinite;  // NaN poison: counts unwritten elements too
  unsigned long long mismatches;
  double err2, ref2;
  float max_abs;
};

__global__ void compare_kernel(const float* got, const float* ref, size_t count,
                               CompareResult* res) {
  double e2 = 0, r2 = 0;
  unsigned long long nf = 0, mm = 0;
  float mx = 0.f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const float g = got[i], r = ref[i];
    if (!isfinite(g)) {
      ++nf;
      continue;
    }
    const float diff = fabsf(g - r);
    if (!(diff <= 1e-3f + 1e-3f * fabsf(r))) ++mm;  // fp32 sums in another order: ~1e-6
    e2 += double(diff) * diff;
    r2 += double(r) * r;
    mx = fmaxf(mx, diff);
  }
  atomicAdd(&res->nonfinite, nf);
  atomicAdd(&res->mismatches, mm);
  atomicAdd(&res->err2, e2);
  atomicAdd(&res->ref2, r2);
  atomicMax(reinterpret_cast<int*>(&res->max_abs), __float_as_int(mx));  // mx >= 0
}

__global__ void checksum_kernel(const uint32_t* words, size_t n, unsigned long long* out) {
  unsigned long long s = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    s += (unsigned long long)(words[i]) * (2 * (i & 0xffff) + 1);
  atomicAdd(out, s);
}

// ---------------------------------------------------------------------------------------------
// host: tensor maps (common.cuh's encoder through the runtime's entry-point query)

// The library's encoder lookup (primitives.cuh), required here.
static EncodeTiledFn get_encoder() {
  const EncodeTiledFn fn = tensor_map_encoder();
  REQUIRE(fn != nullptr, "cuTensorMapEncodeTiled not found");
  return fn;
}

// A bf16 tensor of RANK dims (dim 0 contiguous, byte strides of dims 1..), 128B swizzle, L2_256B
// promotion (the library's), out-of-bounds elements read as zeros.
template <int RANK>
static CUtensorMap encode_map(const void* base, const cuuint64_t (&dims)[RANK],
                              const cuuint64_t (&byte_strides)[RANK - 1],
                              const cuuint32_t (&box)[RANK], const char* what) {
  CUtensorMap map;
  memset(&map, 0, sizeof(map));
  cuuint32_t elem[RANK];
  for (int i = 0; i < RANK; ++i) elem[i] = 1;
  REQUIRE(box[0] * 2 <= 128, "%s: box inner dimension %u bytes > the 128-byte swizzle span", what,
          box[0] * 2);
  const CUresult r = get_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, RANK, const_cast<void*>(base), dims, byte_strides,
      box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  REQUIRE(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed for %s (%d)", what, int(r));
  return map;
}

// ---------------------------------------------------------------------------------------------
// problems

struct Shape {
  const char* name;
  int T, K, N, E, k;
};

static const Shape kShapes[] = {
    {"edge", 777, 200, 264, 5, 2},  // K % 64 = 8, N % 256 = 8, T odd, partial tiles, empty expert
    {"conf3", 65536, 1024, 8192, 16, 4},  // gate|up of h = 4096
    {"mixtral", 16384, 4096, 28672, 8, 2},
    {"qwen", 32768, 2048, 1536, 128, 8},
};

// Uneven routing (the f1 workshops'): expert weights 1..5 cyclically, expert 1 gets no tokens;
// each token picks k distinct experts. Rows are grouped by expert, tokens ascending inside one.
static void make_routing(const Shape& s, uint64_t seed, std::vector<int32_t>& offsets,
                         std::vector<int32_t>& tokens) {
  std::mt19937_64 rng(seed);
  std::vector<double> weight(s.E);
  for (int e = 0; e < s.E; ++e) weight[e] = 1.0 + (e * 7 % 5);
  if (s.E > s.k + 1) weight[1] = 0.0;  // an empty expert
  std::vector<std::vector<int32_t>> rows(s.E);
  std::vector<double> w(s.E);
  for (int t = 0; t < s.T; ++t) {
    w = weight;
    for (int j = 0; j < s.k; ++j) {
      double total = 0;
      for (double v : w) total += v;
      double r = std::uniform_real_distribution<double>(0, total)(rng);
      int e = 0;
      for (; e < s.E - 1; ++e) {
        if (w[e] > 0 && r < w[e]) break;
        r -= w[e];
      }
      while (w[e] == 0) e = (e + s.E - 1) % s.E;  // rounding at the end of the range
      rows[e].push_back(t);
      w[e] = 0;
    }
  }
  offsets.assign(s.E + 1, 0);
  tokens.clear();
  for (int e = 0; e < s.E; ++e) {
    offsets[e + 1] = offsets[e] + int(rows[e].size());
    tokens.insert(tokens.end(), rows[e].begin(), rows[e].end());
  }
}

static int g_num_sms = 0;

struct Problem {
  int T, K, N, E, k, M;
  bf16* x;   // [T + 1, K], row T zeros
  bf16* xg;  // [M, K] = x[tok[r]] (v1, cuBLAS)
  bf16* w;   // [E, N, K]
  int32_t *offsets, *token_index;
  std::vector<int32_t> h_offsets, h_tokens;
  CUtensorMap map_b, map_xg, map_xrow;
  int tail_row;
  int grid;
  float* fold;                         // [grid * 8]
  unsigned long long* nonzero_chunks;  // [1]
};

static void fill(bf16* p, size_t n, uint64_t seed, float stddev) {
  fill_normal_bf16<<<4 * g_num_sms, 256>>>(p, n, seed, stddev);
  CUDA_CHECK(cudaGetLastError());
}

static Problem make_problem(const Shape& s, uint64_t seed, bool tail_zero_row) {
  Problem P;
  P.T = s.T;
  P.K = s.K;
  P.N = s.N;
  P.E = s.E;
  P.k = s.k;
  P.M = s.T * s.k;
  make_routing(s, seed, P.h_offsets, P.h_tokens);
  CUDA_CHECK(cudaMalloc(&P.x, size_t(P.T + 1) * P.K * 2));
  CUDA_CHECK(cudaMalloc(&P.xg, size_t(P.M) * P.K * 2));
  CUDA_CHECK(cudaMalloc(&P.w, size_t(P.E) * P.N * P.K * 2));
  CUDA_CHECK(cudaMalloc(&P.offsets, sizeof(int32_t) * (P.E + 1)));
  CUDA_CHECK(cudaMalloc(&P.token_index, sizeof(int32_t) * P.M));
  fill(P.x, size_t(P.T) * P.K, seed * 3 + 1, 1.f);
  CUDA_CHECK(cudaMemset(P.x + size_t(P.T) * P.K, 0, size_t(P.K) * 2));  // the zero row T
  fill(P.w, size_t(P.E) * P.N * P.K, seed * 3 + 2, 1.f / std::sqrt(float(P.K)));
  CUDA_CHECK(cudaMemcpy(P.offsets, P.h_offsets.data(), sizeof(int32_t) * (P.E + 1),
                        cudaMemcpyHostToDevice));
  CUDA_CHECK(
      cudaMemcpy(P.token_index, P.h_tokens.data(), sizeof(int32_t) * P.M, cudaMemcpyHostToDevice));
  gather_rows<<<4 * g_num_sms, 256>>>(P.x, P.token_index, P.M, P.K, P.xg);
  CUDA_CHECK(cudaGetLastError());

  const cuuint64_t K = P.K, N = P.N, E = P.E;
  P.map_b = encode_map<3>(P.w, {K, N, E}, {K * 2, N * K * 2}, {kBK, kBBoxRows, 1}, "W");
  P.map_xg = encode_map<2>(P.xg, {K, cuuint64_t(P.M)}, {K * 2}, {kBK, kContigBoxRows}, "xg");
  // Row TMA: rows past an expert's count use coordinate T: out of bounds of {K, T} (zero-filled),
  // or, with --tail zero, the zero row T inside {K, T + 1}.
  P.tail_row = P.T;
  P.map_xrow = encode_map<2>(P.x, {K, cuuint64_t(P.T + (tail_zero_row ? 1 : 0))}, {K * 2}, {kBK, 1},
                             "x rows");

  const int n_tiles = (P.N + kBN - 1) / kBN;
  const long long max_tiles = (P.M / kBM + P.E) * (long long)n_tiles;
  P.grid = int(std::min<long long>(g_num_sms, max_tiles));
  CUDA_CHECK(cudaMalloc(&P.fold, sizeof(float) * P.grid * kConsumerWarps));
  CUDA_CHECK(cudaMalloc(&P.nonzero_chunks, sizeof(unsigned long long)));
  return P;
}

static void free_problem(Problem& P) {
  cudaFree(P.x);
  cudaFree(P.xg);
  cudaFree(P.w);
  cudaFree(P.offsets);
  cudaFree(P.token_index);
  cudaFree(P.fold);
  cudaFree(P.nonzero_chunks);
}

// ---------------------------------------------------------------------------------------------
// versions and launch

constexpr int kNumVersions = 13;
static const char* kVersionNames[kNumVersions + 1] = {
    "",
    "contiguous A, TMA {64,64} boxes",
    "gathered A, cp.async 16 B (library)",
    "gathered A, row TMA, 32 lanes x 4 rows",
    "gathered A, row TMA, 128 lanes x 1 row",
    "gathered A, row TMA, 1 warp-uniform x 128",
    "gathered A, row TMA, 4 warp-uniform x 32",
    "v2 w/o consumer fence (measure)",
    "cp.async, warp arrive, lag 2",
    "cp.async, warp arrive, lag 3",
    "hybrid: 64 rows cp.async + 64 row TMA",
    "cp.async with .L2::256B prefetch",
    "consumers gather their own 64 rows",
    "consumers 48 rows + 2 producer warps 16",
};

typedef void (*KernelFn)(const CUtensorMap, const CUtensorMap, const ProbeParams);

static KernelFn kernel_for(int version) {
  switch (version) {
    case 1: return probe_kernel<kAContig, 1>;
    case 2: return probe_kernel<kACpAsync, 4>;
    case 3: return probe_kernel<kARowTmaLanes, 1>;
    case 4: return probe_kernel<kARowTmaLanes, 4>;
    case 5: return probe_kernel<kARowTmaWarp, 1>;
    case 6: return probe_kernel<kARowTmaWarp, 4>;
    case 7: return probe_kernel<kACpAsyncNoFence, 4>;
    case 8: return probe_kernel<kACpAsyncWarp, 2>;
    case 9: return probe_kernel<kACpAsyncWarp, 3>;
    case 10: return probe_kernel<kAHybrid, 4>;
    case 11: return probe_kernel<kACpAsyncL2, 4>;
    case 12: return probe_kernel<kAConsumerGather, 4>;
    case 13: return probe_kernel<kAConsumerPlusProducer, 4>;
  }
  return nullptr;
}

// out == nullptr: timed mode (fold only); else checked mode (C stored, zero-fill counted).
static void launch(int version, const Problem& P, float* out, cudaStream_t stream) {
  ProbeParams p;
  p.x = P.x;
  p.offsets = P.offsets;
  p.token_index = P.token_index;
  p.out = out;
  p.fold = P.fold;
  p.nonzero_chunks = P.nonzero_chunks;
  p.K = P.K;
  p.N = P.N;
  p.E = P.E;
  p.tail_row = P.tail_row;
  p.n_tiles = (P.N + kBN - 1) / kBN;
  p.k_tiles = (P.K + kBK - 1) / kBK;
  const CUtensorMap& map_a =
      version == 1 ? P.map_xg
                   : ((version == 2 || (version >= 7 && version != 10)) ? P.map_b : P.map_xrow);
  kernel_for(version)<<<P.grid, kThreads, probe_smem_bytes(P.E), stream>>>(map_a, P.map_b, p);
  CUDA_CHECK(cudaGetLastError());
}

static double fold_sum(const Problem& P) {
  std::vector<float> h(size_t(P.grid) * kConsumerWarps);
  CUDA_CHECK(cudaMemcpy(h.data(), P.fold, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double s = 0;
  for (float v : h) s += v;
  return s;
}

static unsigned long long checksum(const float* c, size_t count) {
  unsigned long long* d_sum;
  CUDA_CHECK(cudaMalloc(&d_sum, sizeof(unsigned long long)));
  CUDA_CHECK(cudaMemset(d_sum, 0, sizeof(unsigned long long)));
  checksum_kernel<<<4 * g_num_sms, 256>>>(reinterpret_cast<const uint32_t*>(c), count, d_sum);
  CUDA_CHECK(cudaGetLastError());
  unsigned long long s;
  CUDA_CHECK(cudaMemcpy(&s, d_sum, sizeof(s), cudaMemcpyDeviceToHost));
  cudaFree(d_sum);
  return s;
}

// ---------------------------------------------------------------------------------------------
// checks

// One version on one problem in checked mode: C vs the reference (NaN poison first), the A tile's
// must-be-zero chunks, and a bitwise-identical rerun.
static bool check_version(int version, const Shape& s, const Problem& P, float* out,
                          const float* ref) {
  const size_t count = size_t(P.M) * P.N;
  CUDA_CHECK(cudaMemset(out, 0xFF, count * 4));  // NaN
  CUDA_CHECK(cudaMemset(P.nonzero_chunks, 0, sizeof(unsigned long long)));
  launch(version, P, out, 0);
  CUDA_CHECK(cudaDeviceSynchronize());

  CompareResult* d_res;
  CUDA_CHECK(cudaMalloc(&d_res, sizeof(CompareResult)));
  CUDA_CHECK(cudaMemset(d_res, 0, sizeof(CompareResult)));
  compare_kernel<<<8 * g_num_sms, 256>>>(out, ref, count, d_res);
  CUDA_CHECK(cudaGetLastError());
  CompareResult res;
  CUDA_CHECK(cudaMemcpy(&res, d_res, sizeof(res), cudaMemcpyDeviceToHost));
  cudaFree(d_res);
  unsigned long long nonzero = 0;
  CUDA_CHECK(cudaMemcpy(&nonzero, P.nonzero_chunks, sizeof(nonzero), cudaMemcpyDeviceToHost));
  const double rel = std::sqrt(res.err2 / std::max(res.ref2, 1e-300));
  const bool values_ok = res.nonfinite == 0 && res.mismatches == 0 && rel < 1e-4;

  const unsigned long long c1 = checksum(out, count);
  CUDA_CHECK(cudaMemset(out, 0xFF, count * 4));
  launch(version, P, out, 0);
  CUDA_CHECK(cudaDeviceSynchronize());
  const unsigned long long c2 = checksum(out, count);

  const bool ok = values_ok && nonzero == 0 && c1 == c2;
  printf(
      "  [%s v%d] rel_l2 %.3e  max_abs %.3e  mismatches %llu  non-finite/unwritten %llu  "
      "nonzero must-be-zero A chunks %llu  rerun %s  %s\n",
      s.name, version, rel, res.max_abs, res.mismatches, res.nonfinite, nonzero,
      c1 == c2 ? "identical" : "DIFFERENT", ok ? "CHECK PASSED" : "CHECK FAILED");
  return ok;
}

// ---------------------------------------------------------------------------------------------
// timing: warm-up, then the median of 20 runs, each after an L2 flush (outside the timed region)

template <typename F>
static float median_ms(F&& run, void* flush_buf, size_t flush_bytes) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) run();
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    CUDA_CHECK(cudaMemsetAsync(flush_buf, i & 0xff, flush_bytes));
    CUDA_CHECK(cudaEventRecord(e0));
    run();
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float t;
    CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  CUDA_CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 0.5f * (ms[9] + ms[10]);
}

struct TimingRow {
  std::string shape;
  int version;  // 0: cuBLAS dense
  double gflop, ms, ms_v1;
  bool fold_ok;
};

int main(int argc, char** argv) {
  bool check_only = false;
  bool tail_zero_row = false;
  std::string only;
  std::vector<int> versions = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  uint64_t seed = 20261130;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--check-only")) {
      check_only = true;
    } else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
      only = argv[++i];
    } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
      seed = strtoull(argv[++i], nullptr, 10);
    } else if (!strcmp(argv[i], "--tail") && i + 1 < argc) {
      const std::string m = argv[++i];
      REQUIRE(m == "oob" || m == "zero", "--tail oob|zero");
      tail_zero_row = m == "zero";
    } else if (!strcmp(argv[i], "--versions") && i + 1 < argc) {
      versions.clear();
      for (const char* c = argv[++i]; *c;) {  // comma-separated version numbers
        char* end = nullptr;
        const long v = strtol(c, &end, 10);
        if (end == c) {
          ++c;
          continue;
        }
        if (v >= 1 && v <= kNumVersions) versions.push_back(int(v));
        c = end;
      }
    } else {
      fprintf(stderr,
              "usage: %s [--check-only] [--shape edge|conf3|mixtral|qwen] [--versions 1,2,3,4,5,6]"
              " [--tail oob|zero] [--seed N]\n",
              argv[0]);
      return 2;
    }
  }
  REQUIRE(!versions.empty(), "no version selected");
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  g_num_sms = prop.multiProcessorCount;
  printf("device: %s, %d SMs, L2 %d MB, smem/block opt-in %zu B, seed %llu, tail rows: %s\n",
         prop.name, g_num_sms, prop.l2CacheSize >> 20, prop.sharedMemPerBlockOptin,
         (unsigned long long)seed,
         tail_zero_row ? "zero row T of x (in bounds)" : "row coordinate T (out of bounds)");
  REQUIRE(prop.major == 9, "this probe needs sm_90a (Hopper)");
  REQUIRE(probe_smem_bytes(kMaxExperts) <= prop.sharedMemPerBlockOptin, "shared memory");
  for (int v = 1; v <= kNumVersions; ++v)
    CUDA_CHECK(cudaFuncSetAttribute(kernel_for(v), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(probe_smem_bytes(kMaxExperts))));

  const size_t flush_bytes = size_t(std::max(prop.l2CacheSize, 1 << 20)) * 4;
  void* flush_buf;
  CUDA_CHECK(cudaMalloc(&flush_buf, flush_bytes));
#ifdef WITH_CUBLAS
  cublasHandle_t blas;
  REQUIRE(cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
#endif

  bool all_ok = true;
  int shapes_run = 0;
  std::vector<TimingRow> table;
  for (const Shape& s : kShapes) {
    if (!only.empty() && only != s.name) continue;
    ++shapes_run;
    REQUIRE(s.K % 8 == 0 && s.N % 8 == 0 && s.E <= kMaxExperts && s.T * s.k >= 1,
            "unsupported shape %s", s.name);
    const bool is_edge = !strcmp(s.name, "edge");
    const bool do_check = check_only || is_edge;
    const bool do_time = !check_only && !is_edge;
    const uint64_t shape_seed = seed + std::hash<std::string>()(s.name) % 1000;
    Problem P = make_problem(s, shape_seed, tail_zero_row);
    {
      int mn = 1 << 30, mx = 0, empty = 0, partial = 0;
      for (int e = 0; e < s.E; ++e) {
        const int c = P.h_offsets[e + 1] - P.h_offsets[e];
        mn = std::min(mn, c);
        mx = std::max(mx, c);
        empty += c == 0;
        partial += c % kBM != 0;
      }
      printf(
          "shape %s: T=%d K=%d N=%d E=%d k=%d M=%d; rows per expert min %d max %d, empty %d, "
          "experts with a partial last tile %d; grid %d CTAs, %zu B smem\n",
          s.name, s.T, s.K, s.N, s.E, s.k, P.M, mn, mx, empty, partial, P.grid,
          probe_smem_bytes(s.E));
    }
    if (do_check) {
      const size_t count = size_t(P.M) * P.N;
      float *out, *ref;
      CUDA_CHECK(cudaMalloc(&out, count * 4));
      CUDA_CHECK(cudaMalloc(&ref, count * 4));
      const dim3 rgrid((P.N + kRefTile - 1) / kRefTile, (P.M + kRefTile - 1) / kRefTile);
      reference_kernel<<<rgrid, 256>>>(P.x, P.offsets, P.token_index, P.w, P.M, P.K, P.N, P.E, ref);
      CUDA_CHECK(cudaGetLastError());
      CUDA_CHECK(cudaDeviceSynchronize());
      for (int v : versions) all_ok = check_version(v, s, P, out, ref) && all_ok;
      cudaFree(out);
      cudaFree(ref);
    }
    if (do_time) {
      const double gflop = 2.0 * P.M * double(P.K) * P.N * 1e-9;
      double ms_v1 = 0, fold_first = 0;
      bool have_first = false;
      for (int v : versions) {
        const float ms = median_ms([&] { launch(v, P, nullptr, 0); }, flush_buf, flush_bytes);
        // The last run's fold (all runs of a version give the same one).
        const double f = fold_sum(P);
        if (!have_first) {
          fold_first = f;
          have_first = true;
        }
        const bool fold_ok =
            std::isfinite(f) && std::fabs(f - fold_first) <= 1e-6 * std::max(1.0, std::fabs(f));
        all_ok = all_ok && fold_ok;
        if (v == 1) ms_v1 = ms;
        table.push_back({s.name, v, gflop, ms, 0.0, fold_ok});
        printf("  [%s v%d] %.3f ms = %.1f TFLOP/s  fold %.9e %s\n", s.name, v, ms, gflop / ms, f,
               fold_ok ? "ok" : "CHECKSUM MISMATCH vs the first version");
      }
#ifdef WITH_CUBLAS
      {  // dense GEMM with the same FLOPs: xg [M, K] . W[0]^T [K, N] -> [M, N] bf16, fp32 acc
        bf16* dense_c;
        CUDA_CHECK(cudaMalloc(&dense_c, size_t(P.M) * P.N * 2));
        const float alpha = 1.f, beta = 0.f;
        auto run = [&] {
          const cublasStatus_t st =
              cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, P.N, P.M, P.K, &alpha, P.w, CUDA_R_16BF,
                           P.K, P.xg, CUDA_R_16BF, P.K, &beta, dense_c, CUDA_R_16BF, P.N,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          REQUIRE(st == CUBLAS_STATUS_SUCCESS, "cublasGemmEx %d", int(st));
        };
        const float ms = median_ms(run, flush_buf, flush_bytes);
        table.push_back({s.name, 0, gflop, ms, 0.0, true});
        printf("  [%s] cuBLAS dense same-FLOP GEMM %.3f ms = %.1f TFLOP/s\n", s.name, ms,
               gflop / ms);
        cudaFree(dense_c);
      }
#endif
      for (TimingRow& r : table)
        if (r.shape == s.name) r.ms_v1 = ms_v1;
    }
    free_problem(P);
  }
  REQUIRE(shapes_run > 0, "no shape named %s", only.c_str());

  printf("%s\n", all_ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
  if (!table.empty()) {
    printf("\nGATHER PROBE (main loop only; TFLOP/s = 2 M K N / time; vs v1 = v1 ms / ms)\n");
    printf("%-8s %-3s %-38s %9s %8s %6s %s\n", "shape", "v", "A operand", "ms", "TFLOP/s", "vs v1",
           "fold");
    for (const TimingRow& r : table) {
      const char* name = r.version == 0 ? "cuBLAS dense (same FLOPs)" : kVersionNames[r.version];
      char vs[16] = "-";
      if (r.ms_v1 > 0) snprintf(vs, sizeof(vs), "%.2f", r.ms_v1 / r.ms);
      printf("%-8s %-3s %-38s %9.3f %8.1f %6s %s\n", r.shape.c_str(),
             r.version == 0 ? "-" : std::to_string(r.version).c_str(), name, r.ms, r.gflop / r.ms,
             vs, r.version == 0 ? "-" : (r.fold_ok ? "ok" : "MISMATCH"));
    }
  }
#ifdef WITH_CUBLAS
  cublasDestroy(blas);
#endif
  cudaFree(flush_buf);
  return all_ok ? 0 : 1;
}
