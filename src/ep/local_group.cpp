#include "ep/local_group.hpp"

#include <chrono>
#include <cstring>

#include "common/status.hpp"

namespace moeblaze {
namespace ep {

LocalGroupState::LocalGroupState(int32_t world_size)
    : world_size_(world_size), postings_(size_t(world_size)) {}

void LocalGroupState::check_backend(int32_t backend_kind, int32_t rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (backend_kind_ == 0) backend_kind_ = backend_kind;
  MB_REQUIRE_ARG(backend_kind_ == backend_kind,
                 "ep_config->communicator: this LOCAL group already has layers on backend %d, "
                 "but rank %d's context uses backend %d (one group, one backend)",
                 int(backend_kind_), int(rank), int(backend_kind));
}

void LocalGroupState::abandon(int32_t rank, moeblaze_status_t status, const char* reason) {
  if (world_size_ == 1) return;  // nobody waits for a group of one
  std::lock_guard<std::mutex> lock(mutex_);
  if (broken_) return;
  broken_ = true;
  broken_status_ = status;
  broken_reason_ = format("rank %d's call failed outside an exchange: %s", int(rank), reason);
  arrived_.notify_all();
}

void LocalGroupState::barrier(std::unique_lock<std::mutex>& lock, int32_t rank, const char* step,
                              bool reset_collected) {
  MB_REQUIRE(!broken_, broken_status_, "LOCAL group is unusable: %s", broken_reason_.c_str());
  const uint64_t generation = generation_;
  if (++waiting_ == world_size_) {
    waiting_ = 0;
    ++generation_;
    if (reset_collected) {
      collected_status_ = MOEBLAZE_OK;
      collected_error_.clear();
    }
    arrived_.notify_all();
    return;
  }
  const bool arrived = arrived_.wait_for(lock, std::chrono::seconds(kLocalGroupTimeoutSeconds),
                                         [&] { return generation_ != generation || broken_; });
  if (broken_ && generation_ == generation) {
    fail(broken_status_, "LOCAL group is unusable: %s", broken_reason_.c_str());
  }
  if (!arrived) {
    broken_ = true;
    broken_status_ = MOEBLAZE_ERR_INTERNAL;
    broken_reason_ = format(
        "rank %d waited %d s in '%s' for the other ranks (a rank did not make the same collective "
        "call)",
        int(rank), kLocalGroupTimeoutSeconds, step);
    arrived_.notify_all();
    fail(MOEBLAZE_ERR_INTERNAL, "%s", broken_reason_.c_str());
  }
}

void LocalGroupState::exchange(int32_t rank, Backend& backend, const ExchangeTensor* tensors,
                               size_t count, const char* step, uint64_t layer_tag, void* stream) {
  backend.synchronize(stream);  // the send data must be complete before another rank reads it
  uint64_t generation = 0;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    MB_REQUIRE(!broken_, broken_status_, "LOCAL group is unusable: %s", broken_reason_.c_str());
    generation = generation_;
    if (postings_[size_t(rank)].generation == generation) {
      broken_ = true;
      broken_status_ = MOEBLAZE_ERR_INVALID_ARGUMENT;
      broken_reason_ = format(
          "two calls claimed rank %d in '%s' at once (two layers or threads on one rank of the "
          "group)",
          int(rank), step);
      arrived_.notify_all();
      fail(MOEBLAZE_ERR_INVALID_ARGUMENT, "%s", broken_reason_.c_str());
    }
    postings_[size_t(rank)] = Posting{tensors, count, step, layer_tag, generation};
    barrier(lock, rank, step, true);
  }

  // Every rank has published its sends and waits for the second barrier: read them.
  moeblaze_status_t status = MOEBLAZE_OK;
  std::string error;
  try {
    for (int32_t source = 0; source < world_size_; ++source) {
      const Posting& theirs = postings_[size_t(source)];
      MB_REQUIRE(theirs.generation == generation, MOEBLAZE_ERR_INTERNAL,
                 "'%s': rank %d's posting is not of this exchange", step, int(source));
      MB_REQUIRE_ARG(std::strcmp(theirs.step, step) == 0 && theirs.layer_tag == layer_tag &&
                         theirs.count == count,
                     "collective mismatch: rank %d is in '%s' (layer tag %016llx), rank %d in "
                     "'%s' (layer tag %016llx); every rank must make the same EP calls in the "
                     "same order",
                     int(rank), step, (unsigned long long)layer_tag, int(source), theirs.step,
                     (unsigned long long)theirs.layer_tag);
    }
    for (int32_t source = 0; source < world_size_; ++source) {
      const Posting& theirs = postings_[size_t(source)];
      for (size_t i = 0; i < count; ++i) {
        const ExchangeTensor& mine = tensors[i];
        const ExchangeTensor& sent = theirs.tensors[i];
        const size_t bytes = mine.recv_bytes[size_t(source)];
        MB_REQUIRE(sent.send_bytes[size_t(rank)] == bytes, MOEBLAZE_ERR_INTERNAL,
                   "'%s': rank %d sends %zu bytes to rank %d, which expects %zu", step, int(source),
                   sent.send_bytes[size_t(rank)], int(rank), bytes);
        if (bytes == 0) continue;
        backend.copy_between_ranks(
            static_cast<unsigned char*>(mine.recv) + mine.recv_offset[size_t(source)],
            static_cast<const unsigned char*>(sent.send) + sent.send_offset[size_t(rank)], bytes);
      }
    }
  } catch (const Error& e) {
    status = e.status();
    error = e.what();
  } catch (const std::exception& e) {
    status = MOEBLAZE_ERR_INTERNAL;
    error = e.what();
  }

  std::unique_lock<std::mutex> lock(mutex_);
  if (status != MOEBLAZE_OK && collected_status_ == MOEBLAZE_OK) {
    collected_status_ = status;
    collected_error_ = format("rank %d: %s", int(rank), error.c_str());
  }
  barrier(lock, rank, step, false);
  // collected_* stay as they are until every rank has passed the next exchange's first barrier.
  if (collected_status_ != MOEBLAZE_OK) {
    fail(collected_status_, "LOCAL exchange '%s' failed on %s", step, collected_error_.c_str());
  }
}

namespace {

class LocalTransport final : public Transport {
 public:
  LocalTransport(std::shared_ptr<LocalGroupState> group, int32_t rank, Backend& backend)
      : group_(std::move(group)), rank_(rank), backend_(backend) {}

  void exchange(const ExchangeTensor* tensors, size_t count, const char* step, uint64_t layer_tag,
                void* stream) override {
    exchange_failed_ = true;  // until it returns: its failure is every rank's, already reported
    group_->exchange(rank_, backend_, tensors, count, step, layer_tag, stream);
    exchange_failed_ = false;
  }

  void begin_call() override { exchange_failed_ = false; }

  void abandon(moeblaze_status_t status, const char* reason) override {
    if (!exchange_failed_) group_->abandon(rank_, status, reason);
  }

 private:
  bool exchange_failed_ = false;
  std::shared_ptr<LocalGroupState> group_;
  int32_t rank_;
  Backend& backend_;
};

}  // namespace

std::unique_ptr<Transport> make_local_transport(std::shared_ptr<LocalGroupState> group,
                                                int32_t rank, Backend& backend) {
  return std::make_unique<LocalTransport>(std::move(group), rank, backend);
}

}  // namespace ep
}  // namespace moeblaze
