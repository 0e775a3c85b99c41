#!/usr/bin/env python3
"""Benchmark one MoE expert layer in JAX, forward + backward: moeblaze.jax.moe_experts (XLA FFI)
against a jax.lax.ragged_dot MoE.

    python3 bench/jax_bench.py --out DIR [--configs conf1,mixtral] [--acts swiglu,silu]
                               [--impls moeblaze,ragged_dot] [--checkpoint save_preact] [--quick]

The baseline is the MaxText dataflow: sort the T*k routed rows by expert (argsort of the expert
ids), gather the token rows into that order (a materialised [T*k, d] copy), ragged_dot for the
gate/up and down projections over the expert groups, unsort, weighted sum over each token's k
rows. Its weights use ragged_dot's [E, in, out] layout (made once, outside the timed step).

For every configuration of bench/configs.json x activation x implementation, on the same inputs and
routing (router logits ~ N(0, 1), softmax, top-k, renormalised), one jitted step computes y and the
gradients of sum(y * dy) with respect to x, g and the expert weights. Each case runs in a fresh
child process, so the device's peak memory is that case's own. Recorded per case:

* ms          median wall time of `--reps` steps, each followed by block_until_ready (the device
              finished), after `--warmup` steps (the first compiles).
* tflops      useful FLOPs / time: 18*T*k*d*h (gated) or 12*T*k*d*h (bench/roofline.py).
* peak_bytes  device.memory_stats()['peak_bytes_in_use'] at the end, and peak_above_inputs_bytes:
              that minus the bytes in use once the inputs were on the device (the step's own
              memory: residuals, workspaces, outputs). None where the backend keeps no statistics
              (CPU).
* xla_temp_bytes  the compiled step's temporary buffers (compiled.memory_analysis()).
* rel_err     ||out - ref|| / ||ref|| for y, dx, dg, dw_gate, dw_up, dw_down; the reference is a
              per-expert loop in float32 on the upcast inputs, differentiated with jax.vjp
              (loop_experts). With --no-check no error is recorded, only `finite` per output.
              A non-finite output is an error either way.

Results: DIR/<YYYY-MM-DD>-<device>-jax.json; a table is printed last.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.append(os.path.join(REPO, "bindings", "python"))  # moeblaze, unless installed

import roofline  # noqa: E402  (pure arithmetic, no framework)

GATED = roofline.GATED
GRAD_NAMES = ("x", "g", "w_gate", "w_up", "w_down")


# ------------------------------------------------------------------------------------------------
# Problem and the two implementations (imported in the child process only)
# ------------------------------------------------------------------------------------------------


def make_problem(cfg, activation, dtype_name, seed, device):
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype_name)
    T, d, h, E, k = cfg["T"], cfg["d"], cfg["h"], cfg["E"], cfg["k"]
    keys = jax.random.split(jax.random.PRNGKey(seed), 7)

    def uniform(key, shape, fan_in):
        bound = fan_in ** -0.5
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)

    with jax.default_device(device):
        logits = jax.random.normal(keys[0], (T, E), jnp.float32)
        top, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        p = {
            "x": jax.random.normal(keys[1], (T, d), jnp.float32).astype(dtype),
            "ids": ids.astype(jnp.int32),
            # the routing dtype: float64 for float64 layers, else float32
            "g": (top / top.sum(-1, keepdims=True)).astype(jnp.promote_types(dtype, jnp.float32)),
            "w_gate": uniform(keys[2], (E, h, d), d),
            "w_up": uniform(keys[3], (E, h, d), d) if activation in GATED else None,
            "w_down": uniform(keys[4], (E, d, h), h),
            "dy": jax.random.normal(keys[5], (T, d), jnp.float32).astype(dtype),
        }
        jax.block_until_ready([v for v in p.values() if v is not None])
    return p


def activation_fn(name, a, b):
    import jax

    gelu = lambda v: jax.nn.gelu(v, approximate=False)  # noqa: E731
    return {
        "swiglu": lambda: jax.nn.silu(a) * b,
        "geglu": lambda: gelu(a) * b,
        "reglu": lambda: jax.nn.relu(a) * b,
        "silu": lambda: jax.nn.silu(a),
        "gelu": lambda: gelu(a),
        "relu": lambda: jax.nn.relu(a),
        "relu2": lambda: jax.nn.relu(a) ** 2,
    }[name]()


def ragged_dot_experts(x, ids, g, w_gate_t, w_up_t, w_down_t, activation):
    """The MaxText dataflow. w_gate_t, w_up_t: [E, d, h]; w_down_t: [E, h, d]."""
    import jax
    import jax.numpy as jnp

    T, k = ids.shape
    E = w_gate_t.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)       # routed rows grouped by expert
    sorted_x = jnp.take(x, order // k, axis=0)   # the materialised [T*k, d] copy
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    a = jax.lax.ragged_dot(sorted_x, w_gate_t, group_sizes)
    b = jax.lax.ragged_dot(sorted_x, w_up_t, group_sizes) if w_up_t is not None else None
    y2 = jax.lax.ragged_dot(activation_fn(activation, a, b), w_down_t, group_sizes)
    unsorted = jnp.take(y2, jnp.argsort(order), axis=0).reshape(T, k, -1)
    accumulate = jnp.promote_types(x.dtype, jnp.float32)
    y = jnp.einsum("tkd,tk->td", unsorted, g, preferred_element_type=accumulate)
    return y.astype(x.dtype)


def transposed(p):
    import jax.numpy as jnp

    t = lambda w: None if w is None else jnp.swapaxes(w, 1, 2)  # noqa: E731
    return t(p["w_gate"]), t(p["w_up"]), t(p["w_down"])


def make_step(impl, activation, checkpoint):
    """A jitted fn(x, g, w_gate, w_up, w_down, ids, dy) -> (y, grads): the weights in the
    implementation's own layout, grads in the order x, g, w_gate, (w_up,) w_down."""
    import jax
    import jax.numpy as jnp

    gated = activation in GATED

    if impl == "moeblaze":
        from moeblaze import jax as mbj

        def forward(x, ids, g, wg, wu, wd):
            return mbj.moe_experts(x, ids, g, wg, wu, wd, activation=activation,
                                   checkpoint=checkpoint)
    else:
        def forward(x, ids, g, wg, wu, wd):
            return ragged_dot_experts(x, ids, g, wg, wu, wd, activation)

    def loss(x, g, wg, wu, wd, ids, dy):
        y = forward(x, ids, g, wg, wu, wd)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    argnums = (0, 1, 2, 3, 4) if gated else (0, 1, 2, 4)
    grad = jax.value_and_grad(loss, argnums=argnums, has_aux=True)

    def step(x, g, wg, wu, wd, ids, dy):
        (_, y), grads = grad(x, g, wg, wu, wd, ids, dy)
        return y, grads

    return jax.jit(step)


def impl_args(impl, p):
    if impl == "moeblaze":
        weights = (p["w_gate"], p["w_up"], p["w_down"])
    else:
        weights = transposed(p)
    return (p["x"], p["g"]) + weights + (p["ids"], p["dy"])


def outputs_in_moeblaze_layout(impl, y, grads, gated):
    """{name: array} with the weight gradients in moeblaze's [E, out, in] layout."""
    import jax.numpy as jnp

    names = ("x", "g", "w_gate", "w_up", "w_down") if gated else ("x", "g", "w_gate", "w_down")
    out = {"y": y}
    for name, value in zip(names, grads):
        if impl != "moeblaze" and name.startswith("w_"):
            value = jnp.swapaxes(value, 1, 2)
        out["d" + name] = value
    return out


def loop_experts(x, g, w_gate, w_up, w_down, groups, activation):
    """One expert at a time on its own rows, in moeblaze's [E, out, in] weight layout: dense
    matmuls over [rows_e, d] and [rows_e, h] only, so the reference needs no [E, rows, cols]
    intermediate (ragged_dot's GPU lowering can ask for one: 64 GiB in float32 on conf3).
    groups[e] = (tokens, slots) of expert e's routed rows, a token at most once per expert.

    The experts are the steps of one lax.scan over row groups padded to the largest: one compiled
    body for every expert. A loop of eager per-expert matmuls compiles (and on a GPU autotunes)
    every distinct row count anew, minutes per case. Padding rows read token 0 with weight 0, so
    they add exact zeros to y and to every gradient."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = max(8, max((len(t) for t, _ in groups), default=0))
    rows = -(-rows // 8) * 8
    tokens = np.zeros((len(groups), rows), np.int32)
    slots = np.zeros((len(groups), rows), np.int32)
    mask = np.zeros((len(groups), rows), np.float32)
    for e, (tok, slot) in enumerate(groups):
        tokens[e, :len(tok)] = np.asarray(tok)
        slots[e, :len(tok)] = np.asarray(slot)
        mask[e, :len(tok)] = 1
    acc = jnp.promote_types(x.dtype, jnp.float32)

    def expert(y, step):
        wg, wu, wd, tok, slot, live = step
        xe = x[tok]
        a = xe @ wg.T
        b = xe @ wu.T if wu is not None else None
        y2 = activation_fn(activation, a, b) @ wd.T
        weight = g[tok, slot] * live.astype(g.dtype)
        return y.at[tok].add((weight[:, None] * y2).astype(acc)), None

    y, _ = jax.lax.scan(expert, jnp.zeros(x.shape, acc),
                        (w_gate, w_up, w_down, jnp.asarray(tokens), jnp.asarray(slots),
                         jnp.asarray(mask)))
    return y


def reference_outputs(impl, step_args, activation):
    """y and every gradient of sum(y * dy) from the per-expert loop (loop_experts) in float32
    (float64 for float64 inputs) on the upcast inputs of `impl`'s step, with the routing taken
    from the concrete ids."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    x, g, wg, wu, wd, ids, dy = step_args
    if impl != "moeblaze":  # to moeblaze's [E, out, in] layout
        wg, wu, wd = transposed({"w_gate": wg, "w_up": wu, "w_down": wd})
    flat = np.asarray(ids).reshape(-1)
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.arange(wg.shape[0] + 1))
    k = ids.shape[1]
    groups = [(order[lo:hi] // k, order[lo:hi] % k)
              for lo, hi in zip(bounds[:-1], bounds[1:])]
    up = lambda a: None if a is None else a.astype(jnp.promote_types(a.dtype, jnp.float32))  # noqa: E731,E501
    gated = activation in GATED
    primals = (up(x), up(g), up(wg), up(wu), up(wd)) if gated else (up(x), up(g), up(wg), up(wd))

    @jax.jit
    def forward(*args):
        if gated:
            xx, gg, w1, w3, w2 = args
        else:
            (xx, gg, w1, w2), w3 = args, None
        return loop_experts(xx, gg, w1, w3, w2, groups, activation)

    with jax.default_matmul_precision("highest"):  # no TF32 in the reference
        y, pullback = jax.vjp(forward, *primals)
        grads = pullback(up(dy))
    return outputs_in_moeblaze_layout("moeblaze", y, grads, gated)


def rel_err(a, b):
    import numpy as np

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ------------------------------------------------------------------------------------------------
# One case, in a child process
# ------------------------------------------------------------------------------------------------


def run_case(cfg, activation, impl, args):
    import jax

    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    device = jax.devices(args.device)[0] if args.device else jax.devices()[0]
    stats = device.memory_stats()  # None on the CPU
    p = make_problem(cfg, activation, args.dtype, args.seed, device)
    step_args = jax.device_put(impl_args(impl, p), device)
    del p  # only the step's own inputs stay on the device (one weight layout)
    jax.block_until_ready(step_args)
    inputs_bytes = device.memory_stats()["bytes_in_use"] if stats is not None else None
    step = make_step(impl, activation, args.checkpoint)
    compiled = step.lower(*step_args).compile()
    analysis = compiled.memory_analysis()
    temp_bytes = int(analysis.temp_size_in_bytes) if analysis is not None else None

    for _ in range(args.warmup):
        jax.block_until_ready(step(*step_args))
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        result = step(*step_args)
        jax.block_until_ready(result)
        times.append(time.perf_counter() - start)
    end_stats = device.memory_stats()
    ms = statistics.median(times) * 1e3
    row = {
        "config": cfg["name"], "T": cfg["T"], "d": cfg["d"], "h": cfg["h"], "E": cfg["E"],
        "k": cfg["k"], "activation": activation, "impl": impl, "dtype": args.dtype,
        "checkpoint": args.checkpoint if impl == "moeblaze" else None,
        "ms": ms, "ms_min": min(times) * 1e3, "reps": len(times),
        "tflops": roofline.flops(cfg, activation) / (ms * 1e-3) / 1e12,
        "peak_bytes": end_stats["peak_bytes_in_use"] if end_stats else None,
        "peak_above_inputs_bytes": (end_stats["peak_bytes_in_use"] - inputs_bytes
                                    if end_stats else None),
        "xla_temp_bytes": temp_bytes,
        "device": device.device_kind, "platform": device.platform,
    }
    y, grads = result
    mine = outputs_in_moeblaze_layout(impl, y, grads, activation in GATED)
    if args.check:
        ref = reference_outputs(impl, step_args, activation)
        row["rel_err"] = {name: rel_err(mine[name], ref[name]) for name in ref}
        # rel_err is NaN for a non-finite output, and NaN fails the comparison
        row["ok"] = all(err <= args.tolerance for err in row["rel_err"].values())
    else:
        # Unchecked: no error is recorded (a made-up 0 would read as exact), only finiteness.
        import numpy as np
        row["finite"] = {name: bool(np.all(np.isfinite(np.asarray(v, np.float32))))
                         for name, v in mine.items()}
        row["ok"] = all(row["finite"].values())
    return row


def child_main(args):
    cfg = json.loads(args.case_config)
    try:
        row = run_case(cfg, args.case_activation, args.case_impl, args)
    except Exception as error:  # reported as a failed row, with the traceback on stderr
        traceback.print_exc()
        row = {"config": cfg["name"], "activation": args.case_activation,
               "impl": args.case_impl, "ok": False, "error": f"{type(error).__name__}: {error}"}
    print("JAX_BENCH_ROW " + json.dumps(row), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------


def load_configs(path, names):
    with open(path) as f:
        configs = json.load(f)["configs"]
    if names:
        wanted = names.split(",")
        unknown = sorted(set(wanted) - {c["name"] for c in configs})
        if unknown:
            raise SystemExit(f"unknown configurations {unknown} in {path}")
        configs = [c for c in configs if c["name"] in wanted]
    return configs


def run_child(cfg, activation, impl, args):
    command = [sys.executable, os.path.abspath(__file__), "--child",
               "--case-config", json.dumps(cfg), "--case-activation", activation,
               "--case-impl", impl, "--dtype", args.dtype, "--checkpoint", args.checkpoint,
               "--seed", str(args.seed), "--reps", str(args.reps), "--warmup", str(args.warmup),
               "--tolerance", str(args.tolerance)]
    if args.device:
        command += ["--device", args.device]
    if not args.check:
        command.append("--no-check")
    start = time.time()
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=args.case_timeout_s)
    except subprocess.TimeoutExpired:
        return {"config": cfg["name"], "activation": activation, "impl": impl, "ok": False,
                "error": f"no result within --case-timeout-s {args.case_timeout_s:g}"}
    for line in proc.stdout.splitlines():
        if line.startswith("JAX_BENCH_ROW "):
            row = json.loads(line[len("JAX_BENCH_ROW "):])
            row["wall_s"] = time.time() - start
            if not row.get("ok"):
                sys.stderr.write(proc.stderr[-4000:])
            return row
    sys.stderr.write(proc.stderr[-4000:])
    return {"config": cfg["name"], "activation": activation, "impl": impl, "ok": False,
            "error": f"child exited with {proc.returncode} and no result"}


def mib(n):
    return "-" if n is None else f"{n / 2**20:,.1f}"


def table(rows):
    lines = ["| config | act | impl | ms | TFLOP/s | peak MiB | peak above inputs MiB | "
             "XLA temp MiB | max rel err | ok |", "|" + "---|" * 10]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['config']} | {r['activation']} | {r['impl']} | - | - | - | - | "
                         f"- | - | FAILED: {r.get('error', '')} |")
            continue
        err = f"{max(r['rel_err'].values()):.2e}" if r.get("rel_err") else "not checked"
        lines.append(f"| {r['config']} | {r['activation']} | {r['impl']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.1f} | {mib(r['peak_bytes'])} | "
                     f"{mib(r['peak_above_inputs_bytes'])} | {mib(r['xla_temp_bytes'])} | "
                     f"{err} | {'yes' if r['ok'] else 'NO'} |")
    # moeblaze against ragged_dot on each (config, activation)
    pairs = {}
    for r in rows:
        if "ms" in r:
            pairs.setdefault((r["config"], r["activation"]), {})[r["impl"]] = r
    ratio_lines = []
    for (config, act), impls in pairs.items():
        if "moeblaze" in impls and "ragged_dot" in impls:
            m, b = impls["moeblaze"], impls["ragged_dot"]
            speed = b["ms"] / m["ms"]
            memory = ("-" if not m["peak_above_inputs_bytes"] else
                      f"{m['peak_above_inputs_bytes'] / b['peak_above_inputs_bytes']:.2f}x")
            temp = ("-" if not m["xla_temp_bytes"] or not b["xla_temp_bytes"] else
                    f"{m['xla_temp_bytes'] / b['xla_temp_bytes']:.2f}x")
            ratio_lines.append(f"| {config} | {act} | {speed:.2f}x | {memory} | {temp} |")
    if ratio_lines:
        lines += ["", "| config | act | speed-up over ragged_dot | peak above inputs vs "
                  "ragged_dot | XLA temp vs ragged_dot |", "|---|---|---|---|---|"] + ratio_lines
    return "\n".join(lines)


def environment():
    import jax
    import jaxlib

    info = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version(), "host": platform.node(),
            "devices": [str(d) for d in jax.devices()]}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
        info["commit"] = commit + ("-dirty" if dirty else "")
    except OSError:
        pass
    try:
        from moeblaze import _lib, jax as mbj
        info["moeblaze_library"] = _lib.library_path()
        info["moeblaze_xla"] = mbj.shim_path()
        info["moeblaze_platforms"] = list(mbj.platforms())
        info["moeblaze_build"] = _lib.lib().moeblaze_get_build_info().decode()
    except Exception as error:  # the table still reports the baseline
        info["moeblaze_error"] = f"{type(error).__name__}: {error}"
    return info


def write_result(out, env, args_record, rows):
    os.makedirs(out, exist_ok=True)
    kind = rows[0].get("device", "unknown") if rows else "unknown"
    name = f"{datetime.date.today().isoformat()}-{kind.lower().replace(' ', '-')}-jax.json"
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        json.dump({"environment": env, "args": args_record, "rows": rows}, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "build", "bench"),
                        help="folder for <date>-<device>-jax.json (default: build/bench)")
    parser.add_argument("--configs", default="", help="comma-separated names (default: all)")
    parser.add_argument("--configs-file", default=os.path.join(HERE, "configs.json"))
    parser.add_argument("--acts", default="swiglu,silu")
    parser.add_argument("--impls", default="moeblaze,ragged_dot")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=("bfloat16", "float16", "float32", "float64"))
    parser.add_argument("--checkpoint", default="save_preact",
                        choices=("save_all", "save_preact", "recompute"))
    parser.add_argument("--device", default="", help="JAX platform: gpu, cuda or cpu "
                        "(default: JAX's default backend)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="5 repetitions after 2 warm-up steps")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the float32 reference (non-finite outputs still fail)")
    parser.add_argument("--tolerance", type=float, default=3e-2,
                        help="largest relative error that passes (16-bit dtypes)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--case-timeout-s", type=float, default=1200)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case-config", help=argparse.SUPPRESS)
    parser.add_argument("--case-activation", help=argparse.SUPPRESS)
    parser.add_argument("--case-impl", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.warmup = 5, 2
    if args.child:
        return child_main(args)

    impls = args.impls.split(",")
    for impl in impls:
        if impl not in ("moeblaze", "ragged_dot"):
            raise SystemExit(f"unknown implementation {impl!r} (moeblaze, ragged_dot)")
    configs = load_configs(args.configs_file, args.configs)
    env = environment()
    print(f"seed = {args.seed}; jax {env['jax']}; devices {env['devices']}", flush=True)
    args_record = {k: v for k, v in vars(args).items() if not k.startswith("case") and k != "child"}
    path = None
    rows = []
    for cfg in configs:
        for activation in args.acts.split(","):
            for impl in impls:
                row = run_child(cfg, activation, impl, args)
                rows.append(row)
                if "ms" in row:
                    state = f"{row['ms']:.3f} ms, peak {mib(row.get('peak_bytes'))} MiB"
                    if row.get("rel_err"):
                        state += f", max rel err {max(row['rel_err'].values()):.2e}"
                else:
                    state = f"FAILED: {row.get('error')}"
                if row.get("wall_s") is not None:
                    state += f" ({row['wall_s']:.0f} s)"
                print(f"{cfg['name']} {activation} {impl}: {state}", flush=True)
                if args.out:  # after every case, so that an interrupted run keeps what it measured
                    path = write_result(args.out, env, args_record, rows)
    if path:
        print(f"wrote {path}")
    print()
    print(table(rows))
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
