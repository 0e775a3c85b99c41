// MOEBLAZE_EP_TRANSPORT_NCCL: point-to-point ncclSend/ncclRecv inside one ncclGroupStart/End per
// exchange, on the caller's stream. Only point-to-point operations: NCCL never needs NVLink
// multicast (NVLS) for them, and this file never enables it. Compiled only with MOEBLAZE_NCCL.
//
// NCCL is not linked: libmoeblaze.so has no NEEDED libnccl.so.2 (it must load, CPU backend
// included, where NCCL is absent). The functions are resolved at the first layer creation with this
// transport (nccl_api.hpp), preferring the NCCL the process has already loaded (the framework's),
// because the communicator belongs to the library instance that created it: calling a second copy
// of NCCL with it would be undefined behaviour. MOEBLAZE_NCCL_LIBRARY=/path/to/libnccl.so.2
// overrides the search. No NCCL, or NCCL < 2.7: MOEBLAZE_ERR_NOT_SUPPORTED naming what was tried.
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "ep/nccl/nccl_api.hpp"
#include "ep/transport.hpp"

namespace moeblaze {
namespace ep {
namespace {

void check_nccl(const NcclApi& nccl, ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return;
  fail(MOEBLAZE_ERR_CUDA, "%s failed: %s (NCCL %d)", what, nccl.get_error_string(result),
       int(result));
}

// The resolved NCCL, or NOT_SUPPORTED with what was tried.
const NcclApi& require_nccl() {
  const NcclLoadResult& loaded = process_nccl_api();
  MB_REQUIRE(loaded.ok, MOEBLAZE_ERR_NOT_SUPPORTED, "MOEBLAZE_EP_TRANSPORT_NCCL: %s",
             loaded.error.c_str());
  return loaded.api;
}

void check_cuda(cudaError_t result, const char* what) {
  if (result == cudaSuccess) return;
  fail(MOEBLAZE_ERR_CUDA, "%s failed: %s", what, cudaGetErrorString(result));
}

class NcclTransport final : public Transport {
 public:
  NcclTransport(const NcclApi& nccl, ncclComm_t comm, int32_t rank, int32_t world_size,
                int32_t device)
      : nccl_(nccl), comm_(comm), rank_(rank), world_size_(world_size), device_(device) {}

  void exchange(const ExchangeTensor* tensors, size_t count, const char* step, uint64_t,
                void* stream_ptr) override {
    const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    int previous = 0;
    check_cuda(cudaGetDevice(&previous), "cudaGetDevice");
    if (previous != device_) check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    struct Restore {
      int device;
      int current;
      ~Restore() {
        if (device != current) cudaSetDevice(device);
      }
    } restore{previous, device_};

    // The own chunk never travels through NCCL: a device copy, skipped when already in place.
    for (size_t i = 0; i < count; ++i) {
      const ExchangeTensor& t = tensors[i];
      const size_t bytes = t.recv_bytes[size_t(rank_)];
      MB_REQUIRE(t.send_bytes[size_t(rank_)] == bytes, MOEBLAZE_ERR_INTERNAL,
                 "'%s': the own chunk is %zu bytes sent, %zu received", step,
                 t.send_bytes[size_t(rank_)], bytes);
      const unsigned char* src =
          static_cast<const unsigned char*>(t.send) + t.send_offset[size_t(rank_)];
      unsigned char* dst = static_cast<unsigned char*>(t.recv) + t.recv_offset[size_t(rank_)];
      if (bytes > 0 && src != dst) {
        check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
                   "cudaMemcpyAsync (EP own chunk)");
      }
    }
    if (world_size_ == 1) return;
    check_nccl(nccl_, nccl_.group_start(), "ncclGroupStart");
    try {
      for (size_t i = 0; i < count; ++i) {
        const ExchangeTensor& t = tensors[i];
        for (int32_t peer = 0; peer < world_size_; ++peer) {
          if (peer == rank_) continue;
          const size_t out = t.send_bytes[size_t(peer)];
          const size_t in = t.recv_bytes[size_t(peer)];
          if (out > 0) {
            check_nccl(
                nccl_,
                nccl_.send(static_cast<const unsigned char*>(t.send) + t.send_offset[size_t(peer)],
                           out, ncclUint8, peer, comm_, stream),
                "ncclSend");
          }
          if (in > 0) {
            check_nccl(nccl_,
                       nccl_.recv(static_cast<unsigned char*>(t.recv) + t.recv_offset[size_t(peer)],
                                  in, ncclUint8, peer, comm_, stream),
                       "ncclRecv");
          }
        }
      }
    } catch (...) {
      nccl_.group_end();
      throw;
    }
    check_nccl(nccl_, nccl_.group_end(), "ncclGroupEnd");
  }

 private:
  const NcclApi& nccl_;
  ncclComm_t comm_;
  int32_t rank_;
  int32_t world_size_;
  int32_t device_;
};

}  // namespace

bool nccl_transport_built() {
  return true;
}

std::unique_ptr<Transport> make_nccl_transport(void* comm_ptr, int32_t rank, int32_t world_size,
                                               int32_t device, Backend&) {
  const NcclApi& nccl = require_nccl();
  ncclComm_t comm = static_cast<ncclComm_t>(comm_ptr);
  int comm_rank = -1;
  int comm_size = -1;
  int comm_device = -1;
  check_nccl(nccl, nccl.comm_user_rank(comm, &comm_rank),
             "ncclCommUserRank (ep_config->communicator)");
  check_nccl(nccl, nccl.comm_count(comm, &comm_size), "ncclCommCount (ep_config->communicator)");
  check_nccl(nccl, nccl.comm_cu_device(comm, &comm_device),
             "ncclCommCuDevice (ep_config->communicator)");
  MB_REQUIRE_ARG(comm_rank == rank && comm_size == world_size,
                 "ep_config: rank = %d, world_size = %d, but the NCCL communicator is rank %d of "
                 "%d",
                 int(rank), int(world_size), comm_rank, comm_size);
  MB_REQUIRE_ARG(comm_device == device,
                 "ep_config->communicator is on CUDA device %d, the context on device %d",
                 comm_device, int(device));
  return std::make_unique<NcclTransport>(nccl, comm, rank, world_size, device);
}

}  // namespace ep
}  // namespace moeblaze
