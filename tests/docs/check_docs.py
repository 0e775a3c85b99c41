#!/usr/bin/env python3
"""The tree reads as a product: checks the documentation, sources and comments for

  journal    the vocabulary of a lab notebook (session/run/round/call N, leases, "we tried", ...);
  link       Markdown links to files of the repository that do not exist (and anchors that no
             heading of the target file makes);
  path       repository paths (src/..., tools/..., docs/..., backticked or not) that do not exist;
  machine    absolute paths into a machine's own folders (MACHINE_ROOTS: work, tmp, root, home).

It scans the text files of README.md, CHANGELOG.md, CONTRIBUTING.md, docs/, include/, src/,
bindings/, examples/, bench/, tools/ and tests/ (this file excepted), as git lists them (tracked and
untracked, ignored files left out), else by walking those folders.

    python3 tests/docs/check_docs.py [--root DIR]
    python3 tests/docs/check_docs.py --self-test

Exit status: 0 clean, 1 findings (each printed as path:line: kind: text).
"""
import argparse
import os
import re
import subprocess
import sys

SCANNED = ("README.md", "CHANGELOG.md", "CONTRIBUTING.md", "docs", "include", "src", "bindings",
           "examples", "bench", "tools", "tests")
SELF = "tests/docs/check_docs.py"
TEXT_SUFFIXES = (".md", ".txt", ".py", ".sh", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh",
                 ".cmake", ".rs", ".java", ".i", ".toml", ".json", ".in", ".map", ".def", ".cfg",
                 ".ini", ".yml", ".yaml")
SKIP_PARTS = {".git", "__pycache__", "target", ".pytest_cache", "node_modules"}
SKIP_NAMES = {"Cargo.lock"}
# Top-level folders whose paths are checked for existence.
REPO_DIRS = ("src", "tools", "docs", "bench", "tests", "include", "bindings", "examples", "scripts",
             "cmake", "dev")

# Journal vocabulary: what happened when, instead of what is. Tuned to leave ordinary text alone
# ("runs 8 k-steps", "one call per rank", "a session of training" do not match).
JOURNAL = [
    (re.compile(r"\b(?:[Ss]essions?|[Rr]ounds?|[Cc]alls?)[ -]\d+(?:[a-z]\b|\b)"),
     "session/round/call N"),
    (re.compile(r"\b[Rr]un \d+[a-z]?\b(?! (?:times|ranks?|threads?|warps?|k-steps?|steps?|"
                r"repetitions|configurations|processes|GPUs?|CTAs?|tiles?|rows?|columns?|"
                r"cases?|tests?|iterations?|seconds?|minutes?|ms)\b)|\b[Rr]uns \d+[–-]\d+"),
     "run N"),
    (re.compile(r"\bs\d{1,2}-[a-z]"), "session tag"),
    (re.compile(r"\bleases?\b|\bleased\b", re.I), "lease"),
    (re.compile(r"\b(?:what )?we tried\b|\bwe have tried\b", re.I), "we tried"),
    (re.compile(r"\bdevice calls?\b", re.I), "device call"),
    (re.compile(r"\bworkshops?\b", re.I), "workshop"),
    (re.compile(r"\bpatches/|[\w-]{3,}\.patch\b"), "patch file"),
    (re.compile(r"\b(?:[Ss]ince|[Aa]fter|[Uu]ntil|[Bb]efore|at|in|from) v\d{1,2}\b(?!\.)|"
                r"\bv\d{1,2}'s\b|\s\(v\d{1,2}[,;)]|\bprobe v\d+"), "kernel version history"),
    (re.compile(r"\bnext session\b|\bthis session\b|\bearlier session\b", re.I), "session"),
]

MACHINE_ROOTS = ("work", "tmp", "root", "home")
MACHINE = re.compile(r"(?<![\w.~$/-])/(?:%s)/[\w.-]+" % "|".join(MACHINE_ROOTS))
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REPO_PATH = re.compile(r"(?<![\w/.$-])(?:%s)/[\w./*{},<>@+-]*" % "|".join(REPO_DIRS))
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def list_files(root):
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others",
                              "--exclude-standard", "-z", "--"] + list(SCANNED),
                             capture_output=True, check=True).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for top in SCANNED:
            path = os.path.join(root, top)
            if os.path.isfile(path):
                files.append(top)
            for base, dirs, names in os.walk(path):
                dirs[:] = [d for d in dirs if d not in SKIP_PARTS and not d.startswith("build")]
                for name in names:
                    files.append(os.path.relpath(os.path.join(base, name), root))
    keep = []
    for f in sorted(set(files)):
        f = f.replace(os.sep, "/")
        parts = f.split("/")
        if f == SELF or parts[-1] in SKIP_NAMES or SKIP_PARTS.intersection(parts):
            continue
        if not (f.endswith(TEXT_SUFFIXES) or parts[-1] == "CMakeLists.txt"):
            continue
        if os.path.isfile(os.path.join(root, f)):
            keep.append(f)
    return keep


def slug(heading):
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces -> '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


_anchor_cache = {}


def anchors(path):
    if path not in _anchor_cache:
        found, seen, fence = set(), {}, False
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lstrip().startswith("```"):
                    fence = not fence
                    continue
                m = None if fence else HEADING.match(line)
                if m:
                    base = slug(m.group(2))
                    n = seen.get(base, 0)
                    seen[base] = n + 1
                    found.add(base if n == 0 else f"{base}-{n}")
                for a in re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line):
                    found.add(a)
        _anchor_cache[path] = found
    return _anchor_cache[path]


def expand(path):
    """Brace alternatives: docs/{a,b}.md -> docs/a.md, docs/b.md."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in expand(path[:m.start()] + alt + path[m.end():])]


def repo_path_ok(root, here, token):
    token = token.rstrip(".,;:)]'\"")
    token = token.split("@", 1)[0]  # path@commit names an old version: the path must exist now
    if any(c in token for c in "*<>") or "..." in token:
        return True  # a pattern or a placeholder, not one file
    token = re.sub(r":\d+(?:-\d+)?$", "", token)  # path:line
    # From the repository's root, or (a README's `src/...`) from the folder of the file naming it.
    return all(os.path.exists(os.path.join(root, p.rstrip("/"))) or
               os.path.exists(os.path.join(here, p.rstrip("/"))) for p in expand(token))


def check_text(root, rel, text):
    """Findings (line number, kind, text) of one file."""
    findings = []
    is_md = rel.endswith(".md")
    fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if is_md and line.lstrip().startswith("```"):
            fence = not fence
        for pattern, kind in JOURNAL:
            m = pattern.search(line)
            if m:
                findings.append((number, "journal", f"{kind}: {m.group(0)!r}"))
        m = MACHINE.search(line)
        if m:
            findings.append((number, "machine", m.group(0)))
        if is_md and not fence:
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                base = os.path.dirname(os.path.join(root, rel))
                dest = os.path.normpath(os.path.join(base, file_part)) if file_part else \
                    os.path.join(root, rel)
                if not os.path.exists(dest):
                    findings.append((number, "link", target))
                elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                    findings.append((number, "link", f"{target} (no such heading)"))
        for token in REPO_PATH.findall(line):
            if not repo_path_ok(root, os.path.dirname(os.path.join(root, rel)), token):
                findings.append((number, "path", token.rstrip(".,;:)]'\"")))
    return findings


def run(root):
    total = 0
    for rel in list_files(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        for number, kind, what in check_text(root, rel, text):
            print(f"{rel}:{number}: {kind}: {what}")
            total += 1
    return total


def self_test():
    import tempfile
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "docs"))
        os.makedirs(os.path.join(root, "src", "cpu"))
        with open(os.path.join(root, "docs", "a.md"), "w") as f:
            f.write("# Title\n\n## How it is measured\n")
        with open(os.path.join(root, "src", "cpu", "x.cpp"), "w") as f:
            f.write("")
        must_find = {
            "as measured in session 12": "journal",
            "Run 17 against run 16": "journal",
            "(call 5, after run 15)": "journal",
            "Runs 14–16 had the same bytes": "journal",
            "round 13's producer share": "journal",
            "a short lease of a machine": "journal",
            "what we tried first": "journal",
            "one device call": "journal",
            "the dev/cuda workshop": "journal",
            "b1-four-epilogue-warps.patch": "journal",
            "Since v18 the loop is leaner": "journal",
            "after v15's leaner main loop": "journal",
            "staged (v10, v11: B3 faster)": "journal",
            "s14-lean-band.txt": "journal",
            "see [b](docs/missing.md)": "link",
            "see [a](a.md#nowhere)": "link",
            "`src/cuda/gone.cu`": "path",
            "dev/cuda/sm90_gather_gemm.cu@92ab1fc": "path",
            **{f"see /{root}/out/bench": "machine" for root in MACHINE_ROOTS},
        }
        must_pass = [
            "The CUDA suite runs 8 k-steps a tile and runs 4 warps.",
            "one call per rank; each call returns a status",
            "the backward runs 2 GEMMs",
            "a training session, a round of the reduction, round-to-nearest-even",
            "see [a](a.md#how-it-is-measured) and [web](https://example.com/x)",
            "`src/cpu/x.cpp`, src/cpu/, `src/cuda/engines/<name>/`, `bench/results/*.png`",
            "python3 src/cpu/x.cpp > /dev/null; build/docs/api/html; $HOME/.cargo",
            "MOEBLAZE_NCCL_LIBRARY=/nonexistent/libnccl.so.2 and usr/tmp/x",
            "checkpoint policies: round trip",
            "NCCL version v.patch = code % 100; c.patch",
            "v0 = round_to<T>(v0); f(v1, v2);",
            "done; v0 (ABI 0); first published in v0.1; not planned for v0; from v0.1.0 on",
        ]
        failed = False
        for text, kind in must_find.items():
            rel = "docs/a.md" if kind == "link" else "docs/t.md"
            kinds = {k for _, k, _ in check_text(root, rel, text)}
            if kind not in kinds:
                print(f"self-test: not caught ({kind}): {text!r}")
                failed = True
        for text in must_pass:
            found = check_text(root, "docs/a.md", text)
            if found:
                print(f"self-test: false positive on {text!r}: {found}")
                failed = True
    print("check_docs self-test:", "FAILED" if failed else "ok")
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    root = os.path.abspath(args.root)
    total = run(root)
    if total == 0:
        print("check_docs: the tree: clean")
        return 0
    print(f"check_docs: the tree: {total} finding(s)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
