// The CUDA backend against the CPU reference backend, through the public API only (host copies of
// device buffers): router, routing indices (structure for structure), experts and whole layer
// forward/backward for every activation, dtype and checkpoint policy, odd and ragged shapes,
// bitwise reproducibility, and a whole layer captured in a CUDA graph. Without CUDA or a GPU every
// test prints "SKIPPED: no CUDA GPU" and passes (doctest marks nothing failed).
//
// MOEBLAZE_TEST_QUICK=1 runs a reduced case set (used under compute-sanitizer).
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "support/gpu_support.hpp"
#include "support/test_support.hpp"

#if defined(MOEBLAZE_TESTS_WITH_CUDA)
#include <cuda_runtime.h>
#endif

using namespace mbtest;

namespace {

[[maybe_unused]] bool quick() {
  const char* env = std::getenv("MOEBLAZE_TEST_QUICK");
  return env && env[0] && env[0] != '0';
}

}  // namespace

#if defined(MOEBLAZE_TESTS_WITH_CUDA)
namespace {

// A device allocation (RAII).
class DevBuf {
 public:
  DevBuf() = default;
  ~DevBuf() { reset(); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void alloc(size_t bytes) {
    reset();
    bytes_ = bytes;
    if (bytes) CUDA_OK(cudaMalloc(&ptr_, bytes));
  }
  void reset() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }
  void upload(const void* host, size_t bytes) {
    if (bytes_ != bytes) alloc(bytes);
    if (bytes) CUDA_OK(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
  }
  void download(void* host, size_t bytes) const {
    REQUIRE(bytes <= bytes_);
    if (bytes) CUDA_OK(cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost));
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

void up(DevBuf& dev, const HostTensor& t) {
  dev.upload(t.data(), t.bytes());
}
void down(const DevBuf& dev, HostTensor& t) {
  dev.download(t.data(), t.bytes());
}
void up(DevBuf& dev, const std::vector<int32_t>& v) {
  dev.upload(v.data(), v.size() * 4);
}
void down(const DevBuf& dev, std::vector<int32_t>& v) {
  dev.download(v.data(), v.size() * 4);
}

// Device mirror of a LayerRun: inputs are uploaded from it, outputs downloaded into it. `enqueue_*`
// only enqueue (capturable); `sync_download()` waits and copies the outputs back.
struct DeviceRun {
  LayerRun& r;
  DevBuf x, w_router, w_gate, w_up, w_down, dy, ids, g, d_losses;
  DevBuf y, dx, dw_router, dw_gate, dw_up, dw_down, logits, g_out, dg, d_logits, losses;
  DevBuf ids_out, counts, saved, ws_fwd, ws_bwd;
  int32_t forward_pass = MOEBLAZE_PASS_EXPERTS_FORWARD;
  bool with_saved = true;
  // A training forward gets exactly the MOEBLAZE_FORWARD_WITH_SAVED workspace unless this is false.
  bool lean_training_workspace = true;

  explicit DeviceRun(LayerRun& run) : r(run) {}

  void upload_all() {
    up(x, r.x);
    up(w_router, r.w_router);
    up(w_gate, r.w_gate);
    up(w_up, r.w_up);
    up(w_down, r.w_down);
    up(dy, r.dy);
    up(ids, r.ids);
    up(g, r.g);
    up(d_losses, r.d_losses);
    up(y, r.y);
    up(dx, r.dx);
    up(dw_router, r.dw_router);
    up(dw_gate, r.dw_gate);
    up(dw_up, r.dw_up);
    up(dw_down, r.dw_down);
    up(logits, r.logits);
    up(g_out, r.g_out);
    up(dg, r.dg);
    up(d_logits, r.d_logits);
    up(losses, r.losses);
    up(ids_out, r.ids_out);
    up(counts, r.expert_counts);
  }

  void sync_download() {
    CUDA_OK(cudaDeviceSynchronize());
    down(y, r.y);
    down(dx, r.dx);
    down(dw_router, r.dw_router);
    down(dw_gate, r.dw_gate);
    down(dw_up, r.dw_up);
    down(dw_down, r.dw_down);
    down(logits, r.logits);
    down(g_out, r.g_out);
    down(dg, r.dg);
    down(d_logits, r.d_logits);
    down(losses, r.losses);
    down(ids_out, r.ids_out);
    down(counts, r.expert_counts);
  }

  // Allocates workspaces (filled with garbage) and the saved buffer for these passes; the backward
  // workspace is sized for a backward called with `bwd_flags`, a training forward's for
  // MOEBLAZE_FORWARD_WITH_SAVED (see lean_training_workspace).
  void prepare(int32_t fwd_pass, bool saved_buffer, uint32_t bwd_flags = 0) {
    forward_pass = fwd_pass;
    with_saved = saved_buffer;
    const int32_t bwd_pass = fwd_pass == MOEBLAZE_PASS_LAYER_FORWARD
                                 ? MOEBLAZE_PASS_LAYER_BACKWARD
                                 : MOEBLAZE_PASS_EXPERTS_BACKWARD;
    size_t bwd_bytes = 0;
    MB_CHECK(moeblaze_layer_workspace_size_with_flags(r.layer.get(), bwd_pass, r.T, bwd_flags,
                                                      &bwd_bytes));
    const bool lean = saved_buffer && lean_training_workspace;
    ws_fwd.alloc(r.layer.workspace_size(fwd_pass, r.T, lean ? MOEBLAZE_FORWARD_WITH_SAVED : 0u));
    ws_bwd.alloc(bwd_bytes);
    if (ws_fwd.size()) CUDA_OK(cudaMemset(ws_fwd.get(), 0xff, ws_fwd.size()));
    if (ws_bwd.size()) CUDA_OK(cudaMemset(ws_bwd.get(), 0xff, ws_bwd.size()));
    saved.alloc(saved_buffer ? r.layer.saved_size(fwd_pass, r.T) : 0);
  }

  // One training step of `fwd_pass` on the default stream: uploads the inputs, runs the forward
  // with a saved buffer and the matching backward with `bwd_flags` (workspaces sized for them),
  // then waits and downloads every output.
  void run_training_step(int32_t fwd_pass, uint32_t bwd_flags = 0) {
    upload_all();
    prepare(fwd_pass, true, bwd_flags);
    MB_CHECK(enqueue_forward(nullptr));
    MB_CHECK(enqueue_backward(nullptr, BackwardOutputs(), bwd_flags));
    sync_download();
  }

  moeblaze_status_t enqueue_forward(cudaStream_t stream) {
    moeblaze_forward_args_t a;
    moeblaze_forward_args_init(&a, sizeof a);
    a.num_tokens = r.T;
    a.x = x.get();
    a.w_router = w_router.get();
    a.w_gate = w_gate.get();
    a.w_up = r.gated ? w_up.get() : nullptr;
    a.w_down = w_down.get();
    a.y = y.get();
    a.expert_counts = static_cast<int32_t*>(counts.get());
    a.saved = with_saved ? saved.get() : nullptr;
    a.saved_bytes = with_saved ? saved.size() : 0;
    a.workspace = ws_fwd.get();
    a.workspace_bytes = ws_fwd.size();
    if (forward_pass == MOEBLAZE_PASS_LAYER_FORWARD) {
      a.logits_out = logits.get();
      a.ids_out = static_cast<int32_t*>(ids_out.get());
      a.g_out = g_out.get();
      a.losses = losses.get();
      return moeblaze_layer_forward(r.layer.get(), &a, stream);
    }
    a.ids = static_cast<const int32_t*>(ids.get());
    a.g = g.get();
    return moeblaze_experts_forward(r.layer.get(), &a, stream);
  }

  moeblaze_status_t enqueue_backward(cudaStream_t stream, BackwardOutputs out = BackwardOutputs(),
                                     uint32_t flags = 0) {
    moeblaze_backward_args_t a;
    moeblaze_backward_args_init(&a, sizeof a);
    a.flags = flags;
    a.num_tokens = r.T;
    a.dy = dy.get();
    a.d_losses = r.use_d_losses ? d_losses.get() : nullptr;
    a.x = x.get();
    a.w_router = w_router.get();
    a.w_gate = w_gate.get();
    a.w_up = r.gated ? w_up.get() : nullptr;
    a.w_down = w_down.get();
    a.saved = saved.get();
    a.saved_bytes = saved.size();
    a.dx = out.dx ? dx.get() : nullptr;
    a.dw_gate = out.dw_gate ? dw_gate.get() : nullptr;
    a.dw_up = out.dw_up && r.gated ? dw_up.get() : nullptr;
    a.dw_down = out.dw_down ? dw_down.get() : nullptr;
    a.workspace = ws_bwd.get();
    a.workspace_bytes = ws_bwd.size();
    if (forward_pass == MOEBLAZE_PASS_LAYER_FORWARD) {
      a.dw_router = out.dw_router ? dw_router.get() : nullptr;
      a.d_logits = out.d_logits ? d_logits.get() : nullptr;
      return moeblaze_layer_backward(r.layer.get(), &a, stream);
    }
    a.ids = static_cast<const int32_t*>(ids.get());
    a.g = g.get();
    a.dg = out.dg ? dg.get() : nullptr;
    return moeblaze_experts_backward(r.layer.get(), &a, stream);
  }
};

void copy_inputs(const LayerRun& from, LayerRun& to) {
  to.x = from.x;
  to.w_router = from.w_router;
  to.w_gate = from.w_gate;
  to.w_up = from.w_up;
  to.w_down = from.w_down;
  to.dy = from.dy;
  to.g = from.g;
  to.ids = from.ids;
  to.d_losses = from.d_losses;
  to.use_d_losses = from.use_d_losses;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Compares a GPU output with the CPU's; the tolerance scales with the reduction length and the
// reference's magnitude.
void check_close(const char* name, const HostTensor& got, const HostTensor& want, int32_t dtype,
                 int64_t reduction) {
  const std::vector<double> ref = want.to_vector();
  Tolerance tol = tolerance_for(dtype, reduction, std::max(1e-3, max_abs(ref)));
  if (dtype == MOEBLAZE_DTYPE_F32) tol.rtol = 1e-4;  // different summation orders, expf vs std::exp
  compare(name, got, ref, tol);
}

// Every expert output of `got` (y, dx, dg, the weight gradients) is bitwise that of `want`.
void check_experts_bitwise(const LayerRun& got, const LayerRun& want) {
  CHECK(got.y.bitwise_equal(want.y));
  CHECK(got.dx.bitwise_equal(want.dx));
  CHECK(got.dg.bitwise_equal(want.dg));
  CHECK(got.dw_gate.bitwise_equal(want.dw_gate));
  if (got.gated) CHECK(got.dw_up.bitwise_equal(want.dw_up));
  CHECK(got.dw_down.bitwise_equal(want.dw_down));
}

// One experts forward + backward on a fresh CUDA backend, which reads the MOEBLAZE_CUDA_* switches
// set at this moment: the inputs and, for ACCUMULATE_WGRAD, the starting weight gradients from
// `inputs`; y and dx start at `prefill`, so that rows left unwritten show. Read only the result's
// tensors (its layer is gone).
LayerRun gpu_experts_run(const moeblaze_layer_config_t& cfg, const LayerRun& inputs,
                         uint32_t backward_flags, double prefill = 0.0) {
  Context gpu{MOEBLAZE_BACKEND_CUDA, 0};
  Layer lg(gpu, cfg);
  LayerRun rg(lg, inputs.T);
  copy_inputs(inputs, rg);
  rg.dw_gate = inputs.dw_gate;
  rg.dw_up = inputs.dw_up;
  rg.dw_down = inputs.dw_down;
  rg.y.fill(prefill);
  rg.dx.fill(prefill);
  DeviceRun dev(rg);
  dev.run_training_step(MOEBLAZE_PASS_EXPERTS_FORWARD, backward_flags);
  return rg;
}

// One of the CUDA backend's environment switches (MOEBLAZE_CUDA_*, read when a backend is created
// into process-wide settings), set for the guard's lifetime. On the way out, also when a REQUIRE
// throws, it unsets the variable and creates a backend, which reads the defaults back, so the cases
// after this one never run under a switch a failed case left set.
class ScopedSwitch {
 public:
  explicit ScopedSwitch(const char* variable, const char* value = nullptr) : variable_(variable) {
    if (value != nullptr) set(value);
  }
  ScopedSwitch(const ScopedSwitch&) = delete;
  ScopedSwitch& operator=(const ScopedSwitch&) = delete;
  ~ScopedSwitch() {
    unsetenv(variable_);
    moeblaze_context_t reset = nullptr;  // the C API directly: a destructor must not throw
    if (moeblaze_context_create(&reset, MOEBLAZE_BACKEND_CUDA, 0) == MOEBLAZE_OK)
      moeblaze_context_destroy(reset);
  }
  // Takes effect for the backends created after it.
  void set(const char* value) const { setenv(variable_, value, 1); }

 private:
  const char* variable_;
};

// For a test/tuning switch that must not change results: one experts forward + backward on a
// fresh backend per value of the environment variable `variable` (read when the backend is
// created), each matched against the CPU's outputs `cpu` (T tokens) and bitwise against the first
// value's run. Leaves the variable unset and the next backend reading the defaults.
void check_switch_keeps_bits(const char* variable, const std::vector<const char*>& values,
                             const moeblaze_layer_config_t& cfg, const LayerRun& inputs,
                             const LayerRun& cpu, int64_t T, uint32_t backward_flags = 0) {
  std::vector<LayerRun> got;
  const ScopedSwitch setting(variable);
  for (const char* value : values) {
    const std::string value_text = std::string(variable) + "=" + value;  // CAPTURE: not a pointer
    CAPTURE(value_text);
    setting.set(value);
    const LayerRun rg = gpu_experts_run(cfg, inputs, backward_flags);
    check_close("y", rg.y, cpu.y, cfg.dtype, cfg.d_ffn * cfg.top_k);
    check_close("dx", rg.dx, cpu.dx, cfg.dtype, 2 * cfg.d_ffn * cfg.top_k);
    check_close("dg", rg.dg, cpu.dg, cfg.dtype, cfg.d_ffn + cfg.d_model);
    check_close("dw_down", rg.dw_down, cpu.dw_down, cfg.dtype, T);
    check_close("dw_gate", rg.dw_gate, cpu.dw_gate, cfg.dtype, T);
    if (rg.gated) check_close("dw_up", rg.dw_up, cpu.dw_up, cfg.dtype, T);
    if (!got.empty()) check_experts_bitwise(rg, got.front());
    got.push_back(rg);
  }
}

struct Case {
  int32_t dtype;
  int64_t d, h, E, k, T;
  int32_t activation = MOEBLAZE_ACTIVATION_SWIGLU;
  int32_t checkpoint = MOEBLAZE_CHECKPOINT_SAVE_PREACT;
  const char* routing = "random";  // random | one_expert | skewed | empty_experts
};

void apply_routing(LayerRun& run, const char* routing, Rng& rng) {
  const std::string kind = routing;
  if (kind == "one_expert") {
    // Every token's first pick is the last expert; others random distinct.
    for (int64_t t = 0; t < run.T; ++t) {
      std::vector<int32_t> perm;
      for (int32_t e = 0; e < run.E - 1; ++e) perm.push_back(e);
      std::shuffle(perm.begin(), perm.end(), rng.engine());
      run.ids[size_t(t * run.k)] = int32_t(run.E - 1);
      for (int64_t j = 1; j < run.k; ++j) run.ids[size_t(t * run.k + j)] = perm[size_t(j - 1)];
    }
  } else if (kind == "skewed" || kind == "empty_experts") {
    // Skewed: expert ids drawn with weight 2^-e (experts past k+1 mostly empty); empty_experts:
    // only experts 0..k used.
    for (int64_t t = 0; t < run.T; ++t) {
      std::vector<int32_t> chosen;
      while (int64_t(chosen.size()) < run.k) {
        int32_t e;
        if (kind == "empty_experts") {
          e = int32_t(rng.uniform_int(0, std::min<int64_t>(run.k, run.E - 1)));
        } else {
          e = 0;
          while (e < run.E - 1 && rng.uniform(0, 1) < 0.5) ++e;
        }
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      for (int64_t j = 0; j < run.k; ++j) run.ids[size_t(t * run.k + j)] = chosen[size_t(j)];
    }
  }
}

// A CPU layer of `cfg` with random inputs for T tokens and `routing` (apply_routing), its outputs
// cleared: the oracle a GPU run is compared with.
struct CpuReference {
  Context cpu;
  Layer layer;
  LayerRun run;
  CpuReference(const moeblaze_layer_config_t& cfg, int64_t T, Rng& rng, const char* routing)
      : layer(cpu, cfg), run(layer, T) {
    run.init_random(rng);
    apply_routing(run, routing, rng);
    run.clear_outputs();
  }
};

// check_switch_keeps_bits on T tokens of random inputs under skewed routing (experts 3 and 4
// nearly empty), against the CPU backend's forward + backward of the same inputs.
void check_switch_keeps_bits_skewed(const char* variable, const std::vector<const char*>& values,
                                    const moeblaze_layer_config_t& cfg, int64_t T, Rng& rng) {
  CpuReference ref(cfg, T, rng, "skewed");
  const LayerRun inputs = ref.run;  // the CPU's outputs land in ref.run
  MB_CHECK(ref.run.experts_forward());
  MB_CHECK(ref.run.experts_backward());
  check_switch_keeps_bits(variable, values, cfg, inputs, ref.run, T);
}

// Experts forward + backward on CPU and GPU from the same inputs; everything compared.
void check_experts_case(const Context& cpu, const Context& gpu, const Case& c, Rng& rng,
                        bool accumulate = false) {
  moeblaze_layer_config_t cfg = make_config(c.dtype, c.d, c.h, c.E, c.k);
  cfg.activation = c.activation;
  cfg.checkpoint = c.checkpoint;
  CAPTURE(describe(cfg));
  CAPTURE(c.T);
  CAPTURE(c.routing);
  CAPTURE(accumulate);
  Layer lc(cpu, cfg), lg(gpu, cfg);
  LayerRun rc(lc, c.T), rg(lg, c.T);
  rc.init_random(rng);
  apply_routing(rc, c.routing, rng);
  copy_inputs(rc, rg);
  rc.clear_outputs();
  rg.clear_outputs();
  const uint32_t flags = accumulate ? MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD : 0u;
  if (accumulate) {
    for (LayerRun* run : {&rc, &rg}) {
      run->dw_gate.fill(0.25);
      run->dw_up.fill(-0.5);
      run->dw_down.fill(1.0);
    }
  }
  MB_CHECK(rc.experts_forward());
  MB_CHECK(rc.experts_backward({}, flags));

  DeviceRun dev(rg);
  dev.run_training_step(MOEBLAZE_PASS_EXPERTS_FORWARD, flags);

  check_close("y", rg.y, rc.y, c.dtype, c.h * c.k);
  check_close("dx", rg.dx, rc.dx, c.dtype, 2 * c.h * c.k);
  check_close("dw_gate", rg.dw_gate, rc.dw_gate, c.dtype, c.T);
  if (rg.gated) check_close("dw_up", rg.dw_up, rc.dw_up, c.dtype, c.T);
  check_close("dw_down", rg.dw_down, rc.dw_down, c.dtype, c.T);
  check_close("dg", rg.dg, rc.dg, c.dtype, c.h + c.d);
  CHECK(rg.expert_counts == rc.expert_counts);
}

struct Gpu {
  Context cpu;
  Context gpu{MOEBLAZE_BACKEND_CUDA, 0};
};

}  // namespace
#endif  // MOEBLAZE_TESTS_WITH_CUDA

TEST_SUITE("cuda") {
  TEST_CASE("cuda: backend availability and build info") {
    MESSAGE("build: " << moeblaze_get_build_info());
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    cudaDeviceProp prop{};
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    MESSAGE("device 0: " << prop.name << " (sm_" << prop.major << prop.minor << ")");
    Context gpu(MOEBLAZE_BACKEND_CUDA, 0);
    int32_t backend = 0, device = -1;
    MB_CHECK(moeblaze_context_get_info(gpu.get(), &backend, &device));
    CHECK(backend == MOEBLAZE_BACKEND_CUDA);
    CHECK(device == 0);
    // F64 is CPU-only.
    moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F64, 8, 8, 2, 1);
    moeblaze_layer_t layer = nullptr;
    MB_CHECK_STATUS(moeblaze_layer_create(&layer, gpu.get(), &cfg), MOEBLAZE_ERR_NOT_SUPPORTED);
    moeblaze_layer_destroy(layer);
#endif
  }

  TEST_CASE("cuda: router forward and backward match the CPU (every score function, losses)") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    Gpu ctx;
    Rng rng(test_seed(9101));
    struct RouterCase {
      int64_t E, k, T;
    };
    // E spans every register width of the forward kernel (ceil(E / 32) up to 1, 2, 4, 8, 16, 32
    // logits a lane), partly filled ones included.
    std::vector<RouterCase> cases = {
        {8, 2, 300}, {5, 5, 17}, {64, 6, 129}, {1, 1, 3}, {100, 4, 33}};
    if (!quick()) {
      cases.push_back({256, 8, 1000});
      cases.push_back({300, 4, 77});
      cases.push_back({1000, 8, 100});
    }
    for (const RouterCase& rcase : cases) {
      for (int32_t fn :
           {MOEBLAZE_SCORE_SOFTMAX_TOPK, MOEBLAZE_SCORE_TOPK_SOFTMAX, MOEBLAZE_SCORE_SIGMOID}) {
        for (int renorm : {0, 1}) {
          moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 16, 16, rcase.E, rcase.k);
          cfg.score_function = fn;
          cfg.renormalize = renorm;
          cfg.aux_loss_coeff = 0.01f;
          cfg.z_loss_coeff = 0.001f;
          CAPTURE(describe(cfg));
          CAPTURE(rcase.T);
          Layer lc(ctx.cpu, cfg), lg(ctx.gpu, cfg);
          const int64_t T = rcase.T, E = rcase.E, k = rcase.k;
          HostTensor logits(MOEBLAZE_DTYPE_F32, {T, E}), dg(MOEBLAZE_DTYPE_F32, {T, k});
          fill_normal(logits, rng, 2.0);
          fill_normal(dg, rng, 1.0);
          HostTensor dl(MOEBLAZE_DTYPE_F32, {2});
          dl.set(0, 0.7);
          dl.set(1, -1.3);
          // CPU
          HostTensor g_c(MOEBLAZE_DTYPE_F32, {T, k}), losses_c(MOEBLAZE_DTYPE_F32, {2});
          HostTensor dlog_c(MOEBLAZE_DTYPE_F32, {T, E});
          std::vector<int32_t> ids_c(static_cast<size_t>(T * k)), counts_c(static_cast<size_t>(E));
          AlignedBytes ws(lc.workspace_size(MOEBLAZE_PASS_ROUTER_FORWARD, T));
          MB_CHECK(moeblaze_router_forward(lc.get(), T, logits.data(), ids_c.data(), g_c.data(),
                                           counts_c.data(), losses_c.data(), ws.data(), ws.size(),
                                           nullptr));
          AlignedBytes wsb(lc.workspace_size(MOEBLAZE_PASS_ROUTER_BACKWARD, T));
          MB_CHECK(moeblaze_router_backward(lc.get(), T, logits.data(), ids_c.data(), dg.data(),
                                            dl.data(), dlog_c.data(), wsb.data(), wsb.size(),
                                            nullptr));
          // GPU
          DevBuf d_logits_in, d_ids, d_g, d_counts, d_losses, d_dg, d_dl, d_dlog, d_ws, d_wsb;
          up(d_logits_in, logits);
          d_ids.alloc(size_t(T * k) * 4);
          d_g.alloc(size_t(T * k) * 4);
          d_counts.alloc(size_t(E) * 4);
          d_losses.alloc(8);
          up(d_dg, dg);
          up(d_dl, dl);
          d_dlog.alloc(size_t(T * E) * 4);
          d_ws.alloc(lg.workspace_size(MOEBLAZE_PASS_ROUTER_FORWARD, T));
          d_wsb.alloc(lg.workspace_size(MOEBLAZE_PASS_ROUTER_BACKWARD, T));
          MB_CHECK(moeblaze_router_forward(lg.get(), T, d_logits_in.get(),
                                           static_cast<int32_t*>(d_ids.get()), d_g.get(),
                                           static_cast<int32_t*>(d_counts.get()), d_losses.get(),
                                           d_ws.get(), d_ws.size(), nullptr));
          // Backward from the CPU's ids so that both differentiate the same selection.
          up(d_ids, ids_c);
          MB_CHECK(moeblaze_router_backward(
              lg.get(), T, d_logits_in.get(), static_cast<const int32_t*>(d_ids.get()), d_dg.get(),
              d_dl.get(), d_dlog.get(), d_wsb.get(), d_wsb.size(), nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          // (ids were overwritten by the upload: recompute the forward's for comparison.)
          std::vector<int32_t> ids_g(static_cast<size_t>(T * k)), counts_g(static_cast<size_t>(E));
          HostTensor g_g(MOEBLAZE_DTYPE_F32, {T, k}), losses_g(MOEBLAZE_DTYPE_F32, {2});
          HostTensor dlog_g(MOEBLAZE_DTYPE_F32, {T, E});
          MB_CHECK(moeblaze_router_forward(lg.get(), T, d_logits_in.get(),
                                           static_cast<int32_t*>(d_ids.get()), d_g.get(),
                                           static_cast<int32_t*>(d_counts.get()), d_losses.get(),
                                           d_ws.get(), d_ws.size(), nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          down(d_ids, ids_g);
          down(d_counts, counts_g);
          down(d_g, g_g);
          down(d_losses, losses_g);
          down(d_dlog, dlog_g);
          CHECK(ids_g == ids_c);
          CHECK(counts_g == counts_c);
          compare("g", g_g, g_c.to_vector(), {1e-6, 1e-5});
          compare("losses", losses_g, losses_c.to_vector(), {1e-6, 1e-4});
          compare("d_logits", dlog_g, dlog_c.to_vector(), {1e-6, 1e-4});
        }
      }
    }
#endif
  }

  TEST_CASE("cuda: routing_build matches the CPU structure for structure") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    Gpu ctx;
    Rng rng(test_seed(9202));
    struct RCase {
      int64_t E, k, T;
      const char* routing;
    };
    const std::vector<RCase> cases = {{8, 2, 1000, "random"},  {8, 2, 1000, "one_expert"},
                                      {16, 4, 777, "skewed"},  {16, 2, 300, "empty_experts"},
                                      {5, 5, 33, "random"},    {3, 1, 1, "random"},
                                      {300, 8, 600, "random"}, {1024, 32, 257, "random"}};
    for (const RCase& rc : cases) {
      CAPTURE(rc.E);
      CAPTURE(rc.k);
      CAPTURE(rc.T);
      CAPTURE(rc.routing);
      moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, 8, 8, rc.E, rc.k);
      Layer lc(ctx.cpu, cfg), lg(ctx.gpu, cfg);
      LayerRun run(lc, rc.T);
      run.init_random(rng);
      apply_routing(run, rc.routing, rng);
      const int64_t N = rc.T * rc.k;
      std::vector<int32_t> off_c(static_cast<size_t>(rc.E + 1)), eti_c(static_cast<size_t>(N)),
          tim_c(static_cast<size_t>(N));
      AlignedBytes ws(lc.workspace_size(MOEBLAZE_PASS_ROUTING_BUILD, rc.T));
      MB_CHECK(moeblaze_routing_build(lc.get(), rc.T, run.ids.data(), off_c.data(), eti_c.data(),
                                      tim_c.data(), ws.data(), ws.size(), nullptr));
      DevBuf d_ids, d_off, d_eti, d_tim, d_ws;
      up(d_ids, run.ids);
      d_off.alloc(off_c.size() * 4);
      d_eti.alloc(size_t(N) * 4 + 4);
      d_tim.alloc(size_t(N) * 4 + 4);
      d_ws.alloc(lg.workspace_size(MOEBLAZE_PASS_ROUTING_BUILD, rc.T));
      std::vector<int32_t> off_g(off_c.size()), eti_g(static_cast<size_t>(N)),
          tim_g(static_cast<size_t>(N));
      for (int rep = 0; rep < 2; ++rep) {
        MB_CHECK(moeblaze_routing_build(
            lg.get(), rc.T, static_cast<const int32_t*>(d_ids.get()),
            static_cast<int32_t*>(d_off.get()), static_cast<int32_t*>(d_eti.get()),
            static_cast<int32_t*>(d_tim.get()), d_ws.get(), d_ws.size(), nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        down(d_off, off_g);
        down(d_eti, eti_g);
        down(d_tim, tim_g);
        CHECK(off_g == off_c);
        CHECK(eti_g == eti_c);
        CHECK(tim_g == tim_c);
      }
    }
#endif
  }

  TEST_CASE("cuda: experts forward/backward match the CPU (activations x dtypes x policies)") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    Gpu ctx;
    Rng rng(test_seed(9303));
    const std::vector<int32_t> dtypes = {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16,
                                         MOEBLAZE_DTYPE_F32};
    for (int32_t dtype : dtypes) {
      for (int32_t act : kAllActivations) {
        for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_SAVE_PREACT,
                             MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
          if (quick() && ckpt != MOEBLAZE_CHECKPOINT_SAVE_PREACT && act != 0) continue;
          Case c{dtype, 64, 96, 4, 2, 150};
          c.activation = act;
          c.checkpoint = ckpt;
          check_experts_case(ctx.cpu, ctx.gpu, c, rng);
        }
      }
    }
#endif
  }

  TEST_CASE("cuda: experts edge shapes (odd sizes, ragged, T=0, T=1, k=E, tensor-core tiles)") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    Gpu ctx;
    Rng rng(test_seed(9404));
    std::vector<Case> cases;
    for (int32_t dtype : {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16, MOEBLAZE_DTYPE_F32}) {
      cases.push_back({dtype, 33, 70, 5, 3, 61});                          // odd
      cases.push_back({dtype, 64, 64, 8, 2, 300, 0, 1, "one_expert"});     // all on one
      cases.push_back({dtype, 64, 64, 8, 2, 300, 0, 1, "empty_experts"});  // empty
      cases.push_back({dtype, 40, 48, 6, 3, 257, 3, 1, "skewed"});         // skewed
      cases.push_back({dtype, 32, 32, 4, 4, 37});                          // k = E
      cases.push_back({dtype, 32, 48, 12, 10, 53});                        // k > 8: two batches
      cases.push_back({dtype, 32, 48, 4, 2, 1});                           // T = 1
      cases.push_back({dtype, 32, 48, 4, 2, 0});                           // T = 0
      // d = 2112 (33 k-steps a tile): B1's epilogue-warp form (33-64 k-steps); F1 takes its
      // epilogue-warp form up to 64 k-steps, like every smaller case here. d = 4160 (65 k-steps):
      // both kernels' long-K forms (4 stages, epilogue in the consumers).
      if (dtype != MOEBLAZE_DTYPE_F32) {
        cases.push_back({dtype, 2112, 64, 3, 2, 40});
        cases.push_back({dtype, 4160, 64, 3, 2, 24});
      }
      // 512 <= d <= 2048 (8-32 k-steps): the Hopper B1's split forms (d = 512: the two-group
      // split, whose only size it is; d = 576: the split's lower bound); the cases with d < 512
      // take its 4-stage form. Odd h: a partial last column group; skewed: ragged rows.
      if (dtype != MOEBLAZE_DTYPE_F32) {
        cases.push_back({dtype, 512, 296, 4, 2, 300, MOEBLAZE_ACTIVATION_SILU,
                         MOEBLAZE_CHECKPOINT_RECOMPUTE, "skewed"});
        cases.push_back({dtype, 576, 200, 4, 2, 300, MOEBLAZE_ACTIVATION_SWIGLU,
                         MOEBLAZE_CHECKPOINT_SAVE_PREACT, "skewed"});
        cases.push_back({dtype, 1088, 200, 4, 2, 300});
        cases.push_back({dtype, 2048, 136, 5, 3, 261, MOEBLAZE_ACTIVATION_SILU,
                         MOEBLAZE_CHECKPOINT_SAVE_ALL, "skewed"});
      }
      if (!quick()) {
        cases.push_back({dtype, 256, 384, 8, 2, 700});                  // several 128x128 tiles
        cases.push_back({dtype, 136, 200, 3, 1, 515, 5, 2, "skewed"});  // ReLU, recompute
      }
      if (!quick() && dtype == MOEBLAZE_DTYPE_BF16) {
        cases.push_back({dtype, 512, 1024, 4, 2, 1024});  // long K in every GEMM
        // The largest expert count: the Hopper kernels' device-side tile schedule (a prefix over
        // 1024 experts in shared memory, a binary search per tile), most experts empty.
        cases.push_back({dtype, 64, 72, MOEBLAZE_MAX_EXPERTS, 2, 300});
      }
    }
    for (const Case& c : cases) check_experts_case(ctx.cpu, ctx.gpu, c, rng);
    // Accumulating weight gradients.
    check_experts_case(ctx.cpu, ctx.gpu, {MOEBLAZE_DTYPE_BF16, 64, 64, 4, 2, 100}, rng, true);
    check_experts_case(ctx.cpu, ctx.gpu, {MOEBLAZE_DTYPE_F32, 33, 70, 5, 2, 0}, rng, true);
#endif
  }

  TEST_CASE(
      "cuda: experts match the CPU with every GEMM on the 2x2-warp (64x64) tensor-core layout") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    const ScopedSwitch warps("MOEBLAZE_CUDA_MMA_WARPS", "4");
    {
      Gpu ctx;
      Rng rng(test_seed(9707));
      for (int32_t dtype : {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16}) {
        for (int32_t act : {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_RELU}) {
          for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
            if (quick() && ckpt == MOEBLAZE_CHECKPOINT_SAVE_ALL) continue;
            // Quick (sanitizer) runs: still several tiles in m and n, far less work.
            Case c = quick() ? Case{dtype, 136, 200, 3, 2, 150} : Case{dtype, 256, 384, 8, 2, 700};
            c.activation = act;
            c.checkpoint = ckpt;
            check_experts_case(ctx.cpu, ctx.gpu, c, rng);
          }
        }
        check_experts_case(ctx.cpu, ctx.gpu, {dtype, 64, 64, 8, 2, 300, 0, 1, "one_expert"}, rng);
      }
    }
#endif
  }

  TEST_CASE("cuda: B1/B2 in column chunks of h give bitwise the one-chunk results") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    // h = 1000 with d = 64: MOEBLAZE_CUDA_GU_CHUNKS = 4 runs B1 and B2 in chunks of 256, 256, 256,
    // 232 columns (bf16 and fp32 alike), 3 in two of 512 and 488 (the 256-column alignment), 1 in
    // one; 0 is the policy (one chunk here: four would leave B2's five tiles a wave each). Every
    // output must have the same bits in all four runs, and match the CPU. Each backend reads the
    // switch when it is created.
    // d = 1088 (bf16): the Hopper B1's epilogue-warp form (17 k-steps), where the policy gives one
    // chunk and the switch 1 or 2.
    Rng rng(test_seed(9808));
    for (int64_t d : {64, 1088}) {
      for (int32_t dtype : {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F32}) {
        if (d == 1088 && dtype != MOEBLAZE_DTYPE_BF16) continue;
        for (int32_t act : {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_SILU}) {
          for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_SAVE_PREACT,
                               MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
            for (bool accumulate : {false, true}) {
              if (quick() && (ckpt != MOEBLAZE_CHECKPOINT_SAVE_PREACT || accumulate)) continue;
              if (d == 1088 && accumulate) continue;
              moeblaze_layer_config_t cfg = make_config(dtype, d, 1000, 5, 2);
              cfg.activation = act;
              cfg.checkpoint = ckpt;
              CAPTURE(describe(cfg));
              CAPTURE(accumulate);
              CpuReference ref(cfg, 150, rng, "skewed");  // experts 3, 4 (nearly) empty
              LayerRun& rc = ref.run;
              const uint32_t flags = accumulate ? MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD : 0u;
              if (accumulate) {
                rc.dw_gate.fill(0.25);
                rc.dw_up.fill(-0.5);
                rc.dw_down.fill(1.0);
              }
              LayerRun want = rc;  // the CPU's outputs land in rc
              MB_CHECK(rc.experts_forward());
              MB_CHECK(rc.experts_backward({}, flags));
              check_switch_keeps_bits("MOEBLAZE_CUDA_GU_CHUNKS", {"1", "4", "0", "3"}, cfg, want,
                                      rc, 150, flags);
            }
          }
        }
      }
    }
#endif
  }

  TEST_CASE("cuda: B1/B2's chunks of h bound the backward's peak, but never cost B2 whole waves") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    // The policy's choice, read off the experts backward's workspace (g*u is its one region that
    // depends on the chunks) against the sizes with the count forced (MOEBLAZE_CUDA_GU_CHUNKS).
    int sms = 0;
    REQUIRE(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess);
    CAPTURE(sms);
    const ScopedSwitch chunk_switch("MOEBLAZE_CUDA_GU_CHUNKS");
    const auto backward_bytes = [&](const moeblaze_layer_config_t& cfg, int64_t T,
                                    const char* chunks) {
      chunk_switch.set(chunks);
      const Context gpu(MOEBLAZE_BACKEND_CUDA);
      const Layer layer(gpu, cfg);
      return layer.workspace_size(MOEBLAZE_PASS_EXPERTS_BACKWARD, T);
    };
    // d = 512, h = 2048, E = 4, k = 1 (the benchmark's conf1): the backward's peak alone asks for
    // two chunks. B2 has 4 x 4 x 8 = 128 tiles of 128 x 256, each over its expert's 16,384 rows:
    // one wave where the SMs are >= 128 (Hopper's 132), two in two chunks, so one chunk there;
    // with 64..127 SMs it takes two waves either way, so two chunks.
    moeblaze_layer_config_t conf1 = make_config(MOEBLAZE_DTYPE_BF16, 512, 2048, 4, 1);
    const size_t one = backward_bytes(conf1, 65536, "1");
    const size_t two = backward_bytes(conf1, 65536, "2");
    CHECK(two < one);
    if (sms >= 128) CHECK(backward_bytes(conf1, 65536, "0") == one);
    if (sms >= 64 && sms < 128) CHECK(backward_bytes(conf1, 65536, "0") == two);
    // d = 2048, h = 8192, E = 8, k = 4 (conf7): the peak asks for four chunks, each of 8 x 16 x 8
    // = 1,024 B2 tiles against 4,096 in one; where that adds no wave (132 SMs: 4 x 8 = 32 waves
    // either way), four chunks.
    moeblaze_layer_config_t conf7 = make_config(MOEBLAZE_DTYPE_BF16, 2048, 8192, 8, 4);
    const size_t four = backward_bytes(conf7, 8192, "4");
    CHECK(four < backward_bytes(conf7, 8192, "1"));
    if (4 * ((1024 + sms - 1) / sms) <= (4096 + sms - 1) / sms)
      CHECK(backward_bytes(conf7, 8192, "0") == four);
#endif
  }

  TEST_CASE("cuda: F2/B4 in column chunks of d give bitwise the one-chunk results") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    // d = 1288 against h = 96: the rows ([N, d]) outweigh the activations ([N, 2h] or [N, h]), so
    // the default policy runs F2 and B4 in two column chunks (768 + 520 columns);
    // MOEBLAZE_CUDA_ROW_CHUNKS = 1 forces one, 3 asks for three (512 + 512 + 264). Every output
    // must have the same bits in all three runs and match the CPU, on the Hopper kernels (bf16)
    // and the SIMT engine (fp32), with skewed routing (nearly empty experts).
    Rng rng(test_seed(9819));
    for (int32_t dtype : {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F32}) {
      for (int32_t act : {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_SILU}) {
        for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_PREACT, MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
          if (quick() && (ckpt != MOEBLAZE_CHECKPOINT_SAVE_PREACT || dtype != MOEBLAZE_DTYPE_BF16))
            continue;
          moeblaze_layer_config_t cfg = make_config(dtype, 1288, 96, 5, 3);
          cfg.activation = act;
          cfg.checkpoint = ckpt;
          CAPTURE(describe(cfg));
          check_switch_keeps_bits_skewed("MOEBLAZE_CUDA_ROW_CHUNKS", {"1", "0", "3"}, cfg,
                                         quick() ? 70 : 190, rng);
        }
      }
    }
#endif
  }

  TEST_CASE("cuda: B1's epilogue forms match the CPU; those with epilogue warps agree") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    // MOEBLAZE_CUDA_B1_FORM forces the Hopper B1's epilogue form (rows_layout.cuh, B1Form) whatever
    // the k-steps a tile: d = 64 (1 k-step), 576 (9), 1088 (17). h = 296: the last 256-column tile
    // has 40 columns, all in group 0, so the split forms' epilogue warps (groups 1-3, 2-3) have
    // none and must still write their dg partial; h = 1000: a last tile of 232 columns. Every form
    // must match the CPU. The epilogue-warp and split forms round v alike and run the same element
    // arithmetic, so y, dx and the weight gradients must have the same bits (dg sums the
    // consumers' groups in another order). Without the Hopper kernels the switch changes nothing.
    Rng rng(test_seed(9818));
    const ScopedSwitch form_switch("MOEBLAZE_CUDA_B1_FORM");
    struct Shape {
      int64_t d, h;
    };
    std::vector<Shape> shapes = {{64, 296}, {576, 1000}};
    if (!quick()) shapes.push_back({1088, 296});
    for (const Shape& sh : shapes) {
      for (int32_t dtype : {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16}) {
        for (int32_t act : {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_SILU}) {
          for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_PREACT, MOEBLAZE_CHECKPOINT_SAVE_ALL,
                               MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
            if (quick() && (dtype != MOEBLAZE_DTYPE_BF16 || ckpt == MOEBLAZE_CHECKPOINT_SAVE_ALL))
              continue;
            moeblaze_layer_config_t cfg = make_config(dtype, sh.d, sh.h, 5, 2);
            cfg.activation = act;
            cfg.checkpoint = ckpt;
            CAPTURE(describe(cfg));
            CpuReference ref(cfg, 150, rng, "skewed");  // experts 3, 4 (nearly) empty
            LayerRun& rc = ref.run;
            LayerRun want = rc;  // inputs; the CPU's outputs land in rc
            MB_CHECK(rc.experts_forward());
            MB_CHECK(rc.experts_backward());
            std::vector<LayerRun> got;
            for (const char* form : {"consumers", "warps", "split", "split2"}) {
              const std::string form_name = form;  // CAPTURE prints a char pointer's address
              CAPTURE(form_name);
              form_switch.set(form);
              const LayerRun rg = gpu_experts_run(cfg, want, 0);
              check_close("y", rg.y, rc.y, dtype, sh.h * 2);
              check_close("dx", rg.dx, rc.dx, dtype, 2 * sh.h * 2);
              check_close("dg", rg.dg, rc.dg, dtype, sh.h + sh.d);
              check_close("dw_down", rg.dw_down, rc.dw_down, dtype, 150);
              check_close("dw_gate", rg.dw_gate, rc.dw_gate, dtype, 150);
              if (rg.gated) check_close("dw_up", rg.dw_up, rc.dw_up, dtype, 150);
              if (got.size() >= 2) {  // the split forms against the epilogue-warp form
                const LayerRun& warps = got[1];
                CHECK(rg.y.bitwise_equal(warps.y));
                CHECK(rg.dx.bitwise_equal(warps.dx));
                CHECK(rg.dw_down.bitwise_equal(warps.dw_down));
                CHECK(rg.dw_gate.bitwise_equal(warps.dw_gate));
                if (rg.gated) CHECK(rg.dw_up.bitwise_equal(warps.dw_up));
              }
              got.push_back(rg);
            }
          }
        }
      }
    }
#endif
  }

  TEST_CASE("cuda: F1's epilogue forms match the CPU and each other bit for bit") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    // MOEBLAZE_CUDA_F1_FORM forces the Hopper F1's epilogue form (f1_gemm.cu) whatever the
    // k-steps a tile: the consumers' form (the policy above 64 k-steps), the epilogue warps (the
    // policy up to 64) and the split form, whose consumers store a quarter of the tile's rows from
    // the hand-off (the policy up to 8 for non-gated activations), all round a, b once and form u
    // by the same arithmetic, so every output must keep its bits from one to another.
    // d = 64 (1 k-step), 576 (9), 2112 (33) and 4160 (65: past the threshold, where the policy
    // takes the consumers' form); h = 296: a last tile of 40 columns; skewed routing leaves
    // tiles of fewer rows than the consumers' quads cover. SAVE_PREACT
    // stores a, b (and u transiently); RECOMPUTE's backward runs F1 again into the rows of da|db
    // (ab_ld = 2h); SAVE_ALL keeps u.
    Rng rng(test_seed(9957));
    std::vector<int64_t> depths = {64, 2112};
    if (!quick()) depths.insert(depths.end(), {576, 4160});
    for (int64_t d : depths) {
      for (int32_t act : {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_SILU}) {
        for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_PREACT, MOEBLAZE_CHECKPOINT_RECOMPUTE,
                             MOEBLAZE_CHECKPOINT_SAVE_ALL}) {
          if (quick() && ckpt == MOEBLAZE_CHECKPOINT_SAVE_ALL) continue;
          moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, d, 296, 5, 2);
          cfg.activation = act;
          cfg.checkpoint = ckpt;
          CAPTURE(describe(cfg));
          // "neither": any other value means the policy
          check_switch_keeps_bits_skewed("MOEBLAZE_CUDA_F1_FORM",
                                         {"consumers", "warps", "split", "neither"}, cfg, 200, rng);
        }
      }
    }
#endif
  }

  TEST_CASE("cuda: 2-CTA clusters give one CTA's bits") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    // MOEBLAZE_CUDA_F1_CLUSTER=2 (F1's epilogue-warp form, opt-in) and MOEBLAZE_CUDA_ROWS_CLUSTER=2
    // (the epilogue-warp forms of F2, B4 and B1) run those kernels in clusters of two CTAs on
    // adjacent m-tiles of one expert, each loading part of a stage's B for both: the same tiles'
    // arithmetic, so every output must keep its bits. Skewed routing gives experts an odd number of
    // m-tiles (a cluster's second CTA without rows); non-gated h = 296 ends in an F1 tile whose
    // second box lies past h (loaded by neither CTA); d = 2112 puts B1 in its warps form (33
    // k-steps); k = 1 stores F2's and B4's rows at their tokens.
    Rng rng(test_seed(9959));
    for (const char* knob : {"MOEBLAZE_CUDA_F1_CLUSTER", "MOEBLAZE_CUDA_ROWS_CLUSTER"}) {
      for (int64_t d : {int64_t(64), int64_t(2112)}) {
        for (int64_t k : {int64_t(2), int64_t(1)}) {
          for (int32_t act : {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_SILU}) {
            for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_PREACT, MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
              if (quick() && (d != 2112 || k != 2 || ckpt != MOEBLAZE_CHECKPOINT_SAVE_PREACT))
                continue;
              moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, d, 296, 5, k);
              cfg.activation = act;
              cfg.checkpoint = ckpt;
              const std::string knob_name = knob;
              CAPTURE(knob_name);
              CAPTURE(describe(cfg));
              // "neither": any other value means the policy
              check_switch_keeps_bits_skewed(knob, {"1", "2", "neither"}, cfg, 300, rng);
            }
          }
        }
      }
    }
#endif
  }

  TEST_CASE("cuda: F2's and B4's two store forms match the CPU and each other bit for bit") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    // MOEBLAZE_CUDA_ROWS_FORM: F2 and B4 store their rows from the consumers' registers, or hand
    // them, rounded as stored, to the epilogue warps, which store whole rows; or (pingpong,
    // pingpong128, pingpong2cta) each consumer warpgroup computes and stores its own tiles of 192
    // or 128 columns (pingpong2cta: two CTAs whose tiles share B, each loading half of it for
    // both; skewed routing leaves one of them without rows at some experts' ends), with the same
    // k order: the same values at the same places, so every output must keep its bits. d = 296 (a
    // last tile of 40 columns) and 1000 (232); k = 2 (rows, then the per-token reduction) and k = 1
    // (direct rows: each row stored at its token); F16 as well as BF16; row chunks of d too
    // (MOEBLAZE_CUDA_ROW_CHUNKS).
    Rng rng(test_seed(9973));
    const ScopedSwitch chunk_switch("MOEBLAZE_CUDA_ROW_CHUNKS");
    // F2 alone in another form or number of column chunks (MOEBLAZE_CUDA_F2_ROWS_FORM,
    // MOEBLAZE_CUDA_F2_CHUNKS), B4 as the policy has it.
    chunk_switch.set("2");
    for (int64_t k : {int64_t(2), int64_t(1)}) {
      moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, 1000, 264, 5, k);
      CAPTURE(describe(cfg));
      check_switch_keeps_bits_skewed("MOEBLAZE_CUDA_F2_ROWS_FORM",
                                     {"pingpong2cta", "pingpong", "consumers", "neither"}, cfg, 700,
                                     rng);
      check_switch_keeps_bits_skewed("MOEBLAZE_CUDA_F2_CHUNKS", {"1", "3", "0"}, cfg, 700, rng);
    }
    for (const char* chunks : {"1", "2"}) {
      if (quick() && std::string(chunks) == "2") continue;
      chunk_switch.set(chunks);
      for (int64_t d : {int64_t(296), int64_t(1000)}) {
        for (int32_t dtype : {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16}) {
          for (int64_t k : {int64_t(2), int64_t(1)}) {
            for (int32_t act : {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_SILU}) {
              if (quick() && (dtype != MOEBLAZE_DTYPE_BF16 || act != MOEBLAZE_ACTIVATION_SWIGLU))
                continue;
              moeblaze_layer_config_t cfg = make_config(dtype, d, 264, 5, k);
              cfg.activation = act;
              const std::string chunk_name = chunks;
              CAPTURE(chunk_name);
              CAPTURE(describe(cfg));
              // "neither": any other value means the policy
              check_switch_keeps_bits_skewed(
                  "MOEBLAZE_CUDA_ROWS_FORM",
                  {"consumers", "warps", "pingpong", "pingpong128", "pingpong2cta", "neither"}, cfg,
                  300, rng);
            }
          }
        }
      }
    }
#endif
  }

  TEST_CASE("cuda: the grouped GEMMs' tile rasterisation changes no bit") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    // MOEBLAZE_CUDA_BAND_MTILES (sm90/device.hpp) sets how many m-tiles of an expert the n-tiles
    // of F1, F2, B4 and B1 sweep together: it orders the tiles, so every output must keep its bits
    // whatever the band (1: n-tiles innermost per m-tile; 3: bands that do not divide the experts'
    // m-tiles; 256: one band per expert), and values out of range must mean the defaults. 700
    // routed rows a shape: experts of 0 to ~6 m-tiles under skewed routing. Quick mode (under
    // compute-sanitizer; racecheck ran out of a 200 s budget on the full set) keeps one activation
    // and the bands 8, 1, 3 and one out-of-range value.
    Rng rng(test_seed(9931));
    const std::vector<int32_t> activations =
        quick() ? std::vector<int32_t>{MOEBLAZE_ACTIVATION_SWIGLU}
                : std::vector<int32_t>{MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_SILU};
    const std::vector<const char*> bands =
        quick() ? std::vector<const char*>{"8", "1", "3", "x"}
                : std::vector<const char*>{"8", "1", "3", "256", "0", "x", "257"};
    for (int32_t act : activations) {
      for (int64_t d : {int64_t(64), int64_t(576)}) {
        moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, d, 1000, 5, 2);
        cfg.activation = act;
        CAPTURE(describe(cfg));
        check_switch_keeps_bits_skewed("MOEBLAZE_CUDA_BAND_MTILES", bands, cfg, 350, rng);
      }
    }
#endif
  }

  TEST_CASE("cuda: k = 1 direct rows give the reduction's bits; dropped tokens get zero rows") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    // With k = 1, F2 and B4 write y and dx themselves (experts.cu, direct_rows);
    // MOEBLAZE_CUDA_DIRECT_ROWS = 0 sends them through the rows and the per-token reduction.
    // Both must give the same bits for every output, match the CPU, and (ids out of range, which
    // CUDA drops without a host sync) leave a dropped token's y and dx rows exactly zero. BF16/F16
    // take the Hopper kernels where present, F32 the portable ones.
    Rng rng(test_seed(9909));
    const ScopedSwitch direct_switch("MOEBLAZE_CUDA_DIRECT_ROWS");
    struct Shape {
      int64_t d, h, E, T;
    };
    std::vector<Shape> shapes = {{64, 96, 4, 150}, {40, 72, 3, 61}};
    if (!quick()) shapes.push_back({256, 384, 8, 700});
    for (int32_t dtype : {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16, MOEBLAZE_DTYPE_F32}) {
      for (int32_t act : {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_SILU}) {
        for (const Shape& sh : shapes) {
          for (bool drop : {false, true}) {
            moeblaze_layer_config_t cfg = make_config(dtype, sh.d, sh.h, sh.E, 1);
            cfg.activation = act;
            CAPTURE(describe(cfg));
            CAPTURE(sh.T);
            CAPTURE(drop);
            Context cpu;
            Layer lc(cpu, cfg);
            LayerRun rc(lc, sh.T);
            rc.init_random(rng);
            rc.clear_outputs();
            LayerRun want = rc;  // inputs; the CPU's outputs land in rc
            std::vector<int64_t> dropped;
            if (drop) {
              for (int64_t t = 0; t < sh.T; t += 7) {
                want.ids[size_t(t)] = int32_t(t % 14 == 0 ? sh.E : -1);
                dropped.push_back(t);
              }
            } else {
              MB_CHECK(rc.experts_forward());
              MB_CHECK(rc.experts_backward());
            }
            std::vector<LayerRun> got;
            for (const char* direct : {"0", "1"}) {
              CAPTURE(direct);
              direct_switch.set(direct);
              // y and dx start at 7, not zero: the dropped rows must be written.
              const LayerRun rg = gpu_experts_run(cfg, want, 0, 7.0);
              if (!drop) {
                check_close("y", rg.y, rc.y, dtype, sh.h * 2);
                check_close("dx", rg.dx, rc.dx, dtype, 2 * sh.h * 2);
                check_close("dg", rg.dg, rc.dg, dtype, sh.h + sh.d);
                check_close("dw_down", rg.dw_down, rc.dw_down, dtype, sh.T);
                check_close("dw_gate", rg.dw_gate, rc.dw_gate, dtype, sh.T);
              }
              for (int64_t t : dropped) {
                for (int64_t c = 0; c < sh.d; ++c) {
                  const double yv = rg.y.get(t * sh.d + c), dxv = rg.dx.get(t * sh.d + c);
                  if (yv != 0.0 || dxv != 0.0 || std::signbit(yv) || std::signbit(dxv)) {
                    FAIL_CHECK("dropped token " << t << " column " << c << ": y " << yv << ", dx "
                                                << dxv << " (want +0)");
                    break;
                  }
                }
              }
              if (!got.empty()) check_experts_bitwise(rg, got.front());  // the reduction's bits
              got.push_back(rg);
            }
          }
        }
      }
    }
#endif
  }

  TEST_CASE(
      "cuda: whole layer forward/backward matches the CPU; bitwise reproducible; CUDA graph") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    Gpu ctx;
    Rng rng(test_seed(9505));
    for (int32_t dtype : {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F32}) {
      moeblaze_layer_config_t cfg = make_config(dtype, 128, 192, 8, 2);
      cfg.renormalize = 1;
      cfg.aux_loss_coeff = 0.01f;
      cfg.z_loss_coeff = 0.001f;
      CAPTURE(describe(cfg));
      const int64_t T = 333;
      Layer lc(ctx.cpu, cfg), lg(ctx.gpu, cfg);
      LayerRun rc(lc, T), rg(lg, T);
      rc.init_random(rng);
      rc.use_d_losses = true;
      copy_inputs(rc, rg);
      rc.clear_outputs();
      rg.clear_outputs();
      MB_CHECK(rc.layer_forward());
      MB_CHECK(rc.layer_backward());

      DeviceRun dev(rg);
      dev.run_training_step(MOEBLAZE_PASS_LAYER_FORWARD);
      CHECK(rg.ids_out == rc.ids_out);
      CHECK(rg.expert_counts == rc.expert_counts);
      check_close("logits", rg.logits, rc.logits, dtype, cfg.d_model);
      check_close("g", rg.g_out, rc.g_out, MOEBLAZE_DTYPE_F32, cfg.num_experts);
      check_close("losses", rg.losses, rc.losses, MOEBLAZE_DTYPE_F32, T);
      check_close("y", rg.y, rc.y, dtype, cfg.d_ffn * cfg.top_k);
      check_close("dx", rg.dx, rc.dx, dtype, 2 * cfg.d_ffn * cfg.top_k + cfg.num_experts);
      check_close("dw_gate", rg.dw_gate, rc.dw_gate, dtype, T);
      check_close("dw_up", rg.dw_up, rc.dw_up, dtype, T);
      check_close("dw_down", rg.dw_down, rc.dw_down, dtype, T);
      // d_logits is a function of dg, which carries the storage dtype's rounding (a, b, u).
      check_close("d_logits", rg.d_logits, rc.d_logits, dtype, cfg.d_ffn);
      // dw_router is a reduction over T of d_logits * x; d_logits is rounded to the storage dtype.
      check_close("dw_router", rg.dw_router, rc.dw_router, dtype, T);

      // Bitwise identical across runs.
      const LayerRun first = rg;
      for (int rep = 0; rep < 2; ++rep) {
        rg.clear_outputs();
        dev.upload_all();
        MB_CHECK(dev.enqueue_forward(nullptr));
        MB_CHECK(dev.enqueue_backward(nullptr));
        dev.sync_download();
        CHECK(rg.y.bitwise_equal(first.y));
        CHECK(rg.dx.bitwise_equal(first.dx));
        CHECK(rg.dw_gate.bitwise_equal(first.dw_gate));
        CHECK(rg.dw_up.bitwise_equal(first.dw_up));
        CHECK(rg.dw_down.bitwise_equal(first.dw_down));
        CHECK(rg.dw_router.bitwise_equal(first.dw_router));
        CHECK(rg.d_logits.bitwise_equal(first.d_logits));
        CHECK(rg.losses.bitwise_equal(first.losses));
      }

      // The whole layer forward + backward captured in a CUDA graph, replayed: same bits.
      cudaStream_t stream;
      CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      rg.clear_outputs();
      dev.upload_all();
      cudaGraph_t graph = nullptr;
      CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const moeblaze_status_t fs = dev.enqueue_forward(stream);
      const moeblaze_status_t bs = dev.enqueue_backward(stream);
      const cudaError_t end = cudaStreamEndCapture(stream, &graph);
      MB_CHECK(fs);
      MB_CHECK(bs);
      CUDA_OK(end);
      cudaGraphExec_t exec = nullptr;
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      for (int rep = 0; rep < 2; ++rep) {
        CUDA_OK(cudaGraphLaunch(exec, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
      }
      dev.sync_download();
      CHECK(rg.y.bitwise_equal(first.y));
      CHECK(rg.dx.bitwise_equal(first.dx));
      CHECK(rg.dw_gate.bitwise_equal(first.dw_gate));
      CHECK(rg.dw_down.bitwise_equal(first.dw_down));
      CHECK(rg.dw_router.bitwise_equal(first.dw_router));
      CHECK(rg.d_logits.bitwise_equal(first.d_logits));
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(stream);
    }
#endif
  }

  TEST_CASE("cuda: inference forward (no saved buffer) gives the training y") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    Gpu ctx;
    Rng rng(test_seed(9606));
    for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
      moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, 64, 128, 4, 2);
      cfg.checkpoint = ckpt;
      Layer lg(ctx.gpu, cfg);
      LayerRun rg(lg, 200);
      rg.init_random(rng);
      DeviceRun dev(rg);
      dev.upload_all();
      dev.prepare(MOEBLAZE_PASS_EXPERTS_FORWARD, true);
      MB_CHECK(dev.enqueue_forward(nullptr));
      dev.sync_download();
      const HostTensor trained = rg.y;
      rg.y.fill(NAN);
      dev.upload_all();
      dev.prepare(MOEBLAZE_PASS_EXPERTS_FORWARD, false);
      MB_CHECK(dev.enqueue_forward(nullptr));
      dev.sync_download();
      CHECK(rg.y.bitwise_equal(trained));
    }
#endif
  }

  TEST_CASE("cuda: a training forward runs in the FORWARD_WITH_SAVED workspace, same bits") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    // With a saved buffer the forward writes its routing indices (and under SAVE_ALL u, and for
    // the whole layer the router outputs) there, so its workspace is smaller (experts.cu). Every
    // other case here already runs training forwards in exactly that size (DeviceRun); this one
    // checks the plain size gives the same bits and that an inference forward refuses the lean
    // size. bf16 takes the Hopper kernels where present; d = 1088 also B1's epilogue warps.
    Gpu ctx;
    Rng rng(test_seed(9616));
    struct Shape {
      int64_t d, h, E, k, T;
    };
    for (const Shape& sh : {Shape{64, 128, 4, 2, 200}, Shape{1088, 200, 4, 2, 300}}) {
      for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_SAVE_PREACT}) {
        for (int32_t pass : {MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_LAYER_FORWARD}) {
          moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_BF16, sh.d, sh.h, sh.E, sh.k);
          cfg.checkpoint = ckpt;
          CAPTURE(describe(cfg));
          CAPTURE(pass);
          Layer lg(ctx.gpu, cfg);
          const size_t plain = lg.workspace_size(pass, sh.T);
          const size_t lean = lg.workspace_size(pass, sh.T, MOEBLAZE_FORWARD_WITH_SAVED);
          CHECK(lean < plain);
          // The experts forward drops the index arrays and (SAVE_ALL) u; the layer forward's lean
          // size is at least its router sub-calls' workspace (cuBLASLt's among them), so only
          // the experts pass is held to the full difference.
          if (pass == MOEBLAZE_PASS_EXPERTS_FORWARD) {
            CHECK(lean + 2 * sizeof(int32_t) * size_t(sh.T * sh.k) <= plain);
            if (ckpt == MOEBLAZE_CHECKPOINT_SAVE_ALL) {
              CHECK(lean + 2 * size_t(sh.T * sh.k * sh.h) <= plain);
            }
          }
          LayerRun rg(lg, sh.T);
          rg.init_random(rng);
          std::vector<LayerRun> got;
          for (bool lean_workspace : {true, false}) {
            rg.clear_outputs();
            DeviceRun dev(rg);
            dev.lean_training_workspace = lean_workspace;
            dev.upload_all();
            dev.prepare(pass, true);
            CHECK(dev.ws_fwd.size() == (lean_workspace ? lean : plain));
            MB_CHECK(dev.enqueue_forward(nullptr));
            MB_CHECK(dev.enqueue_backward(nullptr));
            dev.sync_download();
            int64_t non_finite = 0;
            for (int64_t i = 0; i < rg.y.numel(); ++i) non_finite += !std::isfinite(rg.y.get(i));
            CHECK(non_finite == 0);
            if (!got.empty()) {
              check_experts_bitwise(rg, got.front());
              CHECK(rg.ids_out == got.front().ids_out);
              CHECK(rg.g_out.bitwise_equal(got.front().g_out));
            }
            got.push_back(rg);
          }
          // Inference in the lean size: refused before anything runs.
          DeviceRun dev(rg);
          dev.upload_all();
          dev.prepare(pass, false);
          dev.ws_fwd.alloc(lean);
          CHECK(dev.enqueue_forward(nullptr) == MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE);
        }
      }
    }
#endif
  }

  TEST_CASE("cuda: pointers from the wrong memory space are refused, not dereferenced") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    Gpu ctx;
    moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 8, 8, 4, 2);
    Layer lc(ctx.cpu, cfg);
    Layer lg(ctx.gpu, cfg);
    const int64_t T = 3;
    std::vector<float> host_logits(T * 4, 0.5f), host_g(T * 2);
    std::vector<int32_t> host_ids(T * 2);
    DevBuf dev_logits, dev_ids, dev_g;
    dev_logits.upload(host_logits.data(), host_logits.size() * sizeof(float));
    dev_ids.alloc(host_ids.size() * sizeof(int32_t));
    dev_g.alloc(host_g.size() * sizeof(float));
    size_t ws = 0;
    MB_CHECK(moeblaze_layer_workspace_size(lc.get(), MOEBLAZE_PASS_ROUTER_FORWARD, T, &ws));
    std::vector<double> host_ws(ws / sizeof(double) + 2);
    // A GPU pointer given to the CPU backend.
    CHECK(moeblaze_router_forward(lc.get(), T, dev_logits.get(), host_ids.data(), host_g.data(),
                                  nullptr, nullptr, host_ws.data(), ws,
                                  nullptr) == MOEBLAZE_ERR_INVALID_ARGUMENT);
    CHECK(std::string(moeblaze_last_error()).find("logits") != std::string::npos);
    // A host pointer given to the CUDA backend.
    MB_CHECK(moeblaze_layer_workspace_size(lg.get(), MOEBLAZE_PASS_ROUTER_FORWARD, T, &ws));
    DevBuf dev_ws;
    dev_ws.alloc(ws);
    CHECK(moeblaze_router_forward(
              lg.get(), T, host_logits.data(), static_cast<int32_t*>(dev_ids.get()), dev_g.get(),
              nullptr, nullptr, dev_ws.get(), ws, nullptr) == MOEBLAZE_ERR_INVALID_ARGUMENT);
    CHECK(std::string(moeblaze_last_error()).find("logits") != std::string::npos);
    // The right spaces work.
    MB_CHECK(moeblaze_router_forward(lg.get(), T, dev_logits.get(),
                                     static_cast<int32_t*>(dev_ids.get()), dev_g.get(), nullptr,
                                     nullptr, dev_ws.get(), ws, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
#endif
  }

  // RECOMPUTE (a, b recomputed into the da|db buffer) and SAVE_ALL must give SAVE_PREACT's bits,
  // with and without a consumed saved buffer.
  TEST_CASE("cuda: checkpoint policies and a consumed saved buffer give bitwise identical layers") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    Rng rng(test_seed(9808));
    // The whole layer forward + backward of `run` on its layer's backend, the backward called with
    // `bwd_flags` and a workspace sized for them.
    auto run_layer = [](LayerRun& run, uint32_t bwd_flags = 0) {
      run.clear_outputs();
      DeviceRun dev(run);
      dev.run_training_step(MOEBLAZE_PASS_LAYER_FORWARD, bwd_flags);
    };
    // Under compute-sanitizer (quick mode) one dtype and one activation cover the same kernels.
    const std::vector<int32_t> dtypes =
        quick() ? std::vector<int32_t>{MOEBLAZE_DTYPE_BF16}
                : std::vector<int32_t>{MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16, MOEBLAZE_DTYPE_F32};
    const std::vector<int32_t> activations =
        quick() ? std::vector<int32_t>{MOEBLAZE_ACTIVATION_SWIGLU}
                : std::vector<int32_t>{MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_GELU};
    for (int32_t dtype : dtypes) {
      for (int32_t act : activations) {
        moeblaze_layer_config_t base = make_config(dtype, 256, 384, 8, 2);
        base.activation = act;
        base.checkpoint = MOEBLAZE_CHECKPOINT_SAVE_PREACT;
        CAPTURE(describe(base));
        const int64_t T = quick() ? 150 : 700;
        Gpu ctx;
        Layer l0(ctx.gpu, base);
        LayerRun r0(l0, T);
        r0.init_random(rng);
        run_layer(r0);
        auto check_same = [&](const LayerRun& r) {
          CHECK(r.y.bitwise_equal(r0.y));
          CHECK(r.dx.bitwise_equal(r0.dx));
          CHECK(r.dw_gate.bitwise_equal(r0.dw_gate));
          if (r.gated) CHECK(r.dw_up.bitwise_equal(r0.dw_up));
          CHECK(r.dw_down.bitwise_equal(r0.dw_down));
          CHECK(r.dw_router.bitwise_equal(r0.dw_router));
          CHECK(r.d_logits.bitwise_equal(r0.d_logits));
        };
        {
          Gpu variant;
          for (int32_t ckpt : {MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_SAVE_PREACT,
                               MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
            CAPTURE(ckpt);
            moeblaze_layer_config_t c = base;
            c.checkpoint = ckpt;
            Layer l(variant.gpu, c);
            LayerRun r(l, T);
            copy_inputs(r0, r);
            run_layer(r);
            check_same(r);
            // MOEBLAZE_BACKWARD_CONSUME_SAVED: da|db written over the saved a|b, the same bits, and
            // an experts workspace smaller by exactly the da|db region (none saved under
            // RECOMPUTE). The layer workspace holds the largest of its sub-calls' workspaces: at
            // this small size the router projection's cuBLASLt workspace can be that one, so the
            // layer saves at most the experts' difference.
            for (int32_t pass : {MOEBLAZE_PASS_EXPERTS_BACKWARD, MOEBLAZE_PASS_LAYER_BACKWARD}) {
              size_t plain = 0, consumed = 0;
              MB_CHECK(moeblaze_layer_workspace_size(l.get(), pass, T, &plain));
              MB_CHECK(moeblaze_layer_workspace_size_with_flags(
                  l.get(), pass, T, MOEBLAZE_BACKWARD_CONSUME_SAVED, &consumed));
              const size_t elem = c.dtype == MOEBLAZE_DTYPE_F32 ? 4 : 2;
              const size_t halves = act == MOEBLAZE_ACTIVATION_SWIGLU ? 2 : 1;  // gated: da|db
              const size_t dadb = elem * size_t(T * c.top_k) * size_t(c.d_ffn) * halves;
              CAPTURE(pass);
              if (ckpt == MOEBLAZE_CHECKPOINT_RECOMPUTE) {
                CHECK(consumed == plain);
              } else if (pass == MOEBLAZE_PASS_EXPERTS_BACKWARD) {
                CHECK(plain - consumed >= dadb);
                CHECK(plain - consumed <= dadb + 256);  // the region's alignment padding
              } else {
                CHECK(consumed <= plain);
                CHECK(plain - consumed <= dadb + 256);
              }
            }
            LayerRun rc(l, T);
            copy_inputs(r0, rc);
            run_layer(rc, MOEBLAZE_BACKWARD_CONSUME_SAVED);
            check_same(rc);
          }
        }
      }
    }
#endif
  }

}  // TEST_SUITE("cuda")
