#!/usr/bin/env python3
"""Instruction counts of the Hopper kernels' hot loops, from SASS.

The gathered main loops and the activation epilogues answer to instruction count, so a change to
them is predicted from the SASS before it is timed (docs/performance.md, "Where the time goes"). For every kernel with HGMMA instructions this prints

  loop    the instructions of the loop around the first HGMMA (its backward branch);
  steady  the k-step a warp runs when the tile does not end: the loop minus the block that the
          gather's cursor runs once a tile (from the first forward branch after the gather's
          ARRIVES.LDGSTSBAR to its target); loops without a gather: the whole loop; in both, less
          the mbarrier waits' slow paths (after a TRYWAIT, what its branch on success skips);
  MEMBAR  memory barriers in `steady`: a fence.proxy.async compiles to MEMBAR.ALL.CTA and
          FENCE.VIEW.ASYNC.S, and the k-step's wgmma issue waits for both (scoreboard order);
          the gathered loops' one fence a k-step measured no cost (docs/performance.md's
          decision table), so 1 there is expected;
  spills  LDL/STL instructions inside `loop` (spills in the main loop) and in the whole kernel;
  epi     every innermost loop holding >= 8 MUFU instructions (an activation epilogue; a kernel
          can compile several, e.g. B1's epilogue warps with and without a saved u), in address
          order: its instructions, its MUFU count, and the cycles one warp takes to issue it in
          order with each instruction waiting for its operands (issue_cycles: a latency model,
          for comparing two builds of one kernel). Where ptxas reuses registers so that the MUFU
          chains run one or two at a time, this grows with no change to the instruction count:
          F1's one-CTA SiLU epilogue warps took 668 and 769 model cycles (its two loops) with 2
          chains in flight against 391-426 with 8, and the kernel 1.4x as long on the H200.

Usage:
  tools/sass_loops.py FILE.sass [--filter REGEX]     cuobjdump -sass output
  tools/sass_loops.py LIB_OR_CUBIN [--filter R] [--arch sm_90a] [--cuobjdump PATH]
  tools/sass_loops.py --compile src/cuda/engines/sm90/wgrad_gemm.cu [--filter R] [--include DIR ...]
  tools/sass_loops.py LIB --filter 'sm90_f1_kernel.*Li[03]ELi[12]ELi1E' --max-epilogue-ratio 2.5
      exit 1 when an epilogue loop takes over 2.5 times its throughput bound (its MUFU at one per
      MUFU_INTERVAL or its instructions at one a cycle; F1's SwiGLU and SiLU epilogue warps:
      1.5-1.8x when their chains run side by side, 2.1-2.3x with bf16's one-MUFU sigmoid,
      2.6-3.0x two at a time)
  tools/sass_loops.py LIB --filter 'token_reduce16_kernel' --min-loads-in-flight 8
      exit 1 when a listed kernel never has that many 16-byte global loads issued before the
      first of them is read (the per-token sums: a thread's rows one DRAM round trip, not k)
  tools/sass_loops.py --self-test

cuobjdump is looked for in --cuobjdump, $CUOBJDUMP, on the PATH, and in Triton's and NVIDIA's
Python packages (of this interpreter and of the project's .venv, where torch brings Triton). A
CUDA toolkit without it can take the PyPI wheel:
  python3 -m venv VENV && VENV/bin/pip install nvidia-cuda-cuobjdump
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
BRANCH = re.compile(r"BRA(?:\.U)?(?:\.ANY)? (0x[0-9a-f]+)")
COND_FORWARD = re.compile(r"^@!?U?P\d BRA (0x[0-9a-f]+)")


def functions(sass):
    """(name, [(address, instruction text)]) for each function, NOPs left out."""
    for chunk in re.split(r"\n\s+Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        ins = [(int(m.group(1), 16), m.group(2).strip()) for m in INSTR.finditer(chunk)]
        yield name, [(a, t) for a, t in ins if not t.startswith("NOP")]


def short_name(name):
    # _ZN...<len><identifier>I<template args>EEv...: the identifier ending in "kernel" whose decimal
    # length prefix matches, then the template arguments.
    end = name.find("kernelI")
    if end < 0:
        return name[:70]
    end += len("kernel")
    args = re.match(r"I(.*?)EEv", name[end:])
    for start in range(end - 1, 0, -1):
        for width in (1, 2, 3):
            digits = name[start - width : start]
            if start - width >= 0 and digits.isdigit() and int(digits) == end - start:
                return f"{name[start:end]}<{args.group(1) if args else ''}>"
    return name[:70]


def backward_loops(ins):
    """(head, branch address) of every backward branch."""
    loops = []
    for a, t in ins:
        m = BRANCH.search(t)
        if m and int(m.group(1), 16) < a:
            loops.append((int(m.group(1), 16), a))
    return loops


PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def opcode_and_operands(instruction):
    """(opcode, operand text) of an instruction, its guard predicate (@P0, @!UP1) left out."""
    op, _, rest = PREDICATE.sub("", instruction).partition(" ")
    return op, rest


def is_spill(t):
    op = opcode_and_operands(t)[0]
    return op.startswith("LDL") or op.startswith("STL")


def kstep_loop(ins):
    """(head, branch address) of the k-step loop, or None: the loop around the first HGMMA."""
    hgmma = [a for a, t in ins if "HGMMA" in t]
    if not hgmma:
        return None
    first = hgmma[0]
    # The loop around the first HGMMA: the backward branch after it whose target is at or before it,
    # the outermost such (k-step loops hold their HGMMAs; the tile loop of a form that unrolls the
    # k-steps does too).
    around = [(h, b) for h, b in backward_loops(ins) if h <= first < b]
    if not around:
        return None
    # The k-step loop: the innermost loop around the first HGMMA that also holds the gather's
    # arrive when the kernel gathers (the consumer issues its gather inside the k-step loop), else
    # the innermost loop around it.
    gathers = [(h, b) for h, b in around
               if any("ARRIVES.LDGSTSBAR" in t for a, t in ins if h <= a <= b)]
    return min(gathers or around, key=lambda hb: hb[1] - hb[0])


def epilogue_loops(ins):
    """(head, branch address, MUFU count) of every innermost loop holding >= 8 MUFU (none other
    inside it), in address order: one per activation epilogue a kernel compiles (B1's warps have
    two, with and without a saved u)."""
    loops = []
    for h, b in backward_loops(ins):
        mufu = sum("MUFU" in t for a, t in ins if h <= a <= b)
        if mufu >= 8:
            loops.append((h, b, mufu))
    inner = [(h, b, m) for h, b, m in loops
             if not any((h2, b2) != (h, b) and h <= h2 and b2 <= b for h2, b2, m2 in loops)]
    return sorted(inner)


def registers_read(instruction):
    """The registers `instruction` reads: those of its source operands, or of any operand of a
    store (R20 in R20.64, not in UR20)."""
    op, rest = opcode_and_operands(instruction)
    operands = rest.split(",")
    sources = operands if op.startswith(("ST", "RED", "ATOM")) else operands[1:]
    return set(re.findall(r"\bR\d+\b", ",".join(sources)))


def reads_register(instruction, reg):
    return reg in registers_read(instruction)


# An in-order issue model of one warp (issue_cycles): the cycles after which an instruction's
# result can be read, and the cycles between two MUFU of one warp (16 lanes a cycle per SM, 4 a
# sub-core).
LATENCY = {"MUFU": 18, "LDS": 30, "LDG": 400, "LDC": 30, "S2R": 20}
DEFAULT_LATENCY = 5
MUFU_INTERVAL = 8


def written_register(instruction):
    """The register an instruction writes: its first operand when that is a register (stores,
    branches and predicate-setting instructions start with an address, a label or a predicate)."""
    m = re.match(r"(R\d+)\b", opcode_and_operands(instruction)[1].strip())
    return m.group(1) if m else None


def issue_cycles(body):
    """Cycles one warp takes to issue `body` in order when each instruction waits for its source
    registers (LATENCY after their writer issued) and MUFU share one unit (MUFU_INTERVAL)."""
    ready, cycle, last_mufu = {}, 0, -MUFU_INTERVAL
    for t in body:
        op = opcode_and_operands(t)[0]
        start = max([cycle + 1] + [ready[r] for r in registers_read(t) if r in ready])
        if op.startswith("MUFU"):
            start = max(start, last_mufu + MUFU_INTERVAL)
            last_mufu = start
        cycle = start
        dest = written_register(t)
        if dest:
            kind = next((k for k in LATENCY if op.startswith(k)), None)
            ready[dest] = cycle + LATENCY.get(kind, DEFAULT_LATENCY)
    return cycle


def loads_in_flight(ins):
    """The most 16-byte global loads (LDG*.128) a thread has issued before the first of them is
    read: for each such load, itself and the ones issued after it until an instruction reads any of
    its four destination registers, in address order (straight-line code: a loop's loads that are
    read at once, behind a branch each, count 1)."""
    loads = [(i, written_register(t)) for i, (a, t) in enumerate(ins)
             if opcode_and_operands(t)[0].startswith("LDG") and ".128" in t]
    best = 0
    for i, dest in loads:
        if dest is None:
            continue
        base = int(dest[1:])
        regs = {f"R{base + q}" for q in range(4)}
        count = 1
        for a, t in ins[i + 1:]:
            if registers_read(t) & regs:
                break
            if opcode_and_operands(t)[0].startswith("LDG") and ".128" in t:
                count += 1
        best = max(best, count)
    return best


def check_loads_in_flight(sass, pattern, minimum):
    """1 if a kernel matching `pattern` has fewer than `minimum` 16-byte loads in flight."""
    rows = [(short_name(n), loads_in_flight(i)) for n, i in functions(sass)
            if re.search(pattern, n)]
    few = [(k, n) for k, n in rows if n < minimum]
    for k, n in rows:
        print(f"sass_loops: {k}: {n} 16-byte loads in flight")
    for k, n in few:
        print(f"sass_loops: {k}: fewer than {minimum} loads in flight")
    return 1 if few or not rows else 0


def without_wait_slow_paths(body):
    """`body` less the slow paths of the mbarrier waits: a TRYWAIT followed by a forward branch
    on success (primitives.cuh's mbar_wait polls once, then counts its polls) runs the poll and
    the branch when the phase is already over, not the counting loop the branch jumps over."""
    out, skip_to = [], -1
    for i, (a, t) in enumerate(body):
        if a < skip_to:
            continue
        out.append((a, t))
        if "TRYWAIT" in t and i + 1 < len(body):
            nxt_a, nxt_t = body[i + 1]
            m = COND_FORWARD.match(nxt_t)
            if m and nxt_t.startswith("@P") and int(m.group(1), 16) > nxt_a:
                out.append((nxt_a, nxt_t))
                skip_to = int(m.group(1), 16)
    return out


def analyse(name, ins):
    loop = kstep_loop(ins)
    if loop is None:
        return None
    head, back = loop
    body = [(a, t) for a, t in ins if head <= a <= back]
    steady = body
    arrive = [i for i, (a, t) in enumerate(body) if "ARRIVES.LDGSTSBAR" in t]
    if arrive:
        for i in range(arrive[0] + 1, len(body)):
            m = COND_FORWARD.match(body[i][1])
            if m and int(m.group(1), 16) > body[i][0]:
                target = int(m.group(1), 16)
                steady = body[: i + 1] + [(a, t) for a, t in body if a >= target]
                break
    steady = without_wait_slow_paths(steady)
    epi = []
    for h, b, mufu in epilogue_loops(ins):
        epi_body = [t for a, t in ins if h <= a <= b]
        epi.append((len(epi_body), mufu, issue_cycles(epi_body)))
    return {
        "kernel": short_name(name),
        "loop": len(body),
        "steady": len(steady),
        "hgmma": sum("HGMMA" in t for a, t in body),
        "membar": sum(opcode_and_operands(t)[0].startswith("MEMBAR") for a, t in steady),
        "epi": epi,  # one (instructions, MUFU, cycles) per epilogue loop
        "loop_spills": sum(is_spill(t) for a, t in body),
        "spills": sum(is_spill(t) for a, t in ins),
    }


def report(sass, pattern=""):
    rows = []
    for name, ins in functions(sass):
        if pattern and not re.search(pattern, name):
            continue
        r = analyse(name, ins)
        if r:
            rows.append(r)
    print(f"{'kernel':52s} {'loop':>5s} {'steady':>6s} {'HGMMA':>5s} {'MEMBAR':>6s} "
          f"{'spills loop/all':>15s}  epi loops: instructions (MUFU, cycles)")
    for r in rows:
        epi = " | ".join(f"{n} ({m}, {c})" for n, m, c in r["epi"]) or "-"
        print(f"{r['kernel']:52s} {r['loop']:5d} {r['steady']:6d} {r['hgmma']:5d} {r['membar']:6d} "
              f"{r['loop_spills']:7d}/{r['spills']:<7d}  {epi}")
    return rows


def bundled_cuobjdumps():
    """cuobjdump binaries that Python packages ship (Triton's, NVIDIA's wheel), in this
    interpreter's environment and in the project's .venv."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for prefix in (sys.prefix, os.path.join(root, ".venv")):
        for site in glob.glob(os.path.join(prefix, "lib", "python3*", "site-packages")):
            found += glob.glob(os.path.join(site, "triton", "backends", "nvidia", "bin",
                                            "cuobjdump"))
            found += glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "cuobjdump"))
    return found


def find_cuobjdump(explicit, required=True):
    candidates = [explicit, os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    for c in candidates + bundled_cuobjdumps():
        if c and os.path.exists(c):
            return c
    if required:
        sys.exit("sass_loops: no cuobjdump (pass --cuobjdump, set CUOBJDUMP, or see --help)")
    return None


def self_test():
    """A synthetic k-step loop: 2 waits, a proxy fence, HGMMA, a gather with a once-a-tile block
    (holding a MEMBAR that the steady k-step does not count), a spill."""
    lines = []
    addr = [0x100]

    def emit(t):
        lines.append(f"        /*{addr[0]:04x}*/                   {t} ;")
        addr[0] += 0x10

    emit("S2R R0, SR_TID.X")
    head = addr[0]
    emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2")
    # A wait with a fast path: one poll and a forward branch past its counting retry loop.
    retry = addr[0]
    emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R2")
    emit("@P0 BRA 0x%x" % (retry + 0x40))
    emit("IADD3 R3, R3, 0x1, RZ")
    emit("@!P0 BRA 0x%x" % retry)
    emit("MEMBAR.ALL.CTA")  # a fence.proxy.async before the wgmma
    emit("FENCE.VIEW.ASYNC.S")
    emit("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24")
    emit("LDGSTS.E.BYPASS.128 [R7], desc[UR16][R162.64], P1")
    emit("ARRIVES.LDGSTSBAR.64.ARVCNT [UR6]")
    skip_at = addr[0]
    emit("@P0 BRA 0x%x" % (skip_at + 0x50))  # skips 4 instructions
    emit("MEMBAR.SC.GPU")  # once a tile: not in the steady k-step
    emit("IMAD R1, R1, R2, RZ")
    emit("STL [R1], R2")
    emit("IADD3 R1, R1, 0x1, RZ")
    emit("WARPGROUP.DEPBAR.LE gsb0, 0x1")
    emit("@!P0 BRA 0x%x" % head)
    emit("EXIT")
    sass = "\n\tFunction : _ZN8moeblaze4cuda16sm90_test_kernelI13__nv_bfloat16EEvv\n" + "\n".join(lines)
    (r,) = [analyse(n, i) for n, i in functions(sass)]
    expect = {"loop": 17, "steady": 11, "hgmma": 1, "membar": 1, "loop_spills": 1, "spills": 1,
              "epi": []}
    bad = {k: (r[k], v) for k, v in expect.items() if r[k] != v}
    if bad:
        print("sass_loops self-test FAILED:", bad)
        return 1
    # A mutation must be seen: without the arrive there is no once-a-tile block to skip.
    sass2 = sass.replace("ARRIVES.LDGSTSBAR.64.ARVCNT [UR6]", "NOP")
    (r2,) = [analyse(n, i) for n, i in functions(sass2)]
    if r2["steady"] != r2["loop"] - 2:
        print("sass_loops self-test FAILED: a loop without a gather must count whole (less the"
              " wait's slow path)")
        return 1
    # An epilogue loop of 8 MUFU chains (EX2, then an FADD of its result): side by side, or each
    # read at once. The model must charge the serial form about a MUFU latency a chain more.
    def epilogue(side_by_side, base=0x1000):
        text = []
        for i in range(8):
            text.append(f"MUFU.EX2 R{20 + i}, R{10 + i}")
            if not side_by_side:
                text.append(f"FADD R{30 + i}, R{20 + i}, 1")
        if side_by_side:
            text += [f"FADD R{30 + i}, R{20 + i}, 1" for i in range(8)]
        text.append("STG.E.128 desc[UR4][R2.64], R30")
        body = [(base + 0x10 * i, t) for i, t in enumerate(text)]
        body.append((base + 0x10 * len(text), "@P0 BRA 0x%x" % base))
        return body
    cycles = {}
    for side_by_side in (True, False):
        (loop,) = epilogue_loops(epilogue(side_by_side))
        cycles[side_by_side] = issue_cycles([t for a, t in epilogue(side_by_side)
                                             if loop[0] <= a <= loop[1]])
    # Two epilogue loops in one outer loop (B1's warps: with and without a saved u): both count,
    # the outer one (which holds them) does not.
    two = epilogue(True, 0x1000) + epilogue(False, 0x2000) + [(0x3000, "@P1 BRA 0x1000")]
    if [(h, m) for h, b, m in epilogue_loops(two)] != [(0x1000, 8), (0x2000, 8)]:
        print("sass_loops self-test FAILED: the innermost epilogue loops")
        return 1
    # Side by side: the MUFU 8 cycles apart (the last at 57), the last FADD its latency after it,
    # then the store and the branch. Serial: each FADD waits a MUFU latency, the next MUFU follows.
    if cycles != {True: 57 + 18 + 2, False: 1 + 7 * 19 + 18 + 2}:
        print(f"sass_loops self-test FAILED: issue cycles {cycles}")
        return 1
    # --max-epilogue-ratio 2 passes the side-by-side loop (77 / 64) and fails the serial one.
    for side_by_side, want in ((True, 0), (False, 1)):
        row = {"kernel": "k", "epi": [(18, 8, 60), (18, 8, cycles[side_by_side])]}
        if check_epilogue_ratio([row], 2.0) != want:
            print("sass_loops self-test FAILED: --max-epilogue-ratio")
            return 1
    if (not reads_register("STG.E.128 desc[UR4][R20.64], R8", "R20")
            or reads_register("FADD R20, R21, 1", "R20")
            or reads_register("IADD3 R1, UR20, 1, RZ", "R20")):
        print("sass_loops self-test FAILED: register reads")
        return 1
    # A filter that matches none of the input's kernels fails a check; an input without kernels
    # (a library built without sm_90a) is skipped where allowed.
    with_kernels = "\t\tFunction : _Z6kernelv\n"
    if (no_match_status(with_kernels, True, True) != 1
            or no_match_status(with_kernels, True, False) is not None
            or no_match_status("", True, True) != 77 or no_match_status("", False, True) != 1):
        print("sass_loops self-test FAILED: a filter that matches nothing")
        return 1
    # Loads in flight: eight row loads before the first read, against each read at once.
    batched = [(0x10 * i, f"@P{i % 7} LDG.E.128.CONSTANT R{4 * i + 8}, desc[UR10][R{60 + i}.64]")
               for i in range(8)] + [(0x100 + 0x10 * i, f"FADD R3, R3, R{4 * i + 9}")
                                     for i in range(8)]
    serial = []
    for i in range(8):
        serial += [(0x200 * i, f"LDG.E.128 R8, desc[UR6][R{60 + i}.64]"),
                   (0x200 * i + 0x10, "FADD R3, R3, R10"), (0x200 * i + 0x20, "@!P0 BRA 0x40")]
    if loads_in_flight(batched) != 8 or loads_in_flight(serial) != 1:
        print("sass_loops self-test FAILED: loads in flight",
              loads_in_flight(batched), loads_in_flight(serial))
        return 1
    print("sass_loops self-test: PASS")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", nargs="?", help="cuobjdump -sass text, a cubin or a shared library")
    ap.add_argument("--filter", default="",
                    help="only kernels whose mangled name matches this (a Python regex)")
    ap.add_argument("--max-epilogue-ratio", type=float, default=0.0, metavar="R",
                    help="exit 1 if a listed kernel's epilogue loop takes more than R times its "
                         "throughput bound: its MUFU at one per MUFU_INTERVAL or its instructions "
                         "at one a cycle, whichever is longer (a schedule that runs the chains "
                         "one or two at a time)")
    ap.add_argument("--min-loads-in-flight", type=int, default=0, metavar="N",
                    help="exit 1 unless every kernel --filter matches (any kernel, not only the "
                         "GEMMs) has N 16-byte global loads issued before the first is read")
    ap.add_argument("--skip-without-cuobjdump", action="store_true",
                    help="exit 77 (a skipped test) without cuobjdump or without any kernel of "
                         "--arch in the input (a kernel that --filter misses fails the check)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--cuobjdump", default=None)
    ap.add_argument("--compile", metavar="CU", help="compile this .cu for sm_90a first (nvcc)")
    ap.add_argument("--include", action="append", default=[], help="extra include directories")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if a.compile:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        tmp = tempfile.mkdtemp(prefix="sass_loops_")
        cubin = os.path.join(tmp, "k.cubin")
        incs = [os.path.join(root, "include"), os.path.join(root, "src")] + a.include
        cmd = ["nvcc", "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-cubin",
               "-gencode=arch=compute_90a,code=sm_90a", "-o", cubin, a.compile]
        cmd[1:1] = [f"-I{d}" for d in incs]
        subprocess.run(cmd, check=True)
        a.input = cubin
    if not a.input:
        ap.error("an input file, --compile or --self-test")
    with open(a.input, "rb") as f:
        head = f.read(4)
    if head == b"\x7fELF":
        tool = find_cuobjdump(a.cuobjdump, required=not a.skip_without_cuobjdump)
        if tool is None:
            print("sass_loops: SKIPPED: no cuobjdump (set CUOBJDUMP, or see --help)")
            return 77
        args = [tool, "-sass", a.input] if a.input.endswith(".cubin") else [tool, "--dump-sass", "-arch", a.arch, a.input]
        sass = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    else:
        sass = open(a.input, encoding="utf-8", errors="replace").read()
    if a.min_loads_in_flight:
        if a.skip_without_cuobjdump and not re.search(r"Function\s*:", sass):
            print(f"sass_loops: SKIPPED: no {a.arch} kernel in {a.input}")
            return 77
        return check_loads_in_flight(sass, a.filter, a.min_loads_in_flight)
    rows = report(sass, a.filter)
    if not rows:
        status = no_match_status(sass, a.skip_without_cuobjdump, bool(a.max_epilogue_ratio))
        if status == 77:
            print(f"sass_loops: SKIPPED: no {a.arch} kernel in {a.input}")
        elif status == 1:
            print(f"sass_loops: no kernel matches {a.filter!r}: nothing checked (renamed?)")
        if status is not None:
            return status
    if a.max_epilogue_ratio:
        return check_epilogue_ratio(rows, a.max_epilogue_ratio)
    return 0


def no_match_status(sass, skip_allowed, checking):
    """The exit status when --filter matches no kernel of `sass`: 77 (skipped) where the input has
    no kernel at all and skipping is allowed, 1 where a check was asked for (a renamed kernel or
    template must not pass it unchecked), else None (an empty listing)."""
    if skip_allowed and not re.search(r"Function\s*:", sass):
        return 77
    return 1 if checking else None


def check_epilogue_ratio(rows, limit):
    """1 if an epilogue loop's issue cycles exceed `limit` times its throughput bound: its MUFU at
    one per MUFU_INTERVAL, or its instructions at one a cycle, whichever is longer."""
    slow = []
    for r in rows:
        for instructions, mufu, cycles in r["epi"]:
            bound = max(mufu * MUFU_INTERVAL, instructions)
            ratio = cycles / bound
            if ratio > limit:
                slow.append(f"{r['kernel']}: {cycles} cycles for {mufu} MUFU and {instructions} "
                            f"instructions ({ratio:.2f}x)")
    for line in slow:
        print("sass_loops: epilogue loop slower than the limit:", line)
    if not slow:
        print(f"sass_loops: every epilogue loop within {limit}x its throughput bound")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
