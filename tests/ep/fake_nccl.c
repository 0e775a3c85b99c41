/* A stand-in libnccl for the loader tests (test_ep_nccl_loader.cpp): the nine functions the NCCL
 * transport resolves, with C-compatible signatures, none of them usable for communication. The
 * version and whether ncclRecv exists are compile definitions, so one file makes every variant;
 * the distinctive version (FAKE_NCCL_VERSION) and error string prove which library answered. */
#include <stddef.h>

#define FAKE_NCCL_INVALID_USAGE 5

int ncclGetVersion(int* version) {
  *version = FAKE_NCCL_VERSION;
  return 0;
}
const char* ncclGetErrorString(int result) {
  (void)result;
  return "moeblaze fake NCCL";
}
int ncclCommCount(const void* comm, int* count) {
  (void)comm;
  (void)count;
  return FAKE_NCCL_INVALID_USAGE;
}
int ncclCommCuDevice(const void* comm, int* device) {
  (void)comm;
  (void)device;
  return FAKE_NCCL_INVALID_USAGE;
}
int ncclCommUserRank(const void* comm, int* rank) {
  (void)comm;
  (void)rank;
  return FAKE_NCCL_INVALID_USAGE;
}
int ncclGroupStart(void) {
  return FAKE_NCCL_INVALID_USAGE;
}
int ncclGroupEnd(void) {
  return FAKE_NCCL_INVALID_USAGE;
}
int ncclSend(const void* buffer, size_t count, int type, int peer, void* comm, void* stream) {
  (void)buffer, (void)count, (void)type, (void)peer, (void)comm, (void)stream;
  return FAKE_NCCL_INVALID_USAGE;
}
#if !defined(FAKE_NCCL_OMIT_RECV)
int ncclRecv(void* buffer, size_t count, int type, int peer, void* comm, void* stream) {
  (void)buffer, (void)count, (void)type, (void)peer, (void)comm, (void)stream;
  return FAKE_NCCL_INVALID_USAGE;
}
#endif
