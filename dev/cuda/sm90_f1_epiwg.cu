// Kernel workshop round 10: F1 (forward first GEMM of an MoE layer: gathered A rows, dual B =
// w_gate / w_up, SwiGLU epilogue writing a, b, u in bf16) on Hopper (sm_90a) with the epilogue
// handed off, as bf16 a and b in shared memory, to dedicated EPILOGUE WARPS, so that the consumer
// warpgroups start the next tile's main loop right after a tile's last wgmma.
//
// Build (from the repository root; -I src is required: the device primitives and the tensor-map
// encoder come from src/cuda/sm90/primitives.cuh; -I include as well makes u the library's
// act_math::forward, see act_u, without it a verbatim copy is used, same SASS; no -lcuda: the
// encoder takes cuTensorMapEncodeTiled from the driver through the runtime's entry-point query):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v -I include \
//        -I src -o /tmp/f1w dev/cuda/sm90_f1_epiwg.cu -lcublas
// Without cuBLAS (the dense column of the table is then 0): add -DNO_CUBLAS, drop -lcublas.
// The device call (build, per-version checks, full checks + timing, memcheck; table last):
//   bash dev/cuda/run_sm90_f1_epiwg.sh
// By hand:
//   /tmp/f1w [--check-only] [--shape edge|tiny|conf3|conf4|mixtral|qwen] [--versions 1,2,3]
//            [--seed N]        (default: versions 1..6, shapes edge tiny conf3 mixtral qwen)
//
// ---- the problem (round 1's, dev/cuda/sm90_gather_gemm.cu) ----
// For expert e and routed rows r in [off[e], off[e+1]):
//   a_r = x[tok_r] . w_gate[e]^T,  b_r = x[tok_r] . w_up[e]^T        ([h] each, fp32 accumulate)
//   a, b rounded to bf16 once; u_r = act(a_r, b_r) = silu(a) * b in fp32 from the ROUNDED a, b with
//   the library's GPU formula (act_math::forward: sigmoid = __fdividef(1, 1 + __expf(-a))),
//   rounded.
// Outputs a, b, u: [N, ld] bf16 (ld = h here except on edge / tiny, which pad 24 / 8 columns).
//
// ---- versions ----
//   v1: round 7's v1 = the library's F1 (src/cuda/sm90/f1_gemm.cu, bf16 SwiGLU instance) =
//       f1_sm90_kernel<4 stages, kEpiFull>: persistent grid (one CTA per SM), tile 128 rows x
//       (128 cols of w_gate + the same 128 of w_up) x 64 k, 4 stages of 48 KB, 384 threads:
//       warpgroup 0 produces (TMA for the weights, 16-byte cp.async gather of the A rows,
//       setmaxnreg 40), warpgroups 1, 2 consume (m64n256k16, 128 fp32 accumulators, setmaxnreg
//       232) and run the epilogue (round; act; per-warp 2 KB staging; 16-byte stores) before the
//       next tile: the tensor cores idle meanwhile. Only change from round 7: u uses the library's
//       MUFU sigmoid (round 7's v1 predates it) and the outputs have a row stride (ld). v1 is the
//       baseline and the BITWISE oracle of v2 and v3.
//   v2: f1_epiwg_kernel<3 stages, kEpiFull>: THE EPILOGUE WARPS (design below).
//   v3: f1_sm90_kernel<3 stages, kEpiFull>: v1 with 3 stages: what the third stage costs alone.
//   v4, v5, v6: timing probes (main loop alone; nothing written; smoke-run, never checked):
//       v4 = v2's (kernel 2, no hand-off), v5 = v3's, v6 = v1's (round 7's "v2" probe).
//       v2 - v4: the epilogue left exposed; v4 - v5: 2 instead of 4 gathering warps; v5 - v6: the
//       third stage; v3 - v5: the consumers' epilogue.
//   Round 12 (session 5), after round 11 moved the library's gather into the consumer warpgroups
//   (primitives.cuh's HalfTileGather: round 10 had shown the gather's rate is per issuing warp):
//   GATHER = 1 variants, where the consumers gather their own 64 A rows STAGES - 1 k-steps ahead
//   and the producer is thread 0 alone (the weight boxes): the epilogue warps no longer take
//   gathering warps away.
//       v7: kernel 1 <4 stages, GATHER> = the library's F1 since round 11;
//       v8: kernel 2 <3 stages, GATHER>: the epilogue warps with the consumers' gather (lag 2);
//       v9 (probe) = v8's main loop alone, v10 (probe) = v7's.
//   Prediction (written before the run): conf3 v7 ~10.4 ms (the library's 10.38), v10 ~7.3-7.6,
//   v9 ~7.5-8.0 (one stage and one k-step of lead fewer), v8 = v9 + ~0.3-0.5 ms of hand-off
//   ~8.0-8.5 ms: F1 -2 ms on conf3; mixtral v7 ~12.4, v8 ~11.5.
//
// ---- why not a 4th warpgroup (512 threads), as the brief proposed ----
// ptxas (nvcc 13.0) compiles a kernel for the register target of its launch bound, 65536 / 512 =
// 128 registers, and checks EVERY instruction against that target, setmaxnreg or not. The
// m64n256k16 f32 wgmma keeps its 128 accumulators in R24..R151 (ptxas's placement), so it cannot
// be compiled: "ptxas fatal: (C7602) Insufficient registers (128) to compile instruction ... Try to
// compile with register target of 154 or higher." Reproduced here with __launch_bounds__(512, 1),
// __launch_bounds__(512), __maxnreg__(128) and -maxrregcount=128 (and 416 threads), with or without
// the 4th warpgroup's setmaxnreg; without any bound ptxas takes 154 registers at entry, and
// 154 x 512 > 65536 cannot launch. (Round 9, sm90_f2_actload.cu, hit the same wall.) In a
// 384-thread kernel the target is 168 and the same instruction compiles (the consumer code then
// uses up to R175 in v1, inside setmaxnreg's 232). So the epilogue workers have to come out of the
// 384 threads: v2 SPLITS WARPGROUP 0 into 2 producer warps (0, 1) and 2 epilogue warps (2, 3).
// setmaxnreg is per warpgroup, so both halves get the same count (72). The alternative, a smaller
// accumulator per consumer (m64n128 tiles: 128 x 64 h-columns), is round 7's v6, whose main loop
// alone ran at 358 TFLOP/s: worse than any exposed epilogue.
//
// ---- v2: design ----
// * Producer (warps 0, 1; 64 threads): v1's code with 16 instead of 8 rows per thread (row
//   r = (tid >> 3) + 8 i, the same 16-byte chunks and swizzle); thread 0 issues the two TMA weight
//   boxes; token ids through shared memory behind named barrier 1 (64 threads). full[s] counts
//   64 + 1 arrivals. Tile order, rasterisation (bands of 8 m-tiles), persistent grid, k-loop,
//   descriptors, one wgmma batch in flight, release of stage s after wait_group 1: all v1's.
// * Hand-off buffer (64 KB): 4 sub-tiles of 128 rows x 64 columns bf16 (a cols 0-63, a 64-127,
//   b 0-63, b 64-127), each in TMA's 128-byte swizzle (16-byte chunk c of row r at
//   r * 128 + ((c ^ (r & 7)) << 4), 1024-byte aligned), i.e. exactly the layout a TMA store of a
//   box {64 cols, 128 rows} with CU_TENSOR_MAP_SWIZZLE_128B reads (the same swizzle the producer
//   already writes A in and wgmma reads).
// * Consumers, after a tile's final wgmma wait and the release of its last stage: wait
//   handoff_empty, write their 64 rows: register 4j + q of lane (g, t4) = row g + 8 (q >> 1),
//   column 8j + 2 t4 + (q & 1); the pair (q, q + 1) rounded by one __floats2bfloat162_rn (v1's
//   rounding, bit for bit) is one 4-byte STS to sub-tile j >> 3, chunk j & 7, word t4. A warp
//   instruction (fixed j, rr) writes rows g = 0..7 (row & 7 == g), chunks (j & 7) ^ g: 8 distinct
//   16-byte groups x 4 words = all 32 banks once: conflict-free. 64 STS per thread. Then
//   fence.proxy.async.shared::cta (each thread, its own writes: generic proxy -> the TMA unit's
//   async-proxy reads), __syncwarp, lane 0 arrives on handoff_full; on to the next tile. The
//   consumers no longer decode tile coordinates at all.
// * Epilogue warps (warps 2, 3; 64 threads): per tile, decode the tile (same sequence of tile ids),
//   wait handoff_full;
//   - a, b of a WHOLE tile (128 valid rows): lane 0 of warp 2 ("the issuer") issues up to 4 TMA
//     stores cp.async.bulk.tensor.2d.global.shared::cta.bulk_group, box {64, 128} at
//     {n0 + 64 half, row0} of a 2-D map over the [N, h] output with row stride ld (boxes that start
//     at or past h are not issued), then cp.async.bulk.commit_group. Columns past h (edge:
//     h = 264, the last n-tile's first box covers 256..319) are clipped by the TMA unit at the
//     map's dimension h. Rows need no clipping: a whole tile's rows all belong to its expert.
//   - a, b of a PARTIAL tile (the last m-tile of an expert; rows past the count belong to the next
//     expert or lie past N): predicated 16-byte stores from the buffer, like u. Why not TMA with
//     clipping: a TMA store clips only at the map's bounds, so it would need a map per expert whose
//     row dimension ends at the expert's last row: E maps built from host-side offsets (the
//     library keeps the offsets on the device and never syncs) or rewritten on the device
//     (tensormap.replace + tensormap.cp_fenceproxy per expert: more moving parts than the
//     fallback). Partial tiles are 1 per expert and n-tile: < 1 % of tiles on conf3 and mixtral,
//     6 % on qwen (E = 128).
//   - u: each lane reads 16-byte chunk (lane & 7) of row 8 i + 4 ew + (lane >> 3) of a and of b at
//     the SAME offset (the sub-tiles share one layout), converts bf16 -> fp32 by bit placement
//     (exact: the floats v1 computes u from), u = act_u(a, b) (the library's act_math::forward),
//     packs with __floats2bfloat162_rn and stores 16 bytes to out_u (predicated on row < rows,
//     col < h). An 8-lane phase reads one 128-byte row: conflict-free LDS.128; a warp instruction
//     stores 4 rows x 128 contiguous bytes: whole lines. 32 chunks per thread per tile.
//   - release: the issuer runs cp.async.bulk.wait_group.read 0 (the TMA unit has finished READING
//     the buffer; its global writes may still be in flight), __syncwarp, lane 0 of each epilogue
//     warp arrives on handoff_empty. At exit the issuer waits cp.async.bulk.wait_group 0 (the
//     writes done before the CTA, and the buffer, go away).
// * Non-gated activations (the library's F1 also does them; not here): the tile is then 256 columns
//   of a only, so the hand-off would hold a in all 4 sub-tiles (a 0-63 ... 192-255), a is stored by
//   4 TMA boxes and u = act_math::forward(act, a, 0) is formed from one sub-tile at a time with the
//   same lane mapping; out_b does not exist. A null output (checkpoint policy) drops its stores.
//
// ---- barrier protocol (v2) ----
//   barrier         count  arrivals (per phase)                           waiters, parity
//   full[s]         65     64 cp.async.mbarrier.arrive.noinc (producer     consumers: use u = it /
//   3
//                          threads, when their copies land) + 1            of stage s = it % 3,
//                          arrive.expect_tx(32 KB) by thread 0             parity u & 1
//   empty[s]        8      lane 0 of each consumer warp, after the         producer: parity
//                          wgmma that read s completed (wait_group 1;      (u & 1) ^ 1
//                          the tile's last stage after wait_group 0)
//   handoff_full    8      lane 0 of each consumer warp, after its 64      epilogue warps: tile n
//                          rows are written + fenced (__syncwarp first)    of this CTA, parity n &
//                          1
//   handoff_empty   2      lane 0 of each epilogue warp, after its u       consumers: before
//                          loads (__syncwarp) and, warp 2, after the       writing tile n, parity
//                          issuer's wait_group.read 0                      (n & 1) ^ 1
//   named barrier 1 (64 threads): the producer warps around the token-id refill (v1: 128).
// Phases are counted per CTA: n = the CTA's n-th tile (all roles walk t = blockIdx.x, +=
// gridDim.x). No deadlock. Every wait is on a resource that a role releases without waiting for the
// waiter:
//   - the epilogue warps wait only for handoff_full (and for their own TMA reads, which complete on
//     their own); they never wait on the producer or on a later consumer step;
//   - a consumer waits for full[s] (the producer's fill of a stage it has not released yet) and for
//     handoff_empty(n - 1) (the epilogue warps' tile n - 1, whose handoff_full this consumer
//     already gave before starting tile n's main loop, so that tile's epilogue can always finish);
//   - the producer waits for empty[s] of use u - 1, which the consumers give after the wgmma of
//     use u - 1 completes; that wgmma needs full of use u - 1, already arrived by the producer;
//     the consumers release every stage of tile n BEFORE waiting handoff_empty, so the producer
//     can run up to 3 stages into tile n + 1 while the consumers wait.
//   So the wait-for graph has no cycle: producer -> consumers (empty) -> producer (full, earlier
//   use) and consumers -> epilogue (handoff_empty) -> consumers (handoff_full, earlier tile) only
//   point back to strictly earlier work.
// Round 8b's deadlock (v9: one arrival per producer warp after cp.async.wait_group 3 = the full
// arrival of use u made only while issuing use u + 3): the consumers release use u - 1 only after
// the wgmma of use u is issued (wait_group 1), so the producer's wait for empty of use u' - S
// (S stages) needs full of use u' - S + 1, i.e. an arrival made at iteration u' - S + 1 + lag.
// It deadlocks when u' - S + 1 + lag >= u', i.e. lag >= S - 1: lag 3 with S = 4 deadlocks, lag 2
// does not. Here the lag is 0 (cp.async.mbarrier.arrive.noinc at the same iteration, completed by
// the hardware) and S = 3: 0 < 2. The hand-off adds a lag of its own kind: the buffer written for
// tile n needs tile n - 1's epilogue done, which needs nothing of tile n: lag 1 with 1 buffer,
// safe. No parity aliasing (a parity wait cannot tell phase p from p + 2): handoff_full cannot
// complete phase n + 1 before both epilogue warps waited phase n (phase n + 1 needs every consumer
// warp's tile-(n + 1) arrival, each after its handoff_empty(n) wait, which needs both epilogue
// warps' arrivals after their handoff_full(n) waits); symmetrically handoff_empty cannot complete
// phase n before every consumer warp waited phase n - 1 (phase n needs the epilogue warps' arrivals
// for tile n, after handoff_full(n), which needs every consumer warp's tile-n arrival, each after
// its handoff_empty(n - 1) wait). One arrival per WARP on both (never one per warpgroup): warps of
// a warpgroup drift (round 5's lesson: a single leader arrival let a lagging warp find a barrier
// two phases ahead). full / empty: v1's argument (a stage cannot be refilled before all 8 consumer
// warps released it, nor released before it was filled). A randomised interleaving model of this
// protocol (Python, outside the repository, in the style of round 5's: producer, 8 consumer warps,
// 2 epilogue warps, asynchronous fills / wgmma / TMA reads, mbarrier phase/parity semantics, 2-4
// stages, 0-6 tiles, 1-7 k-steps) passed 400 seeds with no deadlock, no stage refilled under a live
// wgmma, no hand-off write under a read, no read of an incomplete hand-off; its mutations fail as
// they must: arrival lag 3 with 4 stages deadlocks (round 8b), handoff_empty count 1 for 2 warps
// and a missing handoff_empty wait are caught. Proxies: generic STS of the hand-off -> TMA store's
// async-proxy reads: fence.proxy.async. shared::cta by every writing thread after its writes and
// before its warp's release-arrival, the issuer's acquire-wait, then the store (CUTLASS's order:
// smem writes, tma_store_fence, barrier, store). TMA reads -> the consumers' next generic writes
// (WAR): cp.async.bulk.wait_group.read 0 before the release-arrival (CUTLASS's tma_store_wait
// before reusing the buffer; no proxy fence there). The epilogue warps' own LDS are generic ->
// generic: the mbarrier acquire/release suffice.
//
// ---- shared memory (per CTA, E <= 4096; 227 KB = 232448 B opt-in) ----
//   v1 (kernel 1, 4 stages): 1024 slack + 4 x 48 KB + 16 KB staging + 64 barriers + 512 token ids
//     + 4 (E + 1) tile prefix = 214,592 + 4 (E + 1) = 230,980 at E = 4096 (v3: 3 stages, 181,812).
//   v2 (kernel 2, 3 stages): 1024 + 3 x 48 KB + 64 KB hand-off + 64 barriers (3 full, 3 empty,
//     handoff_full, handoff_empty) + 512 + 4 (E + 1) = 214,592 + 4 (E + 1) = 230,980 at E = 4096.
//     4 stages + the hand-off would be 263,760 + 4 (E + 1): does not fit (static_assert).
//
// ---- registers (setmaxnreg; ptxas entry count 168 = 65536 / 384 rounded down to 8) ----
//   The CTA's pool is 384 x 168 = 64512; .dec returns registers to it, .inc blocks until it has
//   them, all 4 warps of a warpgroup set the same count. So counts must sum to <= 3 x 168 = 504 per
//   thread slot of a warpgroup (or a consumer's .inc waits forever; the host checks the entry count
//   before launching):
//     kernel 1: 40 (warpgroup 0) + 2 x 232 = 504 (round 7's);
//     kernel 2: 72 (warpgroup 0: producer and epilogue warps) + 2 x 216 = 504.
//   Used (SASS, highest register per role): kernel 1 consumers R175, producer R27; kernel 2
//   consumers R151 (the hand-off is 64 STS, no epilogue temporaries), warpgroup 0 R51. 0 spills.
//
// ---- what the program checks (before any timing; every shape, every checked version) ----
//   1. Every element of a, b, u (outputs poisoned with 0xFFFF, a bf16 NaN, first) against the SIMT
//      fp32 device oracle (round 1's tolerances; an unwritten element counts as non-finite).
//   2. The padding still poisoned: columns h..ld-1 of every row (edge, tiny) and 128 rows past N
//      (every shape): catches an unclipped TMA box (the last expert's partial tile would write
//      rows past N; a box past h, columns past h) or a missing predicate.
//   3. Sampled rows against the CPU fp64 reference (and the oracle against the CPU).
//   4. v2, v3 (any version but 1): a, b, u BITWISE equal to v1's over the whole allocation
//      (v1 run once per shape on poisoned outputs); the first differing (row, expert, column) is
//      printed.
//   5. A second run (outputs poisoned again) bitwise identical (position-weighted checksum).
//   Shapes: edge (T 3001, d 200, h 264, E 7, k 2: k tail, n tail clipped by TMA, ragged experts so
//   every expert has a partial last tile, an empty expert, whole tiles for the TMA path, ld = h +
//   24), tiny (T 50, d 72, h 136, E 3: every tile partial, most CTAs idle, k_tiles 2 < stages, ld =
//   h + 8), conf3, mixtral, qwen (timed; conf4 with --shape conf4). Timing: 3 warm-ups, median of
//   20 runs each after a 4 x L2 memset.
//
// ---- compile-time facts (nvcc 13.0, this machine, no GPU) ----
//   All 6 F1 kernels: 168 registers at entry, 0 bytes stack, 0 spill stores / loads, no C75xx
//   note or warning, no LDL / STL. SASS: 4 HGMMA.64x256x16.F32.BF16 per kernel (one
//   WARPGROUP.DEPBAR.LE gsb0 0x1 in the k-loop, 0x0 after it); kernel 1: 8 LDGSTS.E.BYPASS.128 per
//   stage, USETMAXREG 0x28 / 0xe8; kernel 2: 16 LDGSTS per stage, USETMAXREG.DEALLOC 0x48 /
//   TRY_ALLOC 0xd8, 4 UTMASTG.2D + UTMACMDFLUSH (the stores and their commit), DEPBAR for the bulk
//   waits, FENCE.VIEW.ASYNC.S (hand-off and main-loop proxy fences), 16-byte LDS / STG in the
//   epilogue warps. The SASS of kernel 2 is identical with the library's act_math::forward and
//   with act_u's verbatim copy. Since the device helpers come from primitives.cuh (they were round
//   7's copies before) the cubin is byte-identical except mbar_wait's poll limit (2^20, was 2^24).
//
// ---- prediction (before any run) ----
// Known (H200, earlier rounds / profiles): conf3 F1 (library, MUFU sigmoid) 10.6 ms, its main loop
// alone 8.3-8.8 ms (round 7's probe 8.80 = 500 TFLOP/s); mixtral main loop 16.1 of ~17.0 ms; qwen
// 2.9 of ~3.5 ms. The epilogue warps' work per tile (2 SMSPs: 16,384 u x 2 MUFU at 4 lanes / clk /
// SMSP = 4096 clk, ~3.5 k issue slots per warp) is ~12 % of conf3's tile at the measured main-loop
// speed (8.8 ms / 498 tiles per CTA = 17.7 us = 35 k clk, 16 k-steps), 6 % of qwen's (32 k-steps)
// and 3 % of mixtral's (64), so it hides; the extra shared-memory traffic (192 KB per tile:
// hand-off writes, u reads, TMA reads) is < 10 % of the tile's wgmma operand reads. What is left:
//   - the third stage: 2 stages of lookahead instead of 3 (2.2 instead of 3.3 us at conf3's 1.1 us
//     per k-step) against gather latencies of ~1-2 us under load: +2-8 % on the main loop (v5 vs
//     v6), most on mixtral (weights from DRAM);
//   - 2 gathering warps instead of 4: same instructions, half the issuing warps: +0-3 % (v4 vs v5);
//   - the hand-off (64 STS + fence + arrival per consumer thread, 0.3-0.5 us per tile, nothing
//     overlaps it): +2-3 % on conf3, ~1 % on qwen / mixtral.
//   v2: conf3 9.2-9.9 ms (445-480 TFLOP/s, 1.07-1.15x v1; central 9.5 ms = 463); qwen 3.0-3.3 ms
//       (1.05-1.15x); mixtral 16.6-17.5 ms (0.97-1.03x: its epilogue was small, its main loop the
//       most latency-sensitive). v2 - v4 <= 3 %.
//   v3: 2-6 % slower than v1 on every shape (the third stage's cost without any hiding).
//   If v2 is slower than predicted on conf3: first v4 vs v6 (is it the main loop: stages or
//   gather?), then v2 vs v4 (exposed epilogue: the epilogue warps too slow, or contention).
//   A 4-stage v2 would need a smaller hand-off (e.g. 32 KB: one consumer warpgroup's 64 rows at a
//   time, the two warpgroups taking turns): 4 x 48 + 32 KB + the rest fits only for E <= 363.
//
// ---- not verified here (no GPU; the checks above decide) ----
//   - TMA store clipping of box columns past the map's dimension (the padding check on edge
//     catches a write past h); a box wholly past h is not issued anyway.
//   - That ptxas keeps each role's registers within its setmaxnreg count (it must; the SASS shows
//     warpgroup 0 at <= R51 < 72 and the consumers at <= R151 < 216).
//   - The fence.proxy.async placement (per writing thread, before the arrival) follows CUTLASS's
//     TMA-store epilogue; the PTX ISA text for it was not re-read in this session.

#include <cuda.h>  // CUtensorMap and the encoder's types only; no libcuda link
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#ifndef NO_CUBLAS
#include <cublas_v2.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

// The library's Hopper device primitives (mbarrier, cp.async, TMA loads, fences, wgmma and its
// descriptors, pack2, warp_prefix_tiles, kBK) and the tensor-map encoder, with no other library
// dependency (-I src). Their device code exists only in the sm_90a pass (MB_SM90_DEVICE), so this
// file's device code that uses them is guarded the same way, and any other device target is an
// error here rather than a kernel that traps. mbar_wait is the header's, with a watchdog of 2^20
// polls instead of the library's 2^26 so that a hang fails fast: at 2^24 polls (rounds 1-9's own
// copies) round 8b's full run that ended in the trap took ~67 s against 4-8 s without the hang,
// so 2^20 should trap within seconds, and no real wait comes near it (microseconds).
#define MB_SM90_MBAR_POLL_LIMIT (1u << 20)
#include "cuda/sm90/primitives.cuh"
#if defined(__CUDA_ARCH__) && !MB_SM90_DEVICE
#error "sm90_f1_epiwg.cu is for sm_90a only: -gencode=arch=compute_90a,code=sm_90a"
#endif
using namespace moeblaze::cuda::sm90;

// The library's activation formula (act_math::forward) when the repository's include paths are
// given (-I include as well as -I src, as the run script does); otherwise a verbatim copy of its
// GPU SwiGLU.
#if __has_include("common/activation_math.hpp") && __has_include("moeblaze.h")
#include "common/activation_math.hpp"
#define F1_LIBRARY_ACT 1
#else
#ifdef F1_REQUIRE_LIBRARY_ACT  // the run script's build: the library's formula or no build
#error "activation_math.hpp / moeblaze.h not found: build from the repo root with -I include -I src"
#endif
#define F1_LIBRARY_ACT 0
#endif

// ---------------------------------------------------------------------------------------------
// error checking (a workshop program: print file:line and exit)

#define CUDA_CHECK(call)                                                                          \
  do {                                                                                            \
    cudaError_t err_ = (call);                                                                    \
    if (err_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(err_), __FILE__, __LINE__, \
              cudaGetErrorString(err_));                                                          \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

#define REQUIRE(cond, ...)                                \
  do {                                                    \
    if (!(cond)) {                                        \
      fprintf(stderr, "requirement failed: %s: ", #cond); \
      fprintf(stderr, __VA_ARGS__);                       \
      fprintf(stderr, "\n");                              \
      exit(1);                                            \
    }                                                     \
  } while (0)

typedef __nv_bfloat16 bf16;

// ---------------------------------------------------------------------------------------------
// CPU reference (the spec): fp64 accumulation over bf16 inputs, for a subset of routed rows.

static float bf16_bits_to_float(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static float round_bf16_host(float f) {  // round-to-nearest-even, NaN kept
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float r;
  memcpy(&r, &u, 4);
  return r;
}

static float silu_host(float a) {
  return a * (1.f / (1.f + std::exp(-a)));
}

// One routed row: a_ref, b_ref (unrounded) for all h columns.
static void f1_row_cpu(const uint16_t* x_row, const uint16_t* wg_e, const uint16_t* wu_e, int d,
                       int h, float* a_out, float* b_out) {
  std::vector<float> xf(d);
  for (int k = 0; k < d; ++k) xf[k] = bf16_bits_to_float(x_row[k]);
  for (int n = 0; n < h; ++n) {
    const uint16_t* g = wg_e + size_t(n) * d;
    const uint16_t* u = wu_e + size_t(n) * d;
    double sa = 0, sb = 0;
    for (int k = 0; k < d; ++k) {
      sa += double(xf[k]) * bf16_bits_to_float(g[k]);
      sb += double(xf[k]) * bf16_bits_to_float(u[k]);
    }
    a_out[n] = float(sa);
    b_out[n] = float(sb);
  }
}

// ---------------------------------------------------------------------------------------------
// device helpers: the mbarrier, cp.async, TMA load, fence and wgmma primitives, the K-major
// descriptor and pack2 are primitives.cuh's (see the includes). Local here: what the header does
// not have (the TMA store and its bulk-group commit / waits, new in this round) and the round's
// own epilogue math (act_u, act_pair).

#if MB_SM90_DEVICE

// TMA store (new in this round): the box at {c0, c1} of `map` from shared memory at `src`, laid
// out as the map's swizzle says. Elements of the box outside the map's dimensions are not written.
// Completion is tracked per issuing thread by bulk async-groups (commit / wait below).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed bulk groups still READ their shared-memory
// source (the global writes may still be in flight): the source may then be overwritten.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until at most N of this thread's committed bulk groups are pending at all (writes done).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// u = act(a, b) for SwiGLU from the ROUNDED a, b, in fp32: the library's formula. With the
// repository's include paths this is act_math::forward itself; without them, a verbatim copy of
// its GPU branch (sigmoid = __fdividef(1, 1 + __expf(-a)), silu = a * sigmoid, u = silu * b).
// Every version calls this one function, so their u agree bitwise when their a, b do.
// (Non-gated activations would call act_math::forward(act, a, 0) here: see the header.)
__device__ __forceinline__ float act_u(float a, float b) {
#if F1_LIBRARY_ACT
  return moeblaze::act_math::forward(moeblaze::Activation::SwiGLU, a, b);
#else
  return (a * __fdividef(1.f, 1.f + __expf(-a))) * b;
#endif
}

// Two packed bf16 (lo at the lower address) -> u of the pair, packed the same way. bf16 -> fp32 by
// bit placement is exact, so act_u sees the same floats as in v1's epilogue. (Not unpack2<bf16>:
// that converts with cvt.f32.bf16, the same values by a different instruction.)
__device__ __forceinline__ uint32_t act_pair(uint32_t a2, uint32_t b2) {
  const float a0 = __uint_as_float(a2 << 16), a1 = __uint_as_float(a2 & 0xffff0000u);
  const float b0 = __uint_as_float(b2 << 16), b1 = __uint_as_float(b2 & 0xffff0000u);
  return pack2<bf16>(act_u(a0, b0), act_u(a1, b1));
}

#endif  // MB_SM90_DEVICE

// ---------------------------------------------------------------------------------------------
// the kernels' shared pieces

constexpr int kBM = 128;  // routed rows per tile
constexpr int kBN = 128;  // columns of h per tile (for each of w_gate and w_up)
// k per stage: primitives.cuh's kBK = 64, one 128-byte swizzle row of bf16
constexpr int kThreads = 384;  // warpgroup 0: producer (v2: + epilogue warps); 1, 2: consumers
constexpr int kProducerThreads = 128;  // kernel 1: all of warpgroup 0 gathers
constexpr int kConsumerWarps = 8;
// Kernel 2 (v2) splits warpgroup 0: warps 0, 1 produce (64 threads), warps 2, 3 are the epilogue
// warps. (A 4th warpgroup, 512 threads, does not compile: see the header.)
constexpr int kEpiProducerThreads = 64;
constexpr int kEpiWarps = 2;
constexpr int kEpiIssuerTid = 64;  // lane 0 of warp 2: issues and waits for the TMA stores
constexpr int kBandMTiles = 8;     // rasterisation: n-tiles sweep a band of 8 m-tiles
constexpr int kMaxExperts = 4096;

constexpr int kATileBytes = kBM * kBK * 2;                  // 16 KB
constexpr int kBTileBytes = kBN * kBK * 2;                  // 16 KB each for gate and up
constexpr int kStageBytes = kATileBytes + 2 * kBTileBytes;  // 48 KB
constexpr int kEpiWarpBytes = 16 * 64 * 2;                  // v1: 16 rows x 64 cols bf16
constexpr int kEpiBytes = kConsumerWarps * kEpiWarpBytes;   // 16 KB
constexpr int kTokenBytes = kBM * 4;  // the producer's current tile's token ids
// v2's hand-off buffer: 4 sub-tiles of 128 rows x 64 columns bf16 (128-byte rows, TMA's 128B
// swizzle: 16-byte chunk c of row r at r * 128 + ((c ^ (r & 7)) << 4)), in this order:
// a columns [0, 64), a [64, 128), b [0, 64), b [64, 128) of the tile's 128 h-columns.
constexpr int kHandoffSubBytes = kBM * 64 * 2;          // 16 KB
constexpr int kHandoffBytes = 4 * kHandoffSubBytes;     // 64 KB
constexpr int kHandoffSubWords = kHandoffSubBytes / 4;  // 4096

// Register budgets (setmaxnreg counts are per thread, multiples of 8 in [24, 256]). A 384-thread
// CTA with __launch_bounds__(384, 1) starts with 168 registers per thread (ptxas's entry count:
// 65536 / 384 rounded down to a multiple of 8), i.e. a CTA pool of 384 x 168 = 64512. .dec
// returns registers to the pool, .inc blocks until the pool has them, and the same count is set
// for all 4 warps of a warpgroup. So the three warpgroups' counts must sum to <= 3 x 168 = 504, or
// a consumer's .inc waits forever (no watchdog can catch that: the host checks it before launch).
//   kernel 1 (round 7's):  warpgroup 0 (producer) 40 + consumers 2 x 232 = 504;
//   kernel 2 (v2):         warpgroup 0 (2 producer + 2 epilogue warps) 72 + consumers 2 x 216 =
//   504.
constexpr int kEntryRegs = 168;
constexpr int kRegsWg0V1 = 40, kRegsConsumerV1 = 232;
constexpr int kRegsWg0 = 72, kRegsConsumer = 216;
static_assert(kRegsWg0V1 + 2 * kRegsConsumerV1 <= 3 * kEntryRegs, "kernel 1 register split");
static_assert(kRegsWg0 + 2 * kRegsConsumer <= 3 * kEntryRegs, "kernel 2 register split");
static_assert(kRegsWg0 % 8 == 0 && kRegsConsumer % 8 == 0, "setmaxnreg counts are multiples of 8");

constexpr size_t smem_bytes_v1(int stages, int E) {  // v1, v3, v4, v5
  return 1024 /* alignment slack */ + size_t(stages) * kStageBytes + kEpiBytes +
         4 * stages * 8 /* full, empty, a_full[2] */ + kTokenBytes + sizeof(int) * size_t(E + 1);
}
constexpr size_t smem_bytes_epiwg(int stages, int E) {  // v2
  return 1024 /* alignment slack */ + size_t(stages) * kStageBytes + kHandoffBytes +
         (4 * stages + 2) * 8 /* full, empty, a_full[2], handoff_full, handoff_empty */ +
         kTokenBytes + sizeof(int) * size_t(E + 1);
}
constexpr int kSmemOptin = 232448;  // H100 / H200: 227 KB per block
static_assert(smem_bytes_v1(4, kMaxExperts) <= kSmemOptin, "v1 shared memory");
static_assert(smem_bytes_epiwg(3, kMaxExperts) <= kSmemOptin, "v2 shared memory");
static_assert(smem_bytes_epiwg(4, 1) > kSmemOptin, "4 stages + hand-off would fit: revisit");

struct F1Params {
  const bf16* x;               // [T, d]
  const int32_t* offsets;      // [E + 1]
  const int32_t* token_index;  // [N] token of each routed row
  bf16* out_a;                 // [N, ld] (first h columns)
  bf16* out_b;                 // [N, ld]
  bf16* out_u;                 // [N, ld]
  int ld;                      // elements between output rows (>= h, % 8 == 0)
  int d, h, E;
  int n_tiles;  // ceil(h / kBN)
  int k_tiles;  // ceil(d / kBK)
};

struct TileCoord {
  int e;
  int row0;  // first routed row of the tile
  int rows;  // valid rows (1..128)
  int n0;    // first column of h
};

#if MB_SM90_DEVICE

// The library's tile order (round 7's decode_tile<CLUSTER = 1>): tile_start[e] = first linear
// tile id of expert e (prefix of ceil(count_e / 128) * n_tiles); inside an expert, bands of 8
// m-tiles swept by the n-tiles.
__device__ __forceinline__ TileCoord decode_tile(int t, const int* tile_start, const F1Params& p) {
  int lo = 0, hi = p.E - 1;  // largest e with tile_start[e] <= t (it is never an empty expert)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int e = lo;
  const int off = __ldg(p.offsets + e);
  const int count = __ldg(p.offsets + e + 1) - off;
  const int m_tiles = (count + kBM - 1) / kBM;
  const int local = t - tile_start[e];
  const int band = local / (kBandMTiles * p.n_tiles);
  const int band_m0 = band * kBandMTiles;
  const int band_h = min(kBandMTiles, m_tiles - band_m0);
  const int r = local - band * kBandMTiles * p.n_tiles;
  const int m_tile = band_m0 + r % band_h;
  const int n_tile = r / band_h;
  TileCoord c;
  c.e = e;
  c.row0 = off + m_tile * kBM;
  c.rows = min(kBM, count - m_tile * kBM);
  c.n0 = n_tile * kBN;
  return c;
}

// tile_start[1..E] = tiles per expert, then the inclusive prefix (tile_start[0] = 0). Called by
// every thread of the block; ends with a block barrier.
__device__ __forceinline__ void build_tile_prefix(int* tile_start, const F1Params& p, int tid,
                                                  int nthreads, int warp, int lane) {
  for (int e = tid; e < p.E; e += nthreads) {
    const int count = __ldg(p.offsets + e + 1) - __ldg(p.offsets + e);
    tile_start[e + 1] = ((count + kBM - 1) / kBM) * p.n_tiles;
  }
  __syncthreads();
  if (warp == 0) warp_prefix_tiles(tile_start, p.E, lane);  // inclusive scan of tile_start[1..E]
  __syncthreads();
}

// The producer (round 1's): thread 0 issues the two TMA weight boxes of a stage, all PT threads
// gather the A rows with 16-byte cp.async (zero-filled past the expert's rows and past d) and
// arrive on the stage's full barrier when their copies land (.noinc). full[s] expects PT + 1
// arrivals (PT cp.async arrivals + thread 0's arrive.expect_tx of 32 KB). PT = 128 (kernel 1, the
// whole warpgroup 0: round 7's v1 code exactly, 8 rows per thread) or 64 (kernel 2, warps 0 and
// 1: 16 rows per thread, the same addresses in the same order per row).
template <int STAGES, int PT>
__device__ __forceinline__ void producer_loop(const CUtensorMap* tmap_gate,
                                              const CUtensorMap* tmap_up, const F1Params& p,
                                              uint8_t* smem, uint64_t* full_bar,
                                              uint64_t* empty_bar, int* tok_s,
                                              const int* tile_start, int total_tiles, int tid) {
  static_assert(PT == 128 || PT == 64, "producer threads");
  constexpr int kRowStep = PT / 8;  // rows per pass: 8 threads per 128-byte row slice
  const int chunk = tid & 7;        // 16-byte chunk of a 128-byte row slice
  const int row_base = tid >> 3;
  uint32_t it = 0;
  for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const TileCoord c = decode_tile(t, tile_start, p);
    // The tile's token ids go through shared memory (8 per thread would not fit in 40 registers).
    // Named barrier 1: the PT producer threads only.
    asm volatile("bar.sync 1, %0;\n" ::"n"(PT) : "memory");  // previous tile's ids no longer read
#pragma unroll
    for (int q = 0; q < kBM / PT; ++q) {
      const int r = tid + q * PT;
      tok_s[r] = r < c.rows ? __ldg(p.token_index + c.row0 + r) : -1;
    }
    asm volatile("bar.sync 1, %0;\n" ::"n"(PT) : "memory");
    for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
      const int s = it % STAGES;
      mbar_wait(smem_u32(empty_bar + s), ((it / STAGES) & 1) ^ 1);
      uint8_t* stage = smem + s * kStageBytes;
      const uint32_t full = smem_u32(full_bar + s);
      if (tid == 0) {
        mbar_arrive_expect_tx(full, 2 * kBTileBytes);  // both boxes count in full (zero-filled)
        tma_load_3d(smem_u32(stage + kATileBytes), tmap_gate, full, kt * kBK, c.n0, c.e);
        tma_load_3d(smem_u32(stage + kATileBytes + kBTileBytes), tmap_up, full, kt * kBK, c.n0,
                    c.e);
      }
      const int k = kt * kBK + chunk * 8;
      const bool k_ok = k < p.d;
      const uint32_t a_tile = smem_u32(stage);
#pragma unroll
      for (int i = 0; i < kBM / kRowStep; ++i) {
        const int r = row_base + kRowStep * i;
        const int tok = tok_s[r];
        const bool ok = k_ok && tok >= 0;
        const bf16* src = ok ? p.x + size_t(tok) * p.d + k : p.x;
        cp_async16_zfill(a_tile + r * 128 + ((chunk ^ (r & 7)) << 4), src, ok);
      }
      cp_async_mbar_arrive_noinc(full);
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// One tile's main loop of a consumer warpgroup (round 1's, every version): wait full[s], proxy
// fence (cp.async wrote A through the generic proxy, wgmma reads it through the async proxy),
// 4 x m64n256k16, commit, wait_group 1, release the previous stage (one arrival per warp:
// empty[s] expects 8). On return the tile's accumulators are final and every stage is released.
template <int STAGES>
__device__ __forceinline__ void consumer_mainloop(float (&acc)[128], uint32_t& it, int k_tiles,
                                                  uint8_t* smem, uint64_t* full_bar,
                                                  uint64_t* empty_bar, int wg, int lane) {
  int prev_s = 0;
  for (int kt = 0; kt < k_tiles; ++kt, ++it) {
    const int s = it % STAGES;
    mbar_wait(smem_u32(full_bar + s), (it / STAGES) & 1);
    fence_proxy_async();
    const uint32_t stage = smem_u32(smem + s * kStageBytes);
    const uint64_t desc_a = smem_desc_kmajor_sw128(stage + wg * (kATileBytes / 2));
    const uint64_t desc_b = smem_desc_kmajor_sw128(stage + kATileBytes);
    fence_accumulators(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      // +32 bytes per 16 k inside the swizzle row: +2 in the descriptor's address field.
      wgmma_m64n256k16<bf16, 0, 0>(acc, desc_a + 2 * kk, desc_b + 2 * kk,
                                   (kt > 0 || kk > 0) ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<1>();
    fence_accumulators(acc);
    if (kt > 0 && lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));
    prev_s = s;
  }
  wgmma_wait<0>();
  fence_accumulators(acc);
  if (lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));
}

// Round 12: GATHER = 1, the consumers gather their own 64 A rows (the library's F1 since round
// 11, primitives.cuh's HalfTileGather), STAGES - 1 k-steps ahead, on the warpgroup's own a_full
// barriers; the producer only issues the weight boxes (thread 0: b_producer_loop). full[s] then
// counts thread 0's expect_tx alone.
__device__ __forceinline__ void b_producer_loop(int stages, const CUtensorMap* tmap_gate,
                                                const CUtensorMap* tmap_up, const F1Params& p,
                                                uint8_t* smem, uint64_t* full_bar,
                                                uint64_t* empty_bar, const int* tile_start,
                                                int total_tiles) {
  uint32_t it = 0;
  for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const TileCoord c = decode_tile(t, tile_start, p);
    for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
      const int s = it % stages;
      mbar_wait(smem_u32(empty_bar + s), ((it / stages) & 1) ^ 1);
      uint8_t* stage = smem + s * kStageBytes;
      const uint32_t full = smem_u32(full_bar + s);
      mbar_arrive_expect_tx(full, 2 * kBTileBytes);
      tma_load_3d(smem_u32(stage + kATileBytes), tmap_gate, full, kt * kBK, c.n0, c.e);
      tma_load_3d(smem_u32(stage + kATileBytes + kBTileBytes), tmap_up, full, kt * kBK, c.n0, c.e);
    }
  }
}

// consumer_mainloop with the warpgroup's own gather (GATHER = 1): also waits its a_full[s], and
// after wait_group 1 refills the slot of the previous k-step with its A rows of k-step
// it + STAGES - 1.
template <int STAGES, class RowRange>
__device__ __forceinline__ void consumer_mainloop_gather(float (&acc)[128], uint32_t& it,
                                                         int k_tiles, uint8_t* smem,
                                                         uint64_t* full_bar, uint64_t* empty_bar,
                                                         uint64_t* my_a_full,
                                                         HalfTileGather<bf16>& gather,
                                                         RowRange& row_range, int wg, int lane) {
  int prev_s = 0;
  for (int kt = 0; kt < k_tiles; ++kt, ++it) {
    const int s = it % STAGES;
    mbar_wait(smem_u32(full_bar + s), (it / STAGES) & 1);
    mbar_wait(smem_u32(my_a_full + s), (it / STAGES) & 1);
    fence_proxy_async();
    const uint32_t stage = smem_u32(smem + s * kStageBytes);
    const uint64_t desc_a = smem_desc_kmajor_sw128(stage + wg * (kATileBytes / 2));
    const uint64_t desc_b = smem_desc_kmajor_sw128(stage + kATileBytes);
    fence_accumulators(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      wgmma_m64n256k16<bf16, 0, 0>(acc, desc_a + 2 * kk, desc_b + 2 * kk,
                                   (kt > 0 || kk > 0) ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<1>();
    fence_accumulators(acc);
    if (kt > 0 && lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));
    const int refill = int((it + STAGES - 1) % STAGES);
    gather.issue(smem_u32(smem + refill * kStageBytes), smem_u32(my_a_full + refill), row_range);
    prev_s = s;
  }
  wgmma_wait<0>();
  fence_accumulators(acc);
  if (lane == 0) mbar_arrive(smem_u32(empty_bar + prev_s));
}

#endif  // MB_SM90_DEVICE

enum : int {
  kEpiFull = 0,  // round 7's v1 epilogue (the library's): a, b, u staged per warp and stored
  kEpiNone = 1,  // probe: no epilogue (the main loop alone; writes nothing, never checked)
};

// ---------------------------------------------------------------------------------------------
// kernel 1 (v1, v3, v4, v5): round 7's v1 = the library's F1, with STAGES a parameter. The
// consumers run the epilogue after each tile's main loop (the tensor cores idle meanwhile).

template <int STAGES, int EPI, int GATHER = 0>
__global__ void __launch_bounds__(kThreads, 1)
    f1_sm90_kernel(const __grid_constant__ CUtensorMap tmap_gate,
                   const __grid_constant__ CUtensorMap tmap_up, const F1Params p) {
#if MB_SM90_DEVICE
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment (128B swizzle atoms) by an offset from smem_raw, so the compiler still
  // knows every derived pointer is shared memory (STS/LDS, not generic ST/LD).
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* epi = smem + STAGES * kStageBytes;
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(epi + kEpiBytes);
  uint64_t* empty_bar = full_bar + STAGES;
  uint64_t* a_full_bar = empty_bar + STAGES;                     // GATHER: [2][STAGES]
  int* tok_s = reinterpret_cast<int*>(a_full_bar + 2 * STAGES);  // [kBM]
  int* tile_start = tok_s + kBM;                                 // [E + 1]

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      // cp.async arrivals + expect_tx (GATHER: expect_tx alone)
      mbar_init(smem_u32(full_bar + s), GATHER ? 1 : kProducerThreads + 1);
      mbar_init(smem_u32(empty_bar + s), kConsumerWarps);
      mbar_init(smem_u32(a_full_bar + s), 128);
      mbar_init(smem_u32(a_full_bar + STAGES + s), 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  build_tile_prefix(tile_start, p, tid, kThreads, warp, lane);
  const int total_tiles = tile_start[p.E];

  if (warp < 4) {
    // ================= producer warpgroup =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegsWg0V1) : "memory");
    if constexpr (GATHER) {
      if (tid == 0)
        b_producer_loop(STAGES, &tmap_gate, &tmap_up, p, smem, full_bar, empty_bar, tile_start,
                        total_tiles);
    } else {
      producer_loop<STAGES, kProducerThreads>(&tmap_gate, &tmap_up, p, smem, full_bar, empty_bar,
                                              tok_s, tile_start, total_tiles, tid);
    }
  } else {
    // ================= consumer warpgroups =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegsConsumerV1) : "memory");
    const int wg = (warp >> 2) - 1;   // 0 or 1: rows [64 wg, 64 wg + 64) of the tile
    const int warp_in_wg = warp & 3;  // rows [16 warp_in_wg, +16) of the warpgroup's 64
    const int cw = warp - 4;
    uint32_t* stg = reinterpret_cast<uint32_t*>(epi + cw * kEpiWarpBytes);
    const int g = lane >> 2, t4 = lane & 3;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    auto row_range = [&](int t) {
      const TileCoord c = decode_tile(t, tile_start, p);
      return make_int2(c.row0, c.rows);
    };
    uint64_t* my_a_full = a_full_bar + wg * STAGES;
    HalfTileGather<bf16> gather(p.x, p.d, p.d, p.k_tiles, p.token_index, total_tiles, wg);
    if constexpr (GATHER) {
      gather.start(row_range);
      for (int s = 0; s < STAGES - 1; ++s)
        gather.issue(smem_u32(smem + s * kStageBytes), smem_u32(my_a_full + s), row_range);
    }
    uint32_t it = 0;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = decode_tile(t, tile_start, p);
      if constexpr (GATHER)
        consumer_mainloop_gather<STAGES>(acc, it, p.k_tiles, smem, full_bar, empty_bar, my_a_full,
                                         gather, row_range, wg, lane);
      else
        consumer_mainloop<STAGES>(acc, it, p.k_tiles, smem, full_bar, empty_bar, wg, lane);
      if (EPI == kEpiNone) {  // keep the accumulators live, or ptxas drops the wgmmas
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 128; ++i) sum += acc[i];
        if (sum == 1.2345e-30f) p.out_u[tid] = __float2bfloat16_rn(sum);  // practically never
        continue;
      }

      // ---- epilogue. Accumulator layout (wgmma m64nN, f32): register 4j + q of lane (g, t4)
      // holds row g (q < 2) or g + 8 (q >= 2), column 8j + 2 t4 + (q & 1); j < 16: a, j >= 16: b.
      const int tile_row = wg * 64 + warp_in_wg * 16;  // first tile row of this warp
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll 1  // one output per pass; unrolling it only raises register pressure
        for (int out = 0; out < 3; ++out) {
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const int j = half * 8 + jj;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
              const float ra0 = __bfloat162float(__float2bfloat16_rn(acc[4 * j + 2 * rr]));
              const float ra1 = __bfloat162float(__float2bfloat16_rn(acc[4 * j + 2 * rr + 1]));
              const float rb0 = __bfloat162float(__float2bfloat16_rn(acc[64 + 4 * j + 2 * rr]));
              const float rb1 = __bfloat162float(__float2bfloat16_rn(acc[64 + 4 * j + 2 * rr + 1]));
              uint32_t v;
              if (out == 0)
                v = pack2<bf16>(ra0, ra1);
              else if (out == 1)
                v = pack2<bf16>(rb0, rb1);
              else
                v = pack2<bf16>(act_u(ra0, rb0), act_u(ra1, rb1));
              const int row = g + 8 * rr;  // row & 7 == g
              stg[row * 32 + ((jj ^ g) << 2) + t4] = v;
            }
          }
          __syncwarp();
          bf16* dst_base = out == 0 ? p.out_a : (out == 1 ? p.out_b : p.out_u);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = i * 4 + (lane >> 3);
            const int ch = lane & 7;
            const uint4 v =
                *reinterpret_cast<const uint4*>(stg + row * 32 + ((ch ^ (row & 7)) << 2));
            const int col = c.n0 + half * 64 + ch * 8;
            if (tile_row + row < c.rows && col < p.h) {  // h % 8 == 0: a chunk is all in or out
              *reinterpret_cast<uint4*>(dst_base + size_t(c.row0 + tile_row + row) * p.ld + col) =
                  v;
            }
          }
          __syncwarp();
        }
      }
    }
  }
#else
  __trap();  // no sm_90a device pass (the #error above rejects any other device target)
#endif  // MB_SM90_DEVICE
}

// ---------------------------------------------------------------------------------------------
// kernel 2 (v2, and the v4 probe): the epilogue warps. Same tile order, main loop and consumer
// code as kernel 1, 3 stages; warpgroup 0 is split: warps 0, 1 produce (64 gathering threads),
// warps 2, 3 are the epilogue warps. After a tile's last wgmma the consumers round a, b into the
// shared hand-off buffer, arrive on handoff_full and go straight on to the next tile's main loop;
// the epilogue warps store a, b (TMA store; predicated 16-byte stores for a partial tile), compute
// u from the bf16 a, b in shared memory and store it, then release the buffer (handoff_empty).
// Barrier protocol, budgets and reasoning: see the header.
// EPI = kEpiNone (v4 probe): the consumers skip the hand-off and the epilogue warps do nothing.

template <int STAGES, int EPI, int GATHER = 0>
__global__ void __launch_bounds__(kThreads, 1)
    f1_epiwg_kernel(const __grid_constant__ CUtensorMap tmap_gate,
                    const __grid_constant__ CUtensorMap tmap_up,
                    const __grid_constant__ CUtensorMap tmap_out_a,
                    const __grid_constant__ CUtensorMap tmap_out_b, const F1Params p) {
#if MB_SM90_DEVICE
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* handoff = smem + STAGES * kStageBytes;  // 1024-byte aligned (48 KB stages)
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(handoff + kHandoffBytes);
  uint64_t* empty_bar = full_bar + STAGES;
  uint64_t* handoff_full = empty_bar + STAGES;
  uint64_t* handoff_empty = handoff_full + 1;
  uint64_t* a_full_bar = handoff_empty + 1;                      // GATHER: [2][STAGES]
  int* tok_s = reinterpret_cast<int*>(a_full_bar + 2 * STAGES);  // [kBM]
  int* tile_start = tok_s + kBM;                                 // [E + 1]

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      // cp.async arrivals + expect_tx (GATHER: expect_tx alone)
      mbar_init(smem_u32(full_bar + s), GATHER ? 1 : kEpiProducerThreads + 1);
      mbar_init(smem_u32(empty_bar + s), kConsumerWarps);
      mbar_init(smem_u32(a_full_bar + s), 128);
      mbar_init(smem_u32(a_full_bar + STAGES + s), 128);
    }
    mbar_init(smem_u32(handoff_full), kConsumerWarps);  // one arrival per consumer warp
    mbar_init(smem_u32(handoff_empty), kEpiWarps);      // one arrival per epilogue warp
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  build_tile_prefix(tile_start, p, tid, kThreads, warp, lane);
  const int total_tiles = tile_start[p.E];
  uint32_t* hb = reinterpret_cast<uint32_t*>(handoff);  // the hand-off buffer as 32-bit words

  if (warp < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegsWg0) : "memory");
    if (warp < 2) {
      // ================= producer warps 0, 1 (GATHER: thread 0 alone, the weight boxes) =====
      if constexpr (GATHER) {
        if (tid == 0)
          b_producer_loop(STAGES, &tmap_gate, &tmap_up, p, smem, full_bar, empty_bar, tile_start,
                          total_tiles);
      } else {
        producer_loop<STAGES, kEpiProducerThreads>(&tmap_gate, &tmap_up, p, smem, full_bar,
                                                   empty_bar, tok_s, tile_start, total_tiles, tid);
      }
    } else if (EPI != kEpiNone) {
      // ================= epilogue warps 2, 3 =================
      const int ew = warp - 2;                   // 0 or 1
      const bool issuer = tid == kEpiIssuerTid;  // issues (and alone waits for) the TMA stores
      uint32_t n = 0;                            // this CTA's tiles so far: hand-off phase n
      for (int t = blockIdx.x; t < total_tiles; t += gridDim.x, ++n) {
        const TileCoord c = decode_tile(t, tile_start, p);
        mbar_wait(smem_u32(handoff_full), n & 1);
        // a and b: a whole tile by TMA store. The map's dimensions are {h, N}, so the TMA unit
        // clips columns past h; rows need no clipping because all 128 rows of a whole tile
        // belong to its expert. A partial tile (its last rows belong to the next expert, or lie
        // past N) takes the predicated 16-byte stores below instead: a TMA store can only clip at
        // the map's bounds, and a map per expert would need the offsets on the host.
        const bool tma_ab = c.rows == kBM;
        if (tma_ab && issuer) {
#pragma unroll
          for (int sub = 0; sub < 4; ++sub) {
            const int col = c.n0 + (sub & 1) * 64;
            if (col < p.h)  // a box wholly past h is not issued
              tma_store_2d(sub < 2 ? &tmap_out_a : &tmap_out_b,
                           smem_u32(handoff + sub * kHandoffSubBytes), col, c.row0);
          }
          bulk_commit_group();
        }
        // u (and a, b of a partial tile): a lane reads 16-byte chunk (lane & 7) of row
        // 8 i + 4 ew + (lane >> 3) of a and of b at the same offset (the four sub-tiles share one
        // layout), so a warp instruction covers 4 rows x 128 contiguous bytes: conflict-free
        // 16-byte shared loads (an 8-lane phase reads one 128-byte row) and whole-line 16-byte
        // global stores.
#pragma unroll 2
        for (int i = 0; i < 2 * kBM / 8; ++i) {
          const int half = i / (kBM / 8);
          const int row = (i % (kBM / 8)) * 8 + ew * 4 + (lane >> 3);
          const int ch = lane & 7;
          const int col = c.n0 + half * 64 + ch * 8;
          if (row < c.rows && col < p.h) {
            const int word = half * kHandoffSubWords + row * 32 + ((ch ^ (row & 7)) << 2);
            const uint4 av = *reinterpret_cast<const uint4*>(hb + word);
            const uint4 bv = *reinterpret_cast<const uint4*>(hb + 2 * kHandoffSubWords + word);
            const size_t off = size_t(c.row0 + row) * p.ld + col;
            if (!tma_ab) {
              *reinterpret_cast<uint4*>(p.out_a + off) = av;
              *reinterpret_cast<uint4*>(p.out_b + off) = bv;
            }
            uint4 uv;
            uv.x = act_pair(av.x, bv.x);
            uv.y = act_pair(av.y, bv.y);
            uv.z = act_pair(av.z, bv.z);
            uv.w = act_pair(av.w, bv.w);
            *reinterpret_cast<uint4*>(p.out_u + off) = uv;
          }
        }
        // Release the buffer: the TMA unit must have finished READING it (the issuer's bulk
        // groups), and every lane its shared loads (__syncwarp orders them before lane 0's
        // arrival, which releases them to the consumers' acquiring wait).
        if (issuer) bulk_wait_group_read<0>();
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_u32(handoff_empty));
      }
      // The last stores' global writes must be complete before the kernel ends, and their
      // shared-memory source must stay valid until then.
      if (issuer) bulk_wait_group<0>();
    }
  } else {
    // ================= consumer warpgroups =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegsConsumer) : "memory");
    const int wg = (warp >> 2) - 1;   // 0 or 1: rows [64 wg, 64 wg + 64) of the tile
    const int warp_in_wg = warp & 3;  // rows [16 warp_in_wg, +16) of the warpgroup's 64
    const int g = lane >> 2, t4 = lane & 3;
    const int tile_row = wg * 64 + warp_in_wg * 16;  // first tile row of this warp
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    auto row_range = [&](int t) {
      const TileCoord c = decode_tile(t, tile_start, p);
      return make_int2(c.row0, c.rows);
    };
    uint64_t* my_a_full = a_full_bar + wg * STAGES;
    HalfTileGather<bf16> gather(p.x, p.d, p.d, p.k_tiles, p.token_index, total_tiles, wg);
    if constexpr (GATHER) {
      gather.start(row_range);
      for (int s = 0; s < STAGES - 1; ++s)
        gather.issue(smem_u32(smem + s * kStageBytes), smem_u32(my_a_full + s), row_range);
    }
    uint32_t it = 0;
    uint32_t n = 0;  // this CTA's tiles so far: hand-off phase n
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x, ++n) {
      if constexpr (GATHER)
        consumer_mainloop_gather<STAGES>(acc, it, p.k_tiles, smem, full_bar, empty_bar, my_a_full,
                                         gather, row_range, wg, lane);
      else
        consumer_mainloop<STAGES>(acc, it, p.k_tiles, smem, full_bar, empty_bar, wg, lane);
      if (EPI == kEpiNone) {  // probe: keep the accumulators live, or ptxas drops the wgmmas
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 128; ++i) sum += acc[i];
        if (sum == 1.2345e-30f) p.out_u[tid] = __float2bfloat16_rn(sum);  // practically never
        continue;
      }
      // The epilogue warps have released the previous tile's buffer (phase n - 1 of
      // handoff_empty; for n = 0 the wait on parity 1 of a fresh barrier returns at once).
      mbar_wait(smem_u32(handoff_empty), (n & 1) ^ 1);
      // Register 4j + q of lane (g, t4): row g + 8 (q >> 1), column 8j + 2 t4 + (q & 1) of the 256
      // B-columns; j < 16: a, j >= 16: b. 8-column group j lands in sub-tile j >> 3 (a lo, a hi,
      // b lo, b hi) as 16-byte chunk j & 7. Per warp instruction (fixed j, rr) the 8 rows g of a
      // quad set hit chunks (j & 7) ^ g: 8 distinct chunks x 4 words = 32 distinct banks.
      // pack2 rounds each fp32 accumulator to bf16 once, as v1's epilogue does.
#pragma unroll
      for (int j = 0; j < 32; ++j) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int row = tile_row + g + 8 * rr;  // row & 7 == g
          hb[(j >> 3) * kHandoffSubWords + row * 32 + (((j & 7) ^ g) << 2) + t4] =
              pack2<bf16>(acc[4 * j + 2 * rr], acc[4 * j + 2 * rr + 1]);
        }
      }
      // Generic-proxy writes -> the TMA unit's async-proxy reads: each writing thread fences its
      // own writes, then the warp's arrival (release) publishes them; the issuer's wait
      // (acquire) precedes its TMA store.
      fence_proxy_async();
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_u32(handoff_full));
    }
  }
#else
  __trap();  // no sm_90a device pass (the #error above rejects any other device target)
#endif  // MB_SM90_DEVICE
}

// ---------------------------------------------------------------------------------------------
// kernel 0: SIMT fp32 reference (device oracle). 64x64 tiles of (routed rows) x (h columns),
// computing a and b unrounded in fp32.

constexpr int kRefTile = 64, kRefK = 16;

__global__ void __launch_bounds__(256)
    f1_reference_kernel(const bf16* x, const int32_t* offsets, const int32_t* token_index,
                        const bf16* w_gate, const bf16* w_up, int N, int d, int h, int E,
                        float* ref_a, float* ref_b) {
  __shared__ float xs[kRefK][kRefTile];
  __shared__ float gs[kRefK][kRefTile + 1];
  __shared__ float us[kRefK][kRefTile + 1];
  __shared__ int tok_s[kRefTile], exp_s[kRefTile];
  const int row0 = blockIdx.y * kRefTile, n0 = blockIdx.x * kRefTile;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  // The tile's rows may span several experts: each row carries its own expert.
  if (tid < kRefTile) {
    const int r = row0 + tid;
    int e = -1;
    if (r < N) {
      int lo = 0, hi = E - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (offsets[mid] <= r)
          lo = mid;
        else
          hi = mid - 1;
      }
      e = lo;
    }
    tok_s[tid] = r < N ? token_index[r] : 0;
    exp_s[tid] = e;
  }
  __syncthreads();
  // Experts present in this tile: the weights differ per row, so accumulate per (row, col) with
  // the row's own expert. Group rows by expert: loop over the distinct experts in the tile.
  float acc_a[4][4] = {}, acc_b[4][4] = {};
  const int e_first = exp_s[0], e_last = exp_s[min(kRefTile, N - row0) - 1];
  for (int e = e_first; e <= e_last; ++e) {
    for (int k0 = 0; k0 < d; k0 += kRefK) {
      for (int i = tid; i < kRefK * kRefTile; i += 256) {
        const int rr = i / kRefK, kk = i % kRefK;
        const int k = k0 + kk;
        const bool ok = exp_s[rr] == e && k < d;
        xs[kk][rr] = ok ? __bfloat162float(x[size_t(tok_s[rr]) * d + k]) : 0.f;
        const int n = n0 + rr;
        const bool okw = n < h && k < d;
        gs[kk][rr] = okw ? __bfloat162float(w_gate[(size_t(e) * h + n) * d + k]) : 0.f;
        us[kk][rr] = okw ? __bfloat162float(w_up[(size_t(e) * h + n) * d + k]) : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kRefK; ++kk) {
        float xv[4], gv[4], uv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[i] = xs[kk][ty * 4 + i];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          gv[j] = gs[kk][tx * 4 + j];
          uv[j] = us[kk][tx * 4 + j];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            acc_a[i][j] = fmaf(xv[i], gv[j], acc_a[i][j]);
            acc_b[i][j] = fmaf(xv[i], uv[j], acc_b[i][j]);
          }
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = row0 + ty * 4 + i, n = n0 + tx * 4 + j;
      if (r < N && n < h) {
        ref_a[size_t(r) * h + n] = acc_a[i][j];
        ref_b[size_t(r) * h + n] = acc_b[i][j];
      }
    }
}

// ---------------------------------------------------------------------------------------------
// device utilities: random fill, poison, full comparison, checksum

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_normal_bf16(bf16* out, size_t n, uint64_t seed, float stddev) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(seed * 0x100000001b3ull + i);
    const float u1 = (float((r >> 40) & 0xffffff) + 0.5f) * (1.f / 16777216.f);
    const float u2 = float((r >> 16) & 0xffffff) * (1.f / 16777216.f);
    const float z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    out[i] = __float2bfloat16_rn(z * stddev);
  }
}

// ---------------------------------------------------------------------------------------------
// device utilities: full comparison with the oracle, bitwise comparison, padding, checksum

// The oracle's u: the contract's accurate silu (the CPU's formula) from the rounded a, b; the
// kernels use the MUFU form, within the tolerance below.
__device__ __forceinline__ float silu_ref(float a) {
  return a * (1.f / (1.f + expf(-a)));
}

struct CompareResult {
  unsigned long long nonfinite[3];  // a, b, u (poison 0xFFFF is a NaN: counts unwritten too)
  unsigned long long mismatches[3];
  double err2[3], ref2[3];
  float max_abs[3];
};

__device__ __forceinline__ void atomic_max_float(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));  // v >= 0
}

// Every element (r < N, n < h) of a, b, u (row stride ld) against the oracle's [N, h] a, b.
__global__ void compare_kernel(const bf16* a, const bf16* b, const bf16* u, const float* ref_a,
                               const float* ref_b, int N, int h, int ld, CompareResult* res) {
  double e2[3] = {0, 0, 0}, r2[3] = {0, 0, 0};
  unsigned long long nf[3] = {0, 0, 0}, mm[3] = {0, 0, 0};
  float mx[3] = {0, 0, 0};
  const size_t count = size_t(N) * h;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / h, n = i - r * h, o = r * ld + n;
    const float ga = __bfloat162float(a[o]), gb = __bfloat162float(b[o]),
                gu = __bfloat162float(u[o]);
    const float ra = ref_a[i], rb = ref_b[i];
    const float rar = __bfloat162float(__float2bfloat16_rn(ra));
    const float rbr = __bfloat162float(__float2bfloat16_rn(rb));
    const float ru = __bfloat162float(__float2bfloat16_rn(silu_ref(rar) * rbr));
    const float got[3] = {ga, gb, gu}, ref[3] = {ra, rb, ru};
    // a, b: bf16 rounding (<= 2^-9 relative) plus summation-order noise; u: a rounding flip of a or
    // b moves u by about one bf16 ulp of a*b.
    const float tol[3] = {ldexpf(fabsf(ra), -7) + 1e-4f, ldexpf(fabsf(rb), -7) + 1e-4f,
                          ldexpf(fabsf(ra * rb), -5) + ldexpf(fabsf(ru), -7) + 1e-4f};
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      if (!isfinite(got[q])) {
        ++nf[q];
        continue;
      }
      const float diff = fabsf(got[q] - ref[q]);
      if (!(diff <= tol[q])) ++mm[q];
      e2[q] += double(diff) * diff;
      r2[q] += double(ref[q]) * ref[q];
      mx[q] = fmaxf(mx[q], diff);
    }
  }
#pragma unroll
  for (int q = 0; q < 3; ++q) {
    atomicAdd(&res->nonfinite[q], nf[q]);
    atomicAdd(&res->mismatches[q], mm[q]);
    atomicAdd(&res->err2[q], e2[q]);
    atomicAdd(&res->ref2[q], r2[q]);
    atomic_max_float(&res->max_abs[q], mx[q]);
  }
}

// Bitwise comparison of two whole output allocations (padding included): the number of differing
// 16-bit elements and the lowest differing index.
struct DiffResult {
  unsigned long long count;
  unsigned long long first;
};

__global__ void diff_kernel(const uint16_t* x, const uint16_t* y, size_t n, DiffResult* res) {
  unsigned long long c = 0, first = ~0ull;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    if (x[i] != y[i]) {
      ++c;
      first = min(first, (unsigned long long)i);
    }
  }
  if (c) {
    atomicAdd(&res->count, c);
    atomicMin(&res->first, first);
  }
}

// Elements outside [N, h] (columns h..ld-1 of every row, and the padding rows past N) that are
// no longer the poison 0xFFFF: a store that should have been clipped or predicated off.
__global__ void padding_kernel(const uint16_t* x, int N, int h, int ld, size_t n,
                               unsigned long long* bad) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / ld, col = i - r * ld;
    if ((r >= size_t(N) || col >= size_t(h)) && x[i] != 0xFFFFu) ++c;
  }
  if (c) atomicAdd(bad, c);
}

__global__ void checksum_kernel(const uint32_t* words, size_t n, unsigned long long* out) {
  unsigned long long s = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    s += (unsigned long long)(words[i]) * (2 * (i & 0xffff) + 1);
  atomicAdd(out, s);
}

// ---------------------------------------------------------------------------------------------
// host: tensor maps and launchers

// primitives.cuh's tensor_map_encoder(): cuTensorMapEncodeTiled from the driver through the
// runtime's entry-point query (no libcuda link); nullptr if the query fails.
static EncodeTiledFn get_encoder() {
  const EncodeTiledFn fn = tensor_map_encoder();
  REQUIRE(fn != nullptr, "cuTensorMapEncodeTiled not found (driver entry-point query failed)");
  return fn;
}

static CUtensorMap encode_2d_or_3d(const bf16* base, int rank, const cuuint64_t* dims,
                                   const cuuint64_t* strides, const cuuint32_t* box,
                                   CUtensorMapL2promotion promo) {
  CUtensorMap map;
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = get_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, cuuint32_t(rank),
                                   const_cast<bf16*>(base), dims, strides, box, elem,
                                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
                                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  REQUIRE(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (%d)", int(r));
  return map;
}

// Weights [E, h, d] bf16 as a 3-D tensor (d fastest); box = 64 k x 128 rows x 1 expert, 128B
// swizzle; rows past h and k past d read as zeros (never the next expert's rows).
static CUtensorMap make_weight_map(const bf16* w, int E, int h, int d) {
  const cuuint64_t dims[3] = {cuuint64_t(d), cuuint64_t(h), cuuint64_t(E)};
  const cuuint64_t strides[2] = {cuuint64_t(d) * 2, cuuint64_t(h) * d * 2};
  const cuuint32_t box[3] = {kBK, kBN, 1};
  return encode_2d_or_3d(w, 3, dims, strides, box, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

// v2's output map (a or b): [N, h] with row stride ld elements, box = 64 columns x 128 rows, 128B
// swizzle (the hand-off buffer's layout). A store clips columns past h and rows past N.
static CUtensorMap make_output_map(const bf16* out, int N, int h, int ld) {
  const cuuint64_t dims[2] = {cuuint64_t(h), cuuint64_t(N)};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * 2};
  const cuuint32_t box[2] = {64, kBM};
  return encode_2d_or_3d(out, 2, dims, strides, box, CU_TENSOR_MAP_L2_PROMOTION_NONE);
}

struct F1Problem {
  int T, d, h, E, k, N;
  int ld;                          // output row stride (h + the shape's column padding)
  size_t out_elems;                // (N + kPadRows) * ld per output
  bf16 *x, *w_gate, *w_up;         // device
  int32_t *offsets, *token_index;  // device
  bf16 *a, *b, *u;                 // device outputs
  std::vector<int32_t> h_offsets, h_tokens;
};

// Rows past N in every output allocation: must stay poisoned (a store past the last expert's
// rows, e.g. an unclipped TMA box of its partial last tile, lands there).
constexpr int kPadRows = 128;

static int g_num_sms = 0;

struct Maps {
  CUtensorMap gate, up, out_a, out_b;
};

template <int STAGES, int EPI, int GATHER = 0>
static void launch_v1style(const Maps& M, const F1Params& p, size_t smem, cudaStream_t stream) {
  static bool printed = false;
  if (!printed) {
    printed = true;
    printf(
        "  (kernel 1: %d stages, epilogue %s, A gathered by the %s: grid %d x %d threads, %zu B "
        "shared memory)\n",
        STAGES, EPI == kEpiFull ? "in the consumers" : "none (probe)",
        GATHER ? "consumers" : "producer", g_num_sms, kThreads, smem);
  }
  f1_sm90_kernel<STAGES, EPI, GATHER><<<g_num_sms, kThreads, smem, stream>>>(M.gate, M.up, p);
}

template <int STAGES, int EPI, int GATHER = 0>
static void launch_epiwg(const Maps& M, const F1Params& p, size_t smem, cudaStream_t stream) {
  static bool printed = false;
  if (!printed) {
    printed = true;
    printf(
        "  (kernel 2: %d stages, %s + 2 epilogue warps%s: grid %d x %d threads, %zu B "
        "shared memory)\n",
        STAGES, GATHER ? "1 weight-box thread, consumers gather A" : "2 producer warps",
        EPI == kEpiFull ? "" : ", no epilogue (probe)", g_num_sms, kThreads, smem);
  }
  f1_epiwg_kernel<STAGES, EPI, GATHER>
      <<<g_num_sms, kThreads, smem, stream>>>(M.gate, M.up, M.out_a, M.out_b, p);
}

constexpr int kNumVersions = 10;  // kernel versions 1..kNumVersions
// Timing probes (a main loop alone, v4-v6, v9, v10): timed and smoke-run, never checked.
static bool is_probe(int version) {
  return (version >= 4 && version <= 6) || version >= 9;
}

static void f1_run(int version, const F1Problem& P, const Maps& M, cudaStream_t stream) {
  F1Params p;
  p.x = P.x;
  p.offsets = P.offsets;
  p.token_index = P.token_index;
  p.out_a = P.a;
  p.out_b = P.b;
  p.out_u = P.u;
  p.ld = P.ld;
  p.d = P.d;
  p.h = P.h;
  p.E = P.E;
  p.n_tiles = (P.h + kBN - 1) / kBN;
  p.k_tiles = (P.d + kBK - 1) / kBK;
  switch (version) {
    case 1: launch_v1style<4, kEpiFull>(M, p, smem_bytes_v1(4, P.E), stream); break;
    case 2: launch_epiwg<3, kEpiFull>(M, p, smem_bytes_epiwg(3, P.E), stream); break;
    case 3: launch_v1style<3, kEpiFull>(M, p, smem_bytes_v1(3, P.E), stream); break;
    case 4: launch_epiwg<3, kEpiNone>(M, p, smem_bytes_epiwg(3, P.E), stream); break;
    case 5: launch_v1style<3, kEpiNone>(M, p, smem_bytes_v1(3, P.E), stream); break;
    case 6: launch_v1style<4, kEpiNone>(M, p, smem_bytes_v1(4, P.E), stream); break;
    // round 12: the consumers gather A (GATHER = 1)
    case 7: launch_v1style<4, kEpiFull, 1>(M, p, smem_bytes_v1(4, P.E), stream); break;
    case 8: launch_epiwg<3, kEpiFull, 1>(M, p, smem_bytes_epiwg(3, P.E), stream); break;
    case 9: launch_epiwg<3, kEpiNone, 1>(M, p, smem_bytes_epiwg(3, P.E), stream); break;
    case 10: launch_v1style<4, kEpiNone, 1>(M, p, smem_bytes_v1(4, P.E), stream); break;
    default: REQUIRE(false, "unknown kernel version %d", version);
  }
  CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------
// problems

struct Shape {
  const char* name;
  int T, d, h, E, k;
  int ld_pad;       // output columns past h (poisoned, must stay so)
  bool in_default;  // checked (and timed, unless edge / tiny) when no --shape is given
};

static const Shape kShapes[] = {
    // k tail (d % 64 != 0), n tail (h % 128 = 8: the last n-tile's first TMA box is clipped at
    // column 264, its second box is not issued), ragged experts (every expert's last m-tile is
    // partial), an empty expert, full tiles (the TMA-store path)
    {"edge", 3001, 200, 264, 7, 2, 24, true},
    // fewer tiles than SMs (most CTAs idle), every tile partial (v2: only the fallback stores),
    // k_tiles = 2 < stages
    {"tiny", 50, 72, 136, 3, 2, 8, true},
    {"conf3", 65536, 1024, 4096, 16, 4, 0, true},
    {"conf4", 32768, 2048, 8192, 16, 4, 0, false},
    {"mixtral", 16384, 4096, 14336, 8, 2, 0, true},
    {"qwen", 32768, 2048, 768, 128, 8, 0, true},
};

// Uneven routing: expert weights 1..5 cyclically, expert 1 gets no tokens; each token picks k
// distinct experts. Rows are grouped by expert, tokens ascending inside an expert.
static void make_routing(const Shape& s, uint64_t seed, std::vector<int32_t>& offsets,
                         std::vector<int32_t>& tokens) {
  std::mt19937_64 rng(seed);
  std::vector<double> weight(s.E);
  for (int e = 0; e < s.E; ++e) weight[e] = 1.0 + (e * 7 % 5);
  if (s.E > s.k + 1) weight[1] = 0.0;  // an empty expert
  std::vector<std::vector<int32_t>> rows(s.E);
  std::vector<double> w(s.E);
  for (int t = 0; t < s.T; ++t) {
    w = weight;
    for (int j = 0; j < s.k; ++j) {
      double total = 0;
      for (double v : w) total += v;
      double r = std::uniform_real_distribution<double>(0, total)(rng);
      int e = 0;
      for (; e < s.E - 1; ++e) {
        if (w[e] > 0 && r < w[e]) break;
        r -= w[e];
      }
      while (w[e] == 0) e = (e + s.E - 1) % s.E;  // rounding at the end of the range
      rows[e].push_back(t);
      w[e] = 0;
    }
  }
  offsets.assign(s.E + 1, 0);
  tokens.clear();
  for (int e = 0; e < s.E; ++e) {
    offsets[e + 1] = offsets[e] + int(rows[e].size());
    tokens.insert(tokens.end(), rows[e].begin(), rows[e].end());
  }
}

static void fill(bf16* p, size_t n, uint64_t seed, float stddev) {
  fill_normal_bf16<<<4 * g_num_sms, 256>>>(p, n, seed, stddev);
  CUDA_CHECK(cudaGetLastError());
}

static F1Problem make_problem(const Shape& s, uint64_t seed) {
  F1Problem P;
  P.T = s.T;
  P.d = s.d;
  P.h = s.h;
  P.E = s.E;
  P.k = s.k;
  P.N = s.T * s.k;
  P.ld = s.h + s.ld_pad;
  P.out_elems = size_t(P.N + kPadRows) * P.ld;
  make_routing(s, seed, P.h_offsets, P.h_tokens);
  CUDA_CHECK(cudaMalloc(&P.x, size_t(P.T) * P.d * 2));
  CUDA_CHECK(cudaMalloc(&P.w_gate, size_t(P.E) * P.h * P.d * 2));
  CUDA_CHECK(cudaMalloc(&P.w_up, size_t(P.E) * P.h * P.d * 2));
  CUDA_CHECK(cudaMalloc(&P.offsets, sizeof(int32_t) * (P.E + 1)));
  CUDA_CHECK(cudaMalloc(&P.token_index, sizeof(int32_t) * P.N));
  CUDA_CHECK(cudaMalloc(&P.a, P.out_elems * 2));
  CUDA_CHECK(cudaMalloc(&P.b, P.out_elems * 2));
  CUDA_CHECK(cudaMalloc(&P.u, P.out_elems * 2));
  fill(P.x, size_t(P.T) * P.d, seed * 3 + 1, 1.f);
  const float wstd = 1.f / std::sqrt(float(P.d));
  fill(P.w_gate, size_t(P.E) * P.h * P.d, seed * 3 + 2, wstd);
  fill(P.w_up, size_t(P.E) * P.h * P.d, seed * 3 + 3, wstd);
  CUDA_CHECK(cudaMemcpy(P.offsets, P.h_offsets.data(), sizeof(int32_t) * (P.E + 1),
                        cudaMemcpyHostToDevice));
  CUDA_CHECK(
      cudaMemcpy(P.token_index, P.h_tokens.data(), sizeof(int32_t) * P.N, cudaMemcpyHostToDevice));
  return P;
}

static void free_problem(F1Problem& P) {
  cudaFree(P.x);
  cudaFree(P.w_gate);
  cudaFree(P.w_up);
  cudaFree(P.offsets);
  cudaFree(P.token_index);
  cudaFree(P.a);
  cudaFree(P.b);
  cudaFree(P.u);
}

static void poison_outputs(const F1Problem& P) {
  const size_t bytes = P.out_elems * 2;
  CUDA_CHECK(cudaMemset(P.a, 0xFF, bytes));  // 0xFFFF: a bf16 NaN
  CUDA_CHECK(cudaMemset(P.b, 0xFF, bytes));
  CUDA_CHECK(cudaMemset(P.u, 0xFF, bytes));
}

static unsigned long long checksum(const F1Problem& P) {
  unsigned long long* d_sum;
  CUDA_CHECK(cudaMalloc(&d_sum, sizeof(unsigned long long)));
  CUDA_CHECK(cudaMemset(d_sum, 0, sizeof(unsigned long long)));
  const size_t words = P.out_elems / 2;  // ld even
  for (bf16* o : {P.a, P.b, P.u})
    checksum_kernel<<<4 * g_num_sms, 256>>>(reinterpret_cast<const uint32_t*>(o), words, d_sum);
  CUDA_CHECK(cudaGetLastError());
  unsigned long long s;
  CUDA_CHECK(cudaMemcpy(&s, d_sum, sizeof(s), cudaMemcpyDeviceToHost));
  cudaFree(d_sum);
  return s;
}

// ---------------------------------------------------------------------------------------------
// checks

// The references of one problem, computed once and shared by every kernel version:
//  - the SIMT fp32 device oracle (kernel 0) for every element;
//  - the CPU fp64 reference for sampled rows (first, last and a random row of every non-empty
//    expert, at most 96), all columns, and the oracle's rows for the same sample;
//  - v1's outputs (whole allocations, padding included): the bitwise oracle of v2 and v3.
struct Reference {
  float* ref_a = nullptr;  // [N, h] device
  float* ref_b = nullptr;  // [N, h] device
  std::vector<int> rows;
  std::vector<float> cpu_a, cpu_b;                         // [rows, h]
  double oracle_rel = 0;                                   // oracle vs CPU on the sampled rows
  bf16 *v1_a = nullptr, *v1_b = nullptr, *v1_u = nullptr;  // device, out_elems each
};

static Reference build_reference(F1Problem& P) {
  Reference R;
  const size_t count = size_t(P.N) * P.h;
  CUDA_CHECK(cudaMalloc(&R.ref_a, count * 4));
  CUDA_CHECK(cudaMalloc(&R.ref_b, count * 4));
  dim3 rgrid((P.h + kRefTile - 1) / kRefTile, (P.N + kRefTile - 1) / kRefTile);
  f1_reference_kernel<<<rgrid, 256>>>(P.x, P.offsets, P.token_index, P.w_gate, P.w_up, P.N, P.d,
                                      P.h, P.E, R.ref_a, R.ref_b);
  CUDA_CHECK(cudaGetLastError());

  std::mt19937 rng(1234);
  for (int e = 0; e < P.E; ++e) {
    const int lo = P.h_offsets[e], hi = P.h_offsets[e + 1];
    if (hi == lo) continue;
    R.rows.push_back(lo);
    R.rows.push_back(hi - 1);
    R.rows.push_back(lo + int(rng() % unsigned(hi - lo)));
  }
  std::sort(R.rows.begin(), R.rows.end());
  R.rows.erase(std::unique(R.rows.begin(), R.rows.end()), R.rows.end());
  if (R.rows.size() > 96) {  // keep the CPU time bounded on many-expert shapes
    std::vector<int> keep;
    for (size_t i = 0; i < R.rows.size(); i += (R.rows.size() + 95) / 96) keep.push_back(R.rows[i]);
    R.rows = keep;
  }
  std::vector<uint16_t> hx(size_t(P.T) * P.d), hg(size_t(P.E) * P.h * P.d),
      hu(size_t(P.E) * P.h * P.d);
  CUDA_CHECK(cudaMemcpy(hx.data(), P.x, hx.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(hg.data(), P.w_gate, hg.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(hu.data(), P.w_up, hu.size() * 2, cudaMemcpyDeviceToHost));
  const size_t nr = R.rows.size();
  R.cpu_a.resize(nr * P.h);
  R.cpu_b.resize(nr * P.h);
  {
    const unsigned nthreads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
    std::vector<std::thread> pool;
    for (unsigned w = 0; w < nthreads; ++w)
      pool.emplace_back([&, w] {
        for (size_t i = w; i < nr; i += nthreads) {
          const int r = R.rows[i];
          int e = 0;
          while (P.h_offsets[e + 1] <= r) ++e;
          f1_row_cpu(&hx[size_t(P.h_tokens[r]) * P.d], &hg[size_t(e) * P.h * P.d],
                     &hu[size_t(e) * P.h * P.d], P.d, P.h, &R.cpu_a[i * P.h], &R.cpu_b[i * P.h]);
        }
      });
    for (auto& t : pool) t.join();
  }
  std::vector<float> or_a(P.h), or_b(P.h);
  double oe2 = 0, or2 = 0;
  for (size_t i = 0; i < nr; ++i) {
    const size_t r = R.rows[i];
    CUDA_CHECK(cudaMemcpy(or_a.data(), R.ref_a + r * P.h, P.h * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(or_b.data(), R.ref_b + r * P.h, P.h * 4, cudaMemcpyDeviceToHost));
    for (int n = 0; n < P.h; ++n) {
      const double ra = R.cpu_a[i * P.h + n], rb = R.cpu_b[i * P.h + n];
      oe2 += (or_a[n] - ra) * (or_a[n] - ra) + (or_b[n] - rb) * (or_b[n] - rb);
      or2 += ra * ra + rb * rb;
    }
  }
  R.oracle_rel = std::sqrt(oe2 / std::max(or2, 1e-300));
  return R;
}

// v1's outputs of this problem (poisoned first), kept as the bitwise reference of v2 and v3.
static void build_v1_outputs(F1Problem& P, const Maps& M, Reference& R) {
  const size_t bytes = P.out_elems * 2;
  CUDA_CHECK(cudaMalloc(&R.v1_a, bytes));
  CUDA_CHECK(cudaMalloc(&R.v1_b, bytes));
  CUDA_CHECK(cudaMalloc(&R.v1_u, bytes));
  poison_outputs(P);
  f1_run(1, P, M, 0);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(R.v1_a, P.a, bytes, cudaMemcpyDeviceToDevice));
  CUDA_CHECK(cudaMemcpy(R.v1_b, P.b, bytes, cudaMemcpyDeviceToDevice));
  CUDA_CHECK(cudaMemcpy(R.v1_u, P.u, bytes, cudaMemcpyDeviceToDevice));
}

static void free_reference(Reference& R) {
  cudaFree(R.ref_a);
  cudaFree(R.ref_b);
  if (R.v1_a) cudaFree(R.v1_a);
  if (R.v1_b) cudaFree(R.v1_b);
  if (R.v1_u) cudaFree(R.v1_u);
}

// One kernel version on one problem: poison, run, then
// 1) every element against the device oracle (NaN / unwritten counted);
// 2) the padding (columns past h, rows past N) still poisoned;
// 3) the sampled rows against the CPU fp64 reference (and the oracle against the CPU);
// 4) v2, v3 (and any version but 1): a, b, u bitwise equal to v1's, every element;
// 5) determinism: a second run gives bitwise the same a, b, u.
static bool check_problem(int version, const Shape& s, F1Problem& P, const Maps& M,
                          const Reference& R) {
  bool ok = true;
  poison_outputs(P);
  f1_run(version, P, M, 0);
  CUDA_CHECK(cudaDeviceSynchronize());

  CompareResult* d_res;
  CUDA_CHECK(cudaMalloc(&d_res, sizeof(CompareResult)));
  CUDA_CHECK(cudaMemset(d_res, 0, sizeof(CompareResult)));
  compare_kernel<<<8 * g_num_sms, 256>>>(P.a, P.b, P.u, R.ref_a, R.ref_b, P.N, P.h, P.ld, d_res);
  CUDA_CHECK(cudaGetLastError());
  CompareResult res;
  CUDA_CHECK(cudaMemcpy(&res, d_res, sizeof(res), cudaMemcpyDeviceToHost));
  cudaFree(d_res);
  const char* names[3] = {"a", "b", "u"};
  for (int q = 0; q < 3; ++q) {
    const double rel = std::sqrt(res.err2[q] / std::max(res.ref2[q], 1e-300));
    const bool pass = res.nonfinite[q] == 0 && res.mismatches[q] == 0 && rel < 1e-2;
    printf(
        "  [%s v%d] full vs device fp32 oracle, %s: rel_l2 %.3e  max_abs %.3e  mismatches %llu  "
        "non-finite/unwritten %llu  %s\n",
        s.name, version, names[q], rel, res.max_abs[q], res.mismatches[q], res.nonfinite[q],
        pass ? "ok" : "FAIL");
    ok = ok && pass;
  }

  {
    unsigned long long* d_bad;
    CUDA_CHECK(cudaMalloc(&d_bad, 3 * sizeof(unsigned long long)));
    CUDA_CHECK(cudaMemset(d_bad, 0, 3 * sizeof(unsigned long long)));
    const bf16* outs[3] = {P.a, P.b, P.u};
    for (int q = 0; q < 3; ++q)
      padding_kernel<<<8 * g_num_sms, 256>>>(reinterpret_cast<const uint16_t*>(outs[q]), P.N, P.h,
                                             P.ld, P.out_elems, d_bad + q);
    CUDA_CHECK(cudaGetLastError());
    unsigned long long bad[3];
    CUDA_CHECK(cudaMemcpy(bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost));
    cudaFree(d_bad);
    const bool pass = bad[0] == 0 && bad[1] == 0 && bad[2] == 0;
    printf(
        "  [%s v%d] padding (%d columns past h, %d rows past N) still poisoned: "
        "overwritten a %llu b %llu u %llu  %s\n",
        s.name, version, P.ld - P.h, kPadRows, bad[0], bad[1], bad[2], pass ? "ok" : "FAIL");
    ok = ok && pass;
  }

  const size_t nr = R.rows.size();
  std::vector<uint16_t> got_a(P.h), got_b(P.h), got_u(P.h);
  double e2[3] = {0, 0, 0}, r2[3] = {0, 0, 0};
  size_t bad[3] = {0, 0, 0}, nonfinite = 0;
  for (size_t i = 0; i < nr; ++i) {
    const size_t r = R.rows[i];
    CUDA_CHECK(cudaMemcpy(got_a.data(), P.a + r * P.ld, P.h * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_b.data(), P.b + r * P.ld, P.h * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_u.data(), P.u + r * P.ld, P.h * 2, cudaMemcpyDeviceToHost));
    for (int n = 0; n < P.h; ++n) {
      const float ra = R.cpu_a[i * P.h + n], rb = R.cpu_b[i * P.h + n];
      const float ru = round_bf16_host(silu_host(round_bf16_host(ra)) * round_bf16_host(rb));
      const float got[3] = {bf16_bits_to_float(got_a[n]), bf16_bits_to_float(got_b[n]),
                            bf16_bits_to_float(got_u[n])};
      const float ref[3] = {ra, rb, ru};
      const float tol[3] = {
          std::ldexp(std::fabs(ra), -7) + 1e-4f, std::ldexp(std::fabs(rb), -7) + 1e-4f,
          std::ldexp(std::fabs(ra * rb), -5) + std::ldexp(std::fabs(ru), -7) + 1e-4f};
      for (int q = 0; q < 3; ++q) {
        if (!std::isfinite(got[q])) {
          ++nonfinite;
          continue;
        }
        const double diff = std::fabs(double(got[q]) - ref[q]);
        if (!(diff <= tol[q])) ++bad[q];
        e2[q] += diff * diff;
        r2[q] += double(ref[q]) * ref[q];
      }
    }
  }
  bool cpu_ok = nonfinite == 0 && R.oracle_rel < 1e-4;  // oracle: fp32 vs fp64 summation only
  for (int q = 0; q < 3; ++q)
    cpu_ok = cpu_ok && bad[q] == 0 && std::sqrt(e2[q] / std::max(r2[q], 1e-300)) < 1e-2;
  printf(
      "  [%s v%d] CPU fp64 spot check, %zu rows x %d cols: rel_l2 a %.3e b %.3e u %.3e, "
      "mismatches %zu/%zu/%zu, non-finite %zu; device oracle vs CPU rel_l2 %.3e  %s\n",
      s.name, version, nr, P.h, std::sqrt(e2[0] / std::max(r2[0], 1e-300)),
      std::sqrt(e2[1] / std::max(r2[1], 1e-300)), std::sqrt(e2[2] / std::max(r2[2], 1e-300)),
      bad[0], bad[1], bad[2], nonfinite, R.oracle_rel, cpu_ok ? "ok" : "FAIL");
  ok = ok && cpu_ok;

  if (version != 1) {
    REQUIRE(R.v1_a != nullptr, "v1 outputs not built");
    DiffResult* d_diff;
    CUDA_CHECK(cudaMalloc(&d_diff, 3 * sizeof(DiffResult)));
    DiffResult init[3];
    for (auto& dr : init) dr = {0, ~0ull};
    CUDA_CHECK(cudaMemcpy(d_diff, init, sizeof(init), cudaMemcpyHostToDevice));
    const bf16* mine[3] = {P.a, P.b, P.u};
    const bf16* theirs[3] = {R.v1_a, R.v1_b, R.v1_u};
    for (int q = 0; q < 3; ++q)
      diff_kernel<<<8 * g_num_sms, 256>>>(reinterpret_cast<const uint16_t*>(mine[q]),
                                          reinterpret_cast<const uint16_t*>(theirs[q]), P.out_elems,
                                          d_diff + q);
    CUDA_CHECK(cudaGetLastError());
    DiffResult diff[3];
    CUDA_CHECK(cudaMemcpy(diff, d_diff, sizeof(diff), cudaMemcpyDeviceToHost));
    cudaFree(d_diff);
    bool same = true;
    for (int q = 0; q < 3; ++q) {
      same = same && diff[q].count == 0;
      if (diff[q].count) {
        const unsigned long long r = diff[q].first / P.ld, col = diff[q].first % P.ld;
        int e = 0;
        while (e < P.E && P.h_offsets[e + 1] <= int(r)) ++e;
        printf(
            "  [%s v%d] %s differs from v1 in %llu elements; first at row %llu (expert %d, "
            "its row %lld), column %llu\n",
            s.name, version, names[q], diff[q].count, r, e,
            e < P.E ? (long long)r - P.h_offsets[e] : -1ll, col);
      }
    }
    printf(
        "  [%s v%d] a, b, u bitwise vs v1 (every element, padding included): %llu/%llu/%llu "
        "differ  %s\n",
        s.name, version, diff[0].count, diff[1].count, diff[2].count, same ? "ok" : "FAIL");
    ok = ok && same;
  }

  const unsigned long long c1 = checksum(P);
  poison_outputs(P);
  f1_run(version, P, M, 0);
  CUDA_CHECK(cudaDeviceSynchronize());
  const unsigned long long c2 = checksum(P);
  printf("  [%s v%d] rerun checksum %s (%016llx)\n", s.name, version,
         c1 == c2 ? "identical" : "DIFFERENT", c1);
  ok = ok && c1 == c2;
  return ok;
}

// ---------------------------------------------------------------------------------------------
// timing: warm-up, then the median of 20 runs, each after an L2 flush (outside the timed region)

template <typename F>
static float median_ms(F&& launch, void* flush_buf, size_t flush_bytes) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) launch();
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    CUDA_CHECK(cudaMemsetAsync(flush_buf, i & 0xff, flush_bytes));
    CUDA_CHECK(cudaEventRecord(e0));
    launch();
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float t;
    CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  CUDA_CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 0.5f * (ms[9] + ms[10]);
}

struct TimingRow {
  std::string name;
  double gflop, ms_f1[kNumVersions + 1], ms_dense;
};

int main(int argc, char** argv) {
  bool check_only = false;
  std::string only;
  std::vector<int> versions = {1, 2, 3, 4, 5, 6};
  uint64_t seed = 20261129;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--check-only"))
      check_only = true;
    else if (!strcmp(argv[i], "--shape") && i + 1 < argc)
      only = argv[++i];
    else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
      seed = strtoull(argv[++i], nullptr, 10);
    else if (!strcmp(argv[i], "--versions") && i + 1 < argc) {
      versions.clear();
      for (const char* c = argv[++i]; *c;) {  // comma-separated version numbers
        char* end = nullptr;
        const long v = strtol(c, &end, 10);
        if (end == c) {
          ++c;
          continue;
        }
        if (v >= 1 && v <= kNumVersions) versions.push_back(int(v));
        c = end;
      }
    } else {
      fprintf(stderr,
              "usage: %s [--check-only] [--shape NAME] [--seed N] [--versions 1,2,3,4,5,6]\n",
              argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  g_num_sms = prop.multiProcessorCount;
  printf("device: %s, %d SMs, L2 %d MB, smem/block opt-in %zu B, seed %llu; u formula: %s\n",
         prop.name, g_num_sms, prop.l2CacheSize >> 20, prop.sharedMemPerBlockOptin,
         (unsigned long long)seed,
         F1_LIBRARY_ACT ? "the library's act_math::forward"
                        : "verbatim copy of act_math (no -I include)");
  REQUIRE(prop.major == 9, "this kernel needs sm_90a (Hopper)");
  REQUIRE(smem_bytes_v1(4, kMaxExperts) <= prop.sharedMemPerBlockOptin, "shared memory (v1)");
  REQUIRE(smem_bytes_epiwg(3, kMaxExperts) <= prop.sharedMemPerBlockOptin, "shared memory (v2)");
  {
    const cudaFuncAttribute attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
    CUDA_CHECK(cudaFuncSetAttribute(f1_sm90_kernel<4, kEpiFull>, attr,
                                    int(smem_bytes_v1(4, kMaxExperts))));
    CUDA_CHECK(cudaFuncSetAttribute(f1_sm90_kernel<3, kEpiFull>, attr,
                                    int(smem_bytes_v1(3, kMaxExperts))));
    CUDA_CHECK(cudaFuncSetAttribute(f1_sm90_kernel<3, kEpiNone>, attr,
                                    int(smem_bytes_v1(3, kMaxExperts))));
    CUDA_CHECK(cudaFuncSetAttribute(f1_sm90_kernel<4, kEpiNone>, attr,
                                    int(smem_bytes_v1(4, kMaxExperts))));
    CUDA_CHECK(cudaFuncSetAttribute(f1_epiwg_kernel<3, kEpiFull>, attr,
                                    int(smem_bytes_epiwg(3, kMaxExperts))));
    CUDA_CHECK(cudaFuncSetAttribute(f1_epiwg_kernel<3, kEpiNone>, attr,
                                    int(smem_bytes_epiwg(3, kMaxExperts))));
    CUDA_CHECK(cudaFuncSetAttribute(f1_sm90_kernel<4, kEpiFull, 1>, attr,
                                    int(smem_bytes_v1(4, kMaxExperts))));
    CUDA_CHECK(cudaFuncSetAttribute(f1_sm90_kernel<4, kEpiNone, 1>, attr,
                                    int(smem_bytes_v1(4, kMaxExperts))));
    CUDA_CHECK(cudaFuncSetAttribute(f1_epiwg_kernel<3, kEpiFull, 1>, attr,
                                    int(smem_bytes_epiwg(3, kMaxExperts))));
    CUDA_CHECK(cudaFuncSetAttribute(f1_epiwg_kernel<3, kEpiNone, 1>, attr,
                                    int(smem_bytes_epiwg(3, kMaxExperts))));
    // setmaxnreg.inc waits forever if the CTA's pool (threads x entry registers) cannot cover the
    // split: refuse to launch instead.
    cudaFuncAttributes fa1, fa2;
    CUDA_CHECK(cudaFuncGetAttributes(&fa1, f1_sm90_kernel<4, kEpiFull>));
    CUDA_CHECK(cudaFuncGetAttributes(&fa2, f1_epiwg_kernel<3, kEpiFull>));
    printf("entry registers: kernel 1 %d (split %d / 2 x %d), kernel 2 %d (split %d / 2 x %d)\n",
           fa1.numRegs, kRegsWg0V1, kRegsConsumerV1, fa2.numRegs, kRegsWg0, kRegsConsumer);
    REQUIRE(fa1.numRegs * 3 >= kRegsWg0V1 + 2 * kRegsConsumerV1, "kernel 1 register split");
    REQUIRE(fa2.numRegs * 3 >= kRegsWg0 + 2 * kRegsConsumer, "kernel 2 register split");
  }

  const size_t flush_bytes = size_t(std::max(prop.l2CacheSize, 1 << 20)) * 4;
  void* flush_buf;
  CUDA_CHECK(cudaMalloc(&flush_buf, flush_bytes));
#ifndef NO_CUBLAS
  cublasHandle_t blas;
  REQUIRE(cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
#endif

  bool all_ok = true;
  std::vector<TimingRow> table;
  for (const Shape& s : kShapes) {
    if (only.empty() ? !s.in_default : only != s.name) continue;
    REQUIRE(s.d % 8 == 0 && s.h % 8 == 0 && s.ld_pad % 8 == 0 && s.E <= kMaxExperts,
            "unsupported shape %s", s.name);
    const uint64_t shape_seed = seed + std::hash<std::string>()(s.name) % 1000;
    printf("shape %s: T=%d d=%d h=%d E=%d k=%d N=%d ld=%d (seed %llu)\n", s.name, s.T, s.d, s.h,
           s.E, s.k, s.T * s.k, s.h + s.ld_pad, (unsigned long long)shape_seed);
    F1Problem P = make_problem(s, shape_seed);
    {
      int mn = 1 << 30, mx = 0, empty = 0, partial = 0, full = 0;
      for (int e = 0; e < s.E; ++e) {
        const int c = P.h_offsets[e + 1] - P.h_offsets[e];
        mn = std::min(mn, c);
        mx = std::max(mx, c);
        empty += c == 0;
        partial += c % kBM != 0;
        full += c / kBM;
      }
      printf("  rows per expert: min %d max %d, empty experts %d; m-tiles: %d whole, %d partial\n",
             mn, mx, empty, full, partial);
    }
    Maps maps;
    maps.gate = make_weight_map(P.w_gate, P.E, P.h, P.d);
    maps.up = make_weight_map(P.w_up, P.E, P.h, P.d);
    maps.out_a = make_output_map(P.a, P.N, P.h, P.ld);
    maps.out_b = make_output_map(P.b, P.N, P.h, P.ld);
    Reference ref = build_reference(P);
    bool need_v1_outputs = false;
    for (int v : versions) need_v1_outputs = need_v1_outputs || (!is_probe(v) && v != 1);
    if (need_v1_outputs) build_v1_outputs(P, maps, ref);
    for (int v : versions) {
      if (is_probe(v)) {  // smoke run: a hang traps here, a fault shows as a CUDA error
        f1_run(v, P, maps, 0);
        CUDA_CHECK(cudaDeviceSynchronize());
        printf("  [%s v%d] timing probe ran (outputs not checked: it writes nothing)\n", s.name, v);
        continue;
      }
      const bool ok = check_problem(v, s, P, maps, ref);
      all_ok = all_ok && ok;
      printf("  [%s v%d] %s\n", s.name, v, ok ? "CHECK PASSED" : "CHECK FAILED");
    }
    free_reference(ref);
    if (!check_only && strcmp(s.name, "edge") != 0 && strcmp(s.name, "tiny") != 0) {
      TimingRow row;
      row.name = s.name;
      row.gflop = 4.0 * P.N * double(P.d) * P.h * 1e-9;
      for (int v = 0; v <= kNumVersions; ++v) row.ms_f1[v] = 0;
      for (int v : versions)
        row.ms_f1[v] = median_ms([&] { f1_run(v, P, maps, 0); }, flush_buf, flush_bytes);
      row.ms_dense = 0;
#ifndef NO_CUBLAS
      {  // dense GEMM with the same FLOPs: [N, d] x [2h, d]^T -> [N, 2h] bf16, fp32 accumulate
        bf16* dense_c;
        CUDA_CHECK(cudaMalloc(&dense_c, size_t(P.N) * 2 * P.h * 2));
        bf16* dense_a;
        CUDA_CHECK(cudaMalloc(&dense_a, size_t(P.N) * P.d * 2));
        fill(dense_a, size_t(P.N) * P.d, shape_seed + 77, 1.f);
        const float alpha = 1.f, beta = 0.f;
        // w_gate[0..1] viewed as [2h, d] when E >= 2 (contiguous): a dense B of 2h rows.
        REQUIRE(P.E >= 2, "dense reference needs E >= 2");
        auto launch = [&] {
          const cublasStatus_t st =
              cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, 2 * P.h, P.N, P.d, &alpha, P.w_gate,
                           CUDA_R_16BF, P.d, dense_a, CUDA_R_16BF, P.d, &beta, dense_c, CUDA_R_16BF,
                           2 * P.h, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          REQUIRE(st == CUBLAS_STATUS_SUCCESS, "cublasGemmEx %d", int(st));
        };
        row.ms_dense = median_ms(launch, flush_buf, flush_bytes);
        cudaFree(dense_c);
        cudaFree(dense_a);
      }
#endif
      table.push_back(row);
      for (int v : versions)
        printf("  [%s v%d] F1 %.3f ms = %.1f TFLOP/s\n", s.name, v, row.ms_f1[v],
               row.gflop / row.ms_f1[v]);
      printf("  [%s] cuBLAS dense same-FLOP GEMM %.3f ms = %.1f TFLOP/s\n", s.name, row.ms_dense,
             row.ms_dense > 0 ? row.gflop / row.ms_dense : 0.0);
    }
    free_problem(P);
  }

  if (!table.empty()) {
    printf(
        "\nF1 (median of 20, L2 flushed), TFLOP/s = 4*N*d*h / time, x v1 = v1's time / this"
        " time. v1 = the library (4 stages, epilogue in the consumers); v2 = epilogue warps"
        " (3 stages); v3 = v1 with 3 stages. Main loop alone (probes, ms): v4 = v2's,"
        " v5 = v3's, v6 = v1's. Round 12, A gathered by the consumers: v7 = v1 (the library"
        " since round 11), v8 = v2; probes v9 = v8's, v10 = v7's\n");
    printf("%-8s %6s", "shape", "GFLOP");
    for (int v : versions)
      if (!is_probe(v)) printf(" | v%d ms   TF/s x v1", v);
    printf(" |");
    for (int v : versions)
      if (is_probe(v)) printf(" v%d ms ", v);
    printf("| dense TF/s\n");
    for (const TimingRow& r : table) {
      printf("%-8s %6.0f", r.name.c_str(), r.gflop);
      for (int v : versions) {
        if (is_probe(v)) continue;
        const double x = r.ms_f1[1] > 0 ? r.ms_f1[1] / r.ms_f1[v] : 0.0;
        printf(" | %6.3f %5.0f %4.2f", r.ms_f1[v], r.gflop / r.ms_f1[v], x);  // GFLOP/ms = TFLOP/s
      }
      printf(" |");
      for (int v : versions)
        if (is_probe(v)) printf(" %6.3f", r.ms_f1[v]);
      printf(" | %10.0f\n", r.ms_dense > 0 ? r.gflop / r.ms_dense : 0.0);
    }
  }
  printf("%s\n", all_ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
#ifndef NO_CUBLAS
  cublasDestroy(blas);
#endif
  cudaFree(flush_buf);
  return all_ok ? 0 : 1;
}
