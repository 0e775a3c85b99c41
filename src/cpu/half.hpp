// 16-bit floating-point storage types of the CPU backend and their conversions to and from float.
// Conversions to 16 bits round to nearest, ties to even, and keep NaN (quiet), Inf and subnormals.
#pragma once

#include <cstdint>
#include <cstring>

namespace moeblaze {
namespace cpu {

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline float bf16_to_float(bf16 value) {
  return bits_float(uint32_t(value.bits) << 16);
}

inline bf16 float_to_bf16(float value) {
  const uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return bf16{uint16_t((bits >> 16) | 0x0040u)};  // NaN: keep sign and payload top, make it quiet
  }
  // Adding 0x7fff plus the lowest kept bit rounds to nearest even; carries propagate into the
  // exponent, so the largest finite values correctly round up to Inf.
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return bf16{uint16_t((bits + rounding) >> 16)};
}

inline float f16_to_float(f16 value) {
  const uint32_t sign = uint32_t(value.bits & 0x8000u) << 16;
  const uint32_t exponent = (value.bits >> 10) & 0x1fu;
  const uint32_t mantissa = value.bits & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // Inf, NaN
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in float.
    const float magnitude = float(mantissa) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Keeps `kept` = bits >> shift and rounds it to nearest even using the dropped bits.
inline uint32_t round_shift_right_even(uint32_t bits, uint32_t shift) {
  const uint32_t kept = bits >> shift;
  const uint32_t dropped = bits & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  return kept + ((dropped > half || (dropped == half && (kept & 1u))) ? 1u : 0u);
}

inline f16 float_to_f16(float value) {
  const uint32_t bits = float_bits(value);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu))};
  if (magnitude >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};  // >= 65520 (or Inf) -> Inf
  const uint32_t exponent = magnitude >> 23;                           // biased float exponent
  if (exponent >= 113) {
    // Normal half: rebias the exponent, round the 23-bit mantissa to 10 bits (a carry may bump the
    // exponent, which is the correct result).
    const uint32_t rebased = ((exponent - 112u) << 23) | (magnitude & 0x7fffffu);
    return f16{uint16_t(sign | round_shift_right_even(rebased, 13))};
  }
  if (exponent < 102) return f16{sign};  // below 2^-25: rounds to zero
  // Subnormal half (units of 2^-24): the value is mantissa_with_hidden_bit * 2^(exponent - 150).
  const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
  return f16{uint16_t(sign | round_shift_right_even(mantissa, 126u - exponent))};
}

// Load a storage value into its accumulation type, and round an accumulator into storage.
inline float to_acc(float value) {
  return value;
}
inline double to_acc(double value) {
  return value;
}
inline float to_acc(bf16 value) {
  return bf16_to_float(value);
}
inline float to_acc(f16 value) {
  return f16_to_float(value);
}

template <typename Storage>
inline Storage from_acc(float value);
template <>
inline float from_acc<float>(float value) {
  return value;
}
template <>
inline bf16 from_acc<bf16>(float value) {
  return float_to_bf16(value);
}
template <>
inline f16 from_acc<f16>(float value) {
  return float_to_f16(value);
}
template <typename Storage>
inline Storage from_acc(double value);
template <>
inline double from_acc<double>(double value) {
  return value;
}

}  // namespace cpu
}  // namespace moeblaze
