// Router: score function + top-k + renormalisation + counts + aux/z-loss partials in one kernel (a
// warp per token), then a fixed-order reduction of the per-block partials. Backward: the Jacobian
// of g restricted to the selected experts plus the loss gradients, a warp per token. No atomics on
// floating-point values anywhere; every sum has a fixed order.
#include <cfloat>
#include <climits>

#include "common/layer_desc.hpp"
#include "cuda/cuda_util.cuh"
#include "cuda/kernels.hpp"

namespace moeblaze {
namespace cuda {
namespace {

constexpr int kRouterWarps = 4;           // warps per block
constexpr int kRouterTokensPerWarp = 16;  // tokens each warp handles, one after the other
constexpr int kRouterTokensPerBlock = kRouterWarps * kRouterTokensPerWarp;

// Top-k order: larger value first; NaN below every number; ties to the lower expert id.
__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) {
  const bool a_nan = isnan(a), b_nan = isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

struct TokenStats {
  float max;  // max logit (NaN-free max; -inf when every logit is NaN)
  float sum;  // sum of exp(l - max)
};

// A token's softmax statistics from its logits in global memory (the backward; a lane reads
// experts lane, lane + 32, ...).
__device__ __forceinline__ TokenStats softmax_stats(const float* row, int E, int lane) {
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, row[e]);
  m = warp_max(m);
  float s = 0.f;
  for (int e = lane; e < E; e += 32) s += expf(row[e] - m);
  s = warp_sum(s);
  return {m, s};
}

// A token's logits held by its warp: lane owns experts e = lane + 32 i, i < kPerLane (values past E
// are never read). The reductions below visit them in ascending i, the order of a strided loop over
// e, so every sum and maximum is the one such a loop gives.
template <int kPerLane>
struct TokenRow {
  float v[kPerLane];
};

template <int kPerLane>
__device__ __forceinline__ TokenRow<kPerLane> load_row(const float* row, int E, int lane) {
  TokenRow<kPerLane> r;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    r.v[i] = e < E ? __ldg(row + e) : 0.f;
  }
  return r;
}

template <int kPerLane>
__device__ __forceinline__ float row_max(const TokenRow<kPerLane>& r, int E, int lane) {
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    if (lane + 32 * i < E) m = fmaxf(m, r.v[i]);
  return warp_max(m);
}

template <int kPerLane>
__device__ __forceinline__ TokenStats softmax_stats(const TokenRow<kPerLane>& r, int E, int lane) {
  const float m = row_max(r, E, lane);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    if (lane + 32 * i < E) s += expf(r.v[i] - m);
  s = warp_sum(s);
  return {m, s};
}

__device__ __forceinline__ float sigmoidf_(float l) {
  return 1.f / (1.f + expf(-l));
}

// SIGMOID scores up to a common factor, the CPU's cpu::sigmoid_scores() rule: the plain sigmoid
// when the token's largest logit m is at least -60, else sigmoid(l) * exp(-m), so that top-k, the
// renormalised weights and the aux loss's normalised scores stay exact where every sigmoid
// underflows to 0.
constexpr float kSigmoidScaleBelow = -60.f;
__device__ __forceinline__ float sigmoid_score(float l, float m) {
  return m >= kSigmoidScaleBelow ? sigmoidf_(l) : expf(l - m) / (1.f + expf(l));
}

// The value top-k ranks expert e by.
__device__ __forceinline__ float rank_score(ScoreFunction fn, float l, const TokenStats& st) {
  switch (fn) {
    case ScoreFunction::SoftmaxTopk: return expf(l - st.max) / st.sum;
    case ScoreFunction::TopkSoftmax: return l;
    case ScoreFunction::Sigmoid: return sigmoid_score(l, st.max);
  }
  return l;
}

struct RouterParams {
  int64_t T;
  int E, k;
  ScoreFunction fn;
  bool renormalize;
  bool want_aux, want_z;
  const float* logits;
  int32_t* ids;
  float* g;
  float* part_p;    // [blocks, E]
  int32_t* part_c;  // [blocks, E]
  float* part_z;    // [blocks]
};

// kPerLane = ceil(E / 32) rounded up to a power of two (router_forward picks the instance): the
// token's logits and rank scores live in registers, each read from global memory once, and the
// warp loads its next token's logits before working on this one's.
template <int kPerLane>
__global__ void __launch_bounds__(kRouterWarps * 32) router_forward_kernel(RouterParams p) {
  extern __shared__ unsigned char smem_raw[];
  float* acc_p = reinterpret_cast<float*>(smem_raw);                        // [warps, E]
  int32_t* acc_c = reinterpret_cast<int32_t*>(acc_p + kRouterWarps * p.E);  // [warps, E]
  __shared__ float acc_z[kRouterWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int E = p.E, k = p.k;
  for (int i = threadIdx.x; i < kRouterWarps * E; i += blockDim.x) {
    acc_p[i] = 0.f;
    acc_c[i] = 0;
  }
  __syncthreads();
  float* my_p = acc_p + warp * E;
  int32_t* my_c = acc_c + warp * E;
  float z_sum = 0.f;
  const int64_t first = int64_t(blockIdx.x) * kRouterTokensPerBlock + warp * kRouterTokensPerWarp;
  const bool need_stats = p.fn != ScoreFunction::Sigmoid || p.want_z;
  TokenRow<kPerLane> next = {};
  if (first < p.T) next = load_row<kPerLane>(p.logits + first * E, E, lane);
  for (int i = 0; i < kRouterTokensPerWarp; ++i) {
    const int64_t t = first + i;
    if (t >= p.T) break;
    const float* row = p.logits + t * E;
    const TokenRow<kPerLane> cur = next;
    if (i + 1 < kRouterTokensPerWarp && t + 1 < p.T) next = load_row<kPerLane>(row + E, E, lane);
    TokenStats st{0.f, 1.f};
    if (need_stats) {
      st = softmax_stats(cur, E, lane);
    } else {  // SIGMOID needs the largest logit only (sigmoid_score's scale)
      st.max = row_max(cur, E, lane);
    }
    float score[kPerLane];
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) score[q] = rank_score(p.fn, cur.v[q], st);
    // Bit q of `taken` marks lane-owned expert lane + 32 q as already selected.
    uint32_t taken = 0;
    float g_mine = 0.f;  // lane j keeps the j-th pick's weight
    int id_mine = -1;
    float sel_sum = 0.f, sel_max = -INFINITY;
    for (int j = 0; j < k; ++j) {
      float best = NAN;
      int best_id = INT_MAX;
#pragma unroll
      for (int q = 0; q < kPerLane; ++q) {
        const int e = lane + 32 * q;
        if (e >= E || (taken & (1u << q))) continue;
        if (ranks_before(score[q], e, best, best_id)) {
          best = score[q];
          best_id = e;
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, offset);
        const int oi = __shfl_xor_sync(0xffffffffu, best_id, offset);
        if (ranks_before(ob, oi, best, best_id)) {
          best = ob;
          best_id = oi;
        }
      }
      if ((best_id & 31) == lane) taken |= 1u << (best_id >> 5);
      if (lane == j) {
        g_mine = best;
        id_mine = best_id;
      }
      sel_max = fmaxf(sel_max, best);
      if ((best_id & 31) == lane) my_c[best_id] += 1;
    }
    // Weights of the picks.
    if (p.fn == ScoreFunction::TopkSoftmax) {
      const float ex = lane < k ? expf(g_mine - sel_max) : 0.f;
      sel_sum = warp_sum(ex);
      g_mine = ex / sel_sum;
    } else if (p.renormalize) {
      sel_sum = warp_sum(lane < k ? g_mine : 0.f);
      g_mine = g_mine / sel_sum;
    } else if (p.fn == ScoreFunction::Sigmoid && lane < k) {
      g_mine = sigmoidf_(row[id_mine]);  // the plain sigmoid (the rank score may be scaled)
    }
    if (lane < k) {
      p.ids[t * k + lane] = id_mine;
      p.g[t * k + lane] = g_mine;
    }
    if (p.want_aux) {
      if (p.fn == ScoreFunction::Sigmoid) {  // the rank scores are sigmoid_score's
        float s = 0.f;
#pragma unroll
        for (int q = 0; q < kPerLane; ++q)
          if (lane + 32 * q < E) s += score[q];
        s = warp_sum(s);
#pragma unroll
        for (int q = 0; q < kPerLane; ++q)
          if (lane + 32 * q < E) my_p[lane + 32 * q] += score[q] / s;
      } else {
#pragma unroll
        for (int q = 0; q < kPerLane; ++q)
          if (lane + 32 * q < E) my_p[lane + 32 * q] += expf(cur.v[q] - st.max) / st.sum;
      }
    }
    if (p.want_z) {
      const float lse = st.max + logf(st.sum);
      z_sum += lse * lse;
    }
  }
  if (lane == 0) acc_z[warp] = z_sum;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float s = 0.f;
    int32_t c = 0;
    for (int w = 0; w < kRouterWarps; ++w) {
      s += acc_p[w * E + e];
      c += acc_c[w * E + e];
    }
    p.part_p[int64_t(blockIdx.x) * E + e] = s;
    p.part_c[int64_t(blockIdx.x) * E + e] = c;
  }
  if (threadIdx.x == 0) {
    float z = 0.f;
    for (int w = 0; w < kRouterWarps; ++w) z += acc_z[w];
    p.part_z[blockIdx.x] = z;
  }
}

constexpr int kReduceThreads = 1024;

// Fixed-order block reduction: every thread's value, combined in a fixed tree.
__device__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  if (warp == 0) {
    const int nwarps = blockDim.x >> 5;
    total = warp_sum(lane < nwarps ? scratch[lane] : 0.f);
  }
  __syncthreads();
  return total;  // valid in thread 0
}

__global__ void __launch_bounds__(kReduceThreads)
    router_reduce_kernel(int64_t T, int E, int k, int blocks, const float* part_p,
                         const int32_t* part_c, const float* part_z, int32_t* counts, float* losses,
                         float aux_coeff, float z_coeff) {
  __shared__ float scratch[32];
  float aux_part = 0.f;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float s = 0.f;
    int32_t c = 0;
    // One thread sums an expert's partials in block order; unrolled so that the loads of 16
    // blocks are in flight together (a latency-bound loop otherwise), the additions in order.
#pragma unroll 16
    for (int b = 0; b < blocks; ++b) {
      s += part_p[int64_t(b) * E + e];
      c += part_c[int64_t(b) * E + e];
    }
    if (counts) counts[e] = c;
    if (T > 0) aux_part += (float(c) / float(T * k)) * (s / float(T));
  }
  float z_part = 0.f;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) z_part += part_z[b];
  const float aux = block_sum(aux_part, scratch);
  const float z = block_sum(z_part, scratch);
  if (threadIdx.x == 0 && losses) {
    losses[0] = (T > 0 && aux_coeff != 0.f) ? aux_coeff * float(E) * aux : 0.f;
    losses[1] = (T > 0 && z_coeff != 0.f) ? z_coeff * z / float(T) : 0.f;
  }
}

// ---- backward ---------------------------------------------------------------------------------

constexpr int kCountThreads = 256;
constexpr int kCountTokensPerBlock = 256;

// Per-block expert histograms of `ids` (integer shared-memory counters: the result does not depend
// on the order), then reduced over blocks in a fixed order by count_reduce_kernel.
__global__ void count_partial_kernel(int64_t T, int E, int k, const int32_t* ids, int32_t* part_c) {
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t begin = int64_t(blockIdx.x) * kCountTokensPerBlock * k;
  const int64_t end = min(begin + int64_t(kCountTokensPerBlock) * k, T * k);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int id = ids[i];
    if (id >= 0 && id < E) atomicAdd(&hist[id], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) part_c[int64_t(blockIdx.x) * E + e] = hist[e];
}

__global__ void count_reduce_kernel(int E, int blocks, const int32_t* part_c, int32_t* counts) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
    int32_t c = 0;
#pragma unroll 16
    for (int b = 0; b < blocks; ++b) c += part_c[int64_t(b) * E + e];
    counts[e] = c;
  }
}

struct RouterBwdParams {
  int64_t T;
  int E, k;
  ScoreFunction fn;
  bool renormalize;
  float aux_coeff, z_coeff;
  const float* logits;
  const int32_t* ids;
  const float* dg;
  const float* d_losses;  // nullptr = {1, 1}
  const int32_t* counts;  // [E], only with aux
  float* d_logits;
};

__global__ void __launch_bounds__(256) router_backward_kernel(RouterBwdParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= p.T) return;
  const int E = p.E, k = p.k;
  const float* row = p.logits + t * E;
  float* out = p.d_logits + t * E;
  const float d_aux = p.d_losses ? p.d_losses[0] : 1.f;
  const float d_z = p.d_losses ? p.d_losses[1] : 1.f;
  const bool sigmoid = p.fn == ScoreFunction::Sigmoid;
  TokenStats st = softmax_stats(row, E, lane);

  // Lane j < k: the j-th pick, its (pre-normalisation) score and the gradient w.r.t. that score.
  int id = -1;
  float dgj = 0.f, score = 0.f;
  if (lane < k) {
    id = p.ids[t * k + lane];
    if (id < 0 || id >= E) id = -1;
    dgj = p.dg[t * k + lane];
    if (id >= 0) {
      const float l = row[id];
      score = p.fn == ScoreFunction::SoftmaxTopk ? expf(l - st.max) / st.sum
              : sigmoid                          ? sigmoid_score(l, st.max)
                                                 : l;
    }
  }
  if (id < 0) dgj = 0.f;
  float d_score = dgj;  // dLoss/d(score of pick j)
  if (p.fn == ScoreFunction::TopkSoftmax) {
    float m = warp_max(id >= 0 ? score : -INFINITY);
    const float ex = id >= 0 ? expf(score - m) : 0.f;
    const float s = warp_sum(ex);
    const float gj = ex / s;
    const float dot = warp_sum(gj * dgj);
    d_score = gj * (dgj - dot);  // already w.r.t. the logit
  } else if (p.renormalize) {
    const float S = warp_sum(id >= 0 ? score : 0.f);
    const float gj = score / S;
    const float dot = warp_sum(gj * dgj);
    d_score = (dgj - dot) / S;
  }
  // Softmax: dl_e = p_e * (dp_e - sum_j dp_j p_j) for the picks' part.
  const float pick_dot =
      (p.fn == ScoreFunction::SoftmaxTopk) ? warp_sum(id >= 0 ? d_score * score : 0.f) : 0.f;

  // Aux loss: dLoss/dq_e = w_e with q the normalised scores.
  const bool aux = p.aux_coeff != 0.f && p.counts != nullptr;
  float sig_sum = 1.f, wq_dot = 0.f;
  if (aux) {
    const float scale = d_aux * p.aux_coeff * float(E) / (float(p.T) * float(p.T * k));
    if (sigmoid) {
      float s = 0.f;
      for (int e = lane; e < E; e += 32) s += sigmoid_score(row[e], st.max);
      sig_sum = warp_sum(s);
      float dot = 0.f;
      for (int e = lane; e < E; e += 32)
        dot += scale * float(p.counts[e]) * sigmoid_score(row[e], st.max) / sig_sum;
      wq_dot = warp_sum(dot);
    } else {
      float dot = 0.f;
      for (int e = lane; e < E; e += 32)
        dot += scale * float(p.counts[e]) * expf(row[e] - st.max) / st.sum;
      wq_dot = warp_sum(dot);
    }
  }
  const float lse = st.max + logf(st.sum);
  const float z_scale = p.z_coeff != 0.f ? d_z * p.z_coeff * 2.f * lse / float(p.T) : 0.f;
  const float aux_scale =
      aux ? d_aux * p.aux_coeff * float(E) / (float(p.T) * float(p.T * k)) : 0.f;

  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    float sel = 0.f;  // d_score of the pick that is expert e, if any
    for (int j = 0; j < k; ++j) {
      const int idj = __shfl_sync(0xffffffffu, id, j);
      const float dj = __shfl_sync(0xffffffffu, d_score, j);
      if (idj == e) sel = dj;
    }
    if (e >= E) continue;
    const float l = row[e];
    const float pe = expf(l - st.max) / st.sum;
    float grad;
    if (p.fn == ScoreFunction::SoftmaxTopk) {
      grad = pe * (sel - pick_dot);
    } else if (p.fn == ScoreFunction::TopkSoftmax) {
      grad = sel;
    } else {
      // Renormalised, the scores' common factor cancels; otherwise g is the plain sigmoid.
      const float s = sigmoidf_(l);
      grad = sel * (p.renormalize ? sigmoid_score(l, st.max) : s) * (1.f - s);
    }
    if (aux) {
      const float w = aux_scale * float(p.counts[e]);
      if (sigmoid) {
        grad += (w - wq_dot) / sig_sum * sigmoid_score(l, st.max) * (1.f - sigmoidf_(l));
      } else {
        grad += pe * (w - wq_dot);
      }
    }
    if (p.z_coeff != 0.f) grad += z_scale * pe;
    out[e] = grad;
  }
}

}  // namespace

void router_forward(const LayerDesc& desc, int64_t T, const float* logits, int32_t* ids, float* g,
                    int32_t* expert_counts, float* losses, Carver& ws, bool run,
                    cudaStream_t stream) {
  const int E = int(desc.E), k = int(desc.k);
  const int blocks = int((T + kRouterTokensPerBlock - 1) / kRouterTokensPerBlock);
  float* part_p = ws.carve<float>(sizeof(float) * size_t(blocks) * E);
  int32_t* part_c = ws.carve<int32_t>(sizeof(int32_t) * size_t(blocks) * E);
  float* part_z = ws.carve<float>(sizeof(float) * size_t(blocks > 0 ? blocks : 1));
  if (!run) return;
  RouterParams p;
  p.T = T;
  p.E = E;
  p.k = k;
  p.fn = desc.score_function;
  p.renormalize = desc.renormalize;
  p.want_aux = losses != nullptr && desc.aux_loss_coeff != 0.f;
  p.want_z = losses != nullptr && desc.z_loss_coeff != 0.f;
  p.logits = logits;
  p.ids = ids;
  p.g = g;
  p.part_p = part_p;
  p.part_c = part_c;
  p.part_z = part_z;
  if (blocks > 0) {
    const size_t smem = size_t(kRouterWarps) * E * (sizeof(float) + sizeof(int32_t));
    const int per_lane = (E + 31) / 32;
    const auto launch = [&](auto kernel) {
      kernel<<<blocks, kRouterWarps * 32, smem, stream>>>(p);
    };
    if (per_lane <= 1)
      launch(router_forward_kernel<1>);
    else if (per_lane <= 2)
      launch(router_forward_kernel<2>);
    else if (per_lane <= 4)
      launch(router_forward_kernel<4>);
    else if (per_lane <= 8)
      launch(router_forward_kernel<8>);
    else if (per_lane <= 16)
      launch(router_forward_kernel<16>);
    else
      launch(router_forward_kernel<32>);  // E <= MOEBLAZE_MAX_EXPERTS = 1024
    check_launch("router_forward_kernel");
  }
  if (expert_counts || losses) {
    router_reduce_kernel<<<1, kReduceThreads, 0, stream>>>(T, E, k, blocks, part_p, part_c, part_z,
                                                           expert_counts, losses,
                                                           desc.aux_loss_coeff, desc.z_loss_coeff);
    check_launch("router_reduce_kernel");
  }
}

void router_backward(const LayerDesc& desc, int64_t T, const float* logits, const int32_t* ids,
                     const float* dg, const float* d_losses, float* d_logits, Carver& ws, bool run,
                     cudaStream_t stream) {
  const int E = int(desc.E), k = int(desc.k);
  const bool aux = desc.aux_loss_coeff != 0.f;
  const int count_blocks = int((T + kCountTokensPerBlock - 1) / kCountTokensPerBlock);
  int32_t* part_c = aux ? ws.carve<int32_t>(sizeof(int32_t) * size_t(count_blocks) * E) : nullptr;
  int32_t* counts = aux ? ws.carve<int32_t>(sizeof(int32_t) * size_t(E)) : nullptr;
  if (!run || T == 0) return;
  if (aux) {
    count_partial_kernel<<<count_blocks, kCountThreads, sizeof(int32_t) * E, stream>>>(T, E, k, ids,
                                                                                       part_c);
    check_launch("count_partial_kernel");
    count_reduce_kernel<<<blocks_for(E, 256), 256, 0, stream>>>(E, count_blocks, part_c, counts);
    check_launch("count_reduce_kernel");
  }
  RouterBwdParams p;
  p.T = T;
  p.E = E;
  p.k = k;
  p.fn = desc.score_function;
  p.renormalize = desc.renormalize;
  p.aux_coeff = desc.aux_loss_coeff;
  p.z_coeff = desc.z_loss_coeff;
  p.logits = logits;
  p.ids = ids;
  p.dg = dg;
  p.d_losses = d_losses;
  p.counts = counts;
  p.d_logits = d_logits;
  router_backward_kernel<<<blocks_for(T, 8), 256, 0, stream>>>(p);
  check_launch("router_backward_kernel");
}

}  // namespace cuda
}  // namespace moeblaze
