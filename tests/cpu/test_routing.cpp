// Index-based routing (moeblaze_routing_build) on the CPU backend: the paper's worked example, the
// structural invariants on random ids, and the errors the CPU backend detects in ids.
#include <numeric>

#include "support/test_support.hpp"

using namespace mbtest;

namespace {

struct RoutingIndex {
  std::vector<int32_t> offsets, token_indices, index_map;
};

RoutingIndex build(const Layer& layer, int64_t T, const std::vector<int32_t>& ids,
                   moeblaze_status_t expected = MOEBLAZE_OK) {
  const int64_t E = layer.config().num_experts;
  const int64_t N = T * layer.config().top_k;
  RoutingIndex index;
  index.offsets.assign(size_t(E + 1), -7);
  index.token_indices.assign(size_t(N), -7);
  index.index_map.assign(size_t(N), -7);
  AlignedBytes workspace(layer.workspace_size(MOEBLAZE_PASS_ROUTING_BUILD, T));
  const moeblaze_status_t status = moeblaze_routing_build(
      layer.get(), T, ids.data(), index.offsets.data(), index.token_indices.data(),
      index.index_map.data(), workspace.data(), workspace.size(), nullptr);
  if (expected == MOEBLAZE_OK) {
    MB_CHECK(status);
  } else {
    CHECK_MESSAGE(status == expected, status_text(status));
  }
  return index;
}

void check_invariants(const RoutingIndex& index, const std::vector<int32_t>& ids, int64_t T,
                      int64_t E, int64_t k) {
  const int64_t N = T * k;
  REQUIRE(index.offsets[0] == 0);
  REQUIRE(index.offsets[size_t(E)] == N);
  for (int64_t e = 0; e < E; ++e) {
    REQUIRE(index.offsets[size_t(e)] <= index.offsets[size_t(e + 1)]);
    int64_t expected_count = 0;
    for (int32_t id : ids) expected_count += id == e ? 1 : 0;
    REQUIRE(index.offsets[size_t(e + 1)] - index.offsets[size_t(e)] == expected_count);
    for (int32_t r = index.offsets[size_t(e)] + 1; r < index.offsets[size_t(e + 1)]; ++r) {
      REQUIRE(index.token_indices[size_t(r - 1)] < index.token_indices[size_t(r)]);
    }
  }
  std::vector<int> row_used(size_t(N), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = index.index_map[size_t(t * k + j)];
      const int32_t e = ids[size_t(t * k + j)];
      REQUIRE(r >= index.offsets[size_t(e)]);
      REQUIRE(r < index.offsets[size_t(e + 1)]);
      REQUIRE(index.token_indices[size_t(r)] == t);
      ++row_used[size_t(r)];
    }
  }
  for (int used : row_used) REQUIRE(used == 1);
}

}  // namespace

TEST_SUITE("cpu") {
  TEST_CASE("routing: the paper's worked example (T=5, E=4, k=2)") {
    Context context;
    Layer layer(context, make_config(MOEBLAZE_DTYPE_F32, 8, 8, 4, 2));
    const std::vector<int32_t> ids = {2, 3, 0, 1, 0, 3, 1, 2, 0, 3};
    const RoutingIndex index = build(layer, 5, ids);
    CHECK(index.token_indices == std::vector<int32_t>{1, 2, 4, 1, 3, 0, 3, 0, 2, 4});
    CHECK(index.offsets == std::vector<int32_t>{0, 3, 5, 7, 10});
    CHECK(index.index_map == std::vector<int32_t>{5, 7, 0, 3, 1, 8, 4, 6, 2, 9});
    check_invariants(index, ids, 5, 4, 2);
  }

  TEST_CASE("routing: invariants on random ids") {
    Context context;
    Rng rng(test_seed(20260101));
    struct Shape {
      int64_t T, E, k;
    };
    for (Shape s : {Shape{1, 1, 1}, Shape{7, 3, 3}, Shape{64, 8, 2}, Shape{333, 31, 5},
                    Shape{1000, 64, 8}, Shape{50, 128, 1}}) {
      CAPTURE(s.T);
      CAPTURE(s.E);
      CAPTURE(s.k);
      Layer layer(context, make_config(MOEBLAZE_DTYPE_BF16, 16, 16, s.E, s.k));
      const std::vector<int32_t> ids = random_ids(rng, s.T, s.E, s.k);
      check_invariants(build(layer, s.T, ids), ids, s.T, s.E, s.k);
    }
  }

  TEST_CASE("routing: every token on one expert, and empty experts") {
    Context context;
    Layer layer(context, make_config(MOEBLAZE_DTYPE_F32, 8, 8, 6, 2));
    const int64_t T = 9;
    std::vector<int32_t> ids;
    for (int64_t t = 0; t < T; ++t) {
      ids.push_back(4);
      ids.push_back(t % 2 ? 1 : 5);
    }
    const RoutingIndex index = build(layer, T, ids);
    CHECK(index.offsets == std::vector<int32_t>{0, 0, 4, 4, 4, 13, 18});
    check_invariants(index, ids, T, 6, 2);
  }

  TEST_CASE("routing: T = 0") {
    Context context;
    Layer layer(context, make_config(MOEBLAZE_DTYPE_F32, 8, 8, 3, 2));
    const RoutingIndex index = build(layer, 0, {});
    CHECK(index.offsets == std::vector<int32_t>{0, 0, 0, 0});
  }

  TEST_CASE("routing: ids out of range or repeated are INVALID_ARGUMENT") {
    Context context;
    Layer layer(context, make_config(MOEBLAZE_DTYPE_F32, 8, 8, 4, 2));
    SUBCASE("too large") {
      build(layer, 3, {0, 1, 2, 4, 1, 3}, MOEBLAZE_ERR_INVALID_ARGUMENT);
      const std::string message = moeblaze_last_error();
      CHECK_MESSAGE(message.find("t=1") != std::string::npos, message);
      CHECK_MESSAGE(message.find("j=1") != std::string::npos, message);
    }
    SUBCASE("negative") {
      build(layer, 2, {0, 1, -1, 3}, MOEBLAZE_ERR_INVALID_ARGUMENT);
    }
    SUBCASE("repeated within a token") {
      build(layer, 3, {0, 1, 2, 2, 1, 3}, MOEBLAZE_ERR_INVALID_ARGUMENT);
      const std::string message = moeblaze_last_error();
      CHECK_MESSAGE(message.find("t=1") != std::string::npos, message);
    }
  }

}  // TEST_SUITE
