// F1 on Hopper (see f1_gemm.hpp): dev/cuda/sm90_gather_gemm.cu version 1 (consumer proxy fence, no
// cluster), generalised to BF16 / F16 and the 7 activations.
//
// Tile: 128 routed rows x 256 columns of the dual B operand x 64 k, 4 stages of 48 KB.
//   gated:     B = 128 rows of w_gate[e] (n0..n0+127) next to the same 128 rows of w_up[e]:
//              one m64n256k16 wgmma computes a and b of the same (row, column) side by side;
//   non-gated: B = 256 rows of w_gate[e] (two TMA boxes, n0 and n0+128): a tile is 256 columns
//              of a, and b does not exist.
// 384 threads: warpgroup 0 produces (one thread issues the two TMA boxes, all 128 gather the A
// rows with 16-byte cp.async into the same 128-byte swizzle), warpgroups 1 and 2 consume (64 rows
// each, 128 fp32 accumulators per thread). Persistent grid of one CTA per SM; every CTA turns
// expert_offsets into a prefix of tile counts in shared memory; tile ids map to (expert, m-tile,
// n-tile) by binary search, rasterised in bands of 8 m-tiles so concurrent CTAs share A rows and
// B tiles in L2. Epilogue: each consumer warp stages 16 rows x 64 columns of one output at a time
// in an XOR-swizzled 2 KB buffer and writes it with coalesced 16-byte stores.
//
// The device code needs sm_90a (wgmma, setmaxnreg, TMA); the library is also compiled for other
// architectures, whose image of the kernel only traps. sm90_f1_supported refuses to launch unless
// the image the runtime picked for the current device is sm_90 or newer.
#include "cuda/sm90/f1_gemm.hpp"

#include <cuda.h>  // CUtensorMap and the encoder's types only: no libcuda link
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "common/activation_math.hpp"
#include "common/status.hpp"
#include "cuda/cuda_util.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MB_SM90_DEVICE 1
#else
#define MB_SM90_DEVICE 0
#endif

namespace moeblaze {
namespace cuda {
namespace {

constexpr int kBM = 128;        // routed rows per tile
constexpr int kBBoxRows = 128;  // rows of one TMA weight box
constexpr int kBK = 64;         // k per stage: one 128-byte swizzle row of 16-bit elements
constexpr int kStages = 4;
constexpr int kThreads = 384;  // warpgroup 0: producer; 1, 2: consumers
constexpr int kProducerThreads = 128;
constexpr int kConsumerWarps = 8;
constexpr int kBandMTiles = 8;  // rasterisation: n-tiles sweep a band of 8 m-tiles
constexpr int kMaxExperts = 1024;

constexpr int kATileBytes = kBM * kBK * 2;       // 16 KB
constexpr int kBBoxBytes = kBBoxRows * kBK * 2;  // 16 KB, two per stage
constexpr int kStageBytes = kATileBytes + 2 * kBBoxBytes;
constexpr int kPipeBytes = kStages * kStageBytes;  // 192 KB
constexpr int kEpiWarpBytes = 16 * 64 * 2;         // 16 rows x 64 cols of 16-bit
constexpr int kEpiBytes = kConsumerWarps * kEpiWarpBytes;
constexpr int kBarrierBytes = 2 * kStages * 8;
constexpr int kTokenBytes = kBM * 4;

constexpr size_t smem_bytes(int E) {
  return 1024 /* alignment slack */ + kPipeBytes + kEpiBytes + kBarrierBytes + kTokenBytes +
         sizeof(int) * size_t(E + 1);
}
constexpr size_t kMaxSmemBytes = smem_bytes(kMaxExperts);

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
  int n_tiles;  // ceil(h / tile_cols)
  int k_tiles;  // ceil(d / kBK)
};

struct TileCoord {
  int e;
  int row0;    // first routed row of the tile
  int rows;    // valid rows (1..128)
  int n_tile;  // columns [n_tile * tile_cols, +tile_cols) of h
};

#if MB_SM90_DEVICE

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Spins until the phase with `parity` completes. A wait far beyond any real stall (2^26 polls,
// many seconds; real waits are microseconds) traps instead of hanging the device.
// No printf here: a call anywhere in the kernel makes ptxas serialise the wgmmas (C7510).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  uint32_t polls = 0;
  do {
    if (++polls == (1u << 26)) __trap();
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

// Arrives on `bar` once every cp.async this thread issued so far has landed. .noinc: the arrival
// counts against the barrier's expected count (the producer threads are part of it).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled and src is not read
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

#define MB_WGMMA_M64N256K16(TYPE)                                                                  \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE                                 \
      " {"                                                                                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "           \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "           \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "           \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "           \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "           \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "     \
      "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, "       \
      "%125, %126, %127"                                                                           \
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"                                                         \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), \
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), \
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), \
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), \
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), \
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),          \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),        \
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),        \
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),        \
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])         \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))

// D[64x256] (+)= A[64x16] * B[256x16]^T, both K-major in 128B-swizzled shared memory.
template <typename T>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    MB_WGMMA_M64N256K16("bf16");
  } else {
    MB_WGMMA_M64N256K16("f16");
  }
}
#undef MB_WGMMA_M64N256K16

// Two values rounded to T, packed (lo at the lower address): the same conversions as gemm.cuh's
// store2 (round-to-nearest-even).
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

// tile_start[e] = first linear tile id of expert e (prefix of ceil(count_e / kBM) * n_tiles).
__device__ __forceinline__ TileCoord decode_tile(int t, const int* tile_start, const F1Params& p) {
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
  const int n_tile = r / band_h;
  TileCoord c;
  c.e = e;
  c.row0 = off + m_tile * kBM;
  c.rows = min(kBM, count - m_tile * kBM);
  c.n_tile = n_tile;
  return c;
}

#endif  // MB_SM90_DEVICE

// ACT: the activation (Activation cast to int); gated ones read w_gate and w_up, non-gated ones
// read 256 rows of w_gate (tmap_second is then the w_gate map, second box at n0 + 128).
template <typename T, int ACT>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_f1_kernel(const __grid_constant__ CUtensorMap tmap_gate,
                   const __grid_constant__ CUtensorMap tmap_second, const F1Params p) {
#if MB_SM90_DEVICE
  constexpr Activation kAct = static_cast<Activation>(ACT);
  constexpr bool kGated =
      kAct == Activation::SwiGLU || kAct == Activation::GeGLU || kAct == Activation::ReGLU;
  constexpr int kTileCols = tile_cols(kGated);
  constexpr int kSecondRowOffset = kGated ? 0 : kBBoxRows;
  constexpr int kGroups = kTileCols / 64;  // 64-column epilogue groups per tile

  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment (128B swizzle atoms) by an offset from smem_raw, so the compiler still
  // knows every derived pointer is shared memory.
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* epi = smem + kPipeBytes;
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(epi + kEpiBytes);
  uint64_t* empty_bar = full_bar + kStages;
  int* tok_s = reinterpret_cast<int*>(empty_bar + kStages);  // [kBM]
  int* tile_start = tok_s + kBM;                             // [E + 1]

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;

  // ---- prologue: barriers and the tile prefix (from the device-side offsets; no host sync)
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_u32(full_bar + s), kProducerThreads + 1);  // cp.async arrivals + expect_tx
      mbar_init(smem_u32(empty_bar + s), kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  for (int e = tid; e < p.E; e += kThreads) {
    const int count = __ldg(p.offsets + e + 1) - __ldg(p.offsets + e);
    tile_start[e + 1] = ((count + kBM - 1) / kBM) * p.n_tiles;
  }
  __syncthreads();
  if (warp == 0) {  // inclusive scan of tile_start[1..E]: each lane sums a contiguous chunk
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
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    const T* x = static_cast<const T*>(p.x);
    const int chunk = tid & 7;  // 16-byte chunk of a 128-byte row slice
    const int row_base = tid >> 3;
    uint32_t it = 0;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = decode_tile(t, tile_start, p);
      const int n0 = c.n_tile * kTileCols;
      // The tile's token ids go through shared memory (8 per thread would not fit in 40 registers).
      asm volatile("bar.sync 1, 128;\n" ::: "memory");  // previous tile's ids no longer read
      tok_s[tid] = tid < c.rows ? __ldg(p.token_index + c.row0 + tid) : -1;
      asm volatile("bar.sync 1, 128;\n" ::: "memory");
      for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(smem_u32(empty_bar + s), ((it / kStages) & 1) ^ 1);
        uint8_t* stage = smem + s * kStageBytes;
        const uint32_t full = smem_u32(full_bar + s);
        if (tid == 0) {
          // Non-gated tiles at the end of h may have no row of their second box inside h: it is
          // not loaded, and the accumulator columns it feeds (past h) are never stored.
          const bool second_box = n0 + kSecondRowOffset < p.h;
          mbar_arrive_expect_tx(full, second_box ? 2 * kBBoxBytes : kBBoxBytes);
          tma_load_3d(smem_u32(stage + kATileBytes), &tmap_gate, full, kt * kBK, n0, c.e);
          if (second_box)
            tma_load_3d(smem_u32(stage + kATileBytes + kBBoxBytes), &tmap_second, full, kt * kBK,
                        n0 + kSecondRowOffset, c.e);
        }
        const int k = kt * kBK + chunk * 8;
        const bool k_ok = k < p.d;
        const uint32_t a_tile = smem_u32(stage);
#pragma unroll
        for (int i = 0; i < kBM / 16; ++i) {
          const int r = row_base + 16 * i;
          const int tok = tok_s[r];
          const bool ok = k_ok && tok >= 0;
          const T* src = ok ? x + size_t(tok) * p.d + k : x;
          cp_async16_zfill(a_tile + r * 128 + ((chunk ^ (r & 7)) << 4), src, ok);
        }
        cp_async_mbar_arrive_noinc(full);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  } else {
    // ================= consumer warpgroups =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int wg = (warp >> 2) - 1;   // 0 or 1: rows [64 wg, 64 wg + 64) of the tile
    const int warp_in_wg = warp & 3;  // rows [16 warp_in_wg, +16) of the warpgroup's 64
    const int cw = warp - 4;
    uint32_t* stg = reinterpret_cast<uint32_t*>(epi + cw * kEpiWarpBytes);
    const int g = lane >> 2, t4 = lane & 3;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    uint32_t it = 0;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = decode_tile(t, tile_start, p);
      const int n0 = c.n_tile * kTileCols;
      int prev_s = 0;
      for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(smem_u32(full_bar + s), (it / kStages) & 1);
        // The A rows were written by cp.async (generic proxy); wgmma reads through the async proxy.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        const uint32_t stage = smem_u32(smem + s * kStageBytes);
        const uint64_t desc_a = smem_desc_kmajor_sw128(stage + wg * (kATileBytes / 2));
        const uint64_t desc_b = smem_desc_kmajor_sw128(stage + kATileBytes);
        fence_accumulators(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          // +32 bytes per 16 k inside the swizzle row: +2 in the descriptor's address field.
          wgmma_m64n256k16<T>(acc, desc_a + 2 * kk, desc_b + 2 * kk, (kt > 0 || kk > 0) ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_accumulators(acc);
        if (kt > 0 && lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));
        prev_s = s;
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));

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
                v = pack2<T>(act_math::forward(kAct, ra0, rb0), act_math::forward(kAct, ra1, rb1));
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
#else
  __trap();  // no sm_90a image: sm90_f1_supported never lets this run
#endif  // MB_SM90_DEVICE
}

// ---- host -----------------------------------------------------------------------------------

typedef CUresult (*EncodeTiledFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                  const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                  const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder through the runtime (no libcuda link); nullptr if unavailable.
EncodeTiledFn tensor_map_encoder() {
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

// Weights [E, h, d] as a 3-D tensor (d fastest); box = 64 k x 128 rows x 1 expert, 128B swizzle;
// rows past h and k past d read as zeros (never the next expert's rows).
template <typename T>
CUtensorMap make_weight_map(const void* w, int64_t E, int64_t h, int64_t d) {
  CUtensorMap map;
  std::memset(&map, 0, sizeof(map));
  const cuuint64_t dims[3] = {cuuint64_t(d), cuuint64_t(h), cuuint64_t(E)};
  const cuuint64_t strides[2] = {cuuint64_t(d) * sizeof(T),
                                 cuuint64_t(h) * cuuint64_t(d) * sizeof(T)};
  const cuuint32_t box[3] = {kBK, kBBoxRows, 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUtensorMapDataType type = std::is_same<T, __nv_bfloat16>::value
                                       ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const EncodeTiledFn encode = tensor_map_encoder();
  MB_REQUIRE(encode != nullptr, MOEBLAZE_ERR_CUDA,
             "sm90 F1: cuTensorMapEncodeTiled is not available from the driver");
  const CUresult r = encode(&map, type, 3, const_cast<void*>(w), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MB_REQUIRE(r == CUDA_SUCCESS, MOEBLAZE_ERR_CUDA, "sm90 F1: cuTensorMapEncodeTiled failed (%d)",
             int(r));
  return map;
}

using KernelFn = void (*)(const CUtensorMap, const CUtensorMap, const F1Params);

template <typename T>
KernelFn kernel_for_act(Activation act) {
  switch (act) {
    case Activation::SwiGLU: return sm90_f1_kernel<T, int(Activation::SwiGLU)>;
    case Activation::GeGLU: return sm90_f1_kernel<T, int(Activation::GeGLU)>;
    case Activation::ReGLU: return sm90_f1_kernel<T, int(Activation::ReGLU)>;
    case Activation::SiLU: return sm90_f1_kernel<T, int(Activation::SiLU)>;
    case Activation::GELU: return sm90_f1_kernel<T, int(Activation::GELU)>;
    case Activation::ReLU: return sm90_f1_kernel<T, int(Activation::ReLU)>;
    case Activation::ReLU2: return sm90_f1_kernel<T, int(Activation::ReLU2)>;
  }
  return nullptr;
}

KernelFn kernel_for(Dtype dtype, Activation act) {
  if (dtype == Dtype::BF16) return kernel_for_act<__nv_bfloat16>(act);
  if (dtype == Dtype::F16) return kernel_for_act<__half>(act);
  return nullptr;
}

constexpr Activation kAllActivations[] = {Activation::SwiGLU, Activation::GeGLU, Activation::ReGLU,
                                          Activation::SiLU,   Activation::GELU,  Activation::ReLU,
                                          Activation::ReLU2};

// What the launch needs to know about a device, found once per device.
struct DeviceInfo {
  int cc_major = 0, cc_minor = 0;
  int sms = 0;
  bool usable = false;  // cc 9.0, an sm_90 image of every kernel, the shared memory fits
};

const DeviceInfo& device_info(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, DeviceInfo> infos;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = infos.find(device);
  if (found != infos.end()) return found->second;
  DeviceInfo info;
  int optin = 0;
  bool ok =
      cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, device) ==
          cudaSuccess &&
      cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, device) ==
          cudaSuccess &&
      cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
          cudaSuccess;
  ok = ok && info.cc_major == 9 && info.cc_minor == 0 && info.sms > 0 &&
       size_t(optin) >= kMaxSmemBytes && tensor_map_encoder() != nullptr;
  if (ok) {
    // The image the runtime picked for this device must be the sm_90a one (a build without 90a
    // in MOEBLAZE_CUDA_ARCHS would run the trapping sm_80 image), and the shared memory opt-in is
    // set here, once per device, never during a (possibly captured) launch.
    int previous = -1;
    ok = cudaGetDevice(&previous) == cudaSuccess;
    const bool switch_device = ok && previous != device;
    if (switch_device) ok = cudaSetDevice(device) == cudaSuccess;
    for (Dtype dtype : {Dtype::BF16, Dtype::F16}) {
      for (Activation act : kAllActivations) {
        if (!ok) break;
        const KernelFn fn = kernel_for(dtype, act);
        cudaFuncAttributes attr;
        ok = cudaFuncGetAttributes(&attr, fn) == cudaSuccess && attr.binaryVersion >= 90 &&
             cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  int(kMaxSmemBytes)) == cudaSuccess;
      }
    }
    if (switch_device) cudaSetDevice(previous);
  }
  (void)cudaGetLastError();  // a refused query leaves no sticky error behind
  info.usable = ok;
  return infos.emplace(device, info).first->second;
}

const DeviceInfo& current_device_info() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    static const DeviceInfo none;
    return none;
  }
  return device_info(device);
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace

bool sm90_f1_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("MOEBLAZE_CUDA_SM90");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return enabled;
}

void sm90_f1_prepare_device(int device) {
  (void)device_info(device);
}

void sm90_current_device_cc(int* cc_major, int* cc_minor) {
  const DeviceInfo& info = current_device_info();
  *cc_major = info.cc_major;
  *cc_minor = info.cc_minor;
}

bool sm90_f1_supported(const LayerDesc& desc, int64_t T, int cc_major, int cc_minor, const void* x,
                       const void* w_gate, const void* w_up, const void* out_a, const void* out_b,
                       const void* out_u, int64_t ab_ld) {
  if (cc_major != 9 || cc_minor != 0) return false;
  if (desc.dtype != Dtype::BF16 && desc.dtype != Dtype::F16) return false;
  if (kernel_for(desc.dtype, desc.activation) == nullptr) return false;
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
  const void* required[] = {x, w_gate, desc.gated() ? w_up : w_gate};
  for (const void* ptr : required)
    if (ptr == nullptr || !aligned16(ptr)) return false;
  const void* outputs[] = {out_a, desc.gated() ? out_b : nullptr, out_u};
  for (const void* ptr : outputs)
    if (ptr != nullptr && !aligned16(ptr)) return false;
  return current_device_info().usable;
}

void sm90_f1_launch(const LayerDesc& desc, int64_t T, const void* x, const int32_t* expert_offsets,
                    const int32_t* expert_token_indices, const void* w_gate, const void* w_up,
                    void* out_a, void* out_b, void* out_u, int64_t ab_ld, cudaStream_t stream) {
  const int64_t N = T * desc.k;
  const bool gated = desc.gated();
  if (!gated) out_b = nullptr;
  if (N == 0 || (out_a == nullptr && out_b == nullptr && out_u == nullptr)) return;
  const DeviceInfo& info = current_device_info();
  MB_REQUIRE(info.usable, MOEBLAZE_ERR_CUDA, "sm90 F1 launched on an unsupported device");
  const KernelFn kernel = kernel_for(desc.dtype, desc.activation);
  MB_REQUIRE(kernel != nullptr, MOEBLAZE_ERR_CUDA, "sm90 F1: unsupported dtype or activation");

  F1Params p;
  p.x = x;
  p.offsets = expert_offsets;
  p.token_index = expert_token_indices;
  p.out_a = out_a;
  p.out_b = out_b;
  p.out_u = out_u;
  p.ab_ld = ab_ld != 0 ? ab_ld : desc.h;
  p.d = int(desc.d);
  p.h = int(desc.h);
  p.E = int(desc.E);
  const int cols = tile_cols(gated);
  p.n_tiles = int((desc.h + cols - 1) / cols);
  p.k_tiles = int((desc.d + kBK - 1) / kBK);

  CUtensorMap map_gate, map_second;
  if (desc.dtype == Dtype::BF16) {
    map_gate = make_weight_map<__nv_bfloat16>(w_gate, desc.E, desc.h, desc.d);
    map_second = gated ? make_weight_map<__nv_bfloat16>(w_up, desc.E, desc.h, desc.d) : map_gate;
  } else {
    map_gate = make_weight_map<__half>(w_gate, desc.E, desc.h, desc.d);
    map_second = gated ? make_weight_map<__half>(w_up, desc.E, desc.h, desc.d) : map_gate;
  }
  // Persistent: one CTA per SM (the shared memory allows no more), fewer when there are fewer
  // tiles than SMs (an upper bound from N: sum_e ceil(count_e / 128) <= N / 128 + E).
  const int64_t max_tiles = (N / kBM + desc.E) * p.n_tiles;
  const int grid = int(max_tiles < info.sms ? max_tiles : info.sms);
  kernel<<<grid, kThreads, smem_bytes(p.E), stream>>>(map_gate, map_second, p);
  check_launch("sm90_f1_kernel");
}

}  // namespace cuda
}  // namespace moeblaze
