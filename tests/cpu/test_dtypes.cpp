// Rounding of the 16-bit storage dtypes, observed exactly through the public API.
//
// With d = h = E = k = 1, x = 1, w_gate = w_down = 1 and ReLU, every token's y is round(g * 1): the
// library's float -> BF16/F16 conversion applied to the (float) routing weight g. Comparing with
// the test's own, independently written encoder checks round-to-nearest-even, ties, subnormals,
// overflow to Inf, and NaN, bit for bit.
#include <cstdio>
#include <cstring>

#include "support/test_support.hpp"

using namespace mbtest;

namespace {

std::vector<float> interesting_floats(Rng& rng) {
  // (-0 is left out: y = 0 + g * y2 turns it into +0, as a sum starting at zero does.)
  std::vector<float> values = {0.0f,
                               1.0f,
                               -1.0f,
                               65504.0f,
                               65519.99f,
                               65520.0f,
                               1e30f,
                               -1e30f,
                               3.3895314e38f,
                               3.4028235e38f,
                               INFINITY,
                               -INFINITY,
                               5.9604645e-8f /* 2^-24 */,
                               2.9802322e-8f /* 2^-25: tie to 0 */,
                               2.9802326e-8f,
                               8.940697e-8f /* 1.5 * 2^-24: tie to 2^-23 */,
                               6.1035156e-5f /* 2^-14 */,
                               6.1e-5f,
                               1e-40f /* float subnormal */};
  // Exact midpoints between neighbouring BF16 and F16 values (ties) and their float neighbours.
  for (int i = 0; i < 200; ++i) {
    const float base = float(rng.uniform(-4, 4));
    uint32_t bits;
    std::memcpy(&bits, &base, 4);
    for (uint32_t low : {0x8000u, 0x7fffu, 0x8001u}) {  // BF16 tie and neighbours
      const uint32_t b = (bits & 0xffff0000u) | low;
      float f;
      std::memcpy(&f, &b, 4);
      values.push_back(f);
    }
    for (uint32_t low : {0x1000u, 0x0fffu, 0x1001u}) {  // F16 tie (13 dropped bits) and neighbours
      const uint32_t b = (bits & 0xffffe000u) | low;
      float f;
      std::memcpy(&f, &b, 4);
      values.push_back(f);
    }
  }
  // Random bit patterns over the exponents that matter (F16 subnormals up to past BF16's range).
  for (int i = 0; i < 4000; ++i) {
    const uint32_t exponent = uint32_t(rng.uniform_int(90, 160));
    const uint32_t bits = (uint32_t(rng.uniform_int(0, 1)) << 31) | (exponent << 23) |
                          uint32_t(rng.uniform_int(0, (1 << 23) - 1));
    float f;
    std::memcpy(&f, &bits, 4);
    values.push_back(f);
  }
  return values;
}

}  // namespace

TEST_SUITE("cpu") {
  TEST_CASE("dtypes: BF16 and F16 outputs round to nearest even, bit for bit") {
    Context context;
    Rng rng(test_seed(1212));
    const std::vector<float> values = interesting_floats(rng);
    for (int32_t dtype : {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16}) {
      const std::string dtype_name = dtype_label(dtype);
      CAPTURE(dtype_name);
      moeblaze_layer_config_t cfg = make_config(dtype, 1, 1, 1, 1);
      cfg.activation = MOEBLAZE_ACTIVATION_RELU;
      Layer layer(context, cfg);
      LayerRun run(layer, int64_t(values.size()));
      run.x.fill(1.0);
      run.w_gate.fill(1.0);
      run.w_down.fill(1.0);
      std::fill(run.ids.begin(), run.ids.end(), 0);
      std::memcpy(run.g.data(), values.data(), values.size() * sizeof(float));
      MB_CHECK(run.experts_forward(false));
      int64_t mismatches = 0;
      const uint16_t* y = static_cast<const uint16_t*>(run.y.data());
      for (size_t i = 0; i < values.size(); ++i) {
        uint16_t expected =
            dtype == MOEBLAZE_DTYPE_BF16 ? encode_bf16(values[i]) : encode_f16(values[i]);
        // y is the token's sum of its rounded rows, which starts at +0: a row that rounds to -0
        // gives +0.
        if ((expected & 0x7fffu) == 0) expected = 0;
        if (y[i] != expected && mismatches++ < 5) {
          char message[160];
          std::snprintf(message, sizeof message, "g = %a: got 0x%04x, expected 0x%04x",
                        double(values[i]), unsigned(y[i]), unsigned(expected));
          FAIL_CHECK(message);
        }
      }
      CHECK(mismatches == 0);
    }
  }

  TEST_CASE("dtypes: NaN propagates to 16-bit outputs as NaN") {
    Context context;
    for (int32_t dtype : {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16, MOEBLAZE_DTYPE_F32}) {
      moeblaze_layer_config_t cfg = make_config(dtype, 1, 1, 1, 1);
      cfg.activation = MOEBLAZE_ACTIVATION_RELU;
      Layer layer(context, cfg);
      LayerRun run(layer, 2);
      run.x.fill(1.0);
      run.w_gate.fill(1.0);
      run.w_down.fill(1.0);
      std::fill(run.ids.begin(), run.ids.end(), 0);
      run.g.set(0, NAN);
      run.g.set(1, -NAN);
      MB_CHECK(run.experts_forward(false));
      CHECK(std::isnan(run.y.get(0)));
      CHECK(std::isnan(run.y.get(1)));
    }
  }

}  // TEST_SUITE
