#!/usr/bin/env python3
"""Where a Hopper kernel's warps stall, by code region, from Nsight Compute's SASS source page.

It maps ncu's hottest stall PCs onto the kernel's roles (by the branch targets' distances, as in
cuobjdump's SASS) for every kernel of a profile: it
reads the source page that tools/ncu_kernels.sh exports (`ncu --import R --page source --csv
--print-source sass`, inside ncu_kernels.tgz as source.csv) and splits each kernel's warp-state
samples over

  k-step loop   the loop around the first HGMMA (tools/sass_loops.py's k-step loop), its mbarrier
                wait loops listed apart;
  MUFU loop     the smallest loop with >= 8 MUFU: in B1's forms with epilogue warps, their item
                loop (in the consumers' form, the tile loop that holds their epilogue);
  wait loops    every other mbarrier retry loop (a TRYWAIT and the branch back to it), by offset
                and barrier operand: the consumers' hand-off wait, the producer's empty waits;
  rest          everything else;

with each region's top stall reasons, so the question "which side waits, and on what" is one
command. Offsets are from the function's first instruction, as cuobjdump prints them.

--count executed splits the instructions each warp executed instead (the SourceCounters
section's "Instructions Executed"; `--set full` has it): how much of a kernel's issued work its
wait loops are, with each wait loop's entries (the executions of the instruction before its head)
and passes per entry. A warp that waits out a whole main loop polls through it every pass
(docs/design/cuda-kernels.md, the mbarrier wait). For that column alone:
  ncu -k regex:sm90 --profile-from-start off --section SourceCounters --export R \
      python3 tests/cuda/profile_kernels.py --profiler-range --act swiglu ...
  ncu --import R.ncu-rep --page source --csv --print-source sass > source.csv

Usage:
  tools/ncu_regions.py source.csv [--filter SUBSTRING] [--top N] [--count samples|executed]
  tools/ncu_regions.py --self-test
"""
import argparse
import csv
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_loops import backward_loops, epilogue_loops, kstep_loop  # noqa: E402

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
COUNTS = {"samples": SAMPLES, "executed": EXECUTED}


def read_source_page(path):
    """[(kernel name, header, rows)] from ncu's source-page CSV (one block per kernel)."""
    kernels, name, header, rows = [], None, None, []
    for r in csv.reader(open(path, newline="")):
        if r and r[0] == "Kernel Name":
            if name is not None and header is not None:
                kernels.append((name, header, rows))
            name, header, rows = (r[1] if len(r) > 1 else "?"), None, []
        elif r and r[0] == "Address":
            header = r
        elif header is not None and r:
            rows.append(r)
    if name is not None and header is not None:
        kernels.append((name, header, rows))
    return kernels


def parse_address(text):
    text = text.strip()
    return int(text, 16) if text.lower().startswith("0x") else int(text)


def instructions(header, rows, column=SAMPLES):
    """[(address, SASS text, count, {stall reason: samples})] in address order: count is the
    column's (warp-state samples, or instructions executed without stall reasons)."""
    # The SASS text: the "Source" column (ncu 2025.x), else the one after the address.
    i_src = header.index("Source") if "Source" in header else 1
    i_s = header.index(column)
    stall_cols = [(i, h) for i, h in enumerate(header)
                  if column == SAMPLES and h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows:
        try:
            addr = parse_address(r[0])
        except (ValueError, IndexError):
            continue
        text = " ".join(r[i_src].split()) if i_src < len(r) else ""
        value = r[i_s].replace(",", "") if i_s < len(r) else ""
        samples = int(value) if value.isdigit() else 0
        reasons = {h: int(r[i]) for i, h in stall_cols if i < len(r) and r[i].isdigit()
                   and int(r[i]) > 0}
        out.append((addr, text, samples, reasons))
    out.sort(key=lambda x: x[0])
    return out


def wait_loops(ins):
    """(head, branch, TRYWAIT text) of each mbarrier retry loop: a short loop (at most 10
    instructions) with a TRYWAIT and no HGMMA in it: mbar_wait's (the poll right before the branch
    back, or poll and counter) and a wait whose polls suspend the thread (poll, NANOSLEEP.SYNCS,
    counter), the form a try_wait time hint compiles to."""
    out = []
    for h, b in backward_loops(ins):
        body = [t for a, t in ins if h <= a <= b]
        polls = [t for t in body if "TRYWAIT" in t]
        if 2 <= len(body) <= 10 and polls and not any("HGMMA" in t for t in body):
            out.append((h, b, polls[0]))
    return out


def regions(ins):
    """[(label, head, branch)] of a kernel: the k-step loop, the MUFU loop, the wait loops."""
    plain = [(a, t) for a, t, _, _ in ins]
    base = plain[0][0] if plain else 0
    found = []
    k = kstep_loop(plain)
    if k:
        found.append(("k-step loop", k[0], k[1]))
    for e in epilogue_loops(plain):  # one per activation epilogue the kernel compiles
        if not (k and e[0] <= k[0] and k[1] <= e[1]):  # not the tile loop around the k-steps
            found.append((f"MUFU loop ({e[2]} MUFU)", e[0], e[1]))
        else:
            found.append((f"MUFU loop ({e[2]} MUFU; holds the k-step loop)", e[0], e[1]))
    for h, b, wait in wait_loops(plain):
        operand = re.search(r"\[[^\]]*\]", wait)
        inside = [lab for lab, lh, lb in found if lh <= h and b <= lb and "wait" not in lab]
        where = f" in the {inside[0].split(' (')[0]}" if inside else ""
        found.append((f"wait +0x{h - base:x} {operand.group(0) if operand else ''}{where}", h, b))
    return base, found


def summarise(name, header, rows, top, column=SAMPLES):
    ins = instructions(header, rows, column)
    total = sum(s for _, _, s, _ in ins)
    if not ins or total == 0:
        return None
    base, found = regions(ins)

    def stats(lo, hi, exclude=()):
        samples, reasons = 0, {}
        for a, _, s, rs in ins:
            if lo <= a <= hi and not any(el <= a <= eh for el, eh in exclude):
                samples += s
                for k, v in rs.items():
                    reasons[k] = reasons.get(k, 0) + v
        return samples, reasons

    count_of = {a: s for a, _, s, _ in ins}
    previous = {ins[i][0]: ins[i - 1][0] for i in range(1, len(ins))}
    lines = [f"{name[:100]}: {total} " + ("samples" if column == SAMPLES else
                                          "instructions executed")]
    waits = [(h, b) for lab, h, b in found if lab.startswith("wait")]
    covered = []
    for lab, h, b in found:
        if lab.startswith("wait"):
            s, rs = stats(h, b)
        else:  # a loop's own instructions; its waits are listed apart
            s, rs = stats(h, b, [w for w in waits if h <= w[0] and w[1] <= b])
        covered.append((h, b))
        top_rs = sorted(rs.items(), key=lambda kv: -kv[1])[:top]
        span = f"+0x{h - base:x}..+0x{b - base:x}"
        detail = ", ".join(f"{k} {v}" for k, v in top_rs)
        if column == EXECUTED and lab.startswith("wait"):  # a pass runs the head once
            entries = count_of.get(previous.get(h), 0)
            detail = f"entered {entries}, {count_of[h] / max(entries, 1):.1f} passes each"
        lines.append(f"  {lab:58s} {span:18s} {s:9d} {100.0 * s / total:5.1f} %  " + detail)
    rest, rs = 0, {}
    for a, _, s, r in ins:
        if not any(h <= a <= b for h, b in covered):
            rest += s
            for k, v in r.items():
                rs[k] = rs.get(k, 0) + v
    top_rs = sorted(rs.items(), key=lambda kv: -kv[1])[:top]
    lines.append(f"  {'rest':58s} {'':18s} {rest:9d} {100.0 * rest / total:5.1f} %  " +
                 ", ".join(f"{k} {v}" for k, v in top_rs))
    return lines


def self_test():
    """A synthetic kernel: producer wait loop, k-step loop with a wait, epilogue MUFU loop."""
    rows, addr = [], [0x7F0000001000]

    def emit(text, samples=0, **reasons):
        rows.append([hex(addr[0]), text, str(samples)] +
                    [str(reasons.get(k, 0)) for k in ("stall_long_sb", "stall_barrier")])
        addr[0] += 0x10
        return addr[0] - 0x10

    emit("S2R R0, SR_TID.X")
    w0 = emit("IADD3 R1, R1, 0x1, RZ")  # producer's wait loop head
    emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R16+URZ], R5", 5, stall_long_sb=5)
    emit("@!P0 BRA 0x%x" % w0, 40, stall_long_sb=40)
    k0 = emit("VIADD R11, R11, 0x1")  # k-step loop head, its wait first
    emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR16], R12")
    emit("@!P0 BRA 0x%x" % k0, 7, stall_long_sb=7)
    emit("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR16], R24", 30)
    emit("WARPGROUP.DEPBAR.LE gsb0, 0x1", 20, stall_barrier=20)
    emit("@!P0 BRA 0x%x" % k0)
    e0 = emit("LDG.E.128 R4, desc[UR4][R2.64]")
    for _ in range(8):
        emit("MUFU.EX2 R6, R6", 2)
    emit("LOP3.LUT R7, R4, 0xffff0000, RZ, 0xc0, !PT", 11, stall_long_sb=11)
    emit("@P1 BRA 0x%x" % e0)
    emit("EXIT", 1)
    header = ["Address", "Source", SAMPLES, "stall_long_sb", "stall_barrier"]
    lines = summarise("sm90_test_kernel", header, rows, 2)
    text = "\n".join(lines)
    want = {"k-step loop": 50, "MUFU loop (8 MUFU)": 27, "wait +0x10 [R16+URZ]": 45,
            "wait +0x40 [UR16] in the k-step loop": 7, "rest": 1}
    got = {}
    for line in lines[1:]:
        m = re.match(r"  (.*?)\s+(?:\+0x[0-9a-f]+\.\.\+0x[0-9a-f]+\s+)?(\d+)\s+[\d.]+ %", line)
        got[m.group(1)] = int(m.group(2))
    bad = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    if bad or sum(got.values()) != 130:
        print(text)
        print("ncu_regions self-test FAILED:", bad, "total", sum(got.values()))
        return 1
    # Instructions executed: a suspending wait (poll, suspend, counter, branch back) entered 10
    # times with 45 passes each, and the k-step loop's wait of the counting form.
    rows, addr[0] = [], 0x7F0000001000
    emit("S2R R0, SR_TID.X", 10)
    w0 = emit("IMAD.U32 R11, RZ, RZ, UR11", 450)
    emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R11+URZ], R8", 450)
    emit("@!P0 NANOSLEEP.SYNCS 0xfa0", 450)
    emit("@!P0 SYNCS.PHASECHK.TRANS64 P0, [R11+URZ], R8", 450)
    emit("@P0 BRA 0x%x" % (addr[0] + 0x40), 450)
    emit("VIADD R12, R12, 0x1", 440)
    emit("ISETP.NE.U32.AND P0, PT, R12, 0x4000000, PT", 440)
    emit("@P0 BRA 0x%x" % w0, 440)
    emit("BPT.TRAP 0x1")
    emit("IMAD.MOV.U32 R3, RZ, RZ, 0x1", 100)
    k0 = emit("VIADD R11, R11, 0x1", 100)
    emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR16], R12", 100)
    emit("@!P0 BRA 0x%x" % k0, 100)
    emit("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR16], R24", 100)
    emit("@!P0 BRA 0x%x" % k0, 100)
    emit("EXIT", 10)
    header = ["Address", "Source", EXECUTED, "stall_long_sb", "stall_barrier"]
    lines = summarise("sm90_test_kernel", header, rows, 2, EXECUTED)
    text = "\n".join(lines)
    checks = [r"wait \+0x10 \[R11\+URZ\]\s+\S+\s+3570 .* entered 10, 45\.0 passes each",
              r"wait \+0xb0 \[UR16\] in the k-step loop\s+\S+\s+300 .* entered 100, 1\.0 passes",
              r"^sm90_test_kernel: 4190 instructions executed"]
    missing = [c for c in checks if not re.search(c, text, re.M)]
    if missing:
        print(text)
        print("ncu_regions self-test FAILED (instructions executed):", missing)
        return 1
    print("ncu_regions self-test: PASS")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source_csv", nargs="?")
    ap.add_argument("--filter", default="", help="only kernels whose name contains this")
    ap.add_argument("--top", type=int, default=3, help="stall reasons per region")
    ap.add_argument("--count", choices=sorted(COUNTS), default="samples",
                    help="split warp-state samples (default) or instructions executed")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.source_csv:
        ap.error("a source-page CSV, or --self-test")
    for name, header, rows in read_source_page(a.source_csv):
        if a.filter and a.filter not in name:
            continue
        column = COUNTS[a.count]
        if column not in header:
            print(f"{name[:100]}: no '{column}' column (profile with --set full)")
            continue
        lines = summarise(name, header, rows, a.top, column)
        if lines:
            print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
