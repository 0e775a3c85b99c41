#include "cuda/token_reduce.hpp"

#include <algorithm>
#include <type_traits>

#include "cuda/cuda_util.cuh"

namespace moeblaze {
namespace cuda {
namespace {

// A block a token of up to kReduceThreads threads, as many warps as the row has columns (or
// 16-byte chunks) for: narrow rows (d = 512 in bf16: 64 chunks) leave no thread idle, and an SM
// then holds twice the working threads (32 blocks of 64).
constexpr int kReduceThreads = 128;

unsigned reduce_threads(int64_t items) {
  const int64_t warps =
      std::min<int64_t>(std::max<int64_t>((items + 31) / 32, 1), kReduceThreads / 32);
  return unsigned(32 * warps);
}

// A row of the sum: index entry r of token t, or -1 when it adds nothing.
__device__ __forceinline__ int32_t summed_row(const int32_t* index, int64_t index_rows, int64_t t,
                                              int k, int j) {
  const int32_t r = __ldg(index + t * k + j);
  return r >= 0 && r < index_rows ? r : -1;
}

// Any width and alignment, an element a thread. __fadd_rn: the additions are never contracted.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
    token_reduce_kernel(int64_t width, int64_t rows_ld, int64_t out_ld, int k, int64_t index_rows,
                        const int32_t* index, const T* rows, T* out) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    float s = 0.f;
    for (int j = 0; j < k; ++j) {
      const int32_t r = summed_row(index, index_rows, t, k, j);
      if (r < 0) continue;
      s = __fadd_rn(s, to_f32<T>(rows[int64_t(r) * rows_ld + c]));
    }
    out[t * out_ld + c] = from_f32<T>(s);
  }
}

// Rows a thread loads before its first addition (token_reduce16_kernel).
constexpr int kReduceBatch = 8;

// s[i] += element i of a 16-byte chunk, in order. bf16 widens by a shift of its bits (each 32-bit
// word's low element shifted up, the high one masked), two instructions a pair where the generic
// conversion took three.
template <typename T, int kVec>
__device__ __forceinline__ void add_chunk(float (&s)[kVec], const uint4& raw) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      s[2 * q] = __fadd_rn(s[2 * q], __uint_as_float(w[q] << 16));
      s[2 * q + 1] = __fadd_rn(s[2 * q + 1], __uint_as_float(w[q] & 0xffff0000u));
    }
  } else {
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) s[i] = __fadd_rn(s[i], to_f32<T>(v[i]));
  }
}

// The sum of one 16-byte column chunk c over kCount rows: row_at[b] (have[b]) is row b; every load
// issued before the first addition. kEvery: every row adds (no dropped token), no test a row.
template <typename T, int kVec, int kCount, bool kEvery>
__device__ __forceinline__ void add_rows(float (&s)[kVec], const T* const (&row_at)[kCount],
                                         const bool (&have)[kCount], int64_t c) {
  uint4 raw[kCount];
#pragma unroll
  for (int b = 0; b < kCount; ++b)
    raw[b] = kEvery || have[b] ? __ldg(reinterpret_cast<const uint4*>(row_at[b] + c))
                               : make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int b = 0; b < kCount; ++b) {
    if (!kEvery && !have[b]) continue;  // a row that adds nothing (not even +0)
    add_chunk<T, kVec>(s, raw[b]);
  }
}

// Rows j0 .. j0 + kCount - 1 of token t (those below k): their addresses (row 0 where a row adds
// nothing; not read).
template <typename T, int kCount>
__device__ __forceinline__ void locate_rows(const T* (&row_at)[kCount], bool (&have)[kCount],
                                            const T* rows, int64_t rows_ld, const int32_t* index,
                                            int64_t index_rows, int64_t t, int k, int j0) {
#pragma unroll
  for (int b = 0; b < kCount; ++b) {
    const int32_t r = j0 + b < k ? summed_row(index, index_rows, t, k, j0 + b) : -1;
    have[b] = r >= 0;
    row_at[b] = rows + (have[b] ? int64_t(r) * rows_ld : 0);
  }
}

template <typename T>
__device__ __forceinline__ void store_chunk(T* out, const float (&s)[16 / sizeof(T)]) {
  constexpr int kVec = 16 / int(sizeof(T));
  uint4 packed;
  T* o = reinterpret_cast<T*>(&packed);
#pragma unroll
  for (int i = 0; i < kVec; ++i) o[i] = from_f32<T>(s[i]);
  *reinterpret_cast<uint4*>(out) = packed;
}

// token_reduce_kernel 16 bytes at a time (width, rows_ld and out_ld multiples of the elements in 16
// bytes, rows and out 16-byte aligned): the same additions in the same order, so the same bits.
// A thread issues the loads of up to kReduceBatch rows before its first addition: one DRAM round
// trip a batch instead of one a row (with a branch around each row, ptxas waited for every load
// before the next). kRows > 0 compiles k == kRows (every top-k in practice): a thread locates the
// token's rows once for all of its column chunks, and sums rows that all add (no dropped token)
// without a test a row. kRows == 0 takes any k, kReduceBatch rows at a time.
template <typename T, int kRows>
__global__ void __launch_bounds__(kReduceThreads)
    token_reduce16_kernel(int64_t width, int64_t rows_ld, int64_t out_ld, int k, int64_t index_rows,
                          const int32_t* index, const T* rows, T* out) {
  constexpr int kVec = 16 / int(sizeof(T));
  const int64_t t = blockIdx.x;
  const int64_t first = kVec * int64_t(threadIdx.x), step = kVec * int64_t(blockDim.x);
  if constexpr (kRows > 0) {
    const T* row_at[kRows];
    bool have[kRows];
    locate_rows<T, kRows>(row_at, have, rows, rows_ld, index, index_rows, t, kRows, 0);
    bool all_rows = true;
#pragma unroll
    for (int b = 0; b < kRows; ++b) all_rows = all_rows && have[b];
    for (int64_t c = first; c < width; c += step) {
      float s[kVec] = {};
      if (all_rows)
        add_rows<T, kVec, kRows, true>(s, row_at, have, c);
      else
        add_rows<T, kVec, kRows, false>(s, row_at, have, c);
      store_chunk<T>(out + t * out_ld + c, s);
    }
  } else {
    for (int64_t c = first; c < width; c += step) {
      float s[kVec] = {};
      for (int j0 = 0; j0 < k; j0 += kReduceBatch) {
        const T* row_at[kReduceBatch];
        bool have[kReduceBatch];
        locate_rows<T, kReduceBatch>(row_at, have, rows, rows_ld, index, index_rows, t, k, j0);
        add_rows<T, kVec, kReduceBatch, false>(s, row_at, have, c);
      }
      store_chunk<T>(out + t * out_ld + c, s);
    }
  }
}

// token_reduce16_kernel compiled for k == kRows where kRows <= kReduceBatch, else for any k.
template <typename T, int kRows = 1>
void launch_token_reduce16(T* out, int64_t out_ld, const T* rows, int64_t rows_ld,
                           const int32_t* index, int64_t index_rows, int64_t T_, int k,
                           int64_t width, cudaStream_t stream) {
  constexpr int kVec = 16 / int(sizeof(T));
  if constexpr (kRows <= kReduceBatch) {
    if (k != kRows)
      return launch_token_reduce16<T, kRows + 1>(out, out_ld, rows, rows_ld, index, index_rows, T_,
                                                 k, width, stream);
  }
  constexpr int kCompiled = kRows <= kReduceBatch ? kRows : 0;
  token_reduce16_kernel<T, kCompiled><<<unsigned(T_), reduce_threads(width / kVec), 0, stream>>>(
      width, rows_ld, out_ld, k, index_rows, index, rows, out);
  check_launch("token_reduce16_kernel");
}

template <typename T>
void launch_token_reduce(T* out, int64_t out_ld, const T* rows, int64_t rows_ld,
                         const int32_t* index, int64_t index_rows, int64_t T_, int k, int64_t width,
                         cudaStream_t stream) {
  constexpr int kVec = 16 / int(sizeof(T));
  if (width % kVec == 0 && rows_ld % kVec == 0 && out_ld % kVec == 0 && aligned16(rows) &&
      aligned16(out)) {
    launch_token_reduce16<T>(out, out_ld, rows, rows_ld, index, index_rows, T_, k, width, stream);
    return;
  }
  token_reduce_kernel<T><<<unsigned(T_), reduce_threads(width), 0, stream>>>(
      width, rows_ld, out_ld, k, index_rows, index, rows, out);
  check_launch("token_reduce_kernel");
}

}  // namespace

void token_reduce(Dtype dtype, void* out, int64_t out_ld, const void* rows, int64_t rows_ld,
                  const int32_t* index, int64_t index_rows, int64_t T, int64_t k, int64_t width,
                  cudaStream_t stream) {
  if (T == 0 || width == 0) return;
  MB_CUDA_DISPATCH_DTYPE(
      dtype, launch_token_reduce<scalar_t>(static_cast<scalar_t*>(out), out_ld,
                                           static_cast<const scalar_t*>(rows), rows_ld, index,
                                           index_rows, T, int(k), width, stream));
}

}  // namespace cuda
}  // namespace moeblaze
