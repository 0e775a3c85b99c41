// What a context handle names: one backend on one device, shared by the context handle and every
// layer (plain or expert-parallel) created on it, so that destroy order does not matter.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

#include "common/backend.hpp"

namespace moeblaze {

struct ContextState {
  std::unique_ptr<Backend> backend;
  int32_t backend_kind = 0;
  int32_t device = 0;
  // Execute calls on one context are serialised: the CPU backend's worker pool is per context, and
  // for CUDA the critical section only enqueues work.
  std::mutex execute_mutex;
};

}  // namespace moeblaze
