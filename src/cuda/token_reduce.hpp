// The per-token sums of routed rows: out[t] = round(sum_j rows[index[t k + j]]), j ascending, in
// fp32 with every addition rounded. The one-device layer sums F2's and B4's rows into y and dx
// with it (experts.cu) and the expert-parallel home rank the rows its experts return (ep_ops.cu),
// so the two layers agree bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/layer_desc.hpp"

namespace moeblaze {
namespace cuda {

// `width` columns of T rows of `out` (out_ld elements apart) from the rows `index` names (rows_ld
// elements apart; index entries outside [0, index_rows) add nothing: the expert-parallel indices
// come from a caller's buffer that the host cannot check without a synchronisation).
void token_reduce(Dtype dtype, void* out, int64_t out_ld, const void* rows, int64_t rows_ld,
                  const int32_t* index, int64_t index_rows, int64_t T, int64_t k, int64_t width,
                  cudaStream_t stream);

}  // namespace cuda
}  // namespace moeblaze
