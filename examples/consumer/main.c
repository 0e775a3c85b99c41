/* The smallest complete use of libmoeblaze: a CPU context, a layer, its size queries, one forward
 * pass, and the version. Built against the installed package by the `examples_consumer_*` tests.
 *
 * Copyright (c) 2026 the moeblaze authors. SPDX-License-Identifier: Apache-2.0 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <moeblaze.h>

#define CHECK(call)                                                                \
  do {                                                                             \
    moeblaze_status_t status_ = (call);                                            \
    if (status_ != MOEBLAZE_OK) {                                                  \
      fprintf(stderr, "%s failed: %s: %s\n", #call, moeblaze_status_name(status_), \
              moeblaze_last_error());                                              \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

enum { T = 16, D = 8, H = 16, E = 4, K = 2 };

int main(void) {
  static float x[T * D], w_router[E * D], w_gate[E * H * D], w_up[E * H * D], w_down[E * D * H];
  static float y[T * D];
  int32_t ids[T * K], counts[E];
  moeblaze_context_t context = NULL;
  moeblaze_layer_t layer = NULL;
  moeblaze_layer_config_t config;
  moeblaze_forward_args_t args;
  size_t saved_bytes = 0, workspace_bytes = 0, i;
  void *saved, *workspace;
  int32_t routed = 0;
  unsigned seed = 7;

  printf("moeblaze header %d.%d.%d, library %d (ABI %d): %s\n", MOEBLAZE_VERSION_MAJOR,
         MOEBLAZE_VERSION_MINOR, MOEBLAZE_VERSION_PATCH, (int)moeblaze_get_version(),
         (int)moeblaze_get_abi_version(), moeblaze_get_build_info());
  if (moeblaze_get_abi_version() != MOEBLAZE_ABI_VERSION) {
    fprintf(stderr, "ABI mismatch\n");
    return 1;
  }

  CHECK(moeblaze_context_create(&context, MOEBLAZE_BACKEND_CPU, 0));
  CHECK(moeblaze_layer_config_init(&config, sizeof config));
  config.dtype = MOEBLAZE_DTYPE_F32;
  config.d_model = D;
  config.d_ffn = H;
  config.num_experts = E;
  config.top_k = K;
  CHECK(moeblaze_layer_create(&layer, context, &config));

  CHECK(moeblaze_layer_saved_size(layer, MOEBLAZE_PASS_LAYER_FORWARD, T, &saved_bytes));
  CHECK(moeblaze_layer_workspace_size(layer, MOEBLAZE_PASS_LAYER_FORWARD, T, &workspace_bytes));
  printf("T=%d d=%d h=%d E=%d k=%d: saved %zu bytes, forward workspace %zu bytes\n", T, D, H, E, K,
         saved_bytes, workspace_bytes);

  /* A small deterministic generator keeps the example free of rand()'s platform differences. */
#define NEXT() ((float)((seed = seed * 1103515245u + 12345u) >> 9 & 0xffff) / 65536.0f - 0.5f)
  for (i = 0; i < T * D; ++i) x[i] = NEXT();
  for (i = 0; i < E * D; ++i) w_router[i] = NEXT();
  for (i = 0; i < E * H * D; ++i) w_gate[i] = NEXT(), w_up[i] = NEXT();
  for (i = 0; i < E * D * H; ++i) w_down[i] = NEXT();

  saved = malloc(saved_bytes ? saved_bytes : 1); /* malloc is 16-byte aligned on glibc */
  workspace = malloc(workspace_bytes ? workspace_bytes : 1);
  CHECK(moeblaze_forward_args_init(&args, sizeof args));
  args.num_tokens = T;
  args.x = x;
  args.w_router = w_router;
  args.w_gate = w_gate;
  args.w_up = w_up;
  args.w_down = w_down;
  args.y = y;
  args.ids_out = ids;
  args.expert_counts = counts;
  args.saved = saved;
  args.saved_bytes = saved_bytes;
  args.workspace = workspace;
  args.workspace_bytes = workspace_bytes;
  CHECK(moeblaze_layer_forward(layer, &args, NULL));

  for (i = 0; i < E; ++i) routed += counts[i];
  for (i = 0; i < T * D; ++i) {
    if (!isfinite(y[i])) {
      fprintf(stderr, "y[%zu] is not finite\n", i);
      return 1;
    }
  }
  printf("forward ok: y[0] = %g, token 0 -> experts %d and %d, %d routed rows\n", y[0], (int)ids[0],
         (int)ids[1], (int)routed);
  if (routed != T * K) {
    fprintf(stderr, "expert counts sum to %d, expected %d\n", (int)routed, T * K);
    return 1;
  }

  free(saved);
  free(workspace);
  CHECK(moeblaze_layer_destroy(layer));
  CHECK(moeblaze_context_destroy(context));
  return 0;
}
