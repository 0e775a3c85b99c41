// The C ABI contract: every public entry point rejects bad input with the documented status and a
// message naming the argument, never crashes; handles, versioned structs, errors and versions
// behave as the header says. Runs on the CPU backend (always available).

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "support/test_support.hpp"

namespace {

using mbtest::AlignedBytes;

moeblaze_layer_config_t small_config(int32_t activation = MOEBLAZE_ACTIVATION_SWIGLU) {
  moeblaze_layer_config_t cfg = mbtest::make_config(MOEBLAZE_DTYPE_F32, 8, 12, 4, 2);
  cfg.activation = activation;
  return cfg;
}

// A layer of `cfg` on a CPU context of its own, alive as long as the layer.
class CpuLayer {
 public:
  explicit CpuLayer(const moeblaze_layer_config_t& cfg = small_config()) : layer_(context_, cfg) {}
  moeblaze_layer_t get() const { return layer_.get(); }

 private:
  mbtest::Context context_;
  mbtest::Layer layer_;
};

// Host buffers for one experts/layer call with T tokens of small_config(). Inputs are fixed
// (sin-based) values and a fixed routing, so the cases below can corrupt one element on purpose.
struct Buffers {
  static constexpr int64_t T = 5, d = 8, h = 12, E = 4, k = 2;
  std::vector<float> x, w_router, w_gate, w_up, w_down, y, g, dy, dx, dw_router, dw_gate, dw_up,
      dw_down, dg, logits, d_logits, losses;
  std::vector<int32_t> ids;
  AlignedBytes saved, workspace;
  // The sizes the library asked for (`workspace` may be grown past it for another pass).
  size_t saved_bytes = 0, workspace_bytes = 0;

  Buffers(moeblaze_layer_t layer, int32_t forward_pass, int32_t workspace_pass) {
    auto fill = [](std::vector<float>& v, size_t n, float scale) {
      v.resize(n);
      for (size_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.7f * float(i) + 0.3f);
    };
    fill(x, T * d, 1.0f);
    fill(w_router, E * d, 0.3f);
    fill(w_gate, E * h * d, 0.3f);
    fill(w_up, E * h * d, 0.3f);
    fill(w_down, E * d * h, 0.3f);
    fill(dy, T * d, 1.0f);
    y.assign(T * d, 0.0f);
    dx.assign(T * d, 0.0f);
    dw_router.assign(E * d, 0.0f);
    dw_gate.assign(E * h * d, 0.0f);
    dw_up.assign(E * h * d, 0.0f);
    dw_down.assign(E * d * h, 0.0f);
    dg.assign(T * k, 0.0f);
    fill(logits, T * E, 1.5f);
    d_logits.assign(T * E, 0.0f);
    losses.assign(2, 0.0f);
    ids = {0, 1, 2, 3, 1, 2, 3, 0, 0, 2};
    g = {0.6f, 0.4f, 0.7f, 0.3f, 0.5f, 0.5f, 0.9f, 0.1f, 0.2f, 0.8f};
    MB_CHECK(moeblaze_layer_saved_size(layer, forward_pass, T, &saved_bytes));
    MB_CHECK(moeblaze_layer_workspace_size(layer, workspace_pass, T, &workspace_bytes));
    saved.resize(saved_bytes);
    workspace.resize(workspace_bytes);
  }

  moeblaze_forward_args_t forward_args() {
    moeblaze_forward_args_t a;
    MB_CHECK(moeblaze_forward_args_init(&a, sizeof(a)));
    point_inputs(a);
    a.y = y.data();
    return a;
  }

  moeblaze_backward_args_t backward_args() {
    moeblaze_backward_args_t a;
    MB_CHECK(moeblaze_backward_args_init(&a, sizeof(a)));
    point_inputs(a);
    a.dy = dy.data();
    a.dx = dx.data();
    a.dw_router = dw_router.data();
    a.dw_gate = dw_gate.data();
    a.dw_up = dw_up.data();
    a.dw_down = dw_down.data();
    a.dg = dg.data();
    return a;
  }

 private:
  // The fields both args structs share.
  template <typename Args>
  void point_inputs(Args& a) {
    a.num_tokens = T;
    a.x = x.data();
    a.w_router = w_router.data();
    a.w_gate = w_gate.data();
    a.w_up = w_up.data();
    a.w_down = w_down.data();
    a.ids = ids.data();
    a.g = g.data();
    a.saved = saved.data();
    a.saved_bytes = saved_bytes;
    a.workspace = workspace.data();
    a.workspace_bytes = workspace_bytes;
  }
};

}  // namespace

TEST_SUITE("api") {
  TEST_CASE("versions and build info") {
    CHECK(moeblaze_get_version() == MOEBLAZE_VERSION);
    CHECK(moeblaze_get_abi_version() == MOEBLAZE_ABI_VERSION);
    const char* info = moeblaze_get_build_info();
    REQUIRE(info != nullptr);
    CHECK(std::string(info).find("moeblaze 0.1.0") != std::string::npos);
    MESSAGE("build: " << std::string(info));
  }

  TEST_CASE("status names and strings cover every code, never NULL") {
    const moeblaze_status_t codes[] = {MOEBLAZE_OK,
                                       MOEBLAZE_ERR_INVALID_ARGUMENT,
                                       MOEBLAZE_ERR_INVALID_HANDLE,
                                       MOEBLAZE_ERR_NOT_SUPPORTED,
                                       MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
                                       MOEBLAZE_ERR_OUT_OF_MEMORY,
                                       MOEBLAZE_ERR_CUDA,
                                       MOEBLAZE_ERR_VERSION_MISMATCH,
                                       MOEBLAZE_ERR_NON_FINITE,
                                       MOEBLAZE_ERR_INTERNAL};
    for (moeblaze_status_t code : codes) {
      CHECK(std::string(moeblaze_status_name(code)).rfind("MOEBLAZE_", 0) == 0);
      CHECK(std::string(moeblaze_status_name(code)) != "MOEBLAZE_ERR_UNKNOWN_STATUS");
      CHECK(std::string(moeblaze_status_string(code)).size() > 3);
    }
    CHECK(std::string(moeblaze_status_name(12345)) == "MOEBLAZE_ERR_UNKNOWN_STATUS");
    CHECK(std::string(moeblaze_status_string(-7)) == "unknown status code");
  }

  TEST_CASE("last error: never NULL, cleared on success, per thread, copyable") {
    moeblaze_context_t ctx = nullptr;
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_create(&ctx, 42, 0), MOEBLAZE_ERR_INVALID_ARGUMENT,
                             "backend");
    CHECK(ctx == nullptr);
    const std::string message = moeblaze_last_error();
    CHECK(message.find("moeblaze_context_create") != std::string::npos);

    // Another thread sees its own (empty) error, then its own failure; ours is untouched.
    std::string other_before, other_after;
    std::thread worker([&] {
      other_before = moeblaze_last_error();
      size_t bytes = 0;
      moeblaze_layer_workspace_size(nullptr, 0, 0, &bytes);
      other_after = moeblaze_last_error();
    });
    worker.join();
    CHECK(other_before.empty());
    CHECK(other_after.find("layer") != std::string::npos);
    CHECK(std::string(moeblaze_last_error()) == message);

    // Copy-out: the return value is the full size; short buffers are truncated and terminated.
    char small[8];
    const size_t needed = moeblaze_copy_last_error(small, sizeof(small));
    CHECK(needed == message.size() + 1);
    CHECK(std::strlen(small) == 7);
    CHECK(std::string(small) == message.substr(0, 7));
    CHECK(moeblaze_copy_last_error(nullptr, 0) == needed);

    MB_CHECK_OK(moeblaze_context_create(&ctx, MOEBLAZE_BACKEND_CPU, 0));
    CHECK(std::string(moeblaze_last_error()).empty());
    CHECK(moeblaze_copy_last_error(small, sizeof(small)) == 1);
    MB_CHECK_OK(moeblaze_context_destroy(ctx));
  }

  TEST_CASE("contexts: create, info, threads, destroy, bad input") {
    CHECK(moeblaze_backend_available(MOEBLAZE_BACKEND_CPU) == 1);
    CHECK(moeblaze_backend_available(0) == 0);
    CHECK(moeblaze_backend_available(7) == 0);

    moeblaze_context_t ctx = nullptr;
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_create(nullptr, MOEBLAZE_BACKEND_CPU, 0),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "out");
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_create(&ctx, 0, 0), MOEBLAZE_ERR_INVALID_ARGUMENT,
                             "backend");
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_create(&ctx, -1, 0), MOEBLAZE_ERR_INVALID_ARGUMENT,
                             "backend");
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_create(&ctx, MOEBLAZE_BACKEND_CPU, 1),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "device");
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_create(&ctx, MOEBLAZE_BACKEND_CPU, -3),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "device");
    CHECK(ctx == nullptr);
    if (!moeblaze_backend_available(MOEBLAZE_BACKEND_CUDA)) {
      MB_CHECK_STATUS_MENTIONS(moeblaze_context_create(&ctx, MOEBLAZE_BACKEND_CUDA, 0),
                               MOEBLAZE_ERR_NOT_SUPPORTED, "CUDA");
      CHECK(ctx == nullptr);
    }

    MB_CHECK_OK(moeblaze_context_create(&ctx, MOEBLAZE_BACKEND_CPU, 0));
    int32_t backend = -1, device = -1;
    MB_CHECK_OK(moeblaze_context_get_info(ctx, &backend, &device));
    CHECK(backend == MOEBLAZE_BACKEND_CPU);
    CHECK(device == 0);
    MB_CHECK_OK(moeblaze_context_get_info(ctx, nullptr, nullptr));
    MB_CHECK_OK(moeblaze_context_set_num_threads(ctx, 3));
    MB_CHECK_OK(moeblaze_context_set_num_threads(ctx, 0));
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_set_num_threads(ctx, -1),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "num_threads");
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_set_num_threads(nullptr, 1),
                             MOEBLAZE_ERR_INVALID_HANDLE, "context");
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_get_info(nullptr, &backend, &device),
                             MOEBLAZE_ERR_INVALID_HANDLE, "context");

    MB_CHECK_OK(moeblaze_context_destroy(ctx));
    MB_CHECK_OK(moeblaze_context_destroy(nullptr));
    // A destroyed handle is recognised, not dereferenced.
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_destroy(ctx), MOEBLAZE_ERR_INVALID_HANDLE,
                             "not a live");
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_set_num_threads(ctx, 1), MOEBLAZE_ERR_INVALID_HANDLE,
                             "not a live");
    // A pointer that was never a handle.
    int not_a_handle = 0;
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_context_destroy(reinterpret_cast<moeblaze_context_t>(&not_a_handle)),
        MOEBLAZE_ERR_INVALID_HANDLE, "not a live");
  }

  TEST_CASE("layer config: init, versioning and every field's range") {
    moeblaze_layer_config_t cfg;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_config_init(nullptr, sizeof(cfg)),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "config");
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_config_init(&cfg, 4), MOEBLAZE_ERR_VERSION_MISMATCH,
                             "smaller than any published");
    MB_CHECK_OK(moeblaze_layer_config_init(&cfg, sizeof(cfg)));
    CHECK(cfg.struct_size == sizeof(cfg));
    CHECK(cfg.dtype == MOEBLAZE_DTYPE_BF16);
    CHECK(cfg.activation == MOEBLAZE_ACTIVATION_SWIGLU);
    CHECK(cfg.checkpoint == MOEBLAZE_CHECKPOINT_SAVE_PREACT);
    CHECK(cfg.score_function == MOEBLAZE_SCORE_SOFTMAX_TOPK);
    CHECK(cfg.deterministic == 1);
    CHECK(cfg.top_k == 1);

    // A struct from a newer header: init zeroes the tail it does not know.
    struct Newer {
      moeblaze_layer_config_t base;
      int64_t future_field;
    } newer;
    std::memset(&newer, 0xAB, sizeof(newer));
    MB_CHECK_OK(moeblaze_layer_config_init(&newer.base, sizeof(newer)));
    CHECK(newer.base.struct_size == sizeof(newer));
    CHECK(newer.future_field == 0);

    mbtest::Context context;
    moeblaze_layer_t layer = nullptr;
    auto expect_bad = [&](void (*mutate)(moeblaze_layer_config_t&), const char* field) {
      moeblaze_layer_config_t c = small_config();
      mutate(c);
      MB_CHECK_STATUS_MENTIONS(moeblaze_layer_create(&layer, context.get(), &c),
                               MOEBLAZE_ERR_INVALID_ARGUMENT, field);
      CHECK(layer == nullptr);
    };
    expect_bad([](moeblaze_layer_config_t& c) { c.dtype = 9; }, "config.dtype");
    expect_bad([](moeblaze_layer_config_t& c) { c.dtype = -1; }, "config.dtype");
    expect_bad([](moeblaze_layer_config_t& c) { c.d_model = 0; }, "config.d_model");
    expect_bad([](moeblaze_layer_config_t& c) { c.d_model = -5; }, "config.d_model");
    expect_bad([](moeblaze_layer_config_t& c) { c.d_ffn = 0; }, "config.d_ffn");
    expect_bad([](moeblaze_layer_config_t& c) { c.num_experts = 0; }, "config.num_experts");
    expect_bad([](moeblaze_layer_config_t& c) { c.num_experts = MOEBLAZE_MAX_EXPERTS + 1; },
               "config.num_experts");
    expect_bad([](moeblaze_layer_config_t& c) { c.top_k = 0; }, "config.top_k");
    expect_bad([](moeblaze_layer_config_t& c) { c.top_k = 5; }, "config.top_k");  // k > E = 4
    expect_bad(
        [](moeblaze_layer_config_t& c) {
          c.num_experts = 64;
          c.top_k = MOEBLAZE_MAX_TOP_K + 1;
        },
        "config.top_k");
    expect_bad([](moeblaze_layer_config_t& c) { c.activation = mbtest::kActivationCount; },
               "config.activation");
    expect_bad([](moeblaze_layer_config_t& c) { c.activation = -1; }, "config.activation");
    expect_bad([](moeblaze_layer_config_t& c) { c.checkpoint = 3; }, "config.checkpoint");
    expect_bad([](moeblaze_layer_config_t& c) { c.score_function = -1; }, "config.score_function");
    expect_bad([](moeblaze_layer_config_t& c) { c.renormalize = 2; }, "config.renormalize");
    expect_bad([](moeblaze_layer_config_t& c) { c.aux_loss_coeff = -0.5f; },
               "config.aux_loss_coeff");
    expect_bad(
        [](moeblaze_layer_config_t& c) {
          c.z_loss_coeff = std::numeric_limits<float>::quiet_NaN();
        },
        "config.z_loss_coeff");
    expect_bad(
        [](moeblaze_layer_config_t& c) {
          c.aux_loss_coeff = std::numeric_limits<float>::infinity();
        },
        "config.aux_loss_coeff");
    expect_bad([](moeblaze_layer_config_t& c) { c.deterministic = 7; }, "config.deterministic");
    expect_bad([](moeblaze_layer_config_t& c) { c.reserved0 = 1; }, "config.reserved0");

    // struct_size from the past, and from the future with unknown bytes set / zero.
    moeblaze_layer_config_t c = small_config();
    c.struct_size = 8;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_create(&layer, context.get(), &c),
                             MOEBLAZE_ERR_VERSION_MISMATCH, "struct_size");
    Newer future;
    std::memset(&future, 0, sizeof(future));
    future.base = small_config();
    future.base.struct_size = sizeof(future);
    future.future_field = 1;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_create(&layer, context.get(), &future.base),
                             MOEBLAZE_ERR_NOT_SUPPORTED, "newer");
    future.future_field = 0;
    MB_CHECK_OK(moeblaze_layer_create(&layer, context.get(), &future.base));
    MB_CHECK_OK(moeblaze_layer_destroy(layer));

    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_create(&layer, context.get(), nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "config");
    c = small_config();
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_create(nullptr, context.get(), &c),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "out");
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_create(&layer, nullptr, &c),
                             MOEBLAZE_ERR_INVALID_HANDLE, "context");
  }

  TEST_CASE("layer handles: wrong kind, destroyed, get_config round trip") {
    mbtest::Context context;
    moeblaze_layer_config_t cfg = small_config(MOEBLAZE_ACTIVATION_GELU);
    cfg.aux_loss_coeff = 0.01f;
    moeblaze_layer_t layer = nullptr;
    MB_CHECK_OK(moeblaze_layer_create(&layer, context.get(), &cfg));

    // A layer where a context is expected and vice versa (the "plan with the wrong context" mistake
    // bindings make when handles travel as integers).
    moeblaze_layer_t other = nullptr;
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_layer_create(&other, reinterpret_cast<moeblaze_context_t>(layer), &cfg),
        MOEBLAZE_ERR_INVALID_HANDLE, "is a moeblaze_layer_t, not a moeblaze_context_t");
    size_t bytes = 0;
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_layer_workspace_size(reinterpret_cast<moeblaze_layer_t>(context.get()),
                                      MOEBLAZE_PASS_EXPERTS_FORWARD, 4, &bytes),
        MOEBLAZE_ERR_INVALID_HANDLE, "is a moeblaze_context_t, not a moeblaze_layer_t");
    MB_CHECK_STATUS_MENTIONS(moeblaze_context_destroy(reinterpret_cast<moeblaze_context_t>(layer)),
                             MOEBLAZE_ERR_INVALID_HANDLE, "not a moeblaze_context_t");

    moeblaze_layer_config_t back;
    MB_CHECK_OK(moeblaze_layer_config_init(&back, sizeof(back)));
    MB_CHECK_OK(moeblaze_layer_get_config(layer, &back));
    CHECK(back.activation == MOEBLAZE_ACTIVATION_GELU);
    CHECK(back.d_ffn == 12);
    CHECK(back.aux_loss_coeff == doctest::Approx(0.01f));
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_get_config(layer, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "config");
    back.struct_size = 3;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_get_config(layer, &back), MOEBLAZE_ERR_VERSION_MISMATCH,
                             "struct_size");

    MB_CHECK_OK(moeblaze_layer_destroy(layer));
    MB_CHECK_OK(moeblaze_layer_destroy(nullptr));
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_destroy(layer), MOEBLAZE_ERR_INVALID_HANDLE,
                             "not a live");
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_get_config(layer, &back), MOEBLAZE_ERR_INVALID_HANDLE,
                             "not a live");
  }

  TEST_CASE("a layer outlives its context handle") {
    moeblaze_context_t ctx = nullptr;
    MB_CHECK(moeblaze_context_create(&ctx, MOEBLAZE_BACKEND_CPU, 0));
    moeblaze_layer_config_t cfg = small_config();
    moeblaze_layer_t layer = nullptr;
    MB_CHECK(moeblaze_layer_create(&layer, ctx, &cfg));
    MB_CHECK_OK(moeblaze_context_destroy(ctx));
    Buffers b(layer, MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_EXPERTS_FORWARD);
    moeblaze_forward_args_t a = b.forward_args();
    MB_CHECK_OK(moeblaze_experts_forward(layer, &a, nullptr));
    MB_CHECK_OK(moeblaze_layer_destroy(layer));
  }

  TEST_CASE("size queries") {
    CpuLayer L;
    size_t bytes = 0;
    for (int32_t pass = MOEBLAZE_PASS_ROUTER_FORWARD; pass <= MOEBLAZE_PASS_LAYER_BACKWARD;
         ++pass) {
      MB_CHECK_OK(moeblaze_layer_workspace_size(L.get(), pass, 0, &bytes));
      MB_CHECK_OK(moeblaze_layer_workspace_size(L.get(), pass, 1000, &bytes));
    }
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_workspace_size(L.get(), 7, 10, &bytes),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "pass");
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_workspace_size(L.get(), -1, 10, &bytes),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "pass");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_layer_workspace_size(L.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, -1, &bytes),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens");
    // T * k must fit the int32 row indices.
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_workspace_size(L.get(), MOEBLAZE_PASS_EXPERTS_FORWARD,
                                                           int64_t(1) << 31, &bytes),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_layer_workspace_size(L.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, 4, nullptr),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "bytes");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_layer_workspace_size(nullptr, MOEBLAZE_PASS_EXPERTS_FORWARD, 4, &bytes),
        MOEBLAZE_ERR_INVALID_HANDLE, "layer");

    size_t experts = 0, whole = 0, experts_big = 0;
    MB_CHECK_OK(moeblaze_layer_saved_size(L.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, 100, &experts));
    MB_CHECK_OK(moeblaze_layer_saved_size(L.get(), MOEBLAZE_PASS_LAYER_FORWARD, 100, &whole));
    MB_CHECK_OK(
        moeblaze_layer_saved_size(L.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, 1000, &experts_big));
    CHECK(experts > 0);
    CHECK(whole > experts);  // the whole layer also keeps logits, ids and g
    CHECK(experts_big > experts);
    // SAVE_PREACT, SwiGLU: a and b (2*N*h elements) dominate.
    CHECK(experts_big >= size_t(2 * 1000 * 2 * 12) * sizeof(float));
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_layer_saved_size(L.get(), MOEBLAZE_PASS_ROUTER_FORWARD, 10, &bytes),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "pass");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_layer_saved_size(L.get(), MOEBLAZE_PASS_EXPERTS_BACKWARD, 10, &bytes),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "pass");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_layer_saved_size(L.get(), MOEBLAZE_PASS_LAYER_FORWARD, -2, &bytes),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_layer_saved_size(L.get(), MOEBLAZE_PASS_LAYER_FORWARD, 2, nullptr),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "bytes");

    // RECOMPUTE keeps only indices: far smaller.
    moeblaze_layer_config_t cfg = small_config();
    cfg.checkpoint = MOEBLAZE_CHECKPOINT_RECOMPUTE;
    CpuLayer R(cfg);
    size_t recompute = 0;
    MB_CHECK_OK(
        moeblaze_layer_saved_size(R.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, 1000, &recompute));
    CHECK(recompute < size_t(4 * 1000 * 2) * 4 + 4096);
  }

  TEST_CASE("router entry points reject bad input") {
    CpuLayer L;
    Buffers b(L.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_ROUTER_FORWARD);
    const int64_t T = Buffers::T;
    std::vector<int32_t> ids(T * 2);
    std::vector<float> g(T * 2), counts_f(1);
    std::vector<int32_t> counts(4);
    MB_CHECK_OK(moeblaze_router_forward(L.get(), T, b.logits.data(), ids.data(), g.data(),
                                        counts.data(), b.losses.data(), b.workspace.data(),
                                        b.workspace_bytes, nullptr));
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_forward(nullptr, T, b.logits.data(), ids.data(), g.data(), nullptr, nullptr,
                                b.workspace.data(), b.workspace_bytes, nullptr),
        MOEBLAZE_ERR_INVALID_HANDLE, "layer");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_forward(L.get(), -1, b.logits.data(), ids.data(), g.data(), nullptr,
                                nullptr, b.workspace.data(), b.workspace_bytes, nullptr),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_forward(L.get(), T, nullptr, ids.data(), g.data(), nullptr, nullptr,
                                b.workspace.data(), b.workspace_bytes, nullptr),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "logits");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_forward(L.get(), T, b.logits.data(), nullptr, g.data(), nullptr, nullptr,
                                b.workspace.data(), b.workspace_bytes, nullptr),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "ids");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_forward(L.get(), T, b.logits.data(), ids.data(), nullptr, nullptr, nullptr,
                                b.workspace.data(), b.workspace_bytes, nullptr),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "g");
    // Misaligned float pointer.
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_forward(L.get(), T, b.logits.data(), ids.data(),
                                reinterpret_cast<char*>(g.data()) + 1, nullptr, nullptr,
                                b.workspace.data(), b.workspace_bytes, nullptr),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "aligned");
    // T = 0 accepts NULL tensors.
    MB_CHECK_OK(moeblaze_router_forward(L.get(), 0, nullptr, nullptr, nullptr, nullptr, nullptr,
                                        b.workspace.data(), b.workspace_bytes, nullptr));
    // Non-finite logits must be reported by the CPU backend.
    std::vector<float> bad_logits = b.logits;
    bad_logits[6] = std::numeric_limits<float>::quiet_NaN();
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_forward(L.get(), T, bad_logits.data(), ids.data(), g.data(), nullptr,
                                nullptr, b.workspace.data(), b.workspace_bytes, nullptr),
        MOEBLAZE_ERR_NON_FINITE, "logits");
    bad_logits[6] = std::numeric_limits<float>::infinity();
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_forward(L.get(), T, bad_logits.data(), ids.data(), g.data(), nullptr,
                                nullptr, b.workspace.data(), b.workspace_bytes, nullptr),
        MOEBLAZE_ERR_NON_FINITE, "logits");

    size_t bwd_ws = 0;
    MB_CHECK(moeblaze_layer_workspace_size(L.get(), MOEBLAZE_PASS_ROUTER_BACKWARD, T, &bwd_ws));
    AlignedBytes ws(bwd_ws);
    void* wsp = ws.data();
    std::vector<float> dg(T * 2, 0.1f), d_logits(T * 4);
    MB_CHECK_OK(moeblaze_router_backward(L.get(), T, b.logits.data(), ids.data(), dg.data(),
                                         nullptr, d_logits.data(), wsp, bwd_ws, nullptr));
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_backward(L.get(), T, b.logits.data(), ids.data(), nullptr, nullptr,
                                 d_logits.data(), wsp, bwd_ws, nullptr),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "dg");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_backward(L.get(), T, b.logits.data(), ids.data(), dg.data(), nullptr,
                                 nullptr, wsp, bwd_ws, nullptr),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "d_logits");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_router_backward(L.get(), T, nullptr, ids.data(), dg.data(), nullptr,
                                 d_logits.data(), wsp, bwd_ws, nullptr),
        MOEBLAZE_ERR_INVALID_ARGUMENT, "logits");
    if (bwd_ws > 0) {
      MB_CHECK_STATUS_MENTIONS(
          moeblaze_router_backward(L.get(), T, b.logits.data(), ids.data(), dg.data(), nullptr,
                                   d_logits.data(), wsp, bwd_ws - 1, nullptr),
          MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "workspace_bytes");
    }
  }

  TEST_CASE("routing_build rejects bad input and bad ids") {
    CpuLayer L;
    const int64_t T = 5;
    size_t ws_bytes = 0;
    MB_CHECK(moeblaze_layer_workspace_size(L.get(), MOEBLAZE_PASS_ROUTING_BUILD, T, &ws_bytes));
    AlignedBytes ws(ws_bytes);
    void* wsp = ws.data();
    std::vector<int32_t> ids = {0, 1, 2, 3, 1, 2, 3, 0, 0, 2};
    std::vector<int32_t> offsets(5), eti(10), tim(10);
    MB_CHECK_OK(moeblaze_routing_build(L.get(), T, ids.data(), offsets.data(), eti.data(),
                                       tim.data(), wsp, ws_bytes, nullptr));
    CHECK(offsets[4] == 10);
    MB_CHECK_STATUS_MENTIONS(moeblaze_routing_build(L.get(), T, ids.data(), nullptr, eti.data(),
                                                    tim.data(), wsp, ws_bytes, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "expert_offsets");
    MB_CHECK_STATUS_MENTIONS(moeblaze_routing_build(L.get(), T, nullptr, offsets.data(), eti.data(),
                                                    tim.data(), wsp, ws_bytes, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "ids");
    MB_CHECK_STATUS_MENTIONS(moeblaze_routing_build(L.get(), T, ids.data(), offsets.data(), nullptr,
                                                    tim.data(), wsp, ws_bytes, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "expert_token_indices");
    MB_CHECK_STATUS_MENTIONS(moeblaze_routing_build(L.get(), T, ids.data(), offsets.data(),
                                                    eti.data(), nullptr, wsp, ws_bytes, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "token_index_map");
    std::vector<int32_t> bad = ids;
    bad[3] = 4;  // E = 4: out of range
    MB_CHECK_STATUS_MENTIONS(moeblaze_routing_build(L.get(), T, bad.data(), offsets.data(),
                                                    eti.data(), tim.data(), wsp, ws_bytes, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "ids");
    bad = ids;
    bad[5] = -1;
    MB_CHECK_STATUS_MENTIONS(moeblaze_routing_build(L.get(), T, bad.data(), offsets.data(),
                                                    eti.data(), tim.data(), wsp, ws_bytes, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "ids");
    bad = ids;
    bad[3] = bad[2];  // token 1 routed twice to expert 2
    MB_CHECK_STATUS_MENTIONS(moeblaze_routing_build(L.get(), T, bad.data(), offsets.data(),
                                                    eti.data(), tim.data(), wsp, ws_bytes, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "ids");
  }

  TEST_CASE("args structs: init and versioning") {
    moeblaze_forward_args_t f;
    moeblaze_backward_args_t bw;
    MB_CHECK_STATUS_MENTIONS(moeblaze_forward_args_init(nullptr, sizeof(f)),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "args");
    MB_CHECK_STATUS_MENTIONS(moeblaze_backward_args_init(nullptr, sizeof(bw)),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "args");
    MB_CHECK_STATUS_MENTIONS(moeblaze_forward_args_init(&f, 3), MOEBLAZE_ERR_VERSION_MISMATCH,
                             "struct_size");
    MB_CHECK_STATUS_MENTIONS(moeblaze_backward_args_init(&bw, 16), MOEBLAZE_ERR_VERSION_MISMATCH,
                             "struct_size");
    MB_CHECK_OK(moeblaze_forward_args_init(&f, sizeof(f)));
    MB_CHECK_OK(moeblaze_backward_args_init(&bw, sizeof(bw)));
    CHECK(f.struct_size == sizeof(f));
    CHECK(f.x == nullptr);
    CHECK(f.num_tokens == 0);
    CHECK(bw.flags == 0u);
  }

  TEST_CASE("experts forward and backward reject bad input") {
    CpuLayer L;
    Buffers b(L.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_EXPERTS_BACKWARD);
    // `good` trains (it has a saved buffer), so the MOEBLAZE_FORWARD_WITH_SAVED size is exact.
    size_t fwd_ws = 0;
    MB_CHECK(moeblaze_layer_workspace_size_with_flags(
        L.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, Buffers::T, MOEBLAZE_FORWARD_WITH_SAVED, &fwd_ws));

    moeblaze_forward_args_t good = b.forward_args();
    good.workspace_bytes = fwd_ws;
    // The workspace was sized for the backward pass; use the larger of both.
    if (fwd_ws > b.workspace_bytes) {
      b.workspace.resize(fwd_ws);
      good.workspace = b.workspace.data();
    }
    MB_CHECK_OK(moeblaze_experts_forward(L.get(), &good, nullptr));

    auto expect_forward = [&](void (*mutate)(moeblaze_forward_args_t&), moeblaze_status_t status,
                              const char* needle) {
      moeblaze_forward_args_t a = good;
      mutate(a);
      MB_CHECK_STATUS_MENTIONS(moeblaze_experts_forward(L.get(), &a, nullptr), status, needle);
    };
    expect_forward([](moeblaze_forward_args_t& a) { a.x = nullptr; }, MOEBLAZE_ERR_INVALID_ARGUMENT,
                   "args->x");
    expect_forward([](moeblaze_forward_args_t& a) { a.w_gate = nullptr; },
                   MOEBLAZE_ERR_INVALID_ARGUMENT, "args->w_gate");
    expect_forward([](moeblaze_forward_args_t& a) { a.w_up = nullptr; },
                   MOEBLAZE_ERR_INVALID_ARGUMENT, "args->w_up");
    expect_forward([](moeblaze_forward_args_t& a) { a.w_down = nullptr; },
                   MOEBLAZE_ERR_INVALID_ARGUMENT, "args->w_down");
    expect_forward([](moeblaze_forward_args_t& a) { a.ids = nullptr; },
                   MOEBLAZE_ERR_INVALID_ARGUMENT, "args->ids");
    expect_forward([](moeblaze_forward_args_t& a) { a.g = nullptr; }, MOEBLAZE_ERR_INVALID_ARGUMENT,
                   "args->g");
    expect_forward([](moeblaze_forward_args_t& a) { a.y = nullptr; }, MOEBLAZE_ERR_INVALID_ARGUMENT,
                   "args->y");
    expect_forward([](moeblaze_forward_args_t& a) { a.num_tokens = -4; },
                   MOEBLAZE_ERR_INVALID_ARGUMENT, "args->num_tokens");
    expect_forward([](moeblaze_forward_args_t& a) { a.flags = 1; }, MOEBLAZE_ERR_INVALID_ARGUMENT,
                   "args->flags");
    expect_forward([](moeblaze_forward_args_t& a) { a.saved_bytes -= 1; },
                   MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "args->saved_bytes");
    expect_forward(
        [](moeblaze_forward_args_t& a) {
          a.saved = static_cast<char*>(a.saved) + 8;
          a.saved_bytes -= 8;
          a.saved_bytes += 8;
        },
        MOEBLAZE_ERR_INVALID_ARGUMENT, "16-byte aligned");
    if (fwd_ws > 0) {
      expect_forward([](moeblaze_forward_args_t& a) { a.workspace_bytes -= 1; },
                     MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "args->workspace_bytes");
      expect_forward([](moeblaze_forward_args_t& a) { a.workspace = nullptr; },
                     MOEBLAZE_ERR_INVALID_ARGUMENT, "args->workspace");
    }
    expect_forward([](moeblaze_forward_args_t& a) { a.struct_size = 0; },
                   MOEBLAZE_ERR_VERSION_MISMATCH, "struct_size");
    MB_CHECK_STATUS_MENTIONS(moeblaze_experts_forward(L.get(), nullptr, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "args");
    MB_CHECK_STATUS_MENTIONS(moeblaze_experts_forward(nullptr, &good, nullptr),
                             MOEBLAZE_ERR_INVALID_HANDLE, "layer");
    // Bad ids are found by the CPU backend.
    b.ids[7] = 9;
    MB_CHECK_STATUS_MENTIONS(moeblaze_experts_forward(L.get(), &good, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "ids");
    b.ids[7] = 0;

    // Inference: no saved buffer, so the routing indices and u need the plain (larger) workspace;
    // the training size is refused with the query to ask.
    moeblaze_forward_args_t inference = good;
    inference.saved = nullptr;
    inference.saved_bytes = 0;
    size_t inference_ws = 0;
    MB_CHECK(moeblaze_layer_workspace_size(L.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, Buffers::T,
                                           &inference_ws));
    CHECK(inference_ws > fwd_ws);
    MB_CHECK_STATUS_MENTIONS(moeblaze_experts_forward(L.get(), &inference, nullptr),
                             MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
                             "moeblaze_layer_workspace_size(MOEBLAZE_PASS_EXPERTS_FORWARD)");
    AlignedBytes inference_workspace(inference_ws);
    inference.workspace = inference_workspace.data();
    inference.workspace_bytes = inference_ws;
    MB_CHECK_OK(moeblaze_experts_forward(L.get(), &inference, nullptr));

    // Backward.
    MB_CHECK_OK(moeblaze_experts_forward(L.get(), &good, nullptr));
    moeblaze_backward_args_t bgood = b.backward_args();
    MB_CHECK_OK(moeblaze_experts_backward(L.get(), &bgood, nullptr));
    auto expect_backward = [&](void (*mutate)(moeblaze_backward_args_t&), moeblaze_status_t status,
                               const char* needle) {
      moeblaze_backward_args_t a = bgood;
      mutate(a);
      MB_CHECK_STATUS_MENTIONS(moeblaze_experts_backward(L.get(), &a, nullptr), status, needle);
    };
    expect_backward([](moeblaze_backward_args_t& a) { a.saved = nullptr; },
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "args->saved");
    expect_backward([](moeblaze_backward_args_t& a) { a.dy = nullptr; },
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "args->dy");
    expect_backward([](moeblaze_backward_args_t& a) { a.x = nullptr; },
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "args->x");
    expect_backward([](moeblaze_backward_args_t& a) { a.w_down = nullptr; },
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "args->w_down");
    expect_backward([](moeblaze_backward_args_t& a) { a.g = nullptr; },
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "args->g");
    expect_backward([](moeblaze_backward_args_t& a) { a.flags = 6; }, MOEBLAZE_ERR_INVALID_ARGUMENT,
                    "args->flags");
    expect_backward([](moeblaze_backward_args_t& a) { a.saved_bytes = 16; },
                    MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "args->saved_bytes");
    expect_backward([](moeblaze_backward_args_t& a) { a.num_tokens = -1; },
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "args->num_tokens");
    expect_backward([](moeblaze_backward_args_t& a) { a.dx = static_cast<char*>(a.dx) + 2; },
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "args->dx");
    // All gradient outputs optional.
    expect_backward(
        [](moeblaze_backward_args_t& a) {
          a.dx = a.dw_gate = a.dw_up = a.dw_down = a.dg = nullptr;
        },
        MOEBLAZE_OK, "");

    // A saved buffer written for a different token count is detected (CPU).
    moeblaze_backward_args_t fewer = bgood;
    fewer.num_tokens = Buffers::T - 1;
    MB_CHECK_STATUS_MENTIONS(moeblaze_experts_backward(L.get(), &fewer, nullptr),
                             MOEBLAZE_ERR_VERSION_MISMATCH, "saved");
    // ... and a buffer that was never filled.
    b.saved.fill_byte(0);
    MB_CHECK_STATUS_MENTIONS(moeblaze_experts_backward(L.get(), &bgood, nullptr),
                             MOEBLAZE_ERR_VERSION_MISMATCH, "saved");
  }

  TEST_CASE("non-gated activations take w_up = NULL") {
    CpuLayer L(small_config(MOEBLAZE_ACTIVATION_RELU));
    Buffers b(L.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_EXPERTS_FORWARD);
    moeblaze_forward_args_t a = b.forward_args();
    a.w_up = nullptr;
    MB_CHECK_OK(moeblaze_experts_forward(L.get(), &a, nullptr));
  }

  TEST_CASE("whole layer forward and backward reject bad input") {
    moeblaze_layer_config_t cfg = small_config();
    cfg.aux_loss_coeff = 0.01f;
    cfg.z_loss_coeff = 0.001f;
    CpuLayer L(cfg);
    Buffers fb(L.get(), MOEBLAZE_PASS_LAYER_FORWARD, MOEBLAZE_PASS_LAYER_FORWARD);
    moeblaze_forward_args_t f = fb.forward_args();
    f.ids = nullptr;  // not used by the whole layer
    f.g = nullptr;
    f.losses = fb.losses.data();
    MB_CHECK_OK(moeblaze_layer_forward(L.get(), &f, nullptr));
    CHECK(std::isfinite(fb.losses[0]));
    CHECK(fb.losses[0] > 0.0f);
    CHECK(fb.losses[1] > 0.0f);

    moeblaze_forward_args_t bad = f;
    bad.w_router = nullptr;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_forward(L.get(), &bad, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "args->w_router");
    bad = f;
    bad.saved_bytes = 100;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_forward(L.get(), &bad, nullptr),
                             MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "MOEBLAZE_PASS_LAYER_FORWARD");
    bad = f;
    bad.losses = reinterpret_cast<char*>(fb.losses.data()) + 1;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_forward(L.get(), &bad, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "args->losses");
    // NaN in x shows up as non-finite logits.
    std::vector<float> nan_x = fb.x;
    nan_x[3] = std::numeric_limits<float>::quiet_NaN();
    bad = f;
    bad.x = nan_x.data();
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_forward(L.get(), &bad, nullptr),
                             MOEBLAZE_ERR_NON_FINITE, "logits");

    // Backward needs the layer-forward saved buffer and its own workspace size.
    MB_CHECK_OK(moeblaze_layer_forward(L.get(), &f, nullptr));
    size_t bwd_ws = 0;
    MB_CHECK(
        moeblaze_layer_workspace_size(L.get(), MOEBLAZE_PASS_LAYER_BACKWARD, Buffers::T, &bwd_ws));
    AlignedBytes ws(bwd_ws);
    moeblaze_backward_args_t bw = fb.backward_args();
    bw.ids = nullptr;
    bw.g = nullptr;
    bw.dg = nullptr;
    bw.workspace = ws.data();
    bw.workspace_bytes = bwd_ws;
    MB_CHECK_OK(moeblaze_layer_backward(L.get(), &bw, nullptr));
    moeblaze_backward_args_t bbad = bw;
    bbad.w_router = nullptr;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_backward(L.get(), &bbad, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "args->w_router");
    bbad = bw;
    bbad.workspace_bytes = bwd_ws - 1;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_backward(L.get(), &bbad, nullptr),
                             MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "MOEBLAZE_PASS_LAYER_BACKWARD");
    // An experts-forward saved buffer is smaller than a layer-forward one: rejected by size.
    size_t experts_saved = 0;
    MB_CHECK(moeblaze_layer_saved_size(L.get(), MOEBLAZE_PASS_EXPERTS_FORWARD, Buffers::T,
                                       &experts_saved));
    bbad = bw;
    bbad.saved_bytes = experts_saved;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_backward(L.get(), &bbad, nullptr),
                             MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "args->saved_bytes");
  }
}
