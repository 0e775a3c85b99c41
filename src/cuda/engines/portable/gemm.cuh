// The grouped GEMM engine of the expert kernels (F1, F2, B1, B2, B3, B4) and their epilogues.
//
// One problem = for each expert e, C_e[M_e, N] = sum_k A_e[m, k] * B_e[k, n]. Either M is the
// expert's routed rows ("rows-M": F1, F2, B1, B4; m-tiles come from expert_offsets on the device)
// or K is ("rows-K": the weight gradients B2/B3, where every expert owns a fixed M x N output).
//
// Each operand is either K-major (element (i, k) at row(i)[k]: x, dy, u, da|db rows, nn.Linear
// weights read as [out, in]) or MN-major (element (i, k) at row(k)[i]: weights read as [in, out],
// routed tensors in the weight gradients). A row pointer comes from:
//   - routed tensors: routed row r = expert_offsets[e] + index; the source row is gather[r] (token
//   id,
//     gather-on-load) or r itself;
//   - weights: expert e's matrix; row indices >= split come from the second pointer (B4 reads
//     [w_gate; w_up] as one K = 2h operand).
// F1 is "dual": its B tile holds BN/2 rows of w_gate and the same BN/2 rows of w_up, so one A tile
// feeds both projections and the epilogue sees a and b of the same (row, column) side by side.
//
// Two engines share the operand and epilogue code:
//   - mma_gemm_kernel: bf16/f16 tensor cores, mma.sync m16n8k16 with fp32 accumulation, ldmatrix
//     (.trans for MN-major operands), a 4-stage cp.async pipeline of 128x128x32 tiles, 8 warps of
//     64x32 (or 4 of 64x64, see MmaLayout), XOR-swizzled shared memory (conflict-free ldmatrix),
//     gather indices of MN-major operands prefetched one k-tile ahead. Needs d % 8 == 0,
//     h % 8 == 0 and 16-byte aligned operands (the host checks).
//   - simt_gemm_kernel: exact fp32 FMA on 64x64x16 tiles with element-wise predicated loads. It is
//     the F32 path (validation, not speed) and the fallback for odd shapes or misaligned pointers.
// Both stage the fp32 tile in shared memory, then a row-wise epilogue (a warp per row) applies the
// operation's epilogue, so per-row reductions (B1's dg) have a fixed order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/activation_math.hpp"
#include "common/layer_desc.hpp"
#include "cuda/cuda_util.cuh"

namespace moeblaze {
namespace cuda {

enum class Epi : int { F1 = 0, F2 = 1, B1 = 2, Wgrad = 3, B4 = 4 };

struct Operand {
  const void* p0 = nullptr;
  const void* p1 = nullptr;         // second source (dual F1 w_up; B4 rows >= split)
  int64_t ld = 0;                   // elements between consecutive rows
  int64_t expert_stride = 0;        // weights: elements per expert
  const int32_t* gather = nullptr;  // routed: source row of each routed row (token ids)
  int32_t split = 0;                // weights with p1: row indices >= split read p1
  bool routed = false;
};

struct EpilogueArgs {
  Activation act = Activation::SwiGLU;
  bool gated = false;
  int64_t h = 0, d = 0;
  int64_t total_rows = 0;  // N = T*k (for the dg partial layout)
  // F1
  void* out_a = nullptr;
  void* out_b = nullptr;
  void* out_u = nullptr;
  // F2 / B4: routed row r of the result, weighted and rounded to the storage dtype
  // (row_value(w, v), w = out_w[out_pair[r]] for F2's g, 1 when out_w is null), goes to row r
  // of out_rows ([N, d]; the per-token reduction sums a token's k rows) or, with out_by_pair
  // (k = 1), to row out_pair[r] ([T, d]: the token's output itself).
  void* out_rows = nullptr;
  int64_t rows_ld = 0;                // elements between rows of out_rows; 0 = d
  const int32_t* out_pair = nullptr;  // [N] routed row -> (token, slot) pair index
  const float* out_w = nullptr;       // [T*k]
  bool out_by_pair = false;
  // B1
  const void* a_src = nullptr;
  const void* b_src = nullptr;
  // Row stride (elements) of F1's out_a/out_b and B1's a_src/b_src; 0 means h. RECOMPUTE's backward
  // keeps a, b inside the da|db buffer (stride 2h): B1 reads each a, b element once, in the thread
  // that then overwrites it with da, db.
  int64_t ab_ld = 0;
  const void* u_src = nullptr;  // SAVE_ALL: u as saved; else recomputed from a, b
  const float* g = nullptr;     // [T*k]
  const int32_t* row_pair = nullptr;
  void* dadb = nullptr;      // [N, 2h] (gated) or [N, h]
  void* gu = nullptr;        // [N, h]: g * u, storage dtype
  float* dg_part = nullptr;  // [n-tiles, N]
  // B1 under a column chunk (experts.cu): h is then the chunk's width, the activation pointers
  // point at its first column, gu is the chunk's own [N, h] buffer, and these carry the full-width
  // buffers' row strides and da's distance to db. 0: derived from h (no chunk).
  int64_t dadb_ld = 0, db_offset = 0, u_ld = 0;
  // Wgrad: rows m < split -> out0[e], else out1[e] (row m - split)
  void* out0 = nullptr;
  void* out1 = nullptr;
  int64_t out_ld = 0, out_expert_stride = 0;
  int32_t out_split = 0;
  bool accumulate = false;
};

struct GemmParams {
  int E = 0;
  int M = 0, N = 0, K = 0;               // the ragged one of M (rows-M) / K (rows-K) is ignored
  const int32_t* offsets = nullptr;      // [E+1]
  const int32_t* mtile_start = nullptr;  // [E+1], rows-M only (for this engine's BM)
  const int32_t* tile_expert = nullptr;  // [num_mtiles]: expert of each m-tile (rows-M)
  int num_mtiles = 0;                    // grid: rows-M worst case / rows-K per expert
  int num_ntiles = 0;
  bool dual = false;
  Operand A, B;
  EpilogueArgs ep;
};

template <Epi EPI>
struct EpiTraits {
  static constexpr bool a_kmajor = EPI != Epi::Wgrad;
  static constexpr bool b_kmajor = EPI == Epi::F1 || EPI == Epi::F2;
  static constexpr bool rows_k = EPI == Epi::Wgrad;
};

// ---- operand addressing -----------------------------------------------------------------------

// Row `index` of an operand for expert e (routed: index relative to the expert's first row).
template <typename T>
__device__ __forceinline__ const T* operand_row(const Operand& op, int e, int off_e,
                                                int64_t index) {
  if (op.routed) {
    const int64_t r = off_e + index;
    const int64_t src = op.gather ? int64_t(__ldg(op.gather + r)) : r;
    return static_cast<const T*>(op.p0) + src * op.ld;
  }
  if (op.p1 && index >= op.split)
    return static_cast<const T*>(op.p1) + e * op.expert_stride + (index - op.split) * op.ld;
  return static_cast<const T*>(op.p0) + e * op.expert_stride + index * op.ld;
}

// Dual-B row: tile row c < half reads p0 row n0 + c, else p1 row n0 + c - half.
template <typename T>
__device__ __forceinline__ const T* dual_row(const Operand& op, int e, int64_t index, bool second) {
  const void* base = second ? op.p1 : op.p0;
  return static_cast<const T*>(base) + e * op.expert_stride + index * op.ld;
}

// ---- the tile's identity ------------------------------------------------------------------------

struct TileInfo {
  int e;
  int off_e;
  int rows;  // valid rows of M for this expert (rows-M: count; rows-K: M)
  int kdim;  // K extent (rows-K: count)
  int m0;    // first M index of the tile (local to the expert)
  int nt;    // n-tile index
  bool valid;
};

template <bool ROWS_K>
__device__ __forceinline__ TileInfo locate_tile(const GemmParams& p, int bm) {
  TileInfo ti;
  const int64_t bid = blockIdx.x;
  ti.nt = int(bid % p.num_ntiles);
  const int64_t mt = bid / p.num_ntiles;
  if (ROWS_K) {
    ti.e = int(mt / p.num_mtiles);
    ti.m0 = int(mt % p.num_mtiles) * bm;
    ti.off_e = p.offsets[ti.e];
    ti.kdim = p.offsets[ti.e + 1] - ti.off_e;
    ti.rows = p.M;
    ti.valid = true;
    return ti;
  }
  // Independent loads: the number of valid m-tiles and this tile's expert (garbage past total).
  const int total = __ldg(p.mtile_start + p.E);
  const int e = __ldg(p.tile_expert + mt);
  ti.valid = mt < total;
  if (!ti.valid) return ti;
  ti.e = e;
  ti.m0 = int(mt - __ldg(p.mtile_start + e)) * bm;
  ti.off_e = __ldg(p.offsets + e);
  ti.rows = __ldg(p.offsets + e + 1) - ti.off_e;
  ti.kdim = p.K;
  return ti;
}

// ---- row-wise epilogue (a warp per row of the staged fp32 tile) ---------------------------------

// Two adjacent elements at p (p[0], p[1]); `both` false: only p[0]. `vec`: p is 2-element aligned.
template <typename T>
__device__ __forceinline__ void load2(const T* p, bool both, bool vec, float& a, float& b) {
  if (both && vec) {
    if constexpr (std::is_same<T, float>::value) {
      const float2 v = *reinterpret_cast<const float2*>(p);
      a = v.x;
      b = v.y;
    } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
      a = v.x;
      b = v.y;
    } else {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(p));
      a = v.x;
      b = v.y;
    }
    return;
  }
  a = to_f32<T>(p[0]);
  b = both ? to_f32<T>(p[1]) : 0.f;
}

template <typename T>
__device__ __forceinline__ void store2(T* p, bool both, bool vec, float a, float b) {
  if (both && vec) {
    if constexpr (std::is_same<T, float>::value) {
      *reinterpret_cast<float2*>(p) = make_float2(a, b);
    } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
    } else {
      *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
    }
    return;
  }
  p[0] = from_f32<T>(a);
  if (both) p[1] = from_f32<T>(b);
}

// Lanes own column pairs (2*lane, 2*lane+1) + 64*i, so stores are 4- or 8-byte wide when the row
// stride is even (`vec`).
template <typename T, Epi EPI>
__device__ void tile_epilogue(const GemmParams& p, const TileInfo& ti, const float* cs, int cs_ld,
                              int bm, int bn) {
  const EpilogueArgs& ep = p.ep;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nwarps = blockDim.x >> 5;
  const int logical_bn = p.dual ? bn / 2 : bn;
  const int n0 = ti.nt * logical_bn;
  for (int r = warp; r < bm; r += nwarps) {
    const int m = ti.m0 + r;
    if (m >= ti.rows) break;
    const float* crow = cs + r * cs_ld;
    if constexpr (EPI == Epi::F1) {
      const int64_t grow = int64_t(ti.off_e) + m;
      const bool vec = (ep.h & 1) == 0;
      for (int c = 2 * lane; c < logical_bn; c += 64) {
        const int64_t n = n0 + c;
        if (n >= ep.h) break;
        const bool both = n + 1 < ep.h;
        const float a0 = round_to<T>(crow[c]), a1 = round_to<T>(crow[c + 1]);
        const float b0 = ep.gated ? round_to<T>(crow[c + logical_bn]) : 0.f;
        const float b1 = ep.gated ? round_to<T>(crow[c + 1 + logical_bn]) : 0.f;
        const int64_t at = grow * ep.h + n;
        const int64_t at_ab = grow * (ep.ab_ld ? ep.ab_ld : ep.h) + n;
        if (ep.out_a) store2(static_cast<T*>(ep.out_a) + at_ab, both, vec, a0, a1);
        if (ep.out_b) store2(static_cast<T*>(ep.out_b) + at_ab, both, vec, b0, b1);
        if (ep.out_u)
          store2(static_cast<T*>(ep.out_u) + at, both, vec, act_forward<T>(ep.act, a0, b0),
                 act_forward<T>(ep.act, a1, b1));
      }
    } else if constexpr (EPI == Epi::F2 || EPI == Epi::B4) {
      const int64_t grow = int64_t(ti.off_e) + m;
      const int64_t pair = ep.out_pair ? int64_t(ep.out_pair[grow]) : grow;
      const float w = ep.out_w ? ep.out_w[pair] : 1.f;
      const int64_t rows_ld = ep.rows_ld ? ep.rows_ld : ep.d;
      T* orow = static_cast<T*>(ep.out_rows) + (ep.out_by_pair ? pair : grow) * rows_ld;
      const bool vec = (ep.d & 1) == 0 && (rows_ld & 1) == 0 &&
                       reinterpret_cast<uintptr_t>(ep.out_rows) % (2 * sizeof(T)) == 0;
      for (int c = 2 * lane; c < logical_bn; c += 64) {
        const int64_t n = n0 + c;
        if (n >= ep.d) break;
        store2(orow + n, n + 1 < ep.d, vec, row_value<T>(w, crow[c]), row_value<T>(w, crow[c + 1]));
      }
    } else if constexpr (EPI == Epi::B1) {
      const int64_t grow = int64_t(ti.off_e) + m;
      const float gval = ep.g[ep.row_pair[grow]];
      const int64_t dadb_ld = ep.dadb_ld ? ep.dadb_ld : (ep.gated ? 2 * ep.h : ep.h);
      const int64_t db_offset = ep.db_offset ? ep.db_offset : ep.h;
      const int64_t u_ld = ep.u_ld ? ep.u_ld : ep.h;
      const bool vec = (ep.h & 1) == 0;
      float dot = 0.f;
      for (int c = 2 * lane; c < logical_bn; c += 64) {
        const int64_t n = n0 + c;
        if (n >= ep.h) break;
        const bool both = n + 1 < ep.h;
        const float v0 = crow[c], v1 = both ? crow[c + 1] : 0.f;
        const int64_t at = grow * ep.h + n;
        const int64_t at_ab = grow * (ep.ab_ld ? ep.ab_ld : ep.h) + n;
        float a0, a1, b0 = 0.f, b1 = 0.f, u0, u1;
        load2(static_cast<const T*>(ep.a_src) + at_ab, both, vec, a0, a1);
        if (ep.gated) load2(static_cast<const T*>(ep.b_src) + at_ab, both, vec, b0, b1);
        if (ep.u_src) {
          load2(static_cast<const T*>(ep.u_src) + grow * u_ld + n, both, vec, u0, u1);
        } else {
          u0 = round_to<T>(act_forward<T>(ep.act, a0, b0));
          u1 = both ? round_to<T>(act_forward<T>(ep.act, a1, b1)) : 0.f;
        }
        dot += v0 * u0;
        dot += v1 * u1;
        float da0, db0, da1, db1;
        act_backward<T>(ep.act, a0, b0, gval * v0, &da0, &db0);
        act_backward<T>(ep.act, a1, b1, gval * v1, &da1, &db1);
        T* drow = static_cast<T*>(ep.dadb) + grow * dadb_ld;
        store2(drow + n, both, vec, da0, da1);
        if (ep.gated) store2(drow + db_offset + n, both, vec, db0, db1);
        store2(static_cast<T*>(ep.gu) + at, both, vec, gval * u0, gval * u1);
      }
      dot = warp_sum(dot);
      if (lane == 0) ep.dg_part[int64_t(ti.nt) * ep.total_rows + grow] = dot;
    } else {  // Wgrad
      const bool second = m >= ep.out_split;
      T* out = static_cast<T*>(second ? ep.out1 : ep.out0);
      if (out == nullptr) continue;
      T* orow = out + int64_t(ti.e) * ep.out_expert_stride +
                int64_t(second ? m - ep.out_split : m) * ep.out_ld;
      const bool vec = (ep.out_ld & 1) == 0 && (ep.out_expert_stride & 1) == 0 &&
                       (reinterpret_cast<uintptr_t>(out) % (2 * sizeof(T))) == 0;
      for (int c = 2 * lane; c < logical_bn; c += 64) {
        const int n = n0 + c;
        if (n >= p.N) break;
        const bool both = n + 1 < p.N;
        float v0 = crow[c], v1 = crow[c + 1];
        if (ep.accumulate) {
          float o0, o1;
          load2(orow + n, both, vec, o0, o1);
          v0 += o0;
          v1 += o1;
        }
        store2(orow + n, both, vec, v0, v1);
      }
    }
  }
}

// ---- SIMT engine (exact fp32) -------------------------------------------------------------------

constexpr int kSimtBM = 64, kSimtBN = 64, kSimtBK = 16, kSimtThreads = 256;

template <typename T, bool KMAJOR>
__device__ __forceinline__ float simt_fetch(const Operand& op, int e, int off_e, int64_t i,
                                            int64_t k) {
  if (KMAJOR) return to_f32<T>(operand_row<T>(op, e, off_e, i)[k]);
  return to_f32<T>(operand_row<T>(op, e, off_e, k)[i]);
}

template <typename T, Epi EPI>
__global__ void __launch_bounds__(kSimtThreads) simt_gemm_kernel(const GemmParams p) {
  using Tr = EpiTraits<EPI>;
  __shared__ float As[kSimtBK][kSimtBM];
  __shared__ float Bs[kSimtBK][kSimtBN];
  __shared__ float Cs[kSimtBM][kSimtBN + 1];
  const TileInfo ti = locate_tile<Tr::rows_k>(p, kSimtBM);
  if (!ti.valid) return;
  const int tid = threadIdx.x;
  const int tx = tid & 15, ty = tid >> 4;
  const int half = kSimtBN / 2;
  const int logical_bn = p.dual ? half : kSimtBN;
  const int n0 = ti.nt * logical_bn;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < ti.kdim; k0 += kSimtBK) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + i * kSimtThreads;
      const int mm = Tr::a_kmajor ? idx >> 4 : idx & 63;
      const int kk = Tr::a_kmajor ? idx & 15 : idx >> 6;
      const int m = ti.m0 + mm;
      const int k = k0 + kk;
      float v = 0.f;
      if (m < ti.rows && k < ti.kdim) v = simt_fetch<T, Tr::a_kmajor>(p.A, ti.e, ti.off_e, m, k);
      As[kk][mm] = v;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + i * kSimtThreads;
      const int nn = Tr::b_kmajor ? idx >> 4 : idx & 63;
      const int kk = Tr::b_kmajor ? idx & 15 : idx >> 6;
      const int k = k0 + kk;
      float v = 0.f;
      if (p.dual) {
        const bool second = nn >= half;
        const int n = n0 + (second ? nn - half : nn);
        if (n < p.N && k < ti.kdim) v = to_f32<T>(dual_row<T>(p.B, ti.e, n, second)[k]);
      } else {
        const int n = n0 + nn;
        if (n < p.N && k < ti.kdim) v = simt_fetch<T, Tr::b_kmajor>(p.B, ti.e, ti.off_e, n, k);
      }
      Bs[kk][nn] = v;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSimtBK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) Cs[ty * 4 + i][tx * 4 + j] = acc[i][j];
  __syncthreads();
  tile_epilogue<T, EPI>(p, ti, &Cs[0][0], kSimtBN + 1, kSimtBM, kSimtBN);
}

// ---- tensor-core engine (bf16 / f16) ------------------------------------------------------------

constexpr int kMmaBM = 128, kMmaBN = 128, kMmaBK = 32, kMmaStages = 4;
// Warp layouts (template parameter WARPS_N): 2 x 2 warps of 64 x 64 (128 bytes of shared memory
// read per mma, 4 warps, ~230 registers) or 2 x 4 warps of 64 x 32 (192 bytes per mma, 8 warps,
// ~126 registers, twice the warps to hide the epilogue's latency). By default F2 uses the first and
// every other GEMM the second (measured); MOEBLAZE_CUDA_MMA_WARPS=4 or 8, read at backend creation,
// forces one layout everywhere.
template <int WARPS_N>
struct MmaLayout {
  static constexpr int warps_m = 2, warps_n = WARPS_N;
  static constexpr int threads = 32 * warps_m * warps_n;
  static constexpr int warp_tile_m = kMmaBM / warps_m, warp_tile_n = kMmaBN / warps_n;
  static constexpr int frags_m = warp_tile_m / 16, frags_n = warp_tile_n / 8;
  // 16-byte chunks of one operand's stage (128 x 32 halves) per thread.
  static constexpr int chunks = kMmaBM * kMmaBK / 8 / threads;
  static_assert(frags_m == 4 && frags_n % 2 == 0, "fragment loops assume these");
};
static_assert(kMmaBM == kMmaBN, "the loaders assume square tiles");
constexpr int kMmaCsLd = kMmaBN + 4;
constexpr size_t kMmaStageHalves = size_t(kMmaBM) * kMmaBK + size_t(kMmaBN) * kMmaBK;
constexpr size_t kMmaPipeBytes = kMmaStageHalves * 2 * kMmaStages;
constexpr size_t kMmaEpiBytes = size_t(kMmaBM) * kMmaCsLd * sizeof(float);
constexpr size_t kMmaSmemBytes = kMmaPipeBytes > kMmaEpiBytes ? kMmaPipeBytes : kMmaEpiBytes;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: zero-fill, src not read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared-memory offsets (in halves) of 16-byte chunk `chunk` of row `row`, swizzled so that the
// eight rows one ldmatrix reads fall into distinct bank groups.
// K-major tile [128 rows][32 k]: 4 chunks per row.
__device__ __forceinline__ int kmajor_offset(int row, int chunk) {
  return row * kMmaBK + ((chunk ^ ((row >> 1) & 3)) << 3);
}
// MN-major tile [32 k][128]: 16 chunks per row.
__device__ __forceinline__ int mnmajor_offset(int krow, int chunk) {
  return krow * 128 + ((chunk ^ (krow & 7)) << 3);
}

// Loads one operand's 128 x 32 tile for k-tile starting at k0 into `tile` (cp.async, zero-fill
// outside the problem). K-major: thread owns rows tid/4 and tid/4 + 64, chunk tid%4 (row pointers
// fixed for the whole tile). MN-major: thread owns k-rows tid/16 and tid/16 + 16, chunk tid%16.
template <typename T, bool KMAJOR, int THREADS>
struct TileLoader {
  static constexpr int kMmaChunksPerThread = kMmaBM * kMmaBK / 8 / THREADS;
  static constexpr int kMmaThreads = THREADS;
  const T* row_ptr[kMmaChunksPerThread];
  bool row_ok[kMmaChunksPerThread];
  int mn0;       // first MN index of the tile (MN-major)
  int mn_limit;  // MN extent (MN-major)
  // MN-major routed operands: source rows of the two k-rows of the NEXT k-tile, loaded one k-tile
  // ahead so the gather index load is off the cp.async issue path.
  int64_t next_src[kMmaChunksPerThread];

  __device__ __forceinline__ void prefetch_rows(const Operand& op, int off_e, int k0, int kdim) {
    if constexpr (!KMAJOR) {
      if (!op.routed) return;
#pragma unroll
      for (int i = 0; i < kMmaChunksPerThread; ++i) {
        const int k = k0 + (int(threadIdx.x) >> 4) + i * (kMmaThreads / 16);
        const int64_t r = int64_t(off_e) + k;
        next_src[i] = k < kdim ? (op.gather ? int64_t(__ldg(op.gather + r)) : r) : 0;
      }
    }
  }

  // Loads k-tiles in order: k0 = 0, BK, 2*BK, ... (prefetch_rows(op, off_e, 0, kdim) first).
  __device__ __forceinline__ void load(T* tile, const Operand& op, int e, int off_e, int k0,
                                       int kdim) {
    const int tid = threadIdx.x;
    if (KMAJOR) {
      const int chunk = tid & 3;
      const int k = k0 + chunk * 8;
#pragma unroll
      for (int i = 0; i < kMmaChunksPerThread; ++i) {
        const int row = (tid >> 2) + i * (kMmaThreads / 4);
        const bool ok = row_ok[i] && k < kdim;
        const T* src = ok ? row_ptr[i] + k : static_cast<const T*>(op.p0);
        cp_async16(smem_addr(tile + kmajor_offset(row, chunk)), src, ok);
      }
    } else {
      const int chunk = tid & 15;
      const int mn = mn0 + chunk * 8;
      int64_t src_rows[kMmaChunksPerThread];
#pragma unroll
      for (int i = 0; i < kMmaChunksPerThread; ++i) src_rows[i] = next_src[i];
      prefetch_rows(op, off_e, k0 + kMmaBK, kdim);
#pragma unroll
      for (int i = 0; i < kMmaChunksPerThread; ++i) {
        const int krow = (tid >> 4) + i * (kMmaThreads / 16);
        const int k = k0 + krow;
        const bool ok = k < kdim && mn < mn_limit;
        const T* src = static_cast<const T*>(op.p0);
        if (ok) {
          src = op.routed ? static_cast<const T*>(op.p0) + src_rows[i] * op.ld + mn
                          : operand_row<T>(op, e, off_e, k) + mn;
        }
        cp_async16(smem_addr(tile + mnmajor_offset(krow, chunk)), src, ok);
      }
    }
  }
};

// Packed pairs of the 16-bit storage types.
template <typename T>
struct Pair16;
template <>
struct Pair16<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(type v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ type zero() { return __float2bfloat162_rn(0.f); }
};
template <>
struct Pair16<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(type v) { return __half22float2(v); }
  static __device__ __forceinline__ type zero() { return __float2half2_rn(0.f); }
};

// B1's epilogue on the tensor-core tile. tile_epilogue<B1> handles one row at a time and waits for
// that row's loads (row_pair, then g; a, b and u) before it can issue the next row's, so a warp
// pays about three global-memory latencies per row, 16 rows in a row. Here a warp issues the loads
// of kBatch rows first and only then computes and stores them: about three latencies per batch.
// Everything else is as in tile_epilogue<B1>: the rows a warp owns (warp, warp + nwarps, ...), the
// columns a lane owns (2*lane, 2*lane + 1, + 64*j), each element's arithmetic, the order of the
// per-lane dot product and of the warp sum, so results are bitwise identical. The tensor-core
// engine runs only with h % 8 == 0, so every column pair inside h is whole and 4-byte aligned
// (tile_epilogue's `both` and `vec` are always true there); B1 is never dual.
template <typename T, int NWARPS>
__device__ __forceinline__ void b1_epilogue_batched(const GemmParams& p, const TileInfo& ti,
                                                    const float* cs) {
  using P = Pair16<T>;
  using T2 = typename P::type;
  constexpr int kRowsPerWarp = kMmaBM / NWARPS;
  constexpr int kBatch = kRowsPerWarp < 8 ? kRowsPerWarp : 8;
  constexpr int kPairs = kMmaBN / 64;  // column pairs per lane and row: c = 2*lane + 64*j
  static_assert(kRowsPerWarp % kBatch == 0, "whole batches");
  const EpilogueArgs& ep = p.ep;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = ti.nt * kMmaBN;
  const int64_t dadb_ld = ep.dadb_ld ? ep.dadb_ld : (ep.gated ? 2 * ep.h : ep.h);
  const int64_t db_offset = ep.db_offset ? ep.db_offset : ep.h;
  const int64_t u_ld = ep.u_ld ? ep.u_ld : ep.h;
  const int64_t ab_ld = ep.ab_ld ? ep.ab_ld : ep.h;
  const T* a_src = static_cast<const T*>(ep.a_src);
  const T* b_src = static_cast<const T*>(ep.b_src);
  const T* u_src = static_cast<const T*>(ep.u_src);
  for (int batch = 0; batch < kRowsPerWarp; batch += kBatch) {
    if (ti.m0 + warp + batch * NWARPS >= ti.rows) break;  // rows ascend: the rest are past too
    int32_t pair[kBatch];
    T2 ra[kBatch][kPairs], rb[kBatch][kPairs], ru[kBatch][kPairs];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int m = ti.m0 + warp + (batch + i) * NWARPS;
      const bool row_ok = m < ti.rows;
      const int64_t grow = int64_t(ti.off_e) + m;
      pair[i] = row_ok ? __ldg(ep.row_pair + grow) : 0;
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        const int64_t n = n0 + 2 * lane + 64 * j;
        const bool ok = row_ok && n < ep.h;
        const int64_t at_ab = grow * ab_ld + n;
        // Plain (coherent) loads: with RECOMPUTE, a and b live in the da|db buffer this kernel
        // writes (each element is overwritten only after this, its one read, by this thread).
        ra[i][j] = ok ? *reinterpret_cast<const T2*>(a_src + at_ab) : P::zero();
        rb[i][j] = ok && ep.gated ? *reinterpret_cast<const T2*>(b_src + at_ab) : P::zero();
        ru[i][j] = ok && u_src ? *reinterpret_cast<const T2*>(u_src + grow * u_ld + n) : P::zero();
      }
    }
    float gval[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int m = ti.m0 + warp + (batch + i) * NWARPS;
      gval[i] = m < ti.rows ? __ldg(ep.g + pair[i]) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int r = warp + (batch + i) * NWARPS;
      const int m = ti.m0 + r;
      if (m >= ti.rows) break;  // warp-uniform
      const int64_t grow = int64_t(ti.off_e) + m;
      const float* crow = cs + r * kMmaCsLd;
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        const int c = 2 * lane + 64 * j;
        const int64_t n = n0 + c;
        if (n >= ep.h) break;
        const float v0 = crow[c], v1 = crow[c + 1];
        const int64_t at = grow * ep.h + n;
        const float2 af = P::to_float2(ra[i][j]);
        const float a0 = af.x, a1 = af.y;
        float b0 = 0.f, b1 = 0.f, u0, u1;
        if (ep.gated) {
          const float2 bf = P::to_float2(rb[i][j]);
          b0 = bf.x;
          b1 = bf.y;
        }
        if (u_src) {
          const float2 uf = P::to_float2(ru[i][j]);
          u0 = uf.x;
          u1 = uf.y;
        } else {
          u0 = round_to<T>(act_forward<T>(ep.act, a0, b0));
          u1 = round_to<T>(act_forward<T>(ep.act, a1, b1));
        }
        dot += v0 * u0;
        dot += v1 * u1;
        float da0, db0, da1, db1;
        act_backward<T>(ep.act, a0, b0, gval[i] * v0, &da0, &db0);
        act_backward<T>(ep.act, a1, b1, gval[i] * v1, &da1, &db1);
        T* drow = static_cast<T*>(ep.dadb) + grow * dadb_ld;
        store2(drow + n, true, true, da0, da1);
        if (ep.gated) store2(drow + db_offset + n, true, true, db0, db1);
        store2(static_cast<T*>(ep.gu) + at, true, true, gval[i] * u0, gval[i] * u1);
      }
      dot = warp_sum(dot);
      if (lane == 0) ep.dg_part[int64_t(ti.nt) * ep.total_rows + grow] = dot;
    }
  }
}

template <typename T, Epi EPI, int WARPS_N>
__global__ void __launch_bounds__(MmaLayout<WARPS_N>::threads) mma_gemm_kernel(const GemmParams p) {
  using Tr = EpiTraits<EPI>;
  using L = MmaLayout<WARPS_N>;
  constexpr int kMmaThreads = L::threads, kMmaChunksPerThread = L::chunks;
  constexpr int kMmaWarpsN = L::warps_n, kMmaWarpTileM = L::warp_tile_m,
                kMmaWarpTileN = L::warp_tile_n, kMmaFragsM = L::frags_m, kMmaFragsN = L::frags_n;
  extern __shared__ __align__(128) unsigned char smem[];
  T* pipe = reinterpret_cast<T*>(smem);
  const TileInfo ti = locate_tile<Tr::rows_k>(p, kMmaBM);
  if (!ti.valid) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / kMmaWarpsN, warp_n = warp % kMmaWarpsN;
  const int logical_bn = p.dual ? kMmaBN / 2 : kMmaBN;
  const int n0 = ti.nt * logical_bn;

  TileLoader<T, Tr::a_kmajor, kMmaThreads> la;
  TileLoader<T, Tr::b_kmajor, kMmaThreads> lb;
  if (Tr::a_kmajor) {
#pragma unroll
    for (int i = 0; i < kMmaChunksPerThread; ++i) {
      const int m = ti.m0 + (tid >> 2) + i * (kMmaThreads / 4);
      la.row_ok[i] = m < ti.rows;
      la.row_ptr[i] = la.row_ok[i] ? operand_row<T>(p.A, ti.e, ti.off_e, m) : nullptr;
    }
  } else {
    la.mn0 = ti.m0;
    la.mn_limit = ti.rows;
    la.prefetch_rows(p.A, ti.off_e, 0, ti.kdim);
  }
  if (Tr::b_kmajor) {
#pragma unroll
    for (int i = 0; i < kMmaChunksPerThread; ++i) {
      const int nn = (tid >> 2) + i * (kMmaThreads / 4);
      if (p.dual) {
        const bool second = nn >= kMmaBN / 2;
        const int n = n0 + (second ? nn - kMmaBN / 2 : nn);
        lb.row_ok[i] = n < p.N;
        lb.row_ptr[i] = lb.row_ok[i] ? dual_row<T>(p.B, ti.e, n, second) : nullptr;
      } else {
        const int n = n0 + nn;
        lb.row_ok[i] = n < p.N;
        lb.row_ptr[i] = lb.row_ok[i] ? operand_row<T>(p.B, ti.e, ti.off_e, n) : nullptr;
      }
    }
  } else {
    lb.mn0 = n0;
    lb.mn_limit = p.N;
    lb.prefetch_rows(p.B, ti.off_e, 0, ti.kdim);
  }

  float acc[kMmaFragsM][kMmaFragsN][4];
#pragma unroll
  for (int i = 0; i < kMmaFragsM; ++i)
#pragma unroll
    for (int j = 0; j < kMmaFragsN; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

  const int num_k_tiles = (ti.kdim + kMmaBK - 1) / kMmaBK;
  auto stage_a = [&](int s) { return pipe + size_t(s) * kMmaStageHalves; };
  auto stage_b = [&](int s) { return pipe + size_t(s) * kMmaStageHalves + kMmaBM * kMmaBK; };

#pragma unroll
  for (int s = 0; s < kMmaStages - 1; ++s) {
    if (s < num_k_tiles) {
      la.load(stage_a(s), p.A, ti.e, ti.off_e, s * kMmaBK, ti.kdim);
      lb.load(stage_b(s), p.B, ti.e, ti.off_e, s * kMmaBK, ti.kdim);
    }
    cp_async_commit();
  }

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<kMmaStages - 2>();
    __syncthreads();
    const int next = kt + kMmaStages - 1;
    if (next < num_k_tiles) {
      const int s = next % kMmaStages;
      la.load(stage_a(s), p.A, ti.e, ti.off_e, next * kMmaBK, ti.kdim);
      lb.load(stage_b(s), p.B, ti.e, ti.off_e, next * kMmaBK, ti.kdim);
    }
    cp_async_commit();
    const T* As = stage_a(kt % kMmaStages);
    const T* Bs = stage_b(kt % kMmaStages);
#pragma unroll
    for (int ks = 0; ks < kMmaBK / 16; ++ks) {
      uint32_t af[kMmaFragsM][4];
      uint32_t bf[kMmaFragsN / 2][4];
#pragma unroll
      for (int i = 0; i < kMmaFragsM; ++i) {
        if (Tr::a_kmajor) {
          const int row = warp_m * kMmaWarpTileM + i * 16 + (lane & 15);
          const int chunk = ks * 2 + (lane >> 4);
          ldmatrix_x4(smem_addr(As + kmajor_offset(row, chunk)), af[i]);
        } else {
          const int krow = ks * 16 + (lane & 7) + ((lane >> 4) << 3);
          const int col = warp_m * kMmaWarpTileM + i * 16 + ((lane >> 3) & 1) * 8;
          ldmatrix_x4_trans(smem_addr(As + mnmajor_offset(krow, col >> 3)), af[i]);
        }
      }
#pragma unroll
      for (int jp = 0; jp < kMmaFragsN / 2; ++jp) {
        if (Tr::b_kmajor) {
          const int row = warp_n * kMmaWarpTileN + jp * 16 + (lane & 7) + ((lane >> 4) << 3);
          const int chunk = ks * 2 + ((lane >> 3) & 1);
          ldmatrix_x4(smem_addr(Bs + kmajor_offset(row, chunk)), bf[jp]);
        } else {
          const int krow = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
          const int col = warp_n * kMmaWarpTileN + jp * 16 + (lane >> 4) * 8;
          ldmatrix_x4_trans(smem_addr(Bs + mnmajor_offset(krow, col >> 3)), bf[jp]);
        }
      }
#pragma unroll
      for (int i = 0; i < kMmaFragsM; ++i)
#pragma unroll
        for (int j = 0; j < kMmaFragsN; ++j)
          mma_16816<T>(acc[i][j], af[i], bf[j >> 1][(j & 1) * 2], bf[j >> 1][(j & 1) * 2 + 1]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  float* cs = reinterpret_cast<float*>(smem);
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int i = 0; i < kMmaFragsM; ++i)
#pragma unroll
    for (int j = 0; j < kMmaFragsN; ++j) {
      const int row = warp_m * kMmaWarpTileM + i * 16 + g;
      const int col = warp_n * kMmaWarpTileN + j * 8 + t4 * 2;
      *reinterpret_cast<float2*>(cs + row * kMmaCsLd + col) =
          make_float2(acc[i][j][0], acc[i][j][1]);
      *reinterpret_cast<float2*>(cs + (row + 8) * kMmaCsLd + col) =
          make_float2(acc[i][j][2], acc[i][j][3]);
    }
  __syncthreads();
  if constexpr (EPI == Epi::B1) {
    b1_epilogue_batched<T, kMmaThreads / 32>(p, ti, cs);
    return;
  }
  tile_epilogue<T, EPI>(p, ti, cs, kMmaCsLd, kMmaBM, kMmaBN);
}

// Host side (gemm.cu).
// use_mma: tensor cores (bf16/f16, aligned, d and h multiples of 8), else the SIMT engine.
// mma_warps: the tensor-core warp layout, 4 (2x2 warps of 64x64), 8 (2x4 of 64x32), else the
// per-GEMM default (CudaTuning::mma_warps).
void launch_gemm(Dtype dtype, Epi epi, bool use_mma, GemmParams p, int rows_m_total, int mma_warps,
                 cudaStream_t stream);
void gemm_init_attributes();
int gemm_bm(bool use_mma);
// int32 scratch a rows-M launch needs at p.mtile_start (tile starts and the tile -> expert map).
size_t gemm_tile_scratch_ints(int64_t N, int64_t E);

}  // namespace cuda
}  // namespace moeblaze
