// The layout of the saved buffer a forward pass fills for its backward pass. Shared by every
// backend so the format is defined once. Pointers are nullptr where the checkpoint policy keeps
// nothing.
#pragma once

#include <cstdint>

#include "carver.hpp"
#include "layer_desc.hpp"

namespace moeblaze {

constexpr uint32_t kSavedMagic = 0x5653424du;  // "MBSV" little-endian

// First bytes of every saved buffer. The CPU backend checks it in backward; the CUDA backend writes
// it but cannot read it back without a host sync.
struct SavedHeader {
  uint32_t magic;
  uint32_t version;  // MOEBLAZE_VERSION
  uint32_t pass;     // MOEBLAZE_PASS_EXPERTS_FORWARD or MOEBLAZE_PASS_LAYER_FORWARD
  uint32_t reserved;
  uint64_t layer_hash;
  int64_t num_tokens;
};

struct SavedView {
  SavedHeader* header = nullptr;
  int32_t* expert_offsets = nullptr;        // [E+1]
  int32_t* expert_token_indices = nullptr;  // [N]
  int32_t* token_index_map = nullptr;       // [N]
  // layer scope only
  void* logits = nullptr;  // [T,E] routing dtype
  int32_t* ids = nullptr;  // [T,k]
  void* g = nullptr;       // [T,k] routing dtype
  // Activations by policy, in the storage dtype, rows in expert-grouped order. Gated activations
  // keep a and b as the two halves of one [N, 2h] block (row r: a at [0, h), b at [h, 2h)), so
  // ab_ld = 2h; otherwise a is [N, h] and ab_ld = h. That is exactly the layout of the backward's
  // da|db, so a backward allowed to consume the saved buffer (MOEBLAZE_BACKWARD_CONSUME_SAVED)
  // writes da, db over a, b in place and reads them back as one operand. u is [N, h].
  void* a = nullptr;
  void* b = nullptr;
  int64_t ab_ld = 0;
  void* u = nullptr;
};

// Carves the saved layout out of `carver` (measuring when the carver has no base).
// `pass` is Pass::ExpertsForward or Pass::LayerForward.
inline SavedView carve_saved(Carver& carver, const LayerDesc& desc, Pass pass, int64_t T) {
  const int64_t N = T * desc.k;
  const size_t es = desc.elem_size();
  const size_t rs = desc.relem_size();
  SavedView v;
  v.header = carver.carve<SavedHeader>(sizeof(SavedHeader));
  v.expert_offsets = carver.carve<int32_t>(sizeof(int32_t) * size_t(desc.E + 1));
  v.expert_token_indices = carver.carve<int32_t>(sizeof(int32_t) * size_t(N));
  v.token_index_map = carver.carve<int32_t>(sizeof(int32_t) * size_t(N));
  if (pass == Pass::LayerForward) {
    v.logits = carver.carve(rs * size_t(T * desc.E));
    v.ids = carver.carve<int32_t>(sizeof(int32_t) * size_t(N));
    v.g = carver.carve(rs * size_t(N));
  }
  const size_t act_bytes = es * size_t(N) * size_t(desc.h);
  if (desc.checkpoint != Checkpoint::Recompute) {
    const int64_t halves = desc.gated() ? 2 : 1;
    v.ab_ld = halves * desc.h;
    v.a = carver.carve(act_bytes * size_t(halves));
    if (desc.gated() && v.a != nullptr)
      v.b = static_cast<unsigned char*>(v.a) + es * size_t(desc.h);
  }
  if (desc.checkpoint == Checkpoint::SaveAll) v.u = carver.carve(act_bytes);
  return v;
}

inline size_t saved_size(const LayerDesc& desc, Pass pass, int64_t T) {
  Carver measure;
  carve_saved(measure, desc, pass, T);
  return measure.size();
}

inline SavedHeader make_saved_header(const LayerDesc& desc, Pass pass, int64_t T) {
  SavedHeader h{};
  h.magic = kSavedMagic;
  h.version = MOEBLAZE_VERSION;
  h.pass = static_cast<uint32_t>(pass);
  h.reserved = 0;
  h.layer_hash = desc.hash();
  h.num_tokens = T;
  return h;
}

}  // namespace moeblaze
