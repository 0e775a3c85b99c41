// Whether the Hopper kernels (sm90/) can run on the current device, found once per device.
#pragma once

namespace moeblaze {
namespace cuda {

struct Sm90Device {
  int cc_major = 0, cc_minor = 0;
  int sms = 0;
  // Compute capability 9.0, the library's sm_90a image of every sm90 kernel picked by the runtime,
  // the shared-memory opt-in granted, and the driver's tensor-map encoder found.
  bool usable = false;
  // The ping-pong F2/B4 kernels are prepared too (F2's form for h <= 1024, B4's when forced);
  // where they are not, F2 and B4 run the cooperative kernel, and nothing else depends on them.
  bool rows_pingpong = false;
  // 2-CTA clusters of the ping-pong kernel resident at once (its grid); 0: that form falls back.
  int rows_pingpong_clusters = 0;
  // 2-CTA clusters of F1's epilogue-warp kernels resident at once (its grid); 0: F1 runs one CTA.
  int f1_clusters = 0;
  // The same for the rows kernels' epilogue-warp forms (F2, B4, B1).
  int rows_clusters = 0;
};

// The current device's facts (cached per device; the first query per device sets the kernels'
// shared-memory attributes, so call sm90_prepare_device outside any CUDA-graph capture first).
const Sm90Device& sm90_current_device();

// Warm-up for `device`, e.g. in the backend's constructor. Never throws.
void sm90_prepare_device(int device);

// Tile rasterisation of the persistent grouped GEMMs F1, F2, B4 and B1 (primitives.cuh's
// decode_grouped_tile): inside an expert the n-tiles sweep bands of this many m-tiles. Each kernel
// has its default, by how many n-tiles its output has (the tile order decides how much of each
// operand is still in L2 when the next tile needs it, and the kernels' operands differ: see
// tools/models/tile_order_dram_model.py); a backend's Sm90Forms::band_mtiles
// (MOEBLAZE_CUDA_BAND_MTILES, read when the backend is created) sets one band for all of
// them, 1..256, for tuning; 0 means the defaults. Any band gives the same results bit for bit: it
// orders the tiles, not the arithmetic. The defaults, as measured on the H200
// (docs/design/cuda-kernels.md):
//   - F2 and B4 with at most kSm90NarrowOutputNTiles n-tiles (d <= 2048): band 1, so they read
//     their A rows once per m-tile (conf3: a quarter to a third fewer DRAM bytes, 1-2 % faster);
//   - wider outputs (mixtral, d = 4096: 16 n-tiles) keep band 8, where band 1 was 10-17 % slower;
//   - F1 and B1: band 8 (F1 reads less at wider bands but is no faster; the model predicts up to
//     twice B1's reads at band 1 on the larger shapes).
enum class Sm90Gemm { F1, F2, B4, B1 };
constexpr int kSm90DefaultBandMTiles = 8;
constexpr int kSm90NarrowOutputNTiles = 8;  // F2 and B4 at or below: band 1
int sm90_band_mtiles(Sm90Gemm gemm, int n_tiles, int forced_band);
int sm90_parse_band_mtiles(const char* value);  // nullptr or not an integer in 1..256: 0

// A backend's choices between the Hopper kernels' equivalent forms (each keeps every bit): read
// once when the backend is created (tuning.hpp) and passed to every launch.
struct Sm90Forms {
  int f1_form = -1;    // f1_gemm.hpp: -1 the policy, 0 consumers, 1 epilogue warps, 2 split
  int f1_cluster = 0;  // f1_gemm.hpp: 0 the policy, 1 one CTA, 2 two-CTA clusters
  int b1_form = -1;    // rows_gemm.hpp: -1 the policy, else a B1Form
  int rows_form = -1;  // rows_gemm.hpp: F2 / B4, -1 the policy, 0 consumers, 1 warps, 2-4 ping-pong
  int rows_cluster = 0;  // rows_gemm.hpp: F2 / B4 / B1 warps forms, 0 the policy, 1 or 2 CTAs
  int band_mtiles = 0;   // 0: the per-kernel defaults above, else 1..256 for every kernel
};

}  // namespace cuda
}  // namespace moeblaze
