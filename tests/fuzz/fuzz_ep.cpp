// A fuzz target over the expert-parallel API (CPU backend, LOCAL transport, each rank a thread of
// this process): the input bytes choose the layer configuration (any field value, valid or not;
// at times one rank's differs from its peers' in one field), the group's size, each rank's token
// count and tensors (any bit pattern), the optional outputs and flags each rank passes, a buffer a
// rank passes one byte short, a second backward, and bytes each rank writes over its HOME saved
// buffer, EXPERT saved buffer and `exchange` between its calls. Whatever they are, every call on
// every rank must return a documented status with a message on failure, never wait out the group's
// timeout (a rank that fails makes its peers fail at once), and touch nothing outside the
// exact-size buffers it was given (ASan).
//
// Built like fuzz_layer.cpp: a libFuzzer target with -DMOEBLAZE_BUILD_FUZZERS=ON (scripts/test.sh's
// fuzz phase), and in every build a plain program running pseudo-random inputs from a printed seed
// or replaying the files named on its command line.
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "fuzz_support.hpp"

namespace {

using namespace moeblaze_fuzz;

constexpr int32_t kMaxRanks = 4;

// A CPU context of one thread per rank, created once: the ranks of a LOCAL group call at once, so
// they do not share one.
moeblaze_context_t rank_context(int32_t rank) {
  static moeblaze_context_t contexts[kMaxRanks] = {};
  static const bool created = [] {
    for (moeblaze_context_t& c : contexts) {
      moeblaze_context_create(&c, MOEBLAZE_BACKEND_CPU, 0);
      moeblaze_context_set_num_threads(c, 1);
    }
    return true;
  }();
  (void)created;
  return contexts[rank];
}

// The ranks' threads, started once and reused by every input (a thread per rank and input would
// grow ASan's registry of finished threads with every input the fuzzer runs).
class RankThreads {
 public:
  static RankThreads& get() {
    static RankThreads* threads = new RankThreads;  // never destroyed: its threads outlive main
    return *threads;
  }
  // body(rank) for every rank in [0, world) at once, one thread each; returns when all have.
  void run(int32_t world, const std::function<void(int32_t)>& body) {
    std::unique_lock<std::mutex> lock(mutex_);
    body_ = &body;
    world_ = world;
    pending_ = world;
    ++generation_;
    start_.notify_all();
    done_.wait(lock, [&] { return pending_ == 0; });
    body_ = nullptr;
  }

 private:
  RankThreads() {
    for (int32_t rank = 0; rank < kMaxRanks; ++rank)
      std::thread([this, rank] { serve(rank); }).detach();
  }
  void serve(int32_t rank) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      start_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (rank >= world_) continue;
      const std::function<void(int32_t)>* body = body_;
      lock.unlock();
      (*body)(rank);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }
  std::mutex mutex_;
  std::condition_variable start_, done_;
  const std::function<void(int32_t)>* body_ = nullptr;
  int32_t world_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
};

enum Buffer : uint8_t { kHome, kExpert, kExchange, kBufferCount };
// Which buffer a rank passes one byte short (with an allocation of that size).
enum Short : uint8_t {
  kNoneShort,
  kHomeShort,
  kExchangeShort,
  kExpertShort,
  kFinishWorkspaceShort,
  kBackwardWorkspaceShort,
  kShortCount
};

struct Overwrite {
  Buffer buffer;
  uint32_t at;  // taken modulo the buffer's size
  uint8_t value;
};

// One rank's layer, tensors and choices, all drawn before the ranks' threads start (the input is
// read in one order, whatever the threads' timing).
struct Rank {
  moeblaze_layer_config_t config;  // the group's, or at times another layer's
  moeblaze_ep_layer_t layer = nullptr;
  int64_t T = 0;
  int64_t experts = 0;    // E_r
  int64_t most_rows = 0;  // the header's bound on recv_rows: world · max T · min(k, E_r)
  std::unique_ptr<Block> x, w_router, w_gate, w_up, w_down, dy, y, dx, dw_router, dw_gate, dw_up,
      dw_down, dg, d_logits, logits_out, ids_out, g_out, counts, losses, d_losses;
  bool optional_outputs = false;
  bool pass_d_losses = false;
  uint32_t backward_flags = 0;
  bool tight_backward_workspace = false;
  bool second_backward = false;  // the same on every rank: each backward is collective
  Short short_buffer = kNoneShort;
  std::vector<Overwrite> after_begin, after_finish;
  size_t exchange_bytes = 0;
  ~Rank() { moeblaze_ep_layer_destroy(layer); }
};

size_t short_by(const Rank& r, Short which, size_t bytes) {
  return r.short_buffer == which && bytes > 0 ? bytes - 1 : bytes;
}

void overwrite(const std::vector<Overwrite>& writes, Block* const (&buffers)[kBufferCount]) {
  for (const Overwrite& w : writes) {
    const Block* b = buffers[w.buffer];
    if (b && b->size > 0) static_cast<unsigned char*>(b->ptr)[w.at % b->size] = w.value;
  }
}

// A call that fails on every rank's input: a rank that cannot go on makes it instead of the
// collective call its peers are making, so that they fail at once rather than wait for it.
void fail_the_group(const Rank& r, moeblaze_ep_forward_args_t fa, Block& exchange) {
  fa.flags = 1;  // reserved, must be 0
  const moeblaze_status_t status =
      moeblaze_ep_forward_finish(r.layer, &fa, exchange.ptr, exchange.size, nullptr);
  if (status == MOEBLAZE_OK) __builtin_trap();  // its own flags, or a peer's failure before it
  check(status);
}

// One rank's training step: forward_begin, forward_finish, one or two backwards. Returns at the
// first failure (the group then fails its peers' calls too).
void run_rank(Rank& r) {
  size_t bytes = 0;
  check(moeblaze_ep_layer_saved_size(r.layer, MOEBLAZE_EP_SAVED_HOME, r.T, 0, &bytes));
  Block home(short_by(r, kHomeShort, bytes));
  check(moeblaze_ep_layer_workspace_size(r.layer, MOEBLAZE_EP_PASS_FORWARD_BEGIN, r.T, 0, &bytes));
  Block begin_workspace(bytes);
  Block exchange(short_by(r, kExchangeShort, r.exchange_bytes));

  moeblaze_ep_forward_args_t fa;
  moeblaze_ep_forward_args_init(&fa, sizeof fa);
  fa.num_tokens = r.T;
  fa.x = r.x->ptr;
  fa.w_router = r.w_router->ptr;
  fa.w_gate = r.w_gate->ptr;
  fa.w_up = r.w_up->ptr;
  fa.w_down = r.w_down->ptr;
  fa.y = r.y->ptr;
  if (r.optional_outputs) {
    fa.logits_out = r.logits_out->ptr;
    fa.ids_out = static_cast<int32_t*>(r.ids_out->ptr);
    fa.g_out = r.g_out->ptr;
    fa.expert_counts = static_cast<int32_t*>(r.counts->ptr);
    fa.losses = r.losses->ptr;
  }
  fa.home_saved = home.ptr;
  fa.home_saved_bytes = home.size;
  fa.workspace = begin_workspace.ptr;
  fa.workspace_bytes = begin_workspace.size;
  int64_t recv_rows = 0;
  moeblaze_status_t status =
      moeblaze_ep_forward_begin(r.layer, &fa, exchange.ptr, exchange.size, &recv_rows, nullptr);
  check(status);
  if (status != MOEBLAZE_OK) return;
  if (recv_rows < 0 || recv_rows > r.most_rows) {
    std::fprintf(stderr, "fuzz_ep: recv_rows %lld outside the header's bound %lld\n",
                 (long long)recv_rows, (long long)r.most_rows);
    __builtin_trap();
  }

  size_t finish_bytes = 0, expert_bytes = 0;
  if (moeblaze_ep_layer_workspace_size(r.layer, MOEBLAZE_EP_PASS_FORWARD_FINISH, r.T, recv_rows,
                                       &finish_bytes) != MOEBLAZE_OK ||
      moeblaze_ep_layer_saved_size(r.layer, MOEBLAZE_EP_SAVED_EXPERT, r.T, recv_rows,
                                   &expert_bytes) != MOEBLAZE_OK) {
    std::fprintf(stderr, "fuzz_ep: a size query refused recv_rows %lld from forward_begin: %s\n",
                 (long long)recv_rows, moeblaze_last_error());
    __builtin_trap();
  }
  if (finish_bytes > kMaxLibraryBytes || expert_bytes > kMaxLibraryBytes) {
    fail_the_group(r, fa, exchange);
    return;
  }
  Block finish_workspace(short_by(r, kFinishWorkspaceShort, finish_bytes));
  Block expert(short_by(r, kExpertShort, expert_bytes));
  Block* const buffers[kBufferCount] = {&home, &expert, &exchange};
  overwrite(r.after_begin, buffers);
  fa.expert_saved = expert.ptr;
  fa.expert_saved_bytes = expert.size;
  fa.workspace = finish_workspace.ptr;
  fa.workspace_bytes = finish_workspace.size;
  status = moeblaze_ep_forward_finish(r.layer, &fa, exchange.ptr, exchange.size, nullptr);
  check(status);
  if (status != MOEBLAZE_OK) return;

  overwrite(r.after_finish, buffers);
  size_t backward_bytes = 0;
  check(r.tight_backward_workspace
            ? moeblaze_ep_layer_workspace_size_with_flags(r.layer, MOEBLAZE_EP_PASS_BACKWARD, r.T,
                                                          recv_rows, r.backward_flags,
                                                          &backward_bytes)
            : moeblaze_ep_layer_workspace_size(r.layer, MOEBLAZE_EP_PASS_BACKWARD, r.T, recv_rows,
                                               &backward_bytes));
  if (backward_bytes > kMaxLibraryBytes) backward_bytes = 0;  // refused, on every rank at once
  Block backward_workspace(short_by(r, kBackwardWorkspaceShort, backward_bytes));
  moeblaze_ep_backward_args_t ba;
  moeblaze_ep_backward_args_init(&ba, sizeof ba);
  ba.flags = r.backward_flags;
  ba.num_tokens = r.T;
  ba.dy = r.dy->ptr;
  ba.d_losses = r.pass_d_losses ? r.d_losses->ptr : nullptr;
  ba.x = r.x->ptr;
  ba.w_router = r.w_router->ptr;
  ba.w_gate = r.w_gate->ptr;
  ba.w_up = r.w_up->ptr;
  ba.w_down = r.w_down->ptr;
  ba.home_saved = home.ptr;
  ba.home_saved_bytes = home.size;
  ba.expert_saved = expert.ptr;
  ba.expert_saved_bytes = expert.size;
  ba.dx = r.dx->ptr;
  ba.dw_router = r.dw_router->ptr;
  ba.dw_gate = r.dw_gate->ptr;
  ba.dw_up = r.dw_up->ptr;
  ba.dw_down = r.dw_down->ptr;
  if (r.optional_outputs) {
    ba.dg = r.dg->ptr;
    ba.d_logits = r.d_logits->ptr;
  }
  ba.workspace = backward_workspace.ptr;
  ba.workspace_bytes = backward_workspace.size;
  status = moeblaze_ep_backward(r.layer, &ba, exchange.ptr, exchange.size, nullptr);
  check(status);
  if (status != MOEBLAZE_OK || !r.second_backward) return;
  check(moeblaze_ep_backward(r.layer, &ba, exchange.ptr, exchange.size, nullptr));
}

// One field of `config` changed: a rank that describes another layer than its peers (the group
// must report a collective mismatch on every rank, never act on it).
void change_one_field(Input& in, moeblaze_layer_config_t& config) {
  const uint8_t field = in.byte();
  // Only a configuration the library can accept, so that the changed one is not refused alone
  // (and nothing here overflows).
  if (config.num_experts < 1 || config.top_k < 1 || too_large(config, 1, 1)) return;
  const auto next = [](int32_t value, uint32_t count) {
    return int32_t((uint32_t(value) + 1) % count);
  };
  switch (field % 7) {
    case 0: config.d_model += 1; break;
    case 1: config.d_ffn += 1; break;
    case 2: config.num_experts += 1; break;
    case 3: config.top_k = config.top_k % config.num_experts + 1; break;
    case 4: config.activation = next(config.activation, 7); break;
    case 5: config.score_function = next(config.score_function, 3); break;
    default: config.dtype = next(config.dtype, 4); break;
  }
}

int run_one(const uint8_t* data, size_t size) {
  Input in(data, size);
  const moeblaze_layer_config_t config = draw_config(in);
  const int64_t world = in.small(1, 3);
  if (world < 1 || world > kMaxRanks) {
    moeblaze_ep_group_t group = nullptr;
    check(moeblaze_ep_local_group_create(&group, int32_t(world)));  // must refuse, or be destroyed
    moeblaze_ep_local_group_destroy(group);
    return 0;
  }
  moeblaze_ep_group_t group = nullptr;
  moeblaze_status_t status = moeblaze_ep_local_group_create(&group, int32_t(world));
  check(status);
  if (status != MOEBLAZE_OK) return 0;
  struct DestroyGroup {
    moeblaze_ep_group_t g;
    ~DestroyGroup() { moeblaze_ep_local_group_destroy(g); }
  } destroy_group{group};

  std::vector<Rank> ranks(static_cast<size_t>(world));
  for (int32_t rank = 0; rank < int32_t(world); ++rank) {
    moeblaze_ep_config_t ep;
    moeblaze_ep_config_init(&ep, sizeof ep);
    ep.transport = MOEBLAZE_EP_TRANSPORT_LOCAL;
    ep.rank = rank;
    ep.world_size = int32_t(world);
    ep.communicator = group;
    Rank& r = ranks[size_t(rank)];
    r.config = config;
    if (in.byte() == 7) change_one_field(in, r.config);
    status = moeblaze_ep_layer_create(&r.layer, rank_context(rank), &r.config, &ep);
    check(status);
    if (status != MOEBLAZE_OK) return 0;  // each rank must hold a layer to make the calls
  }

  // Token counts, then the size guard over the largest rows any rank can receive.
  int64_t most_tokens = 0;
  for (Rank& r : ranks) {
    r.T = in.small(0, 5);
    if (r.T < 0 || r.T > (int64_t(1) << 16)) return 0;  // refused by forward_begin, not run here
    most_tokens = r.T > most_tokens ? r.T : most_tokens;
  }
  for (Rank& r : ranks) {
    if (too_large(r.config, world * most_tokens, r.config.top_k)) return 0;
  }
  for (Rank& r : ranks) {
    const int64_t k = r.config.top_k;
    int64_t begin = 0, end = 0;
    check(moeblaze_ep_layer_get_experts(r.layer, &begin, &end));
    r.experts = end - begin;
    check(moeblaze_ep_layer_exchange_size(r.layer, &r.exchange_bytes));
    r.most_rows = world * most_tokens * (k < r.experts ? k : r.experts);
    size_t bytes[4] = {};
    check(moeblaze_ep_layer_saved_size(r.layer, MOEBLAZE_EP_SAVED_HOME, r.T, 0, &bytes[0]));
    check(moeblaze_ep_layer_saved_size(r.layer, MOEBLAZE_EP_SAVED_EXPERT, r.T, r.most_rows,
                                       &bytes[1]));
    check(moeblaze_ep_layer_workspace_size(r.layer, MOEBLAZE_EP_PASS_FORWARD_FINISH, r.T,
                                           r.most_rows, &bytes[2]));
    check(moeblaze_ep_layer_workspace_size(r.layer, MOEBLAZE_EP_PASS_BACKWARD, r.T, r.most_rows,
                                           &bytes[3]));
    for (size_t b : bytes) {
      if (b > kMaxLibraryBytes) return 0;
    }
  }

  // Each rank's tensors and choices.
  for (Rank& r : ranks) {
    const moeblaze_layer_config_t& config = r.config;
    const int64_t d = config.d_model, h = config.d_ffn, E = config.num_experts, k = config.top_k;
    const size_t es = dtype_size(config.dtype);
    const int32_t routing = routing_dtype(config.dtype);
    const size_t rs = dtype_size(routing);
    const size_t T = size_t(r.T), Er = size_t(r.experts);
    const auto block = [](size_t bytes) { return std::make_unique<Block>(bytes); };
    r.x = block(es * T * d);
    r.w_router = block(es * E * d);
    r.w_gate = block(es * Er * h * d);
    r.w_up = block(es * Er * h * d);
    r.w_down = block(es * Er * d * h);
    r.dy = block(es * T * d);
    r.y = block(es * T * d);
    r.dx = block(es * T * d);
    r.dw_router = block(es * E * d);
    r.dw_gate = block(es * Er * h * d);
    r.dw_up = block(es * Er * h * d);
    r.dw_down = block(es * Er * d * h);
    r.dg = block(rs * T * k);
    r.d_logits = block(rs * T * E);
    r.logits_out = block(rs * T * E);
    r.ids_out = block(4 * T * k);
    r.g_out = block(rs * T * k);
    r.counts = block(4 * E);
    r.losses = block(rs * 2);
    r.d_losses = block(rs * 2);
    for (const auto* b : {&r.x, &r.w_router, &r.w_gate, &r.w_up, &r.w_down, &r.dy}) {
      fill(in, **b, config.dtype);
    }
    fill(in, *r.d_losses, routing);
    const uint8_t choices = in.byte();
    r.optional_outputs = choices & 1;
    r.pass_d_losses = choices & 2;
    r.backward_flags = (choices >> 2) & 3;
    r.tight_backward_workspace = choices & 16;
    const uint8_t short_choice = in.byte();
    r.short_buffer = short_choice < 16 ? Short(short_choice % kShortCount) : kNoneShort;
    for (auto* writes : {&r.after_begin, &r.after_finish}) {
      for (int n = in.byte() % 4; n > 0; --n) {
        const Buffer buffer = Buffer(in.byte() % kBufferCount);
        const uint32_t at = in.u32();
        writes->push_back({buffer, at, in.byte()});
      }
    }
  }

  const bool second_backward = in.byte() & 1;
  for (Rank& r : ranks) r.second_backward = second_backward;
  RankThreads::get().run(int32_t(world), [&](int32_t rank) { run_rank(ranks[size_t(rank)]); });
  return 0;
}

}  // namespace

MOEBLAZE_FUZZ_TARGET("fuzz_ep", run_one)
