// "Execute calls never allocate": every execute entry point, run on the CPU backend with several
// worker threads, makes no heap allocation through operator new. This test binary replaces the
// global operator new (libmoeblaze links libstdc++ dynamically, so its allocations resolve here
// too) and counts the calls made, on any thread, while a moeblaze execute call runs. Size queries,
// plan creation and error paths (which build a message) may allocate; execute calls that succeed
// may not.
#include <link.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>

#include "support/test_support.hpp"

namespace {

std::atomic<bool> g_counting{false};
std::atomic<long> g_allocations{0};

void* counted_alloc(std::size_t bytes, std::size_t alignment) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  if (bytes == 0) bytes = 1;
  void* p = nullptr;
  if (alignment <= alignof(std::max_align_t)) {
    p = std::malloc(bytes);
  } else {
    bytes = (bytes + alignment - 1) / alignment * alignment;
    p = std::aligned_alloc(alignment, bytes);
  }
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(std::size_t bytes) {
  return counted_alloc(bytes, 0);
}
void* operator new[](std::size_t bytes) {
  return counted_alloc(bytes, 0);
}
void* operator new(std::size_t bytes, std::align_val_t alignment) {
  return counted_alloc(bytes, static_cast<std::size_t>(alignment));
}
void* operator new[](std::size_t bytes, std::align_val_t alignment) {
  return counted_alloc(bytes, static_cast<std::size_t>(alignment));
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}

namespace {

using namespace mbtest;

// Counts the allocations made while `call` runs; returns its status through `status`.
template <typename Call>
long allocations_during(Call&& call, moeblaze_status_t* status) {
  g_allocations.store(0);
  g_counting.store(true);
  *status = call();
  g_counting.store(false);
  return g_allocations.load();
}

// True when a shared libstdc++ is loaded: only then do the library's operator new calls resolve to
// this program's replacement. A toolchain that links libstdc++ statically into the library and the
// program (the GPU machine's GCC 13 does) gives each its own operator new, and the counter above
// cannot see the library's allocations at all.
bool shared_libstdcxx_loaded() {
  bool found = false;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        if (info->dlpi_name && std::strstr(info->dlpi_name, "libstdc++.so"))
          *static_cast<bool*>(data) = true;
        return 0;
      },
      &found);
  return found;
}

#define CHECK_NO_ALLOCATION(call)                                                            \
  do {                                                                                       \
    moeblaze_status_t status_ = MOEBLAZE_OK;                                                 \
    const long allocations_ = allocations_during([&] { return (call); }, &status_);          \
    CHECK_MESSAGE(status_ == MOEBLAZE_OK, #call ": " << status_text(status_));               \
    CHECK_MESSAGE(allocations_ == 0, #call " made " << allocations_ << " heap allocations"); \
  } while (0)

}  // namespace

TEST_SUITE("cpu") {
  TEST_CASE("execute calls make no heap allocation (every entry point, worker threads on)") {
    for (int32_t dtype : {MOEBLAZE_DTYPE_F32, MOEBLAZE_DTYPE_BF16}) {
      for (int32_t checkpoint : {MOEBLAZE_CHECKPOINT_SAVE_PREACT, MOEBLAZE_CHECKPOINT_RECOMPUTE}) {
        moeblaze_layer_config_t cfg;
        MB_CHECK(moeblaze_layer_config_init(&cfg, sizeof cfg));
        cfg.dtype = dtype;
        cfg.d_model = 64;
        cfg.d_ffn = 96;
        cfg.num_experts = 8;
        cfg.top_k = 2;
        cfg.checkpoint = checkpoint;
        cfg.aux_loss_coeff = 0.01f;
        cfg.z_loss_coeff = 0.001f;
        CAPTURE(dtype);
        CAPTURE(checkpoint);

        Context context;
        MB_CHECK(moeblaze_context_set_num_threads(context.get(), 3));
        Layer layer(context, cfg);
        const int64_t T = 300;
        LayerRun run(layer, T);
        Rng rng(test_seed(4242));
        run.init_random(rng);

        // Buffers sized once, for the largest pass, before anything is counted.
        size_t ws = 0;
        for (int32_t pass = MOEBLAZE_PASS_ROUTER_FORWARD; pass <= MOEBLAZE_PASS_LAYER_BACKWARD;
             ++pass) {
          size_t bytes = 0;
          MB_CHECK(moeblaze_layer_workspace_size(layer.get(), pass, T, &bytes));
          ws = std::max(ws, bytes);
        }
        size_t experts_saved = 0, layer_saved = 0;
        MB_CHECK(moeblaze_layer_saved_size(layer.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, T,
                                           &experts_saved));
        MB_CHECK(
            moeblaze_layer_saved_size(layer.get(), MOEBLAZE_PASS_LAYER_FORWARD, T, &layer_saved));
        run.workspace.resize(ws);
        run.saved.resize(std::max(experts_saved, layer_saved));
        std::vector<int32_t> offsets(size_t(cfg.num_experts + 1)), eti(size_t(T * cfg.top_k)),
            tim(size_t(T * cfg.top_k));

        moeblaze_forward_args_t experts_fwd = run.forward_args(true);
        moeblaze_forward_args_t layer_fwd = run.forward_args(true);
        layer_fwd.logits_out = run.logits.data();
        layer_fwd.ids_out = run.ids_out.data();
        layer_fwd.g_out = run.g_out.data();
        layer_fwd.losses = run.losses.data();
        moeblaze_backward_args_t experts_bwd = run.backward_args(LayerRun::Outputs(), 0);
        experts_bwd.dw_router = nullptr;
        experts_bwd.d_logits = nullptr;
        moeblaze_backward_args_t layer_bwd = run.backward_args(LayerRun::Outputs(), 0);
        layer_bwd.dg = nullptr;

        auto experts_forward = [&] {
          return moeblaze_experts_forward(layer.get(), &experts_fwd, nullptr);
        };
        auto experts_backward = [&] {
          return moeblaze_experts_backward(layer.get(), &experts_bwd, nullptr);
        };
        auto layer_forward = [&] {
          return moeblaze_layer_forward(layer.get(), &layer_fwd, nullptr);
        };
        auto layer_backward = [&] {
          return moeblaze_layer_backward(layer.get(), &layer_bwd, nullptr);
        };
        auto router_forward = [&] {
          return moeblaze_router_forward(layer.get(), T, run.logits.data(), run.ids_out.data(),
                                         run.g_out.data(), run.expert_counts.data(),
                                         run.losses.data(), run.workspace.data(), ws, nullptr);
        };
        auto router_backward = [&] {
          return moeblaze_router_backward(layer.get(), T, run.logits.data(), run.ids_out.data(),
                                          run.dg.data(), nullptr, run.d_logits.data(),
                                          run.workspace.data(), ws, nullptr);
        };
        auto routing_build = [&] {
          return moeblaze_routing_build(layer.get(), T, run.ids.data(), offsets.data(), eti.data(),
                                        tim.data(), run.workspace.data(), ws, nullptr);
        };

        // Warm-up: the worker pool starts its threads on first use.
        MB_CHECK(experts_forward());
        MB_CHECK(layer_forward());
        run.dg.fill(0.25);

        CHECK_NO_ALLOCATION(experts_forward());
        CHECK_NO_ALLOCATION(experts_backward());
        CHECK_NO_ALLOCATION(layer_forward());
        CHECK_NO_ALLOCATION(layer_backward());
        CHECK_NO_ALLOCATION(router_forward());
        CHECK_NO_ALLOCATION(router_backward());
        CHECK_NO_ALLOCATION(routing_build());
      }
    }
  }

  TEST_CASE("the allocation counter sees allocations made inside the library") {
    // Creating a context builds the backend and its thread pool on the heap, inside the library:
    // the counter must notice, or the test above could pass vacuously. (An error path is not a
    // reliable probe: the thread-local message string reuses its capacity from earlier errors.)
    moeblaze_status_t status = MOEBLAZE_ERR_INTERNAL;
    moeblaze_context_t ctx = nullptr;
    const long allocations = allocations_during(
        [&ctx] { return moeblaze_context_create(&ctx, MOEBLAZE_BACKEND_CPU, 0); }, &status);
    CHECK(status == MOEBLAZE_OK);
    if (ctx) moeblaze_context_destroy(ctx);
    if (!shared_libstdcxx_loaded()) {
      // Not a library defect, and not something this test can check: say so loudly instead.
      MESSAGE(
          "libstdc++ is linked statically here: the library's allocations bypass this "
          "program's operator new, so the no-allocation test above proves nothing on this "
          "toolchain (it is meaningful where libstdc++ is shared, e.g. in CI)");
      return;
    }
    CHECK(allocations > 0);
  }
}
