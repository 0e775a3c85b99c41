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
 * No memory a call writes (its outputs, its `workspace`, the `saved` buffer a forward fills or a
 * backward with ::MOEBLAZE_BACKWARD_CONSUME_SAVED consumes, the expert-parallel buffers) may share
 * a byte with another of its arguments, over the declared size of each buffer and the shape of each
 * tensor: no in-place `dx` over `x`, no `workspace` inside `saved`. Such a call fails with
 * ::MOEBLAZE_ERR_INVALID_ARGUMENT naming both arguments, before anything is written. Arguments that
 * are only read may share memory.
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
 * Handles are opaque values, never addresses, and no value is issued twice: a destroyed handle
 * gives ::MOEBLAZE_ERR_INVALID_HANDLE forever. A `struct_size` above 1 MiB is
 * ::MOEBLAZE_ERR_INVALID_ARGUMENT wherever a versioned struct is read or written. Buffers the
 * library reads indices from (the saved buffers, the expert-parallel `exchange`) carry a header
 * and, on the CPU backend, every index in them is checked before it is used.
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
 *          device); ::MOEBLAZE_ERR_NOT_SUPPORTED (backend not compiled in, no usable GPU, or
 *          cuBLASLt cannot be loaded: the CUDA backend loads `libcublasLt.so.<major>` when its
 *          first context is created, from `MOEBLAZE_CUBLASLT_LIBRARY` if set, else the process's
 *          copy, the system's search path or the CUDA toolkit it was built with);
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
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT (NULL, or `struct_size` above 1 MiB);
 *          ::MOEBLAZE_ERR_VERSION_MISMATCH (`struct_size` smaller than any published version). */
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
 *  caller must have set (moeblaze_layer_config_init() does). Bytes past the fields this library
 *  knows are zeroed. \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_HANDLE;
 *  ::MOEBLAZE_ERR_INVALID_ARGUMENT (NULL `config`, `struct_size` above 1 MiB: nothing is
 *  written); ::MOEBLAZE_ERR_VERSION_MISMATCH (`struct_size` below the first published size). */
MOEBLAZE_API moeblaze_status_t moeblaze_layer_get_config(moeblaze_layer_t layer,
                                                         moeblaze_layer_config_t* config);

/*! \brief Bytes of the workspace that the execute call identified by `pass` needs for
 *  `num_tokens` tokens. A pure function of (layer, pass, num_tokens); may be 0, in which case the
 *  workspace pointer may be NULL.
 *  \param[in] pass  a ::moeblaze_pass_code. */
MOEBLAZE_API moeblaze_status_t moeblaze_layer_workspace_size(moeblaze_layer_t layer, int32_t pass,
                                                             int64_t num_tokens, size_t* bytes);

/*! \brief As moeblaze_layer_workspace_size(), for a call made with `flags`: for a backward pass
 *  the `MOEBLAZE_BACKWARD_*` bits of ::moeblaze_backward_args_t::flags, for a forward pass
 *  ::MOEBLAZE_FORWARD_WITH_SAVED. With ::MOEBLAZE_BACKWARD_CONSUME_SAVED the experts and layer
 *  backward need less; with ::MOEBLAZE_FORWARD_WITH_SAVED the experts and layer forward do. A flag
 *  that does not apply to `pass` is ignored, so every other pass and flag gives the same size as
 *  moeblaze_layer_workspace_size(). A pure function of (layer, pass, num_tokens, flags).
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT (unknown pass or flag bits, num_tokens
 *          out of range, `bytes` NULL); ::MOEBLAZE_ERR_INVALID_HANDLE. */
MOEBLAZE_API moeblaze_status_t moeblaze_layer_workspace_size_with_flags(
    moeblaze_layer_t layer, int32_t pass, int64_t num_tokens, uint32_t flags, size_t* bytes);

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
 *  SIGMOID scores are exact for any finite logits: where every sigmoid of a token underflows
 *  (its logits all below about -88 in F32), the top-k, the renormalised weights and the aux
 *  loss's normalised scores are computed from the scores up to a common factor, never 0/0.
 *
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT; ::MOEBLAZE_ERR_INVALID_HANDLE;
 *          ::MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE; ::MOEBLAZE_ERR_NON_FINITE (CPU: a logit is NaN or
 *          Inf, or, with `losses`, the z-loss of a token does not fit the routing dtype (logits
 *          near its largest value); the CUDA backend cannot report either without a host sync:
 *          it orders NaN below every number and returns an Inf z-loss); ::MOEBLAZE_ERR_CUDA. */
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
 *  \return as moeblaze_router_forward() (the z-loss check applies whenever `z_loss_coeff` is not
 *          0). */
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
  void* workspace;        /*!< moeblaze_layer_workspace_size() bytes of scratch; with `saved`,
                               moeblaze_layer_workspace_size_with_flags(::MOEBLAZE_FORWARD_WITH_SAVED)
                               bytes suffice */
  size_t workspace_bytes; /*!< size of `workspace` */
} moeblaze_forward_args_t;

/*! Flag for moeblaze_layer_workspace_size_with_flags() with ::MOEBLAZE_PASS_EXPERTS_FORWARD or
 *  ::MOEBLAZE_PASS_LAYER_FORWARD: the size for a forward call that is given a `saved` buffer
 *  (training). Such a call writes the routing indices, the router outputs (layer forward) and,
 *  under ::MOEBLAZE_CHECKPOINT_SAVE_ALL, the activation `u` straight into `saved`, so its workspace
 *  holds none of them: it is smaller by `2*N + E + 1` int32 (N = T*k), by `T*E + 2*T*k` routing
 *  elements for the layer forward, and by `N*h` elements under SAVE_ALL (the layer forward's by
 *  less where its router sub-calls' own workspace is the larger part). A forward with `saved`
 *  accepts this size or the larger one of moeblaze_layer_workspace_size(); a forward without
 *  `saved` (inference) needs the larger one. Only a size-query flag: ::moeblaze_forward_args_t's
 *  `flags` stay 0, since the call itself knows whether it has `saved`. */
#define MOEBLAZE_FORWARD_WITH_SAVED 4u

/*! Flag for ::moeblaze_backward_args_t: add weight gradients to `dw_*` instead of overwriting. */
#define MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD 1u

/*! Flag for ::moeblaze_backward_args_t: the backward may overwrite the activations in `saved`,
 *  which is then invalid for any later backward (the header and routing indices stay intact, the
 *  activations do not). It lowers the backward's peak memory by the size of the saved activations:
 *  the CUDA backend writes the activation gradients over the saved pre-activations instead of into
 *  the workspace, which shrinks by `2*N*h` elements (gated; `N*h` otherwise), N = T*k. The results
 *  are bitwise those of a backward without the flag. Query the workspace with
 *  moeblaze_layer_workspace_size_with_flags() and the same flags to get the smaller size (the
 *  larger one of moeblaze_layer_workspace_size() is also accepted). Do not set it when the same
 *  saved buffer must serve another backward (PyTorch's `retain_graph=True`, double backward). A
 *  backend may ignore it: the CPU backend does, and so does a layer whose checkpoint policy is
 *  ::MOEBLAZE_CHECKPOINT_RECOMPUTE (it saves no activations). Also a flag of
 *  ::moeblaze_ep_backward_args_t, where it applies to the EXPERT saved buffer (query with
 *  moeblaze_ep_layer_workspace_size_with_flags()). */
#define MOEBLAZE_BACKWARD_CONSUME_SAVED 2u

/*! \brief Arguments of moeblaze_experts_backward() and moeblaze_layer_backward(). Versioned: fill
 *  with moeblaze_backward_args_init(). The inputs must be those of the forward pass that filled
 *  `saved`. Every gradient output is optional: NULL skips it (e.g. frozen weights). */
typedef struct moeblaze_backward_args {
  uint32_t struct_size; /*!< set by moeblaze_backward_args_init() */
  uint32_t flags;       /*!< ::MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD and/or
                             ::MOEBLAZE_BACKWARD_CONSUME_SAVED, or 0 */
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
 *          version, ::MOEBLAZE_ERR_INVALID_ARGUMENT when its routing index was modified after the
 *          forward pass (every index is checked before use; the CUDA backend cannot read the
 *          buffer without a host sync). */
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

/* ---------------------------------------------------------------------------------------------- */
/* Expert parallelism                                                                             */
/* ---------------------------------------------------------------------------------------------- */

/*! \page ep Expert parallelism
 *
 * An expert-parallel (EP) layer spreads the `E` experts of one layer over `world_size` ranks
 * (one GPU, or one thread of the CPU backend, each) and moves the tokens to them. Rank `r` owns the
 * contiguous experts `[begin_r, end_r)` (moeblaze_ep_layer_get_experts(): `E / world_size`
 * experts, one more on the first `E % world_size` ranks) and feeds its own `T_r` tokens. The
 * router weight is replicated. Results equal the one-device layer on the *global batch* (the
 * concatenation of the ranks' tokens in rank order): `y`, `dg` and the expert weight gradients
 * bitwise for F32 and F64 (docs/design/expert-parallel.md, section 5).
 *
 * Data flow of one training step on every rank (all calls on `stream`):
 * - moeblaze_ep_forward_begin(): router projection, router and routing build of this rank's
 *   tokens, the exchange of the per-expert counts, and a copy of the count table to the caller's
 *   host `exchange` buffer. This copy is **the one host synchronisation** of EP: the send and
 *   receive sizes must be known on the host to post the exchange. It returns `recv_rows`, the rows
 *   this rank's experts receive, so the caller can allocate the exact buffers of the next phase.
 * - moeblaze_ep_forward_finish(): the routed rows (and their routing weights `g`) travel to the
 *   experts' ranks, the local experts run on them, the results travel back and are combined per
 *   token in slot order. No host synchronisation.
 * - moeblaze_ep_backward(): the transposed exchanges with the forward's sizes (read from
 *   `exchange`: no count exchange, no host synchronisation), the experts' backward on the
 *   received rows, the router's backward on this rank's tokens.
 *
 * These three calls are **collective**: every rank of the group must make them, in the same order,
 * for the same layer (as with any NCCL collective); a rank with no tokens passes `num_tokens = 0`.
 * Which optional outputs each rank requests may differ. Unlike a ::moeblaze_layer_t, an EP layer is
 * not immutable: its execute calls reuse host scratch that the layer holds (sized at creation, so
 * that they make no heap allocation), hence two execute calls of one EP layer must never overlap
 * (being collectives, they cannot anyway: each rank makes them one after another).
 *
 * Gradient convention: the gradients are those of the sum of the ranks' objectives. `dw_gate`,
 * `dw_up`, `dw_down` of a rank's experts are complete (every rank's rows reach their owner);
 * `dw_router` is this rank's share (sum the shares over ranks, e.g. in rank order, as for any
 * replicated parameter), and so are the losses: `losses` returns this rank's shares of the
 * global-batch aux and z losses, whose sum over ranks is the one-device value.
 *
 * Transports (::moeblaze_ep_transport_code): NCCL point-to-point sends and receives on the
 * caller's stream (never NVLink multicast), for production; and LOCAL, an in-process group whose
 * ranks are threads of one process, for tests and for the CPU backend.
 *
 * Memory: every rank owns, per training step, two saved buffers (sizes from
 * moeblaze_ep_layer_saved_size()) and a small host `exchange` buffer:
 * - the *home* saved buffer (function of `T_r`): the count table, logits, ids, g and routing
 *   indices of this rank's tokens; written by forward_begin, read by forward_finish and backward;
 * - the *expert* saved buffer (function of `recv_rows`): the received rows, their routing weights
 *   and local expert ids, and the local experts' saved activations; written by forward_finish,
 *   read by backward. For inference both may be freed after forward_finish.
 */

/*! How the ranks of an expert-parallel group exchange rows. Values are frozen. */
enum moeblaze_ep_transport_code {
  /*! `communicator` is an `ncclComm_t`; CUDA backend; needs a build with MOEBLAZE_NCCL (else
   *  ::MOEBLAZE_ERR_NOT_SUPPORTED) */
  MOEBLAZE_EP_TRANSPORT_NCCL = 1,
  /*! `communicator` is a ::moeblaze_ep_group_t: ranks are threads of this process (tests, CPU) */
  MOEBLAZE_EP_TRANSPORT_LOCAL = 2
};

/*! Identifies an expert-parallel execute call, for moeblaze_ep_layer_workspace_size(). */
enum moeblaze_ep_pass_code {
  MOEBLAZE_EP_PASS_FORWARD_BEGIN = 0,  /*!< moeblaze_ep_forward_begin() */
  MOEBLAZE_EP_PASS_FORWARD_FINISH = 1, /*!< moeblaze_ep_forward_finish() */
  MOEBLAZE_EP_PASS_BACKWARD = 2        /*!< moeblaze_ep_backward() */
};

/*! The two saved buffers of an expert-parallel training step, for
 *  moeblaze_ep_layer_saved_size(). */
enum moeblaze_ep_saved_code {
  MOEBLAZE_EP_SAVED_HOME = 0,  /*!< this rank's tokens: a function of `num_tokens` */
  MOEBLAZE_EP_SAVED_EXPERT = 1 /*!< the rows this rank's experts received: of `recv_rows` */
};

/*! An in-process group of ranks for ::MOEBLAZE_EP_TRANSPORT_LOCAL. Opaque. */
typedef struct moeblaze_ep_group_s* moeblaze_ep_group_t;

/*! \brief Creates an in-process group of `world_size` ranks (1..::MOEBLAZE_MAX_EXPERTS).
 *
 *  Each rank is one thread of this process that creates its own EP layer with
 *  ::MOEBLAZE_EP_TRANSPORT_LOCAL, this group as `communicator` and its rank, and then makes the
 *  collective calls on its own thread. The ranks rendezvous inside every exchange (a barrier, then
 *  each rank copies what it receives, then a second barrier). With the CUDA backend a rank first
 *  synchronises its stream and the copies are synchronous `cudaMemcpy` calls: this transport is
 *  for testing, not for speed. A rank that waits longer than 120 s for the others fails with
 *  ::MOEBLAZE_ERR_INTERNAL (a missing collective call) and the group is unusable from then on. A
 *  call that fails on one rank outside an exchange (a bad argument), or two calls on one rank at
 *  once, make the group unusable at once: the other ranks' calls then fail with that status and
 *  reason instead of waiting (a group of one rank never becomes unusable this way).
 *
 *  \param[out] out         receives the group; NULL on failure.
 *  \param[in]  world_size  ranks in the group.
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT; ::MOEBLAZE_ERR_OUT_OF_MEMORY. */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_local_group_create(moeblaze_ep_group_t* out,
                                                              int32_t world_size);

/*! \brief Destroys a group handle. NULL is a no-op. Layers created on the group keep it alive. */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_local_group_destroy(moeblaze_ep_group_t group);

/*! \brief The placement of one rank of an expert-parallel layer. Versioned: fill it with
 *  moeblaze_ep_config_init(), then set fields. */
typedef struct moeblaze_ep_config {
  uint32_t struct_size; /*!< set by moeblaze_ep_config_init() */
  int32_t transport;    /*!< ::moeblaze_ep_transport_code; default NCCL */
  int32_t rank;         /*!< this rank, 0..world_size-1; default 0 */
  int32_t world_size;   /*!< ranks, 1..num_experts; default 1. NCCL: must equal the
                             communicator's size (and `rank` its rank) */
  void* communicator;   /*!< NCCL: an `ncclComm_t`, borrowed (must outlive the layer; the layer
                             uses the NCCL library the process already loaded). LOCAL: a
                             ::moeblaze_ep_group_t of `world_size` ranks */
} moeblaze_ep_config_t;

/*! \brief Fills `*config` with defaults and sets `struct_size` (same rules as
 *  moeblaze_layer_config_init()). */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_config_init(moeblaze_ep_config_t* config,
                                                       size_t struct_size);

/*! An expert-parallel layer plan: this rank's view of one layer. Opaque; its execute calls must
 *  not overlap (\ref ep). */
typedef struct moeblaze_ep_layer_s* moeblaze_ep_layer_t;

/*! \brief Creates this rank's expert-parallel plan of the layer `config` on `context`.
 *
 *  `config` describes the GLOBAL layer (`num_experts` = E of all ranks); the plan derives this
 *  rank's local experts (`E_r` of them, run as a layer with `top_k = 1` on the received rows). Not
 *  collective: no communication happens here.
 *
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT (a config field; `world_size` outside
 *          1..num_experts; `rank` outside 0..world_size-1; a NULL `communicator`; a LOCAL group
 *          whose size is not `world_size`, or whose ranks use different backends; an NCCL
 *          communicator whose rank or size differ); ::MOEBLAZE_ERR_INVALID_HANDLE (`context`, or
 *          a LOCAL `communicator` that is not a live group); ::MOEBLAZE_ERR_NOT_SUPPORTED (an
 *          unknown transport; NCCL on a CPU context or in a build without MOEBLAZE_NCCL; as
 *          moeblaze_layer_create()); ::MOEBLAZE_ERR_VERSION_MISMATCH; ::MOEBLAZE_ERR_CUDA;
 *          ::MOEBLAZE_ERR_OUT_OF_MEMORY. */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_layer_create(moeblaze_ep_layer_t* out,
                                                        moeblaze_context_t context,
                                                        const moeblaze_layer_config_t* config,
                                                        const moeblaze_ep_config_t* ep_config);

/*! \brief Destroys an expert-parallel plan. NULL is a no-op. */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_layer_destroy(moeblaze_ep_layer_t layer);

/*! \brief The global ids `[*begin, *end)` of the experts this rank owns: the first dimension of the
 *  `w_gate`, `w_up`, `w_down` it passes is `end - begin`. Either out-pointer may be NULL. */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_layer_get_experts(moeblaze_ep_layer_t layer,
                                                             int64_t* begin, int64_t* end);

/*! \brief Bytes of the host `exchange` buffer of one training step: a header and the count table
 *  `[world_size, E]` int32. Plain host memory (pageable is fine), any alignment of 8 or more. */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_layer_exchange_size(moeblaze_ep_layer_t layer,
                                                               size_t* bytes);

/*! \brief Bytes of the workspace of the call `pass` (::moeblaze_ep_pass_code) for `num_tokens`
 *  tokens on this rank and `recv_rows` rows received by its experts (the value
 *  moeblaze_ep_forward_begin() returned; ignored for ::MOEBLAZE_EP_PASS_FORWARD_BEGIN). A pure
 *  function of its arguments. An upper bound for a given largest `T` over ranks:
 *  `recv_rows <= world_size * T * min(top_k, E_r)`.
 *
 *  The forward_finish workspace holds the routed rows in send order `[T*k, d]` (then the returned
 *  rows), their `g`, the local experts' output rows `[recv_rows, d]` and the local experts'
 *  workspace; the backward workspace the `dy` rows out and in, the `dx` rows, `dg` rows, `dg`,
 *  `d_logits` and the sub-calls' workspace. */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_layer_workspace_size(moeblaze_ep_layer_t layer,
                                                                int32_t pass, int64_t num_tokens,
                                                                int64_t recv_rows, size_t* bytes);

/*! \brief moeblaze_ep_layer_workspace_size() for a backward made with the MOEBLAZE_BACKWARD_*
 *  `flags`: with ::MOEBLAZE_BACKWARD_CONSUME_SAVED the local experts' backward writes its
 *  activation gradients over the EXPERT saved buffer (as moeblaze_layer_backward() does with its
 *  saved buffer), so the backward workspace may be smaller. The forward passes ignore `flags`.
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT (unknown pass or flag bits, num_tokens or
 *          recv_rows out of range, `bytes` NULL); ::MOEBLAZE_ERR_INVALID_HANDLE. */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_layer_workspace_size_with_flags(
    moeblaze_ep_layer_t layer, int32_t pass, int64_t num_tokens, int64_t recv_rows, uint32_t flags,
    size_t* bytes);

/*! \brief Bytes of the saved buffer `part` (::moeblaze_ep_saved_code) for `num_tokens` tokens on
 *  this rank (HOME) or `recv_rows` received rows (EXPERT). */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_layer_saved_size(moeblaze_ep_layer_t layer, int32_t part,
                                                            int64_t num_tokens, int64_t recv_rows,
                                                            size_t* bytes);

/*! \brief Arguments of moeblaze_ep_forward_begin() and moeblaze_ep_forward_finish() (the same
 *  struct for both: begin reads the fields marked "begin", finish the others and `home_saved`).
 *  Versioned: fill with moeblaze_ep_forward_args_init(). Shapes use `T` = `num_tokens` of this
 *  rank, the global `E` and `k`, and `E_r` = this rank's experts. Memory: the context's device. */
typedef struct moeblaze_ep_forward_args {
  uint32_t struct_size; /*!< set by moeblaze_ep_forward_args_init() */
  uint32_t flags;       /*!< reserved, must be 0 */
  int64_t num_tokens;   /*!< T >= 0 of this rank, the same in begin and finish */
  /* inputs */
  const void* x;        /*!< [T,d] dtype (begin and finish) */
  const void* w_router; /*!< [E,d] dtype, replicated (begin) */
  const void* w_gate;   /*!< [E_r,h,d] dtype, this rank's experts (finish) */
  const void* w_up;     /*!< [E_r,h,d] dtype; gated activations only (finish) */
  const void* w_down;   /*!< [E_r,d,h] dtype (finish) */
  /* outputs (finish) */
  void* y;                /*!< [T,d] dtype, required */
  void* logits_out;       /*!< [T,E] routing dtype, optional */
  int32_t* ids_out;       /*!< [T,k] int32, optional: global expert ids */
  void* g_out;            /*!< [T,k] routing dtype, optional */
  int32_t* expert_counts; /*!< [E] int32, optional: GLOBAL tokens per expert (all ranks) */
  void* losses;           /*!< [2] routing dtype, optional: this rank's shares {aux, z} */
  /* buffers */
  void* home_saved;          /*!< moeblaze_ep_layer_saved_size(HOME, T) bytes, required (begin
                                  writes it; finish and backward read it) */
  size_t home_saved_bytes;   /*!< size of `home_saved` */
  void* expert_saved;        /*!< moeblaze_ep_layer_saved_size(EXPERT, recv_rows) bytes, required
                                  by finish (which writes it; backward reads it) */
  size_t expert_saved_bytes; /*!< size of `expert_saved` */
  void* workspace;           /*!< moeblaze_ep_layer_workspace_size() bytes of the call's pass */
  size_t workspace_bytes;    /*!< size of `workspace` */
} moeblaze_ep_forward_args_t;

/*! \brief Arguments of moeblaze_ep_backward(). Versioned: fill with
 *  moeblaze_ep_backward_args_init(). Inputs are those of the forward step that filled the saved
 *  buffers and `exchange`. Every gradient output is optional (NULL skips it; the rank still serves
 *  the other ranks' rows). */
typedef struct moeblaze_ep_backward_args {
  uint32_t struct_size; /*!< set by moeblaze_ep_backward_args_init() */
  uint32_t flags;       /*!< ::MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD and/or
                             ::MOEBLAZE_BACKWARD_CONSUME_SAVED (the EXPERT saved buffer's
                             activations), or 0 */
  int64_t num_tokens;   /*!< T of this rank, as in forward */
  /* inputs */
  const void* dy;            /*!< [T,d] dtype */
  const void* d_losses;      /*!< [2] routing dtype, optional: dLoss/d(loss shares); NULL = {1,1} */
  const void* x;             /*!< [T,d] dtype, as in forward */
  const void* w_router;      /*!< [E,d] dtype */
  const void* w_gate;        /*!< [E_r,h,d] dtype */
  const void* w_up;          /*!< [E_r,h,d] dtype; gated activations only */
  const void* w_down;        /*!< [E_r,d,h] dtype */
  const void* home_saved;    /*!< the HOME saved buffer of the forward step */
  size_t home_saved_bytes;   /*!< its size */
  const void* expert_saved;  /*!< the EXPERT saved buffer of the forward step */
  size_t expert_saved_bytes; /*!< its size */
  /* outputs (each optional) */
  void* dx;        /*!< [T,d] dtype, overwritten; includes the router's path */
  void* dw_router; /*!< [E,d] dtype: this rank's share */
  void* dw_gate;   /*!< [E_r,h,d] dtype: complete gradient of this rank's experts */
  void* dw_up;     /*!< [E_r,h,d] dtype; gated activations only */
  void* dw_down;   /*!< [E_r,d,h] dtype */
  void* dg;        /*!< [T,k] routing dtype: dLoss/dg of this rank's tokens */
  void* d_logits;  /*!< [T,E] routing dtype */
  /* buffers */
  void* workspace;        /*!< moeblaze_ep_layer_workspace_size(BACKWARD, T, recv_rows) bytes */
  size_t workspace_bytes; /*!< size of `workspace` */
} moeblaze_ep_backward_args_t;

/*! \brief Fills `*args` with zeros/NULLs and sets `struct_size`. */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_forward_args_init(moeblaze_ep_forward_args_t* args,
                                                             size_t struct_size);

/*! \brief Fills `*args` with zeros/NULLs and sets `struct_size`. */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_backward_args_init(moeblaze_ep_backward_args_t* args,
                                                              size_t struct_size);

/*! \brief Forward, phase 1 (collective): routes this rank's tokens and exchanges the counts.
 *
 *  Reads `args->num_tokens`, `x`, `w_router`; writes `home_saved` (logits, ids, g, routing indices
 *  and the count table) and the host buffer `exchange`; uses `args->workspace`
 *  (moeblaze_ep_layer_workspace_size(::MOEBLAZE_EP_PASS_FORWARD_BEGIN, T) bytes).
 *
 *  **Host synchronisation:** this is the one call of the EP layer that waits for the device: after
 *  the count exchange is enqueued on `stream`, it copies the count table to `exchange` and blocks
 *  the calling thread until `stream` has reached that point (the router of this rank and the count
 *  exchange with every rank). Work enqueued on other streams before the call keeps the device busy
 *  meanwhile. Every later call of the step reads its sizes from `exchange` and never waits.
 *
 *  \param[out] exchange        host memory, moeblaze_ep_layer_exchange_size() bytes, filled here;
 *                              pass it to forward_finish and backward of the same step.
 *  \param[in]  exchange_bytes  its size.
 *  \param[out] recv_rows       rows this rank's experts will receive in forward_finish; size the
 *                              EXPERT saved buffer and the finish/backward workspaces with it.
 *  \param[in]  stream          cudaStream_t or NULL; ignored on CPU.
 *  \return ::MOEBLAZE_OK; ::MOEBLAZE_ERR_INVALID_ARGUMENT (a NULL or misaligned pointer, flags,
 *          T < 0, buffer size; a mismatched collective call on a LOCAL group);
 *          ::MOEBLAZE_ERR_INVALID_HANDLE; ::MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE;
 *          ::MOEBLAZE_ERR_VERSION_MISMATCH (args struct_size); ::MOEBLAZE_ERR_NON_FINITE (CPU: a
 *          logit is NaN or Inf); ::MOEBLAZE_ERR_CUDA (also an NCCL error);
 *          ::MOEBLAZE_ERR_INTERNAL (a LOCAL group timed out). */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_forward_begin(moeblaze_ep_layer_t layer,
                                                         const moeblaze_ep_forward_args_t* args,
                                                         void* exchange, size_t exchange_bytes,
                                                         int64_t* recv_rows, void* stream);

/*! \brief Forward, phase 2 (collective): dispatch, local experts, return and combine.
 *
 *  Reads `x`, `w_gate`, `w_up`, `w_down`, `home_saved` and `exchange` (which must come from
 *  moeblaze_ep_forward_begin() of this layer with the same `num_tokens`, and not have been
 *  finished yet); writes `y`, the optional outputs and `expert_saved`; uses `args->workspace`
 *  (moeblaze_ep_layer_workspace_size(::MOEBLAZE_EP_PASS_FORWARD_FINISH, T, recv_rows) bytes).
 *  Enqueues work on `stream` and never waits for the device.
 *
 *  \return as moeblaze_ep_forward_begin(), and ::MOEBLAZE_ERR_INVALID_ARGUMENT when `exchange`
 *          was not filled by forward_begin of this layer, was already finished, belongs to
 *          another `num_tokens`, or its count table was modified; on a CPU context also when
 *          `home_saved` is not the HOME buffer of the step in `exchange` or was modified (its
 *          header, count table, ids and routing index are checked before use; a CUDA context
 *          cannot read it without a host sync, and its kernels skip indices out of range). */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_forward_finish(moeblaze_ep_layer_t layer,
                                                          const moeblaze_ep_forward_args_t* args,
                                                          void* exchange, size_t exchange_bytes,
                                                          void* stream);

/*! \brief Backward (collective) of one finished forward step: `dx`, `dw_router` (this rank's
 *  share), `dw_gate`, `dw_up`, `dw_down` (complete, of this rank's experts), `dg`, `d_logits`.
 *
 *  Exchange sizes come from `exchange` (a finished step of this layer): no host synchronisation;
 *  the call may be captured in a CUDA graph. May be called more than once per forward step.
 *  \return as moeblaze_ep_forward_finish(). */
MOEBLAZE_API moeblaze_status_t moeblaze_ep_backward(moeblaze_ep_layer_t layer,
                                                    const moeblaze_ep_backward_args_t* args,
                                                    const void* exchange, size_t exchange_bytes,
                                                    void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOEBLAZE_H_ */
