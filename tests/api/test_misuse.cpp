// Misuse that must give a clear status and never touch memory it should not: handles used after
// destroy while their memory is reused, struct_size values no struct has, saved buffers whose
// routing indices the caller overwrote between forward and backward, and buffers a call writes
// that share memory with another argument. Each case here failed before the library checked it (a
// stale handle wrote past the caller's ids_out, a 2.9 GB memset, reads past the saved buffer, a
// wild write from a workspace laid over the saved buffer, dw_router computed from a dx written
// over x).

#include <atomic>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/test_support.hpp"

using namespace mbtest;

namespace {

moeblaze_layer_config_t config_with(int64_t E, int64_t k) {
  return make_config(MOEBLAZE_DTYPE_F32, 8, 12, E, k);
}

}  // namespace

TEST_SUITE("api") {
  TEST_CASE("misuse: a destroyed layer stays invalid when its memory is reused") {
    Context context;
    const moeblaze_layer_config_t small = config_with(2, 1);
    const moeblaze_layer_config_t large = config_with(16, 8);
    // Destroy and create repeatedly: an allocator hands the freed memory to the next create, which
    // an address-keyed registry took for the old handle.
    std::set<moeblaze_layer_t> seen;
    for (int round = 0; round < 64; ++round) {
      moeblaze_layer_t stale = nullptr;
      MB_CHECK(moeblaze_layer_create(&stale, context.get(), &small));
      CHECK(seen.insert(stale).second);  // a handle value is never issued twice
      MB_CHECK(moeblaze_layer_destroy(stale));
      moeblaze_layer_t fresh = nullptr;
      MB_CHECK(moeblaze_layer_create(&fresh, context.get(), &large));
      CHECK(seen.insert(fresh).second);

      moeblaze_layer_config_t back;
      MB_CHECK(moeblaze_layer_config_init(&back, sizeof back));
      MB_CHECK_STATUS_MENTIONS(moeblaze_layer_get_config(stale, &back), MOEBLAZE_ERR_INVALID_HANDLE,
                               "destroyed");
      // A forward through the stale handle with buffers sized for the old layer (E = 2, k = 1):
      // refused before anything is written (the new layer's k = 8 would write 8 ids per token).
      const int64_t T = 2;
      std::vector<float> x(T * 8, 0.5f), w_router(2 * 8, 0.1f), w_gate(2 * 12 * 8, 0.1f),
          w_up(2 * 12 * 8, 0.1f), w_down(2 * 8 * 12, 0.1f), y(T * 8, 0.0f);
      std::vector<int32_t> ids_out(T * 1 + 4, -7);  // [T,k] of the old layer, then a guard
      AlignedBytes workspace(1 << 16);
      moeblaze_forward_args_t a;
      MB_CHECK(moeblaze_forward_args_init(&a, sizeof a));
      a.num_tokens = T;
      a.x = x.data();
      a.w_router = w_router.data();
      a.w_gate = w_gate.data();
      a.w_up = w_up.data();
      a.w_down = w_down.data();
      a.y = y.data();
      a.ids_out = ids_out.data();
      a.workspace = workspace.data();
      a.workspace_bytes = workspace.size();
      MB_CHECK_STATUS_MENTIONS(moeblaze_layer_forward(stale, &a, nullptr),
                               MOEBLAZE_ERR_INVALID_HANDLE, "layer");
      for (int32_t v : ids_out) CHECK(v == -7);
      MB_CHECK_STATUS_MENTIONS(moeblaze_layer_destroy(stale), MOEBLAZE_ERR_INVALID_HANDLE,
                               "not a live");
      MB_CHECK(moeblaze_layer_get_config(fresh, &back));
      CHECK(back.num_experts == 16);
      MB_CHECK(moeblaze_layer_destroy(fresh));
    }
  }

  TEST_CASE("misuse: a destroyed context stays invalid when its memory is reused") {
    for (int round = 0; round < 64; ++round) {
      moeblaze_context_t stale = nullptr;
      MB_CHECK(moeblaze_context_create(&stale, MOEBLAZE_BACKEND_CPU, 0));
      MB_CHECK(moeblaze_context_destroy(stale));
      moeblaze_context_t fresh = nullptr;
      MB_CHECK(moeblaze_context_create(&fresh, MOEBLAZE_BACKEND_CPU, 0));
      CHECK(fresh != stale);
      int32_t backend = -1, device = -1;
      MB_CHECK_STATUS_MENTIONS(moeblaze_context_get_info(stale, &backend, &device),
                               MOEBLAZE_ERR_INVALID_HANDLE, "destroyed");
      CHECK(backend == -1);
      MB_CHECK_STATUS_MENTIONS(moeblaze_context_set_num_threads(stale, 2),
                               MOEBLAZE_ERR_INVALID_HANDLE, "context");
      const moeblaze_layer_config_t cfg = config_with(4, 2);
      moeblaze_layer_t layer = nullptr;
      MB_CHECK_STATUS_MENTIONS(moeblaze_layer_create(&layer, stale, &cfg),
                               MOEBLAZE_ERR_INVALID_HANDLE, "context");
      CHECK(layer == nullptr);
      MB_CHECK(moeblaze_context_destroy(fresh));
    }
  }

  TEST_CASE("misuse: handles created, used and destroyed from several threads") {
    // Handles of other threads may be destroyed at any moment: a call on one gets OK (it was
    // live: the call keeps its object alive) or INVALID_HANDLE, never anything else.
    Context context;
    constexpr int kThreads = 4, kRounds = 150;
    std::vector<std::atomic<moeblaze_layer_t>> latest(kThreads);
    for (auto& handle : latest) handle.store(nullptr);
    std::atomic<int> unexpected{0};
    std::vector<std::thread> threads;
    for (int id = 0; id < kThreads; ++id) {
      threads.emplace_back([&, id] {
        const moeblaze_layer_config_t cfg = config_with(2 + id, 1);
        for (int round = 0; round < kRounds; ++round) {
          moeblaze_layer_t mine = nullptr;
          if (moeblaze_layer_create(&mine, context.get(), &cfg) != MOEBLAZE_OK) ++unexpected;
          latest[size_t(id)].store(mine);
          const moeblaze_layer_t other = latest[size_t((id + 1) % kThreads)].load();
          moeblaze_layer_config_t back;
          moeblaze_layer_config_init(&back, sizeof back);
          const moeblaze_status_t s = moeblaze_layer_get_config(other, &back);
          if (s == MOEBLAZE_OK && back.num_experts != 2 + (id + 1) % kThreads) ++unexpected;
          if (s != MOEBLAZE_OK && s != MOEBLAZE_ERR_INVALID_HANDLE) ++unexpected;
          size_t bytes = 0;
          if (moeblaze_layer_workspace_size(mine, MOEBLAZE_PASS_LAYER_FORWARD, 3, &bytes) !=
              MOEBLAZE_OK)
            ++unexpected;
          latest[size_t(id)].store(nullptr);
          if (moeblaze_layer_destroy(mine) != MOEBLAZE_OK) ++unexpected;
        }
      });
    }
    for (std::thread& t : threads) t.join();
    CHECK(unexpected.load() == 0);
  }

  TEST_CASE("misuse: pointers that are not handles are refused without being read") {
    // Any address: the registry compares values, it never dereferences a handle.
    int32_t not_a_handle[4] = {0, 0, 0, 0};
    moeblaze_layer_config_t back;
    MB_CHECK(moeblaze_layer_config_init(&back, sizeof back));
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_layer_get_config(reinterpret_cast<moeblaze_layer_t>(not_a_handle), &back),
        MOEBLAZE_ERR_INVALID_HANDLE, "layer");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_layer_get_config(reinterpret_cast<moeblaze_layer_t>(uintptr_t(1)), &back),
        MOEBLAZE_ERR_INVALID_HANDLE, "layer");
    MB_CHECK_STATUS_MENTIONS(
        moeblaze_context_destroy(reinterpret_cast<moeblaze_context_t>(~uintptr_t(0))),
        MOEBLAZE_ERR_INVALID_HANDLE, "context");
  }

  TEST_CASE("misuse: struct_size is bounded before the library reads or writes that much") {
    Context context;
    const moeblaze_layer_config_t cfg = config_with(4, 2);
    Layer layer(context, cfg);

    // get_config writes struct_size bytes: an uninitialised struct (a huge size) must be refused
    // with the caller's memory untouched.
    struct Guarded {
      moeblaze_layer_config_t config;
      unsigned char after[64];
    } guarded;
    std::memset(&guarded, 0x5a, sizeof guarded);
    for (uint32_t size : {uint32_t(0xFFFFFFF0u), uint32_t(0x80000000u), uint32_t((1u << 20) + 1)}) {
      guarded.config.struct_size = size;
      MB_CHECK_STATUS_MENTIONS(moeblaze_layer_get_config(layer.get(), &guarded.config),
                               MOEBLAZE_ERR_INVALID_ARGUMENT, "struct_size");
      for (unsigned char byte : guarded.after) CHECK(byte == 0x5a);
    }
    // A newer caller's larger struct: what this library does not know reads as zero.
    {
      struct Newer {
        moeblaze_layer_config_t base;
        unsigned char extra[40];
      } newer;
      std::memset(&newer, 0x5a, sizeof newer);
      newer.base.struct_size = sizeof newer;
      MB_CHECK(moeblaze_layer_get_config(layer.get(), &newer.base));
      CHECK(newer.base.struct_size == sizeof newer);
      CHECK(newer.base.num_experts == 4);
      for (unsigned char byte : newer.extra) CHECK(byte == 0);
    }

    // read_versioned scans the bytes beyond the struct it knows for non-zero ones: bounded too.
    moeblaze_forward_args_t args;
    MB_CHECK(moeblaze_forward_args_init(&args, sizeof args));
    args.struct_size = 0x80000000u;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_forward(layer.get(), &args, nullptr),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "struct_size");
    moeblaze_layer_config_t huge = cfg;
    huge.struct_size = 0xFFFFFFFFu;
    moeblaze_layer_t out = nullptr;
    MB_CHECK_STATUS_MENTIONS(moeblaze_layer_create(&out, context.get(), &huge),
                             MOEBLAZE_ERR_INVALID_ARGUMENT, "struct_size");
    // The largest accepted size, 1 MiB, all zero past the known fields: accepted.
    AlignedBytes big(size_t(1) << 20);
    std::memcpy(big.data(), &cfg, sizeof cfg);
    static_cast<moeblaze_layer_config_t*>(big.data())->struct_size = uint32_t(1) << 20;
    MB_CHECK(moeblaze_layer_create(&out, context.get(),
                                   static_cast<const moeblaze_layer_config_t*>(big.data())));
    MB_CHECK(moeblaze_layer_destroy(out));
  }

  TEST_CASE("misuse: a saved buffer whose routing indices were overwritten is refused") {
    Context context;
    Rng rng(test_seed(2501));
    const int64_t T = 6, E = 4, k = 2;
    for (int32_t pass : {MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_LAYER_FORWARD}) {
      CAPTURE(pass);
      Layer layer(context, config_with(E, k));
      LayerRun run(layer, T);
      run.init_random(rng);
      if (pass == MOEBLAZE_PASS_EXPERTS_FORWARD) {
        MB_CHECK(run.experts_forward());
      } else {
        MB_CHECK(run.layer_forward());
        run.ids = run.ids_out;  // the router's choice: the index was built from these
      }
      const ReferenceRoutingIndex index = routing_index_of(run.ids, T, E, k);
      // Locate the three arrays in the buffer by their content, not by the (internal) layout.
      const int64_t offsets_at =
          find_int32_sequence(run.saved.data(), run.saved.size(), index.expert_offsets);
      const int64_t tokens_at =
          find_int32_sequence(run.saved.data(), run.saved.size(), index.expert_token_indices);
      const int64_t map_at =
          find_int32_sequence(run.saved.data(), run.saved.size(), index.token_index_map);
      REQUIRE(offsets_at >= 0);
      REQUIRE(tokens_at >= 0);
      REQUIRE(map_at >= 0);
      const std::vector<unsigned char> pristine(
          static_cast<const unsigned char*>(run.saved.data()),
          static_cast<const unsigned char*>(run.saved.data()) + run.saved.size());
      auto word = [&](int64_t byte_offset, int64_t i) -> int32_t& {
        return reinterpret_cast<int32_t*>(static_cast<unsigned char*>(run.saved.data()) +
                                          byte_offset)[i];
      };
      auto backward = [&] {
        return pass == MOEBLAZE_PASS_EXPERTS_FORWARD ? run.experts_backward()
                                                     : run.layer_backward();
      };
      struct Corruption {
        const char* what;
        int64_t at, i;
        int32_t value;
      };
      const int32_t N = int32_t(T * k);
      const Corruption cases[] = {
          {"expert_offsets[E] beyond N", offsets_at, E, N + 100},
          {"expert_offsets[0] negative", offsets_at, 0, -5},
          {"expert_offsets decreasing", offsets_at, 2, 0},
          {"expert_offsets huge", offsets_at, 1, INT32_MAX},
          {"expert_token_indices beyond T", tokens_at, 3, int32_t(T) + 7},
          {"expert_token_indices negative", tokens_at, 0, -1},
          {"token_index_map beyond N", map_at, 5, N},
          {"token_index_map negative", map_at, 0, INT32_MIN},
          {"token_index_map not a bijection", map_at, 1, index.token_index_map[0]},
      };
      for (const Corruption& c : cases) {
        CAPTURE(c.what);
        std::memcpy(run.saved.data(), pristine.data(), pristine.size());
        word(c.at, c.i) = c.value;
        MB_CHECK_STATUS_MENTIONS(backward(), MOEBLAZE_ERR_INVALID_ARGUMENT, "saved");
      }
      std::memcpy(run.saved.data(), pristine.data(), pristine.size());
      MB_CHECK(backward());
    }
  }

  TEST_CASE("misuse: a buffer the call writes may not overlap another argument") {
    Context context;
    Rng rng(test_seed(2502));
    const int64_t T = 6, E = 4, k = 2;
    Layer layer(context, config_with(E, k));
    const auto overlap = MOEBLAZE_ERR_INVALID_ARGUMENT;

    // Forward: the workspace laid over the saved buffer (it wrote scratch over the routing index,
    // then followed it past w_gate), y over x, the saved buffer over a weight.
    for (int32_t pass : {MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_LAYER_FORWARD}) {
      CAPTURE(pass);
      LayerRun run(layer, T);
      run.init_random(rng);
      run.prepare(pass, true);
      const auto forward = [&](moeblaze_forward_args_t a) {
        if (pass == MOEBLAZE_PASS_EXPERTS_FORWARD)
          return moeblaze_experts_forward(layer.get(), &a, nullptr);
        a.ids = nullptr;
        a.g = nullptr;
        return moeblaze_layer_forward(layer.get(), &a, nullptr);
      };
      AlignedBytes arena(std::max(run.saved.size(), run.workspace.size()));
      moeblaze_forward_args_t a = run.forward_args(true);
      a.saved = a.workspace = arena.data();
      MB_CHECK_STATUS_MENTIONS(forward(a), overlap, "args->saved");
      a = run.forward_args(true);
      a.y = const_cast<void*>(a.x);
      MB_CHECK_STATUS_MENTIONS(forward(a), overlap, "args->x");
      a = run.forward_args(true);
      a.w_gate = a.saved;
      MB_CHECK_STATUS_MENTIONS(forward(a), overlap, "args->w_gate");
      // Buffers that only touch (one arena, back to back) and inputs that share memory are fine,
      // with the bits of separate buffers.
      MB_CHECK(forward(run.forward_args(true)));
      const std::vector<double> y_separate = run.y.to_vector();
      AlignedBytes both(run.saved.size() + run.workspace.size());
      a = run.forward_args(true);
      a.saved = both.data();
      a.workspace = static_cast<unsigned char*>(both.data()) + run.saved.size();
      MB_CHECK_OK(forward(a));
      CHECK(run.y.to_vector() == y_separate);
      a = run.forward_args(true);
      a.w_down = a.w_gate;  // arguments only read may share memory
      MB_CHECK_OK(forward(a));
    }

    // Backward: dx over x (the router's backward read x after the experts wrote dx: dw_router
    // silently wrong), the workspace over the saved buffer (a wild write), d_logits inside the
    // workspace, a weight gradient over its weight.
    for (int32_t pass : {MOEBLAZE_PASS_EXPERTS_BACKWARD, MOEBLAZE_PASS_LAYER_BACKWARD}) {
      CAPTURE(pass);
      const bool whole = pass == MOEBLAZE_PASS_LAYER_BACKWARD;
      LayerRun run(layer, T);
      run.init_random(rng);
      MB_CHECK(whole ? run.layer_forward() : run.experts_forward());
      run.prepare(pass, false);
      const auto backward = [&](moeblaze_backward_args_t a) {
        if (!whole) {
          a.dw_router = nullptr;
          a.d_logits = nullptr;
          return moeblaze_experts_backward(layer.get(), &a, nullptr);
        }
        a.ids = nullptr;
        a.g = nullptr;
        a.dg = nullptr;
        return moeblaze_layer_backward(layer.get(), &a, nullptr);
      };
      moeblaze_backward_args_t a = run.backward_args(LayerRun::Outputs(), 0);
      a.dx = const_cast<void*>(a.x);
      MB_CHECK_STATUS_MENTIONS(backward(a), overlap, "args->dx");
      a = run.backward_args(LayerRun::Outputs(), 0);
      AlignedBytes arena(std::max(run.saved.size(), run.workspace.size()));
      std::memcpy(arena.data(), run.saved.data(), run.saved.size());
      a.saved = a.workspace = arena.data();
      a.workspace_bytes = run.workspace.size();
      MB_CHECK_STATUS_MENTIONS(backward(a), overlap, "args->workspace");
      a = run.backward_args(LayerRun::Outputs(), 0);
      a.dw_gate = const_cast<void*>(a.w_gate);
      MB_CHECK_STATUS_MENTIONS(backward(a), overlap, "args->dw_gate");
      if (whole) {
        a = run.backward_args(LayerRun::Outputs(), 0);
        a.d_logits = static_cast<unsigned char*>(run.workspace.data()) + 64;
        MB_CHECK_STATUS_MENTIONS(backward(a), overlap, "args->d_logits");
      }
      MB_CHECK(backward(run.backward_args(LayerRun::Outputs(), 0)));
    }

    // The router and routing entry points.
    {
      size_t ws_bytes = 0;
      MB_CHECK(
          moeblaze_layer_workspace_size(layer.get(), MOEBLAZE_PASS_ROUTING_BUILD, T, &ws_bytes));
      AlignedBytes ws(ws_bytes);
      std::vector<int32_t> ids = random_ids(rng, T, E, k);
      std::vector<int32_t> offsets(size_t(E + 1)), eti(size_t(T * k)), tim(size_t(T * k));
      MB_CHECK_STATUS_MENTIONS(
          moeblaze_routing_build(layer.get(), T, ids.data(), offsets.data(), eti.data(), eti.data(),
                                 ws.data(), ws_bytes, nullptr),
          overlap, "token_index_map");
      MB_CHECK_STATUS_MENTIONS(
          moeblaze_routing_build(layer.get(), T, ids.data(), offsets.data(), eti.data(), ids.data(),
                                 ws.data(), ws_bytes, nullptr),
          overlap, "ids");
      MB_CHECK_OK(moeblaze_routing_build(layer.get(), T, ids.data(), offsets.data(), eti.data(),
                                         tim.data(), ws.data(), ws_bytes, nullptr));
    }
    {
      size_t ws_bytes = 0;
      MB_CHECK(
          moeblaze_layer_workspace_size(layer.get(), MOEBLAZE_PASS_ROUTER_FORWARD, T, &ws_bytes));
      AlignedBytes ws(ws_bytes);
      std::vector<float> logits(size_t(T * E)), g(size_t(T * k));
      for (float& v : logits) v = float(rng.uniform(-1.0, 1.0));
      std::vector<int32_t> ids(size_t(T * k));
      MB_CHECK_STATUS_MENTIONS(
          moeblaze_router_forward(layer.get(), T, logits.data(), ids.data(), logits.data(), nullptr,
                                  nullptr, ws.data(), ws_bytes, nullptr),
          overlap, "logits");
      MB_CHECK_OK(moeblaze_router_forward(layer.get(), T, logits.data(), ids.data(), g.data(),
                                          nullptr, nullptr, ws.data(), ws_bytes, nullptr));
    }
  }
}
