// Checks of a routing index read back from a caller-owned buffer (a layer's saved buffer, the
// expert-parallel HOME saved buffer): the caller can overwrite such a buffer between the forward
// pass that wrote it and the call that reads it, and every index in it addresses memory. Host
// memory only (the CPU backend, the EP layer on a CPU context); each check is O(N * k).
#pragma once

#include <cstdint>

namespace moeblaze {

// The routing index of N = T*k routed rows over E experts, as moeblaze_routing_build() defines it
// (expert_offsets [E+1], expert_token_indices [N], token_index_map [N]). Throws
// Error(INVALID_ARGUMENT) naming `argument` unless the offsets run from 0 to N without decreasing,
// every row names a token in [0, T), and token_index_map is a bijection between the pairs (t, j)
// and the rows with expert_token_indices[token_index_map[t*k + j]] == t. Once it passes, no index
// in it addresses anything outside the tensors it indexes.
void check_routing_index(int64_t T, int64_t k, int64_t E, const int32_t* expert_offsets,
                         const int32_t* expert_token_indices, const int32_t* token_index_map,
                         const char* argument);

// `ids` [T,k] (named `ids_argument`) must be the ids the index of `index_argument` was built from:
// each in [0, E), and the row of pair (t, j) inside the rows of expert ids[t, j]. Call after
// check_routing_index. Throws Error(INVALID_ARGUMENT).
void check_ids_match_routing_index(int64_t T, int64_t k, int64_t E, const int32_t* ids,
                                   const int32_t* expert_offsets, const int32_t* token_index_map,
                                   const char* ids_argument, const char* index_argument);

}  // namespace moeblaze
