// B2, B3 on Hopper (see wgrad_gemm.hpp). Tiles run in expert index order (a longest-first order
// was never faster).
//
// As a GEMM with M output rows, N output columns and K = the expert's routed rows:
//   B2: A[m][k=r] = dy[tok_r][m] (gathered, M = d), B[k=r][n] = gu[r][n] (contiguous, N = h)
//   B3, transposed: A[m][k=r] = x[tok_r][m] (gathered, M = d), B[k=r][n] = dadb[r][n]
//       (contiguous, N = 2h, h or the h columns of one wanted half); tile element (m, n) is
//       dw[n][m]: columns n < split go to out0 (dw_gate, or the one wanted gradient), n >= split
//       to out1 (dw_up) row n - split. (The direct form, x as the 256-column gathered side, moved
//       32 KB a stage through cp.async instead of 16 KB and ran at 412 TFLOP/s on conf3 instead
//       of 511.)
// Tile: 128 output rows x 256 output columns x 64 routed rows (k), 4 stages of 48 KB.
// 384 threads: warpgroup 0 produces (setmaxnreg 56: at 40 its 16-pass copy spilled, when it also
// gathered A), warpgroups 1 and 2 consume (setmaxnreg 224); consumer warpgroup w owns output rows
// [64w, 64w + 64) and issues 4 wgmma.m64n256k16 per stage with BOTH operands MN-major (transposed A
// and B, the MN-major descriptor of common.cuh: LBO 8192 between 64-wide boxes, SBO 1024 between
// 8-k-row groups, +2048 bytes per 16 k; A's 64 rows per warpgroup are one box, so its LBO is
// unused). Stage = A: 2 boxes {64 m, 64 k} + B: 4 boxes {64 n, 64 k}, each box 64 k-rows of 128
// bytes in the 128-byte swizzle (16-byte chunk c of k-row r at r * 128 + ((c ^ (r & 7)) << 4)). Per
// stage of 64 routed rows (row0 = off + 64 kt, valid = min(64, count - 64 kt)):
//   the gathered operand A (dy for B2, x for B3): each consumer warpgroup gathers its own box
//     (the 64 output rows it alone reads) 2 k-steps ahead, 16-byte cp.async with zero-fill (rows
//     >= valid, columns >= the operand's width) into the swizzle, completing on the warpgroup's
//     per-slot barrier (KRowGather below: the gather's rate is per issuing warp, and the
//     consumers' 8 warps outrun the producer's 4). The gather of k-step it + 2 is issued right
//     after k-step it's wgmmas are committed, into the slot of k-step it - 2, so it runs while the
//     tensor pipe works (2-5 % faster B3 than issuing it after wait<1>);
//   the contiguous operand B (gu for B2, dadb for B3), by the producer: a FULL stage (valid == 64)
//     is TMA boxes
//     {64 columns, 64 rows} of a 2-D map over [N rows, width] (one thread; boxes starting past
//     the width are neither issued nor expected); a PARTIAL stage (the expert's last, when
//     count % 64 != 0) is loaded by the same cp.async path with the identity row map,
//     zero-filling rows >= valid.
//   So rows of the NEXT expert are never read: a TMA box of a partial stage would read them, and
//   an Inf/NaN there would give 0 * Inf = NaN in this expert's gradient.
//   Full barrier: 129 arrivals per phase (128 cp.async.mbarrier.arrive.noinc, one per producer
//   thread, + thread 0's arrive.expect_tx(TMA bytes), or a plain arrive on a partial stage);
//   empty barrier: 8 arrivals (lane 0 of each consumer warp). Thread 0 issues fence.proxy.async
//   before a TMA refill of a stage whose previous fill was by cp.async (generic -> async proxy
//   write-after-write); consumers fence.proxy.async after every full wait (cp.async data is read
//   by wgmma through the async proxy).
// Schedule: tiles (e, m_tile, n_tile) for EVERY expert (an empty one still writes its zeros), in
// expert index order; CTA c takes positions c, c + G, c + 2G, ... (G CTAs). Within an expert the
// tiles run along the larger output dimension first, so a wave reads the larger operand once.
// Epilogue (each thread's accumulators hold rows g, g + 8 of its warp's 16 and column pairs
// 8j + 2 t4): each consumer warp stages its block through a 2 KB shared buffer 64 columns at a
// time (stmatrix; B3: .trans, the warpgroup's four buffers as one, so a row's 128 bytes are
// stored together) and writes whole 32-byte sectors with 16-byte stores. In the
// accumulate mode (the caller's accumulate_wgrad: out += the gradient) the stores go straight
// from the fragments instead: B2 4-byte read-modify-write pairs, B3 2-byte ones.
#include "cuda/engines/sm90/wgrad_gemm.hpp"

#include "common/status.hpp"
#include "cuda/cuda_util.cuh"
#include "cuda/engines/sm90/common.cuh"
#include "cuda/engines/sm90/device.hpp"

namespace moeblaze {
namespace cuda {
namespace {

using namespace sm90;

constexpr int kBM = kSm90WgradTileRows;
constexpr int kBN = kSm90WgradTileCols;
constexpr int kStages = 4;
// The consumers gather their A box this many k-steps ahead, issued between a k-step's wgmma
// commit and its wait<1>: the target slot (k-step it - 2) is then free, so the lead is kStages - 2.
constexpr int kGatherLead = kStages - 2;
constexpr int kThreads = 384;  // warpgroup 0: producer; 1, 2: consumers

constexpr int kBoxBytes = 64 * kBK * 2;              // 8 KB: 64 k-rows x 128 bytes
constexpr int kATileBytes = (kBM / 64) * kBoxBytes;  // 16 KB: 2 boxes
constexpr int kBTileBytes = (kBN / 64) * kBoxBytes;  // 32 KB: 4 boxes
constexpr int kStageBytes = kATileBytes + kBTileBytes;
constexpr int kPipeBytes = kStages * kStageBytes;  // 192 KB
constexpr int kBarrierBytes = 4 * kStages * 8;     // full, empty, a_full of each consumer warpgroup

// The epilogue stages the consumers' output through shared memory one 64-column chunk of a warp's
// 16 x 256 block at a time, 2 KB a warp: B2 a warp's 16 rows x 64 columns (128 bytes a row); B3
// a warpgroup's four buffers as one, 64 output rows (n) x the warpgroup's 64 m (128 bytes a row).
constexpr int kEpilogueWarpBytes = 64 * 32;

// The staging buffers follow the per-expert counts, 128-byte aligned.
constexpr size_t trans_stage_offset(int E) {
  return (size_t(kPipeBytes + kBarrierBytes) + sizeof(int) * size_t(E) + 127) / 128 * 128;
}
constexpr size_t smem_bytes(int E) {
  return 1024 /* alignment slack */ + trans_stage_offset(E) +
         size_t(8 /* consumer warps */) * kEpilogueWarpBytes;
}
constexpr size_t kMaxSmemBytes = smem_bytes(kMaxExperts);
static_assert(kMaxSmemBytes <= kSmemPerBlock,
              "227 KB of shared memory per block on the H100 / H200");

struct WgradParams {
  const void* gsrc;            // gathered operand rows [T, gld] (B2: dy; B3: x)
  const void* csrc;            // contiguous operand: routed row r at csrc + r * cld (gu; dadb)
  int gld, cld;                // elements between rows
  const int32_t* offsets;      // [E + 1]
  const int32_t* token_index;  // [N]
  void* out0;                  // [E, split, N]
  void* out1;                  // [E, M - split, N] (nullptr when split == M)
  int64_t out_stride0, out_stride1;  // elements per expert
  int64_t out_ld;  // B2: elements between output rows (h; N is the width of a column chunk)
  int split;       // output rows m < split -> out0, else out1 (row m - split); TRANS_OUT: columns n
  int M, N, E, m_tiles, n_tiles;
  int m_fast;  // tiles of one expert m-fastest (N > M) or n-fastest (see tile_origin)
  int accumulate;
};

#if MB_SM90_DEVICE

constexpr int kProducerThreads = 128;
constexpr int kConsumerWarps = 8;

// Tile `local` of an expert. The CTAs running at one time hold consecutive tiles of one expert
// and sweep k together; a wave covering all tiles along the fast dimension reads the operand of
// the slow dimension from DRAM once, the other once per wave. Fast = the larger dimension, so the
// larger operand is read once: n-fastest when N <= M, m-fastest otherwise (B2: M = d < N = h;
// B3: M = d < N = 2h).
__device__ __forceinline__ void tile_origin(const WgradParams& p, int local, int& m0, int& n0) {
  if (p.m_fast) {
    const int nt = local / p.m_tiles;
    m0 = (local - nt * p.m_tiles) * kBM;
    n0 = nt * kBN;
  } else {
    const int mt = local / p.n_tiles;
    m0 = mt * kBM;
    n0 = (local - mt * p.n_tiles) * kBN;
  }
}

// Copies 64 k-rows x (BOXES * 64) columns (rows row0.. of src) into BOXES swizzled boxes with the
// 128 producer threads: thread tid takes 16-byte chunk tid % (8 BOXES) of rows tid / (8 BOXES) +
// (128 / (8 BOXES)) i. Chunks of rows >= valid or columns >= width are zero-filled and their
// source is not read.
template <typename T, int BOXES>
__device__ __forceinline__ void load_rows(uint32_t dst, const T* src, int ld, int col0, int width,
                                          int valid, int row0, int tid) {
  constexpr int kChunksPerRow = BOXES * 8;
  constexpr int kRowsPerPass = kProducerThreads / kChunksPerRow;  // 8 or 4
  constexpr int kPasses = kBK / kRowsPerPass;                     // 8 or 16
  const int cr = tid % kChunksPerRow;
  const int rbase = tid / kChunksPerRow;
  const int col = col0 + 8 * cr;
  const bool col_ok = col < width;
  const uint32_t box_dst = dst + uint32_t(cr >> 3) * kBoxBytes;
  const int c = cr & 7;
  // Unrolled 4 x, not fully: fully unrolled, ptxas hoists the 8..16 per-pass addresses out of the
  // k-loop and spills them (the producer has 56 registers).
#pragma unroll 4
  for (int i = 0; i < kPasses; ++i) {
    const int r = rbase + kRowsPerPass * i;
    const bool ok = col_ok && r < valid;
    const T* ptr = ok ? src + size_t(row0 + r) * ld + col : src;
    cp_async16_zfill(box_dst + uint32_t(r) * 128u + uint32_t((c ^ (r & 7)) << 4), ptr, ok);
  }
}

// Four 8x8 b16 matrices from the accumulator fragment layout (lane 4 r + w holds row r, columns
// 2w, 2w + 1 of matrix i in r[i]) into shared memory TRANSPOSED: lane 8 i + r gives the address
// of the 16 bytes that receive column r of matrix i (its 8 rows, in order).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
      "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
      : "memory");
}

// The same four matrices NOT transposed: lane 8 i + r gives the address of the 16 bytes that
// receive row r of matrix i (its 8 columns, in order).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// The staging buffer of consumer warp `warp` (4..11) for the staged epilogues.
__device__ __forceinline__ uint32_t epilogue_stage(const uint8_t* smem, int E, int warp) {
  return smem_u32(smem) + uint32_t(trans_stage_offset(E)) + uint32_t(warp - 4) * kEpilogueWarpBytes;
}

// The staged epilogues' four matrices of stmatrix call q (0..3) of 64-column chunk c (0..3): matrix
// i is 8-column group jc = 8 c + 2 q + (i >> 1) of the warp's block, row half rr = i & 1, rounded
// by pack2 (zeros when the tile ran no k-step: `live` false).
template <typename T>
__device__ __forceinline__ void stmatrix_fragments(uint32_t (&frag)[4], const float (&acc)[128],
                                                   int c, int q, bool live) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int a = 4 * (8 * c + 2 * q + (i >> 1)) + 2 * (i & 1);
    frag[i] = pack2<T>(live ? acc[a] : 0.f, live ? acc[a + 1] : 0.f);
  }
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// The gathered operand A of one consumer warpgroup: box wg of each stage (64 k-rows, the expert's
// routed rows row0.., x the warpgroup's 64 output rows m0 + 64 wg..: columns of the gathered
// rows), loaded by the warpgroup itself kGatherLead k-steps ahead of its wgmmas into the slot
// whose wgmma completed before the previous k-step's wait<1> returned. The cursor walks the
// consumer's (tile, k-step) sequence: tiles blockIdx.x, + gridDim.x, ..., those of empty experts
// skipped (they run no k-step). Thread w of the warpgroup loads chunk w & 7 of k-rows (w >> 3) + 16
// i, i < 4; the token ids of the cursor's k-step are fetched one k-step ahead (right after the
// previous one is issued).
template <typename T>
class KRowGather {
 public:
  __device__ __forceinline__ KRowGather(const WgradParams& p, const int* cnt_s, int total_tiles,
                                        int wg)
      : p_(p), cnt_s_(cnt_s), total_tiles_(total_tiles), wg_(wg) {}

  __device__ __forceinline__ void start() {
    tile_ = int(blockIdx.x);
    kt_ = 0;
    row_bytes_ = uint32_t(p_.gld) * uint32_t(sizeof(T));
    const int w = int(threadIdx.x) & 127;
    const int chunk = w & 7, row = w >> 3;
    // Rows row + 16 i share row & 7, so their swizzled chunks are i * 2 KB apart.
    smem_off_ =
        uint32_t(wg_) * kBoxBytes + uint32_t(row) * 128u + uint32_t((chunk ^ (row & 7)) << 4);
    asm volatile("" : "+r"(smem_off_));  // kept, not recomputed from threadIdx (HalfTileGather)
    locate();
    fetch_ids();
  }

  // Issues the cursor's k-step into this warpgroup's box of the A tile at shared address a_tile,
  // completing on `bar`, and advances the cursor. Past the last k-step: nothing. The per-tile
  // column pointer and the per-thread shared offset are kept, not recomputed each k-step (B2's
  // SASS: ~130 of the consumers' ~230 instructions a k-step were this and fetch_ids).
  __device__ __forceinline__ void issue(uint32_t a_tile, uint32_t bar) {
    if (tile_ >= total_tiles_) return;
    const uint32_t dst = a_tile + smem_off_;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // Row 0 stands in for a zero-filled chunk (nothing is read).
      const bool ok = col_ok_ && ids_[i] >= 0;
      const uint32_t id = ok ? uint32_t(ids_[i]) : 0u;
      cp_async16_zfill(dst + uint32_t(i) * 2048u, gathered_row(col_src_, id, row_bytes_), ok);
    }
    cp_async_mbar_arrive_noinc(bar);
    if (++kt_ == k_tiles_) {
      kt_ = 0;
      tile_ += int(gridDim.x);
      locate();
    } else {
      ids_src_ += kBK;
      rem_ -= kBK;
    }
    fetch_ids();
  }

 private:
  // The expert, column pointer and k-steps of tile_, moved forward past tiles of empty experts.
  __device__ __forceinline__ void locate() {
    const int tiles_per_expert = p_.m_tiles * p_.n_tiles;
    for (; tile_ < total_tiles_; tile_ += int(gridDim.x)) {
      const int e = tile_ / tiles_per_expert;
      const int count = cnt_s_[e];
      if (count == 0) continue;
      int m0, n0;
      tile_origin(p_, tile_ - e * tiles_per_expert, m0, n0);
      const int w = int(threadIdx.x) & 127;
      const int col = m0 + 64 * wg_ + 8 * (w & 7);
      col_ok_ = col < p_.M;
      col_src_ = reinterpret_cast<const char*>(static_cast<const T*>(p_.gsrc) + col);
      const int row = w >> 3;
      ids_src_ = p_.token_index + __ldg(p_.offsets + e) + row;
      rem_ = count - row;
      k_tiles_ = (count + kBK - 1) / kBK;
      return;
    }
  }

  // The token ids of the cursor's k-step: rows row + 16 i of it, -1 past the expert's rows
  // (rem_ = rows of the expert left from this thread's first row on).
  __device__ __forceinline__ void fetch_ids() {
    if (tile_ >= total_tiles_) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) ids_[i] = 16 * i < rem_ ? __ldg(ids_src_ + 16 * i) : -1;
  }

  static_assert(sizeof(T) == 2, "row_bytes_ < 2^32 needs gld < 2^31 and 2-byte elements");
  const WgradParams& p_;
  const int* cnt_s_;
  int total_tiles_, wg_;
  int tile_ = 0, kt_ = 0, k_tiles_ = 0;
  uint32_t smem_off_ = 0;
  bool col_ok_ = false;
  const char* col_src_ = nullptr;  // the thread's column of row 0, in bytes
  uint32_t row_bytes_ = 0;         // bytes between gathered rows
  const int32_t* ids_src_ = nullptr;
  int rem_ = 0;
  int ids_[4] = {-1, -1, -1, -1};
};

#endif  // MB_SM90_DEVICE

// A is the gathered operand (rows by cp.async), B the contiguous one (rows by TMA). B2: A = dy,
// B = gu. TRANS_OUT: B3 as the transposed product, A = x (M = d), B = dadb (N = 2h or h), tile
// element (m, n) stored as dw[n][m].
template <typename T, bool TRANS_OUT>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_wgrad_kernel(const __grid_constant__ CUtensorMap cmap, const WgradParams p) {
#if MB_SM90_DEVICE
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + kPipeBytes);
  uint64_t* empty_bar = full_bar + kStages;
  uint64_t* a_full_bar = empty_bar + kStages;  // [2][kStages]: consumer warpgroup wg's A box
  int* cnt_s = reinterpret_cast<int*>(a_full_bar + 2 * kStages);  // [E] rows per expert

  const int tid = threadIdx.x;
  // Broadcast from lane 0: the compiler then knows the warp index is warp-uniform (uniform
  // registers for the barrier and descriptor addresses derived from it).
  const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0), lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      // B: 128 cp.async arrivals (a partial stage's rows; empty otherwise) + thread 0's expect_tx.
      mbar_init(smem_u32(full_bar + s), kProducerThreads + 1);
      mbar_init(smem_u32(empty_bar + s), kConsumerWarps);
      mbar_init(smem_u32(a_full_bar + s), 128);  // A: one cp.async arrival per consumer thread
      mbar_init(smem_u32(a_full_bar + kStages + s), 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  for (int e = tid; e < p.E; e += kThreads)
    cnt_s[e] = __ldg(p.offsets + e + 1) - __ldg(p.offsets + e);
  __syncthreads();

  const int tiles_per_expert = p.m_tiles * p.n_tiles;
  const int total_tiles = p.E * tiles_per_expert;
  const int G = int(gridDim.x), cta = int(blockIdx.x);
  constexpr int kCBoxes = kBN / 64;  // boxes of the contiguous operand (B)

  if (warp < 4) {
    // ================= producer warpgroup =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    const T* csrc = static_cast<const T*>(p.csrc);
    uint32_t it = 0;
    uint32_t cp_filled = 0;  // thread 0: stages whose last contiguous-operand fill was cp.async
    const int c_width = p.N;
    for (int t = cta; t < total_tiles; t += G) {
      const int e = t / tiles_per_expert;
      int m0, n0;
      tile_origin(p, t - e * tiles_per_expert, m0, n0);
      const int c_col0 = n0;
      const int off = __ldg(p.offsets + e);
      const int count = cnt_s[e];
      const int k_tiles = (count + kBK - 1) / kBK;
      const int c_boxes = min(kCBoxes, (c_width - c_col0 + 63) / 64);
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        const int row0 = off + kt * kBK;
        const int valid = min(kBK, count - kt * kBK);
        mbar_wait(smem_u32(empty_bar + s), ((it / kStages) & 1) ^ 1);
        const uint32_t full = smem_u32(full_bar + s);
        const uint32_t c_dst = smem_u32(smem + s * kStageBytes) + kATileBytes;
        if (valid == kBK) {
          if (tid == 0) {
            if ((cp_filled >> s) & 1u) fence_proxy_async();  // generic writes before TMA's
            cp_filled &= ~(1u << s);
            mbar_arrive_expect_tx(full, uint32_t(c_boxes) * kBoxBytes);
            for (int b = 0; b < c_boxes; ++b)
              tma_load_2d(c_dst + uint32_t(b) * kBoxBytes, &cmap, full, c_col0 + 64 * b, row0);
          }
        } else {
          // The expert's last, partial stage: a TMA box would read the next expert's rows.
          if (tid == 0) {
            mbar_arrive(full);
            cp_filled |= 1u << s;
          }
          load_rows<T, kCBoxes>(c_dst, csrc, p.cld, c_col0, c_width, valid, row0, tid);
        }
        cp_async_mbar_arrive_noinc(full);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  } else {
    // ================= consumer warpgroups =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
    const int wg = (warp >> 2) - 1;   // output rows [64 wg, 64 wg + 64) of the tile
    const int warp_in_wg = warp & 3;  // rows [16 warp_in_wg, +16) of those
    const int g = lane >> 2, t4 = lane & 3;
    float acc[128];
#pragma unroll
    for (int q = 0; q < 128; ++q) acc[q] = 0.f;
    uint64_t* my_a_full = a_full_bar + wg * kStages;
    KRowGather<T> gather(p, cnt_s, total_tiles, wg);
    gather.start();
    for (int s = 0; s < kGatherLead; ++s)
      gather.issue(smem_u32(smem + s * kStageBytes), smem_u32(my_a_full + s));
    const StageDesc desc_a0(smem_desc_mnmajor_sw128(smem_u32(smem) + uint32_t(wg) * kBoxBytes));
    const StageDesc desc_b0(smem_desc_mnmajor_sw128(smem_u32(smem) + kATileBytes));
    uint32_t it = 0;
    for (int t = cta; t < total_tiles; t += G) {
      const int e = t / tiles_per_expert;
      int m0, n0;
      tile_origin(p, t - e * tiles_per_expert, m0, n0);
      const int count = cnt_s[e];
      const int k_tiles = (count + kBK - 1) / kBK;
      int prev_s = 0;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(smem_u32(full_bar + s), (it / kStages) & 1);
        mbar_wait(smem_u32(my_a_full + s), (it / kStages) & 1);
        fence_proxy_async();  // cp.async (generic proxy) data is read by wgmma (async proxy)
        const uint32_t stage_offset = uint32_t(s) * kStageBytes;
        wgmma_kstep<T, 1, 1>(acc, desc_a0.at(stage_offset), desc_b0.at(stage_offset), kt > 0);
        // While wgmma(it - 1) and wgmma(it) run: this warpgroup's A of k-step it + kGatherLead
        // into the slot of k-step it - 2, whose wgmma completed before the previous k-step's
        // wait<1> returned (after the wait it would run with the pipe draining).
        const int refill = int((it + kGatherLead) % kStages);
        gather.issue(smem_u32(smem + refill * kStageBytes), smem_u32(my_a_full + refill));
        wgmma_wait<1>();
        fence_accumulators(acc);
        if (kt > 0 && lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));
        prev_s = s;
      }
      // Unconditional (nothing may be pending): a wait under a branch makes ptxas insert its own
      // in a divergent path and serialise the wgmmas (C7518).
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (k_tiles > 0 && lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));
      // An empty expert's tile ran no wgmma: its accumulators hold the previous tile's values.
      const bool live = k_tiles > 0;

      // ---- epilogue: register 4j + q of lane (g, t4) holds row g (q < 2) or g + 8 (q >= 2),
      // column 8j + 2 t4 + (q & 1) of the warp's 16 x 256 block.
      if (p.accumulate && count == 0) continue;  // empty expert: leave out untouched
      const int tile_row = wg * 64 + warp_in_wg * 16 + g;
      if constexpr (TRANS_OUT) {
        if (!p.accumulate) {
          // Element (m, n) is output row n, column m: a warp holds 16 m (32 bytes) of each row, its
          // warpgroup's four warps 64 m (128 bytes). Per 64-column chunk: the four warps put their
          // rounded fragments with stmatrix.trans into the warpgroup's 8 KB staging buffer as 64
          // rows n of 128 bytes (warp w's 8-m half h at 16-byte chunk 2 w + h, swizzled by n & 7),
          // then each warp writes 16 of those rows, 4 rows of 128 contiguous bytes a store, where
          // from its own 32-byte pieces a store touched 16 rows (2-byte stores from the fragments
          // made this epilogue a quarter of B3 on mixtral). The rounding is pack2's
          // round-to-nearest of the fp32 accumulator, as below: the same bits.
          const uint32_t stage = epilogue_stage(smem, p.E, 4 + 4 * wg);  // its warps' 4 buffers
          const int m_lane = m0 + wg * 64 + 8 * (lane & 7);
          const bool m_ok = m_lane < p.M;  // M % 8 == 0: 8 m are all in or all out
          // The lane's output row n = n_lane + 64 c + 4 pass is at one of two bases plus n rows: a
          // running offset, where forming each store's address from the expert, row and column
          // took ~37 instructions (SASS). base1 is only used for n >= split.
          const int n_lane = n0 + 16 * warp_in_wg + (lane >> 3);
          const uint64_t row_bytes = uint64_t(p.M) * sizeof(T);
          const uint64_t base0 =
              reinterpret_cast<uint64_t>(p.out0) +
              (uint64_t(e) * uint64_t(p.out_stride0) + uint64_t(m_lane)) * sizeof(T);
          const uint64_t base1 =
              reinterpret_cast<uint64_t>(p.out1) +
              (uint64_t(e) * uint64_t(p.out_stride1) + uint64_t(m_lane)) * sizeof(T) -
              uint64_t(p.split) * row_bytes;
          uint64_t row_offset = uint64_t(n_lane) * row_bytes;
#pragma unroll
          for (int c = 0; c < 4; ++c) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              uint32_t frag[4];
              stmatrix_fragments<T>(frag, acc, c, q, live);
              const int i = lane >> 3;
              const int n_row = 8 * (2 * q + (i >> 1)) + (lane & 7);  // row of the chunk
              stmatrix_x4_trans(
                  stage + 4u * uint32_t(stage_chunk_word(n_row, 2 * warp_in_wg + (i & 1))), frag);
            }
            warpgroup_sync(wg);  // the four warps' pieces of every row are in the buffer
#pragma unroll
            for (int pass = 0; pass < 4; ++pass) {
              const int n_row = 16 * warp_in_wg + (lane >> 3) + 4 * pass;
              const uint4 v =
                  ld_shared_v4(stage + 4u * uint32_t(stage_chunk_word(n_row, lane & 7)));
              const int n = n_lane + 64 * c + 4 * pass;
              store16_if(m_ok && n < p.N,
                         reinterpret_cast<void*>((n < p.split ? base0 : base1) + row_offset), v);
              row_offset += 4 * row_bytes;
            }
            row_offset += 48 * row_bytes;  // the chunk's 64 rows
            warpgroup_sync(wg);            // the next chunk overwrites the buffer
          }
          continue;
        }
        // Accumulate: 2-byte read-modify-write stores, a warp instruction covers 8 consecutive m
        // of 4 output rows; the fp32 add and one rounding, as B2's path below.
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int m = m0 + tile_row + 8 * rr;
          if (m >= p.M) continue;
#pragma unroll
          for (int q = 0; q < 4 * 32; q += 2) {
            const int jc = q >> 2, half = (q >> 1) & 1;  // q: 4 jc + 2 half, half = column parity
            const int n = n0 + 8 * jc + 2 * t4 + half;
            if (n >= p.N) continue;
            T* o = n < p.split
                       ? static_cast<T*>(p.out0) + size_t(e) * p.out_stride0 + size_t(n) * p.M + m
                       : static_cast<T*>(p.out1) + size_t(e) * p.out_stride1 +
                             size_t(n - p.split) * p.M + m;
            *o = from_f32<T>((live ? acc[4 * jc + 2 * rr + half] : 0.f) + to_f32<T>(*o));
          }
        }
      } else if (!p.accumulate) {
        // B2: element (m, n) is output row m, column n. Per 64-column chunk of the warp's
        // 16 x 256 block: stmatrix puts the rounded fragments into the warp's staging buffer as
        // 16 rows of 128 bytes (16-byte chunk ch of row r at chunk ch ^ (r & 7), so the 8 rows
        // of one matrix, and the 8 chunks one load reads of a row, fall in distinct banks), then
        // each warp store writes 4 rows x 128 contiguous bytes with 16-byte stores (4-byte pair
        // stores from the fragments cost B2 7.5 % on mixtral). Same pack2 rounding: same bits.
        const uint32_t stage = epilogue_stage(smem, p.E, warp);
        const int warp_row0 = m0 + wg * 64 + warp_in_wg * 16;
        // The lane's four output rows m = warp_row0 + (lane >> 3) + 4 pass, addressed once a
        // tile at column n0 + 8 (lane & 7) (chunk c adds 64 columns), where forming each store's
        // address from the expert, row and column took ~37 instructions (SASS).
        const int n_lane = n0 + 8 * (lane & 7);
        uint64_t row_address[4];
        bool row_ok[4];
#pragma unroll
        for (int pass = 0; pass < 4; ++pass) {
          const int m = warp_row0 + (lane >> 3) + 4 * pass;
          row_ok[pass] = m < p.M;
          // Integer arithmetic: out1 may be null (split == M), and a row past M is never stored.
          row_address[pass] =
              m < p.split ? reinterpret_cast<uint64_t>(p.out0) +
                                (uint64_t(e) * uint64_t(p.out_stride0) +
                                 uint64_t(m) * uint64_t(p.out_ld) + uint64_t(n_lane)) *
                                    sizeof(T)
                          : reinterpret_cast<uint64_t>(p.out1) +
                                (uint64_t(e) * uint64_t(p.out_stride1) +
                                 uint64_t(m - p.split) * uint64_t(p.out_ld) + uint64_t(n_lane)) *
                                    sizeof(T);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            uint32_t frag[4];
            stmatrix_fragments<T>(frag, acc, c, q, live);
            const int i = lane >> 3, r = 8 * (i & 1) + (lane & 7);
            stmatrix_x4(stage + 4u * uint32_t(stage_chunk_word(r, 2 * q + (i >> 1))), frag);
          }
          __syncwarp();
          const int n = n0 + 64 * c + 8 * (lane & 7);
#pragma unroll
          for (int pass = 0; pass < 4; ++pass) {
            const int r = (lane >> 3) + 4 * pass;  // row of the warp's 16
            const uint4 v = ld_shared_v4(stage + 4u * uint32_t(stage_chunk_word(r, lane & 7)));
            // N % 8 == 0: a 16-byte chunk is all in or all out.
            store16_if(row_ok[pass] && n < p.N,
                       reinterpret_cast<void*>(row_address[pass] + 64 * c * sizeof(T)), v);
          }
          __syncwarp();  // the next chunk overwrites the buffer
        }
      } else {
        // B2, accumulate: 4-byte read-modify-write pair stores from the fragments (the old pairs
        // loaded 8 at a time first), the fp32 add and one rounding.
#pragma unroll  // rr indexes the accumulators: a runtime index would move them to local memory
        for (int rr = 0; rr < 2; ++rr) {
          const int m = m0 + tile_row + 8 * rr;
          if (m >= p.M) continue;
          T* orow = m < p.split
                        ? static_cast<T*>(p.out0) + size_t(e) * p.out_stride0 + size_t(m) * p.out_ld
                        : static_cast<T*>(p.out1) + size_t(e) * p.out_stride1 +
                              size_t(m - p.split) * p.out_ld;
          orow += n0 + 2 * t4;
#pragma unroll
          for (int j0 = 0; j0 < 32; j0 += 8) {
            uint32_t old[8];
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
              const bool ok = n0 + 8 * (j0 + jj) < p.N;  // N % 8 == 0: a pair is all in or out
              old[jj] = ok ? *reinterpret_cast<const uint32_t*>(orow + 8 * (j0 + jj)) : 0u;
            }
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
              const int jc = j0 + jj;
              if (n0 + 8 * jc < p.N) {
                const float2 o = unpack2<T>(old[jj]);
                *reinterpret_cast<uint32_t*>(orow + 8 * jc) =
                    pack2<T>(o.x + (live ? acc[4 * jc + 2 * rr] : 0.f),
                             o.y + (live ? acc[4 * jc + 2 * rr + 1] : 0.f));
              }
            }
          }
        }
      }  // TRANS_OUT
    }
  }
#else
  __trap();  // no sm_90a image: sm90_wgrad_supported never lets this run
#endif  // MB_SM90_DEVICE
}

// ---- host -----------------------------------------------------------------------------------

using KernelFn = void (*)(const CUtensorMap, const WgradParams);

// The two forms: B2, and B3 as the transposed product (see sm90_b3_launch).
enum class WgradForm { B2, B3 };

KernelFn kernel_for(Dtype dtype, WgradForm form) {
  if (dtype == Dtype::BF16) {
    return form == WgradForm::B2 ? sm90_wgrad_kernel<__nv_bfloat16, false>
                                 : sm90_wgrad_kernel<__nv_bfloat16, true>;
  }
  return form == WgradForm::B2 ? sm90_wgrad_kernel<__half, false> : sm90_wgrad_kernel<__half, true>;
}

// The contiguous operand: `rows` routed rows of `width` columns, `ld` elements apart, as a 2-D map
// with box {64 columns, 64 rows}; columns >= width and rows >= rows read as zeros.
CUtensorMap contiguous_map(Dtype dtype, const void* base, int64_t width, int64_t rows, int64_t ld,
                           const char* what) {
  if (dtype == Dtype::BF16)
    return make_map_2d<__nv_bfloat16>(base, uint64_t(width), uint64_t(rows), uint64_t(ld), 64,
                                      uint32_t(kBK), what);
  return make_map_2d<__half>(base, uint64_t(width), uint64_t(rows), uint64_t(ld), 64, uint32_t(kBK),
                             what);
}

// Zeros for every expert's output (no routed rows at all: every expert is empty). The kernel's
// empty-expert path would write the same +0 bits, but needs a tensor map over >= 1 row.
void write_zeros(void* out, int64_t elements, size_t elem_size, cudaStream_t stream,
                 const char* what) {
  if (out == nullptr || elements == 0) return;
  check(cudaMemsetAsync(out, 0, size_t(elements) * elem_size, stream), what);
}

void launch(const LayerDesc& desc, WgradForm form, const CUtensorMap& map, WgradParams p,
            cudaStream_t stream, const char* what) {
  const Sm90Device& info = sm90_current_device();
  MB_REQUIRE(info.usable, MOEBLAZE_ERR_CUDA, "sm90 %s launched on an unsupported device", what);
  p.E = int(desc.E);
  p.m_tiles = (p.M + kBM - 1) / kBM;
  p.n_tiles = (p.N + kBN - 1) / kBN;
  p.m_fast = p.N > p.M ? 1 : 0;
  // Persistent: one CTA per SM (the shared memory allows no more), fewer when there are fewer
  // tiles; every expert's tiles are scheduled, empty or not.
  const int64_t total_tiles = int64_t(p.E) * p.m_tiles * p.n_tiles;
  const int grid = int(total_tiles < info.sms ? total_tiles : info.sms);
  kernel_for(desc.dtype, form)<<<grid, kThreads, smem_bytes(p.E), stream>>>(map, p);
  check_launch(what);
}

}  // namespace

size_t sm90_wgrad_max_smem_bytes() {
  return kMaxSmemBytes;
}

bool sm90_wgrad_prepare_kernels() {
  for (Dtype dtype : {Dtype::BF16, Dtype::F16}) {
    for (WgradForm form : {WgradForm::B2, WgradForm::B3}) {
      if (!prepare_kernel(kernel_for(dtype, form), kMaxSmemBytes)) return false;
    }
  }
  return true;
}

bool sm90_wgrad_supported(const LayerDesc& desc, int64_t T,
                          std::initializer_list<const void*> tensors) {
  if (desc.dtype != Dtype::BF16 && desc.dtype != Dtype::F16) return false;
  if (desc.d <= 0 || desc.h <= 0 || desc.d % 8 != 0 || desc.h % 8 != 0) return false;
  if (desc.E < 1 || desc.E > kMaxExperts || desc.k < 1 || T < 0) return false;
  constexpr int64_t kIntMax = 0x7fffffff;
  if (T > kIntMax || desc.k > kIntMax) return false;
  const int64_t N = T * desc.k;
  const int64_t widest = desc.d > 2 * desc.h ? desc.d : 2 * desc.h;
  // Tile ids (plus the grid stride past the last one) stay inside int.
  const int64_t max_tiles = desc.E * ((widest + kBM - 1) / kBM) * ((widest + kBN - 1) / kBN);
  if (widest > kIntMax || N > kIntMax || max_tiles > kIntMax / 2) return false;
  for (const void* ptr : tensors)
    if (ptr != nullptr && !aligned16(ptr)) return false;
  return sm90_current_device().usable;
}

void sm90_b2_launch(const LayerDesc& desc, const B2Op& op, cudaStream_t stream) {
  void* const dw_down = op.dw_down;
  if (dw_down == nullptr) return;
  const int64_t N = op.rows.T * desc.k;
  const int64_t col0 = op.col0, cols = op.cols != 0 ? op.cols : desc.h;
  const bool accumulate = op.accumulate;
  const void* const gu = op.gu;
  MB_REQUIRE(col0 >= 0 && cols > 0 && col0 + cols <= desc.h && (col0 % 8) == 0 && (cols % 8) == 0,
             MOEBLAZE_ERR_INTERNAL, "sm90 B2: bad column range [%lld, +%lld) of h = %lld",
             static_cast<long long>(col0), static_cast<long long>(cols),
             static_cast<long long>(desc.h));
  if (N == 0) {
    MB_REQUIRE(cols == desc.h || accumulate, MOEBLAZE_ERR_INTERNAL,
               "sm90 B2: no routed rows under a column range");
    if (!accumulate)
      write_zeros(dw_down, desc.E * desc.d * desc.h, desc.elem_size(), stream, "sm90 B2 zeros");
    return;
  }
  WgradParams p = {};
  p.gsrc = op.dy;
  p.gld = int(desc.d);
  p.csrc = gu;
  p.cld = int(cols);
  p.offsets = op.rows.expert_offsets;
  p.token_index = op.rows.expert_token_indices;
  p.out0 = static_cast<unsigned char*>(dw_down) + size_t(col0) * desc.elem_size();
  p.out_stride0 = desc.d * desc.h;
  p.out_ld = desc.h;
  p.M = int(desc.d);
  p.N = int(cols);
  p.split = p.M;
  p.accumulate = accumulate ? 1 : 0;
  const CUtensorMap map = contiguous_map(desc.dtype, gu, cols, N, cols, "B2");
  launch(desc, WgradForm::B2, map, p, stream, "sm90_wgrad_kernel (B2)");
}

void sm90_b3_launch(const LayerDesc& desc, const B3Op& op, cudaStream_t stream) {
  const bool gated = desc.gated();
  void* const dw_gate = op.dw_gate;
  void* const dw_up = gated ? op.dw_up : nullptr;
  if (dw_gate == nullptr && dw_up == nullptr) return;
  const bool accumulate = op.accumulate;
  const void* const dadb = op.dadb;
  const int64_t N = op.rows.T * desc.k;
  const int64_t h = desc.h;
  if (N == 0) {
    if (!accumulate) {
      write_zeros(dw_gate, desc.E * h * desc.d, desc.elem_size(), stream, "sm90 B3 zeros");
      write_zeros(dw_up, desc.E * h * desc.d, desc.elem_size(), stream, "sm90 B3 zeros");
    }
    return;
  }
  const int64_t dadb_ld = gated ? 2 * h : h;
  // dadb's columns are [da | db]: read only the wanted halves. dw_up alone: start at db (h % 8 ==
  // 0 keeps the base 16-byte aligned); one half: M = h, so the map zero-fills past it.
  const bool both = dw_gate != nullptr && dw_up != nullptr;
  const void* a_base =
      dw_gate != nullptr
          ? dadb
          : static_cast<const void*>(static_cast<const char*>(dadb) + size_t(h) * desc.elem_size());
  const int dadb_width = int(both ? 2 * h : h);
  WgradParams p = {};
  p.gsrc = op.x;
  p.gld = int(desc.d);
  p.csrc = a_base;
  p.cld = int(dadb_ld);
  p.offsets = op.rows.expert_offsets;
  p.token_index = op.rows.expert_token_indices;
  p.out0 = dw_gate != nullptr ? dw_gate : dw_up;
  p.out1 = both ? dw_up : nullptr;
  p.out_stride0 = h * desc.d;
  p.out_stride1 = h * desc.d;
  p.split = int(h);
  p.accumulate = accumulate ? 1 : 0;
  // dw^T [d, 2h] = x^T . dadb, in B2's orientation: the gathered x is the 128-row side (16 KB a
  // stage through cp.async) and dadb the 256-column TMA side. The direct form (dw = dadb^T . x,
  // x on the 256-column side: 32 KB a stage gathered) ran at 412 TFLOP/s on conf3, this one at 511
  // (H200, docs/performance.md).
  p.M = int(desc.d);
  p.N = dadb_width;
  const CUtensorMap map = contiguous_map(desc.dtype, a_base, dadb_width, N, dadb_ld, "B3");
  launch(desc, WgradForm::B3, map, p, stream, "sm90_wgrad_kernel (B3)");
}

}  // namespace cuda
}  // namespace moeblaze
