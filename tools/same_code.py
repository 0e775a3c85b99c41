#!/usr/bin/env python3
"""Whether two builds of libmoeblaze hold the same code, the revision in their build info aside.

A benchmark run records the revision its library reports (moeblaze_get_build_info()); where that
names another commit than the run (a library built in a folder configured at an older commit),
bench/make_report.py refuses to publish the run. A build of the run's commit settles whether the
run measured that commit's code: this tool compares

  * every kernel's SASS (cuobjdump -sass), the per-file hash in anonymous-namespace names aside;
  * the host code (objdump -d), addresses and displacements aside (a fatbin of another size
    moves the sections after it);
  * the read-only data byte for byte, but for the revision string (of equal length in both);
  * the section table, names and sizes, but for the fatbin's size (it is compressed: the kernels'
    names change its bytes).

With --stamp RUN.json (RAN.so the library the run loaded, FRESH.so a build of the run's commit)
it records the check in the run as `build_check`, which make_report.py accepts in place of a
library revision that matches the run's commit.

Usage:
  tools/same_code.py RAN.so FRESH.so [--stamp RUN.json] [--cuobjdump PATH]
  tools/same_code.py --self-test LIB.so     (changes a copy's revision, then one byte of its data)

Exit status: 0 the same code, 1 not (what differs is printed), 77 (--self-test) no objdump.
"""
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_loops import find_cuobjdump, functions  # noqa: E402

REVISION = re.compile(rb" \(git ([0-9A-Za-z._-]+)\), ABI ")
ANONYMOUS = re.compile(r"_GLOBAL__N__[0-9a-f]+_[0-9]+_[A-Za-z0-9_]+?_cu_[0-9a-f]{8}")
HOST_ADDRESS = re.compile(r"\b(?:0x)?[0-9a-f]{4,}\b")
FATBIN = ".nv_fatbin"


def sections(path):
    """{name: (type, file offset, size)} of an ELF64 little-endian file."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise SystemExit(f"same_code: {path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]
    out = {}
    for name_at, kind, _, _, offset, size, *_ in headers:
        end = data.index(b"\0", names_offset + name_at)
        out[data[names_offset + name_at:end].decode()] = (kind, offset, size)
    return data, out


def revision_in(data, secs):
    """The build-info revision in an ELF file's .rodata (sections()'s data and table), or None."""
    _, offset, size = secs.get(".rodata", (0, 0, 0))
    m = REVISION.search(data, offset, offset + size)
    return m.group(1).decode() if m else None


def revision(path):
    return revision_in(*sections(path))


def section_bytes(data, secs, name):
    kind, offset, size = secs[name]
    return b"" if kind == 8 else data[offset:offset + size]  # SHT_NOBITS holds no bytes


def host_code(path):
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True,
                         text=True, check=True).stdout
    lines = out.split("\n")[3:]  # past the header that names the file
    return [HOST_ADDRESS.sub("A", ANONYMOUS.sub("ANON", line.split(":", 1)[-1])) for line in lines]


def kernels(path, cuobjdump):
    """{kernel name: its instructions} (sass_loops.functions: addresses and NOPs aside), with
    anonymous-namespace hashes normalised."""
    out = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
    return {ANONYMOUS.sub("ANON", name): [ANONYMOUS.sub("ANON", text) for _, text in body]
            for name, body in functions(out)}


def compare(ran, fresh, cuobjdump):
    """(differences, what was compared, the two revisions): the same code when the first is
    empty."""
    diffs, compared = [], []
    data_a, secs_a = sections(ran)
    data_b, secs_b = sections(fresh)
    rev_a, rev_b = revision_in(data_a, secs_a), revision_in(data_b, secs_b)
    if rev_a is None or rev_b is None:
        diffs.append("no build-info revision string in " + (ran if rev_a is None else fresh))
        return diffs, compared, (rev_a, rev_b)
    if len(rev_a) != len(rev_b):
        diffs.append(f"revisions of different lengths ({rev_a}, {rev_b}): their data cannot be "
                     "compared byte for byte; build FRESH with MOEBLAZE_COMMIT of RAN's length")
        return diffs, compared, (rev_a, rev_b)
    table_a = {n: (k, s) for n, (k, _, s) in secs_a.items() if n != FATBIN}
    table_b = {n: (k, s) for n, (k, _, s) in secs_b.items() if n != FATBIN}
    if table_a != table_b:
        moved = sorted(set(table_a.items()) ^ set(table_b.items()))
        diffs.append(f"section tables differ: {moved[:6]}")
    compared.append(f"section table ({len(table_a)} sections, the fatbin's size aside)")
    if ".rodata" in secs_a and ".rodata" in secs_b:
        ro_a = section_bytes(data_a, secs_a, ".rodata").replace(rev_a.encode(), b"?" * len(rev_a))
        ro_b = section_bytes(data_b, secs_b, ".rodata").replace(rev_b.encode(), b"?" * len(rev_b))
        if ro_a != ro_b:
            count = sum(x != y for x, y in zip(ro_a, ro_b)) + abs(len(ro_a) - len(ro_b))
            diffs.append(f".rodata: {count} bytes differ besides the revision")
        compared.append(f".rodata ({len(ro_a)} bytes, the revision aside)")
    if shutil.which("objdump"):
        host_a, host_b = host_code(ran), host_code(fresh)
        if host_a != host_b:
            at = next((i for i, (x, y) in enumerate(zip(host_a, host_b)) if x != y),
                      min(len(host_a), len(host_b)))
            diffs.append(f"host code differs (first at disassembly line {at}: "
                         f"{host_a[at:at + 1]} / {host_b[at:at + 1]})")
        compared.append(f"host code ({len(host_a)} lines of objdump -d, addresses aside)")
    else:
        diffs.append("no objdump on the PATH: the host code was not compared")
    if FATBIN in secs_a or FATBIN in secs_b:
        if cuobjdump is None:
            diffs.append("no cuobjdump (--cuobjdump, $CUOBJDUMP, PATH, Triton's or NVIDIA's "
                         "Python packages): the kernels were not compared")
        else:
            ka, kb = kernels(ran, cuobjdump), kernels(fresh, cuobjdump)
            changed = sorted(k for k in ka.keys() & kb.keys() if ka[k] != kb[k])
            only = sorted(ka.keys() ^ kb.keys())
            if changed or only or not ka:
                diffs.append(f"kernels: {len(changed)} with other SASS, {len(only)} in one build "
                             f"only, {len(ka)} / {len(kb)} in all: {(changed + only)[:3]}")
            compared.append(f"the SASS of {len(ka)} kernels")
    return diffs, compared, (rev_a, rev_b)


def stamp(run_json, revisions, compared):
    """Records in run_json that the library it ran (revisions[0]) is a build of the run's commit
    (revisions[1], the fresh build's), as compare() found."""
    with open(run_json) as f:
        doc = json.load(f)
    rev_ran, rev_fresh = revisions
    info = doc.get("environment", {}).get("moeblaze_build_info", "")
    if f"(git {rev_ran})" not in info:
        raise SystemExit(f"same_code: {run_json} ran a library that reports {info!r}, "
                         f"not RAN's revision {rev_ran}")
    commit = str(doc.get("commit", ""))
    if rev_fresh.endswith("-dirty") or not commit.startswith(rev_fresh):
        raise SystemExit(f"same_code: FRESH is a build of {rev_fresh}, not of the run's commit "
                         f"{commit}")
    doc["build_check"] = {
        "library_revision": rev_ran, "same_code_as": rev_fresh,
        "compared": compared, "by": "tools/same_code.py"}
    with open(run_json, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"same_code: {run_json}: build_check recorded")


def self_test(lib, cuobjdump):
    if not shutil.which("objdump"):
        print("same_code self-test: SKIPPED (no objdump)")
        return 77
    data, secs = sections(lib)
    rev = revision_in(data, secs)
    assert rev, f"no revision string in {lib}"
    _, ro_offset, ro_size = secs[".rodata"]
    with tempfile.TemporaryDirectory() as tmp:
        restamped, touched = os.path.join(tmp, "restamped.so"), os.path.join(tmp, "touched.so")
        other = ("0" if rev[0] != "0" else "1") + rev[1:]
        with open(restamped, "wb") as f:
            f.write(data.replace(f"(git {rev})".encode(), f"(git {other})".encode()))
        assert revision(restamped) == other
        diffs, compared, _ = compare(lib, restamped, cuobjdump)
        assert not diffs, f"a copy with another revision differs: {diffs}"
        # One byte of read-only data (away from the revision) changed must be found.
        rev_at = data.find(rev.encode(), ro_offset)
        at = ro_offset if rev_at - ro_offset > 64 else ro_offset + ro_size - 1
        with open(touched, "wb") as f:
            f.write(data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1:])
        diffs, _, _ = compare(lib, touched, None)  # the kernels are the first copy's
        assert any(".rodata" in d for d in diffs), f"a changed byte went unseen: {diffs}"
    print(f"same_code self-test: ok ({'; '.join(compared)})")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ran", help="the library a run loaded (or, with --self-test, any build)")
    ap.add_argument("fresh", nargs="?", help="a build of the run's commit")
    ap.add_argument("--stamp", metavar="RUN.json", help="record the check in this run")
    ap.add_argument("--cuobjdump", help="cuobjdump to use")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump(args.cuobjdump, required=False)
    if args.self_test:
        return self_test(args.ran, cuobjdump)
    if not args.fresh:
        ap.error("FRESH is required")
    diffs, compared, revisions = compare(args.ran, args.fresh, cuobjdump)
    print("revisions: %s / %s" % revisions)
    print("compared: " + "; ".join(compared))
    for d in diffs:
        print("DIFFERS: " + d)
    if diffs:
        return 1
    print("same code")
    if args.stamp:
        stamp(args.stamp, revisions, compared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
