#!/usr/bin/env python3
"""Turns a results JSON of run_bench.py into markdown tables and PNG plots.

    python3 bench/make_report.py RESULTS.json [--out-dir DIR] [--doc docs/performance.md]
    python3 bench/make_report.py RESULTS.json --publish [--as latest|layer|megablocks]
    python3 bench/make_report.py --roofline --doc docs/performance.md

* writes DIR/report.md (every table, accuracy included) and, when matplotlib is importable, the
  plots DIR/time.png, DIR/saved.png and DIR/peak.png (DIR: --out-dir, default beside the JSON);
* with --doc, replaces the text between the markers
  <!-- BENCH-RESULTS:BEGIN --> and <!-- BENCH-RESULTS:END --> in that file with the summary, the
  time and memory tables and the plots (the accuracy table stays in report.md);
* --publish makes RESULTS.json the committed result set: copies it to bench/results/latest.json,
  writes report.md and the plots there and refreshes docs/performance.md;
* --publish --as layer (or megablocks) makes RESULTS.json bench/results/layer.json (or
  megablocks.json) and refreshes its table in docs/performance.md, between
  <!-- LAYER-RESULTS:BEGIN --> and <!-- LAYER-RESULTS:END --> (MEGABLOCKS-RESULTS);
* with --roofline (no results JSON needed), refreshes the block between
  <!-- ROOFLINE:BEGIN --> and <!-- ROOFLINE:END --> from bench/configs.json.

Every implementation other than moeblaze in the JSON is a baseline and gets its own columns
(grouped_mm, loop, and any added to bench/baselines.py, in that order).
"""

import argparse
import json
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_clocks  # noqa: E402
import roofline  # noqa: E402

RESULTS_BEGIN = "<!-- BENCH-RESULTS:BEGIN -->"
RESULTS_END = "<!-- BENCH-RESULTS:END -->"
ROOFLINE_BEGIN = "<!-- ROOFLINE:BEGIN -->"
ROOFLINE_END = "<!-- ROOFLINE:END -->"
LAYER_BEGIN = "<!-- LAYER-RESULTS:BEGIN -->"
LAYER_END = "<!-- LAYER-RESULTS:END -->"
MEGABLOCKS_BEGIN = "<!-- MEGABLOCKS-RESULTS:BEGIN -->"
MEGABLOCKS_END = "<!-- MEGABLOCKS-RESULTS:END -->"
BASELINE_POLICY = "autograd"
POLICIES = ("save_preact", "save_all", "recompute")
# The committed result set (bench/results/README.md) and the document that shows it.
RESULTS_DIR = os.path.join(HERE, "results")
LATEST_JSON = "latest.json"
REPORT_MD = "report.md"
PLOT_FILES = {"ms": "time.png", "saved_bytes": "saved.png", "peak_bytes": "peak.png"}
PERFORMANCE_DOC = os.path.join(HERE, "..", "docs", "performance.md")
# Baselines in the order their columns appear; others follow in the order of the JSON.
BASELINE_ORDER = ("grouped_mm", "loop", "sonicmoe")
# The targets of docs/performance.md ("Targets").
TARGET_SPEEDUP = 1.3
TARGET_SAVED_RATIO = 0.45
TARGET_PEAK_RATIO = 0.6
TARGET_TFLOPS = 550.0
MIB = float(1 << 20)


def _fmt(value, spec, scale=1.0):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value / scale, spec)


def _keys(rows):
    keys = []
    for r in rows:
        key = (r["config"], r["act"])
        if key not in keys:
            keys.append(key)
    return keys


def _index(rows):
    return {(r["config"], r["act"], r["impl"], r["policy"]): r for r in rows}


def _ratio(a, b):
    if a is None or not b:
        return None
    return a / b


def baselines(rows):
    """The baseline implementations present in the rows, in column order."""
    present = []
    for r in rows:
        if r["impl"] != "moeblaze" and r["impl"] not in present:
            present.append(r["impl"])
    known = [b for b in BASELINE_ORDER if b in present]
    return known + [b for b in present if b not in known]


def _baseline_row(rows, idx, cfg, act, impl):
    """A baseline's row for (cfg, act): its autograd row, else its first row."""
    row = idx.get((cfg, act, impl, BASELINE_POLICY))
    if row is None:
        row = next((r for r in rows if (r["config"], r["act"], r["impl"]) == (cfg, act, impl)),
                   None)
    return row or {}


def speed_table(doc):
    rows = doc["rows"]
    idx = _index(rows)
    bases = baselines(rows)
    # The dense rate the card sustains under its power limit (gpu_clocks.sustained_matmul): the
    # share of that is the fair efficiency of a long run.
    dense = (doc.get("environment", {}).get("dense_reference") or {}).get("tflops")
    head = (["config", "act"] + [f"{b} ms" for b in bases] + ["moeblaze ms"]
            + [f"× vs {b}" for b in bases] + ["moeblaze TFLOP/s"]
            + [f"{b} TFLOP/s" for b in bases[:1]] + ["moeblaze % of 790"]
            + ([f"moeblaze % of sustained {dense:.0f}"] if dense else [])
            + ["compute floor ms", "recompute ms"])
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for cfg, act in _keys(rows):
        base = [_baseline_row(rows, idx, cfg, act, b) for b in bases]
        mb = idx.get((cfg, act, "moeblaze", "save_preact")) or {}
        rc = idx.get((cfg, act, "moeblaze", "recompute")) or {}
        any_row = next((r for r in [mb] + base if r.get("flops")), {})
        floor = None
        if any_row.get("flops"):
            floor = any_row["flops"] / (roofline.H200_BF16_TFLOPS * 1e12) * 1e3
        cells = ([cfg, act] + [_fmt(b.get("ms"), ".3f") for b in base] + [_fmt(mb.get("ms"), ".3f")]
                 + [_fmt(_ratio(b.get("ms"), mb.get("ms")), ".2f") for b in base]
                 + [_fmt(mb.get("tflops"), ".0f")]
                 + [_fmt(b.get("tflops"), ".0f") for b in base[:1]]
                 + [_fmt(_ratio(mb.get("tflops"), roofline.H200_BF16_TFLOPS / 100), ".0f")]
                 + ([_fmt(_ratio(mb.get("tflops"), dense / 100), ".0f")] if dense else [])
                 + [_fmt(floor, ".2f"), _fmt(rc.get("ms"), ".3f")])
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def memory_table(doc):
    rows = doc["rows"]
    idx = _index(rows)
    bases = baselines(rows)
    names = " / ".join(bases)
    first = bases[0] if bases else "baseline"
    out = [f"| config | act | saved MiB {names} | saved MiB moeblaze preact / all / recompute "
           f"| preact ÷ {first} | peak MiB {names} | peak MiB moeblaze preact / all / recompute "
           f"| preact ÷ {first} |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for cfg, act in _keys(rows):
        base = [_baseline_row(rows, idx, cfg, act, b) for b in bases]
        mbs = [idx.get((cfg, act, "moeblaze", p)) or {} for p in POLICIES]
        first_row = base[0] if base else {}

        def each(field):
            return " / ".join(_fmt(b.get(field), ".0f", MIB) for b in base)

        def three(field):
            return " / ".join(_fmt(m.get(field), ".1f" if field == "saved_bytes" else ".0f", MIB)
                              for m in mbs)

        out.append(
            f"| {cfg} | {act} | {each('saved_bytes')} | {three('saved_bytes')} "
            f"| {_fmt(_ratio(mbs[0].get('saved_bytes'), first_row.get('saved_bytes')), '.2f')} "
            f"| {each('peak_bytes')} | {three('peak_bytes')} "
            f"| {_fmt(_ratio(mbs[0].get('peak_bytes'), first_row.get('peak_bytes')), '.2f')} |")
    return "\n".join(out)


def _sampled(row, field):
    """A row's clock or energy field, None where nothing was sampled while it ran."""
    return row.get(field) if row.get("clock_samples") else None


def energy_table(doc):
    """Each row's median SM clock and board power while its repetitions ran, and the joules of one
    repetition (bench/gpu_clocks.py row_clocks), beside the peers'; "" when no row was sampled.
    Under the power limit the implementation that needs fewer joules a step runs its SMs faster,
    so this table says why two step times differ where their kernels' cycles do not."""
    rows = doc["rows"]
    if not any(r.get("clock_samples") for r in rows):
        return ""
    idx = _index(rows)
    bases = baselines(rows)
    names = " / ".join(bases + ["moeblaze"])
    head = (["config", "act", f"SM MHz {names}", f"W {names}", f"J a repetition {names}"]
            + [f"J moeblaze ÷ {b}" for b in bases])
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for cfg, act in _keys(rows):
        impls = [_baseline_row(rows, idx, cfg, act, b) for b in bases]
        mb = idx.get((cfg, act, "moeblaze", "save_preact")) or {}
        impls.append(mb)

        def each(field, spec):
            return " / ".join(_fmt(_sampled(r, field), spec) for r in impls)

        cells = ([cfg, act, each("sm_mhz", ".0f"), each("power_w", ".0f"), each("joules", ".2f")]
                 + [_fmt(_ratio(_sampled(mb, "joules"), _sampled(b, "joules")), ".3f")
                    for b in impls[:-1]])
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def energy_caption(doc):
    """What energy_table's figures are, naming the power reading the run sampled."""
    used = sorted({r.get("power_field") or "power.draw" for r in doc["rows"]
                   if r.get("clock_samples")})
    power = " and ".join(f"`{field}`" for field in used)
    text = ("**Clocks and energy.** Medians of the nvidia-smi samples taken while a row's timed "
            f"repetitions ran: SM clock and board power ({power}); joules a repetition = that "
            "power × the median time. Where the card sits at its power limit, the implementation "
            "that needs fewer joules a step runs at the higher clock.")
    if "power.draw" in used:
        text += (" `power.draw` is a one-second average on Ampere and newer cards, so a row whose "
                 "timing rounds are shorter reads partly its neighbours' draw; the SM clock is "
                 "an instantaneous reading.")
    return text


def accuracy_table(doc):
    out = ["| config | act | impl | policy | y | dx | dw_gate | dw_up | dw_down | dg "
           "| bitwise repeat |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in doc["rows"]:
        if r.get("error") or r.get("skipped"):
            continue
        e = r.get("rel_err") or {}
        cells = " | ".join(_fmt(e.get(n), ".1e") for n in
                           ("y", "dx", "dw_gate", "dw_up", "dw_down", "dg"))
        out.append(f"| {r['config']} | {r['act']} | {r['impl']} | {r['policy']} | {cells} "
                   f"| {r.get('bitwise_repeat', '–')} |")
    return "\n".join(out)


def accuracy_line(doc):
    """The largest relative error of any output, per implementation (the summary of the table)."""
    worst = {}
    for r in doc["rows"]:
        if r.get("error") or r.get("skipped"):
            continue
        values = [v for v in (r.get("rel_err") or {}).values()
                  if isinstance(v, (int, float)) and math.isfinite(v)]
        if values:
            worst[r["impl"]] = max(worst.get(r["impl"], 0.0), max(values))
    if not worst:
        return None
    order = ["moeblaze"] + baselines(doc["rows"])
    parts = [f"{impl} {worst[impl]:.1e}" for impl in order if impl in worst]
    return ("Accuracy: the largest ‖out − ref‖ / ‖ref‖ of any output (y, dx, dg, dw_*) against "
            "the fp32 reference: " + ", ".join(parts) + ".")


def _geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def round_verdict(base_row, mb_row):
    """How moeblaze's row compares with a baseline's round by round (run_bench --interleave: round
    i of both rows ran side by side): "faster" or "slower" when moeblaze's median beat or lost to
    the baseline's in every round, "mixed" otherwise; None without two or more paired rounds. A
    ratio of medians near 1 says little alone: the rounds show whether the lead is consistent."""
    ours, theirs = mb_row.get("ms_rounds") or [], base_row.get("ms_rounds") or []
    if len(ours) < 2 or len(ours) != len(theirs):
        return None
    if all(m < b for m, b in zip(ours, theirs)):
        return "faster"
    if all(m > b for m, b in zip(ours, theirs)):
        return "slower"
    return "mixed"


def _round_summary(rows, idx, mb, baseline):
    """' faster in every paired timing round on X of N rows (...)' or '' without rounds."""
    verdicts = [(r["config"], round_verdict(_baseline_row(rows, idx, r["config"], r["act"],
                                                          baseline), r)) for r in mb]
    verdicts = [(cfg, v) for cfg, v in verdicts if v]
    if not verdicts:
        return ""
    faster = sum(1 for _, v in verdicts if v == "faster")
    others = [f"{cfg} {v}" for cfg, v in verdicts if v != "faster"]
    return (f"; faster in every paired timing round on {faster} of {len(verdicts)}"
            + (f" ({', '.join(others)})" if others else ""))


def target_lines(doc):
    """Per activation: moeblaze's speed-up over each baseline (geometric mean and slowest row), and
    its saved and peak bytes against the first baseline; then the error, tolerance and determinism
    counts."""
    rows = doc["rows"]
    idx = _index(rows)
    bases = baselines(rows)
    lines = []
    for act in sorted({r["act"] for r in rows}):
        mb = [r for r in rows if r["act"] == act and r["impl"] == "moeblaze"
              and r["policy"] == "save_preact" and not r.get("error") and r.get("ms")]
        speed = []
        for b in bases:
            ratios = [_ratio(_baseline_row(rows, idx, r["config"], act, b).get("ms"), r["ms"])
                      for r in mb]
            ratios = [x for x in ratios if x]
            if ratios:
                target = f", target ≥ {TARGET_SPEEDUP}×" if b == "grouped_mm" else ""
                speed.append(f"**{_fmt(_geomean(ratios), '.2f')}×** over {b} (slowest "
                             f"{_fmt(min(ratios), '.2f')}×, {len(ratios)} configurations{target}"
                             f"{_round_summary(rows, idx, mb, b)})")
        first = bases[0] if bases else None
        memory = ""
        if first:
            saved, peak = [], []
            for r in mb:
                base = _baseline_row(rows, idx, r["config"], act, first)
                saved.append(_ratio(r.get("saved_bytes"), base.get("saved_bytes")))
                peak.append(_ratio(r.get("peak_bytes"), base.get("peak_bytes")))
            saved = [x for x in saved if x is not None]
            peak = [x for x in peak if x is not None]
            memory = (f"; saved bytes ÷ {first} at most **{_fmt(max(saved) if saved else None, '.2f')}**"
                      f" (target ≤ {TARGET_SAVED_RATIO} for SwiGLU); peak ÷ {first} at most "
                      f"**{_fmt(max(peak) if peak else None, '.2f')}** (target ≤ "
                      f"{TARGET_PEAK_RATIO})")
        lines.append(f"- **{act}**: geometric-mean speed-up " + ("; ".join(speed) or "–")
                     + memory + ".")
    n_err = sum(1 for r in rows if r.get("error"))
    n_tol = sum(1 for r in rows if r.get("err_ok") is False)
    n_nondet = sum(1 for r in rows if r["impl"] == "moeblaze" and r.get("bitwise_repeat") is False)
    if any(str(r.get("impl_source", "")).startswith("SHIM") for r in rows):
        lines.append("- **WARNING: the moeblaze rows were produced by the development shim (the "
                     "loop baseline), not by moeblaze.**")
    lines.append(f"- rows with errors: {n_err}; rows over the accuracy tolerance "
                 f"({doc.get('method', {}).get('err_tolerance', '?')}): {n_tol}; moeblaze rows "
                 f"not bitwise reproducible: {n_nondet}.")
    return lines


def error_lines(doc):
    lines = []
    for r in doc["rows"]:
        if r.get("error"):
            lines.append(f"- {r['config']}/{r['act']}/{r['impl']}/{r['policy']}: "
                         f"`{r['error'][:200]}`")
        elif r.get("skipped"):
            lines.append(f"- {r['config']}/{r['act']}/{r['impl']}/{r['policy']}: skipped "
                         f"({r['skipped']})")
    return lines


def clock_lines(doc):
    """The card's sustained dense rate and clocks, when the JSON records them: under a power cap,
    TFLOP/s figures mean little without them."""
    env = doc.get("environment", {})
    dense = env.get("dense_reference") or {}
    lines = []
    if dense.get("tflops"):
        lines.append(f"Sustained dense {dense['dtype']} matmul ({dense['shape']}, back to back for "
                     f"{dense['seconds']} s before the rows): **{dense['tflops']:.0f} TFLOP/s**; "
                     f"{gpu_clocks.describe(dense.get('clocks'))}.")
    runs = doc.get("runs") or []
    if len(runs) > 1:
        for i, run in enumerate(runs, 1):
            if run.get("clocks_during_run"):
                lines.append(f"Clocks during the rows of command {i}: "
                             f"{gpu_clocks.describe(run['clocks_during_run'])}.")
    elif env.get("clocks_during_run"):
        lines.append(f"Clocks during the rows: {gpu_clocks.describe(env['clocks_during_run'])}.")
    return lines


def peer_lines(doc):
    """The peers' versions the run recorded (run_bench.py environment "peers"), when any."""
    found = doc.get("environment", {}).get("peers") or {}
    if not found:
        return []
    return ["Peers: " + "; ".join(f"{name} {version}" for name, version in found.items()) + "."]


def command_lines(doc):
    """The command, or for a merged result set (run_bench.py --merge) each run's."""
    runs = doc.get("runs") or []
    if len(runs) > 1:
        intro = ("Runs, merged into this set with `run_bench.py --merge` (each configuration × "
                 "activation comes whole from one run, so its rows were timed side by side):")
        return [intro, ""] + [f"{i}. `{scrub_text(run.get('command') or '')}` "
                              f"({run.get('date_utc', '')})" for i, run in enumerate(runs, 1)] + [""]
    return [f"Command: `{scrub_text(doc.get('command') or '')}`"]


def build_checked(doc):
    """Whether tools/same_code.py found the run's library (whose build info names another
    revision) to hold the code of a build of the run's commit (the run's build_check)."""
    check = doc.get("build_check") or {}
    info = doc.get("environment", {}).get("moeblaze_build_info", "")
    return bool(check.get("same_code_as")) and str(doc.get("commit", "")).startswith(
        check["same_code_as"]) and f"(git {check.get('library_revision')})" in info


def build_check_lines(doc):
    if not build_checked(doc):
        return []
    check = doc["build_check"]
    return [f"**Build check:** the library reported revision `{check['library_revision']}`; "
            f"{check.get('by', 'tools/same_code.py')} found it the same code as a build of "
            f"`{check['same_code_as']}` ({'; '.join(check.get('compared', []))})."]


def markdown(doc, plot_names=(), image_dir="", accuracy=True):
    """The report. image_dir prefixes the plots' file names (the path from the markdown file that
    shows them to the plots); accuracy=False replaces the accuracy table by its one-line summary
    (the block in docs/performance.md)."""
    env = doc.get("environment", {})
    parts = [
        f"Device **{doc.get('device')}**, commit `{doc.get('commit')}`, "
        f"{doc.get('date_utc', '')}; torch {env.get('torch')}"
        f"{', CUDA ' + str(env['cuda']) if env.get('cuda') else ''}; dtype {env.get('dtype')}.",
        f"moeblaze: {env.get('moeblaze_build_info', env.get('moeblaze', '?'))}"
        + {True: "; backward consumes its saved buffer (consume_saved=True, the default).",
           False: "; backward keeps its saved buffer (--keep-saved).",
           None: "."}[env.get("moeblaze_consume_saved")],
        *peer_lines(doc),
        *([f"**Commit mismatch:** {doc['commit_mismatch']}."]
          if doc.get("commit_mismatch") and not build_checked(doc) else []),
        *build_check_lines(doc),
        *command_lines(doc),
        *clock_lines(doc),
        "",
        *target_lines(doc),
        "",
        "**Time** (fwd+bwd, median ms; TFLOP/s count 18·T·k·d·h gated, 12·T·k·d·h otherwise; "
        "moeblaze = save_preact):",
        "",
        speed_table(doc),
        "",
        "**Memory** (saved = unique storages handed to autograd beyond the inputs; peak = "
        "max_memory_allocated during fwd+bwd above what was allocated before):",
        "",
        memory_table(doc),
    ]
    energy = energy_table(doc)
    if energy:
        parts += ["", energy_caption(doc), "", energy]
    if accuracy:
        parts += ["", "**Accuracy** (‖out − ref‖ / ‖ref‖ against the fp32 reference):", "",
                  accuracy_table(doc)]
    else:
        line = accuracy_line(doc)
        if line:
            parts += ["", line]
    errors = error_lines(doc)
    if errors:
        parts += ["", "**Errors and skipped rows:**", ""] + errors
    for name in plot_names:
        parts += ["", f"![{name}]({image_dir}{name})"]
    return "\n".join(parts) + "\n"


# Absolute paths of the machine a run came from (its --out folder, the library it loaded): the
# committed result set names files, not machines.
_MACHINE_PATH = re.compile(r"(?<![\w.$])/(?:work|tmp|root|home|scratch|mnt)/[^\s\"']*")


def scrub_text(text):
    text = re.sub(r"--out(\s+|=)(?:\"[^\"]*\"|\S+)", r'--out\1"$OUT"', text)
    return _MACHINE_PATH.sub(lambda m: os.path.basename(m.group(0).rstrip("/")) or ".", text)


def scrub_machine_paths(value):
    """value with every machine path replaced (the --out folder by $OUT, other paths by their file
    name), recursively through lists and dicts."""
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, list):
        return [scrub_machine_paths(v) for v in value]
    if isinstance(value, dict):
        return {k: scrub_machine_paths(v) for k, v in value.items()}
    return value


def plots(doc, out_dir):
    """PNG bar charts of time and memory per configuration (PLOT_FILES); returns the file names
    written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        print(f"make_report: no plots ({error})", flush=True)
        return []
    rows = doc["rows"]
    idx = _index(rows)
    acts = []
    for r in rows:
        if r["act"] not in acts:
            acts.append(r["act"])
    labels = {"grouped_mm": "grouped_mm dataflow", "loop": "per-expert loop"}
    series = [(b, labels.get(b, b)) for b in baselines(rows)] + \
             [(("moeblaze", p), f"moeblaze {p}") for p in POLICIES]
    written = []

    def value(cfg, act, impl, field):
        if isinstance(impl, tuple):
            row = idx.get((cfg, act) + impl) or {}
        else:
            row = _baseline_row(rows, idx, cfg, act, impl)
        return row.get(field)

    def bars(field, scale, ylabel, title, log):
        if not any(r.get(field) is not None for r in rows):
            return  # e.g. peak bytes of a CPU run
        fig, axes = plt.subplots(len(acts), 1, figsize=(12, 3.6 * len(acts)), squeeze=False)
        for ax, act in zip(axes[:, 0], acts):
            cfgs = [c for c, a in _keys(rows) if a == act]
            width = 0.8 / len(series)
            for i, (impl, label) in enumerate(series):
                values = []
                for c in cfgs:
                    v = value(c, act, impl, field)
                    values.append(float("nan") if v is None else v / scale)
                if all(math.isnan(v) for v in values):
                    continue
                xs = [j + (i - len(series) / 2 + 0.5) * width for j in range(len(cfgs))]
                ax.bar(xs, values, width, label=label)
            ax.set_xticks(range(len(cfgs)))
            ax.set_xticklabels(cfgs, rotation=20)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title} — {act}")
            if log:
                ax.set_yscale("log")
            ax.grid(axis="y", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.suptitle(f"{doc.get('device')} · {doc.get('commit', '')[:12]}")
        fig.tight_layout()
        fname = PLOT_FILES[field]
        fig.savefig(os.path.join(out_dir, fname), dpi=110)
        plt.close(fig)
        written.append(fname)

    bars("ms", 1.0, "ms (log)", "fwd+bwd time", True)
    bars("saved_bytes", float(1 << 30), "GiB", "bytes saved for backward", False)
    bars("peak_bytes", float(1 << 30), "GiB", "peak memory above inputs", False)
    return written


def replace_block(path, begin, end, body):
    with open(path) as f:
        text = f.read()
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"{path}: markers {begin} ... {end} not found")
    text = text[:i + len(begin)] + "\n" + body.rstrip("\n") + "\n" + text[j:]
    with open(path, "w") as f:
        f.write(text)


def report(json_path, out_dir=None, doc_path=None, make_plots=True):
    """Writes out_dir/report.md and the plots (PLOT_FILES) for a results JSON; with doc_path, also
    refreshes that document's results block, its plot links relative to the document."""
    with open(json_path) as f:
        doc = json.load(f)
    out_dir = out_dir or os.path.dirname(os.path.abspath(json_path))
    os.makedirs(out_dir, exist_ok=True)
    if make_plots:
        names = plots(doc, out_dir)
    else:  # keep the plots already there
        names = [n for n in PLOT_FILES.values() if os.path.exists(os.path.join(out_dir, n))]
    text = markdown(doc, names)
    md_path = os.path.join(out_dir, REPORT_MD)
    with open(md_path, "w") as f:
        f.write(text)
    print(f"make_report: wrote {md_path}" + (f" and {', '.join(names)}" if names else ""),
          flush=True)
    if doc_path:
        image_dir = os.path.relpath(os.path.abspath(out_dir),
                                    os.path.dirname(os.path.abspath(doc_path)))
        block = markdown(doc, names, image_dir=image_dir.replace(os.sep, "/") + "/",
                         accuracy=False)
        replace_block(doc_path, RESULTS_BEGIN, RESULTS_END, block)
        print(f"make_report: updated {doc_path}", flush=True)
    return text


PEER_NAMES = {"grouped_mm": "grouped_mm", "sonicmoe": "SonicMoE", "megablocks": "MegaBlocks"}
# The activations' names in tables (bench/baselines.py's ACTIVATIONS).
ACT_NAMES = {"swiglu": "SwiGLU", "geglu": "GeGLU", "reglu": "ReGLU", "silu": "SiLU",
             "gelu": "GELU", "relu": "ReLU", "relu2": "ReLU²"}


def _peer_name(impl):
    return PEER_NAMES.get(impl, impl)


def _moeblaze_row(rows, idx, cfg, act):
    """moeblaze's save_preact row for (cfg, act), else its first row."""
    row = idx.get((cfg, act, "moeblaze", "save_preact"))
    if row is None:
        key = (cfg, act, "moeblaze")
        row = next((r for r in rows if (r["config"], r["act"], r["impl"]) == key), None)
    return row or {}


def layer_table(doc):
    """The whole-layer table of docs/performance.md: per configuration, every baseline's and
    moeblaze's ms, moeblaze's speed-up over each baseline and the peaks in GiB (an activation
    column when the run has more than one)."""
    rows = [r for r in doc["rows"] if r.get("ms") is not None]
    if not rows:
        return "(no timed rows)\n"
    idx, names = _index(rows), baselines(rows)
    keys = _keys(rows)
    with_act = len({act for _, act in keys}) > 1
    head = ["config"] + (["act"] if with_act else [])
    head += [f"{_peer_name(b)} ms" for b in names] + ["moeblaze ms"]
    head += [f"× {_peer_name(b)}" for b in names]
    head += ["peak GiB moeblaze / " + " / ".join(_peer_name(b) for b in names)]
    lines = ["| " + " | ".join(head) + " |",
             "|---" * (1 + with_act) + "|---:" * (2 * len(names) + 1) + "|---|"]
    for cfg, act in keys:
        mb = _moeblaze_row(rows, idx, cfg, act)
        peers = [_baseline_row(rows, idx, cfg, act, b) for b in names]
        cells = [cfg] + ([act] if with_act else [])
        cells += [_fmt(r.get("ms"), ".2f") for r in peers] + [_fmt(mb.get("ms"), ".2f")]
        cells += [_fmt(_ratio(r.get("ms"), mb.get("ms")), ".2f") for r in peers]
        cells.append(" / ".join(_fmt(r.get("peak_bytes"), ".2f", float(1 << 30))
                                for r in [mb] + peers))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def megablocks_table(doc):
    """The MegaBlocks table of docs/performance.md: per configuration and activation, MegaBlocks'
    and moeblaze's ms and moeblaze's speed-up, then the peaks in GiB of the first activation."""
    rows = [r for r in doc["rows"] if r.get("ms") is not None]
    idx = _index(rows)
    configs, acts = [], []
    for cfg, act in _keys(rows):
        configs += [cfg] if cfg not in configs else []
        acts += [act] if act not in acts else []
    if not acts:
        return "(no timed rows)\n"
    head = ["config"]
    for act in acts:
        head += [f"{ACT_NAMES.get(act, act)}: MegaBlocks / moeblaze ms", "×"]
    head.append(f"peak GiB moeblaze / MegaBlocks ({ACT_NAMES.get(acts[0], acts[0])})")
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---|---:" * len(acts) + "|---|"]
    for cfg in configs:
        cells = [cfg]
        for act in acts:
            mb = _moeblaze_row(rows, idx, cfg, act)
            peer = _baseline_row(rows, idx, cfg, act, "megablocks")
            cells += [f"{_fmt(peer.get('ms'), '.2f')} / {_fmt(mb.get('ms'), '.2f')}",
                      _fmt(_ratio(peer.get("ms"), mb.get("ms")), ".2f")]
        mb = _moeblaze_row(rows, idx, cfg, acts[0])
        peer = _baseline_row(rows, idx, cfg, acts[0], "megablocks")
        cells.append(f"{_fmt(mb.get('peak_bytes'), '.2f', float(1 << 30))} / "
                     f"{_fmt(peer.get('peak_bytes'), '.2f', float(1 << 30))}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --publish --as NAME: the results file in bench/results/ and the block of docs/performance.md
# that a run of that kind replaces (latest: the result set, its report and plots; the others one
# JSON and one table).
PUBLISH_AS = {
    "layer": ("layer.json", LAYER_BEGIN, LAYER_END, layer_table),
    "megablocks": ("megablocks.json", MEGABLOCKS_BEGIN, MEGABLOCKS_END, megablocks_table),
}


def publish(json_path, results_dir=RESULTS_DIR, doc_path=PERFORMANCE_DOC, make_plots=True,
            as_="latest"):
    """Makes json_path a committed result: as_ "latest", the result set (results_dir/latest.json,
    report.md and the plots beside it, and the results block of doc_path); "layer" or
    "megablocks", results_dir/layer.json or megablocks.json and that table's block of doc_path.
    Machine paths are replaced in every case."""
    if as_ != "latest" and as_ not in PUBLISH_AS:
        raise SystemExit(f"--as {as_}: expected latest, " + ", ".join(PUBLISH_AS))
    with open(json_path) as f:
        doc = scrub_machine_paths(json.load(f))
    if doc.get("commit_mismatch") and not build_checked(doc):
        # A committed result names the build it measured.
        raise SystemExit(f"make_report: {json_path} is not published: {doc['commit_mismatch']}")
    os.makedirs(results_dir, exist_ok=True)
    if as_ != "latest":
        name, begin, end, table = PUBLISH_AS[as_]
        path = os.path.join(results_dir, name)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"make_report: wrote {path}", flush=True)
        text = table(doc)
        if doc_path:
            replace_block(doc_path, begin, end, text)
            print(f"make_report: updated {doc_path}", flush=True)
        return text
    latest = os.path.join(results_dir, LATEST_JSON)
    with open(latest, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"make_report: wrote {latest}", flush=True)
    return report(latest, results_dir, doc_path, make_plots)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", help="results JSON from run_bench.py")
    parser.add_argument("--doc", default=None, help="markdown file with the markers to fill")
    parser.add_argument("--out-dir", "--plots-dir", dest="out_dir", default=None,
                        help="where report.md and the plots go (default: beside the JSON)")
    parser.add_argument("--publish", action="store_true",
                        help="make RESULTS the committed result set (bench/results/latest.json, "
                             "report.md, plots) and refresh docs/performance.md")
    parser.add_argument("--as", dest="as_", default="latest",
                        choices=["latest"] + sorted(PUBLISH_AS),
                        help="with --publish: what the run replaces (latest: the result set; "
                             "layer: bench/results/layer.json and the whole-layer table; "
                             "megablocks: megablocks.json and the MegaBlocks table)")
    parser.add_argument("--no-plots", action="store_true",
                        help="leave the plots as they are (e.g. without matplotlib)")
    parser.add_argument("--roofline", action="store_true",
                        help="refresh the roofline block of --doc from bench/configs.json")
    args = parser.parse_args()
    if not args.results and not args.roofline:
        parser.error("give a results JSON, --roofline, or both")
    if args.publish and not args.results:
        parser.error("--publish needs a results JSON")
    if args.as_ != "latest" and not args.publish:
        parser.error("--as needs --publish")
    if args.roofline:
        doc_path = args.doc or (PERFORMANCE_DOC if args.publish else None)
        if not doc_path:
            parser.error("--roofline needs --doc")
        replace_block(doc_path, ROOFLINE_BEGIN, ROOFLINE_END,
                      roofline.markdown_table(roofline.load_configs()))
        print(f"make_report: roofline block of {doc_path} refreshed", flush=True)
    if args.publish:
        publish(args.results, doc_path=args.doc or PERFORMANCE_DOC,
                make_plots=not args.no_plots, as_=args.as_)
    elif args.results:
        report(args.results, args.out_dir, args.doc, make_plots=not args.no_plots)


if __name__ == "__main__":
    main()
