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
#include "cuda/engines/gemm_ops.hpp"
#include "cuda/engines/sm90/device.hpp"

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
bool sm90_rows_prepare_kernels(int* max_2cta_clusters);

// True when the F2 / B4 / B1 kernels can run this layer on the current device: the sm90 kernels
// are usable (device.hpp), dtype BF16 or F16, d % 8 == 0, h % 8 == 0,
// 1 <= E <= 1024, every count inside int range and every non-null pointer in `tensors` 16-byte
// aligned (TMA and 16-byte cp.async need it).
bool sm90_rows_supported(const LayerDesc& desc, int64_t T,
                         std::initializer_list<const void*> tensors);

// F2 and B4 (gemm_ops.hpp). Precondition: sm90_rows_supported over the op's tensors.
void sm90_f2_launch(const LayerDesc& desc, const F2Op& op, const Sm90Forms& forms,
                    cudaStream_t stream);
void sm90_b4_launch(const LayerDesc& desc, const B4Op& op, const Sm90Forms& forms,
                    cudaStream_t stream);

// F2's and B4's form (Sm90Forms::rows_form): -1 = the epilogue warps' (B4's policy), 0 the
// consumers' (they store their rows after each main loop), 1 the epilogue warps' (the consumers
// hand the rounded rows to warps 1-3 of the producer warpgroup and go on; 3 stages instead of 4),
// 2 and 3 the ping-pong kernel (rows_pingpong_gemm.cu: each consumer warpgroup a whole tile of 192
// or 128 columns, one's store under the other's main loop), 4 the same kernel with 192 columns in
// 2-CTA clusters that share B by multicast (F2's form for h <= kSm90F2PingpongMaxH, below). Every
// form gives the same bits (the CUDA suite checks it). Parses MOEBLAZE_CUDA_ROWS_FORM's value
// ("consumers", "warps", "pingpong", "pingpong128", "pingpong2cta"; nullptr or anything else: -1).
int sm90_parse_rows_form(const char* value);
constexpr int kSm90RowsFormPingpong192 = 2;
constexpr int kSm90RowsFormPingpong128 = 3;
constexpr int kSm90RowsFormPingpong2Cta = 4;

// F2's form as its launch takes it (Sm90Forms::rows_form): the forced one; else, for F2's short
// main loops (h <= kSm90F2PingpongMaxH: at most 16 k-steps a tile), the 192-column ping-pong in
// 2-CTA clusters, SonicMoE's down-projection form: no tile boundary leaves the tensor cores
// waiting for an epilogue (F2 2-4 % faster on qwen3-30b-a3b and sonicmoe-readme on an H100; it
// falls back to the cooperative kernel where no such clusters are prepared); else -1.
constexpr int64_t kSm90F2PingpongMaxH = 1024;
int sm90_f2_rows_form(const LayerDesc& desc, const Sm90Forms& forms);

// The ping-pong forms of F2 and B4 (rows_pingpong_gemm.cu) on `device`, the current device's
// facts as the caller looked them up for its choice of form (one lookup a launch); tile_n = 192 or
// 128, cluster = 1, or 2 with tile_n 192 (device.rows_pingpong_clusters > 0). Precondition:
// sm90_rows_supported over the op's tensors.
void sm90_f2_pingpong_launch(const LayerDesc& desc, const F2Op& op, const Sm90Device& device,
                             int tile_n, int cluster, const Sm90Forms& forms, cudaStream_t stream);
void sm90_b4_pingpong_launch(const LayerDesc& desc, const B4Op& op, const Sm90Device& device,
                             int tile_n, int cluster, const Sm90Forms& forms, cudaStream_t stream);
// As sm90_rows_prepare_kernels, for the ping-pong kernels alone (Sm90Device::rows_pingpong); sets
// *max_clusters to the 2-CTA clusters that can be resident at once (0: none).
bool sm90_rows_pingpong_prepare_kernels(int* max_clusters);

// The rows kernels' epilogue-warp forms (F2 / B4 "warps", B1 "warps") in 2-CTA clusters
// (Sm90Forms::rows_cluster = 2): two CTAs on adjacent m-tiles of one expert each load every other
// B box of a stage into both, halving B's L2 traffic; the same bits as one CTA. Parses
// MOEBLAZE_CUDA_ROWS_CLUSTER's value ("1", "2"; anything else: 0, the policy).
int sm90_parse_rows_cluster(const char* value);

// B1's epilogue form (Sm90Forms::b1_form; rows_gemm.cu, B1Form): -1 = the policy by k-steps a
// tile; 0, 1, 2, 3 force the consumers', the epilogue warps', the split or the two-group split
// form. Parses MOEBLAZE_CUDA_B1_FORM's value ("consumers", "warps", "split", "split2"; nullptr or
// anything else: -1, the policy).
int sm90_parse_b1_form(const char* value);

// B1 (gemm_ops.hpp) on `stream`: its dg partials are kSm90B1DgPartsPerTile per tile of
// kSm90B1TileCols columns of h, tile-major. Precondition: sm90_rows_supported over the op's
// tensors.
void sm90_b1_launch(const LayerDesc& desc, const B1Op& op, const Sm90Forms& forms,
                    cudaStream_t stream);

}  // namespace cuda
}  // namespace moeblaze
