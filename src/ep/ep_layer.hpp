// One rank's expert-parallel plan: the global layer's router (replicated), this rank's experts run
// as a local layer (E_r experts, top_k = 1) on the rows the exchange brings, and the transport.
// The data flow is that of docs/design/expert-parallel.md, sections 2 and 3; the arithmetic is the
// backend's own (router projection, router, routing build, experts, and its row movement and loss
// shares), so that results equal the one-device layer on the global batch.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/backend.hpp"
#include "common/context.hpp"
#include "common/layer_desc.hpp"
#include "ep/local_group.hpp"
#include "ep/transport.hpp"

namespace moeblaze {
namespace ep {

// Host-side state of one step (the caller's `exchange` buffer): this header, then the count table.
struct ExchangeHeader {
  uint32_t magic;
  uint32_t state;  // kStepBegun or kStepFinished
  uint64_t layer_tag;
  int64_t num_tokens;
  int64_t recv_rows;
  int32_t rank;
  int32_t world_size;
  uint64_t step;  // the forward_begin that filled it (EpLayer::steps_begun_), also in HomeHeader
};
constexpr uint32_t kExchangeMagic = 0x5845424du;  // "MBEX" little-endian
constexpr uint32_t kStepBegun = 1;
constexpr uint32_t kStepFinished = 2;
constexpr size_t kExchangeTableOffset = 64;  // the table starts here, 8-byte aligned
static_assert(sizeof(ExchangeHeader) <= kExchangeTableOffset, "exchange header too large");

// First bytes of the HOME saved buffer: which layer, rank and step wrote it. The CPU layer checks
// it (and the indices after it) in finish and backward: the buffer is the caller's memory. The
// EXPERT saved buffer starts with the same header (ExpertHeader, kExpertMagic, the received rows
// R as num_tokens), checked in backward: a buffer of another step would give other gradients.
struct HomeHeader {
  uint32_t magic;    // kHomeMagic
  uint32_t version;  // MOEBLAZE_VERSION
  uint64_t layer_tag;
  uint64_t step;  // as ExchangeHeader::step
  int64_t num_tokens;
  int32_t rank;
  int32_t world_size;
};
constexpr uint32_t kHomeMagic = 0x4845424du;  // "MBEH" little-endian
using ExpertHeader = HomeHeader;
constexpr uint32_t kExpertMagic = 0x5245424du;  // "MBER" little-endian

enum class EpPass : int32_t { ForwardBegin = 0, ForwardFinish = 1, Backward = 2 };
enum class EpSaved : int32_t { Home = 0, Expert = 1 };

// Not immutable: the execute calls (forward_begin, forward_finish, backward) overwrite the
// layer's host scratch (the step's split sizes and exchange descriptors, sized at creation so that
// an execute call never allocates). They are collectives, so one layer never runs two at once.
class EpLayer {
 public:
  EpLayer(std::shared_ptr<ContextState> context, const LayerDesc& global_desc,
          int32_t transport_kind, int32_t rank, int32_t world_size, void* communicator,
          std::shared_ptr<LocalGroupState> group);

  int64_t expert_begin() const { return expert_begin_; }
  int64_t expert_end() const { return expert_end_; }
  int32_t rank() const { return rank_; }
  int32_t world_size() const { return world_size_; }
  const LayerDesc& global_desc() const { return global_desc_; }

  size_t exchange_size() const;
  // backward_flags (MOEBLAZE_BACKWARD_*): CONSUME_SAVED may shrink the backward's workspace.
  size_t workspace_size(EpPass pass, int64_t T, int64_t R, uint32_t backward_flags = 0) const;
  size_t saved_size(EpSaved part, int64_t T, int64_t R) const;

  // Largest rows this rank's experts can receive for `T` tokens on every rank: the limit of the
  // local layer's int32 row indices.
  void require_recv_rows(int64_t R, const char* argument) const;

  // Runs one execute call (`body` calls forward_begin, forward_finish or backward) so that a
  // failure of this rank's own is passed to the transport (Transport::abandon) before it is
  // rethrown: the other ranks must not wait for collectives this rank will not make.
  template <class Body>
  auto run_call(Body&& body) -> decltype(body()) {
    transport_->begin_call();
    try {
      return body();
    } catch (const Error& e) {
      transport_->abandon(e.status(), e.what());
      throw;
    }
  }

  int64_t forward_begin(const moeblaze_ep_forward_args_t& args, void* exchange,
                        size_t exchange_bytes, void* stream);
  void forward_finish(const moeblaze_ep_forward_args_t& args, void* exchange, size_t exchange_bytes,
                      void* stream);
  void backward(const moeblaze_ep_backward_args_t& args, const void* exchange,
                size_t exchange_bytes, void* stream);

 private:
  // The host sizes of one step, from the count table. Row counts per rank: this rank sends
  // send_rows[q] rows to rank q, starting at send_begin[q] of the send order; it receives
  // recv_rows[s] rows from rank s at recv_begin[s] of its received rows.
  struct Splits {
    std::vector<int64_t> send_rows, send_begin, recv_rows, recv_begin;  // [W] each
    int64_t total_recv = 0;
    int64_t global_tokens = 0;
  };
  // An exchange moves at most this many tensors at once (rows and their g).
  static constexpr size_t kMaxExchangeTensors = 2;

  // What forward_finish and backward take from the forward step before their own work: its
  // header, count table and R, then the views of its two saved buffers. Defined in ep_layer.cpp,
  // beside the buffer layouts.
  struct Step;
  // Fills splits_ from the count table.
  void compute_splits(const ExchangeHeader& header, const int32_t* table);
  // The step in `exchange`, for T tokens, as `call` expects it (`expected_state`). Its saved views
  // stay empty until open_step: each call checks its own tensors in between.
  Step read_step(const void* exchange, size_t exchange_bytes, int64_t T, uint32_t expected_state,
                 const char* call) const;
  // The count table of `exchange` as forward_begin wrote it for T tokens (else INVALID_ARGUMENT).
  void check_count_table(const Step& step, int64_t T) const;
  // The HOME saved buffer as forward_begin of this step wrote it (host memory only).
  void check_home_saved(const Step& step, int64_t T) const;
  // The EXPERT saved buffer's header as forward_finish of this step wrote it (host memory only).
  void check_expert_saved(const Step& step) const;
  // Checks the step's buffers (both saved ones, then the workspace of `pass`), fills splits_ and
  // carves the saved views. Args: the forward or backward arguments (the same buffer fields).
  template <class Args>
  void open_step(Step& step, const Args& args, EpPass pass);
  // exchange_tensors_[slot] and its four [W] arrays, all overwritten.
  ExchangeTensor& exchange_slot(size_t slot, const void* send, void* recv, size_t** send_offset,
                                size_t** send_bytes, size_t** recv_offset, size_t** recv_bytes);
  // exchange_tensors_[slot] = rows of `row_bytes` bytes by splits_: towards the experts, or home.
  void set_rows_tensor(size_t slot, const void* send, void* recv, size_t row_bytes,
                       bool to_experts);

  std::shared_ptr<ContextState> context_;
  LayerDesc global_desc_;  // as created: the losses' coefficients
  LayerDesc router_desc_;  // the global router without loss terms (EP computes loss shares)
  LayerDesc local_desc_;   // this rank's experts: E_r experts, top_k = 1
  int32_t rank_;
  int32_t world_size_;
  int64_t expert_begin_;
  int64_t expert_end_;
  std::vector<int64_t> rank_expert_begin_;  // [W + 1]
  uint64_t layer_tag_;
  uint64_t steps_begun_ = 0;  // forward_begin calls so far: the step id of the next one is this + 1
  HomeHeader home_header_{};  // the source of forward_begin's (asynchronous) header copy
  ExpertHeader expert_header_{};  // forward_finish's, likewise
  std::shared_ptr<LocalGroupState> group_;
  std::unique_ptr<Transport> transport_;
  // Host scratch of the execute calls, sized at creation (see the class comment).
  Splits splits_;
  std::vector<size_t> exchange_sizes_;  // [kMaxExchangeTensors, 4, W]
  ExchangeTensor exchange_tensors_[kMaxExchangeTensors];
};

}  // namespace ep
}  // namespace moeblaze
