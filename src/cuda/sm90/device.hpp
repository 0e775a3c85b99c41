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
// dev/cuda/tile_order_dram_model.py); a backend's Sm90Forms::band_mtiles
// (MOEBLAZE_CUDA_BAND_MTILES, read when the backend is created) sets one band for all of
// them, 1..256, for tuning; 0 means the defaults. Any band gives the same results bit for bit: it
// orders the tiles, not the arithmetic. The defaults, measured on the H200:
//   - F2 and B4 with at most kSm90NarrowOutputNTiles n-tiles (N = d <= 2048): band 1. They read
//     their A rows once per m-tile (session 14, conf3 SwiGLU, Nsight Compute: F2 3.43 -> 2.70 GB,
//     B4 9.04 -> 6.13 GB; 2.98 -> 2.94 and 5.80 -> 5.67 ms). On conf4 (8 n-tiles, session 15)
//     it was neutral: F2 5.87 -> 5.76 ms, B4 11.88 -> 12.16, inside that call's noise; conf7 flat;
//   - wider outputs (mixtral, d = 4096: 16 n-tiles) keep band 8: there band 1 was 10-17 % slower
//     in both orders of a same-process A/B (session 15, dev/cuda/results/
//     2026-11-30-nvidia-h200-s15-f1-warps-dg-bands.txt: SwiGLU F2 5.53 -> 5.00 ms and B4 11.54 ->
//     9.90 at band 8; SiLU 5.57 -> 4.99 and 5.87 -> 5.01);
//   - F1 and B1: band 8. F1 reads less at 32 (3.95 -> 2.64 GB) but is no faster (6.80 -> 6.84 ms);
//     B1 at band 1 gained 0.7 % on conf3 while the model predicts up to 2.2x its reads on conf4,
//     conf7 and mixtral.
enum class Sm90Gemm { F1, F2, B4, B1 };
constexpr int kSm90DefaultBandMTiles = 8;
constexpr int kSm90NarrowOutputNTiles = 8;  // F2 and B4 at or below: band 1
int sm90_band_mtiles(Sm90Gemm gemm, int n_tiles, int forced_band);
int sm90_parse_band_mtiles(const char* value);  // nullptr or not an integer in 1..256: 0

// A backend's choices between the Hopper kernels' equivalent forms (each keeps every bit): read
// once when the backend is created (tuning.hpp) and passed to every launch.
struct Sm90Forms {
  int f1_form = -1;     // f1_gemm.hpp: -1 the policy, 0 consumers, 1 epilogue warps
  int b1_form = -1;     // rows_gemm.hpp: -1 the policy, else a B1Form
  int band_mtiles = 0;  // 0: the per-kernel defaults above, else 1..256 for every kernel
};

}  // namespace cuda
}  // namespace moeblaze
