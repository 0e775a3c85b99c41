// A fuzz target over the public API (CPU backend): the input bytes choose a layer configuration
// (any field value, valid or not), a token count, the tensors' contents (any bit pattern: NaN,
// Inf, huge values), the routing ids, which calls run, and bytes written over the saved buffer
// between forward and backward. Whatever they are, every call must return a documented status with
// a message on failure, and touch nothing outside the exact-size buffers it was given (ASan).
//
// Built two ways (tests/CMakeLists.txt): with clang's libFuzzer (-DMOEBLAZE_BUILD_FUZZERS=ON,
// scripts/test.sh's fuzz phase), and as a plain program that runs pseudo-random inputs from a
// printed seed (or replays input files given on the command line) in every build.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "moeblaze.h"

namespace {

// Reads the fuzz input front to back; past its end every read is 0.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t byte() { return at_ < size_ ? data_[at_++] : 0; }
  uint32_t u32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(byte()) << (8 * i);
    return v;
  }
  uint64_t u64() { return uint64_t(u32()) | (uint64_t(u32()) << 32); }
  // Mostly small values in [lo, hi], sometimes any 64-bit value.
  int64_t small(int64_t lo, int64_t hi) {
    const uint8_t b = byte();
    if (b == 255) return int64_t(u64());
    return lo + int64_t(b) % (hi - lo + 1);
  }
  float any_float() {
    const uint8_t kind = byte() % 8;
    if (kind < 5) return float(int8_t(byte())) / 16.0f;  // ordinary values
    const uint32_t bits = u32();                         // any bit pattern
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  bool done() const { return at_ >= size_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

// The most one input may hold allocated at once: run_one skips shapes that would need more, and a
// block past it traps, so a too-loose skip fails here instead of exhausting the fuzzer's memory.
constexpr size_t kMaxLiveBytes = size_t(1) << 26;
size_t live_bytes = 0;

// An exact-size, 64-byte aligned heap block.
struct Block {
  explicit Block(size_t bytes) : size(bytes) {
    live_bytes += bytes;
    if (live_bytes > kMaxLiveBytes) {
      std::fprintf(stderr, "fuzz_layer: %zu bytes allocated at once (limit %zu)\n", live_bytes,
                   kMaxLiveBytes);
      __builtin_trap();
    }
    if (bytes > 0 && posix_memalign(&ptr, 64, bytes) != 0) ptr = nullptr;
    if (ptr) std::memset(ptr, 0, bytes);
  }
  ~Block() {
    std::free(ptr);
    live_bytes -= size;
  }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  void* ptr = nullptr;
  size_t size;
};

size_t dtype_size(int32_t dtype) {
  return dtype == MOEBLAZE_DTYPE_F64 ? 8 : dtype == MOEBLAZE_DTYPE_F32 ? 4 : 2;
}

// Every status the header documents, and a message whenever it is not OK.
void check(moeblaze_status_t status) {
  switch (status) {
    case MOEBLAZE_OK:
      if (moeblaze_last_error()[0] != '\0') __builtin_trap();  // success clears the message
      return;
    case MOEBLAZE_ERR_INVALID_ARGUMENT:
    case MOEBLAZE_ERR_INVALID_HANDLE:
    case MOEBLAZE_ERR_NOT_SUPPORTED:
    case MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE:
    case MOEBLAZE_ERR_VERSION_MISMATCH:
    case MOEBLAZE_ERR_NON_FINITE:
      if (moeblaze_last_error()[0] == '\0') __builtin_trap();
      return;
    default:
      std::fprintf(stderr, "undocumented status %d: %s\n", int(status), moeblaze_last_error());
      __builtin_trap();
  }
}

void fill(Input& in, const Block& b, int32_t dtype) {
  const size_t es = dtype_size(dtype);
  unsigned char* p = static_cast<unsigned char*>(b.ptr);
  for (size_t i = 0; i + es <= b.size; i += es) {
    const float f = in.done() ? 0.25f * float(i % 7) - 0.5f : in.any_float();
    if (dtype == MOEBLAZE_DTYPE_F64) {
      const double v = f;
      std::memcpy(p + i, &v, 8);
    } else if (dtype == MOEBLAZE_DTYPE_F32) {
      std::memcpy(p + i, &f, 4);
    } else {
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const uint16_t half = uint16_t(bits >> 16);  // bf16 truncation; also some f16 pattern
      std::memcpy(p + i, &half, 2);
    }
  }
}

int run_one(const uint8_t* data, size_t size) {
  static moeblaze_context_t context = [] {
    moeblaze_context_t c = nullptr;
    moeblaze_context_create(&c, MOEBLAZE_BACKEND_CPU, 0);
    moeblaze_context_set_num_threads(c, 1);
    return c;
  }();
  Input in(data, size);

  moeblaze_layer_config_t config;
  moeblaze_layer_config_init(&config, sizeof config);
  config.dtype = int32_t(in.small(0, 3));
  config.d_model = in.small(1, 12);
  config.d_ffn = in.small(1, 12);
  config.num_experts = in.small(1, 6);
  config.top_k = in.small(1, 4);
  config.activation = int32_t(in.small(0, 6));
  config.checkpoint = int32_t(in.small(0, 2));
  config.score_function = int32_t(in.small(0, 2));
  config.renormalize = int32_t(in.small(0, 1));
  config.aux_loss_coeff = (in.byte() & 1) ? in.any_float() : 0.0f;
  config.z_loss_coeff = (in.byte() & 1) ? in.any_float() : 0.0f;
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
    ~Destroy() { moeblaze_layer_destroy(l); }
  } destroy{layer};

  const int64_t T = in.small(0, 6);
  const bool whole = in.byte() & 1;
  const int32_t fwd_pass = whole ? MOEBLAZE_PASS_LAYER_FORWARD : MOEBLAZE_PASS_EXPERTS_FORWARD;
  const int32_t bwd_pass = whole ? MOEBLAZE_PASS_LAYER_BACKWARD : MOEBLAZE_PASS_EXPERTS_BACKWARD;
  size_t saved_bytes = 0, fwd_ws = 0, bwd_ws = 0;
  status = moeblaze_layer_saved_size(layer, fwd_pass, T, &saved_bytes);
  check(status);
  if (status != MOEBLAZE_OK) return 0;
  check(moeblaze_layer_workspace_size(layer, fwd_pass, T, &fwd_ws));
  check(moeblaze_layer_workspace_size(layer, bwd_pass, T, &bwd_ws));

  const int64_t d = config.d_model, h = config.d_ffn, E = config.num_experts, k = config.top_k;
  // Valid but too large to be worth allocating and running (the size queries above ran): the
  // weights, the tokens, the expert work and the library's buffers each stay small, so no input
  // makes a run take more than a few MiB or milliseconds. The products cannot overflow: each
  // factor is checked before it multiplies.
  constexpr int64_t kMaxElements = int64_t(1) << 16;
  constexpr size_t kMaxLibraryBytes = size_t(1) << 24;
  const auto over = [](int64_t a, int64_t b) {
    return a > kMaxElements || b > kMaxElements || a * b > kMaxElements;
  };
  if (over(d, h) || over(d * h, E) || over(T, d + E) || over(T * k, h) || over(T * k * h, d) ||
      saved_bytes > kMaxLibraryBytes || fwd_ws > kMaxLibraryBytes || bwd_ws > kMaxLibraryBytes) {
    return 0;
  }
  const size_t es = dtype_size(config.dtype);
  const size_t rs = config.dtype == MOEBLAZE_DTYPE_F64 ? 8 : 4;
  Block x(es * T * d), w_router(es * E * d), w_gate(es * E * h * d), w_up(es * E * h * d),
      w_down(es * E * d * h), y(es * T * d), dy(es * T * d), dx(es * T * d), dw_router(es * E * d),
      dw_gate(es * E * h * d), dw_up(es * E * h * d), dw_down(es * E * d * h), g(rs * T * k),
      dg(rs * T * k), logits(rs * T * E), d_logits(rs * T * E), losses(rs * 2), ids(4 * T * k),
      counts(4 * E), saved(saved_bytes);
  for (const Block* b : {&x, &w_router, &w_gate, &w_up, &w_down, &dy}) fill(in, *b, config.dtype);
  fill(in, g, config.dtype == MOEBLAZE_DTYPE_F64 ? MOEBLAZE_DTYPE_F64 : MOEBLAZE_DTYPE_F32);
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
    fill(in, logits, config.dtype == MOEBLAZE_DTYPE_F64 ? MOEBLAZE_DTYPE_F64 : MOEBLAZE_DTYPE_F32);
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
  check(whole ? moeblaze_layer_backward(layer, &ba, nullptr)
              : moeblaze_experts_backward(layer, &ba, nullptr));
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return run_one(data, size);
}

#ifndef MOEBLAZE_LIBFUZZER
// Without libFuzzer: replay the files named on the command line, or run pseudo-random inputs
// (MOEBLAZE_FUZZ_RUNS of them, default 2000) from a printed seed (MOEBLAZE_TEST_SEED overrides).
int main(int argc, char** argv) {
  if (argc > 1) {
    for (int i = 1; i < argc; ++i) {
      FILE* f = std::fopen(argv[i], "rb");
      if (!f) {
        std::fprintf(stderr, "cannot open %s\n", argv[i]);
        return 1;
      }
      std::vector<uint8_t> bytes;
      int c;
      while ((c = std::fgetc(f)) != EOF) bytes.push_back(uint8_t(c));
      std::fclose(f);
      run_one(bytes.data(), bytes.size());
    }
    std::printf("replayed %d inputs\n", argc - 1);
    return 0;
  }
  const char* seed_text = std::getenv("MOEBLAZE_TEST_SEED");
  const char* runs_text = std::getenv("MOEBLAZE_FUZZ_RUNS");
  const uint64_t seed = seed_text ? std::strtoull(seed_text, nullptr, 10) : 2527;
  const long runs = runs_text ? std::strtol(runs_text, nullptr, 10) : 2000;
  std::printf("fuzz_layer: %ld pseudo-random inputs, seed %llu (set MOEBLAZE_TEST_SEED)\n", runs,
              (unsigned long long)seed);
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> bytes;
  for (long r = 0; r < runs; ++r) {
    bytes.resize(rng() % 512);
    for (uint8_t& b : bytes) b = uint8_t(rng());
    run_one(bytes.data(), bytes.size());
  }
  std::printf("fuzz_layer: %ld inputs, no failure\n", runs);
  return 0;
}
#endif
