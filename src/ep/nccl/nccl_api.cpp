// See nccl_api.hpp for the search order and why it prefers the NCCL the process already has.
#include "ep/nccl/nccl_api.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 7, 0)
#error "nccl.h is older than NCCL 2.7 (no ncclSend/ncclRecv): point NCCL_HOME to a newer NCCL"
#endif

namespace moeblaze {
namespace ep {
namespace {

constexpr const char* kSoname = "libnccl.so.2";

std::string last_dl_error() {
  const char* message = dlerror();
  return message ? message : "unknown dlerror";
}

// The file that defines `symbol`, for messages ("" if dladdr cannot tell).
std::string defining_file(void* symbol) {
  Dl_info info{};
  if (symbol != nullptr && dladdr(symbol, &info) != 0 && info.dli_fname != nullptr) {
    return info.dli_fname;
  }
  return "";
}

template <typename Function>
bool resolve(void* handle, const char* name, Function& out, std::string& missing) {
  out = reinterpret_cast<Function>(dlsym(handle, name));
  if (out == nullptr) missing += missing.empty() ? name : std::string(", ") + name;
  return out != nullptr;
}

// Every function from `handle` (RTLD_DEFAULT or a library handle) and the version check.
NcclLoadResult resolve_all(void* handle, std::string source) {
  NcclLoadResult result;
  NcclApi& api = result.api;
  std::string missing;
  resolve(handle, "ncclGetVersion", api.get_version, missing);
  resolve(handle, "ncclGetErrorString", api.get_error_string, missing);
  resolve(handle, "ncclCommCount", api.comm_count, missing);
  resolve(handle, "ncclCommCuDevice", api.comm_cu_device, missing);
  resolve(handle, "ncclCommUserRank", api.comm_user_rank, missing);
  resolve(handle, "ncclGroupStart", api.group_start, missing);
  resolve(handle, "ncclGroupEnd", api.group_end, missing);
  resolve(handle, "ncclSend", api.send, missing);
  resolve(handle, "ncclRecv", api.recv, missing);
  const std::string file = defining_file(reinterpret_cast<void*>(api.get_version));
  if (!file.empty() && source.find(file) == std::string::npos) source += " = " + file;
  api.source = source;
  if (!missing.empty()) {
    result.error = source + " lacks " + missing + " (the NCCL transport needs NCCL >= 2.7)";
    return result;
  }
  if (api.get_version(&api.version) != ncclSuccess) {
    result.error = source + ": ncclGetVersion failed";
    return result;
  }
  const NcclVersion v = decode_nccl_version(api.version);
  if (v.major < kMinNcclMajor || (v.major == kMinNcclMajor && v.minor < kMinNcclMinor)) {
    result.error = source + " is NCCL " + std::to_string(v.major) + "." + std::to_string(v.minor) +
                   "." + std::to_string(v.patch) +
                   "; the NCCL transport needs NCCL >= 2.7 (ncclSend/ncclRecv)";
    return result;
  }
  result.ok = true;
  return result;
}

}  // namespace

NcclVersion decode_nccl_version(int code) {
  // NCCL_VERSION(X, Y, Z) is X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z from 2.9 on.
  NcclVersion v;
  if (code >= 10000) {
    v.major = code / 10000;
    v.minor = code % 10000 / 100;
  } else {
    v.major = code / 1000;
    v.minor = code % 1000 / 100;
  }
  v.patch = code % 100;
  return v;
}

NcclLoadResult load_nccl_api(const char* override_path) {
  const char* const hint =
      "; load NCCL before creating the layer (e.g. import torch with CUDA), or set "
      "MOEBLAZE_NCCL_LIBRARY=/path/to/libnccl.so.2";
  if (override_path != nullptr && override_path[0] != '\0') {
    const std::string source = std::string("MOEBLAZE_NCCL_LIBRARY=") + override_path;
    void* handle = dlopen(override_path, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      NcclLoadResult result;
      result.error = "NCCL not loaded: dlopen(" + source + ") failed: " + last_dl_error() +
                     " (no other NCCL is tried when MOEBLAZE_NCCL_LIBRARY is set)";
      return result;
    }
    NcclLoadResult result = resolve_all(handle, source);
    if (!result.ok) dlclose(handle);
    return result;
  }

  std::string tried;
  // 1. The process's global scope. An NCCL found here is the one in use: if it is unusable, say so
  // rather than load a second copy that the communicator does not belong to.
  if (dlsym(RTLD_DEFAULT, "ncclGetVersion") != nullptr) {
    return resolve_all(RTLD_DEFAULT, "the process's NCCL (RTLD_DEFAULT)");
  }
  tried += "the process's global symbols (RTLD_DEFAULT: no ncclGetVersion)";

  // 2. A libnccl.so.2 already loaded into a local scope (matched by its SONAME).
  if (void* handle = dlopen(kSoname, RTLD_NOW | RTLD_NOLOAD)) {
    NcclLoadResult result = resolve_all(handle, "the process's libnccl.so.2 (RTLD_NOLOAD)");
    if (!result.ok) dlclose(handle);
    return result;
  }
  tried += "; an already loaded libnccl.so.2 (RTLD_NOLOAD: none)";

  // 3. Not loaded yet: load it.
  if (void* handle = dlopen(kSoname, RTLD_NOW | RTLD_LOCAL)) {
    NcclLoadResult result = resolve_all(handle, "dlopen(\"libnccl.so.2\")");
    if (!result.ok) dlclose(handle);
    return result;
  }
  tried += "; dlopen(\"libnccl.so.2\"): " + last_dl_error();

  NcclLoadResult result;
  result.error = "NCCL not found: tried " + tried + hint;
  return result;
}

const NcclLoadResult& process_nccl_api() {
  static const NcclLoadResult result = load_nccl_api(std::getenv("MOEBLAZE_NCCL_LIBRARY"));
  return result;
}

}  // namespace ep
}  // namespace moeblaze
