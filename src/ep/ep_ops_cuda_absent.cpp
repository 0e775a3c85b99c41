// Without the CUDA backend there is no CUDA EpOps (no CUDA context can exist either).
#if !defined(MOEBLAZE_WITH_CUDA)
#include "common/status.hpp"
#include "ep/ep_ops.hpp"

namespace moeblaze {
namespace ep {

std::unique_ptr<EpOps> make_cuda_ep_ops(int32_t) {
  fail(MOEBLAZE_ERR_NOT_SUPPORTED, "expert parallelism on CUDA: the CUDA backend is not built");
}

}  // namespace ep
}  // namespace moeblaze
#endif
