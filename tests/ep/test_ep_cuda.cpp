// Expert parallelism on the CUDA backend, against the one-GPU layer on the global batch:
//   - world size 1 over NCCL (a one-device communicator from ncclCommInitAll), when the library and
//     this suite are built with NCCL (otherwise: the NCCL transport must answer NOT_SUPPORTED);
//   - world size 2 over the LOCAL transport (two threads; GPUs 0 and 1 when there are two, else
//     both ranks on GPU 0), each rank on its own non-blocking stream.
// Every quantity is compared with the tolerance table; each step runs twice and must repeat
// bitwise. Which quantities are also bitwise equal to the one-GPU layer is printed (the design
// expects dg and the expert weight gradients, and y in F32 unless the GPU kernels fuse g*y2 into
// the k-way sum with FMA); MOEBLAZE_TEST_EP_REQUIRE_BITWISE=1 turns those reports into checks.
// Without a GPU every case prints "SKIPPED" and the suite exits 77 (CTest: Skipped). Run with
// NCCL_NVLS_ENABLE=0 (CTest sets it): EP uses point-to-point NCCL only, never NVLink multicast.
#include <cstdlib>
#include <thread>

#include "ep/ep_support.hpp"
#include "support/gpu_support.hpp"

#if defined(MOEBLAZE_TESTS_WITH_CUDA)
#include <cuda_runtime.h>
#endif
#if defined(MOEBLAZE_TESTS_WITH_NCCL)
#include <nccl.h>
#endif

using namespace mbtest;
using namespace mbtest::ep;

#if defined(MOEBLAZE_TESTS_WITH_CUDA)
namespace {

bool require_bitwise() {
  const char* env = std::getenv("MOEBLAZE_TEST_EP_REQUIRE_BITWISE");
  return env && env[0] == '1';
}

// A device allocation holding a copy of a host tensor (or `bytes` of scratch); not thread-safe
// for doctest assertions, so rank threads use the status-returning helpers below.
class DevBuf {
 public:
  DevBuf() = default;
  ~DevBuf() {
    if (ptr_) cudaFree(ptr_);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  cudaError_t alloc(size_t bytes) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = bytes;
    return bytes ? cudaMalloc(&ptr_, bytes) : cudaSuccess;
  }
  cudaError_t upload(const void* host, size_t bytes) {
    cudaError_t e = alloc(bytes);
    if (e == cudaSuccess && bytes) e = cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice);
    return e;
  }
  cudaError_t upload(const HostTensor& t) { return upload(t.data(), t.bytes()); }
  cudaError_t download(HostTensor& t) const {
    return t.bytes() ? cudaMemcpy(t.data(), ptr_, t.bytes(), cudaMemcpyDeviceToHost) : cudaSuccess;
  }
  cudaError_t download(void* host, size_t bytes) const {
    return bytes ? cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost) : cudaSuccess;
  }
  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The one-GPU layer on the global batch (device 0): the reference of every EP result.
Global gpu_reference(const EpCase& c, const Global& inputs) {
  Global g = inputs;
  const int64_t T = c.global_tokens();
  const int64_t E = c.E, k = c.k, d = c.d;
  const int32_t rdtype = routing_dtype(c.dtype);
  Context context(MOEBLAZE_BACKEND_CUDA, 0);
  Layer layer(context, c.config());
  DevBuf x, dy, w_router, w_gate, w_up, w_down, d_losses, y, dx, dw_router, dw_gate, dw_up, dw_down,
      logits, ids, gg, counts, losses, d_logits, saved, ws, dg;
  CUDA_OK(x.upload(g.x));
  CUDA_OK(dy.upload(g.dy));
  CUDA_OK(w_router.upload(g.w_router));
  CUDA_OK(w_gate.upload(g.w_gate));
  CUDA_OK(w_up.upload(g.w_up));
  CUDA_OK(w_down.upload(g.w_down));
  CUDA_OK(d_losses.upload(g.d_losses));
  g.y.reset(c.dtype, {T, d});
  g.dx.reset(c.dtype, {T, d});
  g.dw_router.reset(c.dtype, {E, d});
  g.dw_gate.reset(c.dtype, {E, c.h, d});
  g.dw_up.reset(c.dtype, {E, c.h, d});
  g.dw_down.reset(c.dtype, {E, d, c.h});
  g.logits.reset(rdtype, {T, E});
  g.g.reset(rdtype, {T, k});
  g.losses.reset(rdtype, {2});
  g.d_logits.reset(rdtype, {T, E});
  g.dg.reset(rdtype, {T, k});
  g.ids.assign(size_t(T * k), -1);
  g.counts.assign(size_t(E), -1);
  for (DevBuf* b : {&y, &dx}) CUDA_OK(b->alloc(g.y.bytes() + 16));
  CUDA_OK(dw_router.alloc(g.dw_router.bytes()));
  CUDA_OK(dw_gate.alloc(g.dw_gate.bytes()));
  CUDA_OK(dw_up.alloc(g.dw_up.bytes()));
  CUDA_OK(dw_down.alloc(g.dw_down.bytes()));
  CUDA_OK(logits.alloc(g.logits.bytes() + 16));
  CUDA_OK(ids.alloc(g.ids.size() * 4 + 16));
  CUDA_OK(gg.alloc(g.g.bytes() + 16));
  CUDA_OK(counts.alloc(size_t(E) * 4));
  CUDA_OK(losses.alloc(g.losses.bytes()));
  CUDA_OK(d_logits.alloc(g.d_logits.bytes() + 16));
  CUDA_OK(dg.alloc(g.dg.bytes() + 16));
  CUDA_OK(saved.alloc(layer.saved_size(MOEBLAZE_PASS_LAYER_FORWARD, T)));
  size_t ws_bytes = 0;
  for (int32_t pass : {MOEBLAZE_PASS_LAYER_FORWARD, MOEBLAZE_PASS_LAYER_BACKWARD,
                       MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_EXPERTS_BACKWARD}) {
    ws_bytes = std::max(ws_bytes, layer.workspace_size(pass, T));
  }
  CUDA_OK(ws.alloc(ws_bytes));

  moeblaze_forward_args_t fa;
  MB_CHECK(moeblaze_forward_args_init(&fa, sizeof fa));
  fa.num_tokens = T;
  fa.x = x.get();
  fa.w_router = w_router.get();
  fa.w_gate = w_gate.get();
  fa.w_up = c.gated() ? w_up.get() : nullptr;
  fa.w_down = w_down.get();
  fa.y = y.get();
  fa.logits_out = logits.get();
  fa.ids_out = static_cast<int32_t*>(ids.get());
  fa.g_out = gg.get();
  fa.expert_counts = static_cast<int32_t*>(counts.get());
  fa.losses = losses.get();
  fa.saved = saved.get();
  fa.saved_bytes = saved.size();
  fa.workspace = ws.get();
  fa.workspace_bytes = ws.size();
  MB_CHECK(moeblaze_layer_forward(layer.get(), &fa, nullptr));
  moeblaze_backward_args_t ba;
  MB_CHECK(moeblaze_backward_args_init(&ba, sizeof ba));
  ba.num_tokens = T;
  ba.dy = dy.get();
  ba.d_losses = d_losses.get();
  ba.x = x.get();
  ba.w_router = w_router.get();
  ba.w_gate = w_gate.get();
  ba.w_up = c.gated() ? w_up.get() : nullptr;
  ba.w_down = w_down.get();
  ba.saved = saved.get();
  ba.saved_bytes = saved.size();
  ba.dx = dx.get();
  ba.dw_router = dw_router.get();
  ba.dw_gate = dw_gate.get();
  ba.dw_up = c.gated() ? dw_up.get() : nullptr;
  ba.dw_down = dw_down.get();
  ba.d_logits = d_logits.get();
  ba.workspace = ws.get();
  ba.workspace_bytes = ws.size();
  MB_CHECK(moeblaze_layer_backward(layer.get(), &ba, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(y.download(g.y));
  CUDA_OK(dx.download(g.dx));
  CUDA_OK(dw_router.download(g.dw_router));
  CUDA_OK(dw_gate.download(g.dw_gate));
  CUDA_OK(dw_up.download(g.dw_up));
  CUDA_OK(dw_down.download(g.dw_down));
  CUDA_OK(logits.download(g.logits));
  CUDA_OK(gg.download(g.g));
  CUDA_OK(losses.download(g.losses));
  CUDA_OK(d_logits.download(g.d_logits));
  CUDA_OK(ids.download(g.ids.data(), g.ids.size() * 4));
  CUDA_OK(counts.download(g.counts.data(), g.counts.size() * 4));

  // dg: the experts backward with the router's ids and g, as the layer backward computes it.
  CUDA_OK(saved.alloc(layer.saved_size(MOEBLAZE_PASS_EXPERTS_FORWARD, T)));
  fa.ids = static_cast<const int32_t*>(ids.get());
  fa.g = gg.get();
  fa.saved = saved.get();
  fa.saved_bytes = saved.size();
  MB_CHECK(moeblaze_experts_forward(layer.get(), &fa, nullptr));
  ba.ids = static_cast<const int32_t*>(ids.get());
  ba.g = gg.get();
  ba.saved = saved.get();
  ba.saved_bytes = saved.size();
  ba.dx = nullptr;
  ba.dw_router = ba.dw_gate = ba.dw_up = ba.dw_down = ba.d_logits = nullptr;
  ba.dg = dg.get();
  MB_CHECK(moeblaze_experts_backward(layer.get(), &ba, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(dg.download(g.dg));
  return g;
}

struct RankSetup {
  int32_t transport = MOEBLAZE_EP_TRANSPORT_LOCAL;
  void* communicator = nullptr;
  int32_t device = 0;
};

// One rank's two steps on the GPU; any failure is recorded in the results (no doctest asserts on
// rank threads).
void run_rank(const EpCase& c, const Global& g, RankSetup setup, int32_t rank,
              std::vector<RankResult>* out) {
  const int32_t W = c.world();
  const int64_t T = c.tokens[size_t(rank)];
  const int64_t E = c.E, k = c.k, d = c.d, h = c.h;
  const int32_t rdtype = routing_dtype(c.dtype);
  auto fail_with = [&](moeblaze_status_t status, const std::string& what) {
    RankResult failed;
    failed.status = status == MOEBLAZE_OK ? MOEBLAZE_ERR_CUDA : status;
    failed.error = what + (status == MOEBLAZE_OK ? std::string() : ": " + status_text(status));
    for (auto& r : *out) r = failed;
  };
#define RANK_CHECK(call)                                \
  do {                                                  \
    const moeblaze_status_t s_ = (call);                \
    if (s_ != MOEBLAZE_OK) return fail_with(s_, #call); \
  } while (0)
#define RANK_CUDA(call)                                                                \
  do {                                                                                 \
    const cudaError_t e_ = (call);                                                     \
    if (e_ != cudaSuccess)                                                             \
      return fail_with(MOEBLAZE_OK, #call ": " + std::string(cudaGetErrorString(e_))); \
  } while (0)

  RANK_CUDA(cudaSetDevice(setup.device));
  cudaStream_t stream = nullptr;
  RANK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } stream_guard{stream};
  moeblaze_context_t context = nullptr;
  RANK_CHECK(moeblaze_context_create(&context, MOEBLAZE_BACKEND_CUDA, setup.device));
  struct ContextGuard {
    moeblaze_context_t c;
    ~ContextGuard() { moeblaze_context_destroy(c); }
  } context_guard{context};
  const moeblaze_layer_config_t config = c.config();
  moeblaze_ep_config_t ep;
  RANK_CHECK(moeblaze_ep_config_init(&ep, sizeof ep));
  ep.transport = setup.transport;
  ep.rank = rank;
  ep.world_size = W;
  ep.communicator = setup.communicator;
  moeblaze_ep_layer_t layer = nullptr;
  RANK_CHECK(moeblaze_ep_layer_create(&layer, context, &config, &ep));
  struct LayerGuard {
    moeblaze_ep_layer_t l;
    ~LayerGuard() { moeblaze_ep_layer_destroy(l); }
  } layer_guard{layer};
  int64_t begin = -1, end = -1;
  RANK_CHECK(moeblaze_ep_layer_get_experts(layer, &begin, &end));
  const int64_t Er = end - begin, t0 = c.token_begin(rank);
  DevBuf x, dy, w_router, w_gate, w_up, w_down, d_losses;
  RANK_CUDA(x.upload(slice_rows(g.x, t0, T, d, {T, d})));
  RANK_CUDA(dy.upload(slice_rows(g.dy, t0, T, d, {T, d})));
  RANK_CUDA(w_router.upload(g.w_router));
  RANK_CUDA(w_gate.upload(slice_rows(g.w_gate, begin, Er, h * d, {Er, h, d})));
  RANK_CUDA(w_up.upload(slice_rows(g.w_up, begin, Er, h * d, {Er, h, d})));
  RANK_CUDA(w_down.upload(slice_rows(g.w_down, begin, Er, d * h, {Er, d, h})));
  RANK_CUDA(d_losses.upload(g.d_losses));
  size_t exchange_bytes = 0, home_bytes = 0, begin_ws = 0;
  RANK_CHECK(moeblaze_ep_layer_exchange_size(layer, &exchange_bytes));
  RANK_CHECK(moeblaze_ep_layer_saved_size(layer, MOEBLAZE_EP_SAVED_HOME, T, 0, &home_bytes));
  RANK_CHECK(
      moeblaze_ep_layer_workspace_size(layer, MOEBLAZE_EP_PASS_FORWARD_BEGIN, T, 0, &begin_ws));

  for (size_t step = 0; step < out->size(); ++step) {
    RankResult r;
    r.expert_begin = begin;
    r.expert_end = end;
    r.y.reset(c.dtype, {T, d});
    r.dx.reset(c.dtype, {T, d});
    r.dw_router.reset(c.dtype, {E, d});
    r.dw_gate.reset(c.dtype, {Er, h, d});
    r.dw_up.reset(c.dtype, {Er, h, d});
    r.dw_down.reset(c.dtype, {Er, d, h});
    r.dg.reset(rdtype, {T, k});
    r.d_logits.reset(rdtype, {T, E});
    r.logits.reset(rdtype, {T, E});
    r.g.reset(rdtype, {T, k});
    r.losses.reset(rdtype, {2});
    r.ids.assign(size_t(T * k), -1);
    r.counts.assign(size_t(E), -1);
    DevBuf y, dx, dw_router, dw_gate, dw_up, dw_down, dg, d_logits, logits, gg, ids, counts, losses,
        home, expert, ws;
    RANK_CUDA(y.alloc(r.y.bytes() + 16));
    RANK_CUDA(dx.alloc(r.dx.bytes() + 16));
    RANK_CUDA(dw_router.alloc(r.dw_router.bytes()));
    RANK_CUDA(dw_gate.alloc(r.dw_gate.bytes()));
    RANK_CUDA(dw_up.alloc(r.dw_up.bytes()));
    RANK_CUDA(dw_down.alloc(r.dw_down.bytes()));
    RANK_CUDA(dg.alloc(r.dg.bytes() + 16));
    RANK_CUDA(d_logits.alloc(r.d_logits.bytes() + 16));
    RANK_CUDA(logits.alloc(r.logits.bytes() + 16));
    RANK_CUDA(gg.alloc(r.g.bytes() + 16));
    RANK_CUDA(ids.alloc(r.ids.size() * 4 + 16));
    RANK_CUDA(counts.alloc(size_t(E) * 4));
    RANK_CUDA(losses.alloc(r.losses.bytes()));
    RANK_CUDA(home.alloc(home_bytes));
    RANK_CUDA(ws.alloc(begin_ws));
    std::vector<unsigned char> exchange_storage(exchange_bytes + 8);
    void* exchange = exchange_storage.data();  // std::vector storage is 8-byte aligned

    moeblaze_ep_forward_args_t fa;
    RANK_CHECK(moeblaze_ep_forward_args_init(&fa, sizeof fa));
    fa.num_tokens = T;
    fa.x = x.get();
    fa.w_router = w_router.get();
    fa.w_gate = w_gate.get();
    fa.w_up = c.gated() ? w_up.get() : nullptr;
    fa.w_down = w_down.get();
    fa.y = y.get();
    fa.logits_out = logits.get();
    fa.ids_out = static_cast<int32_t*>(ids.get());
    fa.g_out = gg.get();
    fa.expert_counts = static_cast<int32_t*>(counts.get());
    fa.losses = losses.get();
    fa.home_saved = home.get();
    fa.home_saved_bytes = home.size();
    fa.workspace = ws.get();
    fa.workspace_bytes = ws.size();
    int64_t R = -1;
    RANK_CHECK(moeblaze_ep_forward_begin(layer, &fa, exchange, exchange_bytes, &R, stream));
    r.recv_rows = R;
    size_t expert_bytes = 0, finish_ws = 0, backward_ws = 0;
    RANK_CHECK(moeblaze_ep_layer_saved_size(layer, MOEBLAZE_EP_SAVED_EXPERT, T, R, &expert_bytes));
    RANK_CHECK(
        moeblaze_ep_layer_workspace_size(layer, MOEBLAZE_EP_PASS_FORWARD_FINISH, T, R, &finish_ws));
    RANK_CHECK(moeblaze_ep_layer_workspace_size_with_flags(layer, MOEBLAZE_EP_PASS_BACKWARD, T, R,
                                                           c.backward_flags, &backward_ws));
    RANK_CUDA(expert.alloc(expert_bytes));
    RANK_CUDA(ws.alloc(std::max(finish_ws, backward_ws)));
    fa.expert_saved = expert.get();
    fa.expert_saved_bytes = expert.size();
    fa.workspace = ws.get();
    fa.workspace_bytes = ws.size();
    RANK_CHECK(moeblaze_ep_forward_finish(layer, &fa, exchange, exchange_bytes, stream));
    moeblaze_ep_backward_args_t ba;
    RANK_CHECK(moeblaze_ep_backward_args_init(&ba, sizeof ba));
    ba.num_tokens = T;
    ba.flags = c.backward_flags;
    ba.dy = dy.get();
    ba.d_losses = d_losses.get();
    ba.x = x.get();
    ba.w_router = w_router.get();
    ba.w_gate = w_gate.get();
    ba.w_up = c.gated() ? w_up.get() : nullptr;
    ba.w_down = w_down.get();
    ba.home_saved = home.get();
    ba.home_saved_bytes = home.size();
    ba.expert_saved = expert.get();
    ba.expert_saved_bytes = expert.size();
    ba.dx = dx.get();
    ba.dw_router = dw_router.get();
    ba.dw_gate = dw_gate.get();
    ba.dw_up = c.gated() ? dw_up.get() : nullptr;
    ba.dw_down = dw_down.get();
    ba.dg = dg.get();
    ba.d_logits = d_logits.get();
    ba.workspace = ws.get();
    ba.workspace_bytes = ws.size();
    RANK_CHECK(moeblaze_ep_backward(layer, &ba, exchange, exchange_bytes, stream));
    RANK_CUDA(cudaStreamSynchronize(stream));
    RANK_CUDA(y.download(r.y));
    RANK_CUDA(dx.download(r.dx));
    RANK_CUDA(dw_router.download(r.dw_router));
    RANK_CUDA(dw_gate.download(r.dw_gate));
    RANK_CUDA(dw_up.download(r.dw_up));
    RANK_CUDA(dw_down.download(r.dw_down));
    RANK_CUDA(dg.download(r.dg));
    RANK_CUDA(d_logits.download(r.d_logits));
    RANK_CUDA(logits.download(r.logits));
    RANK_CUDA(gg.download(r.g));
    RANK_CUDA(losses.download(r.losses));
    RANK_CUDA(ids.download(r.ids.data(), r.ids.size() * 4));
    RANK_CUDA(counts.download(r.counts.data(), r.counts.size() * 4));
    (*out)[step] = std::move(r);
  }
#undef RANK_CHECK
#undef RANK_CUDA
}

void report_bitwise(const std::string& name, const HostTensor& got, const HostTensor& ref,
                    int64_t elem_begin, std::vector<std::string>* not_bitwise) {
  const size_t es = dtype_bytes(got.dtype());
  const bool same =
      got.bytes() == 0 ||
      std::memcmp(got.data(), static_cast<const unsigned char*>(ref.data()) + elem_begin * es,
                  got.bytes()) == 0;
  if (!same) not_bitwise->push_back(name);
  if (!same && require_bitwise()) check_bitwise(name, got, ref, elem_begin);
}

void check_against_gpu(const EpCase& c, const Global& ref,
                       const std::vector<std::vector<RankResult>>& runs) {
  const int32_t W = c.world();
  const int64_t E = c.E, k = c.k, d = c.d, h = c.h;
  std::vector<std::string> not_bitwise;
  std::vector<double> dw_router_sum(size_t(E * d), 0.0);
  for (int32_t rank = 0; rank < W; ++rank) {
    const RankResult& r = runs[0][size_t(rank)];
    REQUIRE_MESSAGE(r.status == MOEBLAZE_OK, "rank " << rank << ": " << r.error);
    REQUIRE_MESSAGE(runs[1][size_t(rank)].status == MOEBLAZE_OK,
                    "rank " << rank << ": " << runs[1][size_t(rank)].error);
    const std::string who = "rank " + std::to_string(rank) + ": ";
    const int64_t T = c.tokens[size_t(rank)], t0 = c.token_begin(rank);
    check_bitwise(who + "logits", r.logits, ref.logits, t0 * E);
    check_bitwise(who + "g", r.g, ref.g, t0 * k);
    CHECK(std::equal(r.ids.begin(), r.ids.end(), ref.ids.begin() + t0 * k));
    CHECK(r.counts == ref.counts);
    auto tol = [&](int64_t length, const std::vector<double>& values) {
      return tolerance_for(c.dtype, length, std::max(1.0, max_abs(values)));
    };
    const std::vector<double> y_ref = slice_rows(ref.y, t0, T, d, {T, d}).to_vector();
    const std::vector<double> dx_ref = slice_rows(ref.dx, t0, T, d, {T, d}).to_vector();
    compare(who + "y", r.y, y_ref, tol(k * h, y_ref));
    compare(who + "dx", r.dx, dx_ref, tol(k * h + E, dx_ref));
    const int64_t Er = r.expert_end - r.expert_begin;
    const std::vector<double> dw_gate_ref =
        slice_rows(ref.dw_gate, r.expert_begin, Er, h * d, {Er, h, d}).to_vector();
    const std::vector<double> dw_up_ref =
        slice_rows(ref.dw_up, r.expert_begin, Er, h * d, {Er, h, d}).to_vector();
    const std::vector<double> dw_down_ref =
        slice_rows(ref.dw_down, r.expert_begin, Er, d * h, {Er, d, h}).to_vector();
    const int64_t rows = c.global_tokens() * k;
    compare(who + "dw_gate", r.dw_gate, dw_gate_ref, tol(rows, dw_gate_ref));
    if (c.gated()) compare(who + "dw_up", r.dw_up, dw_up_ref, tol(rows, dw_up_ref));
    compare(who + "dw_down", r.dw_down, dw_down_ref, tol(rows, dw_down_ref));
    const std::vector<double> dg_ref = slice_rows(ref.dg, t0, T, k, {T, k}).to_vector();
    compare(who + "dg", r.dg, dg_ref, tolerance_for(MOEBLAZE_DTYPE_F32, h, max_abs(dg_ref) + 1));
    // d_logits: the router's backward plus this rank's loss shares (design section 3).
    const std::vector<double> d_logits_ref = slice_rows(ref.d_logits, t0, T, E, {T, E}).to_vector();
    compare(who + "d_logits", r.d_logits, d_logits_ref, tol(k * h + E, d_logits_ref));
    report_bitwise(who + "y", r.y, ref.y, t0 * d, &not_bitwise);
    report_bitwise(who + "dg", r.dg, ref.dg, t0 * k, &not_bitwise);
    report_bitwise(who + "d_logits", r.d_logits, ref.d_logits, t0 * E, &not_bitwise);
    report_bitwise(who + "dw_gate", r.dw_gate, ref.dw_gate, r.expert_begin * h * d, &not_bitwise);
    report_bitwise(who + "dw_down", r.dw_down, ref.dw_down, r.expert_begin * d * h, &not_bitwise);
    for (int64_t i = 0; i < E * d; ++i) dw_router_sum[size_t(i)] += r.dw_router.get(i);
    const RankResult& again = runs[1][size_t(rank)];
    check_same_run(who + "y", r.y, again.y);
    check_same_run(who + "dx", r.dx, again.dx);
    check_same_run(who + "dw_router", r.dw_router, again.dw_router);
    check_same_run(who + "dw_gate", r.dw_gate, again.dw_gate);
    check_same_run(who + "dw_down", r.dw_down, again.dw_down);
    check_same_run(who + "dg", r.dg, again.dg);
    check_same_run(who + "d_logits", r.d_logits, again.d_logits);
  }
  // The ranks' loss shares add up to the one-GPU losses (aux, z).
  std::vector<double> loss_sum(2, 0.0);
  for (int32_t rank = 0; rank < W; ++rank) {
    for (int i = 0; i < 2; ++i) loss_sum[size_t(i)] += runs[0][size_t(rank)].losses.get(i);
  }
  const std::vector<double> loss_ref = ref.losses.to_vector();
  compare("sum of the ranks' loss shares", loss_sum, loss_ref,
          tolerance_for(MOEBLAZE_DTYPE_F32, c.global_tokens() * E + W,
                        std::max(1e-3, max_abs(loss_ref))));
  for (int32_t rank = 0; rank < W; ++rank) {
    check_same_run("rank " + std::to_string(rank) + ": losses", runs[0][size_t(rank)].losses,
                   runs[1][size_t(rank)].losses);
  }
  const std::vector<double> dw_router_ref = ref.dw_router.to_vector();
  compare("sum of the ranks' dw_router shares", dw_router_sum, dw_router_ref,
          tolerance_for(c.dtype, c.global_tokens() + W,
                        double(W) * std::max(1.0, max_abs(dw_router_ref))));
  std::string list;
  for (const auto& name : not_bitwise) list += " " + name;
  MESSAGE("not bitwise equal to the one-GPU layer:" << (list.empty() ? " (none)" : list));
}

void run_and_check(const EpCase& c, const std::vector<RankSetup>& setups) {
  INFO(c.describe());
  MESSAGE("case: " << c.describe());
  const Global inputs = make_global(c, false);
  const Global ref = gpu_reference(c, inputs);
  std::vector<std::vector<RankResult>> per_rank(setups.size(), std::vector<RankResult>(2));
  std::vector<std::thread> threads;
  for (size_t rank = 0; rank < setups.size(); ++rank) {
    threads.emplace_back(run_rank, std::cref(c), std::cref(inputs), setups[rank], int32_t(rank),
                         &per_rank[rank]);
  }
  for (auto& t : threads) t.join();
  std::vector<std::vector<RankResult>> runs(2, std::vector<RankResult>(setups.size()));
  for (size_t rank = 0; rank < setups.size(); ++rank) {
    for (size_t s = 0; s < 2; ++s) runs[s][rank] = per_rank[rank][s];
  }
  check_against_gpu(c, ref, runs);
}

}  // namespace
#endif  // MOEBLAZE_TESTS_WITH_CUDA

TEST_CASE("ep cuda: NCCL, world size 1 (and 2, 4, 8 when as many GPUs are visible)") {
  SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
#if defined(MOEBLAZE_TESTS_WITH_NCCL)
  int device_count = 0;
  CUDA_OK(cudaGetDeviceCount(&device_count));
  for (int32_t W : {1, 2, 4, 8}) {
    if (W > device_count) {
      MESSAGE("world size " << W << " over NCCL: SKIPPED (" << device_count << " GPU(s) visible)");
      continue;
    }
    // One process, one communicator per GPU (ncclCommInitAll), one thread per rank. At W = 1 the
    // only chunk is the own one (a device copy); W >= 2 exercises ncclSend/ncclRecv.
    std::vector<ncclComm_t> comms(static_cast<size_t>(W), nullptr);
    std::vector<int> devices(static_cast<size_t>(W));
    for (int32_t r = 0; r < W; ++r) devices[size_t(r)] = r;
    REQUIRE(ncclCommInitAll(comms.data(), W, devices.data()) == ncclSuccess);
    // Token layouts: rank 1 empty (a rank that only serves its experts), and, from W = 2,
    // every rank with tokens of its own (both directions of every exchange carry rows).
    const int layouts = W >= 2 ? 2 : 1;
    for (int32_t dtype : {MOEBLAZE_DTYPE_F32, MOEBLAZE_DTYPE_BF16}) {
      for (int layout = 0; layout < layouts; ++layout) {
        EpCase c;
        c.dtype = dtype;
        c.d = 64;
        c.h = 96;
        c.E = 8;
        c.k = 2;
        c.tokens.clear();
        for (int32_t r = 0; r < W; ++r)
          c.tokens.push_back(layout == 0 ? (r == 1 ? 0 : 37 + 5 * r) : 29 + 6 * r);
        if (layout == 1) {  // the loss shares, summed over real ranks
          c.aux = 0.01f;
          c.z = 0.001f;
        }
        c.seed = test_seed(20261210);
        std::vector<RankSetup> setups(static_cast<size_t>(W));
        for (int32_t r = 0; r < W; ++r) {
          setups[size_t(r)].transport = MOEBLAZE_EP_TRANSPORT_NCCL;
          setups[size_t(r)].communicator = comms[size_t(r)];
          setups[size_t(r)].device = r;
        }
        run_and_check(c, setups);
      }
    }
    for (ncclComm_t comm : comms) ncclCommDestroy(comm);
  }
#else
  MESSAGE("SKIPPED: this suite was built without NCCL (MOEBLAZE_NCCL off or nccl.h not found)");
#endif
#endif
}

TEST_CASE(
    "ep cuda: world size 2 over the LOCAL transport against the one-GPU layer (and "
    "CONSUME_SAVED)") {
  SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
  int device_count = 0;
  CUDA_OK(cudaGetDeviceCount(&device_count));
  moeblaze_ep_group_t group = nullptr;
  MB_CHECK(moeblaze_ep_local_group_create(&group, 2));
  for (int32_t dtype : {MOEBLAZE_DTYPE_F32, MOEBLAZE_DTYPE_BF16}) {
    struct Variant {
      int32_t checkpoint;
      uint32_t backward_flags;
      int32_t score_function;
      float aux, z;  // router loss coefficients: the loss shares on CUDA
    };
    // CONSUME_SAVED: the experts' backward writes da|db over the EXPERT saved buffer; the results
    // must not change (each step runs a fresh forward first).
    for (const Variant v :
         {Variant{MOEBLAZE_CHECKPOINT_SAVE_PREACT, 0u, MOEBLAZE_SCORE_SOFTMAX_TOPK, 0.f, 0.f},
          Variant{MOEBLAZE_CHECKPOINT_RECOMPUTE, 0u, MOEBLAZE_SCORE_SOFTMAX_TOPK, 0.f, 0.f},
          Variant{MOEBLAZE_CHECKPOINT_SAVE_PREACT, MOEBLAZE_BACKWARD_CONSUME_SAVED,
                  MOEBLAZE_SCORE_SOFTMAX_TOPK, 0.f, 0.f},
          Variant{MOEBLAZE_CHECKPOINT_SAVE_PREACT, 0u, MOEBLAZE_SCORE_SOFTMAX_TOPK, 0.01f, 0.001f},
          Variant{MOEBLAZE_CHECKPOINT_RECOMPUTE, 0u, MOEBLAZE_SCORE_SIGMOID, 0.02f, 0.003f}}) {
      EpCase c;
      c.dtype = dtype;
      c.checkpoint = v.checkpoint;
      c.backward_flags = v.backward_flags;
      c.score_function = v.score_function;
      c.aux = v.aux;
      c.z = v.z;
      c.d = 64;
      c.h = 96;
      c.E = 6;
      c.k = 3;
      c.tokens = {29, 0};
      if (dtype == MOEBLAZE_DTYPE_BF16) c.tokens = {41, 23};
      c.seed = test_seed(20261211);
      std::vector<RankSetup> setups(2);
      for (int32_t rank = 0; rank < 2; ++rank) {
        setups[size_t(rank)].communicator = group;
        setups[size_t(rank)].device = device_count > 1 ? rank : 0;
      }
      run_and_check(c, setups);
    }
  }
  MB_CHECK(moeblaze_ep_local_group_destroy(group));
#endif
}

TEST_CASE("ep cuda: memory spaces and backends are checked") {
  SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
  Context cpu(MOEBLAZE_BACKEND_CPU, 0);
  Context gpu(MOEBLAZE_BACKEND_CUDA, 0);
  moeblaze_ep_group_t group = nullptr;
  MB_CHECK(moeblaze_ep_local_group_create(&group, 2));
  EpCase c;
  c.tokens = {4, 4};
  const moeblaze_layer_config_t config = c.config();
  moeblaze_ep_config_t ep;
  MB_CHECK(moeblaze_ep_config_init(&ep, sizeof ep));
  ep.transport = MOEBLAZE_EP_TRANSPORT_LOCAL;
  ep.world_size = 2;
  ep.communicator = group;
  moeblaze_ep_layer_t rank0 = nullptr, rank1 = nullptr;
  MB_CHECK(moeblaze_ep_layer_create(&rank0, gpu.get(), &config, &ep));
  ep.rank = 1;
  // One group, one backend: a CPU rank cannot join a group of GPU ranks.
  MB_CHECK_STATUS(moeblaze_ep_layer_create(&rank1, cpu.get(), &config, &ep),
                  MOEBLAZE_ERR_INVALID_ARGUMENT);
  // Host memory given to a CUDA layer is refused before any communication.
  const Global g = make_global(c, false);
  size_t bytes = 0;
  MB_CHECK(moeblaze_ep_layer_exchange_size(rank0, &bytes));
  AlignedBytes exchange(bytes);
  DevBuf home, ws;
  MB_CHECK(moeblaze_ep_layer_saved_size(rank0, MOEBLAZE_EP_SAVED_HOME, 4, 0, &bytes));
  CUDA_OK(home.alloc(bytes));
  MB_CHECK(moeblaze_ep_layer_workspace_size(rank0, MOEBLAZE_EP_PASS_FORWARD_BEGIN, 4, 0, &bytes));
  CUDA_OK(ws.alloc(bytes));
  moeblaze_ep_forward_args_t fa;
  MB_CHECK(moeblaze_ep_forward_args_init(&fa, sizeof fa));
  fa.num_tokens = 4;
  fa.x = g.x.data();  // host memory
  fa.w_router = g.w_router.data();
  fa.home_saved = home.get();
  fa.home_saved_bytes = home.size();
  fa.workspace = ws.get();
  fa.workspace_bytes = ws.size();
  int64_t recv = 0;
  MB_CHECK_STATUS(
      moeblaze_ep_forward_begin(rank0, &fa, exchange.data(), exchange.size(), &recv, nullptr),
      MOEBLAZE_ERR_INVALID_ARGUMENT);
  CHECK(std::strstr(moeblaze_last_error(), "args->x") != nullptr);
  MB_CHECK(moeblaze_ep_layer_destroy(rank0));
  MB_CHECK(moeblaze_ep_local_group_destroy(group));
#endif
}
