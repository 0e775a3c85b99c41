// The CUDA backend: class CudaBackend (every Backend virtual), its factory, and the cuBLASLt router
// projection. Execute calls only enqueue work on the caller's stream: no allocation, no host
// synchronisation, all scratch carved from the caller's workspace by the same code that sizes it.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "common/backend.hpp"
#include "common/carver.hpp"
#include "common/status.hpp"
#include "cuda/cublaslt_api.hpp"
#include "cuda/cuda_util.cuh"
#include "cuda/engines/engine_set.hpp"
#include "cuda/ep_ops.hpp"
#include "cuda/experts.hpp"
#include "cuda/kernels.hpp"
#include "cuda/tuning.hpp"

#ifndef MOEBLAZE_CUDA_VERSION
#define MOEBLAZE_CUDA_VERSION "unknown"
#endif
#ifndef MOEBLAZE_CUDA_ARCH_LIST
#define MOEBLAZE_CUDA_ARCH_LIST ""
#endif

namespace moeblaze {
namespace cuda {
namespace {

// cuBLASLt scratch, carved from the router-projection workspace.
constexpr size_t kLtWorkspaceBytes = size_t(4) << 20;

cudaDataType_t cuda_type(Dtype dtype) {
  switch (dtype) {
    case Dtype::F32: return CUDA_R_32F;
    case Dtype::BF16: return CUDA_R_16BF;
    case Dtype::F16: return CUDA_R_16F;
    default: fail(MOEBLAZE_ERR_NOT_SUPPORTED, "dtype not supported by the CUDA backend");
  }
}

template <typename T>
__global__ void convert_f32_kernel(int64_t n, const float* in, T* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = from_f32<T>(in[i]);
}

// Column-major D[m,n] = alpha * op(A) op(B) + beta * C, with C == D. fp32 compute (exact fp32 for
// F32 operands: CUBLAS_COMPUTE_32F never uses TF32).
struct LtGemm {
  cublasOperation_t op_a, op_b;
  int64_t m, n, k;
  cudaDataType_t ab_type, d_type;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* d;
  int64_t ldd;
  float beta;
};

template <typename H>
struct LtHandle {
  H h = nullptr;
  cublasStatus_t (*destroy)(H) = nullptr;
  LtHandle() = default;
  LtHandle(const LtHandle&) = delete;
  LtHandle& operator=(const LtHandle&) = delete;
  ~LtHandle() {
    if (h && destroy) destroy(h);
  }
};

// What cuBLASLt needs besides the pointers: the descriptors and the algorithm its heuristic chose.
// Building them costs tens of microseconds and heap allocations inside cuBLASLt, so they are built
// once per GEMM shape and kept by the backend (LtPlanCache); the execute path then only enqueues.
struct LtPlan {
  LtHandle<cublasLtMatmulDesc_t> op;
  LtHandle<cublasLtMatrixLayout_t> la, lb, ld;
  cublasLtMatmulAlgo_t algo{};
};

std::shared_ptr<const LtPlan> make_lt_plan(cublasLtHandle_t handle, const LtGemm& g,
                                           size_t workspace_bytes) {
  const CublasLtApi& lt = cublaslt_api();
  auto plan = std::make_shared<LtPlan>();
  plan->op.destroy = lt.matmul_desc_destroy;
  check_lt(lt.matmul_desc_create(&plan->op.h, CUBLAS_COMPUTE_32F, CUDA_R_32F),
           "cublasLtMatmulDescCreate");
  check_lt(lt.matmul_desc_set_attribute(plan->op.h, CUBLASLT_MATMUL_DESC_TRANSA, &g.op_a,
                                        sizeof(g.op_a)),
           "cublasLtMatmulDescSetAttribute(TRANSA)");
  check_lt(lt.matmul_desc_set_attribute(plan->op.h, CUBLASLT_MATMUL_DESC_TRANSB, &g.op_b,
                                        sizeof(g.op_b)),
           "cublasLtMatmulDescSetAttribute(TRANSB)");
  const bool ta = g.op_a == CUBLAS_OP_T, tb = g.op_b == CUBLAS_OP_T;
  plan->la.destroy = plan->lb.destroy = plan->ld.destroy = lt.matrix_layout_destroy;
  check_lt(lt.matrix_layout_create(&plan->la.h, g.ab_type, ta ? g.k : g.m, ta ? g.m : g.k, g.lda),
           "cublasLtMatrixLayoutCreate(A)");
  check_lt(lt.matrix_layout_create(&plan->lb.h, g.ab_type, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb),
           "cublasLtMatrixLayoutCreate(B)");
  check_lt(lt.matrix_layout_create(&plan->ld.h, g.d_type, g.m, g.n, g.ldd),
           "cublasLtMatrixLayoutCreate(D)");
  LtHandle<cublasLtMatmulPreference_t> pref;
  pref.destroy = lt.preference_destroy;
  check_lt(lt.preference_create(&pref.h), "cublasLtMatmulPreferenceCreate");
  check_lt(lt.preference_set_attribute(pref.h, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                       &workspace_bytes, sizeof(workspace_bytes)),
           "cublasLtMatmulPreferenceSetAttribute");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  check_lt(lt.algo_get_heuristic(handle, plan->op.h, plan->la.h, plan->lb.h, plan->ld.h, plan->ld.h,
                                 pref.h, 1, &result, &found),
           "cublasLtMatmulAlgoGetHeuristic");
  MB_REQUIRE(found > 0, MOEBLAZE_ERR_NOT_SUPPORTED,
             "cuBLASLt has no algorithm for the router GEMM");
  plan->algo = result.algo;
  return plan;
}

// Plans by GEMM shape (not by pointer: the same plan serves any buffers of that shape). A layer
// uses a handful of shapes per token count T, so the cache stays small; past kMaxPlans distinct
// shapes (a caller cycling through many T) it starts over rather than grow without bound. Shared
// by every thread using the backend: plans are immutable once built, the map is mutex-guarded.
class LtPlanCache {
 public:
  // A shared reference: a plan stays alive for a caller even if another thread clears the cache.
  std::shared_ptr<const LtPlan> get(cublasLtHandle_t handle, const LtGemm& g,
                                    size_t workspace_bytes) {
    const Key key{int(g.op_a),   int(g.op_b), g.m,   g.n,   g.k,         int(g.ab_type),
                  int(g.d_type), g.lda,       g.ldb, g.ldd, g.beta != 0, workspace_bytes};
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = plans_.find(key);
    if (found != plans_.end()) return found->second;
    if (plans_.size() >= kMaxPlans) plans_.clear();
    return plans_.emplace(key, make_lt_plan(handle, g, workspace_bytes)).first->second;
  }

 private:
  static constexpr size_t kMaxPlans = 256;
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int, int, int64_t, int64_t, int64_t,
                         bool, size_t>;
  std::mutex mutex_;
  std::map<Key, std::shared_ptr<const LtPlan>> plans_;
};

void lt_matmul(cublasLtHandle_t handle, LtPlanCache& cache, const LtGemm& g, void* workspace,
               size_t workspace_bytes, cudaStream_t stream) {
  const std::shared_ptr<const LtPlan> plan = cache.get(handle, g, workspace_bytes);
  const float alpha = 1.f;
  check_lt(cublaslt_api().matmul(handle, plan->op.h, &alpha, g.a, plan->la.h, g.b, plan->lb.h,
                                 &g.beta, g.d, plan->ld.h, g.d, plan->ld.h, &plan->algo, workspace,
                                 workspace_bytes, stream),
           "cublasLtMatmul");
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int32_t device)
      : device_(device), tuning_(CudaTuning::from_environment(device)) {
    DeviceGuard guard(device_);
    check_lt(cublaslt_api().create(&lt_), "cublasLtCreate");  // loads cuBLASLt (cublaslt_api.hpp)
    EngineSet::prepare_device(device_);  // kernel attributes, outside any graph capture
  }
  ~CudaBackend() override {
    if (lt_) {
      int previous = 0;
      const bool have = cudaGetDevice(&previous) == cudaSuccess;
      cudaSetDevice(device_);
      cublaslt_api().destroy(lt_);
      if (have) cudaSetDevice(previous);
    }
  }

  int32_t kind() const override { return MOEBLAZE_BACKEND_CUDA; }
  int32_t device() const override { return device_; }

  void check_supported(const LayerDesc& desc) const override {
    MB_REQUIRE(desc.dtype != Dtype::F64, MOEBLAZE_ERR_NOT_SUPPORTED,
               "dtype F64 is supported by the CPU backend only");
    MB_REQUIRE(desc.E <= 1024, MOEBLAZE_ERR_NOT_SUPPORTED, "the CUDA backend supports E <= 1024");
  }

  size_t workspace_size(const LayerDesc& desc, Pass pass, int64_t T,
                        uint32_t flags) const override {
    Carver measure;
    switch (pass) {
      case Pass::RouterForward:
        cuda::router_forward(desc, T, nullptr, nullptr, nullptr, nullptr, nullptr, measure, false,
                             nullptr);
        break;
      case Pass::RouterBackward:
        cuda::router_backward(desc, T, nullptr, nullptr, nullptr, nullptr, nullptr, measure, false,
                              nullptr);
        break;
      case Pass::RoutingBuild:
        cuda::routing_build(desc, T, nullptr, nullptr, nullptr, nullptr, nullptr, measure, false,
                            nullptr);
        break;
      case Pass::RouterProjectForward: carve_project_forward(measure, desc, T); break;
      case Pass::RouterProjectBackward: carve_project_backward(measure, desc, T); break;
      case Pass::ExpertsForward: {
        ExpertsForwardCall call;
        call.T = T;
        call.has_saved = (flags & MOEBLAZE_FORWARD_WITH_SAVED) != 0;
        cuda::experts_forward(desc, call, measure, false, tuning_);
        break;
      }
      case Pass::ExpertsBackward: {
        ExpertsBackwardCall call;
        call.T = T;
        call.consume_saved = (flags & MOEBLAZE_BACKWARD_CONSUME_SAVED) != 0;
        cuda::experts_backward(desc, call, measure, false, tuning_);
        break;
      }
      case Pass::LayerForward:
      case Pass::LayerBackward: {
        // Composed by the API layer from the other passes; report the largest as a safe bound.
        size_t largest = 0;
        for (Pass p : {Pass::RouterForward, Pass::RouterBackward, Pass::RouterProjectForward,
                       Pass::RouterProjectBackward, Pass::ExpertsForward, Pass::ExpertsBackward}) {
          const size_t s = workspace_size(desc, p, T, flags);
          largest = s > largest ? s : largest;
        }
        return largest;
      }
    }
    return measure.size();
  }

  void router_forward(const LayerDesc& desc, const RouterForwardCall& call) override {
    DeviceGuard guard(device_);
    Carver ws(call.workspace.ptr);
    cuda::router_forward(desc, call.T, static_cast<const float*>(call.logits), call.ids,
                         static_cast<float*>(call.g), call.expert_counts,
                         static_cast<float*>(call.losses), ws, true, as_stream(call.stream));
  }

  void router_backward(const LayerDesc& desc, const RouterBackwardCall& call) override {
    DeviceGuard guard(device_);
    Carver ws(call.workspace.ptr);
    cuda::router_backward(desc, call.T, static_cast<const float*>(call.logits), call.ids,
                          static_cast<const float*>(call.dg),
                          static_cast<const float*>(call.d_losses),
                          static_cast<float*>(call.d_logits), ws, true, as_stream(call.stream));
  }

  void routing_build(const LayerDesc& desc, const RoutingBuildCall& call) override {
    DeviceGuard guard(device_);
    Carver ws(call.workspace.ptr);
    cuda::routing_build(desc, call.T, call.ids, call.expert_offsets, call.expert_token_indices,
                        call.token_index_map, nullptr, ws, true, as_stream(call.stream));
  }

  void router_project_forward(const LayerDesc& desc,
                              const RouterProjectForwardCall& call) override {
    DeviceGuard guard(device_);
    Carver ws(call.workspace.ptr);
    void* lt_ws = carve_project_forward(ws, desc, call.T);
    if (call.T == 0) return;
    LtGemm g;
    g.op_a = CUBLAS_OP_T;
    g.op_b = CUBLAS_OP_N;
    g.m = desc.E;
    g.n = call.T;
    g.k = desc.d;
    g.ab_type = cuda_type(desc.dtype);
    g.d_type = CUDA_R_32F;
    g.a = call.w_router;
    g.lda = desc.d;
    g.b = call.x;
    g.ldb = desc.d;
    g.d = call.logits;
    g.ldd = desc.E;
    g.beta = 0.f;
    lt_matmul(lt_, lt_plans_, g, lt_ws, kLtWorkspaceBytes, as_stream(call.stream));
  }

  // d_logits is fp32 while x and w_router are in the storage dtype. For 16-bit layers d_logits is
  // rounded to the storage dtype by a small kernel (cuBLASLt has no fp32 x bf16 matmul) and both
  // GEMMs run on tensor cores with fp32 accumulation: dw_router and dx get the same relative error
  // as their own final rounding. F32 layers use d_logits as it is (exact fp32).
  void router_project_backward(const LayerDesc& desc,
                               const RouterProjectBackwardCall& call) override {
    DeviceGuard guard(device_);
    Carver ws(call.workspace.ptr);
    void* dl_storage = nullptr;
    void* lt_ws = carve_project_backward(ws, desc, call.T, &dl_storage);
    cudaStream_t stream = as_stream(call.stream);
    if (call.T == 0) {
      if (call.dw_router && !call.accumulate_wgrad)
        check(
            cudaMemsetAsync(call.dw_router, 0, desc.elem_size() * size_t(desc.E * desc.d), stream),
            "cudaMemsetAsync(dw_router)");
      return;
    }
    const void* dl = call.d_logits;
    if (desc.dtype != Dtype::F32) {
      const int64_t n = call.T * desc.E;
      MB_CUDA_DISPATCH_DTYPE(desc.dtype, {
        convert_f32_kernel<scalar_t><<<blocks_for(n, 256), 256, 0, stream>>>(
            n, static_cast<const float*>(call.d_logits), static_cast<scalar_t*>(dl_storage));
      });
      check_launch("convert_f32_kernel");
      dl = dl_storage;
    }
    const cudaDataType_t t = cuda_type(desc.dtype);
    if (call.dw_router) {
      LtGemm g;
      g.op_a = CUBLAS_OP_N;
      g.op_b = CUBLAS_OP_T;
      g.m = desc.d;
      g.n = desc.E;
      g.k = call.T;
      g.ab_type = t;
      g.d_type = t;
      g.a = call.x;
      g.lda = desc.d;
      g.b = dl;
      g.ldb = desc.E;
      g.d = call.dw_router;
      g.ldd = desc.d;
      g.beta = call.accumulate_wgrad ? 1.f : 0.f;
      lt_matmul(lt_, lt_plans_, g, lt_ws, kLtWorkspaceBytes, stream);
    }
    if (call.dx) {
      LtGemm g;
      g.op_a = CUBLAS_OP_N;
      g.op_b = CUBLAS_OP_N;
      g.m = desc.d;
      g.n = call.T;
      g.k = desc.E;
      g.ab_type = t;
      g.d_type = t;
      g.a = call.w_router;
      g.lda = desc.d;
      g.b = dl;
      g.ldb = desc.E;
      g.d = call.dx;
      g.ldd = desc.d;
      g.beta = 1.f;
      lt_matmul(lt_, lt_plans_, g, lt_ws, kLtWorkspaceBytes, stream);
    }
  }

  void experts_forward(const LayerDesc& desc, const ExpertsForwardCall& call) override {
    DeviceGuard guard(device_);
    Carver ws(call.workspace.ptr);
    cuda::experts_forward(desc, call, ws, true, tuning_);
  }

  void experts_backward(const LayerDesc& desc, const ExpertsBackwardCall& call) override {
    DeviceGuard guard(device_);
    Carver ws(call.workspace.ptr);
    cuda::experts_backward(desc, call, ws, true, tuning_);
  }

  void copy(void* dst, const void* src, size_t bytes, void* stream) override {
    if (bytes == 0) return;
    DeviceGuard guard(device_);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)),
          "cudaMemcpyAsync");
  }

  // Expert parallelism (cuda/ep_ops.cu).
  void gather_rows(void* dst, const void* src, const int32_t* index, int64_t n, int64_t index_rows,
                   size_t row_bytes, void* stream) override {
    DeviceGuard guard(device_);
    ep_gather_rows(dst, src, index, n, index_rows, row_bytes, as_stream(stream));
  }
  void scatter_rows(void* dst, const void* src, const int32_t* index, int64_t n, int64_t index_rows,
                    size_t row_bytes, void* stream) override {
    DeviceGuard guard(device_);
    ep_scatter_rows(dst, src, index, n, index_rows, row_bytes, as_stream(stream));
  }
  void combine_rows(Dtype dtype, void* out, const void* rows, const int32_t* index, int64_t T,
                    int64_t k, int64_t d, int64_t index_rows, void* stream) override {
    DeviceGuard guard(device_);
    ep_combine_rows(dtype, out, rows, index, T, k, d, index_rows, as_stream(stream));
  }
  void local_expert_ids(const int32_t* table, int64_t W, int64_t E, int64_t expert_begin,
                        int64_t local_experts, int64_t R, int32_t* local_ids,
                        void* stream) override {
    DeviceGuard guard(device_);
    ep_local_expert_ids(table, W, E, expert_begin, local_experts, R, local_ids, as_stream(stream));
  }
  void global_counts(const int32_t* table, int64_t W, int64_t E, int32_t* counts,
                     void* stream) override {
    DeviceGuard guard(device_);
    ep_global_counts(table, W, E, counts, as_stream(stream));
  }
  void loss_shares_forward(const LayerDesc& desc, const LossShareCall& call,
                           void* losses) override {
    DeviceGuard guard(device_);
    ep_loss_shares_forward(desc, call, losses);
  }
  void loss_shares_backward(const LayerDesc& desc, const LossShareCall& call, const void* d_losses,
                            void* d_logits) override {
    DeviceGuard guard(device_);
    ep_loss_shares_backward(desc, call, d_losses, d_logits);
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes, void* stream) override {
    DeviceGuard guard(device_);
    ep_copy_to_host(host_dst, src, bytes, as_stream(stream));
  }
  void copy_between_ranks(void* dst, const void* src, size_t bytes) override {
    DeviceGuard guard(device_);
    ep_copy_between_ranks(dst, src, bytes);
  }
  void synchronize(void* stream) override {
    DeviceGuard guard(device_);
    ep_synchronize(as_stream(stream));
  }

  bool pointer_usable(const void* ptr) const override {
    if (ptr == nullptr) return true;
    cudaPointerAttributes attr{};
    const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky error; cannot tell
      return true;
    }
    // Managed memory is reachable from any device; device memory only from the context's own.
    if (attr.type == cudaMemoryTypeManaged) return true;
    return attr.type == cudaMemoryTypeDevice && attr.device == device_;
  }

 private:
  static void* carve_project_forward(Carver& ws, const LayerDesc& desc, int64_t T) {
    (void)desc;
    (void)T;
    return ws.carve(kLtWorkspaceBytes);
  }
  static void* carve_project_backward(Carver& ws, const LayerDesc& desc, int64_t T,
                                      void** dl_storage = nullptr) {
    void* dl = desc.dtype == Dtype::F32 ? nullptr : ws.carve(desc.elem_size() * size_t(T * desc.E));
    if (dl_storage) *dl_storage = dl;
    return ws.carve(kLtWorkspaceBytes);
  }

  int32_t device_;
  const CudaTuning tuning_;  // read once, at creation (tuning.hpp)
  cublasLtHandle_t lt_ = nullptr;
  LtPlanCache lt_plans_;  // descriptors only: independent of the lt_ handle's lifetime
};

}  // namespace
}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(int32_t device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    fail(MOEBLAZE_ERR_NOT_SUPPORTED, "no usable CUDA device: %s: %s", cudaGetErrorName(err),
         cudaGetErrorString(err));
  }
  MB_REQUIRE(device >= 0 && device < count, MOEBLAZE_ERR_INVALID_ARGUMENT,
             "device %d out of range (%d CUDA devices)", int(device), count);
  int major = 0;
  cuda::check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
              "cudaDeviceGetAttribute");
  MB_REQUIRE(major >= 8, MOEBLAZE_ERR_NOT_SUPPORTED,
             "CUDA device %d has compute capability %d.x; moeblaze needs 8.0 or newer", int(device),
             major);
  return std::make_unique<cuda::CudaBackend>(device);
}

bool cuda_pointer_is_device_memory(const void* ptr) {
  // Asked on every CPU-backend call: only touch the CUDA runtime when a GPU exists (decided once).
  static const bool have_gpu = [] {
    int count = 0;
    const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    (void)cudaGetLastError();
    return ok;
  }();
  if (!have_gpu || ptr == nullptr) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice;
}

bool cuda_backend_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  for (int i = 0; i < count; ++i) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, i) == cudaSuccess &&
        major >= 8)
      return cuda::cublaslt_available();  // a context also needs cuBLASLt (loaded at run time)
  }
  (void)cudaGetLastError();
  return false;
}

const char* cuda_build_info() {
  return "CUDA " MOEBLAZE_CUDA_VERSION "," MOEBLAZE_CUDA_ARCH_LIST;
}

}  // namespace moeblaze
