/*
 * moeblaze.h — the C API of libmoeblaze, one Mixture-of-Experts (MoE) layer, forward and backward.
 *
 * Copyright (c) 2026 the moeblaze authors. SPDX-License-Identifier: Apache-2.0
 */
/*! \file moeblaze.h
 *
 * \mainpage moeblaze
 *
 * moeblaze computes the forward and backward pass of one token-choice Mixture-of-Experts layer for
 * training: router top-k, dispatch, the expert MLPs (SwiGLU and six other activations), the
 * weighted combine, and every gradient, with the least activation memory the math allows. Routing
 * is index based (the MoEBlaze method): no permuted copy of the tokens is ever written; the expert
 * GEMMs gather their rows through integer index lists and the combine and the input gradient are
 * per-token reductions in a fixed order, so results are bitwise reproducible.
 *
 * \section layer The layer
 *
 * Shape letters used throughout: `T` tokens, `d` model dim (`d_model`), `h` expert hidden dim
 * (`d_ffn`), `E` experts, `k` experts per token (`top_k`), `N = T*k` routed rows.
 *
 * \code
 *   logits = x . w_router^T                  x [T,d], w_router [E,d]        (routing dtype)
 *   ids, g = route(logits)                   ids [T,k] int32, g [T,k]       (routing dtype)
 *   for each routed pair r = (t, j), e = ids[t,j]:
 *     a_r  = x_t . w_gate[e]^T               w_gate [E,h,d]  (nn.Linear layout: out, in)
 *     b_r  = x_t . w_up[e]^T                 w_up   [E,h,d]  (gated activations only)
 *     u_r  = act(a_r, b_r)                   SwiGLU silu(a)*b, GeGLU gelu(a)*b, ReGLU relu(a)*b,
 *                                            SiLU silu(a), GELU gelu(a), ReLU relu(a), ReLU^2
 *     y2_r = u_r . w_down[e]^T               w_down [E,d,h]
 *   y_t    = sum_j g[t,j] * y2_(t,j)         y [T,d], j = 0..k-1 in that order
 * \endcode
 *
 * All tensors are dense, row-major (C order) and contiguous. GELU is the exact (erf) form.
 *
 * \section numerics Numerical contract
 *
 * - Storage dtype (`x`, weights, `y`, `dx`, `dw_*`): F32, BF16, F16, or F64 (CPU backend only).
 *   BF16/F16 values are produced with round-to-nearest-even.
 * - Accumulation is always at least F32 (F64 for F64 layers).
 * - The *routing dtype* — of `logits`, `g`, `dg`, `d_logits`, the losses and their gradients — is
 *   F64 for F64 layers and F32 for every other dtype. Arguments in the routing dtype are typed
 *   `void*` below.
 * - `a` and `b` are rounded to the storage dtype once; `u = act(a, b)` is computed in F32 from the
 *   rounded `a`, `b` and rounded once. Backward uses exactly these values, so the three checkpoint
 *   policies give identical results.
 * - `y` and `dx` are rounded once, after the F32 reduction over a token's `k` rows. The whole-layer
 *   backward adds the router's share of `dx` to the experts' share after that rounding (one extra
 *   rounding for 16-bit dtypes).
 * - Router top-k ties go to the lower expert id.
 *
 * \section memory Memory model
 *
 * moeblaze never allocates memory on an execute path. Every execute call takes a caller-owned
 * `workspace` (scratch for that call only) and, for training, a caller-owned `saved` buffer that
 * the forward pass fills and the matching backward pass reads (the cuDNN workSpace / reserveSpace
 * model). Both sizes are pure functions of (layer, pass, num_tokens), queried before anything runs
 * with moeblaze_layer_workspace_size() and moeblaze_layer_saved_size(). Buffers must be 16-byte
 * aligned. Tensors live on the layer's device: host memory for the CPU backend, device memory of
 * the context's GPU for the CUDA backend.
 *
 * \section streams Streams and synchronisation
 *
 * A `stream` argument is a `cudaStream_t` passed as `void*` (NULL = the legacy default stream); the
 * CPU backend ignores it and runs synchronously. CUDA execute calls only enqueue work: they never
 * synchronise with the host and never allocate, so a whole forward and backward may be captured in
 * a CUDA graph. Inputs must be ready on `stream`; outputs are valid when `stream` reaches the end
 * of the call. Asynchronous CUDA faults may surface in a later call as ::MOEBLAZE_ERR_CUDA.
 *
 * \section errors Errors
 *
 * Every function returns a ::moeblaze_status_t (`int32_t`). On failure, moeblaze_last_error()
 * returns a message for the calling thread that names the offending argument; outputs are then
 * unspecified. No function aborts, exits, or lets a C++ exception escape.
 *
 * \section threads Threads
 *
 * All functions may be called concurrently from several threads. A layer is immutable after
 * creation and may execute concurrently on different streams with separate workspace and saved
 * buffers. Destroying a context or layer while work that uses it is in flight is undefined.
 *
 * \section determinism Determinism
 *
 * With `deterministic = 1` (the default) the same build on the same device model gives bitwise
 * identical outputs and gradients for the same inputs, whatever the thread count or stream. No
 * atomics are used to combine floating-point values.
 */
#ifndef MOEBLAZE_H_
#define MOEBLAZE_H_

#include <stddef.h>
#include <stdint.h>

/* ---------------------------------------------------------------------------------------------- */
/* Versions and export                                                                            */
/* ---------------------------------------------------------------------------------------------- */

#define MOEBLAZE_VERSION_MAJOR 0 /*!< major version of this header */
#define MOEBLAZE_VERSION_MINOR 1 /*!< minor version of this header */
#define MOEBLAZE_VERSION_PATCH 0 /*!< patch version of this header */
/*! The version as one integer: major * 10000 + minor * 100 + patch. */
#define MOEBLAZE_VERSION \
  (MOEBLAZE_VERSION_MAJOR * 10000 + MOEBLAZE_VERSION_MINOR * 100 + MOEBLAZE_VERSION_PATCH)
/*! The ABI version; equals the shared library's SONAME suffix (`libmoeblaze.so.0`). */
#define MOEBLAZE_ABI_VERSION 0

#if defined(_WIN32)
#if defined(MOEBLAZE_BUILDING_LIBRARY)
#define MOEBLAZE_API __declspec(dllexport)
#else
#define MOEBLAZE_API __declspec(dllimport)
#endif
#elif defined(__GNUC__)
#define MOEBLAZE_API __attribute__((visibility("default")))
#else
#define MOEBLAZE_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/*! \brief The library's version, ::MOEBLAZE_VERSION of the build that is loaded. */
MOEBLAZE_API int32_t moeblaze_get_version(void);

/*! \brief The library's ABI version. A caller compiled against another ::MOEBLAZE_ABI_VERSION
 *  must not use the library. */
MOEBLAZE_API int32_t moeblaze_get_abi_version(void);

/*! \brief A static, human-readable line describing the build: version, git revision, whether the
 *  CUDA backend was compiled in, its CUDA version and GPU architectures. Never NULL. */
MOEBLAZE_API const char* moeblaze_get_build_info(void);

/* ---------------------------------------------------------------------------------------------- */
/* Status codes and errors                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/*! Returned by every function; one of ::moeblaze_status_code. The values are frozen. */
typedef int32_t moeblaze_status_t;

/*! The values a ::moeblaze_status_t takes. */
enum moeblaze_status_code {
  MOEBLAZE_OK = 0,                         /*!< success */
  MOEBLAZE_ERR_INVALID_ARGUMENT = 1,       /*!< an argument is NULL, out of range or inconsistent */
  MOEBLAZE_ERR_INVALID_HANDLE = 2,         /*!< a handle is NULL, destroyed, or of the wrong kind */
  MOEBLAZE_ERR_NOT_SUPPORTED = 3,          /*!< valid, but not supported by this build/backend */
  MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE = 4, /*!< workspace or saved buffer smaller than queried */
  MOEBLAZE_ERR_OUT_OF_MEMORY = 5,          /*!< a host allocation failed (create calls only) */
  MOEBLAZE_ERR_CUDA = 6,                   /*!< the CUDA runtime or cuBLASLt reported an error */
  MOEBLAZE_ERR_VERSION_MISMATCH = 7,       /*!< struct_size or saved buffer from another version */
  MOEBLAZE_ERR_NON_FINITE = 8,             /*!< an input that must be finite holds NaN or Inf */
  MOEBLAZE_ERR_INTERNAL = 99               /*!< a bug in moeblaze; please report it */
};

/*! \brief The enumerator name of a status ("MOEBLAZE_ERR_INVALID_ARGUMENT"); static, never NULL. */
MOEBLAZE_API const char* moeblaze_status_name(moeblaze_status_t status);

/*! \brief A one-line description of a status ("invalid argument"); static, never NULL. */
MOEBLAZE_API const char* moeblaze_status_string(moeblaze_status_t status);

/*! \brief The message of the last failed call on the calling thread; "" after a successful call.
 *
 *  Never NULL. The pointer stays valid until the next moeblaze call on the same thread. */
MOEBLAZE_API const char* moeblaze_last_error(void);

/*! \brief Copies the calling thread's last error message into `buffer` (truncated, always
 *  NUL-terminated when `buffer_size > 0`).
 *  \return the size needed for the whole message including the terminating NUL. */
MOEBLAZE_API size_t moeblaze_copy_last_error(char* buffer, size_t buffer_size);

/* ---------------------------------------------------------------------------------------------- */
/* Enumerations (values are frozen; new values are only appended)                                 */
/* ---------------------------------------------------------------------------------------------- */

/*! Where a context runs. Values follow DLPack's device codes. */
enum moeblaze_backend_code {
  MOEBLAZE_BACKEND_CPU = 1, /*!< the reference backend: host memory, threaded, always available */
  MOEBLAZE_BACKEND_CUDA = 2 /*!< NVIDIA GPUs (sm_80 and newer; tuned for sm_90a) */
};

/*! Storage dtype of `x`, the weights, `y` and their gradients. */
enum moeblaze_dtype_code {
  MOEBLAZE_DTYPE_F32 = 0,  /*!< IEEE binary32 (CUDA: exact FP32 arithmetic, no TF32) */
  MOEBLAZE_DTYPE_BF16 = 1, /*!< bfloat16 */
  MOEBLAZE_DTYPE_F16 = 2,  /*!< IEEE binary16 */
  MOEBLAZE_DTYPE_F64 = 3   /*!< IEEE binary64; CPU backend only (reference and gradient checks) */
};

/*! The expert MLP's activation. Gated activations (`*GLU`) use both `w_gate` and `w_up`. */
enum moeblaze_activation_code {
  MOEBLAZE_ACTIVATION_SWIGLU = 0, /*!< silu(a) * b (default) */
  MOEBLAZE_ACTIVATION_GEGLU = 1,  /*!< gelu(a) * b, exact erf GELU */
  MOEBLAZE_ACTIVATION_REGLU = 2,  /*!< relu(a) * b */
  MOEBLAZE_ACTIVATION_SILU = 3,   /*!< silu(a) = a * sigmoid(a) */
  MOEBLAZE_ACTIVATION_GELU = 4,   /*!< gelu(a), exact erf form */
  MOEBLAZE_ACTIVATION_RELU = 5,   /*!< relu(a); relu'(0) = 0 */
  MOEBLAZE_ACTIVATION_RELU2 = 6   /*!< relu(a)^2 */
};

/*! What the forward pass keeps in the saved buffer for the backward pass. */
enum moeblaze_checkpoint_code {
  MOEBLAZE_CHECKPOINT_SAVE_ALL = 0,    /*!< a, b and u (3*N*h values; non-gated: a and u) */
  MOEBLAZE_CHECKPOINT_SAVE_PREACT = 1, /*!< a and b (2*N*h; non-gated: a); u recomputed (default) */
  MOEBLAZE_CHECKPOINT_RECOMPUTE = 2    /*!< nothing but indices; backward re-runs the first GEMM */
};

/*! How router logits become the experts `ids` and weights `g` of each token. */
enum moeblaze_score_function_code {
  MOEBLAZE_SCORE_SOFTMAX_TOPK = 0, /*!< p = softmax(logits); top-k of p; g = p[ids] (default) */
  MOEBLAZE_SCORE_TOPK_SOFTMAX = 1, /*!< top-k of logits; g = softmax over the k selected logits */
  MOEBLAZE_SCORE_SIGMOID = 2       /*!< s = sigmoid(logits); top-k of s; g = s[ids] */
};

/*! Identifies an execute call, for moeblaze_layer_workspace_size() and
 *  moeblaze_layer_saved_size(). */
enum moeblaze_pass_code {
  MOEBLAZE_PASS_ROUTER_FORWARD = 0,   /*!< moeblaze_router_forward() */
  MOEBLAZE_PASS_ROUTER_BACKWARD = 1,  /*!< moeblaze_router_backward() */
  MOEBLAZE_PASS_ROUTING_BUILD = 2,    /*!< moeblaze_routing_build() */
  MOEBLAZE_PASS_EXPERTS_FORWARD = 3,  /*!< moeblaze_experts_forward() */
  MOEBLAZE_PASS_EXPERTS_BACKWARD = 4, /*!< moeblaze_experts_backward() */
  MOEBLAZE_PASS_LAYER_FORWARD = 5,    /*!< moeblaze_layer_forward() */
  MOEBLAZE_PASS_LAYER_BACKWARD = 6    /*!< moeblaze_layer_backward() */
};

/*! Limits checked by moeblaze_layer_create(). */
#define MOEBLAZE_MAX_EXPERTS 1024 /*!< largest `num_experts` */
#define MOEBLAZE_MAX_TOP_K 32     /*!< largest `top_k` */

/* ---------------------------------------------------------------------------------------------- */
/* Contexts: a backend bound to a device                                                          */
/* ---------------------------------------------------------------------------------------------- */

/*! An execution context: one backend on one device. Opaque; create with
 *  moeblaze_context_create(). */
typedef struct moeblaze_context_s* moeblaze_context_t;

/*! \brief 1 if `backend` (a ::moeblaze_backend_code) is compiled in and usable on this machine
 *  (for CUDA: a GPU of compute capability 8.0 or newer is visible), else 0. Never fails. */
MOEBLAZE_API int32_t moeblaze_backend_available(int32_t backend);

/*! \brief Creates a context for `backend` on `device`.
 *
 *  \param[out] out      receives the new context; set to NULL on failure.
 *  \param[in]  backend  a ::moeblaze_backend_code.
 *  \param[in]  device   CPU: must be 0. CUDA: the CUDA device ordinal.
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT (NULL `out`, unknown backend, bad
 *          device); ::MOEBLAZE_ERR_NOT_SUPPORTED (backend not compiled in or no usable GPU);
 *          ::MOEBLAZE_ERR_CUDA; ::MOEBLAZE_ERR_OUT_OF_MEMORY.
 *
 *  The CPU backend uses `MOEBLAZE_NUM_THREADS` threads if that environment variable is set, else
 *  one per hardware thread; see moeblaze_context_set_num_threads(). */
MOEBLAZE_API moeblaze_status_t moeblaze_context_create(moeblaze_context_t* out, int32_t backend,
                                                       int32_t device);

/*! \brief Destroys a context. NULL is a no-op. Layers created on it keep what they need alive, so
 *  they may be destroyed later; the context handle itself becomes invalid at once. */
MOEBLAZE_API moeblaze_status_t moeblaze_context_destroy(moeblaze_context_t context);

/*! \brief Reports the backend (::moeblaze_backend_code) and device a context was created with.
 *  Either out-pointer may be NULL. */
MOEBLAZE_API moeblaze_status_t moeblaze_context_get_info(moeblaze_context_t context,
                                                         int32_t* backend, int32_t* device);

/*! \brief Sets how many threads the CPU backend uses for calls on this context (0: one per
 *  hardware thread). Results do not depend on the thread count. CUDA contexts accept and ignore
 *  it. */
MOEBLAZE_API moeblaze_status_t moeblaze_context_set_num_threads(moeblaze_context_t context,
                                                                int32_t num_threads);

/* ---------------------------------------------------------------------------------------------- */
/* Layer configuration and plan                                                                   */
/* ---------------------------------------------------------------------------------------------- */

/*! \brief The shape and options of one MoE layer. Versioned: always fill it with
 *  moeblaze_layer_config_init(), then set fields.
 *
 *  Fields are only ever appended. A caller compiled against an older header passes a smaller
 *  `struct_size` and gets defaults for the newer fields; a larger `struct_size` (newer header) is
 *  accepted if every byte this library does not know is zero, else rejected with
 *  ::MOEBLAZE_ERR_NOT_SUPPORTED. */
typedef struct moeblaze_layer_config {
  uint32_t struct_size;   /*!< sizeof the caller's struct; set by moeblaze_layer_config_init() */
  int32_t dtype;          /*!< ::moeblaze_dtype_code; default BF16 */
  int64_t d_model;        /*!< d > 0; no default (0 until set) */
  int64_t d_ffn;          /*!< h > 0, the expert hidden dim; no default */
  int64_t num_experts;    /*!< E, 1..::MOEBLAZE_MAX_EXPERTS; no default */
  int64_t top_k;          /*!< k, 1..min(E, ::MOEBLAZE_MAX_TOP_K); default 1 */
  int32_t activation;     /*!< ::moeblaze_activation_code; default SWIGLU */
  int32_t checkpoint;     /*!< ::moeblaze_checkpoint_code; default SAVE_PREACT */
  int32_t score_function; /*!< ::moeblaze_score_function_code; default SOFTMAX_TOPK */
  int32_t renormalize;    /*!< 1: g /= sum_j g over a token's k picks (SOFTMAX_TOPK, SIGMOID);
                               TOPK_SOFTMAX is normalised by construction. Default 0 */
  float aux_loss_coeff;   /*!< >= 0; weight of the load-balancing loss (0: not computed) */
  float z_loss_coeff;     /*!< >= 0; weight of the router z-loss (0: not computed) */
  int32_t deterministic;  /*!< 1: bitwise reproducible (default); 0: allow faster atomics
                               (no kernel uses them yet: results are reproducible either way) */
  int32_t reserved0;      /*!< must be 0 (explicit padding) */
} moeblaze_layer_config_t;

/*! \brief Fills `*config` with defaults and sets `struct_size`.
 *  \param[out] config       the struct to fill.
 *  \param[in]  struct_size  `sizeof *config` as the caller sees it.
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT (NULL); ::MOEBLAZE_ERR_VERSION_MISMATCH
 *          (`struct_size` smaller than any published version). */
MOEBLAZE_API moeblaze_status_t moeblaze_layer_config_init(moeblaze_layer_config_t* config,
                                                          size_t struct_size);

/*! An immutable, validated layer plan bound to a context. Opaque. */
typedef struct moeblaze_layer_s* moeblaze_layer_t;

/*! \brief Validates `config` and creates a layer plan on `context`.
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT (a field out of range: the message names
 *          it); ::MOEBLAZE_ERR_INVALID_HANDLE; ::MOEBLAZE_ERR_VERSION_MISMATCH /
 *          ::MOEBLAZE_ERR_NOT_SUPPORTED (see ::moeblaze_layer_config_t);
 * ::MOEBLAZE_ERR_NOT_SUPPORTED (e.g. F64 on CUDA); ::MOEBLAZE_ERR_OUT_OF_MEMORY. */
MOEBLAZE_API moeblaze_status_t moeblaze_layer_create(moeblaze_layer_t* out,
                                                     moeblaze_context_t context,
                                                     const moeblaze_layer_config_t* config);

/*! \brief Destroys a layer plan. NULL is a no-op. */
MOEBLAZE_API moeblaze_status_t moeblaze_layer_destroy(moeblaze_layer_t layer);

/*! \brief Copies the layer's validated configuration into `*config`, whose `struct_size` the
 *  caller must have set (moeblaze_layer_config_init() does). */
MOEBLAZE_API moeblaze_status_t moeblaze_layer_get_config(moeblaze_layer_t layer,
                                                         moeblaze_layer_config_t* config);

/*! \brief Bytes of the workspace that the execute call identified by `pass` needs for
 *  `num_tokens` tokens. A pure function of (layer, pass, num_tokens); may be 0, in which case the
 *  workspace pointer may be NULL.
 *  \param[in] pass  a ::moeblaze_pass_code. */
MOEBLAZE_API moeblaze_status_t moeblaze_layer_workspace_size(moeblaze_layer_t layer, int32_t pass,
                                                             int64_t num_tokens, size_t* bytes);

/*! \brief Bytes of the saved buffer that the forward pass `pass` (::MOEBLAZE_PASS_EXPERTS_FORWARD
 * or
 *  ::MOEBLAZE_PASS_LAYER_FORWARD) writes for its backward pass, for `num_tokens` tokens.
 *
 *  The buffer holds a small header, the routing indices (2*N + E + 1 int32) and, by checkpoint
 *  policy, the activations; the layer forward also keeps logits, ids and g. Inputs (x, weights)
 *  are never copied into it. */
MOEBLAZE_API moeblaze_status_t moeblaze_layer_saved_size(moeblaze_layer_t layer, int32_t pass,
                                                         int64_t num_tokens, size_t* bytes);

/* ---------------------------------------------------------------------------------------------- */
/* Router: logits -> top-k ids and weights, load-balancing and z losses, and their gradients      */
/* ---------------------------------------------------------------------------------------------- */

/*! \brief Routes every token: score function, top-k (ties to the lower expert id), optional
 *  renormalisation, per-expert counts and the router losses.
 *
 *  Losses (each already multiplied by its coefficient; 0 when the coefficient is 0):
 *  - `losses[0]` = aux_loss_coeff * E * sum_e f_e * P_e, with f_e = count_e / (T*k) and P_e the
 *    mean over tokens of the token's normalised scores (softmax of the logits for the softmax score
 *    functions; sigmoid scores divided by their sum over experts for SIGMOID). 1 * coeff when
 *    perfectly balanced.
 *  - `losses[1]` = z_loss_coeff * mean_t logsumexp(logits_t)^2.
 *
 *  \param layer             the plan.
 *  \param num_tokens        T >= 0 (T*k < 2^31).
 *  \param logits            [T,E] routing dtype, in.
 *  \param ids               [T,k] int32, out: the experts of each token in descending score order.
 *  \param g                 [T,k] routing dtype, out: the routing weights, aligned with `ids`.
 *  \param expert_counts     [E] int32, out, optional (NULL): tokens routed to each expert.
 *  \param losses            [2] routing dtype, out, optional (NULL): see above.
 *  \param workspace         moeblaze_layer_workspace_size(::MOEBLAZE_PASS_ROUTER_FORWARD) bytes.
 *  \param stream            cudaStream_t or NULL; ignored on CPU.
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT; ::MOEBLAZE_ERR_INVALID_HANDLE;
 *          ::MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE; ::MOEBLAZE_ERR_NON_FINITE (CPU: a logit is NaN or
 *          Inf; the CUDA backend cannot report this without a host sync and orders NaN below every
 *          number); ::MOEBLAZE_ERR_CUDA. */
MOEBLAZE_API moeblaze_status_t moeblaze_router_forward(moeblaze_layer_t layer, int64_t num_tokens,
                                                       const void* logits, int32_t* ids, void* g,
                                                       int32_t* expert_counts, void* losses,
                                                       void* workspace, size_t workspace_bytes,
                                                       void* stream);

/*! \brief Gradient of the routing weights and router losses with respect to the logits.
 *
 *  d_logits = J^T dg + d_losses[0] * d(losses[0])/d(logits) + d_losses[1] * d(losses[1])/d(logits),
 *  where J is the Jacobian of `g` with respect to `logits` for the selected experts (top-k
 *  selection itself is piecewise constant and has no gradient).
 *
 *  \param logits      [T,E] routing dtype, in: the logits given to moeblaze_router_forward().
 *  \param ids         [T,k] int32, in: the ids it produced.
 *  \param dg          [T,k] routing dtype, in: dLoss/dg.
 *  \param d_losses    [2] routing dtype, in, optional: dLoss/dlosses[i]. NULL means {1, 1}: the
 *                     losses were added to the training objective as returned.
 *  \param d_logits    [T,E] routing dtype, out (overwritten).
 *  \return as moeblaze_router_forward(). */
MOEBLAZE_API moeblaze_status_t moeblaze_router_backward(moeblaze_layer_t layer, int64_t num_tokens,
                                                        const void* logits, const int32_t* ids,
                                                        const void* dg, const void* d_losses,
                                                        void* d_logits, void* workspace,
                                                        size_t workspace_bytes, void* stream);

/* ---------------------------------------------------------------------------------------------- */
/* Token routing index structures                                                                 */
/* ---------------------------------------------------------------------------------------------- */

/*! \brief Builds the index structures the expert kernels use instead of a permuted token copy.
 *  The experts calls build these themselves; this call exposes them for inspection and tests.
 *
 *  Built atomic-free and deterministically (dense token-expert map, per-expert counts, scan,
 *  scatter), with no host synchronisation:
 *  - `expert_offsets` [E+1]: exclusive prefix sum of per-expert counts; expert e owns routed rows
 *    `expert_offsets[e] .. expert_offsets[e+1]-1`, and `expert_offsets[E] = N`.
 *  - `expert_token_indices` [N]: the token id of each routed row, grouped by expert, ascending
 *    token id inside each expert.
 *  - `token_index_map` [N]: for pair (t, j), at `t*k + j`, the routed row holding token t's
 *    j-th expert: `expert_token_indices[token_index_map[t*k+j]] == t`.
 *
 *  \param ids  [T,k] int32, in: expert ids; each in [0,E), distinct within a token.
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT (CPU: an id out of range or repeated
 *          within a token; CUDA cannot check this without a host sync: such pairs are dropped
 *          from the structures); ::MOEBLAZE_ERR_INVALID_HANDLE;
 *          ::MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE; ::MOEBLAZE_ERR_CUDA. */
MOEBLAZE_API moeblaze_status_t moeblaze_routing_build(moeblaze_layer_t layer, int64_t num_tokens,
                                                      const int32_t* ids, int32_t* expert_offsets,
                                                      int32_t* expert_token_indices,
                                                      int32_t* token_index_map, void* workspace,
                                                      size_t workspace_bytes, void* stream);

/* ---------------------------------------------------------------------------------------------- */
/* Experts and whole layer: arguments                                                             */
/* ---------------------------------------------------------------------------------------------- */

/*! \brief Arguments of moeblaze_experts_forward() and moeblaze_layer_forward(). Versioned: fill
 *  with moeblaze_forward_args_init(), then set the pointers the call uses. Unused fields are
 *  ignored. Shapes use the layer's d, h, E, k and this struct's `num_tokens`. */
typedef struct moeblaze_forward_args {
  uint32_t struct_size; /*!< set by moeblaze_forward_args_init() */
  uint32_t flags;       /*!< reserved, must be 0 */
  int64_t num_tokens;   /*!< T >= 0 (T*k < 2^31) */
  /* inputs */
  const void* x;        /*!< [T,d] dtype */
  const void* w_router; /*!< [E,d] dtype; layer forward only */
  const void* w_gate;   /*!< [E,h,d] dtype */
  const void* w_up;     /*!< [E,h,d] dtype; gated activations only (ignored otherwise) */
  const void* w_down;   /*!< [E,d,h] dtype */
  const int32_t* ids;   /*!< [T,k] int32; experts forward only: each token's experts */
  const void* g;        /*!< [T,k] routing dtype; experts forward only: routing weights */
  /* outputs */
  void* y;                /*!< [T,d] dtype, required */
  void* logits_out;       /*!< [T,E] routing dtype; layer forward, optional */
  int32_t* ids_out;       /*!< [T,k] int32; layer forward, optional */
  void* g_out;            /*!< [T,k] routing dtype; layer forward, optional */
  int32_t* expert_counts; /*!< [E] int32; optional: tokens routed to each expert */
  void* losses;           /*!< [2] routing dtype; layer forward, optional: {aux, z} as in
                               moeblaze_router_forward() */
  /* buffers */
  void* saved;            /*!< moeblaze_layer_saved_size() bytes, out; NULL for inference (then no
                               backward is possible) */
  size_t saved_bytes;     /*!< size of `saved` */
  void* workspace;        /*!< moeblaze_layer_workspace_size() bytes of scratch */
  size_t workspace_bytes; /*!< size of `workspace` */
} moeblaze_forward_args_t;

/*! Flag for ::moeblaze_backward_args_t: add weight gradients to `dw_*` instead of overwriting. */
#define MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD 1u

/*! \brief Arguments of moeblaze_experts_backward() and moeblaze_layer_backward(). Versioned: fill
 *  with moeblaze_backward_args_init(). The inputs must be those of the forward pass that filled
 *  `saved`. Every gradient output is optional: NULL skips it (e.g. frozen weights). */
typedef struct moeblaze_backward_args {
  uint32_t struct_size; /*!< set by moeblaze_backward_args_init() */
  uint32_t flags;       /*!< 0 or ::MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD */
  int64_t num_tokens;   /*!< T, as in the forward pass */
  /* inputs */
  const void* dy;       /*!< [T,d] dtype: dLoss/dy */
  const void* d_losses; /*!< [2] routing dtype; layer backward, optional; NULL means {1, 1} */
  const void* x;        /*!< [T,d] dtype, as in forward */
  const void* w_router; /*!< [E,d] dtype; layer backward only */
  const void* w_gate;   /*!< [E,h,d] dtype */
  const void* w_up;     /*!< [E,h,d] dtype; gated activations only */
  const void* w_down;   /*!< [E,d,h] dtype */
  const int32_t* ids;   /*!< [T,k] int32; experts backward only */
  const void* g;        /*!< [T,k] routing dtype; experts backward only */
  const void* saved;    /*!< the saved buffer the forward pass filled */
  size_t saved_bytes;   /*!< size of `saved` */
  /* outputs (each optional) */
  void* dx;        /*!< [T,d] dtype, overwritten (the layer backward includes the router's path) */
  void* dw_router; /*!< [E,d] dtype; layer backward only */
  void* dw_gate;   /*!< [E,h,d] dtype */
  void* dw_up;     /*!< [E,h,d] dtype; gated activations only */
  void* dw_down;   /*!< [E,d,h] dtype */
  void* dg;        /*!< [T,k] routing dtype; experts backward: dLoss/dg */
  void* d_logits;  /*!< [T,E] routing dtype; layer backward, optional */
  void* workspace; /*!< moeblaze_layer_workspace_size() bytes of scratch */
  size_t workspace_bytes; /*!< size of `workspace` */
} moeblaze_backward_args_t;

/*! \brief Fills `*args` with zeros/NULLs and sets `struct_size`. Same rules as
 *  moeblaze_layer_config_init(). */
MOEBLAZE_API moeblaze_status_t moeblaze_forward_args_init(moeblaze_forward_args_t* args,
                                                          size_t struct_size);

/*! \brief Fills `*args` with zeros/NULLs and sets `struct_size`. */
MOEBLAZE_API moeblaze_status_t moeblaze_backward_args_init(moeblaze_backward_args_t* args,
                                                           size_t struct_size);

/* ---------------------------------------------------------------------------------------------- */
/* Experts: given ids and g                                                                       */
/* ---------------------------------------------------------------------------------------------- */

/*! \brief Expert MLPs and weighted combine for tokens already routed (`ids`, `g`).
 *
 *  Reads `x`, `ids`, `g`, `w_gate`, `w_up`, `w_down`; writes `y`, optionally `expert_counts`, and
 *  `saved` (for moeblaze_experts_backward()). Gathers token rows through the routing indices; no
 *  permuted copy of `x` is written.
 *
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT (a required pointer NULL, T < 0, flags,
 *          misaligned buffer; CPU: an id out of range or repeated within a token);
 *          ::MOEBLAZE_ERR_INVALID_HANDLE; ::MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE (workspace or saved
 *          buffer smaller than queried); ::MOEBLAZE_ERR_VERSION_MISMATCH (args struct_size);
 *          ::MOEBLAZE_ERR_CUDA. */
MOEBLAZE_API moeblaze_status_t moeblaze_experts_forward(moeblaze_layer_t layer,
                                                        const moeblaze_forward_args_t* args,
                                                        void* stream);

/*! \brief Backward of moeblaze_experts_forward(): `dx`, `dw_gate`, `dw_up`, `dw_down` and `dg` from
 *  `dy` and the saved buffer.
 *
 *  \return as moeblaze_experts_forward(), and ::MOEBLAZE_ERR_VERSION_MISMATCH when the CPU backend
 *          finds that `saved` was written by another layer configuration, token count or library
 *          version (the CUDA backend cannot read the buffer's header without a host sync). */
MOEBLAZE_API moeblaze_status_t moeblaze_experts_backward(moeblaze_layer_t layer,
                                                         const moeblaze_backward_args_t* args,
                                                         void* stream);

/* ---------------------------------------------------------------------------------------------- */
/* Whole layer: router projection + router + experts                                              */
/* ---------------------------------------------------------------------------------------------- */

/*! \brief The whole layer: logits = x . w_router^T (in the routing dtype), routing as
 *  moeblaze_router_forward(), then moeblaze_experts_forward().
 *
 *  Reads `x`, `w_router`, `w_gate`, `w_up`, `w_down`; writes `y` and the optional `logits_out`,
 *  `ids_out`, `g_out`, `expert_counts`, `losses`; fills `saved` (which keeps logits, ids and g for
 *  backward). \return as moeblaze_experts_forward() and moeblaze_router_forward(). */
MOEBLAZE_API moeblaze_status_t moeblaze_layer_forward(moeblaze_layer_t layer,
                                                      const moeblaze_forward_args_t* args,
                                                      void* stream);

/*! \brief Backward of moeblaze_layer_forward(): every gradient, the router's included.
 *
 *  dx = (experts' dx) + d_logits . w_router, dw_router = d_logits^T . x, where d_logits comes from
 *  moeblaze_router_backward() applied to the experts' dg and `d_losses`. */
MOEBLAZE_API moeblaze_status_t moeblaze_layer_backward(moeblaze_layer_t layer,
                                                       const moeblaze_backward_args_t* args,
                                                       void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOEBLAZE_H_ */
