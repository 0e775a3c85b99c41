/* The CPU backend of any build (CUDA included) runs without the CUDA libraries: a forward and a
 * backward on a CPU context, then the process's mappings must show no cuBLAS and no CUDA runtime
 * library (the CUDA backend loads cuBLASLt only when a CUDA context is created). CTest runs it
 * with LD_LIBRARY_PATH pointing nowhere. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moeblaze.h"

#define CHECK(call)                                                                       \
  do {                                                                                    \
    moeblaze_status_t status_ = (call);                                                   \
    if (status_ != MOEBLAZE_OK) {                                                         \
      fprintf(stderr, "%s failed: %s\n", #call, moeblaze_last_error());                   \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

static void* zeroed(size_t bytes) {
  void* p = NULL;
  if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) return NULL;
  memset(p, 0, bytes ? bytes : 64);
  return p;
}

int main(void) {
  enum { T = 4, D = 8, H = 8, E = 4, K = 2 };
  moeblaze_context_t context = NULL;
  moeblaze_layer_t layer = NULL;
  moeblaze_layer_config_t config;
  moeblaze_forward_args_t fa;
  moeblaze_backward_args_t ba;
  size_t saved_bytes = 0, fwd_ws = 0, bwd_ws = 0;
  float *x, *w_router, *w_gate, *w_up, *w_down, *y, *dx;
  void *saved, *ws_f, *ws_b;
  int i;
  FILE* maps;
  char line[4096];
  int found = 0;

  CHECK(moeblaze_context_create(&context, MOEBLAZE_BACKEND_CPU, 0));
  CHECK(moeblaze_layer_config_init(&config, sizeof config));
  config.dtype = MOEBLAZE_DTYPE_F32;
  config.d_model = D;
  config.d_ffn = H;
  config.num_experts = E;
  config.top_k = K;
  CHECK(moeblaze_layer_create(&layer, context, &config));
  CHECK(moeblaze_layer_saved_size(layer, MOEBLAZE_PASS_LAYER_FORWARD, T, &saved_bytes));
  CHECK(moeblaze_layer_workspace_size(layer, MOEBLAZE_PASS_LAYER_FORWARD, T, &fwd_ws));
  CHECK(moeblaze_layer_workspace_size(layer, MOEBLAZE_PASS_LAYER_BACKWARD, T, &bwd_ws));
  x = zeroed(sizeof(float) * T * D);
  w_router = zeroed(sizeof(float) * E * D);
  w_gate = zeroed(sizeof(float) * E * H * D);
  w_up = zeroed(sizeof(float) * E * H * D);
  w_down = zeroed(sizeof(float) * E * D * H);
  y = zeroed(sizeof(float) * T * D);
  dx = zeroed(sizeof(float) * T * D);
  saved = zeroed(saved_bytes);
  ws_f = zeroed(fwd_ws);
  ws_b = zeroed(bwd_ws);
  for (i = 0; i < T * D; ++i) x[i] = (float)(i % 5) * 0.25f - 0.5f;
  for (i = 0; i < E * D; ++i) w_router[i] = (float)(i % 3) * 0.1f;
  for (i = 0; i < E * H * D; ++i) w_gate[i] = w_up[i] = w_down[i] = (float)(i % 7) * 0.05f;

  CHECK(moeblaze_forward_args_init(&fa, sizeof fa));
  fa.num_tokens = T;
  fa.x = x;
  fa.w_router = w_router;
  fa.w_gate = w_gate;
  fa.w_up = w_up;
  fa.w_down = w_down;
  fa.y = y;
  fa.saved = saved;
  fa.saved_bytes = saved_bytes;
  fa.workspace = ws_f;
  fa.workspace_bytes = fwd_ws;
  CHECK(moeblaze_layer_forward(layer, &fa, NULL));
  CHECK(moeblaze_backward_args_init(&ba, sizeof ba));
  ba.num_tokens = T;
  ba.dy = y;
  ba.x = x;
  ba.w_router = w_router;
  ba.w_gate = w_gate;
  ba.w_up = w_up;
  ba.w_down = w_down;
  ba.saved = saved;
  ba.saved_bytes = saved_bytes;
  ba.dx = dx;
  ba.workspace = ws_b;
  ba.workspace_bytes = bwd_ws;
  CHECK(moeblaze_layer_backward(layer, &ba, NULL));
  CHECK(moeblaze_layer_destroy(layer));
  CHECK(moeblaze_context_destroy(context));

  maps = fopen("/proc/self/maps", "r");
  if (maps == NULL) {
    printf("no /proc/self/maps: only the run itself was checked\n");
    return 0;
  }
  while (fgets(line, sizeof line, maps) != NULL) {
    if (strstr(line, "libcublas") != NULL || strstr(line, "libcudart") != NULL) {
      fprintf(stderr, "a CUDA library was loaded by a CPU-only run: %s", line);
      found = 1;
    }
  }
  fclose(maps);
  if (found) return 1;
  printf("CPU backend ran (%s); no cuBLAS or CUDA runtime library loaded\n",
         moeblaze_get_build_info());
  return 0;
}
