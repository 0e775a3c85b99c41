// F2, B4 and B1 for Hopper: the "rows" grouped GEMMs whose M is an expert's routed rows, on one
// persistent, warp-specialised TMA + wgmma kernel, for BF16 and F16, every activation and every
// checkpoint policy.
//
// For expert e and routed rows r in [expert_offsets[e], expert_offsets[e+1]):
//   F2: y2[r]  = g_r * (u[r] . w_down[e]^T)             u [N, h] -> rows [N, d]
//   B4: dxr[r] = da[r] . w_gate[e] + db[r] . w_up[e]      da|db [N, 2h] (gated; [N, h] otherwise)
//                                                       -> rows [N, d]
//       (rows in the storage dtype, each element rounded once from the fp32 accumulator)
//   B1: v[r]   = dy[tok_r] . w_down[e]                   dy [T, d] gathered by expert_token_indices
//       and, in the epilogue, the activation backward of gemm.cuh's B1 (act_math, the same
//       formulas): u from the saved u or recomputed from the rounded a, b; dg partial sums of
//       v * u, two per 256-column tile (part 0 over the 64-column groups the consumers run in a
//       split form, else the first group; part 1 over the rest); du = g * v; da, db; g * u.
// fp32 accumulation; the k order within a tile is fixed and every output element belongs to one
// tile of one CTA, so every result is bitwise repeatable (no atomics). The accumulation order
// differs from the mma.sync engine's (k-steps of 16 inside 64-wide stages), so results can differ
// from that engine in the last bit. Rows past expert_offsets[E] (dropped pairs) are not written.
// No host sync, no allocation: the tile schedule is built by every CTA from the device-side
// offsets; the tensor maps are kernel parameters encoded on the host per call (graph-capturable).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "common/layer_desc.hpp"
#include "cuda/sm90/device.hpp"

namespace moeblaze {
namespace cuda {

// Output columns of one B1 tile, and the dg partials B1 writes per row and tile (its first 64
// columns, then the rest): B1's dg partial buffer holds ceil(h / kSm90B1TileCols) *
// kSm90B1DgPartsPerTile partials per row, tile-major.
constexpr int kSm90B1TileCols = 256;
constexpr int kSm90B1DgPartsPerTile = 2;

// The largest dynamic shared memory a launch asks for, for the device check.
size_t sm90_rows_max_smem_bytes();

// See sm90_f1_prepare_kernels (f1_gemm.hpp).
bool sm90_rows_prepare_kernels();

// True when the F2 / B4 / B1 kernels can run this layer on the current device: the sm90 kernels
// are usable (device.hpp), dtype BF16 or F16, d % 8 == 0, h % 8 == 0,
// 1 <= E <= 1024, every count inside int range and every non-null pointer in `tensors` 16-byte
// aligned (TMA and 16-byte cp.async need it).
bool sm90_rows_supported(const LayerDesc& desc, int64_t T,
                         std::initializer_list<const void*> tensors);

// Where F2 / B4 put routed row r of their column range, in the storage dtype: row r of `rows`
// ([N, ld]), or with by_pair (k = 1) row pair[r] of it ([T, ld]: the token's output itself; rows
// then points at the range's first column). Each element is row_value(w, v) (cuda_util.cuh),
// w = weights[pair[r]] (F2's g) or 1 (weights null). rows must be in the sm90_rows_supported
// check's tensors; pair is needed when weights or by_pair are set.
struct Sm90RowsOut {
  void* rows = nullptr;
  int64_t ld = 0;                  // elements between rows; 0 = the range's width
  const int32_t* pair = nullptr;   // [N] routed row -> (token, slot) pair index
  const float* weights = nullptr;  // [T*k]
  bool by_pair = false;
};

// The output columns [col0, col0 + cols) of d that one F2 / B4 launch computes (cols = 0: all of
// d). col0 must be a multiple of kSm90B1TileCols, so each tile is one of the full launch's tiles
// and gives the same bits.
struct Sm90Columns {
  int64_t col0 = 0, cols = 0;
};

// F2 (N = T*k routed rows). Precondition: sm90_rows_supported.
void sm90_f2_launch(const LayerDesc& desc, int64_t T, const void* u, const int32_t* expert_offsets,
                    const void* w_down, const Sm90Columns& range, const Sm90RowsOut& out,
                    const Sm90Forms& forms, cudaStream_t stream);

// B4: dadb [N, 2h] (da at [0, h), db at [h, 2h)) or [N, h] for non-gated activations. w_up is
// ignored for non-gated activations.
void sm90_b4_launch(const LayerDesc& desc, int64_t T, const void* dadb,
                    const int32_t* expert_offsets, const void* w_gate, const void* w_up,
                    const Sm90Columns& range, const Sm90RowsOut& out, const Sm90Forms& forms,
                    cudaStream_t stream);

// B1's epilogue operands (as gemm.cuh's EpilogueArgs for Epi::B1).
// B1 covers columns [col0, col0 + cols) of h (cols = 0: all of h). The activation pointers below
// point at column col0 of their buffers (the caller offsets them); w_down is offset here. gu is
// the range's own [N, cols] buffer; dg_part points at the partials of the range's first n-tile
// (col0 / kSm90B1TileCols), so col0 must be a multiple of kSm90B1TileCols.
// MOEBLAZE_CUDA_B1_FORM (sm90_set_b1_form) may force one of the kernel's four epilogue forms.
struct Sm90B1Epilogue {
  const void* a_src = nullptr;  // [N, ab_ld] saved or recomputed a (may alias dadb: RECOMPUTE)
  const void* b_src = nullptr;  // [N, ab_ld] b (gated only; may alias dadb)
  int64_t ab_ld = 0;            // elements between rows of a_src / b_src (0 = h)
  const void* u_src = nullptr;  // [N, u_ld] saved u (SAVE_ALL) or nullptr (recomputed from a, b)
  int64_t u_ld = 0;             // 0 = h
  const float* g = nullptr;     // [T*k] routing weights, read at row_pair[r]
  const int32_t* row_pair = nullptr;  // [N] routed row -> (token, slot) pair index
  void* dadb = nullptr;               // [N, dadb_ld]: da at column n, db at column h + n
  int64_t dadb_ld = 0;                // 0 = 2h (gated) or h
  void* gu = nullptr;                 // [N, cols] g * u
  float* dg_part = nullptr;  // [ceil(cols / kSm90B1TileCols) * kSm90B1DgPartsPerTile, N] partials
  int64_t col0 = 0, cols = 0;
};

// B1's epilogue form (Sm90Forms::b1_form; rows_gemm.cu, B1Form): -1 = the policy by k-steps a
// tile; 0, 1, 2, 3 force the consumers', the epilogue warps', the split or the two-group split
// form. Parses MOEBLAZE_CUDA_B1_FORM's value ("consumers", "warps", "split", "split2"; nullptr or
// anything else: -1, the policy).
int sm90_parse_b1_form(const char* value);

// B1 on `stream`: dy [T, d]; w_down [E, d, h]. Precondition: sm90_rows_supported.
void sm90_b1_launch(const LayerDesc& desc, int64_t T, const void* dy, const int32_t* expert_offsets,
                    const int32_t* expert_token_indices, const void* w_down,
                    const Sm90B1Epilogue& epilogue, const Sm90Forms& forms, cudaStream_t stream);

}  // namespace cuda
}  // namespace moeblaze
