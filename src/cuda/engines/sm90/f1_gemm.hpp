// F1 (the forward first GEMM of the expert MLP) for Hopper: a persistent, warp-specialised
// TMA + cp.async-gather + wgmma kernel.
//
// For expert e and routed rows r in [expert_offsets[e], expert_offsets[e+1]):
//   a_r = x[tok_r] . w_gate[e]^T, b_r = x[tok_r] . w_up[e]^T (gated only), fp32 accumulation;
//   a, b rounded to the storage dtype once; u = act(a, b) in fp32 from the ROUNDED a, b
//   (act_math::forward), rounded once. The same epilogue arithmetic as the mma.sync engine's F1
//   (gemm.cuh tile_epilogue), so equal fp32 accumulators give bitwise equal a, b, u. The fp32
//   accumulation order differs from the mma.sync engine (k-steps of 16 inside 64-wide stages vs
//   32-wide stages), so a, b (and through them u) can differ from that engine in the last bit;
//   within this kernel every run is bitwise identical (fixed tile -> CTA assignment per element,
//   no atomics, fixed k order).
//
// Rows past expert_offsets[E] (dropped pairs) are not written, as in the mma.sync engine.
// No host sync, no allocation, no workspace: the tile schedule is built by every CTA in shared
// memory from the device-side expert_offsets; the two TMA descriptors are kernel parameters
// encoded on the host per call, so the launch can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/layer_desc.hpp"
#include "cuda/engines/gemm_ops.hpp"
#include "cuda/engines/sm90/device.hpp"

namespace moeblaze {
namespace cuda {

// The largest dynamic shared memory a launch asks for (E = 1024), for the device check.
size_t sm90_f1_max_smem_bytes();

// With the current device set to a compute capability 9.0 device: true when every F1 kernel's
// image is the sm_90a one, after setting their shared-memory opt-in (sm90_prepare_device calls it);
// sets *max_2cta_clusters to the 2-CTA clusters of the epilogue-warp form resident at once.
bool sm90_f1_prepare_kernels(int* max_2cta_clusters);

// True when sm90_f1_launch can compute this F1: the sm90 kernels are usable on the current device
// (device.hpp), dtype BF16 or F16, any activation, d % 8 == 0, h % 8 == 0,
// 1 <= E <= 1024, 16-byte aligned tensors (nullptr outputs and, for non-gated activations, w_up
// and out_b are ignored), ab_ld == 0 or (ab_ld >= h and ab_ld % 8 == 0), and every count inside
// int range.
bool sm90_f1_supported(const LayerDesc& desc, const F1Op& op);

// F1's epilogue form (Sm90Forms::f1_form): -1 = the policy (by the k-steps of a tile: the split
// form up to 8 for non-gated activations, the epilogue warps up to 64, the consumers' form above);
// 0 forces the consumers' form, 1 the epilogue-warp form and 2 the split form (the consumers store
// a quarter of each tile's rows from the hand-off, the epilogue warps the rest). Every form gives
// the same bits. Parses MOEBLAZE_CUDA_F1_FORM's value ("consumers", "warps", "split"; nullptr or
// anything else: -1).
int sm90_parse_f1_form(const char* value);

// F1 in 2-CTA clusters (the epilogue-warp form only): two CTAs on adjacent m-tiles of one expert
// each load one of a stage's two B boxes into both, halving B's L2 traffic; the same bits as one
// CTA. Sm90Forms::f1_cluster: 0 = the policy, one CTA (clusters ran the step at 0.96-1.01x one
// CTA's speed on the SiLU rows and 0.93x on qwen3-30b-a3b SwiGLU on the H200,
// docs/design/cuda-kernels.md), 1 forces one CTA, 2 clusters. Parses MOEBLAZE_CUDA_F1_CLUSTER's
// value ("1", "2"; anything else: 0).
int sm90_parse_f1_cluster(const char* value);

// Enqueues F1 (gemm_ops.hpp) on `stream`. Precondition: sm90_f1_supported(desc, op).
// Throws moeblaze::Error (MOEBLAZE_ERR_CUDA) if the tensor-map encoder or the launch fails.
void sm90_f1_launch(const LayerDesc& desc, const F1Op& op, const Sm90Forms& forms,
                    cudaStream_t stream);

}  // namespace cuda
}  // namespace moeblaze
