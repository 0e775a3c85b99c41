/* The public header must compile as strict C99 with every warning an error, and be idempotent
 * (included twice). Built with -std=c99 -pedantic -Wall -Wextra -Werror by
 * tests/abi/CMakeLists.txt. */
#include "moeblaze.h"

/* Uses a few declarations so that a header that compiles but declares the wrong types fails here.
 */
int moeblaze_abi_header_c99_probe(void);
int moeblaze_abi_header_c99_probe(void) {
  moeblaze_layer_config_t config;
  moeblaze_forward_args_t forward;
  moeblaze_backward_args_t backward;
  moeblaze_status_t (*create)(moeblaze_layer_t*, moeblaze_context_t,
                              const moeblaze_layer_config_t*) = moeblaze_layer_create;
  (void)create;
  config.struct_size = (uint32_t)sizeof config;
  forward.struct_size = (uint32_t)sizeof forward;
  backward.struct_size = (uint32_t)sizeof backward;
  return (int)(config.struct_size + forward.struct_size + backward.struct_size) + MOEBLAZE_VERSION +
         MOEBLAZE_ABI_VERSION + MOEBLAZE_OK + MOEBLAZE_DTYPE_BF16 + MOEBLAZE_MAX_EXPERTS +
         MOEBLAZE_MAX_TOP_K + (int)MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD;
}
