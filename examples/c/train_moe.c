/*
 * train_moe.c — trains one Mixture-of-Experts layer with plain SGD through the whole-layer C API.
 *
 * The task is online regression onto a fixed, randomly initialised "teacher" MoE layer of the same
 * shape: every step draws fresh tokens x ~ N(0, 1), the teacher (a second moeblaze layer, run in
 * inference mode) produces the targets, and the student minimises
 *
 *     loss = 1/(2T) * sum_t ||y_t - target_t||^2  +  aux_loss (load balancing, from the library)
 *
 * with moeblaze_layer_forward() / moeblaze_layer_backward() giving every gradient (router
 * included). Progress is measured on a fixed held-out batch; the program exits non-zero when the
 * held-out loss did not fall by the stated factor, so it doubles as an end-to-end test of the
 * training path.
 *
 * C99 plus POSIX; the only library header is moeblaze.h. The CUDA backend is reached without CUDA
 * headers: the CUDA runtime's five plain-C entry points used here are looked up with dlopen().
 *
 * Copyright (c) 2026 the moeblaze authors. SPDX-License-Identifier: Apache-2.0
 */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moeblaze.h"

/* ---- options ------------------------------------------------------------------------------------
 */

typedef struct options {
  int steps;
  int backend; /* MOEBLAZE_BACKEND_* */
  int dtype;   /* MOEBLAZE_DTYPE_* */
  int checkpoint;
  int64_t tokens, d_model, d_ffn, experts, top_k;
  double lr;
  double momentum;
  double aux_coeff;
  double teacher_router_scale;
  double min_improvement; /* required initial/final held-out loss ratio */
  int print_every;
  uint64_t seed;
  int threads;
} options_t;

static void usage(const char* argv0) {
  printf(
      "usage: %s [options]\n"
      "  --steps N            SGD steps (default 600)\n"
      "  --backend cpu|cuda   where the layer runs (default cpu)\n"
      "  --dtype f32|bf16|f16|f64   storage dtype (default f32; f64 is CPU only)\n"
      "  --checkpoint save_all|save_preact|recompute   (default save_preact)\n"
      "  --tokens T --d-model d --d-ffn h --experts E --top-k k   (default 256 32 64 8 2)\n"
      "  --lr X               learning rate (default 0.3)\n"
      "  --momentum X         SGD momentum (default 0.9; 0 = plain SGD)\n"
      "  --aux X              load-balancing loss coefficient (default 0.01)\n"
      "  --teacher-router X   scale of the teacher's router weights: larger = sharper routing\n"
      "                       (default 4)\n"
      "  --min-improvement X  fail unless held-out loss falls by this factor (default 3)\n"
      "  --print-every N      (default 50)\n"
      "  --seed S             (default 1234)\n"
      "  --threads N          CPU threads, 0 = all (default 0)\n",
      argv0);
}

static int parse_choice(const char* value, const char* const* names, const int* codes, int count,
                        int* out) {
  int i;
  for (i = 0; i < count; ++i) {
    if (strcmp(value, names[i]) == 0) {
      *out = codes[i];
      return 1;
    }
  }
  return 0;
}

static int parse_options(int argc, char** argv, options_t* o) {
  static const char* const backend_names[] = {"cpu", "cuda"};
  static const int backend_codes[] = {MOEBLAZE_BACKEND_CPU, MOEBLAZE_BACKEND_CUDA};
  static const char* const dtype_names[] = {"f32", "bf16", "f16", "f64"};
  static const int dtype_codes[] = {MOEBLAZE_DTYPE_F32, MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16,
                                    MOEBLAZE_DTYPE_F64};
  static const char* const checkpoint_names[] = {"save_all", "save_preact", "recompute"};
  static const int checkpoint_codes[] = {
      MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_CHECKPOINT_SAVE_PREACT, MOEBLAZE_CHECKPOINT_RECOMPUTE};
  int i;
  o->steps = 600;
  o->backend = MOEBLAZE_BACKEND_CPU;
  o->dtype = MOEBLAZE_DTYPE_F32;
  o->checkpoint = MOEBLAZE_CHECKPOINT_SAVE_PREACT;
  o->tokens = 256;
  o->d_model = 32;
  o->d_ffn = 64;
  o->experts = 8;
  o->top_k = 2;
  o->lr = 0.3;
  o->momentum = 0.9;
  o->aux_coeff = 0.01;
  o->teacher_router_scale = 4.0;
  o->min_improvement = 3.0;
  o->print_every = 50;
  o->seed = 1234;
  o->threads = 0;
  for (i = 1; i < argc; ++i) {
    const char* arg = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : NULL;
    int ok = 1;
    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      usage(argv[0]);
      exit(0);
    }
    if (value == NULL) {
      fprintf(stderr, "%s: missing value or unknown option '%s'\n", argv[0], arg);
      return 0;
    }
    if (strcmp(arg, "--steps") == 0)
      o->steps = atoi(value);
    else if (strcmp(arg, "--backend") == 0)
      ok = parse_choice(value, backend_names, backend_codes, 2, &o->backend);
    else if (strcmp(arg, "--dtype") == 0)
      ok = parse_choice(value, dtype_names, dtype_codes, 4, &o->dtype);
    else if (strcmp(arg, "--checkpoint") == 0)
      ok = parse_choice(value, checkpoint_names, checkpoint_codes, 3, &o->checkpoint);
    else if (strcmp(arg, "--tokens") == 0)
      o->tokens = atol(value);
    else if (strcmp(arg, "--d-model") == 0)
      o->d_model = atol(value);
    else if (strcmp(arg, "--d-ffn") == 0)
      o->d_ffn = atol(value);
    else if (strcmp(arg, "--experts") == 0)
      o->experts = atol(value);
    else if (strcmp(arg, "--top-k") == 0)
      o->top_k = atol(value);
    else if (strcmp(arg, "--lr") == 0)
      o->lr = atof(value);
    else if (strcmp(arg, "--momentum") == 0)
      o->momentum = atof(value);
    else if (strcmp(arg, "--teacher-router") == 0)
      o->teacher_router_scale = atof(value);
    else if (strcmp(arg, "--aux") == 0)
      o->aux_coeff = atof(value);
    else if (strcmp(arg, "--min-improvement") == 0)
      o->min_improvement = atof(value);
    else if (strcmp(arg, "--print-every") == 0)
      o->print_every = atoi(value);
    else if (strcmp(arg, "--seed") == 0)
      o->seed = strtoull(value, NULL, 10);
    else if (strcmp(arg, "--threads") == 0)
      o->threads = atoi(value);
    else {
      fprintf(stderr, "%s: unknown option '%s'\n", argv[0], arg);
      return 0;
    }
    if (!ok) {
      fprintf(stderr, "%s: bad value '%s' for %s\n", argv[0], value, arg);
      return 0;
    }
    ++i;
  }
  if (o->steps < 1 || o->print_every < 1 || o->tokens < 1 || o->lr <= 0 || o->momentum < 0 ||
      o->momentum >= 1) {
    fprintf(stderr,
            "%s: --steps, --print-every, --tokens and --lr must be positive, --momentum in "
            "[0, 1)\n",
            argv[0]);
    return 0;
  }
  return 1;
}

/* ---- errors -------------------------------------------------------------------------------------
 */

/* Every moeblaze call goes through CHECK: on failure, print the status and the library's message
 * for this thread (which names the offending argument) and stop. */
#define CHECK(call)                                                             \
  do {                                                                          \
    moeblaze_status_t status_ = (call);                                         \
    if (status_ != MOEBLAZE_OK) {                                               \
      fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #call, \
              moeblaze_status_name(status_), moeblaze_last_error());            \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

static void* xmalloc(size_t bytes) {
  void* p = NULL;
  /* The library wants 16-byte aligned buffers; 256 matches what it carves internally. */
  if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0) {
    fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return p;
}

/* ---- memory on the layer's device: host for CPU, cudaMalloc'd for CUDA --------------------------
 */

typedef struct cuda_runtime {
  int (*malloc_)(void**, size_t);
  int (*free_)(void*);
  int (*memcpy_)(void*, const void*, size_t, int);
  int (*synchronize)(void);
  const char* (*error_string)(int);
} cuda_runtime_t;

static cuda_runtime_t g_cuda;
static int g_use_cuda = 0;

enum { kCudaMemcpyHostToDevice = 1, kCudaMemcpyDeviceToHost = 2 };

static void load_symbol(void* library, const char* name, void** slot) {
  /* POSIX's documented way to turn dlsym's object pointer into a function pointer. */
  *slot = dlsym(library, name);
  if (*slot == NULL) {
    fprintf(stderr, "the CUDA runtime has no %s\n", name);
    exit(1);
  }
}

static void cuda_runtime_load(void) {
  static const char* const names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12",
                                      "libcudart.so.11.0"};
  void* library = NULL;
  size_t i;
  for (i = 0; i < sizeof names / sizeof names[0] && library == NULL; ++i) {
    library = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  }
  if (library == NULL) {
    fprintf(stderr,
            "--backend cuda: could not load the CUDA runtime (libcudart.so) to allocate device "
            "memory; add its folder to LD_LIBRARY_PATH\n");
    exit(1);
  }
  load_symbol(library, "cudaMalloc", (void**)&g_cuda.malloc_);
  load_symbol(library, "cudaFree", (void**)&g_cuda.free_);
  load_symbol(library, "cudaMemcpy", (void**)&g_cuda.memcpy_);
  load_symbol(library, "cudaDeviceSynchronize", (void**)&g_cuda.synchronize);
  load_symbol(library, "cudaGetErrorString", (void**)&g_cuda.error_string);
  g_use_cuda = 1;
}

static void cuda_check(int error, const char* what) {
  if (error != 0) {
    fprintf(stderr, "%s failed: %s\n", what, g_cuda.error_string(error));
    exit(1);
  }
}

static void* device_alloc(size_t bytes) {
  void* p = NULL;
  if (!g_use_cuda) return xmalloc(bytes);
  cuda_check(g_cuda.malloc_(&p, bytes ? bytes : 1), "cudaMalloc");
  return p;
}

static void device_free(void* p) {
  if (g_use_cuda) {
    cuda_check(g_cuda.free_(p), "cudaFree");
  } else {
    free(p);
  }
}

static void to_device(void* dst, const void* src, size_t bytes) {
  if (g_use_cuda) {
    cuda_check(g_cuda.memcpy_(dst, src, bytes, kCudaMemcpyHostToDevice), "cudaMemcpy to device");
  } else if (dst != src) {
    memcpy(dst, src, bytes);
  }
}

/* Synchronous on the legacy default stream, which is the stream (NULL) the layer calls use. */
static void to_host(void* dst, const void* src, size_t bytes) {
  if (g_use_cuda) {
    cuda_check(g_cuda.memcpy_(dst, src, bytes, kCudaMemcpyDeviceToHost), "cudaMemcpy to host");
  } else if (dst != src) {
    memcpy(dst, src, bytes);
  }
}

/* ---- dtypes: the example keeps fp64 master values and converts to the storage dtype -------------
 */

static size_t dtype_size(int dtype) {
  switch (dtype) {
    case MOEBLAZE_DTYPE_F32: return 4;
    case MOEBLAZE_DTYPE_F64: return 8;
    default: return 2;
  }
}

static const char* dtype_name(int dtype) {
  switch (dtype) {
    case MOEBLAZE_DTYPE_F32: return "f32";
    case MOEBLAZE_DTYPE_BF16: return "bf16";
    case MOEBLAZE_DTYPE_F16: return "f16";
    default: return "f64";
  }
}

static uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Round to nearest even, as the library does. */
static uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int32_t exponent = (int32_t)((u >> 23) & 0xffu) - 127 + 15;
  uint32_t mantissa = u & 0x7fffffu;
  uint32_t half, rest, halfway;
  int shift;
  if (((u >> 23) & 0xffu) == 0xffu) return (uint16_t)(sign | 0x7c00u | (mantissa ? 0x200u : 0u));
  if (exponent >= 31) return (uint16_t)(sign | 0x7c00u);
  if (exponent <= 0) { /* subnormal half, or zero */
    if (exponent < -10) return (uint16_t)sign;
    mantissa |= 0x800000u;
    shift = 14 - exponent;
    half = mantissa >> shift;
    rest = mantissa & ((1u << shift) - 1u);
    halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return (uint16_t)(sign | half);
  }
  half = sign | ((uint32_t)exponent << 10) | (mantissa >> 13);
  rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half; /* may carry into the exponent */
  return (uint16_t)half;
}

static float f16_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float f = ldexpf((float)mantissa, -24);
    return sign ? -f : f;
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

static void store(void* buffer, size_t i, double value, int dtype) {
  switch (dtype) {
    case MOEBLAZE_DTYPE_F32: ((float*)buffer)[i] = (float)value; break;
    case MOEBLAZE_DTYPE_F64: ((double*)buffer)[i] = value; break;
    case MOEBLAZE_DTYPE_BF16: ((uint16_t*)buffer)[i] = float_to_bf16((float)value); break;
    default: ((uint16_t*)buffer)[i] = float_to_f16((float)value); break;
  }
}

static double load(const void* buffer, size_t i, int dtype) {
  switch (dtype) {
    case MOEBLAZE_DTYPE_F32: return ((const float*)buffer)[i];
    case MOEBLAZE_DTYPE_F64: return ((const double*)buffer)[i];
    case MOEBLAZE_DTYPE_BF16: return bits_float((uint32_t)((const uint16_t*)buffer)[i] << 16);
    default: return f16_to_float(((const uint16_t*)buffer)[i]);
  }
}

/* ---- random numbers: splitmix64 + Box-Muller; printed seed reproduces a run ---------------------
 */

static uint64_t g_rng_state;

static uint64_t next_u64(void) {
  uint64_t z = (g_rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static double uniform01(void) {
  return ((double)(next_u64() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double normal(void) {
  const double two_pi = 6.283185307179586;
  return sqrt(-2.0 * log(uniform01())) * cos(two_pi * uniform01());
}

/* ---- tensors: fp64 master on the host, a storage-dtype staging copy, and the device buffer
 * ------- */

typedef struct tensor {
  size_t count;
  double* master;
  void* staging; /* host, storage dtype */
  void* device;  /* layer's device, storage dtype */
} tensor_t;

static int g_dtype;

static tensor_t tensor_new(size_t count) {
  tensor_t t;
  t.count = count;
  t.master = (double*)xmalloc(count * sizeof(double));
  t.staging = xmalloc(count * dtype_size(g_dtype));
  t.device = device_alloc(count * dtype_size(g_dtype));
  memset(t.master, 0, count * sizeof(double));
  return t;
}

static void tensor_free(tensor_t* t) {
  free(t->master);
  free(t->staging);
  device_free(t->device);
}

static void tensor_fill_normal(tensor_t* t, double stddev) {
  size_t i;
  for (i = 0; i < t->count; ++i) t->master[i] = stddev * normal();
}

/* master -> storage dtype -> device */
static void tensor_upload(tensor_t* t) {
  size_t i;
  for (i = 0; i < t->count; ++i) store(t->staging, i, t->master[i], g_dtype);
  to_device(t->device, t->staging, t->count * dtype_size(g_dtype));
}

/* device -> storage dtype -> master */
static void tensor_download(tensor_t* t) {
  size_t i;
  to_host(t->staging, t->device, t->count * dtype_size(g_dtype));
  for (i = 0; i < t->count; ++i) t->master[i] = load(t->staging, i, g_dtype);
}

/* The four weights of one MoE layer. */
typedef struct weights {
  tensor_t router, gate, up, down;
} weights_t;

static weights_t weights_new(const options_t* o) {
  weights_t w;
  const size_t E = (size_t)o->experts, d = (size_t)o->d_model, h = (size_t)o->d_ffn;
  w.router = tensor_new(E * d);
  w.gate = tensor_new(E * h * d);
  w.up = tensor_new(E * h * d);
  w.down = tensor_new(E * d * h);
  return w;
}

/* Scaled so that a, b, y stay O(1) for x ~ N(0, 1); `router_scale` sets how decisive routing is. */
static void weights_init(weights_t* w, const options_t* o, double router_scale) {
  tensor_fill_normal(&w->router, router_scale / sqrt((double)o->d_model));
  tensor_fill_normal(&w->gate, 1.0 / sqrt((double)o->d_model));
  tensor_fill_normal(&w->up, 1.0 / sqrt((double)o->d_model));
  tensor_fill_normal(&w->down, 1.0 / sqrt((double)o->d_ffn));
  tensor_upload(&w->router);
  tensor_upload(&w->gate);
  tensor_upload(&w->up);
  tensor_upload(&w->down);
}

static void weights_free(weights_t* w) {
  tensor_free(&w->router);
  tensor_free(&w->gate);
  tensor_free(&w->up);
  tensor_free(&w->down);
}

/* SGD with (heavy-ball) momentum on the fp64 master weights; the library sees them rounded to the
 * storage dtype. `velocity` is host-only state of the same shape. */
static void sgd_update(tensor_t* param, tensor_t* grad, double* velocity, double lr,
                       double momentum) {
  size_t i;
  tensor_download(grad);
  for (i = 0; i < param->count; ++i) {
    velocity[i] = momentum * velocity[i] + grad->master[i];
    param->master[i] -= lr * velocity[i];
  }
  tensor_upload(param);
}

/* ---- the layer calls ----------------------------------------------------------------------------
 */

typedef struct buffers {
  void* workspace;
  size_t workspace_bytes;
  void* saved;
  size_t saved_bytes;
  int32_t* expert_counts; /* [E] device */
  void* losses;           /* [2] routing dtype, device */
} buffers_t;

/* training = 0: inference (no saved buffer, so no backward is possible). */
static void forward(moeblaze_layer_t layer, const weights_t* w, const tensor_t* x, tensor_t* y,
                    buffers_t* b, int64_t tokens, int training) {
  moeblaze_forward_args_t args;
  CHECK(moeblaze_forward_args_init(&args, sizeof args));
  args.num_tokens = tokens;
  args.x = x->device;
  args.w_router = w->router.device;
  args.w_gate = w->gate.device;
  args.w_up = w->up.device;
  args.w_down = w->down.device;
  args.y = y->device;
  args.workspace = b->workspace;
  args.workspace_bytes = b->workspace_bytes;
  if (training) {
    args.saved = b->saved;
    args.saved_bytes = b->saved_bytes;
    args.expert_counts = b->expert_counts;
    args.losses = b->losses;
  }
  CHECK(moeblaze_layer_forward(layer, &args, NULL));
}

static void backward(moeblaze_layer_t layer, const weights_t* w, const tensor_t* x,
                     const tensor_t* dy, weights_t* grads, buffers_t* b, int64_t tokens) {
  moeblaze_backward_args_t args;
  CHECK(moeblaze_backward_args_init(&args, sizeof args));
  args.num_tokens = tokens;
  args.dy = dy->device;
  args.d_losses = NULL; /* {1, 1}: the losses are part of the objective as returned */
  args.x = x->device;
  args.w_router = w->router.device;
  args.w_gate = w->gate.device;
  args.w_up = w->up.device;
  args.w_down = w->down.device;
  args.saved = b->saved;
  args.saved_bytes = b->saved_bytes;
  args.dx = NULL; /* x is data, not a parameter: skip its gradient */
  args.dw_router = grads->router.device;
  args.dw_gate = grads->gate.device;
  args.dw_up = grads->up.device;
  args.dw_down = grads->down.device;
  args.workspace = b->workspace;
  args.workspace_bytes = b->workspace_bytes;
  CHECK(moeblaze_layer_backward(layer, &args, NULL));
}

/* 1/(2T) * sum ||y - target||^2, and (optionally) its gradient dy = (y - target) / T. */
static double mse(tensor_t* y, const tensor_t* target, tensor_t* dy, int64_t tokens) {
  double sum = 0.0;
  size_t i;
  tensor_download(y);
  for (i = 0; i < y->count; ++i) {
    const double diff = y->master[i] - target->master[i];
    sum += diff * diff;
    if (dy) dy->master[i] = diff / (double)tokens;
  }
  if (dy) tensor_upload(dy);
  return 0.5 * sum / (double)tokens;
}

/* FNV-1a over the bytes the library last saw: equal checksums mean bitwise equal training runs. */
static uint64_t checksum(const tensor_t* t, uint64_t hash) {
  const unsigned char* bytes = (const unsigned char*)t->staging;
  size_t i;
  for (i = 0; i < t->count * dtype_size(g_dtype); ++i) hash = (hash ^ bytes[i]) * 0x100000001b3ull;
  return hash;
}

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static moeblaze_layer_t make_layer(moeblaze_context_t context, const options_t* o, double aux) {
  moeblaze_layer_config_t config;
  moeblaze_layer_t layer = NULL;
  CHECK(moeblaze_layer_config_init(&config, sizeof config));
  config.dtype = o->dtype;
  config.d_model = o->d_model;
  config.d_ffn = o->d_ffn;
  config.num_experts = o->experts;
  config.top_k = o->top_k;
  config.activation = MOEBLAZE_ACTIVATION_SWIGLU;
  config.checkpoint = o->checkpoint;
  config.aux_loss_coeff = (float)aux;
  config.renormalize = 1; /* g sums to 1 over a token's k experts (Mixtral-style) */
  CHECK(moeblaze_layer_create(&layer, context, &config));
  return layer;
}

int main(int argc, char** argv) {
  options_t o;
  moeblaze_context_t context = NULL;
  moeblaze_layer_t student = NULL, teacher = NULL;
  weights_t w, grads, velocity, teacher_w;
  tensor_t x, y, target, dy, eval_x, eval_target, eval_y;
  buffers_t buf;
  size_t ws_forward = 0, ws_backward = 0, ws_teacher = 0, rsize;
  const char* const checkpoint_names[] = {"SAVE_ALL", "SAVE_PREACT", "RECOMPUTE"};
  double initial_eval, final_eval = 0.0, train_loss = 0.0, aux = 0.0, t_start, t_train = 0.0;
  int32_t* counts_host;
  int step, e;

  if (!parse_options(argc, argv, &o)) {
    usage(argv[0]);
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0); /* progress lines interleave correctly with errors */
  g_dtype = o.dtype;
  g_rng_state = o.seed;
  rsize = o.dtype == MOEBLAZE_DTYPE_F64 ? 8 : 4;

  printf("moeblaze %s\n", moeblaze_get_build_info());
  printf("header %d.%d.%d, library version %d\n", MOEBLAZE_VERSION_MAJOR, MOEBLAZE_VERSION_MINOR,
         MOEBLAZE_VERSION_PATCH, (int)moeblaze_get_version());
  if (!moeblaze_backend_available(o.backend)) {
    fprintf(stderr, "backend %s is not available in this build or on this machine\n",
            o.backend == MOEBLAZE_BACKEND_CUDA ? "cuda" : "cpu");
    return 2;
  }
  if (o.backend == MOEBLAZE_BACKEND_CUDA) cuda_runtime_load();

  CHECK(moeblaze_context_create(&context, o.backend, 0));
  if (o.threads > 0) CHECK(moeblaze_context_set_num_threads(context, o.threads));
  student = make_layer(context, &o, o.aux_coeff);
  teacher = make_layer(context, &o, 0.0);

  printf(
      "task: regress a fixed random teacher MoE; T=%ld d=%ld h=%ld E=%ld k=%ld SwiGLU %s, %s, "
      "backend %s, SGD lr=%g momentum %g, aux coeff %g, seed %lu\n",
      (long)o.tokens, (long)o.d_model, (long)o.d_ffn, (long)o.experts, (long)o.top_k,
      dtype_name(o.dtype), checkpoint_names[o.checkpoint],
      o.backend == MOEBLAZE_BACKEND_CUDA ? "cuda" : "cpu", o.lr, o.momentum, o.aux_coeff,
      (unsigned long)o.seed);

  /* The plan answers every size before anything runs; nothing is allocated on the execute path.
   * The student's forward also runs without a saved buffer (the held-out evaluation), so it needs
   * the plain forward size; a program whose forwards all train could ask
   * moeblaze_layer_workspace_size_with_flags(..., MOEBLAZE_FORWARD_WITH_SAVED, ...) for less. */
  CHECK(
      moeblaze_layer_saved_size(student, MOEBLAZE_PASS_LAYER_FORWARD, o.tokens, &buf.saved_bytes));
  CHECK(moeblaze_layer_workspace_size(student, MOEBLAZE_PASS_LAYER_FORWARD, o.tokens, &ws_forward));
  CHECK(
      moeblaze_layer_workspace_size(student, MOEBLAZE_PASS_LAYER_BACKWARD, o.tokens, &ws_backward));
  CHECK(moeblaze_layer_workspace_size(teacher, MOEBLAZE_PASS_LAYER_FORWARD, o.tokens, &ws_teacher));
  printf(
      "plan: saved %zu bytes (forward -> backward), workspace %zu bytes forward, %zu bytes "
      "backward\n",
      buf.saved_bytes, ws_forward, ws_backward);
  printf("      for comparison, x is %zu bytes and one [T*k, h] activation is %zu bytes\n",
         (size_t)(o.tokens * o.d_model) * dtype_size(o.dtype),
         (size_t)(o.tokens * o.top_k * o.d_ffn) * dtype_size(o.dtype));
  buf.workspace_bytes = ws_forward;
  if (ws_backward > buf.workspace_bytes) buf.workspace_bytes = ws_backward;
  if (ws_teacher > buf.workspace_bytes) buf.workspace_bytes = ws_teacher;
  buf.workspace = device_alloc(buf.workspace_bytes);
  buf.saved = device_alloc(buf.saved_bytes);
  buf.expert_counts = (int32_t*)device_alloc(sizeof(int32_t) * (size_t)o.experts);
  buf.losses = device_alloc(2 * rsize);
  counts_host = (int32_t*)xmalloc(sizeof(int32_t) * (size_t)o.experts);

  /* Teacher: decisive routing (larger router weights). Student: its own random start. */
  teacher_w = weights_new(&o);
  weights_init(&teacher_w, &o, o.teacher_router_scale);
  w = weights_new(&o);
  weights_init(&w, &o, 1.0);
  grads = weights_new(&o);
  velocity = weights_new(&o); /* zero; only its fp64 master arrays are used */

  x = tensor_new((size_t)(o.tokens * o.d_model));
  y = tensor_new(x.count);
  target = tensor_new(x.count);
  dy = tensor_new(x.count);
  eval_x = tensor_new(x.count);
  eval_y = tensor_new(x.count);
  eval_target = tensor_new(x.count);

  tensor_fill_normal(&eval_x, 1.0);
  tensor_upload(&eval_x);
  forward(teacher, &teacher_w, &eval_x, &eval_target, &buf, o.tokens, 0);
  tensor_download(&eval_target);
  forward(student, &w, &eval_x, &eval_y, &buf, o.tokens, 0);
  initial_eval = mse(&eval_y, &eval_target, NULL, o.tokens);
  printf("step     0  held-out loss %.6f\n", initial_eval);

  t_start = now_seconds();
  for (step = 1; step <= o.steps; ++step) {
    double losses_host[2];
    float losses_f32[2];
    double t0 = now_seconds();
    tensor_fill_normal(&x, 1.0);
    tensor_upload(&x);
    forward(teacher, &teacher_w, &x, &target, &buf, o.tokens, 0);
    tensor_download(&target);

    forward(student, &w, &x, &y, &buf, o.tokens, 1);
    train_loss = mse(&y, &target, &dy, o.tokens);
    backward(student, &w, &x, &dy, &grads, &buf, o.tokens);
    sgd_update(&w.router, &grads.router, velocity.router.master, o.lr, o.momentum);
    sgd_update(&w.gate, &grads.gate, velocity.gate.master, o.lr, o.momentum);
    sgd_update(&w.up, &grads.up, velocity.up.master, o.lr, o.momentum);
    sgd_update(&w.down, &grads.down, velocity.down.master, o.lr, o.momentum);
    t_train += now_seconds() - t0;

    if (rsize == 8) {
      to_host(losses_host, buf.losses, sizeof losses_host);
      aux = losses_host[0];
    } else {
      to_host(losses_f32, buf.losses, sizeof losses_f32);
      aux = losses_f32[0];
    }
    if (!(train_loss == train_loss) || !(aux == aux)) { /* NaN never passes */
      fprintf(stderr, "step %d: loss is NaN (mse %g, aux %g)\n", step, train_loss, aux);
      return 1;
    }
    if (step % o.print_every == 0 || step == o.steps) {
      forward(student, &w, &eval_x, &eval_y, &buf, o.tokens, 0);
      final_eval = mse(&eval_y, &eval_target, NULL, o.tokens);
      to_host(counts_host, buf.expert_counts, sizeof(int32_t) * (size_t)o.experts);
      printf("step %5d  train mse %.6f  aux %.5f  held-out loss %.6f  load [", step, train_loss,
             aux, final_eval);
      for (e = 0; e < (int)o.experts; ++e) printf(e ? " %d" : "%d", (int)counts_host[e]);
      printf("]  %.2f ms/step\n", 1e3 * t_train / step);
    }
  }
  printf("trained %d steps in %.2f s\n", o.steps, now_seconds() - t_start);
  printf("held-out loss: initial %.6f -> final %.6f (%.1fx lower; required %.1fx)\n", initial_eval,
         final_eval, initial_eval / final_eval, o.min_improvement);
  {
    uint64_t hash = 0xcbf29ce484222325ull;
    hash = checksum(&w.router, hash);
    hash = checksum(&w.gate, hash);
    hash = checksum(&w.up, hash);
    hash = checksum(&w.down, hash);
    printf("final weights checksum: %016llx\n", (unsigned long long)hash);
  }

  weights_free(&w);
  weights_free(&grads);
  weights_free(&velocity);
  weights_free(&teacher_w);
  tensor_free(&x);
  tensor_free(&y);
  tensor_free(&target);
  tensor_free(&dy);
  tensor_free(&eval_x);
  tensor_free(&eval_y);
  tensor_free(&eval_target);
  device_free(buf.workspace);
  device_free(buf.saved);
  device_free(buf.expert_counts);
  device_free(buf.losses);
  free(counts_host);
  CHECK(moeblaze_layer_destroy(student));
  CHECK(moeblaze_layer_destroy(teacher));
  CHECK(moeblaze_context_destroy(context));

  if (!(final_eval * o.min_improvement <= initial_eval)) {
    printf("FAIL: the held-out loss did not fall by %.1fx\n", o.min_improvement);
    return 1;
  }
  printf("OK: the held-out loss fell by more than %.1fx\n", o.min_improvement);
  return 0;
}
