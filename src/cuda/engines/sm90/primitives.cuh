// The Hopper (sm_90a) device primitives every kernel of the library uses (mbarrier, cp.async and
// TMA wrappers, wgmma and its shared-memory descriptors, the epilogue staging layout) and the
// driver's tensor-map encoder, with no dependency on the rest of the library, so a standalone
// kernel experiment can include it (`-I src`, `using namespace moeblaze::cuda::sm90;`) instead of
// copying it. common.cuh adds the library's host helpers (error reporting, tensor maps, kernel
// preparation) on top. The CUDA suite checks every primitive through the kernels that use it.
//
// Device code is compiled only for the sm_90a image (MB_SM90_DEVICE); the library's other images
// contain a kernel body that traps, and the host-side support checks never launch it there.
#pragma once

#include <cuda.h>  // CUtensorMap and the encoder's types only: no libcuda link
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MB_SM90_DEVICE 1
#else
#define MB_SM90_DEVICE 0
#endif

#ifndef MB_SM90_MBAR_POLL_LIMIT
#define MB_SM90_MBAR_POLL_LIMIT (1u << 26)
#endif

namespace moeblaze {
namespace cuda {
namespace sm90 {

// One stage of k: a 128-byte swizzle row of 16-bit elements.
constexpr int kBK = 64;

// A consumer warp's epilogue staging buffer: 16 rows x 64 columns of 16-bit values (2 KB), 32
// words a row, the 16-byte chunk c of row r at chunk (c ^ (r & 7)), so that both access patterns
// are free of bank conflicts:
//   fragment side: lane (g, t4) holds the word (2 values) at row g + 8 rr, columns 8 jj + 2 t4 of
//     the 64 (the wgmma m64nN accumulator layout, jj the 8-column group of the 64);
//   global side: lane reads or writes 16-byte chunk (lane & 7) of row 4 i + (lane >> 3), so a warp
//     instruction covers 4 rows x 128 contiguous bytes (coalesced).
constexpr int kStageRows = 16;
constexpr int kStageCols = 64;
constexpr int kStageWarpBytes = kStageRows * kStageCols * 2;

// The epilogue warps' hand-off (store_handoff below): 64-column groups of 128 rows x 128 bytes.
constexpr int kHandoffGroupBytes = 128 * 128;

#if MB_SM90_DEVICE

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// One poll of the phase with `parity`: true once it has completed (the thread may be suspended
// for a while inside the poll until it does).
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Spins until the phase with `parity` completes. A wait far beyond any real stall (real waits are
// microseconds) traps instead of hanging the device: after MB_SM90_MBAR_POLL_LIMIT polls, 2^26 in
// the library: seconds, at the ~120 ns a poll takes at base clocks (F1's epilogue warps poll ~450
// times while a tile's ~56 us main loop runs, by Nsight Compute). An experiment may define a
// smaller limit before including this header to fail fast.
// The first poll stands alone, so a wait that is already over (most of a main loop's) costs the
// poll and a branch, not the counter's three instructions as well.
// No printf here: a call anywhere in a kernel makes ptxas serialise its wgmmas (C7510).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (__builtin_expect(mbar_try_wait(bar, parity), 1)) return;
  uint32_t polls = 1;
  while (!mbar_try_wait(bar, parity)) {
    if (++polls == uint32_t(MB_SM90_MBAR_POLL_LIMIT)) __trap();
  }
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Named barriers, allocated here so that no two uses collide: 0 is __syncthreads', 1 the two
// consumer warpgroups together, 2 + wg consumer warpgroup wg alone.

// The consumer warpgroups' 256 threads (warps 4-11) at named barrier 1: the split epilogue forms,
// whose consumers read each other's rows of the hand-off.
__device__ __forceinline__ void consumer_warps_sync() {
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
}

// The 128 threads of consumer warpgroup wg (0 or 1) at named barrier 2 + wg: B3's staged
// epilogue, whose four warps share one staging buffer.
__device__ __forceinline__ void warpgroup_sync(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
}

// Arrives on `bar` once every cp.async this thread issued so far has landed. .noinc: the arrival
// counts against the barrier's expected count (the issuing threads are part of it).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// base + row * row_bytes as one IMAD.WIDE.U32 with a 64-bit addend. (Written as a 64-bit product
// in C++ it also added a zero register to the high word; as one mad.wide.u32 it became a product
// and a separate 64-bit add.)
__device__ __forceinline__ const void* gathered_row(const void* base, uint32_t row,
                                                    uint32_t row_bytes) {
  uint64_t offset;
  asm("mul.wide.u32 %0, %1, %2;\n" : "=l"(offset) : "r"(row), "r"(row_bytes));
  return static_cast<const char*>(base) + offset;
}

__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled and src is not read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

// A 16-byte global store under a predicate, as one predicated instruction: where a branch went
// around each store, ptxas scheduled the work on either side of it separately (an epilogue's
// unrolled chunks ran their activation chains one chunk at a time).
__device__ __forceinline__ void store16_if(bool pred, void* ptr, const uint4& v) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p st.global.v4.b32 [%1], {%2, %3, %4, %5};\n}\n" ::
          "r"(int(pred)),
      "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
      : "memory");
}

// Orders this thread's generic-proxy shared-memory accesses (cp.async results, plain stores)
// with later async-proxy ones (wgmma operand reads, TMA writes) to the same shared memory.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// A 2-D map's box (the wgrad kernels).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// ---- 2-CTA clusters (a stage's shared operand loaded once for both CTAs, by TMA multicast)

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Arrives on the mbarrier at `bar`'s offset in CTA `rank` of the cluster (our own included).
// Release at CTA scope (the default, as CUTLASS's ClusterBarrier): what it orders are the
// consumers' wgmma reads of a stage, finished by wgmma.wait_group before the arrive; a
// cluster-scope release adds a memory barrier that stalled the consumer warps (kernels 1.5-1.9x
// slower on the H200).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}

// True in one lane of the warp (every lane calls it, converged): ELECT, where a test of the lane
// index made ptxas read %tid again (S2R) every k-step.
__device__ __forceinline__ bool elect_one_lane() {
  uint32_t elected;
  asm volatile(
      "{\n.reg .pred p;\n"
      "elect.sync _|p, 0xffffffff;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(elected));
  return elected != 0;
}

// A consumer warp's release of a pipeline stage (every lane calls it): one arrival on the stage's
// empty barrier, or with clusters one on that barrier in every CTA of the cluster, since each
// CTA's producer multicast a share of the stage into ours; lane r arrives on CTA r's, in parallel.
template <int CLUSTER>
__device__ __forceinline__ void release_stage(uint32_t empty_bar, int lane) {
  if (CLUSTER == 1) {
    if (elect_one_lane()) mbar_arrive(empty_bar);
  } else if (lane < CLUSTER) {
    mbar_arrive_cluster(empty_bar, uint32_t(lane));
  }
}

// Every thread of the cluster: our earlier shared-memory and barrier operations (remote ones
// included) are done before any thread of the cluster passes.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// A persistent CTA's place in a grid of CLUSTER-CTA clusters: its rank in the cluster and the
// cluster's tiles (first_tile, first_tile + tile_step, ...). Every thread calls it after its
// barriers are initialised: with clusters it waits until the peers' are too, before the first
// multicast or remote arrival on them.
struct PersistentPlace {
  int rank, first_tile, tile_step;
};
template <int CLUSTER>
__device__ __forceinline__ PersistentPlace persistent_place() {
  if (CLUSTER > 1) cluster_sync();
  return {CLUSTER > 1 ? int(cluster_ctarank()) : 0, int(blockIdx.x) / CLUSTER,
          int(gridDim.x) / CLUSTER};
}

// The box at (c0, c1, c2) written to the same shared-memory offset of every CTA in cta_mask, each
// CTA's barrier at `bar`'s offset credited with the bytes it received.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map,
                                                      uint32_t bar, int c0, int c1, int c2,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(cta_mask)
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
template <int R>
__device__ __forceinline__ void fence_accumulators(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor: K-major operand, 128B swizzle, rows of 128 bytes (64 elements),
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

// A shared-memory descriptor moved by `bytes` (a multiple of 16): its start-address field (bits
// 0-13) holds the address / 16, and shared addresses stay below 256 KB, so the offset adds to the
// low word without carrying out of the field. A main loop offsets stage 0's descriptors to its
// stage, one 32-bit add each, where building them from the stage's address took five
// instructions; stage 0's are kept opaque, or ptxas rebuilds them every k-step.
struct StageDesc {
  uint32_t lo, hi;
  __device__ __forceinline__ explicit StageDesc(uint64_t desc)
      : lo(uint32_t(desc)), hi(uint32_t(desc >> 32)) {
    asm volatile("" : "+r"(lo));
  }
  __device__ __forceinline__ uint64_t at(uint32_t bytes) const {
    return (uint64_t(hi) << 32) | (lo + (bytes >> 4));
  }
};

// MN-major operand, 128B swizzle (CUTLASS's Layout_MN_SW128_Atom: 64 MN elements x 8 k, each k a
// 128-byte row), as TMA writes a box {64 MN, 64 k}: LBO = bytes between 64-element MN blocks (the
// boxes, 8 KB apart), SBO = bytes between groups of 8 k-rows (1024). +2048 bytes per 16 k.
// The CUDA suite checks it through B4 and B1.
__device__ __forceinline__ uint64_t smem_desc_mnmajor_sw128(uint32_t addr) {
  constexpr uint32_t kLbo = 8192, kSbo = 1024;
  uint64_t desc = 0;
  desc |= uint64_t((addr & 0x3FFFF) >> 4);
  desc |= uint64_t(kLbo >> 4) << 16;
  desc |= uint64_t(kSbo >> 4) << 32;
  desc |= uint64_t(1) << 62;  // SWIZZLE_128B
  return desc;
}

// The accumulator operands of a wgmma, 32 at a time: MB_WGMMA_ACC_TEXT_<i> names operands
// 32i .. 32i + 31 in the instruction's text, MB_WGMMA_ACC_BIND_<i> binds them to d[32i .. 32i +
// 31]; an m64nNk16 takes blocks 0 .. N / 64 - 1, so every shape below lists its registers once.
#define MB_WGMMA_ACC_TEXT_0                                                                    \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MB_WGMMA_ACC_TEXT_1                                                                    \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MB_WGMMA_ACC_TEXT_2                                                                    \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, " \
  "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define MB_WGMMA_ACC_TEXT_3                                                                      \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MB_WGMMA_ACC_BIND_0                                                                       \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MB_WGMMA_ACC_BIND_1                                                                      \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]),     \
      "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), \
      "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), \
      "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
      "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define MB_WGMMA_ACC_BIND_2                                                                      \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),     \
      "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), \
      "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), \
      "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), \
      "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define MB_WGMMA_ACC_BIND_3                                                                     \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), \
      "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]),       \
      "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]),       \
      "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]),       \
      "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]),       \
      "+f"(d[127])

// One wgmma.mma_async.sync.aligned.<SHAPE>.f32.TYPE.TYPE of a function with the parameters d,
// desc_a, desc_b, scale_d and the constants TRANS_A, TRANS_B: ACC_TEXT names its accumulators, the
// variadic arguments bind them, and A, B, SCALE, TA, TB are the operand numbers after them.
#define MB_WGMMA_F32(SHAPE, TYPE, A, B, SCALE, TA, TB, ACC_TEXT, ...)                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE                                         \
               ", 0;\n"                                                                          \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" ACC_TEXT "}, " A \
               ", " B ", p, 1, 1, " TA ", " TB ";\n}\n"                                          \
               : __VA_ARGS__                                                                     \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B))

#define MB_WGMMA_M64N256K16(TYPE)                                                    \
  MB_WGMMA_F32("m64n256k16", TYPE, "%128", "%129", "%130", "%131", "%132",           \
               MB_WGMMA_ACC_TEXT_0 ", " MB_WGMMA_ACC_TEXT_1 ", " MB_WGMMA_ACC_TEXT_2 \
                                   ", " MB_WGMMA_ACC_TEXT_3,                         \
               MB_WGMMA_ACC_BIND_0, MB_WGMMA_ACC_BIND_1, MB_WGMMA_ACC_BIND_2, MB_WGMMA_ACC_BIND_3)

// D[64x256] (+)= A[64x16] * B[16x256] from shared memory; T is __nv_bfloat16 or __half.
// TRANS_A / TRANS_B = 0: the operand is K-major; 1: MN-major (the instruction transposes it).
// scale_d = 0 overwrites D (the first k-step of a tile).
template <typename T, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    MB_WGMMA_M64N256K16("bf16");
  } else {
    MB_WGMMA_M64N256K16("f16");
  }
}
#undef MB_WGMMA_M64N256K16

#define MB_WGMMA_M64N192K16(TYPE)                                                     \
  MB_WGMMA_F32("m64n192k16", TYPE, "%96", "%97", "%98", "%99", "%100",                \
               MB_WGMMA_ACC_TEXT_0 ", " MB_WGMMA_ACC_TEXT_1 ", " MB_WGMMA_ACC_TEXT_2, \
               MB_WGMMA_ACC_BIND_0, MB_WGMMA_ACC_BIND_1, MB_WGMMA_ACC_BIND_2)

#define MB_WGMMA_M64N128K16(TYPE)                                                 \
  MB_WGMMA_F32("m64n128k16", TYPE, "%64", "%65", "%66", "%67", "%68",             \
               MB_WGMMA_ACC_TEXT_0 ", " MB_WGMMA_ACC_TEXT_1, MB_WGMMA_ACC_BIND_0, \
               MB_WGMMA_ACC_BIND_1)

// D[64 x N] (+)= A[64x16] * B[16 x N] for N = 192 or 128 (the ping-pong rows kernel's tiles):
// as wgmma_m64n256k16, with N / 2 accumulators a thread in the same fragment order.
template <typename T, int N, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64nk16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                              int scale_d) {
  static_assert(N == 192 || N == 128, "wgmma_m64nk16: N = 192 or 128");
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  if constexpr (N == 192) {
    if constexpr (kBf16) {
      MB_WGMMA_M64N192K16("bf16");
    } else {
      MB_WGMMA_M64N192K16("f16");
    }
  } else {
    if constexpr (kBf16) {
      MB_WGMMA_M64N128K16("bf16");
    } else {
      MB_WGMMA_M64N128K16("f16");
    }
  }
}
#undef MB_WGMMA_M64N192K16
#undef MB_WGMMA_M64N128K16
#undef MB_WGMMA_F32
#undef MB_WGMMA_ACC_TEXT_0
#undef MB_WGMMA_ACC_BIND_0
#undef MB_WGMMA_ACC_TEXT_1
#undef MB_WGMMA_ACC_BIND_1
#undef MB_WGMMA_ACC_TEXT_2
#undef MB_WGMMA_ACC_BIND_2
#undef MB_WGMMA_ACC_TEXT_3
#undef MB_WGMMA_ACC_BIND_3

// One k-step of a consumer warpgroup (kBK = 64: four m64n256k16) from the stage's descriptors,
// issued and committed; the caller waits. Inside a 128-byte swizzle row a K-major operand advances
// 32 bytes per 16 k (+2 in the descriptor's address field), an MN-major one 16 rows of 128 bytes
// (+2048 bytes, +128). accumulate = false overwrites D (a tile's first k-step).
template <typename T, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_kstep(float (&acc)[128], uint64_t desc_a, uint64_t desc_b,
                                            bool accumulate) {
  constexpr uint64_t kStepA = TRANS_A ? 128 : 2, kStepB = TRANS_B ? 128 : 2;
  fence_accumulators(acc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) {
    wgmma_m64n256k16<T, TRANS_A, TRANS_B>(acc, desc_a + kStepA * kk, desc_b + kStepB * kk,
                                          (accumulate || kk > 0) ? 1 : 0);
  }
  wgmma_commit();
}

// Two values rounded to T (round-to-nearest-even), packed with lo at the lower address: the same
// conversions as gemm.cuh's store2.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Two elements of one routed row as F2 / B4 store them, packed like pack2: row_value(w, v) of
// cuda_util.cuh for each, bit for bit, in four instructions a pair instead of five an element.
// row_value rounds the sum 0 + w * v to T and adds 0 again, which only turns a -0 into +0 (0 + x is
// x for every other x, NaN included, and rounding keeps the sign), so here w * v is rounded and
// packed by one conversion and the -0s are made +0 by x * 1 + 0 in T (exact for every other value,
// subnormals included: bf16x2 / f16x2 fma without .ftz keeps them).
template <typename T>
__device__ __forceinline__ uint32_t row_value_pair(float w, float v_lo, float v_hi) {
  const uint32_t rounded = pack2<T>(__fmul_rn(w, v_lo), __fmul_rn(w, v_hi));
  uint32_t out;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(out) : "r"(rounded), "r"(0x3f803f80u), "r"(0u));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(out) : "r"(rounded), "r"(0x3c003c00u), "r"(0u));
  }
  return out;
}

// Four 8 x 8 matrices of 16-bit elements from a warp's registers into shared memory
// (stmatrix.x4): lane i gives the address of row i & 7 of matrix i >> 3; register m of lane l holds
// that matrix's row l >> 2, columns 2 (l & 3) and 2 (l & 3) + 1 (the wgmma accumulator layout of
// one 8-column block), lower column at the lower address.
__device__ __forceinline__ void stmatrix_x4(uint32_t row_addr, uint32_t m0, uint32_t m1,
                                            uint32_t m2, uint32_t m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_addr),
               "r"(m0), "r"(m1), "r"(m2), "r"(m3)
               : "memory");
}

// A consumer warp's 16 rows of a 128 x 256 accumulator tile into the epilogue warps' hand-off
// (F1's and the rows kernels'): 64-column groups of 128 rows x 128 bytes, 16-byte chunk c of row
// r at r * 128 + ((c ^ (r & 7)) << 4), from group first_group on (the groups before it stay with
// the consumers; the buffer starts at first_group's). Register 4j + q of lane (g, t4) holds row
// g + 8 (q >> 1) of the warp's 16 (tile_row on), columns 8j + 2 t4 + (q & 1): per 8-column block j
// one 8 x 8 matrix of rows g and one of rows g + 8, so one stmatrix.x4 writes blocks j and j + 1,
// each matrix's 8 rows in 8 different bank quads. pack(rr, lo, hi) packs a row half's pair.
// tools/models/b1_epilogue_warps_model.py checks the addressing.
template <int kFirstGroup, typename Pack>
__device__ __forceinline__ void store_handoff(uint32_t handoff, int tile_row, int lane,
                                              const float (&acc)[128], Pack pack) {
  // This lane's address: row lane & 7 of matrix lane >> 3 (rows + 8 for matrices 1 and 3, block
  // j + 1 for matrices 2 and 3).
  const int row = tile_row + (lane & 7) + 8 * ((lane >> 3) & 1);
  const int block = lane >> 4;
#pragma unroll
  for (int j = 8 * kFirstGroup; j < 32; j += 2) {
    uint32_t m[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int jj = j + (q >> 1), rr = q & 1;
      m[q] = pack(rr, acc[4 * jj + 2 * rr], acc[4 * jj + 2 * rr + 1]);
    }
    const int jj = j + block;
    stmatrix_x4(handoff + uint32_t(((jj >> 3) - kFirstGroup) * kHandoffGroupBytes + row * 128 +
                                   (((jj & 7) ^ (row & 7)) << 4)),
                m[0], m[1], m[2], m[3]);
  }
}

// Two packed 16-bit values as floats (.x = the lower address).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t bits) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    // A bf16 is the top half of its float: one shift and one mask (__bfloat1622float2 compiled to
    // a shift, a byte permute and a second shift).
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
}

__device__ __forceinline__ int stage_fragment_word(int row, int jj, int t4) {
  return row * 32 + ((jj ^ (row & 7)) << 2) + t4;
}
__device__ __forceinline__ int stage_chunk_word(int row, int chunk) {
  return row * 32 + ((chunk ^ (row & 7)) << 2);
}

// A persistent grouped GEMM's linear tile id `t` -> its expert, routed rows and n-tile.
// tile_start[e] = first tile id of expert e (the prefix of ceil(count_e / BM) * n_tiles; an empty
// expert owns no id); inside an expert, tiles are rasterised in bands of `band` m-tiles that the
// n-tiles sweep, so the CTAs running at one time share A rows and B tiles in L2 (sm90_band_mtiles:
// a default by kernel and output width unless MOEBLAZE_CUDA_BAND_MTILES says otherwise; every
// role of a kernel decodes with the same).
struct GroupedTile {
  int e;
  int row0;    // first routed row
  int rows;    // valid rows (1..BM)
  int n_tile;  // output column tile
};

template <int BM>
__device__ __forceinline__ GroupedTile decode_grouped_tile(int t, const int* tile_start,
                                                           const int32_t* offsets, int E,
                                                           int n_tiles, int band) {
  int lo = 0, hi = E - 1;  // largest e with tile_start[e] <= t (never an empty expert)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int e = lo;
  const int off = __ldg(offsets + e);
  const int count = __ldg(offsets + e + 1) - off;
  const int m_tiles = (count + BM - 1) / BM;
  const int local = t - tile_start[e];
  const int band_index = local / (band * n_tiles);
  const int band_m0 = band_index * band;
  const int band_h = min(band, m_tiles - band_m0);
  const int r = local - band_index * band * n_tiles;
  const int m_tile = band_m0 + r % band_h;
  GroupedTile c;
  c.e = e;
  c.row0 = off + m_tile * BM;
  c.rows = min(BM, count - m_tile * BM);
  c.n_tile = r / band_h;
  return c;
}

// The inclusive prefix of tile_start[1..E] in place (tile_start[0] = 0), by warp 0 of the block:
// each lane sums a contiguous chunk, then one warp scan. The caller synchronises afterwards.
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

// The grouped tile schedule every CTA builds in its prologue from the device-side offsets (no
// host sync): tile_start[e] = expert e's first tile (ceil(count_e / BM) m-tiles times n_tiles
// each), tile_start[E] = the total, which it returns. Every thread of the block calls it; it
// synchronises the block before and after the prefix.
template <int BM, int kThreads>
__device__ __forceinline__ int build_tile_prefix(int* tile_start, const int32_t* offsets, int E,
                                                 int n_tiles, int tid, int warp, int lane) {
  for (int e = tid; e < E; e += kThreads) {
    const int count = __ldg(offsets + e + 1) - __ldg(offsets + e);
    tile_start[e + 1] = ((count + BM - 1) / BM) * n_tiles;
  }
  __syncthreads();
  if (warp == 0) warp_prefix_tiles(tile_start, E, lane);
  __syncthreads();
  return tile_start[E];
}

// The shared memory of the gathered-A pipelines (F1, and F2 / B4 / B1), in the order
// pipeline_smem_bytes (common.cuh) counts it: kStages stages of kStageBytes, 1024-byte aligned for
// the 128-byte swizzle atoms; the epilogue's buffer (the consumers' staging, or the epilogue warps'
// hand-off); the mbarriers; the E + 1 tile starts of the device-side schedule.
template <int kStages, int kStageBytes>
struct GatherPipelineSmem {
  uint8_t* base;
  uint8_t* epi;
  uint64_t* full_bar;       // [kStages]: the stage's TMA bytes landed
  uint64_t* empty_bar;      // [kStages]: every consumer warp is done with the stage
  uint64_t* a_full_bar;     // [2][kStages]: consumer warpgroup wg's gathered A half landed
  uint64_t* handoff_full;   // epilogue-warp forms: the consumers filled the hand-off
  uint64_t* handoff_empty;  // epilogue-warp forms: the epilogue warps read it
  int* tile_start;          // [E + 1]

  // Aligned by an offset from smem_raw, so the compiler still knows every derived pointer is
  // shared memory.
  __device__ __forceinline__ GatherPipelineSmem(uint8_t* smem_raw, int epilogue_bytes)
      : base(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u)),
        epi(base + kStages * kStageBytes),
        full_bar(reinterpret_cast<uint64_t*>(epi + epilogue_bytes)),
        empty_bar(full_bar + kStages),
        a_full_bar(empty_bar + kStages),
        handoff_full(a_full_bar + 2 * kStages),
        handoff_empty(handoff_full + 1),
        tile_start(reinterpret_cast<int*>(handoff_empty + 1)) {}

  __device__ __forceinline__ uint8_t* stage(int s) const { return base + s * kStageBytes; }

  // Set by one thread: per stage, full (the TMA thread's expect_tx: one arrival), empty (one
  // arrival per consumer warp of every CTA in the cluster: each CTA's producer fills a share of
  // the stage in all of them) and the two consumer warpgroups' A halves (one cp.async arrival per
  // consumer thread); the hand-off's full and empty take one arrival per THREAD (each releases its
  // own shared-memory accesses; with one arrival per warp after __syncwarp compute-sanitizer's
  // racecheck reports the hand-off as a hazard, although the PTX memory model orders it).
  __device__ __forceinline__ void init_barriers(int consumer_warps, int epi_warps,
                                                int cluster = 1) const {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_u32(full_bar + s), 1);
      mbar_init(smem_u32(empty_bar + s), consumer_warps * cluster);
      mbar_init(smem_u32(a_full_bar + s), 128);
      mbar_init(smem_u32(a_full_bar + kStages + s), 128);
    }
    mbar_init(smem_u32(handoff_full), 32 * consumer_warps);
    mbar_init(smem_u32(handoff_empty), 32 * epi_warps);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
};

// The gathered A operand of a 128-row tile, loaded by the two consumer warpgroups themselves:
// each loads the 64 rows that only its own wgmmas read (its 8 KB half of the stage's A tile), with
// 16-byte cp.async and zero-fill into the 128-byte swizzle, ahead of its wgmmas by a lead the
// kernel chooses: 4-stage kernels issue k-step it + 2 between k-step it's commit and its
// wgmma_wait<1> (into the slot of k-step it - 2), 3-stage ones k-step it + 2 after the wait (into
// the slot wgmma(it - 1) has just released); completion on a per-(warpgroup, slot) mbarrier of
// 128 .noinc arrivals, so no barrier crosses warpgroups for A.
// Why not the producer warpgroup: the gather's rate is limited per issuing warp (the loads one warp
// keeps in flight), not by L2 or shared memory; on the H200, conf3's F1 main loop took 8.30 ms
// with the producer's 4 warps gathering, 7.28 ms with the consumers' 8 and 6.24 ms with contiguous
// rows by TMA. Thread w of the warpgroup loads chunk w & 7 of rows (w >> 3) + 16
// i, i < 4, of its half. The cursor walks the same (tile, k-step) sequence as the consumer's main
// loop (tiles first_tile, + tile_step, ...: blockIdx.x, + gridDim.x for one CTA, the cluster's
// index and count for clusters), and fetches the token ids of the following tile one tile ahead.
// RowRange: tile id -> int2 {first routed row, valid rows}.
template <typename T>
class HalfTileGather {
 public:
  // src [*, ld]: the rows gathered by token id; k_len: valid k (columns past it read as zeros);
  // k_tiles: k-steps per tile; wg: 0 or 1, the consumer warpgroup (rows [64 wg, 64 wg + 64)).
  // ld < 2^31 (the kernels' int-range checks).
  __device__ __forceinline__ HalfTileGather(const T* src, int64_t ld, int k_len, int k_tiles,
                                            const int32_t* token_index, int total_tiles, int wg,
                                            int first_tile, int tile_step)
      : src_(src),
        row_bytes_(uint32_t(ld) * uint32_t(sizeof(T))),
        k_len_(k_len),
        k_tiles_(k_tiles),
        token_index_(token_index),
        total_tiles_(total_tiles),
        wg_(wg),
        first_tile_(first_tile),
        tile_step_(tile_step) {}

  // Positions the cursor on the CTA's first tile, k-step 0; issues nothing.
  template <class RowRange>
  __device__ __forceinline__ void start(RowRange&& row_range) {
    tile_ = first_tile_;
    kt_ = 0;
    const int w = int(threadIdx.x) & 127;
    const int chunk = w & 7, row = w >> 3;
    // Rows row + 16 i share row & 7 (64 % 8 == 0), so their swizzled chunks are i * 2 KB apart.
    smem_off_ =
        uint32_t(wg_) * (64u * 128u) + uint32_t(row) * 128u + uint32_t((chunk ^ (row & 7)) << 4);
    col_ = chunk * 8;
    // Opaque to the compiler from here: kept in registers, not recomputed from threadIdx every
    // k-step (ptxas rematerialised both, nine instructions a k-step).
    asm volatile("" : "+r"(smem_off_), "+r"(col_));
    fetch_ids(ids_, tile_, row_range);
    fetch_ids(next_ids_, tile_ + tile_step_, row_range);
  }

  // Issues the cursor's k-step into this warpgroup's half of the A tile at shared address a_tile
  // (1024-byte aligned), completing on `bar`, and advances the cursor. Past the last tile: nothing.
  template <class RowRange>
  __device__ __forceinline__ void issue(uint32_t a_tile, uint32_t bar, RowRange&& row_range) {
    if (tile_ >= total_tiles_) return;
    // The thread's shared offset and column are kept from start(), not recomputed each k-step.
    const int k = kt_ * kBK + col_;
    const bool k_ok = k < k_len_;
    const uint32_t dst = a_tile + smem_off_;
    const T* src_k = src_ + k;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // Row 0 stands in for a zero-filled chunk (nothing is read).
      const bool ok = k_ok && ids_[i] >= 0;
      const uint32_t id = ok ? uint32_t(ids_[i]) : 0u;
      cp_async16_zfill(dst + uint32_t(i) * 2048u, gathered_row(src_k, id, row_bytes_), ok);
    }
    cp_async_mbar_arrive_noinc(bar);
    if (++kt_ == k_tiles_) {
      kt_ = 0;
      tile_ += tile_step_;
#pragma unroll
      for (int i = 0; i < 4; ++i) ids_[i] = next_ids_[i];
      fetch_ids(next_ids_, tile_ + tile_step_, row_range);
    }
  }

 private:
  template <class RowRange>
  __device__ __forceinline__ void fetch_ids(int (&ids)[4], int tile, RowRange& row_range) const {
    if (tile >= total_tiles_) return;
    const int2 range = row_range(tile);
    const int row = (int(threadIdx.x) & 127) >> 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 64 * wg_ + row + 16 * i;
      ids[i] = r < range.y ? __ldg(token_index_ + range.x + r) : -1;
    }
  }

  static_assert(sizeof(T) == 2, "row_bytes_ < 2^32 needs ld < 2^31 and 2-byte elements");
  const T* src_;
  uint32_t row_bytes_;  // bytes between gathered rows
  int k_len_, k_tiles_;
  const int32_t* token_index_;
  int total_tiles_, wg_;
  int first_tile_, tile_step_;
  int tile_ = 0, kt_ = 0;
  uint32_t smem_off_ = 0;  // the thread's chunk of row 0 in the warpgroup's half
  int col_ = 0;            // the thread's first column within a k-step
  int ids_[4] = {-1, -1, -1, -1};
  int next_ids_[4] = {-1, -1, -1, -1};
};

#endif  // MB_SM90_DEVICE

// ---- host ---------------------------------------------------------------------------------------

typedef CUresult (*EncodeTiledFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                  const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                  const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder through the runtime (no libcuda link); nullptr if unavailable.
inline EncodeTiledFn tensor_map_encoder() {
  static const EncodeTiledFn fn = [] {
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    void* ptr = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return EncodeTiledFn(nullptr);
    }
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

}  // namespace sm90
}  // namespace cuda
}  // namespace moeblaze
