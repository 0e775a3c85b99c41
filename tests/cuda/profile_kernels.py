"""Per-kernel GPU time of one moeblaze experts forward + backward (torch.profiler), for tuning.

Usage: MOEBLAZE_LIBRARY=build/src/libmoeblaze.so python3 tests/cuda/profile_kernels.py \
           [--T 65536 --d 1024 --h 4096 --E 16 --k 4 --act swiglu --policy save_preact]
           [--impl moeblaze|grouped_mm|sonicmoe] [--routing random|blocked] [--layer]
           [--steps 5] [--host [--trace FILE]] [--clocks SECONDS] [--profiler-range]
Needs a GPU, PyTorch and the Python bindings (bindings/python, found relative to this file).
--impl grouped_mm profiles the benchmark's sort -> torch._grouped_mm baseline (bench/baselines.py)
on the same inputs instead, so that a shape where the two are close can be compared kernel by
kernel; --impl sonicmoe does the same for SonicMoE when it is importable (bench/peers.py). The
step's GPU time split by kernel class (tools/kernel_tags.py) is printed for each.
--profiler-range runs one step between cudaProfilerStart and cudaProfilerStop after the warm-up and
exits: tools/ncu_step_times.sh times its kernels with the clocks locked.
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
import baselines  # noqa: E402
import gpu_clocks  # noqa: E402
import peers  # noqa: E402
import moeblaze.torch as mbt  # noqa: E402
from kernel_tags import kernel_class, kernel_tag, kernels_over_steps, split_by_class  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=65536)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--h", type=int, default=4096)
    p.add_argument("--E", type=int, default=16)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--act", default="swiglu")
    p.add_argument("--policy", default="save_preact")
    p.add_argument("--rows", type=int, default=25, help="kernels listed (the largest first)")
    p.add_argument("--steps", type=int, default=5,
                   help="profiled steps: each kernel's time is the median over them (one step's "
                        "times vary by several per cent), with the smallest and largest")
    p.add_argument("--impl", choices=("moeblaze", "grouped_mm", "sonicmoe"), default="moeblaze",
                   help="moeblaze (the library, --policy applies), the benchmark's grouped_mm "
                        "baseline or SonicMoE on the same inputs (--policy ignored)")
    p.add_argument("--host", action="store_true",
                   help="also time the host side: enqueue time per step, GPU idle time, the CPU "
                        "calls that take longest, and a Chrome trace (--trace)")
    p.add_argument("--trace", default=None, help="with --host: write a Chrome trace here")
    p.add_argument("--clocks", type=float, default=0.0,
                   help="also run back-to-back steps for this many seconds while nvidia-smi samples "
                        "the SM clock, power draw, temperature and the clock-event reasons every "
                        "100 ms: is the steady state power- or heat-capped?")
    p.add_argument("--routing", choices=("random", "blocked"), default="random",
                   help="random: softmax top-k of N(0, 1) logits (the benchmark's). blocked: token "
                        "t's experts are (t * E // T + j) % E, so each expert's gathered rows are "
                        "runs of consecutive tokens and every expert gets k*T/E of them: the "
                        "gathered kernels with and without scattered rows")
    p.add_argument("--layer", action="store_true",
                   help="the whole layer, router included (bench/run_bench.py --mode layer): "
                        "logits = x . w_router^T, top-k of the logits, softmax over the k chosen, "
                        "the experts and the switch loss (weight 1), all differentiated")
    p.add_argument("--profiler-range", action="store_true",
                   help="after the warm-up, one step between cudaProfilerStart/Stop, then exit "
                        "(for a profiler started with --profile-from-start off)")
    a = p.parse_args()
    # SonicMoE's CUTLASS DSL parses the process's command line whenever it compiles a kernel, and
    # reads this script's --h as an abbreviation of its --help: it would print help and exit.
    del sys.argv[1:]
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    gated = a.act in ("swiglu", "geglu", "reglu")
    x = torch.randn(a.T, a.d, device=dev, dtype=dt, requires_grad=True)
    logits = torch.randn(a.T, a.E, device=dev)
    top, ids = torch.topk(torch.softmax(logits, -1), a.k, dim=-1)
    g = (top / top.sum(-1, keepdim=True)).requires_grad_(True)
    if a.routing == "blocked":
        t = torch.arange(a.T, device=dev)
        ids = ((t * a.E // a.T).unsqueeze(1) + torch.arange(a.k, device=dev)) % a.E
    ids = ids.to(torch.int32).contiguous()
    wg = (torch.randn(a.E, a.h, a.d, device=dev) / a.d ** 0.5).to(dt).requires_grad_(True)
    wu = (torch.randn(a.E, a.h, a.d, device=dev) / a.d ** 0.5).to(dt).requires_grad_(True) if gated else None
    wd = (torch.randn(a.E, a.d, a.h, device=dev) / a.h ** 0.5).to(dt).requires_grad_(True)
    dy = torch.randn(a.T, a.d, device=dev, dtype=dt)

    wanted = [t for t in (x, g, wg, wu, wd) if t is not None]
    if a.layer:
        step = layer_step(a, x, wg, wu, wd, dy)
    elif a.impl == "sonicmoe":
        reason = peers.sonicmoe_unsupported(a.act, dt, "cuda")
        if reason:
            raise SystemExit(reason)
        w1 = peers.fuse_up_projection(wg, wu).requires_grad_(True)
        tokens = peers.token_order_indices(a.T, a.k, dev)
        wanted = [x, g, w1, wd]

    def experts_step():
        # autograd.grad as the benchmark does: y.backward() would add every step's weight
        # gradients into .grad (a bf16 add kernel over all weights, ~2 ms a step on mixtral).
        if a.impl == "grouped_mm":
            y = baselines.moe_grouped_mm(x, ids, g, wg, wu, wd, activation=a.act)
        elif a.impl == "sonicmoe":
            y = peers.sonicmoe_experts(x, g, w1, wd, ids, tokens, a.act)
        else:
            y = mbt.moe_experts(x, ids, g, wg, wu, wd, activation=a.act, checkpoint=a.policy)
        torch.autograd.grad(y, wanted, dy)

    if not a.layer:
        step = experts_step
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if a.profiler_range:
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"one step profiled ({a.impl})")
        return
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 5
    flops = (18 if gated else 12) * a.T * a.k * a.d * a.h
    what = a.policy if a.impl == "moeblaze" else a.impl
    what += " layer" if a.layer else ""
    print(f"fwd+bwd {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s "
          f"(T={a.T} d={a.d} h={a.h} E={a.E} k={a.k} {a.act} {what} {a.routing})")
    steps = []
    for _ in range(max(1, a.steps)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        steps.append([(e.name, e.time_range.end - e.time_range.start) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA])
    rows = kernels_over_steps(steps)
    split = split_by_class([(name, median) for name, _, median, _, _ in rows])
    total = sum(split.values())
    print(f"kernel classes ({a.impl}, median of {len(steps)} steps, {len(rows)} kernels, "
          f"{total / 1e3:.3f} ms): " +
          ", ".join(f"{cls} {us / 1e3:.3f} ms ({100 * us / max(total, 1e-9):.1f} %)"
                    for cls, us in split.items()))
    print(f"kernel  median ms (min-max over {len(steps)} steps)  calls a step  tag  class  name")
    for name, calls, median, low, high in rows[:a.rows]:
        print(f"kernel {median / 1e3:8.3f} ms ({low / 1e3:.3f}-{high / 1e3:.3f})  x{calls:<3d} "
              f"{kernel_tag(name) or '-':3s} {kernel_class(name):18s} {name[:100]}")
    if a.host:
        profile_host(step, ms, a)
    if a.clocks > 0:
        profile_clocks(step, a.clocks)


def layer_step(a, x, wg, wu, wd, dy):
    """One differentiated step of the whole layer (bench/run_bench.py make_layer_impl): y and the
    switch loss, both with a gradient (dy, 1)."""
    wr = (torch.randn(a.E, a.d, device=x.device) / a.d ** 0.5).to(x.dtype).requires_grad_(True)
    if a.impl == "sonicmoe":
        reason = peers.sonicmoe_unsupported(a.act, x.dtype, "cuda")
        if reason:
            raise SystemExit(reason)
        layer = peers.sonicmoe_layer(a.d, a.h, a.E, a.k, a.act, wr, wg, wu, wd)
        wanted = [x] + [w for w in layer.parameters() if w.requires_grad]

        def forward():
            return layer(x)
    elif a.impl == "grouped_mm":
        wanted = [w for w in (x, wr, wg, wu, wd) if w is not None]

        def forward():
            return baselines.moe_layer_grouped_mm(x, wr, wg, wu, wd, a.k, a.act)
    else:
        wanted = [w for w in (x, wr, wg, wu, wd) if w is not None]

        def forward():
            y, losses = mbt.moe_layer(x, wr, wg, wu, wd, top_k=a.k, activation=a.act,
                                      checkpoint=a.policy, score_function="topk_softmax",
                                      aux_loss_coeff=1.0)[:2]
            return y, losses[0]

    one = torch.ones((), device=x.device)

    def step():
        y, aux = forward()[:2]
        torch.autograd.grad([y, aux], wanted, [dy, one.to(aux.dtype)])
    return step


def profile_host(step, gpu_step_ms, a):
    """Is the GPU ever waiting for the host? Host enqueue time per step (no sync inside the
    steps), the kernel time the profiler sees, and the CPU calls with the most self time."""
    import time
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    enqueue_ms = (time.perf_counter() - t0) * 1e3 / 5
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    # GPU busy time = the union of the kernels' intervals (the per-op averages attribute kernels
    # launched through ctypes to the enclosing autograd op as well, so their sum double counts).
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy_us, covered_to = 0.0, float("-inf")
    for start, end in spans:
        if end > covered_to:
            busy_us += end - max(start, covered_to)
            covered_to = end
    span_us = (spans[-1][1] - spans[0][0]) if spans else 0.0
    print(f"host: enqueue {enqueue_ms:.3f} ms/step (no sync), GPU step {gpu_step_ms:.3f} ms; "
          f"profiled 2 steps: kernels busy {busy_us / 1e3:.3f} ms of a {span_us / 1e3:.3f} ms span "
          f"(GPU idle {(span_us - busy_us) / 1e3:.3f} ms)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows,
                                    max_name_column_width=90))
    if a.trace:
        prof.export_chrome_trace(a.trace)
        print(f"trace: {a.trace}")


def profile_clocks(step, seconds):
    """Steady-state clocks: a single profiled step after a sync starts from a cooler chip, so its
    kernels can run faster than the same kernels back to back under the power limit. Runs steps
    back to back for `seconds` while nvidia-smi samples, then prints the step time next to the
    clocks it ran at."""
    ms, steps, clocks = gpu_clocks.back_to_back(step, seconds, batch=5)
    print(f"clocks: {steps} back-to-back steps, {ms:.3f} ms a step; {gpu_clocks.describe(clocks)}")


if __name__ == "__main__":
    main()
