// Expert MLP forward (F1, F2, combine) and backward (B1, B2, B3, B4, per-token dx and dg
// reductions): the orchestration. It carves the workspace, chooses the column chunks, describes
// each GEMM as an operation (engines/gemm_ops.hpp) and hands it to the engines (engine_set.hpp),
// then sums rows per token (token_reduce.hpp). Transients (never saved): u unless SAVE_ALL, the
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
#include "cuda/engines/engine_set.hpp"
#include "cuda/engines/sm90/rows_gemm.hpp"
#include "cuda/engines/sm90/wgrad_gemm.hpp"
#include "cuda/kernels.hpp"
#include "cuda/token_reduce.hpp"

namespace moeblaze {
namespace cuda {
namespace {

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

bool can_use_mma(const LayerDesc& desc, std::initializer_list<const void*> operands) {
  if (desc.dtype != Dtype::BF16 && desc.dtype != Dtype::F16) return false;
  if (desc.d % 8 != 0 || desc.h % 8 != 0) return false;
  for (const void* p : operands)
    if (p && !aligned16(p)) return false;
  return true;
}

// k = 1: a token's output is its one routed row (times g), rounded once, so F2 and B4 write y and
// dx themselves (row_value: the reduction's bits) and neither the [N, d] rows nor the
// reduction pass exist. The expert side of the expert-parallel layer runs with k = 1 too. Decided
// from the descriptor alone, so the size query and the run carve the same regions; every F2 / B4
// path (sm90, mma.sync, SIMT) supports it.
bool direct_rows(const LayerDesc& desc, const CudaTuning& tuning) {
  return desc.k == 1 && tuning.direct_rows;
}

// After F2 / B4 over one column chunk: columns [col0, col0 + width) of out [T, d] from its rows
// [N, width], summed per token.
void reduce_rows(int64_t T_, const LayerDesc& desc, const int32_t* tim, const void* rows,
                 int64_t col0, int64_t width, void* out, cudaStream_t stream) {
  void* out_cols = static_cast<char*>(out) + size_t(col0) * desc.elem_size();
  token_reduce(desc.dtype, out_cols, desc.d, rows, width, tim, T_ * desc.k, T_, desc.k, width,
               stream);
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

// Column chunks of h start at multiples of kGemmColumnAlign (gemm_ops.hpp), so B1's dg partials
// keep their absolute index. Chunks of d start at multiples of the F2 / B4 kernel's tile width, so
// no chunk adds a partial tile; an element's bits never depend on the chunking (its k order does
// not change).
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
int64_t row_chunk_cols(const LayerDesc& desc, int64_t N, bool direct, const CudaTuning& tuning) {
  const int64_t d = desc.d, es = int64_t(desc.elem_size());
  if (direct || N == 0) return d;
  // The opt-in 192-column ping-pong tiles (engines/sm90/rows_gemm.hpp); every other tile width
  // divides kGemmColumnAlign.
  const int form = tuning.sm90_forms.rows_form;
  const int64_t align =
      tuning.sm90 && (form == kSm90RowsFormPingpong192 || form == kSm90RowsFormPingpong2Cta)
          ? 192
          : kGemmColumnAlign;
  int64_t chunks = tuning.row_chunks;
  if (chunks <= 0) {
    const int64_t rows = es * N * d;
    const int64_t activations = es * N * desc.h * (desc.gated() ? 2 : 1);
    chunks = rows > activations ? kMaxRowChunks : 1;
  }
  return chunk_width(d, chunks, align);
}

// B2's waves of tiles over h in chunks of `cols` columns, on `sm_count` SMs: each chunk launches
// E x (d / rows) x (cols / columns) tiles of the Hopper kernel (wgrad_gemm.hpp), one CTA an SM.
// Counted so for every engine (the workspace does not depend on which one runs); for the portable
// engines' smaller tiles it is an estimate.
int64_t b2_waves(const LayerDesc& desc, int64_t cols, int sm_count) {
  const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  int64_t waves = 0;
  for (int64_t h0 = 0; h0 < desc.h; h0 += cols) {
    const int64_t width = desc.h - h0 < cols ? desc.h - h0 : cols;
    const int64_t tiles =
        desc.E * ceil_div(desc.d, kSm90WgradTileRows) * ceil_div(width, kSm90WgradTileCols);
    waves += ceil_div(tiles, sm_count);
  }
  return waves;
}

// Width of B1/B2's column chunks of h (h itself: one chunk). g*u ([N, h], storage dtype) is the
// backward's largest transient; B4's rows ([N, d]) share its region once B2 has read it. The
// layer's peak is the larger of the forward's transients (u unless saved, and F2's rows) and the
// backward's (the weight gradients and dx it fills, and that region). Each chunk re-gathers dy
// for B1 and B2 and adds a partial last wave to each, so h is chunked only as far as needed to
// bring the backward down to the forward: the fewest chunks that do (at most 4), or, where no
// number of chunks can, until g*u is no larger than B4's rows (row_cols of d at a time).
// Each B2 tile sums its expert's every routed row, so where a chunk's tiles leave SMs idle, B2's
// time grows by whole waves (E = 4, d = 512: 128 tiles, one wave on 132 SMs; two chunks, two
// waves, B2 twice as long). A count whose B2 takes more than kMaxGuChunkB2Growth more waves than
// one chunk's is passed over for the next larger one that does not, else the largest smaller one
// (at worst one chunk). Decided from the descriptor and the device's SM count only, so the size
// query and the run carve the same regions.
constexpr int64_t kMaxGuChunks = 4;
constexpr double kMaxGuChunkB2Growth = 1.0 / 16;

int64_t gu_chunk_cols(const LayerDesc& desc, int64_t T, int64_t N, int64_t row_cols, bool direct,
                      const CudaTuning& tuning) {
  const int64_t h = desc.h, d = desc.d;
  const int64_t es = int64_t(desc.elem_size());
  if (N == 0) return h;
  if (tuning.gu_chunks > 0) return chunk_width(h, tuning.gu_chunks, kGemmColumnAlign);
  const int64_t rows = direct ? 0 : es * N * row_cols;
  const int64_t gu = es * N * h;
  const int64_t forward = (desc.checkpoint == Checkpoint::SaveAll ? 0 : gu) + rows;
  const int64_t outputs = es * desc.E * d * h * (desc.gated() ? 3 : 2) + es * T * d;
  const auto backward = [&](int64_t c) {
    const int64_t region = (gu + c - 1) / c;
    return outputs + (region > rows ? region : rows);
  };
  if (backward(1) <= forward) return h;
  int64_t chunks = 1;
  while (chunks < kMaxGuChunks && backward(chunks) > forward && (gu + chunks - 1) / chunks > rows)
    ++chunks;
  if (tuning.sm_count > 0) {
    const double waves_allowed =
        double(b2_waves(desc, h, tuning.sm_count)) * (1.0 + kMaxGuChunkB2Growth);
    const auto b2_keeps_pace = [&](int64_t c) {
      return double(b2_waves(desc, chunk_width(h, c, kGemmColumnAlign), tuning.sm_count)) <=
             waves_allowed;
    };
    int64_t pick = 0;
    for (int64_t c = chunks; c <= kMaxGuChunks && pick == 0; ++c)
      if (b2_keeps_pace(c)) pick = c;
    for (int64_t c = chunks - 1; c >= 1 && pick == 0; --c)
      if (b2_keeps_pace(c)) pick = c;
    chunks = pick;
  }
  return chunk_width(h, chunks, kGemmColumnAlign);
}

}  // namespace

// ---- forward ------------------------------------------------------------------------------------

void experts_forward(const LayerDesc& desc, const ExpertsForwardCall& call, Carver& ws, bool run,
                     const CudaTuning& backend_tuning) {
  // F2's overrides and its form resolved (the chunks of d align to its tiles); F1 reads neither.
  CudaTuning tuning = backend_tuning.for_f2();
  if (tuning.sm90) tuning.sm90_forms.rows_form = sm90_f2_rows_form(desc, tuning.sm90_forms);
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
  int32_t* tile_scratch = ws.carve<int32_t>(sizeof(int32_t) * EngineSet::tile_scratch_ints(N, E));
  void* ws_u = ws.carve(save_all ? 0 : es * size_t(N) * size_t(h));
  const bool direct = direct_rows(desc, tuning);
  const int64_t row_cols = row_chunk_cols(desc, N, direct, tuning);
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
  const EngineSet engines(tuning, can_use_mma(desc, {call.x, call.w_gate, call.w_up, call.w_down,
                                                     call.saved.a, call.saved.b, call.saved.u}));
  const RoutedRows rows{T, offsets, eti, row_pair, tile_scratch};

  F1Op f1;
  f1.rows = rows;
  f1.x = call.x;
  f1.w_gate = call.w_gate;
  f1.w_up = call.w_up;
  f1.out_a = save_preact ? call.saved.a : nullptr;
  f1.out_b = save_preact && desc.gated() ? call.saved.b : nullptr;
  f1.ab_ld = save_preact ? call.saved.ab_ld : 0;  // the saved [N, 2h] a|b block (gated)
  f1.out_u = u;
  engines.launch(desc, f1, stream);

  // F2 over column chunks of d: row r = g_r * (u_r . w_down[e]^T), rounded once, into y2 and
  // summed per token into those columns of y; or (direct) straight into y.
  for (int64_t col0 = 0; col0 < d; col0 += row_cols) {
    F2Op f2;
    f2.rows = rows;
    f2.u = u;
    f2.w_down = call.w_down;
    f2.col0 = col0;
    f2.cols = d - col0 < row_cols ? d - col0 : row_cols;
    f2.out.rows =
        direct ? static_cast<void*>(static_cast<unsigned char*>(call.y) + es * size_t(col0)) : y2;
    f2.out.ld = direct ? d : f2.cols;
    f2.out.weights = static_cast<const float*>(call.g);
    f2.out.by_pair = direct;
    engines.launch(desc, f2, stream);
    if (!direct) reduce_rows(T, desc, tim, y2, col0, f2.cols, call.y, stream);
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
  // With MOEBLAZE_BACKWARD_CONSUME_SAVED, B1 writes da|db over the saved a|b block, whose layout is
  // da|db's own ([N, 2h] gated, [N, h] otherwise): no da|db region in the workspace.
  const bool consume = call.consume_saved && !recompute;
  int32_t* row_pair = ws.carve<int32_t>(sizeof(int32_t) * size_t(N));
  int32_t* tile_scratch = ws.carve<int32_t>(sizeof(int32_t) * EngineSet::tile_scratch_ints(N, E));
  // g*u for one column chunk of h at a time (gu_chunk_cols; all of h when that is one chunk).
  const bool direct = direct_rows(desc, tuning);  // B4 writes dx itself: no rows
  const int64_t row_cols = row_chunk_cols(desc, N, direct, tuning);
  const int64_t gu_cols = gu_chunk_cols(desc, T, N, row_cols, direct, tuning);
  const size_t gu_bytes = es * size_t(N) * size_t(gu_cols);
  const size_t dxr_bytes = direct ? 0 : es * size_t(N) * size_t(row_cols);
  // g*u and B4's rows share one region: g*u is written by B1 and last read by B2, B4 runs after
  // both, and all kernels run in order on one stream. (RECOMPUTE's a, b need no region: below.)
  void* dadb = consume ? nullptr : ws.carve(es * size_t(N) * size_t(dadb_ld));
  void* gu = ws.carve(gu_bytes > dxr_bytes ? gu_bytes : dxr_bytes);
  float* dg_part =
      ws.carve<float>(sizeof(float) * size_t(EngineSet::max_b1_dg_parts(h)) * size_t(N));
  if (!run) return;
  cudaStream_t stream = as_stream(call.stream);
  const SavedView& sv = call.saved;
  const EngineSet engines(
      tuning, can_use_mma(desc, {call.x, call.dy, call.w_gate, call.w_up, call.w_down, sv.a, sv.b,
                                 sv.u, call.dw_gate, call.dw_up, call.dw_down}));
  const RoutedRows rows{T, sv.expert_offsets, sv.expert_token_indices, row_pair, tile_scratch};

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
    F1Op f1;
    f1.rows = rows;
    f1.x = call.x;
    f1.w_gate = call.w_gate;
    f1.w_up = call.w_up;
    f1.out_a = dadb;
    f1.out_b = gated ? static_cast<unsigned char*>(dadb) + es * size_t(h) : nullptr;
    f1.ab_ld = dadb_ld;
    engines.launch(desc, f1, stream);
    a_src = f1.out_a;
    b_src = f1.out_b;
    u_src = nullptr;
    ab_ld = dadb_ld;
  }

  // B1: v = dy[tok] . w_down[e]  ([rows, d] x [d, h]); epilogue -> dg partials, da|db, g*u.
  // B2: dw_down[e] [d, h] = sum_r dy[tok_r]^T (g u)_r.
  // Both per column chunk [h0, h0 + cols) of h: B1 writes da|db's columns of the chunk and its g*u
  // into the [N, cols] region, B2 turns that into the same columns of dw_down. Every output tile
  // of either kernel is the unchunked one, so the results do not depend on the chunking. One
  // engine runs every chunk's B1 (the dg partials' layout is that engine's).
  B1Op b1;
  b1.rows = rows;
  b1.dy = call.dy;
  b1.w_down = call.w_down;
  b1.a_src = a_src;
  b1.b_src = b_src;
  b1.ab_ld = ab_ld != 0 ? ab_ld : h;
  b1.u_src = u_src;
  b1.u_ld = h;
  b1.g = static_cast<const float*>(call.g);
  b1.dadb = dadb;
  b1.dadb_ld = dadb_ld;
  b1.gu = gu;
  b1.dg_part = dg_part;
  const GemmEngine& b1_engine = engines.pick(desc, b1);
  for (int64_t h0 = 0; h0 < h; h0 += gu_cols) {
    b1.col0 = h0;
    b1.cols = h - h0 < gu_cols ? h - h0 : gu_cols;
    b1_engine.launch(desc, b1, stream);
    if (call.dw_down) {
      B2Op b2;
      b2.rows = rows;
      b2.dy = call.dy;
      b2.gu = gu;
      b2.dw_down = call.dw_down;
      b2.accumulate = call.accumulate_wgrad;
      b2.col0 = b1.col0;
      b2.cols = b1.cols;
      engines.launch(desc, b2, stream);
    }
  }

  if (call.dg && N > 0) {
    dg_reduce_kernel<<<blocks_for(N, 256), 256, 0, stream>>>(N, int(b1_engine.b1_dg_parts(h)),
                                                             sv.token_index_map, dg_part,
                                                             static_cast<float*>(call.dg));
    check_launch("dg_reduce_kernel");
  }

  // B3: [dw_gate; dw_up][e] [2h, d] = sum_r [da|db]_r^T x[tok_r].
  if (call.dw_gate || (gated && call.dw_up)) {
    B3Op b3;
    b3.rows = rows;
    b3.dadb = dadb;
    b3.x = call.x;
    b3.dw_gate = call.dw_gate;
    b3.dw_up = gated ? call.dw_up : nullptr;
    b3.accumulate = call.accumulate_wgrad;
    engines.launch(desc, b3, stream);
  }

  // B4 over column chunks of d: dx rows = [da|db]_r . [w_gate; w_up][e] (K = 2h), then the
  // per-token reduction into those columns of dx; or (direct) straight into dx.
  if (call.dx) {
    void* dxr = gu;  // the region g*u no longer needs
    for (int64_t col0 = 0; col0 < d; col0 += row_cols) {
      B4Op b4;
      b4.rows = rows;
      b4.dadb = dadb;
      b4.w_gate = call.w_gate;
      b4.w_up = gated ? call.w_up : nullptr;
      b4.col0 = col0;
      b4.cols = d - col0 < row_cols ? d - col0 : row_cols;
      b4.out.rows =
          direct ? static_cast<void*>(static_cast<unsigned char*>(call.dx) + es * size_t(col0))
                 : dxr;
      b4.out.ld = direct ? d : b4.cols;
      b4.out.by_pair = direct;
      engines.launch(desc, b4, stream);
      if (!direct) reduce_rows(T, desc, sv.token_index_map, dxr, col0, b4.cols, call.dx, stream);
    }
    if (direct) zero_dropped(T, desc, sv.token_index_map, call.dx, stream);
  }
}

}  // namespace cuda
}  // namespace moeblaze
