// The run-time NCCL loader of the NCCL transport (src/ep/nccl/nccl_api.hpp), compiled into this
// suite on its own (the library hides it), against stand-in libraries (fake_nccl.c) whose version
// and error string show which library answered, and the system's NCCL when configure found one.
// Runs on the CPU: loading NCCL and ncclGetVersion need no GPU.
//
// Cases named "ep nccl process: ..." change what the process has loaded or read the environment
// once, so CTest runs each in its own process (MOEBLAZE_TEST_NCCL_ISOLATED=1); without that
// variable they only say so. "ep nccl public: ..." needs a GPU (the NCCL transport needs a CUDA
// context) and MOEBLAZE_NCCL_LIBRARY=/nonexistent/libnccl.so.2 (set by CTest).
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "ep/nccl/nccl_api.hpp"
#include "support/test_support.hpp"

using moeblaze::ep::decode_nccl_version;
using moeblaze::ep::load_nccl_api;
using moeblaze::ep::NcclApi;
using moeblaze::ep::NcclLoadResult;

namespace {

constexpr int kFakeVersion = 29901;  // "2.99.1": no real NCCL has it
constexpr const char* kNonexistent = "/nonexistent/libnccl.so.2";

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

bool isolated() {
  const char* value = std::getenv("MOEBLAZE_TEST_NCCL_ISOLATED");
  if (value != nullptr && std::strcmp(value, "1") == 0) return true;
  MESSAGE("not run: CTest runs this case in its own process (MOEBLAZE_TEST_NCCL_ISOLATED=1)");
  return false;
}

void check_complete(const NcclApi& api) {
  CHECK(bool(api.get_version));
  CHECK(bool(api.get_error_string));
  CHECK(bool(api.comm_count));
  CHECK(bool(api.comm_cu_device));
  CHECK(bool(api.comm_user_rank));
  CHECK(bool(api.group_start));
  CHECK(bool(api.group_end));
  CHECK(bool(api.send));
  CHECK(bool(api.recv));
}

// The stand-in answered, not some other NCCL.
void check_is_fake(const NcclLoadResult& loaded) {
  REQUIRE_MESSAGE(loaded.ok, loaded.error);
  check_complete(loaded.api);
  CHECK(loaded.api.version == kFakeVersion);
  CHECK(std::string(loaded.api.get_error_string(ncclSuccess)) == "moeblaze fake NCCL");
  int version = 0;
  CHECK(loaded.api.get_version(&version) == ncclSuccess);
  CHECK(version == kFakeVersion);
}

}  // namespace

TEST_CASE("ep nccl loader: ncclGetVersion codes") {
  const struct {
    int code, major, minor, patch;
  } cases[] = {{2604, 2, 6, 4},   {2703, 2, 7, 3},
               {2804, 2, 8, 4},   {20901, 2, 9, 1},
               {22809, 2, 28, 9}, {kFakeVersion, 2, 99, 1},
               {30000, 3, 0, 0},  {NCCL_VERSION_CODE, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH}};
  for (const auto& c : cases) {
    const auto v = decode_nccl_version(c.code);
    INFO("code " << c.code);
    CHECK(v.major == c.major);
    CHECK(v.minor == c.minor);
    CHECK(v.patch == c.patch);
  }
}

TEST_CASE("ep nccl loader: MOEBLAZE_NCCL_LIBRARY that does not exist is an error, not a fallback") {
  const NcclLoadResult loaded = load_nccl_api(kNonexistent);
  CHECK_FALSE(loaded.ok);
  INFO(loaded.error);
  CHECK(contains(loaded.error, "MOEBLAZE_NCCL_LIBRARY"));
  CHECK(contains(loaded.error, kNonexistent));
  CHECK_FALSE(bool(loaded.api.send));
}

TEST_CASE("ep nccl loader: NCCL older than 2.7 is refused") {
  const NcclLoadResult loaded = load_nccl_api(MOEBLAZE_TEST_FAKE_NCCL_OLD);
  CHECK_FALSE(loaded.ok);
  INFO(loaded.error);
  CHECK(contains(loaded.error, "NCCL 2.6.4"));
  CHECK(contains(loaded.error, ">= 2.7"));
}

TEST_CASE("ep nccl loader: an NCCL without ncclRecv is refused, naming it") {
  const NcclLoadResult loaded = load_nccl_api(MOEBLAZE_TEST_FAKE_NCCL_NO_RECV);
  CHECK_FALSE(loaded.ok);
  INFO(loaded.error);
  CHECK(contains(loaded.error, "lacks ncclRecv"));
  CHECK_FALSE(contains(loaded.error, "ncclSend"));
}

TEST_CASE("ep nccl loader: MOEBLAZE_NCCL_LIBRARY's library answers") {
  const NcclLoadResult loaded = load_nccl_api(MOEBLAZE_TEST_FAKE_NCCL);
  check_is_fake(loaded);
  CHECK(contains(loaded.api.source, MOEBLAZE_TEST_FAKE_NCCL));
  // The stand-in's functions are its own: a call the transport makes reaches it.
  int count = -1;
  CHECK(loaded.api.comm_count(nullptr, &count) == ncclInvalidUsage);
}

TEST_CASE("ep nccl loader: the NCCL found at configure time loads and is >= 2.7") {
#if defined(MOEBLAZE_TEST_REAL_NCCL)
  const NcclLoadResult loaded = load_nccl_api(MOEBLAZE_TEST_REAL_NCCL);
  REQUIRE_MESSAGE(loaded.ok, loaded.error);
  check_complete(loaded.api);
  const auto v = decode_nccl_version(loaded.api.version);
  MESSAGE(MOEBLAZE_TEST_REAL_NCCL << " is NCCL " << v.major << "." << v.minor << "." << v.patch);
  CHECK(loaded.api.version >= NCCL_VERSION(2, 7, 0));
  CHECK(std::strlen(loaded.api.get_error_string(ncclInvalidArgument)) > 0);
#else
  MESSAGE("SKIPPED: configure found no libnccl (only nccl.h)");
#endif
}

TEST_CASE("ep nccl process: a libnccl.so.2 loaded RTLD_LOCAL is used (RTLD_NOLOAD)") {
  if (!isolated()) return;
  // As Python loads torch's NCCL: present, but invisible to the global scope. The stand-in's
  // SONAME is libnccl.so.2; the system's real libnccl.so.2, if any, must not be loaded instead.
  REQUIRE(dlsym(RTLD_DEFAULT, "ncclGetVersion") == nullptr);
  void* framework = dlopen(MOEBLAZE_TEST_FAKE_NCCL, RTLD_NOW | RTLD_LOCAL);
  REQUIRE_MESSAGE(framework != nullptr, dlerror());
  CHECK(dlsym(RTLD_DEFAULT, "ncclGetVersion") == nullptr);
  const NcclLoadResult loaded = load_nccl_api(nullptr);
  check_is_fake(loaded);
  CHECK(contains(loaded.api.source, "RTLD_NOLOAD"));
}

TEST_CASE("ep nccl process: NCCL in the global scope is used (RTLD_DEFAULT)") {
  if (!isolated()) return;
  REQUIRE(dlsym(RTLD_DEFAULT, "ncclGetVersion") == nullptr);
  void* framework = dlopen(MOEBLAZE_TEST_FAKE_NCCL, RTLD_NOW | RTLD_GLOBAL);
  REQUIRE_MESSAGE(framework != nullptr, dlerror());
  const NcclLoadResult loaded = load_nccl_api(nullptr);
  check_is_fake(loaded);
  CHECK(contains(loaded.api.source, "RTLD_DEFAULT"));
}

TEST_CASE("ep nccl process: the process-wide search reads MOEBLAZE_NCCL_LIBRARY once") {
  if (!isolated()) return;
  const char* path = std::getenv("MOEBLAZE_NCCL_LIBRARY");
  REQUIRE(path != nullptr);
  REQUIRE(std::string(path) == kNonexistent);
  const NcclLoadResult& first = moeblaze::ep::process_nccl_api();
  CHECK_FALSE(first.ok);
  CHECK(contains(first.error, kNonexistent));
  // Remembered, failure included: a later change of the environment is not seen.
  REQUIRE(setenv("MOEBLAZE_NCCL_LIBRARY", MOEBLAZE_TEST_FAKE_NCCL, 1) == 0);
  const NcclLoadResult& second = moeblaze::ep::process_nccl_api();
  CHECK(&second == &first);
  CHECK_FALSE(second.ok);
}

TEST_CASE("ep nccl public: MOEBLAZE_NCCL_LIBRARY=/nonexistent refuses the NCCL transport") {
  if (!isolated()) return;
  if (!moeblaze_backend_available(MOEBLAZE_BACKEND_CUDA)) {
    MESSAGE("SKIPPED: no CUDA GPU (or the CUDA backend is not built)");
    return;
  }
  const char* path = std::getenv("MOEBLAZE_NCCL_LIBRARY");
  REQUIRE(path != nullptr);
  REQUIRE(std::string(path) == kNonexistent);
  mbtest::Context context(MOEBLAZE_BACKEND_CUDA, 0);
  const moeblaze_layer_config_t config = mbtest::make_config(MOEBLAZE_DTYPE_F32, 8, 8, 4, 2);
  moeblaze_ep_config_t ep;
  MB_CHECK(moeblaze_ep_config_init(&ep, sizeof ep));
  ep.transport = MOEBLAZE_EP_TRANSPORT_NCCL;
  // Never dereferenced: the search fails before the communicator is asked anything.
  int not_a_communicator = 0;
  ep.communicator = &not_a_communicator;
  moeblaze_ep_layer_t layer = nullptr;
  MB_CHECK_STATUS(moeblaze_ep_layer_create(&layer, context.get(), &config, &ep),
                  MOEBLAZE_ERR_NOT_SUPPORTED);
  CHECK(layer == nullptr);
  INFO(moeblaze_last_error());
  CHECK(contains(moeblaze_last_error(), kNonexistent));
  CHECK(contains(moeblaze_last_error(), "MOEBLAZE_EP_TRANSPORT_NCCL"));
}
