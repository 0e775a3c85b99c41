#!/usr/bin/env python3
"""Benchmark one MoE layer, forward + backward: moeblaze against PyTorch baselines and peers.

    python3 bench/run_bench.py [--out DIR] [--configs conf1,mixtral] [--acts swiglu,silu]
                               [--impls grouped_mm,loop,sonicmoe,megablocks,moeblaze]
                               [--mode experts|layer]
                               [--quick] [--report | --publish]
    python3 bench/run_bench.py --merge RUN.json MORE.json [...] [--out DIR] [--report | --publish]

--mode experts (the default) times the expert layer with the routing given (x, ids, g): moeblaze
with each checkpoint policy, the per-expert loop, the sort -> torch._grouped_mm dataflow, and
SonicMoE and MegaBlocks (dMoE's experts) when they are importable (bench/peers.py; a visible
skipped row otherwise). --mode layer times the whole layer as users call it, router included:
moeblaze.torch.moe_layer, sonicmoe.MoE, megablocks' dMoE and a PyTorch router + grouped_mm layer,
all with top-k-then-softmax routing. For every configuration in
bench/configs.json x activation x implementation it measures, on the same inputs:

* ms      median of CUDA-event-timed fwd+bwd (torch.autograd.grad of y against dy), after warm-up,
          L2 flushed before every repetition (triton do_bench style); the number of repetitions
          fits the time budget (--budget-s).
* tflops  useful FLOPs / time: 18*T*k*d*h (gated) or 12*T*k*d*h; recompute's extra GEMM is not
          counted.
* saved_bytes  unique storages the forward hands to autograd (saved_tensors_hooks), excluding the
          inputs x, ids, g and the weights.
* peak_bytes   max_memory_allocated during fwd+bwd minus memory_allocated before it (includes the
          outputs y, dx, dg, dw_*).
* rel_err ||out - ref|| / ||ref|| for y, dx, dw_gate, dw_up, dw_down, dg (layer mode: dw_router
          instead of dg); the reference is the loop baseline in fp32 (CUDA, TF32 off) or fp64 (CPU)
          on upcast inputs, run over chunks of tokens (exact: y, dx, dg are per token and dw sums
          over chunks). NaN/Inf is an error. In layer mode each implementation routes from its own
          low-precision logits, so a near-tie may pick another expert than the reference does:
          there rel_err is reported but not held to the tolerance.
* bitwise_repeat  whether a second run gave bitwise identical outputs and gradients.

--merge joins runs of one build on one device into one result set (a table too long for one
session's time, measured in parts): each (configuration, activation) comes whole from the last run
that measured it, so every ratio still compares rows timed side by side in one process.

Results: DIR/<YYYY-MM-DD>-<device>.json (rows as described in docs/performance.md). A summary table
is printed last. On CUDA every configuration runs in a child process (a crash or hang loses only
that configuration; a sticky CUDA error cannot poison the rest); rows are written as they finish.
"""

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import torch  # noqa: E402

import baselines  # noqa: E402
import gpu_clocks  # noqa: E402
import peers  # noqa: E402
import roofline  # noqa: E402

GRAD_NAMES = ("dx", "dg", "dw_gate", "dw_up", "dw_down")
ERR_NAMES = ("y",) + GRAD_NAMES
# --mode layer: the leaves are x and all four weights; the routing comes from the router
LAYER_GRAD_NAMES = ("dx", "dw_router", "dw_gate", "dw_up", "dw_down")
LAYER_ERR_NAMES = ("y",) + LAYER_GRAD_NAMES
ALL_POLICIES = ("save_preact", "save_all", "recompute")
ALL_IMPLS = ("grouped_mm", "loop", "sonicmoe", "megablocks", "moeblaze")
BASELINES = ("grouped_mm", "loop", "sonicmoe", "megablocks")  # timed before moeblaze
PEERS = ("sonicmoe", "megablocks")  # libraries imported when installed (bench/peers.py)
BASELINE_POLICY = "autograd"
# a peer's own saving scheme (SonicMoE: x and the pre-activation; MegaBlocks: its default
# Arguments, memory_optimized_mlp off)
PEER_POLICY = "default"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp64": torch.float64}
# rel_err above this flags a row (err_ok = false); bf16/fp16 operands land at 1e-3..1e-2.
ERR_TOLERANCE = {"bf16": 3e-2, "fp16": 1e-2, "fp32": 1e-4, "fp64": 1e-10}
L2_FLUSH_BYTES = 256 << 20
# nvidia-smi's sampling interval while a row's repetitions run (about 1 s: some 20 samples)
ROW_CLOCK_INTERVAL_MS = 50
STICKY_CUDA_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                      "misaligned address", "illegal instruction", "an illegal",
                      "CUDA error: uncorrectable", "cudaErrorLaunchFailure")
EXIT_STICKY = 3


def log(msg):
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="all",
                   help="comma-separated configuration names (default: all)")
    p.add_argument("--configs-file", default=os.path.join(HERE, "configs.json"))
    p.add_argument("--acts", default="swiglu,silu",
                   help=f"comma-separated activations among {','.join(baselines.ACTIVATIONS)}")
    p.add_argument("--impls", default=",".join(ALL_IMPLS),
                   help="comma-separated among " + ",".join(ALL_IMPLS) + " (a peer that cannot "
                        "be imported gives skipped rows with the reason)")
    p.add_argument("--mode", default="experts", choices=("experts", "layer"),
                   help="experts: the expert layer with the routing given; layer: router + "
                        "experts as users call them (loop is not run in this mode)")
    p.add_argument("--parallel-warmup", default="auto", choices=("auto", "on", "off"),
                   help="CUDA: start every configuration's child process at once, let each "
                        "compile its JIT kernels (SonicMoE's take ~100 s a shape) on a tiny "
                        "problem, wait until all have, then measure one at a time (a file lock); "
                        "auto = on when sonicmoe is among --impls")
    p.add_argument("--policies", default=",".join(ALL_POLICIES),
                   help="moeblaze checkpoint policies (save_preact is the one compared for speed)")
    p.add_argument("--keep-saved", action="store_true",
                   help="moeblaze backward keeps its saved buffer intact (consume_saved=False); "
                        "default: it writes its activation gradients over it, as "
                        "moeblaze.torch does by default")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--out", default=os.path.join(REPO, "build", "bench"),
                   help="folder for this run's JSON (default: build/bench, git-ignored)")
    p.add_argument("--publish", action="store_true",
                   help="make this run the committed result set: bench/results/latest.json, its "
                        "report and plots, and the tables in docs/performance.md; with --mode "
                        "layer, bench/results/layer.json and the whole-layer table "
                        "(bench/make_report.py --publish)")
    p.add_argument("--merge", nargs="+", metavar="RUN_JSON", default=None,
                   help="join these results JSONs (one device, one library build) into "
                        "DIR/<first's name>-merged.json instead of running: each (configuration, "
                        "activation) from the last of them that measured any of its rows")
    p.add_argument("--quick", action="store_true", help="3 repetitions, for smoke runs")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="wall-clock budget for the whole run; repetitions are planned to fit")
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--max-reps", type=int, default=50)
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="time the implementations of a configuration and activation in ROUNDS "
                        "rounds of alternating order (as planned, then reversed), each row's "
                        "repetitions split over them, so the card's drift and the order of the "
                        "rows fall on every implementation alike; a row's ms is the median over "
                        "all its repetitions, ms_rounds each round's median (0 or 1: each row "
                        "times its repetitions in one block, right after its checks)")
    p.add_argument("--row-timing-s", type=float, default=1.5,
                   help="at most this long in timed repetitions per row")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-ref", action="store_true", help="skip the high-precision reference")
    p.add_argument("--ref-chunk-gib", type=float, default=4.0,
                   help="activation memory per reference chunk of tokens")
    p.add_argument("--no-isolate", action="store_true",
                   help="run every configuration in this process (default on CPU)")
    p.add_argument("--isolate", action="store_true",
                   help="run configurations in child processes also on CPU (default on CUDA)")
    p.add_argument("--config-timeout-s", type=float, default=None,
                   help="kill a child that spends longer on one configuration (default: "
                        "max(90 s, 3x its share of the budget))")
    p.add_argument("--allow-shim", action="store_true",
                   help="DEVELOPMENT ONLY: if moeblaze cannot be imported, time the loop baseline "
                        "under the moeblaze name (rows are marked impl_source=SHIM)")
    p.add_argument("--report", action="store_true",
                   help="also write the markdown table and PNG plots into --out (make_report.py)")
    p.add_argument("--emulate-grouped-mm", action="store_true",
                   help="TESTS ONLY: run the grouped_mm dataflow with a host-synchronising "
                        "per-group matmul where torch has no grouped_mm (never time this)")
    p.add_argument("--dense-reference-s", type=float, default=None,
                   help="CUDA: before the configurations, time back-to-back 8192^3 matmuls in the "
                        "run's dtype this long (0: skip; default 6, 2 with --quick) and sample the "
                        "clocks meanwhile; the header records the sustained rate, the ceiling "
                        "under the card's power limit (not part of --budget-s)")
    p.add_argument("--no-clock-samples", action="store_true",
                   help="CUDA: do not sample SM clock, power and clock-event reasons with "
                        "nvidia-smi during the run")
    p.add_argument("--gpu-lock", default=None,
                   help="with the parallel warm-up: the lock file that serialises measurements; "
                        "give two runs started side by side (an experts and a layer run) the same "
                        "one, and neither measures while the other does (default: one per run)")
    p.add_argument("--child-state", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-go", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.interleave < 0:
        p.error(f"--interleave {args.interleave}: a number of rounds, 0 or more")
    if args.quick:
        args.min_reps = args.max_reps = 3
    if args.dense_reference_s is None:
        args.dense_reference_s = 2.0 if args.quick else 6.0
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.acts = [a.strip() for a in args.acts.split(",") if a.strip()]
    for act in args.acts:
        baselines.is_gated(act)  # raises on unknown names
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for impl in args.impls:
        if impl not in ALL_IMPLS:
            p.error(f"unknown impl {impl!r}")
    if args.mode == "layer":
        args.impls = [i for i in args.impls if i != "loop"]
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for policy in args.policies:
        if policy not in ALL_POLICIES:
            p.error(f"unknown policy {policy!r}")
    return args


def load_configs(args):
    with open(args.configs_file) as f:
        configs = json.load(f)["configs"]
    if args.configs != "all":
        wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
        by_name = {c["name"]: c for c in configs}
        missing = [w for w in wanted if w not in by_name]
        if missing:
            raise SystemExit(f"unknown configuration(s) {missing}; have {sorted(by_name)}")
        configs = [by_name[w] for w in wanted]
    return configs


def row_plan(args):
    """(impl, policy) in the order rows run: baselines first, so a moeblaze crash loses nothing."""
    plan = []
    for impl in BASELINES:
        if impl in args.impls:
            plan.append((impl, policy_of(impl)))
    if "moeblaze" in args.impls:
        for policy in ALL_POLICIES:
            if policy in args.policies:
                plan.append(("moeblaze", policy))
    return plan


def policy_of(impl):
    """The policy name of a baseline's row: a peer's own scheme or plain autograd."""
    return PEER_POLICY if impl in PEERS else BASELINE_POLICY


def grad_names(args):
    return LAYER_GRAD_NAMES if args.mode == "layer" else GRAD_NAMES


def err_names(args):
    return LAYER_ERR_NAMES if args.mode == "layer" else ERR_NAMES


# ------------------------------------------------------------------------------------------------
# Environment facts
# ------------------------------------------------------------------------------------------------


def git_commit():
    for key in ("MOEBLAZE_COMMIT", "GIT_COMMIT"):
        if os.environ.get(key):
            return os.environ[key]
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0:
            commit = out.stdout.strip()
            dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                    "--untracked-files=no"], capture_output=True, text=True,
                                   timeout=10)
            return commit + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def commit_mismatch(commit, build_info):
    """A message when the library's build-info revision ("(git <hex>[-dirty])") names another
    commit than the one recorded for the run, else None (also when either cannot be read: a
    MOEBLAZE_COMMIT that is not a hash, "unknown", no library). A copy of the tree whose .git is
    not its commit's records the wrong commit; so does a library built from another checkout."""
    m = re.search(r"\(git ([0-9a-f]{7,40})(-dirty)?\)", build_info or "")
    recorded = (commit or "").removesuffix("-dirty")
    if not m or not re.fullmatch(r"[0-9a-f]{7,40}", recorded):
        return None
    built = m.group(1)
    if recorded.startswith(built) or built.startswith(recorded):
        return None
    return (f"the library was built at commit {built}, the run records {commit}: the recorded commit "
            f"is the checkout's HEAD (or $MOEBLAZE_COMMIT); set MOEBLAZE_COMMIT to the commit of "
            f"the tree that ran")


def device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return "cpu"


def device_slug(name):
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def environment(args):
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "dtype": args.dtype,
           "grouped_mm_available": baselines.grouped_mm_available(),
           "moeblaze_consume_saved": not args.keep_saved, "peers": peers.peer_versions()}
    if args.device == "cuda":
        prop = torch.cuda.get_device_properties(0)
        env.update({"cuda": torch.version.cuda, "sm_count": prop.multi_processor_count,
                    "total_memory": prop.total_memory,
                    "capability": f"{prop.major}.{prop.minor}"})
    mb, source = import_moeblaze(args)
    env["moeblaze"] = source
    if mb is not None:
        try:
            import moeblaze
            env["moeblaze_build_info"] = moeblaze.build_info()
            env["moeblaze_library"] = moeblaze.library_path()
        except Exception as error:  # noqa: BLE001 (facts only)
            env["moeblaze_build_info"] = f"unavailable: {error}"
    return env


# ------------------------------------------------------------------------------------------------
# Implementations
# ------------------------------------------------------------------------------------------------

_moeblaze_cache = {}


def import_moeblaze(args):
    """(moe_experts callable or None, description). Never raises."""
    if "result" in _moeblaze_cache:
        return _moeblaze_cache["result"]
    sys.path.insert(0, os.path.join(REPO, "bindings", "python"))
    try:
        import moeblaze
        import moeblaze.torch as mbt
        moeblaze.build_info()  # loads the library now, so a missing one is reported here
        result = (mbt.moe_experts, "bindings/python moeblaze.torch.moe_experts")
    except Exception as error:  # noqa: BLE001
        if args.allow_shim:
            log(f"WARNING: moeblaze import failed ({error!r}); using the DEVELOPMENT SHIM "
                f"(the loop baseline) under the moeblaze name")

            def shim(x, ids, g, w_gate, w_up, w_down, *, activation, checkpoint, **_options):
                return baselines.moe_loop(x, ids, g, w_gate, w_up, w_down, activation)

            result = (shim, "SHIM: loop baseline, NOT moeblaze")
        else:
            result = (None, f"import failed: {type(error).__name__}: {error}")
    _moeblaze_cache["result"] = result
    return result


class Impl:
    """One implementation as the harness drives it.

    fn(x, ids, g, w_gate, w_up, w_down) -> y (experts mode) or fn(x, w_router, w_gate, w_up,
    w_down) -> (y, aux_loss) (layer mode), on the tensors prepare() made; prepare(inputs) builds the
    implementation's own weight layout once per row, outside the measured region; canonical(grads)
    maps its gradients (a dict by gradient name) back to the canonical layout for the accuracy
    check. leaves(native, args) gives the tensors to differentiate (by default fresh leaves over
    the prepared inputs; a module's own parameters for a peer's nn.Module). `skip` is a reason not
    to run the row at all (a peer that is not installed)."""

    def __init__(self, fn=None, prepare=None, canonical=None, skip=None, leaves=None):
        self.fn = fn
        self.prepare = prepare or (lambda inputs: inputs)
        self.canonical = canonical or (lambda grads: grads)
        self.leaves = leaves or leaves_of
        self.skip = skip


def make_impl(impl, policy, activation, args, cfg):
    """The Impl for one row."""
    if args.mode == "layer":
        return make_layer_impl(impl, policy, activation, args, cfg["k"])
    if impl == "loop":
        return Impl(lambda x, ids, g, wg, wu, wd: baselines.moe_loop(x, ids, g, wg, wu, wd,
                                                                     activation))
    if impl == "grouped_mm":
        if args.emulate_grouped_mm:
            return Impl(lambda x, ids, g, wg, wu, wd: baselines.moe_grouped_mm(
                x, ids, g, wg, wu, wd, activation, grouped_mm=baselines.grouped_mm_emulated))
        if not baselines.grouped_mm_available():
            return Impl(skip=f"torch {torch.__version__} has no torch._grouped_mm / "
                             f"F.grouped_mm")
        return Impl(lambda x, ids, g, wg, wu, wd: baselines.moe_grouped_mm(x, ids, g, wg, wu, wd,
                                                                           activation))
    if impl == "sonicmoe":
        reason = peers.sonicmoe_unsupported(activation, DTYPES[args.dtype], args.device)
        if reason:
            return Impl(skip=reason)
        gated = baselines.is_gated(activation)

        def prepare(inputs):
            native = dict(inputs)
            native["w_gate"] = peers.fuse_up_projection(inputs["w_gate"], inputs["w_up"])
            native["w_up"] = None
            return native

        def canonical(grads):
            out = dict(grads)
            out["dw_gate"], out["dw_up"] = peers.split_up_projection(grads["dw_gate"], gated)
            return out

        def fn(x, ids, g, w1, _w_up, wd):
            # the routed pairs in (t, j) order: what SonicMoE's given-routing entry point takes
            token_indices = peers.token_order_indices(ids.shape[0], ids.shape[1], ids.device)
            return peers.sonicmoe_experts(x, g, w1, wd, ids, token_indices, activation)

        return Impl(fn, prepare, canonical)
    if impl == "megablocks":
        return megablocks_experts_impl(activation, args, cfg)
    if impl == "moeblaze":
        fn, source = import_moeblaze(args)
        if fn is None:
            raise RuntimeError(f"moeblaze unavailable: {source}")
        extra = {"consume_saved": False} if args.keep_saved else {}
        return Impl(lambda x, ids, g, wg, wu, wd: fn(x, ids, g, wg, wu, wd, activation=activation,
                                                     checkpoint=policy, **extra))
    raise ValueError(impl)


def make_layer_impl(impl, policy, activation, args, top_k):
    """Layer mode: router + experts; every implementation routes top-k of the logits, then a
    softmax over the k chosen, and returns its switch (load-balancing) loss, which the backward
    includes."""
    if impl == "grouped_mm":
        if not baselines.grouped_mm_available() and not args.emulate_grouped_mm:
            return Impl(skip=f"torch {torch.__version__} has no torch._grouped_mm / "
                             f"F.grouped_mm")
        gmm = baselines.grouped_mm_emulated if args.emulate_grouped_mm else None
        return Impl(lambda x, wr, wg, wu, wd: baselines.moe_layer_grouped_mm(
            x, wr, wg, wu, wd, top_k, activation, grouped_mm=gmm))
    if impl == "sonicmoe":
        reason = peers.sonicmoe_unsupported(activation, DTYPES[args.dtype], args.device)
        if reason:
            return Impl(skip=reason)
        gated = baselines.is_gated(activation)
        holder = {}

        def prepare(inputs):
            d, h, E = inputs["x"].shape[1], inputs["w_down"].shape[2], inputs["w_down"].shape[0]
            layer = peers.sonicmoe_layer(d, h, E, top_k, activation,
                                         inputs["w_router"], inputs["w_gate"], inputs["w_up"],
                                         inputs["w_down"])
            holder["layer"] = layer
            native = dict(inputs)
            native["w_router"] = layer.router.weight
            native["w_gate"] = layer.c_fc.weight
            native["w_up"] = None
            native["w_down"] = layer.c_proj.weight
            return native

        def fn(x, _wr, _wg, _wu, _wd):
            return holder["layer"](x)

        def leaves(native, _args):
            layer = holder["layer"]
            return [native["x"].detach().requires_grad_(True), layer.router.weight,
                    layer.c_fc.weight, None, layer.c_proj.weight]

        def canonical(grads):
            out = dict(grads)
            out["dw_gate"], out["dw_up"] = peers.split_up_projection(grads["dw_gate"], gated)
            return out

        return Impl(fn, prepare, canonical, leaves=leaves)
    if impl == "megablocks":
        return megablocks_layer_impl(activation, args, top_k)
    if impl == "moeblaze":
        fn, source = import_moeblaze(args)
        if fn is None:
            raise RuntimeError(f"moeblaze unavailable: {source}")
        import moeblaze.torch as mbt
        extra = {"consume_saved": False} if args.keep_saved else {}

        def layer(x, wr, wg, wu, wd):
            y, losses = mbt.moe_layer(x, wr, wg, wu, wd, top_k=top_k,
                                      activation=activation, checkpoint=policy,
                                      score_function="topk_softmax", aux_loss_coeff=1.0,
                                      **extra)[:2]
            return y, losses[0]

        return Impl(layer)
    raise ValueError(impl)


def megablocks_canonical(num_experts):
    """Maps MegaBlocks' [E*h, d] weight gradients back to the canonical layout."""
    def canonical(grads):
        out = dict(grads)
        out["dw_gate"], out["dw_up"], out["dw_down"] = peers.from_megablocks_weights(
            grads["dw_gate"], grads["dw_up"], grads["dw_down"], num_experts)
        return out
    return canonical


def megablocks_experts_impl(activation, args, cfg):
    """Experts mode: the dMoE's ParallelDroplessMLP.forward_once with the routing given; its own
    parameters (built once from the canonical weights) are the weight leaves."""
    reason = peers.megablocks_unsupported(activation, DTYPES[args.dtype], args.device)
    if reason:
        return Impl(skip=reason)
    gated = baselines.is_gated(activation)
    holder = {}

    def prepare(inputs):
        experts = peers.megablocks_experts_module(cfg["d"], cfg["h"], cfg["E"], cfg["k"],
                                                  activation, inputs["w_gate"], inputs["w_up"],
                                                  inputs["w_down"])
        holder["experts"] = experts
        native = dict(inputs)
        native["w_gate"], native["w_up"], native["w_down"] = peers.megablocks_parameters(
            experts.mlp, gated)
        return native

    def fn(x, ids, g, _w1, _v1, _w2):
        return peers.megablocks_experts(holder["experts"], x, ids, g)

    def leaves(native, _args):
        return [native["x"].detach().requires_grad_(True),
                native["g"].detach().requires_grad_(True),
                *peers.megablocks_parameters(holder["experts"].mlp, gated)]

    return Impl(fn, prepare, megablocks_canonical(cfg["E"]), leaves=leaves)


def megablocks_layer_impl(activation, args, top_k):
    """Layer mode: a megablocks dMoE holding the canonical weights; its load-balancing loss (weight
    1) is the switch loss of the other layer rows."""
    reason = peers.megablocks_unsupported(activation, DTYPES[args.dtype], args.device)
    if reason:
        return Impl(skip=reason)
    gated = baselines.is_gated(activation)
    holder = {}

    def prepare(inputs):
        E, d, h = inputs["w_down"].shape
        layer = peers.megablocks_layer(d, h, E, top_k, activation, inputs["w_router"],
                                       inputs["w_gate"], inputs["w_up"], inputs["w_down"])
        holder["layer"], holder["E"] = layer, E
        native = dict(inputs)
        native["w_router"] = layer.router.layer.weight
        native["w_gate"], native["w_up"], native["w_down"] = peers.megablocks_parameters(
            layer.experts.mlp, gated)
        return native

    def fn(x, _wr, _w1, _v1, _w2):
        return peers.megablocks_layer_forward(holder["layer"], x)

    def leaves(native, _args):
        layer = holder["layer"]
        return [native["x"].detach().requires_grad_(True), layer.router.layer.weight,
                *peers.megablocks_parameters(layer.experts.mlp, gated)]

    def canonical(grads):
        return megablocks_canonical(holder["E"])(grads)

    return Impl(fn, prepare, canonical, leaves=leaves)


# ------------------------------------------------------------------------------------------------
# Inputs and reference
# ------------------------------------------------------------------------------------------------


def config_seed(args, cfg):
    # same x, routing and weights for every activation and implementation of a configuration
    return args.seed + zlib.crc32(cfg["name"].encode()) % 100000


def make_inputs(cfg, activation, args):
    T, d, h, E, k = cfg["T"], cfg["d"], cfg["h"], cfg["E"], cfg["k"]
    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    route_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    seed = config_seed(args, cfg)
    torch.manual_seed(seed)
    gen_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, dtype=gen_dtype) * scale).to(dtype)

    x = randn(T, d)
    # routing per configs.json: logits ~ N(0,1), softmax, top-k, renormalised
    logits = torch.randn(T, E, device=dev, dtype=torch.float32)
    probs = torch.softmax(logits, dim=-1)
    top, ids = torch.topk(probs, k, dim=-1)
    g = (top / top.sum(dim=-1, keepdim=True)).to(route_dtype)
    ids = ids.to(torch.int32).contiguous()
    w_gate = randn(E, h, d, scale=d ** -0.5)
    w_up = randn(E, h, d, scale=d ** -0.5) if baselines.is_gated(activation) else None
    w_down = randn(E, d, h, scale=h ** -0.5)
    dy = randn(T, d)
    # layer mode: a router whose logits x . w_router^T are ~ N(0, 1) like the ones drawn above
    w_router = randn(E, d, scale=d ** -0.5) if args.mode == "layer" else None
    del logits, probs, top
    return {"x": x, "ids": ids, "g": g.contiguous(), "w_gate": w_gate, "w_up": w_up,
            "w_down": w_down, "w_router": w_router, "dy": dy, "seed": seed}


def leaf_names(args):
    """The differentiable inputs, in grad_names(args) order."""
    if args.mode == "layer":
        return ("x", "w_router", "w_gate", "w_up", "w_down")
    return ("x", "g", "w_gate", "w_up", "w_down")


def leaves_of(inputs, args=None):
    """Fresh leaf tensors that require grad, in grad_names order (None for a missing w_up)."""
    out = []
    for name in leaf_names(args) if args is not None else ("x", "g", "w_gate", "w_up", "w_down"):
        t = inputs[name]
        out.append(None if t is None else t.detach().requires_grad_(True))
    return out


def reference(cfg, activation, inputs, args):
    """fp32 (CUDA, TF32 off) / fp64 (CPU) loop baseline on upcast inputs, over token chunks."""
    ref_dtype = torch.float64 if args.device == "cpu" else torch.float32
    if args.mode == "layer":
        return layer_reference(cfg, activation, inputs, args, ref_dtype)
    T, d, h, k = cfg["T"], cfg["d"], cfg["h"], cfg["k"]
    elem = torch.finfo(ref_dtype).bits // 8
    per_token = k * (d + 6 * h) * elem * 2  # autograd's saved tensors + transients, rough
    chunk = max(1, min(T, int(args.ref_chunk_gib * (1 << 30) // per_token)))
    up = {name: (None if inputs[name] is None else inputs[name].detach().to(ref_dtype, copy=True))
          for name in ("x", "w_gate", "w_up", "w_down", "dy")}
    g = inputs["g"].to(ref_dtype)
    weights = [None if up[n] is None else up[n].requires_grad_(True)
               for n in ("w_gate", "w_up", "w_down")]
    ys, dxs, dgs = [], [], []
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        xc = up["x"][start:end].detach().requires_grad_(True)
        gc_ = g[start:end].detach().requires_grad_(True)
        yc = baselines.moe_loop(xc, inputs["ids"][start:end], gc_, weights[0], weights[1],
                                weights[2], activation)
        yc.backward(up["dy"][start:end])  # weight grads accumulate over chunks in ref_dtype
        ys.append(yc.detach())
        dxs.append(xc.grad)
        dgs.append(gc_.grad)
    ref = {"y": torch.cat(ys), "dx": torch.cat(dxs), "dg": torch.cat(dgs),
           "dw_gate": weights[0].grad, "dw_up": None if weights[1] is None else weights[1].grad,
           "dw_down": weights[2].grad}
    return ref, {"dtype": str(ref_dtype).replace("torch.", ""), "chunk_tokens": chunk,
                 "chunks": math.ceil(T / chunk)}


def layer_reference(cfg, activation, inputs, args, ref_dtype):
    """Layer mode: baselines.moe_layer over the loop in ref_dtype, over token chunks; the switch
    loss uses the whole batch's expert fractions, so the chunks' gradients sum to the batch's."""
    T, d, h, k, E = cfg["T"], cfg["d"], cfg["h"], cfg["k"], cfg["E"]
    elem = torch.finfo(ref_dtype).bits // 8
    per_token = k * (d + 6 * h) * elem * 2
    chunk = max(1, min(T, int(args.ref_chunk_gib * (1 << 30) // per_token)))
    up = {name: (None if inputs[name] is None else inputs[name].detach().to(ref_dtype, copy=True))
          for name in ("x", "w_router", "w_gate", "w_up", "w_down", "dy")}
    with torch.no_grad():
        ids = torch.cat([torch.topk(up["x"][s:s + chunk] @ up["w_router"].t(), k, dim=-1).indices
                         for s in range(0, T, chunk)])
        fractions = baselines.expert_fractions(ids, E, torch.float64 if ref_dtype == torch.float64
                                               else torch.float32)
    del ids
    weights = [None if up[n] is None else up[n].requires_grad_(True)
               for n in ("w_router", "w_gate", "w_up", "w_down")]
    ys, dxs = [], []
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        xc = up["x"][start:end].detach().requires_grad_(True)
        yc, aux = baselines.moe_layer(xc, *weights, k, activation, fractions=fractions,
                                      num_tokens=T)
        torch.autograd.backward([yc, aux], [up["dy"][start:end], torch.ones_like(aux)])
        ys.append(yc.detach())
        dxs.append(xc.grad)
    ref = {"y": torch.cat(ys), "dx": torch.cat(dxs), "dw_router": weights[0].grad,
           "dw_gate": weights[1].grad, "dw_up": None if weights[2] is None else weights[2].grad,
           "dw_down": weights[3].grad}
    return ref, {"dtype": str(ref_dtype).replace("torch.", ""), "chunk_tokens": chunk,
                 "chunks": math.ceil(T / chunk)}


def relative_error(out, ref):
    """||out - ref|| / ||ref|| accumulated in fp64 over chunks (bounded temporary memory)."""
    if out is None or ref is None:
        return None
    a = out.detach().reshape(-1)
    b = ref.detach().reshape(-1)
    if a.numel() != b.numel():
        return float("nan")
    num = 0.0
    den = 0.0
    step = 1 << 26
    for s in range(0, a.numel(), step):
        da = a[s:s + step].to(torch.float64)
        db = b[s:s + step].to(torch.float64)
        num += float(torch.sum((da - db) ** 2))
        den += float(torch.sum(db ** 2))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return math.sqrt(num / den)


# ------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------


def storage_key(t):
    try:
        s = t.untyped_storage()
    except AttributeError:  # torch < 2.0
        s = t.storage()
    return s.data_ptr(), s.nbytes()


class SavedTensorRecorder:
    """Records the storages the forward saves for backward (data_ptr -> nbytes)."""

    def __init__(self, exclude_ptrs):
        self.exclude = set(exclude_ptrs)
        self.storages = {}
        self.count = 0

    def pack(self, t):
        self.count += 1
        if t.numel() > 0:
            ptr, nbytes = storage_key(t)
            if ptr not in self.exclude:
                self.storages[ptr] = max(nbytes, self.storages.get(ptr, 0))
        # detach: returning the tensor itself would make a saved output keep its own grad_fn
        return t.detach()

    @staticmethod
    def unpack(t):
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def total(self):
        return sum(self.storages.values())


def sync(args):
    if args.device == "cuda":
        torch.cuda.synchronize()


def fwd_bwd(fn, inputs, leaves, hooks=None, layer=False):
    """One forward + backward: (y, gradients in leaf order). Experts mode: fn(x, ids, g, w_gate,
    w_up, w_down) -> y, backward of y with dy. Layer mode: fn(x, w_router, w_gate, w_up, w_down)
    -> (y, aux_loss), backward of y with dy plus aux_loss with 1."""
    with hooks if hooks is not None else contextlib.nullcontext():
        if layer:
            y, aux = fn(*leaves)
        else:
            x, g, wg, wu, wd = leaves
            y, aux = fn(x, inputs["ids"], g, wg, wu, wd), None
    wanted = [t for t in leaves if t is not None]
    outputs, seeds = [y], [inputs["dy"]]
    if aux is not None:
        outputs.append(aux)
        seeds.append(torch.ones_like(aux))
    grads = torch.autograd.grad(outputs, wanted, seeds)
    it = iter(grads)
    return y.detach(), [None if t is None else next(it) for t in leaves]


def time_reps(step, reps, args):
    """Per-repetition times in ms; the L2 is flushed before each repetition."""
    times = []
    if args.device == "cuda":
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            flush.zero_()
            starts[i].record()
            step()
            ends[i].record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        del flush
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def percentile(sorted_values, q):
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def is_sticky_cuda_error(error):
    text = str(error)
    return any(s in text for s in STICKY_CUDA_ERRORS)


def timing_reps(row_budget_s, est_ms, args):
    """Timed repetitions for a row whose one step took est_ms: as many as fill row_budget_s,
    within [min_reps, max_reps]; a very slow row still gets 3, not min_reps, so it cannot eat the
    budget."""
    reps = int(row_budget_s * 1e3 / max(est_ms, 1e-3))
    return max(min(args.min_reps, 3) if reps < args.min_reps else args.min_reps,
               min(args.max_reps, reps))


def fill_timing(row, times, clock_summary):
    """A row's timing fields from its repetitions' times (ms) and its clock samples' summary."""
    times = sorted(times)
    row["reps"] = len(times)
    row["ms"] = statistics.median(times)
    row["ms_min"] = times[0]
    row["ms_p20"] = percentile(times, 0.2)
    row["ms_p80"] = percentile(times, 0.8)
    row["tflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e12
    row.update(gpu_clocks.row_clocks(clock_summary, row["ms"]))


def samples_clocks(args):
    """Whether the rows' timed repetitions run under a clock sampler."""
    return args.device == "cuda" and not args.no_clock_samples


def timed_block(step, reps, est_ms, args):
    """One block of a row's timed repetitions: (times in ms, clock samples while they ran)."""
    if est_ms < 250:
        step()  # one more warm-up right before timing (slow rows are warm enough by now)
    with (gpu_clocks.ClockSampler(interval_ms=ROW_CLOCK_INTERVAL_MS) if samples_clocks(args)
          else contextlib.nullcontext()) as sampler:
        times = time_reps(step, reps, args)
    return times, (sampler.samples if sampler else [])


def clock_summary(samples, args):
    """The summary of clock samples gathered over one or more blocks (None: not sampling)."""
    if not samples_clocks(args):
        return None
    sampler = gpu_clocks.ClockSampler(interval_ms=ROW_CLOCK_INTERVAL_MS)
    sampler.samples = list(samples)
    return sampler.summary()


class PendingTiming:
    """A row whose checks are done and whose repetitions are timed later, interleaved with the
    other rows of its configuration and activation (--interleave); holds the step, and with it the
    implementation's state, until then."""

    def __init__(self, row, step, reps, est_ms):
        self.row, self.step, self.reps, self.est_ms = row, step, reps, est_ms
        self.times, self.samples, self.round_ms = [], [], []


def interleave_timing(pending, rounds, args, order_log=None):
    """Times the pending rows in `rounds` rounds, the rows in their order on even rounds and
    reversed on odd ones, each row's repetitions split evenly over the rounds (at least one a
    round), then fills each row's timing fields from all its repetitions. A row whose step raises
    records the error and leaves the later rounds. order_log (tests): each block's row, in order."""
    failed = set()
    for round_index in range(rounds):
        order = pending if round_index % 2 == 0 else pending[::-1]
        for p in order:
            if id(p) in failed:
                continue
            try:
                times, samples = timed_block(p.step, max(1, -(-p.reps // rounds)), p.est_ms, args)
            except Exception as error:  # noqa: BLE001 (recorded, the other rows go on)
                p.row["error"] = " ".join(f"timing: {type(error).__name__}: {error}".split())
                if args.device == "cuda" and (is_sticky_cuda_error(error) or
                                              not cuda_still_usable()):
                    p.row["sticky_cuda_error"] = True
                failed.add(id(p))
                continue
            if order_log is not None:
                order_log.append(p.row["impl"])
            p.times += times
            p.samples += samples
            p.round_ms.append(statistics.median(times))
    for p in pending:
        if id(p) in failed:
            continue
        fill_timing(p.row, p.times, clock_summary(p.samples, args))
        p.row["timing_rounds"] = rounds
        p.row["ms_rounds"] = p.round_ms
        p.step = None  # the implementation's state can go


def run_row(cfg, activation, impl, policy, inputs, ref, args, row_budget_s, deferred=None):
    """Measures one row; fills what it can and records the first error. With `deferred` (a list)
    a row that passed its checks is not timed here: a PendingTiming goes on the list instead."""
    T, d, h, E, k = cfg["T"], cfg["d"], cfg["h"], cfg["E"], cfg["k"]
    flops = roofline.flops(cfg, activation)
    elem = torch.finfo(DTYPES[args.dtype]).bits // 8
    row = {"config": cfg["name"], "act": activation, "impl": impl, "policy": policy,
           "T": T, "d": d, "h": h, "E": E, "k": k, "dtype": args.dtype, "flops": flops,
           "ms": None, "tflops": None, "saved_bytes": None, "peak_bytes": None,
           "rel_err": {name: None for name in err_names(args)},
           "saved_bytes_model": roofline.saved_bytes_model(impl, policy, cfg, activation, elem),
           "seed": inputs["seed"], "error": None, "mode": args.mode}
    if impl == "moeblaze":
        row["impl_source"] = import_moeblaze(args)[1]
    layer = args.mode == "layer"
    stage = "setup"
    try:
        _injected_fault(cfg, impl)
        subject = make_impl(impl, policy, activation, args, cfg)
        if subject.skip:
            row["skipped"] = subject.skip
            return row
        if impl == "moeblaze" and row["impl_source"].startswith("bindings") and not layer:
            row["saved_bytes_library"] = library_saved_size(cfg, activation, policy, args)
        native = subject.prepare(inputs)
        fn = subject.fn

        stage = "warm-up"
        leaves = subject.leaves(native, args)
        out = fwd_bwd(fn, native, leaves, layer=layer)
        del out
        sync(args)

        stage = "memory"
        gc.collect()
        input_ptrs = [storage_key(t)[0] for t in
                      (*[v for v in inputs.values() if isinstance(v, torch.Tensor)],
                       *[v for v in native.values() if isinstance(v, torch.Tensor)], *leaves)
                      if t is not None]
        recorder = SavedTensorRecorder(input_ptrs)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        y, grads = fwd_bwd(fn, native, leaves, hooks=recorder.hooks(), layer=layer)
        sync(args)
        if args.device == "cuda":
            row["peak_bytes"] = torch.cuda.max_memory_allocated() - base
        row["saved_bytes"] = recorder.total()
        row["saved_tensors"] = recorder.count
        row["saved_storages"] = len(recorder.storages)

        stage = "accuracy"
        outs = subject.canonical(dict(zip(grad_names(args), grads)))
        outs["y"] = y
        nonfinite = []
        if ref is not None:
            for name in err_names(args):
                err = relative_error(outs[name], ref[name])
                row["rel_err"][name] = err
                if err is not None and not math.isfinite(err):
                    nonfinite.append(name)
            tol = ERR_TOLERANCE[args.dtype]
            finite = [e for e in row["rel_err"].values() if e is not None]
            row["max_rel_err"] = max(finite) if finite else None
            row["err_ok"] = not nonfinite and all(e <= tol for e in finite)
            if layer:
                # routing from low-precision logits may break a near-tie differently from the
                # reference: the error is reported, not held to the tolerance
                row["err_ok"] = not nonfinite
        else:
            for name in err_names(args):
                t = outs[name]
                if t is not None and not bool(torch.isfinite(t).all()):
                    nonfinite.append(name)

        stage = "repeat"
        t0 = time.perf_counter()
        y2, grads2 = fwd_bwd(fn, native, leaves, layer=layer)
        sync(args)
        est_ms = (time.perf_counter() - t0) * 1e3
        row["bitwise_repeat"] = bool(torch.equal(y, y2)) and all(
            a is None or torch.equal(a, b) for a, b in zip(grads, grads2))
        del y, grads, y2, grads2, outs

        if nonfinite:
            row["rel_err"] = {n: (None if e is None or not math.isfinite(e) else e)
                              for n, e in row["rel_err"].items()}
            raise FloatingPointError(f"non-finite values in {', '.join(nonfinite)}")

        stage = "timing"
        reps = timing_reps(row_budget_s, est_ms, args)

        def step():
            fwd_bwd(fn, native, leaves, layer=layer)

        if deferred is not None:
            deferred.append(PendingTiming(row, step, reps, est_ms))
            return row
        times, samples = timed_block(step, reps, est_ms, args)
        fill_timing(row, times, clock_summary(samples, args))
    except Exception as error:  # noqa: BLE001 (recorded, the run goes on)
        row["error"] = " ".join(f"{stage}: {type(error).__name__}: {error}".split())
        row["error_trace"] = traceback.format_exc(limit=6)[-2000:]
        if args.device == "cuda" and (is_sticky_cuda_error(error) or not cuda_still_usable()):
            row["sticky_cuda_error"] = True
    return row


def cuda_still_usable():
    """False once the CUDA context is broken (a sticky error: every later call fails)."""
    try:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def _injected_fault(cfg, impl):
    """TESTS ONLY: MOEBLAZE_BENCH_FAULT=<crash|hang|raise>:<config>:<impl> makes that row kill its
    process, hang, or raise, so the tests can check that other rows survive."""
    spec = os.environ.get("MOEBLAZE_BENCH_FAULT", "")
    if not spec:
        return
    kind, _, rest = spec.partition(":")
    config, _, which = rest.partition(":")
    if config != cfg["name"] or which != impl:
        return
    if kind == "crash":
        os._exit(139)
    if kind == "hang":
        time.sleep(3600)
    if kind == "raise":
        raise RuntimeError("injected fault")


def library_saved_size(cfg, activation, policy, args):
    try:
        import moeblaze._lib as mlib
        import moeblaze.torch as mbt
        layer = mbt.get_layer(torch.device(args.device), d_model=cfg["d"], d_ffn=cfg["h"],
                              num_experts=cfg["E"], top_k=cfg["k"], activation=activation,
                              dtype={"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                                     "fp64": "float64"}[args.dtype], checkpoint=policy)
        return int(layer.saved_size(mlib.PASS_EXPERTS_FORWARD, cfg["T"]))
    except Exception:  # noqa: BLE001 (a fact, not a requirement)
        return None


def free_memory(args):
    gc.collect()
    if args.device == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception as error:  # noqa: BLE001 (the next row will report a broken context)
            log(f"  empty_cache failed: {error}")


# ------------------------------------------------------------------------------------------------
# One process: configurations in order, rows streamed to a JSON-lines state file
# ------------------------------------------------------------------------------------------------


def error_row(cfg, activation, impl, policy, message, args):
    return {"config": cfg["name"], "act": activation, "impl": impl, "policy": policy,
            "T": cfg["T"], "d": cfg["d"], "h": cfg["h"], "E": cfg["E"], "k": cfg["k"],
            "dtype": args.dtype, "flops": roofline.flops(cfg, activation), "ms": None,
            "tflops": None, "saved_bytes": None, "peak_bytes": None,
            "rel_err": {name: None for name in err_names(args)}, "error": message,
            "mode": args.mode}


def warm_up(configs, args):
    """Runs each row that compiles kernels on first use (SonicMoE: ~100 s a shape) once on a tiny
    problem of the same d, h, E, k, so that the compile happens now, in parallel with the other
    configurations' processes, and not inside the measured rows. Errors are left for the real
    row to report."""
    plan = [(impl, policy) for impl, policy in row_plan(args) if impl == "sonicmoe"]
    for cfg in configs:
        tiny = dict(cfg, T=max(128, 2 * cfg["E"]))
        for activation in args.acts:
            for impl, policy in plan:
                t0 = time.time()
                try:
                    subject = make_impl(impl, policy, activation, args, tiny)
                    if subject.skip:
                        continue
                    inputs = make_inputs(tiny, activation, args)
                    native = subject.prepare(inputs)
                    fwd_bwd(subject.fn, native, subject.leaves(native, args),
                            layer=args.mode == "layer")
                    sync(args)
                    log(f"  warm-up {cfg['name']}/{activation}/{impl}: "
                        f"{time.time() - t0:.0f} s")
                except Exception as error:  # noqa: BLE001
                    log(f"  warm-up {cfg['name']}/{activation}/{impl} failed: "
                        f"{type(error).__name__}: {error}")
                free_memory(args)


def run_configs(configs, args, emit):
    """Runs every configuration in this process; emit(event_dict) receives rows and markers.
    Returns False if a sticky CUDA error ended the run early."""
    torch.set_float32_matmul_precision("highest")  # the fp32 reference must not use TF32
    plan = row_plan(args)
    deadline = args.deadline or (time.time() + args.budget_s)
    rows_left = len(configs) * len(args.acts) * len(plan)
    for cfg in configs:
        emit({"event": "config_start", "config": cfg["name"], "time": time.time()})
        for activation in args.acts:
            label = f"{cfg['name']}/{activation}"
            if time.time() > deadline:
                for impl, policy in plan:
                    emit({"event": "row", "row": error_row(cfg, activation, impl, policy,
                                                            "skipped: time budget exhausted",
                                                            args)})
                rows_left -= len(plan)
                continue
            try:
                inputs = make_inputs(cfg, activation, args)
            except Exception as error:  # noqa: BLE001
                for impl, policy in plan:
                    emit({"event": "row", "row": error_row(
                        cfg, activation, impl, policy, f"inputs: {type(error).__name__}: {error}",
                        args)})
                rows_left -= len(plan)
                free_memory(args)
                continue
            ref, ref_info = None, {"skipped": True}
            if not args.no_ref:
                t0 = time.time()
                try:
                    ref, ref_info = reference(cfg, activation, inputs, args)
                    ref_info["seconds"] = round(time.time() - t0, 2)
                    free_memory(args)  # the reference's fp32 activations
                except Exception as error:  # noqa: BLE001
                    ref_info = {"error": f"{type(error).__name__}: {error}"}
                    log(f"  [{label}] reference failed: {ref_info['error']}")
                    free_memory(args)
            log(f"[{label}] T={cfg['T']} d={cfg['d']} h={cfg['h']} E={cfg['E']} k={cfg['k']} "
                f"seed={inputs['seed']} reference={ref_info}")
            # --interleave: the rows' checks run in plan order, their timing afterwards in
            # alternating rounds (interleave_timing); they are emitted once timed, in plan order.
            pending = [] if args.interleave >= 2 else None
            held = []
            for impl, policy in plan:
                now = time.time()
                if now > deadline:
                    row = error_row(cfg, activation, impl, policy,
                                    "skipped: time budget exhausted", args)
                else:
                    # half of a row's share goes to timed repetitions; warm-up, memory,
                    # accuracy and repeat runs take the rest
                    share = (deadline - now) / max(rows_left, 1)
                    row = run_row(cfg, activation, impl, policy, inputs, ref, args,
                                  row_budget_s=min(args.row_timing_s, 0.5 * share),
                                  deferred=pending)
                    row["reference"] = ref_info
                rows_left -= 1
                if pending is not None:
                    held.append(row)
                else:
                    emit({"event": "row", "row": row})
                    log("  " + row_line(row))
                if row.get("sticky_cuda_error"):
                    for waiting in pending or ():  # checked rows the error leaves untimed
                        waiting.row["error"] = "not timed: a sticky CUDA error in a later row"
                    for kept in held:
                        emit({"event": "row", "row": kept})
                    log(f"  sticky CUDA error in {label} {impl}/{policy}: ending this process")
                    return False
                free_memory(args)  # a row waiting for its timing keeps its state referenced
            if pending is not None:
                interleave_timing(pending, args.interleave, args)
                pending.clear()
                for row in held:
                    emit({"event": "row", "row": row})
                    log("  " + row_line(row))
                if any(row.get("sticky_cuda_error") for row in held):
                    log(f"  sticky CUDA error in {label}'s interleaved timing: ending this process")
                    return False
            del inputs, ref
            free_memory(args)
        emit({"event": "config_done", "config": cfg["name"], "time": time.time()})
    return True


def row_line(row):
    if row.get("error"):
        return f"{row['impl']:>10}/{row['policy']:<11} ERROR {row['error'][:160]}"
    if row.get("skipped"):
        return f"{row['impl']:>10}/{row['policy']:<11} skipped: {row['skipped']}"
    errs = row.get("max_rel_err")
    mib = float(1 << 20)

    def fmt(value, scale=1.0, spec=".1f"):
        return "-" if value is None else format(value / scale, spec)

    return (f"{row['impl']:>10}/{row['policy']:<11} {fmt(row['ms'], spec='.3f'):>9} ms "
            f"{fmt(row['tflops']):>6} TFLOP/s  saved {fmt(row['saved_bytes'], mib):>8} MiB  "
            f"peak {fmt(row['peak_bytes'], mib):>8} MiB  max_rel_err "
            f"{'-' if errs is None else format(errs, '.2e')}  bitwise_repeat "
            f"{row.get('bitwise_repeat')}  reps {row.get('reps')}  SM "
            f"{fmt(row.get('sm_mhz'), spec='.0f')} MHz  {fmt(row.get('power_w'), spec='.0f')} W  "
            f"{fmt(row.get('joules'), spec='.2f')} J")


# ------------------------------------------------------------------------------------------------
# Parent: one child process per stretch of configurations, restarted after a crash or hang
# ------------------------------------------------------------------------------------------------


def read_state(path):
    events = []
    if not os.path.exists(path):
        return events
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut short by a kill
    return events


def child_argv(args, configs, state_path, deadline):
    argv = [sys.executable, os.path.abspath(__file__), "--no-isolate", "--child-state", state_path,
            "--configs", ",".join(c["name"] for c in configs), "--configs-file", args.configs_file,
            "--acts", ",".join(args.acts), "--impls", ",".join(args.impls),
            "--policies", ",".join(args.policies), "--device", args.device, "--dtype", args.dtype,
            "--out", args.out, "--seed", str(args.seed), "--min-reps", str(args.min_reps),
            "--max-reps", str(args.max_reps), "--ref-chunk-gib", str(args.ref_chunk_gib),
            "--row-timing-s", repr(args.row_timing_s), "--interleave", str(args.interleave),
            "--deadline", repr(deadline), "--budget-s", repr(max(1.0, deadline - time.time()))]
    argv += ["--mode", args.mode]
    if args.keep_saved:
        argv.append("--keep-saved")
    if args.config_timeout_s:
        argv += ["--config-timeout-s", repr(args.config_timeout_s)]
    if args.no_ref:
        argv.append("--no-ref")
    if args.allow_shim:
        argv.append("--allow-shim")
    if args.emulate_grouped_mm:
        argv.append("--emulate-grouped-mm")
    return argv


def run_isolated(configs, args, on_rows):
    """Runs configurations in child processes; returns all rows."""
    plan = row_plan(args)
    start = time.time()
    deadline = start + args.budget_s
    hard_stop = deadline + 45.0  # a child past this is killed; what it finished is kept
    state_path = os.path.join(args.out, f".bench-state-{os.getpid()}.jsonl")
    rows = []
    remaining = list(configs)
    while remaining:
        if os.path.exists(state_path):
            os.remove(state_path)
        argv = child_argv(args, remaining, state_path, deadline)
        log(f"== child process for {', '.join(c['name'] for c in remaining)}")
        child = subprocess.Popen(argv, start_new_session=True)
        seen = 0
        current, current_start = None, time.time()
        killed = None
        while True:
            rc = child.poll()
            events = read_state(state_path)
            for event in events[seen:]:
                if event["event"] == "config_start":
                    current, current_start = event["config"], time.time()
                elif event["event"] == "config_done":
                    current = None
                elif event["event"] == "row":
                    rows.append(event["row"])
                    on_rows(rows)
            seen = len(events)
            if rc is not None:
                break
            now = time.time()
            left = max(1, len([c for c in remaining if c["name"] not in done_configs(events)]))
            per_config_limit = args.config_timeout_s or max(
                90.0, 3.0 * (deadline - current_start) / left)
            if now > hard_stop:
                killed = "killed: past the run's hard stop"
            elif current is not None and now - current_start > per_config_limit:
                killed = f"killed: configuration ran over {per_config_limit:.0f} s"
            if killed:
                log(f"== {killed} ({current})")
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                rc = child.returncode
                break
            time.sleep(0.5)
        events = read_state(state_path)
        for event in events[seen:]:
            if event["event"] == "row":
                rows.append(event["row"])
        done = done_configs(events)
        started = [e["config"] for e in events if e["event"] == "config_start"]
        crashed = [name for name in started if name not in done]
        reason = killed or f"child process exited with status {rc}"
        for name in crashed:
            cfg = next(c for c in remaining if c["name"] == name)
            have = {(r["act"], r["impl"], r["policy"]) for r in rows if r["config"] == name}
            for activation in args.acts:
                for impl, policy in plan:
                    if (activation, impl, policy) not in have:
                        rows.append(error_row(cfg, activation, impl, policy,
                                              f"not measured: {reason}", args))
        finished = set(done) | set(crashed)
        if not started and rc != 0:
            # the child died before starting anything (import error, no GPU): give up
            for cfg in remaining:
                for activation in args.acts:
                    for impl, policy in plan:
                        rows.append(error_row(cfg, activation, impl, policy,
                                              f"not measured: {reason}", args))
            finished = {c["name"] for c in remaining}
        remaining = [c for c in remaining if c["name"] not in finished]
        on_rows(rows)
        if remaining and time.time() > hard_stop:
            for cfg in remaining:
                for activation in args.acts:
                    for impl, policy in plan:
                        rows.append(error_row(cfg, activation, impl, policy,
                                              "skipped: time budget exhausted", args))
            remaining = []
    if os.path.exists(state_path):
        os.remove(state_path)
    return rows


def run_configs_in_turn(configs, args, emit):
    """A child of run_parallel: warm up, say so, wait until every sibling has, then measure while
    holding the GPU lock (one child measures at a time, so nothing else runs on the GPU)."""
    import fcntl
    warm_up(configs, args)
    with open(args.child_state + ".ready", "w"):
        pass
    go = args.child_go
    while not os.path.exists(go) and time.time() < (args.deadline or math.inf):
        time.sleep(0.2)
    with open(args.gpu_lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return run_configs(configs, args, emit)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_parallel(configs, args, on_rows):
    """One child process per configuration x activation, all started at once: each warms up
    (compiles), then they measure one at a time. Returns all rows; a crashed or hung child loses
    only its own rows."""
    plan = row_plan(args)
    deadline = time.time() + args.budget_s
    hard_stop = deadline + 45.0
    tag = f"{os.getpid()}"
    lock_path = args.gpu_lock or os.path.join(args.out, f".bench-gpu-{tag}.lock")
    go_path = os.path.join(args.out, f".bench-go-{tag}")
    children = []
    for cfg in configs:
        for activation in args.acts:
            state_path = os.path.join(args.out,
                                      f".bench-state-{tag}-{cfg['name']}-{activation}.jsonl")
            for path in (state_path, state_path + ".ready"):
                if os.path.exists(path):
                    os.remove(path)
            one = argparse.Namespace(**vars(args))
            one.acts = [activation]
            argv = child_argv(one, [cfg], state_path, deadline) + ["--gpu-lock", lock_path,
                                                                   "--child-go", go_path]
            children.append({"cfg": cfg, "act": activation, "state": state_path, "seen": 0,
                             "start": None, "killed": None,
                             "proc": subprocess.Popen(argv, start_new_session=True)})
    log(f"== {len(children)} child processes (compile in parallel, measure in turn)")
    rows = []
    while True:
        alive = 0
        for child in children:
            rc = child["proc"].poll()
            events = read_state(child["state"])
            for event in events[child["seen"]:]:
                if event["event"] == "config_start":
                    child["start"] = time.time()
                elif event["event"] == "row":
                    rows.append(event["row"])
                    on_rows(rows)
            child["seen"] = len(events)
            if rc is not None:
                continue
            alive += 1
            now = time.time()
            limit = args.config_timeout_s or max(90.0, 3.0 * args.budget_s / len(children))
            reason = None
            if now > hard_stop:
                reason = "killed: past the run's hard stop"
            elif child["start"] is not None and now - child["start"] > limit:
                reason = f"killed: configuration ran over {limit:.0f} s"
            if reason:
                log(f"== {reason} ({child['cfg']['name']})")
                os.killpg(child["proc"].pid, signal.SIGKILL)
                child["proc"].wait()
                child["killed"] = reason
        if not os.path.exists(go_path) and all(
                c["proc"].poll() is not None or os.path.exists(c["state"] + ".ready")
                for c in children):
            log("== every child process is warm: measuring one configuration at a time")
            with open(go_path, "w"):
                pass
        if alive == 0:
            break
        time.sleep(0.5)
    for child in children:
        events = read_state(child["state"])
        for event in events[child["seen"]:]:
            if event["event"] == "row":
                rows.append(event["row"])
        cfg = child["cfg"]
        if cfg["name"] not in done_configs(events):
            reason = child["killed"] or f"child process exited with status " \
                                        f"{child['proc'].returncode}"
            have = {(r["act"], r["impl"], r["policy"]) for r in rows if r["config"] == cfg["name"]}
            for impl, policy in plan:
                if (child["act"], impl, policy) not in have:
                    rows.append(error_row(cfg, child["act"], impl, policy,
                                          f"not measured: {reason}", args))
        for path in (child["state"], child["state"] + ".ready"):
            if os.path.exists(path):
                os.remove(path)
    for path in (go_path,) if args.gpu_lock else (lock_path, go_path):
        if os.path.exists(path):
            os.remove(path)
    order = {name: i for i, name in enumerate(c["name"] for c in configs)}
    acts = {a: i for i, a in enumerate(args.acts)}
    slots = {row: i for i, row in enumerate(plan)}
    rows.sort(key=lambda r: (order.get(r["config"], 0), acts.get(r["act"], 0),
                             slots.get((r["impl"], r["policy"]), 0)))
    on_rows(rows)
    return rows


def done_configs(events):
    return [e["config"] for e in events if e["event"] == "config_done"]


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------


def geomean(values):
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def annotate(rows):
    """Adds speed-ups and memory ratios to moeblaze rows; returns a summary dict."""
    index = {(r["config"], r["act"], r["impl"], r["policy"]): r for r in rows}
    for r in rows:
        if r["impl"] != "moeblaze":
            continue
        for base in BASELINES:
            b = index.get((r["config"], r["act"], base,
                           policy_of(base)))
            if b is None:
                continue
            if r.get("ms") and b.get("ms"):
                r[f"speedup_vs_{base}"] = b["ms"] / r["ms"]
            if r.get("saved_bytes") is not None and b.get("saved_bytes"):
                r[f"saved_ratio_vs_{base}"] = r["saved_bytes"] / b["saved_bytes"]
            if r.get("peak_bytes") is not None and b.get("peak_bytes"):
                r[f"peak_ratio_vs_{base}"] = r["peak_bytes"] / b["peak_bytes"]
    summary = {}
    for act in sorted({r["act"] for r in rows}):
        mb = [r for r in rows if r["act"] == act and r["impl"] == "moeblaze"
              and r["policy"] == "save_preact"]
        summary[act] = {
            "geomean_speedup_vs_grouped_mm": geomean([r.get("speedup_vs_grouped_mm") for r in mb]),
            "geomean_speedup_vs_loop": geomean([r.get("speedup_vs_loop") for r in mb]),
            "geomean_speedup_vs_sonicmoe": geomean([r.get("speedup_vs_sonicmoe") for r in mb]),
            "min_speedup_vs_sonicmoe": min(
                [r["speedup_vs_sonicmoe"] for r in mb if "speedup_vs_sonicmoe" in r],
                default=None),
            "max_peak_ratio_vs_sonicmoe": max(
                [r["peak_ratio_vs_sonicmoe"] for r in mb if "peak_ratio_vs_sonicmoe" in r],
                default=None),
            "max_saved_ratio_vs_sonicmoe": max(
                [r["saved_ratio_vs_sonicmoe"] for r in mb if "saved_ratio_vs_sonicmoe" in r],
                default=None),
            "geomean_speedup_vs_megablocks": geomean(
                [r.get("speedup_vs_megablocks") for r in mb]),
            "max_peak_ratio_vs_megablocks": max(
                [r["peak_ratio_vs_megablocks"] for r in mb if "peak_ratio_vs_megablocks" in r],
                default=None),
            "max_saved_ratio_vs_grouped_mm": max(
                [r["saved_ratio_vs_grouped_mm"] for r in mb if "saved_ratio_vs_grouped_mm" in r],
                default=None),
            "max_peak_ratio_vs_grouped_mm": max(
                [r["peak_ratio_vs_grouped_mm"] for r in mb if "peak_ratio_vs_grouped_mm" in r],
                default=None),
            "min_tflops": min([r["tflops"] for r in mb if r.get("tflops")], default=None),
        }
    summary["rows_with_errors"] = sum(1 for r in rows if r.get("error"))
    summary["rows_over_tolerance"] = sum(1 for r in rows if r.get("err_ok") is False)
    return summary


def results_path(args, device):
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return os.path.join(args.out, f"{date}-{device_slug(device)}.json")


def finite_or_none(value):
    """JSON has no NaN/Inf: non-finite floats become None (the row's error says why)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value


def write_results(path, header, rows):
    rows = finite_or_none(rows)
    doc = dict(header)
    doc["summary"] = annotate(rows)
    doc["rows"] = rows
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False, default=_json_default)
    os.replace(tmp, path)
    return doc


def _json_default(value):
    return str(value)


def _measured(rows):
    return any(r.get("ms") is not None for r in rows)


def merge_results(paths, out_dir):
    """Joins runs into one result set (--merge). They must come from one device and one library
    build (their build info), in one dtype and mode; each (configuration, activation) group is
    taken whole from the last run that measured any of its rows, so a ratio never compares rows
    of two runs. The header is the first run's, with every run's command, date and clocks under
    "runs". Returns the merged file's path."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))

    def fact(doc, *keys):
        value = doc
        for key in keys:
            value = (value or {}).get(key)
        return value

    for what in (("device",), ("environment", "moeblaze_build_info"), ("environment", "dtype"),
                 ("method", "timing")):
        values = {json.dumps(fact(doc, *what)) for doc in docs}
        if len(values) > 1:
            raise SystemExit(f"--merge: the runs differ in {'.'.join(what)}: "
                             f"{', '.join(sorted(values))}")
    modes = {"layer" if any("dw_router" in (r.get("rel_err") or {}) for r in doc["rows"])
             else "experts" for doc in docs if _measured(doc["rows"])}
    if len(modes) > 1:
        raise SystemExit("--merge: the runs mix --mode experts and --mode layer")
    groups, order = {}, []
    for doc in docs:
        by_group = {}
        for r in doc["rows"]:
            by_group.setdefault((r["config"], r["act"]), []).append(r)
        for key, rows in by_group.items():
            if key not in groups:
                order.append(key)
            if key not in groups or _measured(rows):
                groups[key] = rows
    merged = {k: v for k, v in docs[0].items() if k not in ("summary", "rows")}
    merged["command"] = " ; ".join(doc.get("command", "?") for doc in docs)
    merged["runs"] = [{"command": doc.get("command"), "date_utc": doc.get("date_utc"),
                       "clocks_during_run": fact(doc, "environment", "clocks_during_run")}
                      for doc in docs]
    rows = [r for key in order for r in groups[key]]
    stem = os.path.splitext(os.path.basename(paths[0]))[0]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}-merged.json")
    write_results(path, merged, rows)
    return path


def summary_table(doc):
    """Compact: one line per configuration x activation."""
    rows = doc["rows"]
    index = {(r["config"], r["act"], r["impl"], r["policy"]): r for r in rows}
    keys = []
    for r in rows:
        key = (r["config"], r["act"])
        if key not in keys:
            keys.append(key)
    gib = float(1 << 30)

    def ms(r):
        return "-" if r is None or r.get("ms") is None else f"{r['ms']:.2f}"

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"{'config/act':<20} {'gmm ms':>8} {'loop ms':>8} {'sonic ms':>8} {'mgblk ms':>9} "
             f"{'mb ms':>8} {'x_gmm':>6} {'x_loop':>7} {'x_sonic':>7} {'x_mgblk':>7} "
             f"{'mb TF/s':>8}  {'saved GiB mb/gmm':>16}  {'peak GiB mb/gmm/sonic/mgblk':>27}  "
             f"{'mb max_err':>10}  errs"]
    for cfg, act in keys:
        g = index.get((cfg, act, "grouped_mm", BASELINE_POLICY))
        lp = index.get((cfg, act, "loop", BASELINE_POLICY))
        sm = index.get((cfg, act, "sonicmoe", PEER_POLICY))
        mk = index.get((cfg, act, "megablocks", PEER_POLICY))
        mb = index.get((cfg, act, "moeblaze", "save_preact"))
        nerr = sum(1 for r in rows if r["config"] == cfg and r["act"] == act and r.get("error"))
        mbs = mb or {}
        saved = f"{fmt(_div(mbs.get('saved_bytes'), gib), '.2f')}/" \
                f"{fmt(_div((g or {}).get('saved_bytes'), gib), '.2f')}"
        peak = f"{fmt(_div(mbs.get('peak_bytes'), gib), '.2f')}/" \
               f"{fmt(_div((g or {}).get('peak_bytes'), gib), '.2f')}/" \
               f"{fmt(_div((sm or {}).get('peak_bytes'), gib), '.2f')}/" \
               f"{fmt(_div((mk or {}).get('peak_bytes'), gib), '.2f')}"
        lines.append(
            f"{cfg + '/' + act:<20} {ms(g):>8} {ms(lp):>8} {ms(sm):>8} {ms(mk):>9} {ms(mb):>8} "
            f"{fmt(mbs.get('speedup_vs_grouped_mm'), '.2f'):>6} "
            f"{fmt(mbs.get('speedup_vs_loop'), '.2f'):>7} "
            f"{fmt(mbs.get('speedup_vs_sonicmoe'), '.2f'):>7} "
            f"{fmt(mbs.get('speedup_vs_megablocks'), '.2f'):>7} "
            f"{fmt(mbs.get('tflops'), '.0f'):>8}  "
            f"{saved:>16}  {peak:>27}  {fmt(mbs.get('max_rel_err'), '.1e'):>10}  {nerr:>4}")
    s = doc["summary"]
    for act, v in s.items():
        if isinstance(v, dict):
            lines.append(f"{act}: geomean speed-up vs grouped_mm "
                         f"{fmt(v['geomean_speedup_vs_grouped_mm'], '.2f')}, vs loop "
                         f"{fmt(v['geomean_speedup_vs_loop'], '.2f')}, vs sonicmoe "
                         f"{fmt(v['geomean_speedup_vs_sonicmoe'], '.2f')} (min "
                         f"{fmt(v['min_speedup_vs_sonicmoe'], '.2f')}), vs megablocks "
                         f"{fmt(v['geomean_speedup_vs_megablocks'], '.2f')}; max saved ratio "
                         f"{fmt(v['max_saved_ratio_vs_grouped_mm'], '.2f')} (sonicmoe "
                         f"{fmt(v['max_saved_ratio_vs_sonicmoe'], '.2f')}), max peak ratio "
                         f"{fmt(v['max_peak_ratio_vs_grouped_mm'], '.2f')} (sonicmoe "
                         f"{fmt(v['max_peak_ratio_vs_sonicmoe'], '.2f')}, megablocks "
                         f"{fmt(v['max_peak_ratio_vs_megablocks'], '.2f')})")
    lines.append(f"rows with errors: {s['rows_with_errors']}; rows over the error tolerance: "
                 f"{s['rows_over_tolerance']}")
    lines += clock_lines(doc)
    if any(str(r.get("impl_source", "")).startswith("SHIM") for r in rows):
        lines.append("WARNING: the moeblaze rows are the DEVELOPMENT SHIM (loop baseline), "
                     "not moeblaze")
    errors = [r for r in rows if r.get("error")]
    for r in errors[:6]:  # device_check.sh shows the last 40 lines: keep the table in view
        lines.append(f"  ERROR {r['config']}/{r['act']}/{r['impl']}/{r['policy']}: "
                     f"{r['error'][:150]}")
    if len(errors) > 6:
        lines.append(f"  ... {len(errors) - 6} more errors in the JSON")
    return "\n".join(lines)


def clock_lines(doc):
    """The ceiling and the clocks: the sustained dense matmul rate measured before the rows, each
    moeblaze save_preact row's TFLOP/s as a share of it, and what the SMs ran at meanwhile."""
    env = doc.get("environment", {})
    lines = []
    dense = env.get("dense_reference") or {}
    if dense.get("tflops"):
        shares = [f"{r['config']}/{r['act']} {100 * r['tflops'] / dense['tflops']:.0f} %"
                  for r in doc["rows"] if r["impl"] == "moeblaze" and r["policy"] == "save_preact"
                  and r.get("tflops") and r["act"] == "swiglu"]
        lines.append(f"sustained dense {dense['dtype']} matmul {dense['shape']}: "
                     f"{dense['tflops']:.0f} TFLOP/s ({gpu_clocks.describe(dense.get('clocks'))})")
        if shares:
            lines.append("moeblaze swiglu TFLOP/s as a share of it: " + ", ".join(shares))
    runs = doc.get("runs") or []
    if len(runs) > 1:  # a merged result set: each run's clocks
        lines += [f"clocks during the rows of command {i}: "
                  f"{gpu_clocks.describe(run['clocks_during_run'])}"
                  for i, run in enumerate(runs, 1) if run.get("clocks_during_run")]
    elif env.get("clocks_during_run"):
        lines.append(f"clocks during the rows: {gpu_clocks.describe(env['clocks_during_run'])}")
    return lines


def _div(v, d):
    return None if v is None else v / d


def parallel_warmup(args):
    if args.no_isolate or args.parallel_warmup == "off":
        return False
    if args.parallel_warmup == "on":
        return True
    return args.device == "cuda" and "sonicmoe" in args.impls


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.merge:
        path = merge_results(args.merge, args.out)
        with open(path) as f:
            doc = json.load(f)
        log(f"wrote {path}")
        print("\n" + summary_table(doc), flush=True)
        return finish_report(path, args)
    configs = load_configs(args)

    if args.child_state:
        with open(args.child_state, "a") as state:
            def emit(event):
                state.write(json.dumps(event, allow_nan=True, default=_json_default) + "\n")
                state.flush()
                os.fsync(state.fileno())
            if args.child_go:
                ok = run_configs_in_turn(configs, args, emit)
            else:
                ok = run_configs(configs, args, emit)
        return 0 if ok else EXIT_STICKY

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU")
    name = device_name(args.device)
    header = {"device": name, "commit": git_commit(),
              "command": " ".join(["python3"] + [os.path.relpath(os.path.abspath(__file__))] +
                                  (sys.argv[1:] if argv is None else list(argv))),
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"),
              "environment": environment(args),
              "method": {"timing": "median of CUDA-event-timed fwd+bwd, L2 flushed before each "
                                   "repetition" if args.device == "cuda" else
                                   "median of host-timed fwd+bwd (CPU)",
                         "flops": "18*T*k*d*h gated, 12*T*k*d*h otherwise",
                         "saved_bytes": "unique storages via saved_tensors_hooks, inputs excluded",
                         "peak_bytes": "max_memory_allocated during fwd+bwd minus allocated before",
                         "reference": "loop baseline in fp32 (CUDA, TF32 off) / fp64 (CPU) on "
                                      "upcast inputs, token chunks",
                         "err_tolerance": ERR_TOLERANCE[args.dtype]}}
    path = results_path(args, name)
    if args.device == "cuda" and args.dense_reference_s > 0:
        dense = gpu_clocks.sustained_matmul(args.dense_reference_s, dtype=DTYPES[args.dtype])
        header["environment"]["dense_reference"] = dense
        if dense.get("tflops"):
            log(f"sustained dense {dense['dtype']} matmul {dense['shape']}: "
                f"{dense['tflops']:.0f} TFLOP/s over {dense['seconds']} s; "
                f"{gpu_clocks.describe(dense['clocks'])}")
    log(f"moeblaze bench: {len(configs)} configuration(s) x {args.acts} x "
        f"{[f'{i}/{p}' for i, p in row_plan(args)]} on {name}; budget {args.budget_s:.0f} s; "
        f"results -> {path}")
    log(f"moeblaze: {header['environment'].get('moeblaze')}; "
        f"{header['environment'].get('moeblaze_build_info', '')}")
    mismatch = commit_mismatch(header["commit"], header["environment"].get("moeblaze_build_info"))
    if mismatch:
        header["commit_mismatch"] = mismatch
        log(f"WARNING: {mismatch}")

    def save(rows):
        write_results(path, header, rows)

    rows = []
    sample_clocks = args.device == "cuda" and not args.no_clock_samples
    with (gpu_clocks.ClockSampler(interval_ms=500) if sample_clocks
          else contextlib.nullcontext()) as sampler:
        if parallel_warmup(args):
            rows = run_parallel(configs, args, save)
        elif (args.device == "cuda" or args.isolate) and not args.no_isolate:
            rows = run_isolated(configs, args, save)
        else:
            def emit(event):
                if event["event"] == "row":
                    rows.append(event["row"])
                    save(rows)
            run_configs(configs, args, emit)
    if sample_clocks:
        header["environment"]["clocks_during_run"] = sampler.summary()
    doc = write_results(path, header, rows)
    log(f"wrote {path}")
    finish_report(path, args)
    log("")
    log(summary_table(doc))
    return 0


def publish_target(doc):
    """What --publish makes of a results doc: a layer run (--mode layer, or a merge of them) the
    committed layer.json and its table, any other run the result set (make_report.py --publish
    --as megablocks publishes a MegaBlocks run)."""
    return "layer" if any(r.get("mode") == "layer" for r in doc.get("rows", [])) else "latest"


def finish_report(path, args):
    """--report / --publish of the results at path (make_report.py); the numbers are saved
    whatever happens here."""
    if args.report or args.publish:
        try:
            import make_report
            if args.publish:  # a layer run replaces layer.json, not the experts' result set
                with open(path) as f:
                    target = publish_target(json.load(f))
                make_report.publish(path, as_=target)
            else:
                make_report.report(path, out_dir=args.out, doc_path=None)
        except Exception as error:  # noqa: BLE001 (the numbers are already saved)
            log(f"report failed: {type(error).__name__}: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
