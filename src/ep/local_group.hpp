// The in-process group behind MOEBLAZE_EP_TRANSPORT_LOCAL: W ranks that are threads of one process
// rendezvous inside every exchange. Protocol of one exchange: every rank makes its send data ready
// (CUDA: synchronises its stream), publishes what it sends, and waits at a barrier; then every rank
// copies the chunks addressed to it out of the senders' buffers; a second barrier keeps the send
// buffers alive until every receiver is done. Each rank checks that the senders' sizes match its
// own receive sizes and that every rank is in the same collective; any failure fails the exchange
// on every rank. A barrier that waits more than kLocalGroupTimeoutSeconds breaks the group, and so
// does a second caller for a rank already inside the exchange (two layers, or two threads, claiming
// one rank): the barrier counts arrivals, so it would otherwise pass without that rank's real peer.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.hpp"
#include "ep/transport.hpp"

namespace moeblaze {
namespace ep {

constexpr int kLocalGroupTimeoutSeconds = 120;

class LocalGroupState {
 public:
  explicit LocalGroupState(int32_t world_size);

  int32_t world_size() const { return world_size_; }

  // Records the backend of rank `rank`'s layer; every layer on the group must use one backend kind.
  void check_backend(int32_t backend_kind, int32_t rank);

  // The exchange protocol above, for rank `rank`.
  void exchange(int32_t rank, Backend& backend, const ExchangeTensor* tensors, size_t count,
                const char* step, uint64_t layer_tag, void* stream);

  // Rank `rank`'s call failed with `status` outside an exchange (Transport::abandon): with more
  // than one rank the group breaks, and every rank's exchange then fails with that status and
  // the reason.
  void abandon(int32_t rank, moeblaze_status_t status, const char* reason);

 private:
  // Borrowed from the posting rank, which stays inside its exchange until the second barrier: no
  // copies, so that an exchange makes no heap allocation.
  // `generation`: the barrier generation it was posted in; a posting of another generation is
  // stale (its rank has left that exchange, its buffers may be gone) and never read.
  struct Posting {
    const ExchangeTensor* tensors = nullptr;
    size_t count = 0;
    const char* step = "";
    uint64_t layer_tag = 0;
    uint64_t generation = UINT64_MAX;
  };

  // Waits until all ranks arrive; with `reset_collected`, the last to arrive clears the collected
  // failure (under the lock) first. Throws (and breaks the group) on timeout.
  void barrier(std::unique_lock<std::mutex>& lock, int32_t rank, const char* step,
               bool reset_collected);

  const int32_t world_size_;
  std::mutex mutex_;
  std::condition_variable arrived_;
  int32_t waiting_ = 0;
  uint64_t generation_ = 0;
  bool broken_ = false;
  moeblaze_status_t broken_status_ = MOEBLAZE_ERR_INTERNAL;  // what a call on the broken group gets
  std::string broken_reason_;
  int32_t backend_kind_ = 0;
  std::vector<Posting> postings_;
  // The first failure of the exchange in progress, reported on every rank.
  moeblaze_status_t collected_status_ = MOEBLAZE_OK;
  std::string collected_error_;
};

}  // namespace ep
}  // namespace moeblaze
