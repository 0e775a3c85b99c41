#!/usr/bin/env python3
"""The table tools/ncu_step_times.sh prints: every kernel of one profiled step with its time,
instructions and memory traffic, from Nsight Compute's CSV (`ncu --csv --metrics ...`, one row per
kernel and metric).

Per kernel, in launch order: its time (ms), warp-level instructions executed (10^9), bytes through
L2 (GB, `lts__t_bytes.sum`: every request the L2 serves, hits and misses) and DRAM bytes read and
written (GB), with its GEMM tag (tools/kernel_tags.py) where it is one of the library's. Then the
sums by tag (the library's two column chunks of F2 and B4 and its four per-token sums become one
line each) and by kernel class (GEMM or not), and the step's total. With the clocks locked, time
is cycles; instructions and bytes are the work that costs energy, which sets the clocks at the
power limit (docs/performance.md, "Energy: equal clocks against the power limit").

Usage:
  tools/ncu_step_table.py times.csv
  tools/ncu_step_table.py --self-test
"""
import csv
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_tags import kernel_class, kernel_tag  # noqa: E402

# The metrics tools/ncu_step_times.sh asks for, by the field they fill.
METRICS = {
    "gpu__time_duration.sum": "ms",
    "smsp__inst_executed.sum": "ginst",
    "lts__t_bytes.sum": "l2_gb",
    "dram__bytes_read.sum": "dram_read_gb",
    "dram__bytes_write.sum": "dram_write_gb",
}
FIELDS = ("ms", "ginst", "l2_gb", "dram_read_gb", "dram_write_gb")

# A value's unit -> its factor to the field's unit (ms, 10^9 instructions, GB). ncu scales its
# units to the value (nsecond / usecond / msecond, byte / Kbyte / ... / Gbyte) unless told
# --print-units base.
_TIME = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0,
         "s": 1e3, "second": 1e3}
_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def _scale(field, unit):
    if field == "ms":
        if unit not in _TIME:
            raise ValueError(f"unknown time unit {unit!r}")
        return _TIME[unit]
    base = "inst" if field == "ginst" else "byte"
    if not unit.endswith(base) or unit[: -len(base)] not in _PREFIX:
        raise ValueError(f"unknown unit {unit!r} for {field}")
    return _PREFIX[unit[: -len(base)]] / 1e9


def parse(text):
    """ncu's CSV -> [{'name', 'tag', 'ms', 'ginst', 'l2_gb', 'dram_read_gb', 'dram_write_gb'}]
    in launch order (a field ncu did not report is None). Lines before the header (the profiled
    program's own output, ==PROF== lines) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line starting with \"ID\")")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    col = {c: header.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Unit",
                                       "Metric Value")}
    kernels = {}
    for r in rows[1:]:
        if len(r) < len(header):
            continue
        k = kernels.setdefault(r[col["ID"]], {"name": r[col["Kernel Name"]],
                                               **{f: None for f in FIELDS}})
        field = METRICS.get(r[col["Metric Name"]])
        if field is None:
            continue
        value = float(r[col["Metric Value"]].replace(",", ""))
        k[field] = value * _scale(field, r[col["Metric Unit"]])
    out = [kernels[i] for i in sorted(kernels, key=int)]
    for k in out:
        k["tag"] = kernel_tag(k["name"])
    return out


def _cells(k):
    fmt = ("%9.3f", "%7.3f", "%8.2f", "%7.3f", "%7.3f")
    return " ".join(("%*s" % (len(f % 0), "-")) if k[x] is None else f % k[x]
                    for f, x in zip(fmt, FIELDS))


def _sum(kernels):
    return {f: sum(k[f] for k in kernels if k[f] is not None) for f in FIELDS}


def table(kernels):
    """The printed table: one line a kernel, then the sums by tag and by class, then the total."""
    head = "       ms  G inst    L2 GB  DRAM rd  DRAM wr"
    out = [head + "  tag kernel"]
    for k in kernels:
        out.append("%s  %-3s %s" % (_cells(k), k["tag"] or "-", k["name"][:90]))
    tags = list(dict.fromkeys(k["tag"] for k in kernels if k["tag"]))
    if tags:
        out.append("")
        out.append(head + "  by tag")
        for tag in tags:
            group = [k for k in kernels if k["tag"] == tag]
            out.append("%s  %-3s %d launch%s" % (_cells(_sum(group)), tag, len(group),
                                                 "" if len(group) == 1 else "es"))
    out.append("")
    out.append(head + "  by class")
    for cls in ("gemm", "other"):
        group = [k for k in kernels if (kernel_class(k["name"]) == "gemm") == (cls == "gemm")]
        out.append("%s  %s (%d kernels)" % (_cells(_sum(group)), cls, len(group)))
    out.append("%s  total of %d kernels (clocks locked at base)" % (_cells(_sum(kernels)),
                                                                    len(kernels)))
    return "\n".join(out)


def self_test():
    hdr = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
           '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
           '"Metric Value"')

    def row(i, name, metric, unit, value):
        return (f'"{i}","1","python3","h","{name}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
                f'"Command line profiler metrics","{metric}","{unit}","{value}"')

    f1 = "void moeblaze::cuda::sm90_f1_kernel<__nv_bfloat16, 4, 1, 1>(CUtensorMap_st, F1Params)"
    rd = "void moeblaze::cuda::token_reduce16_kernel<__nv_bfloat16>(long, long)"
    peer = "kernel_cutlass_kernel_sonicmoe_grouped_gemmHopperWgmma_MoE"
    lines = ["one step profiled (moeblaze)", "==PROF== Disconnected", hdr]
    # Base units (--print-units base), launch IDs out of order, a thousands separator.
    lines += [row(3, rd, "gpu__time_duration.sum", "nsecond", "405,408"),
              row(3, rd, "smsp__inst_executed.sum", "inst", "135626752"),
              row(3, rd, "lts__t_bytes.sum", "byte", "1916741000"),
              row(3, rd, "dram__bytes_read.sum", "byte", "1108383000"),
              row(3, rd, "dram__bytes_write.sum", "byte", "135150000"),
              row(1, f1, "gpu__time_duration.sum", "msecond", "6.570528"),
              row(1, f1, "smsp__inst_executed.sum", "inst", "1,359,618,463"),
              row(1, f1, "lts__t_bytes.sum", "Gbyte", "50.739854"),
              row(1, f1, "dram__bytes_read.sum", "Gbyte", "7.314676"),
              row(1, f1, "dram__bytes_write.sum", "Mbyte", "1603.223"),
              row(1, f1, "launch__grid_size", "", "132"),
              row(2, peer, "gpu__time_duration.sum", "usecond", "7305.376"),
              row(2, peer, "smsp__inst_executed.sum", "Minst", "1126.470908")]
    ks = parse("\n".join(lines))
    assert [k["tag"] for k in ks] == ["F1", None, "RD"], ks
    f1k, peerk, rdk = ks
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, abs(b))  # noqa: E731
    assert close(f1k["ms"], 6.570528) and close(f1k["ginst"], 1.359618463), f1k
    assert close(f1k["l2_gb"], 50.739854) and close(f1k["dram_write_gb"], 1.603223), f1k
    assert close(rdk["ms"], 0.405408) and close(rdk["l2_gb"], 1.916741), rdk
    assert close(peerk["ms"], 7.305376) and close(peerk["ginst"], 1.126470908), peerk
    assert peerk["l2_gb"] is None  # not reported: a dash, and left out of the sums
    text = table(ks)
    assert "F1  1 launch" in text and "RD  1 launch" in text, text
    total = [line for line in text.splitlines() if "total of 3 kernels" in line][0]
    assert total.split()[0] == "%.3f" % (6.570528 + 7.305376 + 0.405408), total
    gemm = [line for line in text.splitlines() if "gemm (2 kernels)" in line]
    assert gemm, text
    for bad, err in ((hdr.replace('"ID"', '"Id"'), "header"),
                     ("\n".join([hdr, row(1, f1, "gpu__time_duration.sum", "cycle", "5")]),
                      "unit")):
        try:
            parse(bad)
        except ValueError as e:
            assert err in str(e) or "unknown" in str(e), e
            continue
        raise AssertionError(f"accepted {bad!r}")
    print("ncu_step_table self-test: ok")


def main(argv):
    if argv[1:] == ["--self-test"]:
        self_test()
        return 0
    if len(argv) != 2:
        sys.stderr.write(__doc__)
        return 2
    with open(argv[1], encoding="utf-8", errors="replace") as f:
        kernels = parse(f.read())
    if not kernels:
        sys.stderr.write("no kernels in the CSV (see ncu.log)\n")
        return 1
    print(table(kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
