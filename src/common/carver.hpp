// Carves sub-buffers out of one caller-owned buffer. The same code runs twice: once with a null
// base to measure the size a pass needs (the size query), once with the caller's buffer to execute,
// so the size query and the layout can never disagree.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moeblaze {

constexpr size_t kBufferAlignment = 256;  // every sub-buffer starts on a 256-byte boundary

class Carver {
 public:
  // base == nullptr: measuring mode; every carve() returns nullptr and only the size grows.
  explicit Carver(void* base = nullptr) : base_(static_cast<unsigned char*>(base)) {}

  template <typename T = void>
  T* carve(size_t bytes) {
    offset_ = (offset_ + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
    unsigned char* where = base_ ? base_ + offset_ : nullptr;
    offset_ += bytes;
    return reinterpret_cast<T*>(where);
  }

  // Total bytes used so far (what a size query reports).
  size_t size() const { return offset_; }

 private:
  unsigned char* base_;
  size_t offset_ = 0;
};

}  // namespace moeblaze
