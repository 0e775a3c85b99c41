#!/usr/bin/env python3
"""Per-kernel GPU times of two or more builds, or kernel forms, against each other: each round runs
tests/cuda/profile_kernels.py once per build and shape, as a separate process, in an order that is
reversed every round (A B, B A, ...), so the card's clock drift falls on every build alike. A build
is a library (MOEBLAZE_LIBRARY) with optional environment variables, so a kernel form forced by a
MOEBLAZE_CUDA_* switch can be compared within one library as well. Prints, per shape and build, the
median over rounds of the step's time and of each tagged GEMM's (F1, F2, B1, ...), with the
speed against the first build, and the untagged kernels' time (rest) and every kernel's (busy).
For a kernel change this is the diagnosis; the benchmark
(tools/ab_libraries.py, bench/run_bench.py) decides.

Usage (a GPU machine, from the repository root):
  python3 tools/ab_kernels.py --build before=build-old/src/libmoeblaze.so \\
      --build after=build-device/src/libmoeblaze.so --shapes conf5:silu,conf1:swiglu \\
      [--kernels B1,F1] [--rounds=2] [--steps=7] [--budget-s=500]
  python3 tools/ab_kernels.py --build split=lib.so,MOEBLAZE_CUDA_B1_FORM=split \\
      --build split2=lib.so,MOEBLAZE_CUDA_B1_FORM=split2 --shapes conf6:silu --kernels B1
  python3 tools/ab_kernels.py --self-test
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from shape_args import args_for, load_configs  # noqa: E402

STEP = "step"  # the column of the whole forward + backward
REST = "rest"  # the profiled step's untagged kernels (routing indices, dg sums, copies, ...)
BUSY = "busy"  # every kernel of the profiled steps (the step column is timed apart, unprofiled)


def parse_build(spec, flag="--build", need_lib=False):
    """'name=LIB[,VAR=VALUE...]' -> (name, absolute LIB path or None, {VAR: VALUE}). An empty LIB
    keeps the environment's MOEBLAZE_LIBRARY, unless need_lib; a LIB sets it, so the variables may
    not. flag names the option in errors (tools/ab_libraries.py's --lib takes the same form)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise ValueError(f"{flag} {spec!r}: expected NAME=LIB[,VAR=VALUE...]")
    lib, *assignments = rest.split(",")
    env = {}
    for item in assignments:
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise ValueError(f"{flag} {spec!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    if need_lib and not lib:
        raise ValueError(f"{flag} {spec!r}: give the path of a libmoeblaze.so")
    if lib and "MOEBLAZE_LIBRARY" in env:
        raise ValueError(f"{flag} {spec!r}: the path sets MOEBLAZE_LIBRARY; give it as NAME=PATH")
    if not lib and not env:
        raise ValueError(f"{flag} {spec!r}: give a library, a variable, or both")
    return name, os.path.abspath(lib) if lib else None, env


def parse_shapes(text):
    """'conf5:silu,conf1:swiglu' -> [('conf5', 'silu'), ('conf1', 'swiglu')]."""
    shapes = []
    for item in text.split(","):
        config, sep, act = item.partition(":")
        if not sep or not config or not act:
            raise ValueError(f"--shapes: {item!r} is not CONFIG:ACT")
        shapes.append((config, act))
    return shapes


KERNEL_LINE = re.compile(r"^kernel\s+([0-9.]+) ms \(([0-9.]+)-([0-9.]+)\)\s+x(\d+)\s+(\S+)\s")
STEP_LINE = re.compile(r"^fwd\+bwd ([0-9.]+) ms")
# The summary of every kernel of the profiled steps, listed or not (profile_kernels.py lists the
# largest --rows of them).
CLASSES_LINE = re.compile(r"^kernel classes \(.*?, \d+ kernels, ([0-9.]+) ms\)")


def parse_profile(text):
    """profile_kernels.py's output -> {'step': ms, TAG: ms a step, ..., 'busy': every kernel's ms
    a step, 'rest': busy less the tagged kernels}; the kernels of one tag are added. busy comes
    from the summary line, which covers the kernels the listing leaves out too."""
    times = {}
    busy = None
    listed = 0.0
    for line in text.splitlines():
        m = STEP_LINE.match(line)
        if m:
            times[STEP] = float(m.group(1))
            continue
        m = CLASSES_LINE.match(line)
        if m:
            busy = float(m.group(1))
            continue
        m = KERNEL_LINE.match(line)
        if m:
            listed += float(m.group(1))
            if m.group(5) != "-":
                times[m.group(5)] = times.get(m.group(5), 0.0) + float(m.group(1))
    if busy is not None or listed > 0:
        times[BUSY] = busy if busy is not None else listed
        tagged = sum(ms for tag, ms in times.items() if tag not in (STEP, BUSY))
        times[REST] = max(times[BUSY] - tagged, 0.0)
    return times


def round_order(builds, round_index):
    """The builds in their given order on even rounds, reversed on odd ones."""
    return list(builds) if round_index % 2 == 0 else list(reversed(builds))


def summarize(names, runs, kernels):
    """runs: {(shape, name): [times of a round, ...]} -> rows (shape, name, rounds, {column:
    (median ms, speed against names[0] or None)}) for every shape every build has a round of."""
    columns = [STEP] + list(kernels)
    shapes = list(dict.fromkeys(shape for shape, _ in runs))
    table = []
    for shape in shapes:
        if not all(runs.get((shape, name)) for name in names):
            continue
        medians = {}
        for name in names:
            medians[name] = {}
            for col in columns:
                vals = [t[col] for t in runs[(shape, name)] if col in t]
                medians[name][col] = statistics.median(vals) if vals else None
        for name in names:
            cells = {}
            for col in columns:
                ms, first = medians[name][col], medians[names[0]][col]
                cells[col] = (ms, first / ms if ms and first else None)
            table.append((shape, name, len(runs[(shape, name)]), cells))
    return table, columns


def format_table(table, columns):
    head = "| shape | build | rounds | " + " | ".join(
        f"{c} ms | × first" for c in columns) + " |"
    lines = [head, "|---|---|---:|" + "---:|---:|" * len(columns)]
    for (config, act), name, rounds, cells in table:
        row = [f"{config} {act}", name, str(rounds)]
        for col in columns:
            ms, speed = cells[col]
            row += ["-" if ms is None else f"{ms:.3f}", "-" if speed is None else f"{speed:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def self_test():
    assert parse_build("a=x/lib.so") == ("a", os.path.abspath("x/lib.so"), {})
    assert parse_build("s2=x.so,MOEBLAZE_CUDA_B1_FORM=split2,B=1") == \
        ("s2", os.path.abspath("x.so"), {"MOEBLAZE_CUDA_B1_FORM": "split2", "B": "1"})
    assert parse_build("w=,MOEBLAZE_CUDA_B1_FORM=warps") == \
        ("w", None, {"MOEBLAZE_CUDA_B1_FORM": "warps"})
    for bad in ("x.so", "=x.so", "a=", "a=x.so,NOVALUE", "a=x.so,=1", "a=x.so,MOEBLAZE_LIBRARY=y"):
        try:
            parse_build(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
    assert parse_shapes("conf5:silu,qwen3-30b-a3b:swiglu") == \
        [("conf5", "silu"), ("qwen3-30b-a3b", "swiglu")]
    for bad in ("conf5", "conf5:", ":silu"):
        try:
            parse_shapes(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
    assert round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    sample = "\n".join([
        "fwd+bwd 3.418 ms, 482.5 TFLOP/s (T=32768 d=512 h=2048 E=16 k=4 silu save_preact random)",
        "kernel classes (moeblaze, median of 7 steps, 5 kernels, 1.561 ms): gemm 1.491 ms (95.5 %)",
        "kernel  median ms (min-max over 7 steps)  calls a step  tag  class  name",
        "kernel    0.991 ms (0.985-1.009)  x1   B1  gemm               void moeblaze::b1",
        "kernel    0.395 ms (0.385-0.399)  x2   F2  gemm               void moeblaze::f2a",
        "kernel    0.105 ms (0.100-0.110)  x1   F2  gemm               void moeblaze::f2b",
        "kernel    0.050 ms (0.049-0.052)  x1   -   elementwise        void at::fill"])
    times = parse_profile(sample)
    assert set(times) == {STEP, "B1", "F2", REST, BUSY}, times
    # busy from the summary (a fifth kernel of 0.020 ms is not listed): rest includes it.
    assert times[STEP] == 3.418 and times["B1"] == 0.991 and times[BUSY] == 1.561, times
    assert abs(times["F2"] - 0.5) < 1e-12 and abs(times[REST] - 0.07) < 1e-12, times
    no_summary = parse_profile("\n".join(line for line in sample.split("\n")
                                         if not line.startswith("kernel classes")))
    assert abs(no_summary[BUSY] - 1.541) < 1e-12 and abs(no_summary[REST] - 0.05) < 1e-12
    shape = ("conf5", "silu")
    runs = {(shape, "base"): [{STEP: 3.4, "B1": 1.0}, {STEP: 3.6, "B1": 0.98},
                              {STEP: 3.5, "B1": 0.99}],
            (shape, "new"): [{STEP: 3.3, "B1": 0.85}, {STEP: 3.2, "B1": 0.86},
                             {STEP: 3.25, "B1": 0.87}],
            (("conf1", "silu"), "base"): [{STEP: 2.0}]}  # no round of "new": left out
    table, columns = summarize(["base", "new"], runs, ["B1", "F1"])
    assert columns == [STEP, "B1", "F1"]
    assert [(row[0], row[1], row[2]) for row in table] == [(shape, "base", 3), (shape, "new", 3)]
    new = table[1][3]
    assert abs(new[STEP][0] - 3.25) < 1e-12 and abs(new[STEP][1] - 3.5 / 3.25) < 1e-12
    assert abs(new["B1"][1] - 0.99 / 0.86) < 1e-12 and new["F1"] == (None, None)
    text = format_table(table, columns)
    assert "| conf5 silu | new | 3 | 3.250 | 1.077 | 0.860 | 1.151 | - | - |" in text, text
    print("ab_kernels self-test: ok")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", action="append", default=[], metavar="NAME=LIB[,VAR=VALUE...]",
                   help="a build: a libmoeblaze.so and/or environment variables (two or more; the "
                        "first is the reference)")
    p.add_argument("--shapes", default="conf5:silu",
                   help="CONFIG:ACT pairs, configurations from bench/configs.json")
    p.add_argument("--kernels", default=None,
                   help="kernel tags to report (tools/kernel_tags.py; default the GEMMs and RD, "
                        "the per-token sums, and with --layer RF and RB, the router's), and "
                        "'rest' (every untagged kernel) and 'busy' (every kernel; the step "
                        "column is timed apart from the profiled steps, without the profiler)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=7, help="profiled steps a run (their median)")
    p.add_argument("--policy", default="save_preact")
    p.add_argument("--layer", action="store_true",
                   help="profile the whole layer (profile_kernels.py --layer): the router's "
                        "kernels too (tags RF, RB)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no run after this many seconds; report what ran")
    p.add_argument("--self-test", action="store_true")
    a = p.parse_args()
    if a.self_test:
        self_test()
        return 0
    try:
        builds = [parse_build(spec) for spec in a.build]
        shapes = parse_shapes(a.shapes)
    except ValueError as error:
        p.error(str(error))
    if len(builds) < 2:
        p.error("give at least two --build NAME=LIB[,VAR=VALUE...]")
    if len({name for name, _, _ in builds}) != len(builds):
        p.error("--build names must differ")
    for name, lib, _ in builds:
        if lib is not None and not os.path.isfile(lib):
            p.error(f"--build {name}: {lib} does not exist")
    configs = load_configs()
    for config, _ in shapes:
        if config not in configs:
            p.error(f"--shapes: unknown configuration {config!r}")
    if a.kernels is None:
        a.kernels = "F1,F2,B1,B2,B3,B4,RD" + (",RF,RB" if a.layer else "") + ",rest,busy"
    kernels = [k for k in a.kernels.split(",") if k]
    start = time.time()
    plan = [(round_index, shape, build) for round_index in range(a.rounds) for shape in shapes
            for build in round_order(builds, round_index)]
    runs = {}
    for round_index, shape, (name, lib, extra) in plan:
        if a.budget_s is not None and time.time() - start > a.budget_s:
            print(f"budget of {a.budget_s:.0f} s spent: the runs so far", flush=True)
            break
        env = dict(os.environ, **extra)
        if lib is not None:
            env["MOEBLAZE_LIBRARY"] = lib
        cmd = [sys.executable, os.path.join(REPO, "tests", "cuda", "profile_kernels.py"),
               *args_for(shape[0], configs).split(), "--act", shape[1], "--policy", a.policy,
               "--steps", str(a.steps), "--rows", "40"] + (["--layer"] if a.layer else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        times = parse_profile(done.stdout)
        if done.returncode != 0 or STEP not in times:
            print(f"profile_kernels.py failed for {name} on {shape[0]} {shape[1]} (exit "
                  f"{done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}")
            return 1
        runs.setdefault((shape, name), []).append(times)
        print(f"round {round_index + 1} {shape[0]} {shape[1]} {name}: step {times[STEP]:.3f} ms " +
              " ".join(f"{k} {times[k]:.3f}" for k in kernels if k in times), flush=True)
    table, columns = summarize([name for name, _, _ in builds], runs, kernels)
    print()
    print(format_table(table, columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
