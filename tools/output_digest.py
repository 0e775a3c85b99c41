#!/usr/bin/env python3
"""Digests of one moeblaze experts forward + backward, to say whether two builds compute the same
bits: run it once per library (MOEBLAZE_LIBRARY) with the same arguments and compare the lines.

    MOEBLAZE_LIBRARY=build-before/src/libmoeblaze.so python3 tools/output_digest.py > before.txt
    MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so python3 tools/output_digest.py > after.txt
    python3 tools/output_digest.py --compare before.txt after.txt [--may-differ dg]

Each line: shape, activation, policy, then a SHA-256 prefix of y, dx, dg and each weight gradient
(the tensors' bytes). The inputs are seeded (--seed), so two runs on one machine see the same
inputs; with the default shapes the B1 forms of the Hopper path run at 8, 16, 32 and 64 k-steps
(d = 512 ... 4096: split2, split, epilogue warps, epilogue warps) and the last tile is partial (h
not a multiple of 256). A kernel change that claims to keep every output's bits is checked with it;
one that does not shows which outputs moved (--compare names them per case and exits 1 when any
output moved that --may-differ does not allow). --layer digests the whole layer instead (router
GEMM, top-k and weights, aux and z losses, experts; moeblaze.torch.moe_layer) for each score
function, over expert counts that take each of the router kernel's register widths. Needs a GPU
(or --device cpu), PyTorch and the Python bindings.
"""
import argparse
import hashlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
import moeblaze.torch as mbt  # noqa: E402

# name: (T, d, h, E, k); small enough to run in seconds, large enough for full and partial tiles.
SHAPES = {
    "k8": (4096, 512, 1320, 8, 2),
    "k16": (4096, 1024, 2280, 8, 4),
    "k32": (2048, 2048, 1000, 4, 2),
    "k64": (1024, 4096, 600, 4, 2),
    "tiny": (64, 32, 48, 4, 2),  # for the CPU backend (the self-check in CTest)
}

# --layer: (T, d, h, E, k). E = 8, 100, 200, 600: 1, 4, 8 and 32 logits a lane in the router's
# forward kernel; T not a multiple of its 64-token blocks.
LAYER_SHAPES = {
    "e8": (4133, 256, 512, 8, 2),
    "e100": (2050, 256, 256, 100, 6),
    "e200": (1001, 256, 256, 200, 8),
    "e600": (515, 128, 128, 600, 4),
    "tiny": (70, 32, 48, 40, 3),  # CPU (the self-check)
}
# score function -> (renormalize, aux_loss_coeff, z_loss_coeff)
LAYER_SCORES = {
    "softmax_topk": (False, 0.01, 0.001),
    "topk_softmax": (False, 0.01, 0.0),
    "sigmoid": (True, 0.01, 0.001),
}


def digest(t):
    if t is None:
        return "-"
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
                          ).hexdigest()[:16]


GATED = ("swiglu", "geglu", "reglu")


def seeded_draws(seed, device):
    """(generator, randn): randn(*size, scale=1.0) draws from one seeded CPU generator and returns
    bf16 on `device`, so two runs with one seed see the same inputs on any device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=torch.bfloat16)

    return gen, randn


def expert_weights(randn, E, h, d, gated):
    """w_gate, w_up (None unless gated), w_down, scaled by 1/sqrt(fan-in), requiring grad."""
    wg = randn(E, h, d, scale=d ** -0.5).requires_grad_(True)
    wu = randn(E, h, d, scale=d ** -0.5).requires_grad_(True) if gated else None
    wd = randn(E, d, h, scale=h ** -0.5).requires_grad_(True)
    return wg, wu, wd


def run(shape, act, policy, seed, device):
    T, d, h, E, k = SHAPES[shape]
    gen, randn = seeded_draws(seed, device)
    gated = act in GATED
    x = randn(T, d).requires_grad_(True)
    logits = torch.randn(T, E, generator=gen)
    top, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    g = (top / top.sum(-1, keepdim=True)).to(device).requires_grad_(True)
    ids = ids.to(device=device, dtype=torch.int32).contiguous()
    wg, wu, wd = expert_weights(randn, E, h, d, gated)
    dy = randn(T, d)
    leaves = [t for t in (x, g, wg, wu, wd) if t is not None]
    y = mbt.moe_experts(x, ids, g, wg, wu, wd, activation=act, checkpoint=policy)
    grads = dict(zip(("dx", "dg", "dw_gate", "dw_up", "dw_down") if gated else
                     ("dx", "dg", "dw_gate", "dw_down"), torch.autograd.grad(y, leaves, dy)))
    names = ("dx", "dg", "dw_gate", "dw_up", "dw_down")
    return f"{shape} {act} {policy} y={digest(y)} " + " ".join(
        f"{n}={digest(grads.get(n))}" for n in names)


def run_layer(shape, act, score, seed, device):
    """One whole-layer forward + backward: y, the losses, ids, g and every gradient."""
    T, d, h, E, k = LAYER_SHAPES[shape]
    renormalize, aux, z = LAYER_SCORES[score]
    _, randn = seeded_draws(seed, device)
    gated = act in GATED
    x = randn(T, d).requires_grad_(True)
    wr = randn(E, d, scale=d ** -0.5).requires_grad_(True)
    wg, wu, wd = expert_weights(randn, E, h, d, gated)
    dy = randn(T, d)
    y, losses, counts, ids, g = mbt.moe_layer(
        x, wr, wg, wu, wd, top_k=k, activation=act, score_function=score,
        renormalize=renormalize, aux_loss_coeff=aux, z_loss_coeff=z)
    leaves = [t for t in (x, wr, wg, wu, wd) if t is not None]
    names = ["dx", "dw_router", "dw_gate"] + (["dw_up"] if gated else []) + ["dw_down"]
    grads = dict(zip(names, torch.autograd.grad((y, losses), leaves,
                                                (dy, torch.ones_like(losses)))))
    outs = {"y": y, "losses": losses, "counts": counts, "ids": ids, "g": g, **grads}
    order = ("y", "losses", "counts", "ids", "g", "dx", "dw_router", "dw_gate", "dw_up",
             "dw_down")
    return f"layer-{shape} {act} {score} " + " ".join(f"{n}={digest(outs.get(n))}" for n in order)


def compare(before, after, may_differ=()):
    """Two runs' lines (the same arguments) -> (report lines, ok): per line, the outputs whose
    digests differ; ok when the runs have the same cases and only outputs named in may_differ (a
    kernel change that reorders a sum, e.g. "dg") differ."""
    report, ok = [], len(before) == len(after)
    if not ok:
        report.append(f"{len(before)} lines against {len(after)}: not the same cases")
    for line_a, line_b in zip(before, after):
        case_a, case_b = line_a.split()[:3], line_b.split()[:3]
        if case_a != case_b:
            report.append(f"{' '.join(case_a)} against {' '.join(case_b)}: not the same case")
            ok = False
            continue
        outs_a = dict(w.split("=", 1) for w in line_a.split()[3:])
        outs_b = dict(w.split("=", 1) for w in line_b.split()[3:])
        moved = sorted(n for n in outs_a.keys() | outs_b.keys() if outs_a.get(n) != outs_b.get(n))
        unexpected = [n for n in moved if n not in may_differ]
        ok = ok and not unexpected
        report.append(f"{' '.join(case_a)}: " + ("identical" if not moved else
                      "differ: " + ", ".join(moved) + (" (unexpected)" if unexpected else "")))
    report.append("same bits" + (f" except {', '.join(may_differ)}" if may_differ else "")
                  if ok else "DIFFERENT BITS")
    return report, ok


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help="among " + ",".join(SHAPES) + " (default k8,k16,k32,k64); with --layer "
                        "among " + ",".join(LAYER_SHAPES) + " (default e8,e100,e200,e600)")
    p.add_argument("--layer", action="store_true",
                   help="the whole layer (router included) for each score function")
    p.add_argument("--scores", default=",".join(LAYER_SCORES), help="with --layer")
    p.add_argument("--acts", default="swiglu,silu")
    p.add_argument("--policies", default="save_preact,save_all,recompute")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--self-test", action="store_true",
                   help="on the CPU backend, tiny shape: two runs give the same lines, another "
                        "seed different ones (CTest)")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="compare two runs' saved lines instead of running: per case the outputs "
                        "that differ; exit 1 if any differs but those of --may-differ")
    p.add_argument("--may-differ", default="",
                   help="with --compare: outputs allowed to differ, e.g. dg (a new sum order)")
    a = p.parse_args()
    if a.self_test:
        return self_test()
    if a.compare:
        texts = []
        for path in a.compare:
            with open(path) as f:
                texts.append([line for line in f.read().splitlines() if line.strip()])
        report, ok = compare(*texts, may_differ=[n for n in a.may_differ.split(",") if n])
        print("\n".join(report))
        return 0 if ok else 1
    if a.layer:
        for shape in (a.shapes or "e8,e100,e200,e600").split(","):
            for act in a.acts.split(","):
                for score in a.scores.split(","):
                    print(run_layer(shape, act, score, a.seed, a.device), flush=True)
        return 0
    for shape in (a.shapes or "k8,k16,k32,k64").split(","):
        for act in a.acts.split(","):
            for policy in a.policies.split(","):
                print(run(shape, act, policy, a.seed, a.device), flush=True)


def self_test():
    def lines(seed):
        return [run("tiny", act, policy, seed, "cpu") for act in ("swiglu", "silu")
                for policy in ("save_preact", "recompute")]

    first, again, other = lines(2026), lines(2026), lines(7)
    ok = first == again and all(a != b for a, b in zip(first, other))
    ok = ok and all(len(line.split()) == 9 for line in first)
    # --compare: identical runs agree; another seed differs in every output, which naming one
    # output as allowed does not excuse; a changed dg alone passes when dg may differ.
    ok = ok and compare(first, again)[1] and not compare(first, other)[1]
    ok = ok and not compare(first, other, may_differ=["dg"])[1]
    moved_dg = [" ".join(w if not w.startswith("dg=") else "dg=0" for w in line.split())
                for line in first]
    ok = ok and compare(first, moved_dg, may_differ=["dg"])[1] and not compare(first, moved_dg)[1]
    ok = ok and "differ: dg (unexpected)" in compare(first, moved_dg)[0][0]
    ok = ok and not compare(first, first[:-1])[1]
    # --layer: repeatable, seed-dependent, every output present (a gated and a non-gated layer).
    layer = [run_layer("tiny", act, score, 2026, "cpu") for act in ("swiglu", "silu")
             for score in LAYER_SCORES]
    layer_again = [run_layer("tiny", act, score, 2026, "cpu") for act in ("swiglu", "silu")
                   for score in LAYER_SCORES]
    layer_other = [run_layer("tiny", "swiglu", score, 7, "cpu") for score in LAYER_SCORES]
    ok = ok and compare(layer, layer_again)[1]
    ok = ok and all(a != b for a, b in zip(layer, layer_other))
    ok = ok and all(len(line.split()) == 13 and "=-" not in line for line in layer[:3])
    ok = ok and all(line.count("=-") == 1 and "dw_up=-" in line for line in layer[3:])
    print("\n".join(first + layer))
    print("output_digest self-test:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
