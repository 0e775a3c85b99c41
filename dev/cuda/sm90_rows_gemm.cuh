// Kernel workshop, round 3: the rows-M grouped GEMMs F2, B4 and B1 on Hopper (sm_90a).
// Included by sm90_f2_gemm.cu, sm90_b4_gemm.cu and sm90_b1_gemm.cu (each is a one-line main that
// picks a Kind); everything lives here so the three programs share one kernel, one oracle and one
// test harness. Read with dev/cuda/sm90_gather_gemm.cu (round 1, F1): the pipeline, the scheduler
// and the test discipline are the same; what is new is the MN-major (transposed) B operand, the
// TMA-loaded (not gathered) A operand with a K split into halves, and the fp32 row outputs.
//
// The problems (bf16 in, fp32 accumulate, fp32 [N, n_out] rows out, as the library's transients),
// for expert e and routed rows r in [off[e], off[e+1]):
//   F2: y2[r]   = u[r] . w_down[e]^T             u [N, h], w_down [E, d, h]: K = h, n_out = d,
//                                                 B K-major (n rows of h contiguous), like F1.
//   B4: dxr[r]  = da[r] . w_gate[e] + db[r] . w_up[e]
//                                                 da|db [N, 2h] (da at [0, h), db at [h, 2h)),
//                                                 w_gate / w_up [E, h, d]: K = 2h in two halves,
//                                                 n_out = d, B MN-major (k rows of d contiguous).
//   B1: v[r]    = dy[tok_r] . w_down[e]           dy [T, d] gathered by expert_token_indices,
//                                                 w_down [E, d, h]: K = d, n_out = h, B MN-major.
//       Two epilogues: kEpiRowsF32 writes v as fp32 rows (a main-loop measurement, "B1"), and
//       kEpiB1SwiGLU is the library's B1 epilogue for SwiGLU with saved a, b ("B1-full"): reads
//       a, b, g[row_pair[r]]; writes da|db [N, 2h] and g*u [N, h] (bf16, rounded once) and the
//       per-n-tile dg partials dg_part[n_tile][r] = sum over the tile's columns of v * u.
//
// Kernel rows_sm90_kernel<A_GATHER, B_MN, EPI, CLUSTER>:
//   - persistent grid (one CTA / cluster per SM / SM pair), the tile prefix built from the
//     device-side expert_offsets in every CTA's prologue (no host sync), tile id -> (expert,
//     m-tile, n-tile) by binary search, rasterised in bands of 8 m-tiles (round 1's scheduler);
//   - version 1: CLUSTER = 1. Version 2: CLUSTER = 2 (round 1's v3 scheme): the two CTAs take two
//     adjacent m-tiles of one expert and the same n-tile; CTA `rank` issues the B boxes rank,
//     rank + 2, ... multicast to both, each CTA expects all B bytes; a stage is free once the
//     consumers of both CTAs released it (remote arrivals, empty count 16); cluster syncs after
//     barrier init and before exit;
//   - tile 128 rows x 256 columns x 64 k, 4 stages of 48 KB (A 16 KB + B 32 KB);
//   - 384 threads: warpgroup 0 produces (setmaxnreg 40), warpgroups 1, 2 consume 64 rows each with
//     wgmma.m64n256k16 (128 fp32 accumulators per thread, setmaxnreg 232);
//   - A, not gathered (F2, B4): one TMA box per stage from a 3-D map {k_half, halves, N} of the
//     [N, halves * k_half] rows, box {64, 1, 128}: k past k_half is zero-filled inside each half
//     (B4's da / db boundary needs no h % 64), rows past N are zero-filled, rows of the next expert
//     in a ragged last m-tile are read but their results are never stored;
//   - A, gathered (B1): round 1's producer: 128 threads, 16-byte cp.async.cg with zero-fill into the
//     128-byte swizzle, one cp.async.mbarrier.arrive.noinc per thread; consumers fence.proxy.async
//     after the full wait (round 1's v1, the one promoted to the library);
//   - B, K-major (F2): two TMA boxes {64 k, 128 n, 1} of the 3-D map {k_half, n_out, E}, side by
//     side (256 rows of 128 bytes), 128B swizzle; the wgmma descriptor is round 1's (SBO 1024,
//     +32 bytes per 16 k);
//   - B, MN-major (B4, B1): four TMA boxes {64 n, 64 k, 1} of the map {n_out, k_half, E} (one per 64
//     columns; a box that starts past n_out is not issued and its bytes are not expected), each box
//     64 k-rows of 128 bytes, 128B swizzle: exactly CUTLASS's Layout_MN_SW128_Atom tiled 4 x along
//     N. The descriptor (CUTLASS make_gmma_desc<Major::MN>, B128: ((T,8,m),(8,k)):((1,T,LBO),(8T,
//     SBO))): LBO = 8192 bytes between the 64-column boxes, SBO = 1024 bytes between groups of 8
//     k-rows, +2048 bytes per 16 k; the instruction's imm-trans-b = 1;
//   - B4's K runs over two halves: k-tile kt < kt_half reads da and w_gate, the rest db and w_up
//     (a second pair of coordinates and a second B map), so one accumulator sums both;
//   - epilogue: fp32 accumulators stored straight from registers as float2 (each quad of lanes
//     writes one full 32-byte sector of a row), rows past the expert's count and columns past n_out
//     predicated off. No shared-memory staging is needed for fp32 sector-complete stores.
// Preconditions (host-checked): n_out % 8 == 0, k_half % 8 == 0 (16-byte TMA strides and cp.async
// rows), E <= kMaxExperts, sm_90a; pointers 16-byte aligned (cudaMalloc here; TMA needs it).

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

#define CUDA_CHECK(call)                                                                \
  do {                                                                                  \
    cudaError_t err_ = (call);                                                          \
    if (err_ != cudaSuccess) {                                                          \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(err_), __FILE__, \
              __LINE__, cudaGetErrorString(err_));                                      \
      exit(1);                                                                          \
    }                                                                                   \
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

enum class Kind { F2, B4, B1 };

static const char* kind_name(Kind k) {
  return k == Kind::F2 ? "F2" : (k == Kind::B4 ? "B4" : "B1");
}

// ---------------------------------------------------------------------------------------------
// device helpers (as in round 1)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Traps after 2^24 polls (a second or more) instead of hanging the device run. No printf in the
// kernel: it makes ptxas serialise the wgmmas (C7510).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  uint32_t polls = 0;
  do {
    if (++polls == (1u << 24)) __trap();
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

__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: zero-filled, src not read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
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

// Same box, written to the same shared-memory offset of every CTA in cta_mask; each CTA's barrier
// at `bar`'s offset receives the bytes it got.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map,
                                                      uint32_t bar, int c0, int c1, int c2,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(cta_mask)
      : "memory");
}

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_id_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t num_clusters_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
  return r;
}

// Arrive on the barrier at the same offset in CTA `rank` of the cluster (rank may be our own).
// Plain (not .release.cluster) arrive, as round 1 v3 and CUTLASS's ClusterBarrier::arrive(cta_id).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}

// Not .aligned: at the end of the kernel the producer warp may arrive divergent (one issuing
// thread), and this form has no convergence requirement.
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
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

__device__ __forceinline__ void fence_accumulators(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// K-major operand, 128B swizzle: rows of 128 bytes (64 bf16 of k), 8-row groups 1024 bytes apart
// (SBO); LBO unused for swizzled K-major (1). +32 bytes (+2 in the field) per 16 k.
__device__ __forceinline__ uint64_t smem_desc_kmajor_sw128(uint32_t addr) {
  uint64_t desc = 0;
  desc |= uint64_t((addr & 0x3FFFF) >> 4);
  desc |= uint64_t(1) << 16;          // LBO (ignored)
  desc |= uint64_t(1024 >> 4) << 32;  // SBO
  desc |= uint64_t(1) << 62;          // SWIZZLE_128B
  return desc;
}

// MN-major operand, 128B swizzle (CUTLASS Layout_MN_SW128_Atom: 64 MN elements x 8 k, each k a
// 128-byte row): LBO = bytes between 64-element MN atoms (our TMA boxes, 8 KB apart), SBO = bytes
// between groups of 8 k-rows (1024). +2048 bytes (+128 in the field) per 16 k.
// lbo / sbo come from the host (RowsParams): 8192 / 1024 by default; `--mn-desc swapped` passes
// 1024 / 8192, a hedge in case the hardware reads the two fields the other way round (nothing
// here has run on a GPU yet: the run script tries the swapped form only if the default fails).
__device__ __forceinline__ uint64_t smem_desc_mnmajor_sw128(uint32_t addr, uint32_t lbo,
                                                            uint32_t sbo) {
  uint64_t desc = 0;
  desc |= uint64_t((addr & 0x3FFFF) >> 4);
  desc |= uint64_t((lbo >> 4) & 0x3FFF) << 16;  // LBO: next 64 columns (8192)
  desc |= uint64_t((sbo >> 4) & 0x3FFF) << 32;  // SBO: next 8 k-rows (1024)
  desc |= uint64_t(1) << 62;                    // SWIZZLE_128B
  return desc;
}

// D[64x256] (+)= A[64x16] * B[16x256]; A K-major; B K-major (TRANS_B 0) or MN-major (1).
template <int TRANS_B>
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
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, %131;\n}\n"
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
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
}

// ---------------------------------------------------------------------------------------------
// the kernel

constexpr int kBM = 128;  // routed rows per tile
constexpr int kBN = 256;  // output columns per tile
constexpr int kBK = 64;   // k per stage: one 128-byte swizzle row of bf16
constexpr int kStages = 4;
constexpr int kThreads = 384;  // warpgroup 0: producer; 1, 2: consumers
constexpr int kProducerThreads = 128;
constexpr int kConsumerWarps = 8;
constexpr int kBandMTiles = 8;
constexpr int kMaxExperts = 4096;

constexpr int kATileBytes = kBM * kBK * 2;  // 16 KB
constexpr int kBTileBytes = kBN * kBK * 2;  // 32 KB
constexpr int kBMnBoxBytes = 64 * kBK * 2;  // 8 KB: one 64-column box of an MN-major B
constexpr int kBKBoxRows = 128;                     // K-major B: two boxes of 128 rows of n
constexpr int kBKBoxBytes = kBKBoxRows * kBK * 2;   // 16 KB
constexpr int kStageBytes = kATileBytes + kBTileBytes;
constexpr int kPipeBytes = kStages * kStageBytes;  // 192 KB
constexpr int kBarrierBytes = 2 * kStages * 8;
constexpr int kTokenBytes = kBM * 4;

static size_t rows_sm90_smem_bytes(int E) {
  return 1024 /* alignment slack */ + kPipeBytes + kBarrierBytes + kTokenBytes +
         sizeof(int) * size_t(E + 1);
}

struct RowsParams {
  const bf16* a_src;           // gathered A only: [T, lda] source rows
  const int32_t* offsets;      // [E + 1]
  const int32_t* token_index;  // [N] (gathered A only)
  float* out;                  // [N, n_out] fp32 rows
  int n_out;                   // output columns
  int k_half;                  // K of one half (K total = halves * k_half)
  int halves;                  // 2 for B4 (da . w_gate + db . w_up), else 1
  int lda;                     // gathered A: elements per source row
  int E;
  int n_tiles;  // ceil(n_out / kBN)
  int kt_half;  // ceil(k_half / kBK)
  uint32_t b_lbo, b_sbo;  // MN-major B descriptor strides in bytes (8192, 1024)
  // B1's SwiGLU epilogue (EPI == kEpiB1SwiGLU), the library's SAVE_PREACT form: a, b saved, u
  // recomputed. Rows are routed rows (expert-sorted), h = n_out.
  const bf16* b1_a;           // [N, h]
  const bf16* b1_b;           // [N, h]
  const float* b1_g;          // [T*k] routing weights, read at row_pair[r]
  const int32_t* b1_row_pair; // [N]
  bf16* b1_dadb;              // [N, 2h]: da at [0, h), db at [h, 2h)
  bf16* b1_gu;                // [N, h]: g * u
  float* b1_dg_part;          // [n_tiles, N]: per 256-column n-tile, sum_n v * u
  int N;                      // routed rows (dg_part row stride)
};

// Epilogues: fp32 rows of the GEMM result (F2, B4, B1's v); B1's SwiGLU backward epilogue.
enum : int { kEpiRowsF32 = 0, kEpiB1SwiGLU = 1 };

// The contract's formulas (src/common/activation_math.hpp, float): accurate expf, IEEE division.
__device__ __forceinline__ float sigmoid_dev(float a) { return 1.f / (1.f + expf(-a)); }
__device__ __forceinline__ float bf16_round(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (lower address)
  return *reinterpret_cast<const uint32_t*>(&v);
}

// One element of B1's epilogue (SwiGLU, u recomputed from the saved a, b):
//   u = round(silu(a) * b); dot += v * u; du = g * v; da = du * b * silu'(a); db = du * silu(a);
//   gu = g * u. Returns (da, db, gu) unrounded; the caller rounds once when packing.
__device__ __forceinline__ void b1_swiglu(float v, float a, float b, float gval, float& dot,
                                          float& da, float& db, float& gu) {
  const float s = sigmoid_dev(a);
  const float silu = a * s;
  const float u = bf16_round(silu * b);
  dot += v * u;
  const float du = gval * v;
  da = du * b * (s * (1.f + a * (1.f - s)));
  db = du * silu;
  gu = gval * u;
}

struct TileCoord {
  int e, row0, rows, n0;
};

// A scheduled tile is a group of CLUSTER vertically adjacent m-tiles of one expert and one n-tile;
// CTA `rank` takes m-tile CLUSTER * group + rank (it may have no rows: it then runs the pipeline
// for the multicast B and stores nothing). tile_start = prefix of ceil(m_tiles / CLUSTER) * n_tiles.
template <int CLUSTER>
__device__ __forceinline__ TileCoord decode_tile(int t, const int* tile_start, const RowsParams& p,
                                                 int rank) {
  int lo = 0, hi = p.E - 1;  // largest e with tile_start[e] <= t (never an empty expert)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int e = lo;
  const int off = __ldg(p.offsets + e);
  const int count = __ldg(p.offsets + e + 1) - off;
  const int m_groups = (count + kBM * CLUSTER - 1) / (kBM * CLUSTER);
  constexpr int kBandGroups = kBandMTiles / CLUSTER;
  const int local = t - tile_start[e];
  const int band = local / (kBandGroups * p.n_tiles);
  const int band_m0 = band * kBandGroups;
  const int band_h = min(kBandGroups, m_groups - band_m0);
  const int r = local - band * kBandGroups * p.n_tiles;
  const int m_tile = (band_m0 + r % band_h) * CLUSTER + rank;
  TileCoord c;
  c.e = e;
  c.row0 = off + m_tile * kBM;
  c.rows = max(0, min(kBM, count - m_tile * kBM));
  c.n0 = (r / band_h) * kBN;
  return c;
}

// A stage is free once the consumers of every CTA of the cluster released it (a peer's producer
// multicasts into our stage after its own empty wait).
template <int CLUSTER>
__device__ __forceinline__ void release_stage(uint32_t empty_bar) {
  if (CLUSTER == 1) {
    mbar_arrive(empty_bar);
  } else {
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) mbar_arrive_cluster(empty_bar, r);
  }
}

// A_GATHER: A rows gathered with cp.async from a_src[token_index[r]] (B1), else TMA from tmap_a.
// B_MN: B MN-major (four 64-column TMA boxes, transposed-B wgmma), else K-major (one box).
template <bool A_GATHER, bool B_MN, int EPI, int CLUSTER>
__global__ void __launch_bounds__(kThreads, 1)
    rows_sm90_kernel(const __grid_constant__ CUtensorMap tmap_a,
                     const __grid_constant__ CUtensorMap tmap_b0,
                     const __grid_constant__ CUtensorMap tmap_b1, const RowsParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + kPipeBytes);
  uint64_t* empty_bar = full_bar + kStages;
  int* tok_s = reinterpret_cast<int*>(empty_bar + kStages);  // [kBM]
  int* tile_start = tok_s + kBM;                             // [E + 1]

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      // gathered: 128 cp.async arrivals + the TMA thread's expect_tx; TMA only: expect_tx alone.
      mbar_init(smem_u32(full_bar + s), A_GATHER ? kProducerThreads + 1 : 1);
      mbar_init(smem_u32(empty_bar + s), kConsumerWarps * CLUSTER);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  for (int e = tid; e < p.E; e += kThreads) {
    const int count = __ldg(p.offsets + e + 1) - __ldg(p.offsets + e);
    tile_start[e + 1] = ((count + kBM * CLUSTER - 1) / (kBM * CLUSTER)) * p.n_tiles;
  }
  __syncthreads();
  if (warp == 0) {  // inclusive scan of tile_start[1..E]
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
  if (CLUSTER > 1) cluster_sync_all();  // also a CTA barrier; the peer's barriers are initialised
  else __syncthreads();
  const int total_tiles = tile_start[p.E];
  const int k_tiles = p.halves * p.kt_half;
  const int rank = CLUSTER > 1 ? int(cluster_ctarank()) : 0;
  const int first_tile = CLUSTER > 1 ? int(cluster_id_x()) : int(blockIdx.x);
  const int tile_stride = CLUSTER > 1 ? int(num_clusters_x()) : int(gridDim.x);

  if (warp < 4) {
    // ================= producer warpgroup =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    // TMA only: one thread issues everything; the others wait at the final cluster barrier
    // (CLUSTER > 1) or exit.
    if (!A_GATHER && tid != 0 && CLUSTER == 1) return;
    const bool producing = A_GATHER || tid == 0;
    const int chunk = tid & 7;
    const int row_base = tid >> 3;
    uint32_t it = 0;
    for (int t = first_tile; producing && t < total_tiles; t += tile_stride) {
      const TileCoord c = decode_tile<CLUSTER>(t, tile_start, p, rank);
      if (A_GATHER) {
        asm volatile("bar.sync 1, 128;\n" ::: "memory");  // previous tile's ids no longer read
        tok_s[tid] = tid < c.rows ? __ldg(p.token_index + c.row0 + tid) : -1;
        asm volatile("bar.sync 1, 128;\n" ::: "memory");
      }
      // B boxes (MN-major: 64 columns each; K-major: 128 rows each) that start past n_out are
      // not issued (nor expected): their columns are never stored, and columns of a GEMM are
      // independent. With a cluster, CTA `rank` issues boxes rank, rank + CLUSTER, ... multicast
      // to every CTA; each CTA expects the bytes of all boxes (the same n0 in every CTA).
      const int box_cols = B_MN ? 64 : kBKBoxRows;
      const int b_boxes = min(kBN / box_cols, (p.n_out - c.n0 + box_cols - 1) / box_cols);
      const uint32_t box_bytes = B_MN ? uint32_t(kBMnBoxBytes) : uint32_t(kBKBoxBytes);
      const uint32_t b_bytes = uint32_t(b_boxes) * box_bytes;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        const int half = kt >= p.kt_half ? 1 : 0;
        const int k0 = (kt - half * p.kt_half) * kBK;
        mbar_wait(smem_u32(empty_bar + s), ((it / kStages) & 1) ^ 1);
        uint8_t* stage = smem + s * kStageBytes;
        const uint32_t full = smem_u32(full_bar + s);
        if (tid == 0) {
          // The idle CTA of a cluster's last group (c.rows == 0; its row0 may be past N) loads no
          // A: its stale A rows only reach accumulator rows that are never stored.
          const bool a_tma = !A_GATHER && c.rows > 0;
          mbar_arrive_expect_tx(full, b_bytes + (a_tma ? uint32_t(kATileBytes) : 0u));
          if (a_tma) tma_load_3d(smem_u32(stage), &tmap_a, full, k0, half, c.row0);
          const CUtensorMap* mb = half ? &tmap_b1 : &tmap_b0;
          for (int i = rank; i < b_boxes; i += CLUSTER) {
            const uint32_t dst = smem_u32(stage + kATileBytes + i * box_bytes);
            const int cb0 = B_MN ? c.n0 + 64 * i : k0;           // MN: {n, k, e}
            const int cb1 = B_MN ? k0 : c.n0 + kBKBoxRows * i;   // K:  {k, n, e}
            if (CLUSTER == 1) tma_load_3d(dst, mb, full, cb0, cb1, c.e);
            else tma_load_3d_multicast(dst, mb, full, cb0, cb1, c.e, uint16_t((1u << CLUSTER) - 1));
          }
        }
        if (A_GATHER) {
          const int k = k0 + chunk * 8;
          const bool k_ok = k < p.k_half;
          const uint32_t a_tile = smem_u32(stage);
#pragma unroll
          for (int i = 0; i < kBM / 16; ++i) {
            const int r = row_base + 16 * i;
            const int tok = tok_s[r];
            const bool ok = k_ok && tok >= 0;
            const bf16* src = ok ? p.a_src + size_t(tok) * p.lda + k : p.a_src;
            cp_async16_zfill(a_tile + r * 128 + ((chunk ^ (r & 7)) << 4), src, ok);
          }
          cp_async_mbar_arrive_noinc(full);
        }
      }
    }
    if (A_GATHER) asm volatile("cp.async.wait_all;\n" ::: "memory");
    if (CLUSTER > 1) __syncwarp();  // (CLUSTER == 1: lanes 1..31 of warp 0 may have exited)
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
    for (int t = first_tile; t < total_tiles; t += tile_stride) {
      const TileCoord c = decode_tile<CLUSTER>(t, tile_start, p, rank);
      int prev_s = 0;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(smem_u32(full_bar + s), (it / kStages) & 1);
        // cp.async (generic proxy) wrote A; wgmma reads through the async proxy.
        if (A_GATHER) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        const uint32_t stage = smem_u32(smem + s * kStageBytes);
        const uint64_t desc_a = smem_desc_kmajor_sw128(stage + wg * (kATileBytes / 2));
        const uint64_t desc_b = B_MN ? smem_desc_mnmajor_sw128(stage + kATileBytes, p.b_lbo, p.b_sbo)
                                     : smem_desc_kmajor_sw128(stage + kATileBytes);
        fence_accumulators(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          // A: +32 bytes per 16 k inside the swizzle row. B K-major: the same; B MN-major: 16
          // k-rows of 128 bytes = +2048 bytes.
          const uint64_t db = desc_b + (B_MN ? uint64_t(128 * kk) : uint64_t(2 * kk));
          wgmma_m64n256k16<B_MN ? 1 : 0>(acc, desc_a + 2 * kk, db, (kt > 0 || kk > 0) ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_accumulators(acc);
        if (kt > 0 && lane == 0) release_stage<CLUSTER>(smem_u32(empty_bar + prev_s));
        prev_s = s;
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (lane == 0) release_stage<CLUSTER>(smem_u32(empty_bar + prev_s));

      // ---- epilogue: register 4j + q of lane (g, t4) holds row g (q < 2) or g + 8 (q >= 2),
      // column 8j + 2 t4 + (q & 1). A quad writes 32 contiguous bytes of a row: whole sectors.
      const int tile_row = wg * 64 + warp_in_wg * 16;
      if constexpr (EPI == kEpiB1SwiGLU) {
        // B1: each thread owns rows g, g + 8 and column pairs 8j + 2 t4 (j < 32) of the tile. It
        // loads a, b of 8 pairs (16 independent 4-byte loads) before computing any of them; a
        // quad covers 16 contiguous bytes of a row per j. dg: the quad's lanes hold all 256
        // columns of a row, so two shuffles finish the row's partial for this n-tile.
        const int h = p.n_out;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int row = tile_row + g + 8 * rr;
          const bool row_ok = row < c.rows;
          const size_t grow = size_t(c.row0) + (row_ok ? row : 0);
          const float gval = row_ok ? __ldg(p.b1_g + __ldg(p.b1_row_pair + grow)) : 0.f;
          const size_t ab_at = grow * h + c.n0 + 2 * t4;
          bf16* dadb_row = p.b1_dadb + grow * 2 * h + c.n0 + 2 * t4;
          bf16* gu_row = p.b1_gu + ab_at;
          float dot = 0.f;
#pragma unroll
          for (int j0 = 0; j0 < 32; j0 += 8) {
            uint32_t ra[8], rb[8];
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
              const int j = j0 + jj;
              const bool ok = row_ok && c.n0 + 8 * j < h;
              ra[jj] = ok ? *reinterpret_cast<const uint32_t*>(p.b1_a + ab_at + 8 * j) : 0u;
              rb[jj] = ok ? *reinterpret_cast<const uint32_t*>(p.b1_b + ab_at + 8 * j) : 0u;
            }
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
              const int j = j0 + jj;
              if (!(row_ok && c.n0 + 8 * j < h)) continue;
              const float2 af = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ra[jj]));
              const float2 bf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&rb[jj]));
              float da0, db0, gu0, da1, db1, gu1;
              b1_swiglu(acc[4 * j + 2 * rr], af.x, bf.x, gval, dot, da0, db0, gu0);
              b1_swiglu(acc[4 * j + 2 * rr + 1], af.y, bf.y, gval, dot, da1, db1, gu1);
              *reinterpret_cast<uint32_t*>(dadb_row + 8 * j) = pack_bf16x2(da0, da1);
              *reinterpret_cast<uint32_t*>(dadb_row + h + 8 * j) = pack_bf16x2(db0, db1);
              *reinterpret_cast<uint32_t*>(gu_row + 8 * j) = pack_bf16x2(gu0, gu1);
            }
          }
          dot += __shfl_xor_sync(0xffffffffu, dot, 1);
          dot += __shfl_xor_sync(0xffffffffu, dot, 2);
          if (row_ok && t4 == 0)
            p.b1_dg_part[size_t(c.n0 / kBN) * p.N + grow] = dot;
        }
      } else {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int row = tile_row + g + 8 * rr;
          if (row < c.rows) {
            float* orow = p.out + size_t(c.row0 + row) * p.n_out + c.n0 + 2 * t4;
#pragma unroll
            for (int j = 0; j < 32; ++j) {
              if (c.n0 + 8 * j < p.n_out)  // n_out % 8 == 0: a pair is all in or all out
                *reinterpret_cast<float2*>(orow + 8 * j) =
                    make_float2(acc[4 * j + 2 * rr], acc[4 * j + 2 * rr + 1]);
            }
          }
        }
      }
    }
  }
  // The peer may still multicast into our stages and arrive on our empty barriers (and we on
  // its) until both CTAs are done.
  if (CLUSTER > 1) cluster_sync_all();
}

// ---------------------------------------------------------------------------------------------
// kernel 0: SIMT fp32 oracle. C[r, n] = sum_k A(r, k) B(e_r, k, n) with
//   A(r, k) = a_src[(gather ? tok[r] : r) * lda + k],  k < halves * k_half = K
//   B(e, k, n) = w_{k / k_half}: MN-major [E, k_half, n_out] at (e, k % k_half, n),
//                                K-major  [E, n_out, k_half] at (e, n, k % k_half).

struct OracleArgs {
  const bf16* a_src;
  const int32_t* token_index;  // nullptr: row r itself
  const bf16* w0;
  const bf16* w1;
  const int32_t* offsets;
  int N, lda, k_half, halves, n_out, E;
  bool b_mn;
};

__device__ __forceinline__ float oracle_b(const OracleArgs& o, int e, int k, int n) {
  const int half = k / o.k_half, kk = k - half * o.k_half;
  const bf16* w = half ? o.w1 : o.w0;
  const size_t idx = o.b_mn ? (size_t(e) * o.k_half + kk) * o.n_out + n
                            : (size_t(e) * o.n_out + n) * o.k_half + kk;
  return __bfloat162float(w[idx]);
}

constexpr int kRefTile = 64, kRefK = 16;

__global__ void __launch_bounds__(256) oracle_kernel(const OracleArgs o, float* ref) {
  __shared__ float as[kRefK][kRefTile];
  __shared__ float bs[kRefK][kRefTile + 1];
  __shared__ int src_s[kRefTile], exp_s[kRefTile];
  const int row0 = blockIdx.y * kRefTile, n0 = blockIdx.x * kRefTile;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int K = o.halves * o.k_half;
  if (tid < kRefTile) {
    const int r = row0 + tid;
    int e = -1;
    if (r < o.N) {
      int lo = 0, hi = o.E - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (o.offsets[mid] <= r) lo = mid; else hi = mid - 1;
      }
      e = lo;
    }
    src_s[tid] = r < o.N ? (o.token_index ? o.token_index[r] : r) : 0;
    exp_s[tid] = e;
  }
  __syncthreads();
  float acc[4][4] = {};
  const int e_first = exp_s[0], e_last = exp_s[min(kRefTile, o.N - row0) - 1];
  for (int e = e_first; e <= e_last; ++e) {
    for (int k0 = 0; k0 < K; k0 += kRefK) {
      for (int i = tid; i < kRefK * kRefTile; i += 256) {
        const int rr = i / kRefK, kk = i % kRefK;
        const int k = k0 + kk;
        const bool ok = exp_s[rr] == e && k < K;
        as[kk][rr] = ok ? __bfloat162float(o.a_src[size_t(src_s[rr]) * o.lda + k]) : 0.f;
      }
      for (int i = tid; i < kRefK * kRefTile; i += 256) {
        // n fastest for MN-major (coalesced), k fastest for K-major
        const int kk = o.b_mn ? i / kRefTile : i % kRefK;
        const int nn = o.b_mn ? i % kRefTile : i / kRefK;
        const int k = k0 + kk, n = n0 + nn;
        bs[kk][nn] = (n < o.n_out && k < K) ? oracle_b(o, e, k, n) : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kRefK; ++kk) {
        float av[4], bv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) av[i] = as[kk][ty * 4 + i];
#pragma unroll
        for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx * 4 + j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = row0 + ty * 4 + i, n = n0 + tx * 4 + j;
      if (r < o.N && n < o.n_out) ref[size_t(r) * o.n_out + n] = acc[i][j];
    }
}

// ---------------------------------------------------------------------------------------------
// device utilities

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

struct CompareResult {
  unsigned long long nonfinite, mismatches;
  double err2, ref2;
  float max_abs;
};

// Tolerance: both sides are fp32 sums of the same exact bf16 x bf16 products in different orders
// (expected error ~1e-6 relative); a layout or k-tile bug gives errors of O(0.1..1).
__device__ __host__ __forceinline__ float out_tol(float ref) {
  return ldexpf(fabsf(ref), -8) + 2e-3f;
}

__global__ void compare_kernel(const float* got, const float* ref, size_t count,
                               CompareResult* res) {
  double e2 = 0, r2 = 0;
  unsigned long long nf = 0, mm = 0;
  float mx = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const float gv = got[i], rv = ref[i];
    if (!isfinite(gv)) { ++nf; continue; }
    const float diff = fabsf(gv - rv);
    if (!(diff <= out_tol(rv))) ++mm;
    e2 += double(diff) * diff;
    r2 += double(rv) * rv;
    mx = fmaxf(mx, diff);
  }
  atomicAdd(&res->nonfinite, nf);
  atomicAdd(&res->mismatches, mm);
  atomicAdd(&res->err2, e2);
  atomicAdd(&res->ref2, r2);
  atomicMax(reinterpret_cast<int*>(&res->max_abs), __float_as_int(mx));
}

__global__ void checksum_kernel(const uint32_t* words, size_t n, unsigned long long* out) {
  unsigned long long s = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    s += (unsigned long long)(words[i]) * (2 * (i & 0xffff) + 1);
  atomicAdd(out, s);
}

// ---------------------------------------------------------------------------------------------
// host: tensor maps

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

// A 3-D bf16 tensor, dim 0 contiguous; strides in elements (of dims 1 and 2); 128B swizzle.
static CUtensorMap make_map_3d(const bf16* base, uint64_t d0, uint64_t d1, uint64_t d2,
                               uint64_t stride1, uint64_t stride2, uint32_t box0, uint32_t box1,
                               uint32_t box2) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {d0, d1, d2};
  const cuuint64_t strides[2] = {stride1 * 2, stride2 * 2};
  const cuuint32_t box[3] = {box0, box1, box2};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = get_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
                                   const_cast<bf16*>(base), dims, strides, box, elem,
                                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  REQUIRE(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (%d)", int(r));
  return map;
}

// ---------------------------------------------------------------------------------------------
// problems

struct Shape {
  const char* name;
  int T, d, h, E, k;
};

static const Shape kShapes[] = {
    {"edge", 3001, 200, 264, 7, 2},  // k tail (264 % 64), n tail (200 % 64), ragged experts
    {"conf3", 65536, 1024, 4096, 16, 4},
    {"conf4", 32768, 2048, 8192, 16, 4},
    {"mixtral", 16384, 4096, 14336, 8, 2},
    {"qwen", 32768, 2048, 768, 128, 8},
};

// Uneven routing: expert weights 1..5 cyclically, expert 1 empty; each token picks k distinct
// experts; rows grouped by expert, tokens ascending inside an expert (round 1's generator).
static void make_routing(const Shape& s, uint64_t seed, std::vector<int32_t>& offsets,
                         std::vector<int32_t>& tokens) {
  std::mt19937_64 rng(seed);
  std::vector<double> weight(s.E);
  for (int e = 0; e < s.E; ++e) weight[e] = 1.0 + (e * 7 % 5);
  if (s.E > s.k + 1) weight[1] = 0.0;
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
      while (w[e] == 0) e = (e + s.E - 1) % s.E;
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
static bool g_mn_desc_swapped = false;  // --mn-desc swapped (see smem_desc_mnmajor_sw128)

static void fill(bf16* p, size_t n, uint64_t seed, float stddev) {
  fill_normal_bf16<<<4 * g_num_sms, 256>>>(p, n, seed, stddev);
  CUDA_CHECK(cudaGetLastError());
}

// One problem of a Kind, in the generic form of the oracle.
struct Problem {
  Kind kind;
  int T, d, h, E, k, N;
  int a_rows;   // rows of a_src (N, or T when gathered)
  int lda, k_half, halves, n_out;
  bool gather, b_mn;
  bf16 *a_src, *w0, *w1;  // w1 == nullptr unless halves == 2
  int32_t *offsets, *token_index;
  float* out;
  std::vector<int32_t> h_offsets, h_tokens;
};

static Problem make_problem(Kind kind, const Shape& s, uint64_t seed) {
  Problem P;
  P.kind = kind;
  P.T = s.T; P.d = s.d; P.h = s.h; P.E = s.E; P.k = s.k; P.N = s.T * s.k;
  make_routing(s, seed, P.h_offsets, P.h_tokens);
  switch (kind) {
    case Kind::F2:  // u [N, h] . w_down [E, d, h]^T
      P.gather = false; P.b_mn = false; P.a_rows = P.N; P.lda = s.h; P.k_half = s.h;
      P.halves = 1; P.n_out = s.d;
      break;
    case Kind::B4:  // [da|db] [N, 2h] . [w_gate; w_up] [E, h, d]
      P.gather = false; P.b_mn = true; P.a_rows = P.N; P.lda = 2 * s.h; P.k_half = s.h;
      P.halves = 2; P.n_out = s.d;
      break;
    case Kind::B1:  // dy[tok] [T, d] . w_down [E, d, h]
      P.gather = true; P.b_mn = true; P.a_rows = P.T; P.lda = s.d; P.k_half = s.d;
      P.halves = 1; P.n_out = s.h;
      break;
  }
  const size_t w_elems = size_t(P.E) * P.k_half * P.n_out;
  CUDA_CHECK(cudaMalloc(&P.a_src, size_t(P.a_rows) * P.lda * 2));
  CUDA_CHECK(cudaMalloc(&P.w0, w_elems * 2));
  P.w1 = nullptr;
  if (P.halves == 2) CUDA_CHECK(cudaMalloc(&P.w1, w_elems * 2));
  CUDA_CHECK(cudaMalloc(&P.offsets, sizeof(int32_t) * (P.E + 1)));
  CUDA_CHECK(cudaMalloc(&P.token_index, sizeof(int32_t) * P.N));
  CUDA_CHECK(cudaMalloc(&P.out, size_t(P.N) * P.n_out * 4));
  fill(P.a_src, size_t(P.a_rows) * P.lda, seed * 3 + 1, 1.f);
  const float wstd = 1.f / std::sqrt(float(P.halves * P.k_half));  // outputs ~ N(0, 1)
  fill(P.w0, w_elems, seed * 3 + 2, wstd);
  if (P.w1) fill(P.w1, w_elems, seed * 3 + 3, wstd);
  CUDA_CHECK(cudaMemcpy(P.offsets, P.h_offsets.data(), sizeof(int32_t) * (P.E + 1),
                        cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(P.token_index, P.h_tokens.data(), sizeof(int32_t) * P.N,
                        cudaMemcpyHostToDevice));
  return P;
}

static void free_problem(Problem& P) {
  cudaFree(P.a_src); cudaFree(P.w0); if (P.w1) cudaFree(P.w1);
  cudaFree(P.offsets); cudaFree(P.token_index); cudaFree(P.out);
}

static OracleArgs oracle_args(const Problem& P) {
  OracleArgs o;
  o.a_src = P.a_src;
  o.token_index = P.gather ? P.token_index : nullptr;
  o.w0 = P.w0;
  o.w1 = P.w1 ? P.w1 : P.w0;
  o.offsets = P.offsets;
  o.N = P.N; o.lda = P.lda; o.k_half = P.k_half; o.halves = P.halves; o.n_out = P.n_out;
  o.E = P.E; o.b_mn = P.b_mn;
  return o;
}

struct Maps {
  CUtensorMap a, b0, b1;
};

static Maps make_maps(const Problem& P) {
  Maps m;
  auto bmap = [&](const bf16* w) {
    if (P.b_mn)  // [E, k_half, n_out]: {n_out, k_half, E}, box 64 n x 64 k
      return make_map_3d(w, P.n_out, P.k_half, P.E, P.n_out, size_t(P.k_half) * P.n_out, 64,
                         kBK, 1);
    // [E, n_out, k_half]: {k_half, n_out, E}, box 64 k x 128 n (two per stage)
    return make_map_3d(w, P.k_half, P.n_out, P.E, P.k_half, size_t(P.k_half) * P.n_out, kBK,
                       kBKBoxRows, 1);
  };
  m.b0 = bmap(P.w0);
  m.b1 = bmap(P.w1 ? P.w1 : P.w0);
  // A: {k_half, halves, N}, box 64 k x 1 x 128 rows: k past k_half zero-filled inside each half.
  // Gathered A has no map (the kernel does not read it): b0 is passed as a placeholder.
  m.a = P.gather ? m.b0
                 : make_map_3d(P.a_src, P.k_half, P.halves, P.a_rows, P.k_half, P.lda, kBK, 1, kBM);
  return m;
}

struct B1Epi;  // B1's epilogue buffers (defined with the B1 checks below)
static void fill_b1_params(RowsParams& p, const B1Epi* b1);

// Versions: 1 = no cluster; 2 = 2-CTA cluster, B boxes split between the two CTAs and multicast
// (round 1's v3 scheme).
constexpr int kNumVersions = 2;

template <bool G, bool MN, int EPI, int CLUSTER>
static void launch_kernel(const Maps& m, const RowsParams& p, size_t smem, cudaStream_t stream) {
  auto kernel = rows_sm90_kernel<G, MN, EPI, CLUSTER>;
  static int grid = 0;  // persistent: as many CTAs (clusters) as fit at once
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CLUSTER;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = rows_sm90_smem_bytes(kMaxExperts);
  cfg.stream = stream;
  cfg.attrs = CLUSTER > 1 ? attr : nullptr;
  cfg.numAttrs = CLUSTER > 1 ? 1 : 0;
  if (grid == 0) {
    grid = g_num_sms;  // one CTA per SM (the shared memory allows no more)
    if (CLUSTER > 1) {  // not every SM may be usable in a cluster (GPCs of odd size)
      cfg.gridDim = dim3(g_num_sms - g_num_sms % CLUSTER);
      int clusters = 0;
      CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
      REQUIRE(clusters > 0, "no cluster of %d fits", CLUSTER);
      grid = std::min(clusters * CLUSTER, g_num_sms - g_num_sms % CLUSTER);
    }
    printf("  (A %s, B %s, epilogue %d, cluster %d: grid %d CTAs)\n", G ? "gathered" : "TMA",
           MN ? "MN-major" : "K-major", EPI, CLUSTER, grid);
  }
  cfg.gridDim = dim3(grid);
  cfg.dynamicSmemBytes = smem;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, m.a, m.b0, m.b1, p));
}

template <Kind KIND, int EPI>
static void set_smem_attributes() {
  constexpr bool kGather = KIND == Kind::B1;
  constexpr bool kMn = KIND != Kind::F2;
  const int bytes = int(rows_sm90_smem_bytes(kMaxExperts));
  const cudaFuncAttribute attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  CUDA_CHECK(cudaFuncSetAttribute(rows_sm90_kernel<kGather, kMn, EPI, 1>, attr, bytes));
  CUDA_CHECK(cudaFuncSetAttribute(rows_sm90_kernel<kGather, kMn, EPI, 2>, attr, bytes));
}

template <Kind KIND, int EPI = kEpiRowsF32>
static void launch_rows_sm90(int version, const Problem& P, const Maps& m, cudaStream_t stream,
                             const B1Epi* b1 = nullptr) {
  constexpr bool kGather = KIND == Kind::B1;
  constexpr bool kMn = KIND != Kind::F2;
  RowsParams p;
  p.a_src = P.a_src;
  p.offsets = P.offsets;
  p.token_index = P.token_index;
  p.out = P.out;
  p.n_out = P.n_out;
  p.k_half = P.k_half;
  p.halves = P.halves;
  p.lda = P.lda;
  p.E = P.E;
  p.n_tiles = (P.n_out + kBN - 1) / kBN;
  p.kt_half = (P.k_half + kBK - 1) / kBK;
  p.b_lbo = g_mn_desc_swapped ? 1024u : 8192u;
  p.b_sbo = g_mn_desc_swapped ? 8192u : 1024u;
  p.N = P.N;
  fill_b1_params(p, b1);
  const size_t smem = rows_sm90_smem_bytes(P.E);
  if (version == 1) launch_kernel<kGather, kMn, EPI, 1>(m, p, smem, stream);
  else if (version == 2) launch_kernel<kGather, kMn, EPI, 2>(m, p, smem, stream);
  else REQUIRE(false, "unknown version %d", version);
  CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------
// CPU reference (fp64) for sampled rows

static float bf16_bits_to_float(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

struct Reference {
  float* ref = nullptr;  // [N, n_out] device oracle
  std::vector<int> rows;
  std::vector<float> cpu;  // [rows, n_out]
  double oracle_rel = 0;
};

static Reference build_reference(const Problem& P) {
  Reference R;
  CUDA_CHECK(cudaMalloc(&R.ref, size_t(P.N) * P.n_out * 4));
  dim3 rgrid((P.n_out + kRefTile - 1) / kRefTile, (P.N + kRefTile - 1) / kRefTile);
  oracle_kernel<<<rgrid, 256>>>(oracle_args(P), R.ref);
  CUDA_CHECK(cudaGetLastError());

  std::mt19937 rng(1234);
  for (int e = 0; e < P.E; ++e) {
    const int lo = P.h_offsets[e], hi = P.h_offsets[e + 1];
    if (hi == lo) continue;
    R.rows.push_back(lo);
    R.rows.push_back(hi - 1);
    R.rows.push_back(lo + int(rng() % unsigned(hi - lo)));
  }
  std::sort(R.rows.begin(), R.rows.end());
  R.rows.erase(std::unique(R.rows.begin(), R.rows.end()), R.rows.end());
  if (R.rows.size() > 48) {  // bound the CPU time (B4 mixtral: 28672 x 4096 MACs per row)
    std::vector<int> keep;
    for (size_t i = 0; i < R.rows.size(); i += (R.rows.size() + 47) / 48) keep.push_back(R.rows[i]);
    R.rows = keep;
  }
  const size_t w_elems = size_t(P.E) * P.k_half * P.n_out;
  const size_t nr_rows = R.rows.size();
  // Only the sampled rows of A come to the host (B4 conf4's A alone is 4.3 GB).
  std::vector<uint16_t> ha(nr_rows * P.lda), hw0(w_elems), hw1(P.w1 ? w_elems : 0);
  for (size_t i = 0; i < nr_rows; ++i) {
    const int r = R.rows[i];
    const size_t src = P.gather ? size_t(P.h_tokens[r]) : size_t(r);
    CUDA_CHECK(cudaMemcpy(ha.data() + i * P.lda, P.a_src + src * P.lda, size_t(P.lda) * 2,
                          cudaMemcpyDeviceToHost));
  }
  CUDA_CHECK(cudaMemcpy(hw0.data(), P.w0, w_elems * 2, cudaMemcpyDeviceToHost));
  if (P.w1) CUDA_CHECK(cudaMemcpy(hw1.data(), P.w1, w_elems * 2, cudaMemcpyDeviceToHost));
  const size_t nr = R.rows.size();
  R.cpu.resize(nr * P.n_out);
  const int K = P.halves * P.k_half;
  {
    const unsigned nthreads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
    std::vector<std::thread> pool;
    for (unsigned w = 0; w < nthreads; ++w)
      pool.emplace_back([&, w] {
        std::vector<double> acc(P.n_out);
        std::vector<float> arow(K);
        for (size_t i = w; i < nr; i += nthreads) {
          const int r = R.rows[i];
          int e = 0;
          while (P.h_offsets[e + 1] <= r) ++e;
          for (int k = 0; k < K; ++k) arow[k] = bf16_bits_to_float(ha[i * P.lda + k]);
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int half = 0; half < P.halves; ++half) {
            const uint16_t* w = half ? hw1.data() : hw0.data();
            const float* a = arow.data() + size_t(half) * P.k_half;
            if (P.b_mn) {  // k outer: weight rows are contiguous in n
              for (int kk = 0; kk < P.k_half; ++kk) {
                const uint16_t* wrow = w + (size_t(e) * P.k_half + kk) * P.n_out;
                const double av = a[kk];
                for (int n = 0; n < P.n_out; ++n) acc[n] += av * bf16_bits_to_float(wrow[n]);
              }
            } else {  // n outer: weight rows are contiguous in k
              for (int n = 0; n < P.n_out; ++n) {
                const uint16_t* wrow = w + (size_t(e) * P.n_out + n) * P.k_half;
                double sum = 0;
                for (int kk = 0; kk < P.k_half; ++kk) sum += double(a[kk]) * bf16_bits_to_float(wrow[kk]);
                acc[n] += sum;
              }
            }
          }
          for (int n = 0; n < P.n_out; ++n) R.cpu[i * P.n_out + n] = float(acc[n]);
        }
      });
    for (auto& t : pool) t.join();
  }
  std::vector<float> orow(P.n_out);
  double oe2 = 0, or2 = 0;
  for (size_t i = 0; i < nr; ++i) {
    CUDA_CHECK(cudaMemcpy(orow.data(), R.ref + size_t(R.rows[i]) * P.n_out, P.n_out * 4,
                          cudaMemcpyDeviceToHost));
    for (int n = 0; n < P.n_out; ++n) {
      const double c = R.cpu[i * P.n_out + n];
      oe2 += (orow[n] - c) * (orow[n] - c);
      or2 += c * c;
    }
  }
  R.oracle_rel = std::sqrt(oe2 / std::max(or2, 1e-300));
  return R;
}

static void poison(const Problem& P) {
  CUDA_CHECK(cudaMemset(P.out, 0xFF, size_t(P.N) * P.n_out * 4));  // 0xFFFFFFFF: a NaN
}

static unsigned long long checksum(const Problem& P) {
  unsigned long long* d_sum;
  CUDA_CHECK(cudaMalloc(&d_sum, sizeof(unsigned long long)));
  CUDA_CHECK(cudaMemset(d_sum, 0, sizeof(unsigned long long)));
  checksum_kernel<<<4 * g_num_sms, 256>>>(reinterpret_cast<const uint32_t*>(P.out),
                                           size_t(P.N) * P.n_out, d_sum);
  CUDA_CHECK(cudaGetLastError());
  unsigned long long s;
  CUDA_CHECK(cudaMemcpy(&s, d_sum, sizeof(s), cudaMemcpyDeviceToHost));
  cudaFree(d_sum);
  return s;
}

// Poison, run, then: every element vs the device oracle (NaN / unwritten counted); sampled rows vs
// the CPU fp64 reference (and the oracle vs the CPU); a rerun bitwise identical.
template <Kind KIND>
static bool check_problem(int version, const Shape& s, const Problem& P, const Maps& m,
                          const Reference& R) {
  char kn[16];
  snprintf(kn, sizeof(kn), "%s v%d", kind_name(KIND), version);
  bool ok = true;
  poison(P);
  launch_rows_sm90<KIND>(version, P, m, 0);
  CUDA_CHECK(cudaDeviceSynchronize());

  const size_t count = size_t(P.N) * P.n_out;
  CompareResult* d_res;
  CUDA_CHECK(cudaMalloc(&d_res, sizeof(CompareResult)));
  CUDA_CHECK(cudaMemset(d_res, 0, sizeof(CompareResult)));
  compare_kernel<<<8 * g_num_sms, 256>>>(P.out, R.ref, count, d_res);
  CUDA_CHECK(cudaGetLastError());
  CompareResult res;
  CUDA_CHECK(cudaMemcpy(&res, d_res, sizeof(res), cudaMemcpyDeviceToHost));
  cudaFree(d_res);
  {
    const double rel = std::sqrt(res.err2 / std::max(res.ref2, 1e-300));
    const bool pass = res.nonfinite == 0 && res.mismatches == 0 && rel < 1e-3;
    printf("  [%s %s] full vs device fp32 oracle: rel_l2 %.3e  max_abs %.3e  mismatches %llu  "
           "non-finite/unwritten %llu  %s\n",
           kn, s.name, rel, res.max_abs, res.mismatches, res.nonfinite, pass ? "ok" : "FAIL");
    ok = ok && pass;
  }

  const size_t nr = R.rows.size();
  std::vector<float> got(P.n_out);
  double e2 = 0, r2 = 0;
  size_t bad = 0, nonfinite = 0;
  for (size_t i = 0; i < nr; ++i) {
    CUDA_CHECK(cudaMemcpy(got.data(), P.out + size_t(R.rows[i]) * P.n_out, P.n_out * 4,
                          cudaMemcpyDeviceToHost));
    for (int n = 0; n < P.n_out; ++n) {
      const float ref = R.cpu[i * P.n_out + n];
      if (!std::isfinite(got[n])) { ++nonfinite; continue; }
      const double diff = std::fabs(double(got[n]) - ref);
      if (!(diff <= out_tol(ref))) ++bad;
      e2 += diff * diff;
      r2 += double(ref) * ref;
    }
  }
  const double cpu_rel = std::sqrt(e2 / std::max(r2, 1e-300));
  const bool cpu_ok = nonfinite == 0 && bad == 0 && cpu_rel < 1e-3 && R.oracle_rel < 1e-4;
  printf("  [%s %s] CPU fp64 spot check, %zu rows x %d cols: rel_l2 %.3e, mismatches %zu, "
         "non-finite %zu; device oracle vs CPU rel_l2 %.3e  %s\n",
         kn, s.name, nr, P.n_out, cpu_rel, bad, nonfinite, R.oracle_rel, cpu_ok ? "ok" : "FAIL");
  ok = ok && cpu_ok;

  const unsigned long long c1 = checksum(P);
  poison(P);
  launch_rows_sm90<KIND>(version, P, m, 0);
  CUDA_CHECK(cudaDeviceSynchronize());
  const unsigned long long c2 = checksum(P);
  printf("  [%s %s] rerun checksum %s (%016llx)\n", kn, s.name,
         c1 == c2 ? "identical" : "DIFFERENT", c1);
  ok = ok && c1 == c2;
  return ok;
}

// ---------------------------------------------------------------------------------------------
// B1's full epilogue (SwiGLU, SAVE_PREACT: a and b saved, u recomputed): buffers, reference, checks

struct B1Epi {
  bf16 *a = nullptr, *b = nullptr;  // [N, h]
  float* g = nullptr;               // [N] routing weights (indexed through row_pair)
  int32_t* row_pair = nullptr;      // [N]: a permutation of [0, N)
  bf16 *dadb = nullptr, *gu = nullptr;  // [N, 2h], [N, h]
  float* dg_part = nullptr;             // [n_tiles, N]
  int n_tiles = 0;
};

static void fill_b1_params(RowsParams& p, const B1Epi* b1) {
  p.b1_a = b1 ? b1->a : nullptr;
  p.b1_b = b1 ? b1->b : nullptr;
  p.b1_g = b1 ? b1->g : nullptr;
  p.b1_row_pair = b1 ? b1->row_pair : nullptr;
  p.b1_dadb = b1 ? b1->dadb : nullptr;
  p.b1_gu = b1 ? b1->gu : nullptr;
  p.b1_dg_part = b1 ? b1->dg_part : nullptr;
}

__global__ void fill_uniform_f32(float* out, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(seed * 0x100000001b3ull + i);
    out[i] = (float((r >> 40) & 0xffffff) + 0.5f) * (1.f / 16777216.f);  // (0, 1)
  }
}

static B1Epi make_b1_epi(const Problem& P, uint64_t seed) {
  B1Epi B;
  const size_t nh = size_t(P.N) * P.n_out;
  B.n_tiles = (P.n_out + kBN - 1) / kBN;
  CUDA_CHECK(cudaMalloc(&B.a, nh * 2));
  CUDA_CHECK(cudaMalloc(&B.b, nh * 2));
  CUDA_CHECK(cudaMalloc(&B.g, size_t(P.N) * 4));
  CUDA_CHECK(cudaMalloc(&B.row_pair, size_t(P.N) * 4));
  CUDA_CHECK(cudaMalloc(&B.dadb, 2 * nh * 2));
  CUDA_CHECK(cudaMalloc(&B.gu, nh * 2));
  CUDA_CHECK(cudaMalloc(&B.dg_part, size_t(B.n_tiles) * P.N * 4));
  fill(B.a, nh, seed * 5 + 11, 1.f);
  fill(B.b, nh, seed * 5 + 12, 1.f);
  fill_uniform_f32<<<4 * g_num_sms, 256>>>(B.g, size_t(P.N), seed * 5 + 13);
  CUDA_CHECK(cudaGetLastError());
  std::vector<int32_t> perm(P.N);
  for (int i = 0; i < P.N; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(seed * 5 + 14));
  CUDA_CHECK(cudaMemcpy(B.row_pair, perm.data(), size_t(P.N) * 4, cudaMemcpyHostToDevice));
  return B;
}

static void free_b1_epi(B1Epi& B) {
  cudaFree(B.a); cudaFree(B.b); cudaFree(B.g); cudaFree(B.row_pair); cudaFree(B.dadb);
  cudaFree(B.gu); cudaFree(B.dg_part);
}

static void poison_b1(const Problem& P, const B1Epi& B) {
  const size_t nh = size_t(P.N) * P.n_out;
  CUDA_CHECK(cudaMemset(B.dadb, 0xFF, 2 * nh * 2));  // bf16 NaN
  CUDA_CHECK(cudaMemset(B.gu, 0xFF, nh * 2));
  CUDA_CHECK(cudaMemset(B.dg_part, 0xFF, size_t(B.n_tiles) * P.N * 4));  // fp32 NaN
}

struct B1Compare {
  unsigned long long nonfinite[3], mismatches[3];  // da, db, gu (gu: more than 1 bf16 ulp apart)
  unsigned long long gu_ulp1;                      // gu exactly 1 ulp apart (reported, not failed)
  double err2[2], ref2[2];
  unsigned long long dg_nonfinite, dg_mismatches;
  double dg_err2, dg_ref2;
};

// Every (row, column): the reference from the oracle's fp32 v with the same formulas. da, db may
// differ from the reference by one bf16 rounding flip plus the effect of v's summation-order
// error (bounded by out_tol(v) times the derivative); gu = round(g * round(silu(a) b)) does not
// depend on v and should match bitwise: more than one bf16 ulp apart fails, exactly one ulp is
// counted and printed (the two kernels might contract a multiply-add inside expf differently).
__global__ void b1_compare_kernel(const float* v_ref, const bf16* a, const bf16* b, const float* g,
                                  const int32_t* row_pair, const bf16* dadb, const bf16* gu,
                                  int N, int h, B1Compare* res) {
  double e2[2] = {0, 0}, r2[2] = {0, 0};
  unsigned long long nf[3] = {0, 0, 0}, mm[3] = {0, 0, 0}, ulp1 = 0;
  const size_t count = size_t(N) * h;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / h, n = i % h;
    const float av = __bfloat162float(a[i]), bv = __bfloat162float(b[i]);
    const float gval = g[row_pair[r]];
    const float v = v_ref[i];
    float dot = 0.f, da, db, gur;
    b1_swiglu(v, av, bv, gval, dot, da, db, gur);
    const float s = sigmoid_dev(av);
    const float vt = out_tol(v);
    const float tol_da = ldexpf(fabsf(da), -7) + fabsf(gval * bv * (s * (1.f + av * (1.f - s)))) * vt + 1e-6f;
    const float tol_db = ldexpf(fabsf(db), -7) + fabsf(gval * av * s) * vt + 1e-6f;
    const float got_da = __bfloat162float(dadb[r * 2 * h + n]);
    const float got_db = __bfloat162float(dadb[r * 2 * h + h + n]);
    const bf16 got_gu = gu[i];
    const float got[2] = {got_da, got_db}, ref[2] = {da, db}, tol[2] = {tol_da, tol_db};
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      if (!isfinite(got[q])) { ++nf[q]; continue; }
      const float diff = fabsf(got[q] - ref[q]);
      if (!(diff <= tol[q])) ++mm[q];
      e2[q] += double(diff) * diff;
      r2[q] += double(ref[q]) * ref[q];
    }
    if (!isfinite(__bfloat162float(got_gu))) {
      ++nf[2];
    } else {
      // ulp distance on the ordered integer line of bf16 (sign-magnitude -> two's complement)
      const int gb = __bfloat16_as_ushort(got_gu), rb = __bfloat16_as_ushort(__float2bfloat16_rn(gur));
      const int go = (gb & 0x8000) ? -(gb & 0x7fff) : gb, ro = (rb & 0x8000) ? -(rb & 0x7fff) : rb;
      const int dist = abs(go - ro);
      if (dist > 1) ++mm[2];
      else if (dist == 1) ++ulp1;
    }
  }
  atomicAdd(&res->gu_ulp1, ulp1);
#pragma unroll
  for (int q = 0; q < 3; ++q) {
    atomicAdd(&res->nonfinite[q], nf[q]);
    atomicAdd(&res->mismatches[q], mm[q]);
  }
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    atomicAdd(&res->err2[q], e2[q]);
    atomicAdd(&res->ref2[q], r2[q]);
  }
}

// dg per row: the kernel's partials summed over n-tiles vs sum_n v_ref * u in double (a warp per
// row). |diff| <= 1e-4 * sum_n |v u| + 1e-4.
__global__ void b1_dg_compare_kernel(const float* v_ref, const bf16* a, const bf16* b,
                                     const float* dg_part, int n_tiles, int N, int h,
                                     B1Compare* res) {
  const int lane = threadIdx.x & 31;
  const int warps = (gridDim.x * blockDim.x) >> 5;
  unsigned long long nf = 0, mm = 0;
  double e2 = 0, r2 = 0;
  for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < N; r += warps) {
    double ref = 0, scale = 0;
    for (int n = lane; n < h; n += 32) {
      const size_t i = size_t(r) * h + n;
      const float av = __bfloat162float(a[i]), bv = __bfloat162float(b[i]);
      const float u = bf16_round(av * sigmoid_dev(av) * bv);
      ref += double(v_ref[i]) * u;
      scale += fabs(double(v_ref[i]) * u);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      ref += __shfl_xor_sync(0xffffffffu, ref, o);
      scale += __shfl_xor_sync(0xffffffffu, scale, o);
    }
    if (lane == 0) {
      float got = 0.f;
      for (int t = 0; t < n_tiles; ++t) got += dg_part[size_t(t) * N + r];
      if (!isfinite(got)) { ++nf; continue; }
      const double diff = fabs(double(got) - ref);
      if (!(diff <= 1e-4 * scale + 1e-4)) ++mm;
      e2 += diff * diff;
      r2 += ref * ref;
    }
  }
  if (lane == 0) {
    atomicAdd(&res->dg_nonfinite, nf);
    atomicAdd(&res->dg_mismatches, mm);
    atomicAdd(&res->dg_err2, e2);
    atomicAdd(&res->dg_ref2, r2);
  }
}

static unsigned long long checksum_b1(const Problem& P, const B1Epi& B) {
  unsigned long long* d_sum;
  CUDA_CHECK(cudaMalloc(&d_sum, sizeof(unsigned long long)));
  CUDA_CHECK(cudaMemset(d_sum, 0, sizeof(unsigned long long)));
  const size_t nh = size_t(P.N) * P.n_out;
  checksum_kernel<<<4 * g_num_sms, 256>>>(reinterpret_cast<const uint32_t*>(B.dadb), nh, d_sum);
  checksum_kernel<<<4 * g_num_sms, 256>>>(reinterpret_cast<const uint32_t*>(B.gu), nh / 2, d_sum);
  checksum_kernel<<<4 * g_num_sms, 256>>>(reinterpret_cast<const uint32_t*>(B.dg_part),
                                           size_t(B.n_tiles) * P.N, d_sum);
  CUDA_CHECK(cudaGetLastError());
  unsigned long long s;
  CUDA_CHECK(cudaMemcpy(&s, d_sum, sizeof(s), cudaMemcpyDeviceToHost));
  cudaFree(d_sum);
  return s;
}

// B1 with its epilogue: poison da|db, g*u, dg partials; run; compare everything with the
// reference built from the oracle's v (itself checked against the CPU by check_problem); rerun
// bitwise identical.
template <Kind K>
static bool check_b1_full(int version, const Shape& s, const Problem& P, const Maps& m,
                          const B1Epi& B, const Reference& R) {
  bool ok = true;
  poison_b1(P, B);
  launch_rows_sm90<K, kEpiB1SwiGLU>(version, P, m, 0, &B);
  CUDA_CHECK(cudaDeviceSynchronize());
  B1Compare* d_res;
  CUDA_CHECK(cudaMalloc(&d_res, sizeof(B1Compare)));
  CUDA_CHECK(cudaMemset(d_res, 0, sizeof(B1Compare)));
  b1_compare_kernel<<<8 * g_num_sms, 256>>>(R.ref, B.a, B.b, B.g, B.row_pair, B.dadb, B.gu, P.N,
                                             P.n_out, d_res);
  CUDA_CHECK(cudaGetLastError());
  b1_dg_compare_kernel<<<8 * g_num_sms, 256>>>(R.ref, B.a, B.b, B.dg_part, B.n_tiles, P.N,
                                                P.n_out, d_res);
  CUDA_CHECK(cudaGetLastError());
  B1Compare res;
  CUDA_CHECK(cudaMemcpy(&res, d_res, sizeof(res), cudaMemcpyDeviceToHost));
  cudaFree(d_res);
  const char* names[2] = {"da", "db"};
  for (int q = 0; q < 2; ++q) {
    const double rel = std::sqrt(res.err2[q] / std::max(res.ref2[q], 1e-300));
    const bool pass = res.nonfinite[q] == 0 && res.mismatches[q] == 0 && rel < 1e-2;
    printf("  [B1-full v%d %s] %s vs reference from the oracle's v: rel_l2 %.3e  mismatches %llu  "
           "non-finite/unwritten %llu  %s\n",
           version, s.name, names[q], rel, res.mismatches[q], res.nonfinite[q], pass ? "ok" : "FAIL");
    ok = ok && pass;
  }
  {
    const bool pass = res.nonfinite[2] == 0 && res.mismatches[2] == 0;
    printf("  [B1-full v%d %s] g*u vs reference: > 1 ulp apart %llu, exactly 1 ulp apart %llu "
           "(0 expected), non-finite/unwritten %llu  %s\n",
           version, s.name, res.mismatches[2], res.gu_ulp1, res.nonfinite[2], pass ? "ok" : "FAIL");
    ok = ok && pass;
  }
  {
    const double rel = std::sqrt(res.dg_err2 / std::max(res.dg_ref2, 1e-300));
    const bool pass = res.dg_nonfinite == 0 && res.dg_mismatches == 0 && rel < 1e-3;
    printf("  [B1-full v%d %s] dg (sum of %d n-tile partials) per row: rel_l2 %.3e  mismatches %llu  "
           "non-finite/unwritten %llu  %s\n",
           version, s.name, B.n_tiles, rel, res.dg_mismatches, res.dg_nonfinite, pass ? "ok" : "FAIL");
    ok = ok && pass;
  }
  const unsigned long long c1 = checksum_b1(P, B);
  poison_b1(P, B);
  launch_rows_sm90<K, kEpiB1SwiGLU>(version, P, m, 0, &B);
  CUDA_CHECK(cudaDeviceSynchronize());
  const unsigned long long c2 = checksum_b1(P, B);
  printf("  [B1-full v%d %s] rerun checksum %s (%016llx)\n", version, s.name,
         c1 == c2 ? "identical" : "DIFFERENT", c1);
  return ok && c1 == c2;
}

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
  double gflop, gb, ms_dense;
  double ms[kNumVersions + 1] = {};       // per version
  double ms_full[kNumVersions + 1] = {};  // B1 only: with B1's full SwiGLU epilogue
};

// The mma.sync engine's conf3 times from docs/performance.md, for the table's last column.
static double mma_sync_conf3_ms(Kind k) {
  return k == Kind::F2 ? 6.5 : (k == Kind::B4 ? 15.6 : 21.9 /* B1 with its full epilogue */);
}

template <Kind KIND>
static int run_main(int argc, char** argv) {
  const char* kn = kind_name(KIND);
  bool check_only = false;
  std::string only;
  uint64_t seed = 20261129;
  std::vector<int> versions = {1, 2};
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--check-only")) check_only = true;
    else if (!strcmp(argv[i], "--shape") && i + 1 < argc) only = argv[++i];
    else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], nullptr, 10);
    else if (!strcmp(argv[i], "--mn-desc") && i + 1 < argc)
      g_mn_desc_swapped = !strcmp(argv[++i], "swapped");
    else if (!strcmp(argv[i], "--versions") && i + 1 < argc) {
      versions.clear();
      for (const char* c = argv[++i]; *c; ++c)
        if (*c >= '1' && *c <= '0' + kNumVersions) versions.push_back(*c - '0');
    } else {
      fprintf(stderr,
              "usage: %s [--check-only] [--shape edge|conf3|conf4|mixtral|qwen] [--seed N] "
              "[--versions 1,2] [--mn-desc default|swapped]\n",
              argv[0]);
      return 2;
    }
  }
  REQUIRE(!versions.empty(), "no versions");
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  g_num_sms = prop.multiProcessorCount;
  printf("%s sm90: device %s, %d SMs, L2 %d MB, smem/block opt-in %zu B, seed %llu, MN-major "
         "B descriptor %s; versions: 1 = no cluster, 2 = 2-CTA cluster with B multicast\n",
         kn, prop.name, g_num_sms, prop.l2CacheSize >> 20, prop.sharedMemPerBlockOptin,
         (unsigned long long)seed,
         KIND == Kind::F2 ? "unused" : (g_mn_desc_swapped ? "SWAPPED (LBO 1024, SBO 8192)"
                                                          : "default (LBO 8192, SBO 1024)"));
  REQUIRE(prop.major == 9, "this kernel needs sm_90a (Hopper)");
  REQUIRE(rows_sm90_smem_bytes(kMaxExperts) <= prop.sharedMemPerBlockOptin, "shared memory");
  set_smem_attributes<KIND, kEpiRowsF32>();
  if constexpr (KIND == Kind::B1) set_smem_attributes<KIND, kEpiB1SwiGLU>();
  const size_t flush_bytes = size_t(std::max(prop.l2CacheSize, 1 << 20)) * 4;
  void* flush_buf;
  CUDA_CHECK(cudaMalloc(&flush_buf, flush_bytes));
#ifndef NO_CUBLAS
  cublasHandle_t blas;
  REQUIRE(cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
#endif
  bool all_ok = true;
  std::vector<TimingRow> table;
  for (const Shape& s : kShapes) {
    if (!only.empty() && only != s.name) continue;
    const uint64_t shape_seed = seed + std::hash<std::string>()(s.name) % 1000;
    Problem P = make_problem(KIND, s, shape_seed);
    REQUIRE(P.n_out % 8 == 0 && P.k_half % 8 == 0 && P.E <= kMaxExperts, "unsupported shape %s",
            s.name);
    int mn = 1 << 30, mx = 0, empty = 0;
    for (int e = 0; e < s.E; ++e) {
      const int c = P.h_offsets[e + 1] - P.h_offsets[e];
      mn = std::min(mn, c); mx = std::max(mx, c); empty += c == 0;
    }
    printf("shape %s: T=%d d=%d h=%d E=%d k=%d N=%d; %s: K=%d (%d x %d) n_out=%d, B %s, A %s "
           "(seed %llu); rows per expert min %d max %d, empty experts %d\n",
           s.name, s.T, s.d, s.h, s.E, s.k, P.N, kn, P.halves * P.k_half, P.halves, P.k_half,
           P.n_out, P.b_mn ? "MN-major" : "K-major", P.gather ? "gathered" : "rows (TMA)",
           (unsigned long long)shape_seed, mn, mx, empty);
    const Maps maps = make_maps(P);
    Reference R = build_reference(P);
    B1Epi b1e;
    if constexpr (KIND == Kind::B1) b1e = make_b1_epi(P, shape_seed);
    for (int v : versions) {
      const bool ok = check_problem<KIND>(v, s, P, maps, R);
      all_ok = all_ok && ok;
      printf("  [%s v%d %s] %s\n", kn, v, s.name, ok ? "CHECK PASSED" : "CHECK FAILED");
      if constexpr (KIND == Kind::B1) {
        const bool ok_full = check_b1_full<KIND>(v, s, P, maps, b1e, R);
        all_ok = all_ok && ok_full;
        printf("  [B1-full v%d %s] %s\n", v, s.name, ok_full ? "CHECK PASSED" : "CHECK FAILED");
      }
    }
    cudaFree(R.ref);
    if (!check_only && strcmp(s.name, "edge") != 0) {
      TimingRow row;
      row.name = s.name;
      const int K = P.halves * P.k_half;
      row.gflop = 2.0 * P.N * double(K) * P.n_out * 1e-9;
      // min bytes: A read once (per routed row), the weights, the fp32 rows written
      row.gb = (double(P.N) * K * 2 + double(P.halves) * P.E * P.k_half * P.n_out * 2 +
                double(P.N) * P.n_out * 4) * 1e-9;
      for (int v : versions) {
        row.ms[v] = median_ms([&] { launch_rows_sm90<KIND>(v, P, maps, 0); }, flush_buf,
                              flush_bytes);
        if constexpr (KIND == Kind::B1)
          row.ms_full[v] = median_ms(
              [&] { launch_rows_sm90<KIND, kEpiB1SwiGLU>(v, P, maps, 0, &b1e); }, flush_buf,
              flush_bytes);
      }
      row.ms_dense = 0;
#ifndef NO_CUBLAS
      {  // dense [N, K] x [K, n_out] -> fp32 [N, n_out], bf16 in, fp32 compute, same B layout
        bf16* dense_a;
        CUDA_CHECK(cudaMalloc(&dense_a, size_t(P.N) * K * 2));
        fill(dense_a, size_t(P.N) * K, shape_seed + 77, 1.f);
        REQUIRE(size_t(P.E) * P.k_half * P.n_out >= size_t(K) * P.n_out, "dense B");
        const float alpha = 1.f, beta = 0.f;
        auto launch = [&] {
          // column-major view: C^T [n_out, N] = B^T [n_out, K] . A^T [K, N]
          const cublasStatus_t st = cublasGemmEx(
              blas, P.b_mn ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N, P.n_out, P.N, K, &alpha,
              P.w0, CUDA_R_16BF, P.b_mn ? P.n_out : K, dense_a, CUDA_R_16BF, K, &beta, P.out,
              CUDA_R_32F, P.n_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          REQUIRE(st == CUBLAS_STATUS_SUCCESS, "cublasGemmEx %d", int(st));
        };
        row.ms_dense = median_ms(launch, flush_buf, flush_bytes);
        cudaFree(dense_a);
      }
#endif
      table.push_back(row);
      for (int v : versions) {
        printf("  [%s v%d %s] sm90 %.3f ms = %.1f TFLOP/s\n", kn, v, s.name, row.ms[v],
               row.gflop / row.ms[v]);
        if (KIND == Kind::B1)
          printf("  [B1-full v%d %s] sm90 with the full epilogue %.3f ms = %.1f TFLOP/s\n", v,
                 s.name, row.ms_full[v], row.gflop / row.ms_full[v]);
      }
      printf("  [%s %s] cuBLAS dense same-FLOP %.3f ms = %.1f TFLOP/s\n", kn, s.name,
             row.ms_dense, row.ms_dense > 0 ? row.gflop / row.ms_dense : 0.0);
    }
    if constexpr (KIND == Kind::B1) free_b1_epi(b1e);
    free_problem(P);
  }
  if (!table.empty()) {
    printf("\n%s sm90 TFLOP/s counted as 2*N*K*n_out; GB = min bytes (A once, weights, fp32 rows);"
           " v1 = no cluster, v2 = 2-CTA cluster (B multicast); dense = cublasGemmEx bf16->fp32 of"
           " the same FLOPs; best/dense excludes full-epi%s\n",
           kn, KIND == Kind::B1 ? "; B1 v = main loop + fp32 v rows (simplified epilogue); "
                                  "full = the same main loop with B1's SwiGLU epilogue "
                                  "(SAVE_PREACT: reads a, b; writes da|db, g*u, dg partials), "
                                  "comparable with the mma.sync 21.9 ms"
                                : "");
    printf("%-8s %8s %7s", "shape", "GFLOP", "GB");
    for (int v : versions) {
      printf("   v%d ms v%d TF/s", v, v);
      if (KIND == Kind::B1) printf(" full%d ms full%d TF", v, v);
    }
    printf(" %9s %8s %10s %12s\n", "dense ms", "dense TF", "best/dense", "mma.sync ms");
    for (const TimingRow& r : table) {
      printf("%-8s %8.0f %7.2f", r.name.c_str(), r.gflop, r.gb);
      double best = 0;
      for (int v : versions) {
        const double tf = r.gflop / r.ms[v];
        best = std::max(best, tf);
        printf(" %8.3f %7.1f", r.ms[v], tf);
        if (KIND == Kind::B1) printf(" %8.3f %8.1f", r.ms_full[v], r.gflop / r.ms_full[v]);
      }
      const double dtf = r.ms_dense > 0 ? r.gflop / r.ms_dense : 0;
      char ref[32] = "-";
      if (r.name == "conf3") snprintf(ref, sizeof(ref), "%.1f", mma_sync_conf3_ms(KIND));
      printf(" %9.3f %8.1f %10.2f %12s\n", r.ms_dense, dtf, dtf > 0 ? best / dtf : 0.0, ref);
    }
  }
  printf("%s %s\n", kn, all_ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
#ifndef NO_CUBLAS
  cublasDestroy(blas);
#endif
  cudaFree(flush_buf);
  return all_ok ? 0 : 1;
}

