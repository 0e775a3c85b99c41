// How the ranks of an expert-parallel layer exchange bytes: one variable-size all-to-all per call,
// possibly of several tensors at once (rows and their g). Sizes are host numbers, known on every
// rank from the count table; both sides of a pair agree on them by construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/backend.hpp"

namespace moeblaze {
namespace ep {

// One tensor of an exchange: the chunk for peer q is send[send_offset[q] .. + send_bytes[q]), the
// chunk from peer q lands at recv[recv_offset[q] .. + recv_bytes[q]). Offsets and sizes in bytes,
// one entry per rank. The chunk a rank sends itself is copied locally (skipped when it is already
// in place). The four arrays are borrowed (the EP layer's scratch, sized at creation): an exchange
// never allocates.
struct ExchangeTensor {
  const void* send = nullptr;
  void* recv = nullptr;
  const size_t* send_offset = nullptr;  // [W]
  const size_t* send_bytes = nullptr;   // [W]
  const size_t* recv_offset = nullptr;  // [W]
  const size_t* recv_bytes = nullptr;   // [W]
};

class Transport {
 public:
  virtual ~Transport() = default;
  // `step` names the collective ("forward: dispatch") for messages, and on the LOCAL transport
  // every rank's step and `layer_tag` must match (a mismatch is an error on every rank). Makes no
  // heap allocation (it is on the execute path), except to build an error message.
  virtual void exchange(const ExchangeTensor* tensors, size_t count, const char* step,
                        uint64_t layer_tag, void* stream) = 0;
  // Around one execute call: begin_call at its start; abandon when it fails, with its status and
  // message. A failure that this rank raised itself (not a failed exchange, which every rank
  // reports alike) leaves the other ranks waiting in a collective this rank will not make; the
  // LOCAL transport then breaks its group with the reason, so they fail at once instead of
  // waiting out the timeout. NCCL's collectives cannot be told: no-ops there.
  virtual void begin_call() {}
  virtual void abandon(moeblaze_status_t /*status*/, const char* /*reason*/) {}
};

class LocalGroupState;  // ep/local_group.hpp

std::unique_ptr<Transport> make_local_transport(std::shared_ptr<LocalGroupState> group,
                                                int32_t rank, Backend& backend);
// `comm` is an ncclComm_t. Throws Error(NOT_SUPPORTED) when the build has no NCCL. Checks that
// the communicator's rank and size are `rank` and `world_size`, and its device is `device`.
std::unique_ptr<Transport> make_nccl_transport(void* comm, int32_t rank, int32_t world_size,
                                               int32_t device, Backend& backend);
bool nccl_transport_built();

}  // namespace ep
}  // namespace moeblaze
