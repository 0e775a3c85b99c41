// A fuzz target over the public API (CPU backend): the input bytes choose a layer configuration
// (any field value, valid or not), a token count, the tensors' contents (any bit pattern: NaN,
// Inf, huge values), the routing ids, which calls run (router, routing structures, experts or
// whole layer), the general or the smaller flag-specific workspaces, bytes written over the saved
// buffer between forward and backward, and whether the layer is destroyed before the backward.
// Whatever they are, every call must return a documented status with a message on failure (a
// stale handle: MOEBLAZE_ERR_INVALID_HANDLE), and touch nothing outside the exact-size buffers it
// was given (ASan).
//
// Built two ways (tests/CMakeLists.txt): with clang's libFuzzer (-DMOEBLAZE_BUILD_FUZZERS=ON,
// scripts/test.sh's fuzz phase), and as a plain program that runs pseudo-random inputs from a
// printed seed (or replays input files given on the command line) in every build.
#include "fuzz_support.hpp"

namespace {

using namespace moeblaze_fuzz;

int run_one(const uint8_t* data, size_t size) {
  moeblaze_context_t context = cpu_context();
  Input in(data, size);
  moeblaze_layer_config_t config = draw_config(in);
  // struct_size: the library may read that many bytes, so the struct lives in a block that large
  // (a newer caller's struct: the tail is fuzzed too); beyond 1 MiB it must refuse before reading.
  Block versioned(sizeof config + 256);
  std::memcpy(versioned.ptr, &config, sizeof config);
  auto* passed = static_cast<moeblaze_layer_config_t*>(versioned.ptr);
  const uint8_t size_kind = in.byte();
  if (size_kind == 7) {
    passed->struct_size = in.u32() % uint32_t(versioned.size + 1);
    unsigned char* tail = static_cast<unsigned char*>(versioned.ptr) + sizeof config;
    for (size_t i = 0; i < versioned.size - sizeof config; ++i) tail[i] = in.byte() == 1 ? 1 : 0;
  } else if (size_kind == 8) {
    passed->struct_size = (uint32_t(1) << 20) + 1 + in.u32() % 1000;
  }
  moeblaze_layer_t layer = nullptr;
  moeblaze_status_t status = moeblaze_layer_create(&layer, context, passed);
  check(status);
  if (status != MOEBLAZE_OK) return 0;
  struct Destroy {
    moeblaze_layer_t l;
    ~Destroy() {
      if (l) moeblaze_layer_destroy(l);
    }
  } destroy{layer};

  const int64_t T = in.small(0, 6);
  const bool whole = in.byte() & 1;
  // At times the layer is destroyed before the backward: its stale handle must be refused.
  const bool stale = in.byte() % 16 == 13;
  const int32_t fwd_pass = whole ? MOEBLAZE_PASS_LAYER_FORWARD : MOEBLAZE_PASS_EXPERTS_FORWARD;
  const int32_t bwd_pass = whole ? MOEBLAZE_PASS_LAYER_BACKWARD : MOEBLAZE_PASS_EXPERTS_BACKWARD;
  size_t saved_bytes = 0, fwd_ws = 0, bwd_ws = 0;
  status = moeblaze_layer_saved_size(layer, fwd_pass, T, &saved_bytes);
  check(status);
  if (status != MOEBLAZE_OK) return 0;
  check(moeblaze_layer_workspace_size(layer, fwd_pass, T, &fwd_ws));
  check(moeblaze_layer_workspace_size(layer, bwd_pass, T, &bwd_ws));

  const int64_t d = config.d_model, h = config.d_ffn, E = config.num_experts, k = config.top_k;
  // Valid but too large to be worth allocating and running (the size queries above ran).
  if (too_large(config, T, k) || saved_bytes > kMaxLibraryBytes || fwd_ws > kMaxLibraryBytes ||
      bwd_ws > kMaxLibraryBytes) {
    return 0;
  }
  const size_t es = dtype_size(config.dtype);
  const size_t rs = dtype_size(routing_dtype(config.dtype));
  Block x(es * T * d), w_router(es * E * d), w_gate(es * E * h * d), w_up(es * E * h * d),
      w_down(es * E * d * h), y(es * T * d), dy(es * T * d), dx(es * T * d), dw_router(es * E * d),
      dw_gate(es * E * h * d), dw_up(es * E * h * d), dw_down(es * E * d * h), g(rs * T * k),
      dg(rs * T * k), logits(rs * T * E), d_logits(rs * T * E), losses(rs * 2), ids(4 * T * k),
      counts(4 * E), saved(saved_bytes);
  for (const Block* b : {&x, &w_router, &w_gate, &w_up, &w_down, &dy}) fill(in, *b, config.dtype);
  fill(in, g, routing_dtype(config.dtype));
  // ids: distinct per token unless the input says otherwise.
  int32_t* id = static_cast<int32_t*>(ids.ptr);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const uint8_t b = in.byte();
      id[t * k + j] = b == 255 ? int32_t(in.u32()) : int32_t((t + j + b / 64) % E);
    }
  }

  // The routing structures alone, from the ids as they are (out of range or repeated, at times).
  if (in.byte() & 1) {
    size_t bytes = 0;
    check(moeblaze_layer_workspace_size(layer, MOEBLAZE_PASS_ROUTING_BUILD, T, &bytes));
    Block offsets(4 * (E + 1)), token_indices(4 * T * k), index_map(4 * T * k), build_ws(bytes);
    check(moeblaze_routing_build(
        layer, T, static_cast<const int32_t*>(ids.ptr), static_cast<int32_t*>(offsets.ptr),
        static_cast<int32_t*>(token_indices.ptr), static_cast<int32_t*>(index_map.ptr),
        build_ws.ptr, build_ws.size, nullptr));
  }

  // The router alone on fuzzed logits.
  if (in.byte() & 1) {
    fill(in, logits, routing_dtype(config.dtype));
    size_t bytes = 0;
    check(moeblaze_layer_workspace_size(layer, MOEBLAZE_PASS_ROUTER_BACKWARD, T, &bytes));
    size_t router_fwd = 0;
    check(moeblaze_layer_workspace_size(layer, MOEBLAZE_PASS_ROUTER_FORWARD, T, &router_fwd));
    Block router_ws(router_fwd > bytes ? router_fwd : bytes);
    Block router_ids(4 * T * k), router_g(rs * T * k);
    status = moeblaze_router_forward(layer, T, logits.ptr, static_cast<int32_t*>(router_ids.ptr),
                                     router_g.ptr, static_cast<int32_t*>(counts.ptr), losses.ptr,
                                     router_ws.ptr, router_ws.size, nullptr);
    check(status);
    check(moeblaze_router_backward(
        layer, T, logits.ptr,
        static_cast<const int32_t*>(status == MOEBLAZE_OK ? router_ids.ptr : ids.ptr), dg.ptr,
        nullptr, d_logits.ptr, router_ws.ptr, router_ws.size, nullptr));
  }

  // Either workspace size the header allows: the general one, or (the forward being given `saved`,
  // the backward its flags) the smaller one of moeblaze_layer_workspace_size_with_flags().
  if (in.byte() & 1) {
    check(moeblaze_layer_workspace_size_with_flags(layer, fwd_pass, T, MOEBLAZE_FORWARD_WITH_SAVED,
                                                   &fwd_ws));
  }
  Block fwd_workspace(fwd_ws);
  moeblaze_forward_args_t fa;
  moeblaze_forward_args_init(&fa, sizeof fa);
  fa.num_tokens = T;
  fa.x = x.ptr;
  fa.w_router = w_router.ptr;
  fa.w_gate = w_gate.ptr;
  fa.w_up = w_up.ptr;
  fa.w_down = w_down.ptr;
  fa.ids = static_cast<const int32_t*>(ids.ptr);
  fa.g = g.ptr;
  fa.y = y.ptr;
  fa.saved = saved.ptr;
  fa.saved_bytes = saved.size;
  fa.workspace = fwd_workspace.ptr;
  fa.workspace_bytes = fwd_workspace.size;
  if (in.byte() == 9) fa.flags = in.u32();
  status = whole ? moeblaze_layer_forward(layer, &fa, nullptr)
                 : moeblaze_experts_forward(layer, &fa, nullptr);
  check(status);
  if (status != MOEBLAZE_OK) return 0;

  // Overwrite parts of the saved buffer, as a caller might between forward and backward.
  unsigned char* s = static_cast<unsigned char*>(saved.ptr);
  for (int writes = in.byte() % 8; writes > 0 && saved.size > 0; --writes) {
    const size_t at = size_t(in.u32()) % saved.size;
    s[at] = in.byte();
  }
  moeblaze_backward_args_t ba;
  moeblaze_backward_args_init(&ba, sizeof ba);
  ba.num_tokens = (in.byte() == 5) ? in.small(0, 8) : T;
  ba.flags = in.byte() & 3;
  if (in.byte() & 1) {
    check(moeblaze_layer_workspace_size_with_flags(layer, bwd_pass, T, ba.flags, &bwd_ws));
  }
  Block bwd_workspace(bwd_ws);
  ba.dy = dy.ptr;
  ba.x = x.ptr;
  ba.w_router = w_router.ptr;
  ba.w_gate = w_gate.ptr;
  ba.w_up = w_up.ptr;
  ba.w_down = w_down.ptr;
  ba.ids = static_cast<const int32_t*>(ids.ptr);
  ba.g = g.ptr;
  ba.saved = saved.ptr;
  ba.saved_bytes = saved.size;
  ba.dx = dx.ptr;
  ba.dw_router = dw_router.ptr;
  ba.dw_gate = dw_gate.ptr;
  ba.dw_up = dw_up.ptr;
  ba.dw_down = dw_down.ptr;
  ba.dg = whole ? nullptr : dg.ptr;
  ba.d_logits = whole ? d_logits.ptr : nullptr;
  ba.workspace = bwd_workspace.ptr;
  ba.workspace_bytes = bwd_workspace.size;
  if (stale) {
    check(moeblaze_layer_destroy(layer));
    destroy.l = nullptr;
  }
  status = whole ? moeblaze_layer_backward(layer, &ba, nullptr)
                 : moeblaze_experts_backward(layer, &ba, nullptr);
  check(status);
  if (stale && status != MOEBLAZE_ERR_INVALID_HANDLE) __builtin_trap();
  return 0;
}

}  // namespace

MOEBLAZE_FUZZ_TARGET("fuzz_layer", run_one)
