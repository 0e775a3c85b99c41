// What the fuzz targets (fuzz_layer.cpp, fuzz_ep.cpp) share: reading the input, exact-size heap
// blocks under a memory limit, the status check, tensor contents, the layer configuration, and the
// program that runs a target without libFuzzer.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "moeblaze.h"

namespace moeblaze_fuzz {

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

// The most one input may hold allocated at once: the targets skip shapes that would need more,
// and a block past it traps, so a too-loose skip fails here instead of exhausting the fuzzer's
// memory (libFuzzer stops at 4 GiB).
constexpr size_t kMaxLiveBytes = size_t(1) << 26;
// The largest saved buffer or workspace a target asks the library for before it skips the shape.
constexpr size_t kMaxLibraryBytes = size_t(1) << 24;
inline std::atomic<size_t> live_bytes{0};

// An exact-size, 64-byte aligned, zeroed heap block (ASan sees any access past its end).
struct Block {
  explicit Block(size_t bytes) : size(bytes) {
    const size_t now = live_bytes += bytes;
    if (now > kMaxLiveBytes) {
      std::fprintf(stderr, "fuzz: %zu bytes allocated at once (limit %zu)\n", now, kMaxLiveBytes);
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

inline size_t dtype_size(int32_t dtype) {
  return dtype == MOEBLAZE_DTYPE_F64 ? 8 : dtype == MOEBLAZE_DTYPE_F32 ? 4 : 2;
}

// The dtype of routing tensors (logits, g, losses) for a layer of `dtype`.
inline int32_t routing_dtype(int32_t dtype) {
  return dtype == MOEBLAZE_DTYPE_F64 ? MOEBLAZE_DTYPE_F64 : MOEBLAZE_DTYPE_F32;
}

// Every status the header documents for these calls, and a message whenever it is not OK.
// MOEBLAZE_ERR_INTERNAL (a LOCAL group waited out its timeout) and anything else trap.
inline void check(moeblaze_status_t status) {
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
      std::fprintf(stderr, "unexpected status %d: %s\n", int(status), moeblaze_last_error());
      __builtin_trap();
  }
}

// Fills `b` with elements of `dtype` from the input (any bit pattern at times); past the input's
// end, with a fixed pattern of ordinary values.
inline void fill(Input& in, const Block& b, int32_t dtype) {
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

// A layer configuration with every field drawn from the input, valid or not.
inline moeblaze_layer_config_t draw_config(Input& in) {
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
  return config;
}

// Whether a layer of `config` on `tokens` tokens, each routed to `top_k` rows, is too large to be
// worth running: the weights, the tokens and the expert work each past 2^16 elements or
// multiply-adds (a negative field counts as too large). Each factor is bounded before it
// multiplies, so nothing overflows, whatever the fields hold.
inline bool too_large(const moeblaze_layer_config_t& config, int64_t tokens, int64_t top_k) {
  constexpr int64_t kMax = int64_t(1) << 16;
  const auto over = [](int64_t a, int64_t b) {
    return a < 0 || b < 0 || a > kMax || b > kMax || a * b > kMax;
  };
  const int64_t d = config.d_model, h = config.d_ffn, E = config.num_experts;
  return over(d, h) || over(d * h, E) || over(tokens, d + E) || over(tokens, top_k) ||
         over(tokens * top_k, h) || over(tokens * top_k * h, d);
}

// A moeblaze CPU context of one thread, created once for the process.
inline moeblaze_context_t cpu_context() {
  static moeblaze_context_t context = [] {
    moeblaze_context_t c = nullptr;
    moeblaze_context_create(&c, MOEBLAZE_BACKEND_CPU, 0);
    moeblaze_context_set_num_threads(c, 1);
    return c;
  }();
  return context;
}

// The program around a target built without libFuzzer: replays the files named on the command
// line, or runs MOEBLAZE_FUZZ_RUNS (default 2000) pseudo-random inputs of up to `max_bytes`
// bytes from a printed seed (MOEBLAZE_TEST_SEED overrides 2527).
inline int run_without_libfuzzer(int argc, char** argv, const char* name, size_t max_bytes,
                                 int (*run_one)(const uint8_t*, size_t)) {
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
    std::printf("%s: replayed %d inputs\n", name, argc - 1);
    return 0;
  }
  const char* seed_text = std::getenv("MOEBLAZE_TEST_SEED");
  const char* runs_text = std::getenv("MOEBLAZE_FUZZ_RUNS");
  const uint64_t seed = seed_text ? std::strtoull(seed_text, nullptr, 10) : 2527;
  const long runs = runs_text ? std::strtol(runs_text, nullptr, 10) : 2000;
  std::printf("%s: %ld pseudo-random inputs, seed %llu (set MOEBLAZE_TEST_SEED)\n", name, runs,
              (unsigned long long)seed);
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> bytes;
  for (long r = 0; r < runs; ++r) {
    bytes.resize(rng() % max_bytes);
    for (uint8_t& b : bytes) b = uint8_t(rng());
    run_one(bytes.data(), bytes.size());
  }
  std::printf("%s: %ld inputs, no failure\n", name, runs);
  return 0;
}

}  // namespace moeblaze_fuzz

// The entry points of a fuzz target whose body is `run_one`: libFuzzer's, and without libFuzzer
// (MOEBLAZE_LIBFUZZER undefined) a main that runs run_without_libfuzzer.
#ifdef MOEBLAZE_LIBFUZZER
#define MOEBLAZE_FUZZ_TARGET(name, run_one)                                 \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { \
    return run_one(data, size);                                             \
  }
#else
#define MOEBLAZE_FUZZ_TARGET(name, run_one)                                      \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {      \
    return run_one(data, size);                                                  \
  }                                                                              \
  int main(int argc, char** argv) {                                              \
    return moeblaze_fuzz::run_without_libfuzzer(argc, argv, name, 512, run_one); \
  }
#endif
