#!/usr/bin/env python3
"""Roofline arithmetic for the benchmark configurations: FLOPs, fewest HBM bytes, floors, and
models of the bytes each implementation saves for backward.

    python3 bench/roofline.py [--configs bench/configs.json] [--tflops 790] [--tbps 4.3]

prints a markdown table (make_report.py inserts it into docs/performance.md).
No torch needed: pure arithmetic.
"""

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
GATED = ("swiglu", "geglu", "reglu")

# Measured on an H200: bf16 dense matmul 769-798 TFLOP/s (an 8192^3 torch matmul, random data, a
# short burst), device-to-device copy ~4.3 TB/s (read + write counted).
H200_BF16_TFLOPS = 790.0
H200_HBM_TBPS = 4.3


def num_projections(activation):
    """g in the formulas: 2 first-GEMM projections for gated activations, 1 otherwise."""
    return 2 if activation in GATED else 1


def flops(cfg, activation):
    """Useful FLOPs of experts fwd + bwd: 6 * N * d * h * (g + 1), i.e. 18*T*k*d*h for gated
    activations and 12*T*k*d*h otherwise (recompute's extra GEMM is not counted)."""
    n = cfg["T"] * cfg["k"]
    return 6 * n * cfg["d"] * cfg["h"] * (num_projections(activation) + 1)


def index_bytes(cfg):
    """The routing indices moeblaze keeps: 3*N + E + 1 int32."""
    return 4 * (3 * cfg["T"] * cfg["k"] + cfg["E"] + 1)


def strict_min_bytes(cfg, activation, elem=2):
    """Fewest HBM bytes of fwd + bwd with SAVE_PREACT: every input read once, every output written
    once, the saved pre-activations written once and read once, nothing else.

    fwd: read x, weights, ids, g; write y, Z (N*g*h), indices.
    bwd: read dy, x, weights, ids, g, Z, indices; write dx, dW, dg."""
    T, d, h, E, k = cfg["T"], cfg["d"], cfg["h"], cfg["E"], cfg["k"]
    g = num_projections(activation)
    n = T * k
    weights = E * d * h * (g + 1)
    dense = elem * (5 * T * d + 3 * weights + 2 * n * g * h)
    routing = 2 * 8 * T * k + 4 * T * k  # ids + g read twice, dg written
    return dense + routing + 2 * index_bytes(cfg)


def fused_bytes(cfg, activation, elem=2):
    """Bytes of a fused design without routed copies that still writes and reads the transients
    between the GEMMs (A write+read in fwd, dZ write+read and s*A for dW2 in bwd):
    b*(5Td + 3P + 5Ngh + 4Nh)."""
    T, d, h, E, k = cfg["T"], cfg["d"], cfg["h"], cfg["E"], cfg["k"]
    g = num_projections(activation)
    n = T * k
    weights = E * d * h * (g + 1)
    return elem * (5 * T * d + 3 * weights + 5 * n * g * h + 4 * n * h)


def saved_bytes_model(impl, policy, cfg, activation, elem=2):
    """Bytes saved for backward beyond the inputs, as modelled for each implementation.

    moeblaze (include/moeblaze.h): indices (3N+E+1 int32) + a, b, u (SAVE_ALL) / a, b (SAVE_PREACT)
    / nothing (RECOMPUTE); non-gated: a, u / a / nothing. Excludes the buffer's small header.
    Baselines (bench/baselines.py under autograd): gathered x (N*d), an fp32 copy of the expert
    output for dg (N*4d), the activation's saved tensors (m * N*h) and int64 perm + token + fp32
    g_sorted (20*N bytes); the loop also keeps index_add's fp32 source (N*4d). SonicMoE: its
    pre-activation z (N*2h gated, N*h otherwise) and int32 indices (3N + E+1 + T+1)."""
    T, d, h, k = cfg["T"], cfg["d"], cfg["h"], cfg["k"]
    n = T * k
    gated = activation in GATED
    if impl == "moeblaze":
        per_row = {"save_all": 3 if gated else 2, "save_preact": 2 if gated else 1,
                   "recompute": 0}.get(policy)
        if per_row is None:
            return None
        return index_bytes(cfg) + elem * per_row * n * h
    if impl in ("loop", "grouped_mm"):
        # tensors of N*h saved by autograd: a (act input), act(a) and b (the product), u (GEMM-2)
        hidden = {"swiglu": 4, "geglu": 4, "reglu": 3, "silu": 2, "gelu": 2, "relu": 1,
                  "relu2": 2}[activation]
        common = elem * n * d + 4 * n * d + elem * hidden * n * h + 20 * n
        if impl == "loop":
            return common + 4 * n * d  # index_add keeps its fp32 source (expand_as in backward)
        return common + 4 * cfg["E"]  # grouped_mm keeps the int32 offsets
    if impl == "sonicmoe":
        return elem * (2 if gated else 1) * n * h + 4 * (3 * n + cfg["E"] + 1 + T + 1)
    return None


def floors_ms(cfg, activation, tflops=H200_BF16_TFLOPS, tbps=H200_HBM_TBPS):
    compute = flops(cfg, activation) / (tflops * 1e12) * 1e3
    memory = strict_min_bytes(cfg, activation) / (tbps * 1e12) * 1e3
    return compute, memory


def load_configs(path=None):
    with open(path or os.path.join(HERE, "configs.json")) as f:
        return json.load(f)["configs"]


def markdown_table(configs, activations=("swiglu", "silu"), tflops=H200_BF16_TFLOPS,
                   tbps=H200_HBM_TBPS):
    gib = float(1 << 30)
    lines = [
        f"| config | T | d | h | E | k | N/E | act | GFLOP | min GB | fused GB | AI (FLOP/B) "
        f"| compute floor ms @{tflops:g} | memory floor ms @{tbps:g} TB/s "
        f"| saved GiB moeblaze preact / all / recompute | saved GiB grouped_mm (model) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for cfg in configs:
        for act in activations:
            f = flops(cfg, act)
            smin = strict_min_bytes(cfg, act)
            fused = fused_bytes(cfg, act)
            compute, memory = floors_ms(cfg, act, tflops, tbps)
            saved = [saved_bytes_model("moeblaze", p, cfg, act) / gib
                     for p in ("save_preact", "save_all", "recompute")]
            base = saved_bytes_model("grouped_mm", None, cfg, act) / gib
            lines.append(
                f"| {cfg['name']} | {cfg['T']} | {cfg['d']} | {cfg['h']} | {cfg['E']} | {cfg['k']} "
                f"| {cfg['T'] * cfg['k'] // cfg['E']} | {act} | {f / 1e9:,.0f} | {smin / 1e9:.2f} "
                f"| {fused / 1e9:.2f} | {f / smin:,.0f} | {compute:.2f} | {memory:.2f} "
                f"| {saved[0]:.2f} / {saved[1]:.2f} / {saved[2]:.3f} | {base:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=None,
                        help="configs.json (default: bench/configs.json)")
    parser.add_argument("--acts", default="swiglu,silu")
    parser.add_argument("--tflops", type=float, default=H200_BF16_TFLOPS)
    parser.add_argument("--tbps", type=float, default=H200_HBM_TBPS)
    args = parser.parse_args()
    print(markdown_table(load_configs(args.configs), args.acts.split(","), args.tflops, args.tbps))


if __name__ == "__main__":
    main()
