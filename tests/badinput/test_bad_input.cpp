// The bad-input sweep: every public entry point of moeblaze.h against each class of bad input —
// NULL, destroyed, foreign and wrong-kind handles; struct_size extremes; sizes that overflow;
// short and misaligned buffers; saved and exchange buffers overwritten between calls; extreme and
// non-finite values. Every case must give its documented status and a message naming what is
// wrong; none may crash or touch memory outside the caller's buffers. Buffers are exactly as large
// as the library asked for (heap blocks of that size), so under AddressSanitizer (scripts/test.sh,
// sanitize phase) an access one byte outside any of them fails the case.
//
// The sweep is table-driven. An Entry is one entry point with a valid call (checked to succeed by
// its "valid" case): its arguments, and the state the call reads, restored before each case. A
// case is that call with one thing changed: a row, or a helper that adds a whole class of bad input
// (bad handles, pointer fields, struct_size, bad values of one argument, buffers). The suite prints
// how many cases it ran; MOEBLAZE_BADINPUT_LIST=<file> writes them, one a line, so that two
// versions of the sweep can be compared.
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "support/test_support.hpp"

using namespace mbtest;

namespace {

constexpr moeblaze_status_t kOk = MOEBLAZE_OK;
constexpr moeblaze_status_t kInvalid = MOEBLAZE_ERR_INVALID_ARGUMENT;
constexpr moeblaze_status_t kBadHandle = MOEBLAZE_ERR_INVALID_HANDLE;
constexpr moeblaze_status_t kShortBuffer = MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE;
constexpr moeblaze_status_t kMismatch = MOEBLAZE_ERR_VERSION_MISMATCH;
constexpr int32_t kI32Min = std::numeric_limits<int32_t>::min();
constexpr int32_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

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

// Buffers one case makes for its call (changed copies of inputs), freed when the case ends.
class Scratch {
 public:
  Exact& block(size_t bytes) {
    blocks_.emplace_back(bytes);
    return blocks_.back();
  }
  Exact& copy(const Exact& source) {
    Exact& b = block(source.size());
    if (source.size() > 0) std::memcpy(b.data(), source.data(), source.size());
    return b;
  }
  // A copy of `source` whose element `at`, of `dtype`, is `value`.
  void* copy_with(const Exact& source, int32_t dtype, int64_t at, double value) {
    Exact& b = copy(source);
    HostTensor one(dtype, {1});
    one.set(0, value);
    std::memcpy(b.bytes() + at * dtype_bytes(dtype), one.data(), dtype_bytes(dtype));
    return b.data();
  }
  // A copy of the int32 array `source` whose element `at` is `value`.
  int32_t* ids_with(const Exact& source, int64_t at, int32_t value) {
    int32_t* ids = copy(source).as<int32_t>();
    ids[at] = value;
    return ids;
  }
  // A copy of the ids `source` (top_k 2) in which token `token` names one expert twice.
  int32_t* ids_repeating(const Exact& source, int64_t token) {
    int32_t* ids = copy(source).as<int32_t>();
    ids[2 * token + 1] = ids[2 * token];
    return ids;
  }

 private:
  std::list<Exact> blocks_;
};

// ---- the sweep ----------------------------------------------------------------------------------

struct Case {
  std::string entry;  // the entry point
  std::string what;   // the bad input: which argument, and what is wrong with it
  moeblaze_status_t expected;
  std::string needle;  // the message must mention it (failures only): the argument
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
    add(std::move(entry), std::move(what), kOk, "",
        [ok] { return ok() ? kOk : MOEBLAZE_ERR_INTERNAL; });
  }

  // Runs every case; returns how many.
  size_t run() {
    std::map<std::string, int> per_entry;
    FILE* list = nullptr;
    if (const char* path = std::getenv("MOEBLAZE_BADINPUT_LIST")) list = std::fopen(path, "w");
    for (const Case& c : cases_) {
      CAPTURE(c.entry);
      CAPTURE(c.what);
      const moeblaze_status_t status = c.call();
      const std::string message = moeblaze_last_error();
      // doctest prints a const char* as a pointer: the names go in as strings.
      const std::string got = moeblaze_status_name(status);
      const std::string expected = moeblaze_status_name(c.expected);
      const std::string naming = c.expected == kOk ? "" : " naming '" + c.needle + "'";
      CHECK_MESSAGE(status == c.expected, c.entry << " [" << c.what << "] returned " << got << " ("
                                                  << message << "), expected " << expected
                                                  << naming);
      if (status != kOk && status == c.expected) {
        CHECK_MESSAGE((!message.empty() && message.find(c.needle) != std::string::npos),
                      c.entry << " [" << c.what << "]: message '" << message
                              << "' does not mention '" << c.needle << "'");
      }
      ++per_entry[c.entry];
      if (list) {
        std::fprintf(list, "%s\t%s\t%s\t%s\n", c.entry.c_str(), c.what.c_str(),
                     moeblaze_status_name(c.expected), c.needle.c_str());
      }
    }
    if (list) std::fclose(list);
    entries_ = per_entry.size();
    return cases_.size();
  }
  size_t entries() const { return entries_; }

 private:
  std::vector<Case> cases_;
  size_t entries_ = 0;
};

// ---- entry points and the classes of bad input --------------------------------------------------

template <typename Args>
using Change = std::function<void(Args&, Scratch&)>;

// One entry point from a valid call: `make` gives valid arguments, `reset` restores the state the
// call reads (saved and exchange buffers), `call` runs it on a handle.
template <typename Handle, typename Args>
struct Entry {
  std::string name;
  Handle handle;
  std::function<Args()> make;
  std::function<moeblaze_status_t(Handle, const Args*)> call;
  std::function<void()> reset = [] {};

  // A case: the valid call with `change` applied to its arguments.
  void add(Sweep& sweep, std::string what, moeblaze_status_t expected, std::string needle,
           Change<Args> change) const {
    add_run(sweep, std::move(what), expected, std::move(needle), [change](const Entry& e) {
      Scratch scratch;
      Args a = e.make();
      change(a, scratch);
      return e.call(e.handle, &a);
    });
  }
  // A case that makes its own call of the entry point, after the reset.
  void add_run(Sweep& sweep, std::string what, moeblaze_status_t expected, std::string needle,
               std::function<moeblaze_status_t(const Entry&)> run) const {
    sweep.add(name, std::move(what), expected, std::move(needle), [e = *this, run] {
      e.reset();
      return run(e);
    });
  }
  void add_valid(Sweep& sweep) const {
    add(sweep, "valid", kOk, "", [](Args&, Scratch&) {});
  }
  // The valid call on another handle.
  std::function<moeblaze_status_t(Handle)> on_handle() const {
    return [e = *this](Handle h) {
      e.reset();
      Args a = e.make();
      return e.call(h, &a);
    };
  }
  // The same entry point from other valid arguments.
  Entry with(std::function<void(Args&)> preset) const {
    Entry e = *this;
    e.make = [make = make, preset] {
      Args a = make();
      preset(a);
      return a;
    };
    return e;
  }
};

template <typename Args>
struct Row {
  std::string what;
  moeblaze_status_t expected;
  std::string needle;
  Change<Args> change;
};

template <typename Handle, typename Args>
void add_rows(Sweep& sweep, const Entry<Handle, Args>& e, const std::vector<Row<Args>>& rows) {
  for (const Row<Args>& r : rows) e.add(sweep, r.what, r.expected, r.needle, r.change);
}

// One case per value of one argument, named "<label> <value>".
template <typename Handle, typename Args, typename T>
void add_values(Sweep& sweep, const Entry<Handle, Args>& e, T Args::*member,
                const std::string& label, const std::vector<T>& values, moeblaze_status_t expected,
                const std::string& needle) {
  for (const T value : values) {
    e.add(sweep, label + " " + std::to_string(value), expected, needle,
          [member, value](Args& a, Scratch&) { a.*member = value; });
  }
}

const std::vector<int64_t> kBadTokens = {-1, kI64Min, kI64Max, int64_t(1) << 31,
                                         (int64_t(1) << 62) + 1};

template <typename Handle, typename Args>
void add_bad_tokens(Sweep& sweep, const Entry<Handle, Args>& e) {
  add_values(sweep, e, &Args::num_tokens, "num_tokens", kBadTokens, kInvalid, "num_tokens");
}

template <typename Pointer>
Pointer offset_by(Pointer p, size_t bytes) {
  return reinterpret_cast<Pointer>(reinterpret_cast<uintptr_t>(p) + bytes);
}

// The classes of bad buffer (a pointer and its byte count).
enum BufferClass : unsigned { kNull = 1, kOneByteShort = 2, kMisaligned = 4 };

// `arg` NULL, one byte short or misaligned by 8 (those in `classes`); the message must name
// `needle`, or "<needle>_bytes" for the short one.
template <typename Handle, typename Args, typename Pointer>
void add_buffer_cases(Sweep& sweep, const Entry<Handle, Args>& e, const std::string& arg,
                      Pointer Args::*pointer, size_t Args::*bytes, unsigned classes,
                      const std::string& needle) {
  if (classes & kNull) {
    e.add(sweep, arg + " NULL", kInvalid, needle,
          [pointer](Args& a, Scratch&) { a.*pointer = nullptr; });
  }
  if (classes & kOneByteShort) {
    e.add(sweep, arg + " one byte short", kShortBuffer, needle + "_bytes",
          [bytes](Args& a, Scratch&) { a.*bytes -= 1; });
  }
  if (classes & kMisaligned) {
    e.add(sweep, arg + " misaligned by 8", kInvalid, needle,
          [pointer](Args& a, Scratch&) { a.*pointer = offset_by(a.*pointer, 8); });
  }
}

// Handles that are not live handles of the kind asked for.
template <typename Handle>
using BadHandles = std::vector<std::pair<std::string, Handle>>;

template <typename Handle>
BadHandles<Handle> bad_handles(Handle destroyed, void* other_kind) {
  static int32_t foreign_object = 0;
  return {{"NULL", nullptr},
          {"destroyed", destroyed},
          {"a handle of another kind", reinterpret_cast<Handle>(other_kind)},
          {"a foreign pointer", reinterpret_cast<Handle>(&foreign_object)},
          {"an odd integer", reinterpret_cast<Handle>(uintptr_t(0x12345))},
          {"all bits set", reinterpret_cast<Handle>(~uintptr_t(0))}};
}

// An entry point's call on one handle argument. A NULL handle is refused like any bad one, except
// by the destroy calls (`null_accepted`).
template <typename Handle>
struct HandleUse {
  std::string entry;
  std::function<moeblaze_status_t(Handle)> call;
  bool null_accepted = false;
  std::string prefix = "";  // the case is "<prefix><bad handle>"
};

// A query's call on a handle, its outputs pointing at variables.
template <typename Handle, typename... Out>
std::function<moeblaze_status_t(Handle)> with_outputs(moeblaze_status_t (*query)(Handle, Out*...)) {
  return [query](Handle h) {
    std::tuple<Out...> out{};
    return std::apply([&](Out&... o) { return query(h, &o...); }, out);
  };
}

// Every use, and the valid call of every entry, against every bad handle: INVALID_HANDLE and a
// message naming `argument`.
template <typename Handle, typename... Args>
void add_bad_handle_cases(Sweep& sweep, const BadHandles<Handle>& bad, const std::string& argument,
                          std::vector<HandleUse<Handle>> uses,
                          const Entry<Handle, Args>&... entries) {
  (uses.push_back({entries.name, entries.on_handle()}), ...);
  for (const HandleUse<Handle>& use : uses) {
    for (const auto& [what, handle] : bad) {
      const bool accepted = handle == nullptr && use.null_accepted;
      sweep.add(use.entry, use.prefix + what, accepted ? kOk : kBadHandle, argument,
                [call = use.call, h = handle] { return call(h); });
    }
  }
}

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

// Each pointer field NULL, misaligned, and (where the call ignores it) a poison pointer that must
// never be read. `prefix` is how messages name the fields ("args->").
template <typename Handle, typename Args>
void add_field_cases(Sweep& sweep, const Entry<Handle, Args>& e, const std::vector<Field>& fields,
                     const std::string& prefix = "args->") {
  for (const Field& f : fields) {
    const std::string arg = prefix + f.name;
    e.add(sweep, arg + " NULL", f.use == Field::Required ? kInvalid : kOk, arg,
          [f](Args& a, Scratch&) { set_field(a, f, nullptr); });
    if (f.use == Field::Ignored) {
      e.add(sweep, arg + " poison (ignored)", kOk, "", [f](Args& a, Scratch&) {
        set_field(a, f, reinterpret_cast<const void*>(uintptr_t(0x40)));
      });
      continue;
    }
    for (size_t offset = 1; offset < f.element; offset *= 2) {
      e.add(sweep, arg + " misaligned by " + std::to_string(offset), kInvalid, arg,
            [f, offset](Args& a, Scratch&) {
              const void* p = get_field(a, f);
              if (p == nullptr) p = reinterpret_cast<const void*>(uintptr_t(0x1000));
              set_field(a, f, static_cast<const unsigned char*>(p) + offset);
            });
    }
  }
}

// struct_size cases of a versioned struct passed by pointer.
template <typename Handle, typename Args>
void add_struct_size_cases(Sweep& sweep, const Entry<Handle, Args>& e) {
  const std::pair<uint32_t, moeblaze_status_t> sizes[] = {
      {0u, kMismatch},
      {4u, kMismatch},
      {uint32_t(sizeof(Args) - 8), kMismatch},
      // Only sizeof(Args) bytes are there: nothing past them may be read.
      {(1u << 20) + 8, kInvalid},
      {0x80000000u, kInvalid},
      {0xFFFFFFFFu, kInvalid}};
  for (const auto& [size, expected] : sizes) {
    e.add(sweep, "struct_size = " + std::to_string(size), expected, "struct_size",
          [size = size](Args& a, Scratch&) { a.struct_size = size; });
  }
  // A newer caller's larger struct: zero tail accepted, a set byte refused.
  for (bool set_tail : {false, true}) {
    e.add_run(
        sweep, set_tail ? "larger struct_size, tail byte set" : "larger struct_size, zero tail",
        set_tail ? MOEBLAZE_ERR_NOT_SUPPORTED : kOk, "struct_size", [set_tail](const auto& e) {
          Exact bigger(sizeof(Args) + 64);
          Args a = e.make();
          a.struct_size = uint32_t(bigger.size());
          std::memcpy(bigger.data(), &a, sizeof a);
          if (set_tail) bigger.bytes()[sizeof(Args) + 63] = 1;
          return e.call(e.handle, bigger.as<const Args>());
        });
  }
  e.add_run(sweep, "args NULL", kInvalid, "is NULL",
            [](const auto& e) { return e.call(e.handle, nullptr); });
}

// The arguments of the size queries (`pass` is the EP saved-size query's `part`).
struct Query {
  int32_t pass;
  int64_t num_tokens;
  int64_t recv_rows;
  uint32_t flags;
  bool bytes_null;
};

template <typename Handle>
Entry<Handle, Query> query_entry(
    std::string name, Handle handle, Query valid,
    std::function<moeblaze_status_t(Handle, const Query&, size_t*)> query) {
  return {std::move(name), handle, [valid] { return valid; },
          [query](Handle h, const Query* q) {
            size_t bytes = 0;
            return query(h, *q, q->bytes_null ? nullptr : &bytes);
          }};
}

// `member` of a size query set to each bad value, for each of `passes`.
template <typename Handle>
void add_query_values(Sweep& sweep, const Entry<Handle, Query>& e, std::vector<int32_t> passes,
                      int64_t Query::*member, const std::string& label) {
  for (int32_t pass : passes) {
    add_values(sweep, e.with([pass](Query& q) { q.pass = pass; }), member, label, kBadTokens,
               kInvalid, label);
  }
}

// ---- global functions and contexts --------------------------------------------------------------

// A versioned struct's *_init function, on untyped memory.
struct Init {
  const char* name;
  size_t size;
  std::function<moeblaze_status_t(void*, size_t)> call;
};

template <typename Struct>
Init init_of(const char* name, moeblaze_status_t (*init)(Struct*, size_t)) {
  return {name, sizeof(Struct),
          [init](void* p, size_t n) { return init(static_cast<Struct*>(p), n); }};
}

void add_global_cases(Sweep& sweep) {
  for (int32_t status : {-1, 9, 10, 98, 100, kI32Min, kI32Max}) {
    sweep.add_check("moeblaze_status_name", "status " + std::to_string(status), [status] {
      const char* s = moeblaze_status_name(status);
      return s != nullptr && std::strlen(s) > 0;
    });
    sweep.add_check("moeblaze_status_string", "status " + std::to_string(status), [status] {
      const char* s = moeblaze_status_string(status);
      return s != nullptr && std::strlen(s) > 0;
    });
  }
  for (int32_t backend : {-1, 0, 3, 100, kI32Min}) {
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
  const auto create_on = [create, &sweep](std::string what, moeblaze_status_t expected,
                                          std::string needle, int32_t backend, int32_t device) {
    sweep.add(create, std::move(what), expected, std::move(needle), [backend, device] {
      moeblaze_context_t c = nullptr;
      return moeblaze_context_create(&c, backend, device);
    });
  };
  sweep.add(create, "out NULL", kInvalid, "out",
            [] { return moeblaze_context_create(nullptr, MOEBLAZE_BACKEND_CPU, 0); });
  for (int32_t backend : {-1, 0, 3, kI32Max}) {
    create_on("backend " + std::to_string(backend), kInvalid, "backend", backend, 0);
  }
  for (int32_t device : {-1, 1, kI32Min, kI32Max}) {
    create_on("CPU device " + std::to_string(device), kInvalid, "device", MOEBLAZE_BACKEND_CPU,
              device);
  }
  if (!moeblaze_backend_available(MOEBLAZE_BACKEND_CUDA)) {
    create_on("CUDA without a usable GPU", MOEBLAZE_ERR_NOT_SUPPORTED, "CUDA",
              MOEBLAZE_BACKEND_CUDA, 0);
  }

  // Versioned struct init functions.
  const Init inits[] = {init_of("moeblaze_layer_config_init", moeblaze_layer_config_init),
                        init_of("moeblaze_forward_args_init", moeblaze_forward_args_init),
                        init_of("moeblaze_backward_args_init", moeblaze_backward_args_init),
                        init_of("moeblaze_ep_config_init", moeblaze_ep_config_init),
                        init_of("moeblaze_ep_forward_args_init", moeblaze_ep_forward_args_init),
                        init_of("moeblaze_ep_backward_args_init", moeblaze_ep_backward_args_init)};
  for (const Init& init : inits) {
    const auto call = init.call;
    const size_t size = init.size;
    sweep.add(init.name, "NULL", kInvalid, "", [call, size] { return call(nullptr, size); });
    for (size_t bad : {size_t(0), size_t(4), size - 4}) {
      sweep.add(init.name, "struct_size " + std::to_string(bad), kMismatch, "struct_size",
                [call, bad] {
                  Exact block(bad ? bad : 1);
                  return call(block.data(), bad);
                });
    }
    for (size_t bad : {(size_t(1) << 20) + 1, ~size_t(0)}) {
      sweep.add(init.name, "struct_size " + std::to_string(bad), kInvalid, "struct_size",
                [call, size, bad] {
                  Exact block(size);  // the library must refuse before writing `bad` bytes
                  return call(block.data(), bad);
                });
    }
    sweep.add(init.name, "a larger struct is zeroed past the known fields", kOk, "", [call, size] {
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

// The plain arguments of the router and routing-build calls, as structs so a case can change one.
// The fields carry moeblaze.h's parameter names: the field cases take their names from them.
struct RouterForwardArgs {
  int64_t num_tokens;
  const void* logits;
  int32_t* ids;
  void* g;
  int32_t* expert_counts;
  void* losses;
  void* workspace;
  size_t workspace_bytes;
};
struct RouterBackwardArgs {
  int64_t num_tokens;
  const void* logits;
  const int32_t* ids;
  const void* dg;
  const void* d_losses;
  void* d_logits;
  void* workspace;
  size_t workspace_bytes;
};
struct RoutingBuildArgs {
  int64_t num_tokens;
  const int32_t* ids;
  int32_t* expert_offsets;
  int32_t* expert_token_indices;
  int32_t* token_index_map;
  void* workspace;
  size_t workspace_bytes;
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

  // The inputs the forward and the backward args share.
  template <typename Args>
  void set_inputs(Args& a) const {
    a.num_tokens = T;
    a.x = x.data();
    a.w_router = w_router.data();
    a.w_gate = w_gate.data();
    a.w_up = gated ? w_up.data() : nullptr;
    a.w_down = w_down.data();
    a.ids = ids.as<int32_t>();
    a.g = g.data();
  }

  moeblaze_forward_args_t forward_args(int32_t pass) const {
    moeblaze_forward_args_t a;
    moeblaze_forward_args_init(&a, sizeof a);
    set_inputs(a);
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
    set_inputs(a);
    a.dy = dy.data();
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

  RouterForwardArgs router_forward_args() const {
    const Exact& ws = workspace.at(MOEBLAZE_PASS_ROUTER_FORWARD);
    return {T,
            logits.data(),
            ids_out.as<int32_t>(),
            g_out.data(),
            counts.as<int32_t>(),
            losses.data(),
            ws.data(),
            ws.size()};
  }
  RouterBackwardArgs router_backward_args() const {
    const Exact& ws = workspace.at(MOEBLAZE_PASS_ROUTER_BACKWARD);
    return {T,         logits.data(), ids.as<int32_t>(), dg.data(), losses.data(), d_logits.data(),
            ws.data(), ws.size()};
  }
  RoutingBuildArgs routing_build_args() const {
    const Exact& ws = workspace.at(MOEBLAZE_PASS_ROUTING_BUILD);
    return {T,
            ids.as<int32_t>(),
            offsets.as<int32_t>(),
            token_indices.as<int32_t>(),
            index_map.as<int32_t>(),
            ws.data(),
            ws.size()};
  }

  void restore_saved() {
    for (auto& [pass, bytes] : saved_pristine) restore(saved.at(pass), bytes);
  }
};

template <typename Args>
using LayerEntry = Entry<moeblaze_layer_t, Args>;

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

// ---- the layer's entry points -------------------------------------------------------------------

void add_config_cases(Sweep& sweep, const Entry<moeblaze_context_t, moeblaze_layer_config_t>& e) {
  using C = moeblaze_layer_config_t;
  const auto bad = [&](const char* field, Change<C> change) {
    e.add(sweep, std::string("config.") + field, kInvalid, field, std::move(change));
  };
  for (int32_t v : {-1, 4, kI32Max}) bad("dtype", [v](C& c, Scratch&) { c.dtype = v; });
  for (int64_t v : {int64_t(0), int64_t(-1), (int64_t(1) << 20) + 1, kI64Max, kI64Min}) {
    bad("d_model", [v](C& c, Scratch&) { c.d_model = v; });
    bad("d_ffn", [v](C& c, Scratch&) { c.d_ffn = v; });
    bad("top_k", [v](C& c, Scratch&) { c.top_k = v; });
  }
  for (int64_t v : {int64_t(0), int64_t(-1), int64_t(MOEBLAZE_MAX_EXPERTS + 1), kI64Max}) {
    bad("num_experts", [v](C& c, Scratch&) { c.num_experts = v; });
  }
  bad("top_k", [](C& c, Scratch&) { c.top_k = c.num_experts + 1; });
  bad("top_k", [](C& c, Scratch&) {
    c.num_experts = 64;
    c.top_k = MOEBLAZE_MAX_TOP_K + 1;
  });
  for (int32_t v : {-1, 7, 1000}) bad("activation", [v](C& c, Scratch&) { c.activation = v; });
  for (int32_t v : {-1, 3}) {
    bad("checkpoint", [v](C& c, Scratch&) { c.checkpoint = v; });
    bad("score_function", [v](C& c, Scratch&) { c.score_function = v; });
  }
  for (int32_t v : {-1, 2}) {
    bad("renormalize", [v](C& c, Scratch&) { c.renormalize = v; });
    bad("deterministic", [v](C& c, Scratch&) { c.deterministic = v; });
  }
  for (float v : {-1.0f, NAN, INFINITY, -INFINITY, -FLT_MIN}) {
    bad("aux_loss_coeff", [v](C& c, Scratch&) { c.aux_loss_coeff = v; });
    bad("z_loss_coeff", [v](C& c, Scratch&) { c.z_loss_coeff = v; });
  }
  bad("reserved0", [](C& c, Scratch&) { c.reserved0 = 1; });
}

void add_size_query_cases(Sweep& sweep, const LayerEntry<Query>& ws,
                          const LayerEntry<Query>& ws_flags, const LayerEntry<Query>& saved) {
  for (const LayerEntry<Query>* e : {&ws, &ws_flags, &saved}) e->add_valid(sweep);
  for (int32_t pass : {-1, 7, 100, kI32Min}) {
    ws.add_run(sweep, "pass " + std::to_string(pass), kInvalid, "pass", [pass](const auto& e) {
      size_t b = 1;  // the query zeroes it before it checks anything
      const moeblaze_status_t s = moeblaze_layer_workspace_size(e.handle, pass, 4, &b);
      return b == 0 ? s : MOEBLAZE_ERR_INTERNAL;
    });
  }
  add_values(sweep, saved, &Query::pass, "pass", {-1, 0, 1, 2, 4, 6, 7}, kInvalid, "pass");
  add_query_values(sweep, ws, {0, 1, 2, 3, 4, 5, 6}, &Query::num_tokens, "num_tokens");
  add_query_values(sweep, saved, {MOEBLAZE_PASS_LAYER_FORWARD}, &Query::num_tokens, "num_tokens");
  add_values(sweep, ws_flags, &Query::flags, "flags", {8u, 0x80000000u, 0xFFFFFFFFu}, kInvalid,
             "flags");
  for (const LayerEntry<Query>* e : {&ws, &saved}) {
    e->add(sweep, "bytes NULL", kInvalid, "bytes", [](Query& q, Scratch&) { q.bytes_null = true; });
  }
}

void add_router_cases(Sweep& sweep, const std::shared_ptr<World>& wp,
                      const LayerEntry<RouterForwardArgs>& forward,
                      const LayerEntry<RouterBackwardArgs>& backward,
                      const LayerEntry<RoutingBuildArgs>& build) {
  const World& w = *wp;
  const int32_t rdtype = routing_dtype(w.config.dtype);
  {
    using A = RouterForwardArgs;
    forward.add_valid(sweep);
    add_field_cases(sweep, forward,
                    {MB_FIELD(A, logits, w.rs, Required), MB_FIELD(A, ids, 4, Required),
                     MB_FIELD(A, g, w.rs, Required), MB_FIELD(A, expert_counts, 4, Optional),
                     MB_FIELD(A, losses, w.rs, Optional)},
                    "");
    add_bad_tokens(sweep, forward);
    add_buffer_cases(sweep, forward, "workspace", &A::workspace, &A::workspace_bytes,
                     kNull | kOneByteShort | kMisaligned, "workspace");
    for (double bad : {double(NAN), double(INFINITY), -double(INFINITY)}) {
      for (int64_t at : {int64_t(0), w.T * w.E - 1}) {
        forward.add(sweep, "logits[" + std::to_string(at) + "] = " + std::to_string(bad),
                    MOEBLAZE_ERR_NON_FINITE, "logits", [wp, rdtype, at, bad](A& a, Scratch& s) {
                      a.logits = s.copy_with(wp->logits, rdtype, at, bad);
                    });
      }
    }
    // Extreme but finite logits: routing works, nothing non-finite is returned with OK.
    for (double extreme : {1e30, -1e30, 3e38, -3e38, -1000.0}) {
      forward.add_run(sweep, "every logit " + std::to_string(extreme), kOk, "",
                      [wp, rdtype, extreme](const auto& e) {
                        HostTensor logits(rdtype, {World::T, World::E});
                        logits.fill(extreme);
                        A a = e.make();
                        a.logits = logits.data();
                        a.losses =
                            nullptr;  // the z-loss of +-3e38 does not fit in the routing dtype
                        const moeblaze_status_t s = e.call(e.handle, &a);
                        HostTensor g(rdtype, {World::N});
                        std::memcpy(g.data(), wp->g_out.data(), wp->g_out.size());
                        for (int64_t i = 0; i < World::N; ++i) {
                          if (!std::isfinite(g.get(i)))
                            return moeblaze_status_t(MOEBLAZE_ERR_INTERNAL);
                        }
                        return s;
                      });
    }
  }
  {
    using A = RouterBackwardArgs;
    backward.add_valid(sweep);
    add_field_cases(sweep, backward,
                    {MB_FIELD(A, logits, w.rs, Required), MB_FIELD(A, ids, 4, Required),
                     MB_FIELD(A, dg, w.rs, Required), MB_FIELD(A, d_losses, w.rs, Optional),
                     MB_FIELD(A, d_logits, w.rs, Required)},
                    "");
    add_bad_tokens(sweep, backward);
    add_buffer_cases(sweep, backward, "workspace", &A::workspace, &A::workspace_bytes,
                     kNull | kOneByteShort | kMisaligned, "workspace");
    for (int32_t bad : {-1, int32_t(World::E), kI32Max, kI32Min}) {
      for (int64_t at : {int64_t(0), World::N - 1}) {
        backward.add(sweep, "ids[" + std::to_string(at) + "] = " + std::to_string(bad), kInvalid,
                     "ids",
                     [wp, at, bad](A& a, Scratch& s) { a.ids = s.ids_with(wp->ids, at, bad); });
      }
    }
    backward.add(sweep, "ids repeated within a token", kInvalid, "ids",
                 [wp](A& a, Scratch& s) { a.ids = s.ids_repeating(wp->ids, 0); });
    backward.add(
        sweep, "logits NaN", MOEBLAZE_ERR_NON_FINITE, "logits",
        [wp, rdtype](A& a, Scratch& s) { a.logits = s.copy_with(wp->logits, rdtype, 3, NAN); });
  }
  {
    using A = RoutingBuildArgs;
    build.add_valid(sweep);
    add_field_cases(
        sweep, build,
        {MB_FIELD(A, ids, 4, Required), MB_FIELD(A, expert_offsets, 4, Required),
         MB_FIELD(A, expert_token_indices, 4, Required), MB_FIELD(A, token_index_map, 4, Required)},
        "");
    for (int32_t bad : {-1, int32_t(World::E), kI32Min}) {
      build.add(sweep, "ids[7] = " + std::to_string(bad), kInvalid, "ids",
                [wp, bad](A& a, Scratch& s) { a.ids = s.ids_with(wp->ids, 7, bad); });
    }
    add_buffer_cases(sweep, build, "workspace", &A::workspace, &A::workspace_bytes,
                     kNull | kOneByteShort | kMisaligned, "workspace");
    add_bad_tokens(sweep, build);
  }
}

// An experts or whole-layer pass, from the world's args struct for it (`args`).
template <typename Args>
LayerEntry<Args> pass_entry(const char* name, const std::shared_ptr<World>& wp, int32_t pass,
                            moeblaze_status_t (*run)(moeblaze_layer_t, const Args*, void*),
                            Args (World::*args)(int32_t) const, std::function<void()> reset) {
  return {name, wp->layer, [wp, pass, args] { return ((*wp).*args)(pass); },
          [run](moeblaze_layer_t layer, const Args* a) { return run(layer, a, nullptr); },
          std::move(reset)};
}

void add_forward_cases(Sweep& sweep, const std::shared_ptr<World>& wp,
                       const LayerEntry<moeblaze_forward_args_t>& e, bool whole) {
  using A = moeblaze_forward_args_t;
  e.add_valid(sweep);
  // The valid workspace has the plain (inference) size: one byte less is refused without a saved
  // buffer and enough with one (MOEBLAZE_FORWARD_WITH_SAVED needs less).
  add_rows(sweep, e,
           {{"inference (saved NULL)", kOk, "",
             [](A& a, Scratch&) {
               a.saved = nullptr;
               a.saved_bytes = 0;
             }},
            {"workspace one byte short (inference)", kShortBuffer, "args->workspace_bytes",
             [](A& a, Scratch&) {
               a.saved = nullptr;
               a.saved_bytes = 0;
               a.workspace_bytes -= 1;
             }},
            {"workspace one byte short (training)", kOk, "",
             [](A& a, Scratch&) { a.workspace_bytes -= 1; }}});
  add_field_cases(sweep, e, forward_fields(*wp, whole));
  add_struct_size_cases(sweep, e);
  add_bad_tokens(sweep, e);
  add_values(sweep, e, &A::flags, "flags", {1u, 4u, 0x80000000u}, kInvalid, "args->flags");
  add_buffer_cases(sweep, e, "saved", &A::saved, &A::saved_bytes, kOneByteShort | kMisaligned,
                   "args->saved");
  add_buffer_cases(sweep, e, "workspace", &A::workspace, &A::workspace_bytes, kNull | kMisaligned,
                   "args->workspace");
  if (!whole) {
    for (int32_t bad : {-1, int32_t(World::E), kI32Max}) {
      e.add(sweep, "ids[3] = " + std::to_string(bad), kInvalid, "ids",
            [wp, bad](A& a, Scratch& s) { a.ids = s.ids_with(wp->ids, 3, bad); });
    }
    e.add(sweep, "ids repeated within a token", kInvalid, "ids",
          [wp](A& a, Scratch& s) { a.ids = s.ids_repeating(wp->ids, 2); });
  } else {
    // x that makes a logit non-finite.
    for (double bad : {double(NAN), double(INFINITY), -double(INFINITY)}) {
      e.add(sweep, "x[0] = " + std::to_string(bad), MOEBLAZE_ERR_NON_FINITE, "logits",
            [wp, bad](A& a, Scratch& s) { a.x = s.copy_with(wp->x, wp->config.dtype, 0, bad); });
    }
  }
}

void add_backward_cases(Sweep& sweep, const std::shared_ptr<World>& wp,
                        const LayerEntry<moeblaze_backward_args_t>& e, bool whole) {
  using A = moeblaze_backward_args_t;
  World& w = *wp;
  const int32_t forward = whole ? MOEBLAZE_PASS_LAYER_FORWARD : MOEBLAZE_PASS_EXPERTS_FORWARD;
  const int32_t other = whole ? MOEBLAZE_PASS_EXPERTS_FORWARD : MOEBLAZE_PASS_LAYER_FORWARD;
  e.add_valid(sweep);
  add_field_cases(sweep, e, backward_fields(w, whole));
  add_struct_size_cases(sweep, e);
  add_bad_tokens(sweep, e);
  for (int64_t T : {int64_t(0), World::T - 1}) {
    e.add(sweep, "num_tokens " + std::to_string(T) + " (not the forward's)", kMismatch, "saved",
          [T](A& a, Scratch&) { a.num_tokens = T; });
  }
  add_values(sweep, e, &A::flags, "flags", {4u, 8u, 0x80000000u}, kInvalid, "args->flags");
  add_buffer_cases(sweep, e, "saved", &A::saved, &A::saved_bytes,
                   kNull | kOneByteShort | kMisaligned, "args->saved");
  add_buffer_cases(sweep, e, "workspace", &A::workspace, &A::workspace_bytes, kOneByteShort,
                   "args->workspace");
  e.add(sweep, "the other forward's saved buffer", kMismatch, "saved",
        [wp, forward, other](A& a, Scratch& s) {
          // Big enough for either layout; only its header differs.
          const Exact& theirs = wp->saved.at(other);
          Exact& copy = s.block(std::max(theirs.size(), wp->saved.at(forward).size()));
          std::memcpy(copy.data(), theirs.data(), theirs.size());
          a.saved = copy.data();
          a.saved_bytes = copy.size();
        });
  // The saved buffer overwritten between forward and backward: its header words, then every word
  // of its routing index with values no index can have.
  const auto overwritten = [&](std::string what, moeblaze_status_t expected, std::string needle,
                               std::function<void(const Exact&)> poke) {
    e.add(sweep, std::move(what), expected, std::move(needle),
          [wp, forward, poke](A&, Scratch&) { poke(wp->saved.at(forward)); });
  };
  for (size_t word = 0; word < 8; ++word) {
    overwritten("saved header word " + std::to_string(word) + " flipped", kMismatch, "saved",
                [word](const Exact& b) { b.as<uint32_t>()[word] ^= 0x00010001u; });
  }
  overwritten("saved all zero", kMismatch, "saved",
              [](const Exact& b) { std::memset(b.data(), 0, b.size()); });
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
  const std::vector<unsigned char>& pristine = w.saved_pristine.at(forward);
  const std::pair<const char*, const std::vector<int32_t>*> arrays[] = {
      {"expert_offsets", &index.expert_offsets},
      {"expert_token_indices", &index.expert_token_indices},
      {"token_index_map", &index.token_index_map}};
  for (const auto& [name, words] : arrays) {
    const int64_t at = find_int32_sequence(pristine.data(), pristine.size(), *words);
    REQUIRE_MESSAGE(at >= 0, name);
    const int32_t N = int32_t(World::N);
    for (size_t i = 0; i < words->size(); ++i) {
      for (int32_t value : {-1, N + 1, kI32Max, kI32Min}) {
        overwritten(
            std::string("saved ") + name + "[" + std::to_string(i) + "] = " + std::to_string(value),
            kInvalid, "saved", [at = at, i, value](const Exact& b) {
              reinterpret_cast<int32_t*>(b.bytes() + at)[i] = value;
            });
      }
    }
  }
  if (whole) {
    const int64_t at = find_int32_sequence(pristine.data(), pristine.size(), ids);
    REQUIRE(at >= 0);
    for (size_t i : {size_t(0), size_t(World::N - 1)}) {
      overwritten("saved ids[" + std::to_string(i) + "] out of range", kInvalid, "saved ids",
                  [at, i](const Exact& b) { reinterpret_cast<int32_t*>(b.bytes() + at)[i] = 99; });
    }
  } else {
    e.add(sweep, "ids other than the forward's", kInvalid, "ids", [wp](A& a, Scratch& s) {
      int32_t* swapped = s.copy(wp->ids).as<int32_t>();
      std::swap(swapped[0], swapped[1]);
      a.ids = swapped;
    });
  }
}

void add_layer_cases(Sweep& sweep, const std::shared_ptr<World>& wp) {
  World& w = *wp;
  using C = moeblaze_layer_config_t;
  const Entry<moeblaze_context_t, C> create{
      "moeblaze_layer_create", w.context, [wp] { return wp->config; },
      [](moeblaze_context_t context, const C* c) {
        moeblaze_layer_t out = nullptr;
        const moeblaze_status_t s = moeblaze_layer_create(&out, context, c);
        if (out != nullptr) moeblaze_layer_destroy(out);
        return s;
      }};
  const LayerEntry<C> get_config{"moeblaze_layer_get_config", w.layer,
                                 [] {
                                   C c;
                                   moeblaze_layer_config_init(&c, sizeof c);
                                   return c;
                                 },
                                 [](moeblaze_layer_t layer, const C* c) {
                                   Exact block(sizeof *c);  // it writes struct_size bytes
                                   std::memcpy(block.data(), c, sizeof *c);
                                   return moeblaze_layer_get_config(layer, block.as<C>());
                                 }};
  const auto ws = query_entry<moeblaze_layer_t>(
      "moeblaze_layer_workspace_size", w.layer, {MOEBLAZE_PASS_LAYER_FORWARD, 4, 0, 0, false},
      [](moeblaze_layer_t l, const Query& q, size_t* b) {
        return moeblaze_layer_workspace_size(l, q.pass, q.num_tokens, b);
      });
  const auto ws_flags = query_entry<moeblaze_layer_t>(
      "moeblaze_layer_workspace_size_with_flags", w.layer,
      {MOEBLAZE_PASS_LAYER_BACKWARD, 4, 0, 0, false},
      [](moeblaze_layer_t l, const Query& q, size_t* b) {
        return moeblaze_layer_workspace_size_with_flags(l, q.pass, q.num_tokens, q.flags, b);
      });
  const auto saved = query_entry<moeblaze_layer_t>(
      "moeblaze_layer_saved_size", w.layer, {MOEBLAZE_PASS_LAYER_FORWARD, 4, 0, 0, false},
      [](moeblaze_layer_t l, const Query& q, size_t* b) {
        return moeblaze_layer_saved_size(l, q.pass, q.num_tokens, b);
      });
  const LayerEntry<RouterForwardArgs> router_forward{
      "moeblaze_router_forward", w.layer, [wp] { return wp->router_forward_args(); },
      [](moeblaze_layer_t l, const RouterForwardArgs* a) {
        return moeblaze_router_forward(l, a->num_tokens, a->logits, a->ids, a->g, a->expert_counts,
                                       a->losses, a->workspace, a->workspace_bytes, nullptr);
      }};
  const LayerEntry<RouterBackwardArgs> router_backward{
      "moeblaze_router_backward", w.layer, [wp] { return wp->router_backward_args(); },
      [](moeblaze_layer_t l, const RouterBackwardArgs* a) {
        return moeblaze_router_backward(l, a->num_tokens, a->logits, a->ids, a->dg, a->d_losses,
                                        a->d_logits, a->workspace, a->workspace_bytes, nullptr);
      }};
  const LayerEntry<RoutingBuildArgs> routing_build{
      "moeblaze_routing_build", w.layer, [wp] { return wp->routing_build_args(); },
      [](moeblaze_layer_t l, const RoutingBuildArgs* a) {
        return moeblaze_routing_build(l, a->num_tokens, a->ids, a->expert_offsets,
                                      a->expert_token_indices, a->token_index_map, a->workspace,
                                      a->workspace_bytes, nullptr);
      }};
  const auto experts_forward =
      pass_entry("moeblaze_experts_forward", wp, MOEBLAZE_PASS_EXPERTS_FORWARD,
                 moeblaze_experts_forward, &World::forward_args, [] {});
  const auto layer_forward = pass_entry("moeblaze_layer_forward", wp, MOEBLAZE_PASS_LAYER_FORWARD,
                                        moeblaze_layer_forward, &World::forward_args, [] {});
  // The backward passes read the saved buffer their forward filled: each case starts from it.
  const std::function<void()> restore_saved = [wp] { wp->restore_saved(); };
  const auto experts_backward =
      pass_entry("moeblaze_experts_backward", wp, MOEBLAZE_PASS_EXPERTS_BACKWARD,
                 moeblaze_experts_backward, &World::backward_args, restore_saved);
  const auto layer_backward =
      pass_entry("moeblaze_layer_backward", wp, MOEBLAZE_PASS_LAYER_BACKWARD,
                 moeblaze_layer_backward, &World::backward_args, restore_saved);

  // Every call that takes a context or a layer, on each bad one.
  add_bad_handle_cases<moeblaze_context_t>(
      sweep, bad_handles<moeblaze_context_t>(w.destroyed_context, w.layer), "context",
      {{"moeblaze_context_destroy", moeblaze_context_destroy, true},
       {"moeblaze_context_get_info", with_outputs(moeblaze_context_get_info)},
       {"moeblaze_context_set_num_threads",
        [](moeblaze_context_t c) { return moeblaze_context_set_num_threads(c, 1); }},
       {create.name, create.on_handle(), false, "context "}});
  add_bad_handle_cases<moeblaze_layer_t>(
      sweep, bad_handles<moeblaze_layer_t>(w.destroyed_layer, w.context), "layer",
      {{"moeblaze_layer_destroy", moeblaze_layer_destroy, true}}, get_config, ws, ws_flags, saved,
      router_forward, router_backward, routing_build, experts_forward, layer_forward,
      experts_backward, layer_backward);

  // Contexts.
  for (int32_t threads : {-1, 4097, kI32Min, kI32Max}) {
    sweep.add("moeblaze_context_set_num_threads", "num_threads " + std::to_string(threads),
              kInvalid, "num_threads",
              [wp, threads] { return moeblaze_context_set_num_threads(wp->context, threads); });
  }
  sweep.add("moeblaze_context_get_info", "both outputs NULL", kOk, "",
            [wp] { return moeblaze_context_get_info(wp->context, nullptr, nullptr); });

  // The layer plan.
  create.add_valid(sweep);
  add_config_cases(sweep, create);
  create.add_run(sweep, "out NULL", kInvalid, "out", [](const auto& e) {
    const C c = e.make();
    return moeblaze_layer_create(nullptr, e.handle, &c);
  });
  add_struct_size_cases(sweep, create);
  get_config.add_valid(sweep);
  get_config.add_run(sweep, "config NULL", kInvalid, "config",
                     [](const auto& e) { return moeblaze_layer_get_config(e.handle, nullptr); });
  add_values(sweep, get_config, &C::struct_size, "struct_size", {0u, 4u, uint32_t(sizeof(C) - 4)},
             kMismatch, "struct_size");
  add_values(sweep, get_config, &C::struct_size, "struct_size", {(1u << 20) + 4, 0xFFFFFFF0u},
             kInvalid, "struct_size");

  add_size_query_cases(sweep, ws, ws_flags, saved);
  add_router_cases(sweep, wp, router_forward, router_backward, routing_build);
  add_forward_cases(sweep, wp, experts_forward, false);
  add_forward_cases(sweep, wp, layer_forward, true);
  add_backward_cases(sweep, wp, experts_backward, false);
  add_backward_cases(sweep, wp, layer_backward, true);
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

  // The inputs and buffers of one step, which the forward and the backward args share.
  template <typename Args>
  void set_step(Args& a) const {
    a.num_tokens = T;
    a.x = x.data();
    a.w_router = w_router.data();
    a.w_gate = w_gate.data();
    a.w_up = w_up.data();
    a.w_down = w_down.data();
    a.home_saved = home.data();
    a.home_saved_bytes = home.size();
    a.expert_saved = expert.data();
    a.expert_saved_bytes = expert.size();
    a.workspace = workspace.data();
    a.workspace_bytes = workspace.size();
  }
  moeblaze_ep_forward_args_t forward_args() const {
    moeblaze_ep_forward_args_t a;
    moeblaze_ep_forward_args_init(&a, sizeof a);
    set_step(a);
    a.y = y.data();
    return a;
  }
  moeblaze_ep_backward_args_t backward_args() const {
    moeblaze_ep_backward_args_t a;
    moeblaze_ep_backward_args_init(&a, sizeof a);
    set_step(a);
    a.dy = dy.data();
    a.dx = dx.data();
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

template <typename Args>
using EpEntry = Entry<moeblaze_ep_layer_t, Args>;
template <typename Args>
using ExchangeCall =
    std::function<moeblaze_status_t(moeblaze_ep_layer_t, const Args*, void*, size_t)>;

// A step call of the EP layer on the world's exchange buffer.
template <typename Args>
EpEntry<Args> ep_entry(std::string name, const std::shared_ptr<EpWorld>& wp,
                       std::function<Args()> make, ExchangeCall<Args> call,
                       std::function<void()> reset) {
  return {std::move(name), wp->layer, std::move(make),
          [wp, call](moeblaze_ep_layer_t layer, const Args* a) {
            return call(layer, a, wp->exchange.data(), wp->exchange.size());
          },
          std::move(reset)};
}

// The exchange buffer NULL, one byte short and misaligned by 4.
template <typename Args>
void add_exchange_cases(Sweep& sweep, const EpEntry<Args>& e, const std::shared_ptr<EpWorld>& wp,
                        ExchangeCall<Args> call) {
  struct Bad {
    const char* what;
    moeblaze_status_t expected;
    const char* needle;
    void* exchange;
    size_t bytes;
  };
  const Exact& x = wp->exchange;
  const Bad bads[] = {
      {"exchange NULL", kInvalid, "exchange", nullptr, x.size()},
      {"exchange one byte short", kShortBuffer, "exchange_bytes", x.data(), x.size() - 1},
      {"exchange misaligned by 4", kInvalid, "exchange", x.plus(4), x.size()}};
  for (const Bad& b : bads) {
    e.add_run(sweep, b.what, b.expected, b.needle, [call, b](const auto& e) {
      Args a = e.make();
      return call(e.handle, &a, b.exchange, b.bytes);
    });
  }
}

// The exchange and HOME buffers overwritten between calls, every word of each: words that hold a
// header field, a count or an index must be refused; words that hold values (logits, g) or padding
// may be accepted; nothing may be read or written outside the buffers.
template <typename Args>
void add_overwritten_cases(Sweep& sweep, const EpEntry<Args>& e,
                           const std::shared_ptr<EpWorld>& wp) {
  // `exchange`: a 64-byte header (12 words of fields, then padding), then the count table.
  for (size_t word = 0; word < wp->exchange.size() / 4; ++word) {
    const bool padding = word >= 12 && word < 16;
    for (int32_t value : {-1, 1 << 24}) {
      e.add(sweep, "exchange word " + std::to_string(word) + " = " + std::to_string(value),
            padding ? kOk : kInvalid, "exchange",
            [wp, word, value](Args&, Scratch&) { wp->exchange.as<int32_t>()[word] = value; });
    }
  }
  for (size_t word = 0; word < wp->home.size() / 4; ++word) {
    const bool checked = wp->home_checked_words.count(word) > 0;
    e.add(sweep, "home_saved word " + std::to_string(word) + " = INT32_MIN",
          checked ? kInvalid : kOk, "home_saved",
          [wp, word](Args&, Scratch&) { wp->home.as<int32_t>()[word] = kI32Min; });
  }
}

void add_ep_cases(Sweep& sweep, const std::shared_ptr<EpWorld>& wp) {
  EpWorld& w = *wp;
  using FA = moeblaze_ep_forward_args_t;
  using BA = moeblaze_ep_backward_args_t;
  using EC = moeblaze_ep_config_t;
  const ExchangeCall<FA> begin_call = [](moeblaze_ep_layer_t l, const FA* a, void* x, size_t n) {
    int64_t recv_rows = 0;
    return moeblaze_ep_forward_begin(l, a, x, n, &recv_rows, nullptr);
  };
  const ExchangeCall<FA> finish_call = [](moeblaze_ep_layer_t l, const FA* a, void* x, size_t n) {
    return moeblaze_ep_forward_finish(l, a, x, n, nullptr);
  };
  const ExchangeCall<BA> backward_call = [](moeblaze_ep_layer_t l, const BA* a, void* x, size_t n) {
    return moeblaze_ep_backward(l, a, x, n, nullptr);
  };
  // finish runs on a begun step, backward on a finished one.
  const std::function<FA()> make_fa = [wp] { return wp->forward_args(); };
  const auto begin = ep_entry<FA>("moeblaze_ep_forward_begin", wp, make_fa, begin_call, [] {});
  const auto finish = ep_entry<FA>("moeblaze_ep_forward_finish", wp, make_fa, finish_call,
                                   [wp] { wp->to_begun(); });
  const auto backward = ep_entry<BA>(
      "moeblaze_ep_backward", wp, [wp] { return wp->backward_args(); }, backward_call,
      [wp] { wp->to_finished(); });
  const Entry<moeblaze_context_t, EC> create{
      "moeblaze_ep_layer_create", w.context, [wp] { return wp->ep; },
      [wp](moeblaze_context_t context, const EC* ep) {
        moeblaze_ep_layer_t out = nullptr;
        const moeblaze_status_t s = moeblaze_ep_layer_create(&out, context, &wp->config, ep);
        if (out != nullptr) moeblaze_ep_layer_destroy(out);
        return s;
      }};
  const auto ws = query_entry<moeblaze_ep_layer_t>(
      "moeblaze_ep_layer_workspace_size", w.layer, {MOEBLAZE_EP_PASS_FORWARD_BEGIN, 4, 4, 0, false},
      [](moeblaze_ep_layer_t l, const Query& q, size_t* b) {
        return moeblaze_ep_layer_workspace_size(l, q.pass, q.num_tokens, q.recv_rows, b);
      });
  const auto ws_flags =
      query_entry<moeblaze_ep_layer_t>("moeblaze_ep_layer_workspace_size_with_flags", w.layer,
                                       {MOEBLAZE_EP_PASS_BACKWARD, 4, 4, 0, false},
                                       [](moeblaze_ep_layer_t l, const Query& q, size_t* b) {
                                         return moeblaze_ep_layer_workspace_size_with_flags(
                                             l, q.pass, q.num_tokens, q.recv_rows, q.flags, b);
                                       });
  const auto saved = query_entry<moeblaze_ep_layer_t>(
      "moeblaze_ep_layer_saved_size", w.layer, {MOEBLAZE_EP_SAVED_HOME, 4, 4, 0, false},
      [](moeblaze_ep_layer_t l, const Query& q, size_t* b) {
        return moeblaze_ep_layer_saved_size(l, q.pass, q.num_tokens, q.recv_rows, b);
      });

  // Groups, and every call that takes an EP layer on each bad one.
  sweep.add("moeblaze_ep_local_group_create", "out NULL", kInvalid, "out",
            [] { return moeblaze_ep_local_group_create(nullptr, 1); });
  for (int32_t size : {0, -1, MOEBLAZE_MAX_EXPERTS + 1, kI32Min}) {
    sweep.add("moeblaze_ep_local_group_create", "world_size " + std::to_string(size), kInvalid,
              "world_size", [size] {
                moeblaze_ep_group_t g = nullptr;
                return moeblaze_ep_local_group_create(&g, size);
              });
  }
  const auto bad_groups = bad_handles<moeblaze_ep_group_t>(w.destroyed_group, w.layer);
  add_bad_handle_cases<moeblaze_ep_group_t>(
      sweep, bad_groups, "group",
      {{"moeblaze_ep_local_group_destroy", moeblaze_ep_local_group_destroy, true}});
  add_bad_handle_cases<moeblaze_ep_layer_t>(
      sweep, bad_handles<moeblaze_ep_layer_t>(w.destroyed_layer, w.group), "layer",
      {{"moeblaze_ep_layer_destroy", moeblaze_ep_layer_destroy, true},
       {"moeblaze_ep_layer_get_experts", with_outputs(moeblaze_ep_layer_get_experts)},
       {"moeblaze_ep_layer_exchange_size", with_outputs(moeblaze_ep_layer_exchange_size)}},
      ws, ws_flags, saved, begin, finish, backward);

  // The EP layer plan.
  create.add_valid(sweep);
  for (const auto& [what, group] : bad_groups) {
    if (group == nullptr) continue;  // a NULL communicator is its own case below
    create.add(sweep, "communicator " + what, kBadHandle, "communicator",
               [g = group](EC& ep, Scratch&) { ep.communicator = g; });
  }
  add_rows(sweep, create,
           {{"transport 0", MOEBLAZE_ERR_NOT_SUPPORTED, "transport",
             [](EC& e, Scratch&) { e.transport = 0; }},
            {"transport 3", MOEBLAZE_ERR_NOT_SUPPORTED, "transport",
             [](EC& e, Scratch&) { e.transport = 3; }},
            {"NCCL on a CPU context", MOEBLAZE_ERR_NOT_SUPPORTED, "NCCL",
             [](EC& e, Scratch&) { e.transport = MOEBLAZE_EP_TRANSPORT_NCCL; }},
            {"rank -1", kInvalid, "rank", [](EC& e, Scratch&) { e.rank = -1; }},
            {"rank = world_size", kInvalid, "rank", [](EC& e, Scratch&) { e.rank = 1; }},
            {"world_size 0", kInvalid, "world_size", [](EC& e, Scratch&) { e.world_size = 0; }},
            {"world_size > E", kInvalid, "world_size", [](EC& e, Scratch&) { e.world_size = 5; }},
            {"world_size 2 with a 1-rank group", kInvalid, "world_size",
             [](EC& e, Scratch&) { e.world_size = 2; }},
            {"communicator NULL", kInvalid, "communicator",
             [](EC& e, Scratch&) { e.communicator = nullptr; }}});
  create.add_run(sweep, "out NULL", kInvalid, "out", [wp](const auto& e) {
    const EC ep = e.make();
    return moeblaze_ep_layer_create(nullptr, e.handle, &wp->config, &ep);
  });
  add_struct_size_cases(sweep, create);

  // Size queries.
  for (const EpEntry<Query>* e : {&ws, &ws_flags, &saved}) e->add_valid(sweep);
  add_values(sweep, ws, &Query::pass, "pass", {-1, 3, kI32Max}, kInvalid, "pass");
  add_values(sweep, saved, &Query::pass, "part", {-1, 2}, kInvalid, "part");
  add_query_values(sweep, ws, {0, 1, 2}, &Query::num_tokens, "num_tokens");
  add_query_values(sweep, saved, {MOEBLAZE_EP_SAVED_HOME}, &Query::num_tokens, "num_tokens");
  add_query_values(sweep, ws, {1, 2}, &Query::recv_rows, "recv_rows");
  add_query_values(sweep, saved, {MOEBLAZE_EP_SAVED_EXPERT}, &Query::recv_rows, "recv_rows");
  add_values(sweep, ws_flags, &Query::flags, "flags", {4u, 0xFFFFFFFFu}, kInvalid, "flags");
  sweep.add("moeblaze_ep_layer_exchange_size", "bytes NULL", kInvalid, "bytes",
            [wp] { return moeblaze_ep_layer_exchange_size(wp->layer, nullptr); });
  sweep.add("moeblaze_ep_layer_get_experts", "both outputs NULL", kOk, "",
            [wp] { return moeblaze_ep_layer_get_experts(wp->layer, nullptr, nullptr); });

  // The three step calls: args structs, buffers, sizes, flags and call order.
  {
    // The forward args' pointer fields, as begin and as finish use them.
    struct StepField {
      Field begin;
      Field::Use finish;
    };
    const StepField step_fields[] = {{MB_FIELD(FA, x, 4, Required), Field::Required},
                                     {MB_FIELD(FA, w_router, 4, Required), Field::Ignored},
                                     {MB_FIELD(FA, w_gate, 4, Ignored), Field::Required},
                                     {MB_FIELD(FA, w_up, 4, Ignored), Field::Required},
                                     {MB_FIELD(FA, w_down, 4, Ignored), Field::Required},
                                     {MB_FIELD(FA, y, 4, Ignored), Field::Required},
                                     {MB_FIELD(FA, logits_out, 4, Ignored), Field::Optional},
                                     {MB_FIELD(FA, ids_out, 4, Ignored), Field::Optional},
                                     {MB_FIELD(FA, g_out, 4, Ignored), Field::Optional},
                                     {MB_FIELD(FA, expert_counts, 4, Ignored), Field::Optional},
                                     {MB_FIELD(FA, losses, 4, Ignored), Field::Optional}};
    std::vector<Field> begin_fields, finish_fields;
    for (const StepField& f : step_fields) {
      begin_fields.push_back(f.begin);
      finish_fields.push_back(f.begin);
      finish_fields.back().use = f.finish;
    }
    begin_fields.push_back(MB_FIELD(FA, expert_saved, 16, Ignored));  // finish's: a buffer, below
    add_field_cases(sweep, begin, begin_fields);
    add_field_cases(sweep, finish, finish_fields);
  }
  {
    using A = BA;
    add_field_cases(sweep, backward,
                    {MB_FIELD(A, dy, 4, Required), MB_FIELD(A, d_losses, 4, Optional),
                     MB_FIELD(A, x, 4, Required), MB_FIELD(A, w_router, 4, Required),
                     MB_FIELD(A, w_gate, 4, Required), MB_FIELD(A, w_up, 4, Required),
                     MB_FIELD(A, w_down, 4, Required), MB_FIELD(A, dx, 4, Optional),
                     MB_FIELD(A, dw_router, 4, Optional), MB_FIELD(A, dw_gate, 4, Optional),
                     MB_FIELD(A, dw_up, 4, Optional), MB_FIELD(A, dw_down, 4, Optional),
                     MB_FIELD(A, dg, 4, Optional), MB_FIELD(A, d_logits, 4, Optional)});
  }
  // The workspace is as large as the largest pass needs: 1 byte is short for each call.
  const auto one_byte_workspace = [](auto& a, Scratch&) { a.workspace_bytes = 1; };
  for (const EpEntry<FA>* e : {&begin, &finish}) {
    e->add_valid(sweep);
    add_struct_size_cases(sweep, *e);
    add_bad_tokens(sweep, *e);
    add_buffer_cases(sweep, *e, "home_saved", &FA::home_saved, &FA::home_saved_bytes,
                     kNull | kOneByteShort | kMisaligned, "args->home_saved");
    add_buffer_cases(sweep, *e, "workspace", &FA::workspace, &FA::workspace_bytes, kNull,
                     "args->workspace");
    e->add(sweep, "workspace one byte short", kShortBuffer, "args->workspace_bytes",
           one_byte_workspace);
    add_values(sweep, *e, &FA::flags, "flags", {1u}, kInvalid, "args->flags");
  }
  add_buffer_cases(sweep, finish, "expert_saved", &FA::expert_saved, &FA::expert_saved_bytes,
                   kNull | kOneByteShort, "args->expert_saved");
  backward.add_valid(sweep);
  add_struct_size_cases(sweep, backward);
  add_bad_tokens(sweep, backward);
  add_values(sweep, backward, &BA::flags, "flags", {4u, 0x80000000u}, kInvalid, "args->flags");
  add_buffer_cases(sweep, backward, "home_saved", &BA::home_saved, &BA::home_saved_bytes, kNull,
                   "home_saved");
  add_buffer_cases(sweep, backward, "expert_saved", &BA::expert_saved, &BA::expert_saved_bytes,
                   kOneByteShort, "args->expert_saved");
  backward.add(sweep, "workspace one byte short", kShortBuffer, "args->workspace_bytes",
               one_byte_workspace);

  add_exchange_cases(sweep, begin, wp, begin_call);
  add_exchange_cases(sweep, finish, wp, finish_call);
  add_exchange_cases(sweep, backward, wp, backward_call);
  begin.add_run(sweep, "recv_rows NULL", kInvalid, "recv_rows", [wp](const auto& e) {
    FA a = e.make();
    return moeblaze_ep_forward_begin(e.handle, &a, wp->exchange.data(), wp->exchange.size(),
                                     nullptr, nullptr);
  });
  finish.add(sweep, "a finished step", kInvalid, "already finished",
             [wp](FA&, Scratch&) { wp->to_finished(); });
  backward.add(sweep, "a step not finished", kInvalid, "forward_finish",
               [wp](BA&, Scratch&) { wp->to_begun(); });
  finish.add(sweep, "exchange never begun", kInvalid, "forward_begin",
             [wp](FA&, Scratch&) { std::memset(wp->exchange.data(), 0, wp->exchange.size()); });
  add_overwritten_cases(sweep, finish, wp);
  add_overwritten_cases(sweep, backward, wp);
}

}  // namespace

TEST_CASE("bad input: every entry point refuses every class of bad input") {
  Sweep sweep;
  add_global_cases(sweep);
  std::vector<std::shared_ptr<World>> worlds;
  for (const LayerCase& lc : kLayerCases) {
    INFO(std::string(lc.name));
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
