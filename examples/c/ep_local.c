/*
 * ep_local.c — expert parallelism (EP) from C: W ranks train one Mixture-of-Experts layer whose
 * experts are spread over them, then the world's result is checked against the one-device layer.
 *
 * The ranks are threads of this process joined by moeblaze's LOCAL transport (an in-process
 * group). Each rank has what a GPU of a real EP job has: its own context (here a CPU context), its
 * own tokens, a replica of the router weight and the weights of ITS experts only. Every step:
 *
 *   forward_begin   route this rank's tokens, exchange the per-expert counts, sync the host once
 *   (allocate)      the receive-side buffers, sized by the row count begin returned
 *   forward_finish  send rows to the experts' ranks, run the local experts, bring results home
 *   backward        the same exchanges transposed; complete gradients of the rank's experts
 *   all-reduce      sum the router's gradient shares (a replicated parameter), then plain SGD
 *
 * The task is a toy regression: y should approach M·x for a fixed random d×d matrix M. The world's
 * objective is the sum of the ranks' objectives, L = Σ_r L_r with
 *
 *     L_r = 1/(2T) Σ_{t of rank r} ||y_t − M·x_t||²  +  aux_r
 *
 * where T is the GLOBAL token count and aux_r this rank's share of the load-balancing loss.
 *
 * At the end one inference forward of the world is compared with ONE moeblaze_layer_forward on
 * the global batch (every rank's tokens, in rank order) with the full weights (every rank's
 * experts, in rank order). The program exits 1 if they disagree, if the loss did not fall, or on
 * any failed call. With the NCCL transport the calls are the same; see README.md.
 *
 * C99 plus POSIX threads; the only library header is moeblaze.h.
 *
 * Copyright (c) 2026 the moeblaze authors. SPDX-License-Identifier: Apache-2.0
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moeblaze.h"

/* ---- options ------------------------------------------------------------------------------------
 */

typedef struct options {
  int32_t world_size;
  int64_t experts, top_k, d_model, d_ffn;
  int64_t tokens; /* of rank 0; rank r has tokens + 4r (uneven on purpose: EP does not need equal
                     batches) */
  int steps;
  double lr;
  double aux_coeff;
  uint64_t seed;
  int threads; /* CPU threads of each rank's context */
} options_t;

static void usage(const char* argv0) {
  printf(
      "usage: %s [options]\n"
      "  --world-size W       ranks, one thread each, 1..E (default 2)\n"
      "  --experts E          experts of the whole layer, split contiguously (default 4)\n"
      "  --top-k k            experts per token (default 2)\n"
      "  --d-model d --d-ffn h   (default 16 32)\n"
      "  --tokens T           tokens of rank 0; rank r has T + 4r (default 24)\n"
      "  --steps N            SGD steps (default 6)\n"
      "  --lr X               learning rate (default 0.1)\n"
      "  --aux X              load-balancing loss coefficient (default 0.01)\n"
      "  --seed S             (default 2026)\n"
      "  --threads N          CPU threads per rank, 0 = all (default 1)\n",
      argv0);
}

static int parse_options(int argc, char** argv, options_t* o) {
  int i;
  o->world_size = 2;
  o->experts = 4;
  o->top_k = 2;
  o->d_model = 16;
  o->d_ffn = 32;
  o->tokens = 24;
  o->steps = 6;
  o->lr = 0.1;
  o->aux_coeff = 0.01;
  o->seed = 2026;
  o->threads = 1;
  for (i = 1; i < argc; i += 2) {
    const char* arg = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      usage(argv[0]);
      exit(0);
    }
    if (value == NULL) {
      fprintf(stderr, "%s: missing value or unknown option '%s'\n", argv[0], arg);
      return 0;
    }
    if (strcmp(arg, "--world-size") == 0)
      o->world_size = atoi(value);
    else if (strcmp(arg, "--experts") == 0)
      o->experts = atol(value);
    else if (strcmp(arg, "--top-k") == 0)
      o->top_k = atol(value);
    else if (strcmp(arg, "--d-model") == 0)
      o->d_model = atol(value);
    else if (strcmp(arg, "--d-ffn") == 0)
      o->d_ffn = atol(value);
    else if (strcmp(arg, "--tokens") == 0)
      o->tokens = atol(value);
    else if (strcmp(arg, "--steps") == 0)
      o->steps = atoi(value);
    else if (strcmp(arg, "--lr") == 0)
      o->lr = atof(value);
    else if (strcmp(arg, "--aux") == 0)
      o->aux_coeff = atof(value);
    else if (strcmp(arg, "--seed") == 0)
      o->seed = strtoull(value, NULL, 10);
    else if (strcmp(arg, "--threads") == 0)
      o->threads = atoi(value);
    else {
      fprintf(stderr, "%s: unknown option '%s'\n", argv[0], arg);
      return 0;
    }
  }
  /* Only what the example itself relies on; the library validates the layer and the placement
   * (world_size 1..E, k <= E, ...) and its messages are reported like any other failure. */
  if (o->world_size < 1 || o->tokens < 0 || o->steps < 1 || o->lr <= 0 || o->threads < 0) {
    fprintf(stderr,
            "%s: --world-size and --steps must be >= 1, --tokens >= 0, --lr > 0, --threads >= "
            "0\n",
            argv[0]);
    return 0;
  }
  return 1;
}

static int64_t rank_tokens(const options_t* o, int32_t rank) {
  return o->tokens + 4 * rank;
}

/* ---- errors and memory --------------------------------------------------------------------------
 */

/* Every moeblaze call goes through TRY: on failure it prints who failed (a rank, or -1 for the
 * one-device reference), the status name and the library's message for this thread (which names
 * the offending argument), and makes the enclosing function return 0. */
static void report_failure(int32_t rank, int line, const char* call, moeblaze_status_t status) {
  fprintf(stderr, "%s %d: %s:%d: %s failed: %s (%s)\n", rank < 0 ? "reference" : "rank",
          rank < 0 ? 0 : (int)rank, __FILE__, line, call, moeblaze_status_name(status),
          moeblaze_last_error());
}

#define TRY(rank, call)                                 \
  do {                                                  \
    const moeblaze_status_t status_ = (call);           \
    if (status_ != MOEBLAZE_OK) {                       \
      report_failure((rank), __LINE__, #call, status_); \
      return 0;                                         \
    }                                                   \
  } while (0)

static void* xmalloc(size_t bytes) {
  void* p = NULL;
  /* The library wants 16-byte aligned buffers (8 for the host `exchange` buffer). */
  if (posix_memalign(&p, 64, bytes ? bytes : 1) != 0) {
    fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return p;
}

static float* floats(int64_t count) {
  return (float*)xmalloc(sizeof(float) * (size_t)count);
}

/* ---- random numbers: splitmix64 + Box-Muller, one independent stream per purpose ----------------
 *
 * A stream depends only on (seed, purpose), never on the world size: the router replica, an
 * expert's weights and a rank's tokens are the same numbers whichever thread draws them. */

enum { kStreamRouter = 1, kStreamTarget = 2, kStreamExpert = 100, kStreamTokens = 100000 };

typedef struct rng {
  uint64_t state;
} rng_t;

static rng_t rng_stream(uint64_t seed, uint64_t purpose) {
  rng_t r;
  r.state = seed ^ (purpose * 0xd1b54a32d192ed03ull);
  return r;
}

static uint64_t next_u64(rng_t* r) {
  uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static double uniform01(rng_t* r) {
  return ((double)(next_u64(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static void fill_normal(rng_t* r, float* out, int64_t count, double stddev) {
  const double two_pi = 6.283185307179586;
  int64_t i;
  for (i = 0; i < count; ++i) {
    const double u = uniform01(r), v = uniform01(r);
    out[i] = (float)(stddev * sqrt(-2.0 * log(u)) * cos(two_pi * v));
  }
}

/* ---- the world: what the ranks share ------------------------------------------------------------
 *
 * With NCCL the ranks would be processes and these would be NCCL collectives; with threads a
 * barrier and shared arrays do the same job. */

struct rank_state;

typedef struct world {
  const options_t* o;
  moeblaze_ep_group_t group; /* the LOCAL transport's "communicator" */
  int64_t global_tokens;     /* T: the loss is normalised by it on every rank */
  /* barrier; `failed` breaks it so that no rank waits forever for one that has quit */
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  int32_t arrived;
  uint64_t generation;
  int failed;
  /* per-step exchange between ranks */
  float* router_shares;     /* [W, E*d]: each rank's share of dL/dw_router */
  double* step_loss;        /* [W]: each rank's L_r */
  double first_loss;        /* the world's loss at step 1, for the check that it fell */
  int64_t* step_recv_rows;  /* [W]: rows each rank's experts received */
  struct rank_state* ranks; /* [W] */
} world_t;

/* Waits for every rank; returns 0 (at once) when some rank has failed. */
static int world_sync(world_t* w) {
  int ok;
  pthread_mutex_lock(&w->mutex);
  if (!w->failed) {
    const uint64_t generation = w->generation;
    if (++w->arrived == w->o->world_size) {
      w->arrived = 0;
      ++w->generation;
      pthread_cond_broadcast(&w->cond);
    } else {
      while (generation == w->generation && !w->failed) pthread_cond_wait(&w->cond, &w->mutex);
    }
  }
  ok = !w->failed;
  pthread_mutex_unlock(&w->mutex);
  return ok;
}

/* Wakes the ranks waiting in world_sync(). A rank waiting inside a LOCAL collective of the library
 * for the failed rank is not woken by this: the group gives up after 120 s with
 * MOEBLAZE_ERR_INTERNAL (with NCCL, the job would hang: abort the communicator). */
static void world_fail(world_t* w) {
  pthread_mutex_lock(&w->mutex);
  w->failed = 1;
  pthread_cond_broadcast(&w->cond);
  pthread_mutex_unlock(&w->mutex);
}

/* ---- one rank -----------------------------------------------------------------------------------
 */

typedef struct rank_state {
  world_t* world;
  int32_t rank;
  int ok;
  int64_t tokens;                   /* T_r */
  int64_t expert_begin, expert_end; /* this rank owns global experts [begin, end) */
  moeblaze_context_t context;
  moeblaze_ep_layer_t layer;
  /* Weights. The router is a replica (identical on every rank, kept identical by the all-reduce);
   * gate/up/down hold ONLY this rank's experts: expert expert_begin + i is slice i. No rank ever
   * holds the full layer. */
  float* w_router;  /* [E, d] */
  float* w_gate;    /* [E_r, h, d] */
  float* w_up;      /* [E_r, h, d] */
  float* w_down;    /* [E_r, d, h] */
  float* dw_router; /* [E, d]: this rank's share, then (after the all-reduce) the sum */
  float *dw_gate, *dw_up, *dw_down; /* complete gradients of this rank's experts */
  float* m_target;            /* [d, d]: the regression target's matrix (same on every rank) */
  float *x, *target, *y, *dy; /* [T_r, d]: this rank's tokens and their values */
  float losses[2];            /* this rank's shares of {aux, z} (routing dtype: F32 here) */
  /* Per-step buffers. `exchange` is host memory that carries the count table from forward_begin
   * to forward_finish and backward; HOME saved depends only on T_r, so it is allocated once. */
  void* exchange;
  size_t exchange_bytes;
  void* home_saved;
  size_t home_saved_bytes;
  void* begin_workspace;
  size_t begin_workspace_bytes;
  /* Receive side, sized from recv_rows of this step (known only after forward_begin). */
  int64_t recv_rows;
  void* expert_saved;
  size_t expert_saved_bytes;
  void* workspace; /* for forward_finish, then backward */
  size_t workspace_bytes;
} rank_t;

/* The GLOBAL layer: every rank describes the whole layer (num_experts = E of all ranks); the EP
 * plan derives its own share of it. The one-device reference uses the same config. */
static int make_config(int32_t rank, const options_t* o, moeblaze_layer_config_t* config) {
  TRY(rank, moeblaze_layer_config_init(config, sizeof *config));
  config->dtype = MOEBLAZE_DTYPE_F32;
  config->d_model = o->d_model;
  config->d_ffn = o->d_ffn;
  config->num_experts = o->experts;
  config->top_k = o->top_k;
  config->activation = MOEBLAZE_ACTIVATION_SWIGLU;
  config->checkpoint = MOEBLAZE_CHECKPOINT_SAVE_PREACT;
  config->aux_loss_coeff = (float)o->aux_coeff;
  return 1;
}

static int rank_setup(rank_t* r) {
  const options_t* o = r->world->o;
  const int64_t E = o->experts, d = o->d_model, h = o->d_ffn;
  moeblaze_layer_config_t config;
  moeblaze_ep_config_t ep;
  int64_t e, local_experts;
  rng_t rng;

  /* Each rank its own context: on GPUs, one per device. One thread each keeps W ranks from
   * oversubscribing the cores. */
  TRY(r->rank, moeblaze_context_create(&r->context, MOEBLAZE_BACKEND_CPU, 0));
  TRY(r->rank, moeblaze_context_set_num_threads(r->context, o->threads));
  if (!make_config(r->rank, o, &config)) return 0;
  TRY(r->rank, moeblaze_ep_config_init(&ep, sizeof ep));
  ep.transport = MOEBLAZE_EP_TRANSPORT_LOCAL;
  ep.rank = r->rank;
  ep.world_size = o->world_size;
  ep.communicator = r->world->group;
  /* Not collective: creating the plan talks to no other rank. */
  TRY(r->rank, moeblaze_ep_layer_create(&r->layer, r->context, &config, &ep));

  /* Which experts are mine: E/W each, one more on the first E%W ranks, contiguous. This fixes the
   * first dimension of the expert weights this rank passes. */
  TRY(r->rank, moeblaze_ep_layer_get_experts(r->layer, &r->expert_begin, &r->expert_end));
  local_experts = r->expert_end - r->expert_begin;

  r->tokens = rank_tokens(o, r->rank);
  r->w_router = floats(E * d);
  r->dw_router = floats(E * d);
  r->w_gate = floats(local_experts * h * d);
  r->w_up = floats(local_experts * h * d);
  r->w_down = floats(local_experts * d * h);
  r->dw_gate = floats(local_experts * h * d);
  r->dw_up = floats(local_experts * h * d);
  r->dw_down = floats(local_experts * d * h);
  r->m_target = floats(d * d);
  r->x = floats(r->tokens * d);
  r->target = floats(r->tokens * d);
  r->y = floats(r->tokens * d);
  r->dy = floats(r->tokens * d);

  /* The replicated parameter: every rank draws the same numbers from the same stream. */
  rng = rng_stream(o->seed, kStreamRouter);
  fill_normal(&rng, r->w_router, E * d, 1.0 / sqrt((double)d));
  rng = rng_stream(o->seed, kStreamTarget);
  fill_normal(&rng, r->m_target, d * d, 0.5 / sqrt((double)d));
  /* The owner initialises its experts; expert e's stream does not depend on who owns it. */
  for (e = 0; e < local_experts; ++e) {
    rng = rng_stream(o->seed, (uint64_t)(kStreamExpert + r->expert_begin + e));
    fill_normal(&rng, r->w_gate + e * h * d, h * d, 1.0 / sqrt((double)d));
    fill_normal(&rng, r->w_up + e * h * d, h * d, 1.0 / sqrt((double)d));
    fill_normal(&rng, r->w_down + e * d * h, d * h, 1.0 / sqrt((double)h));
  }
  /* This rank's data: a fixed batch, so that a few steps show the loss falling. */
  rng = rng_stream(o->seed, (uint64_t)(kStreamTokens + r->rank));
  fill_normal(&rng, r->x, r->tokens * d, 1.0);
  {
    int64_t t, i, j;
    for (t = 0; t < r->tokens; ++t) {
      for (i = 0; i < d; ++i) {
        double sum = 0.0;
        for (j = 0; j < d; ++j) sum += (double)r->m_target[i * d + j] * r->x[t * d + j];
        r->target[t * d + i] = (float)sum;
      }
    }
  }

  /* Everything that depends only on T_r is sized once. */
  TRY(r->rank, moeblaze_ep_layer_exchange_size(r->layer, &r->exchange_bytes));
  TRY(r->rank, moeblaze_ep_layer_saved_size(r->layer, MOEBLAZE_EP_SAVED_HOME, r->tokens, 0,
                                            &r->home_saved_bytes));
  TRY(r->rank, moeblaze_ep_layer_workspace_size(r->layer, MOEBLAZE_EP_PASS_FORWARD_BEGIN, r->tokens,
                                                0, &r->begin_workspace_bytes));
  r->exchange = xmalloc(r->exchange_bytes);
  r->home_saved = xmalloc(r->home_saved_bytes);
  r->begin_workspace = xmalloc(r->begin_workspace_bytes);
  return 1;
}

static void rank_release_step(rank_t* r) {
  free(r->expert_saved);
  free(r->workspace);
  r->expert_saved = NULL;
  r->workspace = NULL;
}

/* One forward of the world, this rank's part. Collective: every rank calls it, in step. */
static int rank_forward(rank_t* r) {
  moeblaze_ep_forward_args_t args;
  size_t finish_bytes = 0, backward_bytes = 0;

  TRY(r->rank, moeblaze_ep_forward_args_init(&args, sizeof args));
  args.num_tokens = r->tokens;
  args.x = r->x;
  args.w_router = r->w_router;
  args.w_gate = r->w_gate;
  args.w_up = r->w_up;
  args.w_down = r->w_down;
  args.y = r->y;
  args.losses = r->losses;
  args.home_saved = r->home_saved;
  args.home_saved_bytes = r->home_saved_bytes;
  args.workspace = r->begin_workspace;
  args.workspace_bytes = r->begin_workspace_bytes;

  /* Phase 1: the router picks every token's experts, and the ranks exchange how many rows each
   * will send to each expert. Those counts were computed on the device, but the exchange of the
   * rows needs them on the HOST (NCCL's send/recv take host sizes), and so does the caller, to
   * size the receive side. So begin copies the count table into `exchange` and waits for it:
   * this is the one host synchronisation of an EP step. Nothing after it waits. */
  TRY(r->rank, moeblaze_ep_forward_begin(r->layer, &args, r->exchange, r->exchange_bytes,
                                         &r->recv_rows, NULL));

  /* Now the receive side has an exact size: the EXPERT saved buffer (the rows that arrive, their
   * routing weights and the local experts' activations, which backward needs) and the
   * workspaces. That is why there are two saved buffers: HOME had to exist before begin (begin
   * writes it), EXPERT can only be sized after it. One buffer would have to assume the worst case
   * of recv_rows <= W·T·min(k, E_r), which is what the two phases avoid. */
  TRY(r->rank, moeblaze_ep_layer_saved_size(r->layer, MOEBLAZE_EP_SAVED_EXPERT, r->tokens,
                                            r->recv_rows, &r->expert_saved_bytes));
  TRY(r->rank, moeblaze_ep_layer_workspace_size(r->layer, MOEBLAZE_EP_PASS_FORWARD_FINISH,
                                                r->tokens, r->recv_rows, &finish_bytes));
  TRY(r->rank, moeblaze_ep_layer_workspace_size(r->layer, MOEBLAZE_EP_PASS_BACKWARD, r->tokens,
                                                r->recv_rows, &backward_bytes));
  r->workspace_bytes = finish_bytes > backward_bytes ? finish_bytes : backward_bytes;
  r->expert_saved = xmalloc(r->expert_saved_bytes);
  r->workspace = xmalloc(r->workspace_bytes);
  args.expert_saved = r->expert_saved;
  args.expert_saved_bytes = r->expert_saved_bytes;
  args.workspace = r->workspace;
  args.workspace_bytes = r->workspace_bytes;

  /* Phase 2: rows (with their g) travel to the experts' ranks, this rank's experts run on what it
   * received, results travel back and are summed per token into y. */
  TRY(r->rank, moeblaze_ep_forward_finish(r->layer, &args, r->exchange, r->exchange_bytes, NULL));
  return 1;
}

/* This rank's share of the objective, and dL/dy of its tokens. */
static double rank_loss(rank_t* r) {
  const int64_t n = r->tokens * r->world->o->d_model;
  const double scale = 1.0 / (double)r->world->global_tokens;
  double sum = 0.0;
  int64_t i;
  for (i = 0; i < n; ++i) {
    const double diff = (double)r->y[i] - r->target[i];
    sum += diff * diff;
    r->dy[i] = (float)(diff * scale);
  }
  return 0.5 * sum * scale + r->losses[0] + r->losses[1];
}

/* Collective. Uses the saved buffers and `exchange` of the last rank_forward(): the sizes of its
 * exchanges are the forward's, read from `exchange`, so backward never waits for the host. */
static int rank_backward(rank_t* r) {
  moeblaze_ep_backward_args_t args;
  TRY(r->rank, moeblaze_ep_backward_args_init(&args, sizeof args));
  args.num_tokens = r->tokens;
  args.dy = r->dy;
  args.d_losses = NULL; /* {1, 1}: the loss shares are part of the objective as returned */
  args.x = r->x;
  args.w_router = r->w_router;
  args.w_gate = r->w_gate;
  args.w_up = r->w_up;
  args.w_down = r->w_down;
  args.home_saved = r->home_saved;
  args.home_saved_bytes = r->home_saved_bytes;
  args.expert_saved = r->expert_saved;
  args.expert_saved_bytes = r->expert_saved_bytes;
  args.dx = NULL; /* x is data, not a parameter */
  args.dw_router = r->dw_router;
  args.dw_gate = r->dw_gate;
  args.dw_up = r->dw_up;
  args.dw_down = r->dw_down;
  args.workspace = r->workspace;
  args.workspace_bytes = r->workspace_bytes;
  TRY(r->rank, moeblaze_ep_backward(r->layer, &args, r->exchange, r->exchange_bytes, NULL));
  return 1;
}

static void sgd(float* w, const float* grad, int64_t count, double lr) {
  int64_t i;
  for (i = 0; i < count; ++i) w[i] = (float)(w[i] - lr * grad[i]);
}

/* Prints the world's loss and each rank's share; returns the world's loss. */
static double print_step(const world_t* w, const char* label) {
  double total = 0.0;
  int32_t q;
  for (q = 0; q < w->o->world_size; ++q) total += w->step_loss[q];
  printf("%s  world loss %.6f  =", label, total);
  for (q = 0; q < w->o->world_size; ++q) {
    printf("%s rank %d %.6f (%ld rows in)", q ? " +" : "", (int)q, w->step_loss[q],
           (long)w->step_recv_rows[q]);
  }
  printf("\n");
  return total;
}

static int rank_train(rank_t* r) {
  world_t* w = r->world;
  const options_t* o = w->o;
  const int64_t E = o->experts, d = o->d_model, h = o->d_ffn;
  const int64_t local_experts = r->expert_end - r->expert_begin;
  const int32_t me = r->rank;
  int step;

  for (step = 1; step <= o->steps; ++step) {
    char label[32];
    int64_t i;
    int32_t q;
    if (!rank_forward(r)) return 0;
    w->step_loss[me] = rank_loss(r);
    w->step_recv_rows[me] = r->recv_rows;
    if (!rank_backward(r)) return 0;
    /* The receive side changes size from step to step. On a GPU, allocate from a caching
     * allocator, or once for the bound recv_rows <= W * max T_r * min(k, E_r). */
    rank_release_step(r);

    /* The router is replicated, so its gradient is the SUM of the ranks' shares (what an all-reduce
     * does). Summed here in rank order, the same order on every rank: every replica receives the
     * same bits and the replicas never drift apart. dw_gate/up/down need no reduction: the
     * exchange already brought every rank's rows to the expert's owner. */
    memcpy(w->router_shares + me * E * d, r->dw_router, sizeof(float) * (size_t)(E * d));
    if (!world_sync(w)) return 0; /* all shares and losses are published */
    for (i = 0; i < E * d; ++i) {
      double sum = 0.0;
      for (q = 0; q < o->world_size; ++q) sum += w->router_shares[q * E * d + i];
      r->dw_router[i] = (float)sum;
    }
    if (me == 0) {
      double total;
      snprintf(label, sizeof label, "step %2d", step);
      total = print_step(w, label);
      if (step == 1) w->first_loss = total;
    }
    if (!world_sync(w)) return 0; /* everyone has read them before the next step overwrites them */

    sgd(r->w_router, r->dw_router, E * d, o->lr);
    sgd(r->w_gate, r->dw_gate, local_experts * h * d, o->lr);
    sgd(r->w_up, r->dw_up, local_experts * h * d, o->lr);
    sgd(r->w_down, r->dw_down, local_experts * d * h, o->lr);
  }

  /* Inference with the trained weights, the result main() checks. Both saved buffers are still
   * required (begin and finish write them) but could be freed right after finish. */
  if (!rank_forward(r)) return 0;
  w->step_loss[me] = rank_loss(r);
  w->step_recv_rows[me] = r->recv_rows;
  rank_release_step(r);
  if (!world_sync(w)) return 0;
  if (me == 0) print_step(w, "final  ");
  return 1;
}

static int rank_destroy_handles(rank_t* r) {
  TRY(r->rank, moeblaze_ep_layer_destroy(r->layer)); /* NULL is a no-op */
  TRY(r->rank, moeblaze_context_destroy(r->context));
  return 1;
}

static void* rank_main(void* arg) {
  rank_t* r = (rank_t*)arg;
  world_t* w = r->world;
  r->ok = rank_setup(r);
  if (r->ok && world_sync(w) && r->rank == 0) {
    int32_t q;
    for (q = 0; q < w->o->world_size; ++q) {
      const rank_t* p = &w->ranks[q];
      printf(
          "rank %d: experts [%ld, %ld) of %ld, %ld tokens, home saved %zu bytes, exchange %zu "
          "bytes\n",
          (int)q, (long)p->expert_begin, (long)p->expert_end, (long)w->o->experts, (long)p->tokens,
          p->home_saved_bytes, p->exchange_bytes);
    }
  }
  /* The first sync: every rank's setup is done before rank 0 reads it; the second: rank 0 has
   * printed before step 1 prints. */
  r->ok = r->ok && world_sync(w) && rank_train(r);
  if (!r->ok) world_fail(w);
  /* The layer and the context belong to this rank; the host arrays stay for main() to check. */
  free(r->exchange);
  free(r->home_saved);
  free(r->begin_workspace);
  rank_release_step(r);
  if (!rank_destroy_handles(r)) r->ok = 0;
  return NULL;
}

static void rank_free(rank_t* r) {
  float* arrays[] = {r->w_router, r->w_gate, r->w_up,    r->w_down,   r->dw_router,
                     r->dw_gate,  r->dw_up,  r->dw_down, r->m_target, r->x,
                     r->target,   r->y,      r->dy};
  size_t i;
  for (i = 0; i < sizeof arrays / sizeof arrays[0]; ++i) free(arrays[i]);
}

/* ---- the check: the world against one device ----------------------------------------------------
 *
 * What the design guarantees (docs/design/expert-parallel.md, section 5): an exchange only moves
 * bytes, every expert sees its rows in ascending global token order, and the home rank sums a
 * token's k expert outputs in the one-device order. So in F32 and F64, y, dg and the expert weight
 * gradients dw_gate/up/down are BITWISE the one-device layer's on the global batch. Equal only
 * within rounding (another summation grouping, still deterministic run to run): dx, the sum of
 * the ranks' dw_router shares and the sum of the loss shares. In BF16/F16 y is within one extra
 * rounding (each expert row is rounded before it travels home).
 *
 * That is also why the reference is a forward with the world's trained weights and not a second,
 * one-device training run: the summed router gradient differs from the one-device one in the last
 * bits, so the two trajectories would drift apart by rounding. */

/* The one-device layer: its own context and plan, freed by reference_free() whatever happened. */
typedef struct reference {
  moeblaze_context_t context;
  moeblaze_layer_t layer;
  void* workspace;
} reference_t;

static int reference_forward(reference_t* ref, const options_t* o, int64_t T, const float* x,
                             const float* w_router, const float* w_gate, const float* w_up,
                             const float* w_down, float* y, float* losses) {
  moeblaze_layer_config_t config;
  moeblaze_forward_args_t args;
  size_t workspace_bytes = 0;
  if (!make_config(-1, o, &config)) return 0;
  TRY(-1, moeblaze_context_create(&ref->context, MOEBLAZE_BACKEND_CPU, 0));
  TRY(-1, moeblaze_context_set_num_threads(ref->context, o->threads));
  TRY(-1, moeblaze_layer_create(&ref->layer, ref->context, &config));
  TRY(-1,
      moeblaze_layer_workspace_size(ref->layer, MOEBLAZE_PASS_LAYER_FORWARD, T, &workspace_bytes));
  ref->workspace = xmalloc(workspace_bytes);
  TRY(-1, moeblaze_forward_args_init(&args, sizeof args));
  args.num_tokens = T;
  args.x = x;
  args.w_router = w_router;
  args.w_gate = w_gate;
  args.w_up = w_up;
  args.w_down = w_down;
  args.y = y;
  args.losses = losses; /* the global-batch {aux, z} */
  args.saved = NULL;    /* inference: no backward follows */
  args.workspace = ref->workspace;
  args.workspace_bytes = workspace_bytes;
  TRY(-1, moeblaze_layer_forward(ref->layer, &args, NULL));
  return 1;
}

static int reference_free(reference_t* ref) {
  free(ref->workspace);
  TRY(-1, moeblaze_layer_destroy(ref->layer)); /* NULL is a no-op */
  TRY(-1, moeblaze_context_destroy(ref->context));
  return 1;
}

static int check_against_one_device(const world_t* w, double first_loss) {
  const options_t* o = w->o;
  const int64_t E = o->experts, d = o->d_model, h = o->d_ffn, T = w->global_tokens;
  float* x = floats(T * d);
  float* target = floats(T * d);
  float* y_world = floats(T * d);
  float* y_ref = floats(T * d);
  float* w_gate = floats(E * h * d);
  float* w_up = floats(E * h * d);
  float* w_down = floats(E * d * h);
  float losses_ref[2] = {0.0f, 0.0f};
  reference_t ref = {NULL, NULL, NULL};
  int64_t token_at = 0, expert_at = 0, i;
  int32_t q;
  int ok = 1;

  /* The global batch is every rank's tokens in rank order. Experts are contiguous over ranks, so
   * the ranks' expert slices in rank order ARE the full weights. */
  for (q = 0; q < o->world_size; ++q) {
    const rank_t* p = &w->ranks[q];
    const int64_t local_experts = p->expert_end - p->expert_begin;
    const size_t token_bytes = sizeof(float) * (size_t)(p->tokens * d);
    const size_t expert_bytes = sizeof(float) * (size_t)(local_experts * h * d);
    memcpy(x + token_at * d, p->x, token_bytes);
    memcpy(target + token_at * d, p->target, token_bytes);
    memcpy(y_world + token_at * d, p->y, token_bytes);
    memcpy(w_gate + expert_at * h * d, p->w_gate, expert_bytes);
    memcpy(w_up + expert_at * h * d, p->w_up, expert_bytes);
    memcpy(w_down + expert_at * d * h, p->w_down, expert_bytes);
    token_at += p->tokens;
    expert_at += local_experts;
  }

  /* The replicas of the router must be the same bits on every rank (see rank_train). */
  for (q = 1; q < o->world_size; ++q) {
    if (memcmp(w->ranks[q].w_router, w->ranks[0].w_router, sizeof(float) * (size_t)(E * d)) != 0) {
      printf("FAIL: rank %d's router replica differs from rank 0's\n", (int)q);
      ok = 0;
    }
  }

  if (!reference_forward(&ref, o, T, x, w->ranks[0].w_router, w_gate, w_up, w_down, y_ref,
                         losses_ref)) {
    ok = 0;
  } else {
    const int bitwise = memcmp(y_world, y_ref, sizeof(float) * (size_t)(T * d)) == 0;
    double max_ref = 0.0, max_diff = 0.0, aux_world = 0.0, loss_world = 0.0, sum = 0.0;
    double loss_ref, y_tolerance, aux_tolerance, loss_tolerance;
    for (i = 0; i < T * d; ++i) {
      const double diff = fabs((double)y_world[i] - y_ref[i]);
      const double error = (double)y_ref[i] - target[i];
      if (fabs(y_ref[i]) > max_ref) max_ref = fabs(y_ref[i]);
      if (diff > max_diff || diff != diff) max_diff = diff; /* a NaN sticks: never passes */
      sum += error * error;
    }
    for (q = 0; q < o->world_size; ++q) {
      aux_world += w->ranks[q].losses[0];
      loss_world += w->step_loss[q];
    }
    loss_ref = 0.5 * sum / (double)T + losses_ref[0] + losses_ref[1];
    /* y: bitwise by design here (F32, CPU); the check allows a few ulps of the largest value all
     * the same, so that it tests agreement rather than one particular summation order (other
     * backends may fuse differently). The losses are sums of shares: within rounding only. */
    y_tolerance = 1e-5 * (max_ref > 1.0 ? max_ref : 1.0);
    aux_tolerance = 1e-5 * (fabs(losses_ref[0]) > 1e-3 ? fabs(losses_ref[0]) : 1e-3);
    loss_tolerance = 1e-5 * (loss_ref > 1.0 ? loss_ref : 1.0);
    printf(
        "y, world vs one device on the global batch (%ld tokens): max |diff| %.3g (tolerance "
        "%.3g), bitwise identical: %s\n",
        (long)T, max_diff, y_tolerance, bitwise ? "yes" : "no");
    printf("aux loss: sum of the ranks' shares %.9f, one device %.9f\n", aux_world,
           (double)losses_ref[0]);
    printf("loss: world %.9f, one device %.9f\n", loss_world, loss_ref);
    if (!(max_diff <= y_tolerance) || !(fabs(aux_world - losses_ref[0]) <= aux_tolerance) ||
        !(fabs(loss_world - loss_ref) <= loss_tolerance)) {
      printf("FAIL: the world disagrees with the one-device layer\n");
      ok = 0;
    }
    if (!(loss_world < first_loss)) {
      printf("FAIL: the loss did not fall (step 1: %.6f, final: %.6f)\n", first_loss, loss_world);
      ok = 0;
    }
  }
  if (!reference_free(&ref)) ok = 0;
  free(x);
  free(target);
  free(y_world);
  free(y_ref);
  free(w_gate);
  free(w_up);
  free(w_down);
  return ok;
}

int main(int argc, char** argv) {
  options_t o;
  world_t world;
  rank_t* ranks;
  pthread_t* threads;
  double final_loss = 0.0;
  int32_t q;
  int ok = 1, started = 0;

  if (!parse_options(argc, argv, &o)) {
    usage(argv[0]);
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0); /* progress lines interleave correctly with errors */
  printf("moeblaze %s\n", moeblaze_get_build_info());
  printf(
      "task: y -> M x with SGD; W=%d ranks (LOCAL transport, one thread and one CPU context "
      "each), E=%ld experts, k=%ld, d=%ld, h=%ld, SwiGLU F32, tokens %ld + 4*rank per rank, "
      "lr %g, aux coeff %g, %d steps, seed %llu\n",
      (int)o.world_size, (long)o.experts, (long)o.top_k, (long)o.d_model, (long)o.d_ffn,
      (long)o.tokens, o.lr, o.aux_coeff, o.steps, (unsigned long long)o.seed);

  memset(&world, 0, sizeof world);
  world.o = &o;
  for (q = 0; q < o.world_size; ++q) world.global_tokens += rank_tokens(&o, q);
  pthread_mutex_init(&world.mutex, NULL);
  pthread_cond_init(&world.cond, NULL);
  world.router_shares = floats((int64_t)o.world_size * o.experts * o.d_model);
  world.step_loss = (double*)xmalloc(sizeof(double) * (size_t)o.world_size);
  world.step_recv_rows = (int64_t*)xmalloc(sizeof(int64_t) * (size_t)o.world_size);
  ranks = (rank_t*)xmalloc(sizeof(rank_t) * (size_t)o.world_size);
  threads = (pthread_t*)xmalloc(sizeof(pthread_t) * (size_t)o.world_size);
  memset(ranks, 0, sizeof(rank_t) * (size_t)o.world_size);
  world.ranks = ranks;

  /* The group is the rendezvous of the LOCAL transport; with NCCL this is ncclCommInitRank. */
  {
    const moeblaze_status_t status = moeblaze_ep_local_group_create(&world.group, o.world_size);
    if (status != MOEBLAZE_OK) {
      report_failure(-1, __LINE__, "moeblaze_ep_local_group_create", status);
      ok = 0;
    }
  }
  for (q = 0; ok && q < o.world_size; ++q) {
    ranks[q].world = &world;
    ranks[q].rank = q;
    if (pthread_create(&threads[q], NULL, rank_main, &ranks[q]) != 0) {
      fprintf(stderr, "pthread_create failed for rank %d\n", (int)q);
      world_fail(&world);
      ok = 0;
      break;
    }
    ++started;
  }
  for (q = 0; q < started; ++q) {
    pthread_join(threads[q], NULL);
    ok = ok && ranks[q].ok;
  }
  /* Layers keep their group alive; this releases the program's own handle. */
  if (world.group != NULL) {
    const moeblaze_status_t status = moeblaze_ep_local_group_destroy(world.group);
    if (status != MOEBLAZE_OK) {
      report_failure(-1, __LINE__, "moeblaze_ep_local_group_destroy", status);
      ok = 0;
    }
  }

  if (ok) {
    for (q = 0; q < o.world_size; ++q) final_loss += world.step_loss[q];
    ok = check_against_one_device(&world, world.first_loss);
  }

  for (q = 0; q < o.world_size; ++q) rank_free(&ranks[q]);
  free(ranks);
  free(threads);
  free(world.router_shares);
  free(world.step_loss);
  free(world.step_recv_rows);
  pthread_mutex_destroy(&world.mutex);
  pthread_cond_destroy(&world.cond);
  if (!ok) {
    printf("FAIL\n");
    return 1;
  }
  printf("OK: the world equals the one-device layer (final loss %.6f)\n", final_loss);
  return 0;
}
