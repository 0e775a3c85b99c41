#!/usr/bin/env bash
# One device call: the library's per-kernel times (tests/cuda/profile_kernels.py) at the working
# tree against a BEFORE version of some source files, side by side in one process run each, after
# the working tree's CUDA tests and sanitizers (tools/device_check.sh).
#   AB_DIR=.ab bash dev/cuda/run_library_ab.sh   (carry .deps and AB_DIR; ~5-6 minutes)
# AB_DIR holds the BEFORE files by name (f1_gemm.cu, rows_gemm.cu, primitives.cuh, ...: each is
# copied over src/cuda/sm90/<name> in a copy of the tree), and other BEFORE sources under
# AB_DIR/src/ by their path below src/ (AB_DIR/src/cuda/experts.cu). Logs under $OUT, the table last.
# Shapes: PROFILE_SHAPES, one "name|profile_kernels.py arguments" per line (dev/cuda/shape_args.py
# --lines writes them from bench/configs.json). AB_DIR=none: no BEFORE
# build, the working tree's per-kernel times alone. AB_DIR=env: no BEFORE build either; BEFORE and
# AFTER are the working tree's library run under the environment assignments in BEFORE_ENV and
# AFTER_ENV (e.g. BEFORE_ENV=MOEBLAZE_CUDA_B1_FORM=warps AFTER_ENV=MOEBLAZE_CUDA_B1_FORM=split).
# AB_DIR=prebuilt: the BEFORE library is already built in /tmp/moeblaze_before/build-before.
set -u -o pipefail
out="${OUT:-./library_ab_out}"
mkdir -p "$out"
ab="${AB_DIR:-.ab}"
root="$(pwd)"
if [ "${CHECK:-1}" = 1 ]; then
  OUT="$out/check" bash tools/device_check.sh --no-bench --no-sass --no-profile 2>&1 | tail -12
else
  cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_CUDA=ON \
    "-DMOEBLAZE_CUDA_ARCHS=90a" -DMOEBLAZE_BUILD_EXAMPLES=OFF >"$out/build_new.log" 2>&1 &&
    cmake --build build-device -j 16 --target moeblaze >>"$out/build_new.log" 2>&1 ||
    { tail -20 "$out/build_new.log"; exit 1; }
fi
before=/tmp/moeblaze_before
if [ "$ab" != none ] && [ "$ab" != env ] && [ "$ab" != prebuilt ]; then
  rm -rf "$before" && mkdir -p "$before"
  tar --exclude=./build-device --exclude=./.git -cf - . | tar -xf - -C "$before"
  # Plain files: sm90 sources by name; a src/ subtree: copied over src/ path by path.
  for f in "$ab"/*; do [ -f "$f" ] && cp "$f" "$before/src/cuda/sm90/$(basename "$f")"; done
  [ -d "$ab/src" ] && cp -r "$ab/src/." "$before/src/"
  (cd "$before" && cmake -S . -B build-before -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DMOEBLAZE_CUDA=ON "-DMOEBLAZE_CUDA_ARCHS=90a" -DMOEBLAZE_BUILD_EXAMPLES=OFF \
    -DMOEBLAZE_BUILD_TESTS=OFF >"$out/build_before.log" 2>&1 &&
    cmake --build build-before -j 16 --target moeblaze >>"$out/build_before.log" 2>&1) ||
    { tail -20 "$out/build_before.log"; exit 1; }
fi
# Default shapes from bench/configs.json (dev/cuda/shape_args.py NAME:ACT[:EXTRA] makes such lines).
shapes="${PROFILE_SHAPES:-$(python3 dev/cuda/shape_args.py --lines conf3:swiglu conf3:silu \
  mixtral:swiglu qwen3-30b-a3b:swiglu)}"
[ -n "$shapes" ] || { echo "no shapes to profile" >&2; exit 2; }
: >"$out/profile.log"
profile_failures=0
while IFS='|' read -r name args; do
  for which in before after; do
    [ "$which" = before ] && [ "$ab" = none ] && continue
    lib="$root/build-device/src/libmoeblaze.so"
    assignments=""
    if [ "$ab" = env ]; then
      assignments="${AFTER_ENV:-}"
      [ "$which" = before ] && assignments="${BEFORE_ENV:-}"
    elif [ "$which" = before ]; then
      lib="$before/build-before/src/libmoeblaze.so"
    fi
    { echo "=== $name $which"; echo "environment: ${assignments:-(none)}"; } >>"$out/profile.log"
    # shellcheck disable=SC2086  # args and assignments split on purpose
    env $assignments MOEBLAZE_LIBRARY="$lib" timeout 120 python3 tests/cuda/profile_kernels.py \
      $args --rows 12 >>"$out/profile.log" 2>&1 ||
      { echo "profile failed: $name $which (exit $?)"; profile_failures=$((profile_failures + 1)); }
  done
done <<<"$shapes"
echo "== per-kernel CUDA time (ms a step, every call), before -> after"
python3 - "$out/profile.log" <<'PY'
import re, sys
sys.path.insert(0, "tools")
from kernel_tags import kernel_tag
blocks = re.split(r"^=== (.+)$", open(sys.argv[1]).read(), flags=re.M)[1:]
res = {}
for head, body in zip(blocks[::2], blocks[1::2]):
    name, which = head.rsplit(" ", 1)
    k = {}
    for line in body.splitlines():
        mm = re.search(r"fwd\+bwd ([\d.]+) ms, ([\d.]+) TFLOP/s", line)
        if mm:
            k["fwd+bwd"] = float(mm.group(1))
        tag = kernel_tag(line)
        if tag is not None:
            cols = [c for c in re.split(r"\s{2,}", line.strip()) if c]
            # torch.profiler table: name, self cpu %, self cpu, cpu total %, cpu total,
            # cpu time avg, self cuda, self cuda %, cuda total, cuda time avg, # calls. Self CUDA
            # is the step's total over every call (B1/B2 run once per column chunk of h), summed
            # over the kernel's instances with the same tag.
            times = [c for c in cols if re.fullmatch(r"[\d.]+(ms|us)", c)]
            if len(times) >= 6:
                v = times[-3]
                k[tag] = k.get(tag, 0.0) + float(v[:-2]) / (1000.0 if v.endswith("us") else 1.0)
    res.setdefault(name, {})[which] = k
tags = ["F1", "F2", "B1", "B4", "B2", "B3", "fwd+bwd"]
print("%-22s %s" % ("shape", " ".join("%17s" % t for t in tags)))
for name, d in res.items():
    b, a = d.get("before", {}), d.get("after", {})
    print("%-22s %s" % (name, " ".join("%7s->%-7s" % (("%.2f" % b[t]) if t in b else "-",
                                                     ("%.2f" % a[t]) if t in a else "-")
                                       for t in tags)))
PY
[ "$profile_failures" = 0 ] || exit 1
