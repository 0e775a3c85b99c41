// B2 and B3 for Hopper: the weight-gradient grouped GEMMs, a reduction over each expert's routed
// rows ("varlen K") with both operands MN-major, on one persistent, warp-specialised
// TMA + cp.async + wgmma kernel, experts in index order; the CUDA suite checks edge shapes, BF16
// and F16, accumulation, and Inf/NaN rows of the neighbouring expert.
//
// For expert e and routed rows r in [expert_offsets[e], expert_offsets[e+1]), tok_r =
// expert_token_indices[r]:
//   B2: dw_down[e] [d, h]          (+)= sum_r dy[tok_r]^T gu_r
//   B3: [dw_gate; dw_up][e] [2h, d] (+)= sum_r [da|db]_r^T x[tok_r]   (gated; non-gated: dw_gate
//                                        [h, d] from da [N, h] alone)
// fp32 accumulation, rounded once to the storage dtype (round-to-nearest-even); accumulate: out =
// round(old + acc) with one fp32 add. An expert with no rows gets zeros (accumulate == false) or
// is left untouched (accumulate == true). One CTA owns a whole output tile and sums k in ascending
// row order (no split-K, no atomics), so every result is bitwise repeatable; the order differs
// from the mma.sync engine's, so results can differ from that engine in the last bit.
// Only rows inside an expert's range are read: rows past expert_offsets[E] (dropped pairs) and
// the next expert's rows never enter a sum (an Inf there cannot turn into NaN here).
// No host sync, no allocation: the tensor map is a kernel parameter encoded on the host per call
// (graph-capturable).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "common/layer_desc.hpp"
#include "cuda/engines/gemm_ops.hpp"

namespace moeblaze {
namespace cuda {

// B2 / B3's output tile: rows of M (d) x columns of N (h for B2, 2h for B3). One persistent CTA an
// SM runs whole tiles, each summing its expert's every routed row.
constexpr int kSm90WgradTileRows = 128;
constexpr int kSm90WgradTileCols = 256;

// The largest dynamic shared memory a launch asks for (E = 1024), for the device check.
size_t sm90_wgrad_max_smem_bytes();

// See sm90_f1_prepare_kernels (f1_gemm.hpp): with a compute capability 9.0 device current, true
// when every B2 / B3 kernel's image is the sm_90a one, after setting their shared-memory opt-in.
bool sm90_wgrad_prepare_kernels();

// True when the B2 / B3 kernels can run this layer on the current device: the sm90 kernels are
// usable (device.hpp), dtype BF16 or F16, d % 8 == 0, h % 8 == 0, 1 <= E <= 1024,
// every count inside int range and every non-null pointer in `tensors` 16-byte aligned (TMA and
// 16-byte cp.async need it).
bool sm90_wgrad_supported(const LayerDesc& desc, int64_t T,
                          std::initializer_list<const void*> tensors);

// B2 and B3 (gemm_ops.hpp) on `stream`; nothing wanted (no output pointer): nothing to do.
// Precondition: sm90_wgrad_supported over the op's tensors. Throws moeblaze::Error
// (MOEBLAZE_ERR_CUDA) if the tensor-map encoder or the launch fails.
void sm90_b2_launch(const LayerDesc& desc, const B2Op& op, cudaStream_t stream);
void sm90_b3_launch(const LayerDesc& desc, const B3Op& op, cudaStream_t stream);

}  // namespace cuda
}  // namespace moeblaze
