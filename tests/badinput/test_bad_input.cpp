// The bad-input sweep: every public entry point of moeblaze.h against each class of bad input —
// NULL, destroyed, foreign and wrong-kind handles; struct_size extremes; sizes that overflow;
// short and misaligned buffers; saved and exchange buffers overwritten between calls; extreme and
// non-finite values. Every case must give its documented status and a message naming what is
// wrong; none may crash or touch memory outside the caller's buffers. Buffers are exactly as large
// as the library asked for (heap blocks of that size), so under AddressSanitizer (scripts/test.sh,
// sanitize phase) an access one byte outside any of them fails the case.
//
// Each case starts from a valid call (checked to succeed) and breaks one thing. The suite prints
// how many cases it ran.
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "support/test_support.hpp"

using namespace mbtest;

namespace {

// ---- exact-size buffers -------------------------------------------------------------------------

// A heap block of exactly `bytes` bytes, 64-byte aligned, zeroed (AddressSanitizer knows its size).
class Exact {
 public:
  Exact() = default;
  explicit Exact(size_t bytes) { reset(bytes); }
  void reset(size_t bytes) {
    void* p = nullptr;
    if (bytes > 0 && posix_memalign(&p, 64, bytes) != 0) p = nullptr;
    REQUIRE((bytes == 0 || p != nullptr));
    if (p) std::memset(p, 0, bytes);
    block_.reset(p);
    bytes_ = bytes;
  }
  void* data() const { return block_.get(); }
  size_t size() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(block_.get());
  }
  unsigned char* bytes() const { return static_cast<unsigned char*>(block_.get()); }
  // Misaligned by `offset` bytes (never dereferenced by a correct library).
  void* plus(size_t offset) const { return bytes() + offset; }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, Free> block_;
  size_t bytes_ = 0;
};

std::vector<unsigned char> snapshot(const Exact& b) {
  return std::vector<unsigned char>(b.bytes(), b.bytes() + b.size());
}
void restore(const Exact& b, const std::vector<unsigned char>& s) {
  if (!s.empty()) std::memcpy(b.data(), s.data(), s.size());
}

// ---- the case table
// -------------------------------------------------------------------------------

struct Case {
  std::string entry;  // the entry point
  std::string what;   // the bad input
  moeblaze_status_t expected;
  std::string needle;  // the message must mention it (failures only)
  std::function<moeblaze_status_t()> call;
};

class Sweep {
 public:
  void add(std::string entry, std::string what, moeblaze_status_t expected, std::string needle,
           std::function<moeblaze_status_t()> call) {
    cases_.push_back(
        {std::move(entry), std::move(what), expected, std::move(needle), std::move(call)});
  }
  // A function that returns no status: `ok` says whether its result is as documented.
  void add_check(std::string entry, std::string what, std::function<bool()> ok) {
    add(std::move(entry), std::move(what), MOEBLAZE_OK, "",
        [ok] { return ok() ? MOEBLAZE_OK : MOEBLAZE_ERR_INTERNAL; });
  }

  // Runs every case; returns how many.
  size_t run() {
    std::map<std::string, int> per_entry;
    for (const Case& c : cases_) {
      CAPTURE(c.entry);
      CAPTURE(c.what);
      const moeblaze_status_t status = c.call();
      const std::string message = moeblaze_last_error();
      CHECK_MESSAGE(status == c.expected, c.entry << " [" << c.what << "] returned "
                                                  << moeblaze_status_name(status) << " (" << message
                                                  << "), expected "
                                                  << moeblaze_status_name(c.expected));
      if (status != MOEBLAZE_OK && status == c.expected) {
        CHECK_MESSAGE((!message.empty() && message.find(c.needle) != std::string::npos),
                      c.entry << " [" << c.what << "]: message '" << message
                              << "' does not mention '" << c.needle << "'");
      }
      ++per_entry[c.entry];
    }
    entries_ = per_entry.size();
    return cases_.size();
  }
  size_t entries() const { return entries_; }

 private:
  std::vector<Case> cases_;
  size_t entries_ = 0;
};

// Handles that are not live handles of the kind asked for.
template <typename Handle>
std::vector<std::pair<std::string, Handle>> bad_handles(Handle destroyed, void* other_kind) {
  static int32_t foreign_object = 0;
  return {{"NULL", nullptr},
          {"destroyed", destroyed},
          {"a handle of another kind", reinterpret_cast<Handle>(other_kind)},
          {"a foreign pointer", reinterpret_cast<Handle>(&foreign_object)},
          {"an odd integer", reinterpret_cast<Handle>(uintptr_t(0x12345))},
          {"all bits set", reinterpret_cast<Handle>(~uintptr_t(0))}};
}

const int64_t kBadTokens[] = {-1, std::numeric_limits<int64_t>::min(),
                              std::numeric_limits<int64_t>::max(), int64_t(1) << 31,
                              (int64_t(1) << 62) + 1};

// ---- one layer configuration with every buffer of its calls ------------------------------------

struct LayerCase {
  const char* name;
  int32_t dtype, activation, checkpoint, score_function, renormalize;
  float aux, z;
};

const LayerCase kLayerCases[] = {
    {"F32 SwiGLU softmax-topk save-preact", MOEBLAZE_DTYPE_F32, MOEBLAZE_ACTIVATION_SWIGLU,
     MOEBLAZE_CHECKPOINT_SAVE_PREACT, MOEBLAZE_SCORE_SOFTMAX_TOPK, 0, 0.01f, 0.001f},
    {"BF16 GELU sigmoid recompute", MOEBLAZE_DTYPE_BF16, MOEBLAZE_ACTIVATION_GELU,
     MOEBLAZE_CHECKPOINT_RECOMPUTE, MOEBLAZE_SCORE_SIGMOID, 1, 0.01f, 0.0f},
    {"F64 ReGLU topk-softmax save-all", MOEBLAZE_DTYPE_F64, MOEBLAZE_ACTIVATION_REGLU,
     MOEBLAZE_CHECKPOINT_SAVE_ALL, MOEBLAZE_SCORE_TOPK_SOFTMAX, 0, 0.0f, 0.01f},
};

struct World {
  static constexpr int64_t T = 5, d = 8, h = 12, E = 4, k = 2, N = T * k;
  moeblaze_context_t context = nullptr;
  moeblaze_layer_t layer = nullptr;
  moeblaze_layer_t destroyed_layer = nullptr;
  moeblaze_context_t destroyed_context = nullptr;
  moeblaze_layer_config_t config;
  bool gated;
  size_t es, rs;
  Exact x, w_router, w_gate, w_up, w_down, y, dy, dx, dw_router, dw_gate, dw_up, dw_down;
  Exact logits, ids, g, dg, d_logits, losses, counts, offsets, token_indices, index_map;
  // Outputs only (never read back as another call's input): router ids and g, forward outputs.
  Exact ids_out, g_out, logits_out;
  std::map<int32_t, Exact> workspace;  // by pass (forward passes: the plain, larger size)
  std::map<int32_t, Exact> saved;      // by forward pass, filled by a valid forward
  std::map<int32_t, std::vector<unsigned char>> saved_pristine;

  explicit World(const LayerCase& lc) {
    MB_CHECK(moeblaze_context_create(&context, MOEBLAZE_BACKEND_CPU, 0));
    MB_CHECK(moeblaze_context_set_num_threads(context, 2));
    MB_CHECK(moeblaze_context_create(&destroyed_context, MOEBLAZE_BACKEND_CPU, 0));
    MB_CHECK(moeblaze_context_destroy(destroyed_context));
    config = make_config(lc.dtype, d, h, E, k);
    config.activation = lc.activation;
    config.checkpoint = lc.checkpoint;
    config.score_function = lc.score_function;
    config.renormalize = lc.renormalize;
    config.aux_loss_coeff = lc.aux;
    config.z_loss_coeff = lc.z;
    MB_CHECK(moeblaze_layer_create(&layer, context, &config));
    MB_CHECK(moeblaze_layer_create(&destroyed_layer, context, &config));
    MB_CHECK(moeblaze_layer_destroy(destroyed_layer));
    gated = is_gated(lc.activation);
    es = dtype_bytes(lc.dtype);
    rs = dtype_bytes(routing_dtype(lc.dtype));
    for (Exact* t : {&x, &y, &dy, &dx}) t->reset(es * T * d);
    for (Exact* t : {&w_router, &dw_router}) t->reset(es * E * d);
    for (Exact* t : {&w_gate, &w_up, &w_down, &dw_gate, &dw_up, &dw_down}) t->reset(es * E * h * d);
    for (Exact* t : {&logits, &d_logits}) t->reset(rs * T * E);
    for (Exact* t : {&g, &dg}) t->reset(rs * N);
    losses.reset(rs * 2);
    ids.reset(sizeof(int32_t) * N);
    ids_out.reset(sizeof(int32_t) * N);
    g_out.reset(rs * N);
    logits_out.reset(rs * T * E);
    counts.reset(sizeof(int32_t) * E);
    offsets.reset(sizeof(int32_t) * (E + 1));
    token_indices.reset(sizeof(int32_t) * N);
    index_map.reset(sizeof(int32_t) * N);
    Rng rng(test_seed(2525));
    auto fill = [&](const Exact& t, int32_t dtype, double scale) {
      HostTensor tmp(dtype, {int64_t(t.size() / dtype_bytes(dtype))});
      fill_normal(tmp, rng, scale);
      std::memcpy(t.data(), tmp.data(), t.size());
    };
    fill(x, lc.dtype, 1.0);
    fill(dy, lc.dtype, 1.0);
    for (const Exact* t : {&w_router, &w_gate, &w_up, &w_down}) fill(*t, lc.dtype, 0.3);
    fill(logits, routing_dtype(lc.dtype), 1.0);
    fill(dg, routing_dtype(lc.dtype), 1.0);
    const int32_t fixed_ids[N] = {0, 1, 2, 3, 1, 2, 3, 0, 0, 2};
    std::memcpy(ids.data(), fixed_ids, sizeof fixed_ids);
    HostTensor gt(routing_dtype(lc.dtype), {N});
    for (int64_t i = 0; i < N; ++i) gt.set(i, 0.1 + 0.08 * double(i));
    std::memcpy(g.data(), gt.data(), g.size());

    for (int32_t pass = MOEBLAZE_PASS_ROUTER_FORWARD; pass <= MOEBLAZE_PASS_LAYER_BACKWARD;
         ++pass) {
      size_t bytes = 0;
      MB_CHECK(moeblaze_layer_workspace_size(layer, pass, T, &bytes));
      workspace[pass].reset(bytes);
    }
    for (int32_t pass : {MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_LAYER_FORWARD}) {
      size_t bytes = 0;
      MB_CHECK(moeblaze_layer_saved_size(layer, pass, T, &bytes));
      saved[pass].reset(bytes);
      moeblaze_forward_args_t a = forward_args(pass);
      MB_CHECK(pass == MOEBLAZE_PASS_EXPERTS_FORWARD ? moeblaze_experts_forward(layer, &a, nullptr)
                                                     : moeblaze_layer_forward(layer, &a, nullptr));
      saved_pristine[pass] = snapshot(saved[pass]);
    }
  }
  ~World() {
    moeblaze_layer_destroy(layer);
    moeblaze_context_destroy(context);
  }
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  moeblaze_forward_args_t forward_args(int32_t pass) const {
    moeblaze_forward_args_t a;
    moeblaze_forward_args_init(&a, sizeof a);
    a.num_tokens = T;
    a.x = x.data();
    a.w_router = w_router.data();
    a.w_gate = w_gate.data();
    a.w_up = gated ? w_up.data() : nullptr;
    a.w_down = w_down.data();
    a.ids = ids.as<int32_t>();
    a.g = g.data();
    a.y = y.data();
    if (pass == MOEBLAZE_PASS_LAYER_FORWARD) {
      a.logits_out = logits_out.data();
      a.losses = losses.data();
      a.g_out = g_out.data();
    }
    a.expert_counts = counts.as<int32_t>();
    const Exact& s = saved.at(pass);
    a.saved = s.data();
    a.saved_bytes = s.size();
    const Exact& w = workspace.at(pass);
    a.workspace = w.data();
    a.workspace_bytes = w.size();
    return a;
  }

  moeblaze_backward_args_t backward_args(int32_t pass) const {
    const int32_t forward = pass == MOEBLAZE_PASS_EXPERTS_BACKWARD ? MOEBLAZE_PASS_EXPERTS_FORWARD
                                                                   : MOEBLAZE_PASS_LAYER_FORWARD;
    moeblaze_backward_args_t a;
    moeblaze_backward_args_init(&a, sizeof a);
    a.num_tokens = T;
    a.dy = dy.data();
    a.x = x.data();
    a.w_router = w_router.data();
    a.w_gate = w_gate.data();
    a.w_up = gated ? w_up.data() : nullptr;
    a.w_down = w_down.data();
    a.ids = ids.as<int32_t>();
    a.g = g.data();
    a.saved = saved.at(forward).data();
    a.saved_bytes = saved.at(forward).size();
    a.dx = dx.data();
    a.dw_gate = dw_gate.data();
    a.dw_up = gated ? dw_up.data() : nullptr;
    a.dw_down = dw_down.data();
    if (pass == MOEBLAZE_PASS_EXPERTS_BACKWARD) {
      a.dg = dg.data();
    } else {
      a.dw_router = dw_router.data();
      a.d_logits = d_logits.data();
    }
    a.workspace = workspace.at(pass).data();
    a.workspace_bytes = workspace.at(pass).size();
    return a;
  }

  void restore_saved() {
    for (auto& [pass, bytes] : saved_pristine) restore(saved.at(pass), bytes);
  }
};

// A pointer field of an args struct, as bytes at an offset (every pointer has one representation).
struct Field {
  const char* name;
  size_t offset;
  size_t element;  // element size: what a pointer must be aligned to
  enum Use { Required, Optional, Ignored } use;
};

template <typename Args>
void set_field(Args& a, const Field& f, const void* value) {
  std::memcpy(reinterpret_cast<unsigned char*>(&a) + f.offset, &value, sizeof value);
}
template <typename Args>
const void* get_field(const Args& a, const Field& f) {
  const void* value = nullptr;
  std::memcpy(&value, reinterpret_cast<const unsigned char*>(&a) + f.offset, sizeof value);
  return value;
}

#define MB_FIELD(Args, name, element, use)           \
  Field {                                            \
#name, offsetof(Args, name), element, Field::use \
  }

std::vector<Field> forward_fields(const World& w, bool whole_layer) {
  using A = moeblaze_forward_args_t;
  const size_t es = w.es, rs = w.rs;
  const Field::Use layer_only = whole_layer ? Field::Optional : Field::Ignored;
  return {
      MB_FIELD(A, x, es, Required),
      Field{"w_router", offsetof(A, w_router), es, whole_layer ? Field::Required : Field::Ignored},
      MB_FIELD(A, w_gate, es, Required),
      Field{"w_up", offsetof(A, w_up), es, w.gated ? Field::Required : Field::Optional},
      MB_FIELD(A, w_down, es, Required),
      Field{"ids", offsetof(A, ids), 4, whole_layer ? Field::Ignored : Field::Required},
      Field{"g", offsetof(A, g), rs, whole_layer ? Field::Ignored : Field::Required},
      MB_FIELD(A, y, es, Required),
      Field{"logits_out", offsetof(A, logits_out), rs, layer_only},
      Field{"ids_out", offsetof(A, ids_out), 4, layer_only},
      Field{"g_out", offsetof(A, g_out), rs, layer_only},
      MB_FIELD(A, expert_counts, 4, Optional),
      Field{"losses", offsetof(A, losses), rs, layer_only}};
}

std::vector<Field> backward_fields(const World& w, bool whole_layer) {
  using A = moeblaze_backward_args_t;
  const size_t es = w.es, rs = w.rs;
  const Field::Use layer_opt = whole_layer ? Field::Optional : Field::Ignored;
  const Field::Use experts_req = whole_layer ? Field::Ignored : Field::Required;
  return {
      MB_FIELD(A, dy, es, Required),
      Field{"d_losses", offsetof(A, d_losses), rs, layer_opt},
      MB_FIELD(A, x, es, Required),
      Field{"w_router", offsetof(A, w_router), es, whole_layer ? Field::Required : Field::Ignored},
      MB_FIELD(A, w_gate, es, Required),
      Field{"w_up", offsetof(A, w_up), es, w.gated ? Field::Required : Field::Optional},
      MB_FIELD(A, w_down, es, Required),
      Field{"ids", offsetof(A, ids), 4, experts_req},
      Field{"g", offsetof(A, g), rs, experts_req},
      MB_FIELD(A, dx, es, Optional),
      Field{"dw_router", offsetof(A, dw_router), es, layer_opt},
      MB_FIELD(A, dw_gate, es, Optional),
      Field{"dw_up", offsetof(A, dw_up), es, Field::Optional},
      MB_FIELD(A, dw_down, es, Optional),
      Field{"dg", offsetof(A, dg), rs, whole_layer ? Field::Ignored : Field::Optional},
      Field{"d_logits", offsetof(A, d_logits), rs, layer_opt}};
}

// Pointer-field cases shared by the four args-struct calls: NULL, misaligned, and (for fields the
// call ignores) a poison pointer that must never be read.
template <typename Args>
void add_field_cases(Sweep& sweep, const std::string& entry, const std::vector<Field>& fields,
                     std::function<Args()> make, std::function<moeblaze_status_t(Args&)> call,
                     std::function<void()> reset) {
  for (const Field& f : fields) {
    const std::string arg = std::string("args->") + f.name;
    sweep.add(entry, arg + " NULL",
              f.use == Field::Required ? MOEBLAZE_ERR_INVALID_ARGUMENT : MOEBLAZE_OK, arg, [=] {
                reset();
                Args a = make();
                set_field(a, f, nullptr);
                return call(a);
              });
    if (f.use == Field::Ignored) {
      sweep.add(entry, arg + " poison (ignored)", MOEBLAZE_OK, "", [=] {
        reset();
        Args a = make();
        set_field(a, f, reinterpret_cast<const void*>(uintptr_t(0x40)));
        return call(a);
      });
      continue;
    }
    for (size_t offset = 1; offset < f.element; offset *= 2) {
      sweep.add(entry, arg + " misaligned by " + std::to_string(offset),
                MOEBLAZE_ERR_INVALID_ARGUMENT, arg, [=] {
                  reset();
                  Args a = make();
                  const void* p = get_field(a, f);
                  if (p == nullptr) p = reinterpret_cast<const void*>(uintptr_t(0x1000));
                  set_field(a, f, static_cast<const unsigned char*>(p) + offset);
                  return call(a);
                });
    }
  }
}

// struct_size cases of a versioned args struct passed by pointer.
template <typename Args>
void add_struct_size_cases(Sweep& sweep, const std::string& entry, std::function<Args()> make,
                           std::function<moeblaze_status_t(const Args*)> call,
                           std::function<void()> reset) {
  for (uint32_t size : {0u, 4u, uint32_t(sizeof(Args) - 8)}) {
    sweep.add(entry, "struct_size = " + std::to_string(size), MOEBLAZE_ERR_VERSION_MISMATCH,
              "struct_size", [=] {
                reset();
                Args a = make();
                a.struct_size = size;
                return call(&a);
              });
  }
  for (uint32_t size : {(1u << 20) + 8, 0x80000000u, 0xFFFFFFFFu}) {
    sweep.add(entry, "struct_size = " + std::to_string(size), MOEBLAZE_ERR_INVALID_ARGUMENT,
              "struct_size", [=] {
                reset();
                Args a = make();  // sizeof(Args) bytes only: nothing past them may be read
                a.struct_size = size;
                return call(&a);
              });
  }
  // A newer caller's larger struct: zero tail accepted, a set byte refused.
  for (bool set_tail : {false, true}) {
    sweep.add(entry,
              set_tail ? "larger struct_size, tail byte set" : "larger struct_size, zero tail",
              set_tail ? MOEBLAZE_ERR_NOT_SUPPORTED : MOEBLAZE_OK, "struct_size", [=] {
                reset();
                Exact bigger(sizeof(Args) + 64);
                Args a = make();
                a.struct_size = uint32_t(bigger.size());
                std::memcpy(bigger.data(), &a, sizeof a);
                if (set_tail) bigger.bytes()[sizeof(Args) + 63] = 1;
                return call(bigger.as<const Args>());
              });
  }
  sweep.add(entry, "args NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "is NULL", [=] {
    reset();
    return call(nullptr);
  });
}

// ---- the sweeps
// -----------------------------------------------------------------------------------

void add_global_cases(Sweep& sweep) {
  for (int32_t status : {-1, 9, 10, 98, 100, std::numeric_limits<int32_t>::min(),
                         std::numeric_limits<int32_t>::max()}) {
    sweep.add_check("moeblaze_status_name", "status " + std::to_string(status), [status] {
      const char* s = moeblaze_status_name(status);
      return s != nullptr && std::strlen(s) > 0;
    });
    sweep.add_check("moeblaze_status_string", "status " + std::to_string(status), [status] {
      const char* s = moeblaze_status_string(status);
      return s != nullptr && std::strlen(s) > 0;
    });
  }
  for (int32_t backend : {-1, 0, 3, 100, std::numeric_limits<int32_t>::min()}) {
    sweep.add_check("moeblaze_backend_available", "backend " + std::to_string(backend),
                    [backend] { return moeblaze_backend_available(backend) == 0; });
  }
  sweep.add_check("moeblaze_copy_last_error", "NULL buffer", [] {
    moeblaze_context_create(nullptr, MOEBLAZE_BACKEND_CPU, 0);  // leaves a message
    return moeblaze_copy_last_error(nullptr, 100) == std::strlen(moeblaze_last_error()) + 1;
  });
  sweep.add_check("moeblaze_copy_last_error", "size 0 and 1", [] {
    moeblaze_context_create(nullptr, MOEBLAZE_BACKEND_CPU, 0);
    Exact one(1);
    one.bytes()[0] = 'x';
    const size_t needed = moeblaze_copy_last_error(one.as<char>(), 0);
    const bool untouched = one.bytes()[0] == 'x';
    moeblaze_copy_last_error(one.as<char>(), 1);
    return needed > 1 && untouched && one.bytes()[0] == '\0';
  });
  sweep.add_check("moeblaze_get_build_info", "never NULL",
                  [] { return moeblaze_get_build_info() != nullptr; });
  sweep.add_check("moeblaze_get_version", "the header's version",
                  [] { return moeblaze_get_version() == MOEBLAZE_VERSION; });
  sweep.add_check("moeblaze_get_abi_version", "the header's ABI version",
                  [] { return moeblaze_get_abi_version() == MOEBLAZE_ABI_VERSION; });
  sweep.add_check("moeblaze_last_error", "never NULL, after a failure and after a success", [] {
    moeblaze_context_create(nullptr, MOEBLAZE_BACKEND_CPU, 0);
    const char* failed = moeblaze_last_error();
    const bool named = failed != nullptr && std::strstr(failed, "out") != nullptr;
    moeblaze_get_build_info();
    moeblaze_context_destroy(nullptr);  // a successful call clears it
    const char* cleared = moeblaze_last_error();
    return named && cleared != nullptr && cleared[0] == '\0';
  });

  // Contexts.
  const std::string create = "moeblaze_context_create";
  sweep.add(create, "out NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "out",
            [] { return moeblaze_context_create(nullptr, MOEBLAZE_BACKEND_CPU, 0); });
  for (int32_t backend : {-1, 0, 3, std::numeric_limits<int32_t>::max()}) {
    sweep.add(create, "backend " + std::to_string(backend), MOEBLAZE_ERR_INVALID_ARGUMENT,
              "backend", [backend] {
                moeblaze_context_t c = nullptr;
                return moeblaze_context_create(&c, backend, 0);
              });
  }
  for (int32_t device :
       {-1, 1, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()}) {
    sweep.add(create, "CPU device " + std::to_string(device), MOEBLAZE_ERR_INVALID_ARGUMENT,
              "device", [device] {
                moeblaze_context_t c = nullptr;
                return moeblaze_context_create(&c, MOEBLAZE_BACKEND_CPU, device);
              });
  }
  if (!moeblaze_backend_available(MOEBLAZE_BACKEND_CUDA)) {
    sweep.add(create, "CUDA without a usable GPU", MOEBLAZE_ERR_NOT_SUPPORTED, "CUDA", [] {
      moeblaze_context_t c = nullptr;
      return moeblaze_context_create(&c, MOEBLAZE_BACKEND_CUDA, 0);
    });
  }

  // Versioned struct init functions.
  struct Init {
    const char* name;
    size_t size;
    std::function<moeblaze_status_t(void*, size_t)> call;
  };
  const Init inits[] = {
      {"moeblaze_layer_config_init", sizeof(moeblaze_layer_config_t),
       [](void* p, size_t n) {
         return moeblaze_layer_config_init(static_cast<moeblaze_layer_config_t*>(p), n);
       }},
      {"moeblaze_forward_args_init", sizeof(moeblaze_forward_args_t),
       [](void* p, size_t n) {
         return moeblaze_forward_args_init(static_cast<moeblaze_forward_args_t*>(p), n);
       }},
      {"moeblaze_backward_args_init", sizeof(moeblaze_backward_args_t),
       [](void* p, size_t n) {
         return moeblaze_backward_args_init(static_cast<moeblaze_backward_args_t*>(p), n);
       }},
      {"moeblaze_ep_config_init", sizeof(moeblaze_ep_config_t),
       [](void* p, size_t n) {
         return moeblaze_ep_config_init(static_cast<moeblaze_ep_config_t*>(p), n);
       }},
      {"moeblaze_ep_forward_args_init", sizeof(moeblaze_ep_forward_args_t),
       [](void* p, size_t n) {
         return moeblaze_ep_forward_args_init(static_cast<moeblaze_ep_forward_args_t*>(p), n);
       }},
      {"moeblaze_ep_backward_args_init", sizeof(moeblaze_ep_backward_args_t),
       [](void* p, size_t n) {
         return moeblaze_ep_backward_args_init(static_cast<moeblaze_ep_backward_args_t*>(p), n);
       }},
  };
  for (const Init& init : inits) {
    const auto call = init.call;
    const size_t size = init.size;
    sweep.add(init.name, "NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "",
              [call, size] { return call(nullptr, size); });
    for (size_t bad : {size_t(0), size_t(4), size - 4}) {
      sweep.add(init.name, "struct_size " + std::to_string(bad), MOEBLAZE_ERR_VERSION_MISMATCH,
                "struct_size", [call, bad] {
                  Exact block(bad ? bad : 1);
                  return call(block.data(), bad);
                });
    }
    for (size_t bad : {(size_t(1) << 20) + 1, ~size_t(0)}) {
      sweep.add(init.name, "struct_size " + std::to_string(bad), MOEBLAZE_ERR_INVALID_ARGUMENT,
                "struct_size", [call, size, bad] {
                  Exact block(size);  // the library must refuse before writing `bad` bytes
                  return call(block.data(), bad);
                });
    }
    sweep.add(init.name, "a larger struct is zeroed past the known fields", MOEBLAZE_OK, "",
              [call, size] {
                Exact block(size + 32);
                std::memset(block.data(), 0x5a, block.size());
                const moeblaze_status_t s = call(block.data(), block.size());
                for (size_t i = size; i < block.size(); ++i) {
                  if (block.bytes()[i] != 0) return moeblaze_status_t(MOEBLAZE_ERR_INTERNAL);
                }
                return s;
              });
  }
}

void add_layer_cases(Sweep& sweep, const std::shared_ptr<World>& wp) {
  World& w = *wp;
  const auto bad_layers = bad_handles<moeblaze_layer_t>(w.destroyed_layer, w.context);
  const auto bad_contexts = bad_handles<moeblaze_context_t>(w.destroyed_context, w.layer);

  // ---- contexts and layer plans
  for (const auto& [what, c] : bad_contexts) {
    const moeblaze_context_t context = c;
    const moeblaze_status_t destroy_status =
        context == nullptr ? MOEBLAZE_OK : MOEBLAZE_ERR_INVALID_HANDLE;
    sweep.add("moeblaze_context_destroy", what, destroy_status, "context",
              [context] { return moeblaze_context_destroy(context); });
    sweep.add("moeblaze_context_get_info", what, MOEBLAZE_ERR_INVALID_HANDLE, "context", [context] {
      int32_t b = 0, d = 0;
      return moeblaze_context_get_info(context, &b, &d);
    });
    sweep.add("moeblaze_context_set_num_threads", what, MOEBLAZE_ERR_INVALID_HANDLE, "context",
              [context] { return moeblaze_context_set_num_threads(context, 1); });
    sweep.add("moeblaze_layer_create", "context " + what, MOEBLAZE_ERR_INVALID_HANDLE, "context",
              [wp, context] {
                moeblaze_layer_t out = nullptr;
                return moeblaze_layer_create(&out, context, &wp->config);
              });
  }
  for (int32_t threads :
       {-1, 4097, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()}) {
    sweep.add("moeblaze_context_set_num_threads", "num_threads " + std::to_string(threads),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "num_threads",
              [wp, threads] { return moeblaze_context_set_num_threads(wp->context, threads); });
  }
  sweep.add("moeblaze_context_get_info", "both outputs NULL", MOEBLAZE_OK, "",
            [wp] { return moeblaze_context_get_info(wp->context, nullptr, nullptr); });

  // Config fields out of range.
  struct ConfigCase {
    const char* field;
    std::function<void(moeblaze_layer_config_t&)> set;
  };
  const int64_t kI64Min = std::numeric_limits<int64_t>::min();
  const int64_t kI64Max = std::numeric_limits<int64_t>::max();
  std::vector<ConfigCase> config_cases;
  for (int32_t v : {-1, 4, std::numeric_limits<int32_t>::max()}) {
    config_cases.push_back({"dtype", [v](moeblaze_layer_config_t& c) { c.dtype = v; }});
  }
  for (int64_t v : {int64_t(0), int64_t(-1), (int64_t(1) << 20) + 1, kI64Max, kI64Min}) {
    config_cases.push_back({"d_model", [v](moeblaze_layer_config_t& c) { c.d_model = v; }});
    config_cases.push_back({"d_ffn", [v](moeblaze_layer_config_t& c) { c.d_ffn = v; }});
    config_cases.push_back({"top_k", [v](moeblaze_layer_config_t& c) { c.top_k = v; }});
  }
  for (int64_t v : {int64_t(0), int64_t(-1), int64_t(MOEBLAZE_MAX_EXPERTS + 1), kI64Max}) {
    config_cases.push_back({"num_experts", [v](moeblaze_layer_config_t& c) { c.num_experts = v; }});
  }
  config_cases.push_back(
      {"top_k", [](moeblaze_layer_config_t& c) { c.top_k = c.num_experts + 1; }});
  config_cases.push_back({"top_k", [](moeblaze_layer_config_t& c) {
                            c.num_experts = 64;
                            c.top_k = MOEBLAZE_MAX_TOP_K + 1;
                          }});
  for (int32_t v : {-1, 7, 1000}) {
    config_cases.push_back({"activation", [v](moeblaze_layer_config_t& c) { c.activation = v; }});
  }
  for (int32_t v : {-1, 3}) {
    config_cases.push_back({"checkpoint", [v](moeblaze_layer_config_t& c) { c.checkpoint = v; }});
    config_cases.push_back(
        {"score_function", [v](moeblaze_layer_config_t& c) { c.score_function = v; }});
  }
  for (int32_t v : {-1, 2}) {
    config_cases.push_back({"renormalize", [v](moeblaze_layer_config_t& c) { c.renormalize = v; }});
    config_cases.push_back(
        {"deterministic", [v](moeblaze_layer_config_t& c) { c.deterministic = v; }});
  }
  for (float v : {-1.0f, NAN, INFINITY, -INFINITY, -FLT_MIN}) {
    config_cases.push_back(
        {"aux_loss_coeff", [v](moeblaze_layer_config_t& c) { c.aux_loss_coeff = v; }});
    config_cases.push_back(
        {"z_loss_coeff", [v](moeblaze_layer_config_t& c) { c.z_loss_coeff = v; }});
  }
  config_cases.push_back({"reserved0", [](moeblaze_layer_config_t& c) { c.reserved0 = 1; }});
  for (const ConfigCase& cc : config_cases) {
    const auto set = cc.set;
    sweep.add("moeblaze_layer_create", std::string("config.") + cc.field,
              MOEBLAZE_ERR_INVALID_ARGUMENT, cc.field, [wp, set] {
                moeblaze_layer_config_t c = wp->config;
                set(c);
                moeblaze_layer_t out = nullptr;
                return moeblaze_layer_create(&out, wp->context, &c);
              });
  }
  sweep.add("moeblaze_layer_create", "out NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "out",
            [wp] { return moeblaze_layer_create(nullptr, wp->context, &wp->config); });
  add_struct_size_cases<moeblaze_layer_config_t>(
      sweep, "moeblaze_layer_create", [wp] { return wp->config; },
      [wp](const moeblaze_layer_config_t* c) {
        moeblaze_layer_t out = nullptr;
        const moeblaze_status_t s = moeblaze_layer_create(&out, wp->context, c);
        if (out != nullptr) moeblaze_layer_destroy(out);
        return s;
      },
      [] {});

  for (const auto& [what, l] : bad_layers) {
    const moeblaze_layer_t layer = l;
    sweep.add("moeblaze_layer_destroy", what,
              layer == nullptr ? MOEBLAZE_OK : MOEBLAZE_ERR_INVALID_HANDLE, "layer",
              [layer] { return moeblaze_layer_destroy(layer); });
    sweep.add("moeblaze_layer_get_config", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [layer] {
      moeblaze_layer_config_t c;
      moeblaze_layer_config_init(&c, sizeof c);
      return moeblaze_layer_get_config(layer, &c);
    });
    sweep.add("moeblaze_layer_workspace_size", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [layer] {
      size_t b = 0;
      return moeblaze_layer_workspace_size(layer, MOEBLAZE_PASS_LAYER_FORWARD, 4, &b);
    });
    sweep.add("moeblaze_layer_workspace_size_with_flags", what, MOEBLAZE_ERR_INVALID_HANDLE,
              "layer", [layer] {
                size_t b = 0;
                return moeblaze_layer_workspace_size_with_flags(layer, 0, 4, 0, &b);
              });
    sweep.add("moeblaze_layer_saved_size", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [layer] {
      size_t b = 0;
      return moeblaze_layer_saved_size(layer, MOEBLAZE_PASS_LAYER_FORWARD, 4, &b);
    });
    sweep.add("moeblaze_router_forward", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [wp, layer] {
      World& w = *wp;
      const Exact& ws = w.workspace.at(MOEBLAZE_PASS_ROUTER_FORWARD);
      return moeblaze_router_forward(layer, w.T, w.logits.data(), w.ids_out.as<int32_t>(),
                                     w.g_out.data(), nullptr, nullptr, ws.data(), ws.size(),
                                     nullptr);
    });
    sweep.add("moeblaze_router_backward", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [wp, layer] {
      World& w = *wp;
      const Exact& ws = w.workspace.at(MOEBLAZE_PASS_ROUTER_BACKWARD);
      return moeblaze_router_backward(layer, w.T, w.logits.data(), w.ids.as<int32_t>(), w.dg.data(),
                                      nullptr, w.d_logits.data(), ws.data(), ws.size(), nullptr);
    });
    sweep.add("moeblaze_routing_build", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [wp, layer] {
      World& w = *wp;
      const Exact& ws = w.workspace.at(MOEBLAZE_PASS_ROUTING_BUILD);
      return moeblaze_routing_build(layer, w.T, w.ids.as<int32_t>(), w.offsets.as<int32_t>(),
                                    w.token_indices.as<int32_t>(), w.index_map.as<int32_t>(),
                                    ws.data(), ws.size(), nullptr);
    });
    for (int32_t pass : {MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_LAYER_FORWARD}) {
      sweep.add(pass == MOEBLAZE_PASS_LAYER_FORWARD ? "moeblaze_layer_forward"
                                                    : "moeblaze_experts_forward",
                what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [wp, layer, pass] {
                  moeblaze_forward_args_t a = wp->forward_args(pass);
                  return pass == MOEBLAZE_PASS_LAYER_FORWARD
                             ? moeblaze_layer_forward(layer, &a, nullptr)
                             : moeblaze_experts_forward(layer, &a, nullptr);
                });
    }
    for (int32_t pass : {MOEBLAZE_PASS_EXPERTS_BACKWARD, MOEBLAZE_PASS_LAYER_BACKWARD}) {
      sweep.add(pass == MOEBLAZE_PASS_LAYER_BACKWARD ? "moeblaze_layer_backward"
                                                     : "moeblaze_experts_backward",
                what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [wp, layer, pass] {
                  wp->restore_saved();
                  moeblaze_backward_args_t a = wp->backward_args(pass);
                  return pass == MOEBLAZE_PASS_LAYER_BACKWARD
                             ? moeblaze_layer_backward(layer, &a, nullptr)
                             : moeblaze_experts_backward(layer, &a, nullptr);
                });
    }
  }
  // get_config's own argument.
  sweep.add("moeblaze_layer_get_config", "config NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "config",
            [wp] { return moeblaze_layer_get_config(wp->layer, nullptr); });
  for (uint32_t size : {0u, 4u, uint32_t(sizeof(moeblaze_layer_config_t) - 4)}) {
    sweep.add("moeblaze_layer_get_config", "struct_size " + std::to_string(size),
              MOEBLAZE_ERR_VERSION_MISMATCH, "struct_size", [wp, size] {
                Exact block(sizeof(moeblaze_layer_config_t));
                block.as<moeblaze_layer_config_t>()->struct_size = size;
                return moeblaze_layer_get_config(wp->layer, block.as<moeblaze_layer_config_t>());
              });
  }
  for (uint32_t size : {(1u << 20) + 4, 0xFFFFFFF0u}) {
    sweep.add("moeblaze_layer_get_config", "struct_size " + std::to_string(size),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "struct_size", [wp, size] {
                Exact block(sizeof(moeblaze_layer_config_t));
                block.as<moeblaze_layer_config_t>()->struct_size = size;
                return moeblaze_layer_get_config(wp->layer, block.as<moeblaze_layer_config_t>());
              });
  }

  // ---- size queries
  for (int32_t pass : {-1, 7, 100, std::numeric_limits<int32_t>::min()}) {
    sweep.add("moeblaze_layer_workspace_size", "pass " + std::to_string(pass),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "pass", [wp, pass] {
                size_t b = 1;
                const moeblaze_status_t s = moeblaze_layer_workspace_size(wp->layer, pass, 4, &b);
                return b == 0 ? s : MOEBLAZE_ERR_INTERNAL;
              });
  }
  for (int32_t pass : {-1, 0, 1, 2, 4, 6, 7}) {
    sweep.add("moeblaze_layer_saved_size", "pass " + std::to_string(pass),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "pass", [wp, pass] {
                size_t b = 0;
                return moeblaze_layer_saved_size(wp->layer, pass, 4, &b);
              });
  }
  for (int64_t T : kBadTokens) {
    for (int32_t pass = 0; pass <= 6; ++pass) {
      sweep.add("moeblaze_layer_workspace_size", "num_tokens " + std::to_string(T),
                MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens", [wp, pass, T] {
                  size_t b = 0;
                  return moeblaze_layer_workspace_size(wp->layer, pass, T, &b);
                });
    }
    sweep.add("moeblaze_layer_saved_size", "num_tokens " + std::to_string(T),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens", [wp, T] {
                size_t b = 0;
                return moeblaze_layer_saved_size(wp->layer, MOEBLAZE_PASS_LAYER_FORWARD, T, &b);
              });
  }
  for (uint32_t flags : {8u, 0x80000000u, 0xFFFFFFFFu}) {
    sweep.add("moeblaze_layer_workspace_size_with_flags", "flags " + std::to_string(flags),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "flags", [wp, flags] {
                size_t b = 0;
                return moeblaze_layer_workspace_size_with_flags(wp->layer, 6, 4, flags, &b);
              });
  }
  sweep.add("moeblaze_layer_workspace_size", "bytes NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "bytes",
            [wp] { return moeblaze_layer_workspace_size(wp->layer, 0, 4, nullptr); });
  sweep.add("moeblaze_layer_saved_size", "bytes NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "bytes",
            [wp] { return moeblaze_layer_saved_size(wp->layer, 3, 4, nullptr); });

  // ---- router and routing build
  {
    struct RouterForwardArgs {
      int64_t T;
      const void* logits;
      int32_t* ids;
      void* g;
      int32_t* counts;
      void* losses;
      void* ws;
      size_t ws_bytes;
    };
    auto base = [wp] {
      World& w = *wp;
      const Exact& ws = w.workspace.at(MOEBLAZE_PASS_ROUTER_FORWARD);
      return RouterForwardArgs{w.T,
                               w.logits.data(),
                               w.ids_out.as<int32_t>(),
                               w.g_out.data(),
                               w.counts.as<int32_t>(),
                               w.losses.data(),
                               ws.data(),
                               ws.size()};
    };
    auto call = [wp](const RouterForwardArgs& a) {
      return moeblaze_router_forward(wp->layer, a.T, a.logits, a.ids, a.g, a.counts, a.losses, a.ws,
                                     a.ws_bytes, nullptr);
    };
    const std::string entry = "moeblaze_router_forward";
    sweep.add(entry, "valid", MOEBLAZE_OK, "", [=] { return call(base()); });
    struct P {
      const char* name;
      std::function<void(RouterForwardArgs&, const void*)> set;
      size_t element;
      bool required;
    };
    const P pointers[] = {
        {"logits", [](RouterForwardArgs& a, const void* p) { a.logits = p; }, w.rs, true},
        {"ids", [](RouterForwardArgs& a, const void* p) { a.ids = (int32_t*)p; }, 4, true},
        {"g", [](RouterForwardArgs& a, const void* p) { a.g = (void*)p; }, w.rs, true},
        {"expert_counts", [](RouterForwardArgs& a, const void* p) { a.counts = (int32_t*)p; }, 4,
         false},
        {"losses", [](RouterForwardArgs& a, const void* p) { a.losses = (void*)p; }, w.rs, false},
    };
    for (const P& p : pointers) {
      const auto set = p.set;
      sweep.add(entry, std::string(p.name) + " NULL",
                p.required ? MOEBLAZE_ERR_INVALID_ARGUMENT : MOEBLAZE_OK, p.name, [=] {
                  RouterForwardArgs a = base();
                  set(a, nullptr);
                  return call(a);
                });
      for (size_t off = 1; off < p.element; off *= 2) {
        sweep.add(entry, std::string(p.name) + " misaligned by " + std::to_string(off),
                  MOEBLAZE_ERR_INVALID_ARGUMENT, p.name, [=] {
                    RouterForwardArgs a = base();
                    set(a, wp->d_logits.plus(off));
                    return call(a);
                  });
      }
    }
    for (int64_t T : kBadTokens) {
      sweep.add(entry, "num_tokens " + std::to_string(T), MOEBLAZE_ERR_INVALID_ARGUMENT,
                "num_tokens", [=] {
                  RouterForwardArgs a = base();
                  a.T = T;
                  return call(a);
                });
    }
    sweep.add(entry, "workspace one byte short", MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
              "workspace_bytes", [=] {
                RouterForwardArgs a = base();
                a.ws_bytes -= 1;
                return call(a);
              });
    sweep.add(entry, "workspace NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "workspace", [=] {
      RouterForwardArgs a = base();
      a.ws = nullptr;
      return call(a);
    });
    sweep.add(entry, "workspace misaligned by 8", MOEBLAZE_ERR_INVALID_ARGUMENT, "workspace", [=] {
      RouterForwardArgs a = base();
      a.ws = static_cast<unsigned char*>(a.ws) + 8;
      return call(a);
    });
    for (double bad : {double(NAN), double(INFINITY), -double(INFINITY)}) {
      for (int64_t at : {int64_t(0), w.T * w.E - 1}) {
        sweep.add(entry, "logits[" + std::to_string(at) + "] = " + std::to_string(bad),
                  MOEBLAZE_ERR_NON_FINITE, "logits", [=] {
                    World& w = *wp;
                    Exact logits(w.logits.size());
                    std::memcpy(logits.data(), w.logits.data(), w.logits.size());
                    HostTensor one(routing_dtype(w.config.dtype), {1});
                    one.set(0, bad);
                    std::memcpy(logits.bytes() + at * w.rs, one.data(), w.rs);
                    RouterForwardArgs a = base();
                    a.logits = logits.data();
                    return call(a);
                  });
      }
    }
    // Extreme but finite logits: routing works, nothing non-finite is returned with OK.
    for (double extreme : {1e30, -1e30, 3e38, -3e38, -1000.0}) {
      sweep.add(entry, "every logit " + std::to_string(extreme), MOEBLAZE_OK, "", [=] {
        World& w = *wp;
        HostTensor logits(routing_dtype(w.config.dtype), {w.T, w.E});
        logits.fill(extreme);
        RouterForwardArgs a = base();
        a.logits = logits.data();
        a.losses = nullptr;  // the z-loss of +-3e38 does not fit (tested below)
        const moeblaze_status_t s = call(a);
        HostTensor g(routing_dtype(w.config.dtype), {w.N});
        std::memcpy(g.data(), w.g_out.data(), w.g_out.size());
        for (int64_t i = 0; i < w.N; ++i) {
          if (!std::isfinite(g.get(i))) return moeblaze_status_t(MOEBLAZE_ERR_INTERNAL);
        }
        return s;
      });
    }
  }
  {
    const std::string entry = "moeblaze_router_backward";
    struct A {
      int64_t T;
      const void* logits;
      const int32_t* ids;
      const void* dg;
      const void* d_losses;
      void* d_logits;
      void* ws;
      size_t ws_bytes;
    };
    auto base = [wp] {
      World& w = *wp;
      const Exact& ws = w.workspace.at(MOEBLAZE_PASS_ROUTER_BACKWARD);
      return A{w.T,         w.logits.data(), w.ids.as<int32_t>(),
               w.dg.data(), w.losses.data(), w.d_logits.data(),
               ws.data(),   ws.size()};
    };
    auto call = [wp](const A& a) {
      return moeblaze_router_backward(wp->layer, a.T, a.logits, a.ids, a.dg, a.d_losses, a.d_logits,
                                      a.ws, a.ws_bytes, nullptr);
    };
    sweep.add(entry, "valid", MOEBLAZE_OK, "", [=] { return call(base()); });
    struct P {
      const char* name;
      std::function<void(A&, const void*)> set;
      size_t element;
      bool required;
    };
    const P pointers[] = {
        {"logits", [](A& a, const void* p) { a.logits = p; }, w.rs, true},
        {"ids", [](A& a, const void* p) { a.ids = (const int32_t*)p; }, 4, true},
        {"dg", [](A& a, const void* p) { a.dg = p; }, w.rs, true},
        {"d_losses", [](A& a, const void* p) { a.d_losses = p; }, w.rs, false},
        {"d_logits", [](A& a, const void* p) { a.d_logits = (void*)p; }, w.rs, true},
    };
    for (const P& p : pointers) {
      const auto set = p.set;
      sweep.add(entry, std::string(p.name) + " NULL",
                p.required ? MOEBLAZE_ERR_INVALID_ARGUMENT : MOEBLAZE_OK, p.name, [=] {
                  A a = base();
                  set(a, nullptr);
                  return call(a);
                });
      for (size_t off = 1; off < p.element; off *= 2) {
        sweep.add(entry, std::string(p.name) + " misaligned by " + std::to_string(off),
                  MOEBLAZE_ERR_INVALID_ARGUMENT, p.name, [=] {
                    A a = base();
                    set(a, wp->dx.plus(off));
                    return call(a);
                  });
      }
    }
    for (int64_t T : kBadTokens) {
      sweep.add(entry, "num_tokens " + std::to_string(T), MOEBLAZE_ERR_INVALID_ARGUMENT,
                "num_tokens", [=] {
                  A a = base();
                  a.T = T;
                  return call(a);
                });
    }
    sweep.add(entry, "workspace one byte short", MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
              "workspace_bytes", [=] {
                A a = base();
                a.ws_bytes -= 1;
                return call(a);
              });
    for (int32_t bad : {-1, int32_t(World::E), std::numeric_limits<int32_t>::max(),
                        std::numeric_limits<int32_t>::min()}) {
      for (int64_t at : {int64_t(0), World::N - 1}) {
        sweep.add(entry, "ids[" + std::to_string(at) + "] = " + std::to_string(bad),
                  MOEBLAZE_ERR_INVALID_ARGUMENT, "ids", [=] {
                    Exact ids(wp->ids.size());
                    std::memcpy(ids.data(), wp->ids.data(), ids.size());
                    ids.as<int32_t>()[at] = bad;
                    A a = base();
                    a.ids = ids.as<int32_t>();
                    return call(a);
                  });
      }
    }
    sweep.add(entry, "ids repeated within a token", MOEBLAZE_ERR_INVALID_ARGUMENT, "ids", [=] {
      Exact ids(wp->ids.size());
      std::memcpy(ids.data(), wp->ids.data(), ids.size());
      ids.as<int32_t>()[1] = ids.as<int32_t>()[0];
      A a = base();
      a.ids = ids.as<int32_t>();
      return call(a);
    });
    sweep.add(entry, "logits NaN", MOEBLAZE_ERR_NON_FINITE, "logits", [=] {
      World& w = *wp;
      HostTensor logits(routing_dtype(w.config.dtype), {w.T, w.E});
      std::memcpy(logits.data(), w.logits.data(), w.logits.size());
      logits.set(3, NAN);
      A a = base();
      a.logits = logits.data();
      return call(a);
    });
  }
  {
    const std::string entry = "moeblaze_routing_build";
    struct A {
      int64_t T;
      const int32_t* ids;
      int32_t *offsets, *token_indices, *index_map;
      void* ws;
      size_t ws_bytes;
    };
    auto base = [wp] {
      World& w = *wp;
      const Exact& ws = w.workspace.at(MOEBLAZE_PASS_ROUTING_BUILD);
      return A{w.T,
               w.ids.as<int32_t>(),
               w.offsets.as<int32_t>(),
               w.token_indices.as<int32_t>(),
               w.index_map.as<int32_t>(),
               ws.data(),
               ws.size()};
    };
    auto call = [wp](const A& a) {
      return moeblaze_routing_build(wp->layer, a.T, a.ids, a.offsets, a.token_indices, a.index_map,
                                    a.ws, a.ws_bytes, nullptr);
    };
    sweep.add(entry, "valid", MOEBLAZE_OK, "", [=] { return call(base()); });
    const std::pair<const char*, std::function<void(A&, int32_t*)>> pointers[] = {
        {"ids", [](A& a, int32_t* p) { a.ids = p; }},
        {"expert_offsets", [](A& a, int32_t* p) { a.offsets = p; }},
        {"expert_token_indices", [](A& a, int32_t* p) { a.token_indices = p; }},
        {"token_index_map", [](A& a, int32_t* p) { a.index_map = p; }},
    };
    for (const auto& [name, set] : pointers) {
      const auto setter = set;
      const std::string n = name;
      sweep.add(entry, n + " NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, n, [=] {
        A a = base();
        setter(a, nullptr);
        return call(a);
      });
      for (size_t off : {size_t(1), size_t(2)}) {
        sweep.add(entry, n + " misaligned by " + std::to_string(off), MOEBLAZE_ERR_INVALID_ARGUMENT,
                  n, [=] {
                    A a = base();
                    setter(a, reinterpret_cast<int32_t*>(wp->dx.plus(off)));
                    return call(a);
                  });
      }
    }
    for (int32_t bad : {-1, int32_t(World::E), std::numeric_limits<int32_t>::min()}) {
      sweep.add(entry, "ids[7] = " + std::to_string(bad), MOEBLAZE_ERR_INVALID_ARGUMENT, "ids",
                [=] {
                  Exact ids(wp->ids.size());
                  std::memcpy(ids.data(), wp->ids.data(), ids.size());
                  ids.as<int32_t>()[7] = bad;
                  A a = base();
                  a.ids = ids.as<int32_t>();
                  return call(a);
                });
    }
    sweep.add(entry, "workspace one byte short", MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
              "workspace_bytes", [=] {
                A a = base();
                a.ws_bytes -= 1;
                return call(a);
              });
    for (int64_t T : kBadTokens) {
      sweep.add(entry, "num_tokens " + std::to_string(T), MOEBLAZE_ERR_INVALID_ARGUMENT,
                "num_tokens", [=] {
                  A a = base();
                  a.T = T;
                  return call(a);
                });
    }
  }

  // ---- experts and whole layer, forward
  for (int32_t pass : {MOEBLAZE_PASS_EXPERTS_FORWARD, MOEBLAZE_PASS_LAYER_FORWARD}) {
    const bool whole = pass == MOEBLAZE_PASS_LAYER_FORWARD;
    const std::string entry = whole ? "moeblaze_layer_forward" : "moeblaze_experts_forward";
    using Args = moeblaze_forward_args_t;
    const std::function<Args()> make = [wp, pass] { return wp->forward_args(pass); };
    const std::function<moeblaze_status_t(const Args*)> call_ptr = [wp, whole](const Args* a) {
      return whole ? moeblaze_layer_forward(wp->layer, a, nullptr)
                   : moeblaze_experts_forward(wp->layer, a, nullptr);
    };
    const std::function<moeblaze_status_t(Args&)> call = [call_ptr](Args& a) {
      return call_ptr(&a);
    };
    const std::function<void()> reset = [] {};
    sweep.add(entry, "valid", MOEBLAZE_OK, "", [=] {
      Args a = make();
      return call(a);
    });
    sweep.add(entry, "inference (saved NULL)", MOEBLAZE_OK, "", [=] {
      Args a = make();
      a.saved = nullptr;
      a.saved_bytes = 0;
      return call(a);
    });
    add_field_cases<Args>(sweep, entry, forward_fields(w, whole), make, call, reset);
    add_struct_size_cases<Args>(sweep, entry, make, call_ptr, reset);
    for (int64_t T : kBadTokens) {
      sweep.add(entry, "num_tokens " + std::to_string(T), MOEBLAZE_ERR_INVALID_ARGUMENT,
                "num_tokens", [=] {
                  Args a = make();
                  a.num_tokens = T;
                  return call(a);
                });
    }
    for (uint32_t flags : {1u, 4u, 0x80000000u}) {
      sweep.add(entry, "flags " + std::to_string(flags), MOEBLAZE_ERR_INVALID_ARGUMENT,
                "args->flags", [=] {
                  Args a = make();
                  a.flags = flags;
                  return call(a);
                });
    }
    sweep.add(entry, "saved one byte short", MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
              "args->saved_bytes", [=] {
                Args a = make();
                a.saved_bytes -= 1;
                return call(a);
              });
    sweep.add(entry, "saved misaligned by 8", MOEBLAZE_ERR_INVALID_ARGUMENT, "args->saved", [=] {
      Args a = make();
      a.saved = static_cast<unsigned char*>(a.saved) + 8;
      return call(a);
    });
    // The baseline's workspace has the plain (inference) size: one byte less is refused without
    // a saved buffer and enough with one (MOEBLAZE_FORWARD_WITH_SAVED needs less).
    sweep.add(entry, "workspace one byte short (inference)", MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
              "args->workspace_bytes", [=] {
                Args a = make();
                a.saved = nullptr;
                a.saved_bytes = 0;
                a.workspace_bytes -= 1;
                return call(a);
              });
    sweep.add(entry, "workspace one byte short (training)", MOEBLAZE_OK, "", [=] {
      Args a = make();
      a.workspace_bytes -= 1;
      return call(a);
    });
    sweep.add(entry, "workspace NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "args->workspace", [=] {
      Args a = make();
      a.workspace = nullptr;
      return call(a);
    });
    sweep.add(entry, "workspace misaligned by 8", MOEBLAZE_ERR_INVALID_ARGUMENT, "args->workspace",
              [=] {
                Args a = make();
                a.workspace = static_cast<unsigned char*>(a.workspace) + 8;
                return call(a);
              });
    if (!whole) {
      for (int32_t bad : {-1, int32_t(World::E), std::numeric_limits<int32_t>::max()}) {
        sweep.add(entry, "ids[3] = " + std::to_string(bad), MOEBLAZE_ERR_INVALID_ARGUMENT, "ids",
                  [=] {
                    Exact ids(wp->ids.size());
                    std::memcpy(ids.data(), wp->ids.data(), ids.size());
                    ids.as<int32_t>()[3] = bad;
                    Args a = make();
                    a.ids = ids.as<int32_t>();
                    return call(a);
                  });
      }
      sweep.add(entry, "ids repeated within a token", MOEBLAZE_ERR_INVALID_ARGUMENT, "ids", [=] {
        Exact ids(wp->ids.size());
        std::memcpy(ids.data(), wp->ids.data(), ids.size());
        ids.as<int32_t>()[5] = ids.as<int32_t>()[4];
        Args a = make();
        a.ids = ids.as<int32_t>();
        return call(a);
      });
    } else {
      // x that makes a logit non-finite.
      for (double bad : {double(NAN), double(INFINITY), -double(INFINITY)}) {
        sweep.add(entry, "x[0] = " + std::to_string(bad), MOEBLAZE_ERR_NON_FINITE, "logits", [=] {
          World& w = *wp;
          HostTensor x(w.config.dtype, {w.T, w.d});
          std::memcpy(x.data(), w.x.data(), w.x.size());
          x.set(0, bad);
          Args a = make();
          a.x = x.data();
          return call(a);
        });
      }
    }
  }

  // ---- experts and whole layer, backward
  for (int32_t pass : {MOEBLAZE_PASS_EXPERTS_BACKWARD, MOEBLAZE_PASS_LAYER_BACKWARD}) {
    const bool whole = pass == MOEBLAZE_PASS_LAYER_BACKWARD;
    const int32_t forward = whole ? MOEBLAZE_PASS_LAYER_FORWARD : MOEBLAZE_PASS_EXPERTS_FORWARD;
    const std::string entry = whole ? "moeblaze_layer_backward" : "moeblaze_experts_backward";
    using Args = moeblaze_backward_args_t;
    const std::function<Args()> make = [wp, pass] { return wp->backward_args(pass); };
    const std::function<moeblaze_status_t(const Args*)> call_ptr = [wp, whole](const Args* a) {
      return whole ? moeblaze_layer_backward(wp->layer, a, nullptr)
                   : moeblaze_experts_backward(wp->layer, a, nullptr);
    };
    const std::function<moeblaze_status_t(Args&)> call = [call_ptr](Args& a) {
      return call_ptr(&a);
    };
    const std::function<void()> reset = [wp] { wp->restore_saved(); };
    sweep.add(entry, "valid", MOEBLAZE_OK, "", [=] {
      reset();
      Args a = make();
      return call(a);
    });
    add_field_cases<Args>(sweep, entry, backward_fields(w, whole), make, call, reset);
    add_struct_size_cases<Args>(sweep, entry, make, call_ptr, reset);
    for (int64_t T : kBadTokens) {
      sweep.add(entry, "num_tokens " + std::to_string(T), MOEBLAZE_ERR_INVALID_ARGUMENT,
                "num_tokens", [=] {
                  reset();
                  Args a = make();
                  a.num_tokens = T;
                  return call(a);
                });
    }
    for (int64_t T : {int64_t(0), World::T - 1}) {
      sweep.add(entry, "num_tokens " + std::to_string(T) + " (not the forward's)",
                MOEBLAZE_ERR_VERSION_MISMATCH, "saved", [=] {
                  reset();
                  Args a = make();
                  a.num_tokens = T;
                  return call(a);
                });
    }
    for (uint32_t flags : {4u, 8u, 0x80000000u}) {
      sweep.add(entry, "flags " + std::to_string(flags), MOEBLAZE_ERR_INVALID_ARGUMENT,
                "args->flags", [=] {
                  reset();
                  Args a = make();
                  a.flags = flags;
                  return call(a);
                });
    }
    sweep.add(entry, "saved NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "args->saved", [=] {
      reset();
      Args a = make();
      a.saved = nullptr;
      return call(a);
    });
    sweep.add(entry, "saved one byte short", MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
              "args->saved_bytes", [=] {
                reset();
                Args a = make();
                a.saved_bytes -= 1;
                return call(a);
              });
    sweep.add(entry, "saved misaligned by 8", MOEBLAZE_ERR_INVALID_ARGUMENT, "args->saved", [=] {
      reset();
      Args a = make();
      a.saved = static_cast<const unsigned char*>(a.saved) + 8;
      return call(a);
    });
    sweep.add(entry, "workspace one byte short", MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
              "args->workspace_bytes", [=] {
                reset();
                Args a = make();
                a.workspace_bytes -= 1;
                return call(a);
              });
    sweep.add(
        entry, "the other forward's saved buffer", MOEBLAZE_ERR_VERSION_MISMATCH, "saved", [=] {
          reset();
          World& w = *wp;
          const int32_t other = whole ? MOEBLAZE_PASS_EXPERTS_FORWARD : MOEBLAZE_PASS_LAYER_FORWARD;
          // Big enough for either layout; only its header differs.
          const Exact& theirs = w.saved.at(other);
          Exact copy(std::max(theirs.size(), w.saved.at(forward).size()));
          std::memcpy(copy.data(), theirs.data(), theirs.size());
          Args a = make();
          a.saved = copy.data();
          a.saved_bytes = copy.size();
          return call(a);
        });
    // The saved buffer overwritten between forward and backward: its header words, then every
    // word of its routing index with values no index can have.
    for (size_t word = 0; word < 8; ++word) {
      sweep.add(entry, "saved header word " + std::to_string(word) + " flipped",
                MOEBLAZE_ERR_VERSION_MISMATCH, "saved", [=] {
                  reset();
                  wp->saved.at(forward).as<uint32_t>()[word] ^= 0x00010001u;
                  Args a = make();
                  return call(a);
                });
    }
    sweep.add(entry, "saved all zero", MOEBLAZE_ERR_VERSION_MISMATCH, "saved", [=] {
      reset();
      std::memset(wp->saved.at(forward).data(), 0, wp->saved.at(forward).size());
      Args a = make();
      return call(a);
    });
    {
      World& w = *wp;
      std::vector<int32_t> ids(w.ids.as<int32_t>(), w.ids.as<int32_t>() + World::N);
      if (whole) {  // the router chose: read its ids back from the forward's output
        std::vector<int32_t> router_ids(World::N);
        moeblaze_forward_args_t a = w.forward_args(MOEBLAZE_PASS_LAYER_FORWARD);
        Exact saved(w.saved.at(forward).size());
        a.saved = saved.data();
        a.ids_out = router_ids.data();
        MB_CHECK(moeblaze_layer_forward(w.layer, &a, nullptr));
        ids = router_ids;
      }
      const ReferenceRoutingIndex index = routing_index_of(ids, World::T, World::E, World::k);
      const Exact& buffer = w.saved.at(forward);
      const std::pair<const char*, const std::vector<int32_t>*> arrays[] = {
          {"expert_offsets", &index.expert_offsets},
          {"expert_token_indices", &index.expert_token_indices},
          {"token_index_map", &index.token_index_map}};
      for (const auto& [name, words] : arrays) {
        const int64_t at =
            find_int32_sequence(w.saved_pristine.at(forward).data(), buffer.size(), *words);
        REQUIRE_MESSAGE(at >= 0, name);
        const int32_t N = int32_t(World::N);
        for (size_t i = 0; i < words->size(); ++i) {
          for (int32_t value : {-1, N + 1, std::numeric_limits<int32_t>::max(),
                                std::numeric_limits<int32_t>::min()}) {
            sweep.add(entry,
                      std::string("saved ") + name + "[" + std::to_string(i) +
                          "] = " + std::to_string(value),
                      MOEBLAZE_ERR_INVALID_ARGUMENT, "saved", [=] {
                        reset();
                        reinterpret_cast<int32_t*>(wp->saved.at(forward).bytes() + at)[i] = value;
                        Args a = make();
                        return call(a);
                      });
          }
        }
      }
      if (whole) {
        const int64_t at =
            find_int32_sequence(w.saved_pristine.at(forward).data(), buffer.size(), ids);
        REQUIRE(at >= 0);
        for (size_t i : {size_t(0), size_t(World::N - 1)}) {
          sweep.add(entry, "saved ids[" + std::to_string(i) + "] out of range",
                    MOEBLAZE_ERR_INVALID_ARGUMENT, "saved ids", [=] {
                      reset();
                      reinterpret_cast<int32_t*>(wp->saved.at(forward).bytes() + at)[i] = 99;
                      Args a = make();
                      return call(a);
                    });
        }
      } else {
        sweep.add(entry, "ids other than the forward's", MOEBLAZE_ERR_INVALID_ARGUMENT, "ids", [=] {
          reset();
          Exact ids(wp->ids.size());
          std::memcpy(ids.data(), wp->ids.data(), ids.size());
          std::swap(ids.as<int32_t>()[0], ids.as<int32_t>()[1]);
          Args a = make();
          a.ids = ids.as<int32_t>();
          return call(a);
        });
      }
    }
  }
}

// ---- expert parallelism (one rank of a LOCAL group: every call completes on one thread) --------

struct EpWorld {
  static constexpr int64_t T = 6, d = 8, h = 8, E = 4, k = 2;
  moeblaze_context_t context = nullptr;
  moeblaze_ep_group_t group = nullptr, destroyed_group = nullptr;
  moeblaze_ep_layer_t layer = nullptr, destroyed_layer = nullptr;
  moeblaze_layer_config_t config;
  moeblaze_ep_config_t ep;
  Exact x, w_router, w_gate, w_up, w_down, y, dy, dx, exchange, home, expert, workspace;
  std::vector<unsigned char> home_begun, exchange_begun, home_finished, exchange_finished,
      expert_finished;
  std::set<size_t> home_checked_words;  // HOME words that hold a header field, count or index
  int64_t recv_rows = 0;

  EpWorld() {
    MB_CHECK(moeblaze_context_create(&context, MOEBLAZE_BACKEND_CPU, 0));
    MB_CHECK(moeblaze_ep_local_group_create(&group, 1));
    MB_CHECK(moeblaze_ep_local_group_create(&destroyed_group, 1));
    MB_CHECK(moeblaze_ep_local_group_destroy(destroyed_group));
    config = make_config(MOEBLAZE_DTYPE_F32, d, h, E, k);
    config.aux_loss_coeff = 0.01f;
    moeblaze_ep_config_init(&ep, sizeof ep);
    ep.transport = MOEBLAZE_EP_TRANSPORT_LOCAL;
    ep.communicator = group;
    MB_CHECK(moeblaze_ep_layer_create(&layer, context, &config, &ep));
    MB_CHECK(moeblaze_ep_layer_create(&destroyed_layer, context, &config, &ep));
    MB_CHECK(moeblaze_ep_layer_destroy(destroyed_layer));
    for (Exact* t : {&x, &y, &dy, &dx}) t->reset(4 * T * d);
    w_router.reset(4 * E * d);
    for (Exact* t : {&w_gate, &w_up, &w_down}) t->reset(4 * E * h * d);
    Rng rng(test_seed(2526));
    for (const Exact* t : {&x, &dy, &w_router, &w_gate, &w_up, &w_down}) {
      HostTensor tmp(MOEBLAZE_DTYPE_F32, {int64_t(t->size() / 4)});
      fill_normal(tmp, rng, 0.5);
      std::memcpy(t->data(), tmp.data(), t->size());
    }
    size_t bytes = 0;
    MB_CHECK(moeblaze_ep_layer_exchange_size(layer, &bytes));
    exchange.reset(bytes);
    MB_CHECK(moeblaze_ep_layer_saved_size(layer, MOEBLAZE_EP_SAVED_HOME, T, 0, &bytes));
    home.reset(bytes);
    size_t ws = 0;
    MB_CHECK(moeblaze_ep_layer_workspace_size(layer, MOEBLAZE_EP_PASS_FORWARD_BEGIN, T, 0, &ws));
    workspace.reset(ws);
    moeblaze_ep_forward_args_t a = forward_args();
    MB_CHECK(moeblaze_ep_forward_begin(layer, &a, exchange.data(), exchange.size(), &recv_rows,
                                       nullptr));
    // Exact sizes for this step's recv_rows.
    MB_CHECK(moeblaze_ep_layer_saved_size(layer, MOEBLAZE_EP_SAVED_EXPERT, T, recv_rows, &bytes));
    expert.reset(bytes);
    for (int32_t pass : {1, 2}) {
      MB_CHECK(moeblaze_ep_layer_workspace_size(layer, pass, T, recv_rows, &bytes));
      ws = std::max(ws, bytes);
    }
    workspace.reset(ws);
    a = forward_args();
    MB_CHECK(moeblaze_ep_forward_begin(layer, &a, exchange.data(), exchange.size(), &recv_rows,
                                       nullptr));
    home_begun = snapshot(home);
    exchange_begun = snapshot(exchange);
    std::vector<int32_t> ids(size_t(T * k));
    a.ids_out = ids.data();
    MB_CHECK(moeblaze_ep_forward_finish(layer, &a, exchange.data(), exchange.size(), nullptr));
    home_finished = snapshot(home);
    exchange_finished = snapshot(exchange);
    expert_finished = snapshot(expert);

    // Where the header, count table, ids and routing index are: the header first (its fields
    // fill the first 40 bytes), the others found by their content.
    for (size_t word = 0; word < 10; ++word) home_checked_words.insert(word);
    const ReferenceRoutingIndex index = routing_index_of(ids, T, E, k);
    std::vector<int32_t> counts(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      counts[size_t(e)] = index.expert_offsets[size_t(e + 1)] - index.expert_offsets[size_t(e)];
    }
    const std::vector<const std::vector<int32_t>*> arrays = {
        &counts, &ids, &index.expert_offsets, &index.expert_token_indices, &index.token_index_map};
    for (const std::vector<int32_t>* words : arrays) {
      const int64_t at = find_int32_sequence(home_begun.data(), home_begun.size(), *words);
      REQUIRE(at >= 0);
      for (size_t i = 0; i < words->size(); ++i) home_checked_words.insert(size_t(at / 4) + i);
    }
  }
  ~EpWorld() {
    moeblaze_ep_layer_destroy(layer);
    moeblaze_ep_local_group_destroy(group);
    moeblaze_context_destroy(context);
  }

  moeblaze_ep_forward_args_t forward_args() const {
    moeblaze_ep_forward_args_t a;
    moeblaze_ep_forward_args_init(&a, sizeof a);
    a.num_tokens = T;
    a.x = x.data();
    a.w_router = w_router.data();
    a.w_gate = w_gate.data();
    a.w_up = w_up.data();
    a.w_down = w_down.data();
    a.y = y.data();
    a.home_saved = home.data();
    a.home_saved_bytes = home.size();
    a.expert_saved = expert.data();
    a.expert_saved_bytes = expert.size();
    a.workspace = workspace.data();
    a.workspace_bytes = workspace.size();
    return a;
  }
  moeblaze_ep_backward_args_t backward_args() const {
    moeblaze_ep_backward_args_t a;
    moeblaze_ep_backward_args_init(&a, sizeof a);
    a.num_tokens = T;
    a.dy = dy.data();
    a.x = x.data();
    a.w_router = w_router.data();
    a.w_gate = w_gate.data();
    a.w_up = w_up.data();
    a.w_down = w_down.data();
    a.home_saved = home.data();
    a.home_saved_bytes = home.size();
    a.expert_saved = expert.data();
    a.expert_saved_bytes = expert.size();
    a.dx = dx.data();
    a.workspace = workspace.data();
    a.workspace_bytes = workspace.size();
    return a;
  }
  void to_begun() {
    restore(home, home_begun);
    restore(exchange, exchange_begun);
  }
  void to_finished() {
    restore(home, home_finished);
    restore(exchange, exchange_finished);
    restore(expert, expert_finished);
  }
};

void add_ep_cases(Sweep& sweep, const std::shared_ptr<EpWorld>& wp) {
  EpWorld& w = *wp;
  const auto bad_layers = bad_handles<moeblaze_ep_layer_t>(w.destroyed_layer, w.group);
  const auto bad_groups = bad_handles<moeblaze_ep_group_t>(w.destroyed_group, w.layer);

  sweep.add("moeblaze_ep_local_group_create", "out NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "out",
            [] { return moeblaze_ep_local_group_create(nullptr, 1); });
  for (int32_t size : {0, -1, MOEBLAZE_MAX_EXPERTS + 1, std::numeric_limits<int32_t>::min()}) {
    sweep.add("moeblaze_ep_local_group_create", "world_size " + std::to_string(size),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "world_size", [size] {
                moeblaze_ep_group_t g = nullptr;
                return moeblaze_ep_local_group_create(&g, size);
              });
  }
  for (const auto& [what, g] : bad_groups) {
    const moeblaze_ep_group_t group = g;
    sweep.add("moeblaze_ep_local_group_destroy", what,
              group == nullptr ? MOEBLAZE_OK : MOEBLAZE_ERR_INVALID_HANDLE, "group",
              [group] { return moeblaze_ep_local_group_destroy(group); });
    if (group == nullptr) continue;  // a NULL communicator is its own case below
    sweep.add("moeblaze_ep_layer_create", "communicator " + what, MOEBLAZE_ERR_INVALID_HANDLE,
              "communicator", [wp, group] {
                moeblaze_ep_config_t ep = wp->ep;
                ep.communicator = group;
                moeblaze_ep_layer_t out = nullptr;
                return moeblaze_ep_layer_create(&out, wp->context, &wp->config, &ep);
              });
  }
  struct EpConfigCase {
    const char* what;
    std::function<void(moeblaze_ep_config_t&)> set;
    moeblaze_status_t expected;
    const char* needle;
  };
  const EpConfigCase ep_cases[] = {
      {"transport 0", [](moeblaze_ep_config_t& e) { e.transport = 0; }, MOEBLAZE_ERR_NOT_SUPPORTED,
       "transport"},
      {"transport 3", [](moeblaze_ep_config_t& e) { e.transport = 3; }, MOEBLAZE_ERR_NOT_SUPPORTED,
       "transport"},
      {"NCCL on a CPU context",
       [](moeblaze_ep_config_t& e) { e.transport = MOEBLAZE_EP_TRANSPORT_NCCL; },
       MOEBLAZE_ERR_NOT_SUPPORTED, "NCCL"},
      {"rank -1", [](moeblaze_ep_config_t& e) { e.rank = -1; }, MOEBLAZE_ERR_INVALID_ARGUMENT,
       "rank"},
      {"rank = world_size", [](moeblaze_ep_config_t& e) { e.rank = 1; },
       MOEBLAZE_ERR_INVALID_ARGUMENT, "rank"},
      {"world_size 0", [](moeblaze_ep_config_t& e) { e.world_size = 0; },
       MOEBLAZE_ERR_INVALID_ARGUMENT, "world_size"},
      {"world_size > E", [](moeblaze_ep_config_t& e) { e.world_size = 5; },
       MOEBLAZE_ERR_INVALID_ARGUMENT, "world_size"},
      {"world_size 2 with a 1-rank group", [](moeblaze_ep_config_t& e) { e.world_size = 2; },
       MOEBLAZE_ERR_INVALID_ARGUMENT, "world_size"},
      {"communicator NULL", [](moeblaze_ep_config_t& e) { e.communicator = nullptr; },
       MOEBLAZE_ERR_INVALID_ARGUMENT, "communicator"},
  };
  for (const EpConfigCase& c : ep_cases) {
    const auto set = c.set;
    sweep.add("moeblaze_ep_layer_create", c.what, c.expected, c.needle, [wp, set] {
      moeblaze_ep_config_t ep = wp->ep;
      set(ep);
      moeblaze_ep_layer_t out = nullptr;
      return moeblaze_ep_layer_create(&out, wp->context, &wp->config, &ep);
    });
  }
  sweep.add("moeblaze_ep_layer_create", "out NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "out",
            [wp] { return moeblaze_ep_layer_create(nullptr, wp->context, &wp->config, &wp->ep); });
  add_struct_size_cases<moeblaze_ep_config_t>(
      sweep, "moeblaze_ep_layer_create", [wp] { return wp->ep; },
      [wp](const moeblaze_ep_config_t* e) {
        moeblaze_ep_layer_t out = nullptr;
        const moeblaze_status_t s = moeblaze_ep_layer_create(&out, wp->context, &wp->config, e);
        if (out != nullptr) moeblaze_ep_layer_destroy(out);
        return s;
      },
      [] {});

  for (const auto& [what, l] : bad_layers) {
    const moeblaze_ep_layer_t layer = l;
    sweep.add("moeblaze_ep_layer_destroy", what,
              layer == nullptr ? MOEBLAZE_OK : MOEBLAZE_ERR_INVALID_HANDLE, "layer",
              [layer] { return moeblaze_ep_layer_destroy(layer); });
    sweep.add("moeblaze_ep_layer_get_experts", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [layer] {
      int64_t b = 0, e = 0;
      return moeblaze_ep_layer_get_experts(layer, &b, &e);
    });
    sweep.add("moeblaze_ep_layer_exchange_size", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer",
              [layer] {
                size_t b = 0;
                return moeblaze_ep_layer_exchange_size(layer, &b);
              });
    sweep.add("moeblaze_ep_layer_workspace_size", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer",
              [layer] {
                size_t b = 0;
                return moeblaze_ep_layer_workspace_size(layer, 0, 4, 0, &b);
              });
    sweep.add("moeblaze_ep_layer_workspace_size_with_flags", what, MOEBLAZE_ERR_INVALID_HANDLE,
              "layer", [layer] {
                size_t b = 0;
                return moeblaze_ep_layer_workspace_size_with_flags(layer, 2, 4, 4, 0, &b);
              });
    sweep.add("moeblaze_ep_layer_saved_size", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [layer] {
      size_t b = 0;
      return moeblaze_ep_layer_saved_size(layer, 0, 4, 0, &b);
    });
    sweep.add("moeblaze_ep_forward_begin", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [wp, layer] {
      moeblaze_ep_forward_args_t a = wp->forward_args();
      int64_t r = 0;
      return moeblaze_ep_forward_begin(layer, &a, wp->exchange.data(), wp->exchange.size(), &r,
                                       nullptr);
    });
    sweep.add("moeblaze_ep_forward_finish", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer",
              [wp, layer] {
                wp->to_begun();
                moeblaze_ep_forward_args_t a = wp->forward_args();
                return moeblaze_ep_forward_finish(layer, &a, wp->exchange.data(),
                                                  wp->exchange.size(), nullptr);
              });
    sweep.add("moeblaze_ep_backward", what, MOEBLAZE_ERR_INVALID_HANDLE, "layer", [wp, layer] {
      wp->to_finished();
      moeblaze_ep_backward_args_t a = wp->backward_args();
      return moeblaze_ep_backward(layer, &a, wp->exchange.data(), wp->exchange.size(), nullptr);
    });
  }
  // Size queries.
  for (int32_t pass : {-1, 3, std::numeric_limits<int32_t>::max()}) {
    sweep.add("moeblaze_ep_layer_workspace_size", "pass " + std::to_string(pass),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "pass", [wp, pass] {
                size_t b = 0;
                return moeblaze_ep_layer_workspace_size(wp->layer, pass, 4, 4, &b);
              });
  }
  for (int32_t part : {-1, 2}) {
    sweep.add("moeblaze_ep_layer_saved_size", "part " + std::to_string(part),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "part", [wp, part] {
                size_t b = 0;
                return moeblaze_ep_layer_saved_size(wp->layer, part, 4, 4, &b);
              });
  }
  for (int64_t T : kBadTokens) {
    for (int32_t pass : {0, 1, 2}) {
      sweep.add("moeblaze_ep_layer_workspace_size", "num_tokens " + std::to_string(T),
                MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens", [wp, T, pass] {
                  size_t b = 0;
                  return moeblaze_ep_layer_workspace_size(wp->layer, pass, T, 4, &b);
                });
    }
    sweep.add("moeblaze_ep_layer_saved_size", "num_tokens " + std::to_string(T),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens", [wp, T] {
                size_t b = 0;
                return moeblaze_ep_layer_saved_size(wp->layer, 0, T, 4, &b);
              });
    for (int32_t pass : {1, 2}) {
      sweep.add("moeblaze_ep_layer_workspace_size", "recv_rows " + std::to_string(T),
                MOEBLAZE_ERR_INVALID_ARGUMENT, "recv_rows", [wp, T, pass] {
                  size_t b = 0;
                  return moeblaze_ep_layer_workspace_size(wp->layer, pass, 4, T, &b);
                });
    }
    sweep.add("moeblaze_ep_layer_saved_size", "recv_rows " + std::to_string(T),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "recv_rows", [wp, T] {
                size_t b = 0;
                return moeblaze_ep_layer_saved_size(wp->layer, 1, 4, T, &b);
              });
  }
  for (uint32_t flags : {4u, 0xFFFFFFFFu}) {
    sweep.add("moeblaze_ep_layer_workspace_size_with_flags", "flags " + std::to_string(flags),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "flags", [wp, flags] {
                size_t b = 0;
                return moeblaze_ep_layer_workspace_size_with_flags(wp->layer, 2, 4, 4, flags, &b);
              });
  }
  sweep.add("moeblaze_ep_layer_exchange_size", "bytes NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "bytes",
            [wp] { return moeblaze_ep_layer_exchange_size(wp->layer, nullptr); });
  sweep.add("moeblaze_ep_layer_get_experts", "both outputs NULL", MOEBLAZE_OK, "",
            [wp] { return moeblaze_ep_layer_get_experts(wp->layer, nullptr, nullptr); });

  // The three collective calls.
  using FA = moeblaze_ep_forward_args_t;
  using BA = moeblaze_ep_backward_args_t;
  const std::function<FA()> make_fa = [wp] { return wp->forward_args(); };
  const std::function<BA()> make_ba = [wp] { return wp->backward_args(); };
  const std::function<moeblaze_status_t(const FA*)> begin_ptr = [wp](const FA* a) {
    int64_t r = 0;
    return moeblaze_ep_forward_begin(wp->layer, a, wp->exchange.data(), wp->exchange.size(), &r,
                                     nullptr);
  };
  const std::function<moeblaze_status_t(const FA*)> finish_ptr = [wp](const FA* a) {
    return moeblaze_ep_forward_finish(wp->layer, a, wp->exchange.data(), wp->exchange.size(),
                                      nullptr);
  };
  const std::function<moeblaze_status_t(const BA*)> backward_ptr = [wp](const BA* a) {
    return moeblaze_ep_backward(wp->layer, a, wp->exchange.data(), wp->exchange.size(), nullptr);
  };
  const std::function<void()> begun = [wp] { wp->to_begun(); };
  const std::function<void()> finished = [wp] { wp->to_finished(); };
  const std::function<void()> nothing = [] {};

  sweep.add("moeblaze_ep_forward_begin", "valid", MOEBLAZE_OK, "", [=] {
    FA a = make_fa();
    return begin_ptr(&a);
  });
  sweep.add("moeblaze_ep_forward_finish", "valid", MOEBLAZE_OK, "", [=] {
    begun();
    FA a = make_fa();
    return finish_ptr(&a);
  });
  sweep.add("moeblaze_ep_backward", "valid", MOEBLAZE_OK, "", [=] {
    finished();
    BA a = make_ba();
    return backward_ptr(&a);
  });
  add_struct_size_cases<FA>(sweep, "moeblaze_ep_forward_begin", make_fa, begin_ptr, nothing);
  add_struct_size_cases<FA>(sweep, "moeblaze_ep_forward_finish", make_fa, finish_ptr, begun);
  add_struct_size_cases<BA>(sweep, "moeblaze_ep_backward", make_ba, backward_ptr, finished);
  {
    using A = FA;
    const std::vector<Field> begin_fields = {
        MB_FIELD(A, x, 4, Required),         MB_FIELD(A, w_router, 4, Required),
        MB_FIELD(A, w_gate, 4, Ignored),     MB_FIELD(A, w_up, 4, Ignored),
        MB_FIELD(A, w_down, 4, Ignored),     MB_FIELD(A, y, 4, Ignored),
        MB_FIELD(A, logits_out, 4, Ignored), MB_FIELD(A, ids_out, 4, Ignored),
        MB_FIELD(A, g_out, 4, Ignored),      MB_FIELD(A, expert_counts, 4, Ignored),
        MB_FIELD(A, losses, 4, Ignored),     MB_FIELD(A, expert_saved, 16, Ignored),
    };
    const std::vector<Field> finish_fields = {
        MB_FIELD(A, x, 4, Required),          MB_FIELD(A, w_router, 4, Ignored),
        MB_FIELD(A, w_gate, 4, Required),     MB_FIELD(A, w_up, 4, Required),
        MB_FIELD(A, w_down, 4, Required),     MB_FIELD(A, y, 4, Required),
        MB_FIELD(A, logits_out, 4, Optional), MB_FIELD(A, ids_out, 4, Optional),
        MB_FIELD(A, g_out, 4, Optional),      MB_FIELD(A, expert_counts, 4, Optional),
        MB_FIELD(A, losses, 4, Optional),
    };
    const std::function<moeblaze_status_t(A&)> begin = [begin_ptr](A& a) { return begin_ptr(&a); };
    const std::function<moeblaze_status_t(A&)> finish = [finish_ptr](A& a) {
      return finish_ptr(&a);
    };
    add_field_cases<A>(sweep, "moeblaze_ep_forward_begin", begin_fields, make_fa, begin, nothing);
    add_field_cases<A>(sweep, "moeblaze_ep_forward_finish", finish_fields, make_fa, finish, begun);
  }
  {
    using A = BA;
    const std::vector<Field> fields = {
        MB_FIELD(A, dy, 4, Required),        MB_FIELD(A, d_losses, 4, Optional),
        MB_FIELD(A, x, 4, Required),         MB_FIELD(A, w_router, 4, Required),
        MB_FIELD(A, w_gate, 4, Required),    MB_FIELD(A, w_up, 4, Required),
        MB_FIELD(A, w_down, 4, Required),    MB_FIELD(A, dx, 4, Optional),
        MB_FIELD(A, dw_router, 4, Optional), MB_FIELD(A, dw_gate, 4, Optional),
        MB_FIELD(A, dw_up, 4, Optional),     MB_FIELD(A, dw_down, 4, Optional),
        MB_FIELD(A, dg, 4, Optional),        MB_FIELD(A, d_logits, 4, Optional),
    };
    const std::function<moeblaze_status_t(A&)> call = [backward_ptr](A& a) {
      return backward_ptr(&a);
    };
    add_field_cases<A>(sweep, "moeblaze_ep_backward", fields, make_ba, call, finished);
  }
  // Buffers, sizes, flags and call order.
  struct BufferCase {
    const char* what;
    std::function<void(FA&)> set;
    moeblaze_status_t expected;
    const char* needle;
  };
  const BufferCase forward_buffers[] = {
      {"home_saved NULL", [](FA& a) { a.home_saved = nullptr; }, MOEBLAZE_ERR_INVALID_ARGUMENT,
       "args->home_saved"},
      {"home_saved one byte short", [](FA& a) { a.home_saved_bytes -= 1; },
       MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "args->home_saved_bytes"},
      {"home_saved misaligned by 8",
       [](FA& a) { a.home_saved = static_cast<unsigned char*>(a.home_saved) + 8; },
       MOEBLAZE_ERR_INVALID_ARGUMENT, "args->home_saved"},
      {"workspace one byte short", [](FA& a) { a.workspace_bytes = 1; },
       MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "args->workspace_bytes"},
      {"workspace NULL", [](FA& a) { a.workspace = nullptr; }, MOEBLAZE_ERR_INVALID_ARGUMENT,
       "args->workspace"},
      {"flags 1", [](FA& a) { a.flags = 1; }, MOEBLAZE_ERR_INVALID_ARGUMENT, "args->flags"},
  };
  for (const BufferCase& c : forward_buffers) {
    const auto set = c.set;
    sweep.add("moeblaze_ep_forward_begin", c.what, c.expected, c.needle, [=] {
      FA a = make_fa();
      set(a);
      return begin_ptr(&a);
    });
    sweep.add("moeblaze_ep_forward_finish", c.what, c.expected, c.needle, [=] {
      begun();
      FA a = make_fa();
      set(a);
      return finish_ptr(&a);
    });
  }
  sweep.add("moeblaze_ep_forward_finish", "expert_saved NULL", MOEBLAZE_ERR_INVALID_ARGUMENT,
            "args->expert_saved", [=] {
              begun();
              FA a = make_fa();
              a.expert_saved = nullptr;
              return finish_ptr(&a);
            });
  sweep.add("moeblaze_ep_forward_finish", "expert_saved one byte short",
            MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "args->expert_saved_bytes", [=] {
              begun();
              FA a = make_fa();
              a.expert_saved_bytes -= 1;
              return finish_ptr(&a);
            });
  for (int64_t T : kBadTokens) {
    sweep.add("moeblaze_ep_forward_begin", "num_tokens " + std::to_string(T),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens", [=] {
                FA a = make_fa();
                a.num_tokens = T;
                return begin_ptr(&a);
              });
    sweep.add("moeblaze_ep_forward_finish", "num_tokens " + std::to_string(T),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens", [=] {
                begun();
                FA a = make_fa();
                a.num_tokens = T;
                return finish_ptr(&a);
              });
    sweep.add("moeblaze_ep_backward", "num_tokens " + std::to_string(T),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "num_tokens", [=] {
                finished();
                BA a = make_ba();
                a.num_tokens = T;
                return backward_ptr(&a);
              });
  }
  for (uint32_t flags : {4u, 0x80000000u}) {
    sweep.add("moeblaze_ep_backward", "flags " + std::to_string(flags),
              MOEBLAZE_ERR_INVALID_ARGUMENT, "args->flags", [=] {
                finished();
                BA a = make_ba();
                a.flags = flags;
                return backward_ptr(&a);
              });
  }
  sweep.add("moeblaze_ep_backward", "home_saved NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "home_saved",
            [=] {
              finished();
              BA a = make_ba();
              a.home_saved = nullptr;
              return backward_ptr(&a);
            });
  sweep.add("moeblaze_ep_backward", "expert_saved one byte short",
            MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE, "args->expert_saved_bytes", [=] {
              finished();
              BA a = make_ba();
              a.expert_saved_bytes -= 1;
              return backward_ptr(&a);
            });
  sweep.add("moeblaze_ep_backward", "workspace one byte short", MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
            "args->workspace_bytes", [=] {
              finished();
              BA a = make_ba();
              a.workspace_bytes = 1;
              return backward_ptr(&a);
            });
  // The exchange buffer itself.
  const std::string calls[] = {"moeblaze_ep_forward_begin", "moeblaze_ep_forward_finish",
                               "moeblaze_ep_backward"};
  for (const std::string& entry : calls) {
    auto run = [=](void* exchange, size_t bytes) {
      if (entry == calls[0]) {
        FA a = make_fa();
        int64_t r = 0;
        return moeblaze_ep_forward_begin(wp->layer, &a, exchange, bytes, &r, nullptr);
      }
      if (entry == calls[1]) {
        begun();
        FA a = make_fa();
        return moeblaze_ep_forward_finish(wp->layer, &a, exchange, bytes, nullptr);
      }
      finished();
      BA a = make_ba();
      return moeblaze_ep_backward(wp->layer, &a, exchange, bytes, nullptr);
    };
    sweep.add(entry, "exchange NULL", MOEBLAZE_ERR_INVALID_ARGUMENT, "exchange",
              [=] { return run(nullptr, wp->exchange.size()); });
    sweep.add(entry, "exchange one byte short", MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE,
              "exchange_bytes", [=] { return run(wp->exchange.data(), wp->exchange.size() - 1); });
    sweep.add(entry, "exchange misaligned by 4", MOEBLAZE_ERR_INVALID_ARGUMENT, "exchange",
              [=] { return run(wp->exchange.plus(4), wp->exchange.size()); });
  }
  sweep.add("moeblaze_ep_forward_begin", "recv_rows NULL", MOEBLAZE_ERR_INVALID_ARGUMENT,
            "recv_rows", [=] {
              FA a = make_fa();
              return moeblaze_ep_forward_begin(wp->layer, &a, wp->exchange.data(),
                                               wp->exchange.size(), nullptr, nullptr);
            });
  sweep.add("moeblaze_ep_forward_finish", "a finished step", MOEBLAZE_ERR_INVALID_ARGUMENT,
            "already finished", [=] {
              finished();
              FA a = make_fa();
              return finish_ptr(&a);
            });
  sweep.add("moeblaze_ep_backward", "a step not finished", MOEBLAZE_ERR_INVALID_ARGUMENT,
            "forward_finish", [=] {
              begun();
              BA a = make_ba();
              return backward_ptr(&a);
            });
  sweep.add("moeblaze_ep_forward_finish", "exchange never begun", MOEBLAZE_ERR_INVALID_ARGUMENT,
            "forward_begin", [=] {
              begun();
              std::memset(wp->exchange.data(), 0, wp->exchange.size());
              FA a = make_fa();
              return finish_ptr(&a);
            });
  // The exchange and HOME buffers overwritten between calls, every word of each: words that hold
  // a header field, a count or an index must be refused; words that hold values (logits, g) or
  // padding may be accepted; nothing may be read or written outside the buffers.
  for (int phase = 0; phase < 2; ++phase) {
    const bool in_finish = phase == 0;
    const std::string entry = in_finish ? calls[1] : calls[2];
    auto call = [=] {
      if (in_finish) {
        FA a = make_fa();
        return finish_ptr(&a);
      }
      BA a = make_ba();
      return backward_ptr(&a);
    };
    // `exchange`: a 64-byte header (12 words of fields, then padding), then the count table.
    for (size_t word = 0; word < w.exchange.size() / 4; ++word) {
      const bool padding = word >= 12 && word < 16;
      for (int32_t value : {-1, 1 << 24}) {
        sweep.add(entry, "exchange word " + std::to_string(word) + " = " + std::to_string(value),
                  padding ? MOEBLAZE_OK : MOEBLAZE_ERR_INVALID_ARGUMENT, "exchange", [=] {
                    in_finish ? begun() : finished();
                    reinterpret_cast<int32_t*>(wp->exchange.data())[word] = value;
                    return call();
                  });
      }
    }
    for (size_t word = 0; word < w.home.size() / 4; ++word) {
      const bool checked = w.home_checked_words.count(word) > 0;
      sweep.add(entry, "home_saved word " + std::to_string(word) + " = INT32_MIN",
                checked ? MOEBLAZE_ERR_INVALID_ARGUMENT : MOEBLAZE_OK, "home_saved", [=] {
                  in_finish ? begun() : finished();
                  reinterpret_cast<int32_t*>(wp->home.data())[word] =
                      std::numeric_limits<int32_t>::min();
                  return call();
                });
    }
  }
}

}  // namespace

TEST_CASE("bad input: every entry point refuses every class of bad input") {
  Sweep sweep;
  add_global_cases(sweep);
  std::vector<std::shared_ptr<World>> worlds;
  for (const LayerCase& lc : kLayerCases) {
    INFO(lc.name);
    worlds.push_back(std::make_shared<World>(lc));
    add_layer_cases(sweep, worlds.back());
  }
  auto ep = std::make_shared<EpWorld>();
  add_ep_cases(sweep, ep);
  const size_t cases = sweep.run();
  MESSAGE("bad-input sweep: " << cases << " cases over " << sweep.entries()
                              << " entry points (3 layer configurations, EP on one rank)");
  CHECK(sweep.entries() == 43);  // every function of moeblaze.h
  std::printf("bad-input sweep: %zu cases over %zu entry points\n", cases, sweep.entries());
  CHECK(cases > 1000);
}
