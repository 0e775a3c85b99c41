// "Execute calls never allocate": every execute entry point, run on the CPU backend with several
// worker threads, makes no heap allocation through operator new. This test binary replaces the
// global operator new (libmoeblaze links libstdc++ dynamically, so its allocations resolve here
// too) and counts the calls made, on any thread, while a moeblaze execute call runs. Size queries,
// plan creation and error paths (which build a message) may allocate; execute calls that succeed
// may not.
#include <execinfo.h>
#include <link.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include "support/test_support.hpp"

namespace {

std::atomic<bool> g_counting{false};
std::atomic<long> g_allocations{0};

// MOEBLAZE_TEST_ALLOCATION_BACKTRACES=1 prints the stack of every counted allocation to stderr, to
// find where an execute call allocates (addr2line -f -C -e libmoeblaze.so <offset> names the
// library's hidden functions).
const bool g_print_backtraces = std::getenv("MOEBLAZE_TEST_ALLOCATION_BACKTRACES") != nullptr;
thread_local bool t_printing_backtrace = false;  // what backtrace() itself allocates is not counted

void print_allocation_backtrace(std::size_t bytes) {
  t_printing_backtrace = true;
  char line[64];
  const int length =
      std::snprintf(line, sizeof line, "---- counted allocation of %zu bytes\n", bytes);
  if (length > 0) (void)!write(STDERR_FILENO, line, size_t(length));
  void* frames[48];
  backtrace_symbols_fd(frames, backtrace(frames, 48), STDERR_FILENO);
  t_printing_backtrace = false;
}

void* counted_alloc(std::size_t bytes, std::size_t alignment) {
  if (g_counting.load(std::memory_order_relaxed) && !t_printing_backtrace) {
    g_allocations.fetch_add(1);
    if (g_print_backtraces) print_allocation_backtrace(bytes);
  }
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

#define CHECK_NO_ALLOCATION(call)                                                                 \
  do {                                                                                            \
    moeblaze_status_t status_ = MOEBLAZE_OK;                                                      \
    const long allocations_ = allocations_during([&] { return (call); }, &status_);               \
    CHECK_MESSAGE(status_ == MOEBLAZE_OK, #call ": " << status_text(status_));                    \
    CHECK_MESSAGE(allocations_ == 0, #call " made " << allocations_                               \
                                                    << " heap allocations"                        \
                                                       " (MOEBLAZE_TEST_ALLOCATION_BACKTRACES=1 " \
                                                       "prints where)");                          \
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

  TEST_CASE("expert-parallel execute calls make no heap allocation (LOCAL transport, 2 ranks)") {
    // Each rank runs on its own thread: setup and one warm-up step may allocate; then, with the
    // counter on, one more forward_begin / forward_finish / backward per rank, concurrently (the
    // exchange rendezvous between them is part of what is measured).
    constexpr int32_t kWorld = 2;
    constexpr int64_t kD = 16, kH = 24, kE = 4, kK = 2;
    const int64_t tokens[kWorld] = {7, 5};
    moeblaze_layer_config_t cfg;
    MB_CHECK(moeblaze_layer_config_init(&cfg, sizeof cfg));
    cfg.dtype = MOEBLAZE_DTYPE_F32;
    cfg.d_model = kD;
    cfg.d_ffn = kH;
    cfg.num_experts = kE;
    cfg.top_k = kK;
    cfg.aux_loss_coeff = 0.01f;  // the loss-share paths run too
    cfg.z_loss_coeff = 0.001f;
    moeblaze_ep_group_t group = nullptr;
    MB_CHECK(moeblaze_ep_local_group_create(&group, kWorld));

    struct RankState {
      moeblaze_status_t status = MOEBLAZE_OK;
      std::string error;  // set only outside the measured window
      int64_t recv_rows = -1;
    };
    RankState state[kWorld];
    std::atomic<int> ready{0}, done{0};
    std::atomic<bool> go{false};

    auto rank_main = [&](int32_t rank) {
      RankState& st = state[rank];
      auto fail = [&](moeblaze_status_t status) {
        st.status = status;
        st.error = moeblaze_last_error();
      };
      moeblaze_context_t ctx = nullptr;
      moeblaze_ep_layer_t layer = nullptr;
      const int64_t T = tokens[rank];
      moeblaze_status_t status = moeblaze_context_create(&ctx, MOEBLAZE_BACKEND_CPU, 0);
      if (status == MOEBLAZE_OK) status = moeblaze_context_set_num_threads(ctx, 2);
      moeblaze_ep_config_t ep;
      if (status == MOEBLAZE_OK) status = moeblaze_ep_config_init(&ep, sizeof ep);
      if (status == MOEBLAZE_OK) {
        ep.transport = MOEBLAZE_EP_TRANSPORT_LOCAL;
        ep.rank = rank;
        ep.world_size = kWorld;
        ep.communicator = group;
        status = moeblaze_ep_layer_create(&layer, ctx, &cfg, &ep);
      }
      int64_t begin = 0, end = 0;
      if (status == MOEBLAZE_OK) status = moeblaze_ep_layer_get_experts(layer, &begin, &end);
      const int64_t local = end - begin;
      Rng rng(700 + uint64_t(rank));
      HostTensor x(MOEBLAZE_DTYPE_F32, {T, kD}), dy(MOEBLAZE_DTYPE_F32, {T, kD});
      HostTensor w_router(MOEBLAZE_DTYPE_F32, {kE, kD}), y(MOEBLAZE_DTYPE_F32, {T, kD});
      HostTensor w_gate(MOEBLAZE_DTYPE_F32, {local, kH, kD}),
          w_up(MOEBLAZE_DTYPE_F32, {local, kH, kD});
      HostTensor w_down(MOEBLAZE_DTYPE_F32, {local, kD, kH}), dx(MOEBLAZE_DTYPE_F32, {T, kD});
      HostTensor dw_router(MOEBLAZE_DTYPE_F32, {kE, kD});
      HostTensor dw_gate(MOEBLAZE_DTYPE_F32, {local, kH, kD}),
          dw_up(MOEBLAZE_DTYPE_F32, {local, kH, kD});
      HostTensor dw_down(MOEBLAZE_DTYPE_F32, {local, kD, kH});
      HostTensor losses(MOEBLAZE_DTYPE_F32, {2}), d_losses(MOEBLAZE_DTYPE_F32, {2});
      d_losses.set(0, 1.0);
      d_losses.set(1, 1.0);
      std::vector<int32_t> expert_counts(size_t(kE), 0);
      for (HostTensor* t : {&x, &dy, &w_router, &w_gate, &w_up, &w_down}) fill_normal(*t, rng, 0.5);
      size_t exchange_bytes = 0, home_bytes = 0, begin_ws = 0;
      if (status == MOEBLAZE_OK) status = moeblaze_ep_layer_exchange_size(layer, &exchange_bytes);
      if (status == MOEBLAZE_OK)
        status = moeblaze_ep_layer_saved_size(layer, MOEBLAZE_EP_SAVED_HOME, T, 0, &home_bytes);
      if (status == MOEBLAZE_OK)
        status = moeblaze_ep_layer_workspace_size(layer, MOEBLAZE_EP_PASS_FORWARD_BEGIN, T, 0,
                                                  &begin_ws);
      AlignedBytes exchange(exchange_bytes), home(home_bytes), ws_begin(begin_ws);
      AlignedBytes expert, ws_finish, ws_backward;
      moeblaze_ep_forward_args_t fa;
      moeblaze_ep_backward_args_t ba;
      if (status == MOEBLAZE_OK) status = moeblaze_ep_forward_args_init(&fa, sizeof fa);
      if (status == MOEBLAZE_OK) status = moeblaze_ep_backward_args_init(&ba, sizeof ba);
      fa.num_tokens = T;
      fa.x = x.data();
      fa.w_router = w_router.data();
      fa.w_gate = w_gate.data();
      fa.w_up = w_up.data();
      fa.w_down = w_down.data();
      fa.y = y.data();
      fa.losses = losses.data();
      fa.expert_counts = expert_counts.data();
      fa.home_saved = home.data();
      fa.home_saved_bytes = home.size();
      ba.num_tokens = T;
      ba.dy = dy.data();
      ba.d_losses = d_losses.data();
      ba.x = x.data();
      ba.w_router = w_router.data();
      ba.w_gate = w_gate.data();
      ba.w_up = w_up.data();
      ba.w_down = w_down.data();
      ba.home_saved = home.data();
      ba.home_saved_bytes = home.size();
      ba.dx = dx.data();
      ba.dw_router = dw_router.data();
      ba.dw_gate = dw_gate.data();
      ba.dw_up = dw_up.data();
      ba.dw_down = dw_down.data();
      // One step; buffers that depend on the received rows are sized on the first (warm-up) call.
      auto step = [&](bool size_buffers) {
        fa.workspace = ws_begin.data();
        fa.workspace_bytes = ws_begin.size();
        moeblaze_status_t s = moeblaze_ep_forward_begin(layer, &fa, exchange.data(),
                                                        exchange.size(), &st.recv_rows, nullptr);
        if (s != MOEBLAZE_OK) return s;
        if (size_buffers) {
          size_t expert_bytes = 0, finish_ws = 0, backward_ws = 0;
          s = moeblaze_ep_layer_saved_size(layer, MOEBLAZE_EP_SAVED_EXPERT, T, st.recv_rows,
                                           &expert_bytes);
          if (s == MOEBLAZE_OK)
            s = moeblaze_ep_layer_workspace_size(layer, MOEBLAZE_EP_PASS_FORWARD_FINISH, T,
                                                 st.recv_rows, &finish_ws);
          if (s == MOEBLAZE_OK)
            s = moeblaze_ep_layer_workspace_size(layer, MOEBLAZE_EP_PASS_BACKWARD, T, st.recv_rows,
                                                 &backward_ws);
          if (s != MOEBLAZE_OK) return s;
          expert.resize(expert_bytes);
          ws_finish.resize(finish_ws);
          ws_backward.resize(backward_ws);
        }
        fa.expert_saved = expert.data();
        fa.expert_saved_bytes = expert.size();
        fa.workspace = ws_finish.data();
        fa.workspace_bytes = ws_finish.size();
        s = moeblaze_ep_forward_finish(layer, &fa, exchange.data(), exchange.size(), nullptr);
        if (s != MOEBLAZE_OK) return s;
        ba.expert_saved = expert.data();
        ba.expert_saved_bytes = expert.size();
        ba.workspace = ws_backward.data();
        ba.workspace_bytes = ws_backward.size();
        return moeblaze_ep_backward(layer, &ba, exchange.data(), exchange.size(), nullptr);
      };
      if (status == MOEBLAZE_OK) status = step(true);
      if (status != MOEBLAZE_OK) fail(status);
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      // The measured step runs even after a failed setup (it then fails fast) so that the other
      // rank is not left waiting inside the exchange.
      const moeblaze_status_t measured = st.status == MOEBLAZE_OK ? step(false) : st.status;
      done.fetch_add(1);
      if (st.status == MOEBLAZE_OK && measured != MOEBLAZE_OK) fail(measured);
      moeblaze_ep_layer_destroy(layer);
      moeblaze_context_destroy(ctx);
    };

    std::vector<std::thread> threads;
    for (int32_t rank = 0; rank < kWorld; ++rank) threads.emplace_back(rank_main, rank);
    while (ready.load() < kWorld) std::this_thread::yield();
    g_allocations.store(0);
    g_counting.store(true);
    go.store(true);
    while (done.load() < kWorld) std::this_thread::yield();
    g_counting.store(false);
    const long allocations = g_allocations.load();
    for (std::thread& t : threads) t.join();
    moeblaze_ep_local_group_destroy(group);
    for (int32_t rank = 0; rank < kWorld; ++rank) {
      CAPTURE(rank);
      CHECK_MESSAGE(state[rank].status == MOEBLAZE_OK, status_text(state[rank].status)
                                                           << ": " << state[rank].error);
      CHECK(state[rank].recv_rows >= 0);
    }
    CHECK_MESSAGE(allocations == 0,
                  "one EP step on 2 ranks made "
                      << allocations
                      << " heap allocations (MOEBLAZE_TEST_ALLOCATION_BACKTRACES=1 prints where)");
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
