// The router's projection in the whole-layer calls: logits = x . w_router^T, and its backward
// dx += d_logits . w_router, dw_router (= or +=) d_logits^T . x. Logits live in the routing dtype.
#include "cpu/cpu_kernels.hpp"

namespace moeblaze {
namespace cpu {

namespace {

template <typename S>
void router_project_forward_typed(const LayerDesc& desc, const RouterProjectForwardCall& call,
                                  ThreadPool& pool) {
  using Acc = acc_t<S>;
  const int64_t d = desc.d;
  const int64_t E = desc.E;
  const S* x = static_cast<const S*>(call.x);                // [T, d]
  const S* w_router = static_cast<const S*>(call.w_router);  // [E, d]
  Acc* logits = static_cast<Acc*>(call.logits);              // [T, E] routing dtype
  pool.parallel_for(call.T, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t e = 0; e < E; ++e) logits[t * E + e] = dot<Acc>(x + t * d, w_router + e * d, d);
    }
  });
}

template <typename S>
void router_project_backward_typed(const LayerDesc& desc, const RouterProjectBackwardCall& call,
                                   ThreadPool& pool) {
  using Acc = acc_t<S>;
  const int64_t T = call.T;
  const int64_t d = desc.d;
  const int64_t E = desc.E;
  const Acc* d_logits = static_cast<const Acc*>(call.d_logits);  // [T, E] routing dtype
  const S* x = static_cast<const S*>(call.x);                    // [T, d]
  const S* w_router = static_cast<const S*>(call.w_router);      // [E, d]

  if (call.dx) {
    S* dx = static_cast<S*>(call.dx);  // [T, d], in/out
    pool.parallel_for(T, [&](int64_t begin, int64_t end) {
      Acc acc[kTile];
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t c0 = 0; c0 < d; c0 += kTile) {
          const int64_t width = std::min(kTile, d - c0);
          std::fill(acc, acc + width, Acc(0));
          for (int64_t e = 0; e < E; ++e) {
            const Acc scale = d_logits[t * E + e];
            const S* w_row = w_router + e * d + c0;
            for (int64_t c = 0; c < width; ++c) acc[c] += scale * Acc(to_acc(w_row[c]));
          }
          for (int64_t c = 0; c < width; ++c) store(dx + t * d + c0 + c, acc[c], true);
        }
      }
    });
  }

  if (call.dw_router) {
    // One group holding every token: dw_router[e][c] = sum_t d_logits[t, e] * x[t, c].
    const int32_t offsets[2] = {0, int32_t(T)};
    grouped_outer_product<S, Acc>(
        pool, 1, offsets, E, d, [&](int64_t t, int64_t e) { return d_logits[t * E + e]; },
        [&](int64_t t) { return x + t * d; }, static_cast<S*>(call.dw_router),
        call.accumulate_wgrad);
  }
}

}  // namespace

void router_project_forward(const LayerDesc& desc, const RouterProjectForwardCall& call,
                            ThreadPool& pool) {
  dispatch_storage(
      desc.dtype, [&](auto tag) { router_project_forward_typed<decltype(tag)>(desc, call, pool); });
}

void router_project_backward(const LayerDesc& desc, const RouterProjectBackwardCall& call,
                             ThreadPool& pool) {
  dispatch_storage(desc.dtype, [&](auto tag) {
    router_project_backward_typed<decltype(tag)>(desc, call, pool);
  });
}

}  // namespace cpu
}  // namespace moeblaze
