#!/usr/bin/env python3
"""Turns a results JSON of run_bench.py into markdown tables and PNG plots.

    python3 bench/make_report.py bench/results/2026-11-29-nvidia-h200.json \
        [--doc docs/performance.md] [--plots-dir bench/results] [--roofline]

* writes <plots-dir>/<stem>.md (the tables) and, when matplotlib is importable,
  <plots-dir>/<stem>-time.png and <stem>-memory.png;
* with --doc, replaces the text between the markers
  <!-- BENCH-RESULTS:BEGIN --> and <!-- BENCH-RESULTS:END --> in that file;
* with --roofline (no results JSON needed), refreshes the block between
  <!-- ROOFLINE:BEGIN --> and <!-- ROOFLINE:END --> from bench/configs.json.
"""

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_clocks  # noqa: E402
import roofline  # noqa: E402

RESULTS_BEGIN = "<!-- BENCH-RESULTS:BEGIN -->"
RESULTS_END = "<!-- BENCH-RESULTS:END -->"
ROOFLINE_BEGIN = "<!-- ROOFLINE:BEGIN -->"
ROOFLINE_END = "<!-- ROOFLINE:END -->"
BASELINE_POLICY = "autograd"
POLICIES = ("save_preact", "save_all", "recompute")
# architecture.md section 7
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


def speed_table(doc):
    rows = doc["rows"]
    idx = _index(rows)
    # Runs from session 13 on also measure the dense rate the card sustains under its power limit
    # (gpu_clocks.sustained_matmul); the share of that is the fair efficiency of a long run.
    dense = (doc.get("environment", {}).get("dense_reference") or {}).get("tflops")
    dense_head = f" moeblaze % of sustained {dense:.0f} |" if dense else ""
    out = ["| config | act | grouped_mm ms | loop ms | moeblaze ms | × vs grouped_mm | × vs loop "
           "| moeblaze TFLOP/s | grouped_mm TFLOP/s | moeblaze % of 790 |" + dense_head +
           " compute floor ms | recompute ms |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if dense else "") +
           "---:|---:|"]
    for cfg, act in _keys(rows):
        g = idx.get((cfg, act, "grouped_mm", BASELINE_POLICY)) or {}
        lp = idx.get((cfg, act, "loop", BASELINE_POLICY)) or {}
        mb = idx.get((cfg, act, "moeblaze", "save_preact")) or {}
        rc = idx.get((cfg, act, "moeblaze", "recompute")) or {}
        any_row = g or lp or mb
        floor = None
        if any_row.get("flops"):
            floor = any_row["flops"] / (roofline.H200_BF16_TFLOPS * 1e12) * 1e3
        out.append(
            f"| {cfg} | {act} | {_fmt(g.get('ms'), '.3f')} | {_fmt(lp.get('ms'), '.3f')} "
            f"| {_fmt(mb.get('ms'), '.3f')} | {_fmt(_ratio(g.get('ms'), mb.get('ms')), '.2f')} "
            f"| {_fmt(_ratio(lp.get('ms'), mb.get('ms')), '.2f')} "
            f"| {_fmt(mb.get('tflops'), '.0f')} "
            f"| {_fmt(g.get('tflops'), '.0f')} "
            f"| {_fmt(_ratio(mb.get('tflops'), roofline.H200_BF16_TFLOPS / 100), '.0f')} "
            + (f"| {_fmt(_ratio(mb.get('tflops'), dense / 100), '.0f')} " if dense else "")
            + f"| {_fmt(floor, '.2f')} | {_fmt(rc.get('ms'), '.3f')} |")
    return "\n".join(out)


def memory_table(doc):
    rows = doc["rows"]
    idx = _index(rows)
    out = ["| config | act | saved MiB grouped_mm / loop | saved MiB moeblaze preact / all / "
           "recompute | preact ÷ grouped_mm | peak MiB grouped_mm / loop | peak MiB moeblaze "
           "preact / all / recompute | preact ÷ grouped_mm |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for cfg, act in _keys(rows):
        g = idx.get((cfg, act, "grouped_mm", BASELINE_POLICY)) or {}
        lp = idx.get((cfg, act, "loop", BASELINE_POLICY)) or {}
        mbs = [idx.get((cfg, act, "moeblaze", p)) or {} for p in POLICIES]

        def both(field, a, b):
            return f"{_fmt(a.get(field), '.0f', MIB)} / {_fmt(b.get(field), '.0f', MIB)}"

        def three(field):
            return " / ".join(_fmt(m.get(field), ".1f" if field == "saved_bytes" else ".0f", MIB)
                              for m in mbs)

        out.append(
            f"| {cfg} | {act} | {both('saved_bytes', g, lp)} | {three('saved_bytes')} "
            f"| {_fmt(_ratio(mbs[0].get('saved_bytes'), g.get('saved_bytes')), '.2f')} "
            f"| {both('peak_bytes', g, lp)} | {three('peak_bytes')} "
            f"| {_fmt(_ratio(mbs[0].get('peak_bytes'), g.get('peak_bytes')), '.2f')} |")
    return "\n".join(out)


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


def target_lines(doc):
    rows = doc["rows"]
    lines = []
    for act in sorted({r["act"] for r in rows}):
        mb = [r for r in rows if r["act"] == act and r["impl"] == "moeblaze"
              and r["policy"] == "save_preact" and not r.get("error")]
        speedups = [r["speedup_vs_grouped_mm"] for r in mb if r.get("speedup_vs_grouped_mm")]
        geo = (math.exp(sum(math.log(s) for s in speedups) / len(speedups))
               if speedups else None)
        saved = [r["saved_ratio_vs_grouped_mm"] for r in mb if "saved_ratio_vs_grouped_mm" in r]
        peak = [r["peak_ratio_vs_grouped_mm"] for r in mb if "peak_ratio_vs_grouped_mm" in r]
        slowest = min(speedups) if speedups else None
        lines.append(
            f"- **{act}**: geometric-mean speed-up over the grouped_mm dataflow "
            f"**{_fmt(geo, '.2f')}×** (target ≥ {TARGET_SPEEDUP}×; slowest configuration "
            f"{_fmt(slowest, '.2f')}×, {len(speedups)} configurations); saved bytes ÷ grouped_mm "
            f"at most **{_fmt(max(saved) if saved else None, '.2f')}** "
            f"(target ≤ {TARGET_SAVED_RATIO} for SwiGLU); peak ÷ grouped_mm at most "
            f"**{_fmt(max(peak) if peak else None, '.2f')}** (target ≤ {TARGET_PEAK_RATIO}).")
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
    """The card's sustained dense rate and clocks, when the run recorded them (runs from session
    13 on): under a power cap, TFLOP/s figures mean little without them."""
    env = doc.get("environment", {})
    dense = env.get("dense_reference") or {}
    lines = []
    if dense.get("tflops"):
        lines.append(f"Sustained dense {dense['dtype']} matmul ({dense['shape']}, back to back for "
                     f"{dense['seconds']} s before the rows): **{dense['tflops']:.0f} TFLOP/s**; "
                     f"{gpu_clocks.describe(dense.get('clocks'))}.")
    if env.get("clocks_during_run"):
        lines.append(f"Clocks during the rows: {gpu_clocks.describe(env['clocks_during_run'])}.")
    return lines


def markdown(doc, plot_names=()):
    env = doc.get("environment", {})
    parts = [
        f"Device **{doc.get('device')}**, commit `{doc.get('commit')}`, "
        f"{doc.get('date_utc', '')}; torch {env.get('torch')}"
        f"{', CUDA ' + str(env['cuda']) if env.get('cuda') else ''}; dtype {env.get('dtype')}.",
        f"moeblaze: {env.get('moeblaze_build_info', env.get('moeblaze', '?'))}"
        + {True: "; backward consumes its saved buffer (consume_saved=True, the default).",
           False: "; backward keeps its saved buffer (--keep-saved).",
           None: "."}[env.get("moeblaze_consume_saved")],
        f"Command: `{doc.get('command')}`",
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
        "",
        "**Accuracy** (‖out − ref‖ / ‖ref‖ against the fp32 loop reference):",
        "",
        accuracy_table(doc),
    ]
    errors = error_lines(doc)
    if errors:
        parts += ["", "**Errors and skipped rows:**", ""] + errors
    for name in plot_names:
        parts += ["", f"![{name}](../bench/results/{name})"]
    return "\n".join(parts) + "\n"


def plots(doc, out_dir, stem):
    """PNG bar charts of time and memory per configuration; returns the file names written."""
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
    series = [("grouped_mm", BASELINE_POLICY, "grouped_mm dataflow"),
              ("loop", BASELINE_POLICY, "per-expert loop")] + \
             [("moeblaze", p, f"moeblaze {p}") for p in POLICIES]
    written = []

    def bars(field, scale, ylabel, title, fname, log):
        if not any(r.get(field) is not None for r in rows):
            return  # e.g. peak bytes of a CPU run
        fig, axes = plt.subplots(len(acts), 1, figsize=(12, 3.6 * len(acts)), squeeze=False)
        for ax, act in zip(axes[:, 0], acts):
            cfgs = [c for c, a in _keys(rows) if a == act]
            width = 0.8 / len(series)
            for i, (impl, policy, label) in enumerate(series):
                values = []
                for c in cfgs:
                    v = (idx.get((c, act, impl, policy)) or {}).get(field)
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
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(fname)

    bars("ms", 1.0, "ms (log)", "fwd+bwd time", f"{stem}-time.png", True)
    bars("saved_bytes", float(1 << 30), "GiB", "bytes saved for backward",
         f"{stem}-saved.png", False)
    bars("peak_bytes", float(1 << 30), "GiB", "peak memory above inputs",
         f"{stem}-peak.png", False)
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


def report(json_path, out_dir=None, doc_path=None):
    with open(json_path) as f:
        doc = json.load(f)
    out_dir = out_dir or os.path.dirname(os.path.abspath(json_path))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(json_path))[0]
    names = plots(doc, out_dir, stem)
    text = markdown(doc, names)
    md_path = os.path.join(out_dir, f"{stem}.md")
    with open(md_path, "w") as f:
        f.write(text)
    print(f"make_report: wrote {md_path}" + (f" and {', '.join(names)}" if names else ""),
          flush=True)
    if doc_path:
        replace_block(doc_path, RESULTS_BEGIN, RESULTS_END, text)
        print(f"make_report: updated {doc_path}", flush=True)
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", help="results JSON from run_bench.py")
    parser.add_argument("--doc", default=None, help="markdown file with the markers to fill")
    parser.add_argument("--plots-dir", default=None,
                        help="where the .md and .png go (default: beside the JSON)")
    parser.add_argument("--roofline", action="store_true",
                        help="refresh the roofline block of --doc from bench/configs.json")
    args = parser.parse_args()
    if not args.results and not args.roofline:
        parser.error("give a results JSON, --roofline, or both")
    if args.roofline:
        if not args.doc:
            parser.error("--roofline needs --doc")
        replace_block(args.doc, ROOFLINE_BEGIN, ROOFLINE_END,
                      roofline.markdown_table(roofline.load_configs()))
        print(f"make_report: roofline block of {args.doc} refreshed", flush=True)
    if args.results:
        report(args.results, args.plots_dir, args.doc)


if __name__ == "__main__":
    main()
