// The expert GEMMs of gemm_ops.hpp as the portable grouped GEMM's parameters (gemm.cuh).
#include "cuda/engines/portable/portable_engine.hpp"

#include "cuda/cuda_util.cuh"
#include "cuda/engines/portable/gemm.cuh"

namespace moeblaze {
namespace cuda {
namespace {

// Column `col` of a row-major buffer of `es`-byte elements (nullptr stays nullptr).
void* column(const void* base, int64_t col, size_t es) {
  return base == nullptr ? nullptr
                         : const_cast<unsigned char*>(static_cast<const unsigned char*>(base)) +
                               es * size_t(col);
}

int64_t range_cols(int64_t cols, int64_t all) {
  return cols != 0 ? cols : all;
}

}  // namespace

bool PortableEngine::tensor_core_shapes(const LayerDesc& desc,
                                        std::initializer_list<const void*> tensors) const {
  if (!tensor_cores_) return true;  // SIMT: every dtype and shape
  if (desc.dtype != Dtype::BF16 && desc.dtype != Dtype::F16) return false;
  if (desc.d % 8 != 0 || desc.h % 8 != 0) return false;
  for (const void* p : tensors)
    if (p != nullptr && !aligned16(p)) return false;
  return true;
}

int PortableEngine::tile_cols() const {
  return tensor_cores_ ? kMmaBN : kSimtBN;
}

bool PortableEngine::supports(const LayerDesc& desc, const F1Op& op) const {
  return tensor_core_shapes(desc, {op.x, op.w_gate, op.w_up, op.out_a, op.out_b, op.out_u});
}

bool PortableEngine::supports(const LayerDesc& desc, const F2Op& op) const {
  return tensor_core_shapes(desc, {op.u, op.w_down, op.out.rows});
}

bool PortableEngine::supports(const LayerDesc& desc, const B1Op& op) const {
  return tensor_core_shapes(desc, {op.dy, op.w_down, op.a_src, op.b_src, op.u_src, op.dadb, op.gu});
}

bool PortableEngine::supports(const LayerDesc& desc, const B2Op& op) const {
  return tensor_core_shapes(desc, {op.dy, op.gu, op.dw_down});
}

bool PortableEngine::supports(const LayerDesc& desc, const B3Op& op) const {
  return tensor_core_shapes(desc, {op.dadb, op.x, op.dw_gate, op.dw_up});
}

bool PortableEngine::supports(const LayerDesc& desc, const B4Op& op) const {
  return tensor_core_shapes(desc, {op.dadb, op.w_gate, op.w_up, op.out.rows});
}

void PortableEngine::launch(const LayerDesc& desc, const F1Op& op, cudaStream_t stream) const {
  GemmParams p;
  p.E = int(desc.E);
  p.N = int(desc.h);
  p.K = int(desc.d);
  p.offsets = op.rows.expert_offsets;
  p.mtile_start = op.rows.tile_scratch;
  p.dual = desc.gated();
  p.A.p0 = op.x;
  p.A.ld = desc.d;
  p.A.routed = true;
  p.A.gather = op.rows.expert_token_indices;
  p.B.p0 = op.w_gate;
  p.B.p1 = desc.gated() ? op.w_up : nullptr;
  p.B.ld = desc.d;
  p.B.expert_stride = desc.h * desc.d;
  p.B.split = int32_t(desc.h);
  p.ep.act = desc.activation;
  p.ep.gated = desc.gated();
  p.ep.h = desc.h;
  p.ep.d = desc.d;
  p.ep.out_a = op.out_a;
  p.ep.out_b = op.out_b;
  p.ep.ab_ld = op.ab_ld != 0 ? op.ab_ld : desc.h;
  p.ep.out_u = op.out_u;
  launch_gemm(desc.dtype, Epi::F1, tensor_cores_, p, int(op.rows.T * desc.k), mma_warps_, stream);
}

void PortableEngine::launch(const LayerDesc& desc, const F2Op& op, cudaStream_t stream) const {
  const int64_t d = desc.d, h = desc.h, cols = range_cols(op.cols, d);
  GemmParams p;
  p.E = int(desc.E);
  p.N = int(cols);
  p.K = int(h);
  p.offsets = op.rows.expert_offsets;
  p.mtile_start = op.rows.tile_scratch;
  p.A.p0 = op.u;
  p.A.ld = h;
  p.A.routed = true;
  p.B.p0 = column(op.w_down, op.col0 * h, desc.elem_size());  // rows col0.. of w_down[e] [d, h]
  p.B.ld = h;
  p.B.expert_stride = d * h;
  p.ep.d = cols;
  p.ep.h = h;
  p.ep.out_rows = op.out.rows;
  p.ep.rows_ld = op.out.ld != 0 ? op.out.ld : cols;
  p.ep.out_pair = op.rows.row_pair;
  p.ep.out_w = op.out.weights;
  p.ep.out_by_pair = op.out.by_pair;
  launch_gemm(desc.dtype, Epi::F2, tensor_cores_, p, int(op.rows.T * desc.k), mma_warps_, stream);
}

void PortableEngine::launch(const LayerDesc& desc, const B1Op& op, cudaStream_t stream) const {
  const int64_t d = desc.d, h = desc.h, N = op.rows.T * desc.k, cols = range_cols(op.cols, h);
  const size_t es = desc.elem_size();
  GemmParams p;
  p.E = int(desc.E);
  p.N = int(cols);
  p.K = int(d);
  p.offsets = op.rows.expert_offsets;
  p.mtile_start = op.rows.tile_scratch;
  p.A.p0 = op.dy;
  p.A.ld = d;
  p.A.routed = true;
  p.A.gather = op.rows.expert_token_indices;
  p.B.p0 = column(op.w_down, op.col0, es);  // MN-major: row k (of d) is w_down[e][k, col0:]
  p.B.ld = h;
  p.B.expert_stride = d * h;
  p.ep.act = desc.activation;
  p.ep.gated = desc.gated();
  p.ep.h = cols;
  p.ep.d = d;
  p.ep.total_rows = N;
  p.ep.a_src = column(op.a_src, op.col0, es);
  p.ep.b_src = column(op.b_src, op.col0, es);
  p.ep.ab_ld = op.ab_ld != 0 ? op.ab_ld : h;
  p.ep.u_src = column(op.u_src, op.col0, es);
  p.ep.u_ld = op.u_ld != 0 ? op.u_ld : h;
  p.ep.g = op.g;
  p.ep.row_pair = op.rows.row_pair;
  p.ep.dadb = column(op.dadb, op.col0, es);
  p.ep.dadb_ld = op.dadb_ld != 0 ? op.dadb_ld : (desc.gated() ? 2 * h : h);
  p.ep.db_offset = h;
  p.ep.gu = op.gu;
  p.ep.dg_part = op.dg_part + size_t(op.col0 / tile_cols()) * size_t(N);
  launch_gemm(desc.dtype, Epi::B1, tensor_cores_, p, int(N), mma_warps_, stream);
}

void PortableEngine::launch(const LayerDesc& desc, const B2Op& op, cudaStream_t stream) const {
  if (op.dw_down == nullptr) return;
  const int64_t d = desc.d, h = desc.h, cols = range_cols(op.cols, h);
  GemmParams p;
  p.E = int(desc.E);
  p.M = int(d);
  p.N = int(cols);
  p.offsets = op.rows.expert_offsets;
  p.A.p0 = op.dy;
  p.A.ld = d;
  p.A.routed = true;
  p.A.gather = op.rows.expert_token_indices;
  p.B.p0 = op.gu;
  p.B.ld = cols;
  p.B.routed = true;
  p.ep.out0 = column(op.dw_down, op.col0, desc.elem_size());
  p.ep.out_ld = h;
  p.ep.out_expert_stride = d * h;
  p.ep.out_split = int32_t(d);
  p.ep.accumulate = op.accumulate;
  launch_gemm(desc.dtype, Epi::Wgrad, tensor_cores_, p, int(op.rows.T * desc.k), mma_warps_,
              stream);
}

void PortableEngine::launch(const LayerDesc& desc, const B3Op& op, cudaStream_t stream) const {
  const bool gated = desc.gated();
  void* const dw_up = gated ? op.dw_up : nullptr;
  if (op.dw_gate == nullptr && dw_up == nullptr) return;
  const int64_t d = desc.d, h = desc.h, dadb_ld = gated ? 2 * h : h;
  GemmParams p;
  p.E = int(desc.E);
  p.M = int(dadb_ld);
  p.N = int(d);
  p.offsets = op.rows.expert_offsets;
  p.A.p0 = op.dadb;
  p.A.ld = dadb_ld;
  p.A.routed = true;
  p.B.p0 = op.x;
  p.B.ld = d;
  p.B.routed = true;
  p.B.gather = op.rows.expert_token_indices;
  p.ep.out0 = op.dw_gate;
  p.ep.out1 = dw_up;
  p.ep.out_ld = d;
  p.ep.out_expert_stride = h * d;
  p.ep.out_split = int32_t(h);
  p.ep.accumulate = op.accumulate;
  launch_gemm(desc.dtype, Epi::Wgrad, tensor_cores_, p, int(op.rows.T * desc.k), mma_warps_,
              stream);
}

void PortableEngine::launch(const LayerDesc& desc, const B4Op& op, cudaStream_t stream) const {
  const int64_t d = desc.d, h = desc.h, cols = range_cols(op.cols, d);
  const bool gated = desc.gated();
  const size_t es = desc.elem_size();
  GemmParams p;
  p.E = int(desc.E);
  p.N = int(cols);
  p.K = int(gated ? 2 * h : h);
  p.offsets = op.rows.expert_offsets;
  p.mtile_start = op.rows.tile_scratch;
  p.A.p0 = op.dadb;
  p.A.ld = gated ? 2 * h : h;
  p.A.routed = true;
  // MN-major: row k (of h) is w_gate[e][k, col0:]
  p.B.p0 = column(op.w_gate, op.col0, es);
  p.B.p1 = gated ? column(op.w_up, op.col0, es) : nullptr;
  p.B.split = int32_t(h);
  p.B.ld = d;
  p.B.expert_stride = h * d;
  p.ep.d = cols;
  p.ep.h = h;
  p.ep.out_rows = op.out.rows;
  p.ep.rows_ld = op.out.ld != 0 ? op.out.ld : cols;
  p.ep.out_pair = op.rows.row_pair;
  p.ep.out_by_pair = op.out.by_pair;
  launch_gemm(desc.dtype, Epi::B4, tensor_cores_, p, int(op.rows.T * desc.k), mma_warps_, stream);
}

int64_t PortableEngine::b1_dg_parts(int64_t h) const {
  return (h + tile_cols() - 1) / tile_cols();
}

int64_t PortableEngine::max_b1_dg_parts(int64_t h) {
  return (h + kSimtBN - 1) / kSimtBN;  // kSimtBN <= kMmaBN
}

size_t PortableEngine::tile_scratch_ints(int64_t N, int64_t E) {
  return gemm_tile_scratch_ints(N, E);
}

void PortableEngine::prepare_device() {
  gemm_init_attributes();
}

}  // namespace cuda
}  // namespace moeblaze
