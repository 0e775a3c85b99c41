#!/usr/bin/env python3
"""Times two or more builds of the library against each other with the benchmark itself: for a
change to kernel code, which tools/ab_tuning.py (MOEBLAZE_CUDA_* variants inside one library)
cannot compare. Each round runs bench/run_bench.py once per build, in a shuffled order, as a
separate process with MOEBLAZE_LIBRARY set to that build (moeblaze rows only, checkpoint policy
save_preact), so the card's clock drift spreads over every build; a row's figure is the median of
its rounds' medians. The benchmark refuses to merge runs of different builds into one result set;
this compares them without merging. A build may also set environment variables
(NAME=PATH,VAR=VALUE,...), so a library's candidate policy can be timed through the switch that
forces it before the policy is written. Prints, per configuration and activation, each build's time,
its speed against the first build, the same speed paired by round (the first build's time over
this build's in each round: the median, the range and in how many rounds it was the faster; a
round's builds ran minutes apart, so the pairing removes the card's drift between rounds), its SM
clock and joules a repetition, and whether every round kept its error against the fp32 reference
under the tolerance and repeated bitwise. --deadline-s bounds the whole comparison: no round starts
that the longest round so far would carry past it, and the table covers the rounds that finished
(every build's, so the pairing holds).

Usage (a GPU machine, from the repository root):
  python3 tools/ab_libraries.py --lib before=build-old/src/libmoeblaze.so \\
      --lib after=build-device/src/libmoeblaze.so --configs conf1,qwen3-30b-a3b \\
      --acts swiglu,silu [--rounds=3] [--row-timing-s 1.2] [--deadline-s S] [--out DIR]
  python3 tools/ab_libraries.py --lib one=lib.so --lib pairs=lib.so,MOEBLAZE_CUDA_F1_CLUSTER=2
  python3 tools/ab_libraries.py --self-test
"""
import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from ab_kernels import parse_build  # noqa: E402


def parse_lib(spec):
    """'name=path[,VAR=VALUE...]' -> (name, absolute path, {VAR: VALUE}): the variables are set in
    that build's benchmark processes only (not MOEBLAZE_LIBRARY: the path sets it)."""
    return parse_build(spec, flag="--lib", need_lib=True)


def moeblaze_rows(doc):
    """A benchmark JSON -> {(config, act): row} of its timed moeblaze save_preact rows."""
    rows = {}
    for row in doc.get("rows", []):
        if row.get("impl") != "moeblaze" or row.get("policy", "save_preact") != "save_preact":
            continue
        if row.get("skipped") or row.get("error") or row.get("ms") is None:
            continue
        rows[(row["config"], row["act"])] = row
    return rows


def summarize(names, runs):
    """runs: {name: [rows of one run, ...]} (round i of every build at index i) -> table rows
    (config, act, name, ms, low, high, speed against names[0], paired speed (median, low, high,
    rounds faster), sm_mhz, joules, error ok and repeatable) for every (config, act) that every
    build timed in every round."""
    keys = None
    for name in names:
        for rows in runs[name]:
            keys = set(rows) if keys is None else keys & set(rows)
    table = []
    for key in sorted(keys or ()):
        per_build = {}
        for name in names:
            vals = [rows[key] for rows in runs[name]]
            ms = [r["ms"] for r in vals]
            mhz = [r["sm_mhz"] for r in vals if r.get("sm_mhz") is not None]
            joules = [r["joules"] for r in vals if r.get("joules") is not None]
            per_build[name] = (statistics.median(ms), min(ms), max(ms),
                               statistics.median(mhz) if mhz else None,
                               statistics.median(joules) if joules else None,
                               all(r.get("err_ok", True) and r.get("bitwise_repeat", True)
                                   for r in vals))
        base = per_build[names[0]][0]
        base_rounds = [rows[key]["ms"] for rows in runs[names[0]]]
        for name in names:
            ms, low, high, mhz, joules, ok = per_build[name]
            ratios = [b / rows[key]["ms"] for b, rows in zip(base_rounds, runs[name])]
            paired = (statistics.median(ratios), min(ratios), max(ratios),
                      sum(r > 1.0 for r in ratios), len(ratios))
            table.append((key[0], key[1], name, ms, low, high, base / ms, paired, mhz, joules,
                          ok))
    return table


def format_table(table):
    lines = ["| config | act | build | ms (median of rounds) | min–max | × first "
             "| × first by round: median (min–max), rounds faster | SM MHz | J a rep "
             "| error ok, repeatable |", "|---|---|---|---:|---|---:|---|---:|---:|---|"]
    for config, act, name, ms, low, high, speed, paired, mhz, joules, ok in table:
        mid, lo, hi, faster, rounds = paired
        cells = [config, act, name, f"{ms:.3f}", f"{low:.3f}–{high:.3f}", f"{speed:.4f}",
                 f"{mid:.4f} ({lo:.4f}–{hi:.4f}), {faster}/{rounds}",
                 "-" if mhz is None else format(mhz, ".0f"),
                 "-" if joules is None else format(joules, ".3f"), "yes" if ok else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def round_fits(elapsed, round_seconds, deadline):
    """Whether another round fits before `deadline` seconds (None: no deadline), `elapsed` seconds
    in, given the durations of the rounds so far (the first round always starts)."""
    if deadline is None or not round_seconds:
        return True
    return elapsed + max(round_seconds) <= deadline


def self_test():
    assert round_fits(0.0, [], 10.0) and round_fits(100.0, [50.0], None)
    assert round_fits(50.0, [40.0, 50.0], 100.0) and not round_fits(51.0, [40.0, 50.0], 100.0)
    assert parse_lib("a=x/lib.so") == ("a", os.path.abspath("x/lib.so"), {})
    assert parse_lib("b=x/lib.so,MOEBLAZE_CUDA_F1_CLUSTER=2,V=") == (
        "b", os.path.abspath("x/lib.so"), {"MOEBLAZE_CUDA_F1_CLUSTER": "2", "V": ""})
    for bad in ("x/lib.so", "=x", "a=", "a=,V=1", "a=x.so,V", "a=x.so,=1",
                "a=x.so,MOEBLAZE_LIBRARY=y.so"):
        try:
            parse_lib(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")

    def run(ms_by_key, mhz=1500.0):
        return {"rows": [{"config": c, "act": a, "impl": "moeblaze", "policy": "save_preact",
                          "ms": ms, "sm_mhz": mhz, "joules": ms / 100, "err_ok": True,
                          "bitwise_repeat": True} for (c, a), ms in
                         ms_by_key.items()]
                + [{"config": "conf1", "act": "silu", "impl": "sonicmoe", "ms": 1.0},
                   {"config": "conf9", "act": "silu", "impl": "moeblaze", "skipped": "budget"},
                   {"config": "conf8", "act": "silu", "impl": "moeblaze", "error": "oom", "ms": 1}]}

    a = [moeblaze_rows(run({("conf1", "silu"): 2.0, ("conf6", "silu"): 6.0})),
         moeblaze_rows(run({("conf1", "silu"): 2.2, ("conf6", "silu"): 6.2})),
         moeblaze_rows(run({("conf1", "silu"): 2.1, ("conf6", "silu"): 6.1}))]
    b = [moeblaze_rows(run({("conf1", "silu"): 1.9})),  # conf6 missing in one round: dropped
         moeblaze_rows(run({("conf1", "silu"): 2.1, ("conf6", "silu"): 5.0})),
         moeblaze_rows(run({("conf1", "silu"): 2.0, ("conf6", "silu"): 5.0}))]
    assert set(a[0]) == {("conf1", "silu"), ("conf6", "silu")}  # peers and skipped rows ignored
    table = summarize(["before", "after"], {"before": a, "after": b})
    assert [(r[0], r[2]) for r in table] == [("conf1", "before"), ("conf1", "after")], table
    before, after = table
    assert abs(before[3] - 2.1) < 1e-12 and (before[4], before[5]) == (2.0, 2.2)
    assert abs(after[3] - 2.0) < 1e-12 and abs(after[6] - 2.1 / 2.0) < 1e-12
    assert before[6] == 1.0 and after[8] == 1500.0 and after[10] is True
    # Paired by round: 2.0/1.9, 2.2/2.1, 2.1/2.0 -> median 1.05, all three faster.
    mid, lo, hi, faster, rounds = after[7]
    assert abs(mid - 2.1 / 2.0) < 1e-12 and abs(lo - 2.2 / 2.1) < 1e-12
    assert abs(hi - 2.0 / 1.9) < 1e-12 and (faster, rounds) == (3, 3), after[7]
    assert before[7][:3] == (1.0, 1.0, 1.0) and before[7][3] == 0
    assert ("| conf1 | silu | after | 2.000 | 1.900–2.100 | 1.0500 | 1.0500 (1.0476–1.0526), "
            "3/3 | 1500 | 0.020 | yes |") in format_table(table), format_table(table)
    # A build faster in the median of rounds can be slower in most paired rounds.
    c = [moeblaze_rows(run({("conf1", "silu"): v})) for v in (1.0, 3.0, 3.0)]
    d = [moeblaze_rows(run({("conf1", "silu"): v})) for v in (2.0, 2.0, 3.1)]
    _, later = summarize(["c", "d"], {"c": c, "d": d})
    assert later[6] > 1.0 and later[7][3] == 1 and later[7][0] < 1.0, later
    print("ab_libraries self-test: ok")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", action="append", default=[], metavar="NAME=PATH[,VAR=VALUE...]",
                   help="a build of libmoeblaze.so and the variables its runs set (two or more; "
                        "the first is the reference)")
    p.add_argument("--configs", default="qwen3-30b-a3b",
                   help="names from bench/configs.json, or all")
    p.add_argument("--acts", default="swiglu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--row-timing-s", type=float, default=1.2)
    p.add_argument("--budget-s", type=float, default=300.0, help="each run_bench.py process's")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="the whole comparison's seconds: no round starts that the longest round so "
                        "far would carry past them; the table covers the rounds that finished")
    p.add_argument("--out", default=None, help="keep every run's JSON here (default: a temp dir)")
    p.add_argument("--self-test", action="store_true")
    a = p.parse_args()
    if a.self_test:
        self_test()
        return 0
    try:
        libs = [parse_lib(spec) for spec in a.lib]
    except ValueError as e:
        p.error(str(e))
    if len(libs) < 2:
        p.error("give at least two --lib NAME=PATH")
    if len({name for name, _, _ in libs}) != len(libs):
        p.error("--lib names must differ")
    for name, path, _ in libs:
        if not os.path.isfile(path):
            p.error(f"--lib {name}: {path} does not exist")
    if a.deadline_s is not None and a.deadline_s <= 0:
        p.error("--deadline-s must be positive")
    for name, path, lib_env in libs:
        settings = " ".join(f"{var}={value}" for var, value in lib_env.items())
        print(f"build {name}: {path}" + (f" with {settings}" if settings else ""), flush=True)
    out = a.out or tempfile.mkdtemp(prefix="ab_libraries_")
    runs = {name: [] for name, _, _ in libs}
    start, round_seconds = time.monotonic(), []
    for round_index in range(a.rounds):
        if not round_fits(time.monotonic() - start, round_seconds, a.deadline_s):
            print(f"== stopped after {round_index} of {a.rounds} rounds: the next would pass "
                  f"--deadline-s {a.deadline_s:g}", flush=True)
            break
        round_start = time.monotonic()
        order = list(libs)
        random.shuffle(order)
        for name, path, lib_env in order:
            run_dir = os.path.join(out, f"round{round_index}-{name}")
            os.makedirs(run_dir, exist_ok=True)
            env = dict(os.environ, MOEBLAZE_LIBRARY=path, **lib_env)
            env["LD_LIBRARY_PATH"] = os.path.dirname(path) + (
                ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
            cmd = [sys.executable, os.path.join(REPO, "bench", "run_bench.py"), "--out", run_dir,
                   "--configs", a.configs, "--acts", a.acts, "--impls", "moeblaze",
                   "--policies", "save_preact", "--dense-reference-s", "0",
                   "--row-timing-s", str(a.row_timing_s), "--budget-s", str(a.budget_s)]
            print(f"== round {round_index + 1}/{a.rounds}: {name}", flush=True)
            with open(os.path.join(run_dir, "log.txt"), "w") as log:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            found = sorted(glob.glob(os.path.join(run_dir, "*.json")))
            if rc != 0 or not found:
                print(f"run_bench.py failed for {name} (exit {rc}); see {run_dir}/log.txt")
                return 1
            with open(found[-1]) as f:
                runs[name].append(moeblaze_rows(json.load(f)))
        round_seconds.append(time.monotonic() - round_start)
    table = summarize([name for name, _, _ in libs], runs)
    print(f"\nruns kept in {out}\n")
    print(format_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
