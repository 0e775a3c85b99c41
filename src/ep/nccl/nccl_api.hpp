// The NCCL functions the NCCL transport calls, resolved at run time (dlopen/dlsym) instead of
// linked, so that libmoeblaze.so has no NEEDED libnccl.so.2 and loads on machines without NCCL.
//
// The communicator in ep_config was created by the caller's NCCL (usually the framework's, e.g.
// PyTorch's), and an ncclComm_t is only meaningful to the library instance that made it. So the
// search prefers the NCCL the process has already loaded and loads a copy only as a last resort:
//   0. MOEBLAZE_NCCL_LIBRARY=/path/to/libnccl.so.2, when set: that file and nothing else (an
//      explicit choice that cannot be honoured is an error, never a silent fallback);
//   1. the process's global symbols (RTLD_DEFAULT): NCCL linked into the executable or loaded
//      RTLD_GLOBAL;
//   2. dlopen("libnccl.so.2", RTLD_NOLOAD): a libnccl.so.2 already loaded with RTLD_LOCAL, which
//      step 1 cannot see; Python loads extension modules (and so torch's libnccl.so.2) that way;
//   3. dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL) through the system's search path.
// RTLD_NOW: a missing symbol fails here, with a message, not as a lazy-binding abort in the middle
// of an exchange. RTLD_LOCAL (not RTLD_GLOBAL): every function is taken from our handle by dlsym,
// so NCCL's symbols need not enter the global scope, where they would change how libraries loaded
// later resolve theirs. A successfully opened library is never closed (the process keeps it).
//
// This file depends on nothing else of moeblaze (the tests compile it on its own).
#pragma once

#include <nccl.h>

#include <string>

namespace moeblaze {
namespace ep {

struct NcclApi {
  decltype(&::ncclGetVersion) get_version = nullptr;
  decltype(&::ncclGetErrorString) get_error_string = nullptr;
  decltype(&::ncclCommCount) comm_count = nullptr;
  decltype(&::ncclCommCuDevice) comm_cu_device = nullptr;
  decltype(&::ncclCommUserRank) comm_user_rank = nullptr;
  decltype(&::ncclGroupStart) group_start = nullptr;
  decltype(&::ncclGroupEnd) group_end = nullptr;
  decltype(&::ncclSend) send = nullptr;
  decltype(&::ncclRecv) recv = nullptr;
  int version = 0;     // ncclGetVersion's code
  std::string source;  // where the functions came from, for messages
};

struct NcclLoadResult {
  bool ok = false;
  NcclApi api;        // complete when ok
  std::string error;  // what was tried and why it failed, when !ok
};

// Major, minor, patch of an ncclGetVersion code (2.8.4 is 2804, from 2.9 on 2.9.1 is 20901).
struct NcclVersion {
  int major = 0, minor = 0, patch = 0;
};
NcclVersion decode_nccl_version(int code);
// ncclSend/ncclRecv exist since NCCL 2.7.
constexpr int kMinNcclMajor = 2, kMinNcclMinor = 7;

// One search as described above; `override_path` plays MOEBLAZE_NCCL_LIBRARY (null or empty: not
// set). Not cached; the tests call it directly.
NcclLoadResult load_nccl_api(const char* override_path);

// The process's one search, with MOEBLAZE_NCCL_LIBRARY from the environment, done at the first
// call (thread-safe) and remembered, failure included.
const NcclLoadResult& process_nccl_api();

}  // namespace ep
}  // namespace moeblaze
