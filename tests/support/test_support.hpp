// Shared helpers of the C++ test suites (tests/api, tests/cpu, tests/cuda, tests/ep). Public C API
// only: everything here goes through "moeblaze.h", so the helpers test the library the way a user
// sees it.
//
//   MB_CHECK(call)            REQUIRE a status of MOEBLAZE_OK, printing moeblaze_last_error()
//   MB_CHECK_STATUS_MENTIONS  CHECK a status and what the last error says (MB_CHECK_STATUS and
//                             MB_CHECK_OK are its shorthands)
//   Context, Layer            RAII handles
//   HostTensor                host tensor of any dtype (F32/BF16/F16/F64 storage, double access)
//   Rng, test_seed()          seeded RNG; MOEBLAZE_TEST_SEED overrides the seed, which is printed
//   tolerance_for(), compare()  per-dtype tolerances scaled by reduction length; max abs/rel error
//   LayerRun                  every buffer of one layer config, and forward/backward through the
//   API
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "moeblaze.h"

namespace mbtest {

// ---- status -------------------------------------------------------------------------------------

inline std::string status_text(moeblaze_status_t status) {
  return std::string(moeblaze_status_name(status)) + ": " + moeblaze_last_error();
}

}  // namespace mbtest

// REQUIREs that a moeblaze call succeeds; on failure prints the status name and last error.
#define MB_CHECK(call)                                                     \
  do {                                                                     \
    const moeblaze_status_t mb_check_status_ = (call);                     \
    if (mb_check_status_ != MOEBLAZE_OK) {                                 \
      FAIL(#call " returned " << ::mbtest::status_text(mb_check_status_)); \
    }                                                                      \
  } while (0)

// CHECKs that a moeblaze call returns `expected` and that the thread's last error agrees: on
// failure it is a message that mentions `needle` (any non-empty message for ""), on success it was
// cleared.
#define MB_CHECK_STATUS_MENTIONS(call, expected, needle)                                           \
  do {                                                                                             \
    const moeblaze_status_t mb_check_status_ = (call);                                             \
    CHECK_MESSAGE(mb_check_status_ == (expected),                                                  \
                  #call " returned " << ::mbtest::status_text(mb_check_status_) << ", expected "   \
                                     << std::string(moeblaze_status_name(expected)));              \
    const std::string mb_check_message_ = moeblaze_last_error();                                   \
    if (mb_check_status_ != MOEBLAZE_OK) {                                                         \
      const bool mb_check_mentions_ =                                                              \
          !mb_check_message_.empty() && mb_check_message_.find(needle) != std::string::npos;       \
      CHECK_MESSAGE(mb_check_mentions_, "message '" << mb_check_message_ << "' does not mention '" \
                                                    << std::string(needle) << "'");                \
    } else {                                                                                       \
      CHECK_MESSAGE(mb_check_message_.empty(),                                                     \
                    "success left the message '" << mb_check_message_ << "'");                     \
    }                                                                                              \
  } while (0)

// CHECKs that a moeblaze call fails with `expected`, and that it left a message.
#define MB_CHECK_STATUS(call, expected) MB_CHECK_STATUS_MENTIONS(call, expected, "")

// CHECKs (not fatal, unlike MB_CHECK) that a moeblaze call succeeds and clears the last error.
#define MB_CHECK_OK(call) MB_CHECK_STATUS_MENTIONS(call, MOEBLAZE_OK, "")

namespace mbtest {

// ---- 16-bit conversions (independent of the library's, on purpose)
// --------------------------------

// Rounds a double to the nearest value with `mantissa_bits` explicit mantissa bits and the exponent
// range of the target (min_exponent: smallest normal exponent; max finite from max_exponent),
// ties to even. Then encodes. Written via frexp/ldexp so it shares no code with src/cpu/half.hpp.
inline uint16_t encode_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (std::isnan(value)) return uint16_t((bits >> 16) | 0x40);
  if (std::isinf(value)) return uint16_t(bits >> 16);
  const uint32_t lo_bits = bits & 0xffff0000u;
  float truncated_lo;
  std::memcpy(&truncated_lo, &lo_bits, 4);
  // Candidates: truncated toward zero (lo) and the next bf16 away from zero (hi).
  const uint32_t hi_bits = lo_bits + 0x10000u;
  float hi;
  std::memcpy(&hi, &hi_bits, 4);
  // Past the largest finite bf16 the next step is 2^128 (which encodes as Inf), as IEEE rounding
  // with an unbounded exponent says.
  const double hi_value =
      std::isinf(hi) ? std::copysign(std::ldexp(1.0, 128), double(value)) : double(hi);
  const double below = std::fabs(double(value) - double(truncated_lo));
  const double above = std::fabs(hi_value - double(value));
  if (below < above) return uint16_t(lo_bits >> 16);
  if (above < below) return uint16_t(hi_bits >> 16);
  return uint16_t(((lo_bits >> 16) & 1u) ? (hi_bits >> 16) : (lo_bits >> 16));
}

inline float decode_bf16(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

inline float decode_f16(uint16_t bits) {
  const int sign = (bits & 0x8000) ? -1 : 1;
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  if (exponent == 0x1f) return mantissa ? NAN : sign * INFINITY;
  if (exponent == 0) return float(sign * std::ldexp(double(mantissa), -24));
  return float(sign * std::ldexp(double(1024 + mantissa), exponent - 25));
}

inline uint16_t encode_f16(float value) {
  if (std::isnan(value)) return 0x7e00;
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  const double magnitude = std::fabs(double(value));
  if (magnitude >= 65520.0) return sign | 0x7c00;
  // Quantum of the binade (2^-24 for subnormals), then round-half-even on the integer multiple.
  int exponent;
  std::frexp(magnitude, &exponent);  // magnitude in [2^(exponent-1), 2^exponent)
  const int quantum_exp = std::max(exponent - 11, -24);
  const double scaled = std::ldexp(magnitude, -quantum_exp);
  double integer = std::floor(scaled);
  const double fraction = scaled - integer;
  if (fraction > 0.5 || (fraction == 0.5 && std::fmod(integer, 2.0) == 1.0)) integer += 1;
  const double rounded = std::ldexp(integer, quantum_exp);
  // Encode the (exactly representable) rounded value.
  if (rounded == 0) return sign;
  if (rounded < std::ldexp(1.0, -14)) return sign | uint16_t(std::ldexp(rounded, 24));
  int e;
  const double m = std::frexp(rounded, &e);  // rounded = m * 2^e, m in [0.5, 1)
  const int biased = e - 1 + 15;
  const int mantissa = int(std::ldexp(m, 11)) - 1024;
  return sign | uint16_t(biased << 10) | uint16_t(mantissa);
}

// Rounds a double to what a value of `dtype` can hold (through float for the 16-bit types, as the
// library does).
inline double round_to(int32_t dtype, double value) {
  switch (dtype) {
    case MOEBLAZE_DTYPE_F32: return double(float(value));
    case MOEBLAZE_DTYPE_BF16: return decode_bf16(encode_bf16(float(value)));
    case MOEBLAZE_DTYPE_F16: return decode_f16(encode_f16(float(value)));
    default: return value;
  }
}

inline size_t dtype_bytes(int32_t dtype) {
  switch (dtype) {
    case MOEBLAZE_DTYPE_F32: return 4;
    case MOEBLAZE_DTYPE_BF16:
    case MOEBLAZE_DTYPE_F16: return 2;
    case MOEBLAZE_DTYPE_F64: return 8;
  }
  return 0;
}

inline const char* dtype_label(int32_t dtype) {
  switch (dtype) {
    case MOEBLAZE_DTYPE_F32: return "F32";
    case MOEBLAZE_DTYPE_BF16: return "BF16";
    case MOEBLAZE_DTYPE_F16: return "F16";
    case MOEBLAZE_DTYPE_F64: return "F64";
  }
  return "?";
}

inline int32_t routing_dtype(int32_t dtype) {
  return dtype == MOEBLAZE_DTYPE_F64 ? MOEBLAZE_DTYPE_F64 : MOEBLAZE_DTYPE_F32;
}

// Every moeblaze_activation_code in code order: the suites loop over it. The case "forward: the
// activation list of the tests covers every code" fails when the library accepts a code it lacks.
constexpr int32_t kAllActivations[] = {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_GEGLU,
                                       MOEBLAZE_ACTIVATION_REGLU,  MOEBLAZE_ACTIVATION_SILU,
                                       MOEBLAZE_ACTIVATION_GELU,   MOEBLAZE_ACTIVATION_RELU,
                                       MOEBLAZE_ACTIVATION_RELU2};
constexpr int32_t kActivationCount = int32_t(sizeof(kAllActivations) / sizeof(kAllActivations[0]));

// The header's rule: the gated activations (u = f(a) * b, with w_up) are the *GLU ones.
inline bool is_gated(int32_t activation) {
  return activation == MOEBLAZE_ACTIVATION_SWIGLU || activation == MOEBLAZE_ACTIVATION_GEGLU ||
         activation == MOEBLAZE_ACTIVATION_REGLU;
}

// ---- memory
// ---------------------------------------------------------------------------------------

// Zero-initialised host bytes, 64-byte aligned (the API requires 16).
class AlignedBytes {
 public:
  AlignedBytes() = default;
  explicit AlignedBytes(size_t bytes) { resize(bytes); }
  void resize(size_t bytes) {
    bytes_ = bytes;
    storage_.assign((bytes + 63) / 64 + 1, Block{});
  }
  void* data() { return bytes_ ? static_cast<void*>(storage_.data()) : nullptr; }
  const void* data() const { return bytes_ ? static_cast<const void*>(storage_.data()) : nullptr; }
  size_t size() const { return bytes_; }
  void fill_byte(unsigned char value) { std::memset(storage_.data(), value, bytes_); }

 private:
  struct alignas(64) Block {
    unsigned char bytes[64];
  };
  std::vector<Block> storage_;
  size_t bytes_ = 0;
};

// A dense host tensor of one dtype; elements are read and written as double (rounded on write).
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(int32_t dtype, std::vector<int64_t> shape) { reset(dtype, std::move(shape)); }

  void reset(int32_t dtype, std::vector<int64_t> shape) {
    dtype_ = dtype;
    shape_ = std::move(shape);
    numel_ = 1;
    for (int64_t s : shape_) numel_ *= s;
    bytes_.resize(size_t(numel_) * dtype_bytes(dtype));
  }

  int32_t dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  size_t bytes() const { return bytes_.size(); }

  double get(int64_t i) const {
    const unsigned char* p = static_cast<const unsigned char*>(bytes_.data());
    switch (dtype_) {
      case MOEBLAZE_DTYPE_F32: {
        float v;
        std::memcpy(&v, p + 4 * i, 4);
        return v;
      }
      case MOEBLAZE_DTYPE_F64: {
        double v;
        std::memcpy(&v, p + 8 * i, 8);
        return v;
      }
      case MOEBLAZE_DTYPE_BF16: {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        return decode_bf16(v);
      }
      case MOEBLAZE_DTYPE_F16: {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        return decode_f16(v);
      }
    }
    return NAN;
  }

  void set(int64_t i, double value) {
    unsigned char* p = static_cast<unsigned char*>(bytes_.data());
    switch (dtype_) {
      case MOEBLAZE_DTYPE_F32: {
        const float v = float(value);
        std::memcpy(p + 4 * i, &v, 4);
        return;
      }
      case MOEBLAZE_DTYPE_F64: std::memcpy(p + 8 * i, &value, 8); return;
      case MOEBLAZE_DTYPE_BF16: {
        const uint16_t v = encode_bf16(float(value));
        std::memcpy(p + 2 * i, &v, 2);
        return;
      }
      case MOEBLAZE_DTYPE_F16: {
        const uint16_t v = encode_f16(float(value));
        std::memcpy(p + 2 * i, &v, 2);
        return;
      }
    }
  }

  std::vector<double> to_vector() const {
    std::vector<double> out(static_cast<size_t>(numel_));
    for (int64_t i = 0; i < numel_; ++i) out[size_t(i)] = get(i);
    return out;
  }
  void from_vector(const std::vector<double>& values) {
    REQUIRE(int64_t(values.size()) == numel_);
    for (int64_t i = 0; i < numel_; ++i) set(i, values[size_t(i)]);
  }
  void fill(double value) {
    for (int64_t i = 0; i < numel_; ++i) set(i, value);
  }
  bool bitwise_equal(const HostTensor& other) const {
    return dtype_ == other.dtype_ && bytes_.size() == other.bytes_.size() &&
           (bytes_.size() == 0 ||
            std::memcmp(bytes_.data(), other.bytes_.data(), bytes_.size()) == 0);
  }

 private:
  int32_t dtype_ = MOEBLAZE_DTYPE_F32;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  AlignedBytes bytes_;
};

// ---- randomness
// -----------------------------------------------------------------------------------

// The seed of a random test: MOEBLAZE_TEST_SEED if set, else `fallback`. Printed so a failure can
// be replayed.
inline uint64_t test_seed(uint64_t fallback) {
  uint64_t seed = fallback;
  if (const char* env = std::getenv("MOEBLAZE_TEST_SEED")) seed = std::strtoull(env, nullptr, 0);
  MESSAGE("seed = " << seed << " (set MOEBLAZE_TEST_SEED to override)");
  return seed;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  double normal(double stddev = 1.0) {
    return std::normal_distribution<double>(0.0, stddev)(engine_);
  }
  double uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(engine_);
  }
  int64_t uniform_int(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(engine_);
  }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

inline void fill_normal(HostTensor& tensor, Rng& rng, double stddev) {
  for (int64_t i = 0; i < tensor.numel(); ++i) tensor.set(i, rng.normal(stddev));
}

// k distinct experts per token, uniformly at random.
inline std::vector<int32_t> random_ids(Rng& rng, int64_t T, int64_t E, int64_t k) {
  std::vector<int32_t> ids(size_t(T * k));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) perm[size_t(e)] = int32_t(e);
    std::shuffle(perm.begin(), perm.end(), rng.engine());
    for (int64_t j = 0; j < k; ++j) ids[size_t(t * k + j)] = perm[size_t(j)];
  }
  return ids;
}

// The routing index moeblaze_routing_build() defines, computed independently from `ids` [T,k].
struct ReferenceRoutingIndex {
  std::vector<int32_t> expert_offsets;        // [E+1]
  std::vector<int32_t> expert_token_indices;  // [N]
  std::vector<int32_t> token_index_map;       // [N]
};

inline ReferenceRoutingIndex routing_index_of(const std::vector<int32_t>& ids, int64_t T, int64_t E,
                                              int64_t k) {
  ReferenceRoutingIndex index;
  index.expert_offsets.assign(size_t(E + 1), 0);
  for (int32_t e : ids) ++index.expert_offsets[size_t(e) + 1];
  for (int64_t e = 0; e < E; ++e)
    index.expert_offsets[size_t(e + 1)] += index.expert_offsets[size_t(e)];
  index.expert_token_indices.assign(size_t(T * k), -1);
  index.token_index_map.assign(size_t(T * k), -1);
  std::vector<int32_t> next(index.expert_offsets.begin(), index.expert_offsets.end() - 1);
  for (int64_t t = 0; t < T; ++t) {  // tokens ascending inside each expert
    for (int64_t j = 0; j < k; ++j) {
      const int32_t row = next[size_t(ids[size_t(t * k + j)])]++;
      index.expert_token_indices[size_t(row)] = int32_t(t);
      index.token_index_map[size_t(t * k + j)] = row;
    }
  }
  return index;
}

// The byte offset of the first occurrence of `words` (int32, 4-byte aligned) in a buffer, or -1.
// Finds an array inside a saved buffer by its known content, without relying on the layout.
inline int64_t find_int32_sequence(const void* buffer, size_t bytes,
                                   const std::vector<int32_t>& words) {
  const size_t length = words.size() * sizeof(int32_t);
  const auto* base = static_cast<const unsigned char*>(buffer);
  for (size_t at = 0; length > 0 && at + length <= bytes; at += sizeof(int32_t)) {
    if (std::memcmp(base + at, words.data(), length) == 0) return int64_t(at);
  }
  return -1;
}

// ---- comparison
// -----------------------------------------------------------------------------------

struct Tolerance {
  double atol;
  double rtol;
};

// Unit roundoff of a dtype's storage.
inline double unit_roundoff(int32_t dtype) {
  switch (dtype) {
    case MOEBLAZE_DTYPE_F32: return std::ldexp(1.0, -24);
    case MOEBLAZE_DTYPE_BF16: return std::ldexp(1.0, -8);
    case MOEBLAZE_DTYPE_F16: return std::ldexp(1.0, -11);
    case MOEBLAZE_DTYPE_F64: return std::ldexp(1.0, -53);
  }
  return 1;
}

// Tolerance for a value of `dtype` that is a sum of `reduction_length` products of magnitude about
// `scale`, accumulated in F32 (F64 for F64). Base values follow TransformerEngine's table; atol
// grows with the reduction length: atol = max(base, 4 * K * eps_acc * scale) (docs/testing.md,
// "Tolerances").
inline Tolerance tolerance_for(int32_t dtype, int64_t reduction_length, double scale = 1.0) {
  const double accumulation_eps =
      dtype == MOEBLAZE_DTYPE_F64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
  const double growth =
      4.0 * double(std::max<int64_t>(reduction_length, 1)) * accumulation_eps * scale;
  switch (dtype) {
    case MOEBLAZE_DTYPE_F32: return {std::max(1e-6, growth), 5e-6};
    case MOEBLAZE_DTYPE_F16:
      return {std::max(1e-5, growth + 2 * unit_roundoff(dtype) * scale), 1e-3 * 2};
    case MOEBLAZE_DTYPE_BF16:
      return {std::max(1e-5, growth + 2 * unit_roundoff(dtype) * scale), 1e-2 * 1.6};
    case MOEBLAZE_DTYPE_F64: return {std::max(1e-12, growth), 1e-12};
  }
  return {0, 0};
}

struct CompareResult {
  bool ok = true;
  double max_abs = 0;
  double max_rel = 0;
  int64_t mismatches = 0;
  int64_t first_mismatch = -1;
};

// got[i] passes if |got - ref| <= atol + rtol * |ref|. NaN never passes (neither in got nor in
// ref). Reports max abs/rel error, the number of mismatches and the first one.
inline CompareResult compare(const std::string& name, const std::vector<double>& got,
                             const std::vector<double>& ref, Tolerance tol) {
  CompareResult result;
  REQUIRE_MESSAGE(got.size() == ref.size(),
                  name << ": size " << got.size() << " vs reference " << ref.size());
  double worst_fraction = 0;  // of the allowed error used
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(got[i] - ref[i]);
    const double allowed = tol.atol + tol.rtol * std::fabs(ref[i]);
    const bool bad = !(diff <= allowed) || std::isnan(got[i]) || std::isnan(ref[i]);
    if (std::isfinite(diff)) {
      result.max_abs = std::max(result.max_abs, diff);
      if (ref[i] != 0) result.max_rel = std::max(result.max_rel, diff / std::fabs(ref[i]));
      worst_fraction = std::max(worst_fraction, allowed > 0 ? diff / allowed : 0.0);
    }
    if (bad) {
      if (result.first_mismatch < 0) result.first_mismatch = int64_t(i);
      ++result.mismatches;
      result.ok = false;
    }
  }
  std::ostringstream report;
  report << name << ": n=" << got.size() << " max_abs=" << result.max_abs
         << " max_rel=" << result.max_rel << " (atol=" << tol.atol << " rtol=" << tol.rtol << ", "
         << int(100 * worst_fraction) << "% of the allowed error used)";
  if (!result.ok) {
    const size_t i = size_t(result.first_mismatch);
    report << "; " << result.mismatches << " mismatches, first at [" << i << "]: got " << got[i]
           << " expected " << ref[i];
  }
  CHECK_MESSAGE(result.ok, report.str());
  return result;
}

inline CompareResult compare(const std::string& name, const HostTensor& got,
                             const std::vector<double>& ref, Tolerance tol) {
  return compare(name, got.to_vector(), ref, tol);
}

// ---- handles
// --------------------------------------------------------------------------------------

class Context {
 public:
  explicit Context(int32_t backend = MOEBLAZE_BACKEND_CPU, int32_t device = 0) {
    MB_CHECK(moeblaze_context_create(&handle_, backend, device));
  }
  ~Context() { moeblaze_context_destroy(handle_); }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  moeblaze_context_t get() const { return handle_; }
  void set_num_threads(int32_t n) { MB_CHECK(moeblaze_context_set_num_threads(handle_, n)); }

 private:
  moeblaze_context_t handle_ = nullptr;
};

inline moeblaze_layer_config_t make_config(int32_t dtype, int64_t d, int64_t h, int64_t E,
                                           int64_t k) {
  moeblaze_layer_config_t config;
  MB_CHECK(moeblaze_layer_config_init(&config, sizeof config));
  config.dtype = dtype;
  config.d_model = d;
  config.d_ffn = h;
  config.num_experts = E;
  config.top_k = k;
  return config;
}

inline std::string describe(const moeblaze_layer_config_t& c) {
  std::ostringstream s;
  s << dtype_label(c.dtype) << " d=" << c.d_model << " h=" << c.d_ffn << " E=" << c.num_experts
    << " k=" << c.top_k << " act=" << c.activation << " ckpt=" << c.checkpoint
    << " score=" << c.score_function << " renorm=" << c.renormalize << " aux=" << c.aux_loss_coeff
    << " z=" << c.z_loss_coeff;
  return s.str();
}

class Layer {
 public:
  Layer(const Context& context, const moeblaze_layer_config_t& config) : config_(config) {
    MB_CHECK(moeblaze_layer_create(&handle_, context.get(), &config));
  }
  ~Layer() { moeblaze_layer_destroy(handle_); }
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;
  moeblaze_layer_t get() const { return handle_; }
  const moeblaze_layer_config_t& config() const { return config_; }

  size_t workspace_size(int32_t pass, int64_t T) const {
    size_t bytes = 0;
    MB_CHECK(moeblaze_layer_workspace_size(handle_, pass, T, &bytes));
    return bytes;
  }
  size_t workspace_size(int32_t pass, int64_t T, uint32_t flags) const {
    size_t bytes = 0;
    MB_CHECK(moeblaze_layer_workspace_size_with_flags(handle_, pass, T, flags, &bytes));
    return bytes;
  }
  size_t saved_size(int32_t pass, int64_t T) const {
    size_t bytes = 0;
    MB_CHECK(moeblaze_layer_saved_size(handle_, pass, T, &bytes));
    return bytes;
  }

 private:
  moeblaze_layer_t handle_ = nullptr;
  moeblaze_layer_config_t config_;
};

// ---- one layer's buffers and calls
// ----------------------------------------------------------------

// Which gradients a backward call writes (NULL for the others).
struct BackwardOutputs {
  bool dx = true, dw_router = true, dw_gate = true, dw_up = true, dw_down = true, dg = true,
       d_logits = true;
};

// Every buffer of one layer configuration for T tokens, allocated from the size queries, and the
// forward/backward calls through the public API. Outputs are pre-filled with NaN so a skipped write
// is visible. Tests set the inputs (init_random() or by hand) and read the outputs.
struct LayerRun {
  const Layer& layer;
  moeblaze_layer_config_t cfg;
  int64_t T, d, h, E, k;
  int32_t dtype, rdtype;
  bool gated;

  // inputs
  HostTensor x, w_router, w_gate, w_up, w_down, dy;  // dtype
  std::vector<int32_t> ids;                          // [T,k] experts forward/backward
  HostTensor g;                                      // [T,k] routing dtype
  HostTensor d_losses;                               // [2] routing dtype
  bool use_d_losses = false;                         // else NULL ({1, 1})
  // outputs
  HostTensor y, dx, dw_router, dw_gate, dw_up, dw_down;  // dtype
  HostTensor logits, g_out, dg, d_logits, losses;        // routing dtype
  std::vector<int32_t> ids_out, expert_counts;
  AlignedBytes saved, workspace;
  int32_t forward_pass = MOEBLAZE_PASS_EXPERTS_FORWARD;
  // A forward with a saved buffer gets exactly the MOEBLAZE_FORWARD_WITH_SAVED workspace (the
  // smallest it accepts) unless this is false (then the plain, larger size).
  bool lean_training_workspace = true;

  LayerRun(const Layer& layer_, int64_t T_)
      : layer(layer_),
        cfg(layer_.config()),
        T(T_),
        d(cfg.d_model),
        h(cfg.d_ffn),
        E(cfg.num_experts),
        k(cfg.top_k),
        dtype(cfg.dtype),
        rdtype(routing_dtype(cfg.dtype)),
        gated(is_gated(cfg.activation)) {
    x.reset(dtype, {T, d});
    w_router.reset(dtype, {E, d});
    w_gate.reset(dtype, {E, h, d});
    w_up.reset(dtype, {E, h, d});
    w_down.reset(dtype, {E, d, h});
    dy.reset(dtype, {T, d});
    ids.assign(size_t(T * k), 0);
    g.reset(rdtype, {T, k});
    d_losses.reset(rdtype, {2});
    y.reset(dtype, {T, d});
    dx.reset(dtype, {T, d});
    dw_router.reset(dtype, {E, d});
    dw_gate.reset(dtype, {E, h, d});
    dw_up.reset(dtype, {E, h, d});
    dw_down.reset(dtype, {E, d, h});
    logits.reset(rdtype, {T, E});
    g_out.reset(rdtype, {T, k});
    dg.reset(rdtype, {T, k});
    d_logits.reset(rdtype, {T, E});
    losses.reset(rdtype, {2});
    ids_out.assign(size_t(T * k), -1);
    expert_counts.assign(size_t(E), -1);
  }

  // x ~ N(0,1), weights ~ N(0, 1/sqrt(fan_in)), dy ~ N(0,1), random distinct ids, g ~ U(0.1, 1).
  void init_random(Rng& rng) {
    fill_normal(x, rng, 1.0);
    fill_normal(w_router, rng, 1.0 / std::sqrt(double(d)));
    fill_normal(w_gate, rng, 1.0 / std::sqrt(double(d)));
    fill_normal(w_up, rng, 1.0 / std::sqrt(double(d)));
    fill_normal(w_down, rng, 1.0 / std::sqrt(double(h)));
    fill_normal(dy, rng, 1.0);
    ids = random_ids(rng, T, E, k);
    for (int64_t i = 0; i < g.numel(); ++i) g.set(i, rng.uniform(0.1, 1.0));
    d_losses.set(0, 1.0);
    d_losses.set(1, 1.0);
  }

  void clear_outputs() {
    for (HostTensor* t : {&y, &dx, &dw_router, &dw_gate, &dw_up, &dw_down, &logits, &g_out, &dg,
                          &d_logits, &losses}) {
      t->fill(NAN);
    }
    std::fill(ids_out.begin(), ids_out.end(), -1);
    std::fill(expert_counts.begin(), expert_counts.end(), -1);
  }

  void prepare(int32_t pass, bool with_saved) {
    const bool forward =
        pass == MOEBLAZE_PASS_EXPERTS_FORWARD || pass == MOEBLAZE_PASS_LAYER_FORWARD;
    const bool lean = forward && with_saved && lean_training_workspace;
    workspace.resize(layer.workspace_size(pass, T, lean ? MOEBLAZE_FORWARD_WITH_SAVED : 0u));
    workspace.fill_byte(0xff);  // garbage the backend must not depend on
    if (with_saved) saved.resize(layer.saved_size(pass, T));
  }

  moeblaze_forward_args_t forward_args(bool with_saved) {
    moeblaze_forward_args_t a;
    MB_CHECK(moeblaze_forward_args_init(&a, sizeof a));
    a.num_tokens = T;
    a.x = x.data();
    a.w_router = w_router.data();
    a.w_gate = w_gate.data();
    a.w_up = gated ? w_up.data() : nullptr;
    a.w_down = w_down.data();
    a.ids = ids.data();
    a.g = g.data();
    a.y = y.data();
    a.expert_counts = expert_counts.data();
    a.saved = with_saved ? saved.data() : nullptr;
    a.saved_bytes = with_saved ? saved.size() : 0;
    a.workspace = workspace.data();
    a.workspace_bytes = workspace.size();
    return a;
  }

  moeblaze_status_t experts_forward(bool with_saved = true) {
    forward_pass = MOEBLAZE_PASS_EXPERTS_FORWARD;
    prepare(forward_pass, with_saved);
    moeblaze_forward_args_t a = forward_args(with_saved);
    return moeblaze_experts_forward(layer.get(), &a, nullptr);
  }

  moeblaze_status_t layer_forward(bool with_saved = true) {
    forward_pass = MOEBLAZE_PASS_LAYER_FORWARD;
    prepare(forward_pass, with_saved);
    moeblaze_forward_args_t a = forward_args(with_saved);
    a.ids = nullptr;
    a.g = nullptr;
    a.logits_out = logits.data();
    a.ids_out = ids_out.data();
    a.g_out = g_out.data();
    a.losses = losses.data();
    return moeblaze_layer_forward(layer.get(), &a, nullptr);
  }

  using Outputs = BackwardOutputs;

  moeblaze_backward_args_t backward_args(Outputs out, uint32_t flags) {
    moeblaze_backward_args_t a;
    MB_CHECK(moeblaze_backward_args_init(&a, sizeof a));
    a.flags = flags;
    a.num_tokens = T;
    a.dy = dy.data();
    a.d_losses = use_d_losses ? d_losses.data() : nullptr;
    a.x = x.data();
    a.w_router = w_router.data();
    a.w_gate = w_gate.data();
    a.w_up = gated ? w_up.data() : nullptr;
    a.w_down = w_down.data();
    a.ids = ids.data();
    a.g = g.data();
    a.saved = saved.data();
    a.saved_bytes = saved.size();
    a.dx = out.dx ? dx.data() : nullptr;
    a.dw_router = out.dw_router ? dw_router.data() : nullptr;
    a.dw_gate = out.dw_gate ? dw_gate.data() : nullptr;
    a.dw_up = out.dw_up && gated ? dw_up.data() : nullptr;
    a.dw_down = out.dw_down ? dw_down.data() : nullptr;
    a.dg = out.dg ? dg.data() : nullptr;
    a.d_logits = out.d_logits ? d_logits.data() : nullptr;
    a.workspace = workspace.data();
    a.workspace_bytes = workspace.size();
    return a;
  }

  moeblaze_status_t experts_backward(Outputs out = Outputs(), uint32_t flags = 0) {
    prepare(MOEBLAZE_PASS_EXPERTS_BACKWARD, false);
    moeblaze_backward_args_t a = backward_args(out, flags);
    a.dw_router = nullptr;
    a.d_logits = nullptr;
    return moeblaze_experts_backward(layer.get(), &a, nullptr);
  }

  moeblaze_status_t layer_backward(Outputs out = Outputs(), uint32_t flags = 0) {
    prepare(MOEBLAZE_PASS_LAYER_BACKWARD, false);
    moeblaze_backward_args_t a = backward_args(out, flags);
    a.ids = nullptr;
    a.g = nullptr;
    a.dg = nullptr;
    return moeblaze_layer_backward(layer.get(), &a, nullptr);
  }
};

}  // namespace mbtest
