// The CPU reference backend: plain loops, accumulation in float (double for F64 layers), threaded
// with a static partition over output elements. It is the oracle the CUDA backend is tested
// against, so clarity beats speed here. Host memory only; `stream` arguments are ignored and every
// call is synchronous.
#include <cstring>
#include <memory>

#include "cpu/cpu_kernels.hpp"

namespace moeblaze {
namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend() = default;

  int32_t kind() const override { return MOEBLAZE_BACKEND_CPU; }
  int32_t device() const override { return 0; }

  // Device memory handed to the CPU backend would be dereferenced on the host: refuse it.
  bool pointer_usable(const void* ptr) const override {
    return !cuda_pointer_is_device_memory(ptr);
  }

  void check_supported(const LayerDesc& desc) const override {
    MB_REQUIRE(desc.k <= MOEBLAZE_MAX_TOP_K, MOEBLAZE_ERR_NOT_SUPPORTED,
               "CPU backend: top_k = %lld exceeds %d", (long long)desc.k, MOEBLAZE_MAX_TOP_K);
  }

  // The CPU backend ignores MOEBLAZE_BACKWARD_CONSUME_SAVED (its backward is a reference, not a
  // memory-bound path) but honours MOEBLAZE_FORWARD_WITH_SAVED, so the API's sizes can be tested
  // anywhere.
  size_t workspace_size(const LayerDesc& desc, Pass pass, int64_t T,
                        uint32_t flags) const override {
    Carver measure;
    switch (pass) {
      case Pass::RouterForward: cpu::carve_router_forward_scratch(measure, desc, T); break;
      case Pass::RouterBackward: cpu::carve_router_backward_scratch(measure, desc, T); break;
      case Pass::RoutingBuild: cpu::carve_routing_scratch(measure, desc, T); break;
      case Pass::ExpertsForward:
        cpu::carve_experts_forward_scratch(measure, desc, T,
                                           (flags & MOEBLAZE_FORWARD_WITH_SAVED) != 0);
        break;
      case Pass::ExpertsBackward: cpu::carve_experts_backward_scratch(measure, desc, T); break;
      case Pass::RouterProjectForward:
      case Pass::RouterProjectBackward: break;  // stack tiles only
      case Pass::LayerForward:
      case Pass::LayerBackward:
        fail(MOEBLAZE_ERR_INTERNAL,
             "CPU backend: workspace_size(pass %d) is composed by the API layer", int(pass));
    }
    return measure.size();
  }

  void router_forward(const LayerDesc& desc, const RouterForwardCall& call) override {
    cpu::router_forward(desc, call, pool_);
  }
  void router_backward(const LayerDesc& desc, const RouterBackwardCall& call) override {
    cpu::router_backward(desc, call, pool_);
  }
  void routing_build(const LayerDesc& desc, const RoutingBuildCall& call) override {
    Carver carver(call.workspace.ptr);
    const cpu::RoutingScratch scratch = cpu::carve_routing_scratch(carver, desc, call.T);
    cpu::build_routing(desc, call.T, call.ids, call.expert_offsets, call.expert_token_indices,
                       call.token_index_map, scratch, pool_);
  }
  void router_project_forward(const LayerDesc& desc,
                              const RouterProjectForwardCall& call) override {
    cpu::router_project_forward(desc, call, pool_);
  }
  void router_project_backward(const LayerDesc& desc,
                               const RouterProjectBackwardCall& call) override {
    cpu::router_project_backward(desc, call, pool_);
  }
  void experts_forward(const LayerDesc& desc, const ExpertsForwardCall& call) override {
    cpu::experts_forward(desc, call, pool_);
  }
  void experts_backward(const LayerDesc& desc, const ExpertsBackwardCall& call) override {
    cpu::experts_backward(desc, call, pool_);
  }

  void copy(void* dst, const void* src, size_t bytes, void* stream) override {
    if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
  }

  void set_num_threads(int32_t num_threads) override { pool_.set_num_threads(num_threads); }

  // Expert parallelism: host memory, synchronous.
  void gather_rows(void* dst, const void* src, const int32_t* index, int64_t n, int64_t index_rows,
                   size_t row_bytes, void*) override {
    cpu::ep_gather_rows(dst, src, index, n, index_rows, row_bytes);
  }
  void scatter_rows(void* dst, const void* src, const int32_t* index, int64_t n, int64_t index_rows,
                    size_t row_bytes, void*) override {
    cpu::ep_scatter_rows(dst, src, index, n, index_rows, row_bytes);
  }
  void combine_rows(Dtype dtype, void* out, const void* rows, const int32_t* index, int64_t T,
                    int64_t k, int64_t d, int64_t index_rows, void*) override {
    cpu::ep_combine_rows(dtype, out, rows, index, T, k, d, index_rows);
  }
  void local_expert_ids(const int32_t* table, int64_t W, int64_t E, int64_t expert_begin,
                        int64_t local_experts, int64_t R, int32_t* local_ids, void*) override {
    cpu::ep_local_expert_ids(table, W, E, expert_begin, local_experts, R, local_ids);
  }
  void global_counts(const int32_t* table, int64_t W, int64_t E, int32_t* counts, void*) override {
    cpu::ep_global_counts(table, W, E, counts);
  }
  void loss_shares_forward(const LayerDesc& desc, const LossShareCall& call,
                           void* losses) override {
    cpu::ep_loss_shares_forward(desc, call, losses);
  }
  void loss_shares_backward(const LayerDesc& desc, const LossShareCall& call, const void* d_losses,
                            void* d_logits) override {
    cpu::ep_loss_shares_backward(desc, call, d_losses, d_logits);
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes, void*) override {
    if (bytes) std::memcpy(host_dst, src, bytes);
  }
  void copy_between_ranks(void* dst, const void* src, size_t bytes) override {
    if (bytes && dst != src) std::memcpy(dst, src, bytes);
  }
  void synchronize(void*) override {}

 private:
  cpu::ThreadPool pool_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() {
  return std::make_unique<CpuBackend>();
}

}  // namespace moeblaze
