// Without MOEBLAZE_NCCL the NCCL transport does not exist; the entry points stay (the header and
// the bindings do not change with the build) and report NOT_SUPPORTED.
#if !defined(MOEBLAZE_WITH_NCCL)
#include "common/status.hpp"
#include "ep/transport.hpp"

namespace moeblaze {
namespace ep {

bool nccl_transport_built() {
  return false;
}

std::unique_ptr<Transport> make_nccl_transport(void*, int32_t, int32_t, int32_t, Backend&) {
  fail(MOEBLAZE_ERR_NOT_SUPPORTED,
       "MOEBLAZE_EP_TRANSPORT_NCCL: this libmoeblaze was built without NCCL (configure the CUDA "
       "backend with -DMOEBLAZE_NCCL=ON or AUTO where nccl.h is found, e.g. NCCL_HOME); "
       "MOEBLAZE_EP_TRANSPORT_LOCAL works in every build");
}

}  // namespace ep
}  // namespace moeblaze
#endif
