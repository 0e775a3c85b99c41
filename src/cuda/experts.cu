// Expert MLP forward (F1, F2, combine) and backward (B1, B2, B3, B4, per-token dx and dg
// reductions) on top of the grouped GEMM engine. Transients (never saved): u unless SAVE_ALL, the
// [N, d] rows of F2 and B4 (each weighted and rounded once to the storage dtype, then summed per
// token in fixed j order in fp32 and rounded again, so y and dx are deterministic without atomics
// and equal the expert-parallel layer's bit for bit), da|db and g*u in the storage dtype, B1's
// per-n-tile dg partials. In the backward, B4's rows share g*u's region, RECOMPUTE's a, b live in
// da|db's, and B1 + B2 run over column chunks of h when g*u would be the larger region (see
// experts_backward).
#include "cuda/experts.hpp"

#include <type_traits>

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

// out_t = round(sum_j rows[tim[t,j]]), j ascending, in fp32 with every addition rounded
// (__fadd_rn: never contracted): the expert-parallel home rank's sum of the rows its experts
// return, so the one-device and the expert-parallel layer agree bitwise in every dtype. `width`
// columns; rows and out are rows_ld and out_ld elements apart.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
    token_reduce_kernel(int64_t width, int64_t rows_ld, int64_t out_ld, int k,
                        const int32_t* token_index_map, const T* rows, T* out) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    float s = 0.f;
    for (int j = 0; j < k; ++j) {
      const int32_t r = token_index_map[t * k + j];
      if (r < 0) continue;
      s = __fadd_rn(s, to_f32<T>(rows[int64_t(r) * rows_ld + c]));
    }
    out[t * out_ld + c] = from_f32<T>(s);
  }
}

// token_reduce_kernel 16 bytes at a time (width, rows_ld and out_ld multiples of the elements in
// 16 bytes, rows and out 16-byte aligned): the same additions in the same order, so the same bits.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
    token_reduce16_kernel(int64_t width, int64_t rows_ld, int64_t out_ld, int k,
                          const int32_t* token_index_map, const T* rows, T* out) {
  constexpr int kVec = 16 / int(sizeof(T));
  const int64_t t = blockIdx.x;
  for (int64_t c = kVec * int64_t(threadIdx.x); c < width; c += kVec * int64_t(blockDim.x)) {
    float s[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) s[i] = 0.f;
    for (int j = 0; j < k; ++j) {
      const int32_t r = token_index_map[t * k + j];
      if (r < 0) continue;
      const uint4 raw = *reinterpret_cast<const uint4*>(rows + int64_t(r) * rows_ld + c);
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kVec; ++i) s[i] = __fadd_rn(s[i], to_f32<T>(v[i]));
    }
    uint4 packed;
    T* o = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int i = 0; i < kVec; ++i) o[i] = from_f32<T>(s[i]);
    *reinterpret_cast<uint4*>(out + t * out_ld + c) = packed;
  }
}

// Direct rows (k = 1): a token whose pair was dropped (an id out of range, which CUDA cannot
// refuse without a host sync) has no routed row, so F2 / B4 never write its output row; it gets
// the zeros the reduction would give. One warp per token.
template <typename T>
__global__ void zero_dropped_kernel(int64_t num_tokens, int64_t d, const int32_t* token_index_map,
                                    T* out) {
  const int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (t >= num_tokens || token_index_map[t] >= 0) return;
  for (int64_t c = threadIdx.x & 31; c < d; c += 32) out[t * d + c] = from_f32<T>(0.f);
}

// dg[p] = sum of B1's partial dot products of the pair's row, in n-tile order (and within a tile
// in part order): a fixed order, so deterministic.
__global__ void dg_reduce_kernel(int64_t N, int parts, const int32_t* token_index_map,
                                 const float* part, float* dg) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= N) return;
  const int32_t r = token_index_map[p];
  float s = 0.f;
  if (r >= 0)
    for (int i = 0; i < parts; ++i) s += part[int64_t(i) * N + r];
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

// Columns [col0, col0 + width) of out [T, d] from rows [N, width] (one column chunk's rows).
template <typename T>
void token_reduce(int64_t T_, const LayerDesc& desc, const int32_t* tim, const void* rows,
                  int64_t col0, int64_t width, void* out, cudaStream_t stream) {
  constexpr int kVec = 16 / int(sizeof(T));
  T* out_cols = static_cast<T*>(out) + col0;
  if (width % kVec == 0 && desc.d % kVec == 0 && aligned16(rows) && aligned16(out_cols)) {
    token_reduce16_kernel<T><<<unsigned(T_), kReduceThreads, 0, stream>>>(
        width, width, desc.d, int(desc.k), tim, static_cast<const T*>(rows), out_cols);
    check_launch("token_reduce16_kernel");
    return;
  }
  token_reduce_kernel<T><<<unsigned(T_), kReduceThreads, 0, stream>>>(
      width, width, desc.d, int(desc.k), tim, static_cast<const T*>(rows), out_cols);
  check_launch("token_reduce_kernel");
}

// k = 1: a token's output is its one routed row (times g), rounded once, so F2 and B4 write y and
// dx themselves (row_value: the reduction's bits) and neither the [N, d] rows nor the
// reduction pass exist. The expert side of the expert-parallel layer runs with k = 1 too. Decided
// from the descriptor alone, so the size query and the run carve the same regions; every F2 / B4
// path (sm90, mma.sync, SIMT) supports it.
bool direct_rows(const LayerDesc& desc, const CudaTuning& tuning) {
  return desc.k == 1 && tuning.direct_rows;
}

// After F2 / B4 over one column chunk: the per-token reduction of its rows into those columns.
void reduce_rows(int64_t T_, const LayerDesc& desc, const int32_t* tim, const void* rows,
                 int64_t col0, int64_t width, void* out, cudaStream_t stream) {
  if (T_ == 0) return;
  MB_CUDA_DISPATCH_DTYPE(desc.dtype,
                         token_reduce<scalar_t>(T_, desc, tim, rows, col0, width, out, stream));
}

// After F2 / B4 with direct rows: the dropped tokens' zero rows.
void zero_dropped(int64_t T_, const LayerDesc& desc, const int32_t* tim, void* out,
                  cudaStream_t stream) {
  if (T_ == 0) return;
  constexpr int kThreads = 256;  // 8 tokens a block
  const unsigned blocks = unsigned((T_ * 32 + kThreads - 1) / kThreads);
  MB_CUDA_DISPATCH_DTYPE(desc.dtype, zero_dropped_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
                                         T_, desc.d, tim, static_cast<scalar_t*>(out)));
  check_launch("zero_dropped_kernel");
}

// Every B1 tile width (sm90 256, mma.sync 128, SIMT 64) divides a chunk's width, so each chunk's
// n-tiles are exactly the unchunked kernel's and its dg partials keep their absolute index.
constexpr int64_t kGuChunkAlign = 256;
constexpr int64_t kMaxGuChunks = 4;

// Every F2 / B4 tile width (sm90 256, mma.sync 128, SIMT 64) divides a column chunk's offset, so
// each chunk's tiles are the unchunked launch's and give the same bits.
constexpr int64_t kRowChunkAlign = 256;
constexpr int64_t kMaxRowChunks = 2;

int64_t chunk_width(int64_t total, int64_t chunks, int64_t align) {
  if (chunks <= 1) return total;
  const int64_t cols = ((total + chunks - 1) / chunks + align - 1) / align * align;
  return cols < total ? cols : total;
}

// Width of F2's and B4's column chunks of d (d itself: one chunk). Their rows ([N, d], storage
// dtype) are the layer's largest transient on fine-grained layers (d large against h: qwen3's are
// 1 GiB against 0.75 GiB of saved a|b); in chunks of columns they shrink to [N, d / chunks], and
// each further chunk re-reads the GEMM's A operand (u or da|db) once. So d is cut in two where
// the rows would exceed the layer's [N, h]-sized activations (a|b, and B4's A operand da|db), and
// not further: two chunks already put the rows below them.
int64_t row_chunk_cols(const LayerDesc& desc, int64_t N, bool direct, int forced_chunks) {
  const int64_t d = desc.d, es = int64_t(desc.elem_size());
  if (direct || N == 0) return d;
  int64_t chunks = forced_chunks;
  if (chunks <= 0) {
    const int64_t rows = es * N * d;
    const int64_t activations = es * N * desc.h * (desc.gated() ? 2 : 1);
    chunks = rows > activations ? kMaxRowChunks : 1;
  }
  return chunk_width(d, chunks, kRowChunkAlign);
}

// Width of B1/B2's column chunks of h (h itself: one chunk). g*u ([N, h], storage dtype) is the
// backward's largest transient; B4's rows ([N, d]) share its region once B2 has read it. The
// layer's peak is the larger of the forward's transients (u unless saved, and F2's rows) and the
// backward's (the weight gradients and dx it fills, and that region). Each chunk re-gathers dy
// for B1 and B2 and adds a partial last wave to each, so h is chunked only as far as needed to
// bring the backward down to the forward: the fewest chunks that do (at most 4), or, where no
// number of chunks can, until g*u is no larger than B4's rows (row_cols of d at a time).
int64_t gu_chunk_cols(const LayerDesc& desc, int64_t T, int64_t N, int64_t row_cols, bool direct,
                      int forced_chunks) {
  const int64_t h = desc.h, d = desc.d;
  const int64_t es = int64_t(desc.elem_size());
  if (N == 0) return h;
  int64_t chunks = forced_chunks > 0 ? forced_chunks : 0;
  if (chunks == 0) {
    const int64_t rows = direct ? 0 : es * N * row_cols;
    const int64_t gu = es * N * h;
    const int64_t forward = (desc.checkpoint == Checkpoint::SaveAll ? 0 : gu) + rows;
    const int64_t outputs = es * desc.E * d * h * (desc.gated() ? 3 : 2) + es * T * d;
    const auto backward = [&](int64_t c) {
      const int64_t region = (gu + c - 1) / c;
      return outputs + (region > rows ? region : rows);
    };
    if (backward(1) <= forward) return h;
    chunks = 1;
    while (chunks < kMaxGuChunks && backward(chunks) > forward && (gu + chunks - 1) / chunks > rows)
      ++chunks;
  }
  return chunk_width(h, chunks, kGuChunkAlign);
}

// B1's dg partials per row, for whichever B1 kernel runs: one per tile of kSimtBN or kMmaBN
// columns, kSm90B1DgPartsPerTile per tile of kSm90B1TileCols.
int64_t max_b1_dg_parts(const LayerDesc& desc) {
  const int64_t portable = (desc.h + kSimtBN - 1) / kSimtBN;  // kSimtBN <= kMmaBN
  const int64_t sm90 = (desc.h + kSm90B1TileCols - 1) / kSm90B1TileCols * kSm90B1DgPartsPerTile;
  return portable > sm90 ? portable : sm90;
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

void experts_forward(const LayerDesc& desc, const ExpertsForwardCall& call, Carver& ws, bool run,
                     const CudaTuning& tuning) {
  const int64_t T = call.T, N = T * desc.k, h = desc.h, d = desc.d, E = desc.E;
  const size_t es = desc.elem_size();
  // With a saved buffer (training; the size query's MOEBLAZE_FORWARD_WITH_SAVED) the routing
  // indices, and under SAVE_ALL u, go straight into it, so the workspace carves them only without
  // one. call.has_saved decides the layout in the size query and in the run alike.
  const bool saved = call.has_saved;
  const bool save_all = saved && desc.checkpoint == Checkpoint::SaveAll;
  int32_t* ws_offsets = ws.carve<int32_t>(saved ? 0 : sizeof(int32_t) * size_t(E + 1));
  int32_t* ws_eti = ws.carve<int32_t>(saved ? 0 : sizeof(int32_t) * size_t(N));
  int32_t* ws_tim = ws.carve<int32_t>(saved ? 0 : sizeof(int32_t) * size_t(N));
  int32_t* row_pair = ws.carve<int32_t>(sizeof(int32_t) * size_t(N));
  int32_t* mtile = ws.carve<int32_t>(sizeof(int32_t) * gemm_tile_scratch_ints(N, E));
  void* ws_u = ws.carve(save_all ? 0 : es * size_t(N) * size_t(h));
  const bool direct = direct_rows(desc, tuning);
  const int64_t row_cols = row_chunk_cols(desc, N, direct, tuning.row_chunks);
  void* y2 = ws.carve(direct ? 0 : es * size_t(N) * size_t(row_cols));
  cudaStream_t stream = as_stream(call.stream);
  int32_t* offsets = saved ? call.saved.expert_offsets : ws_offsets;
  int32_t* eti = saved ? call.saved.expert_token_indices : ws_eti;
  int32_t* tim = saved ? call.saved.token_index_map : ws_tim;
  routing_build(desc, T, call.ids, offsets, eti, tim, row_pair, ws, run, stream);
  if (!run) return;

  if (call.expert_counts) counts_from_offsets(E, offsets, call.expert_counts, stream);
  if (saved) {
    write_header_kernel<<<1, 1, 0, stream>>>(make_saved_header(desc, call.saved_pass, T),
                                             call.saved.header);
    check_launch("write_header_kernel");
  }

  const bool save_preact = saved && desc.checkpoint != Checkpoint::Recompute;
  void* u = save_all ? call.saved.u : ws_u;
  const bool mma = can_use_mma(desc, {call.x, call.w_gate, call.w_up, call.w_down, call.saved.a,
                                      call.saved.b, call.saved.u});

  GemmParams f1 = f1_params(desc, offsets, mtile, eti, call.x, call.w_gate, call.w_up);
  f1.ep.out_a = save_preact ? call.saved.a : nullptr;
  f1.ep.out_b = save_preact && desc.gated() ? call.saved.b : nullptr;
  if (save_preact) f1.ep.ab_ld = call.saved.ab_ld;  // the saved [N, 2h] a|b block (gated)
  f1.ep.out_u = u;
  if (tuning.sm90 && sm90_f1_supported(desc, T, call.x, call.w_gate, call.w_up, f1.ep.out_a,
                                       f1.ep.out_b, f1.ep.out_u, f1.ep.ab_ld)) {
    sm90_f1_launch(desc, T, call.x, offsets, eti, call.w_gate, call.w_up, f1.ep.out_a, f1.ep.out_b,
                   f1.ep.out_u, f1.ep.ab_ld, tuning.sm90_forms, stream);
  } else {
    launch_gemm(desc.dtype, Epi::F1, mma, f1, int(N), tuning.mma_warps, stream);
  }

  // F2 over column chunks of d: row r = g_r * (u_r . w_down[e]^T), rounded once, into y2 and
  // summed per token into those columns of y; or (direct) straight into y.
  const float* g = static_cast<const float*>(call.g);
  const bool f2_sm90 = tuning.sm90 && sm90_rows_supported(desc, T, {u, call.w_down, y2, call.y});
  for (int64_t col0 = 0; col0 < d; col0 += row_cols) {
    const int64_t cols = d - col0 < row_cols ? d - col0 : row_cols;
    Sm90RowsOut out;
    out.rows =
        direct ? static_cast<void*>(static_cast<unsigned char*>(call.y) + es * size_t(col0)) : y2;
    out.ld = direct ? d : cols;
    out.pair = row_pair;
    out.weights = g;
    out.by_pair = direct;
    if (f2_sm90) {
      sm90_f2_launch(desc, T, u, offsets, call.w_down, {col0, cols}, out, tuning.sm90_forms,
                     stream);
    } else {
      GemmParams f2;
      f2.E = int(E);
      f2.N = int(cols);
      f2.K = int(h);
      f2.offsets = offsets;
      f2.mtile_start = mtile;
      f2.A.p0 = u;
      f2.A.ld = h;
      f2.A.routed = true;
      f2.B.p0 = static_cast<const unsigned char*>(call.w_down) + es * size_t(col0 * h);
      f2.B.ld = h;
      f2.B.expert_stride = d * h;
      f2.ep.d = cols;
      f2.ep.h = h;
      f2.ep.out_rows = out.rows;
      f2.ep.rows_ld = out.ld;
      f2.ep.out_pair = out.pair;
      f2.ep.out_w = out.weights;
      f2.ep.out_by_pair = out.by_pair;
      launch_gemm(desc.dtype, Epi::F2, mma, f2, int(N), tuning.mma_warps, stream);
    }
    if (!direct) reduce_rows(T, desc, tim, y2, col0, cols, call.y, stream);
  }
  if (direct) zero_dropped(T, desc, tim, call.y, stream);
}

// ---- backward -----------------------------------------------------------------------------------

void experts_backward(const LayerDesc& desc, const ExpertsBackwardCall& call, Carver& ws, bool run,
                      const CudaTuning& tuning) {
  const int64_t T = call.T, N = T * desc.k, h = desc.h, d = desc.d, E = desc.E;
  const size_t es = desc.elem_size();
  const bool gated = desc.gated();
  const bool recompute = desc.checkpoint == Checkpoint::Recompute;
  const int64_t dadb_ld = gated ? 2 * h : h;
  const int64_t b1_dg_parts = max_b1_dg_parts(desc);
  // With MOEBLAZE_BACKWARD_CONSUME_SAVED, B1 writes da|db over the saved a|b block, whose layout is
  // da|db's own ([N, 2h] gated, [N, h] otherwise): no da|db region in the workspace.
  const bool consume = call.consume_saved && !recompute;
  int32_t* row_pair = ws.carve<int32_t>(sizeof(int32_t) * size_t(N));
  int32_t* mtile = ws.carve<int32_t>(sizeof(int32_t) * gemm_tile_scratch_ints(N, E));
  // g*u for one column chunk of h at a time (gu_chunk_cols; all of h when that is one chunk).
  const bool direct = direct_rows(desc, tuning);  // B4 writes dx itself: no rows
  const int64_t row_cols = row_chunk_cols(desc, N, direct, tuning.row_chunks);
  const int64_t gu_cols = gu_chunk_cols(desc, T, N, row_cols, direct, tuning.gu_chunks);
  const size_t gu_bytes = es * size_t(N) * size_t(gu_cols);
  const size_t dxr_bytes = direct ? 0 : es * size_t(N) * size_t(row_cols);
  // g*u and B4's rows share one region: g*u is written by B1 and last read by B2, B4 runs after
  // both, and all kernels run in order on one stream. (RECOMPUTE's a, b need no region: below.)
  void* dadb = consume ? nullptr : ws.carve(es * size_t(N) * size_t(dadb_ld));
  void* gu = ws.carve(gu_bytes > dxr_bytes ? gu_bytes : dxr_bytes);
  float* dg_part = ws.carve<float>(sizeof(float) * size_t(b1_dg_parts) * size_t(N));
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
    if (tuning.sm90 && sm90_f1_supported(desc, T, call.x, call.w_gate, call.w_up, a_ws, b_ws,
                                         nullptr, f1.ep.ab_ld)) {
      sm90_f1_launch(desc, T, call.x, sv.expert_offsets, sv.expert_token_indices, call.w_gate,
                     call.w_up, a_ws, b_ws, nullptr, f1.ep.ab_ld, tuning.sm90_forms, stream);
    } else {
      launch_gemm(desc.dtype, Epi::F1, mma, f1, int(N), tuning.mma_warps, stream);
    }
    a_src = a_ws;
    b_src = b_ws;
    u_src = nullptr;
    ab_ld = dadb_ld;
  }

  // B1: v = dy[tok] . w_down[e]  ([rows, d] x [d, h]); epilogue -> dg partials, da|db, g*u.
  // B2: dw_down[e] [d, h] = sum_r dy[tok_r]^T (g u)_r.
  // Both per column chunk [h0, h0 + cols) of h: B1 writes da|db's columns of the chunk and its g*u
  // into the [N, cols] region, B2 turns that into the same columns of dw_down. Every output tile
  // of either kernel is the unchunked one, so the results do not depend on the chunking.
  const int64_t ab_ld_full = ab_ld != 0 ? ab_ld : h;
  const bool b1_sm90 =
      tuning.sm90 &&
      sm90_rows_supported(desc, T, {call.dy, call.w_down, a_src, b_src, u_src, dadb, gu});
  const bool b2_sm90 = call.dw_down != nullptr && tuning.sm90 &&
                       sm90_wgrad_supported(desc, T, {call.dy, gu, call.dw_down});
  const int b1_tile_cols = b1_sm90 ? kSm90B1TileCols : (mma ? kMmaBN : kSimtBN);
  const int b1_parts_per_tile = b1_sm90 ? kSm90B1DgPartsPerTile : 1;
  const auto column = [es](const void* base, int64_t col) -> void* {
    return base == nullptr ? nullptr
                           : const_cast<unsigned char*>(static_cast<const unsigned char*>(base)) +
                                 es * size_t(col);
  };
  for (int64_t h0 = 0; h0 < h; h0 += gu_cols) {
    const int64_t cols = h - h0 < gu_cols ? h - h0 : gu_cols;
    float* dg_chunk = dg_part + size_t(h0 / b1_tile_cols * b1_parts_per_tile) * size_t(N);
    if (b1_sm90) {
      Sm90B1Epilogue ep;
      ep.a_src = column(a_src, h0);
      ep.b_src = column(b_src, h0);
      ep.ab_ld = ab_ld_full;
      ep.u_src = column(u_src, h0);
      ep.u_ld = h;
      ep.g = static_cast<const float*>(call.g);
      ep.row_pair = row_pair;
      ep.dadb = column(dadb, h0);
      ep.dadb_ld = dadb_ld;
      ep.gu = gu;
      ep.dg_part = dg_chunk;
      ep.col0 = h0;
      ep.cols = cols;
      sm90_b1_launch(desc, T, call.dy, sv.expert_offsets, sv.expert_token_indices, call.w_down, ep,
                     tuning.sm90_forms, stream);
    } else {
      GemmParams b1;
      b1.E = int(E);
      b1.N = int(cols);
      b1.K = int(d);
      b1.offsets = sv.expert_offsets;
      b1.mtile_start = mtile;
      b1.A.p0 = call.dy;
      b1.A.ld = d;
      b1.A.routed = true;
      b1.A.gather = sv.expert_token_indices;
      b1.B.p0 = column(call.w_down, h0);  // MN-major: row k (of d) is w_down[e][k, h0:]
      b1.B.ld = h;
      b1.B.expert_stride = d * h;
      b1.ep.act = desc.activation;
      b1.ep.gated = gated;
      b1.ep.h = cols;
      b1.ep.d = d;
      b1.ep.total_rows = N;
      b1.ep.a_src = column(a_src, h0);
      b1.ep.b_src = column(b_src, h0);
      b1.ep.ab_ld = ab_ld_full;
      b1.ep.u_src = column(u_src, h0);
      b1.ep.u_ld = h;
      b1.ep.g = static_cast<const float*>(call.g);
      b1.ep.row_pair = row_pair;
      b1.ep.dadb = column(dadb, h0);
      b1.ep.dadb_ld = dadb_ld;
      b1.ep.db_offset = h;
      b1.ep.gu = gu;
      b1.ep.dg_part = dg_chunk;
      launch_gemm(desc.dtype, Epi::B1, mma, b1, int(N), tuning.mma_warps, stream);
    }

    if (b2_sm90) {
      sm90_b2_launch(desc, T, call.dy, sv.expert_offsets, sv.expert_token_indices, gu, call.dw_down,
                     call.accumulate_wgrad, stream, h0, cols);
    } else if (call.dw_down) {
      GemmParams b2;
      b2.E = int(E);
      b2.M = int(d);
      b2.N = int(cols);
      b2.offsets = sv.expert_offsets;
      b2.A.p0 = call.dy;
      b2.A.ld = d;
      b2.A.routed = true;
      b2.A.gather = sv.expert_token_indices;
      b2.B.p0 = gu;
      b2.B.ld = cols;
      b2.B.routed = true;
      b2.ep.out0 = column(call.dw_down, h0);
      b2.ep.out_ld = h;
      b2.ep.out_expert_stride = d * h;
      b2.ep.out_split = int32_t(d);
      b2.ep.accumulate = call.accumulate_wgrad;
      launch_gemm(desc.dtype, Epi::Wgrad, mma, b2, int(N), tuning.mma_warps, stream);
    }
  }

  if (call.dg && N > 0) {
    const int b1_parts = int((h + b1_tile_cols - 1) / b1_tile_cols * b1_parts_per_tile);
    dg_reduce_kernel<<<blocks_for(N, 256), 256, 0, stream>>>(N, b1_parts, sv.token_index_map,
                                                             dg_part, static_cast<float*>(call.dg));
    check_launch("dg_reduce_kernel");
  }

  // B3: [dw_gate; dw_up][e] [2h, d] = sum_r [da|db]_r^T x[tok_r].
  void* dw_up = gated ? call.dw_up : nullptr;
  if ((call.dw_gate || dw_up) && tuning.sm90 &&
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
    launch_gemm(desc.dtype, Epi::Wgrad, mma, b3, int(N), tuning.mma_warps, stream);
  }

  // B4 over column chunks of d: dx rows = [da|db]_r . [w_gate; w_up][e] (K = 2h), then the
  // per-token reduction into those columns of dx; or (direct) straight into dx.
  if (call.dx) {
    void* dxr = gu;  // the region g*u no longer needs
    const bool b4_sm90 =
        tuning.sm90 && sm90_rows_supported(desc, T, {dadb, call.w_gate, call.w_up, dxr, call.dx});
    for (int64_t col0 = 0; col0 < d; col0 += row_cols) {
      const int64_t cols = d - col0 < row_cols ? d - col0 : row_cols;
      Sm90RowsOut out;
      out.rows = direct
                     ? static_cast<void*>(static_cast<unsigned char*>(call.dx) + es * size_t(col0))
                     : dxr;
      out.ld = direct ? d : cols;
      out.pair = row_pair;
      out.by_pair = direct;
      if (b4_sm90) {
        sm90_b4_launch(desc, T, dadb, sv.expert_offsets, call.w_gate, call.w_up, {col0, cols}, out,
                       tuning.sm90_forms, stream);
      } else {
        GemmParams b4;
        b4.E = int(E);
        b4.N = int(cols);
        b4.K = int(dadb_ld);
        b4.offsets = sv.expert_offsets;
        b4.mtile_start = mtile;
        b4.A.p0 = dadb;
        b4.A.ld = dadb_ld;
        b4.A.routed = true;
        // MN-major: row k (of h) is w_gate[e][k, col0:]
        b4.B.p0 = static_cast<const unsigned char*>(call.w_gate) + es * size_t(col0);
        b4.B.p1 =
            gated ? static_cast<const unsigned char*>(call.w_up) + es * size_t(col0) : nullptr;
        b4.B.split = int32_t(h);
        b4.B.ld = d;
        b4.B.expert_stride = h * d;
        b4.ep.d = cols;
        b4.ep.h = h;
        b4.ep.out_rows = out.rows;
        b4.ep.rows_ld = out.ld;
        b4.ep.out_pair = out.pair;
        b4.ep.out_by_pair = out.by_pair;
        launch_gemm(desc.dtype, Epi::B4, mma, b4, int(N), tuning.mma_warps, stream);
      }
      if (!direct) reduce_rows(T, desc, sv.token_index_map, dxr, col0, cols, call.dx, stream);
    }
    if (direct) zero_dropped(T, desc, sv.token_index_map, call.dx, stream);
  }
}

}  // namespace cuda
}  // namespace moeblaze
