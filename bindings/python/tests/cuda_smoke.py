"""CUDA smoke test of moeblaze.torch needing only torch (no pytest, no numpy): for the GPU machine.

    MOEBLAZE_LIBRARY=<cuda build>/src/libmoeblaze.so PYTHONPATH=bindings/python \
        python3 bindings/python/tests/cuda_smoke.py

Runs the same inputs through the CPU and the CUDA backends (moe_experts and the MoE module, forward
and backward, several dtypes) and compares; checks the current-stream use, graph-free repeat
determinism and that the saved buffer is a torch CUDA allocation. Exits non-zero on any mismatch.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import moeblaze  # noqa: E402
from moeblaze import torch as mbt  # noqa: E402

failures = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        failures.append(name)


def close(a, b, rtol, atol):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return False, "non-finite"
    # atol relative to the tensor's scale: long 16-bit reductions (dw_*) differ by a few ulps of
    # their largest terms when the two backends round intermediate a, b, u differently.
    scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
    err = ((a - b).abs() - rtol * b.abs()).max().item() if a.numel() else 0.0
    return err <= atol * scale, f"max excess {err:.3e} (scale {scale:.3g})"


def experts_case(dtype, act, T=300, d=64, h=96, E=8, k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=gen)
    w_gate = torch.randn(E, h, d, generator=gen) / d ** 0.5
    w_up = torch.randn(E, h, d, generator=gen) / d ** 0.5 if act in ("swiglu", "geglu") else None
    w_down = torch.randn(E, d, h, generator=gen) / h ** 0.5
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int()
    g = torch.rand(T, k, generator=gen)
    dy = torch.randn(T, d, generator=gen)
    results = {}
    for device in ("cpu", "cuda"):
        # detach().clone(): fresh leaves per device (.to() may return the very same tensor).
        leaves = [t.to(device=device, dtype=dtype).detach().clone().requires_grad_(True)
                  if t is not None else None for t in (x, w_gate, w_up, w_down)]
        gg = g.to(device).detach().clone().requires_grad_(True)
        y = mbt.moe_experts(leaves[0], ids.to(device), gg, leaves[1], leaves[2], leaves[3],
                            activation=act)
        y.backward(dy.to(device=device, dtype=dtype))
        results[device] = [y, gg.grad] + [t.grad for t in leaves if t is not None]
    tol = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2),
           torch.float16: (5e-3, 5e-3)}[dtype]
    names = ["y", "dg", "dx", "dw_gate"] + (["dw_up"] if act in ("swiglu", "geglu") else []) + \
        ["dw_down"]
    for name, a, b in zip(names, results["cuda"], results["cpu"]):
        ok, detail = close(a, b, *tol)
        check(f"experts {act} {dtype} {name} cuda~cpu", ok, detail)


def module_case(dtype):
    torch.manual_seed(1)
    cpu = mbt.MoE(64, 128, 8, top_k=2, aux_loss_coeff=0.01, z_loss_coeff=0.001, dtype=dtype)
    gpu = mbt.MoE(64, 128, 8, top_k=2, aux_loss_coeff=0.01, z_loss_coeff=0.001, dtype=dtype,
                  device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(4, 50, 64).to(dtype)
    outs = {}
    for name, module, xx in (("cpu", cpu, x), ("cuda", gpu, x.cuda())):
        xx = xx.clone().requires_grad_(True)
        y, aux, z = module(xx)
        (y.float().square().mean() + aux + z).backward()
        outs[name] = [y, aux, z, xx.grad] + [p.grad for p in module.parameters()]
    tol = (2e-4, 2e-4) if dtype == torch.float32 else (3e-2, 3e-2)
    for i, (a, b) in enumerate(zip(outs["cuda"], outs["cpu"])):
        ok, detail = close(a, b, *tol)
        check(f"MoE {dtype} output/grad #{i} cuda~cpu", ok, detail)


def stream_and_memory():
    x = torch.randn(512, 64, device="cuda")
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(512)]).int().cuda()
    g = torch.rand(512, 2, device="cuda")
    w_gate, w_up = torch.randn(8, 96, 64, device="cuda"), torch.randn(8, 96, 64, device="cuda")
    w_down = torch.randn(8, 64, 96, device="cuda")
    y0 = mbt.moe_experts(x, ids, g, w_gate, w_up, w_down)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y1 = mbt.moe_experts(x, ids, g, w_gate, w_up, w_down)
    torch.cuda.current_stream().wait_stream(side)
    check("side stream gives bitwise-equal y", torch.equal(y0, y1))
    packed = []
    x.requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: packed.append((t.dtype, t.device.type)) or t, lambda t: t):
        y = mbt.moe_experts(x, ids, g, w_gate, w_up, w_down)
    check("saved buffer is a CUDA uint8 tensor seen by saved-tensor hooks",
          (torch.uint8, "cuda") in packed)
    y.sum().backward()
    check("backward ran", x.grad is not None and bool(torch.isfinite(x.grad).all()))


def main():
    print(f"torch {torch.__version__}, moeblaze {moeblaze.build_info()}")
    if not torch.cuda.is_available():
        print("torch.cuda unavailable: nothing to test")
        return 0
    if not moeblaze.backend_available("cuda"):
        print("FAIL: the loaded libmoeblaze has no usable CUDA backend")
        return 1
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for act in ("swiglu", "relu2"):
            experts_case(dtype, act)
    for dtype in (torch.float32, torch.bfloat16):
        module_case(dtype)
    stream_and_memory()
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
