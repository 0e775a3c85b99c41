// Expert MLP forward (F1, F2, combine) and backward (B1, B2, B3, B4, per-token dx and dg
// reductions) on top of the grouped GEMM engine. Transients (never saved): u unless SAVE_ALL, the
// fp32 [N,d] outputs of F2 and B4 (reduced per token in fixed j order and rounded once, so y and dx
// are deterministic without atomics), da|db and g*u in the storage dtype, B1's per-n-tile dg
// partials. In the backward, B4's fp32 rows reuse g*u's region and RECOMPUTE's a, b live in da|db's
// (see experts_backward).
#include "cuda/experts.hpp"

#include "common/saved_layout.hpp"
#include "cuda/cuda_util.cuh"
#include "cuda/gemm.cuh"
#include "cuda/kernels.hpp"
#include "cuda/sm90/f1_gemm.hpp"
#include "cuda/sm90/rows_gemm.hpp"
#include "cuda/sm90/wgrad_gemm.hpp"

namespace moeblaze {
namespace cuda {
namespace {

constexpr int kReduceThreads = 128;

// y_t = round(sum_j g[t,j] * rows[tim[t,j]]) (weights == nullptr: plain sum), j in order. Each
// product is rounded before it is added (__fmul_rn / __fadd_rn: never contracted to an FMA), as
// the CPU reference does and as the expert-parallel layer does when an expert rank applies g to
// its row and the home rank sums the returned rows: with F32 storage all three agree bitwise
// (seen on two H200s: the contracted form differed from the EP layer by one ulp of y).
template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
    token_reduce_kernel(int64_t d, int k, const int32_t* token_index_map, const float* weights,
                        const float* rows, T* out) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float s = 0.f;
    for (int j = 0; j < k; ++j) {
      const int32_t r = token_index_map[t * k + j];
      if (r < 0) continue;
      const float v = rows[int64_t(r) * d + c];
      s = __fadd_rn(s, weights ? __fmul_rn(weights[t * k + j], v) : v);
    }
    out[t * d + c] = from_f32<T>(s);
  }
}

// dg[p] = sum over n-tiles of B1's partial dot products, in n-tile order.
__global__ void dg_reduce_kernel(int64_t N, int tiles, const int32_t* token_index_map,
                                 const float* part, float* dg) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= N) return;
  const int32_t r = token_index_map[p];
  float s = 0.f;
  if (r >= 0)
    for (int i = 0; i < tiles; ++i) s += part[int64_t(i) * N + r];
  dg[p] = s;
}

__global__ void write_header_kernel(SavedHeader header, SavedHeader* out) {
  *out = header;
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

bool can_use_mma(const LayerDesc& desc, std::initializer_list<const void*> operands) {
  if (desc.dtype != Dtype::BF16 && desc.dtype != Dtype::F16) return false;
  if (desc.d % 8 != 0 || desc.h % 8 != 0) return false;
  for (const void* p : operands)
    if (p && !aligned16(p)) return false;
  return true;
}

template <typename T>
void token_reduce(int64_t T_, const LayerDesc& desc, const int32_t* tim, const float* weights,
                  const float* rows, void* out, cudaStream_t stream) {
  token_reduce_kernel<T><<<unsigned(T_), kReduceThreads, 0, stream>>>(
      desc.d, int(desc.k), tim, weights, rows, static_cast<T*>(out));
  check_launch("token_reduce_kernel");
}

void token_reduce_any(int64_t T_, const LayerDesc& desc, const int32_t* tim, const float* weights,
                      const float* rows, void* out, cudaStream_t stream) {
  if (T_ == 0) return;
  MB_CUDA_DISPATCH_DTYPE(desc.dtype,
                         token_reduce<scalar_t>(T_, desc, tim, weights, rows, out, stream));
}

// The dg partial buffer is sized for the smaller (SIMT) n-tile.
int64_t max_b1_ntiles(const LayerDesc& desc) {
  const int bn = kSimtBN;
  return (desc.h + bn - 1) / bn;
}

GemmParams f1_params(const LayerDesc& desc, const int32_t* offsets, int32_t* mtile,
                     const int32_t* eti, const void* x, const void* w_gate, const void* w_up) {
  GemmParams p;
  p.E = int(desc.E);
  p.N = int(desc.h);
  p.K = int(desc.d);
  p.offsets = offsets;
  p.mtile_start = mtile;
  p.dual = desc.gated();
  p.A.p0 = x;
  p.A.ld = desc.d;
  p.A.routed = true;
  p.A.gather = eti;
  p.B.p0 = w_gate;
  p.B.p1 = desc.gated() ? w_up : nullptr;
  p.B.ld = desc.d;
  p.B.expert_stride = desc.h * desc.d;
  p.B.split = int32_t(desc.h);
  p.ep.act = desc.activation;
  p.ep.gated = desc.gated();
  p.ep.h = desc.h;
  p.ep.d = desc.d;
  p.ep.ab_ld = desc.h;
  return p;
}

}  // namespace

// ---- forward ------------------------------------------------------------------------------------

void experts_forward(const LayerDesc& desc, const ExpertsForwardCall& call, Carver& ws, bool run) {
  const int64_t T = call.T, N = T * desc.k, h = desc.h, d = desc.d, E = desc.E;
  const size_t es = desc.elem_size();
  // Carved unconditionally so the size query needs no knowledge of `saved`.
  int32_t* ws_offsets = ws.carve<int32_t>(sizeof(int32_t) * size_t(E + 1));
  int32_t* ws_eti = ws.carve<int32_t>(sizeof(int32_t) * size_t(N));
  int32_t* ws_tim = ws.carve<int32_t>(sizeof(int32_t) * size_t(N));
  int32_t* mtile = ws.carve<int32_t>(sizeof(int32_t) * gemm_tile_scratch_ints(N, E));
  void* ws_u = ws.carve(es * size_t(N) * size_t(h));
  float* y2 = ws.carve<float>(sizeof(float) * size_t(N) * size_t(d));
  cudaStream_t stream = as_stream(call.stream);
  const bool saved = run && call.has_saved;
  int32_t* offsets = saved ? call.saved.expert_offsets : ws_offsets;
  int32_t* eti = saved ? call.saved.expert_token_indices : ws_eti;
  int32_t* tim = saved ? call.saved.token_index_map : ws_tim;
  routing_build(desc, T, call.ids, offsets, eti, tim, nullptr, ws, run, stream);
  if (!run) return;

  if (call.expert_counts) counts_from_offsets(E, offsets, call.expert_counts, stream);
  if (saved) {
    write_header_kernel<<<1, 1, 0, stream>>>(make_saved_header(desc, call.saved_pass, T),
                                             call.saved.header);
    check_launch("write_header_kernel");
  }

  const bool save_all = saved && desc.checkpoint == Checkpoint::SaveAll;
  const bool save_preact = saved && desc.checkpoint != Checkpoint::Recompute;
  void* u = save_all ? call.saved.u : ws_u;
  const bool mma = can_use_mma(desc, {call.x, call.w_gate, call.w_up, call.w_down, call.saved.a,
                                      call.saved.b, call.saved.u});

  GemmParams f1 = f1_params(desc, offsets, mtile, eti, call.x, call.w_gate, call.w_up);
  f1.ep.out_a = save_preact ? call.saved.a : nullptr;
  f1.ep.out_b = save_preact && desc.gated() ? call.saved.b : nullptr;
  if (save_preact) f1.ep.ab_ld = call.saved.ab_ld;  // the saved [N, 2h] a|b block (gated)
  f1.ep.out_u = u;
  if (sm90_f1_supported(desc, T, call.x, call.w_gate, call.w_up, f1.ep.out_a, f1.ep.out_b,
                        f1.ep.out_u, f1.ep.ab_ld)) {
    sm90_f1_launch(desc, T, call.x, offsets, eti, call.w_gate, call.w_up, f1.ep.out_a, f1.ep.out_b,
                   f1.ep.out_u, f1.ep.ab_ld, stream);
  } else {
    launch_gemm(desc.dtype, Epi::F1, mma, f1, int(N), stream);
  }

  if (sm90_rows_supported(desc, T, {u, call.w_down, y2})) {
    sm90_f2_launch(desc, T, u, offsets, call.w_down, y2, stream);
    token_reduce_any(T, desc, tim, static_cast<const float*>(call.g), y2, call.y, stream);
    return;
  }
  GemmParams f2;
  f2.E = int(E);
  f2.N = int(d);
  f2.K = int(h);
  f2.offsets = offsets;
  f2.mtile_start = mtile;
  f2.A.p0 = u;
  f2.A.ld = h;
  f2.A.routed = true;
  f2.B.p0 = call.w_down;
  f2.B.ld = h;
  f2.B.expert_stride = d * h;
  f2.ep.d = d;
  f2.ep.h = h;
  f2.ep.out_rows_f32 = y2;
  launch_gemm(desc.dtype, Epi::F2, mma, f2, int(N), stream);

  token_reduce_any(T, desc, tim, static_cast<const float*>(call.g), y2, call.y, stream);
}

// ---- backward -----------------------------------------------------------------------------------

void experts_backward(const LayerDesc& desc, const ExpertsBackwardCall& call, Carver& ws,
                      bool run) {
  const int64_t T = call.T, N = T * desc.k, h = desc.h, d = desc.d, E = desc.E;
  const size_t es = desc.elem_size();
  const bool gated = desc.gated();
  const bool recompute = desc.checkpoint == Checkpoint::Recompute;
  const int64_t dadb_ld = gated ? 2 * h : h;
  const int64_t b1_tiles = max_b1_ntiles(desc);
  // With MOEBLAZE_BACKWARD_CONSUME_SAVED, B1 writes da|db over the saved a|b block, whose layout is
  // da|db's own ([N, 2h] gated, [N, h] otherwise): no da|db region in the workspace.
  const bool consume = call.consume_saved && !recompute;
  int32_t* row_pair = ws.carve<int32_t>(sizeof(int32_t) * size_t(N));
  int32_t* mtile = ws.carve<int32_t>(sizeof(int32_t) * gemm_tile_scratch_ints(N, E));
  const size_t gu_bytes = es * size_t(N) * size_t(h);
  const size_t dxr_bytes = sizeof(float) * size_t(N) * size_t(d);
  // B4's fp32 rows reuse g*u's region when they fit: g*u is written by B1 and last read by B2, and
  // all kernels run in order on one stream. (RECOMPUTE's a, b need no region: see below.)
  const bool dxr_in_gu = dxr_bytes <= gu_bytes;
  void* dadb = consume ? nullptr : ws.carve(es * size_t(N) * size_t(dadb_ld));
  void* gu = ws.carve(gu_bytes);
  float* dg_part = ws.carve<float>(sizeof(float) * size_t(b1_tiles) * size_t(N));
  float* dxr_own = ws.carve<float>(dxr_in_gu ? 0 : dxr_bytes);
  if (!run) return;
  cudaStream_t stream = as_stream(call.stream);
  const SavedView& sv = call.saved;
  const bool mma = can_use_mma(desc, {call.x, call.dy, call.w_gate, call.w_up, call.w_down, sv.a,
                                      sv.b, sv.u, call.dw_gate, call.dw_up, call.dw_down});

  build_row_pair(N, sv.token_index_map, row_pair, stream);

  const void* a_src = sv.a;
  const void* b_src = sv.b;
  const void* u_src = desc.checkpoint == Checkpoint::SaveAll ? sv.u : nullptr;
  int64_t ab_ld = sv.ab_ld;
  if (consume) {
    // B1 reads every a, b element exactly once, in the thread that then overwrites that same
    // element with da or db (as RECOMPUTE's path below relies on too).
    dadb = sv.a;
  }
  if (recompute) {
    // The recomputed a, b go where B1 writes da, db (a at [r, 0, h), b at [r, h, 2h) of row r of
    // da|db): B1 reads every a, b element exactly once, in the thread that then overwrites that
    // same element with da or db, and no other thread touches it.
    void* a_ws = dadb;
    void* b_ws = gated ? static_cast<unsigned char*>(dadb) + es * size_t(h) : nullptr;
    GemmParams f1 = f1_params(desc, sv.expert_offsets, mtile, sv.expert_token_indices, call.x,
                              call.w_gate, call.w_up);
    f1.ep.out_a = a_ws;
    f1.ep.out_b = b_ws;
    f1.ep.ab_ld = dadb_ld;
    if (sm90_f1_supported(desc, T, call.x, call.w_gate, call.w_up, a_ws, b_ws, nullptr,
                          f1.ep.ab_ld)) {
      sm90_f1_launch(desc, T, call.x, sv.expert_offsets, sv.expert_token_indices, call.w_gate,
                     call.w_up, a_ws, b_ws, nullptr, f1.ep.ab_ld, stream);
    } else {
      launch_gemm(desc.dtype, Epi::F1, mma, f1, int(N), stream);
    }
    a_src = a_ws;
    b_src = b_ws;
    u_src = nullptr;
    ab_ld = dadb_ld;
  }

  // B1: v = dy[tok] . w_down[e]  ([rows, d] x [d, h]); epilogue -> dg partials, da|db, g*u.
  int b1_ntiles = 0;
  if (sm90_rows_supported(desc, T, {call.dy, call.w_down, a_src, b_src, u_src, dadb, gu})) {
    Sm90B1Epilogue ep;
    ep.a_src = a_src;
    ep.b_src = b_src;
    ep.ab_ld = ab_ld;
    ep.u_src = u_src;
    ep.g = static_cast<const float*>(call.g);
    ep.row_pair = row_pair;
    ep.dadb = dadb;
    ep.gu = gu;
    ep.dg_part = dg_part;
    sm90_b1_launch(desc, T, call.dy, sv.expert_offsets, sv.expert_token_indices, call.w_down, ep,
                   stream);
    b1_ntiles = int((h + kSm90B1TileCols - 1) / kSm90B1TileCols);
  } else {
    GemmParams b1;
    b1.E = int(E);
    b1.N = int(h);
    b1.K = int(d);
    b1.offsets = sv.expert_offsets;
    b1.mtile_start = mtile;
    b1.A.p0 = call.dy;
    b1.A.ld = d;
    b1.A.routed = true;
    b1.A.gather = sv.expert_token_indices;
    b1.B.p0 = call.w_down;  // MN-major: row k (of d) is w_down[e][k, :]
    b1.B.ld = h;
    b1.B.expert_stride = d * h;
    b1.ep.act = desc.activation;
    b1.ep.gated = gated;
    b1.ep.h = h;
    b1.ep.d = d;
    b1.ep.total_rows = N;
    b1.ep.a_src = a_src;
    b1.ep.b_src = b_src;
    b1.ep.ab_ld = ab_ld;
    b1.ep.u_src = u_src;
    b1.ep.g = static_cast<const float*>(call.g);
    b1.ep.row_pair = row_pair;
    b1.ep.dadb = dadb;
    b1.ep.gu = gu;
    b1.ep.dg_part = dg_part;
    launch_gemm(desc.dtype, Epi::B1, mma, b1, int(N), stream);
    b1_ntiles = int((h + (mma ? kMmaBN : kSimtBN) - 1) / (mma ? kMmaBN : kSimtBN));
  }

  if (call.dg && N > 0) {
    dg_reduce_kernel<<<blocks_for(N, 256), 256, 0, stream>>>(N, b1_ntiles, sv.token_index_map,
                                                             dg_part, static_cast<float*>(call.dg));
    check_launch("dg_reduce_kernel");
  }

  // B2: dw_down[e] [d, h] = sum_r dy[tok_r]^T (g u)_r.
  if (call.dw_down && sm90_wgrad_supported(desc, T, {call.dy, gu, call.dw_down})) {
    sm90_b2_launch(desc, T, call.dy, sv.expert_offsets, sv.expert_token_indices, gu, call.dw_down,
                   call.accumulate_wgrad, stream);
  } else if (call.dw_down) {
    GemmParams b2;
    b2.E = int(E);
    b2.M = int(d);
    b2.N = int(h);
    b2.offsets = sv.expert_offsets;
    b2.A.p0 = call.dy;
    b2.A.ld = d;
    b2.A.routed = true;
    b2.A.gather = sv.expert_token_indices;
    b2.B.p0 = gu;
    b2.B.ld = h;
    b2.B.routed = true;
    b2.ep.out0 = call.dw_down;
    b2.ep.out_ld = h;
    b2.ep.out_expert_stride = d * h;
    b2.ep.out_split = int32_t(d);
    b2.ep.accumulate = call.accumulate_wgrad;
    launch_gemm(desc.dtype, Epi::Wgrad, mma, b2, int(N), stream);
  }

  // B3: [dw_gate; dw_up][e] [2h, d] = sum_r [da|db]_r^T x[tok_r].
  void* dw_up = gated ? call.dw_up : nullptr;
  if ((call.dw_gate || dw_up) &&
      sm90_wgrad_supported(desc, T, {dadb, call.x, call.dw_gate, dw_up})) {
    sm90_b3_launch(desc, T, dadb, call.x, sv.expert_offsets, sv.expert_token_indices, call.dw_gate,
                   dw_up, call.accumulate_wgrad, stream);
  } else if (call.dw_gate || dw_up) {
    GemmParams b3;
    b3.E = int(E);
    b3.M = int(dadb_ld);
    b3.N = int(d);
    b3.offsets = sv.expert_offsets;
    b3.A.p0 = dadb;
    b3.A.ld = dadb_ld;
    b3.A.routed = true;
    b3.B.p0 = call.x;
    b3.B.ld = d;
    b3.B.routed = true;
    b3.B.gather = sv.expert_token_indices;
    b3.ep.out0 = call.dw_gate;
    b3.ep.out1 = gated ? call.dw_up : nullptr;
    b3.ep.out_ld = d;
    b3.ep.out_expert_stride = h * d;
    b3.ep.out_split = int32_t(h);
    b3.ep.accumulate = call.accumulate_wgrad;
    launch_gemm(desc.dtype, Epi::Wgrad, mma, b3, int(N), stream);
  }

  // B4: dx rows = [da|db]_r . [w_gate; w_up][e] (K = 2h), then the per-token reduction.
  if (call.dx) {
    float* dxr = dxr_in_gu ? static_cast<float*>(gu) : dxr_own;
    if (sm90_rows_supported(desc, T, {dadb, call.w_gate, call.w_up, dxr})) {
      sm90_b4_launch(desc, T, dadb, sv.expert_offsets, call.w_gate, call.w_up, dxr, stream);
      token_reduce_any(T, desc, sv.token_index_map, nullptr, dxr, call.dx, stream);
      return;
    }
    GemmParams b4;
    b4.E = int(E);
    b4.N = int(d);
    b4.K = int(dadb_ld);
    b4.offsets = sv.expert_offsets;
    b4.mtile_start = mtile;
    b4.A.p0 = dadb;
    b4.A.ld = dadb_ld;
    b4.A.routed = true;
    b4.B.p0 = call.w_gate;  // MN-major: row k (of h) is w_gate[e][k, :]
    b4.B.p1 = gated ? call.w_up : nullptr;
    b4.B.split = int32_t(h);
    b4.B.ld = d;
    b4.B.expert_stride = h * d;
    b4.ep.d = d;
    b4.ep.h = h;
    b4.ep.out_rows_f32 = dxr;
    launch_gemm(desc.dtype, Epi::B4, mma, b4, int(N), stream);
    token_reduce_any(T, desc, sv.token_index_map, nullptr, dxr, call.dx, stream);
  }
}

}  // namespace cuda
}  // namespace moeblaze
