#include "ep/ep_layer.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>

#include "common/carver.hpp"
#include "common/checks.hpp"
#include "common/routing_index.hpp"
#include "common/saved_layout.hpp"
#include "common/status.hpp"

namespace moeblaze {
namespace ep {

namespace {

// ---- buffer layouts (each carved twice: to measure and to execute)
// --------------------------------

// The HOME saved buffer: everything about this rank's tokens that finish and backward need.
struct HomeSaved {
  HomeHeader* header = nullptr;
  int32_t* table = nullptr;                 // [W,E] per-expert counts of every rank
  void* logits = nullptr;                   // [T,E] rtype
  int32_t* ids = nullptr;                   // [T,k] global expert ids
  void* g = nullptr;                        // [T,k] rtype
  int32_t* expert_offsets = nullptr;        // [E+1]
  int32_t* expert_token_indices = nullptr;  // [N]: the send order (by expert, hence by rank)
  int32_t* token_index_map = nullptr;       // [N]: pair (t, j) -> its row in send order
};

HomeSaved carve_home(Carver& c, const LayerDesc& desc, int64_t W, int64_t T) {
  const int64_t N = T * desc.k;
  HomeSaved s;
  s.header = c.carve<HomeHeader>(sizeof(HomeHeader));
  s.table = c.carve<int32_t>(sizeof(int32_t) * size_t(W * desc.E));
  s.logits = c.carve(desc.relem_size() * size_t(T * desc.E));
  s.ids = c.carve<int32_t>(sizeof(int32_t) * size_t(N));
  s.g = c.carve(desc.relem_size() * size_t(N));
  s.expert_offsets = c.carve<int32_t>(sizeof(int32_t) * size_t(desc.E + 1));
  s.expert_token_indices = c.carve<int32_t>(sizeof(int32_t) * size_t(N));
  s.token_index_map = c.carve<int32_t>(sizeof(int32_t) * size_t(N));
  return s;
}

// The EXPERT saved buffer: the received rows are the `x` of the local experts' backward.
struct ExpertSaved {
  ExpertHeader* header = nullptr;
  void* recv = nullptr;          // [R,d] dtype
  void* recv_g = nullptr;        // [R] rtype
  int32_t* local_ids = nullptr;  // [R] local expert of each row
  Buffer experts;                // the local experts' saved buffer (EXPERTS_FORWARD layout)
};

ExpertSaved carve_expert(Carver& c, const LayerDesc& local, int64_t R) {
  ExpertSaved s;
  s.header = c.carve<ExpertHeader>(sizeof(ExpertHeader));
  s.recv = c.carve(local.elem_size() * size_t(R * local.d));
  s.recv_g = c.carve(local.relem_size() * size_t(R));
  s.local_ids = c.carve<int32_t>(sizeof(int32_t) * size_t(R));
  const size_t experts_bytes = saved_size(local, Pass::ExpertsForward, R);
  s.experts = {c.carve(experts_bytes), experts_bytes};
  return s;
}

Buffer carve_sub(Carver& c, size_t bytes) {
  return {c.carve(bytes), bytes};
}

// The workspaces of the three execute calls. rd = the router's description (the global layer),
// local = this rank's experts; T = this rank's tokens, R = the rows its experts receive.

struct BeginScratch {
  Buffer sub;
};

BeginScratch carve_begin(Carver& c, const Backend& backend, const LayerDesc& rd, int64_t T) {
  size_t sub = 0;
  for (Pass p : {Pass::RouterProjectForward, Pass::RouterForward, Pass::RoutingBuild}) {
    sub = std::max(sub, backend.workspace_size(rd, p, T, 0));
  }
  BeginScratch s;
  s.sub = carve_sub(c, sub);
  return s;
}

struct FinishScratch {
  void* rows = nullptr;              // [N,d]: sent rows, then the returned rows (send order)
  void* send_g = nullptr;            // [N] rtype
  void* y_rows = nullptr;            // [R,d]: the local experts' output rows
  int32_t* global_counts = nullptr;  // [E]
  void* loss_scratch = nullptr;      // [kLossShareScratchRows,E] rtype
  Buffer sub;
};

FinishScratch carve_finish(Carver& c, const Backend& backend, const LayerDesc& rd,
                           const LayerDesc& local, int64_t T, int64_t R) {
  const int64_t N = T * rd.k;
  FinishScratch s;
  s.rows = c.carve(rd.elem_size() * size_t(N * rd.d));
  s.send_g = c.carve(rd.relem_size() * size_t(N));
  s.y_rows = c.carve(rd.elem_size() * size_t(R * rd.d));
  s.global_counts = c.carve<int32_t>(sizeof(int32_t) * size_t(rd.E));
  s.loss_scratch = c.carve(rd.relem_size() * size_t(kLossShareScratchRows * rd.E));
  // The local experts' forward always writes the EXPERT saved buffer.
  s.sub = carve_sub(
      c, backend.workspace_size(local, Pass::ExpertsForward, R, MOEBLAZE_FORWARD_WITH_SAVED));
  return s;
}

struct BackwardScratch {
  void* rows = nullptr;              // [N,d]: dy rows sent, then the returned dx rows
  void* recv_dy = nullptr;           // [R,d]
  void* dx_rows = nullptr;           // [R,d]
  void* dg_rows = nullptr;           // [R] rtype
  void* back_dg = nullptr;           // [N] rtype, send order
  void* dg = nullptr;                // [T,k] rtype (unless the caller asked for dg)
  void* d_logits = nullptr;          // [T,E] rtype (unless the caller asked for d_logits)
  int32_t* global_counts = nullptr;  // [E]
  void* loss_scratch = nullptr;      // [kLossShareScratchRows,E] rtype
  Buffer sub;
};

BackwardScratch carve_backward(Carver& c, const Backend& backend, const LayerDesc& rd,
                               const LayerDesc& local, int64_t T, int64_t R, uint32_t flags) {
  const int64_t N = T * rd.k;
  const size_t es = rd.elem_size();
  const size_t rs = rd.relem_size();
  BackwardScratch s;
  s.rows = c.carve(es * size_t(N * rd.d));
  s.recv_dy = c.carve(es * size_t(R * rd.d));
  s.dx_rows = c.carve(es * size_t(R * rd.d));
  s.dg_rows = c.carve(rs * size_t(R));
  s.back_dg = c.carve(rs * size_t(N));
  s.dg = c.carve(rs * size_t(N));
  s.d_logits = c.carve(rs * size_t(T * rd.E));
  s.global_counts = c.carve<int32_t>(sizeof(int32_t) * size_t(rd.E));
  s.loss_scratch = c.carve(rs * size_t(kLossShareScratchRows * rd.E));
  size_t sub = backend.workspace_size(local, Pass::ExpertsBackward, R, flags);
  for (Pass p : {Pass::RouterBackward, Pass::RouterProjectBackward}) {
    sub = std::max(sub, backend.workspace_size(rd, p, T, 0));
  }
  s.sub = carve_sub(c, sub);
  return s;
}

uint64_t make_layer_tag(const LayerDesc& desc, int32_t world_size) {
  // The same on every rank of one layer: the global description and the group size.
  return desc.hash() * 1099511628211ull ^ uint64_t(uint32_t(world_size));
}

}  // namespace

// ---- construction -------------------------------------------------------------------------------

EpLayer::EpLayer(std::shared_ptr<ContextState> context, const LayerDesc& global_desc,
                 int32_t transport_kind, int32_t rank, int32_t world_size, void* communicator,
                 std::shared_ptr<LocalGroupState> group)
    : context_(std::move(context)),
      global_desc_(global_desc),
      rank_(rank),
      world_size_(world_size),
      group_(std::move(group)) {
  const int64_t E = global_desc.E;
  const int64_t base = E / world_size;
  const int64_t extra = E % world_size;
  rank_expert_begin_.assign(size_t(world_size) + 1, 0);
  for (int32_t q = 0; q < world_size; ++q) {
    rank_expert_begin_[size_t(q) + 1] = rank_expert_begin_[size_t(q)] + base + (q < extra ? 1 : 0);
  }
  expert_begin_ = rank_expert_begin_[size_t(rank)];
  expert_end_ = rank_expert_begin_[size_t(rank) + 1];

  router_desc_ = global_desc;
  router_desc_.aux_loss_coeff = 0.0f;
  router_desc_.z_loss_coeff = 0.0f;

  local_desc_ = global_desc;
  local_desc_.E = expert_end_ - expert_begin_;
  local_desc_.k = 1;
  local_desc_.score_function = ScoreFunction::SoftmaxTopk;
  local_desc_.renormalize = false;
  local_desc_.aux_loss_coeff = 0.0f;
  local_desc_.z_loss_coeff = 0.0f;

  Backend& backend = *context_->backend;
  backend.check_supported(router_desc_);
  backend.check_supported(local_desc_);
  layer_tag_ = make_layer_tag(global_desc_, world_size);

  if (transport_kind == MOEBLAZE_EP_TRANSPORT_LOCAL) {
    transport_ = make_local_transport(group_, rank, backend);
  } else {
    transport_ = make_nccl_transport(communicator, rank, world_size, context_->device, backend);
  }

  const size_t W = size_t(world_size);
  for (std::vector<int64_t>* v :
       {&splits_.send_rows, &splits_.send_begin, &splits_.recv_rows, &splits_.recv_begin}) {
    v->assign(W, 0);
  }
  exchange_sizes_.assign(kMaxExchangeTensors * 4 * W, 0);
}

// ---- sizes --------------------------------------------------------------------------------------

size_t EpLayer::exchange_size() const {
  return kExchangeTableOffset + sizeof(int32_t) * size_t(world_size_) * size_t(global_desc_.E);
}

size_t EpLayer::saved_size(EpSaved part, int64_t T, int64_t R) const {
  Carver measure;
  if (part == EpSaved::Home) {
    carve_home(measure, router_desc_, world_size_, T);
  } else {
    carve_expert(measure, local_desc_, R);
  }
  return measure.size();
}

size_t EpLayer::workspace_size(EpPass pass, int64_t T, int64_t R, uint32_t backward_flags) const {
  const Backend& backend = *context_->backend;
  Carver measure;
  switch (pass) {
    case EpPass::ForwardBegin: carve_begin(measure, backend, router_desc_, T); break;
    case EpPass::ForwardFinish:
      carve_finish(measure, backend, router_desc_, local_desc_, T, R);
      break;
    case EpPass::Backward:
      carve_backward(measure, backend, router_desc_, local_desc_, T, R, backward_flags);
      break;
  }
  return measure.size();
}

void EpLayer::require_recv_rows(int64_t R, const char* argument) const {
  MB_REQUIRE_ARG(R >= 0 && R <= kMaxRoutedRows,
                 "%s = %lld must be in [0, 2^31) (the rows this rank's experts receive)", argument,
                 (long long)R);
}

// ---- step state ---------------------------------------------------------------------------------

// Plain views into the caller's `exchange` and saved buffers: building one allocates nothing.
struct EpLayer::Step {
  const ExchangeHeader* header = nullptr;
  const int32_t* table = nullptr;  // [W,E], host
  int64_t R = 0;
  HomeSaved home;
  ExpertSaved expert;
};

EpLayer::Step EpLayer::read_step(const void* exchange, size_t exchange_bytes, int64_t T,
                                 uint32_t expected_state, const char* call) const {
  require_num_tokens(router_desc_, T, "args->num_tokens");
  MB_REQUIRE_ARG(exchange != nullptr, "exchange is NULL");
  MB_REQUIRE_ARG(reinterpret_cast<uintptr_t>(exchange) % 8 == 0,
                 "exchange (%p) must be 8-byte aligned", exchange);
  MB_REQUIRE(exchange_bytes >= exchange_size(), MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
             "exchange_bytes = %zu, but this layer needs %zu (ask "
             "moeblaze_ep_layer_exchange_size)",
             exchange_bytes, exchange_size());
  const auto* header = static_cast<const ExchangeHeader*>(exchange);
  MB_REQUIRE_ARG(header->magic == kExchangeMagic && header->layer_tag == layer_tag_ &&
                     header->rank == rank_ && header->world_size == world_size_,
                 "exchange was not filled by moeblaze_ep_forward_begin of this layer and rank: "
                 "call moeblaze_ep_forward_begin before %s",
                 call);
  if (expected_state == kStepBegun) {
    MB_REQUIRE_ARG(header->state == kStepBegun,
                   "exchange: this forward step was already finished; %s needs a fresh "
                   "moeblaze_ep_forward_begin",
                   call);
  } else {
    MB_REQUIRE_ARG(header->state == kStepFinished,
                   "exchange: this forward step was begun but not finished; call "
                   "moeblaze_ep_forward_finish before %s",
                   call);
  }
  MB_REQUIRE_ARG(header->num_tokens == T,
                 "args->num_tokens = %lld, but the forward step in `exchange` has %lld tokens",
                 (long long)T, (long long)header->num_tokens);
  Step step;
  step.header = header;
  step.table = reinterpret_cast<const int32_t*>(static_cast<const unsigned char*>(exchange) +
                                                kExchangeTableOffset);
  step.R = header->recv_rows;
  check_count_table(step, T);
  return step;
}

// `exchange` is the caller's memory: its counts size every exchange, gather and buffer of the step,
// so they are checked as forward_begin left them before any is used.
void EpLayer::check_count_table(const Step& step, int64_t T) const {
  const int64_t E = global_desc_.E;
  const int64_t k = global_desc_.k;
  MB_REQUIRE_ARG(step.R >= 0 && step.R <= kMaxRoutedRows,
                 "exchange: recv_rows = %lld is out of range [0, 2^31) (the buffer was modified "
                 "after moeblaze_ep_forward_begin)",
                 (long long)step.R);
  int64_t received = 0;
  for (int64_t s = 0; s < world_size_; ++s) {
    int64_t routed = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int32_t count = step.table[s * E + e];
      MB_REQUIRE_ARG(count >= 0,
                     "exchange: count table [rank %lld, expert %lld] = %d is negative (the buffer "
                     "was modified after moeblaze_ep_forward_begin)",
                     (long long)s, (long long)e, int(count));
      routed += count;
      if (e >= expert_begin_ && e < expert_end_) received += count;
    }
    MB_REQUIRE_ARG(routed % k == 0 && routed <= kMaxRoutedRows && (s != rank_ || routed == T * k),
                   "exchange: count table row of rank %lld routes %lld rows, which is not what "
                   "moeblaze_ep_forward_begin wrote (the buffer was modified)",
                   (long long)s, (long long)routed);
  }
  MB_REQUIRE_ARG(received == step.R,
                 "exchange: the count table gives %lld received rows, its header %lld (the buffer "
                 "was modified after moeblaze_ep_forward_begin)",
                 (long long)received, (long long)step.R);
}

// The HOME saved buffer is the caller's memory, and its indices address x, dy and the workspace:
// on a CPU context every one is checked before any is followed. (A CUDA context cannot read it
// without a host synchronisation; its kernels skip indices out of range instead.)
void EpLayer::check_home_saved(const Step& step, int64_t T) const {
  const HomeSaved& home = step.home;
  const HomeHeader& h = *home.header;
  const int64_t E = global_desc_.E;
  const int64_t k = global_desc_.k;
  MB_REQUIRE_ARG(h.magic == kHomeMagic && h.version == uint32_t(MOEBLAZE_VERSION) &&
                     h.layer_tag == layer_tag_ && h.rank == rank_ && h.world_size == world_size_,
                 "args->home_saved was not filled by moeblaze_ep_forward_begin of this layer and "
                 "rank (or was overwritten since)");
  MB_REQUIRE_ARG(h.step == step.header->step && h.num_tokens == T,
                 "args->home_saved belongs to another forward step than `exchange` (step %llu "
                 "with %lld tokens; `exchange` holds step %llu with %lld)",
                 (unsigned long long)h.step, (long long)h.num_tokens,
                 (unsigned long long)step.header->step, (long long)T);
  MB_REQUIRE_ARG(
      std::memcmp(home.table, step.table, sizeof(int32_t) * size_t(world_size_ * E)) == 0,
      "args->home_saved: its count table differs from the one in `exchange` (one of "
      "them was modified after moeblaze_ep_forward_begin)");
  check_routing_index(T, k, E, home.expert_offsets, home.expert_token_indices, home.token_index_map,
                      "args->home_saved");
  for (int64_t e = 0; e < E; ++e) {
    MB_REQUIRE_ARG(home.expert_offsets[e + 1] - home.expert_offsets[e] == step.table[rank_ * E + e],
                   "args->home_saved: corrupted routing index: expert %lld has %d rows, the count "
                   "table %d",
                   (long long)e, int(home.expert_offsets[e + 1] - home.expert_offsets[e]),
                   int(step.table[rank_ * E + e]));
  }
  check_ids_match_routing_index(T, k, E, home.ids, home.expert_offsets, home.token_index_map,
                                "args->home_saved ids", "args->home_saved");
}

void EpLayer::check_expert_saved(const Step& step) const {
  const ExpertHeader& h = *step.expert.header;
  MB_REQUIRE_ARG(h.magic == kExpertMagic && h.version == uint32_t(MOEBLAZE_VERSION) &&
                     h.layer_tag == layer_tag_ && h.rank == rank_ && h.world_size == world_size_,
                 "args->expert_saved was not filled by moeblaze_ep_forward_finish of this layer "
                 "and rank (or was overwritten since)");
  MB_REQUIRE_ARG(h.step == step.header->step && h.num_tokens == step.R,
                 "args->expert_saved belongs to another forward step than `exchange` (step %llu "
                 "with %lld received rows; `exchange` holds step %llu with %lld)",
                 (unsigned long long)h.step, (long long)h.num_tokens,
                 (unsigned long long)step.header->step, (long long)step.R);
}

template <class Args>
void EpLayer::open_step(Step& step, const Args& a, EpPass pass) {
  const Backend& backend = *context_->backend;
  const int64_t T = a.num_tokens;
  const int64_t R = step.R;
  // A NULL saved buffer is reported as missing, not as too small (require_buffer checks the size
  // first). Where and how is each call's own: callers and the error tests see the difference.
  if (pass == EpPass::Backward) {
    MB_REQUIRE_ARG(a.home_saved != nullptr && a.expert_saved != nullptr,
                   "args->home_saved and args->expert_saved must be the buffers of the forward "
                   "step (one is NULL)");
  }
  require_buffer(backend, a.home_saved, a.home_saved_bytes, saved_size(EpSaved::Home, T, 0),
                 "args->home_saved", "args->home_saved_bytes",
                 "moeblaze_ep_layer_saved_size(MOEBLAZE_EP_SAVED_HOME)");
  if (pass == EpPass::ForwardFinish) {
    MB_REQUIRE_ARG(a.expert_saved != nullptr,
                   "args->expert_saved is NULL: forward_finish writes the received rows there "
                   "(moeblaze_ep_layer_saved_size(MOEBLAZE_EP_SAVED_EXPERT, recv_rows) bytes)");
  }
  require_buffer(backend, a.expert_saved, a.expert_saved_bytes, saved_size(EpSaved::Expert, T, R),
                 "args->expert_saved", "args->expert_saved_bytes",
                 "moeblaze_ep_layer_saved_size(MOEBLAZE_EP_SAVED_EXPERT, recv_rows)");
  // Name the query that gives the size asked for: the flags-aware one where the flags change it.
  const char* workspace_query =
      pass == EpPass::ForwardFinish
          ? "moeblaze_ep_layer_workspace_size(MOEBLAZE_EP_PASS_FORWARD_FINISH, recv_rows)"
      : (a.flags & MOEBLAZE_BACKWARD_CONSUME_SAVED) != 0
          ? "moeblaze_ep_layer_workspace_size_with_flags(MOEBLAZE_EP_PASS_BACKWARD, recv_rows, "
            "flags)"
          : "moeblaze_ep_layer_workspace_size(MOEBLAZE_EP_PASS_BACKWARD, recv_rows)";
  require_buffer(backend, a.workspace, a.workspace_bytes, workspace_size(pass, T, R, a.flags),
                 "args->workspace", "args->workspace_bytes", workspace_query);

  compute_splits(*step.header, step.table);
  // The backward arguments hold the saved buffers as const: it only reads them.
  Carver home_carver(const_cast<void*>(a.home_saved));
  step.home = carve_home(home_carver, router_desc_, world_size_, T);
  Carver expert_carver(const_cast<void*>(a.expert_saved));
  step.expert = carve_expert(expert_carver, local_desc_, R);
  if (backend.kind() == MOEBLAZE_BACKEND_CPU) {
    check_home_saved(step, T);
    if (pass == EpPass::Backward) check_expert_saved(step);
  }
}

void EpLayer::compute_splits(const ExchangeHeader& header, const int32_t* table) {
  const int64_t W = world_size_;
  const int64_t E = global_desc_.E;
  Splits& s = splits_;  // sized at creation: only overwritten
  for (std::vector<int64_t>* v : {&s.send_rows, &s.send_begin, &s.recv_rows, &s.recv_begin}) {
    std::fill(v->begin(), v->end(), 0);
  }
  s.total_recv = 0;
  s.global_tokens = 0;
  int64_t routed = 0;
  for (int64_t q = 0; q < W; ++q) {
    for (int64_t e = rank_expert_begin_[size_t(q)]; e < rank_expert_begin_[size_t(q) + 1]; ++e) {
      s.send_rows[size_t(q)] += table[rank_ * E + e];
    }
    s.send_begin[size_t(q)] = q == 0 ? 0 : s.send_begin[size_t(q) - 1] + s.send_rows[size_t(q) - 1];
    for (int64_t e = expert_begin_; e < expert_end_; ++e)
      s.recv_rows[size_t(q)] += table[q * E + e];
    s.recv_begin[size_t(q)] = s.total_recv;
    s.total_recv += s.recv_rows[size_t(q)];
    for (int64_t e = 0; e < E; ++e) routed += table[q * E + e];
  }
  s.global_tokens = routed / global_desc_.k;
  MB_REQUIRE(s.total_recv == header.recv_rows, MOEBLAZE_ERR_INTERNAL,
             "exchange: the count table gives %lld received rows, the header %lld",
             (long long)s.total_recv, (long long)header.recv_rows);
}

ExchangeTensor& EpLayer::exchange_slot(size_t slot, const void* send, void* recv,
                                       size_t** send_offset, size_t** send_bytes,
                                       size_t** recv_offset, size_t** recv_bytes) {
  MB_REQUIRE(slot < kMaxExchangeTensors, MOEBLAZE_ERR_INTERNAL, "EP: exchange slot %zu", slot);
  const size_t W = size_t(world_size_);
  size_t* sizes = exchange_sizes_.data() + slot * 4 * W;
  *send_offset = sizes;
  *send_bytes = sizes + W;
  *recv_offset = sizes + 2 * W;
  *recv_bytes = sizes + 3 * W;
  ExchangeTensor& t = exchange_tensors_[slot];
  t.send = send;
  t.recv = recv;
  t.send_offset = *send_offset;
  t.send_bytes = *send_bytes;
  t.recv_offset = *recv_offset;
  t.recv_bytes = *recv_bytes;
  return t;
}

void EpLayer::set_rows_tensor(size_t slot, const void* send, void* recv, size_t row_bytes,
                              bool to_experts) {
  // Towards the experts: send by destination rank in send order, receive by source rank. Back home:
  // the transpose.
  const Splits& s = splits_;
  const std::vector<int64_t>& out_rows = to_experts ? s.send_rows : s.recv_rows;
  const std::vector<int64_t>& out_begin = to_experts ? s.send_begin : s.recv_begin;
  const std::vector<int64_t>& in_rows = to_experts ? s.recv_rows : s.send_rows;
  const std::vector<int64_t>& in_begin = to_experts ? s.recv_begin : s.send_begin;
  size_t *send_offset, *send_bytes, *recv_offset, *recv_bytes;
  exchange_slot(slot, send, recv, &send_offset, &send_bytes, &recv_offset, &recv_bytes);
  for (size_t q = 0; q < size_t(world_size_); ++q) {
    send_offset[q] = size_t(out_begin[q]) * row_bytes;
    send_bytes[q] = size_t(out_rows[q]) * row_bytes;
    recv_offset[q] = size_t(in_begin[q]) * row_bytes;
    recv_bytes[q] = size_t(in_rows[q]) * row_bytes;
  }
}

// ---- forward ------------------------------------------------------------------------------------

int64_t EpLayer::forward_begin(const moeblaze_ep_forward_args_t& a, void* exchange,
                               size_t exchange_bytes, void* stream) {
  Backend& backend = *context_->backend;
  const LayerDesc& rd = router_desc_;
  const int64_t T = a.num_tokens;
  const int64_t E = rd.E;
  const int64_t W = world_size_;

  MB_REQUIRE_ARG(a.flags == 0, "args->flags = %u must be 0 (reserved)", a.flags);
  require_num_tokens(rd, T, "args->num_tokens");
  const bool empty = T == 0;
  require_tensor(backend, a.x, true, empty, rd.elem_size(), "args->x");
  require_tensor(backend, a.w_router, true, false, rd.elem_size(), "args->w_router");
  require_buffer(backend, a.home_saved, a.home_saved_bytes, saved_size(EpSaved::Home, T, 0),
                 "args->home_saved", "args->home_saved_bytes",
                 "moeblaze_ep_layer_saved_size(MOEBLAZE_EP_SAVED_HOME)");
  require_buffer(backend, a.workspace, a.workspace_bytes,
                 workspace_size(EpPass::ForwardBegin, T, 0), "args->workspace",
                 "args->workspace_bytes",
                 "moeblaze_ep_layer_workspace_size(MOEBLAZE_EP_PASS_FORWARD_BEGIN)");
  MB_REQUIRE_ARG(exchange != nullptr, "exchange is NULL");
  MB_REQUIRE_ARG(reinterpret_cast<uintptr_t>(exchange) % 8 == 0,
                 "exchange (%p) must be 8-byte aligned", exchange);
  MB_REQUIRE(exchange_bytes >= exchange_size(), MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
             "exchange_bytes = %zu, but this layer needs %zu (ask "
             "moeblaze_ep_layer_exchange_size)",
             exchange_bytes, exchange_size());
  const size_t es = rd.elem_size();
  require_disjoint({
      {a.x, size_t(T) * size_t(rd.d) * es, false, "args->x"},
      {a.w_router, size_t(E) * size_t(rd.d) * es, false, "args->w_router"},
      {a.home_saved, a.home_saved_bytes, true, "args->home_saved"},
      {a.workspace, a.workspace_bytes, true, "args->workspace"},
      {exchange, exchange_bytes, true, "exchange"},
  });
  // The caller's exchange is invalid until this step's table has arrived.
  auto* header = static_cast<ExchangeHeader*>(exchange);
  header->magic = 0;

  Carver home_carver(a.home_saved);
  const HomeSaved home = carve_home(home_carver, rd, W, T);
  Carver ws_carver(a.workspace);
  const BeginScratch scratch = carve_begin(ws_carver, backend, rd, T);

  {
    std::lock_guard<std::mutex> lock(context_->execute_mutex);
    RouterProjectForwardCall project;
    project.T = T;
    project.x = a.x;
    project.w_router = a.w_router;
    project.logits = home.logits;
    project.workspace = scratch.sub;
    project.stream = stream;
    backend.router_project_forward(rd, project);

    RouterForwardCall route;
    route.T = T;
    route.logits = home.logits;
    route.ids = home.ids;
    route.g = home.g;
    route.expert_counts = home.table + rank_ * E;  // this rank's row of the table
    route.workspace = scratch.sub;
    route.stream = stream;
    backend.router_forward(rd, route);

    RoutingBuildCall build;
    build.T = T;
    build.ids = home.ids;
    build.expert_offsets = home.expert_offsets;
    build.expert_token_indices = home.expert_token_indices;
    build.token_index_map = home.token_index_map;
    build.workspace = scratch.sub;
    build.stream = stream;
    backend.routing_build(rd, build);
  }

  // F1: every rank's counts to every rank (the own row is already in place).
  const size_t row_bytes = sizeof(int32_t) * size_t(E);
  {
    size_t *send_offset, *send_bytes, *recv_offset, *recv_bytes;
    exchange_slot(0, home.table, home.table, &send_offset, &send_bytes, &recv_offset, &recv_bytes);
    for (size_t q = 0; q < size_t(W); ++q) {
      send_offset[q] = size_t(rank_) * row_bytes;
      send_bytes[q] = row_bytes;
      recv_offset[q] = q * row_bytes;
      recv_bytes[q] = row_bytes;
    }
  }
  transport_->exchange(exchange_tensors_, 1, "forward_begin: count exchange", layer_tag_, stream);

  // The HOME header, before the synchronisation below (which also waits for this copy).
  const uint64_t step = ++steps_begun_;
  home_header_.magic = kHomeMagic;
  home_header_.version = uint32_t(MOEBLAZE_VERSION);
  home_header_.layer_tag = layer_tag_;
  home_header_.step = step;
  home_header_.num_tokens = T;
  home_header_.rank = rank_;
  home_header_.world_size = world_size_;
  backend.copy(home.header, &home_header_, sizeof(HomeHeader), stream);

  // F1': the one host synchronisation.
  auto* table =
      reinterpret_cast<int32_t*>(static_cast<unsigned char*>(exchange) + kExchangeTableOffset);
  backend.copy_to_host(table, home.table, row_bytes * size_t(W), stream);

  int64_t recv_rows = 0;
  for (int64_t s = 0; s < W; ++s) {
    int64_t routed = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int32_t count = table[s * E + e];
      MB_REQUIRE(count >= 0, MOEBLAZE_ERR_INTERNAL, "count table: rank %lld, expert %lld: %d",
                 (long long)s, (long long)e, int(count));
      routed += count;
      if (e >= expert_begin_ && e < expert_end_) recv_rows += count;
    }
    MB_REQUIRE(routed % rd.k == 0, MOEBLAZE_ERR_INTERNAL,
               "count table: rank %lld routed %lld rows, not a multiple of top_k = %lld",
               (long long)s, (long long)routed, (long long)rd.k);
    if (s == rank_) {
      MB_REQUIRE(routed == T * rd.k, MOEBLAZE_ERR_INTERNAL,
                 "count table: this rank routed %lld rows for %lld tokens", (long long)routed,
                 (long long)T);
    }
  }
  require_recv_rows(recv_rows, "the rows this rank's experts receive");

  header->state = kStepBegun;
  header->layer_tag = layer_tag_;
  header->num_tokens = T;
  header->recv_rows = recv_rows;
  header->rank = rank_;
  header->world_size = world_size_;
  header->step = step;
  header->magic = kExchangeMagic;
  return recv_rows;
}

void EpLayer::forward_finish(const moeblaze_ep_forward_args_t& a, void* exchange,
                             size_t exchange_bytes, void* stream) {
  Backend& backend = *context_->backend;
  const LayerDesc& rd = router_desc_;
  const int64_t T = a.num_tokens;
  const int64_t E = rd.E;
  const int64_t W = world_size_;
  const int64_t k = rd.k;
  const int64_t d = rd.d;
  const size_t es = rd.elem_size();
  const size_t rs = rd.relem_size();

  MB_REQUIRE_ARG(a.flags == 0, "args->flags = %u must be 0 (reserved)", a.flags);
  Step step = read_step(exchange, exchange_bytes, T, kStepBegun, "moeblaze_ep_forward_finish");
  const int64_t N = T * k;  // only now: read_step has checked T
  const int64_t R = step.R;
  const bool empty = T == 0;
  require_tensor(backend, a.x, true, empty, es, "args->x");
  require_tensor(backend, a.w_gate, true, false, es, "args->w_gate");
  require_tensor(backend, a.w_up, rd.gated(), false, es, "args->w_up");
  require_tensor(backend, a.w_down, true, false, es, "args->w_down");
  require_tensor(backend, a.y, true, empty, es, "args->y");
  require_tensor(backend, a.logits_out, false, false, rs, "args->logits_out");
  require_tensor(backend, a.ids_out, false, false, sizeof(int32_t), "args->ids_out");
  require_tensor(backend, a.g_out, false, false, rs, "args->g_out");
  require_tensor(backend, a.expert_counts, false, false, sizeof(int32_t), "args->expert_counts");
  require_tensor(backend, a.losses, false, false, rs, "args->losses");
  {
    const size_t Tn = size_t(T), dn = size_t(d), h = size_t(rd.h), En = size_t(E), kn = size_t(k),
                 local = size_t(expert_end_ - expert_begin_);
    require_disjoint({
        {a.x, Tn * dn * es, false, "args->x"},
        {a.w_gate, local * h * dn * es, false, "args->w_gate"},
        {rd.gated() ? a.w_up : nullptr, local * h * dn * es, false, "args->w_up"},
        {a.w_down, local * dn * h * es, false, "args->w_down"},
        {a.home_saved, a.home_saved_bytes, false, "args->home_saved"},
        {a.y, Tn * dn * es, true, "args->y"},
        {a.logits_out, Tn * En * rs, true, "args->logits_out"},
        {a.ids_out, Tn * kn * sizeof(int32_t), true, "args->ids_out"},
        {a.g_out, Tn * kn * rs, true, "args->g_out"},
        {a.expert_counts, En * sizeof(int32_t), true, "args->expert_counts"},
        {a.losses, 2 * rs, true, "args->losses"},
        {a.expert_saved, a.expert_saved_bytes, true, "args->expert_saved"},
        {a.workspace, a.workspace_bytes, true, "args->workspace"},
        {exchange, exchange_bytes, true, "exchange"},
    });
  }
  open_step(step, a, EpPass::ForwardFinish);

  const HomeSaved& home = step.home;
  const ExpertSaved& expert = step.expert;
  Carver ws(a.workspace);
  const FinishScratch scratch = carve_finish(ws, backend, rd, local_desc_, T, R);

  // F2: the routed rows in send order (by expert, hence by destination rank; tokens ascending),
  // and g along with them (option B of the design: the expert rank applies it).
  backend.gather_rows(scratch.rows, a.x, home.expert_token_indices, N, T, es * size_t(d), stream);
  backend.scatter_rows(scratch.send_g, home.g, home.token_index_map, N, N, rs, stream);

  // F3: dispatch.
  set_rows_tensor(0, scratch.rows, expert.recv, es * size_t(d), true);
  set_rows_tensor(1, scratch.send_g, expert.recv_g, rs, true);
  transport_->exchange(exchange_tensors_, 2, "forward_finish: dispatch", layer_tag_, stream);

  // F4: the local experts on the received rows, a batch of R tokens with top_k = 1.
  backend.local_expert_ids(home.table, W, E, expert_begin_, expert_end_ - expert_begin_, R,
                           expert.local_ids, stream);
  {
    ExpertsForwardCall experts;
    experts.T = R;
    experts.x = expert.recv;
    experts.ids = expert.local_ids;
    experts.g = expert.recv_g;
    experts.w_gate = a.w_gate;
    experts.w_up = rd.gated() ? a.w_up : nullptr;
    experts.w_down = a.w_down;
    experts.y = scratch.y_rows;
    Carver saved_carver(expert.experts.ptr);
    experts.saved = carve_saved(saved_carver, local_desc_, Pass::ExpertsForward, R);
    experts.has_saved = true;
    experts.saved_pass = Pass::ExpertsForward;
    experts.workspace = scratch.sub;
    experts.stream = stream;
    std::lock_guard<std::mutex> lock(context_->execute_mutex);
    backend.experts_forward(local_desc_, experts);
  }

  // The EXPERT header: this step's, for backward's check.
  expert_header_.magic = kExpertMagic;
  expert_header_.version = uint32_t(MOEBLAZE_VERSION);
  expert_header_.layer_tag = layer_tag_;
  expert_header_.step = step.header->step;
  expert_header_.num_tokens = R;
  expert_header_.rank = rank_;
  expert_header_.world_size = world_size_;
  backend.copy(expert.header, &expert_header_, sizeof(ExpertHeader), stream);

  // F5: the weighted rows go home, into send order.
  set_rows_tensor(0, scratch.y_rows, scratch.rows, es * size_t(d), false);
  transport_->exchange(exchange_tensors_, 1, "forward_finish: return", layer_tag_, stream);

  // F6: y_t = sum_j rows[(t, j)], j ascending, rounded once.
  backend.combine_rows(rd.dtype, a.y, scratch.rows, home.token_index_map, T, k, d, N, stream);

  if (a.expert_counts || a.losses) {
    backend.global_counts(home.table, W, E, scratch.global_counts, stream);
  }
  if (a.expert_counts) {
    backend.copy(a.expert_counts, scratch.global_counts, sizeof(int32_t) * size_t(E), stream);
  }
  if (a.losses) {
    LossShareCall loss;
    loss.T = T;
    loss.global_tokens = splits_.global_tokens;
    loss.logits = home.logits;
    loss.global_counts = scratch.global_counts;
    loss.scratch = scratch.loss_scratch;
    loss.stream = stream;
    backend.loss_shares_forward(global_desc_, loss, a.losses);
  }
  if (a.logits_out) backend.copy(a.logits_out, home.logits, rs * size_t(T * E), stream);
  if (a.ids_out) backend.copy(a.ids_out, home.ids, sizeof(int32_t) * size_t(N), stream);
  if (a.g_out) backend.copy(a.g_out, home.g, rs * size_t(N), stream);

  static_cast<ExchangeHeader*>(exchange)->state = kStepFinished;
}

// ---- backward -----------------------------------------------------------------------------------

void EpLayer::backward(const moeblaze_ep_backward_args_t& a, const void* exchange,
                       size_t exchange_bytes, void* stream) {
  Backend& backend = *context_->backend;
  const LayerDesc& rd = router_desc_;
  const int64_t T = a.num_tokens;
  const int64_t E = rd.E;
  const int64_t W = world_size_;
  const int64_t k = rd.k;
  const int64_t d = rd.d;
  const size_t es = rd.elem_size();
  const size_t rs = rd.relem_size();

  require_backward_flags(a.flags, "args->flags");
  Step step = read_step(exchange, exchange_bytes, T, kStepFinished, "moeblaze_ep_backward");
  const int64_t N = T * k;  // only now: read_step has checked T
  const int64_t R = step.R;
  const bool empty = T == 0;
  require_tensor(backend, a.dy, true, empty, es, "args->dy");
  require_tensor(backend, a.d_losses, false, false, rs, "args->d_losses");
  require_tensor(backend, a.x, true, empty, es, "args->x");
  require_tensor(backend, a.w_router, true, false, es, "args->w_router");
  require_tensor(backend, a.w_gate, true, false, es, "args->w_gate");
  require_tensor(backend, a.w_up, rd.gated(), false, es, "args->w_up");
  require_tensor(backend, a.w_down, true, false, es, "args->w_down");
  require_tensor(backend, a.dx, false, false, es, "args->dx");
  require_tensor(backend, a.dw_router, false, false, es, "args->dw_router");
  require_tensor(backend, a.dw_gate, false, false, es, "args->dw_gate");
  require_tensor(backend, a.dw_up, false, false, es, "args->dw_up");
  require_tensor(backend, a.dw_down, false, false, es, "args->dw_down");
  require_tensor(backend, a.dg, false, false, rs, "args->dg");
  require_tensor(backend, a.d_logits, false, false, rs, "args->d_logits");
  {
    const size_t Tn = size_t(T), dn = size_t(d), h = size_t(rd.h), En = size_t(E), kn = size_t(k),
                 local = size_t(expert_end_ - expert_begin_);
    const bool consumed = (a.flags & MOEBLAZE_BACKWARD_CONSUME_SAVED) != 0;
    const bool gated = rd.gated();
    require_disjoint({
        {a.dy, Tn * dn * es, false, "args->dy"},
        {a.d_losses, 2 * rs, false, "args->d_losses"},
        {a.x, Tn * dn * es, false, "args->x"},
        {a.w_router, En * dn * es, false, "args->w_router"},
        {a.w_gate, local * h * dn * es, false, "args->w_gate"},
        {gated ? a.w_up : nullptr, local * h * dn * es, false, "args->w_up"},
        {a.w_down, local * dn * h * es, false, "args->w_down"},
        {exchange, exchange_bytes, false, "exchange"},
        {a.home_saved, a.home_saved_bytes, consumed, "args->home_saved"},
        {a.expert_saved, a.expert_saved_bytes, consumed, "args->expert_saved"},
        {a.dx, Tn * dn * es, true, "args->dx"},
        {a.dw_router, En * dn * es, true, "args->dw_router"},
        {a.dw_gate, local * h * dn * es, true, "args->dw_gate"},
        {gated ? a.dw_up : nullptr, local * h * dn * es, true, "args->dw_up"},
        {a.dw_down, local * dn * h * es, true, "args->dw_down"},
        {a.dg, Tn * kn * rs, true, "args->dg"},
        {a.d_logits, Tn * En * rs, true, "args->d_logits"},
        {a.workspace, a.workspace_bytes, true, "args->workspace"},
    });
  }
  open_step(step, a, EpPass::Backward);
  const bool accumulate = (a.flags & MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD) != 0;
  const bool consume = (a.flags & MOEBLAZE_BACKWARD_CONSUME_SAVED) != 0;

  const HomeSaved& home = step.home;
  const ExpertSaved& expert = step.expert;
  Carver ws(a.workspace);
  const BackwardScratch scratch = carve_backward(ws, backend, rd, local_desc_, T, R, a.flags);

  // B0, B1: the unscaled dy rows to the experts' ranks, with the forward's sizes.
  backend.gather_rows(scratch.rows, a.dy, home.expert_token_indices, N, T, es * size_t(d), stream);
  set_rows_tensor(0, scratch.rows, scratch.recv_dy, es * size_t(d), true);
  transport_->exchange(exchange_tensors_, 1, "backward: dispatch", layer_tag_, stream);

  // B2: the local experts' backward. dx and dg rows are always computed: other ranks need them.
  {
    ExpertsBackwardCall experts;
    experts.T = R;
    experts.dy = scratch.recv_dy;
    experts.x = expert.recv;
    experts.ids = expert.local_ids;
    experts.g = expert.recv_g;
    experts.w_gate = a.w_gate;
    experts.w_up = rd.gated() ? a.w_up : nullptr;
    experts.w_down = a.w_down;
    Carver saved_carver(expert.experts.ptr);
    experts.saved = carve_saved(saved_carver, local_desc_, Pass::ExpertsForward, R);
    experts.saved_pass = Pass::ExpertsForward;
    experts.dx = scratch.dx_rows;
    experts.dw_gate = a.dw_gate;
    experts.dw_up = rd.gated() ? a.dw_up : nullptr;
    experts.dw_down = a.dw_down;
    experts.dg = scratch.dg_rows;
    experts.accumulate_wgrad = accumulate;
    experts.consume_saved = consume;  // the expert saved buffer's activations: see moeblaze.h
    experts.workspace = scratch.sub;
    experts.stream = stream;
    std::lock_guard<std::mutex> lock(context_->execute_mutex);
    backend.experts_backward(local_desc_, experts);
  }

  // B3: dx rows and dg home, into send order.
  set_rows_tensor(0, scratch.dx_rows, scratch.rows, es * size_t(d), false);
  set_rows_tensor(1, scratch.dg_rows, scratch.back_dg, rs, false);
  transport_->exchange(exchange_tensors_, 2, "backward: return", layer_tag_, stream);

  // B4: this rank's tokens.
  const bool need_router = a.dx != nullptr || a.dw_router != nullptr || a.d_logits != nullptr;
  if (!need_router && a.dg == nullptr) return;
  void* dg = a.dg ? a.dg : scratch.dg;
  backend.gather_rows(dg, scratch.back_dg, home.token_index_map, N, N, rs, stream);
  if (a.dx) {
    backend.combine_rows(rd.dtype, a.dx, scratch.rows, home.token_index_map, T, k, d, N, stream);
  }
  if (!need_router) return;

  void* d_logits = a.d_logits ? a.d_logits : scratch.d_logits;
  {
    RouterBackwardCall route;
    route.T = T;
    route.logits = home.logits;
    route.ids = home.ids;
    route.dg = dg;
    route.d_logits = d_logits;
    route.workspace = scratch.sub;
    route.stream = stream;
    std::lock_guard<std::mutex> lock(context_->execute_mutex);
    backend.router_backward(rd, route);
  }
  if (global_desc_.aux_loss_coeff != 0.0f || global_desc_.z_loss_coeff != 0.0f) {
    backend.global_counts(home.table, W, E, scratch.global_counts, stream);
    LossShareCall loss;
    loss.T = T;
    loss.global_tokens = splits_.global_tokens;
    loss.logits = home.logits;
    loss.global_counts = scratch.global_counts;
    loss.scratch = scratch.loss_scratch;
    loss.stream = stream;
    backend.loss_shares_backward(global_desc_, loss, a.d_losses, d_logits);
  }
  if (a.dx == nullptr && a.dw_router == nullptr) return;
  RouterProjectBackwardCall project;
  project.T = T;
  project.d_logits = d_logits;
  project.x = a.x;
  project.w_router = a.w_router;
  project.dx = a.dx;
  project.dw_router = a.dw_router;
  project.accumulate_wgrad = accumulate;
  project.workspace = scratch.sub;
  project.stream = stream;
  std::lock_guard<std::mutex> lock(context_->execute_mutex);
  backend.router_project_backward(rd, project);
}

}  // namespace ep
}  // namespace moeblaze
