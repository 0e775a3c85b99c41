// Index-based routing, built the way the MoEBlaze paper builds it (and the CUDA backend mirrors):
//   1. a dense [T, E] map holding, for each (token, expert), the slot j that picked it or -1;
//   2. per-expert counts (a column reduction of the map);
//   3. an exclusive scan of the counts -> expert_offsets;
//   4. per expert, a scatter in ascending token order -> expert_token_indices and token_index_map.
// No atomics and no sort: the result is a pure function of ids.
#include "cpu/cpu_kernels.hpp"

namespace moeblaze {
namespace cpu {

RoutingScratch carve_routing_scratch(Carver& carver, const LayerDesc& desc, int64_t T) {
  RoutingScratch scratch;
  scratch.dense_map = carver.carve<int32_t>(sizeof(int32_t) * size_t(T) * size_t(desc.E));
  scratch.counts = carver.carve<int32_t>(sizeof(int32_t) * size_t(desc.E));
  return scratch;
}

void build_routing(const LayerDesc& desc, int64_t T, const int32_t* ids, int32_t* expert_offsets,
                   int32_t* expert_token_indices, int32_t* token_index_map,
                   const RoutingScratch& scratch, ThreadPool& pool) {
  const int64_t E = desc.E;
  const int64_t k = desc.k;
  int32_t* dense_map = scratch.dense_map;  // [T, E]
  int32_t* counts = scratch.counts;        // [E]

  // Validation runs serially so the reported (t, j) is always the first offending pair.
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      MB_REQUIRE_ARG(e >= 0 && e < E, "ids[t=%lld, j=%lld] = %d is out of range [0, E=%lld)",
                     (long long)t, (long long)j, int(e), (long long)E);
    }
  }

  // 1. Dense token-expert map.
  pool.parallel_for(T, [&](int64_t begin, int64_t end) {
    std::fill(dense_map + begin * E, dense_map + end * E, int32_t(-1));
  });
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      int32_t& slot = dense_map[t * E + e];
      MB_REQUIRE_ARG(slot < 0,
                     "ids[t=%lld, j=%lld] = %d repeats ids[t=%lld, j=%d]: the experts of "
                     "a token must be distinct",
                     (long long)t, (long long)j, int(e), (long long)t, int(slot));
      slot = int32_t(j);
    }
  }

  // 2. Per-expert counts.
  pool.parallel_for(E, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      int32_t count = 0;
      for (int64_t t = 0; t < T; ++t) count += dense_map[t * E + e] >= 0 ? 1 : 0;
      counts[e] = count;
    }
  });

  // 3. Exclusive scan.
  expert_offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) expert_offsets[e + 1] = expert_offsets[e] + counts[e];

  // 4. Scatter, ascending token id inside each expert.
  pool.parallel_for(E, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      int32_t row = expert_offsets[e];
      for (int64_t t = 0; t < T; ++t) {
        const int32_t j = dense_map[t * E + e];
        if (j < 0) continue;
        expert_token_indices[row] = int32_t(t);
        token_index_map[t * k + j] = row;
        ++row;
      }
    }
  });
}

}  // namespace cpu
}  // namespace moeblaze
