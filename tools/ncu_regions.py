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

Usage:
  tools/ncu_regions.py source.csv [--filter SUBSTRING] [--top N]
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


def instructions(header, rows):
    """[(address, SASS text, samples, {stall reason: samples})] in address order."""
    # The SASS text: the "Source" column (ncu 2025.x), else the one after the address.
    i_src = header.index("Source") if "Source" in header else 1
    i_s = header.index(SAMPLES)
    stall_cols = [(i, h) for i, h in enumerate(header)
                  if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows:
        try:
            addr = parse_address(r[0])
        except (ValueError, IndexError):
            continue
        text = " ".join(r[i_src].split()) if i_src < len(r) else ""
        samples = int(r[i_s]) if i_s < len(r) and r[i_s].isdigit() else 0
        reasons = {h: int(r[i]) for i, h in stall_cols if i < len(r) and r[i].isdigit()
                   and int(r[i]) > 0}
        out.append((addr, text, samples, reasons))
    out.sort(key=lambda x: x[0])
    return out


def wait_loops(ins):
    """(head, branch, TRYWAIT text) of each mbarrier retry loop: a short loop (at most 8
    instructions) whose backward branch directly follows its TRYWAIT (mbar_wait's shape)."""
    out = []
    for h, b in backward_loops(ins):
        body = [t for a, t in ins if h <= a <= b]
        if len(body) <= 8 and len(body) >= 2 and "TRYWAIT" in body[-2]:
            out.append((h, b, body[-2]))
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


def summarise(name, header, rows, top):
    ins = instructions(header, rows)
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

    lines = [f"{name[:100]}: {total} samples"]
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
        lines.append(f"  {lab:58s} {span:18s} {s:9d} {100.0 * s / total:5.1f} %  " +
                     ", ".join(f"{k} {v}" for k, v in top_rs))
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
    print("ncu_regions self-test: PASS")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source_csv", nargs="?")
    ap.add_argument("--filter", default="", help="only kernels whose name contains this")
    ap.add_argument("--top", type=int, default=3, help="stall reasons per region")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.source_csv:
        ap.error("a source-page CSV, or --self-test")
    for name, header, rows in read_source_page(a.source_csv):
        if a.filter and a.filter not in name:
            continue
        if SAMPLES not in header:
            print(f"{name[:100]}: no '{SAMPLES}' column (profile with --set full)")
            continue
        lines = summarise(name, header, rows, a.top)
        if lines:
            print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
