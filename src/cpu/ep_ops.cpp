// The CPU backend's operations for expert parallelism (Backend's row movement and loss shares):
// host memory, plain loops. The loss arithmetic uses the CPU router's own per-token functions
// (cpu/router_math.hpp) in the router's order, so that with one rank the loss shares and their
// gradients are bitwise the router's own, and with several ranks every token's d_logits is
// bitwise the one-device value (the global counts and token count are the same numbers).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/status.hpp"
#include "cpu/cpu_kernels.hpp"
#include "cpu/router_math.hpp"

namespace moeblaze {
namespace cpu {
namespace {

// The score the aux loss balances: softmax, or sigmoid normalised over the experts.
template <typename R>
R balance_scores(const LayerDesc& desc, const R* row, R* balance) {
  const int64_t E = desc.E;
  const R lse = softmax(row, E, balance);
  if (desc.score_function == ScoreFunction::Sigmoid) {
    sigmoid_scores(row, E, balance);
    R sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += balance[e];
    for (int64_t e = 0; e < E; ++e) balance[e] = balance[e] / sum;
  }
  return lse;
}

template <typename R>
void loss_forward_typed(const LayerDesc& desc, const LossShareCall& call, R* losses) {
  const int64_t T = call.T;
  const int64_t E = desc.E;
  const int64_t k = desc.k;
  const R* logits = static_cast<const R*>(call.logits);
  losses[0] = 0;
  losses[1] = 0;
  const int64_t global_T = call.global_tokens;
  if (global_T == 0) return;
  // One pass over the tokens; every sum still runs over t ascending from 0, as the router's.
  R* balance = static_cast<R*>(call.scratch);  // [E]: one token's scores
  R* score_sum = balance + E;                  // [E]: sum over t of the scores
  std::fill(score_sum, score_sum + E, R(0));
  R lse_square_sum = 0;
  for (int64_t t = 0; t < T; ++t) {
    const R lse = balance_scores(desc, logits + t * E, balance);
    for (int64_t e = 0; e < E; ++e) score_sum[e] += balance[e];
    if (desc.z_loss_coeff != 0.0f) check_z_loss_term(desc.z_loss_coeff, lse, t);
    lse_square_sum += lse * lse;
  }
  if (desc.aux_loss_coeff != 0.0f) {
    R total = 0;
    for (int64_t e = 0; e < E; ++e) {
      const R mean_score = score_sum[e] / R(global_T);
      total += (R(call.global_counts[e]) / R(global_T * k)) * mean_score;
    }
    losses[0] = R(desc.aux_loss_coeff) * R(E) * total;
  }
  if (desc.z_loss_coeff != 0.0f) {
    losses[1] = R(desc.z_loss_coeff) * lse_square_sum / R(global_T);
    MB_REQUIRE(std::isfinite(losses[1]), MOEBLAZE_ERR_NON_FINITE,
               "losses[1]: this rank's z-loss share overflows the routing dtype (the sum of the "
               "squared logsumexps does); scale the logits down or set z_loss_coeff to 0");
  }
  MB_REQUIRE(std::isfinite(losses[0]), MOEBLAZE_ERR_NON_FINITE,
             "losses[0]: the aux loss share overflows the routing dtype (aux_loss_coeff = %g is "
             "too large)",
             double(desc.aux_loss_coeff));
}

template <typename R>
void loss_backward_typed(const LayerDesc& desc, const LossShareCall& call, const R* d_losses,
                         R* d_logits) {
  const int64_t T = call.T;
  const int64_t E = desc.E;
  const int64_t k = desc.k;
  const int64_t global_T = call.global_tokens;
  const R* logits = static_cast<const R*>(call.logits);
  const bool with_aux = global_T > 0 && desc.aux_loss_coeff != 0.0f;
  const bool with_z = global_T > 0 && desc.z_loss_coeff != 0.0f;
  if (!with_aux && !with_z) return;
  const R d_aux = d_losses ? d_losses[0] : R(1);
  const R d_z = d_losses ? d_losses[1] : R(1);
  R* probs = static_cast<R*>(call.scratch);  // [E]
  if (with_z) {
    for (int64_t t = 0; t < T; ++t) {
      check_z_loss_term(desc.z_loss_coeff, logsumexp(logits + t * E, E), t);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    const R* row = logits + t * E;
    R* out = d_logits + t * E;
    // As the router's backward: probs = softmax (softmax score functions) or the sigmoid scores
    // up to a common factor (SIGMOID).
    if (desc.score_function == ScoreFunction::Sigmoid) {
      sigmoid_scores(row, E, probs);
    } else {
      softmax(row, E, probs);
    }
    if (with_aux) {
      const R scale = d_aux * R(desc.aux_loss_coeff) * R(E) / (R(global_T) * R(global_T * k));
      const int32_t* counts = call.global_counts;
      if (desc.score_function == ScoreFunction::Sigmoid) {
        R sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += probs[e];
        R q_dot_w = 0;
        for (int64_t e = 0; e < E; ++e) {
          q_dot_w += (probs[e] / sum) * (scale * R(counts[e]));
        }
        for (int64_t e = 0; e < E; ++e) {
          const R w = scale * R(counts[e]);
          out[e] += (w - q_dot_w) / sum * probs[e] * (R(1) - sigmoid(row[e]));
        }
      } else {
        R q_dot_w = 0;
        for (int64_t e = 0; e < E; ++e) q_dot_w += probs[e] * (scale * R(counts[e]));
        for (int64_t e = 0; e < E; ++e) {
          out[e] += probs[e] * (scale * R(counts[e]) - q_dot_w);
        }
      }
    }
    if (with_z) {
      const R lse = desc.score_function == ScoreFunction::Sigmoid ? softmax(row, E, probs)
                                                                  : logsumexp(row, E);
      const R scale = d_z * R(desc.z_loss_coeff) * R(2) * lse / R(global_T);
      for (int64_t e = 0; e < E; ++e) out[e] += scale * probs[e];
    }
  }
}

}  // namespace

void ep_gather_rows(void* dst, const void* src, const int32_t* index, int64_t n, int64_t index_rows,
                    size_t row_bytes) {
  auto* out = static_cast<unsigned char*>(dst);
  const auto* in = static_cast<const unsigned char*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t row = index[i];
    if (row >= 0 && row < index_rows) {
      std::memcpy(out + size_t(i) * row_bytes, in + size_t(row) * row_bytes, row_bytes);
    } else {
      std::memset(out + size_t(i) * row_bytes, 0, row_bytes);
    }
  }
}

void ep_scatter_rows(void* dst, const void* src, const int32_t* index, int64_t n,
                     int64_t index_rows, size_t row_bytes) {
  auto* out = static_cast<unsigned char*>(dst);
  const auto* in = static_cast<const unsigned char*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t row = index[i];
    if (row < 0 || row >= index_rows) continue;
    std::memcpy(out + size_t(row) * row_bytes, in + size_t(i) * row_bytes, row_bytes);
  }
}

void ep_combine_rows(Dtype dtype, void* out, const void* rows, const int32_t* index, int64_t T,
                     int64_t k, int64_t d, int64_t index_rows) {
  dispatch_storage(dtype, [&](auto tag) {
    using S = decltype(tag);
    using Acc = decltype(to_acc(S{}));
    S* y = static_cast<S*>(out);
    const S* in = static_cast<const S*>(rows);
    // The accumulators of a chunk of columns live on the stack (no allocation); every output
    // is still its own sum over j ascending from 0.
    constexpr int64_t kChunk = 256;
    Acc acc[kChunk];
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c0 = 0; c0 < d; c0 += kChunk) {
        const int64_t width = std::min(kChunk, d - c0);
        std::fill(acc, acc + width, Acc(0));
        for (int64_t j = 0; j < k; ++j) {
          const int32_t r = index[t * k + j];
          if (r < 0 || r >= index_rows) continue;
          const S* row = in + int64_t(r) * d + c0;
          for (int64_t c = 0; c < width; ++c) acc[c] += Acc(to_acc(row[c]));
        }
        for (int64_t c = 0; c < width; ++c) y[t * d + c0 + c] = from_acc<S>(acc[c]);
      }
    }
  });
}

void ep_local_expert_ids(const int32_t* table, int64_t W, int64_t E, int64_t expert_begin,
                         int64_t local_experts, int64_t R, int32_t* local_ids) {
  int64_t row = 0;
  for (int64_t s = 0; s < W; ++s) {
    for (int64_t e = 0; e < local_experts; ++e) {
      const int64_t count = table[s * E + expert_begin + e];
      MB_REQUIRE(count >= 0 && row + count <= R, MOEBLAZE_ERR_INTERNAL,
                 "EP: the count table holds more received rows than the %lld expected",
                 (long long)R);
      for (int64_t i = 0; i < count; ++i) local_ids[row++] = int32_t(e);
    }
  }
  MB_REQUIRE(row == R, MOEBLAZE_ERR_INTERNAL,
             "EP: the count table holds %lld received rows, %lld expected", (long long)row,
             (long long)R);
}

void ep_global_counts(const int32_t* table, int64_t W, int64_t E, int32_t* counts) {
  for (int64_t e = 0; e < E; ++e) {
    int64_t sum = 0;
    for (int64_t s = 0; s < W; ++s) sum += table[s * E + e];
    counts[e] = int32_t(sum);
  }
}

void ep_loss_shares_forward(const LayerDesc& desc, const LossShareCall& call, void* losses) {
  dispatch_routing(desc.dtype, [&](auto tag) {
    using R = decltype(tag);
    loss_forward_typed<R>(desc, call, static_cast<R*>(losses));
  });
}

void ep_loss_shares_backward(const LayerDesc& desc, const LossShareCall& call, const void* d_losses,
                             void* d_logits) {
  dispatch_routing(desc.dtype, [&](auto tag) {
    using R = decltype(tag);
    loss_backward_typed<R>(desc, call, static_cast<const R*>(d_losses), static_cast<R*>(d_logits));
  });
}

}  // namespace cpu
}  // namespace moeblaze
