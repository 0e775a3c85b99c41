// The CUDA router at the edges of F32, against the CPU oracle: SIGMOID scores where every sigmoid
// of a token underflows (logits <= -89) must give the CPU's ids, weights, aux loss and d_logits,
// all finite; a z-loss that does not fit F32 is MOEBLAZE_ERR_NON_FINITE on the CPU and (the CUDA
// backend cannot report data-dependent errors without a host sync) +Inf in the CUDA losses.
#include <cfloat>
#include <cmath>
#include <vector>

#include "support/gpu_support.hpp"

using namespace mbtest;

#if defined(MOEBLAZE_TESTS_WITH_CUDA)
namespace {

class DeviceCopy {
 public:
  explicit DeviceCopy(size_t bytes) : bytes_(bytes) {
    if (bytes) CUDA_OK(cudaMalloc(&ptr_, bytes));
  }
  ~DeviceCopy() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }
  void up(const void* host) {
    if (bytes_) CUDA_OK(cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice));
  }
  void down(void* host) const {
    if (bytes_) CUDA_OK(cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost));
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

bool all_finite(const HostTensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (!std::isfinite(t.get(i))) return false;
  }
  return true;
}

}  // namespace
#endif

TEST_SUITE("cuda") {
  TEST_CASE("cuda: SIGMOID router with underflowing sigmoids matches the CPU, finite") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    Context cpu(MOEBLAZE_BACKEND_CPU), gpu(MOEBLAZE_BACKEND_CUDA, 0);
    const int64_t E = 6, k = 2, T = 5;
    const double u = -89.0, big = 3.0e38;
    const std::vector<double> rows = {
        u - 11, u - 1, u - 6,  u - 31, u - 0.5, u - 111,  // every logit <= -89
        -1000,  -1000, -1000,  -1000,  -1000,   -1000,    // ties: the lower ids
        -big,   -1e30, u,      u,      u - 400, -1e5,     // down to -3e38
        -0.7,   2.0,   0.25,   -3.0,   1.5,     0.0,      // the ordinary case
        u - 20, -big,  u - 20, -big,   -big,    -big,     // two equal picks among -3e38
    };
    for (int32_t renormalize : {1, 0}) {
      CAPTURE(renormalize);
      moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 8, 8, E, k);
      cfg.score_function = MOEBLAZE_SCORE_SIGMOID;
      cfg.renormalize = renormalize;
      cfg.aux_loss_coeff = 0.01f;
      Layer lc(cpu, cfg), lg(gpu, cfg);
      HostTensor logits(MOEBLAZE_DTYPE_F32, {T, E}), dg(MOEBLAZE_DTYPE_F32, {T, k});
      logits.from_vector(rows);
      for (int64_t i = 0; i < T * k; ++i) dg.set(i, 0.3 + 0.1 * double(i % 5) - 0.2 * (i % 2));
      // CPU
      std::vector<int32_t> ids_c(size_t(T * k)), ids_g(size_t(T * k));
      HostTensor g_c(MOEBLAZE_DTYPE_F32, {T, k}), g_g(MOEBLAZE_DTYPE_F32, {T, k});
      HostTensor loss_c(MOEBLAZE_DTYPE_F32, {2}), loss_g(MOEBLAZE_DTYPE_F32, {2});
      HostTensor dl_c(MOEBLAZE_DTYPE_F32, {T, E}), dl_g(MOEBLAZE_DTYPE_F32, {T, E});
      AlignedBytes ws(std::max(lc.workspace_size(MOEBLAZE_PASS_ROUTER_FORWARD, T),
                               lc.workspace_size(MOEBLAZE_PASS_ROUTER_BACKWARD, T)));
      MB_CHECK(moeblaze_router_forward(lc.get(), T, logits.data(), ids_c.data(), g_c.data(),
                                       nullptr, loss_c.data(), ws.data(), ws.size(), nullptr));
      MB_CHECK(moeblaze_router_backward(lc.get(), T, logits.data(), ids_c.data(), dg.data(),
                                        nullptr, dl_c.data(), ws.data(), ws.size(), nullptr));
      // GPU
      DeviceCopy d_logits(logits.bytes()), d_ids(ids_g.size() * 4), d_g(g_g.bytes()),
          d_loss(loss_g.bytes()), d_dg(dg.bytes()), d_dl(dl_g.bytes()),
          d_ws(std::max(lg.workspace_size(MOEBLAZE_PASS_ROUTER_FORWARD, T),
                        lg.workspace_size(MOEBLAZE_PASS_ROUTER_BACKWARD, T)));
      d_logits.up(logits.data());
      d_dg.up(dg.data());
      MB_CHECK(moeblaze_router_forward(lg.get(), T, d_logits.get(),
                                       static_cast<int32_t*>(d_ids.get()), d_g.get(), nullptr,
                                       d_loss.get(), d_ws.get(), d_ws.size(), nullptr));
      MB_CHECK(moeblaze_router_backward(lg.get(), T, d_logits.get(),
                                        static_cast<const int32_t*>(d_ids.get()), d_dg.get(),
                                        nullptr, d_dl.get(), d_ws.get(), d_ws.size(), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      d_ids.down(ids_g.data());
      d_g.down(g_g.data());
      d_loss.down(loss_g.data());
      d_dl.down(dl_g.data());
      CHECK(ids_g == ids_c);
      CHECK(all_finite(g_g));
      CHECK(all_finite(loss_g));
      CHECK(all_finite(dl_g));
      // Weights below the smallest normal float may flush to 0 on either side.
      compare("g", g_g, g_c.to_vector(), {double(FLT_MIN), 1e-5});
      compare("losses", loss_g, loss_c.to_vector(), {1e-7, 1e-4});
      compare("d_logits", dl_g, dl_c.to_vector(), {1e-7, 1e-4});
    }
#endif
  }

  TEST_CASE("cuda: a z-loss that overflows F32 is an error on the CPU, +Inf on CUDA") {
    SKIP_WITHOUT_GPU();
#if defined(MOEBLAZE_TESTS_WITH_CUDA)
    Context cpu(MOEBLAZE_BACKEND_CPU), gpu(MOEBLAZE_BACKEND_CUDA, 0);
    const int64_t E = 4, k = 2, T = 2;
    moeblaze_layer_config_t cfg = make_config(MOEBLAZE_DTYPE_F32, 8, 8, E, k);
    cfg.z_loss_coeff = 1e-3f;
    Layer lc(cpu, cfg), lg(gpu, cfg);
    HostTensor logits(MOEBLAZE_DTYPE_F32, {T, E});
    logits.from_vector({0.5, 1.0, -2.0, 0.0, 3.0e38, 1.0, -3.0e38, 2.0});
    std::vector<int32_t> ids(size_t(T * k));
    HostTensor g(MOEBLAZE_DTYPE_F32, {T, k}), losses(MOEBLAZE_DTYPE_F32, {2});
    AlignedBytes ws(lc.workspace_size(MOEBLAZE_PASS_ROUTER_FORWARD, T));
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_forward(lc.get(), T, logits.data(), ids.data(), g.data(), nullptr,
                                losses.data(), ws.data(), ws.size(), nullptr),
        MOEBLAZE_ERR_NON_FINITE, "z-loss");
    DeviceCopy d_logits(logits.bytes()), d_ids(ids.size() * 4), d_g(g.bytes()),
        d_loss(losses.bytes()), d_ws(lg.workspace_size(MOEBLAZE_PASS_ROUTER_FORWARD, T));
    d_logits.up(logits.data());
    MB_CHECK(moeblaze_router_forward(lg.get(), T, d_logits.get(),
                                     static_cast<int32_t*>(d_ids.get()), d_g.get(), nullptr,
                                     d_loss.get(), d_ws.get(), d_ws.size(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    d_loss.down(losses.data());
    CHECK(std::isinf(losses.get(1)));
    CHECK(losses.get(1) > 0);
#endif
  }
}
