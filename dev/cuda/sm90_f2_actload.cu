// Kernel workshop round 9: F2 (forward second GEMM of an MoE layer, y2_r = u_r . w_down[e]^T,
// fp32 rows [N, d], K = h) on Hopper (sm_90a) with u FORMED ON LOAD from the saved a|b block
// instead of read from the transient [N, h] u buffer that F1 writes today (2 GiB on conf3, the
// forward's memory peak).
//
// Build (from the repository root; no -lcuda: the tensor-map encoder comes from the driver through
// the runtime's entry-point query; -I include -I src for the library's activation formula):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v -I include \
//     -I src -o /tmp/f2a dev/cuda/sm90_f2_actload.cu -lcublas
// Without cuBLAS (the dense column of the table is then 0): add -DNO_CUBLAS, drop -lcublas.
// The one device call: bash dev/cuda/run_sm90_f2_actload.sh.
//
// Run:
//   ./f2a                       # check every shape and version, then the timing table
//   ./f2a --check-only          # checks only
//   ./f2a --shape conf3         # one shape (edge | tiny | conf3 | mixtral | qwen)
//   ./f2a --seed 7
//   ./f2a --versions 1,2        # kernel versions to check and time (default 1..6; v1 is always
//                               # checked: it is the bitwise reference of the others)
//
// ---- the problem ----
// For expert e and routed rows r in [off[e], off[e+1]) (rows of an expert are contiguous):
//   a|b [N, 2h] bf16 (F1's saved pre-activations, row r = a_r | b_r),
//   u_r = act(a_r, b_r) = round_bf16( (a * sigmoid(a)) * b ),  sigmoid(a) = __fdividef(1, 1 +
//         __expf(-a)), in fp32 from the bf16 a, b: the library's act_math::forward(SwiGLU, a, b)
//         (src/common/activation_math.hpp, included here, not copied), rounded once (RNE) with
//         __floats2bfloat162_rn exactly as F1's epilogue (src/cuda/sm90/f1_gemm.cu) packs it;
//   y2_r = u_r . w_down[e]^T, w_down [E, d, h] bf16, fp32 accumulate, fp32 rows [N, d] out.
//
// ---- versions ----
// All versions: persistent grid (min(#SMs, #tiles) CTAs, one per SM), tile 128 routed rows x 256
// output columns x 64 k, the library's tile decode (prefix of per-expert tile counts in shared
// memory, binary search, bands of 8 m-tiles swept by the n-tiles), B = w_down by TMA as two
// K-major boxes {64 k, 128 n} (a box starting past d is neither issued nor expected), 384 threads
// = 3 warpgroups, two consumer warpgroups of 64 rows each issuing wgmma m64n256k16 (128 fp32
// accumulators per thread), the wgmma batch of k-step kt left in flight (wait_group 1) while
// k-step kt+1 is prepared, fp32 rows stored straight from registers, rows past the expert's count
// masked (they are read: a ragged last m-tile reads the next expert's rows; rows of a GEMM are
// independent). Every version issues the same wgmmas in the same k-order on the same operand bits
// as v1, so its fp32 output must be BITWISE v1's (checked).
//   v1: TODAY'S F2: src/cuda/sm90/rows_gemm.cu's sm90_rows_kernel<bf16, KIND 0> (copied, bf16
//       only): A = u [N, h] by TMA (3-D map {h, 1, N}, box {64, 1, 128}); warpgroup 0 produces
//       (one thread issues A + B), 1 and 2 consume; setmaxnreg 40 / 232; 4 stages of 48 KB.
//   v2: u FORMED ON LOAD BY THE CONSUMERS (f2_onload_kernel<AB 3, B 3>). Producer warpgroup
//       (setmaxnreg 40): thread 0 TMA-loads the a-tile and the b-tile of a k-step (3-D map
//       {h, 2, N} of the a|b block, box {64 k, 1, 128 rows}: a at {k0, 0, row0}, b at {k0, 1,
//       row0}; k past h and rows past N are zero-filled inside each half) into an "ab" ring;
//       thread 32 loads w_down into a separate "B" ring. Each consumer warpgroup (setmaxnreg 232),
//       for k-step kt: waits ab_full, converts ITS 64 rows x 64 k (4 x 16-byte chunks per thread,
//       all 8 loads before any store) into its own u buffer kt & 1 (8 KB). TMA wrote a and b in
//       the SW128 K-major layout the wgmma A operand needs, so u[off] = act(a[off], b[off]) at the
//       SAME byte offset: no index arithmetic, conflict-free LDS.128 / STS.128. Then
//       fence.proxy.async.shared::cta (generic-proxy stores -> wgmma's async-proxy reads), one
//       ab_empty arrival per warp, bar.sync of the warpgroup's 128 threads (its wgmma reads all
//       64 rows), wait B_full, 4 wgmmas, commit, wait_group 1 (k-step kt-1 done), release kt-1's B
//       slot. So the transform of kt overlaps the in-flight wgmma of kt-1, and u buffer kt & 1
//       was last read by kt-2's wgmma, complete by then. The transform is act_math::forward as
//       written: ~13 SASS instructions per element, 2 of them MUFU (EX2, RCP).
//   v3: u formed on load by a DEDICATED TRANSFORM WARPGROUP (f2_xform_kernel<AB 3, U 2, B 3>).
//       The brief's 4-warpgroup form (512 threads, setmaxnreg to rebalance) cannot be compiled:
//       ptxas allocates for the launch bound, 65536 / 512 = 128 registers for EVERY thread
//       (setmaxnreg.inc does not raise it), and the consumer's 128 accumulators + descriptors
//       need >= 154 (ptxas C7602). So warpgroup 0 (setmaxnreg 64) is the transform warpgroup and
//       also issues every load from its thread 0: the ab ring needs no empty barrier (its only
//       reader is this warpgroup: a named barrier of its 128 threads, then thread 0 reloads the
//       slot with k-step kt + 3), and B(kt + 1) is issued right after the u_empty wait of k-step
//       kt (its slot frees with wgmma(kt - 2), which that wait already implies: no stall, no
//       deadlock). It converts the whole 128 x 64 tile (8 chunks per thread, 2 in flight) into a
//       u ring of 2 x 16 KB (u_full: 128 arrivals, each after that thread's proxy fence; u_empty:
//       one arrival per consumer warp once its wgmma on the slot completed). The consumers
//       (setmaxnreg 224) run v1's loop on the u ring + B ring. Still 4 transform warps, one per
//       SM sub-partition, so the same 4 MUFU units as v2.
//   v4: v2 with the ab / B rings resized to 2 / 4 stages (probe of the ring split).
//   v5: v2 with the LEAN transform: the same bits in ~9 SASS instructions per element instead of
//       ~13 (bf16 -> float by bit placement; exp(-a) as ex2.approx.ftz instead of __expf's non-ftz
//       ex2, whose denormal-range fix-up (FSETP + 2 predicated FMUL) cannot change the sigmoid:
//       see lean_swiglu). Proven equal to act_math::forward for all 65536 bf16 a at start-up.
//   v6: v3 with the lean transform.
//   Reference: f2_reference_kernel, a SIMT fp32 GEMM (64 x 64 tiles, one expert per block) of the
//   F1-style u (f1_style_u_kernel: act_math::forward over a|b, packed as F1 does) with w_down;
//   itself spot-checked against an fp64 CPU GEMM on sampled rows.
//
// ---- shared-memory budget (227 KB = 232448 B opt-in per block) ----
//   The brief's fused stage (u 16 + a,b staging 32 + B 32 = 80 KB) fits only 2 stages (3 x 80 =
//   240 KB > 227 KB). But the parts have different lifetimes: a, b are dead once transformed
//   (early in the k-step), B and u live until the wgmma completes (a k-step later), and u is
//   produced and consumed by the same warpgroup. So v2 splits them: ab ring 3 x 32 KB + B ring
//   3 x 32 KB + u 2 warpgroups x 2 buffers x 8 KB = 96 + 96 + 32 = 224 KB; with the barriers, the
//   tile prefix (E <= 256) and 1 KB of alignment slack: 231524 <= 232448 B. Why 3 / 3: a 4th
//   slot of either ring does not fit (256 KB). Prefetch lead: v1's 4 fused stages keep ~3 k-steps
//   of loads in flight; v2's ab ring (slot freed right after the transform) ~2.5, its B ring ~2
//   (slot freed one k-step after use). v4 = 2 / 4 tests the other split (ab ~1.5, B ~3).
//   v3 / v6: ab 3 x 32 + u 2 x 16 + B 3 x 32 = 224 KB. v1: 4 x 48 = 192 KB.
//
// ---- expected result (a prediction; per CTA = per SM, per 128 x 256 x 64 k-step) ----
//   Tensor time: 2 x 128 x 256 x 64 = 4.19 MFLOP / 4096 FLOP/clk/SM = 1024 clk at peak; v1 at
//   ~720 TFLOP/s takes ~1400 clk.
//   Transform: 8192 elements x 2 MUFU / 16 MUFU per clk per SM = 1024 clk: MUFU must be busy 73 %
//   of v1's k-step (the formula must be bitwise the library's, so no cheaper sigmoid exists).
//   Issue slots per sub-partition: v2 ~840 (13 instr x 2048 elements / 32 lanes), v5 ~580, of
//   ~1400. L2 -> SM: 64 KB per k-step (a 16 + b 16 + B 32) against v1's 48 KB (+33 %; at v1's
//   speed that is ~11 TB/s over 132 SMs, likely past the L2's limit); shared memory: TMA 64 KB +
//   transform 48 KB + wgmma reads 80 KB = 192 KB per k-step vs v1's 128 KB.
//   So: v2 / v1 time 1.10 - 1.35 (most likely ~1.2: L2 bytes and MUFU both near their limits),
//   about the same ratio on every shape (the transform is redone for each of the d / 256 n-tiles,
//   so its cost per FLOP does not depend on the shape; qwen's short K = 768 (12 k-steps per tile)
//   exposes the per-tile pipeline fill more, in v1 too); v5 0 - 10 % faster than v2 (fewer issue
//   slots, same MUFU and bytes); v3 / v6 within +-10 % of v2 / v5; v4 within a few % of v2.
//   "Within 10 % of v1" needs MUFU, L2 and issue to overlap almost perfectly: possible for v5,
//   not expected. If the L2 bytes are the limit, the next step is a 2-CTA cluster multicasting
//   w_down (B 16 KB per CTA per k-step: 48 KB in all, v1's bytes).
//
// ---- what a reviewer with a GPU should check first ----
//   1. edge and tiny, every version "CHECK PASSED": the lean transform's exhaustive check; the u
//      dumped from the on-load transform BITWISE equal to f1_style_u_kernel's u on every element
//      (and 0 nonzero u in the zero-filled k tail, h = 328: k 328..383, and in rows past N); the
//      outputs BITWISE equal to v1's. A bitwise output mismatch with a matching u dump means the
//      wgmma operand or order differs (descriptor, buffer parity, barrier), not the formula.
//   2. conf3 (the main benchmark shape) v2 / v1 and v5 / v1 against the prediction; if far worse,
//      profile (ncu) v5 vs v1: MUFU (sm__inst_executed_pipe_xu), L2 (lts__t_sectors / throughput)
//      and shared-memory wavefronts; v6 vs v5 says whether the consumers' issue slots or the MUFU
//      pipe is the limit, v4 vs v2 whether the B ring's lead is.
//   3. ptxas (run script): no spills, no C7510 (wgmma serialisation) warning.
//
// Preconditions (host-checked): d % 8 == 0, h % 8 == 0, E <= kMaxExperts (256), 16-byte aligned
// pointers (cudaMalloc).

#include <cuda.h>  // CUtensorMap and the encoder's signature only; no libcuda link
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#ifndef NO_CUBLAS
#include <cublas_v2.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/activation_math.hpp"  // act_math::forward: the library's activation formula

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
using moeblaze::Activation;

// ---------------------------------------------------------------------------------------------
// constants and shared-memory layouts

constexpr int kBM = 128;          // routed rows per tile
constexpr int kBN = 256;          // output columns per tile
constexpr int kBK = 64;           // k per stage: one 128-byte swizzle row of bf16
constexpr int kBandMTiles = 8;    // rasterisation: n-tiles sweep a band of 8 m-tiles
constexpr int kMaxExperts = 256;  // the tile prefix lives in shared memory next to 224 KB of rings
constexpr int kSmemOptin = 232448;

constexpr int kATileBytes = kBM * kBK * 2;       // 16 KB: a 128-row A (u, a or b) tile
constexpr int kHalfTileBytes = kATileBytes / 2;  // 8 KB: one consumer warpgroup's 64 rows
constexpr int kBTileBytes = kBN * kBK * 2;       // 32 KB
constexpr int kBBoxRows = 128;                   // K-major B: two boxes of 128 rows of n
constexpr int kBBoxBytes = kBBoxRows * kBK * 2;  // 16 KB
constexpr int kAbBytes = 2 * kATileBytes;        // 32 KB: a tile then b tile
constexpr uint32_t kAbTx = uint32_t(kAbBytes);   // expect_tx of an ab slot (OOB fill included)
constexpr uint32_t kPollLimit = 1u << 24;        // mbarrier watchdog: ~1 s, then __trap()
constexpr Activation kAct = Activation::SwiGLU;

// v1 (the library's F2): 4 stages of A 16 KB + B 32 KB.
constexpr int kV1Stages = 4;
constexpr int kV1StageBytes = kATileBytes + kBTileBytes;
constexpr size_t v1_smem_bytes(int E) {
  return 1024 /* alignment slack */ + size_t(kV1Stages) * kV1StageBytes + 2 * kV1Stages * 8 +
         sizeof(int) * size_t(E + 1);
}
// v2 / v4: ab ring + B ring + 2 warpgroups x 2 u buffers of 8 KB.
constexpr size_t v2_smem_bytes(int ab_stages, int b_stages, int E) {
  return 1024 + size_t(ab_stages) * kAbBytes + size_t(b_stages) * kBTileBytes + 4 * kHalfTileBytes +
         2 * (ab_stages + b_stages) * 8 + sizeof(int) * size_t(E + 1);
}
// v3: ab ring + u ring (16 KB slots) + B ring; barriers ab_full, u_full/empty, b_full/empty.
constexpr size_t v3_smem_bytes(int ab_stages, int u_stages, int b_stages, int E) {
  return 1024 + size_t(ab_stages) * kAbBytes + size_t(u_stages) * kATileBytes +
         size_t(b_stages) * kBTileBytes + (ab_stages + 2 * u_stages + 2 * b_stages) * 8 +
         sizeof(int) * size_t(E + 1);
}
constexpr int kV2Ab = 3, kV2B = 3;            // v2
constexpr int kV4Ab = 2, kV4B = 4;            // v4
constexpr int kV3Ab = 3, kV3U = 2, kV3B = 3;  // v3
static_assert(v1_smem_bytes(kMaxExperts) <= kSmemOptin, "v1 shared memory");
static_assert(v2_smem_bytes(kV2Ab, kV2B, kMaxExperts) <= kSmemOptin, "v2 shared memory");
static_assert(v2_smem_bytes(kV4Ab, kV4B, kMaxExperts) <= kSmemOptin, "v4 shared memory");
static_assert(v3_smem_bytes(kV3Ab, kV3U, kV3B, kMaxExperts) <= kSmemOptin, "v3 shared memory");

// v3 register split (setmaxnreg): transform(+load) warpgroup / consumers, within 65536.
constexpr int kV3XformRegs = 64, kV3ConsumerRegs = 224;
static_assert(128 * (kV3XformRegs + 2 * kV3ConsumerRegs) <= 65536, "v3 register split");

struct F2Params {
  const int32_t* offsets;  // [E + 1]
  float* out;              // [N, d] fp32 rows
  bf16* u_dump;            // DUMP variants: [N, h], the u the transform formed
  unsigned* tail_nonzero;  // DUMP variants: nonzero u words in zero-filled k / rows past N
  int d;                   // output columns (n)
  int h;                   // K
  int E;
  int N;
  int n_tiles;  // ceil(d / kBN)
  int k_tiles;  // ceil(h / kBK)
};

struct TileCoord {
  int e, row0, rows, n0;
};

// ---------------------------------------------------------------------------------------------
// device helpers (common.cuh's, with a ~1 s watchdog)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Spins until the phase with `parity` completes. A wait far beyond any real stall (2^24 polls: a
// second or more; real waits are microseconds) traps ("unspecified launch failure") instead of
// hanging the device. No printf here: a call anywhere in a kernel makes ptxas serialise its
// wgmmas (C7510).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  uint32_t polls = 0;
  do {
    if (++polls == kPollLimit) __trap();
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Raises the barrier's expected transaction bytes without arriving (the arrival comes later).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Orders this thread's generic-proxy shared-memory accesses (plain stores) with later async-proxy
// ones (wgmma operand reads, TMA writes) to the same shared memory.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

template <int ID>
__device__ __forceinline__ void named_bar_sync_128() {
  asm volatile("bar.sync %0, 128;\n" ::"n"(ID) : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across the asynchronous wgmma window.
__device__ __forceinline__ void fence_accumulators(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor: K-major operand, 128B swizzle, rows of 128 bytes (64 bf16),
// 8-row groups 1024 bytes apart (SBO); LBO is unused for swizzled K-major layouts (set to 1).
// The tile base must be 1024-byte aligned; stepping k by 16 elements adds 32 bytes to the start.
__device__ __forceinline__ uint64_t smem_desc_kmajor_sw128(uint32_t addr) {
  uint64_t desc = 0;
  desc |= uint64_t((addr & 0x3FFFF) >> 4);
  desc |= uint64_t(1) << 16;          // LBO (ignored)
  desc |= uint64_t(1024 >> 4) << 32;  // SBO
  desc |= uint64_t(1) << 62;          // SWIZZLE_128B
  return desc;
}

// D[64x256] (+)= A[64x16] * B[256x16]^T, both K-major in 128B-swizzled shared memory.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "
      "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, "
      "%125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// One k-step of a consumer warpgroup: 4 x m64n256k16 over A (64 rows at a_addr) and B (256 rows
// at b_addr), both K-major SW128, committed as one group. Identical in every version, so the
// fp32 results are identical when the operands are.
__device__ __forceinline__ void wgmma_kstep(float (&acc)[128], uint32_t a_addr, uint32_t b_addr,
                                            bool first) {
  const uint64_t desc_a = smem_desc_kmajor_sw128(a_addr);
  const uint64_t desc_b = smem_desc_kmajor_sw128(b_addr);
  fence_accumulators(acc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk)  // +32 bytes per 16 k inside the swizzle row (both)
    wgmma_m64n256k16(acc, desc_a + 2 * kk, desc_b + 2 * kk, (!first || kk > 0) ? 1 : 0);
  wgmma_commit();
}

// ---- activation: the library's formula, packed as F1's epilogue packs it ----

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (lower address)
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float2 unpack_bf16x2(uint32_t bits) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}

// Two adjacent u from two adjacent (a, b): u = round_bf16(act_math::forward(SwiGLU, a, b)).
__device__ __forceinline__ uint32_t act_pair(uint32_t a2, uint32_t b2) {
  const float2 a = unpack_bf16x2(a2), b = unpack_bf16x2(b2);
  return pack_bf16x2(moeblaze::act_math::forward(kAct, a.x, b.x),
                     moeblaze::act_math::forward(kAct, a.y, b.y));
}

__device__ __forceinline__ uint4 act_chunk(const uint4& a, const uint4& b) {
  return make_uint4(act_pair(a.x, b.x), act_pair(a.y, b.y), act_pair(a.z, b.z), act_pair(a.w, b.w));
}

// LEAN: the same bits in fewer instructions (~9 instead of ~13 SASS per element, loads, stores and
// packing included):
//  - bf16 -> float by bit placement (w << 16, w & 0xffff0000: exact, what the intrinsic does,
//    without its PRMT + shift for the high half);
//  - exp(-a) as ex2.approx.FTZ.f32(a * -log2e): __expf is ex2.approx.f32 (no ftz) of the same
//    product (log2e = 0x1.715476p+0f as in libdevice), and the non-ftz form adds FSETP + 2
//    predicated FMUL per element to handle results below 2^-126. Those results only occur for
//    a > 87.3, where the ftz form returns 0 and the non-ftz one a denormal d; 1 + d == 1 + 0 == 1
//    in round-to-nearest, so the sigmoid (MUFU.RCP of 1 + e, unchanged) is bitwise the same.
//    Checked exhaustively at start-up for all 65536 bf16 values of a (lean_equivalence_kernel).
__device__ __forceinline__ float lean_swiglu(float a, float b) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(a * -0x1.715476p+0f));
  const float s = __fdividef(1.f, 1.f + e);  // act_math::sigmoid's division
  return (a * s) * b;                        // silu(a) * b, in act_math's order
}

__device__ __forceinline__ uint32_t lean_act_pair(uint32_t a2, uint32_t b2) {
  const float a0 = __uint_as_float(a2 << 16), a1 = __uint_as_float(a2 & 0xffff0000u);
  const float b0 = __uint_as_float(b2 << 16), b1 = __uint_as_float(b2 & 0xffff0000u);
  return pack_bf16x2(lean_swiglu(a0, b0), lean_swiglu(a1, b1));
}

template <bool LEAN>
__device__ __forceinline__ uint4 transform_chunk(const uint4& a, const uint4& b) {
  if constexpr (LEAN) {
    return make_uint4(lean_act_pair(a.x, b.x), lean_act_pair(a.y, b.y), lean_act_pair(a.z, b.z),
                      lean_act_pair(a.w, b.w));
  } else {
    return act_chunk(a, b);
  }
}

// DUMP variants only: the 16-byte chunk `idx` of a 128-row SW128 tile (row = idx / 8, physical
// chunk idx % 8, logical chunk = physical ^ (row & 7), the inverse of the TMA swizzle) written to
// u_dump when it is a valid (row, k) of the tile's expert; in the zero-filled region (k >= h or
// row >= N) it must be zero (counted otherwise). Only the n-tile-0 CTA of an m-tile dumps.
__device__ __forceinline__ void dump_chunk(const F2Params& p, const TileCoord& c, int k0,
                                           int tile_row, int phys_chunk, const uint4& u) {
  if (c.n0 != 0) return;
  const int k = k0 + 8 * (phys_chunk ^ (tile_row & 7));
  const int grow = c.row0 + tile_row;
  if (k >= p.h || grow >= p.N) {
    if ((u.x | u.y | u.z | u.w) != 0u) atomicAdd(p.tail_nonzero, 1u);
  } else if (tile_row < c.rows) {  // h % 8 == 0: a chunk is all in or all out
    *reinterpret_cast<uint4*>(p.u_dump + size_t(grow) * p.h + k) = u;
  }
}

// ---- tile schedule (rows_gemm.cu's) ----

// tile_start[e] = first linear tile id of expert e (prefix of ceil(count_e / kBM) * n_tiles).
__device__ __forceinline__ TileCoord decode_tile(int t, const int* tile_start, const F2Params& p) {
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

// The inclusive prefix of tile_start[1..E] in place (tile_start[0] = 0), by warp 0 of the block.
__device__ __forceinline__ void warp_prefix_tiles(int* tile_start, int E, int lane) {
  const int chunk = (E + 31) / 32;
  const int begin = min(E, lane * chunk), end = min(E, begin + chunk);
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

// Builds the tile prefix (after the caller initialised its barriers) and returns the tile count.
__device__ __forceinline__ int build_tile_start(int* tile_start, const F2Params& p) {
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) {
    const int count = __ldg(p.offsets + e + 1) - __ldg(p.offsets + e);
    tile_start[e + 1] = ((count + kBM - 1) / kBM) * p.n_tiles;
  }
  __syncthreads();
  if (threadIdx.x < 32) warp_prefix_tiles(tile_start, p.E, threadIdx.x);
  __syncthreads();
  return tile_start[p.E];
}

// B boxes (128 rows of n each) that start before d: the others are neither issued nor expected
// (their accumulator columns are never stored).
__device__ __forceinline__ int b_boxes(const TileCoord& c, const F2Params& p) {
  return min(kBN / kBBoxRows, (p.d - c.n0 + kBBoxRows - 1) / kBBoxRows);
}

// Issues the w_down boxes of one k-step (K-major: {k, n, e}).
__device__ __forceinline__ void load_b(const CUtensorMap* map, uint32_t dst, uint32_t full,
                                       const TileCoord& c, int k0, int boxes) {
  mbar_arrive_expect_tx(full, uint32_t(boxes) * kBBoxBytes);
  for (int i = 0; i < boxes; ++i)
    tma_load_3d(dst + i * kBBoxBytes, map, full, k0, c.n0 + kBBoxRows * i, c.e);
}

// The fp32 rows of one consumer warp (16 rows) straight from the accumulators: register 4j + q
// of lane (g, t4) holds row g (q < 2) or g + 8 (q >= 2), column 8j + 2 t4 + (q & 1).
__device__ __forceinline__ void store_rows(const F2Params& p, const TileCoord& c, int tile_row,
                                           int g, int t4, const float (&acc)[128]) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = tile_row + g + 8 * rr;
    if (row < c.rows) {
      float* orow = p.out + size_t(c.row0 + row) * p.d + c.n0 + 2 * t4;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        if (c.n0 + 8 * j < p.d)  // d % 8 == 0: a pair is all in or all out
          *reinterpret_cast<float2*>(orow + 8 * j) =
              make_float2(acc[4 * j + 2 * rr], acc[4 * j + 2 * rr + 1]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// v1: today's F2 (rows_gemm.cu, KIND 0, bf16): A = u by TMA

__global__ void __launch_bounds__(384, 1)
    f2_v1_kernel(const __grid_constant__ CUtensorMap tmap_u,
                 const __grid_constant__ CUtensorMap tmap_w, const F2Params p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + kV1Stages * kV1StageBytes);
  uint64_t* empty_bar = full_bar + kV1Stages;
  int* tile_start = reinterpret_cast<int*>(empty_bar + kV1Stages);  // [E + 1]

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < kV1Stages; ++s) {
      mbar_init(smem_u32(full_bar + s), 1);
      mbar_init(smem_u32(empty_bar + s), 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  const int total_tiles = build_tile_start(tile_start, p);

  if (warp < 4) {
    // ================= producer warpgroup =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid != 0) return;  // one thread issues everything
    uint32_t it = 0;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = decode_tile(t, tile_start, p);
      const int boxes = b_boxes(c, p);
      for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
        const int s = it % kV1Stages;
        const int k0 = kt * kBK;
        mbar_wait(smem_u32(empty_bar + s), ((it / kV1Stages) & 1) ^ 1);
        const uint32_t stage = smem_u32(smem + s * kV1StageBytes);
        const uint32_t full = smem_u32(full_bar + s);
        // One arrival (count 1) carries the whole stage's bytes: A here, the B boxes in load_b.
        mbar_expect_tx(full, uint32_t(kATileBytes));
        tma_load_3d(stage, &tmap_u, full, k0, 0, c.row0);
        load_b(&tmap_w, stage + kATileBytes, full, c, k0, boxes);
      }
    }
  } else {
    // ================= consumer warpgroups =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int wg = (warp >> 2) - 1;   // rows [64 wg, 64 wg + 64) of the tile
    const int warp_in_wg = warp & 3;  // rows [16 warp_in_wg, +16) of those
    const int g = lane >> 2, t4 = lane & 3;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    uint32_t it = 0;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = decode_tile(t, tile_start, p);
      int prev_s = 0;
      for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
        const int s = it % kV1Stages;
        mbar_wait(smem_u32(full_bar + s), (it / kV1Stages) & 1);
        const uint32_t stage = smem_u32(smem + s * kV1StageBytes);
        wgmma_kstep(acc, stage + wg * kHalfTileBytes, stage + kATileBytes, kt == 0);
        wgmma_wait<1>();
        fence_accumulators(acc);
        if (kt > 0 && lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));
        prev_s = s;
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));
      store_rows(p, c, wg * 64 + warp_in_wg * 16, g, t4, acc);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Producers of the on-load versions (v2, v3, v4): one thread each for the ab ring and the B ring.

template <int AB_STAGES>
__device__ __forceinline__ void produce_ab(const CUtensorMap* map, uint8_t* ab_ring,
                                           uint64_t* ab_full, uint64_t* ab_empty,
                                           const int* tile_start, int total_tiles,
                                           const F2Params& p) {
  uint32_t it = 0;
  for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const TileCoord c = decode_tile(t, tile_start, p);
    for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
      const int s = it % AB_STAGES;
      mbar_wait(smem_u32(ab_empty + s), ((it / AB_STAGES) & 1) ^ 1);
      const uint32_t dst = smem_u32(ab_ring + s * kAbBytes);
      const uint32_t full = smem_u32(ab_full + s);
      mbar_arrive_expect_tx(full, kAbTx);
      tma_load_3d(dst, map, full, kt * kBK, 0, c.row0);                // a: half 0
      tma_load_3d(dst + kATileBytes, map, full, kt * kBK, 1, c.row0);  // b: half 1
    }
  }
}

template <int B_STAGES>
__device__ __forceinline__ void produce_b(const CUtensorMap* map, uint8_t* b_ring, uint64_t* b_full,
                                          uint64_t* b_empty, const int* tile_start, int total_tiles,
                                          const F2Params& p) {
  uint32_t it = 0;
  for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const TileCoord c = decode_tile(t, tile_start, p);
    const int boxes = b_boxes(c, p);
    for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
      const int s = it % B_STAGES;
      mbar_wait(smem_u32(b_empty + s), ((it / B_STAGES) & 1) ^ 1);
      load_b(map, smem_u32(b_ring + s * kBTileBytes), smem_u32(b_full + s), c, kt * kBK, boxes);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// v2 / v4: u formed on load by the consumer warpgroups

template <int AB_STAGES, int B_STAGES, bool LEAN, bool DUMP>
__global__ void __launch_bounds__(384, 1)
    f2_onload_kernel(const __grid_constant__ CUtensorMap tmap_ab,
                     const __grid_constant__ CUtensorMap tmap_w, const F2Params p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* ab_ring = smem;                            // AB_STAGES x (a 16 KB | b 16 KB)
  uint8_t* b_ring = ab_ring + AB_STAGES * kAbBytes;   // B_STAGES x 32 KB
  uint8_t* u_bufs = b_ring + B_STAGES * kBTileBytes;  // [wg][kt & 1] x 8 KB
  uint64_t* ab_full = reinterpret_cast<uint64_t*>(u_bufs + 4 * kHalfTileBytes);
  uint64_t* ab_empty = ab_full + AB_STAGES;
  uint64_t* b_full = ab_empty + AB_STAGES;
  uint64_t* b_empty = b_full + B_STAGES;
  int* tile_start = reinterpret_cast<int*>(b_empty + B_STAGES);  // [E + 1]

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < AB_STAGES; ++s) {
      mbar_init(smem_u32(ab_full + s), 1);   // the producer's expect_tx arrival
      mbar_init(smem_u32(ab_empty + s), 8);  // one arrival per consumer warp, after its transform
    }
    for (int s = 0; s < B_STAGES; ++s) {
      mbar_init(smem_u32(b_full + s), 1);
      mbar_init(smem_u32(b_empty + s), 8);  // one arrival per consumer warp, after its wgmma
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  const int total_tiles = build_tile_start(tile_start, p);

  if (warp < 4) {
    // ================= producer warpgroup: thread 0 the ab ring, thread 32 the B ring =========
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid == 0)
      produce_ab<AB_STAGES>(&tmap_ab, ab_ring, ab_full, ab_empty, tile_start, total_tiles, p);
    else if (tid == 32)
      produce_b<B_STAGES>(&tmap_w, b_ring, b_full, b_empty, tile_start, total_tiles, p);
  } else {
    // ================= consumer warpgroups: transform, then wgmma =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int wg = (warp >> 2) - 1;   // rows [64 wg, 64 wg + 64) of the tile
    const int wt = tid & 127;         // thread in the warpgroup
    const int warp_in_wg = warp & 3;  // rows [16 warp_in_wg, +16) of those
    const int g = lane >> 2, t4 = lane & 3;
    uint8_t* my_u = u_bufs + wg * 2 * kHalfTileBytes;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    uint32_t it = 0;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = decode_tile(t, tile_start, p);
      int prev_s = 0;
      for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
        const int sa = it % AB_STAGES, sb = it % B_STAGES;
        uint8_t* ubuf = my_u + (it & 1) * kHalfTileBytes;
        // --- transform (overlaps the wgmma of k-step kt-1, still in flight) ---
        mbar_wait(smem_u32(ab_full + sa), (it / AB_STAGES) & 1);
        {
          const uint4* a4 =
              reinterpret_cast<const uint4*>(ab_ring + sa * kAbBytes + wg * kHalfTileBytes);
          const uint4* b4 = reinterpret_cast<const uint4*>(ab_ring + sa * kAbBytes + kATileBytes +
                                                           wg * kHalfTileBytes);
          uint4* u4 = reinterpret_cast<uint4*>(ubuf);
          uint4 ra[4], rb[4];  // all loads first: the u stores could alias them for the compiler
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            ra[i] = a4[i * 128 + wt];
            rb[i] = b4[i * 128 + wt];
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int idx = i * 128 + wt;  // chunk in the warpgroup's 8 KB (row idx / 8)
            const uint4 u = transform_chunk<LEAN>(ra[i], rb[i]);
            u4[idx] = u;
            if (DUMP) dump_chunk(p, c, kt * kBK, wg * 64 + (idx >> 3), idx & 7, u);
          }
        }
        fence_proxy_async();  // this thread's u stores -> the warpgroup's wgmma (async proxy)
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_u32(ab_empty + sa));  // a, b of this warp read
        if (wg == 0)  // every u row of the warpgroup written and fenced (immediate barrier ids)
          named_bar_sync_128<1>();
        else
          named_bar_sync_128<2>();
        // --- wgmma of k-step kt ---
        mbar_wait(smem_u32(b_full + sb), (it / B_STAGES) & 1);
        wgmma_kstep(acc, smem_u32(ubuf), smem_u32(b_ring + sb * kBTileBytes), kt == 0);
        wgmma_wait<1>();  // k-step kt-1 done: its B slot and u buffer (it-1) & 1 are free
        fence_accumulators(acc);
        if (kt > 0 && lane == 0) mbar_arrive(smem_u32(b_empty + prev_s));
        prev_s = sb;
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (lane == 0) mbar_arrive(smem_u32(b_empty + prev_s));
      store_rows(p, c, wg * 64 + warp_in_wg * 16, g, t4, acc);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// v3: u formed on load by a dedicated transform warpgroup (warpgroup 0, which also issues the
// loads from its thread 0); consumers 1, 2 run v1's loop over the u ring.

// The (tile, k-step) stream of this CTA, walked ahead of the transform by thread 0's loads.
struct Cursor {
  int t, kt;
  uint32_t i;  // position in the stream (ring slot i % STAGES, phase i / STAGES)
  TileCoord c;
};

__device__ __forceinline__ void cursor_start(Cursor& q, const int* tile_start, int total_tiles,
                                             const F2Params& p) {
  q.t = blockIdx.x;
  q.kt = 0;
  q.i = 0;
  if (q.t < total_tiles) q.c = decode_tile(q.t, tile_start, p);
}

__device__ __forceinline__ void cursor_next(Cursor& q, const int* tile_start, int total_tiles,
                                            const F2Params& p) {
  ++q.i;
  if (++q.kt == p.k_tiles) {
    q.kt = 0;
    q.t += gridDim.x;
    if (q.t < total_tiles) q.c = decode_tile(q.t, tile_start, p);
  }
}

template <int AB_STAGES, int U_STAGES, int B_STAGES, bool LEAN, bool DUMP>
__global__ void __launch_bounds__(384, 1)
    f2_xform_kernel(const __grid_constant__ CUtensorMap tmap_ab,
                    const __grid_constant__ CUtensorMap tmap_w, const F2Params p) {
  // B(j + kLead) is loaded during the transform of k-step j. Its slot frees when wgmma(j + kLead -
  // B_STAGES) = wgmma(j - U_STAGES) completes: exactly what the u_empty wait of the same
  // iteration waits for, so thread 0's b_empty wait adds no dependency (no deadlock, no stall).
  constexpr int kLead = B_STAGES - U_STAGES;
  static_assert(kLead >= 1, "the B ring must be deeper than the u ring");
  // The consumers free u slot j only after issuing wgmma(j + 1) (wait_group 1), so the transform
  // must be able to write u(j + 1) while slot j is still held: at least 2 u slots.
  static_assert(U_STAGES >= 2, "u ring of at least 2 slots");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* ab_ring = smem;                            // AB_STAGES x (a 16 KB | b 16 KB)
  uint8_t* u_ring = ab_ring + AB_STAGES * kAbBytes;   // U_STAGES x 16 KB
  uint8_t* b_ring = u_ring + U_STAGES * kATileBytes;  // B_STAGES x 32 KB
  uint64_t* ab_full = reinterpret_cast<uint64_t*>(b_ring + B_STAGES * kBTileBytes);
  uint64_t* u_full = ab_full + AB_STAGES;
  uint64_t* u_empty = u_full + U_STAGES;
  uint64_t* b_full = u_empty + U_STAGES;
  uint64_t* b_empty = b_full + B_STAGES;
  int* tile_start = reinterpret_cast<int*>(b_empty + B_STAGES);  // [E + 1]

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    // No ab_empty: the transform warpgroup is the ab ring's only reader; a named barrier of its
    // 128 threads frees a slot, then its thread 0 reloads it.
    for (int s = 0; s < AB_STAGES; ++s) mbar_init(smem_u32(ab_full + s), 1);
    for (int s = 0; s < U_STAGES; ++s) {
      mbar_init(smem_u32(u_full + s), 128);  // every transform thread, after its proxy fence
      mbar_init(smem_u32(u_empty + s), 8);   // one arrival per consumer warp, after its wgmma
    }
    for (int s = 0; s < B_STAGES; ++s) {
      mbar_init(smem_u32(b_full + s), 1);
      mbar_init(smem_u32(b_empty + s), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  build_tile_start(tile_start, p);
  // Re-read by each role after its setmaxnreg (not kept live across it: the 64-register
  // transform role of the DUMP variant spilled it).
  const volatile int* total_s = tile_start + p.E;

  if (warp < 4) {
    // ================= transform warpgroup: ab ring -> u ring (+ all loads) =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kV3XformRegs) : "memory");
    const int total_tiles = *total_s;
    Cursor qa = {}, qb = {};  // thread 0 only: the next ab and B loads
    auto load_ab = [&] {
      const int s = qa.i % AB_STAGES;
      const uint32_t dst = smem_u32(ab_ring + s * kAbBytes);
      const uint32_t full = smem_u32(ab_full + s);
      mbar_arrive_expect_tx(full, kAbTx);
      tma_load_3d(dst, &tmap_ab, full, qa.kt * kBK, 0, qa.c.row0);
      tma_load_3d(dst + kATileBytes, &tmap_ab, full, qa.kt * kBK, 1, qa.c.row0);
      cursor_next(qa, tile_start, total_tiles, p);
    };
    auto load_b_next = [&] {
      const int s = qb.i % B_STAGES;
      mbar_wait(smem_u32(b_empty + s), ((qb.i / B_STAGES) & 1) ^ 1);
      load_b(&tmap_w, smem_u32(b_ring + s * kBTileBytes), smem_u32(b_full + s), qb.c, qb.kt * kBK,
             b_boxes(qb.c, p));
      cursor_next(qb, tile_start, total_tiles, p);
    };
    if (tid == 0) {
      cursor_start(qa, tile_start, total_tiles, p);
      cursor_start(qb, tile_start, total_tiles, p);
      for (int j = 0; j < AB_STAGES && qa.t < total_tiles; ++j) load_ab();
      for (int j = 0; j < kLead && qb.t < total_tiles; ++j) load_b_next();
    }
    const int xt = tid;  // 0..127
    uint32_t it = 0;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = decode_tile(t, tile_start, p);
      for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
        const int sa = it % AB_STAGES, su = it % U_STAGES;
        mbar_wait(smem_u32(u_empty + su), ((it / U_STAGES) & 1) ^ 1);
        if (tid == 0 && qb.t < total_tiles) load_b_next();  // B(it + kLead): see kLead
        mbar_wait(smem_u32(ab_full + sa), (it / AB_STAGES) & 1);
        const uint4* a4 = reinterpret_cast<const uint4*>(ab_ring + sa * kAbBytes);
        const uint4* b4 = reinterpret_cast<const uint4*>(ab_ring + sa * kAbBytes + kATileBytes);
        uint4* u4 = reinterpret_cast<uint4*>(u_ring + su * kATileBytes);
        // 8 chunks per thread, 2 in flight (64 registers). The DUMP variant is not unrolled: its
        // dump addresses, hoisted for all 8 chunks, spilled.
        constexpr int kGroup = 2, kUnroll = DUMP ? 1 : 8 / kGroup;
#pragma unroll kUnroll
        for (int i0 = 0; i0 < 8; i0 += kGroup) {
          uint4 ra[kGroup], rb[kGroup];
#pragma unroll
          for (int i = 0; i < kGroup; ++i) {
            ra[i] = a4[(i0 + i) * 128 + xt];
            rb[i] = b4[(i0 + i) * 128 + xt];
          }
#pragma unroll
          for (int i = 0; i < kGroup; ++i) {
            const int idx = (i0 + i) * 128 + xt;  // chunk of the 16 KB tile (row idx / 8)
            const uint4 u = transform_chunk<LEAN>(ra[i], rb[i]);
            u4[idx] = u;
            if (DUMP) dump_chunk(p, c, kt * kBK, idx >> 3, idx & 7, u);
          }
        }
        fence_proxy_async();  // this thread's u stores -> the consumers' wgmma (async proxy)
        mbar_arrive(smem_u32(u_full + su));
        named_bar_sync_128<1>();  // every transform thread has read ab slot sa
        if (tid == 0 && qa.t < total_tiles) load_ab();  // ab(it + AB_STAGES) into slot sa
      }
    }
  } else {
    // ================= consumer warpgroups: v1's loop over the u ring =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kV3ConsumerRegs) : "memory");
    const int total_tiles = *total_s;
    const int wg = (warp >> 2) - 1;   // rows [64 wg, 64 wg + 64) of the tile
    const int warp_in_wg = warp & 3;  // rows [16 warp_in_wg, +16) of those
    const int g = lane >> 2, t4 = lane & 3;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    uint32_t it = 0;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = decode_tile(t, tile_start, p);
      int prev_su = 0, prev_sb = 0;
      for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
        const int su = it % U_STAGES, sb = it % B_STAGES;
        mbar_wait(smem_u32(u_full + su), (it / U_STAGES) & 1);
        mbar_wait(smem_u32(b_full + sb), (it / B_STAGES) & 1);
        wgmma_kstep(acc, smem_u32(u_ring + su * kATileBytes + wg * kHalfTileBytes),
                    smem_u32(b_ring + sb * kBTileBytes), kt == 0);
        wgmma_wait<1>();
        fence_accumulators(acc);
        if (kt > 0 && lane == 0) {
          mbar_arrive(smem_u32(u_empty + prev_su));
          mbar_arrive(smem_u32(b_empty + prev_sb));
        }
        prev_su = su;
        prev_sb = sb;
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (lane == 0) {
        mbar_arrive(smem_u32(u_empty + prev_su));
        mbar_arrive(smem_u32(b_empty + prev_sb));
      }
      store_rows(p, c, wg * 64 + warp_in_wg * 16, g, t4, acc);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// helper kernels: F1-style u, fp32 reference, fills, comparisons

// u [N, h] from a|b [N, 2h] exactly as F1's epilogue writes it (act_math::forward on the bf16
// values as floats, the pair rounded once by __floats2bfloat162_rn).
__global__ void f1_style_u_kernel(const bf16* ab, bf16* u, int64_t N, int h) {
  const int64_t pairs_per_row = h / 2, pairs = N * pairs_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / pairs_per_row, col = 2 * (i % pairs_per_row);
    const uint32_t a2 = *reinterpret_cast<const uint32_t*>(ab + r * 2 * h + col);
    const uint32_t b2 = *reinterpret_cast<const uint32_t*>(ab + r * 2 * h + h + col);
    const float2 ra = unpack_bf16x2(a2), rb = unpack_bf16x2(b2);
    *reinterpret_cast<uint32_t*>(u + r * h + col) =
        pack_bf16x2(moeblaze::act_math::forward(kAct, ra.x, rb.x),
                    moeblaze::act_math::forward(kAct, ra.y, rb.y));
  }
}

// SIMT fp32 reference: block (n-tile, m-tile of expert blockIdx.z) computes 64 x 64 outputs.
constexpr int kRefTile = 64, kRefK = 16;
__global__ void __launch_bounds__(256)
    f2_reference_kernel(const bf16* u, const bf16* w, const int32_t* offsets, int d, int h,
                        float* y) {
  __shared__ float us[kRefK][kRefTile + 1];
  __shared__ float ws[kRefK][kRefTile + 1];
  const int e = blockIdx.z;
  const int off = offsets[e], count = offsets[e + 1] - off;
  const int m0 = blockIdx.y * kRefTile, n0 = blockIdx.x * kRefTile;
  if (m0 >= count) return;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const bf16* we = w + size_t(e) * d * h;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < h; k0 += kRefK) {
    for (int i = tid; i < kRefK * kRefTile; i += 256) {
      const int rr = i / kRefK, kk = i % kRefK, k = k0 + kk;
      const int m = m0 + rr, n = n0 + rr;
      us[kk][rr] = (m < count && k < h) ? __bfloat162float(u[size_t(off + m) * h + k]) : 0.f;
      ws[kk][rr] = (n < d && k < h) ? __bfloat162float(we[size_t(n) * h + k]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kRefK; ++kk) {
      float uv[4], wv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) uv[i] = us[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) wv[j] = ws[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(uv[i], wv[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = m0 + ty * 4 + i, n = n0 + tx * 4 + j;
      if (m < count && n < d) y[size_t(off + m) * d + n] = acc[i][j];
    }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// LEAN == act_math, exhaustively: every bf16 a (65536 patterns: NaN, inf, denormals included),
// (1) silu(a) as a float, bitwise; (2) whole u pairs (a in both halves of the word, by an odd-
// multiplier permutation) with 64 b values (specials and pseudo-random), bitwise.
__global__ void lean_equivalence_kernel(unsigned long long* mismatches, unsigned* first_a) {
  const uint32_t a_bits = blockIdx.x * blockDim.x + threadIdx.x;
  if (a_bits >= 65536u) return;
  const float a = __uint_as_float(a_bits << 16);
  unsigned long long bad = 0;
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(a * -0x1.715476p+0f));
  const float lean_silu = a * __fdividef(1.f, 1.f + e);
  if (__float_as_uint(lean_silu) != __float_as_uint(moeblaze::act_math::silu(a))) ++bad;
  const uint32_t a2 = a_bits | (((a_bits * 40503u + 1u) & 0xffffu) << 16);
  const uint16_t specials[9] = {0x0000, 0x8000, 0x3f80, 0xbf80, 0x7f80,
                                0xff80, 0x7fc0, 0x0001, 0x7f7f};
  for (int j = 0; j < 64; ++j) {
    const uint32_t r = uint32_t(splitmix64(uint64_t(a_bits) * 64 + j));
    const uint32_t lo = j < 9 ? specials[j] : (r & 0xffffu), hi = (r >> 16) & 0xffffu;
    const uint32_t b2 = lo | (hi << 16);
    if (act_pair(a2, b2) != lean_act_pair(a2, b2)) ++bad;
  }
  if (bad) {
    atomicAdd(mismatches, bad);
    atomicMin(first_a, a_bits);
  }
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

struct CompareResult {
  unsigned long long nonfinite;   // NaN / inf in `got` (the 0xFF poison is a NaN: unwritten too)
  unsigned long long mismatches;  // bitwise (bitwise mode) or |diff| > tol (tolerance mode)
  unsigned long long first_bad;   // smallest mismatching index (~0ull if none)
  double err2, ref2;
  float max_abs;
};

__device__ __forceinline__ void atomic_max_float(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));  // v >= 0
}

// fp32 `got` vs `ref`: BITWISE (mismatch = different bits) or with a tolerance (mismatch =
// |diff| > 1e-3 |ref| + abs_tol); rel-L2 accumulated either way.
__global__ void compare_f32_kernel(const float* got, const float* ref, size_t n, bool bitwise,
                                   float abs_tol, CompareResult* res) {
  double e2 = 0, r2 = 0;
  unsigned long long nf = 0, mm = 0, first = ~0ull;
  float mx = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float g = got[i], r = ref[i];
    if (!isfinite(g)) {
      ++nf;
      first = min(first, (unsigned long long)i);
      continue;
    }
    const float diff = fabsf(g - r);
    const bool bad =
        bitwise ? __float_as_uint(g) != __float_as_uint(r) : !(diff <= 1e-3f * fabsf(r) + abs_tol);
    if (bad) {
      ++mm;
      first = min(first, (unsigned long long)i);
    }
    e2 += double(diff) * diff;
    r2 += double(r) * r;
    mx = fmaxf(mx, diff);
  }
  atomicAdd(&res->nonfinite, nf);
  atomicAdd(&res->mismatches, mm);
  atomicMin(&res->first_bad, first);
  atomicAdd(&res->err2, e2);
  atomicAdd(&res->ref2, r2);
  atomic_max_float(&res->max_abs, mx);
}

// bf16 words, bitwise (the u dump against the F1-style u).
__global__ void compare_u16_kernel(const uint16_t* got, const uint16_t* ref, size_t n,
                                   CompareResult* res) {
  unsigned long long mm = 0, first = ~0ull;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    if (got[i] != ref[i]) {
      ++mm;
      first = min(first, (unsigned long long)i);
    }
  }
  atomicAdd(&res->mismatches, mm);
  atomicMin(&res->first_bad, first);
}

// ---------------------------------------------------------------------------------------------
// host: tensor maps, problems, launchers

typedef CUresult (*EncodeTiledFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                  const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                  const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static EncodeTiledFn get_encoder() {
  static EncodeTiledFn fn = nullptr;
  if (!fn) {
    cudaDriverEntryPointQueryResult q;
    void* ptr = nullptr;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                cudaEnableDefault, &q));
    REQUIRE(q == cudaDriverEntryPointSuccess && ptr, "cuTensorMapEncodeTiled not found");
    fn = reinterpret_cast<EncodeTiledFn>(ptr);
  }
  return fn;
}

// A 3-D bf16 tensor {dim0, dim1, dim2} (dim0 contiguous, strides in elements), 128B swizzle, OOB
// zero fill, box {box0, box1, box2}.
static CUtensorMap make_map_3d(const void* base, uint64_t dim0, uint64_t dim1, uint64_t dim2,
                               uint64_t stride1, uint64_t stride2, uint32_t box0, uint32_t box1,
                               uint32_t box2) {
  CUtensorMap map;
  memset(&map, 0, sizeof(map));
  const cuuint64_t dims[3] = {dim0, dim1, dim2};
  const cuuint64_t strides[2] = {stride1 * 2, stride2 * 2};
  const cuuint32_t box[3] = {box0, box1, box2};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r =
      get_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims,
                    strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  REQUIRE(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (%d)", int(r));
  return map;
}

struct Problem {
  int T, d, h, E, k, N;
  bf16* ab;          // [N, 2h] a | b
  bf16* u;           // [N, h] F1-style u (v1's A; the reference of the u dump)
  bf16* w;           // [E, d, h] w_down
  int32_t* offsets;  // [E + 1]
  float* y_ref;      // [N, d] fp32 reference
  float* y_v1;       // [N, d] v1's output (the bitwise reference of v2-v4)
  float* y;          // [N, d] the version under test
  bf16* u_dump;      // [N, h] the on-load u of the DUMP variants
  unsigned* tail_nonzero;
  std::vector<int32_t> h_offsets;
  CUtensorMap map_u, map_ab, map_w;
};

static int g_num_sms = 0;

static F2Params params_of(const Problem& P, float* out, bool dump) {
  F2Params p;
  p.offsets = P.offsets;
  p.out = out;
  p.u_dump = dump ? P.u_dump : nullptr;
  p.tail_nonzero = P.tail_nonzero;
  p.d = P.d;
  p.h = P.h;
  p.E = P.E;
  p.N = P.N;
  p.n_tiles = (P.d + kBN - 1) / kBN;
  p.k_tiles = (P.h + kBK - 1) / kBK;
  return p;
}

static int grid_of(const Problem& P) {
  // Persistent: one CTA per SM, fewer when there are fewer tiles (an upper bound on the tiles).
  const int64_t max_tiles = (int64_t(P.N) / kBM + P.E) * ((P.d + kBN - 1) / kBN);
  return int(std::min<int64_t>(max_tiles, g_num_sms));
}

constexpr int kNumVersions = 6;
static const char* kVersionName[kNumVersions + 1] = {
    "",
    "v1 today's F2 (u by TMA)",
    "v2 on-load, consumers transform (ab 3 / B 3), act_math::forward",
    "v3 on-load, transform warpgroup (ab 3 / u 2 / B 3), act_math::forward",
    "v4 = v2 with ab 2 / B 4",
    "v5 = v2 with the lean transform (same bits)",
    "v6 = v3 with the lean transform (same bits)"};

template <typename Kernel>
static void launch(Kernel kernel, int threads, size_t smem, const Problem& P, const F2Params& p,
                   cudaStream_t stream) {
  kernel<<<grid_of(P), threads, smem, stream>>>(P.map_ab, P.map_w, p);
}

template <int AB, int BS, bool LEAN>
static void launch_onload(const Problem& P, const F2Params& p, bool dump, cudaStream_t stream) {
  const size_t smem = v2_smem_bytes(AB, BS, P.E);
  if (dump)
    launch(f2_onload_kernel<AB, BS, LEAN, true>, 384, smem, P, p, stream);
  else
    launch(f2_onload_kernel<AB, BS, LEAN, false>, 384, smem, P, p, stream);
}

template <int AB, int U, int BS, bool LEAN>
static void launch_xform(const Problem& P, const F2Params& p, bool dump, cudaStream_t stream) {
  const size_t smem = v3_smem_bytes(AB, U, BS, P.E);
  if (dump)
    launch(f2_xform_kernel<AB, U, BS, LEAN, true>, 384, smem, P, p, stream);
  else
    launch(f2_xform_kernel<AB, U, BS, LEAN, false>, 384, smem, P, p, stream);
}

static void run_version(int version, const Problem& P, float* out, bool dump, cudaStream_t stream) {
  const F2Params p = params_of(P, out, dump);
  switch (version) {
    case 1:
      f2_v1_kernel<<<grid_of(P), 384, v1_smem_bytes(P.E), stream>>>(P.map_u, P.map_w, p);
      break;
    case 2: launch_onload<kV2Ab, kV2B, false>(P, p, dump, stream); break;
    case 3: launch_xform<kV3Ab, kV3U, kV3B, false>(P, p, dump, stream); break;
    case 4: launch_onload<kV4Ab, kV4B, false>(P, p, dump, stream); break;
    case 5: launch_onload<kV2Ab, kV2B, true>(P, p, dump, stream); break;
    case 6: launch_xform<kV3Ab, kV3U, kV3B, true>(P, p, dump, stream); break;
    default: REQUIRE(false, "unknown kernel version %d", version);
  }
  CUDA_CHECK(cudaGetLastError());
}

template <int AB, int BS, bool LEAN>
static void allow_onload_smem() {
  const int bytes = int(v2_smem_bytes(AB, BS, kMaxExperts));
  const cudaFuncAttribute attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  CUDA_CHECK(cudaFuncSetAttribute(f2_onload_kernel<AB, BS, LEAN, true>, attr, bytes));
  CUDA_CHECK(cudaFuncSetAttribute(f2_onload_kernel<AB, BS, LEAN, false>, attr, bytes));
}

template <int AB, int U, int BS, bool LEAN>
static void allow_xform_smem() {
  const int bytes = int(v3_smem_bytes(AB, U, BS, kMaxExperts));
  const cudaFuncAttribute attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  CUDA_CHECK(cudaFuncSetAttribute(f2_xform_kernel<AB, U, BS, LEAN, true>, attr, bytes));
  CUDA_CHECK(cudaFuncSetAttribute(f2_xform_kernel<AB, U, BS, LEAN, false>, attr, bytes));
}

static void set_smem_attributes() {
  CUDA_CHECK(cudaFuncSetAttribute(f2_v1_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  int(v1_smem_bytes(kMaxExperts))));
  allow_onload_smem<kV2Ab, kV2B, false>();
  allow_onload_smem<kV4Ab, kV4B, false>();
  allow_onload_smem<kV2Ab, kV2B, true>();
  allow_xform_smem<kV3Ab, kV3U, kV3B, false>();
  allow_xform_smem<kV3Ab, kV3U, kV3B, true>();
}

struct Shape {
  const char* name;
  int T, d, h, E, k;
};

static const Shape kShapes[] = {
    // k tail (h % 64 = 8: u zero-filled at k 328..383), n tail (d = 200 < 256: the second B box
    // half-filled), ragged experts, one empty expert.
    {"edge", 777, 200, 328, 5, 2},
    {"tiny", 50, 72, 136, 3, 2},  // fewer tiles than SMs: most CTAs idle
    {"conf3", 65536, 1024, 4096, 16, 4},
    {"mixtral", 16384, 4096, 14336, 8, 2},
    {"qwen", 32768, 2048, 768, 128, 8},
};

// Uneven routing: expert weights 1..5 cyclically, expert 1 gets no tokens (when E > k + 1); each
// token picks k distinct experts. Only the per-expert counts matter to F2 (rows grouped by expert).
static std::vector<int32_t> make_offsets(const Shape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> weight(s.E);
  for (int e = 0; e < s.E; ++e) weight[e] = 1.0 + (e * 7 % 5);
  if (s.E > s.k + 1) weight[1] = 0.0;  // an empty expert
  std::vector<int64_t> count(s.E, 0);
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
      ++count[e];
      w[e] = 0;
    }
  }
  std::vector<int32_t> offsets(s.E + 1, 0);
  for (int e = 0; e < s.E; ++e) offsets[e + 1] = offsets[e] + int32_t(count[e]);
  return offsets;
}

static void fill(bf16* p, size_t n, uint64_t seed, float stddev) {
  fill_normal_bf16<<<4 * g_num_sms, 256>>>(p, n, seed, stddev);
  CUDA_CHECK(cudaGetLastError());
}

static Problem make_problem(const Shape& s, uint64_t seed) {
  Problem P;
  P.T = s.T;
  P.d = s.d;
  P.h = s.h;
  P.E = s.E;
  P.k = s.k;
  P.N = s.T * s.k;
  P.h_offsets = make_offsets(s, seed);
  REQUIRE(P.h_offsets[P.E] == P.N, "routing lost rows");
  const size_t N = P.N, d = P.d, h = P.h;
  CUDA_CHECK(cudaMalloc(&P.ab, N * 2 * h * 2));
  CUDA_CHECK(cudaMalloc(&P.u, N * h * 2));
  CUDA_CHECK(cudaMalloc(&P.u_dump, N * h * 2));
  CUDA_CHECK(cudaMalloc(&P.w, size_t(P.E) * d * h * 2));
  CUDA_CHECK(cudaMalloc(&P.offsets, sizeof(int32_t) * (P.E + 1)));
  CUDA_CHECK(cudaMalloc(&P.y_ref, N * d * 4));
  CUDA_CHECK(cudaMalloc(&P.y_v1, N * d * 4));
  CUDA_CHECK(cudaMalloc(&P.y, N * d * 4));
  CUDA_CHECK(cudaMalloc(&P.tail_nonzero, sizeof(unsigned)));
  fill(P.ab, N * 2 * h, seed * 3 + 1, 1.f);                                 // a, b ~ N(0, 1)
  fill(P.w, size_t(P.E) * d * h, seed * 3 + 2, 1.f / std::sqrt(float(h)));  // ~ N(0, 1/h)
  CUDA_CHECK(cudaMemcpy(P.offsets, P.h_offsets.data(), sizeof(int32_t) * (P.E + 1),
                        cudaMemcpyHostToDevice));
  f1_style_u_kernel<<<8 * g_num_sms, 256>>>(P.ab, P.u, P.N, P.h);
  CUDA_CHECK(cudaGetLastError());
  // A (u, a|b) as {h, halves, N} with box {64 k, 1, 128 rows}: k past h and rows past N read as
  // zeros; B (w_down [E, d, h]) as {h, d, E} with box {64 k, 128 n, 1}: n past d zero-filled.
  P.map_u = make_map_3d(P.u, h, 1, N, h, h, kBK, 1, kBM);
  P.map_ab = make_map_3d(P.ab, h, 2, N, h, 2 * h, kBK, 1, kBM);
  P.map_w = make_map_3d(P.w, h, d, P.E, h, d * h, kBK, kBBoxRows, 1);
  return P;
}

static void free_problem(Problem& P) {
  cudaFree(P.ab);
  cudaFree(P.u);
  cudaFree(P.u_dump);
  cudaFree(P.w);
  cudaFree(P.offsets);
  cudaFree(P.y_ref);
  cudaFree(P.y_v1);
  cudaFree(P.y);
  cudaFree(P.tail_nonzero);
}

// ---------------------------------------------------------------------------------------------
// checks

static float bf16_bits_to_float(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static float round_bf16_host(float f) {  // round-to-nearest-even, NaN kept
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float r;
  memcpy(&r, &u, 4);
  return r;
}

static CompareResult compare_f32(const float* got, const float* ref, size_t n, bool bitwise,
                                 float abs_tol) {
  CompareResult* d_res;
  CUDA_CHECK(cudaMalloc(&d_res, sizeof(CompareResult)));
  CompareResult init = {};
  init.first_bad = ~0ull;
  CUDA_CHECK(cudaMemcpy(d_res, &init, sizeof(init), cudaMemcpyHostToDevice));
  compare_f32_kernel<<<8 * g_num_sms, 256>>>(got, ref, n, bitwise, abs_tol, d_res);
  CUDA_CHECK(cudaGetLastError());
  CompareResult res;
  CUDA_CHECK(cudaMemcpy(&res, d_res, sizeof(res), cudaMemcpyDeviceToHost));
  cudaFree(d_res);
  return res;
}

static CompareResult compare_u16(const bf16* got, const bf16* ref, size_t n) {
  CompareResult* d_res;
  CUDA_CHECK(cudaMalloc(&d_res, sizeof(CompareResult)));
  CompareResult init = {};
  init.first_bad = ~0ull;
  CUDA_CHECK(cudaMemcpy(d_res, &init, sizeof(init), cudaMemcpyHostToDevice));
  compare_u16_kernel<<<8 * g_num_sms, 256>>>(reinterpret_cast<const uint16_t*>(got),
                                             reinterpret_cast<const uint16_t*>(ref), n, d_res);
  CUDA_CHECK(cudaGetLastError());
  CompareResult res;
  CUDA_CHECK(cudaMemcpy(&res, d_res, sizeof(res), cudaMemcpyDeviceToHost));
  cudaFree(d_res);
  return res;
}

static double rel_l2(const CompareResult& r) {
  return std::sqrt(r.err2 / std::max(r.ref2, 1e-300));
}

// The fp32 reference of a problem: the SIMT kernel over every row, spot-checked against an fp64
// CPU GEMM on sampled rows (first, last, random of each non-empty expert, at most 24 rows), which
// also checks the F1-style u against the host formula (accurate exp and division: within one bf16
// rounding flip of the device's MUFU form). Returns false on failure.
static bool build_reference(const Shape& s, Problem& P) {
  const size_t N = P.N, d = P.d, h = P.h;
  CUDA_CHECK(cudaMemset(P.y_ref, 0xFF, N * d * 4));
  int max_count = 0;
  for (int e = 0; e < P.E; ++e)
    max_count = std::max(max_count, P.h_offsets[e + 1] - P.h_offsets[e]);
  dim3 grid((P.d + kRefTile - 1) / kRefTile, (max_count + kRefTile - 1) / kRefTile, P.E);
  f2_reference_kernel<<<grid, 256>>>(P.u, P.w, P.offsets, P.d, P.h, P.y_ref);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());

  std::mt19937 rng(1234);
  std::vector<int> rows, row_e;
  for (int e = 0; e < P.E; ++e) {
    const int lo = P.h_offsets[e], hi = P.h_offsets[e + 1];
    if (hi == lo) continue;
    for (int r : {lo, hi - 1, lo + int(rng() % unsigned(hi - lo))}) {
      rows.push_back(r);
      row_e.push_back(e);
    }
  }
  std::vector<int> keep, keep_e;
  const size_t stride = (rows.size() + 23) / 24;
  for (size_t i = 0; i < rows.size(); i += stride) {
    keep.push_back(rows[i]);
    keep_e.push_back(row_e[i]);
  }
  const size_t nr = keep.size();
  std::vector<uint16_t> hu(nr * h), hab(nr * 2 * h);
  std::vector<float> yref(nr * d);
  for (size_t i = 0; i < nr; ++i) {
    CUDA_CHECK(cudaMemcpy(&hu[i * h], P.u + size_t(keep[i]) * h, h * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&hab[i * 2 * h], P.ab + size_t(keep[i]) * 2 * h, 2 * h * 2,
                          cudaMemcpyDeviceToHost));
    CUDA_CHECK(
        cudaMemcpy(&yref[i * d], P.y_ref + size_t(keep[i]) * d, d * 4, cudaMemcpyDeviceToHost));
  }
  // u vs the host formula (accurate): |diff| <= 2^-7 |u_host| + 1e-6 (one bf16 rounding flip).
  size_t u_bad = 0;
  for (size_t i = 0; i < nr * h; ++i) {
    const size_t r = i / h, k = i % h;
    const float a = bf16_bits_to_float(hab[r * 2 * h + k]);
    const float b = bf16_bits_to_float(hab[r * 2 * h + h + k]);
    const float uh = round_bf16_host(a * (1.f / (1.f + std::exp(-a))) * b);
    const float ud = bf16_bits_to_float(hu[i]);
    if (!(std::fabs(ud - uh) <= std::ldexp(std::fabs(uh), -7) + 1e-6f)) ++u_bad;
  }
  // The fp64 GEMM of the sampled rows, weights copied per expert.
  std::vector<double> cpu(nr * d);
  {
    std::vector<int> experts(keep_e);
    std::sort(experts.begin(), experts.end());
    experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
    std::vector<uint16_t> hw(d * h);
    for (int e : experts) {
      CUDA_CHECK(cudaMemcpy(hw.data(), P.w + size_t(e) * d * h, d * h * 2, cudaMemcpyDeviceToHost));
      const unsigned nthreads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
      std::vector<std::thread> pool;
      for (unsigned tix = 0; tix < nthreads; ++tix)
        pool.emplace_back([&, tix, e] {
          std::vector<float> uf(h);
          for (size_t i = 0; i < nr; ++i) {
            if (keep_e[i] != e) continue;
            for (size_t k = 0; k < h; ++k) uf[k] = bf16_bits_to_float(hu[i * h + k]);
            for (size_t n = tix; n < d; n += nthreads) {
              double acc = 0;
              const uint16_t* wr = &hw[n * h];
              for (size_t k = 0; k < h; ++k) acc += double(uf[k]) * bf16_bits_to_float(wr[k]);
              cpu[i * d + n] = acc;
            }
          }
        });
      for (auto& t : pool) t.join();
    }
  }
  double e2 = 0, r2 = 0;
  size_t nonfinite = 0;
  for (size_t i = 0; i < nr * d; ++i) {
    if (!std::isfinite(yref[i])) {
      ++nonfinite;
      continue;
    }
    e2 += (yref[i] - cpu[i]) * (yref[i] - cpu[i]);
    r2 += cpu[i] * cpu[i];
  }
  const double rel = std::sqrt(e2 / std::max(r2, 1e-300));
  const bool ok = u_bad == 0 && nonfinite == 0 && rel < 1e-4;
  printf(
      "  [%s ref] fp32 reference vs fp64 CPU on %zu rows x %d cols: rel_l2 %.3e, non-finite "
      "%zu; F1-style u vs host formula (<= 1 bf16 flip): %zu bad of %zu  %s\n",
      s.name, nr, P.d, rel, nonfinite, u_bad, nr * h, ok ? "ok" : "FAIL");
  return ok;
}

static void describe_first_bad(const Problem& P, const float* got, const float* ref,
                               const CompareResult& r) {
  if (r.first_bad == ~0ull) return;
  const size_t i = r.first_bad;
  float g, f;
  CUDA_CHECK(cudaMemcpy(&g, got + i, 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(&f, ref + i, 4, cudaMemcpyDeviceToHost));
  const int row = int(i / P.d), col = int(i % P.d);
  int e = 0;
  while (P.h_offsets[e + 1] <= row) ++e;
  printf("      first mismatch: row %d (expert %d, row %d of it) col %d: got %.9g ref %.9g\n", row,
         e, row - P.h_offsets[e], col, g, f);
}

// One version on one problem. v1: vs the fp32 reference (rel-L2 < 1e-4, no non-finite, every
// element within 1e-3 |ref| + 5e-4; y ~ N(0, ~0.35)) and saved as y_v1. v2-v4: the DUMP variant's u
// bitwise equal to the F1-style u (and zero in the zero-filled region), its output and the timed
// variant's output bitwise equal to v1's.
static bool check_version(int version, const Shape& s, Problem& P) {
  const size_t N = P.N, d = P.d, h = P.h;
  bool ok = true;
  if (version == 1) {
    CUDA_CHECK(cudaMemset(P.y_v1, 0xFF, N * d * 4));  // 0xFFFFFFFF: a NaN (unwritten rows show)
    run_version(1, P, P.y_v1, false, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    const CompareResult r = compare_f32(P.y_v1, P.y_ref, N * d, false, 5e-4f);
    const bool pass = r.nonfinite == 0 && r.mismatches == 0 && rel_l2(r) < 1e-4;
    printf(
        "  [%s v1] vs fp32 reference: rel_l2 %.3e max_abs %.3e mismatches %llu non-finite/"
        "unwritten %llu  %s\n",
        s.name, rel_l2(r), r.max_abs, r.mismatches, r.nonfinite, pass ? "ok" : "FAIL");
    if (!pass) describe_first_bad(P, P.y_v1, P.y_ref, r);
    ok = ok && pass;
  } else {
    // 1) the DUMP variant: u as formed on load, every valid element, and its output.
    CUDA_CHECK(cudaMemset(P.u_dump, 0xFF, N * h * 2));  // 0xFFFF: a bf16 NaN
    CUDA_CHECK(cudaMemset(P.tail_nonzero, 0, sizeof(unsigned)));
    CUDA_CHECK(cudaMemset(P.y, 0xFF, N * d * 4));
    run_version(version, P, P.y, true, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    const CompareResult ru = compare_u16(P.u_dump, P.u, N * h);
    unsigned tail = 0;
    CUDA_CHECK(cudaMemcpy(&tail, P.tail_nonzero, sizeof(tail), cudaMemcpyDeviceToHost));
    const bool upass = ru.mismatches == 0 && tail == 0;
    printf(
        "  [%s v%d] u formed on load vs F1-style u, bitwise over %zu elements: mismatches %llu;"
        " nonzero u chunks in the zero-filled k tail / rows past N: %u  %s\n",
        s.name, version, N * h, ru.mismatches, tail, upass ? "ok" : "FAIL");
    if (ru.first_bad != ~0ull)
      printf("      first u mismatch: row %llu k %llu\n", ru.first_bad / h, ru.first_bad % h);
    const CompareResult rd = compare_f32(P.y, P.y_v1, N * d, true, 0.f);
    const bool dpass = rd.nonfinite == 0 && rd.mismatches == 0;
    printf("  [%s v%d] (dump variant) output vs v1 bitwise: mismatches %llu non-finite %llu  %s\n",
           s.name, version, rd.mismatches, rd.nonfinite, dpass ? "ok" : "FAIL");
    if (!dpass) describe_first_bad(P, P.y, P.y_v1, rd);
    // 2) the timed variant, twice (a rerun must be bitwise identical too).
    bool tpass = true;
    for (int run = 0; run < 2; ++run) {
      CUDA_CHECK(cudaMemset(P.y, 0xFF, N * d * 4));
      run_version(version, P, P.y, false, 0);
      CUDA_CHECK(cudaDeviceSynchronize());
      const CompareResult r = compare_f32(P.y, P.y_v1, N * d, true, 0.f);
      const bool pass = r.nonfinite == 0 && r.mismatches == 0;
      printf(
          "  [%s v%d] output vs v1 bitwise (run %d): mismatches %llu non-finite/unwritten %llu"
          " (rel_l2 %.3e)  %s\n",
          s.name, version, run + 1, r.mismatches, r.nonfinite, rel_l2(r), pass ? "ok" : "FAIL");
      if (!pass) describe_first_bad(P, P.y, P.y_v1, r);
      tpass = tpass && pass;
    }
    ok = upass && dpass && tpass;
  }
  return ok;
}

// ---------------------------------------------------------------------------------------------
// timing: warm-up, then the median of 20 runs, each after an L2 flush (outside the timed region)

template <typename F>
static float median_ms(F&& launch, void* flush_buf, size_t flush_bytes) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) launch();
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    CUDA_CHECK(cudaMemsetAsync(flush_buf, i & 0xff, flush_bytes));
    CUDA_CHECK(cudaEventRecord(e0));
    launch();
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
  std::string name;
  double gflop, gb_u, gb_ab, gb_w, ms[kNumVersions + 1], ms_dense;
};

int main(int argc, char** argv) {
  bool check_only = false;
  std::string only;
  std::vector<int> versions = {1, 2, 3, 4, 5, 6};
  uint64_t seed = 20261206;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--check-only")) {
      check_only = true;
    } else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
      only = argv[++i];
    } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
      seed = strtoull(argv[++i], nullptr, 10);
    } else if (!strcmp(argv[i], "--versions") && i + 1 < argc) {
      versions.clear();
      for (const char* c = argv[++i]; *c; ++c)
        if (*c >= '1' && *c <= '0' + kNumVersions) versions.push_back(*c - '0');
    } else {
      fprintf(stderr,
              "usage: %s [--check-only] [--shape NAME] [--seed N] [--versions 1,2,3,4,5,6]\n",
              argv[0]);
      return 2;
    }
  }
  std::sort(versions.begin(), versions.end());
  versions.erase(std::unique(versions.begin(), versions.end()), versions.end());
  REQUIRE(!versions.empty(), "no version selected");
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  g_num_sms = prop.multiProcessorCount;
  printf("device: %s, %d SMs, L2 %d MB, smem/block opt-in %zu B, seed %llu\n", prop.name, g_num_sms,
         prop.l2CacheSize >> 20, prop.sharedMemPerBlockOptin, (unsigned long long)seed);
  REQUIRE(prop.major == 9, "these kernels need sm_90a (Hopper)");
  REQUIRE(size_t(kSmemOptin) <= prop.sharedMemPerBlockOptin, "shared memory opt-in");
  set_smem_attributes();
  bool all_ok = true;
  {
    unsigned long long* d_bad;
    unsigned* d_first;
    CUDA_CHECK(cudaMalloc(&d_bad, sizeof(unsigned long long)));
    CUDA_CHECK(cudaMalloc(&d_first, sizeof(unsigned)));
    CUDA_CHECK(cudaMemset(d_bad, 0, sizeof(unsigned long long)));
    CUDA_CHECK(cudaMemset(d_first, 0xFF, sizeof(unsigned)));
    lean_equivalence_kernel<<<256, 256>>>(d_bad, d_first);
    CUDA_CHECK(cudaGetLastError());
    unsigned long long bad = 0;
    unsigned first = 0;
    CUDA_CHECK(cudaMemcpy(&bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&first, d_first, sizeof(first), cudaMemcpyDeviceToHost));
    cudaFree(d_bad);
    cudaFree(d_first);
    printf(
        "lean transform vs act_math::forward, all 65536 bf16 a (silu bits; u pairs x 64 b): "
        "%llu mismatches  %s\n",
        bad, bad ? "FAIL" : "ok");
    if (bad) printf("  first mismatching a bits: 0x%04x\n", first);
    all_ok = all_ok && bad == 0;
  }
  printf("shared memory at E = %d: v1 %zu B, v2 %zu B, v3 %zu B, v4 %zu B (limit %d)\n",
         kMaxExperts, v1_smem_bytes(kMaxExperts), v2_smem_bytes(kV2Ab, kV2B, kMaxExperts),
         v3_smem_bytes(kV3Ab, kV3U, kV3B, kMaxExperts), v2_smem_bytes(kV4Ab, kV4B, kMaxExperts),
         kSmemOptin);
  for (int v : versions) printf("  %s\n", kVersionName[v]);

  const size_t flush_bytes = size_t(std::max(prop.l2CacheSize, 1 << 20)) * 4;
  void* flush_buf;
  CUDA_CHECK(cudaMalloc(&flush_buf, flush_bytes));
#ifndef NO_CUBLAS
  cublasHandle_t blas;
  REQUIRE(cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
#endif

  std::vector<TimingRow> table;
  for (const Shape& s : kShapes) {
    if (!only.empty() && only != s.name) continue;
    REQUIRE(s.d % 8 == 0 && s.h % 8 == 0 && s.E <= kMaxExperts, "unsupported shape %s", s.name);
    const uint64_t shape_seed = seed + std::hash<std::string>()(s.name) % 1000;
    printf("shape %s: T=%d d=%d h=%d E=%d k=%d N=%d; K = h: %d k-steps, %d n-tiles (seed %llu)\n",
           s.name, s.T, s.d, s.h, s.E, s.k, s.T * s.k, (s.h + kBK - 1) / kBK, (s.d + kBN - 1) / kBN,
           (unsigned long long)shape_seed);
    Problem P = make_problem(s, shape_seed);
    {
      int mn = 1 << 30, mx = 0, empty = 0;
      for (int e = 0; e < s.E; ++e) {
        const int c = P.h_offsets[e + 1] - P.h_offsets[e];
        mn = std::min(mn, c);
        mx = std::max(mx, c);
        empty += c == 0;
      }
      printf("  rows per expert: min %d max %d, empty experts %d; persistent grid %d CTAs\n", mn,
             mx, empty, grid_of(P));
    }
    bool shape_ok = build_reference(s, P);
    // v1 is the bitwise reference of the others: always checked first.
    bool v1_ok = check_version(1, s, P);
    printf("  [%s v1] %s\n", s.name, v1_ok ? "CHECK PASSED" : "CHECK FAILED");
    shape_ok = shape_ok && v1_ok;
    for (int v : versions) {
      if (v == 1) continue;
      const bool ok = check_version(v, s, P);
      printf("  [%s v%d] %s\n", s.name, v, ok ? "CHECK PASSED" : "CHECK FAILED");
      shape_ok = shape_ok && ok;
    }
    all_ok = all_ok && shape_ok;
    if (!check_only && strcmp(s.name, "edge") != 0 && strcmp(s.name, "tiny") != 0) {
      TimingRow row;
      row.name = s.name;
      row.gflop = 2.0 * P.N * double(P.d) * P.h * 1e-9;
      row.gb_u = 2.0 * P.N * double(P.h) * 1e-9;
      row.gb_ab = 4.0 * P.N * double(P.h) * 1e-9;
      row.gb_w = 2.0 * P.E * double(P.d) * P.h * 1e-9;
      for (int v = 0; v <= kNumVersions; ++v) row.ms[v] = 0;
      for (int v : versions)
        row.ms[v] = median_ms([&] { run_version(v, P, P.y, false, 0); }, flush_buf, flush_bytes);
      row.ms_dense = 0;
#ifndef NO_CUBLAS
      {  // dense GEMM with the same FLOPs: u [N, h] x w_down[0] [d, h]^T -> [N, d] fp32
        const float alpha = 1.f, beta = 0.f;
        auto launch = [&] {
          const cublasStatus_t st =
              cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, P.d, P.N, P.h, &alpha, P.w, CUDA_R_16BF,
                           P.h, P.u, CUDA_R_16BF, P.h, &beta, P.y, CUDA_R_32F, P.d,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          REQUIRE(st == CUBLAS_STATUS_SUCCESS, "cublasGemmEx %d", int(st));
        };
        row.ms_dense = median_ms(launch, flush_buf, flush_bytes);
      }
#endif
      table.push_back(row);
      for (int v : versions)
        printf("  [%s v%d] %.3f ms = %.1f TFLOP/s (%.2f x v1's time)\n", s.name, v, row.ms[v],
               row.gflop / row.ms[v], row.ms[1] > 0 ? row.ms[v] / row.ms[1] : 0.0);
      printf("  [%s] cuBLAS dense same-FLOP GEMM (fp32 out) %.3f ms = %.1f TFLOP/s\n", s.name,
             row.ms_dense, row.ms_dense > 0 ? row.gflop / row.ms_dense : 0.0);
    }
    free_problem(P);
  }

  if (!table.empty()) {
    printf(
        "\nF2 TFLOP/s = 2*N*d*h / time; activation bytes read once (min): v1 u = 2*N*h, "
        "v2-v4 a|b = 4*N*h (weights 2*E*d*h for all); vN/v1 = time ratio (> 1: slower)\n");
    printf("%-8s %7s %7s %7s %6s", "shape", "GFLOP", "GB u", "GB a|b", "GB w");
    for (int v : versions) printf("   v%d ms v%d TF/s%s", v, v, v == 1 ? "" : " v/v1");
    printf(" %9s %8s\n", "dense ms", "dense TF");
    for (const TimingRow& r : table) {
      printf("%-8s %7.0f %7.2f %7.2f %6.2f", r.name.c_str(), r.gflop, r.gb_u, r.gb_ab, r.gb_w);
      for (int v : versions) {
        printf(" %8.3f %7.1f", r.ms[v], r.gflop / r.ms[v]);  // GFLOP/ms = TFLOP/s
        if (v != 1) printf(" %4.2f", r.ms[1] > 0 ? r.ms[v] / r.ms[1] : 0.0);
      }
      const double dtf = r.ms_dense > 0 ? r.gflop / r.ms_dense : 0;
      printf(" %9.3f %8.1f\n", r.ms_dense, dtf);
    }
  }
  printf("%s\n", all_ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
#ifndef NO_CUBLAS
  cublasDestroy(blas);
#endif
  cudaFree(flush_buf);
  return all_ok ? 0 : 1;
}
