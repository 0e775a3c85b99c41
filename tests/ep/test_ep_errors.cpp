// Argument validation of the expert-parallel entry points: every failure has the right status and a
// message naming the argument; nothing crashes, nothing hangs (one-rank groups, or a mismatch that
// every rank of the group detects).
#include <chrono>
#include <functional>
#include <thread>

#include "ep/ep_support.hpp"

using namespace mbtest;
using namespace mbtest::ep;

namespace {

bool last_error_mentions(const char* text) {
  return std::strstr(moeblaze_last_error(), text) != nullptr;
}

#define CHECK_ERROR_NAMES(call, status, text)                                             \
  do {                                                                                    \
    MB_CHECK_STATUS(call, status);                                                        \
    CHECK_MESSAGE(last_error_mentions(text),                                              \
                  "the message should name '" << text << "': " << moeblaze_last_error()); \
  } while (0)

struct Group {
  moeblaze_ep_group_t handle = nullptr;
  explicit Group(int32_t world) { MB_CHECK(moeblaze_ep_local_group_create(&handle, world)); }
  ~Group() { moeblaze_ep_local_group_destroy(handle); }
};

moeblaze_ep_config_t local_config(const Group& group, int32_t rank, int32_t world) {
  moeblaze_ep_config_t ep;
  MB_CHECK(moeblaze_ep_config_init(&ep, sizeof ep));
  ep.transport = MOEBLAZE_EP_TRANSPORT_LOCAL;
  ep.rank = rank;
  ep.world_size = world;
  ep.communicator = group.handle;
  return ep;
}

struct EpLayer {
  moeblaze_ep_layer_t handle = nullptr;
  EpLayer(const Context& context, const moeblaze_layer_config_t& config,
          const moeblaze_ep_config_t& ep) {
    MB_CHECK(moeblaze_ep_layer_create(&handle, context.get(), &config, &ep));
  }
  ~EpLayer() { moeblaze_ep_layer_destroy(handle); }
};

// One forward_begin of `layer` on `T` tokens of `g` with buffers of its own (x NULL with
// `x_null`): its status and the thread's last error.
struct CallResult {
  moeblaze_status_t status = MOEBLAZE_OK;
  std::string message;
};

CallResult begin_once(moeblaze_ep_layer_t layer, const Global& g, int64_t T, bool x_null = false) {
  size_t bytes = 0, ws = 0;
  moeblaze_ep_layer_exchange_size(layer, &bytes);
  AlignedBytes exchange(bytes);
  moeblaze_ep_layer_saved_size(layer, MOEBLAZE_EP_SAVED_HOME, T, 0, &bytes);
  AlignedBytes home(bytes);
  moeblaze_ep_layer_workspace_size(layer, MOEBLAZE_EP_PASS_FORWARD_BEGIN, T, 0, &ws);
  AlignedBytes workspace(ws);
  moeblaze_ep_forward_args_t fa;
  moeblaze_ep_forward_args_init(&fa, sizeof fa);
  fa.num_tokens = T;
  fa.x = x_null ? nullptr : g.x.data();
  fa.w_router = g.w_router.data();
  fa.home_saved = home.data();
  fa.home_saved_bytes = home.size();
  fa.workspace = workspace.data();
  fa.workspace_bytes = workspace.size();
  int64_t recv = 0;
  CallResult r;
  r.status =
      moeblaze_ep_forward_begin(layer, &fa, exchange.data(), exchange.size(), &recv, nullptr);
  r.message = moeblaze_last_error();
  return r;
}

// body(0) and body(1) on two threads at once, as two ranks (or two callers of one rank) make their
// calls; CHECKs that both returned well within the LOCAL group's timeout (they must fail at once).
std::vector<CallResult> on_two_threads(const std::function<CallResult(int)>& body) {
  std::vector<CallResult> results(2);
  const auto start = std::chrono::steady_clock::now();
  std::thread first([&] { results[0] = body(0); }), second([&] { results[1] = body(1); });
  first.join();
  second.join();
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
  return results;
}

}  // namespace

TEST_CASE("ep errors: config init and group creation") {
  moeblaze_ep_config_t ep;
  MB_CHECK(moeblaze_ep_config_init(&ep, sizeof ep));
  CHECK(ep.struct_size == sizeof ep);
  CHECK(ep.transport == MOEBLAZE_EP_TRANSPORT_NCCL);
  CHECK(ep.rank == 0);
  CHECK(ep.world_size == 1);
  CHECK(ep.communicator == nullptr);
  MB_CHECK_STATUS(moeblaze_ep_config_init(nullptr, sizeof ep), MOEBLAZE_ERR_INVALID_ARGUMENT);
  MB_CHECK_STATUS(moeblaze_ep_config_init(&ep, 4), MOEBLAZE_ERR_VERSION_MISMATCH);
  moeblaze_ep_forward_args_t fa;
  MB_CHECK(moeblaze_ep_forward_args_init(&fa, sizeof fa));
  CHECK(fa.x == nullptr);
  moeblaze_ep_backward_args_t ba;
  MB_CHECK(moeblaze_ep_backward_args_init(&ba, sizeof ba));
  CHECK(ba.dx == nullptr);

  moeblaze_ep_group_t group = reinterpret_cast<moeblaze_ep_group_t>(&ep);
  CHECK_ERROR_NAMES(moeblaze_ep_local_group_create(nullptr, 2), MOEBLAZE_ERR_INVALID_ARGUMENT,
                    "out");
  CHECK_ERROR_NAMES(moeblaze_ep_local_group_create(&group, 0), MOEBLAZE_ERR_INVALID_ARGUMENT,
                    "world_size");
  CHECK(group == nullptr);
  MB_CHECK(moeblaze_ep_local_group_destroy(nullptr));
  CHECK_ERROR_NAMES(moeblaze_ep_local_group_destroy(reinterpret_cast<moeblaze_ep_group_t>(&ep)),
                    MOEBLAZE_ERR_INVALID_HANDLE, "group");
}

TEST_CASE("ep errors: layer creation") {
  Context context;
  Context other;
  Group group(2);
  const moeblaze_layer_config_t config = make_config(MOEBLAZE_DTYPE_F32, 8, 8, 4, 2);
  moeblaze_ep_config_t ep = local_config(group, 0, 2);
  moeblaze_ep_layer_t layer = reinterpret_cast<moeblaze_ep_layer_t>(&ep);

  CHECK_ERROR_NAMES(moeblaze_ep_layer_create(nullptr, context.get(), &config, &ep),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "out");
  CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, nullptr, &config, &ep),
                    MOEBLAZE_ERR_INVALID_HANDLE, "context");
  CHECK(layer == nullptr);
  CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), nullptr, &ep),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "config");
  CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, nullptr),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "ep_config");
  {
    moeblaze_layer_config_t bad = config;
    bad.top_k = 9;
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &bad, &ep),
                      MOEBLAZE_ERR_INVALID_ARGUMENT, "top_k");
  }
  {
    moeblaze_ep_config_t bad = ep;
    bad.struct_size = 4;
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, &bad),
                      MOEBLAZE_ERR_VERSION_MISMATCH, "ep_config");
  }
  {
    moeblaze_ep_config_t bad = ep;
    bad.rank = 2;
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, &bad),
                      MOEBLAZE_ERR_INVALID_ARGUMENT, "rank");
    bad.rank = -1;
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, &bad),
                      MOEBLAZE_ERR_INVALID_ARGUMENT, "rank");
  }
  {
    Group big(5);
    moeblaze_ep_config_t bad = local_config(big, 0, 5);  // 5 ranks, 4 experts
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, &bad),
                      MOEBLAZE_ERR_INVALID_ARGUMENT, "world_size");
    bad.world_size = 0;
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, &bad),
                      MOEBLAZE_ERR_INVALID_ARGUMENT, "world_size");
  }
  {
    moeblaze_ep_config_t bad = ep;
    bad.world_size = 3;  // the group has 2 ranks
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, &bad),
                      MOEBLAZE_ERR_INVALID_ARGUMENT, "world_size");
  }
  {
    moeblaze_ep_config_t bad = ep;
    bad.communicator = nullptr;
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, &bad),
                      MOEBLAZE_ERR_INVALID_ARGUMENT, "communicator");
    bad.communicator = context.get();  // a live handle of the wrong kind
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, &bad),
                      MOEBLAZE_ERR_INVALID_HANDLE, "communicator");
  }
  {
    moeblaze_ep_config_t bad = ep;
    bad.transport = 7;
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, &bad),
                      MOEBLAZE_ERR_NOT_SUPPORTED, "transport");
    bad.transport = MOEBLAZE_EP_TRANSPORT_NCCL;  // NCCL needs a CUDA context
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, &bad),
                      MOEBLAZE_ERR_NOT_SUPPORTED, "NCCL");
  }
  {
    // A destroyed group.
    moeblaze_ep_group_t gone = nullptr;
    MB_CHECK(moeblaze_ep_local_group_create(&gone, 2));
    MB_CHECK(moeblaze_ep_local_group_destroy(gone));
    moeblaze_ep_config_t bad = ep;
    bad.communicator = gone;
    CHECK_ERROR_NAMES(moeblaze_ep_layer_create(&layer, context.get(), &config, &bad),
                      MOEBLAZE_ERR_INVALID_HANDLE, "communicator");
  }
  CHECK(layer == nullptr);

  // A group keeps working after its handle is destroyed while layers use it.
  moeblaze_ep_group_t short_lived = nullptr;
  MB_CHECK(moeblaze_ep_local_group_create(&short_lived, 1));
  moeblaze_ep_config_t one;
  MB_CHECK(moeblaze_ep_config_init(&one, sizeof one));
  one.transport = MOEBLAZE_EP_TRANSPORT_LOCAL;
  one.communicator = short_lived;
  MB_CHECK(moeblaze_ep_layer_create(&layer, context.get(), &config, &one));
  MB_CHECK(moeblaze_ep_local_group_destroy(short_lived));
  int64_t begin = -1, end = -1;
  MB_CHECK(moeblaze_ep_layer_get_experts(layer, &begin, &end));
  CHECK(begin == 0);
  CHECK(end == 4);
  MB_CHECK(moeblaze_ep_layer_destroy(layer));
  MB_CHECK(moeblaze_ep_layer_destroy(nullptr));
  CHECK_ERROR_NAMES(moeblaze_ep_layer_destroy(layer), MOEBLAZE_ERR_INVALID_HANDLE, "layer");
}

TEST_CASE("ep errors: queries") {
  Context context;
  Group group(2);
  const moeblaze_layer_config_t config = make_config(MOEBLAZE_DTYPE_F32, 8, 8, 5, 2);
  EpLayer layer(context, config, local_config(group, 1, 2));
  Layer plain(context, config);
  int64_t begin = -1, end = -1;
  MB_CHECK(moeblaze_ep_layer_get_experts(layer.handle, &begin, &end));
  CHECK(begin == 3);  // E = 5 over 2 ranks: [0, 3) and [3, 5)
  CHECK(end == 5);
  MB_CHECK(moeblaze_ep_layer_get_experts(layer.handle, nullptr, nullptr));
  CHECK_ERROR_NAMES(moeblaze_ep_layer_get_experts(nullptr, &begin, &end),
                    MOEBLAZE_ERR_INVALID_HANDLE, "layer");
  CHECK_ERROR_NAMES(moeblaze_ep_layer_get_experts(
                        reinterpret_cast<moeblaze_ep_layer_t>(plain.get()), &begin, &end),
                    MOEBLAZE_ERR_INVALID_HANDLE, "moeblaze_layer_t");

  size_t bytes = 1;
  MB_CHECK(moeblaze_ep_layer_exchange_size(layer.handle, &bytes));
  CHECK(bytes >= 2 * 5 * sizeof(int32_t));
  CHECK_ERROR_NAMES(moeblaze_ep_layer_exchange_size(layer.handle, nullptr),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "bytes");
  MB_CHECK(
      moeblaze_ep_layer_workspace_size(layer.handle, MOEBLAZE_EP_PASS_BACKWARD, 10, 7, &bytes));
  CHECK(bytes > 0);
  CHECK_ERROR_NAMES(moeblaze_ep_layer_workspace_size(layer.handle, 3, 10, 7, &bytes),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "pass");
  CHECK(bytes == 0);
  CHECK_ERROR_NAMES(
      moeblaze_ep_layer_workspace_size(layer.handle, MOEBLAZE_EP_PASS_BACKWARD, -1, 7, &bytes),
      MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens");
  CHECK_ERROR_NAMES(moeblaze_ep_layer_workspace_size(layer.handle, MOEBLAZE_EP_PASS_FORWARD_FINISH,
                                                     10, -7, &bytes),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "recv_rows");
  CHECK_ERROR_NAMES(moeblaze_ep_layer_saved_size(layer.handle, 2, 10, 7, &bytes),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "part");
  CHECK_ERROR_NAMES(
      moeblaze_ep_layer_saved_size(layer.handle, MOEBLAZE_EP_SAVED_EXPERT, 10, 7, nullptr),
      MOEBLAZE_ERR_INVALID_ARGUMENT, "bytes");
  // Sizes grow with what they depend on, and only with that.
  size_t small = 0, large = 0;
  MB_CHECK(moeblaze_ep_layer_saved_size(layer.handle, MOEBLAZE_EP_SAVED_EXPERT, 10, 7, &small));
  MB_CHECK(moeblaze_ep_layer_saved_size(layer.handle, MOEBLAZE_EP_SAVED_EXPERT, 10, 70, &large));
  CHECK(large > small);
  MB_CHECK(moeblaze_ep_layer_saved_size(layer.handle, MOEBLAZE_EP_SAVED_HOME, 10, 7, &small));
  MB_CHECK(moeblaze_ep_layer_saved_size(layer.handle, MOEBLAZE_EP_SAVED_HOME, 10, 70, &large));
  CHECK(large == small);

  // The flags-aware query: unknown bits are rejected; the forward passes ignore the flags; on the
  // CPU backend (which ignores CONSUME_SAVED) every size equals the plain query's.
  size_t plain_bytes = 0, with_flags = 1;
  MB_CHECK(moeblaze_ep_layer_workspace_size(layer.handle, MOEBLAZE_EP_PASS_BACKWARD, 10, 7,
                                            &plain_bytes));
  MB_CHECK(moeblaze_ep_layer_workspace_size_with_flags(layer.handle, MOEBLAZE_EP_PASS_BACKWARD, 10,
                                                       7, MOEBLAZE_BACKWARD_CONSUME_SAVED,
                                                       &with_flags));
  CHECK(with_flags == plain_bytes);
  MB_CHECK(moeblaze_ep_layer_workspace_size_with_flags(layer.handle, MOEBLAZE_EP_PASS_BACKWARD, 10,
                                                       7, 0, &with_flags));
  CHECK(with_flags == plain_bytes);
  MB_CHECK(moeblaze_ep_layer_workspace_size(layer.handle, MOEBLAZE_EP_PASS_FORWARD_FINISH, 10, 7,
                                            &plain_bytes));
  MB_CHECK(moeblaze_ep_layer_workspace_size_with_flags(
      layer.handle, MOEBLAZE_EP_PASS_FORWARD_FINISH, 10, 7,
      MOEBLAZE_BACKWARD_CONSUME_SAVED | MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD, &with_flags));
  CHECK(with_flags == plain_bytes);
  CHECK_ERROR_NAMES(moeblaze_ep_layer_workspace_size_with_flags(
                        layer.handle, MOEBLAZE_EP_PASS_BACKWARD, 10, 7, 4u, &with_flags),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "flags");
  CHECK(with_flags == 0);
  CHECK_ERROR_NAMES(
      moeblaze_ep_layer_workspace_size_with_flags(layer.handle, 3, 10, 7, 0, &with_flags),
      MOEBLAZE_ERR_INVALID_ARGUMENT, "pass");
  CHECK_ERROR_NAMES(moeblaze_ep_layer_workspace_size_with_flags(nullptr, MOEBLAZE_EP_PASS_BACKWARD,
                                                                10, 7, 0, &with_flags),
                    MOEBLAZE_ERR_INVALID_HANDLE, "layer");
  CHECK_ERROR_NAMES(moeblaze_ep_layer_workspace_size_with_flags(
                        layer.handle, MOEBLAZE_EP_PASS_BACKWARD, 10, 7, 0, nullptr),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "bytes");
}

namespace {

// A one-rank layer and the buffers of one step, for the call-sequence and argument tests.
struct OneRank {
  Context context;
  Group group{1};
  EpCase c;
  Global g;
  moeblaze_ep_layer_t layer = nullptr;
  HostTensor y, dx;
  AlignedBytes exchange, home, expert, workspace;
  moeblaze_ep_forward_args_t fa;
  moeblaze_ep_backward_args_t ba;
  int64_t recv_rows = -1;

  OneRank() {
    c.tokens = {6};
    g = make_global(c, false);
    const moeblaze_layer_config_t config = c.config();
    const moeblaze_ep_config_t ep = local_config(group, 0, 1);
    MB_CHECK(moeblaze_ep_layer_create(&layer, context.get(), &config, &ep));
    y.reset(c.dtype, {6, c.d});
    dx.reset(c.dtype, {6, c.d});
    size_t bytes = 0;
    MB_CHECK(moeblaze_ep_layer_exchange_size(layer, &bytes));
    exchange.resize(bytes);
    MB_CHECK(moeblaze_ep_layer_saved_size(layer, MOEBLAZE_EP_SAVED_HOME, 6, 0, &bytes));
    home.resize(bytes);
    // Bounds: every pair may land here.
    MB_CHECK(moeblaze_ep_layer_saved_size(layer, MOEBLAZE_EP_SAVED_EXPERT, 6, 6 * c.k, &bytes));
    expert.resize(bytes);
    size_t ws = 0;
    for (int32_t pass : {0, 1, 2}) {
      MB_CHECK(moeblaze_ep_layer_workspace_size(layer, pass, 6, 6 * c.k, &bytes));
      ws = std::max(ws, bytes);
    }
    workspace.resize(ws);
    MB_CHECK(moeblaze_ep_forward_args_init(&fa, sizeof fa));
    fa.num_tokens = 6;
    fa.x = g.x.data();
    fa.w_router = g.w_router.data();
    fa.w_gate = g.w_gate.data();
    fa.w_up = g.w_up.data();
    fa.w_down = g.w_down.data();
    fa.y = y.data();
    fa.home_saved = home.data();
    fa.home_saved_bytes = home.size();
    fa.expert_saved = expert.data();
    fa.expert_saved_bytes = expert.size();
    fa.workspace = workspace.data();
    fa.workspace_bytes = workspace.size();
    MB_CHECK(moeblaze_ep_backward_args_init(&ba, sizeof ba));
    ba.num_tokens = 6;
    ba.dy = g.dy.data();
    ba.x = g.x.data();
    ba.w_router = g.w_router.data();
    ba.w_gate = g.w_gate.data();
    ba.w_up = g.w_up.data();
    ba.w_down = g.w_down.data();
    ba.home_saved = home.data();
    ba.home_saved_bytes = home.size();
    ba.expert_saved = expert.data();
    ba.expert_saved_bytes = expert.size();
    ba.dx = dx.data();
    ba.workspace = workspace.data();
    ba.workspace_bytes = workspace.size();
  }
  ~OneRank() { moeblaze_ep_layer_destroy(layer); }

  moeblaze_status_t begin(const moeblaze_ep_forward_args_t& args) {
    return moeblaze_ep_forward_begin(layer, &args, exchange.data(), exchange.size(), &recv_rows,
                                     nullptr);
  }
  moeblaze_status_t finish(const moeblaze_ep_forward_args_t& args) {
    return moeblaze_ep_forward_finish(layer, &args, exchange.data(), exchange.size(), nullptr);
  }
  moeblaze_status_t backward(const moeblaze_ep_backward_args_t& args) {
    return moeblaze_ep_backward(layer, &args, exchange.data(), exchange.size(), nullptr);
  }
};

}  // namespace

TEST_CASE("ep errors: call order (finish without begin, backward without finish, twice)") {
  OneRank one;
  // A fresh (zeroed) exchange buffer was never begun.
  CHECK_ERROR_NAMES(one.finish(one.fa), MOEBLAZE_ERR_INVALID_ARGUMENT, "forward_begin");
  CHECK_ERROR_NAMES(one.backward(one.ba), MOEBLAZE_ERR_INVALID_ARGUMENT, "forward_begin");
  MB_CHECK(one.begin(one.fa));
  CHECK(one.recv_rows == 6 * one.c.k);  // one rank owns every expert
  CHECK_ERROR_NAMES(one.backward(one.ba), MOEBLAZE_ERR_INVALID_ARGUMENT, "forward_finish");
  moeblaze_ep_forward_args_t other_tokens = one.fa;
  other_tokens.num_tokens = 5;
  CHECK_ERROR_NAMES(one.finish(other_tokens), MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens");
  MB_CHECK(one.finish(one.fa));
  CHECK_ERROR_NAMES(one.finish(one.fa), MOEBLAZE_ERR_INVALID_ARGUMENT, "already finished");
  MB_CHECK(one.backward(one.ba));
  MB_CHECK(one.backward(one.ba));  // backward may run more than once per step
  moeblaze_ep_backward_args_t bad_tokens = one.ba;
  bad_tokens.num_tokens = 7;
  CHECK_ERROR_NAMES(one.backward(bad_tokens), MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens");
  // An exchange of another layer (another configuration) is refused.
  EpCase other_case;
  other_case.E = 4;
  other_case.tokens = {6};
  const moeblaze_layer_config_t other_config = other_case.config();
  const moeblaze_ep_config_t ep = local_config(one.group, 0, 1);
  EpLayer other(one.context, other_config, ep);
  CHECK_ERROR_NAMES(moeblaze_ep_forward_finish(other.handle, &one.fa, one.exchange.data(),
                                               one.exchange.size(), nullptr),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "exchange");
}

TEST_CASE("ep errors: arguments of the execute calls") {
  OneRank one;
  CHECK_ERROR_NAMES(moeblaze_ep_forward_begin(nullptr, &one.fa, one.exchange.data(),
                                              one.exchange.size(), &one.recv_rows, nullptr),
                    MOEBLAZE_ERR_INVALID_HANDLE, "layer");
  CHECK_ERROR_NAMES(moeblaze_ep_forward_begin(one.layer, nullptr, one.exchange.data(),
                                              one.exchange.size(), &one.recv_rows, nullptr),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "args");
  CHECK_ERROR_NAMES(moeblaze_ep_forward_begin(one.layer, &one.fa, one.exchange.data(),
                                              one.exchange.size(), nullptr, nullptr),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "recv_rows");
  CHECK_ERROR_NAMES(moeblaze_ep_forward_begin(one.layer, &one.fa, nullptr, one.exchange.size(),
                                              &one.recv_rows, nullptr),
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "exchange");
  CHECK_ERROR_NAMES(moeblaze_ep_forward_begin(one.layer, &one.fa, one.exchange.data(), 8,
                                              &one.recv_rows, nullptr),
                    MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "exchange_bytes");
  {
    moeblaze_ep_forward_args_t a = one.fa;
    a.struct_size = 8;
    CHECK_ERROR_NAMES(one.begin(a), MOEBLAZE_ERR_VERSION_MISMATCH, "args");
    a = one.fa;
    a.flags = 1;
    CHECK_ERROR_NAMES(one.begin(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->flags");
    a = one.fa;
    a.x = nullptr;
    CHECK_ERROR_NAMES(one.begin(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->x");
    a = one.fa;
    a.w_router = nullptr;
    CHECK_ERROR_NAMES(one.begin(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->w_router");
    a = one.fa;
    a.x = static_cast<const unsigned char*>(one.g.x.data()) + 1;
    CHECK_ERROR_NAMES(one.begin(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->x");
    a = one.fa;
    a.num_tokens = -1;
    CHECK_ERROR_NAMES(one.begin(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->num_tokens");
    a = one.fa;
    a.home_saved_bytes = 16;
    CHECK_ERROR_NAMES(one.begin(a), MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "args->home_saved_bytes");
    a = one.fa;
    a.workspace = nullptr;
    CHECK_ERROR_NAMES(one.begin(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->workspace");
    // Memory a call writes shared with another argument.
    a = one.fa;
    a.workspace = a.home_saved;
    CHECK_ERROR_NAMES(one.begin(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "overlap");
    a = one.fa;
    a.home_saved = const_cast<void*>(a.x);
    CHECK_ERROR_NAMES(one.begin(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->home_saved");
  }
  MB_CHECK(one.begin(one.fa));
  {
    moeblaze_ep_forward_args_t a = one.fa;
    a.w_up = nullptr;  // SwiGLU is gated
    CHECK_ERROR_NAMES(one.finish(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->w_up");
    a = one.fa;
    a.y = nullptr;
    CHECK_ERROR_NAMES(one.finish(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->y");
    a = one.fa;
    a.expert_saved = nullptr;
    CHECK_ERROR_NAMES(one.finish(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->expert_saved");
    a = one.fa;
    a.expert_saved_bytes = 64;
    CHECK_ERROR_NAMES(one.finish(a), MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
                      "args->expert_saved_bytes");
    a = one.fa;
    a.workspace_bytes = 64;
    CHECK_ERROR_NAMES(one.finish(a), MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "args->workspace_bytes");
    a = one.fa;
    a.workspace = a.expert_saved;  // its declared size may reach other buffers too: one is named
    CHECK_ERROR_NAMES(one.finish(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->workspace");
    a = one.fa;
    a.y = const_cast<void*>(a.x);
    CHECK_ERROR_NAMES(one.finish(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->y");
  }
  MB_CHECK(one.finish(one.fa));
  {
    moeblaze_ep_backward_args_t a = one.ba;
    a.flags = 4;
    CHECK_ERROR_NAMES(one.backward(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->flags");
    a = one.ba;
    a.dy = nullptr;
    CHECK_ERROR_NAMES(one.backward(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->dy");
    a = one.ba;
    a.expert_saved = nullptr;
    CHECK_ERROR_NAMES(one.backward(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "expert_saved");
    a = one.ba;
    a.dg = static_cast<unsigned char*>(one.dx.data()) + 2;
    CHECK_ERROR_NAMES(one.backward(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->dg");
    a = one.ba;
    a.dx = const_cast<void*>(a.x);  // the router's dw_router reads x after dx is written
    CHECK_ERROR_NAMES(one.backward(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->dx");
    a = one.ba;
    a.workspace = const_cast<void*>(a.expert_saved);
    CHECK_ERROR_NAMES(one.backward(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->workspace");
  }
  MB_CHECK(one.backward(one.ba));
}

TEST_CASE("ep errors: a collective mismatch fails on every rank instead of corrupting data") {
  // Rank 0 runs a layer with E = 8, rank 1 one with E = 6: their exchanges do not match.
  Group group(2);
  std::vector<moeblaze_status_t> status(2, MOEBLAZE_OK);
  std::vector<std::string> message(2);
  auto body = [&](int32_t rank) {
    Context context;
    EpCase c;
    c.E = rank == 0 ? 8 : 6;
    c.tokens = {4, 4};
    Global g = make_global(c, false);
    const moeblaze_layer_config_t config = c.config();
    moeblaze_ep_config_t ep;
    moeblaze_ep_config_init(&ep, sizeof ep);
    ep.transport = MOEBLAZE_EP_TRANSPORT_LOCAL;
    ep.rank = rank;
    ep.world_size = 2;
    ep.communicator = group.handle;
    moeblaze_ep_layer_t layer = nullptr;
    status[size_t(rank)] = moeblaze_ep_layer_create(&layer, context.get(), &config, &ep);
    if (status[size_t(rank)] != MOEBLAZE_OK) return;
    const CallResult r = begin_once(layer, g, 4);
    status[size_t(rank)] = r.status;
    message[size_t(rank)] = r.message;
    moeblaze_ep_layer_destroy(layer);
  };
  std::thread rank0(body, 0), rank1(body, 1);
  rank0.join();
  rank1.join();
  for (int rank = 0; rank < 2; ++rank) {
    CHECK_MESSAGE(status[size_t(rank)] == MOEBLAZE_ERR_INVALID_ARGUMENT,
                  "rank " << rank << ": " << message[size_t(rank)]);
    CHECK_MESSAGE(message[size_t(rank)].find("collective mismatch") != std::string::npos,
                  message[size_t(rank)]);
  }
}

TEST_CASE("ep errors: two layers calling as one rank of a LOCAL group fail at once") {
  // Rank 1's layer exists but stays idle; two layers both claim rank 0. The group's barrier counts
  // arrivals, so without the check it passed with two rank-0 postings and read rank 1's stale one
  // (a use after free once that layer was gone). Both calls must fail now, without waiting out the
  // group's timeout, and the group stays broken.
  Group group(2);
  Context context;
  EpCase c;
  c.tokens = {4, 4};
  Global g = make_global(c, false);
  const moeblaze_layer_config_t config = c.config();
  EpLayer idle_rank1(context, config, local_config(group, 1, 2));
  EpLayer first(context, config, local_config(group, 0, 2));
  EpLayer second(context, config, local_config(group, 0, 2));
  const std::vector<CallResult> r = on_two_threads(
      [&](int which) { return begin_once((which == 0 ? first : second).handle, g, 4); });
  // The second to arrive is refused; the first, waiting at the barrier, fails with the group.
  for (const CallResult& call : r) {
    CHECK_MESSAGE(call.status == MOEBLAZE_ERR_INVALID_ARGUMENT, call.message);
    CHECK_MESSAGE(call.message.find("claimed rank 0") != std::string::npos, call.message);
  }
}

TEST_CASE("ep errors: a bad argument on one rank fails its peer at once, naming it") {
  // Rank 1 passes x = NULL; rank 0's valid call must not wait out the group's timeout for a
  // collective rank 1 will not make: it fails with rank 1's status and reason.
  Group group(2);
  const std::vector<CallResult> r = on_two_threads([&](int rank) {
    Context context;
    EpCase c;
    c.tokens = {4, 4};
    Global g = make_global(c, false);
    EpLayer layer(context, c.config(), local_config(group, rank, 2));
    return begin_once(layer.handle, g, 4, /*x_null=*/rank == 1);
  });
  for (const CallResult& call : r) {
    CHECK_MESSAGE(call.status == MOEBLAZE_ERR_INVALID_ARGUMENT, call.message);
    CHECK_MESSAGE(call.message.find("args->x") != std::string::npos, call.message);
  }
  CHECK_MESSAGE(r[0].message.find("rank 1") != std::string::npos, r[0].message);
}

TEST_CASE("ep errors: an EXPERT saved buffer of another step is refused") {
  // Backward of step 2 given step 1's EXPERT buffer (same recv_rows) returned OK with other dx
  // and weight gradients; the buffer now carries its step, checked against `exchange`.
  OneRank one;
  MB_CHECK(one.begin(one.fa));
  MB_CHECK(one.finish(one.fa));
  const std::vector<unsigned char> step1(
      static_cast<const unsigned char*>(one.expert.data()),
      static_cast<const unsigned char*>(one.expert.data()) + one.expert.size());
  MB_CHECK(one.begin(one.fa));
  MB_CHECK(one.finish(one.fa));
  const std::vector<unsigned char> step2(
      static_cast<const unsigned char*>(one.expert.data()),
      static_cast<const unsigned char*>(one.expert.data()) + one.expert.size());
  std::memcpy(one.expert.data(), step1.data(), step1.size());
  CHECK_ERROR_NAMES(one.backward(one.ba), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->expert_saved");
  std::memset(one.expert.data(), 0, 16);  // its header overwritten
  CHECK_ERROR_NAMES(one.backward(one.ba), MOEBLAZE_ERR_INVALID_ARGUMENT, "args->expert_saved");
  std::memcpy(one.expert.data(), step2.data(), step2.size());
  MB_CHECK(one.backward(one.ba));
}

TEST_CASE("ep errors: a HOME saved buffer or exchange overwritten between calls is refused") {
  // The HOME buffer and `exchange` are the caller's memory between forward_begin, forward_finish
  // and backward; their indices and counts address x, dy and the workspace. Every overwrite below
  // once read or wrote outside the buffers (scatter_rows, gather_rows); now each is reported.
  OneRank one;
  const int64_t T = 6, k = one.c.k, E = one.c.E;
  const int32_t N = int32_t(T * k);
  std::vector<int32_t> ids(size_t(T * k), -1);
  one.fa.ids_out = ids.data();
  MB_CHECK(one.begin(one.fa));
  MB_CHECK(one.finish(one.fa));
  one.fa.ids_out = nullptr;
  const ReferenceRoutingIndex index = routing_index_of(ids, T, E, k);

  MB_CHECK(one.begin(one.fa));  // a fresh step; the same inputs route the same way
  const std::vector<unsigned char> home(
      static_cast<const unsigned char*>(one.home.data()),
      static_cast<const unsigned char*>(one.home.data()) + one.home.size());
  const std::vector<unsigned char> exchange(
      static_cast<const unsigned char*>(one.exchange.data()),
      static_cast<const unsigned char*>(one.exchange.data()) + one.exchange.size());
  auto restore = [&] {
    std::memcpy(one.home.data(), home.data(), home.size());
    std::memcpy(one.exchange.data(), exchange.data(), exchange.size());
  };
  const int64_t tokens_at =
      find_int32_sequence(one.home.data(), one.home.size(), index.expert_token_indices);
  const int64_t map_at =
      find_int32_sequence(one.home.data(), one.home.size(), index.token_index_map);
  const int64_t offsets_at =
      find_int32_sequence(one.home.data(), one.home.size(), index.expert_offsets);
  const int64_t ids_at = find_int32_sequence(one.home.data(), one.home.size(), ids);
  REQUIRE(tokens_at >= 0);
  REQUIRE(map_at >= 0);
  REQUIRE(offsets_at >= 0);
  REQUIRE(ids_at >= 0);
  auto home_word = [&](int64_t at, int64_t i) -> int32_t& {
    return reinterpret_cast<int32_t*>(static_cast<unsigned char*>(one.home.data()) + at)[i];
  };

  struct Overwrite {
    const char* what;
    int64_t at, i;
    int32_t value;
  };
  const Overwrite overwrites[] = {
      {"a token index past T", tokens_at, 2, int32_t(T) + 1000},
      {"a negative token index", tokens_at, 0, -100000},
      {"a row index past N", map_at, 3, N + 1000},
      {"a negative row index", map_at, 1, -1},
      {"a row named twice", map_at, 1, index.token_index_map[0]},
      {"offsets past N", offsets_at, E, N + 64},
      {"an id out of range", ids_at, 4, int32_t(E) + 3},
  };
  for (const Overwrite& o : overwrites) {
    CAPTURE(o.what);
    restore();
    home_word(o.at, o.i) = o.value;
    CHECK_ERROR_NAMES(one.finish(one.fa), MOEBLAZE_ERR_INVALID_ARGUMENT, "home_saved");
  }
  // The whole buffer cleared (or never written by this layer's forward_begin).
  restore();
  std::memset(one.home.data(), 0, one.home.size());
  CHECK_ERROR_NAMES(one.finish(one.fa), MOEBLAZE_ERR_INVALID_ARGUMENT, "home_saved");
  // Its count table changed against the one in `exchange`.
  restore();
  std::vector<int32_t> counts(
      static_cast<size_t>(E));  // the count table of one rank: tokens per expert
  for (int64_t e = 0; e < E; ++e) {
    counts[size_t(e)] = index.expert_offsets[size_t(e + 1)] - index.expert_offsets[size_t(e)];
  }
  const int64_t table_at = find_int32_sequence(one.home.data(), one.home.size(), counts);
  const int64_t exchange_table_at =
      find_int32_sequence(one.exchange.data(), one.exchange.size(), counts);
  REQUIRE(table_at >= 0);
  REQUIRE(exchange_table_at >= 0);
  int32_t* table = reinterpret_cast<int32_t*>(static_cast<unsigned char*>(one.exchange.data()) +
                                              exchange_table_at);
  home_word(table_at, 0) += 1;
  CHECK_ERROR_NAMES(one.finish(one.fa), MOEBLAZE_ERR_INVALID_ARGUMENT, "count table");
  // The count table in `exchange`: a negative count, and one that no longer matches T * k.
  restore();
  table[1] = -3;
  CHECK_ERROR_NAMES(one.finish(one.fa), MOEBLAZE_ERR_INVALID_ARGUMENT, "exchange");
  restore();
  table[0] += 1 << 20;
  CHECK_ERROR_NAMES(one.finish(one.fa), MOEBLAZE_ERR_INVALID_ARGUMENT, "exchange");

  // The HOME buffer of another step: a second forward_begin into other buffers, then finish with
  // this step's `exchange` and the other step's HOME buffer.
  restore();
  {
    AlignedBytes other_home(one.home.size()), other_exchange(one.exchange.size());
    moeblaze_ep_forward_args_t a = one.fa;
    a.home_saved = other_home.data();
    int64_t recv = 0;
    MB_CHECK(moeblaze_ep_forward_begin(one.layer, &a, other_exchange.data(), other_exchange.size(),
                                       &recv, nullptr));
    CHECK_ERROR_NAMES(one.finish(a), MOEBLAZE_ERR_INVALID_ARGUMENT, "another forward step");
  }

  // Untouched, the step finishes; then backward refuses a HOME buffer overwritten after finish
  // (its gather once read before the caller's dy).
  MB_CHECK(one.finish(one.fa));
  const std::vector<unsigned char> finished(
      static_cast<const unsigned char*>(one.home.data()),
      static_cast<const unsigned char*>(one.home.data()) + one.home.size());
  for (const Overwrite& o : overwrites) {
    CAPTURE(o.what);
    std::memcpy(one.home.data(), finished.data(), finished.size());
    home_word(o.at, o.i) = o.value;
    CHECK_ERROR_NAMES(one.backward(one.ba), MOEBLAZE_ERR_INVALID_ARGUMENT, "home_saved");
  }
  std::memcpy(one.home.data(), finished.data(), finished.size());
  MB_CHECK(one.backward(one.ba));
}
