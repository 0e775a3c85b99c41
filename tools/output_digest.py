#!/usr/bin/env python3
"""Digests of one moeblaze experts forward + backward, to say whether two builds compute the same
bits: run it once per library (MOEBLAZE_LIBRARY) with the same arguments and compare the lines.

    MOEBLAZE_LIBRARY=build-before/src/libmoeblaze.so python3 tools/output_digest.py > before.txt
    MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so python3 tools/output_digest.py > after.txt
    diff before.txt after.txt && echo "bitwise identical"

Each line: shape, activation, policy, then a SHA-256 prefix of y, dx, dg and each weight gradient
(the tensors' bytes). The inputs are seeded (--seed), so two runs on one machine see the same
inputs; with the default shapes the B1 forms of the Hopper path run at 8, 16, 32 and 64 k-steps
(d = 512 ... 4096: split2, split, split, epilogue warps) and the last tile is partial (h not a
multiple of 256). A kernel change that
claims to keep every output's bits is checked with it; one that does not shows which outputs moved.
Needs a GPU (or --device cpu), PyTorch and the Python bindings.
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


def digest(t):
    if t is None:
        return "-"
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
                          ).hexdigest()[:16]


def run(shape, act, policy, seed, device):
    T, d, h, E, k = SHAPES[shape]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dt = torch.bfloat16

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dt)

    gated = act in ("swiglu", "geglu", "reglu")
    x = randn(T, d).requires_grad_(True)
    logits = torch.randn(T, E, generator=gen)
    top, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    g = (top / top.sum(-1, keepdim=True)).to(device).requires_grad_(True)
    ids = ids.to(device=device, dtype=torch.int32).contiguous()
    wg = randn(E, h, d, scale=d ** -0.5).requires_grad_(True)
    wu = randn(E, h, d, scale=d ** -0.5).requires_grad_(True) if gated else None
    wd = randn(E, d, h, scale=h ** -0.5).requires_grad_(True)
    dy = randn(T, d)
    leaves = [t for t in (x, g, wg, wu, wd) if t is not None]
    y = mbt.moe_experts(x, ids, g, wg, wu, wd, activation=act, checkpoint=policy)
    grads = dict(zip(("dx", "dg", "dw_gate", "dw_up", "dw_down") if gated else
                     ("dx", "dg", "dw_gate", "dw_down"), torch.autograd.grad(y, leaves, dy)))
    names = ("dx", "dg", "dw_gate", "dw_up", "dw_down")
    return f"{shape} {act} {policy} y={digest(y)} " + " ".join(
        f"{n}={digest(grads.get(n))}" for n in names)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="k8,k16,k32,k64", help="among " + ",".join(SHAPES))
    p.add_argument("--acts", default="swiglu,silu")
    p.add_argument("--policies", default="save_preact,save_all,recompute")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--self-test", action="store_true",
                   help="on the CPU backend, tiny shape: two runs give the same lines, another "
                        "seed different ones (CTest)")
    a = p.parse_args()
    if a.self_test:
        return self_test()
    for shape in a.shapes.split(","):
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
    print("\n".join(first))
    print("output_digest self-test:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
