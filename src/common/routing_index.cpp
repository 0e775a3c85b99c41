#include "common/routing_index.hpp"

#include "common/status.hpp"

namespace moeblaze {

void check_routing_index(int64_t T, int64_t k, int64_t E, const int32_t* expert_offsets,
                         const int32_t* expert_token_indices, const int32_t* token_index_map,
                         const char* argument) {
  const int64_t N = T * k;
  MB_REQUIRE_ARG(expert_offsets[0] == 0 && expert_offsets[E] == N,
                 "%s: corrupted routing index: expert_offsets[0] = %d and expert_offsets[E=%lld] = "
                 "%d, expected 0 and N = %lld (the buffer was modified after the forward pass "
                 "that filled it)",
                 argument, int(expert_offsets[0]), (long long)E, int(expert_offsets[E]),
                 (long long)N);
  for (int64_t e = 0; e < E; ++e) {
    MB_REQUIRE_ARG(
        expert_offsets[e] <= expert_offsets[e + 1],
        "%s: corrupted routing index: expert_offsets[%lld] = %d > expert_offsets[%lld] = "
        "%d (offsets must not decrease)",
        argument, (long long)e, int(expert_offsets[e]), (long long)(e + 1),
        int(expert_offsets[e + 1]));
  }
  for (int64_t r = 0; r < N; ++r) {
    const int32_t t = expert_token_indices[r];
    MB_REQUIRE_ARG(t >= 0 && t < T,
                   "%s: corrupted routing index: expert_token_indices[%lld] = %d is not a token "
                   "in [0, T=%lld)",
                   argument, (long long)r, int(t), (long long)T);
  }
  for (int64_t p = 0; p < N; ++p) {
    const int32_t r = token_index_map[p];
    MB_REQUIRE_ARG(r >= 0 && r < N && expert_token_indices[r] == p / k,
                   "%s: corrupted routing index: token_index_map[%lld] = %d is not a row of token "
                   "%lld",
                   argument, (long long)p, int(r), (long long)(p / k));
  }
  // Every row reached by some pair: with N pairs and N rows, the map is then a bijection.
  for (int64_t r = 0; r < N; ++r) {
    const int64_t t = expert_token_indices[r];
    bool reached = false;
    for (int64_t j = 0; j < k && !reached; ++j) reached = token_index_map[t * k + j] == r;
    MB_REQUIRE_ARG(reached,
                   "%s: corrupted routing index: row %lld (token %lld) is the row of no pair in "
                   "token_index_map",
                   argument, (long long)r, (long long)t);
  }
}

void check_ids_match_routing_index(int64_t T, int64_t k, int64_t E, const int32_t* ids,
                                   const int32_t* expert_offsets, const int32_t* token_index_map,
                                   const char* ids_argument, const char* index_argument) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      MB_REQUIRE_ARG(e >= 0 && e < E, "%s[t=%lld, j=%lld] = %d is out of range [0, E=%lld)",
                     ids_argument, (long long)t, (long long)j, int(e), (long long)E);
      const int32_t r = token_index_map[t * k + j];
      MB_REQUIRE_ARG(r >= expert_offsets[e] && r < expert_offsets[e + 1],
                     "%s[t=%lld, j=%lld] = %d differs from the ids of the forward pass that "
                     "filled `%s`",
                     ids_argument, (long long)t, (long long)j, int(e), index_argument);
    }
  }
}

}  // namespace moeblaze
